//! `kvroute-worker transfer-check`: measure prefill→decode KV transfers on loopback and compare
//! them with kvroute's transfer-tax model ([`kvroute::transfer_estimate`], the function
//! behind every decision's `TransferEstimate`).
//!
//! 1. The network parameters of the model are measured independently of the workers: `B_net`
//!    by streaming a bulk buffer through a loopback TCP connection, `L_setup` as the median time
//!    to connect and get a one-byte answer.
//! 2. A prefill worker and two decode workers (one pulling after the prefill, one receiving the
//!    layer-by-layer push) start in this process. For each prompt size, fresh prompts (no cache
//!    hits anywhere) are sent to the decode workers with `x-prefiller-host-port`; each response's
//!    `kv_transfer` object gives the bytes and times the decode worker measured.
//! 3. Measured: pull = connection to last byte after the prefill finished (all of it exposed);
//!    push = the exposed part, i.e. the push request's connection-to-last-byte time minus the
//!    prefill's compute time the prefill worker reports for that same request (the `done`
//!    frame). Predicted: `V/B + L_setup`
//!    (pull), `V/(L·B) + L_setup` (push, `layerwise_streaming`), with `V = 2·L·H_kv·d_h·b·S`
//!    and `b = 4` (the pool holds f32).
#![allow(clippy::print_stdout)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use kvroute::{NetworkConfig, TransferConfig};
use serde_json::{json, Value};

use crate::{spawn, ModelConfig, Role, TransferMode, WorkerConfig, WorkerHandle, PREFILLER_HEADER};

/// Arguments of `kvroute-worker transfer-check`.
#[derive(clap::Args, Debug, Clone)]
pub struct TransferCheckArgs {
    /// Prompt sizes to transfer, tokens (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048")]
    pub sizes: Vec<u32>,
    /// Requests per size and mode (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub reps: u32,
    /// Model: transformer layers.
    #[arg(long, default_value_t = 8)]
    pub layers: u32,
    /// Model: KV heads.
    #[arg(long, default_value_t = 4)]
    pub kv_heads: u32,
    /// Model: head dimension.
    #[arg(long, default_value_t = 64)]
    pub head_dim: u32,
    /// Model: hidden size (query heads = hidden / head_dim).
    #[arg(long, default_value_t = 256)]
    pub hidden: u32,
    /// Bytes streamed to measure the loopback bandwidth.
    #[arg(long, default_value_t = 256 << 20)]
    pub probe_bytes: u64,
    /// Also write the results as JSON.
    #[arg(long, value_name = "PATH")]
    pub json: Option<std::path::PathBuf>,
}

/// One size's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SizeResult {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Tokens transferred (whole blocks before the last token).
    pub tokens: u64,
    /// KV payload bytes (as measured; equals the model's `V`).
    pub kv_bytes: u64,
    /// Model's `V` for these tokens.
    pub predicted_kv_bytes: u64,
    /// Median prefill compute time in the prefill worker's engine (pull requests), ms.
    pub prefill_ms: f64,
    /// Median measured pull transfer, ms.
    pub pull_ms: f64,
    /// Model: pull, ms.
    pub pull_predicted_ms: f64,
    /// Median push prefill-plus-transfer time (connection to last byte), ms.
    pub push_total_ms: f64,
    /// Median measured exposed push time (each request's connection-to-last-byte time minus the
    /// prefill worker's compute time for it, at least 0), ms.
    pub push_exposed_ms: f64,
    /// Model: layer-wise streaming, ms.
    pub push_predicted_ms: f64,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

/// Loopback bandwidth (bytes/s) and connect-plus-round-trip latency (s), measured with plain
/// TCP sockets.
pub fn measure_loopback(probe_bytes: u64) -> anyhow::Result<(f64, f64)> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding the probe listener")?;
    let addr = l.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        // Connection 1..=9: one-byte echo (latency); connection 10: sink (bandwidth).
        for _ in 0..9 {
            let (mut s, _) = l.accept()?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b)?;
            s.write_all(&b)?;
        }
        let (mut s, _) = l.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
        s.write_all(&total.to_le_bytes())
    });
    let mut lat = Vec::new();
    for _ in 0..9 {
        let t = Instant::now();
        let mut s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        s.write_all(b"x")?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
        lat.push(t.elapsed().as_secs_f64());
    }
    let mut s = TcpStream::connect(addr)?;
    let chunk = vec![7u8; 1 << 20];
    let t = Instant::now();
    let mut sent = 0u64;
    while sent < probe_bytes {
        let n = chunk.len().min((probe_bytes - sent) as usize);
        s.write_all(&chunk[..n])?;
        sent += n as u64;
    }
    s.shutdown(std::net::Shutdown::Write)?;
    let mut ack = [0u8; 8];
    s.read_exact(&mut ack)?;
    let secs = t.elapsed().as_secs_f64();
    match server.join() {
        Ok(r) => r.context("probe server")?,
        Err(_) => bail!("the probe server thread panicked"),
    }
    anyhow::ensure!(u64::from_le_bytes(ack) == probe_bytes, "the probe lost bytes");
    Ok((probe_bytes as f64 / secs, median(&mut lat)))
}

/// `POST path` with a JSON body over a fresh connection; the JSON answer.
fn post_json(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &Value) -> anyhow::Result<Value> {
    let body = body.to_string();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").context("malformed HTTP response")?;
    let status_line = String::from_utf8_lossy(&raw[..split]).lines().next().unwrap_or("").to_owned();
    let v: Value =
        serde_json::from_slice(&raw[split + 4..]).with_context(|| format!("non-JSON answer ({status_line})"))?;
    anyhow::ensure!(status_line.contains(" 200 "), "{status_line}: {v}");
    Ok(v)
}

/// Pseudo-random prompt `n` of `len` tokens (distinct prompts never share a first block).
fn prompt(n: u64, len: u32, vocab: u32) -> Vec<u32> {
    let mut x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % u64::from(vocab)) as u32
        })
        .collect()
}

fn start(model: &ModelConfig, role: Role, mode: TransferMode, max_len: usize) -> anyhow::Result<WorkerHandle> {
    let blocks = u32::try_from(max_len.div_ceil(16) * 2 + 64).unwrap_or(u32::MAX);
    let mut cfg = WorkerConfig {
        model: model.clone(),
        role,
        transfer_mode: mode,
        num_blocks: blocks,
        max_model_len: max_len + 64,
        max_batched_tokens: 2048,
        kv_transfer_timeout_ms: 120_000,
        ..WorkerConfig::ephemeral()
    };
    cfg.kv_events.endpoint = None;
    cfg.kv_events.replay_endpoint = None;
    Ok(spawn(cfg)?)
}

/// Run the check; returns the per-size results (also printed).
pub fn run(args: TransferCheckArgs) -> anyhow::Result<Vec<SizeResult>> {
    anyhow::ensure!(!args.sizes.is_empty() && args.sizes.iter().all(|&s| s >= 32), "--sizes must be >= 32 tokens each");
    anyhow::ensure!(args.reps >= 1, "--reps must be at least 1");
    anyhow::ensure!(args.head_dim > 0 && args.hidden % args.head_dim == 0, "--hidden must be a multiple of --head-dim");
    let heads = args.hidden / args.head_dim;
    anyhow::ensure!(
        args.kv_heads > 0 && heads % args.kv_heads == 0,
        "query heads (hidden / head_dim) must be a multiple of --kv-heads"
    );
    let model = ModelConfig {
        layers: args.layers,
        hidden: args.hidden,
        heads,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        ffn: args.hidden * 2,
        vocab: 512,
        seed: 1,
    };
    model.validate()?;
    let (bw, setup) = measure_loopback(args.probe_bytes.max(1 << 20))?;
    println!(
        "loopback TCP, measured with plain sockets: B_net = {:.2} GB/s ({:.1} Gbit/s), L_setup = {:.1} us (connect + 1-byte round trip)",
        bw / 1e9,
        bw * 8.0 / 1e9,
        setup * 1e6
    );
    let shape = model.shape();
    println!(
        "model: {} layers x {} KV heads x head dim {}, f32 pool: {} KV bytes per token",
        model.layers,
        model.kv_heads,
        model.head_dim,
        shape.kv_bytes_per_token()
    );
    let network = NetworkConfig { bandwidth_gbps: bw * 8.0 / 1e9, setup_latency_us: setup * 1e6 };
    let pull_cfg =
        TransferConfig { model: shape.clone(), network, layerwise_streaming: false, ..TransferConfig::default() };
    let push_cfg = TransferConfig { layerwise_streaming: true, ..pull_cfg.clone() };

    let max_len = args.sizes.iter().copied().max().unwrap_or(0) as usize;
    let prefill = start(&model, Role::Prefill, TransferMode::Pull, max_len)?;
    let pull = start(&model, Role::Decode, TransferMode::Pull, max_len)?;
    let push = start(&model, Role::Decode, TransferMode::Push, max_len)?;
    let pf = prefill.http_addr().to_string();
    let headers = [(PREFILLER_HEADER, pf.as_str())];
    let mut results = Vec::new();
    let mut n = 0u64;
    println!(
        "\n{:>7} {:>8} {:>11} | {:>9} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>9} {:>6}",
        "prompt", "tokens", "KV bytes", "prefill", "pull", "model", "ratio", "push tot", "exposed", "model", "ratio"
    );
    for &size in &args.sizes {
        let mut r = SizeResult {
            prompt_tokens: size,
            tokens: 0,
            kv_bytes: 0,
            predicted_kv_bytes: 0,
            prefill_ms: 0.0,
            pull_ms: 0.0,
            pull_predicted_ms: 0.0,
            push_total_ms: 0.0,
            push_exposed_ms: 0.0,
            push_predicted_ms: 0.0,
        };
        let (mut pre, mut pl, mut ps, mut pe) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..args.reps {
            for (worker, times) in [(&pull, &mut pl), (&push, &mut ps)] {
                n += 1;
                let body = json!({"prompt": prompt(n, size, model.vocab), "max_tokens": 1});
                let v = post_json(worker.http_addr(), "/v1/completions", &headers, &body)?;
                let t = &v["kv_transfer"];
                if let Some(e) = t.get("error") {
                    bail!("transfer of {size} tokens failed: {e}");
                }
                r.tokens = t["tokens"].as_u64().unwrap_or(0);
                r.kv_bytes = t["bytes"].as_u64().unwrap_or(0);
                times.push(t["transfer_ms"].as_f64().unwrap_or(f64::NAN));
                if std::ptr::eq(worker, &pull) {
                    pre.push(t["remote_compute_ms"].as_f64().unwrap_or(f64::NAN));
                } else {
                    pe.push(t["exposed_ms"].as_f64().unwrap_or(f64::NAN));
                }
            }
        }
        let est_pull = kvroute::transfer_estimate(&pull_cfg, r.tokens, 0, 0, 0);
        let est_push = kvroute::transfer_estimate(&push_cfg, r.tokens, 0, 0, 0);
        r.predicted_kv_bytes = est_pull.kv_bytes;
        r.prefill_ms = median(&mut pre);
        r.pull_ms = median(&mut pl);
        r.pull_predicted_ms = est_pull.transfer_s * 1e3;
        r.push_total_ms = median(&mut ps);
        r.push_exposed_ms = median(&mut pe);
        r.push_predicted_ms = est_push.transfer_s * 1e3;
        println!(
            "{:>7} {:>8} {:>11} | {:>7.2}ms | {:>7.2}ms {:>7.2}ms {:>5.1}x | {:>7.2}ms {:>7.2}ms {:>7.2}ms {:>5.1}x",
            size,
            r.tokens,
            r.kv_bytes,
            r.prefill_ms,
            r.pull_ms,
            r.pull_predicted_ms,
            r.pull_ms / r.pull_predicted_ms,
            r.push_total_ms,
            r.push_exposed_ms,
            r.push_predicted_ms,
            r.push_exposed_ms / r.push_predicted_ms
        );
        anyhow::ensure!(
            r.kv_bytes == r.predicted_kv_bytes,
            "measured KV bytes {} != model {}",
            r.kv_bytes,
            r.predicted_kv_bytes
        );
        results.push(r);
    }
    println!(
        "\nratio = measured / predicted. Measured pull = the decode worker's connection-to-last-byte time after the remote \
         prefill; it also includes reading the blocks out of the prefill worker's pool, framing, and parsing on the decode \
         side, which the model (V/B + L_setup) leaves out. Push exposed = the push request's connection-to-last-byte time \
         minus the prefill worker's compute time for that request. Medians of {} requests each.",
        args.reps
    );
    for w in [prefill, pull, push] {
        w.shutdown();
    }
    if let Some(path) = &args.json {
        let v = json!({"bandwidth_bytes_per_s": bw, "setup_s": setup, "kv_bytes_per_token": shape.kv_bytes_per_token(), "sizes": results});
        std::fs::write(path, serde_json::to_vec_pretty(&v)?).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(results)
}
