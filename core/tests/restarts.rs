//! Engine restarts, in every order the router can see them, through the public `Router` API.
//!
//! Each test feeds a "dead" incarnation of an engine (prompt O: tokens `0..`, engine hashes
//! `1000..`), then a restarted one (prompt N: tokens `100_000..`, engine hashes `50_000..`,
//! sequence numbers from 0 again) and plays the caller's part the way `StreamVerdict` documents
//! it: on a gap, replay from the batch before `expected` (or from 0 when `expected` is 0) out of
//! the publisher's replay buffer, which holds the current incarnation's batches only; when replay
//! cannot bring the stream back, resync. Afterwards it counts the blocks of O still matched
//! (stale: the dead engine's cache is gone) and the blocks of N matched (the new engine's).
//! All time is virtual.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute::StreamVerdict;
use kvroute::{BlockStored, EventBatch, KvEvent, Medium};
use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Role, Router};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";
/// Engine blocks (of 16 tokens) per batch.
const PER_BATCH: u32 = 4;
/// Batches of the dead incarnation: 6 × 4 = 24 blocks of prompt O.
const OLD: u32 = 6;
const STALE_RECOVERY_MS: u64 = 30_000;

fn router() -> Router {
    let policy = format!(r#"{{"index":{{"mode":"precise","precise":{{"stale_recovery_ms":{STALE_RECOVERY_MS}}}}}}}"#);
    let r = Router::new(Policy::from_json(&policy).unwrap());
    for (id, w) in [(A, 1), (B, 0)] {
        r.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
        r.update_metrics(id, MetricsSnapshot { waiting: w, kv_usage: 0.2, updated_ms: 0, ..Default::default() })
            .unwrap();
    }
    r
}

/// The two prompts: the dead incarnation's and the new one's.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Prompt {
    Old,
    New,
}

impl Prompt {
    fn first_token(self) -> u32 {
        match self {
            Prompt::Old => 0,
            Prompt::New => 100_000,
        }
    }
    fn first_hash(self) -> u64 {
        match self {
            Prompt::Old => 1000,
            Prompt::New => 50_000,
        }
    }
}

/// Batch `k` of `prompt`'s chain (blocks `4k..4k+4`, parent = the previous batch's last block).
fn chain_batch(prompt: Prompt, k: u32, ts: f64) -> EventBatch {
    let h0 = prompt.first_hash() + u64::from(PER_BATCH * k);
    let first = prompt.first_token() + 16 * PER_BATCH * k;
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: (0..u64::from(PER_BATCH)).map(|i| h0 + i).collect(),
        parent_block_hash: (k > 0).then(|| h0 - 1),
        token_ids: (first..first + 16 * PER_BATCH).collect(),
        block_size: 16,
        medium: Medium::Gpu,
        ..Default::default()
    });
    EventBatch { ts, events: vec![ev], data_parallel_rank: None }
}

/// Blocks of `prompt` (the first `batches` batches of its chain) the router matches on A at `now`.
fn matched(r: &Router, prompt: Prompt, batches: u32, now: u64) -> u32 {
    let first = prompt.first_token();
    let ids: Vec<u32> = (first..first + 16 * PER_BATCH * batches).collect();
    let body = serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 300}).to_string();
    let d = r.route_http(body.as_bytes(), [("x-request-id", "t")], now).unwrap();
    d.score(A).unwrap().matched_blocks
}

fn healthy(r: &Router, now: u64) -> bool {
    // `events_healthy` is judged at the router's latest time; route once to move it.
    let _ = matched(r, Prompt::New, 1, now);
    r.endpoints().iter().find(|e| &*e.id == A).unwrap().events_healthy
}

/// Print the figures the report quotes (`--nocapture`): stale blocks of O, blocks of N.
fn figure(order: &str, r: &Router, new_batches: u32, now: u64) {
    let stale = matched(r, Prompt::Old, OLD + 1, now);
    let new = matched(r, Prompt::New, new_batches, now);
    eprintln!("FIGURE {order}: stale blocks {stale}, new-incarnation blocks {new}/{}", new_batches * PER_BATCH);
}

/// One publisher incarnation's replay buffer (seq → batch) and the caller that follows the
/// verdicts: what the ZMQ subscriber does, without sockets.
struct Caller<'a> {
    r: &'a Router,
    buffer: Vec<(u64, EventBatch)>,
    now: u64,
    resyncs: u32,
    verdicts: Vec<StreamVerdict>,
}

impl<'a> Caller<'a> {
    fn new(r: &'a Router) -> Self {
        Caller { r, buffer: Vec::new(), now: 1_000, resyncs: 0, verdicts: Vec::new() }
    }

    /// The engine published `batch` as `seq` (kept for replay); the caller does not see it.
    fn lose(&mut self, seq: u64, batch: EventBatch) {
        self.buffer.push((seq, batch));
    }

    /// The engine published `batch` as `seq` and the caller received it.
    fn publish(&mut self, seq: u64, batch: EventBatch) {
        self.buffer.push((seq, batch.clone()));
        self.submit(seq, &batch);
    }

    /// The engine restarted: a new process, an empty replay buffer.
    fn restart(&mut self) {
        self.buffer.clear();
    }

    fn apply(&mut self, seq: u64, batch: &EventBatch) -> StreamVerdict {
        self.now += 10;
        let v = self.r.apply_batch(A, batch, Some(seq), self.now).unwrap().verdict;
        self.verdicts.push(v);
        v
    }

    fn submit(&mut self, seq: u64, batch: &EventBatch) {
        let StreamVerdict::Gap { expected, .. } = self.apply(seq, batch) else { return };
        // Replay from the batch before `expected` (which proves the publisher did not restart),
        // or from 0 once the router reports a restart whose first batches were missed.
        let mut from = expected.saturating_sub(1);
        let mut recovered = false;
        for _attempt in 0..2 {
            match self.replay(from, seq) {
                Ok(()) => {
                    recovered = true;
                    break;
                }
                Err(Some(0)) => from = 0,
                Err(_) => break,
            }
        }
        if !recovered {
            self.r.resync_stream(A, self.now).unwrap();
            self.resyncs += 1;
        }
        if let StreamVerdict::Gap { .. } = self.apply(seq, batch) {
            self.r.resync_stream(A, self.now).unwrap();
            self.resyncs += 1;
            self.apply(seq, batch);
        }
    }

    /// Apply the buffered batches `from..held`. `Err(Some(e))`: a gap from `e` was reported on the
    /// way; `Err(None)`: the buffer does not reach `from`.
    fn replay(&mut self, from: u64, held: u64) -> Result<(), Option<u64>> {
        let batches: Vec<(u64, EventBatch)> =
            self.buffer.iter().filter(|(s, _)| (from..held).contains(s)).cloned().collect();
        if batches.first().map(|b| b.0) != Some(from) && from < held {
            return Err(None);
        }
        for (s, b) in batches {
            if let StreamVerdict::Gap { expected, .. } = self.apply(s, &b) {
                return Err(Some(expected));
            }
        }
        Ok(())
    }
}

/// The dead incarnation: batches 0..OLD of prompt O at ts 1000 + k.
fn dead_incarnation(c: &mut Caller<'_>) {
    for k in 0..OLD {
        c.publish(u64::from(k), chain_batch(Prompt::Old, k, 1000.0 + f64::from(k)));
    }
    assert_eq!(matched(c.r, Prompt::Old, OLD, c.now), 24, "the dead incarnation's blocks are indexed");
}

#[test]
fn restart_first_seen_with_seq_within_the_old_range_replays_from_zero() {
    let r = router();
    let mut c = Caller::new(&r);
    dead_incarnation(&mut c);
    // The engine restarts; its batches 0..3 are lost, 3 (<= the old last seq, 5) is the first seen.
    c.restart();
    for k in 0..3 {
        c.lose(u64::from(k), chain_batch(Prompt::New, k, 2000.0 + f64::from(k)));
    }
    c.publish(3, chain_batch(Prompt::New, 3, 2003.0));
    let now = c.now;
    figure("first seen seq within the old range", &r, 4, now);
    assert_eq!(c.verdicts[OLD as usize], StreamVerdict::Gap { expected: 0, got: 3 }, "{:?}", c.verdicts);
    assert_eq!(matched(&r, Prompt::Old, OLD, now), 0, "stale blocks of the dead incarnation");
    assert_eq!(matched(&r, Prompt::New, 4, now), 16, "the new incarnation's blocks, replayed from 0");
    assert_eq!(c.resyncs, 0);
    assert!(healthy(&r, now));
    assert_eq!(r.stats().precise.resets, 1);
}

#[test]
fn restart_first_seen_within_the_old_range_without_replay_stays_stale_until_resync() {
    let r = router();
    let mut c = Caller::new(&r);
    dead_incarnation(&mut c);
    c.restart(); // and its replay buffer no longer holds 0..3 either
    let held = chain_batch(Prompt::New, 3, 2003.0);
    c.now += 10;
    let v = r.apply_batch(A, &held, Some(3), c.now).unwrap().verdict;
    assert_eq!(v, StreamVerdict::Gap { expected: 0, got: 3 });
    let now = c.now;
    assert_eq!(matched(&r, Prompt::Old, OLD, now), 0, "the dead incarnation's blocks are dropped at once");
    assert!(!healthy(&r, now), "stale while the new incarnation's first batches are missing");
    // Later batches of the new incarnation keep reporting the gap until the caller resyncs.
    let v = r.apply_batch(A, &chain_batch(Prompt::New, 4, 2004.0), Some(4), now + 1).unwrap().verdict;
    assert_eq!(v, StreamVerdict::Gap { expected: 0, got: 4 });
    r.resync_stream(A, now + 2).unwrap();
    assert_eq!(r.apply_batch(A, &held, Some(3), now + 3).unwrap().verdict, StreamVerdict::Applied);
    assert!(!healthy(&r, now + 4), "stale for the recovery window after the resync");
    assert!(healthy(&r, now + 2 + STALE_RECOVERY_MS));
}

#[test]
fn restart_during_a_disconnect_whose_seq_passes_the_old_one_is_not_a_continuation() {
    for clock_behind in [false, true] {
        let r = router();
        let mut c = Caller::new(&r);
        dead_incarnation(&mut c);
        // Disconnected while the engine restarts and publishes 0..9; seq 9 (> the old last, 5)
        // is the first seen. The replay buffer holds the new incarnation's 0..9.
        c.restart();
        let ts0 = if clock_behind { 10.0 } else { 2000.0 };
        for k in 0..9 {
            c.lose(u64::from(k), chain_batch(Prompt::New, k, ts0 + f64::from(k)));
        }
        c.publish(9, chain_batch(Prompt::New, 9, ts0 + 9.0));
        let now = c.now;
        figure(
            if clock_behind { "disconnect, seq passes old, clock behind" } else { "disconnect, seq passes old" },
            &r,
            10,
            now,
        );
        assert_eq!(matched(&r, Prompt::Old, OLD, now), 0, "stale blocks (clock behind: {clock_behind})");
        assert_eq!(matched(&r, Prompt::New, 10, now), 40, "new blocks (clock behind: {clock_behind})");
        assert_eq!(c.resyncs, 0);
        assert!(healthy(&r, now));
    }
}

#[test]
fn restart_with_the_publishers_clock_behind_is_a_restart_not_duplicates() {
    let r = router();
    let mut c = Caller::new(&r);
    dead_incarnation(&mut c);
    c.restart();
    // The new process's clock is behind the old one's (ts 10.. < 1000..).
    for k in 0..4 {
        c.publish(u64::from(k), chain_batch(Prompt::New, k, 10.0 + f64::from(k)));
    }
    let now = c.now;
    figure("clock behind", &r, 4, now);
    assert_eq!(c.verdicts[OLD as usize], StreamVerdict::Reset);
    assert_eq!(matched(&r, Prompt::Old, OLD, now), 0, "stale blocks of the dead incarnation");
    assert_eq!(matched(&r, Prompt::New, 4, now), 16);
    assert_eq!(r.stats().precise.duplicates, 0);
}

#[test]
fn a_future_or_infinite_timestamp_does_not_disable_restart_detection() {
    for bad in [f64::INFINITY, f64::NAN, 1e300, f64::NEG_INFINITY] {
        let r = router();
        let mut c = Caller::new(&r);
        dead_incarnation(&mut c);
        // One more batch of the old incarnation with a broken timestamp.
        c.publish(u64::from(OLD), chain_batch(Prompt::Old, OLD, bad));
        c.restart();
        for k in 0..4 {
            c.publish(u64::from(k), chain_batch(Prompt::New, k, 2000.0 + f64::from(k)));
        }
        let now = c.now;
        figure(&format!("old batch with ts {bad:e}"), &r, 4, now);
        assert_eq!(matched(&r, Prompt::Old, OLD + 1, now), 0, "stale blocks after ts {bad}");
        assert_eq!(matched(&r, Prompt::New, 4, now), 16, "new blocks after ts {bad}");
        // The lag gauge reads the last applied batch's timestamp: finite.
        let text = r.metrics_text(now);
        let lag =
            text.lines().find(|l| l.starts_with("kvroute_event_lag_seconds{endpoint=\"10.0.0.1:8000\"}")).unwrap();
        let v: f64 = lag.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(v.is_finite(), "lag after ts {bad}: {lag}");
    }
}

#[test]
fn true_repeats_are_duplicates_and_unprovable_old_seqs_are_restarts() {
    let r = router();
    let mut c = Caller::new(&r);
    dead_incarnation(&mut c);
    // The same batches again (a relay retrying, a replay overlapping): provably repeats.
    for k in [5u32, 3, 4] {
        let b = chain_batch(Prompt::Old, k, 1000.0 + f64::from(k));
        assert_eq!(r.apply_batch(A, &b, Some(u64::from(k)), 5_000).unwrap().verdict, StreamVerdict::Duplicate);
    }
    assert_eq!(matched(&r, Prompt::Old, OLD, 5_000), 24, "repeats change nothing");
    // A different batch under an already applied seq cannot be a repeat: a new incarnation.
    let b = chain_batch(Prompt::New, 0, 1004.0);
    assert_eq!(r.apply_batch(A, &b, Some(4), 5_001).unwrap().verdict, StreamVerdict::Gap { expected: 0, got: 4 });
    assert_eq!(matched(&r, Prompt::Old, OLD, 5_002), 0);
    assert_eq!(r.stats().precise.resets, 1);
}
