//! Engine KV-cache events (vLLM and SGLang), decoded from their msgpack wire format.
//!
//! The module is private: its full description is the documentation of [`EventBatch`].

mod decode;

pub use decode::decode_batch;

use serde::Serialize;
use std::fmt;

/// Where a block lives on the publishing engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Medium {
    /// GPU memory (also the default when the event names no medium).
    #[default]
    Gpu,
    /// CPU memory (offloaded).
    Cpu,
    /// Storage (offloaded).
    Storage,
}

/// A block hash as published: vLLM's int form (the last 8 bytes of the digest, big-endian),
/// vLLM's bytes form reduced the same way, or SGLang's signed int64 reinterpreted as `u64`.
pub type EngineBlockHash = u64;

/// `BlockStored`: the engine now holds these blocks (one hash per block, in chain order).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BlockStored {
    /// Hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<EngineBlockHash>,
    /// Hash of the block before the first one (`None` for a chain that starts at the root).
    pub parent_block_hash: Option<EngineBlockHash>,
    /// Token ids of all stored blocks, concatenated (`block_size` per block).
    pub token_ids: Vec<u32>,
    /// Tokens per engine block.
    pub block_size: u32,
    /// Deprecated numeric LoRA id.
    pub lora_id: Option<i64>,
    /// Tier.
    pub medium: Medium,
    /// LoRA adapter name, when the blocks belong to one.
    pub lora_name: Option<String>,
    /// KV-cache group (hybrid models), when given.
    pub group_idx: Option<u32>,
    /// The request's cache_salt, when the chain starts here and the engine reports it (vLLM's
    /// untagged `extra_keys` of the first block; SGLang's `cache_salt` field or, in newer
    /// releases, block 0's `extra_keys`). An empty salt is no salt (`None`), as vLLM hashes it.
    pub cache_salt: Option<String>,
    /// Per block (one entry per `block_hashes` entry): a 64-bit fingerprint of the block's
    /// extra keys the router cannot compute from token ids — multimodal `(mm_hash, offset)`
    /// pairs, prompt-embeds digests, any other non-string value — or 0 when the block has none.
    /// Empty when no block has any (the common text-only case). See the module docs.
    pub content_keys: Vec<u64>,
    /// vLLM ≥ 0.33 with `num_hash_lookahead_tokens` > 0: per block, the tokens after the block
    /// that its hash also covers (the hashed extra keys become `(E, *tokens)`). Empty otherwise.
    pub lookahead_token_ids: Vec<Vec<u32>>,
    /// vLLM ≥ 0.33: the secondary offloading tier that produced the event (`None`: primary).
    pub ownership: Option<String>,
    /// vLLM ≥ 0.33 / SGLang: the session whose request triggered the store (or reuse report).
    pub session_id: Option<String>,
}

/// `BlockRemoved`: the engine evicted these blocks from `medium`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BlockRemoved {
    /// Hashes of the removed blocks.
    pub block_hashes: Vec<EngineBlockHash>,
    /// Tier they were removed from.
    pub medium: Medium,
    /// KV-cache group, when given.
    pub group_idx: Option<u32>,
    /// vLLM ≥ 0.33: the secondary offloading tier that produced the event (`None`: primary).
    pub ownership: Option<String>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum KvEvent {
    /// Blocks stored.
    BlockStored(BlockStored),
    /// Blocks removed.
    BlockRemoved(BlockRemoved),
    /// Every block dropped (e.g. a cache reset).
    AllBlocksCleared,
}

/// One published batch: `[ts, events, data_parallel_rank?]`.
///
/// ---
///
/// Engine KV-cache events (vLLM and SGLang), decoded from their msgpack wire format.
///
/// The types here are what the event-fed index consumes; [`decode_batch`] turns one ZMQ payload
/// into an [`EventBatch`] or a typed [`EventError`] (never a partial batch).
///
/// # Wire format accepted
///
/// A payload is one msgpack array `[ts, events, rank?, ...]`: `ts` a float (ints accepted),
/// `events` an array, `rank` an int or nil (vLLM `data_parallel_rank`, SGLang `attn_dp_rank`),
/// absent in old vLLM releases. Further trailing elements are skipped, like msgspec does for
/// `array_like` structs. Each event is either
///
/// - **array-tagged** (vLLM ≤ 0.23): `["BlockStored", block_hashes, parent_block_hash, token_ids,
///   block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
///   kv_cache_spec_sliding_window, ...]`, `["BlockRemoved", block_hashes, medium, group_idx, ...]`,
///   `["AllBlocksCleared", ...]`. Only the positions up to `block_size` (stored) / `block_hashes`
///   (removed) are required; older releases send fewer trailing positions, later positions are
///   skipped;
/// - **map-tagged** (vLLM ≥ 0.24, SGLang): `{"type": "BlockStored", "block_hashes": [...], ...}`.
///   Keys may come in any order; unknown keys are skipped whatever their value
///   (`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`, future fields such as the proposed
///   `block_offsets`). Required: `type`, `block_hashes`, and for `BlockStored` also `token_ids`
///   and `block_size`; a missing `parent_block_hash` means "root", a missing `medium` means GPU.
///   A repeated key: the last value wins. Decoded optional keys: `extra_keys`, `group_idx`,
///   `locality`, `ownership`, `session_id`, `lookahead_token_ids` (vLLM 0.33) and SGLang's
///   `cache_salt`, `session_id`.
///
/// # Extra keys, salts and lookahead (what matters for keys)
///
/// - **`extra_keys`** (vLLM, one entry per block, nil or an array) is the *untagged* form of what
///   vLLM hashes (checked against vLLM 0.33's `to_event_extra_keys`): per block, in order, the
///   LoRA name (a str, on every block when `lora_name` is set), one `(mm_hash, offset)` pair per
///   multimodal item overlapping the block (an array; `offset` is the item's start relative to the
///   block's first token, so it can be negative), the `cache_salt` (a str, block 0 only, and only
///   when non-empty), one prompt-embeds digest (32-byte bin) per block of a prompt-embeds
///   request. With lookahead hashing the entry covers the block *and* its lookahead tokens.
///   The strings of block 0 give [`BlockStored::cache_salt`] (the first string after the LoRA
///   name). Every non-string value of a block is fingerprinted (its raw msgpack bytes, fixed-seed
///   XXH3) into [`BlockStored::content_keys`]: a router cannot compute an image's `mm_hash` or an
///   embedding's digest from token ids, so such blocks must never be keyed like text blocks.
///   Newer SGLang releases put the salt in block 0's `extra_keys` the same way.
/// - **`cache_salt`** (SGLang's field; SGLang does not fold the salt into its block hashes, it
///   namespaces the radix tree): an empty string is no salt, from either place.
/// - **`lookahead_token_ids`** (vLLM 0.33, `num_hash_lookahead_tokens` = L > 0): per block the L
///   tokens after it; vLLM hashes such a block with extra keys `(E, *tokens)`, where `E` is the
///   block's extra keys (or `None`). Kept in [`BlockStored::lookahead_token_ids`].
/// - **`ownership`** (vLLM 0.33 offloading: the secondary tier that produced the event, `None` for
///   the primary one) and **`session_id`** are kept; `locality` `"REMOTE"` places the blocks at
///   the storage tier (see `medium` below).
///
/// Values:
///
/// - **block hashes**: a msgpack uint (vLLM's default int form), a negative int (SGLang's signed
///   int64: its bits are kept, `-1` → `u64::MAX`), or bin (vLLM with
///   `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: the sha256 / xxh3-128 digest) of at least 8 bytes,
///   reduced to its **last 8 bytes big-endian** — the same `u64` vLLM's int form carries;
/// - **medium** (ASCII case-insensitive): `GPU` → [`Medium::Gpu`]; `CPU`, `CPU_PINNED` (SGLang L2)
///   → [`Medium::Cpu`]; `STORAGE`, `DISK` (SGLang L3), `EXTERNAL` (SGLang L4, shared/remote pool)
///   → [`Medium::Storage`]; nil or absent → GPU. Any other string is
///   [`EventError::UnknownMedium`]: a tier we cannot place is reported, not guessed (vLLM's own
///   Mooncake store connector publishes lowercase `"cpu"`, hence the case-insensitivity);
/// - **token ids**: ints in `0..=u32::MAX`. SGLang's EAGLE "bigram" pages publish `[t_j, t_j+1]`
///   pairs instead; for those the first element (the page's own token) is kept;
/// - `block_size`, `group_idx`: ints in `0..=u32::MAX`; `lora_id`, rank: any int fitting `i64`.
///
/// # Errors, limits and cost
///
/// Every failure is an [`EventError`] naming the byte offset, and (through [`ErrorSite`]) the
/// event index and wire field. Declared lengths are checked against the bytes left before
/// anything is allocated, so a 5-byte header claiming 4 billion elements costs nothing; all
/// pre-allocation is bounded by a small multiple of the input size. Skipping unknown values is
/// iterative (no recursion, so no stack overflow on deeply nested input).
///
/// The decoder is a single forward pass over the borrowed bytes: it allocates only the output
/// (`events`, and per `BlockStored` the hash and token vectors, the optional strings, and the
/// content keys and lookahead tokens when the event has them).
///
/// # Offload re-announcements and repeated stores
///
/// vLLM 0.33's offloading connector publishes hash-only placeholder stores (`token_ids` `[]`,
/// `block_size` 0, parent nil) and, with self-describing events, chunk-granular stores that
/// re-announce shared hashes once per chunk; `kv_cache_report_mode="full"` re-emits GPU
/// `BlockStored` for prefix hits. They decode like any other event; what they mean for the
/// index (reference counts on offload tiers, idempotent GPU re-stores, placing hash-only
/// stores) is the precise index's business (see [`KvIndex`](crate::KvIndex)).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventBatch {
    /// Publisher timestamp (seconds).
    pub ts: f64,
    /// Events, in order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank of the publisher, when given.
    pub data_parallel_rank: Option<i64>,
}

/// Where in a batch a decode error was found: the event (by index) and the wire field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ErrorSite {
    /// Index of the event in the batch's `events` array; `None` for the batch envelope.
    pub event: Option<usize>,
    /// Wire field name as the engines spell it (`"ts"`, `"events"`, `"data_parallel_rank"`,
    /// `"block_hashes"`, `"parent_block_hash"`, `"token_ids"`, `"block_size"`, `"lora_id"`,
    /// `"medium"`, `"lora_name"`, `"group_idx"`, `"type"`, `"extra_keys"`, `"cache_salt"`,
    /// `"locality"`, `"ownership"`, `"session_id"`, `"lookahead_token_ids"`), `"key"` for a map key, `"event"`
    /// for the event value itself, `"batch"` for the envelope array, or the name of a skipped
    /// field.
    pub field: &'static str,
}

impl ErrorSite {
    const fn batch(field: &'static str) -> Self {
        ErrorSite { event: None, field }
    }

    const fn event(index: usize, field: &'static str) -> Self {
        ErrorSite { event: Some(index), field }
    }
}

impl fmt::Display for ErrorSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.event, self.field) {
            (None, "batch") => f.write_str("batch array"),
            (None, field) => write!(f, "batch field `{field}`"),
            (Some(i), "event") => write!(f, "event {i}"),
            (Some(i), field) => write!(f, "event {i} field `{field}`"),
        }
    }
}

/// A KV-event payload could not be decoded. Nothing of the batch is applied.
///
/// Every variant carries `offset`, the byte offset (from the start of the payload) of the value
/// at fault, and most an [`ErrorSite`] naming the event index and field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EventError {
    /// The payload ends in the middle of a value.
    #[error("byte {offset}: payload truncated inside {site}")]
    Truncated {
        /// Offset of the value that could not be read in full.
        offset: usize,
        /// Where.
        site: ErrorSite,
    },
    /// A value has the wrong msgpack type.
    #[error("byte {offset}: {site}: expected {expected}, found {found}")]
    WrongType {
        /// Offset of the value.
        offset: usize,
        /// Where.
        site: ErrorSite,
        /// What the format allows there.
        expected: &'static str,
        /// The msgpack type found (`"nil"`, `"bool"`, `"int"`, `"float"`, `"str"`, `"bin"`,
        /// `"array"`, `"map"`, `"ext"`, `"reserved byte 0xc1"`).
        found: &'static str,
    },
    /// An array, map, str or bin header declares more elements or bytes than the payload has left
    /// (checked before any allocation).
    #[error("byte {offset}: {site}: declared length {declared} exceeds the {remaining} bytes left")]
    LengthExceedsInput {
        /// Offset of the header.
        offset: usize,
        /// Where.
        site: ErrorSite,
        /// Elements (arrays, maps) or bytes (str, bin, ext) declared.
        declared: u64,
        /// Bytes left after the header.
        remaining: usize,
    },
    /// An integer does not fit the field (negative or > `u32::MAX` token id, block size or group
    /// index; > `i64::MAX` LoRA id or rank).
    #[error("byte {offset}: {site}: integer {value} out of range ({range})")]
    IntOutOfRange {
        /// Offset of the integer.
        offset: usize,
        /// Where.
        site: ErrorSite,
        /// The value on the wire.
        value: i128,
        /// The accepted range, in words.
        range: &'static str,
    },
    /// A block hash in bytes form is shorter than the 8 bytes its `u64` is taken from.
    #[error("byte {offset}: {site}: hash digest of {len} bytes is shorter than 8")]
    ShortHashDigest {
        /// Offset of the bin value.
        offset: usize,
        /// Where.
        site: ErrorSite,
        /// Digest length in bytes.
        len: usize,
    },
    /// A string is not valid UTF-8.
    #[error("byte {offset}: {site}: string is not valid UTF-8")]
    InvalidUtf8 {
        /// Offset of the str value.
        offset: usize,
        /// Where.
        site: ErrorSite,
    },
    /// An event names a type this decoder does not know.
    #[error("byte {offset}: event {event}: unknown event type {tag:?}")]
    UnknownEventType {
        /// Offset of the tag string.
        offset: usize,
        /// Event index.
        event: usize,
        /// The tag as sent.
        tag: String,
    },
    /// A `medium` string is none of the known tiers (see the module docs for the mapping).
    #[error("byte {offset}: event {event}: unknown medium {medium:?}")]
    UnknownMedium {
        /// Offset of the medium string.
        offset: usize,
        /// Event index.
        event: usize,
        /// The medium as sent.
        medium: String,
    },
    /// A required field is absent (map key missing, or tagged array too short).
    #[error("byte {offset}: event {event}: missing required field `{field}`")]
    MissingField {
        /// Offset of the event.
        offset: usize,
        /// Event index.
        event: usize,
        /// The wire field name.
        field: &'static str,
    },
    /// The batch array has fewer than its two required elements (`ts`, `events`).
    #[error("byte {offset}: batch array has {len} elements, expected at least 2 (ts, events)")]
    BatchTooShort {
        /// Offset of the batch array (0).
        offset: usize,
        /// Elements it declares.
        len: usize,
    },
    /// Bytes follow the batch value.
    #[error("byte {offset}: {remaining} trailing bytes after the batch")]
    TrailingBytes {
        /// Offset just past the batch.
        offset: usize,
        /// Bytes left over.
        remaining: usize,
    },
}

impl EventError {
    /// Byte offset (from the start of the payload) of the value at fault; `<= payload.len()`.
    pub fn offset(&self) -> usize {
        match self {
            EventError::Truncated { offset, .. }
            | EventError::WrongType { offset, .. }
            | EventError::LengthExceedsInput { offset, .. }
            | EventError::IntOutOfRange { offset, .. }
            | EventError::ShortHashDigest { offset, .. }
            | EventError::InvalidUtf8 { offset, .. }
            | EventError::UnknownEventType { offset, .. }
            | EventError::UnknownMedium { offset, .. }
            | EventError::MissingField { offset, .. }
            | EventError::BatchTooShort { offset, .. }
            | EventError::TrailingBytes { offset, .. } => *offset,
        }
    }

    /// Index of the event at fault, when the error is inside an event (`None` for the envelope).
    pub fn event(&self) -> Option<usize> {
        match self {
            EventError::Truncated { site, .. }
            | EventError::WrongType { site, .. }
            | EventError::LengthExceedsInput { site, .. }
            | EventError::IntOutOfRange { site, .. }
            | EventError::ShortHashDigest { site, .. }
            | EventError::InvalidUtf8 { site, .. } => site.event,
            EventError::UnknownEventType { event, .. }
            | EventError::UnknownMedium { event, .. }
            | EventError::MissingField { event, .. } => Some(*event),
            EventError::BatchTooShort { .. } | EventError::TrailingBytes { .. } => None,
        }
    }
}
