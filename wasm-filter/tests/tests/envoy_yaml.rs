//! `wasm-filter/envoy.yaml` is what the operator guide tells people to run: check the parts
//! body-based routing depends on (the wasm filter with `allow_on_headers_stop_iteration`, the
//! ORIGINAL_DST clusters keyed by `x-gateway-destination-endpoint`, the route), and run its plugin
//! configuration in the host with its `vm_id` / `root_id`, metric polls going through the cluster
//! it names.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kvroute_wasm_tests::*;
use serde_json::Value;

fn envoy_yaml() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../envoy.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::from_str(&text).unwrap()
}

fn cluster<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc["static_resources"]["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no cluster {name}"))
}

fn assert_original_dst(c: &Value) {
    assert_eq!(c["type"], "ORIGINAL_DST", "{c}");
    assert_eq!(c["lb_policy"], "CLUSTER_PROVIDED");
    assert_eq!(c["original_dst_lb_config"]["use_http_header"], true);
    assert_eq!(c["original_dst_lb_config"]["http_header_name"], DESTINATION);
}

#[test]
fn the_example_envoy_configuration_is_complete_and_its_plugin_configuration_runs() {
    let doc = envoy_yaml();
    let hcm = &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let filters = hcm["http_filters"].as_array().unwrap();
    assert_eq!(filters.last().unwrap()["name"], "envoy.filters.http.router", "the router comes last");
    let wasm = filters.iter().find(|f| f["name"] == "envoy.filters.http.wasm").unwrap();
    let cfg = &wasm["typed_config"]["config"];
    assert_eq!(cfg["allow_on_headers_stop_iteration"], true, "Envoy >= 1.35 needs it for body-based routing");
    let route_cluster = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"].as_str().unwrap();
    assert_original_dst(cluster(&doc, route_cluster));

    let plugin = cfg["configuration"]["value"].as_str().unwrap();
    let parsed = kvroute_filter::config::PluginConfig::parse(plugin.as_bytes()).unwrap();
    let metrics = parsed.filter.metrics.as_ref().unwrap();
    assert_original_dst(cluster(&doc, &metrics.cluster));
    let endpoints: Vec<String> = parsed.filter.endpoints.iter().map(|e| e.address.clone()).collect();

    // Run it: the metrics cluster serves a page for every engine.
    let page = prometheus(&serde_json::json!({"waiting": 0, "running": 1, "kv_usage": 0.2}));
    let metrics_cluster = metrics.cluster.clone();
    let mut host = Host::builder().cluster(&metrics_cluster, move |_| CalloutReply::ok(page.clone())).build().unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let vm_config = VmConfig::new()
        .vm_id(cfg["vm_config"]["vm_id"].as_str().unwrap())
        .root_id(cfg["root_id"].as_str().unwrap())
        .plugin_name(cfg["name"].as_str().unwrap())
        .plugin_configuration(plugin.as_bytes().to_vec());
    let vms = [host.start_vm(&filter, vm_config.clone()).unwrap(), host.start_vm(&filter, vm_config).unwrap()];
    host.advance(Duration::from_millis(600)).unwrap();
    assert!(!host.callouts().is_empty());
    assert!(host.callouts().iter().all(|c| c.cluster == metrics_cluster));
    for vm in vms {
        let (s, o) = route(&mut host, vm, br#"{"model": "m", "prompt": "hello envoy"}"#, &[]).unwrap();
        let dest = o.destination().unwrap();
        assert!(endpoints.iter().any(|e| e == dest), "{dest}");
        assert_eq!(o.header("x-kvroute-fallback"), None);
        host.finish_stream(s).unwrap();
    }
    assert!(host.abi_violations().is_empty(), "{:#?}", &*host.abi_violations());
}
