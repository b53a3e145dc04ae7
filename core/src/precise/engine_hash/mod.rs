//! vLLM-exact prefix-cache block hashes.
//!
//! The module is private: its full description is the documentation of [`EngineHasher`].

mod cbor;
mod pickle;

pub use cbor::encode_cbor;
pub use pickle::encode_pickle;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use cbor::Cbor;
use pickle::Pickler;

/// The seed vLLM (≥ 0.29) derives `NONE_HASH` from when `PYTHONHASHSEED` is unset and the
/// algorithm is `sha256` or `sha256_cbor`.
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

/// vLLM's default `--block-size`, tokens.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// vLLM's `--prefix-caching-hash-algo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HashAlgo {
    /// `sha256` (vLLM's default): SHA-256 of the pickle (protocol 5).
    #[default]
    Sha256,
    /// `sha256_cbor`: SHA-256 of the canonical CBOR.
    Sha256Cbor,
    /// `xxhash`: XXH3-128 of the pickle (protocol 5).
    Xxhash,
    /// `xxhash_cbor`: XXH3-128 of the canonical CBOR.
    XxhashCbor,
}

impl HashAlgo {
    /// All algorithms, in vLLM's order.
    pub const ALL: [HashAlgo; 4] = [HashAlgo::Sha256, HashAlgo::Sha256Cbor, HashAlgo::Xxhash, HashAlgo::XxhashCbor];

    /// The name vLLM uses on its command line (`sha256`, `sha256_cbor`, `xxhash`, `xxhash_cbor`).
    pub const fn name(self) -> &'static str {
        match self {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::Xxhash => "xxhash",
            HashAlgo::XxhashCbor => "xxhash_cbor",
        }
    }

    /// Digest length in bytes: 32 for the SHA-256 variants, 16 for the XXH3-128 variants.
    pub const fn digest_len(self) -> usize {
        match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => 32,
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => 16,
        }
    }

    /// Whether vLLM treats the algorithm as collision resistant (and so derives `NONE_HASH` from a
    /// fixed default seed when `PYTHONHASHSEED` is unset).
    pub const fn is_cryptographic(self) -> bool {
        matches!(self, HashAlgo::Sha256 | HashAlgo::Sha256Cbor)
    }

    /// Whether blocks are serialized with CBOR (otherwise pickle).
    pub const fn uses_cbor(self) -> bool {
        matches!(self, HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor)
    }

    fn digest(self, data: &[u8]) -> BlockDigest {
        let mut bytes = [0u8; 32];
        match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => {
                bytes.copy_from_slice(Sha256::digest(data).as_slice());
                BlockDigest { len: 32, bytes }
            }
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => {
                // Python's `xxh3_128_digest` is XXH128_canonicalFromHash: big-endian, high half first.
                bytes[..16].copy_from_slice(&xxh3_128(data).to_be_bytes());
                BlockDigest { len: 16, bytes }
            }
        }
    }

    fn encode(self, parent: &[u8], tokens: &[u32], extra: Option<&[ExtraValue<'_>]>, out: &mut Vec<u8>) {
        if self.uses_cbor() {
            encode_cbor(parent, tokens, extra, out);
        } else {
            encode_pickle(parent, tokens, extra, out);
        }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for HashAlgo {
    type Err = EngineHashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        HashAlgo::ALL.into_iter().find(|a| a.name() == s).ok_or_else(|| EngineHashError::UnknownAlgo(s.to_owned()))
    }
}

/// How vLLM writes LoRA and `cache_salt` into a block's extra keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExtraKeysForm {
    /// vLLM ≤ 0.30: the LoRA name and the salt as bare strings: `(name, salt)`. The LoRA path is
    /// not hashed.
    Untagged,
    /// vLLM ≥ 0.31: tagged tuples `(("lora", name, path), ("cache_salt", salt))`.
    #[default]
    Tagged,
}

/// Where vLLM's `NONE_HASH` (the parent of every first block) comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum NoneHashSeed {
    /// `PYTHONHASHSEED` is unset in the vLLM process: `H("vllm-none-hash")` for `sha256` and
    /// `sha256_cbor`; random (not reproducible) for `xxhash` and `xxhash_cbor`.
    #[default]
    Default,
    /// The value of `PYTHONHASHSEED` in the vLLM process (used verbatim, even `"random"` or `""`).
    PythonHashSeed(String),
}

impl NoneHashSeed {
    /// From the optional value of `PYTHONHASHSEED`.
    pub fn from_env_value(value: Option<&str>) -> Self {
        value.map_or(NoneHashSeed::Default, |v| NoneHashSeed::PythonHashSeed(v.to_owned()))
    }
}

/// Serializable description of an engine's block hashing (for configuration files).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineHashSpec {
    /// `--prefix-caching-hash-algo`.
    pub algo: HashAlgo,
    /// Extra-key form of the engine's vLLM version.
    pub extra_keys: ExtraKeysForm,
    /// `PYTHONHASHSEED` of the engine processes; `None` when unset.
    pub python_hash_seed: Option<String>,
    /// `--block-size`, tokens.
    pub block_size: u32,
    /// vLLM ≥ 0.33 `num_hash_lookahead_tokens` (speculative decoding with a drafter that reads
    /// the tokens after a block): each block's hash also covers that many following tokens.
    /// 0 (the default) when the engine does not use lookahead hashing. (Not serialized when 0,
    /// so configurations without it keep their serialized form and key fingerprint.)
    #[serde(skip_serializing_if = "is_zero")]
    pub lookahead_tokens: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Default for EngineHashSpec {
    fn default() -> Self {
        EngineHashSpec {
            algo: HashAlgo::Sha256,
            extra_keys: ExtraKeysForm::Tagged,
            python_hash_seed: None,
            block_size: DEFAULT_BLOCK_SIZE,
            lookahead_tokens: 0,
        }
    }
}

/// Why vLLM's block hashes cannot be computed as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineHashError {
    /// `xxhash`/`xxhash_cbor` without `PYTHONHASHSEED`: vLLM draws `NONE_HASH` from a random
    /// per-process seed, so no one outside the process can reproduce its block hashes.
    #[error(
        "vLLM derives NONE_HASH for `{algo}` from a random per-process seed unless PYTHONHASHSEED is set, \
         so its block hashes cannot be reproduced: start vLLM with PYTHONHASHSEED=<value> and configure \
         the same python_hash_seed here, or use --prefix-caching-hash-algo sha256 / sha256_cbor, \
         or use dual-key mode (keys learned from BlockStored events)"
    )]
    UnreproducibleNoneHash {
        /// The algorithm asked for.
        algo: HashAlgo,
    },
    /// A block size of zero tokens.
    #[error("engine block size must be at least 1 token")]
    ZeroBlockSize,
    /// A name that is not one of vLLM's hash algorithms.
    #[error("unknown prefix-caching hash algorithm `{0}` (expected sha256, sha256_cbor, xxhash or xxhash_cbor)")]
    UnknownAlgo(String),
    /// The tagged form (vLLM ≥ 0.31) hashes the LoRA path, and vLLM never runs an adapter without
    /// one, so an empty path cannot produce the engine's hashes.
    #[error("LoRA adapter `{name}` has an empty path; vLLM >= 0.31 hashes the adapter path (`lora_path`)")]
    MissingLoraPath {
        /// The adapter name.
        name: String,
    },
    /// A digest that is neither 16 nor 32 bytes long.
    #[error("a vLLM block digest is 16 or 32 bytes, not {0}")]
    BadDigestLength(usize),
}

/// One block hash as vLLM computes it: 32 bytes (SHA-256) or 16 bytes (XXH3-128), stored inline.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockDigest {
    len: u8,
    bytes: [u8; 32],
}

impl BlockDigest {
    /// From raw digest bytes (as in KV events with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    pub fn from_bytes(digest: &[u8]) -> Result<Self, EngineHashError> {
        match digest.len() {
            16 | 32 => {
                let mut bytes = [0u8; 32];
                bytes[..digest.len()].copy_from_slice(digest);
                Ok(BlockDigest { len: digest.len() as u8, bytes })
            }
            n => Err(EngineHashError::BadDigestLength(n)),
        }
    }

    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// The 64-bit key vLLM publishes in KV events for this block (see [`event_key`]).
    pub fn event_key(&self) -> u64 {
        event_key(self.as_bytes())
    }
}

impl AsRef<[u8]> for BlockDigest {
    fn as_ref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl fmt::Display for BlockDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_bytes().iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for BlockDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockDigest({self})")
    }
}

/// The u64 a vLLM KV event carries for a block digest: `int.from_bytes(digest, "big") & (2**64 - 1)`,
/// i.e. the last 8 bytes read big-endian (all bytes if fewer than 8).
pub fn event_key(digest: &[u8]) -> u64 {
    let tail = &digest[digest.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

/// A LoRA adapter as vLLM's `LoRARequest` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoraAdapter<'a> {
    /// `lora_name` (the `model` of a request that selects the adapter).
    pub name: &'a str,
    /// `lora_path`, exactly as the engine holds it (`--lora-modules name=path`, or the `lora_path`
    /// given to `/v1/load_lora_adapter`). Hashed by vLLM ≥ 0.31 only.
    pub path: &'a str,
}

/// The request-level inputs of a block's extra keys that the router knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct BlockExtras<'a> {
    /// The LoRA adapter of the request, if any (hashed into every block).
    pub lora: Option<LoraAdapter<'a>>,
    /// The request's `cache_salt` (hashed into the first block only; empty counts as none).
    pub cache_salt: Option<&'a str>,
}

/// A Python value inside a block's extra keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtraValue<'a> {
    /// `str`.
    Str(&'a str),
    /// `int` (vLLM's multimodal offsets can be negative).
    Int(i64),
    /// `bytes` (e.g. a prompt-embeds digest).
    Bytes(&'a [u8]),
    /// `tuple`.
    Tuple(&'a [ExtraValue<'a>]),
    /// `None` (the `E` of a lookahead block without other extra keys: `(None, *tokens)`).
    None,
}

/// Computes vLLM's block hashes for one engine configuration.
///
/// ---
///
/// vLLM-exact prefix-cache block hashes.
///
/// vLLM names every full KV-cache block of a prompt by a chained hash (see
/// `vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`):
///
/// ```text
/// h_0 = H((NONE_HASH, tuple(tokens_0), extra_0))
/// h_i = H((h_{i-1},   tuple(tokens_i), extra_i))        only FULL blocks; a partial tail has no hash
/// ```
///
/// where `extra_i` is `None` or a tuple of extra keys, and `H` is `--prefix-caching-hash-algo`
/// (`vllm/utils/hashing.py`):
///
/// | algo          | serialization                                   | digest             |
/// |---------------|-------------------------------------------------|--------------------|
/// | `sha256`      | `pickle.dumps(obj, protocol=5)` (the default)   | SHA-256, 32 bytes  |
/// | `sha256_cbor` | `cbor2.dumps(obj, canonical=True)`              | SHA-256, 32 bytes  |
/// | `xxhash`      | `pickle.dumps(obj, protocol=5)`                 | XXH3-128, 16 bytes |
/// | `xxhash_cbor` | `cbor2.dumps(obj, canonical=True)`              | XXH3-128, 16 bytes |
///
/// The XXH3-128 digest is Python's `xxhash.xxh3_128_digest`: the canonical big-endian form, high
/// 64 bits first. KV events carry [`event_key`]: the last 8 bytes of the digest read big-endian.
///
/// **`NONE_HASH`** (the parent of block 0, vLLM ≥ 0.29) is `H(seed)`: the hash of the
/// *serialized seed string* (its pickle or CBOR, not its raw bytes), where `seed` is the
/// `PYTHONHASHSEED` environment variable of the vLLM process if set (any string, even empty),
/// otherwise `"vllm-none-hash"` for `sha256`/`sha256_cbor` and 32 random bytes (hex) per process for
/// `xxhash`/`xxhash_cbor`. The random case cannot be reproduced: [`EngineHasher::new`] refuses it
/// with [`EngineHashError::UnreproducibleNoneHash`]. (vLLM ≤ 0.28 used random bytes for every
/// algorithm unless `PYTHONHASHSEED` was set, and then the same `H(seed)`.)
///
/// **Extra keys**, in this order: LoRA, multimodal, `cache_salt` (first block only; an empty salt
/// counts as none), prompt embeds. This module covers LoRA and `cache_salt` ([`BlockExtras`]); the
/// raw [`EngineHasher::hash_block`] takes any extra keys ([`ExtraValue`]). Their form depends on the
/// vLLM version ([`ExtraKeysForm`]):
///
/// | vLLM    | LoRA                            | cache_salt              |
/// |---------|---------------------------------|-------------------------|
/// | ≤ 0.30  | `name` (a bare str)             | `salt` (a bare str)     |
/// | ≥ 0.31  | `("lora", name, path)`          | `("cache_salt", salt)`  |
///
/// KV events keep publishing the untagged form even in vLLM ≥ 0.31.
///
/// **Lookahead** (vLLM ≥ 0.33 `num_hash_lookahead_tokens` = L, for drafters that read the tokens
/// after a block): block `i`'s extra keys become `(E, *tokens[end_i .. end_i + L])` with `E` the
/// extra keys above (`None` when empty), and a block is hashed only once its L lookahead tokens
/// exist ([`EngineHasher::with_lookahead`], [`EngineHashSpec::lookahead_tokens`]). A router
/// configured without it computes different keys from block 0 on, so it never claims a
/// lookahead engine's blocks (it finds none).
///
/// **Multimodal and prompt-embeds** extra keys (`("mm", mm_hash, offset)`,
/// `("prompt_embeds", digest)`) cannot be computed from token ids: a request's keys never equal
/// such a block's hash nor any hash chained after it, so nothing is claimed past it.
///
/// # Why hand-written serializers
///
/// The digest covers the exact bytes CPython's C pickler and `cbor2` emit, so "a valid encoding"
/// is not enough: pickle must match byte for byte, including the protocol-5 `FRAME` header (one
/// frame, closed before the next object once it reaches 64 KiB; payloads of 64 KiB or more are
/// written outside frames), `MEMOIZE` after every bytes/str/non-empty tuple, the integer opcode
/// chosen by value (`BININT1` < 2⁸ ≤ `BININT2` < 2¹⁶ ≤ `BININT` < 2³¹ ≤ `LONG1`), `TUPLE1..3`
/// versus `MARK … TUPLE`, and `BINGET` where CPython shares one object (the empty string and the
/// one-character Latin-1 strings, the empty and one-byte bytes). General pickle crates do not
/// promise CPython's framing or memo layout, and the shape hashed here is small and fixed, so
/// both encoders are a few dozen lines written against `Modules/_pickle.c` and checked against
/// vectors generated by vLLM itself (`fixtures/hash-vectors/`). Canonical CBOR of this shape is
/// simply the shortest-form heads, written the same way.
///
/// Token ids are `u32` (vLLM's are Python ints; every vocabulary fits). With warm buffers the
/// chain methods do not allocate (with lookahead: one small vector per call).
///
/// # Example
///
/// ```
/// use kvroute::{BlockExtras, EngineHasher, ExtraKeysForm, HashAlgo, NoneHashSeed};
///
/// let hasher = EngineHasher::new(HashAlgo::Sha256Cbor, ExtraKeysForm::Tagged, NoneHashSeed::Default, 16)?;
/// let tokens: Vec<u32> = (0..40).collect(); // 2 full blocks of 16 tokens + 8 tokens without a hash
/// let (mut scratch, mut keys) = (Vec::new(), Vec::new());
/// let extras = BlockExtras { cache_salt: Some("tenant-42"), ..BlockExtras::default() };
/// assert_eq!(hasher.block_keys(&tokens, &extras, &mut scratch, &mut keys)?, 2);
/// assert_eq!(keys.len(), 2);
///
/// // xxhash without PYTHONHASHSEED: vLLM's NONE_HASH is random, the router cannot follow.
/// assert!(EngineHasher::new(HashAlgo::Xxhash, ExtraKeysForm::Tagged, NoneHashSeed::Default, 16).is_err());
/// # Ok::<(), kvroute::EngineHashError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineHasher {
    algo: HashAlgo,
    form: ExtraKeysForm,
    block_size: usize,
    lookahead: usize,
    none_hash: BlockDigest,
}

impl EngineHasher {
    /// A hasher for engines run with `algo`, the extra-key `form` of their vLLM version, the
    /// `PYTHONHASHSEED` they run with, and `block_size` tokens per block.
    ///
    /// Fails with [`EngineHashError::UnreproducibleNoneHash`] for `xxhash`/`xxhash_cbor` without a
    /// `PYTHONHASHSEED` (vLLM's `NONE_HASH` is then random), and with
    /// [`EngineHashError::ZeroBlockSize`] for `block_size == 0`.
    pub fn new(
        algo: HashAlgo,
        form: ExtraKeysForm,
        seed: NoneHashSeed,
        block_size: u32,
    ) -> Result<Self, EngineHashError> {
        if block_size == 0 {
            return Err(EngineHashError::ZeroBlockSize);
        }
        let seed = match &seed {
            NoneHashSeed::PythonHashSeed(s) => s.as_str(),
            NoneHashSeed::Default if algo.is_cryptographic() => DEFAULT_NONE_HASH_SEED,
            NoneHashSeed::Default => return Err(EngineHashError::UnreproducibleNoneHash { algo }),
        };
        let mut buf = Vec::with_capacity(seed.len() + 24);
        if algo.uses_cbor() {
            let mut enc = Cbor { out: &mut buf };
            enc.str(seed);
        } else {
            let mut p = Pickler::new(&mut buf);
            p.save_str(seed);
            p.finish();
        }
        let none_hash = algo.digest(&buf);
        Ok(EngineHasher { algo, form, block_size: block_size as usize, lookahead: 0, none_hash })
    }

    /// The same hasher for an engine run with `num_hash_lookahead_tokens = tokens` (vLLM ≥ 0.33):
    /// block `i`'s extra keys become `(E, *tokens[end_i .. end_i + tokens])`, where `E` is what
    /// they would be otherwise (`None` or the tuple), and a block is hashed only once those
    /// tokens exist (so a prompt's last blocks may have no key).
    #[must_use]
    pub fn with_lookahead(mut self, tokens: u32) -> Self {
        self.lookahead = tokens as usize;
        self
    }

    /// [`EngineHasher::new`] from a configuration section.
    pub fn from_spec(spec: &EngineHashSpec) -> Result<Self, EngineHashError> {
        let seed = NoneHashSeed::from_env_value(spec.python_hash_seed.as_deref());
        Ok(EngineHasher::new(spec.algo, spec.extra_keys, seed, spec.block_size)?.with_lookahead(spec.lookahead_tokens))
    }

    /// Lookahead tokens per block (`num_hash_lookahead_tokens`; 0: none).
    pub fn lookahead_tokens(&self) -> usize {
        self.lookahead
    }

    /// The algorithm.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// The extra-key form.
    pub fn extra_keys_form(&self) -> ExtraKeysForm {
        self.form
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// vLLM's `NONE_HASH` for this configuration (the parent of every first block).
    pub fn none_hash(&self) -> BlockDigest {
        self.none_hash
    }

    /// Append the digests of all full blocks of `tokens` (a whole prompt, from its first token)
    /// to `out`; returns how many were appended. `scratch` is reused for serialization.
    pub fn block_digests(
        &self,
        tokens: &[u32],
        extras: &BlockExtras<'_>,
        scratch: &mut Vec<u8>,
        out: &mut Vec<BlockDigest>,
    ) -> Result<usize, EngineHashError> {
        self.extend_chain(None, tokens, extras, scratch, out)
    }

    /// Like [`EngineHasher::block_digests`], but appends the u64 keys KV events carry.
    pub fn block_keys(
        &self,
        tokens: &[u32],
        extras: &BlockExtras<'_>,
        scratch: &mut Vec<u8>,
        out: &mut Vec<u64>,
    ) -> Result<usize, EngineHashError> {
        out.reserve(tokens.len() / self.block_size);
        let mut n = 0;
        self.chain(None, tokens, extras, scratch, |d| {
            out.push(d.event_key());
            n += 1;
        })?;
        Ok(n)
    }

    /// Continue a chain: hash the full blocks of `tokens`, which start at a block boundary right
    /// after the block whose digest is `parent` (`None`: `tokens` start the prompt, so the
    /// `cache_salt` applies to their first block). Appends to `out`, returns how many.
    pub fn extend_chain(
        &self,
        parent: Option<&BlockDigest>,
        tokens: &[u32],
        extras: &BlockExtras<'_>,
        scratch: &mut Vec<u8>,
        out: &mut Vec<BlockDigest>,
    ) -> Result<usize, EngineHashError> {
        out.reserve(tokens.len() / self.block_size);
        let before = out.len();
        self.chain(parent.copied(), tokens, extras, scratch, |d| out.push(d))?;
        Ok(out.len() - before)
    }

    /// Hash one block: `H((parent or NONE_HASH, tuple(block_tokens), extra))`, with `extra`
    /// exactly as vLLM's `generate_block_hash_extra_keys` would return it (`None` when empty).
    /// For extra keys beyond LoRA and `cache_salt` (multimodal, prompt embeds).
    pub fn hash_block(
        &self,
        parent: Option<&BlockDigest>,
        block_tokens: &[u32],
        extra: Option<&[ExtraValue<'_>]>,
        scratch: &mut Vec<u8>,
    ) -> BlockDigest {
        let parent = parent.unwrap_or(&self.none_hash);
        self.algo.encode(parent.as_bytes(), block_tokens, extra, scratch);
        self.algo.digest(scratch)
    }

    fn chain(
        &self,
        parent: Option<BlockDigest>,
        tokens: &[u32],
        extras: &BlockExtras<'_>,
        scratch: &mut Vec<u8>,
        mut sink: impl FnMut(BlockDigest),
    ) -> Result<(), EngineHashError> {
        let salt = extras.cache_salt.filter(|s| !s.is_empty() && parent.is_none());
        // Stack storage for the extra keys (no allocation per block).
        let (lora_tagged, salt_tagged);
        let mut first = [ExtraValue::Int(0); 2];
        let mut rest = [ExtraValue::Int(0); 1];
        let (mut n_first, mut n_rest) = (0, 0);
        if let Some(lora) = extras.lora {
            let key = match self.form {
                ExtraKeysForm::Untagged => ExtraValue::Str(lora.name),
                ExtraKeysForm::Tagged => {
                    if lora.path.is_empty() {
                        return Err(EngineHashError::MissingLoraPath { name: lora.name.to_owned() });
                    }
                    lora_tagged = [ExtraValue::Str("lora"), ExtraValue::Str(lora.name), ExtraValue::Str(lora.path)];
                    ExtraValue::Tuple(&lora_tagged)
                }
            };
            first[0] = key;
            rest[0] = key;
            (n_first, n_rest) = (1, 1);
        }
        if let Some(salt) = salt {
            first[n_first] = match self.form {
                ExtraKeysForm::Untagged => ExtraValue::Str(salt),
                ExtraKeysForm::Tagged => {
                    salt_tagged = [ExtraValue::Str("cache_salt"), ExtraValue::Str(salt)];
                    ExtraValue::Tuple(&salt_tagged)
                }
            };
            n_first += 1;
        }
        let first = (n_first > 0).then_some(&first[..n_first]);
        let rest = (n_rest > 0).then_some(&rest[..n_rest]);

        let mut parent = parent.unwrap_or(self.none_hash);
        if self.lookahead > 0 {
            // vLLM's `(E, *lookahead_tokens)`; only blocks whose lookahead tokens exist.
            let l = self.lookahead;
            let mut extra: Vec<ExtraValue<'_>> = Vec::with_capacity(1 + l);
            let (first_t, rest_t) = (first.map(ExtraValue::Tuple), rest.map(ExtraValue::Tuple));
            let mut start = 0;
            while start + self.block_size + l <= tokens.len() {
                let end = start + self.block_size;
                extra.clear();
                extra.push((if start == 0 { first_t } else { rest_t }).unwrap_or(ExtraValue::None));
                extra.extend(tokens[end..end + l].iter().map(|&t| ExtraValue::Int(i64::from(t))));
                self.algo.encode(parent.as_bytes(), &tokens[start..end], Some(&extra), scratch);
                parent = self.algo.digest(scratch);
                sink(parent);
                start = end;
            }
            return Ok(());
        }
        let mut is_first = true;
        for block in tokens.chunks_exact(self.block_size) {
            let extra = if is_first { first } else { rest };
            is_first = false;
            self.algo.encode(parent.as_bytes(), block, extra, scratch);
            parent = self.algo.digest(scratch);
            sink(parent);
        }
        Ok(())
    }
}

/// Append each token's encoding (at most 7 bytes): one 8-byte store per token into a buffer
/// grown once, then cut to the bytes used.
#[inline(always)]
fn push_words(out: &mut Vec<u8>, tokens: &[u32], word: impl Fn(u32) -> (u64, usize)) {
    let start = out.len();
    out.resize(start + tokens.len() * 7 + 8, 0);
    let buf = &mut out[start..];
    let mut i = 0;
    for &t in tokens {
        let (w, len) = word(t);
        buf[i..i + 8].copy_from_slice(&w.to_le_bytes());
        i += len;
    }
    out.truncate(start + i);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn event_key_is_last_eight_bytes_big_endian() {
        let d: Vec<u8> = (1..=16).collect();
        assert_eq!(event_key(&d), 0x090a_0b0c_0d0e_0f10);
        assert_eq!(event_key(&[1, 2]), 0x0102);
        assert_eq!(BlockDigest::from_bytes(&d).unwrap().event_key(), 0x090a_0b0c_0d0e_0f10);
    }
}
