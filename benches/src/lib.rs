//! # kvroute-benches
//!
//! The kvroute trace simulator (and, in `benches/`, the criterion benchmarks).
//!
//! The simulator replays one workload — the built-in synthetic multi-turn agent workload
//! ([`workload::synthetic`]) or a JSONL trace ([`workload::load_trace`]) — against a simulated
//! cluster ([`sim::ClusterConfig`]) under several routing policies ([`PolicyKind`]), and reports
//! for each the true prefix-cache hit ratio, TTFT percentiles, load imbalance and routing cost.
//! The endpoints' caches model what the engines really hold, so the router's approximate index
//! is judged against the truth rather than against itself.
//!
//! The `kvroute-sim` binary is a thin CLI over this library.
//!
//! ```
//! use kvroute_benches::{compare, prepare, synthetic, ClusterConfig, PolicyKind, SyntheticConfig};
//!
//! let workload = synthetic(&SyntheticConfig { sessions: 12, ..Default::default() })?;
//! let policy = kvroute::Policy::default();
//! let requests = prepare(workload, &policy.config().request)?;
//! let cluster = ClusterConfig { endpoints: 4, ..Default::default() };
//! let reports = compare(&requests, &cluster, &PolicyKind::ALL, &policy, &mut |_| {})?;
//! assert_eq!(reports.len(), 3);
//! let table = kvroute_benches::report::table(&reports);
//! assert!(table.contains("| kvroute "));
//! # Ok::<(), kvroute_benches::SimError>(())
//! ```

pub mod cache;
pub mod error;
pub mod indexload;
pub mod peerload;
pub mod policy;
pub mod report;
pub mod sim;
pub mod svg;
pub mod timing;
pub mod workload;

pub use error::SimError;
pub use policy::{Balancer, EndpointLoad, Pick, PolicyKind};
pub use sim::{compare, prepare, simulate, ClusterConfig, PolicyReport, Progress, SimRequest};
pub use workload::{
    load_trace, read_jsonl, save_trace, synthetic, write_jsonl, Span, SyntheticConfig, TraceRequest, WorkloadKind,
};
