"""Zero-copy views in the epcomm package: ``Group.alloc`` (shared memory every peer maps, a
DLPack Buffer) and ``All2All.expert_output_buffer()`` (the manager's window combine reads in
place). Combine from either, or from a torch tensor over them, gives exactly the bytes of
combine from a private numpy copy for every backend on 2 and 4 thread ranks and 2 process
ranks; ``zero_copy_combines`` counts the in-place ones; misuse raises with the library's
message; nothing is left in /dev/shm.

    PYTHONPATH=python EPCOMM_LIBRARY=target/debug/libepcomm.so python3 tests/py/test_mem.py -v

numpy is required; torch is used when importable (tests/python.rs runs this with torch; without
it the torch paths are left out, and EPCOMM_REQUIRE_TORCH=1 makes its absence a failure).
"""

import gc
import multiprocessing
import os
import threading
import unittest

import numpy as np

import epcomm

try:
    import torch
except ImportError:
    torch = None
    if os.environ.get("EPCOMM_REQUIRE_TORCH") == "1":
        raise

BACKENDS = (
    "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
    "flashinfer_nvlink_two_sided",
)
H, K, T = 16, 2, 5


def unique(tag):
    return f"pymem-{tag}-{os.getpid()}-{threading.get_ident() % 100000}"


def leftovers(name):
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"epcomm.{name}")]


def inputs(rank, e):
    x = ((np.arange(T * H, dtype=np.float32) * 7 + rank) % 13 - 6).reshape(T, H)
    ids = ((np.arange(T * K) * 3 + rank + np.arange(T * K) // K) % e).astype(np.int64)
    w = (0.25 + 0.25 * (np.arange(T * K) % 3)).astype(np.float32)
    return x, ids.reshape(T, K), w.reshape(T, K)


def combine_paths(g, backend):
    """Combine of the same expert outputs (twice the dispatched rows) from a numpy copy, the
    expert-output buffer, a torch tensor over it, and Group.alloc memory: the outputs and the
    in-place count."""
    world = g.size
    e = 2 * world
    x, ids, w = inputs(g.rank, e)
    outs = []
    with epcomm.All2All(g, backend, e, K, H, "float32", max_tokens_per_rank=T) as a:
        for path in range(4 if torch is not None else 3):
            d = a.dispatch(x, ids, w)
            y = 2 * np.asarray(d["hidden"]).reshape(-1, H)
            out = np.zeros((T, H), np.float32)
            if path == 0:
                a.combine(y.copy(), out)
            elif path == 1:
                buf = a.expert_output_buffer()
                np.asarray(buf)[...] = y
                a.combine(buf, out)
            elif path == 2:
                mem = g.alloc(y.shape, "float32")
                np.asarray(mem)[...] = y
                a.combine(mem, out)
            else:
                t = torch.from_dlpack(a.expert_output_buffer())
                t.copy_(torch.from_numpy(y))
                a.combine(t, out)
                del t
            outs.append(out)
        return outs, a.zero_copy_combines()


def check_rank(g):
    """Every backend's paths on this rank: byte-identical, in-place count as expected."""
    for b in BACKENDS:
        outs, n = combine_paths(g, b)
        for p, o in enumerate(outs[1:], 1):
            if o.tobytes() != outs[0].tobytes():
                raise AssertionError(f"{b} rank {g.rank}: path {p} differs")
        want = 2 if torch is not None else 1
        if n != want:
            raise AssertionError(f"{b} rank {g.rank}: {n} in-place combines, expected {want}")
    g.barrier()


def thread_ranks(world, fn):
    name = unique(f"t{world}")
    errors = {}

    def body(rank):
        try:
            with epcomm.Group(name, rank, world, timeout_s=30) as g:
                fn(g)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors[rank] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[min(errors)]
    return name


def _proc_rank(name, rank, q):
    try:
        with epcomm.Group(name, rank, 2, timeout_s=30) as g:
            check_rank(g)
        q.put((rank, None))
    except BaseException as e:  # noqa: BLE001 -- sent to the parent
        q.put((rank, repr(e)))


class ZeroCopy(unittest.TestCase):
    def test_two_thread_ranks(self):
        self.assertEqual(leftovers(thread_ranks(2, check_rank)), [])

    def test_four_thread_ranks(self):
        self.assertEqual(leftovers(thread_ranks(4, check_rank)), [])

    def test_two_process_ranks(self):
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        name = unique("p2")
        procs = [ctx.Process(target=_proc_rank, args=(name, r, q)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(q.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        self.assertEqual(results, {0: None, 1: None})
        self.assertEqual(leftovers(name), [])


class Alloc(unittest.TestCase):
    def test_alloc_buffers_and_misuse(self):
        name = unique("alloc")
        g = epcomm.Group(name, 0, 1)
        b = g.alloc(64)
        self.assertEqual((b.shape, b.dtype), ((64,), "uint8"))
        self.assertEqual(np.asarray(b).tobytes(), bytes(64))
        f = g.alloc((3, 4), "bfloat16")
        self.assertEqual((f.shape, f.dtype, f.nbytes), ((3, 4), "bfloat16", 24))
        with self.assertRaises(epcomm.InvalidArgumentError) as c:
            g.alloc(0)
        self.assertEqual(str(c.exception), "bytes is 0: expected at least 1")
        with self.assertRaises(ValueError) as c:
            g.alloc(7, "float32")
        self.assertEqual(str(c.exception), "7 bytes is not a whole number of float32 elements")
        if torch is not None:
            t = torch.from_dlpack(f)
            t.fill_(1.5)
            self.assertEqual(np.asarray(f).view(np.uint16).tolist(), [[0x3FC0] * 4] * 3)
            del f
            gc.collect()
            # The tensor keeps the memory: close is refused while it lives.
            with self.assertRaises(ValueError) as c:
                g.close()
            self.assertIn("live buffers from Group.alloc", str(c.exception))
            self.assertEqual(float(t.float().sum()), 18.0)
            del t
        else:
            del f
        del b
        gc.collect()
        g.close()
        self.assertEqual(leftovers(name), [])

    def test_no_shared_memory(self):
        name = unique("direct0")
        os.environ["EPCOMM_SHM_DIRECT"] = "0"
        try:
            g = epcomm.Group(name, 0, 1)
        finally:
            del os.environ["EPCOMM_SHM_DIRECT"]
        with g:
            with self.assertRaises(RuntimeError) as c:
                g.alloc(16)
            self.assertEqual(
                str(c.exception),
                f"group '{name}' has no shared memory to allocate from: only a shared-memory "
                "group with EPCOMM_SHM_DIRECT=1 (the default) maps windows into its peers; use "
                "ordinary memory with this group",
            )
            with epcomm.All2All(g, "deepep_high_throughput", 2, 1, H, "float32") as a:
                x, ids, w = inputs(0, 2)
                a.dispatch(x, ids[:, :1].copy(), w[:, :1].copy())
                with self.assertRaises(RuntimeError) as c:
                    a.expert_output_buffer()
                self.assertIn("has no shared memory for an expert-output buffer", str(c.exception))
        self.assertEqual(leftovers(name), [])

    def test_expert_output_buffer_before_dispatch(self):
        name = unique("before")
        with epcomm.Group(name, 0, 1) as g:
            with epcomm.All2All(g, "deepep_low_latency", 2, 1, H, "float32",
                                max_tokens_per_rank=4) as a:
                with self.assertRaises(RuntimeError) as c:
                    a.expert_output_buffer()
                self.assertEqual(
                    str(c.exception),
                    "expert_output_buffer called without a successful dispatch: call dispatch "
                    "first",
                )
                self.assertEqual(a.zero_copy_combines(), 0)


if __name__ == "__main__":
    unittest.main()
