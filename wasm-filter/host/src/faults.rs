//! Fault injection: make any `env.proxy_*` import answer any status, to test how a filter copes
//! with a host that refuses a call (Envoy answers InternalFailure, BadArgument, NotFound, ... in
//! situations a test host otherwise never produces).
//!
//! A [`Fault`] is armed per import with [`crate::Host::inject_fault`]; while it matches a call,
//! the hostcall does nothing and returns the fault's code (no out-parameter is written, as
//! Envoy's hostcalls leave them untouched on error). The calls are counted per import for every
//! VM of the host ([`crate::Host::hostcall_count`]), whether faulted or not.

use crate::fast_map::FastMap;

use crate::abi::Status;

/// Every `env.proxy_*` import this host provides (ABI 0.2.1), in registration order.
pub const PROXY_IMPORTS: &[&str] = &[
    "proxy_log",
    "proxy_get_log_level",
    "proxy_get_current_time_nanoseconds",
    "proxy_set_tick_period_milliseconds",
    "proxy_get_buffer_status",
    "proxy_get_buffer_bytes",
    "proxy_set_buffer_bytes",
    "proxy_get_header_map_pairs",
    "proxy_set_header_map_pairs",
    "proxy_get_header_map_size",
    "proxy_get_header_map_value",
    "proxy_add_header_map_value",
    "proxy_replace_header_map_value",
    "proxy_remove_header_map_value",
    "proxy_get_property",
    "proxy_set_property",
    "proxy_get_shared_data",
    "proxy_set_shared_data",
    "proxy_register_shared_queue",
    "proxy_resolve_shared_queue",
    "proxy_enqueue_shared_queue",
    "proxy_dequeue_shared_queue",
    "proxy_continue_stream",
    "proxy_close_stream",
    "proxy_send_local_response",
    "proxy_http_call",
    "proxy_get_status",
    "proxy_set_effective_context",
    "proxy_done",
    "proxy_call_foreign_function",
    "proxy_define_metric",
    "proxy_get_metric",
    "proxy_increment_metric",
    "proxy_record_metric",
    "proxy_grpc_call",
    "proxy_grpc_stream",
    "proxy_grpc_send",
    "proxy_grpc_cancel",
    "proxy_grpc_close",
];

/// A status an import answers instead of doing its work, on some of its calls.
///
/// Calls are numbered from 1, counted from the moment the fault is injected, over all VMs.
/// By default every call fails; [`Fault::nth`] and [`Fault::from_call`] narrow that.
///
/// ```
/// use kvroute_wasm_host::{Fault, Status};
/// // the second call from now on answers BadArgument, every other call works
/// let f = Fault::status(Status::BadArgument).nth(2);
/// assert_eq!(f.code(), 2);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    code: i32,
    first: u64,
    last: Option<u64>,
}

impl Fault {
    /// Every call answers `status`.
    pub const fn status(status: Status) -> Fault {
        Fault::code_of(status.code())
    }

    /// Every call answers this raw code (also one ABI 0.2.1 does not define).
    pub const fn code_of(code: i32) -> Fault {
        Fault { code, first: 1, last: None }
    }

    /// Only the `k`-th call (from 1) fails.
    pub const fn nth(self, k: u64) -> Fault {
        Fault { first: k, last: Some(k), ..self }
    }

    /// The `k`-th call (from 1) and every later one fail.
    pub const fn from_call(self, k: u64) -> Fault {
        Fault { first: k, last: None, ..self }
    }

    /// The code the import answers.
    pub const fn code(&self) -> i32 {
        self.code
    }
}

/// An armed fault and how often its import was called since.
#[derive(Debug)]
struct Armed {
    fault: Fault,
    calls: u64,
    fired: u64,
}

/// The host's faults and call counts.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    armed: FastMap<&'static str, Armed>,
    /// Keyed by the address of the import's name (the hostcall wrappers pass their `'static`
    /// literal): counting a call hashes one word, not the name.
    calls: FastMap<usize, (&'static str, u64)>,
    fired: FastMap<&'static str, u64>,
}

impl Faults {
    /// The import's name as this host registered it.
    pub(crate) fn known(import: &str) -> Option<&'static str> {
        PROXY_IMPORTS.iter().copied().find(|n| *n == import)
    }

    pub(crate) fn arm(&mut self, import: &'static str, fault: Fault) {
        self.armed.insert(import, Armed { fault, calls: 0, fired: 0 });
    }

    pub(crate) fn disarm(&mut self, import: &str) {
        self.armed.remove(import);
    }

    pub(crate) fn clear(&mut self) {
        self.armed.clear();
    }

    pub(crate) fn calls(&self, import: &str) -> u64 {
        self.calls.values().filter(|(name, _)| *name == import).map(|(_, n)| n).sum()
    }

    pub(crate) fn fired(&self, import: &str) -> u64 {
        self.fired.get(import).copied().unwrap_or(0)
    }

    /// Counts a call of `import`; `Some(code)` when an armed fault answers it.
    pub(crate) fn on_call(&mut self, import: &'static str) -> Option<i32> {
        self.calls.entry(import.as_ptr() as usize).or_insert((import, 0)).1 += 1;
        if self.armed.is_empty() {
            return None;
        }
        let armed = self.armed.get_mut(import)?;
        armed.calls += 1;
        let n = armed.calls;
        let hit = n >= armed.fault.first && armed.fault.last.is_none_or(|last| n <= last);
        if !hit {
            return None;
        }
        armed.fired += 1;
        *self.fired.entry(import).or_insert(0) += 1;
        Some(armed.fault.code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nth_and_from_call_select_calls() {
        let mut f = Faults::default();
        f.arm("proxy_log", Fault::status(Status::NotFound).nth(2));
        f.arm("proxy_done", Fault::status(Status::InternalFailure).from_call(2));
        let log: Vec<_> = (0..4).map(|_| f.on_call("proxy_log")).collect();
        assert_eq!(log, [None, Some(1), None, None]);
        let done: Vec<_> = (0..3).map(|_| f.on_call("proxy_done")).collect();
        assert_eq!(done, [None, Some(10), Some(10)]);
        assert_eq!((f.calls("proxy_log"), f.fired("proxy_log"), f.fired("proxy_done")), (4, 1, 2));
        f.clear();
        assert_eq!(f.on_call("proxy_done"), None);
        assert_eq!(f.calls("proxy_done"), 4);
    }

    #[test]
    fn the_list_names_distinct_imports() {
        let mut names = PROXY_IMPORTS.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), PROXY_IMPORTS.len());
    }
}
