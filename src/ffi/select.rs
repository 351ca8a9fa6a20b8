//! all2all backend and EPLB communicator selection.

use std::ffi::c_char;

use super::{epcomm_dtype, guard, EPCOMM_ALL2ALL_PASSTHROUGH, EPCOMM_PROBE};
use crate::dtype::DType;
use crate::error::Error;
use crate::probe;
use crate::select::all2all::{self, Backend, Layout};
use crate::select::eplb::{self, Communicator, DeviceKind};

/// One name accepted as an all2all backend.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_all2all_name_desc {
    /// The accepted name (static string).
    pub name: *const c_char,
    /// The EPCOMM_ALL2ALL_* backend it resolves to.
    pub backend: i32,
    /// EPCOMM_NAME_CANONICAL, EPCOMM_NAME_ALIAS or EPCOMM_NAME_REMOVED.
    pub kind: i32,
    /// The EPCOMM_LAYOUT_* of the backend.
    pub layout: i32,
    /// vLLM's manager class for the backend (static string).
    pub manager_class: *const c_char,
}

fn backend_arg(backend: i32) -> Result<Backend, Error> {
    if backend == EPCOMM_ALL2ALL_PASSTHROUGH {
        return Err(Error::InvalidArgument(format!(
            "all2all backend '{}' ({}) has no layout: the MoE backend dispatches and combines itself, with no exchange",
            all2all::PASSTHROUGH,
            all2all::PASSTHROUGH_MANAGER_CLASS
        )));
    }
    Backend::from_code(backend).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "all2all backend {backend} is not valid: expected an EPCOMM_ALL2ALL_* value in 0..{}",
            Backend::ALL.len() - 1
        ))
    })
}

/// Resolves an all2all backend name with vLLM's rules. Matching is exact and case-sensitive.
/// `naive` and `pplx` resolve to EPCOMM_ALL2ALL_ALLGATHER_REDUCESCATTER with vLLM's
/// "has been removed" warning; `flashinfer_all2allv` resolves to
/// EPCOMM_ALL2ALL_FLASHINFER_NVLINK_TWO_SIDED with vLLM's deprecation warning (once per process).
/// An unknown name returns EPCOMM_ERROR_INVALID_ARGUMENT with the message
/// "Unknown all2all backend: {name}" and the closest valid names in the hint. `passthrough`
/// (the MoE backend dispatches and combines itself) resolves to EPCOMM_ALL2ALL_PASSTHROUGH,
/// vLLM's PassThroughAll2AllManager, which has no exchange: only creating a handle for it fails,
/// with vLLM's RuntimeError "passthrough has no all2all handle: dispatch and combine run inside
/// the MoE backend.".
///
/// # Safety
/// `name` is NULL or a NUL-terminated string; `backend_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_backend_resolve(
    name: *const c_char,
    backend_out: *mut i32,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let name = unsafe { guard::str_arg(name, "name") }?;
        let out = unsafe { guard::out_arg(backend_out, "backend_out") }?;
        *out = match all2all::resolve_config(name)? {
            // vLLM's warnings, logged as `resolve` logs them.
            Some(_) => all2all::resolve(name)? as i32,
            None => EPCOMM_ALL2ALL_PASSTHROUGH,
        };
        Ok(())
    })
}

/// Whether `name` resolves to an all2all backend (including aliases, removed names and
/// `passthrough`), i.e. whether epcomm_all2all_backend_resolve succeeds. NULL gives false. Logs
/// nothing.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_backend_is_known(name: *const c_char) -> bool {
    guard::call_or(false, || {
        // SAFETY: caller contract.
        unsafe { guard::str_arg(name, "name") }
            .map(|n| all2all::lookup(n).is_some() || n == all2all::PASSTHROUGH)
            .unwrap_or(false)
    })
}

/// The canonical name of an EPCOMM_ALL2ALL_* backend (static string; "passthrough" for
/// EPCOMM_ALL2ALL_PASSTHROUGH), or NULL if `backend` is not one.
#[no_mangle]
pub extern "C" fn epcomm_all2all_backend_name(backend: i32) -> *const c_char {
    guard::name_or_null(|| match backend {
        EPCOMM_ALL2ALL_PASSTHROUGH => Some(all2all::PASSTHROUGH),
        code => Backend::from_code(code).map(|b| b.name()),
    })
}

/// vLLM's manager class for a backend (e.g. "DeepEPLLAll2AllManager";
/// "PassThroughAll2AllManager" for EPCOMM_ALL2ALL_PASSTHROUGH), or NULL if `backend` is not an
/// EPCOMM_ALL2ALL_* value.
#[no_mangle]
pub extern "C" fn epcomm_all2all_backend_manager_class(backend: i32) -> *const c_char {
    guard::name_or_null(|| match backend {
        EPCOMM_ALL2ALL_PASSTHROUGH => Some(all2all::PASSTHROUGH_MANAGER_CLASS),
        code => Backend::from_code(code).map(|b| b.manager_class()),
    })
}

/// The EPCOMM_LAYOUT_* a backend's dispatch/combine use. EPCOMM_ALL2ALL_PASSTHROUGH has none
/// (EPCOMM_ERROR_INVALID_ARGUMENT saying so).
///
/// # Safety
/// `layout_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_backend_layout(backend: i32, layout_out: *mut i32) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(layout_out, "layout_out") }?;
        *out = backend_arg(backend)?.layout() as i32;
        Ok(())
    })
}

/// The name of an EPCOMM_LAYOUT_* value ("REPLICATED", "TOKEN_MAJOR", ...), or NULL.
#[no_mangle]
pub extern "C" fn epcomm_all2all_layout_name(layout: i32) -> *const c_char {
    guard::name_or_null(|| Layout::from_code(layout).map(|l| l.name()))
}

/// How many names epcomm_all2all_name_info can describe.
#[no_mangle]
pub extern "C" fn epcomm_all2all_name_count() -> usize {
    all2all::ACCEPTED_NAMES.len()
}

/// Describes accepted name number `index` (0 <= index < epcomm_all2all_name_count()), in vLLM's
/// order.
///
/// # Safety
/// `info_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_name_info(
    index: usize,
    info_out: *mut epcomm_all2all_name_desc,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(info_out, "info_out") }?;
        let n = all2all::ACCEPTED_NAMES.get(index).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "index {index} is out of range: expected 0 <= index < {}",
                all2all::ACCEPTED_NAMES.len()
            ))
        })?;
        *out = epcomm_all2all_name_desc {
            name: guard::static_cstr(n.name),
            backend: n.backend as i32,
            kind: n.kind as i32,
            layout: n.backend.layout() as i32,
            manager_class: guard::static_cstr(n.backend.manager_class()),
        };
        Ok(())
    })
}

/// What the EPLB communicator factory needs to decide.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_eplb_select_request {
    /// sizeof(epcomm_eplb_select_request); lets the struct grow.
    pub struct_size: u32,
    /// The configured name ("torch_nccl", "torch_gloo", "torch_xccl", "nixl", "pynccl");
    /// NULL = automatic.
    pub communicator: *const c_char,
    /// The EP group is an elastic (stateless) group.
    pub elastic: bool,
    /// DLPack device type of the expert weights (EPCOMM_DEVICE_*).
    pub device_type: i32,
    /// Dtypes of the first layer's expert weight tensors (may be NULL when the count is 0).
    pub weight_dtypes: *const epcomm_dtype,
    /// Number of entries in weight_dtypes.
    pub num_weight_dtypes: usize,
    /// 1 = NCCL usable, 0 = not, EPCOMM_PROBE = probe this process.
    pub nccl_available: i32,
    /// 1 = NIXL present, 0 = not, EPCOMM_PROBE = probe this process.
    pub nixl_available: i32,
}

fn availability(v: i32, field: &str, probe: impl FnOnce() -> bool) -> Result<bool, Error> {
    match v {
        EPCOMM_PROBE => Ok(probe()),
        0 => Ok(false),
        1 => Ok(true),
        other => Err(Error::InvalidArgument(format!(
            "{field} is {other}: expected 0, 1 or EPCOMM_PROBE (-1)"
        ))),
    }
}

/// Chooses the EPLB communicator with vLLM's `create_eplb_communicator` rules and messages
/// (elastic EP restrictions, the forced-to-pynccl warning, device and dtype checks, NCCL/NIXL
/// availability; automatic selection when no name is given) and writes EPCOMM_EPLB_*.
/// `torch_xccl` (chosen by vLLM for XPU, and automatically on EPCOMM_DEVICE_ONEAPI weights) is
/// EPCOMM_EPLB_TORCH_XCCL; creating it moves host memory only (XPU weights staged in host
/// memory by the caller), as vLLM runs it on the CPU group for host tensors.
///
/// # Safety
/// `request` is NULL or a valid request whose pointers follow their field docs;
/// `communicator_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_communicator_select(
    request: *const epcomm_eplb_select_request,
    communicator_out: *mut i32,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(communicator_out, "communicator_out") }?;
        let req = unsafe { SelectArgs::from_ffi(request) }?;
        let (sel, warnings) = eplb::select_outcome(&req.request());
        for w in &warnings {
            crate::log::warn(w);
        }
        *out = sel?.communicator as i32;
        Ok(())
    })
}

/// A parsed `epcomm_eplb_select_request`.
pub(crate) struct SelectArgs {
    pub requested: Option<String>,
    pub elastic: bool,
    pub device: DeviceKind,
    pub dtypes: Vec<DType>,
    pub nccl_available: bool,
    pub nixl_available: bool,
}

impl SelectArgs {
    /// # Safety
    /// `request` is NULL or a valid request whose pointers follow their field docs.
    pub(crate) unsafe fn from_ffi(
        request: *const epcomm_eplb_select_request,
    ) -> Result<SelectArgs, Error> {
        // SAFETY: caller contract.
        let req = unsafe { request.as_ref() }.ok_or(Error::NullPointer("request"))?;
        if (req.struct_size as usize) < std::mem::size_of::<epcomm_eplb_select_request>() {
            return Err(Error::InvalidArgument(format!(
                "request->struct_size is {}: expected sizeof(epcomm_eplb_select_request) = {}",
                req.struct_size,
                std::mem::size_of::<epcomm_eplb_select_request>()
            )));
        }
        let requested = if req.communicator.is_null() {
            None
        } else {
            // SAFETY: non-NULL, NUL-terminated per the field doc.
            Some(unsafe { guard::str_arg(req.communicator, "request->communicator") }?.to_owned())
        };
        let (p, n) = (req.weight_dtypes, req.num_weight_dtypes);
        // SAFETY: num_weight_dtypes entries per the field doc.
        let dtypes: Vec<DType> = unsafe { guard::slice_arg(p, n, "request->weight_dtypes") }?
            .iter()
            .map(|d| DType::from(*d))
            .collect();
        Ok(SelectArgs {
            requested,
            elastic: req.elastic,
            device: DeviceKind::from_dlpack(req.device_type),
            dtypes,
            nccl_available: availability(
                req.nccl_available,
                "request->nccl_available",
                probe::nccl_usable,
            )?,
            nixl_available: availability(
                req.nixl_available,
                "request->nixl_available",
                probe::nixl_usable,
            )?,
        })
    }

    pub(crate) fn request(&self) -> eplb::SelectRequest<'_> {
        eplb::SelectRequest {
            requested: self.requested.as_deref(),
            elastic: self.elastic,
            device: self.device,
            weight_dtypes: &self.dtypes,
            nccl_available: self.nccl_available,
            nixl_available: self.nixl_available,
        }
    }
}

/// The name of an EPCOMM_EPLB_* communicator (static string), or NULL.
#[no_mangle]
pub extern "C" fn epcomm_eplb_communicator_name(communicator: i32) -> *const c_char {
    guard::name_or_null(|| Communicator::from_code(communicator).map(|c| c.name()))
}

/// vLLM's class for an EPCOMM_EPLB_* communicator (e.g. "PyNcclEplbCommunicator"), or NULL.
#[no_mangle]
pub extern "C" fn epcomm_eplb_communicator_class(communicator: i32) -> *const c_char {
    guard::name_or_null(|| Communicator::from_code(communicator).map(|c| c.class_name()))
}
