//! `kvroute_subscription`: the core's ZMQ KV-event subscriber (feature `zmq`), a native
//! background thread feeding one router endpoint. Without the feature every function returns
//! `KVROUTE_RESULT_UNSUPPORTED`.

use std::ffi::c_char;

use crate::error::{guard, guard_value, kvroute_result, Result};
use crate::ptr;
use crate::router::kvroute_router;
use crate::types::kvroute_socket_mode;

/// A running (or stopped) KV-event subscription: one native thread receiving an engine's ZMQ
/// event stream and applying it to the router, with gap replay and resync.
///
/// Start it with `kvroute_subscription_start`, free it with `kvroute_subscription_free` (which
/// stops it). Every other function may be called from any thread, concurrently.
pub struct kvroute_subscription {
    inner: imp::Handle,
}

/// How to reach one publisher (`kvroute_subscription_start`). Zero-initialize it and set
/// `endpoint`: 0 and NULL mean the defaults.
#[repr(C)]
pub struct kvroute_subscriber_config {
    /// ZMQ endpoint of the live stream, NUL-terminated: `tcp://10.0.0.7:5557` (connect) or
    /// `tcp://*:5557` (bind). Must not be NULL.
    pub endpoint: *const c_char,
    /// Bind or connect (`KVROUTE_SOCKET_MODE_*`, default AUTO).
    pub mode: kvroute_socket_mode,
    /// Topic prefix filter, NUL-terminated; NULL or `""` takes every topic.
    pub topic: *const c_char,
    /// The publisher's replay endpoint, NUL-terminated; NULL for none (every gap then
    /// resynchronizes the stream).
    pub replay_endpoint: *const c_char,
    /// How long one replay may take, ms (0: the default, 1000).
    pub replay_timeout_ms: u64,
    /// Poll timeout of the worker, which bounds how long a stop takes, ms (0: the default,
    /// 100).
    pub poll_interval_ms: u64,
}

/// Counters of one subscription.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct kvroute_subscriber_stats {
    /// Multipart messages received on the live stream.
    pub messages: u64,
    /// Well-formed batches received on the live stream.
    pub batches: u64,
    /// Batches the router applied (live, replayed or resubmitted).
    pub applied: u64,
    /// Batches ignored as already seen.
    pub duplicates: u64,
    /// Publisher restarts.
    pub resets: u64,
    /// Gaps detected.
    pub gaps: u64,
    /// Replays requested.
    pub replays: u64,
    /// Replayed batches applied.
    pub replayed_batches: u64,
    /// Replays that did not recover their gap.
    pub replay_failures: u64,
    /// Streams resynchronized.
    pub resyncs: u64,
    /// Payloads that did not decode.
    pub decode_errors: u64,
    /// Messages skipped for their shape.
    pub malformed: u64,
    /// Batches or resyncs the router refused (e.g. unknown endpoint).
    pub router_errors: u64,
}

#[cfg(feature = "zmq")]
mod imp {
    use std::sync::{Mutex, PoisonError};

    use kvroute::{SocketMode, SubscriberConfig, SubscriberStats, Subscription};

    use super::{kvroute_subscriber_config, kvroute_subscriber_stats};
    use crate::error::{Error, Result, KVROUTE_RESULT_INVALID_ARGUMENT};
    use crate::ptr;
    use crate::router::kvroute_router;
    use crate::types::{KVROUTE_SOCKET_MODE_AUTO, KVROUTE_SOCKET_MODE_BIND, KVROUTE_SOCKET_MODE_CONNECT};

    pub(super) struct Handle {
        running: Mutex<Option<Subscription>>,
        /// Counters when it was stopped.
        last: Mutex<SubscriberStats>,
        endpoint_id: String,
        local_endpoint: String,
    }

    fn stats_out(s: SubscriberStats) -> kvroute_subscriber_stats {
        kvroute_subscriber_stats {
            messages: s.messages,
            batches: s.batches,
            applied: s.applied,
            duplicates: s.duplicates,
            resets: s.resets,
            gaps: s.gaps,
            replays: s.replays,
            replayed_batches: s.replayed_batches,
            replay_failures: s.replay_failures,
            resyncs: s.resyncs,
            decode_errors: s.decode_errors,
            malformed: s.malformed,
            router_errors: s.router_errors,
        }
    }

    /// Start a subscription.
    ///
    /// # Safety
    ///
    /// The strings in `cfg` are NULL or NUL-terminated.
    pub(super) unsafe fn start(
        router: &kvroute_router,
        endpoint_id: &str,
        cfg: &kvroute_subscriber_config,
    ) -> Result<Handle> {
        // SAFETY: the caller's contract (`kvroute_subscription_start`) for the config strings.
        let endpoint = unsafe { ptr::cstr(cfg.endpoint, "config->endpoint") }?;
        // SAFETY: as above.
        let topic = unsafe { ptr::opt_cstr(cfg.topic, "config->topic") }?;
        // SAFETY: as above.
        let replay = unsafe { ptr::opt_cstr(cfg.replay_endpoint, "config->replay_endpoint") }?;
        let mut c = SubscriberConfig::new(endpoint);
        c.mode = match cfg.mode {
            KVROUTE_SOCKET_MODE_AUTO => SocketMode::Auto,
            KVROUTE_SOCKET_MODE_BIND => SocketMode::Bind,
            KVROUTE_SOCKET_MODE_CONNECT => SocketMode::Connect,
            other => {
                return Err(Error::new(
                    KVROUTE_RESULT_INVALID_ARGUMENT,
                    format!("config->mode {other} is none of KVROUTE_SOCKET_MODE_AUTO, _BIND, _CONNECT"),
                ))
            }
        };
        c.topic = topic.unwrap_or_default().to_owned();
        c.replay_endpoint = replay.map(str::to_owned);
        if cfg.replay_timeout_ms != 0 {
            c.replay_timeout_ms = cfg.replay_timeout_ms;
        }
        if cfg.poll_interval_ms != 0 {
            c.poll_interval_ms = cfg.poll_interval_ms;
        }
        let s = Subscription::start(router.inner.clone(), endpoint_id, c, kvroute::unix_clock())?;
        Ok(Handle {
            endpoint_id: s.endpoint_id().to_owned(),
            local_endpoint: s.local_endpoint().to_owned(),
            running: Mutex::new(Some(s)),
            last: Mutex::new(SubscriberStats::default()),
        })
    }

    impl Handle {
        pub(super) fn stats(&self) -> kvroute_subscriber_stats {
            stats_out(match &*self.running.lock().unwrap_or_else(PoisonError::into_inner) {
                Some(s) => s.stats(),
                None => *self.last.lock().unwrap_or_else(PoisonError::into_inner),
            })
        }

        pub(super) fn is_running(&self) -> bool {
            self.running.lock().unwrap_or_else(PoisonError::into_inner).as_ref().is_some_and(Subscription::is_running)
        }

        pub(super) fn stop(&self) -> Result<kvroute_subscriber_stats> {
            let taken = self.running.lock().unwrap_or_else(PoisonError::into_inner).take();
            let stats = match taken {
                Some(s) => s.stop()?,
                None => *self.last.lock().unwrap_or_else(PoisonError::into_inner),
            };
            *self.last.lock().unwrap_or_else(PoisonError::into_inner) = stats;
            Ok(stats_out(stats))
        }

        pub(super) fn endpoint_id(&self) -> &str {
            &self.endpoint_id
        }

        pub(super) fn local_endpoint(&self) -> &str {
            &self.local_endpoint
        }
    }
}

#[cfg(not(feature = "zmq"))]
mod imp {
    use super::{kvroute_subscriber_config, kvroute_subscriber_stats};
    use crate::error::{Error, Result};
    use crate::router::kvroute_router;

    /// Never constructed without the `zmq` feature.
    pub(super) enum Handle {}

    /// Start a subscription: unsupported.
    ///
    /// # Safety
    ///
    /// None needed (the signature matches the `zmq` build).
    pub(super) unsafe fn start(_: &kvroute_router, _: &str, _: &kvroute_subscriber_config) -> Result<Handle> {
        Err(Error::unsupported("zmq"))
    }

    impl Handle {
        pub(super) fn stats(&self) -> kvroute_subscriber_stats {
            match *self {}
        }

        pub(super) fn is_running(&self) -> bool {
            match *self {}
        }

        pub(super) fn stop(&self) -> Result<kvroute_subscriber_stats> {
            match *self {}
        }

        pub(super) fn endpoint_id(&self) -> &str {
            match *self {}
        }

        pub(super) fn local_endpoint(&self) -> &str {
            match *self {}
        }
    }
}

/// The subscription behind a handle.
///
/// # Safety
///
/// `s` is NULL or a live subscription.
unsafe fn handle<'a>(s: *const kvroute_subscription) -> Result<&'a imp::Handle> {
    // SAFETY: forwarded contract.
    unsafe { ptr::obj(s, "subscription") }.map(|s| &s.inner)
}

/// Subscribe router endpoint `endpoint` (an `ip:port`, NUL-terminated; batches for an endpoint
/// the router does not know are counted in `router_errors`) to its engine's KV-event stream as
/// `config` describes, on a native background thread, and store the subscription in `*out`.
/// `now` for the events is `kvroute_now_ms()` (UNIX milliseconds): route with that clock too.
///
/// Returns once the socket is bound or connected. Errors: `KVROUTE_RESULT_SUBSCRIBE_ERROR`
/// (invalid config, with the field in `kvroute_last_error_field`; socket errors),
/// `KVROUTE_RESULT_INVALID_ENDPOINT_ID`, `KVROUTE_RESULT_INVALID_ARGUMENT` (mode),
/// `KVROUTE_RESULT_UNSUPPORTED` (built without `zmq`).
///
/// Ownership: nothing is kept from `config`. `*out` (written only on success) is owned by the
/// caller: free it with `kvroute_subscription_free`. The subscription keeps the router's state
/// alive: the router handle may be freed first. NULL: `router`, `endpoint`, `config`,
/// `config->endpoint` and `out` must not be NULL. Thread safety: any thread.
///
/// # Safety
///
/// `router` is NULL or a live router; `endpoint` is NULL or NUL-terminated; `config` is NULL or
/// valid for one read, its strings NULL or NUL-terminated; `out` is NULL or valid for one
/// write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_subscription_start(
    router: *const kvroute_router,
    endpoint: *const c_char,
    config: *const kvroute_subscriber_config,
    out: *mut *mut kvroute_subscription,
) -> kvroute_result {
    guard("kvroute_subscription_start", || {
        let out = ptr::out(out, "out")?;
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { ptr::obj(router, "router") }?;
        // SAFETY: the caller's contract for `endpoint`.
        let id = unsafe { ptr::cstr(endpoint, "endpoint") }?;
        // SAFETY: the caller's contract for `config`.
        let cfg = unsafe { ptr::obj(config, "config") }?;
        // SAFETY: the caller's contract for the strings in `config`.
        let h = unsafe { imp::start(r, id, cfg) }?;
        let handle = Box::new(kvroute_subscription { inner: h });
        // SAFETY: `out` is non-NULL and valid by the caller's contract.
        unsafe { ptr::write(out, Box::into_raw(handle)) };
        Ok(())
    })
}

/// Store the subscription's counters in `*out` (written only on success; after a stop, the
/// final counters). NULL: `subscription` and `out` must not be NULL. Thread safety: any thread.
///
/// Ownership: `subscription` stays the caller's; nothing to free.
///
/// # Safety
///
/// `subscription` is NULL or a live subscription; `out` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_subscription_stats(
    subscription: *const kvroute_subscription,
    out: *mut kvroute_subscriber_stats,
) -> kvroute_result {
    guard("kvroute_subscription_stats", || {
        let out = ptr::out(out, "out")?;
        // SAFETY: the caller's contract for `subscription`.
        let s = unsafe { handle(subscription) }?.stats();
        // SAFETY: `out` is non-NULL and valid by the caller's contract.
        unsafe { ptr::write(out, s) };
        Ok(())
    })
}

/// Whether the worker thread is running (false after a stop, or if it died); false for NULL.
/// Thread safety: any thread.
///
/// Ownership: `subscription` stays the caller's; nothing to free.
///
/// # Safety
///
/// `subscription` is NULL or a live subscription.
#[no_mangle]
pub unsafe extern "C" fn kvroute_subscription_is_running(subscription: *const kvroute_subscription) -> bool {
    guard_value("kvroute_subscription_is_running", false, || {
        // SAFETY: the caller's contract for `subscription`.
        unsafe { handle(subscription) }.is_ok_and(imp::Handle::is_running)
    })
}

/// Stop the worker (within about one poll interval; a replay in progress is abandoned), wait
/// for it, and store the final counters in `*out` (optional, may be NULL; written only on
/// success). Stopping again returns the same counters. The handle must still be freed.
///
/// Errors: `KVROUTE_RESULT_SUBSCRIBE_ERROR` (the worker had panicked). NULL: `subscription` must
/// not be NULL. Thread safety: any thread.
///
/// Ownership: `subscription` stays the caller's; nothing to free.
///
/// # Safety
///
/// `subscription` is NULL or a live subscription; `out` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_subscription_stop(
    subscription: *const kvroute_subscription,
    out: *mut kvroute_subscriber_stats,
) -> kvroute_result {
    guard("kvroute_subscription_stop", || {
        // SAFETY: the caller's contract for `subscription`.
        let s = unsafe { handle(subscription) }?.stop()?;
        // SAFETY: `out` is NULL or valid by the caller's contract.
        unsafe { ptr::write(out, s) };
        Ok(())
    })
}

/// Copy the router endpoint this subscription feeds. Strings out as in
/// `kvroute_decision_request_id` (the text never changes). Thread safety: any thread.
///
/// Ownership: `subscription` stays the caller's; nothing to free.
///
/// # Safety
///
/// `subscription` is NULL or a live subscription; `buf` is NULL or valid for `buf_len` bytes;
/// `needed` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_subscription_endpoint(
    subscription: *const kvroute_subscription,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    guard("kvroute_subscription_endpoint", || {
        // SAFETY: the caller's contract for `subscription`.
        let h = unsafe { handle(subscription) }?;
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_str(h.endpoint_id().as_bytes(), buf, buf_len, needed) }
    })
}

/// Copy the ZMQ endpoint the socket is bound or connected to, as ZMQ reports it (for a bind to
/// port `*`, this names the port chosen). Strings out as in `kvroute_decision_request_id`.
/// Thread safety: any thread.
///
/// Ownership: `subscription` stays the caller's; nothing to free.
///
/// # Safety
///
/// `subscription` is NULL or a live subscription; `buf` is NULL or valid for `buf_len` bytes;
/// `needed` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_subscription_local_endpoint(
    subscription: *const kvroute_subscription,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    guard("kvroute_subscription_local_endpoint", || {
        // SAFETY: the caller's contract for `subscription`.
        let h = unsafe { handle(subscription) }?;
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_str(h.local_endpoint().as_bytes(), buf, buf_len, needed) }
    })
}

/// Stop (if running) and free a subscription. NULL is a no-op.
///
/// Ownership: takes back a handle from `kvroute_subscription_start`. Thread safety: no other
/// call may use this handle during or after this call; it blocks for up to one poll interval.
///
/// # Safety
///
/// `subscription` is NULL or a live subscription, freed only once.
#[no_mangle]
pub unsafe extern "C" fn kvroute_subscription_free(subscription: *mut kvroute_subscription) {
    guard_value("kvroute_subscription_free", (), || {
        if !subscription.is_null() {
            // SAFETY: a live handle from `Box::into_raw` in `kvroute_subscription_start`, freed
            // once. Dropping it stops and joins the worker (the core's `Drop`).
            drop(unsafe { Box::from_raw(subscription) });
        }
    });
}
