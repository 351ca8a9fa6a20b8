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


class InvalidArgumentError(Error, ValueError):
    """A bad argument (EPCOMM_ERROR_INVALID_ARGUMENT, EPCOMM_ERROR_NULL_POINTER)."""


class EpcommAssertionError(Error, AssertionError):
    """A condition vLLM asserts (EPCOMM_ERROR_ASSERTION)."""


class EpcommNotImplementedError(Error, NotImplementedError):
    """What vLLM does not implement either (EPCOMM_ERROR_NOT_IMPLEMENTED)."""


class EpcommRuntimeError(Error, RuntimeError):
    """A failure at run time: a peer, the transport, an unavailable backend, an internal error."""


class EpcommTimeoutError(Error, TimeoutError):
    """A peer that did not arrive in time (EPCOMM_ERROR_TIMEOUT)."""


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
    """The exception for a failed call's ``status``, with this thread's last message and hint."""
    lib = load_library()
    message = (lib.epcomm_last_error_message() or lib.epcomm_status_string(status)).decode()
    hint = lib.epcomm_last_error_hint()
    return error_class(status)(message, status, hint.decode() if hint else None)


def check(status: int) -> None:
    """Returns on EPCOMM_OK (0); raises ``make_error(status)`` otherwise."""
    if status != 0:
        raise make_error(status)

