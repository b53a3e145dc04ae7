//! # kvroute-relay
//!
//! proxy-wasm filters have no sockets, so engine KV events cannot reach the kvroute Envoy filter
//! over ZMQ. The relay subscribes to each engine's ZMQ stream (vLLM / SGLang framing
//! `[topic, seq, msgpack payload]`), puts the batches in order (duplicates dropped, gaps
//! replayed from the publisher's replay socket, or the stream resynchronized when replay cannot
//! recover them) and POSTs each batch to the filter's event path on every Envoy listener it is
//! given, signed with the shared secret (HMAC-SHA256 over endpoint, kind, sequence number,
//! timestamp and body; the secret itself is never sent). See `wasm-filter/README.md` (Events) and the protocol in
//! [`kvroute_filter::ingest`].
//!
//! Receiving, decoding and gap handling are the core's ZMQ subscriber
//! ([`kvroute::Subscription`], one per engine). It delivers each batch, decoded once,
//! to the relay's [`kvroute::EventSink`], which judges the engine's stream with the
//! core's [`kvroute::StreamTracker`] (the rules of the filter's index, which sees the
//! same batches) and forwards every batch it accepts (applied or reset; replayed batches
//! included, in sequence order) as received. A resync of the subscription reaches the sink
//! before the batch that starts the stream again: the relay forwards it as a resync notice
//! ahead of that batch.
//!
//! With a `replica` section the relay is also its Envoy's link to the other router replicas of
//! its fleet over NATS ([`replica`]: the filter's shared log out, the others' batches in).
//!
//! Per target, one forwarding thread POSTs in order; when the filter answers 409 (it missed
//! batches: a POST was lost, or its Envoy restarted mid-stream) the relay POSTs a resync notice
//! and the batch again, which the filter then accepts as a fresh start.

pub mod config;
mod engine;
mod forward;
pub mod http;
pub mod replica;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

pub use config::{EngineConfig, RelayConfig};
use kvroute::{SubscribeError, SubscriberStats, Subscription};
pub use replica::{ReplicaRelayConfig, ReplicaRelayStats};

/// The relay's own counters (the subscriptions count the receiving side).
#[derive(Debug, Default)]
pub(crate) struct Stats {
    /// Batches handed to the forwarders (live and replayed).
    pub(crate) batches: AtomicU64,
    /// POSTs the filter accepted (200).
    pub(crate) posted: AtomicU64,
    /// 409 answers (the filter missed batches; a resync followed).
    pub(crate) conflicts: AtomicU64,
    /// POSTs that failed for good (transport errors after retries, or 4xx/5xx).
    pub(crate) post_failures: AtomicU64,
    /// Batches or resync notices dropped because a target's queue was full.
    pub(crate) dropped: AtomicU64,
}

/// Counters of a running relay, summed over its engines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatsSnapshot {
    /// ZMQ messages received (live).
    pub received: u64,
    /// Batches handed to the forwarders (live and replayed).
    pub batches: u64,
    /// Payloads decoded (for the sequence judgment), once per batch received, live or replayed.
    pub decoded: u64,
    /// Duplicate batches dropped.
    pub duplicates: u64,
    /// Gaps detected.
    pub gaps: u64,
    /// Batches recovered by replay.
    pub replayed: u64,
    /// Streams resynchronized (replay unavailable or failed).
    pub resyncs: u64,
    /// Payloads that did not decode (not forwarded).
    pub decode_errors: u64,
    /// Malformed ZMQ messages skipped.
    pub malformed: u64,
    /// POSTs the filter accepted (200).
    pub posted: u64,
    /// 409 answers (the filter missed batches; a resync followed).
    pub conflicts: u64,
    /// POSTs that failed for good (transport errors after retries, or 4xx/5xx).
    pub post_failures: u64,
    /// Batches or resync notices dropped because a target's queue was full.
    pub dropped: u64,
}

impl StatsSnapshot {
    fn new(own: &Stats) -> Self {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            batches: g(&own.batches),
            posted: g(&own.posted),
            conflicts: g(&own.conflicts),
            post_failures: g(&own.post_failures),
            dropped: g(&own.dropped),
            ..StatsSnapshot::default()
        }
    }

    fn add_subscriber(&mut self, s: &SubscriberStats) {
        self.received += s.messages;
        self.decoded += s.decoded;
        self.duplicates += s.duplicates;
        self.gaps += s.gaps;
        self.replayed += s.replayed_batches;
        self.resyncs += s.resyncs;
        self.decode_errors += s.decode_errors;
        self.malformed += s.malformed;
    }
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// The relay could not start.
#[derive(Debug)]
#[non_exhaustive]
pub enum RelayError {
    /// The configuration is invalid.
    Config(String),
    /// An engine's subscription could not be started (bad subscriber config, a ZMQ bind or
    /// connect error, ...).
    Subscribe {
        /// The engine's endpoint id.
        engine: String,
        /// The core subscriber's error.
        error: SubscribeError,
    },
    /// A forwarding thread could not be spawned.
    Spawn(std::io::Error),
    /// The replica side could not start (its secret, a thread, the NATS options).
    Replica(String),
}

impl std::fmt::Display for RelayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RelayError::Config(s) => write!(f, "relay configuration: {s}"),
            RelayError::Subscribe { engine, error } => write!(f, "engine {engine}: {error}"),
            RelayError::Spawn(e) => write!(f, "could not spawn a forwarding thread: {e}"),
            RelayError::Replica(s) => write!(f, "replica relay: {s}"),
        }
    }
}

impl std::error::Error for RelayError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RelayError::Config(_) | RelayError::Replica(_) => None,
            RelayError::Subscribe { error, .. } => Some(error),
            RelayError::Spawn(e) => Some(e),
        }
    }
}

/// What a forwarder is asked to send. A batch's `topic` is `None` when unknown (a vLLM ≤ 0.23
/// replay) or not usable as a header value: the header is then left out.
#[derive(Debug, Clone)]
pub(crate) enum Msg {
    Batch { endpoint: Arc<str>, topic: Option<Arc<str>>, seq: u64, payload: Arc<[u8]> },
    Resync { endpoint: Arc<str> },
}

/// A running relay: one core subscription (with its receiving thread) per engine, one
/// forwarding thread per target.
pub struct Relay {
    stop: Arc<AtomicBool>,
    stats: Arc<Stats>,
    subscriptions: Vec<Subscription>,
    /// Final counters of the subscriptions already stopped.
    stopped: Vec<SubscriberStats>,
    threads: Vec<JoinHandle<()>>,
    replica: Option<replica::ReplicaSide>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").field("stats", &self.stats()).finish_non_exhaustive()
    }
}

impl Relay {
    /// Open every engine's sockets (errors are returned here) and start relaying with `secret`;
    /// the replica side (when configured) reads its secret from its `secret_file` or
    /// `secret_env`.
    pub fn start(cfg: &RelayConfig, secret: &str) -> Result<Relay, RelayError> {
        Relay::start_with(cfg, secret, None)
    }

    /// [`Relay::start`] with the replica side's secret given (`None`: read as configured).
    pub fn start_with(cfg: &RelayConfig, secret: &str, replica_secret: Option<&str>) -> Result<Relay, RelayError> {
        cfg.validate().map_err(RelayError::Config)?;
        // Built as it goes, so that an error stops whatever was already started (`Drop`).
        let mut relay = Relay {
            stop: Arc::new(AtomicBool::new(false)),
            stats: Arc::new(Stats::default()),
            subscriptions: Vec::new(),
            stopped: Vec::new(),
            threads: Vec::new(),
            replica: None,
        };
        let mut senders = Vec::new();
        for t in &cfg.targets {
            let target = http::Target::parse(t, cfg.timeout()).map_err(RelayError::Config)?;
            let (tx, rx) = std::sync::mpsc::sync_channel(cfg.queue_batches);
            senders.push(tx);
            let f = forward::Forwarder::new(target, cfg, secret, relay.stats.clone(), relay.stop.clone());
            let name = format!("kvroute-relay post {t}");
            let thread = std::thread::Builder::new().name(name).spawn(move || f.run(&rx)).map_err(RelayError::Spawn)?;
            relay.threads.push(thread);
        }
        for e in &cfg.engines {
            let sub = engine::subscribe(e, senders.clone(), &relay.stats)?;
            relay.subscriptions.push(sub);
        }
        if let Some(r) = &cfg.replica {
            let secret = match replica_secret {
                Some(s) => s.to_owned(),
                None => r.secret().map_err(RelayError::Replica)?,
            };
            relay.replica = Some(replica::ReplicaSide::start(r, &secret, cfg.timeout()).map_err(RelayError::Replica)?);
        }
        Ok(relay)
    }

    /// Current counters.
    pub fn stats(&self) -> StatsSnapshot {
        let mut s = StatsSnapshot::new(&self.stats);
        for sub in &self.subscriptions {
            s.add_subscriber(&sub.stats());
        }
        for done in &self.stopped {
            s.add_subscriber(done);
        }
        s
    }

    /// The replica side's counters (with the NATS transport's), when configured.
    pub fn replica_stats(&self) -> Option<ReplicaRelayStats> {
        self.replica.as_ref().map(replica::ReplicaSide::stats)
    }

    /// Whether every subscription and forwarding thread is still running.
    pub fn is_running(&self) -> bool {
        self.subscriptions.iter().all(Subscription::is_running)
            && self.threads.iter().all(|t| !t.is_finished())
            && self.replica.as_ref().is_none_or(replica::ReplicaSide::is_running)
    }

    /// Stop the subscriptions, then the forwarders (about one poll interval; what is still queued
    /// is not posted); returns the final counters.
    pub fn stop(mut self) -> StatsSnapshot {
        self.shutdown();
        self.stats()
    }

    fn shutdown(&mut self) {
        if let Some(mut r) = self.replica.take() {
            r.shutdown();
        }
        for sub in self.subscriptions.drain(..) {
            // `stop` fails only when the worker had already ended (panicked): its counters were
            // final then.
            let last = sub.stats();
            self.stopped.push(sub.stop().unwrap_or(last));
        }
        self.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Log a line on stderr with the relay's prefix (the relay is a small daemon: its log is stderr).
pub(crate) fn log(msg: std::fmt::Arguments<'_>) {
    eprintln!("kvroute-relay: {msg}");
}
