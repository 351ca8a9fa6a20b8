//! Shared memory for callers (as `ncclMemAlloc`/`ncclMemFree`) and the manager's zero-copy
//! expert-output buffer (as DeepEP's `get_next_combine_buffer`).
//!
//! A shared-memory group in direct mode hands out *windows*: memory every peer maps on first
//! use. Dispatch into a window has the sources store their rows straight into it; combine from
//! a window has the peers load the rows in place. Nothing else changes: a window is ordinary
//! host memory to its owner and any host tensor may lie in it.

use std::ffi::c_void;

use super::all2all::{epcomm_all2all, with_manager};
use super::group::epcomm_group;
use super::guard;
use super::handle::{Exclusive, Handle};
use crate::error::Error;

/// Why a group without windows cannot allocate (host transport, EPCOMM_SHM_DIRECT=0).
fn no_windows(name: &str) -> Error {
    Error::Unavailable(format!(
        "group '{name}' has no shared memory to allocate from: only a shared-memory group with EPCOMM_SHM_DIRECT=1 (the default) maps windows into its peers; use ordinary memory with this group"
    ))
}

/// Allocates `bytes` (> 0) of zeroed shared memory from this rank's group: a window every
/// peer maps on first use, so dispatch into it and combine from it move each byte once with
/// plain stores and loads. Not collective: each rank allocates on its own (peers map a window
/// when an op offers it), and sizes may differ between ranks. The memory is this rank's to use
/// as ordinary host memory (page-aligned, at least `bytes` long) until epcomm_mem_free or
/// epcomm_group_destroy, which frees whatever is left; pass tensors in it to any call. A group
/// without windows (host callbacks, or EPCOMM_SHM_DIRECT=0) returns EPCOMM_ERROR_UNAVAILABLE
/// and no memory: allocate ordinary memory instead.
///
/// # Safety
/// `group` is NULL or a live handle; `ptr_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_mem_alloc(
    group: *mut epcomm_group,
    bytes: usize,
    ptr_out: *mut *mut c_void,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(ptr_out, "ptr_out") }?;
        *out = std::ptr::null_mut();
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "bytes is 0: expected at least 1".into(),
            ));
        }
        // SAFETY: caller contract.
        unsafe {
            epcomm_group::with(group, |h, g| {
                let mut buf = g.alloc_shared(bytes)?.ok_or_else(|| no_windows(g.name()))?;
                *out = buf.as_mut_ptr().cast();
                lock_mem(h).push(buf);
                Ok(())
            })
        }
    })
}

/// The group's allocations (a panic while they were held leaves them usable).
fn lock_mem(h: &epcomm_group) -> std::sync::MutexGuard<'_, Vec<crate::group::SharedBuf>> {
    h.mem.lock().unwrap_or_else(|e| e.into_inner())
}

/// Frees memory from epcomm_mem_alloc on this group (NULL is a no-op); a peer that mapped it
/// releases its mapping when it maps other windows or leaves the group. Errors, freeing
/// nothing: a pointer that is not the start of a live allocation of this group (freed
/// already, from another group, or inside one) is EPCOMM_ERROR_INVALID_ARGUMENT; a call while
/// another thread's call on the group is in flight (which may be using the memory) is
/// EPCOMM_ERROR_INVALID_STATE. Tensors in the memory must not be used afterwards.
///
/// # Safety
/// `group` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn epcomm_mem_free(group: *mut epcomm_group, ptr: *mut c_void) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let h = unsafe { epcomm_group::borrow(group) }?;
        if ptr.is_null() {
            return Ok(());
        }
        // Holding the group's lock: no call on it (which could be reading the memory) runs.
        let g = h.lock()?;
        let mut mem = lock_mem(&h);
        let Some(i) = mem
            .iter()
            .position(|b| b.as_ptr() == ptr.cast_const().cast())
        else {
            return Err(Error::InvalidArgument(format!(
                "ptr {ptr:p} is not memory of group '{}' from epcomm_mem_alloc (freed already, from another group, or not the start of an allocation)",
                g.name()
            )));
        };
        drop(mem.swap_remove(i));
        Ok(())
    })
}

/// The manager's expert-output buffer for its last dispatch: `*rows_out` rows of
/// hidden_size elements of the config's expert_dtype at `*data_out` (compact, row-major; the
/// shape of the dispatch output's `hidden` in that dtype), in shared memory the manager owns.
/// Let the experts write their outputs there and pass it (a tensor [rows, hidden_size] at
/// `*data_out`) to epcomm_all2all_combine: the peers read it in place, no copy (counted by
/// epcomm_all2all_zero_copy_combines). Contents unspecified until written; the memory may be
/// reused by the next call of this function and is freed with the manager; it never aliases
/// the dispatch outputs. Before a dispatch: EPCOMM_ERROR_INVALID_STATE; a group without
/// windows: EPCOMM_ERROR_UNAVAILABLE (use ordinary memory). Not collective.
///
/// # Safety
/// `a2a` is NULL or a live handle; the outputs are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_expert_output_buffer(
    a2a: *mut epcomm_all2all,
    data_out: *mut *mut c_void,
    rows_out: *mut i64,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let (data, rows) = unsafe {
            (
                guard::out_arg(data_out, "data_out")?,
                guard::out_arg(rows_out, "rows_out")?,
            )
        };
        (*data, *rows) = (std::ptr::null_mut(), 0);
        // SAFETY: caller contract.
        unsafe {
            with_manager(a2a, |st, g| {
                let n = st.mgr.combine_rows().unwrap_or(0);
                *data = st.mgr.expert_output_buffer(g)?.as_mut_ptr().cast();
                *rows = n as i64;
                Ok(())
            })
        }
    })
}

/// How many combines of this manager read their expert output in place from its
/// expert-output buffer (each a combine that made no copy of it on this rank).
///
/// # Safety
/// `a2a` is NULL or a live handle; `count_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_zero_copy_combines(
    a2a: *const epcomm_all2all,
    count_out: *mut u64,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(count_out, "count_out") }?;
        // SAFETY: caller contract.
        let n = unsafe { epcomm_all2all::with(a2a, |_, st| Ok(st.mgr.zero_copy_combines())) }?;
        *out = n;
        Ok(())
    })
}
