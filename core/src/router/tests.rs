//! Unit tests of the router.
use super::*;
use crate::{decision, EndpointSpec, MetricsSnapshot, Role, RouteError, RouteRequest, Rule, StateError};

fn router() -> Router {
    let r = Router::default();
    r.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode)).unwrap();
    r.upsert_endpoint(EndpointSpec::new("10.0.0.2:8000", Role::Decode)).unwrap();
    r
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
    assert_eq!(r.lock().books.ids.probes, n - 1);
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
    let mut keys = KeyBufs::default();
    #[cfg(feature = "tokenizer")]
    prepare_keys(&active, None, &req, &mut keys, 1);
    #[cfg(not(feature = "tokenizer"))]
    prepare_keys(&active, &req, &mut keys, 1);
    let mut s = DecideScratch::default();
    let inflight = |c: &RouterCore, id: &str| c.endpoints().iter().find(|e| *e.id == *id).map_or(0, |e| e.inflight);

    // Health changes between the phases: the write phase plans again and avoids `warm`.
    let plan = core.plan(core.books.view(&req), &active, &req, &keys, 1, &mut s);
    core.set_healthy(&warm, false).unwrap();
    let d = core.commit(&active, &req, &keys, plan, 1, &mut s).unwrap();
    assert_eq!(d.endpoint(), Some(other));
    assert_eq!((inflight(&core, &warm), inflight(&core, other)), (0, 1));
    core.complete(&d.request_id).unwrap();
    core.set_healthy(&warm, true).unwrap();

    // The endpoint planned for is removed between the phases: planned again, nothing is
    // counted on the removed endpoint.
    let plan = core.plan(core.books.view(&req), &active, &req, &keys, 2, &mut s);
    core.remove_endpoint(&warm).unwrap();
    let d = core.commit(&active, &req, &keys, plan, 2, &mut s).unwrap();
    assert_eq!(d.endpoint(), Some(other));
    core.complete(&d.request_id).unwrap();
    core.upsert_endpoint(EndpointSpec::new(warm.as_str(), Role::Decode)).unwrap();

    // A metrics update between the phases does not move the epoch: the plan stands.
    let plan = core.plan(core.books.view(&req), &active, &req, &keys, 3, &mut s);
    let planned = plan.target().expect("the request is routed");
    let busy = MetricsSnapshot { waiting: 50, kv_usage: 0.79, updated_ms: 3, ..Default::default() };
    let planned_id = core.endpoints.roster()[planned].to_string();
    core.update_metrics(&planned_id, busy).unwrap();
    let d = core.commit(&active, &req, &keys, plan, 3, &mut s).unwrap();
    assert_eq!(d.endpoint(), Some(planned_id.as_str()));
    assert_eq!(core.stats().inflight_requests, 1);
}

/// The write phase books under the shared lock exactly when the plan's index writes are no-ops
/// and nothing else needs the exclusive lock; otherwise the plan comes back unapplied.
/// A completion as a `Router` makes it on the shared path: off the books, then off the loads.
fn complete_shared(core: &RouterCore, books: &mut Books, request_id: &str) {
    let Some(Ok(f)) = core.complete_shared(books, request_id) else { panic!("{request_id} not in flight") };
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
    let keys_of = |req: &RouteRequest| {
        let mut keys = KeyBufs::default();
        #[cfg(feature = "tokenizer")]
        prepare_keys(&active, None, req, &mut keys, 5);
        #[cfg(not(feature = "tokenizer"))]
        prepare_keys(&active, req, &mut keys, 5);
        keys
    };
    let (keys, fresh_keys) = (keys_of(&req), keys_of(&fresh));
    let mut s = DecideScratch::default();
    let index_before = core.stats().index;
    // The books kept apart, as a `Router` keeps them.
    let mut books = std::mem::replace(&mut core.books, Books::new(1));
    let routed = books.counters.routed;

    // Seen before on the endpoint that holds it, at the same time: booked under `&self`.
    let plan = core.plan(books.view(&req), &active, &req, &keys, 5, &mut s);
    let Ok(shared) = core.commit_shared(&mut books, &active, &req, &keys, plan, 5, &s) else { panic!("not booked") };
    let shared = core.finish_shared(&active, &keys, shared, 5);
    assert_eq!(shared.endpoint(), d.endpoint());
    assert_eq!(books.counters.routed, routed + 1);
    assert_eq!(books.inflight.len(), 1);
    assert_eq!(core.stats().index, index_before, "the index is untouched");
    let load = |core: &RouterCore| {
        let slot = core.endpoints.slot_of(shared.endpoint().unwrap_or_default()).unwrap();
        core.endpoints.get(slot).map(|e| (e.load.inflight(), e.load.inflight_tokens(), e.load.waiting_now()))
    };
    let booked_load = load(&core);
    complete_shared(&core, &mut books, &shared.request_id);
    assert_eq!(books.inflight.len(), 0);
    let released = load(&core);
    assert!(
        matches!((booked_load, released), (Some((1, t, w)), Some((0, 0, v))) if t > 0 && v + 1 == w),
        "the completion takes the request off its endpoint's load: {booked_load:?} -> {released:?}"
    );
    // Completing it again (or any id not in flight) is a typed error that changes nothing.
    assert!(matches!(
        core.complete_shared(&mut books, &shared.request_id),
        Some(Err(StateError::UnknownRequest { .. }))
    ));
    assert_eq!((load(&core), books.inflight.len()), (released, 0));

    // A prompt new to the index needs its blocks written: the exclusive lock.
    let plan = core.plan(books.view(&fresh), &active, &fresh, &fresh_keys, 5, &mut s);
    assert!(core.commit_shared(&mut books, &active, &fresh, &fresh_keys, plan, 5, &s).is_err());
    // Later in time, with nothing due: still booked under `&self`; the speculation's clock moves.
    let plan = core.plan(books.view(&req), &active, &req, &keys, 6, &mut s);
    let Ok(later) = core.commit_shared(&mut books, &active, &req, &keys, plan, 6, &s) else { panic!("not booked") };
    let later = core.finish_shared(&active, &keys, later, 6);
    assert_eq!((books.last_now_ms, core.kv.speculation_now()), (6, Some(6)));
    complete_shared(&core, &mut books, &later.request_id);
    // Once a request in flight has timed out, maintenance is due: the exclusive lock.
    let timeout = active.policy.config().limits.inflight_timeout_ms;
    let plan = core.plan(books.view(&req), &active, &req, &keys, 7, &mut s);
    let Ok(old) = core.commit_shared(&mut books, &active, &req, &keys, plan, 7, &s) else { panic!("not booked") };
    let old = core.finish_shared(&active, &keys, old, 7);
    let late = 8 + timeout;
    let plan = core.plan(books.view(&req), &active, &req, &keys, late, &mut s);
    assert!(core.commit_shared(&mut books, &active, &req, &keys, plan, late, &s).is_err());
    complete_shared(&core, &mut books, &old.request_id);
    // An index written between the phases: the plan's no-op verdict no longer holds.
    let plan = core.plan(books.view(&req), &active, &req, &keys, 5, &mut s);
    core.index.write();
    assert!(core.commit_shared(&mut books, &active, &req, &keys, plan, 5, &s).is_err());
    // Flow control routes under the exclusive lock.
    std::mem::swap(&mut core.books, &mut books);
    core.reload_str(r#"{"flow_control":{"enabled":true}}"#).unwrap();
    std::mem::swap(&mut core.books, &mut books);
    let active = core.policy().clone();
    let plan = core.plan(books.view(&req), &active, &req, &keys, 5, &mut s);
    assert!(core.commit_shared(&mut books, &active, &req, &keys, plan, 5, &s).is_err());
}

#[test]
fn decisions_under_way_are_summed_over_every_stripe() {
    let r = router();
    assert_eq!(r.decisions(Ordering::SeqCst), (0, 0));
    // This thread's guards count on its stripe.
    let (a, b) = (r.deciding(), r.deciding());
    assert_eq!(r.decisions(Ordering::SeqCst), (2, 0));
    drop(a);
    assert_eq!(r.decisions(Ordering::SeqCst), (1, 1));
    drop(b);
    assert_eq!(r.decisions(Ordering::SeqCst), (0, 2));
    // Other threads' stripes (written here as their guards would), finished counts wrapping
    // at 2^32 on their own: the sum is exact mod 2^32.
    let mine = STRIPE.with(|s| *s);
    let (x, y) = ((mine + 1) % DECIDING_STRIPES, (mine + 5) % DECIDING_STRIPES);
    r.deciding[x].0.store((u64::from(u32::MAX) << 32) | 3, Ordering::SeqCst);
    r.deciding[y].0.store((7 << 32) | 1, Ordering::SeqCst);
    assert_eq!(r.decisions(Ordering::SeqCst), (4, 2u32.wrapping_add(u32::MAX).wrapping_add(7)));
    let (_, before) = r.decisions(Ordering::SeqCst);
    // One of x's decisions finishes: its finished count wraps to 0, the sum moves by one.
    r.deciding[x].0.fetch_add(DECIDED - 1, Ordering::SeqCst);
    let (under_way, after) = r.decisions(Ordering::SeqCst);
    assert_eq!((under_way, after.wrapping_sub(before)), (3, 1));
    assert_eq!(r.deciding[x].0.load(Ordering::SeqCst), 2);
}

#[test]
fn the_books_publish_what_a_sessionless_read_phase_reads() {
    // A request without a session plans from the values the books published at their last
    // unlock (`BooksCell`), not under their lock: after every call they must be the books'.
    let r = router();
    let published = |r: &Router| {
        let seen = r.books.published();
        let books = r.books();
        assert_eq!(seen, (books.draws(), books.oldest_started()), "published as the books hold them");
        seen.1
    };
    assert_eq!(published(&r), None);
    let prompt = "q".repeat(256 * 40);
    let req = RouteRequest::text("m", &prompt);
    // A new prompt (its blocks written under the exclusive lock), then the same prompt again,
    // booked on the shared path.
    let first = r.route(&req, 5).unwrap();
    assert_eq!(published(&r), Some(5));
    let second = r.route(&req, 6).unwrap();
    assert_eq!(published(&r), Some(5));
    r.complete(&first.request_id).unwrap();
    assert_eq!(published(&r), Some(6));
    r.complete(&second.request_id).unwrap();
    assert_eq!(published(&r), None);
    // A request with a session reads the books under their lock; an exclusive call republishes.
    let mut with_session = req.clone();
    with_session.session_id = Some("s-1".into());
    let third = r.route(&with_session, 7).unwrap();
    assert_eq!(published(&r), Some(7));
    r.update_metrics("10.0.0.1:8000", MetricsSnapshot { updated_ms: 7, ..MetricsSnapshot::default() }).unwrap();
    assert_eq!(published(&r), Some(7));
    // Once the request in flight has timed out, the published start sends the next decision to
    // the exclusive lock, which expires it.
    let timeout = r.policy().policy.config().limits.inflight_timeout_ms;
    let late = r.route(&req, 8 + timeout).unwrap();
    assert_eq!(published(&r), Some(8 + timeout));
    assert!(matches!(r.complete(&third.request_id), Err(StateError::UnknownRequest { .. })));
    r.complete(&late.request_id).unwrap();
    assert_eq!(published(&r), None);
}
