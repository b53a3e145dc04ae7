//! What this replica knows of the others: each one's incarnation, the last batch applied, when it
//! was last heard from. It judges every incoming batch before anything of it is applied.

use std::collections::BTreeMap;

use super::wire::ReplicaBatch;
use super::{ReplicaConfig, ReplicaStats};

#[derive(Debug, Clone)]
struct Peer {
    epoch: u64,
    last_seq: u64,
    last_seen_ms: u64,
    /// Requests of this incarnation may be in flight here.
    has_inflight: bool,
}

/// The verdict on one incoming batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerVerdict {
    /// Apply it.
    Apply,
    /// Apply it; it is the first batch of a new incarnation of a known replica: drop the in-flight
    /// requests of incarnation `old_epoch` first.
    ApplyNewIncarnation {
        /// The incarnation it replaces.
        old_epoch: u64,
    },
    /// A batch of this replica's own previous incarnation (replayed from a stream after a
    /// restart): apply what it says of caches and sessions, not its requests in flight (their
    /// completions died with that incarnation).
    ApplyOwnPast,
    /// Ignore it (counted): own, duplicate, stale, other fleet or unknown replica.
    Ignore,
}

/// The other replicas of the fleet, as seen from this one (an ordered map: no randomly seeded
/// hasher, which inside the Envoy filter would need WASI `random_get`).
#[derive(Debug, Default)]
pub struct PeerTable {
    peers: BTreeMap<String, Peer>,
}

impl PeerTable {
    /// Judge `batch` (received at `now_ms`) and record it; counts go to `stats`.
    pub fn judge(
        &mut self,
        cfg: &ReplicaConfig,
        batch: &ReplicaBatch,
        now_ms: u64,
        stats: &mut ReplicaStats,
    ) -> PeerVerdict {
        if batch.fleet != cfg.fleet {
            stats.wrong_fleet += 1;
            return PeerVerdict::Ignore;
        }
        if batch.replica == cfg.replica_id {
            stats.own += 1;
            return if batch.epoch < cfg.epoch { PeerVerdict::ApplyOwnPast } else { PeerVerdict::Ignore };
        }
        if !cfg.allows(&batch.replica) {
            stats.unknown_replica += 1;
            return PeerVerdict::Ignore;
        }
        let has = !batch.entries.is_empty();
        let Some(p) = self.peers.get_mut(&batch.replica) else {
            self.peers.insert(
                batch.replica.clone(),
                Peer { epoch: batch.epoch, last_seq: batch.seq, last_seen_ms: now_ms, has_inflight: has },
            );
            stats.peers = self.peers.len() as u64;
            return PeerVerdict::Apply;
        };
        if batch.epoch < p.epoch {
            stats.stale += 1;
            return PeerVerdict::Ignore;
        }
        p.last_seen_ms = p.last_seen_ms.max(now_ms);
        if batch.epoch > p.epoch {
            let old_epoch = p.epoch;
            let old_has = p.has_inflight;
            *p = Peer { epoch: batch.epoch, last_seq: batch.seq, last_seen_ms: now_ms, has_inflight: has };
            stats.incarnations += 1;
            return if old_has { PeerVerdict::ApplyNewIncarnation { old_epoch } } else { PeerVerdict::Apply };
        }
        if batch.seq <= p.last_seq {
            stats.duplicates += 1;
            return PeerVerdict::Ignore;
        }
        stats.gaps += batch.seq - p.last_seq - 1;
        p.last_seq = batch.seq;
        p.has_inflight |= has;
        PeerVerdict::Apply
    }

    /// Replicas (and their incarnations) not heard from within `silence_ms` of `now_ms` that may
    /// still have requests in flight here; each is reported once until heard from again.
    pub fn take_silent(&mut self, now_ms: u64, silence_ms: u64) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for (id, p) in &mut self.peers {
            if p.has_inflight && now_ms.saturating_sub(p.last_seen_ms) > silence_ms {
                p.has_inflight = false;
                out.push((id.clone(), p.epoch));
            }
        }
        out.sort();
        out
    }

    /// Replicas heard from.
    pub fn len(&self) -> usize {
        self.peers.len()
    }
}

/// The id under which a request of replica `replica` (incarnation `epoch`) is tracked here: ids are
/// unique only within a replica (generated `kvr-N`, reused client ids).
pub(crate) fn remote_request_id(replica: &str, epoch: u64, id: &str) -> String {
    format!("{}{replica}#{epoch}/{id}", REMOTE_PREFIX)
}

/// The prefix of every remote request id of one incarnation.
pub(crate) fn remote_prefix(replica: &str, epoch: u64) -> String {
    format!("{}{replica}#{epoch}/", REMOTE_PREFIX)
}

/// Remote request ids start with this (a character no HTTP header value carries).
pub(crate) const REMOTE_PREFIX: char = '\u{1}';
