//! The `flow_control` section of the policy: limits, TTLs, priority bands with their fairness and
//! ordering policies, the saturation detector, pre-queue shedding and attained service.
//!
//! The names mirror llm-d's `flowControl` block in this project's snake_case style
//! (`maxBytes` → `max_bytes`, `defaultRequestTTL` → `default_request_ttl_ms`, `priorityBands` →
//! `priority_bands`, the utilization detector's `queueDepthThreshold` → `queue_depth_threshold`,
//! …); durations are integers in milliseconds, as everywhere in the policy.

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// Default: requests queued at most, over all bands (0 = no limit).
pub const DEFAULT_FLOW_MAX_REQUESTS: u64 = 10_000;
/// Default: bytes (request bodies) queued at most, over all bands (0 = no limit, as llm-d).
pub const DEFAULT_FLOW_MAX_BYTES: u64 = 0;
/// Default: bytes queued at most per band (llm-d's band default, 1 GB).
pub const DEFAULT_BAND_MAX_BYTES: u64 = 1_000_000_000;
/// Default: how long a request may wait in the queue, milliseconds.
pub const DEFAULT_REQUEST_TTL_MS: u64 = 30_000;
/// Default: how long a request may wait while the pool has no endpoint, milliseconds.
pub const DEFAULT_NO_ENDPOINTS_TTL_MS: u64 = 5_000;
/// Default: the utilization detector's waiting-queue depth at which an endpoint is saturated.
pub const DEFAULT_QUEUE_DEPTH_THRESHOLD: f64 = 5.0;
/// Default: the utilization detector's KV-cache utilization at which an endpoint is saturated.
pub const DEFAULT_KV_CACHE_UTIL_THRESHOLD: f64 = 0.8;
/// Default: a band dispatches while the pool's saturation is below this ceiling.
pub const DEFAULT_SATURATION_CEILING: f64 = 1.0;
/// Default: pre-queue shedding scale `k` in `p = min(k·sat^power, 1)`.
pub const DEFAULT_SHED_K: f64 = 1.0;
/// Default: pre-queue shedding exponent `power` in `p = min(k·sat^power, 1)`.
pub const DEFAULT_SHED_POWER: f64 = 4.0;
/// Default: attained service counts an output token as this many input tokens.
pub const DEFAULT_OUTPUT_TOKEN_WEIGHT: f64 = 2.0;
/// Default: attained service halves every this many milliseconds.
pub const DEFAULT_SERVICE_HALF_LIFE_MS: u64 = 10_000;
/// Default: output tokens assumed for a request without `max_tokens` (attained service, the
/// concurrency detector's token count).
pub const DEFAULT_UNBOUNDED_OUTPUT_TOKENS: u32 = 1024;
/// Default: fairness ids with their own label on the flow-control metrics (the rest: `other`).
pub const DEFAULT_METRICS_FAIRNESS_IDS: usize = 16;
/// Most priority bands a controller holds (configured and created on demand together).
pub const MAX_PRIORITY_BANDS: usize = 64;
/// Longest TTL accepted, milliseconds (one day).
pub const MAX_FLOW_TTL_MS: u64 = 86_400_000;

/// Flow control: requests wait in per-tenant queues inside priority bands while the pool is
/// saturated, and are released in order as capacity frees (see `RouterCore::admit`).
///
/// Off by default; with it off, `admit` admits every request and routing sheds sheddable
/// requests at saturation exactly as before (the `admission` section).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowControlConfig {
    /// Switch flow control on.
    pub enabled: bool,
    /// Requests queued at most over all bands (llm-d `maxRequests`; 0 = no limit).
    pub max_requests: u64,
    /// Request bytes queued at most over all bands (llm-d `maxBytes`; 0 = no limit).
    pub max_bytes: u64,
    /// How long a request may wait before it is dropped with 429 `rejected-ttl-expired`
    /// (llm-d `defaultRequestTTL`; 0 = no TTL). A band's own TTL or the request's
    /// `x-llm-d-inference-ttl` header replaces it.
    pub default_request_ttl_ms: u64,
    /// While the pool has no healthy decode-capable endpoint, a request that has waited this
    /// long is dropped with 503 `rejected-no-endpoints` (0: requests arriving then are rejected
    /// at once).
    pub no_endpoints_ttl_ms: u64,
    /// The band of every priority that `priority_bands` does not list (llm-d
    /// `defaultPriorityBand`), and the defaults of the listed bands' unset fields.
    pub default_priority_band: BandDefaults,
    /// Bands by priority (llm-d `priorityBands`); priorities must be distinct. A priority not
    /// listed gets a band made from `default_priority_band` when its first request arrives.
    pub priority_bands: Vec<PriorityBandConfig>,
    /// Priority holdback: each band's ceiling is lowered by this much per band above it (in
    /// priority order), so lower bands stop dispatching earlier and leave headroom to higher ones.
    pub priority_holdback: f64,
    /// How saturation is measured.
    pub saturation_detector: SaturationDetectorConfig,
    /// P/D fleets: saturation is the higher of the prefill pool's and the decode pool's (the
    /// decode pool alone when there is no prefill endpoint).
    pub stage_aware: bool,
    /// Probabilistic shedding of sheddable (negative-priority) requests before they queue.
    pub shedding: SheddingConfig,
    /// Where the fairness id comes from when the request carries no fairness header.
    pub fairness_fallback: FairnessFallback,
    /// The fairness id of requests with neither a fairness header nor a fallback value.
    pub default_fairness_id: String,
    /// The attained-service fairness policy's accounting.
    pub attained_service: AttainedServiceConfig,
    /// Fairness ids with their own label on the enqueue-to-dispatch histogram (the first this
    /// many to reach 10 requests; every other id is counted as `other`).
    pub metrics_fairness_ids: usize,
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        FlowControlConfig {
            enabled: false,
            max_requests: DEFAULT_FLOW_MAX_REQUESTS,
            max_bytes: DEFAULT_FLOW_MAX_BYTES,
            default_request_ttl_ms: DEFAULT_REQUEST_TTL_MS,
            no_endpoints_ttl_ms: DEFAULT_NO_ENDPOINTS_TTL_MS,
            default_priority_band: BandDefaults::default(),
            priority_bands: Vec::new(),
            priority_holdback: 0.0,
            saturation_detector: SaturationDetectorConfig::default(),
            stage_aware: true,
            shedding: SheddingConfig::default(),
            fairness_fallback: FairnessFallback::CacheSalt,
            default_fairness_id: "default".into(),
            attained_service: AttainedServiceConfig::default(),
            metrics_fairness_ids: DEFAULT_METRICS_FAIRNESS_IDS,
        }
    }
}

/// The settings of a band (the default band, and the defaults of configured bands).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BandDefaults {
    /// Requests queued at most in the band (0 = no limit).
    pub max_requests: u64,
    /// Request bytes queued at most in the band (0 = no limit).
    pub max_bytes: u64,
    /// Which flow (tenant) of the band dispatches next.
    pub fairness_policy: FairnessPolicy,
    /// Which request of a flow dispatches next.
    pub ordering_policy: OrderingPolicy,
    /// The band dispatches while saturation is below this (before the priority holdback).
    pub saturation_ceiling: f64,
    /// The band's queue TTL (`null`: `flow_control.default_request_ttl_ms`; 0 = no TTL).
    pub default_request_ttl_ms: Option<u64>,
}

impl Default for BandDefaults {
    fn default() -> Self {
        BandDefaults {
            max_requests: 0,
            max_bytes: DEFAULT_BAND_MAX_BYTES,
            fairness_policy: FairnessPolicy::RoundRobin,
            ordering_policy: OrderingPolicy::Fcfs,
            saturation_ceiling: DEFAULT_SATURATION_CEILING,
            default_request_ttl_ms: None,
        }
    }
}

/// One configured band. Unset fields take `flow_control.default_priority_band`'s values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriorityBandConfig {
    /// The band's priority (required; higher dispatches first, negative is sheddable).
    pub priority: i32,
    /// Requests queued at most in the band (0 = no limit).
    #[serde(default)]
    pub max_requests: Option<u64>,
    /// Request bytes queued at most in the band (0 = no limit).
    #[serde(default)]
    pub max_bytes: Option<u64>,
    /// Which flow of the band dispatches next.
    #[serde(default)]
    pub fairness_policy: Option<FairnessPolicy>,
    /// Which request of a flow dispatches next.
    #[serde(default)]
    pub ordering_policy: Option<OrderingPolicy>,
    /// The band dispatches while saturation is below this (before the priority holdback).
    #[serde(default)]
    pub saturation_ceiling: Option<f64>,
    /// The band's queue TTL, milliseconds (0 = no TTL).
    #[serde(default)]
    pub default_request_ttl_ms: Option<u64>,
}

/// Which flow of a band dispatches next (the fairness between tenants of equal priority).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FairnessPolicy {
    /// The best head across the band's flows by the ordering policy (llm-d's default,
    /// `global-strict-fairness-policy`): with FCFS ordering, the band's oldest request. A
    /// bursting tenant gets what it asks for.
    #[serde(alias = "global-strict-fairness-policy")]
    GlobalStrict,
    /// The flows with queued requests take turns, one request each (`round-robin-fairness-policy`).
    #[default]
    #[serde(alias = "round-robin-fairness-policy")]
    RoundRobin,
    /// The flow that has received the least service goes next: input tokens plus
    /// `attained_service.output_token_weight` × output tokens of its admitted requests, halving
    /// every `attained_service.half_life_ms`.
    #[serde(alias = "attained-service-fairness-policy")]
    AttainedService,
}

impl FairnessPolicy {
    /// The name in the policy document.
    pub fn as_str(self) -> &'static str {
        match self {
            FairnessPolicy::GlobalStrict => "global_strict",
            FairnessPolicy::RoundRobin => "round_robin",
            FairnessPolicy::AttainedService => "attained_service",
        }
    }
}

/// Which request of a flow dispatches next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OrderingPolicy {
    /// First come, first served (`fcfs-ordering-policy`).
    #[default]
    #[serde(alias = "fcfs-ordering-policy")]
    Fcfs,
    /// Earliest deadline first, the deadline being enqueue time + the request's queue TTL
    /// (`edf-ordering-policy`); requests without a TTL go last, FCFS among themselves.
    #[serde(alias = "edf-ordering-policy")]
    Edf,
    /// Earliest SLO deadline first: enqueue time + the request's TTFT objective
    /// (`x-llm-d-slo-ttft-ms`, alias `x-slo-ttft-ms`); requests without one go last, FCFS among
    /// themselves (`slo-deadline-ordering-policy`).
    #[serde(alias = "slo-deadline-ordering-policy")]
    SloDeadline,
}

impl OrderingPolicy {
    /// The name in the policy document.
    pub fn as_str(self) -> &'static str {
        match self {
            OrderingPolicy::Fcfs => "fcfs",
            OrderingPolicy::Edf => "edf",
            OrderingPolicy::SloDeadline => "slo_deadline",
        }
    }
}

/// How pool saturation is measured (1.0 = saturated).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum SaturationDetectorConfig {
    /// llm-d's `utilization-detector`: per endpoint
    /// `max(waiting / queue_depth_threshold, kv_usage / kv_cache_util_threshold)` from its last
    /// metrics snapshot corrected by the router's own traffic since (each request routed there
    /// adds one waiting request and one request's share of KV usage), 1.0 when the snapshot is
    /// stale or missing; the pool's saturation is the mean over its healthy endpoints.
    Utilization {
        /// Waiting requests at which an endpoint is saturated.
        #[serde(default = "default_queue_depth_threshold")]
        queue_depth_threshold: f64,
        /// KV-cache utilization (0–1) at which an endpoint is saturated.
        #[serde(default = "default_kv_cache_util_threshold")]
        kv_cache_util_threshold: f64,
        /// Metrics older than this count as saturated (`null`: `metrics.staleness_ms`).
        #[serde(default)]
        metrics_staleness_threshold_ms: Option<u64>,
    },
    /// Requests (and/or tokens) the router has in flight per endpoint against a limit: per
    /// endpoint `max(inflight / max_requests_per_endpoint, inflight_tokens /
    /// max_tokens_per_endpoint)`, the pool's saturation being the mean over its healthy
    /// endpoints. Needs no metrics.
    Concurrency {
        /// In-flight requests at which an endpoint is saturated (`null`: not counted).
        #[serde(default)]
        max_requests_per_endpoint: Option<u32>,
        /// In-flight tokens (input + output budget) at which an endpoint is saturated (`null`:
        /// not counted).
        #[serde(default)]
        max_tokens_per_endpoint: Option<u64>,
    },
}

fn default_queue_depth_threshold() -> f64 {
    DEFAULT_QUEUE_DEPTH_THRESHOLD
}

fn default_kv_cache_util_threshold() -> f64 {
    DEFAULT_KV_CACHE_UTIL_THRESHOLD
}

impl Default for SaturationDetectorConfig {
    fn default() -> Self {
        SaturationDetectorConfig::Utilization {
            queue_depth_threshold: DEFAULT_QUEUE_DEPTH_THRESHOLD,
            kv_cache_util_threshold: DEFAULT_KV_CACHE_UTIL_THRESHOLD,
            metrics_staleness_threshold_ms: None,
        }
    }
}

/// Probabilistic pre-queue shedding: a sheddable request that would have to queue is rejected
/// (429 `rejected-saturated`) with probability `p = min(k · saturation^power, 1)`, drawn from a
/// generator seeded with `seed` (deterministic for a given call sequence).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SheddingConfig {
    /// Shed at all (off: sheddable requests queue like the others, and are still the first
    /// evicted when the queue is full).
    pub enabled: bool,
    /// Scale `k` (≥ 0).
    pub k: f64,
    /// Exponent `power` (> 0).
    pub power: f64,
    /// Seed of the draws.
    pub seed: u64,
}

impl Default for SheddingConfig {
    fn default() -> Self {
        SheddingConfig { enabled: true, k: DEFAULT_SHED_K, power: DEFAULT_SHED_POWER, seed: 0 }
    }
}

/// Where a request's fairness id comes from without a fairness header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FairnessFallback {
    /// The request's `cache_salt` (the tenant's isolation salt), else `default_fairness_id`.
    #[default]
    CacheSalt,
    /// The requested model name.
    Model,
    /// Always `default_fairness_id`.
    None,
}

/// Attained-service accounting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AttainedServiceConfig {
    /// An output token (of the request's budget) counts as this many input tokens (≥ 0).
    pub output_token_weight: f64,
    /// Attained service halves every this many milliseconds (virtual time: the calls' `now_ms`).
    pub half_life_ms: u64,
    /// Output tokens assumed for a request without `max_tokens` (chat).
    pub unbounded_output_tokens: u32,
}

impl Default for AttainedServiceConfig {
    fn default() -> Self {
        AttainedServiceConfig {
            output_token_weight: DEFAULT_OUTPUT_TOKEN_WEIGHT,
            half_life_ms: DEFAULT_SERVICE_HALF_LIFE_MS,
            unbounded_output_tokens: DEFAULT_UNBOUNDED_OUTPUT_TOKENS,
        }
    }
}

/// A band's settings after defaults are applied.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BandParams {
    pub max_requests: u64,
    pub max_bytes: u64,
    pub fairness: FairnessPolicy,
    pub ordering: OrderingPolicy,
    pub ceiling: f64,
    pub ttl_ms: u64,
}

impl FlowControlConfig {
    /// The settings of the band of `priority`.
    pub(crate) fn band_params(&self, priority: i32) -> BandParams {
        let d = &self.default_priority_band;
        let ttl = |t: Option<u64>| t.unwrap_or(self.default_request_ttl_ms);
        match self.priority_bands.iter().find(|b| b.priority == priority) {
            Some(b) => BandParams {
                max_requests: b.max_requests.unwrap_or(d.max_requests),
                max_bytes: b.max_bytes.unwrap_or(d.max_bytes),
                fairness: b.fairness_policy.unwrap_or(d.fairness_policy),
                ordering: b.ordering_policy.unwrap_or(d.ordering_policy),
                ceiling: b.saturation_ceiling.unwrap_or(d.saturation_ceiling),
                ttl_ms: ttl(b.default_request_ttl_ms.or(d.default_request_ttl_ms)),
            },
            None => BandParams {
                max_requests: d.max_requests,
                max_bytes: d.max_bytes,
                fairness: d.fairness_policy,
                ordering: d.ordering_policy,
                ceiling: d.saturation_ceiling,
                ttl_ms: ttl(d.default_request_ttl_ms),
            },
        }
    }
}

fn check_ceiling(field: &str, v: f64) -> Result<(), ConfigError> {
    if !v.is_finite() || v <= 0.0 || v > 100.0 {
        return Err(ConfigError::invalid(field, v, "must be within (0, 100]"));
    }
    Ok(())
}

fn check_ttl(field: &str, v: u64) -> Result<(), ConfigError> {
    if v > MAX_FLOW_TTL_MS {
        return Err(ConfigError::invalid(field, v, format!("must be at most {MAX_FLOW_TTL_MS} (one day)")));
    }
    Ok(())
}

/// Validate the `flow_control` section (called by `Policy::new`).
pub(crate) fn validate(f: &FlowControlConfig) -> Result<(), ConfigError> {
    check_ttl("flow_control.default_request_ttl_ms", f.default_request_ttl_ms)?;
    check_ttl("flow_control.no_endpoints_ttl_ms", f.no_endpoints_ttl_ms)?;
    let d = &f.default_priority_band;
    check_ceiling("flow_control.default_priority_band.saturation_ceiling", d.saturation_ceiling)?;
    if let Some(t) = d.default_request_ttl_ms {
        check_ttl("flow_control.default_priority_band.default_request_ttl_ms", t)?;
    }
    if f.priority_bands.len() > MAX_PRIORITY_BANDS {
        return Err(ConfigError::invalid(
            "flow_control.priority_bands",
            f.priority_bands.len(),
            format!("at most {MAX_PRIORITY_BANDS} bands"),
        ));
    }
    for (i, b) in f.priority_bands.iter().enumerate() {
        if f.priority_bands[..i].iter().any(|o| o.priority == b.priority) {
            return Err(ConfigError::invalid(
                &format!("flow_control.priority_bands[{i}].priority"),
                b.priority,
                "priorities must be distinct",
            ));
        }
        if let Some(c) = b.saturation_ceiling {
            check_ceiling(&format!("flow_control.priority_bands[{i}].saturation_ceiling"), c)?;
        }
        if let Some(t) = b.default_request_ttl_ms {
            check_ttl(&format!("flow_control.priority_bands[{i}].default_request_ttl_ms"), t)?;
        }
    }
    if !(0.0..1.0).contains(&f.priority_holdback) {
        return Err(ConfigError::invalid(
            "flow_control.priority_holdback",
            f.priority_holdback,
            "must be within [0, 1)",
        ));
    }
    match &f.saturation_detector {
        SaturationDetectorConfig::Utilization {
            queue_depth_threshold,
            kv_cache_util_threshold,
            metrics_staleness_threshold_ms,
        } => {
            if !queue_depth_threshold.is_finite() || *queue_depth_threshold <= 0.0 {
                return Err(ConfigError::invalid(
                    "flow_control.saturation_detector.queue_depth_threshold",
                    queue_depth_threshold,
                    "must be a finite number > 0",
                ));
            }
            if !(*kv_cache_util_threshold > 0.0 && *kv_cache_util_threshold <= 1.0) {
                return Err(ConfigError::invalid(
                    "flow_control.saturation_detector.kv_cache_util_threshold",
                    kv_cache_util_threshold,
                    "must be within (0, 1]",
                ));
            }
            if *metrics_staleness_threshold_ms == Some(0) {
                return Err(ConfigError::invalid(
                    "flow_control.saturation_detector.metrics_staleness_threshold_ms",
                    0,
                    "must be > 0 (or null: metrics.staleness_ms)",
                ));
            }
        }
        SaturationDetectorConfig::Concurrency { max_requests_per_endpoint, max_tokens_per_endpoint } => {
            if max_requests_per_endpoint.is_none() && max_tokens_per_endpoint.is_none() {
                return Err(ConfigError::invalid(
                    "flow_control.saturation_detector",
                    "concurrency",
                    "needs max_requests_per_endpoint or max_tokens_per_endpoint",
                ));
            }
            if *max_requests_per_endpoint == Some(0) {
                return Err(ConfigError::invalid(
                    "flow_control.saturation_detector.max_requests_per_endpoint",
                    0,
                    "must be > 0",
                ));
            }
            if *max_tokens_per_endpoint == Some(0) {
                return Err(ConfigError::invalid(
                    "flow_control.saturation_detector.max_tokens_per_endpoint",
                    0,
                    "must be > 0",
                ));
            }
        }
    }
    let s = &f.shedding;
    if !s.k.is_finite() || s.k < 0.0 {
        return Err(ConfigError::invalid("flow_control.shedding.k", s.k, "must be a finite number ≥ 0"));
    }
    if !s.power.is_finite() || s.power <= 0.0 {
        return Err(ConfigError::invalid("flow_control.shedding.power", s.power, "must be a finite number > 0"));
    }
    if f.default_fairness_id.is_empty() {
        return Err(ConfigError::invalid("flow_control.default_fairness_id", "\"\"", "must be non-empty"));
    }
    let a = &f.attained_service;
    if !a.output_token_weight.is_finite() || a.output_token_weight < 0.0 {
        return Err(ConfigError::invalid(
            "flow_control.attained_service.output_token_weight",
            a.output_token_weight,
            "must be a finite number ≥ 0",
        ));
    }
    if a.half_life_ms == 0 {
        return Err(ConfigError::invalid("flow_control.attained_service.half_life_ms", 0, "must be > 0"));
    }
    if f.metrics_fairness_ids > 256 {
        return Err(ConfigError::invalid(
            "flow_control.metrics_fairness_ids",
            f.metrics_fairness_ids,
            "must be at most 256",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::Policy;
    use crate::error::ConfigError;

    use super::*;

    #[test]
    fn defaults_are_off_and_valid() {
        let p = Policy::default();
        let f = &p.config().flow_control;
        assert!(!f.enabled);
        assert_eq!(f.max_requests, DEFAULT_FLOW_MAX_REQUESTS);
        assert_eq!(f.default_request_ttl_ms, 30_000);
        assert_eq!(f.band_params(0).fairness, FairnessPolicy::RoundRobin);
        assert!(validate(f).is_ok());
    }

    #[test]
    fn llm_d_names_and_aliases_are_read() {
        let p = Policy::from_yaml(
            "flow_control:\n  enabled: true\n  max_requests: 100\n  max_bytes: 5000\n  default_request_ttl_ms: 2000\n  \
             default_priority_band:\n    fairness_policy: global-strict-fairness-policy\n  priority_bands:\n  \
             - priority: 10\n    ordering_policy: slo-deadline-ordering-policy\n    max_requests: 7\n  \
             - priority: -1\n    fairness_policy: attained_service\n  saturation_detector:\n    kind: utilization\n    \
             queue_depth_threshold: 8\n    kv_cache_util_threshold: 0.9\n    metrics_staleness_threshold_ms: 200\n",
        )
        .unwrap();
        let f = &p.config().flow_control;
        let b10 = f.band_params(10);
        assert_eq!(
            (b10.max_requests, b10.ordering, b10.fairness),
            (7, OrderingPolicy::SloDeadline, FairnessPolicy::GlobalStrict)
        );
        assert_eq!(b10.ttl_ms, 2000, "unset fields come from the defaults");
        assert_eq!(f.band_params(-1).fairness, FairnessPolicy::AttainedService);
        assert_eq!(
            f.band_params(3).fairness,
            FairnessPolicy::GlobalStrict,
            "an unlisted priority gets the default band"
        );
        let again = Policy::from_json(&p.to_json_pretty()).unwrap();
        assert_eq!(again, p, "the normalized document round-trips");
    }

    #[test]
    fn invalid_values_name_the_field() {
        for (doc, field) in [
            (
                r#"{"flow_control":{"priority_bands":[{"priority":1},{"priority":1}]}}"#,
                "flow_control.priority_bands[1].priority",
            ),
            (r#"{"flow_control":{"priority_holdback":1.5}}"#, "flow_control.priority_holdback"),
            (
                r#"{"flow_control":{"default_priority_band":{"saturation_ceiling":0}}}"#,
                "flow_control.default_priority_band.saturation_ceiling",
            ),
            (r#"{"flow_control":{"saturation_detector":{"kind":"concurrency"}}}"#, "flow_control.saturation_detector"),
            (
                r#"{"flow_control":{"saturation_detector":{"kind":"utilization","kv_cache_util_threshold":2}}}"#,
                "flow_control.saturation_detector.kv_cache_util_threshold",
            ),
            (r#"{"flow_control":{"shedding":{"power":0}}}"#, "flow_control.shedding.power"),
            (
                r#"{"flow_control":{"attained_service":{"half_life_ms":0}}}"#,
                "flow_control.attained_service.half_life_ms",
            ),
            (r#"{"flow_control":{"default_request_ttl_ms":100000000}}"#, "flow_control.default_request_ttl_ms"),
            (r#"{"flow_control":{"default_fairness_id":""}}"#, "flow_control.default_fairness_id"),
        ] {
            let e = Policy::from_json(doc).unwrap_err();
            assert!(matches!(&e, ConfigError::Invalid { field: f, .. } if f == field), "{doc}: {e:?}");
        }
        let e = Policy::from_json(r#"{"flow_control":{"priority_bands":[{"max_requests":3}]}}"#).unwrap_err();
        assert!(matches!(&e, ConfigError::Parse { .. }), "a band needs its priority: {e:?}");
        let e = Policy::from_json(r#"{"flow_control":{"fairness_policy":"round_robin"}}"#).unwrap_err();
        assert!(matches!(&e, ConfigError::Parse { path, .. } if path == "flow_control.fairness_policy"), "{e:?}");
    }
}
