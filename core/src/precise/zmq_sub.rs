//! ZMQ subscriber for engine KV events (cargo feature `zmq`, native only).
//!
//! The module is private: its full description is the documentation of [`Subscription`].

// The core is sans-IO (core/clippy.toml disallows clocks, threads and sleeps); this adapter
// (feature `zmq`, native only) is the exception: it runs the receiver thread, waits for replays
// against Instant deadlines and sleeps between polls. Its `now_ms` still comes from the Clock it
// is given, never from the system clock directly.
#![allow(clippy::disallowed_methods)]

use std::cell::{Cell, OnceCell};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::clock::Clock;

use serde::{Deserialize, Serialize};

use crate::precise::sink::{Batch, BatchOrigin, EventSink};

use crate::endpoints::validate_endpoint_id;
use crate::error::StateError;
use crate::precise::events::{decode_batch, EventBatch, EventError};
use crate::precise::StreamVerdict;
#[cfg(doc)]
use crate::router::Router;

/// Default: how long a replay may take (request to end marker), milliseconds.
pub const DEFAULT_REPLAY_TIMEOUT_MS: u64 = 1_000;
/// Default: the worker's poll timeout, milliseconds (bounds shutdown latency).
pub const DEFAULT_POLL_INTERVAL_MS: u64 = 100;
/// Largest accepted poll interval, milliseconds.
pub const MAX_POLL_INTERVAL_MS: u64 = 10_000;
/// Largest accepted replay timeout, milliseconds.
pub const MAX_REPLAY_TIMEOUT_MS: u64 = 600_000;
/// The sequence number that ends a replay answer (`-1` as a signed 8-byte big-endian integer).
pub const END_SEQ: u64 = u64::MAX;
/// Messages received per wake-up before the stop flag is looked at again.
const MAX_DRAIN: usize = 1024;

/// A callback told about everything unusual on the stream, after the sink's
/// [`EventSink::notice`] (called on the worker thread: keep it short and non-blocking; a panic
/// in it ends the subscription).
pub type Observer = Arc<dyn Fn(&SubscriberEvent) + Send + Sync>;

/// Whether the subscriber binds its `SUB` socket or connects it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SocketMode {
    /// Bind when the endpoint has a wildcard host (`*`, or the IPv6 unspecified address `::` /
    /// `[::]`), connect otherwise. This mirrors vLLM's publisher, which binds on such endpoints
    /// (so its subscribers connect to a concrete address) and connects to concrete ones (so the
    /// subscriber it connects to binds). Unlike vLLM's purely textual test, a concrete IPv6
    /// address such as `[::1]` means connect: a vLLM publisher given `tcp://[::1]:5557` binds
    /// there, and a subscriber must then connect to it.
    #[default]
    Auto,
    /// Always bind (the publisher connects to us).
    Bind,
    /// Always connect (the publisher binds).
    Connect,
}

impl SocketMode {
    /// Whether a socket with this mode binds `endpoint`.
    pub fn binds(self, endpoint: &str) -> bool {
        match self {
            SocketMode::Bind => true,
            SocketMode::Connect => false,
            SocketMode::Auto => {
                let addr = endpoint.split_once("://").map_or(endpoint, |(_, rest)| rest);
                // Host = everything before the last ':' (the port); `[::]` or `::` is the
                // unspecified IPv6 address.
                let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
                addr.contains('*') || matches!(host, "[::]" | "::" | ":::")
            }
        }
    }
}

fn default_replay_timeout_ms() -> u64 {
    DEFAULT_REPLAY_TIMEOUT_MS
}

fn default_poll_interval_ms() -> u64 {
    DEFAULT_POLL_INTERVAL_MS
}

/// How to reach one publisher.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubscriberConfig {
    /// ZMQ endpoint of the live stream, e.g. `tcp://10.0.0.7:5557` (connect) or `tcp://*:5557`
    /// (bind), see [`SocketMode`].
    pub endpoint: String,
    /// Bind or connect (default: [`SocketMode::Auto`]).
    #[serde(default)]
    pub mode: SocketMode,
    /// Topic prefix filter; `""` (the default) takes every topic.
    #[serde(default)]
    pub topic: String,
    /// The publisher's replay (`ROUTER`) endpoint, e.g. `tcp://10.0.0.7:5558`; always connected.
    /// Without one, every gap resynchronizes the stream.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// How long one replay may take, from request to end marker (default
    /// [`DEFAULT_REPLAY_TIMEOUT_MS`]; 1..=[`MAX_REPLAY_TIMEOUT_MS`]).
    #[serde(default = "default_replay_timeout_ms")]
    pub replay_timeout_ms: u64,
    /// Poll timeout of the worker, which bounds how long [`Subscription::stop`] takes (default
    /// [`DEFAULT_POLL_INTERVAL_MS`]; 1..=[`MAX_POLL_INTERVAL_MS`]).
    #[serde(default = "default_poll_interval_ms")]
    pub poll_interval_ms: u64,
}

impl SubscriberConfig {
    /// A configuration for `endpoint` with every other field at its default.
    pub fn new(endpoint: impl Into<String>) -> Self {
        SubscriberConfig {
            endpoint: endpoint.into(),
            mode: SocketMode::Auto,
            topic: String::new(),
            replay_endpoint: None,
            replay_timeout_ms: DEFAULT_REPLAY_TIMEOUT_MS,
            poll_interval_ms: DEFAULT_POLL_INTERVAL_MS,
        }
    }

    /// Whether the `SUB` socket binds (see [`SocketMode::binds`]).
    pub fn binds(&self) -> bool {
        self.mode.binds(&self.endpoint)
    }

    /// Check the values (ZMQ itself judges the endpoints when they are bound or connected).
    pub fn validate(&self) -> Result<(), SubscribeError> {
        let invalid = |field: &'static str, reason: String| Err(SubscribeError::InvalidConfig { field, reason });
        if !self.endpoint.contains("://") {
            return invalid("endpoint", format!("{:?} is not a ZMQ endpoint (transport://address)", self.endpoint));
        }
        if let Some(r) = &self.replay_endpoint {
            if !r.contains("://") {
                return invalid("replay_endpoint", format!("{r:?} is not a ZMQ endpoint (transport://address)"));
            }
        }
        if !(1..=MAX_REPLAY_TIMEOUT_MS).contains(&self.replay_timeout_ms) {
            return invalid(
                "replay_timeout_ms",
                format!("{} is not within 1..={MAX_REPLAY_TIMEOUT_MS}", self.replay_timeout_ms),
            );
        }
        if !(1..=MAX_POLL_INTERVAL_MS).contains(&self.poll_interval_ms) {
            return invalid(
                "poll_interval_ms",
                format!("{} is not within 1..={MAX_POLL_INTERVAL_MS}", self.poll_interval_ms),
            );
        }
        Ok(())
    }
}

/// A subscription could not be started or ended badly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubscribeError {
    /// A configuration value is out of range.
    #[error("invalid subscriber config `{field}`: {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// The endpoint id is not a valid `ip:port`.
    #[error(transparent)]
    EndpointId(#[from] StateError),
    /// A ZMQ call failed while setting up the socket.
    #[error("zmq {op} {endpoint:?}: {source}")]
    Socket {
        /// What was being done (`"socket"`, `"setsockopt"`, `"bind"`, `"connect"`).
        op: &'static str,
        /// The endpoint concerned.
        endpoint: String,
        /// The ZMQ error.
        #[source]
        source: zmq::Error,
    },
    /// The worker thread could not be spawned.
    #[error("could not spawn the subscriber thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// The worker thread panicked (e.g. in an [`Observer`]).
    #[error("the subscriber thread panicked")]
    WorkerPanicked,
}

/// Why a replay did not bring the stream back in order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayFailure {
    /// No replay endpoint is configured.
    #[error("no replay endpoint configured")]
    Unavailable,
    /// No complete answer within the replay timeout.
    #[error("no complete replay answer within {timeout_ms} ms ({received} batches received)")]
    Timeout {
        /// The timeout.
        timeout_ms: u64,
        /// Batches received before it ran out.
        received: u64,
    },
    /// The publisher's buffer no longer reaches the first missing batch.
    #[error("replay starts at seq {first}, after the missing seq {expected}")]
    TooOld {
        /// First missing sequence number.
        expected: u64,
        /// First replayed sequence number.
        first: u64,
    },
    /// The replay does not reach back to the last batch applied (`seq`), which proves that the
    /// publisher did not restart since: continuity cannot be told.
    #[error("replay starts after seq {seq}, the last batch applied: continuity unproven")]
    Unproven {
        /// The last sequence number applied.
        seq: u64,
    },
    /// The replay ended, or skipped, before the held batch.
    #[error("replay does not include seq {missing}")]
    Incomplete {
        /// First sequence number the replay did not deliver.
        missing: u64,
    },
    /// A replayed batch could not be applied (undecodable, unknown endpoint, or the stream moved).
    #[error("replayed batch seq {seq} could not be applied")]
    Unusable {
        /// Its sequence number.
        seq: u64,
    },
    /// A reply had an unexpected shape.
    #[error("malformed replay reply: {reason}")]
    BadReply {
        /// What was wrong.
        reason: &'static str,
    },
    /// A ZMQ call on the replay socket failed.
    #[error("replay socket {op}: {error}")]
    Socket {
        /// What was being done.
        op: &'static str,
        /// The ZMQ error.
        error: zmq::Error,
    },
}

/// Something unusual on the stream, reported to the sink ([`EventSink::notice`]) and the
/// [`Observer`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum SubscriberEvent {
    /// A message with the wrong shape was skipped.
    Malformed {
        /// Number of frames received.
        frames: usize,
        /// What was wrong.
        reason: &'static str,
    },
    /// A payload did not decode (nothing of it was applied).
    Decode {
        /// Its sequence number.
        seq: u64,
        /// The decoder's error.
        error: EventError,
    },
    /// The sink (e.g. the router) refused the batch or a resync (e.g. the endpoint is not
    /// registered).
    Router {
        /// Sequence number of the batch concerned.
        seq: u64,
        /// The sink's error.
        error: StateError,
    },
    /// Batches `expected..got` are missing; recovery starts. `expected` 0: the publisher
    /// restarted and its first batches were missed (the sink cleared the endpoint).
    Gap {
        /// First missing sequence number.
        expected: u64,
        /// The sequence number received.
        got: u64,
    },
    /// The publisher restarted (sequence back to 0); the sink cleared the endpoint and applied
    /// the batch. (A restart first seen at a later sequence number is a [`SubscriberEvent::Gap`]
    /// from 0.)
    Reset {
        /// The batch's sequence number.
        seq: u64,
    },
    /// Replay did not recover the gap.
    ReplayFailed {
        /// First missing sequence number.
        expected: u64,
        /// Why.
        reason: ReplayFailure,
    },
    /// The stream was resynchronized (endpoint cleared and stale for a while).
    Resync {
        /// First missing sequence number.
        expected: u64,
        /// The sequence number of the batch that revealed the gap.
        got: u64,
    },
}

/// Counters of one subscription (a snapshot).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SubscriberStats {
    /// Multipart messages received on the live stream (well-formed or not).
    pub messages: u64,
    /// Well-formed batches received on the live stream.
    pub batches: u64,
    /// Payloads decoded (successfully or not): each live or replayed batch is decoded once,
    /// whatever happens to it after (a held batch submitted again is not decoded again).
    pub decoded: u64,
    /// Batches the sink applied (verdict `Applied` or `Reset`), live, replayed or resubmitted.
    pub applied: u64,
    /// Batches the sink ignored as already seen.
    pub duplicates: u64,
    /// Publisher restarts (verdict `Reset`).
    pub resets: u64,
    /// Gaps detected (verdict `Gap`).
    pub gaps: u64,
    /// Replays requested.
    pub replays: u64,
    /// Replayed batches applied.
    pub replayed_batches: u64,
    /// Replays that did not recover their gap (a missing replay endpoint does not count).
    pub replay_failures: u64,
    /// Streams resynchronized through [`EventSink::resync`] (the router's
    /// [`Router::resync_stream`]).
    pub resyncs: u64,
    /// Connections to the publisher lost (ZMQ's `ZMQ_EVENT_DISCONNECTED`; ZMQ reconnects).
    pub disconnects: u64,
    /// Payloads that did not decode.
    pub decode_errors: u64,
    /// Messages skipped for their shape (frame count, sequence frame size).
    pub malformed: u64,
    /// Batches or resyncs the sink refused (e.g. the router does not know the endpoint).
    pub router_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    messages: AtomicU64,
    batches: AtomicU64,
    decoded: AtomicU64,
    applied: AtomicU64,
    duplicates: AtomicU64,
    resets: AtomicU64,
    gaps: AtomicU64,
    replays: AtomicU64,
    replayed_batches: AtomicU64,
    replay_failures: AtomicU64,
    resyncs: AtomicU64,
    disconnects: AtomicU64,
    decode_errors: AtomicU64,
    malformed: AtomicU64,
    router_errors: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    fn snapshot(&self) -> SubscriberStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SubscriberStats {
            messages: g(&self.messages),
            batches: g(&self.batches),
            decoded: g(&self.decoded),
            applied: g(&self.applied),
            duplicates: g(&self.duplicates),
            resets: g(&self.resets),
            gaps: g(&self.gaps),
            replays: g(&self.replays),
            replayed_batches: g(&self.replayed_batches),
            replay_failures: g(&self.replay_failures),
            resyncs: g(&self.resyncs),
            disconnects: g(&self.disconnects),
            decode_errors: g(&self.decode_errors),
            malformed: g(&self.malformed),
            router_errors: g(&self.router_errors),
        }
    }
}

/// A running subscription: one background thread feeding one endpoint of a sink. Stop it with
/// [`Subscription::stop`] (dropping it stops it too).
///
/// ---
///
/// ZMQ subscriber for engine KV events (cargo feature `zmq`, native only).
///
/// A [`Subscription`] owns ONE background thread that receives a vLLM (or SGLang) KV-event
/// stream over ZMQ, decodes each batch once and delivers it to an [`EventSink`], recovering
/// from lost batches with the publisher's replay socket. The sink judges each batch's place in
/// the stream and keeps it: a [`Router`] (it applies batches to its precise index) or, in a
/// program that only forwards batches, a sink that judges them with a
/// [`crate::precise::StreamTracker`] (the Envoy filter's relay). The core stays free of clocks,
/// threads and I/O: this adapter supplies `now_ms` from a [`Clock`] it is given and calls the
/// sink's methods, the router's being pure.
///
/// # Wire format
/// - Live stream (ZMQ `SUB`): multipart `[topic (utf-8), seq (8-byte big-endian u64), payload
///   (msgpack batch)]`. The subscription filter is [`SubscriberConfig::topic`] (a byte prefix of
///   the topic frame; `""` takes everything). Messages with another frame count or a sequence
///   frame that is not 8 bytes are counted ([`SubscriberStats::malformed`]) and skipped.
/// - Bind or connect: vLLM's publisher binds when its endpoint contains `*` or `::` and connects
///   otherwise, so the subscriber does the opposite: see [`SocketMode`].
/// - Replay (ZMQ `DEALER` to the publisher's `ROUTER`): request `["", start_seq (8-byte BE)]`.
///   Both reply layouts are accepted, told apart by each message's own frame count (so either
///   end marker closes either batch layout): vLLM ≥ 0.26 and SGLang (0.5.23's
///   `_service_replay`) send `["", topic, seq, payload]` per buffered batch and end with
///   `["", "", END_SEQ, ""]`; vLLM ≤ 0.23 sends `["", seq, payload]` and ends with
///   `["", END_SEQ, ""]`. [`END_SEQ`] is `-1` as a signed 8-byte big-endian integer. A replayed
///   batch without a topic frame is not filtered by [`SubscriberConfig::topic`].
/// - Payloads are decoded by [`crate::precise::events::decode_batch`] (see its module for the event
///   formats: vLLM ≤ 0.23 arrays, vLLM ≥ 0.24 and SGLang maps, extra keys, lookahead, offload
///   re-announcements).
///
/// # Gaps, replay and resync
/// When the sink judges a batch a [`StreamVerdict::Gap`] (batches `expected..got` are
/// missing), the batch is held and the worker:
/// 1. opens a fresh `DEALER` (so a late answer to an earlier, timed-out request can never be
///    mistaken for this one), asks for `expected - 1` — the last batch applied, which the sink
///    judges a duplicate only when the publisher is the same process — and delivers each
///    replayed batch in order with its sequence number, until the batch before the held one has
///    been applied. When the sink finds that first batch is not the one it applied (the engine
///    restarted, e.g. during a disconnect, and its new sequence passed the old one), it clears
///    the endpoint and answers a gap from 0: the worker asks again from 0, delivering the new
///    process's batches from its first;
/// 2. gives up ([`ReplayFailure`]) when no replay endpoint is configured, when no complete answer
///    arrives within [`SubscriberConfig::replay_timeout_ms`], when the replay does not reach back
///    to the last batch applied ([`ReplayFailure::Unproven`]) or to `expected`
///    ([`ReplayFailure::TooOld`]), when the replay ends or skips before the held batch, or when a
///    replayed batch cannot be applied; it then calls [`EventSink::resync`] (the router drops
///    the endpoint's precise entries and counts it as stale for
///    `index.precise.stale_recovery_ms`);
/// 3. submits the held batch again (after a resync it is accepted as a fresh start).
///
/// Each replay's end is told to [`EventSink::replay_ended`] (the router counts it).
///
/// # Restarts
/// A publisher restart whose first batch is seen with a sequence number not above the last one
/// applied is judged by the sink: [`StreamVerdict::Reset`] at 0 (endpoint cleared, batch
/// applied; the subscriber counts it), a gap from 0 otherwise (endpoint cleared; the worker
/// replays from 0 as above, or resyncs). The `SUB` socket is monitored for lost connections
/// ([`SubscriberStats::disconnects`]): ZMQ reconnects by itself, and the first batch after a lost
/// connection may come from a new process even when its number is the next one expected. So when
/// it is in order, the worker first proves continuity by replaying from the last batch applied
/// (as in step 1; a restart found there is replayed from 0), and resyncs when that cannot be done.
/// A payload that does not decode is counted and reported, and the stream goes on; since the
/// sink never saw that sequence number, the next batch is a gap, whose replay brings the same
/// undecodable bytes, so the stream is resynchronized: entries that batch would have changed are
/// never trusted blindly.
///
/// # Sinks: applying or forwarding
/// [`EventSink::deliver`] is given each batch as a [`Batch`]: the payload decoded (once, by the
/// subscription: [`SubscriberStats::decoded`] counts it) and raw, its topic and sequence number,
/// and whether it came from the live stream or from a replay. Batches come in sequence order:
/// batches recovered by replay before the held batch that revealed the gap. Payloads that do not
/// decode never reach the sink. A forwarder (e.g. a relay that POSTs batches to a process
/// without sockets) passes on the raw payload of the batches it accepts, and on
/// [`EventSink::resync`] tells its downstream to drop what it holds for the endpoint: that call
/// comes before the batch that starts the stream again. Everything unusual reaches
/// [`EventSink::notice`] and then the [`Observer`], if one was given, on the same thread, in
/// stream order; a verdict's own notice ([`SubscriberEvent::Gap`], [`SubscriberEvent::Reset`])
/// comes after the `deliver` call that returned it.
///
/// # Threading and shutdown
/// [`Subscription::start`] gives the subscription its own ZMQ context, opens the sockets on the
/// worker thread and waits for it to report that the socket is bound or connected (errors come
/// back from `start`). The worker polls with a timeout of [`SubscriberConfig::poll_interval_ms`]
/// and checks a stop flag between polls (also while waiting for a replay); [`Subscription::stop`]
/// and `Drop` set the flag and join the thread, so shutdown takes at most about one poll
/// interval. Sockets are closed with linger 0: nothing is left behind.
///
/// # Clock
/// `now_ms` given to the sink comes from the [`Clock`] passed to `start`. Metric snapshots
/// (`MetricsSnapshot::updated_ms`) and `route` calls must use the same clock. [`unix_clock`](crate::unix_clock)
/// (milliseconds since the UNIX epoch) is the usual choice; pass a monotonic clock (or a test
/// clock) if the rest of the program uses one.
///
/// # Limits
/// One subscription feeds one endpoint of its sink from one publisher. With data parallelism,
/// each rank publishes its own numbered stream (vLLM: port + rank); the router keeps one
/// sequence per endpoint, so subscribe each rank as its own router endpoint.
///
/// ```no_run
/// use std::sync::Arc;
/// use kvroute::{unix_clock, SubscriberConfig, Subscription};
/// use kvroute::{EndpointSpec, Policy, Role, Router};
///
/// let router = Arc::new(Router::new(Policy::from_json(r#"{"index":{"mode":"hybrid"}}"#)?));
/// router.upsert_endpoint(EndpointSpec::new("10.0.0.7:8000", Role::Decode))?;
/// let mut cfg = SubscriberConfig::new("tcp://10.0.0.7:5557");
/// cfg.replay_endpoint = Some("tcp://10.0.0.7:5558".into());
/// let sub = Subscription::start(router.clone(), "10.0.0.7:8000", cfg, unix_clock())?;
/// // ... route requests; events keep flowing into the router ...
/// let stats = sub.stop()?;
/// println!("applied {} batches, {} resyncs", stats.applied, stats.resyncs);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Subscription {
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    thread: Option<JoinHandle<()>>,
    endpoint_id: String,
    local_endpoint: String,
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("endpoint_id", &self.endpoint_id)
            .field("local_endpoint", &self.local_endpoint)
            .field("running", &self.is_running())
            .field("stats", &self.stats())
            .finish()
    }
}

impl Subscription {
    /// Subscribe to `cfg.endpoint` and deliver its batches to `sink` as endpoint `endpoint_id`
    /// (an `ip:port`; for a [`Router`], one it knows or will know: batches for an unregistered
    /// endpoint are counted in [`SubscriberStats::router_errors`]), with `now_ms` read from
    /// `clock`. `sink` is any [`EventSink`]: an `Arc<Router>`, an `Arc` of your own sink, or an
    /// `Arc<dyn EventSink>`.
    ///
    /// Returns once the socket is bound or connected (a bind or connect error is returned here).
    pub fn start<S: EventSink + ?Sized + 'static>(
        sink: Arc<S>,
        endpoint_id: impl Into<String>,
        cfg: SubscriberConfig,
        clock: Clock,
    ) -> Result<Subscription, SubscribeError> {
        Self::start_with_observer(sink, endpoint_id, cfg, clock, None)
    }

    /// [`Subscription::start`] with an [`Observer`] told about malformed messages, decode
    /// errors, gaps, restarts, replay failures and resyncs (after the sink's
    /// [`EventSink::notice`]).
    pub fn start_with_observer<S: EventSink + ?Sized + 'static>(
        sink: Arc<S>,
        endpoint_id: impl Into<String>,
        cfg: SubscriberConfig,
        clock: Clock,
        observer: Option<Observer>,
    ) -> Result<Subscription, SubscribeError> {
        let endpoint_id = endpoint_id.into();
        cfg.validate()?;
        validate_endpoint_id(&endpoint_id)?;
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let worker = Worker {
            sink,
            endpoint_id: endpoint_id.clone(),
            cfg,
            clock,
            observer,
            counters: counters.clone(),
            stop: stop.clone(),
            ctx: zmq::Context::new(),
            last_seq: Cell::new(None),
            disconnected: Cell::new(false),
        };
        let (tx, rx) = mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name(format!("kvroute-zmq {endpoint_id}"))
            .spawn(move || worker.run(&tx))
            .map_err(SubscribeError::Spawn)?;
        let started = rx.recv();
        match started {
            Ok(Ok(local_endpoint)) => {
                Ok(Subscription { stop, counters, thread: Some(thread), endpoint_id, local_endpoint })
            }
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(SubscribeError::WorkerPanicked)
            }
        }
    }

    /// The endpoint id this subscription delivers as.
    pub fn endpoint_id(&self) -> &str {
        &self.endpoint_id
    }

    /// The endpoint the `SUB` socket is bound or connected to, as ZMQ reports it
    /// (`ZMQ_LAST_ENDPOINT`): for a bind to port `*`, this names the port chosen.
    pub fn local_endpoint(&self) -> &str {
        &self.local_endpoint
    }

    /// Current counters.
    pub fn stats(&self) -> SubscriberStats {
        self.counters.snapshot()
    }

    /// Whether the worker thread is still running (false only after it panicked).
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stop the worker, wait for it (about one poll interval at most; a replay in progress is
    /// abandoned) and return the final counters.
    pub fn stop(mut self) -> Result<SubscriberStats, SubscribeError> {
        self.shutdown()?;
        Ok(self.counters.snapshot())
    }

    fn shutdown(&mut self) -> Result<(), SubscribeError> {
        self.stop.store(true, Ordering::Release);
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| SubscribeError::WorkerPanicked),
            None => Ok(()),
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// How a replay attempt ended.
enum ReplayEnd {
    /// Every batch before the held one has been applied.
    Done,
    /// Stop was requested.
    Stopped,
    /// The publisher restarted since the last batch applied: replay again from 0.
    Restarted,
    /// Not recovered.
    Failed(ReplayFailure),
}

/// One parsed replay reply.
enum ReplayMsg<'a> {
    Batch { topic: Option<&'a [u8]>, seq: u64, payload: &'a [u8] },
    End,
}

fn seq_of(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

fn parse_replay(frames: &[Vec<u8>]) -> Result<ReplayMsg<'_>, &'static str> {
    let (topic, seq, payload) = match frames {
        [delim, topic, seq, payload] if delim.is_empty() => (Some(topic.as_slice()), seq, payload),
        [delim, seq, payload] if delim.is_empty() => (None, seq, payload),
        _ => return Err("expected [\"\", topic, seq, payload] or [\"\", seq, payload]"),
    };
    let seq = seq_of(seq).ok_or("sequence frame is not 8 bytes")?;
    if seq == END_SEQ && payload.is_empty() {
        return Ok(ReplayMsg::End);
    }
    Ok(ReplayMsg::Batch { topic, seq, payload })
}

fn wants_ipv6(endpoint: &str) -> bool {
    endpoint.contains('[') || endpoint.contains("::")
}

struct Worker<S: ?Sized> {
    sink: Arc<S>,
    endpoint_id: String,
    cfg: SubscriberConfig,
    clock: Clock,
    observer: Option<Observer>,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    ctx: zmq::Context,
    /// The last sequence number the sink applied from this stream (`None`: none yet, or a
    /// fresh start is due after a resync or a restart).
    last_seq: Cell<Option<u64>>,
    /// The connection was lost since the last live batch: the next one may come from a
    /// restarted publisher.
    disconnected: Cell<bool>,
}

/// Where the `SUB` socket's monitor publishes (one context per subscription).
const MONITOR_ENDPOINT: &str = "inproc://kvroute-zmq-sub-monitor";

/// A payload, decoded when first needed and kept (a held batch submitted again after a replay
/// is not decoded a second time).
type Decoded = OnceCell<Result<EventBatch, EventError>>;

/// A batch as received, before the sink judges it.
#[derive(Clone, Copy)]
struct Received<'a> {
    topic: Option<&'a [u8]>,
    seq: u64,
    payload: &'a [u8],
    origin: BatchOrigin,
    decoded: &'a Decoded,
}

impl<S: EventSink + ?Sized> Worker<S> {
    fn run(self, started: &mpsc::SyncSender<Result<String, SubscribeError>>) {
        let (sub, monitor) = match self.open() {
            Ok((sub, monitor, local)) => {
                let _ = started.send(Ok(local));
                (sub, monitor)
            }
            Err(e) => {
                let _ = started.send(Err(e));
                return;
            }
        };
        self.receive(&sub, &monitor);
        // The sockets (linger 0) are closed before the context is dropped, so dropping the
        // context does not block.
        drop(monitor);
        drop(sub);
    }

    fn open(&self) -> Result<(zmq::Socket, zmq::Socket, String), SubscribeError> {
        let ep = &self.cfg.endpoint;
        let err = |op: &'static str| move |source| SubscribeError::Socket { op, endpoint: ep.clone(), source };
        let sub = self.ctx.socket(zmq::SUB).map_err(err("socket"))?;
        sub.set_linger(0).map_err(err("setsockopt"))?;
        if wants_ipv6(ep) {
            sub.set_ipv6(true).map_err(err("setsockopt"))?;
        }
        sub.set_subscribe(self.cfg.topic.as_bytes()).map_err(err("setsockopt"))?;
        // Lost connections are how a restarted publisher shows itself before its batches do.
        sub.monitor(MONITOR_ENDPOINT, zmq::SocketEvent::DISCONNECTED as i32).map_err(err("monitor"))?;
        let monitor = self.ctx.socket(zmq::PAIR).map_err(err("socket"))?;
        monitor.set_linger(0).map_err(err("setsockopt"))?;
        monitor.connect(MONITOR_ENDPOINT).map_err(err("connect"))?;
        if self.cfg.binds() {
            sub.bind(ep).map_err(err("bind"))?;
        } else {
            sub.connect(ep).map_err(err("connect"))?;
        }
        let local = match sub.get_last_endpoint() {
            Ok(Ok(s)) if !s.is_empty() => s,
            _ => ep.clone(),
        };
        Ok((sub, monitor, local))
    }

    /// Take the monitor's pending events: a lost connection marks the next live batch unsure.
    fn check_monitor(&self, monitor: &zmq::Socket) {
        while let Ok(frames) = monitor.recv_multipart(zmq::DONTWAIT) {
            // Frame 1: event number (u16) and value (u32), native byte order; frame 2: address.
            let event = frames.first().and_then(|f| f.get(..2)).map(|b| u16::from_ne_bytes([b[0], b[1]]));
            if event == Some(zmq::SocketEvent::DISCONNECTED as u16) {
                bump(&self.counters.disconnects);
                self.disconnected.set(true);
            }
        }
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn notify(&self, event: SubscriberEvent) {
        self.sink.notice(&self.endpoint_id, &event);
        if let Some(o) = &self.observer {
            o(&event);
        }
    }

    fn poll_ms(&self, left: Option<Duration>) -> i64 {
        let p = Duration::from_millis(self.cfg.poll_interval_ms);
        let d = left.map_or(p, |l| l.min(p));
        i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
    }

    fn receive(&self, sub: &zmq::Socket, monitor: &zmq::Socket) {
        while !self.stopping() {
            match sub.poll(zmq::POLLIN, self.poll_ms(None)) {
                Ok(0) | Err(zmq::Error::EINTR) => continue,
                Ok(_) => {}
                Err(_) => {
                    // Not expected on a live socket of our own context; do not spin.
                    std::thread::sleep(Duration::from_millis(self.cfg.poll_interval_ms));
                    continue;
                }
            }
            for _ in 0..MAX_DRAIN {
                if self.stopping() {
                    return;
                }
                match sub.recv_multipart(zmq::DONTWAIT) {
                    Ok(frames) => {
                        // Any disconnect that happened before this message was received is
                        // queued on the monitor by now.
                        self.check_monitor(monitor);
                        self.on_message(&frames);
                    }
                    Err(zmq::Error::EINTR) => continue,
                    Err(_) => break, // EAGAIN: drained
                }
            }
        }
    }

    fn on_message(&self, frames: &[Vec<u8>]) {
        bump(&self.counters.messages);
        let malformed = |reason| {
            bump(&self.counters.malformed);
            self.notify(SubscriberEvent::Malformed { frames: frames.len(), reason });
        };
        let [topic, seq, payload] = frames else {
            return malformed("expected 3 frames [topic, seq, payload]");
        };
        if !topic.starts_with(self.cfg.topic.as_bytes()) {
            // ZMQ's own subscription filter already dropped these; never applied.
            return;
        }
        let Some(seq) = seq_of(seq) else {
            return malformed("sequence frame is not 8 bytes");
        };
        bump(&self.counters.batches);
        let decoded = Decoded::new();
        let batch = Received { topic: Some(topic), seq, payload, origin: BatchOrigin::Live, decoded: &decoded };
        // In order, but the connection was lost since the last batch: a restarted publisher may
        // have reached this number again. Prove continuity first (replay from the last batch
        // applied), or resync. Any other number after a lost connection is judged by the sink:
        // going back is a repeat or a restart, jumping ahead a gap whose replay starts at the
        // last batch applied.
        let unsure = self.disconnected.replace(false);
        if unsure && self.last_seq.get().is_some_and(|l| seq == l.wrapping_add(1)) {
            self.recover(seq, seq, batch);
            return;
        }
        if let Some(StreamVerdict::Gap { expected, got }) = self.apply(batch) {
            self.recover(expected, got, batch);
        }
    }

    /// Deliver one batch to the sink (decoding it first, once); count and report what
    /// happened. `None`: not applied (decode error, or the sink refused it).
    fn apply(&self, b: Received<'_>) -> Option<StreamVerdict> {
        let seq = b.seq;
        let decoded = b.decoded.get_or_init(|| {
            bump(&self.counters.decoded);
            decode_batch(b.payload)
        });
        let decoded = match decoded {
            Ok(batch) => batch,
            Err(error) => {
                bump(&self.counters.decode_errors);
                self.notify(SubscriberEvent::Decode { seq, error: error.clone() });
                return None;
            }
        };
        let batch = Batch { topic: b.topic, seq, payload: b.payload, decoded, origin: b.origin };
        match self.sink.deliver(&self.endpoint_id, &batch, (self.clock)()) {
            Ok(verdict) => {
                match verdict {
                    StreamVerdict::Applied | StreamVerdict::Reset => self.last_seq.set(Some(seq)),
                    // A restart whose first batches were missed: the sink cleared the stream.
                    StreamVerdict::Gap { expected: 0, .. } => self.last_seq.set(None),
                    StreamVerdict::Gap { .. } | StreamVerdict::Duplicate => {}
                }
                match verdict {
                    StreamVerdict::Applied => bump(&self.counters.applied),
                    StreamVerdict::Reset => {
                        bump(&self.counters.applied);
                        bump(&self.counters.resets);
                        self.notify(SubscriberEvent::Reset { seq });
                    }
                    // The overlap a replay starts with is a continuity proof, not a duplicate.
                    StreamVerdict::Duplicate if b.origin == BatchOrigin::Replay => {}
                    StreamVerdict::Duplicate => bump(&self.counters.duplicates),
                    StreamVerdict::Gap { expected, got } => {
                        bump(&self.counters.gaps);
                        self.notify(SubscriberEvent::Gap { expected, got });
                    }
                }
                Some(verdict)
            }
            Err(error) => {
                bump(&self.counters.router_errors);
                self.notify(SubscriberEvent::Router { seq, error });
                None
            }
        }
    }

    /// Batches `expected..held` are missing: replay them (or resync), then submit the held one.
    /// The replay starts at `expected - 1`, the last batch applied, which the sink judges a
    /// duplicate only when the publisher did not restart in between; when it did, the sink
    /// reports a gap from 0 and the replay starts again there.
    fn recover(&self, expected: u64, held: u64, batch: Received<'_>) {
        let failure = match &self.cfg.replay_endpoint {
            None => Some(ReplayFailure::Unavailable),
            Some(ep) => {
                bump(&self.counters.replays);
                let mut end = self.replay(ep, expected, held);
                if matches!(end, ReplayEnd::Restarted) {
                    bump(&self.counters.replays);
                    end = self.replay(ep, 0, held);
                }
                match end {
                    ReplayEnd::Done => {
                        self.sink.replay_ended(&self.endpoint_id, true);
                        None
                    }
                    ReplayEnd::Stopped => return,
                    // Restarted again while recovering from a restart: give up.
                    ReplayEnd::Restarted => Some(ReplayFailure::Unusable { seq: 0 }),
                    ReplayEnd::Failed(reason) => Some(reason),
                }
            }
        };
        if let Some(reason) = failure {
            if reason != ReplayFailure::Unavailable {
                bump(&self.counters.replay_failures);
                self.sink.replay_ended(&self.endpoint_id, false);
            }
            self.notify(SubscriberEvent::ReplayFailed { expected, reason });
            self.resync(expected, held);
        }
        if let Some(StreamVerdict::Gap { expected, got }) = self.apply(batch) {
            // The stream moved under us (e.g. another resync): accept the batch as a fresh start.
            self.resync(expected, got);
            self.apply(batch);
        }
    }

    fn resync(&self, expected: u64, got: u64) {
        match self.sink.resync(&self.endpoint_id, (self.clock)()) {
            Ok(()) => {
                self.last_seq.set(None);
                bump(&self.counters.resyncs);
                self.notify(SubscriberEvent::Resync { expected, got });
            }
            Err(error) => {
                bump(&self.counters.router_errors);
                self.notify(SubscriberEvent::Router { seq: got, error });
            }
        }
    }

    /// Ask `ep` for the batches from `expected - 1` (the last applied; from 0 when `expected` is
    /// 0) on and apply them up to (not including) `held`.
    fn replay(&self, ep: &str, expected: u64, held: u64) -> ReplayEnd {
        let from = expected.saturating_sub(1);
        let sock_err = |op| move |error| ReplayEnd::Failed(ReplayFailure::Socket { op, error });
        // A fresh DEALER per replay: an answer to an earlier, abandoned request cannot reach
        // this one (closing with linger 0 discards whatever is still queued).
        let dealer = match self.ctx.socket(zmq::DEALER) {
            Ok(s) => s,
            Err(e) => return sock_err("socket")(e),
        };
        let setup = (|| {
            dealer.set_linger(0).map_err(sock_err("setsockopt"))?;
            if wants_ipv6(ep) {
                dealer.set_ipv6(true).map_err(sock_err("setsockopt"))?;
            }
            dealer.connect(ep).map_err(sock_err("connect"))?;
            let start = from.to_be_bytes();
            dealer.send_multipart([&[][..], &start[..]], zmq::DONTWAIT).map_err(sock_err("send"))
        })();
        if let Err(end) = setup {
            return end;
        }
        let timeout = Duration::from_millis(self.cfg.replay_timeout_ms);
        let deadline = Instant::now() + timeout;
        let mut next = from;
        let mut received = 0u64;
        loop {
            if self.stopping() {
                return ReplayEnd::Stopped;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return ReplayEnd::Failed(ReplayFailure::Timeout { timeout_ms: self.cfg.replay_timeout_ms, received });
            }
            match dealer.poll(zmq::POLLIN, self.poll_ms(Some(left))) {
                Ok(0) | Err(zmq::Error::EINTR) => continue,
                Ok(_) => {}
                Err(e) => return sock_err("poll")(e),
            }
            let frames = match dealer.recv_multipart(zmq::DONTWAIT) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => continue,
                Err(e) => return sock_err("recv")(e),
            };
            let (topic, seq, payload) = match parse_replay(&frames) {
                Ok(ReplayMsg::End) => {
                    return ReplayEnd::Failed(ReplayFailure::Incomplete { missing: next });
                }
                Ok(ReplayMsg::Batch { topic, seq, payload }) => {
                    if topic.is_some_and(|t| !t.starts_with(self.cfg.topic.as_bytes())) {
                        continue;
                    }
                    (topic, seq, payload)
                }
                Err(reason) => return ReplayEnd::Failed(ReplayFailure::BadReply { reason }),
            };
            received += 1;
            if seq < next {
                continue;
            }
            if seq > next {
                let failure = if next == from && from < expected && seq == expected {
                    ReplayFailure::Unproven { seq: from }
                } else if next == from {
                    ReplayFailure::TooOld { expected, first: seq }
                } else {
                    ReplayFailure::Incomplete { missing: next }
                };
                return ReplayEnd::Failed(failure);
            }
            let decoded = Decoded::new();
            match self.apply(Received { topic, seq, payload, origin: BatchOrigin::Replay, decoded: &decoded }) {
                Some(StreamVerdict::Applied | StreamVerdict::Reset) => bump(&self.counters.replayed_batches),
                Some(StreamVerdict::Duplicate) => {}
                // The overlap revealed a restarted publisher (the sink cleared the endpoint).
                Some(StreamVerdict::Gap { expected: 0, .. }) if expected > 0 => return ReplayEnd::Restarted,
                Some(StreamVerdict::Gap { .. }) | None => {
                    return ReplayEnd::Failed(ReplayFailure::Unusable { seq });
                }
            }
            next = seq + 1;
            if next >= held {
                return ReplayEnd::Done;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_mode_binds_on_wildcards_only() {
        let auto = |e| SocketMode::Auto.binds(e);
        assert!(auto("tcp://*:5557"));
        assert!(auto("tcp://127.0.0.1:*"));
        assert!(auto("tcp://[::]:5557"));
        assert!(!auto("tcp://10.0.0.7:5557"));
        assert!(!auto("tcp://[::1]:5557"));
        assert!(!auto("tcp://[fd00::7]:5557"));
        assert!(!auto("ipc:///tmp/kv.sock"));
        assert!(SocketMode::Bind.binds("tcp://10.0.0.7:5557"));
        assert!(!SocketMode::Connect.binds("tcp://*:5557"));
    }

    #[test]
    fn config_validation_and_serde_defaults() {
        let cfg: SubscriberConfig = serde_json::from_str(r#"{"endpoint":"tcp://10.0.0.7:5557"}"#).unwrap();
        assert_eq!(cfg, SubscriberConfig::new("tcp://10.0.0.7:5557"));
        assert!(cfg.validate().is_ok());
        assert!(serde_json::from_str::<SubscriberConfig>(r#"{"endpoint":"tcp://a:1","nope":1}"#).is_err());
        let bad = |f: fn(&mut SubscriberConfig)| {
            let mut c = SubscriberConfig::new("tcp://10.0.0.7:5557");
            f(&mut c);
            c.validate().unwrap_err()
        };
        assert!(matches!(
            bad(|c| c.endpoint = "10.0.0.7:5557".into()),
            SubscribeError::InvalidConfig { field: "endpoint", .. }
        ));
        assert!(matches!(
            bad(|c| c.replay_endpoint = Some("x".into())),
            SubscribeError::InvalidConfig { field: "replay_endpoint", .. }
        ));
        assert!(matches!(
            bad(|c| c.poll_interval_ms = 0),
            SubscribeError::InvalidConfig { field: "poll_interval_ms", .. }
        ));
        assert!(matches!(
            bad(|c| c.replay_timeout_ms = 0),
            SubscribeError::InvalidConfig { field: "replay_timeout_ms", .. }
        ));
    }

    #[test]
    fn replay_replies_in_both_formats() {
        let seq = |n: u64| n.to_be_bytes().to_vec();
        let new = vec![vec![], b"kv".to_vec(), seq(7), vec![0x93]];
        assert!(matches!(parse_replay(&new), Ok(ReplayMsg::Batch { topic: Some(b"kv"), seq: 7, payload: [0x93] })));
        let old = vec![vec![], seq(7), vec![0x93]];
        assert!(matches!(parse_replay(&old), Ok(ReplayMsg::Batch { topic: None, seq: 7, .. })));
        assert!(matches!(parse_replay(&[vec![], vec![], seq(END_SEQ), vec![]]), Ok(ReplayMsg::End)));
        assert!(matches!(parse_replay(&[vec![], seq(END_SEQ), vec![]]), Ok(ReplayMsg::End)));
        assert!(parse_replay(&[vec![], vec![1, 2], vec![0x93]]).is_err());
        assert!(parse_replay(&[vec![1], seq(1), vec![0x93]]).is_err());
        assert!(parse_replay(&[seq(1)]).is_err());
    }
}
