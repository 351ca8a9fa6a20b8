//! Loading and launching the kernels of [`crate::gpu::kernels`] (`cuda` feature).
//!
//! [`Kernels::load`] compiles, through the NVRTC [`Compiler`] (memory + disk cache), every
//! variant one MoE configuration needs for the device's compute capability (`sm_{major}{minor}`)
//! and loads them into the current (primary) context. The launches themselves are built as data
//! by the typed builders of [`Calls`] ([`Kernels::calls`]), which size the grid from the
//! table's `grid` rule: threads per token/row, a warp per row, a block per token, or
//! [`SCAN_THREADS`](crate::gpu::kernels::SCAN_THREADS)-thread tiles for the scan, which recurses over block sums for arrays longer
//! than one tile. [`Kernels::run`] issues them, checking each against the entry point's
//! [`KernelSig`] parameter table (count and kind; a mismatch is an internal error, never a bad
//! launch). [`read_error_word`] copies the device error word back and maps it through
//! [`decode_error_word`] to an [`Error`].
//!
//! Status: compiled and type-checked on CPU-only machines; **never run on a GPU yet**
//! (`scripts/gpu-check.sh` phase 1 is the first run).

use std::ffi::c_void;

use crate::error::{Error, Result};
use crate::gpu::driver::{self, Device, Function, LaunchDims, Module as CuModule, Stream};
use crate::gpu::kernels::{
    self, decode_error_word, FloatDtype, IdDtype, KernelSig, Module, Variant,
};
use crate::gpu::nvrtc::Compiler;

pub use crate::gpu::calls::{check_args, Arg, Call, Calls, KernelId, BLOCK};

/// A loaded entry point and its parameter table.
#[derive(Debug, Clone)]
pub struct Kernel {
    f: Function,
    sig: &'static KernelSig,
}

impl Kernel {
    fn load(m: &CuModule, sig: &'static KernelSig) -> Result<Kernel> {
        Ok(Kernel {
            f: m.function(sig.name)?,
            sig,
        })
    }

    /// The parameter table.
    pub fn sig(&self) -> &'static KernelSig {
        self.sig
    }

    /// Checks `args` against the table: count, kind, and NULL only where nullable.
    pub fn check_args(&self, args: &[Arg]) -> Result<()> {
        check_args(self.sig, args)
    }

    /// Launches with `grid` blocks of `block` threads on `stream`.
    pub fn launch(&self, grid: u32, block: u32, args: &[Arg], stream: &Stream) -> Result<()> {
        self.check_args(args)?;
        // The low 4 bytes of a slot (little-endian) are an int's bytes.
        let mut vals: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let mut ptrs: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|v| (v as *mut u64).cast::<c_void>())
            .collect();
        let dims = LaunchDims {
            grid: (grid.max(1), 1, 1),
            block: (block, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: the arguments match the kernel's parameter list (checked above against the
        // table that tests/gpu_kernels.rs checks against the .cu source); every value lives in
        // `vals` until the call returns; device pointers are the caller's (see each helper).
        unsafe { driver::launch(&self.f, dims, stream, ptrs.as_mut_ptr()) }
            .map_err(|e| Error::Runtime(format!("launching {}: {e}", self.sig.name)))
    }
}

/// `sm_{major}{minor}` for a compute capability.
pub fn arch_for(cc: (i32, i32)) -> String {
    format!("sm_{}{}", cc.0, cc.1)
}

/// What a set of kernels is specialised for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelConfig {
    /// dtype of the caller's `topk_ids`.
    pub id_dtype: IdDtype,
    /// Top-k.
    pub top_k: u32,
    /// dtype of the expert outputs given to combine.
    pub expert_dtype: FloatDtype,
    /// dtype combine writes.
    pub out_dtype: FloatDtype,
}

fn load_variant(v: Variant, arch: &str) -> Result<CuModule> {
    v.validate()?;
    let (src, opts) = kernels::source(&v);
    let c = Compiler::global()?.compile(&src, &opts, arch)?;
    CuModule::load(&c.image.module_bytes())
        .map_err(|e| Error::Runtime(format!("loading kernel module {}: {e}", v.name())))
}

/// Every kernel one configuration needs, loaded in the current context.
#[derive(Debug, Clone)]
pub struct Kernels {
    /// The configuration.
    pub config: KernelConfig,
    /// `sm_XX` they were compiled for.
    pub arch: String,
    /// Grid cap (blocks) of the grid-stride kernels.
    pub max_blocks: u32,
    /// One per [`KernelId::ALL`], in that order.
    loaded: Vec<Kernel>,
}

/// The compiled modules of one configuration.
struct Modules {
    layout: CuModule,
    /// `ep_layout`/`ep_pair_rows` of the int32 variant (wire ids, capacity mode).
    layout_wire: CuModule,
    scan: CuModule,
    pack: CuModule,
    unpack: CuModule,
    combine: CuModule,
}

impl Modules {
    fn load(config: &KernelConfig, arch: &str) -> Result<Modules> {
        let k = config.top_k;
        let layout = load_variant(Variant::layout(config.id_dtype, k), arch)?;
        let layout_wire = if config.id_dtype == IdDtype::I32 {
            layout.clone()
        } else {
            load_variant(Variant::layout(IdDtype::I32, k), arch)?
        };
        Ok(Modules {
            layout,
            layout_wire,
            scan: load_variant(Variant::scan(), arch)?,
            pack: load_variant(Variant::pack(config.id_dtype, k), arch)?,
            // Outputs carry int64 ids, like the CPU path's views.
            unpack: load_variant(Variant::unpack(IdDtype::I64, k), arch)?,
            combine: load_variant(
                Variant::combine(config.expert_dtype, config.out_dtype, k),
                arch,
            )?,
        })
    }

    /// The module that defines `id` (its table's module; the wire variant for
    /// [`KernelId::PairRowsWire`]).
    fn of(&self, id: KernelId) -> Result<&CuModule> {
        if id == KernelId::PairRowsWire {
            return Ok(&self.layout_wire);
        }
        match id.sig().module {
            Module::Layout => Ok(&self.layout),
            Module::Scan => Ok(&self.scan),
            Module::Pack => Ok(&self.pack),
            Module::Unpack => Ok(&self.unpack),
            Module::Combine => Ok(&self.combine),
            Module::Signal => Err(Error::Internal(format!(
                "{}: the signal module is not part of a configuration's kernels",
                id.sig().name
            ))),
        }
    }
}

impl Kernels {
    /// Compiles (or fetches from the cache) and loads every variant `config` needs for
    /// `device`. The device's primary context must be current on this thread.
    pub fn load(device: &Device, config: KernelConfig) -> Result<Kernels> {
        let arch = arch_for(device.compute_capability()?);
        let sms = device.sm_count().unwrap_or(16).max(1) as u32;
        let modules = Modules::load(&config, &arch)?;
        let loaded = KernelId::ALL
            .iter()
            .map(|&id| Kernel::load(modules.of(id)?, id.sig()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Kernels {
            config,
            arch,
            max_blocks: sms * 8,
            loaded,
        })
    }

    /// The launch builders of this configuration.
    pub fn calls(&self) -> Calls {
        Calls {
            top_k: self.config.top_k,
            max_blocks: self.max_blocks,
        }
    }

    fn kernel(&self, id: KernelId) -> Result<&Kernel> {
        self.loaded
            .get(id as usize)
            .ok_or_else(|| Error::Internal(format!("{}: not loaded", id.sig().name)))
    }

    /// Issues `calls` in order on `s`.
    pub fn run(&self, calls: &[Call], s: &Stream) -> Result<()> {
        for c in calls {
            self.kernel(c.kernel)?.launch(c.grid, c.block, &c.args, s)?;
        }
        Ok(())
    }
}

/// `cuMemsetD32Async`: `count` int32 of `value` at `dst` (flag arrays of ones).
///
/// # Safety
/// `dst` is device memory of at least `4 * count` bytes, valid until the stream ran it.
pub unsafe fn memset_d32_async(dst: u64, value: u32, count: usize, s: &Stream) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    driver::init()?;
    let run = || {
        // SAFETY: caller contract; a valid stream.
        let rc =
            unsafe { cudarc::driver::sys::cuMemsetD32Async(dst, value, count, s.raw().cast()) };
        driver::check(rc, "cuMemsetD32Async")
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(|_| {
        Err(Error::Unavailable(
            "CUDA is unavailable: cuMemsetD32Async could not be loaded".into(),
        ))
    })
}

/// Copies the 8-byte device error word at `err` back (a synchronous copy on `s`, after
/// everything queued before it) and maps it to an error ([`decode_error_word`]).
pub fn read_error_word(err: u64, s: &Stream) -> Result<()> {
    let mut word = 0u64;
    // SAFETY: `word` is 8 writable bytes alive until the synchronize below; `err` is an
    // 8-byte device allocation (caller).
    unsafe { driver::memcpy_dtoh_async((&mut word as *mut u64).cast(), err, 8, s) }?;
    s.synchronize()?;
    error_from_word(word)
}

/// `Ok` for 0, else the decoded device error as an [`Error`].
fn error_from_word(word: u64) -> Result<()> {
    match decode_error_word(word) {
        None => Ok(()),
        Some(e) => Err(e.to_error()),
    }
}
