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
    assert_eq!(r.lock().ids.probes, n - 1);
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
