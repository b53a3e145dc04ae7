//! An open-addressing hash table from 64-bit block keys to small sets of 31-bit records.
//!
//! Written here rather than taken from a crate because the index needs three things no
//! general-purpose map offers together: 8-byte buckets, a resumable positional sweep
//! (`retain_at` + a cursor) for incremental garbage collection, and posting lists that live
//! inline when a key has one holder and in a size-classed arena otherwise.
//!
//! Layout:
//! - a bucket is a key tag plus a 32-bit `head`. Two bucket kinds: [`ExactBucket`] (12 bytes: the
//!   whole 64-bit key + head), used by both indexes, and [`FpBucket`] (8 bytes: a 32-bit key
//!   fingerprint + head), for tables where a shared entry is harmless. A head of 0 marks an empty bucket (real
//!   records are never 0). Linear probing from a home position derived from the tag,
//!   any capacity (the home is a multiply-high range reduction), growth by 1.25x at load 7/8
//!   (so the load stays within 0.7–0.875 and memory follows the contents closely), backward-shift
//!   deletion (no tombstones).
//! - `head` with the top bit clear is the single record itself; with the top bit set, its low 31
//!   bits index a chunk in `arena`: `[len | class << 16, rec_0, .., rec_{cap-1}]`,
//!   `cap = 2 << class`. Freed chunks go on a per-class free list (next index in `rec_0`).
//!
//! With [`FpBucket`], keys are stored as 32-bit fingerprints, and the home position is derived from the
//! fingerprint (so the table can be rehashed without the keys). Two keys with equal fingerprints
//! therefore share one entry: among `n` keys about `n² / 2^33` such pairs exist (≈ 57 among 700k
//! keys, measured). A shared entry can make an endpoint that holds one of the two blocks appear to
//! hold the other, i.e. extend a match by one block at one chain position — an error far below the
//! approximate index's own (it records *assumed* residency) — but keys are chained from the
//! tenant's cache_salt, so a client choosing salts can find two tenants whose first keys share a
//! fingerprint in a birthday search of about 2^16 salts (under a second), and one tenant's cached
//! prefix would then steer the other's requests. Both indexes therefore use [`ExactBucket`]: no
//! two distinct keys ever share an entry.

const CHUNK_FLAG: u32 = 1 << 31;
const NONE: u32 = u32::MAX;
const CLASSES: usize = 13; // caps 2 ..= 8192
const MIN_BUCKETS: usize = 64;

/// A bucket layout: how a key is stored and compared (an implementation detail of the index;
/// the two layouts are [`FpBucket`] and [`ExactBucket`]).
pub trait BucketKind: Copy + Default + 'static {
    /// What a lookup compares (a fingerprint or the key itself).
    type Tag: Copy + PartialEq;
    /// The tag of a key.
    fn tag(key: u64) -> Self::Tag;
    /// A well-mixed 64-bit hash of a tag, for the home position.
    fn home_hash(tag: Self::Tag) -> u64;
    /// A bucket holding `tag` and `head`.
    fn make(tag: Self::Tag, head: u32) -> Self;
    /// The stored tag.
    fn stored_tag(&self) -> Self::Tag;
    /// The head (0: empty bucket).
    fn head(&self) -> u32;
    /// Replace the head (never with 0).
    fn set_head(&mut self, head: u32);
}

/// 8-byte bucket: 32-bit key fingerprint + head.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub struct FpBucket(u64);

/// splitmix64's finalizer: a bijective mix.
#[inline]
fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl BucketKind for FpBucket {
    type Tag = u32;
    #[inline]
    fn tag(key: u64) -> u32 {
        (mix64(key) >> 32) as u32
    }
    #[inline]
    fn home_hash(tag: u32) -> u64 {
        u64::from(tag).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
    #[inline]
    fn make(tag: u32, head: u32) -> Self {
        FpBucket((u64::from(tag) << 32) | u64::from(head))
    }
    #[inline]
    fn stored_tag(&self) -> u32 {
        (self.0 >> 32) as u32
    }
    #[inline]
    fn head(&self) -> u32 {
        self.0 as u32
    }
    #[inline]
    fn set_head(&mut self, head: u32) {
        self.0 = (self.0 & !0xffff_ffff) | u64::from(head);
    }
}

/// 12-byte bucket: the whole 64-bit key (as two halves, so no padding) + head.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub struct ExactBucket([u32; 3]);

impl BucketKind for ExactBucket {
    type Tag = u64;
    #[inline]
    fn tag(key: u64) -> u64 {
        key
    }
    #[inline]
    fn home_hash(tag: u64) -> u64 {
        mix64(tag)
    }
    #[inline]
    fn make(tag: u64, head: u32) -> Self {
        ExactBucket([tag as u32, (tag >> 32) as u32, head])
    }
    #[inline]
    fn stored_tag(&self) -> u64 {
        (u64::from(self.0[1]) << 32) | u64::from(self.0[0])
    }
    #[inline]
    fn head(&self) -> u32 {
        self.0[2]
    }
    #[inline]
    fn set_head(&mut self, head: u32) {
        self.0[2] = head;
    }
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

/// The records of one key.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Records<'a> {
    /// Key absent.
    None,
    /// One holder (stored inline in the bucket).
    One(u32),
    /// Several holders (an arena chunk).
    Many(&'a [u32]),
}

impl Records<'_> {
    /// The records as a slice.
    #[inline]
    pub(crate) fn as_slice(&self) -> &[u32] {
        match self {
            Records::None => &[],
            Records::One(r) => std::slice::from_ref(r),
            Records::Many(s) => s,
        }
    }
}

/// Key → set of records. Records are opaque non-zero `u32`s below `1 << 31`.
pub(crate) struct PostingTable<B: BucketKind> {
    buckets: Vec<B>,
    /// Bucket count (any value ≥ `MIN_BUCKETS`).
    n: usize,
    len: usize,
    arena: Vec<u32>,
    free: [u32; CLASSES],
}

#[inline]
fn cap_of(class: u32) -> usize {
    2usize << class
}

impl<B: BucketKind> PostingTable<B> {
    pub(crate) fn new() -> Self {
        Self::with_buckets(MIN_BUCKETS)
    }

    fn with_buckets(n: usize) -> Self {
        let n = n.max(MIN_BUCKETS);
        PostingTable { buckets: vec![B::default(); n], n, len: 0, arena: Vec::new(), free: [NONE; CLASSES] }
    }

    /// Number of keys.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Number of buckets (a sweep pass visits this many positions).
    pub(crate) fn capacity(&self) -> usize {
        self.buckets.len()
    }

    /// Heap bytes held.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<B>() + self.arena.capacity() * 4
    }

    #[inline]
    fn home(&self, tag: B::Tag) -> usize {
        crate::approx::mul_hi(B::home_hash(tag), self.n as u64) as usize
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.n {
            0
        } else {
            i + 1
        }
    }

    /// Hint the CPU to load `key`'s home bucket (callers walking a key sequence prefetch a few
    /// keys ahead so the cache misses of a large table overlap instead of queueing).
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        let i = self.home(B::tag(key));
        prefetch_read(self.buckets.as_ptr().wrapping_add(i).cast());
    }

    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        let tag = B::tag(key);
        let mut i = self.home(tag);
        loop {
            let b = &self.buckets[i];
            if b.head() == 0 {
                return None;
            }
            if b.stored_tag() == tag {
                return Some(i);
            }
            i = self.next(i);
        }
    }

    #[inline]
    fn records_at(&self, i: usize) -> Records<'_> {
        let head = self.buckets[i].head();
        if head & CHUNK_FLAG == 0 {
            Records::One(head)
        } else {
            let c = (head & !CHUNK_FLAG) as usize;
            let len = (self.arena[c] & 0xffff) as usize;
            Records::Many(&self.arena[c + 1..c + 1 + len])
        }
    }

    /// The records of `key` (empty when absent).
    #[inline]
    pub(crate) fn records(&self, key: u64) -> Records<'_> {
        match self.find(key) {
            Some(i) => self.records_at(i),
            None => Records::None,
        }
    }

    /// Replace the record of the same owner (`owner(r) == owner(rec)`) in `key`'s set with
    /// `rec`, returning the old one, or add `rec` (and the key) and return `None`.
    #[cfg(test)]
    pub(crate) fn upsert(&mut self, key: u64, rec: u32, owner: impl Fn(u32) -> u32) -> Option<u32> {
        let who = owner(rec);
        self.upsert_with(key, who, owner, |_| rec)
    }

    /// Set the record of `who` in `key`'s set to `f(old record)` (adding the key and/or the record
    /// when absent). Returns the old record.
    ///
    /// Chunks are kept sorted by record value; `owner` must be monotonic in the record value
    /// (records are owner-major), so the owner is found by binary search.
    pub(crate) fn upsert_with(
        &mut self,
        key: u64,
        who: u32,
        owner: impl Fn(u32) -> u32,
        f: impl FnOnce(Option<u32>) -> u32,
    ) -> Option<u32> {
        if let Some(i) = self.find(key) {
            let head = self.buckets[i].head();
            if head & CHUNK_FLAG == 0 {
                if owner(head) == who {
                    let rec = f(Some(head));
                    debug_assert!(rec != 0 && rec & CHUNK_FLAG == 0);
                    self.buckets[i].set_head(rec);
                    return Some(head);
                }
                let rec = f(None);
                debug_assert!(rec != 0 && rec & CHUNK_FLAG == 0);
                let c = self.alloc(0);
                self.arena[c] = 2; // class 0, len 2
                let (a, b) = if head < rec { (head, rec) } else { (rec, head) };
                self.arena[c + 1] = a;
                self.arena[c + 2] = b;
                self.buckets[i].set_head(CHUNK_FLAG | c as u32);
                return None;
            }
            let c = (head & !CHUNK_FLAG) as usize;
            let len = (self.arena[c] & 0xffff) as usize;
            let pos = match self.arena[c + 1..c + 1 + len].binary_search_by_key(&who, |&r| owner(r)) {
                Ok(pos) => {
                    let old = self.arena[c + 1 + pos];
                    self.arena[c + 1 + pos] = f(Some(old));
                    return Some(old);
                }
                Err(pos) => pos,
            };
            let rec = f(None);
            debug_assert!(rec != 0 && rec & CHUNK_FLAG == 0);
            let class = self.arena[c] >> 16;
            let c = if len == cap_of(class) { self.move_chunk(i, c, len, class + 1) } else { c };
            self.arena.copy_within(c + 1 + pos..c + 1 + len, c + 2 + pos);
            self.arena[c + 1 + pos] = rec;
            self.arena[c] += 1;
            return None;
        }
        let rec = f(None);
        debug_assert!(rec != 0 && rec & CHUNK_FLAG == 0);
        if (self.len + 1) * 8 > self.buckets.len() * 7 {
            self.grow();
        }
        self.place(B::make(B::tag(key), rec));
        self.len += 1;
        None
    }

    fn place(&mut self, b: B) {
        let mut i = self.home(b.stored_tag());
        while self.buckets[i].head() != 0 {
            i = self.next(i);
        }
        self.buckets[i] = b;
    }

    fn grow(&mut self) {
        let n = self.buckets.len() + self.buckets.len() / 4;
        self.rebuild(n);
    }

    fn rebuild(&mut self, n: usize) {
        let old = std::mem::replace(&mut self.buckets, vec![B::default(); n]);
        self.n = n;
        for b in old.into_iter().filter(|b| b.head() != 0) {
            self.place(b);
        }
    }

    /// Shrink the bucket array when it is mostly empty (after large removals).
    pub(crate) fn maybe_shrink(&mut self) {
        let n = self.buckets.len();
        if n > MIN_BUCKETS && self.len * 8 < n {
            let target = (self.len * 2).max(MIN_BUCKETS);
            self.rebuild(target);
            self.buckets.shrink_to_fit();
        }
    }

    fn alloc(&mut self, class: u32) -> usize {
        let f = self.free[class as usize];
        if f != NONE {
            let c = f as usize;
            self.free[class as usize] = self.arena[c + 1];
            return c;
        }
        let c = self.arena.len();
        self.arena.resize(c + 1 + cap_of(class), 0);
        c
    }

    fn release(&mut self, c: usize) {
        let class = (self.arena[c] >> 16) as usize;
        self.arena[c + 1] = self.free[class];
        self.free[class] = c as u32;
    }

    /// Move the chunk of bucket `i` (at `c`, holding `len` records) to `class`.
    fn move_chunk(&mut self, i: usize, c: usize, len: usize, class: u32) -> usize {
        let n = self.alloc(class);
        self.arena.copy_within(c + 1..c + 1 + len, n + 1);
        self.arena[n] = (class << 16) | len as u32;
        self.release(c);
        self.buckets[i].set_head(CHUNK_FLAG | n as u32);
        n
    }

    /// Keep only the records of bucket `i` for which `keep` holds. Returns `true` when the bucket
    /// became empty and was removed (another key may now occupy position `i`).
    pub(crate) fn retain_at(&mut self, i: usize, mut keep: impl FnMut(u32) -> bool) -> bool {
        let head = self.buckets[i].head();
        if head == 0 {
            return false;
        }
        if head & CHUNK_FLAG == 0 {
            if keep(head) {
                return false;
            }
            self.delete_at(i);
            return true;
        }
        let c = (head & !CHUNK_FLAG) as usize;
        let len = (self.arena[c] & 0xffff) as usize;
        let mut w = 0;
        for r in 0..len {
            let rec = self.arena[c + 1 + r];
            if keep(rec) {
                self.arena[c + 1 + w] = rec;
                w += 1;
            }
        }
        let class = self.arena[c] >> 16;
        match w {
            0 => {
                self.release(c);
                self.delete_at(i);
                return true;
            }
            1 => {
                let rec = self.arena[c + 1];
                self.buckets[i].set_head(rec);
                self.release(c);
            }
            _ => {
                self.arena[c] = (class << 16) | w as u32;
                if class > 0 && w * 4 <= cap_of(class) {
                    let target = (2 * w).next_power_of_two().trailing_zeros() - 1;
                    self.move_chunk(i, c, w, target.min(class - 1));
                }
            }
        }
        false
    }

    /// Apply `f` to the record of `who` (`owner(r) == who`) in `key`'s set: `Some(new)` replaces
    /// it, `None` deletes it (and the key when it was the last). Returns the old record, or
    /// `None` (and does nothing) when `who` has no record there.
    pub(crate) fn modify(
        &mut self,
        key: u64,
        who: u32,
        owner: impl Fn(u32) -> u32,
        f: impl FnOnce(u32) -> Option<u32>,
    ) -> Option<u32> {
        let i = self.find(key)?;
        let head = self.buckets[i].head();
        if head & CHUNK_FLAG == 0 {
            if owner(head) != who {
                return None;
            }
            match f(head) {
                Some(new) => self.buckets[i].set_head(new),
                None => self.delete_at(i),
            }
            return Some(head);
        }
        let c = (head & !CHUNK_FLAG) as usize;
        let len = (self.arena[c] & 0xffff) as usize;
        let pos = self.arena[c + 1..c + 1 + len].binary_search_by_key(&who, |&r| owner(r)).ok()?;
        let old = self.arena[c + 1 + pos];
        match f(old) {
            Some(new) => self.arena[c + 1 + pos] = new,
            None => {
                self.retain_at(i, |r| r != old);
            }
        }
        Some(old)
    }

    /// Keep only the records of `key` for which `keep` holds.
    #[cfg(test)]
    pub(crate) fn retain_key(&mut self, key: u64, keep: impl FnMut(u32) -> bool) {
        if let Some(i) = self.find(key) {
            self.retain_at(i, keep);
        }
    }

    fn delete_at(&mut self, mut hole: usize) {
        let n = self.n;
        self.buckets[hole] = B::default();
        self.len -= 1;
        let mut j = self.next(hole);
        while self.buckets[j].head() != 0 {
            let home = self.home(self.buckets[j].stored_tag());
            // Move j into the hole unless its home lies cyclically in (hole, j].
            let dist_home = (j + n - home) % n;
            let dist_hole = (j + n - hole) % n;
            if dist_home >= dist_hole {
                self.buckets[hole] = self.buckets[j];
                self.buckets[j] = B::default();
                hole = j;
            }
            j = self.next(j);
        }
    }

    /// Drop everything.
    pub(crate) fn clear(&mut self) {
        *self = Self::new();
    }

    /// Rebuild keeping only records for which `keep` holds (a full garbage-collection pass).
    pub(crate) fn compact(&mut self, mut keep: impl FnMut(u32) -> bool) {
        let mut i = 0;
        while i < self.buckets.len() {
            if !self.retain_at(i, &mut keep) {
                i += 1;
            }
        }
        // A deletion only moves entries into positions at or after the hole, so no unvisited
        // entry can move behind the scan position.
        self.maybe_shrink();
    }

    /// Iterate over (tag, records) of every key (tests and diagnostics).
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = (B::Tag, Records<'_>)> + '_ {
        (0..self.buckets.len())
            .filter(|&i| self.buckets[i].head() != 0)
            .map(|i| (self.buckets[i].stored_tag(), self.records_at(i)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    fn slot(r: u32) -> u32 {
        r >> 8
    }

    #[test]
    fn bucket_sizes() {
        assert_eq!(std::mem::size_of::<FpBucket>(), 8);
        assert_eq!(std::mem::size_of::<ExactBucket>(), 12);
    }

    #[test]
    fn fingerprints_spread() {
        let fps: BTreeSet<u32> = (0..100_000u64).map(FpBucket::tag).collect();
        assert!(fps.len() > 99_990, "{} distinct", fps.len());
    }

    #[test]
    fn matches_a_reference_map() {
        reference_map::<FpBucket>();
        reference_map::<ExactBucket>();
    }

    #[test]
    fn exact_buckets_store_every_key_including_zero() {
        let mut t: PostingTable<ExactBucket> = PostingTable::new();
        for k in 0..5000u64 {
            t.upsert(k, 0x80 | (k as u32 % 7) << 8, slot);
        }
        assert_eq!(t.len(), 5000);
        assert_eq!(t.records(0).as_slice(), &[0x80]);
        assert_eq!(t.records(4999).as_slice(), &[0x80 | (4999 % 7) << 8]);
        assert!(t.records(5000).as_slice().is_empty());
    }

    fn reference_map<B: BucketKind>() {
        let mut t: PostingTable<B> = PostingTable::new();
        let mut model: BTreeMap<u64, BTreeMap<u32, u32>> = BTreeMap::new();
        let mut x: u64 = 1;
        for step in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = (x % 3000) + 1;
            let s = (x >> 20) as u32 % 40;
            let rec = (s << 8) | (step & 0x7f) | 0x80;
            if x % 7 == 0 {
                // remove slot s from key
                t.retain_key(key, |r| slot(r) != s);
                if let Some(m) = model.get_mut(&key) {
                    m.remove(&s);
                    if m.is_empty() {
                        model.remove(&key);
                    }
                }
            } else {
                let old = t.upsert(key, rec, slot);
                let mold = model.entry(key).or_default().insert(s, rec);
                assert_eq!(old, mold);
            }
        }
        assert_eq!(t.len(), model.len());
        for (k, m) in &model {
            let got: BTreeSet<u32> = t.records(*k).as_slice().iter().copied().collect();
            let want: BTreeSet<u32> = m.values().copied().collect();
            assert_eq!(got, want, "key {k}");
        }
        assert_eq!(t.iter().count(), model.len());
        // Compact away every odd slot; then everything.
        t.compact(|r| slot(r) % 2 == 0);
        for (k, m) in &model {
            let want: BTreeSet<u32> = m.values().copied().filter(|r| slot(*r) % 2 == 0).collect();
            let got: BTreeSet<u32> = t.records(*k).as_slice().iter().copied().collect();
            assert_eq!(got, want);
        }
        t.compact(|_| false);
        assert_eq!(t.len(), 0);
        assert!(t.capacity() <= 64);
        for k in model.keys() {
            assert!(t.records(*k).as_slice().is_empty());
        }
    }

    #[test]
    fn chunks_grow_and_shrink_and_are_reused() {
        let mut t: PostingTable<FpBucket> = PostingTable::new();
        for s in 0..1000u32 {
            assert_eq!(t.upsert(7, s << 8 | 1, slot), None);
        }
        assert_eq!(t.records(7).as_slice().len(), 1000);
        assert!(t.records(7).as_slice().windows(2).all(|w| w[0] < w[1]), "chunks stay sorted");
        let arena_after_grow = t.arena.len();
        t.retain_key(7, |r| slot(r) < 3);
        assert_eq!(t.records(7).as_slice().len(), 3);
        for s in 3..1000u32 {
            t.upsert(7, s << 8 | 1, slot);
        }
        assert_eq!(t.records(7).as_slice().len(), 1000);
        assert!(t.arena.len() <= arena_after_grow * 2, "free lists are reused");
        t.retain_key(7, |r| slot(r) == 5);
        assert_eq!(t.records(7).as_slice(), &[5 << 8 | 1]);
        t.retain_key(7, |_| false);
        assert_eq!(t.len(), 0);
    }
}
