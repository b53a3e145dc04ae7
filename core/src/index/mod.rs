//! Prefix indexes.
//!
//! - [`ApproxIndex`]: blocks assumed resident because the router sent a request there
//!   (tokenizer-free, no engine events needed).
//!
//! Both index kinds answer the same question through [`ApproxIndex::match_blocks`]-shaped calls:
//! for each endpoint slot, how many leading blocks of each prompt sequence does it hold?

mod approx;
mod table;

pub use approx::{ApproxIndex, IndexStats, MatchScratch, GENERATIONS, MAX_SLOTS};
