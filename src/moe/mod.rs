//! MoE dispatch and combine in the layout each vLLM all2all backend name stands for (the
//! contract: docs/design.md, section 3).
//!
//! One dispatch: every rank validates its routing, the ranks exchange a small header (status,
//! shapes, configuration) so a bad input or a mismatched configuration fails on every rank
//! instead of hanging, then gather every rank's top-k ids and weights (a few bytes per token).
//! From that, each rank computes the same [`plan`], and the hidden rows (and extra payloads)
//! move once, straight into their final rows ([`Group::exchange_rows`]). Combine is one
//! [`Group::reduce_rows`]: each source pulls the expert outputs of its tokens from the holders
//! and sums them in f32, in rank order (deterministic), writing f32, bf16 or f16.

pub mod fp8;
mod ft;
pub mod layout;
mod pairwise;
pub mod plan;
mod recv;
pub mod reference;
mod zero_copy;

use std::time::{Duration, Instant};

use crate::bytes;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::{Checker, Group, Op, RowReduce};
use crate::log;
use crate::num::{self, FloatKind};
use crate::select::all2all::{self, Backend, Layout};
use layout::{Contract, Geometry, Ids, Shapes};
use plan::{Plan, Routing};
pub use recv::ExtraRows;
use recv::Received;

/// What a manager is built for (fixed for its lifetime).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Physical experts E (logical plus redundant); rank r owns [r*E/R, (r+1)*E/R).
    pub num_experts: usize,
    pub top_k: usize,
    /// Elements per hidden row.
    pub hidden: usize,
    /// Element type of the hidden rows (any; rows move as bytes).
    pub hidden_dtype: DType,
    /// Element type of the expert outputs given to combine.
    pub expert_dtype: FloatKind,
    /// Element type combine writes.
    pub out_dtype: FloatKind,
    /// Tokens per rank the fixed-capacity layouts hold (M); 0 = no bound (exact-size layouts).
    pub max_tokens_per_rank: usize,
    /// Bytes per token of each extra payload (e.g. quantisation scales) that travels with rows.
    pub extra_row_bytes: Vec<usize>,
    /// Multiply the hidden rows by their (top-1) weight before dispatch (vLLM's option).
    pub apply_router_weight_on_input: bool,
}

impl MoeConfig {
    fn row_bytes(&self) -> usize {
        self.hidden * (self.hidden_dtype.bits as usize / 8)
    }
}

/// Per-call statistics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Hidden rows sent to / received from each rank by the last dispatch.
    pub tokens_sent: Vec<u64>,
    pub tokens_received: Vec<u64>,
    /// Bytes (hidden rows and extra payloads) sent to / received from each rank.
    pub bytes_sent: Vec<u64>,
    pub bytes_received: Vec<u64>,
    /// Expert-output bytes pulled from each rank by the last combine.
    pub combine_bytes_received: Vec<u64>,
    pub dispatch_time: Duration,
    pub combine_time: Duration,
    /// This rank's (token, expert) pairs the last dispatch dropped because the expert's rank
    /// is masked (fault tolerance), and all of them since the manager was created.
    pub dropped_pairs: u64,
    pub dropped_pairs_total: u64,
}

/// The receive side of the last dispatch (owned by the manager, valid until the next call).
/// Which outputs exist and their shapes are the layout's [`layout::Contract`]
/// ([`Manager::output_shapes`]); an output the layout does not produce is empty.
#[derive(Debug, Clone, Copy)]
pub struct DispatchView<'a> {
    pub layout: Layout,
    /// Hidden rows of element type `hidden_dtype`, shaped `shape`.
    pub hidden: &'a [u8],
    /// The shape of `hidden` (and, with the last dimension replaced, of the extras).
    pub shape: &'a [usize],
    /// Rows actually received (≤ rows of the buffer for fixed-capacity layouts).
    pub received_rows: usize,
    /// Ids per row ([`layout::Ids`]).
    pub topk_ids: &'a [i64],
    /// Weights per id or per row ([`layout::Weights`]).
    pub topk_weights: &'a [f32],
    /// Rows per local expert or per source rank ([`layout::Counts`]).
    pub counts: &'a [i32],
    /// `expert_offsets [E_local + 1]`: where each local expert's rows start.
    pub expert_offsets: &'a [i64],
    /// Source rank and token of each row.
    pub src_rank: &'a [i32],
    pub src_token: &'a [i32],
    /// Extra payload rows, same row layout as `hidden` (`extras[i]`, `extras.iter()`).
    pub extras: &'a dyn ExtraRows,
}

/// An all2all manager for one backend name and configuration.
#[derive(Debug)]
pub struct Manager {
    backend: Backend,
    contract: Contract,
    cfg: MoeConfig,
    rank: usize,
    world: usize,
    geo: Geometry,
    plan: Option<Plan>,
    tokens: usize,
    shape: Vec<usize>,
    hidden: Received,
    extras: Vec<Received>,
    /// Whether every receive buffer of the last dispatch was the group's shared memory.
    recv_shared: bool,
    stats: Stats,
    expert_counts: Vec<u32>,
    zero_copy: zero_copy::ZeroCopy,
    /// FP8 dispatch ([`Manager::set_dispatch_fp8`]): the scale rule, and the quantised send
    /// rows, their scales and the received scales (reused across calls).
    fp8: Option<fp8::Scales>,
    fp8_send: Vec<u8>,
    fp8_send_scales: Vec<u8>,
    fp8_scales: Received,
    /// Fault tolerance: the rank mask and the survivors' group ([`ft`]).
    ft: ft::Ft,
}

const HEADER_WORDS: usize = 17;
/// Routing (ids and weights) of at most this many bytes per rank travels with the dispatch
/// header instead of in an exchange of its own: one token at top-8 (96 bytes), and header plus
/// routing stay within the 256 bytes a host transport's op header carries inline.
const ROUTING_INLINE: usize = 120;
/// The header word naming the call (1 dispatch, 2 combine): ranks that call different ones fail
/// alike, before any data moves.
const CALL_WORD: usize = 16;
/// Bytes of one rank's header message: the header words, then [`ROUTING_INLINE`] bytes of
/// routing (256: what a host transport's op header carries inline).
const HEADER_BYTES: usize = HEADER_WORDS * 8 + ROUTING_INLINE;

/// What every rank's dispatch or combine header said ([`Manager::agree`]): the headers, and
/// [`ROUTING_INLINE`] bytes of routing per rank, rank order (zero where a rank sent none).
struct Agreed {
    headers: Vec<[u64; HEADER_WORDS]>,
    routing: Vec<u8>,
}

/// This rank's routing as it travels: the ids (i64), then the weights (f32).
fn routing_bytes(topk_ids: &[i64], topk_weights: &[f32]) -> Vec<u8> {
    let mut mine = Vec::with_capacity(topk_ids.len() * 12);
    mine.extend_from_slice(bytes::as_bytes(topk_ids));
    mine.extend_from_slice(bytes::as_bytes(topk_weights));
    mine
}

/// A dtype as one header word (code, bits, lanes).
fn dtype_word(d: DType) -> u64 {
    u64::from(d.code) << 32 | u64::from(d.bits) << 16 | u64::from(d.lanes)
}

fn dtype_of_word(w: u64) -> DType {
    DType {
        code: (w >> 32) as u8,
        bits: (w >> 16) as u8,
        lanes: w as u16,
    }
}

/// Largest number of (physical) experts a manager accepts.
const MAX_EXPERTS: usize = 1 << 20;

/// Grows a manager-owned buffer to at least `len` bytes (it never shrinks, so steady-state calls
/// neither allocate nor zero-fill), failing with a clear error (instead of the out-of-memory
/// killer) when the memory is not there. `ranks` ranks may grow theirs at once on this host.
fn ensure_len(buf: &mut Vec<u8>, len: usize, ranks: usize, what: &str) -> Result<()> {
    if len > buf.len() {
        let more = len - buf.len();
        check_available(more, len, ranks, what)?;
        buf.try_reserve(more).map_err(|e| {
            Error::Runtime(format!(
                "{what} needs {len} bytes and the allocation failed: {e}"
            ))
        })?;
        buf.resize(len, 0);
    }
    Ok(())
}

/// Fails with a clear error when `ranks` ranks growing a buffer by `more` bytes (to `len`) at
/// once on this host would exceed the memory available.
fn check_available(more: usize, len: usize, ranks: usize, what: &str) -> Result<()> {
    if let Some(avail) = crate::probe::available_memory() {
        if (more as u64).saturating_mul(ranks as u64) > avail {
            return Err(Error::Runtime(format!(
                "{what} needs {len} bytes on each of {ranks} ranks, more than the {avail} bytes of memory available; lower max_tokens_per_rank or the number of tokens"
            )));
        }
    }
    Ok(())
}

/// The checks of a configuration that depend on no layout (their order decides which error a
/// configuration with several faults gets, so it stays as it is).
fn check_config(cfg: &MoeConfig, rank: usize, world: usize) -> Result<()> {
    if cfg.apply_router_weight_on_input && cfg.top_k != 1 {
        return Err(Error::Assertion(
            "apply_router_weight_on_input is only implemented for topk=1".into(),
        ));
    }
    let bad = |m: String| Err(Error::InvalidArgument(m));
    if world == 0 || rank >= world {
        return bad(format!("rank {rank} is not in a group of {world} ranks"));
    }
    if cfg.num_experts == 0 || !cfg.num_experts.is_multiple_of(world) {
        return bad(format!(
            "num_experts is {}: expected a positive multiple of the EP size ({world}) so every rank owns E/R experts (add redundant experts to make it divisible)",
            cfg.num_experts
        ));
    }
    if cfg.top_k == 0 || cfg.top_k > cfg.num_experts {
        return bad(format!(
            "top_k is {}: expected 1..={} (num_experts)",
            cfg.top_k, cfg.num_experts
        ));
    }
    if cfg.hidden == 0 {
        return bad("hidden_size is 0: expected at least 1".into());
    }
    // Bounds that keep every size computation in range (far above real models).
    for (what, v, max) in [
        ("num_experts", cfg.num_experts, MAX_EXPERTS),
        ("hidden_size", cfg.hidden, 1 << 30),
        ("max_tokens_per_rank", cfg.max_tokens_per_rank, 1 << 30),
    ] {
        if v > max {
            return bad(format!("{what} is {v}: expected at most {max}"));
        }
    }
    if let Some((i, &b)) = cfg
        .extra_row_bytes
        .iter()
        .enumerate()
        .find(|(_, &b)| b > 1 << 30)
    {
        return bad(format!(
            "extra_row_bytes[{i}] is {b}: expected at most {}",
            1usize << 30
        ));
    }
    let hd = cfg.hidden_dtype;
    if hd.lanes != 1 || hd.bits == 0 || !hd.bits.is_multiple_of(8) {
        return bad(format!(
            "hidden dtype {} is not a scalar type of whole bytes",
            hd.torch_name()
        ));
    }
    if cfg.apply_router_weight_on_input && FloatKind::from_dtype(hd).is_none() {
        return bad(format!(
            "apply_router_weight_on_input needs float32, bfloat16 or float16 hidden rows, got {}",
            hd.torch_name()
        ));
    }
    Ok(())
}

/// Refuses fixed-capacity buffers that cannot fit in the memory of this host's ranks.
fn check_memory(
    contract: &Contract,
    cfg: &MoeConfig,
    geo: &Geometry,
    backend: Backend,
) -> Result<()> {
    let (layout, world) = (contract.layout, geo.world);
    if contract.fixed_capacity() {
        let rows = contract
            .worst_case_rows(geo, 0)
            .map_or(u64::MAX, |r| r as u64);
        let per_row = (cfg.row_bytes() + cfg.extra_row_bytes.iter().sum::<usize>()) as u64;
        let need = rows.saturating_mul(per_row);
        if let Some(avail) = crate::probe::available_memory() {
            if need.saturating_mul(world as u64) > avail {
                return Err(Error::InvalidArgument(format!(
                    "the {} layout of {} needs {need} bytes of receive buffers on each of {world} ranks ({rows} rows of {per_row} bytes: E_local x M x R for EXPERT_MAJOR, R x M for RANK_MAJOR), more than the {avail} bytes of memory available; lower max_tokens_per_rank",
                    layout.name(),
                    backend.name()
                )));
            }
        }
    }
    Ok(())
}

/// One dispatch's inputs, as [`Manager::dispatch`] takes them.
#[derive(Clone, Copy)]
struct Tokens<'a> {
    hidden: &'a [u8],
    topk_ids: &'a [i64],
    topk_weights: &'a [f32],
    extras: &'a [&'a [u8]],
}

impl Manager {
    /// Creates a manager for `backend` (any name vLLM accepts) on a group of `world` ranks, of
    /// which this is `rank`. Logs `Using {ManagerClass} all2all manager.` once.
    pub fn new(backend: &str, cfg: MoeConfig, rank: usize, world: usize) -> Result<Manager> {
        let _rank = crate::log::rank_scope(rank);
        let backend = all2all::resolve(backend)?;
        let layout = backend.layout();
        let contract = layout::require(layout)?;
        check_config(&cfg, rank, world)?;
        if contract.fixed_capacity() && cfg.max_tokens_per_rank == 0 {
            return Err(Error::InvalidArgument(format!(
                "max_tokens_per_rank is 0: the {} backend ({} layout) needs the fixed capacity M of tokens per rank",
                backend.name(),
                layout.name()
            )));
        }
        let geo = Geometry {
            world,
            num_experts: cfg.num_experts,
            experts_per_rank: cfg.num_experts / world,
            top_k: cfg.top_k,
            max_tokens: cfg.max_tokens_per_rank,
        };
        check_memory(&contract, &cfg, &geo, backend)?;
        log::log_once(log::Level::Info, &all2all::using_manager_info(backend));
        Ok(Manager {
            backend,
            contract,
            cfg,
            rank,
            world,
            geo,
            plan: None,
            tokens: 0,
            shape: Vec::new(),
            hidden: Received::default(),
            extras: Vec::new(),
            recv_shared: false,
            stats: Stats::default(),
            expert_counts: Vec::new(),
            zero_copy: zero_copy::ZeroCopy::default(),
            fp8: None,
            fp8_send: Vec::new(),
            fp8_send_scales: Vec::new(),
            fp8_scales: Received::default(),
            ft: ft::Ft::new(world),
        })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn layout(&self) -> Layout {
        self.contract.layout
    }

    /// The contract of the layout.
    pub fn contract(&self) -> &Contract {
        &self.contract
    }

    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Turns FP8 dispatch on (`Some`) or off: the hidden rows are quantised on the sending side
    /// to float8 e4m3fn with one f32 scale per 128 elements ([`fp8`]), so dispatch delivers
    /// `hidden` bytes per row plus `hidden/128` f32 scales ([`Manager::dispatch_scales`])
    /// instead of the hidden dtype. Needs float hidden rows and hidden % 128 == 0. Every rank
    /// must set the same (checked at each dispatch). Combine is unchanged.
    pub fn set_dispatch_fp8(&mut self, scales: Option<fp8::Scales>) -> Result<()> {
        if scales.is_some() {
            fp8::check_hidden(self.cfg.hidden)?;
            if FloatKind::from_dtype(self.cfg.hidden_dtype).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "FP8 dispatch quantises float hidden states (bfloat16, float16 or float32), not {}",
                    self.cfg.hidden_dtype.torch_name()
                )));
            }
        }
        self.fp8 = scales;
        self.plan = None;
        Ok(())
    }

    /// The FP8 dispatch setting.
    pub fn dispatch_fp8(&self) -> Option<fp8::Scales> {
        self.fp8
    }

    /// The element type of the dispatch output's hidden rows: float8_e4m3fn with FP8 dispatch,
    /// else the configured hidden dtype.
    pub fn dispatch_hidden_dtype(&self) -> DType {
        match self.fp8 {
            Some(_) => DType::F8E4M3FN,
            None => self.cfg.hidden_dtype,
        }
    }

    /// The last FP8 dispatch's scales: f32 (native-endian), `hidden/128` per row of the
    /// dispatch output, rows as the hidden rows (empty without FP8 dispatch).
    pub fn dispatch_scales(&self) -> &[u8] {
        match (self.fp8, &self.plan) {
            (Some(_), Some(p)) => {
                &self.fp8_scales.data()[..p.buffer_rows * fp8::scale_row_bytes(self.cfg.hidden)]
            }
            _ => &[],
        }
    }

    /// Bytes of one dispatched hidden row as it travels (1 per element with FP8 dispatch).
    fn wire_row_bytes(&self) -> usize {
        match self.fp8 {
            Some(_) => self.cfg.hidden,
            None => self.cfg.row_bytes(),
        }
    }

    /// Declares a MoE layer's shape. The one-sided FlashInfer backend is built for one top_k and
    /// num_experts (vLLM's assertion); the others are too, with epcomm's own message.
    pub fn check_layer(&self, top_k: i64, num_experts: i64) -> Result<()> {
        for (field, got, built) in [
            ("top_k", top_k, self.cfg.top_k as i64),
            ("num_experts", num_experts, self.cfg.num_experts as i64),
        ] {
            if got != built {
                if self.backend == Backend::FlashinferNvlinkOneSided {
                    return Err(Error::OneSidedHeterogeneous { field, got, built });
                }
                return Err(Error::InvalidArgument(format!(
                    "this {} manager was created for {field}={built}, got {field}={got}; create one manager per MoE layer shape",
                    self.backend.name()
                )));
            }
        }
        Ok(())
    }

    /// Bytes of the dispatch receive buffers (hidden rows and extras) for `tokens` tokens per
    /// rank in the worst case, before anything is allocated.
    pub fn buffer_bytes(&self, tokens: usize) -> Option<usize> {
        buffer_bytes(self.contract.layout, &self.cfg, self.world, tokens)
    }

    fn check_group(&self, g: &dyn Group) -> Result<()> {
        if g.size() != self.world || g.rank() != self.rank {
            return Err(Error::InvalidArgument(format!(
                "the group has rank {} of {} but this manager was created for rank {} of {}",
                g.rank(),
                g.size(),
                self.rank,
                self.world
            )));
        }
        Ok(())
    }

    fn header(&self, ok: bool, t: usize) -> [u64; HEADER_WORDS] {
        let c = &self.cfg;
        [
            u64::from(ok),
            t as u64,
            c.top_k as u64,
            c.num_experts as u64,
            c.row_bytes() as u64,
            c.max_tokens_per_rank as u64,
            self.contract.layout as u64,
            c.extra_row_bytes.len() as u64,
            c.extra_row_bytes.iter().map(|&b| b as u64).sum(),
            c.expert_dtype as u64,
            u64::from(c.apply_router_weight_on_input),
            self.backend as u64,
            dtype_word(c.hidden_dtype),
            dtype_word(c.out_dtype.dtype()),
            self.fp8.map_or(0, fp8::Scales::word),
            u64::from(self.fault_tolerance()),
            0,
        ]
    }

    /// Exchanges headers; any rank's failure or a configuration mismatch fails every rank.
    fn agree(
        &self,
        g: &mut dyn Group,
        what: &'static str,
        mine: [u64; HEADER_WORDS],
        routing: &[u8],
    ) -> Result<Agreed> {
        let (msg, check) = self.header_message(g, what, mine, routing);
        let mut all = vec![0u8; HEADER_BYTES * self.world];
        g.all_gather_checked(&msg, &mut all, check)?;
        let headers = all.chunks_exact(HEADER_BYTES).map(header_words).collect();
        let routing = all
            .chunks_exact(HEADER_BYTES)
            .map(|c| &c[HEADER_WORDS * 8..]);
        Ok(Agreed {
            headers,
            routing: routing.flatten().copied().collect(),
        })
    }

    /// [`Manager::agree`] without the result, in the header of the group's next op where the
    /// group [`Group::rides`] (combine: its rows' exchange; one engine call fewer).
    fn agree_riding(
        &self,
        g: &mut dyn Group,
        what: &'static str,
        mine: [u64; HEADER_WORDS],
    ) -> Result<()> {
        if !g.rides() {
            return self.agree(g, what, mine, &[]).map(|_| ());
        }
        let (msg, check) = self.header_message(g, what, mine, &[]);
        g.ride(&msg, check)
    }

    /// This rank's header message (the header, then the inline routing) and the check every
    /// rank runs on all of them.
    fn header_message(
        &self,
        g: &dyn Group,
        what: &'static str,
        mut mine: [u64; HEADER_WORDS],
        routing: &[u8],
    ) -> ([u8; HEADER_BYTES], Checker) {
        mine[CALL_WORD] = if what == "dispatch" { 1 } else { 2 };
        let mut msg = [0u8; HEADER_BYTES];
        msg[..HEADER_WORDS * 8].copy_from_slice(bytes::as_bytes(&mine));
        msg[HEADER_WORDS * 8..][..routing.len()].copy_from_slice(routing);
        // A masked rank takes no part (its entry is zero).
        let live: Vec<bool> = (0..self.world).map(|r| !self.is_masked(r)).collect();
        let (group, rank) = (g.name().to_owned(), self.rank);
        let check: Checker = Box::new(move |all: &[u8]| {
            let headers: Vec<[u64; HEADER_WORDS]> =
                all.chunks_exact(HEADER_BYTES).map(header_words).collect();
            check_headers(&group, rank, what, &mine, &headers, &live)
        });
        (msg, check)
    }

    /// Tells the peers this rank's dispatch input was rejected, so they fail instead of
    /// waiting, and returns `err`.
    pub fn reject_dispatch(&mut self, g: &mut dyn Group, err: Error) -> Error {
        let _call = crate::call::scope("dispatch");
        if self.check_group(g).is_err() {
            self.plan = None;
            return err;
        }
        match self.over_group(g, |m, g| Ok(m.reject_dispatch_on(g, err))) {
            Ok(e) | Err(e) => e,
        }
    }

    fn reject_dispatch_on(&mut self, g: &mut dyn Group, err: Error) -> Error {
        let _ = self.agree(g, "dispatch", self.header(false, 0), &[]);
        self.plan = None;
        err
    }

    /// Tells the peers this rank's combine input was rejected, and returns `err`.
    pub fn reject_combine(&mut self, g: &mut dyn Group, err: Error) -> Error {
        let _call = crate::call::scope("combine");
        if self.check_group(g).is_err() {
            return err;
        }
        match self.over_group(g, |m, g| Ok(m.reject_combine_on(g, err))) {
            Ok(e) | Err(e) => e,
        }
    }

    fn reject_combine_on(&mut self, g: &mut dyn Group, err: Error) -> Error {
        let header = self.header(false, self.tokens);
        if self.agree_riding(g, "combine", header).is_ok() && g.rides() {
            // The header rides in the rows' exchange the peers start: take part, rejected.
            let _ = g.reject(Op::AllToAllv, err.clone());
        }
        err
    }

    /// Dispatches this rank's tokens: `hidden` is `[T, hidden]`, `topk_ids` and `topk_weights`
    /// are `[T, K]`, `extras[i]` is `[T, extra_row_bytes[i]]` bytes. Collective.
    pub fn dispatch(
        &mut self,
        g: &mut dyn Group,
        hidden: &[u8],
        topk_ids: &[i64],
        topk_weights: &[f32],
        extras: &[&[u8]],
    ) -> Result<DispatchView<'_>> {
        let _rank = crate::log::rank_scope(self.rank);
        let _call = crate::call::scope("dispatch");
        self.check_group(g)?;
        self.plan = None;
        self.dispatch_started();
        let inp = Tokens {
            hidden,
            topk_ids,
            topk_weights,
            extras,
        };
        self.over_group(g, |m, g| m.dispatch_on(g, inp))?;
        Ok(self.view())
    }

    /// [`Manager::dispatch`] over the group in use (the survivors' after a failure): one user
    /// call of the group ([`Group::open_call`]), so it ends alike on every rank.
    fn dispatch_on(&mut self, g: &mut dyn Group, inp: Tokens<'_>) -> Result<()> {
        g.open_call();
        let out = self.dispatch_ops(g, inp);
        g.close_call(out)
    }

    fn dispatch_ops(&mut self, g: &mut dyn Group, inp: Tokens<'_>) -> Result<()> {
        let start = Instant::now();
        let checked = self.validate_dispatch(inp);
        let t = match checked
            .and_then(|t| self.quantize_input(inp.hidden, inp.topk_weights).map(|_| t))
        {
            Ok(t) => t,
            Err(e) => return Err(self.reject_dispatch_on(g, e)),
        };
        crate::fault::point("dispatch:before_counts");
        if pairwise::applies(self.world, g, self.ft.any()) {
            let plan = self.dispatch_pairwise(g, inp, t)?;
            self.finish_dispatch(plan, t, 0, start);
            return Ok(());
        }
        let routing = routing_bytes(inp.topk_ids, inp.topk_weights);
        let inline = if routing.len() <= ROUTING_INLINE {
            &routing[..]
        } else {
            &[]
        };
        let agreed = self.agree(g, "dispatch", self.header(true, t), inline)?;
        crate::fault::point("dispatch:after_counts");
        let counts: Vec<usize> = agreed.headers.iter().map(|h| h[1] as usize).collect();
        if let Some(r) = counts.iter().position(|&c| !self.fits(c)) {
            return Err(self.too_many_tokens(r, counts[r]));
        }
        let sizes: Vec<usize> = counts.iter().map(|&c| c * self.cfg.top_k * 12).collect();
        let mut all = if sizes.iter().all(|&n| n <= ROUTING_INLINE) {
            let inline = agreed.routing.chunks_exact(ROUTING_INLINE);
            self.split_routing(&counts, inline.zip(&sizes).map(|(c, &n)| &c[..n]))
        } else {
            let mut gathered = vec![0u8; sizes.iter().sum()];
            g.all_gatherv(&routing, &sizes, &mut gathered)?;
            let mut rest = &gathered[..];
            self.split_routing(
                &counts,
                sizes.iter().map(|&n| {
                    let (part, tail) = rest.split_at(n);
                    rest = tail;
                    part
                }),
            )
        };
        let dropped = self.drop_masked(&mut all);
        let plan = plan::build(
            self.contract.layout,
            &self.geo,
            self.rank,
            &all,
            self.cfg.apply_router_weight_on_input,
        );
        self.move_rows(g, &plan, inp.hidden, inp.topk_weights, inp.extras)?;
        self.finish_dispatch(plan, t, dropped, start);
        Ok(())
    }

    /// Records a dispatch that moved its rows by `plan`.
    fn finish_dispatch(&mut self, plan: Plan, t: usize, dropped: u64, start: Instant) {
        self.record_dispatch_stats(&plan);
        self.stats.dropped_pairs = dropped;
        self.stats.dropped_pairs_total += dropped;
        self.shape = self
            .contract
            .hidden_shape(&self.geo, self.cfg.hidden, plan.buffer_rows);
        self.tokens = t;
        self.plan = Some(plan);
        self.stats.dispatch_time = start.elapsed();
    }

    /// Whether `t` tokens of one rank fit the buffers (always, in the exact-size layouts).
    fn fits(&self, t: usize) -> bool {
        !self.contract.fixed_capacity() || t <= self.cfg.max_tokens_per_rank
    }

    fn too_many_tokens(&self, rank: usize, t: usize) -> Error {
        too_many_tokens(
            rank,
            t,
            self.cfg.max_tokens_per_rank,
            self.backend,
            self.contract.layout,
        )
    }

    /// Every rank's routing (ids as i64 and weights, K of each per token) from its bytes
    /// ([`routing_bytes`]), one part per rank in rank order.
    fn split_routing<'a>(
        &self,
        counts: &[usize],
        parts: impl Iterator<Item = &'a [u8]>,
    ) -> Vec<Routing> {
        let k = self.cfg.top_k;
        (counts.iter().zip(parts))
            .map(|(&c, part)| {
                let (ids, weights) = part.split_at(c * k * 8);
                Routing {
                    t: c,
                    k,
                    ids: bytes::to_vec(ids),
                    weights: bytes::to_vec(weights),
                }
            })
            .collect()
    }

    /// With FP8 dispatch, quantises this rank's rows (weighted first if asked, rounded to the
    /// hidden dtype as the unquantised path sends them) once per token into the send rows,
    /// before the header exchange, so a non-finite value fails every rank before data moves.
    fn quantize_input(&mut self, hidden: &[u8], topk_weights: &[f32]) -> Result<()> {
        let Some(scales) = self.fp8 else {
            return Ok(());
        };
        let kind = FloatKind::from_dtype(self.cfg.hidden_dtype)
            .ok_or_else(|| Error::Internal("FP8 dispatch on a non-float hidden dtype".into()))?;
        let scaled;
        let src: &[u8] = if self.cfg.apply_router_weight_on_input {
            scaled = self.weighted(hidden, topk_weights)?;
            &scaled
        } else {
            hidden
        };
        let (q, s) = (&mut self.fp8_send, &mut self.fp8_send_scales);
        fp8::quantize(src, kind, self.cfg.hidden, scales, q, s)
    }

    /// Moves the FP8 scales' rows (after the quantised hidden rows).
    fn move_scales(&mut self, g: &mut dyn Group, plan: &Plan) -> Result<()> {
        let sb = fp8::scale_row_bytes(self.cfg.hidden);
        let what = "the FP8 scales' receive buffer";
        let spare = !self.contract.fixed_capacity();
        let src = (self.fp8_send_scales.as_slice(), sb);
        self.fp8_scales.exchange(g, src, plan, spare, what)
    }

    /// Moves the rows: hidden (weighted first if asked, or quantised), then every extra payload.
    fn move_rows(
        &mut self,
        g: &mut dyn Group,
        plan: &Plan,
        hidden: &[u8],
        topk_weights: &[f32],
        extras: &[&[u8]],
    ) -> Result<()> {
        let row_bytes = self.wire_row_bytes();
        let scaled;
        let fp8_rows = std::mem::take(&mut self.fp8_send);
        let src: &[u8] = if self.fp8.is_some() {
            &fp8_rows
        } else if self.cfg.apply_router_weight_on_input {
            scaled = self.weighted(hidden, topk_weights)?;
            &scaled
        } else {
            hidden
        };
        self.recv_shared = false;
        let what = "the dispatch receive buffer";
        let spare = !self.contract.fixed_capacity();
        let moved = self.hidden.exchange(g, (src, row_bytes), plan, spare, what);
        self.fp8_send = fp8_rows;
        moved?;
        self.move_more(g, plan, extras)
    }

    /// After the hidden rows: the FP8 scales (when on) and every extra payload.
    fn move_more(&mut self, g: &mut dyn Group, plan: &Plan, extras: &[&[u8]]) -> Result<()> {
        let spare = !self.contract.fixed_capacity();
        if self.fp8.is_some() {
            self.move_scales(g, plan)?;
        }
        self.extras.resize_with(extras.len(), Received::default);
        let what = "an extra payload's receive buffer";
        for ((buf, data), &rb) in self
            .extras
            .iter_mut()
            .zip(extras)
            .zip(&self.cfg.extra_row_bytes)
        {
            buf.exchange(g, (data, rb), plan, spare, what)?;
        }
        self.recv_shared = self.hidden.shared_in(g)
            && (self.fp8.is_none() || self.fp8_scales.shared_in(g))
            && self.extras.iter().all(|b| b.shared_in(g));
        Ok(())
    }

    /// The hidden rows multiplied by their (top-1) weight (apply_router_weight_on_input).
    fn weighted(&self, hidden: &[u8], topk_weights: &[f32]) -> Result<Vec<u8>> {
        let kind = FloatKind::from_dtype(self.cfg.hidden_dtype).ok_or_else(|| {
            Error::Internal("apply_router_weight_on_input on a non-float hidden dtype".into())
        })?;
        let mut vals = num::to_f32(hidden, kind);
        for (row, w) in vals.chunks_mut(self.cfg.hidden).zip(topk_weights) {
            row.iter_mut().for_each(|x| *x *= w);
        }
        Ok(num::from_f32(&vals, kind))
    }

    fn record_dispatch_stats(&mut self, plan: &Plan) {
        let scales = self
            .fp8
            .map_or(0, |_| fp8::scale_row_bytes(self.cfg.hidden));
        let per_row = (self.wire_row_bytes()
            + scales
            + self.cfg.extra_row_bytes.iter().sum::<usize>()) as u64;
        let rows = |v: &[Vec<u32>]| -> Vec<u64> { v.iter().map(|x| x.len() as u64).collect() };
        let s = &mut self.stats;
        s.tokens_sent = rows(&plan.give);
        s.tokens_received = rows(&plan.take);
        s.bytes_sent = s.tokens_sent.iter().map(|n| n * per_row).collect();
        s.bytes_received = s.tokens_received.iter().map(|n| n * per_row).collect();
    }

    fn validate_dispatch(&mut self, inp: Tokens<'_>) -> Result<usize> {
        let Tokens {
            hidden,
            topk_ids,
            topk_weights,
            extras,
        } = inp;
        let (k, rb) = (self.cfg.top_k, self.cfg.row_bytes());
        if hidden.len() % rb != 0 {
            return Err(Error::InvalidArgument(format!(
                "hidden has {} bytes; expected a multiple of the row size {rb} (hidden_size {} x {} bytes)",
                hidden.len(),
                self.cfg.hidden,
                self.cfg.hidden_dtype.bits / 8
            )));
        }
        let t = hidden.len() / rb;
        self.check_tokens(t)?;
        if topk_ids.len() != t * k {
            return Err(Error::InvalidArgument(format!(
                "topk_ids has {} entries; expected T x top_k = {t} x {k}",
                topk_ids.len()
            )));
        }
        if topk_weights.len() != t * k {
            return Err(Error::InvalidArgument(format!(
                "topk_weights has {} entries; expected T x top_k = {t} x {k}",
                topk_weights.len()
            )));
        }
        if extras.len() != self.cfg.extra_row_bytes.len() {
            return Err(Error::InvalidArgument(format!(
                "{} extra payloads given; the manager was created for {}",
                extras.len(),
                self.cfg.extra_row_bytes.len()
            )));
        }
        for (i, (x, &b)) in extras.iter().zip(&self.cfg.extra_row_bytes).enumerate() {
            if x.len() != t * b {
                return Err(Error::InvalidArgument(format!(
                    "extras[{i}] has {} bytes; expected T x {b} = {}",
                    x.len(),
                    t * b
                )));
            }
        }
        let counts = plan::validate_ids(topk_ids, k, self.cfg.num_experts)?;
        self.expert_counts = counts;
        Ok(t)
    }

    /// Checks a dispatch's token count against the buffers (before any id is read).
    pub fn check_tokens(&self, t: usize) -> Result<()> {
        if self.fits(t) {
            Ok(())
        } else {
            Err(self.too_many_tokens(self.rank, t))
        }
    }

    /// Tokens this rank routed to each physical expert in the last dispatch (counted while the
    /// ids were validated: EPLB load recording needs no second pass over topk_ids).
    pub fn expert_counts(&self) -> &[u32] {
        &self.expert_counts
    }

    /// Whether the last dispatch received every row (hidden, FP8 scales, extra payloads) in
    /// the group's shared memory, stored there by its source: no copy through the kernel and
    /// one copy per byte. False before a dispatch and on groups without shared memory.
    pub fn dispatch_in_shared_memory(&self) -> bool {
        self.plan.is_some() && self.recv_shared
    }

    /// The receive side of the last dispatch.
    pub fn view(&self) -> DispatchView<'_> {
        static EMPTY: Plan = Plan {
            buffer_rows: 0,
            received_rows: 0,
            give: Vec::new(),
            take: Vec::new(),
            combine_take: Vec::new(),
            row_ids: Vec::new(),
            row_weights: Vec::new(),
            counts: Vec::new(),
            offsets: Vec::new(),
            src_rank: Vec::new(),
            src_token: Vec::new(),
        };
        let p = self.plan.as_ref().unwrap_or(&EMPTY);
        let with_ids = self.contract.topk_ids != Ids::None;
        DispatchView {
            layout: self.contract.layout,
            hidden: &self.hidden[..p.buffer_rows * self.wire_row_bytes()],
            shape: &self.shape,
            received_rows: p.received_rows,
            topk_ids: if with_ids { &p.row_ids } else { &[] },
            topk_weights: &p.row_weights,
            counts: &p.counts,
            expert_offsets: &p.offsets,
            src_rank: &p.src_rank,
            src_token: &p.src_token,
            extras: &self.extras,
        }
    }

    /// The shapes of the last dispatch's outputs (all empty before one).
    pub fn output_shapes(&self) -> Shapes {
        self.plan.as_ref().map_or_else(Shapes::default, |p| {
            self.contract
                .shapes(&self.geo, self.cfg.hidden, p.buffer_rows)
        })
    }

    /// Rows (of `hidden` elements) combine expects: the dispatch buffer's rows.
    pub fn combine_rows(&self) -> Option<usize> {
        self.plan.as_ref().map(|p| p.buffer_rows)
    }

    /// Tokens of this rank in the last dispatch (rows of combine's output).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Brings the expert outputs home and reduces them. `expert_output` has the dispatch
    /// buffer's rows (see [`Manager::combine_rows`]) of `hidden` elements of `expert_dtype`;
    /// `out` gets `[T, hidden]` of `out_dtype`. Collective.
    pub fn combine(
        &mut self,
        g: &mut dyn Group,
        expert_output: &[u8],
        out: &mut [u8],
    ) -> Result<()> {
        let _rank = crate::log::rank_scope(self.rank);
        let _call = crate::call::scope("combine");
        self.check_group(g)?;
        self.over_group(g, |m, g| m.combine_on(g, expert_output, out))
    }

    /// [`Manager::combine`] over the group in use (the survivors' after a failure), one user
    /// call of the group as [`Manager::dispatch_on`] is.
    fn combine_on(
        &mut self,
        g: &mut dyn Group,
        expert_output: &[u8],
        out: &mut [u8],
    ) -> Result<()> {
        g.open_call();
        let out = self.combine_ops(g, expert_output, out);
        g.close_call(out)
    }

    fn combine_ops(
        &mut self,
        g: &mut dyn Group,
        expert_output: &[u8],
        out: &mut [u8],
    ) -> Result<()> {
        let start = Instant::now();
        let checked = self.validate_combine(expert_output, out);
        if let Err(e) = checked {
            return Err(self.reject_combine_on(g, e));
        }
        self.agree_riding(g, "combine", self.header(true, self.tokens))?;
        crate::fault::point("combine");
        let plan = self
            .plan
            .as_ref()
            .ok_or_else(|| Error::Internal("combine: the dispatch plan went missing".into()))?;
        let h = self.cfg.hidden;
        self.zero_copy.note_combine(expert_output);
        g.reduce_rows(RowReduce {
            src: expert_output,
            kind: self.cfg.expert_dtype,
            row_elems: h,
            give: &plan.take,
            out,
            out_kind: self.cfg.out_dtype,
            take: &plan.combine_take,
        })?;
        let rb = (h * self.cfg.expert_dtype.size()) as u64;
        self.stats.combine_bytes_received = plan
            .combine_take
            .iter()
            .map(|v| v.len() as u64 * rb)
            .collect();
        self.stats.combine_time = start.elapsed();
        Ok(())
    }

    fn validate_combine(&self, expert_output: &[u8], out: &[u8]) -> Result<()> {
        let Some(plan) = self.plan.as_ref() else {
            return Err(self.no_dispatch_error());
        };
        let h = self.cfg.hidden;
        let (ek, ok) = (self.cfg.expert_dtype, self.cfg.out_dtype);
        let want_in = plan.buffer_rows * h * ek.size();
        byte_len("expert_output", expert_output.len(), want_in, || {
            let rows = plan.buffer_rows;
            format!("{rows} rows x {h} {} elements = {want_in} bytes (the shape of the dispatch output)", ek.name())
        })?;
        let want_out = self.tokens * h * ok.size();
        byte_len("output", out.len(), want_out, || {
            let t = self.tokens;
            format!(
                "T x hidden = {t} x {h} {} elements = {want_out} bytes",
                ok.name()
            )
        })
    }
}

/// The header words of one rank's header message.
fn header_words(c: &[u8]) -> [u64; HEADER_WORDS] {
    let mut h = [0u64; HEADER_WORDS];
    h.iter_mut()
        .zip(bytes::words(&c[..HEADER_WORDS * 8]))
        .for_each(|(h, w)| *h = w);
    h
}

/// Every rank's checks of the gathered headers (`live[r]`: rank r takes part): the same call,
/// no rejected input, the same configuration as this rank's (`mine`).
fn check_headers(
    group: &str,
    rank: usize,
    what: &str,
    mine: &[u64; HEADER_WORDS],
    headers: &[[u64; HEADER_WORDS]],
    live: &[bool],
) -> Result<()> {
    let live = |r: &usize| live.get(*r).copied().unwrap_or(true);
    check_same_call(group, headers, live)?;
    if let Some(r) = (0..headers.len())
        .filter(live)
        .find(|&r| headers[r][0] == 0)
    {
        return Err(Error::InvalidArgument(format!(
            "{what}: rank {r} rejected its input (see that rank's error); no data was exchanged"
        )));
    }
    const NAMES: [&str; HEADER_WORDS] = [
        "",
        "",
        "top_k",
        "num_experts",
        "hidden row bytes",
        "max_tokens_per_rank",
        "layout",
        "number of extra payloads",
        "extra payload bytes",
        "expert dtype",
        "apply_router_weight_on_input",
        "backend",
        "hidden dtype",
        "out dtype",
        "dispatch fp8",
        "fault tolerance",
        "call",
    ];
    // Dtypes by name (word 9 is a FloatKind, words 12 and 13 DType words).
    let show = |i: usize, w: u64| match i {
        9 => [FloatKind::F32, FloatKind::Bf16, FloatKind::F16]
            .into_iter()
            .find(|k| *k as u64 == w)
            .map_or_else(|| w.to_string(), |k| k.dtype().torch_name()),
        12 | 13 => dtype_of_word(w).torch_name(),
        14 => fp8::Scales::describe(w).to_string(),
        15 => (if w == 1 { "on" } else { "off" }).to_string(),
        _ => w.to_string(),
    };
    for (r, h) in headers.iter().enumerate().filter(|(r, _)| live(r)) {
        for i in 2..CALL_WORD {
            if h[i] != mine[i] {
                return Err(Error::InvalidArgument(format!(
                    "{what}: rank {r} has {} = {} but rank {rank} has {}; every rank must create the manager with the same backend and configuration",
                    NAMES[i],
                    show(i, h[i]),
                    show(i, mine[i])
                )));
            }
        }
    }
    Ok(())
}

/// `what` must have `want` bytes; the error says what was `expected`.
fn byte_len(what: &str, got: usize, want: usize, expected: impl FnOnce() -> String) -> Result<()> {
    if got == want {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "{what} has {got} bytes; expected {}",
        expected()
    )))
}

/// Worst-case bytes of the dispatch receive buffers for `tokens` tokens per rank (hidden rows,
/// extras and per-row metadata), plus combine's accumulator, before anything is allocated;
/// `None` when the figure does not fit in 64 bits.
pub fn buffer_bytes(layout: Layout, cfg: &MoeConfig, world: usize, tokens: usize) -> Option<usize> {
    let geo = Geometry {
        world,
        num_experts: cfg.num_experts,
        experts_per_rank: cfg.num_experts / world.max(1),
        top_k: cfg.top_k,
        max_tokens: if cfg.max_tokens_per_rank > 0 {
            cfg.max_tokens_per_rank
        } else {
            tokens
        },
    };
    // MoonEP's buffers are not epcomm's: only combine's accumulator counts.
    let (rows, meta_per_row) = match layout::contract(layout) {
        Some(c) => (
            c.worst_case_rows(&geo, tokens)?,
            c.meta_bytes_per_row(cfg.top_k)?,
        ),
        None => (0, 0),
    };
    let extras = cfg
        .extra_row_bytes
        .iter()
        .try_fold(0usize, |a, &b| a.checked_add(b))?;
    let row = cfg
        .hidden
        .checked_mul(cfg.hidden_dtype.bits as usize / 8)?
        .checked_add(extras)?
        .checked_add(meta_per_row)?;
    rows.checked_mul(row)?
        .checked_add(tokens.checked_mul(cfg.hidden)?.checked_mul(4)?)
}

/// The one wording of a rank dispatching more than M tokens in a fixed-capacity layout (the
/// CPU manager and the GPU pipeline).
pub(crate) fn too_many_tokens(
    rank: usize,
    t: usize,
    max_tokens_per_rank: usize,
    backend: Backend,
    layout: Layout,
) -> Error {
    Error::InvalidArgument(format!(
        "dispatch: rank {rank} has {t} tokens, more than max_tokens_per_rank = {max_tokens_per_rank} of the {} backend ({} buffers hold M tokens per source rank)",
        backend.name(),
        layout.name()
    ))
}

/// Fails alike on every rank when the live ranks' headers name different calls (one rank's
/// dispatch paired with another's combine): INVALID_STATE, the same text everywhere.
fn check_same_call(
    group: &str,
    headers: &[[u64; HEADER_WORDS]],
    live: impl Fn(&usize) -> bool,
) -> Result<()> {
    let call = |w: u64| if w == 1 { "dispatch" } else { "combine" };
    let mut ranks = (0..headers.len()).filter(|r| live(r));
    let Some(first) = ranks.next() else {
        return Ok(());
    };
    let want = headers[first][CALL_WORD];
    match ranks.find(|&r| headers[r][CALL_WORD] != want) {
        None => Ok(()),
        Some(r) => Err(Error::InvalidState(format!(
            "ranks of group '{group}' called different collectives: rank {first} calls {} but rank {r} calls {}; every rank must call the same collectives in the same order (no data was exchanged)",
            call(want),
            call(headers[r][CALL_WORD])
        ))),
    }
}
