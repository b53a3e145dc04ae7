//! The filter's side of proxy-wasm ABI 0.2.1 (wasm32 only): the host imports, with safe wrappers
//! that map **every** status to a `Result`, and the exports the host calls (`proxy_on_*`), with a
//! dispatcher that hands them to the root and HTTP contexts of [`crate::filter`].
//!
//! The filter does not use the proxy-wasm Rust SDK: its hostcall wrappers `panic!` on any status
//! they do not expect, its dispatcher unwraps `proxy_set_effective_context` and panics on unknown
//! context ids, its logger unwraps `proxy_log`, and its imports return a Rust enum, so an
//! undefined status code is undefined behaviour. With `panic = "abort"` each of those traps the VM
//! and Envoy takes the filter out of service. Here a hostcall failure is an `Err(Status)` the
//! filter handles (fails open on the request path, logs, counts), an unknown context id is
//! ignored (the stream passes through untouched), and a failed `proxy_log` is dropped.
//!
//! The wrappers keep the SDK's function names and shapes (`crate::filter` imports this module as
//! `hostcalls`), and [`Context`], [`RootContext`] and [`HttpContext`] mirror the SDK's traits for
//! the callbacks the filter implements.

// Calling the host's imports, taking ownership of the memory the host returns through our
// allocator, and exporting the callbacks under their ABI names (`no_mangle`) need `unsafe`; it is
// confined to the `abi` and `exports` modules below, each `unsafe` block with its reason.
#![allow(unsafe_code)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::Duration;

use crate::host_map::{parse_map, serialize_map};

/// `proxy_status_t` other than Ok: why a hostcall failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// 1: the key, header, property or buffer does not exist.
    NotFound,
    /// 2: an argument is out of range or not available now.
    BadArgument,
    /// 3
    SerializationFailure,
    /// 4: the host could not parse a value (also: a map the host returned does not parse).
    ParseFailure,
    /// 6
    InvalidMemoryAccess,
    /// 7
    Empty,
    /// 8: the compare-and-swap value of a shared-data write does not match.
    CasMismatch,
    /// 10
    InternalFailure,
    /// 12
    Unimplemented,
    /// A code ABI 0.2.1 does not define.
    Other(u32),
}

impl Status {
    fn check(code: u32) -> Result<(), Status> {
        Err(match code {
            0 => return Ok(()),
            1 => Status::NotFound,
            2 => Status::BadArgument,
            3 => Status::SerializationFailure,
            4 => Status::ParseFailure,
            6 => Status::InvalidMemoryAccess,
            7 => Status::Empty,
            8 => Status::CasMismatch,
            10 => Status::InternalFailure,
            12 => Status::Unimplemented,
            other => Status::Other(other),
        })
    }
}

/// `proxy_log_level_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(dead_code)]
pub enum LogLevel {
    /// 0
    Trace = 0,
    /// 1
    Debug = 1,
    /// 2
    Info = 2,
    /// 3
    Warn = 3,
    /// 4
    Error = 4,
    /// 5
    Critical = 5,
}

/// `proxy_map_type_t` (the maps the filter reads and writes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapType {
    /// 0
    HttpRequestHeaders = 0,
    /// 6
    HttpCallResponseHeaders = 6,
}

/// `proxy_buffer_type_t` (the buffers the filter reads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufferType {
    /// 0
    HttpRequestBody = 0,
    /// 4
    HttpCallResponseBody = 4,
    /// 7
    PluginConfiguration = 7,
}

/// `proxy_metric_type_t` (the filter defines counters only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricType {
    /// 0
    Counter = 0,
}

/// `proxy_action_t`: what an HTTP callback answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// 0: go on with the headers/body/trailers.
    Continue = 0,
    /// 1: hold them.
    Pause = 1,
}

/// The kind of the contexts a root context creates (only HTTP contexts here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContextType {
    /// HTTP streams.
    HttpContext,
}

/// Callbacks of every context.
pub trait Context {
    /// An HTTP callout dispatched by this context was answered (or failed: no headers).
    fn on_http_call_response(&mut self, _token_id: u32, _num_headers: usize, _body_size: usize, _num_trailers: usize) {}

    /// The host is done with the context; `true`: it may be deleted now.
    fn on_done(&mut self) -> bool {
        true
    }
}

/// Callbacks of a root (plugin) context.
pub trait RootContext: Context {
    /// The VM started.
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        true
    }

    /// A plugin configuration arrived; `false` rejects it.
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        true
    }

    /// The tick period elapsed.
    fn on_tick(&mut self) {}

    /// The context of a new HTTP stream of this plugin (`None`: the stream is not filtered).
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        None
    }

    /// What kind of stream contexts [`RootContext::create_http_context`] makes.
    fn get_type(&self) -> Option<ContextType> {
        None
    }
}

/// Callbacks of an HTTP stream context.
pub trait HttpContext: Context {
    /// Request headers arrived.
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        Action::Continue
    }

    /// Request body data arrived (`body_size`: all buffered so far).
    fn on_http_request_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        Action::Continue
    }

    /// Request trailers arrived.
    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        Action::Continue
    }

    /// The stream is over (access-log time).
    fn on_log(&mut self) {}
}

// ---- the raw imports ----

mod abi {
    #[link(wasm_import_module = "env")]
    extern "C" {
        pub fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
        pub fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
        pub fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
        pub fn proxy_get_buffer_bytes(
            buffer_type: u32,
            start: usize,
            max_size: usize,
            return_buffer_data: *mut *mut u8,
            return_buffer_size: *mut usize,
        ) -> u32;
        pub fn proxy_get_header_map_pairs(
            map_type: u32,
            return_map_data: *mut *mut u8,
            return_map_size: *mut usize,
        ) -> u32;
        pub fn proxy_get_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> u32;
        pub fn proxy_replace_header_map_value(
            map_type: u32,
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
        ) -> u32;
        pub fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
        pub fn proxy_get_property(
            path_data: *const u8,
            path_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
        ) -> u32;
        pub fn proxy_get_shared_data(
            key_data: *const u8,
            key_size: usize,
            return_value_data: *mut *mut u8,
            return_value_size: *mut usize,
            return_cas: *mut u32,
        ) -> u32;
        pub fn proxy_set_shared_data(
            key_data: *const u8,
            key_size: usize,
            value_data: *const u8,
            value_size: usize,
            cas: u32,
        ) -> u32;
        pub fn proxy_send_local_response(
            status_code: u32,
            status_code_details_data: *const u8,
            status_code_details_size: usize,
            body_data: *const u8,
            body_size: usize,
            headers_data: *const u8,
            headers_size: usize,
            grpc_status: i32,
        ) -> u32;
        pub fn proxy_close_stream(stream_type: u32) -> u32;
        pub fn proxy_continue_stream(stream_type: u32) -> u32;
        pub fn proxy_set_effective_context(context_id: u32) -> u32;
        pub fn proxy_http_call(
            upstream_data: *const u8,
            upstream_size: usize,
            headers_data: *const u8,
            headers_size: usize,
            body_data: *const u8,
            body_size: usize,
            trailers_data: *const u8,
            trailers_size: usize,
            timeout_milliseconds: u32,
            return_token: *mut u32,
        ) -> u32;
        pub fn proxy_define_metric(
            metric_type: u32,
            name_data: *const u8,
            name_size: usize,
            return_metric_id: *mut u32,
        ) -> u32;
        pub fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    }
}

/// Takes ownership of `size` bytes at `data`, which the host filled through
/// `proxy_on_memory_allocate` (null or empty: nothing was allocated).
fn take(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() || size == 0 {
        return Vec::new();
    }
    // SAFETY: the host returns a pointer it got from `proxy_on_memory_allocate(size)` for exactly
    // this size (ABI 0.2.1); that allocation has alignment 1 and `size` bytes, which is the layout
    // of a `Vec<u8>` with capacity `size`, and the host wrote all of them.
    unsafe { Vec::from_raw_parts(data, size, size) }
}

/// A returned value: `Ok(None)` when the host answers NotFound.
fn value(code: u32, data: *mut u8, size: usize) -> Result<Option<Vec<u8>>, Status> {
    match Status::check(code) {
        Ok(()) => Ok(Some(take(data, size))),
        Err(Status::NotFound) => Ok(None),
        Err(s) => Err(s),
    }
}

// ---- the safe wrappers (named like the SDK's `hostcalls`) ----

/// Writes a log line. The caller usually ignores the result: a failed log line is dropped.
pub fn log(level: LogLevel, message: &str) -> Result<(), Status> {
    // SAFETY: pointer and length of a live `str`, read by the host during the call.
    Status::check(unsafe { abi::proxy_log(level as u32, message.as_ptr(), message.len()) })
}

/// The host's wall clock, nanoseconds since the UNIX epoch.
pub fn get_current_time_ns() -> Result<u64, Status> {
    let mut t = 0u64;
    // SAFETY: the host writes one u64 to a live local.
    Status::check(unsafe { abi::proxy_get_current_time_nanoseconds(&mut t) })?;
    Ok(t)
}

/// Arms the root context's tick (0: off); periods over `u32::MAX` ms are clamped.
pub fn set_tick_period(period: Duration) -> Result<(), Status> {
    let ms = u32::try_from(period.as_millis()).unwrap_or(u32::MAX);
    // SAFETY: no pointers.
    Status::check(unsafe { abi::proxy_set_tick_period_milliseconds(ms) })
}

/// Up to `max_size` bytes of a buffer from `start` (`None`: no such buffer now).
pub fn get_buffer(buffer_type: BufferType, start: usize, max_size: usize) -> Result<Option<Vec<u8>>, Status> {
    let (mut data, mut size) = (std::ptr::null_mut(), 0usize);
    // SAFETY: the host writes a pointer and a size to live locals.
    let code = unsafe { abi::proxy_get_buffer_bytes(buffer_type as u32, start, max_size, &mut data, &mut size) };
    value(code, data, size)
}

/// Every pair of a header map, handed to `f` as slices of the host's serialized map (no copy
/// per pair). A map the host serialized wrongly is `Err(ParseFailure)` (`f` is not called).
pub fn with_map_pairs<R>(map_type: MapType, f: impl FnOnce(&[(&[u8], &[u8])]) -> R) -> Result<R, Status> {
    let (mut data, mut size) = (std::ptr::null_mut(), 0usize);
    // SAFETY: the host writes a pointer and a size to live locals.
    let code = unsafe { abi::proxy_get_header_map_pairs(map_type as u32, &mut data, &mut size) };
    let bytes = value(code, data, size)?.unwrap_or_default();
    let pairs = parse_map(&bytes).ok_or(Status::ParseFailure)?;
    Ok(f(&pairs))
}

/// One header's value (`None`: absent).
pub fn get_map_value_bytes(map_type: MapType, key: &str) -> Result<Option<Vec<u8>>, Status> {
    let (mut data, mut size) = (std::ptr::null_mut(), 0usize);
    // SAFETY: the key is a live `str` read during the call; the host writes a pointer and a size
    // to live locals.
    let code =
        unsafe { abi::proxy_get_header_map_value(map_type as u32, key.as_ptr(), key.len(), &mut data, &mut size) };
    value(code, data, size)
}

/// Sets a header (replacing every value it had), or removes it with `None`.
pub fn set_map_value(map_type: MapType, key: &str, value: Option<&str>) -> Result<(), Status> {
    // SAFETY: key and value are live `str`s read during the call.
    let code = unsafe {
        match value {
            Some(v) => {
                abi::proxy_replace_header_map_value(map_type as u32, key.as_ptr(), key.len(), v.as_ptr(), v.len())
            }
            None => abi::proxy_remove_header_map_value(map_type as u32, key.as_ptr(), key.len()),
        }
    };
    Status::check(code)
}

/// A property (`None`: the host has no such property).
pub fn get_property(path: Vec<&str>) -> Result<Option<Vec<u8>>, Status> {
    // The path's segments, each ended by a NUL except the last.
    let serialized = path.join("\0");
    let (mut data, mut size) = (std::ptr::null_mut(), 0usize);
    // SAFETY: the path is a live `String` read during the call; the host writes a pointer and a
    // size to live locals.
    let code = unsafe { abi::proxy_get_property(serialized.as_ptr(), serialized.len(), &mut data, &mut size) };
    value(code, data, size)
}

/// Shared data: (value, cas); `(None, None)` when the key does not exist.
pub fn get_shared_data(key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), Status> {
    let (mut data, mut size, mut cas) = (std::ptr::null_mut(), 0usize, 0u32);
    // SAFETY: the key is a live `str` read during the call; the host writes a pointer, a size and
    // a cas to live locals.
    let code = unsafe { abi::proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
    match value(code, data, size)? {
        Some(v) => Ok((Some(v), Some(cas))),
        None => Ok((None, None)),
    }
}

/// Writes shared data; with `cas`, only if the key's cas still matches (else `Err(CasMismatch)`).
pub fn set_shared_data(key: &str, value: Option<&[u8]>, cas: Option<u32>) -> Result<(), Status> {
    let v = value.unwrap_or_default();
    // SAFETY: key and value are live slices read during the call.
    Status::check(unsafe { abi::proxy_set_shared_data(key.as_ptr(), key.len(), v.as_ptr(), v.len(), cas.unwrap_or(0)) })
}

/// Answers the current stream locally.
pub fn send_http_response(status_code: u32, headers: Vec<(&str, &str)>, body: Option<&[u8]>) -> Result<(), Status> {
    let map = serialize_map(&headers);
    let body = body.unwrap_or_default();
    // SAFETY: body and map are live buffers read during the call; no details string.
    Status::check(unsafe {
        abi::proxy_send_local_response(
            status_code,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            map.as_ptr(),
            map.len(),
            -1,
        )
    })
}

/// Resets the current stream's request direction (the last resort when it cannot be answered).
pub fn close_request_stream() -> Result<(), Status> {
    // SAFETY: no pointers (0: the HTTP request stream).
    Status::check(unsafe { abi::proxy_close_stream(0) })
}

/// Resumes the current stream's request direction (held by an earlier `Pause`).
pub fn continue_request_stream() -> Result<(), Status> {
    // SAFETY: no pointers (0: the HTTP request stream).
    Status::check(unsafe { abi::proxy_continue_stream(0) })
}

/// Makes `context_id` the context later host calls act on (a stream's headers, local reply,
/// continue), e.g. from the root context's tick.
pub fn set_effective_context(context_id: u32) -> Result<(), Status> {
    // SAFETY: no pointers.
    Status::check(unsafe { abi::proxy_set_effective_context(context_id) })
}

/// An HTTP callout to `upstream` (a cluster); its token identifies the answer.
pub fn dispatch_http_call(
    upstream: &str,
    headers: Vec<(&str, &str)>,
    body: Option<&[u8]>,
    trailers: Vec<(&str, &str)>,
    timeout: Duration,
) -> Result<u32, Status> {
    let (h, t) = (serialize_map(&headers), serialize_map(&trailers));
    let body = body.unwrap_or_default();
    let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
    let mut token = 0u32;
    // SAFETY: every buffer is live and read during the call; the host writes the token to a live
    // local.
    Status::check(unsafe {
        abi::proxy_http_call(
            upstream.as_ptr(),
            upstream.len(),
            h.as_ptr(),
            h.len(),
            body.as_ptr(),
            body.len(),
            t.as_ptr(),
            t.len(),
            ms,
            &mut token,
        )
    })?;
    Ok(token)
}

/// Defines (or finds) a metric; its id.
pub fn define_metric(metric_type: MetricType, name: &str) -> Result<u32, Status> {
    let mut id = 0u32;
    // SAFETY: the name is a live `str` read during the call; the host writes the id to a live local.
    Status::check(unsafe { abi::proxy_define_metric(metric_type as u32, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

/// Adds `offset` to a metric.
pub fn increment_metric(metric_id: u32, offset: i64) -> Result<(), Status> {
    // SAFETY: no pointers.
    Status::check(unsafe { abi::proxy_increment_metric(metric_id, offset) })
}

// ---- the dispatcher and the exports ----

/// The root context factory (set once when the module initializes).
type NewRoot = fn(u32) -> Box<dyn RootContext>;

#[derive(Default)]
struct Dispatcher {
    new_root: Option<NewRoot>,
    roots: BTreeMap<u32, Box<dyn RootContext>>,
    http: BTreeMap<u32, Box<dyn HttpContext>>,
}

std::thread_local! {
    static DISPATCHER: RefCell<Dispatcher> = RefCell::new(Dispatcher::default());
}

/// Runs `f` on the dispatcher; `default` when it is unavailable (never, unless a callback
/// re-entered the module, which proxy-wasm hosts do not do).
fn with<R>(default: R, f: impl FnOnce(&mut Dispatcher) -> R) -> R {
    DISPATCHER.try_with(|d| d.try_borrow_mut().ok().map(|mut d| f(&mut d))).ok().flatten().unwrap_or(default)
}

/// Registers the root context factory (from `_initialize`).
pub fn set_root_context(new_root: NewRoot) {
    with((), |d| d.new_root = Some(new_root));
}

fn action(a: Action) -> u32 {
    a as u32
}

/// The exported callbacks. Unknown context ids (never created, already deleted, or created for a
/// root this module does not know) are answered with the neutral value: Continue, true, nothing.
mod exports {
    use super::{action, with, Action, ContextType};

    extern "C" {
        /// wasm-ld's static constructors of the module (wasi-libc's among them).
        fn __wasm_call_ctors();
    }

    /// The module's initialization (a WASI reactor): static constructors, a panic hook that logs
    /// the message (a bug would still trap, but with a reason in Envoy's log), the factory.
    #[no_mangle]
    pub extern "C" fn _initialize() {
        // SAFETY: wasm-ld defines it; it runs the constructors once, before any other export.
        unsafe { __wasm_call_ctors() };
        std::panic::set_hook(Box::new(|info| {
            let _ = super::log(super::LogLevel::Critical, &info.to_string());
        }));
        crate::init();
    }

    #[no_mangle]
    pub extern "C" fn proxy_abi_version_0_2_1() {}

    /// Memory for the values the host returns (taken back by `super::take`).
    #[no_mangle]
    pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
        if size == 0 {
            return std::ptr::NonNull::<u8>::dangling().as_ptr();
        }
        match std::alloc::Layout::array::<u8>(size) {
            // SAFETY: a non-zero size; a null answer (out of memory) goes to the host, which
            // fails the hostcall instead of writing.
            Ok(layout) => unsafe { std::alloc::alloc(layout) },
            Err(_) => std::ptr::null_mut(),
        }
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_context_create(context_id: u32, root_context_id: u32) {
        with((), |d| {
            if root_context_id == 0 {
                if let Some(new_root) = d.new_root {
                    d.roots.insert(context_id, new_root(context_id));
                }
                return;
            }
            let ctx = d
                .roots
                .get(&root_context_id)
                .filter(|r| r.get_type() == Some(ContextType::HttpContext))
                .and_then(|r| r.create_http_context(context_id));
            if let Some(ctx) = ctx {
                d.http.insert(context_id, ctx);
            }
        });
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_vm_start(context_id: u32, vm_configuration_size: usize) -> bool {
        with(false, |d| d.roots.get_mut(&context_id).is_some_and(|r| r.on_vm_start(vm_configuration_size)))
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_configure(context_id: u32, plugin_configuration_size: usize) -> bool {
        with(false, |d| d.roots.get_mut(&context_id).is_some_and(|r| r.on_configure(plugin_configuration_size)))
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_tick(context_id: u32) {
        with((), |d| {
            if let Some(r) = d.roots.get_mut(&context_id) {
                r.on_tick();
            }
        });
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_http_call_response(
        context_id: u32,
        token: u32,
        num_headers: usize,
        body_size: usize,
        num_trailers: usize,
    ) {
        with((), |d| {
            if let Some(r) = d.roots.get_mut(&context_id) {
                r.on_http_call_response(token, num_headers, body_size, num_trailers);
            } else if let Some(h) = d.http.get_mut(&context_id) {
                h.on_http_call_response(token, num_headers, body_size, num_trailers);
            }
        });
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_request_headers(context_id: u32, num_headers: usize, end_of_stream: u32) -> u32 {
        action(with(Action::Continue, |d| {
            d.http
                .get_mut(&context_id)
                .map_or(Action::Continue, |h| h.on_http_request_headers(num_headers, end_of_stream != 0))
        }))
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_request_body(context_id: u32, body_size: usize, end_of_stream: u32) -> u32 {
        action(with(Action::Continue, |d| {
            d.http
                .get_mut(&context_id)
                .map_or(Action::Continue, |h| h.on_http_request_body(body_size, end_of_stream != 0))
        }))
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_request_trailers(context_id: u32, num_trailers: usize) -> u32 {
        action(with(Action::Continue, |d| {
            d.http.get_mut(&context_id).map_or(Action::Continue, |h| h.on_http_request_trailers(num_trailers))
        }))
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_done(context_id: u32) -> bool {
        with(true, |d| {
            if let Some(h) = d.http.get_mut(&context_id) {
                h.on_done()
            } else if let Some(r) = d.roots.get_mut(&context_id) {
                r.on_done()
            } else {
                true
            }
        })
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_log(context_id: u32) {
        with((), |d| {
            if let Some(h) = d.http.get_mut(&context_id) {
                h.on_log();
            }
        });
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_delete(context_id: u32) {
        // Dropped outside the dispatcher's borrow: a context's drop runs no callbacks, but keep
        // the borrow as short as possible anyway.
        let gone = with((None, None), |d| (d.http.remove(&context_id), d.roots.remove(&context_id)));
        drop(gone);
    }
}
