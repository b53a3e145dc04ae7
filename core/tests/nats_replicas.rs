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
