//! Replays the binding-neutral flow-control fixtures in `fixtures/golden-flow/` (format:
//! `fixtures/golden-flow/README.md`) through `Router`'s public API. Python, C and the Envoy filter
//! replay the same files.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvroute::{Admission, EndpointSpec, MetricsSnapshot, Policy, Release, ReleaseOutcome, Role, Router, Ticket};
use serde_json::{json, Map, Value};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/golden-flow")
}

/// `expect` matches `actual`: numbers within 1e-9, objects by subset, arrays element by element
/// and of equal length.
fn check(path: &str, expect: &Value, actual: &Value, errors: &mut Vec<String>) {
    match (expect, actual) {
        (Value::Number(e), Value::Number(a)) => {
            let (e, a) = (e.as_f64().unwrap(), a.as_f64().unwrap());
            if (e - a).abs() > 1e-9 {
                errors.push(format!("{path}: expected {e}, got {a}"));
            }
        }
        (Value::Object(e), Value::Object(a)) => {
            for (k, ev) in e {
                match a.get(k) {
                    Some(av) => check(&format!("{path}.{k}"), ev, av, errors),
                    None => errors.push(format!("{path}.{k}: missing in {actual}")),
                }
            }
        }
        (Value::Array(e), Value::Array(a)) => {
            if e.len() != a.len() {
                errors.push(format!("{path}: expected {expect}, got {actual}"));
                return;
            }
            for (i, (ev, av)) in e.iter().zip(a).enumerate() {
                check(&format!("{path}[{i}]"), ev, av, errors);
            }
        }
        _ if expect == actual => {}
        _ => errors.push(format!("{path}: expected {expect}, got {actual}")),
    }
}

fn admission_view(a: &Admission) -> Value {
    match a {
        Admission::Admit => json!("admit"),
        Admission::Queued(_) => json!("queued"),
        Admission::Rejected(r) => json!({"rejected": {"status": r.status, "reason": r.reason.as_str()}}),
    }
}

/// A request held by the replayer under its fixture id.
#[derive(Default)]
struct Held {
    body: String,
    headers: Vec<(String, String)>,
    ticket: Option<Ticket>,
    request_id: Option<String>,
}

struct Replay {
    router: Router,
    held: BTreeMap<String, Held>,
    by_ticket: BTreeMap<Ticket, String>,
}

impl Replay {
    /// Route the request held under `id` (admitted at once, or dispatched) and remember its
    /// request id; the route view is `{endpoint, shed}`.
    fn route(&mut self, id: &str, now: u64) -> Value {
        let h = self.held.get_mut(id).unwrap();
        match self.router.route_http(h.body.as_bytes(), h.headers.iter().map(|(k, v)| (k, v)), now) {
            Ok(d) => {
                let shed = d.shed().is_some();
                let view = json!({"endpoint": d.endpoint(), "shed": shed});
                if !shed {
                    h.request_id = Some(d.request_id);
                }
                view
            }
            Err(e) => json!({"error": e.to_string()}),
        }
    }

    fn release_view(&mut self, r: &Release, now: u64, route: bool) -> Value {
        let id = self.by_ticket.remove(&r.ticket).unwrap_or_else(|| format!("unknown ticket {}", r.ticket));
        match r.outcome {
            ReleaseOutcome::Dispatched => {
                let mut v = json!({"id": id, "outcome": "dispatched", "waited_ms": r.waited_ms});
                if route {
                    v["route"] = self.route(&id, now);
                }
                v
            }
            ReleaseOutcome::Dropped(rej) => json!({
                "id": id, "outcome": "dropped", "status": rej.status, "reason": rej.reason.as_str(),
                "waited_ms": r.waited_ms,
            }),
        }
    }
}

fn stats_view(router: &Router) -> Value {
    let s = router.flow_stats();
    let bands: Map<String, Value> = s.bands.iter().map(|b| (b.priority.to_string(), json!(b.queued))).collect();
    json!({
        "queued": s.queued,
        "queued_bytes": s.queued_bytes,
        "bands": bands,
        "counters": serde_json::to_value(&s.counters).unwrap(),
    })
}

fn run_case(path: &Path) -> Vec<String> {
    let case: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let name = case["name"].as_str().unwrap().to_owned();
    let policy = Policy::from_json(&case["policy"].to_string()).unwrap();
    let default_body = case.get("body").cloned().unwrap_or(json!({"model": "m", "prompt": "hello", "max_tokens": 16}));
    let mut r = Replay { router: Router::new(policy), held: BTreeMap::new(), by_ticket: BTreeMap::new() };
    for e in case["endpoints"].as_array().unwrap() {
        let role: Role = serde_json::from_value(e["role"].clone()).unwrap();
        r.router.upsert_endpoint(EndpointSpec::new(e["id"].as_str().unwrap(), role)).unwrap();
    }
    let mut errors = Vec::new();
    for (i, step) in case["steps"].as_array().unwrap().iter().enumerate() {
        let at = format!("{name} step {i}");
        let now = step.get("now_ms").and_then(Value::as_u64);
        match step["op"].as_str().unwrap() {
            "metrics" => {
                let m: MetricsSnapshot = serde_json::from_value(step["metrics"].clone()).unwrap();
                r.router.update_metrics(step["endpoint"].as_str().unwrap(), m).unwrap();
            }
            "upsert_endpoint" => {
                let role: Role = serde_json::from_value(step["role"].clone()).unwrap();
                r.router.upsert_endpoint(EndpointSpec::new(step["endpoint"].as_str().unwrap(), role)).unwrap();
            }
            "remove_endpoint" => r.router.remove_endpoint(step["endpoint"].as_str().unwrap()).unwrap(),
            "set_healthy" => {
                r.router.set_healthy(step["endpoint"].as_str().unwrap(), step["healthy"].as_bool().unwrap()).unwrap();
            }
            "reload" => {
                r.router.reload_str(&step["policy"].to_string()).unwrap();
            }
            "admit" => {
                let id = step["id"].as_str().unwrap().to_owned();
                let body = step.get("body").unwrap_or(&default_body).to_string();
                let headers: Vec<(String, String)> = step
                    .get("headers")
                    .and_then(Value::as_object)
                    .map(|h| h.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned())).collect())
                    .unwrap_or_default();
                let a =
                    r.router.admit_http(body.as_bytes(), headers.iter().map(|(k, v)| (k, v)), now.unwrap()).unwrap();
                if let Admission::Queued(t) = a {
                    r.by_ticket.insert(t, id.clone());
                }
                r.held.insert(id.clone(), Held { body, headers, ticket: a.ticket(), request_id: None });
                check(&format!("{at} admission"), &step["expect"], &admission_view(&a), &mut errors);
                if a == Admission::Admit && step.get("route").and_then(Value::as_bool).unwrap_or(true) {
                    let v = r.route(&id, now.unwrap());
                    if let Some(e) = step.get("expect_route") {
                        check(&format!("{at} route"), e, &v, &mut errors);
                    }
                }
            }
            "tick" => r.router.tick(now.unwrap()),
            "releases" => {
                let route = step.get("route").and_then(Value::as_bool).unwrap_or(true);
                let rs = r.router.take_releases(now.unwrap());
                let views: Vec<Value> = rs.iter().map(|x| r.release_view(x, now.unwrap(), route)).collect();
                check(&format!("{at} releases"), &step["expect"], &Value::Array(views), &mut errors);
            }
            "complete" => {
                let id = step["id"].as_str().unwrap();
                match r.held.get(id).and_then(|h| h.request_id.clone()) {
                    Some(rid) => r.router.complete(&rid).unwrap(),
                    None => errors.push(format!("{at}: {id} was not routed")),
                }
            }
            "cancel" => {
                let id = step["id"].as_str().unwrap();
                let t = r.held.get(id).and_then(|h| h.ticket).unwrap_or(Ticket(0));
                let got = r.router.cancel(t);
                if got {
                    r.by_ticket.remove(&t);
                }
                check(&format!("{at} cancel"), &step["expect"], &json!(got), &mut errors);
            }
            "shutdown" => r.router.shutdown_queue(),
            "stats" => check(&format!("{at} stats"), &step["expect"], &stats_view(&r.router), &mut errors),
            "saturation" => {
                let s = serde_json::to_value(r.router.flow_saturation(now.unwrap())).unwrap();
                check(&format!("{at} saturation"), &step["expect"], &s, &mut errors);
            }
            other => panic!("{at}: unknown op {other}"),
        }
    }
    // Every ticket a case issued has ended by its last step (the fixtures leave nothing held).
    if !r.by_ticket.is_empty() {
        errors.push(format!("{name}: tickets still held at the end: {:?}", r.by_ticket.values().collect::<Vec<_>>()));
    }
    errors
}

#[test]
fn golden_flow_fixture_suite() {
    let files = kvroute_sim::golden::json_files(&dir()).unwrap();
    assert!(files.len() >= 6, "the suite has at least 6 cases, found {}", files.len());
    let mut all = Vec::new();
    let mut ops = std::collections::BTreeSet::new();
    for f in &files {
        all.extend(run_case(f));
        let case: Value = serde_json::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
        for s in case["steps"].as_array().unwrap() {
            ops.insert(s["op"].as_str().unwrap().to_owned());
        }
    }
    assert!(all.is_empty(), "{} mismatches:\n{}", all.len(), all.join("\n"));
    for op in
        ["admit", "releases", "tick", "complete", "cancel", "reload", "metrics", "shutdown", "stats", "set_healthy"]
    {
        assert!(ops.contains(op), "no fixture uses op {op}");
    }
}
