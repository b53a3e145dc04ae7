//! # kvroute-worker
//!
//! A reference model server that behaves like vLLM wherever routing cares, without a real LLM:
//!
//! - OpenAI-compatible `POST /v1/completions` and `/v1/chat/completions` (JSON or server-sent
//!   events), `GET /metrics` with vLLM's metric names, `GET /health` ([`server`](crate#http)).
//! - A continuous-batching scheduler (waiting queue, `max_running`, a token budget per step,
//!   chunked prefill, preemption) over a paged KV block pool with prefix caching: blocks are
//!   named by vLLM's own block hashes ([`kvroute::EngineHasher`], `sha256_cbor` by default),
//!   reference-counted, and evicted least-recently-used when the pool is full.
//! - KV events on a ZMQ socket exactly as vLLM publishes them (`[topic, seq, msgpack batch]`,
//!   map or array encoding, `BlockStored` / `BlockRemoved` / `AllBlocksCleared`) with vLLM's
//!   replay `ROUTER` socket ([`events`]).
//! - A small deterministic transformer-like model with real arithmetic ([`model`]): prefill
//!   writes K/V of uncached blocks into the pool, decoding attends over it; a CPU backend and a
//!   CUDA backend (cargo feature `cuda`).
//! - Prefill/decode disaggregation: a decode worker given `x-prefiller-host-port` has that
//!   prefill worker compute the prompt and receives its KV blocks over TCP, by post-prefill pull
//!   or layer-by-layer push ([`transfer`]); [`transfer_check`] measures such transfers against
//!   kvroute's transfer-tax model.
//! - [`demo`]: N workers on loopback, a multi-turn agent workload routed through round-robin,
//!   least-loaded and kvroute (approx and precise, fed by the workers' real KV events).
//!
//! The worker makes no routing decision: it is what kvroute routes to.
//!
//! ```
//! use kvroute_worker::{spawn, ModelConfig, WorkerConfig};
//!
//! let cfg = WorkerConfig { model: ModelConfig::tiny(), num_blocks: 64, ..WorkerConfig::ephemeral() };
//! let worker = spawn(cfg)?;
//! println!("{}", worker.ready_line()); // kvroute-worker ready http=127.0.0.1:… events=tcp://127.0.0.1:… …
//! assert_eq!(worker.counters().requests_submitted, 0);
//! worker.shutdown();
//! # Ok::<(), kvroute_worker::WorkerError>(())
//! ```
//!
//! # HTTP
//! See the `server` module's table of routes; errors are OpenAI-shaped
//! (`{"error": {"message", "type", "param", "code"}}`, [`openai::ApiError`]).

mod block_pool;
pub mod config;
pub mod demo;
mod engine;
pub mod events;
pub mod metrics;
pub mod model;
pub mod openai;
mod publisher;
mod server;
pub mod tokenizer;
pub mod transfer;
pub mod transfer_check;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvroute::{BlockExtras, EngineHasher, ExtraKeysForm, NoneHashSeed};

pub use config::{
    BackendKind, BindMode, ConfigError, EventEncoding, KvEventsConfig, ModelConfig, Role, TransferMode, WorkerConfig,
};
pub use metrics::WorkerCounters;
pub use model::BackendError;
pub use publisher::PublisherError;
pub use server::PREFILLER_HEADER;
pub use transfer::TransferReport;

use engine::{Command, Engine, EngineParams};
use metrics::Shared;
use publisher::{Publisher, PublisherStats};

/// Why a worker could not start, or a query failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// A configuration value is out of range.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The block hashing cannot be set up.
    #[error("block hashing: {0}")]
    Hash(#[from] kvroute::EngineHashError),
    /// The compute backend could not start.
    #[error("backend: {0}")]
    Backend(#[from] BackendError),
    /// The KV-event publisher could not start.
    #[error(transparent)]
    Events(#[from] PublisherError),
    /// A listener could not be bound.
    #[error("cannot bind the {what} listener on {addr}: {source}")]
    Bind {
        /// `http` or `kv-transfer`.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A thread or the async runtime could not start.
    #[error("cannot start the worker's {what}: {source}")]
    Start {
        /// What.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The engine thread is gone.
    #[error("the worker's engine has stopped")]
    EngineStopped,
    /// The engine did not answer in time.
    #[error("the worker's engine did not answer within {0:?}")]
    Timeout(Duration),
}

/// How long a query to the engine may take.
const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

/// A running worker: its addresses, counters and in-process queries. Dropping it (or
/// [`WorkerHandle::shutdown`]) stops the HTTP server, aborts requests in flight, publishes the
/// events still queued and joins every thread.
pub struct WorkerHandle {
    cfg: WorkerConfig,
    http_addr: SocketAddr,
    kv_addr: SocketAddr,
    events_endpoint: Option<String>,
    replay_endpoint: Option<String>,
    backend: &'static str,
    shared: Arc<Shared>,
    engine: mpsc::Sender<Command>,
    hasher: EngineHasher,
    publisher: Option<Publisher>,
    publisher_stats: Option<Arc<PublisherStats>>,
    engine_thread: Option<JoinHandle<()>>,
    rt_thread: Option<JoinHandle<()>>,
    stop_http: Option<tokio::sync::oneshot::Sender<()>>,
}

impl std::fmt::Debug for WorkerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerHandle").field("ready", &self.ready_line()).finish_non_exhaustive()
    }
}

/// A random 64-bit value (ids, vLLM's random `NONE_HASH` seed for xxhash without a seed).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// The block hasher of a configuration (vLLM ≥ 0.31 extra-key form).
fn hasher_of(cfg: &WorkerConfig) -> Result<EngineHasher, kvroute::EngineHashError> {
    let seed = match (&cfg.python_hash_seed, cfg.hash_algo.is_cryptographic()) {
        (Some(s), _) => NoneHashSeed::PythonHashSeed(s.clone()),
        (None, true) => NoneHashSeed::Default,
        // vLLM draws a random NONE_HASH per process for xxhash without PYTHONHASHSEED.
        (None, false) => NoneHashSeed::PythonHashSeed(format!("{:016x}{:016x}", random_u64(), random_u64())),
    };
    EngineHasher::new(cfg.hash_algo, ExtraKeysForm::Tagged, seed, cfg.block_size)
}

/// Start a worker: bind its listeners and sockets (port 0 and `tcp://host:*` pick free ports),
/// start the engine, the event publisher and the HTTP server. Returns once everything listens.
pub fn spawn(cfg: WorkerConfig) -> Result<WorkerHandle, WorkerError> {
    cfg.validate()?;
    let hasher = hasher_of(&cfg)?;
    let shared = Arc::new(Shared::default());

    let publisher = match &cfg.kv_events.endpoint {
        Some(ep) => Some(Publisher::start(&cfg.kv_events, ep)?),
        None => None,
    };
    let bind = |what: &'static str, addr: SocketAddr| {
        let l = std::net::TcpListener::bind(addr).map_err(|source| WorkerError::Bind { what, addr, source })?;
        l.set_nonblocking(true).map_err(|source| WorkerError::Bind { what, addr, source })?;
        Ok::<_, WorkerError>(l)
    };
    let http = bind("http", cfg.listen)?;
    let kv = bind("kv-transfer", cfg.kv_transfer_listen)?;
    let local = |l: &std::net::TcpListener, what, addr| {
        l.local_addr().map_err(|source| WorkerError::Bind { what, addr, source })
    };
    let http_addr = local(&http, "http", cfg.listen)?;
    let kv_addr = local(&kv, "kv-transfer", cfg.kv_transfer_listen)?;

    // Engine thread (the backend is built on it: a CUDA context stays on one thread).
    let (etx, erx) = mpsc::channel::<Command>();
    let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<&'static str, BackendError>>(1);
    let params = EngineParams {
        block_size: cfg.block_size as usize,
        max_running: cfg.max_running,
        max_batched_tokens: cfg.max_batched_tokens,
        reemit_cache_hits: cfg.kv_events.reemit_cache_hits,
        pin_timeout: Duration::from_millis(cfg.kv_transfer_timeout_ms),
        layers: cfg.model.layers as usize,
        kv_heads: cfg.model.kv_heads as usize,
        head_dim: cfg.model.head_dim as usize,
    };
    let (model, backend_kind, num_blocks, cuda_device) =
        (cfg.model.clone(), cfg.backend, cfg.num_blocks, cfg.cuda_device);
    let max_positions = cfg.max_model_len + 1;
    let events_tx = publisher.as_ref().map(|p| p.tx.clone());
    let (eshared, ehasher) = (shared.clone(), hasher.clone());
    let engine_thread = std::thread::Builder::new()
        .name("kvroute-worker-engine".into())
        .spawn(move || {
            let weights = model::Weights::new(&model, max_positions);
            let bs = params.block_size;
            match model::build_backend(backend_kind, weights, num_blocks as usize, bs, cuda_device) {
                Ok(b) => {
                    let _ = ready_tx.send(Ok(b.name()));
                    Engine::new(params, b, num_blocks, ehasher, events_tx, eshared).run(&erx);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|source| WorkerError::Start { what: "engine thread", source })?;
    let backend = match ready_rx.recv() {
        Ok(Ok(name)) => name,
        Ok(Err(e)) => {
            let _ = engine_thread.join();
            return Err(e.into());
        }
        Err(_) => {
            let _ = engine_thread.join();
            return Err(WorkerError::EngineStopped);
        }
    };

    // HTTP and KV-transfer servers on their own runtime thread.
    let state = Arc::new(server::AppState {
        cfg: cfg.clone(),
        engine: etx.clone(),
        shared: shared.clone(),
        pending: Arc::new(transfer::PendingPush::default()),
        kv_addr,
        backend,
        events_endpoint: publisher.as_ref().map(|p| p.endpoint.clone()),
        replay_endpoint: publisher.as_ref().and_then(|p| p.replay_endpoint.clone()),
        next_id: AtomicU64::new(0),
        id_base: random_u64(),
    });
    let tserver = Arc::new(transfer::TransferServer {
        engine: etx.clone(),
        pending: state.pending.clone(),
        shared: shared.clone(),
        kv_dim: cfg.model.kv_dim(),
        timeout: Duration::from_millis(cfg.kv_transfer_timeout_ms),
    });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (up_tx, up_rx) = mpsc::sync_channel::<Result<(), std::io::Error>>(1);
    let rt_thread = std::thread::Builder::new()
        .name("kvroute-worker-http".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("kvroute-worker-rt")
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = up_tx.send(Err(e));
                    return;
                }
            };
            rt.block_on(async move {
                let listeners = tokio::net::TcpListener::from_std(http)
                    .and_then(|h| tokio::net::TcpListener::from_std(kv).map(|k| (h, k)));
                let (http, kv) = match listeners {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = up_tx.send(Err(e));
                        return;
                    }
                };
                tokio::spawn(tserver.serve(kv));
                let _ = up_tx.send(Ok(()));
                let app = server::app(state.clone());
                tokio::select! {
                    () = server::serve(http, app, &state.cfg) => {}
                    _ = stop_rx => {}
                }
            });
            rt.shutdown_timeout(Duration::from_millis(500));
        })
        .map_err(|source| WorkerError::Start { what: "HTTP thread", source })?;
    let mut handle = WorkerHandle {
        cfg,
        http_addr,
        kv_addr,
        events_endpoint: publisher.as_ref().map(|p| p.endpoint.clone()),
        replay_endpoint: publisher.as_ref().and_then(|p| p.replay_endpoint.clone()),
        backend,
        shared,
        engine: etx,
        hasher,
        publisher_stats: publisher.as_ref().map(|p| p.stats.clone()),
        publisher,
        engine_thread: Some(engine_thread),
        rt_thread: Some(rt_thread),
        stop_http: Some(stop_tx),
    };
    match up_rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(source)) => {
            handle.stop();
            Err(WorkerError::Start { what: "async runtime", source })
        }
        Err(_) => {
            handle.stop();
            Err(WorkerError::Start { what: "async runtime", source: std::io::Error::other("the HTTP thread ended") })
        }
    }
}

impl WorkerHandle {
    /// The HTTP address actually bound.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// The worker as kvroute names endpoints: `ip:port` of its HTTP address.
    pub fn endpoint_id(&self) -> String {
        self.http_addr.to_string()
    }

    /// The KV-transfer address actually bound.
    pub fn kv_transfer_addr(&self) -> SocketAddr {
        self.kv_addr
    }

    /// Where a subscriber on this machine connects for KV events (the bound endpoint, with a
    /// wildcard host replaced by loopback), or where the publisher connected to; `None` when
    /// events are off.
    pub fn events_endpoint(&self) -> Option<&str> {
        self.events_endpoint.as_deref()
    }

    /// Where a replay client on this machine connects; `None` without replay.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The configuration the worker runs with.
    pub fn config(&self) -> &WorkerConfig {
        &self.cfg
    }

    /// `cpu` or `cuda`.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// The line the CLI prints once listening.
    pub fn ready_line(&self) -> String {
        format!(
            "kvroute-worker ready http={} events={} replay={} kv={} role={} backend={} model={} block_size={} kv_bytes_per_token={}",
            self.http_addr,
            self.events_endpoint.as_deref().unwrap_or("-"),
            self.replay_endpoint.as_deref().unwrap_or("-"),
            self.kv_addr,
            self.cfg.role.as_str(),
            self.backend,
            self.cfg.model_name,
            self.cfg.block_size,
            self.cfg.model.kv_bytes_per_token(),
        )
    }

    /// Counters and gauges (gauges as of the engine's last step).
    pub fn counters(&self) -> WorkerCounters {
        self.shared.counters.snapshot()
    }

    /// KV-cache usage 0–1 (blocks held by running sequences / all blocks).
    pub fn kv_usage(&self) -> f64 {
        self.shared.kv_usage()
    }

    fn query<T: Send + 'static>(&self, make: impl FnOnce(engine::Reply<T>) -> Command) -> Result<T, WorkerError> {
        let (tx, rx) = mpsc::sync_channel::<T>(1);
        let reply: engine::Reply<T> = Box::new(move |v| {
            let _ = tx.send(v);
        });
        self.engine.send(make(reply)).map_err(|_| WorkerError::EngineStopped)?;
        rx.recv_timeout(QUERY_TIMEOUT).map_err(|e| match e {
            mpsc::RecvTimeoutError::Timeout => WorkerError::Timeout(QUERY_TIMEOUT),
            mpsc::RecvTimeoutError::Disconnected => WorkerError::EngineStopped,
        })
    }

    /// Event keys (as in `BlockStored`) of every block the prefix cache holds, sorted.
    pub fn cached_block_keys(&self) -> Result<Vec<u64>, WorkerError> {
        self.query(|reply| Command::CachedKeys { reply })
    }

    /// How many leading blocks of this prompt the prefix cache holds (usable as hits: at most
    /// `(len - 1) / block_size`).
    pub fn cached_prefix_blocks(&self, tokens: &[u32], cache_salt: Option<&str>) -> Result<usize, WorkerError> {
        let (tokens, cache_salt) = (tokens.to_vec(), cache_salt.map(str::to_owned));
        self.query(|reply| Command::ProbePrefix { tokens, cache_salt, reply })
    }

    /// The event keys this worker gives the full blocks of `tokens` (what its `BlockStored`
    /// events carry for that prompt).
    pub fn block_keys(&self, tokens: &[u32], cache_salt: Option<&str>) -> Vec<u64> {
        let mut out = Vec::new();
        let extras = BlockExtras { lora: None, cache_salt };
        let _ = self.hasher.block_keys(tokens, &extras, &mut Vec::new(), &mut out);
        out
    }

    /// Test hook: hold (`true`) or resume (`false`) the scheduler. While held, requests are
    /// accepted and wait in the queue (the `waiting` gauge counts them) but no step runs, so a
    /// test can line requests up without depending on thread timing.
    pub fn hold_scheduler(&self, hold: bool) -> Result<(), WorkerError> {
        self.engine.send(Command::Hold(hold)).map_err(|_| WorkerError::EngineStopped)
    }

    /// Forget the prefix cache (`AllBlocksCleared`); `false` while requests hold blocks.
    pub fn reset_prefix_cache(&self) -> Result<bool, WorkerError> {
        self.query(|reply| Command::ResetPrefixCache { reply })
    }

    /// Subscriptions seen on the KV-event socket (one per subscriber and topic filter).
    pub fn event_subscriptions(&self) -> u64 {
        self.publisher_stats.as_ref().map_or(0, |s| s.subscriptions.load(Ordering::Relaxed))
    }

    /// Wait until at least `n` subscriptions were seen (so no early event is lost to ZMQ's
    /// slow-joiner effect); `false` on timeout.
    pub fn wait_for_event_subscribers(&self, n: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.event_subscriptions() < n {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    /// Fault injection for tests: the next `n` event batches are numbered and kept for replay
    /// but not sent on the live socket, so subscribers see a sequence gap.
    pub fn drop_next_event_batches(&self, n: u64) {
        if let Some(s) = &self.publisher_stats {
            s.drop_next.fetch_add(n, Ordering::AcqRel);
        }
    }

    /// Event batches published so far, and how many of them were held back by
    /// [`WorkerHandle::drop_next_event_batches`].
    pub fn event_batches(&self) -> (u64, u64) {
        self.publisher_stats
            .as_ref()
            .map_or((0, 0), |s| (s.batches.load(Ordering::Relaxed), s.dropped.load(Ordering::Relaxed)))
    }

    /// Stop everything and wait for it.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(tx) = self.stop_http.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.rt_thread.take() {
            let _ = t.join();
        }
        let _ = self.engine.send(Command::Shutdown);
        if let Some(t) = self.engine_thread.take() {
            let _ = t.join();
        }
        if let Some(mut p) = self.publisher.take() {
            p.stop();
        }
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.stop();
    }
}
