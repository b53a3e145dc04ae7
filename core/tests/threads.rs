//! One `Router` shared by several threads: the decision's read phase runs under a shared lock,
//! its write phase under the exclusive one. Alone, a `Router` decides exactly as a `RouterCore`
//! (also when expiry comes due between decisions); shared, every decision is counted once and
//! every in-flight counter returns to zero, with events, health changes and endpoint churn
//! happening meanwhile. Speed is measured in `benches/benches/threads.rs`, never here.
#![allow(clippy::unwrap_used, clippy::expect_used)]
// The shared-router tests start threads (the core itself never does).
#![allow(clippy::disallowed_methods)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvroute::{BlockStored, EndpointSpec, EventBatch, KvEvent, Medium, MetricsSnapshot, Policy, Role};
use kvroute::{RouteRequest, Router, RouterCore, RouterStats, StateError};

const ENDPOINTS: usize = 6;
/// Short in-flight timeout and speculation TTL, so expiry comes due during the sequences.
const HYBRID: &str = r#"{"index":{"mode":"hybrid","speculative_ttl_ms":300},"limits":{"inflight_timeout_ms":900},
    "metrics":{"staleness_ms":1000000000000}}"#;
const APPROX: &str = r#"{"limits":{"inflight_timeout_ms":900},"metrics":{"staleness_ms":1000000000000}}"#;

fn id(e: usize) -> String {
    format!("10.0.0.{}:8000", e + 1)
}

fn metrics(e: usize) -> MetricsSnapshot {
    MetricsSnapshot {
        waiting: (e % 3) as u32,
        running: 2,
        kv_usage: 0.1 + 0.05 * e as f64,
        updated_ms: 0,
        ..Default::default()
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Token ids of request `i`: one of 4 shared 64-token prefixes, then its own tail.
fn prompt_tokens(i: u64) -> Vec<u32> {
    let prefix = i % 4;
    let mut t: Vec<u32> = (0..64).map(|k| (splitmix(prefix * 1000 + k) % 50_000) as u32).collect();
    let tail = 16 * (1 + i % 5);
    t.extend((0..tail).map(|k| (splitmix(0xfeed ^ (i << 16) ^ k) % 50_000) as u32));
    t
}

/// A completions body for request `i` (token ids; every third one has a session id header).
fn body(i: u64) -> String {
    serde_json::json!({"model": "m", "prompt": prompt_tokens(i), "max_tokens": 32}).to_string()
}

fn headers(i: u64) -> Vec<(&'static str, String)> {
    if i % 3 == 0 {
        vec![("x-session-id", format!("s{}", i % 7))]
    } else {
        Vec::new()
    }
}

/// The engine storing request `i`'s prompt (16-token blocks).
fn stored(i: u64) -> EventBatch {
    let t = prompt_tokens(i);
    let n = t.len() / 16;
    let s = BlockStored {
        block_hashes: (0..n as u64).map(|b| splitmix((i << 20) ^ b)).collect(),
        parent_block_hash: None,
        token_ids: t[..n * 16].to_vec(),
        block_size: 16,
        medium: Medium::Gpu,
        ..Default::default()
    };
    EventBatch { ts: 1.0, events: vec![KvEvent::BlockStored(s)], data_parallel_rank: None }
}

fn setup_router(policy: &str) -> Router {
    let r = Router::new(Policy::from_json(policy).unwrap());
    for e in 0..ENDPOINTS {
        r.upsert_endpoint(EndpointSpec::new(id(e).as_str(), Role::Decode)).unwrap();
        r.update_metrics(&id(e), metrics(e)).unwrap();
    }
    r
}

/// A `RouterCore` set up as `setup_router` sets up a `Router`.
fn setup_core(policy: &str) -> RouterCore {
    let mut core = RouterCore::new(Policy::from_json(policy).unwrap());
    for e in 0..ENDPOINTS {
        core.upsert_endpoint(EndpointSpec::new(id(e).as_str(), Role::Decode)).unwrap();
        core.update_metrics(&id(e), metrics(e)).unwrap();
    }
    core
}

/// One step through both: `event` (a stored batch for an endpoint) if any, then request `k` at
/// `now`; the two must agree. Returns the decision's request id.
fn step_both(router: &Router, core: &mut RouterCore, event: Option<(u64, usize)>, k: u64, now: u64, i: u64) -> String {
    if let Some((batch, e)) = event {
        let (b, e) = (stored(batch), id(e % ENDPOINTS));
        assert_eq!(router.apply_batch(&e, &b, None, now).unwrap(), core.apply_batch(&e, &b, None, now).unwrap());
    }
    let body = body(k);
    let a = router.route_http(body.as_bytes(), headers(k), now).unwrap();
    let b = core.route_http(body.as_bytes(), headers(k), now).unwrap();
    assert_eq!(a, b, "decision {i}");
    a.request_id
}

#[test]
fn one_thread_router_decides_as_the_core() {
    for policy in [HYBRID, APPROX] {
        let router = setup_router(policy);
        let mut core = setup_core(policy);
        let mut held: Vec<(u64, String)> = Vec::new();
        let mut expired = 0;
        for i in 0..600u64 {
            // Time moves 7 ms per request (speculation expires after 300 ms, requests left in
            // flight after 900 ms); now and then it steps back a little.
            let now = 1_000 + i * 7 - if i % 50 == 49 { 20 } else { 0 };
            let event = (i % 4 == 1).then_some((i / 2, i as usize / 4));
            let rid = step_both(&router, &mut core, event, i, now, i);
            // Most requests complete a few decisions later; every tenth never does (it expires).
            if i % 10 != 0 {
                held.push((i, rid));
            }
            while held.first().is_some_and(|(j, _)| j + 3 <= i) {
                let (_, rid) = held.remove(0);
                let (x, y) = (router.complete(&rid), core.complete(&rid));
                assert_eq!(x, y);
                expired += usize::from(x.is_err());
            }
        }
        let (a, b) = (as_one_copy(router.stats()), core.stats());
        assert_eq!(a, b);
        assert!(a.counters.inflight_expired > 0, "expiry came due during the sequence");
        assert_eq!(expired, 0, "requests completed within the timeout were still in flight");
        assert_eq!(router.endpoints(), core.endpoints());
    }
}

/// A router's stats as a core's: a router keeps two copies of the precise index (lookups read
/// one while events and speculation are written into the other), a core one.
fn as_one_copy(mut s: RouterStats) -> RouterStats {
    assert_eq!(s.precise.copies, 2, "a router keeps two copies of the precise index");
    s.precise.copies = 1;
    s
}

/// A prompt routed again and again: the decisions' index writes become no-ops (a speculation
/// is extended once a quarter TTL has passed), so they book under the shared lock
/// (`RouterCore::commit_shared`) whenever no maintenance is due, at the same millisecond or a
/// later one. Alone, a `Router` still decides exactly as a `RouterCore`.
#[test]
fn one_thread_router_decides_as_the_core_on_repeated_prompts() {
    for policy in [HYBRID, APPROX] {
        let router = setup_router(policy);
        let mut core = setup_core(policy);
        let mut held: Vec<String> = Vec::new();
        for i in 0..800u64 {
            // Eight decisions per millisecond; 12 prompts over and over.
            let now = 1_000 + i / 8;
            let k = (i * 7) % 12;
            let event = (i % 97 == 5).then_some((k, i as usize / 97));
            held.push(step_both(&router, &mut core, event, k, now, i));
            if held.len() > 2 {
                let rid = held.remove(0);
                assert_eq!(router.complete(&rid), core.complete(&rid));
            }
        }
        assert_eq!(as_one_copy(router.stats()), core.stats());
        assert_eq!(router.endpoints(), core.endpoints());
    }
}

/// Route + complete from `threads` threads, each keeping a few requests in flight.
fn hammer(router: &Router, threads: u64, per_thread: u64, clock: &AtomicU64) -> Vec<String> {
    hammer_with(router, threads, per_thread, clock, 1, |i| i)
}

/// [`hammer`] where decision `i` routes prompt `prompt(i)` and the time moves by 1 ms every
/// `per_ms` decisions of a thread. Each thread's time moves with its own decisions (from the
/// clock's value at the start; the clock itself, which others may read, moves with everyone's):
/// a request a thread holds is then at most `per_thread / per_ms` ms old to any thread, however
/// the threads are scheduled, so none outlives the in-flight timeout on a busy machine (with
/// one clock for all, a thread held off its core while the others decided aged its requests
/// past the timeout).
fn hammer_with(
    router: &Router,
    threads: u64,
    per_thread: u64,
    clock: &AtomicU64,
    per_ms: u64,
    prompt: impl Fn(u64) -> u64 + Sync,
) -> Vec<String> {
    let prompt = &prompt;
    let start = clock.load(Ordering::Relaxed);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut ids = Vec::new();
                    let mut held = std::collections::VecDeque::new();
                    for k in 0..per_thread {
                        let i = prompt(t * per_thread + k);
                        clock.fetch_add(1, Ordering::Relaxed);
                        let now = (start + k) / per_ms;
                        let d = router.route_http(body(i).as_bytes(), headers(i), now).unwrap();
                        ids.push(d.request_id.clone());
                        held.push_back(d.request_id);
                        if held.len() > 3 {
                            router.complete(&held.pop_front().unwrap()).unwrap();
                        }
                    }
                    for rid in held {
                        router.complete(&rid).unwrap();
                    }
                    ids
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    })
}

fn assert_settled(router: &Router, decisions: u64) {
    let st = router.stats();
    assert_eq!(st.inflight_requests, 0);
    assert_eq!(st.counters.routed, decisions);
    assert_eq!(st.counters.decisions_by_rule.iter().sum::<u64>(), decisions);
    assert_eq!(st.counters.inflight_expired, 0);
    for e in router.endpoints() {
        assert_eq!(e.inflight, 0, "{}", e.id);
    }
}

#[test]
fn shared_router_counts_every_decision_once() {
    for policy in [HYBRID, APPROX] {
        let router = setup_router(policy);
        let clock = AtomicU64::new(1_000);
        let ids = hammer(&router, 4, 300, &clock);
        assert_eq!(ids.len(), 1200);
        assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 1200, "request ids are unique");
        assert_settled(&router, 1200);
        // Repeated prompts, 8 decisions per millisecond: most decisions book under the shared
        // lock, side by side.
        let router = setup_router(policy);
        let ids = hammer_with(&router, 4, 300, &AtomicU64::new(8_000), 8, |i| i % 10);
        assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 1200, "request ids are unique");
        assert_settled(&router, 1200);
    }
}

#[test]
fn shared_router_with_events_health_and_endpoint_churn() {
    let router = setup_router(HYBRID);
    let clock = AtomicU64::new(1_000);
    let stop = AtomicBool::new(false);
    let extra = "10.0.1.1:8000";
    let applied = std::thread::scope(|s| {
        let applier = s.spawn(|| {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let e = id((n as usize) % ENDPOINTS);
                router.apply_batch(&e, &stored(n), None, clock.load(Ordering::Relaxed)).unwrap();
                n += 1;
            }
            n
        });
        let churn = s.spawn(|| {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                router.upsert_endpoint(EndpointSpec::new(extra, Role::Decode)).unwrap();
                router.update_metrics(extra, metrics(0)).unwrap();
                router.set_healthy(&id(1), n % 2 == 0).unwrap();
                std::thread::yield_now();
                router.remove_endpoint(extra).unwrap();
                n += 1;
            }
            router.set_healthy(&id(1), true).unwrap();
        });
        let ids = hammer(&router, 2, 400, &clock);
        stop.store(true, Ordering::Relaxed);
        churn.join().unwrap();
        assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 800);
        applier.join().unwrap()
    });
    assert_settled(&router, 800);
    assert_eq!(router.stats().precise.batches, applied, "every batch applied once");
    assert_eq!(router.complete("kvr-1"), Err(StateError::UnknownRequest { request_id: "kvr-1".into() }));
}

/// A decision made while the thread's own thread-locals are being destroyed (from another
/// thread-local's destructor, as a host runtime's per-thread state may) routes normally instead of
/// panicking on the router's per-thread buffers.
#[test]
fn a_decision_from_a_thread_local_destructor_routes() {
    struct RoutesOnDrop(Option<(Arc<Router>, std::sync::mpsc::Sender<bool>)>);
    impl Drop for RoutesOnDrop {
        fn drop(&mut self) {
            if let Some((router, done)) = self.0.take() {
                let routed = router.route(&RouteRequest::text("m", &"x".repeat(4096)), 10).is_ok();
                let _ = done.send(routed);
            }
        }
    }
    std::thread_local! {
        static LATE: std::cell::RefCell<RoutesOnDrop> = const { std::cell::RefCell::new(RoutesOnDrop(None)) };
    }
    let router = Arc::new(Router::default());
    router.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let r = router.clone();
    std::thread::spawn(move || {
        // Registered first, destroyed last: after the router's buffers (registered by the
        // decision below).
        LATE.with(|l| l.borrow_mut().0 = Some((r.clone(), tx)));
        r.route(&RouteRequest::text("m", "hello"), 0).unwrap();
    })
    .join()
    .unwrap();
    assert!(rx.recv().unwrap(), "the late decision failed");
    assert_eq!(router.stats().inflight_requests, 2);
}

/// Stats read from each of a router's two copies of the precise index (`stats` reads the
/// published one; an empty batch at the sequence's last time is written into both and
/// publishes the other), the second with the empty batch's count taken off.
fn stats_of_both_copies(router: &Router) -> (RouterStats, RouterStats) {
    let empty = EventBatch { ts: 1.0, events: Vec::new(), data_parallel_rank: None };
    router.apply_batch(&id(0), &empty, None, 1_299).unwrap();
    let a = router.stats();
    router.apply_batch(&id(0), &empty, None, 1_299).unwrap();
    let mut b = router.stats();
    b.precise.batches -= 1;
    (a, b)
}

/// Events applied by two threads while two others route and complete on one router (precise
/// index, dual keys): the precise index's two copies end equal (every batch and every
/// speculation reached both, in one order), and every decision and batch was counted once.
#[test]
fn the_precise_copies_agree_after_events_beside_decisions() {
    const PRECISE: &str =
        r#"{"index":{"mode":"precise","speculative_ttl_ms":300},"metrics":{"staleness_ms":1000000000000}}"#;
    let router = Arc::new(setup_router(PRECISE));
    let appliers: Vec<_> = (0..2u64)
        .map(|t| {
            let r = router.clone();
            std::thread::spawn(move || {
                for k in 0..300u64 {
                    let i = t * 1000 + k;
                    r.apply_batch(&id((splitmix(i) % ENDPOINTS as u64) as usize), &stored(i % 40), None, 1_000 + k)
                        .unwrap();
                }
            })
        })
        .collect();
    let routers: Vec<_> = (0..2u64)
        .map(|t| {
            let r = router.clone();
            std::thread::spawn(move || {
                for k in 0..300u64 {
                    let i = (k * 7 + t) % 60;
                    let d = r.route_http(body(i).as_bytes(), headers(i), 1_000 + k).unwrap();
                    r.complete(&d.request_id).unwrap();
                }
            })
        })
        .collect();
    for h in appliers.into_iter().chain(routers) {
        h.join().unwrap();
    }
    let (a, b) = stats_of_both_copies(&router);
    assert_eq!(a, b, "the two copies agree");
    assert_eq!(a.precise.copies, 2);
    assert_eq!((a.precise.batches, a.counters.routed, a.inflight_requests), (601, 600, 0));
    assert!(a.precise.index.memberships > 0 && a.precise.speculative_requests > 0, "{:?}", a.precise);
}

/// `index.precise.two_copies`: a router keeps one copy when it is off, and a reload switching it
/// either way keeps the index (the second copy is a twin of the first, or dropped).
#[test]
fn two_copies_follow_the_policy_across_reloads() {
    const ONE: &str =
        r#"{"index":{"mode":"precise","precise":{"two_copies":false}},"metrics":{"staleness_ms":1000000000000}}"#;
    const TWO: &str = r#"{"index":{"mode":"precise"},"metrics":{"staleness_ms":1000000000000}}"#;
    let router = setup_router(ONE);
    let mut core = setup_core(ONE);
    for i in 0..20u64 {
        let e = id((i % ENDPOINTS as u64) as usize);
        assert_eq!(
            router.apply_batch(&e, &stored(i), None, 1_000 + i).unwrap(),
            core.apply_batch(&e, &stored(i), None, 1_000 + i).unwrap()
        );
    }
    let one = router.stats();
    assert_eq!(one.precise.copies, 1, "one copy when the policy says so");
    assert_eq!(one, core.stats());
    router.reload_str(TWO).unwrap();
    let (a, b) = stats_of_both_copies(&router);
    assert_eq!(a, b, "the second copy is a twin of the first");
    assert_eq!((a.precise.copies, a.precise.index), (2, one.precise.index), "the index is kept");
    for i in 0..40u64 {
        let d = router.route_http(body(i).as_bytes(), headers(i), 1_300 + i).unwrap();
        router.complete(&d.request_id).unwrap();
    }
    let (a, b) = stats_of_both_copies(&router);
    assert_eq!(a, b);
    // Bad input changes nothing: a batch from an unknown endpoint (beside lookups, into both
    // copies) and a policy whose `two_copies` is not a bool.
    let before = stats_of_both_copies(&router);
    assert!(matches!(
        router.apply_batch("10.9.9.9:1", &stored(1), None, 1_300),
        Err(StateError::UnknownEndpoint { .. })
    ));
    let bad = r#"{"index":{"mode":"precise","precise":{"two_copies":"yes"}}}"#;
    match router.reload_str(bad) {
        Err(kvroute::ConfigError::Parse { path, .. }) => assert_eq!(path, "index.precise.two_copies"),
        other => panic!("unexpected {other:?}"),
    }
    let (mut x, mut y) = stats_of_both_copies(&router);
    // Two more empty batches were applied; the rejected reload is counted.
    x.precise.batches -= 2;
    y.precise.batches -= 2;
    x.counters.reload_failures -= 1;
    y.counters.reload_failures -= 1;
    assert_eq!((x, y), before, "unchanged");
    router.reload_str(ONE).unwrap();
    let back = router.stats();
    assert_eq!(back.precise.copies, 1);
    assert_eq!(back.precise.index, a.precise.index, "the index is kept");
}

/// The ledger a generated id `kvr-N` is kept in (`(N - 1) mod 8`, see `ledger_of` in
/// `core/src/router/state.rs`).
fn ledger_of_generated(id: &str) -> u64 {
    let n: u64 = id.strip_prefix("kvr-").and_then(|n| n.parse().ok()).unwrap();
    (n - 1) % 8
}

/// Threads book into ledgers of their own, and a request routed on one thread completes on
/// another: its ledger follows from its id.
#[test]
fn requests_complete_on_any_thread() {
    let r = Router::new(Policy::default());
    for e in 0..2 {
        r.upsert_endpoint(EndpointSpec::new(id(e).as_str(), Role::Decode)).unwrap();
    }
    let req = RouteRequest::text("m", &"c".repeat(256 * 40));
    // The first decision writes the prompt's blocks (the exclusive lock); the others book on
    // the shared path, each thread into its home ledger.
    let first = r.route(&req, 5).unwrap();
    assert_eq!(ledger_of_generated(&first.request_id), 0, "the first thread's home is ledger 0");
    let routed: Vec<Vec<String>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..3)
            .map(|_| {
                let (r, req) = (&r, &req);
                sc.spawn(move || (0..50).map(|_| r.route(req, 5).unwrap().request_id).collect::<Vec<_>>())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let homes: HashSet<u64> = routed
        .iter()
        .map(|ids| {
            let ledgers: HashSet<u64> = ids.iter().map(|id| ledger_of_generated(id)).collect();
            assert_eq!(ledgers.len(), 1, "one thread, one ledger: {ids:?}");
            ledgers.into_iter().next().unwrap()
        })
        .collect();
    assert_eq!(homes, HashSet::from([1, 2, 3]), "each thread its own ledger");
    let all: HashSet<&String> = routed.iter().flatten().collect();
    assert_eq!(all.len(), 150, "every id unique");
    assert_eq!(r.stats().inflight_requests, 151);
    // Completed by other threads than the ones that routed them.
    std::thread::scope(|sc| {
        for ids in routed.iter().rev() {
            let r = &r;
            sc.spawn(move || ids.iter().for_each(|id| r.complete(id).unwrap()));
        }
    });
    r.complete(&first.request_id).unwrap();
    let stats = r.stats();
    assert_eq!((stats.inflight_requests, stats.counters.routed), (0, 151));
    assert!(r.endpoints().iter().all(|e| e.inflight == 0));
}

/// `limits.max_inflight_requests` holds across ledgers: a booking on the shared path takes a
/// place its ledger reserved (in batches, or one at a time near the bound), and one that would
/// pass the bound goes to the exclusive lock, which drops the oldest request.
#[test]
fn the_bound_on_requests_in_flight_holds_across_ledgers() {
    for (max, per_thread) in [(4u64, 100u64), (1024, 400)] {
        let r = Router::from_json(&format!(r#"{{"limits":{{"max_inflight_requests":{max}}}}}"#)).unwrap();
        r.upsert_endpoint(EndpointSpec::new(id(0).as_str(), Role::Decode)).unwrap();
        let req = RouteRequest::text("m", &"b".repeat(256 * 40));
        r.route(&req, 5).unwrap();
        std::thread::scope(|sc| {
            for _ in 0..4 {
                let (r, req) = (&r, &req);
                sc.spawn(move || {
                    for i in 0..per_thread {
                        r.route(req, 5).unwrap();
                        if i % 10 == 0 {
                            assert!(r.stats().inflight_requests as u64 <= max);
                        }
                    }
                });
            }
        });
        let stats = r.stats();
        let routed = 4 * per_thread + 1;
        assert_eq!(stats.inflight_requests as u64, max);
        assert_eq!(stats.counters.inflight_expired, routed - max);
        assert_eq!(u64::from(r.endpoints()[0].inflight), max, "the dropped requests left the endpoint's load");
    }
}
