//! The mode decision (decode-direct / colocated / disaggregated), the judgment rubric, the
//! transfer-tax break-even model, and the [`Decision`] a route call returns.

use std::sync::Arc;

use serde::Serialize;

use crate::config::{ModesConfig, PolicyConfig, TransferConfig};
use crate::request::{Horizon, JudgmentHint};
use crate::score::EndpointScore;

/// Header naming the target endpoint (llm-d convention; the Envoy config routes on it with `override_host`).
pub const HEADER_DESTINATION: &str = "x-gateway-destination-endpoint";
/// Header naming the prefill endpoint of a disaggregated request (llm-d convention).
pub const HEADER_PREFILLER: &str = "x-prefiller-host-port";
/// Header carrying the mode.
pub const HEADER_MODE: &str = "x-kvroute-mode";
/// Header carrying the shed reason on a 429.
pub const HEADER_SHED_REASON: &str = "x-kvroute-shed-reason";
/// Optional debugging header: `rule;score;hit`.
pub const HEADER_SCORE: &str = "x-kvroute-score";

/// How the request is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Straight to a decode endpoint that already holds the prompt's KV cache.
    DecodeDirect,
    /// One endpoint runs prefill and decode.
    Colocated,
    /// A prefill endpoint computes the KV cache and ships it to a decode endpoint.
    Disaggregated,
}

impl Mode {
    /// Header value: `decode-direct`, `colocated`, `disaggregated`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::DecodeDirect => "decode-direct",
            Mode::Colocated => "colocated",
            Mode::Disaggregated => "disaggregated",
        }
    }
}

/// Which rule fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// Prefix hit ≥ `bypass_prefix_hit`, KV usage < `decode_kv_ceiling` (and bypass probability ≥
    /// `bypass_probability` when hinted): decode-direct.
    DecodeDirect,
    /// Input < `colocated_input_max_tokens`, short horizon, risk ≤ `colocated_max_risk`: colocated.
    ColocatedFastPath,
    /// The transfer pays for itself: disaggregated.
    Disaggregated,
    /// The transfer-tax model says the transfer does not pay: colocated.
    TransferTaxVeto,
    /// No healthy prefill endpoint: colocated.
    NoPrefillPool,
    /// `modes.disaggregation` is off: colocated.
    DisaggregationDisabled,
    /// The pool is saturated and the request is sheddable.
    Shed,
}

impl Rule {
    /// All rules, in declaration order (for counters).
    pub const ALL: [Rule; 7] = [
        Rule::DecodeDirect,
        Rule::ColocatedFastPath,
        Rule::Disaggregated,
        Rule::TransferTaxVeto,
        Rule::NoPrefillPool,
        Rule::DisaggregationDisabled,
        Rule::Shed,
    ];

    /// Snake-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::DecodeDirect => "decode_direct",
            Rule::ColocatedFastPath => "colocated_fast_path",
            Rule::Disaggregated => "disaggregated",
            Rule::TransferTaxVeto => "transfer_tax_veto",
            Rule::NoPrefillPool => "no_prefill_pool",
            Rule::DisaggregationDisabled => "disaggregation_disabled",
            Rule::Shed => "shed",
        }
    }
}

/// Where the judgment came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JudgmentSource {
    /// Derived by the rubric.
    Derived,
    /// Every field from the hint.
    Hint,
    /// Some fields hinted, the rest derived.
    Mixed,
}

/// The judgment the decision used.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Judgment {
    /// Generation horizon.
    pub horizon: Horizon,
    /// Memory-pressure risk 0–3.
    pub risk: u8,
    /// Bypass probability (only from a hint; the rubric does not invent one).
    pub bypass_probability: Option<f64>,
    /// Origin.
    pub source: JudgmentSource,
}

/// The rubric (used per field when no hint gives it):
/// - horizon: output budget ≤ `short_output_max_tokens` → short; ≥ `long_output_min_tokens` or
///   unbounded → long; else medium.
/// - risk: new tokens = `input · (1 − hit) + output budget` (unbounded counts as
///   `long_output_min_tokens`); risk = how many of `risk_token_thresholds` it reaches.
pub fn judge(cfg: &ModesConfig, hint: &JudgmentHint, input_tokens: u64, max_tokens: Option<u32>, hit: f64) -> Judgment {
    let derived_horizon = match max_tokens {
        None => Horizon::Long,
        Some(m) if m <= cfg.short_output_max_tokens => Horizon::Short,
        Some(m) if m >= cfg.long_output_min_tokens => Horizon::Long,
        Some(_) => Horizon::Medium,
    };
    let out = u64::from(max_tokens.unwrap_or(cfg.long_output_min_tokens));
    let new_tokens = (input_tokens as f64 * (1.0 - hit.clamp(0.0, 1.0))).round() as u64 + out;
    let derived_risk = cfg.risk_token_thresholds.iter().filter(|&&t| new_tokens >= u64::from(t)).count() as u8;
    let hinted = [hint.horizon.is_some(), hint.risk.is_some(), hint.bypass_probability.is_some()];
    let source = match hinted.iter().filter(|&&h| h).count() {
        0 => JudgmentSource::Derived,
        3 => JudgmentSource::Hint,
        _ => JudgmentSource::Mixed,
    };
    Judgment {
        horizon: hint.horizon.unwrap_or(derived_horizon),
        risk: hint.risk.unwrap_or(derived_risk),
        bypass_probability: hint.bypass_probability,
        source,
    }
}

/// The transfer-tax estimate behind a disaggregation decision.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TransferEstimate {
    /// Prompt tokens whose KV the decode endpoint lacks (to be transferred).
    pub tokens: u64,
    /// `V_KV = 2·L·H_kv·d_h·b·tokens`.
    pub kv_bytes: u64,
    /// Exposed transfer time `V/B + L_setup` (or `V/L/B + L_setup` when streaming layer-wise), s.
    pub transfer_s: f64,
    /// Request cost when disaggregated: prefill on P + exposed transfer, s.
    pub disaggregated_cost_s: f64,
    /// Cost when colocated on D: its prefill plus the stall imposed on its running requests, s.
    pub colocated_cost_s: f64,
    /// Whether disaggregation pays (`disaggregated_cost_s < colocated_cost_s`).
    pub pays: bool,
}

/// The break-even model (see [`TransferConfig`]).
pub fn transfer_estimate(
    cfg: &TransferConfig,
    input_tokens: u64,
    cached_on_decode: u64,
    cached_on_prefill: u64,
    running_on_decode: u32,
) -> TransferEstimate {
    let new_d = input_tokens.saturating_sub(cached_on_decode);
    let new_p = input_tokens.saturating_sub(cached_on_prefill);
    let kv_bytes = cfg.model.kv_bytes_per_token().saturating_mul(new_d);
    let exposed = if cfg.layerwise_streaming { kv_bytes as f64 / f64::from(cfg.model.layers) } else { kv_bytes as f64 };
    let bytes_per_s = cfg.network.bandwidth_gbps * 1e9 / 8.0;
    let transfer_s = exposed / bytes_per_s + cfg.network.setup_latency_us * 1e-6;
    let t_d = new_d as f64 / cfg.prefill_tokens_per_s;
    let t_p = new_p as f64 / cfg.prefill_tokens_per_s;
    let disaggregated_cost_s = t_p + transfer_s;
    let colocated_cost_s = t_d * (1.0 + cfg.interference_factor * f64::from(running_on_decode));
    TransferEstimate {
        tokens: new_d,
        kv_bytes,
        transfer_s,
        disaggregated_cost_s,
        colocated_cost_s,
        pays: disaggregated_cost_s < colocated_cost_s,
    }
}

/// What the mode rules need to know about the chosen decode endpoint D and prefill endpoint P.
pub(crate) struct ModeInputs {
    pub input_tokens: u64,
    pub judgment: Judgment,
    pub decode_hit: f64,
    pub decode_kv_usage: f64,
    pub decode_cached_tokens: u64,
    pub decode_running: u32,
    /// Best prefill endpoint's cached tokens, when a prefill pool exists.
    pub prefill_cached_tokens: Option<u64>,
}

/// Apply the rules in order: decode-direct bypass, colocated fast path, disaggregation (subject to
/// the pool, the switch and the transfer-tax veto).
pub(crate) fn decide_mode(cfg: &PolicyConfig, x: &ModeInputs) -> (Mode, Rule, Option<TransferEstimate>) {
    let m = &cfg.modes;
    let bypass_ok = x.judgment.bypass_probability.is_none_or(|p| p >= m.bypass_probability);
    if x.decode_hit >= m.bypass_prefix_hit && x.decode_kv_usage < m.decode_kv_ceiling && bypass_ok {
        return (Mode::DecodeDirect, Rule::DecodeDirect, None);
    }
    if x.input_tokens < u64::from(m.colocated_input_max_tokens)
        && x.judgment.horizon == Horizon::Short
        && x.judgment.risk <= m.colocated_max_risk
    {
        return (Mode::Colocated, Rule::ColocatedFastPath, None);
    }
    let Some(prefill_cached) = x.prefill_cached_tokens else {
        return (Mode::Colocated, Rule::NoPrefillPool, None);
    };
    if !m.disaggregation {
        return (Mode::Colocated, Rule::DisaggregationDisabled, None);
    }
    let t = transfer_estimate(&cfg.transfer, x.input_tokens, x.decode_cached_tokens, prefill_cached, x.decode_running);
    if t.pays {
        (Mode::Disaggregated, Rule::Disaggregated, Some(t))
    } else {
        (Mode::Colocated, Rule::TransferTaxVeto, Some(t))
    }
}

/// Why a request was shed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Shed {
    /// HTTP status to answer with (429).
    pub status: u16,
    /// Human-readable reason (also in the `x-kvroute-shed-reason` header).
    pub reason: String,
}

/// What a decision does with the request.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Send it to `endpoint` (the decode endpoint, or the only one) in `mode`; `prefill_endpoint`
    /// is set exactly when the mode is disaggregated.
    Routed {
        /// Target (decode) endpoint.
        endpoint: Arc<str>,
        /// Prefill endpoint (disaggregated only).
        prefill_endpoint: Option<Arc<str>>,
        /// How it is served.
        mode: Mode,
    },
    /// Refuse it (answer with the shed's status and reason).
    Shed(Shed),
}

/// The routing decision for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The id to pass to `complete` (the caller's `x-request-id`, made unique, or generated).
    pub request_id: String,
    /// Version of the policy that made the whole decision.
    pub policy_version: u64,
    /// The rule that fired.
    pub rule: Rule,
    /// Routed (endpoint, prefill endpoint, mode) or shed (status, reason).
    pub outcome: Outcome,
    /// Headers to set on the upstream request (or on the 429 answer when shed).
    pub headers: Vec<(&'static str, String)>,
    /// The judgment used.
    pub judgment: Judgment,
    /// Input tokens (pseudo-tokens for text).
    pub input_tokens: u64,
    /// Prefix hit ratio on the target.
    pub prefix_hit: f64,
    /// Prompt tokens the target is believed to hold.
    pub cached_tokens: u64,
    /// Pool saturation used by admission.
    pub saturation: f64,
    /// A filter was relaxed because it would have left no candidate.
    pub relaxed_filters: bool,
    /// The transfer-tax estimate, when the disaggregation rule was evaluated.
    pub transfer: Option<TransferEstimate>,
    /// Every registered endpoint at decision time, in id order.
    pub endpoints: Arc<[Arc<str>]>,
    /// Score breakdowns: `scores[i]` belongs to `endpoints[i]`.
    pub scores: Vec<EndpointScore>,
    /// The state changes this decision made, for other router instances to apply
    /// (`Router::apply_effect`); set only when `Router::record_effects(true)` and not shed.
    pub effect: Option<Arc<crate::effect::RoutingEffect>>,
}

/// The JSON form of a decision: the outcome's parts as flat, nullable fields (`mode`,
/// `endpoint`, `prefill_endpoint`, `shed`), as the bindings and fixtures read it.
#[derive(Serialize)]
struct DecisionJson<'a> {
    request_id: &'a str,
    policy_version: u64,
    rule: Rule,
    mode: Option<Mode>,
    endpoint: Option<&'a str>,
    prefill_endpoint: Option<&'a str>,
    shed: Option<&'a Shed>,
    headers: &'a [(&'static str, String)],
    judgment: Judgment,
    input_tokens: u64,
    prefix_hit: f64,
    cached_tokens: u64,
    saturation: f64,
    relaxed_filters: bool,
    transfer: Option<TransferEstimate>,
    endpoints: &'a [Arc<str>],
    scores: &'a [EndpointScore],
}

impl Serialize for Decision {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        DecisionJson {
            request_id: &self.request_id,
            policy_version: self.policy_version,
            rule: self.rule,
            mode: self.mode(),
            endpoint: self.endpoint(),
            prefill_endpoint: self.prefill_endpoint(),
            shed: self.shed(),
            headers: &self.headers,
            judgment: self.judgment,
            input_tokens: self.input_tokens,
            prefix_hit: self.prefix_hit,
            cached_tokens: self.cached_tokens,
            saturation: self.saturation,
            relaxed_filters: self.relaxed_filters,
            transfer: self.transfer,
            endpoints: &self.endpoints,
            scores: &self.scores,
        }
        .serialize(s)
    }
}

impl Decision {
    /// The mode (`None` when shed).
    pub fn mode(&self) -> Option<Mode> {
        match &self.outcome {
            Outcome::Routed { mode, .. } => Some(*mode),
            Outcome::Shed(_) => None,
        }
    }

    /// The target (decode) endpoint (`None` when shed).
    pub fn endpoint(&self) -> Option<&str> {
        match &self.outcome {
            Outcome::Routed { endpoint, .. } => Some(endpoint),
            Outcome::Shed(_) => None,
        }
    }

    /// The prefill endpoint (disaggregated only).
    pub fn prefill_endpoint(&self) -> Option<&str> {
        match &self.outcome {
            Outcome::Routed { prefill_endpoint, .. } => prefill_endpoint.as_deref(),
            Outcome::Shed(_) => None,
        }
    }

    /// Why the request was shed (`None` when routed).
    pub fn shed(&self) -> Option<&Shed> {
        match &self.outcome {
            Outcome::Shed(shed) => Some(shed),
            Outcome::Routed { .. } => None,
        }
    }

    /// Whether the request is routed (not shed).
    pub fn is_routed(&self) -> bool {
        matches!(self.outcome, Outcome::Routed { .. })
    }

    /// The score breakdown of one endpoint.
    pub fn score(&self, endpoint: &str) -> Option<&EndpointScore> {
        self.endpoints.iter().position(|e| &**e == endpoint).and_then(|i| self.scores.get(i))
    }

    /// (endpoint id, score breakdown) pairs in id order.
    pub fn breakdown(&self) -> impl Iterator<Item = (&str, &EndpointScore)> + '_ {
        self.endpoints.iter().map(|e| &**e).zip(&self.scores)
    }

    /// The value of a header the decision sets.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_str())
    }

    /// The decision as a JSON value (the format the golden fixtures compare against).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rubric() {
        let c = ModesConfig::default();
        let h = JudgmentHint::default();
        let j = judge(&c, &h, 100, Some(50), 0.0);
        assert_eq!((j.horizon, j.risk, j.source), (Horizon::Short, 0, JudgmentSource::Derived));
        assert_eq!(judge(&c, &h, 100, Some(500), 0.0).horizon, Horizon::Medium);
        assert_eq!(judge(&c, &h, 100, None, 0.0).horizon, Horizon::Long);
        assert_eq!(judge(&c, &h, 100, Some(2000), 0.0).horizon, Horizon::Long);
        // new tokens: 5000 input, no hit, 100 out → 5100 ≥ 1024, 4096 → risk 2
        assert_eq!(judge(&c, &h, 5000, Some(100), 0.0).risk, 2);
        // with a 90% hit only 500 + 100 are new → risk 0
        assert_eq!(judge(&c, &h, 5000, Some(100), 0.9).risk, 0);
        assert_eq!(judge(&c, &h, 20_000, None, 0.0).risk, 3);
        let hint = JudgmentHint { horizon: Some(Horizon::Long), risk: None, bypass_probability: None };
        let j = judge(&c, &hint, 100, Some(50), 0.0);
        assert_eq!((j.horizon, j.source), (Horizon::Long, JudgmentSource::Mixed));
    }

    #[test]
    fn transfer_model_numbers() {
        let mut t = TransferConfig::default();
        // 1000 tokens × 128 KiB = 131,072,000 B over 12.5 GB/s = 10.49 ms + 0.5 ms.
        let e = transfer_estimate(&t, 1000, 0, 0, 4);
        assert_eq!(e.kv_bytes, 131_072_000);
        assert!((e.transfer_s - (131_072_000.0 / 12.5e9 + 0.0005)).abs() < 1e-12);
        assert!((e.colocated_cost_s - 1000.0 / 8000.0 * 5.0).abs() < 1e-12);
        assert!(e.pays);
        // Idle decode endpoint: colocated costs only its own prefill, the transfer never pays.
        assert!(!transfer_estimate(&t, 1000, 0, 0, 0).pays);
        // Layer-wise streaming exposes 1/L of the volume.
        t.layerwise_streaming = true;
        let s = transfer_estimate(&t, 1000, 0, 0, 4);
        assert!((s.transfer_s - (131_072_000.0 / 32.0 / 12.5e9 + 0.0005)).abs() < 1e-12);
        // Only what the decode endpoint lacks is transferred.
        assert_eq!(transfer_estimate(&t, 1000, 600, 0, 4).tokens, 400);
    }
}
