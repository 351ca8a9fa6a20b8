"""dispatch + combine through ``Group.from_torch`` against the same traffic written by hand with
torch.distributed's ``all_to_all_single`` (gloo, two processes on 127.0.0.1), in the same run:
the mean time per iteration of each and their ratio, for each token count.

    python3 bench_from_torch.py [--tokens 128,1024,4096] [--hidden 7168] [--experts 256]
                                [--top-k 8] [--dtype bfloat16] [--iters 10] [--profile]

The hand-written version sends each token once to every rank holding one of its experts (the
split sizes exchanged first), the expert side returns the rows, and the source sums them: the
traffic of a token-major backend (deepep_high_throughput), which the epcomm side runs; both
results are compared once. ``--profile`` adds, on rank 0, where epcomm's time goes: the
dispatch and combine calls, and within them the time spent in torch.distributed's
send/recv/all_gather (the transport) versus epcomm itself.
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import epcomm
import epcomm._torch

WORLD = 2


def inputs(rank, t, h, e, k, dtype):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()  # k distinct experts
    return x, ids, torch.full((t, k), 1.0 / k)


def by_hand(x, ids, e):
    """One dispatch + combine with all_to_all_single: rows to each holder rank and back."""
    holder = ids // (e // WORLD)
    held = torch.stack([(holder == r).any(dim=1) for r in range(WORLD)])  # [WORLD, T]
    order = torch.cat([held[r].nonzero().flatten() for r in range(WORLD)])
    send_counts = held.sum(dim=1)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    rows = x.new_empty((int(recv_counts.sum()), x.shape[1]))
    dist.all_to_all_single(rows, x[order], recv_counts.tolist(), send_counts.tolist())
    back = x.new_empty((len(order), x.shape[1]))
    dist.all_to_all_single(back, rows * 2, send_counts.tolist(), recv_counts.tolist())
    return torch.zeros_like(x).index_add_(0, order, back)


def by_epcomm(a, x, ids, w):
    d = a.dispatch(x, ids, w)
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


class TransportClock:
    """Wraps TorchTransport's methods to sum the seconds spent inside torch.distributed."""

    def __init__(self):
        self.seconds = 0.0
        cls = epcomm._torch.TorchTransport
        for name in ("send", "recv", "all_gather"):
            setattr(cls, name, self._wrap(getattr(cls, name)))

    def _wrap(self, fn):
        def timed_call(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed_call


def profile(a, x, ids, w, iters, clock):
    """Seconds per iteration: dispatch, combine, and the transport's share of them."""
    split = {"dispatch": 0.0, "expert side": 0.0, "combine": 0.0}
    clock.seconds = 0.0
    for _ in range(iters):
        t0 = time.perf_counter()
        d = a.dispatch(x, ids, w)
        t1 = time.perf_counter()
        y = torch.from_dlpack(d["hidden"]) * 2
        out = torch.zeros_like(x)
        t2 = time.perf_counter()
        a.combine(y, out)
        t3 = time.perf_counter()
        split["dispatch"] += t1 - t0
        split["expert side"] += t2 - t1
        split["combine"] += t3 - t2
    split["in torch.distributed"] = clock.seconds
    return {k: v / iters for k, v in split.items()}


def rank_main(rank, port, args, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    clock = TransportClock() if args.profile else None
    dtype = getattr(torch, args.dtype)
    for t in args.tokens:
        x, ids, w = inputs(rank, t, args.hidden, args.experts, args.top_k, dtype)
        with epcomm.Group.from_torch() as g, epcomm.All2All(
            g, "deepep_high_throughput", num_experts=args.experts, top_k=args.top_k,
            hidden_size=args.hidden, dtype=dtype, max_tokens_per_rank=t,
        ) as a:
            same = torch.equal(by_epcomm(a, x, ids, w), by_hand(x, ids, args.experts))
            ep = timed(lambda: by_epcomm(a, x, ids, w), args.iters)
            split = profile(a, x, ids, w, args.iters, clock) if clock else None
        hand = timed(lambda: by_hand(x, ids, args.experts), args.iters)
        if rank == 0:
            results[t] = (ep, hand, same, split)
    dist.destroy_process_group()


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="128,1024,4096",
                   type=lambda s: [int(v) for v in s.split(",")])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    return p.parse_args()


def main():
    args = parse()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = tmp.Manager().dict()
    tmp.spawn(rank_main, args=(port, args, results), nprocs=WORLD, join=True)
    print(f"{WORLD} ranks over gloo, H={args.hidden} {args.dtype}, top-{args.top_k} of "
          f"{args.experts} experts, {args.iters} iterations, libepcomm {epcomm.version()}")
    print("| T | from_torch (ms) | all_to_all_single (ms) | ratio | same result |")
    print("|---|---|---|---|---|")
    for t in args.tokens:
        ep, hand, same, _ = results[t]
        print(f"| {t} | {ep * 1e3:.2f} | {hand * 1e3:.2f} | {ep / hand:.2f} | {same} |")
    for t in args.tokens:
        split = results[t][3]
        if split:
            parts = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in split.items())
            print(f"T={t} per iteration on rank 0: {parts}")


if __name__ == "__main__":
    main()
