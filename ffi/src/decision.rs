//! `kvroute_decision`: one routing decision behind an opaque handle, with accessors.
//!
//! The handle holds the core `Decision` as it came out of the route call (one allocation);
//! every accessor reads it in place: numbers are returned or written to out-structs, strings
//! are copied into caller buffers (the "strings out" convention).

use std::ffi::c_char;

use kvroute::Decision;

use crate::error::{guard, guard_value, kvroute_result, Error, Result};
use crate::ptr;
use crate::types::{
    filter_out, horizon_out, kvroute_filter, kvroute_horizon, kvroute_judgment_source, kvroute_mode, kvroute_role,
    kvroute_rule, mode_out, role_out, rule_out, source_out, KVROUTE_MODE_NONE, KVROUTE_RULE_NONE,
};

/// The routing decision for one request (from `kvroute_router_route`).
///
/// Immutable: any number of threads may read it at once. Free it with `kvroute_decision_free`
/// (once, when no other call uses it). It does not refer to the router: it may outlive it.
pub struct kvroute_decision {
    pub(crate) inner: Decision,
}

/// The judgment a decision used (hint headers, the derived rubric, or both).
#[repr(C)]
pub struct kvroute_judgment {
    /// Generation horizon (`KVROUTE_HORIZON_*`).
    pub horizon: kvroute_horizon,
    /// Memory-pressure risk, 0 to 3.
    pub risk: u8,
    /// Whether a bypass probability was given (only hints give one).
    pub has_bypass_probability: bool,
    /// The bypass probability (0 when not given).
    pub bypass_probability: f64,
    /// Origin (`KVROUTE_JUDGMENT_SOURCE_*`).
    pub source: kvroute_judgment_source,
}

/// The transfer-tax estimate behind a disaggregation decision.
#[repr(C)]
pub struct kvroute_transfer {
    /// Prompt tokens whose KV the decode endpoint lacks.
    pub tokens: u64,
    /// Bytes of KV cache to transfer.
    pub kv_bytes: u64,
    /// Exposed transfer time, seconds.
    pub transfer_s: f64,
    /// Cost when disaggregated, seconds.
    pub disaggregated_cost_s: f64,
    /// Cost when colocated, seconds.
    pub colocated_cost_s: f64,
    /// Whether disaggregation pays.
    pub pays: bool,
}

/// One endpoint's score breakdown in a decision.
#[repr(C)]
pub struct kvroute_endpoint_score {
    /// Its role (`KVROUTE_ROLE_*`).
    pub role: kvroute_role,
    /// Why a filter removed it (`KVROUTE_FILTER_NONE` if none; it may still have been used if
    /// the filter was relaxed).
    pub filtered: kvroute_filter,
    /// Leading prompt blocks it holds.
    pub matched_blocks: u32,
    /// Prompt tokens those blocks cover.
    pub cached_tokens: u64,
    /// Whether the match came from the event-fed precise index.
    pub precise: bool,
    /// Tier-weighted prefix hit ratio, 0 to 1.
    pub prefix_hit: f64,
    /// LoRA affinity, 0 to 1.
    pub lora: f64,
    /// Normalized queue depth.
    pub queue: f64,
    /// KV-cache usage, 0 to 1.
    pub kv_usage: f64,
    /// 1 when the request's session last went here.
    pub session: f64,
    /// Normalized router-side in-flight requests.
    pub inflight: f64,
    /// The weighted total.
    pub total: f64,
}

/// The decision behind a handle.
///
/// # Safety
///
/// `d` is NULL or a live decision.
unsafe fn decision<'a>(d: *const kvroute_decision) -> Result<&'a Decision> {
    // SAFETY: forwarded contract.
    unsafe { ptr::obj(d, "decision") }.map(|d| &d.inner)
}

/// Run a copying accessor: `text` picks the string (or the error) from the decision.
///
/// # Safety
///
/// `d` is NULL or a live decision; `buf` is NULL or valid for `buf_len` bytes; `needed` is NULL
/// or valid for one write.
unsafe fn copy_from(
    function: &str,
    d: *const kvroute_decision,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
    text: impl FnOnce(&Decision) -> Result<&str>,
) -> kvroute_result {
    guard(function, || {
        // SAFETY: the caller's contract for `d`.
        let d = unsafe { decision(d) }?;
        let s = text(d)?;
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_str(s.as_bytes(), buf, buf_len, needed) }
    })
}

/// Run a value accessor: `fallback` for a NULL decision.
///
/// # Safety
///
/// `d` is NULL or a live decision.
unsafe fn value<T: Copy>(function: &str, d: *const kvroute_decision, fallback: T, f: impl FnOnce(&Decision) -> T) -> T {
    guard_value(function, fallback, || {
        // SAFETY: the caller's contract for `d`.
        unsafe { d.as_ref() }.map_or(fallback, |d| f(&d.inner))
    })
}

/// Free a decision. NULL is a no-op.
///
/// Ownership: takes back a decision from `kvroute_router_route`. Thread safety: no other call
/// may use this decision during or after this call.
///
/// # Safety
///
/// `decision` is NULL or a live decision, freed only once.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_free(decision: *mut kvroute_decision) {
    guard_value("kvroute_decision_free", (), || {
        if !decision.is_null() {
            // SAFETY: a live handle from `Box::into_raw` in `kvroute_router_route`, freed once.
            drop(unsafe { Box::from_raw(decision) });
        }
    });
}

/// The serving mode (`KVROUTE_MODE_*`); `KVROUTE_MODE_NONE` when shed or when `decision` is
/// NULL. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_mode(decision: *const kvroute_decision) -> kvroute_mode {
    // SAFETY: forwarded contract.
    unsafe { value("kvroute_decision_mode", decision, KVROUTE_MODE_NONE, |d| mode_out(d.mode())) }
}

/// The rule that fired (`KVROUTE_RULE_*`); `KVROUTE_RULE_NONE` when `decision` is NULL. Thread
/// safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_rule(decision: *const kvroute_decision) -> kvroute_rule {
    // SAFETY: forwarded contract.
    unsafe { value("kvroute_decision_rule", decision, KVROUTE_RULE_NONE, |d| rule_out(d.rule)) }
}

/// The version of the policy that made the whole decision; 0 when `decision` is NULL. Thread
/// safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_policy_version(decision: *const kvroute_decision) -> u64 {
    // SAFETY: forwarded contract.
    unsafe { value("kvroute_decision_policy_version", decision, 0, |d| d.policy_version) }
}

/// Copy the request id to pass to `kvroute_router_complete` (the caller's `x-request-id`, made
/// unique, or a generated one).
///
/// Strings out: `buf` receives the text and a terminating NUL when `buf_len` is at least the
/// size needed; `*needed` (when `needed` is not NULL) receives that size, NUL included, on
/// `KVROUTE_RESULT_OK` and on `KVROUTE_RESULT_BUFFER_TOO_SMALL` (the buffer is then untouched).
/// `buf` may be NULL when `buf_len` is 0 (a size query). The decision never changes, so the
/// size is the same on every call. NULL: `decision` must not be NULL. Thread safety: any
/// thread.
///
/// Ownership: `decision` stays the caller's; the text is copied into the caller's `buf`, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision; `buf` is NULL or valid for `buf_len` bytes; `needed`
/// is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_request_id(
    decision: *const kvroute_decision,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    // SAFETY: forwarded contract.
    unsafe { copy_from("kvroute_decision_request_id", decision, buf, buf_len, needed, |d| Ok(&d.request_id)) }
}

/// Copy the target (decode) endpoint, `ip:port`. `KVROUTE_RESULT_ABSENT` when shed. Strings out
/// as in `kvroute_decision_request_id`. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the text is copied into the caller's `buf`, nothing to free.
/// NULL: `decision` must not be NULL (`KVROUTE_RESULT_NULL_ARGUMENT`); `buf` may be NULL only when `buf_len` is 0; `needed` may be NULL.
///
/// # Safety
///
/// As for `kvroute_decision_request_id`.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_endpoint(
    decision: *const kvroute_decision,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    // SAFETY: forwarded contract.
    unsafe {
        copy_from("kvroute_decision_endpoint", decision, buf, buf_len, needed, |d| {
            d.endpoint().ok_or_else(|| Error::absent("the endpoint (the request was shed)"))
        })
    }
}

/// Copy the prefill endpoint, `ip:port`. `KVROUTE_RESULT_ABSENT` unless disaggregated. Strings
/// out as in `kvroute_decision_request_id`. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the text is copied into the caller's `buf`, nothing to free.
/// NULL: `decision` must not be NULL (`KVROUTE_RESULT_NULL_ARGUMENT`); `buf` may be NULL only when `buf_len` is 0; `needed` may be NULL.
///
/// # Safety
///
/// As for `kvroute_decision_request_id`.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_prefill_endpoint(
    decision: *const kvroute_decision,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    // SAFETY: forwarded contract.
    unsafe {
        copy_from("kvroute_decision_prefill_endpoint", decision, buf, buf_len, needed, |d| {
            d.prefill_endpoint().ok_or_else(|| Error::absent("the prefill endpoint"))
        })
    }
}

/// Whether the request was shed (answer with `kvroute_decision_shed_status`, 429, and the
/// decision's headers); false when `decision` is NULL. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_is_shed(decision: *const kvroute_decision) -> bool {
    // SAFETY: forwarded contract.
    unsafe { value("kvroute_decision_is_shed", decision, false, |d| d.shed().is_some()) }
}

/// The HTTP status to answer a shed request with (429); 0 when not shed or `decision` is NULL.
/// Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_shed_status(decision: *const kvroute_decision) -> u16 {
    // SAFETY: forwarded contract.
    unsafe { value("kvroute_decision_shed_status", decision, 0, |d| d.shed().map_or(0, |s| s.status)) }
}

/// Copy why the request was shed (also in the `x-kvroute-shed-reason` header).
/// `KVROUTE_RESULT_ABSENT` when not shed. Strings out as in `kvroute_decision_request_id`.
/// Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the text is copied into the caller's `buf`, nothing to free.
/// NULL: `decision` must not be NULL (`KVROUTE_RESULT_NULL_ARGUMENT`); `buf` may be NULL only when `buf_len` is 0; `needed` may be NULL.
///
/// # Safety
///
/// As for `kvroute_decision_request_id`.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_shed_reason(
    decision: *const kvroute_decision,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    // SAFETY: forwarded contract.
    unsafe {
        copy_from("kvroute_decision_shed_reason", decision, buf, buf_len, needed, |d| {
            d.shed().map(|s| s.reason.as_str()).ok_or_else(|| Error::absent("the shed reason (not shed)"))
        })
    }
}

/// The number of headers to set on the upstream request (or on the 429 answer when shed); 0
/// when `decision` is NULL. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_header_count(decision: *const kvroute_decision) -> usize {
    // SAFETY: forwarded contract.
    unsafe { value("kvroute_decision_header_count", decision, 0, |d| d.headers.len()) }
}

/// Copy the name of header `index` (below `kvroute_decision_header_count`; lower case, e.g.
/// `x-gateway-destination-endpoint`). `KVROUTE_RESULT_OUT_OF_RANGE` past the end. Strings out
/// as in `kvroute_decision_request_id`. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the text is copied into the caller's `buf`, nothing to free.
/// NULL: `decision` must not be NULL (`KVROUTE_RESULT_NULL_ARGUMENT`); `buf` may be NULL only when `buf_len` is 0; `needed` may be NULL.
///
/// # Safety
///
/// As for `kvroute_decision_request_id`.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_header_name(
    decision: *const kvroute_decision,
    index: usize,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    // SAFETY: forwarded contract.
    unsafe {
        copy_from("kvroute_decision_header_name", decision, buf, buf_len, needed, |d| {
            d.headers.get(index).map(|(k, _)| *k).ok_or_else(|| Error::out_of_range("header", index, d.headers.len()))
        })
    }
}

/// Copy the value of header `index`. `KVROUTE_RESULT_OUT_OF_RANGE` past the end. Strings out as
/// in `kvroute_decision_request_id`. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the text is copied into the caller's `buf`, nothing to free.
/// NULL: `decision` must not be NULL (`KVROUTE_RESULT_NULL_ARGUMENT`); `buf` may be NULL only when `buf_len` is 0; `needed` may be NULL.
///
/// # Safety
///
/// As for `kvroute_decision_request_id`.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_header_value(
    decision: *const kvroute_decision,
    index: usize,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    // SAFETY: forwarded contract.
    unsafe {
        copy_from("kvroute_decision_header_value", decision, buf, buf_len, needed, |d| {
            d.headers
                .get(index)
                .map(|(_, v)| v.as_str())
                .ok_or_else(|| Error::out_of_range("header", index, d.headers.len()))
        })
    }
}

/// Copy the value of the header named `name` (NUL-terminated, lower case) that the decision
/// sets. `KVROUTE_RESULT_ABSENT` if it sets none. Strings out as in
/// `kvroute_decision_request_id`. NULL: `decision` and `name` must not be NULL. Thread safety:
/// any thread.
///
/// Ownership: `decision` stays the caller's; the text is copied into the caller's `buf`, nothing to free.
///
/// # Safety
///
/// As for `kvroute_decision_request_id`; `name` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_header(
    decision: *const kvroute_decision,
    name: *const c_char,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    // SAFETY: forwarded contract.
    unsafe {
        copy_from("kvroute_decision_header", decision, buf, buf_len, needed, |d| {
            // SAFETY: the caller's contract for `name`.
            let name = ptr::cstr(name, "name")?;
            d.header(name).ok_or_else(|| Error::absent(&format!("header {name:?}")))
        })
    }
}

/// Prefix hit ratio on the target, 0 to 1; 0 when `decision` is NULL. Thread safety: any
/// thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_prefix_hit(decision: *const kvroute_decision) -> f64 {
    // SAFETY: forwarded contract.
    unsafe { value("kvroute_decision_prefix_hit", decision, 0.0, |d| d.prefix_hit) }
}

/// Prompt tokens the target is believed to hold; 0 when `decision` is NULL. Thread safety: any
/// thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_cached_tokens(decision: *const kvroute_decision) -> u64 {
    // SAFETY: forwarded contract.
    unsafe { value("kvroute_decision_cached_tokens", decision, 0, |d| d.cached_tokens) }
}

/// Input tokens (pseudo-tokens of 4 bytes for text without a tokenizer); 0 when `decision` is
/// NULL. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_input_tokens(decision: *const kvroute_decision) -> u64 {
    // SAFETY: forwarded contract.
    unsafe { value("kvroute_decision_input_tokens", decision, 0, |d| d.input_tokens) }
}

/// Pool saturation used by admission; 0 when `decision` is NULL. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_saturation(decision: *const kvroute_decision) -> f64 {
    // SAFETY: forwarded contract.
    unsafe { value("kvroute_decision_saturation", decision, 0.0, |d| d.saturation) }
}

/// Whether a filter was relaxed because it would have left no candidate; false when `decision`
/// is NULL. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_relaxed_filters(decision: *const kvroute_decision) -> bool {
    // SAFETY: forwarded contract.
    unsafe { value("kvroute_decision_relaxed_filters", decision, false, |d| d.relaxed_filters) }
}

/// Store the judgment the decision used in `*out` (written only on success). NULL: `decision`
/// and `out` must not be NULL. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision; `out` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_judgment(
    decision: *const kvroute_decision,
    out: *mut kvroute_judgment,
) -> kvroute_result {
    guard("kvroute_decision_judgment", || {
        let out = ptr::out(out, "out")?;
        // SAFETY: the caller's contract for `decision`.
        let j = unsafe { self::decision(decision) }?.judgment;
        let v = kvroute_judgment {
            horizon: horizon_out(j.horizon),
            risk: j.risk,
            has_bypass_probability: j.bypass_probability.is_some(),
            bypass_probability: j.bypass_probability.unwrap_or(0.0),
            source: source_out(j.source),
        };
        // SAFETY: `out` is non-NULL and valid by the caller's contract.
        unsafe { ptr::write(out, v) };
        Ok(())
    })
}

/// Store the transfer-tax estimate in `*out` (written only on success).
/// `KVROUTE_RESULT_ABSENT` when the disaggregation rule was not evaluated. NULL: `decision` and
/// `out` must not be NULL. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision; `out` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_transfer(
    decision: *const kvroute_decision,
    out: *mut kvroute_transfer,
) -> kvroute_result {
    guard("kvroute_decision_transfer", || {
        let out = ptr::out(out, "out")?;
        // SAFETY: the caller's contract for `decision`.
        let d = unsafe { self::decision(decision) }?;
        let t = d.transfer.ok_or_else(|| Error::absent("the transfer estimate"))?;
        let v = kvroute_transfer {
            tokens: t.tokens,
            kv_bytes: t.kv_bytes,
            transfer_s: t.transfer_s,
            disaggregated_cost_s: t.disaggregated_cost_s,
            colocated_cost_s: t.colocated_cost_s,
            pays: t.pays,
        };
        // SAFETY: `out` is non-NULL and valid by the caller's contract.
        unsafe { ptr::write(out, v) };
        Ok(())
    })
}

/// The number of per-endpoint score breakdowns: every endpoint registered at decision time, in
/// id order; 0 when `decision` is NULL. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_score_count(decision: *const kvroute_decision) -> usize {
    // SAFETY: forwarded contract.
    unsafe { value("kvroute_decision_score_count", decision, 0, |d| d.scores.len().min(d.endpoints.len())) }
}

/// Copy the endpoint id of score breakdown `index` (below `kvroute_decision_score_count`).
/// `KVROUTE_RESULT_OUT_OF_RANGE` past the end. Strings out as in
/// `kvroute_decision_request_id`. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the text is copied into the caller's `buf`, nothing to free.
/// NULL: `decision` must not be NULL (`KVROUTE_RESULT_NULL_ARGUMENT`); `buf` may be NULL only when `buf_len` is 0; `needed` may be NULL.
///
/// # Safety
///
/// As for `kvroute_decision_request_id`.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_score_endpoint(
    decision: *const kvroute_decision,
    index: usize,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    // SAFETY: forwarded contract.
    unsafe {
        copy_from("kvroute_decision_score_endpoint", decision, buf, buf_len, needed, |d| {
            let count = d.scores.len().min(d.endpoints.len());
            d.endpoints
                .get(index)
                .filter(|_| index < count)
                .map(|e| &**e)
                .ok_or_else(|| Error::out_of_range("score", index, count))
        })
    }
}

/// Store score breakdown `index` in `*out` (written only on success).
/// `KVROUTE_RESULT_OUT_OF_RANGE` past the end. NULL: `decision` and `out` must not be NULL.
/// Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the value is returned, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision; `out` is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_score(
    decision: *const kvroute_decision,
    index: usize,
    out: *mut kvroute_endpoint_score,
) -> kvroute_result {
    guard("kvroute_decision_score", || {
        let out = ptr::out(out, "out")?;
        // SAFETY: the caller's contract for `decision`.
        let d = unsafe { self::decision(decision) }?;
        let count = d.scores.len().min(d.endpoints.len());
        let s =
            d.scores.get(index).filter(|_| index < count).ok_or_else(|| Error::out_of_range("score", index, count))?;
        let v = kvroute_endpoint_score {
            role: role_out(s.role),
            filtered: filter_out(s.filtered),
            matched_blocks: s.matched_blocks,
            cached_tokens: s.cached_tokens,
            precise: s.precise,
            prefix_hit: s.prefix_hit,
            lora: s.lora,
            queue: s.queue,
            kv_usage: s.kv_usage,
            session: s.session,
            inflight: s.inflight,
            total: s.total,
        };
        // SAFETY: `out` is non-NULL and valid by the caller's contract.
        unsafe { ptr::write(out, v) };
        Ok(())
    })
}

/// Copy the decision's routing effect (binary, see `kvroute_router_record_effects`) into
/// `buf`. `KVROUTE_RESULT_ABSENT` when effects are not recorded or the request was shed.
///
/// Bytes out: like strings out, without the NUL: `buf` receives the bytes when `buf_len` is at
/// least their number; `*needed` (when not NULL) receives that number on `KVROUTE_RESULT_OK`
/// and on `KVROUTE_RESULT_BUFFER_TOO_SMALL` (`buf` then untouched); `buf` may be NULL when
/// `buf_len` is 0. NULL: `decision` must not be NULL. Thread safety: any thread.
///
/// Ownership: `decision` stays the caller's; the text is copied into the caller's `buf`, nothing to free.
///
/// # Safety
///
/// `decision` is NULL or a live decision; `buf` is NULL or valid for `buf_len` bytes; `needed`
/// is NULL or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_effect(
    decision: *const kvroute_decision,
    buf: *mut u8,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    guard("kvroute_decision_effect", || {
        // SAFETY: the caller's contract for `decision`.
        let d = unsafe { self::decision(decision) }?;
        let e = d.effect.as_ref().ok_or_else(|| Error::absent("the routing effect"))?;
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_bytes(&e.encode(), buf, buf_len, needed) }
    })
}

/// Copy the whole decision as JSON (the core's serde form, the same as the Python
/// `Decision.to_json()`). Strings out as in `kvroute_decision_request_id`. Thread safety: any
/// thread.
///
/// Ownership: `decision` stays the caller's; the text is copied into the caller's `buf`, nothing to free.
/// NULL: `decision` must not be NULL (`KVROUTE_RESULT_NULL_ARGUMENT`); `buf` may be NULL only when `buf_len` is 0; `needed` may be NULL.
///
/// # Safety
///
/// As for `kvroute_decision_request_id`.
#[no_mangle]
pub unsafe extern "C" fn kvroute_decision_to_json(
    decision: *const kvroute_decision,
    buf: *mut c_char,
    buf_len: usize,
    needed: *mut usize,
) -> kvroute_result {
    guard("kvroute_decision_to_json", || {
        // SAFETY: the caller's contract for `decision`.
        let d = unsafe { self::decision(decision) }?;
        let text = d.to_json().to_string();
        // SAFETY: the caller's contract for `buf` and `needed`.
        unsafe { ptr::copy_str(text.as_bytes(), buf, buf_len, needed) }
    })
}
