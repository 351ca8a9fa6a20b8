"""Two ranks (multiprocessing) dispatch and combine the two-rank worked example with numpy.

Rank 0 holds tokens 10, 11, 12 and rank 1 tokens 20, 21 (hidden size 1); 4 experts, 2 per
rank, top-2 routing. With expert e computing (e+1)*x, combine gives [20, 13.75, 48] on rank 0
and [70, 42] on rank 1 whatever the backend's layout.

    python3 moe_two_ranks.py deepep_v2
"""
import multiprocessing as mp
import os
import queue
import sys
import time

import numpy as np

import epcomm

X = [np.array([[10], [11], [12]], np.float32), np.array([[20], [21]], np.float32)]
IDS = [np.array([[0, 2], [1, 0], [3, -1]], np.int32), np.array([[2, 3], [1, -1]], np.int32)]
W = [np.array([[.5, .5], [.25, .75], [1, 0]], np.float32), np.array([[.5, .5], [1, 0]], np.float32)]
TIMEOUT_S = 60


def expert_side(rank, d):
    """Expert e computes (e+1)*x; the layout's contract says who applies the weights."""
    x = d["hidden"].astype(np.float32)
    y = np.zeros_like(x)
    flat, fy = x.reshape(-1), y.reshape(-1)
    if d["topk_ids"].ndim == 2:  # token-, rank-major and replicated rows carry their ids
        ids, w = d["topk_ids"], d["topk_weights"]
        for r in range(flat.size):
            for k in range(ids.shape[1]):
                e = ids[r, k]
                if e >= 0 and e // 2 == rank:
                    fy[r] += w[r, k] * (e + 1) * flat[r]
    elif d["expert_offsets"].size:  # packed per expert
        for r in range(flat.size):
            j = 0 if r < d["expert_offsets"][1] else 1
            fy[r] = (rank * 2 + j + 1) * flat[r]
    else:  # fixed-capacity buckets per expert
        cap = x.shape[1]
        for r in range(flat.size):
            fy[r] = (rank * 2 + r // cap + 1) * flat[r]
    return y


def rank_main(rank, backend, name, q):
    with epcomm.Group.shm(name, rank, 2, timeout_s=TIMEOUT_S) as g, epcomm.All2All(
        g, backend, num_experts=4, top_k=2, hidden_size=1, max_tokens_per_rank=3
    ) as a:
        # Buffers over epcomm's memory; numpy views of them (no copies), valid until the next
        # dispatch.
        d = {k: np.asarray(v) for k, v in a.dispatch(X[rank], IDS[rank], W[rank]).items()}
        out = np.zeros_like(X[rank])
        a.combine(expert_side(rank, d), out)
    q.put((rank, out.ravel().tolist()))


def collect(procs, q):
    """Each rank's result; stops at once when a rank exits without one."""
    results, deadline = {}, time.monotonic() + TIMEOUT_S
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            rank, values = q.get(timeout=0.2)
            results[rank] = values
        except queue.Empty:
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                sys.exit(f"rank {failed[0]} failed (exit code {procs[failed[0]].exitcode})")
    if len(results) < len(procs):
        sys.exit(f"no result from every rank within {TIMEOUT_S} s")
    return results


if __name__ == "__main__":
    backend = sys.argv[1] if len(sys.argv) > 1 else "deepep_high_throughput"
    name = f"example-py-{os.getpid()}"
    q = mp.Queue()
    procs = [mp.Process(target=rank_main, args=(r, backend, name, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = collect(procs, q)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    print(f"{backend}: rank 0 -> {results[0]}, rank 1 -> {results[1]}")
    sys.exit(0 if results[0] == [20.0, 13.75, 48.0] and results[1] == [70.0, 42.0] else 1)
