//! Typed errors. Every fallible entry point returns one of these; nothing in the core panics on
//! outside data.

use std::fmt;

/// A policy configuration could not be read or is invalid. The previous policy (if any) stays active.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The text is not valid JSON/YAML for the policy schema (syntax, wrong type, unknown field).
    #[error("{format} config error at `{path}`: {message}")]
    Parse {
        /// `"json"` or `"yaml"`.
        format: &'static str,
        /// Dotted path of the offending field (`.` for the document root).
        path: String,
        /// What the parser said.
        message: String,
    },
    /// The document parsed but a value is out of its allowed range.
    #[error("invalid config: `{field}` = {value}: {reason}")]
    Invalid {
        /// Dotted path of the offending field.
        field: String,
        /// The offending value, as text.
        value: String,
        /// Why it is rejected.
        reason: String,
    },
}

impl ConfigError {
    pub(crate) fn invalid(field: &str, value: impl fmt::Display, reason: impl Into<String>) -> Self {
        ConfigError::Invalid { field: field.to_owned(), value: value.to_string(), reason: reason.into() }
    }
}

/// An inference request (body or headers) could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// The body is larger than `request.max_body_bytes`.
    #[error("request body is {size} bytes, over the limit of {limit} bytes")]
    BodyTooLarge {
        /// Body size in bytes.
        size: usize,
        /// Configured limit.
        limit: usize,
    },
    /// The body is empty.
    #[error("request body is empty")]
    EmptyBody,
    /// The body is not syntactically valid JSON.
    #[error("request body is not valid JSON (line {line}, column {column}): {message}")]
    Json {
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// What the parser said.
        message: String,
    },
    /// A body field is missing, has the wrong type or a value out of range.
    #[error("request field `{field}`: {message}")]
    Field {
        /// Path of the field, e.g. `messages[2].content`.
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// A header carries a value that cannot be used.
    #[error("request header `{header}` = {value:?}: {reason}")]
    Header {
        /// Header name (lower case).
        header: String,
        /// The value received.
        value: String,
        /// Why it is rejected.
        reason: String,
    },
}

impl RequestError {
    pub(crate) fn field(field: impl Into<String>, message: impl Into<String>) -> Self {
        RequestError::Field { field: field.into(), message: message.into() }
    }
}

/// An endpoint-table or request-tracking operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    /// The endpoint id is not a valid `ip:port` socket address.
    #[error("invalid endpoint id {id:?}: {reason}")]
    InvalidEndpointId {
        /// The id given.
        id: String,
        /// Why it is rejected.
        reason: String,
    },
    /// No endpoint with this id is registered.
    #[error("unknown endpoint {id:?}")]
    UnknownEndpoint {
        /// The id given.
        id: String,
    },
    /// The router already tracks the maximum number of endpoints.
    #[error("too many endpoints: the limit is {limit}")]
    TooManyEndpoints {
        /// The limit.
        limit: usize,
    },
    /// A metrics snapshot field is out of range.
    #[error("invalid metrics for {endpoint:?}: `{field}` = {value}: {reason}")]
    InvalidMetrics {
        /// Endpoint the snapshot was for.
        endpoint: String,
        /// Offending field.
        field: &'static str,
        /// Offending value.
        value: String,
        /// Why it is rejected.
        reason: &'static str,
    },
    /// `complete` was called for a request id that is not in flight (never routed, already
    /// completed, or expired after `limits.inflight_timeout_ms`).
    #[error("request {request_id:?} is not in flight")]
    UnknownRequest {
        /// The id given.
        request_id: String,
    },
}

/// A request could not be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouteError {
    /// The request itself is malformed.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// No healthy endpoint can serve the request (none registered, all unhealthy, or none with a
    /// role that can decode).
    #[error("no healthy endpoint can serve this request ({detail})")]
    NoEndpoints {
        /// What was missing.
        detail: &'static str,
    },
}

/// KV events could not be applied.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EventIngestError {
    /// The payload is not a valid event batch (nothing was applied).
    #[error(transparent)]
    Decode(#[from] crate::precise::events::EventError),
    /// The endpoint is unknown.
    #[error(transparent)]
    State(#[from] StateError),
}
