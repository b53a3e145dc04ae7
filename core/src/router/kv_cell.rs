//! The precise index's cell: one copy in a [`RouterCore`](super::RouterCore) on its own, two in
//! a [`Router`](crate::Router), so that event application never holds up a lookup.
//!
//! With two copies, lookups read the *published* copy; event application (under the router's
//! shared lock, beside decisions) writes the other one, publishes it, waits for the lookups
//! still reading the old one to leave, and writes the same batch into it. Every write reaches
//! both copies in the same order through a deterministic closure, so they stay equal; the
//! speculation's clock is one word both copies share (`SpecQueue::twin`). Writes under the
//! router's exclusive lock (`&mut`) reach both copies directly, with no locking. This is the
//! left-right scheme (two copies, readers never wait for a writer), hand-written rather than
//! the `left-right` crate's: that crate replays owned operations from a log and gives each
//! reader thread a handle of its own, while these writes borrow the caller's event batch and
//! come from any thread, and the readers are whichever threads route.
//!
//! Like `router/mod.rs`, this file is allowed synchronization by `scripts/check-sans-io.sh`:
//! it is the one synchronized part `RouterCore` holds, and only a `Router` turns it on.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError, RwLock, RwLockReadGuard};

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
    copies: [RwLock<KvIndex>; 2],
    /// The copy lookups read (0 or 1).
    published: AtomicUsize,
    /// Held by the writer of [`KvCell::write_shared`] (several event threads take turns).
    writer: Mutex<()>,
    /// The speculation's clock, which both copies share.
    clock: SpecClock,
    /// Whether the copies hold speculation (set after every write): a decision that does not
    /// read the index takes no guard on it unless speculation may come due.
    speculating: AtomicBool,
}

impl Pair {
    fn note_speculation(&self, s: bool) {
        if self.speculating.load(Ordering::Relaxed) != s {
            self.speculating.store(s, Ordering::Relaxed);
        }
    }
}

/// The index as read: the copy itself, or a read guard on the published copy.
pub(crate) enum KvRead<'a> {
    Plain(&'a KvIndex),
    Guard(RwLockReadGuard<'a, KvIndex>),
}

impl std::ops::Deref for KvRead<'_> {
    type Target = KvIndex;

    fn deref(&self) -> &KvIndex {
        match self {
            KvRead::Plain(k) => k,
            KvRead::Guard(g) => g,
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
        // A cheap empty index stands in while the copies move.
        let placeholder = Copies::One(KvIndex::new(&crate::config::PolicyConfig::default(), 0, 1));
        self.copies = match std::mem::replace(&mut self.copies, placeholder) {
            Copies::One(a) => {
                let b = a.twin();
                let clock = a.speculation_clock();
                let speculating = AtomicBool::new(a.has_speculation());
                Copies::Two(Box::new(Pair {
                    copies: [RwLock::new(a), RwLock::new(b)],
                    published: AtomicUsize::new(0),
                    writer: Mutex::new(()),
                    clock,
                    speculating,
                }))
            }
            Copies::Two(p) => {
                let [a, _] = p.copies;
                Copies::One(a.into_inner().unwrap_or_else(PoisonError::into_inner))
            }
        };
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
            Copies::Two(p) => {
                // The writer takes only the unpublished copy, but a reader that loaded the index
                // just before a publication may find its copy taken: it then reads the copy
                // published since, which no writer holds or waits for (`write_shared` locks the
                // copy it is about to publish, then the one it has just unpublished), so each
                // failed try means a writer moved on. It never blocks on a copy: a reader holding
                // one guard may take another (never nested in this crate, but cheap to rule
                // out), and a blocking read behind a waiting writer would then wait for itself.
                // (No `yield_now` either: the Envoy filter, built from this crate, must import
                // no WASI call it cannot handle failing.)
                loop {
                    let i = p.published.load(Ordering::Acquire);
                    match p.copies[i].try_read() {
                        Ok(g) => return KvRead::Guard(g),
                        Err(std::sync::TryLockError::Poisoned(e)) => return KvRead::Guard(e.into_inner()),
                        Err(std::sync::TryLockError::WouldBlock) => std::hint::spin_loop(),
                    }
                }
            }
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
            Copies::Two(p) => {
                let [a, b] = &mut p.copies;
                let r = f(a.get_mut().unwrap_or_else(PoisonError::into_inner));
                let b = b.get_mut().unwrap_or_else(PoisonError::into_inner);
                f(b);
                let s = b.has_speculation();
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
        }
        self.write_uncounted(&mut |k: &mut KvIndex| k.expire(now_ms));
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
    pub(crate) fn write_shared<R>(&self, mut f: impl FnMut(&mut KvIndex) -> R) -> Option<R> {
        let Copies::Two(p) = &self.copies else { return None };
        let _writer = p.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let old = p.published.load(Ordering::Relaxed);
        let new = 1 - old;
        let r = f(&mut p.copies[new].write().unwrap_or_else(PoisonError::into_inner));
        p.published.store(new, Ordering::Release);
        let mut second = p.copies[old].write().unwrap_or_else(PoisonError::into_inner);
        f(&mut second);
        p.note_speculation(second.has_speculation());
        Some(r)
    }
}

#[cfg(test)]
impl KvCell {
    /// `f` of every copy (tests: the copies must agree).
    pub(crate) fn each_copy<T>(&self, mut f: impl FnMut(&KvIndex) -> T) -> Vec<T> {
        match &self.copies {
            Copies::One(k) => vec![f(k)],
            Copies::Two(p) => p.copies.iter().map(|c| f(&c.read().unwrap_or_else(PoisonError::into_inner))).collect(),
        }
    }
}
