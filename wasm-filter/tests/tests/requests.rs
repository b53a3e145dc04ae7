//! Body-based routing through the filter in the wasmtime host: the request flow Envoy sees
//! (headers paused, body buffered to the end of the stream, destination headers set, continue),
//! shedding (429 with the reason), and fail-open on every kind of input the core cannot route or
//! internal failure: the request still gets a destination, the reason is logged and counted, and
//! the VM never traps.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_wasm_host::FlowState;
use kvroute_wasm_tests::*;
use serde_json::{json, Value};
use std::time::Duration;

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";

fn start(policy: &Value, endpoints: &[(&str, &str)], extra: &Value) -> (Host, VmId, Pages) {
    let pages = Pages::default();
    let mut host = host(&pages).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let vm = host.start_vm(&filter, vm_config(&plugin_config(policy, endpoints, extra))).unwrap();
    (host, vm, pages)
}

fn assert_clean(host: &Host, vms: &[VmId]) {
    assert!(host.abi_violations().is_empty(), "{:#?}", &*host.abi_violations());
    for vm in vms {
        assert_eq!(host.failure(*vm).unwrap(), None, "the VM trapped");
    }
}

fn warn_logs(host: &Host, needle: &str) -> usize {
    host.logs().iter().filter(|l| l.level <= LogLevel::Warn && l.message.contains(needle)).count()
}

use kvroute_wasm_host::LogLevel;

#[test]
fn headers_pause_the_body_is_buffered_to_the_end_then_the_destination_is_set() {
    let (mut host, vm, _) = start(&json!({}), &[(A, "decode"), (B, "decode")], &json!({}));
    let body = json!({"model": "m", "prompt": "route me ".repeat(300), "max_tokens": 10}).to_string();
    let (first, rest) = body.as_bytes().split_at(body.len() / 3);
    let (second, third) = rest.split_at(rest.len() / 2);
    let s = host.new_stream(vm).unwrap();
    let h = [
        (":method", "POST"),
        (":path", "/v1/completions"),
        (":authority", "llm.local"),
        (":scheme", "http"),
        // A client must not be able to pick the upstream itself.
        (DESTINATION, "10.9.9.9:1"),
        ("x-prefiller-host-port", "10.9.9.9:2"),
    ];
    assert_eq!(host.send_request_headers(s, h, false).unwrap(), FlowState::HeadersPaused { stop_all: false });
    for chunk in [first, second] {
        let st = host.send_request_body(s, chunk, false).unwrap();
        assert!(st.is_paused(), "headers stay held while the body is incomplete: {st:?}");
        assert!(host.stream(s).unwrap().upstream_headers().is_none());
    }
    assert_eq!(host.send_request_body(s, third, true).unwrap(), FlowState::Complete);
    let o = outcome(host.stream(s).unwrap());
    let dest = o.destination().unwrap().to_owned();
    assert!(dest == A || dest == B, "{dest}");
    assert_eq!(o.header("x-kvroute-mode"), Some("colocated"));
    assert_eq!(o.header("x-prefiller-host-port"), None, "the client's prefiller header is removed");
    assert_eq!(o.header("x-kvroute-fallback"), None);
    assert_eq!(o.decision.as_ref().unwrap()["endpoint"], dest.as_str());
    assert_eq!(host.stream(s).unwrap().request().body(), body.as_bytes(), "the body goes upstream untouched");
    host.finish_stream(s).unwrap();
    assert_clean(&host, &[vm]);
}

#[test]
fn a_body_ending_with_trailers_is_routed() {
    let (mut host, vm, _) = start(&json!({}), &[(A, "decode")], &json!({}));
    let body = json!({"model": "m", "prompt": "with trailers"}).to_string();
    let s = host.new_stream(vm).unwrap();
    host.send_request_headers(s, [(":method", "POST"), (":path", "/v1/completions"), (":authority", "x")], false)
        .unwrap();
    assert!(host.send_request_body(s, body.as_bytes(), false).unwrap().is_paused());
    host.send_request_trailers(s, [("x-trailer", "1")]).unwrap();
    let o = outcome(host.stream(s).unwrap());
    assert_eq!(o.destination(), Some(A));
    assert_eq!(o.header("x-kvroute-mode"), Some("colocated"));
    assert_eq!(o.header("x-kvroute-fallback"), None, "routed by the core");
    assert_clean(&host, &[vm]);
}

#[test]
fn malformed_inputs_fail_open_to_a_destination_and_never_trap() {
    let policy = json!({"request": {"max_body_bytes": 4096}});
    let (mut host, vm, _) = start(&policy, &[(A, "decode"), (B, "decode")], &json!({}));
    let big = json!({"model": "m", "prompt": "x".repeat(10_000)}).to_string();
    let deep = format!("{}{}", "[".repeat(2000), "]".repeat(2000));
    let cases: Vec<(&str, Vec<u8>, Option<&str>)> = vec![
        ("non-JSON", b"{not json".to_vec(), Some("request_error")),
        ("JSON array", b"[1,2,3]".to_vec(), Some("request_error")),
        ("missing model", br#"{"prompt": "x"}"#.to_vec(), Some("request_error")),
        ("bad token id", br#"{"model": "m", "prompt": [1, -2]}"#.to_vec(), Some("request_error")),
        (
            "wrong content type",
            br#"{"model": "m", "messages": [{"role": "user", "content": 7}]}"#.to_vec(),
            Some("request_error"),
        ),
        ("invalid UTF-8", vec![b'{', 0xff, 0xfe, b'}'], Some("request_error")),
        ("deeply nested", deep.into_bytes(), Some("request_error")),
        (
            "binary noise",
            (0..3000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect(),
            Some("request_error"),
        ),
        ("oversized", big.into_bytes(), Some("body_too_large")),
    ];
    for (name, body, reason) in &cases {
        // In chunks of 1000 bytes, as a chunked upload arrives.
        let s = host.new_stream(vm).unwrap();
        host.send_request_headers(s, [(":method", "POST"), (":path", "/v1/completions"), (":authority", "x")], false)
            .unwrap();
        let chunks: Vec<&[u8]> = body.chunks(1000).collect();
        for (i, c) in chunks.iter().enumerate() {
            let st = host.send_request_body(s, c, i + 1 == chunks.len()).unwrap();
            if host.stream(s).unwrap().upstream_headers().is_some() {
                assert!(!st.is_paused(), "{name}: released after a decision");
                break;
            }
        }
        let o = outcome(host.stream(s).unwrap());
        assert_eq!(o.local_status, None, "{name}: fail open, no local answer");
        let dest = o.destination().unwrap_or_else(|| panic!("{name}: no destination"));
        assert!(dest == A || dest == B, "{name}: {dest}");
        assert_eq!(o.header("x-kvroute-fallback"), *reason, "{name}");
        if *reason == Some("request_error") {
            let d = o.decision.as_ref().unwrap_or_else(|| panic!("{name}: no debug header"));
            assert_eq!(d["error"]["kind"], "request", "{name}: the debug header carries the core's error");
            assert_eq!(d["fallback"], dest, "{name}");
        }
        host.finish_stream(s).unwrap();
    }
    // An empty body (end of stream with the headers) and an empty last data frame.
    let s = host.new_stream(vm).unwrap();
    host.send_request_headers(s, [(":method", "GET"), (":path", "/v1/models"), (":authority", "x")], true).unwrap();
    assert!(
        matches!(outcome(host.stream(s).unwrap()).destination(), Some(A | B)),
        "bodyless requests go to an endpoint"
    );
    host.finish_stream(s).unwrap();
    let s = host.new_stream(vm).unwrap();
    host.send_request_headers(s, [(":method", "POST"), (":path", "/v1/completions"), (":authority", "x")], false)
        .unwrap();
    host.send_request_body(s, b"", true).unwrap();
    let o = outcome(host.stream(s).unwrap());
    assert!(matches!(o.destination(), Some(A | B)));
    assert_eq!(o.header("x-kvroute-fallback"), Some("request_error"));
    host.finish_stream(s).unwrap();

    let page = stats(&mut host, vm).unwrap();
    assert_eq!(stat(&page, "kvroute_wasm_request_errors_total"), Some(9.0), "{page}");
    assert_eq!(stat(&page, "kvroute_wasm_body_too_large_total"), Some(1.0));
    assert_eq!(stat(&page, "kvroute_wasm_fail_open_total"), Some(10.0));
    assert_eq!(stat(&page, "kvroute_wasm_bodyless_total"), Some(1.0));
    assert_eq!(stat(&page, "kvroute_wasm_routed_total"), Some(0.0));
    // Envoy's own stats see the same counters.
    assert!(matches!(host.metric("kvroute_wasm_fail_open_total"), Some(kvroute_wasm_host::MetricValue::Counter(10))));
    assert!(warn_logs(&host, "body_too_large") >= 1, "oversized bodies are logged");

    // After all that the filter still routes normally.
    let (_, o) = route(&mut host, vm, br#"{"model": "m", "prompt": "fine"}"#, &[]).unwrap();
    assert!(matches!(o.destination(), Some(A | B)));
    assert_eq!(o.header("x-kvroute-fallback"), None);
    assert_clean(&host, &[vm]);
}

#[test]
fn saturated_pool_sheds_sheddable_requests_with_429_and_the_reason() {
    let (mut host, vm, pages) = start(&json!({}), &[(A, "decode"), (B, "decode")], &json!({}));
    pages.always(A, prometheus(&json!({"waiting": 5, "running": 0, "kv_usage": 0.2})));
    pages.always(B, prometheus(&json!({"waiting": 6, "running": 0, "kv_usage": 0.2})));
    host.advance(Duration::from_millis(250)).unwrap();
    let body = br#"{"model": "m", "prompt": "Translate 'good morning' into French, please.", "max_tokens": 50}"#;
    let (s, o) = route(&mut host, vm, body, &[("x-kvroute-priority", "-1")]).unwrap();
    assert_eq!(o.local_status, Some(429));
    assert!(o.upstream.is_none(), "a shed request never goes upstream");
    let reason = o.local_headers.get(kvroute::HEADER_SHED_REASON).unwrap().to_owned();
    assert!(!reason.is_empty());
    let (status, answer) = answer(host.stream(s).unwrap());
    assert_eq!(
        (status, answer["error"].as_str(), answer["reason"].as_str()),
        (429, Some("shed"), Some(reason.as_str()))
    );
    assert_eq!(o.decision.as_ref().unwrap()["rule"], "shed");
    host.finish_stream(s).unwrap();
    // Normal priority is never shed.
    let (_, o) = route(&mut host, vm, body, &[]).unwrap();
    assert!(matches!(o.destination(), Some(A | B)));
    let page = stats(&mut host, vm).unwrap();
    assert_eq!(stat(&page, "kvroute_wasm_shed_total"), Some(1.0));
    assert_clean(&host, &[vm]);
}

#[test]
fn no_decode_capable_endpoint_fails_open_to_the_least_loaded_endpoint() {
    let (mut host, vm, _) = start(&json!({}), &[(A, "prefill"), (B, "prefill")], &json!({}));
    let body = br#"{"model": "m", "prompt": "hello"}"#;
    let (s1, o) = route(&mut host, vm, body, &[]).unwrap();
    assert_eq!(o.header("x-kvroute-fallback"), Some("no_endpoints"));
    let first = o.destination().unwrap().to_owned();
    assert!(first == A || first == B);
    let page = stats(&mut host, vm).unwrap();
    assert_eq!(stat(&page, "kvroute_wasm_no_endpoints_total"), Some(1.0));
    assert_eq!(stat(&page, "kvroute_wasm_fail_open_total"), Some(1.0));
    assert!(warn_logs(&host, "no_endpoints") >= 1);
    host.finish_stream(s1).unwrap();
    assert_clean(&host, &[vm]);
}

#[test]
fn a_shared_data_failure_is_logged_and_counted_and_the_request_still_routed() {
    let (mut host, vm, _) = start(&json!({}), &[(A, "decode"), (B, "decode")], &json!({}));
    // A first request creates the log.
    let (s, o) = route(&mut host, vm, br#"{"model": "m", "prompt": "first"}"#, &[]).unwrap();
    assert_eq!(o.header("x-kvroute-fallback"), None);
    host.finish_stream(s).unwrap();
    let head = host.shared_data_keys(VM_ID).into_iter().find(|k| k.ends_with("/head")).unwrap();
    // Every compare-and-swap of the log head fails: the decision's effect cannot be appended.
    host.force_cas_mismatch(VM_ID, &head, 10_000);
    let (_, o) = route(&mut host, vm, br#"{"model": "m", "prompt": "hello"}"#, &[]).unwrap();
    assert!(matches!(o.destination(), Some(A | B)), "{o:?}");
    let page = stats(&mut host, vm).unwrap();
    assert!(stat(&page, "kvroute_wasm_sync_errors_total").unwrap() >= 1.0, "{page}");
    assert!(warn_logs(&host, "shared log") >= 1, "{:#?}", &*host.logs());
    assert_clean(&host, &[vm]);
}

#[test]
fn with_fail_open_disabled_unroutable_requests_get_the_configured_status() {
    let extra = json!({"fail_open": {"enabled": false, "reject_status": 502}});
    let (mut host, vm, _) = start(&json!({}), &[(A, "decode")], &extra);
    let (s, o) = route(&mut host, vm, b"{not json", &[]).unwrap();
    assert_eq!(o.local_status, Some(502));
    assert!(o.upstream.is_none());
    assert_eq!(o.local_headers.get("x-kvroute-fallback"), Some("request_error"));
    assert_eq!(answer(host.stream(s).unwrap()).1["error"], "not_routed");
    let page = stats(&mut host, vm).unwrap();
    assert_eq!(stat(&page, "kvroute_wasm_rejected_total"), Some(1.0));
    assert_clean(&host, &[vm]);
}

#[test]
fn a_routed_request_costs_a_fixed_number_of_host_calls() {
    // One VM, flow control off, nothing else appending: per request the headers are read once,
    // the body once, the clock once (the completion reuses it), and the shared log costs six
    // calls: the poll reads `head`; the effect claims it (CAS) and writes its slot; the
    // completion reads `head`, claims it and writes its slot. A call more on this path shows here.
    let (mut host, vm, _) =
        start(&json!({}), &[(A, "decode"), (B, "decode")], &json!({"debug_decision_header": false}));
    let imports = [
        "proxy_get_header_map_pairs",
        "proxy_get_buffer_bytes",
        "proxy_get_current_time_nanoseconds",
        "proxy_get_shared_data",
        "proxy_set_shared_data",
    ];
    let counts = |h: &Host| imports.map(|c| h.hostcall_count(c));
    // Warm-up: the first request reads the log from its start.
    let (s, o) = route(&mut host, vm, br#"{"model": "m", "prompt": "warm up"}"#, &[]).unwrap();
    assert!(o.destination().is_some());
    host.finish_stream(s).unwrap();
    let before = counts(&host);
    const N: u64 = 20;
    for i in 0..N {
        let body = json!({"model": "m", "prompt": format!("request {i} ").repeat(50)}).to_string();
        let (s, o) = route(&mut host, vm, body.as_bytes(), &[]).unwrap();
        assert!(o.destination().is_some());
        host.finish_stream(s).unwrap();
    }
    let per_request: Vec<f64> =
        counts(&host).iter().zip(before).map(|(after, before)| (after - before) as f64 / N as f64).collect();
    assert_eq!(per_request, [1.0, 1.0, 1.0, 2.0, 4.0], "per request: {imports:?}");
    assert_clean(&host, &[vm]);
}
