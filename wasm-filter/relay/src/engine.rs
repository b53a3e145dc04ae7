//! One core [`Subscription`] per engine, delivering to an [`EngineSink`] that judges the
//! engine's stream and hands every batch it accepts to the forwarders.
//!
//! Receiving, framing, decoding, gap replay and resync are the core's (`kvroute::Subscription`); the
//! sequence judgment is the core's [`StreamTracker`]. This module only turns accepted batches
//! and resyncs into forwarder messages. The subscription calls its sink on one thread in stream
//! order, so a resync notice is queued before the batch that starts the stream again.

use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};

use kvroute::unix_clock;
use kvroute::{batch_digest, StreamTracker};
use kvroute::{Batch, EventSink, SubscriberEvent, Subscription};
use kvroute::{StateError, StreamVerdict};

use crate::{bump, log, EngineConfig, Msg, RelayError, Stats};

/// Hands messages to every forwarder's queue without blocking the subscription's thread.
#[derive(Clone)]
struct Fanout {
    outs: Vec<SyncSender<Msg>>,
    stats: Arc<Stats>,
}

impl Fanout {
    fn send(&self, msg: &Msg) {
        for out in &self.outs {
            match out.try_send(msg.clone()) {
                Ok(()) | Err(TrySendError::Disconnected(_)) => {}
                Err(TrySendError::Full(_)) => bump(&self.stats.dropped),
            }
        }
    }
}

/// The topic as a header value, when it can be one (the topic is informational: a topic that is
/// not printable UTF-8 is left out rather than failing the POST).
fn topic_header(topic: Option<&[u8]>) -> Option<Arc<str>> {
    let t = std::str::from_utf8(topic?).ok()?;
    (!t.chars().any(char::is_control)).then(|| Arc::from(t))
}

/// One engine's stream, as the relay sees it: judged by a [`StreamTracker`] (the same rules as
/// the filter's index, which sees the same batches), its accepted batches forwarded raw, as
/// received (the subscription decoded each once, for the judgment; nothing decodes them again
/// here).
struct EngineSink {
    endpoint: Arc<str>,
    stream: Mutex<StreamTracker>,
    fanout: Fanout,
}

impl EngineSink {
    fn stream(&self) -> std::sync::MutexGuard<'_, StreamTracker> {
        // Only this subscription's thread takes the lock; a panic there ends the subscription.
        self.stream.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl EventSink for EngineSink {
    fn deliver(&self, _endpoint: &str, b: &Batch<'_>, _now_ms: u64) -> Result<StreamVerdict, StateError> {
        // A restart needs nothing here: the relay holds no state of the engine's, and the filter
        // judges the same batch the same way (the batch is forwarded when the verdict is Reset).
        let verdict = self.stream().judge(Some(b.seq), batch_digest(b.decoded)).verdict;
        if verdict.accepted() {
            bump(&self.fanout.stats.batches);
            self.fanout.send(&Msg::Batch {
                endpoint: self.endpoint.clone(),
                topic: topic_header(b.topic),
                seq: b.seq,
                payload: Arc::from(b.payload),
            });
        }
        Ok(verdict)
    }

    fn resync(&self, _endpoint: &str, now_ms: u64) -> Result<(), StateError> {
        // No stale window: the relay routes nothing, it only has to take the next batch as a
        // fresh start, and the filter must drop what it holds for the engine.
        self.stream().resync(now_ms, 0);
        self.fanout.send(&Msg::Resync { endpoint: self.endpoint.clone() });
        Ok(())
    }

    fn notice(&self, _endpoint: &str, event: &SubscriberEvent) {
        let ep = &self.endpoint;
        match event {
            SubscriberEvent::Resync { expected, got } => {
                log(format_args!("{ep}: batches {expected}..{got} lost: resyncing"));
            }
            SubscriberEvent::ReplayFailed { expected, reason } => {
                log(format_args!("{ep}: replay from {expected} failed: {reason}"));
            }
            SubscriberEvent::Decode { seq, error } => {
                log(format_args!("{ep}: batch {seq} does not decode, not forwarded: {error}"));
            }
            SubscriberEvent::Router { seq, error } => log(format_args!("{ep}: batch {seq}: {error}")),
            _ => {}
        }
    }
}

/// Subscribe to engine `e` (sockets are bound or connected before this returns) and forward
/// what its stream accepts to `outs`.
pub(crate) fn subscribe(
    e: &EngineConfig,
    outs: Vec<SyncSender<Msg>>,
    stats: &Arc<Stats>,
) -> Result<Subscription, RelayError> {
    let sink = EngineSink {
        endpoint: Arc::from(e.endpoint.as_str()),
        stream: Mutex::new(StreamTracker::new()),
        fanout: Fanout { outs, stats: stats.clone() },
    };
    Subscription::start(Arc::new(sink), e.endpoint.as_str(), e.subscriber.clone(), unix_clock())
        .map_err(|error| RelayError::Subscribe { engine: e.endpoint.clone(), error })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_become_headers_only_when_they_can() {
        assert_eq!(topic_header(Some(b"kv-events")).as_deref(), Some("kv-events"));
        assert_eq!(topic_header(Some(b"")).as_deref(), Some(""));
        assert_eq!(topic_header(None), None);
        assert_eq!(topic_header(Some(b"kv\r\nx-evil: 1")), None);
        assert_eq!(topic_header(Some(&[0xff, 0xfe])), None);
    }
}
