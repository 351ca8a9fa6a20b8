//! DLPack exports whose deleter is C code: `epcomm_dlpack_export` wraps a tensor view in a
//! DLManagedTensor (or DLPack 1.x's DLManagedTensorVersioned) with its own copy of the shape,
//! and its deleter calls the exporter's `release(ctx)` exactly once and frees the rest.
//!
//! A binding written in an interpreted language (Python's ctypes) cannot give a consumer a
//! deleter of its own: consumers call the deleter when their tensor dies, which may be while an
//! exception propagates or on a thread without the interpreter's lock, where interpreted code
//! must not run. So the library also carries the two C functions a Python binding needs,
//! driven by Python C-API functions the binding hands over once
//! (`epcomm_dlpack_set_python_api`): a release function that takes the GIL and drops one
//! reference (`epcomm_dlpack_python_release`) and the DLPack spec's capsule destructor
//! (`epcomm_dlpack_capsule_destructor`), which frees a capsule nobody consumed.

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::guard;
use super::tensor::epcomm_tensor;
use crate::error::{Error, Result};

/// DLPack's `DLPackVersion`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct epcomm_dlpack_version {
    /// DLPack's major version (1 for DLPack 1.x).
    pub major: u32,
    /// DLPack's minor version.
    pub minor: u32,
}

/// DLPack's pre-1.0 `DLManagedTensor`, field for field (a `DLManagedTensor *` can be passed by
/// cast). The consumer calls `deleter(self)` once when it no longer reads the tensor.
#[repr(C)]
#[derive(Debug)]
pub struct epcomm_dlpack_managed {
    /// The tensor (DLPack's `DLTensor`).
    pub dl_tensor: epcomm_tensor,
    /// The producer's state.
    pub manager_ctx: *mut c_void,
    /// Frees the tensor and `self`.
    pub deleter: Option<unsafe extern "C" fn(managed: *mut epcomm_dlpack_managed)>,
}

/// DLPack 1.x's `DLManagedTensorVersioned`, field for field.
#[repr(C)]
#[derive(Debug)]
pub struct epcomm_dlpack_managed_versioned {
    /// The DLPack version of this struct ({1, 0} for epcomm's exports).
    pub version: epcomm_dlpack_version,
    /// The producer's state.
    pub manager_ctx: *mut c_void,
    /// Frees the tensor and `self`.
    pub deleter: Option<unsafe extern "C" fn(managed: *mut epcomm_dlpack_managed_versioned)>,
    /// DLPack's flags (0 for epcomm's exports: writable, not a copy).
    pub flags: u64,
    /// The tensor (DLPack's `DLTensor`).
    pub dl_tensor: epcomm_tensor,
}

/// Called exactly once with the `ctx` given to epcomm_dlpack_export when the export's deleter
/// runs, on whatever thread the consumer calls the deleter from.
pub type epcomm_dlpack_release_fn = Option<unsafe extern "C" fn(ctx: *mut c_void)>;

/// The Python C-API functions epcomm_dlpack_python_release and
/// epcomm_dlpack_capsule_destructor call, as a Python binding finds them (ctypes.pythonapi).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_python_api {
    /// sizeof(epcomm_python_api); lets the struct grow.
    pub struct_size: u32,
    /// `PyGILState_Ensure`.
    pub gil_ensure: Option<unsafe extern "C" fn() -> i32>,
    /// `PyGILState_Release`.
    pub gil_release: Option<unsafe extern "C" fn(state: i32)>,
    /// `Py_DecRef`.
    pub decref: Option<unsafe extern "C" fn(object: *mut c_void)>,
    /// `Py_IsInitialized`.
    pub is_initialized: Option<unsafe extern "C" fn() -> i32>,
    /// `PyCapsule_GetName`.
    pub capsule_get_name: Option<unsafe extern "C" fn(capsule: *mut c_void) -> *const c_char>,
    /// `PyCapsule_GetPointer`.
    pub capsule_get_pointer:
        Option<unsafe extern "C" fn(capsule: *mut c_void, name: *const c_char) -> *mut c_void>,
}

/// The Python API with every function present.
#[derive(Clone, Copy)]
struct PythonApi {
    gil_ensure: unsafe extern "C" fn() -> i32,
    gil_release: unsafe extern "C" fn(i32),
    decref: unsafe extern "C" fn(*mut c_void),
    is_initialized: unsafe extern "C" fn() -> i32,
    capsule_get_name: unsafe extern "C" fn(*mut c_void) -> *const c_char,
    capsule_get_pointer: unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void,
}

impl PythonApi {
    /// The addresses, to tell one set of functions from another.
    fn addresses(&self) -> [usize; 6] {
        [
            self.gil_ensure as usize,
            self.gil_release as usize,
            self.decref as usize,
            self.is_initialized as usize,
            self.capsule_get_name as usize,
            self.capsule_get_pointer as usize,
        ]
    }
}

static PYTHON: OnceLock<PythonApi> = OnceLock::new();

/// Exports whose deleter has not run yet.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// What an export's deleter frees and releases (its `manager_ctx`).
struct Export {
    _shape: Box<[i64]>,
    _strides: Option<Box<[i64]>>,
    release: epcomm_dlpack_release_fn,
    ctx: *mut c_void,
}

/// Frees an export's state and calls its release function.
///
/// # Safety
/// `state` came from `Box::into_raw` in `new_export` and was not finished before.
unsafe fn finish(state: *mut c_void) {
    // SAFETY: caller contract.
    let e = unsafe { Box::from_raw(state.cast::<Export>()) };
    let (release, ctx) = (e.release, e.ctx);
    drop(e);
    LIVE.fetch_sub(1, Ordering::SeqCst);
    if let Some(f) = release {
        // SAFETY: the exporter gave this function for this context.
        unsafe { f(ctx) };
    }
}

unsafe extern "C" fn delete_managed(managed: *mut epcomm_dlpack_managed) {
    guard::call_or((), || {
        if !managed.is_null() {
            // SAFETY: made by epcomm_dlpack_export; a consumer calls the deleter once.
            let m = unsafe { Box::from_raw(managed) };
            // SAFETY: its manager_ctx is its Export.
            unsafe { finish(m.manager_ctx) };
        }
    })
}

unsafe extern "C" fn delete_versioned(managed: *mut epcomm_dlpack_managed_versioned) {
    guard::call_or((), || {
        if !managed.is_null() {
            // SAFETY: made by epcomm_dlpack_export; a consumer calls the deleter once.
            let m = unsafe { Box::from_raw(managed) };
            // SAFETY: its manager_ctx is its Export.
            unsafe { finish(m.manager_ctx) };
        }
    })
}

/// The tensor with its own copies of the shape and strides, and their state.
///
/// # Safety
/// `t`'s shape (and strides, when not NULL) hold `ndim` entries.
unsafe fn new_export(
    t: &epcomm_tensor,
    release: epcomm_dlpack_release_fn,
    ctx: *mut c_void,
) -> Result<(epcomm_tensor, *mut c_void)> {
    let n = usize::try_from(t.ndim).map_err(|_| {
        Error::InvalidArgument(format!(
            "tensor->ndim is {}; expected 0 or more dimensions",
            t.ndim
        ))
    })?;
    // SAFETY: shape holds ndim entries (caller contract); NULL only with none.
    let shape: Box<[i64]> = unsafe { guard::slice_arg(t.shape, n, "tensor->shape") }?.into();
    let strides: Option<Box<[i64]>> = if t.strides.is_null() {
        None
    } else {
        // SAFETY: strides holds ndim entries when not NULL (caller contract).
        Some(unsafe { guard::slice_arg(t.strides, n, "tensor->strides") }?.into())
    };
    let mut e = Box::new(Export {
        _shape: shape,
        _strides: strides,
        release,
        ctx,
    });
    let mut view = *t;
    view.shape = e._shape.as_mut_ptr();
    view.strides = e
        ._strides
        .as_mut()
        .map_or(std::ptr::null_mut(), |s| s.as_mut_ptr());
    LIVE.fetch_add(1, Ordering::SeqCst);
    Ok((view, Box::into_raw(e).cast()))
}

/// Exports the view `tensor` as a DLPack managed tensor: a `DLManagedTensorVersioned`
/// (epcomm_dlpack_managed_versioned: version {1, 0}, flags 0) when `versioned`, else a
/// `DLManagedTensor` (epcomm_dlpack_managed), written to `*managed_out`. The export has its
/// own copies of the shape and strides (NULL strides stay NULL: row-major); the data is not
/// copied and must stay valid until the deleter runs. Its deleter, called once by the consumer
/// from any thread, frees the export and then calls `release(ctx)` (when `release` is not
/// NULL) exactly once. On failure nothing is allocated and `release` is not called.
///
/// # Safety
/// `tensor` is NULL or valid, its shape (and strides, when not NULL) holding `ndim` entries;
/// `managed_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_dlpack_export(
    tensor: *const epcomm_tensor,
    versioned: bool,
    release: epcomm_dlpack_release_fn,
    ctx: *mut c_void,
    managed_out: *mut *mut c_void,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let t = unsafe { tensor.as_ref() }.ok_or(Error::NullPointer("tensor"))?;
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(managed_out, "managed_out") }?;
        // SAFETY: caller contract.
        let (dl_tensor, manager_ctx) = unsafe { new_export(t, release, ctx) }?;
        *out = if versioned {
            Box::into_raw(Box::new(epcomm_dlpack_managed_versioned {
                version: epcomm_dlpack_version { major: 1, minor: 0 },
                manager_ctx,
                deleter: Some(delete_versioned),
                flags: 0,
                dl_tensor,
            }))
            .cast()
        } else {
            Box::into_raw(Box::new(epcomm_dlpack_managed {
                dl_tensor,
                manager_ctx,
                deleter: Some(delete_managed),
            }))
            .cast()
        };
        Ok(())
    })
}

/// Calls the deleter of `managed`, a DLManagedTensor of any producer, as a consumer does (to
/// free an export nobody consumed); NULL, or a NULL deleter, does nothing.
///
/// # Safety
/// `managed` is NULL or a managed tensor whose deleter was not called yet.
#[no_mangle]
pub unsafe extern "C" fn epcomm_dlpack_delete(managed: *mut epcomm_dlpack_managed) {
    guard::call_or((), || {
        // SAFETY: caller contract.
        if let Some(d) = unsafe { managed.as_ref() }.and_then(|m| m.deleter) {
            // SAFETY: the producer's deleter for this tensor.
            unsafe { d(managed) };
        }
    })
}

/// epcomm_dlpack_delete for a DLManagedTensorVersioned.
///
/// # Safety
/// `managed` is NULL or a managed tensor whose deleter was not called yet.
#[no_mangle]
pub unsafe extern "C" fn epcomm_dlpack_delete_versioned(
    managed: *mut epcomm_dlpack_managed_versioned,
) {
    guard::call_or((), || {
        // SAFETY: caller contract.
        if let Some(d) = unsafe { managed.as_ref() }.and_then(|m| m.deleter) {
            // SAFETY: the producer's deleter for this tensor.
            unsafe { d(managed) };
        }
    })
}

/// How many epcomm_dlpack_export exports of this process have not been deleted yet.
#[no_mangle]
pub extern "C" fn epcomm_dlpack_live() -> usize {
    guard::call_or(0, || LIVE.load(Ordering::SeqCst))
}

/// The functions of `api`, each required.
fn python_api_arg(api: &epcomm_python_api) -> Result<PythonApi> {
    let size = std::mem::size_of::<epcomm_python_api>();
    if (api.struct_size as usize) < size {
        return Err(Error::InvalidArgument(format!(
            "api->struct_size is {}: expected sizeof(epcomm_python_api) = {size}",
            api.struct_size
        )));
    }
    Ok(PythonApi {
        gil_ensure: api
            .gil_ensure
            .ok_or(Error::NullPointer("api->gil_ensure"))?,
        gil_release: api
            .gil_release
            .ok_or(Error::NullPointer("api->gil_release"))?,
        decref: api.decref.ok_or(Error::NullPointer("api->decref"))?,
        is_initialized: api
            .is_initialized
            .ok_or(Error::NullPointer("api->is_initialized"))?,
        capsule_get_name: api
            .capsule_get_name
            .ok_or(Error::NullPointer("api->capsule_get_name"))?,
        capsule_get_pointer: api
            .capsule_get_pointer
            .ok_or(Error::NullPointer("api->capsule_get_pointer"))?,
    })
}

/// Gives epcomm the Python C-API functions of the interpreter that loaded it, for
/// epcomm_dlpack_python_release and epcomm_dlpack_capsule_destructor. Set once per process:
/// a later call with the same functions succeeds, one with others is
/// EPCOMM_ERROR_INVALID_STATE. Every function is required (NULL names the field).
///
/// # Safety
/// `api` is NULL or valid; its functions are the running interpreter's and stay valid for the
/// life of the process.
#[no_mangle]
pub unsafe extern "C" fn epcomm_dlpack_set_python_api(api: *const epcomm_python_api) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let api = unsafe { api.as_ref() }.ok_or(Error::NullPointer("api"))?;
        let wanted = python_api_arg(api)?;
        let set = PYTHON.get_or_init(|| wanted);
        if set.addresses() != wanted.addresses() {
            return Err(Error::InvalidState(
                "the Python C API was already set to another interpreter's functions".into(),
            ));
        }
        Ok(())
    })
}

/// An epcomm_dlpack_release_fn for a Python binding: `object` is a `PyObject *` the binding
/// owns one reference to, which this drops with the GIL held (`PyGILState_Ensure`,
/// `Py_DecRef`, `PyGILState_Release`), so it runs no Python code of its own and is safe from
/// any thread, with or without the GIL and with an exception pending. Does nothing for NULL,
/// before epcomm_dlpack_set_python_api, or once the interpreter is finalized (the reference is
/// then left, as the interpreter's memory is).
///
/// # Safety
/// `object` is NULL or a live `PyObject *` of the interpreter whose API was set, with a
/// reference the caller gives up.
#[no_mangle]
pub unsafe extern "C" fn epcomm_dlpack_python_release(object: *mut c_void) {
    guard::call_or((), || {
        let Some(py) = PYTHON.get() else { return };
        // SAFETY: the interpreter's own functions (epcomm_dlpack_set_python_api's contract);
        // object holds a reference (caller contract).
        unsafe {
            if object.is_null() || (py.is_initialized)() == 0 {
                return;
            }
            let state = (py.gil_ensure)();
            (py.decref)(object);
            (py.gil_release)(state);
        }
    })
}

/// A `PyCapsule` destructor for capsules of epcomm_dlpack_export's tensors, as the DLPack
/// spec's Python rules ask: a capsule still named "dltensor" (or "dltensor_versioned") was not
/// consumed, so its tensor's deleter is called; a consumed one (renamed "used_dltensor" or
/// "used_dltensor_versioned") is left to its consumer. Runs no Python code and sets no Python
/// error, so it is safe while an exception propagates. Does nothing for NULL or before
/// epcomm_dlpack_set_python_api.
///
/// # Safety
/// `capsule` is NULL or a live `PyCapsule` whose pointer, under those names, is a managed
/// tensor of that kind; called with the GIL held (Python calls destructors so).
#[no_mangle]
pub unsafe extern "C" fn epcomm_dlpack_capsule_destructor(capsule: *mut c_void) {
    guard::call_or((), || {
        let Some(py) = PYTHON.get() else { return };
        if capsule.is_null() {
            return;
        }
        // SAFETY: a live capsule (caller contract); its name is NUL-terminated.
        let name = unsafe { (py.capsule_get_name)(capsule) };
        if name.is_null() {
            return;
        }
        // SAFETY: non-NULL, NUL-terminated (PyCapsule_GetName's contract).
        let versioned = match unsafe { CStr::from_ptr(name) }.to_bytes() {
            b"dltensor" => false,
            b"dltensor_versioned" => true,
            _ => return,
        };
        // SAFETY: the capsule's own name, so this cannot fail or set an error.
        let managed = unsafe { (py.capsule_get_pointer)(capsule, name) };
        // SAFETY: an unconsumed managed tensor of that kind (caller contract).
        unsafe {
            if versioned {
                epcomm_dlpack_delete_versioned(managed.cast());
            } else {
                epcomm_dlpack_delete(managed.cast());
            }
        }
    })
}
