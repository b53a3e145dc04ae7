//! The engine-key → request-key map is per endpoint: one publisher flooding distinct blocks
//! evicts only its own entries, never another endpoint's continuations or removals.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use kvroute::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
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

/// BlockStored for `blocks` 16-token engine blocks from token `first`, engine hashes `base + i`
/// chained from `parent`.
fn stored(base: u64, blocks: u32, first: u32, parent: Option<u64>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: (0..u64::from(blocks)).map(|i| base + i).collect(),
        parent_block_hash: parent,
        token_ids: (first..first + 16 * blocks).collect(),
        block_size: 16,
        medium: Medium::Gpu,
        ..Default::default()
    })
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved { block_hashes: hashes.to_vec(), medium: Medium::Gpu, ..Default::default() })
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch { ts: 1.0, events, data_parallel_rank: None }
}

/// Blocks of token ids `0..n` matched on A.
fn matched_on_a(r: &Router, n: u32, now: u64) -> u32 {
    let ids: Vec<u32> = (0..n).collect();
    let body = serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 16}).to_string();
    let d = r.route_http(body.as_bytes(), [("x", "y")], now).unwrap();
    r.complete(&d.request_id).unwrap();
    d.score(A).unwrap().matched_blocks
}

/// B publishes `blocks` distinct blocks (root chains of 100 blocks, tokens far from A's).
fn flood(r: &Router, blocks: u64, now: u64) {
    for c in 0..blocks / 100 {
        let first = 10_000_000 + (c as u32) * 1_600;
        r.apply_batch(B, &batch(vec![stored(1_000_000 + c * 100, 100, first, None)]), None, now).unwrap();
    }
}

#[test]
fn a_flooding_publisher_does_not_orphan_another_endpoints_continuations_or_removals() {
    // A short speculative TTL: the probes' own speculation is gone before the next probe.
    let r = router(r#"{"index":{"mode":"precise","speculative_ttl_ms":1,"precise":{"key_map_capacity":1024}}}"#);
    r.apply_batch(A, &batch(vec![stored(1_000, 8, 0, None)]), None, 0).unwrap();
    assert_eq!(matched_on_a(&r, 192, 1), 8);
    // B floods ten times the map capacity.
    flood(&r, 10_240, 2);
    let orphans = r.stats().precise.orphan_blocks;
    // A's continuation (parent = its last engine block) is placed in the chain.
    r.apply_batch(A, &batch(vec![stored(1_008, 4, 128, Some(1_007))]), None, 10).unwrap();
    assert_eq!(r.stats().precise.orphan_blocks - orphans, 0, "A's continuation is not orphaned");
    assert_eq!(matched_on_a(&r, 192, 20), 12);
    // A's removals still find their request keys: no stale hit.
    r.apply_batch(A, &batch(vec![removed(&[1_003])]), None, 30).unwrap();
    assert_eq!(matched_on_a(&r, 192, 40), 3, "removed block 3: the match stops before it");
    // B's own map is bounded by its capacity.
    assert!(r.stats().precise.mapped_engine_blocks <= 12 + 1_024);
}

#[test]
fn a_removed_endpoint_leaves_no_map_entries_behind() {
    let r = router(r#"{"index":{"mode":"precise","precise":{"key_map_capacity":1024}}}"#);
    r.apply_batch(A, &batch(vec![stored(1_000, 8, 0, None)]), None, 0).unwrap();
    flood(&r, 500, 1);
    assert_eq!(r.stats().precise.mapped_engine_blocks, 508);
    r.remove_endpoint(B).unwrap();
    assert_eq!(r.stats().precise.mapped_engine_blocks, 8);
    // A new endpoint in B's slot does not inherit B's engine keys: a continuation of B's chain
    // is an orphan there.
    r.upsert_endpoint(EndpointSpec::new(B, Role::Decode)).unwrap();
    let orphans = r.stats().precise.orphan_blocks;
    r.apply_batch(B, &batch(vec![stored(5_000, 1, 1_600, Some(1_000_099))]), None, 2).unwrap();
    assert_eq!(r.stats().precise.orphan_blocks - orphans, 1);
}

/// The issue's memory figure: B floods 5M distinct blocks under the default policy; the reported
/// memory of the precise index (block store, maps, speculation) against the budget.
/// `cargo test --release -p kvroute --test key_map -- --ignored --nocapture`.
#[test]
#[ignore]
fn memory_figure_after_a_flood() {
    let r = router(r#"{"index":{"mode":"precise"}}"#);
    r.apply_batch(A, &batch(vec![stored(1_000, 8, 0, None)]), None, 0).unwrap();
    flood(&r, 5_000_000, 1);
    r.apply_batch(A, &batch(vec![stored(1_008, 4, 128, Some(1_007))]), None, 10).unwrap();
    let s = r.stats().precise;
    let p = Policy::default();
    println!(
        "after a 5M-block flood: maps {:.1} MB ({} engine blocks), block store {:.1} MB, total {:.1} MB; \
         block budget {:.1} MB (2 endpoints); A's continuation orphaned: {}",
        s.map_memory_bytes as f64 / 1e6,
        s.mapped_engine_blocks,
        s.index.memory_bytes as f64 / 1e6,
        (s.index.memory_bytes + s.map_memory_bytes) as f64 / 1e6,
        (2 * p.config().index.precise.capacity_bytes_per_endpoint) as f64 / 1e6,
        s.orphan_blocks > 0,
    );
}
