//! End to end: an engine's KV events published over ZMQ (loopback, vLLM framing) → the relay
//! (`kvroute-relay`) → HTTP POSTs to a loopback listener standing in for Envoy, which hands each
//! request to the filter in the wasmtime host and writes back the filter's local answer → the
//! filter's precise index, seen by both of its VMs. With a wrong secret on the relay, the filter
//! answers 401 and nothing is applied. Every wait is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use kvroute::SubscriberConfig;
use kvroute_relay::{EngineConfig, Relay, RelayConfig};
use kvroute_wasm_tests::*;
use serde_json::json;

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";
const WAIT: Duration = Duration::from_secs(10);

/// Serve requests from the listener through `vm` until `done` says so (or time runs out);
/// returns the statuses the filter answered.
fn serve(host: &mut Host, vm: VmId, rx: &Receiver<Incoming>, mut done: impl FnMut(&[u32]) -> bool) -> Vec<u32> {
    let t = Instant::now();
    let mut statuses = Vec::new();
    while !done(&statuses) && t.elapsed() < WAIT {
        let Ok(inc) = rx.recv_timeout(Duration::from_millis(50)) else { continue };
        let status = answer_incoming(host, vm, inc).unwrap();
        assert_ne!(status, 0, "event posts are answered by the filter");
        statuses.push(status);
    }
    statuses
}

fn relay_config(url: &str, publisher: &str) -> RelayConfig {
    RelayConfig {
        targets: vec![url.to_owned()],
        path: EVENTS_PATH.into(),
        secret_env: None,
        secret_file: None,
        timeout_ms: 2000,
        attempts: 1,
        queue_batches: 100,
        engines: vec![EngineConfig { endpoint: B.into(), subscriber: SubscriberConfig::new(publisher) }],
        replica: None,
    }
}

struct Publisher(zmq::Socket, String);

impl Publisher {
    fn new(ctx: &zmq::Context) -> Publisher {
        let sock = ctx.socket(zmq::XPUB).unwrap();
        sock.set_linger(0).unwrap();
        sock.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = sock.get_last_endpoint().unwrap().unwrap();
        Publisher(sock, endpoint)
    }
    fn wait_subscriber(&self) {
        assert!(self.0.poll(zmq::POLLIN, WAIT.as_millis() as i64).unwrap() > 0, "no subscriber");
        let _ = self.0.recv_bytes(0).unwrap();
    }
    fn send(&self, seq: u64, payload: &[u8]) {
        self.0.send_multipart([&b"kv-events"[..], &seq.to_be_bytes()[..], payload], 0).unwrap();
    }
}

fn b_blocks(host: &mut Host, vm: VmId, body: &str) -> u64 {
    let (s, o) = route(host, vm, body.as_bytes(), &[]).unwrap();
    host.finish_stream(s).unwrap();
    score(&o.decision.unwrap(), B)["matched_blocks"].as_u64().unwrap()
}

#[test]
fn engine_events_reach_the_filter_through_the_relay() {
    let case = golden_case("41_precise_event_fed_hit");
    let steps = case["steps"].as_array().unwrap();
    let batch = hex(steps[2]["payload_hex"].as_str().unwrap());
    let body = steps[3]["body"].to_string();

    // The relay signs with its wall clock: the host's clock starts there too, and the window is
    // wide (the host's clock stands still while the test runs, however long that takes).
    let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let mut host = host_at(wall, &Pages::default()).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let events = json!({"events": {"path": EVENTS_PATH, "secret": SECRET, "signature_window_ms": 3_600_000}});
    let cfg = plugin_config(&case["policy"], &[(A, "decode"), (B, "decode")], &events);
    let vms = [host.start_vm(&filter, vm_config(&cfg)).unwrap(), host.start_vm(&filter, vm_config(&cfg)).unwrap()];

    let ctx = zmq::Context::new();
    let (url, rx) = loopback_listener().unwrap();

    // A relay with the wrong secret: refused, nothing applied.
    let publisher = Publisher::new(&ctx);
    let relay = Relay::start(&relay_config(&url, &publisher.1), "not-the-secret-0123456789").unwrap();
    publisher.wait_subscriber();
    publisher.send(0, &batch);
    let statuses = serve(&mut host, vms[0], &rx, |s| !s.is_empty());
    assert_eq!(statuses, [401]);
    let stats = relay.stop();
    assert_eq!((stats.posted, stats.post_failures), (0, 1));
    assert_eq!(b_blocks(&mut host, vms[0], &body), 0);
    assert_eq!(b_blocks(&mut host, vms[1], &body), 0);

    // The right secret: the batch is applied, on both VMs.
    let publisher = Publisher::new(&ctx);
    let relay = Relay::start(&relay_config(&url, &publisher.1), SECRET).unwrap();
    publisher.wait_subscriber();
    publisher.send(0, &batch);
    let statuses = serve(&mut host, vms[0], &rx, |s| !s.is_empty());
    assert_eq!(statuses, [200]);
    let stats = relay.stop();
    assert_eq!((stats.posted, stats.post_failures), (1, 0));
    assert_eq!(b_blocks(&mut host, vms[1], &body), 64);
    assert_eq!(b_blocks(&mut host, vms[0], &body), 64);
    let page = stats_page(&mut host, vms[1]);
    assert_eq!(stat(&page, "kvroute_event_batches_total"), Some(1.0), "{page}");
    assert!(host.abi_violations().is_empty());
}

fn stats_page(host: &mut Host, vm: VmId) -> String {
    stats(host, vm).unwrap()
}
