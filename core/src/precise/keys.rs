//! Precise request keys: the router's dual keys (an xxh3 chain over token ids, computed alike
//! from requests and from engines' `BlockStored` events) and the engine-key scheme.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::approx::{token_bytes, BlockKey, RequestKeys};
use crate::config::{KeyScheme, PreciseConfig};
use crate::precise::engine_hash::{BlockExtras, EngineHasher, ExtraKeysForm, LoraAdapter};
use crate::request::{Prompt, RouteRequest};

/// How a request's precise keys are computed (one of the two key schemes).
#[derive(Debug, Clone)]
pub enum PreciseKeys {
    /// The router's own chain (see [`DualKeyHashing`]).
    Dual(DualKeyHashing),
    /// The engine's own block hashes.
    Engine {
        /// The engines' hashing.
        hasher: EngineHasher,
        /// LoRA adapter name → path (hashed by vLLM ≥ 0.31).
        lora_paths: std::collections::BTreeMap<String, String>,
    },
}

impl PreciseKeys {
    /// The scheme a precise-index section describes. The policy was validated, so an engine
    /// hasher can be built; should that ever fail, dual keys are used.
    pub fn from_config(p: &PreciseConfig) -> Self {
        match p.keys {
            KeyScheme::Engine => match p.engine_hasher() {
                Ok(hasher) => PreciseKeys::Engine { hasher, lora_paths: p.lora_paths.clone() },
                Err(_) => PreciseKeys::Dual(DualKeyHashing { block_tokens: p.index_block_tokens }),
            },
            KeyScheme::Dual => PreciseKeys::Dual(DualKeyHashing { block_tokens: p.index_block_tokens }),
        }
    }

    /// Tokens per index block.
    pub fn block_tokens(&self) -> u32 {
        match self {
            PreciseKeys::Dual(d) => d.block_tokens,
            PreciseKeys::Engine { hasher, .. } => hasher.block_size() as u32,
        }
    }

    /// The precise keys of a request into `out`. Returns `false` (leaving `out` empty) when they
    /// cannot be computed: a text prompt (no token ids; see the router's tokenizer), or — with
    /// engine keys — a LoRA adapter whose path the engine hashes but the policy does not know.
    pub fn request_keys(&self, req: &RouteRequest, out: &mut RequestKeys, scratch: &mut Vec<u8>) -> bool {
        let limit = req.key_limit;
        let mut seqs: Vec<&[u32]> = Vec::with_capacity(req.prompts.len());
        for (i, p) in req.prompts.iter().enumerate() {
            match p {
                // Keyed up to the request's key limit, as the approximate keys are.
                Prompt::Tokens(ids) => seqs.push(match limit {
                    Some(l) if i == l.prompt => &ids[..l.keyed_len.min(ids.len())],
                    Some(l) if i > l.prompt => &[],
                    _ => ids,
                }),
                Prompt::Text(_) => {
                    clear(out);
                    return false;
                }
            }
        }
        let ok = self.keys_for_tokens(req.lora_adapter.as_deref(), req.cache_salt.as_deref(), &seqs, out, scratch);
        if let Some(l) = limit {
            // What the keys cannot cover still counts in the hit denominator: the ids past the
            // limit, the media (e.g. `prompt_embeds`) and the ids of the cut sequence after its
            // last full block. Every sequence here is token ids, so bytes per token do not apply.
            let bt = u64::from(self.block_tokens().max(1));
            let partial = seqs.get(l.prompt).map_or(0, |s| s.len() as u64 % bt);
            out.unkeyed_blocks = RequestKeys::blocks_for(req.unkeyed_tokens(1) + partial, self.block_tokens());
        }
        ok
    }

    /// The precise keys of token sequences (a request's prompts, tokenized) into `out`.
    pub fn keys_for_tokens(
        &self,
        lora: Option<&str>,
        cache_salt: Option<&str>,
        seqs: &[&[u32]],
        out: &mut RequestKeys,
        scratch: &mut Vec<u8>,
    ) -> bool {
        clear(out);
        out.block_tokens = self.block_tokens();
        let ok = match self {
            PreciseKeys::Dual(d) => {
                let root = DualKeyHashing::root(lora, cache_salt);
                for ids in seqs {
                    out.seq_starts.push(u32::try_from(out.keys.len()).unwrap_or(u32::MAX));
                    out.anchor ^= d.chain(root, ids, &mut out.keys, scratch);
                }
                true
            }
            PreciseKeys::Engine { hasher, lora_paths } => {
                engine_keys(hasher, lora_paths, lora, cache_salt, seqs, out, scratch)
            }
        };
        if !ok {
            clear(out);
        }
        ok
    }
}

fn clear(out: &mut RequestKeys) {
    out.keys.clear();
    out.seq_starts.clear();
    out.anchor = 0;
    out.unkeyed_blocks = 0;
}

fn engine_keys(
    hasher: &EngineHasher,
    lora_paths: &std::collections::BTreeMap<String, String>,
    lora: Option<&str>,
    cache_salt: Option<&str>,
    seqs: &[&[u32]],
    out: &mut RequestKeys,
    scratch: &mut Vec<u8>,
) -> bool {
    let lora = match lora {
        None => None,
        Some(name) => match (lora_paths.get(name), hasher.extra_keys_form()) {
            (Some(path), _) => Some(LoraAdapter { name, path }),
            (None, ExtraKeysForm::Untagged) => Some(LoraAdapter { name, path: "" }),
            (None, ExtraKeysForm::Tagged) => return false,
        },
    };
    let extras = BlockExtras { lora, cache_salt };
    for ids in seqs {
        out.seq_starts.push(u32::try_from(out.keys.len()).unwrap_or(u32::MAX));
        if hasher.block_keys(ids, &extras, scratch, &mut out.keys).is_err() {
            return false;
        }
        out.anchor ^= out.keys.last().copied().unwrap_or(0);
    }
    true
}

/// The request key of an index block whose engine block carries content keys (see
/// [`BlockStored::content_keys`]): a fixed-seed mix of the text chain's key and the content
/// fingerprint, never equal to a key a token-id request computes (up to 64-bit collisions).
pub(super) fn content_key(text_key: u64, content: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(&content.to_le_bytes(), text_key ^ 0x6d6d_2d62_6c6f_636b)
}

/// The router's own precise request keys ("dual keys"): an xxh3-64 chain over token ids in
/// blocks of `block_tokens`, rooted in the LoRA adapter and cache_salt:
///
/// ```text
/// root  = xxh3_64("kvroute-dual" ‖ lora-flag ‖ lora ‖ 0xff ‖ salt-flag ‖ salt)
/// key_k = xxh3_64_with_seed(token ids of block k as u32 LE, key_{k-1})
/// ```
///
/// The same chain is computed from a request's token ids and from an engine's BlockStored event
/// (its token ids, chained from the request key its parent block maps to), so precise routing
/// works without reproducing the engine's own hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DualKeyHashing {
    /// Tokens per index block.
    pub block_tokens: u32,
}

impl DualKeyHashing {
    /// The root of every chain for a LoRA adapter (or none) and a cache_salt (or none). An empty
    /// `cache_salt` is no salt, as vLLM hashes it (`Some("")` and `None` give the same root), for
    /// request keys and for event chains alike.
    pub fn root(lora: Option<&str>, cache_salt: Option<&str>) -> u64 {
        let mut buf = Vec::with_capacity(32);
        buf.extend_from_slice(b"kvroute-dual");
        for part in [lora, cache_salt.filter(|s| !s.is_empty())] {
            match part {
                Some(p) => {
                    buf.push(1);
                    buf.extend_from_slice(p.as_bytes());
                }
                None => buf.push(0),
            }
            buf.push(0xff);
        }
        xxh3_64(&buf)
    }

    /// Append the keys of the full blocks of `ids` chained from `parent`; returns the last key
    /// (or `parent` when `ids` holds no full block).
    pub fn chain(&self, parent: u64, ids: &[u32], out: &mut Vec<BlockKey>, scratch: &mut Vec<u8>) -> u64 {
        let mut p = parent;
        for block in ids.chunks_exact(self.block_tokens as usize) {
            p = xxh3_64_with_seed(token_bytes(block, scratch), p);
            out.push(p);
        }
        p
    }

    /// The keys of a request into `out` (cleared first). Returns `false`, leaving `out` empty,
    /// when a prompt sequence is text (precise keys need token ids). Keys end at the request's
    /// [`KeyLimit`](crate::request::KeyLimit), as in [`ApproxHashing::request_keys`](crate::ApproxHashing::request_keys).
    pub fn request_keys(&self, req: &RouteRequest, out: &mut RequestKeys) -> bool {
        out.keys.clear();
        out.seq_starts.clear();
        out.block_tokens = self.block_tokens;
        out.anchor = 0;
        out.unkeyed_blocks = 0;
        let root = Self::root(req.lora_adapter.as_deref(), req.cache_salt.as_deref());
        let mut scratch = Vec::with_capacity(self.block_tokens as usize * 4);
        let mut extra = 0u64;
        for (i, p) in req.prompts.iter().enumerate() {
            let Prompt::Tokens(ids) = p else {
                out.keys.clear();
                out.seq_starts.clear();
                return false;
            };
            out.seq_starts.push(u32::try_from(out.keys.len()).unwrap_or(u32::MAX));
            let ids = match req.key_limit {
                Some(l) if i == l.prompt => &ids[..l.keyed_len.min(ids.len())],
                Some(l) if i > l.prompt => &[],
                _ => &ids[..],
            };
            let before = out.keys.len();
            let last = self.chain(root, ids, &mut out.keys, &mut scratch);
            out.anchor ^= last;
            if req.key_limit.is_some_and(|l| l.prompt == i) {
                extra = (ids.len() - (out.keys.len() - before) * self.block_tokens as usize) as u64;
            }
        }
        // Token ids are tokens: no byte estimate is involved.
        if req.key_limit.is_some() {
            out.unkeyed_blocks =
                RequestKeys::blocks_for(req.unkeyed_tokens(1).saturating_add(extra), self.block_tokens);
        }
        true
    }
}
