//! # kvroute-benches
//!
//! Load generators of the criterion benchmarks in `benches/benches/` and of the index memory
//! test: a synthetic prefix-index workload ([`indexload`]), the same workload as the published
//! peers' inputs ([`peerload`]), request text and endpoint fleets ([`fleet`]) and timing helpers
//! ([`timing`]). The trace simulator is the
//! `kvroute-sim` crate (`benches/sim/`).

pub mod fleet;
pub mod indexload;
pub mod peerload;
pub mod timing;
