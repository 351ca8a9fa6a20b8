"""epcomm's process groups through ctypes, with real processes as ranks.

Tensors are DLPack DLTensors built from ctypes arrays (no numpy); failing statuses become the
Python exception class vLLM raises (epcomm_status_exception) with epcomm's exact message.
Every multi-process case is bounded: ranks still running at the deadline are terminated and
the test fails. Standard library only:

    EPCOMM_LIBRARY=target/debug/libepcomm.so python3 tests/py/test_group.py -v
"""

import builtins
import ctypes
import os
import sys
import time
import traceback
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from epcomm_testlib import (  # noqa: E402
    DEVICE_CPU,
    DL_FLOAT,
    ERROR_INVALID_ARGUMENT,
    ERROR_TIMEOUT,
    GROUP_SIGNATURES,
    MP,
    GroupOptions,
    Tensor,
    check,
    create_shm,
    group_options,
    load_library,
    run_ranks,
    shm_leftovers,
    text as _text,
    unique_name,
)

SEND_FN = ctypes.CFUNCTYPE(
    ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t
)
RECV_FN = ctypes.CFUNCTYPE(
    ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t
)
ALL_GATHER_FN = ctypes.CFUNCTYPE(
    ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p
)
BARRIER_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)


class HostCallbacks(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("user_data", ctypes.c_void_p),
        ("send", SEND_FN),
        ("recv", RECV_FN),
        ("all_gather", ALL_GATHER_FN),
        ("barrier", BARRIER_FN),
    ]


def _signatures():
    i32, cstr, vp = ctypes.c_int32, ctypes.c_char_p, ctypes.c_void_p
    i64p = ctypes.POINTER(ctypes.c_int64)
    tp = ctypes.POINTER(Tensor)
    opts = ctypes.POINTER(GroupOptions)
    return {
        "epcomm_group_create_host": (
            i32,
            [ctypes.POINTER(HostCallbacks), cstr, i32, i32, opts, ctypes.POINTER(vp)],
        ),
        "epcomm_group_rank": (i32, [vp, ctypes.POINTER(i32)]),
        "epcomm_group_size": (i32, [vp, ctypes.POINTER(i32)]),
        "epcomm_group_all_gatherv": (i32, [vp, tp, i64p, tp]),
        "epcomm_group_reduce_scatterv": (i32, [vp, tp, i64p, tp]),
    }


LIB = load_library(GROUP_SIGNATURES, _signatures())

# Every group name this script uses starts with this (epcomm_testlib.unique_name).
NAME_PREFIX = "pygrp"


# ---- tensors --------------------------------------------------------------------------------


class HostArray:
    """A C array with a DLTensor describing it as `shape` (row-major)."""

    def __init__(self, ctype, code, bits, shape, values=None):
        count = 1
        for d in shape:
            count *= d
        self.count = count
        self.buf = (ctype * max(count, 1))()
        if values is not None:
            assert len(values) == count, (len(values), count)
            for i, v in enumerate(values):
                self.buf[i] = v
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = None
        self.tensor = Tensor(
            data=ctypes.cast(self.buf, ctypes.c_void_p),
            device_type=DEVICE_CPU,
            device_id=0,
            ndim=len(shape),
            dtype_code=code,
            dtype_bits=bits,
            dtype_lanes=1,
            shape=ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64)),
            strides=None,
            byte_offset=0,
        )

    def set_strides(self, strides):
        self.strides = (ctypes.c_int64 * len(strides))(*strides)
        self.tensor.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64))

    def values(self):
        return [self.buf[i] for i in range(self.count)]

    def ref(self):
        return ctypes.byref(self.tensor)


def f32(shape, values=None):
    return HostArray(ctypes.c_float, DL_FLOAT, 32, shape, values)


def counts(values):
    return (ctypes.c_int64 * len(values))(*values)


# ---- group helpers --------------------------------------------------------------------------


def rank_size(g):
    r, s = ctypes.c_int32(-1), ctypes.c_int32(-1)
    check(LIB.epcomm_group_rank(g, ctypes.byref(r)))
    check(LIB.epcomm_group_size(g, ctypes.byref(s)))
    return r.value, s.value


# ---- deterministic data ---------------------------------------------------------------------

COLS = 4


def gather_value(rank, row, col):
    return rank * 100 + row * 10 + col + 0.5


def reduce_value(rank, row, col):
    # Multiples of 1/8 below 3: exact in float32, and so is any sum of a few of them.
    return (((rank + 1) * (row * COLS + col) + 5 * rank) % 23) / 8.0


def check_all_gatherv(g, rank, rows):
    """all_gatherv of float32 rows [rows[rank], COLS]; verifies the gathered output."""
    inp = f32(
        [rows[rank], COLS],
        [gather_value(rank, i, c) for i in range(rows[rank]) for c in range(COLS)],
    )
    out = f32([sum(rows), COLS], [-1.0] * (sum(rows) * COLS))
    check(LIB.epcomm_group_all_gatherv(g, inp.ref(), counts(rows), out.ref()))
    want = [
        gather_value(r, i, c) for r in range(len(rows)) for i in range(rows[r]) for c in range(COLS)
    ]
    if out.values() != want:
        raise AssertionError(
            "all_gatherv rank %d: got %r, expected %r" % (rank, out.values(), want)
        )


def check_reduce_scatterv(g, rank, rows):
    """reduce_scatterv of float32 [sum(rows), COLS]; verifies this rank's slice."""
    world, total = len(rows), sum(rows)
    inp = f32([total, COLS], [reduce_value(rank, i, c) for i in range(total) for c in range(COLS)])
    out = f32([rows[rank], COLS], [-1.0] * (rows[rank] * COLS))
    check(LIB.epcomm_group_reduce_scatterv(g, inp.ref(), counts(rows), out.ref()))
    first = sum(rows[:rank])
    want = [
        sum(reduce_value(r, first + i, c) for r in range(world))
        for i in range(rows[rank])
        for c in range(COLS)
    ]
    if out.values() != want:
        raise AssertionError(
            "reduce_scatterv rank %d: got %r, expected %r" % (rank, out.values(), want)
        )


# ---- rank bodies ----------------------------------------------------------------------------

SHM_WORLD = 3
SHM_GATHER_ROWS = [2, 0, 3]
SHM_REDUCE_ROWS = [1, 3, 0]


def shm_rank(rank, name):
    g = create_shm(name, rank, SHM_WORLD)
    try:
        if rank_size(g) != (rank, SHM_WORLD):
            raise AssertionError("rank/size: %r" % (rank_size(g),))
        check_all_gatherv(g, rank, SHM_GATHER_ROWS)
        check_reduce_scatterv(g, rank, SHM_REDUCE_ROWS)
        # A wrong output shape is a ValueError on every rank, and the group stays usable.
        inp = f32([SHM_GATHER_ROWS[rank], COLS], [0.0] * (SHM_GATHER_ROWS[rank] * COLS))
        bad = f32([sum(SHM_GATHER_ROWS) + 1, COLS])
        try:
            check(LIB.epcomm_group_all_gatherv(g, inp.ref(), counts(SHM_GATHER_ROWS), bad.ref()))
        except ValueError as e:
            if e.epcomm_status != ERROR_INVALID_ARGUMENT or "output" not in str(e):
                raise AssertionError("unexpected error: %r" % (e,))
        else:
            raise AssertionError("all_gatherv with a wrong output shape succeeded")
        check(LIB.epcomm_group_barrier(g))
        # So is a non-contiguous input (rows 2 * COLS elements apart).
        strided = f32([2, COLS], [0.0] * (2 * COLS))
        strided.set_strides([2 * COLS, 1])
        even_out = f32([2 * SHM_WORLD, COLS])
        try:
            check(
                LIB.epcomm_group_all_gatherv(
                    g, strided.ref(), counts([2] * SHM_WORLD), even_out.ref()
                )
            )
        except ValueError as e:
            if e.epcomm_status != ERROR_INVALID_ARGUMENT or "not contiguous" not in str(e):
                raise AssertionError("unexpected error: %r" % (e,))
        else:
            raise AssertionError("all_gatherv with a non-contiguous input succeeded")
        check(LIB.epcomm_group_barrier(g))
        check_all_gatherv(g, rank, [1, 2, 0])
        check(LIB.epcomm_group_barrier(g))
    finally:
        LIB.epcomm_group_destroy(g)
    return None


def missing_rank(rank, name, world):
    """Joins a group whose last rank never arrives; reports what the failure looked like."""
    o = group_options(1.0)
    g = ctypes.c_void_p()
    status = LIB.epcomm_group_create_shm(
        name.encode(), rank, world, ctypes.byref(o), ctypes.byref(g)
    )
    report = {
        "status": status,
        "exception_name": _text(LIB.epcomm_status_exception(status)),
        "message": _text(LIB.epcomm_last_error_message()),
        "handle_written": bool(g.value),
        "raised": None,
    }
    if g.value:
        LIB.epcomm_group_destroy(g)
    try:
        check(status)
    except Exception as e:  # the class is what the test checks
        report["raised"] = (type(e).__name__, str(e))
    return report


class PipeTransport:
    """epcomm_host_callbacks over multiprocessing Pipes: one connection per peer."""

    def __init__(self, conns):
        self.conns = conns
        self.errors = []
        # Kept alive for as long as the group uses them.
        self._send = SEND_FN(self._on_send)
        self._recv = RECV_FN(self._on_recv)
        self.callbacks = HostCallbacks()
        self.callbacks.struct_size = ctypes.sizeof(HostCallbacks)
        self.callbacks.user_data = None
        self.callbacks.send = self._send
        self.callbacks.recv = self._recv
        # all_gather and barrier stay NULL: epcomm builds them from send/recv.

    def _on_send(self, _user_data, peer, data, nbytes):
        try:
            payload = ctypes.string_at(data, nbytes) if nbytes else b""
            self.conns[peer].send_bytes(payload)
            return 0
        except Exception:
            self.errors.append(traceback.format_exc())
            return 1

    def _on_recv(self, _user_data, peer, data, nbytes):
        try:
            payload = self.conns[peer].recv_bytes()
            if len(payload) != nbytes:
                self.errors.append(
                    "recv from %d: got %d bytes, expected %d" % (peer, len(payload), nbytes)
                )
                return 2
            if nbytes:
                ctypes.memmove(data, payload, nbytes)
            return 0
        except Exception:
            self.errors.append(traceback.format_exc())
            return 1


HOST_WORLD = 2


def host_rank(rank, name, conns_by_rank):
    transport = PipeTransport(conns_by_rank[rank])
    g = ctypes.c_void_p()
    o = group_options(20.0)
    check(
        LIB.epcomm_group_create_host(
            ctypes.byref(transport.callbacks),
            name.encode(),
            rank,
            HOST_WORLD,
            ctypes.byref(o),
            ctypes.byref(g),
        )
    )
    try:
        if rank_size(g) != (rank, HOST_WORLD):
            raise AssertionError("rank/size: %r" % (rank_size(g),))
        check_all_gatherv(g, rank, [3, 0])
        check_all_gatherv(g, rank, [2, 5])
        check_reduce_scatterv(g, rank, [0, 4])
        check_reduce_scatterv(g, rank, [3, 2])
        check(LIB.epcomm_group_barrier(g))
    finally:
        LIB.epcomm_group_destroy(g)
    if transport.errors:
        raise AssertionError("transport errors:\n" + "\n".join(transport.errors))
    return None


# ---- tests ----------------------------------------------------------------------------------


# ---- shrink through the epcomm package ------------------------------------------------------

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
SHRINK_WORLD = 4


def _epcomm():
    """The epcomm package of this tree (imported in the rank processes only)."""
    if PACKAGE_DIR not in sys.path:
        sys.path.insert(0, PACKAGE_DIR)
    import epcomm

    return epcomm


def shrink_rank(rank, name):
    """The last rank leaves after a barrier; the others see the failure, agree on the lost
    rank and shrink to a group of three that gathers in the new order."""
    epcomm = _epcomm()
    g = epcomm.Group(name, rank, SHRINK_WORLD, timeout_s=5.0)
    try:
        g.barrier()
        if rank == SHRINK_WORLD - 1:
            g.close()
            return None
        try:
            g.barrier()
        except epcomm.Error as e:
            err = e
        else:
            raise AssertionError("the barrier after rank 3 left succeeded")
        lost = g.lost_ranks()
        with g.shrink(lost) as s:
            gathered = [b[0] for b in s.all_gather(bytes([rank * 10]))]
            return {
                "error": (type(err).__name__, err.status, err.message),
                "lost": lost,
                "new": (s.rank, s.size),
                "gathered": gathered,
            }
    finally:
        g.close()


def shrink_errors_rank(rank, name):
    """A 1-rank group: its own rank cannot be excluded, ranks are checked, and shrinking by
    nothing makes a new group of one."""
    epcomm = _epcomm()
    with epcomm.Group(name, rank, 1) as g:
        out = {"lost": g.lost_ranks()}
        for bad in ([0], [1], [-1]):
            try:
                g.shrink(bad)
            except epcomm.Error as e:
                out[str(bad)] = (type(e).__name__, e.message)
        with g.shrink([]) as s:
            out["new"] = (s.rank, s.size)
            s.barrier()
        return out


class LayoutTest(unittest.TestCase):
    def test_struct_sizes(self):
        self.assertEqual(ctypes.sizeof(Tensor), 48)
        self.assertEqual(Tensor.shape.offset, 24)
        self.assertEqual(Tensor.byte_offset.offset, 40)
        o = GroupOptions()
        check(LIB.epcomm_group_options_init(ctypes.byref(o)))
        self.assertEqual(o.struct_size, ctypes.sizeof(GroupOptions))


class ShmGroupTest(unittest.TestCase):
    def test_all_gatherv_and_reduce_scatterv(self):
        name = unique_name(NAME_PREFIX, "a")
        try:
            run_ranks(shm_rank, range(SHM_WORLD), (name,))
        finally:
            leftovers = shm_leftovers(name)
        self.assertEqual(leftovers, [], "group left shared memory behind")

    def test_missing_rank_times_out(self):
        name = unique_name(NAME_PREFIX, "t")
        world = 3
        control = "/dev/shm/epcomm." + name

        def start_hook(rank):
            # Rank 1 starts once rank 0 created the group, so both wait for rank 2 only.
            if rank == 1:
                end = time.monotonic() + 10
                while not os.path.exists(control) and time.monotonic() < end:
                    time.sleep(0.001)

        try:
            reports = run_ranks(missing_rank, [0, 1], (name, world), start_hook=start_hook)
        finally:
            leftovers = shm_leftovers(name)
        want = ("timed out after 1.0 s waiting for rank(s) 2 to join group '%s' (rank(s) 2 of 3 "
                "missing; joined: rank(s) 0, 1); check that those ranks were started and create "
                "the group with the name '%s' and world_size 3 (a rank that failed first reports "
                "its own error there; two jobs that use one name at the same time are refused, "
                "saying so), or raise the timeout (EPCOMM_TIMEOUT_S, or the group's timeout_s)"
                % (name, name))
        for rank in (0, 1):
            r = reports[rank]
            self.assertEqual(r["status"], ERROR_TIMEOUT, (rank, r))
            self.assertEqual(r["exception_name"], "TimeoutError", (rank, r))
            self.assertEqual(r["message"], want, (rank, r))
            self.assertFalse(r["handle_written"], (rank, r))
            self.assertEqual(r["raised"], ("TimeoutError", want), (rank, r))
            self.assertIs(getattr(builtins, r["raised"][0]), TimeoutError)
        self.assertEqual(leftovers, [], "failed join left shared memory behind")


class ShrinkTest(unittest.TestCase):
    def test_survivors_shrink_after_a_rank_left(self):
        name = unique_name(NAME_PREFIX, "s")
        try:
            got = run_ranks(shrink_rank, range(SHRINK_WORLD), (name,))
        finally:
            leftovers = shm_leftovers(name)
        for rank in range(SHRINK_WORLD - 1):
            r = got[rank]
            msg = (
                "rank 3 of group '%s' left (destroyed its group handle) during barrier "
                "(op #2, seen from rank %d)" % (name, rank)
            )
            self.assertEqual(r["error"], ("RuntimeError", 8, msg), rank)
            self.assertEqual(r["lost"], [3], rank)
            self.assertEqual(r["new"], (rank, 3), rank)
            self.assertEqual(r["gathered"], [0, 10, 20], rank)
        self.assertEqual(leftovers, [], "shrink left shared memory behind")

    def test_shrink_arguments(self):
        name = unique_name(NAME_PREFIX, "e")
        got = run_ranks(shrink_errors_rank, [0], (name,))[0]
        self.assertEqual(got["lost"], [])
        self.assertEqual(
            got["[0]"],
            (
                "ValueError",
                "shrink: excluded [0] holds rank 0, the calling rank of group '%s'; "
                "only the survivors call shrink" % name,
            ),
        )
        self.assertEqual(
            got["[1]"],
            ("ValueError", "shrink: excluded[0] is 1; expected a rank of group '%s' (0..1)" % name),
        )
        self.assertEqual(
            got["[-1]"], ("ValueError", "excluded[0] is -1; expected a non-negative value")
        )
        self.assertEqual(got["new"], (0, 1))
        self.assertEqual(shm_leftovers(name), [])


class HostGroupTest(unittest.TestCase):
    def test_pipe_callbacks(self):
        name = unique_name(NAME_PREFIX, "h")
        a, b = MP.Pipe(duplex=True)
        conns_by_rank = {0: {1: a}, 1: {0: b}}
        try:
            run_ranks(host_rank, range(HOST_WORLD), (name, conns_by_rank))
        finally:
            a.close()
            b.close()
        # A host group uses no shared memory of its own.
        self.assertEqual(shm_leftovers(name), [])


if __name__ == "__main__":
    unittest.main()
