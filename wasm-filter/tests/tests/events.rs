//! KV-event ingestion through the filter: authenticated POSTs of raw engine batches (msgpack
//! body; endpoint, topic and sequence in headers) to the configured path are applied to the
//! precise index and answered locally; anything wrong is answered with a typed error and applies
//! nothing. Payloads come from the golden fixtures (vLLM's msgpack encoding).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_wasm_tests::*;
use serde_json::Value;

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";

struct Case {
    host: Host,
    vms: [VmId; 2],
    batch: Vec<u8>,
    body: String,
}

fn case() -> Case {
    let case = golden_case("41_precise_event_fed_hit");
    let steps = case["steps"].as_array().unwrap();
    let mut host = host(&Pages::default()).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let cfg = plugin_config(&case["policy"], &[(A, "decode"), (B, "decode")], &serde_json::json!({}));
    let vms = [host.start_vm(&filter, vm_config(&cfg)).unwrap(), host.start_vm(&filter, vm_config(&cfg)).unwrap()];
    Case { host, vms, batch: hex(steps[2]["payload_hex"].as_str().unwrap()), body: steps[3]["body"].to_string() }
}

/// B's matched blocks for the fixture's request, as seen by `vm`.
fn b_blocks(c: &mut Case, vm: usize) -> u64 {
    let vm = c.vms[vm];
    let (s, o) = route(&mut c.host, vm, c.body.as_bytes(), &[]).unwrap();
    c.host.finish_stream(s).unwrap();
    score(&o.decision.unwrap(), B)["matched_blocks"].as_u64().unwrap()
}

fn event_counters(c: &mut Case, vm: usize) -> (f64, f64, f64) {
    let vm = c.vms[vm];
    let p = stats(&mut c.host, vm).unwrap();
    (
        stat(&p, "kvroute_event_batches_total").unwrap(),
        stat(&p, "kvroute_wasm_event_unauthorized_total").unwrap(),
        stat(&p, "kvroute_wasm_event_rejected_total").unwrap(),
    )
}

fn post(c: &mut Case, headers: &[(&str, &str)], body: &[u8]) -> (u32, Value, bool) {
    let st = c.host.round_trip(c.vms[0], &HttpMessage::new(headers.to_vec(), body.to_vec()), None).unwrap();
    let (status, json) = answer(&st);
    (status, json, st.upstream_headers().is_some())
}

#[test]
fn wrong_or_missing_signature_is_401_and_applies_nothing() {
    let mut c = case();
    let batch = c.batch.clone();
    for secret in ["wrong-secret-0123456789", "", "test-secret-012345678", "test-secret-01234567890"] {
        let (status, answer) = post_events(&mut c.host, c.vms[0], B, Some(0), &batch, secret).unwrap();
        assert_eq!((status, answer["error"].as_str()), (401, Some("unauthorized")), "{secret:?}");
    }
    let (status, _, upstream) = post(
        &mut c,
        &[(":method", "POST"), (":path", EVENTS_PATH), (":authority", "x"), ("x-kvroute-endpoint", B)],
        &batch,
    );
    assert_eq!((status, upstream), (401, false), "no secret header at all");
    for vm in 0..2 {
        assert_eq!(b_blocks(&mut c, vm), 0, "nothing applied");
    }
    let (batches, unauthorized, _) = event_counters(&mut c, 0);
    assert_eq!((batches, unauthorized), (0.0, 5.0));
    assert!(c.host.logs().iter().any(|l| l.message.contains("wrong x-kvroute-signature")));
    assert!(c.host.logs().iter().any(|l| l.message.contains("without a valid signature")));
    // The right secret then works, and the stream starts at the batch's sequence.
    let (status, answer) = post_events(&mut c.host, c.vms[0], B, Some(0), &batch, SECRET).unwrap();
    assert_eq!((status, answer["verdict"].as_str()), (200, Some("applied")));
    assert_eq!(b_blocks(&mut c, 1), 64);
    assert!(c.host.abi_violations().is_empty());
}

#[test]
fn malformed_posts_get_typed_errors_and_apply_nothing() {
    let mut c = case();
    let batch = c.batch.clone();
    // Signed as the relay signs (the signature covers endpoint, kind, seq, timestamp and body;
    // a header the filter cannot parse is refused before the signature is checked).
    let ts = now_ms(&c.host).to_string();
    let with = |extra: &[(&'static str, &'static str)], body: &[u8]| -> Vec<(String, String)> {
        let mut h: Vec<(String, String)> = [(":path", EVENTS_PATH), (":authority", "x")]
            .iter()
            .chain(extra)
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let get = |n: &str| extra.iter().find(|(k, _)| *k == n).map(|(_, v)| *v);
        let seq = get("x-kvroute-seq").and_then(|s| s.parse().ok());
        let sig = kvroute_filter::ingest::signature(
            SECRET.as_bytes(),
            get("x-kvroute-endpoint").unwrap_or(""),
            get("x-kvroute-kind").unwrap_or("batch"),
            seq,
            ts.parse().unwrap(),
            body,
        );
        h.push(("x-kvroute-timestamp".into(), ts.clone()));
        h.push(("x-kvroute-signature".into(), sig));
        h
    };
    // (name, headers, body, expected status, expected error)
    type Post<'a> = (&'a str, Vec<(String, String)>, Vec<u8>, u32, &'a str);
    let cases: Vec<Post<'_>> = vec![
        ("GET", with(&[(":method", "GET"), ("x-kvroute-endpoint", B)], &[]), Vec::new(), 405, "method_not_allowed"),
        ("no endpoint", with(&[(":method", "POST")], &batch), batch.clone(), 400, "bad_request"),
        (
            "bad endpoint",
            with(&[(":method", "POST"), ("x-kvroute-endpoint", "not an address")], &batch),
            batch.clone(),
            400,
            "bad_request",
        ),
        (
            "bad seq",
            with(&[(":method", "POST"), ("x-kvroute-endpoint", B), ("x-kvroute-seq", "-1")], &batch),
            batch.clone(),
            400,
            "bad_request",
        ),
        (
            "bad kind",
            with(&[(":method", "POST"), ("x-kvroute-endpoint", B), ("x-kvroute-kind", "drop")], &batch),
            batch.clone(),
            400,
            "bad_request",
        ),
        (
            "unknown endpoint",
            with(&[(":method", "POST"), ("x-kvroute-endpoint", "10.9.9.9:1"), ("x-kvroute-seq", "0")], &batch),
            batch.clone(),
            404,
            "unknown_endpoint",
        ),
        (
            "empty body",
            with(&[(":method", "POST"), ("x-kvroute-endpoint", B), ("x-kvroute-seq", "0")], &[]),
            Vec::new(),
            400,
            "bad_request",
        ),
        (
            "not msgpack",
            with(&[(":method", "POST"), ("x-kvroute-endpoint", B), ("x-kvroute-seq", "0")], b"{\"json\": true}"),
            b"{\"json\": true}".to_vec(),
            400,
            "decode",
        ),
        (
            "truncated",
            with(&[(":method", "POST"), ("x-kvroute-endpoint", B), ("x-kvroute-seq", "0")], &batch[..batch.len() / 2]),
            batch[..batch.len() / 2].to_vec(),
            400,
            "decode",
        ),
    ];
    for (name, headers, body, status, error) in &cases {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let (got, answer, upstream) = post(&mut c, &headers, body);
        assert_eq!((got, answer["error"].as_str()), (*status, Some(*error)), "{name}: {answer}");
        assert!(!upstream, "{name}: event posts never go upstream");
    }
    assert_eq!(b_blocks(&mut c, 0), 0);
    assert_eq!(b_blocks(&mut c, 1), 0);
    let (batches, _, rejected) = event_counters(&mut c, 0);
    assert_eq!((batches, rejected), (0.0, cases.len() as f64));
    assert_eq!(c.host.failure(c.vms[0]).unwrap(), None);
    assert!(c.host.abi_violations().is_empty(), "{:#?}", &*c.host.abi_violations());
}

#[test]
fn oversized_batches_are_refused_with_413() {
    let mut c = case();
    let cfg = plugin_config(
        &golden_case("41_precise_event_fed_hit")["policy"],
        &[(A, "decode"), (B, "decode")],
        &serde_json::json!({"events": {"path": EVENTS_PATH, "secret": SECRET, "max_body_bytes": 64}}),
    );
    assert!(c.host.reconfigure(c.vms[0], cfg).unwrap());
    let batch = c.batch.clone();
    let (status, answer) = post_events(&mut c.host, c.vms[0], B, Some(0), &batch, SECRET).unwrap();
    assert_eq!((status, answer["error"].as_str()), (413, Some("too_large")));
    assert_eq!(b_blocks(&mut c, 0), 0);
}

#[test]
fn sequence_tracking_duplicates_gaps_and_resync() {
    let case = golden_case("44_precise_stream_gap_duplicate_and_resync");
    let steps = case["steps"].as_array().unwrap();
    let mut host = host(&Pages::default()).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let cfg = plugin_config(&case["policy"], &[(A, "decode"), (B, "decode")], &serde_json::json!({}));
    let vms = [host.start_vm(&filter, vm_config(&cfg)).unwrap(), host.start_vm(&filter, vm_config(&cfg)).unwrap()];
    let batch = |i: usize| hex(steps[i]["payload_hex"].as_str().unwrap());
    // Alternate VMs: each sees the stream state the other left.
    let (s, a) = post_events(&mut host, vms[0], A, Some(0), &batch(2), SECRET).unwrap();
    assert_eq!((s, a["verdict"].as_str()), (200, Some("applied")));
    let (s, a) = post_events(&mut host, vms[1], A, Some(0), &batch(3), SECRET).unwrap();
    assert_eq!((s, a["verdict"].as_str()), (200, Some("duplicate")));
    let (s, a) = post_events(&mut host, vms[0], A, Some(5), &batch(4), SECRET).unwrap();
    assert_eq!(
        (s, a["verdict"].as_str(), a["expected"].as_u64(), a["got"].as_u64()),
        (409, Some("gap"), Some(1), Some(5))
    );
    let (s, _) = post_resync(&mut host, vms[1], A).unwrap();
    assert_eq!(s, 200);
    let (s, a) = post_events(&mut host, vms[0], A, Some(5), &batch(4), SECRET).unwrap();
    assert_eq!((s, a["verdict"].as_str()), (200, Some("applied")));
    let p = stats(&mut host, vms[1]).unwrap();
    assert_eq!(stat(&p, "kvroute_event_gaps_total"), Some(1.0), "{p}");
    assert_eq!(stat(&p, "kvroute_event_resyncs_total"), Some(1.0), "{p}");
    assert!(host.abi_violations().is_empty());
}
