//! An open-addressing hash table from 64-bit block keys to small sets of 31-bit records.
//!
//! Written here rather than taken from a crate because the index needs three things no
//! general-purpose map offers together: 8-byte buckets, a resumable positional sweep
//! (`retain_at` + a cursor) for incremental garbage collection, and posting lists that live
//! inline when a key has one holder and in a size-classed arena otherwise.
//!
//! Layout:
//! - bucket = one `u64`: a 32-bit key fingerprint (high half) and a 32-bit `head` (low half).
//!   The fingerprint is the top half of a bijective mix of the key; 0 marks an empty bucket (a
//!   real fingerprint of 0 is stored as 1). Linear probing from a home position derived from the
//!   fingerprint, power-of-two capacity, load ≤ 7/8, backward-shift deletion (no tombstones).
//! - `head` with the top bit clear is the single record itself; with the top bit set, its low 31
//!   bits index a chunk in `arena`: `[len | class << 16, rec_0, .., rec_{cap-1}]`,
//!   `cap = 2 << class`. Freed chunks go on a per-class free list (next index in `rec_0`).
//!
//! Keys are stored as 32-bit fingerprints, and the home position is derived from the
//! fingerprint (so the table can be rehashed without the keys). Two keys with equal fingerprints
//! therefore share one entry: among `n` keys about `n² / 2^33` such pairs exist (≈ 57 among 700k
//! keys, measured). A shared entry can make an endpoint that holds one of the two blocks appear to
//! hold the other, i.e. extend a match by one block at one chain position — an error far below the
//! approximate index's own (it records *assumed* residency) and one that buys 8-byte buckets
//! instead of 12 or 16. The event-fed precise index does not use fingerprints.

const CHUNK_FLAG: u32 = 1 << 31;
const NONE: u32 = u32::MAX;
const CLASSES: usize = 13; // caps 2 ..= 8192
const MIN_BUCKETS: usize = 64;

#[derive(Clone, Copy, Default, PartialEq, Eq)]
struct Bucket(u64);

impl Bucket {
    #[inline]
    fn new(fp: u32, head: u32) -> Self {
        Bucket((u64::from(fp) << 32) | u64::from(head))
    }
    #[inline]
    fn fp(self) -> u32 {
        (self.0 >> 32) as u32
    }
    #[inline]
    fn head(self) -> u32 {
        self.0 as u32
    }
    #[inline]
    fn is_empty(self) -> bool {
        self.0 >> 32 == 0
    }
    #[inline]
    fn set_head(&mut self, head: u32) {
        self.0 = (self.0 & !0xffff_ffff) | u64::from(head);
    }
}

/// The 32-bit fingerprint of a key (never 0).
#[inline]
fn fingerprint(key: u64) -> u32 {
    let mut x = key;
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    ((x >> 32) as u32).max(1)
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

/// Key → set of records. Records are opaque `u32`s below `1 << 31`.
pub(crate) struct PostingTable {
    buckets: Vec<Bucket>,
    shift: u32,
    len: usize,
    arena: Vec<u32>,
    free: [u32; CLASSES],
}

#[inline]
fn cap_of(class: u32) -> usize {
    2usize << class
}

impl PostingTable {
    pub(crate) fn new() -> Self {
        Self::with_buckets(MIN_BUCKETS)
    }

    fn with_buckets(n: usize) -> Self {
        let n = n.next_power_of_two().max(MIN_BUCKETS);
        PostingTable {
            buckets: vec![Bucket::default(); n],
            shift: 64 - n.trailing_zeros(),
            len: 0,
            arena: Vec::new(),
            free: [NONE; CLASSES],
        }
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
        self.buckets.capacity() * std::mem::size_of::<Bucket>() + self.arena.capacity() * 4
    }

    #[inline]
    fn home(&self, fp: u32) -> usize {
        (u64::from(fp).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        let fp = fingerprint(key);
        let mask = self.mask();
        let mut i = self.home(fp);
        loop {
            let b = self.buckets[i];
            if b.fp() == fp {
                return Some(i);
            }
            if b.is_empty() {
                return None;
            }
            i = (i + 1) & mask;
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
    ///
    /// Chunks are kept sorted by record value; `owner` must be monotonic in the record value
    /// (records are owner-major), so the owner is found by binary search.
    pub(crate) fn upsert(&mut self, key: u64, rec: u32, owner: impl Fn(u32) -> u32) -> Option<u32> {
        debug_assert_eq!(rec & CHUNK_FLAG, 0);
        let who = owner(rec);
        if let Some(i) = self.find(key) {
            let head = self.buckets[i].head();
            if head & CHUNK_FLAG == 0 {
                if owner(head) == who {
                    self.buckets[i].set_head(rec);
                    return Some(head);
                }
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
                Ok(pos) => return Some(std::mem::replace(&mut self.arena[c + 1 + pos], rec)),
                Err(pos) => pos,
            };
            let class = self.arena[c] >> 16;
            let c = if len == cap_of(class) { self.move_chunk(i, c, len, class + 1) } else { c };
            self.arena.copy_within(c + 1 + pos..c + 1 + len, c + 2 + pos);
            self.arena[c + 1 + pos] = rec;
            self.arena[c] += 1;
            return None;
        }
        if (self.len + 1) * 8 > self.buckets.len() * 7 {
            self.grow();
        }
        self.place(Bucket::new(fingerprint(key), rec));
        self.len += 1;
        None
    }

    fn place(&mut self, b: Bucket) {
        let mask = self.mask();
        let mut i = self.home(b.fp());
        while !self.buckets[i].is_empty() {
            i = (i + 1) & mask;
        }
        self.buckets[i] = b;
    }

    fn grow(&mut self) {
        let n = self.buckets.len() * 2;
        self.rebuild(n);
    }

    fn rebuild(&mut self, n: usize) {
        let old = std::mem::replace(&mut self.buckets, vec![Bucket::default(); n]);
        self.shift = 64 - n.trailing_zeros();
        for b in old.into_iter().filter(|b| !b.is_empty()) {
            self.place(b);
        }
    }

    /// Shrink the bucket array when it is mostly empty (after large removals).
    pub(crate) fn maybe_shrink(&mut self) {
        let n = self.buckets.len();
        if n > MIN_BUCKETS && self.len * 8 < n {
            let target = (self.len * 4).next_power_of_two().max(MIN_BUCKETS);
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
        let b = self.buckets[i];
        if b.is_empty() {
            return false;
        }
        let head = b.head();
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

    /// Keep only the records of `key` for which `keep` holds.
    #[cfg(test)]
    pub(crate) fn retain_key(&mut self, key: u64, keep: impl FnMut(u32) -> bool) {
        if let Some(i) = self.find(key) {
            self.retain_at(i, keep);
        }
    }

    fn delete_at(&mut self, mut hole: usize) {
        let mask = self.mask();
        self.buckets[hole] = Bucket::default();
        self.len -= 1;
        let mut j = (hole + 1) & mask;
        while !self.buckets[j].is_empty() {
            let home = self.home(self.buckets[j].fp());
            // Move j into the hole unless its home lies cyclically in (hole, j].
            let dist_home = j.wrapping_sub(home) & mask;
            let dist_hole = j.wrapping_sub(hole) & mask;
            if dist_home >= dist_hole {
                self.buckets[hole] = self.buckets[j];
                self.buckets[j] = Bucket::default();
                hole = j;
            }
            j = (j + 1) & mask;
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

    /// Iterate over (fingerprint, records) of every key (tests and diagnostics).
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, Records<'_>)> + '_ {
        (0..self.buckets.len())
            .filter(|&i| !self.buckets[i].is_empty())
            .map(|i| (self.buckets[i].fp(), self.records_at(i)))
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
    fn bucket_is_eight_bytes() {
        assert_eq!(std::mem::size_of::<Bucket>(), 8);
    }

    #[test]
    fn fingerprints_are_never_zero_and_spread() {
        let fps: BTreeSet<u32> = (0..100_000u64).map(fingerprint).collect();
        assert!(!fps.contains(&0));
        assert!(fps.len() > 99_990, "{} distinct", fps.len());
    }

    #[test]
    fn matches_a_reference_map() {
        let mut t = PostingTable::new();
        let mut model: BTreeMap<u64, BTreeMap<u32, u32>> = BTreeMap::new();
        let mut x: u64 = 1;
        for step in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = (x % 3000) + 1;
            let s = (x >> 20) as u32 % 40;
            let rec = (s << 8) | (step & 0xff);
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
        let mut t = PostingTable::new();
        for s in 0..1000u32 {
            assert_eq!(t.upsert(7, s << 8, slot), None);
        }
        assert_eq!(t.records(7).as_slice().len(), 1000);
        assert!(t.records(7).as_slice().windows(2).all(|w| w[0] < w[1]), "chunks stay sorted");
        let arena_after_grow = t.arena.len();
        t.retain_key(7, |r| slot(r) < 3);
        assert_eq!(t.records(7).as_slice().len(), 3);
        for s in 3..1000u32 {
            t.upsert(7, s << 8, slot);
        }
        assert_eq!(t.records(7).as_slice().len(), 1000);
        assert!(t.arena.len() <= arena_after_grow * 2, "free lists are reused");
        t.retain_key(7, |r| slot(r) == 5);
        assert_eq!(t.records(7).as_slice(), &[5 << 8]);
        t.retain_key(7, |_| false);
        assert_eq!(t.len(), 0);
    }
}
