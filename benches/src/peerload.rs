//! One shared-prefix workload for comparing kvroute's indexes with published peers whose APIs take
//! different inputs (`benches/benches/peers.rs`).
//!
//! The shape is [`WorkloadShape`] (the index bench's): tenants with 32-block system prompts,
//! conversations of 96 further blocks living on one endpoint, one in eight on a second one. Every
//! block carries the two hashes engines and routers use:
//!
//! - a **content hash**, position-independent: what dynamo's `LocalBlockHash` and kv-index's
//!   `ContentHash` are (radix trees walk by it), and what the token ids fed to token trees are
//!   drawn from ([`PeerWorkload::tokens`]);
//! - a **chain key**, the hash of the whole prefix up to the block: what engines publish in
//!   `BlockStored` (vLLM's block hash, dynamo's `ExternalSequenceBlockHash`, kv-index's
//!   `SequenceHash`) and what kvroute's event-fed index stores.
//!
//! Contents are distinct per tenant and per conversation, so a content-walked tree and a
//! chain-keyed table hold exactly the same (block, endpoint) memberships, and every exact index
//! must report the same overlap for every probe.
//!
//! Two inputs are derived:
//!
//! - [`StoreEvent`]s, as an engine publishes them: a conversation placed on an endpoint that
//!   already holds its tenant's system prompt stores only its own blocks, under the prompt's last
//!   block as parent; otherwise it stores the whole sequence from the root. Each (block, endpoint)
//!   membership is stored exactly once, so the blocks of all events are the distinct memberships.
//! - the full placed sequences, as an approximate (router-observed) index sees requests.

use std::collections::HashSet;

use crate::indexload::WorkloadShape;

/// Parent of every first block (a stand-in for an engine's `NONE_HASH`).
const ROOT: u64 = 0x6b76_726f_7574_6530;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Appends `n` content hashes drawn from `stream`.
fn contents(stream: u64, n: usize, out: &mut Vec<u64>) {
    let base = splitmix(stream);
    out.extend((0..n as u64).map(|i| splitmix(base.wrapping_add(i)).max(1)));
}

/// Appends the chain keys of `contents` after `parent`.
fn chain(parent: u64, contents: &[u64], out: &mut Vec<u64>) {
    let mut p = parent;
    for &c in contents {
        p = splitmix(p ^ splitmix(c ^ 0xc4a1)).max(1);
        out.push(p);
    }
}

/// One conversation placed on one endpoint.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Endpoint (slot) holding it.
    pub endpoint: usize,
    /// Tenant whose system prompt it extends.
    pub tenant: usize,
    /// Content hash of every block, root first.
    pub contents: Vec<u64>,
    /// Chain key of every block, root first.
    pub keys: Vec<u64>,
}

/// One `BlockStored` event: the blocks of placement `placement` from `start` on.
#[derive(Debug, Clone, Copy)]
pub struct StoreEvent {
    /// Index into [`PeerWorkload::placements`].
    pub placement: usize,
    /// First stored block (0: from the root; otherwise the parent is block `start - 1`).
    pub start: usize,
}

/// A lookup: a request sharing a prefix with what the index holds.
#[derive(Debug, Clone)]
pub struct Probe {
    /// Content hashes of its blocks.
    pub contents: Vec<u64>,
    /// Chain keys of its blocks.
    pub keys: Vec<u64>,
}

/// Churn at constant size, as an index at capacity sees it: step `k` removes the conversation
/// blocks of the build's placement `k` (its own blocks, leaf first, on its endpoint) and stores
/// a new conversation (`placements[k]`) on an endpoint that holds its tenant's system prompt,
/// under the prompt's last block. Memberships stay the same; no system prompt is removed.
#[derive(Debug, Clone)]
pub struct Churn {
    /// The new conversations, one per step.
    pub placements: Vec<Placement>,
    /// Blocks of a system prompt (where a conversation's own blocks start).
    pub system_blocks: usize,
}

impl Churn {
    /// Blocks removed and stored over all steps.
    pub fn blocks(&self, wl: &PeerWorkload) -> u64 {
        let removed: usize =
            wl.placements[..self.placements.len()].iter().map(|p| p.keys.len() - self.system_blocks).sum();
        let stored: usize = self.placements.iter().map(|p| p.keys.len() - self.system_blocks).sum();
        (removed + stored) as u64
    }

    /// Step `k`'s removal: the endpoint and the chain keys removed (leaf first).
    pub fn removal<'a>(&self, wl: &'a PeerWorkload, k: usize) -> (usize, impl Iterator<Item = u64> + 'a) {
        let p = &wl.placements[k];
        (p.endpoint, p.keys[self.system_blocks..].iter().rev().copied())
    }

    /// Step `k`'s store: the endpoint, the parent (the system prompt's last block), the content
    /// hashes and the chain keys stored.
    pub fn store(&self, k: usize) -> (usize, u64, &[u64], &[u64]) {
        let p = &self.placements[k];
        let s = self.system_blocks;
        (p.endpoint, p.keys[s - 1], &p.contents[s..], &p.keys[s..])
    }
}

/// The generated workload.
#[derive(Debug, Clone)]
pub struct PeerWorkload {
    /// Its shape.
    pub shape: WorkloadShape,
    /// Every placed conversation, in placement order.
    pub placements: Vec<Placement>,
    /// The engine events storing every membership once, in placement order.
    pub events: Vec<StoreEvent>,
    /// The lookups (128 blocks each).
    pub probes: Vec<Probe>,
}

/// Blocks per probe.
pub const PROBE_BLOCKS: usize = 128;

impl PeerWorkload {
    /// Generate placements until the shape's membership target is reached (counting placed
    /// blocks, as [`crate::indexload::IndexWorkload`] does), then `probes` lookups.
    pub fn generate(shape: &WorkloadShape, seed: u64, probes: usize) -> Self {
        let systems: Vec<(Vec<u64>, Vec<u64>)> = (0..shape.tenants)
            .map(|t| {
                let mut c = Vec::with_capacity(shape.system_blocks);
                contents(seed ^ 0x5157_0000 ^ ((t as u64) << 20), shape.system_blocks, &mut c);
                let mut k = Vec::with_capacity(shape.system_blocks);
                chain(ROOT, &c, &mut k);
                (c, k)
            })
            .collect();
        let mut placements = Vec::new();
        let mut total = 0u64;
        let mut c = 0u64;
        while total < shape.memberships {
            let tenant = (splitmix(seed ^ c) % shape.tenants as u64) as usize;
            let (sys_c, sys_k) = &systems[tenant];
            let mut cs = sys_c.clone();
            contents(splitmix(seed.wrapping_add(c) ^ 0xc0), shape.conversation_blocks, &mut cs);
            let mut ks = sys_k.clone();
            chain(*sys_k.last().unwrap_or(&ROOT), &cs[shape.system_blocks..], &mut ks);
            let endpoint = (splitmix(c ^ 0xe) % shape.endpoints as u64) as usize;
            total += ks.len() as u64;
            if c % 8 == 0 {
                // Some conversations moved (load balancing): a second holder.
                let e2 = (endpoint + 1 + (c as usize / 8) % (shape.endpoints - 1).max(1)) % shape.endpoints;
                total += ks.len() as u64;
                placements.push(Placement { endpoint, tenant, contents: cs.clone(), keys: ks.clone() });
                placements.push(Placement { endpoint: e2, tenant, contents: cs, keys: ks });
            } else {
                placements.push(Placement { endpoint, tenant, contents: cs, keys: ks });
            }
            c += 1;
        }
        let mut has_system = HashSet::new();
        let events = placements
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let start = if has_system.insert((p.endpoint, p.tenant)) { 0 } else { shape.system_blocks };
                StoreEvent { placement: i, start }
            })
            .collect();
        let probes = (0..probes)
            .map(|j| {
                // Tenant j's system prompt, 3/4 of one of its conversations, then new blocks.
                let tenant = j % shape.tenants;
                let nth = j / shape.tenants;
                let of_tenant: Vec<&Placement> = placements.iter().filter(|p| p.tenant == tenant).collect();
                let keep = shape.system_blocks + shape.conversation_blocks * 3 / 4;
                let (mut cs, mut ks) = match of_tenant.get(nth % of_tenant.len().max(1)) {
                    Some(p) => (p.contents[..keep].to_vec(), p.keys[..keep].to_vec()),
                    None => (systems[tenant].0.clone(), systems[tenant].1.clone()),
                };
                let fresh = PROBE_BLOCKS.saturating_sub(cs.len());
                let at = cs.len();
                contents(seed ^ 0xdead_beef ^ ((j as u64) << 24), fresh, &mut cs);
                let parent = *ks.last().unwrap_or(&ROOT);
                chain(parent, &cs[at..], &mut ks);
                Probe { contents: cs, keys: ks }
            })
            .collect();
        PeerWorkload { shape: *shape, placements, events, probes }
    }

    /// `steps` churn steps (at most one per placement of the build; see [`Churn`]), drawn from
    /// `seed`.
    pub fn churn(&self, steps: usize, seed: u64) -> Churn {
        let s = self.shape.system_blocks;
        let steps = steps.min(self.placements.len());
        // The (endpoint, tenant) pairs holding a system prompt, in first-placement order.
        let mut seen = HashSet::new();
        let pairs: Vec<(usize, usize)> =
            self.placements.iter().map(|p| (p.endpoint, p.tenant)).filter(|&pair| seen.insert(pair)).collect();
        // Each tenant's system prompt (contents, keys), from its first placement.
        let mut systems: Vec<Option<(&[u64], &[u64])>> = vec![None; self.shape.tenants];
        for p in &self.placements {
            systems[p.tenant].get_or_insert((&p.contents[..s], &p.keys[..s]));
        }
        let placements = (0..steps as u64)
            .map(|k| {
                let (endpoint, tenant) = pairs[(splitmix(seed ^ k) % pairs.len() as u64) as usize];
                let (sys_c, sys) = systems[tenant].unwrap_or((&[], &[]));
                let mut cs = sys_c.to_vec();
                contents(splitmix(seed.wrapping_add(k) ^ 0xc4a7_0000), self.shape.conversation_blocks, &mut cs);
                let mut ks = sys.to_vec();
                chain(*sys.last().unwrap_or(&ROOT), &cs[s..], &mut ks);
                Placement { endpoint, tenant, contents: cs, keys: ks }
            })
            .collect();
        Churn { placements, system_blocks: s }
    }

    /// kvroute's request keys of each probe (one sequence of its chain keys).
    pub fn probe_keys(&self) -> Vec<kvroute::RequestKeys> {
        self.probes
            .iter()
            .map(|p| kvroute::RequestKeys {
                keys: p.keys.clone(),
                seq_starts: vec![0],
                anchor: 0,
                block_tokens: 16,
                unkeyed_blocks: 0,
            })
            .collect()
    }

    /// Blocks of all placed sequences (what an approximate index observes).
    pub fn placed_blocks(&self) -> u64 {
        self.placements.iter().map(|p| p.keys.len() as u64).sum()
    }

    /// Distinct (block, endpoint) memberships: the blocks of all events.
    pub fn memberships(&self) -> u64 {
        self.events.iter().map(|e| (self.placements[e.placement].keys.len() - e.start) as u64).sum()
    }

    /// An event's endpoint, parent chain key (`None`: from the root), content hashes and chain
    /// keys.
    pub fn event(&self, ev: &StoreEvent) -> (usize, Option<u64>, &[u64], &[u64]) {
        let p = &self.placements[ev.placement];
        let parent = ev.start.checked_sub(1).map(|i| p.keys[i]);
        (p.endpoint, parent, &p.contents[ev.start..], &p.keys[ev.start..])
    }

    /// The token ids a block is represented by in a token tree: with one token per block, its
    /// content hash's low bits; with more, ids drawn from the content hash.
    pub fn block_tokens(content: u64, per_block: usize, out: &mut Vec<u32>) {
        if per_block == 1 {
            out.push(content as u32);
        } else {
            out.extend((0..per_block as u64).map(|i| splitmix(content.wrapping_add(i)) as u32));
        }
    }

    /// [`PeerWorkload::block_tokens`] of every block of `contents`.
    pub fn tokens(contents: &[u64], per_block: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(contents.len() * per_block);
        for &c in contents {
            Self::block_tokens(c, per_block, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_store_each_membership_once_and_chains_agree() {
        let shape = WorkloadShape { memberships: 20_000, ..WorkloadShape::for_endpoints(16) };
        let wl = PeerWorkload::generate(&shape, 3, 8);
        let mut seen = HashSet::new();
        for ev in &wl.events {
            let (e, parent, cs, ks) = wl.event(ev);
            assert_eq!(cs.len(), ks.len());
            if let Some(p) = parent {
                assert!(seen.contains(&(p, e)), "the parent is stored first on the same endpoint");
            }
            for &k in ks {
                assert!(seen.insert((k, e)), "stored once");
            }
        }
        assert_eq!(seen.len() as u64, wl.memberships());
        assert!(wl.placed_blocks() > wl.memberships());
        // Content and keys determine each other (no two blocks share a content hash).
        let mut by_content = std::collections::HashMap::new();
        for p in &wl.placements {
            for (c, k) in p.contents.iter().zip(&p.keys) {
                assert_eq!(*by_content.entry(*c).or_insert(*k), *k);
            }
        }
        for probe in &wl.probes {
            assert_eq!(probe.keys.len(), PROBE_BLOCKS);
            assert_eq!(probe.contents.len(), PROBE_BLOCKS);
        }
        // Churn: every removal takes memberships that are there, every store adds new ones
        // under a parent its endpoint holds, and the count stays the same.
        let churn = wl.churn(64, 5);
        let before = seen.len();
        for k in 0..churn.placements.len() {
            let (e, removed) = churn.removal(&wl, k);
            for key in removed {
                assert!(seen.remove(&(key, e)), "removed membership was there");
            }
            let (e, parent, cs, ks) = churn.store(k);
            assert_eq!(cs.len(), ks.len());
            assert!(seen.contains(&(parent, e)), "the parent is held");
            for &key in ks {
                assert!(seen.insert((key, e)), "stored once");
            }
        }
        assert_eq!(seen.len(), before);
        assert_eq!(churn.blocks(&wl), 2 * 64 * shape.conversation_blocks as u64);
    }
}
