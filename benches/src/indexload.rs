//! A synthetic index workload with shared prefixes, used by the index bench and the
//! bytes-per-membership measurement.
//!
//! Tenants have 2k-token system prompts (32 blocks of 64 tokens); conversations extend one
//! system prompt with their own blocks and live on one endpoint (session affinity), a few on
//! two. Keys are chained like real block keys (each depends on its parent).

use kvroute::BlockKey;
use kvroute::PrefixIndex;

/// Sizes of a workload.
#[derive(Debug, Clone, Copy)]
pub struct WorkloadShape {
    /// Endpoints.
    pub endpoints: usize,
    /// Tenants (distinct system prompts).
    pub tenants: usize,
    /// Blocks per system prompt.
    pub system_blocks: usize,
    /// Blocks per conversation beyond its system prompt.
    pub conversation_blocks: usize,
    /// Target (block, endpoint) memberships.
    pub memberships: u64,
    /// Per-endpoint capacity given to the index (memberships).
    pub capacity_per_endpoint: u32,
}

impl WorkloadShape {
    /// The shape used for `endpoints` endpoints: ~1M memberships at 64 endpoints, ~4M at 512
    /// (the size the peers' published numbers use), capacity with 2x headroom (no eviction).
    pub fn for_endpoints(endpoints: usize) -> Self {
        let memberships: u64 = if endpoints >= 512 { 4_190_000 } else { (endpoints as u64) * 16_384 };
        WorkloadShape {
            endpoints,
            tenants: 32,
            system_blocks: 32,
            conversation_blocks: 96,
            memberships,
            capacity_per_endpoint: u32::try_from(2 * memberships / endpoints as u64).unwrap_or(u32::MAX),
        }
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn chain(parent: BlockKey, salt: u64, n: usize, out: &mut Vec<BlockKey>) {
    let mut p = parent;
    for i in 0..n {
        p = splitmix(p ^ splitmix(salt.wrapping_add(i as u64))).max(1);
        out.push(p);
    }
}

/// A generated workload: which endpoint holds which sequence.
pub struct IndexWorkload {
    shape: WorkloadShape,
    systems: Vec<Vec<BlockKey>>,
    /// (endpoint, full key sequence)
    placements: Vec<(usize, Vec<BlockKey>)>,
    seed: u64,
}

impl IndexWorkload {
    /// Generate placements until the shape's membership target is reached.
    pub fn generate(shape: &WorkloadShape, seed: u64) -> Self {
        let systems: Vec<Vec<BlockKey>> = (0..shape.tenants)
            .map(|t| {
                let mut v = Vec::with_capacity(shape.system_blocks);
                chain(splitmix(seed ^ t as u64), 1, shape.system_blocks, &mut v);
                v
            })
            .collect();
        let mut placements = Vec::new();
        let mut total = 0u64;
        let mut c = 0u64;
        while total < shape.memberships {
            let t = (splitmix(seed ^ c) % shape.tenants as u64) as usize;
            let mut keys = systems[t].clone();
            let parent = *keys.last().unwrap_or(&1);
            chain(parent, splitmix(seed.wrapping_add(c) ^ 0xc0), shape.conversation_blocks, &mut keys);
            let e = (splitmix(c ^ 0xe) % shape.endpoints as u64) as usize;
            total += keys.len() as u64;
            placements.push((e, keys.clone()));
            if c % 8 == 0 {
                // Some conversations moved (load balancing): a second holder.
                let e2 = (e + 1 + (c as usize / 8) % (shape.endpoints - 1).max(1)) % shape.endpoints;
                total += keys.len() as u64;
                placements.push((e2, keys));
            }
            c += 1;
        }
        IndexWorkload { shape: *shape, systems, placements, seed }
    }

    /// Activate every endpoint slot and insert every placement (as GPU-resident blocks).
    pub fn fill(&self, ix: &mut PrefixIndex) {
        for e in 0..self.shape.endpoints {
            ix.activate(e);
        }
        for (e, keys) in &self.placements {
            ix.observe(keys, *e);
        }
    }

    /// Memberships placed (before any eviction).
    pub fn placed_memberships(&self) -> u64 {
        self.placements.iter().map(|(_, k)| k.len() as u64).sum()
    }

    /// A 128-block request: tenant 0's system prompt, 3/4 of an existing conversation of that
    /// tenant, then new blocks.
    pub fn probe_keys(&self) -> Vec<BlockKey> {
        let existing = self
            .placements
            .iter()
            .find(|(_, k)| k[..self.shape.system_blocks] == self.systems[0][..])
            .map(|(_, k)| k.clone())
            .unwrap_or_else(|| self.systems[0].clone());
        let keep = self.shape.system_blocks + self.shape.conversation_blocks * 3 / 4;
        let mut keys: Vec<BlockKey> = existing[..keep.min(existing.len())].to_vec();
        let parent = *keys.last().unwrap_or(&1);
        let missing = 128usize.saturating_sub(keys.len());
        chain(parent, 0xdead_beef, missing, &mut keys);
        keys
    }

    /// `n` new conversations (system prompt + fresh blocks), not yet in the index.
    pub fn fresh_sequences(&self, n: usize) -> Vec<Vec<BlockKey>> {
        (0..n)
            .map(|i| {
                let t = i % self.shape.tenants;
                let mut keys = self.systems[t].clone();
                let parent = *keys.last().unwrap_or(&1);
                chain(parent, splitmix(self.seed ^ 0xf00d ^ i as u64), self.shape.conversation_blocks, &mut keys);
                keys
            })
            .collect()
    }
}
