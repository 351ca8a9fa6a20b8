"""dispatch + combine through ``Group.from_torch`` against the same traffic written by hand with
torch.distributed's ``all_to_all_single`` (gloo), in the same run, alternating: the median over
the repetitions of the mean time per iteration of each, their ratio, and whether the results
are identical, for each token count and rank count.

    python3 bench_from_torch.py [--tokens 1,128,1024,4096] [--ranks 2,4] [--hidden 7168]
                                [--experts 256] [--top-k 8] [--dtype bfloat16] [--iters 10]
                                [--reps 5] [--threads N] [--send-recv-only] [--profile]

One rank per process, all on 127.0.0.1 (spawned here), or, for ranks in other network
namespaces or on other machines, one process per rank started by hand (scripts/bench-netns.sh
does): ``--rank R --world W --master HOST:PORT`` with each rank's ``GLOO_SOCKET_IFNAME``.

The hand-written version sends each token once to every rank holding one of its experts (the
split sizes exchanged first), the expert side doubles the rows and returns them, and the source
sums them in f32: the traffic of a token-major backend (deepep_high_throughput), which the
epcomm side runs. ``--send-recv-only`` gives epcomm the host transport without its
all_to_allv callback (as before it existed). ``--threads N`` sets torch's intra-op threads in
every rank (both sides; on a machine with fewer cores than ranks x threads, OpenMP threads that
spin for work slow the hand-written side's indexing most). ``--profile`` adds, on rank 0, where epcomm's time
goes: the dispatch and combine calls, and within them the time spent in torch.distributed.
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import epcomm
import epcomm._torch


def inputs(rank, t, h, e, k, dtype):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()  # k distinct experts
    return x, ids, torch.full((t, k), 1.0 / k)


def by_hand(x, ids, e, world):
    """One dispatch + combine with all_to_all_single: rows to each holder rank and back."""
    holder = ids // (e // world)
    held = torch.stack([(holder == r).any(dim=1) for r in range(world)])  # [world, T]
    order = torch.cat([held[r].nonzero().flatten() for r in range(world)])
    send_counts = held.sum(dim=1)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    rows = x.new_empty((sum(rc), x.shape[1]))
    dist.all_to_all_single(rows, x[order], rc, sc)
    back = x.new_empty((len(order), x.shape[1]))
    dist.all_to_all_single(back, rows * 2, sc, rc)
    # Sum in f32 in rank order (as epcomm's combine does), stored in x's dtype.
    acc = torch.zeros(x.shape, dtype=torch.float32).index_add_(0, order, back.float())
    return acc.to(x.dtype)


def by_epcomm(a, x, ids, w):
    d = a.dispatch(x, ids, w)
    out = torch.empty_like(x)
    a.combine(torch.from_dlpack(d["hidden"]) * 2, out)
    return out


def timed(fn, iters):
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
        for name in ("send", "recv", "all_gather", "all_to_allv"):
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
        out = torch.empty_like(x)
        t2 = time.perf_counter()
        a.combine(y, out)
        t3 = time.perf_counter()
        split["dispatch"] += t1 - t0
        split["expert side"] += t2 - t1
        split["combine"] += t3 - t2
    split["in torch.distributed"] = clock.seconds
    return {k: v / iters for k, v in split.items()}


def group(send_recv_only):
    if not send_recv_only:
        return epcomm.Group.from_torch()
    t = epcomm._torch.TorchTransport()
    return epcomm.Group.host(t.send, t.recv, t.all_gather, rank=t.rank,
                             world_size=t.world_size, name="torch")


def run_rank(rank, world, init_method, args):
    """This rank's rows of the table (rank 0's are the ones printed)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    clock = TransportClock() if args.profile else None
    dtype = getattr(torch, args.dtype)
    rows = []
    for t in args.tokens:
        x, ids, w = inputs(rank, t, args.hidden, args.experts, args.top_k, dtype)
        with group(args.send_recv_only) as g, epcomm.All2All(
            g, "deepep_high_throughput", num_experts=args.experts, top_k=args.top_k,
            hidden_size=args.hidden, dtype=dtype, max_tokens_per_rank=t,
        ) as a:
            ep_fn = lambda: by_epcomm(a, x, ids, w)  # noqa: E731
            hand_fn = lambda: by_hand(x, ids, args.experts, world)  # noqa: E731
            same = torch.equal(ep_fn(), hand_fn())  # also the warm-up of both
            agreed = torch.tensor([int(same)])
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            ep, hand = [], []
            for _ in range(args.reps):  # alternating, so both see the same load
                ep.append(timed(ep_fn, args.iters))
                hand.append(timed(hand_fn, args.iters))
            split = profile(a, x, ids, w, args.iters, clock) if clock else None
        rows.append((t, statistics.median(ep), statistics.median(hand), bool(agreed.item()),
                     split))
    dist.destroy_process_group()
    return rows


def spawned(rank, world, port, args, results):
    rows = run_rank(rank, world, f"tcp://127.0.0.1:{port}", args)
    if rank == 0:
        results[world] = rows


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("--tokens", default=[1, 128, 1024, 4096], type=ints)
    p.add_argument("--ranks", default=[2, 4], type=ints)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads per rank")
    p.add_argument("--send-recv-only", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--rank", type=int, help="run this one rank (with --world and --master)")
    p.add_argument("--world", type=int)
    p.add_argument("--master", help="HOST:PORT of rank 0's rendezvous")
    return p.parse_args()


def report(args, results, where):
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"gloo over {where}, H={args.hidden} {args.dtype}, top-{args.top_k} of "
          f"{args.experts} experts, {args.iters} iterations x {args.reps} repetitions "
          f"(medians), epcomm {'without' if args.send_recv_only else 'with'} the all_to_allv "
          f"callback, libepcomm {epcomm.version()}, load average {load}, {os.cpu_count()} CPUs, "
          f"torch threads per rank {args.threads or torch.get_num_threads()}")
    print()
    print("| T | R | from_torch (ms) | all_to_all_single (ms) | ratio | same result |")
    print("|---:|---:|---:|---:|---:|:---:|")
    for world, rows in results:
        for t, ep, hand, same, _ in rows:
            print(f"| {t} | {world} | {ep * 1e3:.2f} | {hand * 1e3:.2f} | {ep / hand:.2f} | "
                  f"{'yes' if same else 'NO'} |")
    for world, rows in results:
        for t, _, _, _, split in rows:
            if split:
                parts = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in split.items())
                print(f"T={t} R={world} per iteration on rank 0: {parts}")


def main():
    args = parse()
    if args.rank is not None:
        rows = run_rank(args.rank, args.world, f"tcp://{args.master}", args)
        if args.rank == 0:
            report(args, [(args.world, rows)], f"tcp://{args.master}")
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = tmp.Manager().dict()
    for world in args.ranks:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        tmp.spawn(spawned, args=(world, port, args, results), nprocs=world, join=True)
    report(args, [(w, results[w]) for w in args.ranks], "127.0.0.1")


if __name__ == "__main__":
    main()
