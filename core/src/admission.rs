//! Admission control: pool saturation and shedding of sheddable (negative-priority) requests.

use crate::config::PolicyConfig;
use crate::decision::Shed;

/// Shed when the pool is saturated (≥ 1.0) and the request is sheddable (priority < 0).
pub(crate) fn admit(cfg: &PolicyConfig, saturation: f64, priority: i32) -> Option<Shed> {
    if cfg.admission.shed_sheddable && priority < 0 && saturation >= 1.0 {
        Some(Shed {
            status: 429,
            reason: format!(
                "pool saturated ({saturation:.2} >= 1.00; queue threshold {}, kv threshold {}) and request priority {priority} is sheddable",
                cfg.admission.queue_threshold, cfg.admission.kv_threshold
            ),
        })
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::{EndpointState, MetricsSnapshot, Role};
    use crate::score::Scorer;
    use std::sync::Arc;

    fn ep(m: Option<MetricsSnapshot>) -> EndpointState {
        EndpointState {
            id: Arc::from("10.0.0.1:1"),
            role: Role::Decode,
            healthy: true,
            metrics: m,
            load: crate::endpoints::Load::default(),
            kv_per_request: 0.0,
            incarnation: 1,
        }
    }

    /// An endpoint's saturation as the decision computes it (`Scorer::saturation`).
    fn endpoint_saturation(cfg: &PolicyConfig, ep: &EndpointState, now_ms: u64) -> f64 {
        let scorer = Scorer::new(cfg, None, now_ms);
        scorer.saturation(ep, scorer.fresh(ep))
    }

    #[test]
    fn saturation_formula() {
        let cfg = PolicyConfig::default();
        let m = |w, kv| Some(MetricsSnapshot { waiting: w, kv_usage: kv, updated_ms: 1000, ..Default::default() });
        assert_eq!(endpoint_saturation(&cfg, &ep(m(10, 0.1)), 1000), 2.0);
        assert_eq!(endpoint_saturation(&cfg, &ep(m(0, 0.4)), 1000), 0.5);
        assert_eq!(endpoint_saturation(&cfg, &ep(m(0, 0.4)), 5000), 1.0, "stale");
        assert_eq!(endpoint_saturation(&cfg, &ep(None), 0), 1.0, "missing");
        assert!(admit(&cfg, 1.0, -1).is_some());
        assert!(admit(&cfg, 1.0, 0).is_none());
        assert!(admit(&cfg, 0.99, -5).is_none());
    }
}
