//! Exact token ids for routing (feature `tokenizer`, native only): Hugging Face `tokenizers` for
//! the model's `tokenizer.json`, minijinja for its chat template, and a prefix tokenization cache
//! so that turn N of a conversation only tokenizes what is new.
//!
//! The module is private: its full description is the documentation of [`Tokenizer`].

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

use crate::request::{ChatMessage, RawJson};

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
