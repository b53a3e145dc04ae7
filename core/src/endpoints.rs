//! The endpoint table: registered model servers, their roles, metric snapshots and the in-flight
//! counters the router maintains itself.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::StateError;

/// What an endpoint can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill only (disaggregated serving).
    Prefill,
    /// Decode (a decode worker can also prefill locally when no prefill endpoint is named).
    Decode,
    /// Prefill and decode (a colocated worker).
    Both,
}

impl Role {
    /// Can run the decode phase (and so serve decode-direct and colocated requests).
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
    /// Can run the prefill phase for a disaggregated request.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
}

/// An endpoint to register.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointSpec {
    /// `ip:port` (IPv4 or bracketed IPv6).
    pub id: String,
    /// Role.
    pub role: Role,
}

impl EndpointSpec {
    /// A new spec.
    pub fn new(id: impl Into<String>, role: Role) -> Self {
        EndpointSpec { id: id.into(), role }
    }
}

/// A metrics snapshot of one endpoint (as scraped from its `/metrics` or pushed).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSnapshot {
    /// Requests waiting in the engine queue.
    pub waiting: u32,
    /// Requests running.
    pub running: u32,
    /// KV-cache usage 0–1.
    pub kv_usage: f64,
    /// LoRA adapters loaded and running.
    pub lora_running: Vec<String>,
    /// LoRA adapters waiting to be loaded.
    pub lora_waiting: Vec<String>,
    /// Maximum adapters the endpoint can hold at once (`None`: unknown / no LoRA support).
    pub max_lora: Option<u32>,
    /// KV-cache capacity in tokens (vLLM `cache_config_info`: block_size × num_gpu_blocks).
    pub kv_capacity_tokens: Option<u64>,
    /// When the snapshot was taken, milliseconds on the router's clock.
    pub updated_ms: u64,
}

impl MetricsSnapshot {
    pub(crate) fn validate(&self, endpoint: &str) -> Result<(), StateError> {
        if !self.kv_usage.is_finite() || !(0.0..=1.0).contains(&self.kv_usage) {
            return Err(StateError::InvalidMetrics {
                endpoint: endpoint.to_owned(),
                field: "kv_usage",
                value: self.kv_usage.to_string(),
                reason: "must be within [0, 1]",
            });
        }
        Ok(())
    }
}

/// Router-side state of one endpoint.
#[derive(Debug, Clone)]
pub(crate) struct EndpointState {
    pub id: Arc<str>,
    pub role: Role,
    pub healthy: bool,
    pub metrics: Option<MetricsSnapshot>,
    /// What the router's own traffic puts on the endpoint (atomic counters: decisions on several
    /// threads count requests sent and completed without an exclusive lock).
    pub load: Load,
    /// KV usage per running request in the latest snapshot that had any running (0: none yet).
    pub kv_per_request: f64,
    /// Changes every time the slot is (re)assigned, so stale references can be detected.
    pub incarnation: u32,
}

/// `Load::last_assigned_ms` when no request was ever sent.
const NEVER: u64 = u64::MAX;

/// An endpoint's load as the router's own traffic makes it: per-endpoint atomic counters, changed
/// through `&self` (relaxed: each is a counter on its own; a decision reads them as they are,
/// like any state another thread may change a moment later).
///
/// The counters fill a cache line of their own (`align(64)`): every decision's scoring pass reads
/// every endpoint's state while other threads book requests into these counters, and a write
/// here then takes away from the readers' caches only this line. Unaligned, the counters sat at
/// byte 112 of a 160-byte `EndpointState` (a table slot): on a line shared with the endpoint's
/// other fields and the next slot's metrics, and for some slots across two lines.
#[derive(Debug)]
#[repr(align(64))]
pub(crate) struct Load {
    /// Requests in flight (router-tracked).
    inflight: AtomicU32,
    /// Tokens (input + output budget) of the requests this router has in flight here (requests
    /// applied from another instance's effect count 0).
    inflight_tokens: AtomicU64,
    /// When a decision last sent a request here (as target or prefill endpoint), this router's
    /// own or one applied from another instance (`NEVER`: never). Replicated state: instances fed
    /// the same effects hold the same value.
    last_assigned_ms: AtomicU64,
    /// The snapshot's waiting queue corrected by the router's own traffic since it was stored
    /// (`sent` adds one request, `done` takes one off).
    waiting_now: AtomicU32,
    /// The snapshot's KV usage, corrected likewise (an `f64`'s bits).
    kv_usage_now: AtomicU64,
}

// One cache line, the counters' alone (see `Load`); a larger `Load` should be a deliberate choice.
const _: () = assert!(std::mem::align_of::<Load>() == 64 && std::mem::size_of::<Load>() == 64);

impl Default for Load {
    fn default() -> Self {
        Load {
            inflight: AtomicU32::new(0),
            inflight_tokens: AtomicU64::new(0),
            last_assigned_ms: AtomicU64::new(NEVER),
            waiting_now: AtomicU32::new(0),
            kv_usage_now: AtomicU64::new(0f64.to_bits()),
        }
    }
}

impl Clone for Load {
    fn clone(&self) -> Self {
        Load {
            inflight: AtomicU32::new(self.inflight()),
            inflight_tokens: AtomicU64::new(self.inflight_tokens()),
            last_assigned_ms: AtomicU64::new(self.last_assigned_ms.load(Relaxed)),
            waiting_now: AtomicU32::new(self.waiting_now()),
            kv_usage_now: AtomicU64::new(self.kv_usage_now().to_bits()),
        }
    }
}

fn update_f64(a: &AtomicU64, f: impl Fn(f64) -> f64) {
    // The closure always returns `Some`: `fetch_update` cannot fail.
    let _ = a.fetch_update(Relaxed, Relaxed, |bits| Some(f(f64::from_bits(bits)).to_bits()));
}

fn update_u32(a: &AtomicU32, f: impl Fn(u32) -> u32) {
    let _ = a.fetch_update(Relaxed, Relaxed, |v| Some(f(v)));
}

impl Load {
    /// Requests in flight here (router-tracked).
    pub fn inflight(&self) -> u32 {
        self.inflight.load(Relaxed)
    }

    /// Tokens of the requests in flight here.
    pub fn inflight_tokens(&self) -> u64 {
        self.inflight_tokens.load(Relaxed)
    }

    /// When a request was last sent here (`None`: never).
    pub fn last_assigned_ms(&self) -> Option<u64> {
        Some(self.last_assigned_ms.load(Relaxed)).filter(|&t| t != NEVER)
    }

    /// The reported waiting queue corrected by the router's traffic since.
    pub fn waiting_now(&self) -> u32 {
        self.waiting_now.load(Relaxed)
    }

    /// The reported KV usage corrected by the router's traffic since.
    pub fn kv_usage_now(&self) -> f64 {
        f64::from_bits(self.kv_usage_now.load(Relaxed))
    }

    /// A request of `tokens` tokens sent here at `now_ms` is in flight.
    pub fn track(&self, tokens: u64, now_ms: u64) {
        update_u32(&self.inflight, |v| v.saturating_add(1));
        let _ = self.inflight_tokens.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_add(tokens)));
        // The latest of the times (never `NEVER`, which is above every real time).
        let _ = self.last_assigned_ms.fetch_update(Relaxed, Relaxed, |t| {
            Some(if t == NEVER { now_ms.min(NEVER - 1) } else { t.max(now_ms.min(NEVER - 1)) })
        });
    }

    /// A request of `tokens` tokens in flight here is no longer.
    pub fn release(&self, tokens: u64) {
        update_u32(&self.inflight, |v| v.saturating_sub(1));
        let _ = self.inflight_tokens.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(tokens)));
    }

    /// Set the requests in flight outright (tests).
    #[cfg(test)]
    pub fn set_requests(&self, requests: u32) {
        self.inflight.store(requests, Relaxed);
    }

    /// Set the tokens in flight outright (tests).
    #[cfg(test)]
    pub fn set_tokens(&self, tokens: u64) {
        self.inflight_tokens.store(tokens, Relaxed);
    }
}

impl EndpointState {
    /// Store a metrics snapshot; the corrected queue and KV usage restart from it.
    pub(crate) fn set_metrics(&mut self, m: MetricsSnapshot) {
        if m.running > 0 {
            self.kv_per_request = m.kv_usage / f64::from(m.running);
        }
        self.load.waiting_now.store(m.waiting, Relaxed);
        self.load.kv_usage_now.store(m.kv_usage.to_bits(), Relaxed);
        self.metrics = Some(m);
    }

    /// A request was sent here (tracked in flight): until the next snapshot it counts as one
    /// more waiting request and one more request's share of KV usage (the snapshot's usage per
    /// running request, or the last one known). Metrics lag by a scrape interval while the
    /// router's own traffic is known at once; read as they are, a stale report would send every
    /// request between two scrapes to whichever endpoint last reported least.
    pub(crate) fn sent(&self) {
        update_u32(&self.load.waiting_now, |v| v.saturating_add(1));
        let share = self.kv_per_request;
        update_f64(&self.load.kv_usage_now, |u| (u + share).min(1.0));
    }

    /// A request here completed (or expired): one request and one share less, never below 0.
    pub(crate) fn done(&self) {
        update_u32(&self.load.waiting_now, |v| v.saturating_sub(1));
        let share = self.kv_per_request;
        update_f64(&self.load.kv_usage_now, |u| (u - share).max(0.0));
    }
}

/// The endpoint table. Endpoints live in numbered slots (the index refers to slots); iteration is
/// in id order so decisions do not depend on registration order.
#[derive(Debug)]
pub(crate) struct EndpointTable {
    slots: Vec<Option<EndpointState>>,
    by_id: BTreeMap<Arc<str>, u16>,
    order: Vec<u16>,
    /// Changes with every change of the ids (`by_id`), unique in the process (see
    /// [`roster_version`]): a decision scratch's copy of the ids (its roster) is current while
    /// the version it was made at is.
    roster_version: u64,
    incarnations: u32,
}

/// Roster versions: unique in the process, so that a thread's copy of a roster (the decision
/// scratch's) is never taken for another router's.
static ROSTER_VERSIONS: AtomicU64 = AtomicU64::new(1);

fn roster_version() -> u64 {
    ROSTER_VERSIONS.fetch_add(1, Relaxed)
}

impl Default for EndpointTable {
    fn default() -> Self {
        EndpointTable {
            slots: Vec::new(),
            by_id: BTreeMap::new(),
            order: Vec::new(),
            roster_version: roster_version(),
            incarnations: 0,
        }
    }
}

/// Validate an `ip:port` endpoint id.
pub fn validate_endpoint_id(id: &str) -> Result<(), StateError> {
    match id.parse::<SocketAddr>() {
        Ok(a) if a.port() != 0 => Ok(()),
        Ok(_) => Err(StateError::InvalidEndpointId { id: id.to_owned(), reason: "port must not be 0".into() }),
        Err(_) => Err(StateError::InvalidEndpointId {
            id: id.chars().take(128).collect(),
            reason: "expected ip:port (e.g. 10.0.0.7:8000 or [fd00::7]:8000)".into(),
        }),
    }
}

impl EndpointTable {
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn slot_of(&self, id: &str) -> Option<u16> {
        self.by_id.get(id).copied()
    }

    pub fn get(&self, slot: u16) -> Option<&EndpointState> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    pub fn get_mut(&mut self, slot: u16) -> Option<&mut EndpointState> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// Slots in id order.
    pub fn order(&self) -> &[u16] {
        &self.order
    }

    /// Ids in id order (aligned with `order`).
    pub fn ids(&self) -> impl ExactSizeIterator<Item = &Arc<str>> + '_ {
        self.by_id.keys()
    }

    /// The version of the ids: equal versions, equal ids (unique in the process).
    pub fn roster_version(&self) -> u64 {
        self.roster_version
    }

    /// Insert a new endpoint in a free slot accepted by `reusable` (or a fresh one); returns the
    /// slot. The caller has checked that `spec.id` is new and valid and the limit is not reached.
    pub fn insert(&mut self, spec: &EndpointSpec, reusable: impl Fn(usize) -> bool) -> u16 {
        let slot = match (0..self.slots.len()).find(|&s| self.slots[s].is_none() && reusable(s)) {
            Some(s) => s,
            None => match (0..self.slots.len()).find(|&s| self.slots[s].is_none()) {
                // Every free slot still has records of a previous holder awaiting the sweeper
                // and the table cannot grow: the caller's index collects them on activation.
                Some(s) if self.slots.len() >= crate::index::MAX_SLOTS => s,
                _ if self.slots.len() < crate::index::MAX_SLOTS => {
                    self.slots.push(None);
                    self.slots.len() - 1
                }
                _ => 0,
            },
        };
        self.incarnations = self.incarnations.wrapping_add(1);
        let id: Arc<str> = Arc::from(spec.id.as_str());
        self.slots[slot] = Some(EndpointState {
            id: id.clone(),
            role: spec.role,
            healthy: true,
            metrics: None,
            load: Load::default(),
            kv_per_request: 0.0,
            incarnation: self.incarnations,
        });
        let slot = slot as u16;
        self.by_id.insert(id, slot);
        self.rebuild_order();
        slot
    }

    pub fn remove(&mut self, id: &str) -> Option<u16> {
        let slot = self.by_id.remove(id)?;
        self.slots[slot as usize] = None;
        self.rebuild_order();
        Some(slot)
    }

    fn rebuild_order(&mut self) {
        self.order.clear();
        self.order.extend(self.by_id.values().copied());
        self.roster_version = roster_version();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_must_be_socket_addresses() {
        assert!(validate_endpoint_id("10.0.0.1:8000").is_ok());
        assert!(validate_endpoint_id("[fd00::1]:8000").is_ok());
        for bad in ["10.0.0.1", "host:80", "10.0.0.1:0", "10.0.0.1:99999", "", "[fd00::1]"] {
            assert!(matches!(validate_endpoint_id(bad), Err(StateError::InvalidEndpointId { .. })), "{bad}");
        }
    }

    #[test]
    fn order_is_by_id_and_slots_are_reused() {
        let mut t = EndpointTable::default();
        let b = t.insert(&EndpointSpec::new("10.0.0.2:1", Role::Decode), |_| true);
        let a = t.insert(&EndpointSpec::new("10.0.0.1:1", Role::Decode), |_| true);
        assert_eq!(t.order(), &[a, b]);
        assert_eq!(t.remove("10.0.0.2:1"), Some(b));
        let inc_before = t.get(a).unwrap().incarnation;
        let c = t.insert(&EndpointSpec::new("10.0.0.3:1", Role::Prefill), |_| true);
        assert_eq!(c, b, "free slot reused");
        assert_ne!(t.get(c).unwrap().incarnation, inc_before);
        let d = t.insert(&EndpointSpec::new("10.0.0.4:1", Role::Both), |_| false);
        assert_eq!(d, 2, "not reusable: fresh slot");
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn metrics_validation() {
        let m = MetricsSnapshot { kv_usage: 1.5, ..Default::default() };
        assert!(matches!(m.validate("e"), Err(StateError::InvalidMetrics { field: "kv_usage", .. })));
        let m = MetricsSnapshot { kv_usage: f64::NAN, ..Default::default() };
        assert!(m.validate("e").is_err());
        assert!(MetricsSnapshot::default().validate("e").is_ok());
    }
}
