//! `kvroute-worker demo`: start a fleet of in-process workers on loopback, replay a seeded
//! multi-turn agent workload through several routing policies and compare them.
//!
//! Policies: `round-robin` and `least-loaded` (the simulator toolkit's baselines,
//! `kvroute_sim::policy`, on the demo's own in-flight counts), `kvroute-approx`
//! (kvroute's tokenizer-free index of what it sent where) and `kvroute-precise` (kvroute's index
//! fed by the workers' real ZMQ KV events). Both kvroute modes get every worker's real `/metrics`
//! page through `Router::update_metrics_from_prometheus`; all decisions are kvroute's own
//! (`Router::route_http`), the demo only carries the request to the chosen worker and calls
//! `Router::complete` when its stream ends.
//!
//! Each policy runs on a fresh fleet (empty caches) with the same arrival schedule. TTFT is
//! measured by the client, from the request's scheduled arrival to the first streamed token;
//! the prefix-hit rate is the workers' own `usage.prompt_tokens_details.cached_tokens`.
//!
//! The offered load is a fraction of the fleet's capacity, measured before the runs: see
//! `calibrate` for the cost model, and the printed explanation.
#![allow(clippy::print_stdout)]

mod calibrate;
mod chart;
mod fleet;
mod gate;
mod http;
mod noisy;
mod report;
mod runner;
mod workload;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;

pub use runner::PolicyKind;

use calibrate::{CalibrationShape, CostModel};
use fleet::{Fleet, FleetOptions};
use kvroute_sim::Span;
pub use kvroute_sim::WorkloadKind;
use report::PolicySummary;
use workload::WorkloadSpec;

/// Default number of workers.
pub const DEFAULT_WORKERS: u32 = 4;
/// Default offered load (fraction of the measured capacity).
pub const DEFAULT_LOAD: f64 = 0.8;
/// Default length of the arrival schedule per policy, seconds.
pub const DEFAULT_DURATION_S: f64 = 40.0;
/// Default KV block size, tokens.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// What `--load` is a fraction of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LoadBasis {
    /// The capacity with every prompt token computed (no prefix cache at all).
    Cold,
    /// The capacity of the fleet under round-robin routing with prefix caching: each worker
    /// reuses what it computed itself (infinite cache). `--load 0.8` keeps a round-robin fleet
    /// 80% busy.
    RoundRobin,
    /// The capacity with the oracle's hits (one infinite cache shared by all workers): the most
    /// any router can get out of the fleet.
    Oracle,
}

impl LoadBasis {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            LoadBasis::Cold => "cold",
            LoadBasis::RoundRobin => "round-robin",
            LoadBasis::Oracle => "oracle",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            LoadBasis::Cold => "every prompt token computed (no prefix cache)",
            LoadBasis::RoundRobin => "round-robin routing with each worker reusing its own prefix cache",
            LoadBasis::Oracle => "the oracle's hits (one infinite cache shared by all workers)",
        }
    }
}

/// Default chart path.
pub const DEFAULT_OUT: &str = "kvroute-demo.svg";
/// Default chart path of `--scenario noisy-neighbor`.
pub const DEFAULT_NOISY_OUT: &str = noisy::DEFAULT_OUT;

/// What the demo shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Routing policies compared on a multi-turn agent workload (the default).
    Routing,
    /// Flow control under a noisy neighbor: one tenant bursts 10x, the other stays
    /// interactive; flow control off and on (see --help).
    NoisyNeighbor,
}

/// Arguments of `kvroute-worker demo`.
#[derive(clap::Args, Debug, Clone)]
#[command(after_long_help = AFTER_HELP)]
pub struct DemoArgs {
    /// What to show: `routing` (compare routing policies) or `noisy-neighbor` (flow control
    /// under one tenant's 10x burst; see --help).
    #[arg(long, value_enum, default_value_t = Scenario::Routing)]
    pub scenario: Scenario,
    /// Workers to start on loopback (role both) [default: 4; noisy-neighbor: the machine's
    /// cores, 2 to 4; quick: 2].
    #[arg(long, value_name = "N")]
    pub workers: Option<u32>,
    /// Offered load as a fraction of the fleet's measured capacity (see --help).
    #[arg(long, default_value_t = DEFAULT_LOAD, value_name = "FRACTION")]
    pub load: f64,
    /// What --load is a fraction of: the fleet's capacity with no prefix cache (`cold`), under
    /// round-robin with per-worker prefix caches (`round-robin`), or with the oracle's hits.
    #[arg(long, value_enum, default_value_t = LoadBasis::RoundRobin)]
    pub load_basis: LoadBasis,
    /// Length of the arrival schedule of each policy (run), seconds [default: 40, quick: 2.5;
    /// noisy-neighbor: 60, quick: 3].
    #[arg(long, value_name = "SECONDS", conflicts_with = "requests")]
    pub duration_s: Option<f64>,
    /// Number of requests of each policy (instead of --duration-s).
    #[arg(long, value_name = "N")]
    pub requests: Option<u32>,
    /// Workload seed: same seed, same requests at the same times for every policy.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Policies to compare, comma-separated: round-robin (rr), least-loaded (ll), approx,
    /// precise.
    #[arg(long, value_delimiter = ',', default_value = "round-robin,least-loaded,approx,precise", value_name = "LIST")]
    pub policies: Vec<PolicyKind>,
    /// Where to write the SVG chart [default: kvroute-demo.svg; noisy-neighbor:
    /// kvroute-noisy-neighbor.svg].
    #[arg(long, value_name = "PATH")]
    pub out: Option<PathBuf>,
    /// noisy-neighbor: the flow_control section of the flow-control runs, as JSON (`enabled` is
    /// set per run) [default: the concurrency detector at 4 per worker, the batch band's ceiling
    /// 0.25].
    #[arg(long, value_name = "JSON")]
    pub flow_control: Option<String>,
    /// Also write the results as JSON.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// KV block size of the workers and of kvroute's precise index, tokens.
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE, value_name = "TOKENS")]
    pub block_size: u32,
    /// KV pool of each worker, tokens (rounded down to whole blocks) [default: 16384; quick: 1024].
    #[arg(long, value_name = "TOKENS")]
    pub kv_tokens: Option<u32>,
    /// Workload: `agents` (tenants' shared system prompts and growing conversations) or
    /// `unique` (every request a prompt of its own, as long as a system prompt plus a first
    /// message: caching gives nothing, only load balancing counts).
    #[arg(long, value_enum, default_value_t = WorkloadKind::Agents)]
    pub workload: WorkloadKind,
    /// Tenants, each with its own long system prompt [default: 8; quick: 2].
    #[arg(long, value_name = "N")]
    pub tenants: Option<u32>,
    /// Concurrent agent conversations per tenant [default: 3; quick: 2].
    #[arg(long, value_name = "N")]
    pub agents: Option<u32>,
    /// noisy-neighbor: only these runs, comma-separated, by number (1 no burst / flow off, 2 no
    /// burst / flow on, 3 burst / flow off, 4 burst / flow on, 5 burst / flow on / equal
    /// priority) [default: all]; targets whose runs are missing are not judged.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub runs: Vec<usize>,
    /// Tiny everything (model, workload, run): for tests and CI, well under 20 s.
    #[arg(long)]
    pub quick: bool,
}

const AFTER_HELP: &str = "\
WHAT IT DOES
  1. Starts the workers in this process on 127.0.0.1 (ephemeral ports), each with its own HTTP
     server (OpenAI API + /metrics), ZMQ KV-event publisher and replay socket.
  2. Calibrates: every worker at once serves a few probe requests; the medians give a cost
     model (per-request overhead, prefill seconds per token shallow and deep in a context,
     decode seconds per token), measured with every worker competing for the machine's cores.
  3. Builds the workload: tenants with long shared system prompts; each tenant runs several
     agent conversations that grow turn by turn (previous reply + new user/tool message);
     requests arrive as one Poisson process at --load x capacity.
     capacity = workers / mean worker-seconds per request, where a request costs what is left
     to compute after the prompt tokens --load-basis finds cached: none (cold), those each
     worker computed itself under round-robin (round-robin, the default: --load 0.8 keeps a
     round-robin fleet 80% busy), or the oracle's (the best any router could do).
  4. For each policy: restarts the fleet (empty caches), replays the same schedule open-loop,
     streams every request and measures TTFT at the first token.
  5. Prints the table and writes the chart (--out).

ORACLE HIT RATE
  Prompt tokens in full blocks whose whole prefix an earlier request (in arrival order) had
  already sent: the hit rate of one infinite cache shared by all workers. No router can beat it
  (except by luck with partial blocks).

SCENARIO noisy-neighbor (--scenario noisy-neighbor)
  Flow control's evidence on the reference workers (the simulator toolkit's scenario,
  kvroute_sim::noisy): after the calibration, tenant-b sends steadily at 55% of the measured
  capacity (objective interactive, priority 10), tenant-a at 10% and 10x that during the
  middle third of the run (objective batch, priority -1, sheddable). Five runs on one seeded
  schedule, each on a fresh fleet and router (kvroute-approx): no burst (flow control off, and
  on), burst with flow control off, burst with flow control on, burst with flow control on and
  both tenants standard (priority 0, fairness). Every request goes through the core's admit /
  take_releases / cancel protocol in the demo's async runner (held requests wait on their
  ticket; releases are taken after every admission, completion and metrics scrape, and at
  next_flow_deadline). Prints B's TTFT p50/p90 during the burst and its ratio to the no-burst
  run, A's throughput and sheds, the dispatch shares while saturated, the issue's targets;
  writes kvroute-noisy-neighbor.svg (--out) and --json. Honoured: --workers, --duration-s,
  --seed, --kv-tokens, --block-size, --flow-control, --quick (seconds); the routing
  comparison's flags are ignored.

EXAMPLES
  kvroute-worker demo                               the full comparison (a few minutes)
  kvroute-worker demo --quick                       a tiny run (seconds)
  kvroute-worker demo --load 0.6 --policies rr,precise --out demo.svg
  kvroute-worker demo --workload unique --policies ll,approx,precise   no shared prefixes: balance only
  kvroute-worker demo --scenario noisy-neighbor     flow control under a 10x burst (a few minutes)";

/// The settings a run resolves to (defaults depend on `--quick`).
#[derive(Debug, Clone)]
struct Settings {
    workers: u32,
    load: f64,
    load_basis: LoadBasis,
    duration_s: f64,
    requests: Option<u32>,
    policies: Vec<PolicyKind>,
    block_size: u32,
    kv_blocks: u32,
    spec: WorkloadSpec,
    calibration: CalibrationShape,
    quick: bool,
    scrape_interval: Duration,
    progress_interval: Duration,
    drain_timeout: Duration,
}

impl Settings {
    fn resolve(a: &DemoArgs) -> anyhow::Result<Settings> {
        let q = a.quick;
        let workers = a.workers.unwrap_or(if q { 2 } else { DEFAULT_WORKERS });
        anyhow::ensure!((1..=64).contains(&workers), "--workers must be within 1..=64 (got {workers})");
        anyhow::ensure!(
            a.load.is_finite() && a.load > 0.0 && a.load <= 10.0,
            "--load must be a number in (0, 10] (got {})",
            a.load
        );
        anyhow::ensure!((1..=1024).contains(&a.block_size), "--block-size must be within 1..=1024");
        let duration_s = a.duration_s.unwrap_or(if q { 2.5 } else { DEFAULT_DURATION_S });
        anyhow::ensure!(
            duration_s.is_finite() && duration_s > 0.0 && duration_s <= 86_400.0,
            "--duration-s must be a number of seconds in (0, 86400] (got {duration_s})"
        );
        if let Some(n) = a.requests {
            anyhow::ensure!((1..=1_000_000).contains(&n), "--requests must be within 1..=1000000");
        }
        anyhow::ensure!(!a.policies.is_empty(), "--policies is empty");
        let kv_tokens = a.kv_tokens.unwrap_or(if q { 1024 } else { 16_384 });
        let kv_blocks = kv_tokens / a.block_size;
        anyhow::ensure!(kv_blocks >= 8, "--kv-tokens must hold at least 8 blocks of --block-size tokens");
        let tenants = a.tenants.unwrap_or(if q { 2 } else { 8 });
        let agents = a.agents.unwrap_or(if q { 2 } else { 3 });
        anyhow::ensure!((1..=1000).contains(&tenants), "--tenants must be within 1..=1000");
        anyhow::ensure!((1..=1000).contains(&agents), "--agents must be within 1..=1000");
        let spec = if q {
            WorkloadSpec {
                kind: a.workload,
                tenants,
                agents_per_tenant: agents,
                system_tokens: Span::new(128, 192),
                first_message_tokens: Span::new(16, 48),
                message_tokens: Span::new(8, 24),
                output_tokens: Span::new(2, 6),
                turns: Span::new(2, 5),
                max_prompt_tokens: (kv_blocks * a.block_size / 2).max(64),
                vocab_size: 0,
                seed: a.seed,
            }
        } else {
            WorkloadSpec {
                kind: a.workload,
                tenants,
                agents_per_tenant: agents,
                system_tokens: Span::new(1024, 2048),
                first_message_tokens: Span::new(128, 512),
                message_tokens: Span::new(32, 256),
                output_tokens: Span::new(16, 64),
                turns: Span::new(4, 12),
                max_prompt_tokens: (kv_blocks * a.block_size / 2).clamp(64, 6144),
                vocab_size: 0,
                seed: a.seed,
            }
        };
        let calibration = if q {
            CalibrationShape { short: 32, deep: 128, decode: 4, reps: 1 }
        } else {
            CalibrationShape { short: 256, deep: 2048, decode: 32, reps: 3 }
        };
        Ok(Settings {
            workers,
            load: a.load,
            load_basis: a.load_basis,
            duration_s,
            requests: a.requests,
            policies: a.policies.clone(),
            block_size: a.block_size,
            kv_blocks,
            spec,
            calibration,
            quick: q,
            scrape_interval: Duration::from_millis(100),
            progress_interval: Duration::from_secs(if q { 1 } else { 5 }),
            drain_timeout: Duration::from_secs_f64((1.5 * duration_s).clamp(20.0, 120.0)),
        })
    }
}

/// Run the demo: calibrate, run every policy, print the table, write the chart (and JSON).
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if args.scenario == Scenario::NoisyNeighbor {
        return noisy::run(&args);
    }
    let total = Instant::now();
    let mut s = Settings::resolve(&args)?;
    let fleet_opts = FleetOptions {
        workers: s.workers,
        block_size: s.block_size,
        kv_blocks: s.kv_blocks,
        max_model_len: s.spec.max_prompt_tokens as usize + s.spec.output_tokens.max as usize + 16,
        model: fleet::model(s.quick),
    };
    println!("kvroute demo: {} workers (role both) in this process on loopback", s.workers);
    println!("  {}", fleet::describe(&fleet_opts));
    println!("  {}", cpu_note(s.workers));

    // 1. Calibrate on a fresh fleet.
    let fleet = Fleet::start(&fleet_opts).context("starting the workers")?;
    let model = fleet.model_name().to_owned();
    s.spec.vocab_size = fleet.vocab_size();
    calibrate::wait_ready(fleet.addrs(), Duration::from_secs(30))?;
    let cost = calibrate::calibrate(fleet.addrs(), &model, s.spec.vocab_size, s.calibration, s.spec.seed);
    fleet.stop();
    let cost = cost.context("calibrating the fleet")?;

    // 2. The schedule.
    let (mut reqs, rate, capacity) = size_schedule(&s, &cost);
    workload::stamp_arrivals(&mut reqs, rate, s.spec.seed);
    let oracle = workload::oracle_cached(&reqs, s.block_size);
    let prompt_total: u64 = reqs.iter().map(|r| r.prompt.len() as u64).sum();
    let oracle_total: u64 = oracle.iter().map(|&c| u64::from(c)).sum();
    let oracle_rate = if prompt_total == 0 { 0.0 } else { oracle_total as f64 / prompt_total as f64 };
    let cost_oracle = cost.mean_cost(&reqs, &oracle);
    let cost_cold = cost.mean_cost(&reqs, &[]);
    let span = reqs.last().map_or(0.0, |r| r.at_s);
    print_plan(&s, &cost, &reqs, rate, capacity, oracle_rate, cost_oracle, cost_cold, span);
    let prepared = runner::prepare(&reqs, &model);

    // 3. Every policy on a fresh fleet.
    let mut rows = Vec::new();
    let mut notes: Vec<(String, Vec<String>)> = Vec::new();
    for kind in s.policies.clone() {
        println!("\n== {kind}: fresh fleet, {} requests over {span:.1} s", prepared.len());
        let fleet = Fleet::start(&fleet_opts).with_context(|| format!("starting the workers for {kind}"))?;
        calibrate::wait_ready(fleet.addrs(), Duration::from_secs(30))?;
        let policy = if kind.is_kvroute() {
            Some(runner::kvroute_policy(kind, s.block_size, u64::from(s.kv_blocks) * u64::from(s.block_size))?)
        } else {
            None
        };
        let result = runner::run_policy(&runner::RunSettings {
            kind,
            workers: fleet.addrs(),
            schedule: &prepared,
            policy,
            scrape_interval: s.scrape_interval,
            progress_interval: s.progress_interval,
            verbose: true,
            drain_timeout: s.drain_timeout,
            subscribed: &|| fleet.wait_subscribed(Duration::from_secs(5)),
        });
        fleet.stop();
        let result = result.with_context(|| format!("running {kind}"))?;
        let mut summary = PolicySummary::new(
            kind.name(),
            &result.outcomes,
            oracle_rate,
            s.workers as usize,
            result.span_s,
            result.wall_s,
        );
        let cached: Vec<u32> = result.outcomes.iter().map(|o| o.cached_tokens).collect();
        summary.est_busy = rate * cost.mean_cost(&reqs, &cached) / f64::from(s.workers);
        println!(
            "   {kind}: {}/{} done in {:.1} s, TTFT p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, prefix hit {:.1}%",
            summary.completed,
            summary.requests,
            result.wall_s,
            summary.ttft(0.5),
            summary.ttft(0.9),
            summary.ttft(0.99),
            summary.hit_rate * 100.0
        );
        if let Some(e) = &summary.first_error {
            println!("   first error: {e}");
        }
        for n in &result.notes {
            println!("   note: {n}");
        }
        notes.push((kind.name().to_owned(), result.notes));
        rows.push(summary);
    }

    // 4. Results.
    println!(
        "\n## Results ({} workers, load {:.2}, {} requests per policy, seed {})\n",
        s.workers,
        s.load,
        prepared.len(),
        s.spec.seed
    );
    print!("{}", report::table(&rows));
    let ratio = ttft_ratio(&rows);
    if let Some(r) = ratio {
        println!("\nTTFT p90 round-robin / kvroute-precise = {r:.1}x");
    }
    println!(
        "prefix hit = the workers' usage.prompt_tokens_details.cached_tokens / prompt_tokens; oracle hit = one \
         infinite cache shared by all workers (the best any router can do)."
    );
    let title = "kvroute demo: TTFT and prefix-cache hits by routing policy";
    let subtitle = format!(
        "{} workers, load {:.2} of measured capacity ({:.2} req/s), {} requests, seed {}{}",
        s.workers,
        s.load,
        rate,
        prepared.len(),
        s.spec.seed,
        ratio.map_or(String::new(), |r| format!("; TTFT p90 round-robin / kvroute-precise = {r:.1}x"))
    );
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_OUT));
    write_file(&out, chart::render(&rows, title, &subtitle).as_bytes())?;
    println!("chart: {}", out.display());
    if let Some(path) = &args.json {
        let json = results_json(&s, &cost, rate, capacity, oracle_rate, &rows, &notes, ratio);
        write_file(path, serde_json::to_string_pretty(&json).unwrap_or_default().as_bytes())?;
        println!("json: {}", path.display());
    }
    println!("total wall time {:.1} s", total.elapsed().as_secs_f64());
    Ok(())
}

/// Prompt tokens each request would find cached under `basis` (empty: none).
fn basis_cached(reqs: &[workload::DemoRequest], basis: LoadBasis, workers: u32, block_size: u32) -> Vec<u32> {
    match basis {
        LoadBasis::Cold => Vec::new(),
        LoadBasis::Oracle => workload::oracle_cached(reqs, block_size),
        LoadBasis::RoundRobin => {
            // Request i goes to worker i mod N (arrival order); each worker's own infinite cache.
            let w = workers.max(1) as usize;
            let mut out = vec![0u32; reqs.len()];
            for k in 0..w {
                let mine: Vec<workload::DemoRequest> = reqs.iter().skip(k).step_by(w).cloned().collect();
                for (j, c) in workload::oracle_cached(&mine, block_size).into_iter().enumerate() {
                    out[k + j * w] = c;
                }
            }
            out
        }
    }
}

/// Find the request count and rate: rate = load x capacity, capacity = workers / the mean cost
/// of the very requests that will be sent, with the prompt tokens `--load-basis` finds cached
/// not computed. A fixed point: the request count depends on the rate, the mean cost on the
/// request count.
fn size_schedule(s: &Settings, cost: &CostModel) -> (Vec<workload::DemoRequest>, f64, f64) {
    let mut n = s.requests.map_or(64, |r| r as usize);
    let mut reqs = workload::contents(&s.spec, n);
    let mut rate = 1.0;
    let mut capacity = 1.0;
    for _ in 0..8 {
        let cached = basis_cached(&reqs, s.load_basis, s.workers, s.block_size);
        let mean = cost.mean_cost(&reqs, &cached).max(1e-6);
        capacity = f64::from(s.workers) / mean;
        rate = s.load * capacity;
        let want =
            s.requests.map_or_else(|| ((rate * s.duration_s).round() as usize).clamp(1, 1_000_000), |r| r as usize);
        if want == n {
            break;
        }
        n = want;
        reqs = workload::contents(&s.spec, n);
    }
    (reqs, rate, capacity)
}

#[allow(clippy::too_many_arguments)]
fn print_plan(
    s: &Settings,
    cost: &CostModel,
    reqs: &[workload::DemoRequest],
    rate: f64,
    capacity: f64,
    oracle_rate: f64,
    cost_oracle: f64,
    cost_cold: f64,
    span: f64,
) {
    let n = reqs.len().max(1) as f64;
    let mean_prompt = reqs.iter().map(|r| r.prompt.len() as f64).sum::<f64>() / n;
    let max_prompt = reqs.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
    let mean_out = reqs.iter().map(|r| f64::from(r.max_tokens)).sum::<f64>() / n;
    println!(
        "calibration ({:.1} s; all {} workers probed at once, so the figures include their contention for the \
         cores; medians): overhead {:.1} ms/request, prefill {:.3} ms/token at depth {:.0} and {:.3} ms/token at \
         depth {:.0}, decode {:.2} ms/token",
        cost.took_s,
        s.workers,
        cost.overhead_s * 1e3,
        cost.prefill_shallow_s * 1e3,
        cost.depths.0,
        cost.prefill_deep_s * 1e3,
        cost.depths.1,
        cost.decode_s * 1e3
    );
    println!("workload: {}", s.spec.describe());
    println!(
        "  {} requests, prompts {:.0} tokens on average (max {}), {:.0} output tokens on average",
        reqs.len(),
        mean_prompt,
        max_prompt,
        mean_out,
    );
    let basis_cost = f64::from(s.workers) / capacity.max(1e-9);
    println!(
        "capacity (--load-basis {}): with {}, a request costs {:.1} ms of worker time on average (computing every \
         prompt token: {:.1} ms), so the {} workers serve {:.2} req/s",
        s.load_basis.name(),
        s.load_basis.describe(),
        basis_cost * 1e3,
        cost_cold * 1e3,
        s.workers,
        capacity
    );
    println!(
        "load: {:.2} x {:.2} = {:.2} req/s, Poisson, over {:.1} s. With the oracle's hits ({:.1}% of prompt tokens) \
         a request would cost {:.1} ms and the fleet would be {:.0}% busy; each policy's estimate (its own hits) is \
         the table's `est. busy`",
        s.load,
        capacity,
        rate,
        span,
        oracle_rate * 100.0,
        cost_oracle * 1e3,
        rate * cost_oracle / f64::from(s.workers) * 100.0
    );
}

/// Why the CPU figures mean something on a small machine.
fn cpu_note(workers: u32) -> String {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    format!(
        "CPU: each worker computes on ONE engine thread; the {workers} workers share this machine's {cores} core(s) with \
         the router and the load generator. Capacity is calibrated with every worker busy at once, so it is what \
         these cores deliver, and the load is a fraction of that: a worker's speed drops when more engines than cores \
         compute at once, as a GPU's would under interference."
    )
}

fn ttft_ratio(rows: &[PolicySummary]) -> Option<f64> {
    let rr = rows.iter().find(|r| r.name == PolicyKind::RoundRobin.name())?.ttft(0.9);
    let precise = rows.iter().find(|r| r.name == PolicyKind::KvroutePrecise.name())?.ttft(0.9);
    (rr.is_finite() && precise.is_finite() && precise > 0.0).then(|| rr / precise)
}

#[allow(clippy::too_many_arguments)]
fn results_json(
    s: &Settings,
    cost: &CostModel,
    rate: f64,
    capacity: f64,
    oracle_rate: f64,
    rows: &[PolicySummary],
    notes: &[(String, Vec<String>)],
    ratio: Option<f64>,
) -> serde_json::Value {
    let num = |v: f64| if v.is_finite() { serde_json::json!(v) } else { serde_json::Value::Null };
    serde_json::json!({
        "workers": s.workers,
        "load": s.load,
        "load_basis": s.load_basis.name(),
        "workload": s.spec.kind.name(),
        "block_size": s.block_size,
        "kv_blocks_per_worker": s.kv_blocks,
        "seed": s.spec.seed,
        "capacity_req_per_s": capacity,
        "rate_req_per_s": rate,
        "oracle_hit_rate": oracle_rate,
        "ttft_p90_ratio_round_robin_over_precise": ratio.map(num),
        "cost_model": {
            "overhead_ms": cost.overhead_s * 1e3,
            "prefill_ms_per_token_shallow": cost.prefill_shallow_s * 1e3,
            "prefill_ms_per_token_deep": cost.prefill_deep_s * 1e3,
            "depths": [cost.depths.0, cost.depths.1],
            "decode_ms_per_token": cost.decode_s * 1e3,
        },
        "policies": rows.iter().map(|r| serde_json::json!({
            "name": r.name,
            "requests": r.requests,
            "completed": r.completed,
            "failed": r.failed,
            "first_error": r.first_error,
            "ttft_p50_ms": num(r.ttft(0.5)),
            "ttft_p90_ms": num(r.ttft(0.9)),
            "ttft_p99_ms": num(r.ttft(0.99)),
            "hit_rate": r.hit_rate,
            "req_per_s": r.req_per_s,
            "tok_per_s": r.tok_per_s,
            "per_worker": r.per_worker,
            "wall_s": r.wall_s,
            "notes": notes.iter().find(|(n, _)| *n == r.name).map(|(_, v)| v.clone()).unwrap_or_default(),
        })).collect::<Vec<_>>(),
    })
}

fn write_file(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}
