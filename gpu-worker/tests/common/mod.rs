//! Helpers shared by the integration tests: a tiny worker configuration, a blocking HTTP/1.1
//! client (JSON, server-sent events, chunked bodies) and bounded waits. Loopback only.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kvroute_worker::{ModelConfig, WorkerConfig};
use serde_json::Value;

/// Every wait in the tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(20);

/// A tiny model on loopback with OS-chosen ports.
pub fn tiny(num_blocks: u32) -> WorkerConfig {
    WorkerConfig {
        model: ModelConfig::tiny(),
        num_blocks,
        block_size: 16,
        max_model_len: 1024,
        max_batched_tokens: 256,
        kv_transfer_timeout_ms: 10_000,
        ..WorkerConfig::ephemeral()
    }
}

/// An HTTP response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// `data:` payloads of a server-sent-event body.
    pub fn sse(&self) -> Vec<String> {
        self.text().lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_owned).collect()
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let nl = b.windows(2).position(|w| w == b"\r\n").expect("chunk size line");
        let size = usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap().trim(), 16).unwrap();
        b = &b[nl + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// One request over a fresh connection (`Connection: close`).
pub fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
    let mut s = TcpStream::connect_timeout(&addr, WAIT).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("end of headers");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines.next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked")) {
        body = dechunk(&body);
    }
    Resp { status, headers, body }
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    request(addr, "POST", path, &[("content-type", "application/json")], body.to_string().as_bytes())
}

pub fn post_h(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &Value) -> Resp {
    request(addr, "POST", path, headers, body.to_string().as_bytes())
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], b"")
}

/// A completion over token ids; asserts 200 and returns the JSON.
pub fn complete(addr: SocketAddr, tokens: &[u32], max_tokens: u32) -> Value {
    let r = post(
        addr,
        "/v1/completions",
        &serde_json::json!({"prompt": tokens, "max_tokens": max_tokens, "return_token_ids": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// Output token ids of a completion response.
pub fn output_ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

pub fn cached_tokens(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

/// Poll `cond` until it holds or `WAIT` passes.
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Deterministic pseudo-random token ids in `0..vocab` (distinct prompts per `seed`).
pub fn prompt(seed: u32, len: usize, vocab: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % vocab
        })
        .collect()
}
