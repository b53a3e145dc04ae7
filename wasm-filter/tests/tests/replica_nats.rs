//! End to end across two Envoys: a real `nats-server` on loopback (JetStream, token
//! authentication, storage in a temporary directory, stopped at the end), two "Envoys" (two test
//! hosts, two worker VMs each, behind loopback listeners standing in for Envoy's), each with its
//! relay (`kvroute-relay`'s replica side: the filter's export → NATS, NATS → the filter's
//! ingestion route). A request routed in Envoy 1 is in flight in Envoy 2; its completion
//! propagates; Envoy 2 then routes the same prompt to the same endpoint with a prefix hit; and
//! back the other way. Every wait is bounded; nothing is timed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use kvroute_relay::{Relay, RelayConfig};
use kvroute_wasm_tests::*;
use serde_json::{json, Value};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";
const C: &str = "10.0.0.3:8000";
const FLEET: &str = "e2e";
const TOKEN: &str = "nats-token-0123456789";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `nats-server -js` on loopback with token authentication and its storage in a temporary
/// directory; killed (and the directory removed) on drop.
struct Nats {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Nats {
    fn start() -> Nats {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("kvroute-wasm-nats-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bin = std::env::var("KVROUTE_NATS_SERVER").unwrap_or_else(|_| "nats-server".into());
        let child = Command::new(&bin)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "--auth", TOKEN, "-sd"])
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin} ({e}): apt-get install nats-server"));
        let nats = Nats { child, port, dir };
        let t = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(t.elapsed() < Duration::from_secs(20), "nats-server did not listen within 20 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        nats
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One Envoy: a host with two VMs behind a loopback listener, and its relay.
struct Envoy {
    host: Host,
    vms: [VmId; 2],
    rx: Receiver<Incoming>,
    relay: Option<Relay>,
}

fn prompt(tag: &str) -> Vec<u8> {
    let words: String = (0..400).map(|i| format!("{tag}{i} ")).collect();
    json!({"model": "m", "prompt": words, "max_tokens": 600}).to_string().into_bytes()
}

fn envoy(replica_id: &str, nats: &Nats) -> Envoy {
    // The relay signs with its wall clock: the host's clock starts there, and the window is wide
    // (the host's clock stands still while the test runs).
    let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let mut host = host_at(wall, &Pages::default()).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let extra = replica_extra(FLEET, replica_id, &json!({"signature_window_ms": 3_600_000}));
    let cfg = plugin_config(&json!({}), &[(A, "decode"), (B, "decode"), (C, "decode")], &extra);
    let vms = [host.start_vm(&filter, vm_config(&cfg)).unwrap(), host.start_vm(&filter, vm_config(&cfg)).unwrap()];
    let (url, rx) = loopback_listener().unwrap();
    let relay_cfg = json!({
        "replica": {
            "target": url,
            "poll_interval_ms": 5,
            "nats": {
                "url": format!("nats://127.0.0.1:{}", nats.port),
                "fleet": FLEET,
                "replica_id": replica_id,
                "token": TOKEN,
                "stream": {"file_storage": false},
                "flush_interval_ms": 2,
            }
        }
    });
    let relay_cfg = RelayConfig::from_json(&relay_cfg.to_string()).unwrap();
    let relay = Relay::start_with(&relay_cfg, "", Some(REPLICA_SECRET)).unwrap();
    Envoy { host, vms, rx, relay: Some(relay) }
}

/// Serve both Envoys' listeners (relay traffic through VM 0) until `cond` holds, at most 30 s.
fn pump(envoys: &mut [Envoy], what: &str, mut cond: impl FnMut(&mut [Envoy]) -> bool) {
    let t = Instant::now();
    loop {
        for e in envoys.iter_mut() {
            while let Ok(inc) = e.rx.try_recv() {
                answer_incoming(&mut e.host, e.vms[0], inc).unwrap();
            }
        }
        if cond(envoys) {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "not within 30 s: {what}");
        if let Ok(inc) = envoys[0].rx.recv_timeout(Duration::from_millis(2)) {
            let vm = envoys[0].vms[0];
            answer_incoming(&mut envoys[0].host, vm, inc).unwrap();
        }
    }
}

/// The in-flight total as VM 1 (which takes no relay traffic) of an Envoy sees it.
fn inflight(e: &mut Envoy) -> f64 {
    let vm = e.vms[1];
    inflight_total(&stats(&mut e.host, vm).unwrap())
}

fn page(e: &mut Envoy) -> String {
    let vm = e.vms[1];
    stats(&mut e.host, vm).unwrap()
}

#[test]
fn two_envoys_share_routing_state_over_nats() {
    let nats = Nats::start();
    let mut envoys = [envoy("envoy-1", &nats), envoy("envoy-2", &nats)];

    // Envoy 1 routes a request (on its VM 1): Envoy 2 counts it in flight.
    let vm = envoys[0].vms[1];
    let (s1, o1) = route(&mut envoys[0].host, vm, &prompt("shared"), &[]).unwrap();
    let target = o1.destination().unwrap().to_owned();
    pump(&mut envoys, "Envoy 2 sees Envoy 1's request in flight", |e| inflight(&mut e[1]) == 1.0);
    let p = page(&mut envoys[1]);
    assert_eq!(stat(&p, &format!("kvroute_inflight_requests{{endpoint=\"{target}\"}}")), Some(1.0), "{p}");
    assert_eq!(stat(&p, "kvroute_wasm_replica_peers"), Some(1.0), "{p}");

    // Its completion propagates.
    envoys[0].host.finish_stream(s1).unwrap();
    pump(&mut envoys, "the completion reaches Envoy 2", |e| {
        stat(&page(&mut e[1]), "kvroute_wasm_replica_completions_applied_total") == Some(1.0)
    });
    assert_eq!(inflight(&mut envoys[1]), 0.0);

    // Envoy 2 routes the same prompt where Envoy 1 sent it, with a prefix hit.
    let vm = envoys[1].vms[0];
    let (s2, o2) = route(&mut envoys[1].host, vm, &prompt("shared"), &[]).unwrap();
    let d: Value = o2.decision.clone().unwrap();
    assert_eq!(o2.destination(), Some(target.as_str()), "{d}");
    assert!(score(&d, &target)["matched_blocks"].as_u64().unwrap() > 0, "{d}");

    // And back: Envoy 2's request is in flight in Envoy 1 until it completes.
    pump(&mut envoys, "Envoy 1 sees Envoy 2's request in flight", |e| inflight(&mut e[0]) == 1.0);
    envoys[1].host.finish_stream(s2).unwrap();
    pump(&mut envoys, "Envoy 2's completion reaches Envoy 1", |e| inflight(&mut e[0]) == 0.0);

    // Every VM of both Envoys agrees; the relays carried it with nothing refused or lost.
    for e in envoys.iter_mut() {
        for vm in e.vms {
            assert_eq!(inflight_total(&stats(&mut e.host, vm).unwrap()), 0.0);
        }
    }
    for e in envoys.iter_mut() {
        let s = e.relay.as_ref().unwrap().replica_stats().unwrap();
        assert!(s.nats.connected, "{s:?}");
        assert!(s.exported >= 2 && s.posted >= 2, "{s:?}");
        assert_eq!(
            (s.lost, s.post_rejected, s.malformed, s.identity_mismatches, s.queue_dropped),
            (0, 0, 0, 0, 0),
            "{s:?}"
        );
        assert!(e.host.abi_violations().is_empty());
    }
    // Stopping a relay while its Envoy keeps serving: the pumping thread must keep answering
    // until the relay's threads are done (their last reads and posts).
    for i in 0..2 {
        let relay = envoys[i].relay.take().unwrap();
        let stopper = std::thread::spawn(move || relay.stop());
        while !stopper.is_finished() {
            for e in envoys.iter_mut() {
                while let Ok(inc) = e.rx.recv_timeout(Duration::from_millis(2)) {
                    answer_incoming(&mut e.host, e.vms[0], inc).unwrap();
                }
            }
        }
        stopper.join().unwrap();
    }
    drop(nats);
}
