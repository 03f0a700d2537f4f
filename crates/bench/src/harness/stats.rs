//! Medians, quartiles, percentiles and ranges over runs and samples: every statistic the
//! experiments print is computed here.

/// The median of the values that are not NaN (the mean of the middle two for an even count).
pub(crate) fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 { v[mid] } else { (v[mid - 1] + v[mid]) / 2.0 })
}

/// The median of the finite values of `values`, NaN when there is none.
pub(crate) fn median_of_finite(values: &[f64]) -> f64 {
    median(values.iter().copied().filter(|x| x.is_finite())).unwrap_or(f64::NAN)
}

/// The smallest and the largest of `values` (infinite for none).
pub(crate) fn min_max(values: &[f64]) -> (f64, f64) {
    values.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

/// The quantiles `qs` of `values` (the value of rank `(n - 1) q`, rounded), sorting them in
/// place; NaN for none.
pub(crate) fn quantiles<const N: usize>(values: &mut [u64], qs: [f64; N]) -> [f64; N] {
    values.sort_unstable();
    qs.map(|q| match values.len() {
        0 => f64::NAN,
        n => values[((n - 1) as f64 * q).round() as usize] as f64,
    })
}

/// The index of the median element of `values` (the lower middle for an even count), NaN
/// last.
pub(crate) fn median_index(values: &[f64]) -> Option<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
    order.get((values.len().max(1) - 1) / 2).copied()
}

/// The median of all of `values`, sorting them in place: the middle value, or the mean of the
/// two middle ones.
pub(crate) fn median_in_place(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    let half = values.len() / 2;
    if values.len() % 2 == 1 { values[half] } else { (values[half - 1] + values[half]) / 2.0 }
}

/// The first and third quartiles (nearest rank) of `values`, sorting them in place.
pub(crate) fn quartiles(values: &mut [f64]) -> (f64, f64) {
    values.sort_by(|a, b| a.total_cmp(b));
    let last = values.len() - 1;
    (values[last / 4], values[last - last / 4])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median([3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median([4.0, 1.0, f64::NAN, 2.0, 3.0]), Some(2.5));
        assert_eq!(median_index(&[5.0, 1.0, 3.0]), Some(2));
        assert_eq!(median_index(&[5.0, 1.0]), Some(1));
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median_in_place(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median_in_place(&mut [3.0, 1.0, 2.0]), 2.0);
    }

    #[test]
    fn quantiles_are_the_rounded_ranks_and_ranges_the_extremes() {
        let mut ns: Vec<u64> = (1..=101).rev().collect();
        assert_eq!(quantiles(&mut ns, [0.5, 0.9, 0.99]), [51.0, 91.0, 100.0]);
        assert!(quantiles(&mut [], [0.5])[0].is_nan());
        assert_eq!(min_max(&[3.0, -1.0, 2.0]), (-1.0, 3.0));
        assert_eq!(median_of_finite(&[1.0, f64::INFINITY, 3.0]), 2.0);
        assert!(median_of_finite(&[f64::NAN]).is_nan());
    }

    #[test]
    fn quartiles_are_the_nearest_ranks() {
        let mut runs = [9.0, 1.0, 5.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0];
        assert_eq!(quartiles(&mut runs), (3.0, 7.0));
        assert_eq!(quartiles(&mut [4.0]), (4.0, 4.0));
    }
}
