//! Replicating routing state between router instances (`record_effects` / `apply_effect`), as
//! the Envoy filter's worker VMs do through shared data.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Role, RouteRequest, Router, RoutingEffect, Rule, StateError};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";
const P: &str = "10.0.1.1:8000";

fn router(policy: &str, prefill: bool) -> Router {
    let r = Router::new(Policy::from_json(policy).unwrap());
    let mut eps = vec![(A, Role::Decode), (B, Role::Decode)];
    if prefill {
        eps.push((P, Role::Prefill));
    }
    for (id, role) in eps {
        r.upsert_endpoint(EndpointSpec::new(id, role)).unwrap();
        r.update_metrics(id, MetricsSnapshot { kv_usage: 0.2, updated_ms: 0, ..Default::default() }).unwrap();
    }
    r
}

fn inflight(r: &Router, id: &str) -> u32 {
    r.endpoints().iter().find(|e| &*e.id == id).unwrap().inflight
}

fn token_body(n: u32) -> String {
    let ids: Vec<u32> = (0..n).collect();
    serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 300}).to_string()
}

#[test]
fn effects_are_off_by_default_and_absent_on_shed() {
    let r = router("{}", false);
    let d = r.route(&RouteRequest::text("m", &"x".repeat(4096)), 1).unwrap();
    assert!(d.effect.is_none());
    let r = router("{}", false);
    r.record_effects(true);
    for id in [A, B] {
        r.update_metrics(id, MetricsSnapshot { waiting: 500, kv_usage: 0.99, updated_ms: 0, ..Default::default() })
            .unwrap();
    }
    let mut req = RouteRequest::text("m", "hi");
    req.priority = -1;
    let d = r.route(&req, 1).unwrap();
    assert_eq!(d.rule, Rule::Shed);
    assert!(d.effect.is_none());
}

#[test]
fn an_applied_effect_gives_the_peer_the_same_residency_load_and_affinity() {
    let (a, b) = (router("{}", false), router("{}", false));
    a.record_effects(true);
    let prompt = "You are a helpful assistant. ".repeat(400);
    let mut req = RouteRequest::text("m", &prompt);
    req.session_id = Some("conversation-7".into());
    let d = a.route(&req, 10).unwrap();
    let target = d.endpoint().map(str::to_owned).unwrap();
    let effect = d.effect.clone().expect("recorded");
    assert_eq!((&*effect.target, effect.request_id.as_str()), (&*target, d.request_id.as_str()));

    // Before: the peer knows nothing about the prompt.
    let before = b.route(&req, 11).unwrap();
    assert_eq!(before.prefix_hit, 0.0);
    b.complete(&before.request_id).unwrap();
    let b = router("{}", false);

    // Through the wire format, as the filter ships it.
    let wire = effect.encode();
    b.apply_effect(&RoutingEffect::decode(&wire).unwrap()).unwrap();
    assert_eq!(inflight(&b, &target), 1);
    assert_eq!(b.stats().counters.effects_applied, 1);
    // Applying the same effect again (a replayed log entry) does not count the request twice.
    b.apply_effect(&effect).unwrap();
    assert_eq!(inflight(&b, &target), 1);

    let again = b.route(&req, 12).unwrap();
    assert_eq!(again.endpoint(), Some(&*target));
    assert_eq!(again.prefix_hit, 1.0);
    assert_eq!(again.rule, Rule::DecodeDirect);
    assert!(again.score(&target).unwrap().session > 0.0, "session affinity replicated");
    // Completion replicates by id.
    b.complete(&d.request_id).unwrap();
    b.complete(&again.request_id).unwrap();
    assert_eq!(inflight(&b, &target), 0);
}

#[test]
fn precise_speculation_and_prefill_load_replicate() {
    let policy = r#"{"index": {"mode": "precise"}, "modes": {"colocated_input_max_tokens": 64}}"#;
    let (a, b) = (router(policy, true), router(policy, true));
    for r in [&a, &b] {
        for id in [A, B] {
            // Busy decode endpoints: a colocated prefill would stall 8 running decodes.
            let m = MetricsSnapshot { running: 8, kv_usage: 0.3, updated_ms: 0, ..Default::default() };
            r.update_metrics(id, m).unwrap();
        }
    }
    a.record_effects(true);
    let d = a.route_http(token_body(1024).as_bytes(), [("x-request-id", "r1")], 10).unwrap();
    let e = d.effect.clone().unwrap();
    assert_eq!(e.precise_keys.len(), 64, "1024 tokens in 16-token blocks");
    assert_eq!(e.prefill.as_deref(), d.prefill_endpoint());
    assert_eq!(d.prefill_endpoint(), Some(P), "a long cold prompt is disaggregated");
    b.apply_effect(&e).unwrap();
    let target = d.endpoint().unwrap();
    assert_eq!(inflight(&b, P), 1);
    // The peer now sees the speculative entries the origin made: same match on the target.
    let on_a = a.route_http(token_body(1024).as_bytes(), [("x-request-id", "r2")], 20).unwrap();
    let on_b = b.route_http(token_body(1024).as_bytes(), [("x-request-id", "r2")], 20).unwrap();
    assert_eq!(on_a.score(target).unwrap().matched_blocks, 64);
    assert_eq!(on_b.score(target).unwrap().matched_blocks, 64);
    assert_eq!(on_a.endpoint(), on_b.endpoint());
    // Speculation expires on the peer as on the origin.
    let ttl = b.policy().policy.config().index.speculative_ttl_ms;
    let late = b.route_http(token_body(1024).as_bytes(), [("x-request-id", "r3")], 20 + ttl + 1).unwrap();
    assert_eq!(late.score(target).unwrap().matched_blocks, 0);
}

#[test]
fn keys_from_a_different_policy_are_not_applied() {
    let a = router(r#"{"index": {"block_tokens": 64}}"#, false);
    let b = router(r#"{"index": {"block_tokens": 128}}"#, false);
    a.record_effects(true);
    let d = a.route(&RouteRequest::text("m", &"y".repeat(8192)), 1).unwrap();
    b.apply_effect(d.effect.as_deref().unwrap()).unwrap();
    assert_eq!(b.stats().index.memberships, 0, "keys made under other hashing are skipped");
    assert_eq!(inflight(&b, d.endpoint().unwrap()), 1, "the load still counts");
}

#[test]
fn an_effect_for_an_unknown_endpoint_is_rejected_whole() {
    let a = router("{}", true);
    a.record_effects(true);
    let b = router("{}", false);
    let d = a.route(&RouteRequest::text("m", &"z".repeat(8192)), 1).unwrap();
    let mut e = (*d.effect.unwrap()).clone();
    e.prefill = Some(P.into());
    let err = b.apply_effect(&e).unwrap_err();
    assert!(matches!(err, StateError::UnknownEndpoint { ref id } if id == P), "{err}");
    assert_eq!(b.stats().inflight_requests, 0);
    assert_eq!(b.stats().index.memberships, 0);
}
