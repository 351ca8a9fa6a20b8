"""Tensor arguments: numpy arrays and DLPack producers (e.g. CPU torch tensors) described to
the library as DLPack DLTensors without copies, dtype names, and copies of epcomm's outputs."""

from __future__ import annotations

import ctypes
import sys
from typing import Any, List, Optional

from ._dlpack import Buffer
from ._lib import DType, Tensor, cp, i64p, vp
from .errors import InvalidArgumentError

_NP_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}

# DLPack 1.0 (DLManagedTensorVersioned) flags.
_DLPACK_FLAG_READ_ONLY = 1 << 0
_DLPACK_FLAG_IS_COPIED = 1 << 1


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedTensorVersioned(ctypes.Structure):
    """DLPack 1.0's DLManagedTensorVersioned, up to its DLTensor."""

    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", vp),
        ("deleter", vp),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", Tensor),
    ]


def _capsule_name(capsule: Any) -> bytes:
    get = ctypes.pythonapi.PyCapsule_GetName
    get.restype = cp
    get.argtypes = [ctypes.py_object]
    return get(capsule)


def _capsule_pointer(capsule: Any, name: bytes) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = vp
    get.argtypes = [ctypes.py_object, cp]
    return get(capsule, name)


def is_numpy(obj: Any) -> bool:
    """Whether ``obj`` is numpy's (checked without importing numpy)."""
    return type(obj).__module__ == "numpy"


class Arg:
    """A tensor argument: keeps what the descriptor points into alive during the call.

    An output (`output=True`) must be writable. A DLPack output (a torch tensor) is passed as
    exported (a copy on export is refused here); the library writes it in place and refuses a
    non-contiguous one itself, on every rank of the collective. A numpy output that is not C-contiguous or not in native byte order is
    computed into a scratch array that `finish()` copies into the caller's array, so the caller's
    array always holds the result."""

    def __init__(self, obj: Any, what: str, output: bool = False):
        self.keep: List[Any] = []
        self.copy_into: Any = None
        if isinstance(obj, Buffer):
            self._from_buffer_view(obj)
        elif hasattr(obj, "__array_interface__") and not hasattr(obj, "__dlpack_device__"):
            self._from_numpy(obj, what, output)
        elif hasattr(obj, "__dlpack__"):
            if is_numpy(obj):
                self._from_numpy(obj, what, output)
            else:
                self._from_dlpack(obj, what, output)
        elif _has_buffer(obj):
            self._from_buffer(obj, what, output)
        else:
            raise TypeError(
                f"{what}: expected a numpy array, an object with __dlpack__ or a buffer "
                f"(memoryview, bytearray, array.array), got {type(obj).__name__}"
            )

    def _from_buffer_view(self, b: Buffer) -> None:
        """One of epcomm's own Buffers: its memory described directly (no DLPack export), held
        for the call like an export (its handle's close() is refused meanwhile)."""
        self.keep.append(b)
        self.keep.append(b._hold())
        dims = (ctypes.c_int64 * max(len(b.shape), 1))(*b.shape)
        self.keep.append(dims)
        t = Tensor()
        t.data = b._data or None
        t.device_type, t.device_id = b._device
        t.ndim = len(b.shape)
        t.dtype = b._dtype
        t.shape = ctypes.cast(dims, i64p)
        self.keep.append(t)
        self.ptr = ctypes.pointer(t)

    def _from_buffer(self, obj: Any, what: str, output: bool) -> None:
        """A buffer-protocol object (memoryview, bytearray, array.array, bytes), viewed in
        place: it must be C-contiguous, and writable when it is an output."""
        view = _PyBuffer(obj, what, output)
        self.keep.append(view)
        b = view.view
        if b.ndim and b.shape:
            shape = [b.shape[i] for i in range(b.ndim)]
        else:  # a 0-d or shapeless export: its items as one dimension
            shape = [b.len // max(b.itemsize, 1)]
        dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.keep.append(dims)
        t = Tensor()
        t.data = b.buf
        t.device_type, t.device_id = 1, 0
        t.ndim = len(shape)
        t.dtype = _buffer_dtype(b.format, b.itemsize, what)
        t.shape = ctypes.cast(dims, i64p)
        self.keep.append(t)
        self.ptr = ctypes.pointer(t)

    def _from_dlpack(self, obj: Any, what: str, output: bool) -> None:
        try:
            capsule = obj.__dlpack__(max_version=(1, 0))
        except TypeError:  # a producer older than DLPack 1.0 (no max_version)
            capsule = obj.__dlpack__()
        self.keep.append(capsule)
        name = _capsule_name(capsule)
        if name == b"dltensor_versioned":
            managed = ctypes.POINTER(_ManagedTensorVersioned)
            m = ctypes.cast(_capsule_pointer(capsule, name), managed)
            if m.contents.version.major != 1:
                raise ValueError(
                    f"{what}: its __dlpack__ export has DLPack version "
                    f"{m.contents.version.major}.{m.contents.version.minor}; expected 1.x"
                )
            if output:
                _check_writable_export(m.contents.flags, what)
            self.ptr = ctypes.pointer(m.contents.dl_tensor)
        elif name == b"dltensor":
            # A DLManagedTensor starts with its DLTensor: epcomm_tensor's layout.
            self.ptr = ctypes.cast(_capsule_pointer(capsule, name), ctypes.POINTER(Tensor))
        else:
            raise TypeError(
                f"{what}: __dlpack__ returned a capsule named {name!r}; expected 'dltensor' "
                "or 'dltensor_versioned'"
            )

    def _from_numpy(self, arr: Any, what: str, output: bool) -> None:
        import numpy as np

        native = None
        if output:
            view = np.asarray(arr)  # no copy: the caller's memory
            if not view.flags.writeable:
                raise ValueError(
                    f"{what} is read-only (a numpy array with flags.writeable False, e.g. one "
                    "backed by bytes); expected a writable array to receive the result"
                )
            if not view.dtype.isnative:
                native = view.dtype.newbyteorder("=")
            if native is not None or not view.flags.c_contiguous:
                a = np.empty(view.shape, native or view.dtype)
                self.copy_into = view
            else:
                a = view
        else:
            a = np.asarray(arr)
            if not a.dtype.isnative:
                # The library reads native-order values; convert rather than misread them.
                a = a.astype(a.dtype.newbyteorder("="))
            a = np.ascontiguousarray(a)
        self.keep.append(a)
        shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
        self.keep.append(shape)
        t = Tensor()
        t.data = a.ctypes.data
        t.device_type, t.device_id = 1, 0
        t.ndim = a.ndim
        t.dtype = DType(_NP_CODES.get(a.dtype.kind, 3), a.dtype.itemsize * 8, 1)
        t.shape = ctypes.cast(shape, i64p)
        t.strides = None
        t.byte_offset = 0
        self.keep.append(t)
        self.ptr = ctypes.pointer(t)
        self.array = a

    def finish(self) -> None:
        """After a successful call: copies a temporary output into the caller's array."""
        if self.copy_into is not None:
            self.copy_into[...] = self.array


class _PyBufferStruct(ctypes.Structure):
    """CPython's Py_buffer."""

    _fields_ = [
        ("buf", vp),
        ("obj", vp),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", cp),
        ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)),
        ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", vp),
    ]


_PYBUF_WRITABLE, _PYBUF_FORMAT, _PYBUF_C_CONTIGUOUS = 0x1, 0x4, 0x38
_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.restype, _get_buffer.argtypes = ctypes.c_int, [
    ctypes.py_object, ctypes.POINTER(_PyBufferStruct), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.restype, _release_buffer.argtypes = None, [ctypes.POINTER(_PyBufferStruct)]


def _has_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
        return True
    except TypeError:
        return False


class _PyBuffer:
    """A held Py_buffer export of ``obj`` (C-contiguous, with its format), released when this
    object goes away."""

    def __init__(self, obj: Any, what: str, output: bool):
        self.view = _PyBufferStruct()
        flags = _PYBUF_C_CONTIGUOUS | _PYBUF_FORMAT | (_PYBUF_WRITABLE if output else 0)
        try:
            _get_buffer(obj, ctypes.byref(self.view), flags)
        except BufferError as e:
            m = memoryview(obj)
            why = "read-only" if output and m.readonly else "not C-contiguous"
            raise InvalidArgumentError(
                f"{what} is {why} ({e}); expected a "
                f"{'writable, ' if output else ''}C-contiguous buffer", 2
            ) from None
        self.held = True

    def __del__(self) -> None:
        if getattr(self, "held", False):
            _release_buffer(ctypes.byref(self.view))
            self.held = False


# struct format character -> DLPack type code (bits come from the item size).
_FORMAT_CODES = {"f": 2, "d": 2, "e": 2, "b": 0, "h": 0, "i": 0, "l": 0, "q": 0, "n": 0,
                 "B": 1, "c": 1, "H": 1, "I": 1, "L": 1, "Q": 1, "N": 1, "?": 6}


def _buffer_dtype(fmt: Optional[bytes], itemsize: int, what: str) -> DType:
    text = (fmt or b"B").decode()
    if text[:1] in "@=" or (text[:1] == "<" and sys.byteorder == "little"):
        text = text[1:]
    if len(text) != 1 or text not in _FORMAT_CODES:
        raise InvalidArgumentError(
            f"{what}: buffer format {text!r} is not a native scalar type epcomm reads", 2)
    return DType(_FORMAT_CODES[text], itemsize * 8, 1)


def _check_writable_export(flags: int, what: str) -> None:
    """An output's DLPack 1.0 export must be the tensor's own, writable memory."""
    if flags & _DLPACK_FLAG_READ_ONLY:
        raise ValueError(
            f"{what} is read-only (its __dlpack__ export is flagged read-only); "
            "expected a writable tensor to receive the result"
        )
    if flags & _DLPACK_FLAG_IS_COPIED:
        raise ValueError(
            f"{what} was exported as a copy (its __dlpack__ export is flagged "
            "is_copied), so the result would not reach it; expected a tensor whose "
            "memory is exported as is"
        )


# Canonical dtype name -> (DLPack code, bits).
_DTYPES = {
    "float32": (2, 32),
    "float16": (2, 16),
    "bfloat16": (4, 16),
    "int32": (0, 32),
    "int64": (0, 64),
    "uint8": (1, 8),
}
# Other spellings vLLM configurations, torch and numpy use.
_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "f32": "float32",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bf16": "bfloat16",
    "int": "int32",
    "long": "int64",
}


def dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype given as a string, a torch dtype, a numpy dtype or a numpy
    scalar type; a ValueError (an epcomm.Error) naming the accepted ones otherwise."""
    if isinstance(dtype, str):
        text = dtype
    elif isinstance(getattr(dtype, "name", None), str):  # numpy.dtype
        text = dtype.name
    elif isinstance(dtype, type) and is_numpy_type(dtype):
        text = dtype.__name__
    else:  # torch.float32 prints as "torch.float32"
        text = str(dtype)
    key = text.lower().replace("torch.", "").replace("numpy.", "")
    name = _ALIASES.get(key, key)
    if name not in _DTYPES:
        accepted = ", ".join(sorted(set(_DTYPES) | set(_ALIASES)))
        raise InvalidArgumentError(
            f"unsupported dtype {dtype!r}; expected one of {accepted} (or the torch/numpy dtype)",
            2,
        )
    return name


def is_numpy_type(t: type) -> bool:
    """Whether ``t`` is a numpy scalar type (np.float32), checked without importing numpy."""
    return t.__module__ == "numpy"


def dtype_struct(dtype: Any) -> DType:
    """The epcomm_dtype of a dtype name, torch dtype or numpy dtype."""
    code, bits = _DTYPES[dtype_name(dtype)]
    return DType(code, bits, 1)
