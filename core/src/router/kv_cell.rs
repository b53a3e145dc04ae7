//! The precise index's cell: one copy in a [`RouterCore`](super::RouterCore) on its own, two in
//! a [`Router`](crate::Router), so that event application never holds up a lookup.
//!
//! With two copies, lookups read the *published* copy (an `ArcSwap` load: the reading thread
//! writes only its own slot, so readers share no word and never wait); event application and
//! the decisions' speculation (under the router's shared lock, beside decisions) write the
//! other one, publish it, wait for the lookups still reading the old one to leave (its `Arc`
//! count falls to one), and write the same into it. Every write reaches both copies in the same
//! order through a deterministic closure, so they stay equal; the speculation's clock is one
//! word both copies share (`SpecQueue::twin`). Writes under the router's exclusive lock (`&mut`)
//! reach both copies directly. This is the left-right scheme (two copies, readers never wait for
//! a writer), built on `arc-swap` rather than the `left-right` crate: that crate replays owned
//! operations from a log and gives each reader thread a handle of its own, while these writes
//! borrow the caller's event batch and come from any thread, and the readers are whichever
//! threads route.
//!
//! A decision's speculation never waits for another writer: when one is at work (an event
//! batch, another decision's speculation), the speculation is handed to it ([`Handoff`]) and
//! the decision goes on; the writer applies what it was handed to both copies before it lets
//! the copies go. A writer holding the turn in a loop (a thread applying events at full rate)
//! would otherwise keep a decision waiting for the lock through many of its batches: the lock
//! is not fair, and a waiter put to sleep wakes up after the writer has taken it again. One
//! thread alone never hands anything over (no other writer is ever at work), so it writes as
//! before.
//!
//! Like `router/mod.rs`, this file is allowed synchronization by `scripts/check-sans-io.sh`:
//! it is the one synchronized part `RouterCore` holds, and only a `Router` turns it on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;

use crate::approx::BlockKey;
use crate::precise::speculation::SpecClock;
use crate::precise::KvIndex;

/// The precise index, its copies and the count of writes that a decision's read phase checks
/// (see `Versioned` in `state.rs`).
pub(crate) struct KvCell {
    copies: Copies,
    /// Two copies may be kept (a `Router` holds the core): see [`KvCell::keep_copies`].
    sharable: bool,
    /// Write accesses through `&mut` (decisions, maintenance, endpoint and policy changes);
    /// events applied beside decisions ([`KvCell::write_shared`]) are not counted (see there).
    writes: u64,
}

// One copy stays inline (a core on its own reads it without an indirection); two are boxed once
// per router.
#[allow(clippy::large_enum_variant)]
enum Copies {
    One(KvIndex),
    Two(Box<Pair>),
}

struct Pair {
    /// The copy lookups read. Loading it writes only the reading thread's own slot (arc-swap's
    /// debts), so readers share no word: nothing they do passes a cache line between them.
    published: ArcSwap<KvCopy>,
    /// The other copy, the writers' (its mutex orders them: several event threads take turns).
    /// `None` only while a writer has it in hand.
    spare: Mutex<Option<Arc<KvCopy>>>,
    /// The writers at work and the speculation handed to them (see [`KvCell::speculate_shared`]).
    /// Taken after `spare` or on its own, never the other way round.
    handoff: Mutex<Handoff>,
    /// An empty index, published for a moment while a write under `&mut` holds the published
    /// copy (no lookup runs then), so that the write allocates nothing.
    placeholder: Arc<KvCopy>,
    /// The speculation's clock, which both copies share.
    clock: SpecClock,
    /// Whether the copies hold speculation (set after every write): a decision that does not
    /// read the index takes no guard on it unless speculation may come due.
    speculating: AtomicBool,
}

/// The writers' hand-off: speculation handed by decisions to the writer at work.
#[derive(Default)]
struct Handoff {
    /// Writers that hold the writers' turn (`spare`) or wait for it, and will take what is
    /// handed over before they let it go ([`Turn::finish`]). Nothing is handed over while it is
    /// zero: `pending` is then empty.
    writers: usize,
    /// Speculation handed over, in the order it came.
    pending: Vec<SpecWrite>,
    /// Key buffers of applied hand-overs, for the next ones (at most [`SPARE_BUFFERS`]).
    buffers: Vec<Vec<BlockKey>>,
}

/// Key buffers a [`Handoff`] keeps for reuse.
const SPARE_BUFFERS: usize = 16;

/// A decision's speculation, as [`KvIndex::speculate_from`] takes it, for every slot routed to.
struct SpecWrite {
    keys: Vec<BlockKey>,
    /// `(slot, blocks of keys it already holds)`: the decode endpoint's, then the prefill one's.
    slots: [(usize, usize); 2],
    len: usize,
    expires_ms: u64,
    now_ms: u64,
}

impl SpecWrite {
    fn apply(&self, kv: &mut KvIndex) {
        speculate(kv, &self.keys, &self.slots[..self.len], self.expires_ms, self.now_ms);
    }
}

/// Speculate `keys` on every slot of `slots` (`(slot, blocks it already holds)`).
fn speculate(kv: &mut KvIndex, keys: &[BlockKey], slots: &[(usize, usize)], expires_ms: u64, now_ms: u64) {
    for &(slot, held) in slots {
        kv.speculate_from(keys, held, slot, expires_ms, now_ms);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Pair {
    /// Count a writer in (before it takes the turn: see [`Handoff::writers`]).
    fn enter(&self) {
        lock(&self.handoff).writers += 1;
    }

    fn note_speculation(&self, s: bool) {
        if self.speculating.load(Ordering::Relaxed) != s {
            self.speculating.store(s, Ordering::Relaxed);
        }
    }
}

/// The index as read: the copy itself, or a guard on the published copy.
pub(crate) enum KvRead<'a> {
    Plain(&'a KvIndex),
    Guard(arc_swap::Guard<Arc<KvCopy>>),
}

/// A cheap empty index: it stands in while the copies move.
fn empty_index() -> KvIndex {
    KvIndex::new(&crate::config::PolicyConfig::default(), 0, 1)
}

/// One of the two copies. Cloning makes a twin (`KvIndex::twin`), which `Arc::make_mut` would
/// do only if a copy were written while still read; [`exclusive`] waits for its readers instead.
pub(crate) struct KvCopy(KvIndex);

impl Clone for KvCopy {
    fn clone(&self) -> Self {
        KvCopy(self.0.twin())
    }
}

/// The copy in `arc` to write, once the lookups still reading it (it was published until a
/// moment ago) have left: nothing can take a new reference to a copy that is not published.
fn exclusive(arc: &mut Arc<KvCopy>) -> &mut KvIndex {
    while Arc::strong_count(arc) > 1 {
        std::hint::spin_loop();
    }
    &mut Arc::make_mut(arc).0
}

impl std::ops::Deref for KvRead<'_> {
    type Target = KvIndex;

    fn deref(&self) -> &KvIndex {
        match self {
            KvRead::Plain(k) => k,
            KvRead::Guard(g) => &g.0,
        }
    }
}

impl KvCell {
    pub(crate) fn new(index: KvIndex) -> Self {
        KvCell { copies: Copies::One(index), sharable: false, writes: 0 }
    }

    /// The cell of a `Router`'s core: two copies when `two` (`index.precise.two_copies`), and
    /// from now on as [`KvCell::keep_copies`] says at every reload.
    pub(crate) fn into_shared(mut self, two: bool) -> Self {
        self.sharable = true;
        self.keep_copies(two);
        self
    }

    /// Keep two copies or one (`index.precise.two_copies`; only in a `Router`'s core: a core on
    /// its own keeps one). Going to two copies makes the second a twin of the first; going to
    /// one drops the second.
    pub(crate) fn keep_copies(&mut self, two: bool) {
        let two = two && self.sharable;
        if two == matches!(self.copies, Copies::Two(_)) {
            return;
        }
        let placeholder = Copies::One(empty_index());
        self.copies = match std::mem::replace(&mut self.copies, placeholder) {
            Copies::One(a) => {
                let b = a.twin();
                let clock = a.speculation_clock();
                let speculating = AtomicBool::new(a.has_speculation());
                Copies::Two(Box::new(Pair {
                    published: ArcSwap::from_pointee(KvCopy(a)),
                    spare: Mutex::new(Some(Arc::new(KvCopy(b)))),
                    handoff: Mutex::new(Handoff::default()),
                    placeholder: Arc::new(KvCopy(empty_index())),
                    clock,
                    speculating,
                }))
            }
            Copies::Two(p) => {
                // Under `&mut`: no lookup holds a copy.
                let mut a = p.published.into_inner();
                let a = std::mem::replace(exclusive(&mut a), empty_index());
                Copies::One(a)
            }
        };
    }

    /// Whether writes can be made beside lookups (two copies).
    pub(crate) fn shared(&self) -> bool {
        matches!(self.copies, Copies::Two(_))
    }

    /// Copies held (1 or 2).
    pub(crate) fn copies(&self) -> u64 {
        match self.copies {
            Copies::One(_) => 1,
            Copies::Two(_) => 2,
        }
    }

    /// Whether the index may hold speculation (always `true` with one copy, which is read
    /// without locking): a decision that does not read the index needs no guard on it
    /// otherwise, as no speculation can come due.
    pub(crate) fn may_speculate(&self) -> bool {
        match &self.copies {
            Copies::One(_) => true,
            Copies::Two(p) => p.speculating.load(Ordering::Relaxed),
        }
    }

    /// The index to read: the published copy, held until the guard drops.
    pub(crate) fn read(&self) -> KvRead<'_> {
        match &self.copies {
            Copies::One(k) => KvRead::Plain(k),
            // Never waits: a writer writes only the copy that is not published.
            Copies::Two(p) => KvRead::Guard(p.published.load()),
        }
    }

    /// [`KvIndex::observe_clock`] (both copies share the clock: no copy is locked).
    pub(crate) fn observe_clock(&self, now_ms: u64) {
        match &self.copies {
            Copies::One(k) => k.observe_clock(now_ms),
            Copies::Two(p) => p.clock.observe(now_ms),
        }
    }

    /// Change the index (counted): `f` runs on every copy, in turn, and must do the same to
    /// each (every `KvIndex` method is deterministic); the first copy's result is returned.
    pub(crate) fn write<R>(&mut self, mut f: impl FnMut(&mut KvIndex) -> R) -> R {
        self.writes = self.writes.wrapping_add(1);
        self.write_uncounted(&mut f)
    }

    fn write_uncounted<R>(&mut self, f: &mut impl FnMut(&mut KvIndex) -> R) -> R {
        match &mut self.copies {
            Copies::One(k) => f(k),
            // Under `&mut` no lookup holds a copy: both are written at once (the published one,
            // which stays published, then the spare).
            Copies::Two(p) => {
                let mut published = p.published.swap(Arc::clone(&p.placeholder));
                let k = exclusive(&mut published);
                // Under `&mut` every writer beside lookups has finished, and took what it was
                // handed: nothing is pending (unless a writer panicked; its hand-overs are
                // applied now, in their order).
                let handoff = p.handoff.get_mut().unwrap_or_else(PoisonError::into_inner);
                handoff.writers = 0;
                let pending = std::mem::take(&mut handoff.pending);
                for w in &pending {
                    w.apply(k);
                }
                let r = f(k);
                let s = k.has_speculation();
                let spare = p.spare.get_mut().unwrap_or_else(PoisonError::into_inner);
                match spare {
                    Some(spare) => {
                        let k = exclusive(spare);
                        for w in &pending {
                            w.apply(k);
                        }
                        f(k);
                    }
                    // Only while a writer holds it, which `&mut` rules out; were it lost, a
                    // twin of the published copy takes its place.
                    None => *spare = Some(Arc::new(KvCopy(k.twin()))),
                }
                p.published.store(published);
                p.note_speculation(s);
                r
            }
        }
    }

    /// Write accesses so far (through `&mut`).
    pub(crate) fn writes(&self) -> u64 {
        self.writes
    }

    /// [`KvIndex::expire`], counted as a write only when something is due: otherwise it only
    /// moves the speculation queue's clock, which neither lookups nor the no-op checks read.
    pub(crate) fn expire(&mut self, now_ms: u64) {
        if self.read().expiry_due(now_ms) {
            self.writes = self.writes.wrapping_add(1);
            self.write_uncounted(&mut |k: &mut KvIndex| k.expire(now_ms));
        } else {
            // What else `expire` would do (moving the deadline window's low end over empty
            // buckets) changes nothing a lookup or a later call reads (`SpecQueue::observe`).
            self.observe_clock(now_ms);
        }
    }

    /// Change the index beside lookups (under the router's shared lock): `f` runs on the
    /// unpublished copy, which is then published, and then on the other copy once the lookups
    /// reading it have left. `None` with one copy (the caller takes the exclusive lock).
    ///
    /// Not counted in [`KvCell::writes`]: event application is what engines report, and a
    /// decision whose read phase found its speculation a no-op before a batch landed is
    /// treated as made just before the batch (had it been, its no-op would have changed
    /// nothing either, and the batch would then apply as it does). Counting these writes would
    /// send nearly every decision to the exclusive lock while events flow.
    pub(crate) fn write_shared<R>(&self, f: impl FnMut(&mut KvIndex) -> R) -> Option<R> {
        let Copies::Two(p) = &self.copies else { return None };
        p.enter();
        let mut turn = Turn::new(p, lock(&p.spare));
        let r = turn.write(f);
        turn.finish();
        r
    }

    /// Speculate `keys` beside lookups on every slot of `slots` (`(slot, blocks it already
    /// holds)`), as [`KvIndex::speculate_from`] does, into both copies: now, or, when another
    /// writer is at work, by that writer before it lets the copies go (the keys are copied for
    /// it, from the first block a slot does not hold). A decision does not queue behind another
    /// writer's write here. Nothing with one copy (the caller holds the exclusive lock and
    /// writes the copy itself). `slots` has at most two entries (decode, then prefill).
    pub(crate) fn speculate_shared(&self, keys: &[BlockKey], slots: &[(usize, usize)], expires_ms: u64, now_ms: u64) {
        let Copies::Two(p) = &self.copies else { return };
        debug_assert!(slots.len() <= 2, "a decision speculates on its decode and prefill endpoints");
        {
            let mut h = lock(&p.handoff);
            if h.writers > 0 {
                // Only the keys from the first one a slot does not hold travel.
                let from = slots.iter().map(|&(_, held)| held).min().unwrap_or(0).min(keys.len());
                let mut buf = h.buffers.pop().unwrap_or_default();
                buf.clear();
                buf.extend_from_slice(&keys[from..]);
                let mut w = SpecWrite { keys: buf, slots: [(0, 0); 2], len: slots.len().min(2), expires_ms, now_ms };
                for (to, &(slot, held)) in w.slots.iter_mut().zip(slots) {
                    *to = (slot, held - from);
                }
                h.pending.push(w);
                return;
            }
            h.writers += 1;
        }
        let mut turn = Turn::new(p, lock(&p.spare));
        turn.write(|kv| speculate(kv, keys, slots, expires_ms, now_ms));
        turn.finish();
    }

    /// Speculation handed over and not yet applied (tests).
    #[cfg(test)]
    pub(crate) fn pending_speculation(&self) -> usize {
        match &self.copies {
            Copies::One(_) => 0,
            Copies::Two(p) => lock(&p.handoff).pending.len(),
        }
    }

    /// [`KvCell::write_shared`] if no other writer is at it now (`None` otherwise, or with one
    /// copy).
    pub(crate) fn try_write_shared<R>(&self, f: impl FnMut(&mut KvIndex) -> R) -> Option<R> {
        let Copies::Two(p) = &self.copies else { return None };
        let spare = match p.spare.try_lock() {
            Ok(s) => s,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        p.enter();
        let mut turn = Turn::new(p, spare);
        let r = turn.write(f);
        turn.finish();
        r
    }
}

/// The writers' turn, held: counted in [`Handoff::writers`] and holding `spare`. It lets the
/// copies go only once it has applied everything handed over ([`Turn::finish`]; dropped
/// without it, in a panic, it only counts itself out).
struct Turn<'a> {
    p: &'a Pair,
    spare: std::sync::MutexGuard<'a, Option<Arc<KvCopy>>>,
    counted: bool,
}

impl<'a> Turn<'a> {
    fn new(p: &'a Pair, spare: std::sync::MutexGuard<'a, Option<Arc<KvCopy>>>) -> Self {
        Turn { p, spare, counted: true }
    }

    /// Write `f` into the spare copy, publish it, and write `f` into the other once the lookups
    /// reading it have left. `None` if the spare copy was lost (a writer panicked: the next
    /// write under `&mut` makes it again).
    fn write<R>(&mut self, mut f: impl FnMut(&mut KvIndex) -> R) -> Option<R> {
        let mut next = self.spare.take()?;
        let r = f(exclusive(&mut next));
        let mut old = self.p.published.swap(next);
        let k = exclusive(&mut old);
        f(k);
        self.p.note_speculation(k.has_speculation());
        *self.spare = Some(old);
        Some(r)
    }

    /// Apply what was handed over, until nothing is, then count this writer out and let the
    /// turn go.
    fn finish(mut self) {
        let mut done: Vec<SpecWrite> = Vec::new();
        loop {
            let mut batch = {
                let mut h = lock(&self.p.handoff);
                for w in done.drain(..) {
                    if h.buffers.len() < SPARE_BUFFERS {
                        h.buffers.push(w.keys);
                    }
                }
                if h.pending.is_empty() {
                    h.writers -= 1;
                    self.counted = false;
                    return;
                }
                std::mem::take(&mut h.pending)
            };
            self.write(|kv| {
                for w in &batch {
                    w.apply(kv);
                }
            });
            done.append(&mut batch);
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if self.counted {
            // Unwinding: count out; what was handed over stays for the next writer.
            let mut h = lock(&self.p.handoff);
            h.writers = h.writers.saturating_sub(1);
        }
    }
}

#[cfg(test)]
impl KvCell {
    /// Run `f` while a writer beside lookups holds the writers' turn, then let that writer
    /// finish as it does (applying what was handed to it). With one copy, just `f`.
    pub(crate) fn with_writer_at_work<R>(&self, f: impl FnOnce() -> R) -> R {
        let Copies::Two(p) = &self.copies else { return f() };
        p.enter();
        let turn = Turn::new(p, lock(&p.spare));
        let r = f();
        turn.finish();
        r
    }

    /// `f` of every copy (tests: the copies must agree).
    pub(crate) fn each_copy<T>(&self, mut f: impl FnMut(&KvIndex) -> T) -> Vec<T> {
        match &self.copies {
            Copies::One(k) => vec![f(k)],
            Copies::Two(p) => {
                let spare = p.spare.lock().unwrap_or_else(PoisonError::into_inner);
                let spare = spare.as_deref().map(|c| f(&c.0));
                std::iter::once(f(&p.published.load().0)).chain(spare).collect()
            }
        }
    }
}
