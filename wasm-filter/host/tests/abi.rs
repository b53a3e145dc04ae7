//! The host's own tests: small WAT guests call every hostcall and the tests check the ABI answers,
//! the stream semantics and the shared state against the specification and Envoy's behaviour.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod guest;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use guest::{bytes_at, journal, logs, module, slot, slot64, slots};
use kvroute_wasm_host::{
    CalloutReply, CalloutRequest, Fault, FlowState, HeaderMap, Host, HostError, HttpMessage, LogLevel, MetricValue,
    Status, VmConfig, VmId, DEFAULT_START_TIME_NS, PROXY_IMPORTS,
};

fn start(host: &mut Host, wat: &str, config: VmConfig) -> VmId {
    let plugin = host.compile(wat).unwrap();
    host.start_vm(&plugin, config).unwrap()
}

fn request_headers() -> HeaderMap {
    HeaderMap::from([(":method", "POST"), (":path", "/v1"), (":authority", "api"), ("drop-me", "x")])
}

// ---- lifecycle ----

const LIFECYCLE: &str = r#"
  (func (export "proxy_on_context_create") (param $c i32) (param $p i32)
    (call $ev (i32.add (i32.const 1000) (i32.add (i32.mul (local.get $p) (i32.const 100)) (local.get $c)))))
  (func (export "proxy_on_vm_start") (param $c i32) (param $n i32) (result i32)
    (call $ev (i32.add (i32.const 2000) (local.get $c)))
    (drop (call $proxy_get_buffer_bytes (i32.const 6) (i32.const 0) (local.get $n) (i32.const 0) (i32.const 4)))
    (call $log_ret)
    (call $rec (i32.const 100)
      (call $proxy_get_buffer_bytes (i32.const 7) (i32.const 0) (i32.const 100) (i32.const 0) (i32.const 4)))
    (i32.const 1))
  (func (export "proxy_on_configure") (param $c i32) (param $n i32) (result i32)
    (call $ev (i32.add (i32.const 3000) (local.get $c)))
    (drop (call $proxy_get_buffer_bytes (i32.const 7) (i32.const 0) (local.get $n) (i32.const 0) (i32.const 4)))
    (call $log_ret)
    (i32.ne (local.get $n) (i32.const 3)))
  (func (export "proxy_on_done") (param $c i32) (result i32)
    (call $ev (i32.add (i32.const 4000) (local.get $c))) (i32.const 1))
  (func (export "proxy_on_log") (param $c i32) (call $ev (i32.add (i32.const 5000) (local.get $c))))
  (func (export "proxy_on_delete") (param $c i32) (call $ev (i32.add (i32.const 6000) (local.get $c))))
  (func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
    (call $ev (i32.add (i32.const 7000) (local.get $c))) (i32.const 0))
"#;

#[test]
fn lifecycle_configuration_and_reconfiguration() {
    let mut host = Host::new().unwrap();
    let wat = module(&[], LIFECYCLE);
    let plugin = host.compile(&wat).unwrap();
    let config = VmConfig::new().vm_configuration(b"vmcfg".to_vec()).plugin_configuration(b"{ }".to_vec());
    let bad = config.clone().plugin_configuration(b"bad".to_vec());
    assert!(matches!(host.start_vm(&plugin, bad), Err(HostError::ConfigureRejected(_))));

    let vm = host.start_vm(&plugin, config.plugin_configuration(b"{}!".to_vec().repeat(2))).unwrap();
    // root context 1: created with parent 0, then vm_start, then configure
    assert_eq!(journal(&host, vm), [1001, 2001, 3001]);
    assert_eq!(logs(&host, vm), ["vmcfg", "{}!{}!"]);
    assert_eq!(slot(&host, vm, 100), 1, "PLUGIN_CONFIGURATION is NotFound in proxy_on_vm_start");
    assert_eq!(host.root_context_id(vm).unwrap(), 1);

    // Envoy-style reconfiguration: a refused configuration retires the new root, the old one stays
    assert!(!host.reconfigure(vm, b"bad".to_vec()).unwrap());
    assert_eq!(journal(&host, vm)[3..], [1002, 2002, 3002, 4002, 6002]);
    assert_eq!(host.root_context_id(vm).unwrap(), 1);
    // an accepted one switches streams to the new root and retires the old
    assert!(host.reconfigure(vm, b"good".to_vec()).unwrap());
    assert_eq!(journal(&host, vm)[8..], [1003, 2003, 3003, 4001, 6001]);
    assert_eq!(host.root_context_id(vm).unwrap(), 3);

    let s = host.new_stream(vm).unwrap();
    assert_eq!(s.context_id(), 4);
    host.send_request_headers(s, request_headers(), true).unwrap();
    let done = host.finish_stream(s).unwrap();
    assert_eq!(done.request().state(), FlowState::Complete);
    assert_eq!(journal(&host, vm)[13..], [1304, 7004, 4004, 5004, 6004]);
    assert!(matches!(host.stream(s), Err(HostError::UnknownStream(_))));

    // configure again in place: the filter's answer is observable
    assert!(!host.configure_again(vm, b"bad".to_vec()).unwrap());
    assert!(host.configure_again(vm, b"fine".to_vec()).unwrap());
    assert_eq!(journal(&host, vm)[18..], [3003, 3003]);

    host.shutdown_vm(vm).unwrap();
    assert_eq!(journal(&host, vm)[20..], [4003, 6003]);
    assert!(matches!(host.new_stream(vm), Err(HostError::UnknownVm(_))));
}

#[test]
fn start_rejects_modules_envoy_would_reject() {
    let mut host = Host::new().unwrap();
    let bare = |exports: &str| format!(r#"(module (memory (export "memory") 1) {exports})"#);
    let alloc = r#"(func (export "proxy_on_memory_allocate") (param i32) (result i32) (i32.const 1024))"#;
    let marker = r#"(func (export "proxy_abi_version_0_2_1"))"#;

    let missing =
        format!(r#"(module (import "env" "proxy_nonexistent" (func)) (memory (export "memory") 1) {marker} {alloc})"#);
    let plugin = host.compile(missing).unwrap();
    match host.start_vm(&plugin, VmConfig::new()) {
        Err(HostError::MissingImport { module, name }) => {
            assert_eq!((module.as_str(), name.as_str()), ("env", "proxy_nonexistent"));
        }
        other => panic!("{other:?}"),
    }
    let no_marker = host.compile(bare(alloc)).unwrap();
    assert!(
        matches!(host.start_vm(&no_marker, VmConfig::new()), Err(HostError::Abi(m)) if m.contains("proxy_abi_version_0_2_1"))
    );
    let old_abi = host.compile(bare(&format!(r#"{alloc} (func (export "proxy_abi_version_0_2_0"))"#))).unwrap();
    assert!(matches!(host.start_vm(&old_abi, VmConfig::new()), Err(HostError::Abi(m)) if m.contains("0.2.1 only")));
    let no_alloc = host.compile(bare(marker)).unwrap();
    assert!(matches!(host.start_vm(&no_alloc, VmConfig::new()), Err(HostError::Abi(m)) if m.contains("allocate")));
    let wrong_type = host
        .compile(bare(&format!(
            r#"{marker} {alloc} (func (export "proxy_on_request_headers") (param i32 i32) (result i32) (i32.const 0))"#
        )))
        .unwrap();
    assert!(
        matches!(host.start_vm(&wrong_type, VmConfig::new()), Err(HostError::Abi(m)) if m.contains("proxy_on_request_headers"))
    );

    // _initialize may log, but nothing else (as in Envoy)
    let init = module(
        &[("hi", b"starting"), ("k", b"k")],
        r#"(func (export "_initialize")
             (drop (call $proxy_log (i32.const 2) {hi}))
             (drop (call $proxy_set_shared_data {k} {k} (i32.const 0))))"#,
    );
    let plugin = host.compile(init).unwrap();
    match host.start_vm(&plugin, VmConfig::new()) {
        Err(HostError::Trap { function, message, .. }) => {
            assert_eq!(function, "_initialize");
            assert!(message.contains("proxy_set_shared_data"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(host.logs().last().map(|l| l.message.as_str()), Some("starting"));

    let refuses = module(&[], r#"(func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 0))"#);
    let plugin = host.compile(refuses).unwrap();
    assert!(matches!(host.start_vm(&plugin, VmConfig::new()), Err(HostError::VmStartRejected(_))));
    assert!(host.vms().is_empty(), "failed VMs are not kept");
}

// ---- header maps ----

#[test]
fn header_maps_serialize_and_edit_like_envoy() {
    let mut host = Host::new().unwrap();
    let wat = module(
        &[
            ("path", b":path"),
            ("new", b"/v2/chat"),
            ("xa", b"x-a"),
            ("one", b"1"),
            ("drop", b"drop-me"),
            ("nope", b"nope"),
        ],
        r#"(func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (call $rec (i32.const 0) (local.get $n))
             (call $rec (i32.const 1) (call $proxy_get_header_map_pairs (i32.const 0) (i32.const 0) (i32.const 4)))
             (call $rec (i32.const 2) (i32.load (i32.const 0)))
             (call $rec (i32.const 3) (i32.load (i32.const 4)))
             (call $rec (i32.const 4) (call $proxy_get_header_map_value (i32.const 0) {path} (i32.const 8) (i32.const 12)))
             (call $rec (i32.const 5) (i32.load (i32.const 8)))
             (call $rec (i32.const 6) (i32.load (i32.const 12)))
             (call $rec (i32.const 7) (call $proxy_add_header_map_value (i32.const 0) {xa} {one}))
             (call $rec (i32.const 8) (call $proxy_replace_header_map_value (i32.const 0) {path} {new}))
             (call $rec (i32.const 9) (call $proxy_remove_header_map_value (i32.const 0) {drop}))
             (call $rec (i32.const 10) (call $proxy_get_header_map_size (i32.const 0) (i32.const 16)))
             (call $rec (i32.const 11) (i32.load (i32.const 16)))
             (call $rec (i32.const 12) (call $proxy_get_header_map_value (i32.const 0) {nope} (i32.const 8) (i32.const 12)))
             (call $rec (i32.const 13) (call $proxy_get_header_map_pairs (i32.const 99) (i32.const 0) (i32.const 4)))
             (call $rec (i32.const 14) (call $proxy_get_header_map_pairs (i32.const 1) (i32.const 0) (i32.const 4)))
             (call $rec (i32.const 15) (i32.load (i32.const 4)))
             (i32.const 0))"#,
    );
    let vm = start(&mut host, &wat, VmConfig::new());
    let s = host.new_stream(vm).unwrap();
    let sent = request_headers();
    assert_eq!(host.send_request_headers(s, sent.clone(), true).unwrap(), FlowState::Complete);
    let r = slots(&host, vm, 16);
    assert_eq!(r[0], 4, "num_headers");
    assert_eq!(r[1], 0);
    assert_eq!(bytes_at(&host, vm, 2, 3), sent.serialize(), "get_header_map_pairs returns the ABI serialization");
    assert_eq!((r[4], bytes_at(&host, vm, 5, 6)), (0, b"/v1".to_vec()));
    assert_eq!(&r[7..10], [0, 0, 0]);
    let upstream = host.stream(s).unwrap().upstream_headers().unwrap().clone();
    assert_eq!(
        upstream.to_pairs(),
        [(":method", "POST"), (":authority", "api"), (":path", "/v2/chat"), ("x-a", "1")]
            .map(|(k, v)| (k.to_string(), v.to_string())),
        "replace removes and re-adds; pseudo-headers stay ahead of the others"
    );
    assert_eq!((r[10], r[11] as usize), (0, ":method".len() + 4 + ":authority".len() + 3 + ":path".len() + 8 + 4));
    assert_eq!(r[12], 1, "missing key: NotFound");
    assert_eq!(r[13], 2, "unknown map type: BadArgument");
    assert_eq!((r[14], r[15]), (0, 0), "trailers not available: empty map, size 0");
}

#[test]
fn set_header_map_pairs_replaces_the_map_and_malformed_maps_count_as_empty() {
    let mut host = Host::new().unwrap();
    let good = HeaderMap::from([("a", "1"), (":path", "/x")]).serialize();
    let truncated = &good[..good.len() - 1];
    let wat = module(
        &[("good", &good), ("bad", truncated)],
        r#"(func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (if (i32.eqz (call $slot (i32.const 0)))
               (then (call $rec (i32.const 1) (call $proxy_set_header_map_pairs (i32.const 0) {good})))
               (else (call $rec (i32.const 2) (call $proxy_set_header_map_pairs (i32.const 0) {bad}))))
             (call $rec (i32.const 0) (i32.const 1))
             (i32.const 0))"#,
    );
    let vm = start(&mut host, &wat, VmConfig::new());
    let first = host.round_trip(vm, &HttpMessage::new(request_headers(), ""), None).unwrap();
    assert_eq!(first.upstream_headers().unwrap().to_pairs(), [(":path".into(), "/x".into()), ("a".into(), "1".into())]);
    assert!(host.abi_violations().is_empty());
    let second = host.round_trip(vm, &HttpMessage::new(request_headers(), ""), None).unwrap();
    assert_eq!(slots(&host, vm, 3)[1..], [0, 0]);
    assert!(second.upstream_headers().unwrap().is_empty(), "Envoy takes a malformed map as empty");
    assert!(host.abi_violations()[0].message.contains("truncated"));
}

// ---- bodies and pausing ----

#[test]
fn request_body_is_buffered_while_paused_and_can_be_rewritten() {
    let mut host = Host::new().unwrap();
    let wat = module(
        &[("new", b"NEW"), ("bang", b"!"), ("x", b"x"), ("xlen", b"x-len"), ("ok", b"ok")],
        r#"(func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (i32.const 1))
           (func (export "proxy_on_request_body") (param $c i32) (param $size i32) (param $eos i32) (result i32)
             (call $ev (local.get $size))
             (if (i32.eqz (local.get $eos)) (then (return (i32.const 1))))
             (call $rec (i32.const 0) (call $proxy_get_buffer_status (i32.const 0) (i32.const 8) (i32.const 12)))
             (call $rec (i32.const 1) (i32.load (i32.const 8)))
             (call $rec (i32.const 2) (call $proxy_get_buffer_bytes (i32.const 0) (i32.const 0) (local.get $size) (i32.const 0) (i32.const 4)))
             (call $rec (i32.const 3) (i32.load (i32.const 0)))
             (call $rec (i32.const 4) (i32.load (i32.const 4)))
             (drop (call $proxy_get_buffer_bytes (i32.const 0) (i32.const 6) (i32.const 1000) (i32.const 0) (i32.const 4)))
             (call $rec (i32.const 5) (i32.load (i32.const 4)))
             (call $rec (i32.const 6) (call $proxy_set_buffer_bytes (i32.const 0) (i32.const 0) (local.get $size) {new}))
             (call $rec (i32.const 7) (call $proxy_set_buffer_bytes (i32.const 0) (i32.const -1) (i32.const 0) {bang}))
             (call $rec (i32.const 8) (call $proxy_set_buffer_bytes (i32.const 0) (i32.const 1) (i32.const 1) {x}))
             (call $rec (i32.const 9) (call $proxy_replace_header_map_value (i32.const 0) {xlen} {ok}))
             (call $rec (i32.const 10) (call $proxy_get_buffer_bytes (i32.const 4) (i32.const 0) (i32.const 1) (i32.const 0) (i32.const 4)))
             (call $rec (i32.const 11) (call $proxy_get_buffer_bytes (i32.const 9) (i32.const 0) (i32.const 1) (i32.const 0) (i32.const 4)))
             (i32.const 0))"#,
    );
    let vm = start(&mut host, &wat, VmConfig::new());
    let s = host.new_stream(vm).unwrap();
    assert_eq!(
        host.send_request_headers(s, request_headers(), false).unwrap(),
        FlowState::HeadersPaused { stop_all: false }
    );
    assert_eq!(host.send_request_body(s, b"hello ", false).unwrap(), FlowState::HeadersPaused { stop_all: false });
    assert_eq!(host.stream(s).unwrap().request().buffered(), 6);
    assert_eq!(host.send_request_body(s, b"world", true).unwrap(), FlowState::Complete);
    assert_eq!(journal(&host, vm), [6, 11], "the body callback sees everything held so far");
    let r = slots(&host, vm, 12);
    assert_eq!((r[0], r[1], r[2]), (0, 11, 0));
    assert_eq!(bytes_at(&host, vm, 3, 4), b"hello world");
    assert_eq!(r[5], 5, "reads are clamped to the buffer");
    assert_eq!(&r[6..10], [0, 0, 2, 0], "replace, append, no middle edit (BadArgument), headers still held");
    assert_eq!((r[10], r[11]), (1, 2), "no callout response: NotFound; unknown buffer: BadArgument");
    let st = host.stream(s).unwrap();
    assert_eq!(st.request().body(), b"NEW!");
    assert_eq!(st.upstream_headers().unwrap().get("x-len"), Some("ok"));
    let actions: Vec<_> = st.callbacks().iter().map(|c| (c.callback, c.size, c.end_of_stream)).collect();
    assert_eq!(
        actions,
        [
            ("proxy_on_request_headers", 4, false),
            ("proxy_on_request_body", 6, false),
            ("proxy_on_request_body", 11, true)
        ]
    );
}

const RESUME_ON_TICK: &str = r#"
  (func (export "proxy_on_configure") (param $c i32) (param $n i32) (result i32)
    (drop (call $proxy_set_tick_period_milliseconds (i32.const 10))) (i32.const 1))
  (func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
    (call $rec (i32.const 50) (local.get $c)) (call $ev (i32.const 1)) (i32.const 1))
  (func (export "proxy_on_request_body") (param $c i32) (param $size i32) (param $eos i32) (result i32)
    (call $ev (i32.add (i32.const 2000) (local.get $size))) (i32.const 0))
  (func (export "proxy_on_tick") (param $root i32)
    (if (i32.and (i32.ne (call $slot (i32.const 50)) (i32.const 0)) (i32.eqz (call $slot (i32.const 51))))
      (then
        (call $rec (i32.const 51) (i32.const 1))
        (call $rec (i32.const 52) (call $proxy_set_effective_context (call $slot (i32.const 50))))
        (call $rec (i32.const 53) (call $proxy_continue_stream (i32.const 0)))
        (call $rec (i32.const 54) (call $proxy_set_effective_context (i32.const 12345)))
        (call $rec (i32.const 55) (call $proxy_continue_stream (i32.const 7))))))
"#;

#[test]
fn pause_without_allow_on_headers_stop_iteration_withholds_the_body_until_continued() {
    let mut host = Host::new().unwrap();
    let vm = start(&mut host, &module(&[], RESUME_ON_TICK), VmConfig::new().allow_on_headers_stop_iteration(false));
    let s = host.new_stream(vm).unwrap();
    assert_eq!(
        host.send_request_headers(s, request_headers(), false).unwrap(),
        FlowState::HeadersPaused { stop_all: true }
    );
    assert_eq!(host.send_request_body(s, b"abc", true).unwrap(), FlowState::HeadersPaused { stop_all: true });
    assert_eq!(journal(&host, vm), [1], "StopAllIteration: the body does not reach the filter");
    assert_eq!(host.stream(s).unwrap().request().buffered(), 3);

    // the tick resumes the stream through the effective context; the body reaches the filter then
    host.advance(Duration::from_millis(10)).unwrap();
    assert_eq!(journal(&host, vm), [1, 2003]);
    assert_eq!(&slots(&host, vm, 56)[52..], [0, 0, 2, 2]);
    let st = host.stream(s).unwrap();
    assert_eq!(st.request().state(), FlowState::Complete);
    assert_eq!(st.request().body(), b"abc");
}

#[test]
fn pause_with_allow_on_headers_stop_iteration_still_delivers_the_body() {
    let mut host = Host::new().unwrap();
    let vm = start(&mut host, &module(&[], RESUME_ON_TICK), VmConfig::new());
    let s = host.new_stream(vm).unwrap();
    assert_eq!(
        host.send_request_headers(s, request_headers(), false).unwrap(),
        FlowState::HeadersPaused { stop_all: false }
    );
    assert_eq!(host.send_request_body(s, b"abcd", true).unwrap(), FlowState::Complete);
    assert_eq!(journal(&host, vm), [1, 2004]);
    // nothing left to continue at the tick: a violation, not a crash
    host.advance(Duration::from_millis(10)).unwrap();
    assert!(host
        .abi_violations()
        .iter()
        .any(|v| v.call == "proxy_continue_stream" && v.message.contains("not paused")));
}

#[test]
fn request_headers_are_read_only_after_they_went_upstream() {
    let mut host = Host::new().unwrap();
    let wat = module(
        &[("late", b"x-late"), ("one", b"1"), ("path", b":path")],
        r#"(func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (i32.const 0))
           (func (export "proxy_on_request_body") (param $c i32) (param $size i32) (param $eos i32) (result i32)
             (call $rec (i32.const 0) (call $proxy_replace_header_map_value (i32.const 0) {late} {one}))
             (call $rec (i32.const 1) (call $proxy_get_header_map_value (i32.const 0) {path} (i32.const 0) (i32.const 4)))
             (call $rec (i32.const 2) (call $proxy_get_header_map_pairs (i32.const 0) (i32.const 0) (i32.const 4)))
             (call $rec (i32.const 3) (i32.load (i32.const 4)))
             (call $rec (i32.const 4) (call $proxy_get_header_map_size (i32.const 0) (i32.const 8)))
             (call $rec (i32.const 5) (call $proxy_add_header_map_value (i32.const 2) {late} {one}))
             (i32.const 0))
           (func (export "proxy_on_log") (param $c i32)
             (call $rec (i32.const 6) (call $proxy_get_header_map_value (i32.const 0) {path} (i32.const 0) (i32.const 4)))
             (call $rec (i32.const 7) (call $proxy_add_header_map_value (i32.const 0) {late} {one})))"#,
    );
    let vm = start(&mut host, &wat, VmConfig::new());
    let s = host.new_stream(vm).unwrap();
    assert_eq!(host.send_request_headers(s, request_headers(), false).unwrap(), FlowState::Streaming);
    host.send_request_body(s, b"{}", true).unwrap();
    assert_eq!(&slots(&host, vm, 6)[..6], [2, 2, 0, 0, 2, 2]);
    assert!(!host.stream(s).unwrap().upstream_headers().unwrap().contains("x-late"));
    let violations = host.take_abi_violations();
    assert!(violations
        .iter()
        .any(|v| v.call == "proxy_replace_header_map_value" && v.message.contains("after they went upstream")));
    host.finish_stream(s).unwrap();
    assert_eq!(&slots(&host, vm, 8)[6..], [0, 2], "readable (not writable) again in proxy_on_log");
}

#[test]
fn response_path_is_filtered_too() {
    let mut host = Host::new().unwrap();
    let wat = module(
        &[("srv", b"x-served-by"), ("me", b"filter"), ("body", b"rewritten")],
        r#"(func (export "proxy_on_response_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (drop (call $proxy_add_header_map_value (i32.const 2) {srv} {me}))
             (i32.const 1))
           (func (export "proxy_on_response_body") (param $c i32) (param $size i32) (param $eos i32) (result i32)
             (if (i32.eqz (local.get $eos)) (then (return (i32.const 1))))
             (call $rec (i32.const 0) (call $proxy_set_buffer_bytes (i32.const 1) (i32.const 0) (local.get $size) {body}))
             (i32.const 0))
           (func (export "proxy_on_response_trailers") (param $c i32) (param $n i32) (result i32)
             (call $rec (i32.const 1) (local.get $n)) (i32.const 0))"#,
    );
    let vm = start(&mut host, &wat, VmConfig::new());
    let s = host.new_stream(vm).unwrap();
    assert!(matches!(host.send_response_headers(s, [(":status", "200")], false), Err(HostError::Protocol { .. })));
    host.send_request_headers(s, request_headers(), true).unwrap();
    assert_eq!(
        host.send_response_headers(s, [(":status", "200")], false).unwrap(),
        FlowState::HeadersPaused { stop_all: false }
    );
    assert_eq!(host.send_response_body(s, b"part1", false).unwrap(), FlowState::HeadersPaused { stop_all: false });
    assert_eq!(host.send_response_body(s, b"part2", true).unwrap(), FlowState::Complete);
    let st = host.finish_stream(s).unwrap();
    assert_eq!(st.downstream_status(), Some(200));
    assert_eq!(st.response().headers().unwrap().get("x-served-by"), Some("filter"));
    assert_eq!(st.response().body(), b"rewritten");

    let s = host.new_stream(vm).unwrap();
    host.send_request_headers(s, request_headers(), true).unwrap();
    host.send_response_headers(s, [(":status", "200")], false).unwrap();
    host.send_response_body(s, b"x", false).unwrap();
    assert_eq!(host.send_response_trailers(s, [("grpc-status", "0")]).unwrap(), FlowState::Complete);
    assert_eq!(slot(&host, vm, 1), 1);
    assert!(matches!(host.send_response_body(s, b"late", true), Err(HostError::Protocol { .. })));
}

// ---- shared data ----

const CAS: &str = r#"
  (func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
    (call $rec (i32.const 0) (call $proxy_get_shared_data {k} (i32.const 0) (i32.const 4) (i32.const 8)))
    (call $rec (i32.const 1) (call $proxy_set_shared_data {k} {v1} (i32.const 0)))
    (call $rec (i32.const 2) (call $proxy_get_shared_data {k} (i32.const 0) (i32.const 4) (i32.const 8)))
    (call $rec (i32.const 3) (i32.load (i32.const 8)))
    (call $rec (i32.const 4) (i32.load (i32.const 4)))
    (call $rec (i32.const 5) (call $proxy_set_shared_data {k} {v2} (call $slot (i32.const 3))))
    (call $rec (i32.const 6) (call $proxy_set_shared_data {k} {v3} (call $slot (i32.const 3))))
    (drop (call $proxy_get_shared_data {k} (i32.const 0) (i32.const 4) (i32.const 8)))
    (call $rec (i32.const 7) (i32.load (i32.const 8)))
    (call $rec (i32.const 8) (call $proxy_set_shared_data {k} {v3} (i32.add (call $slot (i32.const 7)) (i32.const 1000))))
    (call $rec (i32.const 9) (call $proxy_set_shared_data {fresh} {v1} (i32.const 77)))
    (i32.const 0))
  (func (export "proxy_on_response_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
    ;; a CAS retry loop: read, write conditionally, count attempts
    (local $i i32)
    (loop $again
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (drop (call $proxy_get_shared_data {k} (i32.const 0) (i32.const 4) (i32.const 8)))
      (br_if $again (i32.and (i32.lt_u (local.get $i) (i32.const 10))
        (i32.ne (call $proxy_set_shared_data {k} {v1} (i32.load (i32.const 8))) (i32.const 0)))))
    (call $rec (i32.const 10) (local.get $i))
    (i32.const 0))
"#;

fn cas_guest() -> String {
    module(&[("k", b"key"), ("fresh", b"fresh"), ("v1", b"one"), ("v2", b"two"), ("v3", b"three")], CAS)
}

#[test]
fn shared_data_has_compare_and_swap_semantics() {
    let mut host = Host::new().unwrap();
    let a = start(&mut host, &cas_guest(), VmConfig::new().vm_id("kv"));
    let s = host.new_stream(a).unwrap();
    host.send_request_headers(s, request_headers(), true).unwrap();
    let r = slots(&host, a, 10);
    assert_eq!((r[0], r[1], r[2], r[4]), (1, 0, 0, 3), "NotFound, unconditional set, get (value 'one')");
    assert_ne!(r[3], 0, "a cas is never 0");
    assert_eq!((r[5], r[6]), (0, 8), "matching cas writes; the now stale cas mismatches");
    assert_ne!(r[7], r[3], "every write moves the cas");
    assert_eq!(r[8], 8);
    assert_eq!(r[9], 0, "a new key is written whatever the cas");
    assert_eq!(host.shared_data("kv", "key"), Some((b"two".to_vec(), r[7] as u32)));
    assert_eq!(host.shared_data_keys("kv"), ["fresh", "key"]);

    // same vm_id: shared; other vm_id: separate
    let b = start(&mut host, &cas_guest(), VmConfig::new().vm_id("kv"));
    let c = start(&mut host, &cas_guest(), VmConfig::new().vm_id("other"));
    for vm in [b, c] {
        let s = host.new_stream(vm).unwrap();
        host.send_request_headers(s, request_headers(), true).unwrap();
    }
    assert_eq!(slot(&host, b, 0), 0, "vm b sees vm a's key");
    assert_eq!(slot(&host, c, 0), 1, "vm c (other vm_id) does not");

    // a writer between read and write: the retry loop needs 3 attempts for 2 conflicts
    let cas_before = host.shared_data("kv", "key").unwrap().1;
    host.force_cas_mismatch("kv", "key", 2);
    host.send_response_headers(s, [(":status", "200")], true).unwrap();
    assert_eq!(slot(&host, a, 10), 3);
    let (value, cas) = host.shared_data("kv", "key").unwrap();
    assert_eq!(value, b"one");
    assert!(cas > cas_before);
    let set_cas = host.set_shared_data("kv", "key", b"host".to_vec());
    assert_eq!(host.shared_data("kv", "key"), Some((b"host".to_vec(), set_cas)));
}

// ---- shared queues ----

const QUEUE: &str = r#"
  (func (export "proxy_on_configure") (param $c i32) (param $n i32) (result i32)
    (call $rec (i32.const 0) (call $proxy_register_shared_queue {q} (i32.const 20)))
    (call $rec (i32.const 1) (i32.load (i32.const 20)))
    (i32.const 1))
  (func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
    (call $rec (i32.const 2) (call $proxy_resolve_shared_queue {empty} {q} (i32.const 24)))
    (call $rec (i32.const 3) (i32.load (i32.const 24)))
    (call $rec (i32.const 4) (call $proxy_enqueue_shared_queue (i32.load (i32.const 24)) {e1}))
    (call $rec (i32.const 5) (call $proxy_enqueue_shared_queue (call $slot (i32.const 1)) {e2}))
    (call $rec (i32.const 6) (call $proxy_resolve_shared_queue {vmid} {nope} (i32.const 24)))
    (call $rec (i32.const 7) (call $proxy_enqueue_shared_queue (i32.const 999) {e1}))
    (i32.const 0))
  (func (export "proxy_on_queue_ready") (param $root i32) (param $token i32)
    (local $status i32)
    (call $ev (local.get $token))
    (block $done
      (loop $next
        (local.set $status (call $proxy_dequeue_shared_queue (local.get $token) (i32.const 0) (i32.const 4)))
        (br_if $done (i32.ne (local.get $status) (i32.const 0)))
        (call $log_ret)
        (br $next)))
    (call $rec (i32.const 8) (local.get $status))
    (call $rec (i32.const 9) (call $proxy_dequeue_shared_queue (i32.const 4242) (i32.const 0) (i32.const 4))))
"#;

fn queue_guest() -> String {
    module(&[("q", b"events"), ("empty", b""), ("vmid", b"kv"), ("nope", b"nope"), ("e1", b"e1"), ("e2", b"e2")], QUEUE)
}

#[test]
fn shared_queues_wake_the_last_registrant() {
    let mut host = Host::new().unwrap();
    let a = start(&mut host, &queue_guest(), VmConfig::new().vm_id("kv"));
    let b = start(&mut host, &queue_guest(), VmConfig::new().vm_id("kv"));
    let token = slot(&host, a, 1);
    assert_eq!(slot(&host, b, 1), token, "registering an existing name opens the same queue");
    assert_eq!(host.queue_id("kv", "events"), Some(token as u32));

    let s = host.new_stream(a).unwrap();
    host.send_request_headers(s, request_headers(), true).unwrap();
    assert_eq!(&slots(&host, a, 8)[2..], [0, token, 0, 0, 1, 1], "resolve, enqueue twice; unknown queue: NotFound");
    // one wake-up per enqueue, on the consumer (b, the last registrant) only
    assert_eq!(journal(&host, b), [token, token]);
    assert!(journal(&host, a).is_empty());
    assert_eq!(logs(&host, b), ["e1", "e2"]);
    assert_eq!((slot(&host, b, 8), slot(&host, b, 9)), (7, 1), "Empty, then NotFound for an unknown token");

    // a third VM registering takes over; the host can feed the queue too
    let c = start(&mut host, &queue_guest(), VmConfig::new().vm_id("kv"));
    assert!(host.enqueue("kv", "events", b"from-host".to_vec()).unwrap());
    assert_eq!(logs(&host, c), ["from-host"]);
    assert_eq!(journal(&host, b).len(), 2);
    assert_eq!(host.queue_len("kv", "events"), Some(0));
    assert!(!host.enqueue("kv", "missing", b"x".to_vec()).unwrap());
}

// ---- ticks and time ----

#[test]
fn ticks_follow_the_virtual_clock() {
    let mut host = Host::builder().start_time_ns(5_000_000_000).build().unwrap();
    let wat = module(
        &[],
        r#"(func (export "proxy_on_configure") (param $c i32) (param $n i32) (result i32)
             (call $rec (i32.const 0) (call $proxy_set_tick_period_milliseconds (i32.const 100)))
             (i32.const 1))
           (func (export "proxy_on_tick") (param $root i32)
             (local $n i32)
             (local.set $n (call $slot (i32.const 10)))
             (drop (call $proxy_get_current_time_nanoseconds (i32.const 32)))
             (call $rec64 (local.get $n) (i64.load (i32.const 32)))
             (call $rec (i32.const 10) (i32.add (local.get $n) (i32.const 1)))
             (call $ev (local.get $root))
             (if (i32.eq (local.get $n) (i32.const 2))
               (then (drop (call $proxy_set_tick_period_milliseconds (i32.const 0))))))"#,
    );
    let a = start(&mut host, &wat, VmConfig::new());
    host.advance(Duration::from_millis(250)).unwrap();
    assert_eq!(slot(&host, a, 10), 2);
    assert_eq!((slot64(&host, a, 0), slot64(&host, a, 1)), (5_100_000_000, 5_200_000_000));
    let b = start(&mut host, &wat, VmConfig::new());
    host.advance(Duration::from_secs(1)).unwrap();
    assert_eq!(slot(&host, a, 10), 3, "the third tick disabled the timer");
    assert_eq!(slot64(&host, a, 2), 5_300_000_000);
    assert_eq!(slot(&host, b, 10), 3);
    assert_eq!((slot64(&host, b, 0), slot64(&host, b, 2)), (5_350_000_000, 5_550_000_000));
    assert_eq!(host.now_ns(), 6_250_000_000);
    assert_eq!(host.next_event_ns(), None);
}

// ---- HTTP callouts ----

fn callout_guest() -> String {
    let ok = HeaderMap::from([(":method", "GET"), (":path", "/state"), (":authority", "backend")]).serialize();
    let no_path = HeaderMap::from([(":method", "GET"), (":authority", "backend")]).serialize();
    module(
        &[
            ("cluster", b"backend"),
            ("unknown", b"nope"),
            ("ok", &ok),
            ("nopath", &no_path),
            ("ping", b"ping"),
            ("status", b":status"),
            ("route", b"x-route"),
        ],
        r#"(func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (call $rec (i32.const 40) (local.get $c))
             (call $rec (i32.const 0) (call $proxy_http_call {unknown} {ok} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const 24)))
             (call $rec (i32.const 1) (call $proxy_http_call {cluster} {nopath} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 1000) (i32.const 24)))
             (call $rec (i32.const 2) (call $proxy_http_call {cluster} {ok} {ping} (i32.const 0) (i32.const 0) (i32.const 5000) (i32.const 24)))
             (call $rec (i32.const 3) (i32.load (i32.const 24)))
             (i32.const 1))
           (func (export "proxy_on_http_call_response") (param $root i32) (param $token i32) (param $nh i32) (param $nb i32) (param $nt i32)
             (call $rec (i32.const 10) (local.get $root))
             (call $rec (i32.const 11) (local.get $token))
             (call $rec (i32.const 12) (local.get $nh))
             (call $rec (i32.const 13) (local.get $nb))
             (call $rec (i32.const 14) (local.get $nt))
             (call $rec (i32.const 15) (call $proxy_get_header_map_value (i32.const 6) {status} (i32.const 32) (i32.const 36)))
             (call $rec (i32.const 16) (i32.load (i32.const 32)))
             (call $rec (i32.const 17) (i32.load (i32.const 36)))
             (call $rec (i32.const 18) (call $proxy_get_buffer_bytes (i32.const 4) (i32.const 0) (local.get $nb) (i32.const 8) (i32.const 12)))
             (call $rec (i32.const 19) (i32.load (i32.const 8)))
             (call $rec (i32.const 20) (i32.load (i32.const 12)))
             (call $rec (i32.const 21) (call $proxy_get_status (i32.const 28) (i32.const 0) (i32.const 4)))
             (call $rec (i32.const 22) (i32.load (i32.const 28)))
             (call $rec (i32.const 23) (i32.load (i32.const 0)))
             (call $rec (i32.const 24) (i32.load (i32.const 4)))
             (call $rec (i32.const 25) (call $proxy_set_effective_context (call $slot (i32.const 40))))
             (call $rec (i32.const 26) (call $proxy_replace_header_map_value (i32.const 0) {route} (i32.load (i32.const 8)) (i32.load (i32.const 12))))
             (call $rec (i32.const 27) (call $proxy_continue_stream (i32.const 0))))"#,
    )
}

#[test]
fn http_callouts_need_a_cluster_and_pseudo_headers_and_answer_the_root_context() {
    let seen: Rc<RefCell<Vec<CalloutRequest>>> = Rc::default();
    let record = seen.clone();
    let mut host = Host::builder()
        .cluster("backend", move |req| {
            record.borrow_mut().push(req.clone());
            CalloutReply::ok("10.0.0.7:8000").header("x-h", "v").after(Duration::from_millis(5))
        })
        .build()
        .unwrap();
    let vm = start(&mut host, &callout_guest(), VmConfig::new());
    let s = host.new_stream(vm).unwrap();
    assert_eq!(
        host.send_request_headers(s, request_headers(), true).unwrap(),
        FlowState::HeadersPaused { stop_all: false }
    );
    let r = slots(&host, vm, 4);
    assert_eq!(&r[..3], [2, 2, 0], "unknown cluster and missing :path are BadArgument");
    let token = r[3];
    assert_ne!(token, 0);
    {
        let seen = seen.borrow();
        assert_eq!(seen.len(), 1);
        let req = &seen[0];
        assert_eq!(
            (req.cluster.as_str(), req.body.as_slice(), req.timeout_ms, req.token),
            ("backend", &b"ping"[..], 5000, token as u32)
        );
        assert_eq!(req.headers.get(":path"), Some("/state"));
        assert_eq!(req.headers.get("content-length"), Some("4"));
        assert_eq!(req.at_ns, DEFAULT_START_TIME_NS);
    }
    assert_eq!(host.callouts().len(), 1);
    let violations: Vec<String> = host.take_abi_violations().into_iter().map(|v| v.message).collect();
    assert!(violations.iter().any(|m| m.contains("unknown cluster")) && violations.iter().any(|m| m.contains(":path")));

    // the answer arrives after its delay, on the root context, and the filter resumes the stream
    host.advance(Duration::from_millis(4)).unwrap();
    assert_eq!(host.stream(s).unwrap().request().state(), FlowState::HeadersPaused { stop_all: false });
    host.advance(Duration::from_millis(1)).unwrap();
    let r = slots(&host, vm, 28);
    assert_eq!(&r[10..15], [1, token, 2, 13, 0], "root context, token, 2 headers, 13 body bytes, no trailers");
    assert_eq!(r[15], 0);
    assert_eq!(bytes_at(&host, vm, 16, 17), b"200");
    assert_eq!(bytes_at(&host, vm, 19, 20), b"10.0.0.7:8000");
    assert_eq!((r[21], r[22]), (0, 0));
    assert_eq!(&r[25..28], [0, 0, 0]);
    let st = host.stream(s).unwrap();
    assert_eq!(st.request().state(), FlowState::Complete);
    assert_eq!(st.upstream_headers().unwrap().get("x-route"), Some("10.0.0.7:8000"));
    assert!(host.abi_violations().is_empty(), "{:?}", &*host.abi_violations());
}

#[test]
fn failed_and_timed_out_callouts() {
    let mut host = Host::builder().cluster("backend", |_| CalloutReply::reset()).build().unwrap();
    let vm = start(&mut host, &callout_guest(), VmConfig::new());
    let s = host.new_stream(vm).unwrap();
    // an immediate answer runs at the end of the same host operation
    assert_eq!(host.send_request_headers(s, request_headers(), true).unwrap(), FlowState::Complete);
    let r = slots(&host, vm, 25);
    assert_eq!(&r[12..15], [0, 0, 0], "a failed call has no headers");
    assert_eq!(r[15], 2, "no response headers map: BadArgument");
    assert_eq!((r[21], r[22]), (0, 11), "proxy_get_status: BrokenConnection");
    assert_eq!(bytes_at(&host, vm, 23, 24), b"reset");

    let mut host = Host::builder()
        .cluster("backend", |_| CalloutReply::ok("late").after(Duration::from_secs(60)))
        .build()
        .unwrap();
    let vm = start(&mut host, &callout_guest(), VmConfig::new());
    let s = host.new_stream(vm).unwrap();
    host.send_request_headers(s, request_headers(), true).unwrap();
    assert_eq!(
        host.next_event_ns(),
        Some(DEFAULT_START_TIME_NS + 5_000_000_000),
        "the 5 s timeout, not the 60 s delay"
    );
    host.advance(Duration::from_secs(5)).unwrap();
    assert_eq!(bytes_at(&host, vm, 16, 17), b"504");
    assert_eq!(bytes_at(&host, vm, 19, 20), b"upstream request timeout");
}

// ---- local replies ----

#[test]
fn local_reply_ends_the_request_and_goes_through_the_response_callbacks() {
    let mut host = Host::new().unwrap();
    let extra = HeaderMap::from([("retry-after", "1")]).serialize();
    let wat = module(
        &[("body", b"slow down"), ("hdrs", &extra), ("details", b"shed"), ("xf", b"x-filter"), ("one", b"1")],
        r#"(func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (call $rec (i32.const 0) (call $proxy_send_local_response (i32.const 429) {details} {body} {hdrs} (i32.const -1)))
             (i32.const 0))
           (func (export "proxy_on_response_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (call $ev (i32.add (i32.mul (local.get $n) (i32.const 10)) (local.get $e)))
             (call $rec (i32.const 1) (call $proxy_add_header_map_value (i32.const 2) {xf} {one}))
             (i32.const 0))
           (func (export "proxy_on_response_body") (param $c i32) (param $size i32) (param $eos i32) (result i32)
             (call $ev (i32.add (i32.const 1000) (local.get $size))) (i32.const 0))"#,
    );
    let vm = start(&mut host, &wat, VmConfig::new());
    let s = host.new_stream(vm).unwrap();
    assert_eq!(host.send_request_headers(s, request_headers(), false).unwrap(), FlowState::Closed);
    // the rest of the request is ignored, like the upstream that never got it
    assert_eq!(host.send_request_body(s, b"{}", true).unwrap(), FlowState::Closed);
    let st = host.finish_stream(s).unwrap();
    assert_eq!(slots(&host, vm, 2), [0, 0]);
    let reply = st.local_reply().unwrap();
    assert_eq!(
        (reply.status, reply.details.as_str(), reply.body.as_slice(), reply.grpc_status),
        (429, "shed", &b"slow down"[..], -1)
    );
    assert!(st.upstream_headers().is_none(), "nothing went upstream");
    assert_eq!(
        st.response().headers().unwrap().to_pairs(),
        [
            (":status", "429"),
            ("content-length", "9"),
            ("content-type", "text/plain"),
            ("retry-after", "1"),
            ("x-filter", "1")
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
    );
    assert_eq!(st.response().body(), b"slow down");
    assert_eq!(st.response().state(), FlowState::Complete);
    assert_eq!(journal(&host, vm), [40, 1009], "4 response headers without end of stream, then the 9-byte body");
    assert_eq!(
        st.callbacks()[0].action,
        Some(kvroute_wasm_host::Action::Continue),
        "the return value no longer matters"
    );
}

#[test]
fn effective_context_lets_a_tick_reset_or_finish_a_stream() {
    let mut host = Host::new().unwrap();
    let wat = module(
        &[],
        r#"(func (export "proxy_on_configure") (param $c i32) (param $n i32) (result i32)
             (drop (call $proxy_set_tick_period_milliseconds (i32.const 10))) (i32.const 1))
           (func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (call $rec (i32.const 0) (local.get $c)) (i32.const 1))
           (func (export "proxy_on_done") (param $c i32) (result i32)
             (call $rec (i32.const 1) (local.get $c)) (i32.const 0))
           (func (export "proxy_on_log") (param $c i32) (call $ev (i32.add (i32.const 5000) (local.get $c))))
           (func (export "proxy_on_delete") (param $c i32) (call $ev (i32.add (i32.const 6000) (local.get $c))))
           (func (export "proxy_on_tick") (param $root i32)
             (if (call $slot (i32.const 0)) (then
               (drop (call $proxy_set_effective_context (call $slot (i32.const 0))))
               (call $rec (i32.const 2) (call $proxy_close_stream (i32.const 0)))
               (call $rec (i32.const 0) (i32.const 0))))
             (if (call $slot (i32.const 1)) (then
               (drop (call $proxy_set_effective_context (call $slot (i32.const 1))))
               (call $rec (i32.const 3) (call $proxy_done))
               (call $rec (i32.const 4) (call $proxy_done))
               (call $rec (i32.const 1) (i32.const 0)))))"#,
    );
    let vm = start(&mut host, &wat, VmConfig::new());
    let s = host.new_stream(vm).unwrap();
    host.send_request_headers(s, request_headers(), false).unwrap();
    host.advance(Duration::from_millis(10)).unwrap();
    let st = host.stream(s).unwrap();
    assert!(st.was_reset());
    assert_eq!((st.request().state(), st.response().state()), (FlowState::Closed, FlowState::Closed));

    // proxy_on_done returned false: the stream lives until the filter calls proxy_done
    let copy = host.finish_stream(s).unwrap();
    assert!(copy.was_reset());
    assert!(journal(&host, vm).is_empty());
    assert!(host.stream(s).is_ok());
    host.advance(Duration::from_millis(10)).unwrap();
    assert_eq!(journal(&host, vm), [5000 + s.context_id() as i32, 6000 + s.context_id() as i32]);
    assert_eq!(&slots(&host, vm, 5)[2..], [0, 0, 1], "close Ok, done Ok, then NotFound");
    assert!(matches!(host.stream(s), Err(HostError::UnknownStream(_))));
}

// ---- properties, metrics, logs, WASI ----

#[test]
fn properties() {
    let mut host = Host::new().unwrap();
    let wat = module(
        &[
            ("name", b"plugin_name"),
            ("root", b"plugin_root_id"),
            ("vmid", b"plugin_vm_id"),
            ("path", b"request\0path"),
            ("hdr", b"request\0headers\0drop-me"),
            ("unknown", b"nope\0x"),
            ("custom", b"my\0prop"),
            ("val", b"v1"),
            ("src", b"source\0address"),
            ("node", b"node\0id"),
        ],
        r#"(func (export "proxy_on_configure") (param $c i32) (param $n i32) (result i32)
             (call $rec (i32.const 20) (call $proxy_set_property {custom} {val})) (i32.const 1))
           (func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (call $rec (i32.const 0) (call $proxy_get_property {name} (i32.const 0) (i32.const 4))) (call $log_ret)
             (call $rec (i32.const 1) (call $proxy_get_property {root} (i32.const 0) (i32.const 4))) (call $log_ret)
             (call $rec (i32.const 2) (call $proxy_get_property {vmid} (i32.const 0) (i32.const 4))) (call $log_ret)
             (call $rec (i32.const 3) (call $proxy_get_property {path} (i32.const 0) (i32.const 4))) (call $log_ret)
             (call $rec (i32.const 4) (call $proxy_get_property {hdr} (i32.const 0) (i32.const 4))) (call $log_ret)
             (call $rec (i32.const 5) (call $proxy_get_property {unknown} (i32.const 0) (i32.const 4)))
             (call $rec (i32.const 6) (call $proxy_set_property {custom} {val}))
             (call $rec (i32.const 7) (call $proxy_get_property {custom} (i32.const 0) (i32.const 4))) (call $log_ret)
             (call $rec (i32.const 8) (call $proxy_get_property {src} (i32.const 0) (i32.const 4))) (call $log_ret)
             (call $rec (i32.const 9) (call $proxy_get_property {node} (i32.const 0) (i32.const 4))) (call $log_ret)
             (i32.const 0))"#,
    );
    let config =
        VmConfig::new().plugin_name("kvroute").root_id("kvroute_root").vm_id("kv").property("node\0id", b"n1".to_vec());
    let vm = start(&mut host, &wat, config);
    let s = host.new_stream(vm).unwrap();
    host.set_stream_property(s, "source\0address", b"10.1.2.3:5555".to_vec()).unwrap();
    host.send_request_headers(s, request_headers(), true).unwrap();
    assert_eq!(slots(&host, vm, 10), [0, 0, 0, 0, 0, 1, 0, 0, 0, 0]);
    assert_eq!(slot(&host, vm, 20), 1, "no stream in a root context: NotFound");
    assert_eq!(logs(&host, vm), ["kvroute", "kvroute_root", "kv", "/v1", "x", "v1", "10.1.2.3:5555", "n1"]);
}

#[test]
fn metrics_follow_envoys_rules_and_are_shared_by_name() {
    let mut host = Host::new().unwrap();
    let wat = module(
        &[("c", b"requests"), ("g", b"inflight"), ("h", b"latency")],
        r#"(func (export "proxy_on_configure") (param $c i32) (param $n i32) (result i32)
             (call $rec (i32.const 0) (call $proxy_define_metric (i32.const 0) {c} (i32.const 64)))
             (call $rec (i32.const 1) (i32.load (i32.const 64)))
             (call $rec (i32.const 2) (call $proxy_define_metric (i32.const 1) {g} (i32.const 64)))
             (call $rec (i32.const 3) (i32.load (i32.const 64)))
             (call $rec (i32.const 4) (call $proxy_define_metric (i32.const 2) {h} (i32.const 64)))
             (call $rec (i32.const 5) (i32.load (i32.const 64)))
             (call $rec (i32.const 6) (call $proxy_define_metric (i32.const 7) {h} (i32.const 64)))
             (i32.const 1))
           (func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (call $rec (i32.const 7) (call $proxy_increment_metric (call $slot (i32.const 1)) (i64.const 1)))
             (call $rec (i32.const 8) (call $proxy_increment_metric (call $slot (i32.const 3)) (i64.const 5)))
             (call $rec (i32.const 9) (call $proxy_increment_metric (call $slot (i32.const 3)) (i64.const -2)))
             (call $rec (i32.const 10) (call $proxy_increment_metric (call $slot (i32.const 1)) (i64.const -1)))
             (call $rec (i32.const 11) (call $proxy_record_metric (call $slot (i32.const 5)) (i64.const 42)))
             (call $rec (i32.const 12) (call $proxy_get_metric (call $slot (i32.const 3)) (i32.const 64)))
             (call $rec64 (i32.const 0) (i64.load (i32.const 64)))
             (call $rec (i32.const 13) (call $proxy_get_metric (call $slot (i32.const 5)) (i32.const 64)))
             (call $rec (i32.const 14) (call $proxy_increment_metric (i32.const 12345) (i64.const 1)))
             (i32.const 0))"#,
    );
    let a = start(&mut host, &wat, VmConfig::new());
    let b = start(&mut host, &wat, VmConfig::new());
    for vm in [a, b] {
        host.round_trip(vm, &HttpMessage::new(request_headers(), ""), None).unwrap();
    }
    let r = slots(&host, a, 15);
    assert_eq!(&r[..7], [0, 4, 0, 5, 0, 6, 2], "Envoy's ids: type + 4, 8, ...; unknown type BadArgument");
    assert_eq!(
        &r[7..15],
        [0, 0, 0, 2, 0, 0, 2, 1],
        "counters only grow; histograms cannot be read; unknown id NotFound"
    );
    assert_eq!(slot64(&host, a, 0), 3);
    assert_eq!(host.metric("requests"), Some(MetricValue::Counter(2)), "one metric for both VMs");
    assert_eq!(host.metric("inflight"), Some(MetricValue::Gauge(6)));
    assert_eq!(host.metric("latency"), Some(MetricValue::Histogram(vec![42, 42])));
    assert_eq!(host.metric_names(), ["inflight", "latency", "requests"]);
}

#[test]
fn logs_time_and_wasi() {
    let mut host = Host::builder().log_level(LogLevel::Info).build().unwrap();
    let wat = module(
        &[("out", b"to stdout\n"), ("err", b"to stderr"), ("debug", b"hidden")],
        r#"(func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (i32.store (i32.const 64) {out.ptr}) (i32.store (i32.const 68) {out.len})
             (call $rec (i32.const 0) (call $fd_write (i32.const 1) (i32.const 64) (i32.const 1) (i32.const 72)))
             (call $rec (i32.const 1) (i32.load (i32.const 72)))
             (i32.store (i32.const 64) {err.ptr}) (i32.store (i32.const 68) {err.len})
             (drop (call $fd_write (i32.const 2) (i32.const 64) (i32.const 1) (i32.const 72)))
             (call $rec (i32.const 2) (call $fd_write (i32.const 5) (i32.const 64) (i32.const 1) (i32.const 72)))
             (drop (call $proxy_log (i32.const 1) {debug}))
             (call $rec (i32.const 3) (call $clock_time_get (i32.const 0) (i64.const 0) (i32.const 80)))
             (call $rec64 (i32.const 0) (i64.load (i32.const 80)))
             (call $rec (i32.const 4) (call $proxy_get_current_time_nanoseconds (i32.const 88)))
             (call $rec64 (i32.const 1) (i64.load (i32.const 88)))
             (call $rec (i32.const 5) (call $random_get (i32.const 96) (i32.const 16)))
             (call $rec (i32.const 6) (call $proxy_get_log_level (i32.const 112)))
             (call $rec (i32.const 7) (i32.load (i32.const 112)))
             (call $rec (i32.const 8) (call $clock_time_get (i32.const 9) (i64.const 0) (i32.const 80)))
             (i32.const 0))"#,
    );
    let vm = start(&mut host, &wat, VmConfig::new());
    host.advance(Duration::from_millis(1500)).unwrap();
    let s = host.new_stream(vm).unwrap();
    host.send_request_headers(s, request_headers(), true).unwrap();
    assert_eq!(slots(&host, vm, 9), [0, 10, 8, 0, 0, 0, 0, 2, 58]);
    let expected = (DEFAULT_START_TIME_NS + 1_500_000_000) as i64;
    assert_eq!((slot64(&host, vm, 0), slot64(&host, vm, 1)), (expected, expected));
    let entries: Vec<_> = host.logs().iter().map(|l| (l.level, l.message.clone(), l.context_id, l.at_ns)).collect();
    assert_eq!(
        entries,
        [
            (LogLevel::Info, "to stdout".to_string(), s.context_id(), expected as u64),
            (LogLevel::Error, "to stderr".to_string(), s.context_id(), expected as u64)
        ],
        "Debug is below the host's level"
    );
    let random = host.read_memory(vm, 96, 16).unwrap().unwrap();
    assert!(random.iter().any(|b| *b != 0));
}

#[test]
fn memory_size_shows_growth() {
    let mut host = Host::new().unwrap();
    let wat = module(
        &[],
        r#"(func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (drop (memory.grow (i32.const 1))) (i32.const 0))"#,
    );
    let vm = start(&mut host, &wat, VmConfig::new());
    let before = host.memory_size(vm).unwrap();
    assert_eq!(before, 2 * 65536);
    host.round_trip(vm, &HttpMessage::new(request_headers(), ""), None).unwrap();
    assert_eq!(host.memory_size(vm).unwrap(), before + 65536);
}

// ---- an untrusted guest ----

#[test]
fn out_of_bounds_pointers_are_answered_not_crashed_on() {
    let mut host = Host::builder().cluster("backend", |_| CalloutReply::ok("")).build().unwrap();
    let ok = HeaderMap::from([(":method", "GET"), (":path", "/"), (":authority", "b")]).serialize();
    let wat = module(
        &[("path", b":path"), ("cluster", b"backend"), ("ok", &ok)],
        r#"(func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (call $rec (i32.const 0) (call $proxy_log (i32.const 2) (i32.const -256) (i32.const 4096)))
             (call $rec (i32.const 1) (call $proxy_get_header_map_value (i32.const 0) {path} (i32.const 0x7ffffff0) (i32.const 4)))
             (call $rec (i32.const 2) (call $proxy_set_shared_data (i32.const -1) (i32.const 2) (i32.const 0) (i32.const 0) (i32.const 0)))
             (call $rec (i32.const 3) (call $proxy_get_header_map_pairs (i32.const 0) (i32.const -3) (i32.const 4)))
             (call $rec (i32.const 4) (call $proxy_log (i32.const 9) (i32.const 0) (i32.const 0)))
             (call $rec (i32.const 5) (call $fd_write (i32.const 1) (i32.const -8) (i32.const 1) (i32.const 0)))
             (call $rec (i32.const 6) (call $proxy_get_current_time_nanoseconds (i32.const 131068)))
             (call $rec (i32.const 7) (call $proxy_http_call {cluster} {ok} (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 100) (i32.const -1)))
             (call $rec (i32.const 8) (call $proxy_set_header_map_pairs (i32.const 0) (i32.const 131000) (i32.const 100000)))
             (global.set $bad_alloc (i32.const 1))
             (call $rec (i32.const 9) (call $proxy_get_header_map_pairs (i32.const 0) (i32.const 0) (i32.const 4)))
             (global.set $bad_alloc (i32.const 0))
             (call $rec (i32.const 10) (call $proxy_grpc_call (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0)))
             (i32.const 0))"#,
    );
    let vm = start(&mut host, &wat, VmConfig::new());
    let st = host.round_trip(vm, &HttpMessage::new(request_headers(), ""), None).unwrap();
    assert_eq!(slots(&host, vm, 11), [6, 6, 6, 6, 2, 21, 6, 6, 6, 6, 12]);
    assert_eq!(st.request().state(), FlowState::Complete, "the request still went through");
    assert_eq!(host.callouts().len(), 0, "no callout with an unwritable token pointer");
    assert!(host.abi_violations().len() >= 8);
    assert!(host.failure(vm).unwrap().is_none());
}

#[test]
fn a_trap_fails_the_vm_and_its_streams_like_envoy() {
    let wat = module(
        &[("boom", b"panicked at filter.rs:1: boom")],
        r#"(func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (drop (call $proxy_log (i32.const 5) {boom}))
             unreachable)"#,
    );
    for fail_open in [false, true] {
        let mut host = Host::new().unwrap();
        let vm = start(&mut host, &wat, VmConfig::new().fail_open(fail_open));
        let healthy = start(&mut host, &module(&[], ""), VmConfig::new());
        let s = host.new_stream(vm).unwrap();
        match host.send_request_headers(s, request_headers(), true) {
            Err(HostError::Trap { function, message, .. }) => {
                assert_eq!(function, "proxy_on_request_headers");
                assert!(message.contains("unreachable") && message.contains("boom"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        assert!(host.failure(vm).unwrap().is_some());
        let later = host.round_trip(vm, &HttpMessage::new(request_headers(), "body"), None).unwrap();
        assert!(later.failed_by_host());
        if fail_open {
            assert_eq!(later.upstream_headers(), Some(&request_headers()));
            assert_eq!(later.request().body(), b"body");
        } else {
            assert_eq!(later.local_reply().map(|r| (r.status, r.details.as_str())), Some((503, "wasm_fail_stream")));
            assert_eq!(later.downstream_status(), Some(503));
            assert!(later.upstream_headers().is_none());
        }
        assert!(matches!(host.reconfigure(vm, b"{}".to_vec()), Err(HostError::VmFailed(_))));
        let fine = host.round_trip(healthy, &HttpMessage::new(request_headers(), ""), None).unwrap();
        assert_eq!(fine.request().state(), FlowState::Complete, "other VMs are unaffected");
    }
}

#[test]
fn fuel_stops_a_runaway_guest() {
    let mut host = Host::builder().fuel_per_call(1_000_000).build().unwrap();
    let wat = module(
        &[],
        r#"(func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (loop $forever (br $forever)) (i32.const 0))"#,
    );
    let vm = start(&mut host, &wat, VmConfig::new());
    let s = host.new_stream(vm).unwrap();
    match host.send_request_headers(s, request_headers(), true) {
        Err(HostError::Trap { message, .. }) => assert!(message.contains("fuel"), "{message}"),
        other => panic!("{other:?}"),
    }
}

// ---- fault injection ----

#[test]
fn injected_faults_answer_their_status_on_the_selected_calls_and_do_nothing() {
    let mut host = Host::new().unwrap();
    let wat = module(
        &[("xa", b"x-a"), ("one", b"1")],
        r#"(func (export "proxy_on_request_headers") (param $c i32) (param $n i32) (param $e i32) (result i32)
             (call $rec (i32.const 0) (call $proxy_get_current_time_nanoseconds (i32.const 0)))
             (call $rec (i32.const 1) (call $proxy_get_current_time_nanoseconds (i32.const 0)))
             (call $rec (i32.const 2) (call $proxy_get_current_time_nanoseconds (i32.const 0)))
             (call $rec (i32.const 3) (call $proxy_add_header_map_value (i32.const 0) {xa} {one}))
             (call $rec (i32.const 4) (call $proxy_log (i32.const 2) {one}))
             (i32.const 0))"#,
    );
    let vm = start(&mut host, &wat, VmConfig::new());
    assert!(matches!(
        host.inject_fault("proxy_nope", Fault::status(Status::NotFound)),
        Err(HostError::UnknownImport(n)) if n == "proxy_nope"
    ));
    host.inject_fault("proxy_get_current_time_nanoseconds", Fault::status(Status::InternalFailure).nth(2)).unwrap();
    host.inject_fault("proxy_add_header_map_value", Fault::status(Status::BadArgument)).unwrap();
    host.inject_fault("proxy_log", Fault::code_of(99)).unwrap();
    let s = host.new_stream(vm).unwrap();
    host.send_request_headers(s, request_headers(), true).unwrap();
    assert_eq!(slots(&host, vm, 5), [0, 10, 0, 2, 99]);
    assert_eq!(host.stream(s).unwrap().upstream_headers().unwrap().get("x-a"), None, "a faulted call does nothing");
    assert!(host.logs().is_empty(), "a faulted proxy_log logs nothing");
    assert_eq!(host.hostcall_count("proxy_get_current_time_nanoseconds"), 3);
    assert_eq!(host.faults_fired("proxy_get_current_time_nanoseconds"), 1);
    // Removed, the calls work again.
    host.clear_faults();
    let s = host.new_stream(vm).unwrap();
    host.send_request_headers(s, request_headers(), true).unwrap();
    assert_eq!(slots(&host, vm, 5), [0, 0, 0, 0, 0]);
    assert_eq!(host.stream(s).unwrap().upstream_headers().unwrap().get("x-a"), Some("1"));
    assert_eq!(host.faults_fired("proxy_add_header_map_value"), 1);
    assert!(host.abi_violations().is_empty());
    for name in PROXY_IMPORTS {
        host.inject_fault(name, Fault::status(Status::NotFound)).unwrap();
    }
}
