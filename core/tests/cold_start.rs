//! Cold start: distinct tenants arriving one at a time on an idle fleet (nothing in flight, equal
//! metrics) spread over every endpoint instead of falling to a hash, while a returning tenant
//! still goes where its prefix is cached, and router instances that share state through routing
//! effects make the same decisions as one router.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Role, Router};

const ENDPOINTS: [&str; 4] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"];
const TENANTS: usize = 8;
/// Random prompt sets per test: with a plain hash tie-break about a third of them leave an
/// endpoint without a tenant, so a regression shows in (almost) every run of a few sets.
const SETS: u64 = 200;

/// SplitMix64: a seeded generator with no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn words(&mut self, n: usize) -> String {
        const W: [&str; 16] = [
            "agent", "tools", "plans", "query", "cache", "route", "token", "model", "reply", "steps", "graph", "store",
            "index", "batch", "shard", "trace",
        ];
        (0..n).map(|_| W[(self.next() % 16) as usize]).collect::<Vec<_>>().join(" ")
    }
}

/// One tenant: a long system prompt of its own (random length when `vary`).
fn tenants(seed: u64, vary: bool) -> Vec<String> {
    let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0x5eed);
    (0..TENANTS)
        .map(|t| {
            let n = if vary { 150 + (rng.next() % 600) as usize } else { 400 };
            format!("tenant {t} of set {seed}: {}", rng.words(n))
        })
        .collect()
}

fn body(system: &str, user: &str) -> Vec<u8> {
    serde_json::json!({
        "model": "llama",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 300
    })
    .to_string()
    .into_bytes()
}

fn fleet() -> Router {
    let r = Router::new(Policy::default());
    for id in ENDPOINTS {
        r.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
    }
    r
}

/// Equal metrics everywhere: idle, nothing waiting, nothing running.
fn idle_metrics(r: &Router, now: u64) {
    for id in ENDPOINTS {
        r.update_metrics(id, MetricsSnapshot { updated_ms: now, ..Default::default() }).unwrap();
    }
}

fn route(r: &Router, body: &[u8], request_id: &str, now: u64) -> kvroute::Decision {
    r.route_http(body, [("x-request-id", request_id)], now).unwrap()
}

/// Tenants' first requests, one at a time, each completed before the next arrives. Returns
/// where each tenant went.
fn first_requests(r: &Router, prompts: &[String]) -> Vec<String> {
    prompts
        .iter()
        .enumerate()
        .map(|(t, p)| {
            let now = 10 * t as u64;
            idle_metrics(r, now);
            let d = route(r, &body(p, "first question"), &format!("t{t}-0"), now);
            r.complete(&d.request_id).unwrap();
            d.endpoint().unwrap().to_string()
        })
        .collect()
}

fn per_endpoint(homes: &[String]) -> BTreeMap<&str, usize> {
    let mut n: BTreeMap<&str, usize> = ENDPOINTS.iter().map(|&e| (e, 0)).collect();
    for h in homes {
        *n.get_mut(h.as_str()).unwrap() += 1;
    }
    n
}

#[test]
fn distinct_tenants_arriving_one_at_a_time_leave_no_endpoint_idle() {
    for seed in 0..SETS {
        // Prompts of different lengths: every endpoint gets a tenant (at least one each).
        let r = fleet();
        let homes = first_requests(&r, &tenants(seed, true));
        let n = per_endpoint(&homes);
        assert!(n.values().all(|&c| c >= 1), "set {seed}: an endpoint got no tenant: {n:?}");

        // Every tenant comes back: it still goes to the endpoint holding its prefix.
        for (t, p) in tenants(seed, true).iter().enumerate() {
            let now = 1_000 + 10 * t as u64;
            idle_metrics(&r, now);
            let d = route(&r, &body(p, "first question"), &format!("t{t}-1"), now);
            r.complete(&d.request_id).unwrap();
            assert_eq!(d.endpoint(), Some(homes[t].as_str()), "set {seed}: tenant {t} lost its cache");
            assert!(d.prefix_hit > 0.99, "set {seed}: tenant {t} hit {}", d.prefix_hit);
        }

        // Prompts of equal length: exactly two tenants each.
        let r = fleet();
        let homes = first_requests(&r, &tenants(seed, false));
        let n = per_endpoint(&homes);
        assert!(n.values().all(|&c| c == 2), "set {seed}: uneven spread of equal tenants: {n:?}");
    }
}

/// Route the tenants' first requests alternately through two instances that replicate every
/// decision's effect to the other (and every completion to both); returns where each went.
fn first_requests_on_two_instances(prompts: &[String], replicate: bool) -> Vec<String> {
    let (a, b) = (fleet(), fleet());
    a.record_effects(true);
    b.record_effects(true);
    prompts
        .iter()
        .enumerate()
        .map(|(t, p)| {
            let now = 10 * t as u64;
            idle_metrics(&a, now);
            idle_metrics(&b, now);
            let (here, peer) = if t % 2 == 0 { (&a, &b) } else { (&b, &a) };
            let d = route(here, &body(p, "first question"), &format!("t{t}-0"), now);
            if replicate {
                peer.apply_effect(d.effect.as_deref().unwrap()).unwrap();
                peer.complete(&d.request_id).unwrap();
            }
            here.complete(&d.request_id).unwrap();
            d.endpoint().unwrap().to_string()
        })
        .collect()
}

#[test]
fn instances_sharing_effects_decide_like_one_router() {
    let mut unshared_differs = 0;
    for seed in 0..SETS {
        let prompts = tenants(seed, true);
        let one = first_requests(&fleet(), &prompts);
        let two = first_requests_on_two_instances(&prompts, true);
        assert_eq!(one, two, "set {seed}: the replicas disagree with a single router");
        if first_requests_on_two_instances(&prompts, false) != one {
            unshared_differs += 1;
        }
    }
    // Control: without the effects each instance sees only its own half of the fleet's state,
    // so the spread depends on state that really has to be shared.
    assert!(unshared_differs > 0, "the cold spread did not depend on replicated state");
}
