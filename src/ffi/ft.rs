//! Fault tolerance of an all2all manager (`epcomm_moe_config.enable_fault_tolerance`): the
//! rank mask and the recovery point, with vLLM's `All2AllManagerBase` semantics
//! (`query_active_mask`, `query_fault`, `clean_buffers`).

use super::all2all::epcomm_all2all;
use super::guard;
use super::handle::Exclusive;
use crate::error::Error;

/// vLLM's `query_active_mask`: one int32 per rank into `mask_out` (`len` = the world size):
/// 0 = live, 1 = masked (dead or unreachable, excluded by every survivor). All 0 without fault
/// tolerance or before any failure. Not collective.
///
/// # Safety
/// `a2a` is NULL or a live handle; `mask_out` is NULL or writable for `len` int32s.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_query_active_mask(
    a2a: *const epcomm_all2all,
    mask_out: *mut i32,
    len: usize,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let mask = unsafe { epcomm_all2all::with(a2a, |_, st| Ok(st.mgr.active_mask())) }?;
        if len != mask.len() {
            return Err(Error::InvalidArgument(format!(
                "mask_out has {len} entries; expected one per rank of the group ({})",
                mask.len()
            )));
        }
        if mask_out.is_null() {
            return Err(Error::NullPointer("mask_out"));
        }
        // SAFETY: non-NULL and writable for len == mask.len() entries (caller contract).
        unsafe { std::slice::from_raw_parts_mut(mask_out, len) }.copy_from_slice(&mask);
        Ok(())
    })
}

/// vLLM's `query_fault`: whether the mask changed since the last
/// epcomm_all2all_clean_buffers (or since creation). Not collective.
///
/// # Safety
/// `a2a` is NULL or a live handle; `fault_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_query_fault(
    a2a: *const epcomm_all2all,
    fault_out: *mut bool,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(fault_out, "fault_out") }?;
        // SAFETY: caller contract.
        *out = unsafe { epcomm_all2all::with(a2a, |_, st| Ok(st.mgr.query_fault())) }?;
        Ok(())
    })
}

/// vLLM's `clean_buffers`, the recovery point (rank-local, not collective): zeroes the
/// receive buffers, forgets the last dispatch (combine needs a new one; earlier output views
/// are invalid), and makes the current mask the baseline of epcomm_all2all_query_fault.
/// Masked ranks stay masked: a rank rejoins only through a new group.
///
/// # Safety
/// `a2a` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_clean_buffers(a2a: *const epcomm_all2all) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        unsafe {
            epcomm_all2all::with(a2a, |_, st| {
                st.mgr.clean_buffers();
                Ok(())
            })
        }
    })
}

/// vLLM v0.34.0's `update_mask(rank, masked)` (rank-local, not collective), which vLLM's
/// sentinel calls after epcomm_all2all_clean_buffers to replay the dead ranks of a scale-down:
/// sets the rank's entry of the mask and of epcomm_all2all_query_fault's baseline. epcomm's
/// clean_buffers keeps the mask, so replaying a masked rank is a no-op; masking a live rank
/// (epcomm masks the ranks the group loses) or unmasking a masked one (rejoining means a new
/// group) is EPCOMM_ERROR_INVALID_STATE saying so; a rank outside the group
/// EPCOMM_ERROR_INVALID_ARGUMENT; without fault tolerance EPCOMM_ERROR_NOT_IMPLEMENTED (vLLM's
/// base class).
///
/// # Safety
/// `a2a` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_update_mask(
    a2a: *const epcomm_all2all,
    rank: i32,
    masked: bool,
) -> i32 {
    guard::call(|| {
        let r = usize::try_from(rank).map_err(|_| {
            Error::InvalidArgument(format!("update_mask: rank {rank} is out of range"))
        })?;
        // SAFETY: caller contract.
        unsafe { epcomm_all2all::with(a2a, |_, st| st.mgr.update_mask(r, masked)) }
    })
}

/// This rank's (token, expert) pairs dropped because the expert's rank is masked: by the last
/// dispatch (`last_out`) and since creation (`total_out`); either may be NULL.
///
/// # Safety
/// `a2a` is NULL or a live handle; the outputs are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_dropped_pairs(
    a2a: *const epcomm_all2all,
    last_out: *mut u64,
    total_out: *mut u64,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let (last, total) = unsafe {
            epcomm_all2all::with(a2a, |_, st| {
                let s = st.mgr.stats();
                Ok((s.dropped_pairs, s.dropped_pairs_total))
            })
        }?;
        // SAFETY: NULL or writable (caller contract).
        if let Some(o) = unsafe { last_out.as_mut() } {
            *o = last;
        }
        // SAFETY: as above.
        if let Some(o) = unsafe { total_out.as_mut() } {
            *o = total;
        }
        Ok(())
    })
}
