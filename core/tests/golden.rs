//! Replays the binding-neutral golden fixture suite in `fixtures/golden/` (format:
//! `fixtures/golden/README.md`). Python, C and the wasm host replay the same files.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::path::{Path, PathBuf};

use kvroute::{
    Decision, EndpointSpec, EventIngestError, MetricsSnapshot, Policy, RequestError, Role, RouteError, Router,
    StateError,
};
use serde_json::{json, Map, Value};

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/golden")
}

/// The decision as the fixtures see it (documented in fixtures/golden/README.md).
fn view(d: &Decision) -> Value {
    let headers: Map<String, Value> = d.headers.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect();
    let filtered: Map<String, Value> =
        d.breakdown().map(|(e, s)| (e.to_owned(), serde_json::to_value(s.filtered).unwrap())).collect();
    let scores: Map<String, Value> = d
        .breakdown()
        .map(|(e, s)| {
            (
                e.to_owned(),
                json!({
                    "matched_blocks": s.matched_blocks, "cached_tokens": s.cached_tokens, "precise": s.precise,
                    "prefix_hit": s.prefix_hit, "lora": s.lora,
                    "queue": s.queue, "kv_usage": s.kv_usage, "session": s.session,
                    "inflight": s.inflight, "total": s.total,
                }),
            )
        })
        .collect();
    json!({
        "request_id": d.request_id,
        "policy_version": d.policy_version,
        "rule": d.rule.as_str(),
        "mode": d.mode().map(|m| m.as_str()),
        "endpoint": d.endpoint(),
        "prefill_endpoint": d.prefill_endpoint(),
        "shed": d.shed().is_some(),
        "status": d.shed().map(|s| s.status),
        "headers": headers,
        "prefix_hit": d.prefix_hit,
        "cached_tokens": d.cached_tokens,
        "input_tokens": d.input_tokens,
        "relaxed_filters": d.relaxed_filters,
        "judgment": serde_json::to_value(d.judgment).unwrap(),
        "transfer_pays": d.transfer.map(|t| t.pays),
        "filtered": filtered,
        "scores": scores,
    })
}

/// `expect` matches `actual`: numbers within 1e-9, objects by subset except `headers` (exact).
fn check(path: &str, expect: &Value, actual: &Value, errors: &mut Vec<String>) {
    match (expect, actual) {
        (Value::Number(e), Value::Number(a)) => {
            let (e, a) = (e.as_f64().unwrap(), a.as_f64().unwrap());
            if (e - a).abs() > 1e-9 {
                errors.push(format!("{path}: expected {e}, got {a}"));
            }
        }
        (Value::Object(e), Value::Object(a)) => {
            if path.ends_with("headers") && e.len() != a.len() {
                errors.push(format!("{path}: expected exactly {expect}, got {actual}"));
                return;
            }
            for (k, ev) in e {
                match a.get(k) {
                    Some(av) => check(&format!("{path}.{k}"), ev, av, errors),
                    None => errors.push(format!("{path}.{k}: missing in actual {actual}")),
                }
            }
        }
        _ if expect == actual => {}
        _ => errors.push(format!("{path}: expected {expect}, got {actual}")),
    }
}

fn error_kind(e: &RouteError) -> (&'static str, Option<String>, Option<String>) {
    match e {
        RouteError::Request(RequestError::Field { field, .. }) => ("request", Some(field.clone()), None),
        RouteError::Request(RequestError::Header { header, .. }) => ("request", None, Some(header.clone())),
        RouteError::Request(_) => ("request", None, None),
        RouteError::NoEndpoints { .. } => ("no_endpoints", None, None),
        _ => ("other", None, None),
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}

fn role(v: &Value) -> Role {
    serde_json::from_value(v.clone()).unwrap()
}

fn run_case(path: &Path) -> Vec<String> {
    let case: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let name = case["name"].as_str().unwrap().to_owned();
    let policy = match case.get("policy") {
        Some(p) => Policy::from_json(&p.to_string()).unwrap(),
        None => Policy::default(),
    };
    let router = Router::new(policy);
    for e in case["endpoints"].as_array().unwrap() {
        router.upsert_endpoint(EndpointSpec::new(e["id"].as_str().unwrap(), role(&e["role"]))).unwrap();
    }
    let mut errors = Vec::new();
    for (i, step) in case["steps"].as_array().unwrap().iter().enumerate() {
        let at = format!("{name} step {i}");
        match step["op"].as_str().unwrap() {
            "metrics" => {
                let m: MetricsSnapshot = serde_json::from_value(step["metrics"].clone()).unwrap();
                router.update_metrics(step["endpoint"].as_str().unwrap(), m).unwrap();
            }
            "upsert_endpoint" => {
                router.upsert_endpoint(EndpointSpec::new(step["id"].as_str().unwrap(), role(&step["role"]))).unwrap();
            }
            "remove_endpoint" => router.remove_endpoint(step["id"].as_str().unwrap()).unwrap(),
            "set_healthy" => {
                router.set_healthy(step["id"].as_str().unwrap(), step["healthy"].as_bool().unwrap()).unwrap();
            }
            "reload" => {
                router.reload_str(&step["policy"].to_string()).unwrap();
            }
            "resync" => {
                router.resync_stream(step["endpoint"].as_str().unwrap(), step["now_ms"].as_u64().unwrap()).unwrap();
            }
            "events" => {
                let payload = hex(step["payload_hex"].as_str().unwrap());
                let seq = step["seq"].as_u64();
                let now = step["now_ms"].as_u64().unwrap();
                match (
                    router.apply_events(step["endpoint"].as_str().unwrap(), &payload, seq, now),
                    step.get("expect_error"),
                ) {
                    (Ok(out), None) => {
                        if let Some(expect) = step.get("expect") {
                            let mut v = serde_json::to_value(out.verdict).unwrap();
                            v["blocks"] = json!(out.blocks);
                            v["events"] = json!(out.events);
                            check(&at, expect, &v, &mut errors);
                        }
                    }
                    (Err(EventIngestError::Decode(_)), Some(e)) if e["kind"] == "decode" => {}
                    (r, e) => errors.push(format!("{at}: events gave {r:?}, expected {e:?}")),
                }
            }
            "reload_invalid" => {
                let before = router.policy().version;
                if router.reload_str(&step["policy"].to_string()).is_ok() {
                    errors.push(format!("{at}: invalid policy was accepted"));
                }
                assert_eq!(router.policy().version, before);
            }
            "complete" => {
                let r = router.complete(step["request_id"].as_str().unwrap());
                match (&r, step.get("expect_error")) {
                    (Ok(()), None) => {}
                    (Err(StateError::UnknownRequest { .. }), Some(e)) if e["kind"] == "unknown_request" => {}
                    _ => errors.push(format!("{at}: complete gave {r:?}, expected {:?}", step.get("expect_error"))),
                }
            }
            "route" => {
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
                let now = step["now_ms"].as_u64().unwrap();
                let result = router.route_http(body.as_bytes(), headers.iter().map(|(k, v)| (k, v)), now);
                match (result, step.get("expect_error")) {
                    (Ok(d), None) => {
                        if let Some(expect) = step.get("expect") {
                            check(&at, expect, &view(&d), &mut errors);
                        }
                        if step.get("complete").and_then(Value::as_bool).unwrap_or(false) && d.shed().is_none() {
                            router.complete(&d.request_id).unwrap();
                        }
                    }
                    (Err(e), Some(expect)) => {
                        let (kind, field, header) = error_kind(&e);
                        if expect["kind"] != kind {
                            errors.push(format!("{at}: expected error {expect}, got {e:?}"));
                        }
                        if let Some(f) = expect.get("field") {
                            if Some(f.as_str().unwrap().to_owned()) != field {
                                errors.push(format!("{at}: expected error field {f}, got {e:?}"));
                            }
                        }
                        if let Some(h) = expect.get("header") {
                            if Some(h.as_str().unwrap().to_owned()) != header {
                                errors.push(format!("{at}: expected error header {h}, got {e:?}"));
                            }
                        }
                    }
                    (Ok(d), Some(_)) => errors.push(format!("{at}: expected an error, got {}", view(&d))),
                    (Err(e), None) => errors.push(format!("{at}: unexpected error {e:?}")),
                }
            }
            other => panic!("{at}: unknown op {other}"),
        }
    }
    errors
}

#[test]
fn golden_fixture_suite() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(golden_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 25, "the suite has at least 25 cases, found {}", files.len());
    let mut all = Vec::new();
    let mut rules = std::collections::BTreeSet::new();
    for f in &files {
        all.extend(run_case(f));
        let text = std::fs::read_to_string(f).unwrap();
        for r in kvroute::Rule::ALL {
            if text.contains(&format!("\"rule\": \"{}\"", r.as_str())) {
                rules.insert(r.as_str());
            }
        }
    }
    assert!(all.is_empty(), "{} mismatches:\n{}", all.len(), all.join("\n"));
    assert_eq!(rules.len(), kvroute::Rule::ALL.len(), "every rule is covered by an expectation: {rules:?}");
}
