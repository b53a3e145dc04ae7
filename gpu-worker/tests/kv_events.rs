//! KV events: the worker's ZMQ stream decoded by kvroute matches the worker's block pool
//! (stored, evicted, cleared), in both vLLM encodings, with a topic; kvroute's own subscriber
//! feeds a precise-mode router from it and recovers a dropped batch through the replay socket.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use kvroute::{decode_batch, EndpointSpec, KvEvent, Policy, Role, Router};
use kvroute::{unix_clock, SubscriberConfig, Subscription};
use kvroute_worker::{spawn, EventEncoding, KvEventsConfig, WorkerConfig, WorkerHandle};

/// A raw SUB socket on the worker's stream, filtered by `topic`.
struct RawSub {
    _ctx: zmq::Context,
    sock: zmq::Socket,
    next_seq: u64,
    topic: String,
    /// Engine keys the stream says are stored.
    held: BTreeSet<u64>,
    stored_events: usize,
    removed_events: usize,
    cleared_events: usize,
    payloads: Vec<Vec<u8>>,
}

impl RawSub {
    fn connect(w: &WorkerHandle, topic: &str) -> RawSub {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::SUB).unwrap();
        sock.set_subscribe(topic.as_bytes()).unwrap();
        sock.set_rcvtimeo(50).unwrap();
        sock.connect(w.events_endpoint().unwrap()).unwrap();
        assert!(w.wait_for_event_subscribers(1, WAIT), "the publisher never saw the subscription");
        RawSub {
            _ctx: ctx,
            sock,
            next_seq: 0,
            topic: topic.to_owned(),
            held: BTreeSet::new(),
            stored_events: 0,
            removed_events: 0,
            cleared_events: 0,
            payloads: Vec::new(),
        }
    }

    /// Apply every message available now.
    fn drain(&mut self) {
        while let Ok(frames) = self.sock.recv_multipart(0) {
            assert_eq!(frames.len(), 3, "[topic, seq, payload]");
            assert_eq!(frames[0], self.topic.as_bytes());
            let seq = u64::from_be_bytes(frames[1].as_slice().try_into().expect("8-byte sequence"));
            assert_eq!(seq, self.next_seq, "sequence numbers count from 0 without gaps");
            self.next_seq += 1;
            let batch = decode_batch(&frames[2]).expect("kvroute decodes the batch");
            for ev in batch.events {
                match ev {
                    KvEvent::BlockStored(s) => {
                        assert_eq!(s.token_ids.len(), s.block_hashes.len() * 16);
                        self.stored_events += 1;
                        self.held.extend(s.block_hashes);
                    }
                    KvEvent::BlockRemoved(r) => {
                        self.removed_events += 1;
                        for h in r.block_hashes {
                            assert!(self.held.remove(&h), "BlockRemoved for a block never stored");
                        }
                    }
                    KvEvent::AllBlocksCleared => {
                        self.cleared_events += 1;
                        self.held.clear();
                    }
                }
            }
            self.payloads.push(frames[2].clone());
        }
    }

    /// Wait until the stream's view equals the worker's cached blocks.
    fn converge(&mut self, w: &WorkerHandle) {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            self.drain();
            let pool: BTreeSet<u64> = w.cached_block_keys().unwrap().into_iter().collect();
            if pool == self.held {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "events never matched the pool: {pool:?} vs {:?}", self.held);
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn with_events(num_blocks: u32, topic: &str, encoding: EventEncoding) -> WorkerConfig {
    let mut cfg = tiny(num_blocks);
    cfg.kv_events = KvEventsConfig { topic: topic.to_owned(), encoding, ..cfg.kv_events };
    cfg
}

fn stored_removed_cleared(encoding: EventEncoding) -> Vec<Vec<u8>> {
    // 12 blocks: three 64-token prompts (4 blocks each, 5 with decoding) cannot all stay.
    let w = spawn(with_events(12, "kv@worker-0", encoding)).unwrap();
    let mut sub = RawSub::connect(&w, "kv@worker-0");
    let addr = w.http_addr();
    let a = prompt(1, 70, 300);
    complete(addr, &a, 2);
    sub.converge(&w);
    // The stream names exactly the blocks of the prompt (vLLM's sha256_cbor keys).
    let keys = w.block_keys(&a, None);
    assert_eq!(keys.len(), 4);
    // ... computed independently with kvroute's vLLM hasher (sha256_cbor, default NONE_HASH).
    let hasher = kvroute::EngineHasher::new(
        kvroute::HashAlgo::Sha256Cbor,
        kvroute::ExtraKeysForm::Tagged,
        kvroute::NoneHashSeed::Default,
        16,
    )
    .unwrap();
    let mut expect = Vec::new();
    hasher.block_keys(&a, &kvroute::BlockExtras::default(), &mut Vec::new(), &mut expect).unwrap();
    assert_eq!(keys, expect);
    assert_eq!(sub.held, keys.iter().copied().collect::<BTreeSet<_>>());
    assert_eq!(sub.stored_events, 1, "one BlockStored for the prompt's 4 blocks");

    // Fill the pool: LRU eviction of unreferenced blocks shows up as BlockRemoved.
    for s in 2..5 {
        complete(addr, &prompt(s, 70, 300), 2);
        sub.converge(&w);
    }
    assert!(sub.removed_events >= 1, "no BlockRemoved although the pool overflowed");
    assert!(w.counters().blocks_evicted >= 1);
    assert!(!sub.held.contains(&keys[0]), "the least recently used prompt was evicted first");

    // A cache hit re-emits BlockStored (vLLM 0.33) and the view still matches.
    let last = prompt(4, 70, 300);
    let before = sub.stored_events;
    let r = complete(addr, &last, 2);
    assert_eq!(cached_tokens(&r), 64);
    sub.converge(&w);
    assert!(sub.stored_events > before);

    assert!(w.reset_prefix_cache().unwrap());
    sub.converge(&w);
    assert_eq!(sub.cleared_events, 1);
    assert!(sub.held.is_empty());
    let payloads = std::mem::take(&mut sub.payloads);
    w.shutdown();
    payloads
}

#[test]
fn map_encoding_matches_the_pool() {
    let payloads = stored_removed_cleared(EventEncoding::Map);
    let any = |needle: &[u8]| payloads.iter().any(|p| p.windows(needle.len()).any(|w| w == needle));
    assert!(any(b"block_hashes"), "map encoding names its fields");
    assert!(any(b"AllBlocksCleared"));
}

#[test]
fn array_encoding_matches_the_pool() {
    let payloads = stored_removed_cleared(EventEncoding::Array);
    let any = |needle: &[u8]| payloads.iter().any(|p| p.windows(needle.len()).any(|w| w == needle));
    assert!(!any(b"block_hashes"), "array encoding carries no field names");
    assert!(any(b"BlockStored") && any(b"BlockRemoved"));
}

#[test]
fn other_topics_are_filtered_out() {
    let w = spawn(with_events(32, "kv@a", EventEncoding::Map)).unwrap();
    let ctx = zmq::Context::new();
    let sock = ctx.socket(zmq::SUB).unwrap();
    sock.set_subscribe(b"kv@b").unwrap();
    sock.set_rcvtimeo(300).unwrap();
    sock.connect(w.events_endpoint().unwrap()).unwrap();
    assert!(w.wait_for_event_subscribers(1, WAIT));
    complete(w.http_addr(), &prompt(7, 40, 300), 2);
    wait_until("a published batch", || w.event_batches().0 >= 1);
    assert!(sock.recv_multipart(0).is_err(), "a subscriber of another topic received a message");
    w.shutdown();
}

#[test]
fn kvroute_subscriber_feeds_the_precise_index_and_replays_gaps() {
    let w = spawn(with_events(64, "", EventEncoding::Map)).unwrap();
    let policy = Policy::from_json(
        r#"{"index": {"mode": "precise", "precise": {"keys": "dual", "engine_block_tokens": 16, "index_block_tokens": 16}}}"#,
    )
    .unwrap();
    let router = std::sync::Arc::new(Router::new(policy));
    let id = w.endpoint_id();
    router.upsert_endpoint(EndpointSpec::new(id.clone(), Role::Both)).unwrap();
    let mut cfg = SubscriberConfig::new(w.events_endpoint().unwrap());
    cfg.replay_endpoint = w.replay_endpoint().map(str::to_owned);
    cfg.poll_interval_ms = 20;
    let sub = Subscription::start(router.clone(), id.clone(), cfg, unix_clock()).unwrap();
    assert!(w.wait_for_event_subscribers(1, WAIT));
    let addr = w.http_addr();
    let memberships = |r: &Router| r.endpoints().into_iter().find(|e| *e.id == *id).unwrap().precise_memberships;

    complete(addr, &prompt(1, 70, 300), 2);
    wait_until("the index to hold the first prompt", || memberships(&router) == 4);

    // The next batch is kept for replay but never sent live: the subscriber sees a gap at the
    // batch after it and fetches the missing one from the replay socket.
    w.drop_next_event_batches(1);
    complete(addr, &prompt(2, 70, 300), 2);
    wait_until("the held-back batch", || w.event_batches().1 == 1);
    complete(addr, &prompt(3, 38, 300), 2);
    let pool = w.cached_block_keys().unwrap().len() as u32;
    assert_eq!(pool, 4 + 4 + 2);
    wait_until("the index to match the pool after the replay", || memberships(&router) == pool);
    let stats = sub.stop().unwrap();
    assert!(stats.gaps >= 1 && stats.replays >= 1 && stats.replayed_batches >= 1, "{stats:?}");
    assert_eq!(stats.resyncs, 0, "{stats:?}");
    assert_eq!(stats.decode_errors + stats.malformed + stats.router_errors, 0, "{stats:?}");
    w.shutdown();
}
