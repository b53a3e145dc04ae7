//! Small timing helpers shared by the benches that print a summary table after criterion's own
//! report (`peers`, `precise`): record criterion's measurement samples (from `iter_custom`) and
//! take medians, and a CPU-time clock for figures that must hold on a loaded machine.

use std::cell::RefCell;
use std::time::{Duration, Instant};

/// CPU time this process has run, summed over its live threads (Linux: the first field of
/// every `/proc/self/task/*/schedstat`, in nanoseconds). Unlike wall time it does not count the
/// time other processes hold the cores, so a bench timed with it measures the same work on a busy
/// machine as on an idle one (up to cache effects). A thread that exits takes its time with it:
/// take differences with `saturating_sub` around work whose threads outlive the measurement.
/// Elsewhere: a monotonic clock.
pub fn cpu_time() -> Duration {
    fn schedstat() -> Option<u64> {
        let mut total = 0u64;
        for task in std::fs::read_dir("/proc/self/task").ok()? {
            total += run_ns(&task.ok()?.path().join("schedstat"))?;
        }
        Some(total)
    }
    schedstat().map_or_else(monotonic, Duration::from_nanos)
}

/// CPU time the calling thread has run (Linux: `/proc/thread-self/schedstat`); elsewhere a
/// monotonic clock. For single-threaded measurements (lookups timed by criterion).
pub fn thread_cpu_time() -> Duration {
    run_ns(std::path::Path::new("/proc/thread-self/schedstat")).map_or_else(monotonic, Duration::from_nanos)
}

fn run_ns(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.split_whitespace().next()?.parse().ok()
}

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
}
