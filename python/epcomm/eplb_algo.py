"""vLLM's EPLB policy steps (``DefaultEplbPolicy``'s classmethods and ``compute_logical_maps``;
unchanged from v0.33.0 to v0.34.0) and v0.34.0's scale-down placement, one function each,
over epcomm's C entry points.

Arguments are numpy arrays, CPU torch tensors or nested lists; results are numpy int64 arrays
(numpy is needed by this module only, imported on first use). Errors are vLLM's classes
(AssertionError for its asserts) with epcomm's messages.

Ties: ``balanced_packing`` and the policies built on it take equal loads in ascending index (a
stable sort). vLLM sorts with numpy's default, unstable ``np.argsort``, whose order of equal
loads differs between CPUs and numpy builds, so on tied loads the placements may differ from
vLLM's (they are equally balanced); without ties they are identical. ``replicate_experts``,
``preserve_intragpu_slots`` and ``compute_logical_maps`` are always identical.
"""

import ctypes
from typing import Any, Optional, Sequence, Tuple

from . import _check, load_library

__all__ = [
    "ONE_NODE_FALLBACK",
    "balanced_packing",
    "replicate_experts",
    "rebalance_experts_hierarchical",
    "preserve_intragpu_slots",
    "rebalance_experts",
    "compute_logical_maps",
    "schedule_migration_batches",
    "compute_dead_ep_ranks",
    "mark_dead_expert_slots_inplace",
    "redistribute_expert_placement",
]

#: ``flags`` bit: vLLM's eplb_state caller rule (num_ranks % num_nodes != 0 → warning, one node).
ONE_NODE_FALLBACK = 1

_i64, _u32 = ctypes.c_int64, ctypes.c_uint32
_P = ctypes.c_void_p
_SIGNATURES = {
    "epcomm_eplb_rebalance_experts": [_P] + [_i64] * 6 + [_P, _u32, _P],
    "epcomm_eplb_rebalance_experts_hierarchical": [_P] + [_i64] * 6 + [_P],
    "epcomm_eplb_balanced_packing": [_P, _i64, _i64, _i64, _P, _P],
    "epcomm_eplb_replicate_experts": [_P, _i64, _i64, _i64, _P, _P],
    "epcomm_eplb_preserve_intragpu_slots": [_P, _i64, _i64, _i64, _P, _P],
    "epcomm_eplb_compute_logical_maps": [_P, _i64, _i64, _i64, _P, _P, _i64, _P],
    "epcomm_eplb_dead_ep_ranks": [_P, ctypes.c_size_t, _i64, _i64, _P, _P],
    "epcomm_eplb_mark_dead_expert_slots": [_P, _i64, _i64, _P, ctypes.c_size_t, _i64],
    "epcomm_eplb_redistribute_expert_placement": [_P, _i64, _i64, _i64, _i64, _P],
}
_DECLARED: Optional[ctypes.CDLL] = None


def _lib() -> ctypes.CDLL:
    global _DECLARED
    if _DECLARED is None:
        lib = load_library()
        for name, args in _SIGNATURES.items():
            f = getattr(lib, name)
            f.restype = ctypes.c_int32
            f.argtypes = args
        _DECLARED = lib
    return _DECLARED


def _array(x: Any, dtype: Any) -> Any:
    """A C-contiguous 2-D numpy array of ``dtype`` (torch tensors go through ``.cpu()``)."""
    import numpy as np

    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    a = np.ascontiguousarray(np.asarray(x), dtype=dtype)
    if a.ndim != 2:
        raise ValueError(f"expected a 2-D array, got shape {a.shape}")
    return a


def _empty(shape: Sequence[int]) -> Any:
    import numpy as np

    return np.empty(shape, dtype=np.int64)


def _ptr(a: Any) -> Optional[int]:
    return None if a is None else a.ctypes.data


def balanced_packing(weight: Any, num_packs: int) -> Tuple[Any, Any]:
    """vLLM's ``balanced_packing``: weight [X, n] → (pack_index, rank_in_pack), each [X, n]."""
    import numpy as np

    w = _array(weight, np.float64)
    pack, rank = _empty(w.shape), _empty(w.shape)
    _check(_lib().epcomm_eplb_balanced_packing(
        _ptr(w), w.shape[0], w.shape[1], num_packs, _ptr(pack), _ptr(rank)))
    return pack, rank


def replicate_experts(weight: Any, num_phy: int) -> Tuple[Any, Any]:
    """vLLM's ``replicate_experts``: weight [X, num_log] → (phy2log [X, num_phy], logcnt
    [X, num_log])."""
    import numpy as np

    w = _array(weight, np.float64)
    phy2log, logcnt = _empty((w.shape[0], num_phy)), _empty(w.shape)
    _check(_lib().epcomm_eplb_replicate_experts(
        _ptr(w), w.shape[0], w.shape[1], num_phy, _ptr(phy2log), _ptr(logcnt)))
    return phy2log, logcnt


def rebalance_experts_hierarchical(weight: Any, num_physical_experts: int, num_groups: int,
                                   num_nodes: int, num_gpus: int) -> Any:
    """vLLM's ``rebalance_experts_hierarchical``: weight [layers, logical] → phy2log
    [layers, num_physical_experts]."""
    import numpy as np

    w = _array(weight, np.float32)
    out = _empty((w.shape[0], num_physical_experts))
    _check(_lib().epcomm_eplb_rebalance_experts_hierarchical(
        _ptr(w), w.shape[0], w.shape[1], num_physical_experts, num_groups, num_nodes, num_gpus,
        _ptr(out)))
    return out


def preserve_intragpu_slots(phy2log: Any, num_ranks: int, old_phy2log: Any) -> Any:
    """vLLM's ``preserve_intragpu_slots``: phy2log reordered within each rank so that experts
    that stay keep their old slots (a new array; -1 may appear in either map)."""
    import numpy as np

    new, old = _array(phy2log, np.int64), _array(old_phy2log, np.int64)
    if old.shape != new.shape:
        raise ValueError(f"old_phy2log has shape {old.shape}; phy2log has {new.shape}")
    out = _empty(new.shape)
    _check(_lib().epcomm_eplb_preserve_intragpu_slots(
        _ptr(new), new.shape[0], new.shape[1], num_ranks, _ptr(old), _ptr(out)))
    return out


def rebalance_experts(weight: Any, num_replicas: int, num_groups: int, num_nodes: int,
                      num_ranks: int, old_global_expert_indices: Any = None,
                      one_node_fallback: bool = False) -> Any:
    """vLLM's ``DefaultEplbPolicy.rebalance_experts``: weight [layers, logical] token counts →
    phy2log [layers, num_replicas]. ``old_global_expert_indices`` (same shape as the result,
    -1 = unused slot) keeps experts in their old slots; ``one_node_fallback`` applies vLLM's
    eplb_state caller rule first (num_ranks % num_nodes != 0 → warning, one node)."""
    import numpy as np

    w = _array(weight, np.float32)
    out = _empty((w.shape[0], num_replicas))
    old = None
    if old_global_expert_indices is not None:
        old = _array(old_global_expert_indices, np.int64)
        if old.shape != out.shape:
            raise ValueError(
                f"old_global_expert_indices has shape {old.shape}; expected {out.shape}")
    flags = ONE_NODE_FALLBACK if one_node_fallback else 0
    _check(_lib().epcomm_eplb_rebalance_experts(
        _ptr(w), w.shape[0], w.shape[1], num_replicas, num_groups, num_nodes, num_ranks,
        _ptr(old), flags, _ptr(out)))
    return out


def compute_logical_maps(physical_to_logical_map: Any,
                         num_logical_experts: int) -> Tuple[Any, Any]:
    """vLLM's ``compute_logical_maps``: phy2log [layers, P] (or [P] for one layer; -1 = unused
    slot) → (log2phy [layers, E, max_replicas], logcnt [layers, E]), max_replicas being the
    largest replica count, as vLLM derives it."""
    import numpy as np

    src = np.asarray(physical_to_logical_map.detach().cpu().numpy()
                     if hasattr(physical_to_logical_map, "detach") else physical_to_logical_map)
    per_layer = src.ndim == 1
    p2l = _array(src[None, :] if per_layer else src, np.int64)
    layers, physical = p2l.shape
    logcnt = _empty((layers, num_logical_experts))
    log2phy = _empty((layers, num_logical_experts, physical))
    width = ctypes.c_int64()
    _check(_lib().epcomm_eplb_compute_logical_maps(
        _ptr(p2l), layers, physical, num_logical_experts, _ptr(logcnt), _ptr(log2phy),
        log2phy.size, ctypes.addressof(width)))
    w = width.value
    log2phy = np.ascontiguousarray(log2phy.reshape(-1)[: layers * num_logical_experts * w]
                                   .reshape(layers, num_logical_experts, w))
    if per_layer:
        return log2phy[0], logcnt[0]
    return log2phy, logcnt


def schedule_migration_batches(num_local_experts: int, old_indices: Any,
                               new_indices: Any) -> "list[list[Tuple[int, int, Tuple[int, ...]]]]":
    """vLLM v0.33.0's ``schedule_migration_batches`` (migration_scheduler.py) for one layer:
    old and new phy2log [P] (-1 = empty slot) → batches of flows ``(src_rank, dst_rank,
    expert_ids)``, the fields of vLLM's ``MigrationFlow``; no rank is in two flows of a batch.
    The batches ``EplbCommunicator.rearrange`` runs with migration batching."""
    import numpy as np

    def flat(x: Any) -> Any:
        if hasattr(x, "detach") and hasattr(x, "cpu"):
            x = x.detach().cpu().numpy()
        return np.ascontiguousarray(np.asarray(x), dtype=np.int64)

    old, new = flat(old_indices), flat(new_indices)
    assert old.shape == new.shape, (
        f"old_indices.shape == new_indices.shape ({old.shape} != {new.shape})")
    old, new = old.reshape(-1), new.reshape(-1)
    lib = _lib()
    sched, view = lib.epcomm_eplb_schedule_migration_batches, lib.epcomm_eplb_migration_schedule_view
    sched.restype = view.restype = ctypes.c_int32
    sched.argtypes = [_P, _P, _i64, _i64, _P]
    view.argtypes = [_P, _P]
    lib.epcomm_eplb_migration_schedule_destroy.argtypes = [_P]
    lib.epcomm_eplb_migration_schedule_destroy.restype = None

    class View(ctypes.Structure):
        _fields_ = [(name, t) for name, t in (
            ("num_batches", _i64), ("batch_starts", ctypes.POINTER(_i64)),
            ("num_flows", _i64), ("flows", ctypes.POINTER(_i64)),
            ("expert_starts", ctypes.POINTER(_i64)), ("num_expert_ids", _i64),
            ("expert_ids", ctypes.POINTER(_i64)))]

    handle, v = ctypes.c_void_p(), View()
    _check(sched(_ptr(old), _ptr(new), old.size, num_local_experts, ctypes.addressof(handle)))
    try:
        _check(view(handle, ctypes.addressof(v)))
        flows = [(int(v.flows[2 * f]), int(v.flows[2 * f + 1]),
                  tuple(int(v.expert_ids[i])
                        for i in range(v.expert_starts[f], v.expert_starts[f + 1])))
                 for f in range(v.num_flows)]
        return [flows[v.batch_starts[b]:v.batch_starts[b + 1]] for b in range(v.num_batches)]
    finally:
        lib.epcomm_eplb_migration_schedule_destroy(handle)


# ---- vLLM v0.34.0's scale-down placement (vllm/v1/worker/sentinel/eplb_redistribute.py) ----
# Every survivor runs these on the same map and gets the same result, without talking to the
# others, before it reloads the lost experts.


def _ints(values: Any) -> Any:
    import numpy as np

    return np.ascontiguousarray(np.asarray(sorted(values), dtype=np.int64).reshape(-1))


def _write_back(target: Any, result: Any) -> None:
    """Copies ``result`` into ``target`` (a torch tensor or numpy array) in place."""
    if hasattr(target, "copy_") and hasattr(target, "detach"):
        import torch

        target.copy_(torch.from_numpy(result).to(target.dtype))
    else:
        target[...] = result


def compute_dead_ep_ranks(dead_dp_ranks: Any, tp_size: int, pcp_size: int = 1) -> set:
    """vLLM's ``compute_dead_ep_ranks``: the EP ranks of the dead DP ranks (each DP rank owns
    ``tp_size * pcp_size`` consecutive EP ranks)."""
    dead = _ints(dead_dp_ranks)
    out = _empty((max(len(dead) * tp_size * pcp_size, 1),))
    n = ctypes.c_size_t()
    _check(_lib().epcomm_eplb_dead_ep_ranks(
        _ptr(dead) if len(dead) else None, len(dead), tp_size, pcp_size, _ptr(out),
        ctypes.byref(n)))
    return set(out[: n.value].tolist())


def mark_dead_expert_slots_inplace(physical_to_logical_map: Any, dead_ep_ranks: Any,
                                   num_local_experts: int) -> None:
    """vLLM's ``mark_dead_expert_slots_inplace``: the dead EP ranks' slots become -1 in every
    layer of ``physical_to_logical_map`` [layers, physical] (a torch tensor or numpy array,
    changed in place)."""
    import numpy as np

    if not dead_ep_ranks:
        return
    m = _array(physical_to_logical_map, np.int64)
    dead = _ints(dead_ep_ranks)
    _check(_lib().epcomm_eplb_mark_dead_expert_slots(
        _ptr(m), m.shape[0], m.shape[1], _ptr(dead), len(dead), num_local_experts))
    _write_back(physical_to_logical_map, m)


def redistribute_expert_placement(physical_to_logical_map: Any, num_logical: int,
                                  num_local_experts: int) -> set:
    """vLLM's ``redistribute_expert_placement``: each logical expert without a surviving
    replica takes a slot of an over-replicated one, spread round-robin over the EP ranks;
    ``physical_to_logical_map`` (a torch tensor or numpy array) is changed in place. Returns
    the set of (moe_layer_idx, logical_id) whose weights need reloading. Too little redundancy
    raises vLLM's RuntimeError (the map unchanged)."""
    import numpy as np

    m = _array(physical_to_logical_map, np.int64)
    reload = np.zeros((m.shape[0], max(num_logical, 1)), dtype=np.uint8)
    _check(_lib().epcomm_eplb_redistribute_expert_placement(
        _ptr(m), m.shape[0], m.shape[1], num_logical, num_local_experts, _ptr(reload)))
    _write_back(physical_to_logical_map, m)
    return {(int(layer), int(e)) for layer, e in zip(*np.nonzero(reload[:, :num_logical]))}
