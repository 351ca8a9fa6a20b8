"""Loading libepcomm and declaring its C ABI (include/epcomm.h) for ctypes."""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Iterator, Optional, Tuple

#: The package's version (setuptools reads it here); ``epcomm.__version__`` is the loaded
#: library's own, which a package carrying its library matches.
PACKAGE_VERSION = "0.1.0"

logger = logging.getLogger("epcomm")

_HERE = os.path.dirname(os.path.abspath(__file__))


def _soname() -> str:
    """The installed library's SONAME: libepcomm.so.0.MINOR while the version is 0.x."""
    major, minor = PACKAGE_VERSION.split(".")[:2]
    return f"libepcomm.so.0.{minor}" if major == "0" else f"libepcomm.so.{major}"


def _candidates() -> Iterator[Tuple[str, str]]:
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


_LIB: Optional[ctypes.CDLL] = None


def load_library() -> ctypes.CDLL:
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
        lib.epcomm_set_log_callback(_log_bridge, None)
        return lib
    raise ImportError(
        "epcomm cannot load libepcomm. Tried:\n  "
        + "\n  ".join(errors)
        + "\nFix: install the library (make install, then ldconfig, or put its directory on "
        "LD_LIBRARY_PATH), set EPCOMM_LIBRARY to the path of libepcomm.so, or reinstall this "
        "package from a repository with a built library (cargo build --release, then "
        "pip install ./python) so that it carries one."
    )


i32 = ctypes.c_int32
i64 = ctypes.c_int64
sz = ctypes.c_size_t
vp = ctypes.c_void_p
cp = ctypes.c_char_p
i64p = ctypes.POINTER(ctypes.c_int64)

#: EPCOMM_UNIQUE_ID_BYTES.
UNIQUE_ID_BYTES = 128
#: EPCOMM_DEVICE_CPU.
DEVICE_CPU = 1


class DType(ctypes.Structure):
    """epcomm_dtype (DLPack's DLDataType)."""

    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class Tensor(ctypes.Structure):
    """DLPack's DLTensor (epcomm_tensor)."""

    _fields_ = [
        ("data", vp),
        ("device_type", i32),
        ("device_id", i32),
        ("ndim", i32),
        ("dtype", DType),
        ("shape", i64p),
        ("strides", i64p),
        ("byte_offset", ctypes.c_uint64),
    ]


class GroupOptions(ctypes.Structure):
    """epcomm_group_options."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("timeout_s", ctypes.c_double),
        ("initial_capacity_bytes", ctypes.c_uint64),
        ("max_capacity_bytes", ctypes.c_uint64),
        ("elastic", ctypes.c_bool),
        ("disable_direct_reads", ctypes.c_bool),
    ]


class UniqueId(ctypes.Structure):
    """epcomm_unique_id: plain bytes one rank makes and the host passes to the others."""

    _fields_ = [("internal", ctypes.c_uint8 * UNIQUE_ID_BYTES)]


SEND_FN = ctypes.CFUNCTYPE(i32, vp, i32, vp, sz)
RECV_FN = ctypes.CFUNCTYPE(i32, vp, i32, vp, sz)
ALL_GATHER_FN = ctypes.CFUNCTYPE(i32, vp, vp, sz, vp)
BARRIER_FN = ctypes.CFUNCTYPE(i32, vp)
LOST_RANKS_FN = ctypes.CFUNCTYPE(i32, vp, ctypes.POINTER(ctypes.c_uint8), i32)
SHRINK_FN = ctypes.CFUNCTYPE(i32, vp, ctypes.POINTER(i32), sz, ctypes.POINTER(vp))
ALL_TO_ALLV_FN = ctypes.CFUNCTYPE(i32, vp, vp, ctypes.POINTER(sz), vp, ctypes.POINTER(sz))


class HostCallbacks(ctypes.Structure):
    """epcomm_host_callbacks."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("user_data", vp),
        ("send", SEND_FN),
        ("recv", RECV_FN),
        ("all_gather", ALL_GATHER_FN),
        ("barrier", BARRIER_FN),
        ("lost_ranks", LOST_RANKS_FN),
        ("shrink", SHRINK_FN),
        ("all_to_allv", ALL_TO_ALLV_FN),
    ]


class MoeConfig(ctypes.Structure):
    """epcomm_moe_config."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("num_experts", i64),
        ("num_redundant_experts", i64),
        ("top_k", i64),
        ("hidden_size", i64),
        ("hidden_dtype", DType),
        ("expert_dtype", DType),
        ("out_dtype", DType),
        ("max_tokens_per_rank", i64),
        ("extra_row_bytes", i64p),
        ("num_extras", sz),
        ("apply_router_weight_on_input", ctypes.c_bool),
        ("dispatch_fp8", i64),
        ("enable_fault_tolerance", ctypes.c_bool),
    ]


class GpuStats(ctypes.Structure):
    """epcomm_gpu_all2all_stats."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("pool_buffers", ctypes.c_uint64),
        ("pool_bytes", ctypes.c_uint64),
        ("pool_reserved_bytes", ctypes.c_uint64),
        ("pool_reallocations", ctypes.c_uint64),
    ]


class DispatchOutput(ctypes.Structure):
    """epcomm_dispatch_output."""

    _fields_ = [
        ("layout", i32),
        ("received_rows", i64),
        ("hidden", Tensor),
        ("topk_ids", Tensor),
        ("topk_weights", Tensor),
        ("counts", Tensor),
        ("expert_offsets", Tensor),
        ("src_rank", Tensor),
        ("src_token", Tensor),
        ("extras", vp),
        ("num_extras", sz),
    ]


class EplbSelectRequest(ctypes.Structure):
    """epcomm_eplb_select_request."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("communicator", cp),
        ("elastic", ctypes.c_bool),
        ("device_type", i32),
        ("weight_dtypes", ctypes.POINTER(DType)),
        ("num_weight_dtypes", sz),
        ("nccl_available", i32),
        ("nixl_available", i32),
    ]


class EplbSummary(ctypes.Structure):
    """epcomm_eplb_summary: what a rearrangement did."""

    _fields_ = [
        ("layers_changed", i64),
        ("rows_sent", i64),
        ("rows_received", i64),
        ("rows_copied_locally", i64),
    ]


class All2AllStats(ctypes.Structure):
    """epcomm_all2all_stats: arrays of world_size entries, valid until the manager's next call."""

    _fields_ = [
        ("world_size", i32),
        ("tokens_sent", ctypes.POINTER(ctypes.c_uint64)),
        ("tokens_received", ctypes.POINTER(ctypes.c_uint64)),
        ("bytes_sent", ctypes.POINTER(ctypes.c_uint64)),
        ("bytes_received", ctypes.POINTER(ctypes.c_uint64)),
        ("combine_bytes_received", ctypes.POINTER(ctypes.c_uint64)),
        ("dispatch_seconds", ctypes.c_double),
        ("combine_seconds", ctypes.c_double),
    ]


class RearrangeOptions(ctypes.Structure):
    """epcomm_eplb_rearrange_options: the rank mapping and migration batching of a
    rearrangement (initialised by epcomm_eplb_rearrange_options_init)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("rank_mapping", i64p),
        ("rank_mapping_len", ctypes.c_size_t),
        ("migration_batching", ctypes.c_bool),
    ]


class PlanView(ctypes.Structure):
    """epcomm_eplb_plan_view: views of a layer plan, valid until the plan is destroyed."""

    _fields_ = [
        ("num_slots", i64),
        ("unchanged", ctypes.POINTER(ctypes.c_uint8)),
        ("local_copies", i64p),
        ("num_local_copies", i64),
        ("sends", i64p),
        ("num_sends", i64),
        ("recvs", i64p),
        ("num_recvs", i64),
        ("duplicates", i64p),
        ("num_duplicates", i64),
    ]


class NameDesc(ctypes.Structure):
    """epcomm_all2all_name_desc: one name vLLM accepts as an all2all backend."""

    _fields_ = [
        ("name", cp),
        ("backend", i32),
        ("kind", i32),
        ("layout", i32),
        ("manager_class", cp),
    ]


class P2POp(ctypes.Structure):
    """epcomm_p2p_op: one send (EPCOMM_P2P_SEND = 0) or receive (1) of a batch."""

    _fields_ = [("kind", i32), ("peer", i32), ("tensor", ctypes.POINTER(Tensor))]


LOG_FN = ctypes.CFUNCTYPE(None, i32, cp, vp)


def _signatures() -> dict:
    T = ctypes.POINTER(Tensor)
    P = ctypes.POINTER
    opts = P(GroupOptions)
    return {
        "epcomm_version": (cp, []),
        "epcomm_last_error_message": (cp, []),
        "epcomm_last_error_message_torch": (cp, []),
        "epcomm_last_error_hint": (cp, []),
        "epcomm_clear_last_error": (None, []),
        "epcomm_status_exception": (cp, [i32]),
        "epcomm_status_string": (cp, [i32]),
        "epcomm_set_log_callback": (None, [LOG_FN, vp]),
        "epcomm_set_log_level": (i32, [i32]),
        "epcomm_all2all_backend_resolve": (i32, [cp, P(i32)]),
        "epcomm_all2all_backend_name": (cp, [i32]),
        "epcomm_config_check": (i32, [cp]),
        "epcomm_config_check_report": (i32, [cp, cp, sz, P(sz)]),
        "epcomm_group_options_init": (i32, [opts]),
        "epcomm_group_create_shm": (i32, [cp, i32, i32, opts, P(vp)]),
        "epcomm_group_unique_id": (i32, [P(UniqueId)]),
        "epcomm_group_create_shm_unique": (i32, [P(UniqueId), i32, i32, opts, P(vp)]),
        "epcomm_group_create_host": (i32, [P(HostCallbacks), cp, i32, i32, opts, P(vp)]),
        "epcomm_group_destroy": (None, [vp]),
        "epcomm_group_destroy_checked": (i32, [vp]),
        "epcomm_group_rank": (i32, [vp, P(i32)]),
        "epcomm_group_size": (i32, [vp, P(i32)]),
        "epcomm_group_barrier": (i32, [vp]),
        "epcomm_group_all_gatherv": (i32, [vp, T, i64p, T]),
        "epcomm_group_reduce_scatterv": (i32, [vp, T, i64p, T]),
        "epcomm_moe_config_init": (i32, [P(MoeConfig)]),
        "epcomm_all2all_create": (i32, [vp, cp, P(MoeConfig), P(vp)]),
        "epcomm_all2all_destroy": (None, [vp]),
        "epcomm_all2all_destroy_checked": (i32, [vp]),
        "epcomm_all2all_dispatch": (i32, [vp, T, T, T, T, sz, P(DispatchOutput)]),
        "epcomm_all2all_combine": (i32, [vp, T, T]),
        "epcomm_all2all_dispatch_scales": (i32, [vp, P(Tensor)]),
        "epcomm_all2all_set_dispatch_fp8": (i32, [vp, i64]),
        "epcomm_cuda_caps": (i32, [cp, sz, P(sz)]),
        "epcomm_eplb_rebalance": (
            i32,
            [P(ctypes.c_float), i64, i64, i64, i64, i64, i64, i64p, i64p],
        ),
        "epcomm_eplb_communicator_create": (i32, [vp, P(EplbSelectRequest), P(vp)]),
        "epcomm_eplb_communicator_destroy": (None, [vp]),
        "epcomm_eplb_communicator_destroy_checked": (i32, [vp]),
        "epcomm_eplb_communicator_add_send": (i32, [vp, T, sz, i32, i64]),
        "epcomm_eplb_communicator_add_recv": (i32, [vp, T, sz, i32, i64]),
        "epcomm_eplb_communicator_execute": (i32, [vp]),
        "epcomm_eplb_state_create": (i32, [cp, cp, i64, i64, P(vp)]),
        "epcomm_eplb_state_new": (i32, [i64, i64, cp, cp, P(vp)]),
        "epcomm_eplb_state_destroy": (None, [vp]),
        "epcomm_eplb_state_destroy_checked": (i32, [vp]),
        "epcomm_eplb_state_record_dispatch": (i32, [vp, i64, vp]),
        "epcomm_eplb_state_record": (i32, [vp, i64, T]),
        "epcomm_eplb_state_step": (i32, [vp, vp, ctypes.c_bool, ctypes.c_bool, P(ctypes.c_bool)]),
        "epcomm_eplb_state_logical_load": (
            i32,
            [vp, vp, i64p, i64, i64, i64, P(ctypes.c_float)],
        ),
        "epcomm_eplb_rearrange": (
            i32,
            [vp, i64p, i64p, i64, i64, i64, T, sz, i64p, sz, P(EplbSummary)],
        ),
        "epcomm_eplb_rearrange_options_init": (i32, [P(RearrangeOptions)]),
        "epcomm_eplb_rearrange_with": (
            i32,
            [vp, i64p, i64p, i64, i64, i64, T, sz, P(RearrangeOptions), P(EplbSummary)],
        ),
        "epcomm_eplb_rearrange_into": (
            i32,
            [vp, i64p, i64p, i64, i64, i64, T, T, sz, P(RearrangeOptions), P(EplbSummary),
             P(ctypes.c_int64)],
        ),
        "epcomm_eplb_state_migration_batching": (i32, [vp, P(ctypes.c_bool)]),
        **_more_signatures(),
    }


def _more_signatures() -> dict:
    """Sizing, statistics, selection queries, group collectives, plans, DLPack exports and the
    GPU entry points (present in every build; without the cuda/nccl features they report
    unavailable)."""
    T = ctypes.POINTER(Tensor)
    P = ctypes.POINTER
    u8p = P(ctypes.c_uint8)
    return {
        "epcomm_mem_alloc": (i32, [vp, sz, P(vp)]),
        "epcomm_mem_free": (i32, [vp, vp]),
        "epcomm_all2all_expert_output_buffer": (i32, [vp, P(vp), P(ctypes.c_int64)]),
        "epcomm_all2all_zero_copy_combines": (i32, [vp, P(ctypes.c_uint64)]),
        "epcomm_all2all_query_active_mask": (i32, [vp, P(i32), sz]),
        "epcomm_all2all_query_fault": (i32, [vp, P(ctypes.c_bool)]),
        "epcomm_all2all_clean_buffers": (i32, [vp]),
        "epcomm_all2all_update_mask": (i32, [vp, i32, ctypes.c_bool]),
        "epcomm_all2all_dropped_pairs": (i32, [vp, P(ctypes.c_uint64), P(ctypes.c_uint64)]),
        "epcomm_abi_version": (i32, []),
        "epcomm_all2all_check_layer": (i32, [vp, i64, i64]),
        "epcomm_all2all_buffer_bytes": (
            i32,
            [cp, P(MoeConfig), i32, i64, P(ctypes.c_uint64)],
        ),
        "epcomm_all2all_get_stats": (i32, [vp, P(All2AllStats)]),
        "epcomm_all2all_backend_is_known": (ctypes.c_bool, [cp]),
        "epcomm_all2all_backend_manager_class": (cp, [i32]),
        "epcomm_all2all_backend_layout": (i32, [i32, P(i32)]),
        "epcomm_all2all_layout_name": (cp, [i32]),
        "epcomm_all2all_name_count": (sz, []),
        "epcomm_all2all_name_info": (i32, [sz, P(NameDesc)]),
        "epcomm_eplb_communicator_select": (i32, [P(EplbSelectRequest), P(i32)]),
        "epcomm_eplb_communicator_name": (cp, [i32]),
        "epcomm_eplb_communicator_class": (cp, [i32]),
        "epcomm_eplb_logical_maps": (i32, [i64p, i64, i64, i64, i64, i64p, i64p]),
        "epcomm_eplb_min_redundant_experts": (i32, [i64, i64, i64p]),
        "epcomm_eplb_plan_layer": (i32, [i64p, i64p, i64, i64, i32, P(vp)]),
        "epcomm_eplb_layer_plan_view": (i32, [vp, P(PlanView)]),
        "epcomm_eplb_layer_plan_destroy": (None, [vp]),
        "epcomm_eplb_layer_plan_destroy_checked": (i32, [vp]),
        "epcomm_group_all_to_allv": (i32, [vp, T, i64p, T, i64p]),
        "epcomm_group_send_recv": (i32, [vp, P(P2POp), sz]),
        "epcomm_group_broadcast": (i32, [vp, T, i32]),
        "epcomm_group_all_gather": (i32, [vp, vp, sz, vp]),
        "epcomm_nccl_version": (i32, [P(i32)]),
        "epcomm_cuda_check": (i32, []),
        "epcomm_nixl_available": (ctypes.c_bool, []),
        "epcomm_nccl_unique_id": (i32, [u8p]),
        "epcomm_gpu_all2all_create": (
            i32,
            [cp, P(MoeConfig), u8p, i32, i32, i32, i32, P(vp)],
        ),
        "epcomm_gpu_all2all_create_from_comm": (i32, [cp, P(MoeConfig), vp, i32, i32, P(vp)]),
        "epcomm_gpu_all2all_destroy": (None, [vp]),
        "epcomm_gpu_all2all_destroy_checked": (i32, [vp]),
        "epcomm_gpu_all2all_dispatch": (i32, [vp, vp, T, T, T, T, sz, P(DispatchOutput)]),
        "epcomm_gpu_all2all_combine": (i32, [vp, vp, T, T]),
        "epcomm_gpu_all2all_check_error": (i32, [vp, vp]),
        "epcomm_gpu_all2all_get_stats": (i32, [vp, P(GpuStats)]),
        "epcomm_dlpack_export": (i32, [T, ctypes.c_bool, vp, vp, P(vp)]),
        "epcomm_dlpack_delete": (None, [vp]),
        "epcomm_dlpack_delete_versioned": (None, [vp]),
        "epcomm_dlpack_live": (sz, []),
        "epcomm_dlpack_set_python_api": (i32, [vp]),
        "epcomm_dlpack_python_release": (None, [vp]),
        "epcomm_dlpack_capsule_destructor": (None, [vp]),
    }


def _declare(lib: ctypes.CDLL) -> None:
    for name, (res, args) in _signatures().items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


_LEVELS = {1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO, 4: logging.DEBUG}


@LOG_FN
def _log_bridge(level: int, message: bytes, _user: Optional[int]) -> None:
    logger.log(_LEVELS.get(level, logging.INFO), message.decode("utf-8", "replace"))
