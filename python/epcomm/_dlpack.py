"""Views of epcomm-owned memory exported through DLPack (``__dlpack__``), so that
``torch.from_dlpack(v)`` and ``numpy.from_dlpack(v)`` read it without a copy.

Each export is a DLManagedTensor (or, for a consumer asking for DLPack 1.x, a
DLManagedTensorVersioned) in a capsule, following the DLPack spec's Python rules: a consumer
renames the capsule "used_dltensor" ("used_dltensor_versioned") and calls the tensor's deleter
when done; a capsule nobody consumed frees its tensor.

That last rule is not a capsule destructor here: a destructor written in Python (a ctypes
callback) would run inside the capsule's deallocation, which Python also performs while an
exception propagates, and Python code run with an exception pending corrupts it (a
SystemError, or a crash). Instead the package keeps a reference to each capsule it made and
sweeps them at safe points (each export, each garbage collection, ``live_exports()``): a capsule
only the package still holds was dropped by everyone else; unconsumed, its tensor is freed
then; consumed, the consumer's deleter call frees it. The deleter itself has to be a ctypes
callback, so a consumer's tensor released while an exception propagates (a temporary in an
expression that raises) reaches it in that state; keep such tensors in variables."""

from __future__ import annotations

import ctypes
import gc
import struct
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._lib import DEVICE_CPU, DType, Tensor, i64p, vp

_DTYPE_NAMES = {
    (2, 32): "float32",
    (2, 16): "float16",
    (4, 16): "bfloat16",
    (0, 32): "int32",
    (0, 64): "int64",
    (1, 8): "uint8",
    (1, 64): "uint64",
}
# memoryview formats per dtype; bfloat16 is read as its 16 bits.
_FORMATS = {
    "float32": "f",
    "float16": "e",
    "bfloat16": "H",
    "int32": "i",
    "int64": "q",
    "uint8": "B",
    "uint64": "Q",
}
_CODES = {name: code for code, name in _DTYPE_NAMES.items()}


class _ManagedTensor(ctypes.Structure):
    """DLPack's (pre-1.0) DLManagedTensor; its deleter is declared below."""


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedTensorVersioned(ctypes.Structure):
    """DLPack 1.x's DLManagedTensorVersioned."""


_DELETER = ctypes.CFUNCTYPE(None, vp)
_ManagedTensor._fields_ = [("dl_tensor", Tensor), ("manager_ctx", vp), ("deleter", _DELETER)]
_ManagedTensorVersioned._fields_ = [
    ("version", _Version),
    ("manager_ctx", vp),
    ("deleter", _DELETER),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", Tensor),
]

# Exported tensors by address: [managed tensor, shape, owner, capsule or None], what keeps each
# managed tensor (and its owner) alive until its deleter runs or its capsule is swept.
_LIVE: Dict[int, List[Any]] = {}
_UNCONSUMED = (b"dltensor", b"dltensor_versioned")


def sweep() -> None:
    """Frees the tensors of capsules that were dropped unconsumed, and lets go of consumed
    capsules (their consumers call the deleter)."""
    for address, record in list(_LIVE.items()):
        capsule = record[3]
        # The record's reference, this variable's and getrefcount's argument: nobody else.
        if capsule is None or sys.getrefcount(capsule) > 3:
            continue
        if _capsule_name(capsule) in _UNCONSUMED:
            _LIVE.pop(address, None)
        else:
            record[3] = None


def live_exports() -> int:
    """How many exports still hold epcomm memory, after a sweep (tests check that none leak)."""
    sweep()
    return len(_LIVE)


def _sweep_after_gc(phase: str, _info: Dict[str, Any]) -> None:
    if phase == "stop":
        sweep()


gc.callbacks.append(_sweep_after_gc)


@_DELETER
def _delete(address: Optional[int]) -> None:
    if address:
        _LIVE.pop(address, None)


def _api(name: str, res: Any, args: list) -> Any:
    f = getattr(ctypes.pythonapi, name)
    f.restype, f.argtypes = res, args
    return f


# No destructor (see the module's doc): the capsules are swept instead.
_capsule_new = _api("PyCapsule_New", ctypes.py_object, [vp, ctypes.c_char_p, vp])
_capsule_name = _api("PyCapsule_GetName", ctypes.c_char_p, [ctypes.py_object])


def _shape_array(shape: Sequence[int]) -> Any:
    return (ctypes.c_int64 * max(len(shape), 1))(*shape)


class Buffer:
    """A read-write view of an output epcomm returns (dispatch's buffers, statistics, plans,
    maps, loads). A view of a manager's (or plan's) memory is valid until that object's next
    call that replaces it or its close, like the C ABI's views: a tensor made from it with
    ``torch.from_dlpack`` or ``numpy.from_dlpack`` shares the memory and must not be used
    after that (copy it to keep it). Buffers that own their memory (maps, loads) stay valid
    as long as they or a tensor made from them live. ``numpy()`` returns a copy (bfloat16 as
    uint16 bits), ``numpy.asarray(buffer)`` a view, ``tolist()`` nested Python lists."""

    def __init__(self, tensor: Tensor, owner: Any):
        self._owner = owner  # what owns the memory (a manager, a plan, a ctypes array)
        self.shape: Tuple[int, ...] = tuple(tensor.shape[i] for i in range(tensor.ndim))
        self.dtype: str = _DTYPE_NAMES[(tensor.dtype.code, tensor.dtype.bits)]
        self._data: Optional[int] = tensor.data
        self._dtype = DType(tensor.dtype.code, tensor.dtype.bits, 1)
        self._device = (tensor.device_type or DEVICE_CPU, tensor.device_id)

    @classmethod
    def view(cls, address: Optional[int], shape: Sequence[int], dtype: str,
             owner: Any) -> "Buffer":
        """A view of ``shape`` elements of ``dtype`` at ``address``, owned by ``owner``."""
        dims = _shape_array(shape)
        t = Tensor()
        t.data = address or None
        t.ndim = len(shape)
        t.dtype = DType(*_CODES[dtype], 1)
        t.shape = ctypes.cast(dims, i64p)
        return cls(t, owner)

    @classmethod
    def owning(cls, array: Any, shape: Sequence[int], dtype: str) -> "Buffer":
        """A Buffer over a ctypes array it keeps alive (``shape`` of ``dtype`` elements)."""
        return cls.view(ctypes.addressof(array), shape, dtype, array)

    @property
    def nbytes(self) -> int:
        """Bytes of the viewed memory."""
        n = self._dtype.bits // 8
        for d in self.shape:
            n *= d
        return n

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._device

    def _host(self, what: str) -> None:
        if self._device[0] != DEVICE_CPU:
            raise BufferError(f"{what} reads host memory; this buffer is on device "
                              f"{self._device} (use torch.from_dlpack)")

    def __dlpack__(self, stream: Any = None, max_version: Optional[Tuple[int, int]] = None,
                   dl_device: Any = None, copy: Optional[bool] = None) -> Any:
        """A capsule of this view: "dltensor_versioned" (DLPack 1.0, writable) for a consumer
        whose ``max_version`` is 1.x or later, else "dltensor" (DLPack 0.x)."""
        sweep()
        if copy:
            raise BufferError("epcomm exports its buffers as they are (copy=True refused)")
        if dl_device is not None and tuple(dl_device) != self._device:
            raise BufferError(f"this buffer is on device {self._device}; dl_device "
                              f"{dl_device} refused (epcomm does not copy between devices)")
        versioned = max_version is not None and max_version[0] >= 1
        m: Any = _ManagedTensorVersioned() if versioned else _ManagedTensor()
        if versioned:
            m.version.major, m.version.minor = 1, 0
            m.flags = 0  # writable, not a copy
        shape = _shape_array(self.shape)
        t = m.dl_tensor
        t.data = self._data or None
        t.device_type, t.device_id = self._device
        t.ndim = len(self.shape)
        t.dtype = self._dtype
        t.shape = ctypes.cast(shape, i64p)
        t.strides = None
        t.byte_offset = 0
        m.deleter = _delete
        name = b"dltensor_versioned" if versioned else b"dltensor"
        capsule = _capsule_new(ctypes.addressof(m), name, None)
        _LIVE[ctypes.addressof(m)] = [m, shape, self._owner, capsule]
        return capsule

    def tolist(self) -> Any:
        """The elements as nested Python lists (bfloat16 and float16 as floats); a copy."""
        self._host("tolist()")
        flat: List[Any] = []
        if self.nbytes and self._data:
            raw = ctypes.string_at(self._data, self.nbytes)
            n = self.nbytes // (self._dtype.bits // 8)
            flat = list(struct.unpack(f"={n}{_FORMATS[self.dtype]}", raw))
        if self.dtype == "bfloat16":
            flat = [struct.unpack("<f", struct.pack("<I", v << 16))[0] for v in flat]
        for d in reversed(self.shape[1:]):
            flat = [flat[i : i + d] for i in range(0, len(flat), d)]
        return flat if self.shape else flat[0]

    def numpy(self) -> Any:
        """A numpy copy of the view (bfloat16 comes back as uint16 bits)."""
        return self.__array__().copy()

    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> Any:
        """``numpy.asarray(buffer)``: a numpy view of the memory (no copy; valid as long as the
        buffer is), or a copy with ``copy=True``; bfloat16 as uint16 bits."""
        import numpy as np

        self._host("numpy")
        kind = np.dtype(_FORMATS[self.dtype])
        if not self.nbytes or not self._data:
            a = np.zeros(self.shape, kind)
        else:
            raw = (ctypes.c_char * self.nbytes).from_address(self._data)
            setattr(raw, "_epcomm_owner", self._owner)  # the array's base keeps the owner alive
            a = np.frombuffer(raw, kind).reshape(self.shape)
            if copy:
                a = a.copy()
        return a if dtype is None else a.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"epcomm.Buffer(shape={self.shape}, dtype={self.dtype})"
