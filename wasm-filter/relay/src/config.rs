//! The relay's configuration file (JSON).
//!
//! ```json
//! {
//!   "targets": ["http://127.0.0.1:10000"],
//!   "path": "/kvroute/v1/events",
//!   "secret_env": "KVROUTE_EVENTS_SECRET",
//!   "engines": [
//!     {"endpoint": "10.0.0.7:8000",
//!      "subscriber": {"endpoint": "tcp://10.0.0.7:5557", "replay_endpoint": "tcp://10.0.0.7:5558"}}
//!   ],
//!   "replica": {
//!     "target": "http://127.0.0.1:10000",
//!     "secret_env": "KVROUTE_REPLICA_SECRET",
//!     "nats": {"url": "tls://nats.example:4222", "fleet": "prod", "replica_id": "envoy-a",
//!              "tls_required": true, "tls_ca_file": "/etc/kvroute/nats-ca.pem"}
//!   }
//! }
//! ```
//!
//! `engines` (with `targets`) relay KV events; `replica` (optional) makes this relay its Envoy's
//! link to the fleet's other router replicas over NATS (see [`crate::replica`]). At least one of
//! the two is needed.

use std::path::PathBuf;
use std::time::Duration;

use kvroute::SubscriberConfig;
use serde::Deserialize;

use crate::replica::ReplicaRelayConfig;

/// Default event path (the filter's `events.path` must match).
pub const DEFAULT_PATH: &str = "/kvroute/v1/events";
/// Default environment variable holding the shared secret.
pub const DEFAULT_SECRET_ENV: &str = "KVROUTE_EVENTS_SECRET";
/// Default HTTP timeout (connect, write, read), ms.
pub const DEFAULT_TIMEOUT_MS: u64 = 2_000;
/// Default per-target queue (batches).
pub const DEFAULT_QUEUE_BATCHES: usize = 10_000;
/// Default attempts per POST on transport errors and 5xx answers.
pub const DEFAULT_ATTEMPTS: u32 = 4;

/// One engine stream.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// The engine's endpoint id in the filter's endpoint list (`ip:port` of its HTTP server).
    pub endpoint: String,
    /// How to reach its KV-event publisher (the core's subscriber configuration).
    pub subscriber: SubscriberConfig,
}

/// The relay's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    /// Envoy listeners to POST events to (`http://host:port`): every Envoy replica, since each
    /// keeps its own routing state.
    #[serde(default)]
    pub targets: Vec<String>,
    /// The filter's event path.
    #[serde(default = "default_path")]
    pub path: String,
    /// Environment variable with the shared secret (default `KVROUTE_EVENTS_SECRET`).
    #[serde(default)]
    pub secret_env: Option<String>,
    /// File with the shared secret (trailing newline ignored); wins over `secret_env`.
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// HTTP timeout, ms.
    #[serde(default = "default_timeout")]
    pub timeout_ms: u64,
    /// Attempts per POST on transport errors and 5xx answers (backoff 100 ms × 4ⁿ).
    #[serde(default = "default_attempts")]
    pub attempts: u32,
    /// Batches queued per target before new ones are dropped (the filter then answers 409 for
    /// the next one and the relay resyncs the stream).
    #[serde(default = "default_queue")]
    pub queue_batches: usize,
    /// The engines.
    #[serde(default)]
    pub engines: Vec<EngineConfig>,
    /// Router replicas: this relay carries its Envoy's replica batches to and from NATS.
    #[serde(default)]
    pub replica: Option<ReplicaRelayConfig>,
}

fn default_path() -> String {
    DEFAULT_PATH.to_owned()
}
fn default_timeout() -> u64 {
    DEFAULT_TIMEOUT_MS
}
fn default_attempts() -> u32 {
    DEFAULT_ATTEMPTS
}
fn default_queue() -> usize {
    DEFAULT_QUEUE_BATCHES
}

impl RelayConfig {
    /// Parse a JSON configuration (validated).
    pub fn from_json(text: &str) -> Result<RelayConfig, String> {
        let cfg: RelayConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Check the values.
    pub fn validate(&self) -> Result<(), String> {
        if self.targets.is_empty() && (self.replica.is_none() || !self.engines.is_empty()) {
            return Err("`targets` must list at least one Envoy listener".into());
        }
        if let Some(r) = &self.replica {
            r.validate(self.timeout())?;
        }
        for t in &self.targets {
            crate::http::Target::parse(t, self.timeout())?;
        }
        // A request target the HTTP client sends as written (no fragment, nothing it rejects).
        let sendable = !self.path.contains('#') && self.path.parse::<ureq::http::uri::PathAndQuery>().is_ok();
        if !self.path.starts_with('/') || self.path.bytes().any(|b| !b.is_ascii_graphic()) || !sendable {
            return Err(format!("`path` {:?} must be an absolute path", self.path));
        }
        if self.timeout_ms == 0 || self.attempts == 0 || self.queue_batches == 0 {
            return Err("`timeout_ms`, `attempts` and `queue_batches` must be positive".into());
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, e) in self.engines.iter().enumerate() {
            kvroute::validate_endpoint_id(&e.endpoint).map_err(|x| format!("engines[{i}].endpoint: {x}"))?;
            if !seen.insert(&e.endpoint) {
                return Err(format!("engines[{i}].endpoint {:?} is listed twice", e.endpoint));
            }
            e.subscriber.validate().map_err(|x| format!("engines[{i}].subscriber: {x}"))?;
        }
        Ok(())
    }

    /// The HTTP timeout.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// Read the shared secret from `secret_file` or the environment.
    pub fn secret(&self) -> Result<String, String> {
        read_secret(self.secret_file.as_ref(), self.secret_env.as_deref(), DEFAULT_SECRET_ENV)
    }
}

/// A shared secret from `file` (wins) or the environment variable `env` (else `default_env`).
pub(crate) fn read_secret(file: Option<&PathBuf>, env: Option<&str>, default_env: &str) -> Result<String, String> {
    let s = match file {
        Some(p) => std::fs::read_to_string(p).map_err(|e| format!("secret_file {}: {e}", p.display()))?,
        None => {
            let var = env.unwrap_or(default_env);
            std::env::var(var).map_err(|_| format!("environment variable {var} (the shared secret) is not set"))?
        }
    };
    let s = s.trim_end_matches(['\r', '\n']).to_owned();
    if s.len() < kvroute_filter::config::MIN_SECRET_BYTES {
        return Err(format!("the shared secret must be at least {} bytes", kvroute_filter::config::MIN_SECRET_BYTES));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parses_with_defaults_and_validates() {
        let cfg = RelayConfig::from_json(
            r#"{"targets": ["http://127.0.0.1:10000"],
                "engines": [{"endpoint": "10.0.0.7:8000", "subscriber": {"endpoint": "tcp://10.0.0.7:5557"}}]}"#,
        )
        .unwrap();
        assert_eq!(cfg.path, DEFAULT_PATH);
        assert_eq!((cfg.timeout_ms, cfg.attempts, cfg.queue_batches), (2000, 4, 10_000));
        assert!(RelayConfig::from_json(r#"{"targets": [], "engines": []}"#).is_err());
        assert!(RelayConfig::from_json(r#"{"targets": ["ftp://x"], "engines": []}"#).is_err());
        for path in ["/a#b", "/a<b", "/a`b", "a"] {
            let text = format!(r#"{{"targets": ["http://x:1"], "path": {path:?}, "engines": []}}"#);
            assert!(RelayConfig::from_json(&text).unwrap_err().contains("`path`"), "{path}");
        }
        assert!(RelayConfig::from_json(r#"{"targets": ["http://x:1"], "path": "/a?b=1", "engines": []}"#).is_ok());
        assert!(RelayConfig::from_json(r#"{"targets": ["http://x:1"], "engines": [], "nope": 1}"#).is_err());
        let bad_engine =
            r#"{"targets": ["http://x:1"], "engines": [{"endpoint": "x", "subscriber": {"endpoint": "tcp://a:1"}}]}"#;
        assert!(RelayConfig::from_json(bad_engine).unwrap_err().contains("engines[0].endpoint"));
    }

    #[test]
    fn a_replica_only_relay() {
        let cfg = RelayConfig::from_json(
            r#"{"replica": {"target": "http://127.0.0.1:10000",
                            "nats": {"url": "nats://127.0.0.1:4222", "fleet": "f", "replica_id": "envoy-a"}}}"#,
        )
        .unwrap();
        let r = cfg.replica.unwrap();
        assert_eq!((r.path.as_str(), r.poll_interval_ms, r.queue_batches), ("/kvroute/v1/replica", 10, 1024));
        let bad = |replica: &str| RelayConfig::from_json(&format!(r#"{{"replica": {replica}}}"#)).unwrap_err();
        assert!(
            bad(r#"{"target": "http://x:1", "nats": {"fleet": "f", "replica_id": "a.b"}}"#).contains("replica.nats")
        );
        assert!(
            bad(r#"{"target": "https://x:1", "nats": {"fleet": "f", "replica_id": "a"}}"#).contains("replica.target")
        );
        assert!(bad(r#"{"target": "http://x:1", "path": "r", "nats": {"fleet": "f", "replica_id": "a"}}"#)
            .contains("replica.path"));
        // Engines still need targets.
        let e = r#"{"replica": {"target": "http://x:1", "nats": {"fleet": "f", "replica_id": "a"}},
                    "engines": [{"endpoint": "10.0.0.7:8000", "subscriber": {"endpoint": "tcp://10.0.0.7:5557"}}]}"#;
        assert!(RelayConfig::from_json(e).unwrap_err().contains("targets"));
    }
}
