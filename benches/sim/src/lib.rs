//! # kvroute-sim
//!
//! The kvroute simulator toolkit: the trace simulator, the workloads and baseline balancers it
//! compares kvroute against, its reports and SVG charts, and the golden-fixture replay the core's
//! and the filter's tests share.
//!
//! - [`sim`]: the simulator. It replays one workload — the built-in synthetic multi-turn agent
//!   workload ([`workload::synthetic`]) or a JSONL trace ([`workload::load_trace`]) — against a
//!   simulated cluster ([`sim::ClusterConfig`]) under several routing policies ([`PolicyKind`]),
//!   and reports for each the true prefix-cache hit ratio, TTFT percentiles, load imbalance and
//!   routing cost. The endpoints' caches ([`cache`]) model what the engines really hold, so the
//!   router's approximate index is judged against the truth rather than against itself.
//! - [`policy`]: the policies under simulation, with the baseline pickers
//!   ([`RoundRobin`](policy::RoundRobin), [`LeastLoaded`](policy::LeastLoaded)) the reference
//!   worker's demo runs too.
//! - [`workload`]: workloads, token-count ranges ([`Span`]) and workload kinds
//!   ([`WorkloadKind`]), shared with the demo's own workload generator.
//! - [`report`] (aligned Markdown tables, nearest-rank percentiles) and [`svg`] (a hand-written
//!   SVG chart writer and the simulator's chart): the demo's report and chart use them as well.
//! - [`noisy`]: the noisy-neighbor scenario (flow control's evidence): its seeded schedule, the
//!   per-request records and summaries, the targets, table and chart the simulator
//!   ([`noisy::sim`]) and the reference worker's demo share.
//! - [`replicas`]: the router-replicas scenario: N replicas (each its own `RouterCore`) behind a
//!   round-robin spray, their state shared over a bus simulated in virtual time or not, a
//!   replica killed and restarted from the stream, a bus outage ([`replicas::sim`]); summaries,
//!   targets, table and chart.
//! - [`golden`]: the binding-neutral golden fixtures (`fixtures/golden/`) as typed cases, their
//!   replay on a surface, the decision view and the expected-vs-actual comparison.
//!
//! The `kvroute-sim` binary (feature `cli`, on by default) is a thin CLI over this library.
//!
//! ```
//! use kvroute_sim::{compare, prepare, synthetic, ClusterConfig, PolicyKind, SyntheticConfig};
//!
//! let workload = synthetic(&SyntheticConfig { sessions: 12, ..Default::default() })?;
//! let policy = kvroute::Policy::default();
//! let requests = prepare(workload, &policy.config().request)?;
//! let cluster = ClusterConfig { endpoints: 4, ..Default::default() };
//! let reports = compare(&requests, &cluster, &PolicyKind::ALL, &policy, &mut |_| {})?;
//! assert_eq!(reports.len(), 3);
//! let table = kvroute_sim::report::table(&reports);
//! assert!(table.contains("| kvroute "));
//! # Ok::<(), kvroute_sim::SimError>(())
//! ```

pub mod cache;
pub mod error;
pub mod golden;
pub mod noisy;
pub mod policy;
pub mod replicas;
pub mod report;
pub mod sim;
pub mod svg;
pub mod workload;

pub use error::SimError;
pub use policy::{Balancer, EndpointLoad, Pick, PolicyKind};
pub use sim::{compare, prepare, simulate, ClusterConfig, PolicyReport, Progress, SimRequest};
pub use workload::{
    load_trace, read_jsonl, save_trace, synthetic, write_jsonl, Span, SyntheticConfig, TraceRequest, WorkloadKind,
};
