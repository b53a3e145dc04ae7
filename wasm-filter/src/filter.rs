//! The proxy-wasm glue (wasm32 only): the root context owns the router, the shared log and the
//! metric poller; HTTP contexts hold only their request's state.
//!
//! Host calls go through `crate::host` (imported as `hostcalls`), whose wrappers return every
//! status as a `Result`: a failed call is handled (the request fails open, the failure is logged
//! and counted), never a trap. Request headers are only ever changed while the request is
//! paused (in the headers callback, or in a body/trailers callback after headers returned
//! `Pause`): changing them after headers continued fails.

use std::cell::Cell;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use crate::host as hostcalls;
use crate::host::{
    Action, BufferType, Context, ContextType, HttpContext, LogLevel, MapType, MetricType, RootContext, Status,
};
use kvroute::{
    EndpointSpec, EventIngestError, MetricsSnapshot, RequestError, RouteError, RouterCore, RoutingEffect, StateError,
    HEADER_DESTINATION,
};

use crate::config::{
    path_only, PluginConfig, HEADER_DECISION, HEADER_FALLBACK, HEADER_STATS_SECRET, KVROUTE_HEADER_PREFIX,
    ROUTING_HEADERS,
};
use crate::counters::{Counter, Counters};
use crate::ingest::{self, EventPost, PostKind};
use crate::sync::{self, Entry, SharedLog, SharedStore, StoreError, VerdictCode};

fn log(level: LogLevel, msg: &str) {
    let _ = hostcalls::log(level, msg);
}

std::thread_local! {
    /// The last time the host told (the clock when it refuses to).
    static LAST_NOW_MS: Cell<u64> = const { Cell::new(0) };
}

/// The host's clock in ms; when the host refuses the call, the last time it told.
fn now_ms() -> u64 {
    let last = LAST_NOW_MS.try_with(Cell::get).unwrap_or(0);
    match hostcalls::get_current_time_ns() {
        Ok(ns) => {
            let ms = ns / 1_000_000;
            let _ = LAST_NOW_MS.try_with(|c| c.set(ms));
            ms
        }
        Err(_) => last,
    }
}

/// proxy-wasm shared data.
struct HostStore;

impl SharedStore for HostStore {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        hostcalls::get_shared_data(key).map_err(|s| StoreError::Host(format!("get {key}: {s:?}")))
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(s) => Err(StoreError::Host(format!("set {key}: {s:?}"))),
        }
    }
}

/// The router and everything that lives as long as a valid configuration.
struct Active {
    router: RouterCore,
    cfg: Rc<PluginConfig>,
    log: SharedLog,
    /// Metric callouts in flight: token → (endpoint, dispatched at).
    polls: BTreeMap<u32, (String, u64)>,
    next_poll_ms: u64,
    /// Event-post signatures this VM accepted within the timestamp window (replays are refused).
    recent_signatures: ingest::RecentSignatures,
}

/// State shared by the root context and the HTTP contexts of one plugin instance in one VM.
struct Shared {
    active: RefCell<Option<Active>>,
    counters: RefCell<Counters>,
    metric_ids: RefCell<Option<Vec<u32>>>,
    /// Increments not yet added to Envoy's counters (flushed on tick and on the stats page, so
    /// a request costs no metric host call).
    unflushed: RefCell<[u64; Counter::ALL.len()]>,
    instance: std::cell::Cell<u64>,
}

impl Shared {
    fn bump(&self, c: Counter) {
        if let Ok(mut k) = self.counters.try_borrow_mut() {
            k.bump(c);
        }
        if let Ok(mut u) = self.unflushed.try_borrow_mut() {
            if let Some(n) = u.get_mut(c as usize) {
                *n += 1;
            }
        }
    }

    /// Add the increments since the last flush to Envoy's counters.
    fn flush_metrics(&self) {
        let (Ok(ids), Ok(mut unflushed)) = (self.metric_ids.try_borrow(), self.unflushed.try_borrow_mut()) else {
            return;
        };
        let Some(ids) = ids.as_ref() else { return };
        for (id, n) in ids.iter().zip(unflushed.iter_mut()) {
            // Kept when the host refuses them: added at a later flush.
            if *n > 0 && hostcalls::increment_metric(*id, i64::try_from(*n).unwrap_or(i64::MAX)).is_ok() {
                *n = 0;
            }
        }
    }

    fn define_metrics(&self) {
        let Ok(mut ids) = self.metric_ids.try_borrow_mut() else { return };
        if ids.is_some() {
            return;
        }
        let mut out = Vec::with_capacity(Counter::ALL.len());
        for c in Counter::ALL {
            match hostcalls::define_metric(MetricType::Counter, c.name()) {
                Ok(id) => out.push(id),
                Err(s) => {
                    // Defined again at the next configuration; the stats page counts meanwhile.
                    log(LogLevel::Warn, &format!("kvroute: defining metric {}: {s:?}", c.name()));
                    return;
                }
            }
        }
        *ids = Some(out);
    }
}

impl Active {
    /// Apply the entries other VMs appended since the last call.
    fn sync(&mut self, shared: &Shared, now: u64) {
        let router = &mut self.router;
        let mut errors = 0u32;
        let mut divergences = 0u32;
        let r = self.log.poll(&mut HostStore, now, |origin, entry| match apply_entry(router, origin, entry) {
            Ok(false) => {}
            Ok(true) => divergences += 1,
            Err(e) => {
                errors += 1;
                log(LogLevel::Debug, &format!("kvroute: shared log entry of instance {origin} not applied: {e}"));
            }
        });
        if let Err(e) = r {
            errors += 1;
            log(LogLevel::Warn, &format!("kvroute: reading the shared log failed: {e}"));
        }
        for _ in 0..errors {
            shared.bump(Counter::SyncErrors);
        }
        for _ in 0..divergences {
            shared.bump(Counter::SyncDivergences);
        }
    }

    fn append(&mut self, shared: &Shared, entry: &Entry<'_>) {
        if let Err(e) = self.log.append(&mut HostStore, entry) {
            shared.bump(Counter::SyncErrors);
            log(LogLevel::Warn, &format!("kvroute: appending to the shared log failed: {e}"));
        }
    }
}

/// Apply one entry of another instance. `Ok(true)`: an event batch was judged differently here
/// than by its writer (this VM missed entries), so the stream was resynced and the batch applied.
fn apply_entry(router: &mut RouterCore, origin: u64, entry: Entry<'_>) -> Result<bool, String> {
    match entry {
        Entry::Effect(bytes) => {
            let mut e = RoutingEffect::decode(bytes).map_err(|e| e.to_string())?;
            e.request_id = sync::mirror_request_id(origin, &e.request_id);
            router.apply_effect(&e).map_err(|e| e.to_string())?;
        }
        Entry::Complete(id) => match router.complete(&sync::mirror_request_id(origin, id)) {
            // Expired here already, or its effect was lost: nothing to release.
            Ok(()) | Err(StateError::UnknownRequest { .. }) => {}
            Err(e) => return Err(e.to_string()),
        },
        Entry::Metrics { endpoint, snapshot } => {
            let m: MetricsSnapshot = serde_json::from_slice(snapshot).map_err(|e| e.to_string())?;
            router.update_metrics(endpoint, m).map_err(|e| e.to_string())?;
        }
        Entry::Events { endpoint, seq, now_ms, verdict, payload } => {
            let out = router.apply_events(endpoint, payload, seq, now_ms).map_err(|e| e.to_string())?;
            let mine = VerdictCode::of(&out.verdict);
            if mine != verdict {
                if mine == VerdictCode::Gap && matches!(verdict, VerdictCode::Applied | VerdictCode::Reset) {
                    // This VM lost entries (an overrun): start the stream afresh here, as the
                    // writer's relay would after a gap.
                    router.resync_stream(endpoint, now_ms).map_err(|e| e.to_string())?;
                    router.apply_events(endpoint, payload, seq, now_ms).map_err(|e| e.to_string())?;
                }
                return Ok(true);
            }
        }
        Entry::Resync { endpoint, now_ms } => router.resync_stream(endpoint, now_ms).map_err(|e| e.to_string())?,
    }
    Ok(false)
}

/// The root context: configuration, router, shared log, ticks and metric polling.
///
/// Envoy gives every configuration (and every update) a *new* root context in the same VM, so
/// the state lives in a VM-wide registry keyed by the plugin's root id: a new root context for
/// the same root id takes over the router (its policy is swapped with the core's atomic reload,
/// index, in-flight requests and sessions are kept), and requests still in flight under the old
/// root context complete against the same router.
pub struct Root {
    shared: Rc<Shared>,
}

std::thread_local! {
    static REGISTRY: RefCell<BTreeMap<String, Rc<Shared>>> = const { RefCell::new(BTreeMap::new()) };
}

fn new_shared() -> Rc<Shared> {
    Rc::new(Shared {
        active: RefCell::new(None),
        counters: RefCell::new(Counters::default()),
        metric_ids: RefCell::new(None),
        unflushed: RefCell::new([0; Counter::ALL.len()]),
        instance: std::cell::Cell::new(0),
    })
}

impl Root {
    /// A root context with no configuration yet.
    pub fn new() -> Root {
        Root { shared: new_shared() }
    }

    /// Adopt the state of this root id in this VM (or register ours).
    fn adopt(&mut self) {
        let key = hostcalls::get_property(vec!["plugin_root_id"])
            .ok()
            .flatten()
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_default();
        let mine = self.shared.clone();
        let found =
            REGISTRY.try_with(|r| r.try_borrow_mut().ok().map(|mut m| m.entry(key).or_insert(mine).clone())).ok();
        if let Some(shared) = found.flatten() {
            self.shared = shared;
        }
    }

    fn configure(&mut self, cfg: PluginConfig) -> Result<(), String> {
        let cfg = Rc::new(cfg);
        let mut slot = self.shared.active.try_borrow_mut().map_err(|_| "state busy".to_owned())?;
        if self.shared.instance.get() == 0 {
            let id = sync::claim_instance(&mut HostStore).map_err(|e| format!("claiming an instance id: {e}"))?;
            self.shared.instance.set(id);
        }
        let instance = self.shared.instance.get();
        let now = now_ms();
        match slot.as_mut() {
            None => {
                let mut router = RouterCore::new(cfg.policy.clone());
                router.record_effects(true);
                sync_endpoints(&mut router, &cfg)?;
                let mut a = Active {
                    router,
                    log: SharedLog::new(&cfg.filter.sync.namespace, cfg.filter.sync.ring_entries, instance),
                    cfg: cfg.clone(),
                    polls: BTreeMap::new(),
                    next_poll_ms: 0,
                    recent_signatures: ingest::RecentSignatures::default(),
                };
                // Start from what the other VMs already know (the entries the ring retains).
                a.sync(&self.shared, now);
                *slot = Some(a);
            }
            Some(a) => {
                if a.router.policy().policy != cfg.policy {
                    let version = a.router.reload(cfg.policy.clone());
                    log(LogLevel::Info, &format!("kvroute: policy version {version} active"));
                }
                sync_endpoints(&mut a.router, &cfg)?;
                let (old, new) = (&a.cfg.filter.sync, &cfg.filter.sync);
                if old.namespace != new.namespace || old.ring_entries != new.ring_entries {
                    a.log = SharedLog::new(&new.namespace, new.ring_entries, instance);
                    a.sync(&self.shared, now);
                }
                a.cfg = cfg.clone();
                a.next_poll_ms = 0;
            }
        }
        drop(slot);
        if let Err(s) = hostcalls::set_tick_period(Duration::from_millis(cfg.filter.sync.tick_ms)) {
            // No ticks: requests, event posts and the stats page still sync the log; polling waits
            // for the next configuration.
            self.shared.bump(Counter::InternalErrors);
            log(LogLevel::Warn, &format!("kvroute: setting the tick period: {s:?}"));
        }
        Ok(())
    }

    fn poll_metrics(&self, now: u64) {
        let calls = {
            let Ok(mut slot) = self.shared.active.try_borrow_mut() else { return };
            let Some(a) = slot.as_mut() else { return };
            a.sync(&self.shared, now);
            let Some(m) = a.cfg.filter.metrics.clone() else { return };
            // A clock that went backwards restarts the schedule.
            let due = now >= a.next_poll_ms || a.next_poll_ms.saturating_sub(now) > m.interval_ms;
            if !due {
                return;
            }
            match a.log.try_lease(&mut HostStore, now, m.lease()) {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    self.shared.bump(Counter::SyncErrors);
                    log(LogLevel::Warn, &format!("kvroute: poller lease: {e}"));
                    return;
                }
            }
            a.next_poll_ms = now.saturating_add(m.interval_ms);
            // Forget callouts the host never answered.
            let stale = m.timeout().saturating_mul(2);
            a.polls.retain(|_, (_, at)| now.saturating_sub(*at) <= stale && *at <= now);
            let busy: Vec<&str> = a.polls.values().map(|(e, _)| e.as_str()).collect();
            let todo: Vec<String> = a
                .cfg
                .filter
                .endpoints
                .iter()
                .filter(|e| !busy.contains(&e.address.as_str()))
                .map(|e| e.address.clone())
                .collect();
            (m, todo)
        };
        let (m, todo) = calls;
        let mut tokens = Vec::with_capacity(todo.len());
        for ep in todo {
            let headers = vec![
                (":method", "GET"),
                (":path", m.path.as_str()),
                (":authority", ep.as_str()),
                (HEADER_DESTINATION, ep.as_str()),
                ("accept", "text/plain"),
            ];
            match hostcalls::dispatch_http_call(&m.cluster, headers, None, vec![], Duration::from_millis(m.timeout())) {
                Ok(token) => tokens.push((token, ep)),
                Err(s) => {
                    self.shared.bump(Counter::PollFailures);
                    log(LogLevel::Warn, &format!("kvroute: metrics callout to {ep} via {}: {s:?}", m.cluster));
                }
            }
        }
        if let Ok(mut slot) = self.shared.active.try_borrow_mut() {
            if let Some(a) = slot.as_mut() {
                for (t, ep) in tokens {
                    a.polls.insert(t, (ep, now));
                }
            }
        }
    }
}

impl Default for Root {
    fn default() -> Self {
        Root::new()
    }
}

/// Make the router's endpoint table match the configuration (removals first, so that a full
/// table can take new endpoints).
fn sync_endpoints(router: &mut RouterCore, cfg: &PluginConfig) -> Result<(), String> {
    let wanted: BTreeMap<&str, &crate::config::EndpointConfig> =
        cfg.filter.endpoints.iter().map(|e| (e.address.as_str(), e)).collect();
    let current = router.endpoints();
    for e in &current {
        if !wanted.contains_key(&*e.id) {
            router.remove_endpoint(&e.id).map_err(|x| x.to_string())?;
        }
    }
    for e in &cfg.filter.endpoints {
        let now = current.iter().find(|c| *c.id == *e.address);
        if now.is_none_or(|c| c.role != e.role) {
            router.upsert_endpoint(EndpointSpec::new(e.address.as_str(), e.role)).map_err(|x| x.to_string())?;
        }
        if now.is_none_or(|c| c.healthy != e.healthy) {
            router.set_healthy(&e.address, e.healthy).map_err(|x| x.to_string())?;
        }
    }
    Ok(())
}

impl Context for Root {
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        let now = now_ms();
        let status = if num_headers == 0 {
            None
        } else {
            hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
                .ok()
                .flatten()
                .and_then(|v| std::str::from_utf8(&v).ok().and_then(|s| s.parse::<u32>().ok()))
        };
        let body = if status == Some(200) {
            hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size).ok().flatten()
        } else {
            None
        };
        let Ok(mut slot) = self.shared.active.try_borrow_mut() else { return };
        let Some(a) = slot.as_mut() else { return };
        let Some((endpoint, _)) = a.polls.remove(&token_id) else { return };
        let Some(body) = body else {
            self.shared.bump(Counter::PollFailures);
            log(LogLevel::Debug, &format!("kvroute: metrics of {endpoint}: status {status:?}"));
            return;
        };
        let text = String::from_utf8_lossy(&body);
        match a.router.update_metrics_from_prometheus(&endpoint, &text, now) {
            Ok(m) => {
                self.shared.bump(Counter::Polls);
                match serde_json::to_vec(&m) {
                    Ok(json) => a.append(&self.shared, &Entry::Metrics { endpoint: &endpoint, snapshot: &json }),
                    Err(_) => self.shared.bump(Counter::InternalErrors),
                }
            }
            Err(e) => {
                self.shared.bump(Counter::PollFailures);
                log(LogLevel::Warn, &format!("kvroute: metrics of {endpoint} unreadable: {e}"));
            }
        }
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        true
    }

    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        self.adopt();
        self.shared.define_metrics();
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(b) => b.unwrap_or_default(),
            Err(s) => {
                log(LogLevel::Error, &format!("kvroute: cannot read the plugin configuration: {s:?}"));
                self.shared.bump(Counter::ConfigErrors);
                return false;
            }
        };
        let result = PluginConfig::parse(&bytes).map_err(|e| e.to_string()).and_then(|cfg| self.configure(cfg));
        let accepted = match result {
            Ok(()) => {
                self.shared.bump(Counter::Configurations);
                log(LogLevel::Info, &format!("kvroute: configured (instance {})", self.shared.instance.get()));
                true
            }
            Err(e) => {
                self.shared.bump(Counter::ConfigErrors);
                log(LogLevel::Error, &format!("kvroute: configuration rejected, the previous one stays: {e}"));
                false
            }
        };
        self.shared.flush_metrics();
        accepted
    }

    fn on_tick(&mut self) {
        self.poll_metrics(now_ms());
        self.shared.flush_metrics();
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http { shared: self.shared.clone(), phase: Phase::Start, request_id: None, headers: Vec::new() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Where a request is.
enum Phase {
    Start,
    /// An inference request: buffering its body, headers paused.
    Buffering,
    /// An event post: buffering its body (with its signature, to verify against the body).
    Event(EventPost, Option<Signed>),
    /// Done with it (routed, answered locally, or passed through).
    Done,
}

/// The signature of an event post and the timestamp it covers.
struct Signed {
    signature: ingest::Mac,
    timestamp_ms: u64,
}

/// Whether a request header name starts with `x-kvroute-` (any case).
fn is_kvroute_header(name: &str) -> bool {
    name.as_bytes()
        .get(..KVROUTE_HEADER_PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(KVROUTE_HEADER_PREFIX.as_bytes()))
}

/// One HTTP request.
struct Http {
    shared: Rc<Shared>,
    phase: Phase,
    /// The id to complete when the stream ends (routed requests only).
    request_id: Option<String>,
    /// The request headers, read once in the headers callback (without the headers a client
    /// must not set); the decision reads them from here.
    headers: Vec<(String, String)>,
}

fn set_header(name: &str, value: &str) -> bool {
    hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value)).is_ok()
}

/// Answers the request locally. `false`: the host refused (logged).
fn reply(status: u32, headers: Vec<(&str, &str)>, body: &str) -> bool {
    match hostcalls::send_http_response(status, headers, Some(body.as_bytes())) {
        Ok(()) => true,
        Err(s) => {
            log(LogLevel::Warn, &format!("kvroute: local reply {status} refused by the host: {s:?}"));
            false
        }
    }
}

/// Answers the request locally, or resets the stream when the host refuses the answer, so that
/// a request meant to be answered here (event post, stats page, reject) never goes upstream.
fn reply_or_reset(status: u32, headers: Vec<(&str, &str)>, body: &str) {
    if !reply(status, headers, body) {
        let _ = hostcalls::close_request_stream();
    }
}

fn json_reply(status: u32, body: &str) {
    reply_or_reset(status, vec![("content-type", "application/json")], body);
}

/// The error JSON of the debug header.
fn error_json(e: &RouteError) -> serde_json::Value {
    let (kind, field, header) = match e {
        RouteError::Request(RequestError::Field { field, .. }) => ("request", Some(field.as_str()), None),
        RouteError::Request(RequestError::Header { header, .. }) => ("request", None, Some(header.as_str())),
        RouteError::Request(_) => ("request", None, None),
        RouteError::NoEndpoints { .. } => ("no_endpoints", None, None),
        _ => ("other", None, None),
    };
    serde_json::json!({"kind": kind, "field": field, "header": header, "message": e.to_string()})
}

impl Http {
    /// A request header read in the headers callback.
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// Headers to set upstream, or a local answer.
    fn decide(&mut self, body: &[u8]) -> Action {
        let now = now_ms();
        self.shared.bump(Counter::Requests);
        let headers = std::mem::take(&mut self.headers);
        let Ok(mut slot) = self.shared.active.try_borrow_mut() else {
            self.shared.bump(Counter::InternalErrors);
            return self.fail_open("internal", None);
        };
        let Some(a) = slot.as_mut() else {
            drop(slot);
            return self.fail_open("unconfigured", None);
        };
        a.sync(&self.shared, now);
        let debug = a.cfg.filter.debug_decision_header;
        let result = a.router.route_http(body, headers.iter().map(|(k, v)| (k.as_str(), v.as_str())), now);
        let d = match result {
            Ok(d) => d,
            Err(e) => {
                let (counter, reason) = match &e {
                    RouteError::Request(RequestError::BodyTooLarge { .. }) => (Counter::BodyTooLarge, "body_too_large"),
                    RouteError::Request(_) => (Counter::RequestErrors, "request_error"),
                    RouteError::NoEndpoints { .. } => (Counter::NoEndpoints, "no_endpoints"),
                    _ => (Counter::InternalErrors, "internal"),
                };
                self.shared.bump(counter);
                let level = if counter == Counter::RequestErrors { LogLevel::Debug } else { LogLevel::Warn };
                log(level, &format!("kvroute: not routed by the core ({reason}): {e}"));
                drop(slot);
                return self.fail_open(reason, debug.then(|| error_json(&e)));
            }
        };
        if let Some(shed) = d.shed() {
            drop(slot);
            self.shared.bump(Counter::Shed);
            let json = debug.then(|| d.to_json().to_string());
            let mut h: Vec<(&str, &str)> = d.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            if let Some(j) = &json {
                h.push((HEADER_DECISION, j));
            }
            h.push(("content-type", "application/json"));
            let body = serde_json::json!({"error": "shed", "reason": shed.reason}).to_string();
            if !reply(u32::from(shed.status), h, &body) {
                // The 429 cannot be sent: fail open rather than hold the request.
                self.shared.bump(Counter::InternalErrors);
                return self.fail_open("internal", None);
            }
            self.phase = Phase::Done;
            return Action::Pause;
        }
        if let Some(e) = &d.effect {
            a.append(&self.shared, &Entry::Effect(&e.encode()));
        }
        drop(slot);
        self.shared.bump(Counter::Routed);
        self.request_id = Some(d.request_id.clone());
        let mut ok = d.headers.iter().all(|(k, v)| set_header(k, v));
        if debug {
            ok &= set_header(HEADER_DECISION, &d.to_json().to_string());
        }
        if !ok {
            self.shared.bump(Counter::InternalErrors);
            log(LogLevel::Warn, "kvroute: setting the routing headers failed");
        }
        self.phase = Phase::Done;
        Action::Continue
    }

    /// Route to the core's fail-open endpoint (`RouterCore::fail_open_endpoint`: least loaded), or
    /// reject when fail-open is off. Request headers
    /// must still be paused.
    fn fail_open(&mut self, reason: &str, error: Option<serde_json::Value>) -> Action {
        self.phase = Phase::Done;
        let (target, enabled, status) = match self.shared.active.try_borrow() {
            Ok(slot) => match slot.as_ref() {
                Some(a) => (
                    a.router.fail_open_endpoint().map(|e| e.to_string()),
                    a.cfg.filter.fail_open.enabled,
                    a.cfg.filter.fail_open.reject_status,
                ),
                None => (None, true, crate::config::DEFAULT_REJECT_STATUS),
            },
            Err(_) => (None, true, crate::config::DEFAULT_REJECT_STATUS),
        };
        let debug = error.map(|e| serde_json::json!({"error": e, "fallback": target}).to_string());
        match target {
            Some(t) if enabled => {
                self.shared.bump(Counter::FailOpen);
                let mut ok = set_header(HEADER_DESTINATION, &t) && set_header(HEADER_FALLBACK, reason);
                if let Some(j) = &debug {
                    ok &= set_header(HEADER_DECISION, j);
                }
                if !ok {
                    self.shared.bump(Counter::InternalErrors);
                }
                Action::Continue
            }
            _ if reason == "unconfigured" => {
                // Never configured: stay out of the way (the request goes wherever the route
                // sends it; the client's destination headers were removed).
                self.shared.bump(Counter::Unconfigured);
                Action::Continue
            }
            _ => {
                self.shared.bump(Counter::Rejected);
                let mut h = vec![(HEADER_FALLBACK, reason), ("content-type", "application/json")];
                if let Some(j) = &debug {
                    h.push((HEADER_DECISION, j));
                }
                reply_or_reset(u32::from(status), h, &ingest::error_body("not_routed", reason));
                Action::Pause
            }
        }
    }

    fn event_headers(&mut self, events: &crate::config::EventIngestion, end_of_stream: bool) -> Action {
        self.phase = Phase::Done;
        if self.header(":method") != Some("POST") {
            self.shared.bump(Counter::EventRejected);
            json_reply(405, &ingest::error_body("method_not_allowed", "POST only"));
            return Action::Pause;
        }
        let signed = match self.header(ingest::HEADER_SIGNATURE) {
            Some(sig) => match ingest::parse_signature(sig)
                .and_then(|mac| Ok((mac, ingest::parse_timestamp(self.header(ingest::HEADER_TIMESTAMP))?)))
            {
                Ok((signature, ts)) if ingest::timestamp_fresh(ts, now_ms(), events.signature_window_ms) => {
                    Some(Signed { signature, timestamp_ms: ts })
                }
                Ok((_, ts)) => {
                    self.shared.bump(Counter::EventUnauthorized);
                    log(LogLevel::Warn, &format!("kvroute: event post stamped {ts}, outside the signature window"));
                    json_reply(401, &ingest::error_body("stale", "x-kvroute-timestamp outside the signature window"));
                    return Action::Pause;
                }
                Err(detail) => {
                    self.shared.bump(Counter::EventUnauthorized);
                    json_reply(401, &ingest::error_body("unauthorized", &detail));
                    return Action::Pause;
                }
            },
            None => {
                let given = self.header(ingest::HEADER_SECRET).unwrap_or_default();
                if !events.allow_unsigned || !ingest::secret_matches(given.as_bytes(), events.secret.as_bytes()) {
                    self.shared.bump(Counter::EventUnauthorized);
                    log(LogLevel::Warn, "kvroute: event post without a valid signature");
                    let detail = if events.allow_unsigned {
                        "no x-kvroute-signature, and a wrong or missing x-kvroute-secret"
                    } else {
                        "x-kvroute-signature required"
                    };
                    json_reply(401, &ingest::error_body("unauthorized", detail));
                    return Action::Pause;
                }
                None
            }
        };
        let post = match ingest::parse_post(|n| self.header(n)) {
            Ok(p) => p,
            Err(detail) => {
                self.shared.bump(Counter::EventRejected);
                json_reply(400, &ingest::error_body("bad_request", &detail));
                return Action::Pause;
            }
        };
        if end_of_stream {
            self.apply_post(&post, signed.as_ref(), &[]);
        } else {
            self.phase = Phase::Event(post, signed);
        }
        Action::Pause
    }

    fn apply_post(&mut self, post: &EventPost, signed: Option<&Signed>, body: &[u8]) {
        let now = now_ms();
        self.phase = Phase::Done;
        let Ok(mut slot) = self.shared.active.try_borrow_mut() else {
            self.shared.bump(Counter::InternalErrors);
            json_reply(503, &ingest::error_body("busy", "state busy"));
            return;
        };
        let Some(a) = slot.as_mut() else {
            json_reply(503, &ingest::error_body("unconfigured", "no configuration"));
            return;
        };
        if let Some(sig) = signed {
            let Some(events) = a.cfg.filter.events.as_ref() else {
                drop(slot);
                json_reply(503, &ingest::error_body("unconfigured", "no event ingestion"));
                return;
            };
            let (kind, seq) = (post.kind.name(), post.kind.seq());
            let secret = events.secret.as_bytes();
            let refusal =
                if !ingest::verify_signature(secret, &post.endpoint, kind, seq, sig.timestamp_ms, body, &sig.signature)
                {
                    Some(("unauthorized", "wrong x-kvroute-signature"))
                } else if a.recent_signatures.is_replay(&sig.signature, now, events.signature_window_ms) {
                    Some(("replayed", "this signature was already accepted"))
                } else {
                    None
                };
            if let Some((error, detail)) = refusal {
                drop(slot);
                self.shared.bump(Counter::EventUnauthorized);
                log(LogLevel::Warn, &format!("kvroute: event post for {} refused: {detail}", post.endpoint));
                json_reply(401, &ingest::error_body(error, detail));
                return;
            }
        }
        a.sync(&self.shared, now);
        let endpoint = post.endpoint.as_str();
        match post.kind {
            PostKind::Resync => match a.router.resync_stream(endpoint, now) {
                Ok(()) => {
                    if let Some(sig) = signed {
                        a.recent_signatures.record(&sig.signature, sig.timestamp_ms);
                    }
                    a.append(&self.shared, &Entry::Resync { endpoint, now_ms: now });
                    drop(slot);
                    self.shared.bump(Counter::EventResyncs);
                    log(LogLevel::Info, &format!("kvroute: event stream of {endpoint} resynced by its relay"));
                    json_reply(200, r#"{"verdict":"resynced"}"#);
                }
                Err(e) => {
                    drop(slot);
                    self.shared.bump(Counter::EventRejected);
                    json_reply(404, &ingest::error_body("unknown_endpoint", &e.to_string()));
                }
            },
            PostKind::Batch { seq } => {
                if body.is_empty() {
                    drop(slot);
                    self.shared.bump(Counter::EventRejected);
                    json_reply(400, &ingest::error_body("bad_request", "empty body: one msgpack batch expected"));
                    return;
                }
                match a.router.apply_events(endpoint, body, seq, now) {
                    Ok(out) => {
                        let verdict = VerdictCode::of(&out.verdict);
                        if let (Some(sig), VerdictCode::Applied | VerdictCode::Reset) = (signed, verdict) {
                            a.recent_signatures.record(&sig.signature, sig.timestamp_ms);
                        }
                        if verdict != VerdictCode::Duplicate {
                            a.append(
                                &self.shared,
                                &Entry::Events { endpoint, seq, now_ms: now, verdict, payload: body },
                            );
                        }
                        drop(slot);
                        self.shared.bump(if verdict == VerdictCode::Gap {
                            Counter::EventGaps
                        } else {
                            Counter::EventBatches
                        });
                        let (status, answer) = ingest::outcome_answer(&out);
                        json_reply(status, &answer);
                    }
                    Err(EventIngestError::Decode(e)) => {
                        drop(slot);
                        self.shared.bump(Counter::EventRejected);
                        log(LogLevel::Warn, &format!("kvroute: event batch from {endpoint} does not decode: {e}"));
                        json_reply(400, &ingest::error_body("decode", &e.to_string()));
                    }
                    Err(e) => {
                        drop(slot);
                        self.shared.bump(Counter::EventRejected);
                        json_reply(404, &ingest::error_body("unknown_endpoint", &e.to_string()));
                    }
                }
            }
        }
    }

    fn stats(&mut self, secret: Option<&str>) -> Action {
        self.phase = Phase::Done;
        if let Some(secret) = secret {
            let given = self.header(HEADER_STATS_SECRET).unwrap_or_default();
            if !ingest::secret_matches(given.as_bytes(), secret.as_bytes()) {
                json_reply(401, &ingest::error_body("unauthorized", "wrong or missing x-kvroute-stats-secret"));
                return Action::Pause;
            }
        }
        self.shared.flush_metrics();
        let now = now_ms();
        let text = match self.shared.active.try_borrow_mut() {
            Ok(mut slot) => match slot.as_mut() {
                Some(a) => {
                    a.sync(&self.shared, now);
                    let counters = self.shared.counters.try_borrow().map(|c| c.clone()).unwrap_or_default();
                    format!("{}{}", a.router.metrics_text(now), counters.exposition(&a.log.stats, a.log.instance()))
                }
                None => String::new(),
            },
            Err(_) => String::new(),
        };
        reply_or_reset(200, vec![("content-type", "text/plain; version=0.0.4")], &text);
        Action::Pause
    }

    fn complete(&mut self) {
        let Some(id) = self.request_id.take() else { return };
        let Ok(mut slot) = self.shared.active.try_borrow_mut() else {
            self.shared.bump(Counter::InternalErrors);
            return;
        };
        let Some(a) = slot.as_mut() else { return };
        // Unknown: expired after the in-flight timeout, or the router was rebuilt.
        if a.router.complete(&id).is_ok() {
            a.append(&self.shared, &Entry::Complete(&id));
        }
    }

    /// The body is complete (end of stream or trailers): decide.
    fn body_done(&mut self, body_size: usize) -> Action {
        let body = match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size) {
            Ok(b) => b.unwrap_or_default(),
            Err(s) => {
                self.shared.bump(Counter::InternalErrors);
                log(LogLevel::Warn, &format!("kvroute: reading the request body: {s:?}"));
                if let Phase::Event(..) = self.phase {
                    // An event post never goes upstream.
                    self.phase = Phase::Done;
                    json_reply(503, &ingest::error_body("internal", "request body unreadable"));
                    return Action::Pause;
                }
                return self.fail_open("internal", None);
            }
        };
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Buffering => self.decide(&body),
            Phase::Event(post, signed) => {
                self.apply_post(&post, signed.as_ref(), &body);
                Action::Pause
            }
            other => {
                self.phase = other;
                Action::Continue
            }
        }
    }

    fn body_limit(&self) -> usize {
        let Ok(slot) = self.shared.active.try_borrow() else { return usize::MAX };
        let Some(a) = slot.as_ref() else { return usize::MAX };
        match self.phase {
            Phase::Event(..) => a.cfg.filter.events.as_ref().map_or(usize::MAX, |e| e.max_body_bytes),
            _ => a.router.policy().policy.config().request.max_body_bytes,
        }
    }
}

impl Context for Http {
    fn on_done(&mut self) -> bool {
        self.complete();
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // A client must never choose the upstream itself (Envoy follows the destination header),
        // and no x-kvroute-* header goes upstream, whatever the path (the event protocol's
        // secret and signature included): they are removed from the request here, and the ones
        // the filter reads (event posts, the core's own headers) are kept in `self.headers`.
        match hostcalls::get_map_bytes(MapType::HttpRequestHeaders) {
            Ok(pairs) => {
                self.headers = Vec::with_capacity(pairs.len());
                for (k, v) in pairs {
                    let routing = ROUTING_HEADERS.iter().any(|h| h.eq_ignore_ascii_case(&k));
                    if routing || is_kvroute_header(&k) {
                        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &k, None);
                    }
                    if !routing {
                        // Valid UTF-8 (the usual case) keeps the host's buffer: no copy.
                        let v =
                            String::from_utf8(v).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
                        self.headers.push((k, v));
                    }
                }
            }
            Err(s) => {
                self.shared.bump(Counter::InternalErrors);
                log(LogLevel::Warn, &format!("kvroute: reading the request headers: {s:?}"));
                let event_headers = [
                    ingest::HEADER_SECRET,
                    ingest::HEADER_SIGNATURE,
                    ingest::HEADER_TIMESTAMP,
                    ingest::HEADER_ENDPOINT,
                    ingest::HEADER_KIND,
                    ingest::HEADER_SEQ,
                    ingest::HEADER_TOPIC,
                    HEADER_STATS_SECRET,
                ];
                for h in ROUTING_HEADERS.into_iter().chain(event_headers) {
                    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, h, None);
                }
                // One by one, the headers that decide where the request belongs (event path,
                // stats page, inference).
                self.headers = [":path", ":method"]
                    .into_iter()
                    .filter_map(|k| {
                        let v = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, k).ok().flatten()?;
                        Some((k.to_owned(), String::from_utf8_lossy(&v).into_owned()))
                    })
                    .collect();
            }
        }
        // The configuration is shared (`Rc`): holding it costs no copy of its strings.
        let cfg = match self.shared.active.try_borrow() {
            Ok(slot) => match slot.as_ref() {
                Some(a) => Some(a.cfg.clone()),
                None => {
                    drop(slot);
                    self.phase = Phase::Done;
                    self.shared.bump(Counter::Unconfigured);
                    return Action::Continue;
                }
            },
            Err(_) => None,
        };
        if let Some(cfg) = cfg {
            let path = path_only(self.header(":path").unwrap_or_default());
            if let Some(ev) = cfg.filter.events.as_ref().filter(|e| e.path == path) {
                return self.event_headers(ev, end_of_stream);
            }
            if cfg.filter.stats_path.as_deref().is_some_and(|s| s == path) && self.header(":method") == Some("GET") {
                return self.stats(cfg.filter.stats_secret.as_deref());
            }
        }
        if end_of_stream {
            // No body (GET /v1/models, health checks): nothing for the core to read; send it
            // to the least-loaded endpoint.
            self.shared.bump(Counter::Bodyless);
            self.phase = Phase::Done;
            let target = match self.shared.active.try_borrow() {
                Ok(slot) => slot.as_ref().and_then(|a| a.router.fail_open_endpoint().map(|e| e.to_string())),
                Err(_) => None,
            };
            if let Some(t) = target {
                if !set_header(HEADER_DESTINATION, &t) {
                    self.shared.bump(Counter::InternalErrors);
                }
            }
            return Action::Continue;
        }
        self.phase = Phase::Buffering;
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match self.phase {
            Phase::Buffering | Phase::Event(..) => {}
            _ => return Action::Continue,
        }
        if body_size > self.body_limit() {
            if let Phase::Event(..) = self.phase {
                self.phase = Phase::Done;
                self.shared.bump(Counter::EventRejected);
                json_reply(413, &ingest::error_body("too_large", "event batch over max_body_bytes"));
                return Action::Pause;
            }
            self.shared.bump(Counter::Requests);
            self.shared.bump(Counter::BodyTooLarge);
            log(
                LogLevel::Warn,
                &format!("kvroute: not routed by the core (body_too_large): {body_size} bytes buffered, over request.max_body_bytes"),
            );
            return self.fail_open("body_too_large", None);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.body_done(body_size)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        match self.phase {
            // The body ended with trailers: it is all buffered now.
            Phase::Buffering | Phase::Event(..) => self.body_done(usize::MAX),
            _ => Action::Continue,
        }
    }

    fn on_log(&mut self) {
        self.complete();
    }
}
