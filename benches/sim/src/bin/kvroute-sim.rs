//! `kvroute-sim`: compare routing policies on the same workload over a simulated cluster.
//!
//! A thin CLI over the `kvroute_sim` library; see its docs for the model.
#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use kvroute::Policy;
use kvroute_sim::sim::{
    DEFAULT_BATCH_REFERENCE, DEFAULT_CACHE_TOKENS, DEFAULT_ENDPOINTS, DEFAULT_METRICS_INTERVAL_MS,
    DEFAULT_PREFILL_OVERHEAD_MS, DEFAULT_PREFILL_TOKENS_PER_S, DEFAULT_TPOT_MS,
};
use kvroute_sim::workload::{
    DEFAULT_OUTPUT_TOKENS, DEFAULT_RATE, DEFAULT_SESSIONS, DEFAULT_SYSTEM_TOKENS, DEFAULT_TENANTS, DEFAULT_THINK_MS,
    DEFAULT_TURNS, DEFAULT_USER_TOKENS,
};
use kvroute_sim::{
    compare, load_trace, noisy, prepare, replicas, report, save_trace, svg, synthetic, ClusterConfig, PolicyKind,
    PolicyReport, SimError, Span, SyntheticConfig, WorkloadKind,
};

/// Sessions in a `--quick` run.
const QUICK_SESSIONS: u32 = 80;

const AFTER_HELP: &str = "\
WORKLOAD
  Without --trace, a seeded synthetic multi-turn agent workload: each tenant has a shared system
  prompt and its own cache_salt; sessions arrive as a Poisson process (--rate); every turn appends
  the previous assistant reply and a new user message, so conversations grow; turns are spaced by a
  nominal response time plus an exponential think time. Requests are OpenAI chat bodies with
  max_tokens = the output length and headers x-session-id and x-request-id.
  --workload unique: every request is instead a one-turn session with a prompt of its own (its own
  system prompt and cache_salt), so no policy can hit a cache and only load balancing counts;
  --rate is then requests per second, --tenants and --turns are ignored.

JSONL TRACE (--trace FILE, --write-trace FILE)
  One request per line (blank lines skipped, unknown fields rejected):
    {\"t_ms\": 1250, \"body\": {OpenAI chat or completions body}, \"headers\": {\"x-session-id\": \"s-7\"}, \"output_tokens\": 120}
  t_ms      arrival time in ms from the start (lines need not be sorted)
  body      the request body exactly as a client sends it (object)
  headers   optional object of string header values
  output_tokens  the true response length (drives decode time)
  A malformed line stops the run with an error naming the line number.

CLUSTER MODEL
  N endpoints (10.0.0.1:8000, ...), role both. Each has a true LRU prefix cache over 16-token
  blocks (--cache-tokens), a FIFO prefill queue served one at a time (overhead + uncached tokens /
  --prefill-tps) and continuous-batching decode (output tokens x --tpot-ms x (1 + batch/32)).
  TTFT = arrival to end of prefill. Metrics (waiting, running, kv_usage) are pushed to the kvroute
  router every --metrics-interval-ms of simulated time, so the router's view is realistically stale.

POLICIES
  round-robin   endpoints in turn
  least-loaded  fewest outstanding requests (true counts)
  kvroute       kvroute's Router::route_http, approximate mode (default policy, or --policy FILE)

SCENARIO noisy-neighbor (--scenario noisy-neighbor)
  Flow control's evidence: two tenants on one pool (4 endpoints by default), kvroute routing
  every request. tenant-b sends steadily at 55% of the pool's capacity; tenant-a at 10%, and
  10x that (100%) during the middle third of the run. Five runs on one seeded schedule: no
  burst (flow control off, and on), burst with flow control off, burst with flow control on (a
  batch = priority -1, sheddable; b interactive = 10), burst with flow control on and equal
  priorities (both standard = 0). Each request goes through the core's admit / take_releases protocol in
  virtual time (releases after arrivals, completions, metrics pushes and at next_flow_deadline).
  Prints B's TTFT, A's throughput and sheds, the dispatch shares while saturated, the issue's
  targets; writes kvroute-sim-noisy-neighbor.svg. --flow-control JSON replaces the flow-control
  section of the flow-control runs (default: the utilization detector at llm-d's thresholds and
  a saturation ceiling of 0.2 on the batch band).
  Honoured: --endpoints, --duration-s, --seed, --prefill-tps, --tpot-ms, --cache-tokens,
  --metrics-interval-ms, --svg, --no-svg, --json, --quick (20 s).

SCENARIO replicas (--scenario replicas)
  Router replicas over a bus, measured the way peers measure it: the synthetic agent workload
  (1000 sessions by default; --quick: 240 at 4/s) sprayed round-robin over N router replicas,
  each its own kvroute RouterCore with the same endpoints and policy, on the cluster model above.
  Hit rate = the engines' true cached / prompt tokens (the same metric for every run), relative
  to one router; also the routers' predicted hit, TTFT p50/p90 and what the bus carried per
  routed decision. Runs: each count of --replicas (default 1,2,4,8) without and with sync. Sync:
  every replica drains its outbox every --flush-ms (2) into batches, each delivered to every
  other replica --bus-latency-ms (1) later and applied; a replica silent for 1 s publishes a
  heartbeat. The stream retains every batch (600 s, 256 MiB). Then, at the largest count with
  sync (unless --no-faults): router-0 killed at 1/3 of the run (outbox lost, the spray skips it)
  and started again 5 s later with a larger epoch, bootstrapped by replaying the stream; the same
  without the replay; and a 5 s bus outage (nothing published or delivered: outboxes keep their
  entries, the stream holds what was in flight, all of it delivered when the bus is back).
  Recovery: 1-s windows from the restart (bus back); back when, for 5 windows in a row, the
  hit rate pooled over the trailing 3 windows is within 10% of the reference (the other
  replicas; for the outage, the same run without it). Prints a table, the fault details and the
  issue's targets; writes kvroute-sim-replicas.svg.
  Honoured: --replicas, --bus-latency-ms, --flush-ms, --no-faults, --sessions, --rate, --tenants,
  --turns, --seed, the token ranges, --think-ms, --policy, --endpoints, the cluster flags,
  --svg, --no-svg, --json, --quick.

EXAMPLES
  kvroute-sim                          default comparison, chart in ./kvroute-sim.svg
  kvroute-sim --quick                  small run
  kvroute-sim --rate 4 --cache-tokens 80000 --policy my-policy.yaml
  kvroute-sim --write-trace agent.jsonl && kvroute-sim --trace agent.jsonl
  kvroute-sim --workload unique --rate 10 --policies least-loaded,kvroute   nothing to cache
  kvroute-sim --scenario noisy-neighbor                                  flow control under a burst
  kvroute-sim --scenario replicas                                       replicas, sync off and on, faults
  kvroute-sim --scenario replicas --replicas 1,16 --bus-latency-ms 20 --no-faults
  kvroute-sim --scenario noisy-neighbor --flow-control '{\"saturation_detector\":{\"kind\":\"utilization\"}}'";

/// What to simulate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Scenario {
    /// Compare routing policies on one workload (the default).
    Routing,
    /// Flow control under one tenant's burst (see --help).
    NoisyNeighbor,
    /// Router replicas behind a round-robin spray, state shared over a simulated bus or not
    /// (see --help).
    Replicas,
}

/// Compare LLM request-routing policies (round-robin, least-loaded, kvroute) on the same workload
/// over a simulated cluster with true prefix caches; prints a table and writes an SVG chart.
#[derive(Debug, Parser)]
#[command(name = "kvroute-sim", version, after_long_help = AFTER_HELP)]
struct Args {
    /// What to simulate: `routing` (compare routing policies), `noisy-neighbor` (flow control
    /// under one tenant's burst) or `replicas` (router replicas with and without sync, faults);
    /// see --help.
    #[arg(long, value_enum, default_value_t = Scenario::Routing)]
    scenario: Scenario,
    /// noisy-neighbor: length of the schedule, seconds [default: 60; quick: 20].
    #[arg(long, value_name = "SECONDS")]
    duration_s: Option<f64>,
    /// noisy-neighbor: the flow_control section of the flow-control runs, as JSON (`enabled` is
    /// set per run).
    #[arg(long, value_name = "JSON")]
    flow_control: Option<String>,
    /// replicas: replica counts to run, comma-separated (1 is always run: the reference).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8", value_name = "LIST")]
    replicas: Vec<u32>,
    /// replicas: publish-to-delivery latency of the simulated bus, ms.
    #[arg(long, default_value_t = 1, value_name = "MS")]
    bus_latency_ms: u64,
    /// replicas: how often each replica drains its outbox, ms.
    #[arg(long, default_value_t = 2, value_name = "MS")]
    flush_ms: u64,
    /// replicas: skip the two fault runs (kill + restart, bus outage).
    #[arg(long)]
    no_faults: bool,
    /// Replay a JSONL trace instead of the synthetic workload (format: see --help).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Also write the workload (synthetic or trace) as a JSONL trace to FILE.
    #[arg(long, value_name = "FILE")]
    write_trace: Option<PathBuf>,
    /// Endpoints in the cluster [default: 8; noisy-neighbor: 4].
    #[arg(long, value_name = "N")]
    endpoints: Option<u32>,
    /// Synthetic workload: `agents` (tenants' multi-turn sessions) or `unique` (every request a
    /// prompt of its own: caching gives nothing, only load balancing counts).
    #[arg(long, default_value_t = WorkloadKind::Agents, value_name = "KIND", value_parser = parse_workload)]
    workload: WorkloadKind,
    /// Tenants (synthetic workload), each with its own system prompt and cache_salt.
    #[arg(long, default_value_t = DEFAULT_TENANTS, value_name = "N")]
    tenants: u32,
    /// Sessions (synthetic workload) [default: 1000, or 80 with --quick; replicas --quick: 240].
    #[arg(long, value_name = "N")]
    sessions: Option<u32>,
    /// Turns per session, `A-B` or `N` (synthetic workload).
    #[arg(long, default_value_t = DEFAULT_TURNS, value_name = "RANGE")]
    turns: Span,
    /// Session arrival rate, sessions per second (synthetic workload) [default: 2.5; replicas
    /// --quick: 4].
    #[arg(long, value_name = "PER_S")]
    rate: Option<f64>,
    /// Random seed (synthetic workload): same seed, same workload, same results.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// System prompt tokens per tenant, `A-B` (synthetic workload).
    #[arg(long, default_value_t = DEFAULT_SYSTEM_TOKENS, value_name = "RANGE")]
    system_tokens: Span,
    /// New user message tokens per turn, `A-B` (synthetic workload).
    #[arg(long, default_value_t = DEFAULT_USER_TOKENS, value_name = "RANGE")]
    user_tokens: Span,
    /// Output tokens per response, `A-B` (synthetic workload).
    #[arg(long, default_value_t = DEFAULT_OUTPUT_TOKENS, value_name = "RANGE")]
    output_tokens: Span,
    /// Mean think time between a response and the next turn, ms (synthetic workload).
    #[arg(long, default_value_t = DEFAULT_THINK_MS, value_name = "MS")]
    think_ms: f64,
    /// kvroute policy file (JSON or YAML); default: kvroute's default policy.
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,
    /// Policies to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "round-robin,least-loaded,kvroute", value_name = "LIST")]
    policies: Vec<PolicyKind>,
    /// Where to write the SVG chart [default: kvroute-sim.svg; noisy-neighbor:
    /// kvroute-sim-noisy-neighbor.svg; replicas: kvroute-sim-replicas.svg].
    #[arg(long, value_name = "PATH")]
    svg: Option<PathBuf>,
    /// Do not write the SVG chart.
    #[arg(long)]
    no_svg: bool,
    /// Also write the full results as JSON to PATH.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Metrics push interval to the router, ms of simulated time.
    #[arg(long, default_value_t = DEFAULT_METRICS_INTERVAL_MS, value_name = "MS")]
    metrics_interval_ms: u64,
    /// True prefix-cache capacity per endpoint, tokens.
    #[arg(long, default_value_t = DEFAULT_CACHE_TOKENS, value_name = "TOKENS")]
    cache_tokens: u64,
    /// KV memory per endpoint for running requests, tokens: the denominator of the kv_usage
    /// metric pushed to the router [default: --cache-tokens].
    #[arg(long, value_name = "TOKENS")]
    kv_tokens: Option<u64>,
    /// Prefill throughput per endpoint, tokens per second.
    #[arg(long, default_value_t = DEFAULT_PREFILL_TOKENS_PER_S, value_name = "TOK_S")]
    prefill_tps: f64,
    /// Time per output token of a lone request, ms.
    #[arg(long, default_value_t = DEFAULT_TPOT_MS, value_name = "MS")]
    tpot_ms: f64,
    /// Small run (80 sessions unless --sessions is given).
    #[arg(long)]
    quick: bool,
}

/// `WorkloadKind`'s own parser (case-insensitive, trimmed; its error names both kinds), not the
/// `clap::ValueEnum` one the `cli` feature also derives for other command lines.
fn parse_workload(s: &str) -> Result<WorkloadKind, String> {
    s.parse()
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = format!("kvroute-sim: error: {e}");
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                let cause = s.to_string();
                if !msg.contains(&cause) {
                    msg.push_str(&format!("\n  caused by: {cause}"));
                }
                source = s.source();
            }
            eprintln!("{msg}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), SimError> {
    match args.scenario {
        Scenario::NoisyNeighbor => return run_noisy(args),
        Scenario::Replicas => return run_replicas(args),
        Scenario::Routing => {}
    }
    let started = Instant::now();
    let policy = load_policy(args)?;
    let policy_name = args.policy.as_ref().map_or_else(|| "default".to_owned(), |p| p.display().to_string());
    let cluster = cluster_of(args, DEFAULT_ENDPOINTS);
    cluster.validate()?;

    let (workload, description) = match &args.trace {
        Some(path) => (load_trace(path)?, format!("trace {}", path.display())),
        None => {
            let cfg = SyntheticConfig {
                kind: args.workload,
                tenants: args.tenants,
                sessions: args.sessions.unwrap_or(if args.quick { QUICK_SESSIONS } else { DEFAULT_SESSIONS }),
                turns: args.turns,
                rate_per_s: args.rate.unwrap_or(DEFAULT_RATE),
                seed: args.seed,
                system_tokens: args.system_tokens,
                user_tokens: args.user_tokens,
                output_tokens: args.output_tokens,
                think_ms: args.think_ms,
                ..Default::default()
            };
            (synthetic(&cfg)?, cfg.describe())
        }
    };
    if let Some(path) = &args.write_trace {
        save_trace(path, &workload)?;
        eprintln!("kvroute-sim: wrote {} requests to {}", workload.len(), path.display());
    }
    let requests = prepare(workload, &policy.config().request)?;

    let n = requests.len();
    let prompt_tokens: u64 = requests.iter().map(|r| r.prompt_tokens).sum();
    let span_s = requests.last().map_or(0.0, |r| r.arrival_ms as f64 / 1000.0).max(1e-3);
    let capacity = f64::from(cluster.endpoints) * cluster.prefill_tokens_per_s;
    let session_header = &policy.config().request.session_header;
    let sessions: std::collections::HashSet<&str> = requests
        .iter()
        .filter_map(|r| r.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(session_header)))
        .map(|(_, v)| v.as_str())
        .collect();
    println!("kvroute-sim");
    println!("  {description}");
    println!("  {}", cluster.describe());
    println!(
        "  {n} requests over {span_s:.0} s{}; mean prompt {:.0} tokens; prefill demand with no cache hits {:.0}% of cluster capacity; kvroute policy: {policy_name}",
        if sessions.is_empty() { String::new() } else { format!(" in {} sessions", sessions.len()) },
        prompt_tokens as f64 / n as f64,
        100.0 * prompt_tokens as f64 / span_s / capacity,
    );
    println!();

    let mut progress = |p: &kvroute_sim::Progress<'_>| {
        eprintln!(
            "  [{:<12}] {:>3}%  {}/{} requests routed, sim time {:.1} s",
            p.policy,
            p.done * 100 / p.total.max(1),
            p.done,
            p.total,
            p.sim_ms / 1000.0
        );
    };
    let reports = compare(&requests, &cluster, &args.policies, &policy, &mut progress)?;

    print!("{}", report::table(&reports));
    for r in &reports {
        let extra = r.summary.as_ref().map_or_else(String::new, |s| format!("; {s}"));
        println!("  {}: prefill busy {:.0}% of cluster capacity{extra}", r.policy, r.prefill_utilization * 100.0);
        if r.unrouted > 0 {
            println!("  {}: {} requests not routed (shed)", r.policy, r.unrouted);
        }
    }
    if let Some(k) = reports.iter().find(|r| r.policy == PolicyKind::Kvroute.name()) {
        for other in reports.iter().filter(|r| r.policy != k.policy) {
            println!("  {}", versus(k, other));
        }
    }
    if !args.no_svg {
        let title = format!("kvroute-sim: {n} requests on {} endpoints", cluster.endpoints);
        let chart = svg::render(&reports, &title, &[&description, &cluster.describe()]);
        let path = args.svg.clone().unwrap_or_else(|| PathBuf::from("kvroute-sim.svg"));
        std::fs::write(&path, chart).map_err(|e| SimError::Io { path: path.display().to_string(), source: e })?;
        println!("chart: {}", path.display());
    }
    if let Some(path) = &args.json {
        let doc = serde_json::json!({ "workload": description, "cluster": cluster, "requests": n, "reports": reports });
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        std::fs::write(path, text).map_err(|e| SimError::Io { path: path.display().to_string(), source: e })?;
        println!("results: {}", path.display());
    }
    eprintln!("kvroute-sim: done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// `--scenario noisy-neighbor`.
fn run_noisy(args: &Args) -> Result<(), SimError> {
    let started = Instant::now();
    let cluster = cluster_of(args, noisy::sim::DEFAULT_ENDPOINTS);
    cluster.validate()?;
    let duration = args.duration_s.unwrap_or(if args.quick { 20.0 } else { noisy::sim::DEFAULT_DURATION_S });
    let mut s = noisy::sim::SimScenario::new(cluster, noisy::sim::DEFAULT_SHAPE, duration, args.seed);
    s.scenario.validate()?;
    if let Some(text) = &args.flow_control {
        let bad = || SimError::Setting {
            name: "flow-control",
            value: text.clone(),
            reason: "must be a JSON object (the flow_control section)",
        };
        s.flow = serde_json::from_str::<serde_json::Value>(text)
            .ok()
            .filter(serde_json::Value::is_object)
            .ok_or_else(bad)?;
        // Fail early on a section the policy rejects.
        Policy::from_json(&noisy::policy_json(s.base.clone(), &s.flow, true).to_string())?;
    }
    let capacity = noisy::sim::capacity(&s.cluster, &s.scenario.shape);
    println!("kvroute-sim --scenario noisy-neighbor");
    println!("  {}", s.cluster.describe());
    println!(
        "  capacity: {capacity:.1} req/s (each endpoint prefills one request at a time: overhead + the message, the \
         tenant's system prompt cached)"
    );
    println!("  schedule: {}", s.scenario.describe());
    println!("  flow control (flow-on runs): {}", s.flow);
    let mut progress = |r: &noisy::RunRecords| {
        eprintln!("  [{:<28}] {} requests, {:.2} s", r.spec.name, r.records.len(), r.wall_s);
    };
    let runs = noisy::sim::run_all(&s, &mut progress)?;
    let summaries: Vec<noisy::RunSummary> = runs.iter().map(|r| noisy::RunSummary::new(&s.scenario, r)).collect();
    println!();
    print!("{}", noisy::table(&summaries));
    println!(
        "B TTFT = tenant B's requests arriving during the burst (p90 all = over the whole run); A req/s in burst = A's \
         completions during the burst per second; shed = refused at admission, dropped = dropped from the queue."
    );
    println!();
    print!("{}", noisy::targets_text(&noisy::targets(&summaries)));
    for r in &summaries {
        for n in &r.notes {
            println!("  note ({}): {n}", r.spec.name);
        }
    }
    if !args.no_svg {
        let path = args.svg.clone().unwrap_or_else(|| PathBuf::from("kvroute-sim-noisy-neighbor.svg"));
        let title = "kvroute-sim: noisy neighbor, flow control off and on";
        let subtitle = format!(
            "{} endpoints, {capacity:.0} req/s capacity; B 55%, A 10% bursting 10x; seed {}",
            s.cluster.endpoints, s.scenario.seed
        );
        let chart = noisy::chart::render(&s.scenario, &summaries, title, &subtitle);
        std::fs::write(&path, chart).map_err(|e| SimError::Io { path: path.display().to_string(), source: e })?;
        println!("chart: {}", path.display());
    }
    if let Some(path) = &args.json {
        let mut doc = noisy::results_json(&s.scenario, &summaries);
        doc["cluster"] = serde_json::to_value(&s.cluster).unwrap_or_default();
        doc["flow_control"] = s.flow.clone();
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        std::fs::write(path, text).map_err(|e| SimError::Io { path: path.display().to_string(), source: e })?;
        println!("results: {}", path.display());
    }
    eprintln!("kvroute-sim: done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn load_policy(args: &Args) -> Result<Policy, SimError> {
    match &args.policy {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| SimError::Io { path: path.display().to_string(), source: e })?;
            Ok(Policy::from_str_auto(&text)?)
        }
        None => Ok(Policy::default()),
    }
}

/// The cluster the flags describe (`endpoints` unless `--endpoints` says otherwise).
fn cluster_of(args: &Args, endpoints: u32) -> ClusterConfig {
    ClusterConfig {
        endpoints: args.endpoints.unwrap_or(endpoints),
        cache_tokens: args.cache_tokens,
        kv_tokens: args.kv_tokens,
        prefill_tokens_per_s: args.prefill_tps,
        prefill_overhead_ms: DEFAULT_PREFILL_OVERHEAD_MS,
        tpot_ms: args.tpot_ms,
        batch_reference: DEFAULT_BATCH_REFERENCE,
        metrics_interval_ms: args.metrics_interval_ms,
    }
}

/// `--scenario replicas`.
fn run_replicas(args: &Args) -> Result<(), SimError> {
    let started = Instant::now();
    if args.trace.is_some() || args.workload != WorkloadKind::Agents {
        return Err(SimError::Setting {
            name: "scenario",
            value: "replicas".into(),
            reason: "runs the synthetic agent workload (--trace and --workload unique are not supported)",
        });
    }
    let mut s = if args.quick {
        replicas::ReplicasScenario::quick(args.seed)
    } else {
        replicas::ReplicasScenario::new(SyntheticConfig::default(), ClusterConfig::default())
    };
    s.cluster = cluster_of(args, DEFAULT_ENDPOINTS);
    s.workload = SyntheticConfig {
        tenants: args.tenants,
        sessions: args.sessions.unwrap_or(s.workload.sessions),
        turns: args.turns,
        rate_per_s: args.rate.unwrap_or(s.workload.rate_per_s),
        seed: args.seed,
        system_tokens: args.system_tokens,
        user_tokens: args.user_tokens,
        output_tokens: args.output_tokens,
        think_ms: args.think_ms,
        ..s.workload
    };
    s.policy = load_policy(args)?;
    s.replicas.clone_from(&args.replicas);
    s.fault_replicas = args.replicas.iter().copied().max().unwrap_or(1).max(2);
    s.faults = !args.no_faults;
    s.bus.latency_ms = args.bus_latency_ms;
    s.bus.flush_interval_ms = args.flush_ms;
    s.validate()?;
    let reqs = s.requests()?;
    let span_s = reqs.last().map_or(0.0, |r| r.arrival_ms as f64 / 1000.0);
    println!("kvroute-sim --scenario replicas");
    println!("  {}", s.workload.describe());
    println!("  {}", s.cluster.describe());
    println!("  {} requests over {span_s:.0} s, sprayed round-robin over the replicas", reqs.len());
    println!("  {}", s.describe());
    let mut runs = Vec::new();
    for spec in s.specs() {
        let r = replicas::sim::run(&s, &reqs, &spec)?;
        eprintln!("  [{:<44}] {} requests, {:.2} s", spec.name(), r.records.len(), r.wall_s);
        runs.push(r);
    }
    let summaries = replicas::summarize(&s, &runs);
    println!();
    print!("{}", replicas::table(&summaries));
    println!(
        "hit rate = true cached / prompt tokens at the engine each request went to; vs 1 router = over the single \
         router's; predicted = what the routers believed; batches and bytes per effect = published (heartbeats \
         included) per routed decision, all replicas."
    );
    println!();
    print!("{}", replicas::faults_text(&summaries));
    println!();
    print!("{}", replicas::targets_text(&replicas::targets(&s, &summaries)));
    for r in &summaries {
        for n in r
            .notes
            .iter()
            .filter(|n| !n.contains(" killed at ") && !n.contains(" restarted at ") && !n.starts_with("bus "))
        {
            println!("  note ({}): {n}", r.name);
        }
    }
    if !args.no_svg {
        let path = args.svg.clone().unwrap_or_else(|| PathBuf::from("kvroute-sim-replicas.svg"));
        let title = "kvroute-sim: router replicas, state shared over a bus or not";
        let subtitle = format!(
            "{} requests, {} endpoints, round-robin spray; bus latency {} ms, flush {} ms; seed {}",
            reqs.len(),
            s.cluster.endpoints,
            s.bus.latency_ms,
            s.bus.flush_interval_ms,
            s.workload.seed
        );
        let chart = replicas::chart::render(&summaries, title, &subtitle);
        std::fs::write(&path, chart).map_err(|e| SimError::Io { path: path.display().to_string(), source: e })?;
        println!("chart: {}", path.display());
    }
    if let Some(path) = &args.json {
        let doc = replicas::results_json(&s, &summaries);
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        std::fs::write(path, text).map_err(|e| SimError::Io { path: path.display().to_string(), source: e })?;
        println!("results: {}", path.display());
    }
    eprintln!("kvroute-sim: done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn versus(k: &PolicyReport, other: &PolicyReport) -> String {
    let change = |a: f64, b: f64| if b > 0.0 { format!("{:+.0}%", (a / b - 1.0) * 100.0) } else { "n/a".into() };
    format!(
        "kvroute vs {}: hit ratio {:+.1} pts, TTFT p50 {}, p90 {}, p99 {}",
        other.policy,
        (k.hit_ratio - other.hit_ratio) * 100.0,
        change(k.ttft_p50_ms, other.ttft_p50_ms),
        change(k.ttft_p90_ms, other.ttft_p90_ms),
        change(k.ttft_p99_ms, other.ttft_p99_ms),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Args::command().debug_assert();
    }

    #[test]
    fn lists_and_ranges_parse() {
        let a = Args::try_parse_from(["kvroute-sim", "--policies", "kvroute,round-robin", "--turns", "3-5", "--quick"])
            .map_err(|e| e.to_string());
        let a = match a {
            Ok(a) => a,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(a.policies, [PolicyKind::Kvroute, PolicyKind::RoundRobin]);
        assert_eq!(a.turns, Span::new(3, 5));
        assert!(a.quick && a.sessions.is_none());
        assert!(Args::try_parse_from(["kvroute-sim", "--policies", "random"]).is_err());
        assert!(Args::try_parse_from(["kvroute-sim", "--turns", "5-3"]).is_err());
        let a = Args::try_parse_from(["kvroute-sim", "--scenario", "replicas", "--replicas", "1,16", "--no-faults"])
            .map_err(|e| e.to_string());
        let a = match a {
            Ok(a) => a,
            Err(e) => panic!("{e}"),
        };
        assert_eq!((a.scenario, a.replicas.as_slice(), a.no_faults), (Scenario::Replicas, &[1, 16][..], true));
        assert!(Args::try_parse_from(["kvroute-sim", "--replicas", "two"]).is_err());
    }
}
