//! Engine KV-cache events (vLLM and SGLang), decoded from their msgpack wire format.
//!
//! The types here are what the event-fed index consumes; [`decode_batch`] turns one ZMQ payload
//! into an [`EventBatch`] or a typed [`EventError`] (never a partial batch).

use serde::Serialize;

/// Where a block lives on the publishing engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Medium {
    /// GPU memory (also the default when the event names no medium).
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
#[derive(Debug, Clone, PartialEq, Serialize)]
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
}

/// `BlockRemoved`: the engine evicted these blocks from `medium`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BlockRemoved {
    /// Hashes of the removed blocks.
    pub block_hashes: Vec<EngineBlockHash>,
    /// Tier they were removed from.
    pub medium: Medium,
    /// KV-cache group, when given.
    pub group_idx: Option<u32>,
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
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventBatch {
    /// Publisher timestamp (seconds).
    pub ts: f64,
    /// Events, in order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank of the publisher, when given.
    pub data_parallel_rank: Option<i64>,
}
