//! The plugin configuration: the core policy JSON plus a `filter` section.
//!
//! ```json
//! {
//!   "modes": { "decode_kv_ceiling": 0.8 },
//!   "filter": {
//!     "endpoints": [ { "address": "10.0.0.7:8000", "role": "decode" } ],
//!     "metrics": { "cluster": "kvroute_endpoints", "interval_ms": 250 },
//!     "events": { "path": "/kvroute/v1/events", "secret": "a shared secret of 16+ bytes" }
//!   }
//! }
//! ```
//!
//! Everything except `filter` is the policy document every kvroute surface accepts (validated by
//! the core: unknown fields are errors). The `filter` section is described field by field on
//! [`FilterSection`]; `wasm-filter/README.md` has the operator's view.

use kvroute::{Policy, Role};
use serde::Deserialize;

/// Default metric polling interval (ms). Below the core's default metric staleness (1 s), so a
/// single lost poll does not make an endpoint stale.
pub const DEFAULT_POLL_INTERVAL_MS: u64 = 250;
/// Default metric path.
pub const DEFAULT_METRICS_PATH: &str = "/metrics";
/// Default tick period (ms): how often an idle VM applies the shared log and the poller checks
/// whether a poll is due.
pub const DEFAULT_TICK_MS: u64 = 100;
/// Default shared-data namespace.
pub const DEFAULT_NAMESPACE: &str = "kvroute";
/// Default ring size of the replicated log (entries).
pub const DEFAULT_RING_ENTRIES: u32 = 8192;
/// Smallest allowed ring.
pub const MIN_RING_ENTRIES: u32 = 16;
/// Largest allowed ring.
pub const MAX_RING_ENTRIES: u32 = 1 << 20;
/// Shortest accepted event-ingestion secret (bytes).
pub const MIN_SECRET_BYTES: usize = 16;
/// Default largest accepted event batch body (bytes).
pub const DEFAULT_EVENT_MAX_BODY_BYTES: usize = 8 << 20;
/// Default largest difference between a signed event post's timestamp and the filter's clock (ms).
pub const DEFAULT_SIGNATURE_WINDOW_MS: u64 = 30_000;
/// Header carrying the stats page's secret (`filter.stats_secret`).
pub const HEADER_STATS_SECRET: &str = "x-kvroute-stats-secret";
/// Default status of the local reply when fail-open is disabled and the filter cannot route.
pub const DEFAULT_REJECT_STATUS: u16 = 503;
/// Header carrying the decision as JSON when `debug_decision_header` is on.
pub const HEADER_DECISION: &str = "x-kvroute-decision";
/// Header carrying the fail-open reason on the upstream request (or the local reject answer).
pub const HEADER_FALLBACK: &str = "x-kvroute-fallback";
/// Prefix of every kvroute header: the filter removes each request header with it (the event
/// protocol's included) before a request goes upstream, then sets its own.
pub const KVROUTE_HEADER_PREFIX: &str = "x-kvroute-";
/// Every header the filter sets on a request it routes (and so a client must never set itself):
/// the destination and prefiller that Envoy and the engine act on, and the kvroute outputs.
/// `wasm-filter/envoy.yaml` removes each of them with a native filter before the wasm filter
/// runs, so that a missing or trapped VM cannot let a client's own header choose the upstream.
pub const ROUTING_HEADERS: [&str; 7] = [
    kvroute::HEADER_DESTINATION,
    kvroute::HEADER_PREFILLER,
    kvroute::HEADER_MODE,
    kvroute::HEADER_SCORE,
    kvroute::HEADER_SHED_REASON,
    HEADER_DECISION,
    HEADER_FALLBACK,
];

/// A configuration that could not be used (the filter keeps the previous one, if any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Dotted path of the offending field (`.` for the document).
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid plugin configuration at `{}`: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

fn err(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError { field: field.to_owned(), message: message.into() }
}

/// One model server.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// `ip:port` the engine serves on: the router's endpoint id, the value of
    /// `x-gateway-destination-endpoint`, and the `:authority` of its metric polls.
    pub address: String,
    /// `prefill`, `decode` or `both`.
    pub role: Role,
    /// `false` drains the endpoint: it stays registered (its index entries are kept) but is never
    /// picked. Default `true`.
    #[serde(default = "yes")]
    pub healthy: bool,
}

fn yes() -> bool {
    true
}

/// Metric polling: one VM (elected through a shared-data lease) GETs every endpoint's metrics page
/// through `cluster` and shares the snapshots with the other VMs.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsPolling {
    /// Envoy cluster the callouts go through: a cluster of the fleet whose override-host policy
    /// follows `x-gateway-destination-endpoint` (the routing cluster itself works).
    pub cluster: String,
    /// Path of the metrics page. Default `/metrics`.
    #[serde(default = "default_metrics_path")]
    pub path: String,
    /// Poll every endpoint this often (ms). Must be below the policy's `metrics.staleness_ms`.
    #[serde(default = "default_poll_interval")]
    pub interval_ms: u64,
    /// Callout timeout (ms). Default: the interval.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// How long the poller's lease lasts without renewal (ms): another VM takes over after it.
    /// Default: 4 × the interval.
    #[serde(default)]
    pub lease_ms: Option<u64>,
}

fn default_metrics_path() -> String {
    DEFAULT_METRICS_PATH.to_owned()
}

fn default_poll_interval() -> u64 {
    DEFAULT_POLL_INTERVAL_MS
}

impl MetricsPolling {
    /// The callout timeout (ms).
    pub fn timeout(&self) -> u64 {
        self.timeout_ms.unwrap_or(self.interval_ms)
    }

    /// The lease duration (ms).
    pub fn lease(&self) -> u64 {
        self.lease_ms.unwrap_or(self.interval_ms.saturating_mul(4))
    }
}

/// Authenticated KV-event ingestion: POSTs to `path` carry one engine batch each (see
/// `crate::ingest`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventIngestion {
    /// Exact request path the filter answers itself (e.g. `/kvroute/v1/events`).
    pub path: String,
    /// Shared secret (at least 16 bytes): the key of the posts' HMAC-SHA256 signatures (see
    /// `crate::ingest`).
    pub secret: String,
    /// Largest accepted batch (bytes). Default 8 MiB.
    #[serde(default = "default_event_max_body")]
    pub max_body_bytes: usize,
    /// Largest difference between a post's signed timestamp and the filter's clock (ms), either
    /// way; older (or later) posts are refused, so a captured post cannot be replayed after it.
    /// Default 30 000.
    #[serde(default = "default_signature_window")]
    pub signature_window_ms: u64,
    /// Also accept unsigned posts that carry the secret itself in `x-kvroute-secret` (the
    /// protocol before signatures: a captured post can then be replayed with a new sequence
    /// number). Default `false`.
    #[serde(default)]
    pub allow_unsigned: bool,
}

fn default_signature_window() -> u64 {
    DEFAULT_SIGNATURE_WINDOW_MS
}

fn default_event_max_body() -> usize {
    DEFAULT_EVENT_MAX_BODY_BYTES
}

/// Default path prefix of the replica routes (`<path>/out`, `<path>/in`).
pub const DEFAULT_REPLICA_PATH: &str = "/kvroute/v1/replica";
/// Default bound of one replica batch, answered or posted (bytes): NATS' default payload limit.
pub const DEFAULT_REPLICA_MAX_BATCH_BYTES: usize = 1 << 20;
/// Default bound of the entries of one exported batch.
pub const DEFAULT_REPLICA_MAX_BATCH_ENTRIES: usize = 512;

/// Router replicas across Envoys (over NATS, through the relay): this Envoy's identity in its
/// fleet, and the two routes the relay uses (see `crate::ingest`, "Replica routes"). Absent:
/// no replica routes, no replication.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSection {
    /// The fleet (`[A-Za-z0-9_-]`, 1..64): batches of another fleet are ignored.
    pub fleet: String,
    /// This Envoy's replica id in the fleet, the relay's `replica_id` (`[A-Za-z0-9_-]`, 1..64):
    /// batches carrying it are this Envoy's own and are ignored.
    pub replica_id: String,
    /// Path prefix of the routes: `GET <path>/out` and `POST <path>/in`. Default
    /// `/kvroute/v1/replica`.
    #[serde(default = "default_replica_path")]
    pub path: String,
    /// Shared secret with the relay (at least 16 bytes), the key of the HMAC-SHA256 signatures.
    pub secret: String,
    /// Largest difference between a signed timestamp and the filter's clock (ms). Default 30 000.
    #[serde(default = "default_signature_window")]
    pub signature_window_ms: u64,
    /// Largest batch the filter answers or accepts (bytes). Default 1 MiB.
    #[serde(default = "default_replica_max_bytes")]
    pub max_batch_bytes: usize,
    /// Most entries per exported batch. Default 512.
    #[serde(default = "default_replica_max_entries")]
    pub max_batch_entries: usize,
    /// A replica heard from neither by a batch nor a heartbeat for this long is gone: its
    /// requests in flight here are dropped (ms). Default 30 000.
    #[serde(default = "default_peer_silence")]
    pub peer_silence_ms: u64,
    /// Replica ids whose batches are applied (empty: any of the fleet).
    #[serde(default)]
    pub allowed_replicas: Vec<String>,
}

/// The two replica routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaRoute {
    /// `GET <path>/out`: the shared log's effects and completions, for the relay to publish.
    Out,
    /// `POST <path>/in`: another replica's batch, from the relay.
    In,
}

fn default_replica_path() -> String {
    DEFAULT_REPLICA_PATH.to_owned()
}
fn default_replica_max_bytes() -> usize {
    DEFAULT_REPLICA_MAX_BATCH_BYTES
}
fn default_replica_max_entries() -> usize {
    DEFAULT_REPLICA_MAX_BATCH_ENTRIES
}
fn default_peer_silence() -> u64 {
    30_000
}

impl ReplicaSection {
    /// The export route.
    pub fn out_path(&self) -> String {
        format!("{}/out", self.path.trim_end_matches('/'))
    }

    /// The ingestion route.
    pub fn in_path(&self) -> String {
        format!("{}/in", self.path.trim_end_matches('/'))
    }

    /// Which replica route `path` (without its query) is, if any (no allocation: this runs for
    /// every request).
    pub fn route(&self, path: &str) -> Option<ReplicaRoute> {
        match path.strip_prefix(self.path.trim_end_matches('/'))? {
            "/out" => Some(ReplicaRoute::Out),
            "/in" => Some(ReplicaRoute::In),
            _ => None,
        }
    }

    /// The core's replication settings for a VM's router: apply-only (the VMs' own decisions
    /// reach the fleet through the shared log and the relay, under the relay's epoch).
    pub fn core_config(&self) -> kvroute::ReplicaConfig {
        kvroute::ReplicaConfig {
            fleet: self.fleet.clone(),
            replica_id: self.replica_id.clone(),
            epoch: 1,
            allowed_replicas: self.allowed_replicas.clone(),
            publish: false,
            peer_silence_ms: self.peer_silence_ms,
            ..kvroute::ReplicaConfig::default()
        }
    }
}

/// What happens when the filter cannot route a request with the core (malformed body, no
/// endpoint, internal error).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailOpen {
    /// `true` (default): the request still goes upstream, to the least-loaded healthy endpoint.
    /// `false`: it is answered locally with `reject_status`.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Status of that local answer. Default 503.
    #[serde(default = "default_reject_status")]
    pub reject_status: u16,
}

fn default_reject_status() -> u16 {
    DEFAULT_REJECT_STATUS
}

impl Default for FailOpen {
    fn default() -> Self {
        FailOpen { enabled: true, reject_status: DEFAULT_REJECT_STATUS }
    }
}

/// The replicated log the worker VMs share (see `crate::sync`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncConfig {
    /// Shared-data key prefix. Filters that share a namespace (same Envoy `vm_id`) share routing
    /// state, so they must list the same endpoints. Default `kvroute`.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Entries the ring holds. A VM more than this many entries behind loses some (see the
    /// README's fallback). Default 8192.
    #[serde(default = "default_ring")]
    pub ring_entries: u32,
    /// Tick period (ms): idle VMs apply the log this often. Default 100.
    #[serde(default = "default_tick")]
    pub tick_ms: u64,
    /// Completions are not appended at once but with this VM's next append (a routing
    /// decision's effects: one claim for all), at its next tick, or once 64 wait: one shared-data
    /// read and compare-and-swap less per request; the other VMs see a completion up to one
    /// `tick_ms` later (meanwhile they count the request in flight). Default false (appended
    /// at once).
    #[serde(default)]
    pub batch_completions: bool,
}

fn default_namespace() -> String {
    DEFAULT_NAMESPACE.to_owned()
}

fn default_ring() -> u32 {
    DEFAULT_RING_ENTRIES
}

fn default_tick() -> u64 {
    DEFAULT_TICK_MS
}

impl Default for SyncConfig {
    fn default() -> Self {
        SyncConfig {
            namespace: default_namespace(),
            ring_entries: default_ring(),
            tick_ms: default_tick(),
            batch_completions: false,
        }
    }
}

/// The `filter` section of the plugin configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterSection {
    /// The model servers (static list; a reconfiguration adds, changes, drains or removes them).
    pub endpoints: Vec<EndpointConfig>,
    /// Metric polling; absent: no polling (metrics then never arrive and the policy's staleness
    /// filter relaxes, so routing uses prefix, in-flight and session terms only).
    #[serde(default)]
    pub metrics: Option<MetricsPolling>,
    /// KV-event ingestion; absent: the filter answers no event path.
    #[serde(default)]
    pub events: Option<EventIngestion>,
    /// Fail-open behaviour.
    #[serde(default)]
    pub fail_open: FailOpen,
    /// The shared log.
    #[serde(default)]
    pub sync: SyncConfig,
    /// Router replicas across Envoys (the relay carries batches between this Envoy and NATS).
    #[serde(default)]
    pub replica: Option<ReplicaSection>,
    /// Set `x-kvroute-decision` (the decision as JSON) on routed requests and shed answers.
    /// For debugging and tests: it is large (one score per endpoint).
    #[serde(default)]
    pub debug_decision_header: bool,
    /// A `GET` of this exact path is answered with the router's Prometheus metrics plus the
    /// filter's counters, as seen by the VM that answers.
    #[serde(default)]
    pub stats_path: Option<String>,
    /// When set (at least 16 bytes), the stats page is served only to requests carrying it in
    /// `x-kvroute-stats-secret` (compared in constant time); others get 401. Absent: the page
    /// is served to anyone who can reach the listener.
    #[serde(default)]
    pub stats_secret: Option<String>,
}

/// A validated plugin configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginConfig {
    /// The routing policy.
    pub policy: Policy,
    /// The filter section.
    pub filter: FilterSection,
}

impl PluginConfig {
    /// Parse and validate the plugin configuration bytes.
    pub fn parse(bytes: &[u8]) -> Result<PluginConfig, ConfigError> {
        let text = std::str::from_utf8(bytes).map_err(|_| err(".", "not UTF-8"))?;
        if text.trim().is_empty() {
            return Err(err(".", "empty: a `filter` section with `endpoints` is required"));
        }
        let mut doc: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(text).map_err(|e| err(".", format!("not a JSON object: {e}")))?;
        let filter = doc.remove("filter").ok_or_else(|| err("filter", "missing (it lists the endpoints)"))?;
        let filter: FilterSection = serde_path_to_error::deserialize(filter).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." { "filter".to_owned() } else { format!("filter.{path}") };
            err(&field, e.inner().to_string())
        })?;
        let policy =
            Policy::from_json(&serde_json::Value::Object(doc).to_string()).map_err(|e| err("policy", e.to_string()))?;
        let cfg = PluginConfig { policy, filter };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let f = &self.filter;
        let mut seen = std::collections::BTreeSet::new();
        for (i, e) in f.endpoints.iter().enumerate() {
            let field = format!("filter.endpoints[{i}].address");
            kvroute::validate_endpoint_id(&e.address).map_err(|x| err(&field, x.to_string()))?;
            if !seen.insert(e.address.as_str()) {
                return Err(err(&field, format!("{:?} is listed twice", e.address)));
            }
        }
        let max = self.policy.config().limits.max_endpoints;
        if f.endpoints.len() > max {
            return Err(err(
                "filter.endpoints",
                format!("{} endpoints, over the policy's limits.max_endpoints ({max})", f.endpoints.len()),
            ));
        }
        if let Some(m) = &f.metrics {
            if m.cluster.is_empty() {
                return Err(err("filter.metrics.cluster", "must not be empty"));
            }
            check_path("filter.metrics.path", &m.path)?;
            let stale = self.policy.config().metrics.staleness_ms;
            if m.interval_ms == 0 || m.interval_ms >= stale {
                return Err(err(
                    "filter.metrics.interval_ms",
                    format!("{} must be within 1 .. the policy's metrics.staleness_ms ({stale})", m.interval_ms),
                ));
            }
            if m.timeout() == 0 || m.timeout() > u64::from(u32::MAX) {
                return Err(err("filter.metrics.timeout_ms", "must be within 1 .. 2^32-1"));
            }
            if m.lease() <= m.interval_ms {
                return Err(err("filter.metrics.lease_ms", "must be longer than interval_ms"));
            }
        }
        if let Some(e) = &f.events {
            check_path("filter.events.path", &e.path)?;
            if e.secret.len() < MIN_SECRET_BYTES {
                return Err(err("filter.events.secret", format!("must be at least {MIN_SECRET_BYTES} bytes")));
            }
            if e.max_body_bytes == 0 {
                return Err(err("filter.events.max_body_bytes", "must be positive"));
            }
            if e.signature_window_ms == 0 {
                return Err(err("filter.events.signature_window_ms", "must be positive"));
            }
        }
        if let Some(p) = &f.stats_path {
            check_path("filter.stats_path", p)?;
            if f.events.as_ref().is_some_and(|e| &e.path == p) {
                return Err(err("filter.stats_path", "must differ from filter.events.path"));
            }
        }
        if let Some(r) = &f.replica {
            r.core_config().validate().map_err(|e| err("filter.replica", e.to_string()))?;
            check_path("filter.replica.path", &r.path)?;
            let taken = [f.events.as_ref().map(|e| e.path.as_str()), f.stats_path.as_deref()];
            if [r.out_path(), r.in_path()].iter().any(|p| taken.contains(&Some(p.as_str()))) {
                return Err(err("filter.replica.path", "its routes must differ from the event and stats paths"));
            }
            if r.secret.len() < MIN_SECRET_BYTES {
                return Err(err("filter.replica.secret", format!("must be at least {MIN_SECRET_BYTES} bytes")));
            }
            if r.signature_window_ms == 0 {
                return Err(err("filter.replica.signature_window_ms", "must be positive"));
            }
            if !(1024..=64 << 20).contains(&r.max_batch_bytes) {
                return Err(err("filter.replica.max_batch_bytes", "must be within 1024..64 MiB"));
            }
            if !(1..=65_536).contains(&r.max_batch_entries) {
                return Err(err("filter.replica.max_batch_entries", "must be within 1..65536"));
            }
        }
        if f.stats_secret.as_ref().is_some_and(|s| s.len() < MIN_SECRET_BYTES) {
            return Err(err("filter.stats_secret", format!("must be at least {MIN_SECRET_BYTES} bytes")));
        }
        if !(100..=599).contains(&f.fail_open.reject_status) {
            return Err(err("filter.fail_open.reject_status", "must be an HTTP status (100..599)"));
        }
        let s = &f.sync;
        if s.namespace.is_empty() || s.namespace.len() > 64 || !s.namespace.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(err("filter.sync.namespace", "must be 1..64 printable ASCII characters"));
        }
        if !(MIN_RING_ENTRIES..=MAX_RING_ENTRIES).contains(&s.ring_entries) {
            return Err(err(
                "filter.sync.ring_entries",
                format!("must be within {MIN_RING_ENTRIES}..{MAX_RING_ENTRIES}"),
            ));
        }
        if s.tick_ms == 0 || s.tick_ms > 60_000 {
            return Err(err("filter.sync.tick_ms", "must be within 1..60000"));
        }
        Ok(())
    }
}

fn check_path(field: &str, p: &str) -> Result<(), ConfigError> {
    if !p.starts_with('/') || p.bytes().any(|b| !b.is_ascii_graphic()) {
        return Err(err(field, format!("{p:?} must be an absolute path without spaces")));
    }
    Ok(())
}

/// The path part of a `:path` value (without query string or fragment).
pub fn path_only(path: &str) -> &str {
    path.split(['?', '#']).next().unwrap_or(path)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const OK: &str = r#"{"filter": {"endpoints": [{"address": "10.0.0.1:8000", "role": "decode"}]}}"#;

    #[test]
    fn minimal_config_has_defaults() {
        let c = PluginConfig::parse(OK.as_bytes()).unwrap();
        assert_eq!(c.policy, Policy::default());
        assert_eq!(c.filter.endpoints[0].role, Role::Decode);
        assert!(c.filter.endpoints[0].healthy);
        assert_eq!(c.filter.sync, SyncConfig::default());
        assert!(c.filter.fail_open.enabled);
        assert!(c.filter.metrics.is_none() && c.filter.events.is_none());
    }

    #[test]
    fn policy_and_filter_sections_are_split() {
        let text = r#"{"modes": {"decode_kv_ceiling": 0.7},
            "filter": {"endpoints": [], "metrics": {"cluster": "c"},
                       "events": {"path": "/ev", "secret": "0123456789abcdef"}}}"#;
        let c = PluginConfig::parse(text.as_bytes()).unwrap();
        assert_eq!(c.policy.config().modes.decode_kv_ceiling, 0.7);
        let m = c.filter.metrics.unwrap();
        assert_eq!((m.path.as_str(), m.interval_ms, m.timeout(), m.lease()), ("/metrics", 250, 250, 1000));
    }

    #[test]
    fn errors_name_the_field() {
        let bad = |text: &str, field: &str| {
            let e = PluginConfig::parse(text.as_bytes()).unwrap_err();
            assert_eq!(e.field, field, "{text}: {e}");
        };
        bad("", ".");
        bad("[1]", ".");
        bad("{}", "filter");
        bad(r#"{"filter": {"endpoints": [{"address": "nope", "role": "decode"}]}}"#, "filter.endpoints[0].address");
        bad(r#"{"filter": {"endpoints": [{"address": "10.0.0.1:1", "role": "chef"}]}}"#, "filter.endpoints[0].role");
        bad(
            r#"{"filter": {"endpoints": [{"address": "10.0.0.1:1", "role": "decode"}, {"address": "10.0.0.1:1", "role": "both"}]}}"#,
            "filter.endpoints[1].address",
        );
        bad(r#"{"filter": {"endpoints": [], "extra": 1}}"#, "filter.extra");
        bad(r#"{"modes": {"decode_kv_ceiling": 7}, "filter": {"endpoints": []}}"#, "policy");
        bad(r#"{"nonsense": 1, "filter": {"endpoints": []}}"#, "policy");
        bad(
            r#"{"filter": {"endpoints": [], "metrics": {"cluster": "c", "interval_ms": 5000}}}"#,
            "filter.metrics.interval_ms",
        );
        bad(r#"{"filter": {"endpoints": [], "metrics": {"cluster": "c", "path": "metrics"}}}"#, "filter.metrics.path");
        bad(r#"{"filter": {"endpoints": [], "events": {"path": "/e", "secret": "short"}}}"#, "filter.events.secret");
        bad(
            r#"{"filter": {"endpoints": [], "events": {"path": "/e", "secret": "0123456789abcdef", "signature_window_ms": 0}}}"#,
            "filter.events.signature_window_ms",
        );
        bad(r#"{"filter": {"endpoints": [], "stats_path": "/s", "stats_secret": "short"}}"#, "filter.stats_secret");
        bad(r#"{"filter": {"endpoints": [], "sync": {"ring_entries": 2}}}"#, "filter.sync.ring_entries");
        bad(r#"{"filter": {"endpoints": [], "sync": {"namespace": ""}}}"#, "filter.sync.namespace");
        bad(r#"{"filter": {"endpoints": [], "fail_open": {"reject_status": 42}}}"#, "filter.fail_open.reject_status");
        let replica = |extra: &str| {
            format!(
                r#"{{"filter": {{"endpoints": [], "stats_path": "/kvroute/v1/replica/out",
                   "replica": {{"fleet": "f", "replica_id": "r1", "secret": "0123456789abcdef"{extra}}}}}}}"#
            )
        };
        bad(&replica(""), "filter.replica.path");
        bad(&replica(r#", "path": "/r", "fleet": "a.b""#), "filter.replica");
        bad(&replica(r#", "path": "/r", "secret": "short""#), "filter.replica.secret");
        bad(&replica(r#", "path": "/r", "max_batch_bytes": 10"#), "filter.replica.max_batch_bytes");
        let ok = PluginConfig::parse(replica(r#", "path": "/r/""#).as_bytes()).unwrap().filter.replica.unwrap();
        assert_eq!((ok.out_path().as_str(), ok.in_path().as_str()), ("/r/out", "/r/in"));
        assert!(!ok.core_config().publish);
        assert_eq!(ok.route("/r/out"), Some(ReplicaRoute::Out));
        assert_eq!(ok.route("/r/in"), Some(ReplicaRoute::In));
        assert_eq!(ok.route("/r/inx"), None);
        assert_eq!(ok.route("/x/in"), None);
    }

    #[test]
    fn path_only_strips_the_query() {
        assert_eq!(path_only("/a/b?x=1"), "/a/b");
        assert_eq!(path_only("/a"), "/a");
    }
}
