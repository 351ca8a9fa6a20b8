"""The life cycle every epcomm handle shares: ``close()`` (idempotent), a context manager, and
release when garbage-collected."""

from __future__ import annotations

from typing import Any, TypeVar

from ._lib import load_library, vp

H = TypeVar("H", bound="Handle")


class Handle:
    """A C handle released by the library function named ``_DESTROY``."""

    _DESTROY = ""
    _h: vp = vp()

    def close(self) -> None:
        """Releases the handle (idempotent)."""
        if self._h:
            getattr(load_library(), self._DESTROY)(self._h)
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
