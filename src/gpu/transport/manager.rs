//! [`GpuManager`]: MoE dispatch/combine on device memory over NCCL (the counts and capacity
//! pipelines of docs/gpu.md), for every layout (docs/design.md, section 3), with the same
//! [`MoeConfig`] and the same row orders as the CPU [`Manager`] (source rank, then source token,
//! then k).
//!
//! Counts mode, per dispatch, all on the host's stream:
//! 1. `ep_layout` → this rank's counts row ([`plan`] module doc) + device error word;
//! 2. `ncclAllGather` of the rows;
//! 3. **the one host sync**: D2H of the gathered rows, event, wait (polling
//!    `ncclCommGetAsyncError`); refused on a capturing stream with
//!    [`crate::gpu::driver::CAPTURE_SYNC_MESSAGE`];
//! 4. scans → `ep_pack` (rows, wire ids/weights/source token, extras);
//! 5. one NCCL group of `ncclSend`/`ncclRecv` per buffer ([`counts_plan`]); self rows by
//!    `cuMemcpyDtoDAsync`;
//! 6. the layout's unpack kernel.
//!
//! Combine mirrors it with the transposed matrix: `ep_combine_return_*` on the expert rank,
//! the reverse exchange, then `ep_weighted_combine` (expert layouts) or `ep_sum_ranks`.
//!
//! Capacity mode ([`GpuMode::Capacity`], EXPERT_MAJOR only): no host sync, every size static,
//! so a dispatch+combine can be captured in a CUDA graph after one uncaptured warm-up call
//! (which also sizes every buffer: nothing is allocated in later calls with the same T).
//!
//! Status: compiled and clippy-clean, **never run on a GPU** (`scripts/gpu-check.sh` runs it).
#![allow(clippy::too_many_arguments)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::gpu::driver::{
    memcpy_dtod_async, memcpy_dtoh_async, memcpy_htod_async, memset_d8_async, Device, DeviceMemory,
    Event, PinnedHost, PrimaryContext, Stream,
};
use crate::gpu::kernels::{encode_error_word, FloatDtype, IdDtype, ERR_HOST_REJECTED, MAX_TOPK};
use crate::gpu::launch::{memset_d32_async, read_error_word, KernelConfig, Kernels};
use crate::gpu::nccl::plan::{counts_plan, ExchangeOptions, ExchangePlan};
use crate::gpu::nccl::{NcclComm, NcclDataType};
use crate::gpu::transport::local::local_copies;
use crate::gpu::transport::plan::{
    self, broadcast_plan, capacity_supported, combine_counts, counts_row_len, dispatch_shape,
    recv_offsets, row_expert_counts, scan_scratch_elems, DispatchShape, Gathered, ShapeGeometry,
    ROW_ERROR, ROW_RANK_COUNTS,
};
use crate::gpu::transport::Fabric;
use crate::moe::{Manager, MoeConfig};
use crate::num::FloatKind;
use crate::select::all2all::{Backend, Layout};

/// How counts travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuMode {
    /// Exact sizes; one host sync per dispatch for the counts.
    Counts,
    /// Fixed capacity (M tokens per rank), no host sync, CUDA-graph capturable
    /// (EXPERT_MAJOR only).
    Capacity,
}

/// One dispatch's device inputs (addresses on the manager's device).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchInput {
    /// `[T, hidden]` rows of the configured hidden dtype.
    pub hidden: u64,
    /// `[T, K]` ids.
    pub topk_ids: u64,
    /// dtype of `topk_ids`.
    pub id_dtype: IdDtype,
    /// `[T, K]` float32.
    pub topk_weights: u64,
    /// T.
    pub tokens: usize,
    /// `[T, extra_row_bytes[i]]` per extra payload.
    pub extras: Vec<u64>,
}

/// A dispatch result: device addresses of buffers the manager owns (valid until its next
/// dispatch), shaped as [`DispatchShape`] says. 0 = not produced by this layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDispatch {
    /// Shapes; in capacity mode `received_rows` is unknown on the host (`counts` on the
    /// device has it) and set to `usize::MAX`.
    pub shape: DispatchShape,
    /// Rows (`shape.hidden`).
    pub hidden: u64,
    /// int64 ids.
    pub topk_ids: u64,
    /// float32 weights.
    pub topk_weights: u64,
    /// int32 counts.
    pub counts: u64,
    /// int32 EXPERT_PACKED offsets `[E_local + 1]` (int32 on the GPU path).
    pub expert_offsets: u64,
    /// int32 source rank per row (EXPERT_PACKED).
    pub src_rank: u64,
    /// int32 source token per row (EXPERT_PACKED).
    pub src_token: u64,
    /// Extra payloads, laid out like `hidden`.
    pub extras: Vec<u64>,
}

/// Grow-only named device buffers (stable addresses once sized, which CUDA graphs need).
#[derive(Debug, Default)]
struct Pool {
    dev: HashMap<String, DeviceMemory>,
    host: HashMap<&'static str, PinnedHost>,
}

impl Pool {
    /// A buffer of at least `bytes`. Growing frees the old allocation (`cuMemFree`, which
    /// waits for the device work still using it, as `cudaFree` does), so sizes settle after the
    /// first calls; CUDA-graph capture must come after a call of the same size.
    /// The row payloads of a dispatch (hidden, then each extra), as (received rows, row
    /// bytes, output buffer `out_rows{i}` of `rows` rows); `widths`/`recvs` are the exchange
    /// items (rows, ids, weights, sources, then the extras).
    fn payload_outputs(
        &mut self,
        widths: &[usize],
        recvs: &[u64],
        rows: usize,
    ) -> Result<Vec<(u64, usize, u64)>> {
        widths
            .iter()
            .enumerate()
            .filter(|(i, _)| *i == 0 || *i >= 4)
            .map(|(i, &w)| Ok((recvs[i], w, self.get(&format!("out_rows{i}"), rows * w)?)))
            .collect()
    }

    fn get(&mut self, name: &str, bytes: usize) -> Result<u64> {
        let bytes = bytes.max(16).next_multiple_of(256);
        if let Some(m) = self.dev.get(name) {
            if m.bytes() >= bytes {
                return Ok(m.ptr());
            }
        }
        let m = DeviceMemory::alloc(bytes)?;
        let p = m.ptr();
        self.dev.insert(name.to_owned(), m);
        Ok(p)
    }

    fn host(&mut self, name: &'static str, bytes: usize) -> Result<*mut u8> {
        let bytes = bytes.max(16);
        if let Some(m) = self.host.get(name) {
            if m.bytes() >= bytes {
                return Ok(m.ptr().cast());
            }
        }
        let m = PinnedHost::alloc(bytes)?;
        let p = m.ptr().cast();
        self.host.insert(name, m);
        Ok(p)
    }
}

/// What combine needs from the dispatch before it.
#[derive(Debug, Clone)]
struct State {
    tokens: usize,
    id_dtype: IdDtype,
    /// Received rows (N) of the wire buffer.
    n_recv: usize,
    gathered: Option<Gathered>,
    shape: DispatchShape,
}

/// The GPU all2all manager: one NCCL communicator, one device, one configuration. Used by one
/// thread at a time, like the communicator.
pub struct GpuManager {
    cpu: Manager,
    comm: Box<dyn Fabric>,
    ctx: PrimaryContext,
    device: Device,
    mode: GpuMode,
    expert: FloatDtype,
    out: FloatDtype,
    kernels: HashMap<IdDtype, Kernels>,
    pool: Pool,
    state: Option<State>,
    opts: ExchangeOptions,
    /// Bound on the counts wait.
    pub timeout: Duration,
}

impl Drop for GpuManager {
    fn drop(&mut self) {
        // The buffers are freed (cuMemFree) right after this, in this context: make it current
        // on the dropping thread, which may not be the one that used the manager.
        let _ = self.ctx.set_current();
    }
}

impl std::fmt::Debug for GpuManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuManager")
            .field("backend", &self.cpu.backend())
            .field("rank", &self.comm.rank())
            .field("world", &self.comm.world())
            .field("mode", &self.mode)
            .finish()
    }
}

fn float(k: FloatKind) -> FloatDtype {
    match k {
        FloatKind::F32 => FloatDtype::F32,
        FloatKind::Bf16 => FloatDtype::Bf16,
        FloatKind::F16 => FloatDtype::F16,
    }
}

fn to_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::InvalidArgument(format!(
            "{what} is {v}: the GPU kernels index with 32-bit ints (at most {})",
            i32::MAX
        ))
    })
}

impl GpuManager {
    /// A manager for `backend` over `comm` (whose rank/world are the EP group's) on CUDA
    /// device `device`. Validates like the CPU [`Manager`] (same messages, same
    /// `Using … all2all manager.` info) and refuses what the GPU path does not do.
    pub fn new(
        backend: &str,
        cfg: MoeConfig,
        comm: Box<dyn Fabric>,
        device: usize,
        mode: GpuMode,
    ) -> Result<GpuManager> {
        let cpu = Manager::new(backend, cfg.clone(), comm.rank(), comm.world())?;
        if cfg.apply_router_weight_on_input {
            return Err(Error::NotImplemented(
                "apply_router_weight_on_input is not implemented on the GPU path yet; scale the hidden rows before dispatch".into(),
            ));
        }
        if cfg.top_k as u32 > MAX_TOPK {
            return Err(Error::InvalidArgument(format!(
                "top_k is {}: the GPU kernels support at most {MAX_TOPK}",
                cfg.top_k
            )));
        }
        if cpu.backend() == Backend::Moonep {
            return Err(Error::MoonEpUnavailable);
        }
        if mode == GpuMode::Capacity && !capacity_supported(cpu.layout()) {
            return Err(Error::NotImplemented(format!(
                "capacity mode (no host sync, CUDA graphs) is implemented for the EXPERT_MAJOR layout only (deepep_low_latency, nixl_ep); {} uses {}",
                cpu.backend().name(),
                cpu.layout().name()
            )));
        }
        if mode == GpuMode::Capacity && cfg.max_tokens_per_rank == 0 {
            return Err(Error::InvalidArgument(
                "capacity mode needs max_tokens_per_rank > 0".into(),
            ));
        }
        plan::check_index_limits(
            comm.world(),
            cfg.num_experts,
            cfg.top_k,
            cfg.hidden,
            cfg.max_tokens_per_rank,
        )?;
        let dev = Device::get(device)?;
        let ctx = PrimaryContext::retain(dev)?;
        ctx.set_current()?;
        let opts = ExchangeOptions {
            zero_size_p2p: comm.zero_size_p2p(),
            self_via_nccl: false,
        };
        Ok(GpuManager {
            expert: float(cfg.expert_dtype),
            out: float(cfg.out_dtype),
            cpu,
            comm,
            ctx,
            device: dev,
            mode,
            kernels: HashMap::new(),
            pool: Pool::default(),
            state: None,
            opts,
            timeout: Duration::from_secs(300),
        })
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.cpu.backend()
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        self.cpu.layout()
    }

    /// The configuration.
    pub fn config(&self) -> &MoeConfig {
        self.cpu.config()
    }

    /// The mode.
    pub fn mode(&self) -> GpuMode {
        self.mode
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.comm.world()
    }

    /// The transport.
    pub fn fabric(&self) -> &dyn Fabric {
        self.comm.as_ref()
    }

    /// Tokens (T) of the last dispatch: combine's output has this many rows.
    pub fn last_tokens(&self) -> Option<usize> {
        self.state.as_ref().map(|s| s.tokens)
    }

    /// The shape of the last dispatch.
    pub fn last_shape(&self) -> Option<&DispatchShape> {
        self.state.as_ref().map(|s| &s.shape)
    }

    fn kernels(&mut self, id: IdDtype) -> Result<Kernels> {
        if let Some(k) = self.kernels.get(&id) {
            return Ok(k.clone());
        }
        let k = Kernels::load(
            &self.device,
            KernelConfig {
                id_dtype: id,
                top_k: self.cpu.config().top_k as u32,
                expert_dtype: self.expert,
                out_dtype: self.out,
            },
        )?;
        self.kernels.insert(id, k.clone());
        Ok(k)
    }

    /// Compiles and loads the kernels for `id` now (group creation time, not the hot path).
    pub fn warm_kernels(&mut self, id: IdDtype) -> Result<()> {
        self.ctx.set_current()?;
        self.kernels(id).map(|_| ())
    }

    fn row_bytes(&self) -> usize {
        let c = self.cpu.config();
        c.hidden * (c.hidden_dtype.bits as usize / 8)
    }

    fn expert_row_bytes(&self) -> usize {
        let c = self.cpu.config();
        c.hidden * c.expert_dtype.size()
    }

    fn geometry(&self) -> ShapeGeometry {
        let c = self.cpu.config();
        ShapeGeometry {
            world: self.world(),
            rank: self.rank(),
            num_experts: c.num_experts,
            top_k: c.top_k,
            hidden: c.hidden,
            max_tokens_per_rank: c.max_tokens_per_rank,
        }
    }

    /// Issues the grouped exchanges and the self copies.
    fn exchange(&self, s: &Stream, items: &[(ExchangePlan, u64, u64)]) -> Result<()> {
        // SAFETY: every buffer was sized from its plan (send_bytes / recv_bytes) on this
        // device; `s` is a live stream of it.
        unsafe { self.comm.exchange(items, s) }
    }

    /// Waits for `ev`, polling NCCL's async error, bounded by [`GpuManager::timeout`].
    fn wait(&self, ev: &Event) -> Result<()> {
        let start = Instant::now();
        loop {
            if ev.query()? {
                return Ok(());
            }
            self.comm.poll()?;
            if start.elapsed() > self.timeout {
                return Err(Error::Timeout(format!(
                    "GPU dispatch: the counts all-gather did not complete within {:?} (a peer rank is not participating?)",
                    self.timeout
                )));
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Dispatch (collective). `stream` is the host's stream on this manager's device; every
    /// kernel and transfer is enqueued on it. Counts mode syncs the host once (see the module
    /// doc); capacity mode never does.
    pub fn dispatch(&mut self, stream: &Stream, input: &DispatchInput) -> Result<GpuDispatch> {
        self.ctx.set_current()?;
        self.state = None;
        let cfg = self.cpu.config().clone();
        if input.extras.len() != cfg.extra_row_bytes.len() {
            let e = Error::InvalidArgument(format!(
                "{} extra payloads given, the manager was created for {}",
                input.extras.len(),
                cfg.extra_row_bytes.len()
            ));
            return Err(self.reject_dispatch(stream, e));
        }
        let (r, k, e) = (self.world(), cfg.top_k, cfg.num_experts);
        let checked = to_i32(
            input
                .tokens
                .saturating_mul(r)
                .saturating_mul(k)
                .saturating_add(1),
            "tokens x world_size x top_k",
        )
        .and_then(|_| to_i32(e, "num_experts"))
        .and_then(|_| self.kernels(input.id_dtype));
        let kern = match checked {
            Ok(k) => k,
            Err(e) => return Err(self.reject_dispatch(stream, e)),
        };
        let out = match self.mode {
            GpuMode::Counts => self.dispatch_counts(stream, input, &kern)?,
            GpuMode::Capacity => self.dispatch_capacity(stream, input, &kern)?,
        };
        Ok(out)
    }

    /// Returns `err` after telling the peers (counts mode) that this rank's dispatch input was
    /// rejected before the counts all-gather: it takes part in the all-gather with a counts
    /// row of T = 0 carrying the host-made error word [`ERR_HOST_REJECTED`], so every peer
    /// returns "rank r rejected its dispatch input" instead of waiting for it (what the CPU
    /// path's `reject_dispatch` does). Capacity mode and a capturing stream have no host-side
    /// exchange to carry it: there the peers are not told (docs/gpu.md, "Not done").
    pub fn reject_dispatch(&mut self, stream: &Stream, err: Error) -> Error {
        self.state = None;
        if self.mode == GpuMode::Counts
            && stream.ensure_not_capturing().is_ok()
            && self.ctx.set_current().is_ok()
        {
            let _ = self.send_rejection(stream);
        }
        err
    }

    fn send_rejection(&mut self, s: &Stream) -> Result<()> {
        let (r, e) = (self.world(), self.cpu.config().num_experts);
        let row_len = counts_row_len(r, e);
        let word = encode_error_word(ERR_HOST_REJECTED, 0, 0);
        let p = &mut self.pool;
        let row = p.get("counts_row", 4 * row_len)?;
        let all = p.get("counts_all", 4 * row_len * r)?;
        let h_row = p.host("h_reject", 4 * row_len)?;
        let h_all = p.host("h_counts", 4 * row_len * r)?;
        // SAFETY: h_row holds row_len int32 (pinned, owned by the pool; its previous use ended
        // with the previous call's host sync); device buffers sized above.
        unsafe {
            let v = std::slice::from_raw_parts_mut(h_row.cast::<i32>(), row_len);
            v.fill(0);
            v[ROW_ERROR] = word as u32 as i32;
            v[ROW_ERROR + 1] = (word >> 32) as u32 as i32;
            memcpy_htod_async(row, h_row.cast(), 4 * row_len, s)?;
            self.comm.all_gather_i32(row, all, row_len, s)?;
            memcpy_dtoh_async(h_all.cast(), all, 4 * row_len * r, s)?;
        }
        let ev = Event::new(false)?;
        ev.record(s)?;
        self.wait(&ev)
    }

    fn dispatch_counts(
        &mut self,
        s: &Stream,
        inp: &DispatchInput,
        kern: &Kernels,
    ) -> Result<GpuDispatch> {
        // The one host sync of counts mode is impossible inside a graph capture.
        s.ensure_not_capturing()?;
        let cfg = self.cpu.config().clone();
        let layout = self.layout();
        let (r, d, k, e) = (self.world(), self.rank(), cfg.top_k, cfg.num_experts);
        let el = e / r;
        let t = inp.tokens;
        let rb = self.row_bytes();
        let row_len = counts_row_len(r, e);
        let p = &mut self.pool;
        let row = p.get("counts_row", 4 * row_len)?;
        let all = p.get("counts_all", 4 * row_len * r)?;
        let err = p.get("err", 8)?;
        let rank_flag = p.get("rank_flag", 4 * r * t)?;
        let expert_layout = matches!(layout, Layout::ExpertMajor | Layout::ExpertPacked);
        let pair_flag = if expert_layout {
            p.get("pair_flag", 4 * r * t * k)?
        } else {
            0
        };
        let h_t = p.host("h_tokens", 4)?;
        let h_all = p.host("h_counts", 4 * row_len * r)?;
        // SAFETY (this block): every device range was sized above; pinned host memory lives
        // in the pool (its previous use ended with the previous call's host sync).
        unsafe {
            memset_d8_async(row, 0, 4 * row_len, s)?;
            memset_d8_async(err, 0, 8, s)?;
            h_t.cast::<i32>().write(t as i32);
            memcpy_htod_async(row, h_t.cast(), 4, s)?;
        }
        kern.run(
            &kern.calls().layout(
                inp.topk_ids,
                t as i32,
                e as i32,
                el as i32,
                r as i32,
                rank_flag,
                pair_flag,
                row + 4 * ROW_RANK_COUNTS as u64,
                row + 4 * row_expert_counts(r) as u64,
                err,
            ),
            s,
        )?;
        // SAFETY: err (8 bytes) into the row's two error slots; all/h_all sized for R rows.
        unsafe {
            memcpy_dtod_async(row + 4 * ROW_ERROR as u64, err, 8, s)?;
            self.comm.all_gather_i32(row, all, row_len, s)?;
            memcpy_dtoh_async(h_all.cast(), all, 4 * row_len * r, s)?;
        }
        let ev = Event::new(false)?;
        ev.record(s)?;
        self.wait(&ev)?;
        // SAFETY: the copy completed (event); the pinned buffer holds row_len * r int32.
        let raw = unsafe { std::slice::from_raw_parts(h_all.cast::<i32>(), row_len * r) };
        let g = Gathered::parse(raw, r, e)?;
        g.check(d)?;
        let shape = dispatch_shape(layout, &self.geometry(), &g)?;

        let replicated = layout == Layout::Replicated;
        let matrix = if replicated {
            g.replicated_counts()
        } else {
            g.rank_counts.clone()
        };
        let p = &mut self.pool;
        // Send side. REPLICATED packs each token once (R = 1, every flag set) and broadcasts.
        let (pack_r, flags) = if replicated {
            let ones = p.get("ones_t", 4 * t)?;
            // SAFETY: t int32.
            unsafe { memset_d32_async(ones, 1, t, s) }?;
            (1usize, ones)
        } else {
            (r, rank_flag)
        };
        let n_send: usize = if replicated {
            t
        } else {
            (0..r).map(|x| matrix[d * r + x] as usize).sum()
        };
        let n_recv: usize = (0..r).map(|x| matrix[x * r + d] as usize).sum();
        let scan_n = (pack_r * t).max(r * t * k).max(el * n_recv).max(n_recv * k);
        let scratch = p.get("scan_scratch", 4 * scan_scratch_elems(scan_n))?;
        let send_pos = p.get("send_pos", 4 * (pack_r * t + 1))?;
        kern.run(&kern.calls().scan(flags, send_pos, pack_r * t, scratch), s)?;
        let widths: Vec<usize> = [rb, 4 * k, 4 * k, 4]
            .into_iter()
            .chain(cfg.extra_row_bytes.iter().copied())
            .collect();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for (i, w) in widths.iter().enumerate() {
            sends.push(p.get(&format!("send{i}"), n_send * w)?);
            recvs.push(p.get(&format!("recv{i}"), n_recv * w)?);
        }
        kern.run(
            &kern.calls().pack(
                inp.hidden,
                rb as u64,
                inp.topk_ids,
                inp.topk_weights,
                t as i32,
                pack_r as i32,
                flags,
                send_pos,
                sends[0],
                sends[1],
                sends[2],
                sends[3],
            ),
            s,
        )?;
        for (i, &x) in inp.extras.iter().enumerate() {
            kern.run(
                &kern.calls().pack(
                    x,
                    cfg.extra_row_bytes[i] as u64,
                    0,
                    0,
                    t as i32,
                    pack_r as i32,
                    flags,
                    send_pos,
                    sends[4 + i],
                    0,
                    0,
                    0,
                ),
                s,
            )?;
        }
        let mut items = Vec::new();
        for (i, &w) in widths.iter().enumerate() {
            let plan = if replicated {
                broadcast_plan(&g.tokens, d, w, self.opts.zero_size_p2p)
            } else {
                counts_plan(&matrix, r, d, w, self.opts)?
            };
            items.push((plan, sends[i], recvs[i]));
        }
        self.exchange(s, &items)?;

        // Receive side.
        let p = &mut self.pool;
        let offsets = recv_offsets(&matrix, r, d);
        let d_off = p.get("recv_offsets", 4 * (r + 1))?;
        let h_off = p.host("h_offsets", 4 * (r + 1))?;
        // SAFETY: r + 1 int32 in both; the pinned copy stays until the next call's sync.
        unsafe {
            std::ptr::copy_nonoverlapping(offsets.as_ptr(), h_off.cast::<i32>(), r + 1);
            memcpy_htod_async(d_off, h_off.cast(), 4 * (r + 1), s)?;
        }
        let (rows, ids, w, src) = (recvs[0], recvs[1], recvs[2], recvs[3]);
        let n = n_recv as i32;
        let m = cfg.max_tokens_per_rank;
        let mut o = GpuDispatch {
            shape: shape.clone(),
            hidden: rows,
            topk_ids: 0,
            topk_weights: 0,
            counts: 0,
            expert_offsets: 0,
            src_rank: 0,
            src_token: 0,
            extras: recvs[4..].to_vec(),
        };
        match layout {
            Layout::Replicated | Layout::TokenMajor => {
                let out_ids = p.get("out_ids", 8 * n_recv * k)?;
                let out_w = p.get("out_w", 4 * n_recv * k)?;
                let (el_u, rank_u) = if replicated {
                    (e, 0)
                } else {
                    let counts = p.get("out_counts", 4 * el)?;
                    // SAFETY: el int32.
                    unsafe { memset_d8_async(counts, 0, 4 * el, s) }?;
                    kern.run(
                        &kern
                            .calls()
                            .recv_flags(ids, n, el as i32, d as i32, 0, 0, counts),
                        s,
                    )?;
                    o.counts = counts;
                    (el, d)
                };
                kern.run(
                    &kern.calls().unpack_token_major(
                        rows,
                        ids,
                        w,
                        n,
                        rb as u64,
                        el_u as i32,
                        rank_u as i32,
                        0,
                        out_ids,
                        out_w,
                    ),
                    s,
                )?;
                o.topk_ids = out_ids;
                // REPLICATED is an all-gather: weights arrive unchanged (a masked id keeps its
                // weight, as on the CPU path); TOKEN_MAJOR zeroes the non-local ones.
                o.topk_weights = if replicated { w } else { out_w };
            }
            Layout::ExpertMajor | Layout::ExpertPacked => {
                let eflag = p.get("expert_flag", 4 * el * n_recv)?;
                let epos = p.get("expert_pos", 4 * (el * n_recv + 1))?;
                let rpflag = p.get("recv_pair_flag", 4 * n_recv * k)?;
                let rppos = p.get("recv_pair_pos", 4 * (n_recv * k + 1))?;
                kern.run(
                    &kern
                        .calls()
                        .recv_flags(ids, n, el as i32, d as i32, eflag, rpflag, 0),
                    s,
                )?;
                kern.run(&kern.calls().scan(eflag, epos, el * n_recv, scratch), s)?;
                kern.run(&kern.calls().scan(rpflag, rppos, n_recv * k, scratch), s)?;
                let recv5 = [rows, ids, w, src, d_off];
                if layout == Layout::ExpertMajor {
                    let cap = m * r;
                    let counts = p.get("out_counts", 4 * el)?;
                    let outs = p.payload_outputs(&widths, &recvs, el * cap)?;
                    for &(src_rows, wb, out_rows) in &outs {
                        let mut r5 = recv5;
                        r5[0] = src_rows;
                        kern.run(
                            &kern.calls().unpack_expert_major(
                                r5, n, r as i32, wb as u64, el as i32, d as i32, eflag, epos,
                                cap as i32, out_rows, counts, 0, 0, 0, err,
                            ),
                            s,
                        )?;
                    }
                    o.hidden = outs[0].2;
                    o.extras = outs[1..].iter().map(|o| o.2).collect();
                    o.counts = counts;
                } else {
                    let nr = shape.received_rows;
                    let offs = p.get("out_offsets", 4 * (el + 1))?;
                    let out_w = p.get("out_w", 4 * nr)?;
                    let sr = p.get("out_src_rank", 4 * nr)?;
                    let st = p.get("out_src_token", 4 * nr)?;
                    let outs = p.payload_outputs(&widths, &recvs, nr)?;
                    for &(src_rows, wb, out_rows) in &outs {
                        let mut r5 = recv5;
                        r5[0] = src_rows;
                        kern.run(
                            &kern.calls().unpack_expert_packed(
                                r5, n, r as i32, wb as u64, el as i32, d as i32, eflag, epos,
                                out_rows, offs, out_w, sr, st,
                            ),
                            s,
                        )?;
                    }
                    o.hidden = outs[0].2;
                    o.extras = outs[1..].iter().map(|o| o.2).collect();
                    o.expert_offsets = offs;
                    o.topk_weights = out_w;
                    o.src_rank = sr;
                    o.src_token = st;
                }
                // Source side of combine: where each (t, k) result will land.
                let ppos = p.get("pair_pos", 4 * (r * t * k + 1))?;
                let crow = p.get("combine_rows", 4 * t * k)?;
                let wcopy = p.get("weights_copy", 4 * t * k)?;
                kern.run(&kern.calls().scan(pair_flag, ppos, r * t * k, scratch), s)?;
                kern.run(
                    &kern.calls().pair_rows(
                        false,
                        inp.topk_ids,
                        t as i32,
                        e as i32,
                        el as i32,
                        ppos,
                        crow,
                    ),
                    s,
                )?;
                if t * k > 0 {
                    // SAFETY: t*k f32 in both.
                    unsafe { memcpy_dtod_async(wcopy, inp.topk_weights, 4 * t * k, s) }?;
                }
            }
            Layout::RankMajor => {
                let out_ids = p.get("out_ids", 8 * r * m * k)?;
                let out_w = p.get("out_w", 4 * r * m * k)?;
                let counts = p.get("out_counts", 4 * r)?;
                let outs = p.payload_outputs(&widths, &recvs, r * m)?;
                for &(src_rows, wb, out_rows) in &outs {
                    kern.run(
                        &kern.calls().unpack_rank_major(
                            src_rows, ids, w, d_off, r as i32, m as i32, wb as u64, out_rows,
                            out_ids, out_w, counts, err,
                        ),
                        s,
                    )?;
                }
                o.hidden = outs[0].2;
                o.extras = outs[1..].iter().map(|o| o.2).collect();
                o.topk_ids = out_ids;
                o.topk_weights = out_w;
                o.counts = counts;
            }
            Layout::MoonepSlots => return Err(Error::MoonEpUnavailable),
        }
        self.state = Some(State {
            tokens: t,
            id_dtype: inp.id_dtype,
            n_recv,
            gathered: Some(g),
            shape,
        });
        Ok(o)
    }

    fn dispatch_capacity(
        &mut self,
        s: &Stream,
        inp: &DispatchInput,
        kern: &Kernels,
    ) -> Result<GpuDispatch> {
        let cfg = self.cpu.config().clone();
        let (r, d, k, e) = (self.world(), self.rank(), cfg.top_k, cfg.num_experts);
        let el = e / r;
        let (t, m) = (inp.tokens, cfg.max_tokens_per_rank);
        if t > m {
            return Err(Error::InvalidArgument(format!(
                "rank {d} dispatches {t} tokens, more than max_tokens_per_rank = {m}"
            )));
        }
        let rb = self.row_bytes();
        let n = r * m;
        let p = &mut self.pool;
        let err = p.get("err", 8)?;
        let ones = p.get("cap_ones", 4 * n * k)?;
        let iota = p.get("cap_iota", 4 * (n * k + 1))?;
        let mvals = p.get("cap_mvals", 4 * r)?;
        let d_off = p.get("cap_offsets", 4 * (r + 1))?;
        let dummy = p.get("cap_rank_flag", 4 * r * t)?;
        let scratch = p.get(
            "scan_scratch_cap",
            4 * scan_scratch_elems(n * k * el.max(1)),
        )?;
        // SAFETY (this block): every range was sized above.
        unsafe {
            memset_d8_async(err, 0, 8, s)?;
            memset_d32_async(ones, 1, n * k, s)?;
            memset_d32_async(mvals, m as u32, r, s)?;
        }
        kern.run(&kern.calls().scan(ones, iota, n * k, scratch), s)?;
        kern.run(&kern.calls().scan(mvals, d_off, r, scratch), s)?;
        // Validation only (bad ids → error word; read it with check_device_error).
        kern.run(
            &kern.calls().layout(
                inp.topk_ids,
                t as i32,
                e as i32,
                el as i32,
                r as i32,
                dummy,
                0,
                0,
                0,
                err,
            ),
            s,
        )?;
        let widths: Vec<usize> = [rb, 4 * k, 4 * k, 4]
            .into_iter()
            .chain(cfg.extra_row_bytes.iter().copied())
            .collect();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for (i, w) in widths.iter().enumerate() {
            sends.push(p.get(&format!("cap_send{i}"), m * w)?);
            recvs.push(p.get(&format!("cap_recv{i}"), n * w)?);
        }
        // Padding rows: ids -1 (0xff bytes), weights 0.
        // SAFETY: m*k int32/f32.
        unsafe {
            memset_d8_async(sends[1], 0xff, 4 * m * k, s)?;
            memset_d8_async(sends[2], 0, 4 * m * k, s)?;
        }
        kern.run(
            &kern.calls().pack(
                inp.hidden,
                rb as u64,
                inp.topk_ids,
                inp.topk_weights,
                t as i32,
                1,
                ones,
                iota,
                sends[0],
                sends[1],
                sends[2],
                sends[3],
            ),
            s,
        )?;
        for (i, &x) in inp.extras.iter().enumerate() {
            kern.run(
                &kern.calls().pack(
                    x,
                    cfg.extra_row_bytes[i] as u64,
                    0,
                    0,
                    t as i32,
                    1,
                    ones,
                    iota,
                    sends[4 + i],
                    0,
                    0,
                    0,
                ),
                s,
            )?;
        }
        let rows_per = vec![m; r];
        let items: Vec<_> = widths
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                (
                    broadcast_plan(&rows_per, d, w, self.opts.zero_size_p2p),
                    sends[i],
                    recvs[i],
                )
            })
            .collect();
        self.exchange(s, &items)?;
        let p = &mut self.pool;
        let eflag = p.get("cap_expert_flag", 4 * el * n)?;
        let epos = p.get("cap_expert_pos", 4 * (el * n + 1))?;
        let counts = p.get("cap_counts", 4 * el)?;
        kern.run(
            &kern
                .calls()
                .recv_flags(recvs[1], n as i32, el as i32, d as i32, eflag, 0, 0),
            s,
        )?;
        kern.run(&kern.calls().scan(eflag, epos, el * n, scratch), s)?;
        let cap = m * r;
        let mut outs = Vec::new();
        for (j, src_rows) in [recvs[0]].iter().chain(&recvs[4..]).enumerate() {
            let wb = if j == 0 {
                rb
            } else {
                cfg.extra_row_bytes[j - 1]
            };
            let out_rows = p.get(&format!("cap_out{j}"), el * cap * wb)?;
            kern.run(
                &kern.calls().unpack_expert_major(
                    [*src_rows, recvs[1], recvs[2], recvs[3], d_off],
                    n as i32,
                    r as i32,
                    wb as u64,
                    el as i32,
                    d as i32,
                    eflag,
                    epos,
                    cap as i32,
                    out_rows,
                    counts,
                    0,
                    0,
                    0,
                    err,
                ),
                s,
            )?;
            outs.push(out_rows);
        }
        // Source side of combine: row of (t, k) = owner·M·K + t·K + k (fixed slabs).
        let crow = p.get("cap_combine_rows", 4 * m * k)?;
        let wcopy = p.get("cap_weights", 4 * m * k)?;
        kern.run(
            &kern
                .calls()
                .pair_rows(true, sends[1], m as i32, e as i32, el as i32, iota, crow),
            s,
        )?;
        // SAFETY: the padded weights slab (m*k f32).
        unsafe { memcpy_dtod_async(wcopy, sends[2], 4 * m * k, s) }?;
        let mut shape = plan::DispatchShape {
            layout: Layout::ExpertMajor,
            received_rows: usize::MAX,
            buffer_rows: el * cap,
            hidden: vec![el, cap, cfg.hidden],
            topk_ids: Vec::new(),
            topk_weights: Vec::new(),
            counts: el,
            expert_offsets: 0,
            src: 0,
        };
        shape.received_rows = usize::MAX;
        self.state = Some(State {
            tokens: t,
            id_dtype: inp.id_dtype,
            n_recv: n,
            gathered: None,
            shape: shape.clone(),
        });
        Ok(GpuDispatch {
            shape,
            hidden: outs[0],
            topk_ids: 0,
            topk_weights: 0,
            counts,
            expert_offsets: 0,
            src_rank: 0,
            src_token: 0,
            extras: outs[1..].to_vec(),
        })
    }

    /// Reads the device error word of the last call (a host sync): capacity mode's way to
    /// learn about bad ids or full buckets, which it cannot check without syncing.
    pub fn check_device_error(&mut self, stream: &Stream) -> Result<()> {
        self.ctx.set_current()?;
        let err = self.pool.get("err", 8)?;
        read_error_word(err, stream)
    }

    /// Combine (collective): `expert_output` has the dispatch buffer's rows
    /// (`shape.buffer_rows` × hidden, expert dtype), `out` gets `[T, hidden]` of the out dtype.
    pub fn combine(&mut self, stream: &Stream, expert_output: u64, out: u64) -> Result<()> {
        self.ctx.set_current()?;
        let st = self.state.clone().ok_or_else(|| {
            Error::InvalidState("combine called without a dispatch before it".into())
        })?;
        let kern = self.kernels(st.id_dtype)?;
        let cfg = self.cpu.config().clone();
        let layout = self.layout();
        let (r, d, k, e) = (self.world(), self.rank(), cfg.top_k, cfg.num_experts);
        let el = e / r;
        let (t, h) = (st.tokens, cfg.hidden);
        let erb = self.expert_row_bytes();
        let n = st.n_recv;
        if self.mode == GpuMode::Capacity {
            let m = cfg.max_tokens_per_rank;
            let p = &mut self.pool;
            let send = p.get("cap_comb_send", r * m * k * erb)?;
            let recv = p.get("cap_comb_recv", r * m * k * erb)?;
            let ids = p.get("cap_recv1", 0)?;
            let epos = p.get("cap_expert_pos", 0)?;
            let iota = p.get("cap_iota", 0)?;
            let crow = p.get("cap_combine_rows", 0)?;
            let w = p.get("cap_weights", 0)?;
            kern.run(
                &kern.calls().combine_return_expert(
                    expert_output,
                    erb as u64,
                    ids,
                    n as i32,
                    el as i32,
                    d as i32,
                    epos,
                    (m * r) as i32,
                    iota,
                    send,
                ),
                stream,
            )?;
            let cm = vec![(m * k) as i32; r * r];
            let plan = counts_plan(&cm, r, d, erb, self.opts)?;
            self.exchange(stream, &[(plan, send, recv)])?;
            return kern.run(
                &kern
                    .calls()
                    .weighted_combine(recv, crow, w, t as i32, h as i32, out),
                stream,
            );
        }
        let g = st
            .gathered
            .as_ref()
            .ok_or_else(|| Error::Internal("counts-mode state without counts".into()))?;
        let cm = combine_counts(layout, g);
        let n_back: usize = (0..r).map(|x| cm[d * r + x] as usize).sum();
        let n_home: usize = (0..r).map(|x| cm[x * r + d] as usize).sum();
        let p = &mut self.pool;
        let recv = p.get("comb_recv", n_home * erb)?;
        let send = match layout {
            Layout::Replicated | Layout::TokenMajor => expert_output,
            Layout::RankMajor => {
                let send = p.get("comb_send", n_back * erb)?;
                let d_off = p.get("recv_offsets", 4 * (r + 1))?;
                kern.run(
                    &kern.calls().combine_return_rank_major(
                        expert_output,
                        erb as u64,
                        d_off,
                        r as i32,
                        cfg.max_tokens_per_rank as i32,
                        send,
                    ),
                    stream,
                )?;
                send
            }
            Layout::ExpertMajor | Layout::ExpertPacked => {
                let send = p.get("comb_send", n_back * erb)?;
                let ids = p.get("recv1", 0)?;
                let epos = p.get("expert_pos", 0)?;
                let rppos = p.get("recv_pair_pos", 0)?;
                let cap = if layout == Layout::ExpertMajor {
                    cfg.max_tokens_per_rank * r
                } else {
                    0
                };
                kern.run(
                    &kern.calls().combine_return_expert(
                        expert_output,
                        erb as u64,
                        ids,
                        n as i32,
                        el as i32,
                        d as i32,
                        epos,
                        cap as i32,
                        rppos,
                        send,
                    ),
                    stream,
                )?;
                send
            }
            Layout::MoonepSlots => return Err(Error::MoonEpUnavailable),
        };
        let plan = counts_plan(&cm, r, d, erb, self.opts)?;
        self.exchange(stream, &[(plan, send, recv)])?;
        let p = &mut self.pool;
        match layout {
            Layout::Replicated => kern.run(
                &kern
                    .calls()
                    .sum_ranks(recv, 0, 0, t as i32, r as i32, h as i32, out),
                stream,
            ),
            Layout::TokenMajor | Layout::RankMajor => {
                let flag = p.get("rank_flag", 0)?;
                let pos = p.get("send_pos", 0)?;
                kern.run(
                    &kern
                        .calls()
                        .sum_ranks(recv, flag, pos, t as i32, r as i32, h as i32, out),
                    stream,
                )
            }
            _ => {
                let crow = p.get("combine_rows", 0)?;
                let w = p.get("weights_copy", 0)?;
                kern.run(
                    &kern
                        .calls()
                        .weighted_combine(recv, crow, w, t as i32, h as i32, out),
                    stream,
                )
            }
        }
    }
}

impl Fabric for NcclComm {
    fn rank(&self) -> usize {
        NcclComm::rank(self)
    }

    fn world(&self) -> usize {
        NcclComm::world(self)
    }

    fn zero_size_p2p(&self) -> bool {
        ExchangeOptions::for_version(self.api().version).zero_size_p2p
    }

    unsafe fn all_gather_i32(&self, send: u64, recv: u64, count: usize, s: &Stream) -> Result<()> {
        // SAFETY: caller contract (Fabric::all_gather_i32).
        unsafe {
            self.all_gather(
                send as *const std::ffi::c_void,
                recv as *mut std::ffi::c_void,
                count,
                NcclDataType::Int32,
                s.raw(),
            )
        }
    }

    unsafe fn exchange(&self, items: &[(ExchangePlan, u64, u64)], s: &Stream) -> Result<()> {
        let api = self.api();
        api.group_start()?;
        let mut first: Option<Error> = None;
        for (plan, send, recv) in items {
            // SAFETY: caller contract (Fabric::exchange).
            if let Err(e) = unsafe { NcclComm::exchange(self, plan, *send, *recv, s.raw()) } {
                first.get_or_insert(e);
            }
        }
        // Close the group even after a failed call (NCCL's group state is per thread).
        let end = api.group_end();
        if let Some(e) = first {
            return Err(e);
        }
        end?;
        // SAFETY: caller contract.
        unsafe { local_copies(items, s) }
    }

    fn poll(&self) -> Result<()> {
        self.async_error()
    }
}
