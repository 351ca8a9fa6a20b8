//! The GPU manager's pipeline (docs/gpu.md) as code over an [`Executor`]: every buffer, kernel
//! launch, copy, exchange and host sync of one dispatch or combine, in order, for every layout.
//! [`crate::gpu::transport::GpuManager`] runs it with its CUDA executor (device memory, the
//! loaded kernels, NCCL or the local fabric); `tests/gpu_pipeline_counts_emu.rs` and
//! `tests/gpu_pipeline_emu.rs` run the same code with a host executor (the real kernel sources
//! compiled for the host, exchanges as host copies), so the emulation checks the code a device
//! runs, not a copy of it. Pure: always built, no CUDA needed.
//!
//! - `counts`: counts mode (one host sync per dispatch; every layout).
//! - `capacity`: capacity mode (no host sync; EXPERT_MAJOR only).
//! - `experts`: the expert layouts' receive side, which both modes share.
//! - here: the configuration checks, the wire buffers and the steps both modes share.

mod capacity;
mod counts;
mod experts;
mod sizes;

use crate::error::{Error, Result};
use crate::gpu::calls::{Call, Calls};
use crate::gpu::kernels::{
    CombineReturnExpertArgs, IdDtype, PackArgs, WeightedCombineArgs, MAX_TOPK,
};
use crate::gpu::nccl::plan::{ExchangeOptions, ExchangePlan};
use crate::gpu::transport::plan::{
    self, capacity_supported, DispatchShape, Gathered, ShapeGeometry,
};
use crate::moe::layout::{self, Capacity, Contract, Unit};
use crate::moe::{Manager, MoeConfig};
use crate::select::all2all::{Backend, Layout};

/// The message when a host sync is requested on a capturing stream.
pub const CAPTURE_SYNC_MESSAGE: &str =
    "counts need a host sync; use capacity mode under CUDA graphs";

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

impl GpuDispatch {
    /// A result with only the row payloads set (the layout's steps add the rest).
    fn rows(shape: DispatchShape, payloads: &[u64]) -> GpuDispatch {
        GpuDispatch {
            shape,
            hidden: payloads.first().copied().unwrap_or(0),
            topk_ids: 0,
            topk_weights: 0,
            counts: 0,
            expert_offsets: 0,
            src_rank: 0,
            src_token: 0,
            extras: payloads.get(1..).unwrap_or_default().to_vec(),
        }
    }
}

/// What the pipeline needs from a device: named grow-only buffers, kernel launches, copies,
/// the collective exchanges and the one host sync. Every operation is enqueued in order on
/// one stream; only [`Executor::read_i32`] waits for it. Each entry of the pipeline runs
/// between [`Executor::enter`] and [`Executor::leave`].
pub trait Executor {
    /// Makes the device current for this entry, remembering the caller's (CUDA: pushes the
    /// manager's context).
    fn enter(&mut self) -> Result<()>;
    /// Restores what [`Executor::enter`] replaced (CUDA: pops the context).
    fn leave(&mut self);
    /// Creation-time sizing: the buffer `name` gets at least `bytes` now
    /// ([`crate::gpu::transport::pool::Pool::reserve`]).
    fn reserve(&mut self, name: &str, bytes: usize) -> Result<()>;
    /// The launch builders of the kernels specialised for `id` (compiled and loaded on first
    /// use).
    fn calls(&mut self, id: IdDtype) -> Result<Calls>;
    /// The device buffer `name` of at least `bytes` (grow-only: stable addresses once sized,
    /// which CUDA graphs need; contents unspecified). Growing is refused while the stream is
    /// being captured ([`crate::gpu::transport::pool::Pool::get`]).
    fn buffer(&mut self, name: &str, bytes: usize) -> Result<u64>;
    /// Launches `calls` in order with the kernels of `id`.
    fn launch(&mut self, id: IdDtype, calls: &[Call]) -> Result<()>;
    /// Sets `bytes` bytes at `dst` to `value`.
    ///
    /// # Safety
    /// `dst` holds `bytes` bytes of this device.
    unsafe fn fill8(&mut self, dst: u64, value: u8, bytes: usize) -> Result<()>;
    /// Sets `count` 32-bit words at `dst` to `value`.
    ///
    /// # Safety
    /// `dst` holds `4 * count` bytes of this device.
    unsafe fn fill32(&mut self, dst: u64, value: u32, count: usize) -> Result<()>;
    /// Copies `bytes` from `src` to `dst` on the device.
    ///
    /// # Safety
    /// Both hold `bytes` bytes of this device and do not overlap.
    unsafe fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    /// Copies `data` to `dst` through the host staging buffer `staging` (whose previous use
    /// ended at the previous host sync).
    ///
    /// # Safety
    /// `dst` holds `data.len()` bytes of this device.
    unsafe fn upload(&mut self, dst: u64, data: &[u8], staging: &'static str) -> Result<()>;
    /// All-gather of `count` int32 per rank (`recv` holds `count * world`).
    ///
    /// # Safety
    /// `send`/`recv` hold `4 * count` / `4 * count * world` bytes of this device.
    unsafe fn all_gather_i32(&mut self, send: u64, recv: u64, count: usize) -> Result<()>;
    /// Every plan's transfers as one group, plus the self copies.
    ///
    /// # Safety
    /// Each `(plan, send, recv)` has `send`/`recv` of at least `plan.send_bytes` /
    /// `plan.recv_bytes`; every rank issues its plans for the same matrices.
    unsafe fn exchange(&mut self, items: &[(ExchangePlan, u64, u64)]) -> Result<()>;
    /// The host sync: waits for everything enqueued, then returns `count` int32 read at
    /// `src` (bounded by the executor's timeout).
    fn read_i32(&mut self, src: u64, count: usize) -> Result<Vec<i32>>;
    /// `InvalidState` when the stream is being captured into a graph (no host sync there).
    fn ensure_not_capturing(&self) -> Result<()>;
    /// This rank failed while its peers were in the collective: end the transport's part
    /// (CUDA: `ncclCommAbort` of an owned communicator), so the peers fail instead of waiting.
    fn abort(&mut self);
}

/// One call's executor with the launch builders of its id dtype.
struct Ctx<'a> {
    x: &'a mut dyn Executor,
    id: IdDtype,
    k: Calls,
}

impl Ctx<'_> {
    fn buf(&mut self, name: &str, bytes: usize) -> Result<u64> {
        self.x.buffer(name, bytes)
    }

    fn run(&mut self, calls: Vec<Call>) -> Result<()> {
        self.x.launch(self.id, &calls)
    }

    fn exchange(&mut self, items: &[(ExchangePlan, u64, u64)]) -> Result<()> {
        // SAFETY: every buffer was sized from its plan (send_bytes / recv_bytes); the ranks
        // compute their plans from the same gathered counts (or static sizes).
        unsafe { self.x.exchange(items) }
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

/// The send and receive buffers of one dispatch's wire payloads: rows, ids (int32),
/// weights (f32), source token (int32), then each extra payload.
#[derive(Debug)]
struct Wire {
    widths: Vec<usize>,
    sends: Vec<u64>,
    recvs: Vec<u64>,
}

impl Wire {
    /// Allocates `{prefix}send{i}` of `n_send` and `{prefix}recv{i}` of `n_recv` rows each.
    fn alloc(
        c: &mut Ctx,
        prefix: &str,
        widths: Vec<usize>,
        n_send: usize,
        n_recv: usize,
    ) -> Result<Wire> {
        let mut sends = Vec::with_capacity(widths.len());
        let mut recvs = Vec::with_capacity(widths.len());
        for (i, w) in widths.iter().enumerate() {
            sends.push(c.buf(&format!("{prefix}send{i}"), n_send * w)?);
            recvs.push(c.buf(&format!("{prefix}recv{i}"), n_recv * w)?);
        }
        Ok(Wire {
            widths,
            sends,
            recvs,
        })
    }

    /// The receive buffers of rows, ids, weights and source tokens.
    fn recv_meta(&self) -> Result<[u64; 4]> {
        match self.recvs[..] {
            [rows, ids, w, src, ..] => Ok([rows, ids, w, src]),
            _ => Err(Error::Internal(
                "dispatch wire without its row buffers".into(),
            )),
        }
    }

    /// The row payloads (hidden, then each extra) as (received rows, row bytes).
    fn payloads(&self) -> impl Iterator<Item = (usize, u64, usize)> + '_ {
        self.widths
            .iter()
            .zip(&self.recvs)
            .enumerate()
            .filter(|(i, _)| *i == 0 || *i >= 4)
            .map(|(i, (&w, &recv))| (i, recv, w))
    }

    /// One output buffer `{prefix}{i}` of `rows` rows per row payload, with its source.
    fn outputs(&self, c: &mut Ctx, prefix: &str, rows: usize) -> Result<Vec<(u64, usize, u64)>> {
        self.payloads()
            .map(|(i, recv, w)| Ok((recv, w, c.buf(&format!("{prefix}{i}"), rows * w)?)))
            .collect()
    }

    /// The exchange items, one plan per payload.
    fn items(
        &self,
        mut plan: impl FnMut(usize) -> Result<ExchangePlan>,
    ) -> Result<Vec<(ExchangePlan, u64, u64)>> {
        self.widths
            .iter()
            .zip(self.sends.iter().zip(&self.recvs))
            .map(|(&w, (&s, &r))| Ok((plan(w)?, s, r)))
            .collect()
    }
}

/// The `ep_pack` launches of the hidden rows (with ids, weights, source token) and of each
/// extra payload, into `wire`'s send buffers by `flags` / `send_pos` over `ranks` ranks.
fn pack(
    c: &mut Ctx,
    inp: &DispatchInput,
    extra_row_bytes: &[usize],
    ranks: usize,
    flags: u64,
    send_pos: u64,
    wire: &Wire,
) -> Result<()> {
    let [send_rows, send_ids, send_weights, send_src, ..] = wire.sends[..] else {
        return Err(Error::Internal(
            "dispatch wire without its row buffers".into(),
        ));
    };
    let hidden = PackArgs {
        rows: inp.hidden,
        row_bytes: wire.widths[0] as u64,
        topk_ids: inp.topk_ids,
        topk_weights: inp.topk_weights,
        T: inp.tokens as i32,
        R: ranks as i32,
        rank_flag: flags,
        send_pos,
        send_rows,
        send_ids,
        send_weights,
        send_src,
    };
    c.run(c.k.pack(hidden))?;
    // Extras: the same rows, no metadata.
    for ((&x, &wb), &send) in inp.extras.iter().zip(extra_row_bytes).zip(&wire.sends[4..]) {
        c.run(c.k.pack(PackArgs {
            rows: x,
            row_bytes: wb as u64,
            topk_ids: 0,
            topk_weights: 0,
            send_rows: send,
            send_ids: 0,
            send_weights: 0,
            send_src: 0,
            ..hidden
        }))?;
    }
    Ok(())
}

/// `ep_combine_return_expert` (expert layouts, both modes): the rows of `y` back into wire
/// order in `send`, one per (received row, k) this rank owns; `at` = the receive ids, the
/// (local expert, row) positions and the pair positions; `capacity` = bucket rows (0: packed).
fn return_pairs(
    p: &Pipeline,
    c: &mut Ctx,
    st: &State,
    y: u64,
    at: [u64; 3],
    capacity: usize,
    send: u64,
) -> Result<()> {
    let [recv_ids, expert_pos, pair_pos] = at;
    c.run(c.k.combine_return_expert(CombineReturnExpertArgs {
        y,
        row_bytes: p.expert_row_bytes() as u64,
        recv_ids,
        N: st.n_recv as i32,
        E_local: (p.config().num_experts / p.world()) as i32,
        rank: p.rank() as i32,
        expert_pos,
        capacity: capacity as i32,
        pair_pos,
        send_rows: send,
    }))
}

/// `ep_weighted_combine` (source-weighted layouts, both modes): `out[t] = Σ_k w[t,k] ·
/// y[rows[t,k]]` for `t` tokens.
fn weighted_sum(
    c: &mut Ctx,
    p: &Pipeline,
    t: usize,
    y: u64,
    rows: u64,
    w: u64,
    out: u64,
) -> Result<()> {
    c.run(c.k.weighted_combine(WeightedCombineArgs {
        y,
        rows,
        w,
        T: t as i32,
        H: p.config().hidden as i32,
        out,
    }))
}

/// The int32 `v` as a kernel argument, or an error naming `what` (the kernels index with
/// 32-bit ints).
fn to_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::InvalidArgument(format!(
            "{what} is {v}: the GPU kernels index with 32-bit ints (at most {})",
            i32::MAX
        ))
    })
}

/// The kernels a layout's contract takes on the GPU (the receive side's unpack and combine's
/// return and reduction).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    /// Exact rows per (source, token), or every token (REPLICATED, TOKEN_MAJOR).
    Tokens,
    /// M-row regions per source rank (RANK_MAJOR).
    Regions,
    /// M·R-row buckets per local expert (EXPERT_MAJOR).
    Buckets,
    /// Exact rows per (token, local expert), grouped by expert (EXPERT_PACKED).
    Packed,
}

impl Family {
    /// The family of `c`; a contract the GPU kernels do not implement is an error.
    fn of(c: &Contract) -> Result<Family> {
        match (c.unit, c.capacity) {
            (Unit::EveryToken | Unit::Token, Capacity::Exact) => Ok(Family::Tokens),
            (Unit::Token, Capacity::PerSourceRank) => Ok(Family::Regions),
            (Unit::TokenExpert, Capacity::PerLocalExpert) => Ok(Family::Buckets),
            (Unit::TokenExpert, Capacity::Exact) => Ok(Family::Packed),
            (Unit::EveryToken, Capacity::PerSourceRank | Capacity::PerLocalExpert)
            | (Unit::Token, Capacity::PerLocalExpert)
            | (Unit::TokenExpert, Capacity::PerSourceRank) => Err(Error::NotImplemented(format!(
                "the GPU path has no kernels for the {} layout",
                c.layout.name()
            ))),
        }
    }
}

/// How far a call got, which decides what its error means for the peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing collective issued: the peers may be told (counts mode's rejection row).
    Local,
    /// The counts are gathered: every rank checks the same numbers and fails alike.
    Agreed,
    /// The peers may be waiting for work of this call this rank has not enqueued: an error
    /// leaves the group out of step.
    Collective,
}

/// The GPU manager's pipeline: configuration, mode, and what combine needs from the last
/// dispatch. Device-independent: an [`Executor`] does the work.
#[derive(Debug)]
pub struct Pipeline {
    cpu: Manager,
    contract: Contract,
    family: Family,
    rank: usize,
    world: usize,
    mode: GpuMode,
    opts: ExchangeOptions,
    state: Option<State>,
    /// How far the current call got (what an error means for the peers).
    phase: Phase,
    /// The first such error: every later call is refused with it.
    failed: Option<String>,
}

impl Pipeline {
    /// A pipeline for `backend` on rank `rank` of `world`. Validates like the CPU [`Manager`]
    /// (same messages, same `Using … all2all manager.` info) and refuses what the GPU path
    /// does not do. `zero_size_p2p`: whether the transport accepts zero-byte transfers.
    pub fn new(
        backend: &str,
        cfg: MoeConfig,
        rank: usize,
        world: usize,
        mode: GpuMode,
        zero_size_p2p: bool,
    ) -> Result<Pipeline> {
        let cpu = Manager::new(backend, cfg.clone(), rank, world)?;
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
        // MOONEP_SLOTS: the CPU manager refused it already, with the same error.
        let contract = layout::require(cpu.layout())?;
        let family = Family::of(&contract)?;
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
            world,
            cfg.num_experts,
            cfg.top_k,
            cfg.hidden,
            cfg.max_tokens_per_rank,
        )?;
        Ok(Pipeline {
            cpu,
            contract,
            family,
            rank,
            world,
            mode,
            opts: ExchangeOptions {
                zero_size_p2p,
                self_via_nccl: false,
            },
            state: None,
            phase: Phase::Local,
            failed: None,
        })
    }

    /// Allocates every buffer at its largest size for `max_tokens_per_rank` tokens per rank
    /// (the manager does it at creation), so calls within that bound never allocate.
    pub fn reserve(&self, x: &mut dyn Executor) -> Result<()> {
        for (name, bytes) in self.buffer_sizes() {
            x.reserve(&name, bytes)?;
        }
        Ok(())
    }

    /// What [`Pipeline::reserve`] allocates: (name, bytes) of every buffer at its largest
    /// for `max_tokens_per_rank` tokens per rank.
    pub fn buffer_sizes(&self) -> Vec<(String, usize)> {
        sizes::buffers(self, self.cpu.config().max_tokens_per_rank)
    }

    /// The first error that left the group out of step (a call failed after its peers had
    /// started the collective), if any: the pipeline refuses every call since.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Marks the pipeline unusable (unless it already is) for a failure outside its calls
    /// that leaves the group out of step, e.g. a wait for the stream that timed out.
    pub fn mark_unusable(&mut self, why: &str) {
        self.fail(why);
    }

    /// Marks the pipeline unusable unless it already is.
    fn fail(&mut self, why: &str) {
        self.state = None;
        self.failed.get_or_insert_with(|| why.to_owned());
    }

    /// InvalidState naming the first failure, once there was one.
    pub fn ensure_usable(&self) -> Result<()> {
        match &self.failed {
            None => Ok(()),
            Some(first) => Err(Error::InvalidState(format!(
                "the GPU all2all manager is unusable: an earlier call failed while its peers were in the collective ({first}); destroy it and create a new one (its NCCL communicator was aborted if epcomm created it)"
            ))),
        }
    }

    /// `r` of an entry: an error while the peers were in the collective marks the pipeline
    /// unusable ([`Pipeline::failure`]).
    fn settle<T>(&mut self, x: &mut dyn Executor, r: Result<T>) -> Result<T> {
        let phase = std::mem::replace(&mut self.phase, Phase::Local);
        match (r, phase) {
            (Ok(v), _) => Ok(v),
            // Nothing the peers wait for was issued yet: tell them (counts mode).
            (Err(e), Phase::Local) => Err(self.reject_in(x, e)),
            (Err(e), Phase::Agreed) => Err(e),
            (Err(e), Phase::Collective) => {
                self.fail(&e.to_string());
                x.abort();
                Err(e)
            }
        }
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.cpu.backend()
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        self.cpu.layout()
    }

    /// The layout's contract.
    pub fn contract(&self) -> &Contract {
        &self.contract
    }

    /// Whether one row travels per (token, local expert): the layout needs the pair flags.
    fn per_pair(&self) -> bool {
        self.contract.unit == Unit::TokenExpert
    }

    /// Whether every token goes to every rank (packed once, broadcast).
    fn every_token(&self) -> bool {
        self.contract.unit == Unit::EveryToken
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
        self.rank
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Tokens (T) of the last dispatch: combine's output has this many rows.
    pub fn last_tokens(&self) -> Option<usize> {
        self.state.as_ref().map(|s| s.tokens)
    }

    /// The shape of the last dispatch.
    pub fn last_shape(&self) -> Option<&DispatchShape> {
        self.state.as_ref().map(|s| &s.shape)
    }

    /// Forgets the last dispatch (a failed call leaves nothing for combine).
    pub fn clear(&mut self) {
        self.state = None;
    }

    fn row_bytes(&self) -> usize {
        let c = self.cpu.config();
        c.hidden * (c.hidden_dtype.bits as usize / 8)
    }

    fn expert_row_bytes(&self) -> usize {
        let c = self.cpu.config();
        c.hidden * c.expert_dtype.size()
    }

    /// The wire payloads' row bytes: rows, ids (int32), weights, source token, extras.
    fn widths(&self) -> Vec<usize> {
        let c = self.cpu.config();
        [self.row_bytes(), 4 * c.top_k, 4 * c.top_k, 4]
            .into_iter()
            .chain(c.extra_row_bytes.iter().copied())
            .collect()
    }

    fn geometry(&self) -> ShapeGeometry {
        let c = self.cpu.config();
        ShapeGeometry {
            world: self.world,
            rank: self.rank,
            num_experts: c.num_experts,
            top_k: c.top_k,
            hidden: c.hidden,
            max_tokens_per_rank: c.max_tokens_per_rank,
            backend: self.cpu.backend(),
        }
    }

    /// Dispatch (collective) through `x`. Counts mode syncs the host once (see
    /// [`Executor::read_i32`]); capacity mode never does.
    pub fn dispatch(&mut self, x: &mut dyn Executor, input: &DispatchInput) -> Result<GpuDispatch> {
        self.state = None;
        self.ensure_usable()?;
        x.enter()?;
        let r = self.dispatch_in(x, input);
        let r = self.settle(x, r);
        x.leave();
        r
    }

    fn dispatch_in(&mut self, x: &mut dyn Executor, input: &DispatchInput) -> Result<GpuDispatch> {
        let k = self.check_input(x, input)?;
        let mut c = Ctx {
            x,
            id: input.id_dtype,
            k,
        };
        match self.mode {
            GpuMode::Counts => counts::dispatch(self, &mut c, input),
            GpuMode::Capacity => capacity::dispatch(self, &mut c, input),
        }
    }

    /// The checks before any device work: extras, the 32-bit index range, the kernels.
    fn check_input(&self, x: &mut dyn Executor, input: &DispatchInput) -> Result<Calls> {
        let cfg = self.cpu.config();
        if input.extras.len() != cfg.extra_row_bytes.len() {
            return Err(Error::InvalidArgument(format!(
                "{} extra payloads given; the manager was created for {}",
                input.extras.len(),
                cfg.extra_row_bytes.len()
            )));
        }
        let pairs = input
            .tokens
            .saturating_mul(self.world)
            .saturating_mul(cfg.top_k)
            .saturating_add(1);
        to_i32(pairs, "tokens x world_size x top_k")?;
        to_i32(cfg.num_experts, "num_experts")?;
        x.calls(input.id_dtype)
    }

    /// Returns `err` after telling the peers (counts mode) that this rank's dispatch input was
    /// rejected before the counts all-gather: it takes part in the all-gather with a counts
    /// row of T = 0 carrying the host-made error word, so every peer returns "rank r rejected
    /// its dispatch input" instead of waiting for it (what the CPU path's `reject_dispatch`
    /// does). Capacity mode and a capturing stream have no host-side exchange to carry it:
    /// there the peers are not told (docs/gpu.md, "Not done").
    pub fn reject_dispatch(&mut self, x: &mut dyn Executor, err: Error) -> Error {
        if self.failed.is_some() {
            return err;
        }
        if x.enter().is_err() {
            self.state = None;
            return err;
        }
        let err = self.reject_in(x, err);
        x.leave();
        err
    }

    fn reject_in(&mut self, x: &mut dyn Executor, err: Error) -> Error {
        self.state = None;
        if self.mode == GpuMode::Counts && x.ensure_not_capturing().is_ok() {
            let _ = counts::send_rejection(self, x);
        }
        err
    }

    /// Combine (collective) through `x`: `expert_output` has the dispatch buffer's rows
    /// (`shape.buffer_rows` × hidden, expert dtype), `out` gets `[T, hidden]` of the out dtype.
    pub fn combine(&mut self, x: &mut dyn Executor, expert_output: u64, out: u64) -> Result<()> {
        self.ensure_usable()?;
        let st = self.state.clone().ok_or_else(|| {
            Error::InvalidState("combine called without a dispatch before it".into())
        })?;
        x.enter()?;
        // Every rank that dispatched waits in this combine's exchange from here on.
        self.phase = Phase::Collective;
        let r = self.combine_in(x, &st, expert_output, out);
        let r = self.settle(x, r);
        x.leave();
        r
    }

    fn combine_in(
        &mut self,
        x: &mut dyn Executor,
        st: &State,
        expert_output: u64,
        out: u64,
    ) -> Result<()> {
        let k = x.calls(st.id_dtype)?;
        let mut c = Ctx {
            x,
            id: st.id_dtype,
            k,
        };
        match self.mode {
            GpuMode::Counts => counts::combine(self, &mut c, st, expert_output, out),
            GpuMode::Capacity => capacity::combine(self, &mut c, st, expert_output, out),
        }
    }
}
