//! Medians and quartiles over runs.

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
    fn quartiles_are_the_nearest_ranks() {
        let mut runs = [9.0, 1.0, 5.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0];
        assert_eq!(quartiles(&mut runs), (3.0, 7.0));
        assert_eq!(quartiles(&mut [4.0]), (4.0, 4.0));
    }
}
