//! Enumerations of the C API and their names.
//!
//! Every enumeration is a fixed-width integer type with `#define`d constants, not a C `enum`:
//! its size is the same for every compiler, and a value the library does not know (an older
//! library, a caller's mistake) is an ordinary integer on both sides, never undefined
//! behaviour in Rust. Values are stable; 0 means "none" where that makes sense.

use std::ffi::{c_char, CStr};

use kvroute::{FilterReason, Horizon, JudgmentSource, Mode, Role, Rule, StreamVerdict};

use crate::error::{Error, Result, KVROUTE_RESULT_INVALID_ARGUMENT};

/// An endpoint's role.
pub type kvroute_role = u32;
/// Prefill only (disaggregated serving).
pub const KVROUTE_ROLE_PREFILL: kvroute_role = 1;
/// Decode (a decode endpoint can also prefill locally).
pub const KVROUTE_ROLE_DECODE: kvroute_role = 2;
/// Prefill and decode (a colocated worker).
pub const KVROUTE_ROLE_BOTH: kvroute_role = 3;

/// How a request is served.
pub type kvroute_mode = u32;
/// No mode: the request was shed.
pub const KVROUTE_MODE_NONE: kvroute_mode = 0;
/// Straight to a decode endpoint that already holds the prompt's KV cache.
pub const KVROUTE_MODE_DECODE_DIRECT: kvroute_mode = 1;
/// One endpoint runs prefill and decode.
pub const KVROUTE_MODE_COLOCATED: kvroute_mode = 2;
/// A prefill endpoint computes the KV cache and ships it to the decode endpoint.
pub const KVROUTE_MODE_DISAGGREGATED: kvroute_mode = 3;

/// The rule that made a decision.
pub type kvroute_rule = u32;
/// No rule (only for a NULL decision).
pub const KVROUTE_RULE_NONE: kvroute_rule = 0;
/// Prefix hit, KV usage (and bypass probability) allow decode-direct.
pub const KVROUTE_RULE_DECODE_DIRECT: kvroute_rule = 1;
/// Short input, short horizon, low risk: colocated.
pub const KVROUTE_RULE_COLOCATED_FAST_PATH: kvroute_rule = 2;
/// The KV transfer pays for itself: disaggregated.
pub const KVROUTE_RULE_DISAGGREGATED: kvroute_rule = 3;
/// The transfer-tax model says the transfer does not pay: colocated.
pub const KVROUTE_RULE_TRANSFER_TAX_VETO: kvroute_rule = 4;
/// No healthy prefill endpoint: colocated.
pub const KVROUTE_RULE_NO_PREFILL_POOL: kvroute_rule = 5;
/// `modes.disaggregation` is off: colocated.
pub const KVROUTE_RULE_DISAGGREGATION_DISABLED: kvroute_rule = 6;
/// The pool is saturated and the request is sheddable: answer 429.
pub const KVROUTE_RULE_SHED: kvroute_rule = 7;

/// Why an endpoint was filtered out of the candidates.
pub type kvroute_filter = u32;
/// Not filtered.
pub const KVROUTE_FILTER_NONE: kvroute_filter = 0;
/// Queue or KV usage at a filter limit.
pub const KVROUTE_FILTER_SATURATED: kvroute_filter = 1;
/// Metrics missing or older than `metrics.staleness_ms`.
pub const KVROUTE_FILTER_STALE_METRICS: kvroute_filter = 2;
/// Marked unhealthy.
pub const KVROUTE_FILTER_UNHEALTHY: kvroute_filter = 3;

/// A generation horizon.
pub type kvroute_horizon = u32;
/// Short output.
pub const KVROUTE_HORIZON_SHORT: kvroute_horizon = 1;
/// Medium output.
pub const KVROUTE_HORIZON_MEDIUM: kvroute_horizon = 2;
/// Long or unbounded output.
pub const KVROUTE_HORIZON_LONG: kvroute_horizon = 3;

/// Where a decision's judgment came from.
pub type kvroute_judgment_source = u32;
/// Derived by the rubric.
pub const KVROUTE_JUDGMENT_SOURCE_DERIVED: kvroute_judgment_source = 1;
/// Every field from hint headers.
pub const KVROUTE_JUDGMENT_SOURCE_HINT: kvroute_judgment_source = 2;
/// Some fields hinted, the rest derived.
pub const KVROUTE_JUDGMENT_SOURCE_MIXED: kvroute_judgment_source = 3;

/// How a KV-event batch's sequence number was judged.
pub type kvroute_verdict = u32;
/// In order (or first, or unnumbered): applied.
pub const KVROUTE_VERDICT_APPLIED: kvroute_verdict = 1;
/// Already seen: ignored.
pub const KVROUTE_VERDICT_DUPLICATE: kvroute_verdict = 2;
/// Batches `expected .. got` are missing: NOT applied. Replay them (then this one again), or
/// call `kvroute_router_resync_stream` and submit this batch again.
pub const KVROUTE_VERDICT_GAP: kvroute_verdict = 3;
/// The publisher restarted: the endpoint's entries were cleared and the batch applied.
pub const KVROUTE_VERDICT_RESET: kvroute_verdict = 4;

/// Whether a ZMQ subscription binds or connects its socket.
pub type kvroute_socket_mode = u32;
/// Bind on a wildcard host (`tcp://*:5557`), connect otherwise (vLLM's rule).
pub const KVROUTE_SOCKET_MODE_AUTO: kvroute_socket_mode = 0;
/// Always bind.
pub const KVROUTE_SOCKET_MODE_BIND: kvroute_socket_mode = 1;
/// Always connect.
pub const KVROUTE_SOCKET_MODE_CONNECT: kvroute_socket_mode = 2;

pub(crate) fn role_in(role: kvroute_role) -> Result<Role> {
    match role {
        KVROUTE_ROLE_PREFILL => Ok(Role::Prefill),
        KVROUTE_ROLE_DECODE => Ok(Role::Decode),
        KVROUTE_ROLE_BOTH => Ok(Role::Both),
        other => Err(Error::new(
            KVROUTE_RESULT_INVALID_ARGUMENT,
            format!("role {other} is none of KVROUTE_ROLE_PREFILL, _DECODE, _BOTH"),
        )),
    }
}

pub(crate) fn role_out(role: Role) -> kvroute_role {
    match role {
        Role::Prefill => KVROUTE_ROLE_PREFILL,
        Role::Decode => KVROUTE_ROLE_DECODE,
        Role::Both => KVROUTE_ROLE_BOTH,
    }
}

pub(crate) fn mode_out(mode: Option<Mode>) -> kvroute_mode {
    match mode {
        None => KVROUTE_MODE_NONE,
        Some(Mode::DecodeDirect) => KVROUTE_MODE_DECODE_DIRECT,
        Some(Mode::Colocated) => KVROUTE_MODE_COLOCATED,
        Some(Mode::Disaggregated) => KVROUTE_MODE_DISAGGREGATED,
    }
}

pub(crate) fn rule_out(rule: Rule) -> kvroute_rule {
    match rule {
        Rule::DecodeDirect => KVROUTE_RULE_DECODE_DIRECT,
        Rule::ColocatedFastPath => KVROUTE_RULE_COLOCATED_FAST_PATH,
        Rule::Disaggregated => KVROUTE_RULE_DISAGGREGATED,
        Rule::TransferTaxVeto => KVROUTE_RULE_TRANSFER_TAX_VETO,
        Rule::NoPrefillPool => KVROUTE_RULE_NO_PREFILL_POOL,
        Rule::DisaggregationDisabled => KVROUTE_RULE_DISAGGREGATION_DISABLED,
        Rule::Shed => KVROUTE_RULE_SHED,
    }
}

pub(crate) fn filter_out(f: Option<FilterReason>) -> kvroute_filter {
    match f {
        None => KVROUTE_FILTER_NONE,
        Some(FilterReason::Saturated) => KVROUTE_FILTER_SATURATED,
        Some(FilterReason::StaleMetrics) => KVROUTE_FILTER_STALE_METRICS,
        Some(FilterReason::Unhealthy) => KVROUTE_FILTER_UNHEALTHY,
    }
}

pub(crate) fn horizon_out(h: Horizon) -> kvroute_horizon {
    match h {
        Horizon::Short => KVROUTE_HORIZON_SHORT,
        Horizon::Medium => KVROUTE_HORIZON_MEDIUM,
        Horizon::Long => KVROUTE_HORIZON_LONG,
    }
}

pub(crate) fn source_out(s: JudgmentSource) -> kvroute_judgment_source {
    match s {
        JudgmentSource::Derived => KVROUTE_JUDGMENT_SOURCE_DERIVED,
        JudgmentSource::Hint => KVROUTE_JUDGMENT_SOURCE_HINT,
        JudgmentSource::Mixed => KVROUTE_JUDGMENT_SOURCE_MIXED,
    }
}

/// The verdict and, for a gap, (expected, got).
pub(crate) fn verdict_out(v: StreamVerdict) -> (kvroute_verdict, u64, u64) {
    match v {
        StreamVerdict::Applied => (KVROUTE_VERDICT_APPLIED, 0, 0),
        StreamVerdict::Duplicate => (KVROUTE_VERDICT_DUPLICATE, 0, 0),
        StreamVerdict::Gap { expected, got } => (KVROUTE_VERDICT_GAP, expected, got),
        StreamVerdict::Reset => (KVROUTE_VERDICT_RESET, 0, 0),
    }
}

/// A static name, or NULL; behind the panic boundary like every exported function.
fn named(function: &str, pick: impl FnOnce() -> Option<&'static CStr>) -> *const c_char {
    crate::error::guard_value(function, std::ptr::null(), || pick().map_or(std::ptr::null(), CStr::as_ptr))
}

/// `"prefill"`, `"decode"`, `"both"` (the names policy documents and metrics use), or NULL for an
/// unknown value. The string is static: never free it. Thread safety: any thread.
///
/// Ownership: the returned string is static: never free it.
#[no_mangle]
pub extern "C" fn kvroute_role_name(role: kvroute_role) -> *const c_char {
    named("kvroute_role_name", || match role {
        KVROUTE_ROLE_PREFILL => Some(c"prefill"),
        KVROUTE_ROLE_DECODE => Some(c"decode"),
        KVROUTE_ROLE_BOTH => Some(c"both"),
        _ => None,
    })
}

/// `"decode-direct"`, `"colocated"`, `"disaggregated"` (the `x-kvroute-mode` header values), or
/// NULL for `KVROUTE_MODE_NONE` and unknown values. Static string. Thread safety: any thread.
///
/// Ownership: the returned string is static: never free it.
#[no_mangle]
pub extern "C" fn kvroute_mode_name(mode: kvroute_mode) -> *const c_char {
    named("kvroute_mode_name", || match mode {
        KVROUTE_MODE_DECODE_DIRECT => Some(c"decode-direct"),
        KVROUTE_MODE_COLOCATED => Some(c"colocated"),
        KVROUTE_MODE_DISAGGREGATED => Some(c"disaggregated"),
        _ => None,
    })
}

/// `"decode_direct"`, `"colocated_fast_path"`, `"disaggregated"`, `"transfer_tax_veto"`,
/// `"no_prefill_pool"`, `"disaggregation_disabled"`, `"shed"` (the names metrics use), or NULL
/// for `KVROUTE_RULE_NONE` and unknown values. Static string. Thread safety: any thread.
///
/// Ownership: the returned string is static: never free it.
#[no_mangle]
pub extern "C" fn kvroute_rule_name(rule: kvroute_rule) -> *const c_char {
    named("kvroute_rule_name", || match rule {
        KVROUTE_RULE_DECODE_DIRECT => Some(c"decode_direct"),
        KVROUTE_RULE_COLOCATED_FAST_PATH => Some(c"colocated_fast_path"),
        KVROUTE_RULE_DISAGGREGATED => Some(c"disaggregated"),
        KVROUTE_RULE_TRANSFER_TAX_VETO => Some(c"transfer_tax_veto"),
        KVROUTE_RULE_NO_PREFILL_POOL => Some(c"no_prefill_pool"),
        KVROUTE_RULE_DISAGGREGATION_DISABLED => Some(c"disaggregation_disabled"),
        KVROUTE_RULE_SHED => Some(c"shed"),
        _ => None,
    })
}

/// `"saturated"`, `"stale_metrics"`, `"unhealthy"`, or NULL for `KVROUTE_FILTER_NONE` and
/// unknown values. Static string. Thread safety: any thread.
///
/// Ownership: the returned string is static: never free it.
#[no_mangle]
pub extern "C" fn kvroute_filter_name(filter: kvroute_filter) -> *const c_char {
    named("kvroute_filter_name", || match filter {
        KVROUTE_FILTER_SATURATED => Some(c"saturated"),
        KVROUTE_FILTER_STALE_METRICS => Some(c"stale_metrics"),
        KVROUTE_FILTER_UNHEALTHY => Some(c"unhealthy"),
        _ => None,
    })
}

/// `"short"`, `"medium"`, `"long"`, or NULL for an unknown value. Static string. Thread safety:
/// any thread.
///
/// Ownership: the returned string is static: never free it.
#[no_mangle]
pub extern "C" fn kvroute_horizon_name(horizon: kvroute_horizon) -> *const c_char {
    named("kvroute_horizon_name", || match horizon {
        KVROUTE_HORIZON_SHORT => Some(c"short"),
        KVROUTE_HORIZON_MEDIUM => Some(c"medium"),
        KVROUTE_HORIZON_LONG => Some(c"long"),
        _ => None,
    })
}

/// `"derived"`, `"hint"`, `"mixed"`, or NULL for an unknown value. Static string. Thread
/// safety: any thread.
///
/// Ownership: the returned string is static: never free it.
#[no_mangle]
pub extern "C" fn kvroute_judgment_source_name(source: kvroute_judgment_source) -> *const c_char {
    named("kvroute_judgment_source_name", || match source {
        KVROUTE_JUDGMENT_SOURCE_DERIVED => Some(c"derived"),
        KVROUTE_JUDGMENT_SOURCE_HINT => Some(c"hint"),
        KVROUTE_JUDGMENT_SOURCE_MIXED => Some(c"mixed"),
        _ => None,
    })
}

/// `"applied"`, `"duplicate"`, `"gap"`, `"reset"`, or NULL for an unknown value. Static string.
/// Thread safety: any thread.
///
/// Ownership: the returned string is static: never free it.
#[no_mangle]
pub extern "C" fn kvroute_verdict_name(verdict: kvroute_verdict) -> *const c_char {
    named("kvroute_verdict_name", || match verdict {
        KVROUTE_VERDICT_APPLIED => Some(c"applied"),
        KVROUTE_VERDICT_DUPLICATE => Some(c"duplicate"),
        KVROUTE_VERDICT_GAP => Some(c"gap"),
        KVROUTE_VERDICT_RESET => Some(c"reset"),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(p: *const c_char) -> &'static str {
        assert!(!p.is_null());
        // SAFETY: non-NULL names are static NUL-terminated strings.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap()
    }

    /// The serde name of a unit value (`{"verdict": "gap", ...}` for verdicts).
    fn serde_name<T: serde::Serialize>(v: &T) -> String {
        match serde_json::to_value(v).unwrap() {
            serde_json::Value::String(s) => s,
            serde_json::Value::Object(o) => o["verdict"].as_str().unwrap().to_owned(),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn names_are_the_cores() {
        for r in [Role::Prefill, Role::Decode, Role::Both] {
            assert_eq!(s(kvroute_role_name(role_out(r))), r.as_str());
            assert_eq!(role_in(role_out(r)).unwrap(), r);
        }
        for m in [Mode::DecodeDirect, Mode::Colocated, Mode::Disaggregated] {
            assert_eq!(s(kvroute_mode_name(mode_out(Some(m)))), m.as_str());
        }
        assert!(kvroute_mode_name(KVROUTE_MODE_NONE).is_null());
        let mut codes = std::collections::BTreeSet::new();
        for r in Rule::ALL {
            assert_eq!(s(kvroute_rule_name(rule_out(r))), r.as_str());
            codes.insert(rule_out(r));
        }
        assert_eq!(codes.len(), Rule::ALL.len());
        for f in [FilterReason::Saturated, FilterReason::StaleMetrics, FilterReason::Unhealthy] {
            assert_eq!(s(kvroute_filter_name(filter_out(Some(f)))), serde_name(&f));
        }
        for h in [Horizon::Short, Horizon::Medium, Horizon::Long] {
            assert_eq!(s(kvroute_horizon_name(horizon_out(h))), h.as_str());
        }
        for j in [JudgmentSource::Derived, JudgmentSource::Hint, JudgmentSource::Mixed] {
            assert_eq!(s(kvroute_judgment_source_name(source_out(j))), serde_name(&j));
        }
        for v in [
            StreamVerdict::Applied,
            StreamVerdict::Duplicate,
            StreamVerdict::Gap { expected: 1, got: 3 },
            StreamVerdict::Reset,
        ] {
            assert_eq!(s(kvroute_verdict_name(verdict_out(v).0)), serde_name(&v));
        }
        assert!(role_in(0).is_err() && role_in(4).is_err());
        assert!(kvroute_role_name(9).is_null() && kvroute_rule_name(99).is_null());
    }
}
