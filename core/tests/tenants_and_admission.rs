//! Tenant isolation (cache_salt) and admission (shedding sheddable requests when saturated).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use kvroute::{ApproxHashing, EndpointSpec, MetricsSnapshot, Policy, RequestKeys, Role, RouteRequest, Router, Rule};

fn body(prompt: &str, salt: Option<&str>) -> String {
    let mut b = serde_json::json!({"model": "llama", "prompt": prompt, "max_tokens": 400});
    if let Some(s) = salt {
        b["cache_salt"] = s.into();
    }
    b.to_string()
}

#[test]
fn different_cache_salts_never_share_index_keys() {
    let policy = Policy::default();
    let i = &policy.config().index;
    let h = ApproxHashing { block_tokens: i.block_tokens, bytes_per_token: i.bytes_per_token, hash_seed: i.hash_seed };
    let prompt = "identical prompt text across tenants ".repeat(300);
    let mut all: Vec<BTreeSet<u64>> = Vec::new();
    for salt in [None, Some("tenant-a"), Some("tenant-b"), Some(" ")] {
        let mut req = RouteRequest::text("llama", &prompt);
        req.cache_salt = salt.map(str::to_owned);
        let mut keys = RequestKeys::default();
        h.request_keys(&req, &mut keys);
        assert!(keys.keys.len() > 10);
        all.push(keys.keys.iter().copied().collect());
    }
    for a in 0..all.len() {
        for b in a + 1..all.len() {
            assert!(all[a].is_disjoint(&all[b]), "salts {a} and {b} share keys");
        }
    }
}

#[test]
fn a_tenant_never_hits_another_tenants_cache() {
    let router = Router::default();
    router.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode)).unwrap();
    router.upsert_endpoint(EndpointSpec::new("10.0.0.2:8000", Role::Decode)).unwrap();
    let prompt = "identical prompt text across tenants ".repeat(300);
    let a = router.route_http(body(&prompt, Some("tenant-a")).as_bytes(), [("k", "v")], 0).unwrap();
    router.complete(&a.request_id).unwrap();
    let b = router.route_http(body(&prompt, Some("tenant-b")).as_bytes(), [("k", "v")], 1).unwrap();
    router.complete(&b.request_id).unwrap();
    assert!(b.scores.iter().all(|s| s.prefix_hit == 0.0), "tenant b sees nothing of tenant a");
    let a2 = router.route_http(body(&prompt, Some("tenant-a")).as_bytes(), [("k", "v")], 2).unwrap();
    assert_eq!(a2.prefix_hit, 1.0, "tenant a still hits its own cache");
    assert_eq!(a2.endpoint(), a.endpoint());
    let none = router.route_http(body(&prompt, None).as_bytes(), [("k", "v")], 3).unwrap();
    assert!(none.scores.iter().all(|s| s.prefix_hit == 0.0), "unsalted requests share nothing with salted ones");
}

/// vLLM hashes an empty `cache_salt` as no salt (`if request.cache_salt` in
/// `vllm/v1/core/kv_cache_utils.py`), so the router must too: in the approximate keys, whether the
/// request was parsed from HTTP or built directly.
#[test]
fn an_empty_cache_salt_is_no_salt_in_approximate_keys() {
    let policy = Policy::default();
    let i = &policy.config().index;
    let h = ApproxHashing { block_tokens: i.block_tokens, bytes_per_token: i.bytes_per_token, hash_seed: i.hash_seed };
    let prompt = "identical prompt text across tenants ".repeat(300);
    let mut req = RouteRequest::text("llama", &prompt);
    let (mut none, mut empty) = (RequestKeys::default(), RequestKeys::default());
    h.request_keys(&req, &mut none);
    req.cache_salt = Some(String::new());
    h.request_keys(&req, &mut empty);
    assert!(none.keys.len() > 10);
    assert_eq!(none, empty);

    let router = Router::default();
    router.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode)).unwrap();
    router.upsert_endpoint(EndpointSpec::new("10.0.0.2:8000", Role::Decode)).unwrap();
    let a = router.route_http(body(&prompt, None).as_bytes(), [("k", "v")], 0).unwrap();
    router.complete(&a.request_id).unwrap();
    let b = router.route_http(body(&prompt, Some("")).as_bytes(), [("k", "v")], 1).unwrap();
    assert_eq!((b.prefix_hit, &b.endpoint()), (1.0, &a.endpoint()), "\"\" hits the unsalted cache");
    router.complete(&b.request_id).unwrap();
    req.cache_salt = Some(String::new());
    let c = router.route(&req, 2).unwrap();
    assert_eq!(c.prefix_hit, 1.0, "a directly built request with Some(\"\") too");
}

/// The same in the dual-key precise index: an engine event chain rooted with an empty salt and a
/// request without one (or the other way round) are the same chain.
#[test]
fn an_empty_cache_salt_is_no_salt_in_dual_keys() {
    use kvroute::{BlockStored, EventBatch, KvEvent, Medium};
    let stored = |salt: Option<&str>| {
        KvEvent::BlockStored(BlockStored {
            block_hashes: (0..8).map(|i| 900 + i).collect(),
            parent_block_hash: None,
            token_ids: (0..128).collect(),
            block_size: 16,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            group_idx: None,
            cache_salt: salt.map(str::to_owned),
            ..Default::default()
        })
    };
    let ids: Vec<u32> = (0..128).collect();
    for (event_salt, body_salt) in [(Some(""), None), (None, Some("")), (Some(""), Some(""))] {
        let router = Router::new(Policy::from_json(r#"{"index":{"mode":"precise"}}"#).unwrap());
        for id in ["10.0.0.1:8000", "10.0.0.2:8000"] {
            router.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
            router.update_metrics(id, MetricsSnapshot { kv_usage: 0.2, ..Default::default() }).unwrap();
        }
        let batch = EventBatch { ts: 1.0, events: vec![stored(event_salt)], data_parallel_rank: None };
        router.apply_batch("10.0.0.2:8000", &batch, Some(0), 0).unwrap();
        let mut b = serde_json::json!({"model": "llama", "prompt": ids, "max_tokens": 400});
        if let Some(s) = body_salt {
            b["cache_salt"] = s.into();
        }
        let d = router.route_http(b.to_string().as_bytes(), [("k", "v")], 1).unwrap();
        let s = d.score("10.0.0.2:8000").unwrap();
        assert!(s.precise);
        assert_eq!((s.matched_blocks, d.prefix_hit), (8, 1.0), "event salt {event_salt:?}, body salt {body_salt:?}");
        assert_eq!(d.endpoint(), Some("10.0.0.2:8000"));
    }
}

fn saturated_router(waiting: u32, kv: f64, updated_ms: u64) -> Router {
    let router = Router::default();
    for (i, id) in ["10.0.0.1:8000", "10.0.0.2:8000"].iter().enumerate() {
        router.upsert_endpoint(EndpointSpec::new(*id, Role::Decode)).unwrap();
        let m = MetricsSnapshot { waiting: waiting + i as u32, kv_usage: kv, updated_ms, ..Default::default() };
        router.update_metrics(id, m).unwrap();
    }
    router
}

#[test]
fn sheddable_requests_are_shed_only_when_saturated() {
    let p = body("hello", None);
    // Queue 5 and 6 against threshold 5 → saturation 1.1.
    let r = saturated_router(5, 0.1, 1000);
    let d = r.route_http(p.as_bytes(), [("x-kvroute-priority", "-1")], 1000).unwrap();
    assert_eq!(d.rule, Rule::Shed);
    assert_eq!(d.mode(), None);
    assert_eq!(d.endpoint(), None);
    let shed = d.shed().unwrap();
    assert_eq!(shed.status, 429);
    assert!(shed.reason.contains("saturated"), "{}", shed.reason);
    assert_eq!(d.header("x-kvroute-shed-reason"), Some(shed.reason.as_str()));
    assert!((d.saturation - 1.1).abs() < 1e-9);
    assert!(
        r.endpoints().iter().all(|e| e.inflight == 0 && e.index_memberships == 0),
        "a shed request leaves no trace"
    );
    // Priority 0 and positive are admitted at the same saturation.
    for prio in ["0", "3"] {
        let d = r.route_http(p.as_bytes(), [("x-kvroute-priority", prio)], 1000).unwrap();
        assert_ne!(d.rule, Rule::Shed);
        assert!(d.endpoint().is_some());
    }
    // KV usage saturates too (0.8 threshold).
    let r = saturated_router(0, 0.85, 1000);
    assert_eq!(r.route_http(p.as_bytes(), [("x-kvroute-priority", "-5")], 1000).unwrap().rule, Rule::Shed);
    // Below saturation nothing is shed.
    let r = saturated_router(1, 0.5, 1000);
    assert_ne!(r.route_http(p.as_bytes(), [("x-kvroute-priority", "-5")], 1000).unwrap().rule, Rule::Shed);
    // Stale metrics count as saturated.
    let r = saturated_router(0, 0.1, 0);
    assert_eq!(r.route_http(p.as_bytes(), [("x-kvroute-priority", "-1")], 60_000).unwrap().rule, Rule::Shed);
    // Shedding can be switched off.
    let r = saturated_router(9, 0.1, 1000);
    r.reload_str(r#"{"admission":{"shed_sheddable":false}}"#).unwrap();
    assert_ne!(r.route_http(p.as_bytes(), [("x-kvroute-priority", "-1")], 1000).unwrap().rule, Rule::Shed);
    assert_eq!(r.stats().counters.decisions_by_rule[6], 0);
}
