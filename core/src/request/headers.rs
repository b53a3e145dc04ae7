//! The request headers the router reads: the `:path` pseudo-header (which API) and the headers
//! `RequestConfig` names (request id, session, fairness, priority, judgment hints).

use crate::config::RequestConfig;
use crate::error::RequestError;

use super::{Api, Horizon, JudgmentHint};

#[derive(Default)]
pub(super) struct HeaderValues {
    pub(super) path_api: Option<Api>,
    pub(super) request_id: Option<String>,
    pub(super) session_id: Option<String>,
    pub(super) fairness_id: Option<String>,
    pub(super) priority: i32,
    pub(super) hint: JudgmentHint,
}

impl HeaderValues {
    pub(super) fn collect<K: AsRef<str>, V: AsRef<str>>(
        headers: impl IntoIterator<Item = (K, V)>,
        cfg: &RequestConfig,
    ) -> Result<HeaderValues, RequestError> {
        let mut out = HeaderValues::default();
        let (mut seen_path, mut seen_prio, mut seen_h, mut seen_r, mut seen_b) = (false, false, false, false, false);
        for (k, v) in headers {
            let (k, v) = (k.as_ref(), v.as_ref().trim());
            let bad = |reason: &str| RequestError::Header {
                header: k.to_ascii_lowercase(),
                value: v.chars().take(128).collect(),
                reason: reason.to_owned(),
            };
            if k == ":path" {
                if !std::mem::replace(&mut seen_path, true) {
                    let path = v.split('?').next().unwrap_or("");
                    out.path_api = if path.ends_with("/chat/completions") {
                        Some(Api::ChatCompletions)
                    } else if path.ends_with("/completions") {
                        Some(Api::Completions)
                    } else {
                        return Err(bad("only /v1/completions and /v1/chat/completions can be routed"));
                    };
                }
            } else if k.eq_ignore_ascii_case(&cfg.request_id_header) {
                if out.request_id.is_none() && !v.is_empty() {
                    out.request_id = Some(v.to_owned());
                }
            } else if k.eq_ignore_ascii_case(&cfg.session_header) {
                if out.session_id.is_none() && !v.is_empty() {
                    out.session_id = Some(v.to_owned());
                }
            } else if k.eq_ignore_ascii_case(&cfg.fairness_header) {
                if out.fairness_id.is_none() && !v.is_empty() {
                    out.fairness_id = Some(v.to_owned());
                }
            } else if k.eq_ignore_ascii_case(&cfg.priority_header) {
                if !std::mem::replace(&mut seen_prio, true) {
                    out.priority = v.parse().map_err(|_| bad("must be an integer (negative = sheddable)"))?;
                }
            } else if k.eq_ignore_ascii_case(&cfg.horizon_header) {
                if !std::mem::replace(&mut seen_h, true) {
                    out.hint.horizon = Some(match v.to_ascii_lowercase().as_str() {
                        "short" => Horizon::Short,
                        "medium" => Horizon::Medium,
                        "long" => Horizon::Long,
                        _ => return Err(bad("must be short, medium or long")),
                    });
                }
            } else if k.eq_ignore_ascii_case(&cfg.risk_header) {
                if !std::mem::replace(&mut seen_r, true) {
                    match v.parse::<u8>() {
                        Ok(r) if r <= 3 => out.hint.risk = Some(r),
                        _ => return Err(bad("must be an integer 0..=3")),
                    }
                }
            } else if k.eq_ignore_ascii_case(&cfg.bypass_probability_header) && !std::mem::replace(&mut seen_b, true) {
                match v.parse::<f64>() {
                    Ok(p) if (0.0..=1.0).contains(&p) => out.hint.bypass_probability = Some(p),
                    _ => return Err(bad("must be a number within [0, 1]")),
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::RequestConfig;
    use crate::error::RequestError;
    use crate::request::tests::parse;
    use crate::request::{Horizon, JudgmentHint, RouteRequest};

    #[test]
    fn headers_are_read_case_insensitively() {
        let r = parse(
            r#"{"model":"sql-lora","prompt":"x","cache_salt":"t1"}"#,
            &[
                ("X-Session-Id", "s1"),
                ("x-llm-d-inference-fairness-id", "tenant-a"),
                ("X-KVROUTE-PRIORITY", "-2"),
                ("x-kvroute-horizon", "Long"),
                ("x-kvroute-risk", "3"),
                ("x-kvroute-bypass-probability", "0.5"),
                ("x-request-id", "req-1"),
                ("x-request-id", "ignored"),
            ],
        )
        .unwrap();
        assert_eq!(r.session_id.as_deref(), Some("s1"));
        assert_eq!(r.fairness_id.as_deref(), Some("tenant-a"));
        assert_eq!(r.priority, -2);
        assert_eq!(r.hint, JudgmentHint { horizon: Some(Horizon::Long), risk: Some(3), bypass_probability: Some(0.5) });
        assert_eq!(r.request_id.as_deref(), Some("req-1"));
        assert_eq!(r.cache_salt.as_deref(), Some("t1"));
        assert_eq!(r.lora_adapter, None);
        let r = parse(r#"{"model":"m","prompt":"x","cache_salt":""}"#, &[]).unwrap();
        assert_eq!(r.cache_salt, None, "an empty salt is no salt");
        let r = parse(r#"{"model":"m","prompt":"x","cache_salt":null}"#, &[]).unwrap();
        assert_eq!(r.cache_salt, None);
        let mut cfg = RequestConfig::default();
        cfg.lora_adapters.insert("sql-lora".into(), "sql-adapter".into());
        let r = RouteRequest::parse(br#"{"model":"sql-lora","prompt":"x"}"#, [("a", "b")], &cfg).unwrap();
        assert_eq!(r.lora_adapter.as_deref(), Some("sql-adapter"));
    }

    #[test]
    fn bad_headers_are_typed_errors() {
        for (h, v) in [
            ("x-kvroute-priority", "high"),
            ("x-kvroute-horizon", "forever"),
            ("x-kvroute-risk", "4"),
            ("x-kvroute-bypass-probability", "1.5"),
            ("x-kvroute-bypass-probability", "NaN"),
            (":path", "/v1/embeddings"),
            // vLLM's tokens-in API carries media features next to token ids: not routed.
            (":path", "/inference/v1/generate"),
        ] {
            let e = parse(r#"{"model":"m","prompt":"x"}"#, &[(h, v)]).unwrap_err();
            assert!(matches!(&e, RequestError::Header { header, value, .. } if header == h && value == v), "{e:?}");
        }
    }
}
