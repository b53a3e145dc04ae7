//! Routing policies compared by the simulator.
//!
//! A policy is a [`PolicyKind`] (its name) plus a [`Balancer`] (its state and its pick). Adding one
//! is one enum variant, its arm in [`PolicyKind::name`] and [`PolicyKind::balancer`], and a
//! `Balancer` impl. The baselines' picks ([`RoundRobin`], [`LeastLoaded`]) work on endpoint
//! indices alone, so other load generators (the reference worker's demo) run the same ones.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Role, Router, Rule, StateError};

use crate::error::SimError;
use crate::sim::SimRequest;

/// What the simulator knows about one endpoint right now (true values, not metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EndpointLoad {
    /// Requests waiting for prefill (not started).
    pub waiting: u32,
    /// 1 while a prefill is running.
    pub prefilling: u32,
    /// Requests decoding.
    pub decoding: u32,
    /// KV usage of running requests (0–1).
    pub kv_usage: f64,
}

impl EndpointLoad {
    /// Requests routed here and not finished.
    pub fn outstanding(&self) -> u32 {
        self.waiting + self.prefilling + self.decoding
    }
}

/// A balancer's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    /// Endpoint index (`None`: the policy shed the request).
    pub endpoint: Option<usize>,
    /// Handle to pass to [`Balancer::complete`] when the request ends.
    pub ticket: Option<String>,
}

/// A routing policy under simulation.
pub trait Balancer {
    /// Pick an endpoint for `req` arriving at `now_ms`; `loads` are the endpoints' true loads.
    fn pick(&mut self, req: &SimRequest, loads: &[EndpointLoad], now_ms: u64) -> Result<Pick, SimError>;

    /// Metrics scraped from the endpoints at `now_ms` (one per endpoint, in endpoint order).
    fn metrics(&mut self, _snapshots: &[MetricsSnapshot], _now_ms: u64) -> Result<(), SimError> {
        Ok(())
    }

    /// A request picked with `ticket` finished.
    fn complete(&mut self, _ticket: &str) -> Result<(), SimError> {
        Ok(())
    }

    /// An optional one-line summary shown under the results (e.g. which rules fired).
    fn summary(&self) -> Option<String> {
        None
    }
}

/// The policies the simulator knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicyKind {
    /// Endpoints in turn.
    RoundRobin,
    /// Fewest outstanding requests (true counts; ties rotate).
    LeastLoaded,
    /// kvroute's router in approximate mode (`Router::route_http`).
    Kvroute,
}

impl PolicyKind {
    /// Every policy, in report order.
    pub const ALL: [PolicyKind; 3] = [PolicyKind::RoundRobin, PolicyKind::LeastLoaded, PolicyKind::Kvroute];

    /// Name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::Kvroute => "kvroute",
        }
    }

    /// Build the balancer for `endpoints` endpoints with ids `ids`. `kvroute` is the policy the
    /// kvroute balancer runs.
    pub fn balancer(self, ids: &[String], kvroute: &Policy) -> Result<Box<dyn Balancer>, SimError> {
        Ok(match self {
            PolicyKind::RoundRobin => Box::new(RoundRobin::new()),
            PolicyKind::LeastLoaded => Box::new(LeastLoaded::new()),
            PolicyKind::Kvroute => Box::new(KvrouteBalancer::new(ids, kvroute.clone())?),
        })
    }

    fn known() -> String {
        PolicyKind::ALL.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ")
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = SimError;

    fn from_str(s: &str) -> Result<PolicyKind, SimError> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| SimError::UnknownPolicy { name: s.to_owned(), known: PolicyKind::known() })
    }
}

/// Round-robin: endpoints in turn (0, 1, …, n-1, 0, …). The simulator's `round-robin` policy and
/// the reference worker's demo baseline.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoundRobin {
    next: usize,
}

impl RoundRobin {
    /// Starting at endpoint 0.
    pub fn new() -> RoundRobin {
        RoundRobin::default()
    }

    /// The next of `endpoints` endpoints (0 when there are none).
    pub fn pick(&mut self, endpoints: usize) -> usize {
        let e = self.next % endpoints.max(1);
        self.next = e + 1;
        e
    }
}

/// Least-loaded: the endpoint with the smallest load, ties going to the first one after the
/// previous pick (so they rotate instead of piling onto endpoint 0). The simulator's
/// `least-loaded` policy (true outstanding requests) and the reference worker's demo baseline
/// (requests in flight).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeastLoaded {
    next: usize,
}

impl LeastLoaded {
    /// No previous pick: ties go to endpoint 0 first.
    pub fn new() -> LeastLoaded {
        LeastLoaded::default()
    }

    /// Pick one of `endpoints` endpoints by `load(endpoint)` (0 when there are none).
    pub fn pick<K: Ord>(&mut self, endpoints: usize, mut load: impl FnMut(usize) -> K) -> usize {
        let n = endpoints.max(1);
        let e = (0..n).map(|i| (self.next + i) % n).min_by_key(|&e| load(e)).unwrap_or(0);
        self.next = e + 1;
        e
    }
}

impl Balancer for RoundRobin {
    fn pick(&mut self, _req: &SimRequest, loads: &[EndpointLoad], _now_ms: u64) -> Result<Pick, SimError> {
        Ok(Pick { endpoint: Some(RoundRobin::pick(self, loads.len())), ticket: None })
    }
}

impl Balancer for LeastLoaded {
    fn pick(&mut self, _req: &SimRequest, loads: &[EndpointLoad], _now_ms: u64) -> Result<Pick, SimError> {
        let e = LeastLoaded::pick(self, loads.len(), |e| loads.get(e).map_or(u32::MAX, EndpointLoad::outstanding));
        Ok(Pick { endpoint: Some(e), ticket: None })
    }
}

struct KvrouteBalancer {
    router: Router,
    ids: Vec<String>,
    index_of: HashMap<Arc<str>, usize>,
    rules: [u64; Rule::ALL.len()],
    relaxed: u64,
}

impl KvrouteBalancer {
    fn new(ids: &[String], policy: Policy) -> Result<KvrouteBalancer, SimError> {
        let router = Router::new(policy);
        let mut index_of = HashMap::new();
        for (i, id) in ids.iter().enumerate() {
            router.upsert_endpoint(EndpointSpec::new(id.as_str(), Role::Both))?;
            index_of.insert(Arc::from(id.as_str()), i);
        }
        Ok(KvrouteBalancer { router, ids: ids.to_vec(), index_of, rules: [0; Rule::ALL.len()], relaxed: 0 })
    }
}

impl Balancer for KvrouteBalancer {
    fn pick(&mut self, req: &SimRequest, _loads: &[EndpointLoad], now_ms: u64) -> Result<Pick, SimError> {
        let headers = req.headers.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        let d = self
            .router
            .route_http(&req.body, headers, now_ms)
            .map_err(|source| SimError::Route { request_id: req.request_id.clone(), source })?;
        if let Some(i) = Rule::ALL.iter().position(|&r| r == d.rule) {
            self.rules[i] += 1;
        }
        self.relaxed += u64::from(d.relaxed_filters);
        let endpoint = d.endpoint().and_then(|e| self.index_of.get(e).copied());
        Ok(Pick { endpoint, ticket: endpoint.map(|_| d.request_id) })
    }

    fn metrics(&mut self, snapshots: &[MetricsSnapshot], _now_ms: u64) -> Result<(), SimError> {
        for (id, m) in self.ids.iter().zip(snapshots) {
            self.router.update_metrics(id, m.clone())?;
        }
        Ok(())
    }

    fn complete(&mut self, ticket: &str) -> Result<(), SimError> {
        match self.router.complete(ticket) {
            // Dropped from in-flight tracking after `limits.inflight_timeout_ms`: nothing to release.
            Ok(()) | Err(StateError::UnknownRequest { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn summary(&self) -> Option<String> {
        let total: u64 = self.rules.iter().sum();
        if total == 0 {
            return None;
        }
        let mut parts: Vec<String> = Rule::ALL
            .iter()
            .zip(self.rules)
            .filter(|(_, n)| *n > 0)
            .map(|(r, n)| format!("{} {:.1}%", r.as_str(), 100.0 * n as f64 / total as f64))
            .collect();
        if self.relaxed > 0 {
            parts.push(format!("filters relaxed {:.1}%", 100.0 * self.relaxed as f64 / total as f64));
        }
        Some(format!("rules: {}", parts.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_cycles() {
        let mut rr = RoundRobin::new();
        let picks: Vec<usize> = (0..7).map(|_| rr.pick(3)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2, 0]);
        assert_eq!(rr.pick(0), 0);
    }

    #[test]
    fn least_loaded_takes_the_minimum_and_rotates_ties() {
        let mut ll = LeastLoaded::new();
        let loads = [2u32, 1, 1, 5];
        assert_eq!(ll.pick(4, |e| loads[e]), 1);
        assert_eq!(ll.pick(4, |e| loads[e]), 2, "the tie goes to the one after the previous pick");
        assert_eq!(ll.pick(4, |e| loads[e]), 1);
        let flat = [0u32; 3];
        let picks: Vec<usize> = (0..4).map(|_| ll.pick(3, |e| flat[e])).collect();
        assert_eq!(picks, [2, 0, 1, 2]);
        assert_eq!(LeastLoaded::new().pick(0, |_| 0), 0);
    }
}
