"""The life cycle every epcomm handle shares: ``close()`` (idempotent), a context manager, and
release when garbage-collected."""

from __future__ import annotations

from typing import Any, TypeVar

from ._lib import load_library, vp
from .errors import check

H = TypeVar("H", bound="Handle")


class Handle:
    """A C handle released by the library function named ``_DESTROY`` (its ``_checked`` form,
    which returns the status)."""

    _DESTROY = ""
    _h: vp = vp()

    def close(self) -> None:
        """Releases the handle (idempotent). Refused, keeping the handle open (an
        ``epcomm.Error`` that is a RuntimeError, EPCOMM_ERROR_INVALID_STATE), while another
        thread's call on it is in flight, and in a forked child of the process that made it."""
        if self._h:
            check(getattr(load_library(), self._DESTROY + "_checked")(self._h))
            self._h = vp()

    def __enter__(self: H) -> H:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
