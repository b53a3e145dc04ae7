//! The event-ingestion protocol: what a relay POSTs to the filter's event path, and what the
//! filter answers.
//!
//! Request: `POST <events.path>` with headers
//! - `x-kvroute-secret`: the shared secret (compared in constant time);
//! - `x-kvroute-endpoint`: the engine's endpoint id (`ip:port`, as in the filter's endpoint list);
//! - `x-kvroute-kind`: `batch` (default) or `resync`;
//! - `x-kvroute-seq`: the publisher's sequence number (decimal; absent = unnumbered), batches only;
//! - `x-kvroute-topic`: the ZMQ topic (informational);
//!
//! and, for a batch, the raw msgpack payload as published by the engine as the body.
//!
//! Answers (JSON bodies):
//! - `200 {"verdict":"applied"|"duplicate"|"reset","events":N,"blocks":N}`, or `200
//!   {"verdict":"resynced"}`;
//! - `409 {"verdict":"gap","expected":E,"got":G}`: batches are missing, nothing was applied: the
//!   relay replays from `expected` or POSTs a resync, then this batch again;
//! - `400 {"error":"decode"|"bad_request","detail":…}`: the payload or a header is malformed
//!   (nothing applied);
//! - `401 {"error":"unauthorized"}`: wrong or missing secret (nothing applied);
//! - `404 {"error":"unknown_endpoint"}`, `405` (not POST), `413` (body over `max_body_bytes`).

/// Header carrying the shared secret.
pub const HEADER_SECRET: &str = "x-kvroute-secret";
/// Header naming the engine endpoint.
pub const HEADER_ENDPOINT: &str = "x-kvroute-endpoint";
/// Header with the publisher's sequence number.
pub const HEADER_SEQ: &str = "x-kvroute-seq";
/// Header with the ZMQ topic.
pub const HEADER_TOPIC: &str = "x-kvroute-topic";
/// Header with the kind of post: `batch` or `resync`.
pub const HEADER_KIND: &str = "x-kvroute-kind";
/// Header with the post's signature: HMAC-SHA256 keyed by the shared secret (see
/// [`signature`]), lowercase hex.
pub const HEADER_SIGNATURE: &str = "x-kvroute-signature";
/// Header with the time the relay signed the post (UNIX milliseconds, decimal).
pub const HEADER_TIMESTAMP: &str = "x-kvroute-timestamp";

/// Compare two byte strings in time that depends only on their lengths (never on where they
/// differ). Both are first reduced to SHA-256 digests, so even the length of the secret does not
/// leak through timing.
pub fn secret_matches(given: &[u8], secret: &[u8]) -> bool {
    use sha2::{Digest, Sha256};
    let a = Sha256::digest(given);
    let b = Sha256::digest(secret);
    let diff = a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// What an event post asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PostKind {
    /// Apply one batch (with its sequence number, when given).
    Batch {
        /// Publisher sequence number.
        seq: Option<u64>,
    },
    /// Resynchronize the endpoint's stream.
    Resync,
}

/// A parsed event post (headers only; the body comes later).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventPost {
    /// The engine endpoint.
    pub endpoint: String,
    /// What to do.
    pub kind: PostKind,
    /// The topic, when given.
    pub topic: Option<String>,
}

/// Read the post's headers (`get(name)` returns the first value of a header). The secret must
/// have been checked before. Errors are 400 answers' details.
pub fn parse_post<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Result<EventPost, String> {
    let endpoint = get(HEADER_ENDPOINT).ok_or_else(|| format!("missing header {HEADER_ENDPOINT}"))?;
    kvroute::endpoints::validate_endpoint_id(endpoint).map_err(|e| format!("{HEADER_ENDPOINT}: {e}"))?;
    let kind = match get(HEADER_KIND).unwrap_or("batch") {
        "batch" => {
            let seq = match get(HEADER_SEQ) {
                None => None,
                Some(s) => Some(s.trim().parse::<u64>().map_err(|_| format!("{HEADER_SEQ}: {s:?} is not a u64"))?),
            };
            PostKind::Batch { seq }
        }
        "resync" => PostKind::Resync,
        other => return Err(format!("{HEADER_KIND}: {other:?} is neither batch nor resync")),
    };
    Ok(EventPost { endpoint: endpoint.to_owned(), kind, topic: get(HEADER_TOPIC).map(str::to_owned) })
}

/// The JSON answer to an applied batch (status, body).
pub fn outcome_answer(out: &kvroute::ApplyOutcome) -> (u32, String) {
    use kvroute::StreamVerdict as V;
    match out.verdict {
        V::Gap { expected, got } => {
            (409, serde_json::json!({"verdict": "gap", "expected": expected, "got": got}).to_string())
        }
        v => {
            let name = match v {
                V::Applied => "applied",
                V::Duplicate => "duplicate",
                _ => "reset",
            };
            (200, serde_json::json!({"verdict": name, "events": out.events, "blocks": out.blocks}).to_string())
        }
    }
}

/// A JSON error body.
pub fn error_body(error: &str, detail: &str) -> String {
    serde_json::json!({"error": error, "detail": detail}).to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn secrets_compare_whole() {
        assert!(secret_matches(b"0123456789abcdef", b"0123456789abcdef"));
        assert!(!secret_matches(b"0123456789abcdeX", b"0123456789abcdef"));
        assert!(!secret_matches(b"0123456789abcde", b"0123456789abcdef"));
        assert!(!secret_matches(b"", b"0123456789abcdef"));
    }

    #[test]
    fn posts_are_parsed() {
        let h = |pairs: &'static [(&'static str, &'static str)]| {
            move |n: &str| pairs.iter().find(|(k, _)| *k == n).map(|(_, v)| *v)
        };
        let p = parse_post(h(&[("x-kvroute-endpoint", "10.0.0.1:8000"), ("x-kvroute-seq", "7")])).unwrap();
        assert_eq!(p.kind, PostKind::Batch { seq: Some(7) });
        let p = parse_post(h(&[("x-kvroute-endpoint", "10.0.0.1:8000"), ("x-kvroute-kind", "resync")])).unwrap();
        assert_eq!(p.kind, PostKind::Resync);
        assert!(parse_post(h(&[("x-kvroute-seq", "7")])).is_err());
        assert!(parse_post(h(&[("x-kvroute-endpoint", "x")])).is_err());
        assert!(parse_post(h(&[("x-kvroute-endpoint", "10.0.0.1:8000"), ("x-kvroute-seq", "-1")])).is_err());
        assert!(parse_post(h(&[("x-kvroute-endpoint", "10.0.0.1:8000"), ("x-kvroute-kind", "nope")])).is_err());
    }

    #[test]
    fn answers() {
        use kvroute::{ApplyOutcome, StreamVerdict};
        let gap = ApplyOutcome { verdict: StreamVerdict::Gap { expected: 3, got: 5 }, events: 0, blocks: 0 };
        let (s, b) = outcome_answer(&gap);
        assert_eq!(s, 409);
        assert_eq!(serde_json::from_str::<serde_json::Value>(&b).unwrap()["expected"], 3);
        let ok = ApplyOutcome { verdict: StreamVerdict::Applied, events: 2, blocks: 9 };
        let (s, b) = outcome_answer(&ok);
        assert_eq!(s, 200);
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v, serde_json::json!({"verdict": "applied", "events": 2, "blocks": 9}));
    }
}
