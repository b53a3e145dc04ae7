//! Applying the [`RoutingEffect`] of a decision made by another router instance.

use super::inflight::SlotRef;
use super::state::RouterCore;
use crate::effect::RoutingEffect;
use crate::error::StateError;
use crate::replica::{
    remote_prefix, remote_request_id, Outbox, PeerTable, PeerVerdict, ReplicaBatch, ReplicaConfig, ReplicaEntry,
    ReplicaError, ReplicaStats,
};

impl RouterCore {
    /// Apply the state changes a decision made by another router instance (see
    /// [`Router::apply_effect`](crate::Router::apply_effect)).
    pub fn apply_effect(&mut self, e: &RoutingEffect) -> Result<(), StateError> {
        self.apply_effect_as(e, &e.request_id)
    }

    /// [`RouterCore::apply_effect`], tracking the request under `request_id`.
    fn apply_effect_as(&mut self, e: &RoutingEffect, request_id: &str) -> Result<(), StateError> {
        self.apply_effect_parts(e, Some(request_id))
    }

    /// Apply an effect; its request is tracked in flight under `request_id` when given.
    fn apply_effect_parts(&mut self, e: &RoutingEffect, request_id: Option<&str>) -> Result<(), StateError> {
        let t_slot = self.slot(&e.target)?;
        let p_slot = e.prefill.as_deref().map(|p| self.slot(p)).transpose()?;
        let slots = std::iter::once(t_slot).chain(p_slot);
        if e.approx_fingerprint == self.index.fingerprint() && !e.approx_keys.is_empty() {
            let n = e.approx_seq_starts.len();
            for i in 0..n {
                let lo = e.approx_seq_starts[i] as usize;
                let hi = e.approx_seq_starts.get(i + 1).map_or(e.approx_keys.len(), |&h| h as usize);
                let Some(seq) = e.approx_keys.get(lo..hi) else { continue };
                for s in slots.clone() {
                    self.index.write().observe(seq, s as usize);
                }
            }
        }
        if e.precise_fingerprint == self.kv.read().fingerprint() && !e.precise_keys.is_empty() {
            // The expiry is held to this instance's clock plus the TTL (a peer's far-future
            // expiry cannot pin entries here).
            let now = self.kv.read().speculation_now().unwrap_or(e.now_ms);
            self.kv.write(|kv| kv.expire(now));
            for (i, s) in slots.enumerate() {
                let skip = e.precise_skip[i] as usize;
                self.kv.write(|kv| kv.speculate_from(&e.precise_keys, skip, s as usize, e.speculative_expires_ms, now));
            }
        }
        let target = self.endpoints.get(t_slot).map_or(SlotRef { slot: t_slot, incarnation: 0 }, |ep| SlotRef {
            slot: t_slot,
            incarnation: ep.incarnation,
        });
        if let Some(request_id) = request_id.filter(|id| !self.books.contains(id)) {
            let t = self.track(t_slot, e.now_ms, 0);
            let p = p_slot.map(|p| self.track(p, e.now_ms, 0));
            self.books.insert(request_id, t, p, e.now_ms, 0);
            let max = self.active.policy.config().limits.max_inflight_requests;
            self.bound_inflight(max);
        }
        if let Some(k) = e.session_key {
            self.books.sessions.push(k, target);
        }
        self.books.counters.effects_applied += 1;
        Ok(())
    }
}

/// Replication state of a [`RouterCore`]: identity, outbox, peers, counters.
#[derive(Debug)]
pub(crate) struct ReplicaState {
    pub cfg: ReplicaConfig,
    pub outbox: Outbox,
    pub peers: PeerTable,
    pub stats: ReplicaStats,
}

/// What applying one replica batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaApplied {
    /// The batch was applied (false: ignored as own, duplicate, stale, another fleet's or an
    /// unknown replica's; see [`ReplicaStats`]).
    pub applied: bool,
    /// Effects applied.
    pub effects: u32,
    /// Completions applied.
    pub completions: u32,
    /// Entries skipped (an unknown endpoint, a completion of a request not in flight here).
    pub skipped: u32,
}

impl RouterCore {
    /// Take part in a fleet of router replicas as `cfg.replica_id`: from now on every routed
    /// decision's effect and every completion is queued for publishing ([`RouterCore::take_replica_batch`]),
    /// and the other replicas' batches can be applied ([`RouterCore::apply_replica_batch`]).
    /// Replaces an earlier configuration (the outbox and what is known of the peers are kept when
    /// the replica id and epoch stay the same).
    pub fn enable_replication(&mut self, cfg: ReplicaConfig) -> Result<(), ReplicaError> {
        cfg.validate()?;
        self.bump_epoch();
        match &mut self.replica {
            Some(r) if r.cfg.replica_id == cfg.replica_id && r.cfg.epoch == cfg.epoch && r.cfg.fleet == cfg.fleet => {
                r.cfg = cfg;
            }
            _ => {
                let stats =
                    ReplicaStats { replica_id: cfg.replica_id.clone(), epoch: cfg.epoch, ..ReplicaStats::default() };
                self.replica =
                    Some(Box::new(ReplicaState { cfg, outbox: Outbox::new(), peers: PeerTable::default(), stats }));
            }
        }
        Ok(())
    }

    /// Stop replicating: nothing more is queued; what waits is dropped.
    pub fn disable_replication(&mut self) {
        self.bump_epoch();
        self.replica = None;
    }

    /// The replication settings, when enabled.
    pub fn replica_config(&self) -> Option<&ReplicaConfig> {
        self.replica.as_ref().map(|r| &r.cfg)
    }

    /// The next batch to publish (encoded, see [`ReplicaBatch`]): the oldest queued entries within
    /// the batch bounds, or with `heartbeat` an empty batch when nothing waits (publish one every
    /// second or so when idle: the others tell a silent replica from a quiet one by it). `None`
    /// when nothing waits and no heartbeat is asked for, or replication is off.
    pub fn take_replica_batch(&mut self, now_ms: u64, heartbeat: bool) -> Option<Vec<u8>> {
        let r = self.replica.as_mut()?;
        r.outbox.take_batch(&r.cfg, now_ms, heartbeat)
    }

    /// Entries waiting in the outbox.
    pub fn replica_outbox_len(&self) -> usize {
        self.replica.as_ref().map_or(0, |r| r.outbox.len())
    }

    /// Decode and apply another replica's batch (see [`RouterCore::apply_replica_batch`]); a
    /// malformed batch is counted and nothing of it is applied.
    pub fn apply_replica_bytes(&mut self, bytes: &[u8], now_ms: u64) -> Result<ReplicaApplied, ReplicaError> {
        match ReplicaBatch::decode(bytes) {
            Ok(b) => self.apply_replica_batch(&b, now_ms),
            Err(e) => {
                if let Some(r) = &mut self.replica {
                    r.stats.malformed += 1;
                }
                Err(e)
            }
        }
    }

    /// Count a batch that failed to decode elsewhere (the [`Router`](crate::Router) decodes
    /// outside its lock).
    pub fn count_malformed_replica_batch(&mut self) {
        if let Some(r) = &mut self.replica {
            r.stats.malformed += 1;
        }
    }

    /// Apply another replica's batch, received at `now_ms`: judged first (own, other fleet,
    /// unknown replica, duplicate or older incarnation: ignored and counted), then every entry in
    /// order. The other replica's requests are tracked here under ids of their own (an id is
    /// unique only within its replica); a new incarnation of a replica drops what its previous
    /// one had in flight here.
    pub fn apply_replica_batch(&mut self, batch: &ReplicaBatch, now_ms: u64) -> Result<ReplicaApplied, ReplicaError> {
        let mut r = self.replica.take().ok_or(ReplicaError::NotEnabled)?;
        let verdict = r.peers.judge(&r.cfg, batch, now_ms, &mut r.stats);
        let mut out = ReplicaApplied::default();
        match verdict {
            PeerVerdict::Ignore => {}
            PeerVerdict::ApplyOwnPast => {
                out.applied = true;
                r.stats.own_past_applied += 1;
                for e in &batch.entries {
                    if let ReplicaEntry::Effect(fx) = e {
                        match self.apply_effect_parts(fx, None) {
                            Ok(()) => out.effects += 1,
                            Err(_) => out.skipped += 1,
                        }
                    }
                }
            }
            PeerVerdict::Apply | PeerVerdict::ApplyNewIncarnation { .. } => {
                if let PeerVerdict::ApplyNewIncarnation { old_epoch } = verdict {
                    r.stats.inflight_dropped += self.drop_remote_inflight(&batch.replica, old_epoch);
                }
                out.applied = true;
                r.stats.batches_in += 1;
                for e in &batch.entries {
                    match e {
                        ReplicaEntry::Effect(fx) => {
                            let id = remote_request_id(&batch.replica, batch.epoch, &fx.request_id);
                            match self.apply_effect_as(fx, &id) {
                                Ok(()) => {
                                    out.effects += 1;
                                    r.stats.effects_applied += 1;
                                }
                                Err(_) => {
                                    out.skipped += 1;
                                    r.stats.effects_unknown_endpoint += 1;
                                }
                            }
                        }
                        ReplicaEntry::Complete(rid) => {
                            let id = remote_request_id(&batch.replica, batch.epoch, rid);
                            let removed = self.books.remove(&id);
                            match removed {
                                Some(f) => {
                                    self.release(&f);
                                    out.completions += 1;
                                    r.stats.completions_applied += 1;
                                }
                                None => {
                                    out.skipped += 1;
                                    r.stats.completions_unknown += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        let silent = r.peers.take_silent(now_ms, r.cfg.peer_silence_ms);
        for (id, epoch) in silent {
            r.stats.inflight_dropped += self.drop_remote_inflight(&id, epoch);
        }
        self.replica = Some(r);
        Ok(out)
    }

    /// Drop the in-flight requests of replicas silent for longer than `peer_silence_ms` (call it
    /// on a timer; applying a batch does it too). Returns how many were dropped.
    pub fn expire_silent_replicas(&mut self, now_ms: u64) -> u64 {
        let Some(mut r) = self.replica.take() else { return 0 };
        let mut n = 0;
        for (id, epoch) in r.peers.take_silent(now_ms, r.cfg.peer_silence_ms) {
            n += self.drop_remote_inflight(&id, epoch);
        }
        r.stats.inflight_dropped += n;
        self.replica = Some(r);
        n
    }

    /// Replication counters, when enabled.
    pub fn replica_stats(&self) -> Option<ReplicaStats> {
        self.replica.as_ref().map(|r| {
            let mut s = r.stats.clone();
            s.batches_out = r.outbox.batches;
            s.entries_out = r.outbox.taken;
            s.bytes_out = r.outbox.bytes_taken;
            s.outbox_dropped = r.outbox.dropped;
            s.outbox_len = r.outbox.len() as u64;
            s.peers = r.peers.len() as u64;
            s
        })
    }

    fn drop_remote_inflight(&mut self, replica: &str, epoch: u64) -> u64 {
        let prefix = remote_prefix(replica, epoch);
        let gone = self.books.drain_where(|id| id.starts_with(&prefix));
        for f in &gone {
            self.release(f);
        }
        gone.len() as u64
    }
}
