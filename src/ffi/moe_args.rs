//! The MoE dispatch/combine arguments of the host (`epcomm_all2all_*`) and GPU
//! (`epcomm_gpu_all2all_*`) entry points: one set of checks with one wording, and one way to
//! describe a dispatch output. Only where the tensors live differs ([`Memory`]).

use std::ffi::c_void;

use super::tensor::{epcomm_device, epcomm_tensor, HostTensor, Memory};
use crate::bytes;
use crate::dtype::{Code, DType};
use crate::error::{Error, Result};
use crate::moe::layout::Shapes;
use crate::moe::MoeConfig;
use crate::select::all2all::Layout;

/// Dispatch results: views of buffers the manager owns, valid until its next call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_dispatch_output {
    /// EPCOMM_LAYOUT_* of the backend.
    pub layout: i32,
    /// Rows actually received (fixed-capacity layouts have more rows in `hidden`).
    pub received_rows: i64,
    /// Received rows: [rows, hidden] (EXPERT_MAJOR [E_local, M*R, hidden], RANK_MAJOR
    /// [R, M, hidden]); combine's expert_output has this shape.
    pub hidden: epcomm_tensor,
    /// int64 [rows, K] (TOKEN_MAJOR: non-local ids are -1; RANK_MAJOR: padding rows all -1;
    /// REPLICATED: every token's ids); empty (shape [0]) for the per-expert layouts.
    pub topk_ids: epcomm_tensor,
    /// float32 [rows, K] (as topk_ids; dropped ids have weight 0), EXPERT_PACKED [rows].
    pub topk_weights: epcomm_tensor,
    /// int32: TOKEN_MAJOR tokens_per_local_expert [E_local], EXPERT_MAJOR counts [E_local],
    /// RANK_MAJOR recv_counts [R]; empty otherwise.
    pub counts: epcomm_tensor,
    /// int64 EXPERT_PACKED expert_offsets [E_local + 1]; empty otherwise.
    pub expert_offsets: epcomm_tensor,
    /// int32 EXPERT_PACKED source rank / source token per row; empty otherwise.
    pub src_rank: epcomm_tensor,
    pub src_token: epcomm_tensor,
    /// One tensor per extra payload, rows laid out like `hidden` (uint8, [rows..., bytes]).
    pub extras: *const epcomm_tensor,
    pub num_extras: usize,
}

/// The element type of `topk_ids`: the C ABI takes int32 or int64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IdWidth {
    /// int32 ids.
    I32,
    /// int64 ids.
    I64,
}

/// Checks topk_ids' dtype (int32 or int64) without reading it.
pub(crate) fn id_width(t: &HostTensor) -> Result<IdWidth> {
    let int = t.dtype.code() == Some(Code::Int);
    if int && t.dtype.bits == 32 {
        Ok(IdWidth::I32)
    } else if int && t.dtype.bits == 64 {
        Ok(IdWidth::I64)
    } else {
        Err(Error::InvalidArgument(format!(
            "tensor 'topk_ids' has dtype {}; expected torch.int32 or torch.int64",
            t.dtype.torch_name()
        )))
    }
}

/// Host ids as i64.
///
/// # Safety
/// `t` is a host tensor whose memory is valid for reads during the call.
pub(crate) unsafe fn ids_arg(t: &HostTensor) -> Result<Vec<i64>> {
    let width = id_width(t)?;
    // SAFETY: caller contract.
    let b = unsafe { t.as_slice() };
    Ok(match width {
        IdWidth::I32 => bytes::words::<i32>(b).map(i64::from).collect(),
        IdWidth::I64 => bytes::to_vec(b),
    })
}

/// `t` is `[rows, cols]` (any rows when `rows` is `None`), else an error expecting `what`.
fn check_2d(t: &HostTensor, rows: Option<usize>, cols: usize, what: &str) -> Result<()> {
    let ok = t.shape.len() == 2 && t.shape[1] == cols && rows.is_none_or(|r| t.shape[0] == r);
    if !ok {
        return Err(Error::InvalidArgument(format!(
            "tensor '{}' has shape {:?}; expected {what}",
            t.name, t.shape
        )));
    }
    Ok(())
}

/// `t` has the dtype the manager was created for.
fn check_created_for(t: &HostTensor, want: DType) -> Result<()> {
    if t.dtype != want {
        return Err(Error::InvalidArgument(format!(
            "tensor '{}' has dtype {}; the manager was created for {}",
            t.name,
            t.dtype.torch_name(),
            want.torch_name()
        )));
    }
    Ok(())
}

/// A dispatch's tensor descriptors as C passed them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DispatchTensors {
    /// `hidden`.
    pub hidden: *const epcomm_tensor,
    /// `topk_ids`.
    pub topk_ids: *const epcomm_tensor,
    /// `topk_weights`.
    pub topk_weights: *const epcomm_tensor,
    /// `extras` (NULL when `num_extras` is 0).
    pub extras: *const epcomm_tensor,
    /// Entries of `extras`.
    pub num_extras: usize,
}

impl DispatchTensors {
    /// The descriptors in the C argument order.
    pub(crate) fn new(
        hidden: *const epcomm_tensor,
        topk_ids: *const epcomm_tensor,
        topk_weights: *const epcomm_tensor,
        extras: *const epcomm_tensor,
        num_extras: usize,
    ) -> DispatchTensors {
        DispatchTensors {
            hidden,
            topk_ids,
            topk_weights,
            extras,
            num_extras,
        }
    }
}

/// A dispatch's tensors, checked against the manager's configuration; nothing read yet.
pub(crate) struct DispatchArgs {
    /// `[T, hidden_size]` of hidden_dtype.
    pub hidden: HostTensor,
    /// `[T, top_k]` int32/int64.
    pub topk_ids: HostTensor,
    /// The dtype of `topk_ids` (the GPU path passes it to its kernels).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub id_width: IdWidth,
    /// `[T, top_k]` float32.
    pub topk_weights: HostTensor,
    /// `[T, extra_row_bytes[i]]` bytes each.
    pub extras: Vec<HostTensor>,
}

impl DispatchArgs {
    /// Validates a dispatch's descriptors in the C checks' order: the three tensors, hidden's
    /// dtype and shape, the ids' and weights' shapes and dtypes, then the extras.
    ///
    /// # Safety
    /// The pointers of `d` are NULL or valid descriptors; `extras` is NULL or holds
    /// `num_extras`.
    pub(crate) unsafe fn parse(
        cfg: &MoeConfig,
        mem: Memory,
        d: DispatchTensors,
    ) -> Result<DispatchArgs> {
        let (extras, num_extras) = (d.extras, d.num_extras);
        // SAFETY: caller contract for the three descriptors.
        let (x, ids, w) = unsafe {
            (
                mem.tensor(d.hidden, "hidden")?,
                mem.tensor(d.topk_ids, "topk_ids")?,
                mem.tensor(d.topk_weights, "topk_weights")?,
            )
        };
        check_created_for(&x, cfg.hidden_dtype)?;
        let h = cfg.hidden;
        check_2d(&x, None, h, &format!("[T, {h}] (T tokens of hidden_size)"))?;
        let (t, k) = (x.rows(), cfg.top_k);
        check_2d(&ids, Some(t), k, &format!("[{t}, {k}] (T, top_k)"))?;
        check_2d(&w, Some(t), k, &format!("[{t}, {k}] (T, top_k)"))?;
        if w.dtype != DType::F32 {
            return Err(Error::InvalidArgument(format!(
                "tensor 'topk_weights' has dtype {}; expected torch.float32",
                w.dtype.torch_name()
            )));
        }
        let id_width = id_width(&ids)?;
        let want = &cfg.extra_row_bytes;
        if num_extras != want.len() {
            return Err(Error::InvalidArgument(format!(
                "num_extras is {num_extras}; the manager was created for {}",
                want.len()
            )));
        }
        // SAFETY: caller contract.
        let extras = unsafe {
            mem.tensors(extras, num_extras, "extras", "extras[i]", |i, e| {
                if e.rows() != t || e.row_bytes() != want[i] {
                    return Err(Error::InvalidArgument(format!(
                        "tensor 'extras[{i}]' has shape {:?} ({} bytes per row); expected {t} rows of {} bytes",
                        e.shape,
                        e.row_bytes(),
                        want[i]
                    )));
                }
                Ok(())
            })
        }?;
        Ok(DispatchArgs {
            hidden: x,
            topk_ids: ids,
            id_width,
            topk_weights: w,
            extras,
        })
    }

    /// T, this rank's tokens.
    pub(crate) fn tokens(&self) -> usize {
        self.hidden.rows()
    }
}

/// Validates combine's `expert_output` and `output`: dtypes; once a dispatch ran
/// (`dispatched` = its buffer rows and T) the shapes; then that they do not overlap.
///
/// # Safety
/// Pointers are NULL or valid descriptors.
pub(crate) unsafe fn combine_args(
    cfg: &MoeConfig,
    mem: Memory,
    expert_output: *const epcomm_tensor,
    output: *const epcomm_tensor,
    dispatched: Option<(usize, usize)>,
) -> Result<(HostTensor, HostTensor)> {
    // SAFETY: caller contract for both descriptors.
    let (y, o) = unsafe {
        (
            mem.tensor(expert_output, "expert_output")?,
            mem.tensor(output, "output")?,
        )
    };
    check_created_for(&y, cfg.expert_dtype.dtype())?;
    check_created_for(&o, cfg.out_dtype.dtype())?;
    if let Some((rows, t)) = dispatched {
        let h = cfg.hidden;
        if y.shape.last() != Some(&h) || y.bytes / cfg.expert_dtype.size() != rows * h {
            return Err(Error::InvalidArgument(format!(
                "tensor 'expert_output' has shape {:?}; expected the shape of the dispatch output ({rows} rows of {h})",
                y.shape
            )));
        }
        check_2d(&o, Some(t), h, &format!("[{t}, {h}] (T, hidden_size)"))?;
    }
    y.check_disjoint(&o)?;
    Ok((y, o))
}

/// Where each buffer of a dispatch output is: host pointers or device addresses.
pub(crate) struct OutputAddrs {
    /// Received rows.
    pub hidden: usize,
    /// Per-row ids.
    pub topk_ids: usize,
    /// Per-row (or per-id) weights.
    pub topk_weights: usize,
    /// Per-expert or per-rank counts.
    pub counts: usize,
    /// EXPERT_PACKED offsets.
    pub expert_offsets: usize,
    /// EXPERT_PACKED source rank per row.
    pub src_rank: usize,
    /// EXPERT_PACKED source token per row.
    pub src_token: usize,
    /// Extra payload buffers, rows laid out like `hidden`, in the config's order.
    pub extras: Vec<usize>,
}

/// A dispatch output before it is described to C: the layout's shapes (the contract's
/// [`Shapes`]) and where the buffers are.
pub(crate) struct DispatchParts {
    /// The backend's layout.
    pub layout: Layout,
    /// Rows received (-1: known only on the device).
    pub received_rows: i64,
    /// The outputs' shapes; an empty one is not produced by the layout.
    pub shapes: Shapes,
    /// The hidden rows' element type.
    pub hidden_dtype: DType,
    /// `expert_offsets`' element type (int64 on the host, int32 on the GPU).
    pub offsets_dtype: DType,
    /// The buffers.
    pub at: OutputAddrs,
}

/// The shape arrays and extra descriptors a described dispatch output points into; the
/// handle keeps them until its next dispatch.
#[derive(Default)]
pub(crate) struct OutputViews {
    shapes: Vec<Vec<i64>>,
    extras: Vec<epcomm_tensor>,
}

impl OutputViews {
    /// A compact tensor view of `dims` at `addr`; its shape array lives in `self.shapes`.
    fn tensor(
        &mut self,
        addr: usize,
        dtype: DType,
        dims: &[usize],
        dev: epcomm_device,
    ) -> epcomm_tensor {
        let mut shape: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let (ptr, ndim) = (shape.as_mut_ptr(), shape.len() as i32);
        // Moving the vector keeps its buffer where `ptr` points.
        self.shapes.push(shape);
        epcomm_tensor {
            data: addr as *mut c_void,
            device: dev,
            ndim,
            dtype: dtype.into(),
            shape: ptr,
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        }
    }

    /// A host view of `dims` at `addr`, valid until the next describe (the FP8 scales).
    pub(crate) fn host_view(&mut self, addr: usize, dtype: DType, dims: &[usize]) -> epcomm_tensor {
        self.tensor(addr, dtype, dims, Memory::Host.device())
    }

    /// Describes `p` to C (the earlier output's views become invalid): an output the layout
    /// does not produce is an empty `[0]` view; extra payload i is `hidden`'s rows of
    /// `extra_row_bytes[i]` uint8.
    pub(crate) fn describe(
        &mut self,
        p: &DispatchParts,
        extra_row_bytes: &[usize],
        mem: Memory,
    ) -> epcomm_dispatch_output {
        let (dev, sh, at) = (mem.device(), &p.shapes, &p.at);
        let or_empty = |dims: &[usize]| {
            if dims.is_empty() {
                vec![0]
            } else {
                dims.to_vec()
            }
        };
        self.shapes.clear();
        let rows = &sh.hidden[..sh.hidden.len().saturating_sub(1)];
        let u8t = DType::new(Code::UInt, 8);
        let extras: Vec<epcomm_tensor> = at
            .extras
            .iter()
            .zip(extra_row_bytes)
            .map(|(&addr, &rb)| {
                let dims: Vec<usize> = rows.iter().copied().chain([rb]).collect();
                self.tensor(addr, u8t, &dims, dev)
            })
            .collect();
        self.extras = extras;
        epcomm_dispatch_output {
            layout: p.layout as i32,
            received_rows: p.received_rows,
            hidden: self.tensor(at.hidden, p.hidden_dtype, &sh.hidden, dev),
            topk_ids: self.tensor(at.topk_ids, DType::I64, &or_empty(&sh.topk_ids), dev),
            topk_weights: self.tensor(
                at.topk_weights,
                DType::F32,
                &or_empty(&sh.topk_weights),
                dev,
            ),
            counts: self.tensor(at.counts, DType::I32, &[sh.counts], dev),
            expert_offsets: self.tensor(
                at.expert_offsets,
                p.offsets_dtype,
                &[sh.expert_offsets],
                dev,
            ),
            src_rank: self.tensor(at.src_rank, DType::I32, &[sh.src], dev),
            src_token: self.tensor(at.src_token, DType::I32, &[sh.src], dev),
            extras: if self.extras.is_empty() {
                std::ptr::null()
            } else {
                self.extras.as_ptr()
            },
            num_extras: self.extras.len(),
        }
    }
}
