//! One policy's run: replay the schedule open-loop against a fresh fleet, route every request
//! (a baseline of the simulator toolkit's, `kvroute_sim::policy`, or kvroute's `Router`), stream
//! it over HTTP, measure TTFT at the first streamed token and collect the worker-reported prefix
//! hits.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kvroute::{unix_clock, unix_time_ms, SubscriberConfig, Subscription};
use kvroute::{EndpointSpec, Policy, Role, Router};
use kvroute_sim::policy::{LeastLoaded, RoundRobin};

use super::http;
use super::report::{percentile, Outcome};
use super::workload::DemoRequest;

/// How long one request may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(180);

/// The routing policies the demo compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// Workers in turn.
    RoundRobin,
    /// Fewest requests in flight (the demo's own count: exact and immediate).
    LeastLoaded,
    /// kvroute, approximate prefix index (what it sent where) + scraped metrics.
    KvrouteApprox,
    /// kvroute, precise prefix index fed by the workers' ZMQ KV events + scraped metrics.
    KvroutePrecise,
}

impl PolicyKind {
    /// Every policy, in the default order.
    pub const ALL: [PolicyKind; 4] =
        [PolicyKind::RoundRobin, PolicyKind::LeastLoaded, PolicyKind::KvrouteApprox, PolicyKind::KvroutePrecise];

    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::KvrouteApprox => "kvroute-approx",
            PolicyKind::KvroutePrecise => "kvroute-precise",
        }
    }

    /// Whether kvroute's router makes the decisions.
    pub fn is_kvroute(self) -> bool {
        matches!(self, PolicyKind::KvrouteApprox | PolicyKind::KvroutePrecise)
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "round-robin" | "rr" | "roundrobin" => Ok(PolicyKind::RoundRobin),
            "least-loaded" | "ll" | "leastloaded" => Ok(PolicyKind::LeastLoaded),
            "approx" | "kvroute-approx" => Ok(PolicyKind::KvrouteApprox),
            "precise" | "kvroute-precise" => Ok(PolicyKind::KvroutePrecise),
            other => Err(format!(
                "unknown policy {other:?} (expected round-robin, least-loaded, approx or precise; aliases rr, ll, \
                 kvroute-approx, kvroute-precise)"
            )),
        }
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the runner needs to reach one worker.
#[derive(Debug, Clone)]
pub(crate) struct WorkerAddrs {
    /// HTTP (OpenAI + `/metrics`).
    pub(crate) http: SocketAddr,
    /// ZMQ PUB endpoint of its KV events (`tcp://127.0.0.1:port`).
    pub(crate) events: String,
    /// ZMQ ROUTER replay endpoint.
    pub(crate) replay: Option<String>,
}

/// A request ready to send: the schedule entry and its serialized body.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    pub(crate) req: DemoRequest,
    pub(crate) body: Arc<[u8]>,
    pub(crate) request_id: Arc<str>,
}

/// Build the `/v1/completions` body of every request once (shared by every policy).
pub(crate) fn prepare(reqs: &[DemoRequest], model: &str) -> Vec<Prepared> {
    reqs.iter()
        .map(|r| {
            let body = serde_json::json!({
                "model": model,
                "prompt": &*r.prompt,
                "max_tokens": r.max_tokens,
                "min_tokens": r.max_tokens,
                "ignore_eos": true,
                "temperature": 0.0,
                "stream": true,
                "stream_options": {"include_usage": true},
            });
            Prepared {
                req: r.clone(),
                body: Arc::from(body.to_string().into_bytes()),
                request_id: Arc::from(format!("demo-{}", r.index)),
            }
        })
        .collect()
}

/// The kvroute policy of a kvroute mode: defaults, except the index mode, the block sizes and
/// the approximate index's budget, sized to the workers' real KV pool (as an operator would).
pub(crate) fn kvroute_policy(kind: PolicyKind, block_size: u32, pool_tokens_per_worker: u64) -> anyhow::Result<Policy> {
    let json = kvroute_policy_json(kind, block_size, pool_tokens_per_worker);
    Policy::from_json(&json.to_string()).context("building the kvroute policy")
}

/// [`kvroute_policy`]'s document (other sections can be merged in before it is built).
pub(crate) fn kvroute_policy_json(kind: PolicyKind, block_size: u32, pool_tokens_per_worker: u64) -> serde_json::Value {
    let mode = if kind == PolicyKind::KvroutePrecise { "precise" } else { "approx" };
    // One membership per block of `block_tokens` tokens, charged 16 bytes each.
    let approx_block = 64u64;
    let approx_budget = (pool_tokens_per_worker / approx_block).max(64) * kvroute::NOMINAL_BYTES_PER_MEMBERSHIP;
    serde_json::json!({
        "index": {
            "mode": mode,
            "block_tokens": approx_block,
            "capacity_bytes_per_endpoint": approx_budget,
            "precise": {
                "keys": "dual",
                "engine_block_tokens": block_size,
                "index_block_tokens": block_size,
            },
        },
    })
}

/// Live progress of a run, shared with the progress printer.
struct Shared {
    outcomes: Mutex<Vec<Outcome>>,
    done: AtomicUsize,
    inflight: Vec<AtomicUsize>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Outcome>> {
        self.outcomes.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The result of one run.
pub(crate) struct RunResult {
    pub(crate) outcomes: Vec<Outcome>,
    /// First arrival to last completion, seconds.
    pub(crate) span_s: f64,
    /// Wall time of the run (including subscription setup and drain), seconds.
    pub(crate) wall_s: f64,
    /// Notes for the report (event stream counters, errors).
    pub(crate) notes: Vec<String>,
}

/// Settings of one run.
pub(crate) struct RunSettings<'a> {
    pub(crate) kind: PolicyKind,
    pub(crate) workers: &'a [WorkerAddrs],
    pub(crate) schedule: &'a [Prepared],
    pub(crate) policy: Option<Policy>,
    pub(crate) scrape_interval: Duration,
    pub(crate) progress_interval: Duration,
    /// Print progress lines.
    pub(crate) verbose: bool,
    /// How long to wait for stragglers after the last arrival; requests still without a token
    /// then count as unfinished (infinite TTFT).
    pub(crate) drain_timeout: Duration,
    /// Waits until every worker sees its KV-event subscriber (`false`: timed out).
    pub(crate) subscribed: &'a dyn Fn() -> bool,
}

/// Run one policy over the schedule.
pub(crate) fn run_policy(s: &RunSettings<'_>) -> anyhow::Result<RunResult> {
    let wall = Instant::now();
    let n = s.workers.len();
    let ids: Vec<String> = s.workers.iter().map(|w| w.http.to_string()).collect();
    let router = match (&s.policy, s.kind.is_kvroute()) {
        (Some(p), true) => {
            let r = Arc::new(Router::new(p.clone()));
            for id in &ids {
                r.upsert_endpoint(EndpointSpec::new(id.clone(), Role::Both)).context("registering a worker")?;
            }
            Some(r)
        }
        (None, true) => anyhow::bail!("policy {} needs a kvroute policy", s.kind),
        _ => None,
    };
    // The precise mode reads the workers' real KV events.
    let mut subs = Vec::new();
    if let (Some(r), PolicyKind::KvroutePrecise) = (&router, s.kind) {
        for (w, id) in s.workers.iter().zip(&ids) {
            let mut cfg = SubscriberConfig::new(w.events.clone());
            cfg.replay_endpoint = w.replay.clone();
            cfg.poll_interval_ms = 50;
            let sub = Subscription::start(r.clone(), id.clone(), cfg, unix_clock())
                .with_context(|| format!("subscribing to {}", w.events))?;
            subs.push(sub);
        }
        anyhow::ensure!((s.subscribed)(), "the workers did not see the KV-event subscriptions in time");
    }
    let shared = Arc::new(Shared {
        outcomes: Mutex::new(vec![Outcome::default(); s.schedule.len()]),
        done: AtomicUsize::new(0),
        inflight: (0..n).map(|_| AtomicUsize::new(0)).collect(),
    });
    // Scraper + progress printer.
    let stop = Arc::new(AtomicBool::new(false));
    let scraped_ok = Arc::new(AtomicUsize::new(0));
    let scrape_errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let start = Instant::now() + Duration::from_millis(300);
    let scraper = {
        let (stop, shared, router, scraped_ok, scrape_errors) =
            (stop.clone(), shared.clone(), router.clone(), scraped_ok.clone(), scrape_errors.clone());
        let workers: Vec<SocketAddr> = s.workers.iter().map(|w| w.http).collect();
        let ids = ids.clone();
        let (interval, progress, verbose, kind, total) =
            (s.scrape_interval, s.progress_interval, s.verbose, s.kind, s.schedule.len());
        std::thread::Builder::new()
            .name("demo-scrape".into())
            .spawn(move || {
                let mut next_progress = start + progress;
                while !stop.load(Ordering::Acquire) {
                    let tick = Instant::now();
                    let mut waiting = 0u64;
                    let mut running = 0u64;
                    let mut kv = 0.0f64;
                    for (addr, id) in workers.iter().zip(&ids) {
                        match http::get(*addr, "/metrics", Duration::from_secs(2)) {
                            Ok(page) => {
                                let text = String::from_utf8_lossy(&page);
                                let now = unix_time_ms();
                                let snap = match &router {
                                    Some(r) => r.update_metrics_from_prometheus(id, &text, now).map_err(|e| e.to_string()),
                                    None => kvroute::parse_prometheus(&text, now).map_err(|e| e.to_string()),
                                };
                                match snap {
                                    Ok(m) => {
                                        waiting += u64::from(m.waiting);
                                        running += u64::from(m.running);
                                        kv += m.kv_usage;
                                        scraped_ok.fetch_add(1, Ordering::Relaxed);
                                    }
                                    Err(e) => note_error(&scrape_errors, format!("{id} /metrics: {e}")),
                                }
                            }
                            Err(e) => note_error(&scrape_errors, format!("{id} /metrics: {e}")),
                        }
                    }
                    if verbose && Instant::now() >= next_progress {
                        next_progress += progress;
                        let done = shared.done.load(Ordering::Acquire);
                        let mut ttft: Vec<f64> = shared.lock().iter().filter_map(|o| o.ttft_ms).collect();
                        ttft.sort_by(f64::total_cmp);
                        let inflight: usize = shared.inflight.iter().map(|c| c.load(Ordering::Relaxed)).sum();
                        #[allow(clippy::print_stdout)]
                        {
                            println!(
                                "  [{kind:>15}] {:>5.1}s  done {done:>4}/{total}  in flight {inflight:>3}  \
                                 waiting {waiting:>3} running {running:>3}  kv {:>3.0}%  TTFT p50 {:>7.1} ms  p90 {:>7.1} ms",
                                start.elapsed().as_secs_f64(),
                                kv / workers.len().max(1) as f64 * 100.0,
                                percentile(&ttft, 0.5),
                                percentile(&ttft, 0.9),
                            );
                        }
                    }
                    let spent = tick.elapsed();
                    if spent < interval {
                        std::thread::sleep(interval - spent);
                    }
                }
            })
            .context("spawning the metrics scraper")?
    };
    // Let the subscriptions connect and the first metrics arrive.
    std::thread::sleep(start.saturating_duration_since(Instant::now()));

    let mut handles = Vec::with_capacity(s.schedule.len());
    let mut round_robin = RoundRobin::new();
    let mut least_loaded = LeastLoaded::new();
    let mut route_errors = 0usize;
    for p in s.schedule {
        let due = start + Duration::from_secs_f64(p.req.at_s.max(0.0));
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        let arrival = due;
        let (worker, request_id) = match (s.kind, &router) {
            (PolicyKind::RoundRobin, _) => (round_robin.pick(n), None),
            (PolicyKind::LeastLoaded, _) => {
                // Fewest in flight; ties go to the next worker after the last pick.
                (least_loaded.pick(n, |w| shared.inflight[w].load(Ordering::Relaxed)), None)
            }
            (_, Some(r)) => {
                let headers = [("x-request-id", &*p.request_id), ("x-session-id", &*p.req.session)];
                match r.route_http(&p.body, headers, unix_time_ms()) {
                    Ok(d) => {
                        let target = d.endpoint().and_then(|e| ids.iter().position(|id| id == e));
                        match target {
                            Some(w) => (w, Some(d.request_id)),
                            None => {
                                route_errors += 1;
                                let _ = r.complete(&d.request_id);
                                record(
                                    &shared,
                                    p.req.index,
                                    failed(None, format!("kvroute shed or unknown target: {:?}", d.shed())),
                                );
                                continue;
                            }
                        }
                    }
                    Err(e) => {
                        route_errors += 1;
                        record(&shared, p.req.index, failed(None, format!("kvroute route error: {e}")));
                        continue;
                    }
                }
            }
            (_, None) => anyhow::bail!("unreachable: kvroute policy without a router"),
        };
        shared.inflight[worker].fetch_add(1, Ordering::Relaxed);
        if let Some(o) = shared.lock().get_mut(p.req.index) {
            o.worker = Some(worker);
        }
        let (shared, router, addr, p) = (shared.clone(), router.clone(), s.workers[worker].http, p.clone());
        let h = std::thread::Builder::new()
            .name("demo-req".into())
            .stack_size(256 << 10)
            .spawn(move || {
                let mut o = send(addr, &p, arrival);
                o.worker = Some(worker);
                shared.inflight[worker].fetch_sub(1, Ordering::Relaxed);
                if let (Some(r), Some(id)) = (router, request_id) {
                    if let Err(e) = r.complete(&id) {
                        o.error.get_or_insert_with(|| format!("kvroute complete: {e}"));
                    }
                }
                record(&shared, p.req.index, o);
            })
            .context("spawning a request thread")?;
        handles.push(h);
    }
    // Drain.
    let deadline = Instant::now() + s.drain_timeout;
    while shared.done.load(Ordering::Acquire) < s.schedule.len() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let finished_all = shared.done.load(Ordering::Acquire) >= s.schedule.len();
    if finished_all {
        for h in handles {
            let _ = h.join();
        }
    }
    stop.store(true, Ordering::Release);
    let _ = scraper.join();
    let mut notes = Vec::new();
    if !finished_all {
        notes.push(format!("gave up waiting for {} requests", s.schedule.len() - shared.done.load(Ordering::Acquire)));
    }
    if route_errors > 0 {
        notes.push(format!("{route_errors} routing errors"));
    }
    let errs = scrape_errors.lock().unwrap_or_else(PoisonError::into_inner);
    if !errs.is_empty() {
        notes.push(format!("{} metric scrape errors, first: {}", errs.len(), errs[0]));
    }
    if scraped_ok.load(Ordering::Relaxed) == 0 {
        notes.push("no /metrics page could be read".into());
    }
    for sub in subs {
        let id = sub.endpoint_id().to_owned();
        match sub.stop() {
            Ok(st) => {
                if st.applied == 0 || st.resyncs > 0 || st.decode_errors > 0 || st.router_errors > 0 {
                    notes.push(format!(
                        "KV events from {id}: {} batches applied, {} resyncs, {} decode errors, {} router errors",
                        st.applied, st.resyncs, st.decode_errors, st.router_errors
                    ));
                }
            }
            Err(e) => notes.push(format!("KV events from {id}: {e}")),
        }
    }
    if let Some(r) = &router {
        let st = r.stats();
        if s.kind == PolicyKind::KvroutePrecise {
            notes.push(format!(
                "precise index: {} blocks stored by events, {} removed, {} orphan blocks",
                st.precise.blocks_stored, st.precise.blocks_removed, st.precise.orphan_blocks
            ));
        }
    }
    let mut outcomes = std::mem::take(&mut *shared.lock());
    for o in outcomes.iter_mut().filter(|o| o.e2e_ms.is_none() && o.error.is_none()) {
        o.error = Some(format!("unfinished {:.0} s after the last arrival", s.drain_timeout.as_secs_f64()));
    }
    let first = s.schedule.first().map_or(0.0, |p| p.req.at_s);
    let last = s
        .schedule
        .iter()
        .zip(&outcomes)
        .filter_map(|(p, o)| o.e2e_ms.map(|e| p.req.at_s + e / 1000.0))
        .fold(first, f64::max);
    Ok(RunResult { outcomes, span_s: last - first, wall_s: wall.elapsed().as_secs_f64(), notes })
}

fn note_error(errors: &Mutex<Vec<String>>, e: String) {
    let mut v = errors.lock().unwrap_or_else(PoisonError::into_inner);
    if v.len() < 100 {
        v.push(e);
    }
}

fn failed(worker: Option<usize>, error: String) -> Outcome {
    Outcome { worker, error: Some(error), ..Default::default() }
}

fn record(shared: &Shared, index: usize, o: Outcome) {
    if let Some(slot) = shared.lock().get_mut(index) {
        let worker = slot.worker;
        *slot = o;
        slot.worker = slot.worker.or(worker);
    }
    shared.done.fetch_add(1, Ordering::AcqRel);
}

/// Stream one request; TTFT is taken at the first event carrying a choice.
pub(crate) fn send(addr: SocketAddr, p: &Prepared, arrival: Instant) -> Outcome {
    let mut o = Outcome::default();
    let headers = [("x-request-id", &*p.request_id), ("x-session-id", &*p.req.session)];
    let mut stream_error: Option<String> = None;
    let res = http::post_sse(addr, "/v1/completions", &headers, &p.body, REQUEST_TIMEOUT, |data| {
        if data == b"[DONE]" {
            return false;
        }
        let v: serde_json::Value = match serde_json::from_slice(data) {
            Ok(v) => v,
            Err(e) => {
                stream_error = Some(format!("bad SSE payload: {e}"));
                return false;
            }
        };
        if let Some(err) = v.get("error") {
            stream_error = Some(format!("worker error: {err}"));
            return false;
        }
        if o.ttft_ms.is_none() && v.get("choices").and_then(|c| c.as_array()).is_some_and(|c| !c.is_empty()) {
            o.ttft_ms = Some(arrival.elapsed().as_secs_f64() * 1000.0);
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            let num = |x: Option<&serde_json::Value>| x.and_then(serde_json::Value::as_u64).unwrap_or(0) as u32;
            o.prompt_tokens = num(u.get("prompt_tokens"));
            o.output_tokens = num(u.get("completion_tokens"));
            o.cached_tokens = num(u.get("prompt_tokens_details").and_then(|d| d.get("cached_tokens")));
        }
        true
    });
    o.e2e_ms = Some(arrival.elapsed().as_secs_f64() * 1000.0);
    if let Err(e) = res {
        o.error = Some(e.to_string());
    } else if let Some(e) = stream_error {
        o.error = Some(e);
    } else if o.ttft_ms.is_none() {
        o.error = Some("the stream carried no token".into());
    } else if o.prompt_tokens == 0 {
        o.error = Some("the stream carried no usage (stream_options.include_usage)".into());
    }
    o
}
