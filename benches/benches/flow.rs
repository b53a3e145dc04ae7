//! Flow control: the cost of one enqueue + one dispatch with 10,000 requests queued across 1,000
//! flows (10 each), per fairness policy.
//!
//! Run: `cargo bench -p kvroute-benches --bench flow`. A `RouterCore` with 8 decode endpoints
//! and the concurrency detector at one request per endpoint is filled with 8 requests in flight
//! and 10,000 queued. Each iteration then (untimed) completes the oldest request in flight, and
//! (timed) admits a new request of the next flow — `admit` runs the dispatch opportunity first,
//! which releases one queued request into the freed slot, and queues the new one behind the
//! others — and takes the release (`take_releases_into`); (untimed) the released request is
//! routed. The queue stays at 10,000. The timed part is measured per iteration with
//! `Instant` (its own cost, ~20–40 ns, is included: the figure is an upper bound).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kvroute::{Admission, EndpointSpec, Policy, Release, ReleaseOutcome, Role, RouteRequest, RouterCore};

const FLOWS: usize = 1_000;
const QUEUED: usize = 10_000;
const ENDPOINTS: usize = 8;

struct Bench {
    core: RouterCore,
    reqs: Vec<RouteRequest>,
    inflight: VecDeque<String>,
    releases: Vec<Release>,
    now: u64,
    next: usize,
}

fn setup(fairness: &str, ordering: &str) -> Bench {
    let policy = serde_json::json!({"flow_control": {
        "enabled": true,
        "max_requests": 100_000,
        "saturation_detector": {"kind": "concurrency", "max_requests_per_endpoint": 1},
        "default_priority_band": {"fairness_policy": fairness, "ordering_policy": ordering},
    }});
    let mut core = RouterCore::new(Policy::from_json(&policy.to_string()).unwrap());
    for i in 0..ENDPOINTS {
        core.upsert_endpoint(EndpointSpec::new(format!("10.0.0.{}:8000", i + 1), Role::Decode)).unwrap();
    }
    let cfg = core.policy().policy.config().request.clone();
    let reqs: Vec<RouteRequest> = (0..FLOWS)
        .map(|f| {
            let id = format!("tenant-{f}");
            let slo = format!("{}", 100 + (f * 37) % 5000);
            let headers = [("x-llm-d-inference-fairness-id", id.as_str()), ("x-llm-d-slo-ttft-ms", slo.as_str())];
            let body = format!(r#"{{"model":"m","prompt":"request of tenant {f}","max_tokens":64}}"#);
            RouteRequest::parse(body.as_bytes(), headers, &cfg).unwrap()
        })
        .collect();
    let mut b = Bench { core, reqs, inflight: VecDeque::new(), releases: Vec::new(), now: 1_000, next: 0 };
    for i in 0..ENDPOINTS {
        assert_eq!(b.core.admit(&b.reqs[i], 100, b.now), Admission::Admit);
        b.inflight.push_back(b.core.route(&b.reqs[i], b.now).unwrap().request_id);
    }
    for i in 0..QUEUED {
        let a = b.core.admit(&b.reqs[i % FLOWS], 100, b.now);
        assert!(matches!(a, Admission::Queued(_)), "{a:?}");
    }
    assert_eq!(b.core.flow_stats().queued, QUEUED as u64);
    b
}

impl Bench {
    /// One iteration; returns the time of the enqueue + dispatch.
    fn step(&mut self) -> Duration {
        let id = self.inflight.pop_front().unwrap();
        self.core.complete(&id).unwrap();
        self.now += 1;
        let r = &self.reqs[self.next % FLOWS];
        self.next += 1;
        self.releases.clear();
        let t = Instant::now();
        let a = self.core.admit(r, 100, self.now);
        self.core.take_releases_into(self.now, &mut self.releases);
        let took = t.elapsed();
        black_box(a);
        debug_assert!(matches!(a, Admission::Queued(_)));
        debug_assert_eq!(self.releases.len(), 1);
        for rel in &self.releases {
            if rel.outcome == ReleaseOutcome::Dispatched {
                let routed = self.core.route(&self.reqs[0], self.now).unwrap();
                self.inflight.push_back(routed.request_id);
            }
        }
        took
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("flow_enqueue_dispatch_10k_queued_1k_flows");
    for (fairness, ordering) in [
        ("round_robin", "fcfs"),
        ("attained_service", "fcfs"),
        ("global_strict", "fcfs"),
        ("round_robin", "slo_deadline"),
    ] {
        let mut b = setup(fairness, ordering);
        g.bench_function(format!("{fairness}_{ordering}"), |bench| {
            bench.iter_custom(|iters| (0..iters).map(|_| b.step()).sum());
        });
        let s = b.core.flow_stats();
        assert_eq!(s.queued, QUEUED as u64, "the queue stays full");
        assert_eq!(s.counters.rejections.total(), 0);
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
