//! Byte copies for large, write-once destinations.
//!
//! glibc's `memcpy` switches to non-temporal stores only above about three quarters of the L3
//! size per copy; moving many medium rows (expert weights of a few MiB, token rows) one by one
//! therefore pays a read-for-ownership of every destination line. `copy_streaming` writes
//! with non-temporal stores regardless of the single copy's size; callers use it when the total
//! they move is far larger than the caches.
//!
//! Non-temporal stores are weakly ordered: after the last one of a batch, and before the data
//! is handed to another thread or process, call [`streaming_fence`] (one fence per batch, not
//! per row: each fence waits for the write-combining buffers to drain).

/// Transfers at least this large (in total, per call of the caller) are far past the caches:
/// their destinations are written with streaming stores. Smaller ones stay cached for the
/// reader that usually follows.
pub const STREAMING_MIN_BYTES: usize = 16 << 20;

/// Copies `src` into `dst` (same length) with non-temporal stores where the CPU has AVX2;
/// a plain copy elsewhere or for short slices. Call [`streaming_fence`] after the batch.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= 4096 && crate::num::simd_available() {
        // SAFETY: AVX2 is available (checked at run time); the lengths are equal.
        unsafe { x86::copy(dst, src) };
        return;
    }
    dst.copy_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy(dst: &mut [u8], src: &[u8]) {
        let n = dst.len();
        // Plain copy up to the first 32-byte aligned destination address.
        let head = ((32 - dst.as_ptr() as usize % 32) % 32).min(n);
        dst[..head].copy_from_slice(&src[..head]);
        let body = head + (n - head) / 128 * 128;
        let mut i = head;
        while i < body {
            // SAFETY: i + 128 <= n on both slices; dst + i is 32-byte aligned.
            unsafe {
                let s = src.as_ptr().add(i) as *const __m256i;
                let d = dst.as_mut_ptr().add(i) as *mut __m256i;
                let a = _mm256_loadu_si256(s);
                let b = _mm256_loadu_si256(s.add(1));
                let c = _mm256_loadu_si256(s.add(2));
                let e = _mm256_loadu_si256(s.add(3));
                _mm256_stream_si256(d, a);
                _mm256_stream_si256(d.add(1), b);
                _mm256_stream_si256(d.add(2), c);
                _mm256_stream_si256(d.add(3), e);
            }
            i += 128;
        }
        dst[body..].copy_from_slice(&src[body..]);
    }
}

/// The fence lives with the streaming stores in `num` (the lower layer); re-exported here for
/// the copies' callers.
pub use crate::num::streaming_fence;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_length_and_alignment() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0usize, 1, 31, 4095, 4096, 4097, 8191, 10_000, 19_000] {
            for shift in [0usize, 1, 13, 31] {
                let mut dst = vec![0u8; len + shift + 5];
                copy_streaming(&mut dst[shift..shift + len], &src[7..7 + len]);
                assert_eq!(&dst[shift..shift + len], &src[7..7 + len], "{len} {shift}");
                assert!(dst[..shift].iter().all(|&b| b == 0));
                assert!(dst[shift + len..].iter().all(|&b| b == 0));
            }
        }
    }
}
