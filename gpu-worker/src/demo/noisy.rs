//! `kvroute-worker demo --scenario noisy-neighbor`: flow control on real workers.
//!
//! The scenario is the simulator toolkit's (`kvroute_sim::noisy`): tenant B steady at 55% of
//! the fleet's measured capacity, tenant A at 10% bursting 10x during the middle third, five
//! runs on one seeded schedule (no burst with flow control off and on; burst with flow control
//! off; on, with A `batch` and B `interactive`; on, with equal priorities). Each run starts a fresh fleet and a fresh kvroute
//! router (approximate index, the workers' scraped metrics), and replays the schedule open-loop
//! on tokio: every request is admitted through the demo's [`Gate`] (the core's admit /
//! take_releases / cancel protocol), routed by `Router::route_http` when the gate lets it go,
//! streamed to its worker, completed with `Router::complete`. The demo decides nothing: with
//! flow control off the same calls are made and the core admits everything (and routing sheds
//! sheddable requests at saturation, as before).
//!
//! TTFT is measured by the client from the request's scheduled arrival (so it includes any time
//! held in the queue) to its first streamed token. The capacity is calibrated on the machine
//! first (`calibrate`), so the burst saturates the fleet whatever the machine's speed.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvroute::{unix_time_ms, EndpointSpec, Policy, Role, Router};
use kvroute_sim::noisy::{
    self, Arrival, End, RequestRecord, RunRecords, RunSpec, RunSummary, ScenarioConfig, Shape, RUNS, TENANTS,
};
use kvroute_sim::Span;
use tokio::sync::Notify;

use super::calibrate::{self, CalibrationShape, CostModel};
use super::fleet::{self, Fleet, FleetOptions};
use super::gate::{Gate, Gated};
use super::runner::{self, PolicyKind, Prepared, WorkerAddrs};
use super::workload::{DemoRequest, Rng};
use super::{http, write_file, DemoArgs};

/// A run whose fleet's throughput just before it differs from the calibration's by more than
/// this fraction is noted as not comparable.
const PROBE_TOLERANCE: f64 = 0.25;
/// Default chart path of the scenario.
pub const DEFAULT_OUT: &str = "kvroute-noisy-neighbor.svg";
/// Default length of the schedule, seconds.
pub const DEFAULT_DURATION_S: f64 = 60.0;
/// Length of the quick schedule, seconds.
pub const QUICK_DURATION_S: f64 = 3.0;

/// The flow-control section of the flow-control runs on the reference workers: the concurrency
/// detector (the router's own in-flight count per worker: a CPU worker admits up to 64 requests
/// at once, so its `waiting` gauge stays at 0 long past saturation and the utilization detector
/// would see nothing) saturated at 4 requests in flight per worker, and a ceiling of 0.25 on the
/// sheddable band (priority -1): batch requests dispatch only while the workers have fewer than
/// one request in flight on average, i.e. only into capacity that would otherwise idle (the
/// simulator's rule, in this detector's units: a simulated engine prefills one request at a time
/// and the next one waits, while a reference worker computes everything it holds in the same
/// steps, so a second request in flight already slows the first). Everything else at its default
/// (round-robin fairness, FCFS, 30 s TTL, shedding before queueing).
pub fn default_flow() -> serde_json::Value {
    serde_json::json!({
        "saturation_detector": {"kind": "concurrency", "max_requests_per_endpoint": 4},
        "priority_bands": [{"priority": -1, "saturation_ceiling": 0.25}],
    })
}

struct Settings {
    workers: u32,
    duration_s: f64,
    seed: u64,
    block_size: u32,
    kv_blocks: u32,
    shape: Shape,
    calibration: CalibrationShape,
    quick: bool,
    flow: serde_json::Value,
    out: PathBuf,
    json: Option<PathBuf>,
    runs: Vec<usize>,
    /// Closed-loop clients per worker of the throughput measurement.
    throughput_clients: usize,
    /// Its warm-up and measurement window.
    throughput_window: (Duration, Duration),
    /// The same, before each run.
    probe_window: (Duration, Duration),
    scrape_interval: Duration,
    progress_interval: Duration,
    drain_timeout: Duration,
}

fn settings(a: &DemoArgs) -> anyhow::Result<Settings> {
    let q = a.quick;
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get) as u32;
    let workers = a.workers.unwrap_or(if q { 2 } else { cores.clamp(2, 4) });
    anyhow::ensure!((1..=64).contains(&workers), "--workers must be within 1..=64 (got {workers})");
    let duration_s = a.duration_s.unwrap_or(if q { QUICK_DURATION_S } else { DEFAULT_DURATION_S });
    anyhow::ensure!(
        (1.0..=3600.0).contains(&duration_s),
        "--duration-s must be a number of seconds in [1, 3600] (got {duration_s})"
    );
    anyhow::ensure!(a.requests.is_none(), "--requests does not apply to --scenario noisy-neighbor (use --duration-s)");
    anyhow::ensure!((1..=1024).contains(&a.block_size), "--block-size must be within 1..=1024");
    anyhow::ensure!(
        a.runs.iter().all(|r| (1..=RUNS.len()).contains(r)),
        "--runs takes run numbers 1 to {}",
        RUNS.len()
    );
    let kv_tokens = a.kv_tokens.unwrap_or(if q { 2048 } else { 16_384 });
    let kv_blocks = kv_tokens / a.block_size;
    anyhow::ensure!(kv_blocks >= 8, "--kv-tokens must hold at least 8 blocks of --block-size tokens");
    let shape = if q {
        Shape { system_tokens: 64, user_tokens: Span::new(16, 48), output_tokens: Span::new(2, 4) }
    } else {
        Shape { system_tokens: 512, user_tokens: Span::new(256, 768), output_tokens: Span::new(8, 24) }
    };
    let calibration = if q {
        CalibrationShape { short: 32, deep: 64, decode: 4, reps: 1 }
    } else {
        // More repetitions than the routing comparison's: the median must not follow a moment of
        // the machine's other load, since every rate is a fraction of it.
        CalibrationShape { short: 256, deep: 1024, decode: 16, reps: 9 }
    };
    let flow = match &a.flow_control {
        Some(text) => {
            let v: serde_json::Value = serde_json::from_str(text).context("--flow-control: not JSON")?;
            anyhow::ensure!(v.is_object(), "--flow-control must be a JSON object (the flow_control section)");
            v
        }
        None => default_flow(),
    };
    Ok(Settings {
        workers,
        duration_s,
        seed: a.seed,
        block_size: a.block_size,
        kv_blocks,
        shape,
        calibration,
        quick: q,
        flow,
        out: a.out.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_OUT)),
        json: a.json.clone(),
        runs: a.runs.clone(),
        throughput_clients: 2,
        throughput_window: if q {
            (Duration::from_millis(300), Duration::from_secs(1))
        } else {
            (Duration::from_secs(1), Duration::from_secs(8))
        },
        probe_window: if q {
            (Duration::from_millis(200), Duration::from_millis(500))
        } else {
            (Duration::from_secs(1), Duration::from_secs(4))
        },
        scrape_interval: Duration::from_millis(100),
        progress_interval: Duration::from_secs(if q { 1 } else { 5 }),
        // Past the last arrival: the queue's TTL (30 s) bounds how long flow control holds a
        // request, the backlog without it drains at the fleet's spare capacity.
        drain_timeout: Duration::from_secs(if q { 20 } else { 90 }),
    })
}

/// The fleet's capacity for the scenario's mean request, requests per second: the tenant's
/// system prompt cached (in whole blocks), the message and the output computed.
fn capacity(s: &Settings, cost: &CostModel) -> f64 {
    let sys = s.shape.system_tokens;
    let prompt = sys + s.shape.mean_user_tokens().round() as u32;
    let cached = (sys / s.block_size) * s.block_size;
    let output = s.shape.mean_output_tokens().round() as u32;
    let per_request = cost.request_cost(prompt, cached.min(prompt.saturating_sub(1)), output);
    f64::from(s.workers) / per_request.max(1e-6)
}

/// Every request's body, by id: the tenant's system prompt (its own seeded token ids) then the
/// request's own message (seeded by its id, so it is the same in every run).
fn prepare(all: &[Arrival], shape: &Shape, vocab: u32, seed: u64, model: &str) -> Vec<Prepared> {
    let hi = vocab.max(20) - 1;
    let systems: Vec<Vec<u32>> = (0..TENANTS.len())
        .map(|t| {
            let mut rng = Rng::new(seed, 100 + t as u64);
            (0..shape.system_tokens).map(|_| rng.range(16, hi)).collect()
        })
        .collect();
    let reqs: Vec<DemoRequest> = all
        .iter()
        .map(|a| {
            let mut rng = Rng::new(seed, 1_000_000 + a.id as u64);
            let mut prompt = systems[a.tenant].clone();
            prompt.extend((0..a.user_tokens).map(|_| rng.range(16, hi)));
            DemoRequest {
                index: a.id,
                at_s: a.t_s,
                session: Arc::from(format!("nn-{}", a.id)),
                prompt: Arc::from(prompt),
                max_tokens: a.output_tokens,
            }
        })
        .collect();
    let mut prepared = runner::prepare(&reqs, model);
    for p in &mut prepared {
        p.request_id = Arc::from(format!("nn-{}", p.req.index));
    }
    prepared
}

/// The routing sections of every run's policy (flow control on or off): kvroute-approx as in the
/// routing comparison, with the router's notion of a full worker (`scoring.inflight_reference`,
/// the in-flight count that weighs as much as a full prefix hit) set to the flow-control
/// detector's per-worker limit when it has one. With the default (16) and a limit of 4, the
/// scorer keeps a tenant on the worker holding its system prompt (half of each prompt) until 16
/// are in flight there, while the detector (a pool mean) already calls the pool saturated at 8 in
/// all: every in-flight request sits on one worker, the other idles, and the fleet serves half its
/// capacity (measured: 8/0 in flight for most of a run, tenant-b's TTFT p90 in seconds without
/// any burst).
fn routing_policy(s: &Settings, pool_tokens: u64) -> serde_json::Value {
    let mut base = runner::kvroute_policy_json(PolicyKind::KvrouteApprox, s.block_size, pool_tokens);
    let d = &s.flow["saturation_detector"];
    let limit = (d["kind"] == "concurrency").then(|| d["max_requests_per_endpoint"].as_f64()).flatten();
    if let (Some(limit), Some(doc)) = (limit, base.as_object_mut()) {
        doc.insert("scoring".into(), serde_json::json!({ "inflight_reference": limit }));
    }
    base
}

/// Requests for the throughput measurement: the scenario's shape, both tenants in turn, ids
/// past any schedule's (messages of their own).
fn throughput_sample(s: &Settings) -> Vec<Arrival> {
    let mut rng = Rng::new(s.seed, 7);
    let n = if s.quick { 600 } else { 400 };
    (0..n)
        .map(|i| Arrival {
            id: (1 << 40) + i,
            t_s: 0.0,
            tenant: i % TENANTS.len(),
            burst: false,
            user_tokens: rng.range(s.shape.user_tokens.min, s.shape.user_tokens.max),
            output_tokens: rng.range(s.shape.output_tokens.min, s.shape.output_tokens.max),
        })
        .collect()
}

/// What [`measure_throughput`] found.
struct Throughput {
    req_per_s: f64,
    completed: usize,
}

/// The fleet's throughput on `sample`: `clients` closed-loop clients per worker (each sends its
/// next request when the previous one ends, straight to its worker), completions counted in the
/// window after the warm-up.
fn measure_throughput(
    workers: &[WorkerAddrs],
    sample: &[Prepared],
    clients: usize,
    (warmup, window): (Duration, Duration),
) -> anyhow::Result<Throughput> {
    anyhow::ensure!(!sample.is_empty() && clients > 0, "nothing to measure with");
    let t0 = Instant::now();
    let (from, to) = (t0 + warmup, t0 + warmup + window);
    let completed = AtomicUsize::new(0);
    let next = AtomicUsize::new(0);
    let first_error = Mutex::new(None::<String>);
    std::thread::scope(|scope| {
        for w in workers {
            for _ in 0..clients {
                scope.spawn(|| {
                    while Instant::now() < to {
                        let p = &sample[next.fetch_add(1, Ordering::Relaxed) % sample.len()];
                        let o = runner::send(w.http, p, Instant::now());
                        if let Some(e) = o.error {
                            first_error.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(e);
                            return;
                        }
                        let end = Instant::now();
                        if end >= from && end < to {
                            completed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(PoisonError::into_inner) {
        anyhow::bail!("a throughput probe failed: {e}");
    }
    let completed = completed.into_inner();
    anyhow::ensure!(completed > 0, "no request completed in {:.1} s", window.as_secs_f64());
    Ok(Throughput { req_per_s: completed as f64 / window.as_secs_f64(), completed })
}

/// One run's shared state.
struct Run {
    spec: RunSpec,
    arrivals: Vec<Arrival>,
    prepared: Arc<Vec<Prepared>>,
    router: Arc<Router>,
    gate: Arc<Gate>,
    ids: Vec<String>,
    workers: Vec<WorkerAddrs>,
    records: Mutex<Vec<RequestRecord>>,
    start: Instant,
    ended: AtomicUsize,
    inflight: AtomicUsize,
    /// Requests sent to each worker.
    per_worker: Vec<AtomicUsize>,
    /// In flight at each worker now.
    inflight_per_worker: Vec<AtomicUsize>,
}

impl Run {
    fn finish(&self, k: usize, queued_ms: Option<f64>, end: End) {
        let mut r = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(rec) = r.get_mut(k) {
            if queued_ms.is_some() {
                rec.queued_ms = queued_ms;
            }
            rec.finish(end);
        }
        self.ended.fetch_add(1, Ordering::AcqRel);
    }

    /// B's TTFT p90 so far, ms.
    fn b_p90(&self) -> f64 {
        let r = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        let mut v: Vec<f64> = r
            .iter()
            .filter(|x| x.arrival.tenant == noisy::B)
            .filter_map(|x| match x.end {
                End::Completed { ttft_ms, .. } => Some(ttft_ms),
                _ => None,
            })
            .collect();
        v.sort_by(f64::total_cmp);
        super::report::percentile(&v, 0.9)
    }
}

/// One request: wait for its arrival, pass the gate, route, stream, complete.
async fn request(run: Arc<Run>, k: usize) {
    let a = run.arrivals[k];
    let p = &run.prepared[a.id];
    let due = run.start + Duration::from_secs_f64(a.t_s.max(0.0));
    tokio::time::sleep_until(due.into()).await;
    let (fairness, objective) = (TENANTS[a.tenant], run.spec.priorities.objective(a.tenant));
    let headers = [
        ("x-request-id", &*p.request_id),
        ("x-llm-d-inference-fairness-id", fairness),
        ("x-llm-d-inference-objective", objective),
    ];
    // Only for the report (who was held while someone was refused).
    let priority = run.spec.priorities.priority(a.tenant);
    let waited = match run.gate.admit(&p.body, &headers, a.tenant, priority).await {
        Ok(Gated::Go { waited_ms }) => waited_ms,
        Ok(Gated::Refused { rejection, waited_ms, sheddable_queued }) => {
            let end = End::Rejected {
                status: rejection.status,
                reason: rejection.reason.as_str().to_owned(),
                queued: waited_ms.is_some(),
                sheddable_queued,
            };
            run.finish(k, waited_ms, end);
            return;
        }
        Ok(Gated::Lost) => {
            run.finish(k, None, End::Failed { error: "the gate ended without releasing it".into() });
            return;
        }
        Err(e) => {
            run.finish(k, None, End::Failed { error: format!("admit: {e}") });
            return;
        }
    };
    let d = match run.router.route_http(&p.body, headers, unix_time_ms()) {
        Ok(d) => d,
        Err(e) => {
            run.finish(k, waited, End::Failed { error: format!("route: {e}") });
            return;
        }
    };
    let Some(w) = d.endpoint().and_then(|e| run.ids.iter().position(|id| id == e)) else {
        let _ = run.router.complete(&d.request_id);
        let end = match d.shed() {
            Some(shed) => End::Rejected {
                status: shed.status,
                reason: "shed-by-routing".into(),
                queued: waited.is_some(),
                sheddable_queued: 0,
            },
            None => End::Failed { error: "routed to no known worker".into() },
        };
        run.finish(k, waited, end);
        return;
    };
    run.gate.dispatched(a.tenant, waited.is_some());
    run.inflight.fetch_add(1, Ordering::Relaxed);
    run.per_worker[w].fetch_add(1, Ordering::Relaxed);
    run.inflight_per_worker[w].fetch_add(1, Ordering::Relaxed);
    let (addr, prepared, id) = (run.workers[w].http, run.prepared.clone(), a.id);
    let sent = tokio::task::spawn_blocking(move || runner::send(addr, &prepared[id], due)).await;
    run.inflight.fetch_sub(1, Ordering::Relaxed);
    run.inflight_per_worker[w].fetch_sub(1, Ordering::Relaxed);
    let _ = run.router.complete(&d.request_id);
    // A completion: a dispatch opportunity.
    run.gate.wake();
    let end = match sent {
        Ok(o) => match (o.error, o.ttft_ms, o.e2e_ms) {
            (None, Some(ttft_ms), Some(e2e_ms)) => End::Completed { ttft_ms, e2e_ms },
            (Some(e), _, _) => End::Failed { error: e },
            _ => End::Failed { error: "no token".into() },
        },
        Err(e) => End::Failed { error: format!("sender: {e}") },
    };
    run.finish(k, waited, end);
}

fn counts(v: &[AtomicUsize]) -> String {
    v.iter().map(|c| c.load(Ordering::Relaxed).to_string()).collect::<Vec<_>>().join("/")
}

/// Scrape every worker's metrics into the router (each scrape is a dispatch opportunity) and
/// print progress, until `stop`.
fn scraper(
    run: Arc<Run>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    s_interval: Duration,
    progress: Duration,
    verbose: bool,
) {
    let mut next_progress = run.start + progress;
    let mut errors = 0u64;
    while !stop.load(Ordering::Acquire) {
        let tick = Instant::now();
        for (w, id) in run.workers.iter().zip(&run.ids) {
            match http::get(w.http, "/metrics", Duration::from_secs(2)) {
                Ok(page) => {
                    let text = String::from_utf8_lossy(&page);
                    if run.router.update_metrics_from_prometheus(id, &text, unix_time_ms()).is_err() {
                        errors += 1;
                    }
                }
                Err(_) => errors += 1,
            }
        }
        run.gate.wake();
        if verbose && Instant::now() >= next_progress {
            next_progress += progress;
            let q = run.gate.queued();
            #[allow(clippy::print_stdout)]
            {
                println!(
                    "  [{:>26}] {:>5.1}s  ended {:>4}/{}  queued A {:>3} B {:>3}  in flight {:>3} ({})  B TTFT p90 so far \
                     {:>7.1} ms",
                    run.spec.name,
                    run.start.elapsed().as_secs_f64(),
                    run.ended.load(Ordering::Acquire),
                    run.arrivals.len(),
                    q[noisy::A],
                    q[noisy::B],
                    run.inflight.load(Ordering::Relaxed),
                    counts(&run.inflight_per_worker),
                    run.b_p90(),
                );
            }
        }
        let spent = tick.elapsed();
        if spent < s_interval {
            std::thread::sleep(s_interval - spent);
        }
    }
    if errors > 0 {
        #[allow(clippy::print_stdout)]
        {
            println!("   note: {errors} metric scrapes failed");
        }
    }
}

/// Run one of the scenario's runs on a fresh fleet.
///
/// Before the schedule, the fresh fleet's throughput is measured again (`sample`, a shorter
/// window): the machine's speed can change between runs (other processes on a shared machine),
/// and a run whose fleet was much slower or faster than at the calibration is not comparable
/// with the others (noted). Returns the records and that throughput.
#[allow(clippy::too_many_arguments)]
fn run_one(
    s: &Settings,
    spec: &RunSpec,
    all: &[Arrival],
    prepared: &Arc<Vec<Prepared>>,
    fleet_opts: &FleetOptions,
    sample: &[Prepared],
    capacity: f64,
) -> anyhow::Result<(RunRecords, f64)> {
    let wall = Instant::now();
    let fleet = Fleet::start(fleet_opts).with_context(|| format!("starting the workers for {}", spec.name))?;
    calibrate::wait_ready(fleet.addrs(), Duration::from_secs(30))?;
    let probe = match measure_throughput(fleet.addrs(), sample, s.throughput_clients, s.probe_window) {
        Ok(t) => t.req_per_s,
        Err(e) => {
            fleet.stop();
            return Err(e.context("measuring the fleet's throughput before the run"));
        }
    };
    let pool_tokens = u64::from(s.kv_blocks) * u64::from(s.block_size);
    let base = routing_policy(s, pool_tokens);
    let doc = noisy::policy_json(base, &s.flow, spec.flow_control);
    let policy = Policy::from_json(&doc.to_string()).context("building the scenario's kvroute policy")?;
    let router = Arc::new(Router::new(policy));
    let ids: Vec<String> = fleet.addrs().iter().map(|w| w.http.to_string()).collect();
    for id in &ids {
        router.upsert_endpoint(EndpointSpec::new(id.clone(), Role::Both)).context("registering a worker")?;
    }
    let arrivals = noisy::arrivals_of(all, spec);
    let start = Instant::now() + Duration::from_millis(300);
    let records = arrivals.iter().map(|a| RequestRecord::new(*a, spec.priorities.priority(a.tenant))).collect();
    let run = Arc::new(Run {
        spec: *spec,
        arrivals,
        prepared: prepared.clone(),
        router: router.clone(),
        gate: Arc::new(Gate::new(router.clone(), start)),
        ids,
        workers: fleet.addrs().to_vec(),
        records: Mutex::new(records),
        start,
        ended: AtomicUsize::new(0),
        inflight: AtomicUsize::new(0),
        per_worker: (0..s.workers).map(|_| AtomicUsize::new(0)).collect(),
        inflight_per_worker: (0..s.workers).map(|_| AtomicUsize::new(0)).collect(),
    });
    let stop_scraper = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scrape = {
        let (run, stop) = (run.clone(), stop_scraper.clone());
        let (interval, progress, verbose) = (s.scrape_interval, s.progress_interval, true);
        std::thread::Builder::new()
            .name("noisy-scrape".into())
            .spawn(move || scraper(run, stop, interval, progress, verbose))
            .context("spawning the metrics scraper")?
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(2048)
        .enable_all()
        .build()
        .context("starting the run's runtime")?;
    let last_arrival = run.arrivals.last().map_or(0.0, |a| a.t_s);
    let deadline = start + Duration::from_secs_f64(last_arrival) + s.drain_timeout;
    let mut notes = Vec::new();
    let finished_all = rt.block_on(async {
        let stop = Arc::new(Notify::new());
        let dispatcher = tokio::spawn(run.gate.clone().dispatcher(stop.clone()));
        let mut tasks = tokio::task::JoinSet::new();
        for k in 0..run.arrivals.len() {
            tasks.spawn(request(run.clone(), k));
        }
        let all_done = tokio::time::timeout_at(deadline.into(), async { while tasks.join_next().await.is_some() {} })
            .await
            .is_ok();
        // End the queue: whatever is still held is answered (503 rejected-shutting-down).
        stop.notify_one();
        let _ = dispatcher.await;
        if !all_done {
            let _ = tokio::time::timeout(Duration::from_secs(2), async { while tasks.join_next().await.is_some() {} })
                .await;
            tasks.abort_all();
        }
        all_done
    });
    stop_scraper.store(true, Ordering::Release);
    let _ = scrape.join();
    // Streams still open (only after the drain timeout) are left to the workers' shutdown.
    rt.shutdown_timeout(Duration::from_secs(1));
    fleet.stop();
    if !finished_all {
        notes.push(format!("gave up waiting {:.0} s after the last arrival", s.drain_timeout.as_secs_f64()));
    }
    if (probe / capacity - 1.0).abs() > PROBE_TOLERANCE {
        notes.push(format!(
            "the fleet served {probe:.1} req/s just before this run, {:+.0}% from the calibration's {capacity:.1}: the \
             machine's speed changed, compare this run with care",
            (probe / capacity - 1.0) * 100.0
        ));
    }
    notes.push(format!("requests per worker {}", counts(&run.per_worker)));
    let (dispatches, unknown) = run.gate.take_dispatches();
    if unknown > 0 {
        notes.push(format!("{unknown} releases of tickets the gate did not hold"));
    }
    let records = std::mem::take(&mut *run.records.lock().unwrap_or_else(PoisonError::into_inner));
    let flow = spec.flow_control.then(|| router.flow_stats().counters);
    Ok((RunRecords { spec: *spec, records, dispatches, flow, wall_s: wall.elapsed().as_secs_f64(), notes }, probe))
}

#[allow(clippy::print_stdout)]
fn print_run(cfg: &ScenarioConfig, r: &RunRecords) {
    let s = RunSummary::new(cfg, r);
    let (a, b) = (s.tenant(noisy::A), s.tenant(noisy::B));
    println!(
        "   {}: {} requests ended in {:.1} s; B TTFT during the burst p50 {:.1} ms, p90 {:.1} ms ({}/{} done); A {} \
         done, {} shed, {} dropped",
        r.spec.name,
        r.records.len(),
        r.wall_s,
        b.burst_ttft_p50_ms,
        b.burst_ttft_p90_ms,
        b.completed,
        b.requests,
        a.completed,
        a.shed,
        a.dropped
    );
    if let Some(c) = &r.flow {
        println!(
            "   flow control: {} admitted at once, {} queued, {} dispatched from the queue, {} shed, {} refused or \
             dropped in all",
            c.admitted,
            c.enqueued,
            c.dispatched,
            c.shed,
            c.rejections.total()
        );
    }
    for n in &r.notes {
        println!("   note: {n}");
    }
    let failed = r.records.iter().find_map(|x| match &x.end {
        End::Failed { error } => Some(error.clone()),
        _ => None,
    });
    if let Some(e) = failed {
        println!("   first failure: {e}");
    }
}

/// Run the scenario: calibrate, the runs, the report, the chart (and JSON).
#[allow(clippy::print_stdout)]
pub fn run(args: &DemoArgs) -> anyhow::Result<()> {
    let total = Instant::now();
    let s = settings(args)?;
    let fleet_opts = FleetOptions {
        workers: s.workers,
        block_size: s.block_size,
        kv_blocks: s.kv_blocks,
        max_model_len: (s.shape.system_tokens + s.shape.user_tokens.max + s.shape.output_tokens.max) as usize + 16,
        model: fleet::model(s.quick),
    };
    println!("kvroute demo --scenario noisy-neighbor: {} workers (role both) in this process on loopback", s.workers);
    println!("  {}", fleet::describe(&fleet_opts));
    println!("  {}", super::cpu_note(s.workers));

    // 1. Calibrate on a fresh fleet.
    let fleet = Fleet::start(&fleet_opts).context("starting the workers")?;
    let model = fleet.model_name().to_owned();
    let vocab = fleet.vocab_size();
    calibrate::wait_ready(fleet.addrs(), Duration::from_secs(30))?;
    let cost = calibrate::calibrate(fleet.addrs(), &model, vocab, s.calibration, s.seed);
    let cost = match cost {
        Ok(c) => c,
        Err(e) => {
            fleet.stop();
            return Err(e.context("calibrating the fleet"));
        }
    };
    let sample = prepare(&throughput_sample(&s), &s.shape, vocab, s.seed, &model);
    let measured = measure_throughput(fleet.addrs(), &sample, s.throughput_clients, s.throughput_window);
    fleet.stop();
    let measured = measured.context("measuring the fleet's throughput")?;
    let modelled = capacity(&s, &cost);
    println!(
        "calibration ({:.1} s, all workers at once): overhead {:.1} ms/request, prefill {:.3} ms/token (depth {:.0}) to \
         {:.3} ms/token (depth {:.0}), decode {:.2} ms/token; a request of the scenario's mean size (system prompt \
         cached) costs {:.1} ms of worker time: {modelled:.2} req/s for the fleet",
        cost.took_s,
        cost.overhead_s * 1e3,
        cost.prefill_shallow_s * 1e3,
        cost.depths.0,
        cost.prefill_deep_s * 1e3,
        cost.depths.1,
        cost.decode_s * 1e3,
        f64::from(s.workers) / modelled * 1e3,
    );
    let capacity = measured.req_per_s;
    println!(
        "capacity: measured {capacity:.2} req/s ({} of the scenario's requests completed in {:.1} s with {} clients per \
         worker sending one after the other, after {:.1} s of warm-up); the rates below are fractions of it",
        measured.completed,
        s.throughput_window.1.as_secs_f64(),
        s.throughput_clients,
        s.throughput_window.0.as_secs_f64()
    );

    // 2. The schedule.
    let cfg = ScenarioConfig::at_capacity(capacity, s.duration_s, s.shape, s.seed);
    cfg.validate()?;
    let all = noisy::schedule(&cfg);
    println!("schedule: {}", cfg.describe());
    println!(
        "  {} requests with the burst ({} without); offered load {:.0}% of capacity without the burst, {:.0}% during it",
        all.len(),
        all.iter().filter(|a| !a.burst).count(),
        (noisy::A_LOAD + noisy::B_LOAD) * 100.0,
        (noisy::A_LOAD * noisy::BURST_FACTOR + noisy::B_LOAD) * 100.0
    );
    println!("flow control (flow-on runs): {}", s.flow);
    let routing = routing_policy(&s, u64::from(s.kv_blocks) * u64::from(s.block_size));
    println!(
        "routing (every run): kvroute-approx, {}",
        routing.get("scoring").map_or("default scoring".to_owned(), |v| format!("scoring {v}"))
    );
    let prepared = Arc::new(prepare(&all, &s.shape, vocab, s.seed, &model));

    // 3. The runs, each on a fresh fleet.
    let mut runs = Vec::new();
    let mut probes = Vec::new();
    for (i, spec) in RUNS.iter().enumerate() {
        if !s.runs.is_empty() && !s.runs.contains(&(i + 1)) {
            continue;
        }
        println!(
            "\n== {}: fresh fleet, {} requests, flow control {}, A {} / B {}",
            spec.name,
            noisy::arrivals_of(&all, spec).len(),
            if spec.flow_control { "on" } else { "off" },
            spec.priorities.objective(noisy::A),
            spec.priorities.objective(noisy::B)
        );
        let (r, probe) = run_one(&s, spec, &all, &prepared, &fleet_opts, &sample, capacity)
            .with_context(|| format!("running {}", spec.name))?;
        let quiet = cfg.a_rate_per_s + cfg.b_rate_per_s;
        let busy = cfg.a_rate_per_s * cfg.burst_factor + cfg.b_rate_per_s;
        println!(
            "   the fresh fleet served {probe:.2} req/s just before the run (calibration: {capacity:.2}): the schedule \
             offers {:.0}% of that without the burst, {:.0}% during it",
            100.0 * quiet / probe.max(1e-9),
            100.0 * busy / probe.max(1e-9)
        );
        print_run(&cfg, &r);
        runs.push(r);
        probes.push(probe);
    }

    // 4. Results.
    let summaries: Vec<RunSummary> = runs.iter().map(|r| RunSummary::new(&cfg, r)).collect();
    println!("\n## Results ({} workers, {capacity:.2} req/s capacity, seed {})\n", s.workers, s.seed);
    print!("{}", noisy::table(&summaries));
    println!(
        "B TTFT = tenant B's requests arriving during the burst (client-side, from the scheduled arrival: queue time \
         included; p90 all = the whole run); A req/s in burst = A's completions during the burst per second; shed = \
         refused at admission (flow control's shedding, or routing's with flow control off), dropped = dropped from \
         the queue (TTL)."
    );
    let speeds: Vec<String> = runs.iter().zip(&probes).map(|(r, p)| format!("{} {p:.1}", r.spec.name)).collect();
    println!(
        "fleet throughput measured just before each run, req/s (calibration {capacity:.1}): {}",
        speeds.join("; ")
    );
    let targets = noisy::targets(&summaries);
    println!();
    print!("{}", noisy::targets_text(&targets));
    let ratio_on = noisy::b_ratio(&summaries, &noisy::BURST_ON, &noisy::NO_BURST_ON);
    let ratio_on_off = noisy::b_ratio(&summaries, &noisy::BURST_ON, &noisy::NO_BURST_OFF);
    let ratio_off = noisy::b_ratio(&summaries, &noisy::BURST_OFF, &noisy::NO_BURST_OFF);
    if let (Some(on), Some(on_off), Some(off)) = (ratio_on, ratio_on_off, ratio_off) {
        println!(
            "\nB's TTFT p90 during the burst / without it: flow control off {off:.2}x; on {on:.2}x (vs the no-burst run \
             with flow control off: {on_off:.2}x)"
        );
    }
    let title = "kvroute demo: noisy neighbor on the reference workers, flow control off and on";
    let subtitle = format!(
        "{} workers, {capacity:.1} req/s measured capacity; B 55%, A 10% bursting 10x; seed {}{}",
        s.workers,
        s.seed,
        ratio_on.map_or(String::new(), |r| format!("; B p90 with flow control = {r:.2}x its no-burst value"))
    );
    write_file(&s.out, noisy::chart::render(&cfg, &summaries, title, &subtitle).as_bytes())?;
    println!("chart: {}", s.out.display());
    if let Some(path) = &s.json {
        let mut doc = noisy::results_json(&cfg, &summaries);
        doc["workers"] = serde_json::json!(s.workers);
        doc["capacity_req_per_s"] = serde_json::json!(capacity);
        doc["flow_control"] = s.flow.clone();
        doc["cost_model"] = serde_json::json!({
            "overhead_ms": cost.overhead_s * 1e3,
            "prefill_ms_per_token_shallow": cost.prefill_shallow_s * 1e3,
            "prefill_ms_per_token_deep": cost.prefill_deep_s * 1e3,
            "decode_ms_per_token": cost.decode_s * 1e3,
        });
        doc["ends"] = serde_json::json!(runs
            .iter()
            .zip(&probes)
            .map(|(r, probe)| serde_json::json!({
                "run": r.spec.name,
                "throughput_before_req_per_s": probe,
                "requests": r.records.len(),
                "ended_once": r.records.iter().filter(|x| x.ends == 1).count(),
                "unfinished": r.records.iter().filter(|x| matches!(x.end, End::Unfinished)).count(),
                "completed": r.records.iter().filter(|x| matches!(x.end, End::Completed { .. })).count(),
                "rejected_at_admission": r.records.iter().filter(|x| matches!(x.end, End::Rejected { queued: false, .. })).count(),
                "dropped_from_queue": r.records.iter().filter(|x| matches!(x.end, End::Rejected { queued: true, .. })).count(),
                "queued": r.records.iter().filter(|x| x.queued_ms.is_some()).count(),
                "failed": r.records.iter().filter(|x| matches!(x.end, End::Failed { .. })).count(),
                "cancelled": r.records.iter().filter(|x| matches!(x.end, End::Cancelled)).count(),
                "dispatches": r.dispatches.len(),
                "flow": r.flow,
                "notes": r.notes,
            }))
            .collect::<Vec<_>>());
        write_file(path, serde_json::to_string_pretty(&doc).unwrap_or_default().as_bytes())?;
        println!("json: {}", path.display());
    }
    println!("total wall time {:.1} s", total.elapsed().as_secs_f64());
    Ok(())
}
