//! The precise pipeline: what each engine reports it holds.
//!
//! - feed: engines' KV events, as msgpack batches ([`events`]: types and the decoder), received by
//!   the ZMQ subscriber (`zmq_sub`, feature `zmq`) or handed in by a binding;
//! - keys ([`PreciseKeys`]): the router's dual keys chained over token ids, or the engines' own
//!   block hashes ([`engine_hash`]: vLLM's hasher, pickle and CBOR encoders);
//! - index ([`KvIndex`]): the event-fed store (the shared [`crate::index::PrefixIndex`]) with its
//!   per-publisher stream judgment and the speculative entries of requests just routed;
//! - stream judgment ([`StreamTracker`]): sequence numbers, duplicates, gaps and publisher
//!   restarts of one publisher's stream, without an index (what a forwarder needs too).

pub(crate) mod engine_hash;
pub(crate) mod events;
mod index;
mod keys;
#[cfg(feature = "zmq")]
mod sink;
pub(crate) mod speculation;
mod stream;
#[cfg(feature = "zmq")]
pub(crate) mod zmq_sub;

pub use index::{ApplyOutcome, KvIndex, PreciseStats};
pub use keys::{DualKeyHashing, PreciseKeys};
#[cfg(feature = "zmq")]
pub use sink::{Batch, BatchOrigin, EventSink};
pub use stream::{
    batch_digest, StreamInfo, StreamJudgment, StreamTracker, StreamVerdict, MAX_PUBLISHER_TS_S, RECENT_BATCHES,
};
