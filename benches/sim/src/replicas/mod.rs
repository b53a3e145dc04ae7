//! The replicas scenario: N router replicas behind a round-robin spray on one seeded workload,
//! their state shared (or not) over a simulated bus in virtual time ([`sim`]), measured the way
//! peers measure it: the engines' realized prefix-cache hit rate relative to one router, with
//! sync off and on, TTFT p90; then two faults at the largest fleet with sync: one replica killed
//! and restarted (bootstrapped from the stream), and a bus outage.
//!
//! - [`ReplicasScenario`]: the workload, cluster, policy, bus model and fault timings;
//!   [`ReplicasScenario::specs`] the runs.
//! - [`RunRecords`] (one run's per-request records, replication counters, bus counters) and
//!   [`RunSummary`] (hit rates, TTFT, cost per effect, 1-second windows, recovery).
//! - [`targets`], [`table`], [`results_json`] and the chart ([`chart`]).

pub mod chart;
pub mod sim;

use serde::Serialize;

use crate::error::SimError;
use crate::sim::{ClusterConfig, SimRequest};
use crate::workload::SyntheticConfig;

/// The simulated fleet's name.
pub const FLEET: &str = "sim";
/// Replica counts of the default run.
pub const DEFAULT_REPLICAS: [u32; 4] = [1, 2, 4, 8];
/// The target: with sync, at least this fraction of one router's hit rate at the largest
/// fleet.
pub const SYNC_TARGET: f64 = 0.95;
/// A restarted replica's hit rate counts as back once it is within this fraction of the others'.
pub const RECOVERY_BAND: f64 = 0.10;
/// The target for that, seconds after the restart.
pub const RECOVERY_TARGET_S: f64 = 10.0;
/// What peers measured without sync at 8 gateways (hit rate relative to a shared view).
pub const PEER_NO_SYNC_RATIO: f64 = 0.66;
/// Windows of the recovery criterion's trailing span (see [`recovery`]).
pub const SMOOTH_WINDOWS: usize = 3;
/// Consecutive windows the criterion must hold for (see [`recovery`]).
pub const HOLD_WINDOWS: usize = 5;

/// The simulated bus (NATS with a JetStream stream, in virtual time).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BusConfig {
    /// Every replica drains its outbox at this interval (ms; the transport's default).
    pub flush_interval_ms: u64,
    /// Publish to delivery, ms.
    pub latency_ms: u64,
    /// A replica that published nothing for this long publishes an empty batch (ms).
    pub heartbeat_interval_ms: u64,
    /// The stream retains batches this long (s).
    pub stream_max_age_s: u64,
    /// The stream retains at most this many bytes (the newest).
    pub stream_max_bytes: u64,
    /// Outbox bound per replica (entries; the oldest go beyond).
    pub max_outbox_entries: usize,
}

impl Default for BusConfig {
    fn default() -> Self {
        BusConfig {
            flush_interval_ms: 2,
            latency_ms: 1,
            heartbeat_interval_ms: 1000,
            stream_max_age_s: 600,
            stream_max_bytes: 256 << 20,
            max_outbox_entries: 65_536,
        }
    }
}

/// A fault injected in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// None.
    None,
    /// Replica 0 is killed a third of the way through and started again `restart_after_ms` later.
    KillRestart,
    /// The same, the restarted replica starting from live batches only (no stream replay): what
    /// the replay buys.
    KillRestartNoReplay,
    /// No batch is published or delivered for `outage_ms` from a third of the way through.
    BusOutage,
}

/// One run: how many replicas, whether they sync, which fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RunSpec {
    /// Router replicas behind the spray.
    pub replicas: u32,
    /// Replicas share their state over the bus.
    pub sync: bool,
    /// The fault.
    pub fault: Fault,
}

impl RunSpec {
    /// The run's name in tables and charts.
    pub fn name(&self) -> String {
        let n = self.replicas;
        let mut s = format!("{n} replica{}", if n == 1 { "" } else { "s" });
        if n > 1 || self.sync {
            s.push_str(if self.sync { ", sync" } else { ", no sync" });
        }
        match self.fault {
            Fault::None => {}
            Fault::KillRestart => s.push_str(", kill + restart"),
            Fault::KillRestartNoReplay => s.push_str(", kill + restart, no replay"),
            Fault::BusOutage => s.push_str(", bus outage"),
        }
        s
    }
}

/// Everything a run of the scenario needs.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicasScenario {
    /// The workload (multi-turn agent sessions).
    pub workload: SyntheticConfig,
    /// The simulated cluster.
    pub cluster: ClusterConfig,
    /// The routers' policy (the same for every replica).
    pub policy: kvroute::Policy,
    /// Replica counts (1 is always run: it is the reference).
    pub replicas: Vec<u32>,
    /// Replicas of the fault runs.
    pub fault_replicas: u32,
    /// Run the two fault runs.
    pub faults: bool,
    /// The bus.
    pub bus: BusConfig,
    /// Kill to restart, ms.
    pub restart_after_ms: u64,
    /// Length of the bus outage, ms.
    pub outage_ms: u64,
    /// Timeline window, ms.
    pub window_ms: u64,
}

/// Sessions of the default run.
pub const DEFAULT_SESSIONS: u32 = 1_000;
/// Sessions of a quick run.
pub const QUICK_SESSIONS: u32 = 240;

impl ReplicasScenario {
    /// The default scenario: the simulator's default agent workload and 8-endpoint cluster,
    /// kvroute's default policy, 1, 2, 4 and 8 replicas, faults at 8.
    pub fn new(workload: SyntheticConfig, cluster: ClusterConfig) -> ReplicasScenario {
        ReplicasScenario {
            workload,
            cluster,
            policy: kvroute::Policy::default(),
            replicas: DEFAULT_REPLICAS.to_vec(),
            fault_replicas: 8,
            faults: true,
            bus: BusConfig::default(),
            restart_after_ms: 5_000,
            outage_ms: 5_000,
            window_ms: 1_000,
        }
    }

    /// A smaller run (the tests' and `--quick`'s): fewer sessions arriving faster.
    pub fn quick(seed: u64) -> ReplicasScenario {
        let workload =
            SyntheticConfig { sessions: QUICK_SESSIONS, rate_per_s: 4.0, seed, ..SyntheticConfig::default() };
        ReplicasScenario::new(workload, ClusterConfig::default())
    }

    /// Check every setting.
    pub fn validate(&self) -> Result<(), SimError> {
        self.cluster.validate()?;
        self.workload.validate()?;
        if self.replicas.is_empty() {
            return Err(SimError::setting("replicas", "\"\"", "give at least one replica count"));
        }
        if let Some(&n) = self.replicas.iter().find(|&&n| !(1..=64).contains(&n)) {
            return Err(SimError::setting("replicas", n, "each count must be within 1..=64"));
        }
        if self.faults && !(2..=64).contains(&self.fault_replicas) {
            return Err(SimError::setting("fault-replicas", self.fault_replicas, "must be within 2..=64"));
        }
        let positive = [
            ("flush-ms", self.bus.flush_interval_ms),
            ("heartbeat-ms", self.bus.heartbeat_interval_ms),
            ("stream-max-age-s", self.bus.stream_max_age_s),
            ("stream-max-bytes", self.bus.stream_max_bytes),
            ("max-outbox-entries", self.bus.max_outbox_entries as u64),
            ("restart-after-ms", self.restart_after_ms),
            ("outage-ms", self.outage_ms),
            ("window-ms", self.window_ms),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(SimError::setting(name, v, "must be > 0"));
            }
        }
        if self.bus.latency_ms > 60_000 {
            return Err(SimError::setting("bus-latency-ms", self.bus.latency_ms, "at most 60000"));
        }
        Ok(())
    }

    /// The runs, in report order: every replica count without and with sync (one router once
    /// each way), then the fault runs.
    pub fn specs(&self) -> Vec<RunSpec> {
        let mut counts = self.replicas.clone();
        counts.push(1);
        counts.sort_unstable();
        counts.dedup();
        let mut out = Vec::new();
        for &n in &counts {
            for sync in [false, true] {
                out.push(RunSpec { replicas: n, sync, fault: Fault::None });
            }
        }
        if self.faults {
            let n = self.fault_replicas;
            if !counts.contains(&n) {
                out.push(RunSpec { replicas: n, sync: true, fault: Fault::None });
            }
            out.push(RunSpec { replicas: n, sync: true, fault: Fault::KillRestart });
            out.push(RunSpec { replicas: n, sync: true, fault: Fault::KillRestartNoReplay });
            out.push(RunSpec { replicas: n, sync: true, fault: Fault::BusOutage });
        }
        out
    }

    /// One line on the bus and the faults.
    pub fn describe(&self) -> String {
        format!(
            "bus: flush every {} ms, latency {} ms, heartbeat {} ms, stream {} s / {} MiB; faults at {} replicas: kill \
             router-0 at 1/3 and restart it {} s later (replaying the stream), bus outage of {} s at 1/3",
            self.bus.flush_interval_ms,
            self.bus.latency_ms,
            self.bus.heartbeat_interval_ms,
            self.bus.stream_max_age_s,
            self.bus.stream_max_bytes >> 20,
            self.fault_replicas,
            self.restart_after_ms as f64 / 1000.0,
            self.outage_ms as f64 / 1000.0,
        )
    }

    /// The workload, prepared for the cluster model.
    pub fn requests(&self) -> Result<Vec<SimRequest>, SimError> {
        crate::sim::prepare(crate::workload::synthetic(&self.workload)?, &self.policy.config().request)
    }
}

/// How a request ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Never reached a router (not expected).
    #[default]
    Pending,
    /// Routed and served.
    Served,
    /// The router shed it.
    Shed,
    /// Routing failed.
    Failed {
        /// The error.
        error: String,
    },
}

/// One request of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Arrival, ms.
    pub arrival_ms: u64,
    /// The replica that routed it.
    pub replica: u32,
    /// That replica's incarnation (0 before its first restart).
    pub incarnation: u32,
    /// The endpoint it went to.
    pub endpoint: Option<u32>,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Of which found in the endpoint's true cache when its prefill started.
    pub cached_tokens: u64,
    /// Prompt tokens the router believed the endpoint held.
    pub predicted_tokens: u64,
    /// The router's input tokens.
    pub input_tokens: u64,
    /// Arrival to first token, ms.
    pub ttft_ms: f64,
    /// How it ended.
    pub outcome: Outcome,
}

/// What the simulated bus did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BusCounters {
    /// Batches published (heartbeats included).
    pub published: u64,
    /// Their bytes.
    pub published_bytes: u64,
    /// Batches delivered to a live replica.
    pub delivered: u64,
    /// Deliveries that fell due while the bus was down (held, then delivered).
    pub held: u64,
    /// Deliveries to a replica killed since (it replays the stream instead).
    pub dropped_dead: u64,
    /// Completions of requests whose replica was killed (lost with it).
    pub completions_lost: u64,
    /// Entries waiting in the outboxes when the bus came back.
    pub outbox_at_recovery: u64,
    /// When everything published up to the bus's return had been delivered, ms.
    pub caught_up_ms: Option<u64>,
    /// Batches in the stream at the end.
    pub stream_batches: u64,
}

/// A restarted replica's bootstrap from the stream.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReplayReport {
    /// Batches in the stream at the restart.
    pub stream_batches: u64,
    /// The first retained (older ones aged out or beyond the byte bound).
    pub first_retained: u64,
    /// Batches replayed.
    pub batches: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Batches applied (its own earlier incarnation's among them).
    pub applied: u64,
    /// Batches of its own earlier incarnation: their cache and session state applied, their
    /// requests in flight not (they died with it).
    pub own_past: u64,
    /// Effects applied.
    pub effects: u64,
    /// Completions applied.
    pub completions: u64,
    /// Wall-clock time the replay took here, µs (measured, not simulated: the only
    /// non-deterministic field).
    pub wall_us: u64,
}

/// One run's records.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunRecords {
    /// The run.
    pub spec: RunSpec,
    /// Every request, in arrival order.
    pub records: Vec<RequestRecord>,
    /// Every incarnation's replication counters (sync runs).
    pub replica_stats: Vec<kvroute::ReplicaStats>,
    /// The bus.
    pub bus: BusCounters,
    /// The fault's start and end (restart, bus back), ms.
    pub fault_window: Option<(u64, u64)>,
    /// The restarted replica's bootstrap.
    pub replay: Option<ReplayReport>,
    /// Wall-clock time of the run, s.
    pub wall_s: f64,
    /// Kills, restarts, outages, anything unexpected.
    pub notes: Vec<String>,
}

/// Simulate every run of the scenario on one prepared workload; `progress` gets each run.
pub fn run_all(s: &ReplicasScenario, progress: &mut dyn FnMut(&RunRecords)) -> Result<Vec<RunRecords>, SimError> {
    s.validate()?;
    let reqs = s.requests()?;
    s.specs()
        .iter()
        .map(|spec| {
            let r = sim::run(s, &reqs, spec)?;
            progress(&r);
            Ok(r)
        })
        .collect()
}

/// Token-weighted hit rate of some records (`None` when they have no prompt tokens).
fn hit<'a>(records: impl IntoIterator<Item = &'a RequestRecord>) -> Option<f64> {
    let (mut p, mut c) = (0u64, 0u64);
    for r in records.into_iter().filter(|r| r.outcome == Outcome::Served) {
        p += r.prompt_tokens;
        c += r.cached_tokens;
    }
    (p > 0).then(|| c as f64 / p as f64)
}

/// One timeline window of a fault run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Window {
    /// Start, s.
    pub t_s: f64,
    /// The fleet's hit rate (every request arriving in the window).
    pub fleet: Option<f64>,
    /// The faulted replica's (router-0's) requests.
    pub replica: Option<f64>,
    /// The other replicas' requests.
    pub others: Option<f64>,
    /// The fleet's hit rate in the same window of the run without the fault.
    pub baseline: Option<f64>,
    /// router-0's requests in the window.
    pub replica_requests: u32,
}

/// A fault run's recovery.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultReport {
    /// The fault.
    pub fault: Fault,
    /// It started, s.
    pub start_s: f64,
    /// It ended (restart, bus back), s.
    pub end_s: f64,
    /// Seconds from the end until the hit rate was back (see [`recovery`]); `None`: never
    /// within the run.
    pub recovery_s: Option<f64>,
    /// The compared hit rates over the first 10 s after the end: (faulted, reference).
    pub after_10s: (Option<f64>, Option<f64>),
    /// The lowest window ratio (faulted / reference) from the start to 10 s after the end.
    pub worst_ratio: Option<f64>,
    /// The fleet's hit rate from the start to 10 s after the end, and the no-fault run's.
    pub dip: (Option<f64>, Option<f64>),
}

/// One recovery window's tokens: (faulted cached, faulted prompt, reference cached, reference
/// prompt).
pub type WindowTokens = (u64, u64, u64, u64);

/// When a faulted series is back: the first window (from `from`) after which, for
/// [`HOLD_WINDOWS`] consecutive windows, the faulted series pooled over its trailing
/// [`SMOOTH_WINDOWS`] windows (never before `from`) is at least `1 - RECOVERY_BAND` of the
/// reference pooled the same way. Returns the number of windows from `from` to that window's
/// start (0: back at once), or `None`.
///
/// `series[k]` = (faulted cached, faulted prompt, reference cached, reference prompt) tokens of
/// window `k`.
pub fn recovery(series: &[WindowTokens], from: usize) -> Option<usize> {
    let ok = |k: usize| {
        let lo = k.saturating_sub(SMOOTH_WINDOWS - 1).max(from);
        let (mut fc, mut fp, mut rc, mut rp) = (0u64, 0u64, 0u64, 0u64);
        for w in &series[lo..=k] {
            fc += w.0;
            fp += w.1;
            rc += w.2;
            rp += w.3;
        }
        if fp == 0 || rp == 0 {
            return false;
        }
        fc as f64 / fp as f64 >= (1.0 - RECOVERY_BAND) * (rc as f64 / rp as f64)
    };
    (from..series.len()).find(|&k| (k..k + HOLD_WINDOWS).all(|j| j < series.len() && ok(j))).map(|k| k - from)
}

/// One run's results.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSummary {
    /// The run's name.
    pub name: String,
    /// The run.
    pub spec: RunSpec,
    /// Requests.
    pub requests: u64,
    /// Served.
    pub served: u64,
    /// Shed by a router.
    pub shed: u64,
    /// Routing failed, or never reached a router.
    pub failed: u64,
    /// Realized prefix-cache hit rate (true cached / prompt tokens of the served requests).
    pub hit: f64,
    /// `hit` / the single router's.
    pub relative: Option<f64>,
    /// What the routers predicted (believed cached / input tokens).
    pub predicted_hit: f64,
    /// TTFT p50, ms.
    pub ttft_p50_ms: f64,
    /// TTFT p90, ms.
    pub ttft_p90_ms: f64,
    /// Routed decisions (each one effect on the bus with sync).
    pub effects: u64,
    /// Batches published, all replicas (heartbeats included).
    pub batches: u64,
    /// Bytes published.
    pub bytes: u64,
    /// Entries dropped from full outboxes.
    pub outbox_dropped: u64,
    /// Batch gaps the replicas saw.
    pub gaps: u64,
    /// The bus.
    pub bus: BusCounters,
    /// The restart's bootstrap.
    pub replay: Option<ReplayReport>,
    /// Timeline windows (fault runs).
    pub windows: Vec<Window>,
    /// The fault's recovery.
    pub fault: Option<FaultReport>,
    /// Wall-clock time of the run, s.
    pub wall_s: f64,
    /// Notes.
    pub notes: Vec<String>,
}

impl RunSummary {
    /// Batches per routed decision.
    pub fn batches_per_effect(&self) -> Option<f64> {
        (self.spec.sync && self.effects > 0).then(|| self.batches as f64 / self.effects as f64)
    }

    /// Bytes per routed decision.
    pub fn bytes_per_effect(&self) -> Option<f64> {
        (self.spec.sync && self.effects > 0).then(|| self.bytes as f64 / self.effects as f64)
    }
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[crate::report::nearest_rank(q, sorted.len()) - 1]
}

/// Per-window (cached, prompt) tokens of the records `sel` picks, windows of `w_ms` from
/// `origin_ms` (records before it left out), `n` windows.
fn tokens_by_window(
    records: &[RequestRecord],
    origin_ms: u64,
    w_ms: u64,
    n: usize,
    sel: impl Fn(&RequestRecord) -> bool,
) -> Vec<(u64, u64)> {
    let mut out = vec![(0u64, 0u64); n];
    for r in records.iter().filter(|r| r.outcome == Outcome::Served && r.arrival_ms >= origin_ms && sel(r)) {
        let k = ((r.arrival_ms - origin_ms) / w_ms) as usize;
        if let Some(slot) = out.get_mut(k) {
            slot.0 += r.cached_tokens;
            slot.1 += r.prompt_tokens;
        }
    }
    out
}

fn ratio(t: (u64, u64)) -> Option<f64> {
    (t.1 > 0).then(|| t.0 as f64 / t.1 as f64)
}

/// Summarize every run (the single router without sync is the reference of `relative`; the
/// fault runs are compared with the no-fault sync run of the same size).
pub fn summarize(s: &ReplicasScenario, runs: &[RunRecords]) -> Vec<RunSummary> {
    let reference = runs
        .iter()
        .find(|r| r.spec == RunSpec { replicas: 1, sync: false, fault: Fault::None })
        .and_then(|r| hit(&r.records));
    runs.iter().map(|r| summary(s, r, runs, reference)).collect()
}

fn summary(s: &ReplicasScenario, r: &RunRecords, runs: &[RunRecords], reference: Option<f64>) -> RunSummary {
    let served: Vec<&RequestRecord> = r.records.iter().filter(|x| x.outcome == Outcome::Served).collect();
    let mut ttft: Vec<f64> = served.iter().map(|x| x.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let h = hit(&r.records).unwrap_or(0.0);
    let (pi, pc) = served.iter().fold((0u64, 0u64), |(i, c), x| (i + x.input_tokens, c + x.predicted_tokens));
    let sum = |f: &dyn Fn(&kvroute::ReplicaStats) -> u64| r.replica_stats.iter().map(f).sum::<u64>();
    let (windows, fault) = match r.fault_window {
        Some(w) => fault_report(s, r, runs, w),
        None => (Vec::new(), None),
    };
    RunSummary {
        name: r.spec.name(),
        spec: r.spec,
        requests: r.records.len() as u64,
        served: served.len() as u64,
        shed: r.records.iter().filter(|x| x.outcome == Outcome::Shed).count() as u64,
        failed: r.records.iter().filter(|x| matches!(x.outcome, Outcome::Failed { .. } | Outcome::Pending)).count()
            as u64,
        hit: h,
        relative: reference.filter(|&b| b > 0.0).map(|b| h / b),
        predicted_hit: if pi == 0 { 0.0 } else { pc as f64 / pi as f64 },
        ttft_p50_ms: pct(&ttft, 0.5),
        ttft_p90_ms: pct(&ttft, 0.9),
        effects: served.len() as u64,
        batches: sum(&|x| x.batches_out),
        bytes: sum(&|x| x.bytes_out),
        outbox_dropped: sum(&|x| x.outbox_dropped),
        gaps: sum(&|x| x.gaps),
        bus: r.bus.clone(),
        replay: r.replay.clone(),
        windows,
        fault,
        wall_s: r.wall_s,
        notes: r.notes.clone(),
    }
}

fn fault_report(
    s: &ReplicasScenario,
    r: &RunRecords,
    runs: &[RunRecords],
    (start_ms, end_ms): (u64, u64),
) -> (Vec<Window>, Option<FaultReport>) {
    let w = s.window_ms;
    let last = r.records.last().map_or(0, |x| x.arrival_ms);
    let n = (last / w + 1) as usize;
    let base = runs.iter().find(|b| b.spec == RunSpec { fault: Fault::None, ..r.spec });
    let fleet = tokens_by_window(&r.records, 0, w, n, |_| true);
    let mine = tokens_by_window(&r.records, 0, w, n, |x| x.replica == 0);
    let others = tokens_by_window(&r.records, 0, w, n, |x| x.replica != 0);
    let baseline = base.map(|b| tokens_by_window(&b.records, 0, w, n, |_| true));
    let windows = (0..n)
        .map(|k| Window {
            t_s: (k as u64 * w) as f64 / 1000.0,
            fleet: ratio(fleet[k]),
            replica: ratio(mine[k]),
            others: ratio(others[k]),
            baseline: baseline.as_ref().and_then(|b| ratio(b[k])),
            replica_requests: r
                .records
                .iter()
                .filter(|x| x.replica == 0 && x.arrival_ms / w == k as u64 && x.outcome == Outcome::Served)
                .count() as u32,
        })
        .collect();
    // The recovery series, in windows aligned to the fault's end.
    let m = (last.saturating_sub(end_ms) / w + 1) as usize;
    let series: Vec<WindowTokens> = match r.spec.fault {
        Fault::KillRestart | Fault::KillRestartNoReplay => {
            let a = tokens_by_window(&r.records, end_ms, w, m, |x| x.replica == 0);
            let b = tokens_by_window(&r.records, end_ms, w, m, |x| x.replica != 0);
            a.iter().zip(&b).map(|(a, b)| (a.0, a.1, b.0, b.1)).collect()
        }
        _ => {
            let a = tokens_by_window(&r.records, end_ms, w, m, |_| true);
            let b = base.map_or_else(|| vec![(0, 0); m], |b| tokens_by_window(&b.records, end_ms, w, m, |_| true));
            a.iter().zip(&b).map(|(a, b)| (a.0, a.1, b.0, b.1)).collect()
        }
    };
    let recovery_s = recovery(&series, 0).map(|k| (k as u64 * w) as f64 / 1000.0);
    let first10 = (10_000 / w).max(1) as usize;
    let pool = |sel: &dyn Fn(&WindowTokens) -> (u64, u64)| {
        ratio(series.iter().take(first10).map(sel).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1)))
    };
    let after_10s = (pool(&|x| (x.0, x.1)), pool(&|x| (x.2, x.3)));
    // From the start to 10 s after the end: the worst window and the pooled dip.
    let lo = (start_ms / w) as usize;
    let hi = (((end_ms + 10_000) / w) as usize).min(n);
    let worst_ratio = (lo..hi)
        .filter_map(|k| match r.spec.fault {
            Fault::KillRestart | Fault::KillRestartNoReplay => {
                let (a, b) = (ratio(mine[k])?, ratio(others[k])?);
                (b > 0.0).then_some(a / b)
            }
            _ => {
                let (a, b) = (ratio(fleet[k])?, ratio(baseline.as_ref()?[k])?);
                (b > 0.0).then_some(a / b)
            }
        })
        .reduce(f64::min);
    let span = |v: &[(u64, u64)]| ratio(v[lo..hi].iter().fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1)));
    let dip = (span(&fleet), baseline.as_ref().and_then(|b| span(b)));
    let report = FaultReport {
        fault: r.spec.fault,
        start_s: start_ms as f64 / 1000.0,
        end_s: end_ms as f64 / 1000.0,
        recovery_s,
        after_10s,
        worst_ratio,
        dip,
    };
    (windows, Some(report))
}

/// One of the targets and its verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Target {
    /// What is measured.
    pub name: String,
    /// The measured value, as text.
    pub value: String,
    /// The target, as text.
    pub target: String,
    /// Met (`None`: not measured in this run).
    pub met: Option<bool>,
}

fn fmt_opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "-".to_owned(), f)
}

/// The targets, judged on `runs`.
pub fn targets(s: &ReplicasScenario, runs: &[RunSummary]) -> Vec<Target> {
    let largest = runs.iter().filter(|r| r.spec.fault == Fault::None).map(|r| r.spec.replicas).max().unwrap_or(1);
    let find = |sync: bool| runs.iter().find(|r| r.spec == RunSpec { replicas: largest, sync, fault: Fault::None });
    let with = find(true).and_then(|r| r.relative);
    let without = find(false).and_then(|r| r.relative);
    let mut out = vec![
        Target {
            name: format!("hit rate with sync at {largest} replicas, relative to one router"),
            value: fmt_opt(with, |v| format!("{v:.3}")),
            target: format!(">= {SYNC_TARGET}"),
            met: with.map(|v| v >= SYNC_TARGET),
        },
        Target {
            name: format!("hit rate without sync at {largest} replicas, relative to one router (peers: {PEER_NO_SYNC_RATIO} at 8)"),
            value: fmt_opt(without, |v| format!("{v:.3}")),
            target: "reported".into(),
            met: None,
        },
    ];
    let kill = runs.iter().find(|r| r.spec.fault == Fault::KillRestart);
    if let Some(k) = kill.and_then(|k| k.fault.as_ref()) {
        out.push(Target {
            name: format!(
                "restarted replica's hit rate back within {:.0}% of the others' (after the restart)",
                RECOVERY_BAND * 100.0
            ),
            value: fmt_opt(k.recovery_s, |v| format!("{v:.0} s")),
            target: format!("<= {RECOVERY_TARGET_S:.0} s"),
            met: Some(k.recovery_s.is_some_and(|v| v <= RECOVERY_TARGET_S)),
        });
    }
    if let Some(o) = runs.iter().find(|r| r.spec.fault == Fault::BusOutage) {
        let lost = o.requests - o.served;
        out.push(Target {
            name: format!("bus outage of {:.0} s: decisions lost (not routed, errored)", s.outage_ms as f64 / 1000.0),
            value: format!("{lost} of {}", o.requests),
            target: "0".into(),
            met: Some(lost == 0 && o.outbox_dropped == 0),
        });
        if let Some(f) = &o.fault {
            out.push(Target {
                name: format!(
                    "bus outage: fleet hit rate back within {:.0}% of the run without it",
                    RECOVERY_BAND * 100.0
                ),
                value: fmt_opt(f.recovery_s, |v| format!("{v:.0} s after the bus is back")),
                target: format!("<= {RECOVERY_TARGET_S:.0} s"),
                met: Some(f.recovery_s.is_some_and(|v| v <= RECOVERY_TARGET_S)),
            });
        }
    }
    out
}

/// The targets as text lines.
pub fn targets_text(targets: &[Target]) -> String {
    let mut out = String::new();
    for t in targets {
        let verdict = match t.met {
            Some(true) => "met",
            Some(false) => "NOT met",
            None => "reported",
        };
        out.push_str(&format!("  {}: {} (target {}): {verdict}\n", t.name, t.value, t.target));
    }
    out
}

/// The runs' table.
pub fn table(runs: &[RunSummary]) -> String {
    let columns = [
        "run",
        "hit rate",
        "vs 1 router",
        "predicted hit",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "batches / effect",
        "bytes / effect",
        "not served",
    ];
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                r.name.clone(),
                format!("{:.1}%", r.hit * 100.0),
                fmt_opt(r.relative, |v| format!("{v:.3}")),
                format!("{:.1}%", r.predicted_hit * 100.0),
                format!("{:.1}", r.ttft_p50_ms),
                format!("{:.1}", r.ttft_p90_ms),
                fmt_opt(r.batches_per_effect(), |v| format!("{v:.2}")),
                fmt_opt(r.bytes_per_effect(), |v| format!("{v:.0}")),
                (r.requests - r.served).to_string(),
            ]
        })
        .collect();
    crate::report::markdown(&columns, &rows, &[0])
}

/// The fault runs' details as text lines.
pub fn faults_text(runs: &[RunSummary]) -> String {
    let mut out = String::new();
    for r in runs {
        let Some(f) = &r.fault else { continue };
        let pcts = |v: Option<f64>| fmt_opt(v, |x| format!("{:.1}%", x * 100.0));
        match f.fault {
            Fault::KillRestart | Fault::KillRestartNoReplay => {
                out.push_str(&format!(
                    "  {}: router-0 down {:.1}-{:.1} s; back within {:.0}% of the others {} after the restart; its \
                     hit rate over the first 10 s {} (others {}); worst 1-s window ratio {}\n",
                    r.name,
                    f.start_s,
                    f.end_s,
                    RECOVERY_BAND * 100.0,
                    fmt_opt(f.recovery_s, |v| format!("{v:.0} s")),
                    pcts(f.after_10s.0),
                    pcts(f.after_10s.1),
                    fmt_opt(f.worst_ratio, |v| format!("{v:.2}")),
                ));
                if let Some(p) = &r.replay {
                    out.push_str(&format!(
                        "    bootstrap: replayed {} of {} stream batches ({:.1} MiB, {:.0} ms of CPU here): {} effects \
                         and {} completions applied, {} of the batches its own earlier incarnation's (caches and sessions applied, requests in flight not); completions \
                         lost with the killed replica: {}\n",
                        p.batches,
                        p.stream_batches,
                        p.bytes as f64 / f64::from(1 << 20),
                        p.wall_us as f64 / 1000.0,
                        p.effects,
                        p.completions,
                        p.own_past,
                        r.bus.completions_lost,
                    ));
                }
            }
            Fault::BusOutage => {
                out.push_str(&format!(
                    "  {}: bus down {:.1}-{:.1} s; {} outbox entries waiting when it came back (dropped: {}), {} \
                     deliveries held by the stream; caught up {}; fleet hit from the outage to 10 s after {} \
                     (without the outage {}); worst 1-s window ratio {}; back within {:.0}% {} after\n",
                    r.name,
                    f.start_s,
                    f.end_s,
                    r.bus.outbox_at_recovery,
                    r.outbox_dropped,
                    r.bus.held,
                    fmt_opt(r.bus.caught_up_ms.map(|v| v as f64 / 1000.0 - f.end_s), |v| format!(
                        "{:.0} ms after",
                        v * 1000.0
                    )),
                    pcts(f.dip.0),
                    pcts(f.dip.1),
                    fmt_opt(f.worst_ratio, |v| format!("{v:.2}")),
                    RECOVERY_BAND * 100.0,
                    fmt_opt(f.recovery_s, |v| format!("{v:.0} s")),
                ));
            }
            Fault::None => {}
        }
    }
    out
}

/// The results as one JSON document (per-request records left out).
pub fn results_json(s: &ReplicasScenario, runs: &[RunSummary]) -> serde_json::Value {
    serde_json::json!({
        "scenario": "replicas",
        "workload": s.workload,
        "cluster": s.cluster,
        "bus": s.bus,
        "restart_after_ms": s.restart_after_ms,
        "outage_ms": s.outage_ms,
        "window_ms": s.window_ms,
        "runs": runs,
        "targets": targets(s, runs),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_needs_the_criterion_to_hold() {
        // (faulted cached, faulted prompt, reference cached, reference prompt) per window.
        let good = (90, 100, 90, 100);
        let bad = (50, 100, 90, 100);
        assert_eq!(recovery(&[good; 8], 0), Some(0));
        // Good from window 2, but the trailing span (3 windows) pools the bad ones in: window 2
        // 140/200 and window 3 230/300 are below 0.9 x 0.9; window 4 pools 2..=4: 270/300.
        let mut s = vec![bad, bad];
        s.extend([good; 8]);
        assert_eq!(recovery(&s, 0), Some(4));
        // Windows before `from` are never pooled.
        assert_eq!(recovery(&s, 2), Some(0));
        // Not enough windows left to hold the criterion.
        assert_eq!(recovery(&[good; HOLD_WINDOWS - 1], 0), None);
        // A window without requests of the faulted series is judged on its trailing span; with
        // nothing in the span it is not back.
        let mut gap = vec![good; 3];
        gap.push((0, 0, 90, 100));
        gap.extend([good; 2]);
        assert_eq!(recovery(&gap, 0), Some(0));
        assert_eq!(recovery(&[(0, 0, 90, 100); 8], 0), None);
        let mut late = vec![(0, 0, 90, 100); 3];
        late.extend([good; 5]);
        assert_eq!(recovery(&late, 0), Some(3));
    }

    #[test]
    fn specs_and_names() {
        let mut s = ReplicasScenario::quick(1);
        s.replicas = vec![4, 2];
        let specs = s.specs();
        let names: Vec<String> = specs.iter().map(RunSpec::name).collect();
        assert_eq!(
            names,
            [
                "1 replica",
                "1 replica, sync",
                "2 replicas, no sync",
                "2 replicas, sync",
                "4 replicas, no sync",
                "4 replicas, sync",
                "8 replicas, sync",
                "8 replicas, sync, kill + restart",
                "8 replicas, sync, kill + restart, no replay",
                "8 replicas, sync, bus outage",
            ]
        );
        s.faults = false;
        assert_eq!(s.specs().len(), 6);
        assert!(s.validate().is_ok());
        s.faults = true;
        s.fault_replicas = 1;
        assert!(matches!(s.validate(), Err(SimError::Setting { name: "fault-replicas", .. })));
    }
}
