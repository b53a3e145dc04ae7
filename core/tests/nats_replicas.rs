//! Router replicas over a real NATS server on loopback (feature `nats`).
#![cfg(feature = "nats")]
#![allow(clippy::disallowed_methods, clippy::disallowed_types, clippy::unwrap_used, clippy::expect_used)] // real server, real waits

mod nats_support;

use std::sync::Arc;

use kvroute::{EndpointSpec, NatsReplicaOptions, Replicator, Role, Router};
use nats_support::{wait_until, NatsServer};

const TOKEN: &str = "s3cret-fleet-token";

fn router() -> Arc<Router> {
    let r = Router::new(kvroute::Policy::default());
    for i in 0..4 {
        r.upsert_endpoint(EndpointSpec::new(format!("10.0.0.{i}:8000"), Role::Decode)).unwrap();
    }
    Arc::new(r)
}

fn opts(nats: &NatsServer, id: &str) -> NatsReplicaOptions {
    NatsReplicaOptions {
        url: nats.url(),
        fleet: "test".into(),
        replica_id: id.into(),
        token: nats.token.clone(),
        ..NatsReplicaOptions::default()
    }
}

fn body(i: usize) -> Vec<u8> {
    format!(
        r#"{{"model":"m","prompt":"{} tenant {i} asks a long question about caches","max_tokens":8}}"#,
        "system prompt ".repeat(40)
    )
    .into_bytes()
}

#[test]
fn two_replicas_share_inflight_and_prefixes() {
    let nats = NatsServer::start(Some(TOKEN));
    let (a, b) = (router(), router());
    let ra = Replicator::start(a.clone(), opts(&nats, "a")).unwrap();
    let rb = Replicator::start(b.clone(), opts(&nats, "b")).unwrap();
    let d = a.route_http(&body(1), [("x-request-id", "r1")], kvroute::unix_time_ms()).unwrap();
    assert!(wait_until(30, || b.stats().inflight_requests == 1).is_some(), "b sees a's request: {:?}", rb.stats());
    // b routes the same prompt: a's decision told it where the prefix lives.
    let d2 = b.route_http(&body(1), [("x-request-id", "r2")], kvroute::unix_time_ms()).unwrap();
    assert_eq!(d2.endpoint(), d.endpoint());
    assert!(d2.prefix_hit > 0.5, "{}", d2.prefix_hit);
    a.complete(&d.request_id).unwrap();
    assert!(wait_until(30, || b.stats().inflight_requests == 1 && a.stats().inflight_requests == 1).is_some());
    let s = rb.stats();
    assert_eq!(s.replica.completions_applied, 1, "{s:?}");
    assert_eq!(s.replica.malformed, 0);
    drop(ra);
    drop(rb);
}

fn route(r: &Router, i: usize, id: &str) -> kvroute::Decision {
    r.route_http(&body(i), [("x-request-id", id)], kvroute::unix_time_ms()).unwrap()
}

#[test]
fn a_wrong_token_is_refused_and_its_replica_never_heard() {
    let nats = NatsServer::start(Some(TOKEN));
    let (a, intruder) = (router(), router());
    let ra = Replicator::start(a.clone(), opts(&nats, "a")).unwrap();
    let bad = NatsReplicaOptions { token: Some("wrong".into()), ..opts(&nats, "intruder") };
    let ri = Replicator::start(intruder.clone(), bad).unwrap();
    assert!(wait_until(30, || ri.stats().server_errors > 0).is_some(), "{:?}", ri.stats());
    let s = ri.stats();
    assert!(!s.connected && s.connects == 0, "{s:?}");
    assert!(s.last_error.as_deref().unwrap_or("").to_lowercase().contains("authorization"), "{s:?}");
    // The intruder still routes on its own state.
    route(&intruder, 1, "x1");
    // a hears its own fleet (a request of its own comes back as `own`), never the intruder.
    route(&a, 2, "a1");
    assert!(wait_until(30, || ra.stats().replica.own > 0).is_some(), "{:?}", ra.stats());
    assert_eq!(a.stats().inflight_requests, 1);
    assert_eq!(ra.stats().replica.peers, 0);
}

/// A port that publishes whatever it is given: malformed bytes, a batch of a replica outside the
/// allowed list, a valid batch.
struct Raw(std::sync::Mutex<std::collections::VecDeque<Vec<u8>>>);

impl kvroute::ReplicaPort for Raw {
    fn take_batch(&self, _now: u64, _hb: bool) -> Option<Vec<u8>> {
        self.0.lock().unwrap().pop_front()
    }
    fn apply(&self, _batch: &[u8], _now: u64) {}
}

#[test]
fn malformed_and_unknown_batches_are_counted_and_dropped_whole() {
    let nats = NatsServer::start(Some(TOKEN));
    let a = router();
    let ra =
        Replicator::start(a.clone(), NatsReplicaOptions { allowed_replicas: vec!["b".into()], ..opts(&nats, "a") })
            .unwrap();
    // Real effects made by a router of the fleet, wrapped by hand.
    let src = router();
    src.record_effects(true);
    let fx = route(&src, 3, "s1").effect.unwrap().encode();
    let entry = [kvroute::ReplicaEntryRef::EncodedEffect(&fx)];
    let from_b = kvroute::ReplicaBatch::encode_entries("test", "b", 1, 1, 1, &entry).unwrap();
    let from_x = kvroute::ReplicaBatch::encode_entries("test", "x", 1, 1, 1, &entry).unwrap();
    let mut cut = kvroute::ReplicaBatch::encode_entries("test", "b", 1, 2, 1, &entry).unwrap();
    cut.truncate(cut.len() - 3);
    let raw = |batches: Vec<Vec<u8>>| Arc::new(Raw(std::sync::Mutex::new(batches.into_iter().collect())));
    // On b's subject: garbage, a cut batch, then a valid one.
    let rb = Replicator::start_port(raw(vec![b"not a batch".to_vec(), cut, from_b.clone()]), opts(&nats, "b")).unwrap();
    // x is not in a's allowed list; y speaks for b on its own subject.
    let rx = Replicator::start_port(raw(vec![from_x]), opts(&nats, "x")).unwrap();
    let ry = Replicator::start_port(raw(vec![from_b]), opts(&nats, "y")).unwrap();
    let done = || {
        let s = ra.stats();
        s.replica.effects_applied == 1 && s.replica.unknown_replica == 1 && s.spoofed == 1 && s.replica.malformed == 2
    };
    assert!(wait_until(30, done).is_some(), "{:?}", ra.stats());
    let s = ra.stats().replica;
    assert_eq!((s.malformed, s.unknown_replica, s.batches_in), (2, 1, 1), "{s:?}");
    assert_eq!(a.stats().inflight_requests, 1);
    drop((rb, rx, ry));
}

#[test]
fn a_late_replica_catches_up_from_the_stream() {
    let nats = NatsServer::start(Some(TOKEN));
    let a = router();
    let ra = Replicator::start(a.clone(), opts(&nats, "a")).unwrap();
    let mut where_ = Vec::new();
    for i in 0..300 {
        where_.push(route(&a, 1000 + i, &format!("a{i}")).endpoint().unwrap().to_owned());
    }
    assert!(wait_until(30, || a.replica_stats().unwrap().outbox_len == 0).is_some());
    ra.flush();
    // The late one starts with nothing and replays the stream.
    let c = router();
    let rc = Replicator::start(c.clone(), opts(&nats, "c")).unwrap();
    let took = wait_until(60, || c.stats().inflight_requests == 300).expect("c caught up");
    eprintln!("late replica: 300 requests caught up in {took:?}");
    // The same load per endpoint as a's own view, and a's prompts cached where a sent them.
    let load = |r: &Router| r.endpoints().iter().map(|e| (e.id.to_string(), e.inflight)).collect::<Vec<_>>();
    assert_eq!(load(&c), load(&a));
    for (i, _) in where_.iter().enumerate().step_by(37) {
        let d = route(&c, 1000 + i, &format!("c{i}"));
        assert!(d.prefix_hit > 0.5, "request {i}: {}", d.prefix_hit);
    }
    drop((ra, rc));
}

#[test]
fn routing_goes_on_through_a_server_restart_and_sync_recovers() {
    let mut nats = NatsServer::start(Some(TOKEN));
    let (a, b) = (router(), router());
    let ra = Replicator::start(a.clone(), opts(&nats, "a")).unwrap();
    let rb = Replicator::start(b.clone(), opts(&nats, "b")).unwrap();
    route(&a, 1, "before");
    assert!(wait_until(30, || b.stats().inflight_requests == 1).is_some());
    nats.stop();
    assert!(wait_until(30, || !ra.stats().connected).is_some());
    // No decision is lost or slowed by the outage: every route call returns a decision.
    let mut during = 0;
    for i in 0..50 {
        let d = route(&a, 100 + i, &format!("during{i}"));
        assert!(d.is_routed());
        during += 1;
    }
    nats.restart();
    assert!(wait_until(60, || ra.stats().connected && rb.stats().connected).is_some(), "{:?}", ra.stats());
    // Live again: a decision after the restart reaches b.
    let after = route(&a, 999, "after");
    // Everything a decided, during the outage too, reaches b: the outbox held it.
    let got = wait_until(60, || b.stats().inflight_requests == 52);
    let s = ra.stats();
    eprintln!(
        "restart: {during} decisions during the outage, reconnected (connects {}), b in flight {}, recovered in {got:?}, outbox dropped {}, publish errors {}",
        s.connects,
        b.stats().inflight_requests,
        s.replica.outbox_dropped,
        s.publish_errors
    );
    assert!(got.is_some(), "a decision after the restart reaches b: {:?} / {:?}", ra.stats(), rb.stats());
    assert!(s.connects >= 2 && s.disconnects >= 1, "{s:?}");
    assert!(after.is_routed());
}

#[test]
fn a_restarted_replica_leaves_no_phantom_requests() {
    let nats = NatsServer::start(Some(TOKEN));
    let (a, b) = (router(), router());
    let rb = Replicator::start(b.clone(), opts(&nats, "b")).unwrap();
    let ra = Replicator::start(a.clone(), NatsReplicaOptions { epoch: Some(1), ..opts(&nats, "a") }).unwrap();
    for i in 0..10 {
        route(&a, 200 + i, &format!("p{i}"));
    }
    assert!(wait_until(30, || b.stats().inflight_requests == 10).is_some());
    // a dies without completing anything; its next incarnation comes up.
    drop(ra);
    let a2 = router();
    let ra2 = Replicator::start(a2.clone(), NatsReplicaOptions { epoch: Some(2), ..opts(&nats, "a") }).unwrap();
    route(&a2, 300, "q");
    assert!(
        wait_until(30, || rb.stats().replica.incarnations == 1 && b.stats().inflight_requests == 1).is_some(),
        "{:?}",
        rb.stats()
    );
    assert_eq!(rb.stats().replica.inflight_dropped, 10);
    drop(ra2);
}

#[test]
fn a_flood_of_effects_keeps_memory_bounded() {
    let nats = NatsServer::start(Some(TOKEN));
    let a = router();
    let b = router();
    let small = NatsReplicaOptions { max_outbox_entries: 1000, flush_interval_ms: 50, ..opts(&nats, "a") };
    let ra = Replicator::start(a.clone(), small).unwrap();
    let rb = Replicator::start(b.clone(), opts(&nats, "b")).unwrap();
    let max_inflight = kvroute::Policy::default().config().limits.max_inflight_requests;
    for i in 0..20_000 {
        route(&a, i, &format!("f{i}"));
        assert!(a.replica_stats().unwrap().outbox_len <= 1000);
    }
    assert!(wait_until(60, || a.replica_stats().unwrap().outbox_len == 0).is_some());
    // Every batch handed to the client reaches b (loopback, no outage); what the bounded outbox
    // dropped is counted on a's side.
    let sent = ra.stats().replica.entries_out;
    assert!(wait_until(60, || rb.stats().replica.effects_applied == sent || ra.stats().publish_errors > 0).is_some());
    let s = ra.stats();
    if s.publish_errors == 0 {
        assert_eq!(rb.stats().replica.effects_applied, sent);
    }
    assert_eq!(s.replica.entries_out + s.replica.outbox_dropped, 20_000);
    assert!(a.stats().inflight_requests <= max_inflight && b.stats().inflight_requests <= max_inflight);
    eprintln!("flood: {:?}\n{:?}", s, rb.stats());
}

#[test]
fn bad_options_are_typed_errors_and_change_nothing() {
    use kvroute::ReplicaError;
    for bad in [
        "{",
        r#"{"replica_id": "a", "bogus": 1}"#,
        r#"{"replica_id": "a.b"}"#,
        r#"{"replica_id": ""}"#,
        r#"{"replica_id": "a", "flush_interval_ms": 0}"#,
        r#"{"replica_id": "a", "password": "p"}"#,
        r#"{"replica_id": "a", "stream": {"max_bytes": -1}}"#,
        r#"{"replica_id": 7}"#,
    ] {
        let r = NatsReplicaOptions::from_json(bad).and_then(|o| o.validate().map(|()| o));
        assert!(matches!(r, Err(ReplicaError::Config { .. })), "{bad}: {r:?}");
    }
    // A router that replicates already is refused, and its replication is left as it was.
    let a = router();
    let nats = NatsServer::start(Some(TOKEN));
    let ra = Replicator::start(a.clone(), opts(&nats, "a")).unwrap();
    let again = Replicator::start(a.clone(), opts(&nats, "a2"));
    assert!(matches!(again, Err(ReplicaError::AlreadyEnabled { ref replica_id }) if replica_id == "a"), "{again:?}");
    assert_eq!(a.replica_stats().unwrap().replica_id, "a");
    route(&a, 5, "still");
    assert!(wait_until(30, || ra.stats().replica.own > 0).is_some());
    let last = ra.stop();
    assert!(!last.connected && last.published > 0, "{last:?}");
    assert!(a.replica_stats().is_none());
}
