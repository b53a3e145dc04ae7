//! The filter never traps on a hostcall status. The test host's fault injection makes each
//! `env.proxy_*` import the filter uses answer InternalFailure, BadArgument, NotFound (and a code
//! ABI 0.2.1 does not define) while the whole filter runs: a new VM starts and configures, a
//! reconfiguration, a routable request, a bodyless request, an event post, the stats page, ticks
//! with metric-poll callouts and their answers, and a request on a second VM that syncs the
//! shared log. No VM may trap; requests must still go upstream (fail open); with the fault
//! removed, both VMs route, ingest events and poll as before.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use kvroute_wasm_host::{Fault, Status, PROXY_IMPORTS};
use kvroute_wasm_tests::*;
use serde_json::json;

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";

/// The statuses injected: the three the issue names, and one no ABI version defines.
const STATUSES: [(&str, Fault); 4] = [
    ("INTERNAL_FAILURE", Fault::status(Status::InternalFailure)),
    ("BAD_ARGUMENT", Fault::status(Status::BadArgument)),
    ("NOT_FOUND", Fault::status(Status::NotFound)),
    ("undefined code 99", Fault::code_of(99)),
];

struct World {
    host: Host,
    filter: Plugin,
    vms: Vec<VmId>,
    cfg: String,
    batch: Vec<u8>,
    body: Vec<u8>,
    seq: u64,
}

fn world() -> World {
    let case = golden_case("41_precise_event_fed_hit");
    let steps = case["steps"].as_array().unwrap();
    let pages = Pages::default();
    let page = prometheus(&json!({"waiting": 1, "running": 2, "kv_usage": 0.25}));
    pages.always(A, page.clone());
    pages.always(B, page);
    let mut host = host(&pages).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let cfg = plugin_config(&case["policy"], &[(A, "decode"), (B, "decode")], &json!({}));
    let vms = vec![host.start_vm(&filter, vm_config(&cfg)).unwrap(), host.start_vm(&filter, vm_config(&cfg)).unwrap()];
    let mut w = World {
        host,
        filter,
        vms,
        cfg,
        batch: hex(steps[2]["payload_hex"].as_str().unwrap()),
        body: steps[3]["body"].to_string().into_bytes(),
        seq: 0,
    };
    // Warm: polls answered, one request routed on each VM.
    w.host.advance(Duration::from_millis(350)).unwrap();
    for i in 0..2 {
        let (s, o) = route(&mut w.host, w.vms[i], &w.body, &[]).unwrap();
        assert!(o.destination().is_some());
        w.host.finish_stream(s).unwrap();
    }
    w
}

/// What a run under a fault did wrong.
#[derive(Default, Debug)]
struct Run {
    /// Steps that trapped a VM.
    traps: Vec<String>,
    /// Other failures (a request that did not go upstream, no recovery, an unexpected host error).
    failures: Vec<String>,
}

impl Run {
    fn step<T>(&mut self, name: &str, r: Result<T, HostError>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(HostError::Trap { function, message, .. }) => {
                // Where the guest panicked, as its last error line says (`.../src/hostcalls.rs:116:23`).
                let line = message.lines().find(|l| l.contains("panicked")).unwrap_or("");
                let at = line.rsplit('/').next().unwrap_or(line).trim_end_matches(':');
                self.traps.push(format!("{name} in {function}: {at}"));
                None
            }
            // The VM trapped earlier in this run: already counted.
            Err(HostError::VmFailed(_)) => None,
            Err(e) => {
                self.failures.push(format!("{name}: {e}"));
                None
            }
        }
    }
}

/// The whole filter once: configure, request, event, stats, tick and sync paths.
/// `strict`: the request path must fail open (go upstream).
fn exercise(w: &mut World, run: &mut Run, strict: bool) {
    // configure: a new VM, and a reconfiguration of the first one
    let cfg = w.cfg.clone();
    match w.host.start_vm(&w.filter, vm_config(&cfg)) {
        Ok(vm) => w.vms.push(vm),
        Err(HostError::ConfigureRejected(_) | HostError::VmStartRejected(_)) => {}
        Err(e) => {
            run.step::<()>("start a VM", Err(e));
        }
    }
    let other = cfg.replace("\"interval_ms\":100", "\"interval_ms\":150");
    run.step("reconfigure", w.host.reconfigure(w.vms[0], other));
    // request path: a body to route, and a bodyless request
    let body = w.body.clone();
    if let Some((s, o)) = run.step("request", route(&mut w.host, w.vms[0], &body, &[])) {
        if strict && o.upstream.is_none() {
            run.failures.push(format!("request: did not go upstream (local reply {:?})", o.local_status));
        }
        run.step("request done", w.host.finish_stream(s));
    }
    let get = HttpMessage::new(vec![(":method", "GET"), (":path", "/v1/models"), (":authority", "x")], Vec::new());
    if let Some(st) = run.step("bodyless request", w.host.round_trip(w.vms[0], &get, None)) {
        if strict && st.upstream_headers().is_none() {
            run.failures.push("bodyless request: did not go upstream".into());
        }
    }
    // event path
    let batch = w.batch.clone();
    if let Some((status, _)) =
        run.step("event post", post_events(&mut w.host, w.vms[0], B, Some(w.seq), &batch, SECRET))
    {
        if status == 200 {
            w.seq += 1;
        }
    }
    run.step("resync post", post_resync(&mut w.host, w.vms[0], A));
    // stats page
    run.step("stats page", stats(&mut w.host, w.vms[0]));
    // tick path: ticks on every VM, poll callouts and their answers, shared-log sync
    run.step("ticks and polls", w.host.advance(Duration::from_millis(350)));
    // the second VM reads what the first one wrote
    if let Some((s, o)) = run.step("request on VM 2", route(&mut w.host, w.vms[1], &body, &[])) {
        if strict && o.upstream.is_none() {
            run.failures.push("request on VM 2: did not go upstream".into());
        }
        run.step("request on VM 2 done", w.host.finish_stream(s));
    }
    for vm in w.vms.clone() {
        if let Ok(Some(f)) = w.host.failure(vm) {
            if run.traps.is_empty() {
                run.traps.push(format!("{vm}: {}", f.lines().next().unwrap_or("")));
            }
        }
    }
}

/// With the fault removed, the VMs route, ingest and poll as before.
fn recovers(w: &mut World, run: &mut Run) {
    w.host.clear_faults();
    let polls_before = polls(w, run);
    run.step("ticks after", w.host.advance(Duration::from_millis(350)));
    if polls(w, run) <= polls_before {
        run.failures.push("no metric poll after the fault".into());
    }
    for i in 0..2 {
        let body = w.body.clone();
        let Some((s, o)) = run.step("request after", route(&mut w.host, w.vms[i], &body, &[])) else { continue };
        if o.destination().is_none() || o.header("x-kvroute-fallback").is_some() || o.decision.is_none() {
            run.failures.push(format!("VM {i} does not route after the fault: {:?}", o.upstream));
        }
        run.step("request after done", w.host.finish_stream(s));
    }
    let batch = w.batch.clone();
    // A resync first: the fault may have cost the stream a batch.
    run.step("resync after", post_resync(&mut w.host, w.vms[0], B));
    let seq = w.seq + 10;
    if let Some((status, answer)) =
        run.step("event after", post_events(&mut w.host, w.vms[0], B, Some(seq), &batch, SECRET))
    {
        if status != 200 {
            run.failures.push(format!("event post after the fault: {status} {answer}"));
        }
    }
}

/// Metric polls of all VMs (one holds the polling lease), from their stats pages.
fn polls(w: &mut World, run: &mut Run) -> f64 {
    let mut n = 0.0;
    for vm in w.vms.clone() {
        if let Some(page) = run.step("stats", stats(&mut w.host, vm)) {
            n += stat(&page, "kvroute_wasm_metric_polls_total").unwrap_or(0.0);
        }
    }
    n
}

/// The `env.proxy_*` imports of the filter and how often the scenario calls each.
fn imports_and_calls() -> BTreeMap<String, u64> {
    let mut w = world();
    let names: Vec<String> = w
        .filter
        .imports()
        .iter()
        .filter_map(|i| i.strip_prefix("env.").map(str::to_owned))
        .filter(|n| PROXY_IMPORTS.contains(&n.as_str()))
        .collect();
    let before: Vec<u64> = names.iter().map(|n| w.host.hostcall_count(n)).collect();
    let mut run = Run::default();
    exercise(&mut w, &mut run, true);
    recovers(&mut w, &mut run);
    assert!(run.traps.is_empty() && run.failures.is_empty(), "the scenario fails without faults: {run:?}");
    assert!(w.host.abi_violations().is_empty(), "{:#?}", &*w.host.abi_violations());
    names.iter().zip(before).map(|(n, b)| (n.clone(), w.host.hostcall_count(n) - b)).collect()
}

#[test]
fn no_injected_status_traps_the_filter_on_any_path() {
    let calls = imports_and_calls();
    let used: Vec<&String> = calls.iter().filter(|(_, n)| **n > 0).map(|(k, _)| k).collect();
    eprintln!("imports called by the scenario ({}): {used:?}", used.len());
    let mut table = Vec::new();
    let mut trapped = BTreeMap::<&str, usize>::new();
    let mut failures = Vec::new();
    for import in calls.keys() {
        for (label, fault) in STATUSES {
            let mut w = world();
            w.host.inject_fault(import, fault).unwrap();
            let mut run = Run::default();
            exercise(&mut w, &mut run, true);
            recovers(&mut w, &mut run);
            if !run.traps.is_empty() {
                *trapped.entry(label).or_default() += 1;
                table.push(format!("TRAP {import} = {label}: {}", run.traps.join("; ")));
            }
            if run.traps.is_empty() {
                failures.extend(run.failures.iter().map(|f| format!("{import} = {label}: {f}")));
            }
        }
    }
    for line in &table {
        eprintln!("{line}");
    }
    let cases = calls.len();
    for (label, _) in STATUSES {
        eprintln!("{label}: {}/{cases} imports trap", trapped.get(label).copied().unwrap_or(0));
    }
    let headline: usize = STATUSES[..3].iter().map(|(l, _)| trapped.get(l).copied().unwrap_or(0)).sum();
    eprintln!("traps, the three named statuses: {headline}/{}", cases * 3);
    assert!(table.is_empty(), "{} traps:\n{}", table.len(), table.join("\n"));
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Every call site, not just the first: the k-th call of each import fails (InternalFailure),
/// for every k the scenario reaches (the first 40 calls of an import, then every 5th).
#[test]
fn a_failure_at_any_single_call_site_traps_nothing() {
    let calls = imports_and_calls();
    let mut traps = Vec::new();
    let mut failures = Vec::new();
    let mut cases = 0;
    for (import, n) in &calls {
        for k in (1..=*n).filter(|k| *k <= 40 || k % 5 == 0) {
            cases += 1;
            let mut w = world();
            w.host.inject_fault(import, Fault::status(Status::InternalFailure).nth(k)).unwrap();
            let mut run = Run::default();
            exercise(&mut w, &mut run, true);
            recovers(&mut w, &mut run);
            traps.extend(run.traps.iter().map(|t| format!("{import} call {k}: {t}")));
            failures.extend(run.failures.iter().map(|f| format!("{import} call {k}: {f}")));
        }
    }
    eprintln!("{cases} single-call faults, {} traps", traps.len());
    assert!(traps.is_empty(), "{} traps:\n{}", traps.len(), traps.join("\n"));
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

fn counter(w: &mut World, vm: usize, name: &str) -> f64 {
    let page = stats(&mut w.host, w.vms[vm]).unwrap();
    stat(&page, name).unwrap_or(0.0)
}

fn warned(w: &World, needle: &str) -> bool {
    w.host.logs().iter().any(|l| l.level <= kvroute_wasm_host::LogLevel::Warn && l.message.contains(needle))
}

#[test]
fn request_path_failures_fail_open_are_logged_and_counted() {
    const INTERNAL: &str = "kvroute_wasm_internal_errors_total";
    // Headers unreadable: the request still goes upstream, routed by the core on its body.
    let mut w = world();
    w.host.inject_fault("proxy_get_header_map_pairs", Fault::status(Status::InternalFailure)).unwrap();
    let body = w.body.clone();
    let (s, o) = route(&mut w.host, w.vms[0], &body, &[]).unwrap();
    w.host.finish_stream(s).unwrap();
    w.host.clear_faults();
    assert!(o.destination().is_some(), "{:?}", o.upstream);
    assert_eq!(counter(&mut w, 0, INTERNAL), 1.0);
    assert!(warned(&w, "reading the request headers"));

    // Body unreadable: the fail-open destination, with the reason.
    let mut w = world();
    w.host.inject_fault("proxy_get_buffer_bytes", Fault::status(Status::BadArgument)).unwrap();
    let (s, o) = route(&mut w.host, w.vms[0], &body, &[]).unwrap();
    w.host.finish_stream(s).unwrap();
    w.host.clear_faults();
    assert!(o.destination() == Some(A) || o.destination() == Some(B), "{:?}", o.upstream);
    assert_eq!(o.header("x-kvroute-fallback"), Some("internal"));
    assert_eq!(counter(&mut w, 0, INTERNAL), 1.0);
    assert_eq!(counter(&mut w, 0, "kvroute_wasm_fail_open_total"), 1.0);
    assert!(warned(&w, "reading the request body"));

    // Headers not writable: the request goes on without them (the route's default cluster).
    let mut w = world();
    w.host.inject_fault("proxy_replace_header_map_value", Fault::status(Status::NotFound)).unwrap();
    let (s, o) = route(&mut w.host, w.vms[0], &body, &[]).unwrap();
    w.host.finish_stream(s).unwrap();
    w.host.clear_faults();
    assert!(o.upstream.is_some() && o.destination().is_none());
    assert_eq!(counter(&mut w, 0, INTERNAL), 1.0);
    assert!(warned(&w, "setting the routing headers failed"));

    // Shared data refused: routed by this VM's own state, the sync error counted.
    let mut w = world();
    w.host.inject_fault("proxy_get_shared_data", Fault::status(Status::InternalFailure)).unwrap();
    w.host.inject_fault("proxy_set_shared_data", Fault::status(Status::InternalFailure)).unwrap();
    let (s, o) = route(&mut w.host, w.vms[0], &body, &[]).unwrap();
    w.host.finish_stream(s).unwrap();
    w.host.clear_faults();
    assert!(o.destination().is_some() && o.header("x-kvroute-fallback").is_none(), "{:?}", o.upstream);
    assert!(counter(&mut w, 0, "kvroute_wasm_sync_errors_total") >= 1.0);

    // The clock refused: the last time the host told.
    let mut w = world();
    w.host.inject_fault("proxy_get_current_time_nanoseconds", Fault::status(Status::InternalFailure)).unwrap();
    let (s, o) = route(&mut w.host, w.vms[0], &body, &[]).unwrap();
    w.host.finish_stream(s).unwrap();
    assert!(o.destination().is_some() && o.header("x-kvroute-fallback").is_none(), "{:?}", o.upstream);
    for vm in w.vms.clone() {
        assert_eq!(w.host.failure(vm).unwrap(), None);
    }
    assert!(w.host.abi_violations().is_empty(), "{:#?}", &*w.host.abi_violations());
}

#[test]
fn answers_the_host_refuses_reset_the_stream_and_never_go_upstream() {
    // An event post whose answer cannot be sent is reset, not forwarded.
    let mut w = world();
    w.host.inject_fault("proxy_send_local_response", Fault::status(Status::InternalFailure)).unwrap();
    let batch = w.batch.clone();
    let h = signed_event_headers(&w.host, SECRET, B, "batch", Some(0), &batch);
    let st = w.host.round_trip(w.vms[0], &HttpMessage::new(h.clone(), batch.clone()), None).unwrap();
    assert!(st.upstream_headers().is_none() && st.was_reset() && st.local_reply().is_none());
    // So is the stats page.
    let get = HttpMessage::new(vec![(":method", "GET"), (":path", STATS_PATH), (":authority", "x")], Vec::new());
    let st = w.host.round_trip(w.vms[0], &get, None).unwrap();
    assert!(st.upstream_headers().is_none() && st.was_reset());
    assert!(warned(&w, "local reply 200 refused by the host"));
    // An event body the host does not hand over is answered 503, not forwarded.
    w.host.clear_faults();
    w.host.inject_fault("proxy_get_buffer_bytes", Fault::status(Status::InternalFailure)).unwrap();
    let st = w.host.round_trip(w.vms[0], &HttpMessage::new(h, batch), None).unwrap();
    assert_eq!(answer(&st).0, 503);
    assert!(st.upstream_headers().is_none());
    w.host.clear_faults();
    for vm in w.vms.clone() {
        assert_eq!(w.host.failure(vm).unwrap(), None);
    }
}

#[test]
fn a_429_the_host_refuses_to_send_fails_open() {
    let pages = Pages::default();
    pages.always(A, prometheus(&json!({"waiting": 5, "running": 0, "kv_usage": 0.2})));
    pages.always(B, prometheus(&json!({"waiting": 6, "running": 0, "kv_usage": 0.2})));
    let mut host = host(&pages).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let vm = host.start_vm(&filter, vm_config(&plugin_config(&json!({}), &[(A, "decode"), (B, "decode")], &json!({}))));
    let vm = vm.unwrap();
    host.advance(Duration::from_millis(250)).unwrap();
    let body = br#"{"model": "m", "prompt": "Translate 'good morning' into French, please.", "max_tokens": 50}"#;
    host.inject_fault("proxy_send_local_response", Fault::status(Status::InternalFailure)).unwrap();
    let (s, o) = route(&mut host, vm, body, &[("x-kvroute-priority", "-1")]).unwrap();
    host.finish_stream(s).unwrap();
    host.clear_faults();
    assert_eq!(host.faults_fired("proxy_send_local_response"), 1, "the filter tried to shed");
    assert!(matches!(o.destination(), Some(A | B)), "{:?}", o.upstream);
    assert_eq!(o.header("x-kvroute-fallback"), Some("internal"));
    let page = stats(&mut host, vm).unwrap();
    assert_eq!(stat(&page, "kvroute_wasm_shed_total"), Some(1.0));
    assert_eq!(stat(&page, "kvroute_wasm_internal_errors_total"), Some(1.0));
    assert_eq!(stat(&page, "kvroute_wasm_fail_open_total"), Some(1.0));
    assert_eq!(host.failure(vm).unwrap(), None);
}

#[test]
fn the_filter_imports_nothing_whose_failure_it_cannot_handle() {
    // Beyond the proxy-wasm ABI (every status handled, above), the filter takes only what WASI
    // calls cannot fail on: no random seeds (std's randomly seeded hash maps panic when
    // `random_get` fails), no clocks or files.
    let host = host(&Pages::default()).unwrap();
    let imports = host.load_kvroute_filter().unwrap().imports();
    let others: Vec<&String> = imports.iter().filter(|i| !i.starts_with("env.proxy_")).collect();
    for i in &others {
        assert!(
            ["wasi_snapshot_preview1.fd_write", "wasi_snapshot_preview1.proc_exit"].iter().any(|ok| ok == i)
                || i.starts_with("wasi_snapshot_preview1.environ_"),
            "unexpected import {i} (all: {others:?})"
        );
    }
}

// ---- flow control's paths ----

/// Two VMs with flow control on (one request per endpoint, three queued at most, a 1 s TTL):
/// held requests are released by completions and ticks (switching the effective context,
/// resuming with `proxy_continue_stream`), answered from the tick or another stream's callback,
/// replicated through the shared log; clients leave while held.
struct FlowWorld {
    host: Host,
    vms: Vec<VmId>,
    streams: Vec<StreamId>,
}

const FLOW_BODY: &[u8] = br#"{"model":"m","prompt":"hello","max_tokens":16}"#;

fn flow_world() -> FlowWorld {
    let pages = Pages::default();
    let page = prometheus(&json!({"waiting": 0, "running": 0, "kv_usage": 0.1}));
    pages.always(A, page);
    let mut host = host(&pages).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let policy = json!({"flow_control": {
        "enabled": true, "max_requests": 3, "default_request_ttl_ms": 1000, "shedding": {"enabled": false},
        "saturation_detector": {"kind": "concurrency", "max_requests_per_endpoint": 1}}});
    let cfg = plugin_config(&policy, &[(A, "decode")], &json!({}));
    let vms = vec![host.start_vm(&filter, vm_config(&cfg)).unwrap(), host.start_vm(&filter, vm_config(&cfg)).unwrap()];
    host.advance(Duration::from_millis(250)).unwrap();
    FlowWorld { host, vms, streams: Vec::new() }
}

fn flow_request(w: &mut FlowWorld, run: &mut Run, vm: usize, name: &str, headers: &[(&str, &str)]) -> Option<StreamId> {
    let vm = w.vms[vm];
    let (s, _) = run.step(name, route(&mut w.host, vm, FLOW_BODY, headers))?;
    w.streams.push(s);
    Some(s)
}

/// Queue on both VMs, a client leaving, a refusal, a TTL answered from the tick, releases by a
/// completion on each VM and by the other VM's tick.
fn flow_exercise(w: &mut FlowWorld, run: &mut Run) {
    let first = flow_request(w, run, 0, "routed", &[]);
    let q1 = flow_request(w, run, 0, "queued on VM 1", &[]);
    run.step("time", w.host.advance(Duration::from_millis(1)));
    let q2 = flow_request(w, run, 1, "queued on VM 2", &[]);
    if let Some(gone) = flow_request(w, run, 0, "queued, client leaves", &[]) {
        run.step("client leaves", w.host.finish_stream(gone));
    }
    flow_request(w, run, 0, "queued with a TTL", &[("x-llm-d-inference-ttl", "150ms")]);
    flow_request(w, run, 0, "refused", &[]);
    run.step("the TTL runs out", w.host.advance(Duration::from_millis(200)));
    for (name, s) in [("first completes", first), ("VM 1's request completes", q1), ("VM 2's completes", q2)] {
        if let Some(s) = s {
            run.step(name, w.host.finish_stream(s));
        }
        run.step("ticks", w.host.advance(Duration::from_millis(200)));
    }
    for vm in w.vms.clone() {
        if let Ok(Some(f)) = w.host.failure(vm) {
            if run.traps.is_empty() {
                run.traps.push(format!("{vm}: {}", f.lines().next().unwrap_or("")));
            }
        }
    }
}

/// With the fault removed, nothing stays held: every request went upstream or was answered
/// once the finished ones completed and the TTL passed, and new requests are served.
fn flow_recovers(w: &mut FlowWorld, run: &mut Run) {
    w.host.clear_faults();
    for i in 0..2 {
        flow_request(w, run, i, "request after", &[]);
    }
    for _ in 0..3 {
        for s in w.streams.clone() {
            // Open and no longer held (gone upstream or answered): the request ends.
            if w.host.stream(s).is_ok() && !is_held(&w.host, s) {
                run.step("finish", w.host.finish_stream(s));
            }
        }
        run.step("ticks after", w.host.advance(Duration::from_millis(1100)));
    }
    for s in w.streams.clone() {
        if is_held(&w.host, s) {
            run.failures.push(format!("{s:?} still held after the fault"));
        }
    }
}

fn flow_calls() -> BTreeMap<String, u64> {
    let mut w = flow_world();
    let names: Vec<String> = PROXY_IMPORTS.iter().map(|s| (*s).to_owned()).collect();
    let before: Vec<u64> = names.iter().map(|n| w.host.hostcall_count(n)).collect();
    let mut run = Run::default();
    flow_exercise(&mut w, &mut run);
    flow_recovers(&mut w, &mut run);
    assert!(run.traps.is_empty() && run.failures.is_empty(), "the flow scenario fails without faults: {run:?}");
    assert!(w.host.abi_violations().is_empty(), "{:#?}", &*w.host.abi_violations());
    // Without faults the scenario takes every flow path.
    let mut sum = BTreeMap::<&str, f64>::new();
    for vm in w.vms.clone() {
        let page = stats(&mut w.host, vm).unwrap();
        for c in ["resumed", "dropped", "rejected", "cancelled", "queued"] {
            *sum.entry(c).or_default() += stat(&page, &format!("kvroute_wasm_flow_{c}_total")).unwrap_or(0.0);
        }
    }
    let want =
        BTreeMap::from([("resumed", 2.0), ("dropped", 1.0), ("rejected", 1.0), ("cancelled", 1.0), ("queued", 4.0)]);
    for (k, v) in &want {
        assert!(sum[k] >= *v, "flow {k}: {} (all: {sum:?})", sum[k]);
    }
    names.iter().zip(before).map(|(n, b)| (n.clone(), w.host.hostcall_count(n) - b)).filter(|(_, c)| *c > 0).collect()
}

#[test]
fn flow_control_paths_never_trap_and_never_leave_a_request_held_under_host_faults() {
    let calls = flow_calls();
    eprintln!("hostcalls of the flow scenario: {calls:?}");
    for flow_import in ["proxy_set_effective_context", "proxy_continue_stream", "proxy_send_local_response"] {
        assert!(calls.contains_key(flow_import), "the scenario does not reach {flow_import}: {calls:?}");
    }
    let mut traps = Vec::new();
    let mut failures = Vec::new();
    let mut cases = 0;
    for import in calls.keys() {
        for (label, fault) in STATUSES {
            cases += 1;
            let mut w = flow_world();
            w.host.inject_fault(import, fault).unwrap();
            let mut run = Run::default();
            flow_exercise(&mut w, &mut run);
            flow_recovers(&mut w, &mut run);
            traps.extend(run.traps.iter().map(|t| format!("{import} = {label}: {t}")));
            failures.extend(run.failures.iter().map(|f| format!("{import} = {label}: {f}")));
        }
    }
    // Every single call of the imports the flow paths add or lean on.
    for import in [
        "proxy_set_effective_context",
        "proxy_continue_stream",
        "proxy_send_local_response",
        "proxy_replace_header_map_value",
        "proxy_set_tick_period_milliseconds",
        "proxy_set_shared_data",
    ] {
        let n = calls.get(import).copied().unwrap_or(0);
        for k in (1..=n).filter(|k| *k <= 40 || k % 5 == 0) {
            cases += 1;
            let mut w = flow_world();
            w.host.inject_fault(import, Fault::status(Status::InternalFailure).nth(k)).unwrap();
            let mut run = Run::default();
            flow_exercise(&mut w, &mut run);
            flow_recovers(&mut w, &mut run);
            traps.extend(run.traps.iter().map(|t| format!("{import} call {k}: {t}")));
            failures.extend(run.failures.iter().map(|f| format!("{import} call {k}: {f}")));
        }
    }
    eprintln!("{cases} faulted runs of the flow-control scenario, {} traps", traps.len());
    assert!(traps.is_empty(), "{} traps:\n{}", traps.len(), traps.join("\n"));
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}
