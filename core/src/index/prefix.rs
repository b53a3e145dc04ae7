//! The prefix index shared by both index kinds: which endpoint holds which block, in which tier,
//! with a per-endpoint capacity and LRU-style eviction.
//!
//! The module is private: its full description is the documentation of [`PrefixIndex`].

use super::store::{mix64, BlockStore, EMPTY};
use crate::approx::{BlockKey, RequestKeys};
use crate::config::TierWeights;
use crate::precise::events::Medium;

/// Generations per endpoint (eviction granularity is `1/GENERATIONS` of the capacity).
pub const GENERATIONS: u32 = 16;
const STAMP_BITS: u32 = 15;
const STAMP_MASK: u32 = (1 << STAMP_BITS) - 1;
const SPEC: u32 = 1 << 15;
const GPU: u32 = 1 << 16;
const CPU: u32 = 1 << 17;
const STORAGE: u32 = 1 << 18;
const TIERS: u32 = GPU | CPU | STORAGE;
const SLOT_SHIFT: u32 = 19;
/// The record's flag bits (speculative and the three tiers) start here.
const FLAGS_SHIFT: u32 = SPEC.trailing_zeros();
const _: () = assert!(TIERS >> FLAGS_SHIFT == 0b1110 && SPEC >> FLAGS_SHIFT == 1);
/// Largest slot number a record can carry.
pub const MAX_SLOTS: usize = 1 << 12;
const SWEEP_DIVISOR: usize = 16_384;
/// How many keys ahead a walk prefetches table buckets.
const PREFETCH: usize = 12;
const _: () = assert!(PREFETCH < 16, "a prefetched key's mix waits in a ring of 16 (touch_all)");
/// Tables smaller than this (in buckets) stay in cache: no prefetching.
const PREFETCH_MIN_BUCKETS: usize = 1 << 18;
/// A position that could not be stored (the arena is full).
const NO_POS: u32 = u32::MAX;
/// Flags a position of `touch_all`'s call whose block was born with its final record.
const BORN: u32 = 1 << 31;
const SWEEP_PER_BIRTH: usize = 4;

#[derive(Clone, Debug, PartialEq)]
struct SlotState {
    active: bool,
    /// Completed sweep passes when the slot was retired (`None`: never retired since last use).
    retired_at: Option<u64>,
    gen: u32,
    counts: [u32; GENERATIONS as usize],
    live: u32,
    /// Speculative-only memberships (not counted in `live`).
    spec: u32,
    cap: u32,
    per_gen: u32,
}

impl SlotState {
    fn new(cap: u32) -> Self {
        SlotState {
            active: false,
            retired_at: None,
            gen: 0,
            counts: [0; GENERATIONS as usize],
            live: 0,
            spec: 0,
            cap,
            per_gen: (cap / GENERATIONS).max(1),
        }
    }
}

/// Reusable buffers for [`PrefixIndex::match_blocks`]: per slot, and bit sets of slots (all
/// zero between calls).
#[derive(Debug, Default, Clone)]
pub struct MatchScratch {
    /// Slots that held every block so far.
    alive: Vec<u64>,
    /// Slots of `alive` that hold the block in hand.
    seen: Vec<u64>,
    /// Per slot: its current run of equally-weighted blocks.
    runs: Vec<SlotRun>,
    seen_weight: Vec<f64>,
    seen_spec: Vec<bool>,
    /// Slots' figures saved across a uniform credit pass.
    saved: Vec<(usize, SlotMatch)>,
}

/// A slot's state during a walk (one 16-byte line segment per slot).
#[derive(Debug, Default, Clone, Copy)]
struct SlotRun {
    /// Weight of the slot's current run of equally-weighted blocks.
    weight: f64,
    /// Block index where that run started.
    start: u32,
    /// First block held only speculatively, or `u32::MAX`.
    spec_from: u32,
}

/// The tier bit of a medium.
fn tier_bit(m: Medium) -> u32 {
    match m {
        Medium::Gpu => GPU,
        Medium::Cpu => CPU,
        Medium::Storage => STORAGE,
    }
}

/// Per-tier weights resolved for matching: a record's weight is that of its best tier
/// (speculative-only records count as GPU).
#[derive(Debug, Clone, Copy)]
pub struct MatchWeights {
    /// By a record's flag bits (speculative, GPU, CPU, storage).
    by_flags: [f64; 16],
}

impl MatchWeights {
    /// From a policy's tier weights.
    pub fn new(w: &TierWeights) -> Self {
        let mut by_flags = [0.0; 16];
        for (bits, slot) in by_flags.iter_mut().enumerate() {
            let rec = (bits as u32) << SPEC.trailing_zeros();
            *slot = if rec & (GPU | SPEC) != 0 {
                w.gpu
            } else if rec & CPU != 0 {
                w.cpu
            } else {
                w.storage
            };
        }
        MatchWeights { by_flags }
    }

    #[inline]
    fn of(&self, rec: u32) -> f64 {
        self.by_flags[((rec >> FLAGS_SHIFT) & 0xf) as usize]
    }
}

/// What a slot holds of one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding {
    /// In GPU memory.
    pub gpu: bool,
    /// Offloaded to CPU memory.
    pub cpu: bool,
    /// Offloaded to storage.
    pub storage: bool,
    /// Expected (a request was routed there) but not confirmed by an event.
    pub speculative: bool,
}

/// What one endpoint slot matched (see [`PrefixMatch`]).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct SlotMatch {
    /// Leading blocks held (low 32 bits) and, of those, the blocks confirmed (high 32 bits), so
    /// that one addition credits both. Neither count reaches 2^32: a request has fewer blocks.
    counts: u64,
    weighted: f64,
}

impl SlotMatch {
    /// Leading blocks held (any tier, or speculatively), summed over prompt sequences.
    #[inline]
    pub fn blocks(&self) -> u32 {
        self.counts as u32
    }

    /// The same blocks weighted by the tier each is held in.
    #[inline]
    pub fn weighted(&self) -> f64 {
        self.weighted
    }

    /// Of the leading blocks, those confirmed in a tier (not only speculative).
    #[inline]
    pub fn confirmed(&self) -> u32 {
        (self.counts >> 32) as u32
    }

    /// Add `blocks` leading blocks of which `confirmed` are confirmed.
    #[inline(always)]
    fn add(&mut self, blocks: u32, confirmed: u32) {
        self.counts += u64::from(blocks) | u64::from(confirmed) << 32;
    }
}

/// Matched prefix per endpoint slot: one [`SlotMatch`] per slot of the index (a slot's three
/// figures side by side, so crediting a slot touches one cache line).
#[derive(Debug, Default, Clone)]
pub struct PrefixMatch {
    slots: Vec<SlotMatch>,
}

impl PrefixMatch {
    fn reset(&mut self, n: usize) {
        // Zeroed in place (one `memset`), grown only when the index has more slots.
        self.slots.truncate(n);
        self.slots.fill(SlotMatch::default());
        self.slots.resize(n, SlotMatch::default());
    }

    /// Clear to "nothing matched".
    pub fn clear(&mut self) {
        self.slots.clear();
    }

    /// Per slot, in slot order (empty when nothing was matched).
    #[inline]
    pub fn slots(&self) -> &[SlotMatch] {
        &self.slots
    }

    /// What `slot` matched (nothing for a slot past the index's slots).
    #[inline]
    pub fn get(&self, slot: usize) -> SlotMatch {
        self.slots.get(slot).copied().unwrap_or_default()
    }

    /// Leading blocks per slot ([`SlotMatch::blocks`]).
    pub fn blocks(&self) -> Vec<u32> {
        self.slots.iter().map(SlotMatch::blocks).collect()
    }
}

/// Size and memory figures of an index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct IndexStats {
    /// Live (block, endpoint) memberships.
    pub memberships: u64,
    /// Distinct keys stored (live or awaiting the sweeper).
    pub keys: u64,
    /// Heap bytes held by the index.
    pub memory_bytes: u64,
}

/// The approximate index (observed placements; the precise index's store is the same type).
pub type ApproxIndex = PrefixIndex;

/// Extra stores of one (block, slot, offload tier) beyond the first: `(key, slot, tier bit)` →
/// count. Only offload tiers are counted (see [`PrefixIndex::store`]); entries exist only while a
/// duplicate announcement is outstanding, so the common case costs nothing.
type DupCounts = std::collections::BTreeMap<(BlockKey, u16, u32), u32>;

/// Heap bytes charged per duplicate-count entry (a B-tree entry with its share of a node).
const DUP_ENTRY_BYTES: usize = 48;

/// A prefix index. Slots are the endpoint table's slot numbers.
///
/// ---
///
/// The prefix index shared by both index kinds: which endpoint holds which block, in which tier,
/// with a per-endpoint capacity and LRU-style eviction.
///
/// - [`ApproxIndex`] = `PrefixIndex`: blocks *assumed* resident because the router
///   sent a request there (exact 64-bit keys: two tenants' keys never share an entry unless the
///   64-bit keys themselves are equal; a lookup compares the whole key stored in the arena, as
///   32-bit fingerprints would let a chosen pair of salts collide in a birthday search of about
///   2^16 salts, see `core/tests/tenant_boundaries.rs`).
/// - The event-fed precise index uses `PrefixIndex` too and adds tiers from the
///   engine's events and speculative entries.
///
/// # Structure
/// A block store (`store.rs`) keeps every block in an arena, in the order blocks were first
/// stored (a chain stored in one call lies in consecutive positions), a hash table from block key
/// to position, and per block the set of endpoints holding it (its posting). Each (block,
/// endpoint) membership is a 31-bit record: the endpoint's slot (12 bits), the tiers it is held
/// in (GPU, CPU, STORAGE: 3 bits), a speculative flag, and a generation stamp (15 bits). Records
/// are never 0 (a live record always has a tier or the speculative flag). A posting of several
/// records is a reference-counted chunk shared by every block with the same records: the blocks
/// of a chain stored or touched together share one (each change in a call is made once and
/// reused for the next block with the same old posting), so a system prompt held by hundreds of
/// endpoints costs one chunk, not one per block, and a lookup walking it compares two heads per
/// block instead of two lists of hundreds of records.
///
/// # Eviction: generational LRU
/// Each endpoint has a capacity `cap` (memberships, from the byte budget) and a generation counter.
/// Touching a block stamps the membership with the endpoint's current generation; once
/// `cap / 16` memberships carry the current generation, the generation advances and the oldest of
/// the 16 live generations dies as a whole. A record is live iff its stamp is within the last 16
/// generations of its endpoint, so eviction is O(1) and never scans. The guarantee (tested): the
/// most recently touched `15/16 · cap` distinct blocks of an endpoint are always present, and an
/// endpoint never holds more than `cap` live memberships.
///
/// Blocks of one request are touched tail-first, so a request's head blocks are never older than
/// its tail blocks and eviction trims prefixes from the end, as engines do.
///
/// Dead records are reclaimed by an incremental sweeper that walks the arena a bounded number of
/// positions: four per new membership while dead records await reclaiming (so they stay a bounded
/// fraction of the arena), plus `positions / 16384 + 1` per generation advance, so a whole pass
/// completes within 16,384 advances of all endpoints together — inside the 2^15-generation stamp
/// window of each endpoint (2x margin), which makes stamp wrap-around impossible to observe.
///
/// # Reference counts on offload tiers
/// Offloading connectors re-announce a block (once per chunk that overlaps it, once per
/// secondary tier) and remove it as often. The record's tier bit says "held"; a side table counts
/// the announcements beyond the first per (block, endpoint, tier) and exists only while such a
/// duplicate is outstanding (a removal then decrements it instead of dropping the tier). GPU
/// stores are not counted: vLLM re-announces GPU blocks on prefix hits without removals. Counts
/// of a membership that is evicted, cleared or retired are dropped with it (at latest on the
/// next sweep pass).
///
/// A block left without records is deleted; its position is reclaimed when free positions are
/// an eighth of the arena (a compaction keeping the order, amortized O(1) per deletion).
///
/// # Memory
/// A block costs its key and head in the arena (12 bytes) and a 4-byte bucket (load 0.58–0.875
/// while the index grows; at capacity, deleted blocks' buckets and tombstones share the table);
/// holders beyond the first cost 4 bytes each in a chunk shared by the blocks with the same
/// holders; an outstanding duplicate store on an offload tier costs one side-table entry (about
/// 48 bytes). See `memory_bytes` and the `index_memory` test for measured bytes per membership.
pub struct PrefixIndex {
    store: BlockStore,
    dups: DupCounts,
    slots: Vec<SlotState>,
    fingerprint: u64,
    cap: u32,
    cursor: usize,
    sweep_debt: usize,
    /// Dead records (killed generations, retired slots) not yet reclaimed by the sweeper.
    dead_pending: u64,
    passes: u64,
    /// Sums over active slots of `live` and `spec`, and the number of active slots.
    live_total: u64,
    spec_total: u64,
    active_slots: u64,
    /// Positions of the keys of the call in progress (`touch_all`).
    positions: Vec<u32>,
    /// Per slot, what a lookup needs of its state in one word: the generation, with
    /// `ACTIVE` set while the slot is active (mirrors `slots`).
    gens: Vec<u32>,
}

const ACTIVE: u32 = 1 << 31;

/// [`is_live`] from the compact mirror.
#[inline]
fn live_in(gens: &[u32], rec: u32) -> bool {
    gens.get(rec_slot(rec)).is_some_and(|&g| live_at(g, rec))
}

/// [`live_in`] given the mirror word `g` of the record's slot.
#[inline(always)]
fn live_at(g: u32, rec: u32) -> bool {
    g & ACTIVE != 0 && (rec & TIERS == 0 || stamp_live(g, rec))
}

/// Whether a tiered record's generation stamp is among the last `GENERATIONS` of the
/// generation `g` (the slot's generation, or its mirror word).
#[inline(always)]
fn stamp_live(g: u32, rec: u32) -> bool {
    (g.wrapping_sub(rec & STAMP_MASK) & STAMP_MASK) < GENERATIONS
}

/// Credit every live record of `recs` with `k` leading blocks (weighted by its tier; confirmed
/// unless only speculative): the holders of a block who all end their match at block `k`.
#[inline]
fn credit_all(recs: &[u32], gens: &[u32], w: &MatchWeights, k: u32, out: &mut PrefixMatch) {
    let n = out.slots.len().min(gens.len());
    let slots = &mut out.slots[..n];
    // What a record adds, by its flag bits (the same products as `w.of(r) * k`).
    let kf = f64::from(k);
    let add_weighted: [f64; 16] = std::array::from_fn(|flags| w.by_flags[flags] * kf);
    // Flags with a tier bit (all but speculative-only) are confirmed.
    let add_confirmed: [u32; 16] =
        std::array::from_fn(|flags| if (flags as u32) << FLAGS_SHIFT & TIERS == 0 { 0 } else { k });
    for &r in recs {
        let i = rec_slot(r);
        // Every record's slot is below `n`; the test lets the indexing below go unchecked.
        if i < n && live_at(gens[i], r) {
            let flags = ((r >> FLAGS_SHIFT) & 0xf) as usize;
            slots[i].add(k, add_confirmed[flags]);
            slots[i].weighted += add_weighted[flags];
        }
    }
}

/// [`credit_all`], by a loop without the per-record tier lookups when every record of the
/// posting carries the same flag bits (the common case: a prompt held in GPU memory).
#[inline]
fn credit(recs: &[u32], gens: &[u32], w: &MatchWeights, k: u32, out: &mut PrefixMatch) {
    let (any, all) = recs.iter().fold((0, u32::MAX), |(any, all), &r| (any | r, all & r));
    if (any ^ all) & (SPEC | TIERS) != 0 {
        credit_all(recs, gens, w, k, out);
    } else if all & TIERS != 0 {
        credit_uniform::<true>(recs, gens, w.of(all) * f64::from(k), k, k, out);
    } else {
        credit_uniform::<false>(recs, gens, w.of(all) * f64::from(k), 0, k, out);
    }
}

/// [`credit_all`] for records that all carry the same flag bits, held in a tier (`TIERED`) or
/// only speculatively: each live record's slot gets `k` blocks, `weighted` and `confirmed`.
#[inline]
fn credit_uniform<const TIERED: bool>(
    recs: &[u32],
    gens: &[u32],
    weighted: f64,
    confirmed: u32,
    k: u32,
    out: &mut PrefixMatch,
) {
    let n = out.slots.len().min(gens.len());
    let slots = &mut out.slots[..n];
    for &r in recs {
        let i = rec_slot(r);
        if i >= n {
            continue;
        }
        let g = gens[i];
        // `live_at`, its tier test decided for the whole posting.
        let live = g & ACTIVE != 0 && (!TIERED || stamp_live(g, r));
        if live {
            slots[i].add(k, confirmed);
            slots[i].weighted += weighted;
        }
    }
}

/// The record of `slot` in `recs` (sorted by slot, one per slot, slots below `n`): looked for
/// first where an even spread of the slots would put it, a few steps either way (a posting
/// held by most slots has it there or next to it), then by binary search.
#[inline]
fn record_of(recs: &[u32], slot: usize, n: usize) -> Option<u32> {
    let want = slot as u32;
    let guess = (slot * recs.len() / n.max(1)).min(recs.len().saturating_sub(1));
    let (mut lo, mut hi) = (0, recs.len());
    let mut at = guess;
    for _ in 0..4 {
        let got = owner(*recs.get(at)?);
        if got == want {
            return recs.get(at).copied();
        }
        if got < want {
            lo = at + 1;
            at += 1;
        } else {
            hi = at;
            at = at.checked_sub(1)?;
        }
        if lo >= hi {
            return None;
        }
    }
    let rest = recs.get(lo..hi)?;
    rest.binary_search_by_key(&want, |&r| owner(r)).ok().map(|j| rest[j])
}

/// How many leading entries of `stored` equal those of `keys` with `heads` all `head`: eight
/// compared per step without a branch between them, then one by one.
#[inline]
fn same_run(stored: &[u64], heads: &[u32], keys: &[u64], head: u32) -> usize {
    let m = stored.len().min(heads.len()).min(keys.len());
    let (stored, heads, keys) = (&stored[..m], &heads[..m], &keys[..m]);
    let mut run = 0;
    for ((s, h), k) in stored.chunks_exact(8).zip(heads.chunks_exact(8)).zip(keys.chunks_exact(8)) {
        // Any difference in a key or a head leaves a bit set.
        let keys_differ = s.iter().zip(k).fold(0, |d, (s, k)| d | (s ^ k));
        let heads_differ = h.iter().fold(0, |d, &h| d | (h ^ head));
        if keys_differ | u64::from(heads_differ) != 0 {
            break;
        }
        run += 8;
    }
    run + stored[run..]
        .iter()
        .zip(&heads[run..])
        .zip(&keys[run..])
        .take_while(|((&s, &h), &k)| s == k && h == head)
        .count()
}

/// Every set bit of `word` (word `index` of a slot bit set), as a slot number.
#[inline]
fn bits(index: usize, mut word: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (word != 0).then(|| {
            let b = word.trailing_zeros() as usize;
            word &= word - 1;
            index * 64 + b
        })
    })
}

/// The last posting change made in one call, reused while consecutive blocks share the posting
/// (a chain stored together): `(old head, new head or 0 when emptied, side effects)`. It holds a
/// reference on the new head so its chunk is neither freed nor changed in place meanwhile.
struct Memo<E: Copy> {
    entry: Option<(u32, u32, E)>,
}

impl<E: Copy> Memo<E> {
    fn new() -> Self {
        Memo { entry: None }
    }

    #[inline]
    fn get(&self, old: u32) -> Option<(u32, E)> {
        match self.entry {
            Some((o, n, e)) if o == old => Some((n, e)),
            _ => None,
        }
    }

    fn set(&mut self, store: &mut BlockStore, old: u32, new: u32, effect: E) {
        store.retain(new);
        self.clear(store);
        self.entry = Some((old, new, effect));
    }

    fn clear(&mut self, store: &mut BlockStore) {
        if let Some((_, n, _)) = self.entry.take() {
            store.release(n);
        }
    }
}

/// Slice equality without a `memcmp` call for the short postings that dominate.
#[inline]
fn same_records(a: &[u32], b: &[u32]) -> bool {
    a.len() == b.len() && if a.len() <= 8 { a.iter().zip(b).all(|(x, y)| x == y) } else { a == b }
}

#[inline]
fn rec_slot(rec: u32) -> usize {
    (rec >> SLOT_SHIFT) as usize
}

#[inline]
fn owner(rec: u32) -> u32 {
    rec >> SLOT_SHIFT
}

#[inline]
fn is_live(slots: &[SlotState], rec: u32) -> bool {
    match slots.get(rec_slot(rec)) {
        // A speculative-only record carries its expiry tick, not a generation: it lives until
        // the speculation queue withdraws it (or its endpoint goes).
        Some(s) if rec & TIERS == 0 => s.active,
        Some(s) => s.active && stamp_live(s.gen, rec),
        None => false,
    }
}

/// Whether `slot` holds `key` live in the tier `bit`.
fn held_in(store: &BlockStore, slots: &[SlotState], key: BlockKey, slot: usize, bit: u32) -> bool {
    store
        .find(key)
        .is_some_and(|p| store.records_at(p).iter().any(|&r| rec_slot(r) == slot && r & bit != 0 && is_live(slots, r)))
}

/// A live record counted in its endpoint's generations (held in some tier).
#[inline]
fn counted(slots: &[SlotState], rec: u32) -> bool {
    rec & TIERS != 0 && is_live(slots, rec)
}

/// Whether expiry tick `a` is later than `b` (ticks wrap at 2^15; speculation lives far less
/// than half the range).
#[inline]
fn tick_after(a: u32, b: u32) -> bool {
    let d = a.wrapping_sub(b) & STAMP_MASK;
    d != 0 && d < (1 << (STAMP_BITS - 1))
}

impl PrefixIndex {
    /// An empty index whose keys were made under `fingerprint`, with `cap` memberships per endpoint.
    pub fn new(fingerprint: u64, cap: u32) -> Self {
        PrefixIndex {
            store: BlockStore::new(),
            dups: DupCounts::new(),
            slots: Vec::new(),
            fingerprint,
            cap: cap.max(1),
            cursor: 0,
            sweep_debt: 0,
            dead_pending: 0,
            passes: 0,
            live_total: 0,
            spec_total: 0,
            active_slots: 0,
            positions: Vec::new(),
            gens: Vec::new(),
        }
    }

    /// The hashing fingerprint the stored keys were made under.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Drop every entry and adopt a new hashing fingerprint (keys made under another fingerprint
    /// can never match again). Endpoint slots stay active.
    pub fn reset(&mut self, fingerprint: u64) {
        self.store.clear();
        self.dups.clear();
        self.fingerprint = fingerprint;
        self.cursor = 0;
        self.sweep_debt = 0;
        self.dead_pending = 0;
        // Every stale record is gone: retired slots become reusable at once.
        self.passes += 2;
        for s in &mut self.slots {
            s.counts = [0; GENERATIONS as usize];
            s.live = 0;
            s.spec = 0;
        }
        self.live_total = 0;
        self.spec_total = 0;
    }

    /// Keep room for `blocks` distinct blocks from now on, so that an index growing to that
    /// size never rebuilds its table. A growing index rebuilds it at every 1.5x step, moving
    /// every block: the store pauses for each one, and the rebuilds are most of the time of
    /// storing a large index from empty. An embedder that knows the size its index will reach
    /// (the fleet's cache sizes, in blocks) can pay for that memory once instead.
    ///
    /// The memory is held from now on and counted in [`PrefixIndex::stats`] (about 16.6 bytes
    /// per reserved block: its key, its head and its table bucket at load 7/8). The index never
    /// shrinks below the reservation, through deletions or [`PrefixIndex::reset`]. A later call
    /// replaces it; a smaller one gives back the room the contents do not need (0: no
    /// reservation). At most 2^27 - 3 blocks (the most an index holds).
    ///
    /// The table's memory is written now, so it is held, not only promised. An error says the
    /// memory could not be allocated; the index is then as it was, without the reservation.
    pub fn reserve(&mut self, blocks: usize) -> Result<(), std::collections::TryReserveError> {
        self.store.reserve(blocks)
    }

    /// Change the per-endpoint capacity; endpoints over it lose their oldest generations now.
    pub fn set_capacity(&mut self, cap: u32) {
        self.cap = cap.max(1);
        for slot in 0..self.slots.len() {
            let s = &mut self.slots[slot];
            s.cap = self.cap;
            s.per_gen = (self.cap / GENERATIONS).max(1);
            if s.active {
                let mut guard = 0;
                while self.slots[slot].live > self.cap && guard < GENERATIONS {
                    self.advance(slot);
                    guard += 1;
                }
            }
        }
        self.run_sweeper();
    }

    /// Whether `slot` may be given to a new endpoint (no record of a previous holder survives).
    pub fn slot_reusable(&self, slot: usize) -> bool {
        match self.slots.get(slot) {
            None => true,
            Some(s) => !s.active && s.retired_at.is_none_or(|r| self.passes >= r + 2),
        }
    }

    /// Start tracking `slot` (a new endpoint). The slot must be reusable.
    pub fn activate(&mut self, slot: usize) {
        debug_assert!(slot < MAX_SLOTS);
        if slot >= self.slots.len() {
            self.slots.resize(slot + 1, SlotState::new(self.cap));
        }
        if !self.slot_reusable(slot) {
            // Make it reusable now: a full synchronous garbage collection.
            self.collect_all();
        }
        let s = &mut self.slots[slot];
        if s.active {
            self.live_total -= u64::from(s.live);
            self.spec_total -= u64::from(s.spec);
        } else {
            self.active_slots += 1;
        }
        let gen = s.gen;
        *s = SlotState::new(self.cap);
        s.gen = gen;
        s.active = true;
        self.sync_gen(slot);
    }

    /// Mirror `slot`'s state into `gens`.
    fn sync_gen(&mut self, slot: usize) {
        if self.gens.len() < self.slots.len() {
            self.gens.resize(self.slots.len(), 0);
        }
        let s = &self.slots[slot];
        self.gens[slot] = (s.gen & STAMP_MASK) | if s.active { ACTIVE } else { 0 };
    }

    /// Stop tracking `slot` (endpoint removed): all its memberships die at once; the sweeper
    /// reclaims their memory.
    pub fn retire(&mut self, slot: usize) {
        let passes = self.passes;
        if let Some(s) = self.slots.get_mut(slot) {
            self.dead_pending += u64::from(s.live) + u64::from(s.spec);
            self.live_total -= u64::from(s.live);
            self.spec_total -= u64::from(s.spec);
            if s.active {
                self.active_slots -= 1;
            }
            s.active = false;
            s.live = 0;
            s.spec = 0;
            s.counts = [0; GENERATIONS as usize];
            s.retired_at = Some(passes);
            self.sync_gen(slot);
            if !self.dups.is_empty() {
                let slot = slot as u16;
                self.dups.retain(|k, _| k.1 != slot);
            }
            // Reclaim at the same pace as a full turnover of the slot's generations.
            self.sweep_debt += (self.store.positions() / SWEEP_DIVISOR + 1) * GENERATIONS as usize;
        }
    }

    /// Synchronously drop every dead record.
    pub fn collect_all(&mut self) {
        let mut memo = Memo::new();
        for pos in 0..self.store.positions() {
            self.sweep_at(pos, &mut memo);
        }
        memo.clear(&mut self.store);
        self.store.compact(0);
        self.cursor = 0;
        self.sweep_debt = 0;
        self.dead_pending = 0;
        self.passes += 2;
        self.prune_dups();
    }

    /// Drop duplicate counts whose membership is gone (evicted by its generation, or its tier
    /// removed): run once per sweep pass, O(entries), and there are few.
    fn prune_dups(&mut self) {
        if self.dups.is_empty() {
            return;
        }
        let (store, slots) = (&self.store, &self.slots);
        self.dups.retain(|&(key, slot, bit), _| held_in(store, slots, key, usize::from(slot), bit));
    }

    fn advance(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        s.gen = s.gen.wrapping_add(1);
        let idx = (s.gen % GENERATIONS) as usize;
        s.live -= s.counts[idx];
        self.live_total -= u64::from(s.counts[idx]);
        self.dead_pending += u64::from(s.counts[idx]);
        s.counts[idx] = 0;
        self.sweep_debt += self.store.positions() / SWEEP_DIVISOR + 1;
        self.sync_gen(slot);
    }

    fn run_sweeper(&mut self) {
        let mut budget = std::mem::take(&mut self.sweep_debt);
        let mut memo = Memo::new();
        while budget > 0 {
            if self.cursor >= self.store.positions() {
                memo.clear(&mut self.store);
                self.cursor = 0;
                self.passes += 1;
                // Positions freed by deleted blocks are reclaimed once they are a quarter of the
                // arena (a pass boundary: nobody holds positions now).
                self.maybe_compact();
                self.store.maybe_shrink();
                self.prune_dups();
                if self.store.positions() == 0 {
                    break;
                }
            }
            self.sweep_at(self.cursor, &mut memo);
            self.cursor += 1;
            budget -= 1;
        }
        memo.clear(&mut self.store);
        self.maybe_compact();
    }

    /// Reclaim the positions of deleted blocks once they are an eighth of the arena (amortized
    /// O(1) per deletion); the sweeper's cursor follows its block. Only between calls: nobody
    /// holds positions then.
    fn maybe_compact(&mut self) {
        let free = self.store.free_positions();
        if free >= 64 && free * 8 > self.store.positions() {
            self.cursor = self.store.compact(self.cursor);
        }
    }

    /// Drop the dead records of the block at `pos` (the block goes when none is left).
    fn sweep_at(&mut self, pos: usize, memo: &mut Memo<u32>) {
        let old = self.store.head(pos);
        if old == 0 {
            return;
        }
        let (new, dropped) = match memo.get(old) {
            Some(hit) => hit,
            None => {
                let slots = &self.slots;
                let (new, dropped) = self.store.filter(old, |r| is_live(slots, r));
                let new = new.unwrap_or(0);
                memo.set(&mut self.store, old, new, dropped);
                (new, dropped)
            }
        };
        if dropped > 0 {
            self.dead_pending = self.dead_pending.saturating_sub(u64::from(dropped));
            if new == 0 {
                self.store.delete(pos);
            } else {
                self.store.set_head(pos, new);
            }
        }
    }

    /// Record that `slot` now holds every block in `keys` (approximate: assumed on GPU).
    pub fn observe(&mut self, keys: &[BlockKey], slot: usize) {
        self.touch_all(keys, slot, GPU);
    }

    /// Whether [`PrefixIndex::observe`] of `keys` on `slot` would change nothing: `slot` holds
    /// every block of `keys` on the GPU under its current generation's stamp (and speculatively on
    /// none), the call is shorter than a generation piece, the slot owes no generation advance and
    /// no sweep is pending. Read-only, so a decision's read phase can ask it under a shared lock
    /// and its write phase skip the observation (a prompt seen again on the same endpoint).
    pub fn observe_is_noop(&self, keys: &[BlockKey], slot: usize) -> bool {
        let Some(s) = self.slots.get(slot) else { return false };
        let current = (s.gen % GENERATIONS) as usize;
        if !s.active || keys.len() >= s.per_gen as usize || s.counts[current] >= s.per_gen || s.live > s.cap {
            return false;
        }
        if self.sweep_debt > 0 {
            return false;
        }
        let want = ((slot as u32) << SLOT_SHIFT) | (s.gen & STAMP_MASK);
        self.all_held(keys, slot, |r| r & !TIERS == want && r & GPU != 0)
    }

    /// Whether [`PrefixIndex::speculate`] of `keys` on `slot` until tick `tick` would change
    /// nothing: every block is held by `slot` in a tier, or speculatively until `tick` or later.
    pub fn speculate_is_noop(&self, keys: &[BlockKey], slot: usize, tick: u32) -> bool {
        if !self.slots.get(slot).is_some_and(|s| s.active) {
            return false;
        }
        let tick = tick & STAMP_MASK;
        let slots = &self.slots;
        self.all_held(keys, slot, |r| {
            is_live(slots, r) && (r & TIERS != 0 || (r & SPEC != 0 && !tick_after(tick, r & STAMP_MASK)))
        })
    }

    /// Whether every block of `keys` is stored with a record of `slot` that `accept` takes (the
    /// walk of the two no-op checks: a chain stored together is taken run by run, and a head is
    /// judged once for the blocks after it that share it).
    fn all_held(&self, keys: &[BlockKey], slot: usize, accept: impl Fn(u32) -> bool) -> bool {
        let heads = self.store.arena().1;
        let judge = |pos: usize| {
            heads[pos] != 0 && self.store.records_at(pos).iter().any(|&r| rec_slot(r) == slot && accept(r))
        };
        // The last head judged acceptable: blocks sharing it need no second look.
        let mut accepted: Option<u32> = None;
        let mut last: Option<usize> = None;
        let mut i = 0;
        while i < keys.len() {
            if let Some(p) = last {
                let run = self.store.run_after(p, &keys[i..]);
                for (q, &head) in (p + 1..).zip(&heads[p + 1..p + 1 + run]) {
                    if accepted != Some(head) {
                        if !judge(q) {
                            return false;
                        }
                        accepted = Some(head);
                    }
                }
                i += run;
                if i == keys.len() {
                    break;
                }
            }
            let Some(p) = self.store.find(keys[i]) else { return false };
            if accepted != Some(heads[p]) {
                if !judge(p) {
                    return false;
                }
                accepted = Some(heads[p]);
            }
            last = Some(p);
            i += 1;
        }
        true
    }

    /// Record that the engine stored `keys` on `slot` in `medium` (this confirms any
    /// speculation on them).
    ///
    /// Storing a block again on the GPU is idempotent (a touch): vLLM re-announces GPU blocks for
    /// prefix hits (`kv_cache_report_mode="full"`) without a matching removal. On an offload tier
    /// (CPU, storage) stores are reference-counted per (block, slot, tier): offloading connectors
    /// re-announce a hash once per chunk or per secondary tier and remove it as often, so a
    /// duplicate store followed by one removal leaves the block held; the count lives in a side
    /// table only while a duplicate is outstanding.
    pub fn store(&mut self, keys: &[BlockKey], slot: usize, medium: Medium) {
        self.touch_all(keys, slot, tier_bit(medium));
    }

    /// Outstanding duplicate stores (beyond the first) of `key` on `slot` in `medium`.
    pub fn duplicate_stores(&self, key: BlockKey, slot: usize, medium: Medium) -> u32 {
        u16::try_from(slot).ok().and_then(|s| self.dups.get(&(key, s, tier_bit(medium)))).copied().unwrap_or(0)
    }

    /// The blocks of one call get the same generation stamp (so a chain stored together has
    /// identical records block after block, which matching exploits) unless the call alone fills
    /// a generation: then it is cut into generation-sized pieces, tail first, so a long
    /// request's head is never older than its tail. Remaining advances happen after the call.
    fn touch_all(&mut self, keys: &[BlockKey], slot: usize, tier: u32) {
        if !self.slots.get(slot).is_some_and(|s| s.active) {
            return;
        }
        // Head first: find every block, appending new ones in chain order (so a chain stored
        // together lies in consecutive positions, which lookups exploit).
        let mut positions = std::mem::take(&mut self.positions);
        positions.clear();
        let prefetch = self.store.buckets() >= PREFETCH_MIN_BUCKETS;
        // A call that fits in one generation piece stamps every block alike, so a block new to
        // the store is born with its final record (and counted here), and the tail-first pass
        // below skips it (`BORN`); a longer call inserts new blocks empty and stamps them there.
        let stamp = self.slots[slot].gen & STAMP_MASK;
        let one_piece = keys.len() <= self.slots[slot].per_gen as usize;
        let born_head = if one_piece { ((slot as u32) << SLOT_SHIFT) | stamp | tier } else { EMPTY };
        let mut born = 0u32;
        let mut last: Option<usize> = None;
        // The mixes of the keys prefetched, by key index (each key is mixed once: for its
        // prefetch, then its probe); a key skipped by a run was not, and is mixed when probed.
        const MIXED: usize = 16;
        let mut mixed = [(usize::MAX, 0u64); MIXED];
        let mut i = 0;
        while i < keys.len() {
            if let Some(p) = last {
                // The blocks already stored right after the last one: no probe.
                let run = self.store.run_after(p, &keys[i..]);
                positions.extend((p + 1..p + 1 + run).map(|q| q as u32));
                i += run;
                if i == keys.len() {
                    break;
                }
            }
            let key = keys[i];
            if prefetch {
                if let Some(&ahead) = keys.get(i + PREFETCH) {
                    let m = mix64(ahead);
                    mixed[(i + PREFETCH) % MIXED] = (i + PREFETCH, m);
                    self.store.prefetch_mixed(m);
                }
            }
            let mix = match mixed[i % MIXED] {
                (at, m) if at == i => m,
                _ => mix64(key),
            };
            let (pos, new) = self.store.find_or_insert_mixed(key, mix, born_head);
            match pos {
                Some(p) if new && one_piece => {
                    positions.push(p as u32 | BORN);
                    born += 1;
                    if tier != GPU && !self.dups.is_empty() {
                        // First store of this tier: a count left from an evicted membership is stale.
                        if let Ok(slot16) = u16::try_from(slot) {
                            self.dups.remove(&(key, slot16, tier));
                        }
                    }
                }
                Some(p) => positions.push(p as u32),
                None => positions.push(NO_POS),
            }
            last = pos;
            i += 1;
        }
        if born > 0 {
            let s = &mut self.slots[slot];
            s.counts[(stamp % GENERATIONS) as usize] += born;
            s.live += born;
            self.live_total += u64::from(born);
            if self.dead_pending > 0 {
                self.sweep_debt += SWEEP_PER_BIRTH * born as usize;
            }
        }
        // Then tail first, so a long request's head is never older than its tail.
        let mut stamp = stamp;
        let mut in_piece = 0u32;
        let mut memo = Memo::new();
        for (i, &pos) in positions.iter().enumerate().rev() {
            if pos & BORN == 0 {
                self.touch(pos as usize, keys[i], slot, tier, stamp, &mut memo);
            }
            in_piece += 1;
            if in_piece >= self.slots[slot].per_gen {
                memo.clear(&mut self.store);
                self.advance(slot);
                stamp = self.slots[slot].gen & STAMP_MASK;
                in_piece = 0;
            }
        }
        memo.clear(&mut self.store);
        self.positions = positions;
        let mut guard = 0;
        while guard < GENERATIONS {
            let s = &self.slots[slot];
            if s.counts[(s.gen % GENERATIONS) as usize] < s.per_gen && s.live <= s.cap {
                break;
            }
            self.advance(slot);
            guard += 1;
        }
        self.run_sweeper();
    }

    /// Stamp `slot`'s membership of the block at `pos` (`key`) with `stamp` in `tier`.
    fn touch(&mut self, pos: usize, key: BlockKey, slot: usize, tier: u32, stamp: u32, memo: &mut Memo<(u32, bool)>) {
        let old = self.store.head(pos);
        let (new, (prev, was_spec)) = match memo.get(old) {
            Some(hit) => hit,
            None => {
                let base = ((slot as u32) << SLOT_SHIFT) | stamp;
                let slots = &self.slots;
                let mut prev_counted = 0u32;
                let mut was_spec = false;
                let (new, _) = self.store.derive(old, slot as u32, owner, |old| {
                    Some(match old {
                        Some(o) if counted(slots, o) => {
                            prev_counted = o;
                            base | (o & TIERS) | tier
                        }
                        Some(o) => {
                            was_spec = o & SPEC != 0 && is_live(slots, o);
                            base | tier
                        }
                        None => base | tier,
                    })
                });
                let new = new.unwrap_or(EMPTY);
                memo.set(&mut self.store, old, new, (prev_counted, was_spec));
                (new, (prev_counted, was_spec))
            }
        };
        self.store.set_head(pos, new);
        let prev_counted = (prev != 0).then_some(prev);
        if tier != GPU {
            if let Ok(slot16) = u16::try_from(slot) {
                if prev_counted.is_some_and(|o| o & tier != 0) {
                    *self.dups.entry((key, slot16, tier)).or_insert(0) += 1;
                } else if !self.dups.is_empty() {
                    // First store of this tier: a count left from an evicted membership is stale.
                    self.dups.remove(&(key, slot16, tier));
                }
            }
        }
        let s = &mut self.slots[slot];
        if was_spec && s.spec > 0 {
            s.spec -= 1;
            self.spec_total -= 1;
        }
        let cur = (stamp % GENERATIONS) as usize;
        match prev_counted {
            Some(o) => {
                let prev = ((o & STAMP_MASK) % GENERATIONS) as usize;
                if prev != cur {
                    s.counts[prev] -= 1;
                    s.counts[cur] += 1;
                }
            }
            None => {
                s.counts[cur] += 1;
                s.live += 1;
                self.live_total += 1;
                // While dead records await reclaiming, sweep four buckets per birth: a full pass
                // then completes within capacity/4 births, so dead records stay a bounded
                // fraction of the table. (A table with nothing dead is not swept for births.)
                if self.dead_pending > 0 {
                    self.sweep_debt += SWEEP_PER_BIRTH;
                }
            }
        }
    }

    /// Record that `slot` is expected to hold `keys` until expiry tick `tick` (a request was
    /// routed there). Blocks already held in a tier are left as they are; speculative ones keep
    /// the later of their ticks. Speculative memberships are not counted against an endpoint's
    /// capacity (the generations); they are in [`PrefixIndex::charged_memberships`], which the
    /// precise index keeps within [`PrefixIndex::budget_memberships`] by withdrawing speculation;
    /// [`PrefixIndex::unspeculate`] withdraws them.
    pub fn speculate(&mut self, keys: &[BlockKey], slot: usize, tick: u32) {
        if !self.slots.get(slot).is_some_and(|s| s.active) {
            return;
        }
        let tick = tick & STAMP_MASK;
        let spec = ((slot as u32) << SLOT_SHIFT) | SPEC | tick;
        let mut memo = Memo::new();
        let mut last = None;
        for &key in keys {
            // One probe for a block new to the store: it is born with the speculative record.
            let (found, new) = self.store.find_after_or_insert(last, key, spec);
            last = found;
            let born = match found {
                Some(pos) if !new => self.update(pos, slot, &mut memo, |slots, old| match old {
                    Some(o) if counted(slots, o) => (Some(o), false),
                    Some(o) if o & SPEC != 0 && is_live(slots, o) => {
                        (Some(if tick_after(tick, o & STAMP_MASK) { spec } else { o }), false)
                    }
                    _ => (Some(spec), true),
                }),
                found => found.is_some(),
            };
            if born {
                self.slots[slot].spec += 1;
                self.spec_total += 1;
            }
        }
        memo.clear(&mut self.store);
    }

    /// Apply `f` to `slot`'s record in the block at `pos` (through `memo`, so blocks sharing a
    /// posting share the result): `f` gets the record (if any) and returns the new one (`None`:
    /// removed) and a side effect, which is returned. A block left without records is deleted.
    fn update<E: Copy + Default>(
        &mut self,
        pos: usize,
        slot: usize,
        memo: &mut Memo<E>,
        f: impl FnOnce(&[SlotState], Option<u32>) -> (Option<u32>, E),
    ) -> E {
        let old = self.store.head(pos);
        let (new, effect) = match memo.get(old) {
            Some(hit) => hit,
            None => {
                let slots = &self.slots;
                let mut effect = E::default();
                let (new, _) = self.store.derive(old, slot as u32, owner, |o| {
                    let (r, e) = f(slots, o);
                    effect = e;
                    r
                });
                let new = new.unwrap_or(0);
                memo.set(&mut self.store, old, new, effect);
                (new, effect)
            }
        };
        if new == 0 {
            self.store.delete(pos);
        } else {
            self.store.set_head(pos, new);
        }
        effect
    }

    /// Withdraw the speculation that expires at `tick` on `keys` for `slot`: speculative-only
    /// memberships whose tick is not later than `tick` are deleted (a later speculation keeps
    /// them); memberships held in a tier are untouched.
    pub fn unspeculate(&mut self, keys: &[BlockKey], slot: usize, tick: u32) {
        let tick = tick & STAMP_MASK;
        let mut memo = Memo::new();
        let mut last = None;
        for &key in keys {
            let found = match last {
                Some(p) => self.store.find_after(p, key),
                None => self.store.find(key),
            };
            let Some(pos) = found else { continue };
            let deleted = self.update(pos, slot, &mut memo, |_, old| match old {
                Some(r) if r & TIERS == 0 && r & SPEC != 0 && !tick_after(r & STAMP_MASK, tick) => (None, true),
                other => (other, false),
            });
            // A deleted block's position is free: its successor is found through the table.
            last = (!deleted || self.store.head(pos) != 0).then_some(pos);
            if deleted {
                if let Some(s) = self.slots.get_mut(slot).filter(|s| s.spec > 0) {
                    s.spec -= 1;
                    self.spec_total -= 1;
                }
            }
        }
        memo.clear(&mut self.store);
        self.maybe_compact();
    }

    /// Speculative (block, endpoint) memberships pending.
    pub fn speculative_memberships(&self) -> u64 {
        self.spec_total
    }

    /// Memberships charged against the budget: live ones and speculative ones (O(1)).
    pub fn charged_memberships(&self) -> u64 {
        self.live_total + self.spec_total
    }

    /// The budget of all active endpoints together, in memberships (O(1)).
    pub fn budget_memberships(&self) -> u64 {
        u64::from(self.cap) * self.active_slots
    }

    /// Record that the engine removed `keys` from `medium` on `slot`: the tier is dropped, and a
    /// membership left in no tier is deleted.
    pub fn remove(&mut self, keys: &[BlockKey], slot: usize, medium: Medium) {
        if !self.slots.get(slot).is_some_and(|s| s.active) {
            return;
        }
        let bit = tier_bit(medium);
        let mut memo = Memo::new();
        for &key in keys {
            if bit != GPU && !self.dups.is_empty() {
                if let Ok(slot16) = u16::try_from(slot) {
                    if let Some(c) = self.dups.get_mut(&(key, slot16, bit)) {
                        let held = held_in(&self.store, &self.slots, key, slot, bit);
                        if held && *c > 1 {
                            *c -= 1;
                        } else {
                            self.dups.remove(&(key, slot16, bit));
                        }
                        if held {
                            continue; // another announcement still holds it
                        }
                    }
                }
            }
            let Some(pos) = self.store.find(key) else { continue };
            let deleted_counted = self.update(pos, slot, &mut memo, |slots, old| match old {
                None => (None, 0),
                Some(r) if r & TIERS == 0 => (Some(r), 0), // speculative only: not the engine's to remove
                Some(r) => {
                    let live = is_live(slots, r);
                    let rest = r & TIERS & !bit;
                    if !live || rest == 0 {
                        (None, if live { r } else { 0 })
                    } else {
                        (Some((r & !TIERS) | rest), 0)
                    }
                }
            });
            if deleted_counted != 0 {
                let r = deleted_counted;
                let s = &mut self.slots[slot];
                s.counts[((r & STAMP_MASK) % GENERATIONS) as usize] -= 1;
                s.live -= 1;
                self.live_total -= 1;
            }
        }
        memo.clear(&mut self.store);
        self.maybe_compact();
    }

    /// Every membership of `slot` dies at once (the engine cleared its cache); the slot stays
    /// active. O(generations); the sweeper reclaims the memory.
    pub fn clear_slot(&mut self, slot: usize) {
        if !self.slots.get(slot).is_some_and(|s| s.active) {
            return;
        }
        if !self.dups.is_empty() {
            let slot = slot as u16;
            self.dups.retain(|k, _| k.1 != slot);
        }
        for _ in 0..GENERATIONS {
            self.advance(slot);
        }
        self.run_sweeper();
    }

    /// The tiers and speculative flag of `slot`'s membership of `key`, if live.
    pub fn holding(&self, key: BlockKey, slot: usize) -> Option<Holding> {
        let recs = self.store.find(key).map_or(&[][..], |p| self.store.records_at(p));
        recs.iter().find(|&&r| rec_slot(r) == slot && is_live(&self.slots, r)).map(|&r| Holding {
            gpu: r & GPU != 0,
            cpu: r & CPU != 0,
            storage: r & STORAGE != 0,
            speculative: r & SPEC != 0,
        })
    }

    /// For each slot: how many leading blocks of each prompt sequence it holds (summed over
    /// sequences), and the same weighted by the tier each block is held in.
    pub fn match_blocks(
        &self,
        keys: &RequestKeys,
        weights: &MatchWeights,
        out: &mut PrefixMatch,
        scratch: &mut MatchScratch,
    ) {
        let n = self.slots.len();
        out.reset(n);
        if scratch.runs.len() < n {
            scratch.runs.resize(n, SlotRun::default());
            scratch.seen_weight.resize(n, 0.0);
            scratch.seen_spec.resize(n, false);
        }
        let words = n.div_ceil(64);
        if scratch.alive.len() < words {
            scratch.alive.resize(words, 0);
            scratch.seen.resize(words, 0);
        }
        for seq in keys.sequences() {
            self.match_sequence(seq, weights, out, scratch);
        }
    }

    /// Walks the sequence once. `alive` holds the slots that matched every block so far, each with
    /// the weight of its current run of equally-weighted blocks; a slot that drops out at block `k`
    /// is credited `k` blocks. Along a chain stored together, block `i + 1` sits right after block
    /// `i` in the store and shares its posting: one compare of the key and one of the head, no
    /// table probe and no per-holder work. Only where the holders change is there per-holder
    /// work, on bit sets of slots; until the first change the holders are the first block's
    /// records themselves (`pristine`), which the first change (or the end) then credits in one
    /// pass over them.
    fn match_sequence(&self, seq: &[BlockKey], w: &MatchWeights, out: &mut PrefixMatch, scratch: &mut MatchScratch) {
        let Some((&first, rest)) = seq.split_first() else { return };
        let Some(mut pos) = self.store.find(first) else { return };
        let gens = &self.gens;
        let words = self.slots.len().div_ceil(64);
        let MatchScratch { alive, seen, runs, seen_weight, seen_spec, saved } = scratch;
        let (alive, seen) = (&mut alive[..words], &mut seen[..words]);
        let first_head = self.store.head(pos);
        let spec_from_of = |r: u32| if r & TIERS == 0 { 0 } else { u32::MAX };
        if !self.store.records_of(&first_head).iter().any(|&r| live_in(gens, r)) {
            return;
        }
        let mut pristine = true;
        let mut prev = first_head;
        let mut k = 1u32;
        let (arena_keys, arena_heads) = self.store.arena();
        let mut j = 0;
        while pristine || alive.iter().any(|&a| a != 0) {
            // The blocks stored after this one, as long as they are the request's next blocks
            // with the same holders: one compare of the key and one of the head each.
            let run = same_run(&arena_keys[pos + 1..], &arena_heads[pos + 1..], &rest[j..], prev);
            pos += run;
            j += run;
            k += run as u32;
            let Some(&key) = rest.get(j) else { break };
            j += 1;
            let Some(next) = self.store.find_after(pos, key) else { break };
            pos = next;
            let head = self.store.head(pos);
            if head == prev {
                k += 1;
                continue;
            }
            let recs = self.store.records_at(pos);
            if recs.is_empty() {
                break;
            }
            if same_records(recs, self.store.records_of(&prev)) {
                prev = head;
                k += 1;
                continue;
            }
            for &r in recs {
                let i = rec_slot(r);
                if (pristine || alive[i / 64] & (1 << (i % 64)) != 0) && live_in(gens, r) {
                    seen[i / 64] |= 1 << (i % 64);
                    seen_weight[i] = w.of(r);
                    seen_spec[i] = r & TIERS == 0;
                }
            }
            if pristine {
                // The first block's holders: those not seen here end at `k`, the others go on
                // with their state made explicit. All are credited `k` blocks in one uniform
                // pass (the holders of a shared system prompt: hundreds); the few seen here are
                // then put back as they were and go on.
                pristine = false;
                saved.clear();
                for (index, s) in seen.iter().enumerate() {
                    saved.extend(bits(index, *s).map(|i| (i, out.slots[i])));
                }
                let first_recs = self.store.records_of(&first_head);
                credit(first_recs, gens, w, k, out);
                for &(i, before) in saved.iter() {
                    out.slots[i] = before;
                    let Some(r) = record_of(first_recs, i, self.slots.len()) else { continue };
                    if !live_in(gens, r) {
                        continue;
                    }
                    let weight = w.of(r);
                    let spec_from = spec_from_of(r);
                    alive[i / 64] |= 1 << (i % 64);
                    let run = &mut runs[i];
                    *run = SlotRun { weight, start: 0, spec_from };
                    if seen_weight[i] != weight {
                        out.slots[i].weighted += weight * f64::from(k);
                        run.weight = seen_weight[i];
                        run.start = k;
                    }
                    if seen_spec[i] && run.spec_from == u32::MAX {
                        run.spec_from = k;
                    }
                }
                seen.iter_mut().for_each(|s| *s = 0);
            } else {
                for (index, (a, s)) in alive.iter_mut().zip(seen.iter_mut()).enumerate() {
                    for i in bits(index, *a & !*s) {
                        let run = runs[i];
                        let m = &mut out.slots[i];
                        m.add(k, run.spec_from.min(k));
                        m.weighted += run.weight * f64::from(k - run.start);
                    }
                    for i in bits(index, *a & *s) {
                        let run = &mut runs[i];
                        if seen_weight[i] != run.weight {
                            out.slots[i].weighted += run.weight * f64::from(k - run.start);
                            run.weight = seen_weight[i];
                            run.start = k;
                        }
                        if seen_spec[i] && run.spec_from == u32::MAX {
                            run.spec_from = k;
                        }
                    }
                    *a &= *s;
                    *s = 0;
                }
            }
            k += 1;
            prev = head;
        }
        if pristine {
            credit(self.store.records_of(&first_head), gens, w, k, out);
            return;
        }
        for (index, a) in alive.iter_mut().enumerate() {
            for i in bits(index, *a) {
                let run = runs[i];
                let m = &mut out.slots[i];
                m.add(k, run.spec_from.min(k));
                m.weighted += run.weight * f64::from(k - run.start);
            }
            *a = 0;
        }
    }

    /// Whether `slot` holds `key` (live, any tier or speculative).
    pub fn contains(&self, key: BlockKey, slot: usize) -> bool {
        self.store
            .find(key)
            .is_some_and(|p| self.store.records_at(p).iter().any(|&r| rec_slot(r) == slot && is_live(&self.slots, r)))
    }

    /// Live memberships of `slot`.
    pub fn memberships_of(&self, slot: usize) -> u32 {
        self.slots.get(slot).filter(|s| s.active).map_or(0, |s| s.live)
    }

    /// Size and memory figures.
    pub fn stats(&self) -> IndexStats {
        let memberships = self.slots.iter().filter(|s| s.active).map(|s| u64::from(s.live)).sum();
        let memory = self.store.memory_bytes()
            + self.positions.capacity() * 4
            + self.slots.capacity() * std::mem::size_of::<SlotState>()
            + self.dups.len() * DUP_ENTRY_BYTES;
        IndexStats { memberships, keys: self.store.len() as u64, memory_bytes: memory as u64 }
    }

    /// A copy with the same contents and capacities, so that it reports the same memory and
    /// grows at the same points (the second copy a `Router` keeps of the precise index).
    pub(crate) fn twin(&self) -> Self {
        use super::clone_with_capacity as copy;
        PrefixIndex {
            store: self.store.twin(),
            dups: self.dups.clone(),
            slots: copy(&self.slots),
            fingerprint: self.fingerprint,
            cap: self.cap,
            cursor: self.cursor,
            sweep_debt: self.sweep_debt,
            dead_pending: self.dead_pending,
            passes: self.passes,
            live_total: self.live_total,
            spec_total: self.spec_total,
            active_slots: self.active_slots,
            positions: copy(&self.positions),
            gens: copy(&self.gens),
        }
    }

    /// Completed sweep passes (diagnostics and tests).
    pub fn sweep_passes(&self) -> u64 {
        self.passes
    }

    #[cfg(test)]
    pub(crate) fn stored_records(&self) -> u64 {
        self.store.iter().map(|(_, r)| r.len() as u64).sum()
    }

    /// Records of `slot` held in a tier and live (what `memberships_of` counts), by a scan.
    #[cfg(test)]
    pub(crate) fn live_records_in_table(&self, slot: usize) -> u64 {
        self.store
            .iter()
            .map(|(_, recs)| recs.iter().filter(|&&r| rec_slot(r) == slot && counted(&self.slots, r)).count() as u64)
            .sum()
    }

    /// The store's reference counts and table agree with its positions (tests).
    #[cfg(test)]
    pub(crate) fn check_store(&self) {
        self.store.check_refs();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rk(seqs: &[&[u64]]) -> RequestKeys {
        let mut k = RequestKeys { block_tokens: 1, ..Default::default() };
        for s in seqs {
            k.seq_starts.push(k.keys.len() as u32);
            k.keys.extend_from_slice(s);
        }
        k
    }

    fn w() -> MatchWeights {
        MatchWeights::new(&TierWeights::default())
    }

    fn matches(ix: &PrefixIndex, seqs: &[&[u64]]) -> Vec<u32> {
        let mut out = PrefixMatch::default();
        ix.match_blocks(&rk(seqs), &w(), &mut out, &mut MatchScratch::default());
        out.blocks()
    }

    fn weighted(ix: &PrefixIndex, seqs: &[&[u64]]) -> Vec<f64> {
        let mut out = PrefixMatch::default();
        ix.match_blocks(&rk(seqs), &w(), &mut out, &mut MatchScratch::default());
        out.slots().iter().map(SlotMatch::weighted).collect()
    }

    #[test]
    fn longest_consecutive_prefix_per_endpoint() {
        let mut ix = ApproxIndex::new(0, 1 << 16);
        for s in 0..3 {
            ix.activate(s);
        }
        ix.observe(&[1, 2, 3, 4], 0);
        ix.observe(&[1, 2], 1);
        ix.observe(&[1, 2, 3, 4], 2);
        ix.observe(&[9], 2);
        assert_eq!(matches(&ix, &[&[1, 2, 3, 4, 5]]), vec![4, 2, 4]);
        // Endpoint 2 loses block 3 (simulated): it scores at most 2 blocks although it has 4.
        ix.remove(&[3], 2, Medium::Gpu);
        assert!(ix.contains(4, 2));
        assert_eq!(matches(&ix, &[&[1, 2, 3, 4]]), vec![4, 2, 2]);
        // Batches add up per sequence.
        assert_eq!(matches(&ix, &[&[1, 2], &[1, 7]]), vec![3, 3, 3]);
        assert_eq!(matches(&ix, &[&[8, 1, 2]]), vec![0, 0, 0]);
    }

    #[test]
    fn retire_purges_and_slot_reuse_waits_for_the_sweeper() {
        let mut ix = ApproxIndex::new(0, 1 << 10);
        ix.activate(0);
        ix.activate(1);
        let keys: Vec<u64> = (1..=500).collect();
        ix.observe(&keys, 0);
        ix.observe(&keys, 1);
        ix.retire(0);
        assert_eq!(matches(&ix, &[&keys])[..2], [0, 500]);
        assert_eq!(ix.memberships_of(0), 0);
        assert!(!ix.slot_reusable(0));
        // Reactivating forces a collection: the old holder's records must not resurface.
        ix.activate(0);
        assert_eq!(ix.live_records_in_table(0), 0);
        assert_eq!(matches(&ix, &[&keys])[..2], [0, 500]);
        assert_eq!(ix.stored_records(), 500);
    }

    #[test]
    fn capacity_is_never_exceeded_and_recent_blocks_survive() {
        let cap = 1600;
        let mut ix = ApproxIndex::new(0, cap);
        ix.activate(0);
        ix.activate(1);
        let per_gen = cap / GENERATIONS;
        let guaranteed = u64::from(per_gen * (GENERATIONS - 1));
        for i in 0..20_000u64 {
            ix.observe(&[i * 2 + 1], 0);
            ix.observe(&[i * 2 + 2], 1);
            assert!(ix.memberships_of(0) <= cap);
            if i >= guaranteed {
                for back in [0, guaranteed / 2, guaranteed - 1] {
                    assert!(ix.contains((i - back) * 2 + 1, 0), "block {back} touches ago must survive");
                }
            }
        }
        // The sweeper keeps stored records close to the live ones.
        let live = u64::from(ix.memberships_of(0) + ix.memberships_of(1));
        assert_eq!(ix.live_records_in_table(0) + ix.live_records_in_table(1), live);
        assert!(ix.stored_records() * 2 <= live * 3, "stored {} live {live}", ix.stored_records());
        assert!(ix.sweep_passes() > 0);
    }

    #[test]
    fn touching_refreshes_recency() {
        let cap = 320;
        let mut ix = ApproxIndex::new(0, cap);
        ix.activate(0);
        ix.observe(&[1_000_000], 0);
        for i in 1..10_000u64 {
            ix.observe(&[i], 0);
            if i % 100 == 0 {
                ix.observe(&[1_000_000], 0);
            }
        }
        assert!(ix.contains(1_000_000, 0), "a block touched often stays");
        assert!(!ix.contains(1, 0), "an old block is gone");
    }

    #[test]
    fn eviction_trims_from_the_tail_of_a_request() {
        let cap = 64 * GENERATIONS;
        let mut ix = ApproxIndex::new(0, cap);
        ix.activate(0);
        let chain: Vec<u64> = (1..=100).collect();
        ix.observe(&chain, 0);
        // Push enough other blocks to kill some but not all of the chain's generations.
        let mut filler = 10_000u64;
        while ix.contains(100, 0) {
            ix.observe(&[filler], 0);
            filler += 1;
        }
        let m = matches(&ix, &[&chain])[0];
        let present = chain.iter().filter(|&&k| ix.contains(k, 0)).count() as u32;
        assert_eq!(m, present, "what survives is a prefix");
        assert!(m > 0 && m < 100);
    }

    #[test]
    fn shrinking_capacity_evicts_now() {
        let mut ix = ApproxIndex::new(0, 1 << 12);
        ix.activate(0);
        let keys: Vec<u64> = (1..=4000).collect();
        ix.observe(&keys, 0);
        assert_eq!(ix.memberships_of(0), 4000);
        ix.set_capacity(1000);
        assert!(ix.memberships_of(0) <= 1000);
        assert!(ix.contains(1, 0), "head blocks are the newest (tail-first touch)");
    }

    #[test]
    fn reset_forgets_everything() {
        let mut ix = ApproxIndex::new(1, 1 << 12);
        ix.activate(0);
        ix.observe(&[1, 2, 3], 0);
        ix.reset(2);
        assert_eq!(ix.fingerprint(), 2);
        assert_eq!(matches(&ix, &[&[1, 2, 3]]), vec![0]);
        assert_eq!(ix.stats().memberships, 0);
        ix.observe(&[1], 0);
        assert_eq!(matches(&ix, &[&[1, 2, 3]]), vec![1]);
    }

    #[test]
    fn tiers_are_weighted_and_removed_per_medium() {
        let mut ix: PrefixIndex = PrefixIndex::new(0, 1 << 12);
        ix.activate(0);
        ix.activate(1);
        ix.store(&[1, 2, 3, 4], 0, Medium::Gpu);
        ix.store(&[3, 4], 0, Medium::Cpu);
        ix.store(&[1, 2, 3, 4], 1, Medium::Cpu);
        assert_eq!(matches(&ix, &[&[1, 2, 3, 4]]), vec![4, 4]);
        let wt = weighted(&ix, &[&[1, 2, 3, 4]]);
        assert!((wt[0] - 4.0).abs() < 1e-12, "GPU everywhere (GPU wins over CPU): {wt:?}");
        assert!((wt[1] - 3.2).abs() < 1e-12, "CPU everywhere: {wt:?}");
        // Evicted from GPU, still on CPU: counted at the CPU weight.
        ix.remove(&[3, 4], 0, Medium::Gpu);
        let wt = weighted(&ix, &[&[1, 2, 3, 4]]);
        assert!((wt[0] - (2.0 + 1.6)).abs() < 1e-12, "{wt:?}");
        assert_eq!(ix.holding(3, 0), Some(Holding { gpu: false, cpu: true, storage: false, speculative: false }));
        // Gone from every tier: the membership is deleted and the match stops there.
        ix.remove(&[3], 0, Medium::Cpu);
        assert_eq!(ix.holding(3, 0), None);
        assert_eq!(matches(&ix, &[&[1, 2, 3, 4]]), vec![2, 4]);
        assert_eq!(ix.memberships_of(0), 3);
        // Removing what is not there changes nothing.
        ix.remove(&[99, 3], 0, Medium::Gpu);
        assert_eq!(ix.memberships_of(0), 3);
    }

    #[test]
    fn speculation_is_superseded_by_confirmation_and_withdrawn_otherwise() {
        let mut ix: PrefixIndex = PrefixIndex::new(0, 1 << 12);
        ix.activate(0);
        ix.speculate(&[1, 2, 3], 0, 10);
        assert_eq!(matches(&ix, &[&[1, 2, 3]]), vec![3]);
        assert_eq!(ix.speculative_memberships(), 3);
        assert_eq!(ix.holding(1, 0).map(|h| (h.gpu, h.speculative)), Some((false, true)));
        ix.store(&[1, 2], 0, Medium::Gpu);
        assert_eq!(ix.holding(1, 0).map(|h| (h.gpu, h.speculative)), Some((true, false)));
        ix.unspeculate(&[1, 2, 3], 0, 10);
        assert_eq!(matches(&ix, &[&[1, 2, 3]]), vec![2], "confirmed blocks stay, speculation goes");
        assert_eq!(ix.speculative_memberships(), 0);
        assert_eq!(ix.memberships_of(0), 2);
        // Speculating on a confirmed block does not make it speculative.
        ix.speculate(&[1], 0, 20);
        assert_eq!(ix.holding(1, 0).map(|h| h.speculative), Some(false));
        // A later speculation keeps a block that an earlier one's expiry would withdraw.
        ix.speculate(&[7], 0, 30);
        ix.speculate(&[7], 0, 40);
        ix.unspeculate(&[7], 0, 30);
        assert!(ix.contains(7, 0));
        ix.unspeculate(&[7], 0, 40);
        assert!(!ix.contains(7, 0));
        // Ticks wrap.
        ix.speculate(&[8], 0, (1 << 15) - 1);
        ix.speculate(&[8], 0, 5);
        ix.unspeculate(&[8], 0, (1 << 15) - 1);
        assert!(ix.contains(8, 0), "tick 5 is after the wrap");
    }

    #[test]
    fn offload_stores_are_reference_counted_gpu_stores_are_not() {
        let mut ix: PrefixIndex = PrefixIndex::new(0, 1 << 12);
        ix.activate(0);
        ix.activate(1);
        // Store X twice on CPU, remove once: still held; remove again: gone.
        ix.store(&[7], 0, Medium::Cpu);
        ix.store(&[7], 0, Medium::Cpu);
        assert_eq!(ix.duplicate_stores(7, 0, Medium::Cpu), 1);
        ix.remove(&[7], 0, Medium::Cpu);
        assert!(ix.holding(7, 0).is_some_and(|h| h.cpu));
        ix.remove(&[7], 0, Medium::Cpu);
        assert_eq!(ix.holding(7, 0), None);
        assert_eq!(ix.duplicate_stores(7, 0, Medium::Cpu), 0);
        // Per endpoint and per tier: another slot's or tier's removal does not consume the count.
        ix.store(&[8], 0, Medium::Storage);
        ix.store(&[8], 0, Medium::Storage);
        ix.store(&[8], 1, Medium::Storage);
        ix.remove(&[8], 1, Medium::Storage);
        ix.remove(&[8], 0, Medium::Cpu);
        assert_eq!(ix.duplicate_stores(8, 0, Medium::Storage), 1);
        assert!(!ix.contains(8, 1));
        // GPU re-stores are touches: one removal drops the tier.
        ix.store(&[9], 0, Medium::Gpu);
        ix.store(&[9], 0, Medium::Gpu);
        ix.remove(&[9], 0, Medium::Gpu);
        assert_eq!(ix.holding(9, 0), None);
        // Clearing the endpoint drops its counts: a later single store is removed by one removal.
        ix.clear_slot(0);
        assert_eq!(ix.duplicate_stores(8, 0, Medium::Storage), 0);
        ix.store(&[8], 0, Medium::Storage);
        ix.remove(&[8], 0, Medium::Storage);
        assert!(!ix.contains(8, 0));
        // A count whose membership was evicted is stale: it does not keep a later store alive.
        let cap = 64 * GENERATIONS;
        let mut ix: PrefixIndex = PrefixIndex::new(0, cap);
        ix.activate(0);
        ix.store(&[1], 0, Medium::Cpu);
        ix.store(&[1], 0, Medium::Cpu);
        let mut filler = 100u64;
        while ix.contains(1, 0) {
            ix.store(&[filler], 0, Medium::Gpu);
            filler += 1;
        }
        ix.store(&[1], 0, Medium::Cpu);
        assert_eq!(ix.duplicate_stores(1, 0, Medium::Cpu), 0);
        ix.remove(&[1], 0, Medium::Cpu);
        assert!(!ix.contains(1, 0));
    }

    #[test]
    fn clear_slot_drops_everything_of_one_endpoint() {
        let mut ix: PrefixIndex = PrefixIndex::new(0, 1 << 12);
        ix.activate(0);
        ix.activate(1);
        ix.store(&[1, 2], 0, Medium::Gpu);
        ix.store(&[1, 2], 1, Medium::Gpu);
        ix.clear_slot(0);
        assert_eq!(matches(&ix, &[&[1, 2]]), vec![0, 2]);
        assert_eq!(ix.memberships_of(0), 0);
        ix.store(&[1], 0, Medium::Gpu);
        assert_eq!(matches(&ix, &[&[1, 2]]), vec![1, 2]);
    }

    /// Everything an observation or a speculation can change that lookups, counts or later
    /// evictions read: the slots' generations and counts, the totals, and every slot's holding
    /// of keys 1..60.
    type Observable = (Vec<SlotState>, u64, u64, usize, Vec<Vec<Option<Holding>>>);

    fn observable(ix: &PrefixIndex) -> Observable {
        let holdings = (0..6).map(|s| (1..60).map(|k| ix.holding(k, s)).collect()).collect();
        (ix.slots.clone(), ix.live_total, ix.spec_total, ix.dups.len(), holdings)
    }

    #[test]
    fn an_observation_seen_again_is_a_noop() {
        let mut ix: PrefixIndex = PrefixIndex::new(0, 1 << 12);
        ix.activate(0);
        ix.activate(1);
        let keys: Vec<u64> = (1..20).collect();
        assert!(!ix.observe_is_noop(&keys, 0), "new blocks are not a no-op");
        ix.observe(&keys, 0);
        assert!(ix.observe_is_noop(&keys, 0));
        assert!(ix.observe_is_noop(&keys[..5], 0), "a prefix of what is held");
        assert!(!ix.observe_is_noop(&keys, 1), "held by another slot");
        assert!(!ix.observe_is_noop(&(1..21).collect::<Vec<_>>(), 0), "one block more");
        // Held on the CPU only, or speculatively: observing adds the GPU tier.
        ix.store(&[30, 31], 1, Medium::Cpu);
        assert!(!ix.observe_is_noop(&[30, 31], 1));
        ix.speculate(&[40, 41], 1, 5);
        assert!(!ix.observe_is_noop(&[40, 41], 1));
        assert!(ix.speculate_is_noop(&[40, 41], 1, 5), "the same tick again");
        assert!(ix.speculate_is_noop(&[40, 41], 1, 4), "an earlier tick");
        assert!(!ix.speculate_is_noop(&[40, 41], 1, 6), "a later tick moves the expiry");
        assert!(ix.speculate_is_noop(&[30, 31], 1, 6), "held in a tier: speculation leaves it");
        assert!(!ix.speculate_is_noop(&[30, 31, 32], 1, 6), "a new block");
        // Once the generation moves on, observing again restamps.
        let filler: Vec<u64> = (1000..1000 + u64::from(ix.slots[0].per_gen)).collect();
        ix.observe(&filler, 0);
        assert!(!ix.observe_is_noop(&keys, 0));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

        /// `record_of` finds a slot's record exactly where a binary search does, whatever the
        /// posting's share of the slots.
        #[test]
        fn record_of_finds_what_a_binary_search_finds(
            slots in proptest::collection::btree_set(0u32..300, 0..300),
            n in 1usize..400,
            probe in 0usize..400,
        ) {
            let recs: Vec<u32> = slots.iter().map(|&s| (s << SLOT_SHIFT) | GPU | (s % 7)).collect();
            let want = recs.binary_search_by_key(&(probe as u32), |&r| owner(r)).ok().map(|j| recs[j]);
            prop_assert_eq!(record_of(&recs, probe, n), want);
        }

        /// The credit of a posting (`credit`, which takes the uniform loop when all records carry
        /// the same flags) equals the per-record table loop (`credit_all`) bit for bit, from any
        /// starting sums: live and dead records, stale stamps, inactive slots, slots past the
        /// output, every flag combination, mixed or uniform.
        #[test]
        fn uniform_credit_equals_the_per_record_loop(
            slots in proptest::collection::btree_set(0u32..40, 0..40),
            flags in proptest::collection::vec(0u32..16, 40),
            uniform in proptest::option::of(1u32..16),
            stamps in proptest::collection::vec(0u32..40, 40),
            gens in proptest::collection::vec((any::<bool>(), 0u32..40), 36),
            start in proptest::collection::vec((0u32..100, 0u32..400), 36),
            k in 1u32..200,
        ) {
            let recs: Vec<u32> = slots.iter().enumerate().map(|(j, &slot)| {
                let f = uniform.unwrap_or(flags[j]).max(1);
                (slot << SLOT_SHIFT) | (f << FLAGS_SHIFT) | stamps[j]
            }).collect();
            let gens: Vec<u32> = gens.iter().map(|&(active, g)| g | if active { ACTIVE } else { 0 }).collect();
            let w = MatchWeights::new(&TierWeights { gpu: 1.0, cpu: 0.3, storage: 0.1 });
            let mut a = PrefixMatch::default();
            a.reset(34);
            for (m, &(b, wt)) in a.slots.iter_mut().zip(&start) {
                m.add(b, b / 2);
                m.weighted = f64::from(wt) * 0.37;
            }
            let mut b = a.clone();
            credit_all(&recs, &gens, &w, k, &mut a);
            credit(&recs, &gens, &w, k, &mut b);
            let figures = |m: &PrefixMatch| {
                m.slots().iter().map(|s| (s.blocks(), s.confirmed(), s.weighted().to_bits())).collect::<Vec<_>>()
            };
            prop_assert_eq!(figures(&a), figures(&b));
        }

        /// Invariants under random operation sequences: match results equal a naive computation
        /// from `contains`; live counts equal records found; capacity holds.
        #[test]
        fn invariants_hold(ops in proptest::collection::vec((0u8..17, 0usize..6, 1u64..40, 1usize..12), 1..300)) {
            let cap = 128;
            let mut ix: PrefixIndex = PrefixIndex::new(0, cap);
            let mut active = [false; 6];
            for (op, slot, start, len) in ops {
                match op {
                    0 => { if active[slot] { ix.retire(slot); active[slot] = false; } }
                    1 => { if !active[slot] { ix.activate(slot); active[slot] = true; } }
                    10 | 11 => {
                        let keys: Vec<u64> = (start..start + len as u64).collect();
                        ix.remove(&keys, slot, if op == 10 { Medium::Gpu } else { Medium::Cpu });
                    }
                    12 => { let keys: Vec<u64> = (start..start + len as u64).collect(); ix.store(&keys, slot, Medium::Cpu); }
                    13 => { ix.clear_slot(slot); }
                    14 | 15 => {
                        // Speculation on a chain, then (op 15) its withdrawal at the same tick.
                        let keys: Vec<u64> = (start..start + len as u64).collect();
                        let tick = (start as u32) % 7;
                        ix.speculate(&keys, slot, tick);
                        if op == 15 { ix.unspeculate(&keys, slot, tick); }
                    }
                    16 => { ix.collect_all(); }
                    _ => {
                        if !active[slot] { ix.activate(slot); active[slot] = true; }
                        let keys: Vec<u64> = (start..start + len as u64).collect();
                        ix.observe(&keys, slot);
                    }
                }
                let probe: Vec<u64> = (1..30).collect();
                let got = matches(&ix, &[&probe]);
                // Two sequences (sums over them), tier weights all distinct: blocks, weighted
                // blocks and confirmed blocks against a naive walk through `holding`.
                let (probe2, probe3): (Vec<u64>, Vec<u64>) = ((5..25).collect(), (start..start + 9).collect());
                let tiers = TierWeights { gpu: 1.0, cpu: 0.75, storage: 0.5 };
                let mut full = PrefixMatch::default();
                ix.match_blocks(&rk(&[&probe2, &probe3]), &MatchWeights::new(&tiers), &mut full, &mut MatchScratch::default());
                for (s, &is_active) in active.iter().enumerate() {
                    let naive = probe.iter().take_while(|&&k| ix.contains(k, s)).count() as u32;
                    prop_assert_eq!(got.get(s).copied().unwrap_or(0), naive);
                    let (mut blocks, mut weighted, mut confirmed) = (0u32, 0.0f64, 0u32);
                    for seq in [&probe2, &probe3] {
                        let mut spec_seen = false;
                        for h in seq.iter().map_while(|&k| ix.holding(k, s)) {
                            blocks += 1;
                            weighted += if h.gpu || h.speculative { tiers.gpu } else if h.cpu { tiers.cpu } else { tiers.storage };
                            spec_seen |= !(h.gpu || h.cpu || h.storage);
                            confirmed += u32::from(!spec_seen);
                        }
                    }
                    prop_assert_eq!(full.get(s).blocks(), blocks, "blocks of slot {}", s);
                    prop_assert!((full.get(s).weighted() - weighted).abs() < 1e-9, "weighted of slot {}: {:?} vs {}", s, full.get(s), weighted);
                    prop_assert_eq!(full.get(s).confirmed(), confirmed, "confirmed of slot {}", s);
                    prop_assert!(ix.memberships_of(s) <= cap);
                    prop_assert_eq!(u64::from(ix.memberships_of(s)), ix.live_records_in_table(s));
                    if !is_active { prop_assert_eq!(ix.memberships_of(s), 0); }
                }
                let live: u64 = (0..6).map(|s| u64::from(ix.memberships_of(s))).sum();
                let spec: u64 = ix.store.iter().map(|(_, recs)| recs.iter().filter(|&&r| r & TIERS == 0 && is_live(&ix.slots, r)).count() as u64).sum();
                prop_assert_eq!(ix.speculative_memberships(), spec, "speculative counts follow the records");
                prop_assert_eq!(ix.charged_memberships(), live + spec, "running totals follow the slots");
                ix.check_store();
                prop_assert_eq!(ix.budget_memberships(), u64::from(cap) * active.iter().filter(|&&a| a).count() as u64);
            }
        }

        /// The no-op checks never miss a change: whenever `observe_is_noop` (or
        /// `speculate_is_noop`) says so, the operation leaves everything observable as it was.
        #[test]
        fn noop_checks_are_exact(ops in proptest::collection::vec((0u8..17, 0usize..6, 1u64..40, 1usize..12), 1..300)) {
            let mut ix: PrefixIndex = PrefixIndex::new(0, 128);
            let mut active = [false; 6];
            for (op, slot, start, len) in ops {
                let keys: Vec<u64> = (start..start + len as u64).collect();
                match op {
                    0 => { if active[slot] { ix.retire(slot); active[slot] = false; } }
                    1 => { if !active[slot] { ix.activate(slot); active[slot] = true; } }
                    10 | 11 => ix.remove(&keys, slot, if op == 10 { Medium::Gpu } else { Medium::Cpu }),
                    12 => ix.store(&keys, slot, Medium::Cpu),
                    13 => ix.clear_slot(slot),
                    14 | 15 => {
                        let tick = (start as u32) % 7;
                        let noop = ix.speculate_is_noop(&keys, slot, tick);
                        let before = observable(&ix);
                        ix.speculate(&keys, slot, tick);
                        if noop { prop_assert_eq!(&observable(&ix), &before, "speculation said to be a no-op"); }
                        if op == 15 { ix.unspeculate(&keys, slot, tick); }
                    }
                    16 => ix.collect_all(),
                    _ => {
                        if !active[slot] { ix.activate(slot); active[slot] = true; }
                        // Half the observations repeat a chain observed before on the slot.
                        let keys: Vec<u64> = if op % 2 == 0 { (1..1 + len as u64).collect() } else { keys };
                        let noop = ix.observe_is_noop(&keys, slot);
                        let before = observable(&ix);
                        ix.observe(&keys, slot);
                        if noop { prop_assert_eq!(&observable(&ix), &before, "observation said to be a no-op"); }
                    }
                }
                ix.check_store();
            }
        }
    }
}
