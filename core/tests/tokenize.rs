//! Exact tokenization (feature `tokenizer`): ids equal to what Hugging Face produces for the
//! project's own fixture tokenizer (fixtures/tokenizer/reference.json, made by tokenizers and
//! transformers), chat templates rendered byte for byte as Jinja2 does, and a prefix cache whose
//! ids are identical to full tokenization.
#![cfg(feature = "tokenizer")]
#![allow(clippy::unwrap_used, clippy::expect_used)]
// Sans-IO is the library's rule (core/clippy.toml): this test file shares one tokenizer across
// threads to check it is Send + Sync.
#![allow(clippy::disallowed_methods)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kvroute::{ChatMessage, ChatOptions, ChatTemplate, PrefixCacheConfig, RawJson, TokenizeError, Tokenizer};
use proptest::prelude::*;
use serde_json::{json, Value};

/// The request time (`now_ms` of a route call) the tests pass; the fixture's own chat template
/// writes no date.
const NOW_MS: u64 = 1_795_957_509_000;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizer")
}

fn fixture_json() -> Vec<u8> {
    std::fs::read(fixture_dir().join("tokenizer.json")).unwrap()
}

fn reference() -> &'static Value {
    static R: OnceLock<Value> = OnceLock::new();
    R.get_or_init(|| serde_json::from_slice(&std::fs::read(fixture_dir().join("reference.json")).unwrap()).unwrap())
}

/// The fixture tokenizer with its chat template and a prefix cache shared by the tests.
fn cached() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_dir(fixture_dir()).unwrap().with_prefix_cache(PrefixCacheConfig::default()))
}

/// Same, with a 48 KiB budget so that segments are evicted all the time.
fn small_cache() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        Tokenizer::from_dir(fixture_dir()).unwrap().with_prefix_cache(PrefixCacheConfig::with_max_bytes(48 << 10))
    })
}

fn template(name: &str) -> ChatTemplate {
    let config = std::fs::read_to_string(fixture_dir().join("tokenizer_config.json")).unwrap();
    let src = std::fs::read_to_string(fixture_dir().join(name)).unwrap();
    ChatTemplate::from_tokenizer_config(&config, Some(&src)).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| u32::try_from(x.as_u64().unwrap()).unwrap()).collect()
}

fn message(m: &Value) -> ChatMessage {
    let s = |k: &str| m.get(k).and_then(Value::as_str).map(str::to_owned);
    let mut msg = ChatMessage::without_content(s("role").unwrap());
    msg.content = s("content");
    msg.name = s("name");
    msg.tool_call_id = s("tool_call_id");
    msg.reasoning_content = s("reasoning_content");
    msg.tool_calls = m.get("tool_calls_json").and_then(Value::as_str).map(|t| RawJson::new(t).unwrap());
    msg
}

// ---------------------------------------------------------------------------------------------
// Identity with Hugging Face
// ---------------------------------------------------------------------------------------------

#[test]
fn fixture_tokenizer_shape() {
    let tok = cached();
    assert_eq!(tok.vocab_size(), 6006);
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert!(tok.prefix_cache_supported());
    assert!(tok.chat_template().is_some());
}

#[test]
fn texts_match_hf_tokenizers() {
    let texts = reference()["texts"].as_array().unwrap();
    assert!(texts.len() >= 15);
    let plain = Tokenizer::from_dir(fixture_dir()).unwrap();
    for case in texts {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(plain.encode_uncached(text, false).unwrap(), want, "{text:?}");
        assert_eq!(plain.encode(text, true).unwrap(), want, "{text:?} (no cache, special tokens)");
        for tok in [cached(), small_cache()] {
            assert_eq!(tok.encode(text, false).unwrap(), want, "{text:?} (cached)");
            assert_eq!(tok.encode_prompt(text).unwrap(), want, "{text:?} (cached prompt)");
        }
    }
}

#[test]
fn chats_match_transformers_apply_chat_template() {
    let chats = reference()["chats"].as_array().unwrap();
    assert!(chats.len() >= 10);
    let templates = [
        ("chat_template.jinja", template("chat_template.jinja")),
        ("llama3_like.jinja", template("llama3_like.jinja")),
    ];
    let mut checked = 0;
    for case in chats {
        let name = case["template"].as_str().unwrap();
        let t = &templates.iter().find(|(n, _)| *n == name).unwrap().1;
        let messages: Vec<ChatMessage> = case["messages"].as_array().unwrap().iter().map(message).collect();
        let mut opts = ChatOptions::new(case["add_generation_prompt"].as_bool().unwrap());
        opts.parse_tool_call_arguments = false; // transformers alone (vLLM's rewrite: see below)
        opts.continue_final_message = case["continue_final_message"].as_bool().unwrap();
        opts.tools = case.get("tools_json").and_then(Value::as_str).map(|t| RawJson::new(t).unwrap());
        opts.kwargs = case["kwargs_json"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), RawJson::new(v.as_str().unwrap()).unwrap()))
            .collect();
        let rendered = t.render(&messages, &opts);
        if let Some(err) = case.get("error") {
            assert_eq!(rendered, Err(TokenizeError::Rejected { message: err.as_str().unwrap().to_owned() }), "{case}");
            continue;
        }
        let rendered = rendered.unwrap();
        assert_eq!(rendered, case["rendered"].as_str().unwrap(), "rendering of {case}");
        let want = ids(&case["ids"]);
        assert_eq!(cached().encode(&rendered, false).unwrap(), want);
        assert_eq!(small_cache().encode(&rendered, false).unwrap(), want);
        assert_eq!(cached().encode_uncached(&rendered, false).unwrap(), want);
        if name == "chat_template.jinja" {
            // The directory's own template (chat_template.jinja) through the one-call API.
            assert_eq!(cached().encode_chat_with(&messages, &opts).unwrap(), want);
        }
        checked += 1;
    }
    assert!(checked >= 10);
}

// ---------------------------------------------------------------------------------------------
// Prefix cache: ids identical to full tokenization
// ---------------------------------------------------------------------------------------------

/// Pieces chosen to sit on segment boundaries: spaces, newlines, digits, unicode (composed and
/// decomposed), contractions and text that looks like (or is) an added token.
const PIECES: &[&str] = &[
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "\r\n",
    "a",
    "word",
    " word",
    "Word ",
    "the cache",
    "0",
    "7",
    "123",
    "3.14",
    "-42",
    "é",
    "e\u{301}",
    "Größe",
    "世界",
    "🚀",
    "👍🏽",
    "👨\u{200d}👩\u{200d}👧",
    "'s",
    "'LL",
    "don't",
    "<",
    ">",
    "|",
    "<|",
    "|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start",
    "im_end|>",
    "<|IM_END|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_response>",
    "{\"a\": 1}",
    "fn main() {}",
    ".",
    "!?",
    "...",
    "\u{a0}",
    "\u{3000}",
];

fn text_strategy(max_pieces: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(PIECES), 0..max_pieces).prop_map(|p| p.concat())
}

fn message_strategy() -> impl Strategy<Value = ChatMessage> {
    (
        prop::sample::select(&["system", "user", "assistant", "tool", "user", "assistant"][..]),
        text_strategy(12),
        any::<u8>(),
    )
        .prop_map(|(role, content, flags)| {
            let mut m = ChatMessage::new(role, content);
            if role == "assistant" && flags % 5 == 0 {
                m.reasoning_content = Some("reasoning 1 2 3".to_owned());
            }
            if role == "assistant" && flags % 7 == 0 {
                m.tool_calls = Some(
                    RawJson::new(r#"[{"type":"function","function":{"name":"f","arguments":{"x":" 1 "}}}]"#).unwrap(),
                );
            }
            m
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// A conversation encoded turn by turn through the cache gives, at every turn, exactly the
    /// ids of tokenizing the rendered text in full.
    #[test]
    fn chat_turns_through_cache_equal_full_tokenization(
        msgs in prop::collection::vec(message_strategy(), 1..10),
        gen in any::<bool>(),
    ) {
        for n in 1..=msgs.len() {
            let turn = &msgs[..n];
            let opts = ChatOptions::new(gen);
            let text = match cached().render_chat(turn, &opts) {
                Ok(t) => t,
                Err(TokenizeError::Rejected { .. }) => continue,
                Err(e) => panic!("{e}"),
            };
            let full = cached().encode_uncached(&text, false).unwrap();
            prop_assert_eq!(&cached().encode_chat_with(turn, &opts).unwrap(), &full);
            prop_assert_eq!(&small_cache().encode_chat_with(turn, &opts).unwrap(), &full);
        }
    }

    /// Raw texts (special tokens anywhere, tricky neighbours), as chat and as prompt.
    #[test]
    fn random_texts_through_cache_equal_full_tokenization(text in text_strategy(40)) {
        for special in [false, true] {
            let full = cached().encode_uncached(&text, special).unwrap();
            prop_assert_eq!(&cached().encode(&text, special).unwrap(), &full);
            prop_assert_eq!(&small_cache().encode(&text, special).unwrap(), &full);
        }
    }
}

#[test]
fn many_growing_conversations_share_the_cache() {
    // 40 deterministic conversations of 12 turns, interleaved, through one cache.
    let tok = Tokenizer::from_dir(fixture_dir()).unwrap().with_prefix_cache(PrefixCacheConfig::default());
    let mut convs: Vec<Vec<ChatMessage>> = (0..40)
        .map(|c| vec![ChatMessage::new("system", format!("You are assistant #{c}. Be  precise; use 3 digits."))])
        .collect();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for turn in 0..12 {
        for (c, conv) in convs.iter_mut().enumerate() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let piece = |i: u64| PIECES[(i % PIECES.len() as u64) as usize];
            conv.push(ChatMessage::new(
                "user",
                format!("turn {turn} of {c}:{}{}{}", piece(x), piece(x >> 8), piece(x >> 16)),
            ));
            let text = tok.render_chat(conv, &ChatOptions::new(true)).unwrap();
            assert_eq!(tok.encode_chat(conv, true).unwrap(), tok.encode_uncached(&text, false).unwrap());
            conv.push(ChatMessage::new("assistant", format!("answer {turn}{}{}", piece(x >> 24), piece(x >> 32))));
        }
    }
    let stats = tok.prefix_cache_stats().unwrap();
    assert!(stats.hits > 10 * stats.misses / 2, "{stats:?}");
    assert!(stats.hit_tokens > 5 * stats.miss_tokens, "{stats:?}");
}

#[test]
fn turn_n_only_tokenizes_the_new_suffix() {
    let tok = Tokenizer::from_dir(fixture_dir()).unwrap().with_prefix_cache(PrefixCacheConfig::default());
    let mut chat = vec![
        ChatMessage::new("system", "You are a helpful assistant. ".repeat(50)),
        ChatMessage::new("user", "First question about caches?"),
    ];
    let first = tok.encode_chat(&chat, true).unwrap();
    let s1 = tok.prefix_cache_stats().unwrap();
    assert_eq!((s1.hit_tokens + s1.miss_tokens) as usize, first.len());
    chat.push(ChatMessage::new("assistant", "An answer."));
    chat.push(ChatMessage::new("user", "A follow-up."));
    let second = tok.encode_chat(&chat, true).unwrap();
    let s2 = tok.prefix_cache_stats().unwrap();
    let new_tokens = (s2.miss_tokens - s1.miss_tokens) as usize;
    // Only the two new messages and the new generation header were tokenized.
    assert!(new_tokens < 20, "{new_tokens} new tokens tokenized, {s2:?}");
    assert_eq!(second.len(), (s2.hit_tokens - s1.hit_tokens) as usize + new_tokens);
    // Everything up to the old generation header is a shared prefix.
    assert_eq!(second[..first.len() - 3], first[..first.len() - 3]);
}

#[test]
fn cache_stays_within_its_budget() {
    let budget = 8 << 10;
    let tok = Tokenizer::from_dir(fixture_dir()).unwrap().with_prefix_cache(PrefixCacheConfig::with_max_bytes(budget));
    for i in 0..300 {
        let text = format!("<|im_start|>user\nmessage number {i} {}<|im_end|>\n", "x".repeat(i % 50));
        assert_eq!(tok.encode(&text, false).unwrap(), tok.encode_uncached(&text, false).unwrap());
        let s = tok.prefix_cache_stats().unwrap();
        assert!(s.bytes <= budget, "{s:?}");
    }
    let s = tok.prefix_cache_stats().unwrap();
    assert!(s.evictions > 0 && s.entries > 0, "{s:?}");
    tok.clear_prefix_cache();
    assert_eq!(tok.prefix_cache_stats().unwrap().entries, 0);
}

#[test]
fn cache_is_shared_across_threads() {
    let tok =
        Tokenizer::from_dir(fixture_dir()).unwrap().with_prefix_cache(PrefixCacheConfig::with_max_bytes(32 << 10));
    std::thread::scope(|s| {
        for t in 0..4 {
            let tok = &tok;
            s.spawn(move || {
                let mut chat = vec![ChatMessage::new("system", "Shared system prompt, 1 2 3.")];
                for i in 0..30 {
                    chat.push(ChatMessage::new("user", format!("thread {t} turn {i} 🚀")));
                    let text = tok.render_chat(&chat, &ChatOptions::new(true)).unwrap();
                    assert_eq!(tok.encode_chat(&chat, true).unwrap(), tok.encode_uncached(&text, false).unwrap());
                    chat.push(ChatMessage::new("assistant", format!("ok {i}")));
                }
            });
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Tokenizers with tricky added tokens, post-processors and position-dependent pre-tokenizers
// ---------------------------------------------------------------------------------------------

/// The fixture with extra added tokens of every kind, and a post-processor adding BOS/EOS.
fn tricky_json() -> Vec<u8> {
    let mut v: Value = serde_json::from_slice(&fixture_json()).unwrap();
    let added = v["added_tokens"].as_array_mut().unwrap();
    let tokens = [
        ("<R>", false, false, true, false, true),           // rstrip: no cut after it
        ("<L>", false, true, false, false, true),           // lstrip: cuts allowed
        ("[W]", true, false, false, false, true),           // single_word: no cut after it
        ("word", true, false, false, false, false),         // single_word on a word
        ("<N>", false, false, false, true, false),          // normalized: matched after normalization
        ("<tokA", false, false, false, false, true),        // ends with a letter: no cut
        (" <S>", false, false, false, false, true),         // starts with a space (after <R>'s rstrip run)
        ("<|im_end|>\n", false, false, false, false, true), // longer than <|im_end|>: ends with whitespace
    ];
    for ((content, single_word, lstrip, rstrip, normalized, special), id) in tokens.into_iter().zip(6006..) {
        added.push(json!({"id": id, "content": content, "single_word": single_word, "lstrip": lstrip,
                          "rstrip": rstrip, "normalized": normalized, "special": special}));
    }
    v["post_processor"] = json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]},
            "<|im_end|>": {"id": "<|im_end|>", "ids": [2], "tokens": ["<|im_end|>"]}
        }
    });
    serde_json::to_vec(&v).unwrap()
}

const TRICKY_PIECES: &[&str] = &[
    "<R>",
    "<L>",
    "[W]",
    "word",
    "words",
    "<N>",
    "<tokA",
    " <S>",
    "<|im_end|>\n",
    "<|im_end|>",
    "<|im_start|>",
    " ",
    "  ",
    "\n",
    "x",
    "é",
    "1",
    "<",
    ">",
    "_",
    "a_b",
    "Zürich",
    "\t",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn tricky_added_tokens_through_cache_equal_full_tokenization(
        pieces in prop::collection::vec(prop::sample::select(TRICKY_PIECES), 0..30),
    ) {
        static T: OnceLock<Tokenizer> = OnceLock::new();
        let tok = T.get_or_init(|| {
            Tokenizer::from_json(&tricky_json()).unwrap().with_prefix_cache(PrefixCacheConfig::with_max_bytes(16 << 10))
        });
        prop_assert!(tok.prefix_cache_supported());
        let text = pieces.concat();
        for special in [false, true] {
            let full = tok.encode_uncached(&text, special).unwrap();
            prop_assert_eq!(&tok.encode(&text, special).unwrap(), &full, "{:?} special={}", text, special);
        }
    }
}

#[test]
fn post_processor_special_tokens_are_added_once() {
    let tok = Tokenizer::from_json(&tricky_json()).unwrap().with_prefix_cache(PrefixCacheConfig::default());
    let text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    let ids = tok.encode_prompt(text).unwrap();
    assert_eq!(ids, tok.encode_uncached(text, true).unwrap());
    assert_eq!(ids.first(), Some(&0));
    assert_eq!(ids.last(), Some(&2));
    assert_eq!(&ids[1..ids.len() - 1], &tok.encode(text, false).unwrap()[..]);
}

#[test]
fn position_dependent_pipelines_disable_the_cache() {
    let mut v: Value = serde_json::from_slice(&fixture_json()).unwrap();
    v["normalizer"] = Value::Null;
    v["pre_tokenizer"] = json!({"type": "Metaspace", "replacement": "Ġ", "prepend_scheme": "first", "split": true});
    let tok =
        Tokenizer::from_json(&serde_json::to_vec(&v).unwrap()).unwrap().with_prefix_cache(PrefixCacheConfig::default());
    assert!(!tok.prefix_cache_supported());
    // Why: `first` prepends "Ġ" only to the piece at offset 0, so segments are not independent.
    let whole = tok.encode_uncached("<|im_start|>user hello", false).unwrap();
    let mut parts = tok.encode_uncached("<|im_start|>", false).unwrap();
    parts.extend(tok.encode_uncached("user hello", false).unwrap());
    assert_ne!(whole, parts);
    let text = "<|im_start|>user hello<|im_end|> world";
    assert_eq!(tok.encode(text, false).unwrap(), tok.encode_uncached(text, false).unwrap());
    assert_eq!(tok.prefix_cache_stats().unwrap().misses, 0, "nothing went through the cache");

    let mut v: Value = serde_json::from_slice(&fixture_json()).unwrap();
    v["model"]["dropout"] = json!(0.5);
    let tok = Tokenizer::from_json(&serde_json::to_vec(&v).unwrap()).unwrap();
    assert!(!tok.prefix_cache_supported());
}

// ---------------------------------------------------------------------------------------------
// Chat template features
// ---------------------------------------------------------------------------------------------

fn render(src: &str, msgs: &[ChatMessage], opts: &ChatOptions) -> Result<String, TokenizeError> {
    ChatTemplate::new(src)?
        .with_special_token("bos_token", "<s>")
        .with_special_token("eos_token", "</s>")
        .render(msgs, opts)
}

#[test]
fn strftime_now_writes_the_request_time_never_the_clock() {
    // A Llama-style template dates its header with strftime_now("%d %b %Y") when the request
    // gives no date_string.
    let tok = Tokenizer::from_dir(fixture_dir()).unwrap().with_chat_template(template("llama3_like.jinja"));
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "What day is it?"}]}).to_string();
    let req = kvroute::RouteRequest::parse(body.as_bytes(), [("a", "b")], &Default::default()).unwrap();
    let msgs = req.chat.as_ref().unwrap().messages.to_vec();
    let with_date = |date: &str| {
        let mut opts = ChatOptions::new(true);
        opts.kwargs = vec![("date_string".to_owned(), RawJson::new(&format!("\"{date}\"")).unwrap())];
        tok.encode_chat_with(&msgs, &opts).unwrap()
    };
    // 2026-11-29 13:05:09 UTC, and three days and 999 ms later (whole seconds count).
    let (t1, t2) = (1_795_957_509_000, 1_796_216_709_999);
    for (now_ms, date) in [(t1, "29 Nov 2026"), (t2, "02 Dec 2026")] {
        let text = tok.render_chat(&msgs, &ChatOptions::new(true).with_now_ms(now_ms)).unwrap();
        assert!(text.contains(&format!("Today Date: {date}\n")), "{text}");
        // The route path's entry points render at the `now_ms` they are given, every time.
        let keyable = tok.keyable_token_ids(&req, now_ms).unwrap();
        assert_eq!(keyable, vec![with_date(date)]);
        assert_eq!(tok.keyable_token_ids(&req, now_ms).unwrap(), keyable);
        assert_eq!(tok.request_token_ids(&req, now_ms).unwrap(), keyable);
    }
    assert_ne!(tok.keyable_token_ids(&req, t1).unwrap(), tok.keyable_token_ids(&req, t2).unwrap());
    // Without a time the render fails: the system clock is never read.
    let err = tok.render_chat(&msgs, &ChatOptions::new(true)).unwrap_err();
    assert!(matches!(&err, TokenizeError::Render { message } if message.contains("strftime_now")), "{err}");
}

#[test]
fn template_helpers_behave_like_transformers() {
    let msgs = [ChatMessage::new("user", "  Hi  ")];
    let mut opts = ChatOptions::new(true);
    opts.now_unix_s = Some(1_795_957_509);
    // strftime_now with the given time, special tokens, python string methods, trim_blocks.
    let out = render(
        "{{ bos_token }}{% for m in messages %}\n[{{ m.role.upper() }}] {{ m.content.strip() }}{{ eos_token }}\n{% endfor %}{{ strftime_now('%d %B %Y') }}",
        &msgs,
        &opts,
    )
    .unwrap();
    assert_eq!(out, "<s>[USER] Hi</s>\n29 November 2026");
    // tojson: Python's json.dumps defaults (", " and ": "), no HTML escaping, key order kept.
    opts.tools = Some(RawJson::new(r#"[{"z": "<b>&'é", "a": [1, 2.5, null, true, 1e-7]}]"#).unwrap());
    let out = render("{{ tools | tojson }}|{{ tools[0] | tojson(sort_keys=true, indent=2) }}", &msgs, &opts).unwrap();
    assert_eq!(
        out,
        "[{\"z\": \"<b>&'é\", \"a\": [1, 2.5, null, true, 1e-07]}]|{\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true,\n    1e-07\n  ],\n  \"z\": \"<b>&'é\"\n}"
    );
    let out = render("{{ tools | tojson(ensure_ascii=true, separators=[',', ':']) }}", &msgs, &opts).unwrap();
    assert_eq!(out, r#"[{"z":"<b>&'\u00e9","a":[1,2.5,null,true,1e-07]}]"#);
    // Loop controls, namespace, reverse slicing, generation tags, add_generation_prompt.
    let msgs: Vec<ChatMessage> = (0..5).map(|i| ChatMessage::new("user", i.to_string())).collect();
    let out = render(
        "{% set ns = namespace(n=0) %}{% for m in messages[::-1] %}{% if m.content == '3' %}{% continue %}{% endif %}{% if m.content == '1' %}{% break %}{% endif %}{% generation %}{{ m.content }}{% endgeneration %}{% set ns.n = ns.n + 1 %}{% endfor %}/{{ ns.n }}{% if add_generation_prompt %}>{% endif %}",
        &msgs,
        &ChatOptions::new(true),
    )
    .unwrap();
    assert_eq!(out, "42/2>");
    // Absent fields are undefined, as transformers drops None values.
    let mut m = ChatMessage::without_content("assistant");
    m.tool_call_id = Some("c1".into());
    let out =
        render("{{ messages[0].content is defined }} {{ messages[0].tool_call_id }}", &[m], &ChatOptions::default())
            .unwrap();
    assert_eq!(out, "False c1", "booleans print as Python does");
}

#[test]
fn tool_call_arguments_are_parsed_as_vllm_does() {
    let t = template("chat_template.jinja");
    let mut call = ChatMessage::without_content("assistant");
    call.tool_calls = Some(
        RawJson::new(r#"[{"id":"c1","type":"function","function":{"arguments":"{\"b\":1,\"a\":\"x\"}","name":"f"}}]"#)
            .unwrap(),
    );
    let msgs = [ChatMessage::new("user", "go"), call];
    // vLLM (default): the arguments string becomes an object, printed by `tojson` in its key order.
    let out = t.render(&msgs, &ChatOptions::new(false)).unwrap();
    assert!(out.contains(r#"{"name": "f", "arguments": {"b": 1, "a": "x"}}"#), "{out}");
    // transformers alone: the string is printed as it is.
    let mut plain = ChatOptions::new(false);
    plain.parse_tool_call_arguments = false;
    let out = t.render(&msgs, &plain).unwrap();
    assert!(out.contains(r#"{"name": "f", "arguments": {"b":1,"a":"x"}}"#), "{out}");
    // Empty or invalid arguments become {}; an empty list is dropped; non-function calls are errors.
    for (calls, want) in [
        (r#"[{"function":{"name":"f","arguments":""}}]"#, Some(r#""arguments": {}"#)),
        (r#"[{"function":{"name":"f","arguments":"[1]"}}]"#, Some(r#""arguments": {}"#)),
        (r#"[{"function":{"name":"f"}}]"#, Some(r#""arguments": {}"#)),
        (r#"[]"#, Some("</think>\n\n<|im_end|>")), // no <tool_call>
        (r#"[{"type":"custom","function":{"name":"f"}}]"#, None),
        (r#"[3]"#, None),
    ] {
        let mut m = ChatMessage::without_content("assistant");
        m.tool_calls = Some(RawJson::new(calls).unwrap());
        let out = t.render(&[ChatMessage::new("user", "go"), m], &ChatOptions::new(false));
        match want {
            Some(w) => assert!(out.as_ref().unwrap().contains(w), "{calls}: {out:?}"),
            None => assert!(matches!(out, Err(TokenizeError::Json { .. })), "{calls}: {out:?}"),
        }
    }
}

#[test]
fn template_kwargs_override_special_tokens() {
    let mut opts = ChatOptions::new(false);
    opts.kwargs = vec![
        ("bos_token".into(), RawJson::new("\"<B>\"").unwrap()),
        ("enable_thinking".into(), RawJson::new("false").unwrap()),
    ];
    let out = render("{{ bos_token }}{{ enable_thinking is false }}", &[], &opts).unwrap();
    assert_eq!(out, "<B>True");
}

// ---------------------------------------------------------------------------------------------
// Malformed inputs are typed errors
// ---------------------------------------------------------------------------------------------

#[test]
fn malformed_inputs_are_typed_errors() {
    let good = fixture_json();
    for bad in [
        &b""[..],
        b"{",
        b"[]",
        b"{\"model\": 3}",
        &good[..good.len() / 2],
        br#"{"version":"1.0","added_tokens":[],"normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
            "model":{"type":"BPE","vocab":{"a":0},"merges":["a b"]}}"#,
    ] {
        assert!(matches!(Tokenizer::from_json(bad), Err(TokenizeError::Tokenizer { .. })), "{}", String::from_utf8_lossy(bad));
    }
    assert!(matches!(Tokenizer::from_file("/nonexistent/tokenizer.json"), Err(TokenizeError::Io { .. })));
    assert!(matches!(ChatTemplate::new("{% for %}"), Err(TokenizeError::Template { .. })));
    assert!(matches!(ChatTemplate::new("{% if x %}"), Err(TokenizeError::Template { .. })));
    assert!(matches!(ChatTemplate::from_tokenizer_config("{", None), Err(TokenizeError::Json { .. })));
    assert!(matches!(ChatTemplate::from_tokenizer_config("[1]", None), Err(TokenizeError::Json { .. })));
    assert_eq!(
        ChatTemplate::from_tokenizer_config("{\"eos_token\": \"x\"}", None).err(),
        Some(TokenizeError::NoChatTemplate)
    );
    assert!(matches!(
        ChatTemplate::from_tokenizer_config(r#"{"chat_template": "x", "bos_token": 5}"#, None),
        Err(TokenizeError::Json { .. })
    ));
    let listed = ChatTemplate::from_tokenizer_config(
        r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}],
            "eos_token": {"content": "</s>", "special": true}}"#,
        None,
    )
    .unwrap();
    assert_eq!(listed.render(&[], &ChatOptions::default()).unwrap(), "D</s>");
    assert!(RawJson::new("{\"a\":").is_err());
    // Rendering errors.
    let t = ChatTemplate::new("{{ messages[0].content.nope.deeper }}").unwrap();
    assert!(matches!(
        t.render(&[ChatMessage::new("user", "x")], &ChatOptions::default()),
        Err(TokenizeError::Render { .. })
    ));
    let t = ChatTemplate::new("{{ raise_exception('no ' ~ messages|length) }}").unwrap();
    assert_eq!(t.render(&[], &ChatOptions::default()), Err(TokenizeError::Rejected { message: "no 0".into() }));
    let t = ChatTemplate::new("{{ undefined_thing | tojson }}").unwrap();
    assert!(matches!(t.render(&[], &ChatOptions::default()), Err(TokenizeError::Render { .. })));
    // continue_final_message needs a final message with content and no generation prompt.
    let t = ChatTemplate::new("{% for m in messages %}{{ m.content | trim }}{% endfor %}").unwrap();
    let mut cont = ChatOptions::new(true);
    cont.continue_final_message = true;
    let msgs = [ChatMessage::new("assistant", "abc ")];
    assert!(matches!(t.render(&msgs, &cont), Err(TokenizeError::Render { .. })));
    cont.add_generation_prompt = false;
    assert_eq!(t.render(&msgs, &cont).unwrap(), "abc");
    assert!(matches!(t.render(&[], &cont), Err(TokenizeError::Render { .. })));
    assert!(matches!(t.render(&[ChatMessage::without_content("assistant")], &cont), Err(TokenizeError::Render { .. })));
    let drops = ChatTemplate::new("{% for m in messages %}{{ m.role }}{% endfor %}").unwrap();
    assert!(matches!(drops.render(&msgs, &cont), Err(TokenizeError::Render { .. })), "template drops the content");
    // A chat without a template.
    let bare = Tokenizer::from_json(&good).unwrap();
    assert_eq!(bare.encode_chat(&[ChatMessage::new("user", "x")], true), Err(TokenizeError::NoChatTemplate));
}

// ---------------------------------------------------------------------------------------------
// Key limits: a chat with a part the router cannot key (an image) keys only the ids before it
// ---------------------------------------------------------------------------------------------

/// A parsed chat whose message `at` is `[text, image]`.
fn media_chat(messages: &[(&str, &str)], at: usize, add_generation_prompt: bool) -> kvroute::RouteRequest {
    let msgs: Vec<Value> = messages
        .iter()
        .enumerate()
        .map(|(i, (role, text))| {
            if i == at {
                json!({"role": role, "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}]})
            } else {
                json!({"role": role, "content": text})
            }
        })
        .collect();
    let body = json!({"model": "m", "messages": msgs, "add_generation_prompt": add_generation_prompt}).to_string();
    kvroute::RouteRequest::parse(body.as_bytes(), [("a", "b")], &Default::default()).unwrap()
}

/// The ids the engine could see: the conversation rendered with the media message's content
/// being `content` (what vLLM writes there: a placeholder first, then the text, or anything else).
fn engine_ids(req: &kvroute::RouteRequest, content: &str) -> Vec<u32> {
    let chat = req.chat.as_ref().unwrap();
    let at = req.key_limit.unwrap().message.unwrap();
    let mut msgs = chat.messages.to_vec();
    msgs[at].content = Some(content.to_owned());
    let text = cached().render_chat(&msgs, &ChatOptions::new(chat.add_generation_prompt)).unwrap();
    cached().encode_uncached(&text, false).unwrap()
}

const CONVERSATIONS: [&[(&str, &str)]; 3] = [
    &[("system", "You describe pictures. Be exact."), ("user", "What is this?")],
    &[("system", "S"), ("user", "first question"), ("assistant", "first answer"), ("user", "and this one?")],
    &[("user", "Compare with the earlier one.")],
];

#[test]
fn keyable_ids_end_before_the_media_messages_content() {
    for (n, conv) in CONVERSATIONS.iter().enumerate() {
        let at = conv.len() - 1;
        let req = media_chat(conv, at, true);
        let keyable = cached().keyable_token_ids(&req, NOW_MS).unwrap();
        assert_eq!(keyable.len(), 1);
        let keyable = &keyable[0];
        // Whatever vLLM puts at the start of that content, the keyable ids are a prefix of it.
        for content in ["<image>\nWhat is this?", "What is this?", "\n\nx", " x", "<|im_start|>", "<think>", ""] {
            let full = engine_ids(&req, content);
            assert!(full.starts_with(keyable), "conversation {n}, content {content:?}");
            assert!(full.len() > keyable.len());
        }
        // Exactly one token short of the rendering before the content (the boundary token).
        let chat = req.chat.as_ref().unwrap();
        let mut msgs = chat.messages.to_vec();
        msgs[at].content = Some("\u{1}".to_owned());
        let text = cached().render_chat(&msgs, &ChatOptions::new(true)).unwrap();
        let before = &text[..text.find('\u{1}').unwrap()];
        assert!(before.ends_with("<|im_start|>user\n"), "{before:?}");
        assert_eq!(keyable.len() + 1, cached().encode_uncached(before, false).unwrap().len());
        // The text before the image in the same message is not keyed (vLLM puts the image
        // placeholder in front of the message's text by default).
        let old = cached().request_token_ids(&req, NOW_MS).unwrap().remove(0);
        assert!(old.len() > keyable.len() + 3);
    }
}

#[test]
fn without_a_key_limit_keyable_ids_are_the_request_ids() {
    let body = json!({"model": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]}]}).to_string();
    let req = kvroute::RouteRequest::parse(body.as_bytes(), [("a", "b")], &Default::default()).unwrap();
    assert_eq!(req.key_limit, None);
    assert_eq!(cached().keyable_token_ids(&req, NOW_MS).unwrap(), cached().request_token_ids(&req, NOW_MS).unwrap());
    let plain = kvroute::RouteRequest::parse(
        json!({"model": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "a\nb"}]})
            .to_string()
            .as_bytes(),
        [("a", "b")],
        &Default::default(),
    )
    .unwrap();
    assert_eq!(cached().request_token_ids(&req, NOW_MS).unwrap(), cached().request_token_ids(&plain, NOW_MS).unwrap());
}

#[test]
fn a_media_message_in_the_middle_keeps_every_message_for_the_template() {
    // The template looks at the whole conversation (Qwen3-style last-query index); the keys
    // end at the first media message's content however the conversation goes on.
    let conv: &[(&str, &str)] = &[("system", "S"), ("user", "look"), ("assistant", "A cat."), ("user", "And now?")];
    let req = media_chat(conv, 1, true);
    let keyable = cached().keyable_token_ids(&req, NOW_MS).unwrap().remove(0);
    for content in ["<image>\nlook", "look", "x"] {
        assert!(engine_ids(&req, content).starts_with(&keyable), "{content:?}");
    }
    let system_only = cached().encode_uncached("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n", false).unwrap();
    assert_eq!(keyable[..], system_only[..system_only.len() - 1]);
}

#[test]
fn completions_with_prompt_embeds_key_their_text_prompts() {
    let body = json!({"model": "m", "prompt": "Hello there, general.", "prompt_embeds": "AAAA"}).to_string();
    let req = kvroute::RouteRequest::parse(body.as_bytes(), [("a", "b")], &Default::default()).unwrap();
    assert!(req.key_limit.is_some());
    assert_eq!(cached().keyable_token_ids(&req, NOW_MS).unwrap(), cached().request_token_ids(&req, NOW_MS).unwrap());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Random text before the media message and random content in it: the keyable ids are
    /// always a prefix of the full ids.
    #[test]
    fn keyable_ids_are_a_prefix_whatever_follows(
        system in "[ a-zA-Z0-9\n.,!<>|_]{0,40}",
        user in "[ a-zA-Z0-9\n.,!<>|_]{0,40}",
        content in "[ a-zA-Z0-9\n.,!<>|_]{0,20}",
    ) {
        let conv: &[(&str, &str)] = &[("system", &system), ("user", &user)];
        let req = media_chat(conv, 1, true);
        let keyable = cached().keyable_token_ids(&req, NOW_MS).unwrap().remove(0);
        let full = engine_ids(&req, &content);
        prop_assert!(full.starts_with(&keyable), "{:?} vs {:?}", keyable, full);
    }
}

#[test]
fn inline_media_still_end_the_tokenizer_keys() {
    // The approximate keys may go past an image with inline data (its identity is known), the
    // token ids may not: how many placeholder tokens it becomes is the model processor's call.
    let body = json!({"model": "m", "messages": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "q"}]},
        {"role": "assistant", "content": "A"},
    ]})
    .to_string();
    let req = kvroute::RouteRequest::parse(body.as_bytes(), [("a", "b")], &Default::default()).unwrap();
    assert_eq!(req.key_limit, None);
    assert_eq!(req.chat.as_ref().unwrap().media.map(|m| m.message), Some(1));
    let keyable = cached().keyable_token_ids(&req, NOW_MS).unwrap().remove(0);
    let head = cached().encode_uncached("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n", false).unwrap();
    assert_eq!(keyable[..], head[..head.len() - 1]);
}
