//! Unit tests of the router.
use super::*;
use crate::{decision, EndpointSpec, MetricsSnapshot, Role, RouteError, RouteRequest, Rule, StateError};

fn router() -> Router {
    let r = Router::default();
    r.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode)).unwrap();
    r.upsert_endpoint(EndpointSpec::new("10.0.0.2:8000", Role::Decode)).unwrap();
    r
}

/// A request's keys under `active`, made at `now_ms` (as a decision makes them first).
fn keys_of(active: &ActivePolicy, req: &RouteRequest, now_ms: u64) -> KeyBufs {
    let mut keys = KeyBufs::default();
    #[cfg(feature = "tokenizer")]
    prepare_keys(active, None, req, &mut keys, now_ms);
    #[cfg(not(feature = "tokenizer"))]
    prepare_keys(active, req, &mut keys, now_ms);
    keys
}

#[test]
fn router_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Router>();
}

#[test]
fn repeated_prompt_goes_to_the_same_endpoint_and_bypasses() {
    let r = router();
    let prompt = "x".repeat(256 * 40);
    let req = RouteRequest::text("m", &prompt);
    let d1 = r.route(&req, 0).unwrap();
    r.complete(&d1.request_id).unwrap();
    let d2 = r.route(&req, 1).unwrap();
    assert_eq!(d1.endpoint(), d2.endpoint());
    assert_eq!(d2.prefix_hit, 1.0);
    assert_eq!(d2.rule, Rule::DecodeDirect);
    assert_eq!(d2.header(decision::HEADER_MODE), Some("decode-direct"));
    assert_eq!(d2.header(decision::HEADER_DESTINATION), d2.endpoint());
}

#[test]
fn inflight_counts_follow_route_and_complete() {
    let r = router();
    let d = r.route(&RouteRequest::text("m", "hi"), 0).unwrap();
    let ep = d.endpoint().map(str::to_owned).unwrap();
    let count = |r: &Router| r.endpoints().iter().find(|e| *e.id == *ep).unwrap().inflight;
    assert_eq!(count(&r), 1);
    r.complete(&d.request_id).unwrap();
    assert_eq!(count(&r), 0);
    assert!(matches!(r.complete(&d.request_id), Err(StateError::UnknownRequest { .. })));
}

#[test]
fn reused_request_ids_are_made_unique() {
    let r = router();
    let mut req = RouteRequest::text("m", "hi");
    req.request_id = Some("abc".into());
    let a = r.route(&req, 0).unwrap();
    let b = r.route(&req, 0).unwrap();
    assert_eq!(a.request_id, "abc");
    assert_eq!(b.request_id, "abc~2");
    r.complete("abc").unwrap();
    r.complete("abc~2").unwrap();
    assert!(r.endpoints().iter().all(|e| e.inflight == 0));
}

#[test]
fn a_reused_request_id_costs_o1_probes_per_decision() {
    let r = Router::default();
    r.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode)).unwrap();
    let body = br#"{"model":"m","prompt":"hello"}"#;
    let n = 3000u64;
    let mut ids = std::collections::BTreeSet::new();
    for t in 0..n {
        ids.insert(r.route_http(body, [("x-request-id", "same")], t).unwrap().request_id);
    }
    assert_eq!(ids.len() as u64, n, "every decision got its own id");
    assert!(ids.contains("same") && ids.contains("same~2") && ids.contains(format!("same~{n}").as_str()));
    // One probe per reuse (the unfixed loop probed every earlier suffix: n²/2 in all).
    assert_eq!(r.lock().books.ledgers.iter().map(|l| l.ids.probes).sum::<u64>(), n - 1);
    // A suffix a caller supplied itself is skipped, not reused.
    r.route_http(body, [("x-request-id", format!("same~{}", n + 1).as_str())], n).unwrap();
    let d = r.route_http(body, [("x-request-id", "same")], n + 1).unwrap();
    assert_eq!(d.request_id, format!("same~{}", n + 2));
    for id in &ids {
        r.complete(id).unwrap();
    }
    // Once the original id is free again it is used as it is.
    assert_eq!(r.route_http(body, [("x-request-id", "same")], n + 2).unwrap().request_id, "same");
}

#[test]
fn inflight_entries_expire() {
    let r = router();
    let d = r.route(&RouteRequest::text("m", "hi"), 0).unwrap();
    let timeout = r.policy().policy.config().limits.inflight_timeout_ms;
    r.route(&RouteRequest::text("m", "ho"), timeout + 1).unwrap();
    assert!(matches!(r.complete(&d.request_id), Err(StateError::UnknownRequest { .. })));
    assert_eq!(r.stats().counters.inflight_expired, 1);
    assert_eq!(r.endpoints().iter().map(|e| e.inflight).sum::<u32>(), 1);
}

#[test]
fn endpoint_errors() {
    let r = router();
    assert!(matches!(
        r.upsert_endpoint(EndpointSpec::new("nope", Role::Decode)),
        Err(StateError::InvalidEndpointId { .. })
    ));
    assert!(matches!(r.remove_endpoint("10.9.9.9:1"), Err(StateError::UnknownEndpoint { .. })));
    assert!(matches!(
        r.update_metrics("10.9.9.9:1", MetricsSnapshot::default()),
        Err(StateError::UnknownEndpoint { .. })
    ));
    let bad = MetricsSnapshot { kv_usage: 2.0, ..Default::default() };
    assert!(matches!(r.update_metrics("10.0.0.1:8000", bad), Err(StateError::InvalidMetrics { .. })));
    assert_eq!(r.endpoints().len(), 2, "state unchanged");
    let empty = Router::default();
    assert!(matches!(empty.route(&RouteRequest::text("m", "x"), 0), Err(RouteError::NoEndpoints { .. })));
    let r2 = Router::new(Policy::from_json(r#"{"limits":{"max_endpoints":1}}"#).unwrap());
    r2.upsert_endpoint(EndpointSpec::new("10.0.0.1:1", Role::Both)).unwrap();
    assert_eq!(
        r2.upsert_endpoint(EndpointSpec::new("10.0.0.2:1", Role::Both)),
        Err(StateError::TooManyEndpoints { limit: 1 })
    );
}

#[test]
fn prefill_only_fleet_cannot_route() {
    let r = Router::default();
    r.upsert_endpoint(EndpointSpec::new("10.0.0.1:1", Role::Prefill)).unwrap();
    assert!(matches!(r.route(&RouteRequest::text("m", "x"), 0), Err(RouteError::NoEndpoints { .. })));
    assert_eq!(r.stats().counters.route_errors, 1);
}

/// The two phases apart, as two threads interleave them: a plan made before a change of
/// endpoints or health is made again by the write phase; one made before a metrics update is
/// applied as it is (the update counts as arriving just after the decision).
#[test]
fn a_plan_from_before_an_epoch_change_is_made_again() {
    let prompt = "y".repeat(256 * 40);
    let req = RouteRequest::text("m", &prompt);
    // Warm endpoint 1 with the prompt, then plan the same request (endpoint 1 wins on cache).
    let mut core = RouterCore::default();
    for id in ["10.0.0.1:8000", "10.0.0.2:8000"] {
        core.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
    }
    let d = core.route(&req, 0).unwrap();
    let warm = d.endpoint().unwrap().to_owned();
    let other = if warm == "10.0.0.1:8000" { "10.0.0.2:8000" } else { "10.0.0.1:8000" };
    core.complete(&d.request_id).unwrap();
    let active = core.policy().clone();
    let keys = keys_of(&active, &req, 1);
    let mut s = DecideScratch::default();
    let inflight = |c: &RouterCore, id: &str| c.endpoints().iter().find(|e| *e.id == *id).map_or(0, |e| e.inflight);

    // Health changes between the phases: the write phase plans again and avoids `warm`.
    let plan = core.plan(Some(&*core.kv.read()), core.books.view(&req), &active, &req, &keys, 1, &mut s);
    core.set_healthy(&warm, false).unwrap();
    let d = core.commit(&active, &req, &keys, plan, 1, &mut s).unwrap();
    assert_eq!(d.endpoint(), Some(other));
    assert_eq!((inflight(&core, &warm), inflight(&core, other)), (0, 1));
    core.complete(&d.request_id).unwrap();
    core.set_healthy(&warm, true).unwrap();

    // The endpoint planned for is removed between the phases: planned again, nothing is
    // counted on the removed endpoint.
    let plan = core.plan(Some(&*core.kv.read()), core.books.view(&req), &active, &req, &keys, 2, &mut s);
    core.remove_endpoint(&warm).unwrap();
    let d = core.commit(&active, &req, &keys, plan, 2, &mut s).unwrap();
    assert_eq!(d.endpoint(), Some(other));
    core.complete(&d.request_id).unwrap();
    core.upsert_endpoint(EndpointSpec::new(warm.as_str(), Role::Decode)).unwrap();

    // A metrics update between the phases does not move the epoch: the plan stands.
    let plan = core.plan(Some(&*core.kv.read()), core.books.view(&req), &active, &req, &keys, 3, &mut s);
    let planned = plan.target().expect("the request is routed");
    let busy = MetricsSnapshot { waiting: 50, kv_usage: 0.79, updated_ms: 3, ..Default::default() };
    let planned_id = core.endpoints.ids().nth(planned).map(|id| id.to_string()).unwrap();
    core.update_metrics(&planned_id, busy).unwrap();
    let d = core.commit(&active, &req, &keys, plan, 3, &mut s).unwrap();
    assert_eq!(d.endpoint(), Some(planned_id.as_str()));
    assert_eq!(core.stats().inflight_requests, 1);
}

/// The write phase books under the shared lock exactly when the plan's index writes are no-ops
/// and nothing else needs the exclusive lock; otherwise the plan comes back unapplied.
/// A completion as a `Router` makes it on the shared path: off the books, then off the loads.
fn complete_shared(core: &RouterCore, books: &mut Books, request_id: &str) {
    let hash = super::inflight::id_hash(request_id);
    let ledger = &mut books.ledgers[super::state::ledger_of(request_id, hash)];
    let Some(Ok(f)) = core.complete_shared(ledger, request_id, hash) else { panic!("{request_id} not in flight") };
    core.release(&f);
}

#[test]
fn a_repeated_prompt_books_under_the_shared_lock() {
    use super::state::Books;
    let prompt = "z".repeat(256 * 40);
    let req = RouteRequest::text("m", &prompt);
    let fresh = RouteRequest::text("m", &"w".repeat(256 * 40));
    let mut core = RouterCore::default();
    for id in ["10.0.0.1:8000", "10.0.0.2:8000"] {
        core.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
    }
    let d = core.route(&req, 5).unwrap();
    core.complete(&d.request_id).unwrap();
    let active = core.policy().clone();
    let (keys, fresh_keys) = (keys_of(&active, &req, 5), keys_of(&active, &fresh, 5));
    let mut s = DecideScratch::default();
    let index_before = core.stats().index;
    // The books kept apart, as a `Router` keeps them.
    let mut books = std::mem::replace(&mut core.books, Books::new(1));
    let routed = books.counters().routed;

    // Seen before on the endpoint that holds it, at the same time: booked under `&self`.
    let plan = core.plan(Some(&*core.kv.read()), books.view(&req), &active, &req, &keys, 5, &mut s);
    let Ok(shared) = core.commit_shared(&mut books.hold(0, 1_000_000), &active, &req, &keys, plan, 5, &s) else {
        panic!("not booked")
    };
    let shared = core.finish_shared(&active, &keys, shared, 5);
    assert_eq!(shared.endpoint(), d.endpoint());
    assert_eq!(books.counters().routed, routed + 1);
    assert_eq!(books.inflight_len(), 1);
    assert_eq!(core.stats().index, index_before, "the index is untouched");
    let load = |core: &RouterCore| {
        let slot = core.endpoints.slot_of(shared.endpoint().unwrap_or_default()).unwrap();
        core.endpoints.get(slot).map(|e| (e.load.inflight(), e.load.inflight_tokens(), e.load.waiting_now()))
    };
    let booked_load = load(&core);
    complete_shared(&core, &mut books, &shared.request_id);
    assert_eq!(books.inflight_len(), 0);
    let released = load(&core);
    assert!(
        matches!((booked_load, released), (Some((1, t, w)), Some((0, 0, v))) if t > 0 && v + 1 == w),
        "the completion takes the request off its endpoint's load: {booked_load:?} -> {released:?}"
    );
    // Completing it again (or any id not in flight) is a typed error that changes nothing.
    assert!(matches!(
        core.complete_shared(&mut books.ledgers[0], &shared.request_id, super::inflight::id_hash(&shared.request_id)),
        Some(Err(StateError::UnknownRequest { .. }))
    ));
    assert_eq!((load(&core), books.inflight_len()), (released, 0));

    // A prompt new to the index needs its blocks written: the exclusive lock.
    let plan = core.plan(Some(&*core.kv.read()), books.view(&fresh), &active, &fresh, &fresh_keys, 5, &mut s);
    assert!(core.commit_shared(&mut books.hold(0, 1_000_000), &active, &fresh, &fresh_keys, plan, 5, &s).is_err());
    // Later in time, with nothing due: still booked under `&self`; the speculation's clock moves.
    let plan = core.plan(Some(&*core.kv.read()), books.view(&req), &active, &req, &keys, 6, &mut s);
    let Ok(later) = core.commit_shared(&mut books.hold(0, 1_000_000), &active, &req, &keys, plan, 6, &s) else {
        panic!("not booked")
    };
    let later = core.finish_shared(&active, &keys, later, 6);
    assert_eq!((books.last_now_ms(), core.kv.read().speculation_now()), (6, Some(6)));
    complete_shared(&core, &mut books, &later.request_id);
    // Once a request in flight has timed out, maintenance is due: the exclusive lock.
    let timeout = active.policy.config().limits.inflight_timeout_ms;
    let plan = core.plan(Some(&*core.kv.read()), books.view(&req), &active, &req, &keys, 7, &mut s);
    let Ok(old) = core.commit_shared(&mut books.hold(0, 1_000_000), &active, &req, &keys, plan, 7, &s) else {
        panic!("not booked")
    };
    let old = core.finish_shared(&active, &keys, old, 7);
    let late = 8 + timeout;
    let plan = core.plan(Some(&*core.kv.read()), books.view(&req), &active, &req, &keys, late, &mut s);
    assert!(core.commit_shared(&mut books.hold(0, 1_000_000), &active, &req, &keys, plan, late, &s).is_err());
    complete_shared(&core, &mut books, &old.request_id);
    // An index written between the phases: the plan's no-op verdict no longer holds.
    let plan = core.plan(Some(&*core.kv.read()), books.view(&req), &active, &req, &keys, 5, &mut s);
    core.index.write();
    assert!(core.commit_shared(&mut books.hold(0, 1_000_000), &active, &req, &keys, plan, 5, &s).is_err());
    // Flow control routes under the exclusive lock.
    std::mem::swap(&mut core.books, &mut books);
    core.reload_str(r#"{"flow_control":{"enabled":true}}"#).unwrap();
    std::mem::swap(&mut core.books, &mut books);
    let active = core.policy().clone();
    let plan = core.plan(Some(&*core.kv.read()), books.view(&req), &active, &req, &keys, 5, &mut s);
    assert!(core.commit_shared(&mut books.hold(0, 1_000_000), &active, &req, &keys, plan, 5, &s).is_err());
}

#[test]
fn the_books_publish_what_a_sessionless_read_phase_reads() {
    // A decision's read phase reads the draws and the oldest start the ledgers published (see
    // `BooksCell`), not under their locks: the draws as the books hold them, the oldest start
    // at most the books' (lowered on the shared path, exact after every exclusive call).
    let r = router();
    // (published, exact) oldest starts.
    let published = |r: &Router| {
        let seen = r.books.published(0);
        let core = r.lock();
        assert_eq!(seen.0, core.books.draws(0), "the draws as the books hold them");
        let exact = core.books.oldest_started();
        assert!(seen.1.unwrap_or(u64::MAX) <= exact.unwrap_or(u64::MAX), "a lower bound: {seen:?} {exact:?}");
        (seen.1, exact)
    };
    // Taking the exclusive lock (as `published` does) publishes exactly.
    assert_eq!(published(&r), (None, None));
    let prompt = "q".repeat(256 * 40);
    let req = RouteRequest::text("m", &prompt);
    // A new prompt (its blocks written under the exclusive lock), then the same prompt again,
    // booked on the shared path; completions on the shared path leave the bound where it was.
    let first = r.route(&req, 5).unwrap();
    assert_eq!(r.books.published(0).1, Some(5));
    let second = r.route(&req, 6).unwrap();
    assert_eq!(r.books.published(0).1, Some(5));
    r.complete(&first.request_id).unwrap();
    assert_eq!(r.books.published(0).1, Some(5), "not raised on the shared path");
    assert_eq!(published(&r), (Some(5), Some(6)));
    assert_eq!(r.books.published(0).1, Some(6), "exact after an exclusive call");
    r.complete(&second.request_id).unwrap();
    assert_eq!(published(&r), (Some(6), None));
    // A request with a session reads the books' main part under its lock.
    let mut with_session = req.clone();
    with_session.session_id = Some("s-1".into());
    let third = r.route(&with_session, 7).unwrap();
    assert_eq!(r.books.published(0).1, Some(7), "lowered as the ledger's oldest request is older");
    assert_eq!(published(&r), (Some(7), Some(7)));
    // Once the request in flight has timed out, the published start sends the next decision to
    // the exclusive lock, which expires it.
    let timeout = r.policy().policy.config().limits.inflight_timeout_ms;
    let late = r.route(&req, 8 + timeout).unwrap();
    assert_eq!(r.books.published(0).1, Some(8 + timeout));
    assert!(matches!(r.complete(&third.request_id), Err(StateError::UnknownRequest { .. })));
    r.complete(&late.request_id).unwrap();
    assert_eq!(published(&r), (Some(8 + timeout), None));
    assert_eq!(r.books.published(0).1, None);
}

/// Where a request id is kept: generated ids in the ledger that made them, a reused id's
/// suffixes with it, anything else by its hash; a function of the id alone.
#[test]
fn every_id_has_one_ledger() {
    use super::inflight::id_hash;
    use super::state::{ledger_of, Ledger, LEDGERS};
    let of = |id: &str| ledger_of(id, id_hash(id));
    for home in 0..LEDGERS {
        let mut l = Ledger::new(home);
        for _ in 0..3 * LEDGERS {
            let id = l.generate_id(home);
            assert_eq!(of(&id), home, "{id}");
        }
    }
    assert_eq!(of("kvr-1"), 0);
    assert_eq!(of(&format!("kvr-{}", LEDGERS + 2)), 1);
    for base in ["abc", "kvr-3", "kvr-0", "kvr-x", "", "~", "a~b", "kvr-99999999999999999999999"] {
        for n in ["~2", "~17", "~2~3"] {
            assert_eq!(of(&format!("{base}{n}")), of(base), "{base}{n}");
        }
    }
    // Ids spread over the ledgers; a long run of suffixes is walked without recursion.
    let used: std::collections::BTreeSet<usize> = (0..256).map(|i| of(&format!("req-{i}"))).collect();
    assert_eq!(used.len(), LEDGERS);
    let long = format!("x{}", "~1".repeat(100_000));
    assert_eq!(of(&long), of("x"));
}

/// A thread keeps its home ledger in each of the routers it uses in turn (so one thread using
/// two routers books in each as a `RouterCore` would), and past the routers it remembers it gets
/// a new one, where its requests still complete.
#[test]
fn a_thread_keeps_its_home_ledger_in_each_router_it_uses() {
    use super::state::ledger_of;
    let mut routers: Vec<Router> = (0..2).map(|_| router()).collect();
    let req = RouteRequest::text("m", "hi");
    let ledger = |d: &Decision| ledger_of(&d.request_id, super::inflight::id_hash(&d.request_id));
    for _ in 0..3 {
        for r in &routers {
            let d = r.route(&req, 0).unwrap();
            assert_eq!(ledger(&d), 0, "{}", d.request_id);
            r.complete(&d.request_id).unwrap();
        }
    }
    routers.extend((0..super::HOMES_KEPT - 1).map(|_| router()));
    let mut held = Vec::new();
    for _ in 0..2 {
        for r in &routers {
            held.push((r, r.route(&req, 0).unwrap()));
        }
    }
    assert!(held.iter().any(|(_, d)| ledger(d) != 0), "past the routers kept, a new home");
    for (r, d) in held {
        r.complete(&d.request_id).unwrap();
    }
    assert!(routers.iter().all(|r| r.stats().inflight_requests == 0));
}

/// The two copies of a router's precise index (`kv_cell.rs`), and a core fed the same calls.
mod precise_copies {
    use super::*;
    use crate::index::{MatchScratch, MatchWeights, PrefixMatch};
    use crate::precise::events::{BlockRemoved, BlockStored, KvEvent, Medium};
    use crate::{Prompt, RequestKeys};

    const POLICY: &str = r#"{"index":{"mode":"precise"},"metrics":{"staleness_ms":1000000000000}}"#;
    const BLOCK: usize = 16;
    const ENDPOINTS: usize = 4;

    use crate::score::splitmix64 as splitmix;

    fn id(e: usize) -> String {
        format!("10.0.0.{}:8000", e + 1)
    }

    /// Conversation `c`'s prompt: one of 3 shared system prompts (128 tokens), then its own 384.
    fn prompt(c: u64) -> Vec<u32> {
        let sys = c % 3;
        (0..128u64)
            .map(|i| (splitmix(sys << 32 | i) % 50_000) as u32)
            .chain((0..384u64).map(|i| (splitmix(0xc0 << 40 | c << 16 | i) % 50_000) as u32))
            .collect()
    }

    /// Engine hash of block `i` of conversation `c` on endpoint `e`.
    fn engine_hash(e: usize, c: u64, i: usize) -> u64 {
        splitmix((e as u64) << 56 ^ c << 20 ^ i as u64)
    }

    /// A seeded stream of event batches: stores of conversations' prompts (in two parts, the
    /// second chained to the first), evictions of their tails and, rarely, a cleared endpoint.
    fn batches(seed: u64, n: usize) -> Vec<(usize, EventBatch)> {
        let mut out = Vec::with_capacity(n);
        for k in 0..n as u64 {
            let r = splitmix(seed ^ k);
            let e = (r % ENDPOINTS as u64) as usize;
            let c = (r >> 8) % 24;
            let toks = prompt(c);
            let event = match (r >> 16) % 16 {
                0..=8 => {
                    // The first 16 blocks, as a new chain.
                    KvEvent::BlockStored(BlockStored {
                        block_hashes: (0..16).map(|i| engine_hash(e, c, i)).collect(),
                        parent_block_hash: None,
                        token_ids: toks[..16 * BLOCK].to_vec(),
                        block_size: BLOCK as u32,
                        medium: Medium::Gpu,
                        ..Default::default()
                    })
                }
                9..=12 => KvEvent::BlockStored(BlockStored {
                    block_hashes: (16..32).map(|i| engine_hash(e, c, i)).collect(),
                    parent_block_hash: Some(engine_hash(e, c, 15)),
                    token_ids: toks[16 * BLOCK..].to_vec(),
                    block_size: BLOCK as u32,
                    medium: Medium::Gpu,
                    ..Default::default()
                }),
                13..=14 => KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: (8..32).map(|i| engine_hash(e, c, i)).collect(),
                    medium: Medium::Gpu,
                    ..Default::default()
                }),
                _ => KvEvent::AllBlocksCleared,
            };
            out.push((e, EventBatch { ts: k as f64, events: vec![event], data_parallel_rank: None }));
        }
        out
    }

    fn request(c: u64, turn: u64) -> RouteRequest {
        let mut p = prompt(c);
        p.extend((0..64u64).map(|i| (splitmix(turn << 32 | i) % 50_000) as u32));
        let mut req = RouteRequest::text("m", "");
        req.prompts = vec![Prompt::Tokens(p)];
        req.max_tokens = Some(64);
        req
    }

    fn add_endpoints(r: &Router) {
        for e in 0..ENDPOINTS {
            r.upsert_endpoint(EndpointSpec::new(id(e).as_str(), Role::Decode)).unwrap();
        }
    }

    /// Every copy's stats, per-slot memberships and matches of every conversation's prompt.
    fn copies_of(r: &Router) -> Vec<String> {
        let core = r.read();
        let active = core.policy().clone();
        let weights = MatchWeights::new(&active.policy.config().index.tier_weights);
        core.kv.each_copy(|kv| {
            let mut out = format!("{:?}\n", kv.stats());
            for s in 0..ENDPOINTS {
                out += &format!("slot {s}: {} memberships\n", kv.blocks().memberships_of(s));
            }
            for c in 0..24 {
                let (mut keys, mut scratch, mut m, mut ms) =
                    (RequestKeys::default(), Vec::new(), PrefixMatch::default(), MatchScratch::default());
                assert!(active.precise_keys.request_keys(&request(c, 0), &mut keys, &mut scratch));
                kv.match_blocks(&keys, &weights, &mut m, &mut ms);
                out += &format!("{c}: {:?}\n", m.slots());
            }
            out
        })
    }

    /// A core with every endpoint registered, its precise index in two copies when `two`.
    fn core_with_copies(two: bool) -> RouterCore {
        let mut core = RouterCore::from_json(POLICY).unwrap();
        for e in 0..ENDPOINTS {
            core.upsert_endpoint(EndpointSpec::new(id(e).as_str(), Role::Decode)).unwrap();
        }
        if two {
            core.kv = core.kv.into_shared(true);
        }
        core
    }

    /// A decision's read phase and its booking under the shared lock's rules, on a core.
    struct SharedDecision {
        active: Arc<ActivePolicy>,
        keys: KeyBufs,
        s: DecideScratch,
        books: super::super::state::Books,
        booking: Result<super::super::route::SharedBooking, super::super::route::Plan>,
    }

    /// Plan `req` on `core` at 5 ms and book it as a `Router` does under its shared lock
    /// (`commit_shared`), with the core's books taken out.
    fn decide_shared(core: &mut RouterCore, req: &RouteRequest) -> SharedDecision {
        let active = core.policy().clone();
        let keys = keys_of(&active, req, 5);
        let mut s = DecideScratch::default();
        let mut books = std::mem::replace(&mut core.books, super::super::state::Books::new(1));
        let plan = core.plan(Some(&*core.kv.read()), books.view(req), &active, req, &keys, 5, &mut s);
        let booking = core.commit_shared(&mut books.hold(0, 1_000_000), &active, req, &keys, plan, 5, &s);
        SharedDecision { active, keys, s, books, booking }
    }

    /// A decision that brings new blocks to the precise index books under the shared lock when
    /// the index has two copies, and its speculation reaches both; with one copy it goes back
    /// for the exclusive lock.
    #[test]
    fn new_precise_blocks_are_speculated_beside_lookups() {
        let req = request(5, 1);
        for two in [false, true] {
            let mut core = core_with_copies(two);
            let SharedDecision { active, keys, s, books, booking } = decide_shared(&mut core, &req);
            if !two {
                assert!(booking.is_err(), "one copy: speculation needs the exclusive lock");
                continue;
            }
            let Ok(b) = booking else { panic!("not booked beside lookups") };
            assert!(b.speculate, "the prompt's blocks are new");
            assert_eq!(core.kv.each_copy(|kv| kv.stats().speculative_blocks), vec![0, 0]);
            core.speculate_shared(&active, &keys, &b, &s, 5);
            let d = core.finish_shared(&active, &keys, b, 5);
            let spec = core.kv.each_copy(|kv| kv.stats().speculative_blocks);
            assert!(spec[0] > 0 && spec[0] == spec[1], "both copies speculate the prompt: {spec:?}");
            assert_eq!(books.inflight_len(), 1, "{}", d.request_id);
        }
    }

    /// A decision's speculation while another writer holds the copies (an event batch being
    /// applied) is handed to that writer, which writes it into both copies before it lets them
    /// go: the decision does not wait, and the copies end as a direct write leaves them.
    #[test]
    fn speculation_beside_a_writer_at_work_is_handed_to_it() {
        let req = request(5, 1);
        // Every endpoint holds the prompt's first 16 blocks: only the rest is speculated.
        let held = |core: &mut RouterCore| {
            for e in 0..ENDPOINTS {
                let stored = KvEvent::BlockStored(BlockStored {
                    block_hashes: (0..16).map(|i| engine_hash(e, 5, i)).collect(),
                    token_ids: prompt(5)[..16 * BLOCK].to_vec(),
                    block_size: BLOCK as u32,
                    medium: Medium::Gpu,
                    ..Default::default()
                });
                let batch = EventBatch { ts: 0.0, events: vec![stored], data_parallel_rank: None };
                core.apply_batch(&id(e), &batch, None, 1).unwrap();
            }
        };
        let mut core = core_with_copies(true);
        held(&mut core);
        let SharedDecision { active, keys, s, booking, .. } = decide_shared(&mut core, &req);
        let Ok(b) = booking else { panic!("not booked beside lookups") };
        assert!(b.speculate, "the prompt's blocks are new");
        core.kv.with_writer_at_work(|| {
            core.speculate_shared(&active, &keys, &b, &s, 5);
            assert_eq!(core.kv.pending_speculation(), 1, "handed to the writer at work");
            assert_eq!(core.kv.read().stats().speculative_blocks, 0, "not written yet");
        });
        assert_eq!(core.kv.pending_speculation(), 0);
        let handed = core.kv.each_copy(|kv| format!("{:?}", kv.stats()));
        let spec = core.kv.read().stats().speculative_blocks;
        assert!(spec > 0 && spec < 36, "the blocks past the 16 held, on the target: {spec}");
        // The same decision on a fresh core, its speculation written directly.
        let mut direct = core_with_copies(true);
        held(&mut direct);
        let SharedDecision { booking, .. } = decide_shared(&mut direct, &req);
        let Ok(b) = booking else { panic!("not booked beside lookups") };
        direct.speculate_shared(&active, &keys, &b, &s, 5);
        assert_eq!(direct.kv.each_copy(|kv| format!("{:?}", kv.stats())), handed, "handed over = written directly");
        assert_eq!(handed[0], handed[1], "both copies alike");
    }

    /// One thread: a router (events beside decisions, on two copies) and a core (one copy)
    /// given the same calls decide alike, and the router's copies agree.
    #[test]
    fn a_router_with_two_copies_decides_as_a_core() {
        let router = Router::from_json(POLICY).unwrap();
        let mut core = RouterCore::from_json(POLICY).unwrap();
        add_endpoints(&router);
        for e in 0..ENDPOINTS {
            core.upsert_endpoint(EndpointSpec::new(id(e).as_str(), Role::Decode)).unwrap();
        }
        let events = batches(7, 600);
        let mut open = Vec::new();
        for (k, (e, b)) in events.iter().enumerate() {
            let now = 1_000 + 3 * k as u64;
            let a = router.apply_batch(&id(*e), b, None, now).unwrap();
            assert_eq!(a, core.apply_batch(&id(*e), b, None, now).unwrap(), "batch {k}");
            if k % 2 == 0 {
                let req = request((k as u64 / 2) % 24, k as u64 % 5);
                let (x, y) = (router.route(&req, now + 1).unwrap(), core.route(&req, now + 1).unwrap());
                assert_eq!(x.to_json(), y.to_json(), "decision after batch {k}");
                open.push(x.request_id);
            }
            if k % 3 == 0 && !open.is_empty() {
                let done = open.remove(0);
                router.complete(&done).unwrap();
                core.complete(&done).unwrap();
            }
        }
        let copies = copies_of(&router);
        assert_eq!(copies.len(), 2);
        assert_eq!(copies[0], copies[1], "the router's copies agree");
        let core_copy = core.kv.each_copy(|kv| format!("{:?}", kv.stats()));
        assert!(copies[0].starts_with(&core_copy[0]), "the router's copies are the core's index");
        // The workload reached every kind of event, and decisions that wrote speculation.
        let st = router.stats().precise;
        assert!(st.blocks_stored > 0 && st.blocks_removed > 0 && st.orphan_blocks > 0, "{st:?}");
        assert_eq!(st.copies, 2);
    }
}

/// A thread's decisions hold its own copy of the roster (no reference count shared with other
/// threads), made again whenever the roster changes, and never another router's.
#[test]
fn a_threads_roster_copy_follows_the_roster_of_the_router_it_decides_for() {
    let ids = |d: &Decision| d.endpoints.iter().map(|e| e.to_string()).collect::<Vec<_>>();
    let a = router();
    let b = Router::default();
    b.upsert_endpoint(EndpointSpec::new("10.0.9.1:8000", Role::Decode)).unwrap();
    let req = RouteRequest::text("m", &"y".repeat(1024));
    let da = a.route(&req, 0).unwrap();
    assert_eq!(ids(&da), ["10.0.0.1:8000", "10.0.0.2:8000"]);
    // The table's own ids are not the decision's (the copy's are), and the copy is reused.
    let table: Vec<Arc<str>> = a.read().endpoints.ids().cloned().collect();
    assert!(da.endpoints.iter().zip(&table).all(|(d, t)| !Arc::ptr_eq(d, t)));
    let again = a.route(&req, 1).unwrap();
    assert!(Arc::ptr_eq(&da.endpoints, &again.endpoints));
    // The same thread, another router: that router's roster.
    let db = b.route(&req, 2).unwrap();
    assert_eq!((ids(&db), db.endpoint()), (vec!["10.0.9.1:8000".to_string()], Some("10.0.9.1:8000")));
    // Endpoints added and removed: the next decision sees the new roster.
    a.upsert_endpoint(EndpointSpec::new("10.0.0.3:8000", Role::Decode)).unwrap();
    a.remove_endpoint("10.0.0.1:8000").unwrap();
    let d = a.route(&req, 3).unwrap();
    assert_eq!(ids(&d), ["10.0.0.2:8000", "10.0.0.3:8000"]);
    assert!(d.endpoint().is_some_and(|e| e != "10.0.0.1:8000"));
    for d in [da, again, db, d] {
        let r = if d.endpoints.len() == 1 { &b } else { &a };
        r.complete(&d.request_id).unwrap();
    }
}
