"""vLLM's own EPLB weight rearrangement (``rearrange_expert_weights_inplace`` in
vllm/distributed/eplb/rebalance_execute.py, from the installed vLLM) on CPU expert weights,
moving them through ``epcomm.vllm.EpcommEplbCommunicator``: how a runtime that runs vLLM's
rearrangement on CPU uses epcomm (vLLM itself refuses ``enable_eplb`` on CPU).

    python eplb.py          (2 gloo processes; prints PASS lines, exits non-zero on a mismatch)

Each rank holds 4 physical experts of 2 MoE layers, two weights per expert of different row
sizes, every row filled with its logical expert's id; after the rearrangement to a new seeded
placement (with redundant experts in layer 1) every local row must hold the expert the new
placement puts there, for both transports (gloo and shared memory).
"""

import os
import socket
import sys

WORLD, LOCAL, LAYERS = 2, 4, 2
SIZES = (24, 40)  # two weights per expert, of different row sizes


def placements():
    import torch

    g = torch.Generator().manual_seed(5)
    phys = WORLD * LOCAL
    old = torch.stack([torch.arange(phys), torch.tensor([0, 1, 2, 3, 4, 5, 0, 1])])
    new = torch.stack([torch.randperm(phys, generator=g),
                       torch.tensor([0, 1, 2, 3, 4, 5, 2, 3])[torch.randperm(phys, generator=g)]])
    return old, new


def weights_for(indices, rank):
    """Rows of each local physical expert filled with (logical id + 1) * (weight index + 1)."""
    import torch

    out = []
    for layer in range(LAYERS):
        ws = []
        for wi, size in enumerate(SIZES):
            w = torch.empty((LOCAL, size), dtype=torch.float32)
            for i in range(LOCAL):
                e = int(indices[layer, rank * LOCAL + i])
                w[i] = (e + 1) * (wi + 1) + torch.arange(size, dtype=torch.float32) / 1000
            ws.append(w)
        out.append(ws)
    return out


def worker(rank, port, transport, q):
    try:
        import torch
        import torch.distributed as dist

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace

        from epcomm.vllm import EpcommEplbCommunicator

        old, new = placements()
        weights = weights_for(old, rank)
        buffers = [torch.empty_like(w) for w in weights[0]]
        want = weights_for(new, rank)
        # The new placement really moves this rank's experts (else the check proves nothing).
        assert any(not torch.equal(weights[layer][wi], want[layer][wi])
                   for layer in range(LAYERS) for wi in range(len(SIZES)))
        comm = EpcommEplbCommunicator(dist.group.WORLD, transport=transport)
        rearrange_expert_weights_inplace(old, new, weights, buffers, dist.group.WORLD, comm)
        bad = [(layer, wi) for layer in range(LAYERS) for wi in range(len(SIZES))
               if not torch.equal(weights[layer][wi], want[layer][wi])]
        comm.destroy()
        dist.destroy_process_group()
        q.put((rank, bad, None))
    except BaseException as e:  # reported by the parent
        q.put((rank, None, f"{type(e).__name__}: {e}"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    failed = False
    for transport in ("torch", "shm"):
        q = ctx.Queue()
        port = free_port()
        ps = [ctx.Process(target=worker, args=(r, port, transport, q)) for r in range(WORLD)]
        for p in ps:
            p.start()
        results = []
        for _ in ps:
            try:
                results.append(q.get(timeout=300))
            except Exception:
                results.append((None, None, "timed out after 300 s"))
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        errors = [f"rank {r}: {err}" for r, bad, err in results if err]
        wrong = [f"rank {r}: layers/weights {bad}" for r, bad, err in results if bad]
        if errors or wrong:
            failed = True
            print(f"FAIL {transport}: " + "; ".join(errors + wrong))
        else:
            print(f"PASS {transport}: vLLM's rearrange_expert_weights_inplace moved every "
                  f"expert ({LAYERS} layers, {WORLD} ranks x {LOCAL} experts)")
    if failed:
        return 1
    print(f"PASS vllm rebalance_execute over EpcommEplbCommunicator: {WORLD} ranks, every "
          "rank's expert weights equal the new placement's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
