//! `epcomm_tensor`: DLPack's `DLTensor`, field for field, so a `DLTensor *` can be passed by cast.
//! Conversion to byte slices with clear errors that name the tensor and the expectation.

use std::ffi::c_void;

use super::epcomm_dtype;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::P2p;

/// Where a tensor lives: DLPack's `DLDevice`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct epcomm_device {
    /// DLPack device type (EPCOMM_DEVICE_*).
    pub device_type: i32,
    /// Device ordinal (0 for host memory).
    pub device_id: i32,
}

/// A tensor view with exactly the layout of DLPack's `DLTensor` (data, device, ndim, dtype,
/// shape, strides, byte_offset). epcomm never takes ownership of the memory.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_tensor {
    /// Base pointer; the first element is at `data + byte_offset`.
    pub data: *mut c_void,
    pub device: epcomm_device,
    pub ndim: i32,
    pub dtype: epcomm_dtype,
    /// `ndim` extents.
    pub shape: *mut i64,
    /// `ndim` strides in elements, or NULL for a compact row-major tensor.
    pub strides: *mut i64,
    pub byte_offset: u64,
}

/// A validated host tensor: contiguous, with known shape and dtype.
#[derive(Debug, Clone)]
pub(crate) struct HostTensor {
    pub name: &'static str,
    pub ptr: *mut u8,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub bytes: usize,
}

/// `"{tensor}->{field}"` as a static string (a handful of distinct names, made once each).
fn field_name(tensor: &'static str, field: &str) -> &'static str {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static NAMES: OnceLock<Mutex<HashMap<(String, String), &'static str>>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    names
        .entry((tensor.to_owned(), field.to_owned()))
        .or_insert_with(|| Box::leak(format!("{tensor}->{field}").into_boxed_str()))
}

fn device_name(t: i32) -> String {
    match t {
        1 => "CPU (1)".into(),
        2 => "CUDA (2)".into(),
        3 => "CUDA host (3)".into(),
        10 => "ROCm (10)".into(),
        13 => "CUDA managed (13)".into(),
        14 => "oneAPI (14)".into(),
        other => format!("{other}"),
    }
}

/// The extents as sizes; a negative one is an error naming its dimension.
fn dims_arg(raw: &[i64], name: &str) -> Result<Vec<usize>> {
    raw.iter()
        .enumerate()
        .map(|(i, &d)| {
            usize::try_from(d).map_err(|_| {
                Error::InvalidArgument(format!(
                    "tensor '{name}' has shape {raw:?}: dimension {i} is negative"
                ))
            })
        })
        .collect()
}

/// Bytes of a compact tensor, or `None` above 2^62; the row size must fit even without rows.
fn byte_size(shape: &[usize], elem: usize) -> Option<usize> {
    let row = shape[1..]
        .iter()
        .try_fold(elem, |a, &d| a.checked_mul(d))
        .filter(|&b| b <= 1 << 62)?;
    row.checked_mul(shape[0]).filter(|&b| b <= 1 << 62)
}

/// Strides must be row-major, except along dimensions of extent 0 or 1 (never stepped).
fn check_row_major(shape: &[i64], strides: &[i64], name: &str) -> Result<()> {
    let n = shape.len();
    let mut expect = vec![0i64; n];
    let mut acc = 1i64;
    for i in (0..n).rev() {
        expect[i] = acc;
        acc = acc.saturating_mul(shape[i].max(1));
    }
    if (0..n).all(|i| shape[i] <= 1 || strides[i] == expect[i]) {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "tensor '{name}' is not contiguous: strides {strides:?} for shape {shape:?}; expected row-major strides {expect:?}"
    )))
}

/// Where the tensors of a call must live: host memory (`epcomm_*` host functions) or one CUDA
/// device (the GPU all2all handle's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Memory {
    /// Host-accessible memory.
    Host,
    /// Device memory of this CUDA ordinal.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    Cuda(i32),
}

impl Memory {
    /// Validates `t` as a tensor in this memory.
    ///
    /// # Safety
    /// As [`HostTensor::from_ffi`].
    pub(crate) unsafe fn tensor(
        self,
        t: *const epcomm_tensor,
        name: &'static str,
    ) -> Result<HostTensor> {
        match self {
            // SAFETY: caller contract.
            Memory::Host => unsafe { HostTensor::from_ffi(t, name) },
            // SAFETY: caller contract.
            Memory::Cuda(device) => unsafe { HostTensor::from_ffi_cuda(t, name, device) },
        }
    }

    /// The DLPack device of views into this memory.
    pub(crate) fn device(self) -> epcomm_device {
        match self {
            Memory::Host => epcomm_device {
                device_type: super::EPCOMM_DEVICE_CPU,
                device_id: 0,
            },
            Memory::Cuda(device_id) => epcomm_device {
                device_type: super::EPCOMM_DEVICE_CUDA,
                device_id,
            },
        }
    }

    /// `n` tensors at `p` (NULL only when `n` is 0: else `what` is the NULL argument), each
    /// named `item` and checked by `each` as soon as it is validated.
    ///
    /// # Safety
    /// `p` is NULL or holds `n` descriptors valid as for [`HostTensor::from_ffi`].
    pub(crate) unsafe fn tensors(
        self,
        p: *const epcomm_tensor,
        n: usize,
        what: &'static str,
        item: &'static str,
        mut each: impl FnMut(usize, &HostTensor) -> Result<()>,
    ) -> Result<Vec<HostTensor>> {
        if n > 0 && p.is_null() {
            return Err(Error::NullPointer(what));
        }
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: n descriptors at p (caller contract).
            let t = unsafe { self.tensor(p.add(i), item) }?;
            each(i, &t)?;
            out.push(t);
        }
        Ok(out)
    }
}

impl HostTensor {
    /// Validates `t` as a contiguous tensor in host-accessible memory.
    ///
    /// # Safety
    /// `t` is NULL or points to a valid `epcomm_tensor` whose `shape`/`strides` hold `ndim`
    /// entries and whose data covers the described extent.
    pub unsafe fn from_ffi(t: *const epcomm_tensor, name: &'static str) -> Result<HostTensor> {
        // SAFETY: caller contract.
        let r = unsafe { t.as_ref() }.ok_or(Error::NullPointer(name))?;
        if r.device.device_type == 2 {
            // CUDA device memory goes through the GPU entry points, never through the host path.
            return Err(Error::InvalidArgument(format!(
                "tensor '{name}' is on device type CUDA (2); the host-tensor functions take host memory (EPCOMM_DEVICE_CPU = 1): use epcomm_gpu_all2all_dispatch / epcomm_gpu_all2all_combine for CUDA tensors"
            )));
        }
        if !matches!(r.device.device_type, 1 | 3 | 11 | 13) {
            return Err(Error::InvalidArgument(format!(
                "tensor '{name}' is on device type {}; expected host memory (EPCOMM_DEVICE_CPU = 1; CUDA host/managed memory also works)",
                device_name(r.device.device_type)
            )));
        }
        // SAFETY: caller contract.
        unsafe { Self::validate(t, name) }
    }

    /// Validates `t` as a contiguous CUDA device tensor (`kDLCUDA` = 2) on device `device`;
    /// `ptr` is then a device address, never dereferenced on the host.
    ///
    /// # Safety
    /// As [`HostTensor::from_ffi`] for the descriptor (shape/strides); the data is not touched.
    unsafe fn from_ffi_cuda(
        t: *const epcomm_tensor,
        name: &'static str,
        device: i32,
    ) -> Result<HostTensor> {
        // SAFETY: caller contract.
        let r = unsafe { t.as_ref() }.ok_or(Error::NullPointer(name))?;
        if r.device.device_type != 2 || r.device.device_id != device {
            return Err(Error::InvalidArgument(format!(
                "tensor '{name}' is on device type {} id {}; expected CUDA device memory (EPCOMM_DEVICE_CUDA = 2) on device {device}, the device the GPU all2all handle was created for",
                device_name(r.device.device_type),
                r.device.device_id
            )));
        }
        // SAFETY: caller contract.
        unsafe { Self::validate(t, name) }
    }

    /// Shape, dtype, contiguity and data-pointer checks shared by host and device tensors.
    ///
    /// # Safety
    /// As [`HostTensor::from_ffi`].
    unsafe fn validate(t: *const epcomm_tensor, name: &'static str) -> Result<HostTensor> {
        // SAFETY: caller contract (checked non-NULL by both callers).
        let t = unsafe { t.as_ref() }.ok_or(Error::NullPointer(name))?;
        if t.ndim < 1 || t.ndim > 16 {
            return Err(Error::InvalidArgument(format!(
                "tensor '{name}' has ndim {}; expected 1..=16 (rows along dimension 0)",
                t.ndim
            )));
        }
        let dtype = DType::from(t.dtype);
        if dtype.lanes != 1 || dtype.bits == 0 || dtype.bits % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "tensor '{name}' has dtype {}; expected a scalar type of whole bytes",
                dtype.torch_name()
            )));
        }
        if t.shape.is_null() {
            return Err(Error::NullPointer(field_name(name, "shape")));
        }
        let n = t.ndim as usize;
        // SAFETY: shape has ndim entries (caller contract).
        let raw_shape = unsafe { std::slice::from_raw_parts(t.shape, n) };
        let shape = dims_arg(raw_shape, name)?;
        let numel = byte_size(&shape, dtype.bits as usize / 8).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "tensor '{name}' has shape {raw_shape:?}: too large (more than 2^62 bytes)"
            ))
        })?;
        if !t.strides.is_null() && numel > 0 {
            // SAFETY: strides has ndim entries when non-NULL (caller contract).
            let strides = unsafe { std::slice::from_raw_parts(t.strides, n) };
            check_row_major(raw_shape, strides, name)?;
        }
        if t.data.is_null() && numel > 0 {
            return Err(Error::NullPointer(field_name(name, "data")));
        }
        let ptr = if t.data.is_null() || numel == 0 {
            std::ptr::NonNull::<u8>::dangling().as_ptr()
        } else {
            // An in-bounds offset per the caller's contract; wrapping_add keeps even a bad one
            // from being undefined behaviour here.
            t.data.cast::<u8>().wrapping_add(t.byte_offset as usize)
        };
        Ok(HostTensor {
            name,
            ptr,
            shape,
            dtype,
            bytes: numel,
        })
    }

    /// Rows along dimension 0.
    pub fn rows(&self) -> usize {
        self.shape[0]
    }

    /// Elements per row (checked to fit when the tensor was validated).
    pub fn row_elems(&self) -> usize {
        self.shape[1..].iter().product()
    }

    pub fn row_bytes(&self) -> usize {
        self.row_elems() * (self.dtype.bits as usize / 8)
    }

    /// # Safety
    /// The tensor's memory is valid for reads for the duration of the borrow.
    pub unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        // SAFETY: caller contract; ptr is non-NULL (dangling only when empty).
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    /// # Safety
    /// The tensor's memory is valid for writes and not aliased for the duration of the borrow.
    pub unsafe fn as_mut_slice<'a>(&self) -> &'a mut [u8] {
        // SAFETY: caller contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }

    /// The tensor as one operation of a send/recv batch: sent from, or received into.
    ///
    /// # Safety
    /// As [`HostTensor::as_slice`] for a send, [`HostTensor::as_mut_slice`] for a receive.
    pub(crate) unsafe fn p2p<'a>(&self, send: bool, peer: usize) -> P2p<'a> {
        if send {
            // SAFETY: caller contract.
            P2p::Send {
                peer,
                data: unsafe { self.as_slice() },
            }
        } else {
            // SAFETY: caller contract.
            P2p::Recv {
                peer,
                data: unsafe { self.as_mut_slice() },
            }
        }
    }

    /// Errors if the two tensors' bytes overlap (in-place use is not supported).
    pub fn check_disjoint(&self, other: &HostTensor) -> Result<()> {
        let (a0, a1) = (self.ptr as usize, self.ptr as usize + self.bytes);
        let (b0, b1) = (other.ptr as usize, other.ptr as usize + other.bytes);
        if self.bytes > 0 && other.bytes > 0 && a0 < b1 && b0 < a1 {
            return Err(Error::InvalidArgument(format!(
                "tensors '{}' and '{}' overlap; in-place operation is not supported",
                self.name, other.name
            )));
        }
        Ok(())
    }

    /// Same dtype and the same shape past dimension 0.
    pub fn check_rows_like(&self, other: &HostTensor) -> Result<()> {
        if self.dtype != other.dtype {
            return Err(Error::InvalidArgument(format!(
                "tensor '{}' has dtype {} but '{}' has dtype {}; expected the same dtype",
                other.name,
                other.dtype.torch_name(),
                self.name,
                self.dtype.torch_name()
            )));
        }
        if self.shape[1..] != other.shape[1..] {
            return Err(Error::InvalidArgument(format!(
                "tensor '{}' has shape {:?} but '{}' has shape {:?}; expected the same shape past dimension 0",
                other.name, other.shape, self.name, self.shape
            )));
        }
        Ok(())
    }

    /// Dimension 0 must be `rows`.
    pub fn check_rows(&self, rows: usize, why: &str) -> Result<()> {
        if self.rows() != rows {
            return Err(Error::InvalidArgument(format!(
                "tensor '{}' has {} rows (shape {:?}); expected {rows} ({why})",
                self.name,
                self.rows(),
                self.shape
            )));
        }
        Ok(())
    }
}

/// Errors if a tensor that is written (`true`) overlaps another tensor of the same call.
pub(crate) fn check_writes_disjoint(tensors: &[(bool, &HostTensor)]) -> Result<()> {
    for (i, &(wa, a)) in tensors.iter().enumerate() {
        for &(wb, b) in &tensors[i + 1..] {
            if wa || wb {
                a.check_disjoint(b)?;
            }
        }
    }
    Ok(())
}
