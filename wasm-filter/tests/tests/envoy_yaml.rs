//! `wasm-filter/envoy.yaml` is what the operator guide tells people to run: check the parts
//! body-based routing depends on (the wasm filter with `allow_on_headers_stop_iteration`, the
//! clusters whose override-host policy follows `x-gateway-destination-endpoint`, the route), the
//! parts that keep a client from choosing the upstream when the VM is missing or trapped (a native
//! filter before the wasm filter removes every routing header, the clusters reach only the fleet,
//! never loopback or the admin listener, event headers never go upstream), and run its plugin
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

/// The `ip:port` of every endpoint of a static cluster.
fn cluster_addresses(c: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for locality in c["load_assignment"]["endpoints"].as_array().unwrap() {
        for e in locality["lb_endpoints"].as_array().unwrap() {
            let a = &e["endpoint"]["address"]["socket_address"];
            out.push(format!("{}:{}", a["address"].as_str().unwrap(), a["port_value"].as_u64().unwrap()));
        }
    }
    out
}

/// A cluster the filter's header steers: a fixed host list (no ORIGINAL_DST: that connects to
/// whatever address the header names) with the override-host policy on the destination header.
fn assert_fleet_cluster(c: &Value) {
    assert_eq!(c["type"], "STATIC", "only listed hosts are reachable: {c}");
    assert!(c.get("original_dst_lb_config").is_none(), "{c}");
    let policies = c["load_balancing_policy"]["policies"].as_array().unwrap();
    let ext = &policies[0]["typed_extension_config"];
    assert_eq!(ext["name"], "envoy.load_balancing_policies.override_host");
    let cfg = &ext["typed_config"];
    assert_eq!(
        cfg["@type"],
        "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
    );
    assert_eq!(cfg["override_host_sources"][0]["header"], DESTINATION);
    assert!(cfg["fallback_policy"]["policies"].as_array().is_some_and(|p| !p.is_empty()), "{c}");
}

fn is_loopback(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h == "localhost" || h.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified())
}

#[test]
fn a_missing_or_trapped_vm_never_lets_a_client_choose_the_upstream() {
    let doc = envoy_yaml();
    let hcm = &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let filters = hcm["http_filters"].as_array().unwrap();
    let wasm_at = filters.iter().position(|f| f["name"] == "envoy.filters.http.wasm").unwrap();
    // A native filter before the wasm filter removes every header the filter sets.
    let strip_at = filters
        .iter()
        .position(|f| f["name"] == "envoy.filters.http.header_mutation")
        .expect("a header_mutation filter removes the routing headers");
    assert!(strip_at < wasm_at, "the routing headers are removed before the wasm filter runs");
    let strip = &filters[strip_at]["typed_config"];
    assert_eq!(strip["@type"], "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation");
    let removed: Vec<&str> = strip["mutations"]["request_mutations"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["remove"].as_str())
        .collect();
    for h in kvroute_filter::config::ROUTING_HEADERS {
        assert!(removed.contains(&h), "{h} is not removed before the wasm filter");
    }
    // The event protocol's headers must reach the filter: not removed there.
    assert!(!removed.contains(&kvroute_filter::ingest::HEADER_SECRET));

    // Every cluster reaches only the fleet: listed hosts, none on loopback or the admin port.
    let admin = &doc["admin"]["address"]["socket_address"];
    assert!(is_loopback(admin["address"].as_str().unwrap()), "the admin listener binds loopback only: {admin}");
    let admin_port = admin["port_value"].as_u64().unwrap();
    let wasm = &filters[wasm_at];
    let plugin = wasm["typed_config"]["config"]["configuration"]["value"].as_str().unwrap();
    let parsed = kvroute_filter::config::PluginConfig::parse(plugin.as_bytes()).unwrap();
    let mut fleet: Vec<String> = parsed.filter.endpoints.iter().map(|e| e.address.clone()).collect();
    fleet.sort();
    for c in doc["static_resources"]["clusters"].as_array().unwrap() {
        assert_ne!(c["type"], "ORIGINAL_DST", "an ORIGINAL_DST cluster connects wherever a header says: {c}");
        for a in cluster_addresses(c) {
            let (host, port) = a.rsplit_once(':').unwrap();
            assert!(!is_loopback(host), "{a} in cluster {}", c["name"]);
            assert_ne!(port.parse::<u64>().unwrap(), admin_port, "{a} in cluster {}", c["name"]);
        }
    }
    let route_cluster = forwarding_cluster(hcm);
    for name in [route_cluster, parsed.filter.metrics.as_ref().unwrap().cluster.as_str()] {
        let c = cluster(&doc, name);
        assert_fleet_cluster(c);
        let mut hosts = cluster_addresses(c);
        hosts.sort();
        assert_eq!(hosts, fleet, "cluster {name} lists exactly the plugin configuration's endpoints");
    }

    // With the VM gone, requests pass through: the event headers (the secret) never go
    // upstream, and the filter's own paths are answered by Envoy, not forwarded to an engine.
    let routes = hcm["route_config"]["virtual_hosts"][0]["routes"].as_array().unwrap();
    for r in routes.iter().filter(|r| r.get("route").is_some()) {
        let dropped: Vec<&str> =
            r["request_headers_to_remove"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
        for h in [
            kvroute_filter::ingest::HEADER_SECRET,
            kvroute_filter::ingest::HEADER_SIGNATURE,
            kvroute_filter::ingest::HEADER_TIMESTAMP,
        ] {
            assert!(dropped.contains(&h), "route {r} forwards {h}");
        }
    }
    let guard = routes.first().unwrap();
    assert_eq!(guard["match"]["prefix"], "/kvroute/", "{guard}");
    assert_eq!(guard["match"]["case_sensitive"], false, "{guard}");
    assert!(guard["direct_response"]["status"].as_u64().is_some(), "{guard}");
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
    let route_cluster = forwarding_cluster(hcm);
    assert_fleet_cluster(cluster(&doc, route_cluster));

    let plugin = cfg["configuration"]["value"].as_str().unwrap();
    let parsed = kvroute_filter::config::PluginConfig::parse(plugin.as_bytes()).unwrap();
    let metrics = parsed.filter.metrics.as_ref().unwrap();
    assert_fleet_cluster(cluster(&doc, &metrics.cluster));
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

/// The cluster the first forwarding route sends to.
fn forwarding_cluster(hcm: &Value) -> &str {
    hcm["route_config"]["virtual_hosts"][0]["routes"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|r| r["route"]["cluster"].as_str())
        .unwrap()
}
