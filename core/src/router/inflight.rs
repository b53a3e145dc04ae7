//! Requests in flight, request ids and session keys.

use std::collections::{HashMap, VecDeque};

use hashbrown::HashTable;
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

/// Requests in flight: a table by request id plus the ids in arrival order (for expiry and the
/// size bound). Completed requests leave a stale entry in the order queue, skipped when reached
/// and compacted away when the queue grows to twice the table.
///
/// A ledger's (`state::Ledger`), under the ledger's lock in a `Router`, which the decisions and
/// completions of the same ledger on other threads wait for, so it does little there: every id
/// is hashed once, when it comes in (a completion's before the lock:
/// [`InflightTable::remove_hashed`]), and the table and the queue keep its hash; the queue's
/// front is always live and carries its start, so the oldest request's start (read at every
/// unlock) looks nothing up, and the queue is trimmed only when its front leaves.
#[derive(Debug)]
pub(super) struct InflightTable {
    map: HashTable<Entry>,
    order: VecDeque<Queued>,
    next_serial: u64,
}

#[derive(Debug)]
struct Entry {
    id: Arc<str>,
    hash: u64,
    f: Inflight,
}

/// A request in arrival order: its serial (stale when the table holds another one under the
/// id), the id's hash, when it started and the id.
#[derive(Debug)]
struct Queued {
    serial: u64,
    hash: u64,
    started_ms: u64,
    id: Arc<str>,
}

/// The table's hash of a request id (see [`InflightTable::remove_hashed`]).
pub(super) fn id_hash(id: &str) -> u64 {
    crate::approx::bytes_hash(id.as_bytes())
}

impl InflightTable {
    pub fn new() -> Self {
        InflightTable { map: HashTable::new(), order: VecDeque::new(), next_serial: 0 }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.find(id_hash(id), id).is_some()
    }

    fn find(&self, hash: u64, id: &str) -> Option<&Entry> {
        self.map.find(hash, |e| e.hash == hash && *e.id == *id)
    }

    /// Whether `q` is the live request of its id (not completed or replaced since).
    fn live(&self, q: &Queued) -> Option<&Inflight> {
        self.map.find(q.hash, |e| Arc::ptr_eq(&e.id, &q.id)).map(|e| &e.f).filter(|f| f.serial == q.serial)
    }

    /// Add (or replace) the request `id`.
    pub fn insert(&mut self, id: &str, target: SlotRef, prefill: Option<SlotRef>, started_ms: u64, tokens: u64) {
        self.next_serial += 1;
        let serial = self.next_serial;
        let hash = id_hash(id);
        let f = Inflight { target, prefill, started_ms, tokens, serial };
        let (key, replaced) = match self.map.find_mut(hash, |e| e.hash == hash && *e.id == *id) {
            // Replaced: its queue entry goes stale (another serial).
            Some(e) => {
                let old = std::mem::replace(&mut e.f, f);
                (e.id.clone(), Some(old.serial))
            }
            None => {
                let key: Arc<str> = Arc::from(id);
                self.map.insert_unique(hash, Entry { id: key.clone(), hash, f }, |e| e.hash);
                (key, None)
            }
        };
        self.order.push_back(Queued { serial, hash, started_ms, id: key });
        if self.order.len() > 2 * self.map.len() + 1024 {
            let mut order = std::mem::take(&mut self.order);
            order.retain(|q| self.live(q).is_some());
            self.order = order;
        }
        if replaced.is_some() && self.order.front().map(|q| q.serial) == replaced {
            self.trim_front();
        }
    }

    #[cfg(test)]
    pub fn remove(&mut self, id: &str) -> Option<Inflight> {
        self.remove_hashed(id_hash(id), id)
    }

    /// [`InflightTable::remove`] with the id's hash ([`id_hash`]) computed beforehand (outside
    /// the lock).
    pub fn remove_hashed(&mut self, hash: u64, id: &str) -> Option<Inflight> {
        let f = match self.map.find_entry(hash, |e| e.hash == hash && *e.id == *id) {
            Ok(e) => e.remove().0.f,
            Err(_) => return None,
        };
        // Any other front is still live.
        if self.order.front().is_some_and(|q| q.serial == f.serial) {
            self.order.pop_front();
            self.trim_front();
        }
        Some(f)
    }

    /// Drop stale entries (completed or replaced requests) from the front of the order queue,
    /// so that its front is the oldest live request again (amortized O(1): each entry is
    /// dropped once). Every change that can make the front stale ends with it.
    fn trim_front(&mut self) {
        while let Some(q) = self.order.front() {
            if self.live(q).is_some() {
                break;
            }
            self.order.pop_front();
        }
    }

    /// When the oldest request in flight started (the first one expiry would look at).
    pub fn oldest_started(&self) -> Option<u64> {
        let q = self.order.front()?;
        debug_assert!(self.live(q).is_some(), "the front of the queue is live");
        Some(q.started_ms)
    }

    /// Remove and return every request whose id satisfies `take` (a full scan: for rare events
    /// such as a replica's restart).
    pub fn drain_where(&mut self, take: impl Fn(&str) -> bool) -> Vec<Inflight> {
        let out = self.map.extract_if(|e| take(&e.id)).map(|e| e.f).collect();
        self.trim_front();
        out
    }

    /// Remove and return the oldest request for which `take(request)` holds (it stops at the
    /// first live one for which it does not).
    pub fn pop_oldest_if(&mut self, take: impl Fn(&Inflight) -> bool) -> Option<Inflight> {
        while let Some(q) = self.order.front() {
            match self.live(q) {
                Some(f) => {
                    if !take(f) {
                        return None;
                    }
                    let (hash, id) = (q.hash, q.id.clone());
                    self.order.pop_front();
                    let f = match self.map.find_entry(hash, |e| Arc::ptr_eq(&e.id, &id)) {
                        Ok(e) => Some(e.remove().0.f),
                        Err(_) => None,
                    };
                    // The next one may have left already: the front stays live.
                    self.trim_front();
                    return f;
                }
                // Completed (or replaced) since: a stale queue entry.
                None => {
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

/// The memory of reused request ids (ids the router generates are the ledgers', see
/// `state::Ledger`).
#[derive(Debug)]
pub(super) struct RequestIds {
    /// Next suffix per reused request id.
    reused_ids: HashMap<Arc<str>, u64, Xxh3DefaultBuilder>,
    /// In-flight lookups made to find a unique suffix for reused ids (tests).
    pub probes: u64,
}

impl RequestIds {
    pub fn new() -> Self {
        RequestIds { reused_ids: HashMap::with_hasher(Xxh3DefaultBuilder), probes: 0 }
    }

    /// The id of a new decision whose caller gave it `id`, unique among the requests in flight
    /// (`in_flight` says whether an id is).
    pub fn assign(&mut self, id: &str, in_flight: impl Fn(&str) -> bool) -> String {
        if !in_flight(id) {
            return id.to_owned();
        }
        // The caller reused an id still in flight: make it unique (`{id}~{n}`) so neither
        // request's counters are lost; the decision carries the id to complete with. The next
        // suffix to try is remembered per reused id, so a suffix is probed at most once until
        // the memory is cleared: O(1) amortized per decision, however many requests share the
        // id.
        if !self.reused_ids.contains_key(id) {
            if self.reused_ids.len() >= REUSED_IDS_MAX {
                self.reused_ids.clear();
            }
            self.reused_ids.insert(Arc::from(id), 2);
        }
        let Some(next) = self.reused_ids.get_mut(id) else { return format!("{id}~2") };
        loop {
            let candidate = format!("{id}~{next}");
            *next += 1;
            self.probes += 1;
            if !in_flight(candidate.as_str()) {
                return candidate;
            }
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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{InflightTable, SlotRef};

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u64),
        Remove(u8),
        /// Pop the oldest while it started before this time.
        Expire(u64),
        /// Drain the ids of this group (`id % 3`).
        Drain(u8),
        /// Pop the oldest once, whatever it is (the table's size bound).
        PopOldest,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u8..24, 0u64..1000).prop_map(|(i, t)| Op::Insert(i, t)),
            3 => (0u8..24).prop_map(Op::Remove),
            1 => (0u64..1000).prop_map(Op::Expire),
            1 => (0u8..3).prop_map(Op::Drain),
            1 => Just(Op::PopOldest),
        ]
    }

    fn id(i: u8) -> String {
        format!("req-{}-{i}", i % 3)
    }

    /// The table against a model: the requests in flight in arrival order, a replaced request
    /// moving to the back (it arrived again).
    fn check(ops: &[Op]) -> Result<(), TestCaseError> {
        let mut t = InflightTable::new();
        let mut model: Vec<(String, u64)> = Vec::new();
        let at = SlotRef { slot: 0, incarnation: 1 };
        for op in ops {
            match *op {
                Op::Insert(i, started) => {
                    t.insert(&id(i), at, None, started, u64::from(i));
                    model.retain(|(m, _)| *m != id(i));
                    model.push((id(i), started));
                }
                Op::Remove(i) => {
                    let got = t.remove(&id(i)).map(|f| f.started_ms);
                    let want = model.iter().position(|(m, _)| *m == id(i)).map(|p| model.remove(p).1);
                    prop_assert_eq!(got, want);
                }
                Op::Expire(before) => loop {
                    let got = t.pop_oldest_if(|f| f.started_ms < before).map(|f| (f.started_ms, f.tokens));
                    let want = match model.first() {
                        Some((m, s)) if *s < before => {
                            let n = m.rsplit('-').next().and_then(|n| n.parse::<u64>().ok());
                            let s = *s;
                            model.remove(0);
                            n.map(|n| (s, n))
                        }
                        _ => None,
                    };
                    prop_assert_eq!(got, want);
                    if got.is_none() {
                        break;
                    }
                },
                Op::PopOldest => {
                    let got = t.pop_oldest_if(|_| true).map(|f| f.started_ms);
                    let want = (!model.is_empty()).then(|| model.remove(0).1);
                    prop_assert_eq!(got, want);
                }
                Op::Drain(g) => {
                    let prefix = format!("req-{g}-");
                    let mut got: Vec<u64> =
                        t.drain_where(|i| i.starts_with(&prefix)).iter().map(|f| f.tokens).collect();
                    got.sort_unstable();
                    let mut want: Vec<u64> = model
                        .iter()
                        .filter(|(m, _)| m.starts_with(&prefix))
                        .filter_map(|(m, _)| m.rsplit('-').next().and_then(|n| n.parse().ok()))
                        .collect();
                    want.sort_unstable();
                    model.retain(|(m, _)| !m.starts_with(&prefix));
                    prop_assert_eq!(got, want);
                }
            }
            prop_assert_eq!(t.len(), model.len());
            prop_assert_eq!(t.oldest_started(), model.first().map(|(_, s)| *s));
            for i in 0..24 {
                prop_assert_eq!(t.contains(&id(i)), model.iter().any(|(m, _)| *m == id(i)));
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn the_table_keeps_arrival_order_through_replacements_and_removals(ops in prop::collection::vec(op(), 0..200)) {
            check(&ops)?;
        }
    }

    /// Enough replacements that the order queue compacts its stale entries (past twice the
    /// table plus 1024) while the oldest request stays in front.
    #[test]
    fn the_order_queue_compacts_without_losing_the_oldest() {
        let mut ops = vec![Op::Insert(23, 1)];
        for k in 0..3000u64 {
            ops.push(Op::Insert((k % 20) as u8, 10 + k));
        }
        ops.push(Op::Remove(23));
        ops.push(Op::Expire(2000));
        check(&ops).unwrap();
        let mut t = InflightTable::new();
        let at = SlotRef { slot: 0, incarnation: 1 };
        for k in 0..5000u64 {
            t.insert("same", at, None, k, 0);
        }
        assert!(t.order.len() <= 2 * t.map.len() + 1025, "{} queued for {} in flight", t.order.len(), t.map.len());
        assert_eq!(t.oldest_started(), Some(4999));
    }
}
