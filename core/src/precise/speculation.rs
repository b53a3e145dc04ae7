//! The speculation records of the precise index, ordered by deadline.
//!
//! A timer wheel: one bucket per 16 ms tick of deadline, a ring of at least `ttl / 16 + 3`
//! buckets, so every record due now is found in the buckets the clock has passed whatever the
//! order the records were made in (calls carrying `now` slightly out of order, a reload that
//! shortened the TTL). Inserting is O(1); withdrawing is O(1) per record plus one bucket visit per
//! tick of clock advance.
//!
//! No record outlives `now + ttl` by much: an incoming deadline is clamped to it; a reload that
//! shortens the TTL holds every record to `now + ttl` (one pass over the records); when the clock
//! steps back by more than a quarter TTL, the records past `now + ttl` are moved to it (one visit
//! of the buckets past the horizon; a smaller step is skew between callers, and records keep their
//! deadlines). Within a bucket, records are withdrawn in insertion
//! order as far as they are due; the rest of a bucket goes when the clock leaves its tick, so a
//! record made with an out-of-order `now` can be withdrawn up to one tick (16 ms) late, never
//! early.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::approx::BlockKey;

/// Deadline resolution, milliseconds.
const TICK_MS: u64 = 16;
/// A clock going back by up to `ttl / SKEW_DIVISOR` is skew between callers (records keep their
/// deadlines); further back, records are held to `now + ttl`.
const SKEW_DIVISOR: u64 = 4;

fn tick(ms: u64) -> u64 {
    ms / TICK_MS
}

/// One routed request's speculation on one endpoint slot.
#[derive(Debug, Clone)]
pub(crate) struct Speculation {
    /// When it is withdrawn (router time, ms).
    pub deadline_ms: u64,
    /// The expiry tick written into its memberships (withdrawal passes it back).
    pub tick: u32,
    pub slot: u32,
    /// The precise index's epoch of `slot` (bumped on activate and retire: a record made for an
    /// endpoint that left the slot is never withdrawn from the slot's next holder).
    pub epoch: u32,
    pub keys: Box<[BlockKey]>,
}

/// Deadline-ordered speculation records (see the module docs).
#[derive(Debug)]
pub(crate) struct SpecQueue {
    buckets: Vec<VecDeque<Speculation>>,
    /// Every record's bucket tick lies in `lo..=hi`, and `hi - lo < buckets.len()`.
    lo: u64,
    hi: u64,
    len: usize,
    keys: usize,
    /// Sum of the buckets' capacities (records).
    cap_records: usize,
    ttl_ms: u64,
    /// The latest `now` seen ([`NO_TIME`] before the first): an atomic so that a router's
    /// decisions can move it under a shared lock when nothing is due ([`SpecQueue::observe`]).
    /// Shared with the queue's [`twin`](SpecQueue::twin): the two copies of an index a `Router`
    /// keeps read one clock, so a decision moving it moves it for both.
    now_ms: Arc<AtomicU64>,
}

/// [`SpecQueue::now_ms`] before any `now` was seen.
const NO_TIME: u64 = u64::MAX;

/// A handle on a queue's clock (shared by its twins): what [`SpecQueue::observe`] moves.
pub(crate) struct SpecClock(Arc<AtomicU64>);

impl SpecClock {
    /// [`SpecQueue::observe`].
    pub(crate) fn observe(&self, now_ms: u64) {
        observe(&self.0, now_ms);
    }
}

fn observe(word: &AtomicU64, now_ms: u64) {
    let now_ms = now_ms.min(NO_TIME - 1);
    // Read first: decisions on several threads at the same millisecond then share the word's
    // cache line instead of taking it from each other.
    if word.load(Ordering::Relaxed) != now_ms {
        word.store(now_ms, Ordering::Relaxed);
    }
}

fn ring_len(ttl_ms: u64) -> usize {
    usize::try_from(tick(ttl_ms) + 3).unwrap_or(usize::MAX >> 1).next_power_of_two()
}

impl SpecQueue {
    pub(crate) fn new(ttl_ms: u64) -> Self {
        let ttl_ms = ttl_ms.max(1);
        SpecQueue {
            buckets: (0..ring_len(ttl_ms)).map(|_| VecDeque::new()).collect(),
            lo: 0,
            hi: 0,
            len: 0,
            keys: 0,
            cap_records: 0,
            ttl_ms,
            now_ms: Arc::new(AtomicU64::new(NO_TIME)),
        }
    }

    /// A copy of the queue that shares its clock (see `now_ms`).
    pub(crate) fn twin(&self) -> Self {
        SpecQueue {
            // Each bucket with its capacity: `cap_records` sums them.
            buckets: {
                let mut b = Vec::with_capacity(self.buckets.capacity());
                b.extend(self.buckets.iter().map(|d| {
                    let mut c = VecDeque::with_capacity(d.capacity());
                    c.extend(d.iter().cloned());
                    c
                }));
                b
            },
            lo: self.lo,
            hi: self.hi,
            len: self.len,
            keys: self.keys,
            cap_records: self.cap_records,
            ttl_ms: self.ttl_ms,
            now_ms: Arc::clone(&self.now_ms),
        }
    }

    /// Records held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The latest `now` seen (by [`SpecQueue::advance`] or [`SpecQueue::observe`]).
    pub(crate) fn now_ms(&self) -> Option<u64> {
        let t = self.now_ms.load(Ordering::Relaxed);
        (t != NO_TIME).then_some(t)
    }

    /// Observe `now_ms` where [`SpecQueue::advance`] at it is not [`due`](SpecQueue::due): only
    /// the clock moves. What else `advance` would do, moving the window's low end over empty
    /// buckets, changes nothing a lookup or a later call reads (the next `advance`, which every
    /// insertion follows, catches up).
    pub(crate) fn observe(&self, now_ms: u64) {
        observe(&self.now_ms, now_ms);
    }

    /// The queue's clock, to [`observe`](SpecClock::observe) without the queue.
    pub(crate) fn clock(&self) -> SpecClock {
        SpecClock(Arc::clone(&self.now_ms))
    }

    /// How long a speculation may have run before routing the same blocks there again extends
    /// it (see `KvIndex::speculate_from`): a quarter of the TTL.
    pub(crate) fn refresh_after_ms(&self) -> u64 {
        self.ttl_ms / 4
    }

    /// Heap bytes: the ring, the records and their keys.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<VecDeque<Speculation>>()
            + self.cap_records * std::mem::size_of::<Speculation>()
            + self.keys * std::mem::size_of::<BlockKey>()
    }

    fn slot_of(&self, t: u64) -> usize {
        (t & (self.buckets.len() as u64 - 1)) as usize
    }

    /// The deadline a record made at `now` with `expires_ms` gets (clamped to `now + ttl`).
    pub(crate) fn deadline(&self, expires_ms: u64, now_ms: u64) -> u64 {
        expires_ms.min(now_ms.saturating_add(self.ttl_ms))
    }

    /// Adopt a new TTL: records past `now + ttl` are held to it at the next `advance`.
    pub(crate) fn set_ttl(&mut self, ttl_ms: u64) {
        let ttl_ms = ttl_ms.max(1);
        if ttl_ms == self.ttl_ms {
            return;
        }
        let shorter = ttl_ms < self.ttl_ms;
        self.ttl_ms = ttl_ms;
        let n = ring_len(ttl_ms);
        if n != self.buckets.len() || shorter {
            let all = self.take_all();
            self.buckets = (0..n).map(|_| VecDeque::new()).collect();
            let horizon = self.now_ms().map(|now| now.saturating_add(ttl_ms));
            for mut s in all {
                if let Some(h) = horizon {
                    s.deadline_ms = s.deadline_ms.min(h);
                }
                self.place(s);
            }
        }
    }

    fn take_all(&mut self) -> Vec<Speculation> {
        let mut all = Vec::with_capacity(self.len);
        for b in &mut self.buckets {
            all.extend(std::mem::take(b));
        }
        self.len = 0;
        self.keys = 0;
        self.cap_records = 0;
        all
    }

    /// Put a record in the bucket of its deadline tick, keeping the window invariant (a record
    /// that would fall outside it goes to the nearest tick inside: never earlier than the
    /// records already held).
    fn place(&mut self, s: Speculation) {
        let w = self.buckets.len() as u64;
        let mut t = tick(s.deadline_ms);
        if self.len == 0 {
            self.lo = t;
            self.hi = t;
        } else {
            t = t.clamp(self.hi.saturating_sub(w - 1), self.lo.saturating_add(w - 1));
            self.lo = self.lo.min(t);
            self.hi = self.hi.max(t);
        }
        self.len += 1;
        self.keys += s.keys.len();
        let i = self.slot_of(t);
        let b = &mut self.buckets[i];
        let before = b.capacity();
        b.push_back(s);
        self.cap_records += b.capacity() - before;
    }

    /// Add a record made at `now_ms` (call [`SpecQueue::advance`] with the same `now` first); its
    /// deadline must already be clamped with [`SpecQueue::deadline`].
    pub(crate) fn insert(&mut self, s: Speculation) {
        self.place(s);
    }

    fn remove_front(&mut self, i: usize) -> Option<Speculation> {
        let s = self.buckets[i].pop_front()?;
        self.len -= 1;
        self.keys -= s.keys.len();
        if self.buckets[i].is_empty() {
            // Give the buffer back: memory follows the records held.
            self.cap_records -= self.buckets[i].capacity();
            self.buckets[i] = VecDeque::new();
        }
        Some(s)
    }

    /// Whether [`SpecQueue::advance`] at `now_ms` would withdraw a record or hold one to
    /// `now + ttl` (read-only; what else `advance` updates, the clock and the bucket window,
    /// changes no lookup).
    pub(crate) fn due(&self, now_ms: u64) -> bool {
        if self.len == 0 {
            return false;
        }
        let horizon = now_ms.saturating_add(self.ttl_ms);
        if self.hi > tick(horizon.saturating_add(self.ttl_ms / SKEW_DIVISOR)) {
            return true;
        }
        let now_t = tick(now_ms);
        if now_t > self.hi {
            return true;
        }
        if (self.lo..now_t).any(|t| !self.buckets[self.slot_of(t)].is_empty()) {
            return true;
        }
        self.lo <= now_t && self.buckets[self.slot_of(now_t)].front().is_some_and(|s| s.deadline_ms <= now_ms)
    }

    /// Observe `now_ms`: records past `now + ttl` are held to it; records due are passed to
    /// `withdraw`.
    pub(crate) fn advance(&mut self, now_ms: u64, mut withdraw: impl FnMut(Speculation)) {
        self.observe(now_ms);
        let now_t = tick(now_ms);
        if self.len == 0 {
            self.lo = now_t;
            self.hi = now_t;
            return;
        }
        let horizon = now_ms.saturating_add(self.ttl_ms);
        if self.hi > tick(horizon.saturating_add(self.ttl_ms / SKEW_DIVISOR)) {
            self.clamp(horizon);
        }
        let w = self.buckets.len() as u64;
        if now_t > self.hi {
            // Everything is due.
            for s in self.take_all() {
                withdraw(s);
            }
            self.lo = now_t;
            self.hi = now_t;
            return;
        }
        // Buckets the clock has left are due entirely.
        while self.lo < now_t && self.len > 0 {
            let i = self.slot_of(self.lo);
            while let Some(s) = self.remove_front(i) {
                withdraw(s);
            }
            self.lo += 1;
        }
        debug_assert!(self.hi - self.lo < w);
        // The current tick's bucket: as far as its records are due, in insertion order.
        if self.lo == now_t {
            let i = self.slot_of(now_t);
            while self.buckets[i].front().is_some_and(|s| s.deadline_ms <= now_ms) {
                if let Some(s) = self.remove_front(i) {
                    withdraw(s);
                }
            }
        }
        if self.len == 0 {
            self.lo = now_t;
            self.hi = now_t;
        }
    }

    /// Hold every record to `horizon`: records in buckets past its tick move to it.
    fn clamp(&mut self, horizon: u64) {
        let h = tick(horizon);
        let mut moved = Vec::new();
        let mut t = self.hi;
        while t > h && t >= self.lo {
            let i = self.slot_of(t);
            while let Some(mut s) = self.remove_front(i) {
                s.deadline_ms = s.deadline_ms.min(horizon);
                moved.push(s);
            }
            t -= 1;
        }
        if self.len == 0 {
            self.lo = h;
        } else {
            self.lo = self.lo.min(h);
        }
        self.hi = h;
        for s in moved {
            self.place(s);
        }
    }

    /// Remove the record due first (for the byte budget).
    pub(crate) fn pop_soonest(&mut self) -> Option<Speculation> {
        while self.len > 0 && self.lo <= self.hi {
            let i = self.slot_of(self.lo);
            if let Some(s) = self.remove_front(i) {
                return Some(s);
            }
            self.lo += 1;
        }
        None
    }

    /// Drop every record.
    pub(crate) fn clear(&mut self) {
        self.take_all();
        self.buckets.iter_mut().for_each(|b| *b = VecDeque::new());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(deadline_ms: u64, id: u64) -> Speculation {
        Speculation { deadline_ms, tick: 0, slot: 0, epoch: 0, keys: vec![id].into() }
    }

    fn insert(q: &mut SpecQueue, now: u64, expires: u64, id: u64) {
        q.advance(now, |_| {});
        let d = q.deadline(expires, now);
        q.insert(spec(d, id));
    }

    fn due(q: &mut SpecQueue, now: u64) -> Vec<u64> {
        let mut out = Vec::new();
        q.advance(now, |s| out.push(s.keys[0]));
        out.sort_unstable();
        out
    }

    /// `due` (the read-only check `Router` makes before a decision's read phase) is true
    /// whenever `advance` would withdraw something: on a pseudo-random walk of inserts and
    /// clock readings, forwards, backwards and past the window.
    #[test]
    fn due_predicts_every_withdrawal() {
        let mut q = SpecQueue::new(300);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let (mut now, mut withdrawals, mut quiet) = (1_000u64, 0, 0);
        for id in 0..20_000u64 {
            let r = next();
            now = match r % 16 {
                0 => now.saturating_sub((r >> 40) & 0x1ff),
                1 => now + 700 + ((r >> 40) & 0x3ff),
                _ => now + ((r >> 40) & 0x1f),
            };
            if (r >> 8) & 1 == 0 {
                let predicted = q.due(now);
                let mut n = 0;
                q.advance(now, |_| n += 1);
                assert!(predicted || n == 0, "step {id}: {n} withdrawn at {now} without due");
                withdrawals += n;
                quiet += usize::from(!predicted);
            } else {
                insert(&mut q, now, now + ((r >> 20) & 0x1ff), id);
            }
        }
        assert!(withdrawals > 1_000 && quiet > 1_000, "both cases exercised ({withdrawals}, {quiet})");
    }

    #[test]
    fn records_are_withdrawn_by_deadline_not_by_insertion_order() {
        let mut q = SpecQueue::new(2_000);
        insert(&mut q, 1_000, 3_000, 1);
        insert(&mut q, 950, 2_950, 2); // an out-of-order `now`
        assert_eq!(due(&mut q, 2_949), Vec::<u64>::new());
        assert_eq!(due(&mut q, 2_950 + TICK_MS), vec![2]);
        assert_eq!(due(&mut q, 3_000), vec![1]);
        assert_eq!(q.len(), 0);
        assert_eq!(q.memory_bytes(), q.buckets.len() * std::mem::size_of::<VecDeque<Speculation>>());
    }

    #[test]
    fn deadlines_are_held_to_now_plus_ttl() {
        let mut q = SpecQueue::new(2_000);
        insert(&mut q, 10, u64::MAX, 1);
        assert_eq!(due(&mut q, 2_010), vec![1], "a far-future expiry is clamped on insertion");
        // A step back of 900 s: what was made before is held to the new horizon.
        insert(&mut q, 1_000_000, 1_002_000, 2);
        insert(&mut q, 100_000, 102_000, 3);
        assert_eq!(due(&mut q, 102_000), vec![2, 3]);
        // A shorter TTL holds what was made under the longer one.
        let mut q = SpecQueue::new(60_000);
        insert(&mut q, 0, 60_000, 4);
        q.set_ttl(1_000);
        insert(&mut q, 10, 1_010, 5);
        assert_eq!(due(&mut q, 1_010), vec![4, 5]);
    }

    #[test]
    fn forward_jumps_and_the_budget_pop_take_the_soonest() {
        let mut q = SpecQueue::new(2_000);
        for i in 0..100 {
            insert(&mut q, i * 7, i * 7 + 2_000, i);
        }
        assert_eq!(q.pop_soonest().map(|s| s.keys[0]), Some(0));
        assert_eq!(due(&mut q, 10_000_000).len(), 99);
        insert(&mut q, 10_000_001, 10_002_001, 7);
        assert_eq!(due(&mut q, 10_002_001), vec![7]);
    }
}
