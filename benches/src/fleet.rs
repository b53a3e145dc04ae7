//! Request text and endpoint fleets shared by the `route`, `precise` and `threads` benches (and
//! the `route_profile` example).

use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Role, RouteRequest, Router};

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

/// Bytes of the route bench's 8k-token prompts (8192 tokens × 4 bytes per pseudo-token).
pub const ROUTE_PROMPT_BYTES: usize = 8192 * 4;

/// The route bench's router: `n` decode endpoints (see [`add_decode_endpoints`]) and an
/// approximate index warmed by `warm` earlier 8k-token requests of 16 tenants (2k-token system
/// prompts, distinct conversation tails), each kept in flight until the end of the warm-up so
/// the in-flight scorer spreads them as live traffic would. With it the tenants' system prompts.
///
/// # Panics
/// When a warm-up decision fails (the benches' fleets route every request).
#[allow(clippy::expect_used)]
pub fn warmed_router(n: usize, warm: usize, now_ms: u64) -> (Router, Vec<String>) {
    let router = Router::new(Policy::default());
    let ids: Vec<String> = (0..n).map(|i| format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256)).collect();
    add_decode_endpoints(&router, &ids, now_ms);
    let systems: Vec<String> = (0..16).map(|t| words(1000 + t, 2048 * 4)).collect();
    let warm_ids: Vec<String> = (0..warm)
        .map(|r| {
            let tail = words(r as u64, ROUTE_PROMPT_BYTES - systems[0].len());
            let req = RouteRequest::text("llama", &format!("{}{}", systems[r % 16], tail));
            router.route(&req, now_ms).expect("a warm-up decision").request_id
        })
        .collect();
    for id in warm_ids {
        router.complete(&id).expect("a warm-up request in flight");
    }
    (router, systems)
}

/// The route bench's request: a follow-up turn (tenant 3's system prompt, shared; an earlier
/// conversation's tail, cached on one endpoint; new text), 8k tokens.
pub fn follow_up_prompt(systems: &[String]) -> String {
    let prior_tail = words(3, ROUTE_PROMPT_BYTES - systems[3].len());
    let prompt = format!("{}{}", systems[3], &prior_tail[..prior_tail.len() - 4096]);
    let rest = words(99, ROUTE_PROMPT_BYTES - prompt.len());
    format!("{prompt}{rest}")
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
