"""Shared plumbing of the ctypes test scripts in tests/py (not a test script itself).

Loads the library named by the EPCOMM_LIBRARY environment variable, declares the ABI structs
the scripts share (DLPack's DLTensor as epcomm_tensor, epcomm_dtype, epcomm_group_options),
turns failing statuses into the Python exception class vLLM raises (epcomm_status_exception)
with epcomm's exact message, creates shared-memory groups, runs ranks as processes with a
deadline, and lists a group's leftovers in /dev/shm. Standard library only.

The scripts run as `python3 tests/py/<script>.py`, so they put their own directory on sys.path
before `import epcomm_testlib`.
"""

import builtins
import ctypes
import multiprocessing
import os
import queue
import sys
import time
import traceback

# ---- statuses and DLPack codes (include/epcomm.h) -------------------------------------------

OK = 0
ERROR_NULL_POINTER = 1
ERROR_INVALID_ARGUMENT = 2
ERROR_ASSERTION = 3
ERROR_NOT_IMPLEMENTED = 4
ERROR_RUNTIME = 5
ERROR_UNAVAILABLE = 6
ERROR_TIMEOUT = 7
ERROR_INTERNAL = 11

DEVICE_CPU = 1
DL_INT = 0
DL_UINT = 1
DL_FLOAT = 2

# ---- structs --------------------------------------------------------------------------------


class Tensor(ctypes.Structure):
    """DLPack's DLTensor (epcomm_tensor), field for field."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("dtype_code", ctypes.c_uint8),
        ("dtype_bits", ctypes.c_uint8),
        ("dtype_lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DType(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
    ]


class GroupOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("timeout_s", ctypes.c_double),
        ("initial_capacity_bytes", ctypes.c_uint64),
        ("max_capacity_bytes", ctypes.c_uint64),
        ("elastic", ctypes.c_bool),
        ("disable_direct_reads", ctypes.c_bool),
    ]


# ---- the library ----------------------------------------------------------------------------

_i32, _cstr, _vp = ctypes.c_int32, ctypes.c_char_p, ctypes.c_void_p
_opts = ctypes.POINTER(GroupOptions)

# What `check` needs; declared on every load.
ERROR_SIGNATURES = {
    "epcomm_last_error_message": (_cstr, []),
    "epcomm_last_error_hint": (_cstr, []),
    "epcomm_status_exception": (_cstr, [_i32]),
}

# What `group_options` and `create_shm` need.
GROUP_SIGNATURES = {
    "epcomm_group_options_init": (_i32, [_opts]),
    "epcomm_group_create_shm": (_i32, [_cstr, _i32, _i32, _opts, ctypes.POINTER(_vp)]),
    "epcomm_group_destroy": (None, [_vp]),
    "epcomm_group_barrier": (_i32, [_vp]),
}

_LIB = None


def load_library(*signature_sets):
    """The library EPCOMM_LIBRARY names (loaded once), with ERROR_SIGNATURES and every
    {name: (restype, argtypes)} in `signature_sets` declared on it."""
    global _LIB
    if _LIB is None:
        path = os.environ.get("EPCOMM_LIBRARY")
        if not path:
            sys.exit("EPCOMM_LIBRARY must name the epcomm shared library (libepcomm.so)")
        _LIB = ctypes.CDLL(path)
        signature_sets = (ERROR_SIGNATURES,) + signature_sets
    for signatures in signature_sets:
        for name, (restype, argtypes) in signatures.items():
            fn = getattr(_LIB, name)
            fn.restype = restype
            fn.argtypes = argtypes
    return _LIB


def text(b):
    """A C string from the library as str (None stays None)."""
    return None if b is None else b.decode("utf-8")


def check(status):
    """Raises the exception vLLM raises for `status`, with epcomm's message; returns on OK.

    The exception carries the status as `epcomm_status` and the last error's hint as
    `epcomm_hint`.
    """
    if status == OK:
        return
    lib = load_library()
    exc_name = text(lib.epcomm_status_exception(status))
    exc = getattr(builtins, exc_name)(text(lib.epcomm_last_error_message()))
    exc.epcomm_status = status
    exc.epcomm_hint = text(lib.epcomm_last_error_hint())
    raise exc


# ---- groups ---------------------------------------------------------------------------------


def group_options(timeout_s):
    """Initialized epcomm_group_options with `timeout_s` (needs GROUP_SIGNATURES)."""
    o = GroupOptions()
    check(load_library().epcomm_group_options_init(ctypes.byref(o)))
    assert o.struct_size == ctypes.sizeof(GroupOptions), (o.struct_size, ctypes.sizeof(o))
    o.timeout_s = timeout_s
    return o


def create_shm(name, rank, world, timeout_s=20.0):
    """Joins shared-memory group `name` as `rank` of `world`; returns the handle."""
    o = group_options(timeout_s)
    g = ctypes.c_void_p()
    check(
        load_library().epcomm_group_create_shm(
            name.encode(), rank, world, ctypes.byref(o), ctypes.byref(g)
        )
    )
    assert g.value, "create_shm succeeded without a handle"
    return g


def shm_leftovers(name):
    """Entries of /dev/shm that belong to group `name`."""
    prefix = "epcomm." + name
    return sorted(
        f for f in os.listdir("/dev/shm") if f == prefix or f.startswith(prefix + ".")
    )


def unique_name(prefix, suffix):
    """A group name unique to this process: `prefix`, the pid, `suffix`."""
    return "%s%d%s" % (prefix, os.getpid(), suffix)


# ---- running ranks as processes -------------------------------------------------------------

# Seconds a multi-process case may take before its ranks are terminated.
RANK_DEADLINE_S = 60.0

# "fork": a rank starts at once (no re-import), so ranks that must meet within a short timeout
# do; the parent never creates a group itself, so children inherit no epcomm state.
MP = multiprocessing.get_context("fork")


def _rank_main(target, rank, results, args):
    try:
        payload = target(rank, *args)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        sys.exit(1)
    results.put((rank, True, payload))


def run_ranks(target, ranks, args=(), deadline_s=RANK_DEADLINE_S, start_hook=None):
    """Runs target(rank, *args) in one process per rank; returns {rank: payload}.

    Raises AssertionError naming every rank that failed, died, or was still running at the
    deadline (those are terminated). `start_hook(rank)` runs in the parent before each start.
    """
    results = MP.Queue()
    procs = {}
    for rank in ranks:
        if start_hook is not None:
            start_hook(rank)
        p = MP.Process(target=_rank_main, args=(target, rank, results, args), daemon=True)
        p.start()
        procs[rank] = p
    got = {}
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            rank, ok, payload = results.get(timeout=0.05)
            got[rank] = (ok, payload)
        except queue.Empty:
            pass
        if len(got) == len(procs) and not any(p.is_alive() for p in procs.values()):
            break
        if any(not p.is_alive() and r not in got for r, p in procs.items()):
            # A rank ended without reporting: give its message a moment, then stop waiting.
            time.sleep(0.2)
            while True:
                try:
                    rank, ok, payload = results.get_nowait()
                    got[rank] = (ok, payload)
                except queue.Empty:
                    break
            if any(not p.is_alive() and r not in got for r, p in procs.items()):
                break
    problems = []
    for rank, p in sorted(procs.items()):
        if p.is_alive():
            p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
            problems.append("rank %d still running after %.0f s; terminated" % (rank, deadline_s))
            continue
        p.join(5)
        if rank not in got:
            problems.append("rank %d ended with exit code %s and no result" % (rank, p.exitcode))
        elif not got[rank][0]:
            problems.append("rank %d failed:\n%s" % (rank, got[rank][1]))
        elif p.exitcode != 0:
            problems.append("rank %d exited with %s" % (rank, p.exitcode))
    results.close()
    if problems:
        raise AssertionError("\n".join(problems))
    return {rank: got[rank][1] for rank in ranks}
