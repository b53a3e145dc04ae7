//! One publisher's numbered batch stream: which batches are in order, repeats, gaps, or the
//! first of a restarted publisher.
//!
//! The module is private: its full description is the documentation of [`StreamTracker`].

use serde::Serialize;

use crate::precise::events::{EventBatch, KvEvent};

/// How a batch's sequence number is judged against what the stream has seen.
///
/// The publisher's timestamp never decides a verdict (a restarted engine's clock may be behind,
/// one batch may carry a future or non-finite `ts`): a sequence number that goes back is a
/// [`StreamVerdict::Duplicate`] only when the batch provably repeats one of the last
/// [`RECENT_BATCHES`] batches applied (same sequence number, same content and timestamp);
/// anything else is a new publisher incarnation, whose endpoint is cleared at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "verdict")]
pub enum StreamVerdict {
    /// In order (or the first batch seen, or unnumbered): applied.
    Applied,
    /// A repeat of a batch recently applied under the same sequence number: ignored.
    Duplicate,
    /// Batches `expected .. got` are missing: NOT applied. Replay from `expected - 1` (from 0
    /// when `expected` is 0) and submit the replayed batches, then this one again: the batch
    /// before `expected` was applied already, so the router judges it a duplicate when the
    /// publisher is the same process, and a restart (this verdict with `expected` 0) when the
    /// engine restarted in between, e.g. during a disconnect. If replay is unavailable or no
    /// longer reaches back that far, call the router's `resync_stream` and submit this batch
    /// again.
    ///
    /// `expected` 0 after a sequence number that went back: the publisher restarted and its
    /// batches `0 .. got` were missed. The endpoint's entries were already cleared and it counts
    /// as unhealthy until batch 0 is applied or the stream is resynchronized.
    Gap {
        /// First missing sequence number.
        expected: u64,
        /// The sequence number received.
        got: u64,
    },
    /// The publisher restarted (sequence back to 0, not a repeat): the endpoint's entries were
    /// cleared and the batch applied.
    Reset,
}

impl StreamVerdict {
    /// Whether the batch is to be applied (or forwarded): [`StreamVerdict::Applied`] or
    /// [`StreamVerdict::Reset`].
    pub fn accepted(self) -> bool {
        matches!(self, StreamVerdict::Applied | StreamVerdict::Reset)
    }
}

/// How many recently applied batches per stream are remembered (sequence number and a digest of
/// the content and timestamp) to tell a repeated batch from a restarted publisher's.
pub const RECENT_BATCHES: usize = 64;

/// Publisher timestamps (seconds) above this are not kept as the stream's latest (see
/// [`crate::PreciseStats::bad_timestamps`]): about the year 5138 as UNIX time, so a value in
/// milliseconds or a far-future clock is recognised.
pub const MAX_PUBLISHER_TS_S: f64 = 1e11;

/// A digest of what identifies a published batch: its timestamp's bits and its events (kinds,
/// media, hashes, parents, token counts). Equal for a batch delivered twice; what
/// [`StreamTracker::judge`] compares to tell a repeat from a restarted publisher's batch.
pub fn batch_digest(batch: &EventBatch) -> u64 {
    #[inline]
    fn mix(h: u64, x: u64) -> u64 {
        (h.rotate_left(5) ^ x).wrapping_mul(0x517c_c1b7_2722_0a95)
    }
    let mut h = mix(0x6b76_726f_7574_6521, batch.ts.to_bits());
    h = mix(h, batch.events.len() as u64);
    for ev in &batch.events {
        match ev {
            KvEvent::BlockStored(s) => {
                h = mix(mix(h, 1), s.medium as u64);
                h = mix(h, s.parent_block_hash.map_or(u64::MAX, |p| p ^ 0x5555));
                h = mix(h, s.token_ids.len() as u64);
                h = mix(h, s.token_ids.first().map_or(0, |&t| u64::from(t)));
                for &b in &s.block_hashes {
                    h = mix(h, b);
                }
            }
            KvEvent::BlockRemoved(r) => {
                h = mix(mix(h, 2), r.medium as u64);
                for &b in &r.block_hashes {
                    h = mix(h, b);
                }
            }
            KvEvent::AllBlocksCleared => h = mix(h, 3),
        }
    }
    h
}

/// What [`StreamTracker::judge`] decided about one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct StreamJudgment {
    /// The verdict: apply the batch when [`StreamVerdict::accepted`].
    pub verdict: StreamVerdict,
    /// This batch revealed a new publisher incarnation (a sequence number that went back
    /// without repeating a batch recently applied): the caller must drop everything it holds
    /// from this publisher, before applying the batch when the verdict is
    /// [`StreamVerdict::Reset`]. With [`StreamVerdict::Gap`] from 0 the stream then waits for
    /// the new process's first batch (see [`StreamTracker::awaiting_start`]).
    pub restarted: bool,
}

/// Event-stream state of one endpoint, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StreamInfo {
    /// Last sequence number applied.
    pub last_seq: Option<u64>,
    /// Publisher timestamp (seconds) of the latest applied batch whose timestamp was plausible
    /// (finite, within `0..=`[`MAX_PUBLISHER_TS_S`]).
    pub last_publisher_ts: f64,
    /// Router time (ms) when the last batch was applied.
    pub last_applied_ms: Option<u64>,
    /// Whether routing trusts the stream now.
    pub healthy: bool,
}

/// The judgment of one publisher's stream (see [`StreamVerdict`] for the rules).
///
/// Pure: no index, no I/O, no clock (times are arguments). About 1 KiB once a numbered batch
/// has been applied (the [`RECENT_BATCHES`] window), a few words before.
///
/// ---
///
/// One publisher's numbered batch stream: which batches are in order, repeats, gaps, or the
/// first of a restarted publisher.
///
/// A [`StreamTracker`] holds no index and does no I/O: it is told each batch's sequence number
/// and content digest ([`batch_digest`]) and answers with a [`StreamVerdict`]; time is passed in.
/// [`crate::KvIndex`] keeps one per endpoint and applies the batches it accepts; a program that
/// only forwards batches (the Envoy filter's relay) uses one per engine to decide what to forward.
///
/// ```
/// use kvroute::{batch_digest, StreamTracker};
/// use kvroute::{EventBatch, StreamVerdict};
///
/// let batch = |ts: f64| EventBatch { ts, events: Vec::new(), data_parallel_rank: None };
/// let mut t = StreamTracker::new();
/// let (b0, b1) = (batch(1.0), batch(2.0));
/// assert_eq!(t.judge(Some(0), batch_digest(&b0)).verdict, StreamVerdict::Applied);
/// assert_eq!(t.judge(Some(1), batch_digest(&b1)).verdict, StreamVerdict::Applied);
/// assert_eq!(t.judge(Some(1), batch_digest(&b1)).verdict, StreamVerdict::Duplicate);
/// assert_eq!(t.judge(Some(5), 0).verdict, StreamVerdict::Gap { expected: 2, got: 5 });
/// // A new process numbering from 0 again: the caller drops what it holds for this publisher.
/// let restart = t.judge(Some(0), batch_digest(&batch(0.5)));
/// assert_eq!((restart.verdict, restart.restarted), (StreamVerdict::Reset, true));
/// ```
#[derive(Debug, Clone, Default)]
pub struct StreamTracker {
    last_seq: Option<u64>,
    last_ts: f64,
    seen_events: bool,
    stale_until_ms: u64,
    /// Caller time of the last applied batch.
    last_applied_ms: Option<u64>,
    /// The publisher restarted and its first batches were missed: only seq 0 is in order.
    awaiting_start: bool,
    /// (seq, digest) of recently applied numbered batches, at `seq % RECENT_BATCHES` (allocated
    /// on the first one).
    recent: Vec<(u64, u64)>,
}

impl StreamTracker {
    /// A stream that has seen nothing: its first batch, whatever its number, starts it.
    pub fn new() -> Self {
        StreamTracker::default()
    }

    /// Judge one batch: `seq` is the publisher's sequence number (`None`: unnumbered, always
    /// applied and never remembered), `digest` its [`batch_digest`] (ignored when unnumbered).
    ///
    /// An accepted batch ([`StreamVerdict::accepted`]) is remembered as applied: the caller
    /// applies (or forwards) it. A duplicate or a gap changes nothing, except that a batch that
    /// reveals a restarted publisher ([`StreamJudgment::restarted`]) forgets the old sequence first.
    pub fn judge(&mut self, seq: Option<u64>, digest: u64) -> StreamJudgment {
        let mut restarted = false;
        let verdict = match (seq, self.last_seq) {
            (None, _) => StreamVerdict::Applied,
            (Some(0), None) => StreamVerdict::Applied,
            (Some(s), None) if self.awaiting_start => StreamVerdict::Gap { expected: 0, got: s },
            (Some(_), None) => StreamVerdict::Applied,
            (Some(s), Some(last)) if s == last.wrapping_add(1) => StreamVerdict::Applied,
            (Some(s), Some(last)) if s <= last => {
                if self.is_repeat(s, digest) {
                    StreamVerdict::Duplicate
                } else {
                    // Not a batch this stream applied: a new incarnation of the publisher.
                    restarted = true;
                    self.forget();
                    if s == 0 {
                        StreamVerdict::Reset
                    } else {
                        self.awaiting_start = true;
                        StreamVerdict::Gap { expected: 0, got: s }
                    }
                }
            }
            (Some(s), Some(last)) => StreamVerdict::Gap { expected: last + 1, got: s },
        };
        if verdict.accepted() {
            if let Some(s) = seq {
                self.last_seq = Some(s);
                self.awaiting_start = false;
                self.remember(s, digest);
            }
            self.seen_events = true;
        }
        StreamJudgment { verdict, restarted }
    }

    /// Note the publisher timestamp (seconds) of a batch just accepted and, when given, the
    /// caller's time (ms) it was applied at, for the lag gauge. Returns whether `ts` was kept: a
    /// timestamp that is not finite, negative or above [`MAX_PUBLISHER_TS_S`] is not (it never
    /// judges the stream, so a single far-future or non-finite one cannot stick).
    pub fn note_applied(&mut self, ts: f64, now_ms: Option<u64>) -> bool {
        if now_ms.is_some() {
            self.last_applied_ms = now_ms;
        }
        let plausible = (0.0..=MAX_PUBLISHER_TS_S).contains(&ts);
        if plausible {
            self.last_ts = ts;
        }
        plausible
    }

    /// Forget the sequence: the next batch, whatever its number, starts the stream afresh.
    pub fn forget(&mut self) {
        self.last_seq = None;
        self.awaiting_start = false;
        self.recent.clear();
    }

    /// Give up on a gapped stream at `now_ms`: [`StreamTracker::forget`], and unhealthy until
    /// `now_ms + stale_recovery_ms`.
    pub fn resync(&mut self, now_ms: u64, stale_recovery_ms: u64) {
        self.forget();
        self.stale_until_ms = now_ms.saturating_add(stale_recovery_ms);
    }

    /// Whether the stream can be trusted at `now_ms`: it has delivered a batch, is not recovering
    /// from a resync, and is not waiting for a restarted publisher's first batches.
    pub fn healthy(&self, now_ms: u64) -> bool {
        self.seen_events && !self.awaiting_start && now_ms >= self.stale_until_ms
    }

    /// The last sequence number accepted (`None`: none yet, or forgotten).
    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// Whether a restarted publisher was detected after its first batches: only batch 0 (or a
    /// resync) brings the stream back.
    pub fn awaiting_start(&self) -> bool {
        self.awaiting_start
    }

    /// Until when (caller time, ms) the stream counts as stale after a resync.
    pub fn stale_until_ms(&self) -> u64 {
        self.stale_until_ms
    }

    /// The stream's state at `now_ms`, for metrics.
    pub fn info(&self, now_ms: u64) -> StreamInfo {
        StreamInfo {
            last_seq: self.last_seq,
            last_publisher_ts: self.last_ts,
            last_applied_ms: self.last_applied_ms,
            healthy: self.healthy(now_ms),
        }
    }

    /// Whether `seq` was applied recently with this digest.
    fn is_repeat(&self, seq: u64, digest: u64) -> bool {
        self.recent.get(seq as usize % RECENT_BATCHES).is_some_and(|&(s, d)| s == seq && d == digest)
    }

    fn remember(&mut self, seq: u64, digest: u64) {
        if self.recent.is_empty() {
            self.recent = vec![(u64::MAX, 0); RECENT_BATCHES];
        }
        self.recent[seq as usize % RECENT_BATCHES] = (seq, digest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precise::events::{BlockStored, Medium};

    fn batch(ts: f64, hash: u64) -> EventBatch {
        let stored = BlockStored { block_hashes: vec![hash], medium: Medium::Gpu, ..Default::default() };
        EventBatch { ts, events: vec![KvEvent::BlockStored(stored)], data_parallel_rank: None }
    }

    /// Judge batch `(ts, hash)` numbered `seq`.
    fn judge(t: &mut StreamTracker, seq: u64, ts: f64, hash: u64) -> StreamJudgment {
        t.judge(Some(seq), batch_digest(&batch(ts, hash)))
    }

    fn verdict(t: &mut StreamTracker, seq: u64, ts: f64, hash: u64) -> StreamVerdict {
        let j = judge(t, seq, ts, hash);
        assert!(!j.restarted, "seq {seq}: unexpected restart");
        j.verdict
    }

    #[test]
    fn in_order_batches_are_applied_from_whatever_number_comes_first() {
        let mut t = StreamTracker::new();
        assert!(!t.healthy(0), "nothing seen yet");
        assert_eq!(verdict(&mut t, 7, 1.0, 1), StreamVerdict::Applied, "the first batch starts the stream");
        for seq in 8..200 {
            assert_eq!(verdict(&mut t, seq, seq as f64, seq), StreamVerdict::Applied);
        }
        assert_eq!(t.last_seq(), Some(199));
        assert!(t.healthy(0));
        // The sequence wraps like the publisher's counter.
        let mut w = StreamTracker::new();
        assert_eq!(verdict(&mut w, u64::MAX, 1.0, 1), StreamVerdict::Applied);
        assert_eq!(verdict(&mut w, 0, 2.0, 2), StreamVerdict::Applied);
    }

    #[test]
    fn a_repeat_of_a_recent_batch_is_a_duplicate_and_changes_nothing() {
        let mut t = StreamTracker::new();
        for seq in 0..10 {
            assert_eq!(verdict(&mut t, seq, seq as f64, seq), StreamVerdict::Applied);
        }
        assert_eq!(verdict(&mut t, 9, 9.0, 9), StreamVerdict::Duplicate);
        assert_eq!(verdict(&mut t, 3, 3.0, 3), StreamVerdict::Duplicate, "an older one, within the window");
        assert_eq!(t.last_seq(), Some(9));
        assert_eq!(verdict(&mut t, 10, 10.0, 10), StreamVerdict::Applied, "the stream goes on");
        // Beyond the window a repeat can no longer be proven: a restart.
        for seq in 11..11 + RECENT_BATCHES as u64 {
            assert_eq!(verdict(&mut t, seq, seq as f64, seq), StreamVerdict::Applied);
        }
        let j = judge(&mut t, 10, 10.0, 10);
        assert_eq!((j.verdict, j.restarted), (StreamVerdict::Gap { expected: 0, got: 10 }, true));
    }

    #[test]
    fn a_gap_is_reported_and_the_held_batch_applies_once_it_is_filled() {
        let mut t = StreamTracker::new();
        assert_eq!(verdict(&mut t, 0, 1.0, 1), StreamVerdict::Applied);
        assert_eq!(verdict(&mut t, 3, 4.0, 4), StreamVerdict::Gap { expected: 1, got: 3 });
        assert_eq!(t.last_seq(), Some(0), "a gap is not applied");
        assert_eq!(verdict(&mut t, 3, 4.0, 4), StreamVerdict::Gap { expected: 1, got: 3 }, "still missing");
        // Replay: the last batch applied (a continuity proof), then the missing ones.
        assert_eq!(verdict(&mut t, 0, 1.0, 1), StreamVerdict::Duplicate);
        assert_eq!(verdict(&mut t, 1, 2.0, 2), StreamVerdict::Applied);
        assert_eq!(verdict(&mut t, 2, 3.0, 3), StreamVerdict::Applied);
        assert_eq!(verdict(&mut t, 3, 4.0, 4), StreamVerdict::Applied);
        assert!(t.healthy(0), "a gap alone does not make the stream unhealthy");
    }

    #[test]
    fn a_restart_at_zero_is_a_reset_even_with_the_publishers_clock_behind() {
        let mut t = StreamTracker::new();
        for seq in 0..3 {
            assert_eq!(verdict(&mut t, seq, 100.0 + seq as f64, seq), StreamVerdict::Applied);
        }
        // Same number as an applied batch, other content (and an older timestamp): a new process.
        let j = judge(&mut t, 0, 0.5, 555);
        assert_eq!(j, StreamJudgment { verdict: StreamVerdict::Reset, restarted: true });
        assert_eq!(t.last_seq(), Some(0));
        assert_eq!(verdict(&mut t, 1, 0.6, 556), StreamVerdict::Applied);
        // The old incarnation's batches are forgotten: its batch 1 repeated now is not a duplicate.
        let j = judge(&mut t, 1, 101.0, 1);
        assert_eq!((j.verdict, j.restarted), (StreamVerdict::Gap { expected: 0, got: 1 }, true));
        assert!(t.awaiting_start() && !t.healthy(0));
    }

    #[test]
    fn a_restart_seen_after_its_first_batches_waits_for_batch_zero() {
        let mut t = StreamTracker::new();
        for seq in 0..6 {
            assert_eq!(verdict(&mut t, seq, seq as f64, seq), StreamVerdict::Applied);
        }
        let j = judge(&mut t, 2, 50.0, 900);
        assert_eq!(j, StreamJudgment { verdict: StreamVerdict::Gap { expected: 0, got: 2 }, restarted: true });
        assert!(t.awaiting_start() && !t.healthy(0));
        assert_eq!(t.last_seq(), None);
        // Until batch 0 comes, every other number is the same gap, without a second restart.
        assert_eq!(verdict(&mut t, 2, 50.0, 900), StreamVerdict::Gap { expected: 0, got: 2 });
        assert_eq!(verdict(&mut t, 7, 55.0, 905), StreamVerdict::Gap { expected: 0, got: 7 });
        // The replay from 0 brings the new process's batches in order.
        for seq in 0..3 {
            assert_eq!(verdict(&mut t, seq, 48.0 + seq as f64, 898 + seq), StreamVerdict::Applied);
        }
        assert!(!t.awaiting_start() && t.healthy(0));
    }

    #[test]
    fn resync_forgets_the_sequence_and_marks_the_stream_stale() {
        let mut t = StreamTracker::new();
        assert_eq!(verdict(&mut t, 0, 1.0, 1), StreamVerdict::Applied);
        assert_eq!(verdict(&mut t, 50, 2.0, 2), StreamVerdict::Gap { expected: 1, got: 50 });
        t.resync(1_000, 30_000);
        assert_eq!(t.last_seq(), None);
        assert_eq!(t.stale_until_ms(), 31_000);
        assert_eq!(verdict(&mut t, 50, 2.0, 2), StreamVerdict::Applied, "a fresh start");
        assert!(!t.healthy(30_999));
        assert!(t.healthy(31_000));
        // A resync also ends the wait for a restarted publisher's first batch.
        let j = judge(&mut t, 10, 9.0, 9);
        assert!(j.restarted && t.awaiting_start());
        t.resync(40_000, 0);
        assert_eq!(verdict(&mut t, 10, 9.0, 9), StreamVerdict::Applied);
        assert!(t.healthy(40_000));
    }

    #[test]
    fn unnumbered_batches_are_always_applied_and_never_remembered() {
        let mut t = StreamTracker::new();
        assert_eq!(t.judge(None, 0).verdict, StreamVerdict::Applied);
        assert!(t.healthy(0) && t.last_seq().is_none());
        assert_eq!(verdict(&mut t, 4, 1.0, 1), StreamVerdict::Applied);
        // Between numbered batches they neither advance nor break the sequence.
        assert_eq!(t.judge(None, 0).verdict, StreamVerdict::Applied);
        assert_eq!(t.judge(None, 0).verdict, StreamVerdict::Applied);
        assert_eq!(verdict(&mut t, 5, 2.0, 2), StreamVerdict::Applied);
        // Nor do they end the wait for a restarted publisher's batch 0.
        assert!(judge(&mut t, 1, 3.0, 3).restarted);
        assert_eq!(t.judge(None, 0).verdict, StreamVerdict::Applied);
        assert!(t.awaiting_start());
    }

    #[test]
    fn lag_state_keeps_plausible_timestamps_only() {
        let mut t = StreamTracker::new();
        assert_eq!(verdict(&mut t, 0, 1.0, 1), StreamVerdict::Applied);
        assert!(t.note_applied(1_700_000_000.5, Some(42)));
        assert!(!t.note_applied(f64::NAN, None));
        assert!(!t.note_applied(1_700_000_000_000.0, None), "milliseconds, not seconds");
        assert!(!t.note_applied(-1.0, None));
        let info = t.info(0);
        assert_eq!(info.last_publisher_ts, 1_700_000_000.5);
        assert_eq!((info.last_seq, info.last_applied_ms, info.healthy), (Some(0), Some(42), true));
    }

    #[test]
    fn the_digest_tells_content_and_timestamp_apart() {
        assert_eq!(batch_digest(&batch(1.0, 7)), batch_digest(&batch(1.0, 7)));
        assert_ne!(batch_digest(&batch(1.0, 7)), batch_digest(&batch(1.0, 8)));
        assert_ne!(batch_digest(&batch(1.0, 7)), batch_digest(&batch(1.5, 7)));
        let empty = EventBatch { ts: 1.0, events: Vec::new(), data_parallel_rank: None };
        assert_ne!(batch_digest(&empty), batch_digest(&batch(1.0, 7)));
    }
}
