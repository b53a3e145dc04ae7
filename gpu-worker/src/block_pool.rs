//! The paged KV block pool with prefix caching, as vLLM's `BlockPool` keeps it.
//!
//! Every block has a reference count (the running sequences whose block tables hold it) and,
//! once full and computed, the digest of its prefix chain. Blocks nobody references sit in the
//! *free queue*, a doubly linked list in eviction order: allocation takes from its head, and a
//! block that still carries a digest is evicted then (its digest leaves the cache map and a
//! `BlockRemoved` follows). A finished sequence returns its blocks to the tail in reverse order,
//! so its last blocks are evicted first and a shared prefix lives longest (LRU). A prefix-cache
//! hit on a free block takes it out of the queue without copying anything.
//!
//! One difference from vLLM: a digest is cached on one block only. When two sequences compute the
//! same block at once, the second copy is not cached (vLLM keeps both and reports both), so the
//! published events and the pool's cache map always agree exactly.

use std::collections::HashMap;

use kvroute::BlockDigest;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Meta {
    ref_cnt: u32,
    digest: Option<BlockDigest>,
    prev: u32,
    next: u32,
    free: bool,
}

/// The pool's block metadata (the K/V data itself lives in the compute backend).
#[derive(Debug)]
pub(crate) struct BlockPool {
    meta: Vec<Meta>,
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<BlockDigest, u32>,
}

impl BlockPool {
    /// `n` free blocks, queued in id order.
    pub(crate) fn new(n: u32) -> Self {
        let meta = (0..n)
            .map(|i| Meta {
                ref_cnt: 0,
                digest: None,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == n { NIL } else { i + 1 },
                free: true,
            })
            .collect();
        BlockPool {
            meta,
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            num_free: n as usize,
            cached: HashMap::new(),
        }
    }

    pub(crate) fn num_free(&self) -> usize {
        self.num_free
    }

    /// Blocks held by running sequences / all blocks (vLLM's `kv_cache_usage`).
    pub(crate) fn usage(&self) -> f64 {
        if self.meta.is_empty() {
            return 0.0;
        }
        (self.meta.len() - self.num_free) as f64 / self.meta.len() as f64
    }

    /// Blocks that carry a digest (held or free).
    pub(crate) fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// The block holding `digest`, if cached.
    pub(crate) fn lookup(&self, digest: &BlockDigest) -> Option<u32> {
        self.cached.get(digest).copied()
    }

    fn unlink(&mut self, id: u32) {
        let (prev, next) = {
            let m = &self.meta[id as usize];
            (m.prev, m.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.meta[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.meta[next as usize].prev = prev;
        }
        let m = &mut self.meta[id as usize];
        m.prev = NIL;
        m.next = NIL;
        m.free = false;
        self.num_free -= 1;
    }

    fn push_tail(&mut self, id: u32) {
        let tail = self.tail;
        {
            let m = &mut self.meta[id as usize];
            m.prev = tail;
            m.next = NIL;
            m.free = true;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.meta[tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    /// Take a reference on a block (a prefix-cache hit): out of the free queue if it was there.
    pub(crate) fn touch(&mut self, id: u32) {
        if let Some(m) = self.meta.get(id as usize) {
            if m.free {
                self.unlink(id);
            }
            self.meta[id as usize].ref_cnt += 1;
        }
    }

    /// `n` blocks from the head of the free queue, each with one reference. Cached ones are
    /// evicted: their event keys are appended to `evicted`. `None` (nothing changed) when fewer
    /// than `n` are free.
    pub(crate) fn allocate(&mut self, n: usize, evicted: &mut Vec<u64>) -> Option<Vec<u32>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            let m = &mut self.meta[id as usize];
            if let Some(d) = m.digest.take() {
                self.cached.remove(&d);
                evicted.push(d.event_key());
            }
            m.ref_cnt = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Drop one reference on each block, in the order given (give a sequence's blocks last
    /// first: the first ones freed are evicted first).
    pub(crate) fn free(&mut self, ids: impl IntoIterator<Item = u32>) {
        for id in ids {
            let Some(m) = self.meta.get_mut(id as usize) else { continue };
            if m.ref_cnt == 0 {
                continue;
            }
            m.ref_cnt -= 1;
            if m.ref_cnt == 0 {
                self.push_tail(id);
            }
        }
    }

    /// Register a full, computed block under `digest`. `false` when the digest is cached on
    /// another block already (this one stays uncached) or the block carries a digest.
    pub(crate) fn cache(&mut self, id: u32, digest: BlockDigest) -> bool {
        if self.cached.contains_key(&digest) {
            return false;
        }
        let Some(m) = self.meta.get_mut(id as usize) else { return false };
        if m.digest.is_some() {
            return false;
        }
        m.digest = Some(digest);
        self.cached.insert(digest, id);
        true
    }

    /// Whether block `id` carries a digest.
    pub(crate) fn is_cached(&self, id: u32) -> bool {
        self.meta.get(id as usize).is_some_and(|m| m.digest.is_some())
    }

    /// Forget every digest (vLLM's `reset_prefix_cache`); refused while any block is held.
    pub(crate) fn reset(&mut self) -> bool {
        if self.num_free != self.meta.len() {
            return false;
        }
        for m in &mut self.meta {
            m.digest = None;
        }
        self.cached.clear();
        true
    }

    /// Event keys of every cached block, sorted.
    pub(crate) fn cached_keys(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.cached.keys().map(BlockDigest::event_key).collect();
        v.sort_unstable();
        v
    }

    #[cfg(test)]
    fn free_order(&self) -> Vec<u32> {
        let mut v = Vec::new();
        let mut i = self.head;
        while i != NIL {
            v.push(i);
            i = self.meta[i as usize].next;
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(i: u8) -> BlockDigest {
        BlockDigest::from_bytes(&[i; 32]).unwrap()
    }

    #[test]
    fn lru_eviction_order_and_refcounts() {
        let mut p = BlockPool::new(4);
        let mut ev = Vec::new();
        let a = p.allocate(2, &mut ev).unwrap();
        assert_eq!(a, vec![0, 1]);
        assert!(p.cache(0, d(1)) && p.cache(1, d(2)));
        assert!(!p.cache(2, d(1)), "a digest lives on one block only");
        assert_eq!(p.usage(), 0.5);
        // Finish: freed last block first.
        p.free(a.iter().rev().copied());
        assert_eq!(p.free_order(), vec![2, 3, 1, 0]);
        assert_eq!(p.num_free(), 4);
        // A hit on block 0 takes it out of the queue.
        assert_eq!(p.lookup(&d(1)), Some(0));
        p.touch(0);
        assert_eq!(p.free_order(), vec![2, 3, 1]);
        // Allocating 3 evicts the cached block 1 (after the two empty ones).
        let b = p.allocate(3, &mut ev).unwrap();
        assert_eq!(b, vec![2, 3, 1]);
        assert_eq!(ev, vec![d(2).event_key()]);
        assert_eq!(p.lookup(&d(2)), None);
        assert!(p.allocate(1, &mut ev).is_none());
        assert!(!p.reset(), "blocks are held");
        p.free([0, 1, 2, 3]);
        assert_eq!(p.cached_keys(), vec![d(1).event_key()]);
        assert!(p.reset());
        assert_eq!(p.num_cached(), 0);
    }

    #[test]
    fn shared_blocks_stay_until_the_last_reference() {
        let mut p = BlockPool::new(2);
        let mut ev = Vec::new();
        let a = p.allocate(1, &mut ev).unwrap();
        p.cache(a[0], d(9));
        p.touch(a[0]);
        p.free([a[0]]);
        assert_eq!(p.num_free(), 1);
        p.free([a[0]]);
        assert_eq!(p.num_free(), 2);
        p.free([a[0]]);
        assert_eq!(p.num_free(), 2, "extra frees are ignored");
        assert!(p.is_cached(a[0]));
    }
}
