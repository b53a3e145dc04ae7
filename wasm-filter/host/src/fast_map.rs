//! The host's own maps (contexts, shared data, call counters) are looked up on every hostcall:
//! they hash with FxHash's multiply-rotate mixing instead of the standard library's SipHash,
//! which showed in the filter's profile. The test host needs no protection against adversarial
//! keys (a collision only costs a probe).

/// A `HashMap` with rustc's Fx hasher (the `rustc-hash` crate).
pub(crate) type FastMap<K, V> = rustc_hash::FxHashMap<K, V>;
