//! The noisy-neighbor scenario in the simulator (virtual time, seeded): the structural
//! properties flow control must show, asserted deterministically.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_sim::noisy::sim::{run, run_all, SimScenario, DEFAULT_SHAPE};
use kvroute_sim::noisy::{
    self, End, RunRecords, RunSpec, RunSummary, A, B, BURST_EQUAL, BURST_OFF, BURST_ON, NO_BURST_OFF, NO_BURST_ON, RUNS,
};
use kvroute_sim::ClusterConfig;

fn scenario(seed: u64) -> SimScenario {
    SimScenario::new(ClusterConfig { endpoints: 4, ..Default::default() }, DEFAULT_SHAPE, 30.0, seed)
}

fn summaries(s: &SimScenario, runs: &[RunRecords]) -> Vec<RunSummary> {
    runs.iter().map(|r| RunSummary::new(&s.scenario, r)).collect()
}

#[test]
fn noisy_neighbor_flow_control_protects_the_interactive_tenant() {
    let s = scenario(7);
    let runs = run_all(&s, &mut |_| {}).unwrap();
    assert_eq!(runs.len(), RUNS.len());
    let all = noisy::schedule(&s.scenario);
    // Deterministic: the same settings give the same records and dispatches.
    let again = run(&s, &all, &BURST_ON).unwrap();
    let first = runs.iter().find(|r| r.spec == BURST_ON).unwrap();
    assert_eq!((&first.records, &first.dispatches, &first.flow), (&again.records, &again.dispatches, &again.flow));
    for r in &runs {
        // Every request of the run ended exactly once, none left hanging.
        assert_eq!(r.records.len(), noisy::arrivals_of(&all, &r.spec).len(), "{}", r.spec.name);
        for rec in &r.records {
            assert_eq!(rec.ends, 1, "{}: {rec:?}", r.spec.name);
            assert!(
                !matches!(rec.end, End::Unfinished | End::Failed { .. } | End::Cancelled),
                "{}: {rec:?}",
                r.spec.name
            );
        }
        assert!(r.notes.is_empty(), "{}: {:?}", r.spec.name, r.notes);
        // The core's counters agree with what the loop saw.
        match &r.flow {
            Some(c) => {
                let requests = r.records.len() as u64;
                let at_admission =
                    r.records.iter().filter(|x| matches!(x.end, End::Rejected { queued: false, .. })).count();
                assert_eq!(c.admitted + c.enqueued + at_admission as u64, requests, "{}: {c:?}", r.spec.name);
                let queued = r.records.iter().filter(|x| x.queued_ms.is_some()).count() as u64;
                assert_eq!(c.enqueued, queued, "{}", r.spec.name);
                let dropped = r.records.iter().filter(|x| matches!(x.end, End::Rejected { queued: true, .. })).count();
                assert_eq!(c.dispatched + dropped as u64 + c.cancelled, c.enqueued, "{}: {c:?}", r.spec.name);
                assert_eq!(c.cancelled, 0);
            }
            None => {
                assert!(!r.spec.flow_control);
                assert!(r.records.iter().all(|x| x.queued_ms.is_none()), "nothing waits without flow control");
            }
        }
    }
    let sum = summaries(&s, &runs);
    let by = |spec: &RunSpec| sum.iter().find(|r| r.spec == *spec).unwrap();
    let (quiet, quiet_on, off, on, equal) =
        (by(&NO_BURST_OFF), by(&NO_BURST_ON), by(&BURST_OFF), by(&BURST_ON), by(&BURST_EQUAL));
    for r in &sum {
        assert_eq!(r.inconsistent_ends, 0);
        assert_eq!(r.violations, 0, "{}: a request was refused while a sheddable one was queued", r.spec.name);
        // B's requests are the same in every run, and every one of them is served.
        assert_eq!(r.tenant(B).requests, quiet.tenant(B).requests);
        assert_eq!(r.tenant(B).completed, r.tenant(B).requests, "{}", r.spec.name);
    }
    // The burst saturates the pool: without flow control B's TTFT p90 during the burst is over
    // twice its no-burst value (several-fold in the model), and routing sheds part of A.
    let (b_quiet, b_off, b_on) =
        (quiet.tenant(B).burst_ttft_p90_ms, off.tenant(B).burst_ttft_p90_ms, on.tenant(B).burst_ttft_p90_ms);
    assert!(b_off > 2.0 * b_quiet, "off {b_off} vs no burst {b_quiet}");
    assert!(off.tenant(A).reasons.get("shed-by-routing").copied().unwrap_or(0) > 0, "{:?}", off.tenant(A));
    // With flow control B's p90 is less than half of what it is without (a structural margin: the
    // model gives about a third), and B is never refused, while A was held in the queue.
    assert!(b_on < b_off / 2.0, "on {b_on} vs off {b_off}");
    // Without the burst flow control changes little for B: the pool is not saturated.
    let b_quiet_on = quiet_on.tenant(B).burst_ttft_p90_ms;
    assert!(b_quiet_on < 1.5 * b_quiet && b_quiet < 1.5 * b_quiet_on, "{b_quiet_on} vs {b_quiet}");
    assert_eq!(on.tenant(B).shed + on.tenant(B).dropped, 0);
    assert!(on.tenant(A).queued > 0, "the sheddable tenant was held back: {:?}", on.tenant(A));
    assert!(on.tenant(B).queued * 100 <= on.tenant(B).requests, "B seldom waits: {:?}", on.tenant(B));
    // Two equal-priority tenants, one bursting: each at least 40% of the dispatches while
    // saturated (round robin between the two flows), and half of those made while both waited.
    assert!(equal.saturated_dispatches > 500, "{}", equal.saturated_dispatches);
    for t in [A, B] {
        assert!(equal.saturated_share[t] >= 0.4, "{:?}", equal.saturated_share);
        assert!((equal.contended_share[t] - 0.5).abs() < 0.05, "{:?}", equal.contended_share);
    }
    assert_eq!(equal.tenant(A).shed + equal.tenant(A).dropped, 0, "priority 0 is not sheddable");
    // The targets, judged on the same numbers.
    let targets = noisy::targets(&sum);
    assert_eq!(targets.len(), 5);
    assert!(targets[1].measured.ends_with(": saturated"), "{targets:?}");
    assert_eq!(targets[3].met, Some(true), "{targets:?}");
    assert_eq!(targets[4].met, Some(true), "{targets:?}");
}

#[test]
fn the_report_has_every_run() {
    let s = SimScenario::new(ClusterConfig { endpoints: 2, ..Default::default() }, DEFAULT_SHAPE, 9.0, 3);
    let runs = run_all(&s, &mut |_| {}).unwrap();
    let sum = summaries(&s, &runs);
    let table = noisy::table(&sum);
    let svg = noisy::chart::render(&s.scenario, &sum, "t <1>", "s & t");
    for spec in RUNS {
        assert!(table.contains(&format!("| {} ", spec.name)), "{table}");
        assert!(svg.contains(spec.name), "{} missing from the chart", spec.name);
    }
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("t &lt;1&gt;") && svg.contains("s &amp; t"));
    assert!(!svg.contains("NaN") && !svg.contains("inf"), "non-finite numbers in the chart");
    assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
    let json = noisy::results_json(&s.scenario, &sum);
    assert_eq!(json["runs"].as_array().unwrap().len(), RUNS.len());
    assert_eq!(json["targets"].as_array().unwrap().len(), 5);
    let text = noisy::targets_text(&noisy::targets(&sum));
    assert_eq!(text.lines().count(), 5, "{text}");
}
