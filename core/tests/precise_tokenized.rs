//! Precise routing of text and chat requests: the router's tokenizer turns them into the
//! engine's token ids, whose keys match what the engine's KV events report.
#![cfg(feature = "tokenizer")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::Arc;

use kvroute::{BlockStored, EventBatch, KvEvent, Medium};
use kvroute::{ChatTemplate, PrefixCacheConfig, Tokenizer};
use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Role, RouteRequest, Router};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";

fn tokenizer() -> Arc<Tokenizer> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer");
    Arc::new(Tokenizer::from_dir(dir).unwrap().with_prefix_cache(PrefixCacheConfig::default()))
}

/// The same tokenizer with a Llama-style template that dates its header with `strftime_now`.
fn dated_tokenizer() -> Arc<Tokenizer> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer");
    let config = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    let src = std::fs::read_to_string(dir.join("llama3_like.jinja")).unwrap();
    let template = ChatTemplate::from_tokenizer_config(&config, Some(&src)).unwrap();
    Arc::new(Tokenizer::from_dir(dir).unwrap().with_chat_template(template))
}

fn router(mode: &str) -> Router {
    let r = Router::new(Policy::from_json(&format!(r#"{{"index":{{"mode":"{mode}"}}}}"#)).unwrap());
    for id in [A, B] {
        r.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
        r.update_metrics(id, MetricsSnapshot { kv_usage: 0.2, updated_ms: 0, ..Default::default() }).unwrap();
    }
    r
}

fn chat(turns: usize) -> String {
    let mut messages = vec![serde_json::json!({"role": "system", "content": "You are a careful agent. ".repeat(60)})];
    for t in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": format!("Step {t}: inspect the logs and report. ").repeat(12)}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Done with step {t}; nothing unusual. ").repeat(10)}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "Next step, please."}));
    serde_json::json!({"model": "m", "messages": messages, "max_tokens": 300}).to_string()
}

/// What the engine would store for a request: its full 16-token blocks, as one BlockStored (the
/// fixture's own template writes no date, so any time will do).
fn stored_for(tok: &Tokenizer, body: &str) -> (KvEvent, usize) {
    stored_at(tok, body, 0)
}

/// What the engine would store for a request it received at `now_ms`.
fn stored_at(tok: &Tokenizer, body: &str, now_ms: u64) -> (KvEvent, usize) {
    let req = RouteRequest::parse(body.as_bytes(), [("a", "b")], &Default::default()).unwrap();
    let ids = tok.request_token_ids(&req, now_ms).unwrap().remove(0);
    let blocks = ids.len() / 16;
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: (0..blocks as u64).map(|i| 50_000 + i).collect(),
        parent_block_hash: None,
        token_ids: ids[..blocks * 16].to_vec(),
        block_size: 16,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        group_idx: None,
        cache_salt: None,
        ..Default::default()
    });
    (ev, blocks)
}

#[test]
fn chat_requests_hit_what_the_engine_reports() {
    let tok = tokenizer();
    let r = router("precise");
    r.set_tokenizer(Some(tok.clone()));
    let turn1 = chat(1);
    let (ev, blocks) = stored_for(&tok, &turn1);
    assert!(blocks > 20);
    r.apply_batch(B, &EventBatch { ts: 1.0, events: vec![ev], data_parallel_rank: None }, Some(0), 0).unwrap();
    let d = r.route_http(turn1.as_bytes(), [("x", "y")], 10).unwrap();
    assert_eq!(d.endpoint(), Some(B));
    let b = d.score(B).unwrap();
    assert!(b.precise);
    assert_eq!(b.matched_blocks as usize, blocks);
    // input tokens are the tokenizer's count, not a byte estimate
    let exact = tok
        .request_token_ids(&RouteRequest::parse(turn1.as_bytes(), [("a", "b")], &Default::default()).unwrap(), 10)
        .unwrap()[0]
        .len();
    assert_eq!(d.input_tokens, exact as u64);
    r.complete(&d.request_id).unwrap();

    // Turn 2 extends the conversation: it hits turn 1's stored blocks on B (a prefix).
    let turn2 = chat(2);
    let d2 = r.route_http(turn2.as_bytes(), [("x", "y")], 20).unwrap();
    assert_eq!(d2.endpoint(), Some(B));
    let m = d2.score(B).unwrap().matched_blocks as usize;
    assert!(m > 10 && m <= blocks, "turn 2 matches the shared prefix of turn 1: {m} of {blocks}");
    assert!(d2.prefix_hit < 1.0);
}

#[test]
fn the_template_clock_is_the_now_of_the_route_call() {
    let tok = dated_tokenizer();
    let r = router("precise");
    r.set_tokenizer(Some(tok.clone()));
    let body = chat(1);
    // 2026-11-29 13:05:09 UTC and a day later.
    let (day1, day2) = (1_795_957_509_000, 1_796_043_909_000);
    // B served the request on day 1: it holds the blocks of the day-1 rendering.
    let (ev, blocks) = stored_at(&tok, &body, day1);
    assert!(blocks > 20);
    r.apply_batch(B, &EventBatch { ts: 1.0, events: vec![ev], data_parallel_rank: None }, Some(0), day1).unwrap();
    let fresh_metrics = |now_ms: u64| {
        for id in [A, B] {
            r.update_metrics(id, MetricsSnapshot { kv_usage: 0.2, updated_ms: now_ms, ..Default::default() }).unwrap();
        }
    };
    fresh_metrics(day1);
    let d = r.route_http(body.as_bytes(), [("x", "y")], day1).unwrap();
    assert_eq!(d.endpoint(), Some(B));
    assert_eq!(d.score(B).unwrap().matched_blocks as usize, blocks, "routed on day 1: the day-1 date");
    r.complete(&d.request_id).unwrap();

    // The same body routed on day 2 renders the day-2 date: only the blocks before it match.
    let ids = |now_ms| tok.request_token_ids(&parse(&body), now_ms).unwrap().remove(0);
    let (ids1, ids2) = (ids(day1), ids(day2));
    let same_blocks = ids1.iter().zip(&ids2).take_while(|(a, b)| a == b).count() / 16;
    assert!(same_blocks < blocks);
    fresh_metrics(day2);
    let d = r.route_http(body.as_bytes(), [("x", "y")], day2).unwrap();
    assert_eq!(d.score(B).unwrap().matched_blocks as usize, same_blocks, "routed on day 2: the day-2 date");
    assert_eq!(r.stats().counters.tokenize_errors, 0);
}

#[test]
fn without_a_tokenizer_text_requests_have_no_precise_keys() {
    let tok = tokenizer();
    let r = router("precise");
    let body = chat(1);
    let (ev, _) = stored_for(&tok, &body);
    r.apply_batch(B, &EventBatch { ts: 1.0, events: vec![ev], data_parallel_rank: None }, None, 0).unwrap();
    let d = r.route_http(body.as_bytes(), [("x", "y")], 10).unwrap();
    assert_eq!(d.score(B).unwrap().matched_blocks, 0);
    r.set_tokenizer(Some(tok));
    let d = r.route_http(body.as_bytes(), [("x", "y")], 20).unwrap();
    assert!(d.score(B).unwrap().matched_blocks > 0);
    assert_eq!(r.stats().counters.tokenize_errors, 0);
}

/// A chat whose last user turn is `[text, image]`, after a long system prompt.
fn image_chat(url: &str) -> String {
    serde_json::json!({"model": "m", "max_tokens": 300, "messages": [
        {"role": "system", "content": "You are a careful agent. ".repeat(60)},
        {"role": "user", "content": [
            {"type": "text", "text": "What does this picture show? ".repeat(8)},
            {"type": "image_url", "image_url": {"url": url}},
        ]},
    ]})
    .to_string()
}

fn parse(body: &str) -> RouteRequest {
    RouteRequest::parse(body.as_bytes(), [("a", "b")], &Default::default()).unwrap()
}

#[test]
fn chats_that_differ_only_in_the_image_share_only_the_prefix_before_it() {
    let tok = tokenizer();
    let r = router("precise");
    r.set_tokenizer(Some(tok.clone()));
    let first = image_chat("https://example.invalid/cat.png");
    let d = r.route_http(first.as_bytes(), [("x", "y")], 0).unwrap();
    let target = d.endpoint().map(str::to_owned).unwrap();
    r.complete(&d.request_id).unwrap();

    // Within the speculative TTL, the chat with another image: the router's own speculation
    // on the first chat's blocks must not make it a full hit.
    let second = image_chat("https://example.invalid/dog.png");
    let keyable = tok.keyable_token_ids(&parse(&second), 10).unwrap().remove(0);
    let keyable_blocks = keyable.len() / 16;
    assert!(keyable_blocks > 20);
    let d = r.route_http(second.as_bytes(), [("x", "y")], 10).unwrap();
    let s = d.score(&target).unwrap();
    assert!(s.precise);
    assert_eq!(s.matched_blocks as usize, keyable_blocks, "the system prompt, nothing past the image's message");
    assert!(d.prefix_hit < 0.9, "{}", d.prefix_hit);
    assert_ne!(d.mode(), Some(kvroute::Mode::DecodeDirect));
    assert!(d.input_tokens > keyable.len() as u64 + 256);
    assert_eq!(r.stats().counters.tokenize_errors, 0);
}

#[test]
fn an_engine_holding_the_text_prefix_is_hit_up_to_the_image() {
    let tok = tokenizer();
    let r = router("precise");
    r.set_tokenizer(Some(tok.clone()));
    // The engine ran the text-only conversation; now the same one continues with an image.
    let text = chat(1);
    let (ev, blocks) = stored_for(&tok, &text);
    r.apply_batch(B, &EventBatch { ts: 1.0, events: vec![ev], data_parallel_rank: None }, Some(0), 0).unwrap();
    let mut body: serde_json::Value = serde_json::from_str(&text).unwrap();
    body["messages"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.invalid/x.png"}}]}));
    let body = body.to_string();
    let engine = tok.request_token_ids(&parse(&text), 0).unwrap().remove(0);
    let keyable = tok.keyable_token_ids(&parse(&body), 10).unwrap().remove(0);
    let common = engine.iter().zip(&keyable).take_while(|(a, b)| a == b).count();
    let want = (common / 16).min(blocks).min(keyable.len() / 16);
    assert!(want > 20);
    let d = r.route_http(body.as_bytes(), [("x", "y")], 10).unwrap();
    assert_eq!(d.endpoint(), Some(B));
    assert_eq!(d.score(B).unwrap().matched_blocks as usize, want, "the text prefix, up to the image");
    assert!(d.prefix_hit < 1.0);
}
