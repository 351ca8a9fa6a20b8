"""Fault-tolerant expert parallelism in the epcomm package, used as a vLLM user would.

``epcomm.All2All(..., enable_fault_tolerance=True)`` on deepep_low_latency with 4 thread
ranks: rank 3 stalls past the timeout; the survivors' call in progress raises epcomm's
TIMEOUT (a TimeoutError naming rank 3), then they go on over their own group with rank 3
masked: every output equals a numpy float32 reference with rank 3's experts left out,
``query_active_mask()`` is [0, 0, 0, 1] on every survivor, ``query_fault()`` is True until
``clean_buffers()``, ``stats()["dropped_pairs"]`` counts the pairs sent nowhere; rank 3 never
completes a call again. ``epcomm.vllm.EpcommAll2AllManager(..., enable_fault_tolerance=True)``
(4 processes over gloo, when torch is importable): the same through vLLM's
``query_active_mask`` (an int32 tensor) / ``query_fault`` (a bool tensor) / ``clean_buffers``
after a rank is SIGKILLed. Other backends refuse fault tolerance with vLLM's ValueError.

    PYTHONPATH=python EPCOMM_LIBRARY=target/debug/libepcomm.so python3 tests/py/test_ft.py -v
"""

import multiprocessing
import os
import queue
import signal
import threading
import time
import unittest

import numpy as np

import epcomm

try:
    import torch
except ImportError:
    torch = None
    if os.environ.get("EPCOMM_REQUIRE_TORCH") == "1":
        raise

WORLD, E, K, H, M = 4, 8, 2, 16, 8
TIMEOUT_S = 0.8


def unique(tag):
    return f"pyft-{tag}-{os.getpid()}"


def inputs(step, rank):
    t = 3 + (step + rank) % 4
    rng = np.random.default_rng(100 * step + rank)
    x = rng.standard_normal((t, H)).astype(np.float32)
    first = rng.integers(0, E, t)
    ids = np.stack([first, (first + 3) % E], axis=1).astype(np.int64)
    w = rng.uniform(0.25, 1.0, (t, K)).astype(np.float32)
    return x, ids, w


def expert(e, x):
    """Toy expert e: an affine map, the same on every rank."""
    return x * (1.0 + 0.125 * e) + 0.0625 * e


def reference(x, ids, w, mask):
    per = E // WORLD
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(ids[t, k])
            if mask[e // per] == 0:
                out[t] += w[t, k] * expert(e, x[t])
    return out


def step(a2a, rank, s):
    """One dispatch, the experts, one combine; returns the largest error and the mask."""
    x, ids, w = inputs(s, rank)
    d = a2a.dispatch(x, ids, w, views=False)
    per = E // WORLD
    y = np.zeros_like(d["hidden"])
    for j in range(per):
        n = int(d["counts"][j])
        y[j, :n] = expert(rank * per + j, d["hidden"][j, :n])
    out = np.zeros((x.shape[0], H), dtype=np.float32)
    a2a.combine(y, out)
    mask = a2a.query_active_mask()
    want = reference(x, ids, w, mask)
    return float(np.max(np.abs(out - want), initial=0.0)), mask


def stalled_rank(name, rank, results):
    g = epcomm.Group(name, rank, WORLD, timeout_s=TIMEOUT_S)
    a2a = epcomm.All2All(g, "deepep_low_latency", E, K, H, max_tokens_per_rank=M,
                         enable_fault_tolerance=True)
    out = {"steps": []}
    steps = 2 if rank == 3 else 6
    for s in range(steps):
        try:
            out["steps"].append(("ok",) + step(a2a, rank, s))
        except epcomm.Error as e:
            out["steps"].append(("error", type(e).__name__, str(e)))
    if rank == 3:
        time.sleep(3 * TIMEOUT_S)
        try:
            step(a2a, rank, 2)
            out["after"] = "completed"
        except epcomm.Error as e:
            out["after"] = str(e)
    out["fault"] = a2a.query_fault()
    out["dropped_total"] = a2a.stats()["dropped_pairs_total"]
    a2a.clean_buffers()
    out["fault_after_clean"] = a2a.query_fault()
    out["mask_after_clean"] = a2a.query_active_mask()
    a2a.close()
    g.close()
    results[rank] = out


class FaultTolerantAll2AllTest(unittest.TestCase):
    def test_a_stalled_rank_is_masked_and_the_survivors_go_on(self):
        name, results = unique("stall"), {}
        threads = [threading.Thread(target=stalled_rank, args=(name, r, results))
                   for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(sorted(results), list(range(WORLD)))
        for rank in range(3):
            r = results[rank]["steps"]
            self.assertEqual([x[0] for x in r[:2]], ["ok", "ok"], r)
            self.assertEqual(r[2][0], "error")
            # Step 2's first op, dispatch's header exchange (op 11: the join, then 5 per step), named
            # as the user's call.
            self.assertEqual(r[2][1:], ("TimeoutError", (
                f"timed out after 0.8 s in dispatch of group '{name}' (op #11) waiting for "
                "rank(s) 3")))
            for s in r[3:]:
                self.assertEqual(s[0], "ok", r)
                self.assertLessEqual(s[1], 1e-5)
                self.assertEqual(s[2], [0, 0, 0, 1])
            self.assertTrue(results[rank]["fault"])
            self.assertGreater(results[rank]["dropped_total"], 0)
            self.assertFalse(results[rank]["fault_after_clean"])
            self.assertEqual(results[rank]["mask_after_clean"], [0, 0, 0, 1])
        self.assertNotEqual(results[3]["after"], "completed")
        self.assertEqual([f for f in os.listdir("/dev/shm") if name in f], [])

    def test_other_backends_refuse_fault_tolerance_with_vllms_message(self):
        g = epcomm.Group(unique("refuse"), 0, 1)
        with self.assertRaises(ValueError) as cm:
            epcomm.All2All(g, "deepep_high_throughput", E, K, H, enable_fault_tolerance=True)
        self.assertEqual(
            str(cm.exception),
            "Fault tolerance requires an FT-capable all2all backend (one of "
            "['deepep_low_latency', 'nixl_ep']), but got 'deepep_high_throughput'.")
        a2a = epcomm.All2All(g, "nixl_ep", E, K, H, max_tokens_per_rank=M,
                             enable_fault_tolerance=True)
        self.assertEqual(a2a.query_active_mask(), [0])
        self.assertFalse(a2a.query_fault())
        a2a.close()
        g.close()


# ---- epcomm.vllm over gloo processes --------------------------------------------------------

# spawn: a fresh interpreter per rank (gloo does not start in a child forked after torch was
# imported).
MP = multiprocessing.get_context("spawn")


def vllm_rank(rank, port, victim, q):
    from datetime import timedelta

    import torch.distributed as dist

    import epcomm.vllm as ev

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=30))
    m = ev.EpcommAll2AllManager(dist.group.WORLD, transport="shm", timeout_s=TIMEOUT_S,
                                enable_fault_tolerance=True)
    a2a = m.get_handle(dict(backend="deepep_low_latency", num_experts=E, top_k=K,
                            hidden_size=H, max_tokens_per_rank=M))
    out = {"support": m.support_fault_tolerance, "steps": []}
    for s in range(5):
        if rank == victim and s == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            out["steps"].append(("ok",) + step(a2a, rank, s))
        except epcomm.Error as e:
            out["steps"].append(("error", type(e).__name__, str(e)))
    mask = m.query_active_mask()
    out["mask"] = (str(mask.dtype), mask.tolist())
    fault = m.query_fault()
    out["fault"] = (str(fault.dtype), tuple(fault.shape), bool(fault))
    m.clean_buffers()
    out["fault_after_clean"] = bool(m.query_fault())
    # vLLM v0.34.0's sentinel replays the dead ranks after clean_buffers.
    m.update_mask(victim, masked=True)
    out["fault_after_replay"] = bool(m.query_fault())
    try:
        m.update_mask((victim + 1) % WORLD, masked=True)
        out["mask_live"] = "no error"
    except epcomm.Error as e:
        out["mask_live"] = type(e).__name__
    m.destroy()
    q.put((rank, out))
    q.close()
    q.join_thread()  # the queue's feeder thread has sent it
    os._exit(0)  # skip gloo's teardown (the victim's sockets are gone)


@unittest.skipIf(torch is None, "torch is not importable")
class VllmManagerTest(unittest.TestCase):
    def test_vllm_query_active_mask_query_fault_clean_buffers(self):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        victim, q = 1, MP.Queue()
        procs = [MP.Process(target=vllm_rank, args=(r, port, victim, q)) for r in range(WORLD)]
        for p in procs:
            p.start()
        got, end = {}, time.monotonic() + 120
        while len(got) < WORLD - 1 and time.monotonic() < end:
            try:
                rank, out = q.get(timeout=0.1)
                got[rank] = out
            except queue.Empty:
                pass
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        self.assertEqual(sorted(got), [r for r in range(WORLD) if r != victim])
        for rank, out in got.items():
            self.assertTrue(out["support"])
            steps = out["steps"]
            self.assertEqual([s[0] for s in steps], ["ok", "ok", "error", "ok", "ok"], steps)
            self.assertEqual(steps[2][1], "RuntimeError", steps[2])
            self.assertIn(f"rank {victim} of group", steps[2][2])
            for s in steps[3:]:
                self.assertLessEqual(s[1], 1e-5)
                self.assertEqual(s[2], [0, 1, 0, 0])
            self.assertEqual(out["mask"], ("torch.int32", [0, 1, 0, 0]))
            self.assertEqual(out["fault"], ("torch.bool", (), True))
            self.assertFalse(out["fault_after_clean"])
            self.assertFalse(out["fault_after_replay"])
            self.assertEqual(out["mask_live"], "RuntimeError")


if __name__ == "__main__":
    unittest.main()
