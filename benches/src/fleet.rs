//! Request text and endpoint fleets shared by the `route`, `precise` and `threads` benches.

use kvroute::{EndpointSpec, MetricsSnapshot, Role, Router};

/// `len` bytes of pseudo-words drawn from `seed` (deterministic: the same text every run).
pub fn words(seed: u64, len: usize) -> String {
    let words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda", "zeta"];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut s = String::with_capacity(len + 16);
    while s.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(words[(x % 10) as usize]);
        s.push(' ');
    }
    s.truncate(len);
    s
}

/// Register `ids` as decode endpoints with fixed, staggered metrics stamped `now_ms`: 0–3
/// waiting, 8 running, KV usage 0.30–0.50.
///
/// # Panics
/// When the router refuses an id (the benches' ids are valid).
#[allow(clippy::expect_used)]
pub fn add_decode_endpoints(router: &Router, ids: &[String], now_ms: u64) {
    for (i, id) in ids.iter().enumerate() {
        router.upsert_endpoint(EndpointSpec::new(id.as_str(), Role::Decode)).expect("a valid endpoint id");
        let m = MetricsSnapshot {
            waiting: (i % 4) as u32,
            running: 8,
            kv_usage: 0.3 + (i % 5) as f64 * 0.05,
            updated_ms: now_ms,
            ..Default::default()
        };
        router.update_metrics(id, m).expect("a registered endpoint");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_deterministic_and_sized() {
        assert_eq!(words(3, 100), words(3, 100));
        assert_ne!(words(3, 100), words(4, 100));
        assert_eq!(words(3, 100).len(), 100);
        let r = Router::default();
        let ids: Vec<String> = (0..3).map(|i| format!("10.0.0.{i}:8000")).collect();
        add_decode_endpoints(&r, &ids, 5);
        assert_eq!(r.stats().endpoints, 3);
    }
}
