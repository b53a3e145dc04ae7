//! Result codes, the panic boundary and the per-thread last error.
//!
//! Every exported function runs its body through [`guard`] (or [`guard_value`] for the few
//! accessors that return a plain value): a panic is caught there and becomes
//! `KVROUTE_RESULT_PANIC`, so no unwind ever crosses the C ABI. A failing call records its
//! message (and the field or header the error names) in a thread-local slot that the
//! `kvroute_last_error_*` functions copy into caller buffers.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};

use kvroute::EventError;
use kvroute::{ConfigError, EventIngestError, MetricsError, RequestError, RouteError, StateError};

use crate::ptr;

/// The outcome of a call: `KVROUTE_RESULT_OK` (0) or an error code. The values are stable: a
/// code keeps its number in every later version, and new codes get new numbers.
pub type kvroute_result = i32;

/// Success.
pub const KVROUTE_RESULT_OK: kvroute_result = 0;
/// A pointer argument that must not be NULL was NULL (or a NULL data pointer came with a
/// non-zero length).
pub const KVROUTE_RESULT_NULL_ARGUMENT: kvroute_result = 1;
/// A text argument (identifier, document, header, path) is not valid UTF-8.
pub const KVROUTE_RESULT_INVALID_UTF8: kvroute_result = 2;
/// An argument value is out of its range (an unknown role or socket mode constant).
pub const KVROUTE_RESULT_INVALID_ARGUMENT: kvroute_result = 3;
/// The caller's buffer is too small: `*needed` (when given) holds the size required, NUL
/// included, and the buffer is left untouched. Not recorded as the last error.
pub const KVROUTE_RESULT_BUFFER_TOO_SMALL: kvroute_result = 4;
/// An index is not below the matching count (`kvroute_decision_header_count`, ...).
pub const KVROUTE_RESULT_OUT_OF_RANGE: kvroute_result = 5;
/// The optional value asked for is not set (no prefill endpoint, not shed, no transfer
/// estimate, no such header, no last error). Not recorded as the last error.
pub const KVROUTE_RESULT_ABSENT: kvroute_result = 6;
/// The library was built without the feature this function needs (`zmq`, `tokenizer`).
pub const KVROUTE_RESULT_UNSUPPORTED: kvroute_result = 7;
/// A policy document is malformed or invalid (the field is in `kvroute_last_error_field`);
/// on reload, the old policy keeps serving.
pub const KVROUTE_RESULT_CONFIG_ERROR: kvroute_result = 10;
/// A request body or header cannot be understood (the body field path is in
/// `kvroute_last_error_field`, the header name in `kvroute_last_error_header`).
pub const KVROUTE_RESULT_REQUEST_ERROR: kvroute_result = 11;
/// No healthy endpoint can serve the request.
pub const KVROUTE_RESULT_NO_ENDPOINTS: kvroute_result = 12;
/// No endpoint with this id is registered.
pub const KVROUTE_RESULT_UNKNOWN_ENDPOINT: kvroute_result = 13;
/// The endpoint id is not a valid `ip:port` socket address.
pub const KVROUTE_RESULT_INVALID_ENDPOINT_ID: kvroute_result = 14;
/// The router already tracks `limits.max_endpoints` endpoints.
pub const KVROUTE_RESULT_TOO_MANY_ENDPOINTS: kvroute_result = 15;
/// A metrics value is out of range (the field is in `kvroute_last_error_field`).
pub const KVROUTE_RESULT_INVALID_METRICS: kvroute_result = 16;
/// `kvroute_router_complete`: the request is not in flight.
pub const KVROUTE_RESULT_UNKNOWN_REQUEST: kvroute_result = 17;
/// A KV-event payload is not a valid event batch; nothing of it was applied.
pub const KVROUTE_RESULT_EVENT_DECODE_ERROR: kvroute_result = 18;
/// A Prometheus metrics page cannot be used (malformed line, no known engine metrics).
pub const KVROUTE_RESULT_METRICS_PARSE_ERROR: kvroute_result = 19;
/// A ZMQ subscription could not be started (invalid configuration, socket error) or its worker
/// thread failed.
pub const KVROUTE_RESULT_SUBSCRIBE_ERROR: kvroute_result = 20;
/// A tokenizer could not be loaded.
pub const KVROUTE_RESULT_TOKENIZER_ERROR: kvroute_result = 21;
/// Another endpoint-table or request-tracking error (a kind added to the core after this
/// library version).
pub const KVROUTE_RESULT_STATE_ERROR: kvroute_result = 22;
/// A routing effect (`kvroute_router_apply_effect`) is truncated, malformed or of an unknown
/// format version; nothing was applied.
pub const KVROUTE_RESULT_EFFECT_DECODE_ERROR: kvroute_result = 23;
/// A router replica's transport could not start (`kvroute_router_replicate`: the client's
/// options, its runtime or thread).
pub const KVROUTE_RESULT_REPLICATION_ERROR: kvroute_result = 24;
/// A panic was caught at the library boundary (a bug in kvroute: please report the message).
/// The router stays usable.
pub const KVROUTE_RESULT_PANIC: kvroute_result = 30;
/// Another internal error (an error kind added to the core after this library version).
pub const KVROUTE_RESULT_INTERNAL: kvroute_result = 31;

/// A failed call: its code, message and what it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Error {
    pub(crate) code: kvroute_result,
    pub(crate) message: String,
    /// The config field path, request body field path, metrics or subscriber config field.
    pub(crate) field: Option<String>,
    /// The request header name.
    pub(crate) header: Option<String>,
}

/// The result of a function body.
pub(crate) type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn new(code: kvroute_result, message: impl Into<String>) -> Self {
        Error { code, message: message.into(), field: None, header: None }
    }

    fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    /// `name` is NULL.
    pub(crate) fn null(name: &str) -> Self {
        Error::new(KVROUTE_RESULT_NULL_ARGUMENT, format!("`{name}` is NULL"))
    }

    /// The optional value `what` is not set.
    pub(crate) fn absent(what: &str) -> Self {
        Error::new(KVROUTE_RESULT_ABSENT, format!("{what} is not set"))
    }

    /// Index `i` is not below `count`.
    pub(crate) fn out_of_range(what: &str, i: usize, count: usize) -> Self {
        Error::new(KVROUTE_RESULT_OUT_OF_RANGE, format!("{what} index {i} is out of range (count {count})"))
    }

    /// Built without `feature`.
    #[allow(dead_code)] // used only when a feature is off
    pub(crate) fn unsupported(feature: &str) -> Self {
        Error::new(KVROUTE_RESULT_UNSUPPORTED, format!("libkvroute was built without the `{feature}` feature"))
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        let field = match &e {
            ConfigError::Parse { path, .. } => Some(path.clone()),
            ConfigError::Invalid { field, .. } => Some(field.clone()),
            _ => None,
        };
        Error { code: KVROUTE_RESULT_CONFIG_ERROR, message: e.to_string(), field, header: None }
    }
}

impl From<RequestError> for Error {
    fn from(e: RequestError) -> Self {
        let (field, header) = match &e {
            RequestError::Field { field, .. } => (Some(field.clone()), None),
            RequestError::Header { header, .. } => (None, Some(header.clone())),
            _ => (None, None),
        };
        Error { code: KVROUTE_RESULT_REQUEST_ERROR, message: e.to_string(), field, header }
    }
}

impl From<RouteError> for Error {
    fn from(e: RouteError) -> Self {
        match e {
            RouteError::Request(r) => r.into(),
            e @ RouteError::NoEndpoints { .. } => Error::new(KVROUTE_RESULT_NO_ENDPOINTS, e.to_string()),
            e => Error::new(KVROUTE_RESULT_INTERNAL, e.to_string()),
        }
    }
}

impl From<StateError> for Error {
    fn from(e: StateError) -> Self {
        let code = match &e {
            StateError::InvalidEndpointId { .. } => KVROUTE_RESULT_INVALID_ENDPOINT_ID,
            StateError::UnknownEndpoint { .. } => KVROUTE_RESULT_UNKNOWN_ENDPOINT,
            StateError::TooManyEndpoints { .. } => KVROUTE_RESULT_TOO_MANY_ENDPOINTS,
            StateError::InvalidMetrics { field, .. } => {
                return Error::new(KVROUTE_RESULT_INVALID_METRICS, e.to_string()).with_field(*field)
            }
            StateError::UnknownRequest { .. } => KVROUTE_RESULT_UNKNOWN_REQUEST,
            _ => KVROUTE_RESULT_STATE_ERROR,
        };
        Error::new(code, e.to_string())
    }
}

impl From<EventError> for Error {
    fn from(e: EventError) -> Self {
        let err = Error::new(KVROUTE_RESULT_EVENT_DECODE_ERROR, e.to_string());
        match e {
            EventError::MissingField { field, .. } => err.with_field(field),
            _ => err,
        }
    }
}

impl From<EventIngestError> for Error {
    fn from(e: EventIngestError) -> Self {
        match e {
            EventIngestError::Decode(d) => d.into(),
            EventIngestError::State(s) => s.into(),
            e => Error::new(KVROUTE_RESULT_INTERNAL, e.to_string()),
        }
    }
}

impl From<MetricsError> for Error {
    fn from(e: MetricsError) -> Self {
        match e {
            MetricsError::State(s) => s.into(),
            e => Error::new(KVROUTE_RESULT_METRICS_PARSE_ERROR, e.to_string()),
        }
    }
}

impl From<kvroute::EffectDecodeError> for Error {
    fn from(e: kvroute::EffectDecodeError) -> Self {
        Error::new(KVROUTE_RESULT_EFFECT_DECODE_ERROR, e.to_string())
    }
}

#[cfg(feature = "zmq")]
impl From<kvroute::SubscribeError> for Error {
    fn from(e: kvroute::SubscribeError) -> Self {
        use kvroute::SubscribeError as E;
        match e {
            // The router endpoint id is invalid: the same error as registering it.
            E::EndpointId(s) => s.into(),
            E::InvalidConfig { field, .. } => {
                Error::new(KVROUTE_RESULT_SUBSCRIBE_ERROR, e.to_string()).with_field(field)
            }
            e => Error::new(KVROUTE_RESULT_SUBSCRIBE_ERROR, e.to_string()),
        }
    }
}

#[cfg(feature = "nats")]
impl From<kvroute::ReplicaError> for Error {
    fn from(e: kvroute::ReplicaError) -> Self {
        use kvroute::ReplicaError as E;
        match &e {
            E::Config { field, .. } => {
                let field = *field;
                Error::new(KVROUTE_RESULT_CONFIG_ERROR, e.to_string()).with_field(field)
            }
            E::NotEnabled | E::AlreadyEnabled { .. } => Error::new(KVROUTE_RESULT_STATE_ERROR, e.to_string()),
            _ => Error::new(KVROUTE_RESULT_REPLICATION_ERROR, e.to_string()),
        }
    }
}

#[cfg(feature = "tokenizer")]
impl From<kvroute::TokenizeError> for Error {
    fn from(e: kvroute::TokenizeError) -> Self {
        Error::new(KVROUTE_RESULT_TOKENIZER_ERROR, e.to_string())
    }
}

thread_local! {
    /// The last error recorded on this thread.
    static LAST_ERROR: RefCell<Option<Error>> = const { RefCell::new(None) };
}

/// Record `e` as this thread's last error (except the two answers that are no failures).
fn record(function: &str, mut e: Error) -> kvroute_result {
    let code = e.code;
    if code != KVROUTE_RESULT_BUFFER_TOO_SMALL && code != KVROUTE_RESULT_ABSENT {
        e.message = format!("{function}: {}", e.message);
        // During thread teardown the slot may be gone: the code alone is returned then.
        let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = Some(e));
    }
    code
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_owned()
    }
}

/// The panic boundary of a function returning `kvroute_result`: runs `body`, turns an error
/// into its code (recording it as the last error) and a panic into `KVROUTE_RESULT_PANIC`.
pub(crate) fn guard(function: &str, body: impl FnOnce() -> Result<()>) -> kvroute_result {
    // Unwind safety: on a panic the router's own state is protected by its mutex (the core
    // keeps serving after a poisoned lock), and no half-written out-parameter is exposed.
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => KVROUTE_RESULT_OK,
        Ok(Err(e)) => record(function, e),
        Err(payload) => {
            record(function, Error::new(KVROUTE_RESULT_PANIC, format!("panic: {}", panic_message(&*payload))))
        }
    }
}

/// The panic boundary of an accessor returning a plain value: `fallback` on a panic (which is
/// recorded as the last error).
pub(crate) fn guard_value<T>(function: &str, fallback: T, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(payload) => {
            record(function, Error::new(KVROUTE_RESULT_PANIC, format!("panic: {}", panic_message(&*payload))));
            fallback
        }
    }
}

/// Copy one part of this thread's last error. These functions never record an error
/// themselves, so a size query does not overwrite what it is asking about.
fn copy_last(
    part: impl FnOnce(&Error) -> Option<&str>,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    let copied = catch_unwind(AssertUnwindSafe(|| {
        LAST_ERROR.try_with(|slot| {
            let slot = slot.borrow();
            let Some(text) = slot.as_ref().and_then(part) else { return KVROUTE_RESULT_ABSENT };
            // SAFETY: the caller's contract (see the public functions): `buf` is NULL or
            // valid for `buf_len` bytes, `needed` is NULL or valid for one `size_t`.
            match unsafe { ptr::copy_str(text.as_bytes(), buf, buf_len, needed) } {
                Ok(()) => KVROUTE_RESULT_OK,
                Err(e) => e.code,
            }
        })
    }));
    match copied {
        Ok(Ok(code)) => code,
        Ok(Err(_)) => KVROUTE_RESULT_ABSENT,
        Err(_) => KVROUTE_RESULT_PANIC,
    }
}

/// The code of the last failed call on this thread (`KVROUTE_RESULT_OK` when none failed yet).
/// `KVROUTE_RESULT_BUFFER_TOO_SMALL` and `KVROUTE_RESULT_ABSENT` are answers, not failures: they
/// are never recorded.
///
/// Thread safety: every thread has its own last error.
///
/// Ownership: returns a plain value; nothing to free.
/// NULL: takes no pointer.
#[no_mangle]
pub extern "C" fn kvroute_last_error_code() -> kvroute_result {
    catch_unwind(|| LAST_ERROR.try_with(|slot| slot.borrow().as_ref().map_or(KVROUTE_RESULT_OK, |e| e.code)))
        .ok()
        .and_then(std::result::Result::ok)
        .unwrap_or(KVROUTE_RESULT_OK)
}

/// Copy the message of the last failed call on this thread (it starts with the function's
/// name, e.g. `kvroute_router_route: request field `model`: missing field `model``) into `buf`.
///
/// A call that fails records its message; a call that succeeds leaves it (like `errno`), so read
/// it right after the failing call. This function and the other `kvroute_last_error_*`
/// functions never record an error themselves.
///
/// Strings out: `buf` receives the text and a terminating NUL when `buf_len` is at least the
/// size needed; `*needed` (when `needed` is not NULL) receives that size, NUL included, on
/// `KVROUTE_RESULT_OK` and on `KVROUTE_RESULT_BUFFER_TOO_SMALL` (the buffer is then left
/// untouched). `buf` may be NULL when `buf_len` is 0 (a size query).
///
/// Returns `KVROUTE_RESULT_ABSENT` if no call failed on this thread yet.
///
/// Thread safety: every thread has its own last error.
///
/// Ownership: the text is copied into the caller's `buf`; nothing to free.
///
/// # Safety
///
/// `buf` is NULL or valid for writes of `buf_len` bytes; `needed` is NULL or valid for one
/// write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_last_error_message(
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    copy_last(|e| Some(e.message.as_str()), buf, buf_len, needed)
}

/// Copy the field the last error on this thread names: the dotted path of a policy field
/// (`KVROUTE_RESULT_CONFIG_ERROR`, `.` for the document root), the path of a request body field
/// (`KVROUTE_RESULT_REQUEST_ERROR`, e.g. `messages[2].content`), the metrics field
/// (`KVROUTE_RESULT_INVALID_METRICS`), the subscriber config field
/// (`KVROUTE_RESULT_SUBSCRIBE_ERROR`), the replication setting (`KVROUTE_RESULT_CONFIG_ERROR`
/// from `kvroute_router_replicate`: `options` when the document does not parse) or the missing event field
/// (`KVROUTE_RESULT_EVENT_DECODE_ERROR`). Returns `KVROUTE_RESULT_ABSENT` when it names none.
///
/// Strings out as in `kvroute_last_error_message`. Thread safety: per thread.
///
/// Ownership: the text is copied into the caller's `buf`; nothing to free.
/// NULL: `buf` may be NULL only when `buf_len` is 0; `needed` may be NULL.
///
/// # Safety
///
/// As for `kvroute_last_error_message`.
#[no_mangle]
pub unsafe extern "C" fn kvroute_last_error_field(
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    copy_last(|e| e.field.as_deref(), buf, buf_len, needed)
}

/// Copy the request header name the last error on this thread names
/// (`KVROUTE_RESULT_REQUEST_ERROR` for a header, lower case). Returns `KVROUTE_RESULT_ABSENT`
/// when it names none.
///
/// Strings out as in `kvroute_last_error_message`. Thread safety: per thread.
///
/// Ownership: the text is copied into the caller's `buf`; nothing to free.
/// NULL: `buf` may be NULL only when `buf_len` is 0; `needed` may be NULL.
///
/// # Safety
///
/// As for `kvroute_last_error_message`.
#[no_mangle]
pub unsafe extern "C" fn kvroute_last_error_header(
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    copy_last(|e| e.header.as_deref(), buf, buf_len, needed)
}

/// The name of a result code (`"KVROUTE_RESULT_OK"`, ...), or NULL for a value that is no
/// result code. The string is static: never free it.
///
/// Thread safety: any thread.
///
/// Ownership: the returned string is static: never free it.
#[no_mangle]
pub extern "C" fn kvroute_result_name(code: kvroute_result) -> *const c_char {
    guard_value("kvroute_result_name", std::ptr::null(), || {
        let name = match code {
            KVROUTE_RESULT_OK => c"KVROUTE_RESULT_OK",
            KVROUTE_RESULT_NULL_ARGUMENT => c"KVROUTE_RESULT_NULL_ARGUMENT",
            KVROUTE_RESULT_INVALID_UTF8 => c"KVROUTE_RESULT_INVALID_UTF8",
            KVROUTE_RESULT_INVALID_ARGUMENT => c"KVROUTE_RESULT_INVALID_ARGUMENT",
            KVROUTE_RESULT_BUFFER_TOO_SMALL => c"KVROUTE_RESULT_BUFFER_TOO_SMALL",
            KVROUTE_RESULT_OUT_OF_RANGE => c"KVROUTE_RESULT_OUT_OF_RANGE",
            KVROUTE_RESULT_ABSENT => c"KVROUTE_RESULT_ABSENT",
            KVROUTE_RESULT_UNSUPPORTED => c"KVROUTE_RESULT_UNSUPPORTED",
            KVROUTE_RESULT_CONFIG_ERROR => c"KVROUTE_RESULT_CONFIG_ERROR",
            KVROUTE_RESULT_REQUEST_ERROR => c"KVROUTE_RESULT_REQUEST_ERROR",
            KVROUTE_RESULT_NO_ENDPOINTS => c"KVROUTE_RESULT_NO_ENDPOINTS",
            KVROUTE_RESULT_UNKNOWN_ENDPOINT => c"KVROUTE_RESULT_UNKNOWN_ENDPOINT",
            KVROUTE_RESULT_INVALID_ENDPOINT_ID => c"KVROUTE_RESULT_INVALID_ENDPOINT_ID",
            KVROUTE_RESULT_TOO_MANY_ENDPOINTS => c"KVROUTE_RESULT_TOO_MANY_ENDPOINTS",
            KVROUTE_RESULT_INVALID_METRICS => c"KVROUTE_RESULT_INVALID_METRICS",
            KVROUTE_RESULT_UNKNOWN_REQUEST => c"KVROUTE_RESULT_UNKNOWN_REQUEST",
            KVROUTE_RESULT_EVENT_DECODE_ERROR => c"KVROUTE_RESULT_EVENT_DECODE_ERROR",
            KVROUTE_RESULT_METRICS_PARSE_ERROR => c"KVROUTE_RESULT_METRICS_PARSE_ERROR",
            KVROUTE_RESULT_SUBSCRIBE_ERROR => c"KVROUTE_RESULT_SUBSCRIBE_ERROR",
            KVROUTE_RESULT_TOKENIZER_ERROR => c"KVROUTE_RESULT_TOKENIZER_ERROR",
            KVROUTE_RESULT_STATE_ERROR => c"KVROUTE_RESULT_STATE_ERROR",
            KVROUTE_RESULT_EFFECT_DECODE_ERROR => c"KVROUTE_RESULT_EFFECT_DECODE_ERROR",
            KVROUTE_RESULT_REPLICATION_ERROR => c"KVROUTE_RESULT_REPLICATION_ERROR",
            KVROUTE_RESULT_PANIC => c"KVROUTE_RESULT_PANIC",
            KVROUTE_RESULT_INTERNAL => c"KVROUTE_RESULT_INTERNAL",
            _ => return std::ptr::null(),
        };
        name.as_ptr()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> Option<Error> {
        LAST_ERROR.with(|s| s.borrow().clone())
    }

    #[test]
    fn a_panic_becomes_a_code_and_a_message() {
        let code = guard("kvroute_test", || panic!("boom {}", 42));
        assert_eq!(code, KVROUTE_RESULT_PANIC);
        let e = last().unwrap();
        assert_eq!(e.code, KVROUTE_RESULT_PANIC);
        assert_eq!(e.message, "kvroute_test: panic: boom 42");
        assert_eq!(kvroute_last_error_code(), KVROUTE_RESULT_PANIC);
        let v = guard_value("kvroute_test_value", 7u64, || panic!("static message"));
        assert_eq!(v, 7);
        assert_eq!(last().unwrap().message, "kvroute_test_value: panic: static message");
    }

    #[test]
    fn errors_are_recorded_and_answers_are_not() {
        let code = guard("f", || Err(Error::new(KVROUTE_RESULT_CONFIG_ERROR, "bad").with_field("modes.x")));
        assert_eq!(code, KVROUTE_RESULT_CONFIG_ERROR);
        assert_eq!(last().unwrap().field.as_deref(), Some("modes.x"));
        assert_eq!(guard("g", || Err(Error::absent("x"))), KVROUTE_RESULT_ABSENT);
        assert_eq!(
            guard("g", || Err(Error::new(KVROUTE_RESULT_BUFFER_TOO_SMALL, "small"))),
            KVROUTE_RESULT_BUFFER_TOO_SMALL
        );
        assert_eq!(last().unwrap().message, "f: bad", "answers leave the last error alone");
        assert_eq!(guard("h", || Ok(())), KVROUTE_RESULT_OK);
        assert_eq!(last().unwrap().message, "f: bad", "successes leave the last error alone");
    }

    #[test]
    fn every_code_has_a_distinct_name() {
        let mut seen = std::collections::BTreeSet::new();
        for code in -1..64 {
            let p = kvroute_result_name(code);
            if p.is_null() {
                continue;
            }
            // SAFETY: non-NULL names are static NUL-terminated strings.
            let name = unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap();
            assert!(name.starts_with("KVROUTE_RESULT_"));
            assert!(seen.insert(name.to_owned()));
        }
        assert_eq!(seen.len(), 25);
    }
}
