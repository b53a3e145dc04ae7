//! The wall clock, for the callers that need one (feature `wall-clock`; `zmq` implies it).
//!
//! The decision path never reads a clock: every call that depends on time takes `now_ms` (see
//! the crate docs). What does need the system clock — a binding that defaults `now` to UNIX time,
//! the ZMQ subscriber stamping received batches — reads it here, the one module of the core
//! allowed to (`clippy.toml` disallows `SystemTime::now` everywhere else in the core).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of `now` in milliseconds, shared with the rest of the program: the subscriber stamps
/// batches with it, so metric timestamps and `route` calls must use the same clock.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Milliseconds since the UNIX epoch (0 if the system clock is before it).
#[allow(clippy::disallowed_methods)] // the core's one reading of the system clock
pub fn unix_time_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A [`Clock`] reading [`unix_time_ms`].
pub fn unix_clock() -> Clock {
    Arc::new(unix_time_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_time_is_after_2020_and_the_clock_reads_it() {
        let t = unix_time_ms();
        assert!(t > 1_577_836_800_000, "{t}");
        assert!(unix_clock()() >= t);
    }
}
