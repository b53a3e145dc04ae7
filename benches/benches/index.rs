//! Approximate index: insert (observe) and lookup (longest prefix per endpoint) on a workload with
//! shared prefixes, at W = 64 and 512 endpoints.
//!
//! Run: `cargo bench -p kvroute-benches --bench index`. Bytes per membership of the same
//! workload are printed before the timings (and bounded by `benches/tests/index_memory.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute::{ApproxIndex, RequestKeys};
use kvroute::{MatchScratch, MatchWeights, PrefixMatch};
use kvroute_benches::indexload::{IndexWorkload, WorkloadShape};

fn bench_index(c: &mut Criterion) {
    let mut g = c.benchmark_group("approx_index");
    for w in [64usize, 512] {
        let shape = WorkloadShape::for_endpoints(w);
        let wl = IndexWorkload::generate(&shape, 7);
        let mut ix = ApproxIndex::new(0, shape.capacity_per_endpoint);
        wl.fill(&mut ix);
        let st = ix.stats();
        eprintln!(
            "W={w}: {} memberships, {} keys, {} bytes = {:.2} bytes per membership",
            st.memberships,
            st.keys,
            st.memory_bytes,
            st.memory_bytes as f64 / st.memberships as f64
        );
        let probe = wl.probe_keys();
        let mut keys = RequestKeys { block_tokens: 64, ..Default::default() };
        keys.seq_starts.push(0);
        keys.keys.extend_from_slice(&probe);
        let weights = MatchWeights::new(&kvroute::TierWeights::default());
        let mut out = PrefixMatch::default();
        let mut scratch = MatchScratch::default();
        ix.match_blocks(&keys, &weights, &mut out, &mut scratch);
        let best = out.blocks().into_iter().max().unwrap_or(0);
        assert!(best > 0, "the probe shares a prefix with the index");

        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("match_blocks", w), |b| {
            b.iter(|| {
                ix.match_blocks(black_box(&keys), &weights, &mut out, &mut scratch);
                out.slots().len()
            });
        });

        let fresh = wl.fresh_sequences(4096);
        let blocks = fresh[0].len() as u64;
        g.throughput(Throughput::Elements(blocks));
        let mut i = 0usize;
        g.bench_function(BenchmarkId::new("observe_sequence", w), |b| {
            b.iter(|| {
                let seq = &fresh[i % fresh.len()];
                ix.observe(black_box(seq), i % w);
                i += 1;
            });
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50).measurement_time(std::time::Duration::from_secs(4));
    targets = bench_index
}
criterion_main!(benches);
