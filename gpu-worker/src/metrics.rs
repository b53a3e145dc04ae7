//! Counters, histograms and the `/metrics` page (vLLM's metric names, plus `kvroute_worker_*`).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::Serialize;

macro_rules! counters {
    ($($name:ident: $doc:literal,)*) => {
        /// Live atomics, written by the engine and the HTTP layer.
        #[derive(Debug, Default)]
        pub(crate) struct Counters {
            $(pub(crate) $name: AtomicU64,)*
        }

        /// A snapshot of the worker's counters and gauges ([`crate::WorkerHandle::counters`]).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
        #[non_exhaustive]
        pub struct WorkerCounters {
            $(#[doc = $doc] pub $name: u64,)*
        }

        impl Counters {
            pub(crate) fn snapshot(&self) -> WorkerCounters {
                WorkerCounters { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }
    };
}

counters! {
    requests_submitted: "Requests handed to the engine (including remote prefills).",
    requests_finished: "Requests that finished normally.",
    requests_aborted: "Requests aborted (client gone, shutdown, errors).",
    preemptions: "Sequences preempted for lack of free blocks (recomputed later).",
    prompt_tokens: "Prompt tokens of admitted requests.",
    generation_tokens: "Tokens generated.",
    prefill_tokens_computed: "Prompt (and recomputed) tokens whose K/V were computed by this worker's model.",
    decode_tokens_computed: "Decode steps' tokens whose K/V were computed.",
    prefix_cache_queries: "Tokens looked up in the prefix cache (vLLM's prefix_cache_queries).",
    cached_tokens_reused: "Tokens served from the local prefix cache, not recomputed (vLLM's prefix_cache_hits).",
    blocks_stored: "Blocks newly cached (reported in BlockStored events).",
    blocks_evicted: "Cached blocks evicted (reported in BlockRemoved events).",
    cache_resets: "Prefix-cache resets (AllBlocksCleared events).",
    kv_transfers_in: "KV transfers received from prefill workers.",
    kv_transfer_in_bytes: "KV payload bytes received (K and V, f32).",
    kv_transfer_in_blocks: "Blocks received.",
    kv_transfer_in_tokens: "Tokens whose K/V were received and inserted instead of computed.",
    kv_transfer_in_micros: "Microseconds spent receiving KV (connection to last byte), summed.",
    kv_transfer_failures: "Transfers that failed (the prompt was then computed locally).",
    kv_transfers_out: "KV transfers sent to decode workers.",
    kv_transfer_out_bytes: "KV payload bytes sent.",
    remote_prefills: "Remote prefills computed for decode workers.",
    event_batches: "KV-event batches published (or buffered, when dropped for tests).",
    event_batches_dropped: "KV-event batches not sent live (fault injection), still replayable.",
    running: "Gauge: running sequences.",
    waiting: "Gauge: waiting sequences.",
    free_blocks: "Gauge: blocks in the free queue.",
    cached_blocks: "Gauge: blocks carrying a prefix digest.",
    num_blocks: "Gauge: blocks in the pool.",
    pinned_transfers: "Gauge: prefilled prompts held for a decode worker to pull.",
}

/// A cumulative histogram.
#[derive(Debug, Clone)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub(crate) fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    pub(crate) fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(self.counts.iter_mut()) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

/// vLLM's TTFT buckets, seconds.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
/// vLLM's end-to-end latency buckets, seconds.
const E2E_BUCKETS: &[f64] =
    &[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0];
/// Inter-token latency buckets, seconds.
const ITL_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5];
/// KV-transfer buckets, seconds.
const TRANSFER_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0];

/// The worker's histograms.
#[derive(Debug, Clone)]
pub(crate) struct Histograms {
    pub(crate) ttft: Histogram,
    pub(crate) e2e: Histogram,
    pub(crate) itl: Histogram,
    pub(crate) transfer: Histogram,
}

impl Default for Histograms {
    fn default() -> Self {
        Histograms {
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            transfer: Histogram::new(TRANSFER_BUCKETS),
        }
    }
}

/// State shared by the engine, the HTTP layer and the handle.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) counters: Counters,
    /// `f64::to_bits` of the KV usage (0–1).
    pub(crate) kv_usage_bits: AtomicU64,
    pub(crate) hist: Mutex<Histograms>,
}

impl Shared {
    pub(crate) fn add(c: &AtomicU64, v: u64) {
        c.fetch_add(v, Ordering::Relaxed);
    }

    pub(crate) fn set(c: &AtomicU64, v: u64) {
        c.store(v, Ordering::Relaxed);
    }

    pub(crate) fn kv_usage(&self) -> f64 {
        f64::from_bits(self.kv_usage_bits.load(Ordering::Relaxed))
    }

    pub(crate) fn observe(&self, f: impl FnOnce(&mut Histograms)) {
        if let Ok(mut h) = self.hist.lock() {
            f(&mut h);
        }
    }
}

/// What the page needs besides the shared state.
pub(crate) struct PageInfo<'a> {
    pub(crate) model_name: &'a str,
    pub(crate) block_size: u32,
    pub(crate) num_blocks: u32,
    pub(crate) role: &'a str,
    pub(crate) backend: &'a str,
    pub(crate) kv_bytes_per_token: u64,
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The Prometheus text page.
pub(crate) fn render(shared: &Shared, info: &PageInfo<'_>) -> String {
    let c = shared.counters.snapshot();
    let labels = format!("model_name=\"{}\",engine=\"0\"", escape(info.model_name));
    let mut out = String::with_capacity(8192);
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}");
    };
    metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", c.running as f64);
    metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", c.waiting as f64);
    let usage = shared.kv_usage();
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage);
    metric("vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage (pre-v1 name). 1 means 100 percent usage.", usage);
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        c.prefix_cache_queries as f64,
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        c.cached_tokens_reused as f64,
    );
    metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", c.prompt_tokens as f64);
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        c.generation_tokens as f64,
    );
    metric(
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemptions from the engine.",
        c.preemptions as f64,
    );
    metric(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        c.requests_finished as f64,
    );
    let mut hists = shared.hist.lock().map(|h| h.clone()).unwrap_or_default();
    for (name, help, h) in [
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", &mut hists.ttft),
        ("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", &mut hists.e2e),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", &mut hists.itl),
        (
            "kvroute_worker_kv_transfer_seconds",
            "Histogram of KV transfers received, connection to last byte, in seconds.",
            &mut hists.transfer,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, n) in h.bounds.iter().zip(&h.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {n}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
    }
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"{}\",num_gpu_blocks=\"{}\",enable_prefix_caching=\"True\",engine=\"0\"}} 1",
        info.block_size, info.num_blocks
    );
    let _ = writeln!(
        out,
        "# HELP kvroute_worker_info Worker role, backend and KV bytes per token.\n# TYPE kvroute_worker_info gauge\n\
         kvroute_worker_info{{{labels},role=\"{}\",backend=\"{}\",kv_bytes_per_token=\"{}\"}} 1",
        info.role, info.backend, info.kv_bytes_per_token
    );
    let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}");
    };
    for (name, help, v) in [
        (
            "kvroute_worker_prefill_tokens_computed_total",
            "Prompt tokens whose K/V this worker computed.",
            c.prefill_tokens_computed,
        ),
        ("kvroute_worker_blocks_stored_total", "Blocks newly cached.", c.blocks_stored),
        ("kvroute_worker_blocks_evicted_total", "Cached blocks evicted.", c.blocks_evicted),
        ("kvroute_worker_kv_transfers_in_total", "KV transfers received.", c.kv_transfers_in),
        ("kvroute_worker_kv_transfer_in_bytes_total", "KV payload bytes received.", c.kv_transfer_in_bytes),
        ("kvroute_worker_kv_transfer_in_blocks_total", "KV blocks received.", c.kv_transfer_in_blocks),
        ("kvroute_worker_kv_transfer_in_tokens_total", "Tokens whose K/V were received.", c.kv_transfer_in_tokens),
        (
            "kvroute_worker_kv_transfer_failures_total",
            "Failed KV transfers (computed locally instead).",
            c.kv_transfer_failures,
        ),
        ("kvroute_worker_kv_transfers_out_total", "KV transfers sent.", c.kv_transfers_out),
        ("kvroute_worker_kv_transfer_out_bytes_total", "KV payload bytes sent.", c.kv_transfer_out_bytes),
        ("kvroute_worker_remote_prefills_total", "Remote prefills computed for decode workers.", c.remote_prefills),
        ("kvroute_worker_event_batches_total", "KV-event batches published.", c.event_batches),
    ] {
        metric(name, "counter", help, v);
    }
    metric("kvroute_worker_free_blocks", "gauge", "Blocks in the free queue.", c.free_blocks);
    metric("kvroute_worker_cached_blocks", "gauge", "Blocks carrying a prefix digest.", c.cached_blocks);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        h.observe(0.5);
        h.observe(1.5);
        h.observe(3.0);
        assert_eq!(h.counts, vec![1, 2]);
        assert_eq!(h.count, 3);
    }

    #[test]
    fn page_is_read_by_kvroute() {
        let s = Shared::default();
        Shared::set(&s.counters.running, 3);
        Shared::set(&s.counters.waiting, 2);
        s.kv_usage_bits.store(0.25f64.to_bits(), Ordering::Relaxed);
        s.observe(|h| h.ttft.observe(0.02));
        let info = PageInfo {
            model_name: "m\"x",
            block_size: 16,
            num_blocks: 100,
            role: "both",
            backend: "cpu",
            kv_bytes_per_token: 1024,
        };
        let page = render(&s, &info);
        let m = kvroute::parse_prometheus(&page, 5).unwrap();
        assert_eq!((m.running, m.waiting, m.kv_usage), (3, 2, 0.25));
        assert_eq!(m.kv_capacity_tokens, Some(1600));
        assert!(
            page.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"m\\\"x\",engine=\"0\",le=\"0.02\"} 1")
        );
    }
}
