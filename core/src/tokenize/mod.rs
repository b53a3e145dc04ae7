//! Exact token ids for routing (feature `tokenizer`, native only): Hugging Face `tokenizers` for
//! the model's `tokenizer.json`, minijinja for its chat template, and a prefix tokenization cache
//! so that turn N of a conversation only tokenizes what is new.
//!
//! The ids are the ones the engine computes. vLLM renders a chat request with transformers'
//! `apply_chat_template` (Jinja2 with `trim_blocks`, `lstrip_blocks`, loop controls and the
//! `raise_exception`, `tojson` and `strftime_now` helpers) and tokenizes the text with
//! `add_special_tokens=False`; a completions prompt is tokenized with `add_special_tokens=True`.
//! [`Tokenizer::encode_chat`] and [`Tokenizer::encode_prompt`] do the same.
//!
//! `strftime_now` writes the request's time, never the system clock's: the caller passes it
//! ([`ChatOptions::now_unix_s`], [`Tokenizer::keyable_token_ids`]'s `now_ms`; the router passes
//! the `now_ms` of the route call), so a rendering is a function of its inputs.
//!
//! # Multimodal requests
//!
//! Images, audio, video and embeddings become placeholder tokens that the model's processor
//! writes and whose blocks vLLM hashes with the media's own hash, none of which a router has. The
//! router therefore keys only what comes before them: [`Tokenizer::keyable_token_ids`] renders
//! the conversation with the content of the first message holding such a part replaced by a
//! sentinel, cuts the text where the sentinel starts, tokenizes that prefix and drops its last
//! token (the text after the cut may merge with it). See `request` for why the cut is at the
//! message's content rather than at the part.
//!
//! # The prefix cache
//!
//! Hugging Face tokenizers first cut the text at *added tokens* (`<|im_start|>`, `<|im_end|>`, …)
//! and tokenize each piece between them on its own. So the text can be cut after an added token
//! and each *segment* tokenized alone, provided the cut cannot change which added tokens match or
//! how they strip whitespace. A cut is made only after an added token that
//!
//! - is matched on the raw text (`normalized: false`), so the cut is also a piece boundary;
//! - has no `rstrip` (which would eat whitespace after the cut) and no `single_word` (which looks
//!   at the character after it);
//! - ends with an ASCII character that is neither a word character nor whitespace (so the
//!   `single_word` and `lstrip` checks of a token right after the cut see the same thing as at
//!   the start of a text, and an earlier token's `rstrip` stops before the cut);
//! - is not skipped (`encode_special_tokens` off for special tokens).
//!
//! Matches are found with the same automaton `tokenizers` uses (daachorse, leftmost-longest, over
//! every non-normalized added token), so the cuts are exactly among the places where `tokenizers`
//! itself cuts. The cache is disabled (everything is tokenized in full) when a component depends on
//! a piece's position in the whole text: a `Metaspace` pre-tokenizer with `prepend_scheme: first`,
//! or BPE dropout. With these rules the ids of a text are the concatenation of the ids of its
//! segments, each of which depends only on the segment's own text; the cache maps segment text →
//! ids (hash lookup, then a byte comparison, so a hash collision can only cost a miss). The tests
//! in `core/tests/tokenize.rs` check the equality on many conversations and random texts.
//!
//! ```
//! use kvroute::tokenize::{ChatMessage, PrefixCacheConfig, Tokenizer};
//!
//! // A Hugging Face model directory: tokenizer.json, tokenizer_config.json, chat_template.jinja.
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/tokenizer");
//! let tok = Tokenizer::from_dir(dir)?.with_prefix_cache(PrefixCacheConfig::default());
//! let mut chat = vec![ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi!")];
//! let turn1 = tok.encode_chat(&chat, true)?;
//! chat.push(ChatMessage::new("assistant", "Hello."));
//! chat.push(ChatMessage::new("user", "What is a KV cache?"));
//! let turn2 = tok.encode_chat(&chat, true)?; // only the new messages are tokenized
//! // Same prefix up to turn 1's generation header `<|im_start|>assistant\n` (3 tokens).
//! assert_eq!(turn2[..turn1.len() - 3], turn1[..turn1.len() - 3]);
//! let stats = tok.prefix_cache_stats().unwrap_or_default();
//! assert!(stats.hit_tokens > 0);
//! # Ok::<(), kvroute::tokenize::TokenizeError>(())
//! ```

mod cache;
mod py_json;
mod segment;
mod strftime;
mod template;
mod tokenizer;

pub use cache::{
    PrefixCacheConfig, PrefixCacheStats, DEFAULT_MAX_SEGMENT_BYTES, DEFAULT_PREFIX_CACHE_BYTES, SEGMENT_OVERHEAD_BYTES,
};
pub use template::{ChatOptions, ChatTemplate};
pub use tokenizer::Tokenizer;

pub use crate::request::{ChatMessage, RawJson};

/// A tokenizer file, chat template or tokenizer config could not be used, or tokenization or
/// rendering failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizeError {
    /// A file could not be read.
    #[error("cannot read `{path}`: {message}")]
    Io {
        /// The path.
        path: String,
        /// What the OS said.
        message: String,
    },
    /// `tokenizer.json` could not be loaded.
    #[error("invalid tokenizer.json: {message}")]
    Tokenizer {
        /// What `tokenizers` said.
        message: String,
    },
    /// `tokenizer_config.json` (or another JSON input) is malformed.
    #[error("invalid {what}: {message}")]
    Json {
        /// Which input.
        what: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The chat template does not compile.
    #[error("invalid chat template: {message}")]
    Template {
        /// What minijinja said (with line information).
        message: String,
    },
    /// Rendering the chat template failed (undefined value, wrong type, …).
    #[error("chat template rendering failed: {message}")]
    Render {
        /// What minijinja said.
        message: String,
    },
    /// The template itself rejected the conversation with `raise_exception(message)`.
    #[error("chat template rejected the conversation: {message}")]
    Rejected {
        /// The template's message.
        message: String,
    },
    /// A chat was given to a tokenizer that has no chat template.
    #[error("no chat template: the tokenizer config has none and none was given")]
    NoChatTemplate,
    /// `tokenizers` failed to encode the text.
    #[error("tokenization failed: {message}")]
    Encode {
        /// What `tokenizers` said.
        message: String,
    },
}
