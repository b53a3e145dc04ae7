//! The binary token-id body (`request.token_ids_content_type`): little-endian `u32` token ids,
//! the model in a header. It must give the same request as the JSON body with the same ids, and
//! bad bodies and headers must be typed errors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute::{
    EndpointSpec, MetricsSnapshot, Policy, Prompt, RequestConfig, RequestError, Role, RouteError, RouteRequest, Router,
};

const CT: &str = "application/vnd.kvroute.token-ids";

fn le(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|t| t.to_le_bytes()).collect()
}

#[test]
fn a_binary_body_is_the_json_token_id_request() {
    let cfg = RequestConfig::default();
    let ids: Vec<u32> = (0..3000u32).map(|i| i.wrapping_mul(2_654_435_761) % 150_000).chain([0, u32::MAX]).collect();
    let json = serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 7}).to_string();
    let headers = [("x-session-id", "s"), ("x-request-id", "r1"), ("x-kvroute-priority", "2")];
    let from_json = RouteRequest::parse(json.as_bytes(), headers, &cfg).unwrap();
    let bin_headers = [
        ("Content-Type", "Application/VND.kvroute.token-ids; charset=binary"),
        ("x-kvroute-model", "m"),
        ("x-kvroute-max-tokens", "7"),
        ("x-session-id", "s"),
        ("x-request-id", "r1"),
        ("x-kvroute-priority", "2"),
    ];
    let from_bin = RouteRequest::parse(&le(&ids), bin_headers, &cfg).unwrap();
    assert_eq!(from_bin, from_json);
    assert_eq!(from_bin.prompts, vec![Prompt::Tokens(ids)]);
}

#[test]
fn bad_binary_bodies_and_headers_are_typed_errors() {
    let cfg = RequestConfig::default();
    let ok = [("content-type", CT), ("x-kvroute-model", "m")];
    let err =
        |body: &[u8], headers: &[(&str, &str)]| RouteRequest::parse(body, headers.iter().copied(), &cfg).unwrap_err();
    assert_eq!(err(b"", &ok), RequestError::EmptyBody);
    assert!(
        matches!(err(&[1, 2, 3, 4, 5], &ok), RequestError::Field { field, message } if field == "body" && message.contains("multiple of 4"))
    );
    assert!(
        matches!(err(&le(&[1]), &[("content-type", CT)]), RequestError::Header { header, .. } if header == "x-kvroute-model")
    );
    let chat = [("content-type", CT), ("x-kvroute-model", "m"), (":path", "/v1/chat/completions")];
    assert!(
        matches!(err(&le(&[1]), &chat), RequestError::Field { field, message } if field == "body" && message.contains("chat"))
    );
    let bad_max = [("content-type", CT), ("x-kvroute-model", "m"), ("x-kvroute-max-tokens", "-1")];
    assert!(
        matches!(err(&le(&[1]), &bad_max), RequestError::Header { header, .. } if header == "x-kvroute-max-tokens")
    );
    // Another content type (or none) is a JSON body as before: these bytes are not JSON.
    assert!(matches!(
        err(&le(&[1]), &[("content-type", "application/json"), ("x-kvroute-model", "m")]),
        RequestError::Json { .. }
    ));
    // Turned off by configuration: the same.
    let off = RequestConfig { token_ids_content_type: String::new(), ..RequestConfig::default() };
    let e = RouteRequest::parse(&le(&[1]), ok, &off).unwrap_err();
    assert!(matches!(e, RequestError::Json { .. }), "{e:?}");
    // Too large: the body limit holds for binary bodies too.
    let small = RequestConfig { max_body_bytes: 8, ..RequestConfig::default() };
    let e = RouteRequest::parse(&le(&[1, 2, 3]), ok, &small).unwrap_err();
    assert!(matches!(e, RequestError::BodyTooLarge { size: 12, limit: 8 }), "{e:?}");
}

#[test]
fn a_bad_content_type_in_the_policy_is_rejected() {
    for bad in ["text", "application/x; q=1", "a/b c"] {
        let doc = serde_json::json!({"request": {"token_ids_content_type": bad}}).to_string();
        assert!(Policy::from_json(&doc).is_err(), "{bad}");
    }
    let doc = serde_json::json!({"request": {"token_ids_content_type": "", "model_header": "x-model"}}).to_string();
    assert!(Policy::from_json(&doc).is_ok());
    let doc = serde_json::json!({"request": {"model_header": "X Model"}}).to_string();
    assert!(Policy::from_json(&doc).is_err());
}

#[test]
fn route_http_routes_a_binary_body_as_its_json_twin() {
    let make = || {
        let r = Router::new(Policy::default());
        for (i, id) in ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"].iter().enumerate() {
            r.upsert_endpoint(EndpointSpec::new(*id, Role::Decode)).unwrap();
            let m = MetricsSnapshot { waiting: i as u32, kv_usage: 0.2, updated_ms: 0, ..Default::default() };
            r.update_metrics(id, m).unwrap();
        }
        r
    };
    let (a, b) = (make(), make());
    for turn in 0..6u32 {
        let ids: Vec<u32> = (0..(200 + 64 * turn)).map(|i| i % 977).collect();
        let json = serde_json::json!({"model": "m", "prompt": ids}).to_string();
        let da = a.route_http(json.as_bytes(), [("x-request-id", format!("r{turn}").as_str())], 1).unwrap();
        let headers = [("content-type", CT), ("x-kvroute-model", "m"), ("x-request-id", &format!("r{turn}"))];
        let db = b.route_http(&le(&ids), headers, 1).unwrap();
        assert_eq!(da.outcome, db.outcome, "turn {turn}");
        assert_eq!(da.headers, db.headers, "turn {turn}");
        assert_eq!(da.prefix_hit, db.prefix_hit, "turn {turn}");
    }
    let e = b.route_http(&[0, 1, 2], [("content-type", CT), ("x-kvroute-model", "m")], 1).unwrap_err();
    assert!(matches!(e, RouteError::Request(RequestError::Field { .. })), "{e:?}");
}
