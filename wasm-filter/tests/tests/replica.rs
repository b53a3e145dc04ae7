//! The replica routes (`filter.replica`) in the host: the export the relay reads (`GET
//! <path>/out`: every VM's effects and completions after a cursor, bounded, with what the ring
//! overwrote counted) and the ingestion of other replicas' batches (`POST <path>/in`: signed,
//! decoded whole before anything is applied, then applied by every VM of the Envoy).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute::{EndpointSpec, Policy, ReplicaBatch, ReplicaEntry, ReplicaEntryRef, Role, RouterCore};
use kvroute_filter::ingest;
use kvroute_wasm_tests::*;
use serde_json::{json, Value};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";
const FLEET: &str = "fleet-1";
const ME: &str = "envoy-1";

fn prompt(tag: &str) -> Vec<u8> {
    let words: String = (0..400).map(|i| format!("{tag}{i} ")).collect();
    json!({"model": "m", "prompt": words, "max_tokens": 600}).to_string().into_bytes()
}

/// One Envoy: `n` VMs with the replica section (`more` merged into it, `sync` as given).
fn envoy(n: usize, more: &Value, sync: &Value) -> (Host, Vec<VmId>) {
    let mut host = host(&Pages::default()).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let mut extra = replica_extra(FLEET, ME, more);
    extra["sync"] = sync.clone();
    let cfg = plugin_config(&json!({}), &[(A, "decode"), (B, "decode")], &extra);
    let vms = (0..n).map(|_| host.start_vm(&filter, vm_config(&cfg)).unwrap()).collect();
    (host, vms)
}

fn clean(host: &Host) {
    assert!(host.abi_violations().is_empty(), "{:#?}", &*host.abi_violations());
    for vm in host.vms() {
        assert_eq!(host.failure(vm).unwrap(), None);
    }
}

/// An export read: (batch, next cursor, lost, more).
fn export(host: &mut Host, vm: VmId, cursor: Option<u64>) -> (ReplicaBatch, u64, u64, bool) {
    let (status, h, body) = replica_out(host, vm, cursor, REPLICA_SECRET).unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(h.get("content-type"), Some("application/octet-stream"));
    assert_eq!((h.get(ingest::HEADER_REPLICA_FLEET), h.get(ingest::HEADER_REPLICA_ID)), (Some(FLEET), Some(ME)));
    let num = |k: &str| h.get(k).unwrap().parse::<u64>().unwrap();
    let batch = ReplicaBatch::decode(&body).unwrap();
    assert_eq!(batch.epoch, num(ingest::HEADER_REPLICA_LOG), "the batch carries the log's id");
    (batch, num(ingest::HEADER_REPLICA_CURSOR), num(ingest::HEADER_REPLICA_LOST), num(ingest::HEADER_REPLICA_MORE) == 1)
}

/// The request ids (effects) and completions of a batch.
fn ids(b: &ReplicaBatch) -> (Vec<String>, Vec<String>) {
    let mut fx = Vec::new();
    let mut done = Vec::new();
    for e in &b.entries {
        match e {
            ReplicaEntry::Effect(f) => fx.push(f.request_id.clone()),
            ReplicaEntry::Complete(id) => done.push(id.clone()),
        }
    }
    (fx, done)
}

#[test]
fn replica_routes_require_a_valid_fresh_signature() {
    let (mut host, vms) = envoy(1, &json!({}), &json!({}));
    let vm = vms[0];
    let out = format!("{REPLICA_PATH}/out");
    // No signature at all.
    let st = host
        .round_trip(vm, &HttpMessage::new([(":method", "GET"), (":path", out.as_str())], Vec::new()), None)
        .unwrap();
    assert_eq!(answer(&st).0, 401);
    assert!(st.upstream_headers().is_none());
    // The wrong secret, on both routes.
    assert_eq!(replica_out(&mut host, vm, None, "another-secret-0123456789").unwrap().0, 401);
    let batch = ReplicaBatch::encode_entries(FLEET, "envoy-2", 1, 1, 0, &[]).unwrap();
    assert_eq!(replica_in(&mut host, vm, &batch, "another-secret-0123456789").unwrap().0, 401);
    // A signature for another cursor than the one asked for.
    let ts = now_ms(&host);
    let sig = ingest::replica_signature(REPLICA_SECRET.as_bytes(), "out", Some(1), ts, &[]);
    let ts_text = ts.to_string();
    let path = format!("{out}?cursor=0");
    let h = [
        (":method", "GET"),
        (":path", path.as_str()),
        (ingest::HEADER_TIMESTAMP, ts_text.as_str()),
        (ingest::HEADER_SIGNATURE, sig.as_str()),
    ];
    assert_eq!(answer(&host.round_trip(vm, &HttpMessage::new(h, Vec::new()), None).unwrap()).0, 401);
    // Stale: signed 31 s before the filter's clock.
    let old = ts - 31_000;
    let sig = ingest::replica_signature(REPLICA_SECRET.as_bytes(), "out", None, old, &[]);
    let old = old.to_string();
    let h = [
        (":method", "GET"),
        (":path", out.as_str()),
        (ingest::HEADER_TIMESTAMP, old.as_str()),
        (ingest::HEADER_SIGNATURE, sig.as_str()),
    ];
    let (status, body) = answer(&host.round_trip(vm, &HttpMessage::new(h, Vec::new()), None).unwrap());
    assert_eq!((status, body["error"].as_str()), (401, Some("stale")));
    // Wrong methods, a query that is not a cursor.
    let wrong = [(":method", "POST"), (":path", out.as_str())];
    assert_eq!(answer(&host.round_trip(vm, &HttpMessage::new(wrong, b"x".to_vec()), None).unwrap()).0, 405);
    let inp = format!("{REPLICA_PATH}/in");
    let wrong = [(":method", "GET"), (":path", inp.as_str())];
    assert_eq!(answer(&host.round_trip(vm, &HttpMessage::new(wrong, Vec::new()), None).unwrap()).0, 405);
    let q = format!("{out}?cursor=x");
    assert_eq!(
        answer(
            &host
                .round_trip(vm, &HttpMessage::new([(":method", "GET"), (":path", q.as_str())], Vec::new()), None)
                .unwrap()
        )
        .0,
        400
    );
    let page = stats(&mut host, vm).unwrap();
    assert_eq!(stat(&page, "kvroute_wasm_replica_unauthorized_total"), Some(5.0), "{page}");
    assert_eq!(stat(&page, "kvroute_wasm_replica_rejected_total"), Some(3.0), "{page}");
    assert_eq!(stat(&page, "kvroute_wasm_replica_in_batches_total"), Some(0.0));
    // Signed right: answered.
    assert_eq!(replica_out(&mut host, vm, None, REPLICA_SECRET).unwrap().0, 200);
    assert_eq!(replica_in(&mut host, vm, &batch, REPLICA_SECRET).unwrap().0, 200);
    clean(&host);
}

#[test]
fn the_export_reads_every_vms_effects_and_completions_after_a_cursor() {
    let (mut host, vms) = envoy(2, &json!({}), &json!({}));
    let (open, o0) = route(&mut host, vms[0], &prompt("alpha"), &[]).unwrap();
    let (done, o1) = route(&mut host, vms[1], &prompt("beta"), &[]).unwrap();
    host.finish_stream(done).unwrap();
    let (id0, id1) = (o0.request_id().unwrap().to_owned(), o1.request_id().unwrap().to_owned());

    // From the start (no cursor), read through VM 1: both VMs' decisions and VM 1's completion,
    // their ids qualified by the VM that wrote them (ids are unique only within one VM).
    let (b, cursor, lost, more) = export(&mut host, vms[1], None);
    assert_eq!((b.fleet.as_str(), b.replica.as_str(), b.seq, lost, more), (FLEET, ME, 0, 0, false));
    let (fx, completions) = ids(&b);
    assert_eq!(fx.len(), 2, "{fx:?}");
    assert!(fx[0].ends_with(&format!(".{id0}")) && fx[1].ends_with(&format!(".{id1}")), "{fx:?}");
    assert_ne!(fx[0].split('.').next(), fx[1].split('.').next(), "two writers");
    assert_eq!(completions, [fx[1].clone()], "the completion names the exported id");
    if let ReplicaEntry::Effect(e) = &b.entries[0] {
        assert_eq!(&*e.target, o0.destination().unwrap());
    }

    // From the cursor: nothing new, the same cursor.
    let (b, again, _, _) = export(&mut host, vms[0], Some(cursor));
    assert!(b.entries.is_empty());
    assert_eq!(again, cursor);
    // VM 0's request completes: exactly that completion follows the cursor.
    host.finish_stream(open).unwrap();
    let (b, next, _, _) = export(&mut host, vms[0], Some(cursor));
    assert_eq!(ids(&b).1, [fx[0].clone()]);
    assert_eq!(next, cursor + 1);
    // Reading again from an old cursor reads again (the relay owns its cursor).
    assert_eq!(export(&mut host, vms[1], Some(cursor)).0.entries.len(), 1);
    // A cursor past the head (a log before an Envoy restart): read from the oldest entry again.
    let (b, _, _, _) = export(&mut host, vms[1], Some(cursor + 1000));
    assert_eq!(b.entries.len(), 4);
    let page = stats(&mut host, vms[1]).unwrap();
    assert_eq!(stat(&page, "kvroute_wasm_replica_out_entries_total"), Some(8.0), "VM 1 read 3 + 1 + 4: {page}");
    clean(&host);
}

#[test]
fn the_export_is_bounded_and_counts_what_the_ring_overwrote() {
    let (mut host, vms) = envoy(2, &json!({"max_batch_entries": 3}), &json!({"ring_entries": 16}));
    let (_, start, _, _) = export(&mut host, vms[0], None);
    assert_eq!(start, 0);
    for i in 0..20 {
        let (s, _) = route(&mut host, vms[i % 2], &prompt(&format!("p{i}-")), &[]).unwrap();
        host.finish_stream(s).unwrap();
    }
    // 40 entries were written since cursor 0; the ring holds 16: 24 are lost to the export.
    let (b, next, lost, more) = export(&mut host, vms[1], Some(0));
    assert_eq!((lost, b.entries.len(), more), (24, 3, true));
    assert_eq!(next, 24 + 3);
    let mut cursor = next;
    let mut read = 3;
    loop {
        let (b, next, lost, more) = export(&mut host, vms[0], Some(cursor));
        assert_eq!(lost, 0);
        read += b.entries.len();
        cursor = next;
        if !more {
            break;
        }
    }
    assert_eq!((read, cursor), (16, 40));
    let page = stats(&mut host, vms[1]).unwrap();
    assert_eq!(stat(&page, "kvroute_wasm_replica_out_lost_total"), Some(24.0), "{page}");
    clean(&host);
}

/// A router standing for another replica (same policy and endpoints), its decisions' effects
/// encoded as that replica would publish them.
fn remote_router() -> RouterCore {
    let mut r = RouterCore::new(Policy::default());
    r.record_effects(true);
    for ep in [A, B] {
        r.upsert_endpoint(EndpointSpec::new(ep, Role::Decode)).unwrap();
    }
    r
}

#[test]
fn another_replicas_batch_is_applied_by_every_vm() {
    let (mut host, vms) = envoy(3, &json!({}), &json!({}));
    let mut remote = remote_router();
    let d = remote.route_http(&prompt("remote"), Vec::<(&str, &str)>::new(), now_ms(&host)).unwrap();
    let fx = d.effect.clone().unwrap().encode();
    let target = d.effect.as_ref().unwrap().target.to_string();
    let batch = |seq, entries: &[ReplicaEntryRef<'_>]| {
        ReplicaBatch::encode_entries(FLEET, "envoy-2", 7, seq, 0, entries).unwrap()
    };
    let one = batch(1, &[ReplicaEntryRef::EncodedEffect(&fx)]);
    let (status, body) = replica_in(&mut host, vms[0], &one, REPLICA_SECRET).unwrap();
    assert_eq!((status, &body), (200, &json!({"verdict": "applied", "effects": 1, "completions": 0, "skipped": 0})));
    // Every VM counts it in flight and finds its prompt cached where the other replica sent it.
    for vm in &vms {
        let page = stats(&mut host, *vm).unwrap();
        assert_eq!(inflight_total(&page), 1.0, "{page}");
        assert_eq!(stat(&page, "kvroute_wasm_replica_effects_applied_total"), Some(1.0), "{page}");
        assert_eq!(stat(&page, "kvroute_wasm_replica_peers"), Some(1.0));
    }
    // The same batch again (a NATS redelivery, a replayed post): ignored, nothing doubled.
    let (status, body) = replica_in(&mut host, vms[1], &one, REPLICA_SECRET).unwrap();
    assert_eq!((status, body["verdict"].as_str()), (200, Some("ignored")));
    // This Envoy's own batch coming back: ignored.
    let own = ReplicaBatch::encode_entries(FLEET, ME, 1, 1, 0, &[ReplicaEntryRef::EncodedEffect(&fx)]).unwrap();
    assert_eq!(replica_in(&mut host, vms[1], &own, REPLICA_SECRET).unwrap().1["verdict"], "ignored");
    // Another fleet's: ignored.
    let other = ReplicaBatch::encode_entries("fleet-2", "x", 1, 1, 0, &[ReplicaEntryRef::EncodedEffect(&fx)]).unwrap();
    assert_eq!(replica_in(&mut host, vms[1], &other, REPLICA_SECRET).unwrap().1["verdict"], "ignored");
    for vm in &vms {
        assert_eq!(inflight_total(&stats(&mut host, *vm).unwrap()), 1.0);
    }
    // The completion, posted to another VM: released everywhere.
    let two = batch(2, &[ReplicaEntryRef::Complete(&d.request_id)]);
    assert_eq!(replica_in(&mut host, vms[2], &two, REPLICA_SECRET).unwrap().1["completions"], 1);
    for vm in &vms {
        let page = stats(&mut host, *vm).unwrap();
        assert_eq!(inflight_total(&page), 0.0, "{page}");
        assert_eq!(stat(&page, "kvroute_wasm_replica_completions_applied_total"), Some(1.0));
    }
    let page = stats(&mut host, vms[1]).unwrap();
    assert_eq!(stat(&page, "kvroute_wasm_replica_in_ignored_total"), Some(3.0), "{page}");
    // The prompt is cached where the other replica sent it, on every VM.
    for vm in &vms {
        let (s, o) = route(&mut host, *vm, &prompt("remote"), &[]).unwrap();
        let dec = o.decision.unwrap();
        assert!(score(&dec, &target)["matched_blocks"].as_u64().unwrap() > 0, "{dec}");
        assert_eq!(dec["endpoint"], target.as_str());
        host.finish_stream(s).unwrap();
    }
    // A VM started later catches up from the log.
    let filter = host.load_kvroute_filter().unwrap();
    let mut extra = replica_extra(FLEET, ME, &json!({}));
    extra["sync"] = json!({});
    let cfg = plugin_config(&json!({}), &[(A, "decode"), (B, "decode")], &extra);
    let late = host.start_vm(&filter, vm_config(&cfg)).unwrap();
    let page = stats(&mut host, late).unwrap();
    assert_eq!(stat(&page, "kvroute_wasm_replica_batches_applied_total"), Some(2.0), "{page}");
    // Remote batches are not exported again (no echo between replicas): only this Envoy's three
    // requests and their completions.
    let (b, _, _, _) = export(&mut host, vms[0], None);
    let (fx, done) = ids(&b);
    assert_eq!((fx.len(), done.len()), (3, 3), "{fx:?} {done:?}");
    clean(&host);
}

#[test]
fn a_malformed_or_oversized_batch_is_refused_whole() {
    let (mut host, vms) = envoy(2, &json!({"max_batch_bytes": 4096}), &json!({}));
    let mut remote = remote_router();
    let d = remote.route_http(&prompt("remote"), Vec::<(&str, &str)>::new(), now_ms(&host)).unwrap();
    let fx = d.effect.unwrap().encode();
    let good = ReplicaBatch::encode_entries(FLEET, "envoy-2", 7, 1, 0, &[ReplicaEntryRef::EncodedEffect(&fx)]).unwrap();
    // A valid effect followed by a bad one: nothing of the batch may be applied.
    let half = ReplicaBatch::encode_entries(
        FLEET,
        "envoy-2",
        7,
        1,
        0,
        &[ReplicaEntryRef::EncodedEffect(&fx), ReplicaEntryRef::EncodedEffect(b"junk")],
    )
    .unwrap();
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    let mut trailing = good.clone();
    trailing.push(0);
    for (what, body) in [
        ("truncated", good[..good.len() - 1].to_vec()),
        ("bad entry after a good one", half),
        ("bad magic", bad_magic),
        ("trailing bytes", trailing),
        ("empty", Vec::new()),
        ("not a batch", b"{\"json\": true}".to_vec()),
    ] {
        let (status, body) = replica_in(&mut host, vms[0], &body, REPLICA_SECRET).unwrap();
        assert_eq!((status, body["error"].as_str()), (400, Some("malformed")), "{what}: {body}");
    }
    let (status, _) = replica_in(&mut host, vms[0], &vec![0u8; 5000], REPLICA_SECRET).unwrap();
    assert_eq!(status, 413);
    for vm in &vms {
        let page = stats(&mut host, *vm).unwrap();
        assert_eq!(inflight_total(&page), 0.0, "{page}");
        assert_eq!(stat(&page, "kvroute_wasm_replica_effects_applied_total"), Some(0.0));
    }
    let page = stats(&mut host, vms[0]).unwrap();
    assert_eq!(stat(&page, "kvroute_wasm_replica_rejected_total"), Some(7.0), "{page}");
    // The good batch still applies afterwards.
    assert_eq!(replica_in(&mut host, vms[0], &good, REPLICA_SECRET).unwrap().1["effects"], 1);
    assert_eq!(inflight_total(&stats(&mut host, vms[1]).unwrap()), 1.0);
    clean(&host);
}

#[test]
fn without_a_replica_section_the_routes_are_ordinary_requests() {
    let mut host = host(&Pages::default()).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let cfg = plugin_config(&json!({}), &[(A, "decode"), (B, "decode")], &json!({}));
    let vm = host.start_vm(&filter, vm_config(&cfg)).unwrap();
    let (status, _, _) = replica_out(&mut host, vm, None, REPLICA_SECRET).unwrap();
    assert_eq!(status, 0, "not answered by the filter (Envoy's /kvroute/ route answers 503)");
    clean(&host);
}

/// The filter reads a body with the direct reader of `kvroute::request` (wasm32 only: 32 bytes
/// of a string at a time with simd128) where the native core uses serde_json: the block keys of
/// its decisions (in its export) must be the native core's, for prompts and chat contents with
/// escapes, multi-byte text and JSON's special bytes at every offset around the reader's steps.
#[test]
fn the_filters_block_keys_are_the_native_cores_for_every_string_form() {
    let (mut host, vms) = envoy(1, &json!({}), &json!({}));
    let vm = vms[0];
    let mut native = remote_router();
    let filler: String = (0..90).map(|i| format!("w{i} ")).collect();
    let specials = [r"\n", r#"\""#, r"\\", r"\/", r"\u00e9", r"\ud83d\ude00", "é", "日本", "😀", r"\t\r\b\f", "x"];
    let mut bodies = Vec::new();
    for (k, special) in specials.iter().enumerate() {
        for at in 0..70 {
            let text = format!("{}{special}{filler}{special}{}", "a".repeat(at), "b".repeat(k * 7));
            let body = if at % 2 == 0 {
                format!(r#"{{"model":"m","prompt":"{text}","max_tokens":{at}}}"#)
            } else {
                format!(
                    r#"{{"model":"m","messages":[{{"role":"system","content":"{text}"}},{{"role":"user","content":"q{special}{at}","name":"n{special}"}}]}}"#
                )
            };
            bodies.push(body.into_bytes());
        }
    }
    let (mut want, mut got, mut cursor) = (Vec::new(), Vec::new(), None);
    for (i, body) in bodies.iter().enumerate() {
        let d = native.route_http(body, Vec::<(&str, &str)>::new(), now_ms(&host)).unwrap();
        native.complete(&d.request_id).unwrap();
        want.push(d.effect.unwrap().approx_keys.clone());
        let (s, o) = route(&mut host, vm, body, &[]).unwrap();
        assert!(o.upstream.is_some(), "{}", String::from_utf8_lossy(body));
        host.finish_stream(s).unwrap();
        // Read the export before the ring wraps.
        if i % 64 == 63 || i + 1 == bodies.len() {
            loop {
                let (batch, next, lost, more) = export(&mut host, vm, cursor);
                assert_eq!(lost, 0);
                for e in batch.entries {
                    if let ReplicaEntry::Effect(f) = e {
                        got.push(f.approx_keys);
                    }
                }
                cursor = Some(next);
                if !more {
                    break;
                }
            }
        }
    }
    assert_eq!(got.len(), bodies.len());
    for ((g, w), body) in got.iter().zip(&want).zip(&bodies) {
        assert!(!w.is_empty());
        assert_eq!(g, w, "{}", String::from_utf8_lossy(body));
    }
    clean(&host);
}
