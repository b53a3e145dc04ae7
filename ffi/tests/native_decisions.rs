//! The native side of the C golden replay's second check: replays every golden fixture
//! (`fixtures/golden`) through the Rust core directly and writes each route step's decision, as
//! `Decision::to_json`, to `native-decisions.tsv` in cargo's test scratch directory
//! (`target/tmp`). `ffi/tests/golden.c` routes the same steps through the C API and requires
//! `kvroute_decision_to_json` to be byte for byte these lines (scripts/test-ffi.sh runs this test
//! first, then passes the file to the C program).
//!
//! Line format: `<case name> TAB <step index> TAB <decision JSON, or "error" for a failed route>`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::path::Path;

use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Role, Router};
use serde_json::Value;

fn role(v: &Value) -> Role {
    serde_json::from_value(v.clone()).unwrap()
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}

/// Replays one case; appends its route decisions to `out`; returns how many routes it made.
fn replay(case: &Value, out: &mut String) -> usize {
    let name = case["name"].as_str().unwrap();
    let policy = case.get("policy").map_or_else(Policy::default, |p| Policy::from_json(&p.to_string()).unwrap());
    let router = Router::new(policy);
    for e in case["endpoints"].as_array().unwrap() {
        router.upsert_endpoint(EndpointSpec::new(e["id"].as_str().unwrap(), role(&e["role"]))).unwrap();
    }
    let s = |step: &Value, key: &str| step[key].as_str().unwrap_or_default().to_owned();
    let mut routes = 0;
    // Failures of state operations are the fixtures' business (core/tests/golden.rs checks
    // them); here they only have to happen as they do through the C API.
    for (i, step) in case["steps"].as_array().unwrap().iter().enumerate() {
        let now = step["now_ms"].as_u64().unwrap_or(0);
        match step["op"].as_str().unwrap() {
            "metrics" => {
                let m: MetricsSnapshot = serde_json::from_value(step["metrics"].clone()).unwrap();
                let _ = router.update_metrics(&s(step, "endpoint"), m);
            }
            "upsert_endpoint" => {
                let _ = router.upsert_endpoint(EndpointSpec::new(s(step, "id").as_str(), role(&step["role"])));
            }
            "remove_endpoint" => {
                let _ = router.remove_endpoint(&s(step, "id"));
            }
            "set_healthy" => {
                let _ = router.set_healthy(&s(step, "id"), step["healthy"].as_bool().unwrap());
            }
            "reload" | "reload_invalid" => {
                let _ = router.reload_str(&step["policy"].to_string());
            }
            "resync" => {
                let _ = router.resync_stream(&s(step, "endpoint"), now);
            }
            "events" => {
                let payload = hex(step["payload_hex"].as_str().unwrap());
                let _ = router.apply_events(&s(step, "endpoint"), &payload, step["seq"].as_u64(), now);
            }
            "complete" => {
                let _ = router.complete(&s(step, "request_id"));
            }
            "route" => {
                routes += 1;
                let body = match (step.get("body"), step.get("body_raw")) {
                    (Some(b), None) => b.to_string(),
                    (None, Some(Value::String(raw))) => raw.clone(),
                    _ => panic!("{name} step {i}: a route step needs `body` or `body_raw`"),
                };
                let headers: Vec<(String, String)> = step
                    .get("headers")
                    .and_then(Value::as_object)
                    .map(|h| h.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned())).collect())
                    .unwrap_or_default();
                match router.route_http(body.as_bytes(), headers.iter().map(|(k, v)| (k, v)), now) {
                    Ok(d) => {
                        writeln!(out, "{name}\t{i}\t{}", d.to_json()).unwrap();
                        if step.get("complete").and_then(Value::as_bool).unwrap_or(false) && d.shed().is_none() {
                            router.complete(&d.request_id).unwrap();
                        }
                    }
                    Err(_) => writeln!(out, "{name}\t{i}\terror").unwrap(),
                }
            }
            other => panic!("{name} step {i}: unknown op {other}"),
        }
    }
    routes
}

#[test]
fn native_decisions_of_the_golden_fixtures() {
    let files = kvroute_sim::golden::files().unwrap();
    let mut out = String::new();
    let mut routes = 0;
    for f in &files {
        let case: Value = serde_json::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
        routes += replay(&case, &mut out);
    }
    assert!(files.len() >= 40, "{} fixtures", files.len());
    assert_eq!(out.lines().count(), routes);
    assert!(out.lines().filter(|l| !l.ends_with("\terror")).count() >= 60, "too few decisions");
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("native-decisions.tsv");
    std::fs::write(&path, out).unwrap();
}
