"""The dispatch layouts by name: what ``All2All.dispatch()["layout"]``,
``GpuAll2All.dispatch()["layout"]``, ``backend_layout()`` and ``all2all_names()`` return.

A layout is always its name, a ``str`` such as ``"TOKEN_MAJOR"`` (the C enum's
``EPCOMM_LAYOUT_TOKEN_MAJOR`` without the prefix); compare it with the constants below.
"""

from __future__ import annotations

from typing import Tuple

from ._lib import load_library

REPLICATED = "REPLICATED"
"""allgather_reducescatter: every rank's tokens, concatenated in rank order."""
TOKEN_MAJOR = "TOKEN_MAJOR"
"""deepep_high_throughput, mori*: one row per (source, token) routed to this rank."""
EXPERT_MAJOR = "EXPERT_MAJOR"
"""deepep_low_latency, nixl_ep: fixed buckets [E_local, M*R, H] per local expert."""
EXPERT_PACKED = "EXPERT_PACKED"
"""deepep_v2: one row per (source, token, local expert), grouped by expert."""
RANK_MAJOR = "RANK_MAJOR"
"""flashinfer_nvlink_*: a region of M rows per source rank, [R, M, H]."""
MOONEP_SLOTS = "MOONEP_SLOTS"
"""moonep (not implemented: creating its manager fails)."""

LAYOUTS: Tuple[str, ...] = (
    REPLICATED, TOKEN_MAJOR, EXPERT_MAJOR, EXPERT_PACKED, RANK_MAJOR, MOONEP_SLOTS)
"""Every layout name, in the order of the C enum's values."""


def layout_name(code: int) -> str:
    """The name of a C ``EPCOMM_LAYOUT_*`` value (one of ``LAYOUTS``)."""
    name = load_library().epcomm_all2all_layout_name(code)
    if not name:
        raise ValueError(f"unknown layout value {code}")
    return name.decode()
