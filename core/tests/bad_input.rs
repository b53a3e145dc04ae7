//! Garbage in: typed errors out, never a panic, never changed state.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute::{EndpointSpec, RequestError, Role, RouteError, Router, StateError};
use proptest::prelude::*;

fn router() -> Router {
    let r = Router::default();
    r.upsert_endpoint(EndpointSpec::new("10.0.0.1:8000", Role::Decode)).unwrap();
    r.upsert_endpoint(EndpointSpec::new("10.0.0.2:8000", Role::Prefill)).unwrap();
    r
}

fn snapshot(r: &Router) -> String {
    format!("{:?}", (r.endpoints(), r.stats().index, r.stats().inflight_requests))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bodies_and_headers_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512),
                                                headers in proptest::collection::vec(("[a-zA-Z:-]{0,24}", "\\PC{0,24}"), 0..6)) {
        let r = router();
        let before = snapshot(&r);
        match r.route_http(&body, headers.iter().map(|(k, v)| (k.as_str(), v.as_str())), 0) {
            Ok(d) => prop_assert!(d.endpoint().is_some() || d.shed().is_some()),
            Err(RouteError::Request(_)) => prop_assert_eq!(snapshot(&r), before),
            Err(e) => prop_assert!(false, "unexpected error {e:?}"),
        }
    }

    #[test]
    fn json_shaped_garbage_gets_field_errors(model in prop_oneof![Just("\"m\"".to_string()), "[1-9][0-9]{0,2}", Just("null".into()), Just("[]".into())],
                                            prompt in prop_oneof![Just("\"p\"".to_string()), "\\[((0|-?[1-9][0-9]{0,11}),){0,3}(0|-?[1-9][0-9]{0,11})\\]", Just("{}".into()), Just("[[1],\"x\"]".into()), Just("true".into())],
                                            max in prop_oneof![Just("1".to_string()), Just("-1".into()), Just("\"x\"".into()), Just("1.5".into()), Just("null".into())]) {
        let r = router();
        let body = format!(r#"{{"model":{model},"prompt":{prompt},"max_tokens":{max}}}"#);
        let before = snapshot(&r);
        if let Err(e) = r.route_http(body.as_bytes(), [("a", "b")], 0) {
            match e {
                RouteError::Request(RequestError::Field { field, .. }) => {
                    prop_assert!(["model", "prompt", "max_tokens"].iter().any(|f| field.starts_with(f)), "{field}");
                }
                other => prop_assert!(false, "unexpected {other:?}"),
            }
            prop_assert_eq!(snapshot(&r), before);
        }
    }
}

#[test]
fn huge_bodies_are_refused_before_parsing() {
    let r = router();
    let body = vec![b'{'; 9 << 20];
    let e = r.route_http(&body, [("a", "b")], 0).unwrap_err();
    assert_eq!(e, RouteError::Request(RequestError::BodyTooLarge { size: 9 << 20, limit: 8 << 20 }));
    let deep = "[".repeat(100_000);
    let e = r.route_http(format!(r#"{{"model":"m","prompt":{deep}"#).as_bytes(), [("a", "b")], 0).unwrap_err();
    assert!(matches!(e, RouteError::Request(RequestError::Json { .. } | RequestError::Field { .. })), "{e:?}");
}

#[test]
fn state_calls_reject_bad_input_without_side_effects() {
    let r = router();
    let before = snapshot(&r);
    for bad in ["", "10.0.0.1", "10.0.0.1:", "x:y", "10.0.0.1:70000", "::1:80", "10.0.0.1:8000/path"] {
        assert!(
            matches!(
                r.upsert_endpoint(EndpointSpec::new(bad, Role::Decode)),
                Err(StateError::InvalidEndpointId { .. })
            ),
            "{bad}"
        );
    }
    assert!(matches!(r.complete("never-routed"), Err(StateError::UnknownRequest { .. })));
    assert!(matches!(r.set_healthy("10.0.0.9:1", false), Err(StateError::UnknownEndpoint { .. })));
    assert_eq!(snapshot(&r), before);
}
