//! Per-request decision time of the kvroute Envoy filter in the wasmtime host versus the native
//! core, on the same request set.
//!
//! - `native_core`: `Router::route_http` (body + headers) and `Router::complete`, natively.
//! - `filter_in_host`: the whole per-request path of the filter (`kvroute_filter.wasm`, the
//!   `wasm-release` build, compiled by cranelift): stream context creation, request headers
//!   (paused), the body with end of stream (parse, shared-log poll, decision, effect appended to
//!   the shared log, destination headers set), then the end of the stream (`on_done`, `on_log`:
//!   completion appended, context deleted). The host's ABI work (header-map serialization, memory
//!   copies) is included, so this is an upper bound of the in-Envoy cost.
//!
//! Both routers see the same endpoints (4 decode, 2 prefill) with the same metrics, and the same
//! 64 requests (completions and chat, 40..4000 prompt tokens, repeated conversations so the
//! approximate index hits). After criterion's report the bench prints the ratio filter / native
//! from its own interleaved measurement (`cargo bench -p kvroute-wasm-tests --bench
//! filter_vs_core`; the target is at most 2.5x), and the filter's figure with
//! `sync.batch_completions` (completions appended with the next decision's effects).
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvroute::{EndpointSpec, Policy, Role, Router};
use kvroute_wasm_tests::{host, plugin_config, prometheus, vm_config, Host, Pages, VmId};
use serde_json::json;

const ENDPOINTS: [(&str, &str); 6] = [
    ("10.0.0.1:8000", "decode"),
    ("10.0.0.2:8000", "decode"),
    ("10.0.0.3:8000", "decode"),
    ("10.0.0.4:8000", "decode"),
    ("10.0.1.1:8000", "prefill"),
    ("10.0.1.2:8000", "prefill"),
];

fn page(i: usize) -> String {
    prometheus(&json!({"waiting": i % 3, "running": 4, "kv_usage": 0.1 + 0.1 * (i % 4) as f64}))
}

/// The request set: (path, body).
fn requests() -> Vec<(&'static str, Vec<u8>)> {
    let words = |n: usize, seed: usize| -> String {
        (0..n).map(|i| format!("w{}x{} ", (i * 7 + seed) % 997, i % 13)).collect()
    };
    (0..64)
        .map(|i| {
            let conversation = i % 8;
            let len = [40, 150, 600, 1500, 4000][i % 5];
            if i % 2 == 0 {
                let body = json!({"model": "m", "prompt": format!("{}{}", words(len, conversation), words(20, i)), "max_tokens": 100 + i});
                ("/v1/completions", body.to_string().into_bytes())
            } else {
                let body = json!({"model": "m", "messages": [
                    {"role": "system", "content": words(len, conversation)},
                    {"role": "user", "content": words(30, i)}
                ], "max_tokens": 50 + i});
                ("/v1/chat/completions", body.to_string().into_bytes())
            }
        })
        .collect()
}

struct Native {
    router: Router,
    now: u64,
}

impl Native {
    fn new() -> Native {
        let router = Router::new(Policy::default());
        for (i, (id, role)) in ENDPOINTS.iter().enumerate() {
            let role = if *role == "decode" { Role::Decode } else { Role::Prefill };
            router.upsert_endpoint(EndpointSpec::new(*id, role)).unwrap();
            router.update_metrics_from_prometheus(id, &page(i), 0).unwrap();
        }
        Native { router, now: 1 }
    }

    fn one(&mut self, path: &str, body: &[u8]) {
        let headers =
            [(":method", "POST"), (":path", path), (":authority", "llm.local"), ("content-type", "application/json")];
        let d = self.router.route_http(body, headers, self.now).unwrap();
        self.router.complete(&d.request_id).unwrap();
        black_box(&d);
    }
}

struct Filter {
    host: Host,
    vm: VmId,
    /// Whether requests must come out with a destination (the kvroute filter).
    routes: bool,
}

/// A pass-through filter (every callback continues, nothing read or set): what the host's stream
/// handling costs by itself, whatever the filter.
const PASS_THROUGH: &str = r#"(module
  (memory (export "memory") 1)
  (global $heap (mut i32) (i32.const 1024))
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_memory_allocate") (param $n i32) (result i32) (i32.const 1024))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) (i32.const 0))
  (func (export "proxy_on_request_body") (param i32 i32 i32) (result i32) (i32.const 0))
  (func (export "proxy_on_done") (param i32) (result i32) (i32.const 1))
  (func (export "proxy_on_log") (param i32))
  (func (export "proxy_on_delete") (param i32)))"#;

impl Filter {
    fn pass_through() -> Filter {
        let mut host = Host::new().unwrap();
        let plugin = host.compile(PASS_THROUGH).unwrap();
        let vm = host.start_vm(&plugin, kvroute_wasm_tests::VmConfig::new()).unwrap();
        Filter { host, vm, routes: false }
    }
}

impl Filter {
    /// The kvroute filter; `batch`: with `sync.batch_completions` (a completion goes to the shared
    /// log with the next decision's effects, in one claim).
    fn new(batch: bool) -> Filter {
        let pages = Pages::default();
        for (i, (id, _)) in ENDPOINTS.iter().enumerate() {
            pages.always(id, page(i));
        }
        let mut host = host(&pages).unwrap();
        let filter = host.load_kvroute_filter().unwrap();
        // Production settings: no debug header; metrics polled rarely (the clock barely moves).
        let mut extra = json!({"debug_decision_header": false});
        if batch {
            extra["sync"] = json!({"batch_completions": true});
        }
        let cfg = plugin_config(&json!({}), &ENDPOINTS, &extra);
        let vm = host.start_vm(&filter, vm_config(&cfg)).unwrap();
        host.advance(Duration::from_millis(150)).unwrap();
        let mut f = Filter { host, vm, routes: true };
        // Configured and routing (checked outside debug builds too).
        let s = f.host.new_stream(f.vm).unwrap();
        let headers = [(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json")];
        f.host.send_request_headers(s, headers, false).unwrap();
        f.host.send_request_body(s, br#"{"model": "m", "prompt": "hello"}"#, true).unwrap();
        let done = f.host.finish_stream(s).unwrap();
        assert!(done.upstream_headers().is_some_and(|h| h.contains("x-gateway-destination-endpoint")));
        f
    }

    fn one(&mut self, path: &str, body: &[u8]) {
        let s = self.host.new_stream(self.vm).unwrap();
        let headers =
            [(":method", "POST"), (":path", path), (":authority", "llm.local"), ("content-type", "application/json")];
        self.host.send_request_headers(s, headers, false).unwrap();
        self.host.send_request_body(s, body, true).unwrap();
        let done = self.host.finish_stream(s).unwrap();
        black_box(&done);
        debug_assert!(
            !self.routes || done.upstream_headers().is_some_and(|h| h.contains("x-gateway-destination-endpoint"))
        );
    }
}

fn bench(c: &mut Criterion, reqs: &[(&'static str, Vec<u8>)]) {
    let mut g = c.benchmark_group("per_request");
    g.throughput(Throughput::Elements(1));
    let mut native = Native::new();
    let mut i = 0;
    g.bench_function("native_core", |b| {
        b.iter(|| {
            let (p, body) = &reqs[i % reqs.len()];
            i += 1;
            native.one(p, body);
        });
    });
    let mut filter = Filter::new(false);
    let mut j = 0;
    g.bench_function("filter_in_host", |b| {
        b.iter(|| {
            let (p, body) = &reqs[j % reqs.len()];
            j += 1;
            filter.one(p, body);
        });
    });
    let mut floor = Filter::pass_through();
    let mut k = 0;
    g.bench_function("pass_through_in_host", |b| {
        b.iter(|| {
            let (p, body) = &reqs[k % reqs.len()];
            k += 1;
            floor.one(p, body);
        });
    });
    g.finish();
}

/// Interleaved rounds over the whole request set; the best round of each side (least disturbed
/// by other processes): (native, filter, pass-through), and the filter with
/// `sync.batch_completions` (unless `KVROUTE_BENCH_BATCHED=0`).
fn ratio(reqs: &[(&'static str, Vec<u8>)], rounds: usize, reps: usize) -> ([Duration; 3], Option<Duration>) {
    let mut native = Native::new();
    let mut filter = Filter::new(false);
    // `KVROUTE_BENCH_BATCHED=0` leaves it out (a filter build older than the option).
    let mut batched = (std::env::var("KVROUTE_BENCH_BATCHED").as_deref() != Ok("0")).then(|| Filter::new(true));
    let mut floor = Filter::pass_through();
    let (mut best_n, mut best_f, mut best_p, mut best_b) = (Duration::MAX, Duration::MAX, Duration::MAX, Duration::MAX);
    for _ in 0..rounds {
        let t = Instant::now();
        for _ in 0..reps {
            for (p, b) in reqs {
                native.one(p, b);
            }
        }
        best_n = best_n.min(t.elapsed());
        let t = Instant::now();
        for _ in 0..reps {
            for (p, b) in reqs {
                filter.one(p, b);
            }
        }
        best_f = best_f.min(t.elapsed());
        let t = Instant::now();
        for _ in 0..reps {
            for (p, b) in reqs {
                floor.one(p, b);
            }
        }
        best_p = best_p.min(t.elapsed());
        if let Some(batched) = batched.as_mut() {
            let t = Instant::now();
            for _ in 0..reps {
                for (p, b) in reqs {
                    batched.one(p, b);
                }
            }
            best_b = best_b.min(t.elapsed());
        }
    }
    let n = u32::try_from(reps * reqs.len()).unwrap_or(u32::MAX);
    ([best_n / n, best_f / n, best_p / n], batched.is_some().then(|| best_b / n))
}

fn main() {
    let reqs = requests();
    // `cargo bench` passes `--bench`; without it (`cargo test --benches`, or `-- --test`) criterion
    // runs each benchmark once, and the ratio is taken over one round only.
    let test_mode = !std::env::args().any(|a| a == "--bench") || std::env::args().any(|a| a == "--test");
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c, &reqs);
    c.final_summary();
    // `KVROUTE_BENCH_ROUNDS` raises the number of rounds on a busy machine (the best one counts).
    let rounds = std::env::var("KVROUTE_BENCH_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(7);
    let (rounds, reps) = if test_mode { (1, 1) } else { (rounds, 20) };
    let ([n, f, p], b) = ratio(&reqs, rounds, reps);
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    if test_mode {
        // One round, and in `cargo test` an unoptimized build: the run shows the paths work.
        println!("test mode: no measurement (run `cargo bench -p kvroute-wasm-tests --bench filter_vs_core`)");
        return;
    }
    println!(
        "per request over {} requests: native core {:.1} µs, filter in host {:.1} µs, ratio {:.2}x (target <= 2.5x); \
         the host's own stream handling (pass-through filter) {:.1} µs, filter without it {:.1} µs, ratio {:.2}x",
        reqs.len(),
        us(n),
        us(f),
        f.as_secs_f64() / n.as_secs_f64(),
        us(p),
        us(f.saturating_sub(p)),
        f.saturating_sub(p).as_secs_f64() / n.as_secs_f64()
    );
    let Some(b) = b else { return };
    println!(
        "with sync.batch_completions: filter in host {:.1} µs, ratio {:.2}x; without the host's stream handling {:.1} µs, ratio {:.2}x",
        us(b),
        b.as_secs_f64() / n.as_secs_f64(),
        us(b.saturating_sub(p)),
        b.saturating_sub(p).as_secs_f64() / n.as_secs_f64()
    );
}
