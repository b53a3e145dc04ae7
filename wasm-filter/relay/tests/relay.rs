//! The relay against a loopback publisher (vLLM framing and replay) and a loopback HTTP server
//! standing in for the filter's event path. Every wait is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute::{SubscriberConfig, END_SEQ};
use kvroute_relay::{EngineConfig, Relay, RelayConfig};

const EP: &str = "10.0.0.7:8000";
const SECRET: &str = "0123456789abcdef-secret";
const WAIT: Duration = Duration::from_secs(10);

/// A batch `[ts, [], nil]` (no events): enough for sequence handling.
fn batch(ts: f64) -> Vec<u8> {
    let mut b = vec![0x93, 0xcb];
    b.extend_from_slice(&ts.to_be_bytes());
    b.extend_from_slice(&[0x90, 0xc0]);
    b
}

#[derive(Debug, Clone)]
struct Post {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Post {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
    /// `batch:N` or `resync`.
    fn label(&self) -> String {
        match self.header("x-kvroute-kind") {
            Some("resync") => "resync".into(),
            _ => format!("batch:{}", self.header("x-kvroute-seq").unwrap_or("?")),
        }
    }
}

/// A keep-alive HTTP/1.1 server recording POSTs; `answer(post)` gives the status.
fn server(answer: impl Fn(&Post) -> u16 + Send + 'static) -> (String, Arc<Mutex<Vec<Post>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let posts = Arc::new(Mutex::new(Vec::new()));
    let p = posts.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let mut r = BufReader::new(conn.try_clone().unwrap());
            let mut w = conn;
            loop {
                let mut line = String::new();
                if r.read_line(&mut line).unwrap_or(0) == 0 {
                    break;
                }
                let mut headers = Vec::new();
                loop {
                    let mut h = String::new();
                    r.read_line(&mut h).unwrap();
                    let h = h.trim_end();
                    if h.is_empty() {
                        break;
                    }
                    let (k, v) = h.split_once(':').unwrap();
                    headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
                }
                let n: usize =
                    headers.iter().find(|(k, _)| k == "content-length").map_or(0, |(_, v)| v.parse().unwrap());
                let mut body = vec![0; n];
                r.read_exact(&mut body).unwrap();
                let post = Post { headers, body };
                let status = answer(&post);
                p.lock().unwrap().push(post);
                let reply = format!("HTTP/1.1 {status} X\r\ncontent-length: 2\r\n\r\n{{}}");
                if w.write_all(reply.as_bytes()).is_err() {
                    break;
                }
            }
        }
    });
    (url, posts)
}

fn wait_for(posts: &Arc<Mutex<Vec<Post>>>, n: usize) -> Vec<Post> {
    let t = Instant::now();
    while posts.lock().unwrap().len() < n && t.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    posts.lock().unwrap().clone()
}

/// An XPUB publisher on a loopback port; `wait_subscriber` blocks until the relay subscribed.
struct Publisher {
    sock: zmq::Socket,
    endpoint: String,
}

impl Publisher {
    fn new(ctx: &zmq::Context) -> Publisher {
        let sock = ctx.socket(zmq::XPUB).unwrap();
        sock.set_linger(0).unwrap();
        sock.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = sock.get_last_endpoint().unwrap().unwrap();
        Publisher { sock, endpoint }
    }
    fn wait_subscriber(&self) {
        assert!(self.sock.poll(zmq::POLLIN, WAIT.as_millis() as i64).unwrap() > 0, "no subscriber");
        let _ = self.sock.recv_bytes(0).unwrap();
    }
    fn send(&self, seq: u64, payload: &[u8]) {
        self.sock.send_multipart([&b"kv"[..], &seq.to_be_bytes()[..], payload], 0).unwrap();
    }
}

/// A replay server (ROUTER) answering one request with `batches` (vLLM ≥ 0.26 format) + end.
fn replay_server(ctx: &zmq::Context, batches: Vec<(u64, Vec<u8>)>) -> String {
    let sock = ctx.socket(zmq::ROUTER).unwrap();
    sock.set_linger(0).unwrap();
    sock.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = sock.get_last_endpoint().unwrap().unwrap();
    std::thread::spawn(move || {
        if sock.poll(zmq::POLLIN, WAIT.as_millis() as i64).unwrap() == 0 {
            return;
        }
        let req = sock.recv_multipart(0).unwrap();
        let (id, start) = (&req[0], u64::from_be_bytes(req[2].as_slice().try_into().unwrap()));
        for (seq, p) in batches.iter().filter(|(s, _)| *s >= start) {
            sock.send_multipart([&id[..], &[][..], &b"kv"[..], &seq.to_be_bytes()[..], p], 0).unwrap();
        }
        sock.send_multipart([&id[..], &[][..], &[][..], &END_SEQ.to_be_bytes()[..], &[][..]], 0).unwrap();
        std::thread::sleep(Duration::from_millis(500));
    });
    endpoint
}

fn config(url: &str, sub: SubscriberConfig) -> RelayConfig {
    RelayConfig {
        targets: vec![url.to_owned()],
        path: "/kvroute/v1/events".into(),
        secret_env: None,
        secret_file: None,
        timeout_ms: 2000,
        attempts: 2,
        queue_batches: 100,
        engines: vec![EngineConfig { endpoint: EP.into(), subscriber: sub }],
        replica: None,
    }
}

/// The post carries a valid signature by [`SECRET`] over its fields and body, with a timestamp
/// from the wall clock, and never the secret itself.
fn assert_signed(p: &Post, kind: &str, seq: Option<u64>) {
    assert_eq!(p.header("x-kvroute-secret"), None, "the secret never travels");
    assert_eq!(p.header("x-kvroute-kind"), Some(kind));
    assert_eq!(p.header("x-kvroute-seq").map(|s| s.parse::<u64>().unwrap()), seq);
    let ts: u64 = p.header("x-kvroute-timestamp").unwrap().parse().unwrap();
    assert!(ts > 1_600_000_000_000, "timestamp {ts} is the relay's wall clock in UNIX ms");
    let sig = p.header("x-kvroute-signature").unwrap();
    let mac = kvroute_filter::ingest::parse_signature(sig).unwrap();
    let ok = kvroute_filter::ingest::verify_signature(SECRET.as_bytes(), EP, kind, seq, ts, &p.body, &mac);
    assert!(ok, "signature {sig} of {kind} {seq:?}");
    let other = kvroute_filter::ingest::verify_signature(
        SECRET.as_bytes(),
        EP,
        kind,
        Some(seq.map_or(0, |s| s + 1)),
        ts,
        &p.body,
        &mac,
    );
    assert!(!other, "the signature covers the sequence number");
}

#[test]
fn batches_are_posted_in_order_with_the_protocol_headers_and_duplicates_dropped() {
    let ctx = zmq::Context::new();
    let publisher = Publisher::new(&ctx);
    let (url, posts) = server(|_| 200);
    let relay = Relay::start(&config(&url, SubscriberConfig::new(publisher.endpoint.as_str())), SECRET).unwrap();
    publisher.wait_subscriber();
    for seq in 0..4 {
        publisher.send(seq, &batch(1.0 + seq as f64));
    }
    publisher.send(2, &batch(3.0)); // a duplicate
    let got = wait_for(&posts, 4);
    assert_eq!(got.iter().map(Post::label).collect::<Vec<_>>(), ["batch:0", "batch:1", "batch:2", "batch:3"]);
    let p = &got[1];
    assert_signed(p, "batch", Some(1));
    assert_eq!(p.header("x-kvroute-endpoint"), Some(EP));
    assert_eq!(p.header("x-kvroute-topic"), Some("kv"));
    assert_eq!(p.header("content-type"), Some("application/msgpack"));
    assert_eq!(p.body, batch(2.0));
    let stats = relay.stop();
    assert_eq!((stats.batches, stats.duplicates, stats.posted), (4, 1, 4));
    // Each batch received was decoded once (for the judgment), the duplicate included; nothing
    // decodes a forwarded batch again.
    assert_eq!((stats.received, stats.decoded), (5, 5));
}

#[test]
fn a_gap_is_replayed_from_the_publisher() {
    let ctx = zmq::Context::new();
    let publisher = Publisher::new(&ctx);
    let replay = replay_server(&ctx, (0..6).map(|s| (s, batch(1.0 + s as f64))).collect());
    let (url, posts) = server(|_| 200);
    let mut sub = SubscriberConfig::new(publisher.endpoint.as_str());
    sub.replay_endpoint = Some(replay);
    let relay = Relay::start(&config(&url, sub), SECRET).unwrap();
    publisher.wait_subscriber();
    for seq in [0, 1, 4] {
        publisher.send(seq, &batch(1.0 + seq as f64));
    }
    let got = wait_for(&posts, 5);
    assert_eq!(
        got.iter().map(Post::label).collect::<Vec<_>>(),
        ["batch:0", "batch:1", "batch:2", "batch:3", "batch:4"]
    );
    // Replayed batches (2 and 3) are posted exactly as the live ones: payload and topic.
    for (seq, p) in got.iter().enumerate() {
        assert_eq!((p.header("x-kvroute-topic"), &p.body), (Some("kv"), &batch(1.0 + seq as f64)), "batch {seq}");
    }
    let stats = relay.stop();
    assert_eq!((stats.gaps, stats.replayed, stats.resyncs, stats.batches), (1, 2, 0, 5));
    // Decoded once each: the 3 live batches (the held one, 4, not again after the replay) and
    // the 3 replayed (1, the continuity proof, then 2 and 3).
    assert_eq!((stats.received, stats.decoded), (3, 6));
}

#[test]
fn an_unrecoverable_gap_posts_a_resync_notice_before_the_next_batch() {
    let ctx = zmq::Context::new();
    let publisher = Publisher::new(&ctx);
    let (url, posts) = server(|_| 200);
    let relay = Relay::start(&config(&url, SubscriberConfig::new(publisher.endpoint.as_str())), SECRET).unwrap();
    publisher.wait_subscriber();
    for seq in [0, 1, 5, 6] {
        publisher.send(seq, &batch(1.0 + seq as f64));
    }
    let got = wait_for(&posts, 5);
    assert_eq!(got.iter().map(Post::label).collect::<Vec<_>>(), ["batch:0", "batch:1", "resync", "batch:5", "batch:6"]);
    assert_signed(&got[2], "resync", None);
    assert!(got[2].body.is_empty());
    assert_eq!(relay.stop().resyncs, 1);
}

#[test]
fn a_restarted_engine_is_forwarded_from_its_first_batch() {
    let ctx = zmq::Context::new();
    let publisher = Publisher::new(&ctx);
    let (url, posts) = server(|_| 200);
    let relay = Relay::start(&config(&url, SubscriberConfig::new(publisher.endpoint.as_str())), SECRET).unwrap();
    publisher.wait_subscriber();
    for seq in 0..3 {
        publisher.send(seq, &batch(1.0 + seq as f64));
    }
    // A new process numbering from 0 (other content than the batch 0 forwarded): forwarded,
    // for the filter to judge as the restart it is.
    publisher.send(0, &batch(10.0));
    publisher.send(1, &batch(11.0));
    // Another restart, first seen at seq 1: its batch 0 was missed and there is no replay
    // socket, so the stream is resynchronized before the batch is forwarded.
    publisher.send(1, &batch(20.0));
    let got = wait_for(&posts, 7);
    assert_eq!(
        got.iter().map(Post::label).collect::<Vec<_>>(),
        ["batch:0", "batch:1", "batch:2", "batch:0", "batch:1", "resync", "batch:1"]
    );
    assert_eq!((got[3].body.as_slice(), got[6].body.as_slice()), (batch(10.0).as_slice(), batch(20.0).as_slice()));
    let stats = relay.stop();
    assert_eq!((stats.batches, stats.duplicates, stats.gaps, stats.resyncs), (6, 0, 1, 1));
}

#[test]
fn a_conflict_from_the_filter_resyncs_it_and_resends_the_batch() {
    let ctx = zmq::Context::new();
    let publisher = Publisher::new(&ctx);
    // The filter missed batch 1 (say its Envoy restarted): it answers 409 to batch 2 once.
    let refused = Arc::new(Mutex::new(false));
    let (url, posts) = server(move |p| {
        let mut r = refused.lock().unwrap();
        if p.label() == "batch:2" && !*r {
            *r = true;
            409
        } else {
            200
        }
    });
    let relay = Relay::start(&config(&url, SubscriberConfig::new(publisher.endpoint.as_str())), SECRET).unwrap();
    publisher.wait_subscriber();
    for seq in 0..4 {
        publisher.send(seq, &batch(1.0 + seq as f64));
    }
    let got = wait_for(&posts, 6);
    assert_eq!(
        got.iter().map(Post::label).collect::<Vec<_>>(),
        ["batch:0", "batch:1", "batch:2", "resync", "batch:2", "batch:3"]
    );
    assert_eq!(relay.stop().conflicts, 1);
}

#[test]
fn an_unreachable_target_does_not_stop_the_relay() {
    let ctx = zmq::Context::new();
    let publisher = Publisher::new(&ctx);
    // A port nobody listens on (bound then closed).
    let dead = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let relay =
        Relay::start(&config(&format!("http://{dead}"), SubscriberConfig::new(publisher.endpoint.as_str())), SECRET)
            .unwrap();
    publisher.wait_subscriber();
    publisher.send(0, &batch(1.0));
    let t = Instant::now();
    while relay.stats().post_failures == 0 && t.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(relay.is_running());
    assert_eq!(relay.stop().post_failures, 1);
}
