//! The noisy-neighbor scenario in the simulator: the cluster model of [`crate::sim`] (FIFO
//! prefill per endpoint, continuous-batching decode, metrics pushed every
//! `metrics_interval_ms`), kvroute's `Router` routing every request, and flow control driven
//! through the core's protocol in virtual time:
//!
//! - every arrival goes through `admit_http` (admit now → `route_http`; queued → held by its
//!   ticket; rejected → answered);
//! - `take_releases` after every arrival, completion and metrics push, and at the time
//!   `next_flow_deadline` names (a timer event); each release routes its held request or answers
//!   it with its rejection.
//!
//! With flow control off the same calls are made (`admit` then admits everything), so the runs
//! differ only in the policy. Deterministic: same settings, same records.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use kvroute::{Admission, EndpointSpec, Policy, Release, ReleaseOutcome, Role, Router, StateError, Ticket};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::{
    arrivals_of, headers, policy_json, schedule, Arrival, Dispatch, End, Priorities, RequestRecord, RunRecords,
    RunSpec, ScenarioConfig, Shape, RUNS, TENANTS,
};
use crate::error::SimError;
use crate::sim::{prepare, ClusterConfig, Event, Sim, SimRequest};
use crate::workload::{Span, TextGen, TraceRequest, BYTES_PER_TOKEN};

/// Default request sizes of the simulated scenario.
pub const DEFAULT_SHAPE: Shape =
    Shape { system_tokens: 1024, user_tokens: Span::new(256, 768), output_tokens: Span::new(16, 64) };
/// Default endpoints of the simulated scenario.
pub const DEFAULT_ENDPOINTS: u32 = 4;
/// Default length of the simulated schedule, seconds.
pub const DEFAULT_DURATION_S: f64 = 60.0;
/// Model name in the bodies.
const MODEL: &str = "llama-3.1-8b-instruct";

/// The flow-control section of the simulated flow-control runs: llm-d's utilization detector at
/// its defaults (the simulated engines publish their prefill queue as `waiting`: saturated at 5
/// waiting or 80% KV), and a ceiling of 0.2 on the sheddable band (priority -1): batch requests
/// dispatch only while the engines have less than one request waiting on average, so they fill
/// capacity that would otherwise idle and leave the queue to higher bands. Everything else at its
/// default (round-robin fairness, FCFS, 30 s TTL, shedding before queueing).
pub fn default_flow() -> serde_json::Value {
    serde_json::json!({
        "saturation_detector": {"kind": "utilization"},
        "priority_bands": [{"priority": -1, "saturation_ceiling": 0.2}],
    })
}

/// Everything a simulated scenario needs.
#[derive(Debug, Clone, PartialEq)]
pub struct SimScenario {
    /// The simulated cluster.
    pub cluster: ClusterConfig,
    /// The schedule.
    pub scenario: ScenarioConfig,
    /// The `flow_control` section of the flow-control runs (`enabled` is set per run).
    pub flow: serde_json::Value,
    /// The policy's other sections (routing).
    pub base: serde_json::Value,
}

impl SimScenario {
    /// The standard scenario on `cluster`: rates from [`capacity`], `duration_s` long.
    pub fn new(cluster: ClusterConfig, shape: Shape, duration_s: f64, seed: u64) -> SimScenario {
        let scenario = ScenarioConfig::at_capacity(capacity(&cluster, &shape), duration_s, shape, seed);
        SimScenario { cluster, scenario, flow: default_flow(), base: serde_json::json!({}) }
    }
}

/// The cluster's capacity for the scenario's requests, requests per second: every endpoint
/// prefills one request at a time (its overhead plus the message; the tenant's system prompt is
/// cached after its first request there), and decoding runs alongside.
pub fn capacity(cluster: &ClusterConfig, shape: &Shape) -> f64 {
    let service_ms = cluster.prefill_overhead_ms + shape.mean_user_tokens() / cluster.prefill_tokens_per_s * 1000.0;
    f64::from(cluster.endpoints) * 1000.0 / service_ms.max(1e-6)
}

/// The bodies and headers of `arrivals` in a run with `priorities`: chat requests, the tenant's
/// system prompt then the request's own message (the same text for the same request id in every
/// run), `max_tokens` = its output.
fn trace(cfg: &ScenarioConfig, arrivals: &[Arrival], priorities: Priorities) -> Vec<TraceRequest> {
    let mut vocab_rng = StdRng::seed_from_u64(cfg.seed ^ 0x6e6f_6973_7900);
    let text = TextGen::new(&mut vocab_rng);
    let systems: Vec<String> = TENANTS
        .iter()
        .map(|t| {
            let head = format!("You are the assistant of {t}. ");
            let body = cfg.shape.system_tokens.saturating_sub((head.len() / BYTES_PER_TOKEN) as u32);
            format!("{head}{}", text.text(&mut vocab_rng, body))
        })
        .collect();
    arrivals
        .iter()
        .map(|a| {
            let mut rng = StdRng::seed_from_u64(cfg.seed ^ (a.id as u64 + 1).wrapping_mul(0xA076_1D64_78BD_642F));
            let user = format!("Request {}. {}", a.id, text.text(&mut rng, a.user_tokens));
            let body = serde_json::json!({
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": systems[a.tenant]},
                    {"role": "user", "content": user},
                ],
                "max_tokens": a.output_tokens,
            });
            let mut hs: Vec<(String, String)> = vec![("x-request-id".into(), format!("nn-{}", a.id))];
            hs.extend(headers(a.tenant, priorities).iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
            TraceRequest {
                t_ms: (a.t_s * 1000.0).round() as u64,
                body: serde_json::to_vec(&body).unwrap_or_default(),
                headers: hs,
                output_tokens: a.output_tokens,
            }
        })
        .collect()
}

struct FlowLoop<'a> {
    sim: Sim<'a>,
    reqs: &'a [SimRequest],
    arrivals: &'a [Arrival],
    router: Router,
    index_of: HashMap<String, usize>,
    /// Held requests by ticket: (request, queued at µs).
    held: HashMap<Ticket, (usize, u64)>,
    queued_by_tenant: [u32; 2],
    queued_by_priority: BTreeMap<i32, u32>,
    records: Vec<RequestRecord>,
    dispatches: Vec<Dispatch>,
    armed_us: Option<u64>,
    buf: Vec<Release>,
    notes: Vec<String>,
}

impl FlowLoop<'_> {
    fn headers(&self, r: usize) -> impl Iterator<Item = (&str, &str)> {
        self.reqs[r].headers.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// Sheddable requests of lower priority than `priority` now queued.
    fn sheddable_below(&self, priority: i32) -> u32 {
        self.queued_by_priority.range(..priority.min(0)).map(|(_, n)| n).sum()
    }

    fn reject(&mut self, r: usize, status: u16, reason: &str, queued: bool) {
        let sheddable_queued = self.sheddable_below(self.records[r].priority);
        self.records[r].finish(End::Rejected { status, reason: reason.to_owned(), queued, sheddable_queued });
    }

    fn arrive(&mut self, r: usize, now_us: u64) {
        let now_ms = now_us / 1000;
        let admission = self.router.admit_http(&self.reqs[r].body, self.headers(r), now_ms);
        match admission {
            Ok(Admission::Admit) => self.dispatch(r, now_us, false),
            Ok(Admission::Queued(t)) => {
                self.held.insert(t, (r, now_us));
                self.queued_by_tenant[self.arrivals[r].tenant] += 1;
                *self.queued_by_priority.entry(self.records[r].priority).or_insert(0) += 1;
            }
            Ok(Admission::Rejected(rej)) => self.reject(r, rej.status, rej.reason.as_str(), false),
            Err(e) => self.records[r].finish(End::Failed { error: format!("admit: {e}") }),
        }
        self.opportunity(now_us);
    }

    fn dispatch(&mut self, r: usize, now_us: u64, from_queue: bool) {
        let now_ms = now_us / 1000;
        let d = match self.router.route_http(&self.reqs[r].body, self.headers(r), now_ms) {
            Ok(d) => d,
            Err(e) => {
                self.records[r].finish(End::Failed { error: format!("route: {e}") });
                return;
            }
        };
        if let Some(e) = d.endpoint().and_then(|id| self.index_of.get(id).copied()) {
            self.sim.send(r, e, Some(d.request_id), now_us);
            self.dispatches.push(Dispatch {
                t_s: now_us as f64 / 1e6,
                tenant: self.arrivals[r].tenant,
                from_queue,
                queued: self.queued_by_tenant,
            });
            return;
        }
        let _ = self.router.complete(&d.request_id);
        match d.shed() {
            Some(shed) => {
                let status = shed.status;
                self.reject(r, status, "shed-by-routing", from_queue);
            }
            None => self.records[r].finish(End::Failed { error: "no endpoint".into() }),
        }
    }

    /// A dispatch opportunity: take the releases, route or answer each, re-arm the timer.
    fn opportunity(&mut self, now_us: u64) {
        let mut buf = std::mem::take(&mut self.buf);
        self.router.take_releases_into(now_us / 1000, &mut buf);
        for rel in buf.drain(..) {
            let Some((r, at_us)) = self.held.remove(&rel.ticket) else {
                self.notes.push(format!("release of an unknown ticket {}", rel.ticket));
                continue;
            };
            self.queued_by_tenant[self.arrivals[r].tenant] -= 1;
            if let Some(n) = self.queued_by_priority.get_mut(&self.records[r].priority) {
                *n -= 1;
            }
            self.records[r].queued_ms = Some(now_us.saturating_sub(at_us) as f64 / 1000.0);
            match rel.outcome {
                ReleaseOutcome::Dispatched => self.dispatch(r, now_us, true),
                ReleaseOutcome::Dropped(rej) => self.reject(r, rej.status, rej.reason.as_str(), true),
            }
        }
        self.buf = buf;
        if let Some(deadline_ms) = self.router.next_flow_deadline() {
            let at = deadline_ms.saturating_mul(1000).max(now_us + 1000);
            if self.armed_us.is_none_or(|a| at < a) {
                self.sim.schedule(at, Event::Timer);
                self.armed_us = Some(at);
            }
        }
    }
}

/// Simulate one run of the scenario.
pub fn run(s: &SimScenario, all: &[Arrival], spec: &RunSpec) -> Result<RunRecords, SimError> {
    s.cluster.validate()?;
    s.scenario.validate()?;
    let wall = Instant::now();
    let arrivals = arrivals_of(all, spec);
    if arrivals.is_empty() {
        return Err(SimError::EmptyWorkload);
    }
    let policy = Policy::from_json(&policy_json(s.base.clone(), &s.flow, spec.flow_control).to_string())?;
    let reqs = prepare(trace(&s.scenario, &arrivals, spec.priorities), &policy.config().request)?;
    let router = Router::new(policy);
    let ids = s.cluster.endpoint_ids();
    let mut index_of = HashMap::new();
    for (i, id) in ids.iter().enumerate() {
        router.upsert_endpoint(EndpointSpec::new(id.as_str(), Role::Both))?;
        index_of.insert(id.clone(), i);
    }
    let records = arrivals.iter().map(|a| RequestRecord::new(*a, spec.priorities.priority(a.tenant))).collect();
    let mut l = FlowLoop {
        sim: Sim::new(&s.cluster, &reqs),
        reqs: &reqs,
        arrivals: &arrivals,
        router,
        index_of,
        held: HashMap::new(),
        queued_by_tenant: [0; 2],
        queued_by_priority: BTreeMap::new(),
        records,
        dispatches: Vec::new(),
        armed_us: None,
        buf: Vec::new(),
        notes: Vec::new(),
    };
    l.sim.schedule(0, Event::Metrics);
    let n = reqs.len();
    let mut next = 0usize;
    loop {
        let arrival_us = reqs.get(next).map(|r| r.arrival_ms * 1000);
        let take_event = match (l.sim.next_event_us(), arrival_us) {
            (None, None) => break,
            (Some(e), Some(a)) => e <= a,
            (Some(_), None) => true,
            (None, Some(_)) => false,
        };
        if !take_event {
            let r = next;
            next += 1;
            l.arrive(r, reqs[r].arrival_ms * 1000);
            continue;
        }
        let Some(ev) = l.sim.pop() else { break };
        let now_us = ev.t_us;
        match ev.event {
            Event::Metrics => {
                let work_left = next < n || !l.held.is_empty() || l.sim.endpoints.iter().any(|e| e.busy());
                if work_left {
                    for (id, m) in ids.iter().zip(l.sim.snapshots(now_us / 1000)) {
                        l.router.update_metrics(id, m)?;
                    }
                    l.sim.schedule(now_us + s.cluster.metrics_interval_ms * 1000, Event::Metrics);
                    l.opportunity(now_us);
                }
            }
            Event::PrefillDone { endpoint } => l.sim.prefill_done(endpoint, now_us),
            Event::DecodeDone { request } => {
                if let Some(t) = l.sim.decode_done(request) {
                    match l.router.complete(&t) {
                        Ok(()) | Err(StateError::UnknownRequest { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                let ttft_ms = l.sim.flights[request].ttft_us as f64 / 1000.0;
                let e2e_ms = now_us.saturating_sub(reqs[request].arrival_ms * 1000) as f64 / 1000.0;
                l.records[request].finish(End::Completed { ttft_ms, e2e_ms });
                l.opportunity(now_us);
            }
            Event::Timer => {
                if l.armed_us == Some(now_us) {
                    l.armed_us = None;
                }
                l.opportunity(now_us);
            }
        }
    }
    if !l.held.is_empty() {
        // Never expected (every ticket has a TTL): end them as a router shutting down would.
        l.notes.push(format!("{} requests still queued at the end: shut down", l.held.len()));
        l.router.shutdown_queue();
        let end = reqs.last().map_or(0, |r| r.arrival_ms * 1000);
        l.opportunity(end);
    }
    let flow = spec.flow_control.then(|| l.router.flow_stats().counters);
    Ok(RunRecords {
        spec: *spec,
        records: l.records,
        dispatches: l.dispatches,
        flow,
        wall_s: wall.elapsed().as_secs_f64(),
        notes: l.notes,
    })
}

/// Simulate the scenario's runs ([`RUNS`]) on one seeded schedule; `progress` gets each run
/// when it is done.
pub fn run_all(s: &SimScenario, progress: &mut dyn FnMut(&RunRecords)) -> Result<Vec<RunRecords>, SimError> {
    let all = schedule(&s.scenario);
    RUNS.iter()
        .map(|spec| {
            let r = run(s, &all, spec)?;
            progress(&r);
            Ok(r)
        })
        .collect()
}
