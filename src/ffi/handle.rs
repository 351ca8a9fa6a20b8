//! The one handle layer: how every opaque C handle is made, borrowed and released.
//!
//! As rustls-ffi's castable pointers: the pointer's Rust type says what it points to and how it
//! was allocated (here always `Box`, so `destroy` is `Box::from_raw` once), and the NULL check
//! names the C argument. A handle with mutable state ([`Exclusive`]) serves one thread at a
//! time: a call while another thread's call is in flight is `EPCOMM_ERROR_INVALID_STATE`, never
//! a wait (a collective waiting behind another thread's collective could deadlock).

use std::sync::{Mutex, MutexGuard, TryLockError};

use crate::error::{Error, Result};

/// A Rust value handed to C as an opaque pointer made by [`Handle::into_raw`].
pub(crate) trait Handle: Sized {
    /// The C argument a NULL handle is reported as ("a2a", "group", ...).
    const ARG: &'static str;

    /// Boxes the value; C owns the pointer until the handle's destroy call.
    fn into_raw(self) -> *mut Self {
        Box::into_raw(Box::new(self))
    }

    /// The handle behind `p`; NULL is `EPCOMM_ERROR_NULL_POINTER` naming [`Handle::ARG`].
    ///
    /// # Safety
    /// `p` is NULL or from [`Handle::into_raw`] and not destroyed during `'a`.
    unsafe fn from_ptr<'a>(p: *const Self) -> Result<&'a Self> {
        // SAFETY: NULL or a live boxed handle (caller contract).
        unsafe { p.as_ref() }.ok_or(Error::NullPointer(Self::ARG))
    }

    /// Releases the handle; NULL is a no-op.
    ///
    /// # Safety
    /// `p` is NULL or from [`Handle::into_raw`], not used after this call.
    unsafe fn destroy(p: *mut Self) {
        if !p.is_null() {
            // SAFETY: from Box::into_raw, destroyed once (caller contract).
            drop(unsafe { Box::from_raw(p) });
        }
    }
}

/// A handle whose state one thread at a time may use.
pub(crate) trait Exclusive: Handle {
    /// What a call borrows mutably.
    type State;
    /// The `EPCOMM_ERROR_INVALID_STATE` message for concurrent use.
    const BUSY: &'static str;

    /// The lock around the state.
    fn state(&self) -> &Mutex<Self::State>;

    /// The state for one call, or the concurrent-use error.
    fn lock(&self) -> Result<MutexGuard<'_, Self::State>> {
        self.state()
            .try_lock()
            .or_else(recover_poisoned)
            .map_err(|_| Error::InvalidState(Self::BUSY.into()))
    }

    /// Runs `f` with the handle behind `p` and its state.
    ///
    /// # Safety
    /// As [`Handle::from_ptr`].
    unsafe fn with<T>(
        p: *const Self,
        f: impl FnOnce(&Self, &mut Self::State) -> Result<T>,
    ) -> Result<T> {
        // SAFETY: caller contract.
        let h = unsafe { Self::from_ptr(p) }?;
        let mut state = h.lock()?;
        f(h, &mut state)
    }
}

/// Implements [`Handle`] and [`Exclusive`] for a handle struct whose state is the `Mutex` in
/// its field `inner`: `$arg` is the C argument a NULL handle is reported as, `$busy` the
/// concurrent-use message.
macro_rules! exclusive_handle {
    ($ty:ident, $arg:literal, $state:ty, $busy:expr) => {
        impl $crate::ffi::handle::Handle for $ty {
            const ARG: &'static str = $arg;
        }

        impl $crate::ffi::handle::Exclusive for $ty {
            type State = $state;
            const BUSY: &'static str = $busy;
            fn state(&self) -> &std::sync::Mutex<$state> {
                &self.inner
            }
        }
    };
}
pub(crate) use exclusive_handle;

/// `Mutex::try_lock` treats a lock poisoned by a caught panic as an error; the handle's state is
/// still consistent (every operation records its failures), so take the guard back.
fn recover_poisoned<T>(
    e: TryLockError<MutexGuard<'_, T>>,
) -> std::result::Result<MutexGuard<'_, T>, TryLockError<MutexGuard<'_, T>>> {
    match e {
        TryLockError::Poisoned(p) => Ok(p.into_inner()),
        other => Err(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Counter {
        inner: Mutex<u32>,
    }
    exclusive_handle!(Counter, "counter", u32, "the counter is in use");

    #[test]
    fn null_busy_poisoned_and_destroy() {
        // SAFETY: NULL and a live handle from into_raw, destroyed once at the end.
        unsafe {
            let e = Counter::with(std::ptr::null(), |_, _| Ok(())).unwrap_err();
            assert!(matches!(e, Error::NullPointer("counter")));
            let p = Counter {
                inner: Mutex::new(0),
            }
            .into_raw();
            let e = Counter::with(p, |h, _| h.lock().map(|_| ())).unwrap_err();
            assert_eq!(e.to_string(), "the counter is in use");
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                Counter::with(p, |_, _| -> Result<()> { panic!("poison") })
            }));
            assert!(r.is_err());
            Counter::with(p, |_, n| {
                *n += 1;
                Ok(())
            })
            .unwrap();
            assert_eq!(Counter::with(p, |_, n| Ok(*n)).unwrap(), 1);
            Counter::destroy(p);
            Counter::destroy(std::ptr::null_mut());
        }
    }
}
