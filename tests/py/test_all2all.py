"""epcomm's MoE dispatch/combine through ctypes, with numpy arrays and real processes as ranks.

numpy arrays cross the ABI as DLPack DLTensors (epcomm_tensor) that point at the arrays' own
memory; the dispatch output's views are read back with np.ctypeslib. Failing statuses become
the Python exception class vLLM raises (epcomm_status_exception) with epcomm's exact message.
Every multi-process case is bounded: ranks still running at the deadline are terminated and the
test fails.

    EPCOMM_LIBRARY=target/debug/libepcomm.so python3 tests/py/test_all2all.py -v

numpy is required (.ci/run installs it); without it this script fails, it does not skip.
"""

import ctypes
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from epcomm_testlib import (  # noqa: E402
    DEVICE_CPU,
    DL_FLOAT,
    DL_INT,
    DL_UINT,
    ERROR_ASSERTION,
    ERROR_INVALID_ARGUMENT,
    ERROR_RUNTIME,
    GROUP_SIGNATURES,
    DType,
    Tensor,
    check,
    create_shm,
    load_library,
    run_ranks,
    shm_leftovers,
    unique_name,
)

try:
    import numpy as np
except ImportError:
    sys.stderr.write(
        "FAIL: tests/py/test_all2all.py needs numpy, which is not importable by %s.\n"
        ".ci/run installs it (python3 -m pip install numpy); install it the same way to run "
        "this test.\n" % sys.executable
    )
    sys.exit(1)

class MoeConfig(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("num_experts", ctypes.c_int64),
        ("num_redundant_experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("hidden_size", ctypes.c_int64),
        ("hidden_dtype", DType),
        ("expert_dtype", DType),
        ("out_dtype", DType),
        ("max_tokens_per_rank", ctypes.c_int64),
        ("extra_row_bytes", ctypes.POINTER(ctypes.c_int64)),
        ("num_extras", ctypes.c_size_t),
        ("apply_router_weight_on_input", ctypes.c_bool),
        ("dispatch_fp8", ctypes.c_int64),
        ("enable_fault_tolerance", ctypes.c_bool),
    ]


class DispatchOutput(ctypes.Structure):
    _fields_ = [
        ("layout", ctypes.c_int32),
        ("received_rows", ctypes.c_int64),
        ("hidden", Tensor),
        ("topk_ids", Tensor),
        ("topk_weights", Tensor),
        ("counts", Tensor),
        ("expert_offsets", Tensor),
        ("src_rank", Tensor),
        ("src_token", Tensor),
        ("extras", ctypes.POINTER(Tensor)),
        ("num_extras", ctypes.c_size_t),
    ]


class Stats(ctypes.Structure):
    _fields_ = [
        ("world_size", ctypes.c_int32),
        ("tokens_sent", ctypes.POINTER(ctypes.c_uint64)),
        ("tokens_received", ctypes.POINTER(ctypes.c_uint64)),
        ("bytes_sent", ctypes.POINTER(ctypes.c_uint64)),
        ("bytes_received", ctypes.POINTER(ctypes.c_uint64)),
        ("combine_bytes_received", ctypes.POINTER(ctypes.c_uint64)),
        ("dispatch_seconds", ctypes.c_double),
        ("combine_seconds", ctypes.c_double),
    ]


def _signatures():
    i32, i64, cstr, vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_char_p, ctypes.c_void_p
    tp = ctypes.POINTER(Tensor)
    cfgp = ctypes.POINTER(MoeConfig)
    return {
        "epcomm_moe_config_init": (i32, [cfgp]),
        "epcomm_all2all_create": (i32, [vp, cstr, cfgp, ctypes.POINTER(vp)]),
        "epcomm_all2all_destroy": (None, [vp]),
        "epcomm_all2all_dispatch": (
            i32,
            [vp, tp, tp, tp, tp, ctypes.c_size_t, ctypes.POINTER(DispatchOutput)],
        ),
        "epcomm_all2all_combine": (i32, [vp, tp, tp]),
        "epcomm_all2all_check_layer": (i32, [vp, i64, i64]),
        "epcomm_all2all_get_stats": (i32, [vp, ctypes.POINTER(Stats)]),
        "epcomm_all2all_layout_name": (cstr, [i32]),
    }


LIB = load_library(GROUP_SIGNATURES, _signatures())

# The EPCOMM_LAYOUT_* values by name, from the library itself (NULL past the last layout).
LAYOUTS = {}
for _code in range(64):
    _name = LIB.epcomm_all2all_layout_name(_code)
    if _name:
        LAYOUTS[_name.decode()] = _code
LAYOUT_REPLICATED = LAYOUTS["REPLICATED"]
LAYOUT_TOKEN_MAJOR = LAYOUTS["TOKEN_MAJOR"]
LAYOUT_EXPERT_MAJOR = LAYOUTS["EXPERT_MAJOR"]
LAYOUT_EXPERT_PACKED = LAYOUTS["EXPERT_PACKED"]
LAYOUT_RANK_MAJOR = LAYOUTS["RANK_MAJOR"]

# Every group name this script uses starts with this (epcomm_testlib.unique_name).
NAME_PREFIX = "pya2a"


def raised(fn, *args):
    """(exception class name, message, status) of what fn(*args) raised, or None."""
    try:
        fn(*args)
    except Exception as e:  # the class is what the tests check
        return (type(e).__name__, str(e), getattr(e, "epcomm_status", None))
    return None


# ---- numpy <-> epcomm_tensor ----------------------------------------------------------------

_DL_CODES = {"f": DL_FLOAT, "i": DL_INT, "u": DL_UINT}
_NP_KINDS = {DL_FLOAT: "f", DL_INT: "i", DL_UINT: "u"}


class NpTensor:
    """An epcomm_tensor describing a C-contiguous numpy array (keeps both alive)."""

    def __init__(self, arr):
        self.arr = np.ascontiguousarray(arr)
        self.shape = (ctypes.c_int64 * max(self.arr.ndim, 1))(*self.arr.shape)
        self.tensor = Tensor(
            data=self.arr.ctypes.data,
            device_type=DEVICE_CPU,
            device_id=0,
            ndim=self.arr.ndim,
            dtype_code=_DL_CODES[self.arr.dtype.kind],
            dtype_bits=self.arr.dtype.itemsize * 8,
            dtype_lanes=1,
            shape=ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64)),
            strides=None,
            byte_offset=0,
        )

    def ref(self):
        return ctypes.byref(self.tensor)


def to_numpy(t):
    """A copy of a view the library returned (host memory, compact row-major)."""
    if t.device_type != DEVICE_CPU or t.dtype_lanes != 1:
        raise AssertionError("view on device %d, lanes %d" % (t.device_type, t.dtype_lanes))
    if t.strides:
        raise AssertionError("view with explicit strides")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    dtype = np.dtype("%s%d" % (_NP_KINDS[t.dtype_code], t.dtype_bits // 8))
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, dtype)
    ctype = np.ctypeslib.as_ctypes_type(dtype)
    ptr = ctypes.cast(t.data + t.byte_offset, ctypes.POINTER(ctype))
    return np.ctypeslib.as_array(ptr, shape=shape).copy()


def f32_dtype():
    return DType(code=DL_FLOAT, bits=32, lanes=1)


def moe_config(num_experts, top_k, hidden, max_tokens):
    c = MoeConfig()
    check(LIB.epcomm_moe_config_init(ctypes.byref(c)))
    assert c.struct_size == ctypes.sizeof(MoeConfig), (c.struct_size, ctypes.sizeof(MoeConfig))
    c.num_experts = num_experts
    c.top_k = top_k
    c.hidden_size = hidden
    c.hidden_dtype = f32_dtype()
    c.expert_dtype = f32_dtype()
    c.out_dtype = f32_dtype()
    c.max_tokens_per_rank = max_tokens
    return c


class Manager:
    """An epcomm_all2all handle over a group."""

    def __init__(self, group, backend, config):
        self.handle = ctypes.c_void_p()
        check(
            LIB.epcomm_all2all_create(
                group, backend.encode(), ctypes.byref(config), ctypes.byref(self.handle)
            )
        )
        assert self.handle.value, "epcomm_all2all_create succeeded without a handle"

    def close(self):
        if self.handle:
            LIB.epcomm_all2all_destroy(self.handle)
            self.handle = None

    def dispatch(self, x, ids, w):
        """Dispatches; returns the output as numpy copies (dict) and the raw struct."""
        tx, tids, tw = NpTensor(x), NpTensor(ids), NpTensor(w)
        out = DispatchOutput()
        check(LIB.epcomm_all2all_dispatch(self.handle, tx.ref(), tids.ref(), tw.ref(), None, 0,
                                          ctypes.byref(out)))
        views = {
            name: to_numpy(getattr(out, name))
            for name in (
                "hidden",
                "topk_ids",
                "topk_weights",
                "counts",
                "expert_offsets",
                "src_rank",
                "src_token",
            )
        }
        views["layout"] = out.layout
        views["received_rows"] = out.received_rows
        views["num_extras"] = out.num_extras
        return views

    def combine(self, y, tokens, hidden):
        out = np.full((tokens, hidden), np.nan, dtype=np.float32)
        ty, to = NpTensor(y), NpTensor(out)
        check(LIB.epcomm_all2all_combine(self.handle, ty.ref(), to.ref()))
        return to.arr

    def check_layer(self, top_k, num_experts):
        check(LIB.epcomm_all2all_check_layer(self.handle, top_k, num_experts))

    def stats(self):
        s = Stats()
        check(LIB.epcomm_all2all_get_stats(self.handle, ctypes.byref(s)))
        n = s.world_size
        return {
            "world_size": n,
            "tokens_sent": [s.tokens_sent[i] for i in range(n)],
            "tokens_received": [s.tokens_received[i] for i in range(n)],
        }


# ---- groups and ranks -----------------------------------------------------------------------


def run_group(test, suffix, body, world, args=()):
    """Runs body(rank, group, *args) on `world` ranks of a fresh shm group; checks /dev/shm."""
    name = unique_name(NAME_PREFIX, suffix)
    try:
        results = run_ranks(_group_rank, range(world), (name, world, body, args))
    finally:
        leftovers = shm_leftovers(name)
    test.assertEqual(leftovers, [], "group left shared memory behind")
    return results


def _group_rank(rank, name, world, body, args):
    g = create_shm(name, rank, world)
    try:
        return body(rank, g, *args)
    finally:
        LIB.epcomm_group_destroy(g)


# ---- (a) the two-rank worked example (R = 2, E = 4, K = 2) --------------------------------------

EX_WORLD, EX_E, EX_K, EX_H, EX_M = 2, 4, 2, 1, 3
EX_X = [np.array([[10], [11], [12]], np.float32), np.array([[20], [21]], np.float32)]
EX_IDS = [
    np.array([[0, 2], [1, 0], [3, -1]], np.int32),
    np.array([[2, 3], [1, -1]], np.int32),
]
EX_W = [
    np.array([[0.5, 0.5], [0.25, 0.75], [1, 0]], np.float32),
    np.array([[0.5, 0.5], [1, 0]], np.float32),
]
EX_OUT = [[20.0, 13.75, 48.0], [70.0, 42.0]]


def example_expert_side(rank, v):
    """Expert e computes (e+1)*x; the holder side as the layout's contract says."""
    el = EX_E // EX_WORLD
    x = v["hidden"]
    if v["layout"] in (LAYOUT_REPLICATED, LAYOUT_TOKEN_MAJOR, LAYOUT_RANK_MAJOR):
        rows = x.reshape(-1, EX_H)
        y = np.zeros_like(rows)
        for k in range(EX_K):
            e = v["topk_ids"][:, k]
            mine = (e >= 0) & (e // el == rank)
            y[mine] += v["topk_weights"][mine, k, None] * (e[mine, None] + 1) * rows[mine]
        return y.reshape(x.shape)
    if v["layout"] == LAYOUT_EXPERT_MAJOR:
        y = np.zeros_like(x)
        for j in range(el):
            n = v["counts"][j]
            y[j, :n] = (rank * el + j + 1) * x[j, :n]
        return y
    if v["layout"] == LAYOUT_EXPERT_PACKED:
        y = np.zeros_like(x)
        off = v["expert_offsets"]
        for j in range(el):
            y[off[j] : off[j + 1]] = (rank * el + j + 1) * x[off[j] : off[j + 1]]
        return y
    raise AssertionError("unexpected layout %d" % v["layout"])


def example_rank(rank, g, backend):
    m = Manager(g, backend, moe_config(EX_E, EX_K, EX_H, EX_M))
    try:
        v = m.dispatch(EX_X[rank], EX_IDS[rank], EX_W[rank])
        stats = m.stats()
        y = example_expert_side(rank, v)
        out = m.combine(y, len(EX_X[rank]), EX_H)
    finally:
        m.close()
    v["out"] = out
    v["stats"] = stats
    return v


# ---- (b) random routing against a numpy reference -------------------------------------------

RND_WORLD, RND_E, RND_K, RND_H, RND_M = 3, 6, 2, 16, 16
RND_T = [7, 0, 16]


def rnd_inputs(rank):
    """Rank `rank`'s tokens: distinct experts per token, some ids masked, one token fully."""
    rng = np.random.default_rng(1000 + rank)
    t = RND_T[rank]
    x = rng.standard_normal((t, RND_H)).astype(np.float32)
    ids = np.empty((t, RND_K), np.int64)
    for i in range(t):
        ids[i] = rng.permutation(RND_E)[:RND_K]
    w = rng.uniform(0.1, 1.0, (t, RND_K)).astype(np.float32)
    ids[3::4, 1] = -1
    if t > 5:
        ids[5, :] = -1
    w[ids < 0] = 0.0
    return x, ids, w


def rnd_experts():
    rng = np.random.default_rng(77)
    a = rng.uniform(0.5, 1.5, (RND_E, RND_H)).astype(np.float32)
    b = rng.uniform(-1.0, 1.0, (RND_E, RND_H)).astype(np.float32)
    return a, b


def rnd_reference(x, ids, w):
    """out[t] = sum_k w[t,k] * (a_e * x[t] + b_e), e = ids[t,k] >= 0, in float32."""
    a, b = rnd_experts()
    out = np.zeros_like(x)
    for k in range(ids.shape[1]):
        e = ids[:, k]
        on = e >= 0
        out[on] += w[on, k, None] * (a[e[on]] * x[on] + b[e[on]])
    return out


def rnd_expert_side(rank, v):
    """REPLICATED / RANK_MAJOR holder side: each row's weighted sum over this rank's experts."""
    a, b = rnd_experts()
    el = RND_E // RND_WORLD
    rows = v["hidden"].reshape(-1, RND_H)
    ids, w = v["topk_ids"], v["topk_weights"]
    y = np.zeros_like(rows)
    for k in range(RND_K):
        e = ids[:, k]
        mine = (e >= 0) & (e // el == rank)
        y[mine] += w[mine, k, None] * (a[e[mine]] * rows[mine] + b[e[mine]])
    return y.reshape(v["hidden"].shape)


def rnd_check_layout(rank, v):
    """The dispatch output row by row: REPLICATED all tokens, RANK_MAJOR regions."""
    el = RND_E // RND_WORLD
    inputs = [rnd_inputs(s) for s in range(RND_WORLD)]
    if v["layout"] == LAYOUT_REPLICATED:
        np.testing.assert_array_equal(v["hidden"], np.concatenate([i[0] for i in inputs]))
        np.testing.assert_array_equal(v["topk_ids"], np.concatenate([i[1] for i in inputs]))
        np.testing.assert_array_equal(v["topk_weights"], np.concatenate([i[2] for i in inputs]))
        assert v["received_rows"] == sum(RND_T), v["received_rows"]
    elif v["layout"] == LAYOUT_RANK_MAJOR:
        assert v["hidden"].shape == (RND_WORLD, RND_M, RND_H), v["hidden"].shape
        ids = v["topk_ids"].reshape(RND_WORLD, RND_M, RND_K)
        for s, (x, sids, sw) in enumerate(inputs):
            goes = ((sids >= 0) & (sids // el == rank)).any(axis=1)
            n = int(goes.sum())
            assert v["counts"][s] == n, (s, v["counts"], n)
            np.testing.assert_array_equal(v["hidden"][s, :n], x[goes])
            np.testing.assert_array_equal(ids[s, :n], sids[goes])
            assert (ids[s, n:] == -1).all(), ("padding rows", s, ids[s, n:])
        assert v["received_rows"] == int(v["counts"].sum())
    else:
        raise AssertionError("unexpected layout %d" % v["layout"])


def random_rank(rank, g, backend):
    m = Manager(g, backend, moe_config(RND_E, RND_K, RND_H, RND_M))
    try:
        m.check_layer(RND_K, RND_E)
        x, ids, w = rnd_inputs(rank)
        for _ in range(2):
            v = m.dispatch(x, ids, w)
            rnd_check_layout(rank, v)
            y = rnd_expert_side(rank, v)
            out = m.combine(y, RND_T[rank], RND_H)
            np.testing.assert_allclose(out, rnd_reference(x, ids, w), rtol=1e-5, atol=1e-5)
    finally:
        m.close()
    return out.shape


# ---- (c) errors as Python exceptions --------------------------------------------------------


def errors_rank(rank, g):
    report = {}
    cfg = moe_config(EX_E, EX_K, EX_H, EX_M)
    report["moonep"] = raised(Manager, g, "moonep", cfg)
    m = Manager(g, "flashinfer_nvlink_one_sided", cfg)
    try:
        report["check_layer"] = raised(m.check_layer, 6, EX_E)
    finally:
        m.close()
    m = Manager(g, "deepep_high_throughput", cfg)
    try:
        w = EX_W[rank].astype(np.float64) if rank == 0 else EX_W[rank]
        report["f64_weights"] = raised(m.dispatch, EX_X[rank], EX_IDS[rank], w)
        # The group and the manager stay usable.
        v = m.dispatch(EX_X[rank], EX_IDS[rank], EX_W[rank])
        report["after"] = m.combine(example_expert_side(rank, v), len(EX_X[rank]), EX_H)
    finally:
        m.close()
    return report


# ---- (d) the epcomm package's combine writes into the caller's array, or refuses it -----------

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "python"))
import epcomm  # noqa: E402  (the package in python/, on the library EPCOMM_LIBRARY names)

PKG_H = 4
PKG_SCALE = np.arange(1, PKG_H + 1, dtype=np.float32)
REJECTED_BY = "combine: rank %d rejected its input (see that rank's error); no data was exchanged"
READ_ONLY = (
    "out is read-only (a numpy array with flags.writeable False, e.g. one backed by bytes); "
    "expected a writable array to receive the result"
)
READ_ONLY_DLPACK = (
    "out is read-only (its __dlpack__ export is flagged read-only); expected a writable tensor "
    "to receive the result"
)
COPIED_DLPACK = (
    "out was exported as a copy (its __dlpack__ export is flagged is_copied), so the result "
    "would not reach it; expected a tensor whose memory is exported as is"
)
# Rank 1 (2 tokens) passes it.
NOT_CONTIGUOUS = (
    "tensor 'output' is not contiguous: strides [8, 2] for shape [2, 4]; expected row-major "
    "strides [4, 1]"
)


class DLPackOnly:
    """A tensor offering only __dlpack__ (as a CPU torch tensor does): the package's DLPack path.
    `copy` is what the producer is told (numpy flags a copied export is_copied)."""

    def __init__(self, arr, copy=None):
        self.arr, self.copy = arr, copy

    def __dlpack__(self, **kw):
        if self.copy is not None:
            kw["copy"] = self.copy
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


class LegacyDLPackOnly(DLPackOnly):
    """A producer older than DLPack 1.0: __dlpack__ takes no max_version."""

    def __dlpack__(self, stream=None):
        return self.arr.__dlpack__()


def pkg_expected(rank):
    return np.array(EX_OUT[rank], np.float32)[:, None] * PKG_SCALE


def pkg_expert_side(rank, v):
    """TOKEN_MAJOR holder side of the worked example: expert e computes (e+1)*x."""
    el = EX_E // EX_WORLD
    rows, ids, w = v["hidden"], v["topk_ids"], v["topk_weights"]
    y = np.zeros_like(rows)
    for k in range(EX_K):
        e = ids[:, k]
        mine = (e >= 0) & (e // el == rank)
        y[mine] += w[mine, k, None] * (e[mine, None] + 1) * rows[mine]
    return y


def pkg_outs(rank, t):
    """(case, out to pass, what to return afterwards) in call order; both ranks make the same
    calls, and a case that is bad on one rank only is good on the other."""
    nan = np.full((t, PKG_H), np.nan, np.float32)
    strided = np.full((t, 2 * PKG_H), -7.0, np.float32)
    dl_strided = np.full((t, 2 * PKG_H), -7.0, np.float32)
    ro = bytes(t * PKG_H * 4)
    ro_dl = np.zeros((t, PKG_H), np.float32)
    ro_dl.flags.writeable = False
    cases = [
        ("c_order", nan.copy(), None),
        ("fortran", np.asfortranarray(nan), None),
        ("strided", strided[:, ::2], strided),
        ("big_endian", nan.astype(">f4"), None),
        ("dlpack", DLPackOnly(nan.copy()), None),
        ("dlpack_legacy", LegacyDLPackOnly(nan.copy()), None),
        ("read_only", np.frombuffer(ro, np.float32).reshape(t, PKG_H) if rank == 0 else nan.copy(),
         ro),
        ("read_only_dlpack", DLPackOnly(ro_dl) if rank == 1 else nan.copy(), None),
        ("copied_dlpack", DLPackOnly(nan.copy(), copy=True) if rank == 0 else nan.copy(), None),
        ("strided_dlpack", DLPackOnly(dl_strided[:, ::2]) if rank == 1 else nan.copy(), dl_strided),
        ("after", nan.copy(), None),
    ]
    return cases


def pkg_combine_rank(rank, name):
    x = EX_X[rank] * PKG_SCALE
    report = {}
    with epcomm.Group(name, rank, EX_WORLD, timeout_s=20) as g:
        m = epcomm.All2All(g, "deepep_high_throughput", num_experts=EX_E, top_k=EX_K,
                           hidden_size=PKG_H, dtype="float32", max_tokens_per_rank=EX_M)
        try:
            for case, out, extra in pkg_outs(rank, len(x)):
                v = m.dispatch(x, EX_IDS[rank], EX_W[rank], views=False)  # numpy copies
                y = pkg_expert_side(rank, v)
                err = None
                try:
                    got = m.combine(y, out)
                    same = got is out
                except Exception as e:  # the class and message are what the test checks
                    err, same = (type(e).__name__, str(e)), None
                arr = out.arr if isinstance(out, DLPackOnly) else out
                report[case] = {
                    "error": err,
                    "same_object": same,
                    "values": np.array(arr, np.float32).tolist(),
                    "extra": bytes(extra) if isinstance(extra, bytes) else
                    (None if extra is None else extra.tolist()),
                }
        finally:
            m.close()
    return report


def pkg_group_rank(rank, name):
    """The package's all_gatherv and reduce_scatterv with big-endian rows."""
    x = (np.arange(6, dtype=np.float32).reshape(3, 2) + 10 * rank).astype(">f4")
    with epcomm.Group(name, rank, EX_WORLD, timeout_s=20) as g:
        gathered = g.all_gatherv(x[: rank + 1], [1, 2])
        reduced = g.reduce_scatterv(x, [1, 2])
    return gathered.astype(np.float32).tolist(), reduced.astype(np.float32).tolist()


def pkg_inputs_rank(rank, name):
    x = EX_X[rank] * PKG_SCALE
    variants = [
        (np.frombuffer(x.tobytes(), np.float32).reshape(x.shape), EX_IDS[rank], EX_W[rank]),
        (np.asfortranarray(x), np.asfortranarray(EX_IDS[rank]), np.asfortranarray(EX_W[rank])),
        (x.astype(">f4"), EX_IDS[rank].astype(">i4"), EX_W[rank].astype(">f4")),
    ]
    results = []
    with epcomm.Group(name, rank, EX_WORLD, timeout_s=20) as g:
        m = epcomm.All2All(g, "deepep_high_throughput", num_experts=EX_E, top_k=EX_K,
                           hidden_size=PKG_H, dtype="float32", max_tokens_per_rank=EX_M)
        try:
            for hx, ids, w in variants:
                v = m.dispatch(hx, ids, w, views=False)  # numpy copies
                out = m.combine(pkg_expert_side(rank, v), np.zeros(x.shape, np.float32))
                results.append(out.tolist())
        finally:
            m.close()
    return results


# ---- FP8 dispatch through the package -----------------------------------------------------------

FP8_H, FP8_T = 256, 2
FP8_BACKENDS = ("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency",
                "deepep_v2", "flashinfer_nvlink_two_sided")


def e4m3_value(c):
    """float8_e4m3fn code -> value (bias 7, 3 mantissa bits; finite codes)."""
    e, m = (c >> 3) & 15, c & 7
    v = m / 512.0 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
    return -v if c & 0x80 else v


def fp8_codes(rank, t):
    """Token t of rank r: e4m3 codes, each 128-block starting with 448, so with the block's
    amax 448 * 2^(2r+t) the quantised codes are these and the scale exactly 2^(2r+t)."""
    return [0x7E if j % 128 == 0 else ((j * 5 + t + rank) % 0x7E) | ((j & 1) << 7)
            for j in range(FP8_H)]


def fp8_rank(rank, name, backend):
    x = np.array([[e4m3_value(c) * 2.0 ** (2 * rank + t) for c in fp8_codes(rank, t)]
                  for t in range(FP8_T)], np.float32)
    ids = np.array([[t, t + 2] for t in range(FP8_T)], np.int32)
    w = np.full((FP8_T, 2), 0.5, np.float32)
    known = {2.0 ** (2 * r + t): fp8_codes(r, t) for r in range(EX_WORLD) for t in range(FP8_T)}
    report = {}
    with epcomm.Group(name, rank, EX_WORLD, timeout_s=20) as g:
        m = epcomm.All2All(g, backend, num_experts=4, top_k=2, hidden_size=FP8_H,
                           dtype="float32", max_tokens_per_rank=3, dispatch_fp8=True)
        try:
            for case, fp8 in (("created", None), ("ue8m0", "ue8m0")):
                v = m.dispatch(x, ids, w, views=False, fp8=fp8)
                q, sc = v["hidden"], v["scales"]
                rows = q.reshape(-1, FP8_H)
                scales = sc.reshape(-1, FP8_H // 128)
                matched = [rows[i].tolist() == known[scales[i][0]]
                           for i in range(len(rows)) if scales[i][0] in known]
                st = m.stats()
                received = int(np.asarray(st["tokens_received"]).sum())
                report[case] = {
                    "dtypes": (str(q.dtype), str(sc.dtype)),
                    "shapes": (list(q.shape), list(sc.shape)),
                    "matched": (len(matched), all(matched), received),
                    "bytes": int(np.asarray(st["bytes_received"]).sum()),
                }
            v = m.dispatch(x, ids, w, views=False, fp8=False)
            report["off"] = (str(v["hidden"].dtype), "scales" in v)
            try:
                m.dispatch(x, ids, w, fp8="e5m2" if rank == 1 else None)
                report["bad"] = None
            except Exception as e:  # the class and message are what the test checks
                report["bad"] = (type(e).__name__, str(e))
        finally:
            m.close()
    return report


# ---- tests ----------------------------------------------------------------------------------


class StructTest(unittest.TestCase):
    def test_struct_sizes(self):
        self.assertEqual(ctypes.sizeof(Tensor), 48)
        self.assertEqual(Tensor.shape.offset, 24)
        self.assertEqual(Tensor.byte_offset.offset, 40)
        c = MoeConfig()
        check(LIB.epcomm_moe_config_init(ctypes.byref(c)))
        self.assertEqual(c.struct_size, ctypes.sizeof(MoeConfig))
        # bfloat16 defaults
        self.assertEqual((c.hidden_dtype.code, c.hidden_dtype.bits), (4, 16))

    def test_numpy_round_trip(self):
        a = np.arange(12, dtype=np.int64).reshape(3, 4)
        t = NpTensor(a)
        np.testing.assert_array_equal(to_numpy(t.tensor), a)


class WorkedExampleTest(unittest.TestCase):
    def run_example(self, backend, suffix):
        return run_group(self, suffix, example_rank, EX_WORLD, (backend,))

    def check_outputs(self, r):
        for rank in range(EX_WORLD):
            self.assertEqual(r[rank]["out"].ravel().tolist(), EX_OUT[rank], rank)
            self.assertEqual(r[rank]["num_extras"], 0)
            self.assertEqual(r[rank]["stats"]["world_size"], EX_WORLD)

    def test_deepep_high_throughput(self):
        r = self.run_example("deepep_high_throughput", "ht")
        self.check_outputs(r)
        want = [
            ([10, 11, 21], [[0, -1], [1, 0], [1, -1]], [[0.5, 0], [0.25, 0.75], [1, 0]]),
            ([10, 12, 20], [[-1, 2], [3, -1], [2, 3]], [[0, 0.5], [1, 0], [0.5, 0.5]]),
        ]
        sent = [[2, 2], [1, 1]]
        received = [[2, 1], [2, 1]]
        for rank, (x, ids, w) in enumerate(want):
            v = r[rank]
            self.assertEqual(v["layout"], LAYOUT_TOKEN_MAJOR)
            self.assertEqual(v["received_rows"], 3)
            self.assertEqual(v["hidden"].shape, (3, 1))
            self.assertEqual(v["hidden"].ravel().tolist(), x)
            self.assertEqual(v["topk_ids"].dtype, np.int64)
            self.assertEqual(v["topk_ids"].tolist(), ids)
            self.assertEqual(v["topk_weights"].dtype, np.float32)
            self.assertEqual(v["topk_weights"].tolist(), w)
            self.assertEqual(v["counts"].dtype, np.int32)
            self.assertEqual(v["counts"].tolist(), [2, 2])
            self.assertEqual(v["expert_offsets"].shape, (0,))
            self.assertEqual(v["stats"]["tokens_sent"], sent[rank])
            self.assertEqual(v["stats"]["tokens_received"], received[rank])

    def test_deepep_low_latency(self):
        r = self.run_example("deepep_low_latency", "ll")
        self.check_outputs(r)
        buckets = [([10, 11], [11, 21]), ([10, 20], [12, 20])]
        sent = [[3, 2], [1, 2]]
        received = [[3, 1], [2, 2]]
        for rank, (b0, b1) in enumerate(buckets):
            v = r[rank]
            self.assertEqual(v["layout"], LAYOUT_EXPERT_MAJOR)
            self.assertEqual(v["received_rows"], 4)
            # [E_local, M*R, H]; rows past counts[j] are unspecified.
            self.assertEqual(v["hidden"].shape, (2, EX_M * EX_WORLD, 1))
            self.assertEqual(v["counts"].tolist(), [2, 2])
            self.assertEqual(v["hidden"][0, :2].ravel().tolist(), b0)
            self.assertEqual(v["hidden"][1, :2].ravel().tolist(), b1)
            self.assertEqual(v["topk_ids"].shape, (0,))
            self.assertEqual(v["stats"]["tokens_sent"], sent[rank])
            self.assertEqual(v["stats"]["tokens_received"], received[rank])


class RandomRoutingTest(unittest.TestCase):
    def test_allgather_reducescatter(self):
        shapes = run_group(self, "ag", random_rank, RND_WORLD, ("allgather_reducescatter",))
        self.assertEqual([shapes[r] for r in range(RND_WORLD)], [(t, RND_H) for t in RND_T])

    def test_flashinfer_nvlink_one_sided(self):
        shapes = run_group(self, "os", random_rank, RND_WORLD, ("flashinfer_nvlink_one_sided",))
        self.assertEqual([shapes[r] for r in range(RND_WORLD)], [(t, RND_H) for t in RND_T])


def empty_receiver_rank(rank, g):
    """Both ranks route only to experts of rank 0: rank 1 receives no rows."""
    m = Manager(g, "deepep_high_throughput", moe_config(4, 2, 1, 3))
    try:
        x = np.array([[1], [2]], np.float32)
        ids = np.array([[0, 1], [1, -1]], np.int32)
        w = np.array([[0.5, 0.5], [1, 0]], np.float32)
        v = m.dispatch(x, ids, w)
        return v["hidden"].shape, v["topk_ids"].shape, v["topk_weights"].shape
    finally:
        m.close()


class EmptyReceiverTest(unittest.TestCase):
    def test_ids_keep_their_shape_when_nothing_arrives(self):
        r = run_group(self, "em", empty_receiver_rank, 2)
        self.assertEqual(r[0], ((4, 1), (4, 2), (4, 2)))
        self.assertEqual(r[1], ((0, 1), (0, 2), (0, 2)))


class ErrorTest(unittest.TestCase):
    def test_errors_map_to_python_exceptions(self):
        r = run_group(self, "er", errors_rank, EX_WORLD)
        for rank in range(EX_WORLD):
            rep = r[rank]
            self.assertEqual(
                rep["moonep"],
                (
                    "RuntimeError",
                    "MoonEP not available. Install it from https://github.com/MoonshotAI/MoonEP.",
                    ERROR_RUNTIME,
                ),
            )
            self.assertEqual(
                rep["check_layer"],
                (
                    "AssertionError",
                    "FlashInfer one-sided communication does not support heterogeneous top_k "
                    "(got 6, was built with 2)",
                    ERROR_ASSERTION,
                ),
            )
            self.assertEqual(rep["after"].ravel().tolist(), EX_OUT[rank])
        cls, msg, status = r[0]["f64_weights"]
        self.assertEqual((cls, status), ("ValueError", ERROR_INVALID_ARGUMENT), msg)
        self.assertIn("topk_weights", msg)
        self.assertIn("float64", msg)
        self.assertEqual(
            r[1]["f64_weights"],
            (
                "ValueError",
                "dispatch: rank 0 rejected its input (see that rank's error); no data was "
                "exchanged",
                ERROR_INVALID_ARGUMENT,
            ),
        )


class PackageCombineTest(unittest.TestCase):
    """epcomm.All2All.combine(expert_output, out) on two process ranks: every writable layout of
    `out` gets the result in place; a read-only one is a ValueError on its rank and the peer's
    combine fails at once; the group stays usable."""

    def test_combine_writes_into_out_or_refuses_it(self):
        name = unique_name(NAME_PREFIX, "pk")
        try:
            r = run_ranks(pkg_combine_rank, range(EX_WORLD), (name,))
        finally:
            leftovers = shm_leftovers(name)
        self.assertEqual(leftovers, [], "group left shared memory behind")
        for rank in range(EX_WORLD):
            want = pkg_expected(rank).tolist()
            t = len(want)
            rep = r[rank]
            for case in ("c_order", "fortran", "strided", "big_endian", "dlpack", "dlpack_legacy",
                         "after"):
                self.assertEqual(rep[case]["error"], None, (rank, case))
                self.assertEqual(rep[case]["values"], want, (rank, case))
                self.assertTrue(rep[case]["same_object"], (rank, case))
            # The strided view's gaps are untouched.
            self.assertEqual(
                np.array(rep["strided"]["extra"])[:, 1::2].tolist(), [[-7.0] * PKG_H] * t, rank
            )
            bad = {"read_only": 0, "read_only_dlpack": 1, "copied_dlpack": 0, "strided_dlpack": 1}
            msgs = {
                "read_only": READ_ONLY,
                "read_only_dlpack": READ_ONLY_DLPACK,
                "copied_dlpack": COPIED_DLPACK,
                "strided_dlpack": NOT_CONTIGUOUS,
            }
            nan_rows = [[None] * PKG_H] * t
            for case, culprit in bad.items():
                got = rep[case]
                if rank == culprit:
                    self.assertEqual(got["error"], ("ValueError", msgs[case]), (rank, case))
                else:
                    self.assertEqual(
                        got["error"], ("ValueError", REJECTED_BY % culprit), (rank, case)
                    )
                # Nothing was written on either rank.
                values = [[None if np.isnan(v) else v for v in row] for row in got["values"]]
                if case == "read_only" and rank == culprit:
                    self.assertEqual(got["extra"], bytes(t * PKG_H * 4), "bytes were written into")
                    self.assertEqual(got["values"], [[0.0] * PKG_H] * t)
                elif case == "read_only_dlpack" and rank == culprit:
                    self.assertEqual(got["values"], [[0.0] * PKG_H] * t)
                elif case == "strided_dlpack" and rank == culprit:
                    self.assertEqual(got["extra"], [[-7.0] * (2 * PKG_H)] * t)
                else:
                    self.assertEqual(values, nan_rows, (rank, case))

    def test_group_collectives_with_big_endian_rows(self):
        name = unique_name(NAME_PREFIX, "pg")
        try:
            r = run_ranks(pkg_group_rank, range(EX_WORLD), (name,))
        finally:
            leftovers = shm_leftovers(name)
        self.assertEqual(leftovers, [], "group left shared memory behind")
        gathered = [[0.0, 1.0], [10.0, 11.0], [12.0, 13.0]]
        sums = [[10.0, 12.0], [14.0, 16.0], [18.0, 20.0]]
        self.assertEqual(r[0], (gathered, sums[:1]))
        self.assertEqual(r[1], (gathered, sums[1:]))

    def test_read_only_and_non_native_inputs_are_read_correctly(self):
        """dispatch inputs are only read: bytes-backed, Fortran-order and big-endian ones give
        the same result as plain arrays."""
        name = unique_name(NAME_PREFIX, "pi")
        try:
            r = run_ranks(pkg_inputs_rank, range(EX_WORLD), (name,))
        finally:
            leftovers = shm_leftovers(name)
        self.assertEqual(leftovers, [], "group left shared memory behind")
        for rank in range(EX_WORLD):
            self.assertEqual(r[rank], [pkg_expected(rank).tolist()] * 3, rank)


class Fp8DispatchTest(unittest.TestCase):
    """All2All(..., dispatch_fp8=True) and dispatch(..., fp8=) on two process ranks in every
    layout: float8_e4m3fn bits (uint8) and float32 scales [rows..., H/128], every received row's
    codes exact, H + H/32 bytes per row; fp8=False goes back to float32; a bad fp8 value is a
    ValueError on its rank and fails the peer's dispatch at once."""

    def test_every_layout(self):
        for backend in FP8_BACKENDS:
            name = unique_name(NAME_PREFIX, "f8")
            try:
                r = run_ranks(fp8_rank, range(EX_WORLD), (name, backend))
            finally:
                leftovers = shm_leftovers(name)
            self.assertEqual(leftovers, [], "group left shared memory behind")
            for rank in range(EX_WORLD):
                rep = r[rank]
                for case in ("created", "ue8m0"):
                    got = rep[case]
                    at = (backend, rank, case)
                    self.assertEqual(got["dtypes"], ("uint8", "float32"), at)
                    qs, ss = got["shapes"]
                    self.assertEqual(ss, qs[:-1] + [FP8_H // 128], at)
                    n, ok, received = got["matched"]
                    self.assertTrue(received > 0 and n == received and ok, (at, got))
                    self.assertEqual(got["bytes"], received * (FP8_H + FP8_H // 32), at)
                self.assertEqual(rep["off"], ("float32", False), backend)
            self.assertEqual(r[1]["bad"], (
                "ValueError",
                "fp8 must be False/'off', True/'e4m3' or 'ue8m0'/'e4m3_ue8m0', not 'e5m2'"))
            self.assertEqual(r[0]["bad"], ("ValueError", "dispatch: rank 1 rejected its input "
                                            "(see that rank's error); no data was exchanged"),
                             backend)


if __name__ == "__main__":
    unittest.main()
