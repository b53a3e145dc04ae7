//! `RouterCore` (the single-threaded state machine) and `Router` (its thread-safe wrapper) make
//! the same decisions: one seeded workload of routes, completions, metrics, events, effects and a
//! reload, driven through both, gives identical decisions, stats and metrics pages.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute::{EndpointSpec, MetricsSnapshot, Outcome, Policy, Role, Router, RouterCore};

const POLICY: &str = r#"{"index": {"mode": "hybrid"}, "modes": {"colocated_input_max_tokens": 256},
    "admission": {"queue_threshold": 4}}"#;
const ENDPOINTS: [(&str, Role); 4] = [
    ("10.0.0.1:8000", Role::Decode),
    ("10.0.0.2:8000", Role::Decode),
    ("10.0.0.3:8000", Role::Both),
    ("10.0.1.1:8000", Role::Prefill),
];

/// A deterministic generator (xorshift), so the workload is the same on every run.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One step of the workload, applied to either router.
enum Step {
    Route { body: String, headers: Vec<(String, String)> },
    Complete(usize),
    Metrics { endpoint: usize, waiting: u32, kv: f64 },
    Health { endpoint: usize, healthy: bool },
    Reload(String),
}

fn workload(seed: u64, n: usize) -> Vec<Step> {
    let mut rng = Rng(seed);
    let prefixes: Vec<String> = (0..5).map(|i| format!("tenant {i} system prompt. ").repeat(60)).collect();
    let mut steps = Vec::new();
    for i in 0..n {
        let roll = rng.next() % 100;
        steps.push(match roll {
            0..=59 => {
                let p = &prefixes[(rng.next() % 5) as usize];
                let ids: Vec<u32> = (0..(rng.next() % 700) as u32).collect();
                let body = if rng.next() % 3 == 0 {
                    serde_json::json!({"model": "m", "prompt": ids, "max_tokens": rng.next() % 600}).to_string()
                } else {
                    serde_json::json!({"model": "m", "messages": [{"role": "system", "content": p},
                        {"role": "user", "content": format!("question {}", rng.next() % 50)}],
                        "max_tokens": rng.next() % 600})
                    .to_string()
                };
                let mut headers = vec![("x-session-id".to_owned(), format!("s{}", rng.next() % 7))];
                if rng.next() % 4 == 0 {
                    headers.push(("x-kvroute-priority".to_owned(), "-1".to_owned()));
                }
                if rng.next() % 5 == 0 {
                    headers.push(("x-request-id".to_owned(), format!("r{}", rng.next() % 9)));
                }
                Step::Route { body, headers }
            }
            60..=79 => Step::Complete((rng.next() % 64) as usize),
            80..=93 => Step::Metrics {
                endpoint: (rng.next() % 4) as usize,
                waiting: (rng.next() % 8) as u32,
                kv: (rng.next() % 100) as f64 / 100.0,
            },
            94..=97 => Step::Health { endpoint: (rng.next() % 4) as usize, healthy: rng.next() % 3 != 0 },
            _ => Step::Reload(if i % 2 == 0 {
                POLICY.to_owned()
            } else {
                r#"{"index": {"mode": "hybrid", "block_tokens": 32}}"#.to_owned()
            }),
        });
    }
    steps
}

/// Either router, behind one interface.
trait Target {
    fn route_http(&mut self, body: &[u8], headers: &[(String, String)], now: u64) -> Option<serde_json::Value>;
    fn complete(&mut self, id: &str) -> bool;
    fn metrics(&mut self, id: &str, m: MetricsSnapshot);
    fn health(&mut self, id: &str, healthy: bool);
    fn reload(&mut self, text: &str) -> u64;
    fn page(&mut self, now: u64) -> String;
}

impl Target for Router {
    fn route_http(&mut self, body: &[u8], headers: &[(String, String)], now: u64) -> Option<serde_json::Value> {
        Router::route_http(self, body, headers.iter().map(|(k, v)| (k.as_str(), v.as_str())), now)
            .ok()
            .map(|d| d.to_json())
    }
    fn complete(&mut self, id: &str) -> bool {
        Router::complete(self, id).is_ok()
    }
    fn metrics(&mut self, id: &str, m: MetricsSnapshot) {
        Router::update_metrics(self, id, m).unwrap();
    }
    fn health(&mut self, id: &str, healthy: bool) {
        Router::set_healthy(self, id, healthy).unwrap();
    }
    fn reload(&mut self, text: &str) -> u64 {
        Router::reload_str(self, text).unwrap()
    }
    fn page(&mut self, now: u64) -> String {
        // A router keeps two copies of the precise index (lookups read one while events are
        // written into the other); a core keeps one. Compared as one copy.
        let mut stats = self.stats();
        assert_eq!(stats.precise.copies, 2, "a router keeps two copies of the precise index");
        stats.precise.copies = 1;
        let text = self.metrics_text(now);
        let text = text
            .lines()
            .map(|l| match l.strip_prefix("kvroute_index_bytes{index=\"precise\"} ") {
                Some(v) => format!("kvroute_index_bytes{{index=\"precise\"}} {}", v.parse::<u64>().unwrap() / 2),
                None => l.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        format!("{text}\n\n{stats:?}")
    }
}

impl Target for RouterCore {
    fn route_http(&mut self, body: &[u8], headers: &[(String, String)], now: u64) -> Option<serde_json::Value> {
        RouterCore::route_http(self, body, headers.iter().map(|(k, v)| (k.as_str(), v.as_str())), now)
            .ok()
            .map(|d| d.to_json())
    }
    fn complete(&mut self, id: &str) -> bool {
        RouterCore::complete(self, id).is_ok()
    }
    fn metrics(&mut self, id: &str, m: MetricsSnapshot) {
        RouterCore::update_metrics(self, id, m).unwrap();
    }
    fn health(&mut self, id: &str, healthy: bool) {
        RouterCore::set_healthy(self, id, healthy).unwrap();
    }
    fn reload(&mut self, text: &str) -> u64 {
        RouterCore::reload_str(self, text).unwrap()
    }
    fn page(&mut self, now: u64) -> String {
        let stats = self.stats();
        assert_eq!(stats.precise.copies, 1);
        format!("{}\n{stats:?}", self.metrics_text(now))
    }
}

fn run(t: &mut dyn Target, steps: &[Step]) -> Vec<String> {
    let mut out = Vec::new();
    let mut ids: Vec<String> = Vec::new();
    for (i, s) in steps.iter().enumerate() {
        let now = 1_000 + 10 * i as u64;
        match s {
            Step::Route { body, headers } => {
                let d = t.route_http(body.as_bytes(), headers, now);
                if let Some(id) = d.as_ref().and_then(|d| d["request_id"].as_str()) {
                    ids.push(id.to_owned());
                }
                out.push(serde_json::to_string(&d).unwrap());
            }
            Step::Complete(k) => {
                let ok = !ids.is_empty() && {
                    let id = ids.remove(k % ids.len());
                    t.complete(&id)
                };
                out.push(format!("complete {ok}"));
            }
            Step::Metrics { endpoint, waiting, kv } => t.metrics(
                ENDPOINTS[*endpoint].0,
                MetricsSnapshot { waiting: *waiting, kv_usage: *kv, updated_ms: now, ..Default::default() },
            ),
            Step::Health { endpoint, healthy } => t.health(ENDPOINTS[*endpoint].0, *healthy),
            Step::Reload(text) => out.push(format!("version {}", t.reload(text))),
        }
    }
    out.push(t.page(1_000 + 10 * steps.len() as u64));
    out
}

#[test]
fn router_core_and_router_decide_alike() {
    let steps = workload(0x6b76_726f, 600);
    let router = Router::new(Policy::from_json(POLICY).unwrap());
    let mut core = RouterCore::new(Policy::from_json(POLICY).unwrap());
    for (id, role) in ENDPOINTS {
        router.upsert_endpoint(EndpointSpec::new(id, role)).unwrap();
        core.upsert_endpoint(EndpointSpec::new(id, role)).unwrap();
    }
    let mut router = router;
    let a = run(&mut router, &steps);
    let b = run(&mut core, &steps);
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x, y, "step {i}");
    }
    // The workload exercised what it is meant to: routed, shed and disaggregated decisions,
    // completions and reloads.
    let all = a.join("\n");
    for needle in [r#""mode":"decode-direct""#, r#""rule":"shed""#, "complete true", "version 3"] {
        assert!(all.contains(needle), "{needle} never happened");
    }
}

#[test]
fn a_router_wraps_a_core_as_it_is() {
    let mut core = RouterCore::new(Policy::default());
    core.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode)).unwrap();
    let d = core.route(&kvroute::RouteRequest::text("m", &"x".repeat(4096)), 5).unwrap();
    let router = Router::from(core);
    assert_eq!(router.endpoints()[0].inflight, 1, "the wrapped core keeps its state");
    assert!(matches!(d.outcome, Outcome::Routed { .. }));
    router.complete(&d.request_id).unwrap();
    assert_eq!(router.with_core(|c| c.endpoints()[0].inflight), 0);
}
