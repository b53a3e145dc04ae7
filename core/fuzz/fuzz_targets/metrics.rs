//! Fuzz the Prometheus metrics parser (`kvroute::parse_prometheus`, vLLM and SGLang pages) and
//! the router's use of its snapshot. Invariants: no panic; a snapshot's figures are in range
//! (KV usage within 0..=1) and the router accepts it; rejections are typed `MetricsError`s.
//!
//! Run (from core/fuzz): `RUSTC_BOOTSTRAP=1 cargo fuzz run metrics corpus/metrics seeds/metrics
//! -- -dict=metrics.dict -max_total_time=600`
#![no_main]

mod common;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match kvroute::parse_prometheus(&text, 7) {
        Ok(m) => {
            assert!(m.kv_usage.is_finite() && (0.0..=1.0).contains(&m.kv_usage), "{m:?}");
            assert_eq!(m.updated_ms, 7);
            let r = common::router(0, false);
            let (id, _) = common::ENDPOINTS[1];
            let stored = r
                .update_metrics_from_prometheus(id, &text, 7)
                .unwrap_or_else(|e| panic!("parsed once, not twice: {e}"));
            assert_eq!(stored, m);
            let d = r.route_http(br#"{"model": "m", "prompt": "hello"}"#, [("x-request-id", "r")], 8);
            common::check(&r, d);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
