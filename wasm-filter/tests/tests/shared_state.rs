//! Envoy runs one VM per worker thread. These tests start several VMs of the filter in one host
//! (one Envoy process: shared data and metrics shared by `vm_id`) and check that each kind of
//! routing state one VM learns is seen by the others through the replicated log in shared data:
//! approximate prefix observations, in-flight counts, endpoint metrics (polled by one VM only,
//! through HTTP callouts), and the event-fed precise index. A control VM under another `vm_id`
//! (another Envoy process) sees none of it, which shows the checks can fail.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use kvroute_wasm_tests::*;
use serde_json::{json, Value};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";
const C: &str = "10.0.0.3:8000";

/// `n` VMs sharing state, plus a control VM under another vm_id, all with the same config.
fn fleet(policy: &Value, endpoints: &[(&str, &str)], n: usize, pages: &Pages) -> (Host, Vec<VmId>, VmId) {
    let mut host = host(pages).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let cfg = plugin_config(policy, endpoints, &json!({}));
    let vms = (0..n).map(|_| host.start_vm(&filter, vm_config(&cfg)).unwrap()).collect();
    let control = host.start_vm(&filter, vm_config(&cfg).vm_id("another-envoy")).unwrap();
    (host, vms, control)
}

fn clean(host: &Host) {
    assert!(host.abi_violations().is_empty(), "{:#?}", &*host.abi_violations());
    for vm in host.vms() {
        assert_eq!(host.failure(vm).unwrap(), None);
    }
}

fn prompt(tag: &str) -> Vec<u8> {
    let words: String = (0..400).map(|i| format!("{tag}{i} ")).collect();
    json!({"model": "m", "prompt": words, "max_tokens": 600}).to_string().into_bytes()
}

#[test]
fn approximate_prefix_observations_are_shared() {
    let (mut host, vms, control) =
        fleet(&json!({}), &[(A, "decode"), (B, "decode"), (C, "decode")], 3, &Pages::default());
    // Each VM routes its own prompt; every other VM then finds that prompt cached where it went.
    let tags = ["alpha", "beta", "gamma"];
    let mut placed = Vec::new();
    for (vm, tag) in vms.iter().zip(tags) {
        let (s, o) = route(&mut host, *vm, &prompt(tag), &[]).unwrap();
        placed.push(o.destination().unwrap().to_owned());
        host.finish_stream(s).unwrap();
    }
    for (i, tag) in tags.iter().enumerate() {
        for (j, vm) in vms.iter().enumerate() {
            if i == j {
                continue;
            }
            let (s, o) = route(&mut host, *vm, &prompt(tag), &[]).unwrap();
            let d = o.decision.unwrap();
            let sc = score(&d, &placed[i]);
            assert!(sc["matched_blocks"].as_u64().unwrap() > 0, "VM {j} does not see VM {i}'s {tag}: {d}");
            assert_eq!(sc["precise"], false);
            assert_eq!(d["endpoint"], placed[i].as_str(), "VM {j} follows the cache of VM {i}");
            host.finish_stream(s).unwrap();
        }
    }
    // Another Envoy (another vm_id) shares nothing.
    let (_, o) = route(&mut host, control, &prompt("alpha"), &[]).unwrap();
    let d = o.decision.unwrap();
    for ep in [A, B, C] {
        assert_eq!(score(&d, ep)["matched_blocks"], 0, "{d}");
    }
    clean(&host);
}

#[test]
fn in_flight_counts_are_shared_and_released_by_completions() {
    let (mut host, vms, control) = fleet(&json!({}), &[(A, "decode"), (B, "decode")], 3, &Pages::default());
    let mut open = Vec::new();
    for i in 0..8 {
        let vm = vms[i % 2];
        let body = json!({"model": "m", "prompt": format!("request {i}")}).to_string();
        let (s, o) = route(&mut host, vm, body.as_bytes(), &[]).unwrap();
        assert!(o.destination().is_some());
        open.push(s);
    }
    // VM 2 routed nothing, yet sees the 8 requests in flight, and spreads load by them.
    let page = stats(&mut host, vms[2]).unwrap();
    assert_eq!(inflight_total(&page), 8.0, "{page}");
    assert_eq!(stat(&page, &format!("kvroute_inflight_requests{{endpoint=\"{A}\"}}")), Some(4.0), "{page}");
    assert_eq!(inflight_total(&stats(&mut host, control).unwrap()), 0.0);
    let (s, o) = route(&mut host, vms[2], br#"{"model": "m", "prompt": "ninth"}"#, &[]).unwrap();
    let d = o.decision.unwrap();
    assert!(score(&d, A)["inflight"].as_f64().unwrap() > 0.0, "{d}");
    open.push(s);
    for s in open.drain(..5) {
        host.finish_stream(s).unwrap();
    }
    assert_eq!(inflight_total(&stats(&mut host, vms[0]).unwrap()), 4.0);
    for s in open {
        host.finish_stream(s).unwrap();
    }
    for vm in &vms {
        assert_eq!(inflight_total(&stats(&mut host, *vm).unwrap()), 0.0, "every VM saw every completion");
    }
    clean(&host);
}

#[test]
fn batched_completions_reach_the_other_vms_with_the_next_decision_or_the_next_tick() {
    // `sync.batch_completions`: a completion waits for its VM's next append (one claim with the
    // decision's effects) or its next tick; its own VM applies it at once.
    let mut host = host(&Pages::default()).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let extra = json!({"sync": {"batch_completions": true, "tick_ms": 100}});
    let cfg = plugin_config(&json!({}), &[(A, "decode"), (B, "decode")], &extra);
    let vms: Vec<VmId> = (0..2).map(|_| host.start_vm(&filter, vm_config(&cfg)).unwrap()).collect();
    let mut open = Vec::new();
    for i in 0..2 {
        let body = json!({"model": "m", "prompt": format!("request {i}")}).to_string();
        let (s, o) = route(&mut host, vms[0], body.as_bytes(), &[]).unwrap();
        assert!(o.destination().is_some());
        open.push(s);
    }
    assert_eq!(inflight_total(&stats(&mut host, vms[1]).unwrap()), 2.0);
    host.finish_stream(open.remove(0)).unwrap();
    assert_eq!(inflight_total(&stats(&mut host, vms[0]).unwrap()), 1.0, "its own VM at once");
    assert_eq!(inflight_total(&stats(&mut host, vms[1]).unwrap()), 2.0, "deferred");
    let (s, _) = route(&mut host, vms[0], br#"{"model": "m", "prompt": "third"}"#, &[]).unwrap();
    open.push(s);
    assert_eq!(inflight_total(&stats(&mut host, vms[1]).unwrap()), 2.0, "with the next decision");
    for s in open.drain(..) {
        host.finish_stream(s).unwrap();
    }
    assert_eq!(inflight_total(&stats(&mut host, vms[1]).unwrap()), 2.0);
    host.advance(Duration::from_millis(100)).unwrap();
    for vm in &vms {
        assert_eq!(inflight_total(&stats(&mut host, *vm).unwrap()), 0.0, "within one tick");
    }
    clean(&host);
}

#[test]
fn one_vm_polls_metrics_through_the_cluster_and_every_vm_uses_them() {
    let pages = Pages::default();
    pages.always(A, prometheus(&json!({"waiting": 2, "running": 1, "kv_usage": 0.3})));
    let sglang = "# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name=\"m\"} 4\n\
                  sglang:num_running_reqs{model_name=\"m\"} 2\nsglang:token_usage{model_name=\"m\"} 0.55\n";
    pages.always(B, sglang);
    // C answers 503: a failed poll, counted, never fatal.
    let (mut host, vms, control) = fleet(&json!({}), &[(A, "decode"), (B, "decode"), (C, "decode")], 3, &pages);
    host.advance(Duration::from_millis(1_000)).unwrap();

    // (The control VM, another Envoy, polls for itself.)
    let calls: Vec<_> = host.callouts().iter().filter(|c| c.vm != control).cloned().collect();
    let pollers: BTreeSet<_> = calls.iter().map(|c| c.vm).collect();
    assert_eq!(pollers.len(), 1, "one VM holds the polling lease: {pollers:?}");
    for ep in [A, B, C] {
        let mine: Vec<_> = calls.iter().filter(|c| c.headers.get(":authority") == Some(ep)).collect();
        // interval 100 ms over one second (the first poll on the first tick).
        assert!((9..=11).contains(&mine.len()), "{ep}: {} polls", mine.len());
        for c in mine {
            assert_eq!(c.cluster, CLUSTER);
            assert_eq!(c.headers.get(":method"), Some("GET"));
            assert_eq!(c.headers.get(":path"), Some("/metrics"));
            assert_eq!(c.headers.get(DESTINATION), Some(ep), "the ORIGINAL_DST cluster follows this header");
        }
    }
    for vm in &vms {
        let (s, o) = route(&mut host, *vm, br#"{"model": "m", "prompt": "which one"}"#, &[]).unwrap();
        let d = o.decision.unwrap();
        assert_eq!(score(&d, A)["kv_usage"], 0.3, "vLLM page, VM {vm:?}: {d}");
        assert_eq!(score(&d, B)["kv_usage"], 0.55, "SGLang page, VM {vm:?}: {d}");
        assert_eq!(score(&d, C)["filtered"], "stale_metrics", "never answered: {d}");
        assert_eq!(d["endpoint"], A, "A has the least load");
        host.finish_stream(s).unwrap();
    }
    let poller = *pollers.iter().next().unwrap();
    let page = stats(&mut host, poller).unwrap();
    assert!(stat(&page, "kvroute_wasm_metric_polls_total").unwrap() >= 18.0, "{page}");
    assert!(stat(&page, "kvroute_wasm_metric_poll_failures_total").unwrap() >= 9.0, "{page}");

    // The poller goes away (its worker's VM shuts down): another VM takes the lease over.
    host.shutdown_vm(poller).unwrap();
    let before = host.callouts().len();
    host.advance(Duration::from_millis(1_000)).unwrap();
    let later: BTreeSet<_> = host.callouts()[before..].iter().map(|c| c.vm).filter(|vm| *vm != control).collect();
    assert_eq!(later.len(), 1, "{later:?}");
    assert!(!later.contains(&poller));
    clean(&host);
}

#[test]
fn event_fed_index_is_shared() {
    let case = golden_case("41_precise_event_fed_hit");
    let steps = case["steps"].as_array().unwrap();
    let (events, request) = (&steps[2], &steps[3]);
    let (mut host, vms, control) = fleet(&case["policy"], &[(A, "decode"), (B, "decode")], 2, &Pages::default());
    let batch = hex(events["payload_hex"].as_str().unwrap());
    let (status, answer) = post_events(&mut host, vms[0], B, Some(0), &batch, SECRET).unwrap();
    assert_eq!((status, answer["verdict"].as_str(), answer["blocks"].as_u64()), (200, Some("applied"), Some(64)));
    let body = request["body"].to_string();
    for vm in [vms[1], vms[0]] {
        let (s, o) = route(&mut host, vm, body.as_bytes(), &[]).unwrap();
        let d = o.decision.unwrap();
        assert_eq!(d["endpoint"], B, "{d}");
        assert_eq!(score(&d, B)["matched_blocks"], 64);
        assert_eq!(score(&d, B)["precise"], true);
        host.finish_stream(s).unwrap();
    }
    // The same batch again, on the other VM: it knows the stream's sequence already.
    let (status, answer) = post_events(&mut host, vms[1], B, Some(0), &batch, SECRET).unwrap();
    assert_eq!((status, answer["verdict"].as_str()), (200, Some("duplicate")));
    let page = stats(&mut host, vms[1]).unwrap();
    assert_eq!(stat(&page, &format!("kvroute_event_stream_healthy{{endpoint=\"{B}\"}}")), Some(1.0), "{page}");
    let (_, o) = route(&mut host, control, body.as_bytes(), &[]).unwrap();
    assert_eq!(score(&o.decision.unwrap(), B)["matched_blocks"], 0);
    clean(&host);
}

#[test]
fn interleaved_traffic_with_write_conflicts_stays_consistent() {
    // Four VMs take turns; shared-data writes conflict often (as when worker threads race):
    // the log retries, and every VM ends with the same in-flight view.
    let (mut host, vms, _) = fleet(&json!({}), &[(A, "decode"), (B, "decode"), (C, "both")], 4, &Pages::default());
    let (s, _) = route(&mut host, vms[0], br#"{"model": "m", "prompt": "open the log"}"#, &[]).unwrap();
    host.finish_stream(s).unwrap();
    let head = host.shared_data_keys(VM_ID).into_iter().find(|k| k.ends_with("/head")).unwrap();
    let mut open = Vec::new();
    for i in 0..60 {
        if i % 7 == 0 {
            host.force_cas_mismatch(VM_ID, &head, 3);
        }
        let body = json!({"model": "m", "prompt": format!("conversation {} turn {i}", i % 5)}).to_string();
        let (s, o) = route(&mut host, vms[i % 4], body.as_bytes(), &[]).unwrap();
        assert!(o.destination().is_some());
        open.push(s);
        if i % 3 == 0 {
            host.finish_stream(open.remove(0)).unwrap();
        }
        host.advance(Duration::from_millis(7)).unwrap();
    }
    let pages: Vec<String> = vms.iter().map(|vm| stats(&mut host, *vm).unwrap()).collect();
    for p in &pages {
        assert_eq!(inflight_total(p), open.len() as f64, "{p}");
        for ep in [A, B, C] {
            let series = format!("kvroute_inflight_requests{{endpoint=\"{ep}\"}}");
            assert_eq!(stat(p, &series), stat(&pages[0], &series), "{ep}");
        }
        assert_eq!(stat(p, "kvroute_wasm_sync_errors_total"), Some(0.0), "conflicts are retried: {p}");
    }
    let conflicts: f64 = pages.iter().filter_map(|p| stat(p, "kvroute_wasm_sync_cas_conflicts_total")).sum();
    assert!(conflicts >= 9.0, "{conflicts}");
    clean(&host);
}
