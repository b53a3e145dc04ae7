//! One receiving thread per engine: ZMQ `SUB` (+ `DEALER` for replay), a shadow router judging
//! sequence numbers, and the hand-off to the forwarders.
//!
//! Wire format and replay protocol as in `kvroute::zmq_sub` (vLLM ≥ 0.26 and ≤ 0.23 replies).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute::zmq_sub::{unix_time_ms, SubscriberConfig, END_SEQ};
use kvroute::{EndpointSpec, EventIngestError, Policy, Role, Router, StreamVerdict};

use crate::{bump, log, EngineConfig, Msg, RelayError, Stats};

/// The shadow router only tracks sequence numbers and decodes payloads: keep its index small.
const SHADOW_POLICY: &str =
    r#"{"index": {"mode": "precise", "precise": {"capacity_bytes_per_endpoint": 65536, "key_map_capacity": 1024}}}"#;

pub(crate) struct Engine {
    endpoint: Arc<str>,
    cfg: SubscriberConfig,
    ctx: zmq::Context,
    sub: zmq::Socket,
    shadow: Router,
    outs: Vec<SyncSender<Msg>>,
    stats: Arc<Stats>,
    stop: Arc<AtomicBool>,
}

fn seq_of(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

fn wants_ipv6(endpoint: &str) -> bool {
    endpoint.contains('[') || endpoint.contains("::")
}

enum Replay {
    Done,
    Failed(String),
}

impl Engine {
    pub(crate) fn open(
        ctx: &zmq::Context,
        e: &EngineConfig,
        outs: Vec<SyncSender<Msg>>,
        stats: Arc<Stats>,
        stop: Arc<AtomicBool>,
    ) -> Result<Engine, RelayError> {
        let ep = &e.subscriber.endpoint;
        let err = |op: &str| {
            let ep = ep.clone();
            let op = op.to_owned();
            move |x: zmq::Error| RelayError::Socket(format!("{op} {ep}: {x}"))
        };
        let sub = ctx.socket(zmq::SUB).map_err(err("socket"))?;
        sub.set_linger(0).map_err(err("setsockopt"))?;
        if wants_ipv6(ep) {
            sub.set_ipv6(true).map_err(err("setsockopt"))?;
        }
        sub.set_subscribe(e.subscriber.topic.as_bytes()).map_err(err("subscribe"))?;
        if e.subscriber.binds() {
            sub.bind(ep).map_err(err("bind"))?;
        } else {
            sub.connect(ep).map_err(err("connect"))?;
        }
        let policy = Policy::from_json(SHADOW_POLICY).map_err(|x| RelayError::Config(x.to_string()))?;
        let shadow = Router::new(policy);
        shadow
            .upsert_endpoint(EndpointSpec::new(e.endpoint.as_str(), Role::Both))
            .map_err(|x| RelayError::Config(x.to_string()))?;
        Ok(Engine {
            endpoint: Arc::from(e.endpoint.as_str()),
            cfg: e.subscriber.clone(),
            ctx: ctx.clone(),
            sub,
            shadow,
            outs,
            stats,
            stop,
        })
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn poll_ms(&self) -> i64 {
        i64::try_from(self.cfg.poll_interval_ms).unwrap_or(100)
    }

    pub(crate) fn run(self) {
        while !self.stopping() {
            match self.sub.poll(zmq::POLLIN, self.poll_ms()) {
                Ok(0) | Err(zmq::Error::EINTR) => continue,
                Ok(_) => {}
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(self.cfg.poll_interval_ms));
                    continue;
                }
            }
            loop {
                match self.sub.recv_multipart(zmq::DONTWAIT) {
                    Ok(frames) => self.on_message(&frames),
                    Err(zmq::Error::EINTR) => continue,
                    Err(_) => break,
                }
                if self.stopping() {
                    return;
                }
            }
        }
    }

    fn on_message(&self, frames: &[Vec<u8>]) {
        bump(&self.stats.received);
        let [topic, seq, payload] = frames else {
            bump(&self.stats.malformed);
            return;
        };
        let Some(seq) = seq_of(seq) else {
            bump(&self.stats.malformed);
            return;
        };
        let topic: Arc<str> = Arc::from(String::from_utf8_lossy(topic).as_ref());
        let payload: Arc<[u8]> = Arc::from(payload.as_slice());
        if let Some(StreamVerdict::Gap { expected, got }) = self.submit(&topic, seq, &payload) {
            bump(&self.stats.gaps);
            self.recover(expected, got, &topic, &payload);
        }
    }

    /// Judge a batch with the shadow router; forward it when it is applied. `None`: it does not
    /// decode (not forwarded: the filter would refuse it too).
    fn submit(&self, topic: &Arc<str>, seq: u64, payload: &Arc<[u8]>) -> Option<StreamVerdict> {
        match self.shadow.apply_events(&self.endpoint, payload, Some(seq), unix_time_ms()) {
            Ok(out) => {
                match out.verdict {
                    StreamVerdict::Applied | StreamVerdict::Reset => self.forward(Msg::Batch {
                        endpoint: self.endpoint.clone(),
                        topic: topic.clone(),
                        seq,
                        payload: payload.clone(),
                    }),
                    StreamVerdict::Duplicate => bump(&self.stats.duplicates),
                    StreamVerdict::Gap { .. } => {}
                }
                Some(out.verdict)
            }
            Err(EventIngestError::Decode(e)) => {
                bump(&self.stats.decode_errors);
                log(format_args!("{}: batch {seq} does not decode, not forwarded: {e}", self.endpoint));
                None
            }
            Err(e) => {
                log(format_args!("{}: {e}", self.endpoint));
                None
            }
        }
    }

    fn forward(&self, msg: Msg) {
        if matches!(msg, Msg::Batch { .. }) {
            bump(&self.stats.batches);
        }
        for out in &self.outs {
            match out.try_send(msg.clone()) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => bump(&self.stats.dropped),
                Err(TrySendError::Disconnected(_)) => {}
            }
        }
    }

    /// Batches `expected..held` are missing: replay them, or resync; then submit the held one.
    fn recover(&self, expected: u64, held: u64, topic: &Arc<str>, payload: &Arc<[u8]>) {
        let end = match &self.cfg.replay_endpoint {
            None => Replay::Failed("no replay endpoint".into()),
            Some(ep) => self.replay(ep, expected, held),
        };
        if let Replay::Failed(why) = end {
            log(format_args!("{}: batches {expected}..{held} lost ({why}): resyncing", self.endpoint));
            self.resync();
        }
        if let Some(StreamVerdict::Gap { .. }) = self.submit(topic, held, payload) {
            // The stream moved under us: accept the batch as a fresh start.
            self.resync();
            self.submit(topic, held, payload);
        }
    }

    fn resync(&self) {
        if self.shadow.resync_stream(&self.endpoint, unix_time_ms()).is_ok() {
            bump(&self.stats.resyncs);
            self.forward(Msg::Resync { endpoint: self.endpoint.clone() });
        }
    }

    fn replay(&self, ep: &str, expected: u64, held: u64) -> Replay {
        let fail = |op: &str, e: zmq::Error| Replay::Failed(format!("replay {op}: {e}"));
        let dealer = match self.ctx.socket(zmq::DEALER) {
            Ok(s) => s,
            Err(e) => return fail("socket", e),
        };
        let setup = (|| {
            dealer.set_linger(0)?;
            if wants_ipv6(ep) {
                dealer.set_ipv6(true)?;
            }
            dealer.connect(ep)?;
            dealer.send_multipart([&[][..], &expected.to_be_bytes()[..]], zmq::DONTWAIT)
        })();
        if let Err(e) = setup {
            return fail("setup", e);
        }
        let deadline = Instant::now() + Duration::from_millis(self.cfg.replay_timeout_ms);
        let mut next = expected;
        loop {
            if self.stopping() {
                return Replay::Failed("stopping".into());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Replay::Failed("timeout".into());
            }
            let wait = i64::try_from(left.as_millis()).unwrap_or(i64::MAX).clamp(1, self.poll_ms());
            match dealer.poll(zmq::POLLIN, wait) {
                Ok(0) | Err(zmq::Error::EINTR) => continue,
                Ok(_) => {}
                Err(e) => return fail("poll", e),
            }
            let frames = match dealer.recv_multipart(zmq::DONTWAIT) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN | zmq::Error::EINTR) => continue,
                Err(e) => return fail("recv", e),
            };
            let (topic, seq, payload) = match frames.as_slice() {
                [d, topic, seq, payload] if d.is_empty() => (Some(topic.as_slice()), seq, payload),
                [d, seq, payload] if d.is_empty() => (None, seq, payload),
                _ => return Replay::Failed("malformed reply".into()),
            };
            let Some(seq) = seq_of(seq) else { return Replay::Failed("malformed sequence frame".into()) };
            if seq == END_SEQ && payload.is_empty() {
                return Replay::Failed(format!("replay ended before {next}"));
            }
            if topic.is_some_and(|t| !t.starts_with(self.cfg.topic.as_bytes())) || seq < next {
                continue;
            }
            if seq > next {
                return Replay::Failed(format!("replay skipped from {next} to {seq}"));
            }
            let topic: Arc<str> = Arc::from(String::from_utf8_lossy(topic.unwrap_or_default()).as_ref());
            match self.submit(&topic, seq, &Arc::from(payload.as_slice())) {
                Some(StreamVerdict::Applied | StreamVerdict::Reset) => bump(&self.stats.replayed),
                Some(StreamVerdict::Duplicate) => {}
                _ => return Replay::Failed(format!("replayed batch {seq} unusable")),
            }
            next = seq + 1;
            if next >= held {
                return Replay::Done;
            }
        }
    }
}
