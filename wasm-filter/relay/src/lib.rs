//! # kvroute-relay
//!
//! proxy-wasm filters have no sockets, so engine KV events cannot reach the kvroute Envoy filter
//! over ZMQ. The relay subscribes to each engine's ZMQ stream (vLLM / SGLang framing
//! `[topic, seq, msgpack payload]`), puts the batches in order (duplicates dropped, gaps
//! replayed from the publisher's replay socket, or the stream resynchronized when replay cannot
//! recover them) and POSTs each batch to the filter's event path on every Envoy listener it is
//! given, with the shared secret. See `wasm-filter/README.md` (Events) and the protocol in
//! [`kvroute_filter::ingest`].
//!
//! Ordering and gap handling use a *shadow* [`kvroute::Router`] that sees the same batches as
//! the filter: its stream verdict (applied / duplicate / gap / reset) decides what is forwarded.
//! (When the core's subscriber reports applied payloads to its observer, the relay can use the
//! core's subscriber instead of its own receive loop.)
//!
//! Per target, one forwarding thread POSTs in order; when the filter answers 409 (it missed
//! batches: a POST was lost, or its Envoy restarted mid-stream) the relay POSTs a resync notice
//! and the batch again, which the filter then accepts as a fresh start.

pub mod config;
mod engine;
mod forward;
pub mod http;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

pub use config::{EngineConfig, RelayConfig};

/// Counters of a running relay.
#[derive(Debug, Default)]
pub struct Stats {
    /// ZMQ messages received (live).
    pub received: AtomicU64,
    /// Batches handed to the forwarders (live and replayed).
    pub batches: AtomicU64,
    /// Duplicate batches dropped.
    pub duplicates: AtomicU64,
    /// Gaps detected.
    pub gaps: AtomicU64,
    /// Batches recovered by replay.
    pub replayed: AtomicU64,
    /// Streams resynchronized (replay unavailable or failed).
    pub resyncs: AtomicU64,
    /// Payloads that did not decode (not forwarded).
    pub decode_errors: AtomicU64,
    /// Malformed ZMQ messages skipped.
    pub malformed: AtomicU64,
    /// POSTs the filter accepted (200).
    pub posted: AtomicU64,
    /// 409 answers (the filter missed batches; a resync followed).
    pub conflicts: AtomicU64,
    /// POSTs that failed for good (transport errors after retries, or 4xx/5xx).
    pub post_failures: AtomicU64,
    /// Batches dropped because a target's queue was full.
    pub dropped: AtomicU64,
}

impl Stats {
    /// A plain copy of the counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            received: g(&self.received),
            batches: g(&self.batches),
            duplicates: g(&self.duplicates),
            gaps: g(&self.gaps),
            replayed: g(&self.replayed),
            resyncs: g(&self.resyncs),
            decode_errors: g(&self.decode_errors),
            malformed: g(&self.malformed),
            posted: g(&self.posted),
            conflicts: g(&self.conflicts),
            post_failures: g(&self.post_failures),
            dropped: g(&self.dropped),
        }
    }
}

/// A copy of [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[allow(missing_docs)]
pub struct StatsSnapshot {
    pub received: u64,
    pub batches: u64,
    pub duplicates: u64,
    pub gaps: u64,
    pub replayed: u64,
    pub resyncs: u64,
    pub decode_errors: u64,
    pub malformed: u64,
    pub posted: u64,
    pub conflicts: u64,
    pub post_failures: u64,
    pub dropped: u64,
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
    /// A ZMQ socket could not be opened.
    Socket(String),
}

impl std::fmt::Display for RelayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RelayError::Config(s) => write!(f, "relay configuration: {s}"),
            RelayError::Socket(s) => write!(f, "relay socket: {s}"),
        }
    }
}

impl std::error::Error for RelayError {}

/// What a forwarder is asked to send.
#[derive(Debug, Clone)]
pub(crate) enum Msg {
    Batch { endpoint: Arc<str>, topic: Arc<str>, seq: u64, payload: Arc<[u8]> },
    Resync { endpoint: Arc<str> },
}

/// A running relay: one receiving thread per engine, one forwarding thread per target.
pub struct Relay {
    stop: Arc<AtomicBool>,
    stats: Arc<Stats>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").field("stats", &self.stats.snapshot()).finish_non_exhaustive()
    }
}

impl Relay {
    /// Open every engine's sockets (errors are returned here) and start relaying with `secret`.
    pub fn start(cfg: &RelayConfig, secret: &str) -> Result<Relay, RelayError> {
        cfg.validate().map_err(RelayError::Config)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Stats::default());
        let mut threads = Vec::new();
        let mut senders = Vec::new();
        for t in &cfg.targets {
            let target = http::Target::parse(t, cfg.timeout()).map_err(RelayError::Config)?;
            let (tx, rx) = std::sync::mpsc::sync_channel(cfg.queue_batches);
            senders.push(tx);
            let f = forward::Forwarder::new(target, cfg, secret, stats.clone(), stop.clone());
            threads.push(std::thread::spawn(move || f.run(&rx)));
        }
        let ctx = zmq::Context::new();
        let mut engines = Vec::new();
        for e in &cfg.engines {
            engines.push(engine::Engine::open(&ctx, e, senders.clone(), stats.clone(), stop.clone())?);
        }
        for e in engines {
            threads.push(std::thread::spawn(move || e.run()));
        }
        Ok(Relay { stop, stats, threads })
    }

    /// Current counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Whether every thread is still running.
    pub fn is_running(&self) -> bool {
        self.threads.iter().all(|t| !t.is_finished())
    }

    /// Stop and join every thread (about one poll interval); returns the final counters.
    pub fn stop(mut self) -> StatsSnapshot {
        self.shutdown();
        self.stats.snapshot()
    }

    fn shutdown(&mut self) {
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
