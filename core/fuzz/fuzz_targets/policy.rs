//! Fuzz the policy parser: arbitrary text as a policy (JSON, or YAML when it does not start with
//! `{`). On success the normalized JSON parses back to the same policy (round trip), the policy
//! reloads into a router with state, and that router still routes (unless it reserves more than
//! a million index blocks: see below). Invariants: no panic, every rejection a typed
//! `ConfigError`.
//!
//! Run (from core/fuzz): `RUSTC_BOOTSTRAP=1 cargo fuzz run policy corpus/policy seeds/policy
//! -- -dict=policy.dict -max_total_time=600`
#![no_main]

mod common;

use kvroute::Policy;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let p = match Policy::from_str_auto(text) {
        Ok(p) => p,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let json = p.to_json_pretty();
    let again =
        Policy::from_json(&json).unwrap_or_else(|e| panic!("the normalized policy does not parse: {e}\n{json}"));
    assert_eq!(again, p, "round trip changed the policy:\n{json}");
    assert_eq!(again.to_json_pretty(), json);

    // A valid policy may reserve up to 2^27 blocks per index, which a router holds at once
    // (2.2 GB for each): past a million the policy is checked up to here, within the fuzzer's
    // memory limit.
    let i = &p.config().index;
    if i.reserve_blocks.max(i.precise.reserve_blocks) > 1 << 20 {
        return;
    }
    let r = common::router(2, true);
    let before = r.stats().policy_version;
    let version = r.reload(p);
    assert!(version > before);
    // And through the text entry point too.
    let v2 = r.reload_str(&json).unwrap_or_else(|e| panic!("reload_str of the normalized policy: {e}"));
    assert!(v2 > version);
    let body = br#"{"model": "m", "prompt": "the quick brown fox jumps over the lazy dog", "max_tokens": 8}"#;
    let d = r.route_http(body, [("x-session-id", "s1")], 1_000);
    common::check(&r, d);
    assert_eq!(r.stats().inflight_requests, 0);
});
