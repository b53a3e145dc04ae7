//! The [`Router`]: policy cell, endpoint table, index and request tracking, and the one decision
//! path.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use arc_swap::ArcSwap;
use lru::LruCache;
use serde::Serialize;
use xxhash_rust::xxh3::{Xxh3, Xxh3DefaultBuilder};

use crate::admission;
use crate::approx::{ApproxHashing, RequestKeys};
use crate::config::{IndexMode, Policy};
use crate::decision::{self, Decision, Mode, ModeInputs, Rule};
use crate::effect::RoutingEffect;
use crate::endpoints::{validate_endpoint_id, EndpointSpec, EndpointState, EndpointTable, MetricsSnapshot, Role};
use crate::error::{ConfigError, EventIngestError, RouteError, StateError};
use crate::index::{ApproxIndex, IndexStats, MatchScratch, MatchWeights, PrefixMatch};
use crate::precise::events::EventBatch;
use crate::precise::{ApplyOutcome, KvIndex, PreciseKeys, PreciseStats};
use crate::request::RouteRequest;
use crate::score::{self, EndpointScore, FeatureInputs};

/// A policy together with its version and derived parameters.
#[derive(Debug)]
pub struct ActivePolicy {
    /// Monotonic version: 1 for the policy the router was built with, +1 per successful reload.
    pub version: u64,
    /// The policy.
    pub policy: Policy,
    hashing: ApproxHashing,
    fingerprint: u64,
    capacity: u32,
    precise_keys: PreciseKeys,
    precise_fingerprint: u64,
    precise_capacity: u32,
}

impl ActivePolicy {
    fn new(policy: Policy, version: u64) -> Self {
        let i = &policy.config().index;
        let hashing =
            ApproxHashing { block_tokens: i.block_tokens, bytes_per_token: i.bytes_per_token, hash_seed: i.hash_seed };
        ActivePolicy {
            version,
            fingerprint: policy.index_fingerprint(),
            capacity: policy.index_capacity_memberships(),
            hashing,
            precise_keys: PreciseKeys::from_config(&i.precise),
            precise_fingerprint: policy.precise_fingerprint(),
            precise_capacity: policy.precise_capacity_memberships(),
            policy,
        }
    }

    fn reads_approx(&self) -> bool {
        self.policy.config().index.mode != IndexMode::Precise
    }

    fn reads_precise(&self) -> bool {
        self.policy.config().index.mode != IndexMode::Approx
    }
}

#[derive(Debug, Clone, Copy)]
struct SlotRef {
    slot: u16,
    incarnation: u32,
}

#[derive(Debug)]
struct Inflight {
    target: SlotRef,
    prefill: Option<SlotRef>,
    started_ms: u64,
    serial: u64,
}

/// Requests in flight: a map by request id plus the ids in arrival order (for expiry and the
/// size bound). Completed requests leave a stale entry in the order queue, skipped when reached
/// and compacted away when the queue grows to twice the map.
#[derive(Debug)]
struct InflightTable {
    map: std::collections::HashMap<Arc<str>, Inflight, Xxh3DefaultBuilder>,
    order: std::collections::VecDeque<(u64, Arc<str>)>,
    next_serial: u64,
}

impl InflightTable {
    fn new() -> Self {
        InflightTable {
            map: std::collections::HashMap::with_hasher(Xxh3DefaultBuilder),
            order: std::collections::VecDeque::new(),
            next_serial: 0,
        }
    }

    fn len(&self) -> usize {
        self.map.len()
    }

    fn contains(&self, id: &str) -> bool {
        self.map.contains_key(id)
    }

    fn insert(&mut self, id: &str, target: SlotRef, prefill: Option<SlotRef>, started_ms: u64) {
        self.next_serial += 1;
        let serial = self.next_serial;
        let key: Arc<str> = Arc::from(id);
        self.order.push_back((serial, key.clone()));
        self.map.insert(key, Inflight { target, prefill, started_ms, serial });
        if self.order.len() > 2 * self.map.len() + 1024 {
            let map = &self.map;
            self.order.retain(|(serial, id)| map.get(id).is_some_and(|f| f.serial == *serial));
        }
    }

    fn remove(&mut self, id: &str) -> Option<Inflight> {
        self.map.remove(id)
    }

    /// Remove and return the oldest request for which `take(request)` holds (it stops at the
    /// first live one for which it does not).
    fn pop_oldest_if(&mut self, take: impl Fn(&Inflight) -> bool) -> Option<Inflight> {
        while let Some((serial, id)) = self.order.front() {
            match self.map.get(id) {
                Some(f) if f.serial == *serial => {
                    if !take(f) {
                        return None;
                    }
                    let id = id.clone();
                    self.order.pop_front();
                    return self.map.remove(&id);
                }
                // Completed (or replaced) since: a stale queue entry.
                _ => {
                    self.order.pop_front();
                }
            }
        }
        None
    }
}

/// Counters kept by the router (for metrics exposition by the bindings).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RouterCounters {
    /// Decisions per rule, indexed like [`Rule::ALL`].
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

struct State {
    endpoints: EndpointTable,
    index: ApproxIndex,
    kv: KvIndex,
    /// The latest `now` seen (routing or events), for reporting stream health.
    last_now_ms: u64,
    sessions: LruCache<u64, SlotRef, Xxh3DefaultBuilder>,
    inflight: InflightTable,
    next_request: u64,
    /// Next suffix per reused request id (see `Router::assign_request_id`).
    reused_ids: std::collections::HashMap<Arc<str>, u64, Xxh3DefaultBuilder>,
    /// In-flight lookups made to find a unique suffix for reused ids (tests).
    id_probes: u64,
    draws: u64,
    matched: PrefixMatch,
    pmatched: PrefixMatch,
    scratch: MatchScratch,
    slots_buf: Vec<u16>,
    cands_buf: Vec<usize>,
    counters: RouterCounters,
}

impl State {
    fn release(&mut self, f: &Inflight) {
        for r in std::iter::once(f.target).chain(f.prefill) {
            if let Some(ep) = self.endpoints.get_mut(r.slot) {
                if ep.incarnation == r.incarnation {
                    ep.inflight = ep.inflight.saturating_sub(1);
                    ep.done();
                }
            }
        }
    }

    fn expire_inflight(&mut self, now_ms: u64, timeout_ms: u64) {
        while let Some(f) = self.inflight.pop_oldest_if(|f| now_ms.saturating_sub(f.started_ms) > timeout_ms) {
            self.release(&f);
            self.counters.inflight_expired += 1;
        }
    }

    /// Keep at most `max` requests in flight, dropping the oldest.
    fn bound_inflight(&mut self, max: usize) {
        while self.inflight.len() > max {
            match self.inflight.pop_oldest_if(|_| true) {
                Some(f) => {
                    self.release(&f);
                    self.counters.inflight_expired += 1;
                }
                None => break,
            }
        }
    }

    fn live_ref(&self, r: SlotRef) -> bool {
        self.endpoints.get(r.slot).is_some_and(|e| e.incarnation == r.incarnation)
    }

    fn expire_speculation(&mut self, now_ms: u64) {
        self.kv.expire(now_ms);
    }
}

fn nz(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN)
}

/// The router. `Send + Sync`: share it behind an `Arc` and call it from any thread.
///
/// The policy lives in an [`ArcSwap`] cell: every decision loads it once, so a decision is made
/// entirely under one policy version, and [`Router::reload`] swaps it atomically. Mutable state
/// (endpoint table, index, sessions, in-flight requests) sits behind one mutex; block hashing and
/// request parsing happen outside it.
pub struct Router {
    policy: ArcSwap<ActivePolicy>,
    state: Mutex<State>,
    /// Turns text and chat prompts into the engine's token ids for the precise index.
    #[cfg(feature = "tokenizer")]
    tokenizer: arc_swap::ArcSwapOption<crate::tokenize::Tokenizer>,
    tokenize_errors: std::sync::atomic::AtomicU64,
    record_effects: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router").field("policy_version", &self.policy.load().version).finish_non_exhaustive()
    }
}

impl Default for Router {
    fn default() -> Self {
        Router::new(Policy::default())
    }
}

impl Router {
    /// A router running `policy` (version 1) with no endpoints.
    pub fn new(policy: Policy) -> Router {
        let active = ActivePolicy::new(policy, 1);
        let limits = &active.policy.config().limits;
        let state = State {
            endpoints: EndpointTable::default(),
            index: ApproxIndex::new(active.fingerprint, active.capacity),
            kv: KvIndex::new(active.policy.config(), active.precise_fingerprint, active.precise_capacity),
            last_now_ms: 0,
            sessions: LruCache::with_hasher(nz(limits.session_capacity), Xxh3DefaultBuilder),
            inflight: InflightTable::new(),
            next_request: 0,
            reused_ids: std::collections::HashMap::with_hasher(Xxh3DefaultBuilder),
            id_probes: 0,
            draws: 0,
            matched: PrefixMatch::default(),
            pmatched: PrefixMatch::default(),
            scratch: MatchScratch::default(),
            slots_buf: Vec::new(),
            cands_buf: Vec::new(),
            counters: RouterCounters::default(),
        };
        Router {
            policy: ArcSwap::from_pointee(active),
            state: Mutex::new(state),
            #[cfg(feature = "tokenizer")]
            tokenizer: arc_swap::ArcSwapOption::empty(),
            tokenize_errors: std::sync::atomic::AtomicU64::new(0),
            record_effects: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// A router from a JSON policy document.
    pub fn from_json(text: &str) -> Result<Router, ConfigError> {
        Policy::from_json(text).map(Router::new)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing in the core panics while holding the lock; should a bug ever do so, the state
        // is still structurally valid, so keep serving rather than poison every later call.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Use `tokenizer` to compute precise keys for text and chat requests (native only; without
    /// one, only token-id prompts get precise keys). Tokenization happens outside the state lock;
    /// a request that fails to tokenize is routed without precise keys and counted in
    /// `RouterCounters::tokenize_errors`.
    #[cfg(feature = "tokenizer")]
    pub fn set_tokenizer(&self, tokenizer: Option<Arc<crate::tokenize::Tokenizer>>) {
        self.tokenizer.store(tokenizer);
    }

    /// The active policy.
    pub fn policy(&self) -> Arc<ActivePolicy> {
        self.policy.load_full()
    }

    /// Swap in a new (already validated) policy atomically and return its version.
    ///
    /// What happens to state:
    /// - If the hashing parameters (`index.block_tokens`, `index.bytes_per_token`,
    ///   `index.hash_seed`) change, the approximate index is cleared: keys made under the old
    ///   parameters can never match keys made under the new ones, so keeping them would only
    ///   waste memory. Routing continues immediately (cold for the index). A decision that began
    ///   under the old policy and finishes after the swap neither reads nor writes the new index.
    /// - If only `index.capacity_bytes_per_endpoint` changes, entries are kept; endpoints over the
    ///   new capacity lose their oldest generations at once.
    /// - Endpoints, metrics, in-flight counters and sessions are kept (the in-flight and session
    ///   tables are resized to the new limits, releasing the oldest entries if they shrink).
    pub fn reload(&self, policy: Policy) -> u64 {
        let mut st = self.lock();
        let old = self.policy.load_full();
        let new = Arc::new(ActivePolicy::new(policy, old.version + 1));
        if new.fingerprint != st.index.fingerprint() {
            st.index.reset(new.fingerprint);
            st.counters.index_resets += 1;
        }
        if new.capacity != old.capacity {
            st.index.set_capacity(new.capacity);
        }
        if new.precise_fingerprint != st.kv.fingerprint() {
            st.kv.reconfigure(new.policy.config(), new.precise_fingerprint);
            st.counters.index_resets += 1;
        }
        st.kv.set_speculative_ttl(new.policy.config().index.speculative_ttl_ms);
        st.kv.set_capacity(new.precise_capacity, new.policy.config().index.precise.key_map_capacity);
        let limits = &new.policy.config().limits;
        st.bound_inflight(limits.max_inflight_requests);
        st.sessions.resize(nz(limits.session_capacity));
        st.counters.reloads += 1;
        let version = new.version;
        self.policy.store(new);
        version
    }

    /// Parse (JSON if it starts with `{`, else YAML), validate and reload. On error the active
    /// policy is untouched and keeps serving.
    pub fn reload_str(&self, text: &str) -> Result<u64, ConfigError> {
        match Policy::from_str_auto(text) {
            Ok(p) => Ok(self.reload(p)),
            Err(e) => {
                self.lock().counters.reload_failures += 1;
                Err(e)
            }
        }
    }

    /// Register an endpoint, or change the role of a registered one (its index entries, metrics
    /// and counters are kept).
    pub fn upsert_endpoint(&self, spec: EndpointSpec) -> Result<(), StateError> {
        validate_endpoint_id(&spec.id)?;
        let limit = self.policy.load().policy.config().limits.max_endpoints;
        let mut st = self.lock();
        if let Some(slot) = st.endpoints.slot_of(&spec.id) {
            if let Some(ep) = st.endpoints.get_mut(slot) {
                ep.role = spec.role;
            }
            return Ok(());
        }
        if st.endpoints.len() >= limit {
            return Err(StateError::TooManyEndpoints { limit });
        }
        let State { endpoints, index, kv, .. } = &mut *st;
        let slot = endpoints.insert(&spec, |s| index.slot_reusable(s) && kv.slot_reusable(s));
        index.activate(slot as usize);
        kv.activate(slot as usize);
        Ok(())
    }

    /// Remove an endpoint: its index entries are purged (at once for routing; memory is reclaimed
    /// by the sweeper) and requests still in flight there are forgotten.
    pub fn remove_endpoint(&self, id: &str) -> Result<(), StateError> {
        let mut st = self.lock();
        let slot = st.endpoints.remove(id).ok_or_else(|| StateError::UnknownEndpoint { id: id.to_owned() })?;
        st.index.retire(slot as usize);
        st.kv.retire(slot as usize);
        Ok(())
    }

    /// Store a metrics snapshot (its `updated_ms` is the time it was taken).
    ///
    /// Until the next snapshot, scoring corrects it with what the router itself saw since: every
    /// completion there takes one request off the reported waiting queue and one request's share
    /// off the KV usage (the snapshot's usage per running request), never below 0; every request
    /// it sent there (or applied from another instance's effect) adds one of each. Metrics lag by a scrape interval
    /// while the router's own traffic is known at once; read as they are, a stale report would
    /// send every request between two scrapes to whichever endpoint last reported least.
    pub fn update_metrics(&self, id: &str, metrics: MetricsSnapshot) -> Result<(), StateError> {
        metrics.validate(id)?;
        let mut st = self.lock();
        let slot = st.endpoints.slot_of(id).ok_or_else(|| StateError::UnknownEndpoint { id: id.to_owned() })?;
        if let Some(ep) = st.endpoints.get_mut(slot) {
            ep.set_metrics(metrics);
        }
        Ok(())
    }

    /// Mark an endpoint healthy or not (unhealthy endpoints are never picked).
    pub fn set_healthy(&self, id: &str, healthy: bool) -> Result<(), StateError> {
        let mut st = self.lock();
        let slot = st.endpoints.slot_of(id).ok_or_else(|| StateError::UnknownEndpoint { id: id.to_owned() })?;
        if let Some(ep) = st.endpoints.get_mut(slot) {
            ep.healthy = healthy;
        }
        Ok(())
    }

    /// Every endpoint, in id order.
    pub fn endpoints(&self) -> Vec<EndpointInfo> {
        let st = self.lock();
        st.endpoints
            .order()
            .iter()
            .filter_map(|&s| st.endpoints.get(s).map(|e| (s, e)))
            .map(|(s, e)| EndpointInfo {
                id: e.id.clone(),
                role: e.role,
                healthy: e.healthy,
                metrics: e.metrics.clone(),
                inflight: e.inflight,
                index_memberships: st.index.memberships_of(s as usize),
                precise_memberships: st.kv.blocks().memberships_of(s as usize),
                events_healthy: st.kv.healthy(s as usize, st.last_now_ms),
            })
            .collect()
    }

    /// Where to send a request the router could not route (fail-open), or `None` when no
    /// endpoint is registered.
    ///
    /// Not a routing decision: it keeps traffic flowing while something is wrong (a body the
    /// engine will reject itself, no decode-capable endpoint, a binding's internal error). It
    /// picks the endpoint with the fewest router-tracked requests in flight (then the shortest
    /// reported queue, then id order) among healthy decode-capable endpoints, else among healthy
    /// endpoints, else among all. Nothing is recorded: the request is not tracked in flight.
    pub fn fail_open_endpoint(&self) -> Option<Arc<str>> {
        let st = self.lock();
        let load = |e: &&EndpointState| (e.inflight, e.metrics.as_ref().map_or(0, |m| m.waiting));
        let tiers: [fn(&EndpointState) -> bool; 3] = [|e| e.healthy && e.role.decodes(), |e| e.healthy, |_| true];
        tiers.iter().find_map(|keep| {
            let all = st.endpoints.order().iter().filter_map(|&s| st.endpoints.get(s));
            all.filter(|e| keep(e)).min_by_key(load).map(|e| e.id.clone())
        })
    }

    /// A snapshot of sizes and counters.
    pub fn stats(&self) -> RouterStats {
        let version = self.policy.load().version;
        let st = self.lock();
        RouterStats {
            policy_version: version,
            endpoints: st.endpoints.len(),
            inflight_requests: st.inflight.len(),
            index: st.index.stats(),
            precise: st.kv.stats(),
            counters: RouterCounters {
                tokenize_errors: self.tokenize_errors.load(std::sync::atomic::Ordering::Relaxed),
                ..st.counters.clone()
            },
        }
    }

    /// The request finished (response fully sent or failed): release its in-flight counters.
    pub fn complete(&self, request_id: &str) -> Result<(), StateError> {
        let mut st = self.lock();
        match st.inflight.remove(request_id) {
            Some(f) => {
                st.release(&f);
                Ok(())
            }
            None => Err(StateError::UnknownRequest { request_id: request_id.to_owned() }),
        }
    }

    /// Attach a [`RoutingEffect`] to every (non-shed) decision from now on (`Decision::effect`),
    /// for replicating routing state to other router instances. Off by default: it copies the
    /// request's block keys.
    pub fn record_effects(&self, on: bool) {
        self.record_effects.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Apply the state changes a decision made by another router instance (sharing this one's
    /// endpoints and policy): the assumed residency in the approximate index, the speculative
    /// entries in the precise index, the in-flight request and the session affinity. Keys made
    /// under a different index fingerprint (the instances run different policies for a moment
    /// during a reload) are skipped; an effect whose request id is already in flight here is not
    /// counted twice. Replicate completions with [`Router::complete`] on every instance.
    ///
    /// Request ids must be unique across the instances (give every request an `x-request-id`, as
    /// Envoy does): generated `kvr-N` ids are unique only within one instance.
    ///
    /// Errors: `UnknownEndpoint` when the target or prefill endpoint is not registered here
    /// (nothing is applied).
    pub fn apply_effect(&self, e: &RoutingEffect) -> Result<(), StateError> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let slot = |st: &State, id: &str| {
            st.endpoints.slot_of(id).ok_or_else(|| StateError::UnknownEndpoint { id: id.to_owned() })
        };
        let t_slot = slot(st, &e.target)?;
        let p_slot = e.prefill.as_deref().map(|p| slot(st, p)).transpose()?;
        let slots = std::iter::once(t_slot).chain(p_slot);
        if e.approx_fingerprint == st.index.fingerprint() && !e.approx_keys.is_empty() {
            let n = e.approx_seq_starts.len();
            for i in 0..n {
                let lo = e.approx_seq_starts[i] as usize;
                let hi = e.approx_seq_starts.get(i + 1).map_or(e.approx_keys.len(), |&h| h as usize);
                let Some(seq) = e.approx_keys.get(lo..hi) else { continue };
                for s in slots.clone() {
                    st.index.observe(seq, s as usize);
                }
            }
        }
        if e.precise_fingerprint == st.kv.fingerprint() && !e.precise_keys.is_empty() {
            // The expiry is held to this instance's clock plus the TTL (a peer's far-future
            // expiry cannot pin entries here).
            let now = st.kv.speculation_now().unwrap_or(e.now_ms);
            st.expire_speculation(now);
            for (i, s) in slots.enumerate() {
                let skip = e.precise_skip[i] as usize;
                st.kv.speculate_from(&e.precise_keys, skip, s as usize, e.speculative_expires_ms, now);
            }
        }
        let target = st.endpoints.get(t_slot).map_or(SlotRef { slot: t_slot, incarnation: 0 }, |ep| SlotRef {
            slot: t_slot,
            incarnation: ep.incarnation,
        });
        if !st.inflight.contains(&e.request_id) {
            let t = self.track(st, t_slot, e.now_ms);
            let p = p_slot.map(|p| self.track(st, p, e.now_ms));
            st.inflight.insert(&e.request_id, t, p, e.now_ms);
            let max = self.policy.load().policy.config().limits.max_inflight_requests;
            st.bound_inflight(max);
        }
        if let Some(k) = e.session_key {
            st.sessions.push(k, target);
        }
        st.counters.effects_applied += 1;
        Ok(())
    }

    /// Decode one KV-event payload published by `endpoint`'s engine (msgpack, vLLM or SGLang) and
    /// apply it to the precise index. `seq` is the publisher's sequence number (ZMQ frame 2), when
    /// known. A malformed payload is rejected whole and changes nothing.
    pub fn apply_events(
        &self,
        endpoint: &str,
        payload: &[u8],
        seq: Option<u64>,
        now_ms: u64,
    ) -> Result<ApplyOutcome, EventIngestError> {
        let batch = crate::precise::events::decode_batch(payload)?;
        Ok(self.apply_batch(endpoint, &batch, seq, now_ms)?)
    }

    /// Apply an already decoded batch from `endpoint` (see [`Router::apply_events`]).
    pub fn apply_batch(
        &self,
        endpoint: &str,
        batch: &EventBatch,
        seq: Option<u64>,
        now_ms: u64,
    ) -> Result<ApplyOutcome, StateError> {
        let mut st = self.lock();
        let slot =
            st.endpoints.slot_of(endpoint).ok_or_else(|| StateError::UnknownEndpoint { id: endpoint.to_owned() })?;
        st.last_now_ms = st.last_now_ms.max(now_ms);
        st.expire_speculation(now_ms);
        Ok(st.kv.apply_at(slot as usize, batch, seq, now_ms))
    }

    /// Read `endpoint`'s `/metrics` page (vLLM or SGLang Prometheus text, taken at `now_ms`) and
    /// store the snapshot; returns it. A page that cannot be read changes nothing.
    pub fn update_metrics_from_prometheus(
        &self,
        endpoint: &str,
        text: &str,
        now_ms: u64,
    ) -> Result<MetricsSnapshot, crate::metrics::MetricsError> {
        let m = crate::metrics::parse_prometheus(text, now_ms)?;
        self.update_metrics(endpoint, m.clone())?;
        Ok(m)
    }

    /// Count a replay attempt of `endpoint`'s event subscriber (for `metrics_text`).
    pub fn record_replay(&self, endpoint: &str, ok: bool) -> Result<(), StateError> {
        let mut st = self.lock();
        st.endpoints.slot_of(endpoint).ok_or_else(|| StateError::UnknownEndpoint { id: endpoint.to_owned() })?;
        st.kv.record_replay(ok);
        Ok(())
    }

    /// The router's metrics in Prometheus text exposition format: decisions by mode and rule,
    /// the prefix-hit histogram, index sizes, event-stream health and lag, reloads.
    /// `kvroute_event_lag_seconds` compares publisher timestamps with `now_ms`, so it is
    /// meaningful when the router's clock is UNIX time (the bindings' default).
    pub fn metrics_text(&self, now_ms: u64) -> String {
        let version = self.policy.load().version;
        let stats = self.stats();
        let st = self.lock();
        let c = &stats.counters;
        let mut e = crate::metrics::Exposition::new();
        e.header("kvroute_decisions_total", "counter", "Routing decisions by serving mode and the rule that fired.");
        for (i, rule) in Rule::ALL.iter().enumerate() {
            let mode = match rule {
                Rule::DecodeDirect => "decode-direct",
                Rule::Disaggregated => "disaggregated",
                Rule::Shed => "none",
                _ => "colocated",
            };
            e.sample(
                "kvroute_decisions_total",
                &[("mode", mode), ("rule", rule.as_str())],
                c.decisions_by_rule[i] as f64,
            );
        }
        e.header("kvroute_route_errors_total", "counter", "Route calls that returned an error.");
        e.sample("kvroute_route_errors_total", &[], c.route_errors as f64);
        e.header(
            "kvroute_prefix_hit_ratio",
            "histogram",
            "Prefix hit ratio of the chosen endpoint, per routed request.",
        );
        for (i, b) in c.prefix_hit_buckets.iter().enumerate() {
            let le = format!("{:.1}", (i + 1) as f64 / 10.0);
            e.sample("kvroute_prefix_hit_ratio_bucket", &[("le", &le)], *b as f64);
        }
        e.sample("kvroute_prefix_hit_ratio_bucket", &[("le", "+Inf")], c.routed as f64);
        e.sample("kvroute_prefix_hit_ratio_sum", &[], c.prefix_hit_sum);
        e.sample("kvroute_prefix_hit_ratio_count", &[], c.routed as f64);
        e.header("kvroute_index_memberships", "gauge", "Live (block, endpoint) memberships per index.");
        e.sample("kvroute_index_memberships", &[("index", "approx")], stats.index.memberships as f64);
        e.sample("kvroute_index_memberships", &[("index", "precise")], stats.precise.index.memberships as f64);
        e.header("kvroute_index_bytes", "gauge", "Heap bytes held per index.");
        e.sample("kvroute_index_bytes", &[("index", "approx")], stats.index.memory_bytes as f64);
        e.sample("kvroute_index_bytes", &[("index", "precise")], stats.precise.memory_bytes() as f64);
        e.header("kvroute_speculative_blocks", "gauge", "Speculative (block, endpoint) memberships pending.");
        e.sample("kvroute_speculative_blocks", &[], stats.precise.speculative_blocks as f64);
        let p = &stats.precise;
        for (name, help, v) in [
            ("kvroute_event_batches_total", "KV-event batches applied.", p.batches),
            ("kvroute_event_blocks_stored_total", "Blocks reported stored.", p.blocks_stored),
            ("kvroute_event_blocks_removed_total", "Blocks reported removed.", p.blocks_removed),
            (
                "kvroute_event_orphan_blocks_total",
                "Stored blocks with an unknown parent (not indexed).",
                p.orphan_blocks,
            ),
            ("kvroute_event_duplicates_total", "Duplicate batches ignored.", p.duplicates),
            ("kvroute_event_gaps_total", "Sequence gaps detected.", p.gaps),
            ("kvroute_event_resets_total", "Publisher restarts detected.", p.resets),
            ("kvroute_event_resyncs_total", "Streams resynchronized after an unrecoverable gap.", p.resyncs),
            ("kvroute_event_replays_total", "Replays completed.", p.replays),
            ("kvroute_event_replay_failures_total", "Replays that failed.", p.replay_failures),
            ("kvroute_reloads_total", "Successful policy reloads.", c.reloads),
            ("kvroute_reload_failures_total", "Rejected policy reloads.", c.reload_failures),
            ("kvroute_index_resets_total", "Index resets caused by changed key parameters.", c.index_resets),
            (
                "kvroute_inflight_expired_total",
                "Requests dropped from in-flight tracking without complete.",
                c.inflight_expired,
            ),
            ("kvroute_tokenize_errors_total", "Requests the tokenizer failed on.", c.tokenize_errors),
            ("kvroute_effects_applied_total", "Routing effects of other router instances applied.", c.effects_applied),
        ] {
            e.header(name, "counter", help);
            e.sample(name, &[], v as f64);
        }
        e.header("kvroute_policy_version", "gauge", "Active policy version.");
        e.sample("kvroute_policy_version", &[], version as f64);
        e.header("kvroute_inflight_requests", "gauge", "Requests in flight, per endpoint.");
        let order: Vec<u16> = st.endpoints.order().to_vec();
        for &slot in &order {
            if let Some(ep) = st.endpoints.get(slot) {
                e.sample("kvroute_inflight_requests", &[("endpoint", &ep.id)], f64::from(ep.inflight));
            }
        }
        e.header("kvroute_event_stream_healthy", "gauge", "1 when routing trusts the endpoint's KV-event stream.");
        for &slot in &order {
            if let Some(ep) = st.endpoints.get(slot) {
                let info = st.kv.stream_info(slot as usize, now_ms);
                e.sample("kvroute_event_stream_healthy", &[("endpoint", &ep.id)], if info.healthy { 1.0 } else { 0.0 });
            }
        }
        e.header(
            "kvroute_event_lag_seconds",
            "gauge",
            "Router receive time minus publisher timestamp of the last applied batch, per endpoint.",
        );
        for &slot in &order {
            if let Some(ep) = st.endpoints.get(slot) {
                let info = st.kv.stream_info(slot as usize, now_ms);
                if let Some(at) = info.last_applied_ms {
                    e.sample(
                        "kvroute_event_lag_seconds",
                        &[("endpoint", &ep.id)],
                        at as f64 / 1000.0 - info.last_publisher_ts,
                    );
                }
            }
        }
        e.header("kvroute_event_age_seconds", "gauge", "Seconds since the endpoint's last applied KV-event batch.");
        for &slot in &order {
            if let Some(ep) = st.endpoints.get(slot) {
                if let Some(at) = st.kv.stream_info(slot as usize, now_ms).last_applied_ms {
                    e.sample(
                        "kvroute_event_age_seconds",
                        &[("endpoint", &ep.id)],
                        now_ms.saturating_sub(at) as f64 / 1000.0,
                    );
                }
            }
        }
        e.finish()
    }

    /// Give up on `endpoint`'s gapped event stream (replay unavailable or too old): its precise
    /// entries are cleared, its next batch is accepted as a fresh start, and it counts as stale
    /// for `index.precise.stale_recovery_ms` (hybrid mode routes it with the approximate index
    /// meanwhile).
    pub fn resync_stream(&self, endpoint: &str, now_ms: u64) -> Result<(), StateError> {
        let recovery = self.policy.load().policy.config().index.precise.stale_recovery_ms;
        let mut st = self.lock();
        let slot =
            st.endpoints.slot_of(endpoint).ok_or_else(|| StateError::UnknownEndpoint { id: endpoint.to_owned() })?;
        st.kv.resync(slot as usize, now_ms, recovery);
        Ok(())
    }

    /// Parse an HTTP request (body + headers) and route it, all under one policy version.
    pub fn route_http<K, V>(
        &self,
        body: &[u8],
        headers: impl IntoIterator<Item = (K, V)>,
        now_ms: u64,
    ) -> Result<Decision, RouteError>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let active = self.policy.load_full();
        let req = match RouteRequest::parse(body, headers, &active.policy.config().request) {
            Ok(r) => r,
            Err(e) => {
                self.lock().counters.route_errors += 1;
                return Err(e.into());
            }
        };
        self.route_with(&active, &req, now_ms)
    }

    /// Route a parsed request at time `now_ms` (milliseconds on the caller's clock, the same clock
    /// as metric timestamps).
    pub fn route(&self, req: &RouteRequest, now_ms: u64) -> Result<Decision, RouteError> {
        let active = self.policy.load_full();
        self.route_with(&active, req, now_ms)
    }

    fn route_with(&self, active: &ActivePolicy, req: &RouteRequest, now_ms: u64) -> Result<Decision, RouteError> {
        // Block hashing happens outside the lock, into per-thread buffers.
        KEYS.with(|cell| {
            let mut bufs = cell.take();
            bufs.has_precise =
                active.reads_precise() && active.precise_keys.request_keys(req, &mut bufs.precise, &mut bufs.scratch);
            if active.reads_approx() || !bufs.has_precise {
                active.hashing.request_keys(req, &mut bufs.approx);
            } else {
                // Precise mode with precise keys: the approximate keys would be unused; only the
                // tie-break anchor is needed.
                bufs.approx.keys.clear();
                bufs.approx.seq_starts.clear();
                bufs.approx.anchor = bufs.precise.anchor;
            }
            bufs.exact_input_tokens = None;
            #[cfg(feature = "tokenizer")]
            if active.reads_precise() && !bufs.has_precise {
                self.tokenize_into(active, req, now_ms, &mut bufs);
            }
            let out = self.decide(active, req, &bufs, now_ms);
            cell.replace(bufs);
            out
        })
    }

    #[cfg(feature = "tokenizer")]
    fn tokenize_into(&self, active: &ActivePolicy, req: &RouteRequest, now_ms: u64, bufs: &mut KeyBufs) {
        let Some(tok) = self.tokenizer.load_full() else { return };
        // Only the ids before the request's key limit (a part the router cannot key) are keyed.
        // The template clock (`strftime_now`) is the route call's `now_ms`.
        match tok.keyable_token_ids(req, now_ms) {
            Ok(seqs) => {
                let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
                bufs.has_precise = active.precise_keys.keys_for_tokens(
                    req.lora_adapter.as_deref(),
                    req.cache_salt.as_deref(),
                    &refs,
                    &mut bufs.precise,
                    &mut bufs.scratch,
                );
                let keyed: u64 = seqs.iter().map(|s| s.len() as u64).sum();
                let bpt = active.policy.config().index.bytes_per_token;
                let bt = u64::from(active.precise_keys.block_tokens().max(1));
                // Past the media (or key limit): the estimate, the ids after the last full block
                // of the cut sequence and the boundary token dropped there.
                let cut = match (req.chat.as_ref().and_then(|c| c.media), req.key_limit) {
                    (Some(_), _) => Some(0),
                    (None, Some(l)) => Some(l.prompt),
                    (None, None) => None,
                };
                let unkeyed = cut.map_or(0, |c| {
                    let extra = seqs.get(c).map_or(0, |s| s.len() as u64 % bt + 1);
                    req.unkeyed_tokens_past_media(bpt) + extra
                });
                bufs.precise.unkeyed_blocks = RequestKeys::blocks_for(unkeyed, active.precise_keys.block_tokens());
                bufs.exact_input_tokens = Some(keyed + unkeyed);
            }
            Err(_) => {
                self.tokenize_errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    fn decide(
        &self,
        active: &ActivePolicy,
        req: &RouteRequest,
        bufs: &KeyBufs,
        now_ms: u64,
    ) -> Result<Decision, RouteError> {
        let cfg = active.policy.config();
        let keys = &bufs.approx;
        let input_tokens = bufs.exact_input_tokens.unwrap_or_else(|| req.input_tokens(cfg.index.bytes_per_token));
        let session_key = session_key(req);
        let mode = cfg.index.mode;

        let mut guard = self.lock();
        let st = &mut *guard;
        st.last_now_ms = now_ms;
        st.expire_inflight(now_ms, cfg.limits.inflight_timeout_ms);
        st.expire_speculation(now_ms);
        // A decision that began under a policy whose hashing differs from an index's neither
        // reads nor writes that index (see `reload`).
        let approx_valid = active.reads_approx() && st.index.fingerprint() == active.fingerprint;
        let precise_valid = bufs.has_precise && st.kv.fingerprint() == active.precise_fingerprint;
        let weights = MatchWeights::new(&cfg.index.tier_weights);
        if approx_valid {
            st.index.match_blocks(keys, &weights, &mut st.matched, &mut st.scratch);
        } else {
            st.matched.clear();
        }
        if precise_valid {
            st.kv.match_blocks(&bufs.precise, &weights, &mut st.pmatched, &mut st.scratch);
        } else {
            st.pmatched.clear();
        }
        let session_ref = session_key.and_then(|k| st.sessions.peek(&k).copied()).filter(|r| st.live_ref(*r));

        let per_block = |n: usize| if n == 0 { 0.0 } else { 1.0 / n as f64 };
        let (approx_per_block, precise_per_block) =
            (per_block(keys.hit_blocks()), per_block(bufs.precise.hit_blocks()));
        let roster = st.endpoints.roster().clone();
        let mut scores: Vec<EndpointScore> = Vec::with_capacity(roster.len());
        let mut slots = std::mem::take(&mut st.slots_buf);
        slots.clear();
        let (mut saturation_sum, mut pool_size) = (0.0, 0u32);
        for &slot in st.endpoints.order() {
            slots.push(slot);
            let Some(ep) = st.endpoints.get(slot) else {
                // Unreachable (order only lists occupied slots); keep scores aligned with the
                // roster and never pick it.
                scores.push(EndpointScore::unavailable());
                continue;
            };
            let i = slot as usize;
            // Precise mode always reads the precise index; hybrid reads it for endpoints whose
            // event stream is healthy when the request has token ids; otherwise approximate.
            let precise = match mode {
                IndexMode::Approx => false,
                IndexMode::Precise => true,
                IndexMode::Hybrid => precise_valid && st.kv.healthy(i, now_ms),
            };
            let (m, hit_per_block, block_tokens) = if precise {
                (&st.pmatched, precise_per_block, active.precise_keys.block_tokens())
            } else {
                (&st.matched, approx_per_block, cfg.index.block_tokens)
            };
            let matched_blocks = m.blocks.get(i).copied().unwrap_or(0);
            let f = FeatureInputs {
                matched_blocks,
                weighted_blocks: m.weighted.get(i).copied().unwrap_or(0.0),
                hit_per_block,
                cached_tokens: (u64::from(matched_blocks) * u64::from(block_tokens)).min(input_tokens),
                precise,
                lora_adapter: req.lora_adapter.as_deref(),
                session_here: session_ref.is_some_and(|r| r.slot == slot),
                now_ms,
            };
            let s = score::score_endpoint(cfg, ep, &f);
            if ep.role.decodes() && ep.healthy {
                saturation_sum += admission::endpoint_saturation(cfg, ep, now_ms);
                pool_size += 1;
            }
            scores.push(s);
        }

        let mut cands = std::mem::take(&mut st.cands_buf);
        let relaxed_decode = score::candidates(&scores, Role::decodes, &mut cands);
        st.draws = st.draws.wrapping_add(1);
        let endpoints = &st.endpoints;
        let last_assigned = |i: usize| slots.get(i).and_then(|&s| endpoints.get(s)).and_then(|e| e.last_assigned_ms);
        let picked = score::pick(&cfg.scoring.picker, &roster, &scores, &cands, keys.anchor, st.draws, last_assigned);
        let Some(d) = picked else {
            st.counters.route_errors += 1;
            st.slots_buf = slots;
            st.cands_buf = cands;
            return Err(RouteError::NoEndpoints { detail: "no healthy endpoint with role decode or both" });
        };
        let d_slot = slots[d];
        let saturation = if pool_size == 0 { 0.0 } else { saturation_sum / f64::from(pool_size) };
        let judgment =
            decision::judge(&cfg.modes, &req.hint, input_tokens, req.effective_max_tokens(), scores[d].prefix_hit);
        let request_id = self.assign_request_id(st, req);

        if let Some(shed) = admission::admit(cfg, saturation, req.priority) {
            st.counters.decisions_by_rule[rule_index(Rule::Shed)] += 1;
            st.slots_buf = slots;
            st.cands_buf = cands;
            let headers = vec![(decision::HEADER_SHED_REASON, shed.reason.clone())];
            return Ok(Decision {
                request_id,
                policy_version: active.version,
                rule: Rule::Shed,
                mode: None,
                endpoint: None,
                prefill_endpoint: None,
                shed: Some(shed),
                headers,
                judgment,
                input_tokens,
                prefix_hit: scores[d].prefix_hit,
                cached_tokens: scores[d].cached_tokens,
                saturation,
                relaxed_filters: relaxed_decode,
                transfer: None,
                endpoints: roster,
                scores,
                effect: None,
            });
        }

        let mut relaxed = relaxed_decode;
        let prefill = {
            let relaxed_p = score::candidates(&scores, |r| r == Role::Prefill, &mut cands);
            let endpoints = &st.endpoints;
            let last_assigned =
                |i: usize| slots.get(i).and_then(|&s| endpoints.get(s)).and_then(|e| e.last_assigned_ms);
            let anchor = keys.anchor ^ 0x5046;
            let p = score::pick(&cfg.scoring.picker, &roster, &scores, &cands, anchor, st.draws, last_assigned);
            relaxed |= relaxed_p && p.is_some();
            p
        };
        let d_ep = st.endpoints.get(d_slot);
        let inputs = ModeInputs {
            input_tokens,
            judgment,
            decode_hit: scores[d].prefix_hit,
            decode_kv_usage: scores[d].kv_usage,
            decode_cached_tokens: scores[d].cached_tokens,
            decode_running: d_ep.map_or(0, |e| e.metrics.as_ref().map_or(0, |m| m.running).max(e.inflight)),
            prefill_cached_tokens: prefill.map(|p| scores[p].cached_tokens),
        };
        let (mode, rule, transfer) = decision::decide_mode(cfg, &inputs);
        let prefill = if mode == Mode::Disaggregated { prefill } else { None };

        // Book-keeping: assumed residency, in-flight counters, session affinity.
        let target = self.track(st, d_slot, now_ms);
        let prefill_ref = prefill.map(|p| self.track(st, slots[p], now_ms));
        if approx_valid {
            for seq in keys.sequences() {
                st.index.observe(seq, d_slot as usize);
                if let Some(p) = prefill {
                    st.index.observe(seq, slots[p] as usize);
                }
            }
        }
        let expires = now_ms.saturating_add(cfg.index.speculative_ttl_ms);
        let mut precise_skip = [0u32; 2];
        if precise_valid {
            let single = bufs.precise.seq_starts.len() == 1;
            for (i, r) in std::iter::once(target).chain(prefill_ref).enumerate() {
                // Blocks the endpoint already holds in a tier need no speculation: only the
                // rest of a single-sequence prompt is speculated.
                let held = if single { st.pmatched.confirmed.get(r.slot as usize).copied().unwrap_or(0) } else { 0 };
                precise_skip[i] = held;
                st.kv.speculate_from(&bufs.precise.keys, held as usize, r.slot as usize, expires, now_ms);
            }
        }
        st.inflight.insert(&request_id, target, prefill_ref, now_ms);
        st.bound_inflight(cfg.limits.max_inflight_requests);
        if let Some(k) = session_key {
            st.sessions.push(k, target);
        }
        st.counters.decisions_by_rule[rule_index(rule)] += 1;
        let hit = scores[d].prefix_hit;
        st.counters.routed += 1;
        st.counters.prefix_hit_sum += hit;
        for (i, b) in st.counters.prefix_hit_buckets.iter_mut().enumerate() {
            if hit <= (i + 1) as f64 / 10.0 + 1e-12 {
                *b += 1;
            }
        }
        let d_index = d;
        let prefill_index = prefill;
        st.slots_buf = slots;
        st.cands_buf = cands;
        drop(guard);
        let (d, prefill) = (d_index, prefill_index);

        let endpoint = roster[d].clone();
        let prefill_endpoint = prefill.map(|p| roster[p].clone());
        let effect = self.record_effects.load(std::sync::atomic::Ordering::Relaxed).then(|| {
            let (approx_keys, approx_seq_starts) =
                if approx_valid { (keys.keys.clone(), keys.seq_starts.clone()) } else { (Vec::new(), Vec::new()) };
            let (precise_keys, precise_seq_starts) = if precise_valid {
                (bufs.precise.keys.clone(), bufs.precise.seq_starts.clone())
            } else {
                (Vec::new(), Vec::new())
            };
            Arc::new(RoutingEffect {
                request_id: request_id.clone(),
                target: endpoint.clone(),
                prefill: prefill_endpoint.clone(),
                now_ms,
                session_key,
                approx_fingerprint: active.fingerprint,
                approx_keys,
                approx_seq_starts,
                precise_fingerprint: active.precise_fingerprint,
                precise_keys,
                precise_seq_starts,
                precise_skip,
                speculative_expires_ms: expires,
            })
        });
        let mut headers = Vec::with_capacity(4);
        headers.push((decision::HEADER_DESTINATION, endpoint.to_string()));
        if let Some(p) = &prefill_endpoint {
            headers.push((decision::HEADER_PREFILLER, p.to_string()));
        }
        headers.push((decision::HEADER_MODE, mode.as_str().to_owned()));
        if cfg.request.debug_header {
            headers.push((
                decision::HEADER_SCORE,
                format!("{};{:.4};{:.4}", rule.as_str(), scores[d].total, scores[d].prefix_hit),
            ));
        }
        Ok(Decision {
            request_id,
            policy_version: active.version,
            rule,
            mode: Some(mode),
            prefix_hit: scores[d].prefix_hit,
            cached_tokens: scores[d].cached_tokens,
            endpoint: Some(endpoint),
            prefill_endpoint,
            shed: None,
            headers,
            judgment,
            input_tokens,
            saturation,
            relaxed_filters: relaxed,
            transfer,
            endpoints: roster,
            scores,
            effect,
        })
    }

    /// Count a request in flight at `slot`, sent there at `now_ms`.
    fn track(&self, st: &mut State, slot: u16, now_ms: u64) -> SlotRef {
        match st.endpoints.get_mut(slot) {
            Some(ep) => {
                ep.inflight = ep.inflight.saturating_add(1);
                ep.sent();
                ep.last_assigned_ms = Some(ep.last_assigned_ms.map_or(now_ms, |t| t.max(now_ms)));
                SlotRef { slot, incarnation: ep.incarnation }
            }
            None => SlotRef { slot, incarnation: 0 },
        }
    }

    fn assign_request_id(&self, st: &mut State, req: &RouteRequest) -> String {
        match &req.request_id {
            Some(id) if !st.inflight.contains(id.as_str()) => id.clone(),
            Some(id) => {
                // The caller reused an id still in flight: make it unique (`{id}~{n}`) so neither
                // request's counters are lost; the decision carries the id to complete with. The
                // next suffix to try is remembered per reused id, so a suffix is probed at most
                // once until the memory is cleared: O(1) amortized per decision, however many
                // requests share the id.
                if !st.reused_ids.contains_key(id.as_str()) {
                    if st.reused_ids.len() >= REUSED_IDS_MAX {
                        st.reused_ids.clear();
                    }
                    st.reused_ids.insert(Arc::from(id.as_str()), 2);
                }
                let Some(next) = st.reused_ids.get_mut(id.as_str()) else { return format!("{id}~2") };
                loop {
                    let candidate = format!("{id}~{next}");
                    *next += 1;
                    st.id_probes += 1;
                    if !st.inflight.contains(candidate.as_str()) {
                        return candidate;
                    }
                }
            }
            None => loop {
                // Skip ids in flight (replicated from another instance, or given by a caller).
                st.next_request += 1;
                let id = format!("kvr-{}", st.next_request);
                if !st.inflight.contains(id.as_str()) {
                    return id;
                }
            },
        }
    }
}

/// Reused request ids whose next suffix is remembered (see `Router::assign_request_id`); beyond
/// this many the memory starts over (each suffix then is probed once more at worst).
const REUSED_IDS_MAX: usize = 4096;

/// The session-affinity key of a request: its session id within its tenant. The tenant is the
/// fairness id and the cache_salt (an empty salt is no salt), so another tenant reusing a session
/// id is never steered to the first tenant's endpoint. Each part is length-prefixed, so no two
/// different (fairness id, salt, session id) triples share an input.
fn session_key(req: &RouteRequest) -> Option<u64> {
    let session = req.session_id.as_deref()?;
    let salt = req.cache_salt.as_deref().filter(|s| !s.is_empty());
    let mut h = Xxh3::new();
    for part in [req.fairness_id.as_deref(), salt, Some(session)] {
        match part {
            None => h.update(&[0]),
            Some(p) => {
                h.update(&[1]);
                h.update(&(p.len() as u64).to_le_bytes());
                h.update(p.as_bytes());
            }
        }
    }
    Some(h.digest())
}

/// Per-thread key buffers (block hashing happens before the state lock is taken).
#[derive(Default)]
struct KeyBufs {
    approx: RequestKeys,
    precise: RequestKeys,
    has_precise: bool,
    /// Input tokens when the tokenizer counted them.
    exact_input_tokens: Option<u64>,
    scratch: Vec<u8>,
}

std::thread_local! {
    static KEYS: std::cell::Cell<KeyBufs> = std::cell::Cell::new(KeyBufs::default());
}

fn rule_index(rule: Rule) -> usize {
    Rule::ALL.iter().position(|&r| r == rule).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router() -> Router {
        let r = Router::default();
        r.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode)).unwrap();
        r.upsert_endpoint(EndpointSpec::new("10.0.0.2:8000", Role::Decode)).unwrap();
        r
    }

    #[test]
    fn router_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Router>();
    }

    #[test]
    fn repeated_prompt_goes_to_the_same_endpoint_and_bypasses() {
        let r = router();
        let prompt = "x".repeat(256 * 40);
        let req = RouteRequest::text("m", &prompt);
        let d1 = r.route(&req, 0).unwrap();
        r.complete(&d1.request_id).unwrap();
        let d2 = r.route(&req, 1).unwrap();
        assert_eq!(d1.endpoint, d2.endpoint);
        assert_eq!(d2.prefix_hit, 1.0);
        assert_eq!(d2.rule, Rule::DecodeDirect);
        assert_eq!(d2.header(decision::HEADER_MODE), Some("decode-direct"));
        assert_eq!(d2.header(decision::HEADER_DESTINATION), d2.endpoint.as_deref());
    }

    #[test]
    fn inflight_counts_follow_route_and_complete() {
        let r = router();
        let d = r.route(&RouteRequest::text("m", "hi"), 0).unwrap();
        let ep = d.endpoint.clone().unwrap();
        let count = |r: &Router| r.endpoints().iter().find(|e| e.id == ep).unwrap().inflight;
        assert_eq!(count(&r), 1);
        r.complete(&d.request_id).unwrap();
        assert_eq!(count(&r), 0);
        assert!(matches!(r.complete(&d.request_id), Err(StateError::UnknownRequest { .. })));
    }

    #[test]
    fn reused_request_ids_are_made_unique() {
        let r = router();
        let mut req = RouteRequest::text("m", "hi");
        req.request_id = Some("abc".into());
        let a = r.route(&req, 0).unwrap();
        let b = r.route(&req, 0).unwrap();
        assert_eq!(a.request_id, "abc");
        assert_eq!(b.request_id, "abc~2");
        r.complete("abc").unwrap();
        r.complete("abc~2").unwrap();
        assert!(r.endpoints().iter().all(|e| e.inflight == 0));
    }

    #[test]
    fn a_reused_request_id_costs_o1_probes_per_decision() {
        let r = Router::default();
        r.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode)).unwrap();
        let body = br#"{"model":"m","prompt":"hello"}"#;
        let n = 3000u64;
        let mut ids = std::collections::BTreeSet::new();
        for t in 0..n {
            ids.insert(r.route_http(body, [("x-request-id", "same")], t).unwrap().request_id);
        }
        assert_eq!(ids.len() as u64, n, "every decision got its own id");
        assert!(ids.contains("same") && ids.contains("same~2") && ids.contains(format!("same~{n}").as_str()));
        // One probe per reuse (the unfixed loop probed every earlier suffix: n²/2 in all).
        assert_eq!(r.lock().id_probes, n - 1);
        // A suffix a caller supplied itself is skipped, not reused.
        r.route_http(body, [("x-request-id", format!("same~{}", n + 1).as_str())], n).unwrap();
        let d = r.route_http(body, [("x-request-id", "same")], n + 1).unwrap();
        assert_eq!(d.request_id, format!("same~{}", n + 2));
        for id in &ids {
            r.complete(id).unwrap();
        }
        // Once the original id is free again it is used as it is.
        assert_eq!(r.route_http(body, [("x-request-id", "same")], n + 2).unwrap().request_id, "same");
    }

    #[test]
    fn inflight_entries_expire() {
        let r = router();
        let d = r.route(&RouteRequest::text("m", "hi"), 0).unwrap();
        let timeout = r.policy().policy.config().limits.inflight_timeout_ms;
        r.route(&RouteRequest::text("m", "ho"), timeout + 1).unwrap();
        assert!(matches!(r.complete(&d.request_id), Err(StateError::UnknownRequest { .. })));
        assert_eq!(r.stats().counters.inflight_expired, 1);
        assert_eq!(r.endpoints().iter().map(|e| e.inflight).sum::<u32>(), 1);
    }

    #[test]
    fn endpoint_errors() {
        let r = router();
        assert!(matches!(
            r.upsert_endpoint(EndpointSpec::new("nope", Role::Decode)),
            Err(StateError::InvalidEndpointId { .. })
        ));
        assert!(matches!(r.remove_endpoint("10.9.9.9:1"), Err(StateError::UnknownEndpoint { .. })));
        assert!(matches!(
            r.update_metrics("10.9.9.9:1", MetricsSnapshot::default()),
            Err(StateError::UnknownEndpoint { .. })
        ));
        let bad = MetricsSnapshot { kv_usage: 2.0, ..Default::default() };
        assert!(matches!(r.update_metrics("10.0.0.1:8000", bad), Err(StateError::InvalidMetrics { .. })));
        assert_eq!(r.endpoints().len(), 2, "state unchanged");
        let empty = Router::default();
        assert!(matches!(empty.route(&RouteRequest::text("m", "x"), 0), Err(RouteError::NoEndpoints { .. })));
        let r2 = Router::new(Policy::from_json(r#"{"limits":{"max_endpoints":1}}"#).unwrap());
        r2.upsert_endpoint(EndpointSpec::new("10.0.0.1:1", Role::Both)).unwrap();
        assert_eq!(
            r2.upsert_endpoint(EndpointSpec::new("10.0.0.2:1", Role::Both)),
            Err(StateError::TooManyEndpoints { limit: 1 })
        );
    }

    #[test]
    fn prefill_only_fleet_cannot_route() {
        let r = Router::default();
        r.upsert_endpoint(EndpointSpec::new("10.0.0.1:1", Role::Prefill)).unwrap();
        assert!(matches!(r.route(&RouteRequest::text("m", "x"), 0), Err(RouteError::NoEndpoints { .. })));
        assert_eq!(r.stats().counters.route_errors, 1);
    }
}
