//! Prefix indexes.
//!
//! [`PrefixIndex`] answers, for each endpoint slot, how many leading blocks of each prompt
//! sequence it holds and in which tier. Two instantiations:
//! - [`ApproxIndex`]: blocks *assumed* resident because the router sent a request there
//!   (tokenizer-free, no engine events needed; exact 64-bit keys);
//! - the event-fed precise index's store (the same type, with tiers from the engine's events and
//!   speculative entries).

mod prefix;
mod store;

/// The most distinct blocks an index holds (positions in a table bucket).
pub(crate) const MAX_BLOCKS: usize = store::MAX_POSITIONS;

/// Give `ix` the reservation a policy's `reserve_blocks` asks for (validated: at most
/// [`crate::MAX_RESERVE_BLOCKS`]). One whose memory cannot be allocated is not made: the index
/// runs as without it, and its memory in the router's stats shows what it holds (the policy was
/// valid; the machine lacked the memory).
pub(crate) fn reserve_as_configured(ix: &mut PrefixIndex, blocks: u64) {
    ix.reserve(usize::try_from(blocks).unwrap_or(usize::MAX)).ok();
}

pub use prefix::{
    ApproxIndex, Holding, IndexStats, MatchScratch, MatchWeights, PrefixIndex, PrefixMatch, SlotMatch, GENERATIONS,
    MAX_SLOTS,
};

/// A copy of `v` with the same capacity (a twin index reports, and grows, as the original).
pub(crate) fn clone_with_capacity<T: Clone>(v: &Vec<T>) -> Vec<T> {
    let mut out = Vec::with_capacity(v.capacity());
    out.extend_from_slice(v);
    out
}
