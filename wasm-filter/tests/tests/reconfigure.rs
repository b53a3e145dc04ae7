//! Plugin (re)configuration: an invalid configuration makes `proxy_on_configure` fail with the
//! reason logged (the previous configuration keeps serving); valid updates apply under traffic
//! without losing requests in flight or routing state.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_wasm_host::{FlowState, LogLevel};
use kvroute_wasm_tests::*;
use serde_json::json;

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";
const C: &str = "10.0.0.3:8000";

fn errors_logged(host: &Host, needle: &str) -> bool {
    host.logs().iter().any(|l| {
        l.level == LogLevel::Error && l.message.contains("configuration rejected") && l.message.contains(needle)
    })
}

#[test]
fn invalid_configuration_fails_configure_with_the_reason_logged_and_a_valid_one_then_works() {
    let mut host = host(&Pages::default()).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    // At start: the VM does not come up, the reason names the field.
    let bad = plugin_config(&json!({}), &[("nope", "decode")], &json!({}));
    match host.start_vm(&filter, vm_config(&bad)) {
        Err(HostError::ConfigureRejected(_)) => {}
        other => panic!("expected ConfigureRejected, got {other:?}"),
    }
    assert!(errors_logged(&host, "filter.endpoints[0].address"), "{:#?}", &*host.logs());
    let good = plugin_config(&json!({}), &[(A, "decode")], &json!({}));
    let vm = host.start_vm(&filter, vm_config(&good)).unwrap();

    // Later: each invalid update is refused with its reason; the old configuration serves on.
    let invalid = [
        (b"{ not json".to_vec(), "not a JSON object"),
        (b"".to_vec(), "empty"),
        (
            plugin_config(&json!({"modes": {"decode_kv_ceiling": 7}}), &[(A, "decode")], &json!({})).into_bytes(),
            "policy",
        ),
        (
            plugin_config(&json!({}), &[(A, "decode")], &json!({"events": {"path": "/e", "secret": "short"}}))
                .into_bytes(),
            "filter.events.secret",
        ),
        (plugin_config(&json!({}), &[(A, "decode"), (A, "both")], &json!({})).into_bytes(), "listed twice"),
    ];
    for (cfg, reason) in &invalid {
        assert!(!host.reconfigure(vm, cfg.clone()).unwrap(), "{reason}");
        assert!(errors_logged(&host, reason), "{reason}: {:#?}", &*host.logs());
        assert!(!host.configure_again(vm, cfg.clone()).unwrap(), "{reason}");
        let (_, o) = route(&mut host, vm, br#"{"model": "m", "prompt": "still here"}"#, &[]).unwrap();
        assert_eq!(o.destination(), Some(A), "{reason}");
    }
    let page = stats(&mut host, vm).unwrap();
    // Per VM on the stats page; Envoy's stat (shared by name) also counts the failed start.
    assert_eq!(stat(&page, "kvroute_wasm_config_errors_total"), Some(2.0 * invalid.len() as f64), "{page}");
    let envoy_stat = host.metric("kvroute_wasm_config_errors_total");
    assert!(matches!(envoy_stat, Some(kvroute_wasm_host::MetricValue::Counter(11))), "{envoy_stat:?}");

    let moved = plugin_config(&json!({}), &[(B, "decode")], &json!({}));
    assert!(host.reconfigure(vm, moved).unwrap());
    let (_, o) = route(&mut host, vm, br#"{"model": "m", "prompt": "moved"}"#, &[]).unwrap();
    assert_eq!(o.destination(), Some(B));
    assert!(host.abi_violations().is_empty());
}

#[test]
fn reconfiguration_under_traffic_keeps_requests_and_state() {
    let mut host = host(&Pages::default()).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let v1 = plugin_config(&json!({}), &[(A, "decode"), (B, "decode")], &json!({}));
    let vms = [host.start_vm(&filter, vm_config(&v1)).unwrap(), host.start_vm(&filter, vm_config(&v1)).unwrap()];
    let prompt = |i: usize| {
        json!({"model": "m", "prompt": format!("{} {i}", "long shared prefix words ".repeat(60))}).to_string()
    };

    // Traffic before the update: routed and still in flight, and half-received bodies.
    let mut routed = Vec::new();
    for i in 0..6 {
        let (s, o) = route(&mut host, vms[i % 2], prompt(i).as_bytes(), &[]).unwrap();
        assert!(matches!(o.destination(), Some(A | B)));
        routed.push(s);
    }
    let mut partial = Vec::new();
    for i in 0..4 {
        let s = host.new_stream(vms[i % 2]).unwrap();
        host.send_request_headers(s, [(":method", "POST"), (":path", "/v1/completions"), (":authority", "x")], false)
            .unwrap();
        let body = prompt(100 + i);
        let (head, _) = body.as_bytes().split_at(body.len() / 2);
        assert!(host.send_request_body(s, head, false).unwrap().is_paused());
        partial.push((s, body));
    }

    // The update (Envoy applies it to every worker's VM): B drained, C added, a policy change.
    let v2 = plugin_config(
        &json!({"scoring": {"weights": {"inflight": 0.7}}}),
        &[(A, "decode"), (C, "both")],
        &json!({"endpoints": [
            {"address": A, "role": "decode"}, {"address": B, "role": "decode", "healthy": false}, {"address": C, "role": "both"}
        ]}),
    );
    for vm in vms {
        assert!(host.reconfigure(vm, v2.clone()).unwrap());
    }
    // An invalid update in the middle changes nothing.
    for vm in vms {
        assert!(!host.reconfigure(vm, b"{\"filter\": 1}".to_vec()).unwrap());
    }

    // The half-received requests finish under the new configuration.
    for (s, body) in partial {
        let (_, tail) = body.as_bytes().split_at(body.len() / 2);
        assert_eq!(host.send_request_body(s, tail, true).unwrap(), FlowState::Complete);
        let o = outcome(host.stream(s).unwrap());
        assert!(matches!(o.destination(), Some(A | C)), "drained B is never picked: {o:?}");
        assert_eq!(o.decision.as_ref().unwrap()["policy_version"], 2);
        routed.push(s);
    }
    for vm in vms {
        let page = stats(&mut host, vm).unwrap();
        assert_eq!(inflight_total(&page), 10.0, "in-flight requests survive the update: {page}");
        assert_eq!(stat(&page, "kvroute_policy_version"), Some(2.0));
    }
    // Requests routed before the update complete against the same routers.
    for s in routed {
        host.finish_stream(s).unwrap();
    }
    for vm in vms {
        assert_eq!(inflight_total(&stats(&mut host, vm).unwrap()), 0.0);
    }
    // New traffic: the approximate index survived (the shared prefix still wins), B is never picked.
    for i in 0..20 {
        let (s, o) = route(&mut host, vms[i % 2], prompt(200 + i).as_bytes(), &[]).unwrap();
        let d = o.decision.unwrap();
        assert_ne!(d["endpoint"], B);
        assert!(d["prefix_hit"].as_f64().unwrap() > 0.5, "{d}");
        host.finish_stream(s).unwrap();
    }
    assert!(host.abi_violations().is_empty(), "{:#?}", &*host.abi_violations());
    for vm in vms {
        assert_eq!(host.failure(vm).unwrap(), None);
    }
}
