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
use pyo3::types::{PyDict, PyList, PyString};

use kvroute::{EndpointSpec, MetricsSnapshot, Role};

use crate::convert::{self, now_or_clock};
use crate::decision::{ApplyOutcome, Decision};
use crate::errors;
use crate::flow::{Admission, FlowHold, Release, MODE_AWAIT, MODE_TICKETS};
use crate::policy::Policy;
use crate::replication::Replication;
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
/// milliseconds), the clock the ZMQ subscriber uses too. `flow_clock` (a callable returning
/// milliseconds, default `now_ms`) is the clock `await admit()` uses for the dispatch
/// opportunities it makes itself and for its timer.
#[pyclass(frozen, weakref, module = "kvroute", name = "Router")]
pub(crate) struct Router {
    pub(crate) inner: Arc<kvroute::Router>,
    /// Flow control on the Python side: how the router is driven, the dispatcher of `admit`.
    flow: FlowHold,
}

#[pymethods]
impl Router {
    #[new]
    #[pyo3(signature = (config = None, *, flow_clock = None))]
    fn new(py: Python<'_>, config: Option<&Bound<'_, PyAny>>, flow_clock: Option<Bound<'_, PyAny>>) -> PyResult<Self> {
        let flow_clock = flow_clock.filter(|c| !c.is_none());
        if let Some(c) = &flow_clock {
            if !c.is_callable() {
                return Err(PyTypeError::new_err(format!(
                    "flow_clock must be a callable returning milliseconds, not {}",
                    convert::type_name(c)
                )));
            }
        }
        let policy = convert::policy(py, config)?;
        Ok(Router { inner: Arc::new(kvroute::Router::new(policy)), flow: FlowHold::new(flow_clock.map(Bound::unbind)) })
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
        let version = if let convert::ConfigSource::Policy(p) = source {
            py.detach(|| self.inner.reload(*p))
        } else {
            // Documents go through `reload_str`, so the core counts rejected ones.
            let text = source.text(py)?.unwrap_or_default();
            py.detach(|| self.inner.reload_str(text)).map_err(|e| errors::config(py, &e))?
        };
        self.flow.opportunity(py, None);
        Ok(version)
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
        py.detach(|| self.inner.upsert_endpoint(spec)).map_err(|e| errors::state(py, &e))?;
        self.flow.opportunity(py, None);
        Ok(())
    }

    /// Remove an endpoint (its index entries and in-flight requests are forgotten).
    fn remove_endpoint(&self, py: Python<'_>, endpoint: &str) -> PyResult<()> {
        py.detach(|| self.inner.remove_endpoint(endpoint)).map_err(|e| errors::state(py, &e))?;
        self.flow.opportunity(py, None);
        Ok(())
    }

    /// Mark an endpoint healthy or not (unhealthy endpoints are never picked).
    fn set_healthy(&self, py: Python<'_>, endpoint: &str, healthy: bool) -> PyResult<()> {
        py.detach(|| self.inner.set_healthy(endpoint, healthy)).map_err(|e| errors::state(py, &e))?;
        self.flow.opportunity(py, None);
        Ok(())
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
        py.detach(|| self.inner.update_metrics(endpoint, m)).map_err(|e| errors::state(py, &e))?;
        self.flow.opportunity(py, now);
        Ok(())
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
        let at = now_or_clock(now);
        match py.detach(|| self.inner.update_metrics_from_prometheus(endpoint, text, at)) {
            Ok(m) => {
                self.flow.opportunity(py, now);
                convert::serde_to_py(py, &m)
            }
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
    ///
    /// Under `await admit()`, this and every other change that may free capacity (metrics
    /// updates, endpoint changes, `reload`, `tick`, `shutdown_queue`) is a dispatch
    /// opportunity: the futures of the admissions it releases are resolved before it returns
    /// (scheduled on their own event loop when called from another thread).
    fn complete(&self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        py.detach(|| self.inner.complete(request_id)).map_err(|e| errors::state(py, &e))?;
        self.flow.opportunity(py, None);
        Ok(())
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

    /// Join this router's fleet over NATS: a native background thread publishes this router's
    /// routing effects and completions and applies the other replicas' (their requests in flight
    /// and the prefixes they routed), with no Python on the way. Returns a running
    /// `Replication` (stop it with `stop()`, a `with` block, or by dropping it).
    ///
    /// `options`: a dict or JSON text, the core's `NatsReplicaOptions`: `replica_id` (required,
    /// `[A-Za-z0-9_-]`, unique in the fleet), `url` (default `nats://127.0.0.1:4222`), `fleet`,
    /// `token` / `user` + `password` / `nkey_seed`, `tls_required`, `tls_ca_file`,
    /// `tls_cert_file`, `tls_key_file`, `stream` (a dict, or None for core NATS only),
    /// `allowed_replicas`, `epoch` and the timers and bounds (`flush_interval_ms`,
    /// `heartbeat_interval_ms`, `peer_silence_ms`, `max_outbox_entries`, `max_batch_entries`,
    /// `max_batch_bytes`, `connect_timeout_ms`, `max_reconnect_delay_ms`). Unknown keys are
    /// errors.
    ///
    /// An unreachable server or refused credentials are no error: the thread keeps trying (see
    /// `stats()["connected"]`, `["server_errors"]`, `["last_error"]`). Replicated requests are
    /// stamped with `now_ms()`: route with that clock. Raises `ReplicationConfigError` (a
    /// `ConfigError` and a `ReplicationError`; `field` names the setting, `"options"` when the
    /// document does not parse), `ReplicationError` (kind `"already_replicating"`: stop the
    /// running replication first; `"transport"`: the client could not start), `TypeError`.
    fn replicate(&self, py: Python<'_>, options: &Bound<'_, PyAny>) -> PyResult<Replication> {
        let text = if let Ok(s) = options.cast::<PyString>() {
            s.to_str()?.to_owned()
        } else if options.is_instance_of::<PyDict>() {
            convert::json_dumps(options)?.to_str()?.to_owned()
        } else {
            return Err(PyTypeError::new_err(format!(
                "options must be a dict or JSON text (str), not {}",
                convert::type_name(options)
            )));
        };
        let opts = py.detach(|| kvroute::NatsReplicaOptions::from_json(&text)).map_err(|e| errors::replica(py, &e))?;
        let (id, fleet) = (opts.replica_id.clone(), opts.fleet.clone());
        let router = self.inner.clone();
        match py.detach(|| kvroute::Replicator::start(router, opts)) {
            Ok(r) => Ok(Replication::new(r, id, fleet)),
            Err(e) => Err(errors::replica(py, &e)),
        }
    }

    /// The router's replication counters (a dict: `replica_id`, `epoch`, `batches_out`,
    /// `entries_out`, `outbox_len`, `batches_in`, `effects_applied`, `completions_applied`,
    /// `malformed`, `unknown_replica`, `duplicates`, `gaps`, `peers`, ...), or None when it does
    /// not replicate (never started, or stopped).
    fn replica_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        match py.detach(|| self.inner.replica_stats()) {
            Some(s) => convert::serde_to_py(py, &s).map(Some),
            None => Ok(None),
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

    // ----------------------------------------------------------------------------------------
    // flow control (the call protocol is documented on `kvroute::Admission`)
    // ----------------------------------------------------------------------------------------

    /// Wait until flow control lets this request be routed (then call `route` as without flow
    /// control): an awaitable of `Admitted`, which raises `RejectedError` (`status`, `reason`,
    /// `headers`) when the request is refused or dropped, `RequestError` for a request that
    /// cannot be parsed. Cancelling the awaiting task (a client that went away) removes its
    /// request from the queue. With flow control off it admits at once. The router then takes
    /// its releases itself: `enqueue`, `take_releases` and `cancel` raise `RuntimeError`.
    #[pyo3(signature = (body, headers = None, *, now = None))]
    fn admit<'py>(
        slf: &Bound<'py, Self>,
        body: &Bound<'py, PyAny>,
        headers: Option<&Bound<'py, PyAny>>,
        now: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let me = slf.get();
        me.flow.claim(MODE_AWAIT)?;
        let dispatcher = me.flow.dispatcher_or_init(slf.as_any())?;
        dispatcher.call_method1("admit", (slf, body, headers, now))
    }

    /// Flow control's answer for a request about to be routed (the ticket API): `"admit"`
    /// (route it now), `"queued"` (hold it until `take_releases` returns its ticket) or
    /// `"rejected"` (answer with the rejection). Raises `RequestError`; `RuntimeError` on a
    /// router driven by `await admit()`.
    #[pyo3(signature = (body, headers = None, *, now = None))]
    fn enqueue(
        &self,
        py: Python<'_>,
        body: &Bound<'_, PyAny>,
        headers: Option<&Bound<'_, PyAny>>,
        now: Option<u64>,
    ) -> PyResult<Admission> {
        self.flow.claim(MODE_TICKETS)?;
        self.admit_now(py, body, headers, now_or_clock(now))
    }

    /// `enqueue` for the dispatcher of `admit` (no mode check; `now` given).
    fn _enqueue(
        &self,
        py: Python<'_>,
        body: &Bound<'_, PyAny>,
        headers: Option<&Bound<'_, PyAny>>,
        now: u64,
    ) -> PyResult<Admission> {
        self.admit_now(py, body, headers, now)
    }

    /// A dispatch opportunity at `now`, then every release made since the last call, in order:
    /// each ends one ticket (route its request, or answer with its rejection). Call it after
    /// completions, metrics updates, endpoint changes and reloads, and when
    /// `next_flow_deadline()` comes. `RuntimeError` on a router driven by `await admit()`.
    #[pyo3(signature = (*, now = None))]
    fn take_releases(&self, py: Python<'_>, now: Option<u64>) -> PyResult<Vec<Release>> {
        self.flow.claim(MODE_TICKETS)?;
        Ok(self.releases(py, now_or_clock(now)))
    }

    /// `take_releases` for the dispatcher of `admit`.
    fn _take_releases(&self, py: Python<'_>, now: u64) -> Vec<Release> {
        self.releases(py, now)
    }

    /// The client of a held request went away: remove its ticket. True when it was held
    /// (queued, or released and not yet taken: it then never appears in a release); false for
    /// a ticket already ended or never issued. `RuntimeError` on a router driven by
    /// `await admit()` (cancel the awaiting task instead).
    fn cancel(&self, py: Python<'_>, ticket: u64) -> PyResult<bool> {
        self.flow.claim(MODE_TICKETS)?;
        Ok(py.detach(|| self.inner.cancel(kvroute::Ticket(ticket))))
    }

    /// `cancel` for the dispatcher of `admit`.
    fn _cancel(&self, py: Python<'_>, ticket: u64) -> bool {
        py.detach(|| self.inner.cancel(kvroute::Ticket(ticket)))
    }

    /// A dispatch opportunity at `now` with no other event: expire requests past their TTL and
    /// release what the pool has room for. With tickets, the releases wait for
    /// `take_releases`; under `await admit()` they go to their waiters at once.
    #[pyo3(signature = (*, now = None))]
    fn tick(&self, py: Python<'_>, now: Option<u64>) {
        if self.flow.awaitable() {
            self.flow.opportunity(py, now);
        } else {
            let now = now_or_clock(now);
            py.detach(|| self.inner.tick(now));
        }
    }

    /// Drop every queued request with 503 `rejected-shutting-down` and refuse later admissions
    /// the same way (for a router about to stop). Under `await admit()` the waiting admissions
    /// raise `RejectedError` at once.
    fn shutdown_queue(&self, py: Python<'_>) {
        py.detach(|| self.inner.shutdown_queue());
        self.flow.opportunity(py, None);
    }

    /// When flow control would next act on its own (a queue TTL, the no-endpoint TTL, a
    /// release's load lapsing), milliseconds on the router's clock; `None` when nothing is
    /// queued or flow control is off. May be early, never late.
    fn next_flow_deadline(&self, py: Python<'_>) -> Option<u64> {
        py.detach(|| self.inner.next_flow_deadline())
    }

    /// Flow control's queues and counters: a dict with `enabled`, `queued`, `queued_bytes`,
    /// `releases_waiting`, `pending_dispatch`, `shutting_down`, `bands` (highest priority
    /// first) and `counters`.
    fn flow_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let s = py.detach(|| self.inner.flow_stats());
        convert::serde_to_py(py, &s)
    }

    /// The pool's saturation at `now` as flow control measures it: a dict with `pool`,
    /// `decode`, `prefill` (`None` without a prefill pool) and `decode_endpoints`.
    #[pyo3(signature = (*, now = None))]
    fn flow_saturation<'py>(&self, py: Python<'py>, now: Option<u64>) -> PyResult<Bound<'py, PyAny>> {
        let now = now_or_clock(now);
        let s = py.detach(|| self.inner.flow_saturation(now));
        convert::serde_to_py(py, &s)
    }

    /// The dispatcher of `await admit()` (`kvroute._flow.Dispatcher`), `None` before the
    /// first `admit` (for tests and diagnostics).
    #[getter]
    fn _flow_dispatcher(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.flow.dispatcher(py).map(|d| d.clone_ref(py))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let s = py.detach(|| self.inner.stats());
        format!(
            "Router(policy_version={}, endpoints={}, inflight_requests={})",
            s.policy_version, s.endpoints, s.inflight_requests
        )
    }
}

impl Router {
    /// `admit_http` of one request at `now` (parsed while holding the GIL's references, decided
    /// with the GIL released).
    fn admit_now(
        &self,
        py: Python<'_>,
        body: &Bound<'_, PyAny>,
        headers: Option<&Bound<'_, PyAny>>,
        now: u64,
    ) -> PyResult<Admission> {
        let body = convert::body(body)?;
        let body = body.as_slice()?;
        let held = convert::headers(headers)?;
        let mut pairs = Vec::with_capacity(held.len());
        for (k, v) in &held {
            pairs.push((k.as_str()?, v.as_str()?));
        }
        match py.detach(|| self.inner.admit_http(body, pairs.iter().copied(), now)) {
            Ok(a) => Ok(Admission::new(&a)),
            Err(e) => Err(errors::request(py, &e)),
        }
    }

    /// A dispatch opportunity at `now` and the releases since the last one.
    fn releases(&self, py: Python<'_>, now: u64) -> Vec<Release> {
        let taken = py.detach(|| self.inner.take_releases(now));
        taken.iter().map(Release::new).collect()
    }
}
