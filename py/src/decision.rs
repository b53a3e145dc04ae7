//! `Decision` and the small value classes it hands out. A `Decision` wraps the core decision
//! as is; every Python view of it (headers dict, score breakdown, judgment, …) is built when
//! accessed, so `Router.route` stays one core call plus one object.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::convert::{self, repr_bool, repr_opt, repr_str};

/// The serde name of a unit enum value (`"stale_metrics"`, `"derived"`, …).
fn serde_name<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        _ => String::new(),
    }
}

/// Why a request was shed: answer with `status` (429) and `reason`.
#[pyclass(frozen, get_all, module = "kvroute", name = "Shed")]
pub(crate) struct Shed {
    /// HTTP status to answer with (429).
    status: u16,
    /// Human-readable reason (also in the `x-kvroute-shed-reason` header).
    reason: String,
}

#[pymethods]
impl Shed {
    fn __repr__(&self) -> String {
        format!("Shed(status={}, reason={})", self.status, repr_str(&self.reason))
    }
}

/// The judgment a decision used (from hint headers, derived by the rubric, or mixed).
#[pyclass(frozen, get_all, module = "kvroute", name = "Judgment")]
pub(crate) struct Judgment {
    /// `"short"`, `"medium"` or `"long"`.
    horizon: &'static str,
    /// Memory-pressure risk 0–3.
    risk: u8,
    /// Bypass probability (only from a hint).
    bypass_probability: Option<f64>,
    /// `"derived"`, `"hint"` or `"mixed"`.
    source: String,
}

#[pymethods]
impl Judgment {
    fn __repr__(&self) -> String {
        let p = self.bypass_probability.map_or_else(|| "None".to_owned(), |p| format!("{p:?}"));
        format!(
            "Judgment(horizon={}, risk={}, bypass_probability={p}, source={})",
            repr_str(self.horizon),
            self.risk,
            repr_str(&self.source)
        )
    }
}

/// The transfer-tax estimate behind a disaggregation decision.
#[pyclass(frozen, get_all, module = "kvroute", name = "TransferEstimate")]
pub(crate) struct TransferEstimate {
    /// Prompt tokens whose KV the decode endpoint lacks.
    tokens: u64,
    /// Bytes of KV cache to transfer.
    kv_bytes: u64,
    /// Exposed transfer time, seconds.
    transfer_s: f64,
    /// Cost when disaggregated, seconds.
    disaggregated_cost_s: f64,
    /// Cost when colocated, seconds.
    colocated_cost_s: f64,
    /// Whether disaggregation pays.
    pays: bool,
}

#[pymethods]
impl TransferEstimate {
    fn __repr__(&self) -> String {
        format!(
            "TransferEstimate(tokens={}, kv_bytes={}, transfer_s={:?}, disaggregated_cost_s={:?}, colocated_cost_s={:?}, pays={})",
            self.tokens,
            self.kv_bytes,
            self.transfer_s,
            self.disaggregated_cost_s,
            self.colocated_cost_s,
            repr_bool(self.pays)
        )
    }
}

/// One endpoint's score breakdown in a decision.
#[pyclass(frozen, get_all, module = "kvroute", name = "EndpointScore")]
pub(crate) struct EndpointScore {
    /// Endpoint id.
    endpoint: String,
    /// `"prefill"`, `"decode"` or `"both"`.
    role: &'static str,
    /// `"unhealthy"`, `"stale_metrics"`, `"saturated"` or `None`.
    filtered: Option<String>,
    /// Leading prompt blocks it holds.
    matched_blocks: u32,
    /// Prompt tokens those blocks cover.
    cached_tokens: u64,
    /// Whether the match came from the event-fed precise index.
    precise: bool,
    /// Tier-weighted prefix hit ratio 0–1.
    prefix_hit: f64,
    /// LoRA affinity 0–1.
    lora: f64,
    /// Normalized queue depth.
    queue: f64,
    /// KV-cache usage 0–1.
    kv_usage: f64,
    /// 1 when the request's session last went here.
    session: f64,
    /// Normalized router-side in-flight requests.
    inflight: f64,
    /// Weighted total.
    total: f64,
}

impl EndpointScore {
    fn new(endpoint: &str, s: &kvroute::EndpointScore) -> Self {
        EndpointScore {
            endpoint: endpoint.to_owned(),
            role: s.role.as_str(),
            filtered: s.filtered.as_ref().map(serde_name),
            matched_blocks: s.matched_blocks,
            cached_tokens: s.cached_tokens,
            precise: s.precise,
            prefix_hit: s.prefix_hit,
            lora: s.lora,
            queue: s.queue,
            kv_usage: s.kv_usage,
            session: s.session,
            inflight: s.inflight,
            total: s.total,
        }
    }
}

#[pymethods]
impl EndpointScore {
    fn __repr__(&self) -> String {
        format!(
            "EndpointScore(endpoint={}, role={}, filtered={}, prefix_hit={:?}, total={:?})",
            repr_str(&self.endpoint),
            repr_str(self.role),
            repr_opt(self.filtered.as_deref()),
            self.prefix_hit,
            self.total
        )
    }
}

/// The routing decision for one request.
///
/// Set `headers` on the upstream request (or on the 429 answer when `shed`), send it to
/// `endpoint`, and call `Router.complete(request_id)` when the response has finished.
#[pyclass(frozen, module = "kvroute", name = "Decision")]
pub(crate) struct Decision {
    pub(crate) inner: kvroute::Decision,
}

#[pymethods]
impl Decision {
    /// The id to pass to `Router.complete`.
    #[getter]
    fn request_id(&self) -> &str {
        &self.inner.request_id
    }

    /// Version of the policy that made the whole decision.
    #[getter]
    fn policy_version(&self) -> u64 {
        self.inner.policy_version
    }

    /// The rule that fired (`"decode_direct"`, `"colocated_fast_path"`, `"disaggregated"`,
    /// `"transfer_tax_veto"`, `"no_prefill_pool"`, `"disaggregation_disabled"`, `"shed"`).
    #[getter]
    fn rule(&self) -> &'static str {
        self.inner.rule.as_str()
    }

    /// `"decode-direct"`, `"colocated"`, `"disaggregated"`, or `None` when shed.
    #[getter]
    fn mode(&self) -> Option<&'static str> {
        self.inner.mode().map(kvroute::Mode::as_str)
    }

    /// Target (decode) endpoint, or `None` when shed.
    #[getter]
    fn endpoint(&self) -> Option<&str> {
        self.inner.endpoint()
    }

    /// Prefill endpoint (disaggregated only).
    #[getter]
    fn prefill_endpoint(&self) -> Option<&str> {
        self.inner.prefill_endpoint()
    }

    /// Set when the request is shed.
    #[getter]
    fn shed(&self) -> Option<Shed> {
        self.inner.shed().map(|s| Shed { status: s.status, reason: s.reason.clone() })
    }

    /// Headers to set (name → value).
    #[getter]
    fn headers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in &self.inner.headers {
            d.set_item(*k, v)?;
        }
        Ok(d)
    }

    /// The value of one header the decision sets.
    fn header(&self, name: &str) -> Option<&str> {
        self.inner.header(name)
    }

    /// Prefix hit ratio on the target (0–1).
    #[getter]
    fn prefix_hit(&self) -> f64 {
        self.inner.prefix_hit
    }

    /// Prompt tokens the target is believed to hold.
    #[getter]
    fn cached_tokens(&self) -> u64 {
        self.inner.cached_tokens
    }

    /// Input tokens (pseudo-tokens for text without a tokenizer).
    #[getter]
    fn input_tokens(&self) -> u64 {
        self.inner.input_tokens
    }

    /// Pool saturation used by admission.
    #[getter]
    fn saturation(&self) -> f64 {
        self.inner.saturation
    }

    /// Whether a filter was relaxed because it would have left no candidate.
    #[getter]
    fn relaxed_filters(&self) -> bool {
        self.inner.relaxed_filters
    }

    /// The judgment used.
    #[getter]
    fn judgment(&self) -> Judgment {
        let j = &self.inner.judgment;
        Judgment {
            horizon: j.horizon.as_str(),
            risk: j.risk,
            bypass_probability: j.bypass_probability,
            source: serde_name(&j.source),
        }
    }

    /// The transfer-tax estimate, when the disaggregation rule was evaluated.
    #[getter]
    fn transfer(&self) -> Option<TransferEstimate> {
        self.inner.transfer.map(|t| TransferEstimate {
            tokens: t.tokens,
            kv_bytes: t.kv_bytes,
            transfer_s: t.transfer_s,
            disaggregated_cost_s: t.disaggregated_cost_s,
            colocated_cost_s: t.colocated_cost_s,
            pays: t.pays,
        })
    }

    /// Every registered endpoint at decision time, in id order.
    #[getter]
    fn endpoints<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.inner.endpoints.iter().map(|e| &**e))
    }

    /// Score breakdowns: endpoint id → `EndpointScore`, in id order.
    #[getter]
    fn scores<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (e, s) in self.inner.breakdown() {
            d.set_item(e, EndpointScore::new(e, s))?;
        }
        Ok(d)
    }

    /// The score breakdown of one endpoint (`None` if it was not registered).
    fn score(&self, endpoint: &str) -> Option<EndpointScore> {
        self.inner.score(endpoint).map(|s| EndpointScore::new(endpoint, s))
    }

    /// The whole decision as plain data (the core's serde form).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        convert::to_py(py, &self.inner.to_json())
    }

    /// The whole decision as JSON text (the core's serde form).
    fn to_json(&self) -> String {
        self.inner.to_json().to_string()
    }

    fn __repr__(&self) -> String {
        let d = &self.inner;
        format!(
            "Decision(request_id={}, rule={}, mode={}, endpoint={}, prefill_endpoint={}, prefix_hit={:?}, policy_version={})",
            repr_str(&d.request_id),
            repr_str(d.rule.as_str()),
            repr_opt(d.mode().map(kvroute::Mode::as_str)),
            repr_opt(d.endpoint()),
            repr_opt(d.prefill_endpoint()),
            d.prefix_hit,
            d.policy_version
        )
    }
}

/// What applying one KV-event batch did.
#[pyclass(frozen, get_all, module = "kvroute", name = "ApplyOutcome")]
pub(crate) struct ApplyOutcome {
    /// `"applied"`, `"duplicate"`, `"gap"` or `"reset"` (applied and reset change the index; on
    /// a gap, replay from `expected - 1`, or from 0 when `expected` is 0, or call
    /// `resync_stream`, then resubmit; a gap from 0 is a restarted engine whose first batches
    /// were missed: the endpoint was already cleared).
    verdict: String,
    /// First missing sequence number (gap only).
    expected: Option<u64>,
    /// Sequence number received (gap only).
    got: Option<u64>,
    /// Events applied.
    events: u32,
    /// Blocks stored or removed.
    blocks: u64,
}

impl ApplyOutcome {
    pub(crate) fn new(o: &kvroute::ApplyOutcome) -> Self {
        let (verdict, expected, got) = match o.verdict {
            kvroute::StreamVerdict::Gap { expected, got } => ("gap".to_owned(), Some(expected), Some(got)),
            v => {
                // The verdict's serde form is `{"verdict": "applied"}`.
                let name = serde_json::to_value(v)
                    .ok()
                    .and_then(|x| x.get("verdict").and_then(|s| s.as_str().map(str::to_owned)))
                    .unwrap_or_default();
                (name, None, None)
            }
        };
        ApplyOutcome { verdict, expected, got, events: o.events, blocks: o.blocks }
    }
}

#[pymethods]
impl ApplyOutcome {
    fn __repr__(&self) -> String {
        let gap = match (self.expected, self.got) {
            (Some(e), Some(g)) => format!(", expected={e}, got={g}"),
            _ => String::new(),
        };
        format!(
            "ApplyOutcome(verdict={}{gap}, events={}, blocks={})",
            repr_str(&self.verdict),
            self.events,
            self.blocks
        )
    }
}
