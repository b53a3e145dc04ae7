//! One forwarding thread per target: POSTs batches and resync notices in order.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use kvroute_filter::ingest::{
    self, HEADER_ENDPOINT, HEADER_KIND, HEADER_SEQ, HEADER_SIGNATURE, HEADER_TIMESTAMP, HEADER_TOPIC,
};

use crate::http::{Response, Target};
use crate::{bump, log, Msg, RelayConfig, Stats};

/// How often a waiting forwarder looks at the stop flag.
const STOP_CHECK: Duration = Duration::from_millis(50);

pub(crate) struct Forwarder {
    target: Target,
    path: String,
    secret: String,
    attempts: u32,
    stats: Arc<Stats>,
    stop: Arc<AtomicBool>,
}

/// What became of one POST.
enum Sent {
    Ok,
    /// 409: the filter's stream has a gap.
    Conflict,
    Failed,
}

impl Forwarder {
    pub(crate) fn new(
        target: Target,
        cfg: &RelayConfig,
        secret: &str,
        stats: Arc<Stats>,
        stop: Arc<AtomicBool>,
    ) -> Self {
        Forwarder { target, path: cfg.path.clone(), secret: secret.to_owned(), attempts: cfg.attempts, stats, stop }
    }

    pub(crate) fn run(mut self, rx: &Receiver<Msg>) {
        while !self.stop.load(Ordering::Acquire) {
            match rx.recv_timeout(STOP_CHECK) {
                Ok(msg) => self.deliver(&msg),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn deliver(&mut self, msg: &Msg) {
        match self.send(msg) {
            Sent::Ok | Sent::Failed => {}
            Sent::Conflict => {
                // The filter missed batches (a lost POST, a restarted Envoy, a dropped queue
                // entry): resynchronize its stream, then this batch is a fresh start there.
                bump(&self.stats.conflicts);
                if let Msg::Batch { endpoint, .. } = msg {
                    let resync = Msg::Resync { endpoint: endpoint.clone() };
                    if matches!(self.send(&resync), Sent::Ok) {
                        let _ = self.send(msg);
                    }
                }
            }
        }
    }

    fn send(&mut self, msg: &Msg) -> Sent {
        let seq_text;
        let (endpoint, kind, seq, body): (&str, &str, Option<u64>, &[u8]) = match msg {
            Msg::Batch { endpoint, seq, payload, .. } => (endpoint, "batch", Some(*seq), payload),
            Msg::Resync { endpoint } => (endpoint, "resync", None, &[]),
        };
        let mut headers: Vec<(&str, &str)> = vec![(HEADER_ENDPOINT, endpoint), (HEADER_KIND, kind)];
        if let Some(seq) = seq {
            seq_text = seq.to_string();
            headers.push((HEADER_SEQ, seq_text.as_str()));
        }
        if let Msg::Batch { topic: Some(topic), .. } = msg {
            headers.push((HEADER_TOPIC, topic));
        }
        let mut backoff = Duration::from_millis(100);
        for attempt in 1..=self.attempts {
            // Signed afresh for each attempt: the filter refuses a timestamp outside its window,
            // and a retry may come long after the first try. The secret itself never travels.
            let ts = kvroute::unix_time_ms();
            let ts_text = ts.to_string();
            let sig = ingest::signature(self.secret.as_bytes(), endpoint, kind, seq, ts, body);
            let mut signed = headers.clone();
            signed.push((HEADER_TIMESTAMP, ts_text.as_str()));
            signed.push((HEADER_SIGNATURE, sig.as_str()));
            let result = self.target.post(&self.path, &signed, body);
            match result {
                Ok(Response { status: 200, .. }) => {
                    bump(&self.stats.posted);
                    return Sent::Ok;
                }
                Ok(Response { status: 409, .. }) => return Sent::Conflict,
                Ok(Response { status, body }) if status < 500 => {
                    bump(&self.stats.post_failures);
                    log(format_args!(
                        "{} refused a post ({status}): {}",
                        self.target.authority(),
                        String::from_utf8_lossy(&body)
                    ));
                    return Sent::Failed;
                }
                Ok(Response { status, .. }) if attempt == self.attempts => {
                    bump(&self.stats.post_failures);
                    log(format_args!("{} answered {status}; giving up on this post", self.target.authority()));
                    return Sent::Failed;
                }
                Err(e) if attempt == self.attempts => {
                    bump(&self.stats.post_failures);
                    log(format_args!("{}: {e}; giving up on this post", self.target.authority()));
                    return Sent::Failed;
                }
                _ => {}
            }
            if self.stop.load(Ordering::Acquire) {
                return Sent::Failed;
            }
            std::thread::sleep(backoff);
            backoff *= 4;
        }
        Sent::Failed
    }
}
