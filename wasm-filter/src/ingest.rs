//! The event-ingestion protocol: what a relay POSTs to the filter's event path, and what the
//! filter answers.
//!
//! Request: `POST <events.path>` with headers
//! - `x-kvroute-endpoint`: the engine's endpoint id (`ip:port`, as in the filter's endpoint list);
//! - `x-kvroute-kind`: `batch` (default) or `resync`;
//! - `x-kvroute-seq`: the publisher's sequence number (decimal; absent = unnumbered), batches only;
//! - `x-kvroute-topic`: the ZMQ topic (informational, not signed);
//! - `x-kvroute-timestamp`: when the relay signed the post (UNIX milliseconds, decimal);
//! - `x-kvroute-signature`: [`signature`]: lowercase hex of HMAC-SHA256, keyed by the shared
//!   secret, over [`signed_message`] (a version tag, endpoint, kind, sequence number, timestamp
//!   and the SHA-256 of the body), so a captured post cannot be replayed with another sequence
//!   number, endpoint or body, nor after the timestamp window;
//!
//! and, for a batch, the raw msgpack payload as published by the engine as the body. The secret
//! itself never travels. The filter verifies the signature in constant time once the body is in,
//! refuses a timestamp more than `events.signature_window_ms` (30 s) away from its clock, and
//! refuses a signature whose post it applied within that window (a replayed resync or unnumbered
//! batch; a replayed numbered batch is a `duplicate` by its sequence number anyway). Posts that
//! changed nothing (gap, duplicate, errors) are not remembered: the relay may send the same bytes
//! again after a resync. Only with
//! `events.allow_unsigned: true` does the filter also take an unsigned post that carries the
//! secret in `x-kvroute-secret` (compared in constant time; the protocol before signatures).
//!
//! Answers (JSON bodies):
//! - `200 {"verdict":"applied"|"duplicate"|"reset","events":N,"blocks":N}`, or `200
//!   {"verdict":"resynced"}`;
//! - `409 {"verdict":"gap","expected":E,"got":G}`: batches are missing, nothing was applied: the
//!   relay replays from `expected` or POSTs a resync, then this batch again;
//! - `400 {"error":"decode"|"bad_request","detail":…}`: the payload or a header is malformed
//!   (nothing applied);
//! - `401 {"error":"unauthorized"|"stale"|"replayed","detail":…}`: missing or wrong signature (or
//!   secret), a timestamp outside the window, a signature already accepted (nothing applied);
//! - `404 {"error":"unknown_endpoint"}`, `405` (not POST), `413` (body over `max_body_bytes`).
//!
//! # Replica routes (`filter.replica`)
//!
//! The relay next to an Envoy carries router-replica batches between the filter's shared log and
//! NATS. Both routes are signed like event posts, with [`replica_signature`] (its own version
//! tag, so a signature of one protocol never verifies in the other):
//! `x-kvroute-timestamp` and `x-kvroute-signature` over the operation (`out` or `in`), the cursor
//! (`-` when absent), the timestamp and the SHA-256 of the body.
//!
//! - `GET <path>/out?cursor=N` (no cursor: from the oldest entry the log retains): one
//!   `kvroute::ReplicaBatch` (fleet and replica id of this Envoy, epoch = the log's id, seq 0)
//!   with the log's routing effects and completions from sequence `N` on, every VM's, at most
//!   `max_batch_entries` and `max_batch_bytes`. Request ids are qualified by the writing VM
//!   (`<instance hex>.<id>`: ids are unique only within a VM). Headers:
//!   [`HEADER_REPLICA_CURSOR`] (the cursor of the next read), [`HEADER_REPLICA_LOST`] (entries
//!   between `N` and the next cursor the ring overwrote before they were read: lost),
//!   [`HEADER_REPLICA_MORE`] (`1`: the bound was reached, read again at once),
//!   [`HEADER_REPLICA_LOG`] (the log's id: it changes when Envoy restarted, and the relay then
//!   starts a new epoch), [`HEADER_REPLICA_FLEET`] and [`HEADER_REPLICA_ID`].
//! - `POST <path>/in` with one other replica's batch as the body: decoded whole first (a
//!   malformed batch is refused with 400 and nothing of it applied), judged and applied by the
//!   VM that takes it, and appended to the shared log for the other VMs.
//!   `200 {"verdict":"applied"|"ignored","effects":N,"completions":N,"skipped":N}`; 400
//!   `{"error":"malformed"}`, 401 (signature), 405, 413 (over `max_batch_bytes`), 503 (replication
//!   not configured).

/// Header carrying the shared secret (unsigned posts, accepted only with `allow_unsigned`).
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

/// The cursor of the next export read (response header of `GET <replica path>/out`).
pub const HEADER_REPLICA_CURSOR: &str = "x-kvroute-replica-cursor";
/// Entries the ring overwrote before the export read them (response header).
pub const HEADER_REPLICA_LOST: &str = "x-kvroute-replica-lost";
/// `1` when the export stopped at its bound and more entries wait (response header).
pub const HEADER_REPLICA_MORE: &str = "x-kvroute-replica-more";
/// The shared log's id: a new one after an Envoy restart (response header).
pub const HEADER_REPLICA_LOG: &str = "x-kvroute-replica-log";
/// The filter's fleet (response header).
pub const HEADER_REPLICA_FLEET: &str = "x-kvroute-replica-fleet";
/// The filter's replica id (response header).
pub const HEADER_REPLICA_ID: &str = "x-kvroute-replica-id";
/// Version tag at the start of every signed message of the replica routes.
pub const REPLICA_SIGNATURE_VERSION: &str = "kvroute-replica-v1";

/// The message a replica route's signature covers: the version tag, the operation (`out` or
/// `in`), the cursor (`-` when absent), the timestamp (UNIX ms) and the lowercase hex SHA-256 of
/// the body, one per line.
pub fn replica_signed_message(op: &str, cursor: Option<u64>, timestamp_ms: u64, body: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let cursor = cursor.map_or_else(|| "-".to_owned(), |s| s.to_string());
    let digest = hex(&Sha256::digest(body));
    format!("{REPLICA_SIGNATURE_VERSION}\n{op}\n{cursor}\n{timestamp_ms}\n{digest}")
}

/// The signature of a replica route request (lowercase hex HMAC-SHA256 keyed by `secret` over
/// [`replica_signed_message`]).
pub fn replica_signature(secret: &[u8], op: &str, cursor: Option<u64>, timestamp_ms: u64, body: &[u8]) -> String {
    use hmac::Mac;
    hex(&mac(secret, &replica_signed_message(op, cursor, timestamp_ms, body)).finalize().into_bytes())
}

/// Whether `given` is the replica request's signature; compared in constant time.
pub fn verify_replica_signature(
    secret: &[u8],
    op: &str,
    cursor: Option<u64>,
    timestamp_ms: u64,
    body: &[u8],
    given: &Mac,
) -> bool {
    use hmac::Mac;
    mac(secret, &replica_signed_message(op, cursor, timestamp_ms, body)).verify_slice(given).is_ok()
}

/// The `cursor` of an export request's `:path` (`…/out?cursor=N`; absent: `None`). Other query
/// parameters are errors (they would not be signed).
pub fn parse_cursor(path: &str) -> Result<Option<u64>, String> {
    let Some((_, query)) = path.split_once('?') else { return Ok(None) };
    if query.is_empty() {
        return Ok(None);
    }
    match query.strip_prefix("cursor=") {
        Some(v) if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => {
            v.parse::<u64>().map(Some).map_err(|_| format!("cursor {v:?} is not a u64"))
        }
        _ => Err(format!("query {query:?}: only cursor=<u64> is accepted")),
    }
}

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

/// Version tag at the start of every signed message.
pub const SIGNATURE_VERSION: &str = "kvroute-events-v1";

/// The message a post's signature covers: the version tag, endpoint, kind (`batch` or
/// `resync`), sequence number (`-` when absent), timestamp (UNIX ms) and the lowercase hex
/// SHA-256 of the body, one per line.
pub fn signed_message(endpoint: &str, kind: &str, seq: Option<u64>, timestamp_ms: u64, body: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let seq = seq.map_or_else(|| "-".to_owned(), |s| s.to_string());
    let digest = hex(&Sha256::digest(body));
    format!("{SIGNATURE_VERSION}\n{endpoint}\n{kind}\n{seq}\n{timestamp_ms}\n{digest}")
}

fn mac(secret: &[u8], message: &str) -> hmac::Hmac<sha2::Sha256> {
    use hmac::{KeyInit, Mac};
    // HMAC takes keys of any length (long ones are hashed first): this cannot fail.
    let mut m = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(secret)
        .unwrap_or_else(|_| <hmac::Hmac<sha2::Sha256> as KeyInit>::new(&Default::default()));
    m.update(message.as_bytes());
    m
}

/// The signature of a post (lowercase hex of HMAC-SHA256 keyed by `secret` over
/// [`signed_message`]).
pub fn signature(
    secret: &[u8],
    endpoint: &str,
    kind: &str,
    seq: Option<u64>,
    timestamp_ms: u64,
    body: &[u8],
) -> String {
    use hmac::Mac;
    hex(&mac(secret, &signed_message(endpoint, kind, seq, timestamp_ms, body)).finalize().into_bytes())
}

/// An HMAC-SHA256 signature, decoded (the canonical form: two spellings of one signature are
/// one value).
pub type Mac = [u8; 32];

/// Read `x-kvroute-signature`: exactly 64 hex digits, either case (surrounding whitespace
/// ignored). Nothing else decodes, so a captured signature cannot be re-spelt past the replay
/// check.
pub fn parse_signature(value: &str) -> Result<Mac, String> {
    let v = value.trim().as_bytes();
    let digit = |c: u8| char::from(c).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; 32];
    if v.len() != 64 {
        return Err(format!("{HEADER_SIGNATURE}: 64 hex digits expected, got {} bytes", v.len()));
    }
    for (o, pair) in out.iter_mut().zip(v.chunks_exact(2)) {
        match (digit(pair[0]), digit(pair[1])) {
            (Some(h), Some(l)) => *o = (h << 4) | l,
            _ => return Err(format!("{HEADER_SIGNATURE}: not hex")),
        }
    }
    Ok(out)
}

/// Whether `given` is the post's signature; compared in constant time.
pub fn verify_signature(
    secret: &[u8],
    endpoint: &str,
    kind: &str,
    seq: Option<u64>,
    timestamp_ms: u64,
    body: &[u8],
    given: &Mac,
) -> bool {
    use hmac::Mac;
    mac(secret, &signed_message(endpoint, kind, seq, timestamp_ms, body)).verify_slice(given).is_ok()
}

/// Read `x-kvroute-timestamp`.
pub fn parse_timestamp(value: Option<&str>) -> Result<u64, String> {
    let v = value.ok_or_else(|| format!("missing header {HEADER_TIMESTAMP}"))?;
    v.trim().parse::<u64>().map_err(|_| format!("{HEADER_TIMESTAMP}: {v:?} is not UNIX milliseconds"))
}

/// Whether a timestamp is within `window_ms` of `now_ms` (either side: clocks drift both ways).
pub fn timestamp_fresh(timestamp_ms: u64, now_ms: u64, window_ms: u64) -> bool {
    timestamp_ms.abs_diff(now_ms) <= window_ms
}

/// Signatures accepted recently, so that none is accepted twice within the timestamp window.
/// Bounded: past `capacity` entries the oldest are forgotten first. An ordered set answers
/// membership (O(log n) per post, no hasher to seed in the VM); the queue, in acceptance order, ages entries out.
#[derive(Debug, Default)]
pub struct RecentSignatures {
    /// (timestamp of the post, signature), in acceptance order.
    order: std::collections::VecDeque<(u64, Mac)>,
    seen: std::collections::BTreeSet<Mac>,
}

impl RecentSignatures {
    /// Most signatures remembered.
    pub const CAPACITY: usize = 4096;

    /// Whether `sig` was accepted within the window. Entries at the front of the queue whose
    /// timestamp left the window are dropped first (an entry behind a fresher one waits for it:
    /// it is forgotten late, never early).
    pub fn is_replay(&mut self, sig: &Mac, now_ms: u64, window_ms: u64) -> bool {
        while let Some(&(t, old)) = self.order.front() {
            if timestamp_fresh(t, now_ms, window_ms) {
                break;
            }
            self.order.pop_front();
            self.seen.remove(&old);
        }
        self.seen.contains(sig)
    }

    /// Remember `sig`, the signature of an accepted post stamped `timestamp_ms`.
    pub fn record(&mut self, sig: &Mac, timestamp_ms: u64) {
        if !self.seen.insert(*sig) {
            return;
        }
        if self.order.len() >= Self::CAPACITY {
            if let Some((_, old)) = self.order.pop_front() {
                self.seen.remove(&old);
            }
        }
        self.order.push_back((timestamp_ms, *sig));
    }

    /// Signatures remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    s
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

impl PostKind {
    /// The kind's name in `x-kvroute-kind` and in the signed message.
    pub fn name(&self) -> &'static str {
        match self {
            PostKind::Batch { .. } => "batch",
            PostKind::Resync => "resync",
        }
    }

    /// The batch's sequence number.
    pub fn seq(&self) -> Option<u64> {
        match self {
            PostKind::Batch { seq } => *seq,
            PostKind::Resync => None,
        }
    }
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
    kvroute::validate_endpoint_id(endpoint).map_err(|e| format!("{HEADER_ENDPOINT}: {e}"))?;
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
    fn signatures_bind_every_signed_field() {
        let secret = b"0123456789abcdef-secret";
        let sig = signature(secret, "10.0.0.1:8000", "batch", Some(7), 1_000, b"payload");
        assert_eq!(sig.len(), 64);
        let ok = |s: &str| {
            parse_signature(s)
                .is_ok_and(|m| verify_signature(secret, "10.0.0.1:8000", "batch", Some(7), 1_000, b"payload", &m))
        };
        assert!(ok(&sig));
        assert!(ok(&sig.to_ascii_uppercase()));
        assert!(!ok(&sig[..62]));
        assert!(!ok("zz"));
        assert!(!ok(""));
        // One signature, one decoded value: case and surrounding whitespace do not matter, and no
        // other spelling decodes (a sign where a digit belongs, more or fewer digits, non-ASCII).
        assert_eq!(parse_signature(&format!(" {} ", sig.to_ascii_uppercase())), parse_signature(&sig));
        let plus = format!("+{}", &sig[1..]);
        assert!(parse_signature(&plus).is_err(), "{plus}");
        assert!(parse_signature(&format!("{sig}0")).is_err());
        assert!(parse_signature(&format!("é{}", &sig[2..])).is_err());
        let sig = parse_signature(&sig).unwrap();
        let v = |ep: &str, kind: &str, seq, ts, body: &[u8]| verify_signature(secret, ep, kind, seq, ts, body, &sig);
        assert!(!v("10.0.0.2:8000", "batch", Some(7), 1_000, b"payload"));
        assert!(!v("10.0.0.1:8000", "resync", Some(7), 1_000, b"payload"));
        assert!(!v("10.0.0.1:8000", "batch", Some(8), 1_000, b"payload"));
        assert!(!v("10.0.0.1:8000", "batch", None, 1_000, b"payload"));
        assert!(!v("10.0.0.1:8000", "batch", Some(7), 1_001, b"payload"));
        assert!(!v("10.0.0.1:8000", "batch", Some(7), 1_000, b"payloaX"));
        assert!(!verify_signature(b"another secret!!", "10.0.0.1:8000", "batch", Some(7), 1_000, b"payload", &sig));
        // RFC 4231 test case 2: HMAC-SHA256("Jefe", "what do ya want for nothing?").
        use hmac::Mac;
        let m = mac(b"Jefe", "what do ya want for nothing?").finalize().into_bytes();
        assert_eq!(hex(&m), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }

    #[test]
    fn replica_signatures_and_cursors() {
        let secret = b"0123456789abcdef-secret";
        let sig = parse_signature(&replica_signature(secret, "out", Some(7), 1_000, b"")).unwrap();
        assert!(verify_replica_signature(secret, "out", Some(7), 1_000, b"", &sig));
        assert!(!verify_replica_signature(secret, "out", Some(8), 1_000, b"", &sig));
        assert!(!verify_replica_signature(secret, "in", Some(7), 1_000, b"", &sig));
        assert!(!verify_replica_signature(secret, "out", None, 1_000, b"", &sig));
        assert!(!verify_replica_signature(secret, "out", Some(7), 1_001, b"", &sig));
        assert!(!verify_replica_signature(secret, "out", Some(7), 1_000, b"x", &sig));
        // Never an event signature.
        assert_ne!(replica_signature(secret, "in", None, 1, b"x"), signature(secret, "in", "-", None, 1, b"x"));
        assert_eq!(parse_cursor("/r/out"), Ok(None));
        assert_eq!(parse_cursor("/r/out?"), Ok(None));
        assert_eq!(parse_cursor("/r/out?cursor=42"), Ok(Some(42)));
        for bad in ["/r/out?cursor=", "/r/out?cursor=-1", "/r/out?cursor=1&x=2", "/r/out?x=1", "/r/out?cursor=+1"] {
            assert!(parse_cursor(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn timestamps_and_replays() {
        assert!(timestamp_fresh(1_000, 31_000, 30_000));
        assert!(timestamp_fresh(31_000, 1_000, 30_000));
        assert!(!timestamp_fresh(1_000, 31_001, 30_000));
        assert_eq!(parse_timestamp(Some("12")), Ok(12));
        assert!(parse_timestamp(None).is_err());
        assert!(parse_timestamp(Some("-1")).is_err());
        let mac = |n: u32| {
            let mut m = [0u8; 32];
            m[..4].copy_from_slice(&n.to_le_bytes());
            m
        };
        let mut r = RecentSignatures::default();
        assert!(!r.is_replay(&mac(1), 1_000, 30_000));
        r.record(&mac(1), 1_000);
        assert!(r.is_replay(&mac(1), 2_000, 30_000), "a replay");
        assert!(!r.is_replay(&mac(2), 2_000, 30_000));
        // Out of the window, the entry is forgotten (the timestamp check refuses such posts).
        assert!(!r.is_replay(&mac(1), 40_000, 30_000));
        assert!(r.is_empty());
        for i in 0..RecentSignatures::CAPACITY as u32 + 10 {
            r.record(&mac(i), 40_000);
        }
        assert_eq!((r.len(), r.order.len()), (RecentSignatures::CAPACITY, RecentSignatures::CAPACITY));
        assert!(!r.is_replay(&mac(0), 40_000, 30_000), "the oldest went first");
        assert!(r.is_replay(&mac(RecentSignatures::CAPACITY as u32 + 9), 40_000, 30_000));
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
