//! One `Router` shared by several threads (issue 16, "scales with threads"):
//!
//! - **scaling**: `route` + `complete` of pre-parsed 8k-token text requests (approximate index,
//!   64 endpoints, warmed as in `--bench route`, 16 tenants' follow-up turns) on one shared
//!   `Router` from 1, 2, … threads (up to the machine's cores; `KVROUTE_THREADS=1,2,4` to
//!   choose): decisions per second, and the ratio to one thread; the same for 8k-token token-id
//!   requests on the precise index (dual keys, 64 endpoints, 3/4 of each prompt cached). Each
//!   is measured against the same work on a router per thread (nothing shared: what the machine
//!   itself allows, the ceiling on a loaded or small machine);
//! - **lookups under events**: one thread routing + completing 8k-token token-id requests on the
//!   precise index (dual keys, 64 endpoints, fed with 256 conversations' `BlockStored` events)
//!   alone, then while a second thread applies `BlockStored` batches through
//!   `Router::apply_batch` as fast as it can: lookups per second and the slowdown, with the
//!   applier's rate, and the range of the runs' own slowdowns (each run alone and beside the
//!   applier back to back), which shows how far the machine moved the figure; and beside an
//!   applier paced at 8,000 batches/s (a fleet's steady event rate rather than the most one
//!   thread can apply).
//!
//! `KVROUTE_THREADS_PART=scaling` (or `precise-scaling`) runs one scaling part alone, shared
//! router only (e.g. under a profiler); `KVROUTE_THREADS_PART=events` runs the lookups under
//! events alone (each run alone and beside the applier, printed as it goes).
//! Both are timed with `Instant` over fixed operation counts; each figure is the median of
//! `RUNS` runs (the conditions alternate, so machine noise hits both alike). Criterion times one
//! route + complete on the shared router with and without an applier thread. The summary printed
//! at the end carries the issue's goals and the machine's load average (scaling figures on a
//! loaded machine are noisy). Run: `cargo bench -p kvroute-benches --bench threads`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::Criterion;
use kvroute::{BlockStored, EventBatch, KvEvent, Medium, Policy, Prompt};
use kvroute::{RouteRequest, Router};
use kvroute_benches::timing::median;

const NOW: u64 = 1_000;
const W: usize = 64;
/// 8k tokens × 4 bytes per pseudo-token.
const PROMPT_BYTES: usize = 8192 * 4;
const RUNS: usize = 9;
/// The paced applier's rate, batches of 8 blocks per second: 64 engines each publishing a batch
/// every 8 ms or so.
const PACED: f64 = 8_000.0;
/// Decisions per thread per scaling run.
const OPS: usize = 40_000;
/// Lookups per run of the events comparison.
const LOOKUPS: usize = 32_000;
const BLOCK: usize = 16;
const PROMPT_TOKENS: usize = 8192;
const SYSTEM_TOKENS: usize = 2048;
const CONVERSATIONS: usize = 4 * W;
const DUAL: &str = r#"{"index":{"mode":"precise"},"metrics":{"staleness_ms":1000000000000}}"#;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

use kvroute_benches::fleet::words as text;

fn endpoint_id(e: usize) -> String {
    format!("10.0.{}.{}:8000", e / 256, e % 256)
}

fn add_endpoints(router: &Router) -> Vec<String> {
    let ids: Vec<String> = (0..W).map(endpoint_id).collect();
    kvroute_benches::fleet::add_decode_endpoints(router, &ids, NOW);
    ids
}

/// The approximate-index router of the scaling runs (warmed by 256 earlier conversations of 16
/// tenants) and 16 follow-up turns, one per tenant.
fn approx_router() -> (Router, Vec<RouteRequest>) {
    let router = Router::new(Policy::default());
    add_endpoints(&router);
    let systems: Vec<String> = (0..16).map(|t| text(1000 + t, 2048 * 4)).collect();
    let mut warm = Vec::new();
    for r in 0..4 * W {
        let tail = text(r as u64, PROMPT_BYTES - systems[0].len());
        let req = RouteRequest::text("llama", &format!("{}{}", systems[r % 16], tail));
        warm.push(router.route(&req, NOW).unwrap().request_id);
    }
    for id in warm {
        router.complete(&id).unwrap();
    }
    let reqs = (0..16)
        .map(|t| {
            let prior = text(t as u64, PROMPT_BYTES - systems[0].len());
            let p = format!("{}{}", systems[t], &prior[..prior.len() - 4096]);
            RouteRequest::text("llama", &format!("{p}{}", text(99 + t as u64, PROMPT_BYTES - p.len())))
        })
        .collect();
    (router, reqs)
}

fn tokens(stream: u64, n: usize, out: &mut Vec<u32>) {
    let base = splitmix(stream);
    out.extend((0..n as u64).map(|i| (splitmix(base.wrapping_add(i)) % 150_000) as u32));
}

fn stored(tokens: &[u32], hash_base: u64, parent: Option<u64>) -> BlockStored {
    let n = tokens.len() / BLOCK;
    BlockStored {
        block_hashes: (0..n as u64).map(|i| splitmix(hash_base ^ i)).collect(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: BLOCK as u32,
        medium: Medium::Gpu,
        ..Default::default()
    }
}

fn batch(s: BlockStored) -> EventBatch {
    EventBatch { ts: 1.0, events: vec![KvEvent::BlockStored(s)], data_parallel_rank: Some(0) }
}

/// The precise-index router (dual keys) fed with 256 conversations, 16 token-id follow-up turns
/// (3/4 cached on one endpoint), and the applier's batches: 4096 batches of 8 fresh blocks.
/// The applier's batches, each with its endpoint's index.
type Batches = Vec<(usize, EventBatch)>;

fn precise_router() -> (Router, Vec<String>, Vec<RouteRequest>, Batches) {
    let router = Router::from_json(DUAL).unwrap();
    let ids = add_endpoints(&router);
    let systems: Vec<Vec<u32>> = (0..16u64)
        .map(|t| {
            let mut v = Vec::new();
            tokens(0x5157 ^ (t << 32), SYSTEM_TOKENS, &mut v);
            v
        })
        .collect();
    let mut convs = Vec::new();
    for r in 0..CONVERSATIONS {
        let mut toks = systems[r % 16].clone();
        tokens(0xc0 ^ ((r as u64) << 20), PROMPT_TOKENS - SYSTEM_TOKENS, &mut toks);
        router.apply_batch(&ids[r % W], &batch(stored(&toks, (r as u64) << 32, None)), None, NOW).unwrap();
        convs.push(toks);
    }
    let reqs = (0..16)
        .map(|t| {
            let cached = PROMPT_TOKENS * 3 / 4;
            let mut p = convs[t][..cached].to_vec();
            tokens(0xbeef ^ t as u64, PROMPT_TOKENS - cached, &mut p);
            let mut req = RouteRequest::text("llama", "");
            req.prompts = vec![Prompt::Tokens(p)];
            req.max_tokens = Some(256);
            req
        })
        .collect();
    let batches = (0..4096u64)
        .map(|b| {
            let mut t = Vec::new();
            tokens(0xa11 ^ (b << 24), 8 * BLOCK, &mut t);
            ((b as usize) % W, batch(stored(&t, 0xe000_0000_0000 ^ (b << 16), None)))
        })
        .collect();
    (router, ids, reqs, batches)
}

/// `threads` threads each doing `ops` route + complete on `routers[t % routers.len()]`;
/// decisions per second.
fn scaling_run(routers: &[Arc<Router>], reqs: &Arc<Vec<RouteRequest>>, threads: usize, ops: usize) -> f64 {
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (router, reqs, barrier) = (routers[t % routers.len()].clone(), reqs.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..ops {
                    let req = &reqs[(i * 7 + t * 3) % reqs.len()];
                    let d = router.route(black_box(req), NOW).unwrap();
                    router.complete(&d.request_id).unwrap();
                }
            })
        })
        .collect();
    barrier.wait();
    let t0 = Instant::now();
    for h in handles {
        h.join().unwrap();
    }
    (threads * ops) as f64 / t0.elapsed().as_secs_f64()
}

/// One thread doing `LOOKUPS` route + complete on the precise router, optionally while another
/// applies batches as fast as it can to `applied_to` (the same router, or another one: the
/// machine's own interference). Returns (lookups/s, applied batches/s).
fn lookup_run(
    router: &Arc<Router>,
    ids: &Arc<Vec<String>>,
    reqs: &Arc<Vec<RouteRequest>>,
    batches: &Arc<Batches>,
    clock: &Arc<AtomicU64>,
    applied_to: Option<&Arc<Router>>,
    pace: Option<f64>,
) -> (f64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let with_applier = applied_to.is_some();
    let applier = applied_to.map(|target| {
        let (router, ids, batches, clock, stop) =
            (target.clone(), ids.clone(), batches.clone(), clock.clone(), stop.clone());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let (e, b) = &batches[n % batches.len()];
                router.apply_batch(&ids[*e], b, None, clock.load(Ordering::Relaxed)).unwrap();
                n += 1;
                if let Some(rate) = pace {
                    // A steady rate (batches per second), as engines publish.
                    let next = t0 + Duration::from_secs_f64(n as f64 / rate);
                    if let Some(wait) = next.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                }
            }
            n as f64 / t0.elapsed().as_secs_f64()
        })
    });
    if with_applier {
        // Let the applier get going.
        std::thread::sleep(Duration::from_millis(5));
    }
    let t0 = Instant::now();
    for i in 0..LOOKUPS {
        // 1 ms per request: speculative entries expire as in steady traffic.
        let now = clock.fetch_add(1, Ordering::Relaxed) + 1;
        let d = router.route(black_box(&reqs[i % reqs.len()]), now).unwrap();
        router.complete(&d.request_id).unwrap();
    }
    let lookups = LOOKUPS as f64 / t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let applied = applier.map_or(0.0, |h| h.join().unwrap());
    (lookups, applied)
}

/// Decisions/s at each thread count on `router` shared, and on a router per thread (made by
/// `make`: the machine's own ceiling, nothing shared), medians of `RUNS` interleaved runs.
fn scaling_of(
    router: &Arc<Router>,
    reqs: &Arc<Vec<RouteRequest>>,
    counts: &[usize],
    make: impl Fn() -> Router,
) -> Vec<(usize, f64, f64)> {
    let max_threads = counts.iter().copied().max().unwrap_or(1);
    let own: Vec<Arc<Router>> = (0..max_threads).map(|_| Arc::new(make())).collect();
    let shared = [router.clone()];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); counts.len()];
    let mut ceiling: Vec<Vec<f64>> = vec![Vec::new(); counts.len()];
    scaling_run(&shared, reqs, 1, OPS / 4); // warm-up
    scaling_run(&own, reqs, max_threads, OPS / 4);
    for _ in 0..RUNS {
        for (i, &t) in counts.iter().enumerate() {
            rates[i].push(scaling_run(&shared, reqs, t, OPS));
            ceiling[i].push(scaling_run(&own, reqs, t, OPS));
        }
    }
    assert_eq!(router.stats().inflight_requests, 0, "every decision was completed");
    counts.iter().zip(rates.into_iter().zip(ceiling)).map(|(&t, (r, c))| (t, median(r), median(c))).collect()
}

fn print_scaling(what: &str, scaling: &[(usize, f64, f64)]) {
    let (one, one_own) = scaling.first().map_or((f64::NAN, f64::NAN), |s| (s.1, s.2));
    for (t, r, c) in scaling {
        println!(
            "- {what}, {t} thread(s): {r:.0} decisions/s on one shared router ({:.2}x one thread); {c:.0}/s on a router per thread ({:.2}x: the machine's ceiling)",
            r / one,
            c / one_own
        );
    }
    if let Some((_, two, two_own)) = scaling.iter().find(|s| s.0 == 2) {
        let x = two / one;
        println!(
            "- {what}, 2 threads vs 1 on one shared router: {x:.2}x (goal ≥ 1.7x: {}); ceiling here {:.2}x; \
             the shared router's 2 threads do {:.0}% of what 2 routers do (the cost of sharing, apart from the \
             machine)",
            if x >= 1.7 { "met" } else { "NOT met" },
            two_own / one_own,
            100.0 * two / two_own
        );
    }
}

fn thread_counts() -> Vec<usize> {
    if let Ok(s) = std::env::var("KVROUTE_THREADS") {
        let v: Vec<usize> = s.split(',').filter_map(|x| x.trim().parse().ok()).filter(|&n| n > 0).collect();
        if !v.is_empty() {
            return v;
        }
    }
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut v = vec![1, 2];
    let mut n = 4;
    while n <= cores {
        v.push(n);
        n *= 2;
    }
    if cores > 2 && !v.contains(&cores) {
        v.push(cores);
    }
    v
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn main() {
    let part = std::env::var("KVROUTE_THREADS_PART").unwrap_or_default();
    if part == "scaling" || part == "precise-scaling" {
        let (router, reqs) = if part == "scaling" {
            approx_router()
        } else {
            let (r, _, q, _) = precise_router();
            (r, q)
        };
        let (router, reqs) = ([Arc::new(router)], Arc::new(reqs));
        for &t in &thread_counts() {
            let r = median((0..RUNS).map(|_| scaling_run(&router, &reqs, t, OPS)).collect());
            println!("route+complete, {t} thread(s): {r:.0} decisions/s");
        }
        return;
    }
    if part == "events" {
        let (router, ids, reqs, batches) = precise_router();
        let (router, ids, reqs, batches) = (Arc::new(router), Arc::new(ids), Arc::new(reqs), Arc::new(batches));
        let clock = Arc::new(AtomicU64::new(NOW));
        lookup_run(&router, &ids, &reqs, &batches, &clock, Some(&router), None);
        // `KVROUTE_THREADS_ONLY=alone` (or `beside`): only that side, for a profiler.
        let only = std::env::var("KVROUTE_THREADS_ONLY").unwrap_or_default();
        if !only.is_empty() {
            let target = (only == "beside").then_some(&router);
            for _ in 0..RUNS {
                let (l, a) = lookup_run(&router, &ids, &reqs, &batches, &clock, target, None);
                println!("lookups {l:.0}/s ({only}), {a:.0} batches/s");
            }
            return;
        }
        for _ in 0..RUNS {
            let alone = lookup_run(&router, &ids, &reqs, &batches, &clock, None, None).0;
            let (with, applied) = lookup_run(&router, &ids, &reqs, &batches, &clock, Some(&router), None);
            println!(
                "lookups {alone:.0}/s alone, {with:.0}/s beside the applier ({:.1}% slower) at {applied:.0} batches/s",
                (1.0 - with / alone) * 100.0
            );
        }
        return;
    }
    let load_before = load_average();
    let counts = thread_counts();
    let (router, reqs) = approx_router();
    let (router, reqs) = (Arc::new(router), Arc::new(reqs));
    let scaling = scaling_of(&router, &reqs, &counts, || approx_router().0);
    let (prouter, _, preqs, _) = precise_router();
    let pscaling = scaling_of(&Arc::new(prouter), &Arc::new(preqs), &counts, || precise_router().0);

    let (prouter, ids, preqs, batches) = precise_router();
    let (prouter, ids, preqs, batches) = (Arc::new(prouter), Arc::new(ids), Arc::new(preqs), Arc::new(batches));
    let clock = Arc::new(AtomicU64::new(NOW));
    let d = prouter.route(&preqs[3], NOW).unwrap();
    assert_eq!(d.cached_tokens, (PROMPT_TOKENS * 3 / 4) as u64, "3/4 of the lookup prompt is cached");
    prouter.complete(&d.request_id).unwrap();
    let other = Arc::new(precise_router().0);
    let (mut alone, mut with, mut applied, mut beside, mut applied_beside, mut paced) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Warm-up (and a first pass of stores on both routers).
    lookup_run(&prouter, &ids, &preqs, &batches, &clock, Some(&prouter), None);
    lookup_run(&prouter, &ids, &preqs, &batches, &clock, Some(&other), None);
    for _ in 0..RUNS {
        alone.push(lookup_run(&prouter, &ids, &preqs, &batches, &clock, None, None).0);
        let (l, a) = lookup_run(&prouter, &ids, &preqs, &batches, &clock, Some(&prouter), None);
        with.push(l);
        applied.push(a);
        let (l, a) = lookup_run(&prouter, &ids, &preqs, &batches, &clock, Some(&other), None);
        beside.push(l);
        applied_beside.push(a);
        paced.push(lookup_run(&prouter, &ids, &preqs, &batches, &clock, Some(&prouter), Some(PACED)).0);
    }
    // Each run's own slowdown (its lookups alone against beside the applier, back to back): their
    // spread shows how far the machine moved the figure in this session.
    let pair_slow: Vec<f64> = alone.iter().zip(&with).map(|(a, w)| (1.0 - w / a) * 100.0).collect();
    let (pair_min, pair_max) = pair_slow.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let (alone, with, applied) = (median(alone), median(with), median(applied));
    let (beside, applied_beside, paced) = (median(beside), median(applied_beside), median(paced));

    // Per-op timings through criterion: one route + complete on the shared routers.
    let mut c = Criterion::default()
        .sample_size(30)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1))
        .configure_from_args();
    c.bench_function("threads/route_complete_approx_8k_W64", |b| {
        let mut i = 0;
        b.iter(|| {
            i += 1;
            let d = router.route(black_box(&reqs[i % reqs.len()]), NOW).unwrap();
            router.complete(&d.request_id).unwrap();
        });
    });
    c.bench_function("threads/lookup_precise_8k_W64", |b| {
        let mut i = 0;
        b.iter(|| {
            i += 1;
            let now = clock.fetch_add(1, Ordering::Relaxed) + 1;
            let d = prouter.route(black_box(&preqs[i % preqs.len()]), now).unwrap();
            prouter.complete(&d.request_id).unwrap();
        });
    });
    c.final_summary();

    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!();
    println!(
        "## Thread scaling (median of {RUNS} runs; {cores} cores; load average before {load_before}, after {})",
        load_average()
    );
    print_scaling("route+complete approx 8k", &scaling);
    print_scaling("route+complete precise 8k (dual keys)", &pscaling);
    let slow = (1.0 - with / alone) * 100.0;
    println!(
        "- lookups (precise route+complete): {alone:.0}/s alone, {with:.0}/s with an applier thread on the same router at {:.0} batches/s ({:.0} blocks/s): {slow:.1}% slower (goal ≤ 10% slower: {})",
        applied,
        applied * 8.0,
        if slow <= 10.0 { "met" } else { "NOT met" }
    );
    println!("  (each of the {RUNS} runs back to back: {pair_min:.1}% to {pair_max:.1}% slower)");
    println!(
        "- the machine's own interference: {beside:.0} lookups/s ({:.1}% slower) with the applier on another router at {:.0} batches/s",
        (1.0 - beside / alone) * 100.0,
        applied_beside
    );
    println!(
        "- lookups beside an applier paced at {PACED:.0} batches/s ({:.0} blocks/s, a fleet's event rate) on the same router: {paced:.0}/s ({:.1}% slower)",
        PACED * 8.0,
        (1.0 - paced / alone) * 100.0
    );
}
