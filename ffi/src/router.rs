//! `kvroute_router`: the core router behind an opaque handle.

use std::ffi::c_char;
use std::sync::{Arc, Mutex};

use kvroute::{EndpointSpec, MetricsSnapshot, Policy, Router};

use crate::decision::kvroute_decision;
use crate::error::{guard, guard_value, kvroute_result, Error, Result};
use crate::flow::Held;
use crate::ptr;
use crate::types::{kvroute_role, kvroute_verdict, role_in, verdict_out};

/// A KV-cache-aware router: policy, endpoint table, prefix indexes and in-flight tracking.
///
/// Create it with `kvroute_router_new`, free it with `kvroute_router_free`. Every other
/// function taking a `const kvroute_router *` may be called from any number of threads at
/// once (the core router is `Send + Sync`: an atomically swapped policy and one state mutex).
pub struct kvroute_router {
    pub(crate) inner: Arc<Router>,
    /// Flow-control releases taken from the core that did not fit the caller's buffer of
    /// `kvroute_router_take_releases`, oldest first: handed out first by the next call (see
    /// `flow.rs`). Locked before the core's state, never after it.
    pub(crate) held: Mutex<Held>,
}

impl kvroute_router {
    fn new(router: Router) -> Self {
        kvroute_router { inner: Arc::new(router), held: Mutex::new(Held::default()) }
    }
}

/// One request header (or any name/value pair): pointers and lengths, not NUL-terminated.
/// Both must be UTF-8. A pointer may be NULL when its length is 0.
#[repr(C)]
pub struct kvroute_header {
    /// Name bytes (any case).
    pub name: *const c_char,
    /// Name length in bytes.
    pub name_len: usize,
    /// Value bytes.
    pub value: *const c_char,
    /// Value length in bytes.
    pub value_len: usize,
}

/// A metrics snapshot of one endpoint, for `kvroute_router_update_metrics`. Zero-initialize it
/// (`kvroute_metrics m = {0};`) and set what you know.
#[repr(C)]
pub struct kvroute_metrics {
    /// Requests waiting in the engine queue.
    pub waiting: u32,
    /// Requests running.
    pub running: u32,
    /// KV-cache usage, 0 to 1.
    pub kv_usage: f64,
    /// LoRA adapters loaded and running: `lora_running_len` NUL-terminated UTF-8 names (NULL
    /// when the length is 0).
    pub lora_running: *const *const c_char,
    /// Number of names in `lora_running`.
    pub lora_running_len: usize,
    /// LoRA adapters waiting to be loaded (as `lora_running`).
    pub lora_waiting: *const *const c_char,
    /// Number of names in `lora_waiting`.
    pub lora_waiting_len: usize,
    /// Whether `max_lora` is known.
    pub has_max_lora: bool,
    /// Maximum adapters the endpoint can hold at once.
    pub max_lora: u32,
    /// Whether `kv_capacity_tokens` is known.
    pub has_kv_capacity_tokens: bool,
    /// KV-cache capacity in tokens.
    pub kv_capacity_tokens: u64,
    /// When the snapshot was taken, milliseconds on the router's clock (the `now_ms` of routing).
    pub updated_ms: u64,
}

/// The numbers of a metrics snapshot read from a Prometheus page (the adapter names are in
/// `kvroute_router_endpoints_json`).
#[repr(C)]
pub struct kvroute_metrics_snapshot {
    /// Requests waiting.
    pub waiting: u32,
    /// Requests running.
    pub running: u32,
    /// KV-cache usage, 0 to 1.
    pub kv_usage: f64,
    /// Number of LoRA adapters running.
    pub lora_running_count: usize,
    /// Number of LoRA adapters waiting.
    pub lora_waiting_count: usize,
    /// Whether `max_lora` is known.
    pub has_max_lora: bool,
    /// Maximum adapters at once.
    pub max_lora: u32,
    /// Whether `kv_capacity_tokens` is known.
    pub has_kv_capacity_tokens: bool,
    /// KV-cache capacity in tokens.
    pub kv_capacity_tokens: u64,
    /// When the page was read (the `now_ms` given).
    pub updated_ms: u64,
}

/// What applying one KV-event batch did.
#[repr(C)]
pub struct kvroute_apply_outcome {
    /// The stream verdict (`KVROUTE_VERDICT_*`); APPLIED and RESET change the index, and a GAP
    /// with `expected` 0 is a restarted engine whose first batches were missed (the endpoint was
    /// cleared). On a GAP, replay from `expected - 1` (from 0 when `expected` is 0) or resync.
    pub verdict: kvroute_verdict,
    /// Events applied.
    pub events: u32,
    /// Blocks stored or removed.
    pub blocks: u64,
    /// First missing sequence number (GAP only, else 0).
    pub expected: u64,
    /// The sequence number received (GAP only, else 0).
    pub got: u64,
}

/// Sizes of one prefix index.
#[repr(C)]
pub struct kvroute_index_stats {
    /// Live (block, endpoint) memberships.
    pub memberships: u64,
    /// Distinct keys stored.
    pub keys: u64,
    /// Heap bytes held.
    pub memory_bytes: u64,
}

/// The precise (event-fed) index: sizes and event counters.
#[repr(C)]
pub struct kvroute_precise_stats {
    /// The block store.
    pub index: kvroute_index_stats,
    /// Engine blocks in the engine-key to request-key map.
    pub mapped_engine_blocks: u64,
    /// Heap bytes of that map.
    pub map_memory_bytes: u64,
    /// Batches applied.
    pub batches: u64,
    /// Blocks stored.
    pub blocks_stored: u64,
    /// Blocks removed.
    pub blocks_removed: u64,
    /// Stored blocks whose parent was unknown.
    pub orphan_blocks: u64,
    /// Stored events skipped as malformed.
    pub malformed_events: u64,
    /// Duplicate batches ignored.
    pub duplicates: u64,
    /// Gaps detected.
    pub gaps: u64,
    /// Publisher restarts detected.
    pub resets: u64,
    /// Streams resynchronized.
    pub resyncs: u64,
    /// Speculations not yet expired.
    pub speculative_requests: u64,
    /// Speculative memberships not yet expired.
    pub speculative_blocks: u64,
    /// Replays completed.
    pub replays: u64,
    /// Replays failed.
    pub replay_failures: u64,
}

/// The router's counters.
#[repr(C)]
pub struct kvroute_router_counters {
    /// Decisions per rule, indexed by `kvroute_rule` (index 0, `KVROUTE_RULE_NONE`, stays 0).
    pub decisions_by_rule: [u64; 8],
    /// Routed (not shed) decisions.
    pub routed: u64,
    /// Route calls that failed.
    pub route_errors: u64,
    /// Successful reloads.
    pub reloads: u64,
    /// Rejected reloads.
    pub reload_failures: u64,
    /// Index resets caused by a change of hashing parameters.
    pub index_resets: u64,
    /// Requests dropped from in-flight tracking without `kvroute_router_complete`.
    pub inflight_expired: u64,
    /// Requests the tokenizer failed on.
    pub tokenize_errors: u64,
    /// Routed decisions by prefix hit: counts with hit at most 0.1, 0.2, ... 1.0 (cumulative).
    pub prefix_hit_buckets: [u64; 10],
    /// Sum of the routed decisions' prefix hits.
    pub prefix_hit_sum: f64,
}

/// A snapshot of the router's state (`kvroute_router_stats`).
#[repr(C)]
pub struct kvroute_stats {
    /// Active policy version.
    pub policy_version: u64,
    /// Registered endpoints.
    pub endpoints: u64,
    /// Requests in flight.
    pub inflight_requests: u64,
    /// The approximate index.
    pub index: kvroute_index_stats,
    /// The precise index.
    pub precise: kvroute_precise_stats,
    /// Counters.
    pub counters: kvroute_router_counters,
}

fn index_stats(s: &kvroute::IndexStats) -> kvroute_index_stats {
    kvroute_index_stats { memberships: s.memberships, keys: s.keys, memory_bytes: s.memory_bytes }
}

fn router_stats(s: &kvroute::RouterStats) -> kvroute_stats {
    let p = &s.precise;
    let c = &s.counters;
    let mut by_rule = [0u64; 8];
    for (rule, n) in kvroute::Rule::ALL.iter().zip(c.decisions_by_rule) {
        if let Some(slot) = by_rule.get_mut(crate::types::rule_out(*rule) as usize) {
            *slot = n;
        }
    }
    kvroute_stats {
        policy_version: s.policy_version,
        endpoints: s.endpoints as u64,
        inflight_requests: s.inflight_requests as u64,
        index: index_stats(&s.index),
        precise: kvroute_precise_stats {
            index: index_stats(&p.index),
            mapped_engine_blocks: p.mapped_engine_blocks,
            map_memory_bytes: p.map_memory_bytes,
            batches: p.batches,
            blocks_stored: p.blocks_stored,
            blocks_removed: p.blocks_removed,
            orphan_blocks: p.orphan_blocks,
            malformed_events: p.malformed_events,
            duplicates: p.duplicates,
            gaps: p.gaps,
            resets: p.resets,
            resyncs: p.resyncs,
            speculative_requests: p.speculative_requests,
            speculative_blocks: p.speculative_blocks,
            replays: p.replays,
            replay_failures: p.replay_failures,
        },
        counters: kvroute_router_counters {
            decisions_by_rule: by_rule,
            routed: c.routed,
            route_errors: c.route_errors,
            reloads: c.reloads,
            reload_failures: c.reload_failures,
            index_resets: c.index_resets,
            inflight_expired: c.inflight_expired,
            tokenize_errors: c.tokenize_errors,
            prefix_hit_buckets: c.prefix_hit_buckets,
            prefix_hit_sum: c.prefix_hit_sum,
        },
    }
}

/// The router behind a handle.
///
/// # Safety
///
/// `router` is NULL or a live handle from `kvroute_router_new`.
unsafe fn router<'a>(router: *const kvroute_router) -> Result<&'a Router> {
    // SAFETY: forwarded contract.
    unsafe { ptr::obj(router, "router") }.map(|r| &*r.inner)
}

/// Check every header (UTF-8; pointers NULL only with length 0) without allocating, then give
/// the core an iterator over the (name, value) pairs.
///
/// # Safety
///
/// Every header's pointers are NULL or valid for their lengths, for `'a`.
pub(crate) unsafe fn header_pairs<'a>(
    headers: &'a [kvroute_header],
) -> Result<impl Iterator<Item = (&'a str, &'a str)> + 'a> {
    let pair = |h: &'a kvroute_header| -> Result<(&'a str, &'a str)> {
        // SAFETY: the caller's contract for each header's pointers.
        let name = unsafe { ptr::text(h.name, h.name_len, "header name") }?;
        // SAFETY: as above.
        let value = unsafe { ptr::text(h.value, h.value_len, "header value") }?;
        Ok((name, value))
    };
    for h in headers {
        pair(h)?;
    }
    Ok(headers.iter().filter_map(move |h| pair(h).ok()))
}

fn json<T: serde::Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| Error::new(crate::error::KVROUTE_RESULT_INTERNAL, e.to_string()))
}

/// Create a router and store it in `*out`.
///
/// `config` is a policy document, JSON or YAML (auto-detected: JSON when it starts with `{`),
/// `config_len` bytes of UTF-8, not necessarily NUL-terminated; `config == NULL` with
/// `config_len == 0` means the default policy. Fails with `KVROUTE_RESULT_CONFIG_ERROR` (the
/// field in `kvroute_last_error_field`) for an invalid document.
///
/// Ownership: `*out` (written only on success) is owned by the caller; free it with
/// `kvroute_router_free`. NULL: `out` must not be NULL (`KVROUTE_RESULT_NULL_ARGUMENT`).
/// Thread safety: any thread.
///
/// # Safety
///
/// `config` is NULL or valid for reads of `config_len` bytes; `out` is NULL or valid for one
/// write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_new(
    config: *const c_char,
    config_len: usize,
    out: *mut *mut kvroute_router,
) -> kvroute_result {
    guard("kvroute_router_new", || {
        let out = ptr::out(out, "out")?;
        // SAFETY: the caller's contract for `config`.
        let text = unsafe { ptr::text(config, config_len, "config") }?;
        let policy = if config.is_null() { Policy::default() } else { Policy::from_str_auto(text)? };
        let handle = Box::new(kvroute_router::new(Router::new(policy)));
        // SAFETY: `out` is non-NULL and valid for one write by the caller's contract.
        unsafe { ptr::write(out, Box::into_raw(handle)) };
        Ok(())
    })
}

/// Free a router. NULL is a no-op.
///
/// Ownership: takes back a handle from `kvroute_router_new`; running subscriptions keep the
/// router's state alive until they are freed, and decisions never refer to it. Thread safety:
/// no other call may use this handle during or after this call.
///
/// # Safety
///
/// `router` is NULL or a live handle from `kvroute_router_new`, freed only once.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_free(router: *mut kvroute_router) {
    guard_value("kvroute_router_free", (), || {
        if !router.is_null() {
            // SAFETY: a live handle from `Box::into_raw` in `kvroute_router_new`, freed once.
            drop(unsafe { Box::from_raw(router) });
        }
    });
}

/// Replace the policy atomically with a JSON or YAML document (as `kvroute_router_new`) and
/// store its version in `*version` (optional, may be NULL; written only on success).
///
/// On `KVROUTE_RESULT_CONFIG_ERROR` nothing changes: the old policy keeps serving. Endpoints,
/// metrics, in-flight requests and sessions survive every reload. NULL: `router` and (when
/// `config_len > 0`) `config` must not be NULL. Thread safety: any thread; concurrent routes
/// each see one whole policy.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `config` is NULL or valid for `config_len` bytes;
/// `version` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_reload(
    router: *const kvroute_router,
    config: *const c_char,
    config_len: usize,
    version: *mut u64,
) -> kvroute_result {
    guard("kvroute_router_reload", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `config`.
        let text = unsafe { ptr::text(config, config_len, "config") }?;
        let v = r.reload_str(text)?;
        // SAFETY: `version` is NULL or valid by the caller's contract.
        unsafe { ptr::write(version, v) };
        Ok(())
    })
}

/// The active policy's version (1 at creation, +1 per successful reload); 0 if `router` is NULL.
/// Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_policy_version(router: *const kvroute_router) -> u64 {
    guard_value("kvroute_router_policy_version", 0, || {
        // SAFETY: the caller's contract for `router`.
        unsafe { self::router(router) }.map_or(0, |r| r.policy().version)
    })
}

/// Copy the active policy, normalized (every field, defaults filled in), as pretty JSON.
///
/// Strings out: `buf` receives the text and a terminating NUL when `buf_len` is at least the
/// size needed; `*needed` (when `needed` is not NULL) receives that size, NUL included, on
/// `KVROUTE_RESULT_OK` and on `KVROUTE_RESULT_BUFFER_TOO_SMALL` (the buffer is then untouched).
/// `buf` may be NULL when `buf_len` is 0. The policy can change between a size query and the
/// copy (a reload): call again while the result is `KVROUTE_RESULT_BUFFER_TOO_SMALL`. Thread
/// safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `buf` is NULL or valid for `buf_len` bytes; `needed` is
/// NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_policy_json(
    router: *const kvroute_router,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    guard("kvroute_router_policy_json", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        let text = r.policy().policy.to_json_pretty();
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_str(text.as_bytes(), buf, buf_len, needed) }
    })
}

/// Copy the fail-open destination, `ip:port`: where to send a request the router could not
/// route (a request error, no decode-capable endpoint, the host's own failure), so traffic keeps
/// flowing. The least-loaded endpoint by router-tracked requests in flight (then reported queue),
/// preferring healthy decode-capable endpoints, then healthy ones, then any. Not a routing
/// decision: nothing is recorded and there is nothing to complete. `KVROUTE_RESULT_ABSENT` when
/// no endpoint is registered.
///
/// Strings out as in `kvroute_router_policy_json`. Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; the text is copied into the caller's `buf`, nothing
/// to free. NULL: `router` must not be NULL (`KVROUTE_RESULT_NULL_ARGUMENT`); `buf` may be NULL
/// only when `buf_len` is 0; `needed` may be NULL.
///
/// # Safety
///
/// `router` is NULL or a live router; `buf` is NULL or valid for `buf_len` bytes; `needed` is
/// NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_fail_open_endpoint(
    router: *const kvroute_router,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    guard("kvroute_router_fail_open_endpoint", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        let id = r.fail_open_endpoint().ok_or_else(|| Error::absent("a fail-open endpoint (none is registered)"))?;
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_str(id.as_bytes(), buf, buf_len, needed) }
    })
}

/// Register an endpoint (`ip:port`, IPv4 or bracketed IPv6, NUL-terminated) with a role
/// (`KVROUTE_ROLE_*`), or change the role of a registered one.
///
/// Errors: `KVROUTE_RESULT_INVALID_ENDPOINT_ID`, `KVROUTE_RESULT_TOO_MANY_ENDPOINTS`,
/// `KVROUTE_RESULT_INVALID_ARGUMENT` (unknown role). NULL: `router` and `endpoint` must not be
/// NULL. Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `endpoint` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_upsert_endpoint(
    router: *const kvroute_router,
    endpoint: *const c_char,
    role: kvroute_role,
) -> kvroute_result {
    guard("kvroute_router_upsert_endpoint", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `endpoint`.
        let id = unsafe { ptr::cstr(endpoint, "endpoint") }?;
        r.upsert_endpoint(EndpointSpec::new(id, role_in(role)?))?;
        Ok(())
    })
}

/// Remove an endpoint: its index entries and in-flight requests are forgotten.
///
/// Errors: `KVROUTE_RESULT_UNKNOWN_ENDPOINT`. NULL: `router` and `endpoint` must not be NULL.
/// Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `endpoint` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_remove_endpoint(
    router: *const kvroute_router,
    endpoint: *const c_char,
) -> kvroute_result {
    guard("kvroute_router_remove_endpoint", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `endpoint`.
        let id = unsafe { ptr::cstr(endpoint, "endpoint") }?;
        r.remove_endpoint(id)?;
        Ok(())
    })
}

/// Mark an endpoint healthy or not (unhealthy endpoints are never picked).
///
/// Errors: `KVROUTE_RESULT_UNKNOWN_ENDPOINT`. NULL: `router` and `endpoint` must not be NULL.
/// Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `endpoint` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_set_healthy(
    router: *const kvroute_router,
    endpoint: *const c_char,
    healthy: bool,
) -> kvroute_result {
    guard("kvroute_router_set_healthy", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `endpoint`.
        let id = unsafe { ptr::cstr(endpoint, "endpoint") }?;
        r.set_healthy(id, healthy)?;
        Ok(())
    })
}

/// Read a C string array of `len` names.
///
/// # Safety
///
/// `names` is NULL or valid for `len` pointers, each NULL or NUL-terminated.
unsafe fn names(names: *const *const c_char, len: usize, what: &str) -> Result<Vec<String>> {
    // SAFETY: forwarded contract.
    let list = unsafe { ptr::slice(names, len, what) }?;
    list.iter()
        .map(|&p| {
            // SAFETY: forwarded contract (each element NULL or NUL-terminated).
            unsafe { ptr::cstr(p, what) }.map(str::to_owned)
        })
        .collect()
}

/// Store a metrics snapshot of an endpoint (`metrics->updated_ms` is when it was taken).
///
/// Errors: `KVROUTE_RESULT_UNKNOWN_ENDPOINT`, `KVROUTE_RESULT_INVALID_METRICS` (e.g. `kv_usage`
/// outside 0..1 or NaN; the field in `kvroute_last_error_field`). NULL: `router`, `endpoint` and
/// `metrics` must not be NULL. Ownership: nothing is kept from `metrics` (the names are copied).
/// Thread safety: any thread.
///
/// # Safety
///
/// `router` is NULL or a live router; `endpoint` is NULL or NUL-terminated; `metrics` is NULL
/// or points to a `kvroute_metrics` whose arrays are valid for their lengths.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_update_metrics(
    router: *const kvroute_router,
    endpoint: *const c_char,
    metrics: *const kvroute_metrics,
) -> kvroute_result {
    guard("kvroute_router_update_metrics", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `endpoint`.
        let id = unsafe { ptr::cstr(endpoint, "endpoint") }?;
        // SAFETY: the caller's contract for `metrics`.
        let m = unsafe { ptr::obj(metrics, "metrics") }?;
        // SAFETY: the caller's contract for the arrays in `metrics`.
        let lora_running = unsafe { names(m.lora_running, m.lora_running_len, "metrics->lora_running") }?;
        // SAFETY: as above.
        let lora_waiting = unsafe { names(m.lora_waiting, m.lora_waiting_len, "metrics->lora_waiting") }?;
        let snapshot = MetricsSnapshot {
            waiting: m.waiting,
            running: m.running,
            kv_usage: m.kv_usage,
            lora_running,
            lora_waiting,
            max_lora: m.has_max_lora.then_some(m.max_lora),
            kv_capacity_tokens: m.has_kv_capacity_tokens.then_some(m.kv_capacity_tokens),
            updated_ms: m.updated_ms,
        };
        r.update_metrics(id, snapshot)?;
        Ok(())
    })
}

/// Read an endpoint's `/metrics` page (vLLM or SGLang Prometheus text, `text_len` bytes of
/// UTF-8, scraped at `now_ms`), store the snapshot and, when `out` is not NULL, its numbers in
/// `*out` (written only on success).
///
/// Errors: `KVROUTE_RESULT_METRICS_PARSE_ERROR` (a page that cannot be read changes nothing),
/// `KVROUTE_RESULT_UNKNOWN_ENDPOINT`, `KVROUTE_RESULT_INVALID_METRICS`. NULL: `router`,
/// `endpoint` and (when `text_len > 0`) `text` must not be NULL. Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `endpoint` is NULL or NUL-terminated; `text` is NULL or
/// valid for `text_len` bytes; `out` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_update_metrics_from_prometheus(
    router: *const kvroute_router,
    endpoint: *const c_char,
    text: *const c_char,
    text_len: usize,
    now_ms: u64,
    out: *mut kvroute_metrics_snapshot,
) -> kvroute_result {
    guard("kvroute_router_update_metrics_from_prometheus", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `endpoint`.
        let id = unsafe { ptr::cstr(endpoint, "endpoint") }?;
        // SAFETY: the caller's contract for `text`.
        let page = unsafe { ptr::text(text, text_len, "text") }?;
        let m = r.update_metrics_from_prometheus(id, page, now_ms)?;
        let snapshot = kvroute_metrics_snapshot {
            waiting: m.waiting,
            running: m.running,
            kv_usage: m.kv_usage,
            lora_running_count: m.lora_running.len(),
            lora_waiting_count: m.lora_waiting.len(),
            has_max_lora: m.max_lora.is_some(),
            max_lora: m.max_lora.unwrap_or(0),
            has_kv_capacity_tokens: m.kv_capacity_tokens.is_some(),
            kv_capacity_tokens: m.kv_capacity_tokens.unwrap_or(0),
            updated_ms: m.updated_ms,
        };
        // SAFETY: `out` is NULL or valid by the caller's contract.
        unsafe { ptr::write(out, snapshot) };
        Ok(())
    })
}

/// Route one HTTP request (OpenAI completions or chat body; headers such as `x-request-id`,
/// `x-session-id`, the judgment hints) at `now_ms` and store the decision in `*out`.
///
/// `body`: `body_len` bytes (JSON). `headers`: `header_count` name/value pairs (NULL when 0).
/// Errors: `KVROUTE_RESULT_REQUEST_ERROR` (the body field in `kvroute_last_error_field`, or the
/// header in `kvroute_last_error_header`), `KVROUTE_RESULT_NO_ENDPOINTS`,
/// `KVROUTE_RESULT_INVALID_UTF8` (a header). A shed request is a success: see
/// `kvroute_decision_is_shed`.
///
/// Ownership: nothing is kept from the arguments. `*out` (written only on success) is owned by
/// the caller: free it with `kvroute_decision_free`; when the response has finished, pass its
/// request id to `kvroute_router_complete`. NULL: `router` and `out` must not be NULL; `body`
/// and `headers` only when their lengths are 0. Thread safety: any thread, concurrently.
///
/// # Safety
///
/// `router` is NULL or a live router; `body` is NULL or valid for `body_len` bytes; `headers`
/// is NULL or valid for `header_count` elements whose pointers are valid for their lengths;
/// `out` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_route(
    router: *const kvroute_router,
    body: *const c_char,
    body_len: usize,
    headers: *const kvroute_header,
    header_count: usize,
    now_ms: u64,
    out: *mut *mut kvroute_decision,
) -> kvroute_result {
    guard("kvroute_router_route", || {
        let out = ptr::out(out, "out")?;
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `body`.
        let body = unsafe { ptr::slice(body.cast::<u8>(), body_len, "body") }?;
        // SAFETY: the caller's contract for `headers`.
        let headers = unsafe { ptr::slice(headers, header_count, "headers") }?;
        // SAFETY: the caller's contract for each header's pointers.
        let pairs = unsafe { header_pairs(headers) }?;
        let decision = r.route_http(body, pairs, now_ms)?;
        let handle = Box::new(kvroute_decision { inner: decision });
        // SAFETY: `out` is non-NULL and valid for one write by the caller's contract.
        unsafe { ptr::write(out, Box::into_raw(handle)) };
        Ok(())
    })
}

/// The request finished (response sent or failed): release its in-flight counters.
/// `request_id` is the decision's (`kvroute_decision_request_id`), NUL-terminated.
///
/// Errors: `KVROUTE_RESULT_UNKNOWN_REQUEST` (not in flight: never routed, already completed, or
/// expired). NULL: `router` and `request_id` must not be NULL. Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `request_id` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_complete(
    router: *const kvroute_router,
    request_id: *const c_char,
) -> kvroute_result {
    guard("kvroute_router_complete", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `request_id`.
        let id = unsafe { ptr::cstr(request_id, "request_id") }?;
        r.complete(id)?;
        Ok(())
    })
}

/// Attach a routing effect to every (non-shed) decision from now on (`on`), or stop (`!on`):
/// the state changes the decision made, in a compact binary form that other router instances
/// apply with `kvroute_router_apply_effect` (replication between processes sharing the same
/// endpoints and policy). Off by default: it copies the request's block keys.
///
/// NULL: `router` must not be NULL. Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_record_effects(router: *const kvroute_router, on: bool) -> kvroute_result {
    guard("kvroute_router_record_effects", || {
        // SAFETY: the caller's contract for `router`.
        unsafe { self::router(router) }?.record_effects(on);
        Ok(())
    })
}

/// Apply a routing effect made by another router instance (`kvroute_decision_effect`,
/// `effect_len` bytes): the assumed cache residency, speculative entries, the in-flight request
/// and the session affinity. Replicate completions with `kvroute_router_complete` on every
/// instance; request ids must be unique across instances (give every request an
/// `x-request-id`).
///
/// Errors: `KVROUTE_RESULT_EFFECT_DECODE_ERROR`, `KVROUTE_RESULT_UNKNOWN_ENDPOINT` (the target
/// or prefill endpoint is not registered here); nothing is applied then. NULL: `router` and
/// (when `effect_len > 0`) `effect` must not be NULL. Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `effect` is NULL or valid for `effect_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_apply_effect(
    router: *const kvroute_router,
    effect: *const u8,
    effect_len: usize,
) -> kvroute_result {
    guard("kvroute_router_apply_effect", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `effect`.
        let bytes = unsafe { ptr::slice(effect, effect_len, "effect") }?;
        r.apply_effect(&kvroute::RoutingEffect::decode(bytes)?)?;
        Ok(())
    })
}

/// Decode one KV-event payload (`payload_len` bytes of msgpack, as vLLM or SGLang publish it)
/// from `endpoint`'s engine and apply it to the precise index. `seq` points to the publisher's
/// sequence number, or is NULL when unknown. The outcome goes to `*out` (optional, may be NULL;
/// written only on success).
///
/// Errors: `KVROUTE_RESULT_EVENT_DECODE_ERROR` (a malformed payload changes nothing),
/// `KVROUTE_RESULT_UNKNOWN_ENDPOINT`. A gap is a success with verdict `KVROUTE_VERDICT_GAP`.
/// NULL: `router`, `endpoint` and (when `payload_len > 0`) `payload` must not be NULL. Thread
/// safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `endpoint` is NULL or NUL-terminated; `payload` is NULL or
/// valid for `payload_len` bytes; `seq` is NULL or valid for one read; `out` is NULL or valid
/// for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_apply_events(
    router: *const kvroute_router,
    endpoint: *const c_char,
    payload: *const u8,
    payload_len: usize,
    seq: *const u64,
    now_ms: u64,
    out: *mut kvroute_apply_outcome,
) -> kvroute_result {
    guard("kvroute_router_apply_events", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `endpoint`.
        let id = unsafe { ptr::cstr(endpoint, "endpoint") }?;
        // SAFETY: the caller's contract for `payload`.
        let bytes = unsafe { ptr::slice(payload, payload_len, "payload") }?;
        // SAFETY: `seq` is NULL or valid for one read by the caller's contract.
        let seq = unsafe { seq.as_ref() }.copied();
        let o = r.apply_events(id, bytes, seq, now_ms)?;
        let (verdict, expected, got) = verdict_out(o.verdict);
        let outcome = kvroute_apply_outcome { verdict, events: o.events, blocks: o.blocks, expected, got };
        // SAFETY: `out` is NULL or valid by the caller's contract.
        unsafe { ptr::write(out, outcome) };
        Ok(())
    })
}

/// Give up on `endpoint`'s gapped event stream: its precise entries are cleared, its next batch
/// is accepted as a fresh start, and it counts as stale for `index.precise.stale_recovery_ms`.
///
/// Errors: `KVROUTE_RESULT_UNKNOWN_ENDPOINT`. NULL: `router` and `endpoint` must not be NULL.
/// Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `endpoint` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_resync_stream(
    router: *const kvroute_router,
    endpoint: *const c_char,
    now_ms: u64,
) -> kvroute_result {
    guard("kvroute_router_resync_stream", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `endpoint`.
        let id = unsafe { ptr::cstr(endpoint, "endpoint") }?;
        r.resync_stream(id, now_ms)?;
        Ok(())
    })
}

/// Count a replay attempt of `endpoint`'s event stream (`ok`: it recovered the gap) in the
/// router's metrics, for callers running a subscriber of their own (subscriptions started with
/// `kvroute_subscription_start` count theirs).
///
/// Errors: `KVROUTE_RESULT_UNKNOWN_ENDPOINT`. NULL: `router` and `endpoint` must not be NULL.
/// Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `endpoint` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_record_replay(
    router: *const kvroute_router,
    endpoint: *const c_char,
    ok: bool,
) -> kvroute_result {
    guard("kvroute_router_record_replay", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `endpoint`.
        let id = unsafe { ptr::cstr(endpoint, "endpoint") }?;
        r.record_replay(id, ok)?;
        Ok(())
    })
}

/// Tokenize text and chat requests with a Hugging Face tokenizer for the precise index: `path`
/// (NUL-terminated) is a model directory (`tokenizer.json`, plus its chat template and
/// tokenizer config when present) or a `tokenizer.json` file; NULL removes the tokenizer.
///
/// Errors: `KVROUTE_RESULT_TOKENIZER_ERROR`; `KVROUTE_RESULT_UNSUPPORTED` when built without
/// the `tokenizer` feature. Thread safety: any thread (routes in progress keep the tokenizer
/// they started with).
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `path` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_set_tokenizer(
    router: *const kvroute_router,
    path: *const c_char,
) -> kvroute_result {
    guard("kvroute_router_set_tokenizer", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        // SAFETY: the caller's contract for `path`.
        let path = unsafe { ptr::opt_cstr(path, "path") }?;
        set_tokenizer(r, path)
    })
}

#[cfg(feature = "tokenizer")]
fn set_tokenizer(r: &Router, path: Option<&str>) -> Result<()> {
    use kvroute::{PrefixCacheConfig, Tokenizer};
    let Some(path) = path.map(std::path::Path::new) else {
        r.set_tokenizer(None);
        return Ok(());
    };
    let t = if path.is_dir() { Tokenizer::from_dir(path) } else { Tokenizer::from_file(path) }?;
    r.set_tokenizer(Some(Arc::new(t.with_prefix_cache(PrefixCacheConfig::default()))));
    Ok(())
}

#[cfg(not(feature = "tokenizer"))]
fn set_tokenizer(_: &Router, _: Option<&str>) -> Result<()> {
    Err(Error::unsupported("tokenizer"))
}

/// Copy the router's own metrics in Prometheus text format (decisions by mode and rule,
/// prefix-hit histogram, index sizes, event-stream health and lag at `now_ms`, reloads).
///
/// Strings out as in `kvroute_router_policy_json` (the text changes between calls: call again
/// while the result is `KVROUTE_RESULT_BUFFER_TOO_SMALL`, or give a buffer with room to spare).
/// Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `buf` is NULL or valid for `buf_len` bytes; `needed` is
/// NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_metrics_text(
    router: *const kvroute_router,
    now_ms: u64,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    guard("kvroute_router_metrics_text", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        let text = r.metrics_text(now_ms);
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_str(text.as_bytes(), buf, buf_len, needed) }
    })
}

/// Store a snapshot of the router's sizes and counters in `*out` (written only on success).
///
/// NULL: `router` and `out` must not be NULL. Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `out` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_stats(
    router: *const kvroute_router,
    out: *mut kvroute_stats,
) -> kvroute_result {
    guard("kvroute_router_stats", || {
        let out = ptr::out(out, "out")?;
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        let s = router_stats(&r.stats());
        // SAFETY: `out` is non-NULL and valid by the caller's contract.
        unsafe { ptr::write(out, s) };
        Ok(())
    })
}

/// Copy the router's stats as JSON (the core's form: `policy_version`, `endpoints`,
/// `inflight_requests`, `index`, `precise`, `counters`, `flow` (as `kvroute_router_flow_stats_json`);
/// it may gain fields the struct of `kvroute_stats` lacks). Strings out as in `kvroute_router_policy_json`. Thread
/// safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `buf` is NULL or valid for `buf_len` bytes; `needed` is
/// NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_stats_json(
    router: *const kvroute_router,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    guard("kvroute_router_stats_json", || {
        // SAFETY: the caller's contract for `router`.
        let h = unsafe { ptr::obj(router, "router") }?;
        // The flow stats as `kvroute_router_flow_stats` reports them (releases the handle keeps
        // count when the caller takes them).
        let held = h.held();
        let mut stats = h.inner.stats();
        held.adjust(&mut stats.flow);
        drop(held);
        let text = json(&stats)?;
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_str(text.as_bytes(), buf, buf_len, needed) }
    })
}

/// Copy every endpoint, in id order, as a JSON array of objects (`id`, `role`, `healthy`,
/// `metrics` (with the LoRA adapter names), `inflight`, `index_memberships`,
/// `precise_memberships`, `events_healthy`). Strings out as in `kvroute_router_policy_json`.
/// Thread safety: any thread.
///
/// Ownership: `router` stays the caller's; nothing passed in is kept after the call.
///
/// # Safety
///
/// `router` is NULL or a live router; `buf` is NULL or valid for `buf_len` bytes; `needed` is
/// NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_router_endpoints_json(
    router: *const kvroute_router,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    guard("kvroute_router_endpoints_json", || {
        // SAFETY: the caller's contract for `router`.
        let r = unsafe { self::router(router) }?;
        let text = json(&r.endpoints())?;
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_str(text.as_bytes(), buf, buf_len, needed) }
    })
}
