//! # kvroute
//!
//! KV-cache-aware routing for LLM serving. For each inference request, kvroute picks the
//! endpoint(s) and the serving mode:
//!
//! - **decode-direct**: a decode endpoint already holds the prompt's KV cache, skip prefill;
//! - **colocated**: one endpoint runs prefill and decode (short requests, or when shipping the KV
//!   cache would not pay);
//! - **disaggregated**: a prefill endpoint computes the KV cache and ships it to a decode endpoint.
//!
//! The whole decision is pure Rust with no clock, threads or I/O: time is a parameter. The same
//! code runs natively, in the Envoy wasm filter, under Python and behind the C ABI.
//!
//! This is enforced, not only claimed: the crate's `clippy.toml` disallows the system and
//! monotonic clocks (`SystemTime::now`, `Instant::now`), spawning threads, sleeping and
//! `std::net` sockets, and the repository's test script denies those lints and checks that they
//! still bite. Only the feature-gated adapters allow them, each with its reason: the wall clock
//! (`unix_time_ms`, feature `wall-clock`) and the ZMQ subscriber's thread (`zmq_sub`, feature
//! `zmq`). Chat templates follow the rule too: their `strftime_now` writes the `now_ms` of the
//! route call (feature `tokenizer`).
//!
//! ```
//! use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Role, Router};
//!
//! let router = Router::new(Policy::from_json(r#"{"modes": {"colocated_input_max_tokens": 256}}"#)?);
//! router.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode))?;
//! router.upsert_endpoint(EndpointSpec::new("10.0.0.2:8000", Role::Decode))?;
//! router.update_metrics("10.0.0.1:8000", MetricsSnapshot { waiting: 0, kv_usage: 0.2, updated_ms: 1_000, ..Default::default() })?;
//! router.update_metrics("10.0.0.2:8000", MetricsSnapshot { waiting: 1, kv_usage: 0.3, updated_ms: 1_000, ..Default::default() })?;
//!
//! let system = "You are a helpful assistant. ".repeat(200);
//! let body = serde_json::json!({
//!     "model": "llama",
//!     "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
//!     "max_tokens": 64,
//! });
//! let first = router.route_http(body.to_string().as_bytes(), [("x-request-id", "r1")], 1_000)?;
//! router.complete(&first.request_id)?;
//! // The same prompt again: the endpoint that served it is assumed to hold its KV cache.
//! let again = router.route_http(body.to_string().as_bytes(), [("x-request-id", "r2")], 1_010)?;
//! assert_eq!(again.endpoint(), first.endpoint());
//! assert_eq!(again.mode(), Some(kvroute::Mode::DecodeDirect));
//! assert_eq!(again.header("x-kvroute-mode"), Some("decode-direct"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! See `Router` for state handling and hot reload, `config` for every policy knob, and
//! `decision` for the rules.

pub mod admission;
pub mod approx;
#[cfg(feature = "wall-clock")]
mod clock;
pub mod config;
pub mod decision;
pub mod effect;
pub mod endpoints;
pub mod error;
pub mod index;
pub mod metrics;
pub mod precise;
pub mod request;
pub mod router;
pub mod score;
#[cfg(feature = "tokenizer")]
pub mod tokenize;

pub use approx as hashing;
#[cfg(feature = "wall-clock")]
pub use clock::{unix_clock, unix_time_ms, Clock};
#[cfg(feature = "zmq")]
pub use precise::zmq_sub;
pub use precise::{engine_hash, events};

pub use approx::{ApproxHashing, BlockKey, RequestKeys};
pub use config::{Policy, PolicyConfig};
pub use decision::{Decision, Judgment, JudgmentSource, Mode, Outcome, Rule, Shed, TransferEstimate};
pub use effect::{EffectDecodeError, RoutingEffect};
pub use endpoints::{EndpointSpec, MetricsSnapshot, Role};
pub use engine_hash::{
    BlockDigest, BlockExtras, EngineHashError, EngineHashSpec, EngineHasher, ExtraKeysForm, HashAlgo, LoraAdapter,
    NoneHashSeed,
};
pub use error::{ConfigError, EventIngestError, RequestError, RouteError, StateError};
pub use events::{
    decode_batch, BlockRemoved, BlockStored, EngineBlockHash, ErrorSite, EventBatch, EventError, KvEvent, Medium,
};
pub use index::{ApproxIndex, IndexStats};
pub use metrics::{parse_prometheus, MetricsError};
pub use precise::DualKeyHashing;
pub use precise::{ApplyOutcome, KvIndex, PreciseKeys, PreciseStats, StreamInfo, StreamVerdict};
pub use request::{Api, ChatInput, ChatMessage, Horizon, JudgmentHint, Prompt, RawJson, RouteRequest};
pub use router::{ActivePolicy, EndpointInfo, Router, RouterCore, RouterCounters, RouterStats};
pub use score::{EndpointScore, FilterReason};
