//! The fail-open destination: where a request goes when the core could not route it.
//!
//! This is deliberately not a policy: it only has to keep requests flowing while something is
//! wrong (a malformed body the engine will reject itself, no decode-capable endpoint, an internal
//! error). It picks the endpoint with the fewest router-tracked requests in flight, preferring
//! healthy decode-capable endpoints, then any healthy endpoint, then any endpoint at all.

use kvroute::EndpointInfo;

/// The fallback endpoint among `endpoints` (`None` only when there is none).
pub fn least_loaded(endpoints: &[EndpointInfo]) -> Option<&EndpointInfo> {
    let load = |e: &&EndpointInfo| (e.inflight, e.metrics.as_ref().map_or(0, |m| m.waiting));
    let tiers: [&dyn Fn(&EndpointInfo) -> bool; 3] = [&|e| e.healthy && e.role.decodes(), &|e| e.healthy, &|_| true];
    tiers.iter().find_map(|keep| endpoints.iter().filter(|e| keep(e)).min_by_key(load))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kvroute::{EndpointSpec, Role, Router};

    #[test]
    fn prefers_healthy_decoders_with_the_fewest_requests() {
        let r = Router::default();
        for (id, role) in [("10.0.0.1:1", Role::Decode), ("10.0.0.2:1", Role::Decode), ("10.0.0.3:1", Role::Prefill)] {
            r.upsert_endpoint(EndpointSpec::new(id, role)).unwrap();
        }
        assert_eq!(&*least_loaded(&r.endpoints()).unwrap().id, "10.0.0.1:1");
        let d = r.route(&kvroute::RouteRequest::text("m", "hello"), 0).unwrap();
        let busy = d.endpoint.unwrap();
        let other = if &*busy == "10.0.0.1:1" { "10.0.0.2:1" } else { "10.0.0.1:1" };
        assert_eq!(&*least_loaded(&r.endpoints()).unwrap().id, other);
        r.set_healthy("10.0.0.1:1", false).unwrap();
        r.set_healthy("10.0.0.2:1", false).unwrap();
        assert_eq!(&*least_loaded(&r.endpoints()).unwrap().id, "10.0.0.3:1", "any healthy endpoint");
        r.set_healthy("10.0.0.3:1", false).unwrap();
        assert!(least_loaded(&r.endpoints()).is_some(), "any endpoint at all");
        assert!(least_loaded(&[]).is_none());
    }
}
