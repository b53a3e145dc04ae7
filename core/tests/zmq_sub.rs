//! The ZMQ subscriber (feature `zmq`) against a loopback publisher that speaks vLLM's framing
//! (`[topic, seq (8-byte BE), msgpack payload]`) and its replay protocol in both reply formats.
//!
//! Everything runs on 127.0.0.1 with ports chosen by the OS (`tcp://127.0.0.1:*`, then
//! `ZMQ_LAST_ENDPOINT`). The test publisher is an XPUB socket: it sees the subscriber's
//! subscription message, so it never publishes before the subscriber is connected (no
//! slow-joiner sleeps). Every wait is bounded.
#![cfg(feature = "zmq")]
#![allow(clippy::unwrap_used, clippy::expect_used)]
// Sans-IO is the library's rule (core/clippy.toml); this file tests its ZMQ adapter (feature
// `zmq`) with a publisher thread and bounded waits (Instant deadlines, sleeps).
#![allow(clippy::disallowed_methods)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvroute::{batch_digest, StreamTracker};
use kvroute::{
    Batch, BatchOrigin, Clock, EventSink, ReplayFailure, SocketMode, SubscribeError, SubscriberConfig, SubscriberEvent,
    SubscriberStats, Subscription, END_SEQ,
};
use kvroute::{Decision, EndpointSpec, MetricsSnapshot, Policy, Role, Router, StateError, StreamVerdict};

const A: &str = "127.0.0.1:8001";
const B: &str = "127.0.0.1:8002";
const WAIT: Duration = Duration::from_secs(10);
/// Tokens (and engine block size) per batch in the chains below: 4 blocks of 16.
const BLOCKS_PER_BATCH: u32 = 4;
const T0: u64 = 1_000_000;

// ---------------------------------------------------------------------------------------------
// router, clock, payloads
// ---------------------------------------------------------------------------------------------

/// A clock the test controls; the subscriber, metric timestamps and routing all read it.
fn test_clock() -> (Arc<AtomicU64>, Clock) {
    let now = Arc::new(AtomicU64::new(T0));
    let n = now.clone();
    (now, Arc::new(move || n.load(Ordering::SeqCst)))
}

/// Precise mode, decode endpoints A (one waiting request) and B (idle), metrics stamped by `clock`.
fn router(clock: &Clock) -> Arc<Router> {
    let r = Router::new(Policy::from_json(r#"{"index":{"mode":"precise"}}"#).unwrap());
    for (id, waiting) in [(A, 1), (B, 0)] {
        r.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
        let m = MetricsSnapshot { waiting, kv_usage: 0.2, updated_ms: clock(), ..Default::default() };
        r.update_metrics(id, m).unwrap();
    }
    Arc::new(r)
}

/// Route a completions request whose prompt is token ids `0..tokens`.
fn route(r: &Router, tokens: u32, clock: &Clock) -> Decision {
    let ids: Vec<u32> = (0..tokens).collect();
    let body = serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 300}).to_string();
    r.route_http(body.as_bytes(), [("x-request-id", "t")], clock()).unwrap()
}

fn matched(d: &Decision, ep: &str) -> u32 {
    d.score(ep).unwrap().matched_blocks
}

fn healthy(r: &Router, ep: &str) -> bool {
    r.endpoints().iter().find(|e| &*e.id == ep).unwrap().events_healthy
}

/// A named msgpack value writer.
type Field<'a> = (&'a str, &'a dyn Fn(&mut Vec<u8>));

/// How batch `k` of a chain is encoded.
#[derive(Clone, Copy)]
enum Encoding {
    /// vLLM ≥ 0.24: events are maps tagged by `"type"`.
    Map,
    /// vLLM ≤ 0.23: events are arrays tagged by their first element.
    Array,
}

/// Batch `k` of one prompt's chain: `BlockStored` of 4 blocks of 16 tokens (tokens `64k..64k+64`,
/// engine hashes `1000 + 4k + i`, parent = the previous batch's last block), with timestamp `ts`.
fn chain_batch(k: u32, ts: f64, enc: Encoding) -> Vec<u8> {
    chain_batch_at(0, k, ts, enc)
}

/// [`chain_batch`] of another prompt: tokens and engine hashes moved up by `offset`.
fn chain_batch_at(offset: u32, k: u32, ts: f64, enc: Encoding) -> Vec<u8> {
    use rmp::encode::*;
    let n = BLOCKS_PER_BATCH;
    let base = 1000 + u64::from(offset);
    let hashes: Vec<u64> = (0..n).map(|i| base + u64::from(n * k + i)).collect();
    let parent = (k > 0).then(|| base + u64::from(n * k) - 1);
    let first = offset + 16 * n * k;
    let mut b = Vec::new();
    write_array_len(&mut b, 3).unwrap();
    write_f64(&mut b, ts).unwrap();
    write_array_len(&mut b, 1).unwrap();
    let fields: [Field<'_>; 7] = [
        ("block_hashes", &|b| {
            write_array_len(b, n).unwrap();
            for &h in &hashes {
                write_uint(b, h).unwrap();
            }
        }),
        ("parent_block_hash", &|b| match parent {
            Some(p) => {
                write_uint(b, p).unwrap();
            }
            None => write_nil(b).unwrap(),
        }),
        ("token_ids", &|b| {
            write_array_len(b, 16 * n).unwrap();
            for t in first..first + 16 * n {
                write_uint(b, u64::from(t)).unwrap();
            }
        }),
        ("block_size", &|b| {
            write_uint(b, 16).unwrap();
        }),
        ("lora_id", &|b| write_nil(b).unwrap()),
        ("medium", &|b| write_str(b, "GPU").unwrap()),
        ("lora_name", &|b| write_nil(b).unwrap()),
    ];
    match enc {
        Encoding::Map => {
            write_map_len(&mut b, 1 + fields.len() as u32).unwrap();
            write_str(&mut b, "type").unwrap();
            write_str(&mut b, "BlockStored").unwrap();
            for (name, value) in fields {
                write_str(&mut b, name).unwrap();
                value(&mut b);
            }
        }
        Encoding::Array => {
            write_array_len(&mut b, 1 + fields.len() as u32).unwrap();
            write_str(&mut b, "BlockStored").unwrap();
            for (_, value) in fields {
                value(&mut b);
            }
        }
    }
    write_uint(&mut b, 0).unwrap(); // data_parallel_rank
    b
}

fn chain(batches: u32, enc: Encoding) -> Vec<Vec<u8>> {
    (0..batches).map(|k| chain_batch(k, 1.0 + f64::from(k), enc)).collect()
}

/// A router fed `payloads` (seq 0, 1, ...) directly, without ZMQ: what "nothing was lost" means.
fn reference(payloads: &[Vec<u8>], clock: &Clock) -> Arc<Router> {
    let r = router(clock);
    for (seq, p) in payloads.iter().enumerate() {
        r.apply_events(A, p, Some(seq as u64), clock()).unwrap();
    }
    r
}

// ---------------------------------------------------------------------------------------------
// test publisher: XPUB (live) + ROUTER (replay), vLLM's framing and replay protocol
// ---------------------------------------------------------------------------------------------

/// How the replay socket answers.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ReplayFormat {
    /// vLLM ≥ 0.26: `["", topic, seq, payload]`, end `["", "", END_SEQ, ""]`.
    V026,
    /// vLLM ≤ 0.23: `["", seq, payload]`, end `["", END_SEQ, ""]`.
    V023,
    /// Batches with the topic frame, end marker without it (`["", END_SEQ, ""]`).
    TopicOldEnd,
    /// Batches without the topic frame, end marker with it (`["", "", END_SEQ, ""]`).
    NoTopicNewEnd,
    /// Never answers.
    Silent,
}

type Buffer = Arc<Mutex<VecDeque<(Vec<u8>, u64, Vec<u8>)>>>;

struct ReplayServer {
    endpoint: String,
    requests: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ReplayServer {
    fn start(ctx: &zmq::Context, format: ReplayFormat, buffer: Buffer) -> ReplayServer {
        let sock = ctx.socket(zmq::ROUTER).unwrap();
        sock.set_linger(0).unwrap();
        sock.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = sock.get_last_endpoint().unwrap().unwrap();
        let (requests, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (req, st) = (requests.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::SeqCst) {
                if sock.poll(zmq::POLLIN, 10).unwrap() == 0 {
                    continue;
                }
                let frames = sock.recv_multipart(0).unwrap();
                // vLLM: `client_id, _, start_seq_bytes = frame` (anything else is ignored).
                let [id, _, start] = frames.as_slice() else { continue };
                req.fetch_add(1, Ordering::SeqCst);
                let start = u64::from_be_bytes(start.as_slice().try_into().unwrap());
                let end = END_SEQ.to_be_bytes();
                let e: &[u8] = b"";
                let (with_topic, end_with_topic) = match format {
                    ReplayFormat::Silent => continue,
                    ReplayFormat::V026 => (true, true),
                    ReplayFormat::V023 => (false, false),
                    ReplayFormat::TopicOldEnd => (true, false),
                    ReplayFormat::NoTopicNewEnd => (false, true),
                };
                for (topic, seq, payload) in buffer.lock().unwrap().iter().filter(|b| b.1 >= start) {
                    let seq = seq.to_be_bytes();
                    if with_topic {
                        sock.send_multipart([&id[..], e, topic, &seq, payload], 0).unwrap();
                    } else {
                        sock.send_multipart([&id[..], e, &seq, payload], 0).unwrap();
                    }
                }
                if end_with_topic {
                    sock.send_multipart([&id[..], e, e, &end, e], 0).unwrap();
                } else {
                    sock.send_multipart([&id[..], e, &end, e], 0).unwrap();
                }
            }
        });
        ReplayServer { endpoint, requests, stop, thread: Some(thread) }
    }
}

impl Drop for ReplayServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

struct Publisher {
    ctx: zmq::Context,
    sock: zmq::Socket,
    /// The bound endpoint (`None` when connected to a binding subscriber).
    bound: Option<String>,
    topic: String,
    next_seq: u64,
    /// Replay buffer: (topic, seq, payload), at most `capacity` entries.
    buffer: Buffer,
    capacity: usize,
    replay: Option<ReplayServer>,
}

impl Publisher {
    fn xpub(ctx: &zmq::Context) -> zmq::Socket {
        let s = ctx.socket(zmq::XPUB).unwrap();
        s.set_linger(0).unwrap();
        s.set_xpub_verbose(true).unwrap();
        s
    }

    fn new(sock: zmq::Socket, ctx: zmq::Context, bound: Option<String>, replay: Option<ReplayFormat>) -> Self {
        let buffer: Buffer = Arc::default();
        let replay = replay.map(|f| ReplayServer::start(&ctx, f, buffer.clone()));
        Publisher { ctx, sock, bound, topic: String::new(), next_seq: 0, buffer, capacity: 10_000, replay }
    }

    /// A publisher that binds a free loopback port (the subscriber connects).
    fn bind(replay: Option<ReplayFormat>) -> Self {
        let ctx = zmq::Context::new();
        let sock = Self::xpub(&ctx);
        sock.bind("tcp://127.0.0.1:*").unwrap();
        let ep = sock.get_last_endpoint().unwrap().unwrap();
        Self::new(sock, ctx, Some(ep), replay)
    }

    /// A publisher that connects to a subscriber that bound `endpoint`.
    fn connect(endpoint: &str) -> Self {
        let ctx = zmq::Context::new();
        let sock = Self::xpub(&ctx);
        sock.connect(endpoint).unwrap();
        Self::new(sock, ctx, None, None)
    }

    fn endpoint(&self) -> String {
        self.bound.clone().unwrap()
    }

    fn replay_endpoint(&self) -> String {
        self.replay.as_ref().unwrap().endpoint.clone()
    }

    /// Block until a subscriber's subscription message arrives (bounded).
    fn wait_subscribed(&self) {
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            if self.sock.poll(zmq::POLLIN, 20).unwrap() > 0 {
                let msg = self.sock.recv_bytes(0).unwrap();
                if msg.first() == Some(&1) {
                    return;
                }
            }
        }
        panic!("no subscriber connected within {WAIT:?}");
    }

    fn record(&mut self, payload: &[u8]) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let mut buf = self.buffer.lock().unwrap();
        buf.push_back((self.topic.as_bytes().to_vec(), seq, payload.to_vec()));
        while buf.len() > self.capacity {
            buf.pop_front();
        }
        seq
    }

    /// Publish the next batch (like vLLM: send, then keep it for replay).
    fn publish(&mut self, payload: &[u8]) {
        let seq = self.next_seq;
        self.sock.send_multipart([self.topic.as_bytes(), &seq.to_be_bytes(), payload], 0).unwrap();
        self.record(payload);
    }

    /// A batch the subscriber never receives (dropped on the way), still in the replay buffer.
    fn lose(&mut self, payload: &[u8]) {
        self.record(payload);
    }

    fn send_raw(&self, frames: &[&[u8]]) {
        self.sock.send_multipart(frames, 0).unwrap();
    }

    /// The engine restarts: a new socket on the same address, sequence from 0, empty buffer.
    fn restart(&mut self) {
        self.reconnect();
        self.next_seq = 0;
        self.buffer.lock().unwrap().clear();
    }

    /// The connection drops and comes back (a new socket on the same address), the same
    /// process: sequence and replay buffer go on.
    fn reconnect(&mut self) {
        let ep = self.endpoint();
        self.sock = Self::xpub(&self.ctx); // the old socket is closed here
        let deadline = Instant::now() + WAIT;
        while let Err(e) = self.sock.bind(&ep) {
            assert!(Instant::now() < deadline, "rebinding {ep}: {e}");
            std::thread::sleep(Duration::from_millis(10));
        }
        self.wait_subscribed();
    }
}

// ---------------------------------------------------------------------------------------------
// subscriber helpers
// ---------------------------------------------------------------------------------------------

fn config(endpoint: &str) -> SubscriberConfig {
    let mut c = SubscriberConfig::new(endpoint);
    c.poll_interval_ms = 20;
    c.replay_timeout_ms = 2_000;
    c
}

type Seen = Arc<Mutex<Vec<SubscriberEvent>>>;

/// A publisher with a (vLLM 0.26-format) replay socket, and a subscriber started on it and
/// subscribed.
fn start_with_replay(r: &Arc<Router>, clock: &Clock) -> (Publisher, Subscription, Seen) {
    let publisher = Publisher::bind(Some(ReplayFormat::V026));
    let mut cfg = config(&publisher.endpoint());
    cfg.replay_endpoint = Some(publisher.replay_endpoint());
    let (sub, seen) = start(r, cfg, clock);
    publisher.wait_subscribed();
    (publisher, sub, seen)
}

fn start(r: &Arc<Router>, cfg: SubscriberConfig, clock: &Clock) -> (Subscription, Seen) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let observer = Arc::new(move |e: &SubscriberEvent| s.lock().unwrap().push(e.clone()));
    let sub = Subscription::start_with_observer(r.clone(), A, cfg, clock.clone(), Some(observer)).unwrap();
    (sub, seen)
}

fn wait_for(sub: &Subscription, what: &str, cond: impl Fn(&SubscriberStats) -> bool) {
    let deadline = Instant::now() + WAIT;
    loop {
        let s = sub.stats();
        if cond(&s) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn stop(sub: Subscription) -> SubscriberStats {
    let t = Instant::now();
    let stats = sub.stop().unwrap();
    // A stop that hangs would never return; one that returns is prompt by construction (it wakes
    // within one poll interval). The bound only catches the hang, with room for a busy machine.
    assert!(t.elapsed() < WAIT, "stop took {:?}", t.elapsed());
    stats
}

// ---------------------------------------------------------------------------------------------
// tests
// ---------------------------------------------------------------------------------------------

#[test]
fn in_order_stream_is_applied_and_routes() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(None);
    let (sub, seen) = start(&r, config(&publisher.endpoint()), &clock);
    assert_eq!(sub.local_endpoint(), publisher.endpoint(), "connect mode: the publisher's endpoint");
    assert_eq!(sub.endpoint_id(), A);
    publisher.wait_subscribed();
    for p in chain(4, Encoding::Map) {
        publisher.publish(&p);
    }
    wait_for(&sub, "4 applied batches", |s| s.applied == 4);
    let precise = r.stats().precise;
    assert_eq!((precise.batches, precise.blocks_stored, precise.orphan_blocks, precise.gaps), (4, 16, 0, 0));
    // Endpoint A holds the whole 256-token prompt per its engine: a full precise hit, although
    // B has the shorter queue.
    let d = route(&r, 256, &clock);
    assert_eq!(d.endpoint(), Some(A));
    assert!(d.score(A).unwrap().precise);
    assert_eq!((matched(&d, A), matched(&d, B)), (16, 0));
    assert_eq!(d.prefix_hit, 1.0);
    assert!(healthy(&r, A));
    let stats = stop(sub);
    let expected = SubscriberStats { messages: 4, batches: 4, decoded: 4, applied: 4, ..Default::default() };
    assert_eq!(stats, expected);
    assert!(seen.lock().unwrap().is_empty(), "nothing unusual: {:?}", seen.lock().unwrap());
}

#[test]
fn topic_filter_drops_other_topics() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(None);
    publisher.topic = "kv@rank0".into();
    let mut cfg = config(&publisher.endpoint());
    cfg.topic = "kv@rank0".into();
    let (sub, _) = start(&r, cfg, &clock);
    publisher.wait_subscribed();
    let batches = chain(3, Encoding::Map);
    // Another rank's stream (its own numbering) interleaved with ours: none of it may arrive, or
    // its sequence numbers would show up as gaps and its blocks on A.
    for (k, p) in batches.iter().enumerate() {
        publisher.send_raw(&[b"kv@rank1", &(50 + k as u64).to_be_bytes(), &chain_batch(7, 9.0, Encoding::Map)]);
        publisher.publish(p);
    }
    // Ordered delivery: once our last batch is in, anything before it that passed the filter is too.
    wait_for(&sub, "3 applied batches", |s| s.applied == 3);
    let stats = stop(sub);
    assert_eq!((stats.messages, stats.batches, stats.applied, stats.gaps), (3, 3, 3, 0));
    let precise = r.stats().precise;
    assert_eq!((precise.batches, precise.blocks_stored, precise.gaps), (3, 12, 0));
}

#[test]
fn bind_mode_publisher_connects_and_old_event_encoding_is_applied() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let cfg = config("tcp://127.0.0.1:*");
    assert!(cfg.binds(), "a wildcard port binds (vLLM's rule, mirrored)");
    let (sub, _) = start(&r, cfg, &clock);
    let bound = sub.local_endpoint().to_owned();
    assert!(bound.starts_with("tcp://127.0.0.1:") && !bound.ends_with(":*"), "resolved port: {bound}");
    // The publisher (vLLM with a concrete endpoint) connects to us.
    let mut publisher = Publisher::connect(&bound);
    publisher.wait_subscribed();
    for p in chain(3, Encoding::Array) {
        publisher.publish(&p);
    }
    wait_for(&sub, "3 applied batches", |s| s.applied == 3);
    let d = route(&r, 192, &clock);
    assert_eq!((d.endpoint(), matched(&d, A)), (Some(A), 12));
    let stats = stop(sub);
    assert_eq!((stats.batches, stats.applied, stats.decode_errors), (3, 3, 0));

    // An explicit bind on a concrete address works too, and a second bind of it is an error
    // reported by `start`.
    let mut cfg = config(&bound);
    cfg.mode = SocketMode::Bind;
    let first = Subscription::start(r.clone(), A, cfg.clone(), clock.clone()).unwrap();
    let second = Subscription::start(r, A, cfg, clock);
    assert!(matches!(second, Err(SubscribeError::Socket { op: "bind", .. })), "{second:?}");
    stop(first);
}

fn gap_is_replayed(format: ReplayFormat) {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(Some(format));
    let mut cfg = config(&publisher.endpoint());
    cfg.replay_endpoint = Some(publisher.replay_endpoint());
    let (sub, seen) = start(&r, cfg, &clock);
    publisher.wait_subscribed();
    let batches = chain(6, Encoding::Map);
    publisher.publish(&batches[0]);
    publisher.lose(&batches[1]);
    publisher.lose(&batches[2]);
    publisher.publish(&batches[3]); // reveals the gap: held, 1 and 2 replayed, then applied
    publisher.publish(&batches[4]);
    publisher.lose(&batches[5]); // a gap nobody has noticed yet: never applied
    wait_for(&sub, "5 applied batches", |s| s.applied == 5);
    let stats = stop(sub);
    // Decoded once each: the 3 live batches (the held one is not decoded again when it is
    // submitted after the replay) and the 3 replayed (0, the continuity proof, then 1 and 2).
    let expected = SubscriberStats {
        messages: 3,
        batches: 3,
        decoded: 6,
        applied: 5,
        gaps: 1,
        replays: 1,
        replayed_batches: 2,
        ..Default::default()
    };
    assert_eq!(stats, expected, "{format:?}");
    assert_eq!(publisher.replay.as_ref().unwrap().requests.load(Ordering::SeqCst), 1);
    assert_eq!(*seen.lock().unwrap(), vec![SubscriberEvent::Gap { expected: 1, got: 3 }]);
    // The index is exactly what an unbroken stream of batches 0..=4 builds.
    let want = reference(&batches[..5], &clock);
    let (got_p, want_p) = (r.stats().precise, want.stats().precise);
    assert_eq!((got_p.index, got_p.blocks_stored, got_p.orphan_blocks), (want_p.index, want_p.blocks_stored, 0));
    assert_eq!((got_p.gaps, got_p.resyncs), (1, 0));
    assert!(healthy(&r, A));
    let d = route(&r, 384, &clock);
    assert_eq!((d.endpoint(), matched(&d, A)), (Some(A), 20));
    assert_eq!(matched(&route(&want, 384, &clock), A), 20);
}

#[test]
fn gap_is_replayed_vllm_026_format() {
    gap_is_replayed(ReplayFormat::V026);
}

#[test]
fn gap_is_replayed_vllm_023_format() {
    gap_is_replayed(ReplayFormat::V023);
}

/// SGLang 0.5.23's replay ROUTER answers exactly like vLLM ≥ 0.26 (`_service_replay`: per batch
/// `[id, "", topic, seq, payload]`, then `[id, "", "", END_SEQ, ""]`), covered by the 0.26 case.
/// The subscriber judges each reply by its own frame count, so either end marker closes either
/// batch layout.
#[test]
fn gap_is_replayed_with_mixed_topic_and_end_marker_layouts() {
    gap_is_replayed(ReplayFormat::TopicOldEnd);
    gap_is_replayed(ReplayFormat::NoTopicNewEnd);
}

/// After a resync: the endpoint was cleared, is stale, and the held batch was accepted as a
/// fresh start (its parent is unknown, so its blocks are orphans).
/// Publishes batch 0, loses batch 1 (kept in the replay buffer, never sent live), publishes
/// batch 2: the subscriber sees a gap at 1.
fn publish_with_a_gap(publisher: &mut Publisher) {
    let batches = chain(3, Encoding::Map);
    publisher.publish(&batches[0]);
    publisher.lose(&batches[1]);
    publisher.publish(&batches[2]);
}

fn assert_resynced(r: &Router, clock: &Clock) {
    let precise = r.stats().precise;
    assert_eq!((precise.resyncs, precise.orphan_blocks), (1, u64::from(BLOCKS_PER_BATCH)));
    assert!(!healthy(r, A), "stale after resync");
    let d = route(r, 256, clock);
    assert_eq!(matched(&d, A), 0, "cleared");
}

#[test]
fn replay_too_old_resyncs() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(Some(ReplayFormat::V026));
    publisher.capacity = 2;
    let mut cfg = config(&publisher.endpoint());
    cfg.replay_endpoint = Some(publisher.replay_endpoint());
    let (sub, seen) = start(&r, cfg, &clock);
    publisher.wait_subscribed();
    let batches = chain(5, Encoding::Map);
    publisher.publish(&batches[0]);
    for p in &batches[1..4] {
        publisher.lose(p);
    }
    publisher.publish(&batches[4]); // buffer now holds 3 and 4 only
    wait_for(&sub, "a resync", |s| s.resyncs == 1 && s.applied == 2);
    let stats = stop(sub);
    assert_eq!((stats.gaps, stats.replays, stats.replay_failures, stats.replayed_batches), (1, 1, 1, 0));
    let seen = seen.lock().unwrap().clone();
    // Like vLLM, the publisher sends batch 4 before it buffers it: a replay request served in
    // between finds 2 and 3 in the buffer, one served after it 3 and 4.
    let first = match seen.get(1) {
        Some(SubscriberEvent::ReplayFailed { reason: ReplayFailure::TooOld { first, .. }, .. }) => *first,
        other => panic!("{other:?}"),
    };
    assert!((2..=3).contains(&first), "{seen:?}");
    assert_eq!(
        seen,
        vec![
            SubscriberEvent::Gap { expected: 1, got: 4 },
            SubscriberEvent::ReplayFailed { expected: 1, reason: ReplayFailure::TooOld { expected: 1, first } },
            SubscriberEvent::Resync { expected: 1, got: 4 },
        ]
    );
    assert_resynced(&r, &clock);
}

#[test]
fn no_replay_endpoint_resyncs() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(None);
    let (sub, seen) = start(&r, config(&publisher.endpoint()), &clock);
    publisher.wait_subscribed();
    publish_with_a_gap(&mut publisher);
    wait_for(&sub, "a resync", |s| s.resyncs == 1 && s.applied == 2);
    let stats = stop(sub);
    assert_eq!((stats.gaps, stats.replays, stats.replay_failures), (1, 0, 0));
    assert!(seen
        .lock()
        .unwrap()
        .contains(&SubscriberEvent::ReplayFailed { expected: 1, reason: ReplayFailure::Unavailable }));
    assert_resynced(&r, &clock);
}

#[test]
fn silent_replay_times_out_then_resyncs() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(Some(ReplayFormat::Silent));
    let mut cfg = config(&publisher.endpoint());
    cfg.replay_endpoint = Some(publisher.replay_endpoint());
    cfg.replay_timeout_ms = 300;
    let (sub, seen) = start(&r, cfg, &clock);
    publisher.wait_subscribed();
    publish_with_a_gap(&mut publisher);
    wait_for(&sub, "a resync", |s| s.resyncs == 1 && s.applied == 2);
    let stats = stop(sub);
    assert_eq!((stats.replays, stats.replay_failures), (1, 1));
    assert!(seen.lock().unwrap().contains(&SubscriberEvent::ReplayFailed {
        expected: 1,
        reason: ReplayFailure::Timeout { timeout_ms: 300, received: 0 }
    }));
    assert_resynced(&r, &clock);
}

#[test]
fn stop_is_prompt_even_while_waiting_for_a_replay() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(Some(ReplayFormat::Silent));
    let mut cfg = config(&publisher.endpoint());
    cfg.replay_endpoint = Some(publisher.replay_endpoint());
    cfg.replay_timeout_ms = 60_000;
    cfg.poll_interval_ms = 100;
    let (sub, _) = start(&r, cfg, &clock);
    publisher.wait_subscribed();
    publish_with_a_gap(&mut publisher);
    let requests = publisher.replay.as_ref().unwrap().requests.clone();
    let deadline = Instant::now() + WAIT;
    while requests.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "no replay request");
        std::thread::sleep(Duration::from_millis(5));
    }
    let stats = stop(sub); // < 1 s although the replay would wait 60 s
    assert_eq!((stats.replays, stats.replay_failures, stats.resyncs), (1, 0, 0), "abandoned, not failed");
}

#[test]
fn publisher_restart_is_a_reset() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(None);
    let (sub, seen) = start(&r, config(&publisher.endpoint()), &clock);
    publisher.wait_subscribed();
    for p in chain(3, Encoding::Map) {
        publisher.publish(&p);
    }
    wait_for(&sub, "3 applied batches", |s| s.applied == 3);
    assert_eq!(r.stats().precise.index.memberships, 12);
    publisher.restart();
    // The new engine process numbers from 0 again and has a newer clock; it holds only the first
    // batch's blocks.
    publisher.publish(&chain_batch(0, 100.0, Encoding::Map));
    wait_for(&sub, "the restarted stream", |s| s.applied == 4);
    let stats = stop(sub);
    assert_eq!((stats.resets, stats.gaps, stats.resyncs, stats.duplicates), (1, 0, 0, 0));
    assert_eq!(*seen.lock().unwrap(), vec![SubscriberEvent::Reset { seq: 0 }]);
    let precise = r.stats().precise;
    assert_eq!((precise.resets, precise.index.memberships), (1, 4));
    let d = route(&r, 192, &clock);
    assert_eq!(matched(&d, A), 4, "old entries cleared, new batch applied");
    assert!(healthy(&r, A));
}

#[test]
fn garbage_frames_are_counted_and_skipped() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(None);
    let (sub, seen) = start(&r, config(&publisher.endpoint()), &clock);
    publisher.wait_subscribed();
    let seq0 = 0u64.to_be_bytes();
    publisher.send_raw(&[b"only-a-topic"]);
    publisher.send_raw(&[b"", &seq0]);
    publisher.send_raw(&[b"", &seq0, b"\x90", b"extra"]);
    publisher.send_raw(&[b"", b"\x00\x01\x02", b"\x90"]); // sequence frame of 3 bytes
    publisher.send_raw(&[b"", &seq0, b"\xc1\xff\x00garbage"]); // undecodable payload
    publisher.send_raw(&[b"", &[0xff; 8], b""]); // empty payload, seq u64::MAX
    let batches = chain(2, Encoding::Map);
    for p in &batches {
        publisher.publish(p);
    }
    wait_for(&sub, "2 applied batches", |s| s.applied == 2);
    assert!(sub.is_running());
    let stats = stop(sub);
    assert_eq!((stats.messages, stats.malformed, stats.decode_errors), (8, 4, 2));
    assert_eq!((stats.batches, stats.applied, stats.gaps, stats.resyncs), (4, 2, 0, 0));
    let seen = seen.lock().unwrap();
    assert_eq!(seen.iter().filter(|e| matches!(e, SubscriberEvent::Malformed { .. })).count(), 4);
    assert!(matches!(seen[4], SubscriberEvent::Decode { seq: 0, .. }), "{:?}", seen[4]);
    assert_eq!(r.stats().precise.blocks_stored, 8);
}

#[test]
fn unregistered_endpoint_is_counted_not_fatal() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(None);
    let sub = Subscription::start(r.clone(), "127.0.0.1:9999", config(&publisher.endpoint()), clock.clone()).unwrap();
    publisher.wait_subscribed();
    for p in chain(2, Encoding::Map) {
        publisher.publish(&p);
    }
    wait_for(&sub, "2 refused batches", |s| s.router_errors == 2);
    assert!(sub.is_running());
    let stats = stop(sub);
    assert_eq!((stats.batches, stats.applied), (2, 0));
    assert_eq!(r.stats().precise.batches, 0);
}

#[test]
fn start_errors_and_shutdown() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let err = Subscription::start(r.clone(), A, config("tcp://127.0.0.1:notaport"), clock.clone()).unwrap_err();
    assert!(matches!(err, SubscribeError::Socket { op: "connect", .. }), "{err}");
    let err = Subscription::start(r.clone(), "nope", config("tcp://127.0.0.1:5557"), clock.clone()).unwrap_err();
    assert!(matches!(err, SubscribeError::EndpointId(_)), "{err}");
    let err = Subscription::start(r.clone(), A, config("127.0.0.1:5557"), clock.clone()).unwrap_err();
    assert!(matches!(err, SubscribeError::InvalidConfig { field: "endpoint", .. }), "{err}");

    // An idle subscription stops promptly at the default poll interval; dropping stops it too.
    let publisher = Publisher::bind(None);
    let sub = Subscription::start(r.clone(), A, SubscriberConfig::new(publisher.endpoint()), clock.clone()).unwrap();
    assert!(sub.is_running());
    assert_eq!(stop(sub), SubscriberStats::default());
    let sub = Subscription::start(r, A, config(&publisher.endpoint()), clock).unwrap();
    let t = Instant::now();
    drop(sub);
    assert!(t.elapsed() < WAIT, "drop took {:?}", t.elapsed());
}

#[test]
fn real_vllm_and_sglang_payloads_from_fixtures() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/events");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "msgpack"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    if files.is_empty() {
        eprintln!("no fixtures in {}: skipped", dir.display());
        return;
    }
    let payloads: Vec<Vec<u8>> = files.iter().map(|p| std::fs::read(p).unwrap()).collect();
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(None);
    let (sub, seen) = start(&r, config(&publisher.endpoint()), &clock);
    publisher.wait_subscribed();
    for p in &payloads {
        publisher.publish(p);
    }
    let n = payloads.len() as u64;
    wait_for(&sub, "every fixture", |s| s.applied + s.decode_errors == n);
    let stats = stop(sub);
    assert_eq!(stats.decode_errors, 0, "{:?}", seen.lock().unwrap());
    // Over ZMQ or straight into the router: the same index.
    let want = reference(&payloads, &clock).stats().precise;
    assert_eq!(r.stats().precise, want);
    assert_eq!(want.batches, n);
}

#[test]
fn undecodable_batch_mid_stream_ends_in_a_resync() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let (mut publisher, sub, seen) = start_with_replay(&r, &clock);
    let batches = chain(3, Encoding::Map);
    publisher.publish(&batches[0]);
    publisher.publish(b"\xc1 not msgpack"); // seq 1: never applied, so seq 2 is a gap
    publisher.publish(&batches[2]);
    wait_for(&sub, "a resync", |s| s.resyncs == 1 && s.applied == 2);
    let stats = stop(sub);
    // Live decode error, then the replay brings the same bytes: the stream cannot be repaired.
    assert_eq!((stats.decode_errors, stats.gaps, stats.replays, stats.replay_failures), (2, 1, 1, 1));
    assert!(seen
        .lock()
        .unwrap()
        .contains(&SubscriberEvent::ReplayFailed { expected: 1, reason: ReplayFailure::Unusable { seq: 1 } }));
    assert_resynced(&r, &clock);
}

// ---------------------------------------------------------------------------------------------
// sinks: raw batches handed out in order (for forwarders such as the filter's relay)
// ---------------------------------------------------------------------------------------------

/// What a [`Recorder`] saw, in the one order the worker called it: accepted batches (copied)
/// and stream events.
#[derive(Debug, Clone, PartialEq)]
enum Hooked {
    Batch { topic: Option<Vec<u8>>, seq: u64, payload: Vec<u8>, origin: BatchOrigin, verdict: StreamVerdict },
    Event(SubscriberEvent),
}

type HookLog = Arc<Mutex<Vec<Hooked>>>;

/// A sink in front of the router: each batch goes to the router, and the ones it accepted are
/// logged raw with its verdict, like a forwarder's; every notice is logged too.
struct Recorder {
    router: Arc<Router>,
    log: HookLog,
}

impl EventSink for Recorder {
    fn deliver(&self, endpoint: &str, b: &Batch<'_>, now_ms: u64) -> Result<StreamVerdict, StateError> {
        let verdict = self.router.deliver(endpoint, b, now_ms)?;
        if verdict.accepted() {
            self.log.lock().unwrap().push(Hooked::Batch {
                topic: b.topic.map(<[u8]>::to_vec),
                seq: b.seq,
                payload: b.payload.to_vec(),
                origin: b.origin,
                verdict,
            });
        }
        Ok(verdict)
    }
    fn resync(&self, endpoint: &str, now_ms: u64) -> Result<(), StateError> {
        EventSink::resync(&*self.router, endpoint, now_ms)
    }
    fn replay_ended(&self, endpoint: &str, ok: bool) {
        self.router.replay_ended(endpoint, ok);
    }
    fn notice(&self, _endpoint: &str, event: &SubscriberEvent) {
        self.log.lock().unwrap().push(Hooked::Event(event.clone()));
    }
}

fn start_hooked(r: &Arc<Router>, cfg: SubscriberConfig, clock: &Clock) -> (Subscription, HookLog) {
    let log: HookLog = Arc::default();
    // Through a trait object, as a program choosing its sink at run time holds it.
    let sink: Arc<dyn EventSink> = Arc::new(Recorder { router: r.clone(), log: log.clone() });
    let sub = Subscription::start(sink, A, cfg, clock.clone()).unwrap();
    (sub, log)
}

fn live(topic: &str, seq: u64, payload: &[u8]) -> Hooked {
    Hooked::Batch {
        topic: Some(topic.as_bytes().to_vec()),
        seq,
        payload: payload.to_vec(),
        origin: BatchOrigin::Live,
        verdict: StreamVerdict::Applied,
    }
}

#[test]
fn a_sink_gets_accepted_batches_raw_in_order_and_nothing_else() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(None);
    publisher.topic = "kv@rank0".into();
    let mut cfg = config(&publisher.endpoint());
    cfg.topic = "kv@rank0".into();
    let (sub, log) = start_hooked(&r, cfg, &clock);
    publisher.wait_subscribed();
    let batches = chain(3, Encoding::Map);
    for p in &batches {
        publisher.publish(p);
    }
    let seq = |n: u64| n.to_be_bytes();
    publisher.send_raw(&[b"kv@rank0", &seq(1), &batches[1]]); // a duplicate
    publisher.send_raw(&[b"kv@rank1", &seq(9), &batches[2]]); // another topic: filtered out
    publisher.send_raw(&[b"kv@rank0", &seq(3), b"\xc1 not msgpack"]); // does not decode
    publisher.send_raw(&[b"kv@rank0", b"short"]); // malformed
    wait_for(&sub, "everything", |s| s.applied == 3 && s.duplicates == 1 && s.decode_errors == 1 && s.malformed == 1);
    let stats = stop(sub);
    // A sink in front of the router changes nothing in what the subscription does or counts.
    let expected = SubscriberStats {
        messages: 6,
        batches: 5,
        decoded: 5,
        applied: 3,
        duplicates: 1,
        decode_errors: 1,
        malformed: 1,
        ..Default::default()
    };
    assert_eq!(stats, expected);
    let log = log.lock().unwrap().clone();
    assert_eq!(log.len(), 5, "{log:?}");
    for (k, p) in batches.iter().enumerate() {
        assert_eq!(log[k], live("kv@rank0", k as u64, p), "batch {k}: the payload exactly as published");
    }
    assert!(matches!(log[3], Hooked::Event(SubscriberEvent::Decode { seq: 3, .. })), "{:?}", log[3]);
    assert!(matches!(log[4], Hooked::Event(SubscriberEvent::Malformed { frames: 2, .. })), "{:?}", log[4]);
    let (got, want) = (r.stats().precise, reference(&batches, &clock).stats().precise);
    assert_eq!((got.index, got.blocks_stored, got.batches), (want.index, want.blocks_stored, want.batches));
}

fn a_sink_gets_replayed_batches_before_the_held_one(format: ReplayFormat) {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(Some(format));
    publisher.topic = "kv".into();
    let mut cfg = config(&publisher.endpoint());
    cfg.replay_endpoint = Some(publisher.replay_endpoint());
    let (sub, log) = start_hooked(&r, cfg, &clock);
    publisher.wait_subscribed();
    let batches = chain(5, Encoding::Map);
    publisher.publish(&batches[0]);
    publisher.lose(&batches[1]);
    publisher.lose(&batches[2]);
    publisher.publish(&batches[3]);
    publisher.publish(&batches[4]);
    wait_for(&sub, "5 applied batches", |s| s.applied == 5);
    let stats = stop(sub);
    assert_eq!((stats.gaps, stats.replayed_batches, stats.resyncs), (1, 2, 0));
    // vLLM ≤ 0.23 replies carry no topic frame.
    let replay_topic = (format == ReplayFormat::V026).then(|| b"kv".to_vec());
    let replayed = |seq: usize| Hooked::Batch {
        topic: replay_topic.clone(),
        seq: seq as u64,
        payload: batches[seq].clone(),
        origin: BatchOrigin::Replay,
        verdict: StreamVerdict::Applied,
    };
    assert_eq!(
        *log.lock().unwrap(),
        vec![
            live("kv", 0, &batches[0]),
            Hooked::Event(SubscriberEvent::Gap { expected: 1, got: 3 }),
            replayed(1),
            replayed(2),
            live("kv", 3, &batches[3]),
            live("kv", 4, &batches[4]),
        ],
        "{format:?}"
    );
}

#[test]
fn a_sink_gets_replayed_batches_before_the_held_one_vllm_026_format() {
    a_sink_gets_replayed_batches_before_the_held_one(ReplayFormat::V026);
}

#[test]
fn a_sink_gets_replayed_batches_before_the_held_one_vllm_023_format() {
    a_sink_gets_replayed_batches_before_the_held_one(ReplayFormat::V023);
}

#[test]
fn a_sink_learns_of_a_resync_before_the_fresh_start_and_of_a_reset_with_its_batch() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(None);
    let (sub, log) = start_hooked(&r, config(&publisher.endpoint()), &clock);
    publisher.wait_subscribed();
    publish_with_a_gap(&mut publisher); // 0, (1 lost), 2: no replay endpoint, so a resync
    wait_for(&sub, "a resync", |s| s.resyncs == 1 && s.applied == 2);
    publisher.restart();
    let restarted = chain_batch(0, 100.0, Encoding::Map);
    publisher.publish(&restarted);
    wait_for(&sub, "the restarted stream", |s| s.resets == 1);
    stop(sub);
    let batches = chain(3, Encoding::Map);
    assert_eq!(
        *log.lock().unwrap(),
        vec![
            live("", 0, &batches[0]),
            Hooked::Event(SubscriberEvent::Gap { expected: 1, got: 2 }),
            Hooked::Event(SubscriberEvent::ReplayFailed { expected: 1, reason: ReplayFailure::Unavailable }),
            Hooked::Event(SubscriberEvent::Resync { expected: 1, got: 2 }),
            live("", 2, &batches[2]),
            // The sink's own verdict: the notice follows the delivery that returned it.
            Hooked::Batch {
                topic: Some(Vec::new()),
                seq: 0,
                payload: restarted,
                origin: BatchOrigin::Live,
                verdict: StreamVerdict::Reset,
            },
            Hooked::Event(SubscriberEvent::Reset { seq: 0 }),
        ]
    );
}

/// What a [`TrackerSink`] was called with, in order.
#[derive(Debug, Clone, PartialEq)]
enum Call {
    Deliver { seq: u64, origin: BatchOrigin, verdict: StreamVerdict },
    Resync,
    ReplayEnded { ok: bool },
}

/// A sink with no router and no index: it judges the stream with a [`StreamTracker`] alone, as
/// a forwarder does, and keeps (seq, publisher ts) of the batches it accepted.
#[derive(Default)]
struct TrackerSink {
    stream: Mutex<StreamTracker>,
    calls: Mutex<Vec<Call>>,
    accepted: Mutex<Vec<(u64, f64)>>,
}

impl EventSink for TrackerSink {
    fn deliver(&self, endpoint: &str, b: &Batch<'_>, _now_ms: u64) -> Result<StreamVerdict, StateError> {
        assert_eq!(endpoint, A);
        let judged = self.stream.lock().unwrap().judge(Some(b.seq), batch_digest(b.decoded));
        if judged.restarted {
            self.accepted.lock().unwrap().clear();
        }
        if judged.verdict.accepted() {
            self.accepted.lock().unwrap().push((b.seq, b.decoded.ts));
        }
        self.calls.lock().unwrap().push(Call::Deliver { seq: b.seq, origin: b.origin, verdict: judged.verdict });
        Ok(judged.verdict)
    }
    fn resync(&self, _endpoint: &str, now_ms: u64) -> Result<(), StateError> {
        self.stream.lock().unwrap().resync(now_ms, 0);
        self.accepted.lock().unwrap().clear();
        self.calls.lock().unwrap().push(Call::Resync);
        Ok(())
    }
    fn replay_ended(&self, _endpoint: &str, ok: bool) {
        self.calls.lock().unwrap().push(Call::ReplayEnded { ok });
    }
}

fn start_tracked(cfg: SubscriberConfig, clock: &Clock) -> (Subscription, Arc<TrackerSink>) {
    let sink = Arc::new(TrackerSink::default());
    (Subscription::start(sink.clone(), A, cfg, clock.clone()).unwrap(), sink)
}

fn deliver(seq: u64, origin: BatchOrigin, verdict: StreamVerdict) -> Call {
    Call::Deliver { seq, origin, verdict }
}

#[test]
fn a_sink_without_a_router_drives_gap_replay_with_its_own_verdicts() {
    use BatchOrigin::{Live, Replay};
    use StreamVerdict::{Applied, Duplicate};
    let (_, clock) = test_clock();
    let mut publisher = Publisher::bind(Some(ReplayFormat::V026));
    let mut cfg = config(&publisher.endpoint());
    cfg.replay_endpoint = Some(publisher.replay_endpoint());
    let (sub, sink) = start_tracked(cfg, &clock);
    publisher.wait_subscribed();
    let batches = chain(5, Encoding::Map);
    publisher.publish(&batches[0]);
    publisher.lose(&batches[1]);
    publisher.lose(&batches[2]);
    publisher.publish(&batches[3]); // a gap: held, 0..=2 replayed, then delivered again
    publisher.publish(&batches[4]);
    wait_for(&sub, "5 applied batches", |s| s.applied == 5);
    let stats = stop(sub);
    assert_eq!(
        *sink.calls.lock().unwrap(),
        vec![
            deliver(0, Live, Applied),
            deliver(3, Live, StreamVerdict::Gap { expected: 1, got: 3 }),
            deliver(0, Replay, Duplicate), // the continuity proof
            deliver(1, Replay, Applied),
            deliver(2, Replay, Applied),
            Call::ReplayEnded { ok: true },
            deliver(3, Live, Applied),
            deliver(4, Live, Applied),
        ]
    );
    // The decoded batches came with the raw ones: the publisher's timestamps, in order.
    let want: Vec<(u64, f64)> = (0..5).map(|k| (k, 1.0 + k as f64)).collect();
    assert_eq!(*sink.accepted.lock().unwrap(), want);
    // The same counters as with a router behind the subscription (`gap_is_replayed`); seven
    // deliveries, six decodes: the held batch is not decoded twice.
    let expected = SubscriberStats {
        messages: 3,
        batches: 3,
        decoded: 6,
        applied: 5,
        gaps: 1,
        replays: 1,
        replayed_batches: 2,
        ..Default::default()
    };
    assert_eq!(stats, expected);
}

#[test]
fn a_sink_without_a_router_is_resynced_before_the_fresh_start_and_judges_a_restart() {
    use BatchOrigin::Live;
    use StreamVerdict::Applied;
    let (_, clock) = test_clock();
    let mut publisher = Publisher::bind(None);
    let (sub, sink) = start_tracked(config(&publisher.endpoint()), &clock);
    publisher.wait_subscribed();
    publish_with_a_gap(&mut publisher); // 0, (1 lost), 2: no replay endpoint, so a resync
    wait_for(&sub, "a resync", |s| s.resyncs == 1 && s.applied == 2);
    publisher.restart();
    publisher.publish(&chain_batch(0, 100.0, Encoding::Map));
    wait_for(&sub, "the restarted stream", |s| s.resets == 1);
    let stats = stop(sub);
    assert_eq!(
        *sink.calls.lock().unwrap(),
        vec![
            deliver(0, Live, Applied),
            deliver(2, Live, StreamVerdict::Gap { expected: 1, got: 2 }),
            Call::Resync,
            deliver(2, Live, Applied),
            deliver(0, Live, StreamVerdict::Reset),
        ]
    );
    assert_eq!(*sink.accepted.lock().unwrap(), vec![(0, 100.0)], "the restart dropped the old incarnation's");
    assert_eq!((stats.applied, stats.gaps, stats.resyncs, stats.resets, stats.replays), (3, 1, 1, 1, 0));
    assert_eq!((stats.decoded, stats.duplicates, stats.router_errors), (3, 0, 0));
}

// ---------------------------------------------------------------------------------------------
// restarts during a disconnect
// ---------------------------------------------------------------------------------------------

/// Token offset of the restarted engine's prompt (its blocks differ from the dead engine's).
const NEW: u32 = 100_000;

/// Blocks of the prompt at `offset` (its first `batches` batches) the router matches on A.
fn matched_at(r: &Router, offset: u32, batches: u32, clock: &Clock) -> u32 {
    let ids: Vec<u32> = (offset..offset + 16 * BLOCKS_PER_BATCH * batches).collect();
    let body = serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 300}).to_string();
    matched(&r.route_http(body.as_bytes(), [("x-request-id", "t")], clock()).unwrap(), A)
}

/// The dead engine publishes batches 0..3 of prompt 0 (12 blocks), then restarts while the
/// subscriber is disconnected and publishes batches of prompt `NEW`, the first `lost` of them
/// never seen live (still in its replay buffer), then one more live. Returns (stale blocks of
/// the dead engine, blocks of the new one, stats).
fn restart_during_disconnect(replay: bool, lost: u32) -> (u32, u32, SubscriberStats, Arc<Router>, Clock) {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let mut publisher = Publisher::bind(replay.then_some(ReplayFormat::V026));
    let mut cfg = config(&publisher.endpoint());
    cfg.replay_endpoint = replay.then(|| publisher.replay_endpoint());
    let (sub, _) = start(&r, cfg, &clock);
    publisher.wait_subscribed();
    for p in chain(3, Encoding::Map) {
        publisher.publish(&p);
    }
    wait_for(&sub, "3 applied batches", |s| s.applied == 3);
    assert_eq!(matched_at(&r, 0, 3, &clock), 12);
    publisher.restart();
    for k in 0..lost {
        publisher.lose(&chain_batch_at(NEW, k, 100.0 + f64::from(k), Encoding::Map));
    }
    publisher.publish(&chain_batch_at(NEW, lost, 100.0 + f64::from(lost), Encoding::Map));
    // Recovered: the new batches replayed and the live one applied, or a resync and the live one.
    let done = |s: &SubscriberStats| {
        if replay {
            s.applied == 3 + u64::from(lost) + 1
        } else {
            s.resyncs == 1 && s.applied == 4
        }
    };
    wait_for(&sub, "the live batch after the restart", done);
    let stats = stop(sub);
    let (stale, new) = (matched_at(&r, 0, 3, &clock), matched_at(&r, NEW, lost + 1, &clock));
    eprintln!("FIGURE zmq restart during disconnect (replay {replay}, first live seq {lost}): stale blocks {stale}, new-incarnation blocks {new}/{}", (lost + 1) * BLOCKS_PER_BATCH);
    (stale, new, stats, r, clock)
}

#[test]
fn restart_during_a_disconnect_whose_seq_passes_the_old_one_replays_the_new_incarnation() {
    // Old last seq 2; the new engine's first live batch is 5: a gap whose replay starts at 2,
    // where the new engine's batch differs from the one applied: a restart, replayed from 0.
    let (stale, new, stats, r, _) = restart_during_disconnect(true, 5);
    assert_eq!(stale, 0, "no block of the dead incarnation is matched");
    assert_eq!(new, 24, "the new incarnation's batches 0..=5 are indexed");
    assert_eq!((stats.disconnects, stats.gaps, stats.replays, stats.resyncs), (1, 2, 2, 0), "{stats:?}");
    assert!(healthy(&r, A));
}

#[test]
fn restart_during_a_disconnect_that_looks_like_a_continuation_is_caught() {
    // Old last seq 2; the new engine's first live batch is 3, in order: only the lost
    // connection says it may be another process. Replay from 2 shows it is.
    let (stale, new, stats, r, _) = restart_during_disconnect(true, 3);
    assert_eq!(stale, 0, "no block of the dead incarnation is matched");
    assert_eq!(new, 16, "the new incarnation's batches 0..=3 are indexed");
    assert_eq!((stats.disconnects, stats.replays, stats.resyncs), (1, 2, 0), "{stats:?}");
    assert!(healthy(&r, A));
}

#[test]
fn restart_during_a_disconnect_without_replay_resyncs() {
    // Without a replay socket continuity cannot be proven: resync rather than keep the blocks.
    let (stale, _, stats, r, _) = restart_during_disconnect(false, 3);
    assert_eq!(stale, 0, "no block of the dead incarnation is matched");
    assert_eq!((stats.disconnects, stats.resyncs), (1, 1), "{stats:?}");
    assert!(!healthy(&r, A), "stale for the recovery window");
}

#[test]
fn a_lost_connection_to_the_same_publisher_keeps_its_blocks() {
    let (_, clock) = test_clock();
    let r = router(&clock);
    let (mut publisher, sub, seen) = start_with_replay(&r, &clock);
    let batches = chain(4, Encoding::Map);
    for p in &batches[..3] {
        publisher.publish(p);
    }
    wait_for(&sub, "3 applied batches", |s| s.applied == 3);
    publisher.reconnect();
    publisher.publish(&batches[3]);
    wait_for(&sub, "the batch after the reconnect", |s| s.applied == 4);
    let stats = stop(sub);
    // Replay from seq 2 proved the same process: nothing cleared, nothing stale.
    assert_eq!((stats.disconnects, stats.replays, stats.resyncs, stats.duplicates), (1, 1, 0, 0), "{stats:?}");
    assert!(seen.lock().unwrap().is_empty(), "{:?}", seen.lock().unwrap());
    assert_eq!(matched_at(&r, 0, 4, &clock), 16);
    assert!(healthy(&r, A));
    assert_eq!(r.stats().precise.resets, 0);
}
