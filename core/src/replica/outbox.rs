//! The outbox: this replica's state changes waiting to be published, bounded, taken in batches.

use std::collections::VecDeque;

use super::wire::{self, ENTRY_FRAMING, HEADER_FIXED, KIND_COMPLETE, KIND_EFFECT};
use super::ReplicaConfig;
use crate::effect::RoutingEffect;

/// Encoded entries waiting to be published (oldest first) and the next batch number.
#[derive(Debug, Default)]
pub struct Outbox {
    entries: VecDeque<(u8, Vec<u8>)>,
    bytes: usize,
    next_seq: u64,
    /// Entries dropped because the outbox was full.
    pub dropped: u64,
    /// Batches taken.
    pub batches: u64,
    /// Entries taken.
    pub taken: u64,
    /// Bytes taken.
    pub bytes_taken: u64,
}

impl Outbox {
    /// An empty outbox; the first batch is number 1.
    pub fn new() -> Outbox {
        Outbox { next_seq: 1, ..Outbox::default() }
    }

    /// Entries waiting.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Queue a decision's effect.
    pub fn push_effect(&mut self, cfg: &ReplicaConfig, e: &RoutingEffect) {
        self.push(cfg, KIND_EFFECT, e.encode());
    }

    /// Queue a completion.
    pub fn push_complete(&mut self, cfg: &ReplicaConfig, request_id: &str) {
        self.push(cfg, KIND_COMPLETE, request_id.as_bytes().to_vec());
    }

    fn push(&mut self, cfg: &ReplicaConfig, kind: u8, bytes: Vec<u8>) {
        self.bytes += bytes.len();
        self.entries.push_back((kind, bytes));
        while self.entries.len() > cfg.max_outbox_entries
            || (self.bytes > cfg.max_outbox_bytes && self.entries.len() > 1)
        {
            if let Some((_, b)) = self.entries.pop_front() {
                self.bytes -= b.len();
                self.dropped += 1;
            }
        }
    }

    /// The next batch: the oldest entries up to the batch bounds, or (with `heartbeat`) an empty
    /// batch when nothing waits. `None` when nothing waits and no heartbeat is due.
    pub fn take_batch(&mut self, cfg: &ReplicaConfig, now_ms: u64, heartbeat: bool) -> Option<Vec<u8>> {
        if self.entries.is_empty() && !heartbeat {
            return None;
        }
        let mut n = 0usize;
        let mut size = HEADER_FIXED + cfg.fleet.len() + cfg.replica_id.len();
        for (_, b) in &self.entries {
            if n == cfg.max_batch_entries || (n > 0 && size + ENTRY_FRAMING + b.len() > cfg.max_batch_bytes) {
                break;
            }
            size += ENTRY_FRAMING + b.len();
            n += 1;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let mut out = Vec::with_capacity(size);
        wire::header(&mut out, &cfg.fleet, &cfg.replica_id, cfg.epoch, seq, now_ms, n as u32);
        for (kind, b) in self.entries.drain(..n) {
            self.bytes -= b.len();
            wire::entry(&mut out, kind, &b);
        }
        self.batches += 1;
        self.taken += n as u64;
        self.bytes_taken += out.len() as u64;
        Some(out)
    }
}
