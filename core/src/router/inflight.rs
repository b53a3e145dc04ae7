//! Requests in flight, request ids and session keys.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use xxhash_rust::xxh3::{Xxh3, Xxh3DefaultBuilder};

use crate::request::RouteRequest;

/// An endpoint slot as it was when a request was sent there: a request still in flight at an
/// endpoint removed since (and its slot reused) releases nothing on the new one.
#[derive(Debug, Clone, Copy)]
pub(super) struct SlotRef {
    pub slot: u16,
    pub incarnation: u32,
}

#[derive(Debug)]
pub(super) struct Inflight {
    pub target: SlotRef,
    pub prefill: Option<SlotRef>,
    pub started_ms: u64,
    /// Tokens counted in the endpoints' `inflight_tokens` (input + output budget).
    pub tokens: u64,
    serial: u64,
}

/// Requests in flight: a map by request id plus the ids in arrival order (for expiry and the
/// size bound). Completed requests leave a stale entry in the order queue, skipped when reached
/// and compacted away when the queue grows to twice the map.
#[derive(Debug)]
pub(super) struct InflightTable {
    map: HashMap<Arc<str>, Inflight, Xxh3DefaultBuilder>,
    order: VecDeque<(u64, Arc<str>)>,
    next_serial: u64,
}

impl InflightTable {
    pub fn new() -> Self {
        InflightTable { map: HashMap::with_hasher(Xxh3DefaultBuilder), order: VecDeque::new(), next_serial: 0 }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.map.contains_key(id)
    }

    pub fn insert(&mut self, id: &str, target: SlotRef, prefill: Option<SlotRef>, started_ms: u64, tokens: u64) {
        self.next_serial += 1;
        let serial = self.next_serial;
        let key: Arc<str> = Arc::from(id);
        self.order.push_back((serial, key.clone()));
        self.map.insert(key, Inflight { target, prefill, started_ms, tokens, serial });
        if self.order.len() > 2 * self.map.len() + 1024 {
            let map = &self.map;
            self.order.retain(|(serial, id)| map.get(id).is_some_and(|f| f.serial == *serial));
        }
        self.trim_front();
    }

    pub fn remove(&mut self, id: &str) -> Option<Inflight> {
        let f = self.map.remove(id);
        self.trim_front();
        f
    }

    /// Drop stale entries (completed or replaced requests) from the front of the order queue,
    /// so that its front is always the oldest live request (amortized O(1): each entry is
    /// dropped once).
    fn trim_front(&mut self) {
        while let Some((serial, id)) = self.order.front() {
            if self.map.get(id).is_some_and(|f| f.serial == *serial) {
                break;
            }
            self.order.pop_front();
        }
    }

    /// When the oldest request in flight started (the first one expiry would look at).
    pub fn oldest_started(&self) -> Option<u64> {
        let (serial, id) = self.order.front()?;
        match self.map.get(id) {
            Some(f) if f.serial == *serial => Some(f.started_ms),
            // Unreachable (the front is kept live); report it as due so expiry cleans up.
            _ => Some(0),
        }
    }

    /// Remove and return every request whose id satisfies `take` (a full scan: for rare events
    /// such as a replica's restart).
    pub fn drain_where(&mut self, take: impl Fn(&str) -> bool) -> Vec<Inflight> {
        let ids: Vec<Arc<str>> = self.map.keys().filter(|id| take(id)).cloned().collect();
        let out = ids.iter().filter_map(|id| self.map.remove(id)).collect();
        self.trim_front();
        out
    }

    /// Remove and return the oldest request for which `take(request)` holds (it stops at the
    /// first live one for which it does not).
    pub fn pop_oldest_if(&mut self, take: impl Fn(&Inflight) -> bool) -> Option<Inflight> {
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

/// Reused request ids whose next suffix is remembered (see [`RequestIds::assign`]); beyond this
/// many the memory starts over (each suffix then is probed once more at worst).
const REUSED_IDS_MAX: usize = 4096;

/// Request ids: the caller's (made unique when reused while in flight) or generated `kvr-N`.
#[derive(Debug)]
pub(super) struct RequestIds {
    next_request: u64,
    /// Next suffix per reused request id.
    reused_ids: HashMap<Arc<str>, u64, Xxh3DefaultBuilder>,
    /// In-flight lookups made to find a unique suffix for reused ids (tests).
    pub probes: u64,
}

impl RequestIds {
    pub fn new() -> Self {
        RequestIds { next_request: 0, reused_ids: HashMap::with_hasher(Xxh3DefaultBuilder), probes: 0 }
    }

    /// The id of a new decision for `req`, unique among the requests in flight.
    pub fn assign(&mut self, inflight: &InflightTable, req: &RouteRequest) -> String {
        match &req.request_id {
            Some(id) if !inflight.contains(id.as_str()) => id.clone(),
            Some(id) => {
                // The caller reused an id still in flight: make it unique (`{id}~{n}`) so neither
                // request's counters are lost; the decision carries the id to complete with. The
                // next suffix to try is remembered per reused id, so a suffix is probed at most
                // once until the memory is cleared: O(1) amortized per decision, however many
                // requests share the id.
                if !self.reused_ids.contains_key(id.as_str()) {
                    if self.reused_ids.len() >= REUSED_IDS_MAX {
                        self.reused_ids.clear();
                    }
                    self.reused_ids.insert(Arc::from(id.as_str()), 2);
                }
                let Some(next) = self.reused_ids.get_mut(id.as_str()) else { return format!("{id}~2") };
                loop {
                    let candidate = format!("{id}~{next}");
                    *next += 1;
                    self.probes += 1;
                    if !inflight.contains(candidate.as_str()) {
                        return candidate;
                    }
                }
            }
            None => loop {
                // Skip ids in flight (replicated from another instance, or given by a caller).
                self.next_request += 1;
                let id = format!("kvr-{}", self.next_request);
                if !inflight.contains(id.as_str()) {
                    return id;
                }
            },
        }
    }
}

/// The session-affinity key of a request: its session id within its tenant. The tenant is the
/// fairness id and the cache_salt (an empty salt is no salt), so another tenant reusing a session
/// id is never steered to the first tenant's endpoint. Each part is length-prefixed, so no two
/// different (fairness id, salt, session id) triples share an input.
pub(super) fn session_key(req: &RouteRequest) -> Option<u64> {
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
