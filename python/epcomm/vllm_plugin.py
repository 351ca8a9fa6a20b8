"""epcomm's vLLM general plugin: CPU expert parallelism through epcomm, in every vLLM process.

Registered as the ``vllm.general_plugins`` entry point ``epcomm`` (python/pyproject.toml), which
vLLM loads in every process it starts (the spawned workers included) before it builds its
process groups; ``VLLM_PLUGINS``, when set, must name ``epcomm``. ``register()`` then, in this
process:

1. makes the all2all manager vLLM's CPU communicator builds (``AgRsAll2AllManager``, whatever
   ``all2all_backend`` says) epcomm's (``EpcommAll2AllManager``), gathering over the group
   vLLM's manager gathers over, with the shared-memory transport when every rank of the EP
   group is on this host (same host name and boot id) and the torch (gloo) transport
   otherwise, routes the CPU communicator's ``combine_into_output`` to the manager's
   in-place reduction, and, under data parallelism, calls the MoE layer through vLLM's own
   opaque op ``torch.ops.vllm.moe_forward`` (as vLLM does on GPU) so that torch.compile,
   vLLM's default mode, compiles the model around it;
2. where vLLM's ``CPUUnquantizedExperts.apply`` ignores ``expert_map`` (vLLM 0.32.0 to
   0.34.0: it passes global expert ids to a kernel whose buffers hold the local experts, which
   reads out of bounds as soon as experts are split over ranks), maps the ids through
   ``expert_map`` first (a non-local expert gets weight 0 and a local id);
3. makes the EPLB communicator factory return ``EpcommEplbCommunicator`` for CPU weights.

Environment switches (each ``0`` turns its part off): ``EPCOMM_VLLM_PLUGIN`` (everything),
``EPCOMM_VLLM_MANAGER`` (1, the combine routing and the opaque MoE op),
``EPCOMM_VLLM_OPAQUE_MOE`` (the opaque MoE op alone), ``EPCOMM_VLLM_MOE_FIX`` (2),
``EPCOMM_VLLM_EPLB`` (3). ``EPCOMM_VLLM_TRANSPORT`` = ``auto`` (default), ``shm`` or
``torch``. A vLLM release outside ``SUPPORTED_VLLM`` is refused: the plugin logs why and
changes nothing (``EPCOMM_VLLM_REQUIRE=1`` makes that, and any part failing to apply, an
error instead).
"""

from __future__ import annotations

import ast
import inspect
import logging
import os
import textwrap
from typing import Any, List, Optional

#: The vLLM releases whose all2all manager interface, CPU communicator and CPU MoE experts
#: this plugin was checked against (their sources: ``CpuCommunicator`` builds
#: ``AgRsAll2AllManager(self.cpu_group)``; ``All2AllManagerBase`` as ``EpcommAll2AllManager``).
SUPPORTED_VLLM = ("0.32.0", "0.33.0", "0.34.0")

#: The releases whose ``CPUUnquantizedExperts.apply`` is known (read in their sources) to
#: ignore ``expert_map``.
MOE_FIX_RELEASES = ("0.32.0", "0.33.0", "0.34.0")

#: ``CPUUnquantizedExperts.apply``'s parameters in those releases (the fix calls through them).
APPLY_PARAMS = (
    "self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
    "global_num_experts", "expert_map", "a1q_scale", "a2_scale", "workspace13", "workspace2",
    "expert_tokens_meta", "apply_router_weight_on_input",
)

TRANSPORT_ENV = "EPCOMM_VLLM_TRANSPORT"

log = logging.getLogger("epcomm.vllm")
_said: set = set()


def _say(level: int, message: str, *args: Any) -> None:
    """Logs ``message`` once per process (vLLM loads plugins in every process, maybe twice)."""
    if message in _said:
        return
    _said.add(message)
    if not log.handlers and not logging.getLogger().handlers:
        # vLLM configures its own "vllm" logger only; make ours visible the same way.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s [epcomm] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    log.log(level, message, *args)


def _on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "off", "no")


def vllm_version() -> str:
    """The installed vLLM's release (``vllm.__version__`` without a local part: ``+cpu``)."""
    import vllm

    return str(getattr(vllm, "__version__", "?")).split("+")[0]


class PluginRefused(RuntimeError):
    """The plugin cannot serve this vLLM (raised only with ``EPCOMM_VLLM_REQUIRE=1``)."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent; see the module's docstring)."""
    if not _on("EPCOMM_VLLM_PLUGIN"):
        _say(logging.INFO, "EPCOMM_VLLM_PLUGIN=0: the epcomm vLLM plugin changes nothing.")
        return
    require = os.environ.get("EPCOMM_VLLM_REQUIRE", "0") == "1"
    version = vllm_version()
    if version not in SUPPORTED_VLLM:
        why = (f"vLLM {version} is not one of the releases the epcomm plugin supports "
               f"({', '.join(SUPPORTED_VLLM)}): it changes nothing in this vLLM")
        if require:
            raise PluginRefused(why)
        _say(logging.WARNING, "%s.", why)
        return
    parts = (
        ("EPCOMM_VLLM_MANAGER", install_manager),
        ("EPCOMM_VLLM_MOE_FIX", install_moe_fix),
        ("EPCOMM_VLLM_EPLB", install_eplb),
    )
    for switch, part in parts:
        if not _on(switch):
            _say(logging.INFO, "%s=0: %s skipped.", switch, part.__name__)
            continue
        try:
            part(version)
        except Exception as e:  # a part that cannot apply must not take vLLM down
            if require:
                raise
            _say(logging.WARNING, "%s failed (%s: %s); vLLM's own code stays in place.",
                 part.__name__, type(e).__name__, e)


# ---------------------------------------------------------------------------------------------
# 1. The all2all manager


def _transport_choice() -> str:
    t = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if t not in ("auto", "shm", "torch"):
        raise ValueError(f"{TRANSPORT_ENV}={t!r}; expected auto, shm or torch")
    return t


def _gather_group(cpu_group: Any) -> Any:
    """The CPU group vLLM's ``AgRsAll2AllManager`` gathers non-sequence-parallel input over
    (its ``_get_comm_group``: the DP group with data parallelism, else the PCP group; the EP
    group under DP + PCP), or None where that is the EP group itself (TP = 1)."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    dp = ps.get_dp_group()
    if dp.world_size > 1:
        pcp = getattr(ps, "get_pcp_group", None)
        group = cpu_group if (pcp is not None and pcp().world_size > 1) else dp.cpu_group
    else:
        pcp = getattr(ps, "get_pcp_group", None)
        group = pcp().cpu_group if pcp is not None else None
        if group is None:
            return None
    if dist.get_process_group_ranks(group) == dist.get_process_group_ranks(cpu_group):
        return None
    return group


def make_manager_class() -> type:
    """``EpcommAll2AllManager`` with vLLM's constructor (``cls(cpu_group, tcp_store_group)``)
    that picks the transport and the gather group itself."""
    from .vllm import EpcommAll2AllManager, same_host

    class EpcommVllmAll2AllManager(EpcommAll2AllManager):
        """epcomm's manager as vLLM's CPU communicator builds it (the plugin's)."""

        def __init__(self, cpu_group: Any, tcp_store_group: Any = None):
            choice = _transport_choice()
            one_host = same_host(cpu_group)
            transport = choice if choice != "auto" else ("shm" if one_host else "torch")
            if transport == "shm" and not one_host:
                raise ValueError(
                    f"{TRANSPORT_ENV}=shm, but the EP group's ranks are on more than one host"
                )
            super().__init__(cpu_group, tcp_store_group, dp_group=_gather_group(cpu_group),
                             transport=transport)
            _say(logging.INFO,
                 "epcomm all2all manager for vLLM's EP group: %d ranks, transport %s (%s).",
                 self.world_size, transport,
                 ("every rank on this host" if one_host else "ranks on several hosts")
                 + ("" if choice == "auto" else f", {TRANSPORT_ENV}={choice}"))

    return EpcommVllmAll2AllManager


def install_manager(version: str) -> None:
    """vLLM's CPU communicator builds epcomm's manager, and its ``combine_into_output``
    reduces into the output in place through it."""
    import importlib

    all2all = importlib.import_module("vllm.distributed.device_communicators.all2all")
    cpu = importlib.import_module("vllm.distributed.device_communicators.cpu_communicator")
    current = getattr(all2all, "AgRsAll2AllManager")
    if getattr(current, "_epcomm_plugin", False):
        return
    cls = make_manager_class()
    cls._epcomm_plugin = True  # type: ignore[attr-defined]
    cls._vllm_manager = current  # type: ignore[attr-defined]
    setattr(all2all, "AgRsAll2AllManager", cls)

    from .vllm import EpcommAll2AllManager

    comm_cls = cpu.CpuCommunicator
    original = comm_cls.combine_into_output

    def combine_into_output(self: Any, hidden_states: Any, output: Any,
                            is_sequence_parallel: bool = False) -> Any:
        m = getattr(self, "all2all_manager", None)
        if isinstance(m, EpcommAll2AllManager):
            return m.combine_into_output_any(hidden_states, output, is_sequence_parallel)
        return original(self, hidden_states, output, is_sequence_parallel)

    comm_cls.combine_into_output = combine_into_output
    if _on("EPCOMM_VLLM_OPAQUE_MOE"):
        install_opaque_moe(version)
    _say(logging.INFO, "epcomm plugin: vLLM %s's CPU expert parallelism runs on epcomm's "
         "all2all manager (%s=%s).", version, TRANSPORT_ENV, _transport_choice())


def install_opaque_moe(version: str) -> None:
    """Under data parallelism, vLLM's CPU MoE layers call ``torch.ops.vllm.moe_forward`` (the
    custom op vLLM's GPU path calls) instead of the layer's Python directly.

    vLLM's CPU path (``MoERunner._select_forward``, 0.32.0 to 0.34.0) lets torch.compile trace
    the whole MoE layer, its dispatch and combine included. A dispatch's row count is every DP
    rank's tokens, known only at run time; the modular kernel branches on it in Python
    (``if M_full == 0``), which dynamo cannot trace with ``fullgraph=True`` ("Could not guard
    on data-dependent expression"). Behind vLLM's own opaque op the layer runs eagerly inside
    the compiled graph, as on GPU: its output has the input's shape, and the dispatch,
    experts and combine run as in eager mode."""
    import importlib

    mod = importlib.import_module("vllm.model_executor.layers.fused_moe.runner.moe_runner")
    runner = mod.MoERunner
    original = runner._select_forward
    if getattr(original, "_epcomm", False):
        return

    def _select_forward(self: Any) -> Any:
        chosen = original(self)
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and self.moe_config.dp_size > 1:
            import torch

            return (torch.ops.vllm.moe_forward if self._shared_experts is None
                    else torch.ops.vllm.moe_forward_shared)
        return chosen

    _select_forward._epcomm = True  # type: ignore[attr-defined]
    runner._select_forward = _select_forward


# ---------------------------------------------------------------------------------------------
# 2. The CPU MoE expert-map fix


def apply_uses_expert_map(fn: Any) -> Optional[bool]:
    """Whether ``fn``'s body reads ``expert_map`` (None: its source cannot be read)."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    body = ast.parse(src).body[0]
    if not isinstance(body, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return any(isinstance(n, ast.Name) and n.id == "expert_map" and isinstance(n.ctx, ast.Load)
               for stmt in body.body for n in ast.walk(stmt))


def local_routes(topk_weights: Any, topk_ids: Any, expert_map: Any) -> Any:
    """Global top-k routes made local: ``expert_map`` (global expert -> local slot, -1 where
    the expert lives elsewhere) maps each id; a route to a non-local expert keeps a valid local
    id (0) and gets weight 0, so it adds nothing. Returns (weights, ids, non_local)."""
    local = expert_map[topk_ids.long()]
    non_local = local < 0
    weights = topk_weights.masked_fill(non_local, 0)
    ids = local.masked_fill(non_local, 0).to(topk_ids.dtype)
    return weights, ids, non_local


def install_moe_fix(version: str) -> None:
    """Wraps ``CPUUnquantizedExperts.apply`` where it ignores ``expert_map``: detected by
    release (``MOE_FIX_RELEASES``) and by reading the method (its body never reads
    ``expert_map``); skipped, and said so, where vLLM reads it."""
    import importlib

    mod = importlib.import_module("vllm.model_executor.layers.fused_moe.experts.cpu_moe")
    cls = mod.CPUUnquantizedExperts
    original = cls.apply
    if getattr(original, "_epcomm_fix", False):
        return
    uses = apply_uses_expert_map(original)
    if uses:
        _say(logging.INFO, "epcomm plugin: vLLM %s's CPUUnquantizedExperts.apply reads "
             "expert_map; the expert-map fix is not needed and not applied.", version)
        return
    params = tuple(inspect.signature(original).parameters)
    if params != APPLY_PARAMS:
        raise RuntimeError(
            f"vLLM {version}'s CPUUnquantizedExperts.apply has parameters {params}, not the "
            "ones the expert-map fix was written for"
        )
    known = version in MOE_FIX_RELEASES

    def apply(self: Any, output: Any, hidden_states: Any, w1: Any, w2: Any, topk_weights: Any,
              topk_ids: Any, activation: Any, global_num_experts: int, expert_map: Any,
              a1q_scale: Any, a2_scale: Any, workspace13: Any, workspace2: Any,
              expert_tokens_meta: Any, apply_router_weight_on_input: bool) -> None:
        non_local = None
        if expert_map is not None:
            topk_weights, topk_ids, non_local = local_routes(topk_weights, topk_ids,
                                                             expert_map)
        original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                 global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                 expert_tokens_meta, apply_router_weight_on_input)
        if non_local is not None and apply_router_weight_on_input:
            # The weight went into the input (top-1 only): a token whose expert lives
            # elsewhere contributes nothing here.
            output.masked_fill_(non_local.all(dim=-1, keepdim=True), 0)

    apply._epcomm_fix = True  # type: ignore[attr-defined]
    apply.__wrapped__ = original  # type: ignore[attr-defined]
    cls.apply = apply
    _say(logging.INFO, "epcomm plugin: vLLM %s's CPUUnquantizedExperts.apply ignores "
         "expert_map (%s); epcomm maps the top-k ids to local experts before the CPU MoE "
         "kernel (EPCOMM_VLLM_MOE_FIX=0 turns this off).", version,
         "a known defect of this release" if known else "read in its source")


# ---------------------------------------------------------------------------------------------
# 3. EPLB


def install_eplb(version: str) -> None:
    """vLLM's EPLB communicator factory returns ``EpcommEplbCommunicator`` for CPU weights."""
    from .vllm import install_eplb_factory

    install_eplb_factory()


__all__: List[str] = [
    "register", "SUPPORTED_VLLM", "MOE_FIX_RELEASES", "local_routes", "apply_uses_expert_map",
    "make_manager_class", "install_manager", "install_moe_fix", "install_eplb", "vllm_version",
    "PluginRefused",
]
