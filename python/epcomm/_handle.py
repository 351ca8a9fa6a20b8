"""The life cycle every epcomm handle shares: ``close()`` (idempotent), a context manager, and
release when garbage-collected.

``close()`` never frees memory something still uses. Arrays and DLPack tensors made from a
handle's Buffers (``numpy.asarray``, ``torch.from_dlpack``, ``numpy.from_dlpack``) keep its
memory alive, as DLPack's contract asks of a producer: ``close()`` ends the handle at once (every
later call on it, or export of its Buffers, raises), and the C handle is destroyed when the last
of them is gone. A group's ``close()`` closes the managers made on it first, and its own C handle
outlives theirs. ``close()`` is refused (an ``epcomm.Error`` that is a RuntimeError, status
EPCOMM_ERROR_INVALID_STATE), the handle left open, while another thread's call on the handle
(or on a manager made on it) is in flight."""

from __future__ import annotations

import threading
import weakref
from typing import Any, List, Optional, TypeVar

from ._lib import load_library, vp
from .errors import Error, InvalidArgumentError, error_class, make_error

H = TypeVar("H", bound="Handle")

#: EPCOMM_ERROR_INVALID_STATE: the status of a refused close().
INVALID_STATE = 9


def invalid_state(message: str) -> Error:
    """The error of a call refused in this state (EPCOMM_ERROR_INVALID_STATE's class)."""
    return error_class(INVALID_STATE)(message, INVALID_STATE)


class Handle:
    """A C handle released by the library function named ``_DESTROY``; ``_WHAT`` names it in
    messages."""

    _DESTROY = ""
    _WHAT = "handle"
    _h: vp = vp()
    # Guards what follows; reentrant because a Pin's __del__ may run (garbage collection) on a
    # thread that holds it.
    _state: "threading.RLock"
    _closed: bool  # close() ran: no call starts; the C handle may still live
    _calls: int  # calls in flight (any thread) that use the C handle
    _exports: int  # live Pins: arrays / DLPack tensors over the handle's memory
    _lingering: int  # handles made on this one whose C handle still lives
    _destroying: bool
    _parent: Optional["Handle"]
    _dependents: "weakref.WeakSet[Handle]"

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Here, not in __init__: some handles are made with cls.__new__ (Group._adopt).
        self = super().__new__(cls)
        self._state = threading.RLock()
        self._closed = False
        self._calls = 0
        self._exports = 0
        self._lingering = 0
        self._destroying = False
        self._parent = None
        self._dependents = weakref.WeakSet()
        return self

    def _depend_on(self, parent: "Handle") -> None:
        """Records that this handle was made on ``parent`` (a manager on its group): the
        parent's close() closes this one, and its C handle is destroyed after this one's."""
        with parent._state:
            parent._lingering += 1
            parent._dependents.add(self)
        self._parent = parent

    # -- calls ---------------------------------------------------------------------------------

    def _enter(self) -> None:
        """Counts a call that uses the C handle; refused once the handle is closed."""
        with self._state:
            if self._closed or not self._h:
                raise InvalidArgumentError(f"the {self._WHAT} is closed", 2)
            self._calls += 1

    def _leave(self) -> None:
        with self._state:
            self._calls -= 1

    # -- closing -------------------------------------------------------------------------------

    def close(self) -> None:
        """Ends the handle (idempotent): later calls on it raise, and so does exporting its
        Buffers. The C handle, and the memory of this handle's outputs, are released now, or
        when the last numpy array / DLPack tensor made from its Buffers (or a manager made on
        it, for a group) is gone. Managers made on a group are closed with it. Refused, the
        handle left open, while another thread's call on it (or on such a manager) is in
        flight: an epcomm.Error (RuntimeError, status EPCOMM_ERROR_INVALID_STATE)."""
        with self._state:
            if self._closed or not self._h:
                return
            deps: List[Handle] = [d for d in list(self._dependents) if not d._closed]
            for h in [self] + deps:
                with h._state:
                    calls = h._calls
                if calls:
                    also = "" if h is self else (
                        f" (close() of the {self._WHAT} closes the {h._WHAT} made on it)")
                    raise invalid_state(
                        f"close() of the {self._WHAT} refused: {calls} call(s) on the "
                        f"{h._WHAT} are still in flight; close it after they "
                        f"return{also}")
            self._closed = True
        try:
            for d in deps:
                d.close()
        finally:
            self._release(raise_errors=True)

    def _release(self, raise_errors: bool = False) -> None:
        """Destroys the C handle once it is closed and nothing uses it any more."""
        with self._state:
            if (not self._closed or not self._h or self._destroying or self._calls
                    or self._exports or self._lingering):
                return
            self._destroying = True
            h = self._h
        try:
            lib = load_library()
            # The status-returning form where the library has it (it refuses a handle in use).
            checked = getattr(lib, self._DESTROY + "_checked", None)
            status = checked(h) if checked is not None else getattr(lib, self._DESTROY)(h)
        except BaseException:
            with self._state:
                self._destroying = False
                if raise_errors:
                    self._closed = False
            if raise_errors:
                raise
            return  # at interpreter exit the library may be gone; nothing to report to
        with self._state:
            self._destroying = False
            if status:  # a library that refuses to destroy a handle in use says so
                if raise_errors:
                    self._closed = False
                    raise make_error(status)
                return
            self._h = vp()
        parent = self._parent
        if parent is not None:
            with parent._state:
                parent._lingering -= 1
            parent._release()

    def __enter__(self: H) -> H:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            self.close()
        except Error:
            # Never mask the exception leaving the block; the handle is then released when it
            # is garbage-collected.
            if exc_type is None:
                raise

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Pin:
    """One export (a numpy array's base, a DLPack export's owner) of a handle's memory: while
    it lives the C handle is not destroyed (close() leaves that to the last Pin). Holds the
    handle object alive."""

    __slots__ = ("handle",)
    handle: Optional[Handle]

    def __init__(self, handle: Handle):
        with handle._state:
            if handle._closed or not handle._h:
                raise InvalidArgumentError(
                    f"this Buffer views memory of a closed {handle._WHAT}; copy outputs "
                    "before close()", 2)
            handle._exports += 1
        self.handle = handle

    def __del__(self) -> None:
        h = getattr(self, "handle", None)
        if h is not None:
            with h._state:
                h._exports -= 1
            h._release()


class in_flight:  # noqa: N801 -- used as a context manager, like a function
    """``with in_flight(a, g) as h:`` counts a call on every handle given (close() is refused
    meanwhile) and yields the first one's C pointer; refused when any is closed."""

    __slots__ = ("handles",)

    def __init__(self, *handles: Handle):
        self.handles = handles

    def __enter__(self) -> vp:
        entered: List[Handle] = []
        try:
            for h in self.handles:
                h._enter()
                entered.append(h)
        except BaseException:
            for h in reversed(entered):
                h._leave()
            raise
        return self.handles[0]._h

    def __exit__(self, *exc: Any) -> None:
        for h in reversed(self.handles):
            h._leave()
