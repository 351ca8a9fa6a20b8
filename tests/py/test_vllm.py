"""epcomm.vllm: the all2all manager and the EPLB communicator with vLLM v0.33.0's interfaces.

Two and four rank processes over gloo on 127.0.0.1 (each in its own IPC and mount namespace where
`unshare` is permitted). EpcommAll2AllManager's dispatch, dispatch_router_logits and combine
(with different token counts per rank, extra tensors, sequence parallel, both transports) must
equal a plain-torch reference of what vLLM's AgRsAll2AllManager computes: all_gatherv of
[hidden_states, topk_weights, topk_ids, *extra_tensors] in rank order, and reduce_scatterv of
combine's input with the dispatch's token counts, written with torch.distributed collectives.
EpcommEplbCommunicator must move expert weights from add_send to the matching add_recv. Both
are built the way vLLM builds its own once `epcomm.vllm.install()` has patched (stand-ins for)
vLLM's two modules.

    PYTHONPATH=python EPCOMM_LIBRARY=target/debug/libepcomm.so python3 tests/py/test_vllm.py -v
"""

import os
import sys
import types
import unittest

import test_torch_group as ranks

H, K, E = 6, 2, 8  # hidden size, top-k, experts


# ---- the plain-torch reference (AgRs semantics) ---------------------------------------------


def ref_all_gatherv(dist, t, sizes):
    """Every rank's rows of `t` in rank order (padded all_gather, then the padding dropped)."""
    import torch

    pad = max(sizes)
    mine = torch.zeros((pad,) + tuple(t.shape[1:]), dtype=t.dtype)
    mine[: t.shape[0]] = t
    parts = [torch.empty_like(mine) for _ in sizes]
    dist.all_gather(parts, mine)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def ref_reduce_scatterv(dist, t, sizes, rank):
    """The sum over ranks of `t`, this rank's `sizes[rank]` rows."""
    total = t.clone()
    dist.all_reduce(total)
    start = sum(sizes[:rank])
    return total[start : start + sizes[rank]]


# ---- a rank ---------------------------------------------------------------------------------


def rank_inputs(rank):
    """Integer-valued floats, so sums are exact in any order."""
    import torch

    g = torch.Generator().manual_seed(7 + rank)
    t = 2 + rank  # the ranks' token counts differ
    hidden = torch.randint(-8, 8, (t, H), generator=g).to(torch.bfloat16)
    weights = torch.rand((t, K), generator=g)
    ids = torch.randint(0, E, (t, K), generator=g, dtype=torch.int32)
    logits = torch.randint(-8, 8, (t, E), generator=g).float()
    scales = torch.randint(0, 255, (t, 3), generator=g, dtype=torch.uint8)
    flags = torch.rand(t, generator=g) > 0.5
    return hidden, weights, ids, logits, [scales, flags]


def check_manager(dist, epcomm_vllm, rank, world, transport, mism):
    import torch

    hidden, weights, ids, logits, extras = rank_inputs(rank)
    sizes = [2 + r for r in range(world)]
    # As vLLM's CpuCommunicator builds it, once installed with this transport.
    epcomm_vllm.install(transport=transport)
    m = sys.modules["vllm.distributed.device_communicators.all2all"].AgRsAll2AllManager(
        dist.group.WORLD)
    assert isinstance(m, epcomm_vllm.EpcommAll2AllManager)
    assert m.transport == transport, m.transport

    def same(name, got, want):
        if got.dtype != want.dtype or not torch.equal(got, want):
            mism.append(f"{transport}: {name}: {got} != {want}")

    assert (m.rank, m.world_size, m.dp_rank, m.dp_world_size) == (rank, world, rank, world)
    assert m.internode is False

    got = m.dispatch(hidden, weights, ids)
    assert len(got) == 3
    for name, g, t in zip(("hidden", "topk_weights", "topk_ids"), got, (hidden, weights, ids)):
        same(f"dispatch {name}", g, ref_all_gatherv(dist, t, sizes))

    got = m.dispatch(hidden, weights, ids.long(), extra_tensors=extras)
    assert len(got) == 4 and isinstance(got[3], list) and len(got[3]) == 2
    for i, t in enumerate([hidden, weights, ids.long()] + extras):
        g = got[i] if i < 3 else got[3][i - 3]
        same(f"dispatch with extras [{i}]", g, ref_all_gatherv(dist, t, sizes))

    # vLLM's MoE computes on every gathered token; combine brings each rank its own back.
    y = (got[0].float() * (rank + 1)).to(torch.bfloat16)
    same("combine", m.combine(y), ref_reduce_scatterv(dist, y, sizes, rank))
    y32 = got[0].float() + rank
    out = torch.empty((sizes[rank], H))
    r = m.combine_into_output(y32, out)
    same("combine_into_output", r, ref_reduce_scatterv(dist, y32, sizes, rank))
    assert r is out
    check_output_rejected(m, y32, sizes[rank], mism)

    g_h, g_l, g_x = m.dispatch_router_logits(hidden, logits, True, extra_tensors=extras[:1])
    same("router_logits hidden", g_h, ref_all_gatherv(dist, hidden, sizes))
    same("router_logits logits", g_l, ref_all_gatherv(dist, logits, sizes))
    same("router_logits extra", g_x[0], ref_all_gatherv(dist, extras[0], sizes))
    assert len(m.dispatch_router_logits(hidden, logits)) == 2
    y = g_l * (rank + 2)
    same("combine sequence parallel", m.combine(y, is_sequence_parallel=True),
         ref_reduce_scatterv(dist, y, sizes, rank))

    # Without a dispatch of that size, combine splits evenly (AgRs without DP metadata).
    even = torch.arange(4 * world * H, dtype=torch.float32).reshape(4 * world, H) * (rank + 1)
    same("combine even split", m.combine(even), ref_reduce_scatterv(dist, even, [4] * world,
                                                                      rank))

    if world == 2 and transport == "shm":  # torch.compile costs seconds per process
        check_compiled(m, dist, rank, sizes, hidden, weights, ids, transport, mism)
    assert m.stats["dispatches"] > 0 and m.stats["combines"] > 0, m.stats
    # vLLM's base-class methods (0.32.0 to 0.34.0): warn once / no-ops / a null context.
    m.checkpoint_prepare()
    m.checkpoint_restore()
    m.stage_ep_size()
    m.commit_ep_size()
    with m.mask_remote_ranks():
        pass

    a = m.get_handle({"num_experts": E, "top_k": K, "hidden_size": H})
    assert a is m.get_handle({"num_experts": E, "top_k": K, "hidden_size": H})
    assert m.allocate_combine_input((1, H), torch.float32, "cpu") is None
    m.destroy()
    m.destroy()  # idempotent


def check_compiled(m, dist, rank, sizes, hidden, weights, ids, transport, mism):
    """Under torch.compile(fullgraph=True) (vLLM's mode) the manager's calls are the custom
    ops epcomm::vllm_gather / vllm_combine / vllm_combine_into: traced without a graph break,
    with the eager results."""
    import torch

    def step(h, w, i):
        g_h, g_w, g_i = m.dispatch(h, w, i)
        y = g_h.float() * 3
        out = torch.empty((h.shape[0], H))
        m.combine_into_output_any(y, out)
        return g_h, g_w, g_i, out, m.combine(y)

    before = dict(m.stats)
    f = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    g_h, g_w, g_i, out, comb = f(hidden, weights, ids)
    y = ref_all_gatherv(dist, hidden, sizes).float() * 3
    for name, got, want in (("hidden", g_h, ref_all_gatherv(dist, hidden, sizes)),
                            ("topk_weights", g_w, ref_all_gatherv(dist, weights, sizes)),
                            ("topk_ids", g_i, ref_all_gatherv(dist, ids, sizes)),
                            ("combine_into_output", out, ref_reduce_scatterv(dist, y, sizes, rank)),
                            ("combine", comb, ref_reduce_scatterv(dist, y, sizes, rank))):
        if got.dtype != want.dtype or not torch.equal(got, want):
            mism.append(f"{transport}: compiled {name}: {got} != {want}")
    if m.stats["dispatches"] != before["dispatches"] + 1 or \
            m.stats["combines"] != before["combines"] + 2:
        mism.append(f"{transport}: compiled: the ops did not run the manager: {m.stats}")


def check_output_rejected(m, y32, rows, mism):
    """combine_into_output writes its output in place: a non-contiguous or float64 output is
    refused on every rank at once (no temporary copied into it)."""
    import torch

    import epcomm

    cases = [
        (torch.empty((H, rows)).t(), "tensor 'output' is not contiguous: strides [1, "),
        (torch.empty((rows, H), dtype=torch.float64), "tensor 'output' has dtype torch.float64"),
    ]
    for bad, want in cases:
        try:
            m.combine_into_output(y32, bad)
            mism.append(f"combine_into_output accepted {bad.dtype} strides {bad.stride()}")
        except epcomm.Error as e:
            if not (isinstance(e, ValueError) and str(e).startswith(want)):
                mism.append(f"combine_into_output: {type(e).__name__}: {e}")


def check_eplb(dist, epcomm_vllm, rank, world, mism):
    """As vLLM's rearrangement calls it: each rank sends its two local experts (row views of a
    float32 [2, 4] and a bfloat16 [2, 2, 3] weight) to the next rank, which receives them into
    row views of its buffers; expert ids label the transfers, pairing is by order."""
    import torch

    def weights(r):
        base = 100 * r
        return [torch.arange(8, dtype=torch.float32).reshape(2, 4) + base,
                (torch.arange(12).reshape(2, 2, 3) + base).to(torch.bfloat16)]

    # As vLLM's EplbState creates it, once installed (the EPLB group's CPU group).
    make = sys.modules["vllm.distributed.eplb.eplb_state"].create_eplb_communicator
    coordinator = types.SimpleNamespace(cpu_group=dist.group.WORLD)
    c = make(coordinator, "torch_gloo", [weights(rank)], weights(rank))
    assert isinstance(c, epcomm_vllm.EpcommEplbCommunicator)
    device_weights = [[types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))]]
    assert make(coordinator, "torch_nccl", device_weights, []) == "vllm's own"
    # vLLM 0.34.0's push backend keeps vLLM's own factory (its checks, its own buffer).
    assert make(coordinator, "symm_mem", [weights(rank)], None) == "vllm's own"
    assert c.needs_profile_buffer_reservation
    # vLLM 0.34.0's interface: not a push backend, the caller's buffer.
    assert c.needs_recv_rows is False and c.owned_expert_buffer is None
    c.set_stream(None)
    c.set_transfer_context(None, 0)
    c.set_transfer_context(None, 0, recv_rows=None)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    mine, bufs = weights(rank), [torch.zeros(2, 4), torch.zeros((2, 2, 3), dtype=torch.bfloat16)]
    for e in range(2):
        c.add_send([w[e] for w in mine], nxt, 2 * rank + e)
        c.add_recv([b[e] for b in bufs], prv, 2 * prv + e)
    c.execute()
    for i, (got, want) in enumerate(zip(bufs, weights(prv))):
        if not torch.equal(got, want):
            mism.append(f"eplb weight {i}: {got} != {want}")
    c.execute()  # an empty queue is a no-op on every rank
    c.destroy()


def fake_vllm():
    """The two vLLM modules epcomm.vllm.install() patches, as stand-ins (no vLLM install)."""
    names = ["vllm", "vllm.distributed", "vllm.distributed.device_communicators",
             "vllm.distributed.device_communicators.all2all", "vllm.distributed.eplb",
             "vllm.distributed.eplb.eplb_state"]
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[names[3]].AgRsAll2AllManager = None
    sys.modules[names[5]].create_eplb_communicator = lambda *args: "vllm's own"


def rank_main(mode, rank, world, where):
    import epcomm.vllm as epcomm_vllm

    fake_vllm()
    epcomm_vllm.install()
    epcomm_vllm.install()  # plugins may be loaded more than once
    dist = ranks.init_torch(rank, world, int(where))
    out = {"others_in_dev_shm": ranks.shm_isolated(dist, rank, world), "mismatches": []}
    transports = ("torch", "shm") if mode == "both" else ("torch",)
    for transport in transports:
        check_manager(dist, epcomm_vllm, rank, world, transport, out["mismatches"])
    check_eplb(dist, epcomm_vllm, rank, world, out["mismatches"])
    return out


# ---- the driver -----------------------------------------------------------------------------


class VllmTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        ranks.keep_library()
        cls.prefix = ranks.unshare_prefix()

    def run_world(self, mode, world, prefix):
        runs = ranks.run_ranks(self, mode, world, ranks.free_port(), prefix,
                               script=os.path.abspath(__file__))
        for rank in range(world):
            self.assertEqual(runs[rank]["mismatches"], [], f"rank {rank}")
        return runs

    def test_two_ranks_torch_transport_isolated(self):
        runs = self.run_world("torch", 2, self.prefix)
        if self.prefix is not None:
            for rank, r in runs.items():
                self.assertEqual(r["others_in_dev_shm"], 0, f"rank {rank} sees /dev/shm")

    def test_two_ranks_torch_and_shm_transports(self):
        self.run_world("both", 2, None)

    def test_four_ranks_torch_transport_isolated(self):
        runs = self.run_world("torch", 4, self.prefix)
        if self.prefix is not None:
            for rank, r in runs.items():
                self.assertEqual(r["others_in_dev_shm"], 0, f"rank {rank} sees /dev/shm")

    def test_four_ranks_torch_and_shm_transports(self):
        self.run_world("both", 4, None)

    def test_plugin_local_routes(self):
        """The vLLM plugin's expert-map fix: global top-k routes made local, a non-local
        expert's route weight 0 and a valid local id."""
        import torch

        from epcomm.vllm_plugin import local_routes

        expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)  # rank 1
        ids = torch.tensor([[0, 5], [7, 4], [3, 1]], dtype=torch.int32)
        w = torch.tensor([[0.25, 0.75], [0.5, 0.5], [0.125, 0.875]])
        w2, ids2, non_local = local_routes(w, ids, expert_map)
        self.assertEqual(ids2.tolist(), [[0, 1], [3, 0], [0, 0]])
        self.assertEqual(ids2.dtype, torch.int32)
        self.assertEqual(w2.tolist(), [[0.0, 0.75], [0.5, 0.5], [0.0, 0.0]])
        self.assertEqual(non_local.tolist(), [[True, False], [False, False], [True, True]])

    def test_plugin_reads_expert_map(self):
        """The behaviour check: whether a method's body reads ``expert_map``."""
        from epcomm.vllm_plugin import apply_uses_expert_map

        def ignores(self, topk_ids, expert_map):
            return topk_ids

        def reads(self, topk_ids, expert_map):
            return expert_map[topk_ids]

        self.assertIs(apply_uses_expert_map(ignores), False)
        self.assertIs(apply_uses_expert_map(reads), True)


if __name__ == "__main__":
    ranks.main(rank_main)
