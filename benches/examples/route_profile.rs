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

use kvroute::{RouteRequest, Router};
use kvroute_benches::fleet::{follow_up_prompt, warmed_router};
use kvroute_benches::timing::thread_cpu_time;

const NOW: u64 = 1_000;

fn env(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The same router and request as `--bench route`.
fn setup(n: usize) -> (Router, RouteRequest) {
    let (router, systems) = warmed_router(n, 4 * n, NOW);
    (router, RouteRequest::text("llama", &follow_up_prompt(&systems)))
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
