//! What a ZMQ [`Subscription`](super::zmq_sub::Subscription) delivers to: the [`EventSink`]
//! trait, the [`Batch`] it is handed, and the [`Router`] as a sink.

use crate::error::StateError;
use crate::precise::events::EventBatch;
use crate::precise::zmq_sub::SubscriberEvent;
use crate::precise::StreamVerdict;
use crate::router::Router;

/// Where a [`Batch`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BatchOrigin {
    /// The live stream (`SUB`), including a batch held during a gap's recovery and submitted
    /// again after.
    Live,
    /// The publisher's replay socket, recovering a gap.
    Replay,
}

/// One batch as received, decoded once by the subscription: what an [`EventSink`] is given.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Batch<'a> {
    /// The topic frame. `None` for a replayed batch in the vLLM ≤ 0.23 reply format, which
    /// carries no topic.
    pub topic: Option<&'a [u8]>,
    /// The publisher's sequence number.
    pub seq: u64,
    /// The msgpack payload, unchanged (what a forwarder passes on).
    pub payload: &'a [u8],
    /// The payload decoded ([`crate::precise::events::decode_batch`]).
    pub decoded: &'a EventBatch,
    /// Live or replayed.
    pub origin: BatchOrigin,
}

/// What a subscription delivers to: it judges each batch's place in the stream and keeps (or
/// passes on) the batches it accepts.
///
/// One subscription calls its sink from its one worker thread, in stream order: batches in
/// sequence order (those recovered by replay before the held batch that revealed the gap), a
/// resync before the batch that starts the stream again. Calls for one `endpoint` never
/// overlap; a sink shared by several subscriptions (the [`Router`]) is called for different
/// endpoints concurrently. Keep the calls short: a slow sink delays the stream (ZMQ queues, then
/// drops, what is not received), and a panic ends the subscription.
///
/// [`Router`] is a sink (it applies batches to its precise index); a program that only forwards
/// batches judges them with a [`crate::precise::StreamTracker`] (the Envoy filter's relay).
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use kvroute::{batch_digest, StreamTracker};
/// use kvroute::{unix_clock, Batch, EventSink, SubscriberConfig, Subscription};
/// use kvroute::{StateError, StreamVerdict};
///
/// /// Counts the events of the batches that arrive in order.
/// #[derive(Default)]
/// struct Counter {
///     stream: Mutex<StreamTracker>,
///     events: Mutex<usize>,
/// }
///
/// impl EventSink for Counter {
///     fn deliver(&self, _endpoint: &str, batch: &Batch<'_>, _now_ms: u64) -> Result<StreamVerdict, StateError> {
///         let judged = self.stream.lock().unwrap().judge(Some(batch.seq), batch_digest(batch.decoded));
///         if judged.verdict.accepted() {
///             *self.events.lock().unwrap() += batch.decoded.events.len();
///         }
///         Ok(judged.verdict)
///     }
///     fn resync(&self, _endpoint: &str, _now_ms: u64) -> Result<(), StateError> {
///         self.stream.lock().unwrap().forget();
///         Ok(())
///     }
/// }
///
/// let counter = Arc::new(Counter::default());
/// let cfg = SubscriberConfig::new("tcp://127.0.0.1:5557");
/// let sub = Subscription::start(counter.clone(), "10.0.0.7:8000", cfg, unix_clock())?;
/// // ... batches arrive ...
/// let stats = sub.stop()?;
/// assert_eq!(stats.applied as usize, 0, "no publisher here");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait EventSink: Send + Sync {
    /// Judge one decoded batch from `endpoint`'s publisher, received at `now_ms` (the
    /// subscription's clock), and keep it when it is in order. The verdict decides what the
    /// subscription does next: [`StreamVerdict::Gap`] holds the batch and starts a replay from
    /// `expected - 1` (from 0 when `expected` is 0), whose batches come here with
    /// [`BatchOrigin::Replay`] before the held one is delivered again; `Applied` and `Reset` are
    /// counted as applied; a `Duplicate` is dropped.
    ///
    /// An error (e.g. [`StateError::UnknownEndpoint`]) means the batch was not taken: it is
    /// counted ([`super::zmq_sub::SubscriberStats::router_errors`]) and reported, and the stream
    /// goes on (during a replay, the replay fails).
    fn deliver(&self, endpoint: &str, batch: &Batch<'_>, now_ms: u64) -> Result<StreamVerdict, StateError>;

    /// Give up on `endpoint`'s gapped stream at `now_ms` (replay unavailable or failed): drop
    /// what is held for it and accept its next batch, whatever its number, as a fresh start.
    fn resync(&self, endpoint: &str, now_ms: u64) -> Result<(), StateError>;

    /// A replay for `endpoint` ended: `ok` when it recovered its gap. (Not called when no
    /// replay endpoint is configured.) By default nothing is done.
    fn replay_ended(&self, endpoint: &str, ok: bool) {
        let _ = (endpoint, ok);
    }

    /// Something unusual on `endpoint`'s stream (the events an [`super::zmq_sub::Observer`] is
    /// told about, at the same moment, before it): malformed messages, payloads that do not
    /// decode, gaps, restarts, replay failures, resyncs. By default nothing is done.
    fn notice(&self, endpoint: &str, event: &SubscriberEvent) {
        let _ = (endpoint, event);
    }
}

/// The router applies each batch to its precise index ([`Router::apply_batch`]), resyncs with
/// [`Router::resync_stream`] and counts replays with [`Router::record_replay`].
impl EventSink for Router {
    fn deliver(&self, endpoint: &str, batch: &Batch<'_>, now_ms: u64) -> Result<StreamVerdict, StateError> {
        Ok(self.apply_batch(endpoint, batch.decoded, Some(batch.seq), now_ms)?.verdict)
    }

    fn resync(&self, endpoint: &str, now_ms: u64) -> Result<(), StateError> {
        self.resync_stream(endpoint, now_ms)
    }

    fn replay_ended(&self, endpoint: &str, ok: bool) {
        // Counted in the router's metrics (its `metrics_text`); an unknown endpoint was already
        // reported by `deliver`.
        let _ = self.record_replay(endpoint, ok);
    }
}
