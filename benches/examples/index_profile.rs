//! One subject of `--bench peers` alone, for a profiler or an instruction counter: builds
//! kvroute's precise store from the peers workload (`PeerWorkload`, seed 7, as the bench) and
//! runs lookups of its 64 probes, printing apply M blocks/s (best of `RUNS` builds, process
//! CPU time), bytes per membership and µs per lookup (thread CPU time).
//!
//! ```text
//! cargo build --release -p kvroute-benches --example index_profile
//! W=512 PART=find RUNS=1 ITERS=100000 CLOCK=none valgrind --tool=cachegrind --cache-sim=no \
//!     target/release/examples/index_profile
//! ```
//!
//! `CLOCK=none` reads no clock (the times print as 0): under valgrind, rustix's lookup of the
//! vDSO behind the CPU-time clocks faults.
//!
//! Environment: `W` endpoints (64 or 512; default 64), `PART` (`apply`: builds only; `find`:
//! one build, then lookups; `worst`: one build, printing its highest bytes per membership from a
//! tenth of the build on; `churn`: one build, then fresh chains at capacity, the steady state of
//! eviction, deletion and compaction, timing its second half; `peer-churn`: the peers bench's
//! churn, conversations removed and stored after a build; `pause`: the longest store call of a
//! build growing from empty and of one with its final size reserved; default apply and find), `RUNS` builds (default 5; `find`: 1), `ITERS`
//! lookups (default 2,000,000), `STATS` (with `find`: first prints each probe's matching
//! endpoints and their distinct match lengths).
#![allow(clippy::print_stdout)]

use std::hint::black_box;
use std::time::Duration;

use kvroute::{MatchScratch, MatchWeights, Medium, PrefixIndex, PrefixMatch, TierWeights};
use kvroute_benches::indexload::WorkloadShape;
use kvroute_benches::peerload::PeerWorkload;
use kvroute_benches::timing::{cpu_time, thread_cpu_time};

fn env(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// A clock reading.
type Clock = fn() -> Duration;

/// The process's and the thread's CPU time, or zero with `CLOCK=none`.
fn clocks() -> (Clock, Clock) {
    if std::env::var("CLOCK").is_ok_and(|c| c == "none") {
        (|| Duration::ZERO, || Duration::ZERO)
    } else {
        (cpu_time, thread_cpu_time)
    }
}

fn main() {
    let (cpu_time, thread_cpu_time) = clocks();
    let w = env("W").unwrap_or(64);
    let part = std::env::var("PART").unwrap_or_default();
    let shape = WorkloadShape::for_endpoints(w);
    let wl = PeerWorkload::generate(&shape, 7, 64);
    let build = || {
        let mut ix = PrefixIndex::new(0, shape.capacity_per_endpoint);
        for e in 0..w {
            ix.activate(e);
        }
        for ev in &wl.events {
            let (e, _, _, keys) = wl.event(ev);
            ix.store(keys, e, Medium::Gpu);
        }
        ix
    };
    if part == "worst" {
        // Bytes per membership after every event, from a tenth of the build on: the worst
        // point (just after a growth of the table or the arena) and where it was.
        let mut ix = PrefixIndex::new(0, shape.capacity_per_endpoint);
        for e in 0..w {
            ix.activate(e);
        }
        let (mut stored, mut worst, mut at) = (0u64, 0.0f64, 0u64);
        for ev in &wl.events {
            let (e, _, _, keys) = wl.event(ev);
            ix.store(keys, e, Medium::Gpu);
            stored += keys.len() as u64;
            if stored * 10 >= wl.memberships() {
                let per = ix.stats().memory_bytes as f64 / stored as f64;
                if per > worst {
                    (worst, at) = (per, stored);
                }
            }
        }
        println!("W={w} worst {worst:.2} B/membership at {at} of {} memberships", wl.memberships());
        return;
    }
    if part == "pause" {
        // The store's pauses: one build timing each store call (thread CPU time), once growing
        // from empty and once with room for the final block count reserved first
        // (`PrefixIndex::reserve`); prints the longest call and the 99.9th percentile.
        let blocks = usize::try_from(build().stats().keys).unwrap_or(usize::MAX);
        for reserve in [0, blocks] {
            let mut ix = PrefixIndex::new(0, shape.capacity_per_endpoint);
            if let Err(e) = ix.reserve(reserve) {
                println!("W={w}: no memory for {reserve} blocks: {e}");
                return;
            }
            for e in 0..w {
                ix.activate(e);
            }
            let mut calls: Vec<Duration> = wl
                .events
                .iter()
                .map(|ev| {
                    let (e, _, _, keys) = wl.event(ev);
                    let t = thread_cpu_time();
                    ix.store(keys, e, Medium::Gpu);
                    thread_cpu_time().saturating_sub(t)
                })
                .collect();
            calls.sort();
            let q = |f: f64| calls[((calls.len() - 1) as f64 * f) as usize].as_secs_f64() * 1e6;
            println!(
                "W={w} reserved {reserve} blocks: {} store calls, longest {:.0} µs, p99.9 {:.1} µs, median {:.2} µs",
                calls.len(),
                q(1.0),
                q(0.999),
                q(0.5)
            );
        }
        return;
    }
    if part == "peer-churn" {
        // The peers bench's churn: after the build, `Churn` steps of a conversation removed and
        // one stored, `RUNS` times on fresh builds, the best time printed.
        let churn = wl.churn(4096, 11);
        let removals: Vec<(usize, Vec<u64>)> = (0..churn.placements.len())
            .map(|k| {
                let (e, removed) = churn.removal(&wl, k);
                (e, removed.collect())
            })
            .collect();
        let mut best = f64::MAX;
        for _ in 0..env("RUNS").unwrap_or(5).max(1) {
            let mut ix = build();
            let t = cpu_time();
            for (k, (e, removed)) in removals.iter().enumerate() {
                ix.remove(removed, *e, Medium::Gpu);
                let (e, _, _, keys) = churn.store(k);
                ix.store(keys, e, Medium::Gpu);
            }
            best = best.min(cpu_time().saturating_sub(t).as_secs_f64());
            black_box(&ix);
        }
        println!("W={w} peer churn {:.2} M blocks/s", churn.blocks(&wl) as f64 / best / 1e6);
        return;
    }
    if part == "churn" {
        // Steady state: the build, then fresh 96-block chains stored round the endpoints until
        // every endpoint has stored twice its capacity (its generations evict, the sweeper
        // deletes, the arena compacts), timing the second half.
        let mut ix = build();
        let chains = 2 * shape.capacity_per_endpoint as usize * w / 96;
        let mut x: u64 = 0x6368_7572_6e00;
        let mut chain = Vec::with_capacity(96);
        let mut t = cpu_time();
        for c in 0..chains {
            if c == chains / 2 {
                t = cpu_time();
            }
            chain.clear();
            chain.extend((0..96).map(|_| {
                x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
                (x ^ (x >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9) | 1
            }));
            ix.store(&chain, c % w, Medium::Gpu);
        }
        let d = cpu_time().saturating_sub(t).as_secs_f64();
        let st = ix.stats();
        println!(
            "W={w} churn {:.2} M blocks/s, {} memberships, {} blocks, {:.2} B/membership",
            (chains - chains / 2) as f64 * 96.0 / d / 1e6,
            st.memberships,
            st.keys,
            st.memory_bytes as f64 / st.memberships as f64
        );
        return;
    }
    let runs = env("RUNS").unwrap_or(if part == "find" { 1 } else { 5 }).max(1);
    let mut best = f64::MAX;
    let mut last = None;
    for _ in 0..runs {
        drop(last.take());
        let t = cpu_time();
        let built = build();
        best = best.min(cpu_time().saturating_sub(t).as_secs_f64());
        last = Some(built);
    }
    let Some(ix) = last else { return };
    let st = ix.stats();
    println!(
        "W={w} apply {:.2} M blocks/s, {} memberships, {} blocks, {:.2} B/membership",
        wl.memberships() as f64 / best / 1e6,
        wl.memberships(),
        st.keys,
        st.memory_bytes as f64 / wl.memberships() as f64
    );
    if part == "apply" {
        return;
    }
    let probes = wl.probe_keys();
    let weights = MatchWeights::new(&TierWeights::default());
    let (mut out, mut scratch) = (PrefixMatch::default(), MatchScratch::default());
    let iters = env("ITERS").unwrap_or(2_000_000).max(1);
    if env("STATS").is_some() {
        for (i, p) in probes.iter().enumerate() {
            ix.match_blocks(p, &weights, &mut out, &mut scratch);
            let held: Vec<u32> = out.blocks().into_iter().filter(|&b| b > 0).collect();
            let mut d = held.clone();
            d.sort_unstable();
            d.dedup();
            println!("probe {i}: {} holders, distinct lengths {:?}", held.len(), &d[..d.len().min(12)]);
        }
    }
    let t = thread_cpu_time();
    for i in 0..iters {
        ix.match_blocks(&probes[i % probes.len()], &weights, &mut out, &mut scratch);
        black_box(&out);
    }
    let d = thread_cpu_time().saturating_sub(t).as_secs_f64();
    println!("W={w} find-matches {:.3} µs per lookup", d / iters as f64 * 1e6);
}
