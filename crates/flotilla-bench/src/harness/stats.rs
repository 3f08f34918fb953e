//! Turning samples into figures: milliseconds, percentiles.

use std::time::Duration;

/// A duration in milliseconds.
pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The `p` quantile (0 to 1) of sorted samples: the nearest rank, NaN without samples.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// p50 and p99 of unsorted samples.
pub(crate) fn p50_p99(samples: &mut [f64]) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    (percentile(samples, 0.5), percentile(samples, 0.99))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let sorted: Vec<f64> = (1..=101).map(f64::from).collect();
        assert_eq!(percentile(&sorted, 0.0), 1.0);
        assert_eq!(percentile(&sorted, 0.5), 51.0);
        assert_eq!(percentile(&sorted, 0.99), 100.0);
        assert_eq!(percentile(&sorted, 1.0), 101.0);
        assert!(percentile(&[], 0.5).is_nan());
        let mut unsorted = vec![3.0, 1.0, 2.0];
        assert_eq!(p50_p99(&mut unsorted), (2.0, 3.0));
    }
}
