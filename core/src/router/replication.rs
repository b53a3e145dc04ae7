//! Applying the [`RoutingEffect`] of a decision made by another router instance.

use super::inflight::SlotRef;
use super::state::RouterCore;
use crate::effect::RoutingEffect;
use crate::error::StateError;

impl RouterCore {
    /// Apply the state changes a decision made by another router instance (see
    /// [`Router::apply_effect`](crate::Router::apply_effect)).
    pub fn apply_effect(&mut self, e: &RoutingEffect) -> Result<(), StateError> {
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
                    self.index.observe(seq, s as usize);
                }
            }
        }
        if e.precise_fingerprint == self.kv.fingerprint() && !e.precise_keys.is_empty() {
            // The expiry is held to this instance's clock plus the TTL (a peer's far-future
            // expiry cannot pin entries here).
            let now = self.kv.speculation_now().unwrap_or(e.now_ms);
            self.kv.expire(now);
            for (i, s) in slots.enumerate() {
                let skip = e.precise_skip[i] as usize;
                self.kv.speculate_from(&e.precise_keys, skip, s as usize, e.speculative_expires_ms, now);
            }
        }
        let target = self.endpoints.get(t_slot).map_or(SlotRef { slot: t_slot, incarnation: 0 }, |ep| SlotRef {
            slot: t_slot,
            incarnation: ep.incarnation,
        });
        if !self.inflight.contains(&e.request_id) {
            let t = self.track(t_slot, e.now_ms, 0);
            let p = p_slot.map(|p| self.track(p, e.now_ms, 0));
            self.inflight.insert(&e.request_id, t, p, e.now_ms, 0);
            let max = self.active.policy.config().limits.max_inflight_requests;
            self.bound_inflight(max);
        }
        if let Some(k) = e.session_key {
            self.sessions.push(k, target);
        }
        self.counters.effects_applied += 1;
        Ok(())
    }
}
