//! Replica batches, the outbox, the peer table and their application to a router (sans-IO).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use super::*;
use crate::{EndpointSpec, Policy, ReplicaApplied, RouteRequest, RouterCore, RoutingEffect};

const EPS: [&str; 3] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];

fn core(id: &str, epoch: u64) -> RouterCore {
    let mut c = RouterCore::new(Policy::default());
    for e in EPS {
        c.upsert_endpoint(EndpointSpec::new(e, crate::Role::Decode)).unwrap();
    }
    c.enable_replication(ReplicaConfig::new("f", id, epoch)).unwrap();
    c
}

fn core_without_replication() -> RouterCore {
    RouterCore::new(Policy::default())
}

fn prompt(i: usize) -> String {
    format!("{} conversation {i}", "shared system prompt ".repeat(60))
}

fn inflight_at(c: &RouterCore, ep: &str) -> u64 {
    c.endpoints().iter().find(|e| &*e.id == ep).map_or(0, |e| u64::from(e.inflight))
}

fn ship(from: &mut RouterCore, to: &mut RouterCore, now: u64) -> Vec<ReplicaApplied> {
    let mut out = Vec::new();
    while let Some(b) = from.take_replica_batch(now, false) {
        out.push(to.apply_replica_bytes(&b, now).unwrap());
    }
    out
}

fn effect(id: &str) -> RoutingEffect {
    RoutingEffect {
        request_id: id.into(),
        target: Arc::from(EPS[0]),
        prefill: None,
        now_ms: 5,
        session_key: Some(7),
        approx_fingerprint: 1,
        approx_keys: vec![1, 2, 3],
        approx_seq_starts: vec![0],
        precise_fingerprint: 2,
        precise_keys: vec![],
        precise_seq_starts: vec![],
        precise_skip: [0, 0],
        speculative_expires_ms: 9,
    }
}

#[test]
fn batch_round_trips_and_every_truncation_is_an_error() {
    let b = ReplicaBatch {
        fleet: "f".into(),
        replica: "r-1".into(),
        epoch: 3,
        seq: 9,
        sent_ms: 11,
        entries: vec![ReplicaEntry::Effect(effect("a")), ReplicaEntry::Complete("a".into())],
    };
    let bytes = b.encode().unwrap();
    assert_eq!(&bytes[..4], BATCH_MAGIC);
    assert_eq!(ReplicaBatch::decode(&bytes).unwrap(), b);
    for cut in 0..bytes.len() {
        assert!(matches!(ReplicaBatch::decode(&bytes[..cut]), Err(ReplicaError::Malformed(_))), "cut at {cut}");
    }
    let mut extra = bytes.clone();
    extra.push(0);
    assert!(ReplicaBatch::decode(&extra).is_err());
    // A corrupted entry inside an otherwise framed batch: the whole batch is refused.
    let mut bad = bytes.clone();
    let at = bytes.len() - 2 - 5 - effect("a").encode().len();
    bad[at + 5] = 99; // the effect's version byte
    assert!(matches!(ReplicaBatch::decode(&bad), Err(ReplicaError::Malformed(_))));
    // A count larger than the bytes could hold.
    let mut lie = ReplicaBatch { entries: vec![], ..b }.encode().unwrap();
    let n = lie.len();
    lie[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(ReplicaBatch::decode(&lie).is_err());
    // Ids that are not subject tokens.
    assert!(ReplicaBatch::encode_entries("f", "a.b", 1, 1, 1, &[]).is_err());
    assert!(ReplicaBatch::encode_entries("", "a", 1, 1, 1, &[]).is_err());
}

#[test]
fn config_is_validated() {
    assert!(ReplicaConfig::new("f", "a", 1).validate().is_ok());
    assert!(ReplicaConfig::new("f", "", 1).validate().is_err());
    assert!(ReplicaConfig::new("f", "a*", 1).validate().is_err());
    assert!(ReplicaConfig::new("f", &"x".repeat(65), 1).validate().is_err());
    assert!(ReplicaConfig { max_batch_entries: 0, ..ReplicaConfig::new("f", "a", 1) }.validate().is_err());
    let mut c = RouterCore::new(Policy::default());
    assert!(c.enable_replication(ReplicaConfig::new("f f", "a", 1)).is_err());
    assert!(c.replica_stats().is_none());
    assert_eq!(c.apply_replica_bytes(b"x", 0).unwrap_err(), ReplicaError::Malformed("truncated at byte 0".into()));
    let b = ReplicaBatch::encode_entries("f", "b", 1, 1, 1, &[]).unwrap();
    assert_eq!(c.apply_replica_bytes(&b, 0).unwrap_err(), ReplicaError::NotEnabled);
}

#[test]
fn decisions_and_completions_reach_the_other_replica() {
    let (mut a, mut b) = (core("a", 1), core("b", 1));
    let req = RouteRequest::text("m", &prompt(1));
    let d = a.route(&req, 10).unwrap();
    assert!(d.effect.is_none(), "replication alone does not attach effects to decisions");
    let ep = d.endpoint().unwrap().to_owned();
    let applied = ship(&mut a, &mut b, 11);
    assert_eq!(applied, vec![ReplicaApplied { applied: true, effects: 1, completions: 0, skipped: 0 }]);
    assert_eq!(inflight_at(&b, &ep), 1);
    // b routes the same prompt where a sent it, with the prefix a's decision left there.
    let d2 = b.route(&req, 12).unwrap();
    assert_eq!(d2.endpoint(), Some(ep.as_str()));
    assert_eq!(d2.prefix_hit, 1.0);
    a.complete(&d.request_id).unwrap();
    let applied = ship(&mut a, &mut b, 13);
    assert_eq!(applied[0].completions, 1);
    assert_eq!(inflight_at(&b, &ep), 1, "only b's own request is left");
    let s = b.replica_stats().unwrap();
    assert_eq!((s.effects_applied, s.completions_applied, s.peers), (1, 1, 1));
    let page = b.metrics_text(14);
    assert!(page.contains("kvroute_replica_entries_total{direction=\"in\",kind=\"effect\"} 1\n"), "{page}");
    assert!(page.contains("kvroute_replica_peers 1\n"));
    assert!(!core_without_replication().metrics_text(14).contains("kvroute_replica_"));
    let s = a.replica_stats().unwrap();
    assert_eq!((s.batches_out, s.entries_out), (2, 2));
}

#[test]
fn request_ids_of_different_replicas_never_collide() {
    let (mut a, mut b) = (core("a", 1), core("b", 1));
    let req = RouteRequest::text("m", &prompt(2));
    let da = a.route(&req, 10).unwrap();
    let db = b.route(&req, 10).unwrap();
    assert_eq!(da.request_id, db.request_id, "both generate kvr-1");
    ship(&mut a, &mut b, 11);
    ship(&mut b, &mut a, 11);
    assert_eq!(a.stats().inflight_requests, 2);
    assert_eq!(b.stats().inflight_requests, 2);
    // a's completion releases a's request on b, not b's own request of the same id.
    a.complete(&da.request_id).unwrap();
    ship(&mut a, &mut b, 12);
    assert_eq!(b.stats().inflight_requests, 1);
    b.complete(&db.request_id).unwrap();
    assert_eq!(b.stats().inflight_requests, 0);
}

#[test]
fn duplicates_replays_and_gaps_are_judged() {
    let (mut a, mut b) = (core("a", 1), core("b", 1));
    a.route(&RouteRequest::text("m", &prompt(3)), 10).unwrap();
    let b1 = a.take_replica_batch(10, false).unwrap();
    a.route(&RouteRequest::text("m", &prompt(4)), 10).unwrap();
    let _lost = a.take_replica_batch(10, false).unwrap();
    a.route(&RouteRequest::text("m", &prompt(5)), 10).unwrap();
    let b3 = a.take_replica_batch(10, false).unwrap();
    assert!(b.apply_replica_bytes(&b1, 11).unwrap().applied);
    assert!(!b.apply_replica_bytes(&b1, 11).unwrap().applied, "a duplicate");
    assert!(b.apply_replica_bytes(&b3, 11).unwrap().applied);
    assert!(!b.apply_replica_bytes(&b1, 11).unwrap().applied, "a replay of an older batch");
    let s = b.replica_stats().unwrap();
    assert_eq!((s.batches_in, s.duplicates, s.gaps, s.effects_applied), (2, 2, 1, 2));
    assert_eq!(b.stats().inflight_requests, 2);
    // Own batches coming back, other fleets, unknown replicas: ignored.
    let own = b.take_replica_batch(12, true).unwrap();
    assert!(!b.apply_replica_bytes(&own, 12).unwrap().applied);
    let other = ReplicaBatch::encode_entries("g", "c", 1, 1, 1, &[]).unwrap();
    assert!(!b.apply_replica_bytes(&other, 12).unwrap().applied);
    let mut c = core("c", 1);
    c.enable_replication(ReplicaConfig { allowed_replicas: vec!["b".into()], ..ReplicaConfig::new("f", "c", 1) })
        .unwrap();
    assert!(!c.apply_replica_bytes(&b3, 12).unwrap().applied);
    assert!(c.apply_replica_bytes(&own, 12).unwrap().applied);
    let s = c.replica_stats().unwrap();
    assert_eq!((s.unknown_replica, s.batches_in), (1, 1));
    let s = b.replica_stats().unwrap();
    assert_eq!((s.own, s.wrong_fleet), (1, 1));
    assert!(b.apply_replica_bytes(&b3[..b3.len() - 1], 13).is_err());
    assert_eq!(b.replica_stats().unwrap().malformed, 1);
    assert_eq!(b.stats().inflight_requests, 2, "nothing of the malformed batch applied");
}

#[test]
fn a_restarted_replica_takes_its_lost_requests_with_it() {
    let (mut a, mut b) = (core("a", 1), core("b", 1));
    for i in 0..5 {
        a.route(&RouteRequest::text("m", &prompt(10 + i)), 10).unwrap();
    }
    ship(&mut a, &mut b, 11);
    assert_eq!(b.stats().inflight_requests, 5);
    // a crashes: its completions are lost. Its next incarnation announces itself.
    let mut a2 = core("a", 2);
    a2.route(&RouteRequest::text("m", &prompt(20)), 20).unwrap();
    ship(&mut a2, &mut b, 21);
    assert_eq!(b.stats().inflight_requests, 1);
    let s = b.replica_stats().unwrap();
    assert_eq!((s.incarnations, s.inflight_dropped), (1, 5));
    // A late batch of the dead incarnation is stale.
    let mut late = core("a", 1);
    late.route(&RouteRequest::text("m", &prompt(30)), 22).unwrap();
    ship(&mut late, &mut b, 22);
    assert_eq!(b.replica_stats().unwrap().stale, 1);
    assert_eq!(b.stats().inflight_requests, 1);
}

#[test]
fn a_silent_replica_leaves_no_phantom_load() {
    let (mut a, mut b) = (core("a", 1), core("b", 1));
    let d = a.route(&RouteRequest::text("m", &prompt(40)), 1_000).unwrap();
    ship(&mut a, &mut b, 1_000);
    let ep = d.endpoint().unwrap().to_owned();
    assert_eq!(inflight_at(&b, &ep), 1);
    // Heartbeats keep it alive...
    let hb = a.take_replica_batch(20_000, true).unwrap();
    b.apply_replica_bytes(&hb, 20_000).unwrap();
    assert_eq!(b.expire_silent_replicas(45_000), 0);
    assert_eq!(inflight_at(&b, &ep), 1);
    // ... silence past peer_silence_ms drops what it had in flight here.
    assert_eq!(b.expire_silent_replicas(50_001), 1);
    assert_eq!(inflight_at(&b, &ep), 0);
    assert_eq!(b.replica_stats().unwrap().inflight_dropped, 1);
}

#[test]
fn the_outbox_is_bounded_and_batches_respect_their_bounds() {
    let mut a = RouterCore::new(Policy::default());
    a.upsert_endpoint(EndpointSpec::new(EPS[0], crate::Role::Decode)).unwrap();
    let cfg = ReplicaConfig { max_outbox_entries: 10, max_batch_entries: 4, ..ReplicaConfig::new("f", "a", 1) };
    a.enable_replication(cfg).unwrap();
    for i in 0..25 {
        a.route(&RouteRequest::text("m", &prompt(i)), i as u64).unwrap();
    }
    assert_eq!(a.replica_outbox_len(), 10);
    let mut sizes = Vec::new();
    let mut b = core("b", 1);
    while let Some(batch) = a.take_replica_batch(100, false) {
        let d = ReplicaBatch::decode(&batch).unwrap();
        sizes.push(d.entries.len());
        b.apply_replica_bytes(&batch, 100).unwrap();
    }
    assert_eq!(sizes, vec![4, 4, 2]);
    let s = a.replica_stats().unwrap();
    assert_eq!((s.outbox_dropped, s.entries_out, s.outbox_len), (15, 10, 0));
    // The newest ten survived: the 16th to the 25th request.
    assert_eq!(b.replica_stats().unwrap().effects_applied, 10);
    // A byte bound splits batches too; one entry larger than the bound still goes alone.
    a.enable_replication(ReplicaConfig { max_batch_bytes: 64, ..ReplicaConfig::new("f", "a", 2) }).unwrap();
    a.route(&RouteRequest::text("m", &prompt(99)), 200).unwrap();
    a.route(&RouteRequest::text("m", &prompt(98)), 200).unwrap();
    let one = ReplicaBatch::decode(&a.take_replica_batch(201, false).unwrap()).unwrap();
    assert_eq!(one.entries.len(), 1);
    assert_eq!((one.epoch, one.seq), (2, 1));
    // Nothing waits and no heartbeat asked: no batch; a heartbeat is an empty numbered batch.
    a.take_replica_batch(202, false).unwrap();
    assert!(a.take_replica_batch(203, false).is_none());
    let hb = ReplicaBatch::decode(&a.take_replica_batch(204, true).unwrap()).unwrap();
    assert_eq!((hb.entries.len(), hb.seq), (0, 3));
}

#[test]
fn apply_only_replicas_queue_nothing() {
    let mut a = core("a", 1);
    a.enable_replication(ReplicaConfig { publish: false, ..ReplicaConfig::new("f", "a", 1) }).unwrap();
    let d = a.route(&RouteRequest::text("m", &prompt(50)), 1).unwrap();
    a.complete(&d.request_id).unwrap();
    assert_eq!(a.replica_outbox_len(), 0);
    assert!(a.take_replica_batch(2, false).is_none());
    let mut b = core("b", 1);
    b.route(&RouteRequest::text("m", &prompt(51)), 1).unwrap();
    ship(&mut b, &mut a, 2);
    assert_eq!(a.stats().inflight_requests, 1);
}

#[test]
fn effects_for_unknown_endpoints_are_skipped_not_fatal() {
    let mut a = core("a", 1);
    let mut b = RouterCore::new(Policy::default());
    b.upsert_endpoint(EndpointSpec::new(EPS[0], crate::Role::Decode)).unwrap();
    b.enable_replication(ReplicaConfig::new("f", "b", 1)).unwrap();
    let mut sent = std::collections::HashSet::new();
    for i in 0..12 {
        let d = a.route(&RouteRequest::text("m", &format!("{i} {}", "unshared ".repeat(50))), 1).unwrap();
        sent.insert(d.endpoint().unwrap().to_owned());
    }
    assert!(sent.len() > 1, "the workload spreads over several endpoints");
    let r = ship(&mut a, &mut b, 2);
    let (fx, skipped): (u32, u32) = r.iter().fold((0, 0), |(f, s), x| (f + x.effects, s + x.skipped));
    assert_eq!(fx + skipped, 12);
    assert!(skipped > 0 && fx > 0);
    assert_eq!(b.replica_stats().unwrap().effects_unknown_endpoint, u64::from(skipped));
    assert_eq!(b.stats().inflight_requests, fx as usize);
}

#[test]
fn a_restarted_replica_relearns_its_own_past_caches_but_not_its_requests() {
    let mut old = core("a", 1);
    let req = RouteRequest::text("m", &prompt(70));
    let d = old.route(&req, 10).unwrap();
    let replayed: Vec<Vec<u8>> = std::iter::from_fn(|| old.take_replica_batch(11, false)).collect();
    // The next incarnation replays the stream, its own past batches among them.
    let mut new = core("a", 2);
    for b in &replayed {
        assert!(new.apply_replica_bytes(b, 20).unwrap().applied);
    }
    assert_eq!(new.stats().inflight_requests, 0, "the old incarnation's requests died with it");
    let s = new.replica_stats().unwrap();
    assert_eq!((s.own, s.own_past_applied), (1, 1));
    let again = new.route(&req, 21).unwrap();
    assert_eq!(again.endpoint(), d.endpoint());
    assert_eq!(again.prefix_hit, 1.0);
    // Its current incarnation's batches coming back stay ignored.
    let own = new.take_replica_batch(22, false).unwrap();
    assert!(!new.apply_replica_bytes(&own, 22).unwrap().applied);
}
