//! A forked child's copy of a group: its mappings of the control and data segments are the
//! parent's shared memory, so any op or leave from it would act as the parent's rank (its
//! barrier "succeeds", the parent's next op then fails or mismatches at a peer). The child is
//! refused before it touches anything shared, and its drop leaves the parent's slot alone.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;

use super::ShmGroup;
use crate::error::{Error, Result};

/// This process's pid, renewed in a forked child by a fork handler (getpid is a system call,
/// and every op asks).
static PID: AtomicU32 = AtomicU32::new(0);

extern "C" fn renew_pid() {
    PID.store(std::process::id(), Ordering::Relaxed);
}

/// This process's pid (a forked child's own).
pub(crate) fn current_pid() -> u32 {
    static HANDLER: Once = Once::new();
    HANDLER.call_once(|| {
        // The handler first: a fork after it renews the child's copy.
        // SAFETY: the handler only stores the child's pid.
        if unsafe { libc::pthread_atfork(None, None, Some(renew_pid)) } == 0 {
            renew_pid();
        }
    });
    match PID.load(Ordering::Relaxed) {
        // No handler (pthread_atfork failed): ask every time.
        0 => std::process::id(),
        p => p,
    }
}

/// The error of process `child` using `what` ("group 'G'", a handle) made by its parent
/// `parent`; the C handle layer uses the same words.
pub(crate) fn fork_error(what: &str, parent: u32, child: u32) -> Error {
    Error::InvalidState(format!(
        "{what} was created by pid {parent}; this process (pid {child}) is a fork of it and cannot use it: create a new one in the child"
    ))
}

impl ShmGroup {
    /// Whether this process is a fork of the one that joined (its pid differs).
    pub(super) fn forked(&self) -> bool {
        current_pid() != self.pid
    }

    /// Refuses an op in a forked child.
    pub(super) fn check_not_forked(&self) -> Result<()> {
        if self.forked() {
            return Err(fork_error(
                &format!("group '{}'", self.name),
                self.pid,
                current_pid(),
            ));
        }
        Ok(())
    }
}
