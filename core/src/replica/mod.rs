//! Router replicas: the batches of routing-state changes one replica publishes and the others
//! apply (sans-IO; the NATS transport is `nats.rs`, feature `nats`).

mod outbox;
mod peers;
mod wire;

#[cfg(feature = "nats")]
mod nats;

pub(crate) use outbox::Outbox;
pub(crate) use peers::{remote_prefix, remote_request_id, REMOTE_PREFIX};
pub(crate) use peers::{PeerTable, PeerVerdict};
pub use wire::{ReplicaBatch, ReplicaEntry, ReplicaEntryRef, BATCH_MAGIC};

#[cfg(feature = "nats")]
pub use nats::{NatsReplicaOptions, ReplicaPort, Replicator, ReplicatorStats, StreamOptions};

use serde::{Deserialize, Serialize};

/// Longest fleet or replica id (bytes).
pub const MAX_REPLICA_ID_LEN: usize = 64;

/// One router replica's identity and its replication bounds.
///
/// Each replica of a fleet publishes the state changes of its own decisions (the routing effect of
/// every routed request, every completion) in numbered batches, and applies the batches of the
/// others: their requests count as in flight here, their prompts as cached where they were sent,
/// their sessions stick to the same endpoint. See [`RouterCore::enable_replication`](crate::RouterCore::enable_replication).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicaConfig {
    /// The fleet: replicas of one fleet share state; a batch of another fleet is rejected.
    pub fleet: String,
    /// This replica's id, unique in the fleet (`[A-Za-z0-9_-]`, at most 64 bytes).
    pub replica_id: String,
    /// This incarnation of the replica: larger is newer. A replica that restarts must take a larger
    /// epoch (the NATS transport uses its start time in ms); the others then drop the in-flight
    /// requests of its previous incarnation, whose completions were lost with it.
    pub epoch: u64,
    /// Replica ids whose batches are applied; empty: any replica of the fleet. Batches of another
    /// replica are counted (`unknown_replica`) and dropped.
    pub allowed_replicas: Vec<String>,
    /// Queue this router's own decisions and completions for publishing (`false`: apply-only,
    /// for a router whose state changes reach the bus another way, e.g. the Envoy filter's
    /// shared log through its relay).
    pub publish: bool,
    /// Entries waiting to be published, at most (the oldest are dropped beyond, counted in
    /// `outbox_dropped`: while the bus is down routing goes on and memory stays bounded).
    pub max_outbox_entries: usize,
    /// Encoded bytes waiting to be published, at most (the oldest are dropped beyond).
    pub max_outbox_bytes: usize,
    /// Entries per published batch, at most.
    pub max_batch_entries: usize,
    /// Encoded bytes per published batch, at most (NATS' default `max_payload` is 1 MiB); one
    /// larger entry goes alone in its batch.
    pub max_batch_bytes: usize,
    /// A replica heard from neither by a batch nor a heartbeat for this long is gone: its
    /// requests in flight here are dropped (its completions can no longer arrive).
    pub peer_silence_ms: u64,
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        ReplicaConfig {
            fleet: "default".into(),
            replica_id: String::new(),
            epoch: 0,
            allowed_replicas: Vec::new(),
            publish: true,
            max_outbox_entries: 65_536,
            max_outbox_bytes: 64 << 20,
            max_batch_entries: 512,
            max_batch_bytes: 512 << 10,
            peer_silence_ms: 30_000,
        }
    }
}

impl ReplicaConfig {
    /// A configuration for replica `replica_id` of `fleet`, incarnation `epoch`, with the default
    /// bounds.
    pub fn new(fleet: &str, replica_id: &str, epoch: u64) -> ReplicaConfig {
        ReplicaConfig { fleet: fleet.into(), replica_id: replica_id.into(), epoch, ..ReplicaConfig::default() }
    }

    /// Check ids and bounds.
    pub fn validate(&self) -> Result<(), ReplicaError> {
        validate_id("fleet", &self.fleet)?;
        validate_id("replica_id", &self.replica_id)?;
        for r in &self.allowed_replicas {
            validate_id("allowed_replicas", r)?;
        }
        let positive = [
            ("max_outbox_entries", self.max_outbox_entries as u64),
            ("max_outbox_bytes", self.max_outbox_bytes as u64),
            ("max_batch_entries", self.max_batch_entries as u64),
            ("max_batch_bytes", self.max_batch_bytes as u64),
            ("peer_silence_ms", self.peer_silence_ms),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(ReplicaError::Config { field, reason: "must be > 0".into() });
            }
        }
        if self.max_batch_entries > u32::MAX as usize {
            return Err(ReplicaError::Config { field: "max_batch_entries", reason: "too large".into() });
        }
        Ok(())
    }

    pub(crate) fn allows(&self, replica: &str) -> bool {
        self.allowed_replicas.is_empty() || self.allowed_replicas.iter().any(|r| r == replica)
    }
}

/// A fleet or replica id usable as one NATS subject token: `[A-Za-z0-9_-]`, 1 to 64 bytes.
pub fn validate_replica_id(id: &str) -> Result<(), ReplicaError> {
    validate_id("replica_id", id)
}

fn validate_id(field: &'static str, id: &str) -> Result<(), ReplicaError> {
    if id.is_empty() || id.len() > MAX_REPLICA_ID_LEN {
        return Err(ReplicaError::Config { field, reason: format!("{id:?}: must be 1 to {MAX_REPLICA_ID_LEN} bytes") });
    }
    if !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Err(ReplicaError::Config { field, reason: format!("{id:?}: only [A-Za-z0-9_-]") });
    }
    Ok(())
}

/// Replication failed or was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplicaError {
    /// An invalid replication setting.
    #[error("invalid replication setting {field}: {reason}")]
    Config {
        /// The setting.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// Replication is not enabled on this router.
    #[error("replication is not enabled")]
    NotEnabled,
    /// The router replicates already (a transport runs for it): stop that one first.
    #[error("the router already replicates as {replica_id:?}: stop that replication first")]
    AlreadyEnabled {
        /// The replica id it replicates as.
        replica_id: String,
    },
    /// The batch's bytes are not a replica batch (truncated, bad magic, unknown version, a bad
    /// entry). Nothing of it was applied.
    #[error("malformed replica batch: {0}")]
    Malformed(String),
    /// The transport could not start (bad URL, credentials file, runtime).
    #[error("replication transport: {0}")]
    Transport(String),
}

/// Replication counters (see [`RouterCore::replica_stats`](crate::RouterCore::replica_stats)).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReplicaStats {
    /// This replica's id and epoch.
    pub replica_id: String,
    /// This incarnation.
    pub epoch: u64,
    /// Batches taken for publishing (heartbeats included).
    pub batches_out: u64,
    /// Entries taken for publishing.
    pub entries_out: u64,
    /// Encoded bytes taken for publishing.
    pub bytes_out: u64,
    /// Entries dropped from a full outbox (the oldest first).
    pub outbox_dropped: u64,
    /// Entries waiting in the outbox.
    pub outbox_len: u64,
    /// Batches of other replicas applied.
    pub batches_in: u64,
    /// Routing effects of other replicas applied.
    pub effects_applied: u64,
    /// Completions of other replicas applied.
    pub completions_applied: u64,
    /// Completions whose request was not in flight here (already expired, or its effect lost).
    pub completions_unknown: u64,
    /// Effects naming an endpoint this replica does not have (skipped; the rest of the batch is
    /// applied).
    pub effects_unknown_endpoint: u64,
    /// Batches that failed to decode (nothing of them applied).
    pub malformed: u64,
    /// Batches of a replica not in `allowed_replicas`.
    pub unknown_replica: u64,
    /// Batches of another fleet.
    pub wrong_fleet: u64,
    /// This replica's own batches coming back (ignored, but for those of an earlier incarnation:
    /// `own_past_applied`).
    pub own: u64,
    /// Batches of this replica's own earlier incarnations (a stream replayed after a restart)
    /// whose cache and session state was applied, without their requests in flight.
    pub own_past_applied: u64,
    /// Batches seen before (same replica, epoch and sequence number or lower): ignored.
    pub duplicates: u64,
    /// Batches of an older incarnation of a replica already seen newer: ignored.
    pub stale: u64,
    /// Batches missing between two received ones of the same incarnation.
    pub gaps: u64,
    /// New incarnations of known replicas (restarts).
    pub incarnations: u64,
    /// Other replicas' requests dropped from in flight because their replica restarted or went
    /// silent.
    pub inflight_dropped: u64,
    /// Replicas heard from.
    pub peers: u64,
}

#[cfg(test)]
mod tests;
