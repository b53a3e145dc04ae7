//! The noisy-neighbor scenario: the evidence for flow control (issue 14), shared by the simulator
//! (`kvroute-sim --scenario noisy-neighbor`, in virtual time: [`sim`]) and the reference worker's
//! demo (`kvroute-worker demo --scenario noisy-neighbor`, on real workers).
//!
//! Two tenants share one pool. Tenant B sends at a steady rate; tenant A sends at a low rate and,
//! during the middle third of the run, at [`BURST_FACTOR`] times it. The rates are fractions of
//! the pool's capacity ([`ScenarioConfig::at_capacity`]): B [`B_LOAD`], A [`A_LOAD`], so without
//! the burst the pool is 65% busy and during it 155% (the burst alone is 100%). Every request is
//! a tenant's own system prompt (the same for all its requests) and a message of its own.
//!
//! Five runs replay one seeded schedule ([`RUNS`]; the no-burst runs leave out the burst's extra
//! requests and nothing else, so B's requests are the same in every run):
//! 1. `no burst, flow off` and 2. `no burst, flow on`: B's reference TTFT, under each policy;
//! 3. `burst, flow off`: today's behaviour (routing sheds sheddable requests once the pool's
//!    metrics say it is saturated, and admits everything else at once);
//! 4. `burst, flow on`: A `batch` (priority -1, sheddable), B `interactive` (priority 10);
//! 5. `burst, flow on, equal prio`: both `standard` (priority 0), one band, round-robin
//!    fairness between the two tenants.
//!
//! B's TTFT with the burst is judged against both no-burst runs: against the run with flow
//! control on it measures what the burst costs B under that policy, against the run with it off
//! what B gets compared with an unloaded pool today.
//!
//! The caller runs them (the simulator, or the demo against real workers) and hands back one
//! [`RequestRecord`] per request and one [`Dispatch`] per request sent to an engine;
//! [`RunSummary`], [`targets`], [`table`] and [`chart::render`] read both kinds of run the same way.
//! Requests carry the llm-d headers (`x-llm-d-inference-fairness-id`,
//! `x-llm-d-inference-objective`), mapped to priorities by [`OBJECTIVES`] in the policy's
//! `request.objectives`: the callers follow the core's admit / take_releases / cancel protocol and
//! never decide anything about priorities themselves.

pub mod chart;
pub mod sim;

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use crate::error::SimError;
use crate::report::{markdown, nearest_rank};
use crate::workload::{exp_sample, Span};

/// The objectives of the scenario's policy (`request.objectives`): name → priority.
pub const OBJECTIVES: [(&str, i32); 3] = [("interactive", 10), ("standard", 0), ("batch", -1)];
/// Tenant names (their fairness ids): A bursts, B is steady.
pub const TENANTS: [&str; 2] = ["tenant-a", "tenant-b"];
/// Index of the bursting tenant.
pub const A: usize = 0;
/// Index of the steady tenant.
pub const B: usize = 1;
/// A's normal rate, as a fraction of the pool's capacity.
pub const A_LOAD: f64 = 0.10;
/// B's rate, as a fraction of the pool's capacity.
pub const B_LOAD: f64 = 0.55;
/// A's rate during the burst, as a multiple of its normal rate.
pub const BURST_FACTOR: f64 = 10.0;
/// The TTFT target: B's p90 with flow control at most this multiple of its no-burst p90.
pub const TTFT_TARGET_RATIO: f64 = 1.5;
/// The fairness target: each of two equal-priority tenants gets at least this share of the
/// dispatches while saturated.
pub const FAIR_SHARE_TARGET: f64 = 0.40;

/// How the two tenants' objectives are set in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Priorities {
    /// A `batch` (-1, sheddable), B `interactive` (10).
    Tiered,
    /// Both `standard` (0).
    Equal,
}

impl Priorities {
    /// The objective tenant `t` sends (`x-llm-d-inference-objective`).
    pub fn objective(self, t: usize) -> &'static str {
        match (self, t) {
            (Priorities::Equal, _) => "standard",
            (Priorities::Tiered, A) => "batch",
            (Priorities::Tiered, _) => "interactive",
        }
    }

    /// The priority the objective maps to ([`OBJECTIVES`]).
    pub fn priority(self, t: usize) -> i32 {
        let o = self.objective(t);
        OBJECTIVES.iter().find(|(n, _)| *n == o).map_or(0, |(_, p)| *p)
    }
}

/// One run of the scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RunSpec {
    /// Its name in the reports.
    pub name: &'static str,
    /// Whether A bursts.
    pub burst: bool,
    /// Whether the policy has `flow_control.enabled`.
    pub flow_control: bool,
    /// The tenants' objectives.
    pub priorities: Priorities,
}

/// No burst, flow control off: B's reference TTFT as today.
pub const NO_BURST_OFF: RunSpec =
    RunSpec { name: "no burst, flow off", burst: false, flow_control: false, priorities: Priorities::Tiered };
/// No burst, flow control on: B's reference TTFT under the same policy as [`BURST_ON`].
pub const NO_BURST_ON: RunSpec =
    RunSpec { name: "no burst, flow on", burst: false, flow_control: true, priorities: Priorities::Tiered };
/// A bursts, flow control off: today's behaviour.
pub const BURST_OFF: RunSpec =
    RunSpec { name: "burst, flow off", burst: true, flow_control: false, priorities: Priorities::Tiered };
/// A (batch, sheddable) bursts, B interactive, flow control on.
pub const BURST_ON: RunSpec =
    RunSpec { name: "burst, flow on", burst: true, flow_control: true, priorities: Priorities::Tiered };
/// A bursts, both tenants standard (equal priority), flow control on: fairness.
pub const BURST_EQUAL: RunSpec =
    RunSpec { name: "burst, flow on, equal prio", burst: true, flow_control: true, priorities: Priorities::Equal };

/// The scenario's five runs, in report order.
pub const RUNS: [RunSpec; 5] = [NO_BURST_OFF, NO_BURST_ON, BURST_OFF, BURST_ON, BURST_EQUAL];

impl RunSpec {
    /// The run without the burst this one is compared with: the no-burst run with the same
    /// flow-control setting.
    pub fn baseline(&self) -> RunSpec {
        if self.flow_control {
            NO_BURST_ON
        } else {
            NO_BURST_OFF
        }
    }
}

/// The sizes of the scenario's requests (the same shape for both tenants).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Shape {
    /// Each tenant's system prompt (shared by all its requests), tokens.
    pub system_tokens: u32,
    /// The message of each request (its own), tokens.
    pub user_tokens: Span,
    /// Tokens generated.
    pub output_tokens: Span,
}

impl Shape {
    /// Mean message length.
    pub fn mean_user_tokens(&self) -> f64 {
        self.user_tokens.mean()
    }

    /// Mean output length.
    pub fn mean_output_tokens(&self) -> f64 {
        self.output_tokens.mean()
    }
}

/// The schedule's settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScenarioConfig {
    /// Length of the arrival schedule, seconds.
    pub duration_s: f64,
    /// The burst's start, seconds.
    pub burst_start_s: f64,
    /// The burst's end, seconds.
    pub burst_end_s: f64,
    /// A's rate during the burst, a multiple of its normal rate.
    pub burst_factor: f64,
    /// A's normal rate, requests per second.
    pub a_rate_per_s: f64,
    /// B's rate, requests per second.
    pub b_rate_per_s: f64,
    /// Request sizes.
    pub shape: Shape,
    /// Seed of the arrivals and sizes.
    pub seed: u64,
}

impl ScenarioConfig {
    /// The standard scenario on a pool serving `capacity` requests per second: B at
    /// [`B_LOAD`], A at [`A_LOAD`] bursting [`BURST_FACTOR`]x during the middle third.
    pub fn at_capacity(capacity: f64, duration_s: f64, shape: Shape, seed: u64) -> ScenarioConfig {
        ScenarioConfig {
            duration_s,
            burst_start_s: duration_s / 3.0,
            burst_end_s: 2.0 * duration_s / 3.0,
            burst_factor: BURST_FACTOR,
            a_rate_per_s: A_LOAD * capacity,
            b_rate_per_s: B_LOAD * capacity,
            shape,
            seed,
        }
    }

    /// Check every setting.
    pub fn validate(&self) -> Result<(), SimError> {
        if !(self.duration_s.is_finite() && self.duration_s > 0.0 && self.duration_s <= 86_400.0) {
            return Err(SimError::setting("duration-s", self.duration_s, "must be a number of seconds in (0, 86400]"));
        }
        if !(0.0..self.burst_end_s).contains(&self.burst_start_s) || self.burst_end_s > self.duration_s {
            return Err(SimError::setting("burst", self.burst_start_s, "the burst must lie inside the run"));
        }
        for (name, v) in
            [("a-rate", self.a_rate_per_s), ("b-rate", self.b_rate_per_s), ("burst-factor", self.burst_factor)]
        {
            if !(v.is_finite() && v > 0.0 && v <= 1e6) {
                return Err(SimError::setting(name, v, "must be a number in (0, 1e6]"));
            }
        }
        if self.shape.user_tokens.min == 0 {
            return Err(SimError::setting("user-tokens", self.shape.user_tokens, "messages need at least 1 token"));
        }
        if self.shape.output_tokens.min == 0 {
            return Err(SimError::setting("output-tokens", self.shape.output_tokens, "at least 1 output token"));
        }
        Ok(())
    }

    /// The burst's length, seconds.
    pub fn burst_s(&self) -> f64 {
        self.burst_end_s - self.burst_start_s
    }

    /// Whether `t_s` falls in the burst.
    pub fn in_burst(&self, t_s: f64) -> bool {
        (self.burst_start_s..self.burst_end_s).contains(&t_s)
    }

    /// One-line description.
    pub fn describe(&self) -> String {
        format!(
            "tenant-b {:.2} req/s steady; tenant-a {:.2} req/s, {:.0}x ({:.2} req/s) from {:.1} s to {:.1} s; {:.1} s; \
             system prompt {} tok per tenant, message {} tok, output {} tok; seed {}",
            self.b_rate_per_s,
            self.a_rate_per_s,
            self.burst_factor,
            self.a_rate_per_s * self.burst_factor,
            self.burst_start_s,
            self.burst_end_s,
            self.duration_s,
            self.shape.system_tokens,
            self.shape.user_tokens,
            self.shape.output_tokens,
            self.seed
        )
    }
}

/// One request of the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Arrival {
    /// Position in the whole schedule (burst included): the same request has the same id in
    /// every run.
    pub id: usize,
    /// Arrival, seconds from the start.
    pub t_s: f64,
    /// [`A`] or [`B`].
    pub tenant: usize,
    /// One of the burst's extra requests (left out of the no-burst run).
    pub burst: bool,
    /// Its message's length, tokens.
    pub user_tokens: u32,
    /// Tokens it generates.
    pub output_tokens: u32,
}

fn poisson(
    rng: &mut StdRng,
    rate: f64,
    from_s: f64,
    to_s: f64,
    out: &mut Vec<(f64, usize, bool)>,
    tenant: usize,
    burst: bool,
) {
    let mut t = from_s;
    loop {
        t += exp_sample(rng, 1.0 / rate);
        if t >= to_s {
            return;
        }
        out.push((t, tenant, burst));
    }
}

/// The whole schedule (burst included), in arrival order. Three independent Poisson processes,
/// each from its own seeded stream: B over the run, A at its normal rate over the run, and the
/// burst's extra A requests at `(burst_factor - 1)` times A's rate inside the burst (a Poisson
/// process at the burst rate, whose surplus the no-burst run leaves out).
pub fn schedule(cfg: &ScenarioConfig) -> Vec<Arrival> {
    let stream = |k: u64| StdRng::seed_from_u64(cfg.seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut times = Vec::new();
    poisson(&mut stream(1), cfg.b_rate_per_s, 0.0, cfg.duration_s, &mut times, B, false);
    poisson(&mut stream(2), cfg.a_rate_per_s, 0.0, cfg.duration_s, &mut times, A, false);
    let extra = cfg.a_rate_per_s * (cfg.burst_factor - 1.0);
    if extra > 0.0 {
        poisson(&mut stream(3), extra, cfg.burst_start_s, cfg.burst_end_s, &mut times, A, true);
    }
    times.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut sizes = stream(4);
    times
        .into_iter()
        .enumerate()
        .map(|(id, (t_s, tenant, burst))| Arrival {
            id,
            t_s,
            tenant,
            burst,
            user_tokens: cfg.shape.user_tokens.draw(&mut sizes),
            output_tokens: cfg.shape.output_tokens.draw(&mut sizes),
        })
        .collect()
}

/// The arrivals of one run: the whole schedule, or without the burst's extra requests.
pub fn arrivals_of(all: &[Arrival], spec: &RunSpec) -> Vec<Arrival> {
    all.iter().filter(|a| spec.burst || !a.burst).copied().collect()
}

/// The scenario's kvroute policy sections (`request.objectives` and `flow_control`, enabled or
/// not) merged into `base` (the routing settings of the caller): `flow` is the flow-control
/// section the caller chose (detector, limits), `enabled` is set here.
pub fn policy_json(base: serde_json::Value, flow: &serde_json::Value, enabled: bool) -> serde_json::Value {
    let mut doc = match base {
        serde_json::Value::Object(m) => m,
        _ => serde_json::Map::new(),
    };
    let objectives: serde_json::Map<String, serde_json::Value> =
        OBJECTIVES.iter().map(|(n, p)| ((*n).to_owned(), serde_json::json!(p))).collect();
    let request = doc.entry("request").or_insert_with(|| serde_json::json!({}));
    if let Some(r) = request.as_object_mut() {
        r.insert("objectives".into(), serde_json::Value::Object(objectives));
    }
    let mut f = match flow {
        serde_json::Value::Object(m) => m.clone(),
        _ => serde_json::Map::new(),
    };
    f.insert("enabled".into(), serde_json::json!(enabled));
    doc.insert("flow_control".into(), serde_json::Value::Object(f));
    serde_json::Value::Object(doc)
}

/// The headers of a request of tenant `tenant` in a run with `priorities` (besides the request
/// id): its fairness id and objective.
pub fn headers(tenant: usize, priorities: Priorities) -> [(&'static str, &'static str); 2] {
    [("x-llm-d-inference-fairness-id", TENANTS[tenant]), ("x-llm-d-inference-objective", priorities.objective(tenant))]
}

/// How one request ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "end", rename_all = "snake_case")]
pub enum End {
    /// Not ended (yet): the run gave up on it.
    Unfinished,
    /// Streamed to the end.
    Completed {
        /// Arrival to first token, ms.
        ttft_ms: f64,
        /// Arrival to the end of the stream, ms.
        e2e_ms: f64,
    },
    /// Refused at admission (flow control's shedding or limits, or routing's shedding with flow
    /// control off), or dropped from the queue after waiting (`queued`).
    Rejected {
        /// HTTP status.
        status: u16,
        /// The reason (`x-llm-d-request-dropped-reason`, or `shed-by-routing`).
        reason: String,
        /// Dropped after waiting in the queue (else refused at admission).
        queued: bool,
        /// Sheddable requests of lower priority queued at that moment.
        sheddable_queued: u32,
    },
    /// The client went away while it was held (`cancel`).
    Cancelled,
    /// Sent and failed.
    Failed {
        /// What happened.
        error: String,
    },
}

/// One request's record in a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    /// The request.
    pub arrival: Arrival,
    /// Its priority in the run.
    pub priority: i32,
    /// How long it waited in flow control's queue, ms (`None`: it never queued).
    pub queued_ms: Option<f64>,
    /// How it ended.
    pub end: End,
    /// How many ends were recorded (exactly 1 when the run is consistent).
    pub ends: u32,
}

impl RequestRecord {
    /// A request not ended yet.
    pub fn new(arrival: Arrival, priority: i32) -> RequestRecord {
        RequestRecord { arrival, priority, queued_ms: None, end: End::Unfinished, ends: 0 }
    }

    /// Record its end (counted: a second end is an inconsistency the summary reports).
    pub fn finish(&mut self, end: End) {
        self.ends += 1;
        if self.ends == 1 {
            self.end = end;
        }
    }
}

/// One request sent to an engine (admitted at once or released from the queue).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Dispatch {
    /// When, seconds from the start.
    pub t_s: f64,
    /// Whose.
    pub tenant: usize,
    /// It had waited in the queue.
    pub from_queue: bool,
    /// Requests still queued per tenant right after it left.
    pub queued: [u32; 2],
}

impl Dispatch {
    /// Made while the pool was saturated: it had waited, or others were waiting.
    pub fn saturated(&self) -> bool {
        self.from_queue || self.queued.iter().any(|&q| q > 0)
    }

    /// Made while both tenants had requests waiting (itself included).
    pub fn contended(&self) -> bool {
        (0..2).all(|t| self.queued[t] > 0 || (self.from_queue && self.tenant == t))
    }
}

/// A run's raw results.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunRecords {
    /// Which run.
    pub spec: RunSpec,
    /// One per request of the run, in arrival order.
    pub records: Vec<RequestRecord>,
    /// In order.
    pub dispatches: Vec<Dispatch>,
    /// Flow control's counters at the end (flow control on).
    pub flow: Option<kvroute::FlowCounters>,
    /// Wall time of the run, seconds (the simulator: its computing time).
    pub wall_s: f64,
    /// Notes for the report.
    pub notes: Vec<String>,
}

/// One tenant in one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TenantSummary {
    /// Fairness id.
    pub tenant: &'static str,
    /// Objective sent.
    pub objective: &'static str,
    /// Its priority.
    pub priority: i32,
    /// Requests.
    pub requests: u64,
    /// Of which arrived during the burst.
    pub burst_requests: u64,
    /// Completed.
    pub completed: u64,
    /// Refused at admission.
    pub shed: u64,
    /// Dropped from the queue after waiting.
    pub dropped: u64,
    /// Refusals and drops by reason.
    pub reasons: BTreeMap<String, u64>,
    /// Cancelled.
    pub cancelled: u64,
    /// Failed.
    pub failed: u64,
    /// Never ended.
    pub unfinished: u64,
    /// Requests that waited in the queue.
    pub queued: u64,
    /// Their wait, p90, ms.
    pub queue_wait_p90_ms: f64,
    /// TTFT of the completed requests, p50, ms.
    pub ttft_p50_ms: f64,
    /// p90.
    pub ttft_p90_ms: f64,
    /// p99.
    pub ttft_p99_ms: f64,
    /// TTFT of the completed requests that arrived during the burst, p50, ms.
    pub burst_ttft_p50_ms: f64,
    /// p90.
    pub burst_ttft_p90_ms: f64,
    /// Completions whose stream ended during the burst, per second of burst.
    pub burst_completed_per_s: f64,
    /// Completions per second, first arrival to last completion.
    pub completed_per_s: f64,
}

/// One run, summarized.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunSummary {
    /// Which run.
    pub spec: RunSpec,
    /// Per tenant ([`A`], [`B`]).
    pub tenants: Vec<TenantSummary>,
    /// Dispatches made while saturated ([`Dispatch::saturated`]).
    pub saturated_dispatches: u64,
    /// Their share per tenant.
    pub saturated_share: [f64; 2],
    /// Dispatches made while both tenants were waiting ([`Dispatch::contended`]).
    pub contended_dispatches: u64,
    /// Their share per tenant.
    pub contended_share: [f64; 2],
    /// Requests refused or dropped while a sheddable request of lower priority was queued.
    pub violations: u64,
    /// Requests with other than exactly one end.
    pub inconsistent_ends: u64,
    /// Requests arriving during the burst, per second of burst.
    pub burst_offered_per_s: f64,
    /// Completions during the burst (both tenants), per second of burst.
    pub burst_served_per_s: f64,
    /// B's (arrival s, TTFT ms) of its completed requests, for the chart.
    #[serde(skip)]
    pub b_points: Vec<(f64, f64)>,
    /// Flow control's counters (flow control on).
    pub flow: Option<kvroute::FlowCounters>,
    /// Wall time, seconds.
    pub wall_s: f64,
    /// Notes.
    pub notes: Vec<String>,
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[nearest_rank(q, sorted.len()) - 1]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

impl RunSummary {
    /// Summarize a run of the scenario `cfg`.
    pub fn new(cfg: &ScenarioConfig, run: &RunRecords) -> RunSummary {
        let tenants = (0..2).map(|t| tenant_summary(cfg, run, t)).collect();
        let share = |sel: &dyn Fn(&Dispatch) -> bool| {
            let d: Vec<&Dispatch> = run.dispatches.iter().filter(|d| sel(d)).collect();
            let n = d.len() as u64;
            let mut s = [0.0; 2];
            for (t, v) in s.iter_mut().enumerate() {
                *v = if n == 0 { f64::NAN } else { d.iter().filter(|d| d.tenant == t).count() as f64 / n as f64 };
            }
            (n, s)
        };
        let (saturated_dispatches, saturated_share) = share(&Dispatch::saturated);
        let (contended_dispatches, contended_share) = share(&Dispatch::contended);
        let violations = run
            .records
            .iter()
            .filter(|r| matches!(r.end, End::Rejected { sheddable_queued, .. } if sheddable_queued > 0))
            .count() as u64;
        let b_points = run
            .records
            .iter()
            .filter(|r| r.arrival.tenant == B)
            .filter_map(|r| match r.end {
                End::Completed { ttft_ms, .. } => Some((r.arrival.t_s, ttft_ms)),
                _ => None,
            })
            .collect();
        let tenants: Vec<TenantSummary> = tenants;
        let served = tenants.iter().map(|t| t.burst_completed_per_s).sum();
        RunSummary {
            spec: run.spec,
            tenants,
            saturated_dispatches,
            saturated_share,
            contended_dispatches,
            contended_share,
            violations,
            inconsistent_ends: run.records.iter().filter(|r| r.ends != 1).count() as u64,
            burst_offered_per_s: run.records.iter().filter(|r| cfg.in_burst(r.arrival.t_s)).count() as f64
                / cfg.burst_s().max(1e-9),
            burst_served_per_s: served,
            b_points,
            flow: run.flow.clone(),
            wall_s: run.wall_s,
            notes: run.notes.clone(),
        }
    }

    /// Tenant `t`.
    pub fn tenant(&self, t: usize) -> &TenantSummary {
        &self.tenants[t]
    }
}

fn tenant_summary(cfg: &ScenarioConfig, run: &RunRecords, t: usize) -> TenantSummary {
    let mine: Vec<&RequestRecord> = run.records.iter().filter(|r| r.arrival.tenant == t).collect();
    let priorities = run.spec.priorities;
    let mut s = TenantSummary {
        tenant: TENANTS[t],
        objective: priorities.objective(t),
        priority: priorities.priority(t),
        requests: mine.len() as u64,
        burst_requests: mine.iter().filter(|r| cfg.in_burst(r.arrival.t_s)).count() as u64,
        completed: 0,
        shed: 0,
        dropped: 0,
        reasons: BTreeMap::new(),
        cancelled: 0,
        failed: 0,
        unfinished: 0,
        queued: mine.iter().filter(|r| r.queued_ms.is_some()).count() as u64,
        queue_wait_p90_ms: pct(&sorted(mine.iter().filter_map(|r| r.queued_ms).collect()), 0.9),
        ttft_p50_ms: f64::NAN,
        ttft_p90_ms: f64::NAN,
        ttft_p99_ms: f64::NAN,
        burst_ttft_p50_ms: f64::NAN,
        burst_ttft_p90_ms: f64::NAN,
        burst_completed_per_s: 0.0,
        completed_per_s: 0.0,
    };
    let (mut all, mut burst) = (Vec::new(), Vec::new());
    let mut done_in_burst = 0u64;
    let mut last_end_s = 0.0f64;
    for r in &mine {
        match &r.end {
            End::Completed { ttft_ms, e2e_ms } => {
                s.completed += 1;
                all.push(*ttft_ms);
                if cfg.in_burst(r.arrival.t_s) {
                    burst.push(*ttft_ms);
                }
                let end_s = r.arrival.t_s + e2e_ms / 1000.0;
                last_end_s = last_end_s.max(end_s);
                if cfg.in_burst(end_s) {
                    done_in_burst += 1;
                }
            }
            End::Rejected { reason, queued, .. } => {
                if *queued {
                    s.dropped += 1;
                } else {
                    s.shed += 1;
                }
                *s.reasons.entry(reason.clone()).or_insert(0) += 1;
            }
            End::Cancelled => s.cancelled += 1,
            End::Failed { .. } => s.failed += 1,
            End::Unfinished => s.unfinished += 1,
        }
    }
    let (all, burst) = (sorted(all), sorted(burst));
    s.ttft_p50_ms = pct(&all, 0.5);
    s.ttft_p90_ms = pct(&all, 0.9);
    s.ttft_p99_ms = pct(&all, 0.99);
    s.burst_ttft_p50_ms = pct(&burst, 0.5);
    s.burst_ttft_p90_ms = pct(&burst, 0.9);
    s.burst_completed_per_s = done_in_burst as f64 / cfg.burst_s().max(1e-9);
    let first = mine.first().map_or(0.0, |r| r.arrival.t_s);
    s.completed_per_s = if last_end_s > first { s.completed as f64 / (last_end_s - first) } else { 0.0 };
    s
}

/// One of the targets, judged on the runs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Target {
    /// What is asked.
    pub target: String,
    /// What was measured.
    pub measured: String,
    /// `Some(met)`; `None`: informational (an expectation, not a target), or the runs needed are
    /// missing.
    pub met: Option<bool>,
}

fn run_named<'a>(runs: &'a [RunSummary], spec: &RunSpec) -> Option<&'a RunSummary> {
    runs.iter().find(|r| r.spec == *spec)
}

/// B's burst-window TTFT p90 of run `spec` over the same of run `base`.
pub fn b_ratio(runs: &[RunSummary], spec: &RunSpec, base: &RunSpec) -> Option<f64> {
    let b = run_named(runs, base)?.tenant(B).burst_ttft_p90_ms;
    let v = run_named(runs, spec)?.tenant(B).burst_ttft_p90_ms;
    (b.is_finite() && v.is_finite() && b > 0.0).then(|| v / b)
}

fn ms(v: f64) -> String {
    if !v.is_finite() {
        "-".to_owned()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn share(v: f64) -> String {
    if v.is_finite() {
        format!("{:.0}%", v * 100.0)
    } else {
        "-".to_owned()
    }
}

/// The targets, judged on the runs present.
pub fn targets(runs: &[RunSummary]) -> Vec<Target> {
    let mut out = Vec::new();
    let b_p90 = |spec: &RunSpec| run_named(runs, spec).map_or(f64::NAN, |r| r.tenant(B).burst_ttft_p90_ms);
    let on = run_named(runs, &BURST_ON);
    let vs_on = b_ratio(runs, &BURST_ON, &NO_BURST_ON);
    let vs_off = b_ratio(runs, &BURST_ON, &NO_BURST_OFF);
    out.push(Target {
        target: format!(
            "with flow control, B's TTFT p90 (arrivals during the burst) within {TTFT_TARGET_RATIO}x of its no-burst value \
             (both no-burst runs, flow control on and off)"
        ),
        measured: match (vs_on, vs_off) {
            (Some(a), Some(b)) => format!(
                "{} ms; without the burst {} ms with flow control on ({a:.2}x), {} ms with it off ({b:.2}x)",
                ms(b_p90(&BURST_ON)),
                ms(b_p90(&NO_BURST_ON)),
                ms(b_p90(&NO_BURST_OFF))
            ),
            _ => "runs missing".into(),
        },
        met: vs_on.zip(vs_off).map(|(a, b)| a.max(b) <= TTFT_TARGET_RATIO),
    });
    let ratio_off = b_ratio(runs, &BURST_OFF, &NO_BURST_OFF);
    let off = run_named(runs, &BURST_OFF);
    out.push(Target {
        target: "the burst saturates the pool (no target: the scenario's premise)".into(),
        measured: match off {
            Some(r) => format!(
                "with flow control off, {:.1} req/s served during the burst of {:.1} offered ({:.0}%): {}",
                r.burst_served_per_s,
                r.burst_offered_per_s,
                100.0 * r.burst_served_per_s / r.burst_offered_per_s.max(1e-9),
                if r.burst_served_per_s < 0.9 * r.burst_offered_per_s {
                    "saturated"
                } else {
                    "NOT saturated (the capacity was underestimated)"
                }
            ),
            None => "run missing".into(),
        },
        met: None,
    });
    out.push(Target {
        target: "without flow control, expect several-fold (no target)".into(),
        measured: match ratio_off {
            Some(r) => format!("{} ms vs {} ms = {r:.1}x", ms(b_p90(&BURST_OFF)), ms(b_p90(&NO_BURST_OFF))),
            None => "runs missing".into(),
        },
        met: None,
    });
    let eq = run_named(runs, &BURST_EQUAL);
    out.push(Target {
        target: format!(
            "two equal-priority tenants, one bursting: each at least {:.0}% of the dispatches while saturated (judged \
             while both had requests waiting: a tenant with nothing waiting is given nothing)",
            FAIR_SHARE_TARGET * 100.0
        ),
        measured: match eq {
            Some(r) => format!(
                "while both were waiting A {} / B {} of {} dispatches; while anything was queued A {} / B {} of {}",
                share(r.contended_share[A]),
                share(r.contended_share[B]),
                r.contended_dispatches,
                share(r.saturated_share[A]),
                share(r.saturated_share[B]),
                r.saturated_dispatches
            ),
            None => "run missing".into(),
        },
        met: eq.map(|r| r.contended_dispatches > 0 && r.contended_share.iter().all(|&s| s >= FAIR_SHARE_TARGET)),
    });
    let violations: u64 = runs.iter().map(|r| r.violations).sum();
    out.push(Target {
        target: "sheddable traffic is shed first, never a higher-priority request while a sheddable one is queued"
            .into(),
        measured: match on {
            Some(r) => format!(
                "flow on: A (batch) shed {} + dropped {} from the queue, B (interactive) refused or dropped {}; \
                 requests refused while a lower-priority sheddable one was queued (all runs): {violations}",
                r.tenant(A).shed,
                r.tenant(A).dropped,
                r.tenant(B).shed + r.tenant(B).dropped
            ),
            None => "run missing".into(),
        },
        met: on.map(|r| violations == 0 && r.tenant(B).shed + r.tenant(B).dropped == 0),
    });
    out
}

/// The targets as printable lines.
pub fn targets_text(targets: &[Target]) -> String {
    let mut s = String::new();
    for t in targets {
        let tag = match t.met {
            Some(true) => "[met]    ",
            Some(false) => "[NOT MET]",
            None => "[info]   ",
        };
        s.push_str(&format!("{tag} {}: {}\n", t.target, t.measured));
    }
    s
}

/// The runs as an aligned Markdown table.
pub fn table(runs: &[RunSummary]) -> String {
    const COLUMNS: [&str; 12] = [
        "run",
        "B TTFT p50 ms",
        "B TTFT p90 ms",
        "B p90 / no burst",
        "B p90 all ms",
        "B done",
        "A done",
        "A shed",
        "A dropped",
        "A req/s in burst",
        "A/B dispatches, both waiting",
        "B refused",
    ];
    let cells: Vec<[String; 12]> = runs
        .iter()
        .map(|r| {
            let (a, b) = (r.tenant(A), r.tenant(B));
            let ratio = b_ratio(runs, &r.spec, &r.spec.baseline()).unwrap_or(f64::NAN);
            [
                r.spec.name.to_owned(),
                ms(b.burst_ttft_p50_ms),
                ms(b.burst_ttft_p90_ms),
                if ratio.is_finite() { format!("{ratio:.2}x") } else { "-".into() },
                ms(b.ttft_p90_ms),
                format!("{}/{}", b.completed, b.requests),
                format!("{}/{}", a.completed, a.requests),
                a.shed.to_string(),
                a.dropped.to_string(),
                format!("{:.2}", a.burst_completed_per_s),
                if r.contended_dispatches == 0 {
                    "-".into()
                } else {
                    format!(
                        "{}/{} of {}",
                        share(r.contended_share[A]),
                        share(r.contended_share[B]),
                        r.contended_dispatches
                    )
                },
                (b.shed + b.dropped).to_string(),
            ]
        })
        .collect();
    markdown(&COLUMNS, &cells, &[0])
}

/// The results as JSON: the scenario, every run's summary (both tenants), the targets.
pub fn results_json(cfg: &ScenarioConfig, runs: &[RunSummary]) -> serde_json::Value {
    // Non-finite numbers (a percentile of nothing) are written as null.
    serde_json::json!({
        "scenario": cfg,
        "runs": runs,
        "targets": targets(runs),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ScenarioConfig {
        let shape = Shape { system_tokens: 64, user_tokens: Span::new(16, 32), output_tokens: Span::new(2, 4) };
        ScenarioConfig::at_capacity(40.0, 30.0, shape, 7)
    }

    #[test]
    fn the_schedule_is_seeded_and_the_burst_is_ten_times_the_rate() {
        let c = cfg();
        let s = schedule(&c);
        assert_eq!(s, schedule(&c));
        assert_ne!(s, schedule(&ScenarioConfig { seed: 8, ..c }));
        assert!(s.windows(2).all(|w| w[0].t_s <= w[1].t_s));
        assert!(s.iter().enumerate().all(|(i, a)| a.id == i));
        let count = |f: &dyn Fn(&Arrival) -> bool| s.iter().filter(|a| f(a)).count() as f64;
        let b = count(&|a| a.tenant == B);
        assert!((b / c.duration_s / c.b_rate_per_s - 1.0).abs() < 0.15, "B {b}");
        let a_in = count(&|a| a.tenant == A && c.in_burst(a.t_s));
        let a_out = count(&|a| a.tenant == A && !c.in_burst(a.t_s));
        let (rate_in, rate_out) = (a_in / c.burst_s(), a_out / (c.duration_s - c.burst_s()));
        assert!((rate_in / rate_out / BURST_FACTOR - 1.0).abs() < 0.3, "{rate_in} vs {rate_out}");
        assert!(s.iter().filter(|a| a.burst).all(|a| a.tenant == A && c.in_burst(a.t_s)));
        // The no-burst run keeps everything else, ids included.
        let quiet = arrivals_of(&s, &NO_BURST_OFF);
        assert_eq!(quiet.len(), s.iter().filter(|a| !a.burst).count());
        assert_eq!(arrivals_of(&s, &NO_BURST_ON), quiet);
        assert_eq!(arrivals_of(&s, &BURST_OFF), s);
    }

    #[test]
    fn objectives_and_policy_sections() {
        assert_eq!(Priorities::Tiered.priority(A), -1);
        assert_eq!(Priorities::Tiered.priority(B), 10);
        assert_eq!(Priorities::Equal.priority(A), Priorities::Equal.priority(B));
        let doc = policy_json(
            serde_json::json!({"index": {"mode": "approx"}}),
            &serde_json::json!({"max_requests": 5}),
            true,
        );
        let p = kvroute::Policy::from_json(&doc.to_string()).unwrap();
        assert!(p.config().flow_control.enabled);
        assert_eq!(p.config().flow_control.max_requests, 5);
        assert_eq!(p.config().request.objectives.get("batch"), Some(&-1));
    }

    #[test]
    fn summaries_count_ends_shares_and_violations() {
        let c = cfg();
        let arrival = |id, t_s, tenant| Arrival { id, t_s, tenant, burst: false, user_tokens: 1, output_tokens: 1 };
        let mut recs = vec![
            RequestRecord::new(arrival(0, 1.0, A), -1),
            RequestRecord::new(arrival(1, 11.0, B), 10),
            RequestRecord::new(arrival(2, 12.0, B), 10),
            RequestRecord::new(arrival(3, 12.5, A), -1),
        ];
        recs[0].finish(End::Completed { ttft_ms: 10.0, e2e_ms: 20.0 });
        recs[1].finish(End::Completed { ttft_ms: 30.0, e2e_ms: 40.0 });
        recs[2].finish(End::Rejected {
            status: 429,
            reason: "rejected-ttl-expired".into(),
            queued: true,
            sheddable_queued: 1,
        });
        recs[3].finish(End::Cancelled);
        recs[3].finish(End::Cancelled);
        let d = |tenant, from_queue, queued| Dispatch { t_s: 0.0, tenant, from_queue, queued };
        let run = RunRecords {
            spec: BURST_ON,
            records: recs,
            dispatches: vec![d(A, false, [0, 0]), d(B, true, [3, 0]), d(A, true, [2, 1]), d(A, false, [0, 0])],
            flow: None,
            wall_s: 0.0,
            notes: vec![],
        };
        let s = RunSummary::new(&c, &run);
        assert_eq!((s.saturated_dispatches, s.contended_dispatches), (2, 2));
        assert_eq!(s.saturated_share, [0.5, 0.5]);
        assert_eq!((s.violations, s.inconsistent_ends), (1, 1));
        let (a, b) = (s.tenant(A), s.tenant(B));
        assert_eq!((a.requests, a.completed, a.cancelled), (2, 1, 1));
        assert_eq!((b.completed, b.dropped, b.shed, b.burst_requests), (1, 1, 0, 2));
        assert_eq!(b.burst_ttft_p90_ms, 30.0);
        assert!(table(std::slice::from_ref(&s)).contains("| burst, flow on "));
        let t = targets(&[s]);
        assert_eq!(t.len(), 5);
        assert_eq!(t[4].met, Some(false), "{t:?}");
        assert_eq!(t[0].met, None, "no baseline run");
    }
}
