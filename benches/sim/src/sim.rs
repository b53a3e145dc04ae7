//! The cluster model and the discrete-event simulation.
//!
//! # Model
//!
//! Each endpoint (role `both`) has:
//! - a TRUE prefix cache ([`PrefixCache`]): LRU over 16-token blocks of the rendered prompt,
//!   `cache_tokens` tokens per endpoint;
//! - a FIFO prefill queue served one request at a time: service time
//!   `prefill_overhead_ms + uncached_tokens / prefill_tokens_per_s`, where the cached tokens are
//!   looked up when the prefill starts (a prefix may have arrived, or been evicted, while the
//!   request waited). When the prefill ends the prompt's blocks enter the cache and the first token
//!   is out: TTFT = arrival → prefill end;
//! - continuous-batching decode: every request decodes concurrently for
//!   `output_tokens × tpot_ms × (1 + decoding / batch_reference)` (the batch size taken when its
//!   decode starts); when it ends the router is told (`Router::complete`).
//!
//! Every `metrics_interval_ms` of simulated time the endpoints publish metrics (`waiting` = queued
//! for prefill, `running` = prefilling + decoding, `kv_usage` = running requests' prompt + output
//! tokens / `kv_tokens`, by default `cache_tokens`, clamped to 1) with `updated_ms` = that time; between two pushes the
//! router's view is stale, as with a real scraper.
//!
//! Time is kept in integer microseconds; events at the same instant run in the order they were
//! scheduled, so a run is fully deterministic (except the wall-clock routing time, which is
//! measured, not simulated).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Instant;

use kvroute::RequestConfig;
use kvroute::{MetricsSnapshot, Policy, RouteRequest};
use serde::Serialize;

use crate::cache::{self, PrefixCache, BLOCK_TOKENS, BYTES_PER_TOKEN};
use crate::error::SimError;
use crate::policy::{Balancer, EndpointLoad, PolicyKind};
use crate::workload::TraceRequest;

/// Default number of endpoints.
pub const DEFAULT_ENDPOINTS: u32 = 8;
/// Default prefix-cache capacity per endpoint (tokens).
pub const DEFAULT_CACHE_TOKENS: u64 = 150_000;
/// Default prefill throughput per endpoint (tokens per second).
pub const DEFAULT_PREFILL_TOKENS_PER_S: f64 = 12_000.0;
/// Default fixed cost of one prefill (ms).
pub const DEFAULT_PREFILL_OVERHEAD_MS: f64 = 3.0;
/// Default time per output token of a lone request (ms).
pub const DEFAULT_TPOT_MS: f64 = 15.0;
/// Default batch size at which the time per output token doubles.
pub const DEFAULT_BATCH_REFERENCE: f64 = 32.0;
/// Default metrics push interval (ms of simulated time).
pub const DEFAULT_METRICS_INTERVAL_MS: u64 = 100;

/// The simulated cluster.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClusterConfig {
    /// Endpoints (ids `10.0.0.1:8000`, `10.0.0.2:8000`, …).
    pub endpoints: u32,
    /// Prefix-cache capacity per endpoint, tokens.
    pub cache_tokens: u64,
    /// KV memory per endpoint for running requests, tokens: the denominator of the published
    /// `kv_usage` (`None`: the same as `cache_tokens`).
    pub kv_tokens: Option<u64>,
    /// Prefill throughput per endpoint, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Fixed cost of one prefill, ms.
    pub prefill_overhead_ms: f64,
    /// Time per output token of a lone request, ms.
    pub tpot_ms: f64,
    /// Decoding batch size at which the time per output token doubles.
    pub batch_reference: f64,
    /// Metrics push interval, ms of simulated time.
    pub metrics_interval_ms: u64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            endpoints: DEFAULT_ENDPOINTS,
            cache_tokens: DEFAULT_CACHE_TOKENS,
            kv_tokens: None,
            prefill_tokens_per_s: DEFAULT_PREFILL_TOKENS_PER_S,
            prefill_overhead_ms: DEFAULT_PREFILL_OVERHEAD_MS,
            tpot_ms: DEFAULT_TPOT_MS,
            batch_reference: DEFAULT_BATCH_REFERENCE,
            metrics_interval_ms: DEFAULT_METRICS_INTERVAL_MS,
        }
    }
}

impl ClusterConfig {
    /// Check every setting.
    pub fn validate(&self) -> Result<(), SimError> {
        if !(1..=4096).contains(&self.endpoints) {
            return Err(SimError::setting("endpoints", self.endpoints, "must be within 1..=4096"));
        }
        if self.cache_tokens < BLOCK_TOKENS as u64 {
            return Err(SimError::setting("cache-tokens", self.cache_tokens, "must hold at least one 16-token block"));
        }
        if self.kv_tokens == Some(0) {
            return Err(SimError::setting("kv-tokens", 0, "must be > 0"));
        }
        if !(self.prefill_tokens_per_s.is_finite() && self.prefill_tokens_per_s > 0.0) {
            return Err(SimError::setting("prefill-tps", self.prefill_tokens_per_s, "must be a number > 0"));
        }
        for (name, v) in [("prefill-overhead-ms", self.prefill_overhead_ms), ("tpot-ms", self.tpot_ms)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(SimError::setting(name, v, "must be a number >= 0"));
            }
        }
        if !(self.batch_reference.is_finite() && self.batch_reference > 0.0) {
            return Err(SimError::setting("batch-reference", self.batch_reference, "must be a number > 0"));
        }
        if self.metrics_interval_ms == 0 {
            return Err(SimError::setting("metrics-interval-ms", 0, "must be > 0"));
        }
        Ok(())
    }

    /// Endpoint ids: `10.0.0.1:8000`, `10.0.0.2:8000`, … (continuing into `10.0.1.x` past 254).
    pub fn endpoint_ids(&self) -> Vec<String> {
        (0..self.endpoints).map(|i| format!("10.0.{}.{}:8000", i / 254, i % 254 + 1)).collect()
    }

    /// A one-line description.
    pub fn describe(&self) -> String {
        format!(
            "cluster: {} endpoints, prefix cache {}k tok each{}, prefill {:.0} tok/s + {} ms, tpot {} ms x (1 + batch/{}), metrics every {} ms",
            self.endpoints,
            self.cache_tokens / 1000,
            self.kv_tokens.map_or_else(String::new, |k| format!(" (KV memory {}k tok)", k / 1000)),
            self.prefill_tokens_per_s,
            self.prefill_overhead_ms,
            self.tpot_ms,
            self.batch_reference,
            self.metrics_interval_ms
        )
    }
}

/// A workload request ready for simulation: the original body and headers (what the router gets)
/// plus the prompt's true cache blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimRequest {
    /// Arrival time, ms.
    pub arrival_ms: u64,
    /// Request id (from the request-id header, else `req-<n>`).
    pub request_id: String,
    /// OpenAI body.
    pub body: Vec<u8>,
    /// Headers.
    pub headers: Vec<(String, String)>,
    /// True output length.
    pub output_tokens: u32,
    /// Prompt length in tokens (4 bytes per token for text).
    pub prompt_tokens: u64,
    /// Chained block keys of each prompt sequence (see [`cache::chain`]).
    pub chains: Vec<Vec<u64>>,
}

/// Parse each request with `request_cfg` (the kvroute policy's request settings, so header names
/// agree) and compute its true cache blocks from the same rendered prompt the router hashes.
pub fn prepare(requests: Vec<TraceRequest>, request_cfg: &RequestConfig) -> Result<Vec<SimRequest>, SimError> {
    if requests.is_empty() {
        return Err(SimError::EmptyWorkload);
    }
    let mut out = Vec::with_capacity(requests.len());
    for (i, r) in requests.into_iter().enumerate() {
        let parsed = RouteRequest::parse(&r.body, r.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())), request_cfg);
        let req = parsed.map_err(|source| SimError::Request {
            index: i + 1,
            request_id: header(&r.headers, &request_cfg.request_id_header).unwrap_or("-").to_owned(),
            source,
        })?;
        let salt = req.cache_salt.as_deref();
        out.push(SimRequest {
            arrival_ms: r.t_ms,
            request_id: req.request_id.clone().unwrap_or_else(|| format!("req-{}", i + 1)),
            prompt_tokens: req.prompts.iter().map(|p| p.tokens(BYTES_PER_TOKEN as u32)).sum(),
            chains: req.prompts.iter().map(|p| cache::chain(&req.model, salt, p)).collect(),
            body: r.body,
            headers: r.headers,
            output_tokens: r.output_tokens,
        });
    }
    out.sort_by_key(|r| r.arrival_ms);
    Ok(out)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

/// Results of one policy on one workload.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyReport {
    /// Policy name.
    pub policy: String,
    /// Requests served.
    pub requests: u64,
    /// Requests the policy did not route (shed).
    pub unrouted: u64,
    /// Prompt tokens of the served requests.
    pub prompt_tokens: u64,
    /// Of which found in the serving endpoint's true cache when its prefill started.
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`.
    pub hit_ratio: f64,
    /// Mean time to first token, ms.
    pub ttft_mean_ms: f64,
    /// Median TTFT, ms.
    pub ttft_p50_ms: f64,
    /// 90th percentile TTFT, ms.
    pub ttft_p90_ms: f64,
    /// 99th percentile TTFT, ms.
    pub ttft_p99_ms: f64,
    /// Requests per endpoint, max / mean.
    pub load_imbalance: f64,
    /// Requests served by each endpoint.
    pub requests_per_endpoint: Vec<u64>,
    /// Simulated time until the last request finished, ms.
    pub makespan_ms: f64,
    /// Fraction of the cluster's prefill capacity spent prefilling (busy time / endpoints /
    /// time until the last prefill ended).
    pub prefill_utilization: f64,
    /// Mean wall-clock time of one routing decision, µs (measured, not simulated).
    pub mean_route_us: f64,
    /// The balancer's own summary, if any.
    pub summary: Option<String>,
}

impl PolicyReport {
    /// The report without its wall-clock field (everything left is deterministic).
    pub fn without_timing(&self) -> PolicyReport {
        PolicyReport { mean_route_us: 0.0, ..self.clone() }
    }
}

/// Progress of a run, reported about every 10% of requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress<'a> {
    /// Policy being simulated.
    pub policy: &'a str,
    /// Requests routed so far.
    pub done: usize,
    /// Requests in the workload.
    pub total: usize,
    /// Simulated time, ms.
    pub sim_ms: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Event {
    Metrics,
    PrefillDone {
        endpoint: usize,
    },
    DecodeDone {
        request: usize,
    },
    /// A timer of the caller's (the flow-control loop's dispatch timer).
    Timer,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Scheduled {
    pub(crate) t_us: u64,
    seq: u64,
    pub(crate) event: Event,
}

pub(crate) struct Endpoint {
    queue: VecDeque<usize>,
    prefilling: Option<usize>,
    pub(crate) decoding: u32,
    pub(crate) running_tokens: u64,
    cache: PrefixCache,
    pub(crate) served: u64,
    busy_us: u64,
}

impl Endpoint {
    pub(crate) fn busy(&self) -> bool {
        self.prefilling.is_some() || self.decoding > 0 || !self.queue.is_empty()
    }
}

#[derive(Default, Clone)]
pub(crate) struct Flight {
    pub(crate) endpoint: usize,
    pub(crate) ticket: Option<String>,
    pub(crate) cached_tokens: u64,
    pub(crate) ttft_us: u64,
}

/// The cluster's state during a run (the endpoints, the requests in flight, the event heap);
/// [`simulate`] drives it with a balancer, the noisy-neighbor scenario with flow control
/// (`crate::noisy::sim`).
pub(crate) struct Sim<'a> {
    cfg: &'a ClusterConfig,
    reqs: &'a [SimRequest],
    pub(crate) endpoints: Vec<Endpoint>,
    pub(crate) flights: Vec<Flight>,
    heap: BinaryHeap<Reverse<Scheduled>>,
    seq: u64,
}

fn us(ms: f64) -> u64 {
    (ms * 1000.0).round().max(0.0) as u64
}

impl<'a> Sim<'a> {
    /// An idle cluster (empty caches) for `reqs`.
    pub(crate) fn new(cfg: &'a ClusterConfig, reqs: &'a [SimRequest]) -> Sim<'a> {
        Sim {
            cfg,
            reqs,
            endpoints: (0..cfg.endpoints)
                .map(|_| Endpoint {
                    queue: VecDeque::new(),
                    prefilling: None,
                    decoding: 0,
                    running_tokens: 0,
                    cache: PrefixCache::new(cfg.cache_tokens),
                    served: 0,
                    busy_us: 0,
                })
                .collect(),
            flights: vec![Flight::default(); reqs.len()],
            heap: BinaryHeap::new(),
            seq: 0,
        }
    }

    pub(crate) fn schedule(&mut self, t_us: u64, event: Event) {
        self.seq += 1;
        self.heap.push(Reverse(Scheduled { t_us, seq: self.seq, event }));
    }

    /// When the next event is due.
    pub(crate) fn next_event_us(&self) -> Option<u64> {
        self.heap.peek().map(|Reverse(s)| s.t_us)
    }

    /// Take the next event.
    pub(crate) fn pop(&mut self) -> Option<Scheduled> {
        self.heap.pop().map(|Reverse(s)| s)
    }

    /// Queue request `r` at endpoint `e` (its prefill starts at once when the endpoint is idle).
    pub(crate) fn send(&mut self, r: usize, e: usize, ticket: Option<String>, now_us: u64) {
        self.flights[r].endpoint = e;
        self.flights[r].ticket = ticket;
        let ep = &mut self.endpoints[e];
        ep.queue.push_back(r);
        ep.served += 1;
        if ep.prefilling.is_none() {
            self.start_prefill(e, now_us);
        }
    }

    /// Request `r`'s decode ended: its endpoint forgets it; returns its ticket.
    pub(crate) fn decode_done(&mut self, r: usize) -> Option<String> {
        let f = &mut self.flights[r];
        let ep = &mut self.endpoints[f.endpoint];
        ep.decoding = ep.decoding.saturating_sub(1);
        let tokens = self.reqs[r].prompt_tokens + u64::from(self.reqs[r].output_tokens);
        ep.running_tokens = ep.running_tokens.saturating_sub(tokens);
        f.ticket.take()
    }

    fn start_prefill(&mut self, e: usize, now_us: u64) {
        let ep = &mut self.endpoints[e];
        let Some(r) = ep.queue.pop_front() else { return };
        ep.prefilling = Some(r);
        let req = &self.reqs[r];
        let cached_blocks: usize = req.chains.iter().map(|c| ep.cache.lookup(c)).sum();
        let cached = (cached_blocks as u64 * BLOCK_TOKENS as u64).min(req.prompt_tokens);
        let uncached = req.prompt_tokens - cached;
        let service_ms = self.cfg.prefill_overhead_ms + uncached as f64 / self.cfg.prefill_tokens_per_s * 1000.0;
        self.flights[r].cached_tokens = cached;
        let service_us = us(service_ms);
        ep.busy_us += service_us;
        self.schedule(now_us + service_us, Event::PrefillDone { endpoint: e });
    }

    pub(crate) fn prefill_done(&mut self, e: usize, now_us: u64) {
        let ep = &mut self.endpoints[e];
        let Some(r) = ep.prefilling.take() else { return };
        let req = &self.reqs[r];
        for c in &req.chains {
            ep.cache.insert(c);
        }
        ep.decoding += 1;
        ep.running_tokens += req.prompt_tokens + u64::from(req.output_tokens);
        let tpot = self.cfg.tpot_ms * (1.0 + f64::from(ep.decoding) / self.cfg.batch_reference);
        let decode_ms = f64::from(req.output_tokens) * tpot;
        self.flights[r].ttft_us = now_us.saturating_sub(req.arrival_ms * 1000);
        self.schedule(now_us + us(decode_ms), Event::DecodeDone { request: r });
        self.start_prefill(e, now_us);
    }

    fn loads(&self, out: &mut Vec<EndpointLoad>) {
        out.clear();
        out.extend(self.endpoints.iter().map(|ep| EndpointLoad {
            waiting: ep.queue.len() as u32,
            prefilling: u32::from(ep.prefilling.is_some()),
            decoding: ep.decoding,
            kv_usage: self.kv_usage(ep),
        }));
    }

    fn kv_usage(&self, ep: &Endpoint) -> f64 {
        let prefill = ep.prefilling.map_or(0, |r| self.reqs[r].prompt_tokens);
        let capacity = self.cfg.kv_tokens.unwrap_or(self.cfg.cache_tokens).max(1);
        ((ep.running_tokens + prefill) as f64 / capacity as f64).min(1.0)
    }

    pub(crate) fn snapshots(&self, now_ms: u64) -> Vec<MetricsSnapshot> {
        self.endpoints
            .iter()
            .map(|ep| MetricsSnapshot {
                waiting: ep.queue.len() as u32,
                running: ep.decoding + u32::from(ep.prefilling.is_some()),
                kv_usage: self.kv_usage(ep),
                updated_ms: now_ms,
                ..Default::default()
            })
            .collect()
    }
}

/// Simulate one policy (its `balancer`, reported as `name`) on prepared requests.
pub fn simulate(
    requests: &[SimRequest],
    cluster: &ClusterConfig,
    name: &str,
    balancer: &mut dyn Balancer,
    progress: &mut dyn FnMut(&Progress<'_>),
) -> Result<PolicyReport, SimError> {
    cluster.validate()?;
    if requests.is_empty() {
        return Err(SimError::EmptyWorkload);
    }
    let n = requests.len();
    let mut sim = Sim::new(cluster, requests);
    let mut routed = vec![false; n];
    sim.schedule(0, Event::Metrics);
    let mut next_arrival = 0usize;
    let mut loads = Vec::with_capacity(cluster.endpoints as usize);
    let mut route_ns: u128 = 0;
    let mut unrouted = 0u64;
    let mut last_us = 0u64;
    let mut last_prefill_us = 0u64;
    let step = n.div_ceil(10).max(1);
    loop {
        let arrival_us = requests.get(next_arrival).map(|r| r.arrival_ms * 1000);
        let event_us = sim.heap.peek().map(|Reverse(s)| s.t_us);
        let take_event = match (event_us, arrival_us) {
            (None, None) => break,
            (Some(e), Some(a)) => e <= a,
            (Some(_), None) => true,
            (None, Some(_)) => false,
        };
        if !take_event {
            let r = next_arrival;
            next_arrival += 1;
            let now_us = requests[r].arrival_ms * 1000;
            last_us = last_us.max(now_us);
            sim.loads(&mut loads);
            let t0 = Instant::now();
            let pick = balancer.pick(&requests[r], &loads, requests[r].arrival_ms)?;
            route_ns += t0.elapsed().as_nanos();
            match pick.endpoint.filter(|&e| e < sim.endpoints.len()) {
                Some(e) => {
                    routed[r] = true;
                    sim.send(r, e, pick.ticket, now_us);
                }
                None => unrouted += 1,
            }
            if next_arrival % step == 0 || next_arrival == n {
                progress(&Progress { policy: name, done: next_arrival, total: n, sim_ms: now_us as f64 / 1000.0 });
            }
            continue;
        }
        let Some(Reverse(s)) = sim.heap.pop() else { break };
        let now_us = s.t_us;
        match s.event {
            Event::Metrics => {
                let work_left = next_arrival < n || sim.endpoints.iter().any(Endpoint::busy);
                if work_left {
                    let snaps = sim.snapshots(now_us / 1000);
                    balancer.metrics(&snaps, now_us / 1000)?;
                    sim.schedule(now_us + cluster.metrics_interval_ms * 1000, Event::Metrics);
                }
            }
            Event::PrefillDone { endpoint } => {
                last_us = now_us;
                last_prefill_us = now_us;
                sim.prefill_done(endpoint, now_us);
            }
            Event::DecodeDone { request } => {
                last_us = now_us;
                if let Some(t) = sim.decode_done(request) {
                    balancer.complete(&t)?;
                }
            }
            // Never scheduled here.
            Event::Timer => {}
        }
    }

    let mut ttfts: Vec<u64> = Vec::with_capacity(n);
    let (mut prompt_tokens, mut cached_tokens) = (0u64, 0u64);
    for (f, r) in sim.flights.iter().zip(requests).zip(&routed).filter(|(_, &ok)| ok).map(|(x, _)| x) {
        ttfts.push(f.ttft_us);
        prompt_tokens += r.prompt_tokens;
        cached_tokens += f.cached_tokens;
    }
    ttfts.sort_unstable();
    let pct = |p: f64| -> f64 {
        if ttfts.is_empty() {
            return 0.0;
        }
        ttfts[crate::report::nearest_rank(p, ttfts.len()) - 1] as f64 / 1000.0
    };
    let served: Vec<u64> = sim.endpoints.iter().map(|e| e.served).collect();
    let total_served: u64 = served.iter().sum();
    let mean = total_served as f64 / served.len() as f64;
    let max = served.iter().copied().max().unwrap_or(0) as f64;
    Ok(PolicyReport {
        policy: name.to_owned(),
        requests: total_served,
        unrouted,
        prompt_tokens,
        cached_tokens,
        hit_ratio: if prompt_tokens == 0 { 0.0 } else { cached_tokens as f64 / prompt_tokens as f64 },
        ttft_mean_ms: if ttfts.is_empty() {
            0.0
        } else {
            ttfts.iter().map(|&t| t as f64).sum::<f64>() / ttfts.len() as f64 / 1000.0
        },
        ttft_p50_ms: pct(0.50),
        ttft_p90_ms: pct(0.90),
        ttft_p99_ms: pct(0.99),
        load_imbalance: if mean > 0.0 { max / mean } else { 0.0 },
        requests_per_endpoint: served,
        makespan_ms: last_us as f64 / 1000.0,
        prefill_utilization: if last_prefill_us == 0 {
            0.0
        } else {
            sim.endpoints.iter().map(|e| e.busy_us).sum::<u64>() as f64
                / (last_prefill_us as f64 * f64::from(cluster.endpoints))
        },
        mean_route_us: route_ns as f64 / n as f64 / 1000.0,
        summary: balancer.summary(),
    })
}

/// Run every policy in `policies` on the same prepared requests. `kvroute` is the policy the
/// kvroute balancer runs.
pub fn compare(
    requests: &[SimRequest],
    cluster: &ClusterConfig,
    policies: &[PolicyKind],
    kvroute: &Policy,
    progress: &mut dyn FnMut(&Progress<'_>),
) -> Result<Vec<PolicyReport>, SimError> {
    cluster.validate()?;
    let ids = cluster.endpoint_ids();
    policies
        .iter()
        .map(|p| {
            let mut b = p.balancer(&ids, kvroute)?;
            simulate(requests, cluster, p.name(), b.as_mut(), progress)
        })
        .collect()
}
