//! The simulator's typed error.

use kvroute::{ConfigError, ReplicaError, RouteError, StateError};

/// Anything that can stop a simulation: unreadable or malformed input, an invalid setting, or the
/// router refusing an operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// A trace line is malformed (1-based line number).
    #[error("trace line {line}: {message}")]
    TraceLine {
        /// 1-based line number in the JSONL file.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// The workload has no requests.
    #[error("the workload has no requests")]
    EmptyWorkload,
    /// A request of the workload cannot be parsed with the policy's request settings.
    #[error("request #{index} ({request_id}): {source}")]
    Request {
        /// 1-based position of the request in the (time-sorted) workload.
        index: usize,
        /// Its request id.
        request_id: String,
        /// The parse error.
        #[source]
        source: kvroute::RequestError,
    },
    /// The kvroute policy document is invalid.
    #[error("kvroute policy: {0}")]
    Policy(#[from] ConfigError),
    /// A simulator setting is out of range.
    #[error("invalid setting `{name}` = {value}: {reason}")]
    Setting {
        /// Setting name (as the CLI flag, without dashes).
        name: &'static str,
        /// The value given.
        value: String,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// An unknown policy name.
    #[error("unknown policy {name:?} (known: {known})")]
    UnknownPolicy {
        /// The name given.
        name: String,
        /// Comma-separated known names.
        known: String,
    },
    /// The router refused an endpoint-table operation.
    #[error("router state: {0}")]
    State(#[from] StateError),
    /// The router refused a replication setting or operation.
    #[error("replication: {0}")]
    Replica(#[from] ReplicaError),
    /// The router could not route a request.
    #[error("routing request {request_id}: {source}")]
    Route {
        /// The request id.
        request_id: String,
        /// The router's error.
        #[source]
        source: RouteError,
    },
}

impl SimError {
    pub(crate) fn setting(name: &'static str, value: impl std::fmt::Display, reason: &'static str) -> SimError {
        SimError::Setting { name, value: value.to_string(), reason }
    }

    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> SimError {
        SimError::Io { path: path.display().to_string(), source }
    }
}
