//! Fuzz the HTTP routing entry point: arbitrary bytes as a request body, with header values
//! taken from the input, through `Router::route_http` (twice: the second sees the first's
//! indexed state) and `Router::complete`. Invariants: no panic; a decision names a known
//! endpoint and completes exactly once, or is a typed error; nothing stays in flight.
//!
//! Input: byte 0 picks the index mode (approx, precise, hybrid); then lines, up to the first
//! empty line, are the values of `HEADERS` in order (an empty value skips that header); the rest
//! is the body.
//!
//! Run (from core/fuzz): `RUSTC_BOOTSTRAP=1 cargo fuzz run route_request corpus/route_request seeds/route_request
//! -- -max_total_time=600`
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;

/// The request headers kvroute reads (default names), in input order.
const HEADERS: [&str; 10] = [
    "x-request-id",
    "x-session-id",
    "x-kvroute-priority",
    "x-kvroute-horizon",
    "x-kvroute-risk",
    "x-kvroute-bypass-probability",
    "x-llm-d-inference-fairness-id",
    "content-type",
    "x-kvroute-model",
    "x-kvroute-max-tokens",
];

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut headers: Vec<(&str, String)> = Vec::new();
    let mut body = rest;
    for name in HEADERS {
        let Some(nl) = body.iter().position(|&b| b == b'\n') else { break };
        let (line, tail) = (&body[..nl], &body[nl + 1..]);
        body = tail;
        if line.is_empty() {
            break;
        }
        let value = String::from_utf8_lossy(line).into_owned();
        headers.push((name, value));
    }
    let r = common::router(mode, mode & 0x80 != 0);
    for now in [100, 200] {
        let d = r.route_http(body, headers.iter().map(|(k, v)| (*k, v.as_str())), now);
        common::check(&r, d);
    }
    common::check_stats(&r);
});
