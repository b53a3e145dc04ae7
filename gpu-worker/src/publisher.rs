//! The KV-event publisher thread: ZMQ `PUB`-compatible socket + replay `ROUTER`, as vLLM's
//! `ZmqEventPublisher`.
//!
//! - Live stream: multipart `[topic, seq (8-byte big-endian, from 0), payload]`.
//! - The socket is an `XPUB` (wire-identical to `PUB` for subscribers) so the worker sees
//!   subscriptions arrive: [`crate::WorkerHandle::wait_for_event_subscribers`] lets tests and
//!   in-process fleets start sending requests only once a subscriber is listening.
//! - Replay (`ROUTER`, always bound): a `DEALER` sends `["", start_seq (8-byte BE)]`; every
//!   buffered batch with `seq >= start_seq` comes back as `["", topic, seq, payload]` (vLLM ≥
//!   0.26), then the end marker `["", "", 0xFFFFFFFFFFFFFFFF, ""]`. The buffer keeps the last
//!   `buffer_steps` batches.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::config::KvEventsConfig;
use crate::events::{encode_batch, WorkerEvent};

/// The sequence number that ends a replay answer.
pub const END_SEQ: u64 = u64::MAX;

/// One batch handed to the publisher: publisher timestamp (UNIX seconds) and events.
pub(crate) type Batch = (f64, Vec<WorkerEvent>);

/// Counters of the publisher.
#[derive(Debug, Default)]
pub(crate) struct PublisherStats {
    pub(crate) batches: AtomicU64,
    pub(crate) dropped: AtomicU64,
    pub(crate) subscriptions: AtomicU64,
    pub(crate) replays: AtomicU64,
    /// Fault injection: this many next batches are buffered but not sent live.
    pub(crate) drop_next: AtomicU64,
}

/// A running publisher.
#[derive(Debug)]
pub(crate) struct Publisher {
    pub(crate) tx: mpsc::Sender<Batch>,
    pub(crate) stats: Arc<PublisherStats>,
    /// Where a local subscriber connects (or, in connect mode, where we connected).
    pub(crate) endpoint: String,
    /// Where a local replay client connects.
    pub(crate) replay_endpoint: Option<String>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// The publisher could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublisherError {
    /// A ZMQ call failed.
    #[error("KV-event publisher: zmq {op} {endpoint:?}: {source}")]
    Socket {
        /// What was being done.
        op: &'static str,
        /// The endpoint.
        endpoint: String,
        /// The ZMQ error.
        #[source]
        source: zmq::Error,
    },
    /// The thread could not be started.
    #[error("KV-event publisher: could not spawn its thread: {0}")]
    Spawn(#[source] std::io::Error),
}

fn connectable(endpoint: String) -> String {
    endpoint.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
}

fn wants_ipv6(endpoint: &str) -> bool {
    endpoint.contains('[') || endpoint.contains("::")
}

impl Publisher {
    /// Open the sockets (errors come back here) and start the thread.
    pub(crate) fn start(cfg: &KvEventsConfig, endpoint: &str) -> Result<Publisher, PublisherError> {
        let ctx = zmq::Context::new();
        let err = |op: &'static str, ep: &str| {
            let endpoint = ep.to_owned();
            move |source| PublisherError::Socket { op, endpoint, source }
        };
        let publ = ctx.socket(zmq::XPUB).map_err(err("socket", endpoint))?;
        publ.set_linger(200).map_err(err("setsockopt", endpoint))?;
        publ.set_sndhwm(cfg.hwm).map_err(err("setsockopt", endpoint))?;
        publ.set_xpub_verbose(true).map_err(err("setsockopt", endpoint))?;
        if wants_ipv6(endpoint) {
            publ.set_ipv6(true).map_err(err("setsockopt", endpoint))?;
        }
        let live = if cfg.bind.binds(endpoint) {
            publ.bind(endpoint).map_err(err("bind", endpoint))?;
            match publ.get_last_endpoint() {
                Ok(Ok(s)) if !s.is_empty() => connectable(s),
                _ => endpoint.to_owned(),
            }
        } else {
            publ.connect(endpoint).map_err(err("connect", endpoint))?;
            endpoint.to_owned()
        };
        let (router, replay_endpoint) = match &cfg.replay_endpoint {
            None => (None, None),
            Some(ep) => {
                let r = ctx.socket(zmq::ROUTER).map_err(err("socket", ep))?;
                r.set_linger(0).map_err(err("setsockopt", ep))?;
                if wants_ipv6(ep) {
                    r.set_ipv6(true).map_err(err("setsockopt", ep))?;
                }
                r.bind(ep).map_err(err("bind", ep))?;
                let local = match r.get_last_endpoint() {
                    Ok(Ok(s)) if !s.is_empty() => connectable(s),
                    _ => ep.clone(),
                };
                (Some(r), Some(local))
            }
        };
        let (tx, rx) = mpsc::channel::<Batch>();
        let stats = Arc::new(PublisherStats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let worker = Worker {
            publ,
            router,
            topic: cfg.topic.clone().into_bytes(),
            encoding: cfg.encoding,
            buffer: VecDeque::new(),
            buffer_steps: cfg.buffer_steps,
            next_seq: 0,
            stats: stats.clone(),
        };
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvroute-worker-events".into())
            .spawn(move || {
                worker.run(&rx, &stop2);
                drop(ctx);
            })
            .map_err(PublisherError::Spawn)?;
        Ok(Publisher { tx, stats, endpoint: live, replay_endpoint, stop, thread: Some(thread) })
    }

    /// Publish what is queued, close the sockets and join the thread.
    pub(crate) fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Worker {
    publ: zmq::Socket,
    router: Option<zmq::Socket>,
    topic: Vec<u8>,
    encoding: crate::config::EventEncoding,
    buffer: VecDeque<(u64, Vec<u8>)>,
    buffer_steps: usize,
    next_seq: u64,
    stats: Arc<PublisherStats>,
}

impl Worker {
    fn run(mut self, rx: &mpsc::Receiver<Batch>, stop: &AtomicBool) {
        loop {
            match rx.recv_timeout(Duration::from_millis(10)) {
                Ok(b) => {
                    self.publish(b);
                    while let Ok(b) = rx.try_recv() {
                        self.publish(b);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
            self.subscriptions();
            self.replays();
            if stop.load(Ordering::Acquire) {
                while let Ok(b) = rx.try_recv() {
                    self.publish(b);
                }
                break;
            }
        }
    }

    fn publish(&mut self, (ts, events): Batch) {
        if events.is_empty() {
            return;
        }
        let payload = encode_batch(ts, &events, Some(0), self.encoding);
        let seq = self.next_seq;
        self.next_seq += 1;
        let lose = self.stats.drop_next.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_ok();
        if lose {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        } else {
            let seq_b = seq.to_be_bytes();
            // PUB semantics: a full queue drops the message (the subscriber then sees a gap).
            let _ = self.publ.send_multipart([&self.topic[..], &seq_b[..], &payload[..]], zmq::DONTWAIT);
        }
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.buffer.push_back((seq, payload));
        while self.buffer.len() > self.buffer_steps {
            self.buffer.pop_front();
        }
    }

    /// Count subscription messages (XPUB verbose: one per subscriber and topic).
    fn subscriptions(&mut self) {
        while let Ok(msg) = self.publ.recv_bytes(zmq::DONTWAIT) {
            if msg.first() == Some(&1) {
                self.stats.subscriptions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn replays(&mut self) {
        let Some(router) = &self.router else { return };
        while let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) {
            let [id, _delim, start] = &frames[..] else { continue };
            self.stats.replays.fetch_add(1, Ordering::Relaxed);
            if let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) {
                let start = u64::from_be_bytes(start);
                for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
                    let seq_b = seq.to_be_bytes();
                    let frames: [&[u8]; 5] = [id, b"", &self.topic, &seq_b, payload];
                    if router.send_multipart(frames, zmq::DONTWAIT).is_err() {
                        break;
                    }
                }
            }
            let end = END_SEQ.to_be_bytes();
            let _ = router.send_multipart([&id[..], b"", b"", &end[..], b""], zmq::DONTWAIT);
        }
    }
}
