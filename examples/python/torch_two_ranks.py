"""The two-rank worked example with torch tensors over torch.distributed (gloo), the way ranks
on different machines would run it: ``epcomm.Group.from_torch`` carries epcomm's traffic over
the process group, and dispatch's outputs are viewed with ``torch.from_dlpack`` (no copies).

    python3 torch_two_ranks.py deepep_low_latency
"""
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import epcomm

X = [torch.tensor([[10.0], [11.0], [12.0]]), torch.tensor([[20.0], [21.0]])]
IDS = [torch.tensor([[0, 2], [1, 0], [3, -1]]), torch.tensor([[2, 3], [1, -1]])]
W = [torch.tensor([[.5, .5], [.25, .75], [1, 0]]), torch.tensor([[.5, .5], [1, 0]])]
WANT = [[20.0, 13.75, 48.0], [70.0, 42.0]]


def expert_side(rank, d):
    """Expert e computes (e+1)*x, for every layout (the contract says who applies weights)."""
    x = torch.from_dlpack(d["hidden"]).clone()
    if len(d["topk_ids"].shape) == 2:  # rows carry their ids
        ids, w = torch.from_dlpack(d["topk_ids"]), torch.from_dlpack(d["topk_weights"])
        rows = x.reshape(ids.shape[0], -1)
        mine = (ids >= 0) & (ids // 2 == rank)
        scale = (w * (ids + 1) * mine).sum(dim=1, keepdim=True)
        return (rows * scale).reshape(x.shape)
    if d["expert_offsets"].shape[0]:  # packed per expert
        off = torch.from_dlpack(d["expert_offsets"]).tolist()
        for j in range(2):
            x[off[j]:off[j + 1]] *= rank * 2 + j + 1
        return x
    for j in range(2):  # fixed-capacity buckets per expert
        x[j] *= rank * 2 + j + 1
    return x


def rank_main(rank, backend, port, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    with epcomm.Group.from_torch() as g, epcomm.All2All(
        g, backend, num_experts=4, top_k=2, hidden_size=1, max_tokens_per_rank=3
    ) as a:
        d = a.dispatch(X[rank], IDS[rank], W[rank], views=True)
        out = torch.zeros_like(X[rank])
        a.combine(expert_side(rank, d), out)
    results[rank] = out.reshape(-1).tolist()
    dist.destroy_process_group()
    # The process ends here, without the interpreter's teardown: torch's gloo process group
    # sometimes aborts in it ("terminate called without an active exception", SIGABRT, while
    # its worker threads still hold work), after everything above is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    backend = sys.argv[1] if len(sys.argv) > 1 else "deepep_high_throughput"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = tmp.Manager().dict()
    tmp.spawn(rank_main, args=(backend, port, results), nprocs=2, join=True)
    print(f"{backend}: rank 0 -> {results[0]}, rank 1 -> {results[1]}")
    sys.exit(0 if [results[0], results[1]] == WANT else 1)
