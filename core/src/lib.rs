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
//! # The crate's map
//!
//! Every public item is re-exported at the crate root (one path each); the modules are private.
//!
//! | module | job | main items |
//! |---|---|---|
//! | `router/` | the state machine and the decision, in phases: keys → features → filters → pick → admission → mode → book-keeping → decision | [`RouterCore`], [`Router`] (its thread-safe wrapper), [`ActivePolicy`], [`RouterStats`] |
//! | `request/` | requests: types, header reader, JSON body and token-id parser, chat messages, media, chat rendering | [`RouteRequest`], [`Prompt`], [`ChatMessage`] |
//! | `decision` | the mode rules, the judgment rubric, the transfer-tax model, the outcome | [`Decision`], [`Outcome`], [`Mode`], [`Rule`], [`transfer_estimate`] |
//! | `score`, `admission` | per-endpoint features, filters and pickers; pool saturation and shedding (flow control off) | [`EndpointScore`], [`FilterReason`] |
//! | `flow/` | flow control: the `flow_control` policy section, the controller (bands, limits, TTLs, shedding, dispatch), fairness (global strict, round robin, attained service) and ordering (FCFS, EDF, SLO deadline) policies, saturation detectors, metrics; driven through [`RouterCore::admit`] and [`RouterCore::take_releases`] | [`Admission`], [`Release`], [`Ticket`], [`Rejection`], [`FlowControlConfig`], [`FlowStats`] |
//! | `approx/` | the approximate pipeline: block keys over prompt bytes, fed by the router's decisions | [`ApproxHashing`], [`RequestKeys`], [`ApproxIndex`] |
//! | `precise/` | the precise pipeline: KV events (types, msgpack decoder), vLLM's block hasher (pickle, CBOR), request keys, the event-fed index, stream judgment, speculation, the ZMQ subscriber (feature `zmq`) and its sinks | [`decode_batch`], [`EngineHasher`], [`PreciseKeys`], [`KvIndex`], [`StreamTracker`] |
//! | `index/` | the prefix store both indexes use (open addressing, generational LRU, sweeper) | [`PrefixIndex`], [`IndexStats`] |
//! | `tokenize/` | feature `tokenizer`: Hugging Face tokenizer, chat templates, Python-compatible JSON, strftime, segmenter, prefix cache | `Tokenizer`, `ChatTemplate` |
//! | `config`, `endpoints`, `metrics`, `effect`, `error` | the policy document, the endpoint table, Prometheus parsing and exposition, replication effects, typed errors | [`Policy`], [`EndpointSpec`], [`MetricsSnapshot`], [`parse_prometheus`], [`RoutingEffect`] |
//! | `replica/` | router replicas: the batch format, the outbox, the peer table (incarnations, sequence numbers, silence), applied through [`RouterCore::apply_replica_batch`]; the NATS transport (feature `nats`) | [`ReplicaConfig`], [`ReplicaBatch`], [`ReplicaStats`], `Replicator` |
//! | `clock` | feature `wall-clock`: the one reading of the system clock, for bindings and the subscriber | `unix_time_ms` |
//!
//! No clock, thread or socket outside `clock` and the subscriber: `core/clippy.toml` forbids them
//! and the test command checks it.
//!
//! # Flow control
//!
//! Off by default. With `flow_control.enabled`, every request goes through [`RouterCore::admit`]
//! before it is routed: admitted at once, queued behind a [`Ticket`] in its tenant's queue of its
//! priority band, or rejected with an HTTP status and an `x-llm-d-request-dropped-reason`.
//! Queued requests come back through [`RouterCore::take_releases`], called at every dispatch
//! opportunity (completions, metrics updates, a timer): the protocol is on [`Admission`].
//!
//! ```
//! use kvroute::{Admission, EndpointSpec, Policy, ReleaseOutcome, Role, RouterCore};
//!
//! let policy = r#"{"flow_control": {"enabled": true,
//!     "saturation_detector": {"kind": "concurrency", "max_requests_per_endpoint": 1}}}"#;
//! let mut core = RouterCore::new(Policy::from_json(policy)?);
//! core.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode))?;
//! let body = br#"{"model": "m", "prompt": "hello", "max_tokens": 8}"#;
//! let tenant = |t: &'static str| [("x-llm-d-inference-fairness-id", t)];
//!
//! assert_eq!(core.admit_http(body, tenant("a"), 0)?, Admission::Admit);
//! let first = core.route_http(body, tenant("a"), 0)?; // the endpoint is now full
//! let Admission::Queued(ticket) = core.admit_http(body, tenant("b"), 1)? else { panic!() };
//! assert!(core.take_releases(2).is_empty()); // still full
//!
//! core.complete(&first.request_id)?; // capacity frees: a dispatch opportunity
//! let released = core.take_releases(3);
//! assert_eq!((released[0].ticket, released[0].outcome), (ticket, ReleaseOutcome::Dispatched));
//! let second = core.route_http(body, tenant("b"), 3)?; // route the held request now
//! # let _ = second;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod admission;
mod approx;
#[cfg(feature = "wall-clock")]
mod clock;
mod config;
mod decision;
mod effect;
mod endpoints;
mod error;
mod flow;
mod index;
mod metrics;
mod precise;
mod replica;
mod request;
mod router;
mod score;
#[cfg(feature = "tokenizer")]
mod tokenize;

// One path per item: every public item is re-exported here, and only here.

// The router.
pub use router::{ActivePolicy, EndpointInfo, ReplicaApplied, Router, RouterCore, RouterCounters, RouterStats};

// Router replicas.
pub use replica::{
    validate_replica_id, ReplicaBatch, ReplicaConfig, ReplicaEntry, ReplicaEntryRef, ReplicaError, ReplicaStats,
    BATCH_MAGIC, MAX_REPLICA_ID_LEN,
};
#[cfg(feature = "nats")]
pub use replica::{NatsReplicaOptions, ReplicaPort, Replicator, ReplicatorStats, StreamOptions};

// Requests.
pub use request::{
    Api, ChatInput, ChatMedia, ChatMessage, ChatMessageRef, ChatMessages, ChatMessagesIter, Horizon, JudgmentHint,
    KeyLimit, MediaKey, Prompt, RawJson, RouteRequest, MEDIA_PART_TOKENS,
};

// Decisions, scores and replication.
pub use decision::{
    judge, transfer_estimate, Decision, Judgment, JudgmentSource, Mode, Outcome, Rule, Shed, TransferEstimate,
    HEADER_DESTINATION, HEADER_MODE, HEADER_PREFILLER, HEADER_SCORE, HEADER_SHED_REASON,
};
pub use effect::{EffectDecodeError, RoutingEffect};
pub use score::{EndpointScore, FilterReason};

// Endpoints and their metrics.
pub use endpoints::{validate_endpoint_id, EndpointSpec, MetricsSnapshot, Role};
pub use metrics::{parse_prometheus, MetricsError};

// Policy configuration.
pub use config::{
    AdmissionConfig, FilterConfig, IndexConfig, IndexMode, KeyScheme, LimitsConfig, LoraAffinity, MetricsConfig,
    ModelShape, ModesConfig, NetworkConfig, PickerConfig, Policy, PolicyConfig, PreciseConfig, RequestConfig,
    ScoreWeights, ScoringConfig, TierWeights, TransferConfig, DEFAULT_ADMISSION_KV_THRESHOLD,
    DEFAULT_ADMISSION_QUEUE_THRESHOLD, DEFAULT_BLOCK_TOKENS, DEFAULT_BYPASS_PREFIX_HIT, DEFAULT_BYPASS_PROBABILITY,
    DEFAULT_BYTES_PER_TOKEN, DEFAULT_COLOCATED_INPUT_MAX_TOKENS, DEFAULT_COLOCATED_MAX_RISK, DEFAULT_DECODE_KV_CEILING,
    DEFAULT_INDEX_CAPACITY_BYTES, DEFAULT_LONG_OUTPUT_MIN_TOKENS, DEFAULT_MAX_BODY_BYTES, DEFAULT_METRICS_STALENESS_MS,
    DEFAULT_RISK_TOKEN_THRESHOLDS, DEFAULT_SHORT_OUTPUT_MAX_TOKENS, DEFAULT_SPECULATIVE_TTL_MS,
    DEFAULT_TIER_WEIGHT_CPU, DEFAULT_TIER_WEIGHT_GPU, DEFAULT_TIER_WEIGHT_STORAGE, MAX_ENDPOINTS_LIMIT,
    MAX_RESERVE_BLOCKS, NOMINAL_BYTES_PER_MEMBERSHIP,
};

// Flow control.
pub use flow::{
    Admission, AttainedServiceConfig, BandDefaults, BandStats, DropReason, FairnessFallback, FairnessPolicy,
    FlowControlConfig, FlowCounters, FlowReplica, FlowStats, OrderingPolicy, PriorityBandConfig, Rejection,
    RejectionCounts, Release, ReleaseOutcome, SaturationDetectorConfig, SaturationReport, SheddingConfig, Ticket,
    DEFAULT_BAND_MAX_BYTES, DEFAULT_FLOW_MAX_BYTES, DEFAULT_FLOW_MAX_REQUESTS, DEFAULT_KV_CACHE_UTIL_THRESHOLD,
    DEFAULT_METRICS_FAIRNESS_IDS, DEFAULT_NO_ENDPOINTS_TTL_MS, DEFAULT_OUTPUT_TOKEN_WEIGHT,
    DEFAULT_QUEUE_DEPTH_THRESHOLD, DEFAULT_REQUEST_TTL_MS, DEFAULT_SATURATION_CEILING, DEFAULT_SERVICE_HALF_LIFE_MS,
    DEFAULT_SHED_K, DEFAULT_SHED_POWER, DEFAULT_UNBOUNDED_OUTPUT_TOKENS, HEADER_DROPPED_REASON, LABEL_MIN_REQUESTS,
    MAX_FLOW_TTL_MS, MAX_PRIORITY_BANDS,
};

// Errors.
pub use error::{ConfigError, EventIngestError, RequestError, RouteError, StateError};

// The approximate pipeline and the prefix store both indexes use.
pub use approx::{ApproxHashing, BlockKey, RequestKeys};
pub use index::{
    ApproxIndex, Holding, IndexStats, MatchScratch, MatchWeights, PrefixIndex, PrefixMatch, SlotMatch, GENERATIONS,
    MAX_SLOTS,
};

// The precise pipeline: events, engine hashing, keys, the index, stream judgment.
pub use precise::engine_hash::{
    encode_cbor, encode_pickle, event_key, BlockDigest, BlockExtras, EngineHashError, EngineHashSpec, EngineHasher,
    ExtraKeysForm, ExtraValue, HashAlgo, LoraAdapter, NoneHashSeed, DEFAULT_BLOCK_SIZE, DEFAULT_NONE_HASH_SEED,
};
pub use precise::events::{
    decode_batch, BlockRemoved, BlockStored, EngineBlockHash, ErrorSite, EventBatch, EventError, KvEvent, Medium,
};
pub use precise::{
    batch_digest, ApplyOutcome, DualKeyHashing, KvIndex, PreciseKeys, PreciseStats, StreamInfo, StreamJudgment,
    StreamTracker, StreamVerdict, MAX_PUBLISHER_TS_S, RECENT_BATCHES,
};

// Feature `zmq`: the KV-event subscriber and its sinks.
#[cfg(feature = "zmq")]
pub use precise::zmq_sub::{
    Observer, ReplayFailure, SocketMode, SubscribeError, SubscriberConfig, SubscriberEvent, SubscriberStats,
    Subscription, DEFAULT_POLL_INTERVAL_MS, DEFAULT_REPLAY_TIMEOUT_MS, END_SEQ, MAX_POLL_INTERVAL_MS,
    MAX_REPLAY_TIMEOUT_MS,
};
#[cfg(feature = "zmq")]
pub use precise::{Batch, BatchOrigin, EventSink};

// Feature `tokenizer`: exact token ids.
#[cfg(feature = "tokenizer")]
pub use tokenize::{
    ChatOptions, ChatTemplate, PrefixCacheConfig, PrefixCacheStats, TokenizeError, Tokenizer,
    DEFAULT_MAX_SEGMENT_BYTES, DEFAULT_PREFIX_CACHE_BYTES, SEGMENT_OVERHEAD_BYTES,
};

// Feature `wall-clock` (implied by `zmq`): the system clock for the callers that need one.
#[cfg(feature = "wall-clock")]
pub use clock::{unix_clock, unix_time_ms, Clock};
