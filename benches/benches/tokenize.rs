//! Exact tokenization of turn N of a long conversation: with the prefix cache (only the new turn
//! is tokenized) vs full tokenization, at ~95% shared prefix (an ~8k-token conversation whose
//! last ~400 tokens are new: the assistant's previous reply and the new user message).
//! Target: cached ≤ 15% of full.
//!
//! Turn N-1 (the conversation up to the previous user message) went through the cache first, as
//! the previous request of the conversation would have. Both sides render the chat template and
//! tokenize; the new reply and message differ at every iteration (a counter is written into them),
//! so the cached side always tokenizes ~400 fresh tokens. Before the criterion timings, a plain
//! timing loop prints both times and the ratio.
//!
//! Run: `cargo bench -p kvroute-benches --features tokenizer --bench tokenize`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kvroute::{ChatMessage, PrefixCacheConfig, Tokenizer};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/tokenizer");
const PREFIX_TOKENS: usize = 7_600;
/// New tokens in turn N: the previous assistant reply and the new user message.
const REPLY_TOKENS: usize = 150;
const NEW_USER_TOKENS: usize = 250;

struct Setup {
    full: Tokenizer,
    cached: Tokenizer,
    msgs: Vec<ChatMessage>,
    reply: String,
    new_turn: String,
}

/// Text from the fixture corpus (the tokenizer's own training text), read in rotating chunks.
struct Text {
    corpus: String,
    at: usize,
}

impl Text {
    fn next(&mut self, bytes: usize) -> String {
        let start = self.at % (self.corpus.len() - bytes - 8);
        let start = (start..).find(|&i| self.corpus.is_char_boundary(i)).unwrap();
        let end = (start + bytes..).find(|&i| self.corpus.is_char_boundary(i)).unwrap();
        self.at = end + 977;
        self.corpus[start..end].to_owned()
    }
}

/// Text of about `tokens` tokens.
fn text_of(tok: &Tokenizer, text: &mut Text, tokens: usize) -> String {
    let mut s = text.next(tokens * 2);
    while tok.encode_uncached(&s, false).unwrap().len() < tokens {
        s.push_str(&text.next(16));
    }
    s
}

fn setup() -> Setup {
    let full = Tokenizer::from_dir(FIXTURE).unwrap();
    let cached = Tokenizer::from_dir(FIXTURE).unwrap().with_prefix_cache(PrefixCacheConfig::default());
    let corpus = std::fs::read_to_string(Path::new(FIXTURE).join("corpus.txt")).unwrap();
    let mut text = Text { corpus, at: 0 };
    let mut msgs = vec![ChatMessage::new("system", text.next(3_000))];
    while full.encode_chat(&msgs, true).unwrap().len() < PREFIX_TOKENS {
        msgs.push(ChatMessage::new("user", text.next(700)));
        msgs.push(ChatMessage::new("assistant", text.next(1_400)));
    }
    msgs.pop(); // the conversation so far ends with the previous user message
                // Turn N-1 went through the cache (the previous request of this conversation).
    cached.encode_chat(&msgs, true).unwrap();
    let reply = text_of(&full, &mut text, REPLY_TOKENS);
    let new_turn = text_of(&full, &mut text, NEW_USER_TOKENS);
    msgs.push(ChatMessage::new("assistant", reply.clone()));
    msgs.push(ChatMessage::new("user", new_turn.clone()));
    Setup { full, cached, msgs, reply, new_turn }
}

/// Writes a fresh counter into the reply and the new message so that they are never cache hits.
fn refresh(msgs: &mut [ChatMessage], reply: &str, new_turn: &str, i: u64) {
    let n = msgs.len();
    msgs[n - 2].content = Some(format!("[{i}] {reply}"));
    msgs[n - 1].content = Some(format!("[{i}] {new_turn}"));
}

fn time(mut f: impl FnMut(u64), min: Duration) -> Duration {
    let mut i = 0u64;
    let start = Instant::now();
    while start.elapsed() < min || i < 20 {
        f(i);
        i += 1;
    }
    start.elapsed() / u32::try_from(i).unwrap_or(u32::MAX)
}

fn bench_tokenize(c: &mut Criterion) {
    let Setup { full, cached, mut msgs, reply, new_turn } = setup();
    let total = full.encode_chat(&msgs, true).unwrap();
    let before = cached.prefix_cache_stats().unwrap();
    refresh(&mut msgs, &reply, &new_turn, u64::MAX);
    assert_eq!(cached.encode_chat(&msgs, true).unwrap(), full.encode_chat(&msgs, true).unwrap());
    let after = cached.prefix_cache_stats().unwrap();
    let fresh = after.miss_tokens - before.miss_tokens;
    let text = full.render_chat(&msgs, &kvroute::ChatOptions::new(true)).unwrap();
    eprintln!(
        "conversation: {} messages, {} tokens, {} bytes rendered; turn N tokenizes {} new tokens ({:.1}% shared prefix)",
        msgs.len(),
        total.len(),
        text.len(),
        fresh,
        100.0 * (1.0 - fresh as f64 / total.len() as f64)
    );

    let min = Duration::from_secs(2);
    let t_render = time(|_| drop(black_box(full.render_chat(&msgs, &kvroute::ChatOptions::new(true)))), min);
    let mut m = msgs.clone();
    let t_full = time(
        |i| {
            refresh(&mut m, &reply, &new_turn, i);
            black_box(full.encode_chat(&m, true).unwrap());
        },
        min,
    );
    let t_cached = time(
        |i| {
            refresh(&mut m, &reply, &new_turn, i);
            black_box(cached.encode_chat(&m, true).unwrap());
        },
        min,
    );
    // Rendered text with the counter of iteration i in the new turn (built the same way for both).
    let marker = format!("[{}] ", u64::MAX);
    let with_counter = |i: u64| text.replace(&marker, &format!("[{i}] "));
    let t_text_full = time(|i| drop(black_box(full.encode_uncached(&with_counter(i), false))), min);
    let t_text_cached = time(|i| drop(black_box(cached.encode(&with_counter(i), false))), min);
    let cold = Tokenizer::from_dir(FIXTURE).unwrap().with_prefix_cache(PrefixCacheConfig::default());
    let t_text_cold = time(
        |i| {
            cold.clear_prefix_cache();
            drop(black_box(cold.encode(&with_counter(i), false)));
        },
        min,
    );
    eprintln!(
        "encode_chat (render + tokenize): full {:?}, cached {:?}, ratio {:.1}% (render alone {:?})",
        t_full,
        t_cached,
        100.0 * t_cached.as_secs_f64() / t_full.as_secs_f64(),
        t_render
    );
    eprintln!(
        "encode (rendered text only):     full {:?}, cached {:?}, ratio {:.1}%; empty cache {:?} ({:.0}% of full)",
        t_text_full,
        t_text_cached,
        100.0 * t_text_cached.as_secs_f64() / t_text_full.as_secs_f64(),
        t_text_cold,
        100.0 * t_text_cold.as_secs_f64() / t_text_full.as_secs_f64()
    );

    let mut g = c.benchmark_group("tokenize_turn_n");
    g.sample_size(30);
    let mut i = 0u64;
    g.bench_function("encode_chat_full", |b| {
        b.iter(|| {
            i += 1;
            refresh(&mut m, &reply, &new_turn, i);
            full.encode_chat(black_box(&m), true).unwrap()
        });
    });
    g.bench_function("encode_chat_cached", |b| {
        b.iter(|| {
            i += 1;
            refresh(&mut m, &reply, &new_turn, i);
            cached.encode_chat(black_box(&m), true).unwrap()
        });
    });
    g.finish();
}

criterion_group!(benches, bench_tokenize);
criterion_main!(benches);
