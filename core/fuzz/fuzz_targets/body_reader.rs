//! Differential fuzzing of the direct reader of the common JSON body (`request/scan.rs`, the
//! path wasm32 takes first): arbitrary bytes as a body; whenever the reader takes one,
//! `RouteRequest::parse_serde_only` (serde alone) must give the same request, or the same error.
//!
//! Run (from core/fuzz): `RUSTC_BOOTSTRAP=1 cargo fuzz run body_reader -- -dict=body_reader.dict
//! -max_total_time=600`
#![no_main]

use kvroute::{RequestConfig, RouteRequest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let cfg = RequestConfig::default();
    let none = std::iter::empty::<(&str, &str)>;
    if let Some(direct) = RouteRequest::parse_direct_reader(body, none(), &cfg) {
        let serde = RouteRequest::parse_serde_only(body, none(), &cfg);
        assert_eq!(direct, serde, "body: {:?}", String::from_utf8_lossy(body));
    }
});
