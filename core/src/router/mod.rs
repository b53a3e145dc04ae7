//! The router: [`RouterCore`], the single-threaded state machine that makes every decision, and
//! [`Router`], the thread-safe wrapper the bindings share.
//!
//! - `policy.rs`: [`ActivePolicy`] (a validated policy, its version and derived parameters);
//! - `state.rs`: [`RouterCore`]'s tables and the operations on them (endpoints, metrics, events,
//!   completions, reload, stats);
//! - `route.rs`: the decision in phases (keys → features → filters → pick → admission → mode →
//!   book-keeping → decision);
//! - `inflight.rs`: requests in flight, request ids, session keys;
//! - `flow.rs`: flow control on the core (admission, releases, cancellation, shutdown);
//! - `replication.rs`: applying another instance's [`RoutingEffect`];
//! - `exposition.rs`: the Prometheus metrics page.

mod exposition;
mod flow;
mod inflight;
mod kv_cell;
mod policy;
mod replication;
mod route;
mod state;

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crossbeam_utils::sync::{ShardedLock, ShardedLockReadGuard, ShardedLockWriteGuard};
use crossbeam_utils::CachePadded;

use arc_swap::ArcSwap;

pub use policy::ActivePolicy;
pub use replication::ReplicaApplied;
use state::{ledger_of, Books, Ledger, LedgerHold, LEDGERS};
pub use state::{EndpointInfo, RouterCore, RouterCounters, RouterStats};

use crate::config::Policy;
use crate::decision::Decision;
use crate::effect::RoutingEffect;
use crate::endpoints::{EndpointSpec, MetricsSnapshot};
use crate::error::{ConfigError, EventIngestError, RequestError, RouteError, StateError};
use crate::flow::{Admission, FlowStats, Release, SaturationReport, Ticket};
use crate::precise::events::EventBatch;
use crate::precise::ApplyOutcome;
use crate::request::RouteRequest;
use inflight::session_key;
use route::{inflight_due_at, prepare_keys, BooksView, DecideScratch, KeyBufs};

/// The router. `Send + Sync`: share it behind an `Arc` and call it from any thread.
///
/// A [`RouterCore`] behind a sharded readers-writer lock (`crossbeam-utils`' `ShardedLock`: a
/// reader locks only its thread's shard, on a cache line of its own, so threads taking the
/// shared lock write no common word; the exclusive lock takes every shard), plus the policy in
/// an [`ArcSwap`] cell: every
/// decision loads the policy once, so a decision is made entirely under one policy version, and
/// [`Router::reload`] swaps it atomically. Request parsing, block hashing and tokenization happen
/// outside the lock, into per-thread buffers. The decision then runs in two phases: the read
/// phase (both index matches, every endpoint's score, the picks, the mode) under the shared
/// lock, in parallel across threads, into per-thread scratch; then the write phase (request id,
/// in-flight counters, assumed residency, speculation, session, counters). When the decision's
/// approximate-index writes are no-ops (the prompt is already held where it goes, as for a
/// conversation's or a shared system prompt's repeat, or the approximate index is not used) and
/// nothing else needs it, the write phase books under the same shared lock: the endpoints'
/// loads are atomic counters, the requests in flight, ids, draws and counters sit in eight
/// ledgers, each behind a lock of its own held for a few hundred nanoseconds (a thread books
/// the ids it generates into a ledger of its own, so threads do not share those locks or
/// lines; a completion finds its request's ledger from the id), the sessions behind another,
/// and the precise index's speculation goes into its two copies beside lookups (below).
/// Otherwise (new blocks for the approximate index, a request in flight due to expire, flow
/// control or replica publishing on) it runs under the exclusive lock. Completions likewise
/// take the shared lock unless they are published to replicas. State another thread changed in
/// between is read as it was when the read phase ran (as if that change had come a moment
/// later); a change of endpoints, health or policy in between makes the write phase decide
/// again, and an index written in between under the exclusive lock makes it write. One thread
/// alone decides exactly as [`RouterCore`] does.
///
/// The precise index is kept in two copies (`kv_cell.rs`): lookups read the published one,
/// while event application ([`Router::apply_batch`], [`Router::apply_events`]), the
/// decisions' speculation and the withdrawal of speculation come due write the other one,
/// publish it, and write the same into the first once the lookups reading it have left. So
/// events, applied under the shared lock, never hold up a lookup, and a lookup never waits for
/// a writer: a decision's speculation while another writer is at work (an event batch) is
/// handed to that writer, which writes it into both copies before it lets them go. Events are
/// decoded outside the lock.
pub struct Router {
    policy: ArcSwap<ActivePolicy>,
    core: ShardedLock<RouterCore>,
    /// The core's books (requests in flight, ids, sessions, counters, draws, time), kept here
    /// so that decisions and completions can book under the shared lock; [`Router::lock`] puts
    /// them back into the core for every call under the exclusive one (the core then holds no
    /// lock of its own). Taken after `core`, never before. What a decision's read phase reads
    /// of them is published beside them at every unlock, so a request without a session plans
    /// without taking their lock (see `BooksCell`).
    books: BooksCell,
    /// Turns text and chat prompts into the engine's token ids for the precise index.
    #[cfg(feature = "tokenizer")]
    tokenizer: arc_swap::ArcSwapOption<crate::tokenize::Tokenizer>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router").field("policy_version", &self.policy.load().version).finish_non_exhaustive()
    }
}

impl Default for Router {
    fn default() -> Self {
        Router::new(Policy::default())
    }
}

/// A thread's decision buffers.
#[derive(Default)]
struct ThreadBufs {
    /// The request's keys (computed before any lock is taken).
    keys: KeyBufs,
    /// The read phase's matches, slots and candidates.
    decide: DecideScratch,
}

std::thread_local! {
    static BUFS: std::cell::Cell<ThreadBufs> = std::cell::Cell::new(ThreadBufs::default());
}

/// The router's books: the main part (sessions, the counters of calls outside a booking, the
/// latest time) under a mutex, and each ledger (`state::Ledger`: requests in flight, ids,
/// draws, the bookings' counters) under a mutex of its own, on cache lines of its own, with what
/// a decision's read phase reads of it published at its unlocks (its draws beside it, its oldest
/// request in flight's start, as a lower bound, with the other ledgers'). A thread books the
/// decisions it generates ids for into its home ledger (one per thread, handed out in turn),
/// and a completion finds its request's ledger from the id alone, so two threads routing and
/// completing their own requests take no common lock and write no common line of the books
/// (the endpoints' load counters stay shared: they are the load). A decision on the shared
/// path reads the published values (a moment old, as the state under the shared lock may be),
/// locks its ledger for the booking and the main part only for a session.
struct BooksCell {
    /// The main part; its `ledgers` are placeholders while the ledgers are in `ledgers`.
    main: Mutex<Books>,
    ledgers: Box<[CachePadded<LedgerCell>]>,
    /// When each ledger's oldest request in flight started, at most (`u64::MAX`: none), on a
    /// line of their own that every decision reads: a lower bound, lowered when a ledger's
    /// oldest request is older than it says, and set exactly by every exclusive call. Raising
    /// it at every completion would write the line other threads read at every decision; a
    /// bound left low only sends a decision to the exclusive lock (which expires nothing, and
    /// sets it exactly) once `limits.inflight_timeout_ms` has passed since it was set.
    oldest: CachePadded<[AtomicU64; LEDGERS]>,
    /// Places for requests in flight reserved by the ledgers (`LedgerSlot::quota`), so that
    /// `limits.max_inflight_requests` holds across ledgers: a booking on the shared path takes
    /// a place its ledger reserved, reserving more here in batches of [`QUOTA_BATCH`] (one at
    /// a time near the bound), and never past the bound; completions hand unused places back
    /// a batch at a time. Every exclusive call sets each ledger's quota to the requests it
    /// holds and this to their sum. One word every thread wrote at every booking and
    /// completion would be the line 16–64 threads queue on.
    reserved: CachePadded<AtomicUsize>,
    /// The latest `now` of the events applied beside decisions (0: none), for
    /// `Books::last_now_ms`: event application does not take the books' locks, and every holder
    /// of the main part takes it into account as the events would have (`last_now_ms` only
    /// moves forward, so folding it in again changes nothing). Never reset, so an event thread
    /// writes it only when its time moves, and on a line of its own.
    events_now: CachePadded<AtomicU64>,
    /// This cell's identity: a thread remembers its home ledger for the last routers it used.
    uid: u64,
    /// Home ledgers handed out so far (the next thread gets the next one).
    homes: AtomicUsize,
}

/// One ledger and its draws at its last unlock (read by the decisions booked into it: on the
/// same line).
struct LedgerCell {
    slot: Mutex<LedgerSlot>,
    /// `Ledger::draws`.
    draws: AtomicU64,
}

/// A ledger and the places for requests in flight it has reserved (`BooksCell::reserved`):
/// at least as many as it holds.
struct LedgerSlot {
    ledger: Box<Ledger>,
    quota: usize,
}

/// Places a ledger reserves at a time (see `BooksCell::reserved`).
const QUOTA_BATCH: usize = 64;

/// Routers a thread remembers its home ledger for.
const HOMES_KEPT: usize = 4;

std::thread_local! {
    /// The routers (`BooksCell::uid`) this thread used last, the latest first, and its home
    /// ledger in each (uid 0: none).
    static HOME: std::cell::Cell<[(u64, usize); HOMES_KEPT]> = const { std::cell::Cell::new([(0, 0); HOMES_KEPT]) };
}

impl BooksCell {
    fn new(mut books: Books) -> Self {
        static UIDS: AtomicU64 = AtomicU64::new(1);
        let oldest = std::array::from_fn(|i| AtomicU64::new(oldest_of(&books.ledgers[i])));
        let ledgers = books
            .ledgers
            .iter_mut()
            .enumerate()
            .map(|(i, l)| {
                let ledger = std::mem::replace(l, Box::new(Ledger::new(i)));
                let quota = ledger.inflight.len();
                CachePadded::new(LedgerCell {
                    draws: AtomicU64::new(ledger.draws),
                    slot: Mutex::new(LedgerSlot { ledger, quota }),
                })
            })
            .collect();
        BooksCell {
            oldest: CachePadded::new(oldest),
            reserved: CachePadded::new(AtomicUsize::new(books.inflight_len())),
            main: Mutex::new(books),
            ledgers,
            events_now: CachePadded::new(AtomicU64::new(0)),
            uid: UIDS.fetch_add(1, Ordering::Relaxed),
            homes: AtomicUsize::new(0),
        }
    }

    /// The main part, locked.
    fn lock_main(&self) -> MutexGuard<'_, Books> {
        let mut books = self.main.lock().unwrap_or_else(PoisonError::into_inner);
        // Only read: the line stays shared until events at a later time come.
        books.last_now_ms = books.last_now_ms.max(self.events_now.load(Ordering::Relaxed));
        books
    }

    /// Ledger `i`, locked until the guard drops (which publishes it).
    fn lock_ledger(&self, i: usize) -> LedgerGuard<'_> {
        let cell = &self.ledgers[i];
        LedgerGuard { slot: cell.slot.lock().unwrap_or_else(PoisonError::into_inner), cell, oldest: &self.oldest[i] }
    }

    /// The calling thread's home ledger here (the first thread to ask gets ledger 0, so one
    /// thread alone books as a `RouterCore` does).
    fn home(&self) -> usize {
        HOME.try_with(|h| {
            let mut kept = h.get();
            if kept[0].0 == self.uid {
                return kept[0].1;
            }
            // Another router's first, or forgotten: moved (or added) to the front.
            let at = kept.iter().position(|&(uid, _)| uid == self.uid);
            let home = at.map_or_else(|| self.homes.fetch_add(1, Ordering::Relaxed) % LEDGERS, |k| kept[k].1);
            kept[..=at.unwrap_or(HOMES_KEPT - 1)].rotate_right(1);
            kept[0] = (self.uid, home);
            h.set(kept);
            home
        })
        .unwrap_or(0)
    }

    /// The ledger a decision for `req` books into on this thread.
    fn ledger_for(&self, req: &RouteRequest) -> usize {
        state::ledger_for(req, || self.home())
    }

    /// Whether ledger `g` has a place for one more request in flight under `max`, reserving
    /// more for it if it has none left (see `reserved`).
    fn reserve(&self, g: &mut LedgerGuard<'_>, max: usize) -> bool {
        let slot = &mut *g.slot;
        if slot.ledger.inflight.len() < slot.quota {
            return true;
        }
        // A batch, or near the bound one place.
        for n in [QUOTA_BATCH, 1] {
            if self.reserved.fetch_add(n, Ordering::Relaxed) + n <= max {
                slot.quota += n;
                return true;
            }
            self.reserved.fetch_sub(n, Ordering::Relaxed);
        }
        false
    }

    /// After a completion in ledger `g`: hand a batch of places back once two are unused.
    fn unreserve(&self, g: &mut LedgerGuard<'_>) {
        let slot = &mut *g.slot;
        if slot.quota >= slot.ledger.inflight.len() + 2 * QUOTA_BATCH {
            slot.quota -= QUOTA_BATCH;
            self.reserved.fetch_sub(QUOTA_BATCH, Ordering::Relaxed);
        }
    }

    /// Events applied at `now_ms` (see `events_now`).
    fn events_at(&self, now_ms: u64) {
        if self.events_now.load(Ordering::Relaxed) < now_ms {
            self.events_now.fetch_max(now_ms, Ordering::Relaxed);
        }
    }

    /// Ledger `at`'s published draws and the oldest request in flight's start over every ledger
    /// (at most: see `oldest`).
    fn published(&self, at: usize) -> (u64, Option<u64>) {
        (self.ledgers[at].draws.load(Ordering::Relaxed), self.oldest_except(usize::MAX))
    }

    /// The oldest published start of a request in flight in the ledgers other than `at`.
    fn oldest_except(&self, at: usize) -> Option<u64> {
        let starts = self.oldest.iter().enumerate().filter(|&(i, _)| i != at);
        let oldest = starts.map(|(_, t)| t.load(Ordering::Relaxed)).min().unwrap_or(u64::MAX);
        (oldest != u64::MAX).then_some(oldest)
    }
}

/// When `ledger`'s oldest request in flight started (`u64::MAX`: none).
fn oldest_of(ledger: &Ledger) -> u64 {
    ledger.inflight.oldest_started().unwrap_or(u64::MAX)
}

/// A ledger locked; dropping it publishes it (`BooksCell`), then unlocks.
struct LedgerGuard<'a> {
    slot: MutexGuard<'a, LedgerSlot>,
    cell: &'a LedgerCell,
    /// The ledger's slot in `BooksCell::oldest`.
    oldest: &'a AtomicU64,
}

impl LedgerGuard<'_> {
    /// Publish the ledger's oldest start exactly (under the exclusive lock).
    fn publish_exactly(&self) {
        let oldest = oldest_of(&self.slot.ledger);
        if self.oldest.load(Ordering::Relaxed) != oldest {
            self.oldest.store(oldest, Ordering::Relaxed);
        }
    }
}

impl Drop for LedgerGuard<'_> {
    fn drop(&mut self) {
        let l = &self.slot.ledger;
        // Lowered only (see `BooksCell::oldest`), and the draws written only when changed.
        let oldest = oldest_of(l);
        if oldest < self.oldest.load(Ordering::Relaxed) {
            self.oldest.fetch_min(oldest, Ordering::Relaxed);
        }
        if self.cell.draws.load(Ordering::Relaxed) != l.draws {
            self.cell.draws.store(l.draws, Ordering::Relaxed);
        }
    }
}

/// The core under the exclusive lock with its books put back, the main part and every ledger,
/// its home ledger the calling thread's (taken out again on drop).
struct CoreMut<'a> {
    /// The router's books, holding the core's placeholders while the guard lives (named apart
    /// from `RouterCore::books`, which `lock().books` must reach through `Deref`). Declared
    /// first, so dropped first: the books, back in the cell, are published and unlocked
    /// before the exclusive lock is released.
    main: MutexGuard<'a, Books>,
    ledgers: [LedgerGuard<'a>; LEDGERS],
    cell: &'a BooksCell,
    core: ShardedLockWriteGuard<'a, RouterCore>,
}

impl<'a> CoreMut<'a> {
    fn new(mut core: ShardedLockWriteGuard<'a, RouterCore>, cell: &'a BooksCell) -> Self {
        let home = cell.home();
        let mut main = cell.lock_main();
        let mut ledgers: [LedgerGuard<'a>; LEDGERS] = std::array::from_fn(|i| cell.lock_ledger(i));
        std::mem::swap(&mut core.books, &mut *main);
        for (mine, theirs) in core.books.ledgers.iter_mut().zip(&mut ledgers) {
            std::mem::swap(mine, &mut theirs.slot.ledger);
        }
        core.books.home = home;
        CoreMut { main, ledgers, cell, core }
    }
}

impl Drop for CoreMut<'_> {
    fn drop(&mut self) {
        for (mine, theirs) in self.core.books.ledgers.iter_mut().zip(&mut self.ledgers) {
            std::mem::swap(mine, &mut theirs.slot.ledger);
        }
        std::mem::swap(&mut self.core.books, &mut *self.main);
        // Nothing books on the shared path meanwhile (it holds the shared lock): each ledger's
        // quota becomes what it holds (within the bound, which the exclusive calls keep).
        let mut reserved = 0;
        for g in &mut self.ledgers {
            g.slot.quota = g.slot.ledger.inflight.len();
            reserved += g.slot.quota;
            g.publish_exactly();
        }
        self.cell.reserved.store(reserved, Ordering::Relaxed);
    }
}

impl std::ops::Deref for CoreMut<'_> {
    type Target = RouterCore;

    fn deref(&self) -> &RouterCore {
        &self.core
    }
}

impl std::ops::DerefMut for CoreMut<'_> {
    fn deref_mut(&mut self) -> &mut RouterCore {
        &mut self.core
    }
}

impl From<RouterCore> for Router {
    fn from(mut core: RouterCore) -> Router {
        let books = std::mem::replace(&mut core.books, Books::new(1));
        // Two copies of the precise index (`index.precise.two_copies`): events are written
        // beside lookups (`kv_cell.rs`).
        let two = core.policy().policy.config().index.precise.two_copies;
        core.kv = core.kv.into_shared(two);
        Router {
            policy: ArcSwap::new(core.policy().clone()),
            core: ShardedLock::new(core),
            books: BooksCell::new(books),
            #[cfg(feature = "tokenizer")]
            tokenizer: arc_swap::ArcSwapOption::empty(),
        }
    }
}

impl Router {
    /// A router running `policy` (version 1) with no endpoints.
    pub fn new(policy: Policy) -> Router {
        Router::from(RouterCore::new(policy))
    }

    /// A router from a JSON policy document.
    pub fn from_json(text: &str) -> Result<Router, ConfigError> {
        Policy::from_json(text).map(Router::new)
    }

    /// The core under the exclusive lock, with its books.
    fn lock(&self) -> CoreMut<'_> {
        // Nothing in the core panics while holding the lock; should a bug ever do so, the state
        // is still structurally valid, so keep serving rather than poison every later call.
        let core = self.core.write().unwrap_or_else(PoisonError::into_inner);
        CoreMut::new(core, &self.books)
    }

    /// The core under the shared lock, without its books (they are in `self.books`): only for
    /// calls that do not read them (the decision's and completion's shared paths take both).
    fn read(&self) -> ShardedLockReadGuard<'_, RouterCore> {
        self.core.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Run `f` on the core under the lock (for several operations that must see one state).
    pub fn with_core<T>(&self, f: impl FnOnce(&mut RouterCore) -> T) -> T {
        f(&mut self.lock())
    }

    /// Use `tokenizer` to compute precise keys for text and chat requests (native only; without
    /// one, only token-id prompts get precise keys). Tokenization happens outside the state lock;
    /// a request that fails to tokenize is routed without precise keys and counted in
    /// `RouterCounters::tokenize_errors`.
    #[cfg(feature = "tokenizer")]
    pub fn set_tokenizer(&self, tokenizer: Option<Arc<crate::tokenize::Tokenizer>>) {
        self.tokenizer.store(tokenizer);
    }

    /// The active policy.
    pub fn policy(&self) -> Arc<ActivePolicy> {
        self.policy.load_full()
    }

    /// Swap in a new (already validated) policy atomically and return its version.
    ///
    /// What happens to state:
    /// - If the hashing parameters (`index.block_tokens`, `index.bytes_per_token`,
    ///   `index.hash_seed`) change, the approximate index is cleared: keys made under the old
    ///   parameters can never match keys made under the new ones, so keeping them would only
    ///   waste memory. Routing continues immediately (cold for the index). A decision that began
    ///   under the old policy and finishes after the swap neither reads nor writes the new index.
    /// - If only `index.capacity_bytes_per_endpoint` changes, entries are kept; endpoints over the
    ///   new capacity lose their oldest generations at once.
    /// - Endpoints, metrics, in-flight counters and sessions are kept (the in-flight and session
    ///   tables are resized to the new limits, releasing the oldest entries if they shrink).
    pub fn reload(&self, policy: Policy) -> u64 {
        let mut core = self.lock();
        let version = core.reload(policy);
        self.policy.store(core.policy().clone());
        version
    }

    /// Parse (JSON if it starts with `{`, else YAML), validate and reload. On error the active
    /// policy is untouched and keeps serving.
    pub fn reload_str(&self, text: &str) -> Result<u64, ConfigError> {
        match Policy::from_str_auto(text) {
            Ok(p) => Ok(self.reload(p)),
            Err(e) => {
                self.lock().books.counters.reload_failures += 1;
                Err(e)
            }
        }
    }

    /// Register an endpoint, or change the role of a registered one (its index entries, metrics
    /// and counters are kept).
    pub fn upsert_endpoint(&self, spec: EndpointSpec) -> Result<(), StateError> {
        self.lock().upsert_endpoint(spec)
    }

    /// Remove an endpoint: its index entries are purged (at once for routing; memory is reclaimed
    /// by the sweeper) and requests still in flight there are forgotten.
    pub fn remove_endpoint(&self, id: &str) -> Result<(), StateError> {
        self.lock().remove_endpoint(id)
    }

    /// Store a metrics snapshot (its `updated_ms` is the time it was taken).
    ///
    /// Until the next snapshot, scoring corrects it with what the router itself saw since: every
    /// completion there takes one request off the reported waiting queue and one request's share
    /// off the KV usage (the snapshot's usage per running request), never below 0; every request
    /// it sent there (or applied from another instance's effect) adds one of each. Metrics lag by
    /// a scrape interval while the router's own traffic is known at once; read as they are, a
    /// stale report would send every request between two scrapes to whichever endpoint last
    /// reported least.
    pub fn update_metrics(&self, id: &str, metrics: MetricsSnapshot) -> Result<(), StateError> {
        self.lock().update_metrics(id, metrics)
    }

    /// Mark an endpoint healthy or not (unhealthy endpoints are never picked).
    pub fn set_healthy(&self, id: &str, healthy: bool) -> Result<(), StateError> {
        self.lock().set_healthy(id, healthy)
    }

    /// Every endpoint, in id order.
    pub fn endpoints(&self) -> Vec<EndpointInfo> {
        // Reads the books (the latest time seen).
        self.lock().endpoints()
    }

    /// Where to send a request the router could not route (fail-open), or `None` when no
    /// endpoint is registered.
    ///
    /// Not a routing decision: it keeps traffic flowing while something is wrong (a body the
    /// engine will reject itself, no decode-capable endpoint, a binding's internal error). It
    /// picks the endpoint with the fewest router-tracked requests in flight (then the shortest
    /// reported queue, then id order) among healthy decode-capable endpoints, else among healthy
    /// endpoints, else among all. Nothing is recorded: the request is not tracked in flight.
    pub fn fail_open_endpoint(&self) -> Option<Arc<str>> {
        self.read().fail_open_endpoint()
    }

    /// A snapshot of sizes and counters.
    pub fn stats(&self) -> RouterStats {
        // Reads the books (requests in flight, counters).
        self.lock().stats()
    }

    /// The request finished (response fully sent or failed): release its in-flight counters.
    pub fn complete(&self, request_id: &str) -> Result<(), StateError> {
        // Hashed before any lock is taken.
        let hash = inflight::id_hash(request_id);
        {
            let core = self.read();
            // The request leaves its ledger under the ledger's lock; its endpoints' loads
            // (atomic counters, changed only after the booking that added to them) after it.
            let taken = {
                let mut g = self.books.lock_ledger(ledger_of(request_id, hash));
                let taken = core.complete_shared(&mut g.slot.ledger, request_id, hash);
                if matches!(taken, Some(Ok(_))) {
                    self.books.unreserve(&mut g);
                }
                taken
            };
            if let Some(taken) = taken {
                return taken.map(|f| core.release(&f));
            }
        }
        self.lock().complete(request_id)
    }

    /// Attach a [`RoutingEffect`] to every (non-shed) decision from now on (`Decision::effect`),
    /// for replicating routing state to other router instances. Off by default: it copies the
    /// request's block keys.
    pub fn record_effects(&self, on: bool) {
        self.lock().record_effects(on);
    }

    /// Apply the state changes a decision made by another router instance (sharing this one's
    /// endpoints and policy): the assumed residency in the approximate index, the speculative
    /// entries in the precise index, the in-flight request and the session affinity. Keys made
    /// under a different index fingerprint (the instances run different policies for a moment
    /// during a reload) are skipped; an effect whose request id is already in flight here is not
    /// counted twice. Replicate completions with [`Router::complete`] on every instance.
    ///
    /// Request ids must be unique across the instances (give every request an `x-request-id`, as
    /// Envoy does): generated `kvr-N` ids are unique only within one instance (they are unique
    /// and increasing per thread, not consecutive: a thread's ids are those of its ledger, `N`
    /// with `(N - 1) mod 8` its ledger's index).
    ///
    /// Errors: `UnknownEndpoint` when the target or prefill endpoint is not registered here
    /// (nothing is applied).
    pub fn apply_effect(&self, e: &RoutingEffect) -> Result<(), StateError> {
        self.lock().apply_effect(e)
    }

    /// Take part in a fleet of router replicas (see [`RouterCore::enable_replication`]). The NATS
    /// transport (`Replicator`, feature `nats`) calls it for you.
    pub fn enable_replication(&self, cfg: crate::ReplicaConfig) -> Result<(), crate::ReplicaError> {
        self.lock().enable_replication(cfg)
    }

    /// Stop replicating (see [`RouterCore::disable_replication`]).
    pub fn disable_replication(&self) {
        self.lock().disable_replication();
    }

    /// The next batch to publish (see [`RouterCore::take_replica_batch`]).
    pub fn take_replica_batch(&self, now_ms: u64, heartbeat: bool) -> Option<Vec<u8>> {
        self.lock().take_replica_batch(now_ms, heartbeat)
    }

    /// Decode another replica's batch (outside the lock) and apply it (see
    /// [`RouterCore::apply_replica_batch`]); a malformed batch is counted and changes nothing.
    pub fn apply_replica_bytes(&self, bytes: &[u8], now_ms: u64) -> Result<ReplicaApplied, crate::ReplicaError> {
        match crate::ReplicaBatch::decode(bytes) {
            Ok(b) => self.lock().apply_replica_batch(&b, now_ms),
            Err(e) => {
                self.lock().count_malformed_replica_batch();
                Err(e)
            }
        }
    }

    /// Apply another replica's decoded batch (see [`RouterCore::apply_replica_batch`]).
    pub fn apply_replica_batch(
        &self,
        batch: &crate::ReplicaBatch,
        now_ms: u64,
    ) -> Result<ReplicaApplied, crate::ReplicaError> {
        self.lock().apply_replica_batch(batch, now_ms)
    }

    /// Drop the in-flight requests of silent replicas (see [`RouterCore::expire_silent_replicas`]).
    pub fn expire_silent_replicas(&self, now_ms: u64) -> u64 {
        self.lock().expire_silent_replicas(now_ms)
    }

    /// Replication counters, when enabled.
    pub fn replica_stats(&self) -> Option<crate::ReplicaStats> {
        self.read().replica_stats()
    }

    /// Decode one KV-event payload published by `endpoint`'s engine (msgpack, vLLM or SGLang) and
    /// apply it to the precise index. `seq` is the publisher's sequence number (ZMQ frame 2), when
    /// known. A malformed payload is rejected whole and changes nothing.
    pub fn apply_events(
        &self,
        endpoint: &str,
        payload: &[u8],
        seq: Option<u64>,
        now_ms: u64,
    ) -> Result<ApplyOutcome, EventIngestError> {
        // Decoded outside the lock.
        let batch = crate::precise::events::decode_batch(payload)?;
        Ok(self.apply_batch(endpoint, &batch, seq, now_ms)?)
    }

    /// Apply an already decoded batch from `endpoint` (see [`Router::apply_events`]).
    pub fn apply_batch(
        &self,
        endpoint: &str,
        batch: &EventBatch,
        seq: Option<u64>,
        now_ms: u64,
    ) -> Result<ApplyOutcome, StateError> {
        // Beside decisions, under the shared lock: the batch goes into the precise index's
        // unpublished copy, then into the other once the lookups reading it have left, so no
        // lookup waits for it (see `kv_cell.rs`).
        let shared = self.read().apply_batch_shared(endpoint, batch, seq, now_ms);
        match shared {
            Some(r) => {
                if r.is_ok() {
                    self.books.events_at(now_ms);
                }
                r
            }
            None => self.lock().apply_batch(endpoint, batch, seq, now_ms),
        }
    }

    /// Read `endpoint`'s `/metrics` page (vLLM or SGLang Prometheus text, taken at `now_ms`) and
    /// store the snapshot; returns it. A page that cannot be read changes nothing.
    pub fn update_metrics_from_prometheus(
        &self,
        endpoint: &str,
        text: &str,
        now_ms: u64,
    ) -> Result<MetricsSnapshot, crate::metrics::MetricsError> {
        let m = crate::metrics::parse_prometheus(text, now_ms)?;
        self.update_metrics(endpoint, m.clone())?;
        Ok(m)
    }

    /// Count a replay attempt of `endpoint`'s event subscriber (for `metrics_text`).
    pub fn record_replay(&self, endpoint: &str, ok: bool) -> Result<(), StateError> {
        self.lock().record_replay(endpoint, ok)
    }

    /// The router's metrics in Prometheus text exposition format: decisions by mode and rule,
    /// the prefix-hit histogram, index sizes, event-stream health and lag, reloads.
    /// `kvroute_event_lag_seconds` compares publisher timestamps with `now_ms`, so it is
    /// meaningful when the router's clock is UNIX time (the bindings' default).
    pub fn metrics_text(&self, now_ms: u64) -> String {
        // Reads the books (counters).
        self.lock().metrics_text(now_ms)
    }

    /// Give up on `endpoint`'s gapped event stream (replay unavailable or too old): its precise
    /// entries are cleared, its next batch is accepted as a fresh start, and it counts as stale
    /// for `index.precise.stale_recovery_ms` (hybrid mode routes it with the approximate index
    /// meanwhile).
    pub fn resync_stream(&self, endpoint: &str, now_ms: u64) -> Result<(), StateError> {
        self.lock().resync_stream(endpoint, now_ms)
    }

    /// Flow control's answer for a request about to be routed (see [`RouterCore::admit`] and the
    /// protocol on [`Admission`]).
    pub fn admit(&self, req: &RouteRequest, body_bytes: u64, now_ms: u64) -> Admission {
        self.lock().admit(req, body_bytes, now_ms)
    }

    /// Parse an HTTP request (outside the lock) and [`admit`](Router::admit) it, with the body's
    /// length as its size.
    pub fn admit_http<K, V>(
        &self,
        body: &[u8],
        headers: impl IntoIterator<Item = (K, V)>,
        now_ms: u64,
    ) -> Result<Admission, RequestError>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let active = self.policy.load_full();
        let req = RouteRequest::parse(body, headers, &active.policy.config().request)?;
        Ok(self.admit(&req, body.len() as u64, now_ms))
    }

    /// A dispatch opportunity with no other event (see [`RouterCore::tick`]).
    pub fn tick(&self, now_ms: u64) {
        self.lock().tick(now_ms);
    }

    /// A dispatch opportunity, then every release made since the last call (see
    /// [`RouterCore::take_releases`]).
    pub fn take_releases(&self, now_ms: u64) -> Vec<Release> {
        self.lock().take_releases(now_ms)
    }

    /// [`take_releases`](Router::take_releases) into a caller's buffer.
    pub fn take_releases_into(&self, now_ms: u64, out: &mut Vec<Release>) {
        self.lock().take_releases_into(now_ms, out);
    }

    /// Remove a held ticket whose client went away (see [`RouterCore::cancel`]).
    pub fn cancel(&self, ticket: Ticket) -> bool {
        self.lock().cancel(ticket)
    }

    /// Drop every queued request with 503 `rejected-shutting-down` and reject later admissions
    /// (see [`RouterCore::shutdown_queue`]).
    pub fn shutdown_queue(&self) {
        self.lock().shutdown_queue();
    }

    /// When to tick next if nothing else happens (see [`RouterCore::next_flow_deadline`]).
    pub fn next_flow_deadline(&self) -> Option<u64> {
        self.read().next_flow_deadline()
    }

    /// Flow control's queues and counters.
    pub fn flow_stats(&self) -> FlowStats {
        self.read().flow_stats()
    }

    /// The pool's saturation as flow control measures it (see [`RouterCore::flow_saturation`]).
    pub fn flow_saturation(&self, now_ms: u64) -> SaturationReport {
        self.read().flow_saturation(now_ms)
    }

    /// Parse an HTTP request (body + headers) and route it, all under one policy version.
    pub fn route_http<K, V>(
        &self,
        body: &[u8],
        headers: impl IntoIterator<Item = (K, V)>,
        now_ms: u64,
    ) -> Result<Decision, RouteError>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        // A guard, not a clone: no reference count that every decision on every thread writes.
        let active = self.policy.load();
        let req = match RouteRequest::parse(body, headers, &active.policy.config().request) {
            Ok(r) => r,
            Err(e) => {
                self.books.lock_main().counters.route_errors += 1;
                return Err(e.into());
            }
        };
        self.route_with(&active, &req, now_ms)
    }

    /// Route a parsed request at time `now_ms` (milliseconds on the caller's clock, the same clock
    /// as metric timestamps).
    pub fn route(&self, req: &RouteRequest, now_ms: u64) -> Result<Decision, RouteError> {
        let active = self.policy.load();
        self.route_with(&active, req, now_ms)
    }

    fn route_with(&self, active: &ActivePolicy, req: &RouteRequest, now_ms: u64) -> Result<Decision, RouteError> {
        // The thread's buffers; fresh ones while its thread-locals are being destroyed (a
        // decision made from another thread-local's destructor).
        let mut bufs = BUFS.try_with(std::cell::Cell::take).unwrap_or_default();
        #[cfg(feature = "tokenizer")]
        let tok = self.tokenizer.load();
        prepare_keys(
            active,
            #[cfg(feature = "tokenizer")]
            tok.as_deref(),
            req,
            &mut bufs.keys,
            now_ms,
        );
        let out = self.decide(active, req, &bufs.keys, &mut bufs.decide, now_ms);
        let _ = BUFS.try_with(|cell| cell.set(bufs));
        out
    }

    /// The decision: the read phase under the shared lock, the write phase under the exclusive
    /// one. When time has made something due (a request in flight to expire, speculation to
    /// withdraw), the whole decision runs under the exclusive lock instead, as in
    /// [`RouterCore::route`].
    fn decide(
        &self,
        active: &ActivePolicy,
        req: &RouteRequest,
        keys: &KeyBufs,
        s: &mut DecideScratch,
        now_ms: u64,
    ) -> Result<Decision, RouteError> {
        let plan = {
            let core = self.read();
            // One copy of the precise index for the whole read phase (see `kv_cell.rs`). With
            // two copies the speculation due is withdrawn here, beside lookups (or by the writer
            // at it now), and is no reason for the exclusive lock; with one it is.
            let mut kv = core.kv_to_read(keys);
            let mut kv_due = kv.as_ref().is_some_and(|kv| kv.expiry_due(now_ms));
            if kv_due {
                drop(kv);
                kv_due = !core.expire_shared(now_ms);
                kv = Some(core.kv.read());
            }
            // The read phase reads what the ledgers published at their last unlock; a request
            // with a session reads its affinity from the books' main part, under its lock.
            let at = self.books.ledger_for(req);
            let (draws, oldest_started) = self.books.published(at);
            let view = (!kv_due && !inflight_due_at(oldest_started, active, now_ms)).then(|| match session_key(req) {
                None => BooksView::sessionless(draws),
                Some(key) => BooksView::new(draws, self.books.lock_main().session(key)),
            });
            match view {
                None => None,
                Some(view) => {
                    let plan = core.plan(kv.as_deref(), view, active, req, keys, now_ms, s);
                    drop(kv);
                    // The ledger's lock is held for the booking only; the session, the
                    // speculation and the decision come after it.
                    let booking = {
                        let mut g = self.books.lock_ledger(at);
                        let fits = self.books.reserve(&mut g, active.policy.config().limits.max_inflight_requests);
                        let oldest_elsewhere = self.books.oldest_except(at);
                        let mut hold = LedgerHold { ledger: &mut g.slot.ledger, index: at, oldest_elsewhere, fits };
                        core.commit_shared(&mut hold, active, req, keys, plan, now_ms, s)
                    };
                    match booking {
                        Ok(b) => {
                            if b.has_session() {
                                self.books.lock_main().keep_session(&b);
                            }
                            if b.speculate {
                                core.speculate_shared(active, keys, &b, s, now_ms);
                            }
                            return Ok(core.finish_shared(active, keys, b, now_ms));
                        }
                        Err(plan) => Some(plan),
                    }
                }
            }
        };
        let mut core = self.lock();
        match plan {
            Some(plan) => core.commit(active, req, keys, plan, now_ms, s),
            None => core.decide_with(active, req, keys, now_ms, s),
        }
    }
}
