//! Prometheus text: reading model-server metrics (vLLM and SGLang) into a [`MetricsSnapshot`],
//! and writing the router's own metrics.

use std::fmt::Write as _;

use crate::endpoints::MetricsSnapshot;
use crate::error::StateError;

/// A metrics page could not be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsError {
    /// A line of a metric kvroute reads is malformed or out of range.
    #[error("metrics line {line}: {reason}: {text:?}")]
    Malformed {
        /// 1-based line number.
        line: usize,
        /// The line (truncated).
        text: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// The page has none of the metrics kvroute reads (vLLM's `vllm:num_requests_waiting` …,
    /// SGLang's `sglang:num_queue_reqs` …).
    #[error("no vLLM or SGLang engine metrics found")]
    NoKnownMetrics,
    /// The endpoint is unknown (or the snapshot invalid).
    #[error(transparent)]
    State(#[from] StateError),
}

/// One sample: name, labels, value.
struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, String)>,
    value: f64,
}

fn parse_line(line: &str) -> Result<Option<Sample<'_>>, &'static str> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).ok_or("no value")?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices().peekable();
        let close;
        loop {
            // skip separators
            while let Some(&(_, c)) = chars.peek() {
                if c == ',' || c.is_whitespace() {
                    chars.next();
                } else {
                    break;
                }
            }
            let Some(&(start, c)) = chars.peek() else { return Err("unterminated label set") };
            if c == '}' {
                close = start;
                break;
            }
            let mut eq = None;
            for (i, c) in chars.by_ref() {
                if c == '=' {
                    eq = Some(i);
                    break;
                }
            }
            let eq = eq.ok_or("label without '='")?;
            let key = body[start..eq].trim();
            if chars.next().map(|(_, c)| c) != Some('"') {
                return Err("label value not quoted");
            }
            let mut value = String::new();
            let mut closed = false;
            while let Some((_, c)) = chars.next() {
                match c {
                    '\\' => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, other)) => value.push(other),
                        None => return Err("unterminated label value"),
                    },
                    '"' => {
                        closed = true;
                        break;
                    }
                    other => value.push(other),
                }
            }
            if !closed {
                return Err("unterminated label value");
            }
            labels.push((key, value));
        }
        rest = &body[close + 1..];
    }
    let value_text = rest.split_whitespace().next().ok_or("no value")?;
    let value = match value_text {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse::<f64>().map_err(|_| "value is not a number")?,
    };
    Ok(Some(Sample { name, labels, value }))
}

fn label<'a>(s: &'a Sample<'_>, key: &str) -> Option<&'a str> {
    s.labels.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_str())
}

fn split_list(v: &str) -> Vec<String> {
    v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect()
}

/// Read a vLLM or SGLang `/metrics` page. Queue and running counts are summed over series (data
/// parallel engines report one each); KV usage is the maximum; LoRA adapters come from the
/// newest `vllm:lora_requests_info` series; `vllm:cache_config_info` gives the KV capacity.
/// Lines of other metrics are ignored, whatever they contain.
pub fn parse_prometheus(text: &str, now_ms: u64) -> Result<MetricsSnapshot, MetricsError> {
    let mut m = MetricsSnapshot { updated_ms: now_ms, ..Default::default() };
    let (mut found, mut waiting, mut running, mut kv) = (false, 0.0f64, 0.0f64, None::<f64>);
    let mut lora_ts = f64::NEG_INFINITY;
    for (i, raw) in text.lines().enumerate() {
        let bad = |reason| MetricsError::Malformed { line: i + 1, text: raw.chars().take(160).collect(), reason };
        // Only lines of metrics we read may fail the page.
        let name = raw.trim_start().split(|c: char| c == '{' || c.is_whitespace()).next().unwrap_or("");
        let known = matches!(
            name,
            "vllm:num_requests_waiting"
                | "vllm:num_requests_running"
                | "vllm:kv_cache_usage_perc"
                | "vllm:gpu_cache_usage_perc"
                | "vllm:lora_requests_info"
                | "vllm:cache_config_info"
                | "sglang:num_queue_reqs"
                | "sglang:num_running_reqs"
                | "sglang:token_usage"
        );
        if !known {
            continue;
        }
        let Some(s) = parse_line(raw).map_err(bad)? else { continue };
        if !s.value.is_finite() {
            return Err(bad("value is not finite"));
        }
        found = true;
        match s.name {
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => {
                if s.value < 0.0 {
                    return Err(bad("negative count"));
                }
                waiting += s.value;
            }
            "vllm:num_requests_running" | "sglang:num_running_reqs" => {
                if s.value < 0.0 {
                    return Err(bad("negative count"));
                }
                running += s.value;
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                if !(0.0..=1.0).contains(&s.value) {
                    return Err(bad("KV usage must be within [0, 1]"));
                }
                kv = Some(kv.map_or(s.value, |k: f64| k.max(s.value)));
            }
            "vllm:lora_requests_info" if s.value >= lora_ts => {
                lora_ts = s.value;
                m.lora_running = label(&s, "running_lora_adapters").map(split_list).unwrap_or_default();
                m.lora_waiting = label(&s, "waiting_lora_adapters").map(split_list).unwrap_or_default();
                m.max_lora = match label(&s, "max_lora") {
                    Some(v) => Some(v.trim().parse().map_err(|_| bad("max_lora is not an integer"))?),
                    None => None,
                };
            }
            "vllm:cache_config_info" => {
                let num = |k| label(&s, k).and_then(|v| v.trim().parse::<u64>().ok());
                if let (Some(bs), Some(n)) = (num("block_size"), num("num_gpu_blocks")) {
                    m.kv_capacity_tokens = Some(bs.saturating_mul(n));
                }
            }
            _ => {}
        }
    }
    if !found {
        return Err(MetricsError::NoKnownMetrics);
    }
    m.waiting = waiting.round().min(f64::from(u32::MAX)) as u32;
    m.running = running.round().min(f64::from(u32::MAX)) as u32;
    m.kv_usage = kv.unwrap_or(0.0);
    Ok(m)
}

/// A Prometheus exposition writer.
pub(crate) struct Exposition {
    out: String,
}

impl Exposition {
    pub(crate) fn new() -> Self {
        Exposition { out: String::with_capacity(4096) }
    }

    pub(crate) fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    pub(crate) fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"");
                for c in v.chars() {
                    match c {
                        '\\' => self.out.push_str("\\\\"),
                        '"' => self.out.push_str("\\\""),
                        '\n' => self.out.push_str("\\n"),
                        c => self.out.push(c),
                    }
                }
                self.out.push('"');
            }
            self.out.push('}');
        }
        if value.fract() == 0.0 && value.abs() < 1e15 {
            let _ = writeln!(self.out, " {}", value as i64);
        } else {
            let _ = writeln!(self.out, " {value}");
        }
    }

    pub(crate) fn finish(self) -> String {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 3.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 2.0
vllm:num_requests_running{engine="0",model_name="llama"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.57
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 1.7e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters="x"} 1.6e+09
vllm:cache_config_info{block_size="16",num_gpu_blocks="27000",cache_dtype="auto"} 1.0
vllm:prefix_cache_hits_total{engine="0"} 1234
vllm:weird_thing{a="b \"quoted\" \\ back"} NaN
"#;

    #[test]
    fn vllm_page() {
        let m = parse_prometheus(VLLM, 77).unwrap();
        assert_eq!((m.waiting, m.running, m.kv_usage, m.updated_ms), (5, 7, 0.57, 77));
        assert_eq!(m.lora_running, vec!["sql".to_owned(), "chat".to_owned()]);
        assert!(m.lora_waiting.is_empty(), "the newest series wins");
        assert_eq!(m.max_lora, Some(4));
        assert_eq!(m.kv_capacity_tokens, Some(432_000));
    }

    #[test]
    fn sglang_page() {
        let text = "sglang:num_queue_reqs{model_name=\"m\"} 4\nsglang:num_running_reqs{model_name=\"m\"} 9\nsglang:token_usage{model_name=\"m\"} 0.31\nsglang:cache_hit_rate{model_name=\"m\"} 0.5\n";
        let m = parse_prometheus(text, 5).unwrap();
        assert_eq!((m.waiting, m.running, m.kv_usage), (4, 9, 0.31));
    }

    #[test]
    fn errors_name_the_line() {
        assert_eq!(parse_prometheus("foo 1\n# nothing\n", 0), Err(MetricsError::NoKnownMetrics));
        let e = parse_prometheus("vllm:num_requests_waiting{a=\"b\"} many\n", 0).unwrap_err();
        assert!(matches!(e, MetricsError::Malformed { line: 1, reason: "value is not a number", .. }), "{e:?}");
        let e = parse_prometheus("x 1\nvllm:kv_cache_usage_perc 1.5\n", 0).unwrap_err();
        assert!(matches!(e, MetricsError::Malformed { line: 2, .. }), "{e:?}");
        let e = parse_prometheus("vllm:num_requests_running{a=\"unterminated} 1\n", 0).unwrap_err();
        assert!(matches!(e, MetricsError::Malformed { reason: "unterminated label value", .. }), "{e:?}");
        assert!(parse_prometheus("vllm:num_requests_running -1\n", 0).is_err());
        assert!(parse_prometheus("vllm:num_requests_running NaN\n", 0).is_err());
    }

    #[test]
    fn exposition_escapes_labels() {
        let mut e = Exposition::new();
        e.header("kvroute_x", "gauge", "help");
        e.sample("kvroute_x", &[("endpoint", "a\"b\\c")], 1.5);
        e.sample("kvroute_x", &[], 2.0);
        assert_eq!(
            e.finish(),
            "# HELP kvroute_x help\n# TYPE kvroute_x gauge\nkvroute_x{endpoint=\"a\\\"b\\\\c\"} 1.5\nkvroute_x 2\n"
        );
    }
}
