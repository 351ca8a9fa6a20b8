"""epcomm: vLLM's expert-parallel communication layer through ctypes.

Every failing call raises the Python exception class vLLM raises for it (ValueError,
RuntimeError, NotImplementedError, AssertionError, TimeoutError) with vLLM's exact message; the
hint, when there is one, is in the exception's ``hint`` attribute. epcomm's log messages (vLLM's
warnings and infos) go to the ``epcomm`` logger.

Arrays are numpy arrays or any object with ``__dlpack__`` (e.g. CPU torch tensors, including
bfloat16 ones), passed to epcomm without copies.
"""

import builtins
import ctypes
import json
import logging
import os

__all__ = [
    "Error",
    "version",
    "resolve_backend",
    "backends",
    "check_config",
    "config_report",
    "Group",
    "All2All",
    "eplb_rebalance",
    "load_library",
]

logger = logging.getLogger("epcomm")

# ---- the library ----------------------------------------------------------------------------


#: The package version; the library's own is ``version()``.
__version__ = "0.1.0"

_HERE = os.path.dirname(os.path.abspath(__file__))


def _soname():
    """The installed library's SONAME: libepcomm.so.0.MINOR while the version is 0.x."""
    major, minor = __version__.split(".")[:2]
    return f"libepcomm.so.0.{minor}" if major == "0" else f"libepcomm.so.{major}"


def _candidates():
    """(what, path) pairs in the order they are tried; EPCOMM_LIBRARY, when set, is the only one
    (a library asked for by name is not silently replaced by another)."""
    env = os.environ.get("EPCOMM_LIBRARY")
    if env:
        yield "EPCOMM_LIBRARY", env
        return
    yield "the copy carried by the package", os.path.join(_HERE, "libepcomm.so")
    # Bare names: the dynamic loader searches LD_LIBRARY_PATH, its cache (ldconfig) and the
    # default directories.
    yield "the system library path", _soname()
    yield "the system library path", "libepcomm.so"


_LIB = None


def load_library():
    """Loads libepcomm once: the file ``EPCOMM_LIBRARY`` names when it is set, else the copy the
    package carries, else the system library path (the SONAME, then libepcomm.so). Raises
    ImportError listing every attempt when none loads."""
    global _LIB
    if _LIB is not None:
        return _LIB
    errors = []
    for what, path in _candidates():
        if os.sep in path and not os.path.exists(path):
            errors.append(f"{path} ({what}): no such file")
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path} ({what}): {e}")
            continue
        try:
            _declare(lib)
        except AttributeError as e:  # an older libepcomm without a function this one calls
            errors.append(f"{path} ({what}): not this version's library ({e})")
            continue
        _LIB = lib
        _install_log_bridge(lib)
        return lib
    raise ImportError(
        "epcomm cannot load libepcomm. Tried:\n  "
        + "\n  ".join(errors)
        + "\nFix: install the library (make install, then ldconfig, or put its directory on "
        "LD_LIBRARY_PATH), set EPCOMM_LIBRARY to the path of libepcomm.so, or reinstall this "
        "package from a repository with a built library (cargo build --release, then "
        "pip install ./python) so that it carries one."
    )


i32, i64, sz = ctypes.c_int32, ctypes.c_int64, ctypes.c_size_t
vp, cp = ctypes.c_void_p, ctypes.c_char_p
i64p = ctypes.POINTER(ctypes.c_int64)


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    """DLPack's DLTensor (epcomm_tensor)."""

    _fields_ = [
        ("data", vp),
        ("device_type", i32),
        ("device_id", i32),
        ("ndim", i32),
        ("dtype", _DType),
        ("shape", i64p),
        ("strides", i64p),
        ("byte_offset", ctypes.c_uint64),
    ]


class _GroupOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("timeout_s", ctypes.c_double),
        ("initial_capacity_bytes", ctypes.c_uint64),
        ("max_capacity_bytes", ctypes.c_uint64),
        ("elastic", ctypes.c_bool),
        ("disable_direct_reads", ctypes.c_bool),
    ]


class _MoeConfig(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("num_experts", i64),
        ("num_redundant_experts", i64),
        ("top_k", i64),
        ("hidden_size", i64),
        ("hidden_dtype", _DType),
        ("expert_dtype", _DType),
        ("out_dtype", _DType),
        ("max_tokens_per_rank", i64),
        ("extra_row_bytes", i64p),
        ("num_extras", sz),
        ("apply_router_weight_on_input", ctypes.c_bool),
    ]


class _DispatchOutput(ctypes.Structure):
    _fields_ = [
        ("layout", i32),
        ("received_rows", i64),
        ("hidden", _Tensor),
        ("topk_ids", _Tensor),
        ("topk_weights", _Tensor),
        ("counts", _Tensor),
        ("expert_offsets", _Tensor),
        ("src_rank", _Tensor),
        ("src_token", _Tensor),
        ("extras", vp),
        ("num_extras", sz),
    ]


# The dispatch outputs every layout returns (empty where its contract has none), as the C
# struct lists them.
_OUTPUT_TENSORS = tuple(name for name, kind in _DispatchOutput._fields_ if kind is _Tensor)

_LOG_FN = ctypes.CFUNCTYPE(None, i32, cp, vp)


def _declare(lib):
    T = ctypes.POINTER(_Tensor)
    sig = {
        "epcomm_version": (cp, []),
        "epcomm_last_error_message": (cp, []),
        "epcomm_last_error_hint": (cp, []),
        "epcomm_status_exception": (cp, [i32]),
        "epcomm_status_string": (cp, [i32]),
        "epcomm_set_log_callback": (None, [_LOG_FN, vp]),
        "epcomm_set_log_level": (i32, [i32]),
        "epcomm_all2all_backend_resolve": (i32, [cp, ctypes.POINTER(i32)]),
        "epcomm_all2all_backend_name": (cp, [i32]),
        "epcomm_config_check": (i32, [cp]),
        "epcomm_config_check_report": (i32, [cp, ctypes.c_char_p, sz, ctypes.POINTER(sz)]),
        "epcomm_group_options_init": (i32, [ctypes.POINTER(_GroupOptions)]),
        "epcomm_group_create_shm": (i32, [cp, i32, i32, ctypes.POINTER(_GroupOptions), ctypes.POINTER(vp)]),
        "epcomm_group_destroy": (None, [vp]),
        "epcomm_group_rank": (i32, [vp, ctypes.POINTER(i32)]),
        "epcomm_group_size": (i32, [vp, ctypes.POINTER(i32)]),
        "epcomm_group_barrier": (i32, [vp]),
        "epcomm_group_all_gatherv": (i32, [vp, T, i64p, T]),
        "epcomm_group_reduce_scatterv": (i32, [vp, T, i64p, T]),
        "epcomm_moe_config_init": (i32, [ctypes.POINTER(_MoeConfig)]),
        "epcomm_all2all_create": (i32, [vp, cp, ctypes.POINTER(_MoeConfig), ctypes.POINTER(vp)]),
        "epcomm_all2all_destroy": (None, [vp]),
        "epcomm_all2all_dispatch": (i32, [vp, T, T, T, T, sz, ctypes.POINTER(_DispatchOutput)]),
        "epcomm_all2all_combine": (i32, [vp, T, T]),
        "epcomm_cuda_caps": (i32, [ctypes.c_char_p, sz, ctypes.POINTER(sz)]),
        "epcomm_eplb_rebalance": (
            i32,
            [ctypes.POINTER(ctypes.c_float), i64, i64, i64, i64, i64, i64, i64p, i64p],
        ),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


_LEVELS = {1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO, 4: logging.DEBUG}


@_LOG_FN
def _log_bridge(level, message, _user):
    logger.log(_LEVELS.get(level, logging.INFO), message.decode("utf-8", "replace"))


def _install_log_bridge(lib):
    lib.epcomm_set_log_callback(_log_bridge, None)


# ---- errors ---------------------------------------------------------------------------------


class Error:
    """Namespace note: failures raise builtin classes (ValueError, ...) with a ``status`` and a
    ``hint`` attribute; this class only documents that."""


def _check(status):
    if status == 0:
        return
    lib = load_library()
    cls_name = (lib.epcomm_status_exception(status) or b"RuntimeError").decode()
    message = (lib.epcomm_last_error_message() or lib.epcomm_status_string(status)).decode()
    hint = lib.epcomm_last_error_hint()
    exc = getattr(builtins, cls_name, RuntimeError)(message)
    exc.status = status
    exc.hint = hint.decode() if hint else None
    raise exc


def version():
    return load_library().epcomm_version().decode()


# ---- selection and configuration ------------------------------------------------------------


def resolve_backend(name):
    """The canonical all2all backend a vLLM name resolves to (logs vLLM's warnings)."""
    lib = load_library()
    b = i32()
    _check(lib.epcomm_all2all_backend_resolve(name.encode(), ctypes.byref(b)))
    return lib.epcomm_all2all_backend_name(b.value).decode()


def config_report(config):
    """Checks a vLLM-style configuration (dict or JSON) and returns epcomm's report (a dict with
    "ok", the resolution or the error, "warnings" and "infos"); never raises for an invalid one."""
    lib = load_library()
    text = (config if isinstance(config, str) else json.dumps(config)).encode()
    n = sz()
    _check(lib.epcomm_config_check_report(text, None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value + 1)
    _check(lib.epcomm_config_check_report(text, buf, n.value + 1, ctypes.byref(n)))
    return json.loads(buf.value.decode())


def check_config(config):
    """Raises vLLM's exception for the first error of a configuration; returns the report."""
    lib = load_library()
    text = (config if isinstance(config, str) else json.dumps(config)).encode()
    _check(lib.epcomm_config_check(text))
    return config_report(config)


def cuda_caps():
    """What this machine offers the GPU path, as a dict: CUDA driver and devices (compute
    capability, SMs, VMM/IPC support), NCCL and NVRTC (version, file); each part has
    "available" and, when false, a "reason". Never raises for a machine without CUDA."""
    lib = load_library()
    n = sz()
    _check(lib.epcomm_cuda_caps(None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value)
    _check(lib.epcomm_cuda_caps(buf, n.value, ctypes.byref(n)))
    return json.loads(buf.value.decode())


def backends():
    """The resolution of every all2all name vLLM accepts."""
    names = [
        "naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
        "mori_high_throughput", "mori_low_latency", "moonep", "nixl_ep",
        "allgather_reducescatter", "flashinfer_all2allv", "flashinfer_nvlink_two_sided",
        "flashinfer_nvlink_one_sided",
    ]
    return {n: config_report({"all2all_backend": n}) for n in names}


# ---- tensors --------------------------------------------------------------------------------

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
        ("dl_tensor", _Tensor),
    ]


def _capsule_name(capsule):
    get = ctypes.pythonapi.PyCapsule_GetName
    get.restype = cp
    get.argtypes = [ctypes.py_object]
    return get(capsule)


def _capsule_pointer(capsule, name):
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = vp
    get.argtypes = [ctypes.py_object, cp]
    return get(capsule, name)


class _Arg:
    """A tensor argument: keeps what the descriptor points into alive during the call.

    An output (`output=True`) must be writable; one that is not C-contiguous or not in native
    byte order is computed into a temporary array and copied into place by `finish()`, so the
    library only ever writes compact native memory and the caller's array gets the result."""

    def __init__(self, obj, what, output=False):
        self.keep = []
        self.copy_into = None
        if hasattr(obj, "__array_interface__") and not hasattr(obj, "__dlpack_device__"):
            self._from_numpy(obj, what, output)
        elif hasattr(obj, "__dlpack__"):
            if _is_numpy(obj):
                self._from_numpy(obj, what, output)
            else:
                self._from_dlpack(obj, what, output)
        else:
            raise TypeError(
                f"{what}: expected a numpy array or an object with __dlpack__, got "
                f"{type(obj).__name__}"
            )

    def _from_dlpack(self, obj, what, output):
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
            flags = m.contents.flags
            if output and flags & _DLPACK_FLAG_READ_ONLY:
                raise ValueError(
                    f"{what} is read-only (its __dlpack__ export is flagged read-only); "
                    "expected a writable tensor to receive the result"
                )
            if output and flags & _DLPACK_FLAG_IS_COPIED:
                raise ValueError(
                    f"{what} was exported as a copy (its __dlpack__ export is flagged "
                    "is_copied), so the result would not reach it; expected a tensor whose "
                    "memory is exported as is"
                )
            self.ptr = ctypes.pointer(m.contents.dl_tensor)
        elif name == b"dltensor":
            # A DLManagedTensor starts with its DLTensor: epcomm_tensor's layout.
            self.ptr = ctypes.cast(_capsule_pointer(capsule, name), ctypes.POINTER(_Tensor))
        else:
            raise TypeError(
                f"{what}: __dlpack__ returned a capsule named {name!r}; expected 'dltensor' "
                "or 'dltensor_versioned'"
            )

    def _from_numpy(self, arr, what, output):
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
        t = _Tensor()
        t.data = a.ctypes.data
        t.device_type, t.device_id = 1, 0
        t.ndim = a.ndim
        t.dtype = _DType(_NP_CODES.get(a.dtype.kind, 3), a.dtype.itemsize * 8, 1)
        t.shape = ctypes.cast(shape, i64p)
        t.strides = None
        t.byte_offset = 0
        self.keep.append(t)
        self.ptr = ctypes.pointer(t)
        self.array = a

    def finish(self):
        """After a successful call: copies a temporary output into the caller's array."""
        if self.copy_into is not None:
            self.copy_into[...] = self.array


def _is_numpy(obj):
    return type(obj).__module__ == "numpy"


def _dtype_struct(name):
    table = {
        "float32": (2, 32), "float16": (2, 16), "bfloat16": (4, 16),
        "int32": (0, 32), "int64": (0, 64), "uint8": (1, 8),
    }
    code, bits = table[str(name).replace("torch.", "")]
    return _DType(code, bits, 1)


def _to_numpy(t):
    """A numpy copy of an epcomm-owned tensor view (bfloat16 comes back as uint16 bits)."""
    import numpy as np

    shape = tuple(t.shape[i] for i in range(t.ndim))
    n = int(np.prod(shape)) if shape else 1
    kind = {(2, 32): np.float32, (2, 16): np.float16, (4, 16): np.uint16, (0, 32): np.int32,
            (0, 64): np.int64, (1, 8): np.uint8}[(t.dtype.code, t.dtype.bits)]
    if n == 0 or not t.data:
        return np.zeros(shape, kind)
    buf = (ctypes.c_char * (n * np.dtype(kind).itemsize)).from_address(t.data)
    return np.frombuffer(buf, kind).reshape(shape).copy()


# ---- groups and managers --------------------------------------------------------------------


class Group:
    """A process group over shared memory (ranks are processes or threads on one host)."""

    def __init__(self, name, rank, world_size, timeout_s=None):
        lib = load_library()
        opts = _GroupOptions()
        _check(lib.epcomm_group_options_init(ctypes.byref(opts)))
        if timeout_s is not None:
            opts.timeout_s = float(timeout_s)
        h = vp()
        _check(lib.epcomm_group_create_shm(name.encode(), rank, world_size, ctypes.byref(opts), ctypes.byref(h)))
        self._h = h

    @property
    def handle(self):
        return self._h

    @property
    def rank(self):
        r = i32()
        _check(load_library().epcomm_group_rank(self._h, ctypes.byref(r)))
        return r.value

    @property
    def size(self):
        s = i32()
        _check(load_library().epcomm_group_size(self._h, ctypes.byref(s)))
        return s.value

    def barrier(self):
        _check(load_library().epcomm_group_barrier(self._h))

    def all_gatherv(self, x, sizes):
        """Concatenates every rank's rows (numpy) in rank order."""
        import numpy as np

        a = _Arg(np.asarray(x), "x")  # compact, native byte order
        out = np.empty((int(sum(sizes)),) + a.array.shape[1:], a.array.dtype)
        s = (ctypes.c_int64 * len(sizes))(*sizes)
        _check(load_library().epcomm_group_all_gatherv(
            self._h, a.ptr, s, _Arg(out, "out", output=True).ptr))
        return out

    def reduce_scatterv(self, x, sizes):
        """Sums every rank's rows and returns this rank's slice (float32/float16)."""
        import numpy as np

        a = _Arg(np.asarray(x), "x")  # compact, native byte order
        out = np.empty((int(sizes[self.rank]),) + a.array.shape[1:], a.array.dtype)
        s = (ctypes.c_int64 * len(sizes))(*sizes)
        _check(load_library().epcomm_group_reduce_scatterv(
            self._h, a.ptr, s, _Arg(out, "out", output=True).ptr))
        return out

    def close(self):
        if self._h:
            load_library().epcomm_group_destroy(self._h)
            self._h = vp()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class All2All:
    """A MoE dispatch/combine manager for a vLLM all2all backend name."""

    def __init__(self, group, backend, num_experts, top_k, hidden_size, dtype="float32",
                 expert_dtype=None, out_dtype=None, max_tokens_per_rank=0, num_redundant_experts=0,
                 apply_router_weight_on_input=False):
        lib = load_library()
        cfg = _MoeConfig()
        _check(lib.epcomm_moe_config_init(ctypes.byref(cfg)))
        cfg.num_experts, cfg.top_k, cfg.hidden_size = num_experts, top_k, hidden_size
        cfg.num_redundant_experts = num_redundant_experts
        cfg.hidden_dtype = _dtype_struct(dtype)
        cfg.expert_dtype = _dtype_struct(expert_dtype or dtype)
        cfg.out_dtype = _dtype_struct(out_dtype or expert_dtype or dtype)
        cfg.max_tokens_per_rank = max_tokens_per_rank
        cfg.apply_router_weight_on_input = apply_router_weight_on_input
        h = vp()
        _check(lib.epcomm_all2all_create(group.handle, backend.encode(), ctypes.byref(cfg), ctypes.byref(h)))
        self._h = h
        self._group = group  # the group must outlive the manager

    def dispatch(self, hidden, topk_ids, topk_weights):
        """Dispatches this rank's tokens; returns a dict of numpy copies of the layout's outputs."""
        lib = load_library()
        out = _DispatchOutput()
        try:
            args = [_Arg(hidden, "hidden"), _Arg(topk_ids, "topk_ids"),
                    _Arg(topk_weights, "topk_weights")]
        except (TypeError, ValueError):
            # The peers are already in this dispatch: a call the library rejects (no tensors)
            # tells them at once instead of leaving them to time out.
            lib.epcomm_all2all_dispatch(self._h, None, None, None, None, 0, ctypes.byref(out))
            raise
        _check(lib.epcomm_all2all_dispatch(
            self._h, args[0].ptr, args[1].ptr, args[2].ptr, None, 0, ctypes.byref(out)))
        views = {name: _to_numpy(getattr(out, name)) for name in _OUTPUT_TENSORS}
        views["layout"] = out.layout
        views["received_rows"] = out.received_rows
        return views

    def combine(self, expert_output, out):
        """Combines expert outputs (the dispatch output's shape) into `out` ([T, hidden]), in
        place: any writable numpy array (C- or Fortran-order, strided, either byte order) or a
        writable, contiguous __dlpack__ tensor. A read-only `out` is a ValueError on this rank
        and the peers' combine fails at once ("rank R rejected its input")."""
        lib = load_library()
        try:
            a, o = _Arg(expert_output, "expert_output"), _Arg(out, "out", output=True)
        except (TypeError, ValueError):
            # As in dispatch: let the library reject the call so the peers learn of it at once.
            lib.epcomm_all2all_combine(self._h, None, None)
            raise
        _check(lib.epcomm_all2all_combine(self._h, a.ptr, o.ptr))
        o.finish()
        return out

    def close(self):
        if self._h:
            load_library().epcomm_all2all_destroy(self._h)
            self._h = vp()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def eplb_rebalance(weight, num_replicas, num_groups, num_nodes, num_ranks, old_phy2log=None):
    """vLLM's default EPLB policy: weight [layers, logical] → phy2log [layers, num_replicas]."""
    rows = [list(map(float, r)) for r in weight]
    layers, logical = len(rows), len(rows[0])
    w = (ctypes.c_float * (layers * logical))(*[x for r in rows for x in r])
    out = (ctypes.c_int64 * (layers * num_replicas))()
    old = None
    if old_phy2log is not None:
        old = (ctypes.c_int64 * (layers * num_replicas))(*[int(x) for r in old_phy2log for x in r])
    _check(load_library().epcomm_eplb_rebalance(
        w, layers, logical, num_replicas, num_groups, num_nodes, num_ranks, old, out))
    return [list(out[i * num_replicas:(i + 1) * num_replicas]) for i in range(layers)]


from . import eplb_algo  # noqa: E402,F401  (vLLM's EPLB policy steps)
# Loaded at import, so a missing library is reported by `import epcomm` itself.
load_library()
