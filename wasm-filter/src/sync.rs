//! The replicated log the worker VMs share: a bounded ring of entries in proxy-wasm shared data.
//!
//! Envoy runs one VM per worker thread; each has its own [`kvroute::RouterCore`]. Every state change
//! one VM makes (a routing decision's effects, a completion, a metrics snapshot, an event batch, a
//! stream resync, a request flow control queued or that left its queue) is appended to the log,
//! and every VM applies the entries it has not seen before each routing decision and on each
//! tick. `wasm-filter/README.md` explains the choice;
//! this module is the protocol, written against [`SharedStore`] so it is tested natively.
//!
//! # Keys (all under the configured namespace `ns` and ring size `N`)
//! - `ns/rN/head`: the next sequence number (u64 LE). A writer claims sequence `s` by a
//!   compare-and-swap of `head` from `s` to `s + 1`, then stores its entry at `ns/rN/e/{s % N}`.
//!   Several entries at once ([`SharedLog::append_all`]: completions deferred with
//!   [`SharedLog::defer_complete`] and the next entry) take `s..s + k` with one swap to `s + k`,
//!   then one slot write each (nothing changes for readers).
//! - An entry starts with its own sequence number, so a reader tells a slot that still holds an
//!   older lap (`stored < s`: written later, pending) from one already overwritten by a newer lap
//!   (`stored > s`: the reader fell more than `N` entries behind: an overrun).
//! - `kvroute/instances`: a counter giving every router instance (root context) a unique id;
//!   entries carry their writer's id so a VM skips its own.
//! - `ns/rN/poller`: the metric-polling lease (holder id, expiry).
//!
//! # Guarantees
//! - Every entry is applied at most once per VM, in sequence order, by every VM but its writer.
//! - A VM that applies the log before deciding sees every entry whose append completed before
//!   it read `head` (sequential requests on different VMs see each other's effects).
//! - Pending slots (claimed, not yet written: another worker thread is between its two shared
//!   data calls) stop the reader until written or [`PENDING_SKIP_MS`] has passed (then skipped
//!   and counted as lost).
//! - Overruns are detected, counted and skipped to the oldest retained entry.

/// A pending (claimed but unwritten) slot is skipped after this long (ms).
pub const PENDING_SKIP_MS: u64 = 1_000;
/// A claim gives up after this many compare-and-swap conflicts in a row.
pub const MAX_CAS_ATTEMPTS: u32 = 64;
/// Key of the instance-id counter.
pub const INSTANCES_KEY: &str = "kvroute/instances";

const VERSION: u8 = 1;
/// The reused entry buffer is dropped rather than kept when an entry grew it past this.
const MAX_KEPT_ENTRY_BUF: usize = 4096;
const HEADER: usize = 1 + 8 + 8 + 1;

/// A shared-data operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The compare-and-swap token no longer matches (another VM wrote the key).
    CasMismatch,
    /// The host refused the call.
    Host(String),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::CasMismatch => f.write_str("shared data CAS mismatch"),
            StoreError::Host(s) => write!(f, "shared data: {s}"),
        }
    }
}

impl std::error::Error for StoreError {}

/// Key/value storage with compare-and-swap, shared by the VMs (proxy-wasm shared data).
pub trait SharedStore {
    /// Value and CAS token of `key` (`None` when absent).
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError>;
    /// Store `value`; with `Some(cas)`, only if the key's token still is `cas`.
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

/// How the writer's router judged an event batch (so that readers can tell when their own
/// judgment diverges, see the README's fallback).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerdictCode {
    /// Applied.
    Applied,
    /// Duplicate, ignored.
    Duplicate,
    /// Gap, not applied.
    Gap,
    /// Publisher restart, applied.
    Reset,
}

impl VerdictCode {
    /// From the core's verdict.
    pub fn of(v: &kvroute::StreamVerdict) -> VerdictCode {
        match v {
            kvroute::StreamVerdict::Applied => VerdictCode::Applied,
            kvroute::StreamVerdict::Duplicate => VerdictCode::Duplicate,
            kvroute::StreamVerdict::Gap { .. } => VerdictCode::Gap,
            kvroute::StreamVerdict::Reset => VerdictCode::Reset,
        }
    }

    fn byte(self) -> u8 {
        match self {
            VerdictCode::Applied => 0,
            VerdictCode::Duplicate => 1,
            VerdictCode::Gap => 2,
            VerdictCode::Reset => 3,
        }
    }

    fn from_byte(b: u8) -> Option<VerdictCode> {
        Some(match b {
            0 => VerdictCode::Applied,
            1 => VerdictCode::Duplicate,
            2 => VerdictCode::Gap,
            3 => VerdictCode::Reset,
            _ => return None,
        })
    }
}

/// One log entry.
#[derive(Debug, Clone, PartialEq)]
pub enum Entry<'a> {
    /// A routing decision's effects (`kvroute::RoutingEffect::encode`).
    Effect(&'a [u8]),
    /// The request with this id (as its writer's router knows it) completed.
    Complete(&'a str),
    /// A metrics snapshot of `endpoint` (`kvroute::MetricsSnapshot` as JSON).
    Metrics {
        /// Endpoint id.
        endpoint: &'a str,
        /// The snapshot, JSON.
        snapshot: &'a [u8],
    },
    /// An engine KV-event batch, as ingested.
    Events {
        /// Endpoint id.
        endpoint: &'a str,
        /// Publisher sequence number.
        seq: Option<u64>,
        /// Ingestion time (ms).
        now_ms: u64,
        /// The writer's verdict.
        verdict: VerdictCode,
        /// The raw msgpack payload.
        payload: &'a [u8],
    },
    /// The endpoint's event stream was resynchronized.
    Resync {
        /// Endpoint id.
        endpoint: &'a str,
        /// Time (ms).
        now_ms: u64,
    },
    /// Flow control queued one of the writer's requests (its ticket there, and what the other
    /// VMs need to hold a replica of it: `kvroute::FlowReplica`).
    FlowQueued {
        /// The writer's ticket.
        ticket: u64,
        /// Fairness id.
        fairness_id: &'a str,
        /// Priority.
        priority: i32,
        /// When the writer queued it (ms).
        enqueue_ms: u64,
        /// Size (bytes).
        bytes: u64,
        /// Input tokens + output budget.
        tokens: u64,
        /// Attained-service cost.
        cost: f64,
        /// TTFT objective (ms).
        slo_ttft_ms: Option<u64>,
        /// Own queue TTL (ms).
        ttl_ms: Option<u64>,
    },
    /// The writer's queued request `ticket` left its queue (dispatched, answered or cancelled).
    FlowLeft {
        /// The writer's ticket.
        ticket: u64,
    },
    /// Another router replica's batch (`kvroute::ReplicaBatch`, validated by the writer), posted
    /// by the relay: every VM applies it with `RouterCore::apply_replica_bytes`.
    Replica(&'a [u8]),
}

impl<'a> Entry<'a> {
    /// The entry announcing the writer's queued request `ticket`.
    pub fn flow_queued(ticket: u64, r: &'a kvroute::FlowReplica) -> Entry<'a> {
        Entry::FlowQueued {
            ticket,
            fairness_id: &r.fairness_id,
            priority: r.priority,
            enqueue_ms: r.enqueue_ms,
            bytes: r.bytes,
            tokens: r.tokens,
            cost: r.cost,
            slo_ttft_ms: r.slo_ttft_ms,
            ttl_ms: r.ttl_ms,
        }
    }

    /// The replica a [`Entry::FlowQueued`] describes.
    pub fn flow_replica(&self) -> Option<kvroute::FlowReplica> {
        match *self {
            Entry::FlowQueued {
                fairness_id, priority, enqueue_ms, bytes, tokens, cost, slo_ttft_ms, ttl_ms, ..
            } => Some(kvroute::FlowReplica {
                fairness_id: fairness_id.to_owned(),
                priority,
                enqueue_ms,
                bytes,
                tokens,
                cost,
                slo_ttft_ms,
                ttl_ms,
            }),
            _ => None,
        }
    }
}

fn put_opt(out: &mut Vec<u8>, v: Option<u64>) {
    out.push(u8::from(v.is_some()));
    out.extend_from_slice(&v.unwrap_or(0).to_le_bytes());
}

fn take_opt(b: &mut &[u8]) -> Option<Option<u64>> {
    let has = take(b, 1)?[0];
    let v = take_u64(b)?;
    match has {
        0 => Some(None),
        1 => Some(Some(v)),
        _ => None,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let n = u16::try_from(s.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..usize::from(n)]);
}

fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if b.len() < n {
        return None;
    }
    let (head, rest) = b.split_at(n);
    *b = rest;
    Some(head)
}

fn take_u64(b: &mut &[u8]) -> Option<u64> {
    let s = take(b, 8)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Some(u64::from_le_bytes(a))
}

fn take_str<'a>(b: &mut &'a [u8]) -> Option<&'a str> {
    let n = take(b, 2)?;
    let n = usize::from(u16::from_le_bytes([n[0], n[1]]));
    std::str::from_utf8(take(b, n)?).ok()
}

impl Entry<'_> {
    fn kind(&self) -> u8 {
        match self {
            Entry::Effect(_) => 1,
            Entry::Complete(_) => 2,
            Entry::Metrics { .. } => 3,
            Entry::Events { .. } => 4,
            Entry::Resync { .. } => 5,
            Entry::FlowQueued { .. } => 6,
            Entry::FlowLeft { .. } => 7,
            Entry::Replica(_) => 8,
        }
    }

    /// The stored form: header (version, sequence, origin, kind) and body.
    pub fn encode(&self, seq: u64, origin: u64) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(seq, origin, &mut out);
        out
    }

    /// [`Entry::encode`] into `out` (cleared first; its buffer is reused).
    pub fn encode_into(&self, seq: u64, origin: u64, out: &mut Vec<u8>) {
        out.clear();
        let body_len = match self {
            Entry::Effect(b) => b.len(),
            Entry::Complete(s) => s.len(),
            Entry::Metrics { endpoint, snapshot } => 2 + endpoint.len() + snapshot.len(),
            Entry::Events { endpoint, payload, .. } => 2 + endpoint.len() + 18 + payload.len(),
            Entry::Resync { endpoint, .. } => 2 + endpoint.len() + 8,
            Entry::FlowQueued { fairness_id, .. } => 8 * 5 + 4 + 2 * 9 + 2 + fairness_id.len(),
            Entry::FlowLeft { .. } => 8,
            Entry::Replica(b) => b.len(),
        };
        out.reserve(HEADER + body_len);
        out.push(VERSION);
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&origin.to_le_bytes());
        out.push(self.kind());
        match self {
            Entry::Effect(b) => out.extend_from_slice(b),
            Entry::Complete(s) => out.extend_from_slice(s.as_bytes()),
            Entry::Metrics { endpoint, snapshot } => {
                put_str(out, endpoint);
                out.extend_from_slice(snapshot);
            }
            Entry::Events { endpoint, seq, now_ms, verdict, payload } => {
                put_str(out, endpoint);
                out.push(u8::from(seq.is_some()));
                out.extend_from_slice(&seq.unwrap_or(0).to_le_bytes());
                out.extend_from_slice(&now_ms.to_le_bytes());
                out.push(verdict.byte());
                out.extend_from_slice(payload);
            }
            Entry::Resync { endpoint, now_ms } => {
                put_str(out, endpoint);
                out.extend_from_slice(&now_ms.to_le_bytes());
            }
            Entry::FlowQueued {
                ticket,
                fairness_id,
                priority,
                enqueue_ms,
                bytes,
                tokens,
                cost,
                slo_ttft_ms,
                ttl_ms,
            } => {
                for v in [*ticket, *enqueue_ms, *bytes, *tokens, cost.to_bits()] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.extend_from_slice(&priority.to_le_bytes());
                put_opt(out, *slo_ttft_ms);
                put_opt(out, *ttl_ms);
                put_str(out, fairness_id);
            }
            Entry::FlowLeft { ticket } => out.extend_from_slice(&ticket.to_le_bytes()),
            Entry::Replica(b) => out.extend_from_slice(b),
        }
    }

    /// The sequence number a stored entry claims (`None` when the bytes are no entry).
    pub fn stored_seq(bytes: &[u8]) -> Option<u64> {
        let mut b = bytes;
        (take(&mut b, 1)? == [VERSION]).then_some(())?;
        take_u64(&mut b)
    }

    /// Read a stored entry: (sequence, origin, entry). `None` when malformed.
    pub fn decode(bytes: &[u8]) -> Option<(u64, u64, Entry<'_>)> {
        let mut b = bytes;
        if take(&mut b, 1)? != [VERSION] {
            return None;
        }
        let seq = take_u64(&mut b)?;
        let origin = take_u64(&mut b)?;
        let kind = take(&mut b, 1)?[0];
        let entry = match kind {
            1 => Entry::Effect(b),
            2 => Entry::Complete(std::str::from_utf8(b).ok()?),
            3 => {
                let endpoint = take_str(&mut b)?;
                Entry::Metrics { endpoint, snapshot: b }
            }
            4 => {
                let endpoint = take_str(&mut b)?;
                let has = take(&mut b, 1)?[0] != 0;
                let s = take_u64(&mut b)?;
                let now_ms = take_u64(&mut b)?;
                let verdict = VerdictCode::from_byte(take(&mut b, 1)?[0])?;
                Entry::Events { endpoint, seq: has.then_some(s), now_ms, verdict, payload: b }
            }
            5 => {
                let endpoint = take_str(&mut b)?;
                let now_ms = take_u64(&mut b)?;
                if !b.is_empty() {
                    return None;
                }
                Entry::Resync { endpoint, now_ms }
            }
            6 => {
                let ticket = take_u64(&mut b)?;
                let enqueue_ms = take_u64(&mut b)?;
                let bytes = take_u64(&mut b)?;
                let tokens = take_u64(&mut b)?;
                let cost = f64::from_bits(take_u64(&mut b)?);
                let p = take(&mut b, 4)?;
                let priority = i32::from_le_bytes([p[0], p[1], p[2], p[3]]);
                let slo_ttft_ms = take_opt(&mut b)?;
                let ttl_ms = take_opt(&mut b)?;
                let fairness_id = take_str(&mut b)?;
                if !b.is_empty() {
                    return None;
                }
                Entry::FlowQueued {
                    ticket,
                    fairness_id,
                    priority,
                    enqueue_ms,
                    bytes,
                    tokens,
                    cost,
                    slo_ttft_ms,
                    ttl_ms,
                }
            }
            7 => {
                let ticket = take_u64(&mut b)?;
                if !b.is_empty() {
                    return None;
                }
                Entry::FlowLeft { ticket }
            }
            8 => Entry::Replica(b),
            _ => return None,
        };
        Some((seq, origin, entry))
    }
}

/// Counters of one VM's log traffic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncStats {
    /// Entries of other instances applied.
    pub applied: u64,
    /// Entries appended.
    pub appended: u64,
    /// Overruns detected (the ring lapped this reader).
    pub overruns: u64,
    /// Entries lost to overruns or skipped as pending too long.
    pub lost: u64,
    /// Malformed slots skipped.
    pub malformed: u64,
    /// Shared-data calls that failed.
    pub errors: u64,
    /// Compare-and-swap conflicts while claiming.
    pub cas_conflicts: u64,
}

/// What [`SharedLog::export`] read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    /// The sequence number to read from next time (the relay's next cursor).
    pub next: u64,
    /// Entries between the given cursor and the next one that were overwritten before they were
    /// read, or claimed and never written: lost to the export.
    pub lost: u64,
    /// `take` stopped the read: more entries wait.
    pub more: bool,
    /// The cursor was ahead of this log (it came from a log before an Envoy restart): the read
    /// started over at the oldest retained entry.
    pub restarted: bool,
    /// Slots that were not entries (skipped).
    pub malformed: u64,
}

/// Append `n` in decimal (what `format!("{n}")` writes).
fn push_decimal(out: &mut String, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    if let Ok(d) = std::str::from_utf8(&digits[i..]) {
        out.push_str(d);
    }
}

fn read_u64(v: Option<&[u8]>) -> u64 {
    v.and_then(|b| <[u8; 8]>::try_from(b).ok()).map_or(0, u64::from_le_bytes)
}

/// Claim a unique instance id (≥ 1) from the shared counter.
pub fn claim_instance(store: &mut impl SharedStore) -> Result<u64, StoreError> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (v, cas) = store.get(INSTANCES_KEY)?;
        let next = read_u64(v.as_deref()).wrapping_add(1).max(1);
        match store.set(INSTANCES_KEY, &next.to_le_bytes(), cas) {
            Ok(()) => return Ok(next),
            Err(StoreError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(StoreError::CasMismatch)
}

/// One VM's view of the log: its cursor and counters.
#[derive(Debug)]
pub struct SharedLog {
    prefix: String,
    head_key: String,
    lease_key: String,
    ring: u64,
    instance: u64,
    cursor: Option<u64>,
    pending_since: Option<u64>,
    /// `head` and its CAS token as the last poll read them: the next append tries them first
    /// instead of reading `head` again (a stale hint only costs one CAS conflict).
    head_hint: Option<(u64, u32)>,
    /// Reused for slot keys (`{prefix}e/{slot}`): no formatting or allocation per entry.
    key_buf: String,
    /// Reused for the stored form of the entries appended.
    entry_buf: Vec<u8>,
    /// Completions deferred to the next append or flush (their request ids).
    deferred: Vec<String>,
    /// Counters.
    pub stats: SyncStats,
}

impl SharedLog {
    /// The log of namespace `ns` with `ring` slots, read and written by `instance`.
    pub fn new(ns: &str, ring: u32, instance: u64) -> SharedLog {
        let prefix = format!("{ns}/r{ring}/");
        SharedLog {
            head_key: format!("{prefix}head"),
            lease_key: format!("{prefix}poller"),
            prefix,
            ring: u64::from(ring.max(1)),
            instance,
            cursor: None,
            pending_since: None,
            head_hint: None,
            key_buf: String::new(),
            entry_buf: Vec::new(),
            deferred: Vec::new(),
            stats: SyncStats::default(),
        }
    }

    /// This reader's instance id.
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// The next sequence number this reader will apply (`None` before the first poll).
    pub fn cursor(&self) -> Option<u64> {
        self.cursor
    }

    /// The key of `seq`'s slot, `{prefix}e/{seq % ring}`, built in the reused key buffer (hand
    /// it back with `self.key_buf = key` after use).
    fn slot_key(&mut self, seq: u64) -> String {
        let mut key = std::mem::take(&mut self.key_buf);
        key.clear();
        key.push_str(&self.prefix);
        key.push_str("e/");
        push_decimal(&mut key, seq % self.ring);
        key
    }

    fn head(&mut self, store: &mut impl SharedStore) -> Result<(u64, Option<u32>), StoreError> {
        let (v, cas) = store.get(&self.head_key).inspect_err(|_| self.stats.errors += 1)?;
        Ok((read_u64(v.as_deref()), cas))
    }

    /// Append `entry`; returns its sequence number. Completions deferred with
    /// [`SharedLog::defer_complete`] go first, in the same claim.
    pub fn append(&mut self, store: &mut impl SharedStore, entry: &Entry<'_>) -> Result<u64, StoreError> {
        if self.deferred.is_empty() {
            return self.append_all(store, std::slice::from_ref(entry));
        }
        let deferred = std::mem::take(&mut self.deferred);
        let before = deferred.len() as u64;
        let mut entries: Vec<Entry<'_>> = deferred.iter().map(|id| Entry::Complete(id)).collect();
        entries.push(entry.clone());
        let r = self.append_all(store, &entries);
        drop(entries);
        self.reuse_deferred(deferred);
        Ok(r? + before)
    }

    /// Remember that request `id` completed, to be appended with this VM's next append, or by
    /// [`SharedLog::flush`] (the filter flushes on every tick, so the other VMs see it within one
    /// sync tick). Returns how many completions are deferred now.
    pub fn defer_complete(&mut self, id: &str) -> usize {
        self.deferred.push(id.to_owned());
        self.deferred.len()
    }

    /// Completions deferred and not yet appended.
    pub fn deferred(&self) -> usize {
        self.deferred.len()
    }

    /// Append the deferred completions (one claim for all of them). Nothing to do: `Ok(None)`.
    /// They are forgotten when the append fails (as an entry whose append failed is).
    pub fn flush(&mut self, store: &mut impl SharedStore) -> Result<Option<u64>, StoreError> {
        if self.deferred.is_empty() {
            return Ok(None);
        }
        let deferred = std::mem::take(&mut self.deferred);
        let entries: Vec<Entry<'_>> = deferred.iter().map(|id| Entry::Complete(id)).collect();
        let r = self.append_all(store, &entries);
        drop(entries);
        self.reuse_deferred(deferred);
        r.map(Some)
    }

    fn reuse_deferred(&mut self, mut v: Vec<String>) {
        v.clear();
        if self.deferred.is_empty() {
            self.deferred = v;
        }
    }

    /// Append `entries` under consecutive sequence numbers claimed by one compare-and-swap of
    /// `head` (then one slot write each); returns the first one's sequence number.
    pub fn append_all(&mut self, store: &mut impl SharedStore, entries: &[Entry<'_>]) -> Result<u64, StoreError> {
        let k = entries.len() as u64;
        if k == 0 {
            // Nothing to claim: the sequence number the next entry would get.
            return self.head(store).map(|(s, _)| s);
        }
        for _ in 0..MAX_CAS_ATTEMPTS {
            let (seq, cas) = match self.head_hint.take() {
                Some((seq, cas)) => (seq, Some(cas)),
                None => self.head(store)?,
            };
            match store.set(&self.head_key, &(seq + k).to_le_bytes(), cas) {
                Ok(()) => {
                    for (i, entry) in (0..k).zip(entries) {
                        let s = seq + i;
                        let mut bytes = std::mem::take(&mut self.entry_buf);
                        entry.encode_into(s, self.instance, &mut bytes);
                        let key = self.slot_key(s);
                        let written = store.set(&key, &bytes, None);
                        self.key_buf = key;
                        // Kept for the next entry unless a large one (an event batch) grew it.
                        if bytes.capacity() <= MAX_KEPT_ENTRY_BUF {
                            self.entry_buf = bytes;
                        }
                        // The slots not written stay pending: the readers skip them after
                        // PENDING_SKIP_MS and count them as lost.
                        written.inspect_err(|_| self.stats.errors += 1)?;
                        self.stats.appended += 1;
                    }
                    // Caught up to our own entries: no need to read them back.
                    if self.cursor == Some(seq) {
                        self.cursor = Some(seq + k);
                    }
                    return Ok(seq);
                }
                Err(StoreError::CasMismatch) => self.stats.cas_conflicts += 1,
                Err(e) => {
                    self.stats.errors += 1;
                    return Err(e);
                }
            }
        }
        Err(StoreError::CasMismatch)
    }

    /// Apply every entry of other instances this reader has not seen yet, in order, with
    /// `apply(origin, entry)`. The first call starts at the oldest entry the ring retains.
    /// Returns the number of entries applied.
    pub fn poll(
        &mut self,
        store: &mut impl SharedStore,
        now_ms: u64,
        mut apply: impl FnMut(u64, Entry<'_>),
    ) -> Result<u64, StoreError> {
        let (head, head_cas) = self.head(store)?;
        self.head_hint = head_cas.map(|cas| (head, cas));
        let mut cursor = match self.cursor {
            Some(c) if c <= head => c,
            // First poll, or the shared data was reset under us: start from what is retained.
            _ => head.saturating_sub(self.ring),
        };
        let mut applied = 0;
        while cursor < head {
            let key = self.slot_key(cursor);
            let read = store.get(&key);
            self.key_buf = key;
            let value = match read {
                Ok((v, _)) => v,
                Err(e) => {
                    self.stats.errors += 1;
                    self.cursor = Some(cursor);
                    return Err(e);
                }
            };
            match value.as_deref().and_then(Entry::stored_seq) {
                Some(s) if s == cursor => {
                    self.pending_since = None;
                    match value.as_deref().and_then(Entry::decode) {
                        Some((_, origin, entry)) => {
                            if origin != self.instance {
                                apply(origin, entry);
                                self.stats.applied += 1;
                                applied += 1;
                            }
                        }
                        None => self.stats.malformed += 1,
                    }
                    cursor += 1;
                }
                Some(s) if s > cursor => {
                    // Lapped: everything before `head - ring` (or `s + 1 - ring`) is gone.
                    let resume = (s + 1).max(head).saturating_sub(self.ring).max(cursor + 1);
                    self.stats.overruns += 1;
                    self.stats.lost += resume - cursor;
                    self.pending_since = None;
                    cursor = resume;
                }
                // Not written yet (absent, or an older lap): another worker is between its claim
                // and its write. Wait, but not forever.
                _ => {
                    let since = *self.pending_since.get_or_insert(now_ms);
                    if now_ms.saturating_sub(since) < PENDING_SKIP_MS {
                        break;
                    }
                    self.pending_since = None;
                    self.stats.lost += 1;
                    cursor += 1;
                }
            }
        }
        self.cursor = Some(cursor);
        Ok(applied)
    }

    /// Read the entries from sequence `from` on (`None`: the oldest entry the ring retains), of
    /// every writer (this VM's own included), handing each to `take(origin, entry)` until it
    /// answers `false` (its bound is reached: that entry is not taken). For the relay's export:
    /// this VM's own reading position is untouched. A slot claimed but not yet written stops the
    /// read (it is read next time), unless this VM's own reader already passed it (skipped it as
    /// lost). Entries the ring overwrote before they were read are counted in [`Export::lost`].
    pub fn export(
        &mut self,
        store: &mut impl SharedStore,
        from: Option<u64>,
        mut take: impl FnMut(u64, Entry<'_>) -> bool,
    ) -> Result<Export, StoreError> {
        let (head, _) = self.head(store)?;
        let oldest = head.saturating_sub(self.ring);
        let (mut c, restarted) = match from {
            Some(c) if c <= head => (c, false),
            // Ahead of this log: the cursor belongs to another one (Envoy restarted).
            Some(_) => (oldest, true),
            None => (oldest, false),
        };
        let mut out = Export { next: c, lost: 0, more: false, restarted, malformed: 0 };
        if c < oldest {
            out.lost += oldest - c;
            c = oldest;
        }
        while c < head {
            let key = self.slot_key(c);
            let read = store.get(&key);
            self.key_buf = key;
            let value = read.inspect_err(|_| self.stats.errors += 1)?.0;
            match value.as_deref().and_then(Entry::stored_seq) {
                Some(s) if s == c => {
                    match value.as_deref().and_then(Entry::decode) {
                        Some((_, origin, entry)) => {
                            if !take(origin, entry) {
                                out.more = true;
                                break;
                            }
                        }
                        None => out.malformed += 1,
                    }
                    c += 1;
                }
                Some(s) if s > c => {
                    let resume = (s + 1).max(head).saturating_sub(self.ring).max(c + 1);
                    out.lost += resume - c;
                    c = resume;
                }
                _ if self.cursor.is_some_and(|mine| mine > c) => {
                    out.lost += 1;
                    c += 1;
                }
                _ => break,
            }
        }
        out.next = c;
        Ok(out)
    }

    /// The identity of this log (`{prefix}id`: the time it was first configured, ms), created when
    /// absent. Read on every call (two VMs that create it at once race; every VM then answers
    /// with the value that stayed). `0` when the host refuses.
    pub fn log_id(&mut self, store: &mut impl SharedStore, now_ms: u64) -> u64 {
        let key = format!("{}id", self.prefix);
        match store.get(&key) {
            Ok((Some(v), _)) if v.len() == 8 => read_u64(Some(&v)),
            Ok((_, cas)) => {
                let id = now_ms.max(1);
                match store.set(&key, &id.to_le_bytes(), cas) {
                    Ok(()) => id,
                    Err(_) => match store.get(&key) {
                        Ok((Some(v), _)) if v.len() == 8 => read_u64(Some(&v)),
                        _ => 0,
                    },
                }
            }
            Err(_) => {
                self.stats.errors += 1;
                0
            }
        }
    }

    /// Take or renew the metric-polling lease for `lease_ms`; true when this instance holds it.
    pub fn try_lease(&mut self, store: &mut impl SharedStore, now_ms: u64, lease_ms: u64) -> Result<bool, StoreError> {
        let (v, cas) = store.get(&self.lease_key).inspect_err(|_| self.stats.errors += 1)?;
        let (holder, expires) = match v.as_deref() {
            Some(b) if b.len() == 16 => (read_u64(Some(&b[..8])), read_u64(Some(&b[8..]))),
            _ => (0, 0),
        };
        // A clock that went back by more than a lease (a test clock) must not freeze the holder.
        let expired = now_ms >= expires || expires - now_ms > lease_ms;
        if holder != self.instance && !expired {
            return Ok(false);
        }
        let mut value = [0u8; 16];
        value[..8].copy_from_slice(&self.instance.to_le_bytes());
        value[8..].copy_from_slice(&now_ms.saturating_add(lease_ms).to_le_bytes());
        match store.set(&self.lease_key, &value, cas) {
            Ok(()) => Ok(true),
            Err(StoreError::CasMismatch) => Ok(false),
            Err(e) => {
                self.stats.errors += 1;
                Err(e)
            }
        }
    }
}

/// The id under which the relay exports a request of instance `origin` to the other replicas:
/// qualified by the writing VM (ids are unique only within one VM).
pub fn export_request_id(origin: u64, id: &str) -> String {
    format!("{origin:x}.{id}")
}

/// The id under which a mirror tracks another instance's request: qualified by the origin, so
/// equal ids from different VMs (client-supplied or generated) never collide. Starts with a
/// control character no HTTP header value can carry.
pub fn mirror_request_id(origin: u64, id: &str) -> String {
    format!("\u{1}{origin:x}\u{1}{id}")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::collections::HashMap;

    /// Shared data as Envoy implements it: a CAS token per key, bumped on every write.
    #[derive(Default)]
    struct Mem {
        map: HashMap<String, (Vec<u8>, u32)>,
        next: u32,
    }

    impl SharedStore for Mem {
        fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
            Ok(self.map.get(key).map_or((None, None), |(v, c)| (Some(v.clone()), Some(*c))))
        }
        fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            if let (Some(c), Some((_, cur))) = (cas, self.map.get(key)) {
                if c != *cur {
                    return Err(StoreError::CasMismatch);
                }
            }
            self.next += 1;
            self.map.insert(key.to_owned(), (value.to_vec(), self.next));
            Ok(())
        }
    }

    fn collect(log: &mut SharedLog, mem: &mut Mem, now: u64) -> Vec<(u64, String)> {
        let mut out = Vec::new();
        log.poll(mem, now, |o, e| out.push((o, format!("{e:?}")))).unwrap();
        out
    }

    #[test]
    fn slot_keys_are_the_formatted_ones() {
        let mut log = SharedLog::new("kvroute", 8192, 1);
        for seq in [0, 1, 9, 10, 8191, 8192, 8193, 123_456_789, u64::MAX] {
            assert_eq!(log.slot_key(seq), format!("kvroute/r8192/e/{}", seq % 8192));
        }
        let mut big = SharedLog::new("ns", u32::MAX, 1);
        assert_eq!(big.slot_key(u64::MAX), format!("ns/r{}/e/{}", u32::MAX, u64::MAX % u64::from(u32::MAX)));
        let mut s = String::new();
        push_decimal(&mut s, u64::MAX);
        assert_eq!(s, u64::MAX.to_string());
    }

    #[test]
    fn entries_round_trip() {
        let entries = [
            Entry::Effect(&[1, 2, 3]),
            Entry::Complete("req-1"),
            Entry::Metrics { endpoint: "10.0.0.1:8000", snapshot: b"{}" },
            Entry::Events {
                endpoint: "10.0.0.1:8000",
                seq: Some(7),
                now_ms: 9,
                verdict: VerdictCode::Gap,
                payload: &[0x93],
            },
            Entry::Events { endpoint: "e", seq: None, now_ms: 0, verdict: VerdictCode::Reset, payload: &[] },
            Entry::Resync { endpoint: "10.0.0.1:8000", now_ms: 5 },
            Entry::FlowQueued {
                ticket: 1 << 32 | 7,
                fairness_id: "tenant-a",
                priority: -3,
                enqueue_ms: 123,
                bytes: 4096,
                tokens: 1040,
                cost: 2064.5,
                slo_ttft_ms: Some(250),
                ttl_ms: None,
            },
            Entry::FlowLeft { ticket: 1 << 32 | 7 },
            Entry::Replica(b"KVRB..."),
        ];
        for e in entries {
            let b = e.encode(42, 3);
            assert_eq!(Entry::stored_seq(&b), Some(42));
            assert_eq!(Entry::decode(&b), Some((42, 3, e.clone())));
            for cut in 0..HEADER {
                assert!(Entry::decode(&b[..cut]).is_none());
            }
        }
        assert!(Entry::decode(&[9; 30]).is_none());
    }

    /// Counts the reads of each key.
    #[derive(Default)]
    struct Counting(Mem, HashMap<String, u32>);

    impl SharedStore for Counting {
        fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
            *self.1.entry(key.to_owned()).or_default() += 1;
            self.0.get(key)
        }
        fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            self.0.set(key, value, cas)
        }
    }

    #[test]
    fn an_append_after_a_poll_reuses_the_head_it_read_and_a_stale_one_only_costs_a_retry() {
        let mut mem = Counting::default();
        let mut a = SharedLog::new("ns", 16, 1);
        let mut b = SharedLog::new("ns", 16, 2);
        a.append(&mut mem, &Entry::Complete("first")).unwrap();
        let reads = |m: &Counting| m.1.get("ns/r16/head").copied().unwrap_or(0);
        a.poll(&mut mem, 0, |_, _| {}).unwrap();
        let before = reads(&mem);
        assert_eq!(a.append(&mut mem, &Entry::Complete("hinted")).unwrap(), 1);
        assert_eq!(reads(&mem), before, "no second read of head");
        // Stale: b appends between a's poll and a's append.
        a.poll(&mut mem, 0, |_, _| {}).unwrap();
        assert_eq!(b.append(&mut mem, &Entry::Complete("b")).unwrap(), 2);
        assert_eq!(a.append(&mut mem, &Entry::Complete("a")).unwrap(), 3);
        assert_eq!(a.stats.cas_conflicts, 1);
        let mut c = SharedLog::new("ns", 16, 3);
        let mut seen = Vec::new();
        c.poll(&mut mem, 0, |_, e| seen.push(format!("{e:?}"))).unwrap();
        assert_eq!(seen, ["Complete(\"first\")", "Complete(\"hinted\")", "Complete(\"b\")", "Complete(\"a\")"]);
    }

    /// Counts every call.
    #[derive(Default)]
    struct Calls(Mem, u32);

    impl SharedStore for Calls {
        fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
            self.1 += 1;
            self.0.get(key)
        }
        fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            self.1 += 1;
            self.0.set(key, value, cas)
        }
    }

    #[test]
    fn deferred_completions_go_out_with_the_next_append_in_one_claim() {
        let mut mem = Calls::default();
        let mut a = SharedLog::new("ns", 16, 1);
        let mut b = SharedLog::new("ns", 16, 2);
        assert_eq!(a.flush(&mut mem).unwrap(), None);
        assert_eq!(mem.1, 0, "nothing deferred: no call");
        a.poll(&mut mem, 0, |_, _| {}).unwrap();
        assert_eq!(a.append(&mut mem, &Entry::Effect(&[1])).unwrap(), 0);
        assert_eq!(a.defer_complete("r0"), 1);
        assert_eq!(a.defer_complete("r1"), 2);
        let mut seen = Vec::new();
        b.poll(&mut mem, 0, |_, e| seen.push(format!("{e:?}"))).unwrap();
        assert_eq!(seen, ["Effect([1])"], "deferred: not visible yet");
        a.poll(&mut mem, 0, |_, _| {}).unwrap();
        let calls = mem.1;
        assert_eq!(a.append(&mut mem, &Entry::Effect(&[2])).unwrap(), 3, "the effect after the completions");
        assert_eq!(mem.1 - calls, 1 + 3, "one CAS of head, one write per entry");
        assert_eq!(a.deferred(), 0);
        a.defer_complete("r2");
        assert_eq!(a.flush(&mut mem).unwrap(), Some(4));
        assert_eq!(a.flush(&mut mem).unwrap(), None);
        seen.clear();
        b.poll(&mut mem, 0, |o, e| {
            assert_eq!(o, 1);
            seen.push(format!("{e:?}"));
        })
        .unwrap();
        assert_eq!(seen, ["Complete(\"r0\")", "Complete(\"r1\")", "Effect([2])", "Complete(\"r2\")"]);
        assert_eq!((a.stats.appended, a.cursor()), (5, Some(5)));
        // A claim that loses the race retries with every entry.
        let mut c = SharedLog::new("ns", 16, 3);
        c.poll(&mut mem, 0, |_, _| {}).unwrap();
        b.append(&mut mem, &Entry::Complete("b")).unwrap();
        c.defer_complete("c0");
        assert_eq!(c.append(&mut mem, &Entry::Complete("c1")).unwrap(), 7);
        assert_eq!(c.stats.cas_conflicts, 1);
        seen.clear();
        a.poll(&mut mem, 0, |_, e| seen.push(format!("{e:?}"))).unwrap();
        assert_eq!(seen, ["Complete(\"b\")", "Complete(\"c0\")", "Complete(\"c1\")"]);
    }

    #[test]
    fn readers_apply_other_instances_entries_once_in_order() {
        let mut mem = Mem::default();
        let mut a = SharedLog::new("ns", 16, claim_instance(&mut mem).unwrap());
        let mut b = SharedLog::new("ns", 16, claim_instance(&mut mem).unwrap());
        assert_ne!(a.instance(), b.instance());
        assert!(collect(&mut a, &mut mem, 0).is_empty());
        assert!(collect(&mut b, &mut mem, 0).is_empty());
        a.append(&mut mem, &Entry::Complete("x")).unwrap();
        b.append(&mut mem, &Entry::Complete("y")).unwrap();
        a.append(&mut mem, &Entry::Complete("z")).unwrap();
        let seen_by_b = collect(&mut b, &mut mem, 0);
        assert_eq!(
            seen_by_b.iter().map(|(_, e)| e.as_str()).collect::<Vec<_>>(),
            ["Complete(\"x\")", "Complete(\"z\")"]
        );
        assert!(seen_by_b.iter().all(|(o, _)| *o == a.instance()));
        assert_eq!(collect(&mut a, &mut mem, 0).len(), 1, "a sees y only");
        assert!(collect(&mut a, &mut mem, 0).is_empty() && collect(&mut b, &mut mem, 0).is_empty());
        assert_eq!((a.stats.appended, a.stats.applied, b.stats.applied), (2, 1, 2));
    }

    #[test]
    fn a_new_reader_starts_at_the_oldest_retained_entry() {
        let mut mem = Mem::default();
        let mut a = SharedLog::new("ns", 16, 1);
        for i in 0..20 {
            a.append(&mut mem, &Entry::Complete(&i.to_string())).unwrap();
        }
        let mut late = SharedLog::new("ns", 16, 2);
        let got = collect(&mut late, &mut mem, 0);
        assert_eq!(got.len(), 16);
        assert_eq!(got[0].1, "Complete(\"4\")");
        assert_eq!(late.stats.lost, 0);
    }

    #[test]
    fn overruns_are_detected_and_skipped() {
        let mut mem = Mem::default();
        let mut a = SharedLog::new("ns", 16, 1);
        let mut b = SharedLog::new("ns", 16, 2);
        assert!(collect(&mut b, &mut mem, 0).is_empty());
        for i in 0..40 {
            a.append(&mut mem, &Entry::Complete(&i.to_string())).unwrap();
        }
        let got = collect(&mut b, &mut mem, 0);
        assert_eq!(b.stats.overruns, 1);
        assert_eq!(b.stats.lost, 24);
        assert_eq!(got.first().unwrap().1, "Complete(\"24\")");
        assert_eq!(got.len(), 16);
        assert_eq!(b.cursor(), Some(40));
    }

    #[test]
    fn pending_slots_wait_then_are_skipped() {
        let mut mem = Mem::default();
        let mut a = SharedLog::new("ns", 16, 1);
        let mut b = SharedLog::new("ns", 16, 2);
        assert!(collect(&mut b, &mut mem, 0).is_empty());
        // A writer claimed seq 0 but has not written it yet; seq 1 is written.
        mem.set("ns/r16/head", &1u64.to_le_bytes(), None).unwrap();
        a.append(&mut mem, &Entry::Complete("one")).unwrap();
        assert!(collect(&mut b, &mut mem, 100).is_empty(), "waits for seq 0");
        assert!(collect(&mut b, &mut mem, 100 + PENDING_SKIP_MS - 1).is_empty());
        let got = collect(&mut b, &mut mem, 100 + PENDING_SKIP_MS);
        assert_eq!(got.len(), 1);
        assert_eq!(b.stats.lost, 1);
        // A pending slot that gets written in time is applied.
        mem.set("ns/r16/head", &3u64.to_le_bytes(), None).unwrap();
        assert!(collect(&mut b, &mut mem, 5000).is_empty());
        mem.set("ns/r16/e/2", &Entry::Complete("two").encode(2, 1), None).unwrap();
        assert_eq!(collect(&mut b, &mut mem, 5001).len(), 1, "seq 2 now written");
    }

    #[test]
    fn exports_read_every_writer_from_a_cursor_and_count_what_was_overwritten() {
        let mut mem = Mem::default();
        let mut a = SharedLog::new("ns", 16, 1);
        let mut b = SharedLog::new("ns", 16, 2);
        a.append(&mut mem, &Entry::Complete("a0")).unwrap();
        b.append(&mut mem, &Entry::Complete("b1")).unwrap();
        a.append(&mut mem, &Entry::Replica(b"x")).unwrap();
        let mut seen = Vec::new();
        let e = a
            .export(&mut mem, None, |o, e| {
                seen.push((o, format!("{e:?}")));
                true
            })
            .unwrap();
        assert_eq!(seen.len(), 3, "own entries too: {seen:?}");
        assert_eq!((e.next, e.lost, e.more, e.restarted), (3, 0, false, false));
        assert_eq!(a.cursor(), None, "the VM's own reading position is untouched");
        // A bound: the refused entry is read again next time.
        let mut n = 0;
        let e = a.export(&mut mem, Some(0), |_, _| {
            n += 1;
            n <= 1
        });
        assert_eq!(e.unwrap().next, 1);
        // From the head: nothing; ahead of the log: started over.
        assert_eq!(a.export(&mut mem, Some(3), |_, _| true).unwrap().next, 3);
        let e = a.export(&mut mem, Some(99), |_, _| true).unwrap();
        assert!(e.restarted && e.next == 3);
        // Overwritten before the relay read them.
        for i in 0..40 {
            a.append(&mut mem, &Entry::Complete(&i.to_string())).unwrap();
        }
        let mut first = None;
        let e = b
            .export(&mut mem, Some(3), |_, e| {
                first.get_or_insert(format!("{e:?}"));
                true
            })
            .unwrap();
        assert_eq!((e.next, e.lost), (43, 43 - 16 - 3));
        assert_eq!(first.unwrap(), "Complete(\"24\")");
        // A pending slot stops the export until this VM's reader skipped it.
        mem.set("ns/r16/head", &44u64.to_le_bytes(), None).unwrap();
        a.append(&mut mem, &Entry::Complete("after")).unwrap();
        assert_eq!(b.export(&mut mem, Some(43), |_, _| true).unwrap().next, 43);
        collect(&mut b, &mut mem, 0);
        collect(&mut b, &mut mem, PENDING_SKIP_MS);
        let e = b.export(&mut mem, Some(43), |_, _| true).unwrap();
        assert_eq!((e.next, e.lost), (45, 1));
    }

    #[test]
    fn the_log_id_is_created_once() {
        let mut mem = Mem::default();
        let mut a = SharedLog::new("ns", 16, 1);
        let mut b = SharedLog::new("ns", 16, 2);
        assert_eq!(a.log_id(&mut mem, 1234), 1234);
        assert_eq!(b.log_id(&mut mem, 9999), 1234);
        assert_eq!(SharedLog::new("other", 16, 1).log_id(&mut mem, 7), 7);
    }

    #[test]
    fn the_lease_has_one_holder_until_it_expires() {
        let mut mem = Mem::default();
        let mut a = SharedLog::new("ns", 16, 1);
        let mut b = SharedLog::new("ns", 16, 2);
        assert!(a.try_lease(&mut mem, 0, 100).unwrap());
        assert!(!b.try_lease(&mut mem, 50, 100).unwrap());
        assert!(a.try_lease(&mut mem, 60, 100).unwrap(), "renewed");
        assert!(!b.try_lease(&mut mem, 150, 100).unwrap());
        assert!(b.try_lease(&mut mem, 160, 100).unwrap(), "expired: taken over");
        assert!(!a.try_lease(&mut mem, 170, 100).unwrap());
    }

    #[test]
    fn mirror_ids_are_qualified() {
        assert_ne!(mirror_request_id(1, "abc"), mirror_request_id(2, "abc"));
        assert!(mirror_request_id(1, "abc").ends_with("abc"));
    }
}
