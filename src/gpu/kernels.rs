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
pub const CI_TOPK: [u32; 2] = [1, 8];
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
/// [`CI_TOPK`], combine for each (in, out) float dtype pair and [`CI_TOPK`], scan, signal.
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

/// Sender layout: `rank_flag[R*T]`, `pair_flag[R*T*TOPK]`, `rank_counts[R]`,
/// `expert_counts[E]` (EPLB load), validation into `err`. Thread per token.
pub const EP_LAYOUT: KernelSig = KernelSig {
    name: "ep_layout",
    module: Module::Layout,
    params: &[
        p("topk_ids", Elem::Id),
        i("T"),
        i("E"),
        i("E_local"),
        i("R"),
        w("rank_flag", Elem::I32),
        wn("pair_flag", Elem::I32),
        wn("rank_counts", Elem::I32),
        wn("expert_counts", Elem::I32),
        wn("err", Elem::U64),
    ],
    grid: "thread per token",
};

/// `rows[T*TOPK]` = row of (t, k) in the combine receive buffer, -1 if masked.
pub const EP_PAIR_ROWS: KernelSig = KernelSig {
    name: "ep_pair_rows",
    module: Module::Layout,
    params: &[
        p("topk_ids", Elem::Id),
        i("T"),
        i("E"),
        i("E_local"),
        p("pair_pos", Elem::I32),
        w("rows", Elem::I32),
    ],
    grid: "thread per (t, k)",
};

/// Receiver flags: `expert_flag[E_local*N]`, `pair_flag[N*TOPK]`, `local_counts[E_local]`.
pub const EP_RECV_FLAGS: KernelSig = KernelSig {
    name: "ep_recv_flags",
    module: Module::Layout,
    params: &[
        p("recv_ids", Elem::I32),
        i("N"),
        i("E_local"),
        i("rank"),
        wn("expert_flag", Elem::I32),
        wn("pair_flag", Elem::I32),
        wn("local_counts", Elem::I32),
    ],
    grid: "thread per received row",
};

/// Exclusive scan of one [`SCAN_TILE`] per block; `out[n]` = (tile-local) total.
/// Launch with exactly [`SCAN_THREADS`] threads and `ceil(n / SCAN_TILE)` blocks (≥ 1).
pub const EP_SCAN_BLOCK: KernelSig = KernelSig {
    name: "ep_scan_block",
    module: Module::Scan,
    params: &[
        p("in", Elem::I32),
        w("out", Elem::I32),
        u("n"),
        wn("block_sums", Elem::I32),
    ],
    grid: "block per 1024-element tile, 256 threads",
};

/// Adds each tile's offset (`offsets[tile]`, the scanned `block_sums`) to `out[0..=n]`.
pub const EP_SCAN_ADD: KernelSig = KernelSig {
    name: "ep_scan_add",
    module: Module::Scan,
    params: &[w("out", Elem::I32), u("n"), p("offsets", Elem::I32)],
    grid: "thread per element",
};

/// Rows (+ wire ids, weights, source token) into the send buffer grouped by destination.
pub const EP_PACK: KernelSig = KernelSig {
    name: "ep_pack",
    module: Module::Pack,
    params: &[
        p("rows", Elem::U8),
        u("row_bytes"),
        pn("topk_ids", Elem::Id),
        pn("topk_weights", Elem::F32),
        i("T"),
        i("R"),
        p("rank_flag", Elem::I32),
        p("send_pos", Elem::I32),
        w("send_rows", Elem::U8),
        wn("send_ids", Elem::I32),
        wn("send_weights", Elem::F32),
        wn("send_src", Elem::I32),
    ],
    grid: "warp per (rank, token)",
};

/// Byte copy with the whole grid (self traffic, REPLICATED all-gather).
pub const EP_LOCAL_COPY: KernelSig = KernelSig {
    name: "ep_local_copy",
    module: Module::Pack,
    params: &[w("dst", Elem::U8), p("src", Elem::U8), u("bytes")],
    grid: "thread per 16/4/1-byte unit",
};

/// TOKEN_MAJOR: rows (optional copy), filtered ids (-1) and weights (0).
pub const EP_UNPACK_TOKEN_MAJOR: KernelSig = KernelSig {
    name: "ep_unpack_token_major",
    module: Module::Unpack,
    params: &[
        p("recv_rows", Elem::U8),
        p("recv_ids", Elem::I32),
        p("recv_w", Elem::F32),
        i("N"),
        u("row_bytes"),
        i("E_local"),
        i("rank"),
        wn("out_rows", Elem::U8),
        w("out_ids", Elem::Id),
        w("out_w", Elem::F32),
    ],
    grid: "warp per received row",
};

/// EXPERT_MAJOR: fixed-capacity buckets `[E_local, capacity, row]` + `counts[E_local]`.
pub const EP_UNPACK_EXPERT_MAJOR: KernelSig = KernelSig {
    name: "ep_unpack_expert_major",
    module: Module::Unpack,
    params: &[
        p("recv_rows", Elem::U8),
        p("recv_ids", Elem::I32),
        p("recv_w", Elem::F32),
        p("recv_src", Elem::I32),
        p("recv_offsets", Elem::I32),
        i("N"),
        i("R"),
        u("row_bytes"),
        i("E_local"),
        i("rank"),
        p("expert_flag", Elem::I32),
        p("expert_pos", Elem::I32),
        i("capacity"),
        w("out_rows", Elem::U8),
        w("counts", Elem::I32),
        wn("out_w", Elem::F32),
        wn("out_src_rank", Elem::I32),
        wn("out_src_token", Elem::I32),
        wn("err", Elem::U64),
    ],
    grid: "warp per (local expert, received row)",
};

/// EXPERT_PACKED: exact rows grouped by expert + `expert_offsets[E_local+1]`, weight, source.
pub const EP_UNPACK_EXPERT_PACKED: KernelSig = KernelSig {
    name: "ep_unpack_expert_packed",
    module: Module::Unpack,
    params: &[
        p("recv_rows", Elem::U8),
        p("recv_ids", Elem::I32),
        p("recv_w", Elem::F32),
        p("recv_src", Elem::I32),
        p("recv_offsets", Elem::I32),
        i("N"),
        i("R"),
        u("row_bytes"),
        i("E_local"),
        i("rank"),
        p("expert_flag", Elem::I32),
        p("expert_pos", Elem::I32),
        w("out_rows", Elem::U8),
        w("expert_offsets", Elem::I32),
        wn("out_w", Elem::F32),
        wn("out_src_rank", Elem::I32),
        wn("out_src_token", Elem::I32),
    ],
    grid: "warp per (local expert, received row)",
};

/// RANK_MAJOR: `[R, M, row]`, ids/weights (padding ids -1), `recv_counts[R]`.
pub const EP_UNPACK_RANK_MAJOR: KernelSig = KernelSig {
    name: "ep_unpack_rank_major",
    module: Module::Unpack,
    params: &[
        p("recv_rows", Elem::U8),
        p("recv_ids", Elem::I32),
        p("recv_w", Elem::F32),
        p("recv_offsets", Elem::I32),
        i("R"),
        i("M"),
        u("row_bytes"),
        w("out_rows", Elem::U8),
        w("out_ids", Elem::Id),
        w("out_w", Elem::F32),
        w("recv_counts", Elem::I32),
        wn("err", Elem::U64),
    ],
    grid: "warp per (source, slot)",
};

/// Expert layouts: expert output rows back into wire order (per (row, k) pair).
pub const EP_COMBINE_RETURN_EXPERT: KernelSig = KernelSig {
    name: "ep_combine_return_expert",
    module: Module::Combine,
    params: &[
        p("y", Elem::U8),
        u("row_bytes"),
        p("recv_ids", Elem::I32),
        i("N"),
        i("E_local"),
        i("rank"),
        p("expert_pos", Elem::I32),
        i("capacity"),
        p("pair_pos", Elem::I32),
        w("send_rows", Elem::U8),
    ],
    grid: "warp per (received row, k)",
};

/// RANK_MAJOR: `[R, M, row]` back into wire order.
pub const EP_COMBINE_RETURN_RANK_MAJOR: KernelSig = KernelSig {
    name: "ep_combine_return_rank_major",
    module: Module::Combine,
    params: &[
        p("y", Elem::U8),
        u("row_bytes"),
        p("recv_offsets", Elem::I32),
        i("R"),
        i("M"),
        w("send_rows", Elem::U8),
    ],
    grid: "warp per (source, slot)",
};

/// `out[t] = Σ_k w[t,k]·y[rows[t,k]]`, f32, fixed k order.
pub const EP_WEIGHTED_COMBINE: KernelSig = KernelSig {
    name: "ep_weighted_combine",
    module: Module::Combine,
    params: &[
        p("y", Elem::In),
        p("rows", Elem::I32),
        p("w", Elem::F32),
        i("T"),
        i("H"),
        w("out", Elem::Out),
    ],
    grid: "block per token, threads over H",
};

/// `out[t] = Σ_r y[row(r, t)]` in rank order (unweighted).
pub const EP_SUM_RANKS: KernelSig = KernelSig {
    name: "ep_sum_ranks",
    module: Module::Combine,
    params: &[
        p("y", Elem::In),
        pn("rank_flag", Elem::I32),
        pn("send_pos", Elem::I32),
        i("T"),
        i("R"),
        i("H"),
        w("out", Elem::Out),
    ],
    grid: "block per token, threads over H",
};

/// `epoch[0] += 1`.
pub const EP_EPOCH_BUMP: KernelSig = KernelSig {
    name: "ep_epoch_bump",
    module: Module::Signal,
    params: &[w("epoch", Elem::U32)],
    grid: "one thread",
};

/// Release-store `*epoch` into each peer's flag slot (`peer_flags[r]` = device address, 0 = skip).
pub const EP_SIGNAL: KernelSig = KernelSig {
    name: "ep_signal",
    module: Module::Signal,
    params: &[p("peer_flags", Elem::U64), i("R"), p("epoch", Elem::U32)],
    grid: "thread per peer",
};

/// Acquire-spin until `flags[r] >= *epoch`, bounded by `timeout_ns` of `%globaltimer`.
pub const EP_WAIT: KernelSig = KernelSig {
    name: "ep_wait",
    module: Module::Signal,
    params: &[
        p("flags", Elem::U32),
        i("R"),
        p("epoch", Elem::U32),
        u("timeout_ns"),
        wn("err", Elem::U64),
    ],
    grid: "thread per peer",
};

/// Every entry point.
pub const ALL_KERNELS: [&KernelSig; 18] = [
    &EP_LAYOUT,
    &EP_PAIR_ROWS,
    &EP_RECV_FLAGS,
    &EP_SCAN_BLOCK,
    &EP_SCAN_ADD,
    &EP_PACK,
    &EP_LOCAL_COPY,
    &EP_UNPACK_TOKEN_MAJOR,
    &EP_UNPACK_EXPERT_MAJOR,
    &EP_UNPACK_EXPERT_PACKED,
    &EP_UNPACK_RANK_MAJOR,
    &EP_COMBINE_RETURN_EXPERT,
    &EP_COMBINE_RETURN_RANK_MAJOR,
    &EP_WEIGHTED_COMBINE,
    &EP_SUM_RANKS,
    &EP_EPOCH_BUMP,
    &EP_SIGNAL,
    &EP_WAIT,
];

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

/// Builds an error word the way the kernels do: code in bits 63..56, `a` in 55..24, `b` (24
/// bits) in 23..0. 0 means "no error"; when several threads fail the word of the lowest
/// (a, b, code) is kept: the first bad (token, k), as the CPU validation reports.
pub fn encode_error_word(code: u8, a: u32, b: u32) -> u64 {
    (u64::from(code) << 56) | (u64::from(a) << 24) | u64::from(b & 0x00ff_ffff)
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
    let code = (word >> 56) as u8;
    let a = ((word >> 24) & 0xffff_ffff) as u32;
    let b = (word & 0x00ff_ffff) as u32;
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
            _ => Error::InvalidArgument(self.to_string()),
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
