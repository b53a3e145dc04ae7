//! 100,000 requests through two VMs of the filter (the release-optimized guest, as deployed):
//! every request routed, and the guest's linear memory stops growing once the bounded state
//! (approximate index at its byte budget, shared-log cursor, counters) is warm. Wasm memory never
//! shrinks, so any leak per request would show as growth over the 90,000 requests after warm-up.
//!
//! `KVROUTE_LOAD_REQUESTS` changes the count (the test script runs the default, 100,000).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use kvroute_wasm_tests::*;
use serde_json::json;

const ENDPOINTS: [&str; 4] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"];

#[test]
fn one_hundred_thousand_requests_without_guest_memory_growth() {
    let total: usize = std::env::var("KVROUTE_LOAD_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let warmup = total / 10;
    let pages = Pages::default();
    for (i, ep) in ENDPOINTS.iter().enumerate() {
        pages.always(ep, prometheus(&json!({"waiting": i, "running": 2, "kv_usage": 0.1 * i as f64})));
    }
    let mut host = host(&pages).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    // A small index budget, so that the bounded index is full well within the warm-up.
    let policy = json!({"index": {"capacity_bytes_per_endpoint": 32768}});
    let endpoints: Vec<(&str, &str)> = ENDPOINTS.iter().map(|e| (*e, "decode")).collect();
    let cfg = plugin_config(&policy, &endpoints, &json!({"debug_decision_header": false}));
    let vms = [host.start_vm(&filter, vm_config(&cfg)).unwrap(), host.start_vm(&filter, vm_config(&cfg)).unwrap()];

    let started = Instant::now();
    let mut warm = None;
    let mut routed = [0usize; 4];
    for i in 0..total {
        // 50 conversations that keep growing, and a unique tail per request.
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"conversation {} of the load test"}},{{"role":"user","content":"question {i}: {}"}}],"max_tokens":64}}"#,
            i % 50,
            "lorem ipsum dolor sit amet ".repeat(i % 7 + 1)
        );
        let (s, o) = route(&mut host, vms[i % 2], body.as_bytes(), &[]).unwrap();
        let dest = o.destination().unwrap_or_else(|| panic!("request {i} not routed"));
        assert_eq!(o.header("x-kvroute-fallback"), None, "request {i}");
        routed[ENDPOINTS.iter().position(|e| *e == dest).unwrap()] += 1;
        host.finish_stream(s).unwrap();
        if i % 10 == 0 {
            host.advance(Duration::from_millis(3)).unwrap();
        }
        if i + 1 == warmup {
            warm = Some(vms.map(|vm| host.memory_size(vm).unwrap()));
        }
    }
    let warm = warm.unwrap();
    let end = vms.map(|vm| host.memory_size(vm).unwrap());
    println!(
        "{total} requests in {:?}; guest memory after warm-up {warm:?} bytes, at the end {end:?}; per endpoint {routed:?}",
        started.elapsed()
    );
    assert_eq!(end, warm, "guest memory grew after warm-up");
    for vm in vms {
        let page = stats(&mut host, vm).unwrap();
        assert_eq!(inflight_total(&page), 0.0);
        assert_eq!(stat(&page, "kvroute_wasm_routed_total"), Some((total / 2) as f64));
        assert_eq!(stat(&page, "kvroute_wasm_sync_errors_total"), Some(0.0));
        assert_eq!(stat(&page, "kvroute_wasm_sync_lost_total"), Some(0.0));
    }
    assert!(routed.iter().all(|n| *n > 0), "load is spread: {routed:?}");
    assert!(host.abi_violations().is_empty());
}
