//! The prefix tokenization cache: segment text -> token ids, least recently used segments
//! dropped beyond a memory budget.

use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, PoisonError};

/// Prefix tokenization cache settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PrefixCacheConfig {
    /// Memory budget in bytes (segment text + 4 bytes per id + [`SEGMENT_OVERHEAD_BYTES`] per
    /// segment); least recently used segments are dropped beyond it.
    pub max_bytes: usize,
    /// Segments longer than this (bytes of text) are tokenized every time and not kept.
    pub max_segment_bytes: usize,
}

/// Default [`PrefixCacheConfig::max_bytes`]: 64 MiB.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 64 << 20;
/// Default [`PrefixCacheConfig::max_segment_bytes`]: 1 MiB.
pub const DEFAULT_MAX_SEGMENT_BYTES: usize = 1 << 20;
/// Bookkeeping bytes counted per cached segment on top of its text and ids (LRU node, hash slot,
/// allocation headers).
pub const SEGMENT_OVERHEAD_BYTES: usize = 96;

impl Default for PrefixCacheConfig {
    fn default() -> Self {
        PrefixCacheConfig { max_bytes: DEFAULT_PREFIX_CACHE_BYTES, max_segment_bytes: DEFAULT_MAX_SEGMENT_BYTES }
    }
}

impl PrefixCacheConfig {
    /// A cache with a memory budget of `max_bytes`.
    pub fn with_max_bytes(max_bytes: usize) -> PrefixCacheConfig {
        PrefixCacheConfig { max_bytes, ..PrefixCacheConfig::default() }
    }
}

/// Counters of a prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PrefixCacheStats {
    /// Segments found in the cache (or earlier in the same text).
    pub hits: u64,
    /// Segments tokenized.
    pub misses: u64,
    /// Ids served without tokenizing; `hit_tokens + miss_tokens` is every id returned (before
    /// post-processor special tokens).
    pub hit_tokens: u64,
    /// Ids produced by tokenizing.
    pub miss_tokens: u64,
    /// Segments dropped to stay within the budget.
    pub evictions: u64,
    /// Segments held now.
    pub entries: usize,
    /// Bytes accounted now (see [`PrefixCacheConfig::max_bytes`]).
    pub bytes: usize,
}

pub(super) struct Segment {
    pub(super) text: Box<str>,
    pub(super) ids: Arc<[u32]>,
}

impl Segment {
    pub(super) fn cost(&self) -> usize {
        self.text.len() + 4 * self.ids.len() + SEGMENT_OVERHEAD_BYTES
    }
}

/// Keys are already xxh3 hashes: the map uses them as they are.
#[derive(Default)]
pub(super) struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// One segment of a text being encoded: its text, its hash, and its ids when the cache had them.
pub(super) type Part<'a> = (&'a str, u64, Option<Arc<[u32]>>);

pub(super) struct CacheState {
    pub(super) lru: lru::LruCache<u64, Segment, BuildHasherDefault<PassThrough>>,
    pub(super) stats: PrefixCacheStats,
}

pub(super) struct PrefixCache {
    pub(super) config: PrefixCacheConfig,
    state: Mutex<CacheState>,
}

impl PrefixCache {
    pub(super) fn new(config: PrefixCacheConfig) -> PrefixCache {
        PrefixCache {
            config,
            state: Mutex::new(CacheState {
                lru: lru::LruCache::unbounded_with_hasher(BuildHasherDefault::default()),
                stats: PrefixCacheStats::default(),
            }),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, CacheState> {
        // The lock is never held across tokenization or user code, so a poisoned state is whole.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
