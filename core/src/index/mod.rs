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

pub use prefix::{
    ApproxIndex, Holding, IndexStats, MatchScratch, MatchWeights, PrefixIndex, PrefixMatch, SlotMatch, GENERATIONS,
    MAX_SLOTS,
};
