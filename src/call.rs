//! The user's call in progress on this thread (dispatch, combine, rearrange, ...), so that an
//! error a group raises inside it (a peer that died, stalled or left) names the call the user
//! made rather than the group primitive it was running (`reduce_rows`, `all_gatherv`, ...).
//! The entry points of `moe` and `eplb` open a [`scope`]; the transports read [`name_or`]
//! where they word a peer failure. The outermost scope wins: a rearrangement's inner calls
//! stay "rearrange".

use std::cell::Cell;
use std::marker::PhantomData;

thread_local! {
    /// The call named by the outermost [`CallScope`] alive on this thread.
    static CALL: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// While alive, errors of the group primitives this thread runs name `call`; see [`scope`].
#[must_use = "the call is named only while the scope is alive"]
pub struct CallScope {
    previous: Option<&'static str>,
    /// Tied to the thread whose call it named.
    _not_send: PhantomData<*const ()>,
}

/// Names `call` (as the user knows it: "dispatch", "combine", "rearrange") as this thread's
/// call until the returned scope drops, unless an outer scope named one already.
pub fn scope(call: &'static str) -> CallScope {
    let previous = CALL.with(Cell::get);
    if previous.is_none() {
        CALL.with(|c| c.set(Some(call)));
    }
    CallScope {
        previous,
        _not_send: PhantomData,
    }
}

impl Drop for CallScope {
    fn drop(&mut self) {
        CALL.with(|c| c.set(self.previous));
    }
}

/// The user's call in progress on this thread, if a scope names one.
pub fn current() -> Option<&'static str> {
    CALL.with(Cell::get)
}

/// What a failure during the group primitive `op` should name: the user's call in progress,
/// else `op` itself (the user called the primitive directly).
pub fn name_or(op: &'static str) -> &'static str {
    current().unwrap_or(op)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outermost_scope_names_the_call_until_it_drops() {
        assert_eq!(name_or("barrier"), "barrier");
        {
            let _outer = scope("rearrange");
            assert_eq!(name_or("send_recv"), "rearrange");
            {
                let _inner = scope("dispatch");
                assert_eq!(current(), Some("rearrange"));
            }
            assert_eq!(current(), Some("rearrange"));
        }
        assert_eq!(current(), None);
        assert_eq!(name_or("all_gatherv"), "all_gatherv");
    }
}
