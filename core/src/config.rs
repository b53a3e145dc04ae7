//! Policy configuration: one serde type tree, read from JSON or YAML, validated on construction.
//!
//! [`PolicyConfig`] is the plain data tree (every field has a default, unknown fields are rejected);
//! [`Policy`] is the validated, immutable form the router runs on. An invalid `Policy` cannot exist:
//! [`Policy::new`], [`Policy::from_json`] and [`Policy::from_yaml`] are the only ways to make one.
//!
//! The same JSON document is accepted by every surface (Rust, Python, C, the Envoy filter).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// Default: prefix-hit ratio at or above which a request may bypass the prefill pool (decode-direct).
pub const DEFAULT_BYPASS_PREFIX_HIT: f64 = 0.90;
/// Default: decode endpoint KV-usage ceiling (0–1) for decode-direct; at or above it no bypass.
pub const DEFAULT_DECODE_KV_CEILING: f64 = 0.80;
/// Default: inputs strictly shorter than this (tokens) may take the colocated fast path.
pub const DEFAULT_COLOCATED_INPUT_MAX_TOKENS: u32 = 512;
/// Default: outputs of at most this many tokens count as a short generation horizon.
pub const DEFAULT_SHORT_OUTPUT_MAX_TOKENS: u32 = 200;
/// Default: outputs of at least this many tokens (or unbounded) count as a long horizon.
pub const DEFAULT_LONG_OUTPUT_MIN_TOKENS: u32 = 1024;
/// Default: a judgment's bypass probability must reach this for decode-direct.
pub const DEFAULT_BYPASS_PROBABILITY: f64 = 0.88;
/// Default: the highest risk (0–3) that still allows the colocated fast path.
pub const DEFAULT_COLOCATED_MAX_RISK: u8 = 1;
/// Default: new-token thresholds that raise the derived memory-pressure risk to 1, 2 and 3.
pub const DEFAULT_RISK_TOKEN_THRESHOLDS: [u32; 3] = [1024, 4096, 16384];
/// Default: lifetime of speculative index entries (precise index), milliseconds.
pub const DEFAULT_SPECULATIVE_TTL_MS: u64 = 2_000;
/// Default: tier weight of blocks resident in GPU memory.
pub const DEFAULT_TIER_WEIGHT_GPU: f64 = 1.0;
/// Default: tier weight of blocks offloaded to CPU memory.
pub const DEFAULT_TIER_WEIGHT_CPU: f64 = 0.8;
/// Default: tier weight of blocks offloaded to storage.
pub const DEFAULT_TIER_WEIGHT_STORAGE: f64 = 0.5;
/// Default: pseudo-tokens per approximate index block.
pub const DEFAULT_BLOCK_TOKENS: u32 = 64;
/// Default: prompt bytes per pseudo-token.
pub const DEFAULT_BYTES_PER_TOKEN: u32 = 4;
/// Default: approximate index byte budget per endpoint (256 KiB = 16,384 memberships ≈ 1M
/// tokens at 64 tokens per block — the prefix cache of a large engine; size it to yours).
pub const DEFAULT_INDEX_CAPACITY_BYTES: u64 = 256 << 10;
/// Nominal bytes one (block, endpoint) membership is charged against the byte budget.
pub const NOMINAL_BYTES_PER_MEMBERSHIP: u64 = 16;
/// Largest `index.reserve_blocks` / `index.precise.reserve_blocks`: the most blocks an index
/// holds (2^27 - 3).
pub const MAX_RESERVE_BLOCKS: u64 = crate::index::MAX_BLOCKS as u64;
/// Default: largest accepted request body.
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;
/// Default: metrics older than this are stale.
pub const DEFAULT_METRICS_STALENESS_MS: u64 = 1_000;
/// Default admission thresholds (as llm-d): waiting queue 5, KV usage 0.8.
pub const DEFAULT_ADMISSION_QUEUE_THRESHOLD: f64 = 5.0;
/// Default admission KV-usage threshold.
pub const DEFAULT_ADMISSION_KV_THRESHOLD: f64 = 0.80;
/// Hard upper bound on endpoints a router tracks (index slots are 12 bits).
pub const MAX_ENDPOINTS_LIMIT: usize = 4096;

/// The whole policy configuration tree. Every field has a default; unknown fields are rejected.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Approximate prefix index (block size, hashing seed, byte budget) and shared index settings.
    pub index: IndexConfig,
    /// Filters, scorer weights and picker.
    pub scoring: ScoringConfig,
    /// Endpoint metric freshness.
    pub metrics: MetricsConfig,
    /// Admission control (saturation and shedding).
    pub admission: AdmissionConfig,
    /// Mode decision thresholds and the derivation rubric.
    pub modes: ModesConfig,
    /// Transfer-tax break-even model for disaggregation.
    pub transfer: TransferConfig,
    /// Request parsing (body limit, header names, LoRA mapping).
    pub request: RequestConfig,
    /// Bounds on router-held state.
    pub limits: LimitsConfig,
    /// Flow control: priority bands, per-tenant fairness, queueing with deadlines (off by
    /// default).
    pub flow_control: crate::flow::FlowControlConfig,
}

/// Index configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IndexConfig {
    /// Pseudo-tokens per block of the approximate index.
    pub block_tokens: u32,
    /// Prompt bytes per pseudo-token (text prompts). Token-id prompts use one id per token.
    pub bytes_per_token: u32,
    /// Seed mixed into every block-key chain (with the model name and cache_salt).
    pub hash_seed: u64,
    /// Approximate index budget per endpoint, in bytes; charged
    /// [`NOMINAL_BYTES_PER_MEMBERSHIP`] per (block, endpoint) membership.
    pub capacity_bytes_per_endpoint: u64,
    /// Distinct blocks the approximate index keeps room for from the start (0, the default:
    /// none; see [`PrefixIndex::reserve`](crate::PrefixIndex::reserve)). Growing to that size,
    /// the index then never rebuilds its table, a pause of every write to it (up to about 37 ms
    /// at 2.8M blocks on a 2-core machine) that moves every block. About 16.6 bytes per block are
    /// held from the start and counted in its memory. At most [`MAX_RESERVE_BLOCKS`].
    pub reserve_blocks: u64,
    /// Lifetime of speculative entries in the event-fed precise index, milliseconds. Routing
    /// the same blocks to the same endpoint again extends it once a quarter of it has passed
    /// (not on every request), so entries last between 3/4 of it and all of it after their
    /// latest routing.
    pub speculative_ttl_ms: u64,
    /// Weights of cache tiers when scoring matched blocks (approximate entries count as GPU).
    pub tier_weights: TierWeights,
    /// Which index routing reads: `approx`, `precise` or `hybrid`.
    pub mode: IndexMode,
    /// The event-fed precise index.
    pub precise: PreciseConfig,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            block_tokens: DEFAULT_BLOCK_TOKENS,
            bytes_per_token: DEFAULT_BYTES_PER_TOKEN,
            hash_seed: 0,
            capacity_bytes_per_endpoint: DEFAULT_INDEX_CAPACITY_BYTES,
            reserve_blocks: 0,
            speculative_ttl_ms: DEFAULT_SPECULATIVE_TTL_MS,
            tier_weights: TierWeights::default(),
            mode: IndexMode::Approx,
            precise: PreciseConfig::default(),
        }
    }
}

/// Which prefix index routing reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexMode {
    /// The tokenizer-free approximate index only (what the router sent where).
    #[default]
    Approx,
    /// The event-fed precise index only (requests need token ids; endpoints without a healthy
    /// event stream show no cached prefix).
    Precise,
    /// Precise for endpoints whose event stream is healthy, approximate for the others (stream
    /// missing, gapped beyond replay, or recovering) and for requests without token ids.
    Hybrid,
}

/// How precise-index keys relate to the engine's block hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyScheme {
    /// The router's own request keys (an xxh3-64 chain over `index_block_tokens` token ids,
    /// rooted in the LoRA name and cache_salt) plus an engine-key → request-key map learned from
    /// BlockStored events. Works whatever hash the engine uses.
    #[default]
    Dual,
    /// The engine's own block hashes, reproduced exactly from token ids (vLLM's `sha256`,
    /// `sha256_cbor`, `xxhash`, `xxhash_cbor`; see `index.precise.engine`). No map is needed, and
    /// blocks stored before the router started are found too.
    Engine,
}

/// The event-fed precise index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PreciseConfig {
    /// Key scheme.
    pub keys: KeyScheme,
    /// The engines' hashing, for `keys = "engine"` (its `block_size` is ignored:
    /// `engine_block_tokens` applies).
    pub engine: crate::precise::engine_hash::EngineHashSpec,
    /// LoRA adapter name → the path the engines loaded it from (`keys = "engine"` with vLLM ≥
    /// 0.31 hashes the path); requests for an adapter without a path here get no precise keys.
    pub lora_paths: BTreeMap<String, String>,
    /// Tokens per engine block (vLLM `--block-size`, default 16).
    pub engine_block_tokens: u32,
    /// Tokens per index block for dual keys; `engine_block_tokens` must be a multiple of it.
    pub index_block_tokens: u32,
    /// Budget per endpoint, bytes, charged [`NOMINAL_BYTES_PER_MEMBERSHIP`] per membership
    /// (protects memory if removal events are lost; engines normally report their evictions).
    pub capacity_bytes_per_endpoint: u64,
    /// Distinct blocks the precise index keeps room for from the start, in each copy (0, the
    /// default: none); as `index.reserve_blocks` for the approximate index.
    pub reserve_blocks: u64,
    /// Dual keys: engine blocks remembered per endpoint in its engine-key → request-key map (each
    /// endpoint's publisher has its own map, so one publisher's blocks never evict another's).
    /// About 25–50 heap bytes per block, reported in the precise index's memory. The default
    /// names as many engine blocks as the default `capacity_bytes_per_endpoint` holds index
    /// blocks (262,144 memberships).
    pub key_map_capacity: usize,
    /// After an unrecoverable gap, how long an endpoint is treated as stale (hybrid mode routes
    /// it with the approximate index meanwhile), milliseconds.
    pub stale_recovery_ms: u64,
    /// Under a [`Router`](crate::Router) (shared by threads), keep the index in two copies:
    /// lookups read one while events, speculation and expiry are written into the other, so
    /// that applying events never holds up a lookup, at twice the index's memory (each copy
    /// within `capacity_bytes_per_endpoint`) and each write made twice. `false`: one copy,
    /// written under the router's exclusive lock. A `RouterCore` on its own always keeps one.
    /// Changes take effect at the reload, without losing the index.
    pub two_copies: bool,
}

impl PreciseConfig {
    /// The engine hasher this section describes (with `engine_block_tokens` as block size).
    pub fn engine_hasher(
        &self,
    ) -> Result<crate::precise::engine_hash::EngineHasher, crate::precise::engine_hash::EngineHashError> {
        let mut spec = self.engine.clone();
        spec.block_size = self.engine_block_tokens;
        crate::precise::engine_hash::EngineHasher::from_spec(&spec)
    }
}

impl Default for PreciseConfig {
    fn default() -> Self {
        PreciseConfig {
            keys: KeyScheme::Dual,
            engine: crate::precise::engine_hash::EngineHashSpec::default(),
            lora_paths: BTreeMap::new(),
            engine_block_tokens: 16,
            index_block_tokens: 16,
            capacity_bytes_per_endpoint: 4 << 20,
            reserve_blocks: 0,
            key_map_capacity: 262_144,
            stale_recovery_ms: 30_000,
            two_copies: true,
        }
    }
}

/// Per-tier weights of a matched block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierWeights {
    /// GPU memory.
    pub gpu: f64,
    /// CPU memory (offloaded).
    pub cpu: f64,
    /// Storage (offloaded).
    pub storage: f64,
}

impl Default for TierWeights {
    fn default() -> Self {
        TierWeights { gpu: DEFAULT_TIER_WEIGHT_GPU, cpu: DEFAULT_TIER_WEIGHT_CPU, storage: DEFAULT_TIER_WEIGHT_STORAGE }
    }
}

/// Scoring: filters, weighted scorers and the picker.
///
/// `S = w.prefix·H − w.queue·Q̃ − w.kv_usage·U + w.lora·I_lora + w.session·I_session − w.inflight·F̃`
/// with `Q̃ = waiting / queue_reference` and `F̃ = inflight / inflight_reference` (not clamped, so
/// an overloaded cached endpoint keeps losing ground as its queue grows: with weights `w.prefix`
/// and `w.queue`, an endpoint with prefix hit `h` loses to an idle one with no hit once its queue
/// exceeds `h · queue_reference · w.prefix / w.queue`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringConfig {
    /// Scorer weights.
    pub weights: ScoreWeights,
    /// Waiting-queue depth that counts as Q̃ = 1.
    pub queue_reference: f64,
    /// Router-side in-flight requests that count as F̃ = 1.
    pub inflight_reference: f64,
    /// LoRA affinity values.
    pub lora_affinity: LoraAffinity,
    /// Filters applied before scoring.
    pub filters: FilterConfig,
    /// How the endpoint is picked from the scores.
    pub picker: PickerConfig,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        ScoringConfig {
            weights: ScoreWeights::default(),
            queue_reference: 8.0,
            inflight_reference: 16.0,
            lora_affinity: LoraAffinity::default(),
            filters: FilterConfig::default(),
            picker: PickerConfig::default(),
        }
    }
}

/// Scorer weights (all ≥ 0; 0 disables a scorer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoreWeights {
    /// Prefix-hit ratio H (0–1).
    pub prefix: f64,
    /// LoRA affinity (0–1).
    pub lora: f64,
    /// Normalized waiting queue Q̃ (penalty).
    pub queue: f64,
    /// KV-cache usage U (0–1, penalty).
    pub kv_usage: f64,
    /// Session affinity (1 for the endpoint the session last went to).
    pub session: f64,
    /// Normalized router-side in-flight count F̃ (penalty).
    pub inflight: f64,
}

impl Default for ScoreWeights {
    fn default() -> Self {
        ScoreWeights { prefix: 1.0, lora: 0.3, queue: 1.0, kv_usage: 0.5, session: 0.2, inflight: 0.5 }
    }
}

/// LoRA affinity values (llm-d's convention).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraAffinity {
    /// The adapter is running on the endpoint.
    pub running: f64,
    /// The adapter is not loaded but the endpoint has room for another adapter.
    pub room: f64,
    /// The adapter is waiting to be loaded on the endpoint.
    pub waiting: f64,
}

impl Default for LoraAffinity {
    fn default() -> Self {
        LoraAffinity { running: 1.0, room: 0.8, waiting: 0.6 }
    }
}

/// Candidate filters. A filter that would leave a pool empty is relaxed for that decision (the
/// decision records it), except the health filter, which is never relaxed.
///
/// The overload limits are deliberately looser than the score's trade-off (with default weights
/// a full prefix hit is worth 8 waiting requests): the score moves traffic off a busy cached
/// endpoint gradually; the filter only removes endpoints that are plainly overloaded, so a
/// session is not thrown off the endpoint holding its context at the first sign of load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterConfig {
    /// Drop endpoints whose metrics are stale (older than `metrics.staleness_ms`) or missing.
    pub exclude_stale: bool,
    /// Drop endpoints whose fresh metrics show at least this many waiting requests (`null`: off).
    pub max_waiting: Option<f64>,
    /// Drop endpoints whose fresh metrics show at least this KV usage (`null`, the default: off).
    /// Off by default because an engine short of KV memory queues new requests, which the
    /// waiting-queue signal already captures, while excluding it on KV usage alone throws
    /// sessions off the endpoint holding their context (measured with `kvroute-sim --rate 5`:
    /// TTFT p90 1012 ms with a 0.95 limit vs 89 ms without).
    pub max_kv_usage: Option<f64>,
}

impl Default for FilterConfig {
    fn default() -> Self {
        FilterConfig { exclude_stale: true, max_waiting: Some(16.0), max_kv_usage: None }
    }
}

/// The picker.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PickerConfig {
    #[default]
    /// Highest score; ties (within 1e-9) go to the endpoint the router least recently sent a
    /// request to (never counts as least; its own decisions and the routing effects it applied,
    /// so instances sharing effects agree), then to the highest rendezvous hash of (request
    /// anchor, endpoint id). Cold prefixes arriving on an idle fleet therefore visit every
    /// endpoint in turn instead of falling where a hash sends them.
    MaxScore,
    /// Softmax over scores with `temperature`, drawn from a generator seeded with `seed` and
    /// advanced once per decision (deterministic for a given call sequence).
    WeightedRandom {
        /// Generator seed.
        seed: u64,
        /// Softmax temperature (> 0); lower is greedier.
        temperature: f64,
    },
}

/// Metric freshness.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Metrics older than this (relative to the decision's `now`) are stale.
    pub staleness_ms: u64,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig { staleness_ms: DEFAULT_METRICS_STALENESS_MS }
    }
}

/// Admission control (with flow control off; with `flow_control.enabled`, flow control's own
/// detector and shedding apply instead and routing sheds nothing).
///
/// Pool saturation = mean over healthy decode-capable endpoints of
/// `max(waiting / queue_threshold, kv_usage / kv_threshold)`, an endpoint with stale or missing
/// metrics counting as 1.0. The pool is saturated at ≥ 1.0. When saturated, requests with
/// negative priority (sheddable) are shed with a 429-class decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Waiting-queue depth at which an endpoint is saturated.
    pub queue_threshold: f64,
    /// KV usage at which an endpoint is saturated.
    pub kv_threshold: f64,
    /// Shed negative-priority requests when the pool is saturated.
    pub shed_sheddable: bool,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            queue_threshold: DEFAULT_ADMISSION_QUEUE_THRESHOLD,
            kv_threshold: DEFAULT_ADMISSION_KV_THRESHOLD,
            shed_sheddable: true,
        }
    }
}

/// Mode decision thresholds and the rubric that derives a judgment when no hint is given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModesConfig {
    /// Decode-direct: the best decode endpoint's prefix hit must be at least this.
    pub bypass_prefix_hit: f64,
    /// Decode-direct: the best decode endpoint's KV usage must be below this.
    pub decode_kv_ceiling: f64,
    /// Decode-direct: a judgment hint's bypass probability, when given, must be at least this.
    pub bypass_probability: f64,
    /// Colocated fast path: input must be shorter than this many tokens.
    pub colocated_input_max_tokens: u32,
    /// Outputs up to this many tokens are a short horizon.
    pub short_output_max_tokens: u32,
    /// Outputs of at least this many tokens, or unbounded, are a long horizon.
    pub long_output_min_tokens: u32,
    /// Colocated fast path: risk must be at most this.
    pub colocated_max_risk: u8,
    /// New tokens (uncached input + output) at which derived risk reaches 1, 2, 3.
    pub risk_token_thresholds: [u32; 3],
    /// Allow disaggregated serving when a prefill pool exists.
    pub disaggregation: bool,
}

impl Default for ModesConfig {
    fn default() -> Self {
        ModesConfig {
            bypass_prefix_hit: DEFAULT_BYPASS_PREFIX_HIT,
            decode_kv_ceiling: DEFAULT_DECODE_KV_CEILING,
            bypass_probability: DEFAULT_BYPASS_PROBABILITY,
            colocated_input_max_tokens: DEFAULT_COLOCATED_INPUT_MAX_TOKENS,
            short_output_max_tokens: DEFAULT_SHORT_OUTPUT_MAX_TOKENS,
            long_output_min_tokens: DEFAULT_LONG_OUTPUT_MIN_TOKENS,
            colocated_max_risk: DEFAULT_COLOCATED_MAX_RISK,
            risk_token_thresholds: DEFAULT_RISK_TOKEN_THRESHOLDS,
            disaggregation: true,
        }
    }
}

/// Transfer-tax model: does shipping the KV cache from a prefill worker pay for itself?
///
/// `V_KV = 2·L·H_kv·d_h·b·S` bytes for the `S` prompt tokens the decode endpoint lacks;
/// `T_transfer = V_KV / B_net + L_setup` (layer-wise streaming: only the last layer is exposed,
/// `V_KV / L / B_net + L_setup`). Disaggregation pays when
/// `t_prefill(P) + T_transfer < t_prefill(D) · (1 + interference_factor · running(D))`, i.e. when
/// the transfer costs less than the stall a colocated prefill would impose on the decode
/// endpoint's running requests. `t_prefill(X) = uncached tokens on X / prefill_tokens_per_s`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransferConfig {
    /// Model shape.
    pub model: ModelShape,
    /// Network between prefill and decode workers.
    pub network: NetworkConfig,
    /// Layer-wise streaming (only the last layer's transfer is exposed).
    pub layerwise_streaming: bool,
    /// Prefill throughput of one worker, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Stall cost per running decode request per second of colocated prefill.
    pub interference_factor: f64,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            model: ModelShape::default(),
            network: NetworkConfig::default(),
            layerwise_streaming: false,
            prefill_tokens_per_s: 8_000.0,
            interference_factor: 1.0,
        }
    }
}

/// Model shape for the KV volume (defaults: a Llama-3-8B-like model in bf16).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelShape {
    /// Transformer layers L.
    pub layers: u32,
    /// KV heads H_kv.
    pub kv_heads: u32,
    /// Head dimension d_h.
    pub head_dim: u32,
    /// Bytes per element b.
    pub bytes_per_element: u32,
}

impl Default for ModelShape {
    fn default() -> Self {
        ModelShape { layers: 32, kv_heads: 8, head_dim: 128, bytes_per_element: 2 }
    }
}

impl ModelShape {
    /// KV bytes per token: `2·L·H_kv·d_h·b`.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.bytes_per_element)
    }
}

/// Network between prefill and decode workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkConfig {
    /// Bandwidth B_net in gigabits per second.
    pub bandwidth_gbps: f64,
    /// Per-transfer setup latency L_setup in microseconds.
    pub setup_latency_us: f64,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig { bandwidth_gbps: 100.0, setup_latency_us: 500.0 }
    }
}

/// Request parsing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RequestConfig {
    /// Largest accepted body.
    pub max_body_bytes: usize,
    /// Header carrying the request id used by `complete` (generated when absent).
    pub request_id_header: String,
    /// Header carrying the session id (session affinity).
    pub session_header: String,
    /// Header carrying the fairness id (the tenant flow control keeps fair; llm-d's
    /// `x-llm-d-inference-fairness-id`).
    pub fairness_header: String,
    /// A second header read for the fairness id when `fairness_header` is absent (llm-d's older
    /// `x-gateway-inference-fairness-id`).
    pub fairness_alias_header: String,
    /// Header carrying the integer priority (negative = sheddable).
    pub priority_header: String,
    /// Header naming the request's inference objective (llm-d's `x-llm-d-inference-objective`),
    /// mapped to a priority through `objectives`.
    pub objective_header: String,
    /// Inference objective name → priority (llm-d's `InferenceObjective` `spec.priority`). A
    /// request naming a listed objective gets its priority; when it also carries
    /// `priority_header`, the higher of the two wins. An objective not listed here gives no
    /// priority (the priority header's, else 0).
    pub objectives: BTreeMap<String, i32>,
    /// Header carrying the request's time-to-first-token objective in milliseconds (the SLO
    /// deadline ordering of flow control: enqueue time + this).
    pub slo_ttft_header: String,
    /// A second header read for the TTFT objective when `slo_ttft_header` is absent.
    pub slo_ttft_alias_header: String,
    /// Header carrying the request's own queue TTL, a Go duration such as `1500ms` or `2s`
    /// (llm-d's `x-llm-d-inference-ttl`); it replaces the band's default TTL for that request.
    pub queue_ttl_header: String,
    /// Judgment hint: generation horizon `short|medium|long`.
    pub horizon_header: String,
    /// Judgment hint: memory-pressure risk `0..=3`.
    pub risk_header: String,
    /// Judgment hint: bypass probability `0..=1`.
    pub bypass_probability_header: String,
    /// Requested model name → LoRA adapter name. Models not listed use the base model.
    pub lora_adapters: BTreeMap<String, String>,
    /// Add an `x-kvroute-score: rule;score;hit` header to routed requests (debugging).
    pub debug_header: bool,
    /// A request whose `content-type` is this media type (parameters after `;` ignored, case
    /// ignored) has a binary body: the prompt's token ids as little-endian `u32`s, nothing else;
    /// it is a completions request whose model is in `model_header`. A gateway that already
    /// holds the token ids sets it, and the router skips JSON. Empty: binary bodies are off.
    pub token_ids_content_type: String,
    /// Header carrying the model of a binary token-id body (required there, ignored otherwise).
    pub model_header: String,
    /// Header carrying the output-token budget of a binary token-id body (optional).
    pub max_tokens_header: String,
}

impl Default for RequestConfig {
    fn default() -> Self {
        RequestConfig {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            request_id_header: "x-request-id".into(),
            session_header: "x-session-id".into(),
            fairness_header: "x-llm-d-inference-fairness-id".into(),
            fairness_alias_header: "x-gateway-inference-fairness-id".into(),
            priority_header: "x-kvroute-priority".into(),
            objective_header: "x-llm-d-inference-objective".into(),
            objectives: BTreeMap::new(),
            slo_ttft_header: "x-llm-d-slo-ttft-ms".into(),
            slo_ttft_alias_header: "x-slo-ttft-ms".into(),
            queue_ttl_header: "x-llm-d-inference-ttl".into(),
            horizon_header: "x-kvroute-horizon".into(),
            risk_header: "x-kvroute-risk".into(),
            bypass_probability_header: "x-kvroute-bypass-probability".into(),
            lora_adapters: BTreeMap::new(),
            debug_header: false,
            token_ids_content_type: "application/vnd.kvroute.token-ids".into(),
            model_header: "x-kvroute-model".into(),
            max_tokens_header: "x-kvroute-max-tokens".into(),
        }
    }
}

/// Bounds on state the router keeps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Maximum number of endpoints (≤ 4096).
    pub max_endpoints: usize,
    /// Sessions remembered for affinity (LRU).
    pub session_capacity: usize,
    /// Requests tracked in flight; the oldest is dropped (and its counters released) beyond this.
    pub max_inflight_requests: usize,
    /// A request not completed within this time is dropped from in-flight tracking.
    pub inflight_timeout_ms: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_endpoints: 1024,
            session_capacity: 100_000,
            max_inflight_requests: 1_000_000,
            inflight_timeout_ms: 600_000,
        }
    }
}

/// A validated, immutable policy. See the module docs.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
#[serde(transparent)]
pub struct Policy {
    config: PolicyConfig,
}

impl Policy {
    /// Validate a configuration tree.
    pub fn new(config: PolicyConfig) -> Result<Policy, ConfigError> {
        validate(&config)?;
        Ok(Policy { config })
    }

    /// Parse and validate a JSON document.
    pub fn from_json(text: &str) -> Result<Policy, ConfigError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| ConfigError::Parse {
            format: "json",
            path: ".".into(),
            message: e.to_string(),
        })?;
        Policy::from_value("json", value)
    }

    /// Parse and validate a YAML document (an empty document is the default policy).
    pub fn from_yaml(text: &str) -> Result<Policy, ConfigError> {
        let value: serde_json::Value = serde_yaml_ng::from_str(text).map_err(|e| ConfigError::Parse {
            format: "yaml",
            path: ".".into(),
            message: e.to_string(),
        })?;
        let value = if value.is_null() { serde_json::Value::Object(Default::default()) } else { value };
        Policy::from_value("yaml", value)
    }

    fn from_value(format: &'static str, value: serde_json::Value) -> Result<Policy, ConfigError> {
        // serde's derived structs also accept arrays of field values; a policy section is always
        // a mapping, so check the document's shape against the defaults first.
        let shape = serde_json::to_value(PolicyConfig::default()).unwrap_or_default();
        check_shape(format, &shape, &value, &mut String::new())?;
        let config: PolicyConfig = serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            ConfigError::Parse { format, path, message: e.inner().to_string() }
        })?;
        Policy::new(config)
    }

    /// Parse JSON when the text starts with `{` (after whitespace), YAML otherwise.
    pub fn from_str_auto(text: &str) -> Result<Policy, ConfigError> {
        if text.trim_start().starts_with('{') {
            Policy::from_json(text)
        } else {
            Policy::from_yaml(text)
        }
    }

    /// The validated tree.
    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    /// The normalized policy as pretty JSON (every default spelled out).
    pub fn to_json_pretty(&self) -> String {
        // Serializing plain data with finite floats cannot fail.
        serde_json::to_string_pretty(&self.config).unwrap_or_default()
    }

    /// Fingerprint of the parameters that define approximate block keys. Index entries made under
    /// one fingerprint are meaningless under another (see `Router::reload`).
    pub fn index_fingerprint(&self) -> u64 {
        let i = &self.config.index;
        let mut buf = [0u8; 16];
        buf[..4].copy_from_slice(&i.block_tokens.to_le_bytes());
        buf[4..8].copy_from_slice(&i.bytes_per_token.to_le_bytes());
        buf[8..].copy_from_slice(&i.hash_seed.to_le_bytes());
        xxhash_rust::xxh3::xxh3_64(&buf)
    }

    /// Block size of the approximate index in prompt bytes.
    pub fn block_bytes(&self) -> usize {
        self.config.index.block_tokens as usize * self.config.index.bytes_per_token as usize
    }

    /// Per-endpoint membership capacity of the precise index.
    pub fn precise_capacity_memberships(&self) -> u32 {
        let m = self.config.index.precise.capacity_bytes_per_endpoint / NOMINAL_BYTES_PER_MEMBERSHIP;
        u32::try_from(m).unwrap_or(u32::MAX)
    }

    /// Fingerprint of the parameters that define precise-index keys.
    pub fn precise_fingerprint(&self) -> u64 {
        let p = &self.config.index.precise;
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&p.engine_block_tokens.to_le_bytes());
        buf.extend_from_slice(&p.index_block_tokens.to_le_bytes());
        buf.push(p.keys as u8);
        if p.keys == KeyScheme::Engine {
            // Everything that changes the engine's hashes (LoRA paths too).
            buf.extend_from_slice(serde_json::to_string(&(&p.engine, &p.lora_paths)).unwrap_or_default().as_bytes());
        }
        xxhash_rust::xxh3::xxh3_64(&buf)
    }

    /// Per-endpoint membership capacity of the approximate index.
    pub fn index_capacity_memberships(&self) -> u32 {
        let m = self.config.index.capacity_bytes_per_endpoint / NOMINAL_BYTES_PER_MEMBERSHIP;
        u32::try_from(m).unwrap_or(u32::MAX)
    }
}

fn check_shape(
    format: &'static str,
    shape: &serde_json::Value,
    value: &serde_json::Value,
    path: &mut String,
) -> Result<(), ConfigError> {
    let (serde_json::Value::Object(shape), Some(kind)) = (shape, value_kind(value)) else { return Ok(()) };
    let serde_json::Value::Object(map) = value else {
        return Err(ConfigError::Parse {
            format,
            path: if path.is_empty() { ".".into() } else { path.clone() },
            message: format!("invalid type: {kind}, expected a mapping"),
        });
    };
    for (k, v) in map {
        if let Some(s) = shape.get(k) {
            let len = path.len();
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(k);
            check_shape(format, s, v, path)?;
            path.truncate(len);
        }
    }
    Ok(())
}

fn value_kind(v: &serde_json::Value) -> Option<&'static str> {
    match v {
        serde_json::Value::Object(_) => Some("mapping"),
        serde_json::Value::Array(_) => Some("sequence"),
        serde_json::Value::String(_) => Some("string"),
        serde_json::Value::Number(_) => Some("number"),
        serde_json::Value::Bool(_) => Some("boolean"),
        serde_json::Value::Null => Some("null"),
    }
}

fn check_unit(field: &str, v: f64) -> Result<(), ConfigError> {
    if !(0.0..=1.0).contains(&v) {
        return Err(ConfigError::invalid(field, v, "must be within [0, 1]"));
    }
    Ok(())
}

fn check_nonneg(field: &str, v: f64) -> Result<(), ConfigError> {
    if !v.is_finite() || v < 0.0 {
        return Err(ConfigError::invalid(field, v, "must be a finite number ≥ 0"));
    }
    Ok(())
}

fn check_pos(field: &str, v: f64) -> Result<(), ConfigError> {
    if !v.is_finite() || v <= 0.0 {
        return Err(ConfigError::invalid(field, v, "must be a finite number > 0"));
    }
    Ok(())
}

fn check_header(field: &str, v: &str) -> Result<(), ConfigError> {
    let ok = !v.is_empty() && v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if !ok {
        return Err(ConfigError::invalid(field, format!("{v:?}"), "must be a non-empty lower-case header name"));
    }
    Ok(())
}

fn validate(c: &PolicyConfig) -> Result<(), ConfigError> {
    let i = &c.index;
    if !(1..=4096).contains(&i.block_tokens) {
        return Err(ConfigError::invalid("index.block_tokens", i.block_tokens, "must be within 1..=4096"));
    }
    if !(1..=64).contains(&i.bytes_per_token) {
        return Err(ConfigError::invalid("index.bytes_per_token", i.bytes_per_token, "must be within 1..=64"));
    }
    let min_cap = NOMINAL_BYTES_PER_MEMBERSHIP * 64;
    if i.capacity_bytes_per_endpoint < min_cap {
        return Err(ConfigError::invalid(
            "index.capacity_bytes_per_endpoint",
            i.capacity_bytes_per_endpoint,
            format!("must be at least {min_cap} (64 memberships)"),
        ));
    }
    if i.capacity_bytes_per_endpoint > NOMINAL_BYTES_PER_MEMBERSHIP * u64::from(u32::MAX) {
        return Err(ConfigError::invalid(
            "index.capacity_bytes_per_endpoint",
            i.capacity_bytes_per_endpoint,
            "too large",
        ));
    }
    for (field, n) in
        [("index.reserve_blocks", i.reserve_blocks), ("index.precise.reserve_blocks", i.precise.reserve_blocks)]
    {
        if n > MAX_RESERVE_BLOCKS {
            return Err(ConfigError::invalid(field, n, format!("must be at most {MAX_RESERVE_BLOCKS}")));
        }
    }
    if !(1..=60_000).contains(&i.speculative_ttl_ms) {
        return Err(ConfigError::invalid("index.speculative_ttl_ms", i.speculative_ttl_ms, "must be within 1..=60000"));
    }
    let p = &i.precise;
    if !(1..=4096).contains(&p.engine_block_tokens) {
        return Err(ConfigError::invalid(
            "index.precise.engine_block_tokens",
            p.engine_block_tokens,
            "must be within 1..=4096",
        ));
    }
    if p.index_block_tokens == 0 || p.engine_block_tokens % p.index_block_tokens != 0 {
        return Err(ConfigError::invalid(
            "index.precise.index_block_tokens",
            p.index_block_tokens,
            format!("must divide index.precise.engine_block_tokens ({})", p.engine_block_tokens),
        ));
    }
    if p.capacity_bytes_per_endpoint < min_cap
        || p.capacity_bytes_per_endpoint > NOMINAL_BYTES_PER_MEMBERSHIP * u64::from(u32::MAX)
    {
        return Err(ConfigError::invalid(
            "index.precise.capacity_bytes_per_endpoint",
            p.capacity_bytes_per_endpoint,
            format!("must be within {min_cap}..={}", NOMINAL_BYTES_PER_MEMBERSHIP * u64::from(u32::MAX)),
        ));
    }
    if p.keys == KeyScheme::Engine {
        if let Err(e) = p.engine_hasher() {
            return Err(ConfigError::invalid("index.precise.engine", format!("{:?}", p.engine), e.to_string()));
        }
    }
    if p.key_map_capacity < 1024 {
        return Err(ConfigError::invalid(
            "index.precise.key_map_capacity",
            p.key_map_capacity,
            "must be at least 1024",
        ));
    }
    if p.stale_recovery_ms == 0 {
        return Err(ConfigError::invalid("index.precise.stale_recovery_ms", 0, "must be > 0"));
    }
    check_unit("index.tier_weights.gpu", i.tier_weights.gpu)?;
    check_unit("index.tier_weights.cpu", i.tier_weights.cpu)?;
    check_unit("index.tier_weights.storage", i.tier_weights.storage)?;

    let s = &c.scoring;
    check_nonneg("scoring.weights.prefix", s.weights.prefix)?;
    check_nonneg("scoring.weights.lora", s.weights.lora)?;
    check_nonneg("scoring.weights.queue", s.weights.queue)?;
    check_nonneg("scoring.weights.kv_usage", s.weights.kv_usage)?;
    check_nonneg("scoring.weights.session", s.weights.session)?;
    check_nonneg("scoring.weights.inflight", s.weights.inflight)?;
    check_pos("scoring.queue_reference", s.queue_reference)?;
    check_pos("scoring.inflight_reference", s.inflight_reference)?;
    check_unit("scoring.lora_affinity.running", s.lora_affinity.running)?;
    check_unit("scoring.lora_affinity.room", s.lora_affinity.room)?;
    check_unit("scoring.lora_affinity.waiting", s.lora_affinity.waiting)?;
    if let Some(w) = s.filters.max_waiting {
        check_pos("scoring.filters.max_waiting", w)?;
    }
    if let Some(k) = s.filters.max_kv_usage {
        check_pos("scoring.filters.max_kv_usage", k)?;
        check_unit("scoring.filters.max_kv_usage", k)?;
    }
    if let PickerConfig::WeightedRandom { temperature, .. } = s.picker {
        check_pos("scoring.picker.temperature", temperature)?;
    }

    if c.metrics.staleness_ms == 0 {
        return Err(ConfigError::invalid("metrics.staleness_ms", 0, "must be > 0"));
    }

    check_pos("admission.queue_threshold", c.admission.queue_threshold)?;
    check_pos("admission.kv_threshold", c.admission.kv_threshold)?;
    if c.admission.kv_threshold > 1.0 {
        return Err(ConfigError::invalid("admission.kv_threshold", c.admission.kv_threshold, "must be within (0, 1]"));
    }

    let m = &c.modes;
    check_unit("modes.bypass_prefix_hit", m.bypass_prefix_hit)?;
    check_unit("modes.decode_kv_ceiling", m.decode_kv_ceiling)?;
    check_unit("modes.bypass_probability", m.bypass_probability)?;
    if m.long_output_min_tokens <= m.short_output_max_tokens {
        return Err(ConfigError::invalid(
            "modes.long_output_min_tokens",
            m.long_output_min_tokens,
            format!("must be greater than modes.short_output_max_tokens ({})", m.short_output_max_tokens),
        ));
    }
    if m.colocated_max_risk > 3 {
        return Err(ConfigError::invalid("modes.colocated_max_risk", m.colocated_max_risk, "must be within 0..=3"));
    }
    let t = m.risk_token_thresholds;
    if !(t[0] < t[1] && t[1] < t[2]) {
        return Err(ConfigError::invalid(
            "modes.risk_token_thresholds",
            format!("{t:?}"),
            "must be strictly increasing",
        ));
    }

    let x = &c.transfer;
    if x.model.layers == 0 || x.model.kv_heads == 0 || x.model.head_dim == 0 || x.model.bytes_per_element == 0 {
        return Err(ConfigError::invalid("transfer.model", format!("{:?}", x.model), "every dimension must be > 0"));
    }
    check_pos("transfer.network.bandwidth_gbps", x.network.bandwidth_gbps)?;
    check_nonneg("transfer.network.setup_latency_us", x.network.setup_latency_us)?;
    check_pos("transfer.prefill_tokens_per_s", x.prefill_tokens_per_s)?;
    check_nonneg("transfer.interference_factor", x.interference_factor)?;

    let r = &c.request;
    if r.max_body_bytes == 0 {
        return Err(ConfigError::invalid("request.max_body_bytes", 0, "must be > 0"));
    }
    check_header("request.request_id_header", &r.request_id_header)?;
    check_header("request.session_header", &r.session_header)?;
    check_header("request.fairness_header", &r.fairness_header)?;
    check_header("request.fairness_alias_header", &r.fairness_alias_header)?;
    check_header("request.priority_header", &r.priority_header)?;
    check_header("request.objective_header", &r.objective_header)?;
    check_header("request.slo_ttft_header", &r.slo_ttft_header)?;
    check_header("request.slo_ttft_alias_header", &r.slo_ttft_alias_header)?;
    check_header("request.queue_ttl_header", &r.queue_ttl_header)?;
    check_header("request.model_header", &r.model_header)?;
    check_header("request.max_tokens_header", &r.max_tokens_header)?;
    let t = &r.token_ids_content_type;
    if !t.is_empty()
        && (t.contains(';') || !t.contains('/') || t.bytes().any(|b| b.is_ascii_whitespace() || !b.is_ascii_graphic()))
    {
        return Err(ConfigError::invalid(
            "request.token_ids_content_type",
            format!("{t:?}"),
            "must be a media type such as application/vnd.kvroute.token-ids (no parameters), or empty",
        ));
    }
    for name in r.objectives.keys() {
        if name.is_empty() {
            return Err(ConfigError::invalid("request.objectives", "\"\"", "objective names must be non-empty"));
        }
    }
    check_header("request.horizon_header", &r.horizon_header)?;
    check_header("request.risk_header", &r.risk_header)?;
    check_header("request.bypass_probability_header", &r.bypass_probability_header)?;
    for (model, adapter) in &r.lora_adapters {
        if model.is_empty() || adapter.is_empty() {
            return Err(ConfigError::invalid(
                &format!("request.lora_adapters.{model}"),
                format!("{adapter:?}"),
                "model and adapter names must be non-empty",
            ));
        }
    }

    let l = &c.limits;
    if !(1..=MAX_ENDPOINTS_LIMIT).contains(&l.max_endpoints) {
        return Err(ConfigError::invalid(
            "limits.max_endpoints",
            l.max_endpoints,
            format!("must be within 1..={MAX_ENDPOINTS_LIMIT}"),
        ));
    }
    if l.session_capacity == 0 {
        return Err(ConfigError::invalid("limits.session_capacity", 0, "must be > 0"));
    }
    if l.max_inflight_requests == 0 {
        return Err(ConfigError::invalid("limits.max_inflight_requests", 0, "must be > 0"));
    }
    if l.inflight_timeout_ms == 0 {
        return Err(ConfigError::invalid("limits.inflight_timeout_ms", 0, "must be > 0"));
    }
    crate::flow::validate(&c.flow_control)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_seeds() {
        let p = Policy::default();
        let c = p.config();
        assert_eq!(c.modes.bypass_prefix_hit, 0.90);
        assert_eq!(c.modes.decode_kv_ceiling, 0.80);
        assert_eq!(c.modes.colocated_input_max_tokens, 512);
        assert_eq!(c.modes.short_output_max_tokens, 200);
        assert_eq!(c.modes.bypass_probability, 0.88);
        assert_eq!(c.index.speculative_ttl_ms, 2000);
        assert_eq!(c.index.tier_weights.gpu, 1.0);
        assert_eq!(c.index.tier_weights.cpu, 0.8);
        assert_eq!(c.index.block_tokens, 64);
        assert_eq!(c.index.bytes_per_token, 4);
        assert!(Policy::new(c.clone()).is_ok(), "defaults must validate");
    }

    #[test]
    fn empty_documents_are_the_default() {
        assert_eq!(Policy::from_json("{}").unwrap(), Policy::default());
        assert_eq!(Policy::from_yaml("").unwrap(), Policy::default());
        assert_eq!(Policy::from_yaml("{}").unwrap(), Policy::default());
    }

    #[test]
    fn json_and_yaml_read_the_same_tree() {
        let j = Policy::from_json(r#"{"modes":{"bypass_prefix_hit":0.75},"scoring":{"picker":{"kind":"weighted_random","seed":7,"temperature":0.2}}}"#).unwrap();
        let y = Policy::from_yaml("modes:\n  bypass_prefix_hit: 0.75\nscoring:\n  picker:\n    kind: weighted_random\n    seed: 7\n    temperature: 0.2\n").unwrap();
        assert_eq!(j, y);
        assert_eq!(j.config().modes.bypass_prefix_hit, 0.75);
    }

    #[test]
    fn json_floats_are_read_exactly_and_round_trip() {
        // Values serde_json's default float parser reads 1 ULP off (found by a search over
        // shortest representations); with `float_roundtrip` every one is exact, as in YAML.
        for text in ["0.9587872702291189", "0.11290774160688077", "0.9481570359895733", "0.40491912832269483"] {
            let want: f64 = text.parse().unwrap();
            let j = Policy::from_json(&format!(r#"{{"modes":{{"bypass_prefix_hit":{text}}}}}"#)).unwrap();
            assert_eq!(j.config().modes.bypass_prefix_hit.to_bits(), want.to_bits(), "{text}");
            let y = Policy::from_yaml(&format!("modes:\n  bypass_prefix_hit: {text}\n")).unwrap();
            assert_eq!(j, y, "{text}");
            // Written back out and read again: the same policy.
            let again = Policy::from_json(&serde_json::to_string(j.config()).unwrap()).unwrap();
            assert_eq!(again, j, "{text}");
        }
    }

    #[test]
    fn unknown_fields_are_rejected_with_their_path() {
        let e = Policy::from_json(r#"{"scoring":{"weights":{"prefx":1.0}}}"#).unwrap_err();
        match e {
            ConfigError::Parse { path, message, .. } => {
                assert_eq!(path, "scoring.weights.prefx");
                assert!(message.contains("prefx"), "{message}");
            }
            other => panic!("unexpected {other:?}"),
        }
        let e = Policy::from_yaml("modes:\n  colocated_input_max: 3\n").unwrap_err();
        assert!(e.to_string().contains("colocated_input_max"), "{e}");
    }

    #[test]
    fn wrong_types_name_the_field() {
        let e = Policy::from_json(r#"{"modes":{"colocated_input_max_tokens":"many"}}"#).unwrap_err();
        match e {
            ConfigError::Parse { path, .. } => assert_eq!(path, "modes.colocated_input_max_tokens"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn invalid_values_name_field_and_value() {
        let e = Policy::from_json(r#"{"modes":{"bypass_prefix_hit":1.5}}"#).unwrap_err();
        assert_eq!(
            e,
            ConfigError::Invalid {
                field: "modes.bypass_prefix_hit".into(),
                value: "1.5".into(),
                reason: "must be within [0, 1]".into()
            }
        );
        let e = Policy::from_json(r#"{"scoring":{"weights":{"queue":-1}}}"#).unwrap_err();
        assert!(matches!(e, ConfigError::Invalid { ref field, .. } if field == "scoring.weights.queue"), "{e}");
        let e = Policy::from_json(r#"{"index":{"block_tokens":0}}"#).unwrap_err();
        assert!(
            matches!(e, ConfigError::Invalid { ref field, ref value, .. } if field == "index.block_tokens" && value == "0")
        );
        let e = Policy::from_json(r#"{"request":{"priority_header":"X Bad"}}"#).unwrap_err();
        assert!(matches!(e, ConfigError::Invalid { ref field, .. } if field == "request.priority_header"));
        let e = Policy::from_json(r#"{"scoring":{"picker":{"kind":"weighted_random","seed":1,"temperature":0}}}"#)
            .unwrap_err();
        assert!(matches!(e, ConfigError::Invalid { ref field, .. } if field == "scoring.picker.temperature"));
        let e = Policy::from_json(r#"{"modes":{"risk_token_thresholds":[10,5,20]}}"#).unwrap_err();
        assert!(matches!(e, ConfigError::Invalid { ref field, .. } if field == "modes.risk_token_thresholds"));
    }

    #[test]
    fn malformed_documents_are_parse_errors() {
        assert!(matches!(Policy::from_json("{"), Err(ConfigError::Parse { .. })));
        assert!(matches!(Policy::from_json("{} trailing"), Err(ConfigError::Parse { .. })));
        assert!(matches!(Policy::from_json("[]"), Err(ConfigError::Parse { .. })));
        assert!(matches!(Policy::from_yaml("modes: [unclosed"), Err(ConfigError::Parse { .. })));
        assert!(matches!(Policy::from_str_auto("  {\"x\":1}"), Err(ConfigError::Parse { .. })));
        // Sections given as sequences are rejected, not read positionally.
        let e = Policy::from_json(r#"{"scoring":{"weights":[2.0]}}"#).unwrap_err();
        assert!(matches!(&e, ConfigError::Parse { path, .. } if path == "scoring.weights"), "{e:?}");
        let e = Policy::from_yaml("- 1\n- 2\n").unwrap_err();
        assert!(matches!(&e, ConfigError::Parse { path, .. } if path == "."), "{e:?}");
    }

    #[test]
    fn normalized_json_round_trips() {
        let p = Policy::from_json(r#"{"transfer":{"layerwise_streaming":true}}"#).unwrap();
        let again = Policy::from_json(&p.to_json_pretty()).unwrap();
        assert_eq!(p, again);
    }

    #[test]
    fn fingerprint_tracks_hashing_parameters_only() {
        let a = Policy::default();
        let b = Policy::from_json(r#"{"modes":{"bypass_prefix_hit":0.5}}"#).unwrap();
        let c = Policy::from_json(r#"{"index":{"hash_seed":9}}"#).unwrap();
        let d = Policy::from_json(r#"{"index":{"block_tokens":16}}"#).unwrap();
        assert_eq!(a.index_fingerprint(), b.index_fingerprint());
        assert_ne!(a.index_fingerprint(), c.index_fingerprint());
        assert_ne!(a.index_fingerprint(), d.index_fingerprint());
    }

    #[test]
    fn kv_volume_per_token() {
        assert_eq!(ModelShape::default().kv_bytes_per_token(), 131_072);
    }
}
