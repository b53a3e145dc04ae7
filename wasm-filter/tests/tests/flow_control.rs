//! Flow control in the filter: a request the core queues is held paused and released from a
//! completion, the tick (at the queue's nearest deadline), or a finished metrics poll; refusals
//! and drops are answered with their status and `x-llm-d-request-dropped-reason`; a downstream
//! reset cancels the ticket; worker VMs order their queues against each other through the shared
//! log; a VM that lost log entries releases its own held requests (fail-open); reconfiguration and
//! the plugin's shutdown release or answer what is held. The fixtures' sequences are in
//! `filter_golden_flow.rs`; host-call faults on these paths in `host_faults.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kvroute_filter::sync::{Entry, SharedLog, SharedStore, StoreError};
use kvroute_wasm_tests::*;
use serde_json::{json, Value};

const A: &str = "10.0.0.1:8000";
const BODY: &[u8] = br#"{"model":"m","prompt":"hello","max_tokens":16}"#;

/// Flow control on, one request per endpoint at most (the concurrency detector), with `extra`
/// merged into `flow_control`.
fn policy(extra: Value) -> Value {
    let mut f =
        json!({"enabled": true, "saturation_detector": {"kind": "concurrency", "max_requests_per_endpoint": 1}});
    if let (Some(f), Some(x)) = (f.as_object_mut(), extra.as_object()) {
        f.extend(x.clone());
    }
    json!({"flow_control": f})
}

/// `n` VMs of the filter sharing one host, one decode endpoint `A`.
fn start(n: usize, policy: &Value, filter: &Value) -> (Host, Vec<VmId>, Pages) {
    let pages = Pages::default();
    let mut host = host(&pages).unwrap();
    let plugin = host.load_kvroute_filter().unwrap();
    let cfg = plugin_config(policy, &[(A, "decode")], filter);
    let vms = (0..n).map(|_| host.start_vm(&plugin, vm_config(&cfg)).unwrap()).collect();
    (host, vms, pages)
}

fn page(host: &mut Host, vm: VmId) -> String {
    stats(host, vm).unwrap()
}

fn n(page: &str, series: &str) -> f64 {
    stat(page, series).unwrap_or(0.0)
}

fn clean(host: &Host, vms: &[VmId]) {
    for vm in vms {
        assert_eq!(host.failure(*vm).unwrap(), None);
    }
    assert!(host.abi_violations().is_empty(), "{:#?}", &*host.abi_violations());
}

#[test]
fn a_queued_request_is_held_paused_and_resumed_and_routed_when_a_completion_frees_its_slot() {
    let (mut host, vms, _) = start(1, &policy(json!({})), &json!({}));
    let vm = vms[0];
    let (first, o) = route(&mut host, vm, BODY, &[]).unwrap();
    assert_eq!(o.destination(), Some(A));
    let (held, o) = route(&mut host, vm, BODY, &[("x-llm-d-inference-fairness-id", "t")]).unwrap();
    assert!(is_held(&host, held), "{:?}", o.upstream);
    let last = *host.stream(held).unwrap().callbacks().last().unwrap();
    assert_eq!(
        (last.callback, last.action),
        ("proxy_on_request_body", Some(kvroute_wasm_host::Action::Pause)),
        "held by the body callback's Pause"
    );
    let p = page(&mut host, vm);
    assert_eq!(n(&p, "kvroute_wasm_flow_queued_total"), 1.0);
    assert_eq!(n(&p, "kvroute_wasm_flow_held"), 1.0);
    assert_eq!(n(&p, "kvroute_flow_queue_depth{priority=\"0\"}"), 1.0);
    // Time alone releases nothing while the slot is taken.
    host.advance(Duration::from_millis(500)).unwrap();
    assert!(is_held(&host, held));
    // The completion is the dispatch opportunity: resumed from the finishing stream's callback.
    host.finish_stream(first).unwrap();
    let o = outcome(host.stream(held).unwrap());
    assert_eq!(o.destination(), Some(A));
    assert!(o.header("x-kvroute-mode").is_some() && o.decision.is_some(), "routed as usual: {:?}", o.upstream);
    assert_eq!(host.stream(held).unwrap().request().body(), BODY, "the body went on");
    let p = page(&mut host, vm);
    assert_eq!(n(&p, "kvroute_wasm_flow_resumed_total"), 1.0);
    assert_eq!(n(&p, "kvroute_wasm_flow_held"), 0.0);
    assert_eq!(inflight_total(&p), 1.0);
    assert_eq!(n(&p, "kvroute_flow_dispatched_total"), 1.0);
    host.finish_stream(held).unwrap();
    assert_eq!(inflight_total(&page(&mut host, vm)), 0.0);
    clean(&host, &vms);
}

#[test]
fn a_queue_deadline_is_answered_from_the_tick_at_its_time_with_the_reason() {
    let (mut host, vms, _) = start(1, &policy(json!({})), &json!({"sync": {"tick_ms": 100}}));
    let vm = vms[0];
    let (first, _) = route(&mut host, vm, BODY, &[]).unwrap();
    let (held, _) = route(&mut host, vm, BODY, &[("x-llm-d-inference-ttl", "250ms")]).unwrap();
    assert!(is_held(&host, held));
    // Ticks every 100 ms, the last one before the deadline asks for the next at the deadline.
    host.advance(Duration::from_millis(249)).unwrap();
    assert!(is_held(&host, held));
    host.advance(Duration::from_millis(1)).unwrap();
    assert_eq!(dropped(&host, held), Some((429, "rejected-ttl-expired".into())));
    let (_, body) = answer(host.stream(held).unwrap());
    assert_eq!(body["error"], "rejected-ttl-expired");
    assert!(host.stream(held).unwrap().upstream_headers().is_none());
    let p = page(&mut host, vm);
    assert_eq!(n(&p, "kvroute_wasm_flow_dropped_total"), 1.0);
    assert_eq!(n(&p, "kvroute_flow_rejections_total{reason=\"rejected-ttl-expired\"}"), 1.0);
    host.finish_stream(held).unwrap();
    host.finish_stream(first).unwrap();
    // Nothing queued: back to the sync tick.
    let ticks = host.hostcall_count("proxy_set_tick_period_milliseconds");
    host.advance(Duration::from_millis(1000)).unwrap();
    assert!(host.hostcall_count("proxy_set_tick_period_milliseconds") <= ticks + 1);
    clean(&host, &vms);
}

#[test]
fn refusals_and_drops_are_answered_with_their_status_and_the_dropped_reason_header() {
    // A full queue refuses at admission.
    let (mut host, vms, _) = start(1, &policy(json!({"max_requests": 1, "shedding": {"enabled": false}})), &json!({}));
    let vm = vms[0];
    let (first, _) = route(&mut host, vm, BODY, &[]).unwrap();
    let (queued, _) = route(&mut host, vm, BODY, &[]).unwrap();
    assert!(is_held(&host, queued));
    let (refused, o) = route(&mut host, vm, BODY, &[]).unwrap();
    assert_eq!(dropped(&host, refused), Some((429, "rejected-saturated".into())));
    assert!(o.upstream.is_none());
    assert_eq!(o.local_headers.get("content-type"), Some("application/json"));
    // A normal request evicts a queued sheddable one: answered from the other stream's callback.
    host.finish_stream(refused).unwrap();
    host.finish_stream(queued).unwrap();
    let (sheddable, _) = route(&mut host, vm, BODY, &[("x-kvroute-priority", "-1")]).unwrap();
    assert!(is_held(&host, sheddable));
    let (normal, _) = route(&mut host, vm, BODY, &[]).unwrap();
    assert_eq!(dropped(&host, sheddable), Some((429, "evicted-priority".into())));
    assert!(is_held(&host, normal));
    let p = page(&mut host, vm);
    assert_eq!(n(&p, "kvroute_wasm_flow_rejected_total"), 1.0);
    assert_eq!(n(&p, "kvroute_wasm_flow_dropped_total"), 1.0);
    assert_eq!(n(&p, "kvroute_wasm_flow_cancelled_total"), 1.0, "the first queued one's client left");
    // The plugin shutting down answers what it holds: 503.
    host.shutdown_vm(vm).unwrap();
    assert_eq!(dropped(&host, normal), Some((503, "rejected-shutting-down".into())));
    host.finish_stream(first).unwrap();
    clean(&host, &vms);

    // No endpoint and no wait allowed: 503 at once.
    let filter = json!({"endpoints": [{"address": A, "role": "decode", "healthy": false}]});
    let (mut host, vms, _) = start(1, &policy(json!({"no_endpoints_ttl_ms": 0})), &filter);
    let (s, o) = route(&mut host, vms[0], BODY, &[]).unwrap();
    assert_eq!(dropped(&host, s), Some((503, "rejected-no-endpoints".into())));
    assert!(o.upstream.is_none());
    clean(&host, &vms);
}

#[test]
fn a_downstream_reset_cancels_the_held_ticket() {
    let (mut host, vms, _) = start(1, &policy(json!({})), &json!({}));
    let vm = vms[0];
    let (first, _) = route(&mut host, vm, BODY, &[]).unwrap();
    let (gone, _) = route(&mut host, vm, BODY, &[]).unwrap();
    let (next, _) = route(&mut host, vm, BODY, &[]).unwrap();
    assert!(is_held(&host, gone) && is_held(&host, next));
    // The client goes away: Envoy destroys the stream (on_done) while it is held.
    let st = host.finish_stream(gone).unwrap();
    assert!(st.upstream_headers().is_none() && st.local_reply().is_none());
    let p = page(&mut host, vm);
    assert_eq!(n(&p, "kvroute_flow_cancelled_total"), 1.0);
    assert_eq!(n(&p, "kvroute_wasm_flow_cancelled_total"), 1.0);
    assert_eq!(n(&p, "kvroute_flow_queue_depth{priority=\"0\"}"), 1.0);
    // The freed slot goes to the next one, never to the one that left.
    host.finish_stream(first).unwrap();
    assert_eq!(outcome(host.stream(next).unwrap()).destination(), Some(A));
    host.finish_stream(next).unwrap();
    clean(&host, &vms);
}

#[test]
fn a_finished_metrics_poll_releases_what_the_pool_now_has_room_for() {
    let p = json!({"flow_control": {"enabled": true,
        "saturation_detector": {"kind": "utilization", "queue_depth_threshold": 4}}});
    let (mut host, vms, pages) = start(1, &p, &json!({}));
    let vm = vms[0];
    pages.always(A, prometheus(&json!({"waiting": 8, "running": 4, "kv_usage": 0.2})));
    host.advance(Duration::from_millis(150)).unwrap();
    let (held, _) = route(&mut host, vm, BODY, &[]).unwrap();
    assert!(is_held(&host, held), "saturated: queued");
    host.advance(Duration::from_millis(100)).unwrap();
    assert!(is_held(&host, held), "still saturated");
    pages.always(A, prometheus(&json!({"waiting": 0, "running": 4, "kv_usage": 0.2})));
    host.advance(Duration::from_millis(100)).unwrap();
    assert_eq!(outcome(host.stream(held).unwrap()).destination(), Some(A), "released when the poll round ended");
    host.finish_stream(held).unwrap();
    clean(&host, &vms);
}

#[test]
fn a_request_queued_in_one_vm_is_dispatched_before_a_later_one_queued_in_another() {
    let (mut host, vms, _) = start(2, &policy(json!({})), &json!({"sync": {"tick_ms": 100}}));
    let (a, b) = (vms[0], vms[1]);
    let (first, o) = route(&mut host, b, BODY, &[]).unwrap();
    assert_eq!(o.destination(), Some(A));
    host.advance(Duration::from_millis(1)).unwrap();
    let (r1, _) = route(&mut host, a, BODY, &[]).unwrap();
    assert!(is_held(&host, r1), "VM A sees VM B's request in flight: queued");
    host.advance(Duration::from_millis(1)).unwrap();
    let (r2, _) = route(&mut host, b, BODY, &[]).unwrap();
    assert!(is_held(&host, r2));
    // VM B holds a replica of VM A's request, ahead of its own.
    let p = page(&mut host, b);
    assert_eq!(n(&p, "kvroute_wasm_flow_replicas"), 1.0);
    assert_eq!(n(&p, "kvroute_wasm_flow_held"), 1.0);
    assert_eq!(n(&p, "kvroute_flow_queue_depth{priority=\"0\"}"), 2.0, "the queue of both VMs");
    // The completion on VM B frees the slot: VM B's controller gives it to VM A's request, so
    // VM B's own later request stays held.
    host.finish_stream(first).unwrap();
    assert!(is_held(&host, r2), "VM B must not overtake VM A's earlier request");
    assert!(is_held(&host, r1), "VM A has not seen the completion yet");
    // VM A's next tick applies the completion and resumes its request.
    host.advance(Duration::from_millis(100)).unwrap();
    assert_eq!(outcome(host.stream(r1).unwrap()).destination(), Some(A));
    assert!(is_held(&host, r2), "one slot: VM B's request waits for VM A's to complete");
    host.advance(Duration::from_millis(300)).unwrap();
    assert!(is_held(&host, r2), "VM A's routing is counted on VM B (no double count, no lapse)");
    // VM A's request completes: VM B's tick applies it and resumes its own.
    host.finish_stream(r1).unwrap();
    assert!(is_held(&host, r2));
    host.advance(Duration::from_millis(100)).unwrap();
    assert_eq!(outcome(host.stream(r2).unwrap()).destination(), Some(A));
    let p = page(&mut host, b);
    assert_eq!(n(&p, "kvroute_wasm_flow_replicas"), 0.0, "VM A's request left: its replica is forgotten");
    assert_eq!(n(&p, "kvroute_flow_dispatched_total"), 1.0, "each VM counts its own");
    host.finish_stream(r2).unwrap();
    host.advance(Duration::from_millis(100)).unwrap();
    for vm in [a, b] {
        let p = page(&mut host, vm);
        assert_eq!(inflight_total(&p), 0.0);
        assert_eq!(n(&p, "kvroute_flow_queue_depth{priority=\"0\"}"), 0.0);
    }
    clean(&host, &vms);
}

#[test]
fn a_vm_that_lost_log_entries_releases_its_held_requests_instead_of_holding_them() {
    let filter = json!({"sync": {"tick_ms": 100, "ring_entries": 16}});
    let (mut host, vms, _) = start(2, &policy(json!({"max_requests": 0})), &filter);
    let (a, b) = (vms[0], vms[1]);
    let (first, _) = route(&mut host, a, BODY, &[]).unwrap();
    let (held, _) = route(&mut host, a, BODY, &[]).unwrap();
    assert!(is_held(&host, held));
    // VM B queues 20 requests before VM A reads the log again: more than the ring holds.
    let others: Vec<StreamId> = (0..20).map(|_| route(&mut host, b, BODY, &[]).unwrap().0).collect();
    assert!(others.iter().all(|s| is_held(&host, *s)));
    host.advance(Duration::from_millis(100)).unwrap();
    let p = page(&mut host, a);
    assert!(n(&p, "kvroute_wasm_sync_overruns_total") >= 1.0);
    assert_eq!(n(&p, "kvroute_wasm_flow_fail_open_total"), 1.0);
    assert_eq!(n(&p, "kvroute_wasm_flow_replicas"), 0.0, "replicas it can no longer trust are forgotten");
    assert_eq!(outcome(host.stream(held).unwrap()).destination(), Some(A), "released rather than held");
    for s in others {
        host.finish_stream(s).unwrap();
    }
    host.finish_stream(held).unwrap();
    host.finish_stream(first).unwrap();
    clean(&host, &vms);
}

#[test]
fn a_reconfiguration_keeps_held_requests_answers_what_no_longer_fits_and_off_releases_the_rest() {
    let (mut host, vms, _) = start(1, &policy(json!({})), &json!({}));
    let vm = vms[0];
    let (first, _) = route(&mut host, vm, BODY, &[]).unwrap();
    let (older, _) = route(&mut host, vm, BODY, &[]).unwrap();
    let (newer, _) = route(&mut host, vm, BODY, &[]).unwrap();
    // Lower limits: the newest goes (answered from the new root context's configure).
    assert!(host
        .reconfigure(vm, plugin_config(&policy(json!({"max_requests": 1})), &[(A, "decode")], &json!({})))
        .unwrap());
    assert_eq!(dropped(&host, newer), Some((429, "evicted-queue-pressure".into())));
    assert!(is_held(&host, older), "kept over the reload");
    // Flow control off: everything held goes, routed.
    assert!(host.reconfigure(vm, plugin_config(&json!({}), &[(A, "decode")], &json!({}))).unwrap());
    assert_eq!(outcome(host.stream(older).unwrap()).destination(), Some(A));
    host.finish_stream(older).unwrap();
    host.finish_stream(newer).unwrap();
    host.finish_stream(first).unwrap();
    assert_eq!(inflight_total(&page(&mut host, vm)), 0.0);
    clean(&host, &vms);
}

#[test]
fn with_flow_control_off_no_request_costs_a_flow_host_call() {
    let (mut host, vms, _) = start(2, &json!({}), &json!({}));
    host.advance(Duration::from_millis(200)).unwrap();
    let calls = |h: &Host| {
        ["proxy_set_effective_context", "proxy_continue_stream", "proxy_set_tick_period_milliseconds"]
            .map(|c| h.hostcall_count(c))
    };
    let before = calls(&host);
    for i in 0..50 {
        let (s, o) = route(&mut host, vms[i % 2], BODY, &[]).unwrap();
        assert_eq!(o.destination(), Some(A));
        host.finish_stream(s).unwrap();
    }
    host.advance(Duration::from_millis(500)).unwrap();
    assert_eq!(calls(&host), before);
    clean(&host, &vms);
}

/// The host's shared data, written from the test as another VM would (no CAS needed: nothing
/// else writes while the test does).
struct TestStore<'a>(&'a mut Host);

impl SharedStore for TestStore<'_> {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        Ok(self.0.shared_data(VM_ID, key).map_or((None, None), |(v, cas)| (Some(v), Some(cas))))
    }

    fn set(&mut self, key: &str, value: &[u8], _cas: Option<u32>) -> Result<(), StoreError> {
        self.0.set_shared_data(VM_ID, key, value.to_vec());
        Ok(())
    }
}

#[test]
fn a_replica_whose_owner_is_gone_holds_a_slot_for_at_most_a_second() {
    let (mut host, vms, _) = start(1, &policy(json!({})), &json!({"sync": {"tick_ms": 100}}));
    let vm = vms[0];
    let (first, _) = route(&mut host, vm, BODY, &[]).unwrap();
    // A VM that queued a request and then vanished: its `FlowLeft` never comes.
    let ghost = kvroute::FlowReplica {
        fairness_id: "default".into(),
        priority: 0,
        enqueue_ms: now_ms(&host),
        bytes: 10,
        tokens: 17,
        cost: 33.0,
        slo_ttft_ms: None,
        ttl_ms: None,
    };
    let mut gone = SharedLog::new("kvroute", 8192, 999_999);
    gone.append(&mut TestStore(&mut host), &Entry::flow_queued(7, &ghost)).unwrap();
    host.advance(Duration::from_millis(1)).unwrap();
    let (mine, _) = route(&mut host, vm, BODY, &[]).unwrap();
    assert!(is_held(&host, mine));
    assert_eq!(n(&page(&mut host, vm), "kvroute_wasm_flow_replicas"), 1.0, "queued behind the ghost");
    // The slot frees: the ghost is at the head, its owner never takes it.
    host.finish_stream(first).unwrap();
    host.advance(Duration::from_millis(900)).unwrap();
    assert!(is_held(&host, mine), "the slot is held for the other VM's request");
    host.advance(Duration::from_millis(200)).unwrap();
    assert_eq!(outcome(host.stream(mine).unwrap()).destination(), Some(A), "after a second, it is this VM's");
    host.finish_stream(mine).unwrap();
    host.advance(Duration::from_millis(6000)).unwrap();
    assert_eq!(n(&page(&mut host, vm), "kvroute_wasm_flow_replicas"), 0.0, "forgotten");
    clean(&host, &vms);
}
