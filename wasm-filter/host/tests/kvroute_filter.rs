//! Smoke test of the real filter in the host: it loads, starts in two VMs sharing state, routes a
//! request in each, and refuses a bad configuration while the old one keeps serving. The filter's
//! behaviour tests (golden replay, multi-VM consistency, events, load) live with the filter.

use std::time::Duration;

use kvroute_wasm_host::{FlowState, Host, HttpMessage, VmConfig};

const CONFIG: &str = r#"{"filter": {"endpoints": [
    {"address": "10.0.0.7:8000", "role": "decode"},
    {"address": "10.0.0.8:8000", "role": "decode"}
]}}"#;

#[test]
fn kvroute_filter_loads_and_routes_in_two_vms() {
    let mut host = Host::new().unwrap();
    let filter = host.load_kvroute_filter().unwrap_or_else(|e| panic!("{e}"));
    let config = VmConfig::new()
        .vm_id("kvroute")
        .root_id("kvroute")
        .plugin_name("kvroute")
        .plugin_configuration(CONFIG.as_bytes().to_vec());
    let vms = [host.start_vm(&filter, config.clone()).unwrap(), host.start_vm(&filter, config).unwrap()];
    host.advance(Duration::from_millis(500)).unwrap();

    for vm in vms {
        let request =
            HttpMessage::post_json("api.local", "/v1/completions", r#"{"model":"m","prompt":"hello kvroute"}"#);
        let s = host.new_stream(vm).unwrap();
        let paused = host.send_request_headers(s, request.headers.clone(), false).unwrap();
        assert_eq!(paused, FlowState::HeadersPaused { stop_all: false }, "the filter holds the headers for the body");
        assert_eq!(host.send_request_body(s, &request.body, true).unwrap(), FlowState::Complete);
        let upstream = host.stream(s).unwrap().upstream_headers().unwrap().clone();
        let destination = upstream.get("x-gateway-destination-endpoint");
        assert!(matches!(destination, Some("10.0.0.7:8000" | "10.0.0.8:8000")), "{upstream:?}");
        host.send_response_headers(s, [(":status", "200")], false).unwrap();
        host.send_response_body(s, b"{}", true).unwrap();
        let done = host.finish_stream(s).unwrap();
        assert_eq!(done.downstream_status(), Some(200));
        assert_eq!(done.request().body(), request.body.as_slice(), "the body goes upstream untouched");
    }

    // a configuration the filter refuses leaves the old one serving
    assert!(!host.reconfigure(vms[0], b"{ not json".to_vec()).unwrap());
    let request = HttpMessage::post_json("api.local", "/v1/completions", r#"{"model":"m","prompt":"again"}"#);
    let done = host.round_trip(vms[0], &request, None).unwrap();
    assert!(done.upstream_headers().unwrap().contains("x-gateway-destination-endpoint"));

    assert!(host.abi_violations().is_empty(), "{:#?}", &*host.abi_violations());
    assert!(host.failure(vms[0]).unwrap().is_none() && host.failure(vms[1]).unwrap().is_none());
}
