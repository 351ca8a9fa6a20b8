//! The `nccl` phase's checks of the manager's buffers (one rank through NCCL):
//! - `capacity_graph_across_tokens`: a CUDA graph captured at T = 32, then an uncaptured call
//!   at T = 64 on the same manager, then a replay of the T = 32 graph; both results checked
//!   (the replay bit-equal to the uncaptured T = 32 call), no allocation after creation;
//! - `pool_reallocations`: per layout, 50 random-routing calls (T from 1 to M) on one manager:
//!   the pool's allocations after creation (0 expected: every buffer is sized for M at
//!   creation).

use super::*;

/// One of `graph_across_tokens`'s calls: dispatch + combine with identity experts (the
/// bucket rows are combine's input) into `out`.
fn call(mgr: &mut GpuManager, s: &Stream, input: &DispatchInput, out: u64) -> Result<()> {
    let d = mgr.dispatch(s, input)?;
    mgr.combine(s, d.hidden, out)
}

pub(super) fn capacity_graph_across_tokens() -> Value {
    let run = || -> Result<Value> {
        let _c = ctx()?;
        let s = Stream::create()?;
        let (h, k, e, m) = (1024usize, 8usize, 256usize, 64usize);
        let bf = FloatKind::Bf16;
        let cfg = config(e, k, h, m, bf, bf, bf);
        let mut mgr = GpuManager::new(
            "deepep_low_latency",
            cfg,
            nccl_single()?,
            0,
            GpuMode::Capacity,
        )?;
        let created = mgr.stats();
        let (i32_, i64_) = (gen_inputs(32, 32, h, k, e), gen_inputs(64, 64, h, k, e));
        let d32 = device_inputs(&i32_.x, &i32_.ids, &i32_.w, 32, bf, &s)?;
        let d64 = device_inputs(&i64_.x, &i64_.ids, &i64_.w, 64, bf, &s)?;
        let (o32, o64) = (
            DeviceMemory::alloc(32 * h * 2)?,
            DeviceMemory::alloc(64 * h * 2)?,
        );
        // The uncaptured call first (kernels compiled, NCCL connected), then the capture.
        call(&mut mgr, &s, &d32.input, o32.ptr())?;
        s.synchronize()?;
        mgr.check_device_error(&s)?;
        let want32 = download(o32.ptr(), 32 * h * 2, &s)?;
        let graph = capture(&s, || call(&mut mgr, &s, &d32.input, o32.ptr()))?;
        call(&mut mgr, &s, &d64.input, o64.ptr())?;
        s.synchronize()?;
        mgr.check_device_error(&s)?;
        let got64 = num::to_f32(&download(o64.ptr(), 64 * h * 2, &s)?, bf);
        // SAFETY: a zero fill of our own output buffer.
        unsafe { driver::memset_d8_async(o32.ptr(), 0, 32 * h * 2, &s) }?;
        graph.launch(&s)?;
        let replay = download(o32.ptr(), 32 * h * 2, &s)?;
        let c64 = compare(&got64, &identity_reference(&i64_, 64, h, k), false, 2e-2);
        let c32 = compare(
            &num::to_f32(&replay, bf),
            &identity_reference(&i32_, 32, h, k),
            false,
            2e-2,
        );
        let after = mgr.stats();
        let pass = replay == want32
            && c64["pass"] == true
            && c32["pass"] == true
            && after.reallocations == 0;
        Ok(json!({"case": "capacity_graph_across_tokens",
            "replay_equal_to_uncaptured": replay == want32,
            "t64_vs_reference": c64, "replay_t32_vs_reference": c32,
            "pool_reserved_bytes": created.reserved_bytes,
            "pool_reallocations": after.reallocations, "pass": pass}))
    };
    let v = run().unwrap_or_else(
        |e| json!({"case": "capacity_graph_across_tokens", "pass": false, "error": e.to_string()}),
    );
    record(&v);
    v
}

/// `calls` random-routing dispatch + combine calls on one manager of `backend` (counts
/// mode, NCCL R = 1, M = 128): its pool's allocations after creation.
fn reallocations(backend: &str, calls: usize) -> Result<Value> {
    let _c = ctx()?;
    let s = Stream::create()?;
    let (h, k, e, m) = (1024usize, 8usize, 256usize, 128usize);
    let bf = FloatKind::Bf16;
    let cfg = config(e, k, h, m, bf, bf, bf);
    let mut mgr = GpuManager::new(backend, cfg, nccl_single()?, 0, GpuMode::Counts)?;
    let created = mgr.stats();
    let out = DeviceMemory::alloc(m * h * 2)?;
    let mut tokens = Vec::with_capacity(calls);
    for i in 0..calls as u64 {
        let t = 1 + (unit(0xa110c, i).abs() * m as f32) as usize % m;
        let inp = gen_inputs(1000 + i, t, h, k, e);
        let dev = device_inputs(&inp.x, &inp.ids, &inp.w, t, bf, &s)?;
        // The received rows stand in for the expert outputs (same shape and dtype).
        call(&mut mgr, &s, &dev.input, out.ptr())?;
        s.synchronize()?;
        tokens.push(t);
    }
    let after = mgr.stats();
    Ok(json!({"backend": backend, "calls": calls, "tokens": tokens,
        "pool_buffers": after.buffers, "pool_bytes": after.bytes,
        "pool_reserved_bytes": created.reserved_bytes,
        "pool_reallocations": after.reallocations, "pass": after.reallocations == 0}))
}

pub(super) fn pool_reallocations(quick: bool) -> Value {
    let calls = if quick { 20 } else { 50 };
    let per: Vec<Value> = LAYOUTS
        .iter()
        .map(|&(backend, _)| {
            reallocations(backend, calls).unwrap_or_else(
                |e| json!({"backend": backend, "pass": false, "error": e.to_string()}),
            )
        })
        .collect();
    let pass = per.iter().all(|p| p["pass"] == true);
    let v = json!({"case": "pool_reallocations", "calls_per_layout": calls, "layouts": per,
        "pass": pass});
    record(&v);
    v
}
