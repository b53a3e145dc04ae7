//! Flow-control metrics: the enqueue-to-dispatch duration histogram by fairness id, priority and
//! outcome, with the fairness-id label's cardinality bounded.
//!
//! Fairness ids come from request headers, so they are unbounded: only the first
//! `flow_control.metrics_fairness_ids` ids to reach [`LABEL_MIN_REQUESTS`] requests get their own
//! label (counted in a bounded table of candidates whose counts are halved whenever it fills, so
//! a steady tenant gets there and a flood of one-off ids does not); a label once given is never
//! taken back, so every series only grows. Every other id is `other`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use xxhash_rust::xxh3::Xxh3DefaultBuilder;

use super::DropReason;
use crate::metrics::Exposition;

/// Requests an id needs (as counted by the candidate table) before it gets its own label.
pub const LABEL_MIN_REQUESTS: u64 = 10;

/// Upper bounds of the duration histogram, seconds.
pub(crate) const DURATION_BUCKETS_S: [f64; 14] =
    [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// How a request's time in flow control ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Outcome {
    Dispatched,
    Dropped(DropReason),
    Cancelled,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Dispatched => "dispatched",
            Outcome::Dropped(r) => r.as_str(),
            Outcome::Cancelled => "cancelled",
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Histogram {
    /// Non-cumulative counts per bucket; the last is `+Inf`.
    buckets: [u64; DURATION_BUCKETS_S.len() + 1],
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        let i = DURATION_BUCKETS_S.iter().position(|&b| seconds <= b).unwrap_or(DURATION_BUCKETS_S.len());
        self.buckets[i] += 1;
        self.sum += seconds;
        self.count += 1;
    }
}

/// The label table and the histograms.
#[derive(Debug)]
pub(crate) struct FlowMetrics {
    max_labels: usize,
    /// Label names; index 0 is `other`.
    labels: Vec<Arc<str>>,
    label_of: HashMap<Arc<str>, u32, Xxh3DefaultBuilder>,
    /// Candidates (ids without a label yet) and their decayed counts.
    candidates: HashMap<Arc<str>, u64, Xxh3DefaultBuilder>,
    /// (label, priority, outcome) → histogram.
    hists: BTreeMap<(u32, i32, Outcome), Histogram>,
}

impl FlowMetrics {
    pub fn new(max_labels: usize) -> Self {
        FlowMetrics {
            max_labels,
            labels: vec![Arc::from("other")],
            label_of: HashMap::with_hasher(Xxh3DefaultBuilder),
            candidates: HashMap::with_hasher(Xxh3DefaultBuilder),
            hists: BTreeMap::new(),
        }
    }

    /// A reload may change the number of labels: more can be given from now on; fewer give no
    /// new ones (labels given stay).
    pub fn set_max_labels(&mut self, n: usize) {
        self.max_labels = n;
    }

    fn candidate_capacity(&self) -> usize {
        (4 * self.max_labels).max(64)
    }

    /// The label of `id` for one more request (counting it towards a label of its own).
    fn label(&mut self, id: &str) -> u32 {
        if let Some(&l) = self.label_of.get(id) {
            return l;
        }
        if self.labels.len() > self.max_labels {
            return 0;
        }
        let count = match self.candidates.get_mut(id) {
            Some(c) => {
                *c += 1;
                *c
            }
            None => {
                if self.candidates.len() >= self.candidate_capacity() {
                    self.decay_candidates();
                }
                self.candidates.insert(Arc::from(id), 1);
                1
            }
        };
        if count >= LABEL_MIN_REQUESTS {
            self.candidates.remove(id);
            let l = self.labels.len() as u32;
            let name: Arc<str> = Arc::from(id);
            self.labels.push(name.clone());
            self.label_of.insert(name, l);
            return l;
        }
        0
    }

    /// The candidate table is full: halve every count, dropping those that reach 0, until it is
    /// at most half full. Counts only ever go down, so a flood of one-off ids cannot make an id
    /// look frequent; an id seen steadily keeps its count. O(1) amortized per new id.
    fn decay_candidates(&mut self) {
        let half = self.candidate_capacity() / 2;
        while self.candidates.len() > half {
            self.candidates.retain(|_, c| {
                *c /= 2;
                *c > 0
            });
        }
    }

    /// Record a request that spent `waited_ms` in flow control (0 when admitted or rejected at
    /// once) and ended with `outcome`.
    pub fn observe(&mut self, fairness_id: &str, priority: i32, outcome: Outcome, waited_ms: u64) {
        let l = self.label(fairness_id);
        self.hists.entry((l, priority, outcome)).or_default().observe(waited_ms as f64 / 1000.0);
    }

    /// Fairness ids with a label of their own.
    #[cfg(test)]
    pub fn labelled(&self) -> usize {
        self.labels.len() - 1
    }

    /// Write the histogram.
    pub fn expose(&self, e: &mut Exposition) {
        let name = "kvroute_flow_queue_duration_seconds";
        e.header(
            name,
            "histogram",
            "Time from flow-control admission to dispatch or drop, by fairness id (bounded: other), priority and outcome.",
        );
        let mut rows: Vec<(&str, String, &str, &Histogram)> = self
            .hists
            .iter()
            .map(|(&(l, p, o), h)| {
                (self.labels.get(l as usize).map_or("other", |s| &**s), p.to_string(), o.as_str(), h)
            })
            .collect();
        rows.sort_by(|a, b| (a.0, &a.1, a.2).cmp(&(b.0, &b.1, b.2)));
        for (id, prio, outcome, h) in rows {
            let mut acc = 0;
            for (i, b) in DURATION_BUCKETS_S.iter().enumerate() {
                acc += h.buckets[i];
                let le = b.to_string();
                let labels =
                    [("fairness_id", id), ("priority", prio.as_str()), ("outcome", outcome), ("le", le.as_str())];
                e.sample(&format!("{name}_bucket"), &labels, acc as f64);
            }
            let labels = [("fairness_id", id), ("priority", prio.as_str()), ("outcome", outcome), ("le", "+Inf")];
            e.sample(&format!("{name}_bucket"), &labels, h.count as f64);
            let labels = [("fairness_id", id), ("priority", prio.as_str()), ("outcome", outcome)];
            e.sample(&format!("{name}_sum"), &labels, h.sum);
            e.sample(&format!("{name}_count"), &labels, h.count as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_bounded_and_frequent_ids_get_them() {
        let mut m = FlowMetrics::new(2);
        // A thousand one-off ids never get a label.
        for i in 0..1000 {
            m.observe(&format!("once-{i}"), 0, Outcome::Dispatched, 5);
        }
        assert_eq!(m.labelled(), 0);
        // Two steady tenants do, a third frequent one finds the table full.
        for _ in 0..LABEL_MIN_REQUESTS + 5 {
            m.observe("a", 0, Outcome::Dispatched, 5);
            m.observe("b", 0, Outcome::Dispatched, 1500);
        }
        for _ in 0..50 {
            m.observe("c", -1, Outcome::Dropped(DropReason::RejectedTtlExpired), 30_000);
        }
        assert_eq!(m.labelled(), 2);
        let mut e = Exposition::new();
        m.expose(&mut e);
        let page = e.finish();
        assert!(page.contains(r#"fairness_id="a",priority="0",outcome="dispatched",le="0.005"} 6"#), "{page}");
        assert!(!page.contains(r#"kvroute_flow_queue_duration_seconds_count{fairness_id="c""#));
        assert!(
            page.contains(r#"fairness_id="other",priority="-1",outcome="rejected-ttl-expired",le="+Inf"} 50"#),
            "{page}"
        );
        let series: std::collections::BTreeSet<&str> =
            page.lines().filter_map(|l| l.split("fairness_id=\"").nth(1)?.split('"').next()).collect();
        assert_eq!(series, ["a", "b", "other"].into());
    }
}
