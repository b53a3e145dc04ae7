//! `kvroute_replication`: the core's NATS replica transport (feature `nats`), a native
//! background thread publishing one router's replica batches and applying the other replicas'.
//! Without the feature every function returns `KVROUTE_RESULT_UNSUPPORTED`.

use std::ffi::c_char;

use crate::error::{guard, guard_value, kvroute_result, Result};
use crate::ptr;
use crate::router::kvroute_router;

/// A running (or stopped) router replica: one native thread connected to a NATS server that
/// publishes this router's routing effects and completions and applies those of the other
/// replicas of the fleet.
///
/// Start it with `kvroute_router_replicate`, free it with `kvroute_replication_free` (which
/// stops it). Every other function may be called from any thread, concurrently.
pub struct kvroute_replication {
    inner: imp::Handle,
}

#[cfg(feature = "nats")]
mod imp {
    use std::sync::{Mutex, PoisonError};

    use kvroute::{NatsReplicaOptions, Replicator, ReplicatorStats};

    use crate::error::Result;
    use crate::router::kvroute_router;

    pub(super) struct Handle {
        running: Mutex<Option<Replicator>>,
        /// Counters when it was stopped.
        last: Mutex<Option<ReplicatorStats>>,
    }

    pub(super) fn start(router: &kvroute_router, options: &str) -> Result<Handle> {
        let opts = NatsReplicaOptions::from_json(options)?;
        let r = Replicator::start(router.inner.clone(), opts)?;
        Ok(Handle { running: Mutex::new(Some(r)), last: Mutex::new(None) })
    }

    impl Handle {
        pub(super) fn stats(&self) -> ReplicatorStats {
            match &*self.running.lock().unwrap_or_else(PoisonError::into_inner) {
                Some(r) => r.stats(),
                None => self.last.lock().unwrap_or_else(PoisonError::into_inner).clone().unwrap_or_default(),
            }
        }

        pub(super) fn is_running(&self) -> bool {
            self.running.lock().unwrap_or_else(PoisonError::into_inner).is_some()
        }

        pub(super) fn flush(&self) {
            if let Some(r) = &*self.running.lock().unwrap_or_else(PoisonError::into_inner) {
                r.flush();
            }
        }

        pub(super) fn stop(&self) {
            // Taken out of the lock first: the join (up to about a second) holds no lock.
            let taken = self.running.lock().unwrap_or_else(PoisonError::into_inner).take();
            if let Some(r) = taken {
                let s = r.stop();
                *self.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(s);
            }
        }
    }
}

#[cfg(not(feature = "nats"))]
mod imp {
    use crate::error::{Error, Result};
    use crate::router::kvroute_router;

    /// The counters' shape without the feature (never produced).
    #[derive(serde::Serialize)]
    pub(super) struct Stats {}

    /// Never constructed without the `nats` feature.
    pub(super) enum Handle {}

    pub(super) fn start(_: &kvroute_router, _: &str) -> Result<Handle> {
        Err(Error::unsupported("nats"))
    }

    impl Handle {
        pub(super) fn stats(&self) -> Stats {
            match *self {}
        }

        pub(super) fn is_running(&self) -> bool {
            match *self {}
        }

        pub(super) fn flush(&self) {
            match *self {}
        }

        pub(super) fn stop(&self) {
            match *self {}
        }
    }
}

/// The replication behind a handle.
///
/// # Safety
///
/// `r` is NULL or a live replication.
unsafe fn handle<'a>(r: *const kvroute_replication) -> Result<&'a imp::Handle> {
    // SAFETY: forwarded contract.
    unsafe { ptr::obj(r, "replication") }.map(|r| &r.inner)
}

/// Make `router` a replica of its fleet over NATS and store the running replication in `*out`.
///
/// `options` (`options_len` bytes of UTF-8 JSON, not NUL-terminated) is the core's
/// `NatsReplicaOptions` document; unknown fields are errors and every field has a default but
/// `replica_id` (`[A-Za-z0-9_-]`, unique in the fleet):
/// `{"url": "nats://127.0.0.1:4222", "fleet": "prod", "replica_id": "gw-1", "token": "..."}`.
/// Other fields: `epoch`, `allowed_replicas`, `user`, `password`, `nkey_seed`, `tls_required`,
/// `tls_ca_file`, `tls_cert_file`, `tls_key_file`, `stream` (`{"name", "max_age_s",
/// "max_bytes", "replay", "file_storage"}` or `null` for core NATS only), `flush_interval_ms`,
/// `heartbeat_interval_ms`, `peer_silence_ms`, `max_outbox_entries`, `max_batch_entries`,
/// `max_batch_bytes`, `connect_timeout_ms`, `max_reconnect_delay_ms`.
///
/// Returns at once: an unreachable server or refused credentials are no error (the thread
/// keeps trying; see `connected`, `server_errors` and `last_error` in
/// `kvroute_replication_stats_json`). Routing never waits on the bus. The effects and
/// completions of this router are published from now on; the `now_ms` of the replicated
/// requests is `kvroute_now_ms()`, so route with that clock.
///
/// Errors: `KVROUTE_RESULT_CONFIG_ERROR` (malformed JSON, a wrong type, an unknown field, an
/// invalid value; the setting is in `kvroute_last_error_field`), `KVROUTE_RESULT_INVALID_UTF8`,
/// `KVROUTE_RESULT_STATE_ERROR` (the router already replicates: stop that replication first),
/// `KVROUTE_RESULT_REPLICATION_ERROR` (the transport could not start), `KVROUTE_RESULT_UNSUPPORTED`
/// (built without `nats`).
///
/// Ownership: nothing is kept from `options`. `*out` (written only on success) is owned by the
/// caller: free it with `kvroute_replication_free`. The replication keeps the router's state
/// alive: the router handle may be freed first. One replication per router at a time.
/// NULL: `router` and `out` must not be NULL; `options` may be NULL only when `options_len` is 0
/// (which is no valid document). Thread safety: any thread.
///
/// # Safety
///
/// `router` is NULL or a live router; `options` is NULL or valid for `options_len` bytes; `out`
/// is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_replicate(
    router: *const kvroute_router,
    options: *const c_char,
    options_len: usize,
    out: *mut *mut kvroute_replication,
) -> kvroute_result {
    guard("kvroute_router_replicate", || {
        let out = ptr::out(out, "out")?;
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { ptr::obj(router, "router") }?;
        // SAFETY: the caller's contract for `options`.
        let text = unsafe { ptr::text(options, options_len, "options") }?;
        let h = imp::start(r, text)?;
        let handle = Box::new(kvroute_replication { inner: h });
        // SAFETY: `out` is non-NULL and valid by the caller's contract.
        unsafe { ptr::write(out, Box::into_raw(handle)) };
        Ok(())
    })
}

/// Copy the replication's counters as JSON: the transport's (`connected`, `connects`,
/// `disconnects`, `published`, `published_bytes`, `publish_errors`, `received`,
/// `received_bytes`, `inbound_ready`, `inbound_restarts`, `server_errors`, `last_error` (a
/// string or `null`)) and the router's under `replica` (`replica_id`, `epoch`,
/// `effects_applied`, `completions_applied`, `malformed`, `unknown_replica`, `duplicates`,
/// `gaps`, `peers`, ...). After a stop, the counters at the stop. Strings out as in
/// `kvroute_router_policy_json` (the text changes between calls: call again while the result is
/// `KVROUTE_RESULT_BUFFER_TOO_SMALL`). Thread safety: any thread.
///
/// Ownership: `replication` stays the caller's; nothing to free.
///
/// # Safety
///
/// `replication` is NULL or a live replication; `buf` is NULL or valid for `buf_len` bytes;
/// `needed` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_replication_stats_json(
    replication: *const kvroute_replication,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    guard("kvroute_replication_stats_json", || {
        // SAFETY: the caller's contract for `replication`.
        let h = unsafe { handle(replication) }?;
        let text = serde_json::to_string(&h.stats())
            .map_err(|e| crate::error::Error::new(crate::error::KVROUTE_RESULT_INTERNAL, e.to_string()))?;
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_str(text.as_bytes(), buf, buf_len, needed) }
    })
}

/// Whether the replication thread is running (false after `kvroute_replication_stop`); false
/// for NULL. Thread safety: any thread.
///
/// Ownership: `replication` stays the caller's; nothing to free.
///
/// # Safety
///
/// `replication` is NULL or a live replication.
#[no_mangle]
pub unsafe extern "C" fn kvroute_replication_is_running(replication: *const kvroute_replication) -> bool {
    guard_value("kvroute_replication_is_running", false, || {
        // SAFETY: the caller's contract for `replication`.
        unsafe { handle(replication) }.is_ok_and(imp::Handle::is_running)
    })
}

/// Publish what waits now instead of at the next flush tick (a wake-up: returns at once, the
/// publishing happens on the replication thread). A no-op after a stop. NULL: `replication`
/// must not be NULL. Thread safety: any thread.
///
/// Ownership: `replication` stays the caller's; nothing to free.
///
/// # Safety
///
/// `replication` is NULL or a live replication.
#[no_mangle]
pub unsafe extern "C" fn kvroute_replication_flush(replication: *const kvroute_replication) -> kvroute_result {
    guard("kvroute_replication_flush", || {
        // SAFETY: the caller's contract for `replication`.
        unsafe { handle(replication) }?.flush();
        Ok(())
    })
}

/// Publish what waits (bounded: about a second), stop the thread, wait for it and turn
/// replication off on the router (it keeps routing on its own state). Stopping again is a
/// no-op. The handle must still be freed. NULL: `replication` must not be NULL. Thread safety:
/// any thread.
///
/// Ownership: `replication` stays the caller's; nothing to free.
///
/// # Safety
///
/// `replication` is NULL or a live replication.
#[no_mangle]
pub unsafe extern "C" fn kvroute_replication_stop(replication: *const kvroute_replication) -> kvroute_result {
    guard("kvroute_replication_stop", || {
        // SAFETY: the caller's contract for `replication`.
        unsafe { handle(replication) }?.stop();
        Ok(())
    })
}

/// Stop (if running) and free a replication. NULL is a no-op.
///
/// Ownership: takes back a handle from `kvroute_router_replicate`. Thread safety: no other call
/// may use this handle during or after this call; it blocks for up to about a second.
///
/// # Safety
///
/// `replication` is NULL or a live replication, freed only once.
#[no_mangle]
pub unsafe extern "C" fn kvroute_replication_free(replication: *mut kvroute_replication) {
    guard_value("kvroute_replication_free", (), || {
        if !replication.is_null() {
            // SAFETY: a live handle from `Box::into_raw` in `kvroute_router_replicate`, freed
            // once. Stopping joins the thread; dropping the stopped handle frees the rest.
            let h = unsafe { Box::from_raw(replication) };
            h.inner.stop();
            drop(h);
        }
    });
}

/// Copy the router's replication counters as JSON (the `replica` object of
/// `kvroute_replication_stats_json`: `replica_id`, `epoch`, `batches_out`, `effects_applied`,
/// `completions_applied`, `malformed`, `duplicates`, `gaps`, `peers`, ...), or
/// `KVROUTE_RESULT_ABSENT` when replication is off (never started, or stopped). Available in
/// every build (the counters belong to the router, not to the transport). Strings out as in
/// `kvroute_router_policy_json`. Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing to free.
///
/// # Safety
///
/// `router` is NULL or a live router; `buf` is NULL or valid for `buf_len` bytes; `needed` is
/// NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_replica_stats_json(
    router: *const kvroute_router,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    guard("kvroute_router_replica_stats_json", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { ptr::obj(router, "router") }?;
        let Some(s) = r.inner.replica_stats() else { return Err(crate::error::Error::absent("replication")) };
        let text = serde_json::to_string(&s)
            .map_err(|e| crate::error::Error::new(crate::error::KVROUTE_RESULT_INTERNAL, e.to_string()))?;
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_str(text.as_bytes(), buf, buf_len, needed) }
    })
}
