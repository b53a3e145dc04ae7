//! Block keys for the approximate (tokenizer-free) prefix index.
//!
//! The module is private: its full description is the documentation of [`ApproxHashing`].

#[cfg(not(target_arch = "wasm32"))]
use rapidhash::v3::rapidhash_v3;
#[cfg(target_arch = "wasm32")]
use wide::rapidhash_v3;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::request::{MediaKey, Prompt, RouteRequest};

/// A 64-bit chained block key.
pub type BlockKey = u64;

/// Parameters that define approximate block keys (a policy's `index` section).
///
/// ---
///
/// Block keys for the approximate (tokenizer-free) prefix index.
///
/// A prompt is cut into fixed-size blocks (`index.block_tokens` pseudo-tokens of
/// `index.bytes_per_token` bytes for text; `index.block_tokens` ids of 4 bytes little-endian for
/// token-id prompts); only full blocks count, as in the engines. Keys are chained:
///
/// ```text
/// seed  = xxh3_64(model ‖ 0xff ‖ salt-flag ‖ cache_salt ‖ kind, index.hash_seed)
/// key_0 = mix(seed, rapidhash_v3(block_0)),   key_k = mix(key_{k-1}, rapidhash_v3(block_k))
/// mix(p, b) = lo ^ hi of the 128-bit product (p ⊕ c1)·(b ⊕ c2)
/// ```
///
/// Block contents are hashed with rapidhash v3 (a versioned, portable algorithm: the same keys on
/// every platform, wasm included), about twice as fast as xxh3 on 256-byte blocks without AVX2.
/// On wasm32 the same algorithm runs from this module (`wide`, proven bit-identical to the
/// `rapidhash` crate by a property test), because the crate's 128-bit multiplies cost a
/// `__multi3` call each there.
///
/// so a key identifies the whole prefix up to and including its block, within one model and one
/// tenant (`cache_salt`): two different salts never share a key, and an empty salt is no salt (as
/// vLLM hashes it). Key 0 is reserved (remapped to 1).
///
/// Media in a chat (see `request`): the identity of a media message whose media all have one is
/// mixed into the hash of the block where its content starts (`block_hash ← mix(block_hash,
/// identity)`), so renderings share keys past it only when their media are the same; keys end at
/// the request's key limit (the first media without an identity, or `prompt_embeds`), and what
/// lies past it is counted in [`RequestKeys::unkeyed_blocks`], the prefix-hit denominator's
/// share that can never match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApproxHashing {
    /// Pseudo-tokens per block.
    pub block_tokens: u32,
    /// Bytes per pseudo-token for text prompts.
    pub bytes_per_token: u32,
    /// Seed mixed into every chain.
    pub hash_seed: u64,
}

/// The block keys of one request, flattened over its prompt sequences.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestKeys {
    /// Keys of all full blocks, sequence after sequence.
    pub keys: Vec<BlockKey>,
    /// `keys[seq_starts[i]..seq_starts[i+1]]` belong to sequence `i` (last bound is `keys.len()`).
    pub seq_starts: Vec<u32>,
    /// A hash of the whole request prompt (partial blocks included), used to break ties
    /// deterministically between equally scored endpoints.
    pub anchor: u64,
    /// Tokens per block (for converting matched blocks into tokens).
    pub block_tokens: u32,
    /// Blocks of the prompt past its [`KeyLimit`](crate::request::KeyLimit) (estimated): never
    /// keyed, never matched, but part of the prefix-hit denominator.
    pub unkeyed_blocks: u32,
}

impl RequestKeys {
    /// The prefix-hit denominator: keyed blocks plus [`RequestKeys::unkeyed_blocks`].
    pub fn hit_blocks(&self) -> usize {
        self.keys.len() + self.unkeyed_blocks as usize
    }

    /// Blocks of `tokens` tokens the keys do not cover (past a
    /// [`KeyLimit`](crate::request::KeyLimit)), rounded up: any unkeyed token makes a block, so a
    /// request with a limit is never a full hit.
    pub fn blocks_for(tokens: u64, block_tokens: u32) -> u32 {
        u32::try_from(tokens.div_ceil(u64::from(block_tokens.max(1)))).unwrap_or(u32::MAX)
    }

    /// Iterate over the key slices of each prompt sequence.
    pub fn sequences(&self) -> impl Iterator<Item = &[BlockKey]> + '_ {
        let n = self.seq_starts.len();
        (0..n).map(move |i| {
            let lo = self.seq_starts[i] as usize;
            let hi = self.seq_starts.get(i + 1).map_or(self.keys.len(), |&h| h as usize);
            &self.keys[lo..hi]
        })
    }
}

/// Chain step: a folded 64×64→128-bit multiply of the parent key and the block hash, each
/// offset by a constant (the combining step of wyhash/rapidhash).
/// Token ids as little-endian bytes: a zero-copy view on little-endian targets, a copy into
/// `scratch` elsewhere (keys are the same on every platform).
#[inline]
pub(crate) fn token_bytes<'a>(ids: &'a [u32], scratch: &'a mut Vec<u8>) -> &'a [u8] {
    #[cfg(target_endian = "little")]
    {
        let _ = scratch;
        bytemuck::cast_slice(ids)
    }
    #[cfg(not(target_endian = "little"))]
    {
        scratch.clear();
        scratch.extend(ids.iter().flat_map(|t| t.to_le_bytes()));
        scratch
    }
}

/// rapidhash v3 of `data` (the block hash; the target's fast implementation), for the
/// router's tables keyed by strings (request ids): a few multiplies for a short id, where the
/// streaming xxh3 hasher copies into its buffer first (and on wasm32 calls the compiler
/// runtime's 128-bit multiply). Like any unkeyed hash it does not resist chosen collisions.
pub(crate) fn bytes_hash(data: &[u8]) -> u64 {
    rapidhash_v3(data)
}

#[inline]
fn mix(parent: u64, block_hash: u64) -> u64 {
    match folded_multiply(parent ^ 0xa076_1d64_78bd_642f, block_hash ^ 0xe703_7ed1_a0b4_28db) {
        0 => 1,
        k => k,
    }
}

/// `lo ^ hi` of the 128-bit product `a·b`.
#[cfg(not(target_arch = "wasm32"))]
#[inline]
fn folded_multiply(a: u64, b: u64) -> u64 {
    let m = u128::from(a) * u128::from(b);
    (m as u64) ^ ((m >> 64) as u64)
}

/// `lo ^ hi` of the 128-bit product `a·b` (wasm32: without `__multi3`, see [`wide`]).
#[cfg(target_arch = "wasm32")]
#[inline]
fn folded_multiply(a: u64, b: u64) -> u64 {
    let (lo, hi) = wide::mul_wide(a, b);
    lo ^ hi
}

/// The high 64 bits of the 128-bit product `a·b` (the index's range reduction).
#[cfg(not(target_arch = "wasm32"))]
#[inline]
pub(crate) fn mul_hi(a: u64, b: u64) -> u64 {
    ((u128::from(a) * u128::from(b)) >> 64) as u64
}

/// The high 64 bits of the 128-bit product `a·b` (wasm32: without `__multi3`, see [`wide`]).
#[cfg(target_arch = "wasm32")]
#[inline]
pub(crate) fn mul_hi(a: u64, b: u64) -> u64 {
    wide::mul_wide(a, b).1
}

impl ApproxHashing {
    /// Bytes in one text block.
    pub fn block_bytes(&self) -> usize {
        self.block_tokens as usize * self.bytes_per_token as usize
    }

    /// The chain seed for a model and tenant. An empty `cache_salt` is no salt (vLLM hashes it
    /// as none), so `Some("")` and `None` give the same seed.
    pub fn seed(&self, model: &str, cache_salt: Option<&str>, token_ids: bool) -> u64 {
        let cache_salt = cache_salt.filter(|s| !s.is_empty());
        let mut buf = Vec::with_capacity(model.len() + cache_salt.map_or(0, str::len) + 3);
        buf.extend_from_slice(model.as_bytes());
        buf.push(0xff);
        match cache_salt {
            Some(s) => {
                buf.push(1);
                buf.extend_from_slice(s.as_bytes());
            }
            None => buf.push(0),
        }
        buf.push(if token_ids { b't' } else { b'b' });
        xxh3_64_with_seed(&buf, self.hash_seed)
    }

    /// Compute the keys of a request into `out` (cleared first; its buffers are reused). Keys end
    /// at the request's [`KeyLimit`](crate::request::KeyLimit): the sequence it falls in is keyed
    /// up to it, later sequences not at all, and what is past it counts in
    /// [`RequestKeys::unkeyed_blocks`].
    pub fn request_keys(&self, req: &RouteRequest, out: &mut RequestKeys) {
        out.keys.clear();
        out.seq_starts.clear();
        out.block_tokens = self.block_tokens;
        out.unkeyed_blocks = 0;
        let limit = req.key_limit;
        let salt = req.cache_salt.as_deref();
        let mut anchor = self.hash_seed ^ 0x9e37_79b9_7f4a_7c15;
        let (mut text_seed, mut token_seed) = (None, None);
        let mut scratch: Vec<u8> = Vec::new();
        for (i, p) in req.prompts.iter().enumerate() {
            let start = out.keys.len();
            out.seq_starts.push(u32::try_from(start).unwrap_or(u32::MAX));
            // How much of this sequence may be keyed.
            let keyed = |len: usize| match limit {
                Some(l) if i == l.prompt => l.keyed_len.min(len),
                Some(l) if i > l.prompt => 0,
                _ => len,
            };
            // The anchor covers the whole prompt without hashing it twice: the last full-block
            // key (which chains over every full block) plus the partial tail.
            let (seed, tail_hash) = match p {
                Prompt::Text(bytes) => {
                    let seed = *text_seed.get_or_insert_with(|| self.seed(&req.model, salt, false));
                    let bytes_keyed = &bytes[..keyed(bytes.len())];
                    if i == 0 && !req.media_keys.is_empty() {
                        self.chain_bytes_with_media(seed, bytes_keyed, &req.media_keys, &mut out.keys);
                    } else {
                        self.chain_bytes(seed, bytes_keyed, &mut out.keys);
                    }
                    let n = out.keys.len() - start;
                    (seed, xxh3_64(&bytes[n * self.block_bytes()..]))
                }
                Prompt::Tokens(ids) => {
                    let seed = *token_seed.get_or_insert_with(|| self.seed(&req.model, salt, true));
                    self.chain_tokens(seed, &ids[..keyed(ids.len())], &mut out.keys, &mut scratch);
                    let n = out.keys.len() - start;
                    (seed, xxh3_64(token_bytes(&ids[n * self.block_tokens as usize..], &mut scratch)))
                }
            };
            let last = out.keys[start..].last().copied().unwrap_or(seed);
            anchor = mix(anchor ^ last, tail_hash);
        }
        out.anchor = anchor;
        if let Some(l) = limit {
            // Tokens before the limit in the sequence it falls in that no full keyed block covers.
            let extra = match req.prompts.get(l.prompt) {
                Some(p) => {
                    let lo = out.seq_starts.get(l.prompt).map_or(0, |&s| s as usize);
                    let hi = out.seq_starts.get(l.prompt + 1).map_or(out.keys.len(), |&h| h as usize);
                    let keyed_tokens = (hi - lo) as u64 * u64::from(self.block_tokens);
                    let before = match p {
                        Prompt::Text(b) => (l.keyed_len.min(b.len()) as u64) / u64::from(self.bytes_per_token.max(1)),
                        Prompt::Tokens(t) => l.keyed_len.min(t.len()) as u64,
                    };
                    before.saturating_sub(keyed_tokens)
                }
                None => 0,
            };
            let unkeyed = req.unkeyed_tokens(self.bytes_per_token).saturating_add(extra);
            out.unkeyed_blocks = RequestKeys::blocks_for(unkeyed, self.block_tokens);
        }
    }

    /// Append the chained keys of the full blocks of `bytes`.
    pub fn chain_bytes(&self, seed: u64, bytes: &[u8], out: &mut Vec<BlockKey>) {
        let bs = self.block_bytes();
        let mut parent = seed;
        out.reserve(bytes.len() / bs);
        for block in bytes.chunks_exact(bs) {
            parent = mix(parent, rapidhash_v3(block));
            out.push(parent);
        }
    }

    /// [`ApproxHashing::chain_bytes`] with the identities of media messages: each is mixed into
    /// the hash of the block holding its byte offset (`media` in rendering order), so keys from
    /// that block on are shared only by renderings whose media are the same.
    fn chain_bytes_with_media(&self, seed: u64, bytes: &[u8], media: &[MediaKey], out: &mut Vec<BlockKey>) {
        let bs = self.block_bytes();
        let mut parent = seed;
        let mut media = media.iter().peekable();
        out.reserve(bytes.len() / bs);
        for (b, block) in bytes.chunks_exact(bs).enumerate() {
            let mut h = rapidhash_v3(block);
            while let Some(m) = media.next_if(|m| m.at < (b + 1) * bs) {
                h = mix(h, m.key);
            }
            parent = mix(parent, h);
            out.push(parent);
        }
    }

    /// Append the chained keys of the full blocks of a token-id sequence.
    pub fn chain_tokens(&self, seed: u64, ids: &[u32], out: &mut Vec<BlockKey>, scratch: &mut Vec<u8>) {
        let bt = self.block_tokens as usize;
        let mut parent = seed;
        out.reserve(ids.len() / bt);
        for block in ids.chunks_exact(bt) {
            parent = mix(parent, rapidhash_v3(token_bytes(block, scratch)));
            out.push(parent);
        }
    }
}

/// rapidhash v3 for wasm32, bit-identical to `rapidhash::v3::rapidhash_v3` (default secrets).
///
/// Why a second implementation: the crate computes its 64×64→128-bit multiplies with `u128`, and
/// wasm32 has no such instruction, so each one becomes a call to the compiler runtime's generic
/// 128×128-bit `__multi3` (about 10% of the Envoy filter's time per request). wasm does have a
/// native 64-bit multiply, so here the 128-bit product is built from four 32×32→64-bit partial
/// products. Block keys must not change, so this is the same algorithm step for step (rapidhash
/// v3 as specified by its C++ reference: 7 lanes over 112-byte rounds, up to 6 16-byte tail
/// mixes, the final multiply and the avalanche mix), and a property test compares it with the
/// crate over random inputs of every length class on native targets. Only wasm32 uses it.
#[cfg(any(target_arch = "wasm32", test))]
mod wide {
    /// The rapidhash v3 default secrets (the C++ reference's constants).
    const SECRETS: [u64; 7] = [
        0x2d35_8dcc_aa6c_78a5,
        0x8bb8_4b93_962e_acc9,
        0x4b33_a62e_d433_d4a3,
        0x4d5a_2da5_1de1_aa47,
        0xa076_1d64_78bd_642f,
        0xe703_7ed1_a0b4_28db,
        0x90ed_1765_281c_388c,
    ];
    /// The C++ reference's seed 0, premixed as rapidhash v3 does: `0 ^ mix(0 ^ s2, s1)`.
    const SEED: u64 = fold(SECRETS[2], SECRETS[1]);
    /// Secrets of the (up to 6) 16-byte mixes after the 112-byte rounds, in order.
    const TAIL_SECRETS: [usize; 6] = [2, 2, 1, 1, 2, 1];

    /// The 128-bit product `a·b` as (low, high) 64 bits, from 32-bit limbs.
    #[inline(always)]
    pub(super) const fn mul_wide(a: u64, b: u64) -> (u64, u64) {
        const LO: u64 = 0xffff_ffff;
        let (a0, a1) = (a & LO, a >> 32);
        let (b0, b1) = (b & LO, b >> 32);
        let p00 = a0 * b0;
        let p01 = a0 * b1;
        let p10 = a1 * b0;
        let p11 = a1 * b1;
        // Bits 32..64 of the product and the carries out of them in two sums (three operations
        // fewer than masking all three lower partial products): each sum is at most
        // (2^32 - 1)^2 + (2^32 - 1) < 2^64, and the high halves of both go to `hi`.
        let t = p10 + (p00 >> 32);
        let mid = (t & LO) + p01;
        let lo = (p00 & LO) | (mid << 32);
        let hi = p11 + (t >> 32) + (mid >> 32);
        (lo, hi)
    }

    #[inline(always)]
    const fn fold(a: u64, b: u64) -> u64 {
        let (lo, hi) = mul_wide(a, b);
        lo ^ hi
    }

    #[inline(always)]
    fn le64(d: &[u8], at: usize) -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&d[at..at + 8]);
        u64::from_le_bytes(w)
    }

    #[inline(always)]
    fn le32(d: &[u8], at: usize) -> u64 {
        let mut w = [0u8; 4];
        w.copy_from_slice(&d[at..at + 4]);
        u64::from(u32::from_le_bytes(w))
    }

    /// rapidhash v3 of `data` with the default secrets and seed.
    pub(super) fn rapidhash_v3(data: &[u8]) -> u64 {
        let n = data.len();
        let mut seed = SEED;
        let (mut a, mut b, remainder) = if n <= 16 {
            if n >= 8 {
                seed ^= n as u64;
                (le64(data, 0), le64(data, n - 8), n as u64)
            } else if n >= 4 {
                seed ^= n as u64;
                (le32(data, 0), le32(data, n - 4), n as u64)
            } else if n > 0 {
                ((u64::from(data[0]) << 45) | u64::from(data[n - 1]), u64::from(data[n >> 1]), n as u64)
            } else {
                (0, 0, 0)
            }
        } else {
            let mut rest = data;
            if rest.len() > 112 {
                let mut lanes = [seed; 7];
                while rest.len() > 112 {
                    for (i, lane) in lanes.iter_mut().enumerate() {
                        *lane = fold(le64(rest, 16 * i) ^ SECRETS[i], le64(rest, 16 * i + 8) ^ *lane);
                    }
                    rest = &rest[112..];
                }
                seed = lanes.iter().fold(0, |x, l| x ^ l);
            }
            for (i, &s) in TAIL_SECRETS.iter().enumerate() {
                if rest.len() <= 16 * (i + 1) {
                    break;
                }
                seed = fold(le64(rest, 16 * i) ^ SECRETS[s], le64(rest, 16 * i + 8) ^ seed);
            }
            let r = rest.len() as u64;
            (le64(data, n - 16) ^ r, le64(data, n - 8), r)
        };
        a ^= SECRETS[1];
        b ^= seed;
        (a, b) = mul_wide(a, b);
        fold(a ^ 0xaaaa_aaaa_aaaa_aaaa, b ^ SECRETS[1] ^ remainder)
    }

    #[cfg(test)]
    mod tests {
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(4096))]

            #[test]
            fn multiply_matches_u128(a: u64, b: u64) {
                let m = u128::from(a) * u128::from(b);
                prop_assert_eq!(super::mul_wide(a, b), (m as u64, (m >> 64) as u64));
            }

            /// Every length class of the algorithm: 0..=3, 4..=7, 8..=16, the 16-byte tail
            /// mixes, one and several 112-byte rounds (with and without a tail), the filter's
            /// 256-byte blocks and beyond.
            #[test]
            fn block_hash_matches_the_crate(data in proptest::collection::vec(any::<u8>(), 0..1200)) {
                prop_assert_eq!(super::rapidhash_v3(&data), rapidhash::v3::rapidhash_v3(&data));
            }
        }

        #[test]
        fn every_length_up_to_600_and_extremes() {
            let data: Vec<u8> = (0..600u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
            for n in 0..=data.len() {
                assert_eq!(super::rapidhash_v3(&data[..n]), rapidhash::v3::rapidhash_v3(&data[..n]), "length {n}");
            }
            for fill in [0u8, 0xff] {
                for n in [0, 1, 3, 4, 7, 8, 16, 17, 112, 113, 224, 225, 256] {
                    let d = vec![fill; n];
                    assert_eq!(super::rapidhash_v3(&d), rapidhash::v3::rapidhash_v3(&d), "length {n} of {fill:#x}");
                }
            }
            for (a, b) in [(0, 0), (u64::MAX, u64::MAX), (u64::MAX, 1), (1 << 63, 1 << 63)] {
                let m = u128::from(a) * u128::from(b);
                assert_eq!(super::mul_wide(a, b), (m as u64, (m >> 64) as u64));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precise::DualKeyHashing;

    const H: ApproxHashing = ApproxHashing { block_tokens: 4, bytes_per_token: 4, hash_seed: 0 };

    fn keys(req: &RouteRequest) -> RequestKeys {
        let mut k = RequestKeys::default();
        H.request_keys(req, &mut k);
        k
    }

    #[test]
    fn only_full_blocks_and_chained() {
        let a = keys(&RouteRequest::text("m", &"x".repeat(16 * 3 + 5)));
        assert_eq!(a.keys.len(), 3);
        let b = keys(&RouteRequest::text("m", &format!("{}{}", "x".repeat(16 * 3), "y".repeat(16))));
        assert_eq!(&b.keys[..3], &a.keys[..], "shared prefix, shared keys");
        assert_eq!(b.keys.len(), 4);
        // Identical block content at a different position gets a different key (chaining).
        assert_ne!(a.keys[0], a.keys[1]);
        let c = keys(&RouteRequest::text("m", &format!("{}{}", "z".repeat(16), "x".repeat(32))));
        assert_ne!(c.keys[1], a.keys[1]);
    }

    #[test]
    fn model_and_salt_separate_keys() {
        let p = "p".repeat(64);
        let base = keys(&RouteRequest::text("m", &p));
        let other_model = keys(&RouteRequest::text("m2", &p));
        let mut salted = RouteRequest::text("m", &p);
        salted.cache_salt = Some("tenant-a".into());
        let salted_a = keys(&salted);
        salted.cache_salt = Some("tenant-b".into());
        let salted_b = keys(&salted);
        for (i, k) in base.keys.iter().enumerate() {
            assert_ne!(*k, other_model.keys[i]);
            assert_ne!(*k, salted_a.keys[i]);
            assert_ne!(salted_a.keys[i], salted_b.keys[i]);
        }
        // An empty salt is no salt (vLLM: `if request.cache_salt` adds no extra key for "").
        salted.cache_salt = Some(String::new());
        assert_eq!(keys(&salted), base);
    }

    #[test]
    fn token_prompts_and_batches() {
        let mut r = RouteRequest::text("m", "");
        r.prompts = vec![Prompt::Tokens((0..9).collect()), Prompt::Tokens((0..4).collect())];
        let k = keys(&r);
        assert_eq!(k.keys.len(), 3);
        assert_eq!(k.seq_starts, vec![0, 2]);
        let seqs: Vec<&[u64]> = k.sequences().collect();
        assert_eq!(seqs.len(), 2);
        assert_eq!(seqs[1][0], seqs[0][0], "same first block, same key");
        assert!(k.keys.iter().all(|&k| k != 0));
    }

    #[test]
    fn dual_keys_chain_and_separate_tenants() {
        let d = DualKeyHashing { block_tokens: 4 };
        let mut r = RouteRequest::text("m", "");
        r.prompts = vec![Prompt::Tokens((0..10).collect())];
        let mut k = RequestKeys::default();
        assert!(d.request_keys(&r, &mut k));
        assert_eq!(k.keys.len(), 2);
        // The same chain from an event's point of view: block by block from the root.
        let root = DualKeyHashing::root(None, None);
        let mut out = Vec::new();
        let mut scratch = Vec::new();
        let first = d.chain(root, &[0, 1, 2, 3], &mut out, &mut scratch);
        d.chain(first, &[4, 5, 6, 7], &mut out, &mut scratch);
        assert_eq!(out, k.keys);
        r.cache_salt = Some("t".into());
        let mut salted = RequestKeys::default();
        d.request_keys(&r, &mut salted);
        assert_ne!(salted.keys[0], k.keys[0]);
        r.prompts = vec![Prompt::Text(b"text".to_vec())];
        assert!(!d.request_keys(&r, &mut k));
        assert!(k.keys.is_empty());
        assert_ne!(DualKeyHashing::root(Some("a"), None), DualKeyHashing::root(None, Some("a")));
    }

    #[test]
    fn empty_salt_is_no_salt_in_dual_keys() {
        assert_eq!(DualKeyHashing::root(None, Some("")), DualKeyHashing::root(None, None));
        assert_eq!(DualKeyHashing::root(Some("l"), Some("")), DualKeyHashing::root(Some("l"), None));
        assert_ne!(DualKeyHashing::root(None, Some(" ")), DualKeyHashing::root(None, None));
        let d = DualKeyHashing { block_tokens: 4 };
        let mut r = RouteRequest::text("m", "");
        r.prompts = vec![Prompt::Tokens((0..8).collect())];
        let (mut plain, mut empty) = (RequestKeys::default(), RequestKeys::default());
        assert!(d.request_keys(&r, &mut plain));
        r.cache_salt = Some(String::new());
        assert!(d.request_keys(&r, &mut empty));
        assert_eq!(plain, empty);
    }

    #[test]
    fn media_identities_change_the_keys_from_their_block_on() {
        let mut r = RouteRequest::text("m", &"x".repeat(16 * 4));
        let plain = keys(&r);
        r.media_keys = vec![crate::request::MediaKey { at: 16 + 3, key: 7 }];
        let a = keys(&r);
        assert_eq!(a.keys[0], plain.keys[0], "blocks before the medium are unchanged");
        assert!(a.keys[1..].iter().zip(&plain.keys[1..]).all(|(x, y)| x != y));
        r.media_keys = vec![crate::request::MediaKey { at: 16 + 3, key: 8 }];
        let b = keys(&r);
        assert_eq!(b.keys[0], a.keys[0]);
        assert!(b.keys[1..].iter().zip(&a.keys[1..]).all(|(x, y)| x != y), "another medium, other keys");
        // At a block boundary the medium belongs to the block it starts.
        r.media_keys = vec![crate::request::MediaKey { at: 32, key: 7 }];
        let c = keys(&r);
        assert_eq!(c.keys[..2], plain.keys[..2]);
        assert_ne!(c.keys[2], plain.keys[2]);
        assert_eq!(c.unkeyed_blocks, 0, "keyed media leave nothing unkeyed");
    }

    #[test]
    fn anchor_covers_partial_blocks() {
        let a = keys(&RouteRequest::text("m", "short-a"));
        let b = keys(&RouteRequest::text("m", "short-b"));
        assert!(a.keys.is_empty() && b.keys.is_empty());
        assert_ne!(a.anchor, b.anchor);
    }
}
