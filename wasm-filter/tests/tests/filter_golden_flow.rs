//! The flow-control fixture suite (`fixtures/golden-flow/*.json`, format in
//! fixtures/golden-flow/README.md) replayed through the filter in the wasmtime host, and by the
//! native core (`Router`, as `core/tests/golden_flow.rs` does) in the same process: each case's
//! results are checked against the fixture's expectations and must be identical to the native
//! replay's, step by step.
//!
//! Every operation goes through the filter's own interfaces:
//!
//! | fixture op | through the filter |
//! | --- | --- |
//! | `admit` | an HTTP request (body + headers): routed (`admit`), held paused (`queued`), or answered with the status and `x-llm-d-request-dropped-reason` (`rejected`); a route's `{endpoint, shed}` from the destination header or the core's 429 |
//! | `releases` | the releases the filter acted on since the previous `releases` step, in the order it acted (its debug log line `kvroute: flow release: …`, written in the released stream's context), each checked against the stream: resumed upstream with a destination, or answered with the status and reason header |
//! | `complete` | the stream ends; **deferred** to the next step that is a dispatch opportunity in the core (`admit`, `releases`) or to the case's end, at that step's time: in the filter a completion is itself a dispatch opportunity, in the fixtures it is not (its releases come at the next `releases` step, at that step's time) |
//! | `cancel` | the downstream goes away (the stream ends) while the request is held; `true` when the core's `kvroute_flow_cancelled_total` went up. A request that is not held (routed, answered, never queued) is not touched: `false` |
//! | `shutdown` | the plugin shuts down (`Host::shutdown_vm`: the root context's `proxy_on_done`); the filter answers every held request 503 `rejected-shutting-down` |
//! | `metrics` | a metric poll at `updated_ms` (consecutive steps of one time: one poll round) |
//! | `set_healthy`, `upsert_endpoint`, `remove_endpoint`, `reload` | a new plugin configuration |
//! | `stats`, `saturation` | the stats page (`kvroute_flow_*` series; with flow control off the page has none, which reads as zeros) |
//!
//! No filter equivalent, skipped (and said so when the test runs):
//! - `tick`: a filter's tick takes its releases and acts on them at once; there is no window in
//!   which a release waits to be taken (the fixtures' "released but not taken" cancel). The
//!   filter ticks on its own (every ms here), which the fixtures' times allow: nothing is
//!   released between steps except at a step's exact time (TTLs are placed there).
//! - after `shutdown`: `admit` (a plugin that shut down takes no new requests) and `stats` (the
//!   stats page is a request too).
//! - `saturation`'s `decode_endpoints` (not on the stats page).
//!
//! The native replay routes released requests when it takes them (at the `releases` step), the
//! filter when it acts on them (a reload's releases at the reload): the same endpoints in every
//! case here.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, clippy::print_stderr)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use kvroute::{Admission, EndpointSpec, MetricsSnapshot, Policy, Release, ReleaseOutcome, Role, Router, Ticket};
use kvroute_wasm_tests::*;
use serde_json::{json, Map, Value};

fn files() -> Vec<PathBuf> {
    kvroute_sim::golden::json_files(&kvroute_sim::golden::flow_dir()).unwrap()
}

/// `expect` matches `actual` as fixtures/golden-flow/README.md says (and core/tests/golden_flow.rs
/// judges): numbers within 1e-9, objects by subset, arrays element by element and of equal length.
fn check(path: &str, expect: &Value, actual: &Value, errors: &mut Vec<String>) {
    match (expect, actual) {
        (Value::Number(e), Value::Number(a)) => {
            let (e, a) = (e.as_f64().unwrap_or(f64::NAN), a.as_f64().unwrap_or(f64::NAN));
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
        (Value::Array(e), Value::Array(a)) if e.len() == a.len() => {
            for (i, (ev, av)) in e.iter().zip(a).enumerate() {
                check(&format!("{path}[{i}]"), ev, av, errors);
            }
        }
        _ if expect == actual => {}
        _ => errors.push(format!("{path}: expected {expect}, got {actual}")),
    }
}

const DEFAULT_BODY: &str = r#"{"model":"m","prompt":"hello","max_tokens":16}"#;

/// One step's observable result, by step index (steps without one are absent).
type Trace = BTreeMap<usize, Value>;

fn body_of(case: &Value, step: &Value) -> String {
    match step.get("body").or_else(|| case.get("body")) {
        Some(b) => b.to_string(),
        None => serde_json::from_str::<Value>(DEFAULT_BODY).unwrap().to_string(),
    }
}

fn headers_of(step: &Value) -> Vec<(String, String)> {
    step.get("headers")
        .and_then(Value::as_object)
        .map(|h| h.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned())).collect())
        .unwrap_or_default()
}

fn rejected(status: u64, reason: &str) -> Value {
    json!({"rejected": {"status": status, "reason": reason}})
}

/// The saturation view both sides can give (`decode_endpoints` is not on the stats page).
fn saturation_view(pool: f64, decode: f64, prefill: Option<f64>) -> Value {
    json!({"pool": pool, "decode": decode, "prefill": prefill})
}

// ---- the native replay (the core's, as core/tests/golden_flow.rs) ----

/// A request of the native replay: body, headers, ticket when queued, request id when routed.
#[derive(Default)]
struct Req {
    body: String,
    headers: Vec<(String, String)>,
    ticket: Option<Ticket>,
    request_id: Option<String>,
}

/// Route `req` now (as the fixtures' routing rule says); its `{endpoint, shed}`.
fn native_route(router: &Router, req: &mut Req, now: u64) -> Value {
    match router.route_http(req.body.as_bytes(), req.headers.iter().map(|(k, v)| (k, v)), now) {
        Ok(d) => {
            let shed = d.shed().is_some();
            let view = json!({"endpoint": d.endpoint(), "shed": shed});
            if !shed {
                req.request_id = Some(d.request_id);
            }
            view
        }
        Err(e) => json!({"error": e.to_string()}),
    }
}

fn native(case: &Value) -> Trace {
    let policy = Policy::from_json(&case["policy"].to_string()).unwrap();
    let router = Router::new(policy);
    for e in case["endpoints"].as_array().unwrap() {
        let role: Role = serde_json::from_value(e["role"].clone()).unwrap();
        router.upsert_endpoint(EndpointSpec::new(e["id"].as_str().unwrap(), role)).unwrap();
    }
    let mut requests: BTreeMap<String, Req> = BTreeMap::new();
    let mut by_ticket: BTreeMap<Ticket, String> = BTreeMap::new();
    let mut trace = Trace::new();
    for (i, step) in case["steps"].as_array().unwrap().iter().enumerate() {
        let now = step.get("now_ms").and_then(Value::as_u64);
        match step["op"].as_str().unwrap() {
            "metrics" => {
                let m: MetricsSnapshot = serde_json::from_value(step["metrics"].clone()).unwrap();
                router.update_metrics(step["endpoint"].as_str().unwrap(), m).unwrap();
            }
            "upsert_endpoint" => {
                let role: Role = serde_json::from_value(step["role"].clone()).unwrap();
                router.upsert_endpoint(EndpointSpec::new(step["endpoint"].as_str().unwrap(), role)).unwrap();
            }
            "remove_endpoint" => router.remove_endpoint(step["endpoint"].as_str().unwrap()).unwrap(),
            "set_healthy" => {
                router.set_healthy(step["endpoint"].as_str().unwrap(), step["healthy"].as_bool().unwrap()).unwrap();
            }
            "reload" => {
                router.reload_str(&step["policy"].to_string()).unwrap();
            }
            "admit" => {
                let id = step["id"].as_str().unwrap().to_owned();
                let mut req = Req { body: body_of(case, step), headers: headers_of(step), ..Req::default() };
                let headers = req.headers.iter().map(|(k, v)| (k, v));
                let a = router.admit_http(req.body.as_bytes(), headers, now.unwrap()).unwrap();
                let admission = match a {
                    Admission::Admit => json!("admit"),
                    Admission::Queued(t) => {
                        req.ticket = Some(t);
                        by_ticket.insert(t, id.clone());
                        json!("queued")
                    }
                    Admission::Rejected(r) => rejected(u64::from(r.status), r.reason.as_str()),
                };
                let routed =
                    if a == Admission::Admit { native_route(&router, &mut req, now.unwrap()) } else { Value::Null };
                requests.insert(id, req);
                trace.insert(i, json!({"admission": admission, "route": routed}));
            }
            "tick" => router.tick(now.unwrap()),
            "releases" => {
                let now = now.unwrap();
                let views: Vec<Value> = router
                    .take_releases(now)
                    .iter()
                    .map(|r: &Release| {
                        let id = by_ticket.remove(&r.ticket).unwrap_or_else(|| format!("unknown ticket {}", r.ticket));
                        match r.outcome {
                            ReleaseOutcome::Dispatched => {
                                let routed = native_route(&router, requests.get_mut(&id).unwrap(), now);
                                json!({"id": id, "outcome": "dispatched", "waited_ms": r.waited_ms, "route": routed})
                            }
                            ReleaseOutcome::Dropped(rej) => json!({
                                "id": id, "outcome": "dropped", "status": rej.status,
                                "reason": rej.reason.as_str(), "waited_ms": r.waited_ms,
                            }),
                        }
                    })
                    .collect();
                trace.insert(i, Value::Array(views));
            }
            "complete" => {
                let id = step["id"].as_str().unwrap();
                let rid = requests.get(id).and_then(|r| r.request_id.clone()).expect("completed request was routed");
                router.complete(&rid).unwrap();
            }
            "cancel" => {
                let id = step["id"].as_str().unwrap();
                let t = requests.get(id).and_then(|r| r.ticket).unwrap_or(Ticket(0));
                let got = router.cancel(t);
                if got {
                    by_ticket.remove(&t);
                }
                trace.insert(i, json!(got));
            }
            "shutdown" => router.shutdown_queue(),
            "stats" => {
                let s = router.flow_stats();
                let bands: Map<String, Value> =
                    s.bands.iter().map(|b| (b.priority.to_string(), json!(b.queued))).collect();
                let view = json!({
                    "queued": s.queued,
                    "queued_bytes": s.queued_bytes,
                    "bands": bands,
                    "counters": serde_json::to_value(&s.counters).unwrap(),
                });
                trace.insert(i, view);
            }
            "saturation" => {
                let s = router.flow_saturation(now.unwrap());
                trace.insert(i, saturation_view(s.pool, s.decode, s.prefill));
            }
            other => panic!("unknown op {other}"),
        }
    }
    trace
}

// ---- the replay through the filter ----

/// The filter in the host.
struct Filter {
    host: Host,
    vm: VmId,
    pages: Pages,
    policy: Value,
    endpoints: Vec<(String, Role, bool)>,
    offset: u64,
    /// Open streams by fixture id.
    streams: BTreeMap<String, StreamId>,
    /// Fixture ids by context id (for the release log lines).
    ids: BTreeMap<u32, String>,
    /// Completions waiting for the next dispatch opportunity step.
    deferred: Vec<String>,
    /// The plugin shut down.
    stopped: bool,
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

const RELEASE_LOG: &str = "kvroute: flow release: ";

impl Filter {
    fn new(case: &Value) -> Filter {
        let pages = Pages::default();
        let mut host = host_at(0, &pages).unwrap();
        let filter = host.load_kvroute_filter().unwrap();
        let endpoints: Vec<(String, Role, bool)> = case["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["id"].as_str().unwrap().to_owned(), serde_json::from_value(e["role"].clone()).unwrap(), true))
            .collect();
        let policy = case["policy"].clone();
        let vm = host.start_vm(&filter, vm_config(&case_config(&policy, &endpoints))).unwrap();
        host.take_logs();
        Filter {
            host,
            vm,
            pages,
            policy,
            endpoints,
            offset: 1000,
            streams: BTreeMap::new(),
            ids: BTreeMap::new(),
            deferred: Vec::new(),
            stopped: false,
        }
    }

    fn clock(&self) -> u64 {
        now_ms(&self.host)
    }

    /// Move the clock to fixture time `t` (never back: a later offset where a fixture steps back).
    fn at(&mut self, t: u64) {
        let mut target = t + self.offset;
        if target < self.clock() {
            self.offset += self.clock() - target;
            target = self.clock();
        }
        self.host.advance(Duration::from_millis(target - self.clock())).unwrap();
    }

    fn reconfigure(&mut self, errors: &mut Vec<String>, at: &str) {
        let cfg = case_config(&self.policy, &self.endpoints);
        if !self.host.reconfigure(self.vm, cfg).unwrap() {
            errors.push(format!("{at}: the reconfiguration was refused"));
        }
    }

    /// The deferred completions: their streams end now.
    fn flush(&mut self, errors: &mut Vec<String>, at: &str) {
        for id in std::mem::take(&mut self.deferred) {
            match self.streams.remove(&id) {
                Some(s) => {
                    self.host.finish_stream(s).unwrap();
                }
                None => errors.push(format!("{at}: {id} has no open stream to complete")),
            }
        }
    }

    fn held(&self, s: StreamId) -> bool {
        self.host.stream(s).is_ok_and(|st| {
            st.request().state().is_paused() && st.upstream_headers().is_none() && st.local_reply().is_none()
        })
    }

    /// The route view of a stream that went on: its destination, or the core's 429.
    fn route_view(&self, s: StreamId) -> Value {
        let Ok(st) = self.host.stream(s) else { return json!({"error": "stream gone"}) };
        if let Some(h) = st.upstream_headers() {
            return json!({"endpoint": h.get(DESTINATION), "shed": false});
        }
        match st.local_reply() {
            Some(l) if l.headers.get(kvroute::HEADER_SHED_REASON).is_some() => json!({"endpoint": null, "shed": true}),
            Some(l) => json!({"error": format!("answered {}", l.status)}),
            None => json!({"error": "held"}),
        }
    }

    fn page(&mut self) -> String {
        stats(&mut self.host, self.vm).unwrap()
    }

    /// The stats view (as the native replay's) from the stats page.
    fn stats_view(&mut self) -> Value {
        let page = self.page();
        let mut bands = Map::new();
        let (mut queued, mut bytes) = (0.0, 0.0);
        let mut rejections = Map::new();
        for r in kvroute::DropReason::ALL {
            rejections.insert(r.as_str().replace('-', "_"), json!(0));
        }
        for line in page.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, v)) = line.rsplit_once(' ') else { continue };
            let v: f64 = v.parse().unwrap_or(0.0);
            let label = |name: &str| {
                series.strip_prefix(name).and_then(|r| r.split('"').nth(1)).map(str::to_owned).unwrap_or_default()
            };
            if series.starts_with("kvroute_flow_queue_depth{") {
                queued += v;
                bands.insert(label("kvroute_flow_queue_depth{priority="), json!(v as u64));
            } else if series.starts_with("kvroute_flow_queue_bytes{") {
                bytes += v;
            } else if series.starts_with("kvroute_flow_rejections_total{") {
                rejections.insert(label("kvroute_flow_rejections_total{reason=").replace('-', "_"), json!(v as u64));
            }
        }
        let n = |name: &str| stat(&page, name).unwrap_or(0.0) as u64;
        json!({
            "queued": queued as u64,
            "queued_bytes": bytes as u64,
            "bands": bands,
            "counters": {
                "admitted": n("kvroute_flow_admitted_total"),
                "enqueued": n("kvroute_flow_enqueued_total"),
                "dispatched": n("kvroute_flow_dispatched_total"),
                "cancelled": n("kvroute_flow_cancelled_total"),
                "shed": n("kvroute_flow_shed_total"),
                "rejections": rejections,
            },
        })
    }

    /// The releases the filter acted on since the last call, in order, checked against their
    /// streams.
    fn releases(&mut self, errors: &mut Vec<String>, at: &str) -> Value {
        let mut views = Vec::new();
        for l in self.host.take_logs() {
            let Some(what) = l.message.strip_prefix(RELEASE_LOG) else { continue };
            let id = self.ids.get(&l.context_id).cloned().unwrap_or_else(|| format!("context {}", l.context_id));
            let (what, waited) = what.rsplit_once(" after ").unwrap();
            let waited: u64 = waited.trim_end_matches(" ms").parse().unwrap();
            let s = self.streams.get(&id).copied();
            if what == "dispatched" {
                let route = s.map_or(json!({"error": "no stream"}), |s| self.route_view(s));
                views.push(json!({"id": id, "outcome": "dispatched", "waited_ms": waited, "route": route}));
                continue;
            }
            // "dropped (429 rejected-ttl-expired)"
            let inner = what.trim_start_matches("dropped (").trim_end_matches(')');
            let (status, reason) = inner.split_once(' ').unwrap();
            let status: u64 = status.parse().unwrap();
            let answered = s.and_then(|s| self.host.stream(s).ok()).and_then(|st| st.local_reply().cloned());
            match answered {
                Some(l)
                    if u64::from(l.status) == status
                        && l.headers.get(kvroute::HEADER_DROPPED_REASON) == Some(reason)
                        && st_upstream_none(&self.host, s) => {}
                other => errors.push(format!("{at}: {id} dropped ({status} {reason}) but answered {other:?}")),
            }
            views
                .push(json!({"id": id, "outcome": "dropped", "status": status, "reason": reason, "waited_ms": waited}));
        }
        Value::Array(views)
    }
}

fn st_upstream_none(host: &Host, s: Option<StreamId>) -> bool {
    s.and_then(|s| host.stream(s).ok()).is_some_and(|st| st.upstream_headers().is_none())
}

/// The case through the filter: its trace, the steps skipped, and what went wrong on the way.
fn through_filter(case: &Value, errors: &mut Vec<String>) -> (Trace, Vec<String>) {
    let name = case["name"].as_str().unwrap().to_owned();
    let mut f = Filter::new(case);
    let mut trace = Trace::new();
    let mut skipped = Vec::new();
    let steps = case["steps"].as_array().unwrap();
    let mut i = 0;
    while i < steps.len() {
        let step = &steps[i];
        let at = format!("{name} step {i}");
        let now = step.get("now_ms").and_then(Value::as_u64);
        let op = step["op"].as_str().unwrap();
        if f.stopped && matches!(op, "admit" | "stats" | "saturation") {
            skipped.push(format!("{at} ({op} after shutdown)"));
            i += 1;
            continue;
        }
        match op {
            "metrics" => {
                // Consecutive snapshots of one time: one poll round.
                let t = step["metrics"]["updated_ms"].as_u64().unwrap();
                let mut group = vec![step];
                while let Some(next) =
                    steps.get(i + 1).filter(|s| s["op"] == "metrics" && s["metrics"]["updated_ms"].as_u64() == Some(t))
                {
                    group.push(next);
                    i += 1;
                }
                let mut target = t + f.offset;
                if target <= f.clock() {
                    f.offset += f.clock() + 1 - target;
                    target = f.clock() + 1;
                }
                f.host.advance(Duration::from_millis(target - 1 - f.clock())).unwrap();
                for m in group {
                    f.pages.once(m["endpoint"].as_str().unwrap(), prometheus(&m["metrics"]));
                }
                f.host.advance(Duration::from_millis(1)).unwrap();
                f.pages.clear();
            }
            "upsert_endpoint" => {
                let id = step["endpoint"].as_str().unwrap();
                let role: Role = serde_json::from_value(step["role"].clone()).unwrap();
                match f.endpoints.iter_mut().find(|e| e.0 == id) {
                    Some(e) => e.1 = role,
                    None => f.endpoints.push((id.to_owned(), role, true)),
                }
                f.reconfigure(errors, &at);
            }
            "remove_endpoint" => {
                let id = step["endpoint"].as_str().unwrap();
                f.endpoints.retain(|e| e.0 != id);
                f.reconfigure(errors, &at);
            }
            "set_healthy" => {
                let id = step["endpoint"].as_str().unwrap();
                if let Some(e) = f.endpoints.iter_mut().find(|e| e.0 == id) {
                    e.2 = step["healthy"].as_bool().unwrap();
                }
                f.reconfigure(errors, &at);
            }
            "reload" => {
                f.policy = step["policy"].clone();
                f.reconfigure(errors, &at);
            }
            "admit" => {
                f.at(now.unwrap());
                f.flush(errors, &at);
                let id = step["id"].as_str().unwrap().to_owned();
                let body = body_of(case, step);
                let headers = headers_of(step);
                let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                let s = send(&mut f.host, f.vm, body.as_bytes(), &h).unwrap();
                f.ids.insert(s.context_id(), id.clone());
                f.streams.insert(id, s);
                let st = f.host.stream(s).unwrap();
                let dropped = st.local_reply().and_then(|l| {
                    l.headers.get(kvroute::HEADER_DROPPED_REASON).map(|r| rejected(u64::from(l.status), r))
                });
                let view = match dropped {
                    Some(rej) => json!({"admission": rej, "route": null}),
                    None if f.held(s) => json!({"admission": "queued", "route": null}),
                    None => json!({"admission": "admit", "route": f.route_view(s)}),
                };
                trace.insert(i, view);
            }
            "tick" => skipped.push(format!("{at} (tick: a filter's tick acts on its releases at once)")),
            "releases" => {
                f.at(now.unwrap());
                f.flush(errors, &at);
                let views = f.releases(errors, &at);
                trace.insert(i, views);
            }
            "complete" => f.deferred.push(step["id"].as_str().unwrap().to_owned()),
            "cancel" => {
                let id = step["id"].as_str().unwrap();
                let got = match f.streams.get(id).copied().filter(|s| f.held(*s)) {
                    Some(s) => {
                        let before = stat(&f.page(), "kvroute_flow_cancelled_total").unwrap_or(0.0);
                        f.host.finish_stream(s).unwrap();
                        f.streams.remove(id);
                        let after = stat(&f.page(), "kvroute_flow_cancelled_total").unwrap_or(0.0);
                        after > before
                    }
                    None => false,
                };
                trace.insert(i, json!(got));
            }
            "shutdown" => {
                f.host.shutdown_vm(f.vm).unwrap();
                f.stopped = true;
            }
            "stats" => {
                let v = f.stats_view();
                trace.insert(i, v);
            }
            "saturation" => {
                f.at(now.unwrap());
                let page = f.page();
                let pool = stat(&page, "kvroute_flow_saturation{stage=\"pool\"}").unwrap_or(f64::NAN);
                let decode = stat(&page, "kvroute_flow_saturation{stage=\"decode\"}").unwrap_or(f64::NAN);
                let prefill = stat(&page, "kvroute_flow_saturation{stage=\"prefill\"}");
                trace.insert(i, saturation_view(pool, decode, prefill));
            }
            other => panic!("{at}: unknown op {other}"),
        }
        i += 1;
    }
    f.flush(errors, &format!("{name} end"));
    // Nothing stays held, and the filter did nothing wrong.
    for (id, s) in &f.streams {
        if f.held(*s) {
            errors.push(format!("{name}: {id} is still held at the end"));
        }
    }
    if let Some(e) = f.host.failure(f.vm).unwrap() {
        errors.push(format!("{name}: the VM failed: {e}"));
    }
    for v in f.host.abi_violations().iter() {
        errors.push(format!("{name}: ABI violation {v:?}"));
    }
    (trace, skipped)
}

/// The fixture's expectations against a trace (as core/tests/golden_flow.rs judges them).
fn expectations(case: &Value, trace: &Trace, skipped: &[String], errors: &mut Vec<String>) {
    let name = case["name"].as_str().unwrap();
    for (i, step) in case["steps"].as_array().unwrap().iter().enumerate() {
        let at = format!("{name} step {i}");
        if skipped.iter().any(|s| s.starts_with(&format!("{at} "))) {
            continue;
        }
        let Some(got) = trace.get(&i) else { continue };
        match step["op"].as_str().unwrap() {
            "admit" => {
                check(&format!("{at} admission"), &step["expect"], &got["admission"], errors);
                if let Some(e) = step.get("expect_route") {
                    check(&format!("{at} route"), e, &got["route"], errors);
                }
            }
            "saturation" => {
                let mut expect = step["expect"].clone();
                if let Some(o) = expect.as_object_mut() {
                    o.remove("decode_endpoints");
                }
                check(&format!("{at} saturation"), &expect, got, errors);
            }
            op => check(&format!("{at} {op}"), &step["expect"], got, errors),
        }
    }
}

#[test]
fn golden_flow_fixture_suite_through_the_filter_matches_the_native_replay() {
    let files = files();
    assert!(files.len() >= 6, "the suite has at least 6 cases, found {}", files.len());
    let mut errors = Vec::new();
    let mut compared = 0;
    for file in &files {
        let case: Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
        let name = case["name"].as_str().unwrap().to_owned();
        let want = native(&case);
        let (got, skipped) = through_filter(&case, &mut errors);
        for s in &skipped {
            eprintln!("skipped (no filter equivalent): {s}");
        }
        expectations(&case, &got, &skipped, &mut errors);
        for (i, w) in &want {
            let at = format!("{name} step {i} ");
            if skipped.iter().any(|s| s.starts_with(&at)) {
                continue;
            }
            compared += 1;
            match got.get(i) {
                Some(g) if g == w => {}
                other => errors.push(format!("{at}: the filter gave {other:?}, the native replay {w}")),
            }
        }
        for i in got.keys().filter(|i| !want.contains_key(i)) {
            errors.push(format!("{name} step {i}: a filter result with no native one"));
        }
    }
    eprintln!("{} cases, {compared} step results identical to the native replay", files.len());
    assert!(errors.is_empty(), "{} mismatches:\n{}", errors.len(), errors.join("\n"));
}
