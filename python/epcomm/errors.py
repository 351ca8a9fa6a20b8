"""epcomm's exceptions: each is an ``epcomm.Error`` and the builtin class vLLM raises for the
same condition (the C ABI's ``epcomm_status_exception`` names it), so both ``except
epcomm.Error`` and ``except ValueError`` catch it."""

from __future__ import annotations

from typing import Dict, Optional, Type

from ._lib import load_library


class Error(Exception):
    """A failed epcomm call: ``status`` (the EPCOMM_ERROR_* code), ``message`` (vLLM's exact
    text where vLLM raises for the same condition; also ``str(e)``) and ``hint`` (a remedy, or
    None; never part of the message)."""

    status: int
    message: str
    hint: Optional[str]

    def __init__(self, message: str, status: int = 5, hint: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.hint = hint


def _both(builtin: type, doc: str) -> Type[Error]:
    """A class that is an Error and ``builtin``, named as ``builtin`` (so a traceback, or code
    reading ``type(e).__name__``, shows vLLM's class name)."""
    return type(builtin.__name__, (Error, builtin), {"__doc__": doc, "__module__": __name__})


#: A bad argument (EPCOMM_ERROR_INVALID_ARGUMENT, EPCOMM_ERROR_NULL_POINTER): a ValueError.
InvalidArgumentError = _both(ValueError, "A bad argument: an epcomm.Error and a ValueError.")
#: A condition vLLM asserts (EPCOMM_ERROR_ASSERTION): an AssertionError.
EpcommAssertionError = _both(AssertionError, "A failed assertion vLLM makes too.")
#: What vLLM does not implement either (EPCOMM_ERROR_NOT_IMPLEMENTED).
EpcommNotImplementedError = _both(NotImplementedError, "What vLLM does not implement either.")
#: A failure at run time: a peer, the transport, an unavailable backend, an internal error.
EpcommRuntimeError = _both(RuntimeError, "A failure at run time (a peer, the transport, ...).")
#: A peer that did not arrive in time (EPCOMM_ERROR_TIMEOUT): a TimeoutError.
EpcommTimeoutError = _both(TimeoutError, "A peer that did not arrive in time.")


# Keyed by the builtin class name epcomm_status_exception returns.
_BY_BUILTIN: Dict[str, Type[Error]] = {
    "ValueError": InvalidArgumentError,
    "AssertionError": EpcommAssertionError,
    "NotImplementedError": EpcommNotImplementedError,
    "RuntimeError": EpcommRuntimeError,
    "TimeoutError": EpcommTimeoutError,
}


def error_class(status: int) -> Type[Error]:
    """The class raised for ``status``: RuntimeError's for a class this package does not know."""
    name = load_library().epcomm_status_exception(status)
    return _BY_BUILTIN.get((name or b"RuntimeError").decode(), EpcommRuntimeError)


def make_error(status: int) -> Error:
    """The exception for a failed call's ``status``, with this thread's last message (element
    types named as PyTorch names them, as vLLM's messages do) and hint."""
    lib = load_library()
    message = (lib.epcomm_last_error_message_torch() or lib.epcomm_status_string(status)).decode()
    hint = lib.epcomm_last_error_hint()
    return error_class(status)(message, status, hint.decode() if hint else None)


def check(status: int) -> None:
    """Returns on EPCOMM_OK (0); raises ``make_error(status)`` otherwise."""
    if status != 0:
        raise make_error(status)

