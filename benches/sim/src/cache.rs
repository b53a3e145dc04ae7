//! The simulated endpoints' TRUE prefix cache: what an engine such as vLLM really holds.
//!
//! Prompts are cut into blocks of [`BLOCK_TOKENS`] tokens (64 bytes of the rendered prompt at 4
//! bytes per token, the router's pseudo-token size); each block's key hashes its content together
//! with the key of the block before it (and the model and `cache_salt` for the first), so a block
//! matches only when the whole prefix up to it matches. This is deliberately a different block size
//! and seed from the router's approximate index (64-token blocks): the simulator measures the real
//! effect of routing, not the router's own belief.
//!
//! Eviction is LRU over blocks. A lookup touches the matched blocks and an insertion adds a
//! request's blocks tail-first, so a prompt's head is always more recent than its tail and eviction
//! trims prefixes from the end, as engines do.

use std::hash::{BuildHasherDefault, Hasher};
use std::num::NonZeroUsize;

use kvroute::{ApproxHashing, Prompt};
use lru::LruCache;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Tokens per cache block.
pub const BLOCK_TOKENS: usize = 16;
/// Prompt bytes per token for text prompts.
pub const BYTES_PER_TOKEN: usize = 4;

/// Block keys are already uniformly distributed hashes: use them as they are.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxh3_64_with_seed(bytes, self.0);
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// The chained block keys of one prompt sequence: the core's chained-hash construction
/// ([`ApproxHashing`]) at the engine's block size and with a seed of its own.
pub fn chain(model: &str, cache_salt: Option<&str>, prompt: &Prompt) -> Vec<u64> {
    let h = ApproxHashing {
        block_tokens: BLOCK_TOKENS as u32,
        bytes_per_token: BYTES_PER_TOKEN as u32,
        hash_seed: 0x7472_7574_6800, // "truth": never the router's seed
    };
    let mut out = Vec::new();
    match prompt {
        Prompt::Text(bytes) => h.chain_bytes(h.seed(model, cache_salt, false), bytes, &mut out),
        Prompt::Tokens(ids) => h.chain_tokens(h.seed(model, cache_salt, true), ids, &mut out, &mut Vec::new()),
    }
    out
}

/// An LRU prefix cache over blocks.
pub struct PrefixCache {
    lru: LruCache<u64, (), BuildHasherDefault<KeyHasher>>,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache").field("blocks", &self.lru.len()).field("capacity", &self.lru.cap()).finish()
    }
}

impl PrefixCache {
    /// A cache holding up to `capacity_tokens` tokens (rounded down to whole blocks, at least one).
    pub fn new(capacity_tokens: u64) -> PrefixCache {
        let blocks = usize::try_from(capacity_tokens / BLOCK_TOKENS as u64).unwrap_or(usize::MAX);
        let cap = NonZeroUsize::new(blocks).unwrap_or(NonZeroUsize::MIN);
        PrefixCache { lru: LruCache::with_hasher(cap, BuildHasherDefault::default()) }
    }

    /// Leading blocks of `chain` held, touching them (head most recent).
    pub fn lookup(&mut self, chain: &[u64]) -> usize {
        let n = chain.iter().take_while(|k| self.lru.contains(*k)).count();
        for k in chain[..n].iter().rev() {
            self.lru.promote(k);
        }
        n
    }

    /// Insert (or refresh) every block of `chain`, tail first.
    pub fn insert(&mut self, chain: &[u64]) {
        for &k in chain.iter().rev() {
            self.lru.put(k, ());
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.lru.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.lru.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Prompt {
        Prompt::Text(s.as_bytes().to_vec())
    }

    #[test]
    fn chains_share_prefixes_and_respect_salt() {
        let a = chain("m", None, &text(&"a".repeat(64 * 3 + 10)));
        assert_eq!(a.len(), 3);
        let b = chain("m", None, &text(&format!("{}{}", "a".repeat(128), "b".repeat(64))));
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        let salted = chain("m", Some("t"), &text(&"a".repeat(64)));
        assert_ne!(salted[0], a[0]);
        let other_model = chain("m2", None, &text(&"a".repeat(64)));
        assert_ne!(other_model[0], a[0]);
        assert_eq!(chain("m", None, &Prompt::Tokens((0..40).collect())).len(), 2);
    }

    #[test]
    fn lru_trims_tails_first() {
        let mut c = PrefixCache::new(4 * BLOCK_TOKENS as u64);
        let a = [1, 2, 3];
        c.insert(&a);
        assert_eq!(c.lookup(&a), 3);
        assert_eq!(c.lookup(&[1, 2, 9]), 2);
        c.insert(&[7, 8]);
        // Capacity 4: the oldest blocks go, and they are a's tail.
        assert_eq!(c.len(), 4);
        assert_eq!(c.lookup(&a), 2);
        c.insert(&[10, 11, 12, 13]);
        assert_eq!(c.lookup(&a), 0);
        assert_eq!(c.lookup(&[]), 0);
    }
}
