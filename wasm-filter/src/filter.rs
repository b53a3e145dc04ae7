//! The proxy-wasm glue (wasm32 only): the root context owns the router, the shared log and the
//! metric poller; HTTP contexts hold only their request's state.
//!
//! Flow control (the core's `admit` / `take_releases` / `cancel` protocol, documented on
//! `kvroute::Admission`): a request the core queues stays paused (its body callback answered
//! `Pause`); its parsed request waits in [`FlowHold`] with its context id. Releases are taken at
//! every dispatch opportunity (the tick, a completion, a finished metrics poll, an admission, a
//! configuration) and acted on from whichever context took them, after switching the effective
//! context to the held stream: a dispatched one is routed and resumed, a dropped one answered
//! with its status and `x-llm-d-request-dropped-reason`. Other VMs' queued requests are held as
//! replicas (entries `FlowQueued` / `FlowLeft` of the shared log) so that this VM's requests
//! queue behind them; a replica's release is its owner's to act on.
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
    Admission, Decision, EndpointSpec, EventIngestError, MetricsSnapshot, Rejection, Release, ReleaseOutcome,
    ReplicaBatch, ReplicaEntryRef, RequestError, RouteError, RouteRequest, RouterCore, RoutingEffect, StateError,
    Ticket, HEADER_DESTINATION,
};

use crate::config::{
    path_only, PluginConfig, ReplicaRoute, ReplicaSection, HEADER_DECISION, HEADER_FALLBACK, HEADER_STATS_SECRET,
    KVROUTE_HEADER_PREFIX, ROUTING_HEADERS,
};
use crate::counters::{Counter, Counters};
use crate::host_map::HeaderList;
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
    /// Flow control's held requests and the replicas of the other VMs' queues.
    flow: FlowHold,
}

/// With `sync.batch_completions`, at most this many completions wait for the next append or tick.
const MAX_DEFERRED_COMPLETIONS: usize = 64;

/// A replica released here to be dispatched is remembered this long (longer than the core's
/// one-second load grace: forgetting it later finds nothing and changes nothing).
const REPLICA_RELEASED_KEEP_MS: u64 = 5_000;

/// Flow control in this VM: its held requests (the paused streams) and the replicas of the other
/// VMs' queued requests.
#[derive(Default)]
struct FlowHold {
    /// This VM's requests the router holds or released and the filter has not finished with.
    held: BTreeMap<Ticket, Held>,
    /// Releases whose host calls were refused, in release order: retried at every opportunity.
    retry: Vec<Ticket>,
    /// Streams released and resumed from another context: context id → the in-flight id to
    /// complete when the stream ends.
    routed: BTreeMap<u32, String>,
    /// Replicas: (origin instance, the origin's ticket) → the router's ticket here, and when it
    /// was released here to be dispatched.
    replicas: BTreeMap<(u64, u64), (Ticket, Option<u64>)>,
    /// The router's replica tickets → (origin instance, the origin's ticket).
    replica_of: BTreeMap<Ticket, (u64, u64)>,
    /// Replicas released here to be dispatched, oldest first: (when, key), pruned after
    /// [`REPLICA_RELEASED_KEEP_MS`] when their owner's `FlowLeft` never came.
    released: std::collections::VecDeque<(u64, (u64, u64))>,
    /// Reused buffer of `take_releases_into`.
    releases: Vec<Release>,
    /// The running HTTP callback's own request was released and routed: its return value
    /// resumes it.
    resume_own: bool,
}

/// A held request.
struct Held {
    /// Its stream's context id.
    context_id: u32,
    /// The request as parsed at admission (routed as it is when released).
    request: RouteRequest,
    state: HeldState,
}

/// Where a held request is.
#[derive(Clone)]
enum HeldState {
    /// Queued by the router.
    Queued,
    /// Released (after waiting this many ms): route and resume it, or answer it.
    Released(ReleaseOutcome, u64),
    /// Its upstream headers are set; resume it (the host refused before). The in-flight id, when
    /// the core routed it.
    Resuming(Option<String>),
}

impl FlowHold {
    /// Forget every replica (their owners still hold the requests). Returns the router tickets.
    fn drop_replicas(&mut self) -> Vec<Ticket> {
        self.replicas.clear();
        self.released.clear();
        std::mem::take(&mut self.replica_of).into_keys().collect()
    }

    /// Forget the replicas released here long enough ago that their owner's `FlowLeft` no longer
    /// matters (the core stopped counting them as load after one second).
    fn prune(&mut self, now: u64) {
        while let Some(&(at, key)) = self.released.front() {
            if now.saturating_sub(at) <= REPLICA_RELEASED_KEEP_MS && at <= now {
                break;
            }
            self.released.pop_front();
            if let Some(&(t, Some(r))) = self.replicas.get(&key) {
                if r == at {
                    self.replicas.remove(&key);
                    self.replica_of.remove(&t);
                }
            }
        }
    }
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
    /// Root contexts of this plugin instance alive in this VM: when the last one is done, the
    /// router's queue shuts down (held requests are answered 503).
    roots: Cell<u32>,
    /// The queue was shut down: a later configuration starts a new router.
    shut_down: Cell<bool>,
    /// The tick period the host last accepted (ms; 0: refused, asked again while requests are
    /// held).
    tick_ms: Cell<u64>,
}

impl Shared {
    fn bump(&self, c: Counter) {
        self.add(c, 1);
    }

    fn add(&self, c: Counter, n: u64) {
        if n == 0 {
            return;
        }
        if let Ok(mut k) = self.counters.try_borrow_mut() {
            k.add(c, n);
        }
        if let Ok(mut u) = self.unflushed.try_borrow_mut() {
            if let Some(v) = u.get_mut(c as usize) {
                *v = v.saturating_add(n);
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
    /// Apply the entries other VMs appended since the last call. When entries were lost (an
    /// overrun, or a slot never written), see [`Active::lost_entries`].
    fn sync(&mut self, shared: &Shared, now: u64) {
        let Active { router, log: shared_log, flow, .. } = self;
        let lost = shared_log.stats.lost;
        let mut errors = 0u32;
        let mut divergences = 0u32;
        let r =
            shared_log.poll(&mut HostStore, now, |origin, entry| match apply_entry(router, flow, origin, entry, now) {
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
        if self.log.stats.lost > lost {
            self.lost_entries(shared);
        }
    }

    /// This VM lost log entries, so its replicas of the other VMs' queues may be stale (a lost
    /// `FlowLeft` would hold a slot for a request long gone) or missing: it forgets them all (their
    /// owners still hold the requests), and releases its own queued requests at once rather than
    /// let them wait on a view it cannot trust (fail-open for the queue; the core counts them as
    /// cancelled, the filter in `kvroute_wasm_flow_fail_open_total`). They are routed at the next
    /// opportunity.
    fn lost_entries(&mut self, shared: &Shared) {
        for t in self.flow.drop_replicas() {
            self.router.forget_replica(t);
        }
        let queued: Vec<Ticket> =
            self.flow.held.iter().filter(|(_, h)| matches!(h.state, HeldState::Queued)).map(|(t, _)| *t).collect();
        if queued.is_empty() {
            return;
        }
        log(
            LogLevel::Warn,
            &format!("kvroute: shared log entries lost: {} held requests released without waiting", queued.len()),
        );
        for t in queued {
            if !self.router.cancel(t) {
                continue;
            }
            if let Some(h) = self.flow.held.get_mut(&t) {
                h.state = HeldState::Released(ReleaseOutcome::Dispatched, 0);
            }
            self.flow.retry.push(t);
            self.append(shared, &Entry::FlowLeft { ticket: t.0 });
            shared.bump(Counter::FlowFailOpen);
        }
    }

    /// A dispatch opportunity at `now`: take flow control's releases and act on this VM's
    /// (after those whose host calls were refused before); a replica's release is its owner's to
    /// act on. `own`: the context whose callback is running (its own stream goes on by the
    /// callback's return value, never by a continue). Returns whether the effective context was
    /// switched (the caller switches back to `own`).
    fn flow_opportunity(&mut self, shared: &Shared, now: u64, own: u32) -> bool {
        let mut switched = false;
        for t in std::mem::take(&mut self.flow.retry) {
            switched |= self.act_on(shared, t, now, own);
        }
        let mut releases = std::mem::take(&mut self.flow.releases);
        self.router.take_releases_into(now, &mut releases);
        for r in releases.drain(..) {
            if let Some(&key) = self.flow.replica_of.get(&r.ticket) {
                match r.outcome {
                    ReleaseOutcome::Dispatched => {
                        if let Some(v) = self.flow.replicas.get_mut(&key) {
                            v.1 = Some(now);
                            self.flow.released.push_back((now, key));
                        }
                    }
                    ReleaseOutcome::Dropped(_) => {
                        self.flow.replica_of.remove(&r.ticket);
                        self.flow.replicas.remove(&key);
                    }
                }
                continue;
            }
            let Some(h) = self.flow.held.get_mut(&r.ticket) else { continue };
            h.state = HeldState::Released(r.outcome, r.waited_ms);
            self.append(shared, &Entry::FlowLeft { ticket: r.ticket.0 });
            switched |= self.act_on(shared, r.ticket, now, own);
        }
        self.flow.releases = releases;
        switched
    }

    /// Act on the released request `t`, from any context: switch to its stream, then route and
    /// resume it, or answer it. A refused host call keeps it for the next opportunity. Returns
    /// whether the effective context was switched.
    fn act_on(&mut self, shared: &Shared, t: Ticket, now: u64, own: u32) -> bool {
        let Some(mut h) = self.flow.held.remove(&t) else { return false };
        if h.context_id != own && hostcalls::set_effective_context(h.context_id).is_err() {
            shared.bump(Counter::InternalErrors);
            log(LogLevel::Warn, "kvroute: switching to a held request's stream was refused; retried at the next tick");
            self.flow.held.insert(t, h);
            self.flow.retry.push(t);
            return false;
        }
        let switched = h.context_id != own;
        if let HeldState::Released(outcome, waited) = &h.state {
            // In the held stream's context: the log line names the stream.
            let what = match outcome {
                ReleaseOutcome::Dispatched => "dispatched".to_owned(),
                ReleaseOutcome::Dropped(r) => format!("dropped ({} {})", r.status, r.reason.as_str()),
            };
            log(LogLevel::Debug, &format!("kvroute: flow release: {what} after {waited} ms"));
        }
        loop {
            match std::mem::replace(&mut h.state, HeldState::Queued) {
                HeldState::Queued => {
                    self.flow.held.insert(t, h);
                    return switched;
                }
                HeldState::Released(ReleaseOutcome::Dispatched, _) => {
                    let result = self.router.route(&h.request, now);
                    let routed = apply_route(shared, self, result);
                    if !routed.upstream {
                        return switched;
                    }
                    shared.bump(Counter::FlowResumed);
                    h.state = HeldState::Resuming(routed.request_id);
                }
                HeldState::Released(ReleaseOutcome::Dropped(rej), _) => {
                    if flow_reply(&rej) {
                        shared.bump(Counter::FlowDropped);
                        return switched;
                    }
                    // The answer cannot be sent: fail open rather than hold the request.
                    shared.bump(Counter::InternalErrors);
                    if !fail_open_with(shared, Some(self), "internal", None) {
                        return switched;
                    }
                    h.state = HeldState::Resuming(None);
                }
                HeldState::Resuming(id) => {
                    if h.context_id == own {
                        // Resumed by the running callback's return value.
                        if let Some(id) = id {
                            self.flow.routed.insert(own, id);
                        }
                        self.flow.resume_own = true;
                        return switched;
                    }
                    if hostcalls::continue_request_stream().is_ok() {
                        if let Some(id) = id {
                            self.flow.routed.insert(h.context_id, id);
                        }
                        return switched;
                    }
                    shared.bump(Counter::InternalErrors);
                    log(LogLevel::Warn, "kvroute: resuming a released request was refused; retried at the next tick");
                    h.state = HeldState::Resuming(id);
                    self.flow.held.insert(t, h);
                    self.flow.retry.push(t);
                    return switched;
                }
            }
        }
    }

    fn append(&mut self, shared: &Shared, entry: &Entry<'_>) {
        if let Err(e) = self.log.append(&mut HostStore, entry) {
            shared.bump(Counter::SyncErrors);
            log(LogLevel::Warn, &format!("kvroute: appending to the shared log failed: {e}"));
        }
    }

    /// Request `id` completed here: appended at once, or with `sync.batch_completions` deferred
    /// to the next append or tick (or once [`MAX_DEFERRED_COMPLETIONS`] wait).
    fn append_complete(&mut self, shared: &Shared, id: &str) {
        if !self.cfg.filter.sync.batch_completions {
            self.append(shared, &Entry::Complete(id));
        } else if self.log.defer_complete(id) >= MAX_DEFERRED_COMPLETIONS {
            self.flush_completions(shared);
        }
    }

    /// Append the deferred completions (one claim).
    fn flush_completions(&mut self, shared: &Shared) {
        if let Err(e) = self.log.flush(&mut HostStore) {
            shared.bump(Counter::SyncErrors);
            log(LogLevel::Warn, &format!("kvroute: appending completions to the shared log failed: {e}"));
        }
    }
}

/// Apply one entry of another instance. `Ok(true)`: an event batch was judged differently here
/// than by its writer (this VM missed entries), so the stream was resynced and the batch applied.
fn apply_entry(
    router: &mut RouterCore,
    flow: &mut FlowHold,
    origin: u64,
    entry: Entry<'_>,
    now: u64,
) -> Result<bool, String> {
    let replica = entry.flow_replica();
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
        Entry::FlowQueued { ticket, .. } => {
            // Flow control off here (or shutting down): no replica, nothing to order against.
            let Some(local) = replica.and_then(|r| router.enqueue_replica(&r, now)) else { return Ok(false) };
            if let Some((old, _)) = flow.replicas.insert((origin, ticket), (local, None)) {
                flow.replica_of.remove(&old);
                router.forget_replica(old);
            }
            flow.replica_of.insert(local, (origin, ticket));
        }
        Entry::FlowLeft { ticket } => {
            if let Some((local, _)) = flow.replicas.remove(&(origin, ticket)) {
                flow.replica_of.remove(&local);
                router.forget_replica(local);
            }
        }
        // Judged by this VM's router (it sees the batches in the log's order, as the writer did).
        Entry::Replica(bytes) => {
            router.apply_replica_bytes(bytes, now).map_err(|e| e.to_string())?;
        }
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
    /// This root context's id (the effective context to switch back to).
    context_id: u32,
    /// Counted in `Shared::roots`.
    adopted: bool,
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
        roots: Cell::new(0),
        shut_down: Cell::new(false),
        tick_ms: Cell::new(0),
    })
}

impl Root {
    /// The root context `context_id`, with no configuration yet.
    pub fn new(context_id: u32) -> Root {
        Root { shared: new_shared(), context_id, adopted: false }
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
        if !self.adopted {
            self.adopted = true;
            self.shared.roots.set(self.shared.roots.get() + 1);
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
        if self.shared.shut_down.replace(false) {
            // The plugin's last root context was done and its queue shut down: start afresh.
            *slot = None;
        }
        match slot.as_mut() {
            None => {
                let mut router = RouterCore::new(cfg.policy.clone());
                router.record_effects(true);
                sync_endpoints(&mut router, &cfg)?;
                sync_replication(&mut router, &cfg)?;
                let mut a = Active {
                    router,
                    log: SharedLog::new(&cfg.filter.sync.namespace, cfg.filter.sync.ring_entries, instance),
                    cfg: cfg.clone(),
                    polls: BTreeMap::new(),
                    next_poll_ms: 0,
                    recent_signatures: ingest::RecentSignatures::default(),
                    flow: FlowHold::default(),
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
                sync_replication(&mut a.router, &cfg)?;
                let (old, new) = (&a.cfg.filter.sync, &cfg.filter.sync);
                if old.namespace != new.namespace || old.ring_entries != new.ring_entries {
                    // The replicas came from the old log; the other VMs move to the new one too.
                    for t in a.flow.drop_replicas() {
                        a.router.forget_replica(t);
                    }
                    a.flush_completions(&self.shared);
                    a.log = SharedLog::new(&new.namespace, new.ring_entries, instance);
                    a.sync(&self.shared, now);
                }
                a.cfg = cfg.clone();
                a.next_poll_ms = 0;
            }
        }
        // A reload is a dispatch opportunity (and may have dropped or released held requests).
        if let Some(a) = slot.as_mut() {
            if a.flow_opportunity(&self.shared, now, self.context_id) {
                let _ = hostcalls::set_effective_context(self.context_id);
            }
        }
        drop(slot);
        // A refusal leaves no ticks: requests, event posts and the stats page still sync the log,
        // polling waits for the next configuration, and the next queued request asks again.
        self.shared.tick_ms.set(0);
        set_tick(&self.shared, cfg.filter.sync.tick_ms);
        Ok(())
    }

    /// The tick's flow-control work: apply the log, take the releases and act on them, and ask
    /// for the next tick at the nearest queue deadline (at most the sync tick).
    fn flow_tick(&self, now: u64) {
        let Ok(mut slot) = self.shared.active.try_borrow_mut() else { return };
        let Some(a) = slot.as_mut() else { return };
        a.sync(&self.shared, now);
        a.flush_completions(&self.shared);
        a.router.expire_silent_replicas(now);
        a.flow.prune(now);
        if a.flow_opportunity(&self.shared, now, self.context_id) {
            let _ = hostcalls::set_effective_context(self.context_id);
        }
        let wanted = wanted_tick_ms(a, now);
        if wanted != self.shared.tick_ms.get() {
            set_tick(&self.shared, wanted);
        }
    }

    /// The plugin's last root context in this VM is done: drop every held request with 503
    /// `rejected-shutting-down` (nothing would release them any more).
    fn shutdown_queue(&self) {
        let now = now_ms();
        let Ok(mut slot) = self.shared.active.try_borrow_mut() else { return };
        let Some(a) = slot.as_mut() else { return };
        a.flush_completions(&self.shared);
        a.router.shutdown_queue();
        self.shared.shut_down.set(true);
        let held = a.flow.held.len();
        if a.flow_opportunity(&self.shared, now, self.context_id) {
            let _ = hostcalls::set_effective_context(self.context_id);
        }
        if held > 0 {
            log(LogLevel::Info, &format!("kvroute: plugin done: {held} held requests answered 503"));
        }
    }

    fn poll_metrics(&self, now: u64) {
        let calls = {
            let Ok(mut slot) = self.shared.active.try_borrow_mut() else { return };
            let Some(a) = slot.as_mut() else { return };
            // (The tick's flow-control work applied the log just before.)
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

/// Turn replication on (apply-only) or off as the configuration says. The peers' state is kept
/// across reconfigurations with the same fleet and replica id.
fn sync_replication(router: &mut RouterCore, cfg: &PluginConfig) -> Result<(), String> {
    match &cfg.filter.replica {
        Some(r) => router.enable_replication(r.core_config()).map_err(|e| e.to_string()),
        None => {
            if router.replica_config().is_some() {
                router.disable_replication();
            }
            Ok(())
        }
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
        match body {
            None => {
                self.shared.bump(Counter::PollFailures);
                log(LogLevel::Debug, &format!("kvroute: metrics of {endpoint}: status {status:?}"));
            }
            Some(body) => {
                let text = String::from_utf8_lossy(&body);
                match a.router.update_metrics_from_prometheus(&endpoint, &text, now) {
                    Ok(m) => {
                        self.shared.bump(Counter::Polls);
                        match serde_json::to_vec(&m) {
                            Ok(json) => {
                                a.append(&self.shared, &Entry::Metrics { endpoint: &endpoint, snapshot: &json });
                            }
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
        // The round's last answer: a dispatch opportunity on the whole round's figures.
        if a.polls.is_empty() && a.flow_opportunity(&self.shared, now, self.context_id) {
            let _ = hostcalls::set_effective_context(self.context_id);
        }
    }

    fn on_done(&mut self) -> bool {
        if std::mem::take(&mut self.adopted) {
            let left = self.shared.roots.get().saturating_sub(1);
            self.shared.roots.set(left);
            if left == 0 {
                self.shutdown_queue();
            }
        }
        true
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
        let now = now_ms();
        self.flow_tick(now);
        self.poll_metrics(now);
        self.shared.flush_metrics();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http {
            shared: self.shared.clone(),
            context_id,
            phase: Phase::Start,
            request_id: None,
            ticket: None,
            headers: HeaderList::default(),
        }))
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
    /// Held by flow control (paused; its request waits in [`FlowHold`]).
    Held,
    /// A replica batch posted by the relay: buffering its body (verified with its signature).
    ReplicaIn(Signed),
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
    /// This stream's context id.
    context_id: u32,
    phase: Phase,
    /// The id to complete when the stream ends (routed requests only).
    request_id: Option<String>,
    /// Its flow-control ticket while it is held (or released and not finished with).
    ticket: Option<Ticket>,
    /// The request headers, read once in the headers callback (without the headers a client
    /// must not set); the decision reads them from here.
    headers: HeaderList,
}

/// A header's bytes as text: valid UTF-8 (the usual case) in place, anything else with its
/// invalid sequences replaced.
fn header_text(b: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(b) {
        Ok(t) => std::borrow::Cow::Borrowed(t),
        Err(_) => String::from_utf8_lossy(b),
    }
}

fn set_header(name: &str, value: &str) -> bool {
    hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value)).is_ok()
}

/// Answers the request locally. `false`: the host refused (logged).
fn reply(status: u32, headers: Vec<(&str, &str)>, body: &str) -> bool {
    reply_bytes(status, headers, body.as_bytes())
}

/// [`reply`] with a binary body.
fn reply_bytes(status: u32, headers: Vec<(&str, &str)>, body: &[u8]) -> bool {
    match hostcalls::send_http_response(status, headers, Some(body)) {
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

/// Answers a request flow control refused or dropped: its status, `x-llm-d-request-dropped-reason`
/// and a JSON body. `false`: the host refused (logged).
fn flow_reply(rej: &Rejection) -> bool {
    let (name, reason) = rej.header();
    let body = ingest::error_body(reason, "refused by flow control");
    reply(u32::from(rej.status), vec![(name, reason), ("content-type", "application/json")], &body)
}

/// What became of a request the filter routed, in the current (effective) stream.
struct Routed {
    /// It goes upstream (its headers are set): let it go on.
    upstream: bool,
    /// Its in-flight id: completed when the stream ends.
    request_id: Option<String>,
}

/// Apply a routing result to the current stream: set the destination headers (and replicate the
/// decision's effect), or answer the core's 429, or fail open when the core could not route.
fn apply_route(shared: &Shared, a: &mut Active, result: Result<Decision, RouteError>) -> Routed {
    let debug = a.cfg.filter.debug_decision_header;
    let d = match result {
        Ok(d) => d,
        Err(e) => {
            let (counter, reason) = match &e {
                RouteError::Request(RequestError::BodyTooLarge { .. }) => (Counter::BodyTooLarge, "body_too_large"),
                RouteError::Request(_) => (Counter::RequestErrors, "request_error"),
                RouteError::NoEndpoints { .. } => (Counter::NoEndpoints, "no_endpoints"),
                _ => (Counter::InternalErrors, "internal"),
            };
            shared.bump(counter);
            let level = if counter == Counter::RequestErrors { LogLevel::Debug } else { LogLevel::Warn };
            log(level, &format!("kvroute: not routed by the core ({reason}): {e}"));
            let upstream = fail_open_with(shared, Some(a), reason, debug.then(|| error_json(&e)));
            return Routed { upstream, request_id: None };
        }
    };
    if let Some(shed) = d.shed() {
        shared.bump(Counter::Shed);
        let json = debug.then(|| d.to_json().to_string());
        let mut h: Vec<(&str, &str)> = d.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        if let Some(j) = &json {
            h.push((HEADER_DECISION, j));
        }
        h.push(("content-type", "application/json"));
        let body = serde_json::json!({"error": "shed", "reason": shed.reason}).to_string();
        if !reply(u32::from(shed.status), h, &body) {
            // The 429 cannot be sent: fail open rather than hold the request.
            shared.bump(Counter::InternalErrors);
            return Routed { upstream: fail_open_with(shared, Some(a), "internal", None), request_id: None };
        }
        return Routed { upstream: false, request_id: None };
    }
    if let Some(e) = &d.effect {
        a.append(shared, &Entry::Effect(&e.encode()));
    }
    shared.bump(Counter::Routed);
    let mut ok = d.headers.iter().all(|(k, v)| set_header(k, v));
    if debug {
        ok &= set_header(HEADER_DECISION, &d.to_json().to_string());
    }
    if !ok {
        shared.bump(Counter::InternalErrors);
        log(LogLevel::Warn, "kvroute: setting the routing headers failed");
    }
    Routed { upstream: true, request_id: Some(d.request_id) }
}

/// Route the current stream to the core's fail-open endpoint (`RouterCore::fail_open_endpoint`:
/// least loaded), or reject it when fail-open is off. Request headers must still be paused.
/// True: it goes upstream; false: it was answered (or reset).
fn fail_open_with(shared: &Shared, a: Option<&Active>, reason: &str, error: Option<serde_json::Value>) -> bool {
    let (target, enabled, status) = match a {
        Some(a) => (
            a.router.fail_open_endpoint().map(|e| e.to_string()),
            a.cfg.filter.fail_open.enabled,
            a.cfg.filter.fail_open.reject_status,
        ),
        None => (None, true, crate::config::DEFAULT_REJECT_STATUS),
    };
    let debug = error.map(|e| serde_json::json!({"error": e, "fallback": target}).to_string());
    match target {
        Some(t) if enabled => {
            shared.bump(Counter::FailOpen);
            let mut ok = set_header(HEADER_DESTINATION, &t) && set_header(HEADER_FALLBACK, reason);
            if let Some(j) = &debug {
                ok &= set_header(HEADER_DECISION, j);
            }
            if !ok {
                shared.bump(Counter::InternalErrors);
            }
            true
        }
        _ if reason == "unconfigured" => {
            // Never configured: stay out of the way (the request goes wherever the route
            // sends it; the client's destination headers were removed).
            shared.bump(Counter::Unconfigured);
            true
        }
        _ => {
            shared.bump(Counter::Rejected);
            let mut h = vec![(HEADER_FALLBACK, reason), ("content-type", "application/json")];
            if let Some(j) = &debug {
                h.push((HEADER_DECISION, j));
            }
            reply_or_reset(u32::from(status), h, &ingest::error_body("not_routed", reason));
            false
        }
    }
}

/// The tick period flow control wants: the sync tick, shorter when a queue deadline is nearer.
fn wanted_tick_ms(a: &Active, now: u64) -> u64 {
    let base = a.cfg.filter.sync.tick_ms.max(1);
    match a.router.next_flow_deadline() {
        Some(d) => d.saturating_sub(now).clamp(1, base),
        None => base,
    }
}

/// While requests are held: ticks no later than the nearest queue deadline, and ticks at all
/// when the host refused the period before (asked again here, so held requests never wait on a
/// tick that is not armed). No host call otherwise.
fn ensure_tick(shared: &Shared, a: &Active, now: u64) {
    if a.flow.held.is_empty() {
        return;
    }
    let wanted = wanted_tick_ms(a, now);
    if shared.tick_ms.get() == 0 || wanted < shared.tick_ms.get() {
        set_tick(shared, wanted);
    }
}

/// Ask the host for ticks every `ms` (a refusal keeps the previous period; counted).
fn set_tick(shared: &Shared, ms: u64) {
    match hostcalls::set_tick_period(Duration::from_millis(ms)) {
        Ok(()) => shared.tick_ms.set(ms),
        Err(s) => {
            shared.bump(Counter::InternalErrors);
            log(LogLevel::Warn, &format!("kvroute: setting the tick period: {s:?}"));
        }
    }
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
        self.headers.get(name)
    }

    /// Headers to set upstream, or a local answer, or (flow control queued it) hold it.
    fn decide(&mut self, body: &[u8]) -> Action {
        let now = now_ms();
        self.shared.bump(Counter::Requests);
        let headers = std::mem::take(&mut self.headers);
        let shared = self.shared.clone();
        let Ok(mut slot) = shared.active.try_borrow_mut() else {
            shared.bump(Counter::InternalErrors);
            return self.fail_open("internal", None);
        };
        let Some(a) = slot.as_mut() else {
            drop(slot);
            return self.fail_open("unconfigured", None);
        };
        a.sync(&shared, now);
        let pairs = || headers.iter();
        let req = match RouteRequest::parse(body, pairs(), &a.router.policy().policy.config().request) {
            Ok(req) => req,
            Err(_) => {
                // The core reports (and counts) the error as it routes the request.
                let result = a.router.route_http(body, pairs(), now);
                let routed = apply_route(&shared, a, result);
                return self.routed(routed);
            }
        };
        // Flow control first (with it off, always `Admit`).
        let action = match a.router.admit(&req, body.len() as u64, now) {
            Admission::Admit => {
                let result = a.router.route(&req, now);
                let routed = apply_route(&shared, a, result);
                self.routed(routed)
            }
            Admission::Queued(t) => {
                if let Some(r) = a.router.flow_replica(t) {
                    a.append(&shared, &Entry::flow_queued(t.0, &r));
                }
                a.flow.held.insert(t, Held { context_id: self.context_id, request: req, state: HeldState::Queued });
                self.ticket = Some(t);
                self.phase = Phase::Held;
                shared.bump(Counter::FlowQueued);
                Action::Pause
            }
            Admission::Rejected(r) => {
                self.phase = Phase::Done;
                shared.bump(Counter::FlowRejected);
                if flow_reply(&r) {
                    Action::Pause
                } else {
                    // The answer cannot be sent: fail open rather than hold the request.
                    shared.bump(Counter::InternalErrors);
                    let upstream = fail_open_with(&shared, Some(a), "internal", None);
                    if upstream {
                        Action::Continue
                    } else {
                        Action::Pause
                    }
                }
            }
        };
        // The admission was a dispatch opportunity too (a queue deadline, an eviction).
        a.flow.resume_own = false;
        if a.flow_opportunity(&shared, now, self.context_id) {
            let _ = hostcalls::set_effective_context(self.context_id);
        }
        if std::mem::take(&mut a.flow.resume_own) {
            // Its own request was released at once (not expected: an admission dispatches what
            // it can before queueing): the return value resumes it.
            self.ticket = None;
            self.phase = Phase::Done;
            self.request_id = a.flow.routed.remove(&self.context_id);
            return Action::Continue;
        }
        ensure_tick(&shared, a, now);
        if self.ticket.is_some_and(|t| !a.flow.held.contains_key(&t)) {
            // Released and answered at once.
            self.ticket = None;
            self.phase = Phase::Done;
            return Action::Pause;
        }
        action
    }

    /// The return value for a request routed in its own callback.
    fn routed(&mut self, r: Routed) -> Action {
        self.phase = Phase::Done;
        if r.upstream {
            self.request_id = r.request_id;
            Action::Continue
        } else {
            Action::Pause
        }
    }

    /// Route to the core's fail-open endpoint (`RouterCore::fail_open_endpoint`: least loaded), or
    /// reject when fail-open is off. Request headers must still be paused.
    fn fail_open(&mut self, reason: &str, error: Option<serde_json::Value>) -> Action {
        self.phase = Phase::Done;
        let upstream = match self.shared.active.try_borrow() {
            Ok(slot) => fail_open_with(&self.shared, slot.as_ref(), reason, error),
            Err(_) => fail_open_with(&self.shared, None, reason, error),
        };
        if upstream {
            Action::Continue
        } else {
            Action::Pause
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

    /// The signature of a replica route request (timestamp checked; the MAC is verified by the
    /// caller, over what it covers).
    fn replica_signed(&self, r: &ReplicaSection) -> Result<Signed, (&'static str, String)> {
        let sig = self
            .header(ingest::HEADER_SIGNATURE)
            .ok_or_else(|| ("unauthorized", format!("{} required", ingest::HEADER_SIGNATURE)))?;
        let signature = ingest::parse_signature(sig).map_err(|d| ("unauthorized", d))?;
        let ts = ingest::parse_timestamp(self.header(ingest::HEADER_TIMESTAMP)).map_err(|d| ("unauthorized", d))?;
        if !ingest::timestamp_fresh(ts, now_ms(), r.signature_window_ms) {
            return Err(("stale", format!("{} outside the signature window", ingest::HEADER_TIMESTAMP)));
        }
        Ok(Signed { signature, timestamp_ms: ts })
    }

    fn replica_refused(&self, status: u32, error: &str, detail: &str) -> Action {
        let counter = if status == 401 { Counter::ReplicaUnauthorized } else { Counter::ReplicaRejected };
        self.shared.bump(counter);
        log(LogLevel::Warn, &format!("kvroute: replica request refused ({status} {error}): {detail}"));
        json_reply(status, &ingest::error_body(error, detail));
        Action::Pause
    }

    /// `GET <replica path>/out?cursor=N`: the shared log's effects and completions from `N` on, as
    /// one replica batch for the relay (see `crate::ingest`).
    fn replica_out(&mut self, r: &ReplicaSection) -> Action {
        self.phase = Phase::Done;
        if self.header(":method") != Some("GET") {
            return self.replica_refused(405, "method_not_allowed", "GET only");
        }
        let cursor = match ingest::parse_cursor(self.header(":path").unwrap_or_default()) {
            Ok(c) => c,
            Err(d) => return self.replica_refused(400, "bad_request", &d),
        };
        let signed = match self.replica_signed(r) {
            Ok(s) => s,
            Err((e, d)) => return self.replica_refused(401, e, &d),
        };
        if !ingest::verify_replica_signature(
            r.secret.as_bytes(),
            "out",
            cursor,
            signed.timestamp_ms,
            &[],
            &signed.signature,
        ) {
            return self.replica_refused(401, "unauthorized", "wrong x-kvroute-signature");
        }
        let now = now_ms();
        let Ok(mut slot) = self.shared.active.try_borrow_mut() else {
            self.shared.bump(Counter::InternalErrors);
            json_reply(503, &ingest::error_body("busy", "state busy"));
            return Action::Pause;
        };
        let Some(a) = slot.as_mut() else {
            json_reply(503, &ingest::error_body("unconfigured", "no configuration"));
            return Action::Pause;
        };
        a.sync(&self.shared, now);
        // This VM's deferred completions go out with this export, not one later.
        a.flush_completions(&self.shared);
        /// An exported entry, its request id qualified by the writing VM.
        enum Out {
            Effect(Vec<u8>),
            Complete(String),
        }
        let (max_entries, max_bytes) = (r.max_batch_entries, r.max_batch_bytes);
        // The batch header with the longest ids, and each entry's framing.
        let mut bytes = 4 + 1 + 2 * 65 + 3 * 8 + 4;
        let mut entries: Vec<Out> = Vec::new();
        let mut undecodable = 0u64;
        let read = a.log.export(&mut HostStore, cursor, |origin, entry| {
            let out = match entry {
                Entry::Effect(b) => match RoutingEffect::decode(b) {
                    Ok(mut e) => {
                        e.request_id = sync::export_request_id(origin, &e.request_id);
                        Out::Effect(e.encode())
                    }
                    Err(_) => {
                        undecodable += 1;
                        return true;
                    }
                },
                Entry::Complete(id) => Out::Complete(sync::export_request_id(origin, id)),
                _ => return true,
            };
            let n = 5 + match &out {
                Out::Effect(b) => b.len(),
                Out::Complete(id) => id.len(),
            };
            if entries.len() >= max_entries || (!entries.is_empty() && bytes + n > max_bytes) {
                return false;
            }
            bytes += n;
            entries.push(out);
            true
        });
        let read = match read {
            Ok(x) => x,
            Err(e) => {
                drop(slot);
                self.shared.bump(Counter::SyncErrors);
                log(LogLevel::Warn, &format!("kvroute: reading the shared log for the relay: {e}"));
                json_reply(503, &ingest::error_body("internal", "shared log unreadable"));
                return Action::Pause;
            }
        };
        let log_id = a.log.log_id(&mut HostStore, now);
        drop(slot);
        if undecodable > 0 {
            self.shared.add(Counter::SyncErrors, undecodable);
        }
        let refs: Vec<ReplicaEntryRef<'_>> = entries
            .iter()
            .map(|e| match e {
                Out::Effect(b) => ReplicaEntryRef::EncodedEffect(b),
                Out::Complete(id) => ReplicaEntryRef::Complete(id),
            })
            .collect();
        let body = match ReplicaBatch::encode_entries(&r.fleet, &r.replica_id, log_id, 0, now, &refs) {
            Ok(b) => b,
            Err(e) => {
                self.shared.bump(Counter::InternalErrors);
                json_reply(500, &ingest::error_body("internal", &e.to_string()));
                return Action::Pause;
            }
        };
        self.shared.bump(Counter::ReplicaOut);
        self.shared.add(Counter::ReplicaOutEntries, refs.len() as u64);
        self.shared.add(Counter::ReplicaOutLost, read.lost);
        if read.lost > 0 {
            log(
                LogLevel::Warn,
                &format!("kvroute: {} shared-log entries were overwritten before the relay read them", read.lost),
            );
        }
        let (next, lost, log_text) = (read.next.to_string(), read.lost.to_string(), log_id.to_string());
        let headers = vec![
            ("content-type", "application/octet-stream"),
            (ingest::HEADER_REPLICA_CURSOR, next.as_str()),
            (ingest::HEADER_REPLICA_LOST, lost.as_str()),
            (ingest::HEADER_REPLICA_MORE, if read.more { "1" } else { "0" }),
            (ingest::HEADER_REPLICA_LOG, log_text.as_str()),
            (ingest::HEADER_REPLICA_FLEET, r.fleet.as_str()),
            (ingest::HEADER_REPLICA_ID, r.replica_id.as_str()),
        ];
        if !reply_bytes(200, headers, &body) {
            let _ = hostcalls::close_request_stream();
        }
        Action::Pause
    }

    /// `POST <replica path>/in`: the headers (method, signature timestamp); the body follows.
    fn replica_in_headers(&mut self, r: &ReplicaSection, end_of_stream: bool) -> Action {
        self.phase = Phase::Done;
        if self.header(":method") != Some("POST") {
            return self.replica_refused(405, "method_not_allowed", "POST only");
        }
        let signed = match self.replica_signed(r) {
            Ok(s) => s,
            Err((e, d)) => return self.replica_refused(401, e, &d),
        };
        if end_of_stream {
            self.apply_replica_post(&signed, &[]);
        } else {
            self.phase = Phase::ReplicaIn(signed);
        }
        Action::Pause
    }

    /// Another replica's batch: verified, decoded whole, judged and applied here, then appended
    /// to the shared log for the other VMs (only when applied: what this VM's router ignored,
    /// theirs would ignore too).
    fn apply_replica_post(&mut self, signed: &Signed, body: &[u8]) {
        self.phase = Phase::Done;
        let now = now_ms();
        let Ok(mut slot) = self.shared.active.try_borrow_mut() else {
            self.shared.bump(Counter::InternalErrors);
            json_reply(503, &ingest::error_body("busy", "state busy"));
            return;
        };
        let Some(a) = slot.as_mut() else {
            json_reply(503, &ingest::error_body("unconfigured", "no configuration"));
            return;
        };
        let cfg = a.cfg.clone();
        let Some(r) = cfg.filter.replica.as_ref() else {
            drop(slot);
            json_reply(503, &ingest::error_body("unconfigured", "no replica section"));
            return;
        };
        if !ingest::verify_replica_signature(
            r.secret.as_bytes(),
            "in",
            None,
            signed.timestamp_ms,
            body,
            &signed.signature,
        ) {
            drop(slot);
            self.replica_refused(401, "unauthorized", "wrong x-kvroute-signature");
            return;
        }
        let batch = match ReplicaBatch::decode(body) {
            Ok(b) => b,
            Err(e) => {
                a.router.count_malformed_replica_batch();
                drop(slot);
                self.replica_refused(400, "malformed", &e.to_string());
                return;
            }
        };
        a.sync(&self.shared, now);
        match a.router.apply_replica_batch(&batch, now) {
            Ok(out) => {
                if out.applied {
                    a.append(&self.shared, &Entry::Replica(body));
                }
                drop(slot);
                self.shared.bump(if out.applied { Counter::ReplicaIn } else { Counter::ReplicaInIgnored });
                let answer = serde_json::json!({
                    "verdict": if out.applied { "applied" } else { "ignored" },
                    "effects": out.effects, "completions": out.completions, "skipped": out.skipped,
                });
                json_reply(200, &answer.to_string());
            }
            Err(e) => {
                drop(slot);
                self.shared.bump(Counter::InternalErrors);
                log(LogLevel::Warn, &format!("kvroute: replica batch of {} not applied: {e}", batch.replica));
                json_reply(503, &ingest::error_body("internal", &e.to_string()));
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
                    let (held, replicas) = (a.flow.held.len() as u64, a.flow.replicas.len() as u64);
                    let filter = counters.exposition(&a.log.stats, a.log.instance(), held, replicas);
                    let replica = a.router.replica_stats().map(|r| crate::counters::replica_exposition(&r));
                    format!("{}{}{}", a.router.metrics_text(now), filter, replica.unwrap_or_default())
                }
                None => String::new(),
            },
            Err(_) => String::new(),
        };
        reply_or_reset(200, vec![("content-type", "text/plain; version=0.0.4")], &text);
        Action::Pause
    }

    /// The stream ends: a held request is cancelled (its client went away), a routed one is
    /// completed (a dispatch opportunity: its slot is free).
    fn finish(&mut self) {
        if self.request_id.is_none() && self.ticket.is_none() {
            let Ok(slot) = self.shared.active.try_borrow() else { return };
            if slot.as_ref().is_none_or(|a| a.flow.routed.is_empty()) {
                return;
            }
        }
        let shared = self.shared.clone();
        let Ok(mut slot) = shared.active.try_borrow_mut() else {
            shared.bump(Counter::InternalErrors);
            return;
        };
        let Some(a) = slot.as_mut() else { return };
        if let Some(t) = self.ticket.take() {
            a.flow.retry.retain(|x| *x != t);
            match a.flow.held.remove(&t).map(|h| h.state) {
                Some(HeldState::Queued) => {
                    if a.router.cancel(t) {
                        a.append(&shared, &Entry::FlowLeft { ticket: t.0 });
                    }
                    shared.bump(Counter::FlowCancelled);
                }
                // Routed, not resumed yet: it is in flight all the same.
                Some(HeldState::Resuming(id)) => self.request_id = id,
                // Released but never acted on (its stream was unreachable): nothing to end.
                Some(HeldState::Released(..)) | None => {}
            }
        }
        if let Some(id) = a.flow.routed.remove(&self.context_id) {
            self.request_id = Some(id);
        }
        // The time matters only to flow control (its queue deadlines, a retried release): with
        // it off and nothing held or retried, the last time the host told serves (one host call
        // less per request; neither `ensure_tick` nor `take_releases_into` reads it then).
        let idle = a.flow.held.is_empty()
            && a.flow.retry.is_empty()
            && !a.router.policy().policy.config().flow_control.enabled;
        let now = if idle { LAST_NOW_MS.try_with(Cell::get).unwrap_or(0) } else { now_ms() };
        ensure_tick(&shared, a, now);
        let Some(id) = self.request_id.take() else { return };
        // Unknown: expired after the in-flight timeout, or the router was rebuilt.
        if a.router.complete(&id).is_ok() {
            a.append_complete(&shared, &id);
            if a.flow_opportunity(&shared, now, self.context_id) {
                let _ = hostcalls::set_effective_context(self.context_id);
            }
        }
    }

    /// The body is complete (end of stream or trailers): decide.
    fn body_done(&mut self, body_size: usize) -> Action {
        let body = match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size) {
            Ok(b) => b.unwrap_or_default(),
            Err(s) => {
                self.shared.bump(Counter::InternalErrors);
                log(LogLevel::Warn, &format!("kvroute: reading the request body: {s:?}"));
                if let Phase::Event(..) | Phase::ReplicaIn(..) = self.phase {
                    // An event post or replica batch never goes upstream.
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
            Phase::ReplicaIn(signed) => {
                self.apply_replica_post(&signed, &body);
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
            Phase::ReplicaIn(..) => a.cfg.filter.replica.as_ref().map_or(usize::MAX, |r| r.max_batch_bytes),
            _ => a.router.policy().policy.config().request.max_body_bytes,
        }
    }
}

impl Context for Http {
    fn on_done(&mut self) -> bool {
        self.finish();
        true
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // A client must never choose the upstream itself (Envoy follows the destination header),
        // and no x-kvroute-* header goes upstream, whatever the path (the event protocol's
        // secret and signature included): they are removed from the request here, and the ones
        // the filter reads (event posts, the core's own headers) are kept in `self.headers`.
        let read = hostcalls::with_map_pairs(MapType::HttpRequestHeaders, |pairs| {
            let bytes = pairs.iter().map(|(k, v)| k.len() + v.len()).sum();
            let mut headers = HeaderList::with_capacity(pairs.len(), bytes);
            for (k, v) in pairs {
                let k = header_text(k);
                let routing = ROUTING_HEADERS.iter().any(|h| h.eq_ignore_ascii_case(&k));
                if routing || is_kvroute_header(&k) {
                    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &k, None);
                }
                if !routing {
                    headers.push(&k, &header_text(v));
                }
            }
            headers
        });
        match read {
            Ok(headers) => self.headers = headers,
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
                self.headers = HeaderList::default();
                for k in [":path", ":method"] {
                    if let Ok(Some(v)) = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, k) {
                        self.headers.push(k, &String::from_utf8_lossy(&v));
                    }
                }
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
            match cfg.filter.replica.as_ref().and_then(|r| Some((r, r.route(path)?))) {
                Some((r, ReplicaRoute::Out)) => return self.replica_out(r),
                Some((r, ReplicaRoute::In)) => return self.replica_in_headers(r, end_of_stream),
                None => {}
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
            Phase::Buffering | Phase::Event(..) | Phase::ReplicaIn(..) => {}
            // Held by flow control: only its release lets it go on.
            Phase::Held => return Action::Pause,
            _ => return Action::Continue,
        }
        if body_size > self.body_limit() {
            if let Phase::ReplicaIn(..) = self.phase {
                self.phase = Phase::Done;
                self.shared.bump(Counter::ReplicaRejected);
                json_reply(413, &ingest::error_body("too_large", "replica batch over max_batch_bytes"));
                return Action::Pause;
            }
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
            Phase::Buffering | Phase::Event(..) | Phase::ReplicaIn(..) => self.body_done(usize::MAX),
            Phase::Held => Action::Pause,
            _ => Action::Continue,
        }
    }

    fn on_log(&mut self) {
        self.finish();
    }
}
