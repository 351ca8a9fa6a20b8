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

/// Samples as one comma-separated field, the way rank processes report them to the parent.
pub fn encode(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:e}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The samples of an [`encode`]d field.
pub fn decode(field: &str) -> Vec<f64> {
    field
        .split(',')
        .filter_map(|x| x.trim().parse().ok())
        .collect()
}

/// The text after the first line of `text` starting with `tag` ("" when there is none).
pub fn tagged<'a>(text: &'a str, tag: &str) -> &'a str {
    text.lines().find_map(|l| l.strip_prefix(tag)).unwrap_or("")
}

/// The memcpy roofline of a benchmark: `warmup + iters` copies of `bytes` bytes between two
/// buffers, a group barrier before each; returns the `iters` timed ones.
pub fn time_memcpy(
    g: &mut dyn epcomm::group::Group,
    bytes: usize,
    warmup: usize,
    iters: usize,
) -> Result<Vec<f64>, String> {
    let src = vec![1u8; bytes.max(1)];
    let mut dst = vec![0u8; bytes.max(1)];
    let mut times = Vec::with_capacity(iters);
    for it in 0..warmup + iters {
        g.barrier().map_err(|e| e.to_string())?;
        let t0 = std::time::Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        if it >= warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(times)
}

/// Largest relative error (`|got - want| / max(|want|, 1)`) a reduction in `kind` may show
/// against the float32 reference.
pub fn tolerance(kind: epcomm::num::FloatKind) -> f32 {
    match kind {
        epcomm::num::FloatKind::F32 => 1e-5,
        epcomm::num::FloatKind::F16 => 4e-3,
        epcomm::num::FloatKind::Bf16 => 3e-2,
    }
}

/// The closing lines of an nccl-tests table: the wrong-value count with its verdict, then the
/// average bus bandwidth (GB/s).
pub fn nccl_summary(wrong: u64, avg_busbw: f64) {
    wrong_summary(wrong);
    println!("# Avg bus bandwidth    : {avg_busbw:.3}");
}

/// nccl-tests' closing line on wrong values.
pub fn wrong_summary(wrong: u64) {
    println!(
        "# Out of bounds values : {wrong} {}",
        if wrong == 0 { "OK" } else { "FAILED" }
    );
}
