//! Router replicas (sans-IO): what replication costs a decision, and how fast another replica's
//! batches apply.
//!
//! Run: `cargo bench -p kvroute-benches --bench replica`. 64 decode endpoints; requests of 2,048
//! and 8,192 tokens (32 and 128 blocks of approximate keys). Benches:
//! - `route/{off,on}`: one `route()` with replication off and on (on: the effect is encoded and
//!   queued in the outbox, and every 512 decisions the outbox is drained into batches, untimed
//!   for the `take` part: see the next bench);
//! - `take_512`: encoding the queued entries of 512 decisions into batches (`take_replica_batch`);
//! - `apply_512`: applying those batches on another replica (decode + judge + approximate index
//!   observe + in flight + session), on a fresh replica each iteration (setup untimed).
//!
//! Criterion reports throughput in effects per second (`elem/s`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvroute::{EndpointSpec, Policy, ReplicaConfig, Role, RouteRequest, RouterCore};

const ENDPOINTS: usize = 64;
const N: usize = 512;

fn core(id: &str) -> RouterCore {
    let mut c = RouterCore::new(Policy::default());
    for i in 0..ENDPOINTS {
        c.upsert_endpoint(EndpointSpec::new(format!("10.0.{}.{}:8000", i / 200, i % 200 + 1), Role::Decode)).unwrap();
    }
    c.enable_replication(ReplicaConfig { max_outbox_entries: 1 << 20, ..ReplicaConfig::new("bench", id, 1) }).unwrap();
    c
}

/// `n` requests of `tokens` tokens (4 bytes each): 16 shared system prompts, distinct tails.
fn requests(n: usize, tokens: usize) -> Vec<RouteRequest> {
    (0..n)
        .map(|i| {
            let head = format!("system prompt {} ", i % 16).repeat(tokens * 4 / 2 / 16);
            let tail = format!("user {i} asks ").repeat(tokens * 4 / 2 / 14);
            RouteRequest::text("m", &format!("{head}{tail}"))
        })
        .collect()
}

/// The batches 512 decisions of replica `a` produced.
fn batches(reqs: &[RouteRequest]) -> Vec<Vec<u8>> {
    let mut a = core("a");
    for (i, r) in reqs.iter().enumerate() {
        let d = a.route(r, i as u64).unwrap();
        a.complete(&d.request_id).unwrap();
    }
    std::iter::from_fn(|| a.take_replica_batch(1_000, false)).collect()
}

fn bench(c: &mut Criterion) {
    for tokens in [2048usize, 8192] {
        let reqs = requests(N, tokens);
        let mut g = c.benchmark_group(format!("replica/{tokens}_tokens"));
        g.throughput(Throughput::Elements(1));
        for on in [false, true] {
            let mut r = core("a");
            if !on {
                r.disable_replication();
            }
            let mut i = 0usize;
            g.bench_function(if on { "route/on" } else { "route/off" }, |b| {
                b.iter(|| {
                    let d = r.route(&reqs[i % N], i as u64).unwrap();
                    r.complete(&d.request_id).unwrap();
                    i += 1;
                    if i % N == 0 {
                        while r.take_replica_batch(i as u64, false).is_some() {}
                    }
                    black_box(d.prefix_hit)
                });
            });
        }
        g.throughput(Throughput::Elements(N as u64));
        g.bench_function("take_512", |b| {
            b.iter_batched(
                || {
                    let mut a = core("a");
                    for (i, r) in reqs.iter().enumerate() {
                        a.route(r, i as u64).unwrap();
                    }
                    a
                },
                |mut a| {
                    let mut n = 0;
                    while let Some(b) = a.take_replica_batch(1_000, false) {
                        n += b.len();
                    }
                    black_box(n)
                },
                BatchSize::LargeInput,
            );
        });
        let bs = batches(&reqs);
        let bytes: usize = bs.iter().map(Vec::len).sum();
        eprintln!(
            "replica/{tokens}_tokens: {} batches, {bytes} bytes for {N} effects + {N} completions ({:.0} bytes per decision)",
            bs.len(),
            bytes as f64 / N as f64
        );
        g.bench_function("apply_512", |b| {
            b.iter_batched(
                || core("b"),
                |mut b| {
                    for x in &bs {
                        b.apply_replica_bytes(x, 2_000).unwrap();
                    }
                    black_box(b.stats().inflight_requests)
                },
                BatchSize::LargeInput,
            );
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
