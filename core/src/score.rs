//! Per-endpoint features, filters, the weighted score and the pickers.

use std::sync::Arc;

use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::config::{PickerConfig, PolicyConfig, ScoreWeights, ScoringConfig};
use crate::endpoints::{EndpointState, MetricsSnapshot, Role};

/// Why an endpoint was filtered out of the candidates (most severe reason only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FilterReason {
    /// Fresh metrics show the queue or KV usage at a filter limit
    /// (`scoring.filters.max_waiting` / `max_kv_usage`).
    Saturated,
    /// Metrics missing or older than `metrics.staleness_ms`.
    StaleMetrics,
    /// Marked unhealthy.
    Unhealthy,
}

/// One endpoint's score breakdown in a decision (`Decision::scores[i]` belongs to
/// `Decision::endpoints[i]`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EndpointScore {
    /// Its role.
    pub role: Role,
    /// Set when a filter removed it (it may still have been used if the filter was relaxed).
    pub filtered: Option<FilterReason>,
    /// Leading prompt blocks it holds (summed over prompt sequences).
    pub matched_blocks: u32,
    /// Prompt tokens those blocks cover.
    pub cached_tokens: u64,
    /// Whether the match came from the event-fed precise index (else the approximate one).
    pub precise: bool,
    /// H: tier-weighted matched blocks / request blocks (0–1).
    pub prefix_hit: f64,
    /// LoRA affinity (0–1).
    pub lora: f64,
    /// Q̃: waiting queue / `scoring.queue_reference`, the queue being the metrics snapshot's
    /// corrected by the router's own traffic since (see `Router::update_metrics`).
    pub queue: f64,
    /// U: KV-cache usage (0–1): the snapshot's, scaled by the change in the router's count of
    /// requests there since the snapshot (see `Router::update_metrics`).
    pub kv_usage: f64,
    /// 1 when the request's session last went here.
    pub session: f64,
    /// F̃: router-side in-flight requests / `scoring.inflight_reference`.
    pub inflight: f64,
    /// The weighted total.
    pub total: f64,
}

impl EndpointScore {
    /// A placeholder that is never picked.
    pub(crate) fn unavailable() -> Self {
        EndpointScore {
            role: Role::Prefill,
            filtered: Some(FilterReason::Unhealthy),
            matched_blocks: 0,
            cached_tokens: 0,
            precise: false,
            prefix_hit: 0.0,
            lora: 0.0,
            queue: 0.0,
            kv_usage: 0.0,
            session: 0.0,
            inflight: 0.0,
            total: f64::NEG_INFINITY,
        }
    }
}

/// What one endpoint's score takes from the index match and the request.
pub(crate) struct FeatureInputs {
    pub matched_blocks: u32,
    /// Prompt tokens those blocks cover.
    pub cached_tokens: u64,
    /// Whether the match came from the precise index.
    pub precise: bool,
    /// The matched blocks weighted by the tier each is held in.
    pub weighted_blocks: f64,
    /// `1 / request blocks` (0 when the request has no full block).
    pub hit_per_block: f64,
    pub session_here: bool,
}

/// Scores endpoints for one decision: the policy's parameters read once (a decision scores
/// every endpoint, hundreds of them in a large fleet), each endpoint then in one inlined pass
/// that also gives its saturation. The arithmetic is the score's definition (README, "The
/// score") operation for operation, so the results are the same bits whatever the code's shape;
/// a property test checks it against a reference written from the definition.
pub(crate) struct Scorer<'a> {
    cfg: &'a PolicyConfig,
    weights: ScoreWeights,
    queue_reference: f64,
    inflight_reference: f64,
    staleness_ms: u64,
    exclude_stale: bool,
    /// A filter limit is set (`max_waiting` or `max_kv_usage`).
    limits: bool,
    lora_adapter: Option<&'a str>,
    now_ms: u64,
}

impl<'a> Scorer<'a> {
    pub(crate) fn new(cfg: &'a PolicyConfig, lora_adapter: Option<&'a str>, now_ms: u64) -> Self {
        let s = &cfg.scoring;
        Scorer {
            cfg,
            weights: s.weights.clone(),
            queue_reference: s.queue_reference,
            inflight_reference: s.inflight_reference,
            staleness_ms: cfg.metrics.staleness_ms,
            exclude_stale: s.filters.exclude_stale,
            limits: s.filters.max_waiting.is_some() || s.filters.max_kv_usage.is_some(),
            lora_adapter,
            now_ms,
        }
    }

    /// `ep`'s score breakdown, and whether its metrics are fresh.
    #[inline(always)]
    pub(crate) fn score(&self, ep: &EndpointState, f: &FeatureInputs) -> (EndpointScore, bool) {
        let fresh = self.fresh(ep);
        let prefix_hit = (f.weighted_blocks * f.hit_per_block).min(1.0);
        let (queue, kv_usage, lora) = match &ep.metrics {
            Some(m) => {
                let lora = match self.lora_adapter {
                    None => 0.0,
                    Some(a) => lora_affinity(&self.cfg.scoring, m, a),
                };
                (f64::from(ep.load.waiting_now()) / self.queue_reference, ep.load.kv_usage_now(), lora)
            }
            None => (0.0, 0.0, 0.0),
        };
        let session = if f.session_here { 1.0 } else { 0.0 };
        let inflight = f64::from(ep.load.inflight()) / self.inflight_reference;
        let w = &self.weights;
        let total = w.prefix * prefix_hit + w.lora * lora + w.session * session
            - w.queue * queue
            - w.kv_usage * kv_usage
            - w.inflight * inflight;
        let filtered = if !ep.healthy {
            Some(FilterReason::Unhealthy)
        } else if !fresh && self.exclude_stale {
            Some(FilterReason::StaleMetrics)
        } else if fresh && self.limits && overloaded(self.cfg, ep) {
            Some(FilterReason::Saturated)
        } else {
            None
        };
        let score = EndpointScore {
            role: ep.role,
            filtered,
            matched_blocks: f.matched_blocks,
            cached_tokens: f.cached_tokens,
            precise: f.precise,
            prefix_hit,
            lora,
            queue,
            kv_usage,
            session,
            inflight,
            total,
        };
        (score, fresh)
    }

    /// Whether `ep`'s metrics are no older than `metrics.staleness_ms`.
    #[inline(always)]
    pub(crate) fn fresh(&self, ep: &EndpointState) -> bool {
        ep.metrics.as_ref().is_some_and(|m| self.now_ms.saturating_sub(m.updated_ms) <= self.staleness_ms)
    }

    /// Saturation of one endpoint (the pool's saturation is the mean over healthy decode-capable
    /// endpoints): `max(waiting / queue_threshold, kv_usage / kv_threshold)`, or 1.0 when its
    /// metrics are stale or missing (an endpoint we cannot see is assumed full). `fresh` is
    /// [`Scorer::fresh`] of `ep`.
    #[inline(always)]
    pub(crate) fn saturation(&self, ep: &EndpointState, fresh: bool) -> f64 {
        match &ep.metrics {
            Some(m) if fresh => {
                let a = &self.cfg.admission;
                (f64::from(m.waiting) / a.queue_threshold).max(m.kv_usage / a.kv_threshold)
            }
            _ => 1.0,
        }
    }
}

/// The LoRA affinity of an endpoint with metrics `m` for adapter `a` (out of line: most
/// requests name no adapter).
#[inline(never)]
fn lora_affinity(s: &ScoringConfig, m: &MetricsSnapshot, a: &str) -> f64 {
    if m.lora_running.iter().any(|x| x == a) {
        s.lora_affinity.running
    } else if m.lora_waiting.iter().any(|x| x == a) {
        s.lora_affinity.waiting
    } else if m.max_lora.is_some_and(|max| (m.lora_running.len() as u64) < u64::from(max)) {
        s.lora_affinity.room
    } else {
        0.0
    }
}

fn overloaded(cfg: &PolicyConfig, ep: &EndpointState) -> bool {
    let f = &cfg.scoring.filters;
    ep.metrics.as_ref().is_some_and(|m| {
        f.max_waiting.is_some_and(|w| f64::from(m.waiting) >= w) || f.max_kv_usage.is_some_and(|k| m.kv_usage >= k)
    })
}

/// Candidates of a pool (indices into `scores`), relaxing filters when none pass: first
/// saturation, then staleness; health never. Returns whether a filter was relaxed.
pub(crate) fn candidates(scores: &[EndpointScore], in_pool: impl Fn(Role) -> bool, out: &mut Vec<usize>) -> bool {
    const LEVELS: [Option<FilterReason>; 3] = [None, Some(FilterReason::Saturated), Some(FilterReason::StaleMetrics)];
    for (level, max) in LEVELS.iter().enumerate() {
        out.clear();
        out.extend(
            scores
                .iter()
                .enumerate()
                .filter(|(_, s)| in_pool(s.role) && s.filtered <= *max && s.filtered != Some(FilterReason::Unhealthy))
                .map(|(i, _)| i),
        );
        if !out.is_empty() {
            return level > 0;
        }
    }
    false
}

/// Pick one candidate. `draw` is the router's decision counter (advances the weighted-random
/// generator deterministically). `last_assigned(i)` is when the router last sent a request to
/// endpoint `i` (`None`: never); it breaks ties of the max-score picker (asked only on a tie).
pub(crate) fn pick(
    picker: &PickerConfig,
    ids: &[Arc<str>],
    scores: &[EndpointScore],
    cands: &[usize],
    anchor: u64,
    draw: u64,
    last_assigned: impl Fn(usize) -> Option<u64>,
) -> Option<usize> {
    match picker {
        PickerConfig::MaxScore => max_score(ids, scores, cands, anchor, last_assigned),
        PickerConfig::WeightedRandom { seed, temperature } => {
            let max = cands.iter().map(|&i| scores[i].total).fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = cands.iter().map(|&i| ((scores[i].total - max) / temperature).exp()).collect();
            let sum: f64 = weights.iter().sum();
            if !(sum.is_finite() && sum > 0.0) {
                return max_score(ids, scores, cands, anchor, last_assigned);
            }
            let u = unit_f64(splitmix64(seed ^ draw.wrapping_mul(0x9E37_79B9_7F4A_7C15))) * sum;
            let mut acc = 0.0;
            for (k, w) in weights.iter().enumerate() {
                acc += w;
                if u < acc {
                    return Some(cands[k]);
                }
            }
            cands.last().copied()
        }
    }
}

const TIE_EPSILON: f64 = 1e-9;

fn max_score(
    ids: &[Arc<str>],
    scores: &[EndpointScore],
    cands: &[usize],
    anchor: u64,
    last_assigned: impl Fn(usize) -> Option<u64>,
) -> Option<usize> {
    let mut walk = MaxScoreWalk::default();
    let tb = Tiebreak { ids, anchor, last_assigned };
    for &i in cands {
        walk.offer(i, scores[i].total, &tb);
    }
    walk.best()
}

/// What breaks a tie between candidates: their ids (`ids[i]`), the request's anchor (the
/// rendezvous hash's seed) and when each was last assigned (`None`: never).
pub(crate) struct Tiebreak<'a, F> {
    pub ids: &'a [Arc<str>],
    pub anchor: u64,
    pub last_assigned: F,
}

/// The max-score picker, offered the candidates one by one in candidate order (so a decision
/// can pick while it scores): the highest total; within [`TIE_EPSILON`] of it, the least
/// recently assigned endpoint (`None`, never, is the least), then the highest rendezvous hash
/// of (request anchor, endpoint id).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct MaxScoreWalk {
    /// (index, its total, its rendezvous hash once a tie needed it)
    best: Option<(usize, f64, Option<u64>)>,
}

impl MaxScoreWalk {
    /// Offer candidate `i` with score total `total`.
    #[inline(always)]
    pub(crate) fn offer<F: Fn(usize) -> Option<u64>>(&mut self, i: usize, total: f64, tb: &Tiebreak<'_, F>) {
        match self.best {
            None => self.best = Some((i, total, None)),
            Some((_, best_total, _)) if total - best_total > TIE_EPSILON => self.best = Some((i, total, None)),
            Some((_, best_total, _)) if (total - best_total).abs() <= TIE_EPSILON => self.tie(i, total, tb),
            Some(_) => {}
        }
    }

    /// Candidate `i` ties with the best so far.
    #[cold]
    fn tie<F: Fn(usize) -> Option<u64>>(&mut self, i: usize, total: f64, tb: &Tiebreak<'_, F>) {
        let Some((b, best_total, b_hash)) = self.best else { return };
        let rendezvous = |i: usize| tb.ids.get(i).map_or(0, |id| xxh3_64_with_seed(id.as_bytes(), tb.anchor));
        match (tb.last_assigned)(i).cmp(&(tb.last_assigned)(b)) {
            std::cmp::Ordering::Less => self.best = Some((i, total, None)),
            std::cmp::Ordering::Greater => {}
            std::cmp::Ordering::Equal => {
                let bh = b_hash.unwrap_or_else(|| rendezvous(b));
                let r = rendezvous(i);
                self.best = Some(if r > bh { (i, total, Some(r)) } else { (b, best_total, Some(bh)) });
            }
        }
    }

    /// The candidate picked (`None`: none offered).
    pub(crate) fn best(&self) -> Option<usize> {
        self.best.map(|(i, _, _)| i)
    }
}

pub(crate) fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

pub(crate) fn unit_f64(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: &[&str]) -> Vec<Arc<str>> {
        n.iter().map(|s| Arc::from(*s)).collect()
    }

    fn s(_id: &str, total: f64) -> EndpointScore {
        EndpointScore { role: Role::Decode, filtered: None, total, ..EndpointScore::unavailable() }
    }

    /// The score of one endpoint as the README defines it, written as a specification (the
    /// reference the decision's [`Scorer`] is checked against, bit for bit): the terms in the
    /// order the README sums them, the filters as a table of their conditions.
    fn reference_score(
        cfg: &PolicyConfig,
        ep: &EndpointState,
        f: &FeatureInputs,
        lora_adapter: Option<&str>,
        now_ms: u64,
    ) -> (EndpointScore, bool) {
        let s = &cfg.scoring;
        let fresh =
            ep.metrics.as_ref().is_some_and(|m| now_ms.saturating_sub(m.updated_ms) <= cfg.metrics.staleness_ms);
        // H: capped tier-weighted hit.
        let h = (f.weighted_blocks * f.hit_per_block).min(1.0);
        // L: the first affinity that applies (running, waiting, room to load), else 0.
        let l = ep.metrics.as_ref().zip(lora_adapter).map_or(0.0, |(m, a)| {
            let has = |list: &[String]| list.iter().any(|x| x == a);
            let room = m.max_lora.is_some_and(|max| (m.lora_running.len() as u64) < u64::from(max));
            [
                (has(&m.lora_running), s.lora_affinity.running),
                (has(&m.lora_waiting), s.lora_affinity.waiting),
                (room, s.lora_affinity.room),
            ]
            .into_iter()
            .find_map(|(applies, v)| applies.then_some(v))
            .unwrap_or(0.0)
        });
        // Q̃ and U from the corrected load (0 without metrics), F̃ from the requests in flight.
        let q = if ep.metrics.is_some() { f64::from(ep.load.waiting_now()) / s.queue_reference } else { 0.0 };
        let u = if ep.metrics.is_some() { ep.load.kv_usage_now() } else { 0.0 };
        let sess = f64::from(u8::from(f.session_here));
        let fl = f64::from(ep.load.inflight()) / s.inflight_reference;
        let w = &s.weights;
        let terms = [
            (w.lora, l, 1.0),
            (w.session, sess, 1.0),
            (w.queue, q, -1.0),
            (w.kv_usage, u, -1.0),
            (w.inflight, fl, -1.0),
        ];
        let total =
            terms.iter().fold(w.prefix * h, |acc, &(wt, v, sign)| if sign > 0.0 { acc + wt * v } else { acc - wt * v });
        let limits = &s.filters;
        let over = ep.metrics.as_ref().is_some_and(|m| {
            limits.max_waiting.is_some_and(|x| f64::from(m.waiting) >= x)
                || limits.max_kv_usage.is_some_and(|x| m.kv_usage >= x)
        });
        let filtered = [
            (!ep.healthy, FilterReason::Unhealthy),
            (!fresh && limits.exclude_stale, FilterReason::StaleMetrics),
            (fresh && over, FilterReason::Saturated),
        ]
        .into_iter()
        .find_map(|(applies, why)| applies.then_some(why));
        let score = EndpointScore {
            total,
            inflight: fl,
            session: sess,
            kv_usage: u,
            queue: q,
            lora: l,
            prefix_hit: h,
            precise: f.precise,
            cached_tokens: f.cached_tokens,
            matched_blocks: f.matched_blocks,
            filtered,
            role: ep.role,
        };
        (score, fresh)
    }

    /// An endpoint for the scorer's property test: `sent` requests sent since its snapshot.
    #[allow(clippy::too_many_arguments)]
    fn endpoint(
        role: Role,
        healthy: bool,
        metrics: Option<(u32, u32, f64, u64, Option<u32>)>,
        lora: (bool, bool),
        sent: u32,
        inflight: u32,
    ) -> EndpointState {
        let mut ep = EndpointState {
            id: Arc::from("10.0.0.1:8000"),
            role,
            healthy,
            metrics: None,
            load: crate::endpoints::Load::default(),
            kv_per_request: 0.0,
            incarnation: 1,
        };
        if let Some((waiting, running, kv_usage, updated_ms, max_lora)) = metrics {
            ep.set_metrics(MetricsSnapshot {
                waiting,
                running,
                kv_usage,
                lora_running: if lora.0 { vec!["a".into()] } else { Vec::new() },
                lora_waiting: if lora.1 { vec!["b".into()] } else { Vec::new() },
                max_lora,
                kv_capacity_tokens: None,
                updated_ms,
            });
        }
        for _ in 0..sent {
            ep.sent();
        }
        ep.load.set_requests(inflight);
        ep
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]

        /// The decision's scorer gives exactly (bit for bit) what the plain per-endpoint formula
        /// gives, for every role, health, metrics state, filter and LoRA case.
        #[test]
        fn scorer_matches_the_reference_formula(
            role in proptest::sample::select(vec![Role::Decode, Role::Prefill, Role::Both]),
            healthy: bool,
            metrics in proptest::option::of((0u32..40, 0u32..20, 0.0f64..=1.0, 0u64..3_000, proptest::option::of(0u32..4))),
            lora: (bool, bool),
            sent in 0u32..5,
            inflight in 0u32..50,
            weights in proptest::array::uniform6(0.0f64..3.0),
            refs in (0.5f64..64.0, 0.5f64..64.0, 0.1f64..64.0, 0.05f64..=1.0),
            filters in (proptest::bool::ANY, proptest::option::of(1.0f64..30.0), proptest::option::of(0.1f64..=1.0)),
            staleness_ms in 0u64..2_000,
            now_ms in 0u64..4_000,
            adapter in proptest::sample::select(vec![None, Some("a"), Some("b"), Some("c")]),
            matched_blocks in 0u32..200,
            weighted in 0.0f64..200.0,
            hit_per_block in proptest::sample::select(vec![0.0, 1.0 / 128.0, 1.0 / 3.0, 1.0]),
            session_here: bool,
            precise: bool,
        ) {
            let mut cfg = PolicyConfig::default();
            let s = &mut cfg.scoring;
            let [prefix, lora_w, queue, kv_usage, session, inflight_w] = weights;
            s.weights = ScoreWeights { prefix, lora: lora_w, queue, kv_usage, session, inflight: inflight_w };
            (s.queue_reference, s.inflight_reference) = (refs.0, refs.1);
            (s.filters.exclude_stale, s.filters.max_waiting, s.filters.max_kv_usage) = filters;
            (cfg.admission.queue_threshold, cfg.admission.kv_threshold) = (refs.2, refs.3);
            cfg.metrics.staleness_ms = staleness_ms;
            let ep = endpoint(role, healthy, metrics, lora, sent, inflight);
            let f = FeatureInputs {
                matched_blocks,
                cached_tokens: u64::from(matched_blocks) * 16,
                precise,
                weighted_blocks: weighted,
                hit_per_block,
                session_here,
            };
            let scorer = Scorer::new(&cfg, adapter, now_ms);
            let (got, fresh) = scorer.score(&ep, &f);
            let (want, want_fresh) = reference_score(&cfg, &ep, &f, adapter, now_ms);
            proptest::prop_assert_eq!(format!("{got:?}"), format!("{want:?}"));
            proptest::prop_assert_eq!(fresh, want_fresh);
        }
    }

    /// The max-score picker as one loop over the candidates (the reference for
    /// [`MaxScoreWalk`]), on plain arrays: `totals[i]`, `last[i]` (last assignment), `names[i]`.
    fn max_score_reference(
        names: &[String],
        totals: &[f64],
        last: &[Option<u64>],
        cands: &[usize],
        anchor: u64,
    ) -> Option<usize> {
        let hash = |i: usize| xxh3_64_with_seed(names[i].as_bytes(), anchor);
        let (&first, rest) = cands.split_first()?;
        let (mut best, mut best_hash) = (first, None::<u64>);
        for &i in rest {
            let d = totals[i] - totals[best];
            if d > TIE_EPSILON {
                (best, best_hash) = (i, None);
                continue;
            }
            if d.abs() > TIE_EPSILON || last[i] > last[best] {
                continue;
            }
            if last[i] < last[best] {
                (best, best_hash) = (i, None);
                continue;
            }
            let b = *best_hash.get_or_insert_with(|| hash(best));
            let r = hash(i);
            if r > b {
                (best, best_hash) = (i, Some(r));
            }
        }
        Some(best)
    }

    proptest::proptest! {
        /// The walk picks what the plain loop picks, with many exact and near ties (totals a
        /// few epsilons apart) and repeated assignment times.
        #[test]
        fn max_score_walk_matches_the_reference(
            totals in proptest::collection::vec(0u8..6, 1..40),
            nudges in proptest::collection::vec(0u8..3, 40),
            assigned in proptest::collection::vec(proptest::option::of(0u64..3), 40),
            cands in proptest::collection::vec(0usize..40, 0..40),
            anchor: u64,
        ) {
            let n = totals.len();
            let names: Vec<String> = (0..n).map(|i| format!("10.0.0.{i}:8000")).collect();
            let id = ids(&names.iter().map(String::as_str).collect::<Vec<_>>());
            let scores: Vec<EndpointScore> = totals
                .iter()
                .zip(&nudges)
                .map(|(&t, &e)| s("", f64::from(t) * 0.25 + f64::from(e) * TIE_EPSILON * 0.75))
                .collect();
            let cands: Vec<usize> = cands.into_iter().filter(|&i| i < n).collect();
            let totals: Vec<f64> = scores.iter().map(|s| s.total).collect();
            proptest::prop_assert_eq!(
                max_score(&id, &scores, &cands, anchor, |i| assigned[i]),
                max_score_reference(&names, &totals, &assigned, &cands, anchor)
            );
        }
    }

    #[test]
    fn max_score_and_rendezvous_ties() {
        let scores = vec![s("a:1", 0.5), s("b:1", 0.7), s("c:1", 0.7)];
        let id = ids(&["a:1", "b:1", "c:1"]);
        let p = PickerConfig::MaxScore;
        let winner = pick(&p, &id, &scores, &[0, 1, 2], 42, 0, |_| None).unwrap();
        assert!(winner == 1 || winner == 2);
        assert_eq!(pick(&p, &id, &scores, &[0, 1, 2], 42, 5, |_| None), Some(winner), "deterministic");
        assert_eq!(pick(&p, &id, &scores, &[2, 1, 0], 42, 0, |_| None), Some(winner), "independent of order");
        // Different anchors spread ties over both.
        let picks: std::collections::BTreeSet<usize> =
            (0..64).map(|a| pick(&p, &id, &scores, &[0, 1, 2], a, 0, |_| None).unwrap()).collect();
        assert_eq!(picks, [1, 2].into_iter().collect());
        assert_eq!(pick(&p, &id, &scores, &[], 1, 0, |_| None), None);
    }

    #[test]
    fn ties_go_to_the_least_recently_assigned_endpoint_first() {
        let id = ids(&["a:1", "b:1", "c:1"]);
        let p = PickerConfig::MaxScore;
        let mut scores = vec![s("a:1", 0.7), s("b:1", 0.7), s("c:1", 0.7)];
        let mut at = [Some(5), Some(3), Some(9)];
        for anchor in 0..64 {
            assert_eq!(pick(&p, &id, &scores, &[0, 1, 2], anchor, 0, |i| at[i]), Some(1), "least recent wins ties");
            assert_eq!(pick(&p, &id, &scores, &[2, 0, 1], anchor, 0, |i| at[i]), Some(1), "independent of order");
        }
        at[2] = None;
        assert_eq!(pick(&p, &id, &scores, &[0, 1, 2], 1, 0, |i| at[i]), Some(2), "never assigned is least recent");
        scores[0].total = 0.8;
        assert_eq!(pick(&p, &id, &scores, &[0, 1, 2], 1, 0, |i| at[i]), Some(0), "only ties look at recency");
    }

    #[test]
    fn weighted_random_follows_softmax() {
        let scores = vec![s("a:1", 1.0), s("b:1", 0.0)];
        let id = ids(&["a:1", "b:1"]);
        let p = PickerConfig::WeightedRandom { seed: 9, temperature: 0.5 };
        let n = 20_000;
        let a = (0..n).filter(|&d| pick(&p, &id, &scores, &[0, 1], 0, d, |_| None) == Some(0)).count();
        let expect = 1.0 / (1.0 + (-2.0f64).exp());
        let got = a as f64 / n as f64;
        assert!((got - expect).abs() < 0.02, "{got} vs {expect}");
        let seq1: Vec<_> = (0..50).map(|d| pick(&p, &id, &scores, &[0, 1], 0, d, |_| None)).collect();
        let seq2: Vec<_> = (0..50).map(|d| pick(&p, &id, &scores, &[0, 1], 0, d, |_| None)).collect();
        assert_eq!(seq1, seq2, "seeded: same sequence");
    }

    #[test]
    fn relaxation_order() {
        let mut v = vec![s("a:1", 0.0), s("b:1", 0.0), s("c:1", 0.0)];
        v[0].filtered = Some(FilterReason::Unhealthy);
        v[1].filtered = Some(FilterReason::StaleMetrics);
        v[2].filtered = Some(FilterReason::Saturated);
        let mut out = Vec::new();
        assert!(candidates(&v, |_| true, &mut out));
        assert_eq!(out, vec![2]);
        v[2].filtered = Some(FilterReason::Unhealthy);
        assert!(candidates(&v, |_| true, &mut out));
        assert_eq!(out, vec![1]);
        v[1].filtered = Some(FilterReason::Unhealthy);
        candidates(&v, |_| true, &mut out);
        assert!(out.is_empty(), "unhealthy is never relaxed");
    }
}
