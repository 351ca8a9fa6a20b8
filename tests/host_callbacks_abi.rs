//! `epcomm_host_callbacks` is append-only: a host built before the `all_to_allv` field (its
//! `struct_size` ends before it) keeps working over send/recv and epcomm never reads the bytes
//! past its struct; with the field, epcomm calls it for the data of all_gatherv. One rank
//! (world 1), so the callbacks are the whole transport.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

use epcomm::ffi::group::{
    epcomm_group, epcomm_group_all_gatherv, epcomm_group_create_host, epcomm_group_destroy,
    epcomm_host_callbacks,
};
use epcomm::ffi::tensor::{epcomm_device, epcomm_tensor};
use epcomm::ffi::*;

unsafe extern "C" fn cb_send(_: *mut c_void, _: i32, _: *const c_void, _: usize) -> i32 {
    1 // one rank: nothing is ever sent
}

unsafe extern "C" fn cb_recv(_: *mut c_void, _: i32, _: *mut c_void, _: usize) -> i32 {
    1
}

/// Counts its calls in the AtomicUsize that user_data points to.
unsafe extern "C" fn cb_all_to_allv(
    user: *mut c_void,
    send: *const c_void,
    send_bytes: *const usize,
    recv: *mut c_void,
    recv_bytes: *const usize,
) -> i32 {
    // SAFETY: user_data is the test's counter, alive for the group's lifetime.
    unsafe { &*user.cast::<AtomicUsize>() }.fetch_add(1, Ordering::SeqCst);
    // SAFETY: world 1: one count each, buffers of those sizes (epcomm's contract).
    unsafe {
        if *send_bytes != *recv_bytes {
            return 1;
        }
        std::ptr::copy_nonoverlapping(send.cast::<u8>(), recv.cast::<u8>(), *send_bytes);
    }
    0
}

/// A callbacks struct followed by bytes epcomm must not read as callbacks when `struct_size`
/// ends before them (a garbage "all_to_allv" would crash when called).
#[repr(C)]
struct Padded {
    cb: epcomm_host_callbacks,
}

fn tensor(data: *mut u8, shape: &mut [i64]) -> epcomm_tensor {
    epcomm_tensor {
        data: data.cast(),
        device: epcomm_device {
            device_type: EPCOMM_DEVICE_CPU,
            device_id: 0,
        },
        ndim: shape.len() as i32,
        dtype: epcomm_dtype {
            code: 1, // uint
            bits: 8,
            lanes: 1,
        },
        shape: shape.as_mut_ptr(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// all_gatherv of 300 bytes (more than an op header carries) on a one-rank host group made
/// from `cb` with `struct_size`; the status and the output.
fn gather(cb: epcomm_host_callbacks) -> (i32, Vec<u8>) {
    let padded = Padded { cb };
    let mut g: *mut epcomm_group = std::ptr::null_mut();
    // SAFETY: valid pointers; the struct holds struct_size bytes.
    let st = unsafe {
        epcomm_group_create_host(&padded.cb, c"abi".as_ptr(), 0, 1, std::ptr::null(), &mut g)
    };
    assert_eq!(st, 0, "create");
    let mut input: Vec<u8> = (0..300).map(|i| i as u8).collect();
    let mut output = vec![0u8; 300];
    let (mut s_in, mut s_out) = ([300i64], [300i64]);
    let tin = tensor(input.as_mut_ptr(), &mut s_in);
    let tout = tensor(output.as_mut_ptr(), &mut s_out);
    let sizes = [300i64];
    // SAFETY: a live group, tensors over live buffers.
    let st = unsafe { epcomm_group_all_gatherv(g, &tin, sizes.as_ptr(), &tout) };
    // SAFETY: the group is destroyed once.
    unsafe { epcomm_group_destroy(g) };
    (st, output)
}

fn callbacks(calls: &AtomicUsize) -> epcomm_host_callbacks {
    epcomm_host_callbacks {
        struct_size: std::mem::size_of::<epcomm_host_callbacks>() as u32,
        user_data: std::ptr::from_ref(calls).cast_mut().cast(),
        send: Some(cb_send),
        recv: Some(cb_recv),
        all_gather: None,
        barrier: None,
        lost_ranks: None,
        shrink: None,
        all_to_allv: Some(cb_all_to_allv),
    }
}

#[test]
fn a_host_without_the_all_to_allv_field_never_has_it_read() {
    let calls = AtomicUsize::new(0);
    let mut cb = callbacks(&calls);
    cb.struct_size = std::mem::offset_of!(epcomm_host_callbacks, all_to_allv) as u32;
    // The bytes past struct_size: a pointer that must never be called.
    // SAFETY: any non-null value is a valid bit pattern for the Option<fn> field's storage;
    // it is never called when epcomm honours struct_size.
    cb.all_to_allv = unsafe {
        std::mem::transmute::<
            usize,
            Option<
                unsafe extern "C" fn(
                    *mut c_void,
                    *const c_void,
                    *const usize,
                    *mut c_void,
                    *const usize,
                ) -> i32,
            >,
        >(8)
    };
    let (st, out) = gather(cb);
    assert_eq!(st, 0);
    assert_eq!(out, (0..300).map(|i| i as u8).collect::<Vec<u8>>());
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[test]
fn a_host_with_all_to_allv_gets_the_data_through_it() {
    let calls = AtomicUsize::new(0);
    let (st, out) = gather(callbacks(&calls));
    assert_eq!(st, 0);
    assert_eq!(out, (0..300).map(|i| i as u8).collect::<Vec<u8>>());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
