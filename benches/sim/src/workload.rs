//! Workloads: the built-in synthetic multi-turn agent workload and JSONL traces.
//!
//! # JSONL trace format
//!
//! One request per line (blank lines are skipped):
//!
//! ```text
//! {"t_ms": 1250, "body": {"model": "llama", "messages": [...], "max_tokens": 120, "cache_salt": "tenant-0"},
//!  "headers": {"x-session-id": "s-7", "x-request-id": "s-7-t2"}, "output_tokens": 120}
//! ```
//!
//! (shown wrapped; each request is one line in the file)
//!
//! - `t_ms` (integer ≥ 0, required): arrival time in milliseconds from the start of the trace.
//!   Lines need not be sorted; requests are replayed in time order (ties keep file order).
//! - `body` (object, required): the OpenAI `/v1/chat/completions` or `/v1/completions` body exactly
//!   as a client would send it. The router parses it, and the simulated endpoints cache the same
//!   rendered prompt bytes the router hashes.
//! - `headers` (object of string values, optional): request headers, e.g. `x-session-id`,
//!   `x-request-id`, `x-kvroute-priority`.
//! - `output_tokens` (integer ≥ 0, required): how many tokens the response really has (drives the
//!   simulated decode time; `max_tokens` in the body is only what the router sees).
//!
//! Unknown fields are rejected. A malformed line is a [`SimError::TraceLine`] naming the line.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::SimError;

/// One request of a workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival time, milliseconds from the start of the workload.
    pub t_ms: u64,
    /// Serialized OpenAI request body (JSON).
    pub body: Vec<u8>,
    /// Request headers (name, value).
    pub headers: Vec<(String, String)>,
    /// True output length in tokens.
    pub output_tokens: u32,
}

/// Inclusive range of integers, written `A-B` or `N` on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Span {
    /// Smallest value.
    pub min: u32,
    /// Largest value.
    pub max: u32,
}

impl Span {
    /// A range `min..=max`.
    pub const fn new(min: u32, max: u32) -> Span {
        Span { min, max }
    }

    pub(crate) fn draw(self, rng: &mut StdRng) -> u32 {
        rng.random_range(self.min..=self.max.max(self.min))
    }

    pub(crate) fn mean(self) -> f64 {
        (f64::from(self.min) + f64::from(self.max)) / 2.0
    }
}

impl std::str::FromStr for Span {
    type Err = String;

    fn from_str(s: &str) -> Result<Span, String> {
        let parse = |x: &str| x.trim().parse::<u32>().map_err(|_| format!("{x:?} is not a non-negative integer"));
        let span = match s.split_once('-') {
            Some((a, b)) => Span::new(parse(a)?, parse(b)?),
            None => {
                let n = parse(s)?;
                Span::new(n, n)
            }
        };
        if span.min > span.max {
            return Err(format!("range {s:?} is empty (min > max)"));
        }
        Ok(span)
    }
}

impl std::fmt::Display for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}-{}", self.min, self.max)
        }
    }
}

/// Default number of tenants.
pub const DEFAULT_TENANTS: u32 = 4;
/// Default number of sessions.
pub const DEFAULT_SESSIONS: u32 = 1_000;
/// Default turns per session.
pub const DEFAULT_TURNS: Span = Span::new(6, 10);
/// Default session arrival rate (sessions per second).
pub const DEFAULT_RATE: f64 = 2.5;
/// Default shared system prompt length per tenant (tokens).
pub const DEFAULT_SYSTEM_TOKENS: Span = Span::new(1_500, 3_000);
/// Default new user message length per turn (tokens).
pub const DEFAULT_USER_TOKENS: Span = Span::new(100, 600);
/// Default response length (tokens).
pub const DEFAULT_OUTPUT_TOKENS: Span = Span::new(40, 400);
/// Default mean think time between a response and the next turn (ms, exponential).
pub const DEFAULT_THINK_MS: f64 = 3_000.0;
/// Bytes per token of the generated text (the router's default pseudo-token size).
pub const BYTES_PER_TOKEN: usize = 4;

/// What a workload's prompts share: the simulator's synthetic workload and the reference worker's
/// demo both come in these two kinds (with feature `cli`, a `clap::ValueEnum` too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum WorkloadKind {
    /// Multi-turn agent sessions: tenants' long shared system prompts and growing conversations.
    #[default]
    Agents,
    /// Every request a one-turn session with a prompt of its own: no request can reuse anything
    /// another one sent, so caching gives nothing and only load balancing counts.
    Unique,
}

impl WorkloadKind {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::Agents => "agents",
            WorkloadKind::Unique => "unique",
        }
    }
}

impl std::fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WorkloadKind {
    type Err = String;

    fn from_str(s: &str) -> Result<WorkloadKind, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "agents" => Ok(WorkloadKind::Agents),
            "unique" => Ok(WorkloadKind::Unique),
            other => Err(format!("unknown workload {other:?} (expected agents or unique)")),
        }
    }
}

/// Settings of the built-in synthetic multi-turn agent workload.
///
/// Each tenant has a shared system prompt and its own `cache_salt`. Sessions arrive as a Poisson
/// process; each belongs to a random tenant and runs several turns. Every turn appends the
/// previous assistant reply and a new user message, so the conversation (and its cacheable
/// prefix) grows. Turn `k+1` is sent a nominal response time plus an exponential think time
/// after turn `k` (open loop: arrival times do not depend on the policy, so every policy sees
/// exactly the same requests at the same times).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SyntheticConfig {
    /// What the prompts share (agent sessions, or nothing at all). [`WorkloadKind::Unique`]:
    /// every request has a system prompt and a cache salt of its own; `tenants` and `turns` are
    /// ignored.
    pub kind: WorkloadKind,
    /// Tenants (each with its own system prompt and cache salt).
    pub tenants: u32,
    /// Sessions to generate.
    pub sessions: u32,
    /// Turns per session.
    pub turns: Span,
    /// Session arrival rate, sessions per second (Poisson).
    pub rate_per_s: f64,
    /// Random seed: same seed, same workload.
    pub seed: u64,
    /// System prompt length per tenant (tokens).
    pub system_tokens: Span,
    /// New user message length per turn (tokens).
    pub user_tokens: Span,
    /// Response length (tokens); becomes the next turn's assistant message.
    pub output_tokens: Span,
    /// Mean think time between the end of a response and the next turn (ms).
    pub think_ms: f64,
    /// Nominal time per output token used to space turns (ms).
    pub nominal_tpot_ms: f64,
    /// Model name in the bodies.
    pub model: String,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        SyntheticConfig {
            kind: WorkloadKind::Agents,
            tenants: DEFAULT_TENANTS,
            sessions: DEFAULT_SESSIONS,
            turns: DEFAULT_TURNS,
            rate_per_s: DEFAULT_RATE,
            seed: 42,
            system_tokens: DEFAULT_SYSTEM_TOKENS,
            user_tokens: DEFAULT_USER_TOKENS,
            output_tokens: DEFAULT_OUTPUT_TOKENS,
            think_ms: DEFAULT_THINK_MS,
            nominal_tpot_ms: 20.0,
            model: "llama-3.1-8b-instruct".to_owned(),
        }
    }
}

impl SyntheticConfig {
    /// Check every setting.
    pub fn validate(&self) -> Result<(), SimError> {
        if self.tenants == 0 {
            return Err(SimError::setting("tenants", self.tenants, "must be at least 1"));
        }
        if self.sessions == 0 {
            return Err(SimError::setting("sessions", self.sessions, "must be at least 1"));
        }
        if self.turns.min == 0 {
            return Err(SimError::setting("turns", self.turns, "every session needs at least 1 turn"));
        }
        if self.turns.max > 1_000 {
            return Err(SimError::setting("turns", self.turns, "at most 1000 turns per session"));
        }
        if !(self.rate_per_s.is_finite() && self.rate_per_s > 0.0) {
            return Err(SimError::setting("rate", self.rate_per_s, "must be a number > 0 (sessions per second)"));
        }
        if !(self.think_ms.is_finite() && self.think_ms >= 0.0) {
            return Err(SimError::setting("think-ms", self.think_ms, "must be a number >= 0"));
        }
        if !(self.nominal_tpot_ms.is_finite() && self.nominal_tpot_ms >= 0.0) {
            return Err(SimError::setting("nominal-tpot-ms", self.nominal_tpot_ms, "must be a number >= 0"));
        }
        if self.user_tokens.min == 0 {
            return Err(SimError::setting("user-tokens", self.user_tokens, "user messages need at least 1 token"));
        }
        for (name, span) in [
            ("system-tokens", self.system_tokens),
            ("user-tokens", self.user_tokens),
            ("output-tokens", self.output_tokens),
        ] {
            if span.max > 1_000_000 {
                return Err(SimError::setting(name, span, "at most 1,000,000 tokens"));
            }
        }
        if self.model.is_empty() {
            return Err(SimError::setting("model", "\"\"", "must not be empty"));
        }
        Ok(())
    }

    /// A one-line description.
    pub fn describe(&self) -> String {
        if self.kind == WorkloadKind::Unique {
            return format!(
                "synthetic unique-prompt workload: {} one-turn requests at {}/s, each with a prompt of its own \
                 ({} + {} tok), output {} tok, seed {}",
                self.sessions, self.rate_per_s, self.system_tokens, self.user_tokens, self.output_tokens, self.seed
            );
        }
        format!(
            "synthetic agent workload: {} tenants (system prompts {} tok), {} sessions at {}/s, {} turns, user {} tok, output {} tok, think {:.1}s, seed {}",
            self.tenants,
            self.system_tokens,
            self.sessions,
            self.rate_per_s,
            self.turns,
            self.user_tokens,
            self.output_tokens,
            self.think_ms / 1000.0,
            self.seed
        )
    }
}

/// Deterministic pseudo-random prose: words drawn from a per-workload vocabulary.
pub(crate) struct TextGen {
    vocab: Vec<String>,
}

impl TextGen {
    pub(crate) fn new(rng: &mut StdRng) -> TextGen {
        const ONSETS: &[&str] =
            &["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "pl", "ch"];
        const VOWELS: &[&str] = &["a", "e", "i", "o", "u", "ai", "ea", "ou"];
        const CODAS: &[&str] = &["", "", "n", "r", "s", "t", "l", "nd", "ck"];
        let vocab = (0..4096)
            .map(|_| {
                let syllables = rng.random_range(1..=3);
                let mut w = String::new();
                for _ in 0..syllables {
                    w.push_str(ONSETS[rng.random_range(0..ONSETS.len())]);
                    w.push_str(VOWELS[rng.random_range(0..VOWELS.len())]);
                    w.push_str(CODAS[rng.random_range(0..CODAS.len())]);
                }
                w
            })
            .collect();
        TextGen { vocab }
    }

    /// About `tokens` tokens of text (exactly `tokens * BYTES_PER_TOKEN` bytes).
    pub(crate) fn text(&self, rng: &mut StdRng, tokens: u32) -> String {
        let target = tokens as usize * BYTES_PER_TOKEN;
        let mut s = String::with_capacity(target + 16);
        let mut since_period = 0;
        while s.len() < target {
            let w = &self.vocab[rng.random_range(0..self.vocab.len())];
            if since_period == 0 {
                let mut c = w.chars();
                if let Some(first) = c.next() {
                    s.extend(first.to_uppercase());
                    s.push_str(c.as_str());
                }
            } else {
                s.push_str(w);
            }
            since_period += 1;
            if since_period >= rng.random_range(6..=16) {
                s.push('.');
                since_period = 0;
            }
            s.push(' ');
        }
        s.truncate(target);
        s
    }
}

pub(crate) fn exp_sample(rng: &mut StdRng, mean: f64) -> f64 {
    let u: f64 = rng.random();
    -(1.0 - u).ln() * mean
}

/// Generate the synthetic workload (sorted by arrival time).
pub fn synthetic(cfg: &SyntheticConfig) -> Result<Vec<TraceRequest>, SimError> {
    cfg.validate()?;
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let text = TextGen::new(&mut rng);
    let systems: Vec<String> = (0..cfg.tenants)
        .map(|t| {
            let tokens = cfg.system_tokens.draw(&mut rng);
            let head = format!("You are the operations agent of tenant {t}. Follow the playbook below. ");
            let body_tokens = tokens.saturating_sub((head.len() / BYTES_PER_TOKEN) as u32);
            format!("{head}{}", text.text(&mut rng, body_tokens))
        })
        .collect();

    let mut out = Vec::new();
    let mut start_ms = 0.0f64;
    for s in 0..cfg.sessions {
        start_ms += exp_sample(&mut rng, 1000.0 / cfg.rate_per_s);
        let tenant = rng.random_range(0..cfg.tenants);
        let turns = cfg.turns.draw(&mut rng);
        let session = format!("s-{s}");
        let (turns, system, salt) = match cfg.kind {
            WorkloadKind::Agents => (turns, systems[tenant as usize].clone(), format!("tenant-{tenant}")),
            WorkloadKind::Unique => {
                // A system prompt and a cache salt of its own: no block is shared with any
                // other request (the head makes even the first block distinct).
                let tokens = cfg.system_tokens.draw(&mut rng);
                let head = format!("Request {s} of a workload where no two prompts share anything. ");
                let body_tokens = tokens.saturating_sub((head.len() / BYTES_PER_TOKEN) as u32);
                (1, format!("{head}{}", text.text(&mut rng, body_tokens)), format!("request-{s}"))
            }
        };
        let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
        let mut t = start_ms;
        for k in 0..turns {
            let user_tokens = cfg.user_tokens.draw(&mut rng);
            let user = text.text(&mut rng, user_tokens);
            messages.push(serde_json::json!({"role": "user", "content": user}));
            let output_tokens = cfg.output_tokens.draw(&mut rng);
            let body = serde_json::json!({
                "model": cfg.model,
                "messages": messages,
                "max_tokens": output_tokens,
                "cache_salt": salt,
            });
            out.push(TraceRequest {
                t_ms: t as u64,
                body: serde_json::to_vec(&body).unwrap_or_default(),
                headers: vec![
                    ("x-request-id".into(), format!("{session}-t{k}")),
                    ("x-session-id".into(), session.clone()),
                ],
                output_tokens,
            });
            let reply = text.text(&mut rng, output_tokens);
            messages.push(serde_json::json!({"role": "assistant", "content": reply}));
            // Nominal response time (queueing + prefill + decode) plus the user's/tool's think time.
            t += 150.0 + f64::from(output_tokens) * cfg.nominal_tpot_ms + exp_sample(&mut rng, cfg.think_ms);
        }
    }
    out.sort_by_key(|r| r.t_ms);
    Ok(out)
}

/// Expected number of requests of a synthetic configuration.
pub fn expected_requests(cfg: &SyntheticConfig) -> f64 {
    match cfg.kind {
        WorkloadKind::Agents => f64::from(cfg.sessions) * cfg.turns.mean(),
        WorkloadKind::Unique => f64::from(cfg.sessions),
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceLine {
    t_ms: u64,
    body: serde_json::Value,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    output_tokens: u32,
}

/// Parse one JSONL line (`line` is 1-based, for the error).
fn parse_line(text: &str, line: usize) -> Result<TraceRequest, SimError> {
    let bad = |message: String| SimError::TraceLine { line, message };
    let mut de = serde_json::Deserializer::from_str(text);
    let l: TraceLine = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        // A syntax error's path is only where the parser stopped; its line/column says more.
        if path == "." || !inner.is_data() {
            bad(inner.to_string())
        } else {
            bad(format!("`{path}`: {inner}"))
        }
    })?;
    de.end().map_err(|e| bad(e.to_string()))?;
    if !l.body.is_object() {
        return Err(bad("`body` must be a JSON object (an OpenAI request body)".into()));
    }
    let body = serde_json::to_vec(&l.body).map_err(|e| bad(e.to_string()))?;
    let headers: Vec<(String, String)> = l.headers.into_iter().collect();
    // Fail early, with the line number, on bodies the router could never parse.
    kvroute::RouteRequest::parse(&body, headers.iter().map(|(k, v)| (k.as_str(), v.as_str())), &Default::default())
        .map_err(|e| bad(format!("body is not a routable request: {e}")))?;
    Ok(TraceRequest { t_ms: l.t_ms, body, headers, output_tokens: l.output_tokens })
}

/// Read a JSONL trace (see the module docs). Requests come back sorted by `t_ms` (stable).
pub fn read_jsonl(reader: impl BufRead) -> Result<Vec<TraceRequest>, SimError> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line_no = i + 1;
        let text = line.map_err(|e| SimError::TraceLine { line: line_no, message: e.to_string() })?;
        if text.trim().is_empty() {
            continue;
        }
        out.push(parse_line(&text, line_no)?);
    }
    if out.is_empty() {
        return Err(SimError::EmptyWorkload);
    }
    out.sort_by_key(|r| r.t_ms);
    Ok(out)
}

/// Write requests as a JSONL trace (see the module docs).
pub fn write_jsonl(mut w: impl Write, requests: &[TraceRequest]) -> std::io::Result<()> {
    for r in requests {
        let body: serde_json::Value = serde_json::from_slice(&r.body)?;
        let line = TraceLine {
            t_ms: r.t_ms,
            body,
            headers: r.headers.iter().cloned().collect(),
            output_tokens: r.output_tokens,
        };
        serde_json::to_writer(&mut w, &line)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

/// Read a JSONL trace file.
pub fn load_trace(path: &Path) -> Result<Vec<TraceRequest>, SimError> {
    let f = std::fs::File::open(path).map_err(|e| SimError::io(path, e))?;
    read_jsonl(std::io::BufReader::new(f))
}

/// Write a JSONL trace file.
pub fn save_trace(path: &Path, requests: &[TraceRequest]) -> Result<(), SimError> {
    let f = std::fs::File::create(path).map_err(|e| SimError::io(path, e))?;
    write_jsonl(std::io::BufWriter::new(f), requests).map_err(|e| SimError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_parse() {
        assert_eq!("6-10".parse::<Span>(), Ok(Span::new(6, 10)));
        assert_eq!("8".parse::<Span>(), Ok(Span::new(8, 8)));
        assert!("10-6".parse::<Span>().is_err());
        assert!("x".parse::<Span>().is_err());
        assert_eq!(Span::new(6, 10).to_string(), "6-10");
    }

    #[test]
    fn text_has_the_requested_size() {
        let mut rng = StdRng::seed_from_u64(1);
        let g = TextGen::new(&mut rng);
        for n in [0, 1, 7, 300] {
            assert_eq!(g.text(&mut rng, n).len(), n as usize * BYTES_PER_TOKEN);
        }
    }

    #[test]
    fn conversations_grow_by_appending() {
        let cfg = SyntheticConfig { sessions: 1, turns: Span::new(3, 3), ..Default::default() };
        let w = synthetic(&cfg).unwrap();
        assert_eq!(w.len(), 3);
        let msgs = |r: &TraceRequest| {
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            v["messages"].as_array().unwrap().clone()
        };
        let (a, b) = (msgs(&w[0]), msgs(&w[1]));
        assert_eq!(a.len(), 2);
        assert_eq!(b.len(), 4);
        assert_eq!(&b[..2], &a[..]);
        assert_eq!(b[2]["role"], "assistant");
        assert_eq!(b[2]["content"].as_str().unwrap().len(), w[0].output_tokens as usize * BYTES_PER_TOKEN);
        assert!(w[1].t_ms > w[0].t_ms);
    }
}
