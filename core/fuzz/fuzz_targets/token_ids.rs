//! Differential fuzzing of the token-id fast path of the JSON body: arbitrary bytes as a body
//! through `RouteRequest::parse` (fast path, serde when it declines) and
//! `RouteRequest::parse_serde_only` (serde alone). Invariant: both give the same request, or the
//! same error (text, JSON path, line and column).
//!
//! Run (from core/fuzz): `RUSTC_BOOTSTRAP=1 cargo fuzz run token_ids corpus/token_ids seeds/token_ids
//! -- -dict=token_ids.dict -max_total_time=600`
#![no_main]

use kvroute::{RequestConfig, RouteRequest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let cfg = RequestConfig::default();
    let none = std::iter::empty::<(&str, &str)>;
    let fast = RouteRequest::parse(body, none(), &cfg);
    let serde = RouteRequest::parse_serde_only(body, none(), &cfg);
    assert_eq!(fast, serde, "body: {:?}", String::from_utf8_lossy(body));
});
