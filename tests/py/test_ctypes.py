"""epcomm through ctypes, the way a Python binding sees it.

Loads the library named by the EPCOMM_LIBRARY environment variable, turns failing statuses
into the Python exception class vLLM raises (epcomm_status_exception) with epcomm's exact
message, and checks vLLM's messages and warnings. Standard library only:

    EPCOMM_LIBRARY=target/debug/libepcomm.so python3 tests/py/test_ctypes.py -v
"""

import builtins
import ctypes
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from epcomm_testlib import (  # noqa: E402
    DEVICE_CPU,
    DType,
    ERROR_ASSERTION,
    ERROR_INTERNAL,
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_IMPLEMENTED,
    ERROR_NULL_POINTER,
    ERROR_UNAVAILABLE,
    OK,
    check,
    load_library,
    text as _text,
)

LOG_WARN = 2
LOG_INFO = 3

ALL2ALL_ALLGATHER_REDUCESCATTER = 0
ALL2ALL_DEEPEP_LOW_LATENCY = 2
ALL2ALL_FLASHINFER_NVLINK_TWO_SIDED = 7

EPLB_TORCH_GLOO = 1

W1 = (
    "'flashinfer_all2allv' is deprecated and has been renamed to'flashinfer_nvlink_two_sided'."
    " It will be removed in a futurerelease."
)
DBO_MESSAGE = (
    "Microbatching currently only supports the deepep_low_latency, deepep_high_throughput, "
    "nixl_ep all2all backends on this platform. allgather_reducescatter is not supported. To fix "
    "use one of --all2all-backend=deepep_low_latency, --all2all-backend=deepep_high_throughput, "
    "--all2all-backend=nixl_ep and install the matching kernels."
)
FT_MESSAGE = (
    "Fault tolerance requires an FT-capable all2all backend (one of ['deepep_low_latency', "
    "'nixl_ep']), but got 'allgather_reducescatter'."
)
ELASTIC_LB_MESSAGE = (
    "Elastic EP is not compatible with data_parallel_hybrid_lb. Elastic EP supports a single "
    "API server/core client path or data_parallel_external_lb, but not hybrid load balancing."
)

LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_char_p, ctypes.c_void_p)


class NameInfo(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("backend", ctypes.c_int32),
        ("kind", ctypes.c_int32),
        ("layout", ctypes.c_int32),
        ("manager_class", ctypes.c_char_p),
    ]


class EplbSelectRequest(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("communicator", ctypes.c_char_p),
        ("elastic", ctypes.c_bool),
        ("device_type", ctypes.c_int32),
        ("weight_dtypes", ctypes.POINTER(DType)),
        ("num_weight_dtypes", ctypes.c_size_t),
        ("nccl_available", ctypes.c_int32),
        ("nixl_available", ctypes.c_int32),
    ]


def _signatures():
    i32, sz, cstr = ctypes.c_int32, ctypes.c_size_t, ctypes.c_char_p
    return {
        "epcomm_config_check": (i32, [cstr]),
        "epcomm_config_check_report": (
            i32,
            [cstr, ctypes.c_char_p, sz, ctypes.POINTER(sz)],
        ),
        "epcomm_clear_last_error": (None, []),
        "epcomm_status_string": (cstr, [i32]),
        "epcomm_version": (cstr, []),
        "epcomm_abi_version": (i32, []),
        "epcomm_test_panic": (i32, [cstr]),
        "epcomm_set_log_callback": (None, [LOG_FN, ctypes.c_void_p]),
        "epcomm_set_log_level": (i32, [i32]),
        "epcomm_all2all_backend_resolve": (i32, [cstr, ctypes.POINTER(i32)]),
        "epcomm_all2all_backend_is_known": (ctypes.c_bool, [cstr]),
        "epcomm_all2all_backend_name": (cstr, [i32]),
        "epcomm_all2all_backend_manager_class": (cstr, [i32]),
        "epcomm_all2all_backend_layout": (i32, [i32, ctypes.POINTER(i32)]),
        "epcomm_all2all_layout_name": (cstr, [i32]),
        "epcomm_all2all_name_count": (sz, []),
        "epcomm_all2all_name_info": (i32, [sz, ctypes.POINTER(NameInfo)]),
        "epcomm_eplb_communicator_select": (
            i32,
            [ctypes.POINTER(EplbSelectRequest), ctypes.POINTER(i32)],
        ),
        "epcomm_eplb_communicator_name": (cstr, [i32]),
        "epcomm_eplb_communicator_class": (cstr, [i32]),
        "epcomm_cuda_caps": (i32, [ctypes.c_char_p, sz, ctypes.POINTER(sz)]),
    }


# epcomm_last_error_message, epcomm_last_error_hint and epcomm_status_exception come with
# every load (epcomm_testlib.ERROR_SIGNATURES).
LIB = load_library(_signatures())


def resolve(name):
    out = ctypes.c_int32(-77)
    check(LIB.epcomm_all2all_backend_resolve(name.encode(), ctypes.byref(out)))
    return out.value


def config_check(config):
    check(LIB.epcomm_config_check(json.dumps(config).encode()))


def config_report(config):
    text = json.dumps(config).encode()
    size = ctypes.c_size_t(0)
    check(LIB.epcomm_config_check_report(text, None, 0, ctypes.byref(size)))
    buf = ctypes.create_string_buffer(size.value + 1)
    written = ctypes.c_size_t(0)
    check(LIB.epcomm_config_check_report(text, buf, len(buf), ctypes.byref(written)))
    if written.value != size.value:
        raise AssertionError("report length changed: %d != %d" % (written.value, size.value))
    return json.loads(buf.value.decode("utf-8"))


class LogCapture:
    """Installs a ctypes log callback for the duration of a `with` block."""

    def __init__(self):
        self.records = []
        self._callback = LOG_FN(self._on_log)

    def _on_log(self, level, message, _user_data):
        self.records.append((level, message.decode("utf-8")))

    def __enter__(self):
        LIB.epcomm_set_log_callback(self._callback, None)
        return self

    def __exit__(self, *exc):
        LIB.epcomm_set_log_callback(LOG_FN(), None)
        return False


class ExceptionMappingTest(unittest.TestCase):
    def test_unknown_backend_is_value_error(self):
        with self.assertRaises(ValueError) as cm:
            resolve("bogus")
        self.assertEqual(str(cm.exception), "Unknown all2all backend: bogus")
        self.assertEqual(cm.exception.epcomm_status, ERROR_INVALID_ARGUMENT)

    def test_unknown_backend_hint(self):
        with self.assertRaises(ValueError) as cm:
            resolve("flashinfer-nvlink-2s")
        self.assertEqual(str(cm.exception), "Unknown all2all backend: flashinfer-nvlink-2s")
        self.assertIn("flashinfer_nvlink_two_sided", cm.exception.epcomm_hint)

    def test_elastic_ep_hybrid_lb_is_not_implemented_error(self):
        with self.assertRaises(NotImplementedError) as cm:
            config_check(
                {
                    "enable_eplb": True,
                    "enable_elastic_ep": True,
                    "enable_expert_parallel": True,
                    "data_parallel_size": 2,
                    "data_parallel_hybrid_lb": True,
                }
            )
        self.assertEqual(str(cm.exception), ELASTIC_LB_MESSAGE)
        self.assertEqual(cm.exception.epcomm_status, ERROR_NOT_IMPLEMENTED)

    def test_dbo_is_assertion_error(self):
        with self.assertRaises(AssertionError) as cm:
            config_check({"enable_dbo": True})
        self.assertEqual(str(cm.exception), DBO_MESSAGE)
        self.assertEqual(cm.exception.epcomm_status, ERROR_ASSERTION)

    def test_pynccl_unavailable_is_runtime_error(self):
        with self.assertRaises(RuntimeError) as cm:
            config_check(
                {
                    "enable_eplb": True,
                    "enable_expert_parallel": True,
                    "data_parallel_size": 2,
                    "eplb_config": {"use_async": False, "communicator": "pynccl"},
                    "nccl_available": False,
                }
            )
        self.assertEqual(str(cm.exception), "EPLB communicator 'pynccl' requested but unavailable.")
        self.assertEqual(cm.exception.epcomm_status, ERROR_UNAVAILABLE)

    def test_fault_tolerance_is_value_error(self):
        with self.assertRaises(ValueError) as cm:
            config_check({"enable_fault_tolerance": True})
        self.assertEqual(str(cm.exception), FT_MESSAGE)
        config_check(
            {
                "all2all_backend": "deepep_low_latency",
                "enable_dbo": False,
                "enable_fault_tolerance": True,
            }
        )

    def test_elastic_needs_eplb(self):
        with self.assertRaises(ValueError) as cm:
            config_check({"enable_elastic_ep": True})
        self.assertEqual(str(cm.exception), "Elastic EP is only supported with enable_eplb=True.")

    def test_null_pointer_is_value_error(self):
        with self.assertRaises(ValueError) as cm:
            check(LIB.epcomm_config_check(None))
        self.assertEqual(cm.exception.epcomm_status, ERROR_NULL_POINTER)
        self.assertEqual(str(cm.exception), "argument 'config_json' must not be NULL")

    def test_panic_is_runtime_error(self):
        with self.assertRaises(RuntimeError) as cm:
            check(LIB.epcomm_test_panic(b"python says boom"))
        self.assertEqual(str(cm.exception), "python says boom")
        self.assertEqual(cm.exception.epcomm_status, ERROR_INTERNAL)
        # The library still works after a caught panic.
        self.assertEqual(resolve("deepep_low_latency"), ALL2ALL_DEEPEP_LOW_LATENCY)

    def test_status_queries(self):
        self.assertIsNone(LIB.epcomm_status_exception(OK))
        self.assertEqual(_text(LIB.epcomm_status_exception(12345)), "RuntimeError")
        self.assertEqual(_text(LIB.epcomm_status_string(12345)), "unknown status")
        for status in range(0, 12):
            self.assertIsNotNone(LIB.epcomm_status_string(status))
        for status in range(1, 12):
            exc_name = _text(LIB.epcomm_status_exception(status))
            self.assertTrue(issubclass(getattr(builtins, exc_name), Exception), exc_name)

    def test_last_error_lifecycle(self):
        LIB.epcomm_clear_last_error()
        self.assertIsNone(LIB.epcomm_last_error_message())
        self.assertIsNone(LIB.epcomm_last_error_hint())
        with self.assertRaises(ValueError):
            resolve("bogus")
        self.assertEqual(_text(LIB.epcomm_last_error_message()), "Unknown all2all backend: bogus")
        resolve("nixl_ep")  # success leaves the last error alone
        self.assertEqual(_text(LIB.epcomm_last_error_message()), "Unknown all2all backend: bogus")
        LIB.epcomm_clear_last_error()
        self.assertIsNone(LIB.epcomm_last_error_message())


class LoggingTest(unittest.TestCase):
    def test_w1_through_callback(self):
        # The only resolution of 'flashinfer_all2allv' in this process: W1 is logged once per
        # process, so this first resolution must deliver it.
        with LogCapture() as logs:
            self.assertEqual(
                resolve("flashinfer_all2allv"), ALL2ALL_FLASHINFER_NVLINK_TWO_SIDED
            )
        self.assertIn((LOG_WARN, W1), logs.records)

    def test_w2_through_callback(self):
        with LogCapture() as logs:
            self.assertEqual(resolve("pplx"), ALL2ALL_ALLGATHER_REDUCESCATTER)
        self.assertEqual(
            logs.records,
            [
                (
                    LOG_WARN,
                    "The 'pplx' all2all backend has been removed. Falling back to "
                    "'allgather_reducescatter'.",
                )
            ],
        )

    def test_config_check_logs_infos(self):
        with LogCapture() as logs:
            config_check({"all2all_backend": "deepep_low_latency"})
        self.assertIn((LOG_INFO, "Using DeepEPLLAll2AllManager all2all manager."), logs.records)

    def test_callback_removed(self):
        with LogCapture() as logs:
            pass
        resolve("naive")
        self.assertEqual(logs.records, [])


class ReportTest(unittest.TestCase):
    def test_ok_report(self):
        report = config_report({"all2all_backend": "deepep_low_latency"})
        self.assertIs(report["ok"], True)
        self.assertEqual(report["all2all_backend"], "deepep_low_latency")
        self.assertEqual(report["manager_class"], "DeepEPLLAll2AllManager")
        self.assertEqual(report["layout"], "EXPERT_MAJOR")
        self.assertIsInstance(report["warnings"], list)
        self.assertIsInstance(report["infos"], list)

    def test_failure_report(self):
        report = config_report({"enable_dbo": True})
        self.assertIs(report["ok"], False)
        self.assertEqual(report["exception"], "AssertionError")
        self.assertEqual(report["status"], ERROR_ASSERTION)
        self.assertEqual(report["message"], DBO_MESSAGE)

    def test_removed_name_warning_in_report(self):
        report = config_report({"all2all_backend": "naive"})
        self.assertIs(report["ok"], True)
        self.assertIn(
            "The 'naive' all2all backend has been removed. Falling back to "
            "'allgather_reducescatter'.",
            report["warnings"],
        )

    def test_eplb_report(self):
        report = config_report(
            {
                "enable_eplb": True,
                "enable_expert_parallel": True,
                "data_parallel_size": 2,
                "eplb_config": {"use_async": False},
                "nixl_available": False,
            }
        )
        self.assertIs(report["ok"], True)
        self.assertEqual(report["eplb_communicator"], "torch_gloo")
        self.assertEqual(report["eplb_communicator_class"], "TorchDistGlooStagedEplbCommunicator")


class QueryTest(unittest.TestCase):
    def test_cuda_caps(self):
        # Size query, too small a buffer (an error, nothing written), then the JSON.
        n = ctypes.c_size_t()
        check(LIB.epcomm_cuda_caps(None, 0, ctypes.byref(n)))
        self.assertGreater(n.value, 2)
        small = ctypes.create_string_buffer(b"x", 2)
        self.assertEqual(LIB.epcomm_cuda_caps(small, 2, ctypes.byref(n)), ERROR_INVALID_ARGUMENT)
        self.assertEqual(small.value, b"x")
        buf = ctypes.create_string_buffer(n.value)
        check(LIB.epcomm_cuda_caps(buf, n.value, ctypes.byref(n)))
        caps = json.loads(buf.value.decode())
        for part in ("cuda", "nccl", "nvrtc"):
            self.assertIsInstance(caps[part]["available"], bool, caps)
            if not caps[part]["available"]:
                self.assertTrue(caps[part]["reason"], caps)

    def test_versions(self):
        version = _text(LIB.epcomm_version())
        self.assertRegex(version, r"^\d+\.\d+\.\d+$")
        self.assertEqual(LIB.epcomm_abi_version(), 1)

    def test_names(self):
        count = LIB.epcomm_all2all_name_count()
        self.assertEqual(count, 14)
        names = []
        for i in range(count):
            info = NameInfo()
            check(LIB.epcomm_all2all_name_info(i, ctypes.byref(info)))
            names.append(_text(info.name))
            self.assertTrue(LIB.epcomm_all2all_backend_is_known(info.name))
            self.assertEqual(
                info.manager_class, LIB.epcomm_all2all_backend_manager_class(info.backend)
            )
        self.assertIn("flashinfer_all2allv", names)
        self.assertIn("moonep", names)
        with self.assertRaises(ValueError):
            check(LIB.epcomm_all2all_name_info(count, ctypes.byref(NameInfo())))

    def test_eplb_select(self):
        req = EplbSelectRequest()
        req.struct_size = ctypes.sizeof(EplbSelectRequest)
        req.device_type = DEVICE_CPU
        out = ctypes.c_int32(-77)
        check(LIB.epcomm_eplb_communicator_select(ctypes.byref(req), ctypes.byref(out)))
        self.assertEqual(out.value, EPLB_TORCH_GLOO)
        req.communicator = b"pynccl"
        req.nccl_available = 1
        out.value = -77
        with self.assertRaises(RuntimeError) as cm:
            check(LIB.epcomm_eplb_communicator_select(ctypes.byref(req), ctypes.byref(out)))
        self.assertEqual(
            str(cm.exception),
            "EPLB communicator 'pynccl' supports only cuda-like devices (got cpu).",
        )
        self.assertEqual(out.value, -77)


if __name__ == "__main__":
    unittest.main()
