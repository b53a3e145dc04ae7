//! Replays the binding-neutral golden fixture suite in `fixtures/golden/` (format:
//! `fixtures/golden/README.md`) on the core's `Router`. Python, C and the wasm host replay the same
//! files. The cases, their replay and the comparison are `kvroute_sim::golden`'s (shared with the
//! filter's replay); this file only says how the core performs each operation.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use kvroute::{
    EndpointSpec, EventIngestError, MetricsSnapshot, Policy, RequestError, Role, RouteError, Router, StateError,
};
use kvroute_sim::golden::{self, Case, Completed, Cx, Events, Ingested, Metrics, Route, RouteFailure, Routed, Surface};
use serde_json::{json, Value};

struct Core {
    router: Router,
}

impl Core {
    fn new(case: &Case) -> Core {
        let policy = match &case.policy {
            Some(p) => Policy::from_json(&p.to_string()).unwrap(),
            None => Policy::default(),
        };
        let router = Router::new(policy);
        for e in &case.endpoints {
            router.upsert_endpoint(EndpointSpec::new(e.id.as_str(), e.role)).unwrap();
        }
        Core { router }
    }
}

fn failure(e: &RouteError) -> RouteFailure {
    let (kind, field, header) = match e {
        RouteError::Request(RequestError::Field { field, .. }) => ("request", Some(field.clone()), None),
        RouteError::Request(RequestError::Header { header, .. }) => ("request", None, Some(header.clone())),
        RouteError::Request(_) => ("request", None, None),
        RouteError::NoEndpoints { .. } => ("no_endpoints", None, None),
        _ => ("other", None, None),
    };
    RouteFailure { kind: kind.to_owned(), field, header, detail: format!("{e:?}") }
}

fn done<E: std::fmt::Debug>(cx: &mut Cx, what: &str, r: Result<(), E>) {
    if let Err(e) = r {
        cx.fail(format_args!("{what} failed: {e:?}"));
    }
}

impl Surface for Core {
    fn metrics(&mut self, cx: &mut Cx, snapshots: &[&Metrics]) {
        for m in snapshots {
            let snapshot: MetricsSnapshot = serde_json::from_value(m.metrics.clone()).unwrap();
            done(cx, "update_metrics", self.router.update_metrics(&m.endpoint, snapshot));
        }
    }

    fn route(&mut self, cx: &mut Cx, step: &Route) -> Routed {
        let headers = step.header_pairs();
        match self.router.route_http(step.body.as_bytes(), headers.iter().copied(), step.now_ms) {
            Ok(d) => {
                let v = golden::view(&d);
                // The view of the decision and the view of its JSON form are one view.
                let mut differ = Vec::new();
                golden::check("json", &golden::view_json(&d.to_json()), &v, &mut differ);
                for e in differ {
                    cx.fail(format_args!("view and JSON view differ: {e}"));
                }
                if step.complete && d.shed().is_none() {
                    done(cx, "complete", self.router.complete(&d.request_id));
                }
                Routed::Decision(v)
            }
            Err(e) => Routed::Error(failure(&e)),
        }
    }

    fn complete(&mut self, _cx: &mut Cx, request_id: &str) -> Completed {
        match self.router.complete(request_id) {
            Ok(()) => Completed::Done,
            Err(StateError::UnknownRequest { .. }) => Completed::UnknownRequest,
            Err(e) => Completed::Other(format!("{e:?}")),
        }
    }

    fn upsert_endpoint(&mut self, cx: &mut Cx, id: &str, role: Role) {
        done(cx, "upsert_endpoint", self.router.upsert_endpoint(EndpointSpec::new(id, role)));
    }

    fn remove_endpoint(&mut self, cx: &mut Cx, id: &str) {
        done(cx, "remove_endpoint", self.router.remove_endpoint(id));
    }

    fn set_healthy(&mut self, cx: &mut Cx, id: &str, healthy: bool) {
        done(cx, "set_healthy", self.router.set_healthy(id, healthy));
    }

    fn reload(&mut self, cx: &mut Cx, policy: &Value) {
        done(cx, "reload", self.router.reload_str(&policy.to_string()).map(drop));
    }

    fn reload_invalid(&mut self, cx: &mut Cx, policy: &Value) -> bool {
        let before = self.router.policy().version;
        let accepted = self.router.reload_str(&policy.to_string()).is_ok();
        if self.router.policy().version != before {
            cx.fail("the policy version changed");
        }
        accepted
    }

    fn events(&mut self, _cx: &mut Cx, step: &Events) -> Ingested {
        match self.router.apply_events(&step.endpoint, &step.payload, step.seq, step.now_ms) {
            Ok(out) => {
                let mut v = serde_json::to_value(out.verdict).unwrap();
                v["blocks"] = json!(out.blocks);
                v["events"] = json!(out.events);
                Ingested::Outcome(v)
            }
            Err(EventIngestError::Decode(_)) => Ingested::DecodeError,
            Err(e) => Ingested::Other(format!("{e:?}")),
        }
    }

    fn resync(&mut self, cx: &mut Cx, endpoint: &str, now_ms: u64) {
        done(cx, "resync_stream", self.router.resync_stream(endpoint, now_ms));
    }
}

#[test]
fn golden_fixture_suite() {
    let cases = golden::suite().unwrap();
    assert!(cases.len() >= 25, "the suite has at least 25 cases, found {}", cases.len());
    let mut all = Vec::new();
    let mut rules = std::collections::BTreeSet::new();
    for case in &cases {
        all.extend(golden::replay(case, &mut Core::new(case)));
        rules.extend(case.expected_rules());
    }
    assert!(all.is_empty(), "{} mismatches:\n{}", all.len(), all.join("\n"));
    let known: std::collections::BTreeSet<&str> = kvroute::Rule::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(rules, known, "every rule is covered by an expectation");
}
