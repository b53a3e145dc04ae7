//! Hot reload under traffic: every decision is made by exactly one policy version, invalid configs
//! are rejected without disturbing the active one, and nothing panics.
#![allow(clippy::unwrap_used, clippy::expect_used)]
// Sans-IO is the library's rule (core/clippy.toml): this test file routes and reloads from
// several threads at once.
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;

use kvroute::{ConfigError, EndpointSpec, Policy, Role, Router, Rule};

/// Config A: short prompts take the colocated fast path, the debug header is on. (Both configs
/// close the decode-direct bypass with a zero KV ceiling, so repeated prompts do not take it.)
const A: &str =
    r#"{"modes":{"colocated_input_max_tokens":100000,"decode_kv_ceiling":0.0},"request":{"debug_header":true}}"#;
/// Config B: the fast path is closed (no prefill pool → no_prefill_pool), no debug header, and a
/// different hashing seed, so every swap to or from B also resets the index.
const B: &str = "modes:\n  colocated_input_max_tokens: 1\n  decode_kv_ceiling: 0.0\nindex:\n  hash_seed: 77\n";

const INVALID: [&str; 5] = [
    r#"{"modes":{"bypass_prefix_hit":2}}"#,
    r#"{"modes":"#,
    "index:\n  block_tokens: 0\n",
    r#"{"scoring":{"weights":{"prefx":1}}}"#,
    r#"{"limits":{"max_endpoints":999999}}"#,
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    A,
    B,
}

#[test]
fn decisions_are_consistent_with_one_version_under_reload_storm() {
    let router = Arc::new(Router::new(Policy::from_json(A).unwrap()));
    for i in 1..=4 {
        router.upsert_endpoint(EndpointSpec::new(format!("10.0.0.{i}:8000"), Role::Decode)).unwrap();
    }
    let versions: Arc<Mutex<BTreeMap<u64, Kind>>> = Arc::new(Mutex::new(BTreeMap::from([(1, Kind::A)])));
    let done = Arc::new(AtomicBool::new(false));

    let mut routers = Vec::new();
    for t in 0..4 {
        let router = router.clone();
        let done = done.clone();
        routers.push(thread::spawn(move || {
            let mut seen = Vec::new();
            let mut n = 0u64;
            let prompt_base = "shared system prompt for the reload test ".repeat(30);
            while !done.load(Ordering::Relaxed) || n < 200 {
                let body =
                    format!(r#"{{"model":"m","prompt":"{prompt_base} thread {t} request {}","max_tokens":20}}"#, n % 7);
                let d = router.route_http(body.as_bytes(), [("x-session-id", "s")], n).unwrap();
                seen.push((d.policy_version, d.rule, d.header("x-kvroute-score").is_some()));
                router.complete(&d.request_id).unwrap();
                n += 1;
            }
            seen
        }));
    }

    let reloader = {
        let router = router.clone();
        let versions = versions.clone();
        thread::spawn(move || {
            let mut ok = 0;
            for i in 0..2000 {
                if i % 2 == 0 {
                    let kind = if i % 4 == 0 { Kind::B } else { Kind::A };
                    let text = if kind == Kind::A { A } else { B };
                    // Record the version before anyone can observe it: reload assigns
                    // current + 1 and only this thread reloads.
                    let next = router.policy().version + 1;
                    versions.lock().unwrap().insert(next, kind);
                    let v = router.reload_str(text).unwrap();
                    assert_eq!(v, next);
                    ok += 1;
                } else {
                    let before = router.policy().version;
                    let bad = INVALID[(i / 2) % INVALID.len()];
                    let err = router.reload_str(bad).unwrap_err();
                    assert!(matches!(err, ConfigError::Parse { .. } | ConfigError::Invalid { .. }));
                    assert_eq!(router.policy().version, before, "a rejected config changes nothing");
                }
            }
            ok
        })
    };
    let ok_reloads = reloader.join().unwrap();
    done.store(true, Ordering::Relaxed);

    let versions = versions.lock().unwrap().clone();
    let mut total = 0;
    let mut by_kind = [0usize; 2];
    for h in routers {
        let seen = h.join().unwrap();
        let mut last = 0;
        for (version, rule, debug_header) in seen {
            assert!(version >= last, "a thread never sees an older policy after a newer one");
            last = version;
            let kind = versions[&version];
            match kind {
                Kind::A => {
                    assert_eq!(rule, Rule::ColocatedFastPath, "version {version} is A");
                    assert!(debug_header, "version {version} is A: debug header on");
                }
                Kind::B => {
                    assert_eq!(rule, Rule::NoPrefillPool, "version {version} is B");
                    assert!(!debug_header, "version {version} is B: debug header off");
                }
            }
            by_kind[kind as usize] += 1;
            total += 1;
        }
    }
    assert_eq!(ok_reloads, 1000);
    let stats = router.stats();
    assert_eq!(stats.counters.reloads, 1000);
    assert_eq!(stats.counters.reload_failures, 1000);
    assert_eq!(stats.policy_version, 1001);
    assert!(stats.counters.index_resets >= 999, "every A<->B swap resets the index");
    assert!(total >= 800);
    assert!(by_kind[0] > 0 && by_kind[1] > 0, "both policies served traffic: {by_kind:?}");
    assert!(router.endpoints().iter().all(|e| e.inflight == 0), "no in-flight count lost");
}

#[test]
fn index_survives_a_reload_that_keeps_hashing_and_resets_when_hashing_changes() {
    let router = Router::default();
    router.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode)).unwrap();
    router.upsert_endpoint(EndpointSpec::new("10.0.0.2:8000", Role::Decode)).unwrap();
    let body = format!(r#"{{"model":"m","prompt":"{}","max_tokens":500}}"#, "abcd".repeat(64 * 20));
    let first = router.route_http(body.as_bytes(), [("a", "b")], 0).unwrap();
    router.complete(&first.request_id).unwrap();

    router.reload_str(r#"{"modes":{"bypass_prefix_hit":0.95}}"#).unwrap();
    let d = router.route_http(body.as_bytes(), [("a", "b")], 1).unwrap();
    router.complete(&d.request_id).unwrap();
    assert_eq!(d.prefix_hit, 1.0, "same hashing: entries kept");
    assert_eq!(d.endpoint(), first.endpoint());
    assert_eq!(router.stats().counters.index_resets, 0);

    router.reload_str(r#"{"index":{"block_tokens":32}}"#).unwrap();
    let d = router.route_http(body.as_bytes(), [("a", "b")], 2).unwrap();
    assert_eq!(d.prefix_hit, 0.0, "new hashing: old keys are gone");
    assert_eq!(router.stats().counters.index_resets, 1);
    assert_eq!(d.policy_version, 3);

    // Shrinking the budget keeps entries up to the new capacity.
    router.reload_str(r#"{"index":{"block_tokens":32,"capacity_bytes_per_endpoint":4096}}"#).unwrap();
    assert!(router.endpoints().iter().all(|e| e.index_memberships <= 256));
}

/// `index.reserve_blocks` and `index.precise.reserve_blocks` size both indexes when the router
/// starts and again when a reload changes them (a smaller one gives the room back); a value past
/// the limit is rejected and changes nothing; routing is the same with or without a reservation,
/// and a reload that changes only the reservation keeps the index's entries.
#[test]
fn index_reservations_size_the_indexes_at_start_and_at_reload() {
    const BOTH: &str = r#"{"index":{"reserve_blocks":100000,"precise":{"reserve_blocks":50000}}}"#;
    let plain = Router::default();
    let reserved = Router::new(Policy::from_json(BOTH).unwrap());
    let (p, r) = (plain.stats(), reserved.stats());
    assert!(p.index.memory_bytes < 20_000, "no reservation: {} bytes", p.index.memory_bytes);
    assert!(r.index.memory_bytes >= 100_000 * 16, "approximate: {} bytes", r.index.memory_bytes);
    assert!(r.precise.index.memory_bytes >= 50_000 * 16, "precise, per copy: {} bytes", r.precise.index.memory_bytes);
    assert!(p.precise.index.memory_bytes < 20_000);

    let body = |k: usize| format!(r#"{{"model":"m","prompt":"{} {k}","max_tokens":500}}"#, "abcd".repeat(64 * 20));
    let route = |router: &Router, k: usize, now: u64| {
        let d = router.route_http(body(k % 3).as_bytes(), [("a", "b")], now).unwrap();
        router.complete(&d.request_id).unwrap();
        (d.endpoint().map(str::to_owned), d.prefix_hit)
    };
    for router in [&plain, &reserved] {
        for i in 1..=3 {
            router.upsert_endpoint(EndpointSpec::new(format!("10.0.0.{i}:8000"), Role::Decode)).unwrap();
        }
    }
    for k in 0..12 {
        assert_eq!(route(&plain, k, k as u64), route(&reserved, k, k as u64), "request {k}");
    }

    // Lowering the approximate reservation gives its room back; the entries stay.
    let v = reserved.reload_str(r#"{"index":{"precise":{"reserve_blocks":50000}}}"#).unwrap();
    let s = reserved.stats();
    assert!(s.index.memory_bytes < 20_000, "{} bytes after the reload", s.index.memory_bytes);
    assert!(s.precise.index.memory_bytes >= 50_000 * 16, "the precise one keeps its own");
    assert_eq!(route(&reserved, 0, 20).1, 1.0, "entries kept");

    let before = reserved.stats();
    for (text, field) in [
        (r#"{"index":{"reserve_blocks":134217726}}"#, "index.reserve_blocks"),
        (r#"{"index":{"precise":{"reserve_blocks":18446744073709551615}}}"#, "index.precise.reserve_blocks"),
    ] {
        match reserved.reload_str(text) {
            Err(ConfigError::Invalid { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{text}: {other:?}"),
        }
        assert_eq!(reserved.policy().version, v, "a rejected reservation changes nothing");
    }
    // Wrong types and malformed values: typed errors too, naming the field.
    for text in [
        r#"{"index":{"reserve_blocks":-1}}"#,
        r#"{"index":{"reserve_blocks":"many"}}"#,
        r#"{"index":{"reserve_blocks":1.5}}"#,
        r#"{"index":{"precise":{"reserve_blocks":null}}}"#,
        r#"{"index":{"reserve_blocks":1e30}}"#,
        "index:\n  reserve_blocks: [1]\n",
    ] {
        let e = reserved.reload_str(text).expect_err(text);
        assert!(e.to_string().contains("reserve_blocks"), "{text}: {e}");
        assert_eq!(reserved.policy().version, v, "{text} changes nothing");
    }
    let after = reserved.stats();
    assert_eq!(
        (after.index.memory_bytes, after.precise.index.memory_bytes, after.counters.reload_failures),
        (before.index.memory_bytes, before.precise.index.memory_bytes, before.counters.reload_failures + 8),
        "the indexes as they were; every rejection counted"
    );
    assert_eq!(kvroute::MAX_RESERVE_BLOCKS, 134_217_725);
    // The limit itself is valid (checked without building a router: it would hold 2.2 GB).
    Policy::from_json(r#"{"index":{"reserve_blocks":134217725,"precise":{"reserve_blocks":134217725}}}"#).unwrap();
    reserved.reload_str(r#"{"index":{"reserve_blocks":200000}}"#).unwrap();
    assert!(reserved.stats().index.memory_bytes >= 200_000 * 16, "raised again");
    assert_eq!(route(&reserved, 0, 21).1, 1.0, "entries kept through the growth");
    reserved.reload_str("{}").unwrap();
    assert!(reserved.stats().index.memory_bytes < 20_000);
    assert!(reserved.stats().precise.index.memory_bytes < 20_000, "and the precise one's");
}
