//! The array arguments the EPLB entry points share: positive dimensions, bounded sizes, the
//! NULL checks of several pointers at once, and `rows × cols` arrays read and written.

use super::guard;
use crate::error::{Error, Result};

/// A positive dimension argument.
pub(super) fn dim(v: i64, what: &str) -> Result<usize> {
    usize::try_from(v)
        .ok()
        .filter(|&x| x > 0)
        .ok_or_else(|| Error::InvalidArgument(format!("{what} is {v}; expected a positive value")))
}

/// An index argument (a rank, a layer): INVALID_ARGUMENT `{what} is {v}; expected >= 0` when
/// negative.
pub(super) fn index(v: i64, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} is {v}; expected >= 0")))
}

/// [`dim`] of each argument in turn, named by its own name: `dims!(num_layers, num_physical)`
/// is `[dim(num_layers, "num_layers")?, dim(num_physical, "num_physical")?]`.
macro_rules! dims {
    ($($arg:ident),+ $(,)?) => {
        [$($crate::ffi::eplb_args::dim($arg, stringify!($arg))?),+]
    };
}
pub(super) use dims;

/// The most entries of a policy array: the policy copies its inputs into rows, so a wrong size
/// must not ask for more.
const MAX_POLICY_ENTRIES: usize = 1 << 40;

/// `a × b` entries ([`guard::entries`]), bounded by [`MAX_POLICY_ENTRIES`].
pub(super) fn checked_len(a: usize, b: usize, what: &str) -> Result<usize> {
    let n = guard::entries::<i64>(a, b, what)?;
    if n > MAX_POLICY_ENTRIES {
        return Err(Error::InvalidArgument(format!(
            "'{what}' has {n} entries; expected at most {MAX_POLICY_ENTRIES} (2^40)"
        )));
    }
    Ok(n)
}

/// Fails with a NULL-pointer error for the first NULL among `ptrs`.
pub(super) fn non_null(ptrs: &[(bool, &'static str)]) -> Result<()> {
    match ptrs.iter().find(|(null, _)| *null) {
        Some((_, what)) => Err(Error::NullPointer(what)),
        None => Ok(()),
    }
}

/// The `rows × cols` values at `p` as rows.
///
/// # Safety
/// `p` is non-NULL and holds `rows * cols` values.
pub(super) unsafe fn read_rows<T: Copy>(p: *const T, rows: usize, cols: usize) -> Vec<Vec<T>> {
    // SAFETY: the caller's contract.
    let flat = unsafe { std::slice::from_raw_parts(p, rows * cols) };
    flat.chunks(cols.max(1)).map(<[T]>::to_vec).collect()
}

/// Writes `rows` (each `cols` values) to `out` as int64.
///
/// # Safety
/// `out` is non-NULL, has room for `rows.len() * cols` int64 and overlaps no live slice.
pub(super) unsafe fn write_rows<T: Copy>(
    out: *mut i64,
    rows: &[Vec<T>],
    cols: usize,
    to_i64: fn(T) -> i64,
) {
    // SAFETY: the caller's contract.
    let dst = unsafe { std::slice::from_raw_parts_mut(out, rows.len() * cols) };
    for (d, &s) in dst.iter_mut().zip(rows.iter().flatten()) {
        *d = to_i64(s);
    }
}

/// An index as int64, for [`write_rows`].
pub(super) fn id(x: usize) -> i64 {
    x as i64
}
