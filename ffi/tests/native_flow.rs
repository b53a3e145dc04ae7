//! The native side of the C flow-control replay's second check: replays every flow-control
//! fixture (`fixtures/golden-flow`, format in its README.md) through the Rust core directly, as
//! `core/tests/golden_flow.rs` does, and writes a trace of every step to `native-flow.tsv` in
//! cargo's test scratch directory (`target/tmp`): what the step returned, then flow control's
//! whole stats view and next deadline after it. `ffi/tests/golden_flow.c` replays the same
//! steps through the C API and must write exactly these lines (scripts/test-ffi.sh runs this
//! test first, then passes the file to the C program). The fixture expectations themselves are
//! checked by both replays.
//!
//! Line format: `<case name> TAB <step index> TAB <step view> TAB <stats> TAB <deadline>`:
//!
//! - step view: `admit`, `queued` or `rejected <status> <reason>` for an admission, then
//!   ` route <endpoint or -> <shed 0|1>` when it was routed (` route error` when routing failed);
//!   `releases` then ` <id>:dispatched:<waited_ms>:<endpoint or ->:<shed 0|1>` or
//!   ` <id>:dropped:<status>:<reason>:<waited_ms>` per release, in order; `cancel true|false`;
//!   `saturation <pool> <decode> <prefill or none> <decode endpoints>`; else the op's name;
//! - stats: `q=<queued> b=<bytes> w=<releases waiting> p=<pending dispatch>
//!   bands=<priority>:<queued>:<bytes>:<flows>:<ceiling>,... c=<admitted>,<enqueued>,<dispatched>,<cancelled>,<shed>
//!   r=<6 rejection counts by reason code> en=<0|1> sd=<0|1>`;
//! - deadline: `d=<ms or none>`.
//!
//! Numbers with a fraction are printed with 9 decimals (`{:.9}`, `%.9f` in C: both exact).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use kvroute::{Admission, DropReason, EndpointSpec, MetricsSnapshot, Policy, ReleaseOutcome, Role, Router, Ticket};
use serde_json::{json, Value};

#[derive(Default)]
struct Held {
    body: String,
    headers: Vec<(String, String)>,
    ticket: Option<Ticket>,
    request_id: Option<String>,
}

/// Route `h` at `now`: ` route <endpoint or -> <shed>`.
fn route(router: &Router, h: &mut Held, now: u64) -> String {
    match router.route_http(h.body.as_bytes(), h.headers.iter().map(|(k, v)| (k, v)), now) {
        Ok(d) => {
            let shed = d.shed().is_some();
            let view = format!(" route {} {}", d.endpoint().unwrap_or("-"), u8::from(shed));
            if !shed {
                h.request_id = Some(d.request_id);
            }
            view
        }
        Err(_) => " route error".to_owned(),
    }
}

fn stats(router: &Router) -> String {
    let s = router.flow_stats();
    let bands: Vec<String> = s
        .bands
        .iter()
        .map(|b| format!("{}:{}:{}:{}:{:.9}", b.priority, b.queued, b.queued_bytes, b.active_flows, b.ceiling))
        .collect();
    let c = &s.counters;
    let r: Vec<String> = DropReason::ALL.iter().map(|&x| c.rejections.get(x).to_string()).collect();
    format!(
        "q={} b={} w={} p={} bands={} c={},{},{},{},{} r={} en={} sd={}",
        s.queued,
        s.queued_bytes,
        s.releases_waiting,
        s.pending_dispatch,
        bands.join(","),
        c.admitted,
        c.enqueued,
        c.dispatched,
        c.cancelled,
        c.shed,
        r.join(","),
        u8::from(s.enabled),
        u8::from(s.shutting_down)
    )
}

/// Replays one case; appends one line per step to `out`.
fn replay(case: &Value, out: &mut String) -> usize {
    let name = case["name"].as_str().unwrap();
    let router = Router::new(Policy::from_json(&case["policy"].to_string()).unwrap());
    let default_body = case.get("body").cloned().unwrap_or(json!({"model": "m", "prompt": "hello", "max_tokens": 16}));
    for e in case["endpoints"].as_array().unwrap() {
        let role: Role = serde_json::from_value(e["role"].clone()).unwrap();
        router.upsert_endpoint(EndpointSpec::new(e["id"].as_str().unwrap(), role)).unwrap();
    }
    let mut held: BTreeMap<String, Held> = BTreeMap::new();
    let mut by_ticket: BTreeMap<Ticket, String> = BTreeMap::new();
    let steps = case["steps"].as_array().unwrap();
    for (i, step) in steps.iter().enumerate() {
        let now = step.get("now_ms").and_then(Value::as_u64);
        let s = |key: &str| step[key].as_str().unwrap().to_owned();
        let op = step["op"].as_str().unwrap();
        let route_on = step.get("route").and_then(Value::as_bool).unwrap_or(true);
        let view = match op {
            "metrics" => {
                let m: MetricsSnapshot = serde_json::from_value(step["metrics"].clone()).unwrap();
                router.update_metrics(&s("endpoint"), m).unwrap();
                op.to_owned()
            }
            "upsert_endpoint" => {
                let role: Role = serde_json::from_value(step["role"].clone()).unwrap();
                router.upsert_endpoint(EndpointSpec::new(s("endpoint").as_str(), role)).unwrap();
                op.to_owned()
            }
            "remove_endpoint" => {
                router.remove_endpoint(&s("endpoint")).unwrap();
                op.to_owned()
            }
            "set_healthy" => {
                router.set_healthy(&s("endpoint"), step["healthy"].as_bool().unwrap()).unwrap();
                op.to_owned()
            }
            "reload" => {
                router.reload_str(&step["policy"].to_string()).unwrap();
                op.to_owned()
            }
            "admit" => {
                let id = s("id");
                let body = step.get("body").unwrap_or(&default_body).to_string();
                let headers: Vec<(String, String)> = step
                    .get("headers")
                    .and_then(Value::as_object)
                    .map(|h| h.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned())).collect())
                    .unwrap_or_default();
                let a = router.admit_http(body.as_bytes(), headers.iter().map(|(k, v)| (k, v)), now.unwrap()).unwrap();
                let mut h = Held { body, headers, ticket: a.ticket(), request_id: None };
                let mut v = match a {
                    Admission::Admit => "admit".to_owned(),
                    Admission::Queued(t) => {
                        by_ticket.insert(t, id.clone());
                        "queued".to_owned()
                    }
                    Admission::Rejected(r) => format!("rejected {} {}", r.status, r.reason.as_str()),
                };
                if a == Admission::Admit && route_on {
                    v.push_str(&route(&router, &mut h, now.unwrap()));
                }
                held.insert(id, h);
                v
            }
            "tick" => {
                router.tick(now.unwrap());
                op.to_owned()
            }
            "releases" => {
                let mut v = "releases".to_owned();
                for r in router.take_releases(now.unwrap()) {
                    let id = by_ticket.remove(&r.ticket).unwrap_or_else(|| format!("unknown-{}", r.ticket));
                    match r.outcome {
                        ReleaseOutcome::Dispatched => {
                            let routed = match held.get_mut(&id) {
                                Some(h) if route_on => route(&router, h, now.unwrap()),
                                _ => String::new(),
                            };
                            let routed = routed.strip_prefix(" route ").unwrap_or(&routed).replace(' ', ":");
                            write!(v, " {id}:dispatched:{}:{routed}", r.waited_ms).unwrap();
                        }
                        ReleaseOutcome::Dropped(rej) => {
                            write!(v, " {id}:dropped:{}:{}:{}", rej.status, rej.reason.as_str(), r.waited_ms).unwrap();
                        }
                    }
                }
                v
            }
            "complete" => {
                let rid = held.get(&s("id")).and_then(|h| h.request_id.clone()).expect("complete of an unrouted id");
                router.complete(&rid).unwrap();
                op.to_owned()
            }
            "cancel" => {
                let t = held.get(&s("id")).and_then(|h| h.ticket).unwrap_or(Ticket(0));
                let got = router.cancel(t);
                if got {
                    by_ticket.remove(&t);
                }
                format!("cancel {got}")
            }
            "shutdown" => {
                router.shutdown_queue();
                op.to_owned()
            }
            "stats" => op.to_owned(),
            "saturation" => {
                let r = router.flow_saturation(now.unwrap());
                let prefill = r.prefill.map_or_else(|| "none".to_owned(), |p| format!("{p:.9}"));
                format!("saturation {:.9} {:.9} {prefill} {}", r.pool, r.decode, r.decode_endpoints)
            }
            other => panic!("{name} step {i}: unknown op {other}"),
        };
        let deadline = router.next_flow_deadline().map_or_else(|| "none".to_owned(), |d| d.to_string());
        writeln!(out, "{name}\t{i}\t{view}\t{}\td={deadline}", stats(&router)).unwrap();
    }
    assert!(by_ticket.is_empty(), "{name}: tickets still held at the end");
    steps.len()
}

#[test]
fn native_trace_of_the_flow_fixtures() {
    let files = kvroute_sim::golden::json_files(&kvroute_sim::golden::flow_dir()).unwrap();
    let mut out = String::new();
    let mut steps = 0;
    for f in &files {
        let case: Value = serde_json::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
        steps += replay(&case, &mut out);
    }
    assert!(files.len() >= 10, "{} fixtures", files.len());
    assert_eq!(out.lines().count(), steps);
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("native-flow.tsv");
    std::fs::write(&path, out).unwrap();
}
