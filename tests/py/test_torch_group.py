"""epcomm.Group.from_torch: a host-transport group over torch.distributed (gloo on 127.0.0.1).

With 2 and 4 ranks, each a real process that, where `unshare` is permitted, runs in its own IPC
and mount namespace with a private /dev/shm (so the ranks cannot share memory: each checks it
cannot see the others' files there), dispatch + combine through one backend of every layout and
an EPLB rearrangement give byte-identical results to the shared-memory group's on the same
inputs. A dead peer, or one that stops answering, surfaces on the survivor as an epcomm.Error
(at once, or when gloo's short timeout fires).

    PYTHONPATH=python EPCOMM_LIBRARY=target/debug/libepcomm.so python3 tests/py/test_torch_group.py -v
"""

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

# One backend per layout: REPLICATED, TOKEN_MAJOR, EXPERT_MAJOR, EXPERT_PACKED, RANK_MAJOR.
BACKENDS = (
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "flashinfer_nvlink_two_sided",
)
E, K, H, M = 8, 2, 8, 8  # experts, top-k, hidden size, max tokens per rank
LAYERS, LOCAL_SLOTS, COLS = 2, 2, 4
# How long one rank may take, and gloo's own timeout (what fires for a dead peer).
RANK_TIMEOUT_S = 120
GLOO_TIMEOUT_S = 10
SHM_PROBE = "/dev/shm/epcomm-torch-group-probe-%d"

# ---- a rank ---------------------------------------------------------------------------------


def inputs(rank, world):
    import numpy as np

    rng = np.random.default_rng(1000 * world + rank)
    t = 3 + rank
    x = rng.standard_normal((t, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(t)]).astype(np.int64)
    ids[-1, -1] = -1  # an unused slot
    w = rng.random((t, K)).astype(np.float32)
    return x, ids, w


def valid_rows(d):
    """The dispatch outputs without bucket padding (whose bytes are unspecified)."""
    import numpy as np

    v = {k: d[k] for k in ("hidden", "topk_ids", "topk_weights", "counts", "expert_offsets",
                           "src_rank", "src_token")}
    if d["layout"] in ("EXPERT_MAJOR", "RANK_MAJOR"):  # buckets with padding rows
        buckets = d["hidden"].shape[0]
        mask = np.arange(d["hidden"].shape[1])[None, :] < d["counts"][:, None]
        v["hidden"] = d["hidden"][mask]
        for k in ("topk_ids", "topk_weights"):
            if d[k].size:
                v[k] = d[k].reshape((buckets, -1) + d[k].shape[1:])[mask]
    return v


def all2all_results(epcomm, g, rank, world):
    import numpy as np

    out = {}
    x, ids, w = inputs(rank, world)
    for backend in BACKENDS:
        with epcomm.All2All(g, backend, num_experts=E, top_k=K, hidden_size=H,
                            max_tokens_per_rank=M) as a:
            d = a.dispatch(x, ids, w, views=False)  # numpy copies
            for k, arr in valid_rows(d).items():
                out[f"{backend}.dispatch.{k}"] = np.ascontiguousarray(arr).tobytes().hex()
            y = d["hidden"].astype(np.float32) * 2
            if d["layout"] in ("EXPERT_MAJOR", "RANK_MAJOR"):  # buckets with padding rows
                mask = np.arange(y.shape[1])[None, :] < d["counts"][:, None]
                y[~mask] = 0
            combined = np.zeros_like(x)
            a.combine(y, combined)
            out[f"{backend}.combine"] = combined.tobytes().hex()
    return out


def eplb_results(epcomm, g, rank, world):
    import numpy as np

    slots = LOCAL_SLOTS * world
    old = [list(range(slots)) for _ in range(LAYERS)]
    rng = np.random.default_rng(world)
    new = [rng.permutation(slots).tolist() for _ in range(LAYERS)]
    weights = []
    for layer in range(LAYERS):
        mine = old[layer][rank * LOCAL_SLOTS:(rank + 1) * LOCAL_SLOTS]
        t = np.array([[e * 100 + layer * 10 + c for c in range(COLS)] for e in mine],
                     np.float32)
        weights.append([t])
    batched = [[t.copy() for t in layer] for layer in weights]
    live = [[t.copy() for t in layer] for layer in weights]
    nxt = [[np.full_like(t, np.nan) for t in layer] for layer in weights]
    with epcomm.EplbCommunicator(g) as comm:
        summary = comm.rearrange(old, new, weights)
        # vLLM v0.33.0's migration batching: other transfer order, the same weights.
        comm.rearrange(old, new, batched, migration_batching=True)
        # Double-buffered: live only read, the new placement written into the next weights.
        into = comm.rearrange(old, new, live, next_weights=nxt)
        # A next tensor a row short on the last rank: every rank fails, no layer valid.
        short = [[t[:-1] if (layer == 1 and rank == world - 1) else t for t in ts]
                 for layer, ts in enumerate(nxt)]
        try:
            comm.rearrange(new, old, weights, next_weights=short)
            raise AssertionError("a short next tensor was accepted")
        except epcomm.Error as e:
            assert e.next_valid == 0, e.next_valid
            if rank == world - 1:
                assert str(e).startswith("next_weights layer 1 tensor 0 has "), str(e)
            else:
                assert str(e) == (f"rearrange: rank {world - 1} rejected its arguments (see "
                                  "that rank's error) (EPLB rearrangement: no layer was "
                                  "changed)"), str(e)
    assert into == dict(summary, next_valid=LAYERS), into
    for layer in range(LAYERS):
        assert np.array_equal(batched[layer][0], weights[layer][0]), f"batched layer {layer}"
        assert nxt[layer][0].tobytes() == weights[layer][0].tobytes(), f"next layer {layer}"
        mine = old[layer][rank * LOCAL_SLOTS:(rank + 1) * LOCAL_SLOTS]
        assert live[layer][0].tolist() == [[e * 100 + layer * 10 + c for c in range(COLS)]
                                           for e in mine], f"live layer {layer} changed"
    out = {f"eplb.layer{l}": weights[l][0].tobytes().hex() for l in range(LAYERS)}
    out["eplb.summary"] = json.dumps(summary, sort_keys=True)
    return out


def init_torch(rank, world, port):
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    return dist


def shm_isolated(dist, rank, world):
    """How many of the other ranks' files this rank sees in /dev/shm (0 when isolated)."""
    with open(SHM_PROBE % rank, "w") as f:
        f.write("x")
    dist.barrier()
    seen = sum(os.path.exists(SHM_PROBE % r) for r in range(world) if r != rank)
    dist.barrier()
    os.unlink(SHM_PROBE % rank)
    return seen


def rank_main(mode, rank, world, where):
    import epcomm

    out = {}
    if mode == "shm":
        g = epcomm.Group.shm(where, rank, world, timeout_s=60)
    else:
        dist = init_torch(rank, world, int(where))
        out["others_in_dev_shm"] = shm_isolated(dist, rank, world)
        g = epcomm.Group.from_torch()
    with g:
        if mode in ("dead", "stopped"):
            return lost_peer(epcomm, g, rank, mode)
        assert (g.rank, g.size) == (rank, world)
        out.update(all2all_results(epcomm, g, rank, world))
        out.update(eplb_results(epcomm, g, rank, world))
    return out


def lost_peer(epcomm, g, rank, mode):
    """Rank 1 dies ("dead") or stops answering ("stopped": SIGSTOP) after the group formed;
    rank 0's next collective must fail with an epcomm.Error (not hang, not crash): at once when
    the connection closes, else when gloo's own timeout fires."""
    g.barrier()
    if rank == 1:
        if mode == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)
    import numpy as np

    start = time.monotonic()
    try:
        g.all_gatherv(np.ones((1, 4), np.float32), [1, 1])
        return {"raised": None}
    except epcomm.Error as e:
        return {"raised": type(e).__name__, "runtime": isinstance(e, RuntimeError),
                "message": str(e), "status": e.status,
                "cause": type(e.__cause__).__name__, "seconds": time.monotonic() - start}


# ---- the driver -----------------------------------------------------------------------------


def keep_library():
    """Points the rank processes at a private copy of EPCOMM_LIBRARY, so that a rebuild of the
    shared target directory during the run cannot take the file away from a rank starting
    later."""
    lib = os.environ.get("EPCOMM_LIBRARY")
    if not lib or os.environ.get("EPCOMM_TEST_LIBRARY_COPY") == lib:
        return
    where = tempfile.mkdtemp(prefix="epcomm-torch-group-lib-")
    atexit.register(shutil.rmtree, where, True)
    copy = os.path.join(where, "libepcomm.so")
    shutil.copyfile(lib, copy)
    os.environ["EPCOMM_LIBRARY"] = os.environ["EPCOMM_TEST_LIBRARY_COPY"] = copy


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unshare_prefix():
    """The command prefix that runs a rank in its own IPC and mount namespace with a private
    /dev/shm, or None where that is not permitted (then the ranks say so in the test output)."""
    if shutil.which("unshare") is None:
        return None
    script = 'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"'
    prefix = ["unshare", "--ipc", "--mount", "sh", "-c", script]
    ok = subprocess.run(prefix + ["true"], capture_output=True, timeout=30).returncode == 0
    return prefix if ok else None


def run_ranks(test, mode, world, where, prefix=None, expect_exit=None, script=None):
    """Runs `world` rank processes of `script` (default: this file, whose `--rank` entry
    calls rank_main); returns their results by rank."""
    tmp = tempfile.mkdtemp(prefix="epcomm-torch-group-")
    test.addCleanup(shutil.rmtree, tmp, True)
    procs = []
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    for rank in range(world):
        out = os.path.join(tmp, f"{rank}.json")
        cmd = (prefix or []) + [sys.executable, script or os.path.abspath(__file__), "--rank",
                                mode, str(rank), str(world), str(where), out]
        procs.append((subprocess.Popen(cmd, env=env), out))
    deadline = time.monotonic() + RANK_TIMEOUT_S
    codes = {}
    try:
        for rank, (p, _) in enumerate(procs):
            if expect_exit is not None and rank in expect_exit:
                codes[rank] = None  # dies or stops by design; killed below if still there
                continue
            try:
                codes[rank] = p.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:  # no rank outlives the test, whatever happened
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = {}
    for rank, (_, out) in enumerate(procs):
        if rank not in codes:
            test.fail(f"{mode} world {world}: rank {rank} still running after {RANK_TIMEOUT_S} s")
        if expect_exit is None or rank not in expect_exit:
            test.assertEqual(codes[rank], 0, f"{mode} world {world}: rank {rank} exited with "
                             f"{codes[rank]}")
            with open(out) as f:
                results[rank] = json.load(f)
    return results


class FromTorchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        keep_library()
        cls.prefix = unshare_prefix()
        if cls.prefix is None:
            print("NOTE: unshare --ipc --mount is not permitted here: the torch ranks share "
                  "/dev/shm (the host group still uses only torch.distributed)", file=sys.stderr)

    def check_world(self, world):
        torch_runs = run_ranks(self, "torch", world, free_port(), self.prefix)
        shm_runs = run_ranks(self, "shm", world, f"torch-ref-{os.getpid()}-{world}")
        for rank in range(world):
            got, want = dict(torch_runs[rank]), shm_runs[rank]
            seen = got.pop("others_in_dev_shm")
            if self.prefix is not None:
                self.assertEqual(seen, 0, f"rank {rank} sees other ranks' /dev/shm")
            self.assertEqual(sorted(got), sorted(want))
            for key in sorted(want):
                self.assertEqual(got[key], want[key], f"world {world} rank {rank}: {key}")

    def test_two_ranks_match_shm(self):
        self.check_world(2)

    def test_four_ranks_match_shm(self):
        self.check_world(4)

    def lost_peer(self, mode, gloo_message, at_least_s):
        r = run_ranks(self, mode, 2, free_port(), self.prefix, expect_exit={1})[0]
        self.assertEqual(r["raised"], "RuntimeError", r)
        self.assertTrue(r["runtime"], r)
        self.assertEqual(r["status"], 5, r)
        # The rest is gloo's own text (which names the peer's address).
        prefix = ("host transport all_gather failed during all_gatherv of group 'torch' on "
                  "rank 0: callback returned 1; the Python callback raised RuntimeError: ")
        self.assertTrue(r["message"].startswith(prefix), r["message"])
        self.assertIn(gloo_message, r["message"])
        self.assertEqual(r["cause"], "RuntimeError", r)
        self.assertGreaterEqual(r["seconds"], at_least_s, r)
        self.assertLess(r["seconds"], GLOO_TIMEOUT_S + 20, r)

    def test_dead_peer_is_an_epcomm_error(self):
        # gloo says "Connection closed by peer" or "Connection reset by peer".
        self.lost_peer("dead", "by peer", 0)

    def test_stopped_peer_is_an_epcomm_error_after_gloo_timeout(self):
        self.lost_peer("stopped", "Timed out", GLOO_TIMEOUT_S - 1)


class ExampleTest(unittest.TestCase):
    """examples/python/torch_two_ranks.py gives the worked example's results on every layout."""

    @classmethod
    def setUpClass(cls):
        keep_library()

    def test_torch_two_ranks(self):
        here = os.path.dirname(os.path.abspath(__file__))
        example = os.path.join(here, "..", "..", "examples", "python", "torch_two_ranks.py")
        for backend in BACKENDS:
            out = subprocess.run([sys.executable, example, backend], capture_output=True,
                                 text=True, timeout=RANK_TIMEOUT_S)
            self.assertEqual(out.returncode, 0, f"{backend}: stdout {out.stdout!r}, stderr {out.stderr!r}")
            self.assertEqual(
                out.stdout,
                f"{backend}: rank 0 -> [20.0, 13.75, 48.0], rank 1 -> [70.0, 42.0]\n",
            )


def main(rank_main):
    """A rank process (`--rank MODE RANK WORLD WHERE PATH`: `rank_main`'s result as JSON at PATH)
    or, without `--rank`, the tests."""
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        mode, rank, world, where, path = sys.argv[2:7]
        result = rank_main(mode, int(rank), int(world), where)
        with open(path, "w") as f:
            json.dump(result, f)
        # Not sys.exit: the interpreter's teardown destroys torch's gloo process group, whose
        # C++ destructor sometimes calls std::terminate ("terminate called without an active
        # exception", SIGABRT) while its threads still run; the result is written, the epcomm
        # group closed, so nothing is lost by skipping the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    unittest.main()


if __name__ == "__main__":
    main(rank_main)
