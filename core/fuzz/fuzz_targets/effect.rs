//! Fuzz the decoding of routing effects (`RoutingEffect::decode`) and their application by
//! another router instance (`Router::apply_effect`). Byte 0 even: the rest is decoded as is;
//! odd: a real effect (from a decision) is encoded and the rest of the input overwrites some of
//! its bytes (pairs of position, value), so the fingerprints match and application goes deep.
//! Invariants: no panic; a decoded effect re-encodes to bytes that decode to the same effect;
//! applying it is `Ok` or a typed error, routing afterwards works, nothing stays in flight once
//! the effect's request is completed.
//!
//! Run (from core/fuzz): `RUSTC_BOOTSTRAP=1 cargo fuzz run effect corpus/effect seeds/effect
//! -- -max_total_time=600`
#![no_main]

mod common;

use std::sync::OnceLock;

use kvroute::RoutingEffect;
use libfuzzer_sys::fuzz_target;

/// The encoding of an effect of a real decision (hybrid mode, with a session).
fn real_effect() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let r = common::router(2, true);
        r.record_effects(true);
        let body = br#"{"model": "m", "prompt": [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33]}"#;
        let d = r.route_http(body, [("x-session-id", "s1"), ("x-request-id", "r1")], 50);
        match d.ok().and_then(|d| d.effect) {
            Some(e) => e.encode(),
            None => panic!("no effect recorded"),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&how, rest)) = data.split_first() else { return };
    let bytes = if how % 2 == 0 {
        rest.to_vec()
    } else {
        let mut b = real_effect().to_vec();
        for pair in rest.chunks_exact(2) {
            let at = usize::from(pair[0]) % b.len();
            b[at] = pair[1];
        }
        b
    };
    let e = match RoutingEffect::decode(&bytes) {
        Ok(e) => e,
        Err(err) => {
            let _ = err.to_string();
            return;
        }
    };
    let again = RoutingEffect::decode(&e.encode()).unwrap_or_else(|err| panic!("re-encoded effect: {err}"));
    assert_eq!(again, e);

    let r = common::router(2, true);
    if r.apply_effect(&e).is_ok() {
        // Applying it twice counts the request once.
        let _ = r.apply_effect(&e);
        let _ = r.complete(&e.request_id);
    }
    let d = r.route_http(br#"{"model": "m", "prompt": [1,2,3,4,5,6,7,8]}"#, [("x-session-id", "s1")], e.now_ms);
    common::check(&r, d);
    // Requests in flight under other ids of the effect (none) and the one completed above.
    assert_eq!(r.stats().inflight_requests, 0);
});
