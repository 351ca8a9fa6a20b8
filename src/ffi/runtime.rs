//! What this process can use: NCCL, NIXL, CUDA.

use super::guard;
use crate::error::Error;
use crate::probe;

/// Writes the runtime NCCL version code (e.g. 22809 for 2.28.9). Returns EPCOMM_ERROR_UNAVAILABLE
/// when this build has no `nccl` feature or no NCCL library can be loaded (an already-loaded
/// libnccl.so.2 is reused; else VLLM_NCCL_SO_PATH, libnccl.so.2, libnccl.so are tried).
///
/// # Safety
/// `version_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_nccl_version(version_out: *mut i32) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(version_out, "version_out") }?;
        if !cfg!(feature = "nccl") {
            return Err(Error::Unavailable(
                "NCCL is unavailable: epcomm was built without the 'nccl' feature".into(),
            ));
        }
        *out = probe::nccl_version()
            .map_err(|e| Error::Unavailable(format!("NCCL is unavailable: {e}")))?;
        Ok(())
    })
}

/// Returns EPCOMM_OK when the CUDA driver can be used by this build, else
/// EPCOMM_ERROR_UNAVAILABLE with the reason (no `cuda` feature, or no libcuda.so.1).
#[no_mangle]
pub extern "C" fn epcomm_cuda_check() -> i32 {
    guard::call(|| {
        probe::cuda()
            .map(|_| ())
            .map_err(|e| Error::Unavailable(format!("CUDA is unavailable: {e}")))
    })
}

/// Whether NIXL (libnixl.so) can be loaded in this process.
#[no_mangle]
pub extern "C" fn epcomm_nixl_available() -> bool {
    guard::call_or(false, probe::nixl_usable)
}
