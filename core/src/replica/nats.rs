//! The NATS transport for router replicas (feature `nats`): one background thread, a
//! current-thread tokio runtime, an `async-nats` client. It publishes this router's batches and
//! applies the other replicas' batches; the routing path never waits on it.
//!
//! Subjects: `kvroute.<fleet>.fx.<replica>` (one per replica). With a JetStream stream (the
//! default) the batches are also retained (bounded by age and bytes), so a replica that starts
//! late or restarts replays what the fleet did within the retention before it reaches the live
//! edge, and one that lost its connection resumes where it stopped.
#![allow(clippy::disallowed_methods, clippy::disallowed_types)] // the I/O module: a thread and a clock

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use async_nats::jetstream;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

use super::{validate_id, ReplicaConfig, ReplicaError, ReplicaStats};
use crate::clock::unix_time_ms;
use crate::router::Router;

/// What the transport replicates: a [`Router`] (the usual case), or anything else that produces
/// this replica's batches and consumes the others' (the Envoy relay: batches of the filter's
/// shared log out, the other replicas' batches posted to the filter's ingestion path).
pub trait ReplicaPort: Send + Sync + 'static {
    /// The next batch to publish (see [`Router::take_replica_batch`]).
    fn take_batch(&self, now_ms: u64, heartbeat: bool) -> Option<Vec<u8>>;
    /// Another replica's batch arrived (see [`Router::apply_replica_bytes`]).
    fn apply(&self, batch: &[u8], now_ms: u64);
    /// A timer tick (drop silent replicas' requests: [`Router::expire_silent_replicas`]).
    fn tick(&self, _now_ms: u64) {}
    /// Replication counters to report with the transport's.
    fn replica_stats(&self) -> Option<ReplicaStats> {
        None
    }
    /// The transport stopped.
    fn stopped(&self) {}
}

impl ReplicaPort for Router {
    fn take_batch(&self, now_ms: u64, heartbeat: bool) -> Option<Vec<u8>> {
        self.take_replica_batch(now_ms, heartbeat)
    }
    fn apply(&self, batch: &[u8], now_ms: u64) {
        // Malformed and refused batches are counted by the router.
        let _ = self.apply_replica_bytes(batch, now_ms);
    }
    fn tick(&self, now_ms: u64) {
        self.expire_silent_replicas(now_ms);
    }
    fn replica_stats(&self) -> Option<ReplicaStats> {
        Router::replica_stats(self)
    }
    fn stopped(&self) {
        self.disable_replication();
    }
}

/// The JetStream stream that retains the fleet's batches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamOptions {
    /// Stream name (default `KVROUTE_<fleet>`).
    pub name: Option<String>,
    /// Batches older than this are discarded (seconds; default 600, the default
    /// `limits.inflight_timeout_ms`).
    pub max_age_s: u64,
    /// The stream's size bound (bytes; the oldest batches go first).
    pub max_bytes: i64,
    /// On start, replay what the stream retains (the fleet's recent state) before the live
    /// batches; `false`: live batches only.
    pub replay: bool,
    /// File storage (`true`, survives a server restart) or memory.
    pub file_storage: bool,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions { name: None, max_age_s: 600, max_bytes: 256 << 20, replay: true, file_storage: true }
    }
}

/// How a router joins its fleet over NATS (see [`Replicator::start`]). Deserializable from JSON
/// (the Python and C bindings take this document).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsReplicaOptions {
    /// Server URL(s), comma-separated (`nats://127.0.0.1:4222`, `tls://…`).
    pub url: String,
    /// The fleet.
    pub fleet: String,
    /// This replica's id, unique in the fleet.
    pub replica_id: String,
    /// This incarnation (default: the start time in ms, so a restart is always newer).
    pub epoch: Option<u64>,
    /// Replicas whose batches are applied (empty: any of the fleet).
    pub allowed_replicas: Vec<String>,
    /// Token authentication.
    pub token: Option<String>,
    /// User and password authentication.
    pub user: Option<String>,
    /// Password for `user`.
    pub password: Option<String>,
    /// NKey authentication: the seed (`SU…`).
    pub nkey_seed: Option<String>,
    /// Refuse a connection without TLS.
    pub tls_required: bool,
    /// CA certificates (PEM) to verify the server with.
    pub tls_ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS, with `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// Client key (PEM).
    pub tls_key_file: Option<PathBuf>,
    /// The JetStream stream (`null`: core NATS only, live batches, no replay).
    pub stream: Option<StreamOptions>,
    /// How often the outbox is drained (ms).
    pub flush_interval_ms: u64,
    /// An empty batch is published after this long without one (ms).
    pub heartbeat_interval_ms: u64,
    /// A replica silent this long is gone: its requests in flight here are dropped (ms).
    pub peer_silence_ms: u64,
    /// Outbox bound (entries).
    pub max_outbox_entries: usize,
    /// Entries per batch, at most.
    pub max_batch_entries: usize,
    /// Bytes per batch, at most.
    pub max_batch_bytes: usize,
    /// First connection attempt timeout (ms); the client keeps retrying in the background.
    pub connect_timeout_ms: u64,
    /// Longest wait between reconnection attempts (ms).
    pub max_reconnect_delay_ms: u64,
}

impl Default for NatsReplicaOptions {
    fn default() -> Self {
        let r = ReplicaConfig::default();
        NatsReplicaOptions {
            url: "nats://127.0.0.1:4222".into(),
            fleet: r.fleet,
            replica_id: String::new(),
            epoch: None,
            allowed_replicas: Vec::new(),
            token: None,
            user: None,
            password: None,
            nkey_seed: None,
            tls_required: false,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            stream: Some(StreamOptions::default()),
            flush_interval_ms: 2,
            heartbeat_interval_ms: 1000,
            peer_silence_ms: r.peer_silence_ms,
            max_outbox_entries: r.max_outbox_entries,
            max_batch_entries: r.max_batch_entries,
            max_batch_bytes: r.max_batch_bytes,
            connect_timeout_ms: 2000,
            max_reconnect_delay_ms: 1000,
        }
    }
}

impl NatsReplicaOptions {
    /// Options from a JSON document (unknown fields are errors).
    pub fn from_json(json: &str) -> Result<NatsReplicaOptions, ReplicaError> {
        serde_json::from_str(json).map_err(|e| ReplicaError::Config { field: "options", reason: e.to_string() })
    }

    /// The replication settings these options give a router, incarnation `epoch`.
    pub fn replica_config(&self, epoch: u64) -> ReplicaConfig {
        ReplicaConfig {
            fleet: self.fleet.clone(),
            replica_id: self.replica_id.clone(),
            epoch,
            allowed_replicas: self.allowed_replicas.clone(),
            max_outbox_entries: self.max_outbox_entries,
            max_batch_entries: self.max_batch_entries,
            max_batch_bytes: self.max_batch_bytes,
            peer_silence_ms: self.peer_silence_ms,
            ..ReplicaConfig::default()
        }
    }

    /// Check everything that can be checked before connecting.
    pub fn validate(&self) -> Result<(), ReplicaError> {
        self.replica_config(self.epoch.unwrap_or(1)).validate()?;
        if self.url.trim().is_empty() {
            return Err(ReplicaError::Config { field: "url", reason: "empty".into() });
        }
        for (field, v) in [
            ("flush_interval_ms", self.flush_interval_ms),
            ("heartbeat_interval_ms", self.heartbeat_interval_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("max_reconnect_delay_ms", self.max_reconnect_delay_ms),
        ] {
            if v == 0 {
                return Err(ReplicaError::Config { field, reason: "must be > 0".into() });
            }
        }
        if self.password.is_some() && self.user.is_none() {
            return Err(ReplicaError::Config { field: "password", reason: "needs user".into() });
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return Err(ReplicaError::Config {
                field: "tls_cert_file",
                reason: "needs tls_key_file (and back)".into(),
            });
        }
        if let Some(s) = &self.stream {
            if let Some(n) = &s.name {
                validate_id("stream.name", n)?;
            }
            if s.max_age_s == 0 || s.max_bytes <= 0 {
                return Err(ReplicaError::Config {
                    field: "stream",
                    reason: "max_age_s and max_bytes must be > 0".into(),
                });
            }
        }
        Ok(())
    }

    /// The subject this replica publishes on.
    pub fn subject(&self) -> String {
        format!("kvroute.{}.fx.{}", self.fleet, self.replica_id)
    }

    fn stream_name(&self) -> String {
        self.stream.as_ref().and_then(|s| s.name.clone()).unwrap_or_else(|| format!("KVROUTE_{}", self.fleet))
    }
}

/// The transport's counters (plus the router's [`ReplicaStats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReplicatorStats {
    /// Connected to a server now.
    pub connected: bool,
    /// Connections made (the first and every reconnection).
    pub connects: u64,
    /// Connections lost.
    pub disconnects: u64,
    /// Batches handed to the client.
    pub published: u64,
    /// Bytes handed to the client.
    pub published_bytes: u64,
    /// Batches that could not be handed over (the client's buffer full while disconnected; the
    /// batch is lost and the others count a gap).
    pub publish_errors: u64,
    /// Messages received.
    pub received: u64,
    /// Bytes received.
    pub received_bytes: u64,
    /// The stream is set up and its consumer running (or no stream is configured and the
    /// subscription is).
    pub inbound_ready: bool,
    /// Times the inbound side (stream, consumer or subscription) had to be set up again.
    pub inbound_restarts: u64,
    /// Batches dropped because they name another replica than their subject does.
    pub spoofed: u64,
    /// Server-reported errors (authorization among them) and client errors.
    pub server_errors: u64,
    /// The last error seen, if any.
    pub last_error: Option<String>,
    /// The router's replication counters.
    pub replica: ReplicaStats,
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    connected: AtomicBool,
    connects: AtomicU64,
    disconnects: AtomicU64,
    published: AtomicU64,
    published_bytes: AtomicU64,
    publish_errors: AtomicU64,
    received: AtomicU64,
    received_bytes: AtomicU64,
    inbound_ready: AtomicBool,
    inbound_restarts: AtomicU64,
    spoofed: AtomicU64,
    server_errors: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl Shared {
    fn error(&self, e: impl std::fmt::Display) {
        if let Ok(mut g) = self.last_error.lock() {
            *g = Some(e.to_string());
        }
    }
}

/// A router's membership in its fleet over NATS: a background thread that publishes the router's
/// replica batches and applies the other replicas'. Stopped by [`Replicator::stop`] or on drop.
///
/// The bus failing never stops routing: the router keeps deciding on its own state, its outbox is
/// bounded (the oldest entries go first), the client reconnects by itself, and with a stream the
/// inbound side resumes from where it stopped.
pub struct Replicator {
    port: Arc<dyn ReplicaPort>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    wake: Arc<tokio::sync::Notify>,
}

impl std::fmt::Debug for Replicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replicator").field("running", &self.thread.is_some()).finish_non_exhaustive()
    }
}

impl Replicator {
    /// Enable replication on `router` and start the transport thread. Errors are bad options, a
    /// router that replicates already (`AlreadyEnabled`) or a runtime that cannot start; an
    /// unreachable server is not an error (the client keeps trying, see
    /// [`ReplicatorStats::connected`]).
    pub fn start(router: Arc<Router>, opts: NatsReplicaOptions) -> Result<Replicator, ReplicaError> {
        opts.validate()?;
        let epoch = opts.epoch.unwrap_or_else(|| unix_time_ms().max(1));
        // Two transports would drain one outbox: refuse a second one (checked and enabled under
        // one lock, so two concurrent starts cannot both pass).
        let cfg = opts.replica_config(epoch);
        router.with_core(|c| match c.replica_config() {
            Some(on) => Err(ReplicaError::AlreadyEnabled { replica_id: on.replica_id.clone() }),
            None => c.enable_replication(cfg),
        })?;
        Replicator::start_port(router.clone(), opts).inspect_err(|_| router.disable_replication())
    }

    /// Start the transport for any [`ReplicaPort`] (`opts.epoch` and the ids are the port's
    /// business: only the URL, credentials, subjects, stream and timers are used here).
    pub fn start_port(port: Arc<dyn ReplicaPort>, opts: NatsReplicaOptions) -> Result<Replicator, ReplicaError> {
        opts.validate()?;
        let connect = connect_options(&opts)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ReplicaError::Transport(format!("runtime: {e}")))?;
        let shared = Arc::new(Shared::default());
        let wake = Arc::new(tokio::sync::Notify::new());
        let (r, s, w) = (port.clone(), shared.clone(), wake.clone());
        let thread = std::thread::Builder::new()
            .name(format!("kvroute-replica-{}", opts.replica_id))
            .spawn(move || rt.block_on(run(r, opts, connect, s, w)))
            .map_err(|e| ReplicaError::Transport(format!("thread: {e}")))?;
        Ok(Replicator { port, shared, thread: Some(thread), wake })
    }

    /// The transport's and the router's replication counters.
    pub fn stats(&self) -> ReplicatorStats {
        let s = &self.shared;
        ReplicatorStats {
            connected: s.connected.load(Ordering::Relaxed),
            connects: s.connects.load(Ordering::Relaxed),
            disconnects: s.disconnects.load(Ordering::Relaxed),
            published: s.published.load(Ordering::Relaxed),
            published_bytes: s.published_bytes.load(Ordering::Relaxed),
            publish_errors: s.publish_errors.load(Ordering::Relaxed),
            received: s.received.load(Ordering::Relaxed),
            received_bytes: s.received_bytes.load(Ordering::Relaxed),
            inbound_ready: s.inbound_ready.load(Ordering::Relaxed),
            inbound_restarts: s.inbound_restarts.load(Ordering::Relaxed),
            spoofed: s.spoofed.load(Ordering::Relaxed),
            server_errors: s.server_errors.load(Ordering::Relaxed),
            last_error: s.last_error.lock().ok().and_then(|g| g.clone()),
            replica: self.port.replica_stats().unwrap_or_default(),
        }
    }

    /// Publish what waits now instead of at the next flush tick.
    pub fn flush(&self) {
        self.wake.notify_one();
    }

    /// Publish what waits (bounded: at most a second), stop the thread and turn replication off on
    /// the router. Returns the counters at the end (the final flush included).
    pub fn stop(mut self) -> ReplicatorStats {
        self.shutdown().unwrap_or_default()
    }

    fn shutdown(&mut self) -> Option<ReplicatorStats> {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.wake.notify_one();
        let t = self.thread.take()?;
        let _ = t.join();
        let mut s = self.stats();
        s.connected = false;
        s.inbound_ready = false;
        self.port.stopped();
        Some(s)
    }
}

impl Drop for Replicator {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

fn connect_options(opts: &NatsReplicaOptions) -> Result<async_nats::ConnectOptions, ReplicaError> {
    let mut c = async_nats::ConnectOptions::new()
        .name(format!("kvroute-{}-{}", opts.fleet, opts.replica_id))
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_millis(opts.connect_timeout_ms))
        .ping_interval(Duration::from_secs(5))
        .client_capacity(4096);
    let max_delay = opts.max_reconnect_delay_ms;
    c = c.reconnect_delay_callback(move |attempt| {
        let ms = 50u64.saturating_mul(1u64 << attempt.min(10) as u32).min(max_delay);
        Duration::from_millis(ms)
    });
    if let Some(t) = &opts.token {
        c = c.token(t.clone());
    }
    if let Some(u) = &opts.user {
        c = c.user_and_password(u.clone(), opts.password.clone().unwrap_or_default());
    }
    if let Some(seed) = &opts.nkey_seed {
        c = c.nkey(seed.clone());
    }
    if opts.tls_required {
        c = c.require_tls(true);
    }
    if let Some(ca) = &opts.tls_ca_file {
        c = c.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&opts.tls_cert_file, &opts.tls_key_file) {
        c = c.add_client_certificate(cert.clone(), key.clone());
    }
    Ok(c)
}

/// Payloads with their stream sequence (0 without a stream).
/// One received batch: its payload, its stream sequence (0 without a stream) and the replica its
/// subject names.
struct Received {
    payload: bytes::Bytes,
    stream_seq: u64,
    subject: async_nats::Subject,
}

type Inbound = std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<Received, String>> + Send>>;

async fn run(
    router: Arc<dyn ReplicaPort>,
    opts: NatsReplicaOptions,
    connect: async_nats::ConnectOptions,
    shared: Arc<Shared>,
    wake: Arc<tokio::sync::Notify>,
) {
    let ev = shared.clone();
    let connect = connect.event_callback(move |e| {
        let s = ev.clone();
        async move {
            match e {
                async_nats::Event::Connected => {
                    s.connected.store(true, Ordering::Relaxed);
                    s.connects.fetch_add(1, Ordering::Relaxed);
                }
                async_nats::Event::Disconnected => {
                    s.connected.store(false, Ordering::Relaxed);
                    s.disconnects.fetch_add(1, Ordering::Relaxed);
                }
                async_nats::Event::ServerError(err) => {
                    s.server_errors.fetch_add(1, Ordering::Relaxed);
                    s.error(format!("server: {err}"));
                }
                async_nats::Event::ClientError(err) => {
                    s.server_errors.fetch_add(1, Ordering::Relaxed);
                    s.error(format!("client: {err}"));
                }
                _ => {}
            }
        }
    });
    let client = match connect.connect(opts.url.as_str()).await {
        Ok(c) => c,
        Err(e) => {
            shared.error(format!("connect: {e}"));
            return;
        }
    };
    let subject = opts.subject();
    let mut inbound: Option<Inbound> = None;
    let mut next_inbound_try = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(opts.flush_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let heartbeat = opts.heartbeat_interval_ms;
    let mut last_sent = 0u64;
    // The last stream sequence applied: a consumer set up again resumes after it.
    let mut last_stream_seq = 0u64;
    let mut seen_connects = 0u64;
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            break;
        }
        // After a reconnection the consumer is set up again at once (from the last stream
        // sequence applied) rather than after it notices its missed heartbeats.
        let connects = shared.connects.load(Ordering::Relaxed);
        if connects != seen_connects {
            if seen_connects > 0 && inbound.is_some() {
                inbound = None;
                shared.inbound_ready.store(false, Ordering::Relaxed);
                shared.inbound_restarts.fetch_add(1, Ordering::Relaxed);
                next_inbound_try = tokio::time::Instant::now();
            }
            seen_connects = connects;
        }
        if inbound.is_none() && tokio::time::Instant::now() >= next_inbound_try {
            match open_inbound(&client, &opts, last_stream_seq).await {
                Ok(s) => {
                    inbound = Some(s);
                    shared.inbound_ready.store(true, Ordering::Relaxed);
                }
                Err(e) => {
                    shared.error(format!("inbound: {e}"));
                    next_inbound_try = tokio::time::Instant::now() + Duration::from_millis(250);
                }
            }
        }
        tokio::select! {
            _ = tick.tick() => {}
            _ = wake.notified() => {}
            m = next(&mut inbound) => match m {
                Some(Ok(m)) => {
                    last_stream_seq = last_stream_seq.max(m.stream_seq);
                    shared.received.fetch_add(1, Ordering::Relaxed);
                    shared.received_bytes.fetch_add(m.payload.len() as u64, Ordering::Relaxed);
                    // A batch must name the replica its subject names: with per-user publish
                    // permissions on `kvroute.<fleet>.fx.<replica>`, no replica can speak for
                    // another.
                    if batch_replica(&m.payload).is_some_and(|r| !m.subject.ends_with(&format!(".{r}"))) {
                        shared.spoofed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    router.apply(&m.payload, unix_time_ms());
                    continue;
                }
                Some(Err(e)) => {
                    shared.error(format!("inbound: {e}"));
                    continue;
                }
                None => {
                    inbound = None;
                    shared.inbound_ready.store(false, Ordering::Relaxed);
                    shared.inbound_restarts.fetch_add(1, Ordering::Relaxed);
                    next_inbound_try = tokio::time::Instant::now() + Duration::from_millis(250);
                    continue;
                }
            },
        }
        let now = unix_time_ms();
        // With a stream, nothing is published before this replica has opened it: a batch sent
        // while the stream does not exist yet (a fresh server whose JetStream is still starting,
        // where every replica's first attempt fails) would be stored nowhere, and a replica
        // that joins later could never replay it. The outbox keeps the batches meanwhile.
        if opts.stream.is_none() || inbound.is_some() {
            publish_pending(
                &*router,
                &client,
                &subject,
                &shared,
                now,
                now.saturating_sub(last_sent) >= heartbeat,
                &mut last_sent,
            )
            .await;
        }
        router.tick(now);
    }
    // Hand over what waits and flush, bounded.
    let now = unix_time_ms();
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        publish_pending(&*router, &client, &subject, &shared, now, false, &mut last_sent).await;
        let _ = client.flush().await;
    })
    .await;
}

/// The replica id a batch names (`None` if the bytes are too short to say: the router then
/// counts the batch malformed).
fn batch_replica(b: &[u8]) -> Option<&str> {
    if b.len() < 6 || &b[..4] != super::BATCH_MAGIC {
        return None;
    }
    let fleet = usize::from(b[5]);
    let at = 6 + fleet;
    let n = usize::from(*b.get(at)?);
    std::str::from_utf8(b.get(at + 1..at + 1 + n)?).ok()
}

async fn next(inbound: &mut Option<Inbound>) -> Option<Result<Received, String>> {
    match inbound {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

async fn publish_pending(
    router: &dyn ReplicaPort,
    client: &async_nats::Client,
    subject: &str,
    shared: &Shared,
    now: u64,
    heartbeat: bool,
    last_sent: &mut u64,
) {
    let mut hb = heartbeat;
    while let Some(batch) = router.take_batch(now, hb) {
        hb = false;
        let n = batch.len() as u64;
        // `publish` waits only for room in the client's buffer; while disconnected that buffer
        // fills, and a batch that finds no room within the flush budget is lost (a gap for the
        // others) rather than holding up the outbox.
        match tokio::time::timeout(Duration::from_millis(100), client.publish(subject.to_owned(), batch.into())).await {
            Ok(Ok(())) => {
                shared.published.fetch_add(1, Ordering::Relaxed);
                shared.published_bytes.fetch_add(n, Ordering::Relaxed);
                *last_sent = now;
            }
            Ok(Err(e)) => {
                shared.publish_errors.fetch_add(1, Ordering::Relaxed);
                shared.error(format!("publish: {e}"));
            }
            Err(_) => {
                shared.publish_errors.fetch_add(1, Ordering::Relaxed);
                shared.error("publish: client buffer full (disconnected?)");
                break;
            }
        }
    }
}

async fn open_inbound(client: &async_nats::Client, opts: &NatsReplicaOptions, after: u64) -> Result<Inbound, String> {
    let filter = format!("kvroute.{}.fx.*", opts.fleet);
    let Some(so) = &opts.stream else {
        let sub = client.subscribe(filter).await.map_err(|e| e.to_string())?;
        return Ok(Box::pin(sub.map(|m| Ok(Received { payload: m.payload, stream_seq: 0, subject: m.subject }))));
    };
    let js = jetstream::new(client.clone());
    let stream = js
        .get_or_create_stream(jetstream::stream::Config {
            name: opts.stream_name(),
            subjects: vec![format!("kvroute.{}.fx.>", opts.fleet)],
            max_age: Duration::from_secs(so.max_age_s),
            max_bytes: so.max_bytes,
            storage: if so.file_storage {
                jetstream::stream::StorageType::File
            } else {
                jetstream::stream::StorageType::Memory
            },
            ..Default::default()
        })
        .await
        .map_err(|e| format!("stream: {e}"))?;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            filter_subject: filter,
            deliver_policy: if after > 0 {
                jetstream::consumer::DeliverPolicy::ByStartSequence { start_sequence: after + 1 }
            } else if so.replay {
                jetstream::consumer::DeliverPolicy::All
            } else {
                jetstream::consumer::DeliverPolicy::New
            },
            ..Default::default()
        })
        .await
        .map_err(|e| format!("consumer: {e}"))?;
    let msgs = consumer.messages().await.map_err(|e| format!("messages: {e}"))?;
    Ok(Box::pin(msgs.map(|m| {
        let m = m.map_err(|e| e.to_string())?;
        let seq = m.info().map(|i| i.stream_sequence).unwrap_or(0);
        let m = m.message;
        Ok(Received { payload: m.payload, stream_seq: seq, subject: m.subject })
    })))
}
