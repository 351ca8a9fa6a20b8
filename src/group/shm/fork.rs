//! A forked child's copy of a group: its mappings of the control and data segments are the
//! parent's shared memory, so any op or leave from it would act as the parent's rank (its
//! barrier "succeeds", the parent's next op then fails or mismatches at a peer). The child is
//! refused before it touches anything shared, and its drop leaves the parent's slot alone.

use super::ShmGroup;
use crate::error::{Error, Result};

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
        std::process::id() != self.pid
    }

    /// Refuses an op in a forked child.
    pub(super) fn check_not_forked(&self) -> Result<()> {
        if self.forked() {
            return Err(fork_error(
                &format!("group '{}'", self.name),
                self.pid,
                std::process::id(),
            ));
        }
        Ok(())
    }
}
