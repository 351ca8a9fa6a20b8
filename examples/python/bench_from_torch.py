"""dispatch + combine through ``Group.from_torch`` against the same traffic written by hand with
torch.distributed's ``all_to_all_single`` (gloo, two processes on 127.0.0.1): the mean time per
iteration of each and their ratio.

    python3 bench_from_torch.py [tokens_per_rank] [hidden] [iterations]

The hand-written version sends each token once to every rank holding one of its experts (the
split sizes exchanged first), the expert side returns the rows, and the source sums them: the
traffic of a token-major backend (deepep_high_throughput) without the top-k weights.
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import epcomm

E, K, WORLD = 16, 2, 2


def inputs(rank, t, h):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    return x, ids, torch.full((t, K), 1.0 / K)


def by_hand(x, ids):
    """One dispatch + combine with all_to_all_single: rows to each holder rank and back."""
    holder = ids // (E // WORLD)
    pairs = [(tok, r) for r in range(WORLD) for tok in range(x.shape[0]) if (holder[tok] == r).any()]
    order = torch.tensor([tok for tok, _ in pairs])
    send_counts = torch.tensor([sum(1 for _, r in pairs if r == p) for p in range(WORLD)])
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    rows = torch.empty(int(recv_counts.sum()), x.shape[1])
    dist.all_to_all_single(rows, x[order].contiguous(), recv_counts.tolist(), send_counts.tolist())
    back = torch.empty(len(pairs), x.shape[1])
    dist.all_to_all_single(back, rows * 2, send_counts.tolist(), recv_counts.tolist())
    return torch.zeros_like(x).index_add_(0, order, back)


def by_epcomm(a, x, ids, w):
    d = a.dispatch(x, ids, w, views=True)
    out = torch.zeros_like(x)
    a.combine(torch.from_dlpack(d["hidden"]) * 2, out)
    return out


def timed(fn, iters):
    fn()  # warm-up
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / iters


def rank_main(rank, port, t, h, iters, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    x, ids, w = inputs(rank, t, h)
    with epcomm.Group.from_torch() as g, epcomm.All2All(
        g, "deepep_high_throughput", num_experts=E, top_k=K, hidden_size=h, max_tokens_per_rank=t
    ) as a:
        ep = timed(lambda: by_epcomm(a, x, ids, w), iters)
    hand = timed(lambda: by_hand(x, ids), iters)
    if rank == 0:
        results["epcomm"], results["hand"] = ep, hand
    dist.destroy_process_group()


if __name__ == "__main__":
    t, h, iters = (int(v) for v in (sys.argv[1:] + ["256", "1024", "20"][len(sys.argv) - 1:])[:3])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = tmp.Manager().dict()
    tmp.spawn(rank_main, args=(port, t, h, iters, results), nprocs=WORLD, join=True)
    ep, hand = results["epcomm"], results["hand"]
    print(f"{WORLD} ranks, {t} tokens x {h} float32, top-{K} of {E} experts, {iters} iterations: "
          f"from_torch {ep * 1e3:.2f} ms, all_to_all_single by hand {hand * 1e3:.2f} ms, "
          f"ratio {ep / hand:.2f}")
