//! The event-fed precise index: what each endpoint's engine reports it holds, per tier, with
//! speculative entries for requests just routed and per-publisher stream health.
//!
//! The module is private: its full description is the documentation of [`KvIndex`].

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use serde::Serialize;

use super::keys::content_key;
use super::DualKeyHashing;
use crate::approx::{BlockKey, RequestKeys};
use crate::config::{KeyScheme, PolicyConfig};
use crate::index::{IndexStats, MatchScratch, MatchWeights, PrefixIndex, PrefixMatch};
use crate::precise::events::{BlockStored, EventBatch, KvEvent, Medium};
use crate::precise::speculation::{SpecQueue, Speculation};
use crate::precise::stream::{batch_digest, StreamInfo, StreamTracker, StreamVerdict};

/// The expiry tick of a speculation (16 ms resolution, 15 bits: wraps after about 8.7 minutes,
/// far beyond any speculative TTL).
fn spec_tick(expires_ms: u64) -> u32 {
    ((expires_ms / 16) & 0x7fff) as u32
}

/// Bytes a speculative membership is charged against the byte budget: most are the only holder
/// of a new block (an 8-byte key and a 4-byte head in the store's arena, a 4-byte bucket at the
/// table's lowest load, 0.7: 17.7 bytes), and speculation withdrawn leaves free arena positions
/// until a compaction (up to a quarter of the arena) plus the arena's growth step: the nominal
/// 16 bytes of a confirmed membership (mostly sharing blocks) do not cover that.
const SPECULATIVE_BYTES_PER_MEMBERSHIP: u64 = 24;

/// Keys are already hashes: mix them once and use the result.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        let mut x = n ^ 0x9E37_79B9_7F4A_7C15;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        self.0 = x ^ (x >> 31);
    }
}

type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

/// Request keys of one engine block: one per index block it spans.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ReqKeys {
    One(u64),
    Many(Box<[u64]>),
}

impl ReqKeys {
    fn as_slice(&self) -> &[u64] {
        match self {
            ReqKeys::One(k) => std::slice::from_ref(k),
            ReqKeys::Many(v) => v,
        }
    }
    fn last(&self) -> u64 {
        *self.as_slice().last().unwrap_or(&0)
    }
}

/// One endpoint's engine key → request keys, bounded by two generations: when the current map reaches half the
/// capacity it becomes the previous one (the older previous one is dropped); a hit in the previous
/// map moves the entry forward. Memory stays below `capacity` entries; recently used engine blocks
/// are never forgotten first.
#[derive(Debug, Clone)]
struct EngineKeyMap {
    cur: KeyMap<ReqKeys>,
    prev: KeyMap<ReqKeys>,
    capacity: usize,
}

impl EngineKeyMap {
    fn new(capacity: usize) -> Self {
        EngineKeyMap { cur: KeyMap::default(), prev: KeyMap::default(), capacity }
    }

    fn get(&mut self, engine: u64) -> Option<&ReqKeys> {
        if !self.cur.contains_key(&engine) {
            let v = self.prev.remove(&engine)?;
            self.insert(engine, v);
        }
        self.cur.get(&engine)
    }

    fn insert(&mut self, engine: u64, keys: ReqKeys) {
        if self.cur.len() >= self.capacity / 2 && !self.cur.contains_key(&engine) {
            self.prev = std::mem::take(&mut self.cur);
        }
        self.cur.insert(engine, keys);
    }

    fn len(&self) -> usize {
        self.cur.len() + self.prev.len()
    }

    fn memory_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(u64, ReqKeys)>() + 1;
        (self.cur.capacity() + self.prev.capacity()) * entry
    }

    fn clear(&mut self) {
        self.cur = KeyMap::default();
        self.prev = KeyMap::default();
    }
}

/// Withdraw one speculation's memberships, unless its slot was given to another endpoint since.
fn withdraw(blocks: &mut PrefixIndex, epochs: &[u32], s: &Speculation) {
    if epochs.get(s.slot as usize).copied().unwrap_or(0) == s.epoch {
        blocks.unspeculate(&s.keys, s.slot as usize, s.tick);
    }
}

/// `slot`'s engine-key map (created on first use).
fn slot_map(maps: &mut Vec<EngineKeyMap>, slot: usize, capacity: usize) -> &mut EngineKeyMap {
    if maps.len() <= slot {
        maps.resize_with(slot + 1, || EngineKeyMap::new(capacity));
    }
    &mut maps[slot]
}

/// What applying a batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ApplyOutcome {
    /// The stream verdict (only `Applied` and `Reset` change the index).
    pub verdict: StreamVerdict,
    /// Events applied.
    pub events: u32,
    /// Blocks stored or removed.
    pub blocks: u64,
}

/// Counters and sizes of the precise index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PreciseStats {
    /// The block store.
    pub index: IndexStats,
    /// Engine blocks in the engine-key → request-key maps (one per endpoint).
    pub mapped_engine_blocks: u64,
    /// Heap bytes of those maps.
    pub map_memory_bytes: u64,
    /// Heap bytes of the speculation records (the deadline wheel, the records and their keys;
    /// the speculative memberships themselves are in `index.memory_bytes`).
    pub speculation_memory_bytes: u64,
    /// Speculations withdrawn before their deadline to keep the index within its byte budget.
    pub speculation_evictions: u64,
    /// Batches applied.
    pub batches: u64,
    /// Blocks stored.
    pub blocks_stored: u64,
    /// Blocks removed.
    pub blocks_removed: u64,
    /// Stored blocks that could not be indexed because their parent was unknown.
    pub orphan_blocks: u64,
    /// Stored events skipped because their block size is not a multiple of the index block size
    /// or their token ids do not cover their blocks.
    pub malformed_events: u64,
    /// Duplicate batches ignored.
    pub duplicates: u64,
    /// Gaps detected.
    pub gaps: u64,
    /// Publisher restarts detected.
    pub resets: u64,
    /// Streams resynchronized after an unrecoverable gap.
    pub resyncs: u64,
    /// Batches applied whose publisher timestamp was not kept (not finite, negative or above
    /// [`MAX_PUBLISHER_TS_S`](super::MAX_PUBLISHER_TS_S)).
    pub bad_timestamps: u64,
    /// Speculations (routed requests) not yet expired.
    pub speculative_requests: u64,
    /// Speculative (block, endpoint) memberships not yet expired.
    pub speculative_blocks: u64,
    /// Replays the subscriber completed.
    pub replays: u64,
    /// Replays that failed (unavailable, timed out, too old).
    pub replay_failures: u64,
    /// Copies of the index held: 1 in a `RouterCore` on its own, 2 in a `Router` (lookups read
    /// one while events are written into the other; see the README's "Threads"). The sizes
    /// above are one copy's; [`PreciseStats::memory_bytes`] counts every copy.
    pub copies: u64,
}

impl PreciseStats {
    /// Heap bytes of the whole precise index (block store, engine-key maps and speculation),
    /// every copy held.
    pub fn memory_bytes(&self) -> u64 {
        (self.index.memory_bytes + self.map_memory_bytes + self.speculation_memory_bytes) * self.copies.max(1)
    }
}

/// The precise index (see the module docs). Slots are the endpoint table's.
///
/// ---
///
/// The event-fed precise index: what each endpoint's engine reports it holds, per tier, with
/// speculative entries for requests just routed and per-publisher stream health.
///
/// # Keys
/// With dual keys (`index.precise.keys = "dual"`), the index stores the router's own request keys
/// ([`DualKeyHashing`]). A `BlockStored` event carries the token ids of its blocks and the hash of
/// their parent block: the router looks the parent up in its engine-key → request-key map (a
/// chain starting at the root uses the root key of the event's LoRA adapter), computes the request
/// keys of the stored blocks by chaining over their token ids, stores them and remembers
/// engine key → request keys. `BlockRemoved` maps engine keys back to request keys the same way.
///
/// **Blocks the router cannot key from token ids.** A block whose extra keys carry values the
/// router cannot compute — vLLM's multimodal `(mm_hash, offset)` pairs, prompt-embeds digests
/// (see [`BlockStored::content_keys`]) — gets, for its first index block, a key moved off the
/// text chain (a fixed-seed mix of the text key and the content fingerprint); its other index
/// blocks and every later block chain from it. A request of the same token ids (placeholder
/// tokens included) therefore matches up to the block before the image and never past it. The
/// cache_salt and LoRA name, which the router knows, stay in the chain's root.
///
/// **Engine keys already mapped** are reused rather than recomputed by offload-tier (CPU,
/// storage) stores: the engine's hash covers tokens, parent and every extra key, so a known
/// engine key names the same content. This keeps blocks that an offloading connector
/// re-announces without their extra keys (vLLM 0.33's offloading events carry none) keyed as
/// the GPU event first reported them. (GPU events carry their extra keys and are recomputed,
/// which spares the hot path a map probe per block.) A hash-only
/// store (`token_ids` empty, e.g. the offloading connector's placeholder events) is placed
/// entirely through the map; hashes the map does not know are counted as orphans. (Without
/// self-describing events such a placeholder names only the last block of an offloaded chunk,
/// so a chunk's earlier blocks are not seen on the offload tier: a match there stops short,
/// never runs long.)
///
/// **Lookahead** (vLLM `num_hash_lookahead_tokens` = L): the engine's block hash also covers the
/// L tokens after the block, which are the next block's first tokens, so the dual chain already
/// depends on them from the next block on; only the last matched block of a request that
/// diverges within those L tokens can be credited without being servable (at most one block).
///
/// **Repeated stores.** A GPU re-store (vLLM `kv_cache_report_mode="full"` re-emits
/// `BlockStored` for prefix hits) is a touch; offload-tier stores are reference-counted per
/// (block, endpoint, tier) by the block store (see [`PrefixIndex`](crate::PrefixIndex)), so a hash announced twice
/// on CPU needs two removals.
///
/// With engine keys (`index.precise.keys = "engine"`) the event's hashes are the index keys. A
/// request never has multimodal hashes, so no text request reproduces an image block's key or
/// any key chained after it: nothing is claimed past such a block.
///
/// Unknown parents: a `BlockStored` whose parent engine key is not in the map (the subscriber
/// joined after the parent was stored, or the map forgot it) cannot be placed in the chain, so
/// its blocks are not indexed and are counted in [`PreciseStats::orphan_blocks`]. Nothing wrong is
/// indexed; the blocks become known when the engine stores them again (vLLM ≥ 0.33 re-emits
/// `BlockStored` for prefix-cache hits) or when a replay from the start of its buffer is applied.
/// A `BlockRemoved` for an unknown engine key is ignored.
///
/// # Speculation
/// Routing a request inserts speculative memberships for its blocks on the chosen endpoint(s);
/// they count as GPU-resident until the engine confirms them with `BlockStored` (which clears the
/// flag) or `index.speculative_ttl_ms` passes (they are then withdrawn), driven by `now`.
///
/// # Stream health
/// Each endpoint's publisher numbers its batches; the index keeps one [`StreamTracker`] per
/// endpoint to judge them (see [`StreamVerdict`] for the rules). An unrecoverable gap clears the endpoint and marks it stale for
/// `index.precise.stale_recovery_ms`, during which hybrid routing uses the approximate index for
/// it. A sequence number that goes back without repeating a recently applied batch is a
/// restarted publisher: the endpoint is cleared at once, and when the batch is not the new
/// process's first (seq > 0), the stream reports a gap from 0 and stays unhealthy until replay
/// or a resync brings it back. Publisher timestamps are informational only (the lag gauge).
pub struct KvIndex {
    blocks: PrefixIndex,
    scheme: KeyScheme,
    hashing: DualKeyHashing,
    engine_block_tokens: u32,
    /// Engine-key maps per endpoint slot: one publisher's blocks never evict another's.
    maps: Vec<EngineKeyMap>,
    /// Engine blocks each slot's map remembers (`index.precise.key_map_capacity`).
    map_capacity: usize,
    speculation: SpecQueue,
    /// Per slot, bumped when the slot is activated or retired (a speculation made for an earlier
    /// holder withdraws nothing).
    epochs: Vec<u32>,
    /// Per slot, the judgment of its publisher's stream.
    streams: Vec<StreamTracker>,
    stats: PreciseStats,
    scratch_keys: Vec<BlockKey>,
    scratch_bytes: Vec<u8>,
}

impl std::fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndex").field("stats", &self.stats()).finish_non_exhaustive()
    }
}

impl KvIndex {
    /// An empty index configured by `cfg` (`index.precise`).
    pub fn new(cfg: &PolicyConfig, fingerprint: u64, capacity: u32) -> Self {
        let p = &cfg.index.precise;
        let mut blocks = PrefixIndex::new(fingerprint, capacity);
        crate::index::reserve_as_configured(&mut blocks, p.reserve_blocks);
        KvIndex {
            blocks,
            scheme: p.keys,
            hashing: DualKeyHashing { block_tokens: p.index_block_tokens },
            engine_block_tokens: p.engine_block_tokens,
            maps: Vec::new(),
            map_capacity: p.key_map_capacity,
            speculation: SpecQueue::new(cfg.index.speculative_ttl_ms),
            epochs: Vec::new(),
            streams: Vec::new(),
            stats: PreciseStats::default(),
            scratch_keys: Vec::new(),
            scratch_bytes: Vec::new(),
        }
    }

    /// A copy of the index, sharing the speculation's clock with it (the second copy a
    /// `Router` keeps: see `router/kv_cell.rs`). Deterministic methods applied to both in the
    /// same order keep them equal.
    pub(crate) fn twin(&self) -> KvIndex {
        KvIndex {
            blocks: self.blocks.twin(),
            scheme: self.scheme,
            hashing: self.hashing,
            engine_block_tokens: self.engine_block_tokens,
            maps: crate::index::clone_with_capacity(&self.maps),
            map_capacity: self.map_capacity,
            speculation: self.speculation.twin(),
            epochs: crate::index::clone_with_capacity(&self.epochs),
            streams: crate::index::clone_with_capacity(&self.streams),
            stats: self.stats,
            scratch_keys: Vec::new(),
            scratch_bytes: Vec::new(),
        }
    }

    /// The key-parameter fingerprint the stored keys were made under.
    pub fn fingerprint(&self) -> u64 {
        self.blocks.fingerprint()
    }

    /// Adopt new key parameters (see `Router::reload`): everything is forgotten.
    pub fn reconfigure(&mut self, cfg: &PolicyConfig, fingerprint: u64) {
        let p = &cfg.index.precise;
        self.blocks.reset(fingerprint);
        self.scheme = p.keys;
        self.hashing = DualKeyHashing { block_tokens: p.index_block_tokens };
        self.engine_block_tokens = p.engine_block_tokens;
        self.maps.clear();
        self.map_capacity = p.key_map_capacity;
        self.speculation.clear();
        self.speculation.set_ttl(cfg.index.speculative_ttl_ms);
        for s in &mut self.streams {
            *s = StreamTracker::new();
        }
    }

    /// Keep room for `blocks` distinct blocks from now on ([`PrefixIndex::reserve`]).
    pub fn reserve(&mut self, blocks: usize) -> Result<(), std::collections::TryReserveError> {
        self.blocks.reserve(blocks)
    }

    /// The reservation `index.precise.reserve_blocks` asks for (see
    /// `crate::index::reserve_as_configured`).
    pub(crate) fn reserve_as_configured(&mut self, blocks: u64) {
        crate::index::reserve_as_configured(&mut self.blocks, blocks);
    }

    /// Change the per-endpoint capacity and the per-endpoint map capacity.
    pub fn set_capacity(&mut self, capacity: u32, key_map_capacity: usize) {
        self.blocks.set_capacity(capacity);
        self.map_capacity = key_map_capacity;
        for m in &mut self.maps {
            m.capacity = key_map_capacity;
        }
        self.bound_speculation();
    }

    /// Change the speculative TTL (`index.speculative_ttl_ms`): a shorter one holds the pending
    /// speculation to the latest `now` seen plus the new TTL.
    pub fn set_speculative_ttl(&mut self, ttl_ms: u64) {
        self.speculation.set_ttl(ttl_ms);
    }

    /// The request-key hashing.
    pub fn hashing(&self) -> DualKeyHashing {
        self.hashing
    }

    pub(crate) fn slot_reusable(&self, slot: usize) -> bool {
        self.blocks.slot_reusable(slot)
    }

    pub(crate) fn activate(&mut self, slot: usize) {
        self.blocks.activate(slot);
        self.bump_epoch(slot);
        if let Some(m) = self.maps.get_mut(slot) {
            m.clear();
        }
        *self.stream_mut(slot) = StreamTracker::new();
    }

    pub(crate) fn retire(&mut self, slot: usize) {
        self.blocks.retire(slot);
        self.bump_epoch(slot);
        if let Some(m) = self.maps.get_mut(slot) {
            m.clear();
        }
        if let Some(s) = self.streams.get_mut(slot) {
            *s = StreamTracker::new();
        }
    }

    fn bump_epoch(&mut self, slot: usize) {
        if self.epochs.len() <= slot {
            self.epochs.resize(slot + 1, 0);
        }
        self.epochs[slot] = self.epochs[slot].wrapping_add(1);
    }

    /// Whether routing may trust this endpoint's precise entries: it has delivered events, is
    /// not recovering from an unrecoverable gap, and is not waiting for a restarted publisher's
    /// first batches.
    pub fn healthy(&self, slot: usize, now_ms: u64) -> bool {
        self.streams.get(slot).is_some_and(|s| s.healthy(now_ms))
    }

    /// The event-stream state of `slot`.
    pub fn stream_info(&self, slot: usize, now_ms: u64) -> StreamInfo {
        self.streams.get(slot).map_or_else(|| StreamTracker::new().info(now_ms), |s| s.info(now_ms))
    }

    /// `slot`'s stream (created on first use).
    fn stream_mut(&mut self, slot: usize) -> &mut StreamTracker {
        if self.streams.len() <= slot {
            self.streams.resize_with(slot + 1, StreamTracker::new);
        }
        &mut self.streams[slot]
    }

    /// Count a replay attempt by the event subscriber.
    pub fn record_replay(&mut self, ok: bool) {
        if ok {
            self.stats.replays += 1;
        } else {
            self.stats.replay_failures += 1;
        }
    }

    /// Judge and (when in order) apply one decoded batch from `slot`'s publisher, received at
    /// router time `now_ms`.
    pub fn apply_at(&mut self, slot: usize, batch: &EventBatch, seq: Option<u64>, now_ms: u64) -> ApplyOutcome {
        self.judge_and_apply(slot, batch, seq, Some(now_ms))
    }

    /// Judge and (when in order) apply one decoded batch from `slot`'s publisher (see
    /// [`StreamVerdict`]).
    pub fn apply(&mut self, slot: usize, batch: &EventBatch, seq: Option<u64>) -> ApplyOutcome {
        self.judge_and_apply(slot, batch, seq, None)
    }

    fn judge_and_apply(
        &mut self,
        slot: usize,
        batch: &EventBatch,
        seq: Option<u64>,
        now_ms: Option<u64>,
    ) -> ApplyOutcome {
        // Unnumbered batches are never compared: no digest needed.
        let digest = seq.map_or(0, |_| batch_digest(batch));
        let judged = self.stream_mut(slot).judge(seq, digest);
        if judged.restarted {
            // A new incarnation of the publisher: nothing the old one reported holds.
            self.stats.resets += 1;
            self.blocks.clear_slot(slot);
        }
        let verdict = judged.verdict;
        match verdict {
            StreamVerdict::Duplicate => {
                self.stats.duplicates += 1;
                return ApplyOutcome { verdict, events: 0, blocks: 0 };
            }
            StreamVerdict::Gap { .. } => {
                self.stats.gaps += 1;
                return ApplyOutcome { verdict, events: 0, blocks: 0 };
            }
            StreamVerdict::Reset | StreamVerdict::Applied => {}
        }
        // The latest batch's timestamp and when it was applied (for the lag gauge).
        if !self.stream_mut(slot).note_applied(batch.ts, now_ms) {
            self.stats.bad_timestamps += 1;
        }
        let mut blocks = 0u64;
        for ev in &batch.events {
            blocks += self.apply_event(slot, ev);
        }
        self.stats.batches += 1;
        ApplyOutcome { verdict, events: batch.events.len() as u32, blocks }
    }

    fn apply_event(&mut self, slot: usize, ev: &KvEvent) -> u64 {
        match (ev, self.scheme) {
            (KvEvent::BlockStored(s), KeyScheme::Engine) => {
                // Engine keys are the index keys.
                self.blocks.store(&s.block_hashes, slot, s.medium);
                self.stats.blocks_stored += s.block_hashes.len() as u64;
                s.block_hashes.len() as u64
            }
            (KvEvent::BlockRemoved(r), KeyScheme::Engine) => {
                self.blocks.remove(&r.block_hashes, slot, r.medium);
                self.stats.blocks_removed += r.block_hashes.len() as u64;
                r.block_hashes.len() as u64
            }
            (KvEvent::BlockStored(s), KeyScheme::Dual) => self.store_dual(slot, s),
            (KvEvent::BlockRemoved(r), KeyScheme::Dual) => {
                self.scratch_keys.clear();
                let map = slot_map(&mut self.maps, slot, self.map_capacity);
                for &engine in &r.block_hashes {
                    if let Some(keys) = map.get(engine) {
                        self.scratch_keys.extend_from_slice(keys.as_slice());
                    }
                }
                self.blocks.remove(&self.scratch_keys, slot, r.medium);
                self.stats.blocks_removed += r.block_hashes.len() as u64;
                r.block_hashes.len() as u64
            }
            (KvEvent::AllBlocksCleared, _) => {
                self.blocks.clear_slot(slot);
                0
            }
        }
    }

    /// A `BlockStored` under dual keys (see the module docs, "Keys").
    fn store_dual(&mut self, slot: usize, s: &BlockStored) -> u64 {
        let n = s.block_hashes.len();
        self.scratch_keys.clear();
        if s.token_ids.is_empty() && n > 0 {
            // Hash-only announcement (an offloading connector re-announcing blocks: no token
            // ids, no parent): only blocks whose engine key is already mapped can be placed.
            let mut placed = 0u64;
            let map = slot_map(&mut self.maps, slot, self.map_capacity);
            for &engine in &s.block_hashes {
                match map.get(engine) {
                    Some(keys) => {
                        self.scratch_keys.extend_from_slice(keys.as_slice());
                        placed += 1;
                    }
                    None => self.stats.orphan_blocks += 1,
                }
            }
            self.blocks.store(&self.scratch_keys, slot, s.medium);
            self.stats.blocks_stored += placed;
            return placed;
        }
        let bs = s.block_size as usize;
        let ib = self.hashing.block_tokens as usize;
        if bs == 0 || bs % ib != 0 || s.token_ids.len() < n * bs {
            self.stats.malformed_events += 1;
            return 0;
        }
        let mut parent = match s.parent_block_hash {
            None => DualKeyHashing::root(s.lora_name.as_deref(), s.cache_salt.as_deref()),
            Some(p) => match slot_map(&mut self.maps, slot, self.map_capacity).get(p) {
                Some(keys) => keys.last(),
                None => {
                    self.stats.orphan_blocks += n as u64;
                    return 0;
                }
            },
        };
        if s.medium == Medium::Gpu {
            for (i, &engine) in s.block_hashes.iter().enumerate() {
                let start = self.scratch_keys.len();
                parent = self.key_block(parent, &s.token_ids[i * bs..(i + 1) * bs], s.content_keys.get(i).copied());
                self.remember(slot, engine, start);
            }
        } else {
            self.key_offload_blocks(slot, s, parent);
        }
        self.blocks.store(&self.scratch_keys, slot, s.medium);
        self.stats.blocks_stored += n as u64;
        n as u64
    }

    /// The blocks of an offload-tier (CPU, storage) store, keyed into `scratch_keys`. Engine keys
    /// already mapped keep their request keys: the engine's hash covers tokens, parent and every
    /// extra key, so a known engine key names the same content, and vLLM's offloading events
    /// carry no extra keys (a multimodal block would otherwise be re-keyed as text). Kept out of
    /// line: GPU events carry their extra keys and are recomputed without a map probe per block.
    #[inline(never)]
    fn key_offload_blocks(&mut self, slot: usize, s: &BlockStored, mut parent: u64) {
        let bs = s.block_size as usize;
        for (i, &engine) in s.block_hashes.iter().enumerate() {
            if let Some(keys) = slot_map(&mut self.maps, slot, self.map_capacity).get(engine) {
                self.scratch_keys.extend_from_slice(keys.as_slice());
                parent = keys.last();
                continue;
            }
            let start = self.scratch_keys.len();
            parent = self.key_block(parent, &s.token_ids[i * bs..(i + 1) * bs], s.content_keys.get(i).copied());
            self.remember(slot, engine, start);
        }
    }

    /// Append the request keys of one engine block (`tokens`, chained from `parent`) to
    /// `scratch_keys`; returns the last. `content` (see [`BlockStored::content_keys`]): extra keys
    /// the router cannot compute move the block's first index key off the text chain, so it and
    /// every key chained from it differ from what a request of the same token ids computes.
    #[inline]
    fn key_block(&mut self, parent: u64, tokens: &[u32], content: Option<u64>) -> u64 {
        match content {
            None | Some(0) => self.hashing.chain(parent, tokens, &mut self.scratch_keys, &mut self.scratch_bytes),
            Some(content) => {
                let ib = self.hashing.block_tokens as usize;
                let (head, tail) = tokens.split_at(ib.min(tokens.len()));
                let first = self.hashing.chain(parent, head, &mut self.scratch_keys, &mut self.scratch_bytes);
                let moved = content_key(first, content);
                if let Some(k) = self.scratch_keys.last_mut() {
                    *k = moved;
                }
                self.hashing.chain(moved, tail, &mut self.scratch_keys, &mut self.scratch_bytes)
            }
        }
    }

    /// Map `engine` to the request keys appended to `scratch_keys` since `start`, in `slot`'s map.
    #[inline]
    fn remember(&mut self, slot: usize, engine: u64, start: usize) {
        let keys = &self.scratch_keys[start..];
        let entry = if keys.len() == 1 { ReqKeys::One(keys[0]) } else { ReqKeys::Many(keys.into()) };
        slot_map(&mut self.maps, slot, self.map_capacity).insert(engine, entry);
    }

    /// Give up on a gapped stream: drop the endpoint's entries, forget its sequence (the next batch
    /// is accepted as a fresh start) and treat it as stale until `now + stale_recovery_ms`.
    pub fn resync(&mut self, slot: usize, now_ms: u64, stale_recovery_ms: u64) {
        self.blocks.clear_slot(slot);
        self.stream_mut(slot).resync(now_ms, stale_recovery_ms);
        self.stats.resyncs += 1;
    }

    /// Insert speculative entries for a routed request on `slot` at `now_ms` (withdrawn at
    /// `expires_ms`, held to `now_ms + index.speculative_ttl_ms`, unless confirmed before, or kept
    /// longer by a later speculation on the same blocks: each speculative membership carries the
    /// expiry tick of its latest speculation).
    #[cfg(test)]
    pub(crate) fn speculate(&mut self, keys: &RequestKeys, slot: usize, expires_ms: u64, now_ms: u64) {
        self.speculate_from(&keys.keys, 0, slot, expires_ms, now_ms);
    }

    /// [`KvIndex::speculate`] for the keys from position `skip` on (the leading ones are already
    /// held in a tier). Speculation past the byte budget withdraws the soonest-expiring first.
    pub(crate) fn speculate_from(&mut self, keys: &[BlockKey], skip: usize, slot: usize, expires_ms: u64, now_ms: u64) {
        let Some(keys) = keys.get(skip..).filter(|k| !k.is_empty()) else { return };
        let Ok(slot32) = u32::try_from(slot) else { return };
        self.advance_speculation(now_ms);
        let deadline_ms = self.speculation.deadline(expires_ms, now_ms);
        if deadline_ms <= now_ms || self.speculation_holds(keys, slot, deadline_ms) {
            return;
        }
        let tick = spec_tick(deadline_ms);
        self.blocks.speculate(keys, slot, tick);
        let epoch = self.epochs.get(slot).copied().unwrap_or(0);
        self.speculation.insert(Speculation { deadline_ms, tick, slot: slot32, epoch, keys: keys.into() });
        self.bound_speculation();
    }

    /// Whether every block of `keys` is held by `slot` in a tier, or speculatively until within
    /// [`SpecQueue::refresh_after_ms`] of `deadline_ms` or later: then routing them there again
    /// changes nothing. A prompt routed again and again to where it is speculated extends its
    /// speculation once a quarter TTL has passed, not on every request (batched speculation
    /// writes: a repeated prompt's decisions leave the index alone, so a shared `Router` books
    /// them under its shared lock); its blocks stay speculated for at least three quarters of
    /// the TTL after the last routing, and at most the TTL.
    fn speculation_holds(&self, keys: &[BlockKey], slot: usize, deadline_ms: u64) -> bool {
        let enough = deadline_ms.saturating_sub(self.speculation.refresh_after_ms());
        self.blocks.speculate_is_noop(keys, slot, spec_tick(enough))
    }

    /// Whether [`KvIndex::speculate_from`] with these arguments would change nothing, once
    /// [`KvIndex::expire`] at `now_ms` is done (the same test it makes before it writes: every
    /// block from `skip` on is held by `slot` long enough, see `speculation_holds`).
    pub(crate) fn speculation_is_noop(
        &self,
        keys: &[BlockKey],
        skip: usize,
        slot: usize,
        expires_ms: u64,
        now_ms: u64,
    ) -> bool {
        let Some(keys) = keys.get(skip..).filter(|k| !k.is_empty()) else { return true };
        if u32::try_from(slot).is_err() {
            return true;
        }
        let deadline_ms = self.speculation.deadline(expires_ms, now_ms);
        deadline_ms <= now_ms || self.speculation_holds(keys, slot, deadline_ms)
    }

    /// Observe `now_ms` under shared access, where [`KvIndex::expiry_due`] at it is false: the
    /// speculation's clock moves, as [`KvIndex::expire`] would move it, and nothing else would.
    pub(crate) fn observe_clock(&self, now_ms: u64) {
        self.speculation.observe(now_ms);
    }

    /// Whether any speculation is held (then its expiry may come due).
    pub(crate) fn has_speculation(&self) -> bool {
        self.speculation.len() > 0
    }

    /// The speculation's clock (shared with the index's twin), for
    /// [`observe_clock`](KvIndex::observe_clock) without the index.
    pub(crate) fn speculation_clock(&self) -> crate::precise::speculation::SpecClock {
        self.speculation.clock()
    }

    /// The latest `now` the speculation has seen (a replicated effect's expiry is held to it
    /// plus the TTL).
    pub(crate) fn speculation_now(&self) -> Option<u64> {
        self.speculation.now_ms()
    }

    fn advance_speculation(&mut self, now_ms: u64) {
        let (blocks, epochs) = (&mut self.blocks, &self.epochs);
        self.speculation.advance(now_ms, |s| withdraw(blocks, epochs, &s));
    }

    /// Withdraw the soonest-expiring speculation while the index is over its byte budget: the
    /// endpoints' budgets together, charged [`crate::config::NOMINAL_BYTES_PER_MEMBERSHIP`] per
    /// live membership, [`SPECULATIVE_BYTES_PER_MEMBERSHIP`] per speculative one, plus the
    /// speculation records' own bytes. Speculation thus uses what the engines' blocks leave of
    /// the budget.
    fn bound_speculation(&mut self) {
        let nominal = crate::config::NOMINAL_BYTES_PER_MEMBERSHIP;
        let budget = self.blocks.budget_memberships().saturating_mul(nominal);
        while self.speculation.len() > 0 {
            let spec = self.blocks.speculative_memberships();
            let live = self.blocks.charged_memberships() - spec;
            let used = live.saturating_mul(nominal)
                + spec.saturating_mul(SPECULATIVE_BYTES_PER_MEMBERSHIP)
                + self.speculation.memory_bytes() as u64;
            if used <= budget {
                break;
            }
            let Some(s) = self.speculation.pop_soonest() else { break };
            withdraw(&mut self.blocks, &self.epochs, &s);
            self.stats.speculation_evictions += 1;
        }
    }

    /// Withdraw speculation whose time has come (every record whose deadline has passed, in
    /// whatever order they were made; see [`crate::precise::speculation`]); a speculation whose slot
    /// changed hands since is dropped without touching the new holder's entries.
    pub(crate) fn expire(&mut self, now_ms: u64) {
        self.advance_speculation(now_ms);
    }

    /// Whether [`KvIndex::expire`] at `now_ms` would change what a lookup sees (speculation to
    /// withdraw or hold back).
    pub(crate) fn expiry_due(&self, now_ms: u64) -> bool {
        self.speculation.due(now_ms)
    }

    /// Longest held prefix per slot.
    pub fn match_blocks(
        &self,
        keys: &RequestKeys,
        weights: &MatchWeights,
        out: &mut PrefixMatch,
        scratch: &mut MatchScratch,
    ) {
        self.blocks.match_blocks(keys, weights, out, scratch);
    }

    /// The underlying block store (diagnostics and tests).
    pub fn blocks(&self) -> &PrefixIndex {
        &self.blocks
    }

    /// Counters and sizes.
    pub fn stats(&self) -> PreciseStats {
        PreciseStats {
            index: self.blocks.stats(),
            mapped_engine_blocks: self.maps.iter().map(|m| m.len() as u64).sum(),
            map_memory_bytes: (self.maps.iter().map(EngineKeyMap::memory_bytes).sum::<usize>()
                + self.maps.capacity() * std::mem::size_of::<EngineKeyMap>()) as u64,
            speculation_memory_bytes: self.speculation.memory_bytes() as u64,
            speculative_requests: self.speculation.len() as u64,
            speculative_blocks: self.blocks.speculative_memberships(),
            copies: 1,
            ..self.stats
        }
    }

    /// Forget the engine-key map (tests).
    #[cfg(test)]
    fn forget_map(&mut self) {
        self.maps.iter_mut().for_each(EngineKeyMap::clear);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TierWeights;
    use crate::precise::events::{BlockRemoved, BlockStored, Medium};
    use crate::precise::PreciseKeys;

    fn index() -> KvIndex {
        let cfg = PolicyConfig::default();
        let mut ix = KvIndex::new(&cfg, 0, 1 << 14);
        ix.activate(0);
        ix.activate(1);
        ix
    }

    /// An index of 16-token blocks fed by engines with 64-token blocks; slot 0 active.
    fn index_64_over_16() -> KvIndex {
        let mut cfg = PolicyConfig::default();
        cfg.index.precise.engine_block_tokens = 64;
        cfg.index.precise.index_block_tokens = 16;
        let mut ix = KvIndex::new(&cfg, 0, 1 << 14);
        ix.activate(0);
        ix
    }

    fn stored(hashes: &[u64], parent: Option<u64>, first_token: u32, medium: Medium) -> KvEvent {
        let n = hashes.len() as u32;
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: (first_token..first_token + 16 * n).collect(),
            block_size: 16,
            lora_id: None,
            medium,
            lora_name: None,
            group_idx: None,
            cache_salt: None,
            ..Default::default()
        })
    }

    fn batch(ts: f64, events: Vec<KvEvent>) -> EventBatch {
        EventBatch { ts, events, data_parallel_rank: None }
    }

    fn request_keys(ix: &KvIndex, tokens: std::ops::Range<u32>) -> RequestKeys {
        let mut r = crate::request::RouteRequest::text("m", "");
        r.prompts = vec![crate::request::Prompt::Tokens(tokens.collect())];
        let mut k = RequestKeys::default();
        assert!(ix.hashing().request_keys(&r, &mut k));
        k
    }

    #[test]
    fn token_keys_end_at_the_key_limit_and_count_the_rest() {
        let pk = PreciseKeys::from_config(&PolicyConfig::default().index.precise);
        let mut r = crate::request::RouteRequest::text("m", "");
        r.prompts = vec![crate::request::Prompt::Tokens((0..100).collect())];
        let bt = pk.block_tokens() as usize;
        let mut full = RequestKeys::default();
        assert!(pk.request_keys(&r, &mut full, &mut Vec::new()));
        assert_eq!((full.keys.len(), full.unkeyed_blocks), (100 / bt, 0));
        // A limit inside the sequence: keys stop there, and the ids past it (plus the cut
        // block's partial ids) count in the hit denominator, so it is never a full hit.
        r.key_limit =
            Some(crate::request::KeyLimit { prompt: 0, keyed_len: 2 * bt + 3, message: None, media_parts: 0 });
        let mut cut = RequestKeys::default();
        assert!(pk.request_keys(&r, &mut cut, &mut Vec::new()));
        assert_eq!(cut.keys[..], full.keys[..2], "the same chain up to the limit");
        let unkeyed = (100 - (2 * bt + 3)) + 3;
        assert_eq!(cut.unkeyed_blocks as usize, unkeyed.div_ceil(bt));
        // Reused buffers start clean.
        r.key_limit = None;
        assert!(pk.request_keys(&r, &mut cut, &mut Vec::new()));
        assert_eq!((cut.keys.len(), cut.unkeyed_blocks), (100 / bt, 0));
    }

    fn matched(ix: &KvIndex, keys: &RequestKeys) -> Vec<u32> {
        let mut out = PrefixMatch::default();
        ix.match_blocks(keys, &MatchWeights::new(&TierWeights::default()), &mut out, &mut MatchScratch::default());
        out.blocks()
    }

    #[test]
    fn stored_chains_are_found_by_request_keys() {
        let mut ix = index();
        // Two events: blocks 0..2 from the root, then 2..4 continuing from engine hash 102.
        ix.apply(0, &batch(1.0, vec![stored(&[101, 102], None, 0, Medium::Gpu)]), Some(0));
        ix.apply(0, &batch(2.0, vec![stored(&[103, 104], Some(102), 32, Medium::Gpu)]), Some(1));
        let k = request_keys(&ix, 0..80);
        assert_eq!(k.keys.len(), 5);
        assert_eq!(matched(&ix, &k), vec![4, 0]);
        // Removal through the engine keys.
        ix.apply(
            0,
            &batch(
                3.0,
                vec![KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![103],
                    medium: Medium::Gpu,
                    group_idx: None,
                    ..Default::default()
                })],
            ),
            Some(2),
        );
        assert_eq!(matched(&ix, &k), vec![2, 0]);
        let s = ix.stats();
        assert_eq!((s.blocks_stored, s.blocks_removed, s.orphan_blocks), (4, 1, 0));
    }

    #[test]
    fn unknown_parents_are_orphans_not_guesses() {
        let mut ix = index();
        ix.apply(0, &batch(1.0, vec![stored(&[201], Some(999), 0, Medium::Gpu)]), None);
        assert_eq!(ix.stats().orphan_blocks, 1);
        assert_eq!(ix.blocks().stats().memberships, 0);
        // Once the map forgets a parent, its children are orphans too.
        ix.apply(0, &batch(2.0, vec![stored(&[101], None, 0, Medium::Gpu)]), None);
        ix.forget_map();
        ix.apply(0, &batch(3.0, vec![stored(&[102], Some(101), 16, Medium::Gpu)]), None);
        assert_eq!(ix.stats().orphan_blocks, 2);
    }

    #[test]
    fn engine_blocks_larger_than_index_blocks() {
        let mut ix = index_64_over_16();
        let ev = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![7, 8],
            parent_block_hash: None,
            token_ids: (0..128).collect(),
            block_size: 64,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            group_idx: None,
            cache_salt: None,
            ..Default::default()
        });
        ix.apply(0, &batch(1.0, vec![ev]), None);
        let k = request_keys(&ix, 0..130);
        assert_eq!(k.keys.len(), 8);
        assert_eq!(matched(&ix, &k), vec![8]);
        ix.apply(
            0,
            &batch(
                2.0,
                vec![KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![8],
                    medium: Medium::Gpu,
                    group_idx: None,
                    ..Default::default()
                })],
            ),
            None,
        );
        assert_eq!(matched(&ix, &k), vec![4], "removing one engine block removes its four index blocks");
        // A block size that is not a multiple of the index block is skipped and counted.
        let odd = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![9],
            parent_block_hash: None,
            token_ids: (0..24).collect(),
            block_size: 24,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            group_idx: None,
            cache_salt: None,
            ..Default::default()
        });
        ix.apply(0, &batch(3.0, vec![odd]), None);
        assert_eq!(ix.stats().malformed_events, 1);
    }

    #[test]
    fn content_keys_move_an_engine_block_off_the_text_chain_from_its_first_index_block() {
        let mut ix = index_64_over_16();
        // Three engine blocks of 64 tokens; the middle one holds an image.
        let ev = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![7, 8, 9],
            token_ids: (0..192).collect(),
            block_size: 64,
            content_keys: vec![0, 0xfeed, 0],
            ..Default::default()
        });
        ix.apply(0, &batch(1.0, vec![ev]), None);
        let k = request_keys(&ix, 0..192);
        assert_eq!(k.keys.len(), 12);
        assert_eq!(matched(&ix, &k), vec![4], "the engine block before the image, nothing of it or after");
        // The same tokens without content keys on another endpoint match in full, and the
        // image chain's removal goes through the map like any other.
        ix.activate(1);
        let text = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![17, 18, 19],
            token_ids: (0..192).collect(),
            block_size: 64,
            ..Default::default()
        });
        ix.apply(1, &batch(2.0, vec![text]), None);
        assert_eq!(matched(&ix, &k), vec![4, 12]);
        let rm = KvEvent::BlockRemoved(BlockRemoved { block_hashes: vec![8, 9], ..Default::default() });
        ix.apply(0, &batch(3.0, vec![rm]), None);
        assert_eq!(ix.blocks().memberships_of(0), 4);
    }

    #[test]
    fn sequence_tracking() {
        let mut ix = index();
        let b = |ts| batch(ts, vec![stored(&[101], None, 0, Medium::Gpu)]);
        assert_eq!(ix.apply(0, &b(1.0), Some(5)).verdict, StreamVerdict::Applied, "first batch starts the stream");
        assert_eq!(ix.apply(0, &b(2.0), Some(6)).verdict, StreamVerdict::Applied);
        assert_eq!(ix.apply(0, &b(2.0), Some(6)).verdict, StreamVerdict::Duplicate);
        assert_eq!(ix.apply(0, &b(1.0), Some(5)).verdict, StreamVerdict::Duplicate, "an applied batch replayed");
        assert_eq!(ix.apply(0, &b(3.0), Some(9)).verdict, StreamVerdict::Gap { expected: 7, got: 9 });
        // Replay fills the gap, then the held batch applies.
        assert_eq!(ix.apply(0, &b(2.5), Some(7)).verdict, StreamVerdict::Applied);
        assert_eq!(ix.apply(0, &b(2.6), Some(8)).verdict, StreamVerdict::Applied);
        assert_eq!(ix.apply(0, &b(3.0), Some(9)).verdict, StreamVerdict::Applied);
        // Publisher restart: sequence back to 0, not a repeat, clears the endpoint (even when the
        // new process's clock is behind).
        let k = request_keys(&ix, 0..16);
        assert_eq!(matched(&ix, &k), vec![1, 0]);
        let restart = batch(0.5, vec![stored(&[555], None, 1000, Medium::Gpu)]);
        assert_eq!(ix.apply(0, &restart, Some(0)).verdict, StreamVerdict::Reset);
        assert_eq!(matched(&ix, &k), vec![0, 0], "cleared on restart");
        let s = ix.stats();
        assert_eq!((s.duplicates, s.gaps, s.resets), (2, 1, 1));
    }

    #[test]
    fn unrecoverable_gap_resyncs_and_marks_stale() {
        let mut ix = index();
        let b = |ts| batch(ts, vec![stored(&[101], None, 0, Medium::Gpu)]);
        ix.apply(0, &b(1.0), Some(0));
        assert!(ix.healthy(0, 0));
        assert!(!ix.healthy(1, 0), "no events yet: not healthy");
        let v = ix.apply(0, &b(2.0), Some(50)).verdict;
        assert_eq!(v, StreamVerdict::Gap { expected: 1, got: 50 });
        ix.resync(0, 1_000, 30_000);
        assert!(!ix.healthy(0, 1_000));
        assert_eq!(matched(&ix, &request_keys(&ix, 0..16)), vec![0, 0]);
        assert_eq!(ix.apply(0, &b(2.0), Some(50)).verdict, StreamVerdict::Applied);
        assert!(!ix.healthy(0, 30_999));
        assert!(ix.healthy(0, 31_000));
    }

    #[test]
    fn an_older_speculation_does_not_withdraw_a_newer_one() {
        let mut ix = index();
        let short = request_keys(&ix, 0..32);
        let long = request_keys(&ix, 0..64);
        ix.speculate(&short, 0, 2_000, 0);
        ix.speculate(&long, 0, 3_500, 1_500);
        ix.expire(2_500);
        assert_eq!(matched(&ix, &long), vec![4, 0], "the shared prefix is still covered by the newer request");
        ix.expire(3_500);
        assert_eq!(matched(&ix, &long), vec![0, 0]);
        assert_eq!(ix.stats().speculative_blocks, 0);
    }

    #[test]
    fn a_repeated_speculation_is_extended_once_a_quarter_ttl_has_passed() {
        let mut ix = index();
        let k = request_keys(&ix, 0..32);
        ix.speculate(&k, 0, 2_000, 0);
        assert_eq!(ix.stats().speculative_requests, 1);
        // 400 ms later (under a quarter of the 2 s TTL): held long enough, nothing is written.
        assert!(ix.speculation_is_noop(&k.keys, 0, 0, 2_400, 400));
        ix.speculate(&k, 0, 2_400, 400);
        assert_eq!(ix.stats().speculative_requests, 1);
        // 600 ms later: extended to 2.6 s.
        assert!(!ix.speculation_is_noop(&k.keys, 0, 0, 2_600, 600));
        ix.speculate(&k, 0, 2_600, 600);
        assert_eq!(ix.stats().speculative_requests, 2);
        ix.expire(2_100);
        assert_eq!(matched(&ix, &k), vec![2, 0], "the first record's withdrawal leaves the extension");
        ix.expire(2_600);
        assert_eq!(matched(&ix, &k), vec![0, 0]);
        // A slot that does not hold them is always written.
        assert!(!ix.speculation_is_noop(&k.keys, 0, 1, 4_600, 2_600));
    }

    #[test]
    fn speculation_expires_unless_confirmed() {
        let mut ix = index();
        let k = request_keys(&ix, 0..48);
        ix.speculate(&k, 1, 2_000, 0);
        assert_eq!(matched(&ix, &k), vec![0, 3]);
        // The engine confirms the first two blocks on endpoint 1.
        ix.apply(1, &batch(1.0, vec![stored(&[1, 2], None, 0, Medium::Gpu)]), None);
        ix.expire(2_000);
        assert_eq!(matched(&ix, &k), vec![0, 2]);
        assert_eq!(ix.stats().speculative_requests, 0);
        // A speculation for a slot that changed hands is not withdrawn from the new holder: the
        // old holder's expires while the new holder's, on the same blocks, must stay.
        ix.speculate(&k, 0, 3_000, 2_000);
        ix.retire(0);
        ix.activate(0);
        ix.speculate(&k, 0, 3_500, 2_000);
        ix.expire(3_000);
        assert_eq!(matched(&ix, &k), vec![3, 2]);
    }
}
