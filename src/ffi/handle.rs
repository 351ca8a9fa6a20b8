//! The one handle layer: how every opaque C handle is made, borrowed and released.
//!
//! As rustls-ffi's castable pointers: the pointer's Rust type says what it points to and how it
//! was allocated (here always `Box`), and the NULL check names the C argument. A handle with
//! mutable state ([`Exclusive`]) serves one thread at a time: a call while another thread's
//! call is in flight is `EPCOMM_ERROR_INVALID_STATE`, never a wait (a collective waiting behind
//! another thread's collective could deadlock).
//!
//! Every live handle is in one registry (address → type, creating pid, calls in flight,
//! dependents), consulted before a pointer is dereferenced. So a destroy while a call is in
//! flight is refused and frees nothing (the call completes normally); a call on a destroyed
//! handle, or on a pointer of another handle type, is `EPCOMM_ERROR_INVALID_STATE` instead of a
//! use of freed memory (unless the address was reused by a new handle of the same type, which
//! no registry of addresses can tell); and a forked child's calls on its parent's handles are
//! refused before they touch anything shared. A handle made over another ([`Dep`]: a manager
//! over its group) keeps it alive: destroying the group then retires its C handle at once and
//! frees it with its last dependent.

use std::any::TypeId;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::{Mutex, MutexGuard, OnceLock, TryLockError};

use crate::error::{Error, Result};

/// One live handle.
struct Entry {
    ty: TypeId,
    /// The process that made it (a forked child has another pid).
    pid: u32,
    /// Calls using it now (its own, and those of handles made over it).
    in_flight: u32,
    /// Handles made over it ([`Dep`]) that are alive.
    dependents: u32,
    /// Destroyed by the caller while dependents remain: C calls on it are refused; it is freed
    /// with its last dependent.
    retired: bool,
}

/// Handle addresses hashed by one multiplication (the default SipHash costs more than the rest
/// of a borrow; addresses are not attacker-chosen keys).
#[derive(Default)]
struct AddrHasher(u64);

impl std::hash::Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type Registry = HashMap<usize, Entry, std::hash::BuildHasherDefault<AddrHasher>>;

/// This process's pid (a forked child's own), without a system call.
fn pid() -> u32 {
    crate::group::shm::current_pid()
}

fn registry() -> MutexGuard<'static, Registry> {
    static LIVE: OnceLock<Mutex<Registry>> = OnceLock::new();
    let live = LIVE.get_or_init(|| {
        // SAFETY: the handlers only lock and unlock this registry, on the forking thread.
        unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_done), Some(fork_done)) };
        Default::default()
    });
    // Entries are updated under the lock in single steps: a poisoned lock is still consistent.
    live.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// The registry, held by the forking thread across fork().
    static HELD_FOR_FORK: std::cell::RefCell<Option<MutexGuard<'static, Registry>>> =
        const { std::cell::RefCell::new(None) };
}

/// Before fork(): takes the registry, so no other thread holds it at the fork; a child would
/// otherwise inherit it locked forever (its first epcomm call, even creating a new group, would
/// hang).
extern "C" fn fork_prepare() {
    let live = registry();
    HELD_FOR_FORK.with(|h| *h.borrow_mut() = Some(live));
}

/// After fork(), in the parent and in the child: releases the registry again.
extern "C" fn fork_done() {
    HELD_FOR_FORK.with(|h| drop(h.borrow_mut().take()));
}

/// The C type name of a handle type (`epcomm_group`), for messages.
fn kind<H: Handle>() -> &'static str {
    let full = std::any::type_name::<H>();
    full.rsplit("::").next().unwrap_or(full)
}

/// The error of a forked child using a handle its parent made; `what` names the handle. The
/// same words as the shared-memory group's own check.
fn forked(what: &str, parent: u32) -> Error {
    crate::group::shm::fork_error(what, parent, pid())
}

/// How a borrow treats a retired handle.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    /// A C argument: a retired handle is gone for the caller.
    Caller,
    /// A dependent's own reference: the handle lives until the dependent goes.
    Dependent,
}

/// A handle borrowed for one call: counted in flight until dropped, so it is not freed under it.
pub(crate) struct Ref<'a, H: Handle> {
    h: &'a H,
}

impl<H: Handle> Deref for Ref<'_, H> {
    type Target = H;
    fn deref(&self) -> &H {
        self.h
    }
}

impl<H: Handle> Drop for Ref<'_, H> {
    fn drop(&mut self) {
        if let Some(e) = registry().get_mut(&(self.h as *const H as usize)) {
            e.in_flight = e.in_flight.saturating_sub(1);
        }
    }
}

/// A Rust value handed to C as an opaque pointer made by [`Handle::into_raw`].
pub(crate) trait Handle: Sized + 'static {
    /// The C argument a NULL handle is reported as ("a2a", "group", ...).
    const ARG: &'static str;

    /// What messages call this handle ("group 'G'", "the epcomm_all2all handle").
    fn label(&self) -> String {
        format!("the {} handle", kind::<Self>())
    }

    /// Boxes the value and registers it; C owns the pointer until the handle's destroy call.
    fn into_raw(self) -> *mut Self {
        let p = Box::into_raw(Box::new(self));
        let entry = Entry {
            ty: TypeId::of::<Self>(),
            pid: pid(),
            in_flight: 0,
            dependents: 0,
            retired: false,
        };
        registry().insert(p as usize, entry);
        p
    }

    /// The handle behind `p` for one call; NULL is `EPCOMM_ERROR_NULL_POINTER` naming
    /// [`Handle::ARG`]; a pointer that is not a live handle of this type, and a handle of the
    /// parent process in a forked child, are `EPCOMM_ERROR_INVALID_STATE`.
    ///
    /// # Safety
    /// `p` is NULL or any address (only a registered one is dereferenced).
    unsafe fn borrow<'a>(p: *const Self) -> Result<Ref<'a, Self>> {
        // SAFETY: caller contract.
        unsafe { borrow_as(p, Access::Caller) }
    }

    /// Releases the handle. NULL is `EPCOMM_ERROR_NULL_POINTER` naming [`Handle::ARG`] (the
    /// void destroy calls skip it). Refused, freeing nothing
    /// (`EPCOMM_ERROR_INVALID_STATE`): a call using it in flight, a pointer that is not a live
    /// handle of this type (destroyed already), a handle of the parent process in a forked
    /// child. A handle others were made over is retired (gone for C calls) and freed with the
    /// last of them.
    ///
    /// # Safety
    /// `p` is NULL or any address (only a registered one is freed).
    unsafe fn destroy(p: *mut Self) -> Result<()> {
        if p.is_null() {
            return Err(Error::NullPointer(Self::ARG));
        }
        let mut live = registry();
        let e = live_entry::<Self>(&mut live, p, Access::Caller)?;
        if e.pid != pid() || e.in_flight > 0 {
            let (creator, busy) = (e.pid, e.in_flight > 0);
            // SAFETY: registered, so live; no free can happen while the registry is held.
            let label = unsafe { &*p }.label();
            // A forked child first: the calls its copy counts in flight are its parent's.
            return Err(if creator != pid() {
                forked(&label, creator)
            } else {
                debug_assert!(busy);
                Error::InvalidState(format!(
                    "cannot destroy {label}: a call using it is in flight on another thread; nothing was freed: destroy it after that call returns"
                ))
            });
        }
        if e.dependents > 0 {
            e.retired = true;
            return Ok(());
        }
        live.remove(&(p as usize));
        drop(live);
        // SAFETY: from Box::into_raw and now unregistered: no call holds it, none can start.
        drop(unsafe { Box::from_raw(p) });
        Ok(())
    }
}

/// The entry of the live handle `p` of type `H`, or the error naming what `p` is not.
fn live_entry<H: Handle>(live: &mut Registry, p: *const H, access: Access) -> Result<&mut Entry> {
    match live.get_mut(&(p as usize)) {
        Some(e) if e.ty == TypeId::of::<H>() && !(e.retired && access == Access::Caller) => Ok(e),
        _ => Err(Error::InvalidState(format!(
            "{} ({p:p}) is not a live {} handle: it was destroyed already, or was not made by epcomm",
            H::ARG,
            kind::<H>()
        ))),
    }
}

/// [`Handle::borrow`] with `access`.
///
/// # Safety
/// As [`Handle::borrow`].
unsafe fn borrow_as<'a, H: Handle>(p: *const H, access: Access) -> Result<Ref<'a, H>> {
    if p.is_null() {
        return Err(Error::NullPointer(H::ARG));
    }
    let mut live = registry();
    let e = live_entry::<H>(&mut live, p, access)?;
    // SAFETY: registered, so live until unregistered, which waits for in_flight to drop to 0.
    let h = unsafe { &*p };
    if e.pid != pid() {
        // Labelled under the lock: nothing frees the handle meanwhile.
        return Err(forked(&h.label(), e.pid));
    }
    e.in_flight += 1;
    Ok(Ref { h })
}

/// A handle's reference to the handle it was made over (a manager's group): that handle stays
/// alive (not freed, though its C handle may be retired) while this lives.
pub(crate) struct Dep<H: Handle> {
    p: *const H,
    _h: PhantomData<H>,
}

// SAFETY: only an address; every use goes through the registry.
unsafe impl<H: Handle> Send for Dep<H> {}
// SAFETY: as above.
unsafe impl<H: Handle> Sync for Dep<H> {}

impl<H: Handle> Dep<H> {
    /// A reference to the live handle `p` (a C argument: errors as [`Handle::borrow`]).
    ///
    /// # Safety
    /// As [`Handle::borrow`].
    pub(crate) unsafe fn new(p: *const H) -> Result<Self> {
        // SAFETY: caller contract.
        let r = unsafe { H::borrow(p) }?;
        if let Some(e) = registry().get_mut(&(p as usize)) {
            e.dependents += 1;
        }
        drop(r);
        Ok(Dep { p, _h: PhantomData })
    }

    /// The handle for one call of the dependent (alive even when retired).
    pub(crate) fn borrow(&self) -> Result<Ref<'_, H>> {
        // SAFETY: registered while this lives (it counts as a dependent).
        unsafe { borrow_as(self.p, Access::Dependent) }
    }

    /// The address.
    #[cfg(test)]
    fn ptr(&self) -> *const H {
        self.p
    }
}

impl<H: Exclusive> Dep<H> {
    /// Runs `f` with the handle and its state, as [`Exclusive::with`].
    pub(crate) fn with<T>(&self, f: impl FnOnce(&H, &mut H::State) -> Result<T>) -> Result<T> {
        let h = self.borrow()?;
        let mut state = h.lock()?;
        f(&h, &mut state)
    }
}

impl<H: Handle> Drop for Dep<H> {
    fn drop(&mut self) {
        let mut live = registry();
        let key = self.p as usize;
        let free = match live.get_mut(&key) {
            Some(e) => {
                e.dependents -= 1;
                e.dependents == 0 && e.retired
            }
            None => false,
        };
        if free {
            live.remove(&key);
            drop(live);
            // SAFETY: from Box::into_raw, retired by its destroy and now unregistered; a
            // retired handle's only users were its dependents, and this was the last.
            drop(unsafe { Box::from_raw(self.p.cast_mut()) });
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
    /// As [`Handle::borrow`].
    unsafe fn with<T>(
        p: *const Self,
        f: impl FnOnce(&Self, &mut Self::State) -> Result<T>,
    ) -> Result<T> {
        // SAFETY: caller contract.
        let h = unsafe { Self::borrow(p) }?;
        let mut state = h.lock()?;
        f(&h, &mut state)
    }
}

/// Implements [`Handle`] and [`Exclusive`] for a handle struct whose state is the `Mutex` in
/// its field `inner`: `$arg` is the C argument a NULL handle is reported as, `$busy` the
/// concurrent-use message, `$label` (optional) how messages name a handle.
macro_rules! exclusive_handle {
    ($ty:ident, $arg:literal, $state:ty, $busy:expr $(, label = $label:expr)?) => {
        impl $crate::ffi::handle::Handle for $ty {
            const ARG: &'static str = $arg;
            $(
                fn label(&self) -> String {
                    ($label)(self)
                }
            )?
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

    struct Over {
        inner: Mutex<Dep<Counter>>,
    }
    exclusive_handle!(Over, "over", Dep<Counter>, "over is in use");

    fn counter() -> *mut Counter {
        Counter {
            inner: Mutex::new(0),
        }
        .into_raw()
    }

    #[test]
    fn null_busy_poisoned_and_destroy() {
        // SAFETY: NULL and a live handle from into_raw, destroyed once at the end.
        unsafe {
            let e = Counter::with(std::ptr::null(), |_, _| Ok(())).unwrap_err();
            assert!(matches!(e, Error::NullPointer("counter")));
            let p = counter();
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
            Counter::destroy(p).unwrap();
            let e = Counter::destroy(std::ptr::null_mut()).unwrap_err();
            assert!(matches!(e, Error::NullPointer("counter")));
        }
    }

    #[test]
    fn destroy_in_flight_refused_then_stale_pointer_refused() {
        // SAFETY: a handle from into_raw; after its destroy only the registry sees the address.
        unsafe {
            let p = counter();
            let busy = Counter::with(p, |_, _| Ok(Counter::destroy(p).unwrap_err())).unwrap();
            assert_eq!(
                busy.to_string(),
                "cannot destroy the Counter handle: a call using it is in flight on another thread; nothing was freed: destroy it after that call returns"
            );
            Counter::destroy(p).unwrap();
            let gone = format!(
                "counter ({p:p}) is not a live Counter handle: it was destroyed already, or was not made by epcomm"
            );
            assert_eq!(
                Counter::with(p, |_, _| Ok(())).unwrap_err().to_string(),
                gone
            );
            assert_eq!(Counter::destroy(p).unwrap_err().to_string(), gone);
            // Another type's pointer is not a counter.
            let o = Over {
                inner: Mutex::new(Dep::new(counter()).unwrap()),
            }
            .into_raw();
            let e = Counter::with(o.cast(), |_, _| Ok(())).unwrap_err();
            assert!(e.to_string().starts_with("counter ("), "{e}");
            let c = Over::with(o, |_, d| Ok(d.ptr())).unwrap();
            Counter::destroy(c.cast_mut()).unwrap();
            Over::destroy(o).unwrap();
        }
    }

    #[test]
    fn a_dependent_keeps_its_handle_alive() {
        // SAFETY: handles from into_raw, each destroyed once.
        unsafe {
            let c = counter();
            let o = Over {
                inner: Mutex::new(Dep::new(c).unwrap()),
            }
            .into_raw();
            // The dependent's call borrows the counter: its destroy is refused meanwhile.
            let e = Over::with(o, |_, d| {
                d.with(|_, _| Ok(Counter::destroy(c).unwrap_err()))
            });
            assert!(e
                .unwrap()
                .to_string()
                .starts_with("cannot destroy the Counter handle"));
            // Retired: gone for C calls, alive for the dependent.
            Counter::destroy(c).unwrap();
            assert!(Counter::with(c, |_, _| Ok(())).is_err());
            let n = Over::with(o, |_, d| {
                d.with(|_, n| {
                    *n += 5;
                    Ok(*n)
                })
            });
            assert_eq!(n.unwrap(), 5);
            Over::destroy(o).unwrap();
            assert!(!registry().contains_key(&(c as usize)));
        }
    }
}
