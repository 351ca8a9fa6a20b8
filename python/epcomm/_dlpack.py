"""Views of epcomm-owned memory exported through DLPack (``__dlpack__``), so that
``torch.from_dlpack(v)`` and ``numpy.from_dlpack(v)`` read it without a copy."""

from __future__ import annotations

import ctypes
from typing import Any, Dict, Optional, Tuple

from ._lib import DEVICE_CPU, DType, Tensor, i64p, vp
from ._tensor import to_numpy, view_numpy

_DTYPE_NAMES = {
    (2, 32): "float32",
    (2, 16): "float16",
    (4, 16): "bfloat16",
    (0, 32): "int32",
    (0, 64): "int64",
    (1, 8): "uint8",
}


class _ManagedTensor(ctypes.Structure):
    """DLPack's (pre-1.0) DLManagedTensor; its deleter is declared below."""


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_ManagedTensor))
_ManagedTensor._fields_ = [("dl_tensor", Tensor), ("manager_ctx", vp), ("deleter", _DELETER)]

# Exported tensors by address: what keeps each DLManagedTensor (and its owner) alive until the
# consumer calls its deleter.
_LIVE: Dict[int, Tuple[Any, ...]] = {}


@_DELETER
def _delete(managed):
    _LIVE.pop(ctypes.addressof(managed.contents), None)


def _api(name: str, res: Any, args: list) -> Any:
    f = getattr(ctypes.pythonapi, name)
    f.restype, f.argtypes = res, args
    return f


# No capsule destructor: a capsule no consumer took keeps its record (a few hundred bytes and
# the manager) alive until exit; every consumer calls the deleter, which drops it.
_capsule_new = _api("PyCapsule_New", ctypes.py_object, [vp, ctypes.c_char_p, vp])


class Buffer:
    """A read-write view of an output epcomm owns (dispatch's buffers). Valid until the
    manager's next dispatch or close, like the C ABI's views: a tensor made from it with
    ``torch.from_dlpack`` or ``numpy.from_dlpack`` shares the memory and must not be used
    after that (copy it to keep it). ``numpy()`` returns a copy (bfloat16 as uint16 bits);
    ``numpy.asarray(buffer)`` a view."""

    def __init__(self, tensor: Tensor, owner: Any):
        self._owner = owner  # the manager whose memory this is
        self.shape: Tuple[int, ...] = tuple(tensor.shape[i] for i in range(tensor.ndim))
        self.dtype: str = _DTYPE_NAMES[(tensor.dtype.code, tensor.dtype.bits)]
        self._data: Optional[int] = tensor.data
        self._dtype = DType(tensor.dtype.code, tensor.dtype.bits, 1)
        self._copy = Tensor.from_buffer_copy(tensor)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (DEVICE_CPU, 0)

    def __dlpack__(self, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Optional[bool] = None) -> Any:
        """A "dltensor" capsule of this view (a DLPack 0.x export, which 1.x consumers take)."""
        if copy:
            raise BufferError("epcomm exports its buffers as they are (copy=True refused)")
        shape = (ctypes.c_int64 * max(len(self.shape), 1))(*self.shape)
        m = _ManagedTensor()
        m.dl_tensor.data = self._data or None
        m.dl_tensor.device_type, m.dl_tensor.device_id = DEVICE_CPU, 0
        m.dl_tensor.ndim = len(self.shape)
        m.dl_tensor.dtype = self._dtype
        m.dl_tensor.shape = ctypes.cast(shape, i64p)
        m.dl_tensor.strides = None
        m.dl_tensor.byte_offset = 0
        m.deleter = _delete
        _LIVE[ctypes.addressof(m)] = (m, shape, self._owner)
        return _capsule_new(ctypes.addressof(m), b"dltensor", None)

    def numpy(self) -> Any:
        """A numpy copy of the view (bfloat16 comes back as uint16 bits)."""
        return to_numpy(self._copy)

    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> Any:
        """``numpy.asarray(buffer)``: a numpy view of the memory (no copy; valid as long as the
        buffer is), or a copy with ``copy=True``; bfloat16 as uint16 bits."""
        a = to_numpy(self._copy) if copy else view_numpy(self._copy, self._owner)
        return a if dtype is None else a.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"epcomm.Buffer(shape={self.shape}, dtype={self.dtype})"
