//! Core errors → the Python exception classes of `kvroute._errors` (`KvrouteError` and its
//! subclasses), with the message of the core error and its fields as attributes.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyModule};

use kvroute::EventError;
use kvroute::{ConfigError, EventIngestError, RequestError, RouteError, StateError};

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// Attributes of one exception: `(name, value)` pairs, `None` values skipped.
pub(crate) struct Attrs<'py> {
    dict: Bound<'py, PyDict>,
}

impl<'py> Attrs<'py> {
    fn new(py: Python<'py>, kind: &str) -> PyResult<Self> {
        let dict = PyDict::new(py);
        dict.set_item("kind", kind)?;
        Ok(Attrs { dict })
    }

    fn set<V: IntoPyObject<'py>>(self, name: &str, value: V) -> PyResult<Self> {
        self.dict.set_item(name, value)?;
        Ok(self)
    }
}

/// An instance of `kvroute._errors.<class>` with `message` and the attributes.
fn build(py: Python<'_>, class: &str, message: String, attrs: PyResult<Attrs<'_>>) -> PyErr {
    let made = (|| -> PyResult<PyErr> {
        let attrs = attrs?;
        let module = ERRORS.get_or_try_init(py, || py.import("kvroute._errors").map(Bound::unbind))?;
        let cls = module.bind(py).getattr(class)?;
        let value = cls.call((message,), Some(&attrs.dict))?;
        Ok(PyErr::from_value(value))
    })();
    // Building the exception itself failed (the package is broken): raise that instead.
    made.unwrap_or_else(|e| e)
}

/// `ConfigError`.
pub(crate) fn config(py: Python<'_>, e: &ConfigError) -> PyErr {
    let attrs = match e {
        ConfigError::Parse { format, path, message } => Attrs::new(py, "parse")
            .and_then(|a| a.set("format", *format))
            .and_then(|a| a.set("field", path))
            .and_then(|a| a.set("reason", message)),
        ConfigError::Invalid { field, value, reason } => Attrs::new(py, "invalid")
            .and_then(|a| a.set("field", field))
            .and_then(|a| a.set("value", value))
            .and_then(|a| a.set("reason", reason)),
        _ => Attrs::new(py, "other"),
    };
    build(py, "ConfigError", e.to_string(), attrs)
}

/// `RequestError`.
pub(crate) fn request(py: Python<'_>, e: &RequestError) -> PyErr {
    let attrs = match e {
        RequestError::BodyTooLarge { size, limit } => {
            Attrs::new(py, "body_too_large").and_then(|a| a.set("size", *size)).and_then(|a| a.set("limit", *limit))
        }
        RequestError::EmptyBody => Attrs::new(py, "empty_body"),
        RequestError::Json { line, column, message } => Attrs::new(py, "json")
            .and_then(|a| a.set("line", *line))
            .and_then(|a| a.set("column", *column))
            .and_then(|a| a.set("reason", message)),
        RequestError::Field { field, message } => {
            Attrs::new(py, "field").and_then(|a| a.set("field", field)).and_then(|a| a.set("reason", message))
        }
        RequestError::Header { header, value, reason } => Attrs::new(py, "header")
            .and_then(|a| a.set("header", header))
            .and_then(|a| a.set("value", value))
            .and_then(|a| a.set("reason", reason)),
        _ => Attrs::new(py, "other"),
    };
    build(py, "RequestError", e.to_string(), attrs)
}

/// `StateError`.
pub(crate) fn state(py: Python<'_>, e: &StateError) -> PyErr {
    let attrs = match e {
        StateError::InvalidEndpointId { id, reason } => Attrs::new(py, "invalid_endpoint_id")
            .and_then(|a| a.set("endpoint", id))
            .and_then(|a| a.set("reason", reason)),
        StateError::UnknownEndpoint { id } => Attrs::new(py, "unknown_endpoint").and_then(|a| a.set("endpoint", id)),
        StateError::TooManyEndpoints { limit } => {
            Attrs::new(py, "too_many_endpoints").and_then(|a| a.set("limit", *limit))
        }
        StateError::InvalidMetrics { endpoint, field, value, reason } => Attrs::new(py, "invalid_metrics")
            .and_then(|a| a.set("endpoint", endpoint))
            .and_then(|a| a.set("field", *field))
            .and_then(|a| a.set("value", value))
            .and_then(|a| a.set("reason", *reason)),
        StateError::UnknownRequest { request_id } => {
            Attrs::new(py, "unknown_request").and_then(|a| a.set("request_id", request_id))
        }
        _ => Attrs::new(py, "other"),
    };
    build(py, "StateError", e.to_string(), attrs)
}

/// `RequestError` or `NoEndpointsError`.
pub(crate) fn route(py: Python<'_>, e: &RouteError) -> PyErr {
    match e {
        RouteError::Request(r) => request(py, r),
        RouteError::NoEndpoints { detail } => build(
            py,
            "NoEndpointsError",
            e.to_string(),
            Attrs::new(py, "no_endpoints").and_then(|a| a.set("reason", *detail)),
        ),
        _ => build(py, "KvrouteError", e.to_string(), Attrs::new(py, "other")),
    }
}

/// `EventError` (undecodable payload).
pub(crate) fn event(py: Python<'_>, e: &EventError) -> PyErr {
    let kind = match e {
        EventError::Truncated { .. } => "truncated",
        EventError::WrongType { .. } => "wrong_type",
        EventError::LengthExceedsInput { .. } => "length_exceeds_input",
        EventError::IntOutOfRange { .. } => "int_out_of_range",
        EventError::ShortHashDigest { .. } => "short_hash_digest",
        EventError::InvalidUtf8 { .. } => "invalid_utf8",
        EventError::UnknownEventType { .. } => "unknown_event_type",
        EventError::UnknownMedium { .. } => "unknown_medium",
        EventError::MissingField { .. } => "missing_field",
        EventError::BatchTooShort { .. } => "batch_too_short",
        EventError::TrailingBytes { .. } => "trailing_bytes",
        _ => "other",
    };
    let field = match e {
        EventError::MissingField { field, .. } => Some(*field),
        _ => None,
    };
    let attrs = Attrs::new(py, kind)
        .and_then(|a| a.set("offset", e.offset()))
        .and_then(|a| a.set("event", e.event()))
        .and_then(|a| a.set("field", field));
    build(py, "EventError", e.to_string(), attrs)
}

/// `EventError` or `StateError`.
pub(crate) fn event_ingest(py: Python<'_>, e: &EventIngestError) -> PyErr {
    match e {
        EventIngestError::Decode(d) => event(py, d),
        EventIngestError::State(s) => state(py, s),
        _ => build(py, "KvrouteError", e.to_string(), Attrs::new(py, "other")),
    }
}

/// `SubscribeError`.
pub(crate) fn subscribe(py: Python<'_>, e: &kvroute::SubscribeError) -> PyErr {
    use kvroute::SubscribeError as E;
    let attrs = match e {
        E::InvalidConfig { field, reason } => {
            Attrs::new(py, "invalid_config").and_then(|a| a.set("field", *field)).and_then(|a| a.set("reason", reason))
        }
        // The router endpoint id is invalid: the same error as registering it.
        E::EndpointId(s) => return state(py, s),
        E::Socket { op, endpoint, source } => Attrs::new(py, "socket")
            .and_then(|a| a.set("op", *op))
            .and_then(|a| a.set("endpoint", endpoint))
            .and_then(|a| a.set("reason", source.to_string())),
        E::Spawn(io) => Attrs::new(py, "spawn").and_then(|a| a.set("reason", io.to_string())),
        E::WorkerPanicked => Attrs::new(py, "worker_panicked"),
        _ => Attrs::new(py, "other"),
    };
    build(py, "SubscribeError", e.to_string(), attrs)
}

/// `TokenizerError`.
pub(crate) fn tokenize(py: Python<'_>, e: &kvroute::TokenizeError) -> PyErr {
    use kvroute::TokenizeError as E;
    let attrs = match e {
        E::Io { path, message } => {
            Attrs::new(py, "io").and_then(|a| a.set("path", path)).and_then(|a| a.set("reason", message))
        }
        E::Tokenizer { .. } => Attrs::new(py, "tokenizer"),
        E::Json { .. } => Attrs::new(py, "json"),
        E::Template { .. } => Attrs::new(py, "template"),
        E::Render { .. } => Attrs::new(py, "render"),
        E::Rejected { .. } => Attrs::new(py, "rejected"),
        E::NoChatTemplate => Attrs::new(py, "no_chat_template"),
        E::Encode { .. } => Attrs::new(py, "encode"),
        _ => Attrs::new(py, "other"),
    };
    build(py, "TokenizerError", e.to_string(), attrs)
}

/// `SimulationError` (or `ConfigError` / `RequestError` for the policy and the workload).
pub(crate) fn sim(py: Python<'_>, e: &kvroute_sim::SimError) -> PyErr {
    use kvroute_sim::SimError as E;
    let attrs = match e {
        E::Policy(c) => return config(py, c),
        E::Io { path, source } => {
            Attrs::new(py, "io").and_then(|a| a.set("path", path)).and_then(|a| a.set("reason", source.to_string()))
        }
        E::TraceLine { line, .. } => Attrs::new(py, "trace_line").and_then(|a| a.set("line", *line)),
        E::EmptyWorkload => Attrs::new(py, "empty_workload"),
        E::Request { .. } => Attrs::new(py, "request"),
        E::Setting { name, .. } => Attrs::new(py, "setting").and_then(|a| a.set("field", *name)),
        E::UnknownPolicy { name, .. } => Attrs::new(py, "unknown_policy").and_then(|a| a.set("field", name)),
        _ => Attrs::new(py, "other"),
    };
    build(py, "SimulationError", e.to_string(), attrs)
}

/// `SimulationError` for a simulator argument that does not parse.
pub(crate) fn sim_setting(py: Python<'_>, name: &'static str, value: &str, reason: &str) -> PyErr {
    build(
        py,
        "SimulationError",
        format!("invalid setting `{name}` = {value}: {reason}"),
        Attrs::new(py, "setting").and_then(|a| a.set("field", name)).and_then(|a| a.set("reason", reason)),
    )
}

/// `MetricsError` (or `StateError` for an unknown endpoint or invalid snapshot).
pub(crate) fn metrics(py: Python<'_>, e: &kvroute::MetricsError) -> PyErr {
    use kvroute::MetricsError as E;
    let attrs = match e {
        E::Malformed { line, text, reason } => Attrs::new(py, "malformed")
            .and_then(|a| a.set("line", *line))
            .and_then(|a| a.set("text", text))
            .and_then(|a| a.set("reason", *reason)),
        E::NoKnownMetrics => Attrs::new(py, "no_known_metrics"),
        E::State(s) => return state(py, s),
        _ => Attrs::new(py, "other"),
    };
    build(py, "MetricsError", e.to_string(), attrs)
}

/// `ReplicationConfigError` (invalid options) or `ReplicationError`.
pub(crate) fn replica(py: Python<'_>, e: &kvroute::ReplicaError) -> PyErr {
    use kvroute::ReplicaError as E;
    match e {
        E::Config { field, reason } => build(
            py,
            "ReplicationConfigError",
            e.to_string(),
            Attrs::new(py, "invalid_options")
                .and_then(|a| a.set("field", *field))
                .and_then(|a| a.set("reason", reason)),
        ),
        E::NotEnabled => build(py, "ReplicationError", e.to_string(), Attrs::new(py, "not_enabled")),
        E::AlreadyEnabled { replica_id } => already_replicating(py, replica_id),
        E::Malformed(reason) => build(
            py,
            "ReplicationError",
            e.to_string(),
            Attrs::new(py, "malformed").and_then(|a| a.set("reason", reason)),
        ),
        E::Transport(reason) => build(
            py,
            "ReplicationError",
            e.to_string(),
            Attrs::new(py, "transport").and_then(|a| a.set("reason", reason)),
        ),
        _ => build(py, "ReplicationError", e.to_string(), Attrs::new(py, "other")),
    }
}

/// `ReplicationError` (kind `already_replicating`): the router replicates already.
pub(crate) fn already_replicating(py: Python<'_>, replica_id: &str) -> PyErr {
    build(
        py,
        "ReplicationError",
        format!("the router already replicates as {replica_id:?}: stop that replication first"),
        Attrs::new(py, "already_replicating").and_then(|a| a.set("replica_id", replica_id)),
    )
}
