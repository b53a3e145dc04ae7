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
//! age, speculation TTL, in-flight age) except across such a step. Expectations are compared
//! exactly as core/tests/golden.rs does.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvroute_wasm_tests::*;
use serde_json::{json, Value};

struct Replay {
    host: Host,
    vm: VmId,
    pages: Pages,
    policy: Value,
    endpoints: Vec<(String, String, bool)>,
    offset: u64,
    open: HashMap<String, StreamId>,
    errors: Vec<String>,
}

/// The plugin configuration of a case: its policy and endpoints, polling and ticking every ms.
fn case_config(policy: &Value, endpoints: &[(String, String, bool)]) -> String {
    let endpoints: Vec<Value> =
        endpoints.iter().map(|(a, r, h)| json!({"address": a, "role": r, "healthy": h})).collect();
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

impl Replay {
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

    fn reconfigure(&mut self, at: &str, expect_ok: bool) {
        let cfg = self.config();
        let ok = self.host.reconfigure(self.vm, cfg).unwrap();
        if ok != expect_ok {
            self.errors.push(format!("{at}: reconfiguration returned {ok}, expected {expect_ok}"));
        }
    }

    /// Serve these metric pages to one poll at fixture time `t`.
    fn metrics(&mut self, t: u64, group: &[&Value]) {
        let mut target = t + self.offset;
        if target <= self.clock() {
            self.offset += self.clock() + 1 - target;
            target = self.clock() + 1;
        }
        self.host.advance(Duration::from_millis(target - 1 - self.clock())).unwrap();
        for step in group {
            self.pages.once(step["endpoint"].as_str().unwrap(), prometheus(&step["metrics"]));
        }
        self.host.advance(Duration::from_millis(1)).unwrap();
        self.pages.clear();
    }

    fn route(&mut self, at: &str, step: &Value) {
        let body = match (step.get("body"), step.get("body_raw")) {
            (Some(b), None) => b.to_string(),
            (None, Some(Value::String(s))) => s.clone(),
            _ => panic!("{at}: a route step needs `body` or `body_raw`"),
        };
        let headers: Vec<(String, String)> = step
            .get("headers")
            .and_then(Value::as_object)
            .map(|h| h.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned())).collect())
            .unwrap_or_default();
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        self.at(step["now_ms"].as_u64().unwrap());
        let (s, o) = route(&mut self.host, self.vm, body.as_bytes(), &h).unwrap();
        let Some(d) = o.decision.clone() else {
            self.errors.push(format!("{at}: no decision header (local {:?})", o.local_status));
            return;
        };
        match (d.get("error"), step.get("expect_error")) {
            (None, None) => {
                if let Some(expect) = step.get("expect") {
                    let v = view(&d);
                    check(at, expect, &v, &mut self.errors);
                    // What the filter did must agree with the decision it reports.
                    if v["shed"] == true {
                        if o.local_status != v["status"].as_u64().map(|s| s as u32) {
                            self.errors.push(format!("{at}: shed but answered {:?}", o.local_status));
                        }
                    } else {
                        for (k, val) in v["headers"].as_object().unwrap() {
                            if o.header(k) != val.as_str() {
                                self.errors
                                    .push(format!("{at}: upstream {k} = {:?}, decision says {val}", o.header(k)));
                            }
                        }
                    }
                }
                let id = d["request_id"].as_str().unwrap().to_owned();
                if step.get("complete").and_then(Value::as_bool).unwrap_or(false) || d["shed"] != Value::Null {
                    self.host.finish_stream(s).unwrap();
                } else {
                    self.open.insert(id, s);
                }
            }
            (Some(err), Some(expect)) => {
                if expect["kind"] != err["kind"] {
                    self.errors.push(format!("{at}: expected error {expect}, got {err}"));
                }
                for key in ["field", "header"] {
                    if let Some(f) = expect.get(key) {
                        if *f != err[key] {
                            self.errors.push(format!("{at}: expected error {key} {f}, got {err}"));
                        }
                    }
                }
                // Fail-open: the request still went to an endpoint.
                if o.destination().is_none() {
                    self.errors.push(format!("{at}: a request the core refused was not routed (fail-open)"));
                }
                self.host.finish_stream(s).unwrap();
            }
            (Some(err), None) => self.errors.push(format!("{at}: unexpected error {err}")),
            (None, Some(_)) => self.errors.push(format!("{at}: expected an error, got {}", view(&d))),
        }
    }
}

fn run_case(path: &Path) -> Vec<String> {
    let case: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let name = case["name"].as_str().unwrap().to_owned();
    let pages = Pages::default();
    let mut host = host_at(0, &pages).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let endpoints: Vec<(String, String, bool)> = case["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["id"].as_str().unwrap().to_owned(), e["role"].as_str().unwrap().to_owned(), true))
        .collect();
    let policy = case.get("policy").cloned().unwrap_or(json!({}));
    let vm = host.start_vm(&filter, vm_config(&case_config(&policy, &endpoints))).unwrap();
    let mut r = Replay { vm, host, pages, policy, endpoints, offset: 1000, open: HashMap::new(), errors: Vec::new() };
    let steps = case["steps"].as_array().unwrap();
    let mut i = 0;
    while i < steps.len() {
        let step = &steps[i];
        let at = format!("{name} step {i}");
        match step["op"].as_str().unwrap() {
            "metrics" => {
                // Consecutive snapshots taken at the same time: one poll.
                let t = step["metrics"]["updated_ms"].as_u64().unwrap();
                let mut group = vec![step];
                while let Some(next) = steps.get(i + 1) {
                    if next["op"] == "metrics" && next["metrics"]["updated_ms"].as_u64() == Some(t) {
                        group.push(next);
                        i += 1;
                    } else {
                        break;
                    }
                }
                r.metrics(t, &group);
            }
            "route" => r.route(&at, step),
            "complete" => {
                let id = step["request_id"].as_str().unwrap();
                match (r.open.remove(id), step.get("expect_error")) {
                    (Some(s), None) => {
                        r.host.finish_stream(s).unwrap();
                    }
                    (None, Some(e)) if e["kind"] == "unknown_request" => {}
                    (s, e) => r.errors.push(format!("{at}: complete {id}: open stream {s:?}, expected error {e:?}")),
                }
            }
            "upsert_endpoint" => {
                let (id, role) = (step["id"].as_str().unwrap(), step["role"].as_str().unwrap());
                match r.endpoints.iter_mut().find(|e| e.0 == id) {
                    Some(e) => e.1 = role.to_owned(),
                    None => r.endpoints.push((id.to_owned(), role.to_owned(), true)),
                }
                r.reconfigure(&at, true);
            }
            "remove_endpoint" => {
                r.endpoints.retain(|e| e.0 != step["id"].as_str().unwrap());
                r.reconfigure(&at, true);
            }
            "set_healthy" => {
                let id = step["id"].as_str().unwrap();
                if let Some(e) = r.endpoints.iter_mut().find(|e| e.0 == id) {
                    e.2 = step["healthy"].as_bool().unwrap();
                }
                r.reconfigure(&at, true);
            }
            "reload" => {
                r.policy = step["policy"].clone();
                r.reconfigure(&at, true);
            }
            "reload_invalid" => {
                let good = std::mem::replace(&mut r.policy, step["policy"].clone());
                r.reconfigure(&at, false);
                r.policy = good;
            }
            "events" => {
                r.at(step["now_ms"].as_u64().unwrap());
                let payload = hex(step["payload_hex"].as_str().unwrap());
                let (status, body) = post_events(
                    &mut r.host,
                    r.vm,
                    step["endpoint"].as_str().unwrap(),
                    step["seq"].as_u64(),
                    &payload,
                    SECRET,
                )
                .unwrap();
                match (step.get("expect"), step.get("expect_error")) {
                    (_, Some(e)) if e["kind"] == "decode" => {
                        if (status, body["error"].as_str()) != (400, Some("decode")) {
                            r.errors.push(format!("{at}: expected a decode error, got {status} {body}"));
                        }
                    }
                    (expect, None) => {
                        let want = if body["verdict"] == "gap" { 409 } else { 200 };
                        if status != want {
                            r.errors.push(format!("{at}: status {status} for {body}"));
                        }
                        if let Some(expect) = expect {
                            check(&at, expect, &body, &mut r.errors);
                        }
                    }
                    (_, Some(e)) => panic!("{at}: unknown expect_error {e}"),
                }
            }
            "resync" => {
                r.at(step["now_ms"].as_u64().unwrap());
                let (status, body) = post_resync(&mut r.host, r.vm, step["endpoint"].as_str().unwrap()).unwrap();
                if status != 200 {
                    r.errors.push(format!("{at}: resync answered {status} {body}"));
                }
            }
            other => panic!("{at}: unknown op {other}"),
        }
        i += 1;
    }
    if let Some(f) = r.host.failure(r.vm).unwrap() {
        r.errors.push(format!("{name}: the VM failed: {f}"));
    }
    for v in r.host.abi_violations().iter() {
        r.errors.push(format!("{name}: ABI violation {v:?}"));
    }
    r.errors
}

#[test]
fn golden_fixture_suite_through_the_filter() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 25, "the suite has at least 25 cases, found {}", files.len());
    let mut all = Vec::new();
    for f in &files {
        all.extend(run_case(f));
    }
    assert!(all.is_empty(), "{} mismatches:\n{}", all.len(), all.join("\n"));
}
