//! `Router`: the core router, shared by every Python thread.
//!
//! The pyclass is `frozen` and holds an `Arc<kvroute::Router>` (`Send + Sync`), so methods take
//! `&self` with no borrow flag and no lock of the binding's own: the core's own synchronization
//! (an `ArcSwap` policy cell and one state mutex) is all there is. Each method converts its
//! arguments while holding the GIL, then makes its core call inside `Python::detach`, so other
//! Python threads run meanwhile, then converts the result back.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

use kvroute::{EndpointSpec, MetricsSnapshot, Role};

use crate::convert::{self, now_or_clock};
use crate::decision::{ApplyOutcome, Decision};
use crate::errors;
use crate::policy::Policy;
use crate::subscription::Subscription;

fn role(s: &str) -> PyResult<Role> {
    match s {
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        "both" => Ok(Role::Both),
        other => Err(PyValueError::new_err(format!("role must be \"prefill\", \"decode\" or \"both\", not {other:?}"))),
    }
}

/// A KV-cache-aware router: endpoint table, prefix indexes, in-flight tracking and the policy.
///
/// `Router(config=None)`: `config` is a dict, JSON or YAML text, a path (`os.PathLike`) to a
/// JSON or YAML file, or a `Policy`; `None` means the default policy. Thread-safe: share one
/// router between threads; every call releases the GIL while the core works.
///
/// Every `now` argument is milliseconds on the router's clock and defaults to `now_ms()` (UNIX
/// milliseconds), the clock the ZMQ subscriber uses too.
#[pyclass(frozen, module = "kvroute", name = "Router")]
pub(crate) struct Router {
    pub(crate) inner: Arc<kvroute::Router>,
}

#[pymethods]
impl Router {
    #[new]
    #[pyo3(signature = (config = None))]
    fn new(py: Python<'_>, config: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let policy = convert::policy(py, config)?;
        Ok(Router { inner: Arc::new(kvroute::Router::new(policy)) })
    }

    /// Replace the policy atomically and return its version. `config` is what `Router()`
    /// accepts. On error (`ConfigError`, naming the field) the old policy keeps serving.
    fn reload(&self, py: Python<'_>, config: &Bound<'_, PyAny>) -> PyResult<u64> {
        if config.is_none() {
            return Err(PyTypeError::new_err(
                "config must be a dict, JSON or YAML text (str), a path (os.PathLike) or a Policy, not NoneType",
            ));
        }
        let source = convert::config_source(Some(config))?;
        if let convert::ConfigSource::Policy(p) = source {
            return Ok(py.detach(|| self.inner.reload(*p)));
        }
        // Documents go through `reload_str`, so the core counts rejected ones.
        let text = source.text(py)?.unwrap_or_default();
        py.detach(|| self.inner.reload_str(text)).map_err(|e| errors::config(py, &e))
    }

    /// The active policy.
    #[getter]
    fn policy(&self) -> Policy {
        Policy { inner: self.inner.policy().policy.clone() }
    }

    /// The active policy's version (1 at construction, +1 per successful reload).
    #[getter]
    fn policy_version(&self) -> u64 {
        self.inner.policy().version
    }

    /// Register an endpoint (`ip:port`) with role `"prefill"`, `"decode"` or `"both"`, or change
    /// the role of a registered one.
    #[pyo3(signature = (endpoint, role = "decode"))]
    fn upsert_endpoint(&self, py: Python<'_>, endpoint: &str, role: &str) -> PyResult<()> {
        let spec = EndpointSpec::new(endpoint, self::role(role)?);
        py.detach(|| self.inner.upsert_endpoint(spec)).map_err(|e| errors::state(py, &e))
    }

    /// Remove an endpoint (its index entries and in-flight requests are forgotten).
    fn remove_endpoint(&self, py: Python<'_>, endpoint: &str) -> PyResult<()> {
        py.detach(|| self.inner.remove_endpoint(endpoint)).map_err(|e| errors::state(py, &e))
    }

    /// Mark an endpoint healthy or not (unhealthy endpoints are never picked).
    fn set_healthy(&self, py: Python<'_>, endpoint: &str, healthy: bool) -> PyResult<()> {
        py.detach(|| self.inner.set_healthy(endpoint, healthy)).map_err(|e| errors::state(py, &e))
    }

    /// Store a metrics snapshot of an endpoint taken at `now`.
    #[pyo3(signature = (
        endpoint, *, waiting, running, kv_usage, lora_running = Vec::new(), lora_waiting = Vec::new(),
        max_lora = None, kv_capacity_tokens = None, now = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn update_metrics(
        &self,
        py: Python<'_>,
        endpoint: &str,
        waiting: u32,
        running: u32,
        kv_usage: f64,
        lora_running: Vec<String>,
        lora_waiting: Vec<String>,
        max_lora: Option<u32>,
        kv_capacity_tokens: Option<u64>,
        now: Option<u64>,
    ) -> PyResult<()> {
        let m = MetricsSnapshot {
            waiting,
            running,
            kv_usage,
            lora_running,
            lora_waiting,
            max_lora,
            kv_capacity_tokens,
            updated_ms: now_or_clock(now),
        };
        py.detach(|| self.inner.update_metrics(endpoint, m)).map_err(|e| errors::state(py, &e))
    }

    /// Read an endpoint's `/metrics` page (vLLM or SGLang Prometheus text, scraped at `now`),
    /// store the snapshot and return it as a dict. Raises `MetricsError` (naming the line) or
    /// `StateError`; a page that cannot be read changes nothing.
    #[pyo3(signature = (endpoint, text, *, now = None))]
    fn update_metrics_from_prometheus<'py>(
        &self,
        py: Python<'py>,
        endpoint: &str,
        text: &str,
        now: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let now = now_or_clock(now);
        match py.detach(|| self.inner.update_metrics_from_prometheus(endpoint, text, now)) {
            Ok(m) => convert::serde_to_py(py, &m),
            Err(e) => Err(errors::metrics(py, &e)),
        }
    }

    /// Route one HTTP request. `body`: bytes, str or a dict (sent as JSON); `headers`: a mapping
    /// or an iterable of `(name, value)` pairs (str or UTF-8 bytes, as in an ASGI scope).
    /// Raises `RequestError` (naming the field or header), `NoEndpointsError`.
    #[pyo3(signature = (body, headers = None, *, now = None))]
    fn route(
        &self,
        py: Python<'_>,
        body: &Bound<'_, PyAny>,
        headers: Option<&Bound<'_, PyAny>>,
        now: Option<u64>,
    ) -> PyResult<Decision> {
        let body = convert::body(body)?;
        let body = body.as_slice()?;
        let held = convert::headers(headers)?;
        let mut pairs = Vec::with_capacity(held.len());
        for (k, v) in &held {
            pairs.push((k.as_str()?, v.as_str()?));
        }
        let now = now_or_clock(now);
        match py.detach(|| self.inner.route_http(body, pairs.iter().copied(), now)) {
            Ok(d) => Ok(Decision { inner: d }),
            Err(e) => Err(errors::route(py, &e)),
        }
    }

    /// The request finished: release its in-flight counters. Raises `StateError` (kind
    /// `"unknown_request"`) if it is not in flight.
    fn complete(&self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        py.detach(|| self.inner.complete(request_id)).map_err(|e| errors::state(py, &e))
    }

    /// Decode one KV-event payload (msgpack, as vLLM or SGLang publishes it) from `endpoint`'s
    /// engine and apply it. `seq` is the publisher's sequence number, when known. Raises
    /// `EventError` (with the byte `offset`) for a malformed payload, which changes nothing.
    #[pyo3(signature = (endpoint, payload, seq = None, *, now = None))]
    fn apply_events(
        &self,
        py: Python<'_>,
        endpoint: &str,
        payload: &Bound<'_, PyAny>,
        seq: Option<u64>,
        now: Option<u64>,
    ) -> PyResult<ApplyOutcome> {
        let payload = convert::payload(payload, "payload")?;
        let bytes = payload.as_slice()?;
        let now = now_or_clock(now);
        match py.detach(|| self.inner.apply_events(endpoint, bytes, seq, now)) {
            Ok(o) => Ok(ApplyOutcome::new(&o)),
            Err(e) => Err(errors::event_ingest(py, &e)),
        }
    }

    /// Give up on `endpoint`'s gapped event stream: its precise entries are cleared and its next
    /// batch is accepted as a fresh start.
    #[pyo3(signature = (endpoint, *, now = None))]
    fn resync_stream(&self, py: Python<'_>, endpoint: &str, now: Option<u64>) -> PyResult<()> {
        let now = now_or_clock(now);
        py.detach(|| self.inner.resync_stream(endpoint, now)).map_err(|e| errors::state(py, &e))
    }

    /// Subscribe `endpoint` (an `ip:port` the router knows) to its engine's KV-event stream at
    /// `zmq_endpoint` on a native background thread (no Python involved per batch). `replay` is
    /// the publisher's replay endpoint; `mode` is `"auto"` (bind on a wildcard host, else
    /// connect, like vLLM), `"bind"` or `"connect"`. `replay_timeout_ms` (default 1000) bounds a
    /// replay; `poll_interval_ms` (default 100) bounds how long `stop()` takes. Returns once the
    /// socket is up; raises `SubscribeError`.
    #[pyo3(signature = (
        endpoint, zmq_endpoint, *, topic = "", replay = None, mode = "auto", replay_timeout_ms = None,
        poll_interval_ms = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn subscribe(
        &self,
        py: Python<'_>,
        endpoint: &str,
        zmq_endpoint: &str,
        topic: &str,
        replay: Option<String>,
        mode: &str,
        replay_timeout_ms: Option<u64>,
        poll_interval_ms: Option<u64>,
    ) -> PyResult<Subscription> {
        use kvroute::{SocketMode, SubscriberConfig};
        let mode = match mode {
            "auto" => SocketMode::Auto,
            "bind" => SocketMode::Bind,
            "connect" => SocketMode::Connect,
            other => {
                return Err(PyValueError::new_err(format!(
                    "mode must be \"auto\", \"bind\" or \"connect\", not {other:?}"
                )))
            }
        };
        let mut cfg = SubscriberConfig::new(zmq_endpoint);
        cfg.topic = topic.to_owned();
        cfg.replay_endpoint = replay;
        cfg.mode = mode;
        cfg.replay_timeout_ms = replay_timeout_ms.unwrap_or(cfg.replay_timeout_ms);
        cfg.poll_interval_ms = poll_interval_ms.unwrap_or(cfg.poll_interval_ms);
        let router = self.inner.clone();
        let started = py.detach(|| kvroute::Subscription::start(router, endpoint, cfg, kvroute::unix_clock()));
        match started {
            Ok(s) => Ok(Subscription::new(s)),
            Err(e) => Err(errors::subscribe(py, &e)),
        }
    }

    /// Tokenize text and chat requests with a Hugging Face tokenizer for the precise index:
    /// `path` is a model directory (`tokenizer.json`, plus its chat template and tokenizer config
    /// when present) or a `tokenizer.json` file; `None` removes the tokenizer. Raises
    /// `TokenizerError`.
    fn set_tokenizer(&self, py: Python<'_>, path: Option<PathBuf>) -> PyResult<()> {
        use kvroute::{PrefixCacheConfig, Tokenizer};
        let Some(path) = path else {
            py.detach(|| self.inner.set_tokenizer(None));
            return Ok(());
        };
        let loaded = py.detach(|| {
            let t = if path.is_dir() { Tokenizer::from_dir(&path) } else { Tokenizer::from_file(&path) }?;
            let t = Arc::new(t.with_prefix_cache(PrefixCacheConfig::default()));
            self.inner.set_tokenizer(Some(t));
            Ok(())
        });
        loaded.map_err(|e| errors::tokenize(py, &e))
    }

    /// Sizes and counters: a dict with `policy_version`, `endpoints`, `inflight_requests`,
    /// `index`, `precise` and `counters`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let s = py.detach(|| self.inner.stats());
        convert::serde_to_py(py, &s)
    }

    /// Every endpoint, in id order, as dicts (`id`, `role`, `healthy`, `metrics`, `inflight`,
    /// `index_memberships`, `precise_memberships`, `events_healthy`).
    fn endpoints<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let eps = py.detach(|| self.inner.endpoints());
        let list = PyList::empty(py);
        for e in &eps {
            list.append(convert::serde_to_py(py, e)?)?;
        }
        Ok(list)
    }

    /// Where to send a request that could not be routed (a `RequestError`, a gateway's own
    /// failure), so traffic keeps flowing: the least-loaded endpoint, preferring healthy
    /// decode-capable ones. Not a decision: nothing is recorded. `None` without endpoints.
    fn fail_open_endpoint(&self, py: Python<'_>) -> Option<String> {
        py.detach(|| self.inner.fail_open_endpoint()).map(|e| e.to_string())
    }

    /// The router's own metrics in Prometheus text exposition format (decisions by mode and
    /// rule, prefix-hit histogram, index sizes, event-stream health, lag and replays, reloads).
    #[pyo3(signature = (*, now = None))]
    fn metrics_text(&self, py: Python<'_>, now: Option<u64>) -> String {
        let now = now_or_clock(now);
        py.detach(|| self.inner.metrics_text(now))
    }

    /// Count a replay attempt of `endpoint`'s event stream (`ok`: it recovered the gap) for
    /// `metrics_text`, when the events come from a subscriber of your own; `subscribe()` counts
    /// its replays itself.
    fn record_replay(&self, py: Python<'_>, endpoint: &str, ok: bool) -> PyResult<()> {
        py.detach(|| self.inner.record_replay(endpoint, ok)).map_err(|e| errors::state(py, &e))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let s = py.detach(|| self.inner.stats());
        format!(
            "Router(policy_version={}, endpoints={}, inflight_requests={})",
            s.policy_version, s.endpoints, s.inflight_requests
        )
    }
}
