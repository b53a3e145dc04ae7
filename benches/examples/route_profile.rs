//! `--bench route`'s decision alone, for a profiler or an instruction counter: builds the
//! bench's router (`N` decode endpoints, the index warmed by `4 N` earlier 8k-token requests)
//! and makes `ITERS` decisions of its follow-up request (`route()` then `complete()`), printing
//! µs per decision (thread CPU time).
//!
//! ```text
//! cargo build --release -p kvroute-benches --example route_profile
//! N=512 ITERS=2000 CLOCK=none valgrind --tool=callgrind --toggle-collect='*route_profile*decide*' \
//!     target/release/examples/route_profile
//! ```
//!
//! Environment: `N` endpoints (default 512), `ITERS` decisions (default 20,000), `CLOCK=none`
//! (reads no clock, the time prints as 0: under valgrind, rustix's lookup of the vDSO behind
//! the CPU-time clock faults).
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::hint::black_box;
use std::time::Duration;

use kvroute::{Policy, RouteRequest, Router};
use kvroute_benches::fleet::words as text;
use kvroute_benches::timing::thread_cpu_time;

const NOW: u64 = 1_000;
const PROMPT_BYTES: usize = 8192 * 4;

fn env(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The same router and request as `--bench route`.
fn setup(n: usize) -> (Router, RouteRequest) {
    let router = Router::new(Policy::default());
    let ids: Vec<String> = (0..n).map(|i| format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256)).collect();
    kvroute_benches::fleet::add_decode_endpoints(&router, &ids, NOW);
    let systems: Vec<String> = (0..16).map(|t| text(1000 + t, 2048 * 4)).collect();
    let mut warm_ids = Vec::new();
    for r in 0..4 * n {
        let tail = text(r as u64, PROMPT_BYTES - systems[0].len());
        let req = RouteRequest::text("llama", &format!("{}{}", systems[r % 16], tail));
        warm_ids.push(router.route(&req, NOW).unwrap().request_id);
    }
    for id in warm_ids {
        router.complete(&id).unwrap();
    }
    let prior_tail = text(3, PROMPT_BYTES - systems[0].len());
    let prompt = format!("{}{}", systems[3], &prior_tail[..prior_tail.len() - 4096]);
    let prompt = format!("{prompt}{}", text(99, PROMPT_BYTES - prompt.len()));
    (router, RouteRequest::text("llama", &prompt))
}

#[inline(never)]
fn decide(router: &Router, req: &RouteRequest, iters: usize) {
    for _ in 0..iters {
        let d = router.route(black_box(req), NOW).unwrap();
        router.complete(&d.request_id).unwrap();
        black_box(d);
    }
}

fn main() {
    let n = env("N").unwrap_or(512);
    let iters = env("ITERS").unwrap_or(20_000);
    let (router, req) = setup(n);
    decide(&router, &req, 100);
    let clock = || if std::env::var("CLOCK").is_ok_and(|c| c == "none") { Duration::ZERO } else { thread_cpu_time() };
    let t = clock();
    decide(&router, &req, iters);
    let us = clock().saturating_sub(t).as_secs_f64() * 1e6 / iters.max(1) as f64;
    println!("N={n} route() + complete(): {us:.2} µs per decision");
}
