//! kvroute's prefix indexes against published peers from the Rust registry, on one shared-prefix
//! workload, in one run:
//!
//! | subject | keys | input |
//! |---|---|---|
//! | kvroute precise store (`PrefixIndex::store`) | chain keys | store events |
//! | kvroute `KvIndex` through `Router::apply_batch` (engine keys) | chain keys | decoded `EventBatch`es |
//! | kvroute approximate (`ApproxIndex::observe`) | chain keys | whole placed sequences |
//! | dynamo-kv-router 1.6 `RadixTree::apply_event` | content + chain | store events |
//! | dynamo-kv-router 1.6 `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`, 1 thread | content + chain | store events |
//! | kv-index 2.0 `ChainIndex::apply_stored` | content + chain | store events |
//! | kv-index 2.0 `TokenTree::insert_tokens` (approximate; one token per block, page size 1) | content | whole placed sequences |
//! | the same with 16 tokens per block and page size 16 (SGLang's default page) | content | whole placed sequences |
//!
//! The workload is [`PeerWorkload`]: W ∈ {64, 512} endpoints, ~1M / ~4.19M placed (block,
//! endpoint) memberships, tenants' system prompts shared by many endpoints. Store events carry
//! each distinct membership once (an endpoint that already holds its tenant's system prompt
//! stores only the conversation's own blocks, under the prompt's last block), so every exact
//! index ends up holding exactly the same memberships; the approximate indexes observe the whole
//! placed sequences, as a router does.
//!
//! Measured, per subject and W:
//! - **apply**: blocks fed per second on one thread, timing the whole build in CPU time
//!   ([`cpu_time`]: this process's threads' run time, so a loaded machine does not skew it)
//!   (inputs prepared beforehand), median of `KVROUTE_PEERS_RUNS` (default 3) fresh builds;
//!   and, for the goal, kvroute's precise store against ChainIndex in alternating builds
//!   ([`paired_apply`], 8 pairs): the subjects' builds above run one subject after another, so
//!   a machine whose speed moves during the run moves their ratio; alternating builds share it.
//!   Beside it, the same pairs with the store's room for its final block count reserved before
//!   the build ([`PrefixIndex::reserve`]): no table rebuild, so what the store's apply would be
//!   if growth cost nothing (the count is known only after a build: not the goal's figure);
//! - **find-matches**: µs per lookup of a 128-block request sharing a prefix (64 different
//!   probes, cycled), timed by criterion in the calling thread's CPU time ([`thread_cpu_time`]);
//!   the table shows the median of criterion's samples;
//! - **churn**: after an untimed build, [`Churn`]'s 4,096 steps (a conversation's own blocks
//!   removed, leaf first, and a new conversation stored), timed like apply, for the exact
//!   subjects: an index at capacity sees blocks leave as fast as they come. Reported as blocks
//!   removed and stored per second, with every exact subject checked afterwards to report the
//!   same overlap as kvroute's precise store on every probe;
//! - **memory**: bytes allocated and still live after one build, counted by this binary's global
//!   allocator (requested sizes, all threads) for every subject alike, divided by the distinct
//!   memberships. kvroute's own `stats().memory_bytes` is printed beside it as a cross-check.
//!
//! Before timing lookups, every exact index is checked to report the same per-endpoint overlap
//! as kvroute's precise store on every probe (and TokenTree the same best match), so all
//! subjects answer the same question.
//!
//! Run: `cargo bench -p kvroute-benches --features peers --bench peers` (add `-- <filter>` to
//! limit criterion's lookups; `KVROUTE_PEERS_W=512` to one endpoint count).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]
// The only unsafe code: the pass-through counting global allocator below.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::future::Future;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use criterion::Criterion;
use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree};
use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock, TokenTree};
use kvroute::TierWeights;
use kvroute::{ApproxIndex, EndpointSpec, RequestKeys, Role, Router};
use kvroute::{BlockStored, EventBatch, KvEvent, Medium};
use kvroute::{MatchScratch, MatchWeights, PrefixIndex, PrefixMatch};
use kvroute_benches::indexload::WorkloadShape;
use kvroute_benches::peerload::{Churn, PeerWorkload, StoreEvent};
use kvroute_benches::timing::{cpu_time, median, thread_cpu_time, Samples};

// ---------------------------------------------------------------------------------------------
// Counting allocator: live bytes allocated while `COUNTING` is on (requested sizes).
// ---------------------------------------------------------------------------------------------

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicI64 = AtomicI64::new(0);

#[inline]
fn count(delta: i64) {
    if COUNTING.load(Ordering::Relaxed) {
        LIVE.fetch_add(delta, Ordering::Relaxed);
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as i64));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as i64 - layout.size() as i64);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `build` with counting on; returns what it built and the bytes it left allocated. Only
/// allocations made inside count (a build that frees memory allocated before would read low, so
/// builders here create their inputs inside).
fn measured<T>(build: impl FnOnce() -> T) -> (T, i64) {
    LIVE.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    let built = build();
    COUNTING.store(false, Ordering::SeqCst);
    (built, LIVE.load(Ordering::SeqCst))
}

/// A minimal executor for the peer's few async barriers (`flush_and_wait`).
fn block_on<F: Future>(fut: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

// ---------------------------------------------------------------------------------------------
// Results
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Row {
    name: &'static str,
    peer: bool,
    exact: bool,
    /// Blocks fed per build.
    blocks: u64,
    apply_s: f64,
    find_us: Option<f64>,
    bytes: i64,
    /// kvroute's own `stats().memory_bytes`, when it has one.
    self_reported: Option<u64>,
    /// The churn (exact subjects): blocks removed and stored, and seconds (see [`Churn`]).
    churn: Option<(u64, f64)>,
}

impl Row {
    fn apply_mps(&self) -> f64 {
        self.blocks as f64 / self.apply_s / 1e6
    }

    fn churn_mps(&self) -> Option<f64> {
        self.churn.map(|(blocks, s)| blocks as f64 / s / 1e6)
    }
}

/// Median seconds of `runs` builds: `prepare` (untimed) makes the inputs, `apply` (timed)
/// builds the index from them; the index is dropped untimed.
fn time_apply<P, I>(runs: usize, mut prepare: impl FnMut() -> P, mut apply: impl FnMut(P) -> I) -> f64 {
    let mut secs = Vec::with_capacity(runs);
    for _ in 0..runs {
        let input = prepare();
        let t = cpu_time();
        let ix = apply(input);
        secs.push(cpu_time().saturating_sub(t).as_secs_f64());
        drop(black_box(ix));
    }
    median(secs)
}

const SAMPLES: usize = 30;

/// The alternating pairs of a run ([`paired_apply`]).
struct Paired {
    /// The store as it is (growing from empty) against ChainIndex: the goal's figure.
    grown: Vec<f64>,
    /// The store with room for its final block count reserved before the build (no table
    /// rebuild) against ChainIndex: what the build would be if growth cost nothing.
    reserved: Vec<f64>,
    /// That final block count, and the reserved build's bytes per membership.
    blocks: usize,
    reserved_bytes_per_membership: f64,
}
/// Alternating build pairs of the store and ChainIndex ([`paired_apply`]).
const PAIRS: usize = 8;

/// Lookup latency through criterion (`iter_custom`, probes cycled); returns the median of the
/// per-iteration times of criterion's measurement samples, µs (`None` when filtered out).
fn time_find(
    c: &mut Criterion,
    group: &str,
    name: &str,
    probes: usize,
    mut query: impl FnMut(usize) -> usize,
) -> Option<f64> {
    let samples = Samples::new();
    let mut next = 0usize;
    c.bench_function(&format!("{group}/{name}"), |b| {
        b.iter_custom(|iters| {
            let t = thread_cpu_time();
            for _ in 0..iters {
                black_box(query(next % probes));
                next += 1;
            }
            let d = thread_cpu_time().saturating_sub(t);
            samples.record(iters, d);
            d
        });
    });
    samples.median_us(SAMPLES)
}

// ---------------------------------------------------------------------------------------------
// Inputs shared by the subjects (prepared once per W, untimed)
// ---------------------------------------------------------------------------------------------

struct Inputs {
    wl: PeerWorkload,
    w: usize,
    /// kvroute request keys of each probe.
    probe_keys: Vec<RequestKeys>,
    /// Per-endpoint overlap of each probe, from kvroute's precise store (the reference).
    reference: Vec<Vec<u32>>,
    /// Endpoint ids ("host:port").
    ids: Vec<String>,
    /// The churn after a build, its removals' keys (leaf first) and blocks (removed + stored).
    churn: Churn,
    removals: Vec<(usize, Vec<u64>)>,
    churn_blocks: u64,
    /// `reference` after the churn.
    reference_after: Vec<Vec<u32>>,
}

/// Steps of the churn after a build (a conversation removed and one stored per step).
const CHURN_STEPS: usize = 4096;

fn endpoint_id(e: usize) -> String {
    format!("10.0.{}.{}:8000", e / 256, e % 256)
}

fn dynamo_event(wl: &PeerWorkload, i: usize, ev: &StoreEvent) -> RouterEvent {
    let (e, parent, contents, keys) = wl.event(ev);
    dynamo_stored(e, i as u64, parent, ev.start, contents, keys)
}

/// A dynamo store event of `endpoint`: blocks `keys` (content hashes `contents`) from position
/// `start` on, under `parent`.
fn dynamo_stored(
    endpoint: usize,
    id: u64,
    parent: Option<u64>,
    start: usize,
    contents: &[u64],
    keys: &[u64],
) -> RouterEvent {
    let blocks = contents
        .iter()
        .zip(keys)
        .map(|(&c, &k)| KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(k),
            tokens_hash: LocalBlockHash(c),
            mm_extra_info: None,
        })
        .collect();
    let data = KvCacheStoreData {
        parent_hash: parent.map(ExternalSequenceBlockHash),
        start_position: Some(start as u32),
        blocks,
    };
    RouterEvent::new(endpoint as u64, KvCacheEvent { event_id: id, data: KvCacheEventData::Stored(data), dp_rank: 0 })
}

fn dynamo_events(wl: &PeerWorkload) -> Vec<RouterEvent> {
    wl.events.iter().enumerate().map(|(i, ev)| dynamo_event(wl, i, ev)).collect()
}

/// The churn as dynamo events (ids after the build's).
fn dynamo_churn(inp: &Inputs) -> Vec<RouterEvent> {
    let base = inp.wl.events.len() as u64;
    let mut out = Vec::with_capacity(2 * inp.removals.len());
    for (k, (e, removed)) in inp.removals.iter().enumerate() {
        let block_hashes = removed.iter().map(|&h| ExternalSequenceBlockHash(h)).collect();
        let data = KvCacheEventData::Removed(KvCacheRemoveData { block_hashes });
        out.push(RouterEvent::new(*e as u64, KvCacheEvent { event_id: base + 2 * k as u64, data, dp_rank: 0 }));
        let (e, parent, contents, keys) = inp.churn.store(k);
        let id = base + 2 * k as u64 + 1;
        out.push(dynamo_stored(e, id, Some(parent), inp.churn.system_blocks, contents, keys));
    }
    out
}

fn dynamo_overlap(scores: &dynamo_kv_router::protocols::OverlapScores, w: usize) -> Vec<u32> {
    let mut v = vec![0u32; w];
    for (k, &s) in &scores.scores {
        v[k.worker_id as usize] = s;
    }
    v
}

fn check_exact(name: &str, inp: &Inputs, overlap: impl Fn(usize) -> Vec<u32>) {
    let bad = (0..inp.wl.probes.len()).filter(|&i| overlap(i) != inp.reference[i]).count();
    assert_eq!(bad, 0, "{name}: {bad} of {} probes disagree with kvroute's precise store", inp.wl.probes.len());
}

/// [`check_exact`] after the churn.
fn check_exact_after(name: &str, inp: &Inputs, overlap: impl Fn(usize) -> Vec<u32>) {
    let bad = (0..inp.wl.probes.len()).filter(|&i| overlap(i) != inp.reference_after[i]).count();
    assert_eq!(bad, 0, "{name}: {bad} of {} probes disagree with kvroute's precise store", inp.wl.probes.len());
}

// ---------------------------------------------------------------------------------------------
// Subjects
// ---------------------------------------------------------------------------------------------

/// kvroute's precise store holding every membership of `wl`'s events.
fn precise_build(wl: &PeerWorkload) -> PrefixIndex {
    precise_build_reserved(wl, 0)
}

/// [`precise_build`] with room for `blocks` blocks reserved first ([`PrefixIndex::reserve`]; 0:
/// none).
fn precise_build_reserved(wl: &PeerWorkload, blocks: usize) -> PrefixIndex {
    let mut ix: PrefixIndex = PrefixIndex::new(0, wl.shape.capacity_per_endpoint);
    ix.reserve(blocks).expect("the memory for the reservation");
    for e in 0..wl.shape.endpoints {
        ix.activate(e);
    }
    for ev in &wl.events {
        let (e, _, _, keys) = wl.event(ev);
        ix.store(keys, e, Medium::Gpu);
    }
    ix
}

/// Apply `churn` (its removals' keys in `removals`) to kvroute's precise store.
fn precise_churn(ix: &mut PrefixIndex, churn: &Churn, removals: &[(usize, Vec<u64>)]) {
    for (k, (e, removed)) in removals.iter().enumerate() {
        ix.remove(removed, *e, Medium::Gpu);
        let (e, _, _, keys) = churn.store(k);
        ix.store(keys, e, Medium::Gpu);
    }
}

/// Per-endpoint overlap of each probe in `ix`.
fn overlaps(ix: &PrefixIndex, probes: &[RequestKeys]) -> Vec<Vec<u32>> {
    let weights = MatchWeights::new(&TierWeights::default());
    let (mut out, mut scratch) = (PrefixMatch::default(), MatchScratch::default());
    probes
        .iter()
        .map(|k| {
            ix.match_blocks(k, &weights, &mut out, &mut scratch);
            out.blocks()
        })
        .collect()
}

fn kvroute_precise(c: &mut Criterion, inp: &Inputs, runs: usize, group: &str) -> Row {
    let wl = &inp.wl;
    let build = || precise_build(wl);
    let apply_s = time_apply(runs, || (), |()| build());
    let churn = |mut ix: PrefixIndex| {
        precise_churn(&mut ix, &inp.churn, &inp.removals);
        ix
    };
    let churn_s = time_apply(runs, build, churn);
    let after = churn(build());
    assert_eq!(after.stats().memberships, wl.memberships(), "the churn keeps the memberships");
    drop(after);
    let (ix, bytes) = measured(build);
    let st = ix.stats();
    assert_eq!(st.memberships, wl.memberships(), "the store holds every membership");
    let weights = MatchWeights::new(&TierWeights::default());
    let (mut out, mut scratch) = (PrefixMatch::default(), MatchScratch::default());
    let find_us = time_find(c, group, "kvroute precise", wl.probes.len(), |i| {
        ix.match_blocks(&inp.probe_keys[i], &weights, &mut out, &mut scratch);
        out.slots().len()
    });
    Row {
        name: "kvroute precise store (PrefixIndex)",
        peer: false,
        exact: true,
        blocks: wl.memberships(),
        apply_s,
        find_us,
        bytes,
        self_reported: Some(st.memory_bytes),
        churn: Some((inp.churn_blocks, churn_s)),
    }
}

fn kvroute_router(inp: &Inputs, runs: usize) -> Row {
    let wl = &inp.wl;
    let batches: Vec<(usize, EventBatch)> = wl
        .events
        .iter()
        .map(|ev| {
            let (e, parent, _, keys) = wl.event(ev);
            let stored = BlockStored {
                block_hashes: keys.to_vec(),
                parent_block_hash: parent,
                token_ids: Vec::new(),
                block_size: 16,
                lora_id: None,
                medium: Medium::Gpu,
                lora_name: None,
                group_idx: None,
                cache_salt: None,
                ..Default::default()
            };
            (e, EventBatch { ts: 1.0, events: vec![KvEvent::BlockStored(stored)], data_parallel_rank: None })
        })
        .collect();
    let new_router = || {
        let r = Router::from_json(
            r#"{"index":{"mode":"precise","precise":{"keys":"engine","engine":{"algo":"sha256_cbor"}}}}"#,
        )
        .unwrap();
        for id in &inp.ids {
            r.upsert_endpoint(EndpointSpec::new(id.as_str(), Role::Decode)).unwrap();
        }
        r
    };
    let apply = |r: Router| {
        let mut seq = vec![0u64; inp.w];
        for (e, batch) in &batches {
            seq[*e] += 1;
            r.apply_batch(&inp.ids[*e], batch, Some(seq[*e]), 1_000).unwrap();
        }
        r
    };
    let apply_s = time_apply(runs, new_router, apply);
    let (r, with_router) = measured(|| apply(new_router()));
    let (empty, router_only) = measured(new_router);
    drop(empty);
    let st = r.stats().precise;
    assert_eq!(st.index.memberships, wl.memberships(), "the router's precise index holds every membership");
    let self_reported = Some(st.memory_bytes());
    Row {
        name: "kvroute KvIndex via Router::apply_batch (engine keys)",
        peer: false,
        exact: true,
        blocks: wl.memberships(),
        apply_s,
        find_us: None,
        bytes: with_router - router_only,
        self_reported,
        churn: None,
    }
}

fn kvroute_approx(c: &mut Criterion, inp: &Inputs, runs: usize, group: &str) -> Row {
    let wl = &inp.wl;
    let cap = wl.shape.capacity_per_endpoint;
    let build = || {
        let mut ix = ApproxIndex::new(0, cap);
        for e in 0..inp.w {
            ix.activate(e);
        }
        for p in &wl.placements {
            ix.observe(&p.keys, p.endpoint);
        }
        ix
    };
    let apply_s = time_apply(runs, || (), |()| build());
    let (ix, bytes) = measured(build);
    let st = ix.stats();
    let weights = MatchWeights::new(&TierWeights::default());
    let (mut out, mut scratch) = (PrefixMatch::default(), MatchScratch::default());
    let agree = (0..wl.probes.len())
        .filter(|&i| {
            ix.match_blocks(&inp.probe_keys[i], &weights, &mut out, &mut scratch);
            out.blocks() == inp.reference[i]
        })
        .count();
    println!("  kvroute approx: {agree}/{} probes match the exact overlap", wl.probes.len());
    let find_us = time_find(c, group, "kvroute approx", wl.probes.len(), |i| {
        ix.match_blocks(&inp.probe_keys[i], &weights, &mut out, &mut scratch);
        out.slots().len()
    });
    Row {
        name: "kvroute approx (ApproxIndex)",
        peer: false,
        exact: false,
        blocks: wl.placed_blocks(),
        apply_s,
        find_us,
        bytes,
        self_reported: Some(st.memory_bytes),
        churn: None,
    }
}

fn dynamo_radix(c: &mut Criterion, inp: &Inputs, runs: usize, group: &str) -> Row {
    let wl = &inp.wl;
    let apply = |events: Vec<RouterEvent>| {
        let mut t = RadixTree::new();
        for ev in events {
            t.apply_event(ev).unwrap();
        }
        t
    };
    let apply_s = time_apply(runs, || dynamo_events(wl), apply);
    let (t, bytes) = measured(|| {
        let mut t = RadixTree::new();
        for (i, ev) in wl.events.iter().enumerate() {
            t.apply_event(dynamo_event(wl, i, ev)).unwrap();
        }
        t
    });
    let probes: Vec<Vec<LocalBlockHash>> =
        wl.probes.iter().map(|p| p.contents.iter().map(|&c| LocalBlockHash(c)).collect()).collect();
    check_exact("dynamo RadixTree", inp, |i| dynamo_overlap(&t.find_matches(probes[i].clone(), false), inp.w));
    let find_us = time_find(c, group, "dynamo RadixTree", probes.len(), |i| {
        t.find_matches(probes[i].clone(), false).scores.len()
    });
    drop(t);
    let prepare = || (apply(dynamo_events(wl)), dynamo_churn(inp));
    let churn = |(mut t, events): (RadixTree, Vec<RouterEvent>)| {
        for ev in events {
            t.apply_event(ev).unwrap();
        }
        t
    };
    let churn_s = time_apply(runs, prepare, churn);
    let after = churn(prepare());
    check_exact_after("dynamo RadixTree after the churn", inp, |i| {
        dynamo_overlap(&after.find_matches(probes[i].clone(), false), inp.w)
    });
    Row {
        name: "dynamo-kv-router RadixTree",
        peer: true,
        exact: true,
        blocks: wl.memberships(),
        apply_s,
        find_us,
        bytes,
        self_reported: None,
        churn: Some((inp.churn_blocks, churn_s)),
    }
}

fn dynamo_concurrent(c: &mut Criterion, inp: &Inputs, runs: usize, group: &str) -> Row {
    let wl = &inp.wl;
    let new_indexer = || ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, 16);
    let apply = |(ix, events): (ThreadPoolIndexer<ConcurrentRadixTreeCompressed>, Vec<RouterEvent>)| {
        for ev in events {
            ix.enqueue_event(ev).unwrap();
        }
        block_on(ix.flush_and_wait()).unwrap();
        ix
    };
    let apply_s = time_apply(runs, || (new_indexer(), dynamo_events(wl)), apply);
    let (ix, bytes) = measured(|| {
        let ix = new_indexer();
        for (i, ev) in wl.events.iter().enumerate() {
            ix.enqueue_event(dynamo_event(wl, i, ev)).unwrap();
        }
        block_on(ix.flush_and_wait()).unwrap();
        ix
    });
    let probes: Vec<Vec<LocalBlockHash>> =
        wl.probes.iter().map(|p| p.contents.iter().map(|&c| LocalBlockHash(c)).collect()).collect();
    let tree = ix.backend();
    check_exact("dynamo concurrent", inp, |i| dynamo_overlap(&tree.find_matches(&probes[i], false), inp.w));
    let find_us =
        time_find(c, group, "dynamo concurrent", probes.len(), |i| tree.find_matches(&probes[i], false).scores.len());
    drop(ix);
    let prepare = || (apply((new_indexer(), dynamo_events(wl))), dynamo_churn(inp));
    let churn = |(ix, events): (ThreadPoolIndexer<ConcurrentRadixTreeCompressed>, Vec<RouterEvent>)| {
        for ev in events {
            ix.enqueue_event(ev).unwrap();
        }
        block_on(ix.flush_and_wait()).unwrap();
        ix
    };
    let churn_s = time_apply(runs, prepare, churn);
    let after = churn(prepare());
    let tree = after.backend();
    check_exact_after("dynamo concurrent after the churn", inp, |i| {
        dynamo_overlap(&tree.find_matches(&probes[i], false), inp.w)
    });
    Row {
        name: "dynamo-kv-router concurrent (1 thread)",
        peer: true,
        exact: true,
        blocks: wl.memberships(),
        apply_s,
        find_us,
        bytes,
        self_reported: None,
        churn: Some((inp.churn_blocks, churn_s)),
    }
}

struct Chain {
    ix: ChainIndex,
    ids: Vec<u32>,
    maps: Vec<ChainBlockMap>,
}

/// The workload's placements as kv-index's stored blocks (untimed input of [`chain_build`]).
fn chain_stored(wl: &PeerWorkload) -> Vec<Vec<StoredBlock>> {
    wl.placements
        .iter()
        .map(|p| {
            p.contents
                .iter()
                .zip(&p.keys)
                .map(|(&c, &k)| StoredBlock { seq_hash: SequenceHash(k), content_hash: ContentHash(c) })
                .collect()
        })
        .collect()
}

/// A ChainIndex built from the workload's store events.
fn chain_build(inp: &Inputs, stored: &[Vec<StoredBlock>]) -> Chain {
    let wl = &inp.wl;
    let ix = ChainIndex::with_max_workers(inp.w);
    let ids: Vec<u32> = inp.ids.iter().map(|id| ix.intern_worker(id).unwrap()).collect();
    let mut maps: Vec<ChainBlockMap> = (0..inp.w).map(|_| ChainBlockMap::new()).collect();
    for ev in &wl.events {
        let (e, parent, _, _) = wl.event(ev);
        let blocks = &stored[ev.placement][ev.start..];
        ix.apply_stored(ids[e], blocks, parent.map(SequenceHash), &mut maps[e]).unwrap();
    }
    Chain { ix, ids, maps }
}

/// Apply of kvroute's precise store (with `reserve` blocks reserved first: 0, none) against
/// ChainIndex's, their builds alternating (`pairs` pairs, which one goes first alternating too),
/// so that the machine's moves hit both alike: each pair's ratio (ChainIndex's time over the
/// store's: > 1 is the store faster), sorted.
fn paired_apply(inp: &Inputs, pairs: usize, reserve: usize) -> Vec<f64> {
    let stored = chain_stored(&inp.wl);
    // One build each, timed by `time_apply` (the index dropped after the clock stops).
    let ours = || time_apply(1, || (), |()| precise_build_reserved(&inp.wl, reserve));
    let theirs = || time_apply(1, || (), |()| chain_build(inp, &stored));
    let mut ratios: Vec<f64> = (0..pairs)
        .map(|k| {
            let (a, b) = if k % 2 == 0 {
                let a = ours();
                (a, theirs())
            } else {
                let b = theirs();
                (ours(), b)
            };
            b / a
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    ratios
}

fn kv_index_chain(c: &mut Criterion, inp: &Inputs, runs: usize, group: &str) -> Row {
    let wl = &inp.wl;
    let stored = chain_stored(wl);
    let build = || chain_build(inp, &stored);
    let apply_s = time_apply(runs, || (), |()| build());
    let (ch, bytes) = measured(build);
    let mut by_id = vec![usize::MAX; ch.ids.iter().copied().max().map_or(0, |m| m as usize + 1)];
    for (e, &id) in ch.ids.iter().enumerate() {
        by_id[id as usize] = e;
    }
    let probes: Vec<Vec<ContentHash>> =
        wl.probes.iter().map(|p| p.contents.iter().map(|&c| ContentHash(c)).collect()).collect();
    check_exact("kv-index ChainIndex", inp, |i| {
        let mut v = vec![0u32; inp.w];
        for (&id, &s) in &ch.ix.find_matches(&probes[i], false).scores {
            v[by_id[id as usize]] = s;
        }
        v
    });
    let find_alloc = time_find(c, group, "kv-index ChainIndex find_matches", probes.len(), |i| {
        ch.ix.find_matches(&probes[i], false).scores.len()
    });
    let mut out = vec![0u32; by_id.len()];
    let find_into = time_find(c, group, "kv-index ChainIndex score_into", probes.len(), |i| {
        ch.ix.score_into(&wl.probes[i].contents, |c| *c, false, |w, s| out[w as usize] = s)
    });
    if let (Some(a), Some(b)) = (find_alloc, find_into) {
        println!("  kv-index ChainIndex: find_matches {a:.2} µs, score_into {b:.2} µs (the table keeps the faster)");
    }
    drop(ch);
    // The churn's inputs in kv-index's types (untimed).
    let removals: Vec<Vec<SequenceHash>> =
        inp.removals.iter().map(|(_, r)| r.iter().map(|&h| SequenceHash(h)).collect()).collect();
    let stores: Vec<Vec<StoredBlock>> = (0..inp.churn.placements.len())
        .map(|k| {
            let (_, _, contents, keys) = inp.churn.store(k);
            contents
                .iter()
                .zip(keys)
                .map(|(&c, &k)| StoredBlock { seq_hash: SequenceHash(k), content_hash: ContentHash(c) })
                .collect()
        })
        .collect();
    let churn = |mut ch: Chain| {
        for (k, ((e, _), removed)) in inp.removals.iter().zip(&removals).enumerate() {
            ch.ix.apply_removed(ch.ids[*e], removed, &mut ch.maps[*e]);
            let (e, parent, _, _) = inp.churn.store(k);
            ch.ix.apply_stored(ch.ids[e], &stores[k], Some(SequenceHash(parent)), &mut ch.maps[e]).unwrap();
        }
        ch
    };
    let churn_s = time_apply(runs, build, churn);
    let after = churn(build());
    check_exact_after("kv-index ChainIndex after the churn", inp, |i| {
        let mut v = vec![0u32; inp.w];
        for (&id, &s) in &after.ix.find_matches(&probes[i], false).scores {
            v[by_id[id as usize]] = s;
        }
        v
    });
    let find_us = match (find_alloc, find_into) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    Row {
        name: "kv-index ChainIndex",
        peer: true,
        exact: true,
        blocks: wl.memberships(),
        apply_s,
        find_us,
        bytes,
        self_reported: None,
        churn: Some((inp.churn_blocks, churn_s)),
    }
}

fn kv_index_token_tree(c: &mut Criterion, inp: &Inputs, runs: usize, group: &str, per_block: usize) -> Row {
    let wl = &inp.wl;
    let tokens: Vec<Vec<u32>> = wl.placements.iter().map(|p| PeerWorkload::tokens(&p.contents, per_block)).collect();
    let build = || {
        // The page is a block: one token per block and page size 1, or 16 and 16 (SGLang's
        // default page, vLLM's default block).
        let t = TokenTree::with_config(per_block, Default::default());
        for (p, toks) in wl.placements.iter().zip(&tokens) {
            t.insert_tokens(toks, &inp.ids[p.endpoint]);
        }
        t
    };
    let apply_s = time_apply(runs, || (), |()| build());
    let (t, bytes) = measured(build);
    drop(tokens);
    let probes: Vec<Vec<u32>> = wl.probes.iter().map(|p| PeerWorkload::tokens(&p.contents, per_block)).collect();
    let agree = (0..probes.len())
        .filter(|&i| {
            let best = inp.reference[i].iter().copied().max().unwrap_or(0) as usize;
            t.match_prefix_with_counts(&probes[i]).matched_token_count == best * per_block
        })
        .count();
    assert_eq!(agree, probes.len(), "TokenTree's best match equals the exact best overlap");
    let name = if per_block == 1 { "kv-index TokenTree" } else { "kv-index TokenTree 16 tokens per block" };
    let find_us =
        time_find(c, group, name, probes.len(), |i| t.match_prefix_with_counts(&probes[i]).matched_token_count);
    Row {
        name: if per_block == 1 {
            "kv-index TokenTree (approximate; 1 token per block, page 1)"
        } else {
            "kv-index TokenTree (approximate; 16 tokens per block, page 16)"
        },
        peer: true,
        exact: false,
        blocks: wl.placed_blocks(),
        apply_s,
        find_us,
        bytes,
        self_reported: None,
        churn: None,
    }
}

// ---------------------------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------------------------

fn fmt_ratio(x: Option<f64>) -> String {
    x.filter(|r| r.is_finite()).map_or_else(|| "—".to_owned(), |r| format!("{r:.2}x"))
}

/// The best peer figures among `peers`: apply (max), find (min), bytes (min).
fn best(peers: &[&Row]) -> (f64, f64, f64) {
    (
        peers.iter().map(|r| r.apply_mps()).fold(f64::NAN, f64::max),
        peers.iter().filter_map(|r| r.find_us).fold(f64::NAN, f64::min),
        peers.iter().map(|r| r.bytes as f64).fold(f64::NAN, f64::min),
    )
}

fn report(w: usize, wl: &PeerWorkload, rows: &[Row], paired: &Paired) {
    let memberships = wl.memberships();
    let peers: Vec<&Row> = rows.iter().filter(|r| r.peer).collect();
    let all = best(&peers);
    let exact = best(&peers.iter().copied().filter(|r| r.exact).collect::<Vec<_>>());
    let approx = best(&peers.iter().copied().filter(|r| !r.exact).collect::<Vec<_>>());
    println!();
    println!(
        "### W={w}: {memberships} distinct memberships ({} placed blocks), {} probes of 128 blocks",
        wl.placed_blocks(),
        wl.probes.len()
    );
    println!(
        "ratios: value / best peer's value, over all peers (\"all\") and over peers of the same kind, exact or \
         approximate (\"kind\"); apply: >1 is better, find-matches and memory: <1 is better"
    );
    println!();
    println!(
        "| index | apply M blocks/s/thread | ×all | ×kind | find-matches µs | ×all | ×kind | B/membership | ×all | ×kind \
         | memory MB | self-reported B/m |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let per = r.bytes as f64 / memberships as f64;
        let kind = if r.exact { exact } else { approx };
        let ratio = |v: Option<f64>, b: f64| fmt_ratio(v.map(|v| v / b));
        println!(
            "| {} | {:.2} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {:.1} | {} |",
            r.name,
            r.apply_mps(),
            ratio(Some(r.apply_mps()), all.0),
            ratio(Some(r.apply_mps()), kind.0),
            r.find_us.map_or_else(|| "—".to_owned(), |f| format!("{f:.2}")),
            ratio(r.find_us, all.1),
            ratio(r.find_us, kind.1),
            per,
            ratio(Some(r.bytes as f64), all.2),
            ratio(Some(r.bytes as f64), kind.2),
            r.bytes as f64 / 1e6,
            r.self_reported.map_or_else(|| "—".to_owned(), |b| format!("{:.1}", b as f64 / memberships as f64)),
        );
    }
    let best_churn = peers.iter().filter_map(|r| r.churn_mps()).fold(f64::NAN, f64::max);
    println!();
    println!(
        "churn at constant size (after the build, {CHURN_STEPS} steps: one conversation's own blocks removed, leaf \
         first, and a new one stored; M blocks removed + stored per second; ratio to the best exact peer):"
    );
    println!();
    println!("| index | churn M blocks/s | ×exact |");
    println!("|---|---|---|");
    for r in rows {
        if let Some(m) = r.churn_mps() {
            println!("| {} | {m:.2} | {} |", r.name, fmt_ratio(Some(m / best_churn)));
        }
    }
    if let Some(k) = rows.iter().find(|r| r.name.starts_with("kvroute precise")) {
        goals(w, memberships, k, &peers, paired);
    }
}

/// The issue's goals for the precise store, each against the best exact peer of this run.
fn goals(w: usize, memberships: u64, k: &Row, peers: &[&Row], pairs: &Paired) {
    let paired = &pairs.grown;
    let exact: Vec<&Row> = peers.iter().copied().filter(|r| r.exact).collect();
    println!();
    println!("goals (kvroute precise store, W={w}, against the best exact peer of this run):");
    if let Some(p) = exact.iter().max_by(|a, b| a.apply_mps().total_cmp(&b.apply_mps())) {
        let (a, b) = (k.apply_mps(), p.apply_mps());
        // Against ChainIndex the alternating pairs decide (the table's builds run one subject
        // after another, and the machine's speed moves between them).
        let paired_decides = p.name == "kv-index ChainIndex" && !paired.is_empty();
        println!(
            "- apply ≥ 1.5x the best exact peer ({}: {b:.2} M blocks/s): {a:.2} M blocks/s, {:.2}x ({})",
            p.name,
            a / b,
            if paired_decides {
                "one subject's builds after the other's: see the alternating pairs"
            } else {
                verdict(a >= 1.5 * b)
            }
        );
        if let (Some(lo), Some(hi)) = (paired.first(), paired.last()) {
            let mid = median(paired.to_vec());
            println!(
                "  the store against ChainIndex, their builds alternating ({} pairs, the machine's moves hitting both \
                 alike): median {mid:.2}x, pairs {lo:.2}–{hi:.2}x ({})",
                paired.len(),
                if paired_decides { verdict(mid >= 1.5) } else { "not the best exact peer here" }
            );
        }
        if let (Some(lo), Some(hi)) = (pairs.reserved.first(), pairs.reserved.last()) {
            println!(
                "  growth's cost, measured (not the goal's figure: the size is known only after the build): the store \
                 with room for its final {} blocks reserved before the build (`PrefixIndex::reserve`: no table \
                 rebuild), against ChainIndex alternating: median {:.2}x, pairs {lo:.2}–{hi:.2}x, at {:.1} B per \
                 membership (its own count)",
                pairs.blocks,
                median(pairs.reserved.clone()),
                pairs.reserved_bytes_per_membership
            );
        }
    }
    let fastest = exact
        .iter()
        .filter(|r| r.find_us.is_some())
        .min_by(|a, b| a.find_us.unwrap_or(f64::NAN).total_cmp(&b.find_us.unwrap_or(f64::NAN)));
    if let (Some(f), Some(p)) = (k.find_us, fastest) {
        let b = p.find_us.unwrap_or(f64::NAN);
        println!(
            "- find-matches faster than the best exact peer ({}: {b:.2} µs), goal ≤ 1/1.5 of it: {f:.2} µs, {:.2}x \
             (faster: {}; goal: {})",
            p.name,
            f / b,
            if f < b { "yes" } else { "NO" },
            verdict(f * 1.5 <= b)
        );
    }
    let per = k.bytes as f64 / memberships as f64;
    println!("- ≤ 16 B per membership: {per:.1} B ({})", verdict(per <= 16.0));
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "MISSED"
    }
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(SAMPLES)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    let runs: usize = std::env::var("KVROUTE_PEERS_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(3).max(1);
    let ws: Vec<usize> = std::env::var("KVROUTE_PEERS_W")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![64, 512]);
    let mut reports = Vec::new();
    for w in ws {
        let shape = WorkloadShape::for_endpoints(w);
        let wl = PeerWorkload::generate(&shape, 7, 64);
        let probe_keys = wl.probe_keys();
        // The reference answers, and the store's final block count (for the reserved pairs).
        let (reference, blocks) = {
            let ix = precise_build(&wl);
            (overlaps(&ix, &probe_keys), usize::try_from(ix.stats().keys).unwrap_or(usize::MAX))
        };
        let hits = reference.iter().map(|r| r.iter().filter(|&&b| b > 0).count()).sum::<usize>();
        println!(
            "W={w}: {} memberships, {} placed blocks; probes hit {:.1} endpoints on average",
            wl.memberships(),
            wl.placed_blocks(),
            hits as f64 / reference.len() as f64
        );
        let churn = wl.churn(CHURN_STEPS, 11);
        let removals: Vec<(usize, Vec<u64>)> = (0..churn.placements.len())
            .map(|k| {
                let (e, removed) = churn.removal(&wl, k);
                (e, removed.collect())
            })
            .collect();
        let churn_blocks = churn.blocks(&wl);
        let reference_after = {
            let mut ix = precise_build(&wl);
            precise_churn(&mut ix, &churn, &removals);
            overlaps(&ix, &probe_keys)
        };
        assert_ne!(reference_after, reference, "the churn changes what the probes find");
        let inp = Inputs {
            ids: (0..w).map(endpoint_id).collect(),
            wl,
            w,
            probe_keys,
            reference,
            churn,
            removals,
            churn_blocks,
            reference_after,
        };
        let group = format!("find_matches_W{w}");
        let rows = vec![
            kvroute_precise(&mut c, &inp, runs, &group),
            kvroute_router(&inp, runs),
            kvroute_approx(&mut c, &inp, runs, &group),
            dynamo_radix(&mut c, &inp, runs, &group),
            dynamo_concurrent(&mut c, &inp, runs, &group),
            kv_index_chain(&mut c, &inp, runs, &group),
            kv_index_token_tree(&mut c, &inp, runs, &group, 1),
            kv_index_token_tree(&mut c, &inp, runs, &group, 16),
        ];
        let reserved_stats = {
            let ix = precise_build_reserved(&inp.wl, blocks);
            assert_eq!(overlaps(&ix, &inp.probe_keys), inp.reference, "a reserved store answers alike");
            ix.stats()
        };
        let paired = Paired {
            grown: paired_apply(&inp, PAIRS, 0),
            reserved: paired_apply(&inp, PAIRS, blocks),
            blocks,
            reserved_bytes_per_membership: reserved_stats.memory_bytes as f64 / inp.wl.memberships() as f64,
        };
        report(w, &inp.wl, &rows, &paired);
        reports.push((w, inp.wl, rows, paired));
    }
    c.final_summary();
    println!();
    println!("## Summary (all W)");
    for (w, wl, rows, paired) in &reports {
        report(*w, wl, rows, paired);
    }
}
