//! The event endpoint's credentials and the stats page: no `x-kvroute-*` request header is ever
//! forwarded upstream (near-miss paths of the event path included), event posts are bound to
//! their content by an HMAC signature with a timestamp (a captured post cannot be re-sent with
//! another sequence number, after the window, or twice), unsigned posts are refused unless the
//! configuration allows them, and the stats page can require a secret.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kvroute_filter::ingest;
use kvroute_wasm_tests::*;
use serde_json::{json, Value};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";

fn start(extra: &Value) -> (Host, VmId, Vec<u8>) {
    let case = golden_case("41_precise_event_fed_hit");
    let steps = case["steps"].as_array().unwrap();
    let mut host = host(&Pages::default()).unwrap();
    let filter = host.load_kvroute_filter().unwrap();
    let cfg = plugin_config(&case["policy"], &[(A, "decode"), (B, "decode")], extra);
    let vm = host.start_vm(&filter, vm_config(&cfg)).unwrap();
    (host, vm, hex(steps[2]["payload_hex"].as_str().unwrap()))
}

fn send_owned(host: &mut Host, vm: VmId, headers: &[(String, String)], body: &[u8]) -> Stream {
    let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    host.round_trip(vm, &HttpMessage::new(h, body.to_vec()), None).unwrap()
}

fn set(headers: &mut [(String, String)], name: &str, value: &str) {
    for (k, v) in headers.iter_mut() {
        if k == name {
            *v = value.to_owned();
        }
    }
}

#[test]
fn no_kvroute_header_is_forwarded_upstream_whatever_the_path() {
    let (mut host, vm, batch) = start(&json!({}));
    let body = br#"{"model": "m", "prompt": "hello"}"#;
    let signed = signed_event_headers(&host, SECRET, B, "batch", Some(0), &batch);
    let credentials: Vec<(&str, &str)> = signed
        .iter()
        .filter(|(k, _)| k.starts_with("x-kvroute-"))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .chain([
            ("x-kvroute-secret", SECRET),
            ("x-kvroute-stats-secret", "stats-secret-0123456789"),
            ("X-KVROUTE-Custom", "x"),
            ("x-kvroute-fallback", "forged"),
            ("x-kvroute-mode", "forged"),
        ])
        .collect();
    let paths = [
        "/kvroute/v1/events/",
        "/KVROUTE/v1/events",
        "/kvroute/v1/Events",
        "//kvroute/v1/events",
        "/kvroute/v1/events/../events",
        "/kvroute/v1/events%2F",
        "/v1/completions",
        "/kvroute/v1/stats/",
    ];
    for path in paths {
        for method in ["POST", "GET"] {
            let mut h = vec![(":method", method), (":path", path), (":authority", "llm.local"), (":scheme", "http")];
            h.extend_from_slice(&credentials);
            let b: &[u8] = if method == "POST" { body } else { b"" };
            let st = host.round_trip(vm, &HttpMessage::new(h, b.to_vec()), None).unwrap();
            let Some(up) = st.upstream_headers() else { continue };
            let leaked: Vec<(String, String)> = up
                .to_pairs()
                .into_iter()
                .filter(|(k, v)| {
                    k.starts_with("x-kvroute-")
                        && !matches!(
                            k.as_str(),
                            "x-kvroute-mode" | "x-kvroute-decision" | "x-kvroute-fallback" | "x-kvroute-score"
                        )
                        || v == "forged"
                })
                .collect();
            assert!(leaked.is_empty(), "{method} {path} forwarded {leaked:?}");
            assert_eq!(up.get("x-kvroute-secret"), None);
            assert_eq!(up.get("x-kvroute-signature"), None);
        }
    }
    // A query string on the event path is still the event path: answered locally.
    let mut h = signed.clone();
    set(&mut h, ":path", "/kvroute/v1/events?x=1");
    let st = send_owned(&mut host, vm, &h, &batch);
    assert!(st.upstream_headers().is_none());
    assert_eq!(answer(&st).0, 200, "{:?}", answer(&st));
    assert_eq!(host.failure(vm).unwrap(), None);
    assert!(host.abi_violations().is_empty(), "{:#?}", &*host.abi_violations());
}

#[test]
fn a_captured_post_cannot_be_replayed_with_a_new_sequence_nor_after_the_window() {
    let (mut host, vm, batch) = start(&json!({}));
    let captured = signed_event_headers(&host, SECRET, B, "batch", Some(0), &batch);
    let st = send_owned(&mut host, vm, &captured, &batch);
    assert_eq!((answer(&st).0, answer(&st).1["verdict"].as_str()), (200, Some("applied")));

    // The same post with a new sequence number (or endpoint, or kind, or body): refused.
    for (name, value) in [("x-kvroute-seq", "1"), ("x-kvroute-seq", "7"), ("x-kvroute-endpoint", A)] {
        let mut h = captured.clone();
        set(&mut h, name, value);
        let (status, a) = answer(&send_owned(&mut host, vm, &h, &batch));
        assert_eq!((status, a["error"].as_str()), (401, Some("unauthorized")), "{name}: {value}");
    }
    let mut h = captured.clone();
    set(&mut h, "x-kvroute-kind", "resync");
    assert_eq!(answer(&send_owned(&mut host, vm, &h, &[])).0, 401, "as a resync");
    let mut tampered = batch.clone();
    if let Some(last) = tampered.last_mut() {
        *last ^= 1;
    }
    assert_eq!(answer(&send_owned(&mut host, vm, &captured, &tampered)).0, 401, "another body");
    // A new timestamp without a new signature: refused.
    let mut h = captured.clone();
    set(&mut h, "x-kvroute-timestamp", &(now_ms(&host) + 1).to_string());
    assert_eq!(answer(&send_owned(&mut host, vm, &h, &batch)).0, 401);

    // As it was, within the window: a replay of an accepted signature.
    let (status, a) = answer(&send_owned(&mut host, vm, &captured, &batch));
    assert_eq!((status, a["error"].as_str()), (401, Some("replayed")));
    // After the window (30 s by default): stale.
    host.advance(Duration::from_millis(30_001)).unwrap();
    let (status, a) = answer(&send_owned(&mut host, vm, &captured, &batch));
    assert_eq!((status, a["error"].as_str()), (401, Some("stale")));
    // A post stamped in the future beyond the window: stale too.
    let ahead = now_ms(&host) + 30_001;
    let mut h = captured.clone();
    set(&mut h, "x-kvroute-timestamp", &ahead.to_string());
    let sig = ingest::signature(SECRET.as_bytes(), B, "batch", Some(0), ahead, &batch);
    set(&mut h, "x-kvroute-signature", &sig);
    assert_eq!(answer(&send_owned(&mut host, vm, &h, &batch)).1["error"], "stale");

    // A captured resync notice (no sequence number) is accepted once.
    let resync = signed_event_headers(&host, SECRET, B, "resync", None, &[]);
    assert_eq!(answer(&send_owned(&mut host, vm, &resync, &[])), (200, json!({"verdict": "resynced"})));
    let (status, a) = answer(&send_owned(&mut host, vm, &resync, &[]));
    assert_eq!((status, a["error"].as_str()), (401, Some("replayed")));
    // So is an unnumbered batch.
    let unnumbered = signed_event_headers(&host, SECRET, B, "batch", None, &batch);
    assert_eq!(answer(&send_owned(&mut host, vm, &unnumbered, &batch)).0, 200);
    assert_eq!(answer(&send_owned(&mut host, vm, &unnumbered, &batch)).1["error"], "replayed");

    let p = stats(&mut host, vm).unwrap();
    assert_eq!(stat(&p, "kvroute_wasm_event_unauthorized_total"), Some(11.0), "{p}");
    assert_eq!(host.failure(vm).unwrap(), None);
    assert!(host.abi_violations().is_empty(), "{:#?}", &*host.abi_violations());
}

#[test]
fn a_signature_respelt_is_the_same_signature_and_garbage_is_refused() {
    let (mut host, vm, batch) = start(&json!({}));
    // Garbage where the signature or timestamp belongs: 401, nothing applied.
    for (name, value) in [
        ("x-kvroute-signature", "zz"),
        ("x-kvroute-signature", ""),
        ("x-kvroute-signature", "é"),
        ("x-kvroute-timestamp", "soon"),
        ("x-kvroute-timestamp", "99999999999999999999999"),
    ] {
        let mut h = signed_event_headers(&host, SECRET, B, "batch", Some(0), &batch);
        set(&mut h, name, value);
        let (status, a) = answer(&send_owned(&mut host, vm, &h, &batch));
        assert_eq!((status, a["error"].as_str()), (401, Some("unauthorized")), "{name}: {value:?}");
    }
    let p = stats(&mut host, vm).unwrap();
    assert_eq!(stat(&p, "kvroute_event_blocks_stored_total").unwrap_or(0.0), 0.0, "{p}");
    // An accepted resync notice, sent again with its signature spelt another way (upper case; a
    // sign where a leading 0 digit was, which a lenient hex reader decodes to the same byte):
    // never accepted twice. The clock moves until the signature has a byte whose hex starts
    // with 0.
    let (h, sig) = loop {
        let h = signed_event_headers(&host, SECRET, B, "resync", None, &[]);
        let sig = h.iter().find(|(k, _)| k == "x-kvroute-signature").unwrap().1.clone();
        if (0..32).any(|i| sig.as_bytes()[2 * i] == b'0') {
            break (h, sig);
        }
        host.advance(Duration::from_millis(1)).unwrap();
    };
    assert_eq!(answer(&send_owned(&mut host, vm, &h, &[])).0, 200);
    let i = (0..32).find(|i| sig.as_bytes()[2 * i] == b'0').unwrap();
    let plus = format!("{}+{}", &sig[..2 * i], &sig[2 * i + 1..]);
    for respelt in [sig.to_ascii_uppercase(), plus, format!(" {sig}")] {
        let mut again = h.clone();
        set(&mut again, "x-kvroute-signature", &respelt);
        let (status, a) = answer(&send_owned(&mut host, vm, &again, &[]));
        assert_eq!(status, 401, "{respelt:?} accepted again: {a}");
    }
    assert_eq!(host.failure(vm).unwrap(), None);
}

#[test]
fn unsigned_posts_are_refused_unless_the_configuration_allows_them() {
    let unsigned = |batch: &[u8]| -> (Vec<(String, String)>, Vec<u8>) {
        let h = [
            (":method", "POST"),
            (":path", EVENTS_PATH),
            (":authority", "llm.local"),
            ("x-kvroute-secret", SECRET),
            ("x-kvroute-endpoint", B),
            ("x-kvroute-seq", "0"),
        ];
        (h.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(), batch.to_vec())
    };
    let (mut host, vm, batch) = start(&json!({}));
    let (h, b) = unsigned(&batch);
    let (status, a) = answer(&send_owned(&mut host, vm, &h, &b));
    assert_eq!((status, a["error"].as_str()), (401, Some("unauthorized")), "{a}");
    assert!(a["detail"].as_str().unwrap().contains("x-kvroute-signature required"));

    let (mut host, vm, batch) =
        start(&json!({"events": {"path": EVENTS_PATH, "secret": SECRET, "allow_unsigned": true}}));
    let (mut h, b) = unsigned(&batch);
    set(&mut h, "x-kvroute-secret", "wrong-secret-0123456789");
    assert_eq!(answer(&send_owned(&mut host, vm, &h, &b)).0, 401);
    let (h, b) = unsigned(&batch);
    let (status, a) = answer(&send_owned(&mut host, vm, &h, &b));
    assert_eq!((status, a["verdict"].as_str()), (200, Some("applied")));
    // Signed posts are still verified.
    let mut h = signed_event_headers(&host, SECRET, B, "batch", Some(1), &batch);
    set(&mut h, "x-kvroute-seq", "2");
    assert_eq!(answer(&send_owned(&mut host, vm, &h, &batch)).0, 401);
}

#[test]
fn the_stats_page_can_require_a_secret() {
    const STATS_SECRET: &str = "stats-secret-0123456789";
    let (mut host, vm, _) = start(&json!({"stats_secret": STATS_SECRET}));
    let get = |host: &mut Host, secret: Option<&str>| {
        let mut h = vec![(":method", "GET"), (":path", STATS_PATH), (":authority", "llm.local")];
        if let Some(s) = secret {
            h.push(("x-kvroute-stats-secret", s));
        }
        let st = host.round_trip(vm, &HttpMessage::new(h, Vec::new()), None).unwrap();
        let l = st.local_reply().cloned();
        (st.upstream_headers().is_some(), l.map(|l| (l.status, String::from_utf8_lossy(&l.body).into_owned())))
    };
    for wrong in [None, Some(""), Some("stats-secret-012345678"), Some(SECRET)] {
        let (upstream, reply) = get(&mut host, wrong);
        assert!(!upstream, "{wrong:?}");
        let (status, body) = reply.unwrap();
        assert_eq!(status, 401, "{wrong:?}: {body}");
        assert!(!body.contains("kvroute_wasm_"), "{wrong:?}");
    }
    let (upstream, reply) = get(&mut host, Some(STATS_SECRET));
    let (status, body) = reply.unwrap();
    assert_eq!((upstream, status), (false, 200));
    assert!(body.contains("kvroute_wasm_requests_total"), "{body}");
    // Without `stats_secret`, the page is open (as before).
    let (mut host, vm, _) = start(&json!({}));
    assert!(stats(&mut host, vm).unwrap().contains("kvroute_wasm_requests_total"));
}
