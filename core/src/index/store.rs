//! The block store behind [`PrefixIndex`](super::PrefixIndex): every stored block in an arena in
//! the order it was first stored, a hash table from block key to arena position, and holder sets
//! ("postings") shared by the blocks that have the same holders.
//!
//! Written here rather than taken from a crate because the index needs things no general-purpose
//! map offers together: 4-byte buckets (the key lives once, in the arena), a resumable positional
//! sweep for incremental garbage collection, chain order kept in memory, and reference-counted
//! posting lists that many blocks share.
//!
//! Layout:
//! - **arena**: `keys[pos]` (the 64-bit block key) and `heads[pos]` (its holders). A chain stored
//!   in one call gets consecutive positions, so a lookup walking a chain usually finds block
//!   `i + 1` right after block `i` (one compare, same cache line) instead of probing the table.
//!   A head of 0 marks a free position (its block was deleted); free positions are reclaimed by
//!   [`BlockStore::compact`].
//! - **table**: open addressing with linear probing (the home is a multiply-high range reduction
//!   of a mix of the key), growth by 1.5x at load 7/8. A probe examines a group of [`GROUP`]
//!   buckets per step (two SSE2 compares on x86_64): one step finds the first empty bucket and
//!   the tag matches before it, where bucket-by-bucket probing would take a branch per bucket (a
//!   miss probes several at high load). Sizes are multiples of the group. A bucket is
//!   `tag << pos_bits | (pos + 1)` (0: empty): `pos_bits` (20 to 27) as the arena's size needs,
//!   widened in place, the rest a tag from the key's mix, so a probe step that is not the key is
//!   almost always told apart without reading the arena (at 4M blocks, 10 tag bits).
//! - **deletion** leaves the table alone: the block's bucket stays, dead (its position free),
//!   and a store of the key brings the position back. A compaction renumbers the table in place
//!   and turns the dead buckets into tombstones, which probes go past and inserts reuse; a
//!   rebuild (growth, or a table full of dead buckets and tombstones) drops both. The load that
//!   triggers a rebuild counts every bucket in use. Shifting the following buckets back on each
//!   deletion, as linear probing usually does, read each one's key from the arena to find its
//!   home: at capacity (blocks evicted as fast as they come) that was most of the time.
//! - **postings**: a head with the top bit clear is the single record itself; with the top bit
//!   set, its low 31 bits index a chunk in `chunks`: `[len | class << 16, refs, rec_0, ..,
//!   rec_{cap-1}]`, `cap = 2 << class`, records sorted by value (owner-major). A chunk is shared
//!   by every position whose head points to it (`refs` counts them); it is changed in place only
//!   while one position holds it, otherwise a changed copy is made. Freed chunks go on a
//!   per-class free list (next index in `rec_0`).
//!
//! Records are opaque non-zero `u32`s below `1 << 31`.

const CHUNK_FLAG: u32 = 1 << 31;
const NONE: u32 = u32::MAX;
const CLASSES: usize = 13; // caps 2 ..= 8192
const MIN_BUCKETS: usize = 64;
/// Buckets a probe examines per step (32 bytes; table sizes are multiples of it).
const GROUP: usize = 8;
/// Bits of a bucket for the position at least and at most (the rest carry the key's tag).
const MIN_POS_BITS: u32 = 20;
const MAX_POS_BITS: u32 = 27;
/// Most blocks the arena can hold (positions are at most 27 bits in a bucket); stores of new
/// blocks beyond it are dropped (at 17 bytes per block that is a 2 GiB index).
pub(crate) const MAX_POSITIONS: usize = (1 << MAX_POS_BITS) - 3;
/// A permanent empty chunk: the head of a position inserted before its first record is set.
pub(crate) const EMPTY: u32 = CHUNK_FLAG;

/// splitmix64's finalizer: a bijective mix (of a block key: where it lives in the table).
#[inline]
pub(crate) fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The tag of a key's mix in a bucket with `pos_bits` position bits.
#[inline]
fn tag_of(mix: u64, pos_bits: u32) -> u32 {
    (mix as u32) >> pos_bits
}

#[inline]
fn cap_of(class: u32) -> usize {
    2usize << class
}

/// The smallest class holding `len` records.
#[inline]
fn class_for(len: usize) -> u32 {
    (len.max(2).next_power_of_two().trailing_zeros()) - 1
}

/// A read-prefetch hint (no-op off x86_64).
#[inline(always)]
#[allow(unsafe_code)]
fn prefetch_read(p: *const i8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` is only a hint: it never faults whatever the address and has no
    // effect the program can observe; SSE is part of the x86_64 baseline. (`wrapping_add` keeps
    // the address computation itself free of undefined behaviour.)
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// For a group of buckets: bit `k` set where bucket `k` is empty, and where its tag
/// (`bucket >> pos_bits`) is `tag`. SSE2 (the x86_64 baseline): two 4-lane compares each.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code)]
fn group_masks(g: &[u32; GROUP], pos_bits: u32, tag: u32) -> (u32, u32) {
    use core::arch::x86_64::{
        _mm_castsi128_ps, _mm_cmpeq_epi32, _mm_cvtsi32_si128, _mm_movemask_ps, _mm_set1_epi32, _mm_set_epi32,
        _mm_setzero_si128, _mm_srl_epi32,
    };
    let lane = |k: usize| g[k] as i32;
    // SAFETY: these intrinsics only compute on values (no memory access); they need SSE2, which
    // every x86_64 processor has (the target's baseline).
    unsafe {
        let lo = _mm_set_epi32(lane(3), lane(2), lane(1), lane(0));
        let hi = _mm_set_epi32(lane(7), lane(6), lane(5), lane(4));
        let zero = _mm_setzero_si128();
        let shift = _mm_cvtsi32_si128(pos_bits as i32);
        let want = _mm_set1_epi32(tag as i32);
        let empty = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(lo, zero))) as u32
            | (_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(hi, zero))) as u32) << 4;
        let hit = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(_mm_srl_epi32(lo, shift), want))) as u32
            | (_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(_mm_srl_epi32(hi, shift), want))) as u32) << 4;
        (empty, hit)
    }
}

/// For a group of buckets: bit `k` set where bucket `k` is empty, and where its tag
/// (`bucket >> pos_bits`) is `tag`. WebAssembly `simd128` (the Envoy filter's build): two 4-lane
/// compares each, as with SSE2.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
fn group_masks(g: &[u32; GROUP], pos_bits: u32, tag: u32) -> (u32, u32) {
    use core::arch::wasm32::{i32x4_bitmask, u32x4, u32x4_eq, u32x4_shr, u32x4_splat};
    let lo = u32x4(g[0], g[1], g[2], g[3]);
    let hi = u32x4(g[4], g[5], g[6], g[7]);
    let (zero, want) = (u32x4_splat(0), u32x4_splat(tag));
    let empty = u32::from(i32x4_bitmask(u32x4_eq(lo, zero))) | u32::from(i32x4_bitmask(u32x4_eq(hi, zero))) << 4;
    let hit = u32::from(i32x4_bitmask(u32x4_eq(u32x4_shr(lo, pos_bits), want)))
        | u32::from(i32x4_bitmask(u32x4_eq(u32x4_shr(hi, pos_bits), want))) << 4;
    (empty, hit)
}

/// For a group of buckets: bit `k` set where bucket `k` is empty, and where its tag
/// (`bucket >> pos_bits`) is `tag`.
#[cfg(not(any(target_arch = "x86_64", all(target_arch = "wasm32", target_feature = "simd128"))))]
#[inline(always)]
fn group_masks(g: &[u32; GROUP], pos_bits: u32, tag: u32) -> (u32, u32) {
    let (mut empty, mut hit) = (0u32, 0u32);
    for (k, &b) in g.iter().enumerate() {
        empty |= u32::from(b == 0) << k;
        hit |= u32::from(b >> pos_bits == tag) << k;
    }
    (empty, hit)
}

/// Table buckets that hold `blocks` blocks at the load limit (7/8), a whole number of groups.
fn buckets_for(blocks: usize) -> usize {
    (blocks * 8).div_ceil(7).next_multiple_of(GROUP)
}

/// Grow `v` to hold `extra` more elements by steps of 1.25x (memory follows the contents closely;
/// `Vec`'s doubling would leave up to half of it unused).
fn reserve_stepped<T>(v: &mut Vec<T>, extra: usize) {
    let need = v.len() + extra;
    if need > v.capacity() {
        let target = need.max(v.capacity() + v.capacity() / 4).max(64);
        v.reserve_exact(target - v.len());
    }
}

/// Where a probe for a key ended.
enum Probe {
    /// The key's bucket, its block live at this position.
    Live(usize),
    /// The key's bucket, its block deleted (the position is free).
    Dead(usize),
    /// No bucket for the key: the bucket it takes, the first empty one from its home or (for an
    /// insert) a tombstone before it.
    Absent { bucket: usize, tomb: bool },
}

/// Blocks, their keys and their shared holder sets.
pub(crate) struct BlockStore {
    buckets: Vec<u32>,
    /// Low bits of a bucket holding `pos + 1`; the high `32 - pos_bits` hold a tag of the key
    /// (as many as the arena's size leaves, so a probe step that is not the key is almost
    /// never told apart by reading the arena). Grows with the arena, in place (`widen`).
    pos_bits: u32,
    /// Live blocks (positions with a non-zero head).
    len: usize,
    /// Buckets in use: the live blocks', the dead ones' (deleted since the last compaction) and
    /// the tombstones.
    used: usize,
    /// Tombstones in the table (inserts look for one to reuse only while there are any).
    tombs: usize,
    keys: Vec<u64>,
    heads: Vec<u32>,
    chunks: Vec<u32>,
    free: [u32; CLASSES],
    /// Scratch for building a changed posting.
    build: Vec<u32>,
    /// Blocks the store keeps room for however few it holds ([`BlockStore::reserve`]): the
    /// table and the arena do not shrink below it.
    floor: usize,
}

impl BlockStore {
    pub(crate) fn new() -> Self {
        // Chunk 0 is the permanent empty chunk (`EMPTY`), never freed and never counted.
        BlockStore {
            buckets: vec![0; MIN_BUCKETS],
            pos_bits: MIN_POS_BITS,
            len: 0,
            used: 0,
            tombs: 0,
            keys: Vec::new(),
            heads: Vec::new(),
            chunks: vec![0, 1, 0, 0],
            free: [NONE; CLASSES],
            build: Vec::new(),
            floor: 0,
        }
    }

    /// An empty store whose buckets start with `pos_bits` position bits (tests: widening).
    #[cfg(test)]
    fn with_pos_bits(pos_bits: u32) -> Self {
        BlockStore { pos_bits, ..Self::new() }
    }

    /// A copy with the same capacities (see `PrefixIndex::twin`).
    pub(crate) fn twin(&self) -> Self {
        use super::clone_with_capacity as copy;
        BlockStore {
            buckets: copy(&self.buckets),
            pos_bits: self.pos_bits,
            len: self.len,
            used: self.used,
            tombs: self.tombs,
            keys: copy(&self.keys),
            heads: copy(&self.heads),
            chunks: copy(&self.chunks),
            free: self.free,
            build: copy(&self.build),
            floor: self.floor,
        }
    }

    /// Live blocks.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Arena positions (live and free): a sweep pass visits this many.
    pub(crate) fn positions(&self) -> usize {
        self.keys.len()
    }

    /// Heap bytes held.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.buckets.capacity() * 4
            + self.keys.capacity() * 8
            + self.heads.capacity() * 4
            + (self.chunks.capacity() + self.build.capacity()) * 4
    }

    #[inline]
    fn home(&self, mix: u64) -> usize {
        crate::approx::mul_hi(mix, self.buckets.len() as u64) as usize
    }

    /// Hint the CPU to load the home bucket of the key whose [`mix64`] is `mix` (callers walking
    /// a key sequence prefetch a few keys ahead so the cache misses of a large table overlap
    /// instead of queueing).
    #[inline]
    pub(crate) fn prefetch_mixed(&self, mix: u64) {
        prefetch_read(self.buckets.as_ptr().wrapping_add(self.home(mix)).cast());
    }

    /// Buckets in the table.
    pub(crate) fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Bit `k` set where bucket `base + k` of the group at `base` is empty, and where its tag is
    /// `tag` (an empty bucket may show as a tag match too: callers stop at the first empty).
    #[inline(always)]
    fn group_masks(&self, base: usize, tag: u32) -> (u32, u32) {
        group_masks(self.group(base), self.pos_bits, tag)
    }

    /// The group of [`GROUP`] buckets at `base`.
    #[inline(always)]
    fn group(&self, base: usize) -> &[u32; GROUP] {
        match self.buckets[base..base + GROUP].try_into() {
            Ok(g) => g,
            Err(_) => unreachable!("a group is GROUP buckets"),
        }
    }

    /// The tombstone: a bucket whose position field is all ones (no position: positions stop
    /// two short of it, see [`BlockStore::table_changes`]) and whose tag is 0. It stands where a
    /// compaction found a deleted block's bucket: a probe goes past it, an insert reuses it.
    #[inline(always)]
    fn tomb(&self) -> u32 {
        (1 << self.pos_bits) - 1
    }

    /// Linear probing from `key`'s home, a group of [`GROUP`] buckets per step, to `key`'s
    /// bucket or the first empty bucket from the home. A table holds at most one bucket per
    /// key, live or dead (see [`BlockStore::delete`]). With `INSERT`, an absent key's bucket is
    /// the first tombstone on the way, if any, else that empty bucket.
    #[inline(always)]
    fn probe<const INSERT: bool>(&self, key: u64, mix: u64) -> Probe {
        let pos_bits = self.pos_bits;
        let tag = tag_of(mix, pos_bits);
        let home = self.home(mix);
        let mut base = home & !(GROUP - 1);
        let mut from = (home - base) as u32;
        loop {
            let (empty, hit) = self.group_masks(base, tag);
            let empty = empty >> from << from;
            let stop = if empty == 0 { GROUP as u32 } else { empty.trailing_zeros() };
            let mut hit = (hit >> from << from) & ((1u32 << stop) - 1);
            while hit != 0 {
                let b = self.buckets[base + hit.trailing_zeros() as usize];
                // A tombstone's position is past the arena's end (it may match a tag of 0).
                let pos = ((b & ((1 << pos_bits) - 1)) as usize).wrapping_sub(1);
                if self.keys.get(pos) == Some(&key) {
                    return if self.heads[pos] != 0 { Probe::Live(pos) } else { Probe::Dead(pos) };
                }
                hit &= hit - 1;
            }
            if empty != 0 {
                let empty = base + stop as usize;
                if INSERT && self.tombs != 0 {
                    if let Some(t) = self.first_tomb(home, empty) {
                        return Probe::Absent { bucket: t, tomb: true };
                    }
                }
                return Probe::Absent { bucket: empty, tomb: false };
            }
            base += GROUP;
            if base == self.buckets.len() {
                base = 0;
            }
            from = 0;
        }
    }

    /// The first tombstone from bucket `from` up to the empty bucket `to` (cyclically), if any.
    #[inline(never)]
    fn first_tomb(&self, from: usize, to: usize) -> Option<usize> {
        let tomb = self.tomb();
        let mut i = from;
        while i != to {
            if self.buckets[i] == tomb {
                return Some(i);
            }
            i = if i + 1 == self.buckets.len() { 0 } else { i + 1 };
        }
        None
    }

    /// The position of `key`, if stored.
    #[inline]
    pub(crate) fn find(&self, key: u64) -> Option<usize> {
        match self.probe::<false>(key, mix64(key)) {
            Probe::Live(pos) => Some(pos),
            Probe::Dead(_) | Probe::Absent { .. } => None,
        }
    }

    /// The position after `pos` when it holds `key` (a chain stored together), else the table's
    /// answer.
    #[inline(always)]
    pub(crate) fn find_after(&self, pos: usize, key: u64) -> Option<usize> {
        self.live_next(pos, key).or_else(|| self.find_cold(key))
    }

    /// `pos + 1` when the block stored right after `pos` is `key`, live (a chain stored in one
    /// call: no probe).
    #[inline(always)]
    fn live_next(&self, pos: usize, key: u64) -> Option<usize> {
        let next = pos + 1;
        (next < self.keys.len() && self.keys[next] == key && self.heads[next] != 0).then_some(next)
    }

    /// [`BlockStore::find_after`], storing `key` with `head` when it is not live (one probe for
    /// both, as [`BlockStore::find_or_insert_mixed`]): `(position, born)`.
    pub(crate) fn find_after_or_insert(&mut self, pos: Option<usize>, key: u64, head: u32) -> (Option<usize>, bool) {
        match pos.and_then(|p| self.live_next(p, key)) {
            Some(next) => (Some(next), false),
            None => self.find_or_insert_cold(key, head),
        }
    }

    #[inline(never)]
    fn find_or_insert_cold(&mut self, key: u64, head: u32) -> (Option<usize>, bool) {
        self.find_or_insert_mixed(key, mix64(key), head)
    }

    #[inline(never)]
    fn find_cold(&self, key: u64) -> Option<usize> {
        self.find(key)
    }

    /// How many of `keys` lie, live, in the positions right after `pos` (a chain stored
    /// together): the leading run a caller can take without probing the table.
    #[inline]
    pub(crate) fn run_after(&self, pos: usize, keys: &[u64]) -> usize {
        let from = (pos + 1).min(self.keys.len());
        self.keys[from..]
            .iter()
            .zip(&self.heads[from..])
            .zip(keys)
            .take_while(|((&stored, &head), &key)| stored == key && head != 0)
            .count()
    }

    /// Every position's key and head (free positions: head 0), for walks along the arena.
    #[inline]
    pub(crate) fn arena(&self) -> (&[u64], &[u32]) {
        (&self.keys, &self.heads)
    }

    /// The head at `pos` (0: free).
    #[inline]
    pub(crate) fn head(&self, pos: usize) -> u32 {
        self.heads[pos]
    }

    /// The records of the block at `pos`.
    #[inline]
    pub(crate) fn records_at(&self, pos: usize) -> &[u32] {
        let head = &self.heads[pos];
        if *head & CHUNK_FLAG == 0 {
            if *head == 0 {
                &[]
            } else {
                std::slice::from_ref(head)
            }
        } else {
            self.chunk_records(*head)
        }
    }

    /// The records of a chunk head.
    #[inline]
    fn chunk_records(&self, head: u32) -> &[u32] {
        let c = (head & !CHUNK_FLAG) as usize;
        let len = (self.chunks[c] & 0xffff) as usize;
        &self.chunks[c + 2..c + 2 + len]
    }

    /// The records `head` stands for (`head` must be a chunk head or a record).
    #[inline]
    pub(crate) fn records_of<'a>(&'a self, head: &'a u32) -> &'a [u32] {
        if *head & CHUNK_FLAG == 0 {
            std::slice::from_ref(head)
        } else {
            self.chunk_records(*head)
        }
    }

    /// Take a reference on `head` (a chunk's count; records are values).
    #[inline]
    pub(crate) fn retain(&mut self, head: u32) {
        if head & CHUNK_FLAG != 0 && head != EMPTY {
            self.chunks[(head & !CHUNK_FLAG) as usize + 1] += 1;
        }
    }

    /// Drop a reference on `head`; a chunk nobody refers to is freed.
    #[inline]
    pub(crate) fn release(&mut self, head: u32) {
        if head & CHUNK_FLAG != 0 && head != EMPTY {
            let c = (head & !CHUNK_FLAG) as usize;
            self.chunks[c + 1] -= 1;
            if self.chunks[c + 1] == 0 {
                let class = (self.chunks[c] >> 16) as usize;
                self.chunks[c + 2] = self.free[class];
                self.free[class] = c as u32;
            }
        }
    }

    fn alloc(&mut self, class: u32) -> usize {
        let f = self.free[class as usize];
        if f != NONE {
            let c = f as usize;
            self.free[class as usize] = self.chunks[c + 2];
            return c;
        }
        let c = self.chunks.len();
        reserve_stepped(&mut self.chunks, 2 + cap_of(class));
        self.chunks.resize(c + 2 + cap_of(class), 0);
        c
    }

    /// A head for the sorted records `recs` (a record itself, or a new chunk with no
    /// references yet: give it to a position or `retain`/`release` it). `None` when empty.
    fn make(&mut self, recs: &[u32]) -> Option<u32> {
        match recs.len() {
            0 => None,
            1 => Some(recs[0]),
            len => {
                let class = class_for(len);
                let c = self.alloc(class);
                self.chunks[c] = (class << 16) | len as u32;
                self.chunks[c + 1] = 0;
                self.chunks[c + 2..c + 2 + len].copy_from_slice(recs);
                Some(CHUNK_FLAG | c as u32)
            }
        }
    }

    /// The head for `head`'s records with the record of `who` (`owner(r) == who`) replaced by
    /// `f(old)` (`Some`: set or added, `None`: removed). Returns `(new head or None when empty,
    /// old record)`. When no position but the caller's holds `head`, the chunk may be changed in
    /// place (the returned head is then `head` itself).
    pub(crate) fn derive(
        &mut self,
        head: u32,
        who: u32,
        owner: impl Fn(u32) -> u32,
        f: impl FnOnce(Option<u32>) -> Option<u32>,
    ) -> (Option<u32>, Option<u32>) {
        if head & CHUNK_FLAG == 0 {
            // A single record (or a free position, treated as empty).
            if head != 0 && owner(head) == who {
                return (f(Some(head)), Some(head));
            }
            let old = (head != 0).then_some(head);
            return match f(None) {
                None => (old, None),
                Some(rec) => match old {
                    None => (Some(rec), None),
                    Some(o) => {
                        let pair = if o < rec { [o, rec] } else { [rec, o] };
                        (self.make(&pair), None)
                    }
                },
            };
        }
        let c = (head & !CHUNK_FLAG) as usize;
        let len = (self.chunks[c] & 0xffff) as usize;
        let found = self.chunks[c + 2..c + 2 + len].binary_search_by_key(&who, |&r| owner(r));
        let old = found.ok().map(|i| self.chunks[c + 2 + i]);
        let new = f(old);
        if new.is_some() && new == old {
            return (Some(head), old);
        }
        let exclusive = head != EMPTY && self.chunks[c + 1] == 1;
        match (found, new) {
            (Ok(i), Some(rec)) if exclusive => {
                self.chunks[c + 2 + i] = rec;
                (Some(head), old)
            }
            (Err(_), None) => ((len > 0).then_some(head), None),
            (found, new) => {
                // A changed copy: the record replaced, removed or inserted in order.
                let mut b = std::mem::take(&mut self.build);
                b.clear();
                b.extend_from_slice(&self.chunks[c + 2..c + 2 + len]);
                match (found, new) {
                    (Ok(i), Some(rec)) => b[i] = rec,
                    (Ok(i), None) => {
                        b.remove(i);
                    }
                    (Err(i), Some(rec)) => b.insert(i, rec),
                    (Err(_), None) => {}
                }
                let h = self.make(&b);
                self.build = b;
                (h, old)
            }
        }
    }

    /// The head for `head`'s records that `keep` keeps, and how many were dropped.
    pub(crate) fn filter(&mut self, head: u32, mut keep: impl FnMut(u32) -> bool) -> (Option<u32>, u32) {
        if head & CHUNK_FLAG == 0 {
            return if head == 0 || !keep(head) { (None, u32::from(head != 0)) } else { (Some(head), 0) };
        }
        let mut b = std::mem::take(&mut self.build);
        b.clear();
        b.extend(self.chunk_records(head).iter().copied().filter(|&r| keep(r)));
        let dropped = (self.chunk_records(head).len() - b.len()) as u32;
        let h = if dropped == 0 && !b.is_empty() { Some(head) } else { self.make(&b) };
        self.build = b;
        (h, dropped)
    }

    /// Point `pos` at `head` (non-zero), dropping its old head's reference.
    #[inline]
    pub(crate) fn set_head(&mut self, pos: usize, head: u32) {
        debug_assert!(head != 0);
        let old = self.heads[pos];
        if old != head {
            self.retain(head);
            self.heads[pos] = head;
            self.release(old);
        }
    }

    /// [`BlockStore::find_or_insert_mixed`], mixing `key` itself.
    #[cfg(test)]
    pub(crate) fn find_or_insert(&mut self, key: u64, head: u32) -> (Option<usize>, bool) {
        self.find_or_insert_mixed(key, mix64(key), head)
    }

    /// The position of `key` (whose [`mix64`] is `mix`: callers mix a key once, to prefetch its
    /// bucket), or, when absent, a new position for it at the end of the arena holding `head`
    /// (one probe for both: the probe that missed ends on the bucket the key takes). Returns
    /// `(position, born)`; `(None, false)` when the key is new and the arena is full
    /// ([`MAX_POSITIONS`]).
    #[inline(always)]
    pub(crate) fn find_or_insert_mixed(&mut self, key: u64, mix: u64, head: u32) -> (Option<usize>, bool) {
        debug_assert!(head != 0 && mix == mix64(key));
        let (i, tomb) = match self.probe::<true>(key, mix) {
            Probe::Live(pos) => return (Some(pos), false),
            Probe::Dead(pos) => {
                self.revive(pos, head);
                return (Some(pos), true);
            }
            Probe::Absent { bucket, tomb } => (bucket, tomb),
        };
        let pos = self.keys.len();
        if pos >= MAX_POSITIONS {
            return (None, false);
        }
        if self.table_changes(pos) {
            // The probe's bucket is stale.
            return (self.append(key, head), true);
        }
        self.push(key, head);
        self.buckets[i] = (tag_of(mix, self.pos_bits) << self.pos_bits) | (pos as u32 + 1);
        if tomb {
            self.tombs -= 1;
        } else {
            self.used += 1;
        }
        (Some(pos), true)
    }

    /// Whether appending position `pos` first widens the buckets or rebuilds the table.
    #[inline(always)]
    fn table_changes(&self, pos: usize) -> bool {
        // Positions stop two short of the position field's all-ones (the tombstone's). A
        // deleted block keeps its bucket until a compaction makes it a tombstone, and a
        // tombstone stays until an insert reuses it or the table is rebuilt: the table's load
        // is the buckets in use, not the live blocks.
        pos + 3 > 1 << self.pos_bits || (self.used + 1) * 8 > self.buckets.len() * 7
    }

    /// Bring the dead position `pos` (its key's bucket still in the table) back with `head`.
    fn revive(&mut self, pos: usize, head: u32) {
        debug_assert!(self.heads[pos] == 0 && head != 0);
        self.retain(head);
        self.heads[pos] = head;
        self.len += 1;
    }

    /// Append `key` with `head` to the arena (its bucket is the caller's).
    #[inline(always)]
    fn push(&mut self, key: u64, head: u32) {
        if self.keys.len() == self.keys.capacity() || self.heads.len() == self.heads.capacity() {
            self.reserve_arena();
        }
        self.retain(head);
        self.keys.push(key);
        self.heads.push(head);
        self.len += 1;
    }

    /// Room for one more position in the arena (out of line: once per growth step).
    #[cold]
    #[inline(never)]
    fn reserve_arena(&mut self) {
        reserve_stepped(&mut self.keys, 1);
        reserve_stepped(&mut self.heads, 1);
    }

    /// Store the block `key` (not live) with `head`: at its dead position when the table still
    /// has it, else at the end of the arena. `None` when the arena is full ([`MAX_POSITIONS`]).
    #[cfg(test)]
    pub(crate) fn insert(&mut self, key: u64, head: u32) -> Option<usize> {
        let (pos, born) = self.find_or_insert_mixed(key, mix64(key), head);
        debug_assert!(born || pos.is_none(), "insert of a live key");
        pos
    }

    /// Store the block `key`, absent from the table, with `head` at the end of the arena.
    fn append(&mut self, key: u64, head: u32) -> Option<usize> {
        debug_assert!(head != 0);
        let pos = self.keys.len();
        if pos >= MAX_POSITIONS {
            return None;
        }
        if pos + 3 > 1 << self.pos_bits {
            // Positions outgrow their bits: two more, taken from the tags.
            self.widen();
        }
        if (self.used + 1) * 8 > self.buckets.len() * 7 {
            // Full: by half again when the live blocks fill three quarters, else the same size
            // without the dead blocks' buckets.
            let n = self.buckets.len();
            self.rebuild(if (self.len + 1) * 4 > n * 3 { n + n / 2 } else { n });
        }
        self.push(key, head);
        self.place(key, pos);
        self.used += 1;
        Some(pos)
    }

    fn place(&mut self, key: u64, pos: usize) {
        self.place_mixed(mix64(key), pos);
    }

    /// [`BlockStore::place`] of a key whose mix is `mix`.
    #[inline(always)]
    fn place_mixed(&mut self, mix: u64, pos: usize) {
        let home = self.home(mix);
        let mut base = home & !(GROUP - 1);
        let mut from = (home - base) as u32;
        let i = loop {
            let (empty, _) = self.group_masks(base, 0);
            let empty = empty >> from << from;
            if empty != 0 {
                break base + empty.trailing_zeros() as usize;
            }
            base += GROUP;
            if base == self.buckets.len() {
                base = 0;
            }
            from = 0;
        };
        self.buckets[i] = (tag_of(mix, self.pos_bits) << self.pos_bits) | (pos as u32 + 1);
    }

    /// Two more bits for positions in every bucket, taken from the tag's low end. A tag is the
    /// key's mix shifted right by the position bits, so the narrower tag is the old one shifted
    /// by two: every block stays in its bucket and no key is read (a rebuild would move every
    /// block, at a cache miss each on a large table).
    #[cold]
    #[inline(never)]
    fn widen(&mut self) {
        let old = self.pos_bits;
        let new = (old + 2).min(MAX_POS_BITS);
        let mask = (1u32 << old) - 1;
        let (old_tomb, new_tomb) = (mask, (1u32 << new) - 1);
        for b in &mut self.buckets {
            if *b == old_tomb {
                *b = new_tomb;
            } else if *b != 0 {
                *b = ((*b >> old) >> (new - old) << new) | (*b & mask);
            }
        }
        self.pos_bits = new;
    }

    /// Room for `blocks` blocks in all, kept from now on: the arena gets room for that many
    /// positions and the table as many buckets as that many blocks need at its load limit (a
    /// rebuild now, if it has fewer), and neither shrinks below it later. Storing up to `blocks`
    /// blocks then never rebuilds the table, which a growing store does at every 1.5x step
    /// (moving every block: a pause of the store, and most of a build's time). At most
    /// [`MAX_POSITIONS`]. A smaller reservation than the last lowers the floor and gives back
    /// what the store's contents do not need now (0: no reservation).
    ///
    /// The table's memory is written (zeroed) now, so it is held, not only promised; where it
    /// cannot be allocated, the store is left as it was, without the reservation.
    pub(crate) fn reserve(&mut self, blocks: usize) -> Result<(), std::collections::TryReserveError> {
        let blocks = blocks.min(MAX_POSITIONS);
        if blocks < self.floor {
            self.floor = blocks;
            self.maybe_shrink();
            let keep = self.keys.len().max(blocks);
            if self.keys.capacity() > keep + keep / 8 + 64 {
                self.keys.shrink_to(keep + keep / 16);
                self.heads.shrink_to(keep + keep / 16);
            }
        }
        if blocks == 0 {
            return Ok(());
        }
        let n = buckets_for(blocks);
        let mut table = Vec::new();
        if n > self.buckets.len() {
            table.try_reserve_exact(n)?;
        }
        self.keys.try_reserve_exact(blocks.saturating_sub(self.keys.len()))?;
        self.heads.try_reserve_exact(blocks.saturating_sub(self.heads.len()))?;
        self.floor = blocks;
        // Positions up to `blocks - 1` without widening (see `table_changes`).
        while blocks + 2 > 1 << self.pos_bits && self.pos_bits < MAX_POS_BITS {
            self.widen();
        }
        if n > self.buckets.len() {
            table.resize(n, 0);
            self.buckets = table;
            self.place_all();
        }
        Ok(())
    }

    /// Buckets the table keeps at least: room for the reserved blocks at load 7/8.
    fn floor_buckets(&self) -> usize {
        buckets_for(self.floor)
    }

    /// Rebuild the table with `n` buckets from the arena.
    fn rebuild(&mut self, n: usize) {
        self.buckets = Vec::new();
        self.buckets = vec![0; n.max(MIN_BUCKETS).next_multiple_of(GROUP)];
        self.place_all();
    }

    /// Place every live block in the table, empty (all zero) and as large as they need.
    fn place_all(&mut self) {
        debug_assert!(self.buckets.iter().all(|&b| b == 0) && self.len * 8 <= self.buckets.len() * 7);
        // Homes a few positions ahead are prefetched: a large table's misses then overlap. Each
        // key is mixed once, for its prefetch; the mixes wait in a ring until placed.
        const AHEAD: usize = 16;
        let prefetch = self.buckets.len() >= 1 << 16;
        let len = self.keys.len();
        let mut ahead = [0u64; AHEAD];
        for (m, &key) in ahead.iter_mut().zip(&self.keys) {
            *m = mix64(key);
        }
        for pos in 0..len {
            let mix = ahead[pos % AHEAD];
            if let Some(&key) = self.keys.get(pos + AHEAD) {
                let m = mix64(key);
                ahead[pos % AHEAD] = m;
                if prefetch {
                    prefetch_read(self.buckets.as_ptr().wrapping_add(self.home(m)).cast());
                }
            }
            if self.heads[pos] != 0 {
                self.place_mixed(mix, pos);
            }
        }
        self.used = self.len;
        self.tombs = 0;
    }

    /// Delete the block at `pos` (its position becomes free). Its bucket stays, dead, until the
    /// table is rebuilt (by a growth or a compaction): a lookup that reaches it finds the key
    /// with no holders, and a store of the key brings the position back. Removing the bucket
    /// would shift the buckets after it back, reading each one's key from the arena to find its
    /// home: a cache miss per bucket on a large table, which made deletions most of the time of
    /// an index at capacity (blocks evicted as fast as they come).
    pub(crate) fn delete(&mut self, pos: usize) {
        let head = self.heads[pos];
        if head == 0 {
            return;
        }
        self.heads[pos] = 0;
        self.release(head);
        self.len -= 1;
    }

    /// Free positions (deleted blocks) not yet reclaimed.
    pub(crate) fn free_positions(&self) -> usize {
        self.keys.len() - self.len
    }

    /// Reclaim free positions (live blocks keep their order) and size the arena to the contents.
    /// Positions change: callers holding positions must drop them. Returns where position
    /// `keep` went (the count of live positions before it).
    ///
    /// The table is renumbered where it lies: a live block's bucket gets its new position, a
    /// deleted block's bucket becomes a tombstone, and no block moves (a rebuild would move every
    /// block, at a cache miss each on a table larger than the cache). It is rebuilt instead when
    /// it is over a quarter larger than the live blocks need (after many deletions).
    pub(crate) fn compact(&mut self, keep: usize) -> usize {
        let positions = self.keys.len();
        // Per 64 positions: the live ones (a bit each) and how many live ones come before.
        let mut live = vec![0u64; positions.div_ceil(64)];
        let mut before = vec![0u32; live.len()];
        let mut count = 0u32;
        for (w, (bits, at)) in live.iter_mut().zip(before.iter_mut()).enumerate() {
            *at = count;
            for (k, &h) in self.heads[w * 64..(w * 64 + 64).min(positions)].iter().enumerate() {
                *bits |= u64::from(h != 0) << k;
            }
            count += bits.count_ones();
        }
        let mut w = 0;
        let mut kept = 0;
        for r in 0..positions {
            if r == keep {
                kept = w;
            }
            if self.heads[r] != 0 {
                self.keys[w] = self.keys[r];
                self.heads[w] = self.heads[r];
                w += 1;
            }
        }
        self.keys.truncate(w);
        self.heads.truncate(w);
        if self.keys.capacity() > (w + w / 8 + 64).max(self.floor) {
            self.keys.shrink_to((w + w / 16).max(self.floor));
            self.heads.shrink_to((w + w / 16).max(self.floor));
        }
        // Room for the positions added until the next compaction (an eighth of the arena free
        // again) at load 7/8: positions up to 8/7 of the live blocks.
        let fits = (self.len * 4 / 3 + 1).max(self.len + 64);
        if self.buckets.len() > (fits + fits / 4).max(MIN_BUCKETS).max(self.floor_buckets()) {
            self.rebuild(fits.max(self.floor_buckets()));
        } else {
            let mask = (1u32 << self.pos_bits) - 1;
            let tomb = self.tomb();
            for b in &mut self.buckets {
                if *b == 0 || *b == tomb {
                    continue;
                }
                let p = (*b & mask) as usize - 1;
                let (word, k) = (p / 64, p % 64);
                *b = if live[word] >> k & 1 != 0 {
                    let q = before[word] + (live[word] & ((1u64 << k) - 1)).count_ones();
                    (*b & !mask) | (q + 1)
                } else {
                    self.tombs += 1;
                    tomb
                };
            }
        }
        if keep >= w {
            w
        } else {
            kept
        }
    }

    /// Shrink the table when it is mostly empty (after large removals).
    pub(crate) fn maybe_shrink(&mut self) {
        let n = self.buckets.len();
        let least = MIN_BUCKETS.max(self.floor_buckets());
        if n > least && self.len * 8 < n {
            self.rebuild((self.len * 2).max(least));
            self.buckets.shrink_to_fit();
        }
    }

    /// Drop everything but the reservation ([`BlockStore::reserve`]): a reserved store keeps
    /// its arena's and table's memory, emptied.
    pub(crate) fn clear(&mut self) {
        let floor = self.floor;
        let keys = std::mem::take(&mut self.keys);
        let heads = std::mem::take(&mut self.heads);
        let buckets = std::mem::take(&mut self.buckets);
        *self = Self::new();
        if floor > 0 {
            let (mut keys, mut heads, mut buckets) = (keys, heads, buckets);
            keys.clear();
            heads.clear();
            buckets.fill(0);
            (self.keys, self.heads, self.buckets, self.floor) = (keys, heads, buckets, floor);
            // An empty table: wider positions re-encode nothing.
            while floor + 2 > 1 << self.pos_bits && self.pos_bits < MAX_POS_BITS {
                self.pos_bits = (self.pos_bits + 2).min(MAX_POS_BITS);
            }
        }
    }

    /// Every live (key, records) (tests and diagnostics).
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &[u32])> + '_ {
        (0..self.keys.len()).filter(|&p| self.heads[p] != 0).map(|p| (self.keys[p], self.records_at(p)))
    }

    /// Chunks in use, with their reference counts checked against the positions (tests).
    #[cfg(test)]
    pub(crate) fn check_refs(&self) {
        let mut counts = std::collections::BTreeMap::<u32, u32>::new();
        for &h in &self.heads {
            if h & CHUNK_FLAG != 0 && h != EMPTY {
                *counts.entry(h).or_default() += 1;
            }
        }
        for (&h, &n) in &counts {
            let c = (h & !CHUNK_FLAG) as usize;
            assert_eq!(self.chunks[c + 1], n, "chunk {c} references");
            let recs = self.chunk_records(h);
            assert!(recs.len() >= 2 && recs.windows(2).all(|w| w[0] < w[1]), "chunk {c} sorted, 2+ records");
        }
        assert_eq!(self.heads.iter().filter(|&&h| h != 0).count(), self.len);
        for p in 0..self.keys.len() {
            if self.heads[p] != 0 {
                assert_eq!(self.find(self.keys[p]), Some(p));
            }
        }
        // One bucket per position at most, every live position's among them; none per key twice.
        let mask = (1u32 << self.pos_bits) - 1;
        let mut seen = vec![false; self.keys.len()];
        let mut keys = std::collections::BTreeSet::new();
        for &b in self.buckets.iter().filter(|&&b| b != 0 && b != self.tomb()) {
            let p = (b & mask) as usize - 1;
            assert!(!std::mem::replace(&mut seen[p], true), "position {p} has two buckets");
            assert!(keys.insert(self.keys[p]), "key {:x} has two buckets", self.keys[p]);
            assert_eq!(b >> self.pos_bits, tag_of(mix64(self.keys[p]), self.pos_bits), "tag of position {p}");
        }
        for (p, _) in self.heads.iter().enumerate().filter(|(_, &h)| h != 0) {
            assert!(seen[p], "live position {p} has a bucket");
        }
        assert_eq!(self.buckets.iter().filter(|&&b| b != 0).count(), self.used, "buckets in use");
        assert_eq!(self.buckets.iter().filter(|&&b| b == self.tomb()).count(), self.tombs, "tombstones");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    fn slot(r: u32) -> u32 {
        r >> 8
    }

    /// Set `rec` for its owner in `key`'s posting (inserting the key), as the index does.
    fn upsert(s: &mut BlockStore, key: u64, rec: u32) -> Option<u32> {
        match s.find(key) {
            Some(p) => {
                let (h, old) = s.derive(s.head(p), slot(rec), slot, |_| Some(rec));
                s.set_head(p, h.unwrap_or(EMPTY));
                old
            }
            None => {
                s.insert(key, rec);
                None
            }
        }
    }

    fn remove_owner(s: &mut BlockStore, key: u64, who: u32) {
        if let Some(p) = s.find(key) {
            match s.derive(s.head(p), who, slot, |_| None).0 {
                Some(h) => s.set_head(p, h),
                None => s.delete(p),
            }
        }
    }

    /// The group compare of this target (SSE2, simd128 or the portable loop) against its
    /// definition, over empty buckets, matching and near tags at every position width.
    #[test]
    fn group_masks_match_their_definition() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let pos_bits = 8 + (x % 24) as u32;
            let tag = ((x >> 8) as u32) >> pos_bits;
            let mut g = [0u32; GROUP];
            for (k, b) in g.iter_mut().enumerate() {
                let r = (x >> (4 * k)) & 0xf;
                let low = ((x >> 32) as u32).rotate_left(k as u32) & ((1 << pos_bits) - 1);
                *b = match r {
                    0..=3 => 0,
                    4..=9 => (tag << pos_bits) | low,
                    10..=12 => ((tag ^ 1) << pos_bits) | low,
                    _ => (x >> (2 * k)) as u32,
                };
            }
            let (mut empty, mut hit) = (0u32, 0u32);
            for (k, &b) in g.iter().enumerate() {
                empty |= u32::from(b == 0) << k;
                hit |= u32::from(b >> pos_bits == tag) << k;
            }
            assert_eq!(group_masks(&g, pos_bits, tag), (empty, hit), "{g:x?} pos_bits {pos_bits} tag {tag:x}");
        }
    }

    #[test]
    fn matches_a_reference_map_with_shared_postings() {
        let mut t = BlockStore::new();
        let mut model: BTreeMap<u64, BTreeMap<u32, u32>> = BTreeMap::new();
        let mut x: u64 = 1;
        for step in 0..100_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 3000;
            let s = (x >> 20) as u32 % 40;
            let rec = (s << 8) | (step & 0x7f) | 0x80;
            match x % 11 {
                0 | 1 => {
                    remove_owner(&mut t, key, s);
                    if let Some(m) = model.get_mut(&key) {
                        m.remove(&s);
                        if m.is_empty() {
                            model.remove(&key);
                        }
                    }
                }
                2 => {
                    // Share one key's posting with the next key (as a chain stored together).
                    if let (Some(a), Some(b)) = (t.find(key), t.find(key + 1)) {
                        let h = t.head(a);
                        t.set_head(b, h);
                        let m = model[&key].clone();
                        model.insert(key + 1, m);
                    }
                }
                _ => {
                    let old = upsert(&mut t, key, rec);
                    let mold = model.entry(key).or_default().insert(s, rec);
                    assert_eq!(old, mold);
                }
            }
            if step % 997 == 0 {
                t.check_refs();
            }
            if step % 1_000 == 0 {
                t.compact(0);
            }
        }
        t.check_refs();
        assert_eq!(t.len(), model.len());
        for (k, m) in &model {
            let got: Vec<u32> = t.find(*k).map(|p| t.records_at(p).to_vec()).unwrap_or_default();
            let want: Vec<u32> = m.values().copied().collect::<BTreeSet<_>>().into_iter().collect();
            assert_eq!(got, want, "key {k}");
        }
        assert_eq!(t.iter().count(), model.len());
        for p in 0..t.positions() {
            if t.head(p) != 0 {
                t.delete(p);
            }
        }
        assert_eq!(t.len(), 0);
        t.compact(0);
        t.maybe_shrink();
        assert_eq!(t.positions(), 0);
        assert!(t.buckets() <= 64);
        for k in model.keys() {
            assert_eq!(t.find(*k), None);
        }
    }

    #[test]
    fn every_key_including_zero_and_chains_are_consecutive() {
        let mut t = BlockStore::new();
        for k in 0..5000u64 {
            t.insert(k * 7, 0x80).unwrap();
        }
        assert_eq!(t.len(), 5000);
        assert_eq!(t.find(0).map(|p| t.records_at(p)), Some(&[0x80][..]));
        assert_eq!(t.find(7 * 4999), Some(4999));
        assert_eq!(t.find_after(10, 77), Some(11));
        assert_eq!(t.find(1), None);
        t.delete(11);
        assert_eq!(t.find_after(10, 77), None, "a free position is not a successor");
        t.check_refs();
    }

    /// A deleted block leaves a dead bucket: lookups do not find it, a store of its key brings
    /// the same position back (no second bucket), and a table full of positions but not of
    /// live blocks is rebuilt at its size without the dead buckets, not grown.
    #[test]
    fn deleted_blocks_leave_dead_buckets_that_a_store_revives() {
        let mut t = BlockStore::new();
        for k in 0..40u64 {
            t.insert(k * 11, 0x80).unwrap();
        }
        t.delete(7);
        assert_eq!((t.find(77), t.len(), t.positions()), (None, 39, 40));
        assert_eq!(t.find_or_insert(77, 0x81), (Some(7), true), "revived where it was");
        assert_eq!((t.records_at(7), t.len()), (&[0x81][..], 40));
        t.delete(8);
        assert_eq!(t.insert(88, 0x82), Some(8), "insert revives too");
        t.check_refs();
        // Churn: every block deleted as soon as the next is stored, the live count constant.
        let buckets = t.buckets();
        for k in 1000..20_000u64 {
            let p = t.insert(k, 0x80).unwrap();
            t.delete(p - 40);
            if k % 1000 == 0 {
                t.check_refs();
            }
        }
        assert_eq!(t.len(), 40);
        assert_eq!(t.buckets(), buckets, "rebuilt at its size, never grown");
        t.check_refs();
        t.compact(0);
        assert_eq!(t.positions(), 40);
        t.check_refs();
        // A compaction renumbers the table in place: dead buckets become tombstones, which
        // lookups go past and inserts reuse.
        let mut t = BlockStore::new();
        for k in 0..48u64 {
            t.insert(k, 0x80).unwrap();
        }
        for p in (0..48).step_by(2) {
            t.delete(p);
        }
        let used = t.used;
        t.compact(0);
        assert_eq!((t.positions(), t.used), (24, used), "renumbered, the dead buckets kept as tombstones");
        assert_eq!(t.buckets.iter().filter(|&&b| b == t.tomb()).count(), 24);
        for k in 0..48u64 {
            assert_eq!(t.find(k), (k % 2 == 1).then_some(k as usize / 2), "key {k}");
        }
        t.check_refs();
        for k in 100..124u64 {
            t.insert(k, 0x80).unwrap();
        }
        assert!(t.used < used + 24, "some inserts reused a tombstone ({} buckets in use)", t.used);
        t.check_refs();
    }

    /// Positions outgrowing their bits widen every bucket in place: every key stays findable
    /// (through `find_or_insert` and `insert`), tags stay those of the wider buckets (a probe
    /// compares them), deletions still find their bucket, and no key is duplicated.
    #[test]
    fn widening_position_bits_keeps_every_key() {
        let mut t = BlockStore::with_pos_bits(8);
        let key = |k: u64| k.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5a5a;
        for k in 0..3000u64 {
            let (p, born) = if k % 2 == 0 { t.find_or_insert(key(k), 0x80) } else { (t.insert(key(k), 0x80), true) };
            assert_eq!((p, born), (Some(k as usize), true), "key {k}");
            if k % 97 == 0 {
                for j in 0..=k {
                    assert_eq!(t.find(key(j)), Some(j as usize), "key {j} after {k} inserts ({} bits)", t.pos_bits);
                }
            }
        }
        assert_eq!(t.pos_bits, 12, "8 → 10 → 12 bits");
        t.check_refs();
        assert_eq!(t.find_or_insert(key(17), 0x80), (Some(17), false), "found, not stored again");
        for b in t.buckets.iter().filter(|&&b| b != 0) {
            let pos = (b & ((1 << t.pos_bits) - 1)) as usize - 1;
            assert_eq!(b >> t.pos_bits, tag_of(mix64(t.keys[pos]), t.pos_bits), "the wider tag of position {pos}");
        }
        for k in (0..3000u64).step_by(3) {
            t.delete(k as usize);
        }
        for k in 0..3000u64 {
            assert_eq!(t.find(key(k)), (k % 3 != 0).then_some(k as usize));
        }
        t.check_refs();
    }

    /// A reservation sizes the table and the arena once: storing that many blocks then neither
    /// rebuilds the table (the same allocation throughout) nor grows the arena, where the same
    /// stores without it do both; positions are widened up front.
    #[test]
    fn a_reservation_stores_its_blocks_without_growing() {
        let key = |k: u64| k.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xa5a5;
        const N: u64 = 5000;
        let fill = |t: &mut BlockStore| {
            for k in 0..N {
                assert_eq!(t.insert(key(k), 0x80), Some(k as usize), "key {k}");
            }
        };
        let mut grown = BlockStore::with_pos_bits(8);
        let start = grown.buckets.len();
        fill(&mut grown);
        assert!(grown.buckets.len() > start * 16, "without a reservation the table grows");
        assert_eq!(grown.pos_bits, 14, "and positions widen as they come: 8 → 10 → 12 → 14");

        let mut t = BlockStore::with_pos_bits(8);
        t.reserve(N as usize).unwrap();
        assert_eq!(t.pos_bits, 14, "positions widened for the reservation at once");
        let (table, buckets) = (t.buckets.as_ptr(), t.buckets.len());
        let (keys, heads) = (t.keys.as_ptr(), t.heads.as_ptr());
        assert!(buckets * 7 >= N as usize * 8 && buckets < N as usize * 8 / 7 + 2 * GROUP, "{buckets}");
        let reserved = t.memory_bytes();
        fill(&mut t);
        assert_eq!((t.buckets.as_ptr(), t.buckets.len()), (table, buckets), "the table was never rebuilt");
        assert_eq!((t.keys.as_ptr(), t.heads.as_ptr()), (keys, heads), "the arena never grew");
        assert_eq!(t.memory_bytes(), reserved, "the memory was all held from the start");
        assert!(reserved < grown.memory_bytes() + (N as usize) * 4, "about what the grown store holds");
        for k in 0..N {
            assert_eq!(t.find(key(k)), Some(k as usize));
        }
        t.check_refs();
        // One more block than reserved: the store grows as usual.
        assert_eq!(t.insert(key(N), 0x80), Some(N as usize));
        assert_eq!(t.find(key(N)), Some(N as usize));
        t.check_refs();
    }

    /// Deletions, compactions, shrinking and clearing keep the reserved room; a reservation of 0
    /// lets the store shrink again.
    #[test]
    fn a_reservation_is_a_floor_the_store_does_not_shrink_below() {
        let key = |k: u64| k.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x3c3c;
        // Store keys 0..n, delete the first `gone`, compact and shrink as the index does.
        let churn = |t: &mut BlockStore, n: u64, gone: usize| {
            for k in 0..n {
                t.insert(key(k), 0x80);
            }
            for pos in 0..gone {
                t.delete(pos);
            }
            t.compact(0);
            t.maybe_shrink();
        };
        let mut t = BlockStore::new();
        t.reserve(4096).unwrap();
        let floor = t.buckets.len();
        churn(&mut t, 4096, 4000);
        assert_eq!(t.buckets.len(), floor, "kept through deletions");
        assert!(t.keys.capacity() >= 4096 && t.heads.capacity() >= 4096, "the arena too");
        for k in 4000..4096u64 {
            assert_eq!(t.find(key(k)), Some(k as usize - 4000), "the survivors, renumbered");
        }
        t.check_refs();
        let (table, arena) = (t.buckets.as_ptr(), t.keys.as_ptr());
        t.clear();
        assert_eq!((t.len(), t.buckets.len()), (0, floor), "a cleared store keeps its reservation");
        assert_eq!((t.buckets.as_ptr(), t.keys.as_ptr()), (table, arena), "its very memory, emptied");
        assert!(t.keys.capacity() >= 4096 && t.find(key(4050)).is_none());
        for k in 0..4096u64 {
            assert_eq!(t.insert(key(k + 7), 0x80), Some(k as usize));
        }
        assert_eq!((t.buckets.as_ptr(), t.keys.as_ptr()), (table, arena), "and stores into it without growing");
        t.check_refs();
        t.clear();
        let reserved = t.memory_bytes();
        t.reserve(0).unwrap();
        assert_eq!(t.buckets.len(), MIN_BUCKETS, "no reservation: an empty store gives its room back");
        assert!(t.memory_bytes() * 20 < reserved, "{} of {reserved} bytes", t.memory_bytes());
        churn(&mut t, 64, 60);
        assert!(t.buckets.len() < floor / 8, "without it the store shrinks: {}", t.buckets.len());
        for k in 60..64u64 {
            assert_eq!(t.find(key(k)), Some(k as usize - 60));
        }
        t.check_refs();
    }

    /// Tombstones survive a widening as tombstones (not as a position).
    #[test]
    fn widening_keeps_tombstones() {
        let mut t = BlockStore::with_pos_bits(8);
        for k in 0..250u64 {
            t.insert(k * 3 + 1, 0x80).unwrap();
        }
        for p in (0..250).step_by(6) {
            t.delete(p);
        }
        t.compact(0);
        let live: Vec<u64> = (0..250u64).filter(|k| k % 6 != 0).map(|k| k * 3 + 1).collect();
        let tombs = t.buckets.iter().filter(|&&b| b == t.tomb()).count();
        assert_eq!(tombs, 42, "the deleted blocks' buckets");
        t.widen();
        assert_eq!((t.pos_bits, t.buckets.iter().filter(|&&b| b == t.tomb()).count()), (10, tombs));
        t.check_refs();
        for k in 1000..1300u64 {
            t.insert(k, 0x80).unwrap();
        }
        for &k in &live {
            assert!(t.find(k).is_some(), "key {k}");
        }
        t.check_refs();
    }

    #[test]
    fn chunks_are_shared_copied_on_write_and_reused() {
        let mut t = BlockStore::new();
        let p = t.insert(1, 1 << 8 | 1).unwrap();
        let q = t.insert(2, 1 << 8 | 1).unwrap();
        let (h, _) = t.derive(t.head(p), 2, slot, |_| Some(2 << 8 | 1));
        let h = h.unwrap();
        t.set_head(p, h);
        t.set_head(q, h);
        // A change to a shared chunk copies it; the other position keeps its records.
        let (h2, old) = t.derive(h, 2, slot, |_| Some(2 << 8 | 5));
        assert_eq!(old, Some(2 << 8 | 1));
        assert_ne!(h2, Some(h));
        t.set_head(q, h2.unwrap());
        assert_eq!(t.records_at(p), &[1 << 8 | 1, 2 << 8 | 1]);
        assert_eq!(t.records_at(q), &[1 << 8 | 1, 2 << 8 | 5]);
        // An exclusive chunk is changed in place.
        let (h3, _) = t.derive(t.head(q), 2, slot, |_| Some(2 << 8 | 6));
        assert_eq!(h3, Some(t.head(q)));
        t.check_refs();
        for s in 3..1000u32 {
            let (h, _) = t.derive(t.head(p), s, slot, |_| Some(s << 8 | 1));
            t.set_head(p, h.unwrap());
        }
        assert_eq!(t.records_at(p).len(), 999, "slots 1 ..= 999");
        assert!(t.records_at(p).windows(2).all(|w| w[0] < w[1]), "chunks stay sorted");
        let arena = t.chunks.len();
        let (h, dropped) = t.filter(t.head(p), |r| slot(r) < 3);
        assert_eq!(dropped, 997);
        assert_eq!(t.records_at(p).len(), 999, "not yet set");
        t.set_head(p, h.unwrap());
        for s in 3..1000u32 {
            let (h, _) = t.derive(t.head(p), s, slot, |_| Some(s << 8 | 1));
            t.set_head(p, h.unwrap());
        }
        assert!(t.chunks.len() <= arena * 2, "free lists are reused");
        t.check_refs();
    }
}
