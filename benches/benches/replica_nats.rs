//! Router replicas over a real NATS server on loopback: effects published and applied per
//! second, bytes per effect, the receiver's memory.
//!
//! Run: `cargo bench -p kvroute-benches --features nats --bench replica_nats` (needs
//! `nats-server` on PATH: Debian's nats-server; the bench starts it on a free loopback port with
//! JetStream in a temporary directory and stops it). Not a criterion bench: one flood, timed end
//! to end. The publisher is a `ReplicaPort` replaying batches a real router made (512 decisions
//! of 2,048-token prompts over 64 endpoints, renumbered), as fast as the transport takes them;
//! the receiver is a `Router` with the full transport (`Replicator`) applying them. Reported:
//! effects/s from the first batch handed over to the last applied (both directions of one
//! replica's work: it publishes its own and applies the others'), bytes per effect on the wire,
//! and the receiver's resident memory before and after.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    clippy::print_stdout
)] // a report on stdout

use std::collections::VecDeque;
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute::{
    EndpointSpec, NatsReplicaOptions, Policy, ReplicaBatch, ReplicaConfig, ReplicaEntry, ReplicaEntryRef, ReplicaPort,
    Replicator, Role, RouteRequest, Router, RouterCore,
};

const ENDPOINTS: usize = 64;
const DECISIONS: usize = 512;
const ROUNDS: usize = 400; // 400 × 512 = 204,800 effects

fn endpoints() -> Vec<EndpointSpec> {
    (0..ENDPOINTS).map(|i| EndpointSpec::new(format!("10.0.0.{}:8000", i + 1), Role::Decode)).collect()
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).map(str::to_owned))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// The encoded effects of 512 decisions.
fn effects() -> Vec<Vec<u8>> {
    let mut a = RouterCore::new(Policy::default());
    for e in endpoints() {
        a.upsert_endpoint(e).unwrap();
    }
    a.enable_replication(ReplicaConfig { max_outbox_entries: 1 << 20, ..ReplicaConfig::new("bench", "src", 1) })
        .unwrap();
    for i in 0..DECISIONS {
        let head = format!("system prompt {} ", i % 16).repeat(256);
        let tail = format!("user {i} asks ").repeat(292);
        a.route(&RouteRequest::text("m", &format!("{head}{tail}")), i as u64).unwrap();
    }
    let mut out = Vec::new();
    while let Some(b) = a.take_replica_batch(1, false) {
        for e in ReplicaBatch::decode(&b).unwrap().entries {
            if let ReplicaEntry::Effect(fx) = e {
                out.push(fx.encode());
            }
        }
    }
    out
}

/// Replays the effects under fresh request ids, renumbered batches of 512.
struct Flood {
    batches: Mutex<VecDeque<Vec<u8>>>,
    first: Mutex<Option<Instant>>,
}

impl ReplicaPort for Flood {
    fn take_batch(&self, _now: u64, _hb: bool) -> Option<Vec<u8>> {
        let b = self.batches.lock().unwrap().pop_front()?;
        self.first.lock().unwrap().get_or_insert_with(Instant::now);
        Some(b)
    }
    fn apply(&self, _b: &[u8], _now: u64) {}
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("replica_nats: bench");
        return;
    }
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = std::env::temp_dir().join(format!("kvroute-bench-nats-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut server = match Command::new("nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("replica_nats: cannot start nats-server ({e}); apt-get install nats-server");
            std::process::exit(1);
        }
    };
    let t0 = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(20), "nats-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let url = format!("nats://127.0.0.1:{port}");
    let fx = effects();
    let bytes_per_effect = fx.iter().map(Vec::len).sum::<usize>() as f64 / fx.len() as f64;
    let mut batches = VecDeque::new();
    let mut wire = 0usize;
    for round in 0..ROUNDS {
        let ids: Vec<String> = (0..fx.len()).map(|i| format!("r{round}-{i}")).collect();
        // Same keys, fresh request ids: re-encode each effect with its new id.
        let renamed: Vec<Vec<u8>> = fx
            .iter()
            .zip(&ids)
            .map(|(b, id)| {
                let mut e = kvroute::RoutingEffect::decode(b).unwrap();
                e.request_id = id.clone();
                e.encode()
            })
            .collect();
        let refs: Vec<ReplicaEntryRef<'_>> = renamed.iter().map(|b| ReplicaEntryRef::EncodedEffect(b)).collect();
        let b = ReplicaBatch::encode_entries("bench", "src", 1, round as u64 + 1, 1, &refs).unwrap();
        wire += b.len();
        batches.push_back(b);
    }
    let total = ROUNDS * fx.len();
    let opts = |id: &str| NatsReplicaOptions {
        url: url.clone(),
        fleet: "bench".into(),
        replica_id: id.into(),
        stream: None,
        ..NatsReplicaOptions::default()
    };
    let policy = Policy::from_json(r#"{"limits": {"max_inflight_requests": 1000000}}"#).unwrap();
    let b = Arc::new(Router::new(policy));
    for e in endpoints() {
        b.upsert_endpoint(e).unwrap();
    }
    let rb = Replicator::start(b.clone(), opts("b")).unwrap();
    let t0 = Instant::now();
    while !rb.stats().inbound_ready {
        assert!(t0.elapsed() < Duration::from_secs(20));
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    let rss0 = rss_kib();
    let flood = Arc::new(Flood { batches: Mutex::new(batches), first: Mutex::new(None) });
    let rf = Replicator::start_port(flood.clone(), opts("src")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while b.replica_stats().unwrap().effects_applied < total as u64 {
        if Instant::now() > deadline {
            eprintln!("timed out: {:?} / {:?}", rf.stats(), rb.stats());
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let done = Instant::now();
    let first = flood.first.lock().unwrap().unwrap_or(done);
    let secs = (done - first).as_secs_f64();
    let applied = b.replica_stats().unwrap().effects_applied;
    let s = rb.stats();
    println!("replica_nats: {applied} of {total} effects of 2,048-token decisions over 64 endpoints");
    println!(
        "  published and applied: {:.0} effects/s ({:.2} s end to end; goal >= 100,000/s)",
        applied as f64 / secs,
        secs
    );
    println!(
        "  bytes per effect: {bytes_per_effect:.0} encoded, {:.0} on the wire with batch framing ({} batches of {})",
        wire as f64 / total as f64,
        ROUNDS,
        fx.len()
    );
    println!(
        "  receiver: in flight {} (bounded by limits.max_inflight_requests), resident memory {} MiB -> {} MiB",
        b.stats().inflight_requests,
        rss0 / 1024,
        rss_kib() / 1024
    );
    println!(
        "  receiver counters: malformed {}, gaps {}, duplicates {}",
        s.replica.malformed, s.replica.gaps, s.replica.duplicates
    );
    drop(rf);
    drop(rb);
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
