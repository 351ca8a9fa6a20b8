//! The C ABI's DLPack exports (src/ffi/dlpack.rs), called as a consumer calls them: the managed
//! tensors have dlpack.h's layouts, own their shape, and their deleter (called on any thread)
//! frees them and calls the exporter's release exactly once; failures allocate and release
//! nothing. The Python helpers run against a recording stand-in for the Python C API: the
//! release takes the GIL around one Py_DecRef, the capsule destructor frees only unconsumed
//! capsules. One test function per group of checks, serialized: the live count is process-wide.
//! tests/c/dlpack_test.c does the same from C11 and C++17 under ASan+UBSan, whose leak check
//! sees every export freed.

mod common;

use std::ffi::{c_char, c_void, CStr};
use std::mem::{offset_of, size_of};
use std::ptr::{null, null_mut};
use std::sync::Mutex;

use epcomm::ffi::dlpack::*;
use epcomm::ffi::error::epcomm_last_error_message;
use epcomm::ffi::tensor::{epcomm_device, epcomm_tensor};
use epcomm::ffi::{epcomm_dtype, EPCOMM_ERROR_INVALID_STATE, EPCOMM_OK};

use common::{assert_c_test_passed, build_sanitized, manifest_dir, out_dir, run_sanitized, Lang};

static SERIAL: Mutex<()> = Mutex::new(());
/// Every call the release functions and the stand-in Python API saw, in order.
static CALLS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn record(call: String) {
    CALLS.lock().unwrap().push(call);
}

fn take_calls() -> Vec<String> {
    std::mem::take(&mut *CALLS.lock().unwrap())
}

unsafe extern "C" fn release(ctx: *mut c_void) {
    record(format!("release {}", ctx as usize));
}

fn last_error() -> String {
    // SAFETY: the last error is NULL or a NUL-terminated string of this thread.
    let p = epcomm_last_error_message();
    assert!(!p.is_null());
    unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned()
}

/// A 2x3 float32 view of `data` with the given shape array.
fn view(data: &mut [f32; 6], shape: &mut [i64; 2]) -> epcomm_tensor {
    epcomm_tensor {
        data: data.as_mut_ptr().cast(),
        device: epcomm_device {
            device_type: 1,
            device_id: 0,
        },
        ndim: 2,
        dtype: epcomm_dtype {
            code: 2,
            bits: 32,
            lanes: 1,
        },
        shape: shape.as_mut_ptr(),
        strides: null_mut(),
        byte_offset: 4,
    }
}

fn export(t: &epcomm_tensor, versioned: bool, ctx: usize) -> *mut c_void {
    let mut out = null_mut();
    // SAFETY: a valid tensor and output.
    let rc = unsafe { epcomm_dlpack_export(t, versioned, Some(release), ctx as _, &mut out) };
    assert_eq!(rc, EPCOMM_OK);
    assert!(!out.is_null());
    out
}

#[test]
fn layouts_match_dlpack_h() {
    // dlpack.h: DLTensor is 48 bytes; DLManagedTensor {dl_tensor, manager_ctx, deleter};
    // DLManagedTensorVersioned {version, manager_ctx, deleter, flags, dl_tensor}.
    assert_eq!(size_of::<epcomm_tensor>(), 48);
    assert_eq!(size_of::<epcomm_dlpack_managed>(), 64);
    assert_eq!(offset_of!(epcomm_dlpack_managed, manager_ctx), 48);
    assert_eq!(offset_of!(epcomm_dlpack_managed, deleter), 56);
    assert_eq!(size_of::<epcomm_dlpack_managed_versioned>(), 80);
    assert_eq!(offset_of!(epcomm_dlpack_managed_versioned, manager_ctx), 8);
    assert_eq!(offset_of!(epcomm_dlpack_managed_versioned, deleter), 16);
    assert_eq!(offset_of!(epcomm_dlpack_managed_versioned, flags), 24);
    assert_eq!(offset_of!(epcomm_dlpack_managed_versioned, dl_tensor), 32);
}

#[test]
fn deleters_free_the_export_and_release_once() {
    let _s = serial();
    take_calls();
    let before = epcomm_dlpack_live();
    let mut data = [0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0];
    let mut shape = [2i64, 3];
    let t = view(&mut data, &mut shape);
    let m = export(&t, false, 7).cast::<epcomm_dlpack_managed>();
    let v = export(&t, true, 8).cast::<epcomm_dlpack_managed_versioned>();
    shape = [9, 9]; // the exports have their own copies
    assert_eq!(shape, [9, 9]);
    assert_eq!(epcomm_dlpack_live(), before + 2);
    // SAFETY: live exports.
    unsafe {
        let (a, b) = (&(*m).dl_tensor, &(*v).dl_tensor);
        for x in [a, b] {
            assert_eq!(x.data, t.data);
            assert_eq!((x.ndim, x.byte_offset, x.dtype), (2, 4, t.dtype));
            assert_eq!(std::slice::from_raw_parts(x.shape, 2), [2, 3]);
            assert!(x.strides.is_null());
        }
        assert_eq!((*v).version, epcomm_dlpack_version { major: 1, minor: 0 });
        assert_eq!((*v).flags, 0);
        assert!(!(*m).manager_ctx.is_null() && !(*v).manager_ctx.is_null());
    }
    assert_eq!(take_calls(), Vec::<String>::new());
    // SAFETY: each deleter once, as a consumer calls it.
    unsafe { ((*m).deleter.unwrap())(m) };
    assert_eq!(take_calls(), ["release 7"]);
    assert_eq!(epcomm_dlpack_live(), before + 1);
    // A consumer on another thread.
    let addr = v as usize;
    std::thread::spawn(move || {
        let v = addr as *mut epcomm_dlpack_managed_versioned;
        // SAFETY: the export's deleter, once.
        unsafe { epcomm_dlpack_delete_versioned(v) };
    })
    .join()
    .unwrap();
    assert_eq!(take_calls(), ["release 8"]);
    assert_eq!(epcomm_dlpack_live(), before);
}

#[test]
fn strides_and_scalars_are_copied() {
    let _s = serial();
    let before = epcomm_dlpack_live();
    let mut data = [0.0f32; 6];
    let mut shape = [2i64, 3];
    let mut strides = [3i64, 1];
    let mut t = view(&mut data, &mut shape);
    t.strides = strides.as_mut_ptr();
    let m = export(&t, false, 0).cast::<epcomm_dlpack_managed>();
    strides = [0, 0];
    assert_eq!(strides, [0, 0]);
    // SAFETY: a live export.
    unsafe {
        let s = (*m).dl_tensor.strides;
        assert!(!s.is_null() && s != t.strides);
        assert_eq!(std::slice::from_raw_parts(s, 2), [3, 1]);
    }
    t.ndim = 0;
    t.shape = null_mut();
    t.strides = null_mut();
    let scalar = export(&t, true, 0).cast::<epcomm_dlpack_managed_versioned>();
    // SAFETY: a live export.
    assert_eq!(unsafe { (*scalar).dl_tensor.ndim }, 0);
    // SAFETY: each once; without a release function nothing more is called.
    unsafe {
        epcomm_dlpack_delete(m);
        epcomm_dlpack_delete_versioned(scalar);
        epcomm_dlpack_delete(null_mut());
        epcomm_dlpack_delete_versioned(null_mut());
    }
    assert_eq!(epcomm_dlpack_live(), before);
    take_calls();
}

#[test]
fn failures_allocate_and_release_nothing() {
    let _s = serial();
    take_calls();
    let before = epcomm_dlpack_live();
    let mut data = [0.0f32; 6];
    let mut shape = [2i64, 3];
    let good = view(&mut data, &mut shape);
    let mut negative = good;
    negative.ndim = -1;
    let mut no_shape = good;
    no_shape.shape = null_mut();
    let cases: [(*const epcomm_tensor, bool, i32, &str); 4] = [
        (null(), false, 1, "argument 'tensor' must not be NULL"),
        (&good, true, 1, "argument 'managed_out' must not be NULL"),
        (
            &negative,
            false,
            2,
            "tensor->ndim is -1; expected 0 or more dimensions",
        ),
        (
            &no_shape,
            false,
            1,
            "argument 'tensor->shape' must not be NULL",
        ),
    ];
    for (t, null_out, status, message) in cases {
        let mut out = 0xdead as *mut c_void;
        let out_arg = if null_out {
            null_mut()
        } else {
            &mut out as *mut _
        };
        // SAFETY: NULL or valid arguments.
        let rc = unsafe { epcomm_dlpack_export(t, false, Some(release), 5 as _, out_arg) };
        assert_eq!((rc, last_error()), (status, message.to_owned()));
        assert_eq!(out as usize, 0xdead, "{message}: the output was written");
    }
    assert_eq!(epcomm_dlpack_live(), before);
    assert_eq!(take_calls(), Vec::<String>::new());
}

// A stand-in for the Python C API that records its calls.
unsafe extern "C" fn gil_ensure() -> i32 {
    record("PyGILState_Ensure".into());
    42
}
unsafe extern "C" fn gil_release(state: i32) {
    record(format!("PyGILState_Release {state}"));
}
unsafe extern "C" fn decref(object: *mut c_void) {
    record(format!("Py_DecRef {}", object as usize));
}
unsafe extern "C" fn is_initialized() -> i32 {
    1
}

/// A stand-in capsule: its name and pointer.
#[repr(C)]
struct Capsule {
    name: *const c_char,
    pointer: *mut c_void,
}

unsafe extern "C" fn capsule_get_name(capsule: *mut c_void) -> *const c_char {
    // SAFETY: a Capsule.
    unsafe { (*capsule.cast::<Capsule>()).name }
}
unsafe extern "C" fn capsule_get_pointer(capsule: *mut c_void, name: *const c_char) -> *mut c_void {
    // SAFETY: a Capsule.
    let c = unsafe { &*capsule.cast::<Capsule>() };
    assert_eq!(
        name, c.name,
        "PyCapsule_GetPointer must be asked for the capsule's own name"
    );
    c.pointer
}

fn api() -> epcomm_python_api {
    epcomm_python_api {
        struct_size: size_of::<epcomm_python_api>() as u32,
        gil_ensure: Some(gil_ensure),
        gil_release: Some(gil_release),
        decref: Some(decref),
        is_initialized: Some(is_initialized),
        capsule_get_name: Some(capsule_get_name),
        capsule_get_pointer: Some(capsule_get_pointer),
    }
}

fn set_api(api: &epcomm_python_api) -> (i32, String) {
    // SAFETY: a valid struct.
    let rc = unsafe { epcomm_dlpack_set_python_api(api) };
    (
        rc,
        if rc == EPCOMM_OK {
            String::new()
        } else {
            last_error()
        },
    )
}

/// Before the API is set the Python helpers do nothing; bad tables are refused and set nothing.
fn refused_tables() {
    // SAFETY: NULL arguments.
    unsafe {
        epcomm_dlpack_python_release(1 as _);
        epcomm_dlpack_capsule_destructor(null_mut());
    }
    assert_eq!(take_calls(), Vec::<String>::new());
    let mut small = api();
    small.struct_size = 8;
    let size = size_of::<epcomm_python_api>();
    assert_eq!(
        set_api(&small),
        (
            2,
            format!("api->struct_size is 8: expected sizeof(epcomm_python_api) = {size}")
        )
    );
    let mut no_decref = api();
    no_decref.decref = None;
    assert_eq!(
        set_api(&no_decref),
        (1, "argument 'api->decref' must not be NULL".into())
    );
    // SAFETY: NULL.
    let rc = unsafe { epcomm_dlpack_set_python_api(null()) };
    assert_eq!(
        (rc, last_error()),
        (1, "argument 'api' must not be NULL".into())
    );
}

#[test]
fn python_release_and_capsule_destructor() {
    let _s = serial();
    take_calls();
    refused_tables();
    assert_eq!(set_api(&api()), (EPCOMM_OK, String::new()));
    assert_eq!(
        set_api(&api()),
        (EPCOMM_OK, String::new()),
        "the same table again"
    );
    let mut other = api();
    other.is_initialized = Some(gil_ensure);
    assert_eq!(
        set_api(&other),
        (
            EPCOMM_ERROR_INVALID_STATE,
            "the Python C API was already set to another interpreter's functions".into()
        )
    );
    let before = epcomm_dlpack_live();
    let mut data = [0.0f32; 6];
    let mut shape = [2i64, 3];
    let t = view(&mut data, &mut shape);
    let export_py = |versioned: bool, object: usize| {
        let mut out = null_mut();
        let f: epcomm_dlpack_release_fn = Some(epcomm_dlpack_python_release);
        // SAFETY: valid arguments.
        let rc = unsafe { epcomm_dlpack_export(&t, versioned, f, object as _, &mut out) };
        assert_eq!(rc, EPCOMM_OK);
        out
    };
    // Unconsumed capsules: the destructor calls the deleter, which drops the reference.
    // Consumed ones are left to the consumer, whose deleter call (here from another thread,
    // without the GIL) takes the GIL around the Py_DecRef.
    let mut caps = [
        (c"dltensor", export_py(false, 100)),
        (c"dltensor_versioned", export_py(true, 101)),
        (c"used_dltensor", export_py(false, 102)),
        (c"used_dltensor_versioned", export_py(true, 103)),
    ]
    .map(|(name, pointer)| Capsule {
        name: name.as_ptr(),
        pointer,
    });
    assert_eq!(epcomm_dlpack_live(), before + 4);
    for c in caps.iter_mut() {
        // SAFETY: a stand-in capsule with a managed tensor of its name's kind.
        unsafe { epcomm_dlpack_capsule_destructor((c as *mut Capsule).cast()) };
    }
    let gil = |n: usize| {
        [
            "PyGILState_Ensure".to_owned(),
            format!("Py_DecRef {n}"),
            "PyGILState_Release 42".into(),
        ]
    };
    assert_eq!(take_calls(), [gil(100), gil(101)].concat());
    assert_eq!(epcomm_dlpack_live(), before + 2);
    let (a, b) = (caps[2].pointer as usize, caps[3].pointer as usize);
    std::thread::spawn(move || {
        // SAFETY: each export's deleter, once.
        unsafe {
            epcomm_dlpack_delete(a as *mut _);
            epcomm_dlpack_delete_versioned(b as *mut _);
        }
    })
    .join()
    .unwrap();
    assert_eq!(take_calls(), [gil(102), gil(103)].concat());
    assert_eq!(epcomm_dlpack_live(), before);
    // SAFETY: NULL does nothing.
    unsafe {
        epcomm_dlpack_python_release(null_mut());
        epcomm_dlpack_capsule_destructor(null_mut());
    }
    assert_eq!(take_calls(), Vec::<String>::new());
}

fn c_test(lang: Lang, name: &str) {
    let exe = out_dir(name).join("dlpack_test");
    let source = manifest_dir().join("tests/c/dlpack_test.c");
    build_sanitized(&lang.compiler(), lang.flags(), &source, &exe);
    assert_c_test_passed(name, &run_sanitized(&exe));
}

#[test]
fn c_consumer_c11_sanitized() {
    c_test(Lang::C11, "dlpack-c11");
}

#[test]
fn c_consumer_cxx17_sanitized() {
    c_test(Lang::Cxx17, "dlpack-cxx17");
}
