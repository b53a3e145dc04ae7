//! # libkvroute
//!
//! The C library of kvroute: a stable C ABI over the core crate `kvroute`, built as
//! `libkvroute.so` and `libkvroute.a`, with the header `ffi/include/kvroute.h` generated from
//! these sources by cbindgen (committed; `cargo test -p kvroute-ffi-header`, in `ffi/header`,
//! fails when it drifts).
//!
//! Every exported function is an adapter: check and convert the C arguments, make one core call,
//! convert the result. No scoring, threshold or mode logic lives here.
//!
//! The conventions of the whole API (the header's preamble says the same to C readers):
//!
//! - **Names**: opaque types `kvroute_<type>` (`kvroute_router`, `kvroute_decision`,
//!   `kvroute_subscription`) and functions `kvroute_<type>_<verb>`; `_new`/`_start` create,
//!   `_free` destroys (NULL is a no-op).
//! - **Results**: fallible functions return `kvroute_result`, an `int32_t` with stable codes
//!   (`KVROUTE_RESULT_OK` = 0). Out-parameters are written only on success.
//! - **Errors**: a failing call records its message (prefixed with the function name) and the
//!   field or header it names in a per-thread slot; `kvroute_last_error_message`,
//!   `kvroute_last_error_field` and `kvroute_last_error_header` copy them out.
//! - **Strings in**: identifiers (endpoint ids, request ids, paths, ZMQ endpoints) are
//!   NUL-terminated; documents, bodies, headers and payloads are pointer + length. All text is
//!   UTF-8 (`KVROUTE_RESULT_INVALID_UTF8` otherwise). Nothing passed in is kept after the call.
//! - **Strings out**: copied into caller buffers `(char *buf, size_t buf_len, size_t *needed)`;
//!   no function returns memory the caller must free other than the handles above. Static
//!   names (`kvroute_rule_name`, `kvroute_version`) are returned as `const char *` that live
//!   forever.
//! - **Panics**: every exported function runs behind `catch_unwind`; a panic (a kvroute bug)
//!   becomes `KVROUTE_RESULT_PANIC` and never unwinds into C.
//! - **Threads**: a router may be used from any number of threads at once; a decision is
//!   immutable; `_free` must not race with other calls on the same handle.
//! - **Time**: every `now_ms` is an explicit argument, in milliseconds on the caller's clock;
//!   `kvroute_now_ms()` is UNIX time in ms, the clock subscriptions use.

// The C ABI is made of `#[no_mangle] extern "C"` functions taking raw pointers, which the
// workspace-wide `unsafe_code = "deny"` forbids. This crate allows it: each `unsafe` block is
// small and carries a `// SAFETY:` comment, and every pointer-taking function is an `unsafe fn`
// whose `# Safety` section (copied into the header) states the caller's contract.
#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
// The exported types carry their C names (`kvroute_router`, `kvroute_result`), which cbindgen
// copies into the header as they are.
#![allow(non_camel_case_types)]

// The header lists items in this order (cbindgen follows the modules from here).
mod error;

mod types;

mod router;

mod flow;

mod decision;

mod subscription;

mod replication;

mod ptr;

pub use decision::*;
pub use error::{
    kvroute_last_error_code, kvroute_last_error_field, kvroute_last_error_header, kvroute_last_error_message,
    kvroute_result, kvroute_result_name, KVROUTE_RESULT_ABSENT, KVROUTE_RESULT_BUFFER_TOO_SMALL,
    KVROUTE_RESULT_CONFIG_ERROR, KVROUTE_RESULT_EFFECT_DECODE_ERROR, KVROUTE_RESULT_EVENT_DECODE_ERROR,
    KVROUTE_RESULT_INTERNAL, KVROUTE_RESULT_INVALID_ARGUMENT, KVROUTE_RESULT_INVALID_ENDPOINT_ID,
    KVROUTE_RESULT_INVALID_METRICS, KVROUTE_RESULT_INVALID_UTF8, KVROUTE_RESULT_METRICS_PARSE_ERROR,
    KVROUTE_RESULT_NO_ENDPOINTS, KVROUTE_RESULT_NULL_ARGUMENT, KVROUTE_RESULT_OK, KVROUTE_RESULT_OUT_OF_RANGE,
    KVROUTE_RESULT_PANIC, KVROUTE_RESULT_REPLICATION_ERROR, KVROUTE_RESULT_REQUEST_ERROR, KVROUTE_RESULT_STATE_ERROR,
    KVROUTE_RESULT_SUBSCRIBE_ERROR, KVROUTE_RESULT_TOKENIZER_ERROR, KVROUTE_RESULT_TOO_MANY_ENDPOINTS,
    KVROUTE_RESULT_UNKNOWN_ENDPOINT, KVROUTE_RESULT_UNKNOWN_REQUEST, KVROUTE_RESULT_UNSUPPORTED,
};
pub use flow::*;
pub use replication::*;
pub use router::*;
pub use subscription::*;
pub use types::*;

use std::ffi::c_char;

/// The library version (`"0.1.0"`), a static NUL-terminated string: never free it.
/// Thread safety: any thread.
///
/// Ownership: the returned string is static: never free it.
/// NULL: takes no pointer.
#[no_mangle]
pub extern "C" fn kvroute_version() -> *const c_char {
    error::guard_value("kvroute_version", std::ptr::null(), || concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast())
}

/// Milliseconds since the UNIX epoch: the clock subscriptions stamp events with, and a good
/// `now_ms` for every other call. Thread safety: any thread.
///
/// Ownership: returns a plain value; nothing to free.
/// NULL: takes no pointer.
#[no_mangle]
pub extern "C" fn kvroute_now_ms() -> u64 {
    error::guard_value("kvroute_now_ms", 0, now_ms)
}

fn now_ms() -> u64 {
    kvroute::unix_time_ms()
}

#[cfg(test)]
mod tests {
    #[test]
    fn version_and_clock() {
        // SAFETY: a static NUL-terminated string.
        let v = unsafe { std::ffi::CStr::from_ptr(super::kvroute_version()) };
        assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
        assert!(super::kvroute_now_ms() > 1_600_000_000_000);
    }
}
