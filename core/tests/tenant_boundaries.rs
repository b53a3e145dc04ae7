//! Tenant boundaries: session affinity, approximate-index keys and precise salts never let one
//! tenant's state steer or match another tenant's requests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute::{BlockStored, EventBatch, KvEvent, Medium};
use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Role, Router};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";

fn router(policy: &str) -> Router {
    let r = Router::new(Policy::from_json(policy).unwrap());
    for id in [A, B] {
        r.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
        r.update_metrics(id, MetricsSnapshot { kv_usage: 0.2, updated_ms: 0, ..Default::default() }).unwrap();
    }
    r
}

fn token_body(salt: Option<&str>) -> String {
    let mut b = serde_json::json!({"model": "m", "prompt": (0..1024).collect::<Vec<u32>>(), "max_tokens": 300});
    if let Some(s) = salt {
        b["cache_salt"] = s.into();
    }
    b.to_string()
}

fn chat(prompt: &str, salt: Option<&str>) -> String {
    let mut b = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 300});
    if let Some(s) = salt {
        b["cache_salt"] = s.into();
    }
    b.to_string()
}

#[test]
fn session_affinity_is_keyed_by_tenant_as_well_as_session_id() {
    let r = router("{}");
    let a = r
        .route_http(
            chat("tenant a's first turn", None).as_bytes(),
            [("x-session-id", "s1"), ("x-llm-d-inference-fairness-id", "tenant-a")],
            1,
        )
        .unwrap();
    r.complete(&a.request_id).unwrap();
    let here = a.endpoint().unwrap();
    // Tenant a's next turn is steered back by its session.
    let a2 = r
        .route_http(
            chat("tenant a's second turn", None).as_bytes(),
            [("x-session-id", "s1"), ("x-llm-d-inference-fairness-id", "tenant-a")],
            2,
        )
        .unwrap();
    r.complete(&a2.request_id).unwrap();
    assert!(a2.score(here).unwrap().session > 0.0);
    // Another tenant reusing the session id gets no affinity to tenant a's endpoint, by
    // fairness id or by cache_salt.
    for (salt, fairness) in [(None, "tenant-b"), (Some("salt-b"), "tenant-a")] {
        let b = r
            .route_http(
                chat("tenant b's first turn", salt).as_bytes(),
                [("x-session-id", "s1"), ("x-llm-d-inference-fairness-id", fairness)],
                3,
            )
            .unwrap();
        r.complete(&b.request_id).unwrap();
        assert!(b.scores.iter().all(|s| s.session == 0.0), "{fairness} {salt:?}: {:?}", b.scores);
    }
}

/// The approximate index's bucket fingerprint before issue 12: the high 32 bits of splitmix64's
/// finalizer of the key (a bijective mix, so equal fingerprints mean equal high halves).
fn fingerprint32(mut x: u64) -> u32 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((x ^ (x >> 31)) >> 32) as u32
}

#[test]
fn two_tenants_whose_first_keys_share_a_32_bit_fingerprint_share_nothing() {
    // Search salts until two give first block keys with the same 32-bit fingerprint (a birthday
    // search: ~2^16 salts), as an attacker choosing salts could.
    let policy = Policy::default();
    let i = &policy.config().index;
    let h = kvroute::ApproxHashing {
        block_tokens: i.block_tokens,
        bytes_per_token: i.bytes_per_token,
        hash_seed: i.hash_seed,
    };
    let prompt = "a shared system prompt, long enough for a few blocks of pseudo-tokens ".repeat(40);
    let mut seen = std::collections::HashMap::new();
    let mut keys = kvroute::RequestKeys::default();
    let mut pair = None;
    for n in 0..2_000_000u32 {
        let salt = format!("s{n}");
        let mut req = kvroute::RouteRequest::text("m", &prompt);
        req.cache_salt = Some(salt.clone());
        h.request_keys(&req, &mut keys);
        if let Some(other) = seen.insert(fingerprint32(keys.keys[0]), salt.clone()) {
            pair = Some((other, salt));
            break;
        }
    }
    let (s1, s2) = pair.expect("a colliding pair within 2M salts");
    let r = router(r#"{"index":{"mode":"approx"}}"#);
    let body = |salt: &str| {
        serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 300, "cache_salt": salt}).to_string()
    };
    let d1 = r.route_http(body(&s1).as_bytes(), [("x", "y")], 1).unwrap();
    r.complete(&d1.request_id).unwrap();
    let d2 = r.route_http(body(&s2).as_bytes(), [("x", "y")], 2).unwrap();
    assert!(
        d2.scores.iter().all(|s| s.matched_blocks == 0),
        "tenant {s2:?} matched tenant {s1:?}'s blocks: {:?}",
        d2.scores.iter().map(|s| s.matched_blocks).collect::<Vec<_>>()
    );
}

fn stored(base: u64, salt: Option<&str>, medium: Medium, with_tokens: bool) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: (0..64u64).map(|i| base + i).collect(),
        token_ids: if with_tokens { (0..1024).collect() } else { Vec::new() },
        block_size: 16,
        medium,
        cache_salt: salt.map(str::to_owned),
        ..Default::default()
    })
}

fn apply(r: &Router, ev: KvEvent, ts: f64) {
    r.apply_batch(A, &EventBatch { ts, events: vec![ev], data_parallel_rank: None }, None, 0).unwrap();
}

fn hit(r: &Router, salt: Option<&str>) -> u32 {
    let d = r.route_http(token_body(salt).as_bytes(), [("x", "y")], 10).unwrap();
    r.complete(&d.request_id).unwrap();
    d.score(A).unwrap().matched_blocks
}

/// A salted request matches only blocks whose event carried the same salt: never blocks stored
/// without one (the engine may have namespaced them apart, or they belong to an unsalted
/// tenant), in either mode that reads the precise index, on every tier, including offload
/// re-announcements that carry no salt of their own.
#[test]
fn salted_requests_never_match_blocks_whose_event_carried_no_salt() {
    for mode in ["precise", "hybrid"] {
        let r = router(&format!(r#"{{"index":{{"mode":"{mode}"}}}}"#));
        apply(&r, stored(1000, None, Medium::Gpu, true), 1.0);
        assert_eq!(hit(&r, Some("tenant-a")), 0, "{mode}: salted request, unsalted GPU blocks");
        assert_eq!(hit(&r, None), 64, "{mode}: the unsalted request still hits");
        let r = router(&format!(r#"{{"index":{{"mode":"{mode}"}}}}"#));
        apply(&r, stored(1000, None, Medium::Cpu, true), 1.0);
        assert_eq!(hit(&r, Some("tenant-a")), 0, "{mode}: salted request, unsalted offloaded blocks");
        // A salted tenant's blocks, offloaded: the offload event carries no salt (vLLM's
        // offloading events have no extra keys) but names engine blocks already mapped, which
        // keep their salted keys; the unsalted request matches none of them.
        let r = router(&format!(r#"{{"index":{{"mode":"{mode}"}}}}"#));
        apply(&r, stored(2000, Some("tenant-a"), Medium::Gpu, true), 1.0);
        apply(&r, stored(2000, None, Medium::Cpu, false), 2.0);
        apply(&r, stored(2000, None, Medium::Cpu, true), 3.0);
        assert_eq!(hit(&r, Some("tenant-a")), 64, "{mode}");
        assert_eq!(hit(&r, Some("tenant-b")), 0, "{mode}");
        assert_eq!(hit(&r, None), 0, "{mode}: unsalted request, a salted tenant's offloaded blocks");
    }
}
