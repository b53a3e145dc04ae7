//! The decision, in phases:
//!
//! 1. **keys** ([`prepare_keys`]): block keys for the approximate index, precise keys (token ids,
//!    or the tokenizer's) — pure, outside any lock in [`Router`](crate::Router);
//! 2. **features** ([`RouterCore::features`]): expiry, both index matches, the session, and per
//!    endpoint the score inputs and breakdown (with the filters' verdicts);
//! 3. **filters** and **pick** ([`RouterCore::pick`]): the candidates (a filter that would leave
//!    none is relaxed) and the picker's choice of decode endpoint;
//! 4. **admission** ([`crate::admission`]): shed a sheddable request when the pool is saturated
//!    (flow control off; with it on, `admit` did that before the request was routed);
//! 5. **mode** ([`RouterCore::mode`]): the prefill pick and the mode rules with the transfer-tax
//!    model;
//! 6. **book-keeping** ([`RouterCore::book`]): assumed residency, speculation, in-flight
//!    counters, session affinity, counters;
//! 7. **decision** ([`RouterCore::routed`], [`RouterCore::shed`]): the outcome, headers and
//!    the replication effect.

use std::sync::Arc;

use super::inflight::{session_key, SlotRef};
use super::policy::ActivePolicy;
use super::state::{bound_inflight, track, Books, Ledger, LedgerHold, RouterCore};
use crate::admission;
use crate::approx::RequestKeys;
use crate::config::{IndexMode, PickerConfig};
use crate::decision::{self, Decision, Judgment, Mode, ModeInputs, Outcome, Rule, Shed, TransferEstimate};
use crate::effect::RoutingEffect;
use crate::endpoints::{EndpointTable, Role};
use crate::error::RouteError;
use crate::index::{MatchScratch, MatchWeights, PrefixMatch};
use crate::precise::KvIndex;
use crate::request::RouteRequest;
use crate::score::{self, EndpointScore, MaxScoreWalk, Tiebreak};

/// A request's keys, computed before the state is touched.
#[derive(Debug, Default)]
pub(crate) struct KeyBufs {
    approx: RequestKeys,
    precise: RequestKeys,
    has_precise: bool,
    /// Input tokens when the tokenizer counted them.
    exact_input_tokens: Option<u64>,
    /// The tokenizer failed on the request (it is routed without precise keys).
    tokenize_failed: bool,
    scratch: Vec<u8>,
}

/// Phase 1: the request's keys under `active`, into `bufs`. `now_ms` is the chat templates'
/// clock (`strftime_now`).
pub(crate) fn prepare_keys(
    active: &ActivePolicy,
    #[cfg(feature = "tokenizer")] tokenizer: Option<&crate::tokenize::Tokenizer>,
    req: &RouteRequest,
    bufs: &mut KeyBufs,
    now_ms: u64,
) {
    bufs.has_precise =
        active.reads_precise() && active.precise_keys.request_keys(req, &mut bufs.precise, &mut bufs.scratch);
    if active.reads_approx() || !bufs.has_precise {
        active.hashing.request_keys(req, &mut bufs.approx);
    } else {
        // Precise mode with precise keys: the approximate keys would be unused; only the
        // tie-break anchor is needed.
        bufs.approx.keys.clear();
        bufs.approx.seq_starts.clear();
        bufs.approx.anchor = bufs.precise.anchor;
    }
    bufs.exact_input_tokens = None;
    bufs.tokenize_failed = false;
    #[cfg(not(feature = "tokenizer"))]
    let _ = now_ms; // only the chat templates read the clock
    #[cfg(feature = "tokenizer")]
    if let Some(tok) = tokenizer.filter(|_| active.reads_precise() && !bufs.has_precise) {
        tokenize_into(active, tok, req, bufs, now_ms);
    }
}

#[cfg(feature = "tokenizer")]
fn tokenize_into(
    active: &ActivePolicy,
    tok: &crate::tokenize::Tokenizer,
    req: &RouteRequest,
    bufs: &mut KeyBufs,
    now_ms: u64,
) {
    // Only the ids before the request's key limit (a part the router cannot key) are keyed.
    match tok.keyable_token_ids(req, now_ms) {
        Ok(seqs) => {
            let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
            bufs.has_precise = active.precise_keys.keys_for_tokens(
                req.lora_adapter.as_deref(),
                req.cache_salt.as_deref(),
                &refs,
                &mut bufs.precise,
                &mut bufs.scratch,
            );
            let keyed: u64 = seqs.iter().map(|s| s.len() as u64).sum();
            let bpt = active.policy.config().index.bytes_per_token;
            let bt = u64::from(active.precise_keys.block_tokens().max(1));
            // Past the media (or key limit): the estimate, the ids after the last full block
            // of the cut sequence and the boundary token dropped there.
            let cut = match (req.chat.as_ref().and_then(|c| c.media), req.key_limit) {
                (Some(_), _) => Some(0),
                (None, Some(l)) => Some(l.prompt),
                (None, None) => None,
            };
            let unkeyed = cut.map_or(0, |c| {
                let extra = seqs.get(c).map_or(0, |s| s.len() as u64 % bt + 1);
                req.unkeyed_tokens_past_media(bpt) + extra
            });
            bufs.precise.unkeyed_blocks = RequestKeys::blocks_for(unkeyed, active.precise_keys.block_tokens());
            bufs.exact_input_tokens = Some(keyed + unkeyed);
        }
        Err(_) => bufs.tokenize_failed = true,
    }
}

/// A decision's scratch buffers (index matches, slots, candidates). [`RouterCore`] keeps one for
/// its own decisions; [`Router`](crate::Router) keeps one per thread, so the read phase
/// ([`RouterCore::plan`]) needs only shared access to the core.
#[derive(Debug, Default)]
pub(crate) struct DecideScratch {
    matched: PrefixMatch,
    pmatched: PrefixMatch,
    scratch: MatchScratch,
    /// `slots[i]` is the slot of the roster's `i`-th endpoint.
    slots: Vec<u16>,
    /// Decode candidates (roster indexes): the unfiltered ones, or the pick's relaxation.
    cands: Vec<usize>,
    /// Prefill candidates, likewise.
    pcands: Vec<usize>,
    /// The roster has an endpoint with role prefill.
    prefill_pool: bool,
    /// The roster (the endpoint table's ids, reallocated) and the ids' version, for the
    /// decisions made with this scratch: a decision holds the roster and its target's id, so with
    /// one roster for all, every decision on every thread would write the same reference counts
    /// (twice: a clone, then the caller's drop). Threads have a scratch each.
    roster: Option<(u64, Arc<[Arc<str>]>)>,
}

impl DecideScratch {
    /// `table`'s roster, as this scratch's copy (made again when the roster changes).
    fn roster_of(&mut self, table: &EndpointTable) -> Arc<[Arc<str>]> {
        let version = table.roster_version();
        match &self.roster {
            Some((v, r)) if *v == version => Arc::clone(r),
            _ => {
                let r: Arc<[Arc<str>]> = table.ids().map(|id| Arc::from(&**id)).collect();
                self.roster = Some((version, Arc::clone(&r)));
                r
            }
        }
    }
}

/// The read phase's result: everything the decision reads from the state, for the write phase
/// ([`RouterCore::commit`]) to apply. Made under [`RouterCore::epoch`]; a plan from another epoch
/// (endpoints added, removed or re-roled, health, policy, replication or effects changed in
/// between) is made again by the write phase.
///
/// A routed plan also says whether the decision's index writes (the approximate index's assumed
/// residency, the precise index's speculation) would change nothing, with the indexes' write
/// counts it was judged at: the write phase skips them when neither index was written since (a
/// prompt routed again to the endpoint that holds it), so that the exclusive phase is
/// book-keeping only.
pub(crate) struct Plan {
    epoch: u64,
    f: Features,
    outcome: Planned,
    /// The indexes' write counts when the plan was made.
    writes: (u64, u64),
    /// Whether the index writes of a routed plan are no-ops (at `writes`): the approximate
    /// index's, the precise index's.
    quiet: (bool, bool),
}

impl Plan {
    /// The roster index of the decode endpoint planned for, if the request is routed (tests).
    #[cfg(test)]
    pub(super) fn target(&self) -> Option<usize> {
        match &self.outcome {
            Planned::Route(p, _) => Some(p.d),
            _ => None,
        }
    }
}

enum Planned {
    /// No decode-capable candidate.
    NoEndpoint,
    /// Admission refuses the request (flow control off).
    Shed(Pick, Shed),
    Route(Pick, ModeChoice),
}

/// What the features phase found.
struct Features {
    input_tokens: u64,
    /// Input tokens + output budget (the endpoints' in-flight token counts).
    tokens: u64,
    session_key: Option<u64>,
    /// The decision reads and writes the approximate / precise index (its keys were made under
    /// the index's current parameters).
    approx_valid: bool,
    precise_valid: bool,
    roster: Arc<[Arc<str>]>,
    /// The roster's version ([`EndpointTable::roster_version`]): the plan is stale when it moved.
    roster_version: u64,
    /// `scores[i]` belongs to `roster[i]`; `DecideScratch::slots[i]` is its slot.
    scores: Vec<EndpointScore>,
    /// Mean saturation of the healthy decode-capable endpoints.
    saturation: f64,
    /// The picker's draws so far (the tie-break's randomness; the write phase counts this one).
    draws: u64,
    /// The max-score picker's decode pick among the unfiltered candidates, made while scoring
    /// (`None`: another picker, or no unfiltered decode candidate).
    decode_pick: Option<usize>,
}

/// A request [`RouterCore::commit_shared`] booked: what [`RouterCore::finish_shared`] makes its
/// decision of.
pub(crate) struct SharedBooking {
    request_id: String,
    f: Features,
    pick: Pick,
    m: ModeChoice,
    booked: Booked,
    /// The decision's speculation is still to be written ([`RouterCore::speculate_shared`]).
    pub(crate) speculate: bool,
    /// The session key and the target, for the sessions ([`Books::keep_session`], after the
    /// ledger's lock).
    session: Option<(u64, SlotRef)>,
}

/// The decode endpoint picked.
struct Pick {
    /// Index into the roster.
    d: usize,
    relaxed: bool,
    judgment: Judgment,
}

/// The mode phase's result.
struct ModeChoice {
    mode: Mode,
    rule: Rule,
    transfer: Option<TransferEstimate>,
    /// Roster index of the prefill endpoint (disaggregated only).
    prefill: Option<usize>,
    relaxed: bool,
}

/// What book-keeping recorded (for the replication effect).
struct Booked {
    precise_skip: [u32; 2],
    expires_ms: u64,
}

/// What the read phase reads of the books: the picker's draws and the request's session
/// affinity (taken from them before the read phase runs).
#[derive(Clone, Copy)]
pub(crate) struct BooksView {
    draws: u64,
    session: Option<SlotRef>,
}

impl Books {
    /// What [`RouterCore::plan`] reads of them for `req`.
    pub(crate) fn view(&self, req: &RouteRequest) -> BooksView {
        self.view_of(self.ledger_for(req), session_key(req))
    }

    /// [`Books::view`] for a request booked into ledger `ledger` whose session key
    /// (`session_key`) is `session`.
    pub(crate) fn view_of(&self, ledger: usize, session: Option<u64>) -> BooksView {
        BooksView { draws: self.ledgers[ledger].draws, session: session.and_then(|k| self.sessions.peek(&k).copied()) }
    }

    /// The picker's draws so far in ledger `ledger`.
    #[cfg(test)]
    pub(crate) fn draws(&self, ledger: usize) -> u64 {
        self.ledgers[ledger].draws
    }
}

impl Books {
    /// Session `key`'s affinity.
    pub(super) fn session(&self, key: u64) -> Option<SlotRef> {
        self.sessions.peek(&key).copied()
    }

    /// The session affinity of a decision booked on the shared path (the sessions are not in
    /// the ledger it held).
    pub(crate) fn keep_session(&mut self, b: &SharedBooking) {
        if let Some((k, target)) = b.session {
            self.sessions.push(k, target);
        }
    }
}

impl SharedBooking {
    /// Whether the decision has a session to keep ([`Books::keep_session`]).
    pub(crate) fn has_session(&self) -> bool {
        self.session.is_some()
    }
}

impl BooksView {
    /// The view of books with `draws` draws for a request whose session's affinity is
    /// `session`.
    pub(super) fn new(draws: u64, session: Option<SlotRef>) -> Self {
        BooksView { draws, session }
    }

    /// The view of books with `draws` draws for a request without a session: what
    /// [`Books::view`] gives for it.
    pub(crate) fn sessionless(draws: u64) -> Self {
        BooksView { draws, session: None }
    }
}

/// The index writes of routing a request to roster entries `d` and `prefill` (phase 6): the
/// slots written, and the expiry and time of the speculation.
struct IndexWrites {
    d_slot: u16,
    p_slot: Option<u16>,
    expires_ms: u64,
    now_ms: u64,
}

impl IndexWrites {
    fn new(active: &ActivePolicy, d: usize, prefill: Option<usize>, s: &DecideScratch, now_ms: u64) -> Self {
        IndexWrites {
            d_slot: s.slots[d],
            p_slot: prefill.map(|p| s.slots[p]),
            expires_ms: now_ms.saturating_add(active.policy.config().index.speculative_ttl_ms),
            now_ms,
        }
    }

    /// The decode slot, then the prefill slot if any.
    fn slots(&self) -> impl Iterator<Item = u16> {
        std::iter::once(self.d_slot).chain(self.p_slot)
    }
}

/// Whether a request in flight is due to expire at `now_ms`, the oldest having started at
/// `oldest_started` (`None`: nothing in flight): then [`RouterCore::maintain`] would change what
/// a decision reads, and the decision runs under the exclusive lock.
pub(crate) fn inflight_due_at(oldest_started: Option<u64>, active: &ActivePolicy, now_ms: u64) -> bool {
    let timeout = active.policy.config().limits.inflight_timeout_ms;
    oldest_started.is_some_and(|t| now_ms.saturating_sub(t) > timeout)
}

/// Blocks of a precise prompt that `slot` already holds in a tier: they need no speculation, so
/// only the rest of a single-sequence prompt is speculated.
fn precise_held(keys: &KeyBufs, s: &DecideScratch, slot: u16) -> u32 {
    if keys.precise.seq_starts.len() == 1 {
        s.pmatched.get(slot as usize).confirmed()
    } else {
        0
    }
}

/// Phase 6, the books: what routing the request there changes besides the indexes (the
/// endpoints' loads, the request in flight and the counters, in `ledger`: the request id's), and
/// the target, for the session (the caller's, with the bound on requests in flight).
#[allow(clippy::too_many_arguments)]
fn book(
    active: &ActivePolicy,
    endpoints: &EndpointTable,
    ledger: &mut Ledger,
    keys: &KeyBufs,
    f: &Features,
    d: usize,
    m: &ModeChoice,
    request_id: &str,
    now_ms: u64,
    s: &DecideScratch,
) -> (Booked, SlotRef) {
    let cfg = active.policy.config();
    let d_slot = s.slots[d];
    let p_slot = m.prefill.map(|p| s.slots[p]);
    let target = track(endpoints, d_slot, now_ms, f.tokens);
    let prefill_ref: Option<SlotRef> = p_slot.map(|p| track(endpoints, p, now_ms, f.tokens));
    let expires_ms = now_ms.saturating_add(cfg.index.speculative_ttl_ms);
    let mut precise_skip = [0u32; 2];
    if f.precise_valid {
        for (i, slot) in std::iter::once(d_slot).chain(p_slot).enumerate() {
            precise_skip[i] = precise_held(keys, s, slot);
        }
    }
    ledger.inflight.insert(request_id, target, prefill_ref, now_ms, f.tokens);
    let c = &mut ledger.counters;
    c.decisions_by_rule[rule_index(m.rule)] += 1;
    let hit = f.scores[d].prefix_hit;
    c.routed += 1;
    c.prefix_hit_sum += hit;
    for (i, b) in c.prefix_hit_buckets.iter_mut().enumerate() {
        if hit <= (i + 1) as f64 / 10.0 + 1e-12 {
            *b += 1;
        }
    }
    (Booked { precise_skip, expires_ms }, target)
}

fn rule_index(rule: Rule) -> usize {
    Rule::ALL.iter().position(|&r| r == rule).unwrap_or(0)
}

impl RouterCore {
    /// Route a parsed request at time `now_ms` (milliseconds on the caller's clock, the same clock
    /// as metric timestamps).
    pub fn route(&mut self, req: &RouteRequest, now_ms: u64) -> Result<Decision, RouteError> {
        let active = self.active.clone();
        let mut bufs = std::mem::take(&mut self.keys_buf);
        #[cfg(feature = "tokenizer")]
        let tok = self.tokenizer.clone();
        prepare_keys(
            &active,
            #[cfg(feature = "tokenizer")]
            tok.as_deref(),
            req,
            &mut bufs,
            now_ms,
        );
        let out = self.decide(&active, req, &bufs, now_ms);
        self.keys_buf = bufs;
        out
    }

    /// Parse an HTTP request (body + headers) and route it.
    pub fn route_http<K, V>(
        &mut self,
        body: &[u8],
        headers: impl IntoIterator<Item = (K, V)>,
        now_ms: u64,
    ) -> Result<Decision, RouteError>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        match RouteRequest::parse(body, headers, &self.active.policy.config().request) {
            Ok(req) => self.route(&req, now_ms),
            Err(e) => {
                self.books.counters.route_errors += 1;
                Err(e.into())
            }
        }
    }

    /// Phases 2–7 for keys made under `active` (which may be older than the core's policy when a
    /// reload happened meanwhile: the indexes whose parameters changed are then neither read nor
    /// written).
    pub(crate) fn decide(
        &mut self,
        active: &ActivePolicy,
        req: &RouteRequest,
        keys: &KeyBufs,
        now_ms: u64,
    ) -> Result<Decision, RouteError> {
        let mut s = std::mem::take(&mut self.decide_buf);
        let out = self.decide_with(active, req, keys, now_ms, &mut s);
        self.decide_buf = s;
        out
    }

    /// [`RouterCore::decide`] with the caller's scratch: expiry, then the read phase and the
    /// write phase back to back.
    pub(crate) fn decide_with(
        &mut self,
        active: &ActivePolicy,
        req: &RouteRequest,
        keys: &KeyBufs,
        now_ms: u64,
        s: &mut DecideScratch,
    ) -> Result<Decision, RouteError> {
        self.maintain(active, now_ms);
        let plan = self.plan(Some(&*self.kv.read()), self.books.view(req), active, req, keys, now_ms, s);
        self.commit(active, req, keys, plan, now_ms, s)
    }

    /// The state changes that come due with time before a decision at `now_ms` reads the state:
    /// requests in flight past the timeout are dropped, speculation past its deadline withdrawn.
    pub(crate) fn maintain(&mut self, active: &ActivePolicy, now_ms: u64) {
        self.books.last_now_ms = self.books.last_now_ms.max(now_ms);
        self.expire_inflight(now_ms, active.policy.config().limits.inflight_timeout_ms);
        self.kv.expire(now_ms);
    }

    /// For the read phase: whether the index writes `w` would all change nothing, in the
    /// approximate index and in the precise one.
    fn writes_are_noops(
        &self,
        kv: Option<&KvIndex>,
        keys: &KeyBufs,
        f: &Features,
        w: &IndexWrites,
        s: &DecideScratch,
    ) -> (bool, bool) {
        let approx = !f.approx_valid
            || w.slots().all(|slot| keys.approx.sequences().all(|seq| self.index.observe_is_noop(seq, slot as usize)));
        let precise = !f.precise_valid
            || kv.is_some_and(|kv| {
                w.slots().all(|slot| {
                    let held = precise_held(keys, s, slot) as usize;
                    kv.speculation_is_noop(&keys.precise.keys, held, slot as usize, w.expires_ms, w.now_ms)
                })
            });
        (approx, precise)
    }

    /// The precise index for a decision's read phase under a shared lock, or `None` when the
    /// decision does not read it (no precise keys) and no speculation can come due: with two
    /// copies, reading one takes a guard (arc-swap's slot of this thread, and a fence), which a
    /// decision in approximate mode need not pay.
    pub(crate) fn kv_to_read(&self, keys: &KeyBufs) -> Option<super::kv_cell::KvRead<'_>> {
        (keys.has_precise || self.kv.may_speculate()).then(|| self.kv.read())
    }

    /// Withdraw the speculation due at `now_ms` beside lookups (the precise index's two copies,
    /// under a [`Router`](crate::Router)'s shared lock), unless another thread is writing the
    /// index at this moment: then the speculation due is left to that writer or the next
    /// decision, and this decision reads it a moment past its deadline (which the deadlines'
    /// 16 ms resolution allows anyway) instead of queueing behind an event batch. `false` when
    /// the index has one copy (then it needs the exclusive lock).
    pub(crate) fn expire_shared(&self, now_ms: u64) -> bool {
        self.kv.shared() && {
            self.kv.try_write_shared(|kv| kv.expire(now_ms));
            true
        }
    }

    /// Write the speculation of a decision [`RouterCore::commit_shared`] booked beside lookups
    /// (see [`SharedBooking::speculate`]), as [`RouterCore::commit`] would have written it: now,
    /// or by the writer at work on the index at this moment, before it lets the copies go
    /// ([`KvCell::speculate_shared`](super::kv_cell::KvCell::speculate_shared)); the decision
    /// does not wait for it.
    pub(crate) fn speculate_shared(
        &self,
        active: &ActivePolicy,
        keys: &KeyBufs,
        b: &SharedBooking,
        s: &DecideScratch,
        now_ms: u64,
    ) {
        let w = IndexWrites::new(active, b.pick.d, b.m.prefill, s, now_ms);
        // (slot, blocks it holds) of the decode slot, then the prefill one if any.
        let (mut slots, mut n) = ([(0, 0); 2], 0);
        for (to, slot) in slots.iter_mut().zip(w.slots()) {
            *to = (slot as usize, precise_held(keys, s, slot) as usize);
            n += 1;
        }
        self.kv.speculate_shared(&keys.precise.keys, &slots[..n], w.expires_ms, w.now_ms);
    }

    /// The state's epoch: bumped by every change after which a [`Plan`] made before cannot be
    /// applied as it is (see [`Plan`]).
    pub(crate) fn bump_epoch(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
    }

    /// The read phase (phases 2, 3 and 5, and the admission verdict): reads the state, changes
    /// nothing but `s`. Expects [`RouterCore::maintain`] at `now_ms` done (or not due). `books`
    /// is what it reads of the books, taken beforehand (`Books::view`: the core's, or a
    /// [`Router`](crate::Router)'s, which are not locked while it plans).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn plan(
        &self,
        kv: Option<&KvIndex>,
        books: BooksView,
        active: &ActivePolicy,
        req: &RouteRequest,
        keys: &KeyBufs,
        now_ms: u64,
        s: &mut DecideScratch,
    ) -> Plan {
        let f = self.features(kv, books, active, req, keys, now_ms, s);
        let outcome = match self.pick(active, req, keys, &f, s) {
            None => Planned::NoEndpoint,
            Some(pick) => {
                let cfg = active.policy.config();
                let shed =
                    if cfg.flow_control.enabled { None } else { admission::admit(cfg, f.saturation, req.priority) };
                match shed {
                    Some(shed) => Planned::Shed(pick, shed),
                    None => {
                        let m = self.mode(active, keys, &f, &pick, s);
                        Planned::Route(pick, m)
                    }
                }
            }
        };
        let quiet = match &outcome {
            Planned::Route(pick, m) => {
                self.writes_are_noops(kv, keys, &f, &IndexWrites::new(active, pick.d, m.prefill, s, now_ms), s)
            }
            _ => (false, false),
        };
        Plan { epoch: self.epoch, f, outcome, writes: (self.index.writes(), self.kv.writes()), quiet }
    }

    /// The write phase (phases 6 and 7 and the counters): applies `plan` (made again first if
    /// the state's epoch moved since). `s` is the scratch the plan was made with.
    pub(crate) fn commit(
        &mut self,
        active: &ActivePolicy,
        req: &RouteRequest,
        keys: &KeyBufs,
        plan: Plan,
        now_ms: u64,
        s: &mut DecideScratch,
    ) -> Result<Decision, RouteError> {
        self.maintain(active, now_ms);
        let plan = if plan.epoch == self.epoch && plan.f.roster_version == self.endpoints.roster_version() {
            plan
        } else {
            self.plan(Some(&*self.kv.read()), self.books.view(req), active, req, keys, now_ms, s)
        };
        if keys.tokenize_failed {
            self.books.counters.tokenize_errors += 1;
        }
        // The request's ledger: its draw, its id and its booking.
        let at = self.books.ledger_for(req);
        let ledger = &mut self.books.ledgers[at];
        ledger.draws = ledger.draws.wrapping_add(1);
        // Skip the index writes the read phase found to be no-ops, unless an index was written
        // since (by another thread's decision, events, or `maintain` above).
        let quiet = plan.quiet == (true, true) && plan.writes == (self.index.writes(), self.kv.writes());
        let Plan { f, outcome, .. } = plan;
        let (pick, m) = match outcome {
            Planned::NoEndpoint => {
                self.books.counters.route_errors += 1;
                return Err(RouteError::NoEndpoints { detail: "no healthy endpoint with role decode or both" });
            }
            Planned::Shed(pick, shed) => {
                let request_id = self.books.ledgers[at].assign(req, at);
                return Ok(self.shed(active, request_id, f, pick, shed));
            }
            Planned::Route(pick, m) => (pick, m),
        };
        let request_id = self.books.ledgers[at].assign(req, at);
        if active.policy.config().flow_control.enabled {
            // Flow control owns shedding (the request went through `admit`); one request it
            // released is now routed.
            self.flow.routed();
        }
        if !quiet {
            self.write_indexes(keys, &f, &IndexWrites::new(active, pick.d, m.prefill, s, now_ms), s);
        }
        let booked = {
            let (b, endpoints) = (&mut self.books, &self.endpoints);
            let ledger = &mut b.ledgers[at];
            let (booked, target) = book(active, endpoints, ledger, keys, &f, pick.d, &m, &request_id, now_ms, s);
            bound_inflight(endpoints, b, active.policy.config().limits.max_inflight_requests);
            if let Some(k) = f.session_key {
                b.sessions.push(k, target);
            }
            booked
        };
        let mut d = self.routed(active, keys, request_id, f, pick, m, booked, now_ms);
        if let Some(r) = self.replica.as_mut().filter(|r| r.cfg.publish) {
            if let Some(e) = &d.effect {
                r.outbox.push_effect(&r.cfg, e);
            }
        }
        if !self.record_effects {
            d.effect = None;
        }
        Ok(d)
    }

    /// Phase 2: expiry, index matches, session, and every endpoint's score breakdown.
    #[allow(clippy::too_many_arguments)]
    fn features(
        &self,
        kv: Option<&KvIndex>,
        books: BooksView,
        active: &ActivePolicy,
        req: &RouteRequest,
        bufs: &KeyBufs,
        now_ms: u64,
        s: &mut DecideScratch,
    ) -> Features {
        let cfg = active.policy.config();
        let keys = &bufs.approx;
        let input_tokens = bufs.exact_input_tokens.unwrap_or_else(|| req.input_tokens(cfg.index.bytes_per_token));
        // A decision that began under a policy whose hashing differs from an index's neither
        // reads nor writes that index (see `reload`).
        let approx_valid = active.reads_approx() && self.index.fingerprint() == active.fingerprint;
        // The precise index as this decision reads it (its keys made under its parameters).
        let pkv = kv.filter(|kv| bufs.has_precise && kv.fingerprint() == active.precise_fingerprint);
        let precise_valid = pkv.is_some();
        let weights = MatchWeights::new(&cfg.index.tier_weights);
        if approx_valid {
            self.index.match_blocks(keys, &weights, &mut s.matched, &mut s.scratch);
        } else {
            s.matched.clear();
        }
        if let Some(kv) = pkv {
            kv.match_blocks(&bufs.precise, &weights, &mut s.pmatched, &mut s.scratch);
        } else {
            s.pmatched.clear();
        }
        let session_key = session_key(req);
        let session_ref = books.session.filter(|r| self.live_ref(*r));

        let per_block = |n: usize| if n == 0 { 0.0 } else { 1.0 / n as f64 };
        let (approx_per_block, precise_per_block) =
            (per_block(keys.hit_blocks()), per_block(bufs.precise.hit_blocks()));
        let roster = s.roster_of(&self.endpoints);
        let roster_version = self.endpoints.roster_version();
        let mut scores: Vec<EndpointScore> = Vec::with_capacity(roster.len());
        let order = self.endpoints.order();
        s.slots.clear();
        s.slots.extend_from_slice(order);
        // The pools' candidates that no filter removed, gathered here for the picks (which
        // relax the filters only when this leaves a pool empty).
        s.cands.clear();
        s.pcands.clear();
        s.prefill_pool = false;
        let scorer = score::Scorer::new(cfg, req.lora_adapter.as_deref(), now_ms);
        let session_slot = session_ref.map(|r| r.slot);
        let approx_block_tokens = u64::from(cfg.index.block_tokens);
        let precise_block_tokens = u64::from(active.precise_keys.block_tokens());
        let (mut saturation_sum, mut pool_size) = (0.0, 0u32);
        // With the max-score picker the decode pick is made during the pass, among the
        // unfiltered decode candidates in roster order (exactly as the picker walks them
        // afterwards); the weighted-random picker needs them all first.
        let walk_decode = matches!(cfg.scoring.picker, PickerConfig::MaxScore);
        let mut decode_walk = MaxScoreWalk::default();
        let endpoints = &self.endpoints;
        let tiebreak = Tiebreak {
            ids: &roster,
            anchor: keys.anchor,
            last_assigned: |k: usize| {
                order.get(k).and_then(|&s| endpoints.get(s)).and_then(|e| e.load.last_assigned_ms())
            },
        };
        let DecideScratch { matched, pmatched, cands, pcands, prefill_pool, .. } = s;
        // One pass, written straight into `scores` (an exact-size iterator: no capacity check
        // per endpoint).
        scores.extend(order.iter().enumerate().map(|(k, &slot)| {
            let Some(ep) = self.endpoints.get(slot) else {
                // Unreachable (order only lists occupied slots); keep scores aligned with the
                // roster and never pick it.
                return EndpointScore::unavailable();
            };
            let i = slot as usize;
            // Precise mode always reads the precise index; hybrid reads it for endpoints whose
            // event stream is healthy when the request has token ids; otherwise approximate.
            let precise = match cfg.index.mode {
                IndexMode::Approx => false,
                IndexMode::Precise => true,
                IndexMode::Hybrid => pkv.is_some_and(|kv| kv.healthy(i, now_ms)),
            };
            let (m, hit_per_block, block_tokens) = if precise {
                (&*pmatched, precise_per_block, precise_block_tokens)
            } else {
                (&*matched, approx_per_block, approx_block_tokens)
            };
            let slot_match = m.get(i);
            let matched_blocks = slot_match.blocks();
            let inputs = score::FeatureInputs {
                matched_blocks,
                weighted_blocks: slot_match.weighted(),
                hit_per_block,
                cached_tokens: (u64::from(matched_blocks) * block_tokens).min(input_tokens),
                precise,
                session_here: session_slot == Some(slot),
            };
            let (score, fresh) = scorer.score(ep, &inputs);
            let role = score.role;
            if score.filtered.is_none() {
                if role.decodes() {
                    if walk_decode {
                        decode_walk.offer(k, score.total, &tiebreak);
                    } else {
                        cands.push(k);
                    }
                } else if role == Role::Prefill {
                    pcands.push(k);
                }
            }
            *prefill_pool |= role == Role::Prefill;
            if role.decodes() && ep.healthy {
                saturation_sum += scorer.saturation(ep, fresh);
                pool_size += 1;
            }
            score
        }));
        let saturation = if pool_size == 0 { 0.0 } else { saturation_sum / f64::from(pool_size) };
        let output = req.effective_max_tokens().unwrap_or(cfg.flow_control.attained_service.unbounded_output_tokens);
        let tokens = input_tokens.saturating_add(u64::from(output));
        let draws = books.draws;
        let decode_pick = decode_walk.best();
        Features {
            input_tokens,
            tokens,
            session_key,
            approx_valid,
            precise_valid,
            roster,
            roster_version,
            scores,
            saturation,
            draws,
            decode_pick,
        }
    }

    /// The picker's choice among `cands` (roster indexes); `salt` separates the decode and
    /// prefill picks' tie-breaks.
    fn pick_among(
        &self,
        active: &ActivePolicy,
        f: &Features,
        slots: &[u16],
        cands: &[usize],
        anchor: u64,
    ) -> Option<usize> {
        let endpoints = &self.endpoints;
        let last_assigned =
            |i: usize| slots.get(i).and_then(|&s| endpoints.get(s)).and_then(|e| e.load.last_assigned_ms());
        let picker = &active.policy.config().scoring.picker;
        // The write phase counts this draw (`commit`).
        let draws = f.draws.wrapping_add(1);
        score::pick(picker, &f.roster, &f.scores, cands, anchor, draws, last_assigned)
    }

    /// Phase 3: filters (relaxed when they would leave no candidate) and the decode pick, with
    /// the judgment of the request on the picked endpoint.
    fn pick(
        &self,
        active: &ActivePolicy,
        req: &RouteRequest,
        keys: &KeyBufs,
        f: &Features,
        s: &mut DecideScratch,
    ) -> Option<Pick> {
        // The features pass picked among the unfiltered decode candidates (max-score picker) or
        // gathered them (the others); the filters are relaxed only without any.
        let (relaxed, d) = match f.decode_pick {
            Some(d) => (false, d),
            None => {
                let relaxed = s.cands.is_empty() && score::candidates(&f.scores, Role::decodes, &mut s.cands);
                (relaxed, self.pick_among(active, f, &s.slots, &s.cands, keys.approx.anchor)?)
            }
        };
        let modes = &active.policy.config().modes;
        let judgment =
            decision::judge(modes, &req.hint, f.input_tokens, req.effective_max_tokens(), f.scores[d].prefix_hit);
        Some(Pick { d, relaxed, judgment })
    }

    /// Phase 5: the prefill pick and the mode rules.
    fn mode(
        &self,
        active: &ActivePolicy,
        keys: &KeyBufs,
        f: &Features,
        pick: &Pick,
        s: &mut DecideScratch,
    ) -> ModeChoice {
        let relaxed_p = s.pcands.is_empty()
            && s.prefill_pool
            && score::candidates(&f.scores, |r| r == Role::Prefill, &mut s.pcands);
        let prefill = self.pick_among(active, f, &s.slots, &s.pcands, keys.approx.anchor ^ 0x5046);
        let relaxed = pick.relaxed | (relaxed_p && prefill.is_some());
        let d = &f.scores[pick.d];
        let d_ep = s.slots.get(pick.d).and_then(|&slot| self.endpoints.get(slot));
        let inputs = ModeInputs {
            input_tokens: f.input_tokens,
            judgment: pick.judgment,
            decode_hit: d.prefix_hit,
            decode_kv_usage: d.kv_usage,
            decode_cached_tokens: d.cached_tokens,
            decode_running: d_ep.map_or(0, |e| e.metrics.as_ref().map_or(0, |m| m.running).max(e.load.inflight())),
            prefill_cached_tokens: prefill.map(|p| f.scores[p].cached_tokens),
        };
        let (mode, rule, transfer) = decision::decide_mode(active.policy.config(), &inputs);
        let prefill = if mode == Mode::Disaggregated { prefill } else { None };
        ModeChoice { mode, rule, transfer, prefill, relaxed }
    }

    /// The write phase under a shared lock ([`Router`](crate::Router)'s decisions): applies
    /// `plan` exactly as [`RouterCore::commit`] would, when that changes nothing but the
    /// endpoints' atomic loads, the ledger `hold` (requests in flight, ids, draws, counters,
    /// behind its own lock: the one the request's id belongs to, [`Books::ledger_for`]), the
    /// session (kept by the caller after the ledger's lock, [`Books::keep_session`]) and the
    /// precise index's speculation (written beside lookups into its
    /// two copies by [`RouterCore::speculate_shared`] when [`SharedBooking::speculate`] says
    /// so): the plan is current (same epoch and roster, no index written since through the
    /// exclusive lock), it routes, its approximate-index writes are no-ops, no request in flight
    /// is due to expire at `now_ms` (the caller withdrew the speculation due, see
    /// [`RouterCore::expire_shared`]), the request fits under `limits.max_inflight_requests`
    /// (`hold` has a place reserved for it), and neither flow control nor replica publishing is
    /// on.
    /// Otherwise the plan comes back for [`RouterCore::commit`] under the exclusive lock.
    // The plan goes back by value (no allocation on the way to the exclusive lock).
    #[allow(clippy::result_large_err, clippy::too_many_arguments)]
    pub(crate) fn commit_shared(
        &self,
        hold: &mut LedgerHold<'_>,
        active: &ActivePolicy,
        req: &RouteRequest,
        keys: &KeyBufs,
        plan: Plan,
        now_ms: u64,
        s: &DecideScratch,
    ) -> Result<SharedBooking, Plan> {
        // Speculation is written beside lookups only into two copies.
        let shared_kv = self.kv.shared();
        let (approx_quiet, precise_quiet) = plan.quiet;
        let current = plan.epoch == self.epoch
            && plan.f.roster_version == self.endpoints.roster_version()
            && approx_quiet
            && (precise_quiet || shared_kv)
            && plan.writes == (self.index.writes(), self.kv.writes());
        let cfg = active.policy.config();
        let ledger = &mut *hold.ledger;
        let oldest = ledger.inflight.oldest_started().into_iter().chain(hold.oldest_elsewhere).min();
        if !current
            || cfg.flow_control.enabled
            || self.replica.as_ref().is_some_and(|r| r.cfg.publish)
            || inflight_due_at(oldest, active, now_ms)
            || (!shared_kv && self.kv.read().expiry_due(now_ms))
            || !hold.fits
        {
            return Err(plan);
        }
        let Plan { epoch, f, outcome, writes, quiet } = plan;
        let (pick, m) = match outcome {
            Planned::Route(pick, m) => (pick, m),
            outcome => return Err(Plan { epoch, f, outcome, writes, quiet }),
        };
        // `maintain` at `now_ms`, with nothing due: only the latest time seen and the
        // speculation's clock move.
        ledger.last_now_ms = ledger.last_now_ms.max(now_ms);
        self.kv.observe_clock(now_ms);
        ledger.draws = ledger.draws.wrapping_add(1);
        if keys.tokenize_failed {
            ledger.counters.tokenize_errors += 1;
        }
        let request_id = ledger.assign(req, hold.index);
        let (booked, target) = book(active, &self.endpoints, ledger, keys, &f, pick.d, &m, &request_id, now_ms, s);
        let session = f.session_key.map(|k| (k, target));
        Ok(SharedBooking { request_id, f, pick, m, booked, speculate: !precise_quiet, session })
    }

    /// The decision of a request [`RouterCore::commit_shared`] booked, built after the books'
    /// lock is released (the booking is all that needs it).
    pub(crate) fn finish_shared(
        &self,
        active: &ActivePolicy,
        keys: &KeyBufs,
        b: SharedBooking,
        now_ms: u64,
    ) -> Decision {
        let SharedBooking { request_id, f, pick, m, booked, .. } = b;
        let mut d = self.routed(active, keys, request_id, f, pick, m, booked, now_ms);
        if !self.record_effects {
            d.effect = None;
        }
        d
    }

    /// Phase 6, the indexes: the approximate index's assumed residency and the precise index's
    /// speculation (the writes `w`).
    fn write_indexes(&mut self, keys: &KeyBufs, f: &Features, w: &IndexWrites, s: &DecideScratch) {
        if f.approx_valid {
            let index = self.index.write();
            for seq in keys.approx.sequences() {
                for slot in w.slots() {
                    index.observe(seq, slot as usize);
                }
            }
        }
        if f.precise_valid {
            for slot in w.slots() {
                let held = precise_held(keys, s, slot) as usize;
                self.kv.write(|kv| kv.speculate_from(&keys.precise.keys, held, slot as usize, w.expires_ms, w.now_ms));
            }
        }
    }

    /// Phase 7 (shed): the answer for a request admission refused.
    fn shed(&mut self, active: &ActivePolicy, request_id: String, f: Features, pick: Pick, shed: Shed) -> Decision {
        self.books.counters.decisions_by_rule[rule_index(Rule::Shed)] += 1;
        let d = &f.scores[pick.d];
        Decision {
            request_id,
            policy_version: active.version,
            rule: Rule::Shed,
            headers: vec![(decision::HEADER_SHED_REASON, shed.reason.clone())],
            outcome: Outcome::Shed(shed),
            judgment: pick.judgment,
            input_tokens: f.input_tokens,
            prefix_hit: d.prefix_hit,
            cached_tokens: d.cached_tokens,
            saturation: f.saturation,
            relaxed_filters: pick.relaxed,
            transfer: None,
            endpoints: f.roster,
            scores: f.scores,
            effect: None,
        }
    }

    /// Phase 7 (routed): the outcome, the headers and the replication effect.
    #[allow(clippy::too_many_arguments)]
    fn routed(
        &self,
        active: &ActivePolicy,
        keys: &KeyBufs,
        request_id: String,
        f: Features,
        pick: Pick,
        m: ModeChoice,
        booked: Booked,
        now_ms: u64,
    ) -> Decision {
        let endpoint = f.roster[pick.d].clone();
        let prefill_endpoint = m.prefill.map(|p| f.roster[p].clone());
        let effect = (self.record_effects || self.replica.as_ref().is_some_and(|r| r.cfg.publish)).then(|| {
            let (approx_keys, approx_seq_starts) = if f.approx_valid {
                (keys.approx.keys.clone(), keys.approx.seq_starts.clone())
            } else {
                (Vec::new(), Vec::new())
            };
            let (precise_keys, precise_seq_starts) = if f.precise_valid {
                (keys.precise.keys.clone(), keys.precise.seq_starts.clone())
            } else {
                (Vec::new(), Vec::new())
            };
            Arc::new(RoutingEffect {
                request_id: request_id.clone(),
                target: endpoint.clone(),
                prefill: prefill_endpoint.clone(),
                now_ms,
                session_key: f.session_key,
                approx_fingerprint: active.fingerprint,
                approx_keys,
                approx_seq_starts,
                precise_fingerprint: active.precise_fingerprint,
                precise_keys,
                precise_seq_starts,
                precise_skip: booked.precise_skip,
                speculative_expires_ms: booked.expires_ms,
            })
        });
        let d = &f.scores[pick.d];
        let mut headers = Vec::with_capacity(4);
        headers.push((decision::HEADER_DESTINATION, endpoint.to_string()));
        if let Some(p) = &prefill_endpoint {
            headers.push((decision::HEADER_PREFILLER, p.to_string()));
        }
        headers.push((decision::HEADER_MODE, m.mode.as_str().to_owned()));
        if active.policy.config().request.debug_header {
            headers.push((decision::HEADER_SCORE, format!("{};{:.4};{:.4}", m.rule.as_str(), d.total, d.prefix_hit)));
        }
        Decision {
            request_id,
            policy_version: active.version,
            rule: m.rule,
            outcome: Outcome::Routed { endpoint, prefill_endpoint, mode: m.mode },
            prefix_hit: d.prefix_hit,
            cached_tokens: d.cached_tokens,
            headers,
            judgment: pick.judgment,
            input_tokens: f.input_tokens,
            saturation: f.saturation,
            relaxed_filters: m.relaxed,
            transfer: m.transfer,
            endpoints: f.roster,
            scores: f.scores,
            effect,
        }
    }
}
