//! What engine events mean for the precise index's keys and holdings: multimodal and
//! prompt-embeds blocks never match text requests (dual and engine keys), offload
//! re-announcements are reference-counted per endpoint and tier, GPU re-announcements
//! (`kv_cache_report_mode="full"`) are idempotent, empty salts are no salt.
//!
//! Payloads are msgpack written here with `rmp` in the engines' own layouts, or the captures in
//! fixtures/events made by the engines' own publishers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Role, Router};
use kvroute::{EngineHasher, ExtraKeysForm, ExtraValue, HashAlgo, NoneHashSeed};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";

fn router(policy: &str) -> Router {
    let r = Router::new(Policy::from_json(policy).unwrap());
    for (id, w) in [(A, 1), (B, 0)] {
        r.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
        r.update_metrics(id, MetricsSnapshot { waiting: w, kv_usage: 0.2, updated_ms: 0, ..Default::default() })
            .unwrap();
    }
    r
}

const DUAL: &str = r#"{"index":{"mode":"precise"}}"#;
const ENGINE: &str = r#"{"index":{"mode":"precise","precise":{"keys":"engine"}}}"#;

/// Matched blocks of `ep` for a completions request with token ids `ids` (and a salt), routed at
/// `now` seconds (routing speculates for 2 s; whole seconds apart, one request never sees the
/// speculation of another).
fn matched(r: &Router, ids: &[u32], salt: Option<&str>, ep: &str, now: u64) -> u32 {
    let now = now * 10_000;
    let mut body = serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 300});
    if let Some(s) = salt {
        body["cache_salt"] = s.into();
    }
    let d = r.route_http(body.to_string().as_bytes(), [("x", "y")], now).unwrap();
    r.complete(&d.request_id).unwrap();
    d.score(ep).unwrap().matched_blocks
}

// ---------------------------------------------------------------------------------------------
// msgpack values in the engines' layouts
// ---------------------------------------------------------------------------------------------

enum V {
    Nil,
    Int(i64),
    UInt(u64),
    Str(&'static str),
    Arr(Vec<V>),
    Map(Vec<(&'static str, V)>),
}

fn enc(v: &V, out: &mut Vec<u8>) {
    use rmp::encode as e;
    match v {
        V::Nil => e::write_nil(out).unwrap(),
        V::Int(i) => {
            e::write_sint(out, *i).unwrap();
        }
        V::UInt(u) => {
            e::write_uint(out, *u).unwrap();
        }
        V::Str(s) => e::write_str(out, s).unwrap(),
        V::Arr(items) => {
            e::write_array_len(out, items.len() as u32).unwrap();
            items.iter().for_each(|x| enc(x, out));
        }
        V::Map(kv) => {
            e::write_map_len(out, kv.len() as u32).unwrap();
            for (k, v) in kv {
                e::write_str(out, k).unwrap();
                enc(v, out);
            }
        }
    }
}

fn payload(events: Vec<V>) -> Vec<u8> {
    let mut out = Vec::new();
    rmp::encode::write_array_len(&mut out, 3).unwrap();
    rmp::encode::write_f64(&mut out, 1.0).unwrap();
    enc(&V::Arr(events), &mut out);
    rmp::encode::write_uint(&mut out, 0).unwrap();
    out
}

fn uints(x: impl IntoIterator<Item = u64>) -> V {
    V::Arr(x.into_iter().map(V::UInt).collect())
}

/// A vLLM 0.33 BlockStored map with `extra` fields appended.
fn stored(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: std::ops::Range<u32>,
    medium: &'static str,
    extra: Vec<(&'static str, V)>,
) -> V {
    let mut m = vec![
        ("type", V::Str("BlockStored")),
        ("block_hashes", uints(hashes.iter().copied())),
        ("parent_block_hash", parent.map_or(V::Nil, V::UInt)),
        ("token_ids", uints(tokens.clone().map(u64::from))),
        ("block_size", V::UInt(if tokens.is_empty() { 0 } else { 16 })),
        ("lora_id", V::Nil),
        ("medium", V::Str(medium)),
        ("lora_name", V::Nil),
    ];
    m.extend(extra);
    V::Map(m)
}

fn removed(hashes: &[u64], medium: &'static str) -> V {
    V::Map(vec![
        ("type", V::Str("BlockRemoved")),
        ("block_hashes", uints(hashes.iter().copied())),
        ("medium", V::Str(medium)),
    ])
}

/// vLLM's untagged `(mm_hash, offset)` pair.
fn mm(hash: &'static str, offset: i64) -> V {
    V::Arr(vec![V::Str(hash), V::Int(offset)])
}

// ---------------------------------------------------------------------------------------------
// (a) multimodal blocks
// ---------------------------------------------------------------------------------------------

/// 4 blocks of tokens 0..64; an image placeholder covers blocks 1 and 2 (vLLM 0.33 extra keys).
fn image_chain() -> Vec<u8> {
    let extra = V::Arr(vec![V::Nil, V::Arr(vec![mm("img-9f2c", 5)]), V::Arr(vec![mm("img-9f2c", -11)]), V::Nil]);
    payload(vec![stored(&[11, 12, 13, 14], None, 0..64, "GPU", vec![("extra_keys", extra)])])
}

#[test]
fn dual_keys_text_requests_do_not_match_past_a_multimodal_block() {
    let r = router(DUAL);
    r.apply_events(A, &image_chain(), Some(0), 1).unwrap();
    let ids: Vec<u32> = (0..64).collect();
    // Block 0 is text; block 1 holds image tokens the router cannot hash: the match stops there,
    // and block 3 (text again, but chained after the image) does not match either.
    assert_eq!(matched(&r, &ids, None, A, 2), 1);
    // A text-only store of the same token ids is keyed as text and does match.
    r.apply_events(B, &payload(vec![stored(&[21, 22, 23, 24], None, 0..64, "GPU", vec![])]), Some(0), 3).unwrap();
    assert_eq!(matched(&r, &ids, None, B, 4), 4);
    // The image chain stays apart: extending it from its last engine block is still no hit.
    let more = payload(vec![stored(&[15], Some(14), 64..80, "GPU", vec![])]);
    r.apply_events(A, &more, Some(1), 5).unwrap();
    let ids: Vec<u32> = (0..80).collect();
    assert_eq!(matched(&r, &ids, None, A, 6), 1);
}

#[test]
fn dual_keys_offload_reannouncement_without_extra_keys_keeps_the_image_keys() {
    // vLLM 0.33's self-describing offloading events carry token ids and parents but no extra
    // keys: the CPU copy of the image chain must stay keyed as the GPU event reported it.
    let r = router(DUAL);
    r.apply_events(A, &image_chain(), Some(0), 1).unwrap();
    let cpu = payload(vec![stored(&[11, 12, 13, 14], None, 0..64, "CPU", vec![])]);
    r.apply_events(A, &cpu, Some(1), 2).unwrap();
    r.apply_events(A, &payload(vec![removed(&[11, 12, 13, 14], "GPU")]), Some(2), 3).unwrap();
    let ids: Vec<u32> = (0..64).collect();
    assert_eq!(matched(&r, &ids, None, A, 1), 1);
}

#[test]
fn dual_keys_prompt_embeds_blocks_are_not_text_blocks() {
    let r = router(DUAL);
    // Prompt-embeds digests are msgpack bin values in the block's extra keys.
    let mut p = Vec::new();
    rmp::encode::write_array_len(&mut p, 3).unwrap();
    rmp::encode::write_f64(&mut p, 1.0).unwrap();
    rmp::encode::write_array_len(&mut p, 1).unwrap();
    let mut ev = Vec::new();
    enc(&stored(&[31], None, 0..16, "GPU", vec![]), &mut ev);
    // Patch the map length (8 → 9) and append `extra_keys: [[bin(32)]]`.
    assert_eq!(ev[0], 0x88);
    ev[0] = 0x89;
    rmp::encode::write_str(&mut ev, "extra_keys").unwrap();
    rmp::encode::write_array_len(&mut ev, 1).unwrap();
    rmp::encode::write_array_len(&mut ev, 1).unwrap();
    rmp::encode::write_bin(&mut ev, &[7u8; 32]).unwrap();
    p.extend(ev);
    rmp::encode::write_uint(&mut p, 0).unwrap();
    r.apply_events(A, &p, Some(0), 1).unwrap();
    let ids: Vec<u32> = (0..16).collect();
    assert_eq!(matched(&r, &ids, None, A, 2), 0);
}

#[test]
fn engine_keys_text_requests_do_not_match_past_a_multimodal_block() {
    // Real vLLM hashes (sha256 of pickle, vLLM >= 0.31 tagged extra keys): block 1 carries
    // ("mm", hash, offset); the request side never has mm hashes.
    let h = EngineHasher::new(HashAlgo::Sha256, ExtraKeysForm::Tagged, NoneHashSeed::Default, 16).unwrap();
    let ids: Vec<u32> = (0..48).collect();
    let mut scratch = Vec::new();
    let b0 = h.hash_block(None, &ids[0..16], None, &mut scratch);
    let mm_key = [ExtraValue::Str("mm"), ExtraValue::Str("img-9f2c"), ExtraValue::Int(5)];
    let b1 = h.hash_block(Some(&b0), &ids[16..32], Some(&[ExtraValue::Tuple(&mm_key)]), &mut scratch);
    let b2 = h.hash_block(Some(&b1), &ids[32..48], None, &mut scratch);
    let keys = [b0.event_key(), b1.event_key(), b2.event_key()];
    let extra = V::Arr(vec![V::Nil, V::Arr(vec![mm("img-9f2c", 5)]), V::Nil]);
    let r = router(ENGINE);
    r.apply_events(A, &payload(vec![stored(&keys, None, 0..48, "GPU", vec![("extra_keys", extra)])]), Some(0), 1)
        .unwrap();
    assert_eq!(matched(&r, &ids, None, A, 2), 1, "the text block before the image only");
    // Offload re-announcements of those hashes do not extend it either.
    r.apply_events(A, &payload(vec![stored(&keys[1..], None, 0..0, "CPU", vec![])]), Some(1), 3).unwrap();
    assert_eq!(matched(&r, &ids, None, A, 4), 1);
}

// ---------------------------------------------------------------------------------------------
// (c) offload re-announcements: reference counts per endpoint and tier
// ---------------------------------------------------------------------------------------------

fn fixture(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/events").join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn memberships(r: &Router) -> u64 {
    r.stats().precise.index.memberships
}

#[test]
fn engine_keys_duplicate_offload_store_then_one_removal_keeps_the_block() {
    let r = router(ENGINE);
    let x = [0xABCD_u64];
    let cpu_store = payload(vec![stored(&x, None, 0..0, "CPU", vec![])]);
    r.apply_events(A, &cpu_store, Some(0), 1).unwrap();
    r.apply_events(A, &cpu_store, Some(1), 2).unwrap();
    assert_eq!(memberships(&r), 1);
    r.apply_events(A, &payload(vec![removed(&x, "CPU")]), Some(2), 3).unwrap();
    assert_eq!(memberships(&r), 1, "stored twice on CPU, removed once: still held");
    r.apply_events(A, &payload(vec![removed(&x, "CPU")]), Some(3), 4).unwrap();
    assert_eq!(memberships(&r), 0, "removed as often as stored: gone");
    // A removal with nothing left to remove changes nothing (and leaves no count behind).
    r.apply_events(A, &payload(vec![removed(&x, "CPU")]), Some(4), 5).unwrap();
    r.apply_events(A, &cpu_store, Some(5), 6).unwrap();
    r.apply_events(A, &payload(vec![removed(&x, "CPU")]), Some(6), 7).unwrap();
    assert_eq!(memberships(&r), 0);
}

#[test]
fn vllm_offload_capture_is_reference_counted() {
    // fixtures/events/vllm033_offload_reannounce: blk1 stored twice on CPU and once on STORAGE
    // (secondary tier kvcr, REMOTE), blk2 on "cpu"; then blk1 removed once from CPU and from
    // STORAGE. blk1 is still on CPU.
    let r = router(ENGINE);
    r.apply_events(A, &fixture("vllm033_offload_reannounce.msgpack"), Some(0), 1).unwrap();
    assert_eq!(memberships(&r), 2, "blk1 (CPU, one store outstanding) and blk2");
}

#[test]
fn dual_keys_hash_only_offload_stores_use_the_learned_map_and_are_counted() {
    let r = router(DUAL);
    let ids: Vec<u32> = (0..32).collect();
    // GPU store teaches the map engine keys 41, 42 → request keys.
    r.apply_events(A, &payload(vec![stored(&[41, 42], None, 0..32, "GPU", vec![])]), Some(0), 1).unwrap();
    // The offloading connector announces both blocks on CPU, block 42 twice (two chunks).
    let offload = payload(vec![
        stored(&[41], None, 0..0, "CPU", vec![]),
        stored(&[42], None, 0..0, "CPU", vec![]),
        stored(&[42], None, 0..0, "CPU", vec![]),
    ]);
    r.apply_events(A, &offload, Some(1), 2).unwrap();
    // GPU evicts both: the CPU copies still count.
    r.apply_events(A, &payload(vec![removed(&[41, 42], "GPU")]), Some(2), 3).unwrap();
    assert_eq!(matched(&r, &ids, None, A, 4), 2);
    r.apply_events(A, &payload(vec![removed(&[42], "CPU")]), Some(3), 5).unwrap();
    assert_eq!(matched(&r, &ids, None, A, 6), 2, "block 42 was announced twice on CPU");
    r.apply_events(A, &payload(vec![removed(&[42], "CPU")]), Some(4), 7).unwrap();
    assert_eq!(matched(&r, &ids, None, A, 8), 1);
    // A hash-only store of an engine key never seen cannot be placed: an orphan, nothing indexed.
    let before = r.stats().precise.orphan_blocks;
    r.apply_events(A, &payload(vec![stored(&[999], None, 0..0, "CPU", vec![])]), Some(5), 9).unwrap();
    assert_eq!(r.stats().precise.orphan_blocks, before + 1);
    assert_eq!(r.stats().precise.malformed_events, 0);
}

#[test]
fn full_report_mode_gpu_reannouncement_is_idempotent() {
    // vLLM kv_cache_report_mode="full": a prefix hit re-emits BlockStored for the cached blocks
    // (fixtures/events/vllm033_report_full_restore holds the same two blocks twice). One GPU
    // removal then drops the block: GPU stores are not counted.
    for policy in [DUAL, ENGINE] {
        let r = router(policy);
        let fx = fixture("vllm033_report_full_restore.msgpack");
        r.apply_events(A, &fx, Some(0), 1).unwrap();
        r.apply_events(A, &fx, Some(1), 2).unwrap();
        assert_eq!(memberships(&r), 2, "{policy}");
        let batch = kvroute::decode_batch(&fx).unwrap();
        let kvroute::KvEvent::BlockStored(s) = &batch.events[0] else { panic!() };
        let last = s.block_hashes[1];
        r.apply_events(A, &payload(vec![removed(&[last], "GPU")]), Some(2), 3).unwrap();
        assert_eq!(memberships(&r), 1, "{policy}: one removal drops a re-announced GPU block");
    }
}

// ---------------------------------------------------------------------------------------------
// (b) empty cache_salt on the event side
// ---------------------------------------------------------------------------------------------

#[test]
fn empty_event_salt_is_no_salt() {
    let ids: Vec<u32> = (0..32).collect();
    // SGLang's field.
    let r = router(DUAL);
    let sg = payload(vec![stored(&[51, 52], None, 0..32, "GPU", vec![("cache_salt", V::Str(""))])]);
    r.apply_events(A, &sg, Some(0), 1).unwrap();
    assert_eq!(matched(&r, &ids, None, A, 2), 2, "SGLang cache_salt \"\" keys like an unsalted request");
    // vLLM-style / newer SGLang: the salt as block 0's extra key.
    let r = router(DUAL);
    let ek = V::Arr(vec![V::Arr(vec![V::Str("")]), V::Nil]);
    r.apply_events(A, &payload(vec![stored(&[51, 52], None, 0..32, "GPU", vec![("extra_keys", ek)])]), Some(0), 1)
        .unwrap();
    assert_eq!(matched(&r, &ids, None, A, 2), 2);
    // A real salt keys apart from unsalted requests, and matches the same salt.
    let r = router(DUAL);
    let ek = V::Arr(vec![V::Arr(vec![V::Str("tenant-a")]), V::Nil]);
    r.apply_events(A, &payload(vec![stored(&[51, 52], None, 0..32, "GPU", vec![("extra_keys", ek)])]), Some(0), 1)
        .unwrap();
    assert_eq!(matched(&r, &ids, None, A, 2), 0);
    assert_eq!(matched(&r, &ids, Some("tenant-a"), A, 3), 2);
}

#[test]
fn sglang_capture_with_empty_salt_and_lowercase_cpu() {
    // fixtures/events/sglang_empty_salt_lowercase_cpu: page stored on GPU with cache_salt "",
    // then on "cpu" (salt ""), then removed from "cpu".
    let r = router(DUAL);
    r.apply_events(A, &fixture("sglang_empty_salt_lowercase_cpu.msgpack"), Some(0), 1).unwrap();
    let ids: Vec<u32> = (0..16).collect();
    assert_eq!(matched(&r, &ids, None, A, 2), 1);
}

// ---------------------------------------------------------------------------------------------
// (c) lookahead hashing with engine keys
// ---------------------------------------------------------------------------------------------

#[test]
fn engine_keys_follow_a_lookahead_engine_when_configured() {
    // A vLLM 0.33 engine with num_hash_lookahead_tokens = 2 hashes block i with extra keys
    // (None, t[end], t[end+1]) and publishes lookahead_token_ids; 66 tokens give 4 blocks.
    let h = EngineHasher::new(HashAlgo::Sha256, ExtraKeysForm::Tagged, NoneHashSeed::Default, 16)
        .unwrap()
        .with_lookahead(2);
    let ids: Vec<u32> = (0..66).collect();
    let (mut scratch, mut keys) = (Vec::new(), Vec::new());
    h.block_keys(&ids, &kvroute::BlockExtras::default(), &mut scratch, &mut keys).unwrap();
    assert_eq!(keys.len(), 4);
    let la = V::Arr((0..4u64).map(|b| uints([16 * (b + 1), 16 * (b + 1) + 1])).collect());
    let ev = payload(vec![stored(&keys, None, 0..64, "GPU", vec![("lookahead_token_ids", la)])]);
    let with = router(r#"{"index":{"mode":"precise","precise":{"keys":"engine","engine":{"lookahead_tokens":2}}}}"#);
    with.apply_events(A, &ev, Some(0), 1).unwrap();
    assert_eq!(matched(&with, &ids, None, A, 1), 4);
    // The request must carry the lookahead tokens of its last block to be credited with it.
    assert_eq!(matched(&with, &ids[..65], None, A, 2), 3);
    // Configured without lookahead, the router computes other keys and claims nothing.
    let without = router(ENGINE);
    without.apply_events(A, &ev, Some(0), 1).unwrap();
    assert_eq!(matched(&without, &ids, None, A, 1), 0);
}
