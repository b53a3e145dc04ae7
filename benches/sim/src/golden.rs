//! Replaying the binding-neutral golden fixture suite (`fixtures/golden/*.json`, format in
//! `fixtures/golden/README.md`) on a Rust surface: the core's own tests (`core/tests/golden.rs`)
//! and the Envoy filter's in its wasmtime host (`wasm-filter/tests/tests/filter_golden.rs`).
//!
//! What is the fixtures' business lives here once: reading and checking the cases ([`suite`],
//! [`load`]: typed [`Case`]s and [`Step`]s), driving their steps in order ([`replay`]), and judging
//! what a surface reports against the expectations: the decision view ([`view`] of a
//! [`Decision`], [`view_json`] of its JSON form, one and the same object) compared by [`check`]
//! (numbers within 1e-9, objects by subset except `headers`, exactly), route errors by kind, field
//! and header, event verdicts, completions. A surface only says how it performs each operation
//! ([`Surface`]).
//!
//! ```
//! use kvroute_sim::golden;
//!
//! let cases = golden::suite()?;
//! assert!(cases.len() >= 25);
//! let case = golden::case("41_precise_event_fed_hit")?;
//! assert!(case.steps.iter().any(|s| matches!(s, golden::Step::Events(_))));
//! # Ok::<(), golden::FixtureError>(())
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::path::{Path, PathBuf};

use kvroute::{Decision, Role};
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// A fixture that cannot be read or does not follow the format.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FixtureError {
    /// The file or directory could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a case of the documented format.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong with it (with the JSON path of the offending value).
        message: String,
    },
}

/// The directory of the suite in this repository (`fixtures/golden`).
pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden")
}

/// The suite's files (`*.json` in [`dir`]), sorted by name.
pub fn files() -> Result<Vec<PathBuf>, FixtureError> {
    json_files(&dir())
}

/// The directory of the flow-control suite (`fixtures/golden-flow`).
pub fn flow_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden-flow")
}

/// The `*.json` files of `dir`, sorted by name (the fixture suites' listing, for every replay).
pub fn json_files(dir: &Path) -> Result<Vec<PathBuf>, FixtureError> {
    let io = |source| FixtureError::Io { path: dir.display().to_string(), source };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.extension().is_some_and(|x| x == "json") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Every case of the suite, in file-name order.
pub fn suite() -> Result<Vec<Case>, FixtureError> {
    files()?.iter().map(|p| load(p)).collect()
}

/// The case in `fixtures/golden/<name>.json`.
pub fn case(name: &str) -> Result<Case, FixtureError> {
    load(&dir().join(format!("{name}.json")))
}

/// The case in `fixtures/golden/<name>.json` as plain JSON (for tests that take single steps of
/// a case apart).
pub fn case_json(name: &str) -> Result<Value, FixtureError> {
    let path = dir().join(format!("{name}.json"));
    let text = read(&path)?;
    serde_json::from_str(&text)
        .map_err(|e| FixtureError::Format { path: path.display().to_string(), message: e.to_string() })
}

/// Read and check one case file.
pub fn load(path: &Path) -> Result<Case, FixtureError> {
    let text = read(path)?;
    let mut de = serde_json::Deserializer::from_str(&text);
    let case: Case = serde_path_to_error::deserialize(&mut de).map_err(|e| FixtureError::Format {
        path: path.display().to_string(),
        message: format!("`{}`: {}", e.path(), e.inner()),
    })?;
    de.end().map_err(|e| FixtureError::Format { path: path.display().to_string(), message: e.to_string() })?;
    Ok(case)
}

fn read(path: &Path) -> Result<String, FixtureError> {
    std::fs::read_to_string(path).map_err(|source| FixtureError::Io { path: path.display().to_string(), source })
}

/// Bytes of a hex string (the fixtures' `payload_hex`); `None` when it is not an even number of
/// hex digits.
pub fn hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len() / 2).map(|i| s.get(2 * i..2 * i + 2).and_then(|b| u8::from_str_radix(b, 16).ok())).collect()
}

/// One golden case.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// The case's name (its file name without `.json`).
    pub name: String,
    /// What the case shows.
    #[serde(default)]
    pub description: Option<String>,
    /// The policy document (`None`: the defaults).
    #[serde(default)]
    pub policy: Option<Value>,
    /// Endpoints registered, in order, before the first step.
    pub endpoints: Vec<EndpointEntry>,
    /// The steps, run in order on one router.
    pub steps: Vec<Step>,
}

impl Case {
    /// The rules the case's route expectations name (`expect.rule`).
    pub fn expected_rules(&self) -> BTreeSet<&str> {
        self.steps
            .iter()
            .filter_map(|s| match s {
                Step::Route(r) => r.expect.as_ref()?.get("rule")?.as_str(),
                _ => None,
            })
            .collect()
    }
}

/// An endpoint of a case.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointEntry {
    /// Its id (`host:port`).
    pub id: String,
    /// Its role.
    pub role: Role,
}

/// One step of a case (`op`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Step {
    /// Store a metrics snapshot.
    Metrics(Metrics),
    /// Route an HTTP request.
    Route(Route),
    /// Complete a request.
    Complete {
        /// The request id.
        request_id: String,
        /// The error expected (`unknown_request`).
        #[serde(default)]
        expect_error: Option<ExpectedError>,
    },
    /// Register or change an endpoint.
    UpsertEndpoint {
        /// Its id.
        id: String,
        /// Its role.
        role: Role,
    },
    /// Remove an endpoint.
    RemoveEndpoint {
        /// Its id.
        id: String,
    },
    /// Mark an endpoint's health.
    SetHealthy {
        /// Its id.
        id: String,
        /// Healthy or not.
        healthy: bool,
    },
    /// Reload a valid policy (must succeed).
    Reload {
        /// The policy document.
        policy: Value,
    },
    /// Reload an invalid policy: must fail and leave the policy as it was.
    ReloadInvalid {
        /// The policy document.
        policy: Value,
    },
    /// Apply a batch of engine KV events.
    Events(Events),
    /// Give up on a gapped event stream.
    Resync {
        /// The endpoint.
        endpoint: String,
        /// Time of the step, ms.
        now_ms: u64,
    },
}

impl Step {
    /// The step's `op`.
    pub fn op(&self) -> &'static str {
        match self {
            Step::Metrics(_) => "metrics",
            Step::Route(_) => "route",
            Step::Complete { .. } => "complete",
            Step::UpsertEndpoint { .. } => "upsert_endpoint",
            Step::RemoveEndpoint { .. } => "remove_endpoint",
            Step::SetHealthy { .. } => "set_healthy",
            Step::Reload { .. } => "reload",
            Step::ReloadInvalid { .. } => "reload_invalid",
            Step::Events(_) => "events",
            Step::Resync { .. } => "resync",
        }
    }
}

/// A `metrics` step.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metrics {
    /// The endpoint.
    pub endpoint: String,
    /// The snapshot as the fixture gives it (`waiting`, `running`, `kv_usage`, `updated_ms`,
    /// optional `lora_running`, `lora_waiting`, `max_lora`): kept as JSON, since surfaces feed it
    /// differently (a `MetricsSnapshot`, a metrics page).
    pub metrics: Value,
}

impl Metrics {
    /// When the snapshot was taken, ms.
    pub fn updated_ms(&self) -> Option<u64> {
        self.metrics.get("updated_ms").and_then(Value::as_u64)
    }
}

/// A `route` step.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "RawRoute")]
pub struct Route {
    /// Time of the request, ms.
    pub now_ms: u64,
    /// The body to send: `body` serialized compactly, or `body_raw` as it is.
    pub body: String,
    /// Request headers (name, value), by name.
    pub headers: Vec<(String, String)>,
    /// Complete the request right after routing it (unless it was shed).
    pub complete: bool,
    /// The expected decision view (a subset).
    pub expect: Option<Value>,
    /// The expected error.
    pub expect_error: Option<ExpectedError>,
}

impl Route {
    /// The headers as `(&str, &str)` pairs.
    pub fn header_pairs(&self) -> Vec<(&str, &str)> {
        self.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    now_ms: u64,
    #[serde(default)]
    body: Option<Value>,
    #[serde(default)]
    body_raw: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    complete: bool,
    #[serde(default)]
    expect: Option<Value>,
    #[serde(default)]
    expect_error: Option<ExpectedError>,
}

impl TryFrom<RawRoute> for Route {
    type Error = String;

    fn try_from(r: RawRoute) -> Result<Route, String> {
        let body = match (r.body, r.body_raw) {
            (Some(b), None) => b.to_string(),
            (None, Some(raw)) => raw,
            _ => return Err("a route step needs `body` or `body_raw` (one of them)".into()),
        };
        Ok(Route {
            now_ms: r.now_ms,
            body,
            headers: r.headers.into_iter().collect(),
            complete: r.complete,
            expect: r.expect,
            expect_error: r.expect_error,
        })
    }
}

/// An `events` step.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Events {
    /// The publishing endpoint.
    pub endpoint: String,
    /// The batch as its engine publishes it (msgpack; `payload_hex` in the file).
    #[serde(rename = "payload_hex", deserialize_with = "hex_bytes")]
    pub payload: Vec<u8>,
    /// The batch's sequence number (`None`: unsequenced).
    #[serde(default)]
    pub seq: Option<u64>,
    /// Time of the step, ms.
    pub now_ms: u64,
    /// The expected outcome (a subset of {`verdict`, `expected`, `got`, `blocks`, `events`}).
    #[serde(default)]
    pub expect: Option<Value>,
    /// The expected error (`decode`).
    #[serde(default)]
    pub expect_error: Option<ExpectedError>,
}

fn hex_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let s = String::deserialize(d)?;
    hex(&s).ok_or_else(|| serde::de::Error::custom("not a hex string"))
}

/// An `expect_error`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpectedError {
    /// `request`, `no_endpoints` (route), `unknown_request` (complete), `decode` (events).
    pub kind: String,
    /// The body field the error names (route).
    #[serde(default)]
    pub field: Option<String>,
    /// The header the error names (route).
    #[serde(default)]
    pub header: Option<String>,
}

/// Where a replay is, and the mismatches found so far.
#[derive(Debug, Default)]
pub struct Cx {
    at: String,
    errors: Vec<String>,
}

impl Cx {
    /// `<case> step <i>`: where the replay is.
    pub fn at(&self) -> &str {
        &self.at
    }

    /// Record a mismatch at the current step.
    pub fn fail(&mut self, message: impl Display) {
        self.errors.push(format!("{}: {message}", self.at));
    }
}

/// A route as a surface reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum Routed {
    /// A decision, as the golden view ([`view`] or [`view_json`]).
    Decision(Value),
    /// The request was refused.
    Error(RouteFailure),
    /// The surface could not tell (it recorded why with [`Cx::fail`]).
    Unknown,
}

/// A refused route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteFailure {
    /// `request`, `no_endpoints` or `other`.
    pub kind: String,
    /// The body field a request error names.
    pub field: Option<String>,
    /// The header a request error names.
    pub header: Option<String>,
    /// The error as the surface shows it (for messages).
    pub detail: String,
}

/// An event batch as a surface reports it.
#[derive(Debug, Clone, PartialEq)]
pub enum Ingested {
    /// Applied (or judged a duplicate, gap, reset): the outcome as JSON (`verdict` with its
    /// fields, `blocks`, `events`).
    Outcome(Value),
    /// The payload did not decode.
    DecodeError,
    /// Anything else (described).
    Other(String),
}

/// A completion as a surface reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completed {
    /// The request was in flight and is done.
    Done,
    /// No such request in flight.
    UnknownRequest,
    /// Anything else (described).
    Other(String),
}

/// How one surface (the core's router, the filter in its host, …) performs the fixtures'
/// operations. Failures of an operation that must succeed are recorded with [`Cx::fail`];
/// what the fixtures have expectations about is returned and judged by [`replay`].
pub trait Surface {
    /// Metric snapshots taken at the same time (consecutive `metrics` steps with the same
    /// `updated_ms`, in order).
    fn metrics(&mut self, cx: &mut Cx, snapshots: &[&Metrics]);
    /// Route a request; when `step.complete` is set and the request was not shed, complete it
    /// right after.
    fn route(&mut self, cx: &mut Cx, step: &Route) -> Routed;
    /// Complete a request.
    fn complete(&mut self, cx: &mut Cx, request_id: &str) -> Completed;
    /// Register or change an endpoint.
    fn upsert_endpoint(&mut self, cx: &mut Cx, id: &str, role: Role);
    /// Remove an endpoint.
    fn remove_endpoint(&mut self, cx: &mut Cx, id: &str);
    /// Mark an endpoint's health.
    fn set_healthy(&mut self, cx: &mut Cx, id: &str, healthy: bool);
    /// Reload a valid policy.
    fn reload(&mut self, cx: &mut Cx, policy: &Value);
    /// Try to reload an invalid policy; whether it was accepted. The policy in force must stay
    /// as it was (a surface checks what it can of that).
    fn reload_invalid(&mut self, cx: &mut Cx, policy: &Value) -> bool;
    /// Apply an event batch.
    fn events(&mut self, cx: &mut Cx, step: &Events) -> Ingested;
    /// Give up on an endpoint's gapped event stream.
    fn resync(&mut self, cx: &mut Cx, endpoint: &str, now_ms: u64);
}

/// Run `case`'s steps on `surface` (set up with the case's policy and endpoints) and judge every
/// expectation; returns the mismatches, each prefixed with `<case> step <i>`.
pub fn replay(case: &Case, surface: &mut dyn Surface) -> Vec<String> {
    let mut cx = Cx::default();
    let mut i = 0;
    while i < case.steps.len() {
        cx.at = format!("{} step {i}", case.name);
        match &case.steps[i] {
            Step::Metrics(m) => {
                let mut group = vec![m];
                while let Some(Step::Metrics(next)) = case.steps.get(i + 1) {
                    if next.updated_ms() != m.updated_ms() {
                        break;
                    }
                    group.push(next);
                    i += 1;
                }
                surface.metrics(&mut cx, &group);
            }
            Step::Route(r) => match (surface.route(&mut cx, r), &r.expect_error) {
                (Routed::Decision(v), None) => {
                    if let Some(expect) = &r.expect {
                        let at = cx.at.clone();
                        check(&at, expect, &v, &mut cx.errors);
                    }
                }
                (Routed::Error(e), Some(expect)) => {
                    if e.kind != expect.kind {
                        cx.fail(format_args!("expected error {expect:?}, got {}", e.detail));
                    }
                    if expect.field.is_some() && expect.field != e.field {
                        cx.fail(format_args!("expected error field {:?}, got {}", expect.field, e.detail));
                    }
                    if expect.header.is_some() && expect.header != e.header {
                        cx.fail(format_args!("expected error header {:?}, got {}", expect.header, e.detail));
                    }
                }
                (Routed::Decision(v), Some(_)) => cx.fail(format_args!("expected an error, got {v}")),
                (Routed::Error(e), None) => cx.fail(format_args!("unexpected error {}", e.detail)),
                (Routed::Unknown, _) => {}
            },
            Step::Complete { request_id, expect_error } => {
                match (surface.complete(&mut cx, request_id), expect_error) {
                    (Completed::Done, None) => {}
                    (Completed::UnknownRequest, Some(e)) if e.kind == "unknown_request" => {}
                    (r, e) => cx.fail(format_args!("complete {request_id} gave {r:?}, expected error {e:?}")),
                }
            }
            Step::UpsertEndpoint { id, role } => surface.upsert_endpoint(&mut cx, id, *role),
            Step::RemoveEndpoint { id } => surface.remove_endpoint(&mut cx, id),
            Step::SetHealthy { id, healthy } => surface.set_healthy(&mut cx, id, *healthy),
            Step::Reload { policy } => surface.reload(&mut cx, policy),
            Step::ReloadInvalid { policy } => {
                if surface.reload_invalid(&mut cx, policy) {
                    cx.fail("invalid policy was accepted");
                }
            }
            Step::Events(e) => match (surface.events(&mut cx, e), &e.expect_error) {
                (Ingested::Outcome(v), None) => {
                    if let Some(expect) = &e.expect {
                        let at = cx.at.clone();
                        check(&at, expect, &v, &mut cx.errors);
                    }
                }
                (Ingested::DecodeError, Some(x)) if x.kind == "decode" => {}
                (r, x) => cx.fail(format_args!("events gave {r:?}, expected error {x:?}")),
            },
            Step::Resync { endpoint, now_ms } => surface.resync(&mut cx, endpoint, *now_ms),
        }
        i += 1;
    }
    cx.errors
}

/// `expect` matches `actual`: numbers within 1e-9, objects by subset (only the keys `expect`
/// has), except an object at a path ending in `headers`, which must have exactly those keys;
/// anything else equal. Mismatches are appended to `errors`, each with its path.
pub fn check(path: &str, expect: &Value, actual: &Value, errors: &mut Vec<String>) {
    match (expect, actual) {
        (Value::Number(e), Value::Number(a)) => {
            let (e, a) = (e.as_f64().unwrap_or(f64::NAN), a.as_f64().unwrap_or(f64::NAN));
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

/// The decision as the fixtures see it (the table in fixtures/golden/README.md).
pub fn view(d: &Decision) -> Value {
    let headers: Map<String, Value> = d.headers.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect();
    let filtered: Map<String, Value> =
        d.breakdown().map(|(e, s)| (e.to_owned(), serde_json::to_value(s.filtered).unwrap_or(Value::Null))).collect();
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
        "endpoint": d.endpoint().map(AsRef::<str>::as_ref),
        "prefill_endpoint": d.prefill_endpoint().map(AsRef::<str>::as_ref),
        "shed": d.shed().is_some(),
        "status": d.shed().map(|s| s.status),
        "headers": headers,
        "prefix_hit": d.prefix_hit,
        "cached_tokens": d.cached_tokens,
        "input_tokens": d.input_tokens,
        "relaxed_filters": d.relaxed_filters,
        "judgment": serde_json::to_value(d.judgment).unwrap_or(Value::Null),
        "transfer_pays": d.transfer.map(|t| t.pays),
        "filtered": filtered,
        "scores": scores,
    })
}

/// [`view`] of a decision in its JSON form (`Decision::to_json`, as the filter reports it in
/// `x-kvroute-decision`).
pub fn view_json(d: &Value) -> Value {
    let headers: Map<String, Value> = d["headers"]
        .as_array()
        .map(|a| a.iter().filter_map(|p| Some((p.get(0)?.as_str()?.to_owned(), p.get(1)?.clone()))).collect())
        .unwrap_or_default();
    let ids: Vec<String> = d["endpoints"]
        .as_array()
        .map(|a| a.iter().filter_map(|e| e.as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    let scores = d["scores"].as_array().cloned().unwrap_or_default();
    let mut filtered = Map::new();
    let mut by_ep = Map::new();
    for (id, s) in ids.iter().zip(&scores) {
        filtered.insert(id.clone(), s["filtered"].clone());
        let mut s = s.clone();
        if let Some(o) = s.as_object_mut() {
            o.remove("role");
            o.remove("filtered");
        }
        by_ep.insert(id.clone(), s);
    }
    json!({
        "request_id": d["request_id"],
        "policy_version": d["policy_version"],
        "rule": d["rule"],
        "mode": d["mode"],
        "endpoint": d["endpoint"],
        "prefill_endpoint": d["prefill_endpoint"],
        "shed": !d["shed"].is_null(),
        "status": d["shed"].get("status").cloned().unwrap_or(Value::Null),
        "headers": headers,
        "prefix_hit": d["prefix_hit"],
        "cached_tokens": d["cached_tokens"],
        "input_tokens": d["input_tokens"],
        "relaxed_filters": d["relaxed_filters"],
        "judgment": d["judgment"],
        "transfer_pays": d["transfer"].get("pays").cloned().unwrap_or(Value::Null),
        "filtered": filtered,
        "scores": by_ep,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_decodes_pairs_only() {
        assert_eq!(hex("00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(hex(""), Some(vec![]));
        assert_eq!(hex("abc"), None);
        assert_eq!(hex("zz"), None);
    }

    #[test]
    fn check_compares_subsets_numbers_and_exact_headers() {
        let actual = json!({"a": 1.0, "b": {"x": 1, "y": 2}, "headers": {"h": "v", "i": "w"}});
        let mut errors = Vec::new();
        check("c", &json!({"a": 1.0000000001, "b": {"x": 1}}), &actual, &mut errors);
        assert!(errors.is_empty(), "{errors:?}");
        check("c", &json!({"a": 1.1}), &actual, &mut errors);
        check("c", &json!({"b": {"z": 1}}), &actual, &mut errors);
        check("c", &json!({"headers": {"h": "v"}}), &actual, &mut errors);
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(
            errors[0].starts_with("c.a: ") && errors[1].starts_with("c.b.z: ") && errors[2].starts_with("c.headers: ")
        );
    }

    #[test]
    fn route_steps_need_one_body() {
        let step = |v: Value| serde_json::from_value::<Step>(v).map_err(|e| e.to_string());
        let r = step(json!({"op": "route", "now_ms": 1, "body": {"b": 1, "a": [2]}, "headers": {"y": "2", "x": "1"}}));
        let Ok(Step::Route(r)) = r else { panic!("{r:?}") };
        assert_eq!(r.body, r#"{"a":[2],"b":1}"#);
        assert_eq!(r.header_pairs(), [("x", "1"), ("y", "2")]);
        assert!(!r.complete && r.expect.is_none() && r.expect_error.is_none());
        assert!(step(json!({"op": "route", "now_ms": 1})).is_err());
        assert!(step(json!({"op": "route", "now_ms": 1, "body": {}, "body_raw": "{}"})).is_err());
        assert!(step(json!({"op": "route", "now_ms": 1, "body": {}, "typo": 1})).is_err());
        assert!(step(json!({"op": "teleport"})).is_err());
    }
}
