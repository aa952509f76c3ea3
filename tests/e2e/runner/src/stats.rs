//! The few statistics the cases report: medians, a 99th percentile and a trend.

/// The median of `values`: the middle one, or the mean of the middle two; NaN for none.
pub fn median(values: &[f64]) -> f64 {
    let sorted = sorted(values);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The 99th percentile of `values`, the value at rank `0.99 n` (the largest for fewer than 100);
/// NaN for none.
pub fn p99(values: &[f64]) -> f64 {
    let sorted = sorted(values);
    let rank = ((sorted.len() as f64) * 0.99) as usize;
    sorted
        .get(rank.min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or(f64::NAN)
}

/// The least-squares slope of `y` over `x` in `points`; 0 for fewer than two distinct `x`.
pub fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mean_x = points.iter().map(|(x, _)| x).sum::<f64>() / n;
    let mean_y = points.iter().map(|(_, y)| y).sum::<f64>() / n;
    let spread: f64 = points.iter().map(|(x, _)| (x - mean_x).powi(2)).sum();
    if spread == 0.0 {
        return 0.0;
    }
    points
        .iter()
        .map(|(x, y)| (x - mean_x) * (y - mean_y))
        .sum::<f64>()
        / spread
}

fn sorted(values: &[f64]) -> Vec<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_the_middle_value_or_the_mean_of_the_middle_two() {
        assert_eq!(median(&[3.4, 1.2, 2.1]), 2.1);
        assert_eq!(median(&[1.0, 4.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn the_99th_percentile_is_the_largest_below_a_hundred_values() {
        assert_eq!(p99(&[5.0, 1.0, 9.0]), 9.0);
        let hundred: Vec<f64> = (1..=200).map(f64::from).collect();
        assert_eq!(p99(&hundred), 199.0);
        assert!(p99(&[]).is_nan());
    }

    #[test]
    fn the_slope_is_the_least_squares_trend() {
        assert_eq!(slope(&[(1.0, 10.0), (2.0, 12.0), (3.0, 14.0)]), 2.0);
        assert_eq!(slope(&[(1.0, 10.0)]), 0.0);
        assert_eq!(slope(&[(1.0, 10.0), (1.0, 12.0)]), 0.0);
    }
}
