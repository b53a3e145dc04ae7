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
//! Like `router/mod.rs`, this file is allowed synchronization by `scripts/check-sans-io.sh`:
//! it is the one synchronized part `RouterCore` holds, and only a `Router` turns it on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;

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
    /// An empty index, published for a moment while a write under `&mut` holds the published
    /// copy (no lookup runs then), so that the write allocates nothing.
    placeholder: Arc<KvCopy>,
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
                let r = f(k);
                let s = k.has_speculation();
                let spare = p.spare.get_mut().unwrap_or_else(PoisonError::into_inner);
                match spare {
                    Some(spare) => {
                        f(exclusive(spare));
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
        let spare = p.spare.lock().unwrap_or_else(PoisonError::into_inner);
        write_both(p, spare, f)
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
        write_both(p, spare, f)
    }
}

/// The write of [`KvCell::write_shared`], the writers' turn (`spare`) taken.
fn write_both<R>(
    p: &Pair,
    mut spare: std::sync::MutexGuard<'_, Option<Arc<KvCopy>>>,
    mut f: impl FnMut(&mut KvIndex) -> R,
) -> Option<R> {
    let mut next = spare.take()?;
    let r = f(exclusive(&mut next));
    let mut old = p.published.swap(next);
    let k = exclusive(&mut old);
    f(k);
    p.note_speculation(k.has_speculation());
    *spare = Some(old);
    Some(r)
}

#[cfg(test)]
impl KvCell {
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
