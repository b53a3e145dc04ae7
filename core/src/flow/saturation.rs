//! Saturation detectors: how full the pool is (1.0 = saturated), computed from the router's
//! endpoint table at the time of the call.
//!
//! Both detectors read the router's own view, which moves with its traffic: the utilization
//! detector reads each endpoint's metrics snapshot corrected by the requests routed there and
//! completed since (`EndpointState::waiting_now`, `kv_usage_now`), the concurrency detector the
//! router's in-flight counters. Requests flow control has released but the caller has not routed
//! yet count too ([`Saturation::add_pending`]), and so does each request released during one
//! dispatch opportunity ([`Saturation::add_dispatch`]): one opportunity never releases the whole
//! queue on a reading taken before it.

use crate::config::PolicyConfig;
use crate::endpoints::{EndpointState, EndpointTable, Role};

use super::config::SaturationDetectorConfig;

/// Saturation of one pool (stage) and what one more request adds to it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct StageSaturation {
    /// Mean over the pool's healthy endpoints.
    pub value: f64,
    /// Healthy endpoints in the pool.
    pub endpoints: u32,
    /// What one request adds to `value` (spread over the pool).
    per_request: f64,
    /// What one token adds to `value` (concurrency detector with a token limit).
    per_token: f64,
}

impl StageSaturation {
    fn add(&mut self, requests: f64, tokens: f64) {
        self.value += (requests * self.per_request).max(tokens * self.per_token);
    }
}

/// The pool's saturation by stage.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Saturation {
    /// Decode-capable endpoints (role `decode` or `both`).
    pub decode: StageSaturation,
    /// Prefill-only endpoints (role `prefill`).
    pub prefill: StageSaturation,
    /// Whether `value` is the higher of the two stages (stage-aware detector and a prefill pool).
    pub stage_aware: bool,
}

impl Saturation {
    /// No healthy decode-capable endpoint: nothing can be routed.
    pub fn no_endpoints(&self) -> bool {
        self.decode.endpoints == 0
    }

    /// The pool's saturation: the decode pool's, or with stage awareness and a prefill pool the
    /// higher of the two.
    pub fn value(&self) -> f64 {
        if self.stage_aware && self.prefill.endpoints > 0 {
            self.decode.value.max(self.prefill.value)
        } else {
            self.decode.value
        }
    }

    /// Count `requests` released but not yet routed, with `tokens` tokens between them.
    pub fn add_pending(&mut self, requests: u64, tokens: u64) {
        self.decode.add(requests as f64, tokens as f64);
        if self.prefill.endpoints > 0 {
            self.prefill.add(requests as f64, tokens as f64);
        }
    }

    /// Count one request released now, of `tokens` tokens.
    pub fn add_dispatch(&mut self, tokens: u64) {
        self.add_pending(1, tokens);
    }
}

/// One endpoint's saturation under `detector`.
fn endpoint_saturation(detector: &SaturationDetectorConfig, staleness_ms: u64, ep: &EndpointState, now_ms: u64) -> f64 {
    match detector {
        SaturationDetectorConfig::Utilization { queue_depth_threshold, kv_cache_util_threshold, .. } => {
            match &ep.metrics {
                Some(m) if now_ms.saturating_sub(m.updated_ms) <= staleness_ms => (f64::from(ep.load.waiting_now())
                    / queue_depth_threshold)
                    .max(ep.load.kv_usage_now() / kv_cache_util_threshold),
                // Unknown is not idle: an endpoint we cannot see is assumed full.
                _ => 1.0,
            }
        }
        SaturationDetectorConfig::Concurrency { max_requests_per_endpoint, max_tokens_per_endpoint } => {
            let r = max_requests_per_endpoint.map_or(0.0, |m| f64::from(ep.load.inflight()) / f64::from(m));
            let t = max_tokens_per_endpoint.map_or(0.0, |m| ep.load.inflight_tokens() as f64 / m as f64);
            r.max(t)
        }
    }
}

/// The pool's saturation at `now_ms`, before counting released-but-unrouted requests.
pub(crate) fn measure(policy: &PolicyConfig, endpoints: &EndpointTable, now_ms: u64) -> Saturation {
    let f = &policy.flow_control;
    let detector = &f.saturation_detector;
    let staleness = match detector {
        SaturationDetectorConfig::Utilization { metrics_staleness_threshold_ms: Some(s), .. } => *s,
        _ => policy.metrics.staleness_ms,
    };
    let (mut d_sum, mut d_n, mut p_sum, mut p_n) = (0.0, 0u32, 0.0, 0u32);
    for &slot in endpoints.order() {
        let Some(ep) = endpoints.get(slot) else { continue };
        if !ep.healthy {
            continue;
        }
        let s = endpoint_saturation(detector, staleness, ep, now_ms);
        if ep.role.decodes() {
            d_sum += s;
            d_n += 1;
        } else if ep.role == Role::Prefill {
            p_sum += s;
            p_n += 1;
        }
    }
    let (per_request, per_token) = match detector {
        SaturationDetectorConfig::Utilization { queue_depth_threshold, .. } => (1.0 / queue_depth_threshold, 0.0),
        SaturationDetectorConfig::Concurrency { max_requests_per_endpoint, max_tokens_per_endpoint } => (
            max_requests_per_endpoint.map_or(0.0, |m| 1.0 / f64::from(m)),
            max_tokens_per_endpoint.map_or(0.0, |m| 1.0 / m as f64),
        ),
    };
    let stage = |sum: f64, n: u32| {
        if n == 0 {
            StageSaturation::default()
        } else {
            let n_f = f64::from(n);
            StageSaturation {
                value: sum / n_f,
                endpoints: n,
                per_request: per_request / n_f,
                per_token: per_token / n_f,
            }
        }
    };
    Saturation { decode: stage(d_sum, d_n), prefill: stage(p_sum, p_n), stage_aware: f.stage_aware }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Policy;
    use crate::endpoints::{EndpointSpec, MetricsSnapshot};

    fn table(specs: &[(&str, Role)]) -> EndpointTable {
        let mut t = EndpointTable::default();
        for (id, role) in specs {
            t.insert(&EndpointSpec::new(*id, *role), |_| true);
        }
        t
    }

    fn set(t: &mut EndpointTable, id: &str, f: impl FnOnce(&mut EndpointState)) {
        let slot = t.slot_of(id).unwrap();
        f(t.get_mut(slot).unwrap());
    }

    #[test]
    fn utilization_reads_the_corrected_estimates_and_stale_is_full() {
        let p = Policy::from_json(r#"{"flow_control":{"enabled":true}}"#).unwrap();
        let mut t = table(&[("10.0.0.1:1", Role::Decode), ("10.0.0.2:1", Role::Decode)]);
        let m =
            |w, kv| MetricsSnapshot { waiting: w, running: 4, kv_usage: kv, updated_ms: 1000, ..Default::default() };
        set(&mut t, "10.0.0.1:1", |e| e.set_metrics(m(0, 0.4)));
        set(&mut t, "10.0.0.2:1", |e| e.set_metrics(m(5, 0.1)));
        let s = measure(p.config(), &t, 1000);
        // (0.4/0.8 + 5/5) / 2
        assert!((s.value() - 0.75).abs() < 1e-12, "{s:?}");
        // Routing a request there raises the estimate at once.
        set(&mut t, "10.0.0.1:1", |e| e.sent());
        set(&mut t, "10.0.0.1:1", |e| e.sent());
        set(&mut t, "10.0.0.1:1", |e| e.sent());
        let s = measure(p.config(), &t, 1000);
        // endpoint 1: max(3/5, (0.4 + 3·0.1)/0.8 = 0.875)
        assert!((s.value() - (0.875 + 1.0) / 2.0).abs() < 1e-12, "{s:?}");
        // Stale metrics (default staleness 1 s) count as saturated.
        let s = measure(p.config(), &t, 2001);
        assert_eq!(s.value(), 1.0);
        // Released but unrouted requests count: 1/(2 endpoints · 5).
        let mut s = measure(p.config(), &t, 1000);
        let before = s.value();
        s.add_dispatch(100);
        assert!((s.value() - before - 0.1).abs() < 1e-12);
        // An unhealthy endpoint is not in the pool; none at all is "no endpoints".
        set(&mut t, "10.0.0.1:1", |e| e.healthy = false);
        set(&mut t, "10.0.0.2:1", |e| e.healthy = false);
        assert!(measure(p.config(), &t, 1000).no_endpoints());
    }

    #[test]
    fn concurrency_counts_requests_and_tokens() {
        let p = Policy::from_json(
            r#"{"flow_control":{"enabled":true,"saturation_detector":{"kind":"concurrency","max_requests_per_endpoint":4,"max_tokens_per_endpoint":1000}}}"#,
        )
        .unwrap();
        let mut t = table(&[("10.0.0.1:1", Role::Both), ("10.0.0.2:1", Role::Both)]);
        set(&mut t, "10.0.0.1:1", |e| {
            e.load.set_requests(2);
            e.load.set_tokens(100);
        });
        set(&mut t, "10.0.0.2:1", |e| {
            e.load.set_requests(1);
            e.load.set_tokens(900);
        });
        let mut s = measure(p.config(), &t, 0);
        assert!((s.value() - (0.5 + 0.9) / 2.0).abs() < 1e-12, "{s:?}");
        s.add_dispatch(10);
        assert!((s.value() - (0.7 + 0.125)).abs() < 1e-12, "one request is 1/(2·4): {s:?}");
    }

    #[test]
    fn stage_aware_takes_the_fuller_stage() {
        let p = Policy::from_json(
            r#"{"flow_control":{"enabled":true,"saturation_detector":{"kind":"concurrency","max_requests_per_endpoint":2}}}"#,
        )
        .unwrap();
        let mut t = table(&[("10.0.0.1:1", Role::Decode), ("10.0.0.2:1", Role::Prefill)]);
        set(&mut t, "10.0.0.2:1", |e| e.load.set_requests(2));
        let s = measure(p.config(), &t, 0);
        assert_eq!((s.decode.value, s.prefill.value, s.value()), (0.0, 1.0, 1.0));
        let p = Policy::from_json(
            r#"{"flow_control":{"enabled":true,"stage_aware":false,"saturation_detector":{"kind":"concurrency","max_requests_per_endpoint":2}}}"#,
        )
        .unwrap();
        assert_eq!(measure(p.config(), &t, 0).value(), 0.0, "without stage awareness only decode counts");
    }
}
