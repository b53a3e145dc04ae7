//! The request headers the router reads: the `:path` pseudo-header (which API) and the headers
//! `RequestConfig` names (request id, session, fairness, priority and objective, TTFT objective,
//! queue TTL, judgment hints).

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
    pub(super) objective: Option<String>,
    pub(super) slo_ttft_ms: Option<u64>,
    pub(super) queue_ttl_ms: Option<u64>,
    pub(super) hint: JudgmentHint,
    /// The body is binary token ids (`content-type` is `token_ids_content_type`).
    pub(super) binary_tokens: bool,
    /// `model_header` (used by binary token-id bodies).
    pub(super) model: Option<String>,
    /// `max_tokens_header` (used by binary token-id bodies).
    pub(super) max_tokens: Option<u32>,
}

impl HeaderValues {
    pub(super) fn collect<K: AsRef<str>, V: AsRef<str>>(
        headers: impl IntoIterator<Item = (K, V)>,
        cfg: &RequestConfig,
    ) -> Result<HeaderValues, RequestError> {
        let mut out = HeaderValues::default();
        let (mut seen_path, mut seen_prio, mut seen_h, mut seen_r, mut seen_b) = (false, false, false, false, false);
        let (mut direct_priority, mut fairness_alias, mut slo_alias) = (None, None, None);
        let (mut seen_slo, mut seen_slo_alias, mut seen_ttl) = (false, false, false);
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
            } else if k.eq_ignore_ascii_case("content-type") {
                let media = v.split(';').next().unwrap_or("").trim();
                if !cfg.token_ids_content_type.is_empty() && media.eq_ignore_ascii_case(&cfg.token_ids_content_type) {
                    out.binary_tokens = true;
                }
            } else if k.eq_ignore_ascii_case(&cfg.model_header) {
                if out.model.is_none() && !v.is_empty() {
                    out.model = Some(v.to_owned());
                }
            } else if k.eq_ignore_ascii_case(&cfg.max_tokens_header) {
                if out.max_tokens.is_none() {
                    match v.parse::<u32>() {
                        Ok(m) => out.max_tokens = Some(m),
                        Err(_) => return Err(bad("must be a non-negative integer below 2^32")),
                    }
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
            } else if k.eq_ignore_ascii_case(&cfg.fairness_alias_header) {
                if fairness_alias.is_none() && !v.is_empty() {
                    fairness_alias = Some(v.to_owned());
                }
            } else if k.eq_ignore_ascii_case(&cfg.priority_header) {
                if !std::mem::replace(&mut seen_prio, true) {
                    let p: i32 = v.parse().map_err(|_| bad("must be an integer (negative = sheddable)"))?;
                    direct_priority = Some(p);
                }
            } else if k.eq_ignore_ascii_case(&cfg.objective_header) {
                if out.objective.is_none() && !v.is_empty() {
                    out.objective = Some(v.to_owned());
                }
            } else if k.eq_ignore_ascii_case(&cfg.slo_ttft_header) {
                if !std::mem::replace(&mut seen_slo, true) {
                    out.slo_ttft_ms = Some(parse_ms(v).map_err(bad)?);
                }
            } else if k.eq_ignore_ascii_case(&cfg.slo_ttft_alias_header) {
                if !std::mem::replace(&mut seen_slo_alias, true) {
                    slo_alias = Some(parse_ms(v).map_err(bad)?);
                }
            } else if k.eq_ignore_ascii_case(&cfg.queue_ttl_header) {
                if !std::mem::replace(&mut seen_ttl, true) {
                    out.queue_ttl_ms = Some(parse_go_duration_ms(v).map_err(bad)?);
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
        if out.fairness_id.is_none() {
            out.fairness_id = fairness_alias;
        }
        if out.slo_ttft_ms.is_none() {
            out.slo_ttft_ms = slo_alias;
        }
        // The objective's priority and the direct header's: the higher wins; neither gives 0.
        let objective_priority = out.objective.as_deref().and_then(|o| cfg.objectives.get(o)).copied();
        out.priority = match (objective_priority, direct_priority) {
            (Some(a), Some(b)) => a.max(b),
            (Some(p), None) | (None, Some(p)) => p,
            (None, None) => 0,
        };
        Ok(out)
    }
}

/// A non-negative integer number of milliseconds.
fn parse_ms(v: &str) -> Result<u64, &'static str> {
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err("must be a non-negative integer (milliseconds)");
    }
    v.parse().map_err(|_| "must be a non-negative integer (milliseconds)")
}

/// A positive Go duration (`1500ms`, `2s`, `1m30s`, `0.5h`; units `ns`, `us`, `µs`, `ms`, `s`,
/// `m`, `h`), in whole milliseconds rounded up (so a positive duration is never 0).
pub(crate) fn parse_go_duration_ms(v: &str) -> Result<u64, &'static str> {
    const BAD: &str = "must be a positive Go duration such as 1500ms, 2s or 1m30s";
    let mut rest = v;
    let mut total_ns: f64 = 0.0;
    if rest.is_empty() {
        return Err(BAD);
    }
    while !rest.is_empty() {
        let num_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or(BAD)?;
        let (num, tail) = rest.split_at(num_end);
        if num.is_empty() || num == "." {
            return Err(BAD);
        }
        let n: f64 = num.parse().map_err(|_| BAD)?;
        let unit_end = tail.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_end);
        let scale = match unit {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return Err(BAD),
        };
        total_ns += n * scale;
        rest = tail;
    }
    let ms = (total_ns / 1e6).ceil();
    if !ms.is_finite() || ms <= 0.0 || ms > 1e15 {
        return Err(BAD);
    }
    Ok(ms as u64)
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
    fn flow_control_headers() {
        let mut cfg = RequestConfig::default();
        cfg.objectives.insert("batch".into(), -1);
        cfg.objectives.insert("interactive".into(), 10);
        let p = |headers: &[(&str, &str)]| {
            RouteRequest::parse(br#"{"model":"m","prompt":"x"}"#, headers.iter().copied(), &cfg).unwrap()
        };
        let r = p(&[("x-gateway-inference-fairness-id", "old"), ("x-llm-d-inference-fairness-id", "new")]);
        assert_eq!(r.fairness_id.as_deref(), Some("new"), "the primary header wins over the alias");
        let r = p(&[("X-Gateway-Inference-Fairness-Id", "old")]);
        assert_eq!(r.fairness_id.as_deref(), Some("old"), "the alias alone is read");
        let r = p(&[("x-llm-d-inference-objective", "batch")]);
        assert_eq!((r.priority, r.objective.as_deref()), (-1, Some("batch")));
        let r = p(&[("x-llm-d-inference-objective", "batch"), ("x-kvroute-priority", "3")]);
        assert_eq!(r.priority, 3, "the higher of objective and direct priority wins");
        let r = p(&[("x-llm-d-inference-objective", "interactive"), ("x-kvroute-priority", "3")]);
        assert_eq!(r.priority, 10);
        let r = p(&[("x-llm-d-inference-objective", "unknown")]);
        assert_eq!(
            (r.priority, r.objective.as_deref()),
            (0, Some("unknown")),
            "an unlisted objective gives no priority"
        );
        let r = p(&[("x-slo-ttft-ms", "250"), ("x-llm-d-slo-ttft-ms", "100")]);
        assert_eq!(r.slo_ttft_ms, Some(100), "the primary SLO header wins");
        let r = p(&[("x-slo-ttft-ms", "250")]);
        assert_eq!(r.slo_ttft_ms, Some(250));
        for (v, ms) in
            [("1500ms", 1500), ("2s", 2000), ("1m30s", 90_000), ("0.5h", 1_800_000), ("1us", 1), ("1.5s", 1500)]
        {
            assert_eq!(p(&[("x-llm-d-inference-ttl", v)]).queue_ttl_ms, Some(ms), "{v}");
        }
        let r = p(&[]);
        assert_eq!((r.slo_ttft_ms, r.queue_ttl_ms, r.objective, r.priority), (None, None, None, 0));
    }

    #[test]
    fn bad_headers_are_typed_errors() {
        for (h, v) in [
            ("x-kvroute-priority", "high"),
            ("x-kvroute-horizon", "forever"),
            ("x-kvroute-risk", "4"),
            ("x-kvroute-bypass-probability", "1.5"),
            ("x-kvroute-bypass-probability", "NaN"),
            ("x-llm-d-slo-ttft-ms", "-5"),
            ("x-slo-ttft-ms", "fast"),
            ("x-llm-d-slo-ttft-ms", "1.5"),
            ("x-llm-d-inference-ttl", "10"),
            ("x-llm-d-inference-ttl", "0s"),
            ("x-llm-d-inference-ttl", "-1s"),
            ("x-llm-d-inference-ttl", "3 days"),
            ("x-llm-d-inference-ttl", "ms"),
            (":path", "/v1/embeddings"),
            // vLLM's tokens-in API carries media features next to token ids: not routed.
            (":path", "/inference/v1/generate"),
        ] {
            let e = parse(r#"{"model":"m","prompt":"x"}"#, &[(h, v)]).unwrap_err();
            assert!(matches!(&e, RequestError::Header { header, value, .. } if header == h && value == v), "{e:?}");
        }
    }
}
