//! Routing on the event-fed precise index: approx / precise / hybrid modes, speculation,
//! tiers, and stream health seen through the router.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute::StreamVerdict;
use kvroute::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kvroute::{EndpointSpec, MetricsSnapshot, Mode, Policy, Role, Router, Rule};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";

fn router(mode: &str) -> Router {
    let r = Router::new(Policy::from_json(&format!(r#"{{"index":{{"mode":"{mode}"}}}}"#)).unwrap());
    for (id, w) in [(A, 1), (B, 0)] {
        r.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
        r.update_metrics(id, MetricsSnapshot { waiting: w, kv_usage: 0.2, updated_ms: 0, ..Default::default() })
            .unwrap();
    }
    r
}

/// A completions body with token ids 0..n.
fn body(n: u32) -> String {
    let ids: Vec<u32> = (0..n).collect();
    serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 300}).to_string()
}

/// BlockStored for `blocks` engine blocks of 16 tokens starting at token `first`, with made-up
/// engine hashes `base + i` chained from `parent`.
fn stored(base: u64, blocks: u32, first: u32, parent: Option<u64>, medium: Medium) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: (0..u64::from(blocks)).map(|i| base + i).collect(),
        parent_block_hash: parent,
        token_ids: (first..first + 16 * blocks).collect(),
        block_size: 16,
        lora_id: None,
        medium,
        lora_name: None,
        group_idx: None,
        cache_salt: None,
        ..Default::default()
    })
}

fn batch(ts: f64, events: Vec<KvEvent>) -> EventBatch {
    EventBatch { ts, events, data_parallel_rank: None }
}

#[test]
fn precise_mode_routes_to_the_endpoint_whose_engine_holds_the_prefix() {
    let r = router("precise");
    // B's engine holds the first 48 of 64 blocks (B also has the shorter queue, but A is what
    // we will make win through the cache, so give A the blocks).
    r.apply_batch(A, &batch(1.0, vec![stored(1000, 48, 0, None, Medium::Gpu)]), Some(0), 10).unwrap();
    let d = r.route_http(body(1024).as_bytes(), [("x", "y")], 20).unwrap();
    assert_eq!(d.endpoint(), Some(A));
    let a = d.score(A).unwrap();
    assert!(a.precise);
    assert_eq!((a.matched_blocks, a.cached_tokens), (48, 768));
    assert!((a.prefix_hit - 0.75).abs() < 1e-12);
    assert_eq!(d.score(B).unwrap().matched_blocks, 0);
    // The rest arrives; the repeat is a full hit: decode-direct.
    r.complete(&d.request_id).unwrap();
    r.apply_batch(A, &batch(2.0, vec![stored(2000, 16, 768, Some(1047), Medium::Gpu)]), Some(1), 30).unwrap();
    let d = r.route_http(body(1024).as_bytes(), [("x", "y")], 40).unwrap();
    assert_eq!((d.prefix_hit, d.rule, d.mode()), (1.0, Rule::DecodeDirect, Some(Mode::DecodeDirect)));
}

#[test]
fn offloaded_blocks_count_at_their_tier_weight() {
    let r = router("precise");
    r.apply_batch(B, &batch(1.0, vec![stored(1000, 64, 0, None, Medium::Cpu)]), None, 0).unwrap();
    let d = r.route_http(body(1024).as_bytes(), [("x", "y")], 5).unwrap();
    let b = d.score(B).unwrap();
    assert_eq!(b.matched_blocks, 64);
    assert!((b.prefix_hit - 0.8).abs() < 1e-12, "CPU tier weight 0.8: {}", b.prefix_hit);
    assert_ne!(d.rule, Rule::DecodeDirect, "0.8 is below the 0.9 bypass threshold");
    r.apply_batch(B, &batch(2.0, vec![stored(1000, 64, 0, None, Medium::Gpu)]), None, 6).unwrap();
    let d = r.route_http(body(1024).as_bytes(), [("x", "y")], 7).unwrap();
    assert_eq!(d.score(B).unwrap().prefix_hit, 1.0);
    // Evicted from GPU: back to the CPU weight; removed everywhere: nothing.
    let removed = |m| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: (1000..1064).collect(),
            medium: m,
            group_idx: None,
            ..Default::default()
        })
    };
    r.apply_batch(B, &batch(3.0, vec![removed(Medium::Gpu)]), None, 8).unwrap();
    let d = r.route_http(body(1024).as_bytes(), [("x", "y")], 9).unwrap();
    assert!((d.score(B).unwrap().prefix_hit - 0.8).abs() < 1e-12);
    r.apply_batch(B, &batch(4.0, vec![removed(Medium::Cpu)]), None, 10).unwrap();
    let d = r.route_http(body(1024).as_bytes(), [("x", "y")], 11).unwrap();
    assert_eq!(d.score(B).unwrap().matched_blocks, 0);
}

#[test]
fn speculative_entries_cover_the_ttl_and_then_go() {
    let r = router("precise");
    let first = r.route_http(body(1024).as_bytes(), [("x", "y")], 0).unwrap();
    r.complete(&first.request_id).unwrap();
    let target = first.endpoint().map(str::to_owned).unwrap();
    // Within the 2 s TTL the next request sees the speculative prefix on the same endpoint.
    let again = r.route_http(body(1024).as_bytes(), [("x", "y")], 1_500).unwrap();
    r.complete(&again.request_id).unwrap();
    assert_eq!(again.endpoint(), first.endpoint());
    assert_eq!(again.score(&target).unwrap().prefix_hit, 1.0);
    assert_eq!(r.stats().precise.speculative_requests, 2);
    // No event confirmed it: after the TTL of the second speculation it is gone.
    let later = r.route_http(body(1024).as_bytes(), [("x", "y")], 3_501).unwrap();
    assert_eq!(later.score(&target).unwrap().matched_blocks, 0);
}

#[test]
fn confirmed_blocks_outlive_speculation() {
    let r = router("precise");
    let d = r.route_http(body(512).as_bytes(), [("x", "y")], 0).unwrap();
    r.complete(&d.request_id).unwrap();
    let target = d.endpoint().unwrap();
    r.apply_batch(target, &batch(1.0, vec![stored(1000, 16, 0, None, Medium::Gpu)]), Some(0), 100).unwrap();
    let later = r.route_http(body(512).as_bytes(), [("x", "y")], 10_000).unwrap();
    assert_eq!(later.score(target).unwrap().matched_blocks, 16, "confirmed half stays, speculative half went");
}

#[test]
fn hybrid_uses_precise_only_for_healthy_streams_and_token_prompts() {
    let r = router("hybrid");
    // A publishes events; B never does (its entries come from the approximate index).
    r.apply_batch(A, &batch(1.0, vec![stored(1000, 64, 0, None, Medium::Gpu)]), Some(0), 0).unwrap();
    let d = r.route_http(body(1024).as_bytes(), [("x", "y")], 10).unwrap();
    assert!(d.score(A).unwrap().precise);
    assert!(!d.score(B).unwrap().precise);
    assert_eq!(d.endpoint(), Some(A));
    // A text prompt has no token ids: every endpoint is scored from the approximate index.
    let text = serde_json::json!({"model": "m", "prompt": "hello ".repeat(400), "max_tokens": 300}).to_string();
    let d = r.route_http(text.as_bytes(), [("x", "y")], 20).unwrap();
    assert!(d.scores.iter().all(|s| !s.precise));
}

#[test]
fn unrecoverable_gap_falls_back_to_approximate_until_recovered() {
    let r = router("hybrid");
    r.apply_batch(A, &batch(1.0, vec![stored(1000, 64, 0, None, Medium::Gpu)]), Some(0), 0).unwrap();
    let out = r.apply_batch(A, &batch(2.0, vec![]), Some(7), 1_000).unwrap();
    assert_eq!(out.verdict, StreamVerdict::Gap { expected: 1, got: 7 });
    // The caller's replay failed: resync.
    r.resync_stream(A, 1_000).unwrap();
    assert_eq!(r.apply_batch(A, &batch(2.0, vec![]), Some(7), 1_000).unwrap().verdict, StreamVerdict::Applied);
    let d = r.route_http(body(1024).as_bytes(), [("x", "y")], 2_000).unwrap();
    assert!(!d.score(A).unwrap().precise, "stale: approximate");
    assert_eq!(r.endpoints().iter().find(|e| &*e.id == A).unwrap().precise_memberships, 0, "cleared");
    let d = r.route_http(body(1024).as_bytes(), [("x", "y")], 31_000).unwrap();
    assert!(d.score(A).unwrap().precise, "recovered after index.precise.stale_recovery_ms");
    assert_eq!(r.stats().precise.resyncs, 1);
    assert!(matches!(r.resync_stream("10.9.9.9:1", 0), Err(kvroute::StateError::UnknownEndpoint { .. })));
}

#[test]
fn removing_an_endpoint_forgets_its_stream_and_entries() {
    let r = router("precise");
    r.apply_batch(A, &batch(1.0, vec![stored(1000, 64, 0, None, Medium::Gpu)]), Some(0), 0).unwrap();
    r.remove_endpoint(A).unwrap();
    r.upsert_endpoint(EndpointSpec::new(A, Role::Decode)).unwrap();
    let d = r.route_http(body(1024).as_bytes(), [("x", "y")], 10).unwrap();
    assert_eq!(d.score(A).unwrap().matched_blocks, 0);
    assert!(matches!(
        r.apply_batch("10.9.9.9:1", &batch(1.0, vec![]), None, 0),
        Err(kvroute::StateError::UnknownEndpoint { .. })
    ));
}

#[test]
fn changing_precise_key_parameters_resets_the_precise_index() {
    let r = router("precise");
    r.apply_batch(A, &batch(1.0, vec![stored(1000, 64, 0, None, Medium::Gpu)]), Some(0), 0).unwrap();
    r.reload_str(r#"{"index":{"mode":"precise","precise":{"engine_block_tokens":32,"index_block_tokens":16}}}"#)
        .unwrap();
    assert_eq!(r.stats().precise.index.memberships, 0);
    let d = r.route_http(body(1024).as_bytes(), [("x", "y")], 10).unwrap();
    assert_eq!(d.score(A).unwrap().matched_blocks, 0);
}

/// Engine keys: the router reproduces vLLM's own sha256_cbor block hashes (vectors generated by
/// vLLM 0.33.0's code, fixtures/hash-vectors/), so events carrying the engine's hashes match the
/// request's token ids directly, LoRA and cache_salt included.
#[test]
fn engine_keys_match_vllm_hashes_end_to_end() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hash-vectors/vllm-0.33.0.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let tokens: Vec<u32> =
        v["sequences"]["widths"]["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let chain = v["chains"]["sha256_cbor"][0]["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "widths/lora_cache_salt")
        .unwrap();
    let keys: Vec<u64> = chain["blocks"].as_array().unwrap().iter().map(|b| b["event_key"].as_u64().unwrap()).collect();
    assert_eq!(keys.len(), tokens.len() / 16);

    let policy = r#"{"index":{"mode":"precise","precise":{"keys":"engine",
        "engine":{"algo":"sha256_cbor","extra_keys":"tagged"},
        "lora_paths":{"sql-adapter":"/models/loras/sql-adapter"}}},
        "request":{"lora_adapters":{"sql":"sql-adapter"}}}"#;
    let r = Router::new(Policy::from_json(policy).unwrap());
    for id in [A, B] {
        r.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
        r.update_metrics(id, MetricsSnapshot { kv_usage: 0.2, updated_ms: 0, ..Default::default() }).unwrap();
    }
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: keys.clone(),
        parent_block_hash: None,
        token_ids: tokens[..keys.len() * 16].to_vec(),
        block_size: 16,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: Some("sql-adapter".into()),
        group_idx: None,
        cache_salt: None,
        ..Default::default()
    });
    r.apply_batch(B, &batch(1.0, vec![ev]), Some(0), 0).unwrap();
    let body = |salt: &str| {
        serde_json::json!({"model": "sql", "prompt": tokens, "max_tokens": 100, "cache_salt": salt}).to_string()
    };
    let d = r.route_http(body("tenant-42").as_bytes(), [("x", "y")], 10).unwrap();
    assert_eq!(d.endpoint(), Some(B));
    assert_eq!(d.score(B).unwrap().matched_blocks, keys.len() as u32);
    assert_eq!(d.prefix_hit, 1.0);
    // Another tenant's salt changes every engine hash: no match.
    let d = r.route_http(body("tenant-7").as_bytes(), [("x", "y")], 20).unwrap();
    assert_eq!(d.score(B).unwrap().matched_blocks, 0);
}

#[test]
fn engine_keys_need_a_reproducible_none_hash() {
    let e = Policy::from_json(r#"{"index":{"precise":{"keys":"engine","engine":{"algo":"xxhash"}}}}"#).unwrap_err();
    assert!(e.to_string().contains("PYTHONHASHSEED"), "{e}");
    assert!(Policy::from_json(
        r#"{"index":{"precise":{"keys":"engine","engine":{"algo":"xxhash","python_hash_seed":"0"}}}}"#
    )
    .is_ok());
}

#[test]
fn dual_keys_keep_tenants_apart_using_the_salt_the_engine_reports() {
    let r = router("precise");
    let mut ev = stored(1000, 64, 0, None, Medium::Gpu);
    if let KvEvent::BlockStored(s) = &mut ev {
        s.cache_salt = Some("tenant-a".into());
    }
    r.apply_batch(A, &batch(1.0, vec![ev]), None, 0).unwrap();
    let salted = |salt: Option<&str>| {
        let mut b = serde_json::json!({"model": "m", "prompt": (0..1024).collect::<Vec<u32>>(), "max_tokens": 300});
        if let Some(s) = salt {
            b["cache_salt"] = s.into();
        }
        b.to_string()
    };
    let hit = |salt| r.route_http(salted(salt).as_bytes(), [("x", "y")], 10).unwrap().score(A).unwrap().matched_blocks;
    assert_eq!(hit(Some("tenant-a")), 64);
    assert_eq!(hit(Some("tenant-b")), 0);
    assert_eq!(hit(None), 0);
}

#[test]
fn prometheus_pages_feed_metrics_and_the_router_exposes_its_own() {
    let r = router("hybrid");
    let page = "vllm:num_requests_waiting{engine=\"0\"} 2\nvllm:num_requests_running{engine=\"0\"} 5\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.4\n";
    let m = r.update_metrics_from_prometheus(A, page, 1_000).unwrap();
    assert_eq!((m.waiting, m.running, m.kv_usage, m.updated_ms), (2, 5, 0.4, 1_000));
    assert_eq!(r.endpoints().iter().find(|e| &*e.id == A).unwrap().metrics.as_ref().unwrap().waiting, 2);
    // A bad page changes nothing.
    assert!(r.update_metrics_from_prometheus(A, "vllm:num_requests_waiting oops\n", 2_000).is_err());
    assert!(matches!(
        r.update_metrics_from_prometheus("10.9.9.9:1", page, 0),
        Err(kvroute::MetricsError::State(kvroute::StateError::UnknownEndpoint { .. }))
    ));
    assert_eq!(r.endpoints().iter().find(|e| &*e.id == A).unwrap().metrics.as_ref().unwrap().updated_ms, 1_000);

    r.apply_batch(A, &batch(1.0, vec![stored(1000, 64, 0, None, Medium::Gpu)]), Some(0), 1_500).unwrap();
    let d = r.route_http(body(1024).as_bytes(), [("x", "y")], 1_600).unwrap();
    r.complete(&d.request_id).unwrap();
    r.record_replay(A, true).unwrap();
    let text = r.metrics_text(2_000);
    for want in [
        "kvroute_decisions_total{mode=\"decode-direct\",rule=\"decode_direct\"} 1",
        "kvroute_prefix_hit_ratio_bucket{le=\"1.0\"} 1",
        "kvroute_prefix_hit_ratio_count 1",
        "kvroute_event_batches_total 1",
        "kvroute_event_replays_total 1",
        "kvroute_event_stream_healthy{endpoint=\"10.0.0.1:8000\"} 1",
        "kvroute_event_stream_healthy{endpoint=\"10.0.0.2:8000\"} 0",
        "kvroute_event_age_seconds{endpoint=\"10.0.0.1:8000\"} 0.5",
        "kvroute_index_memberships{index=\"precise\"} 64",
        "# TYPE kvroute_prefix_hit_ratio histogram",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    // Every sample line is `name{labels} value` with a numeric value.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let v = line.rsplit(' ').next().unwrap();
        assert!(v.parse::<f64>().is_ok(), "{line}");
    }
}
