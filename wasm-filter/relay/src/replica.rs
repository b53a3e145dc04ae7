//! Router replicas across Envoys: the relay carries replica batches between its Envoy's filter
//! and the fleet's NATS subjects, with the core's NATS transport ([`kvroute::Replicator`] over a
//! [`ReplicaPort`]).
//!
//! - **Out**: a poller thread reads the filter's export route (`GET <path>/out?cursor=N`, signed)
//!   and queues the entries (the routing effects and completions of every worker VM of that
//!   Envoy, request ids qualified by VM). The transport takes them as this relay's batches:
//!   its replica id, its epoch (its start time, and a new one whenever the filter's log changes
//!   identity, i.e. Envoy restarted, so the other replicas drop what the old Envoy had in
//!   flight) and a sequence number that grows by one per batch.
//! - **In**: the other replicas' batches (the relay's own are skipped) go through a bounded queue
//!   to a poster thread that POSTs each to the filter's ingestion route (`POST <path>/in`,
//!   signed); a full queue or a refused post is counted and logged, never retried forever.
//! - **Heartbeats** are published only while the filter answers: a relay whose Envoy is gone
//!   falls silent, and after `peer_silence_ms` the others drop that Envoy's requests.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvroute::{NatsReplicaOptions, ReplicaBatch, ReplicaEntry, ReplicaEntryRef, ReplicaPort, ReplicaStats, Replicator};
use kvroute_filter::ingest::{self, HEADER_SIGNATURE, HEADER_TIMESTAMP};
use serde::{Deserialize, Serialize};

use crate::http::Target;
use crate::{bump, log};

/// Default path prefix of the filter's replica routes (its `filter.replica.path`).
pub const DEFAULT_REPLICA_PATH: &str = kvroute_filter::config::DEFAULT_REPLICA_PATH;
/// Default environment variable with the replica routes' shared secret.
pub const DEFAULT_REPLICA_SECRET_ENV: &str = "KVROUTE_REPLICA_SECRET";
/// Environment variable with the NATS token, when the configuration has none.
pub const NATS_TOKEN_ENV: &str = "KVROUTE_NATS_TOKEN";

/// The relay's replica section.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaRelayConfig {
    /// This relay's Envoy listener (`http://host:port`): the sidecar's own Envoy.
    pub target: String,
    /// The filter's `filter.replica.path`.
    #[serde(default = "default_path")]
    pub path: String,
    /// Environment variable with the shared secret (default `KVROUTE_REPLICA_SECRET`).
    #[serde(default)]
    pub secret_env: Option<String>,
    /// File with the shared secret (trailing newline ignored); wins over `secret_env`.
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// How often the export route is read when it had nothing more (ms).
    #[serde(default = "default_poll")]
    pub poll_interval_ms: u64,
    /// Entries read from the filter and not yet published, at most (the oldest are dropped
    /// beyond, counted).
    #[serde(default = "default_pending")]
    pub max_pending_entries: usize,
    /// Other replicas' batches waiting to be posted to the filter, at most (new ones are dropped
    /// beyond, counted: the filter then counts a gap).
    #[serde(default = "default_queue")]
    pub queue_batches: usize,
    /// No heartbeat is published once the filter has not answered for this long (ms).
    #[serde(default = "default_filter_silence")]
    pub filter_silence_ms: u64,
    /// Attempts per post on transport errors and 5xx answers.
    #[serde(default = "default_attempts")]
    pub attempts: u32,
    /// The NATS side (the core's options: `url`, `fleet`, `replica_id`, `token`, `user` /
    /// `password`, `nkey_seed`, `tls_required`, `tls_ca_file`, `tls_cert_file` / `tls_key_file`,
    /// `stream`, `flush_interval_ms`, …). `epoch` is the relay's own business and ignored.
    pub nats: NatsReplicaOptions,
}

fn default_path() -> String {
    DEFAULT_REPLICA_PATH.to_owned()
}
fn default_poll() -> u64 {
    10
}
fn default_pending() -> usize {
    65_536
}
fn default_queue() -> usize {
    1024
}
fn default_filter_silence() -> u64 {
    5_000
}
fn default_attempts() -> u32 {
    3
}

impl ReplicaRelayConfig {
    /// Check the values.
    pub fn validate(&self, timeout: Duration) -> Result<(), String> {
        Target::parse(&self.target, timeout).map_err(|e| format!("replica.target: {e}"))?;
        if !self.path.starts_with('/')
            || self.path.bytes().any(|b| !b.is_ascii_graphic())
            || self.path.contains(['?', '#'])
        {
            return Err(format!("replica.path {:?} must be an absolute path", self.path));
        }
        if self.poll_interval_ms == 0
            || self.max_pending_entries == 0
            || self.queue_batches == 0
            || self.filter_silence_ms == 0
            || self.attempts == 0
        {
            return Err("replica: poll_interval_ms, max_pending_entries, queue_batches, filter_silence_ms and attempts must be positive".into());
        }
        self.nats.validate().map_err(|e| format!("replica.nats: {e}"))
    }

    /// Read the shared secret from `secret_file` or the environment.
    pub fn secret(&self) -> Result<String, String> {
        crate::config::read_secret(self.secret_file.as_ref(), self.secret_env.as_deref(), DEFAULT_REPLICA_SECRET_ENV)
    }

    fn route(&self, which: &str) -> String {
        format!("{}/{which}", self.path.trim_end_matches('/'))
    }
}

/// Counters of the replica side.
#[derive(Debug, Default)]
struct Counters {
    polls: AtomicU64,
    poll_failures: AtomicU64,
    exported: AtomicU64,
    lost: AtomicU64,
    envoy_restarts: AtomicU64,
    pending_dropped: AtomicU64,
    identity_mismatches: AtomicU64,
    batches_out: AtomicU64,
    heartbeats: AtomicU64,
    received: AtomicU64,
    own: AtomicU64,
    malformed: AtomicU64,
    queue_dropped: AtomicU64,
    posted: AtomicU64,
    post_ignored: AtomicU64,
    post_rejected: AtomicU64,
    post_failures: AtomicU64,
}

/// Counters of the replica side of a running relay.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReplicaRelayStats {
    /// This relay's current epoch.
    pub epoch: u64,
    /// Export reads answered 200.
    pub polls: u64,
    /// Export reads that failed (transport, status, an answer that does not decode).
    pub poll_failures: u64,
    /// Entries read from the filter.
    pub exported: u64,
    /// Entries the filter's ring overwrote before the relay read them (lost to the fleet).
    pub lost: u64,
    /// Times the filter's log changed identity (Envoy restarted): a new epoch began.
    pub envoy_restarts: u64,
    /// Entries dropped from a full pending queue (NATS down for long), or of a previous epoch.
    pub pending_dropped: u64,
    /// Export answers naming another fleet or replica id than the relay's (not published).
    pub identity_mismatches: u64,
    /// Batches handed to the transport (heartbeats included).
    pub batches_out: u64,
    /// Heartbeats among them.
    pub heartbeats: u64,
    /// Batches received from NATS.
    pub received: u64,
    /// The relay's own batches coming back (skipped).
    pub own: u64,
    /// Received batches that do not decode (skipped).
    pub malformed: u64,
    /// Received batches dropped on a full post queue.
    pub queue_dropped: u64,
    /// Batches the filter applied.
    pub posted: u64,
    /// Batches the filter ignored (duplicate, stale, another fleet's).
    pub post_ignored: u64,
    /// Batches the filter refused (4xx).
    pub post_rejected: u64,
    /// Posts that failed for good (transport errors or 5xx after the attempts).
    pub post_failures: u64,
    /// The NATS transport's counters.
    pub nats: kvroute::ReplicatorStats,
}

/// What the transport publishes: this relay's identity, incarnation and the entries waiting.
struct Outbound {
    epoch: u64,
    seq: u64,
    /// Kind (effect / completion) and encoded bytes.
    pending: VecDeque<(bool, Vec<u8>)>,
    /// The filter's log id last seen.
    log_id: Option<u64>,
    /// When the filter last answered (ms; 0: never).
    last_answer_ms: u64,
}

struct Port {
    fleet: String,
    replica_id: String,
    max_batch_entries: usize,
    max_batch_bytes: usize,
    max_pending: usize,
    filter_silence_ms: u64,
    out: Mutex<Outbound>,
    inbound: SyncSender<Vec<u8>>,
    counters: Arc<Counters>,
}

impl Port {
    /// The filter answered an export read: queue its entries (a new epoch when its log changed).
    /// `false`: the log changed under the cursor, read again from the start.
    fn exported(&self, log_id: u64, batch: ReplicaBatch, now: u64) -> bool {
        let Ok(mut o) = self.out.lock() else { return true };
        o.last_answer_ms = now;
        if o.log_id.is_some_and(|old| old != log_id) {
            // Envoy restarted: what it had in flight is gone with it. A new incarnation makes the
            // other replicas drop this replica's requests of the old one.
            o.log_id = Some(log_id);
            o.epoch = now.max(o.epoch + 1);
            o.seq = 0;
            let dropped = o.pending.len() as u64;
            o.pending.clear();
            self.counters.pending_dropped.fetch_add(dropped, Ordering::Relaxed);
            bump(&self.counters.envoy_restarts);
            log(format_args!("the filter's log changed (Envoy restarted): new epoch {}", o.epoch));
            return false;
        }
        o.log_id = Some(log_id);
        self.counters.exported.fetch_add(batch.entries.len() as u64, Ordering::Relaxed);
        for e in batch.entries {
            if o.pending.len() >= self.max_pending {
                o.pending.pop_front();
                bump(&self.counters.pending_dropped);
            }
            o.pending.push_back(match e {
                ReplicaEntry::Effect(fx) => (true, fx.encode()),
                ReplicaEntry::Complete(id) => (false, id.into_bytes()),
            });
        }
        true
    }
}

impl ReplicaPort for Port {
    fn take_batch(&self, now_ms: u64, heartbeat: bool) -> Option<Vec<u8>> {
        let mut o = self.out.lock().ok()?;
        if o.pending.is_empty() {
            // A heartbeat says this Envoy is alive: only while its filter answers.
            let alive = o.last_answer_ms > 0 && now_ms.saturating_sub(o.last_answer_ms) <= self.filter_silence_ms;
            if !heartbeat || !alive {
                return None;
            }
        }
        let mut n = 0;
        let mut bytes = 0;
        for (_, b) in &o.pending {
            if n == self.max_batch_entries || (n > 0 && bytes + b.len() + 5 > self.max_batch_bytes) {
                break;
            }
            n += 1;
            bytes += b.len() + 5;
        }
        let taken: Vec<(bool, Vec<u8>)> = o.pending.drain(..n).collect();
        let refs: Vec<ReplicaEntryRef<'_>> = taken
            .iter()
            .map(|(effect, b)| {
                if *effect {
                    ReplicaEntryRef::EncodedEffect(b)
                } else {
                    ReplicaEntryRef::Complete(std::str::from_utf8(b).unwrap_or_default())
                }
            })
            .collect();
        o.seq += 1;
        let batch = ReplicaBatch::encode_entries(&self.fleet, &self.replica_id, o.epoch, o.seq, now_ms, &refs);
        match batch {
            Ok(b) => {
                bump(&self.counters.batches_out);
                if n == 0 {
                    bump(&self.counters.heartbeats);
                }
                Some(b)
            }
            Err(e) => {
                o.seq -= 1;
                log(format_args!("encoding a replica batch: {e}"));
                None
            }
        }
    }

    fn apply(&self, batch: &[u8], _now_ms: u64) {
        bump(&self.counters.received);
        match ReplicaBatch::decode(batch) {
            Err(e) => {
                bump(&self.counters.malformed);
                log(format_args!("a replica batch from NATS does not decode (skipped): {e}"));
            }
            Ok(b) if b.replica == self.replica_id => bump(&self.counters.own),
            Ok(_) => match self.inbound.try_send(batch.to_vec()) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => {
                    let n = self.counters.queue_dropped.fetch_add(1, Ordering::Relaxed);
                    if n.is_power_of_two() || n == 0 {
                        log(format_args!("the post queue to the filter is full: {} batches dropped", n + 1));
                    }
                }
                Err(TrySendError::Disconnected(_)) => bump(&self.counters.queue_dropped),
            },
        }
    }

    fn replica_stats(&self) -> Option<ReplicaStats> {
        let o = self.out.lock().ok()?;
        Some(ReplicaStats {
            replica_id: self.replica_id.clone(),
            epoch: o.epoch,
            batches_out: self.counters.batches_out.load(Ordering::Relaxed),
            outbox_len: o.pending.len() as u64,
            outbox_dropped: self.counters.pending_dropped.load(Ordering::Relaxed),
            ..ReplicaStats::default()
        })
    }
}

/// The replica side of a running relay: the transport, the poller and the poster.
pub(crate) struct ReplicaSide {
    replicator: Option<Replicator>,
    port: Arc<Port>,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

fn signed(secret: &str, op: &str, cursor: Option<u64>, body: &[u8]) -> (String, String) {
    let ts = kvroute::unix_time_ms();
    (ts.to_string(), ingest::replica_signature(secret.as_bytes(), op, cursor, ts, body))
}

fn sleep_unless_stopped(stop: &AtomicBool, d: Duration) {
    let step = Duration::from_millis(20);
    let mut left = d;
    while !stop.load(Ordering::Acquire) && !left.is_zero() {
        let s = left.min(step);
        std::thread::sleep(s);
        left -= s;
    }
}

impl ReplicaSide {
    pub(crate) fn start(cfg: &ReplicaRelayConfig, secret: &str, timeout: Duration) -> Result<ReplicaSide, String> {
        cfg.validate(timeout)?;
        let counters = Arc::new(Counters::default());
        let (tx, rx) = std::sync::mpsc::sync_channel(cfg.queue_batches);
        let port = Arc::new(Port {
            fleet: cfg.nats.fleet.clone(),
            replica_id: cfg.nats.replica_id.clone(),
            max_batch_entries: cfg.nats.max_batch_entries,
            max_batch_bytes: cfg.nats.max_batch_bytes,
            max_pending: cfg.max_pending_entries,
            filter_silence_ms: cfg.filter_silence_ms,
            out: Mutex::new(Outbound {
                epoch: kvroute::unix_time_ms().max(1),
                seq: 0,
                pending: VecDeque::new(),
                log_id: None,
                last_answer_ms: 0,
            }),
            inbound: tx,
            counters: counters.clone(),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let mut side =
            ReplicaSide { replicator: None, port: port.clone(), counters, stop: stop.clone(), threads: Vec::new() };
        let poller = Poller {
            target: Target::parse(&cfg.target, timeout)?,
            path: cfg.route("out"),
            secret: secret.to_owned(),
            interval: Duration::from_millis(cfg.poll_interval_ms),
            port: port.clone(),
            stop: stop.clone(),
        };
        let poster = Poster {
            target: Target::parse(&cfg.target, timeout)?,
            path: cfg.route("in"),
            secret: secret.to_owned(),
            attempts: cfg.attempts,
            counters: side.counters.clone(),
            stop,
        };
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new().name(name.to_owned()).spawn(f).map_err(|e| format!("spawning {name}: {e}"))
        };
        side.threads.push(spawn("kvroute-relay replica out", Box::new(move || poller.run()))?);
        side.threads.push(spawn("kvroute-relay replica in", Box::new(move || poster.run(&rx)))?);
        let replicator = Replicator::start_port(port, cfg.nats.clone()).map_err(|e| e.to_string())?;
        side.replicator = Some(replicator);
        Ok(side)
    }

    pub(crate) fn stats(&self) -> ReplicaRelayStats {
        let c = &*self.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ReplicaRelayStats {
            epoch: self.port.out.lock().map(|o| o.epoch).unwrap_or(0),
            polls: g(&c.polls),
            poll_failures: g(&c.poll_failures),
            exported: g(&c.exported),
            lost: g(&c.lost),
            envoy_restarts: g(&c.envoy_restarts),
            pending_dropped: g(&c.pending_dropped),
            identity_mismatches: g(&c.identity_mismatches),
            batches_out: g(&c.batches_out),
            heartbeats: g(&c.heartbeats),
            received: g(&c.received),
            own: g(&c.own),
            malformed: g(&c.malformed),
            queue_dropped: g(&c.queue_dropped),
            posted: g(&c.posted),
            post_ignored: g(&c.post_ignored),
            post_rejected: g(&c.post_rejected),
            post_failures: g(&c.post_failures),
            nats: self.replicator.as_ref().map(Replicator::stats).unwrap_or_default(),
        }
    }

    pub(crate) fn is_running(&self) -> bool {
        self.threads.iter().all(|t| !t.is_finished())
    }

    pub(crate) fn shutdown(&mut self) {
        // The transport first: it publishes what waits (bounded), then the threads stop.
        if let Some(r) = self.replicator.take() {
            r.stop();
        }
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for ReplicaSide {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Reads the filter's export route.
struct Poller {
    target: Target,
    path: String,
    secret: String,
    interval: Duration,
    port: Arc<Port>,
    stop: Arc<AtomicBool>,
}

impl Poller {
    fn run(self) {
        let c = self.port.counters.clone();
        let mut cursor: Option<u64> = None;
        let mut failures = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            match self.read(cursor) {
                Ok((next, more)) => {
                    failures = 0;
                    cursor = next;
                    if !more {
                        sleep_unless_stopped(&self.stop, self.interval);
                    }
                }
                Err(e) => {
                    bump(&c.poll_failures);
                    if failures.is_power_of_two() || failures == 0 {
                        log(format_args!("reading {}{}: {e}", self.target.authority(), self.path));
                    }
                    failures = failures.saturating_add(1);
                    // Back off up to a second while the filter does not answer.
                    let wait = self.interval.saturating_mul(failures.min(100)).min(Duration::from_secs(1));
                    sleep_unless_stopped(&self.stop, wait);
                }
            }
        }
    }

    /// One export read from `cursor`: the next cursor and whether more waits.
    fn read(&self, cursor: Option<u64>) -> Result<(Option<u64>, bool), String> {
        let c = &self.port.counters;
        let (ts, sig) = signed(&self.secret, "out", cursor, &[]);
        let path = cursor.map_or_else(|| self.path.clone(), |n| format!("{}?cursor={n}", self.path));
        let r = self
            .target
            .get(&path, &[(HEADER_TIMESTAMP, ts.as_str()), (HEADER_SIGNATURE, sig.as_str())])
            .map_err(|e| e.to_string())?;
        if r.status != 200 {
            return Err(format!("status {}: {}", r.status, String::from_utf8_lossy(&r.body)));
        }
        let num = |h: &str| {
            r.header(h).and_then(|v| v.trim().parse::<u64>().ok()).ok_or_else(|| format!("header {h} missing"))
        };
        let next = num(ingest::HEADER_REPLICA_CURSOR)?;
        let lost = num(ingest::HEADER_REPLICA_LOST)?;
        let log_id = num(ingest::HEADER_REPLICA_LOG)?;
        let more = r.header(ingest::HEADER_REPLICA_MORE) == Some("1");
        let fleet = r.header(ingest::HEADER_REPLICA_FLEET).unwrap_or_default();
        let id = r.header(ingest::HEADER_REPLICA_ID).unwrap_or_default();
        if fleet != self.port.fleet || id != self.port.replica_id {
            bump(&c.identity_mismatches);
            return Err(format!(
                "the filter is replica {id:?} of fleet {fleet:?}, this relay {:?} of {:?}: nothing published",
                self.port.replica_id, self.port.fleet
            ));
        }
        let batch = ReplicaBatch::decode(&r.body).map_err(|e| format!("the export does not decode: {e}"))?;
        bump(&c.polls);
        if lost > 0 {
            c.lost.fetch_add(lost, Ordering::Relaxed);
            log(format_args!("{lost} entries of the filter's log were overwritten before they were read (lost)"));
        }
        if !self.port.exported(log_id, batch, kvroute::unix_time_ms()) {
            return Ok((None, true));
        }
        Ok((Some(next), more))
    }
}

/// Posts the other replicas' batches to the filter's ingestion route, in order.
struct Poster {
    target: Target,
    path: String,
    secret: String,
    attempts: u32,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
}

impl Poster {
    fn run(self, rx: &Receiver<Vec<u8>>) {
        while !self.stop.load(Ordering::Acquire) {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(batch) => self.post(&batch),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn post(&self, batch: &[u8]) {
        let c = &*self.counters;
        let mut backoff = Duration::from_millis(50);
        for attempt in 1..=self.attempts {
            let (ts, sig) = signed(&self.secret, "in", None, batch);
            let result = self.target.post(
                &self.path,
                &[(HEADER_TIMESTAMP, ts.as_str()), (HEADER_SIGNATURE, sig.as_str())],
                batch,
            );
            match result {
                Ok(r) if r.status == 200 => {
                    let ignored =
                        serde_json::from_slice::<serde_json::Value>(&r.body).is_ok_and(|v| v["verdict"] == "ignored");
                    bump(if ignored { &c.post_ignored } else { &c.posted });
                    return;
                }
                Ok(r) if r.status < 500 => {
                    bump(&c.post_rejected);
                    log(format_args!(
                        "{} refused a replica batch ({}): {}",
                        self.target.authority(),
                        r.status,
                        String::from_utf8_lossy(&r.body)
                    ));
                    return;
                }
                Ok(r) if attempt == self.attempts => {
                    bump(&c.post_failures);
                    log(format_args!("{} answered {} to a replica batch; dropped", self.target.authority(), r.status));
                    return;
                }
                Err(e) if attempt == self.attempts => {
                    bump(&c.post_failures);
                    log(format_args!("posting a replica batch to {}: {e}; dropped", self.target.authority()));
                    return;
                }
                _ => {}
            }
            if self.stop.load(Ordering::Acquire) {
                bump(&c.post_failures);
                return;
            }
            std::thread::sleep(backoff);
            backoff *= 4;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn port(queue: usize) -> (Port, Receiver<Vec<u8>>) {
        let (tx, rx) = std::sync::mpsc::sync_channel(queue);
        let port = Port {
            fleet: "f".into(),
            replica_id: "me".into(),
            max_batch_entries: 2,
            max_batch_bytes: 1 << 20,
            max_pending: 3,
            filter_silence_ms: 1000,
            out: Mutex::new(Outbound { epoch: 100, seq: 0, pending: VecDeque::new(), log_id: None, last_answer_ms: 0 }),
            inbound: tx,
            counters: Arc::new(Counters::default()),
        };
        (port, rx)
    }

    fn export(ids: &[&str]) -> ReplicaBatch {
        ReplicaBatch {
            fleet: "f".into(),
            replica: "me".into(),
            epoch: 7,
            seq: 0,
            sent_ms: 0,
            entries: ids.iter().map(|i| ReplicaEntry::Complete((*i).to_owned())).collect(),
        }
    }

    #[test]
    fn batches_carry_the_relays_identity_epoch_and_growing_sequence_numbers() {
        let (p, _rx) = port(4);
        assert_eq!(p.take_batch(1000, true), None, "no heartbeat before the filter answered");
        assert!(p.exported(7, export(&["a", "b", "c"]), 1000));
        let b = ReplicaBatch::decode(&p.take_batch(1001, false).unwrap()).unwrap();
        assert_eq!((b.fleet.as_str(), b.replica.as_str(), b.epoch, b.seq, b.entries.len()), ("f", "me", 100, 1, 2));
        let b = ReplicaBatch::decode(&p.take_batch(1002, false).unwrap()).unwrap();
        assert_eq!((b.seq, b.entries), (2, vec![ReplicaEntry::Complete("c".into())]));
        assert_eq!(p.take_batch(1003, false), None);
        // Heartbeats while the filter answers, not after `filter_silence_ms`.
        let hb = ReplicaBatch::decode(&p.take_batch(1500, true).unwrap()).unwrap();
        assert_eq!((hb.seq, hb.entries.len()), (3, 0));
        assert_eq!(p.take_batch(2001, true), None);
        // The pending queue is bounded: the oldest go first.
        assert!(p.exported(7, export(&["1", "2", "3", "4"]), 3000));
        assert_eq!(p.counters.pending_dropped.load(Ordering::Relaxed), 1);
        let b = ReplicaBatch::decode(&p.take_batch(3001, false).unwrap()).unwrap();
        assert_eq!(b.entries[0], ReplicaEntry::Complete("2".into()));
        // The filter's log changed (Envoy restarted): a new epoch, numbered from 1, and what
        // waited of the old log is dropped.
        assert!(!p.exported(8, export(&["x"]), 5000));
        assert!(p.exported(8, export(&["y"]), 5000));
        let b = ReplicaBatch::decode(&p.take_batch(5001, false).unwrap()).unwrap();
        assert_eq!((b.epoch, b.seq, b.entries), (5000, 1, vec![ReplicaEntry::Complete("y".into())]));
        assert_eq!(p.counters.envoy_restarts.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn inbound_batches_skip_our_own_and_the_queue_is_bounded() {
        let (p, rx) = port(1);
        let theirs = ReplicaBatch::encode_entries("f", "other", 1, 1, 0, &[]).unwrap();
        let ours = ReplicaBatch::encode_entries("f", "me", 1, 1, 0, &[]).unwrap();
        p.apply(&ours, 0);
        p.apply(b"junk", 0);
        p.apply(&theirs, 0);
        p.apply(&theirs, 0);
        assert_eq!(rx.try_recv().unwrap(), theirs);
        assert!(rx.try_recv().is_err());
        let c = &p.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        assert_eq!((g(&c.received), g(&c.own), g(&c.malformed), g(&c.queue_dropped)), (4, 1, 1, 1));
    }
}
