//! Prefill/decode disaggregation: the KV-transfer TCP protocol and the decode worker's side of
//! a remote prefill.
//!
//! # Flow
//! A decode worker receiving `x-prefiller-host-port: ip:port` (kvroute's disaggregated
//! decision) first asks its own engine how many leading blocks of the prompt it already caches
//! (`skip`), then `POST`s `/kvroute/v1/prefill` to that prefill worker's HTTP address with the
//! prompt's token ids, `skip_blocks` and the transfer mode. The prefill worker schedules the
//! prompt like any other (its own prefix cache applies, its `BlockStored` events are published)
//! and answers with a transfer id and its KV-transfer address. The decode worker then connects
//! there and receives the K/V of the whole blocks `skip..(len - 1) / block_size` (the positions
//! its own admission will take as cached: vLLM always computes a prompt's last token):
//!
//! - **pull** (default): the `POST` returns once the prompt is computed; the blocks stay pinned
//!   in the prefill worker's pool until the decode worker reads them (or a timeout passes).
//! - **push**: the `POST` returns at once; the prefill worker streams each layer's K/V over the
//!   decode worker's connection as soon as the layer is computed, so only the last layer's
//!   transfer is exposed after the prefill ends.
//!
//! The decode worker inserts the blocks into its pool (publishing `BlockStored` for them) and
//! runs the request, which computes only the tail. The response carries a `kv_transfer` object.
//!
//! # Wire protocol (TCP, little-endian)
//! Request: `b"KVT1"`, op `u8` (1 pull, 2 push), transfer id `u64`. Then frames `type u8,
//! length u32, payload`:
//!
//! | type | payload |
//! |---|---|
//! | 1 header | `layers, kv_heads, head_dim, block_size` (u32 each), dtype `u8` (0 = f32), `start, n` (u32), `n` token ids (u32) |
//! | 2 layer | `layer, start, n` (u32), K then V: `n × kv_heads × head_dim` f32 each, token-major |
//! | 3 done | first token of the prefill (u32), the prefill's compute time in the prefill worker's engine, µs (u64) |
//! | 4 error | UTF-8 message |
//!
//! The KV payload of a transfer is exactly `tokens × 2 × layers × kv_heads × head_dim × 4`
//! bytes: kvroute's `ModelShape` with `bytes_per_element = 4` predicts it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::config::TransferMode;
use crate::engine::{Command, TransferMsg, TransferredKv};
use crate::metrics::Shared;

/// Magic of a transfer request.
pub const MAGIC: &[u8; 4] = b"KVT1";
/// Request op: read a pinned transfer.
pub const OP_PULL: u8 = 1;
/// Request op: attach to a pushed transfer.
pub const OP_PUSH: u8 = 2;
const FRAME_HEADER: u8 = 1;
const FRAME_LAYER: u8 = 2;
const FRAME_DONE: u8 = 3;
const FRAME_ERROR: u8 = 4;
/// Largest accepted frame, bytes.
const MAX_FRAME: usize = 1 << 30;

/// The transfer as the decode worker measured it (the response's `kv_transfer` object).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TransferReport {
    /// The prefill worker (`x-prefiller-host-port`).
    pub prefill_host_port: String,
    /// `pull` or `push`.
    pub mode: &'static str,
    /// Leading blocks the decode worker had cached already (not transferred).
    pub skipped_blocks: usize,
    /// Blocks received.
    pub blocks: usize,
    /// Tokens whose K/V were received.
    pub tokens: usize,
    /// KV payload bytes received (K and V, all layers).
    pub bytes: u64,
    /// Bytes read from the connection (payload + framing + token ids).
    pub wire_bytes: u64,
    /// Duration of the `POST /kvroute/v1/prefill` (pull: the remote prefill), milliseconds.
    pub prefill_ms: f64,
    /// Connection opened to last byte read, milliseconds (push: includes the remote prefill,
    /// overlapped with the transfer).
    pub transfer_ms: f64,
    /// The prefill worker's own time for the prefill (its engine, submission to finish),
    /// milliseconds.
    pub remote_compute_ms: f64,
    /// The transfer time not hidden behind the prefill, milliseconds: pull: `transfer_ms`;
    /// push: `transfer_ms - remote_compute_ms` (at least 0).
    pub exposed_ms: f64,
    /// The prefill worker's first token (equal to the decode worker's when all goes well).
    pub first_token: Option<u32>,
    /// Why the transfer did not happen or failed (the prompt was then computed locally).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Pushed transfers waiting for their decode worker to attach: id → (receiver, created).
pub(crate) type PendingPush = Mutex<HashMap<u64, (UnboundedReceiver<TransferMsg>, Instant)>>;

/// Serialize one message into a frame (`kv_dim`: floats of K per position, for the count).
fn frame(msg: &TransferMsg, kv_dim: usize) -> Vec<u8> {
    fn put(out: &mut Vec<u8>, v: u32) {
        out.extend_from_slice(&v.to_le_bytes());
    }
    let mut p = Vec::new();
    let kind = match msg {
        TransferMsg::Header { layers, kv_heads, head_dim, block_size, start, tokens } => {
            for v in [*layers, *kv_heads, *head_dim, *block_size] {
                put(&mut p, v);
            }
            p.push(0);
            put(&mut p, *start);
            put(&mut p, tokens.len() as u32);
            for &t in tokens {
                put(&mut p, t);
            }
            FRAME_HEADER
        }
        TransferMsg::Layer { layer, start, k, v } => {
            p.reserve(12 + 4 * (k.len() + v.len()));
            put(&mut p, *layer);
            put(&mut p, *start);
            put(&mut p, (k.len() / kv_dim.max(1)) as u32);
            put_floats(&mut p, k);
            put_floats(&mut p, v);
            FRAME_LAYER
        }
        TransferMsg::Done { first_token, compute_us } => {
            put(&mut p, *first_token);
            p.extend_from_slice(&compute_us.to_le_bytes());
            FRAME_DONE
        }
        TransferMsg::Error(e) => {
            p.extend_from_slice(e.as_bytes());
            FRAME_ERROR
        }
    };
    let mut out = Vec::with_capacity(5 + p.len());
    out.push(kind);
    out.extend_from_slice(&(p.len() as u32).to_le_bytes());
    out.extend_from_slice(&p);
    out
}

/// Append `xs` as little-endian f32 (one copy on little-endian machines).
fn put_floats(out: &mut Vec<u8>, xs: &[f32]) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(xs));
    } else {
        for x in xs {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
}

/// Read little-endian f32 from `bytes` into `dst` (`bytes.len() == 4 * dst.len()`).
fn get_floats(dst: &mut [f32], bytes: &[u8]) {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(bytes);
    } else {
        for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
            *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
}

/// KV payload bytes of a message (K and V).
fn payload_bytes(msg: &TransferMsg) -> u64 {
    match msg {
        TransferMsg::Layer { k, v, .. } => 4 * (k.len() + v.len()) as u64,
        _ => 0,
    }
}

/// Shared state of the KV-transfer server.
pub(crate) struct TransferServer {
    pub(crate) engine: std::sync::mpsc::Sender<Command>,
    pub(crate) pending: Arc<PendingPush>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) kv_dim: usize,
    pub(crate) timeout: Duration,
}

impl TransferServer {
    /// Accept connections until the task is dropped.
    pub(crate) async fn serve(self: Arc<Self>, listener: TcpListener) {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let me = self.clone();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(me.timeout, me.connection(stream)).await;
            });
        }
    }

    async fn connection(&self, mut s: TcpStream) -> std::io::Result<()> {
        let _ = s.set_nodelay(true);
        let mut req = [0u8; 13];
        s.read_exact(&mut req).await?;
        if &req[..4] != MAGIC {
            return s.write_all(&frame(&TransferMsg::Error("bad magic".into()), 1)).await;
        }
        let id = u64::from_le_bytes([req[5], req[6], req[7], req[8], req[9], req[10], req[11], req[12]]);
        let mut sent = 0u64;
        match req[4] {
            OP_PULL => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let cmd = Command::TakeTransfer {
                    id,
                    reply: Box::new(move |m| {
                        let _ = tx.send(m);
                    }),
                };
                let msgs = match self.engine.send(cmd) {
                    Ok(()) => rx.await.ok().flatten(),
                    Err(_) => None,
                };
                let msgs = msgs.unwrap_or_else(|| vec![TransferMsg::Error(format!("unknown transfer {id}"))]);
                for m in &msgs {
                    sent += payload_bytes(m);
                    s.write_all(&frame(m, self.kv_dim)).await?;
                }
            }
            OP_PUSH => {
                let rx = self.pending.lock().ok().and_then(|mut p| p.remove(&id)).map(|(rx, _)| rx);
                let Some(mut rx) = rx else {
                    return s.write_all(&frame(&TransferMsg::Error(format!("unknown transfer {id}")), 1)).await;
                };
                while let Some(m) = rx.recv().await {
                    sent += payload_bytes(&m);
                    s.write_all(&frame(&m, self.kv_dim)).await?;
                    if matches!(m, TransferMsg::Done { .. } | TransferMsg::Error(_)) {
                        break;
                    }
                }
            }
            op => return s.write_all(&frame(&TransferMsg::Error(format!("unknown op {op}")), 1)).await,
        }
        s.flush().await?;
        Shared::add(&self.shared.counters.kv_transfers_out, 1);
        Shared::add(&self.shared.counters.kv_transfer_out_bytes, sent);
        Ok(())
    }
}

/// Drop pushed transfers nobody attached to within `timeout`.
pub(crate) fn expire_pending(pending: &PendingPush, timeout: Duration) {
    if let Ok(mut p) = pending.lock() {
        p.retain(|_, (_, created)| created.elapsed() < timeout);
    }
}

/// The shape the decode worker expects.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) layers: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) block_size: usize,
}

async fn read_frame(s: &mut TcpStream, wire: &mut u64) -> Result<(u8, Vec<u8>), String> {
    let mut h = [0u8; 5];
    s.read_exact(&mut h).await.map_err(|e| format!("read: {e}"))?;
    let len = u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as usize;
    if len > MAX_FRAME {
        return Err(format!("frame of {len} bytes"));
    }
    let mut p = vec![0u8; len];
    s.read_exact(&mut p).await.map_err(|e| format!("read: {e}"))?;
    *wire += 5 + len as u64;
    Ok((h[0], p))
}

fn u32_at(p: &[u8], i: usize) -> Result<u32, String> {
    p.get(4 * i..4 * i + 4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| "truncated frame".to_owned())
}

/// Connect to `addr`, ask for transfer `id` with `op`, and receive positions `start..start +
/// expected.len()` (whose token ids must be `expected`). Returns the K/V, the payload bytes,
/// the wire bytes, the prefill's first token and its compute time in the prefill worker's engine
/// (microseconds).
pub(crate) async fn receive(
    addr: &str,
    op: u8,
    id: u64,
    start: usize,
    expected: &[u32],
    shape: Shape,
) -> Result<(TransferredKv, u64, u64, u32, u64), String> {
    let mut s = TcpStream::connect(addr).await.map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = s.set_nodelay(true);
    let mut req = Vec::with_capacity(13);
    req.extend_from_slice(MAGIC);
    req.push(op);
    req.extend_from_slice(&id.to_le_bytes());
    s.write_all(&req).await.map_err(|e| format!("write: {e}"))?;
    let n = expected.len();
    let kvd = shape.kv_heads * shape.head_dim;
    let mut kv = TransferredKv {
        start,
        len: n,
        k: vec![vec![0.0; n * kvd]; shape.layers],
        v: vec![vec![0.0; n * kvd]; shape.layers],
    };
    let mut covered = vec![vec![false; n]; shape.layers];
    let (mut wire, mut bytes, mut header) = (0u64, 0u64, false);
    loop {
        let (kind, p) = read_frame(&mut s, &mut wire).await?;
        match kind {
            FRAME_HEADER => {
                let dims = [u32_at(&p, 0)?, u32_at(&p, 1)?, u32_at(&p, 2)?, u32_at(&p, 3)?];
                let want = [shape.layers, shape.kv_heads, shape.head_dim, shape.block_size].map(|x| x as u32);
                if dims != want {
                    return Err(format!("model shape {dims:?} of the prefill worker differs from ours {want:?}"));
                }
                if p.get(16) != Some(&0) {
                    return Err("unsupported dtype".into());
                }
                let rest = p.get(17..).ok_or("truncated header")?;
                let (st, cnt) = (u32_at(rest, 0)? as usize, u32_at(rest, 1)? as usize);
                if st != start || cnt != n {
                    return Err(format!("prefill worker sends positions {st}+{cnt}, expected {start}+{n}"));
                }
                let toks: Result<Vec<u32>, String> = (0..cnt).map(|i| u32_at(rest, 2 + i)).collect();
                if toks? != expected {
                    return Err("prefill worker's token ids differ from the prompt".into());
                }
                header = true;
            }
            FRAME_LAYER => {
                if !header {
                    return Err("layer before header".into());
                }
                let (layer, st, cnt) = (u32_at(&p, 0)? as usize, u32_at(&p, 1)? as usize, u32_at(&p, 2)? as usize);
                let data = p.get(12..).ok_or("truncated layer")?;
                if layer >= shape.layers || st < start || st + cnt > start + n || data.len() != 8 * cnt * kvd {
                    return Err(format!("bad layer frame: layer {layer}, positions {st}+{cnt}"));
                }
                let (off, m) = ((st - start) * kvd, cnt * kvd);
                let (kb, vb) = data.split_at(4 * m);
                get_floats(&mut kv.k[layer][off..off + m], kb);
                get_floats(&mut kv.v[layer][off..off + m], vb);
                covered[layer][st - start..st - start + cnt].iter_mut().for_each(|c| *c = true);
                bytes += data.len() as u64;
            }
            FRAME_DONE => {
                let first = u32_at(&p, 0)?;
                if !header || covered.iter().any(|l| l.iter().any(|c| !c)) {
                    return Err("transfer ended before every position of every layer arrived".into());
                }
                let compute_us = p.get(4..12).and_then(|b| <[u8; 8]>::try_from(b).ok()).map_or(0, u64::from_le_bytes);
                return Ok((kv, bytes, wire, first, compute_us));
            }
            FRAME_ERROR => return Err(format!("prefill worker: {}", String::from_utf8_lossy(&p))),
            k => return Err(format!("unknown frame type {k}")),
        }
    }
}

/// A `POST` with a JSON body over a fresh connection; returns the status and the body.
pub(crate) async fn http_post_json(host_port: &str, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let mut s = TcpStream::connect(host_port).await.map_err(|e| format!("connect {host_port}: {e}"))?;
    let _ = s.set_nodelay(true);
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host_port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
    s.write_all(body).await.map_err(|e| format!("write: {e}"))?;
    let mut resp = Vec::new();
    (&mut s).take(16 << 20).read_to_end(&mut resp).await.map_err(|e| format!("read: {e}"))?;
    let split = resp.windows(4).position(|w| w == b"\r\n\r\n").ok_or("malformed HTTP response")?;
    let head = String::from_utf8_lossy(&resp[..split]).to_string();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("malformed status line: {head:.80}"))?;
    let mut body = resp[split + 4..].to_vec();
    if head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    }) {
        body = dechunk(&body).ok_or("malformed chunked body")?;
    }
    Ok((status, body))
}

/// Decode a chunked body.
fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let nl = b.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&b[..nl]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        b = &b[nl + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}

/// The KV-transfer address a prefill worker reported, made reachable: an unspecified IP is
/// replaced by the prefill worker's own host.
pub(crate) fn reachable(kv_addr: &str, prefill_host_port: &str) -> String {
    match kv_addr.parse::<SocketAddr>() {
        Ok(a) if a.ip().is_unspecified() => {
            let host = prefill_host_port.rsplit_once(':').map_or(prefill_host_port, |(h, _)| h);
            format!("{host}:{}", a.port())
        }
        _ => kv_addr.to_owned(),
    }
}

/// The mode's op code.
pub(crate) fn op_of(mode: TransferMode) -> u8 {
    match mode {
        TransferMode::Pull => OP_PULL,
        TransferMode::Push => OP_PUSH,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dechunk_and_reachable() {
        assert_eq!(dechunk(b"3\r\nabc\r\n2;x\r\nde\r\n0\r\n\r\n").unwrap(), b"abcde");
        assert!(dechunk(b"5\r\nab").is_none());
        assert_eq!(reachable("0.0.0.0:9001", "10.0.0.2:8000"), "10.0.0.2:9001");
        assert_eq!(reachable("127.0.0.1:9001", "10.0.0.2:8000"), "127.0.0.1:9001");
    }

    #[test]
    fn layer_frames_carry_their_count() {
        let m = TransferMsg::Layer { layer: 1, start: 16, k: vec![1.0; 6], v: vec![2.0; 6] };
        let f = frame(&m, 3);
        assert_eq!(f[0], FRAME_LAYER);
        assert_eq!(u32::from_le_bytes(f[1..5].try_into().unwrap()) as usize, f.len() - 5);
        assert_eq!(u32_at(&f[5..], 2).unwrap(), 2);
        assert_eq!(payload_bytes(&m), 48);
    }
}
