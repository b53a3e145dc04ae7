//! Small timing helpers shared by the benches that print a summary table after criterion's own
//! report (`peers`, `precise`): record criterion's measurement samples (from `iter_custom`) and
//! take medians.

use std::cell::RefCell;
use std::time::Duration;

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
}
