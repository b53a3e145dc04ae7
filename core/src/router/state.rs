//! [`RouterCore`]: the state tables (endpoints, both indexes, in-flight requests, sessions,
//! counters) and every operation on them except the decision itself (`route.rs`), replication
//! (`replication.rs`) and the metrics page (`exposition.rs`).

use std::num::NonZeroUsize;
use std::sync::Arc;

use lru::LruCache;
use serde::Serialize;
use xxhash_rust::xxh3::Xxh3DefaultBuilder;

use super::inflight::{id_hash, Inflight, InflightTable, RequestIds, SlotRef};
use super::kv_cell::KvCell;
use super::policy::ActivePolicy;
use super::route::{DecideScratch, KeyBufs};
use crate::config::Policy;
use crate::endpoints::{validate_endpoint_id, EndpointSpec, EndpointState, EndpointTable, MetricsSnapshot, Role};
use crate::error::{ConfigError, EventIngestError, StateError};
use crate::flow::{FlowController, FlowStats};
use crate::index::{ApproxIndex, IndexStats};
use crate::precise::events::EventBatch;
use crate::precise::{ApplyOutcome, KvIndex, PreciseStats};
use crate::request::RouteRequest;

/// Counters kept by the router (for metrics exposition by the bindings).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RouterCounters {
    /// Decisions per rule, indexed like [`Rule::ALL`](crate::Rule::ALL).
    pub decisions_by_rule: [u64; 7],
    /// Route calls that returned an error.
    pub route_errors: u64,
    /// Successful reloads.
    pub reloads: u64,
    /// Rejected reloads.
    pub reload_failures: u64,
    /// Index resets caused by a change of hashing parameters.
    pub index_resets: u64,
    /// Requests dropped from in-flight tracking without `complete` (timeout or overflow).
    pub inflight_expired: u64,
    /// Requests the tokenizer failed on (routed without precise keys).
    pub tokenize_errors: u64,
    /// Routed decisions by the target's prefix hit: counts with hit ≤ 0.1, ≤ 0.2, … ≤ 1.0
    /// (cumulative, as Prometheus histogram buckets).
    pub prefix_hit_buckets: [u64; 10],
    /// Sum of the routed decisions' prefix hits.
    pub prefix_hit_sum: f64,
    /// Routed (not shed) decisions.
    pub routed: u64,
    /// Routing effects of other router instances applied (`Router::apply_effect`).
    pub effects_applied: u64,
}

impl RouterCounters {
    /// Add `o`'s counts to these.
    pub(super) fn add(&mut self, o: &RouterCounters) {
        // Destructured: a counter added later cannot be left out of the sum.
        let RouterCounters {
            decisions_by_rule,
            route_errors,
            reloads,
            reload_failures,
            index_resets,
            inflight_expired,
            tokenize_errors,
            prefix_hit_buckets,
            prefix_hit_sum,
            routed,
            effects_applied,
        } = o;
        for (a, b) in self.decisions_by_rule.iter_mut().zip(decisions_by_rule) {
            *a += b;
        }
        for (a, b) in self.prefix_hit_buckets.iter_mut().zip(prefix_hit_buckets) {
            *a += b;
        }
        self.route_errors += route_errors;
        self.reloads += reloads;
        self.reload_failures += reload_failures;
        self.index_resets += index_resets;
        self.inflight_expired += inflight_expired;
        self.tokenize_errors += tokenize_errors;
        self.prefix_hit_sum += prefix_hit_sum;
        self.routed += routed;
        self.effects_applied += effects_applied;
    }
}

/// A snapshot of the router's state.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RouterStats {
    /// Active policy version.
    pub policy_version: u64,
    /// Registered endpoints.
    pub endpoints: usize,
    /// Requests in flight.
    pub inflight_requests: usize,
    /// Approximate index figures.
    pub index: IndexStats,
    /// Precise index figures and event counters.
    pub precise: PreciseStats,
    /// Counters.
    pub counters: RouterCounters,
    /// Flow control: queue sizes by band and counters.
    pub flow: FlowStats,
}

/// One endpoint as the router sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EndpointInfo {
    /// Id.
    pub id: Arc<str>,
    /// Role.
    pub role: Role,
    /// Health flag.
    pub healthy: bool,
    /// Last metrics snapshot.
    pub metrics: Option<MetricsSnapshot>,
    /// Router-side in-flight requests.
    pub inflight: u32,
    /// Approximate-index memberships.
    pub index_memberships: u32,
    /// Precise-index memberships.
    pub precise_memberships: u32,
    /// Whether its KV event stream is healthy (has delivered events, not recovering from a gap),
    /// judged at the time of the last routing decision or event.
    pub events_healthy: bool,
}

/// The router's state machine: endpoints, the approximate and precise indexes, in-flight
/// requests, sessions and counters, with the one decision path ([`RouterCore::route`]).
///
/// Single-threaded and synchronous: every method takes `&mut self` (or `&self`), time is a
/// parameter, and it owns its scratch buffers. Hold one directly where calls are already
/// serialized (the Envoy filter: one per VM), or share a [`Router`](crate::Router), which wraps
/// one behind a readers-writer lock with the policy in a lock-free cell, hashes requests outside
/// the lock and runs each decision's read phase under the shared lock.
pub struct RouterCore {
    pub(super) active: Arc<ActivePolicy>,
    pub(super) endpoints: EndpointTable,
    /// The approximate index: read through `Deref`, changed through [`Versioned::write`].
    pub(super) index: Versioned<ApproxIndex>,
    /// The precise index: read through [`KvCell::read`], changed through [`KvCell::write`]
    /// (counted likewise); two copies under a [`Router`](crate::Router) (see `kv_cell.rs`).
    pub(super) kv: KvCell,
    /// Requests in flight, request ids, sessions, counters, the picker's draws and the latest
    /// time seen: what every decision and completion books, in [`LEDGERS`] ledgers. A
    /// [`Router`](crate::Router) keeps them beside the core, each ledger under a lock of its
    /// own, so that decisions whose index writes are no-ops book under its shared lock into one
    /// ledger ([`RouterCore::commit_shared`]); it puts them back here for every call under its
    /// exclusive lock.
    pub(super) books: Books,
    pub(super) record_effects: bool,
    /// Replication to other router replicas (`replication.rs`), when enabled.
    pub(super) replica: Option<Box<super::replication::ReplicaState>>,
    /// Flow control (queues, limits, dispatch; `router/flow.rs`).
    pub(super) flow: FlowController,
    #[cfg(feature = "tokenizer")]
    pub(super) tokenizer: Option<Arc<crate::tokenize::Tokenizer>>,
    /// Bumped by every change a decision's read phase cannot have seen safely (see
    /// `route::Plan`): endpoints added, removed or re-roled, health, policy, replication,
    /// effects recording.
    pub(super) epoch: u64,
    // Scratch buffers of the decision (kept between calls: no allocation per decision).
    pub(super) decide_buf: DecideScratch,
    pub(super) keys_buf: KeyBufs,
}

impl std::fmt::Debug for RouterCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterCore")
            .field("policy_version", &self.active.version)
            .field("endpoints", &self.endpoints.len())
            .field("inflight", &self.books.inflight_len())
            .finish_non_exhaustive()
    }
}

impl Default for RouterCore {
    fn default() -> Self {
        RouterCore::new(Policy::default())
    }
}

/// An index and the count of the write accesses to it: a decision's read phase notes the count,
/// and its write phase knows the index unchanged since when the count is the same (so a write
/// the read phase found to be a no-op can be skipped). Reads go through `Deref`; the only way to
/// change the index is [`Versioned::write`], which counts, so no change can go unnoticed.
pub(super) struct Versioned<T> {
    inner: T,
    writes: u64,
}

impl<T> Versioned<T> {
    pub(super) fn new(inner: T) -> Self {
        Versioned { inner, writes: 0 }
    }

    /// The index, to change it (counted).
    pub(super) fn write(&mut self) -> &mut T {
        self.writes = self.writes.wrapping_add(1);
        &mut self.inner
    }

    /// Write accesses so far.
    pub(super) fn writes(&self) -> u64 {
        self.writes
    }
}

impl<T> std::ops::Deref for Versioned<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.inner
    }
}

pub(super) fn nz(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN)
}

fn unknown(id: &str) -> StateError {
    StateError::UnknownEndpoint { id: id.to_owned() }
}

impl RouterCore {
    /// A router core running `policy` (version 1) with no endpoints.
    pub fn new(policy: Policy) -> RouterCore {
        let active = Arc::new(ActivePolicy::new(policy, 1));
        let cfg = active.policy.config();
        RouterCore {
            endpoints: EndpointTable::default(),
            index: Versioned::new({
                let mut ix = ApproxIndex::new(active.fingerprint, active.capacity);
                crate::index::reserve_as_configured(&mut ix, cfg.index.reserve_blocks);
                ix
            }),
            kv: KvCell::new(KvIndex::new(cfg, active.precise_fingerprint, active.precise_capacity)),
            books: Books::new(cfg.limits.session_capacity),
            record_effects: false,
            replica: None,
            flow: FlowController::new(cfg),
            #[cfg(feature = "tokenizer")]
            tokenizer: None,
            epoch: 0,
            decide_buf: DecideScratch::default(),
            keys_buf: KeyBufs::default(),
            active,
        }
    }

    /// A router core from a JSON policy document.
    pub fn from_json(text: &str) -> Result<RouterCore, ConfigError> {
        Policy::from_json(text).map(RouterCore::new)
    }

    /// The active policy.
    pub fn policy(&self) -> &Arc<ActivePolicy> {
        &self.active
    }

    /// Use `tokenizer` to compute precise keys for text and chat requests (see
    /// [`Router::set_tokenizer`](crate::Router::set_tokenizer)).
    #[cfg(feature = "tokenizer")]
    pub fn set_tokenizer(&mut self, tokenizer: Option<Arc<crate::tokenize::Tokenizer>>) {
        self.tokenizer = tokenizer;
    }

    /// Swap in a new (already validated) policy and return its version (see
    /// [`Router::reload`](crate::Router::reload) for what happens to state).
    pub fn reload(&mut self, policy: Policy) -> u64 {
        self.bump_epoch();
        let new = Arc::new(ActivePolicy::new(policy, self.active.version + 1));
        if new.fingerprint != self.index.fingerprint() {
            self.index.write().reset(new.fingerprint);
            self.books.counters.index_resets += 1;
        }
        if new.capacity != self.active.capacity {
            self.index.write().set_capacity(new.capacity);
        }
        let cfg = new.policy.config();
        let old = &self.active.policy.config().index;
        if cfg.index.reserve_blocks != old.reserve_blocks {
            crate::index::reserve_as_configured(self.index.write(), cfg.index.reserve_blocks);
        }
        if cfg.index.precise.reserve_blocks != old.precise.reserve_blocks {
            let n = cfg.index.precise.reserve_blocks;
            self.kv.write(|kv| kv.reserve_as_configured(n));
        }
        if new.precise_fingerprint != self.kv.read().fingerprint() {
            self.kv.write(|kv| kv.reconfigure(cfg, new.precise_fingerprint));
            self.books.counters.index_resets += 1;
        }
        self.kv.write(|kv| kv.set_speculative_ttl(cfg.index.speculative_ttl_ms));
        self.kv.write(|kv| kv.set_capacity(new.precise_capacity, cfg.index.precise.key_map_capacity));
        self.kv.keep_copies(cfg.index.precise.two_copies);
        self.bound_inflight(cfg.limits.max_inflight_requests);
        self.books.sessions.resize(nz(cfg.limits.session_capacity));
        self.books.counters.reloads += 1;
        self.active = new;
        let RouterCore { flow, endpoints, active, .. } = self;
        flow.reconfigure(&crate::flow::Ctx { policy: active.policy.config(), endpoints });
        self.active.version
    }

    /// Parse (JSON if it starts with `{`, else YAML), validate and reload. On error the active
    /// policy is untouched and keeps serving.
    pub fn reload_str(&mut self, text: &str) -> Result<u64, ConfigError> {
        match Policy::from_str_auto(text) {
            Ok(p) => Ok(self.reload(p)),
            Err(e) => {
                self.books.counters.reload_failures += 1;
                Err(e)
            }
        }
    }

    /// Register an endpoint, or change the role of a registered one (its index entries, metrics
    /// and counters are kept).
    pub fn upsert_endpoint(&mut self, spec: EndpointSpec) -> Result<(), StateError> {
        validate_endpoint_id(&spec.id)?;
        self.bump_epoch();
        if let Some(slot) = self.endpoints.slot_of(&spec.id) {
            if let Some(ep) = self.endpoints.get_mut(slot) {
                ep.role = spec.role;
            }
            return Ok(());
        }
        let limit = self.active.policy.config().limits.max_endpoints;
        if self.endpoints.len() >= limit {
            return Err(StateError::TooManyEndpoints { limit });
        }
        let RouterCore { endpoints, index, kv, .. } = self;
        let slot = {
            let kv = kv.read();
            endpoints.insert(&spec, |s| index.slot_reusable(s) && kv.slot_reusable(s))
        };
        index.write().activate(slot as usize);
        kv.write(|kv| kv.activate(slot as usize));
        Ok(())
    }

    /// Remove an endpoint: its index entries are purged (at once for routing; memory is reclaimed
    /// by the sweeper) and requests still in flight there are forgotten.
    pub fn remove_endpoint(&mut self, id: &str) -> Result<(), StateError> {
        let slot = self.endpoints.remove(id).ok_or_else(|| unknown(id))?;
        self.bump_epoch();
        self.index.write().retire(slot as usize);
        self.kv.write(|kv| kv.retire(slot as usize));
        Ok(())
    }

    /// Store a metrics snapshot (see [`Router::update_metrics`](crate::Router::update_metrics)).
    pub fn update_metrics(&mut self, id: &str, metrics: MetricsSnapshot) -> Result<(), StateError> {
        metrics.validate(id)?;
        let slot = self.endpoints.slot_of(id).ok_or_else(|| unknown(id))?;
        if let Some(ep) = self.endpoints.get_mut(slot) {
            ep.set_metrics(metrics);
        }
        Ok(())
    }

    /// Read `endpoint`'s `/metrics` page (vLLM or SGLang Prometheus text, taken at `now_ms`) and
    /// store the snapshot; returns it. A page that cannot be read changes nothing.
    pub fn update_metrics_from_prometheus(
        &mut self,
        endpoint: &str,
        text: &str,
        now_ms: u64,
    ) -> Result<MetricsSnapshot, crate::metrics::MetricsError> {
        let m = crate::metrics::parse_prometheus(text, now_ms)?;
        self.update_metrics(endpoint, m.clone())?;
        Ok(m)
    }

    /// Mark an endpoint healthy or not (unhealthy endpoints are never picked).
    pub fn set_healthy(&mut self, id: &str, healthy: bool) -> Result<(), StateError> {
        let slot = self.endpoints.slot_of(id).ok_or_else(|| unknown(id))?;
        if let Some(ep) = self.endpoints.get_mut(slot) {
            ep.healthy = healthy;
        }
        self.bump_epoch();
        Ok(())
    }

    /// Every endpoint, in id order.
    pub fn endpoints(&self) -> Vec<EndpointInfo> {
        let kv = self.kv.read();
        self.endpoints
            .order()
            .iter()
            .filter_map(|&s| self.endpoints.get(s).map(|e| (s, e)))
            .map(|(s, e)| EndpointInfo {
                id: e.id.clone(),
                role: e.role,
                healthy: e.healthy,
                metrics: e.metrics.clone(),
                inflight: e.load.inflight(),
                index_memberships: self.index.memberships_of(s as usize),
                precise_memberships: kv.blocks().memberships_of(s as usize),
                events_healthy: kv.healthy(s as usize, self.books.last_now_ms()),
            })
            .collect()
    }

    /// Where to send a request the router could not route (see
    /// [`Router::fail_open_endpoint`](crate::Router::fail_open_endpoint)).
    pub fn fail_open_endpoint(&self) -> Option<Arc<str>> {
        let load = |e: &&EndpointState| (e.load.inflight(), e.metrics.as_ref().map_or(0, |m| m.waiting));
        let tiers: [fn(&EndpointState) -> bool; 3] = [|e| e.healthy && e.role.decodes(), |e| e.healthy, |_| true];
        tiers.iter().find_map(|keep| {
            let all = self.endpoints.order().iter().filter_map(|&s| self.endpoints.get(s));
            all.filter(|e| keep(e)).min_by_key(load).map(|e| e.id.clone())
        })
    }

    /// A snapshot of sizes and counters.
    pub fn stats(&self) -> RouterStats {
        let (inflight_requests, counters) = {
            let b = &self.books;
            (b.inflight_len(), b.counters())
        };
        RouterStats {
            policy_version: self.active.version,
            endpoints: self.endpoints.len(),
            inflight_requests,
            index: self.index.stats(),
            precise: PreciseStats { copies: self.kv.copies(), ..self.kv.read().stats() },
            counters,
            flow: self.flow.stats(self.active.policy.config().flow_control.enabled),
        }
    }

    /// The request finished (response fully sent or failed): release its in-flight counters.
    pub fn complete(&mut self, request_id: &str) -> Result<(), StateError> {
        release_request(&self.endpoints, &mut self.books, request_id)?;
        if let Some(r) = &mut self.replica {
            if r.cfg.publish && !request_id.starts_with(crate::replica::REMOTE_PREFIX) {
                r.outbox.push_complete(&r.cfg, request_id);
            }
        }
        Ok(())
    }

    /// [`RouterCore::complete`] under a shared lock ([`Router`](crate::Router)'s completions, on
    /// the router's `books`): `None` (nothing done) when completions are published to replicas,
    /// which needs the exclusive lock; otherwise the request leaves the books, and the caller
    /// takes it off its endpoints' loads ([`RouterCore::release`]), which needs no lock of the
    /// books.
    ///
    /// `hash`: the id's [`id_hash`](super::inflight::id_hash), computed before the books' lock.
    /// `ledger`: the request's ledger ([`ledger_of`]).
    pub(super) fn complete_shared(
        &self,
        ledger: &mut Ledger,
        request_id: &str,
        hash: u64,
    ) -> Option<Result<Inflight, StateError>> {
        if self.replica.as_ref().is_some_and(|r| r.cfg.publish) {
            return None;
        }
        Some(ledger.inflight.remove_hashed(hash, request_id).ok_or_else(|| unknown_request(request_id)))
    }

    /// Decode one KV-event payload published by `endpoint`'s engine and apply it to the precise
    /// index (see [`Router::apply_events`](crate::Router::apply_events)).
    pub fn apply_events(
        &mut self,
        endpoint: &str,
        payload: &[u8],
        seq: Option<u64>,
        now_ms: u64,
    ) -> Result<ApplyOutcome, EventIngestError> {
        let batch = crate::precise::events::decode_batch(payload)?;
        Ok(self.apply_batch(endpoint, &batch, seq, now_ms)?)
    }

    /// Apply an already decoded batch from `endpoint` (see [`RouterCore::apply_events`]).
    pub fn apply_batch(
        &mut self,
        endpoint: &str,
        batch: &EventBatch,
        seq: Option<u64>,
        now_ms: u64,
    ) -> Result<ApplyOutcome, StateError> {
        let slot = self.endpoints.slot_of(endpoint).ok_or_else(|| unknown(endpoint))?;
        self.books.last_now_ms = self.books.last_now_ms.max(now_ms);
        Ok(self.kv.write(|kv| apply_at(kv, slot, batch, seq, now_ms)))
    }

    /// [`RouterCore::apply_batch`] under a shared lock ([`Router`](crate::Router)'s event
    /// application, beside decisions: see [`KvCell::write_shared`]), leaving the books' latest
    /// time to the caller; `None` when the index has one copy (then it needs the exclusive lock).
    pub(super) fn apply_batch_shared(
        &self,
        endpoint: &str,
        batch: &EventBatch,
        seq: Option<u64>,
        now_ms: u64,
    ) -> Option<Result<ApplyOutcome, StateError>> {
        let Some(slot) = self.endpoints.slot_of(endpoint) else { return Some(Err(unknown(endpoint))) };
        self.kv.write_shared(|kv| apply_at(kv, slot, batch, seq, now_ms)).map(Ok)
    }

    /// Count a replay attempt of `endpoint`'s event subscriber (for `metrics_text`).
    pub fn record_replay(&mut self, endpoint: &str, ok: bool) -> Result<(), StateError> {
        self.endpoints.slot_of(endpoint).ok_or_else(|| unknown(endpoint))?;
        self.kv.write(|kv| kv.record_replay(ok));
        Ok(())
    }

    /// Give up on `endpoint`'s gapped event stream (see
    /// [`Router::resync_stream`](crate::Router::resync_stream)).
    pub fn resync_stream(&mut self, endpoint: &str, now_ms: u64) -> Result<(), StateError> {
        let recovery = self.active.policy.config().index.precise.stale_recovery_ms;
        let slot = self.endpoints.slot_of(endpoint).ok_or_else(|| unknown(endpoint))?;
        self.kv.write(|kv| kv.resync(slot as usize, now_ms, recovery));
        Ok(())
    }

    /// Attach a [`RoutingEffect`](crate::RoutingEffect) to every (non-shed) decision from now on
    /// (see [`Router::record_effects`](crate::Router::record_effects)).
    pub fn record_effects(&mut self, on: bool) {
        self.bump_epoch();
        self.record_effects = on;
    }

    pub(super) fn slot(&self, id: &str) -> Result<u16, StateError> {
        self.endpoints.slot_of(id).ok_or_else(|| unknown(id))
    }

    pub(super) fn release(&self, f: &Inflight) {
        release(&self.endpoints, f);
    }

    pub(super) fn expire_inflight(&mut self, now_ms: u64, timeout_ms: u64) {
        while let Some(f) = self.books.pop_oldest_if(|f| now_ms.saturating_sub(f.started_ms) > timeout_ms) {
            self.release(&f);
            self.books.counters.inflight_expired += 1;
        }
    }

    /// Keep at most `max` requests in flight, dropping the oldest.
    pub(super) fn bound_inflight(&mut self, max: usize) {
        let RouterCore { books, endpoints, .. } = self;
        bound_inflight(endpoints, books, max);
    }

    pub(super) fn live_ref(&self, r: SlotRef) -> bool {
        self.endpoints.get(r.slot).is_some_and(|e| e.incarnation == r.incarnation)
    }

    /// Count a request of `tokens` tokens in flight at `slot`, sent there at `now_ms`.
    pub(super) fn track(&self, slot: u16, now_ms: u64, tokens: u64) -> SlotRef {
        track(&self.endpoints, slot, now_ms, tokens)
    }
}

/// Ledgers the books keep requests in flight in (see [`Books`]).
pub(crate) const LEDGERS: usize = 8;

/// The ledger that keeps request `id` (`hash`: its [`id_hash`](super::inflight::id_hash)), a
/// function of the id alone, so a completion finds its request wherever it was routed from:
/// - an id `X~N` (a reused id made unique, `N` digits) is kept where `X` is, so the suffixes
///   of a reused id are found in the ledger that holds it;
/// - an id `kvr-N` (as generated, or given in that form): `(N - 1) mod LEDGERS`, so a
///   generated id lands in the ledger that made it;
/// - any other id: bits of its hash.
pub(crate) fn ledger_of(id: &str, hash: u64) -> usize {
    let mut base = id;
    while let Some((b, n)) = base.rsplit_once('~') {
        if n.is_empty() || !n.bytes().all(|d| d.is_ascii_digit()) {
            break;
        }
        base = b;
    }
    let hash = if base.len() == id.len() { hash } else { id_hash(base) };
    match base.strip_prefix("kvr-").and_then(|n| n.parse::<u64>().ok()).filter(|&n| n > 0) {
        Some(n) => ((n - 1) % LEDGERS as u64) as usize,
        // Bits the in-flight table's probing does not use (it takes the low and the top bits).
        None => ((hash >> 32) % LEDGERS as u64) as usize,
    }
}

/// The ledger a decision for `req` books into: its caller's id's ([`ledger_of`]), else the
/// caller's home ledger (`home`, asked only then).
pub(crate) fn ledger_for(req: &RouteRequest, home: impl FnOnce() -> usize) -> usize {
    req.request_id.as_deref().map_or_else(home, |id| ledger_of(id, id_hash(id)))
}

/// One of the books' ledgers: requests in flight whose ids map to it ([`ledger_of`]), the ids it
/// generates and the memory of its reused ids, and the picker's draws, the counters and the
/// latest time of the decisions booked into it. A [`Router`](crate::Router) locks one ledger
/// per booking and per completion, and a thread books its generated ids into a ledger of its
/// own, so threads neither wait for one another there nor write the same lines.
#[derive(Debug)]
pub(crate) struct Ledger {
    pub(super) inflight: InflightTable,
    pub(super) ids: RequestIds,
    pub(super) counters: RouterCounters,
    /// Picker draws made (the tie-break's randomness) by decisions booked here.
    pub(super) draws: u64,
    /// Ids generated here (the `k`-th is `kvr-{k·LEDGERS + index + 1}`).
    pub(super) generated: u64,
    /// The latest `now` of the decisions booked here.
    pub(super) last_now_ms: u64,
}

impl Ledger {
    pub(super) fn new(index: usize) -> Ledger {
        Ledger {
            inflight: InflightTable::new(),
            ids: RequestIds::new(),
            counters: RouterCounters::default(),
            // Each ledger's draws start apart, so that decisions on different threads draw
            // different tie-breaks (ledger 0, a single thread's, starts at 0 as before).
            draws: (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            generated: 0,
            last_now_ms: 0,
        }
    }

    /// The id of a new decision for `req` booked into this ledger, `index` (the one
    /// [`ledger_for`] gives `req`): the caller's id, made unique when reused while in flight
    /// (its suffixes are this ledger's too), or one this ledger generates.
    pub(super) fn assign(&mut self, req: &RouteRequest, index: usize) -> String {
        let id = match &req.request_id {
            Some(id) => {
                let Ledger { ids, inflight, .. } = self;
                ids.assign(id, |c| inflight.contains(c))
            }
            None => self.generate_id(index),
        };
        debug_assert_eq!(ledger_of(&id, id_hash(&id)), index, "an id is booked into its ledger");
        id
    }

    /// A new id generated by ledger `index` (this one), unique among the requests it holds.
    pub(super) fn generate_id(&mut self, index: usize) -> String {
        loop {
            // Skip ids in flight (replicated from another instance, or given by a caller).
            self.generated += 1;
            let n = (self.generated - 1) * LEDGERS as u64 + index as u64 + 1;
            let id = format!("kvr-{n}");
            if !self.inflight.contains(&id) {
                return id;
            }
        }
    }
}

/// What decisions and completions book besides the endpoints' loads and the indexes (see
/// `RouterCore::books`): the ledgers (requests in flight, ids, draws, counters), the sessions and
/// the counters of calls outside a decision's booking.
pub(crate) struct Books {
    pub(super) sessions: LruCache<u64, SlotRef, Xxh3DefaultBuilder>,
    /// `LEDGERS` ledgers (boxed: a [`Router`](crate::Router) swaps them in and out by pointer
    /// for every call under its exclusive lock).
    #[allow(clippy::vec_box)]
    pub(super) ledgers: Vec<Box<Ledger>>,
    /// The ledger this caller books its generated ids into (a `Router` sets its thread's; 0
    /// for a `RouterCore` on its own).
    pub(super) home: usize,
    pub(super) counters: RouterCounters,
    /// The latest `now` seen outside the ledgers (events, maintenance), for reporting stream
    /// health (see [`Books::last_now_ms`]).
    pub(super) last_now_ms: u64,
}

impl Books {
    pub(super) fn new(session_capacity: usize) -> Books {
        Books {
            sessions: LruCache::with_hasher(nz(session_capacity), Xxh3DefaultBuilder),
            ledgers: (0..LEDGERS).map(|i| Box::new(Ledger::new(i))).collect(),
            home: 0,
            counters: RouterCounters::default(),
            last_now_ms: 0,
        }
    }

    /// The latest `now` seen (routing or events).
    pub(super) fn last_now_ms(&self) -> u64 {
        self.ledgers.iter().map(|l| l.last_now_ms).fold(self.last_now_ms, u64::max)
    }

    /// The ledger of request `id`.
    fn ledger(&self, id: &str) -> &Ledger {
        &self.ledgers[ledger_of(id, id_hash(id))]
    }

    pub(super) fn contains(&self, id: &str) -> bool {
        self.ledger(id).inflight.contains(id)
    }

    /// Add (or replace) request `id` in its ledger.
    pub(super) fn insert(&mut self, id: &str, target: SlotRef, prefill: Option<SlotRef>, started_ms: u64, tokens: u64) {
        let hash = id_hash(id);
        self.ledgers[ledger_of(id, hash)].inflight.insert(id, target, prefill, started_ms, tokens);
    }

    pub(super) fn remove(&mut self, id: &str) -> Option<Inflight> {
        let hash = id_hash(id);
        self.ledgers[ledger_of(id, hash)].inflight.remove_hashed(hash, id)
    }

    /// Requests in flight.
    pub(super) fn inflight_len(&self) -> usize {
        self.ledgers.iter().map(|l| l.inflight.len()).sum()
    }

    /// The ledger whose oldest request in flight is the oldest (the lowest index among those
    /// that started in the same millisecond), and when it started.
    fn oldest(&self) -> Option<(usize, u64)> {
        let fronts = self.ledgers.iter().enumerate().filter_map(|(i, l)| l.inflight.oldest_started().map(|t| (i, t)));
        fronts.min_by_key(|&(i, t)| (t, i))
    }

    /// When the oldest request in flight started (`None`: none in flight).
    #[cfg(test)]
    pub(crate) fn oldest_started(&self) -> Option<u64> {
        self.oldest().map(|(_, t)| t)
    }

    /// Remove and return the oldest request in flight if `take(request)` holds.
    pub(super) fn pop_oldest_if(&mut self, take: impl Fn(&Inflight) -> bool) -> Option<Inflight> {
        let (i, _) = self.oldest()?;
        self.ledgers[i].inflight.pop_oldest_if(take)
    }

    /// Remove and return every request whose id satisfies `take`.
    pub(super) fn drain_where(&mut self, take: impl Fn(&str) -> bool) -> Vec<Inflight> {
        self.ledgers.iter_mut().flat_map(|l| l.inflight.drain_where(&take)).collect()
    }

    /// The counters: those kept outside the ledgers, then every ledger's.
    pub(super) fn counters(&self) -> RouterCounters {
        let mut c = self.counters.clone();
        for l in &self.ledgers {
            c.add(&l.counters);
        }
        c
    }

    /// The ledger a decision for `req` books into: its caller's id's, else the home ledger.
    pub(crate) fn ledger_for(&self, req: &RouteRequest) -> usize {
        ledger_for(req, || self.home)
    }

    /// Ledger `index` as a booking on the shared path holds it, the other ledgers read as they
    /// are (a `Router` reads what they last published instead), for one more request in flight
    /// under the bound `max`.
    #[cfg(test)]
    pub(crate) fn hold(&mut self, index: usize, max: usize) -> LedgerHold<'_> {
        let fits = self.inflight_len() < max;
        let others = self.ledgers.iter().enumerate().filter(|&(i, _)| i != index);
        let oldest_elsewhere = others.filter_map(|(_, l)| l.inflight.oldest_started()).min();
        LedgerHold { ledger: &mut self.ledgers[index], index, oldest_elsewhere, fits }
    }
}

/// A ledger held by a booking on the shared path (locked, under a `Router`): the ledger, its
/// index, when the oldest request in flight in the other ledgers started (as they last
/// published it: a moment old) and whether one more request fits under
/// `limits.max_inflight_requests` (a place reserved beforehand, so the bound holds across
/// ledgers).
pub(crate) struct LedgerHold<'a> {
    pub(crate) ledger: &'a mut Ledger,
    pub(crate) index: usize,
    pub(crate) oldest_elsewhere: Option<u64>,
    pub(crate) fits: bool,
}

/// Apply `slot`'s batch at `now_ms` to one copy of the precise index, speculation due withdrawn
/// first (both event paths, exclusive and shared).
fn apply_at(kv: &mut KvIndex, slot: u16, batch: &EventBatch, seq: Option<u64>, now_ms: u64) -> ApplyOutcome {
    kv.expire(now_ms);
    kv.apply_at(slot as usize, batch, seq, now_ms)
}

/// Take request `request_id` out of `books` and off its endpoints' loads.
fn release_request(endpoints: &EndpointTable, books: &mut Books, request_id: &str) -> Result<(), StateError> {
    release(endpoints, &take_request(books, request_id)?);
    Ok(())
}

/// Take request `request_id` out of `books` (its endpoints' loads are the caller's).
fn take_request(books: &mut Books, request_id: &str) -> Result<Inflight, StateError> {
    books.remove(request_id).ok_or_else(|| unknown_request(request_id))
}

fn unknown_request(request_id: &str) -> StateError {
    StateError::UnknownRequest { request_id: request_id.to_owned() }
}

/// Take `f`'s request off its endpoints' loads.
pub(super) fn release(endpoints: &EndpointTable, f: &Inflight) {
    for r in std::iter::once(f.target).chain(f.prefill) {
        if let Some(ep) = endpoints.get(r.slot) {
            if ep.incarnation == r.incarnation {
                ep.load.release(f.tokens);
                ep.done();
            }
        }
    }
}

/// Count a request of `tokens` tokens in flight at `slot`, sent there at `now_ms`.
pub(super) fn track(endpoints: &EndpointTable, slot: u16, now_ms: u64, tokens: u64) -> SlotRef {
    match endpoints.get(slot) {
        Some(ep) => {
            ep.load.track(tokens, now_ms);
            ep.sent();
            SlotRef { slot, incarnation: ep.incarnation }
        }
        None => SlotRef { slot, incarnation: 0 },
    }
}

/// Keep at most `max` requests in flight, dropping the oldest.
pub(super) fn bound_inflight(endpoints: &EndpointTable, books: &mut Books, max: usize) {
    while books.inflight_len() > max {
        match books.pop_oldest_if(|_| true) {
            Some(f) => {
                release(endpoints, &f);
                books.counters.inflight_expired += 1;
            }
            None => break,
        }
    }
}
