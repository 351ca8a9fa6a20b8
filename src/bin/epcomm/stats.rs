//! Summaries of per-rank timing samples for the benchmarks.

/// Per iteration, the slowest rank's time (`per_rank[r][i]`; a missing sample counts as 0).
pub fn slowest(per_rank: &[Vec<f64>]) -> Vec<f64> {
    let n = per_rank.first().map_or(0, Vec::len);
    (0..n)
        .map(|i| {
            per_rank
                .iter()
                .map(|v| v.get(i).copied().unwrap_or(0.0))
                .fold(0.0, f64::max)
        })
        .collect()
}

/// (median, p99) of `v` (one sort).
pub fn median_p99(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let med = v[v.len() / 2];
    let p99 = v[((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1];
    (med, p99)
}
