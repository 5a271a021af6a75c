//! Order statistics the report and the floor share.

/// The `p` quantile (0–1) of `sorted`, nearest rank; NaN when empty.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}
