//! One core [`Subscription`] per engine, feeding a shadow router and handing every batch it
//! accepts to the forwarders.
//!
//! Receiving, framing, sequence judgment, gap replay and resync are the core's
//! (`kvroute::zmq_sub`): this module only turns the subscription's callbacks into forwarder
//! messages. The subscription calls its observer and its batch sink on one thread in stream
//! order, so a resync notice is queued before the batch that starts the stream again.

use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;

use kvroute::unix_clock;
use kvroute::zmq_sub::{Batch, Hooks, SubscriberEvent, Subscription};
use kvroute::{EndpointSpec, Policy, Role, Router};

use crate::{bump, log, EngineConfig, Msg, RelayError, Stats};

/// The shadow router only tracks sequence numbers and decodes payloads: keep its index small.
const SHADOW_POLICY: &str =
    r#"{"index": {"mode": "precise", "precise": {"capacity_bytes_per_endpoint": 65536, "key_map_capacity": 1024}}}"#;

/// The router that judges every engine's stream for the relay (one endpoint per engine). It sees
/// the same batches as the filter, so its verdicts decide what is forwarded.
pub(crate) fn shadow_router(engines: &[EngineConfig]) -> Result<Arc<Router>, RelayError> {
    let policy = Policy::from_json(SHADOW_POLICY).map_err(|x| RelayError::Config(x.to_string()))?;
    let shadow = Router::new(policy);
    for e in engines {
        shadow
            .upsert_endpoint(EndpointSpec::new(e.endpoint.as_str(), Role::Both))
            .map_err(|x| RelayError::Config(format!("engine {}: {x}", e.endpoint)))?;
    }
    Ok(Arc::new(shadow))
}

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

/// Subscribe to engine `e` (sockets are bound or connected before this returns) and forward
/// what the shadow router accepts to `outs`.
pub(crate) fn subscribe(
    shadow: &Arc<Router>,
    e: &EngineConfig,
    outs: Vec<SyncSender<Msg>>,
    stats: &Arc<Stats>,
) -> Result<Subscription, RelayError> {
    let endpoint: Arc<str> = Arc::from(e.endpoint.as_str());
    let fanout = Fanout { outs, stats: stats.clone() };

    let (ep, to) = (endpoint.clone(), fanout.clone());
    let observer = move |event: &SubscriberEvent| match event {
        // Ordered before the batch that restarts the stream (same thread, stream order).
        SubscriberEvent::Resync { expected, got } => {
            log(format_args!("{ep}: batches {expected}..{got} lost: resyncing"));
            to.send(&Msg::Resync { endpoint: ep.clone() });
        }
        SubscriberEvent::ReplayFailed { expected, reason } => {
            log(format_args!("{ep}: replay from {expected} failed: {reason}"));
        }
        SubscriberEvent::Decode { seq, error } => {
            log(format_args!("{ep}: batch {seq} does not decode, not forwarded: {error}"));
        }
        SubscriberEvent::Router { seq, error } => log(format_args!("{ep}: batch {seq}: {error}")),
        _ => {}
    };

    let ep = endpoint;
    let sink = move |b: &Batch<'_>| {
        bump(&fanout.stats.batches);
        fanout.send(&Msg::Batch {
            endpoint: ep.clone(),
            topic: topic_header(b.topic),
            seq: b.seq,
            payload: Arc::from(b.payload),
        });
    };

    let hooks = Hooks::new().observer(Arc::new(observer)).batch_sink(Arc::new(sink));
    Subscription::start_with_hooks(shadow.clone(), e.endpoint.as_str(), e.subscriber.clone(), unix_clock(), hooks)
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
