//! Native-endian words in byte buffers: shared-memory segment words, tensors passed as bytes,
//! host-callback payloads. The one home of the decoding idiom, so no caller writes
//! `from_ne_bytes(c.try_into().unwrap())` again.

use std::mem::size_of;

pub use bytemuck::Pod;

/// The whole words of `bytes` in order (native endian); a trailing partial word is ignored.
pub fn words<T: Pod>(bytes: &[u8]) -> impl ExactSizeIterator<Item = T> + '_ {
    bytes
        .chunks_exact(size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
}

/// [`words`] collected.
pub fn to_vec<T: Pod>(bytes: &[u8]) -> Vec<T> {
    words(bytes).collect()
}

/// The word at byte offset `at`, or `None` when it does not fit in `bytes`.
pub fn word_at<T: Pod>(bytes: &[u8], at: usize) -> Option<T> {
    let end = at.checked_add(size_of::<T>())?;
    bytes.get(at..end).map(bytemuck::pod_read_unaligned)
}

/// `values` as native-endian bytes.
pub fn as_bytes<T: Pod>(values: &[T]) -> &[u8] {
    bytemuck::cast_slice(values)
}

/// FNV-1a over the little-endian bytes of `words`: the digest ranks compare to agree on a list
/// (the same on every machine and every run).
pub fn fnv1a(words: impl IntoIterator<Item = u64>) -> u64 {
    words
        .into_iter()
        .flat_map(u64::to_le_bytes)
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_and_bounds() {
        let v = [1u64, u64::MAX, 7];
        let b = as_bytes(&v);
        assert_eq!(to_vec::<u64>(b), v);
        assert_eq!(words::<u32>(&b[..7]).len(), 1);
        assert_eq!(word_at::<u64>(b, 8), Some(u64::MAX));
        assert_eq!(word_at::<u64>(b, 17), None);
        assert_eq!(word_at::<u64>(b, usize::MAX), None);
        assert_eq!(fnv1a([]), 0xcbf2_9ce4_8422_2325);
        assert_ne!(fnv1a([1, 2]), fnv1a([2, 1]));
        let f = [1.5f32, -2.0];
        assert_eq!(to_vec::<f32>(as_bytes(&f)), f);
    }
}
