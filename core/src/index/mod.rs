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
