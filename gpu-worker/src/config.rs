//! Worker configuration: every command-line flag of `kvroute-worker serve` is a field here.

use std::net::SocketAddr;

use kvroute::HashAlgo;
use serde::{Deserialize, Serialize};

/// Default HTTP listen address (the CLI's `--listen`).
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8001";
/// Default KV-event endpoint: bind on every interface, as vLLM's default `tcp://*:5557`.
pub const DEFAULT_EVENTS_ENDPOINT: &str = "tcp://*:5557";
/// Default KV-transfer listen address (port 0: chosen by the OS, printed on the ready line).
pub const DEFAULT_KV_TRANSFER_LISTEN: &str = "127.0.0.1:0";
/// Default served model name.
pub const DEFAULT_MODEL_NAME: &str = "kvroute-tiny";
/// Default KV block size, tokens (vLLM's default).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// Default number of KV blocks in the pool.
pub const DEFAULT_NUM_BLOCKS: u32 = 4096;
/// Default limit of concurrently running sequences (vLLM's `--max-num-seqs`).
pub const DEFAULT_MAX_RUNNING: usize = 64;
/// Default token budget of one scheduler step (vLLM's `--max-num-batched-tokens`).
pub const DEFAULT_MAX_BATCHED_TOKENS: usize = 2048;
/// Default context limit, tokens (prompt + generated).
pub const DEFAULT_MAX_MODEL_LEN: usize = 8192;
/// Default replay buffer of the KV-event publisher, batches (vLLM's `buffer_steps`).
pub const DEFAULT_EVENT_BUFFER_STEPS: usize = 10_000;
/// Default ZMQ send high-water mark of the KV-event publisher (vLLM's `hwm`).
pub const DEFAULT_EVENT_HWM: i32 = 100_000;
/// Default largest accepted request body, bytes.
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;
/// Default bound on reading a request's headers (and on an idle keep-alive connection waiting
/// for its next request), milliseconds.
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// Default bound on reading a whole request body, milliseconds.
pub const DEFAULT_BODY_READ_TIMEOUT_MS: u64 = 60_000;
/// Default limit of open HTTP connections.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default `max_tokens` of a completion request that gives none (OpenAI's default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;
/// Default bound on one prefill/decode KV transfer (remote prefill + transfer), milliseconds.
pub const DEFAULT_KV_TRANSFER_TIMEOUT_MS: u64 = 30_000;

/// What the worker serves in a disaggregated deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill worker: computes prompts' KV for decode workers (it also serves ordinary requests).
    Prefill,
    /// Decode worker: honours `x-prefiller-host-port` by pulling the prompt's KV from that worker.
    Decode,
    /// Both (colocated): serves everything; honours `x-prefiller-host-port` too.
    #[default]
    Both,
}

impl Role {
    /// `prefill`, `decode` or `both`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }

    /// Whether this role runs remote prefills for other workers (`/kvroute/v1/prefill`).
    pub const fn serves_prefill(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// Whether this role honours `x-prefiller-host-port` (fetches the KV from that worker).
    pub const fn pulls_kv(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

/// How KV events are encoded on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum EventEncoding {
    /// vLLM ≥ 0.24: every event is a msgpack map tagged by `"type"`.
    #[default]
    Map,
    /// vLLM ≤ 0.23: every event is a msgpack array tagged by its first element.
    Array,
}

/// Whether the KV-event `PUB` socket binds or connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum BindMode {
    /// vLLM's rule: bind when the endpoint contains `*` or `::`, connect otherwise.
    #[default]
    Auto,
    /// Always bind.
    Bind,
    /// Always connect (the subscriber binds).
    Connect,
}

impl BindMode {
    /// Whether a publisher with this mode binds `endpoint`.
    pub fn binds(self, endpoint: &str) -> bool {
        match self {
            BindMode::Bind => true,
            BindMode::Connect => false,
            BindMode::Auto => endpoint.contains('*') || endpoint.contains("::"),
        }
    }
}

/// How a decode worker obtains a prompt's KV from a prefill worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum TransferMode {
    /// Post-prefill pull: the prefill worker computes the whole prompt, then the decode worker
    /// reads the blocks.
    #[default]
    Pull,
    /// Layer-by-layer push: the prefill worker streams each layer's K/V as soon as it is
    /// computed, over a connection the decode worker opened first.
    Push,
}

impl TransferMode {
    /// `pull` or `push`.
    pub const fn as_str(self) -> &'static str {
        match self {
            TransferMode::Pull => "pull",
            TransferMode::Push => "push",
        }
    }
}

/// Compute backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// Plain Rust, f32, one thread.
    #[default]
    Cpu,
    /// CUDA through `cudarc` (cargo feature `cuda`), kernels compiled with NVRTC.
    Cuda,
}

impl BackendKind {
    /// `cpu` or `cuda`.
    pub const fn as_str(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// Shape of the deterministic transformer-like model (weights come from `seed`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Transformer layers `L`.
    pub layers: u32,
    /// Hidden size.
    pub hidden: u32,
    /// Query heads (a multiple of `kv_heads`).
    pub heads: u32,
    /// KV heads `H_kv` (grouped-query attention).
    pub kv_heads: u32,
    /// Head dimension `d_h` (even: rotary embeddings rotate pairs).
    pub head_dim: u32,
    /// MLP inner size.
    pub ffn: u32,
    /// Vocabulary size (byte tokens are `byte % vocab`).
    pub vocab: u32,
    /// Seed of the weights.
    pub seed: u64,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig { layers: 2, hidden: 128, heads: 4, kv_heads: 2, head_dim: 32, ffn: 256, vocab: 512, seed: 0 }
    }
}

impl ModelConfig {
    /// A very small model for tests (fast even in debug builds).
    pub fn tiny() -> Self {
        ModelConfig { layers: 2, hidden: 32, heads: 2, kv_heads: 1, head_dim: 16, ffn: 64, vocab: 300, seed: 7 }
    }

    /// Floats of K (or of V) per token and layer: `kv_heads × head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads as usize * self.head_dim as usize
    }

    /// Floats of the queries per token: `heads × head_dim`.
    pub fn q_dim(&self) -> usize {
        self.heads as usize * self.head_dim as usize
    }

    /// KV bytes per token in the pool (f32): `2 · L · H_kv · d_h · 4`, the same formula as
    /// `kvroute::ModelShape::kv_bytes_per_token` with `bytes_per_element = 4`.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers) * u64::from(self.kv_heads) * u64::from(self.head_dim) * 4
    }

    /// The matching model shape for kvroute's transfer-tax model (`transfer.model` in a policy).
    pub fn shape(&self) -> kvroute::ModelShape {
        kvroute::ModelShape {
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            bytes_per_element: 4,
        }
    }

    /// Check the shape.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &'static str, reason: String| Err(ConfigError { field, reason });
        for (field, v, max) in [
            ("layers", self.layers, 256),
            ("hidden", self.hidden, 1 << 16),
            ("heads", self.heads, 1024),
            ("kv_heads", self.kv_heads, 1024),
            ("head_dim", self.head_dim, 1024),
            ("ffn", self.ffn, 1 << 18),
            ("vocab", self.vocab, 1 << 22),
        ] {
            if v == 0 || v > max {
                return bad(field, format!("{v} is not within 1..={max}"));
            }
        }
        if self.heads % self.kv_heads != 0 {
            return bad(
                "heads",
                format!("{} query heads are not a multiple of {} KV heads", self.heads, self.kv_heads),
            );
        }
        if self.head_dim % 2 != 0 {
            return bad("head_dim", format!("{} is odd (rotary embeddings rotate pairs)", self.head_dim));
        }
        if self.vocab < 2 {
            return bad("vocab", "must be at least 2".into());
        }
        Ok(())
    }
}

/// The KV-event publisher (`--kv-events-*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// ZMQ endpoint of the `PUB` socket; `None` publishes nothing.
    pub endpoint: Option<String>,
    /// ZMQ endpoint of the replay `ROUTER` socket (always bound); `None`: no replay.
    pub replay_endpoint: Option<String>,
    /// Topic frame of every message (vLLM's default is empty).
    pub topic: String,
    /// Event encoding.
    pub encoding: EventEncoding,
    /// Bind or connect the `PUB` socket.
    pub bind: BindMode,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// ZMQ send high-water mark.
    pub hwm: i32,
    /// Re-emit `BlockStored` for prefix-cache hits (vLLM 0.33 does).
    pub reemit_cache_hits: bool,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            endpoint: Some(DEFAULT_EVENTS_ENDPOINT.to_owned()),
            replay_endpoint: None,
            topic: String::new(),
            encoding: EventEncoding::Map,
            bind: BindMode::Auto,
            buffer_steps: DEFAULT_EVENT_BUFFER_STEPS,
            hwm: DEFAULT_EVENT_HWM,
            reemit_cache_hits: true,
        }
    }
}

/// Everything a worker needs; [`WorkerConfig::default`] matches the CLI defaults and
/// [`WorkerConfig::ephemeral`] is the usual start for tests and in-process fleets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// HTTP listen address (port 0: chosen by the OS).
    pub listen: SocketAddr,
    /// Served model name (`model` of requests; other names get 404).
    pub model_name: String,
    /// Role in a disaggregated deployment.
    pub role: Role,
    /// KV events.
    pub kv_events: KvEventsConfig,
    /// KV-transfer TCP listen address (port 0: chosen by the OS).
    pub kv_transfer_listen: SocketAddr,
    /// How this worker, as a decode worker, obtains KV from a prefill worker.
    pub transfer_mode: TransferMode,
    /// Bound on a remote prefill plus its transfer, milliseconds.
    pub kv_transfer_timeout_ms: u64,
    /// KV block size, tokens.
    pub block_size: u32,
    /// KV blocks in the pool.
    pub num_blocks: u32,
    /// Prefix-cache block hash (`--prefix-caching-hash-algo`).
    pub hash_algo: HashAlgo,
    /// `PYTHONHASHSEED` the block hashes are derived as if vLLM ran with; `None`: unset (then
    /// `xxhash`/`xxhash_cbor` use a random per-process seed, as vLLM does).
    pub python_hash_seed: Option<String>,
    /// Concurrently running sequences.
    pub max_running: usize,
    /// Tokens per scheduler step (prefill chunks + one per decoding sequence).
    pub max_batched_tokens: usize,
    /// Longest sequence (prompt + generated), tokens.
    pub max_model_len: usize,
    /// Model shape and seed.
    pub model: ModelConfig,
    /// Compute backend.
    pub backend: BackendKind,
    /// CUDA device ordinal (backend `cuda`).
    pub cuda_device: usize,
    /// Largest accepted request body, bytes.
    pub max_body_bytes: usize,
    /// Bound on reading a request's headers, milliseconds, counted from the connection's accept
    /// (or from the end of its previous response): the connection is closed when it passes.
    pub header_read_timeout_ms: u64,
    /// Bound on reading a whole request body, milliseconds, counted from the end of its headers:
    /// when it passes the request gets 408 and the connection is closed.
    pub body_read_timeout_ms: u64,
    /// Open HTTP connections at most; a connection accepted beyond it gets a 503 (best effort)
    /// and is closed at once.
    pub max_connections: usize,
    /// `max_tokens` of requests that give none.
    pub default_max_tokens: u32,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8001)),
            model_name: DEFAULT_MODEL_NAME.to_owned(),
            role: Role::Both,
            kv_events: KvEventsConfig::default(),
            kv_transfer_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            transfer_mode: TransferMode::Pull,
            kv_transfer_timeout_ms: DEFAULT_KV_TRANSFER_TIMEOUT_MS,
            block_size: DEFAULT_BLOCK_SIZE,
            num_blocks: DEFAULT_NUM_BLOCKS,
            hash_algo: HashAlgo::Sha256Cbor,
            python_hash_seed: None,
            max_running: DEFAULT_MAX_RUNNING,
            max_batched_tokens: DEFAULT_MAX_BATCHED_TOKENS,
            max_model_len: DEFAULT_MAX_MODEL_LEN,
            model: ModelConfig::default(),
            backend: BackendKind::Cpu,
            cuda_device: 0,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            header_read_timeout_ms: DEFAULT_HEADER_READ_TIMEOUT_MS,
            body_read_timeout_ms: DEFAULT_BODY_READ_TIMEOUT_MS,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            default_max_tokens: DEFAULT_MAX_TOKENS,
        }
    }
}

impl WorkerConfig {
    /// Everything on loopback with OS-chosen ports: HTTP `127.0.0.1:0`, KV events
    /// `tcp://127.0.0.1:*` with replay `tcp://127.0.0.1:*`, KV transfer `127.0.0.1:0`. The
    /// actual addresses are on the [`crate::WorkerHandle`].
    pub fn ephemeral() -> Self {
        WorkerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            kv_events: KvEventsConfig {
                endpoint: Some("tcp://127.0.0.1:*".to_owned()),
                replay_endpoint: Some("tcp://127.0.0.1:*".to_owned()),
                ..KvEventsConfig::default()
            },
            ..WorkerConfig::default()
        }
    }

    /// Check every value; [`crate::spawn`] calls it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &'static str, reason: String| Err(ConfigError { field, reason });
        self.model.validate()?;
        if self.model_name.is_empty() {
            return bad("model_name", "must not be empty".into());
        }
        if !(1..=1024).contains(&self.block_size) {
            return bad("block_size", format!("{} is not within 1..=1024", self.block_size));
        }
        if self.num_blocks == 0 {
            return bad("num_blocks", "must be at least 1".into());
        }
        if self.max_running == 0 {
            return bad("max_running", "must be at least 1".into());
        }
        if self.max_batched_tokens == 0 {
            return bad("max_batched_tokens", "must be at least 1".into());
        }
        if !(2..=1 << 20).contains(&self.max_model_len) {
            return bad("max_model_len", format!("{} is not within 2..={}", self.max_model_len, 1 << 20));
        }
        if self.max_body_bytes < 1024 {
            return bad("max_body_bytes", format!("{} is below 1024", self.max_body_bytes));
        }
        if self.default_max_tokens == 0 {
            return bad("default_max_tokens", "must be at least 1".into());
        }
        for (field, v) in [
            ("kv_transfer_timeout_ms", self.kv_transfer_timeout_ms),
            ("header_read_timeout_ms", self.header_read_timeout_ms),
            ("body_read_timeout_ms", self.body_read_timeout_ms),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1".into());
            }
        }
        if self.max_connections == 0 {
            return bad("max_connections", "must be at least 1".into());
        }
        let ev = &self.kv_events;
        for (field, ep) in [("kv_events.endpoint", &ev.endpoint), ("kv_events.replay_endpoint", &ev.replay_endpoint)] {
            if let Some(ep) = ep {
                if !ep.contains("://") {
                    return bad(field, format!("{ep:?} is not a ZMQ endpoint (transport://address)"));
                }
            }
        }
        if ev.buffer_steps == 0 {
            return bad("kv_events.buffer_steps", "must be at least 1".into());
        }
        if ev.hwm < 0 {
            return bad("kv_events.hwm", format!("{} is negative", ev.hwm));
        }
        if self.backend == BackendKind::Cuda && self.model.head_dim > 256 {
            return bad("model.head_dim", "the CUDA backend supports head_dim <= 256".into());
        }
        Ok(())
    }
}

/// A configuration value is out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid worker config `{field}`: {reason}")]
pub struct ConfigError {
    /// The field.
    pub field: &'static str,
    /// Why it is rejected.
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_kv_bytes_match_core() {
        WorkerConfig::default().validate().unwrap();
        WorkerConfig::ephemeral().validate().unwrap();
        let m = ModelConfig::default();
        assert_eq!(m.kv_bytes_per_token(), 2 * 2 * 2 * 32 * 4);
        assert_eq!(m.shape().kv_bytes_per_token(), m.kv_bytes_per_token());
        ModelConfig::tiny().validate().unwrap();
    }

    #[test]
    fn bad_values_name_their_field() {
        let mut c = WorkerConfig::default();
        c.model.heads = 3;
        assert_eq!(c.validate().unwrap_err().field, "heads");
        let mut c = WorkerConfig::default();
        c.model.head_dim = 15;
        assert_eq!(c.validate().unwrap_err().field, "head_dim");
        let c = WorkerConfig { block_size: 0, ..WorkerConfig::default() };
        assert_eq!(c.validate().unwrap_err().field, "block_size");
        let mut c = WorkerConfig::default();
        c.kv_events.endpoint = Some("localhost:5557".into());
        assert_eq!(c.validate().unwrap_err().field, "kv_events.endpoint");
        let c = WorkerConfig { header_read_timeout_ms: 0, ..WorkerConfig::default() };
        assert_eq!(c.validate().unwrap_err().field, "header_read_timeout_ms");
        let c = WorkerConfig { body_read_timeout_ms: 0, ..WorkerConfig::default() };
        assert_eq!(c.validate().unwrap_err().field, "body_read_timeout_ms");
        let c = WorkerConfig { max_connections: 0, ..WorkerConfig::default() };
        assert_eq!(c.validate().unwrap_err().field, "max_connections");
    }

    #[test]
    fn vllm_bind_rule() {
        assert!(BindMode::Auto.binds("tcp://*:5557"));
        assert!(BindMode::Auto.binds("tcp://[::]:5557"));
        assert!(!BindMode::Auto.binds("tcp://127.0.0.1:5557"));
        assert!(BindMode::Bind.binds("tcp://127.0.0.1:5557"));
        assert!(!BindMode::Connect.binds("tcp://*:5557"));
    }
}
