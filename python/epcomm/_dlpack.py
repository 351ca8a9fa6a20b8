"""Views of epcomm-owned memory exported through DLPack (``__dlpack__``), so that
``torch.from_dlpack(v)`` and ``numpy.from_dlpack(v)`` read it without a copy.

Each export is made by the library (``epcomm_dlpack_export``): a DLManagedTensor, or for a
consumer asking for DLPack 1.x a DLManagedTensorVersioned, in a capsule, following the DLPack
spec's Python rules: a consumer renames the capsule "used_dltensor" ("used_dltensor_versioned")
and calls the tensor's deleter when done; a capsule nobody consumed frees its tensor.

No Python code runs when an export is freed. Consumers call the deleter whenever their tensor
dies, which may be while an exception propagates (a temporary in an expression that raises) or
on a thread without the GIL, and Python code run then (a ctypes callback) corrupts the pending
exception (a SystemError, or a crash). So the deleter and the capsule's destructor are the
library's C functions: the deleter drops the export's one reference to what owns the memory
(``epcomm_dlpack_python_release``: PyGILState_Ensure, Py_DecRef, PyGILState_Release, through the
Python C-API functions handed to the library once), the destructor calls the deleter of a
capsule still named "dltensor" or "dltensor_versioned" (``epcomm_dlpack_capsule_destructor``)."""

from __future__ import annotations

import ctypes
import struct
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ._handle import Handle, Pin
from ._lib import DEVICE_CPU, DType, Tensor, i64p, load_library, vp
from .errors import InvalidArgumentError, check

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


class _PythonApi(ctypes.Structure):
    """epcomm_python_api: the Python C-API functions the library's DLPack helpers call."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("gil_ensure", vp),
        ("gil_release", vp),
        ("decref", vp),
        ("is_initialized", vp),
        ("capsule_get_name", vp),
        ("capsule_get_pointer", vp),
    ]


def _api(name: str, res: Any, args: list) -> Any:
    f = getattr(ctypes.pythonapi, name)
    f.restype, f.argtypes = res, args
    return f


def _address(f: Any) -> int:
    return ctypes.cast(f, vp).value or 0


_capsule_new = _api("PyCapsule_New", ctypes.py_object, [vp, ctypes.c_char_p, vp])
_incref = _api("Py_IncRef", None, [ctypes.py_object])
_decref = _api("Py_DecRef", None, [ctypes.py_object])
# (library, its release function, its capsule destructor) once the API is handed over.
_EXPORTER: List[Tuple[Any, int, int]] = []


def _exporter() -> Tuple[Any, int, int]:
    """The library, with this interpreter's C-API functions handed to it (once)."""
    if not _EXPORTER:
        lib = load_library()
        py = ctypes.pythonapi
        names = ("PyGILState_Ensure", "PyGILState_Release", "Py_DecRef", "Py_IsInitialized",
                 "PyCapsule_GetName", "PyCapsule_GetPointer")
        api = _PythonApi(ctypes.sizeof(_PythonApi), *(_address(getattr(py, n)) for n in names))
        check(lib.epcomm_dlpack_set_python_api(ctypes.byref(api)))
        _EXPORTER.append((lib, _address(lib.epcomm_dlpack_python_release),
                          _address(lib.epcomm_dlpack_capsule_destructor)))
    return _EXPORTER[0]


def live_exports() -> int:
    """How many of the library's DLPack exports are not freed yet (tests check that none
    leak)."""
    return int(load_library().epcomm_dlpack_live())


def _shape_array(shape: Sequence[int]) -> Any:
    return (ctypes.c_int64 * max(len(shape), 1))(*shape)


def _export(t: Tensor, versioned: bool, owner: Any) -> Any:
    """A capsule of the library's export of ``t``, which holds a reference to ``owner`` until
    its deleter runs."""
    lib, release, destructor = _exporter()
    managed = vp()
    _incref(owner)  # the export's reference, dropped by epcomm_dlpack_python_release
    status = lib.epcomm_dlpack_export(ctypes.byref(t), versioned, release, id(owner),
                                      ctypes.byref(managed))
    if status:
        _decref(owner)
        check(status)
    name = b"dltensor_versioned" if versioned else b"dltensor"
    try:
        return _capsule_new(managed.value, name, destructor)
    except BaseException:
        delete = lib.epcomm_dlpack_delete_versioned if versioned else lib.epcomm_dlpack_delete
        delete(managed)
        raise


class Buffer:
    """A read-write view of an output epcomm returns (dispatch's buffers, statistics, plans,
    maps, loads). A view of a manager's (or plan's) memory is valid until that object's next
    call that replaces it, like the C ABI's views: a tensor made from it with
    ``torch.from_dlpack`` or ``numpy.from_dlpack`` shares the memory and must not be used
    after that (copy it to keep it). Such a tensor (or ``numpy.asarray`` array) keeps the
    memory alive after that object's ``close()``, which frees it when the last one is gone;
    the Buffer itself does not: after the close (or once replaced, for dispatch outputs)
    exporting or reading it raises.
    Buffers that own their memory (maps, loads) stay valid as long as they or a tensor made
    from them live. ``numpy()`` returns a copy (bfloat16 as uint16 bits),
    ``numpy.asarray(buffer)`` a view, ``tolist()`` nested Python lists."""

    def __init__(self, tensor: Tensor, owner: Any,
                 stale: Optional[Callable[[], Optional[str]]] = None):
        self._owner = owner  # what owns the memory (a manager, a plan, a ctypes array)
        # Why the memory is no longer this view's (it was replaced), or None.
        self._stale = stale
        self.shape: Tuple[int, ...] = tuple(tensor.shape[i] for i in range(tensor.ndim))
        self.dtype: str = _DTYPE_NAMES[(tensor.dtype.code, tensor.dtype.bits)]
        self._data: Optional[int] = tensor.data
        self._dtype = DType(tensor.dtype.code, tensor.dtype.bits, 1)
        self._device = (tensor.device_type or DEVICE_CPU, tensor.device_id)

    @classmethod
    def view(cls, address: Optional[int], shape: Sequence[int], dtype: str, owner: Any,
             stale: Optional[Callable[[], Optional[str]]] = None) -> "Buffer":
        """A view of ``shape`` elements of ``dtype`` at ``address``, owned by ``owner``
        (``stale``: as the constructor's)."""
        dims = _shape_array(shape)
        t = Tensor()
        t.data = address or None
        t.ndim = len(shape)
        t.dtype = DType(*_CODES[dtype], 1)
        t.shape = ctypes.cast(dims, i64p)
        return cls(t, owner, stale)

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

    def _usable(self) -> None:
        """Raises when the memory is gone: its handle closed, or replaced (``stale``)."""
        owner = self._owner
        if isinstance(owner, Handle) and (owner._closed or not owner._h):
            raise InvalidArgumentError(
                f"this Buffer views memory of a closed {owner._WHAT}; copy outputs before "
                "close()", 2)
        why = self._stale() if self._stale is not None else None
        if why is not None:
            raise InvalidArgumentError(why, 2)

    def _hold(self) -> Any:
        """What an export of this view holds to keep its memory: a Pin of a handle (its
        close() is refused meanwhile), else the owner itself."""
        self._usable()
        return Pin(self._owner) if isinstance(self._owner, Handle) else self._owner

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
        if copy:
            raise BufferError("epcomm exports its buffers as they are (copy=True refused)")
        if dl_device is not None and tuple(dl_device) != self._device:
            raise BufferError(f"this buffer is on device {self._device}; dl_device "
                              f"{dl_device} refused (epcomm does not copy between devices)")
        versioned = max_version is not None and max_version[0] >= 1
        shape = _shape_array(self.shape)
        t = Tensor()
        t.data = self._data or None
        t.device_type, t.device_id = self._device
        t.ndim = len(self.shape)
        t.dtype = self._dtype
        t.shape = ctypes.cast(shape, i64p)  # the library copies it
        return _export(t, versioned, self._hold())

    def tolist(self) -> Any:
        """The elements as nested Python lists (bfloat16 and float16 as floats); a copy."""
        self._host("tolist()")
        self._usable()
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
        self._usable()
        kind = np.dtype(_FORMATS[self.dtype])
        if not self.nbytes or not self._data:
            a = np.zeros(self.shape, kind)
        else:
            hold = self._hold()
            raw = (ctypes.c_char * self.nbytes).from_address(self._data)
            setattr(raw, "_epcomm_owner", hold)  # the array's base keeps the memory alive
            a = np.frombuffer(raw, kind).reshape(self.shape)
            if copy:
                a = a.copy()
        return a if dtype is None else a.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"epcomm.Buffer(shape={self.shape}, dtype={self.dtype})"
