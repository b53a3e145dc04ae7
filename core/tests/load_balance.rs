//! Cache locality vs load balance: the anti-collapse trade-off is made exactly as configured, and a
//! hot shared prefix spreads once its endpoint saturates; the fail-open
//! destination.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, VecDeque};

use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Role, RouteRequest, Router};

fn metrics(waiting: u32, now: u64) -> MetricsSnapshot {
    MetricsSnapshot { waiting, running: 0, kv_usage: 0.3, updated_ms: now, ..Default::default() }
}

fn chat(system: &str, user: &str) -> String {
    serde_json::json!({
        "model": "llama",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 300
    })
    .to_string()
}

/// Route `body` once, find which endpoint got it (the cached one) and which did not (idle), then
/// give the cached one a waiting queue of `queue` and return where the same request goes next.
fn cached_vs_idle(policy: &str, queue: u32) -> (bool, f64) {
    let router = Router::new(Policy::from_json(policy).unwrap());
    let (a, b) = ("10.0.0.1:8000", "10.0.0.2:8000");
    router.upsert_endpoint(EndpointSpec::new(a, Role::Decode)).unwrap();
    router.upsert_endpoint(EndpointSpec::new(b, Role::Decode)).unwrap();
    router.update_metrics(a, metrics(0, 0)).unwrap();
    router.update_metrics(b, metrics(0, 0)).unwrap();
    let body = chat(&"a long shared system prompt ".repeat(400), "question");
    let first = router.route_http(body.as_bytes(), [("x", "y")], 0).unwrap();
    router.complete(&first.request_id).unwrap();
    let cached = first.endpoint().unwrap();
    let idle = if cached == a { b } else { a };
    router.update_metrics(cached, metrics(queue, 10)).unwrap();
    router.update_metrics(idle, metrics(0, 10)).unwrap();
    let next = router.route_http(body.as_bytes(), [("x", "y")], 10).unwrap();
    let hit = next.score(cached).unwrap().prefix_hit;
    (next.endpoint().unwrap() == cached, hit)
}

#[test]
fn overloaded_cached_endpoint_loses_to_idle_one_exactly_at_the_configured_point() {
    // Saturation filter off: the score alone decides. Defaults: w.prefix = 1, w.queue = 1,
    // queue_reference = 8 → a full hit is worth 8 waiting requests.
    let p = r#"{"scoring":{"filters":{"max_waiting":null}}}"#;
    for q in [0, 3, 7] {
        let (stays, hit) = cached_vs_idle(p, q);
        assert!(hit > 0.99, "the repeat is a full hit ({hit})");
        assert!(stays, "queue {q} < 8: the cached endpoint still wins");
    }
    for q in [9, 12, 40] {
        assert!(!cached_vs_idle(p, q).0, "queue {q} > 8: the idle endpoint wins");
    }
    // Doubling the queue weight halves the break-even point to 4.
    let p2 = r#"{"scoring":{"filters":{"max_waiting":null},"weights":{"queue":2.0}}}"#;
    assert!(cached_vs_idle(p2, 3).0);
    assert!(!cached_vs_idle(p2, 5).0);
    // A prefix weight of 0 ignores the cache entirely: any queue loses.
    let p3 = r#"{"scoring":{"filters":{"max_waiting":null},"weights":{"prefix":0.0}}}"#;
    assert!(!cached_vs_idle(p3, 1).0);
}

#[test]
fn overload_filter_removes_the_cached_endpoint_at_its_limit() {
    // With the queue weight at 0 the score always prefers the cached endpoint, so only the
    // overload filter (scoring.filters.max_waiting, default 16) can move the request.
    let p = r#"{"scoring":{"weights":{"queue":0.0}}}"#;
    assert!(cached_vs_idle(p, 15).0);
    assert!(!cached_vs_idle(p, 16).0);
    let p = r#"{"scoring":{"weights":{"queue":0.0},"filters":{"max_waiting":6}}}"#;
    assert!(cached_vs_idle(p, 5).0);
    assert!(!cached_vs_idle(p, 6).0);
    // Off: the cached endpoint keeps it whatever its queue.
    let p = r#"{"scoring":{"weights":{"queue":0.0},"filters":{"max_waiting":null}}}"#;
    assert!(cached_vs_idle(p, 500).0);
}

struct HotSpotRun {
    per_endpoint: BTreeMap<String, usize>,
    first_five: Vec<String>,
    holders: usize,
}

/// 400 requests sharing one long system prompt, one every 5 ms, each lasting `duration_ms`.
/// The engine queue mirrors unfinished requests; metrics are refreshed every 20 ms, so the
/// router sees them a little late, as in production. At every step, checks the anti-collapse
/// invariant: no endpoint is far past the saturation threshold while another sits idle.
fn hot_spot(duration_ms: u64) -> HotSpotRun {
    let router = Router::default();
    for i in 1..=8 {
        router.upsert_endpoint(EndpointSpec::new(format!("10.0.0.{i}:8000"), Role::Decode)).unwrap();
    }
    // With default weights a full hit is worth `queue_reference` (8) waiting requests.
    let threshold = router.policy().policy.config().scoring.queue_reference as u32;
    let system = "You are the hot-spot agent. Follow the tool protocol precisely. ".repeat(120);
    let mut in_flight: VecDeque<(u64, String)> = VecDeque::new();
    let mut per_endpoint: BTreeMap<String, usize> = BTreeMap::new();
    let mut first_five = Vec::new();
    for i in 0..400u64 {
        let now = i * 5;
        while in_flight.front().is_some_and(|(t, _)| now >= t + duration_ms) {
            let (_, id) = in_flight.pop_front().unwrap();
            router.complete(&id).unwrap();
        }
        if i % 4 == 0 {
            for e in router.endpoints() {
                router.update_metrics(&e.id, metrics(e.inflight, now)).unwrap();
            }
        }
        let body = chat(&system, &format!("task number {i}"));
        let d = router.route_http(body.as_bytes(), [("x", "y")], now).unwrap();
        let ep = d.endpoint().map(str::to_owned).unwrap().to_string();
        if i < 5 {
            first_five.push(ep.clone());
        }
        *per_endpoint.entry(ep).or_default() += 1;
        in_flight.push_back((now, d.request_id));
        let eps = router.endpoints();
        let busiest = eps.iter().map(|e| e.inflight).max().unwrap();
        let idle = eps.iter().filter(|e| e.inflight == 0).count();
        // Metrics lag up to 4 routes behind, so allow that much past the threshold.
        assert!(busiest <= threshold + 4 || idle == 0, "collapse at step {i}: {eps:?}");
    }
    let holders = router.endpoints().iter().filter(|e| e.index_memberships > 0).count();
    HotSpotRun { per_endpoint, first_five, holders }
}

#[test]
fn hot_shared_prefix_spreads_once_its_endpoint_saturates() {
    // ~20 requests in flight: more than one endpoint can queue below the threshold.
    let low = hot_spot(100);
    // Cache affinity first: the first requests pile onto the endpoint that holds the prefix.
    assert!(low.first_five.iter().all(|e| *e == low.first_five[0]), "{:?}", low.first_five);
    assert!(low.per_endpoint.len() >= 3, "{:?}", low.per_endpoint);
    assert!(low.per_endpoint.len() < 8, "under light load the prefix stays on few endpoints: {:?}", low.per_endpoint);
    assert_eq!(low.holders, low.per_endpoint.len());

    // ~80 requests in flight: the hot prefix must spread over the whole fleet, evenly.
    let high = hot_spot(400);
    assert_eq!(high.per_endpoint.len(), 8, "{:?}", high.per_endpoint);
    let max = *high.per_endpoint.values().max().unwrap() as f64;
    assert!(max < 2.0 * 400.0 / 8.0, "{:?}", high.per_endpoint);
    assert_eq!(high.holders, 8);
}

#[test]
fn fail_open_endpoint_prefers_healthy_decoders_with_the_fewest_requests_in_flight() {
    let r = Router::default();
    assert_eq!(r.fail_open_endpoint(), None, "no endpoint registered");
    for (id, role) in [("10.0.0.1:1", Role::Decode), ("10.0.0.2:1", Role::Decode), ("10.0.0.3:1", Role::Prefill)] {
        r.upsert_endpoint(EndpointSpec::new(id, role)).unwrap();
    }
    assert_eq!(r.fail_open_endpoint().as_deref(), Some("10.0.0.1:1"), "ties go in id order");
    let d = r.route(&RouteRequest::text("m", "hello"), 0).unwrap();
    let busy = d.endpoint().unwrap();
    let other = if busy == "10.0.0.1:1" { "10.0.0.2:1" } else { "10.0.0.1:1" };
    assert_eq!(r.fail_open_endpoint().as_deref(), Some(other), "fewest in flight");
    let inflight_before = r.stats().inflight_requests;
    r.fail_open_endpoint();
    assert_eq!(r.stats().inflight_requests, inflight_before, "nothing is recorded");
    r.set_healthy("10.0.0.1:1", false).unwrap();
    r.set_healthy("10.0.0.2:1", false).unwrap();
    assert_eq!(r.fail_open_endpoint().as_deref(), Some("10.0.0.3:1"), "any healthy endpoint");
    r.set_healthy("10.0.0.3:1", false).unwrap();
    assert!(r.fail_open_endpoint().is_some(), "any endpoint at all");
}

#[test]
fn between_scrapes_the_routers_own_traffic_corrects_the_stale_snapshot() {
    // One endpoint (X) served three requests of one prompt; a scrape taken while they were there
    // shows a queue and KV usage; then all three finish before the next scrape. Eight new
    // distinct prompts arriving now must spread evenly: X is as idle as the other endpoint.
    // Read as-is, the stale snapshot would send all eight to the other one (X's 2 waiting and
    // 0.03 KV usage outweigh eight requests in flight).
    let router = Router::default();
    let (a, b) = ("10.0.0.1:8000", "10.0.0.2:8000");
    for id in [a, b] {
        router.upsert_endpoint(EndpointSpec::new(id, Role::Decode)).unwrap();
        router.update_metrics(id, metrics(0, 0)).unwrap();
    }
    let hot = chat(&"the hot tenant's system prompt ".repeat(200), "q");
    let ids: Vec<_> = (0..3).map(|_| router.route_http(hot.as_bytes(), [("x", "y")], 1).unwrap()).collect::<Vec<_>>();
    let x = ids[0].endpoint().map(str::to_owned).unwrap();
    assert!(ids.iter().all(|d| d.endpoint() == Some(&x)), "the repeats follow the cache");
    let y = if &*x == a { b } else { a };
    router
        .update_metrics(
            &x,
            MetricsSnapshot { waiting: 2, running: 1, kv_usage: 0.03, updated_ms: 5, ..Default::default() },
        )
        .unwrap();
    router.update_metrics(y, MetricsSnapshot { updated_ms: 5, ..Default::default() }).unwrap();
    for d in &ids {
        router.complete(&d.request_id).unwrap();
    }
    let mut per: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..8 {
        let body = chat(&format!("cold tenant {i} ").repeat(150), "q");
        let d = router.route_http(body.as_bytes(), [("x", "y")], 6).unwrap();
        *per.entry(d.endpoint().unwrap().to_string()).or_default() += 1;
    }
    assert_eq!(per.get(&*x), Some(&4), "{per:?}");
    assert_eq!(per.get(y), Some(&4), "{per:?}");

    // The correction ends at the next snapshot: a fresh report is taken as it is.
    router.update_metrics(&x, metrics(12, 7)).unwrap();
    router.update_metrics(y, metrics(0, 7)).unwrap();
    let d = router.route_http(chat("another cold one", "q").as_bytes(), [("x", "y")], 7).unwrap();
    assert_eq!(d.endpoint(), Some(y));
    assert_eq!(d.score(&x).unwrap().queue, 12.0 / 8.0, "the reported queue, nothing added");
}
