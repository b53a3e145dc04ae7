//! One forwarding thread per target: POSTs batches and resync notices in order.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use kvroute_filter::ingest::{HEADER_ENDPOINT, HEADER_KIND, HEADER_SECRET, HEADER_SEQ, HEADER_TOPIC};

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
        let (headers, body): (Vec<(&str, &str)>, &[u8]) = match msg {
            Msg::Batch { endpoint, topic, seq, payload } => {
                seq_text = seq.to_string();
                let mut headers = vec![
                    (HEADER_SECRET, self.secret.as_str()),
                    (HEADER_ENDPOINT, endpoint),
                    (HEADER_KIND, "batch"),
                    (HEADER_SEQ, seq_text.as_str()),
                ];
                if let Some(topic) = topic {
                    headers.push((HEADER_TOPIC, topic));
                }
                (headers, payload)
            }
            Msg::Resync { endpoint } => {
                (vec![(HEADER_SECRET, self.secret.as_str()), (HEADER_ENDPOINT, endpoint), (HEADER_KIND, "resync")], &[])
            }
        };
        let mut backoff = Duration::from_millis(100);
        for attempt in 1..=self.attempts {
            let result = self.target.post(&self.path, &headers, body);
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
