//! The CUDA kernels of the GPU path as data: header-free CUDA C sources
//! (`include_str!`'d from `src/gpu/kernels/*.cu`), the specialisations to compile, each entry
//! point's exact parameter list (for the host-side launcher), and the device error word.
//!
//! Pure Rust, always built (no `cuda` feature needed): `tests/gpu_kernels.rs` compiles every
//! [`variants`] entry with NVRTC ([`crate::gpu::nvrtc`]) on CPU-only CI.
//!
//! # Data flow (NCCL two-sided path; row orders of docs/design.md, section 3)
//! Sender: [`EP_LAYOUT`] → flags → [`EP_SCAN_BLOCK`] (positions, exclusive scan with the total
//! appended) → [`EP_PACK`] into a send buffer grouped by destination rank, then token. Wire
//! metadata per row: ids int32 `[TOPK]`, weights f32 `[TOPK]`, source token int32. Receiver rows
//! are ordered by source rank, then token (the deterministic order of every layout):
//! [`EP_RECV_FLAGS`] → scan → one `ep_unpack_*` per layout. Combine runs the plan backwards:
//! `ep_combine_return_*` on the expert rank, then [`EP_WEIGHTED_COMBINE`] (expert layouts: the
//! source applies the weights, f32, fixed k order) or [`EP_SUM_RANKS`] (TOKEN_MAJOR, RANK_MAJOR,
//! REPLICATED: unweighted sum in rank order). REPLICATED's all-gather is [`EP_LOCAL_COPY`].
//!
//! # Launch conventions
//! Every kernel is grid-stride, so any grid works; "warp per row" kernels want
//! `blockDim.x % 32 == 0`. Pointers are raw device addresses (`u64`, `CUdeviceptr`), `int` is
//! `i32`, `u64` is `unsigned long long`. Nullable pointers may be 0. Counters the kernels
//! `atomicAdd` into must be zeroed by the caller first. `TOPK` ≤ [`MAX_TOPK`].

use std::fmt;

use crate::error::Error;

/// Prepended to every module: types, bf16/f16 bit helpers, error word, row copy.
pub const PRELUDE_CU: &str = include_str!("kernels/prelude.cu");
/// `ep_layout`, `ep_pair_rows`, `ep_recv_flags`.
pub const LAYOUT_CU: &str = include_str!("kernels/layout.cu");
/// `ep_scan_block`, `ep_scan_add`.
pub const SCAN_CU: &str = include_str!("kernels/scan.cu");
/// `ep_pack`, `ep_local_copy`.
pub const PACK_CU: &str = include_str!("kernels/pack.cu");
/// `ep_unpack_*`.
pub const UNPACK_CU: &str = include_str!("kernels/unpack.cu");
/// `ep_combine_return_*`, `ep_weighted_combine`, `ep_sum_ranks`.
pub const COMBINE_CU: &str = include_str!("kernels/combine.cu");
/// `ep_epoch_bump`, `ep_signal`, `ep_wait`.
pub const SIGNAL_CU: &str = include_str!("kernels/signal.cu");

/// The largest top-k the kernels support (one warp lane per k in the row kernels).
pub const MAX_TOPK: u32 = 32;
/// Top-k values [`variants`] lists for the CI compile check (others compile on demand with
/// [`Variant`] constructors; the code is the same apart from unrolling). Kept to two so the
/// check stays fast on 2 cores; TOPK=32 was checked by hand (NVRTC 12.8, sm_90: no spills,
/// 80 registers in `ep_layout`, 96 in `ep_weighted_combine`).
const CI_TOPK: [u32; 2] = [1, 8];
/// Threads per block `ep_scan_block` must be launched with.
pub const SCAN_THREADS: u32 = 256;
/// Elements one `ep_scan_block` block scans (`SCAN_THREADS * 4`).
pub const SCAN_TILE: u32 = 1024;

/// A source file of kernels (one NVRTC program each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Module {
    /// Routing metadata (sender and receiver).
    Layout,
    /// Prefix sums.
    Scan,
    /// Send-buffer packing and plain copies.
    Pack,
    /// Receive buffer → layouts.
    Unpack,
    /// Return path and reductions.
    Combine,
    /// One-sided epochs, signal and bounded wait.
    Signal,
}

impl Module {
    /// Every module.
    pub const ALL: [Module; 6] = [
        Module::Layout,
        Module::Scan,
        Module::Pack,
        Module::Unpack,
        Module::Combine,
        Module::Signal,
    ];

    /// Short name (file stem).
    pub fn name(self) -> &'static str {
        match self {
            Module::Layout => "layout",
            Module::Scan => "scan",
            Module::Pack => "pack",
            Module::Unpack => "unpack",
            Module::Combine => "combine",
            Module::Signal => "signal",
        }
    }

    /// The module's CUDA source (without the prelude).
    pub fn body(self) -> &'static str {
        match self {
            Module::Layout => LAYOUT_CU,
            Module::Scan => SCAN_CU,
            Module::Pack => PACK_CU,
            Module::Unpack => UNPACK_CU,
            Module::Combine => COMBINE_CU,
            Module::Signal => SIGNAL_CU,
        }
    }

    /// The entry points this module defines.
    pub fn kernels(self) -> Vec<&'static KernelSig> {
        ALL_KERNELS
            .iter()
            .copied()
            .filter(|k| k.module == self)
            .collect()
    }
}

/// The dtype of `topk_ids` (and of the ids a layout outputs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdDtype {
    /// int32 (`ID_DTYPE=0`).
    I32,
    /// int64 (`ID_DTYPE=1`).
    I64,
}

/// A floating-point payload dtype for the reductions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FloatDtype {
    /// float32 (code 0).
    F32,
    /// bfloat16 (code 1).
    Bf16,
    /// float16 (code 2).
    F16,
}

impl FloatDtype {
    /// Every float dtype.
    pub const ALL: [FloatDtype; 3] = [FloatDtype::F32, FloatDtype::Bf16, FloatDtype::F16];

    /// The `IN_DTYPE` / `OUT_DTYPE` code.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            FloatDtype::F32 => "f32",
            FloatDtype::Bf16 => "bf16",
            FloatDtype::F16 => "f16",
        }
    }
}

/// One specialisation to compile: a module plus its `#define`s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Variant {
    /// Which source.
    pub module: Module,
    /// `ID_DTYPE` (layout, pack, unpack).
    pub id_dtype: Option<IdDtype>,
    /// `TOPK` (all but scan and signal).
    pub topk: Option<u32>,
    /// `IN_DTYPE` (combine: dtype of the expert outputs).
    pub in_dtype: Option<FloatDtype>,
    /// `OUT_DTYPE` (combine: dtype written).
    pub out_dtype: Option<FloatDtype>,
}

impl Variant {
    fn plain(module: Module) -> Variant {
        Variant {
            module,
            id_dtype: None,
            topk: None,
            in_dtype: None,
            out_dtype: None,
        }
    }

    /// `layout.cu` for an id dtype and top-k.
    pub fn layout(id: IdDtype, topk: u32) -> Variant {
        Variant {
            id_dtype: Some(id),
            topk: Some(topk),
            ..Variant::plain(Module::Layout)
        }
    }

    /// `pack.cu` for an id dtype and top-k.
    pub fn pack(id: IdDtype, topk: u32) -> Variant {
        Variant {
            id_dtype: Some(id),
            topk: Some(topk),
            ..Variant::plain(Module::Pack)
        }
    }

    /// `unpack.cu` for an (output) id dtype and top-k.
    pub fn unpack(id: IdDtype, topk: u32) -> Variant {
        Variant {
            id_dtype: Some(id),
            topk: Some(topk),
            ..Variant::plain(Module::Unpack)
        }
    }

    /// `combine.cu` for input/output dtypes and top-k.
    pub fn combine(input: FloatDtype, output: FloatDtype, topk: u32) -> Variant {
        Variant {
            topk: Some(topk),
            in_dtype: Some(input),
            out_dtype: Some(output),
            ..Variant::plain(Module::Combine)
        }
    }

    /// `scan.cu`.
    pub fn scan() -> Variant {
        Variant::plain(Module::Scan)
    }

    /// `signal.cu`.
    pub fn signal() -> Variant {
        Variant::plain(Module::Signal)
    }

    /// A readable name, e.g. `combine.bf16-f32.k8`.
    pub fn name(&self) -> String {
        let mut s = self.module.name().to_string();
        if let Some(id) = self.id_dtype {
            s.push_str(match id {
                IdDtype::I32 => ".i32",
                IdDtype::I64 => ".i64",
            });
        }
        if let (Some(i), Some(o)) = (self.in_dtype, self.out_dtype) {
            s.push_str(&format!(".{}-{}", i.name(), o.name()));
        }
        if let Some(k) = self.topk {
            s.push_str(&format!(".k{k}"));
        }
        s
    }

    /// `-D` options for this variant.
    pub fn defines(&self) -> Vec<String> {
        let mut d = Vec::new();
        if let Some(k) = self.topk {
            d.push(format!("-DTOPK={k}"));
        }
        if let Some(id) = self.id_dtype {
            d.push(format!("-DID_DTYPE={}", id as u32));
        }
        if let Some(t) = self.in_dtype {
            d.push(format!("-DIN_DTYPE={}", t.code()));
        }
        if let Some(t) = self.out_dtype {
            d.push(format!("-DOUT_DTYPE={}", t.code()));
        }
        d
    }

    /// Checks the variant's parameters (top-k in `1..=MAX_TOPK`, required fields present).
    pub fn validate(&self) -> Result<(), Error> {
        let needs_topk = !matches!(self.module, Module::Scan | Module::Signal);
        match self.topk {
            Some(k) if !(1..=MAX_TOPK).contains(&k) => {
                return Err(Error::InvalidArgument(format!(
                    "GPU kernels support top_k in [1, {MAX_TOPK}], got {k}"
                )))
            }
            None if needs_topk => {
                return Err(Error::InvalidArgument(format!(
                    "kernel variant {} needs a top_k",
                    self.name()
                )))
            }
            _ => {}
        }
        Ok(())
    }
}

/// Every specialisation the CI compile check builds: layout/pack/unpack for each id dtype and
/// `CI_TOPK` (1 and 8), combine for each (in, out) float dtype pair and `CI_TOPK`, scan, signal.
pub fn variants() -> Vec<Variant> {
    let ids = [IdDtype::I32, IdDtype::I64];
    let mut v = Vec::new();
    for k in CI_TOPK {
        for id in ids {
            v.push(Variant::layout(id, k));
            v.push(Variant::pack(id, k));
            v.push(Variant::unpack(id, k));
        }
        for i in FloatDtype::ALL {
            for o in FloatDtype::ALL {
                v.push(Variant::combine(i, o, k));
            }
        }
    }
    v.push(Variant::scan());
    v.push(Variant::signal());
    v
}

/// The full source (prelude + module) and NVRTC options (`-std=c++17` and the `-D`s) of a
/// variant. Add `--ptxas-options=-v` to get register/spill figures in the log.
pub fn source(v: &Variant) -> (String, Vec<String>) {
    let mut src = String::with_capacity(PRELUDE_CU.len() + v.module.body().len() + 64);
    src.push_str(PRELUDE_CU);
    src.push_str(&format!("\n// ---- module {} ----\n", v.module.name()));
    src.push_str(v.module.body());
    let mut opts = vec!["-std=c++17".to_string()];
    opts.extend(v.defines());
    if crate::env::nvrtc_lineinfo() {
        // Source lines in compute-sanitizer and profiler reports; no effect on the code.
        opts.push("-lineinfo".to_string());
    }
    (src, opts)
}

// ---- entry points ---------------------------------------------------------------------------

/// Element type behind a pointer parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    /// Raw bytes (rows of any dtype).
    U8,
    /// int32.
    I32,
    /// uint32 (epochs, flags).
    U32,
    /// uint64 (error word, device addresses).
    U64,
    /// float32.
    F32,
    /// The variant's id dtype (`ID_DTYPE`).
    Id,
    /// The variant's `IN_DTYPE`.
    In,
    /// The variant's `OUT_DTYPE`.
    Out,
}

/// How a parameter is passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamType {
    /// A device pointer (`CUdeviceptr`, 8 bytes).
    Ptr {
        /// Element type.
        elem: Elem,
        /// Written by the kernel.
        written: bool,
        /// May be 0 (NULL).
        nullable: bool,
    },
    /// `int` (4 bytes).
    I32,
    /// `unsigned long long` (8 bytes).
    U64,
}

impl ParamType {
    /// Size of the argument value in bytes (what `cuLaunchKernel` copies).
    pub fn size(self) -> usize {
        match self {
            ParamType::I32 => 4,
            ParamType::Ptr { .. } | ParamType::U64 => 8,
        }
    }
}

/// One kernel parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param {
    /// Name as in the `.cu` source.
    pub name: &'static str,
    /// Type.
    pub ty: ParamType,
}

/// An entry point: name, module and parameters in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSig {
    /// `extern "C"` symbol name.
    pub name: &'static str,
    /// Module that defines it.
    pub module: Module,
    /// Parameters, in order.
    pub params: &'static [Param],
    /// How work maps onto the grid.
    pub grid: &'static str,
}

const fn p(name: &'static str, elem: Elem) -> Param {
    Param {
        name,
        ty: ParamType::Ptr {
            elem,
            written: false,
            nullable: false,
        },
    }
}
const fn w(name: &'static str, elem: Elem) -> Param {
    Param {
        name,
        ty: ParamType::Ptr {
            elem,
            written: true,
            nullable: false,
        },
    }
}
const fn wn(name: &'static str, elem: Elem) -> Param {
    Param {
        name,
        ty: ParamType::Ptr {
            elem,
            written: true,
            nullable: true,
        },
    }
}
const fn pn(name: &'static str, elem: Elem) -> Param {
    Param {
        name,
        ty: ParamType::Ptr {
            elem,
            written: false,
            nullable: true,
        },
    }
}
const fn i(name: &'static str) -> Param {
    Param {
        name,
        ty: ParamType::I32,
    }
}
const fn u(name: &'static str) -> Param {
    Param {
        name,
        ty: ParamType::U64,
    }
}

/// One kernel argument. Device pointers are `u64` addresses (0 = NULL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arg {
    /// A device pointer.
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `unsigned long long`.
    U64(u64),
}

impl Arg {
    /// The 8-byte parameter slot `cuLaunchKernel` reads (an `int` is the slot's low 4
    /// bytes, little-endian).
    pub fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) | Arg::U64(p) => p,
            Arg::I32(v) => u64::from(v as u32),
        }
    }
}

/// The Rust type of a parameter kind (`p`, `w`, `pn`, `wn`: pointers; `i`: int; `u`: u64).
macro_rules! arg_type {
    (i) => {
        i32
    };
    (u) => {
        u64
    };
    ($ptr:ident) => {
        u64
    };
}

/// The [`Arg`] of a value of a parameter kind.
macro_rules! arg_of {
    (i, $v:expr) => {
        Arg::I32($v)
    };
    (u, $v:expr) => {
        Arg::U64($v)
    };
    ($ptr:ident, $v:expr) => {
        Arg::Ptr($v)
    };
}

/// The parameter's name in the `.cu` source: the field's, unless renamed (`in` is a Rust
/// keyword).
macro_rules! c_name {
    ($field:ident) => {
        stringify!($field)
    };
    ($field:ident, $name:literal) => {
        $name
    };
}

/// The one declaration of every entry point: from it come the [`KernelSig`] table (checked
/// against the `.cu` sources by tests/gpu_kernels.rs) and a typed argument struct whose
/// fields are the parameters in order (`args()` gives the launch's [`Arg`]s), which the
/// launch builders of [`crate::gpu::calls`] take.
macro_rules! entry_points {
    ($(
        $(#[doc = $doc:literal])*
        $sig:ident / $args:ident = $name:literal in $module:ident, $grid:literal {
            $( $field:ident $(= $cname:literal)? : $kind:ident $(($elem:ident))? ),* $(,)?
        }
    )*) => {
        $(
            $(#[doc = $doc])*
            pub const $sig: KernelSig = KernelSig {
                name: $name,
                module: Module::$module,
                params: &[ $( $kind(c_name!($field $(, $cname)?) $(, Elem::$elem)?) ),* ],
                grid: $grid,
            };

            #[doc = concat!("The arguments of `", $name, "`, in its order (the `.cu` names).")]
            #[allow(non_snake_case)]
            #[derive(Debug, Clone, Copy, PartialEq, Eq)]
            pub struct $args {
                $(
                    #[doc = concat!("`", c_name!($field $(, $cname)?), "`.")]
                    pub $field: arg_type!($kind),
                )*
            }

            impl $args {
                /// The launch arguments, in the entry point's order.
                pub fn args(&self) -> Vec<Arg> {
                    vec![ $( arg_of!($kind, self.$field) ),* ]
                }
            }
        )*

        /// Every entry point.
        pub const ALL_KERNELS: &[&KernelSig] = &[ $( &$sig ),* ];
    };
}

entry_points! {
    /// Sender layout: `rank_flag[R*T]`, `pair_flag[R*T*TOPK]`, `rank_counts[R]`,
    /// `expert_counts[E]` (EPLB load), validation into `err`. Thread per token.
    EP_LAYOUT / LayoutArgs = "ep_layout" in Layout, "thread per token" {
        topk_ids: p(Id),
        T: i,
        E: i,
        E_local: i,
        R: i,
        rank_flag: w(I32),
        pair_flag: wn(I32),
        rank_counts: wn(I32),
        expert_counts: wn(I32),
        err: wn(U64),
    }

    /// `rows[T*TOPK]` = row of (t, k) in the combine receive buffer, -1 if masked.
    EP_PAIR_ROWS / PairRowsArgs = "ep_pair_rows" in Layout, "thread per (t, k)" {
        topk_ids: p(Id),
        T: i,
        E: i,
        E_local: i,
        pair_pos: p(I32),
        rows: w(I32),
    }

    /// Receiver flags: `expert_flag[E_local*N]`, `pair_flag[N*TOPK]`, `local_counts[E_local]`.
    EP_RECV_FLAGS / RecvFlagsArgs = "ep_recv_flags" in Layout, "thread per received row" {
        recv_ids: p(I32),
        N: i,
        E_local: i,
        rank: i,
        expert_flag: wn(I32),
        pair_flag: wn(I32),
        local_counts: wn(I32),
    }

    /// Exclusive scan of one [`SCAN_TILE`] per block; `out[n]` = (tile-local) total.
    /// Launch with exactly [`SCAN_THREADS`] threads and `ceil(n / SCAN_TILE)` blocks (≥ 1).
    EP_SCAN_BLOCK / ScanBlockArgs = "ep_scan_block" in Scan, "block per 1024-element tile, 256 threads" {
        input = "in": p(I32),
        out: w(I32),
        n: u,
        block_sums: wn(I32),
    }

    /// Adds each tile's offset (`offsets[tile]`, the scanned `block_sums`) to `out[0..=n]`.
    EP_SCAN_ADD / ScanAddArgs = "ep_scan_add" in Scan, "thread per element" {
        out: w(I32),
        n: u,
        offsets: p(I32),
    }

    /// Rows (+ wire ids, weights, source token) into the send buffer grouped by destination.
    EP_PACK / PackArgs = "ep_pack" in Pack, "warp per (rank, token)" {
        rows: p(U8),
        row_bytes: u,
        topk_ids: pn(Id),
        topk_weights: pn(F32),
        T: i,
        R: i,
        rank_flag: p(I32),
        send_pos: p(I32),
        send_rows: w(U8),
        send_ids: wn(I32),
        send_weights: wn(F32),
        send_src: wn(I32),
    }

    /// Byte copy with the whole grid (self traffic, REPLICATED all-gather).
    EP_LOCAL_COPY / LocalCopyArgs = "ep_local_copy" in Pack, "thread per 16/4/1-byte unit" {
        dst: w(U8),
        src: p(U8),
        bytes: u,
    }

    /// TOKEN_MAJOR: rows (optional copy), filtered ids (-1) and weights (0).
    EP_UNPACK_TOKEN_MAJOR / UnpackTokenMajorArgs = "ep_unpack_token_major" in Unpack, "warp per received row" {
        recv_rows: p(U8),
        recv_ids: p(I32),
        recv_w: p(F32),
        N: i,
        row_bytes: u,
        E_local: i,
        rank: i,
        out_rows: wn(U8),
        out_ids: w(Id),
        out_w: w(F32),
    }

    /// EXPERT_MAJOR: fixed-capacity buckets `[E_local, capacity, row]` + `counts[E_local]`.
    EP_UNPACK_EXPERT_MAJOR / UnpackExpertMajorArgs = "ep_unpack_expert_major" in Unpack, "warp per (local expert, received row)" {
        recv_rows: p(U8),
        recv_ids: p(I32),
        recv_w: p(F32),
        recv_src: p(I32),
        recv_offsets: p(I32),
        N: i,
        R: i,
        row_bytes: u,
        E_local: i,
        rank: i,
        expert_flag: p(I32),
        expert_pos: p(I32),
        capacity: i,
        out_rows: w(U8),
        counts: w(I32),
        out_w: wn(F32),
        out_src_rank: wn(I32),
        out_src_token: wn(I32),
        err: wn(U64),
    }

    // Its first twelve parameters are EXPERT_MAJOR's (both call unpack.cu's ep_unpack_expert):
    // each table is its kernel's own signature, as tests/gpu_kernels.rs checks against the .cu.
    /// EXPERT_PACKED: exact rows grouped by expert + `expert_offsets[E_local+1]`, weight, source.
    EP_UNPACK_EXPERT_PACKED / UnpackExpertPackedArgs = "ep_unpack_expert_packed" in Unpack, "warp per (local expert, received row)" {
        recv_rows: p(U8),
        recv_ids: p(I32),
        recv_w: p(F32),
        recv_src: p(I32),
        recv_offsets: p(I32),
        N: i,
        R: i,
        row_bytes: u,
        E_local: i,
        rank: i,
        expert_flag: p(I32),
        expert_pos: p(I32),
        out_rows: w(U8),
        expert_offsets: w(I32),
        out_w: wn(F32),
        out_src_rank: wn(I32),
        out_src_token: wn(I32),
    }

    /// RANK_MAJOR: `[R, M, row]`, ids/weights (padding ids -1), `recv_counts[R]`.
    EP_UNPACK_RANK_MAJOR / UnpackRankMajorArgs = "ep_unpack_rank_major" in Unpack, "warp per (source, slot)" {
        recv_rows: p(U8),
        recv_ids: p(I32),
        recv_w: p(F32),
        recv_offsets: p(I32),
        R: i,
        M: i,
        row_bytes: u,
        out_rows: w(U8),
        out_ids: w(Id),
        out_w: w(F32),
        recv_counts: w(I32),
        err: wn(U64),
    }

    /// Expert layouts: expert output rows back into wire order (per (row, k) pair).
    EP_COMBINE_RETURN_EXPERT / CombineReturnExpertArgs = "ep_combine_return_expert" in Combine, "warp per (received row, k)" {
        y: p(U8),
        row_bytes: u,
        recv_ids: p(I32),
        N: i,
        E_local: i,
        rank: i,
        expert_pos: p(I32),
        capacity: i,
        pair_pos: p(I32),
        send_rows: w(U8),
    }

    /// RANK_MAJOR: `[R, M, row]` back into wire order.
    EP_COMBINE_RETURN_RANK_MAJOR / CombineReturnRankMajorArgs = "ep_combine_return_rank_major" in Combine, "warp per (source, slot)" {
        y: p(U8),
        row_bytes: u,
        recv_offsets: p(I32),
        R: i,
        M: i,
        send_rows: w(U8),
    }

    /// `out[t] = Σ_k w[t,k]·y[rows[t,k]]`, f32, fixed k order.
    EP_WEIGHTED_COMBINE / WeightedCombineArgs = "ep_weighted_combine" in Combine, "block per token, threads over H" {
        y: p(In),
        rows: p(I32),
        w: p(F32),
        T: i,
        H: i,
        out: w(Out),
    }

    /// `out[t] = Σ_r y[row(r, t)]` in rank order (unweighted).
    EP_SUM_RANKS / SumRanksArgs = "ep_sum_ranks" in Combine, "block per token, threads over H" {
        y: p(In),
        rank_flag: pn(I32),
        send_pos: pn(I32),
        T: i,
        R: i,
        H: i,
        out: w(Out),
    }

    /// `epoch[0]` = the next epoch (`onesided::Epoch::next`: 0 is skipped on wraparound).
    EP_EPOCH_BUMP / EpochBumpArgs = "ep_epoch_bump" in Signal, "one thread" {
        epoch: w(U32),
    }

    /// Release-store `*epoch` into each peer's flag slot (`peer_flags[r]` = device address, 0 = skip).
    EP_SIGNAL / SignalArgs = "ep_signal" in Signal, "thread per peer" {
        peer_flags: p(U64),
        R: i,
        epoch: p(U32),
    }

    /// Acquire-spin until `flags[r]` reaches `*epoch` (`onesided::epoch_reached`: wrap-safe, a
    /// zero flag never counts), bounded by `timeout_ns` of `%globaltimer`; a timeout writes
    /// `{ERR_WAIT_TIMEOUT, peer}` into `err`.
    EP_WAIT / WaitArgs = "ep_wait" in Signal, "thread per peer" {
        flags: p(U32),
        R: i,
        epoch: p(U32),
        timeout_ns: u,
        err: wn(U64),
    }
}

/// Parses the `extern "C" __global__` entry points of a CUDA source: (name, [(type, name)]).
/// Used by the tests to check the [`KernelSig`] tables against the `.cu` files.
pub fn parse_entry_points(src: &str) -> Vec<(String, Vec<(String, String)>)> {
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(pos) = rest.find("extern \"C\" __global__") {
        rest = &rest[pos + 21..];
        // Skip `__launch_bounds__(...)`, the only other parenthesis before the parameters.
        if let Some(lb) = rest.find("__launch_bounds__(") {
            if rest[..lb].trim().is_empty() || rest[..lb].trim() == "void" {
                let after = lb + "__launch_bounds__(".len();
                let Some(end) = rest[after..].find(')') else {
                    break;
                };
                rest = &rest[after + end + 1..];
            }
        }
        let Some(open) = rest.find('(') else { break };
        let Some(close) = rest[open..].find(')') else {
            break;
        };
        let head = &rest[..open];
        let name = head
            .split_whitespace()
            .last()
            .unwrap_or_default()
            .to_string();
        let params = rest[open + 1..open + close]
            .split(',')
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|p| !p.is_empty())
            .map(|p| {
                let name = p.rsplit([' ', '*']).next().unwrap_or_default().to_string();
                let ty = p[..p.len() - name.len()].trim().to_string();
                (ty, name)
            })
            .collect();
        out.push((name, params));
        rest = &rest[open + close..];
    }
    out
}

// ---- device error word ------------------------------------------------------------------------

/// Code: a `topk_ids` entry is < -1 or ≥ E (a = token, b = k).
pub const ERR_ID_OUT_OF_RANGE: u8 = 1;
/// Code: a token names one expert twice (a = token, b = k of the second occurrence).
pub const ERR_DUPLICATE_ID: u8 = 2;
/// Code: an EXPERT_MAJOR bucket is full (a = received row, b = local expert).
pub const ERR_CAPACITY: u8 = 3;
/// Code: a one-sided wait timed out (a = peer rank).
pub const ERR_WAIT_TIMEOUT: u8 = 4;
/// Code: a RANK_MAJOR region overflowed (a = source rank, b = rows it sent).
pub const ERR_RANK_CAPACITY: u8 = 5;
/// Code (host-made, never written by a kernel): the rank's dispatch input failed the host-side
/// checks before the counts all-gather; it sends this word in its counts row so its peers
/// return an error naming it instead of waiting (a = b = 0).
pub const ERR_HOST_REJECTED: u8 = 6;

/// Bit position of the code (8 bits) in the device error word.
pub const ERR_CODE_SHIFT: u32 = 56;
/// Bit position of `a` (32 bits: token, row or peer) in the device error word.
pub const ERR_A_SHIFT: u32 = 24;
/// Mask of `b` (the low 24 bits: k, expert, rows).
pub const ERR_B_MASK: u32 = 0x00ff_ffff;

/// The one declaration of the device error word: every `#define EP_ERR_*` of
/// `kernels/prelude.cu` with its value (the layout, then each code a kernel writes).
/// tests/gpu_kernels.rs parses the prelude against this table; the one-sided workspace's
/// error word ([`crate::gpu::onesided::ErrorWord`]) is this same word.
pub const ERROR_WORD_DEFINES: [(&str, u64); 8] = [
    ("EP_ERR_CODE_SHIFT", ERR_CODE_SHIFT as u64),
    ("EP_ERR_A_SHIFT", ERR_A_SHIFT as u64),
    ("EP_ERR_B_MASK", ERR_B_MASK as u64),
    ("EP_ERR_ID_OUT_OF_RANGE", ERR_ID_OUT_OF_RANGE as u64),
    ("EP_ERR_DUPLICATE_ID", ERR_DUPLICATE_ID as u64),
    ("EP_ERR_CAPACITY", ERR_CAPACITY as u64),
    ("EP_ERR_WAIT_TIMEOUT", ERR_WAIT_TIMEOUT as u64),
    ("EP_ERR_RANK_CAPACITY", ERR_RANK_CAPACITY as u64),
];

/// Builds an error word the way the kernels do: code in bits 63..56, `a` in 55..24, `b` (24
/// bits) in 23..0. 0 means "no error"; when several threads fail the word of the lowest
/// (a, b, code) is kept: the first bad (token, k), as the CPU validation reports.
pub fn encode_error_word(code: u8, a: u32, b: u32) -> u64 {
    (u64::from(code) << ERR_CODE_SHIFT) | (u64::from(a) << ERR_A_SHIFT) | u64::from(b & ERR_B_MASK)
}

/// A decoded device error word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceError {
    /// `topk_ids[token][k]` is outside `[-1, E)`.
    IdOutOfRange {
        /// Token index on the reporting rank.
        token: u32,
        /// Position in the top-k row.
        k: u32,
    },
    /// `topk_ids[token]` names an expert twice (`k` = second occurrence).
    DuplicateId {
        /// Token index.
        token: u32,
        /// Position of the repeat.
        k: u32,
    },
    /// EXPERT_MAJOR bucket overflow.
    Capacity {
        /// Received row that did not fit.
        row: u32,
        /// Local expert whose bucket was full.
        local_expert: u32,
    },
    /// A one-sided wait gave up.
    WaitTimeout {
        /// The peer rank that never signalled.
        peer: u32,
    },
    /// RANK_MAJOR region overflow.
    RankCapacity {
        /// Source rank.
        source: u32,
        /// Rows it sent.
        rows: u32,
    },
    /// The rank's input failed the host-side checks (code 6, sent in its counts row).
    HostRejected,
    /// A code this version does not know.
    Unknown {
        /// Raw code.
        code: u8,
        /// Raw `a`.
        a: u32,
        /// Raw `b`.
        b: u32,
    },
}

/// Decodes an error word; `None` for 0 (no error).
pub fn decode_error_word(word: u64) -> Option<DeviceError> {
    if word == 0 {
        return None;
    }
    let code = (word >> ERR_CODE_SHIFT) as u8;
    let a = (word >> ERR_A_SHIFT) as u32;
    let b = word as u32 & ERR_B_MASK;
    Some(match code {
        ERR_ID_OUT_OF_RANGE => DeviceError::IdOutOfRange { token: a, k: b },
        ERR_DUPLICATE_ID => DeviceError::DuplicateId { token: a, k: b },
        ERR_CAPACITY => DeviceError::Capacity {
            row: a,
            local_expert: b,
        },
        ERR_WAIT_TIMEOUT => DeviceError::WaitTimeout { peer: a },
        ERR_RANK_CAPACITY => DeviceError::RankCapacity { source: a, rows: b },
        ERR_HOST_REJECTED => DeviceError::HostRejected,
        _ => DeviceError::Unknown { code, a, b },
    })
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            DeviceError::IdOutOfRange { token, k } => write!(
                f,
                "topk_ids[{token}][{k}] is out of range: expected -1 (masked) or an expert id in [0, num_experts)"
            ),
            DeviceError::DuplicateId { token, k } => write!(
                f,
                "topk_ids[{token}] routes token {token} to one expert twice (entry {k} repeats an earlier one): the top-k experts of a token must be distinct"
            ),
            DeviceError::Capacity { row, local_expert } => write!(
                f,
                "expert bucket {local_expert} is full: received row {row} does not fit (more tokens than max_tokens_per_rank * world_size)"
            ),
            DeviceError::WaitTimeout { peer } => write!(
                f,
                "timed out waiting for rank {peer} to signal (peer dead, stuck or not participating)"
            ),
            DeviceError::RankCapacity { source, rows } => write!(
                f,
                "rank {source} sent {rows} rows, more than max_tokens_per_rank"
            ),
            DeviceError::HostRejected => write!(
                f,
                "its input failed the host-side checks (sizes, shapes, dtypes or alignment)"
            ),
            DeviceError::Unknown { code, a, b } => {
                write!(f, "unknown device error code {code} (a={a}, b={b})")
            }
        }
    }
}

impl DeviceError {
    /// The epcomm error for this condition (invalid argument for bad ids and capacity,
    /// timeout for a wait).
    pub fn to_error(&self) -> Error {
        match self {
            DeviceError::WaitTimeout { .. } => Error::Timeout(self.to_string()),
            DeviceError::Unknown { .. } => Error::Internal(self.to_string()),
            DeviceError::IdOutOfRange { .. }
            | DeviceError::DuplicateId { .. }
            | DeviceError::Capacity { .. }
            | DeviceError::RankCapacity { .. }
            | DeviceError::HostRejected => Error::InvalidArgument(self.to_string()),
        }
    }
}

/// A one-line description of an error word ("no device error" for 0).
pub fn describe_error_word(word: u64) -> String {
    decode_error_word(word).map_or_else(|| "no device error".to_string(), |e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_word_round_trip() {
        let w = encode_error_word(ERR_DUPLICATE_ID, 4096, 7);
        assert_eq!(
            decode_error_word(w),
            Some(DeviceError::DuplicateId { token: 4096, k: 7 })
        );
        assert_eq!(decode_error_word(0), None);
        assert_eq!(
            decode_error_word(encode_error_word(ERR_WAIT_TIMEOUT, 3, 0)),
            Some(DeviceError::WaitTimeout { peer: 3 })
        );
    }

    #[test]
    fn variant_names_are_unique() {
        let v = variants();
        let mut names: Vec<String> = v.iter().map(Variant::name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), v.len());
        assert!(v.iter().all(|x| x.validate().is_ok()));
    }
}
