//! Per-request outcomes, per-policy summaries and the results table (written with the simulator
//! toolkit's table writer and nearest-rank percentiles, `kvroute_sim::report`).

use kvroute_sim::report::{markdown, nearest_rank};

/// What happened to one request.
#[derive(Debug, Clone, Default)]
pub(crate) struct Outcome {
    /// Worker index it was sent to (`None`: never sent).
    pub(crate) worker: Option<usize>,
    /// Arrival to first streamed token, milliseconds (on the client's clock).
    pub(crate) ttft_ms: Option<f64>,
    /// Arrival to the end of the stream, milliseconds.
    pub(crate) e2e_ms: Option<f64>,
    /// Prompt tokens as the worker reported them.
    pub(crate) prompt_tokens: u32,
    /// Prompt tokens served from the worker's prefix cache (`usage.prompt_tokens_details`).
    pub(crate) cached_tokens: u32,
    /// Generated tokens.
    pub(crate) output_tokens: u32,
    /// Why it failed.
    pub(crate) error: Option<String>,
}

impl Outcome {
    pub(crate) fn ok(&self) -> bool {
        self.error.is_none() && self.ttft_ms.is_some()
    }
}

/// Summary of one policy's run.
#[derive(Debug, Clone)]
pub(crate) struct PolicySummary {
    /// Policy name.
    pub(crate) name: String,
    /// Requests in the schedule.
    pub(crate) requests: usize,
    /// Completed successfully.
    pub(crate) completed: usize,
    /// Failed (first error kept).
    pub(crate) failed: usize,
    /// First error seen.
    pub(crate) first_error: Option<String>,
    /// TTFT of every request that got a first token, sorted ascending, milliseconds (the
    /// others count as infinite in percentiles).
    pub(crate) ttft_sorted_ms: Vec<f64>,
    /// Worker-reported cached prompt tokens / prompt tokens.
    pub(crate) hit_rate: f64,
    /// Oracle hit rate of the same schedule.
    pub(crate) oracle_hit_rate: f64,
    /// Completed requests per second (first arrival to last completion).
    pub(crate) req_per_s: f64,
    /// Prompt + generated tokens per second over the same span.
    pub(crate) tok_per_s: f64,
    /// Requests per worker.
    pub(crate) per_worker: Vec<usize>,
    /// Wall time of the run, seconds.
    pub(crate) wall_s: f64,
    /// Estimated fleet utilization: offered requests x their measured cost given the hits this
    /// policy got, over the fleet's capacity (NaN when unknown).
    pub(crate) est_busy: f64,
}

impl PolicySummary {
    /// Summarize outcomes. `span_s` is first arrival to last completion.
    pub(crate) fn new(
        name: &str,
        outcomes: &[Outcome],
        oracle_hit_rate: f64,
        workers: usize,
        span_s: f64,
        wall_s: f64,
    ) -> PolicySummary {
        let mut ttft: Vec<f64> = outcomes.iter().filter_map(|o| o.ttft_ms).collect();
        ttft.sort_by(f64::total_cmp);
        let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok()).collect();
        let prompt: u64 = ok.iter().map(|o| u64::from(o.prompt_tokens)).sum();
        let cached: u64 = ok.iter().map(|o| u64::from(o.cached_tokens)).sum();
        let generated: u64 = ok.iter().map(|o| u64::from(o.output_tokens)).sum();
        let mut per_worker = vec![0; workers];
        for w in outcomes.iter().filter_map(|o| o.worker) {
            if let Some(c) = per_worker.get_mut(w) {
                *c += 1;
            }
        }
        let span = span_s.max(1e-9);
        PolicySummary {
            name: name.to_owned(),
            requests: outcomes.len(),
            completed: ok.len(),
            failed: outcomes.len() - ok.len(),
            first_error: outcomes.iter().find_map(|o| o.error.clone()),
            ttft_sorted_ms: ttft,
            hit_rate: if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
            oracle_hit_rate,
            req_per_s: ok.len() as f64 / span,
            tok_per_s: (prompt + generated) as f64 / span,
            per_worker,
            wall_s,
            est_busy: f64::NAN,
        }
    }

    /// TTFT percentile (nearest rank) over every request of the schedule, milliseconds: infinite
    /// when it falls on a request that never got a token; NaN without requests.
    pub(crate) fn ttft(&self, q: f64) -> f64 {
        if self.requests == 0 {
            return f64::NAN;
        }
        self.ttft_sorted_ms.get(nearest_rank(q, self.requests) - 1).copied().unwrap_or(f64::INFINITY)
    }
}

/// Nearest-rank percentile of sorted data (`q` in 0–1); NaN when empty.
pub(crate) fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[nearest_rank(q, sorted.len()) - 1]
}

fn ms(v: f64) -> String {
    if v == f64::INFINITY {
        "unfinished".to_owned()
    } else if !v.is_finite() {
        "-".to_owned()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The results as an aligned Markdown table.
pub(crate) fn table(rows: &[PolicySummary]) -> String {
    const COLUMNS: [&str; 11] = [
        "policy",
        "done",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TTFT p99 ms",
        "prefix hit",
        "oracle hit",
        "est. busy",
        "req/s",
        "tok/s",
        "requests per worker",
    ];
    let cells: Vec<[String; 11]> = rows
        .iter()
        .map(|r| {
            [
                r.name.clone(),
                format!("{}/{}", r.completed, r.requests),
                ms(r.ttft(0.50)),
                ms(r.ttft(0.90)),
                ms(r.ttft(0.99)),
                format!("{:.1}%", r.hit_rate * 100.0),
                format!("{:.1}%", r.oracle_hit_rate * 100.0),
                if r.est_busy.is_finite() { format!("{:.0}%", r.est_busy * 100.0) } else { "-".to_owned() },
                format!("{:.2}", r.req_per_s),
                format!("{:.0}", r.tok_per_s),
                r.per_worker.iter().map(ToString::to_string).collect::<Vec<_>>().join("/"),
            ]
        })
        .collect();
    // Text columns (the policy, the per-worker counts) left-aligned, numbers right.
    markdown(&COLUMNS, &cells, &[0, COLUMNS.len() - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.9), 90.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert_eq!(percentile(&[7.0], 0.0), 7.0);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn summary_and_table() {
        let o = |w, t, p, c| Outcome {
            worker: Some(w),
            ttft_ms: Some(t),
            e2e_ms: Some(t + 10.0),
            prompt_tokens: p,
            cached_tokens: c,
            output_tokens: 5,
            error: None,
        };
        let failed = Outcome { worker: Some(1), error: Some("boom".into()), ..Default::default() };
        let s = PolicySummary::new("rr", &[o(0, 10.0, 100, 50), o(1, 30.0, 100, 0), failed], 0.6, 2, 2.0, 3.0);
        assert_eq!((s.completed, s.failed), (2, 1));
        // The failed request never got a token: it is the slowest.
        assert_eq!(s.ttft(0.5), 30.0);
        assert_eq!(s.ttft(0.34), 30.0);
        assert_eq!(s.ttft(0.33), 10.0);
        assert_eq!(s.ttft(0.9), f64::INFINITY);
        assert_eq!(s.first_error.as_deref(), Some("boom"));
        assert!((s.hit_rate - 0.25).abs() < 1e-12);
        assert_eq!(s.per_worker, vec![1, 2]);
        assert!((s.req_per_s - 1.0).abs() < 1e-12);
        assert!((s.tok_per_s - 105.0).abs() < 1e-12);
        let t = table(&[s]);
        assert!(t.contains("| rr "), "{t}");
        assert!(t.contains("25.0%") && t.contains("60.0%") && t.contains("2/3"), "{t}");
        assert!(t.contains("unfinished"), "{t}");
    }
}
