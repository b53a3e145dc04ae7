//! The active policy: a validated [`Policy`] with its version and the parameters derived from it
//! once per reload (hashing, index fingerprints and capacities).

use crate::approx::ApproxHashing;
use crate::config::{IndexMode, Policy};
use crate::precise::PreciseKeys;

/// A policy together with its version and derived parameters.
#[derive(Debug)]
pub struct ActivePolicy {
    /// Monotonic version: 1 for the policy the router was built with, +1 per successful reload.
    pub version: u64,
    /// The policy.
    pub policy: Policy,
    pub(super) hashing: ApproxHashing,
    pub(super) fingerprint: u64,
    pub(super) capacity: u32,
    pub(super) precise_keys: PreciseKeys,
    pub(super) precise_fingerprint: u64,
    pub(super) precise_capacity: u32,
}

impl ActivePolicy {
    pub(super) fn new(policy: Policy, version: u64) -> Self {
        let i = &policy.config().index;
        let hashing =
            ApproxHashing { block_tokens: i.block_tokens, bytes_per_token: i.bytes_per_token, hash_seed: i.hash_seed };
        ActivePolicy {
            version,
            fingerprint: policy.index_fingerprint(),
            capacity: policy.index_capacity_memberships(),
            hashing,
            precise_keys: PreciseKeys::from_config(&i.precise),
            precise_fingerprint: policy.precise_fingerprint(),
            precise_capacity: policy.precise_capacity_memberships(),
            policy,
        }
    }

    pub(super) fn reads_approx(&self) -> bool {
        self.policy.config().index.mode != IndexMode::Precise
    }

    pub(super) fn reads_precise(&self) -> bool {
        self.policy.config().index.mode != IndexMode::Approx
    }
}
