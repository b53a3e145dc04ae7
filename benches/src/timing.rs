//! Small timing helpers shared by the benches that print a summary table after criterion's own
//! report (`peers`, `precise`): record criterion's measurement samples (from `iter_custom`) and
//! take medians, and a CPU-time clock for figures that must hold on a loaded machine.

use std::cell::RefCell;
use std::time::{Duration, Instant};

/// CPU time this process has run, all its threads together (Linux: the process's CPU clock,
/// `clock_gettime(CLOCK_PROCESS_CPUTIME_ID)`, nanosecond-resolved). Unlike wall time it does not
/// count the time other processes hold the cores, so a bench timed with it measures the same
/// work on a busy machine as on an idle one (up to cache effects). Elsewhere: a monotonic clock.
pub fn cpu_time() -> Duration {
    #[cfg(target_os = "linux")]
    return duration(rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime));
    #[cfg(not(target_os = "linux"))]
    monotonic()
}

/// CPU time the calling thread has run (Linux: `clock_gettime(CLOCK_THREAD_CPUTIME_ID)`); elsewhere
/// a monotonic clock. For single-threaded measurements (lookups timed by criterion).
///
/// Not `/proc/thread-self/schedstat`, which these benches read before: for the thread reading it
/// the kernel reports the run time as of the last tick or switch, so a measurement shorter than
/// a tick (4 ms at 250 Hz) could read 0 and every sample was off by up to a tick.
pub fn thread_cpu_time() -> Duration {
    #[cfg(target_os = "linux")]
    return duration(rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime));
    #[cfg(not(target_os = "linux"))]
    monotonic()
}

#[cfg(target_os = "linux")]
fn duration(t: rustix::time::Timespec) -> Duration {
    Duration::new(u64::try_from(t.tv_sec).unwrap_or(0), u32::try_from(t.tv_nsec).unwrap_or(0))
}

#[cfg_attr(target_os = "linux", allow(dead_code))]
fn monotonic() -> Duration {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed()
}

/// Median of `v` (NaN when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The `(iterations, elapsed)` pairs an `iter_custom` routine returned to criterion.
#[derive(Debug, Default)]
pub struct Samples(RefCell<Vec<(u64, Duration)>>);

impl Samples {
    /// No samples yet.
    pub fn new() -> Self {
        Samples::default()
    }

    /// Record one call of the routine.
    pub fn record(&self, iters: u64, elapsed: Duration) {
        self.0.borrow_mut().push((iters, elapsed));
    }

    /// Median time per iteration, µs, over the last `last` calls (criterion's measurement
    /// samples come after its warm-up calls); `None` if the routine never ran (filtered out).
    pub fn median_us(&self, last: usize) -> Option<f64> {
        let s = self.0.borrow();
        if s.is_empty() {
            return None;
        }
        let tail = &s[s.len().saturating_sub(last)..];
        Some(median(tail.iter().map(|(n, d)| d.as_secs_f64() * 1e6 / (*n).max(1) as f64).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
        let s = Samples::new();
        assert_eq!(s.median_us(5), None);
        s.record(1, Duration::from_secs(100)); // warm-up, dropped below
        s.record(10, Duration::from_micros(20));
        s.record(20, Duration::from_micros(60));
        s.record(5, Duration::from_micros(10));
        assert_eq!(s.median_us(3), Some(2.0));
    }

    #[test]
    fn thread_cpu_time_counts_work_not_sleep() {
        let t0 = thread_cpu_time();
        std::thread::sleep(Duration::from_millis(50));
        let slept = thread_cpu_time().saturating_sub(t0);
        let t1 = thread_cpu_time();
        let mut x = 0u64;
        while thread_cpu_time().saturating_sub(t1) < Duration::from_millis(20) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        // Sleeping runs no code (allow for the clock's own reads); the loop ran 20 ms of CPU.
        assert!(slept < Duration::from_millis(50), "{slept:?}");
        assert!(thread_cpu_time().saturating_sub(t1) >= Duration::from_millis(20));
        assert!(cpu_time() >= thread_cpu_time(), "the process has run at least this thread's time");
    }

    #[test]
    fn the_clocks_resolve_less_than_a_tick() {
        // 100 measurements of about 50 µs of work each: every one reads more than zero (a clock
        // that moves only at scheduler ticks, 1-10 ms apart, reads zero for most of them).
        let mut zeros = 0;
        for _ in 0..100 {
            let (t, p, wall) = (thread_cpu_time(), cpu_time(), Instant::now());
            let mut x = 0u64;
            while wall.elapsed() < Duration::from_micros(50) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            if thread_cpu_time() == t || cpu_time() == p {
                zeros += 1;
            }
        }
        assert_eq!(zeros, 0, "measurements that read no CPU time");
    }
}
