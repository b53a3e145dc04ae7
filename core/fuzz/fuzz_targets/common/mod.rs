//! Shared set-up of the router-level fuzz targets: a small fleet, a policy per index mode, some
//! indexed state (metrics, KV events from the fixtures, one routed request) and the checks every
//! decision must pass.
#![allow(dead_code)]

use kvroute::{Decision, EndpointSpec, MetricsSnapshot, Mode, Outcome, Policy, Role, RouteError, Router};

/// The fleet: decode, colocated and prefill endpoints.
pub const ENDPOINTS: [(&str, Role); 4] = [
    ("10.0.0.1:8000", Role::Decode),
    ("10.0.0.2:8000", Role::Both),
    ("10.0.1.1:8000", Role::Prefill),
    ("[fd00::1]:8000", Role::Both),
];

/// Approximate and precise index budgets per endpoint of [`policy`] (small, so the fuzzer
/// reaches eviction).
pub const CAPACITY_BYTES: u64 = 16 << 10;
/// The dual-key map capacity of [`policy`].
pub const KEY_MAP_CAPACITY: usize = 2048;

/// KV-event batches from the fixtures (vLLM 0.23 and 0.33, SGLang).
pub const EVENT_BATCHES: [&[u8]; 6] = [
    include_bytes!("../../../../fixtures/events/vllm033_many_events.msgpack"),
    include_bytes!("../../../../fixtures/events/vllm033_removed_and_cleared.msgpack"),
    include_bytes!("../../../../fixtures/events/vllm033_offload_reannounce.msgpack"),
    include_bytes!("../../../../fixtures/events/vllm023_many_events.msgpack"),
    include_bytes!("../../../../fixtures/events/sglang_stored_pages.msgpack"),
    include_bytes!("../../../../fixtures/events/sglang_tiers_removed_cleared.msgpack"),
];

/// The policy for index mode `mode % 3` (approx, precise, hybrid), with small budgets.
pub fn policy(mode: u8) -> Policy {
    let mode = ["approx", "precise", "hybrid"][usize::from(mode % 3)];
    let text = format!(
        r#"{{"index": {{"mode": "{mode}", "block_tokens": 4, "capacity_bytes_per_endpoint": {CAPACITY_BYTES},
            "precise": {{"capacity_bytes_per_endpoint": {CAPACITY_BYTES}, "key_map_capacity": {KEY_MAP_CAPACITY},
                         "engine_block_tokens": 16, "index_block_tokens": 16}}}},
            "limits": {{"max_inflight_requests": 64}}}}"#
    );
    match Policy::from_json(&text) {
        Ok(p) => p,
        Err(e) => panic!("the fuzz policy is invalid: {e}"),
    }
}

/// A router over [`ENDPOINTS`] with [`policy`]`(mode)`, metrics for every endpoint, and (when
/// `with_state`) the fixture events applied and one request routed and completed.
pub fn router(mode: u8, with_state: bool) -> Router {
    let r = Router::new(policy(mode));
    for (i, (id, role)) in ENDPOINTS.iter().enumerate() {
        r.upsert_endpoint(EndpointSpec::new(*id, *role)).unwrap_or_else(|e| panic!("{id}: {e}"));
        let m = MetricsSnapshot {
            waiting: i as u32,
            running: 2,
            kv_usage: 0.2 * i as f64,
            updated_ms: 0,
            ..Default::default()
        };
        r.update_metrics(id, m).unwrap_or_else(|e| panic!("{id}: {e}"));
    }
    if with_state {
        for (i, batch) in EVENT_BATCHES.iter().enumerate() {
            let (id, _) = ENDPOINTS[i % ENDPOINTS.len()];
            // SGLang and vLLM fixtures may not fit the policy's block sizes: skipped events are fine.
            let _ = r.apply_events(id, batch, Some(i as u64 / 4), 10);
        }
        let body = br#"{"model": "m", "prompt": "the quick brown fox jumps over the lazy dog, again and again"}"#;
        if let Ok(d) = r.route_http(body, [("x-session-id", "s1")], 20) {
            if d.is_routed() {
                r.complete(&d.request_id).unwrap_or_else(|e| panic!("complete: {e}"));
            }
        }
    }
    r
}

/// Whether `id` is one of [`ENDPOINTS`].
pub fn known(id: &str) -> bool {
    ENDPOINTS.iter().any(|(e, _)| *e == id)
}

/// Check a decision: a routed one names known endpoints and completes exactly once; a shed one
/// names none. Errors must be typed (any `RouteError` is).
pub fn check(r: &Router, d: Result<Decision, RouteError>) {
    let d = match d {
        Ok(d) => d,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let _ = d.to_json();
    match &d.outcome {
        Outcome::Routed { endpoint, prefill_endpoint, mode } => {
            assert!(known(endpoint), "unknown target {endpoint}");
            if let Some(p) = prefill_endpoint {
                assert!(known(p), "unknown prefill endpoint {p}");
            }
            assert_eq!(prefill_endpoint.is_some(), *mode == Mode::Disaggregated, "prefill endpoint iff disaggregated");
            assert!((0.0..=1.0).contains(&d.prefix_hit), "prefix hit {}", d.prefix_hit);
            assert_eq!(d.scores.len(), d.endpoints.len());
            r.complete(&d.request_id).unwrap_or_else(|e| panic!("complete {}: {e}", d.request_id));
            assert!(r.complete(&d.request_id).is_err(), "a second complete of {} succeeded", d.request_id);
        }
        Outcome::Shed(shed) => assert_eq!(shed.status, 429),
    }
}

/// Check the router's figures: nothing in flight after every decision completed, every index
/// within its budget.
pub fn check_stats(r: &Router) {
    let s = r.stats();
    assert_eq!(s.inflight_requests, 0, "{s:?}");
    let n = s.endpoints as u64;
    let per_endpoint = CAPACITY_BYTES / kvroute::NOMINAL_BYTES_PER_MEMBERSHIP;
    assert!(s.index.memberships <= n * per_endpoint, "approx index over budget: {s:?}");
    assert!(
        s.precise.index.memberships <= n * per_endpoint + s.precise.speculative_blocks,
        "precise index over budget: {s:?}"
    );
    assert!(s.precise.mapped_engine_blocks <= KEY_MAP_CAPACITY as u64, "key map over capacity: {s:?}");
}
