//! Multimodal chat requests on the approximate (tokenizer-free) index: keys end before the first
//! content part the router cannot key, and what lies past it still counts against the hit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute::MEDIA_PART_TOKENS;
use kvroute::{ApproxHashing, EndpointSpec, MetricsSnapshot, Mode, Policy, RequestKeys, Role, RouteRequest, Router};
use serde_json::{json, Value};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";

fn router() -> Router {
    let r = Router::default();
    for (id, waiting) in [(A, 0), (B, 1)] {
        r.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
        r.update_metrics(id, MetricsSnapshot { waiting, kv_usage: 0.2, updated_ms: 0, ..Default::default() }).unwrap();
    }
    r
}

fn system() -> String {
    "You answer questions about pictures, briefly and precisely. ".repeat(40)
}

fn image(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

fn body(messages: Value) -> String {
    json!({"model": "llava", "messages": messages, "max_tokens": 300}).to_string()
}

/// A chat whose user turn is some text followed by an image.
fn with_image(url: &str) -> String {
    body(json!([
        {"role": "system", "content": system()},
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture? ".repeat(20)}, image(url)]},
    ]))
}

fn keys(body: &str) -> RequestKeys {
    let p = Policy::default();
    let i = &p.config().index;
    let h = ApproxHashing { block_tokens: i.block_tokens, bytes_per_token: i.bytes_per_token, hash_seed: i.hash_seed };
    let req = RouteRequest::parse(body.as_bytes(), [("a", "b")], &Default::default()).unwrap();
    let mut k = RequestKeys::default();
    h.request_keys(&req, &mut k);
    k
}

#[test]
fn chats_that_differ_only_in_the_image_share_only_the_prefix_before_it() {
    let r = router();
    let first = r.route_http(with_image("https://example.invalid/cat.png").as_bytes(), [("x", "y")], 0).unwrap();
    assert_eq!(first.endpoint(), Some(A));
    r.complete(&first.request_id).unwrap();

    let second = with_image("https://example.invalid/dog.png");
    let d = r.route_http(second.as_bytes(), [("x", "y")], 1).unwrap();
    let k = keys(&second);
    // The keys stop where the user message's content starts: the system prompt's blocks.
    let system_blocks = (system().len() + "\u{1}system\u{2}\u{3}\u{1}user\u{2}".len()) / (64 * 4);
    assert_eq!(k.keys.len(), system_blocks);
    assert!(u64::from(k.unkeyed_blocks) >= u64::from(MEDIA_PART_TOKENS) / 64);
    let a = d.score(A).unwrap();
    assert_eq!(a.matched_blocks as usize, system_blocks, "no hit past the start of the image's message");
    let want = system_blocks as f64 / k.hit_blocks() as f64;
    assert!((d.prefix_hit - want).abs() < 1e-12, "{} vs {want}", d.prefix_hit);
    assert!(d.prefix_hit < 0.9);
    assert_ne!(d.mode(), Some(Mode::DecodeDirect), "a new image needs its prefill");
    assert!(d.input_tokens >= u64::from(MEDIA_PART_TOKENS));

    // The exact repeat, same URL: still not a full hit (the URL may serve other bytes).
    r.complete(&d.request_id).unwrap();
    let d = r.route_http(second.as_bytes(), [("x", "y")], 2).unwrap();
    assert!(d.prefix_hit < 1.0);
    assert_eq!(d.score(A).unwrap().matched_blocks as usize, system_blocks);
}

#[test]
fn an_image_appended_after_the_text_keeps_the_text_prefix() {
    let r = router();
    let text = [
        json!({"role": "system", "content": system()}),
        json!({"role": "user", "content": "Describe the plot of the film in detail. ".repeat(20)}),
    ];
    let plain = body(Value::Array(text.to_vec()));
    let first = r.route_http(plain.as_bytes(), [("x", "y")], 0).unwrap();
    r.complete(&first.request_id).unwrap();
    let text_blocks = keys(&plain).keys.len();
    assert!(text_blocks > 10);

    // The same conversation with a further user message holding an image.
    let mut more = text.to_vec();
    more.push(json!({"role": "user", "content": [image("https://example.invalid/poster.png")]}));
    let more = body(Value::Array(more));
    let k = keys(&more);
    assert!(k.keys.len() >= text_blocks);
    let d = r.route_http(more.as_bytes(), [("x", "y")], 1).unwrap();
    assert_eq!(d.endpoint(), first.endpoint());
    assert_eq!(d.score(A).unwrap().matched_blocks as usize, text_blocks, "every block of the text-only chat");
    assert!(d.prefix_hit < 1.0);
}

#[test]
fn text_typed_parts_are_keyed_like_string_content() {
    let parts = body(json!([
        {"role": "system", "content": system()},
        {"role": "user", "content": [{"type": "input_text", "text": "first"}, {"type": "text", "text": "second"}]},
    ]));
    let string = body(json!([
        {"role": "system", "content": system()},
        {"role": "user", "content": "first\nsecond"},
    ]));
    let (a, b) = (keys(&parts), keys(&string));
    assert_eq!(a, b);
    assert_eq!(a.unkeyed_blocks, 0);
}

/// vLLM's completions `prompt_embeds` run as further sequences the router cannot key: the token
/// prompts are keyed in full, the embeddings count against the hit, on both indexes.
#[test]
fn prompt_embeds_are_never_a_full_hit() {
    use kvroute::{BlockStored, EventBatch, KvEvent, Medium};
    let ids: Vec<u32> = (0..1024).collect();
    let plain = json!({"model": "m", "prompt": ids, "max_tokens": 300}).to_string();
    let embeds = json!({"model": "m", "prompt": ids, "prompt_embeds": ["AAAA"], "max_tokens": 300}).to_string();

    let r = router();
    let first = r.route_http(plain.as_bytes(), [("x", "y")], 0).unwrap();
    r.complete(&first.request_id).unwrap();
    let d = r.route_http(embeds.as_bytes(), [("x", "y")], 1).unwrap();
    let blocks = 1024 / 64;
    assert_eq!(d.score(A).unwrap().matched_blocks, blocks);
    let want = f64::from(blocks) / f64::from(blocks + MEDIA_PART_TOKENS / 64);
    assert!((d.prefix_hit - want).abs() < 1e-12, "{} vs {want}", d.prefix_hit);
    assert_eq!(d.input_tokens, 1024 + u64::from(MEDIA_PART_TOKENS));

    let r = Router::new(Policy::from_json(r#"{"index":{"mode":"precise"}}"#).unwrap());
    for id in [A, B] {
        r.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
        r.update_metrics(id, MetricsSnapshot { kv_usage: 0.2, ..Default::default() }).unwrap();
    }
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: (0..64).collect(),
        parent_block_hash: None,
        token_ids: ids,
        block_size: 16,
        medium: Medium::Gpu,
        ..Default::default()
    });
    r.apply_batch(B, &EventBatch { ts: 1.0, events: vec![ev], data_parallel_rank: None }, Some(0), 0).unwrap();
    let full = r.route_http(plain.as_bytes(), [("x", "y")], 1).unwrap();
    assert_eq!((full.prefix_hit, full.mode()), (1.0, Some(Mode::DecodeDirect)));
    r.complete(&full.request_id).unwrap();
    let d = r.route_http(embeds.as_bytes(), [("x", "y")], 2).unwrap();
    let s = d.score(B).unwrap();
    assert!(s.precise);
    assert_eq!(s.matched_blocks, 64);
    assert!((d.prefix_hit - 64.0 / 80.0).abs() < 1e-12, "{}", d.prefix_hit);
    assert_ne!(d.mode(), Some(Mode::DecodeDirect));
}

fn data_image(b64: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}})
}

/// A conversation whose first user turn holds an inline image, `turns` exchanges long.
fn data_chat(b64: &str, turns: usize) -> String {
    let mut m = vec![
        json!({"role": "system", "content": system()}),
        json!({"role": "user", "content": [{"type": "text", "text": "What is in this picture? ".repeat(20)}, data_image(b64)]}),
    ];
    for t in 0..turns {
        m.push(json!({"role": "assistant", "content": format!("Answer {t}: a cat on a mat. ").repeat(12)}));
        m.push(json!({"role": "user", "content": format!("Follow-up {t}: and behind it? ").repeat(12)}));
    }
    body(Value::Array(m))
}

/// Inline image data is its own identity: the same image resent with a growing conversation
/// keeps hitting past it; another image hits only what precedes the message holding it.
#[test]
fn inline_images_are_keyed_by_their_data() {
    let r = router();
    let turn1 = data_chat("iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB", 0);
    let d = r.route_http(turn1.as_bytes(), [("x", "y")], 0).unwrap();
    r.complete(&d.request_id).unwrap();
    let k1 = keys(&turn1);
    assert_eq!(k1.unkeyed_blocks, 0);

    let turn2 = data_chat("iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB", 1);
    let k2 = keys(&turn2);
    assert_eq!(k2.keys[..k1.keys.len()], k1.keys[..], "the conversation grows by appending");
    let d = r.route_http(turn2.as_bytes(), [("x", "y")], 1).unwrap();
    assert_eq!(d.score(A).unwrap().matched_blocks as usize, k1.keys.len(), "past the image");
    r.complete(&d.request_id).unwrap();
    let again = r.route_http(turn2.as_bytes(), [("x", "y")], 2).unwrap();
    assert_eq!((again.prefix_hit, again.mode()), (1.0, Some(Mode::DecodeDirect)));
    r.complete(&again.request_id).unwrap();

    // Another image: only the blocks that end before the user message's content starts.
    let other = data_chat("R0lGODlhAQABAIAAAAUEBAAAACwAAAAA", 1);
    let d = r.route_http(other.as_bytes(), [("x", "y")], 3).unwrap();
    let before = (system().len() + "\u{1}system\u{2}\u{3}\u{1}user\u{2}".len()) / (64 * 4);
    assert_eq!(d.score(A).unwrap().matched_blocks as usize, before);
    assert!(d.prefix_hit < 0.9);
    assert_ne!(d.mode(), Some(Mode::DecodeDirect));
}

/// A part's `uuid` is vLLM's identifier for its media: the same uuid (and part) is the same
/// medium even behind an http URL; without one, an http URL is not keyed.
#[test]
fn a_uuid_identifies_the_media() {
    let chat = |part: Value| {
        body(json!([
            {"role": "system", "content": system()},
            {"role": "user", "content": [part]},
            {"role": "assistant", "content": "A long answer about the picture. ".repeat(20)},
        ]))
    };
    let with_uuid =
        chat(json!({"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}, "uuid": "sha256:abc"}));
    let r = router();
    let d = r.route_http(with_uuid.as_bytes(), [("x", "y")], 0).unwrap();
    r.complete(&d.request_id).unwrap();
    let d = r.route_http(with_uuid.as_bytes(), [("x", "y")], 1).unwrap();
    assert_eq!(d.prefix_hit, 1.0);
    let without = chat(json!({"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}));
    let k = keys(&without);
    assert!(k.unkeyed_blocks > 0 && k.keys.len() < keys(&with_uuid).keys.len());
}
