//! Capacity calibration: measure the fleet's prefill and decode costs with every worker busy at
//! once (so the measurement includes the workers' contention for the machine's cores), then turn
//! them into a per-request service time for the workload under ideal (oracle) caching.
//!
//! Measured, per worker, all workers in parallel, median of a few repetitions with fresh random
//! tokens:
//! - `overhead`: TTFT of a tiny prompt (HTTP, scheduling, one forward step);
//! - prefill cost per token near the start of a context (a fresh prompt of `short` tokens) and
//!   deep in a context (a cached prefix of `deep` tokens extended by `short` new tokens: the
//!   shape of a later agent turn);
//! - decode cost per generated token at batch 1 (a short prompt generating `decode` tokens).
//!
//! A request's cost is `overhead + uncached · prefill_per_token(depth) + output · decode`, where
//! `uncached` and the depth come from the oracle: the tokens an ideal router would still have
//! to compute. Capacity = workers / mean cost.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::runner::{self, Prepared, WorkerAddrs};
use super::workload::{DemoRequest, Rng};

/// Lengths used by the calibration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CalibrationShape {
    /// New tokens per prefill probe.
    pub(crate) short: u32,
    /// Cached prefix of the deep probe.
    pub(crate) deep: u32,
    /// Generated tokens of the decode probe.
    pub(crate) decode: u32,
    /// Repetitions (median taken).
    pub(crate) reps: u32,
}

/// The measured cost model.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CostModel {
    /// Per-request fixed cost, seconds.
    pub(crate) overhead_s: f64,
    /// Prefill seconds per token at mean depth `short / 2`.
    pub(crate) prefill_shallow_s: f64,
    /// Prefill seconds per token at mean depth `deep + short / 2`.
    pub(crate) prefill_deep_s: f64,
    /// Depths the two prefill costs were measured at.
    pub(crate) depths: (f64, f64),
    /// Decode seconds per generated token (batch 1).
    pub(crate) decode_s: f64,
    /// Wall time of the calibration, seconds.
    pub(crate) took_s: f64,
}

impl CostModel {
    /// Prefill seconds per token at context depth `d` (linear in depth, never below the shallow
    /// figure's 50% or below zero).
    pub(crate) fn prefill_per_token(&self, d: f64) -> f64 {
        let (d0, d1) = self.depths;
        let slope = if d1 > d0 { (self.prefill_deep_s - self.prefill_shallow_s) / (d1 - d0) } else { 0.0 };
        (self.prefill_shallow_s + slope.max(0.0) * (d - d0)).max(self.prefill_shallow_s * 0.5).max(0.0)
    }

    /// Worker-seconds to serve a request with `prompt` tokens of which `cached` are cached and
    /// `output` generated.
    pub(crate) fn request_cost(&self, prompt: u32, cached: u32, output: u32) -> f64 {
        let uncached = f64::from(prompt.saturating_sub(cached));
        let mid = f64::from(cached) + uncached / 2.0;
        self.overhead_s + uncached * self.prefill_per_token(mid) + f64::from(output.saturating_sub(1)) * self.decode_s
    }

    /// Mean cost over requests with the given cached tokens each.
    pub(crate) fn mean_cost(&self, reqs: &[DemoRequest], cached: &[u32]) -> f64 {
        if reqs.is_empty() {
            return 0.0;
        }
        let total: f64 = reqs
            .iter()
            .zip(cached.iter().copied().chain(std::iter::repeat(0)))
            .map(|(r, c)| self.request_cost(r.prompt.len() as u32, c, r.max_tokens))
            .sum();
        total / reqs.len() as f64
    }
}

/// One probe request; returns (TTFT s, decode seconds per token after the first).
fn probe(addr: SocketAddr, model: &str, prompt: Vec<u32>, max_tokens: u32, tag: &str) -> anyhow::Result<(f64, f64)> {
    let req = DemoRequest { index: 0, at_s: 0.0, session: Arc::from(tag), prompt: Arc::from(prompt), max_tokens };
    let mut p: Prepared = runner::prepare(std::slice::from_ref(&req), model).remove(0);
    p.request_id = Arc::from(format!("calibrate-{tag}"));
    let t0 = Instant::now();
    let o = runner::send(addr, &p, t0);
    if let Some(e) = o.error {
        anyhow::bail!("calibration request to {addr} failed: {e}");
    }
    let ttft = o.ttft_ms.unwrap_or(0.0) / 1000.0;
    let e2e = o.e2e_ms.unwrap_or(0.0) / 1000.0;
    let per_token = if max_tokens > 1 { (e2e - ttft).max(0.0) / f64::from(max_tokens - 1) } else { 0.0 };
    Ok((ttft, per_token))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// Run the calibration against a fresh fleet (it leaves entries in the workers' caches: restart
/// them afterwards).
pub(crate) fn calibrate(
    workers: &[WorkerAddrs],
    model: &str,
    vocab: u32,
    shape: CalibrationShape,
    seed: u64,
) -> anyhow::Result<CostModel> {
    let t0 = Instant::now();
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = workers
            .iter()
            .enumerate()
            .map(|(w, addr)| {
                let addr = addr.http;
                scope.spawn(move || -> anyhow::Result<Vec<[f64; 5]>> {
                    let mut rng = Rng::new(seed, 1000 + w as u64);
                    let hi = vocab.max(20) - 1;
                    let mut draw = |n: u32| (0..n).map(|_| rng.range(16, hi)).collect::<Vec<u32>>();
                    // Warm-up (code paths, allocations).
                    probe(addr, model, draw(32), 2, &format!("w{w}-warm"))?;
                    let mut out = Vec::new();
                    for rep in 0..shape.reps.max(1) {
                        let tag = format!("w{w}-r{rep}");
                        let (tiny, _) = probe(addr, model, draw(8), 1, &format!("{tag}-tiny"))?;
                        let (shallow, _) = probe(addr, model, draw(shape.short), 1, &format!("{tag}-short"))?;
                        let base = draw(shape.deep);
                        probe(addr, model, base.clone(), 1, &format!("{tag}-base"))?;
                        let mut ext = base;
                        ext.extend(draw(shape.short));
                        let (deep, _) = probe(addr, model, ext, 1, &format!("{tag}-deep"))?;
                        let (_, decode) = probe(addr, model, draw(16), shape.decode.max(2), &format!("{tag}-decode"))?;
                        out.push([tiny, shallow, deep, decode, 0.0]);
                    }
                    Ok(out)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("calibration thread panicked"))))
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    let all: Vec<[f64; 5]> = results.into_iter().flatten().collect();
    let col = |i: usize| median(all.iter().map(|r| r[i]).collect());
    let (tiny, shallow, deep, decode) = (col(0), col(1), col(2), col(3));
    let short = f64::from(shape.short.max(1));
    Ok(CostModel {
        overhead_s: tiny,
        prefill_shallow_s: ((shallow - tiny) / short).max(0.0),
        prefill_deep_s: ((deep - tiny) / short).max(0.0),
        depths: (short / 2.0, f64::from(shape.deep) + short / 2.0),
        decode_s: decode,
        took_s: t0.elapsed().as_secs_f64(),
    })
}

/// Poll until every worker answers `/metrics` (or time out).
pub(crate) fn wait_ready(workers: &[WorkerAddrs], timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    for w in workers {
        loop {
            match super::http::get(w.http, "/metrics", Duration::from_secs(2)) {
                Ok(_) => break,
                Err(e) if Instant::now() >= deadline => anyhow::bail!("worker {} not ready: {e}", w.http),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_model_grows_with_depth_and_uncached_tokens() {
        let m = CostModel {
            overhead_s: 0.01,
            prefill_shallow_s: 0.001,
            prefill_deep_s: 0.002,
            depths: (100.0, 1100.0),
            decode_s: 0.005,
            took_s: 0.0,
        };
        assert!((m.prefill_per_token(100.0) - 0.001).abs() < 1e-12);
        assert!((m.prefill_per_token(1100.0) - 0.002).abs() < 1e-12);
        assert!((m.prefill_per_token(0.0) - 0.0009).abs() < 1e-12);
        // 200 uncached at mid depth 100 + 1 + 9 decode steps.
        let c = m.request_cost(200, 0, 10);
        assert!((c - (0.01 + 200.0 * 0.001 + 9.0 * 0.005)).abs() < 1e-9, "{c}");
        assert!(m.request_cost(200, 150, 10) < c);
        assert!((m.request_cost(200, 200, 1) - 0.01).abs() < 1e-12);
    }
}
