//! The golden fixture suite (`fixtures/golden/*.json`, format in fixtures/golden/README.md)
//! replayed through the filter in the wasmtime host: every operation goes through the filter's
//! own interfaces, never through a router handle:
//!
//! | fixture op | through the filter |
//! | --- | --- |
//! | `metrics` | a metric poll: the test cluster serves a vLLM page with those figures to the next poll, taken at `updated_ms` |
//! | `route` | an HTTP request (body + headers); the decision is read from the headers the filter sets and `x-kvroute-decision` |
//! | `complete` / `complete: true` | the stream ends (`proxy_on_done` / `proxy_on_log`) |
//! | `events`, `resync` | authenticated POSTs to the event path |
//! | `upsert_endpoint`, `remove_endpoint`, `set_healthy`, `reload`, `reload_invalid` | a new plugin configuration (Envoy's config update: a new root context) |
//!
//! The host's clock only moves forward; six fixtures step back in time (a metrics snapshot
//! older than an earlier request). Fixture times are mapped onto the clock with an offset that
//! grows where a fixture steps back, which keeps every difference the decisions read (metric
//! age, speculation TTL, in-flight age) except across such a step. The cases, their replay and
//! the comparison are `kvroute_sim::golden`'s, as for core/tests/golden.rs: expectations are judged
//! exactly as there.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::collections::HashMap;
use std::time::Duration;

use kvroute::Role;
use kvroute_sim::golden::{self, Case, Completed, Cx, Events, Ingested, Metrics, Route, RouteFailure, Routed, Surface};
use kvroute_wasm_tests::*;
use serde_json::{json, Value};

/// The filter in the host, as a golden surface.
struct Filter {
    host: Host,
    vm: VmId,
    pages: Pages,
    policy: Value,
    endpoints: Vec<(String, Role, bool)>,
    offset: u64,
    open: HashMap<String, StreamId>,
}

/// The plugin configuration of a case: its policy and endpoints, polling and ticking every ms.
fn case_config(policy: &Value, endpoints: &[(String, Role, bool)]) -> String {
    let endpoints: Vec<Value> =
        endpoints.iter().map(|(a, r, h)| json!({"address": a, "role": r.as_str(), "healthy": h})).collect();
    plugin_config(
        policy,
        &[],
        &json!({
            "endpoints": endpoints,
            "metrics": {"cluster": CLUSTER, "interval_ms": 1},
            "sync": {"tick_ms": 1},
        }),
    )
}

impl Filter {
    fn new(case: &Case) -> Filter {
        let pages = Pages::default();
        let mut host = host_at(0, &pages).unwrap();
        let filter = host.load_kvroute_filter().unwrap();
        let endpoints: Vec<(String, Role, bool)> =
            case.endpoints.iter().map(|e| (e.id.clone(), e.role, true)).collect();
        let policy = case.policy.clone().unwrap_or(json!({}));
        let vm = host.start_vm(&filter, vm_config(&case_config(&policy, &endpoints))).unwrap();
        Filter { vm, host, pages, policy, endpoints, offset: 1000, open: HashMap::new() }
    }

    fn config(&self) -> String {
        case_config(&self.policy, &self.endpoints)
    }

    fn clock(&self) -> u64 {
        now_ms(&self.host)
    }

    /// Move the clock to fixture time `t` (or later, see the module docs).
    fn at(&mut self, t: u64) {
        let mut target = t + self.offset;
        if target < self.clock() {
            self.offset += self.clock() - target;
            target = self.clock();
        }
        self.host.advance(Duration::from_millis(target - self.clock())).unwrap();
    }

    /// A new plugin configuration; whether the filter took it.
    fn reconfigure(&mut self) -> bool {
        let cfg = self.config();
        self.host.reconfigure(self.vm, cfg).unwrap()
    }

    fn reconfigure_ok(&mut self, cx: &mut Cx) {
        if !self.reconfigure() {
            cx.fail("reconfiguration returned false, expected true");
        }
    }

    /// What the VM itself reports wrong at the end of a case.
    fn failures(&self, name: &str) -> Vec<String> {
        let mut errors = Vec::new();
        if let Some(f) = self.host.failure(self.vm).unwrap() {
            errors.push(format!("{name}: the VM failed: {f}"));
        }
        for v in self.host.abi_violations().iter() {
            errors.push(format!("{name}: ABI violation {v:?}"));
        }
        errors
    }
}

impl Surface for Filter {
    /// One poll at the snapshots' time: the test cluster serves each endpoint's page once.
    fn metrics(&mut self, _cx: &mut Cx, snapshots: &[&Metrics]) {
        let t = snapshots[0].updated_ms().unwrap();
        let mut target = t + self.offset;
        if target <= self.clock() {
            self.offset += self.clock() + 1 - target;
            target = self.clock() + 1;
        }
        self.host.advance(Duration::from_millis(target - 1 - self.clock())).unwrap();
        for m in snapshots {
            self.pages.once(&m.endpoint, prometheus(&m.metrics));
        }
        self.host.advance(Duration::from_millis(1)).unwrap();
        self.pages.clear();
    }

    fn route(&mut self, cx: &mut Cx, step: &Route) -> Routed {
        self.at(step.now_ms);
        let (s, o) = route(&mut self.host, self.vm, step.body.as_bytes(), &step.header_pairs()).unwrap();
        let Some(d) = o.decision.clone() else {
            cx.fail(format_args!("no decision header (local {:?})", o.local_status));
            return Routed::Unknown;
        };
        if let Some(err) = d.get("error") {
            // Fail-open: the request still went to an endpoint.
            if o.destination().is_none() {
                cx.fail("a request the core refused was not routed (fail-open)");
            }
            self.host.finish_stream(s).unwrap();
            let text = |k: &str| err[k].as_str().map(str::to_owned);
            return Routed::Error(RouteFailure {
                kind: text("kind").unwrap_or_default(),
                field: text("field"),
                header: text("header"),
                detail: err.to_string(),
            });
        }
        let v = golden::view_json(&d);
        if step.expect.is_some() {
            // What the filter did must agree with the decision it reports.
            if v["shed"] == true {
                if o.local_status != v["status"].as_u64().map(|s| s as u32) {
                    cx.fail(format_args!("shed but answered {:?}", o.local_status));
                }
            } else {
                for (k, val) in v["headers"].as_object().unwrap() {
                    if o.header(k) != val.as_str() {
                        cx.fail(format_args!("upstream {k} = {:?}, decision says {val}", o.header(k)));
                    }
                }
            }
        }
        let id = d["request_id"].as_str().unwrap().to_owned();
        if step.complete || d["shed"] != Value::Null {
            self.host.finish_stream(s).unwrap();
        } else {
            self.open.insert(id, s);
        }
        Routed::Decision(v)
    }

    /// The request's stream ends.
    fn complete(&mut self, _cx: &mut Cx, request_id: &str) -> Completed {
        match self.open.remove(request_id) {
            Some(s) => {
                self.host.finish_stream(s).unwrap();
                Completed::Done
            }
            None => Completed::UnknownRequest,
        }
    }

    fn upsert_endpoint(&mut self, cx: &mut Cx, id: &str, role: Role) {
        match self.endpoints.iter_mut().find(|e| e.0 == id) {
            Some(e) => e.1 = role,
            None => self.endpoints.push((id.to_owned(), role, true)),
        }
        self.reconfigure_ok(cx);
    }

    fn remove_endpoint(&mut self, cx: &mut Cx, id: &str) {
        self.endpoints.retain(|e| e.0 != id);
        self.reconfigure_ok(cx);
    }

    fn set_healthy(&mut self, cx: &mut Cx, id: &str, healthy: bool) {
        if let Some(e) = self.endpoints.iter_mut().find(|e| e.0 == id) {
            e.2 = healthy;
        }
        self.reconfigure_ok(cx);
    }

    fn reload(&mut self, cx: &mut Cx, policy: &Value) {
        self.policy = policy.clone();
        self.reconfigure_ok(cx);
    }

    fn reload_invalid(&mut self, _cx: &mut Cx, policy: &Value) -> bool {
        let good = std::mem::replace(&mut self.policy, policy.clone());
        let accepted = self.reconfigure();
        self.policy = good;
        accepted
    }

    /// An authenticated POST to the event path.
    fn events(&mut self, _cx: &mut Cx, step: &Events) -> Ingested {
        self.at(step.now_ms);
        let (status, body) =
            post_events(&mut self.host, self.vm, &step.endpoint, step.seq, &step.payload, SECRET).unwrap();
        if (status, body["error"].as_str()) == (400, Some("decode")) {
            return Ingested::DecodeError;
        }
        let want = if body["verdict"] == "gap" { 409 } else { 200 };
        if status == want {
            Ingested::Outcome(body)
        } else {
            Ingested::Other(format!("status {status} for {body}"))
        }
    }

    fn resync(&mut self, cx: &mut Cx, endpoint: &str, now_ms: u64) {
        self.at(now_ms);
        let (status, body) = post_resync(&mut self.host, self.vm, endpoint).unwrap();
        if status != 200 {
            cx.fail(format_args!("resync answered {status} {body}"));
        }
    }
}

#[test]
fn golden_fixture_suite_through_the_filter() {
    let cases = golden::suite().unwrap();
    assert!(cases.len() >= 25, "the suite has at least 25 cases, found {}", cases.len());
    let mut all = Vec::new();
    for case in &cases {
        let mut filter = Filter::new(case);
        all.extend(golden::replay(case, &mut filter));
        all.extend(filter.failures(&case.name));
    }
    assert!(all.is_empty(), "{} mismatches:\n{}", all.len(), all.join("\n"));
}
