//! The approximate (tokenizer-free) pipeline.
//!
//! - keys ([`ApproxHashing`]): a prompt's bytes (or token ids) cut into fixed-size blocks and
//!   chained into 64-bit block keys, seeded by model and `cache_salt`;
//! - index ([`ApproxIndex`](crate::ApproxIndex), the shared [`crate::index::PrefixIndex`] store): which endpoint is
//!   assumed to hold which blocks;
//! - feed: the router's own decisions. A routed request's blocks are assumed resident on its
//!   target (and prefill endpoint) at once; nothing else writes this index.

mod keys;

pub(crate) use keys::{bytes_hash, mul_hi, token_bytes};
pub use keys::{ApproxHashing, BlockKey, RequestKeys};
