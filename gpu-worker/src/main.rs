//! `kvroute-worker`: the reference model server (`serve`), the routing demo (`demo`) and the KV
//! transfer check (`transfer-check`).

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use kvroute::HashAlgo;
use kvroute_worker::config::{self, KvEventsConfig};
use kvroute_worker::{BackendKind, BindMode, EventEncoding, ModelConfig, Role, TransferMode, WorkerConfig};

/// Reference model-server worker for kvroute.
#[derive(Parser, Debug)]
#[command(name = "kvroute-worker", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the OpenAI-compatible API, metrics, KV events and KV transfers.
    Serve(Box<ServeArgs>),
    /// Start in-process workers and compare routing policies on a multi-turn agent workload.
    Demo(kvroute_worker::demo::DemoArgs),
    /// Measure prefill-to-decode KV transfers (pull and layer-wise push) on loopback and compare
    /// them with kvroute's transfer-tax model.
    TransferCheck(kvroute_worker::transfer_check::TransferCheckArgs),
}

/// Flags of `serve` (see `kvroute_worker::WorkerConfig` for each field).
#[derive(Args, Debug)]
struct ServeArgs {
    /// HTTP listen address (port 0: any free port; the ready line tells which).
    #[arg(long, default_value = config::DEFAULT_LISTEN)]
    listen: SocketAddr,
    /// Served model name.
    #[arg(long, default_value = config::DEFAULT_MODEL_NAME)]
    model_name: String,
    /// Role in a disaggregated deployment.
    #[arg(long, value_enum, default_value_t = Role::Both)]
    role: Role,
    /// ZMQ endpoint of the KV-event socket (`tcp://*:5557` binds; with `--kv-events-bind auto`,
    /// an endpoint without `*` or `::` is connected to, as vLLM does).
    #[arg(long, default_value = config::DEFAULT_EVENTS_ENDPOINT)]
    kv_events_endpoint: String,
    /// Publish no KV events.
    #[arg(long)]
    no_kv_events: bool,
    /// ZMQ endpoint of the replay ROUTER socket (always bound), e.g. `tcp://*:5558`.
    #[arg(long)]
    kv_events_replay_endpoint: Option<String>,
    /// Topic frame of every KV-event message.
    #[arg(long, default_value = "")]
    kv_events_topic: String,
    /// Event encoding: `map` (vLLM >= 0.24) or `array` (vLLM <= 0.23).
    #[arg(long, value_enum, default_value_t = EventEncoding::Map)]
    kv_events_encoding: EventEncoding,
    /// Bind or connect the KV-event socket (`auto`: vLLM's rule).
    #[arg(long, value_enum, default_value_t = BindMode::Auto)]
    kv_events_bind: BindMode,
    /// Batches kept for replay.
    #[arg(long, default_value_t = config::DEFAULT_EVENT_BUFFER_STEPS)]
    kv_events_buffer_steps: usize,
    /// Do not re-emit BlockStored for prefix-cache hits (vLLM < 0.33 behaviour).
    #[arg(long)]
    no_reemit_cache_hits: bool,
    /// KV-transfer TCP listen address.
    #[arg(long, default_value = config::DEFAULT_KV_TRANSFER_LISTEN)]
    kv_transfer_listen: SocketAddr,
    /// How this worker, as decode worker, obtains KV: `pull` (after the prefill) or `push`
    /// (streamed layer by layer).
    #[arg(long, value_enum, default_value_t = TransferMode::Pull)]
    transfer_mode: TransferMode,
    /// Bound on a remote prefill plus its transfer, milliseconds.
    #[arg(long, default_value_t = config::DEFAULT_KV_TRANSFER_TIMEOUT_MS)]
    kv_transfer_timeout_ms: u64,
    /// KV block size, tokens.
    #[arg(long, default_value_t = config::DEFAULT_BLOCK_SIZE)]
    block_size: u32,
    /// KV blocks in the pool.
    #[arg(long, default_value_t = config::DEFAULT_NUM_BLOCKS)]
    num_blocks: u32,
    /// Prefix-cache block hash: sha256, sha256_cbor, xxhash, xxhash_cbor.
    #[arg(long, default_value = "sha256_cbor")]
    hash_algo: HashAlgo,
    /// PYTHONHASHSEED the block hashes assume (default: the environment's PYTHONHASHSEED).
    #[arg(long)]
    python_hash_seed: Option<String>,
    /// Concurrently running sequences.
    #[arg(long, default_value_t = config::DEFAULT_MAX_RUNNING)]
    max_running: usize,
    /// Tokens per scheduler step.
    #[arg(long, default_value_t = config::DEFAULT_MAX_BATCHED_TOKENS)]
    max_batched_tokens: usize,
    /// Longest sequence (prompt + generated), tokens.
    #[arg(long, default_value_t = config::DEFAULT_MAX_MODEL_LEN)]
    max_model_len: usize,
    /// Model: transformer layers.
    #[arg(long, default_value_t = ModelConfig::default().layers)]
    layers: u32,
    /// Model: hidden size.
    #[arg(long, default_value_t = ModelConfig::default().hidden)]
    hidden: u32,
    /// Model: query heads.
    #[arg(long, default_value_t = ModelConfig::default().heads)]
    heads: u32,
    /// Model: KV heads.
    #[arg(long, default_value_t = ModelConfig::default().kv_heads)]
    kv_heads: u32,
    /// Model: head dimension.
    #[arg(long, default_value_t = ModelConfig::default().head_dim)]
    head_dim: u32,
    /// Model: MLP inner size.
    #[arg(long, default_value_t = ModelConfig::default().ffn)]
    ffn: u32,
    /// Model: vocabulary size.
    #[arg(long, default_value_t = ModelConfig::default().vocab)]
    vocab: u32,
    /// Model: weight seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Compute backend (`cuda` needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    backend: BackendKind,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    cuda_device: usize,
    /// Largest accepted request body, bytes.
    #[arg(long, default_value_t = config::DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// Bound on reading a request's headers (and on an idle keep-alive connection), milliseconds;
    /// the connection is closed when it passes.
    #[arg(long, default_value_t = config::DEFAULT_HEADER_READ_TIMEOUT_MS)]
    header_read_timeout_ms: u64,
    /// Bound on reading a whole request body, milliseconds (then 408 and the connection closes).
    #[arg(long, default_value_t = config::DEFAULT_BODY_READ_TIMEOUT_MS)]
    body_read_timeout_ms: u64,
    /// Open HTTP connections at most; beyond it a new connection gets 503 and is closed.
    #[arg(long, default_value_t = config::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// `max_tokens` of requests that give none.
    #[arg(long, default_value_t = config::DEFAULT_MAX_TOKENS)]
    default_max_tokens: u32,
}

impl ServeArgs {
    fn config(self) -> WorkerConfig {
        WorkerConfig {
            listen: self.listen,
            model_name: self.model_name,
            role: self.role,
            kv_events: KvEventsConfig {
                endpoint: (!self.no_kv_events).then_some(self.kv_events_endpoint),
                replay_endpoint: self.kv_events_replay_endpoint,
                topic: self.kv_events_topic,
                encoding: self.kv_events_encoding,
                bind: self.kv_events_bind,
                buffer_steps: self.kv_events_buffer_steps,
                reemit_cache_hits: !self.no_reemit_cache_hits,
                ..KvEventsConfig::default()
            },
            kv_transfer_listen: self.kv_transfer_listen,
            transfer_mode: self.transfer_mode,
            kv_transfer_timeout_ms: self.kv_transfer_timeout_ms,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            hash_algo: self.hash_algo,
            python_hash_seed: self.python_hash_seed.or_else(|| std::env::var("PYTHONHASHSEED").ok()),
            max_running: self.max_running,
            max_batched_tokens: self.max_batched_tokens,
            max_model_len: self.max_model_len,
            model: ModelConfig {
                layers: self.layers,
                hidden: self.hidden,
                heads: self.heads,
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
                ffn: self.ffn,
                vocab: self.vocab,
                seed: self.seed,
            },
            backend: self.backend,
            cuda_device: self.cuda_device,
            max_body_bytes: self.max_body_bytes,
            header_read_timeout_ms: self.header_read_timeout_ms,
            body_read_timeout_ms: self.body_read_timeout_ms,
            max_connections: self.max_connections,
            default_max_tokens: self.default_max_tokens,
        }
    }
}

/// Wait for Ctrl-C or SIGTERM.
async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[allow(clippy::print_stdout)]
fn serve(args: ServeArgs) -> anyhow::Result<()> {
    use std::io::Write as _;
    let worker = kvroute_worker::spawn(args.config())?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", worker.ready_line())?;
    out.flush()?;
    drop(out);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(terminated());
    worker.shutdown();
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve(*args),
        Command::Demo(args) => kvroute_worker::demo::run(args),
        Command::TransferCheck(args) => kvroute_worker::transfer_check::run(args).map(drop),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-worker: {e:#}");
            ExitCode::FAILURE
        }
    }
}
