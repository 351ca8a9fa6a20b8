"""Never silently wrong through the package (issue 27), with numpy and torch as a user would:

- any exception raised while a collective's arguments are prepared (torch's BufferError for
  requires_grad, sparse, conj-bit and meta tensors; a producer's own RuntimeError; a
  KeyboardInterrupt) reaches the caller unchanged after the peers were told: their call fails
  at once naming the rank, and the next call pairs correctly (dispatch, combine, every group
  collective, EPLB rearrange), on 2 rank processes;
- arrays and DLPack tensors made from a handle's Buffers keep its memory alive after
  ``All2All.close()`` / ``Group.close()`` (the memory is unmapped with the last of them);
  Buffers of a closed manager or of an earlier dispatch raise instead of exporting;
- ``close()`` from another thread while a call is in flight raises and leaves the handle
  working.
Crash-prone scenarios run in a child interpreter whose exit status is checked.

    PYTHONPATH=python EPCOMM_LIBRARY=target/debug/libepcomm.so python3 tests/py/test_safety.py -v
"""

import gc
import operator
import os
import subprocess
import sys
import textwrap
import time
import unittest

import numpy as np
import torch

import epcomm
from epcomm_testlib import run_ranks

# A peer's failure must arrive at once, far inside the group timeout (a peer left waiting
# would only fail after TIMEOUT_S).
TIMEOUT_S = 20.0
AT_ONCE_S = 10.0


class RaisingProducer:
    """A DLPack producer whose export raises ``exc``."""

    def __init__(self, exc):
        self.exc = exc

    def __dlpack__(self, *args, **kwargs):
        raise self.exc

    def __dlpack_device__(self):
        return (1, 0)


class RaisingBytes:
    """An object whose bytes() raises."""

    def __bytes__(self):
        raise RuntimeError("no bytes today")


def bad_inputs(rows, cols):
    """(name, value, the exception class its export raises) for values whose preparation
    raises."""
    return [
        ("requires_grad", torch.ones(rows, cols).requires_grad_(True), BufferError),
        ("sparse", torch.ones(rows, cols).to_sparse(), BufferError),
        ("conj", torch.ones(rows, cols, dtype=torch.complex64).conj(), BufferError),
        ("meta", torch.ones(rows, cols, device="meta"), BufferError),
        ("producer", RaisingProducer(RuntimeError("producer failed")), RuntimeError),
        ("interrupt", RaisingProducer(KeyboardInterrupt("interrupted")), KeyboardInterrupt),
    ]


def attempt(fn):
    """fn()'s outcome: ("ok", seconds) or (exception class name, message, seconds)."""
    t0 = time.monotonic()
    try:
        fn()
        return ("ok", round(time.monotonic() - t0, 1))
    except BaseException as e:  # noqa: BLE001 -- KeyboardInterrupt is one of the cases
        return (type(e).__name__, str(e), time.monotonic() - t0)


H, K = 4, 1


def moe_rank(rank, name):
    """Per bad input: rank 0 dispatches it, rank 1 good rows; then both dispatch step-tagged
    rows (rank r's rows of step s hold 100*s + r) and report the tags they received. Then the
    same for combine's expert_output. Returns the outcomes in order, each bad input's own
    export outcome (what torch or the producer raises) first."""
    out = []
    with epcomm.Group.shm(name, rank, 2, timeout_s=TIMEOUT_S) as g, epcomm.All2All(
        g, "deepep_high_throughput", num_experts=4, top_k=K, hidden_size=H,
        max_tokens_per_rank=4,
    ) as a:
        # Token 0 to expert 0 (rank 0), token 1 to expert 2 (rank 1): one row each way.
        ids, w = torch.tensor([[0], [2]]), torch.ones(2, K)

        def step(s):
            x = torch.full((2, H), float(100 * s + rank))
            d = a.dispatch(x, ids, w)
            got = torch.from_dlpack(d["hidden"]).clone()
            y = torch.zeros(2, H)
            a.combine(got, y)  # identity experts, weight 1: the tokens come back
            return sorted(set(got[:, 0].tolist())), torch.equal(y, x)

        out.append([attempt(lambda: b.__dlpack__(max_version=(1, 0)))[:2]
                    for _, b, _ in bad_inputs(2, H)])
        s = 0
        for kind, bad, _ in bad_inputs(2, H):
            s += 1
            x = torch.full((2, H), float(100 * s + rank))
            out.append(("dispatch", kind, attempt(lambda: a.dispatch(bad if rank == 0 else x,
                                                                       ids, w))))
            s += 1
            out.append(("next step", kind, step(s)))
        for kind, bad, _ in bad_inputs(2, H):
            s += 1
            x = torch.full((2, H), float(100 * s + rank))
            d = a.dispatch(x, ids, w)
            rows = torch.from_dlpack(d["hidden"]).clone()
            out.append(("combine", kind, attempt(
                lambda: a.combine(bad if rank == 0 else rows, torch.zeros(2, H)))))
            s += 1
            out.append(("next step", kind, step(s)))
    return out


def group_rank(rank, name):
    """Per group collective (and EPLB rearrange): rank 0 passes a requires_grad tensor (an
    object whose bytes() raises, for all_gather), rank 1 good arguments; then every rank
    all-gathers a step tag. Returns the outcomes in order."""
    bad = torch.ones(2, H).requires_grad_(True)
    # What the bad values raise by themselves (torch's own messages).
    out = [{"numpy": attempt(lambda: np.asarray(bad))[:2],
            "dlpack": attempt(lambda: bad.__dlpack__(max_version=(1, 0)))[:2],
            "bytes": attempt(lambda: bytes(RaisingBytes()))[:2],
            "index": attempt(lambda: operator.index(1.5))[:2]}]
    with epcomm.Group.shm(name, rank, 2, timeout_s=TIMEOUT_S) as g, \
            epcomm.EplbCommunicator(g, "torch_gloo") as c:
        def rows(n):
            return np.full((n, H), rank + 1, np.float32)

        cases = [
            ("all_gatherv", lambda v: g.all_gatherv(v, [2, 2])),
            ("reduce_scatterv", lambda v: g.reduce_scatterv(v, [1, 1])),
            ("all_to_allv", lambda v: g.all_to_allv(v, [1, 1], rows(2), [1, 1])),
            ("send_recv", lambda v: g.send_recv(
                [("send", 1, v)] if rank == 0 else [("recv", 0, rows(2))])),
            ("broadcast", lambda v: g.broadcast(v, 0)),
            # A root that is no rank (a float) on rank 0, good tensors everywhere.
            ("broadcast_root", lambda v: g.broadcast(rows(2), 1.5 if rank == 0 else 0)),
            ("all_gather", lambda v: g.all_gather(v)),
            ("rearrange", lambda v: c.rearrange([[0, 1]], [[1, 0]], [[v]])),
        ]
        for i, (op, fn) in enumerate(cases):
            good = {"all_gather": b"good", "rearrange": rows(1)}.get(op, rows(2))
            mine = (RaisingBytes() if op == "all_gather" else bad) if rank == 0 else good
            out.append((op, attempt(lambda: fn(mine))))
            tag = f"step{i}".encode()
            out.append(("next step", op, g.all_gather(tag)))
        # The rearrangement still works and moves the rows.
        weights = np.full((1, H), rank + 1, np.float32)
        c.rearrange([[0, 1]], [[1, 0]], [[weights]])
        out.append(("rearranged", weights.tolist()))
    return out


class PeersAreToldTest(unittest.TestCase):
    def run_two(self, fn):
        return run_ranks(fn, [0, 1], args=(f"pysafe-{fn.__name__}-{os.getpid()}",),
                         deadline_s=120)

    def assert_at_once(self, outcome, want_class, want_message, where):
        self.assertEqual(outcome[:2], (want_class, want_message), where)
        self.assertLess(outcome[2], AT_ONCE_S, f"{where}: failed only after {outcome[2]:.1f} s")

    def test_dispatch_and_combine(self):
        res = self.run_two(moe_rank)
        kinds = bad_inputs(2, H)
        own = res[0][0]
        s = 0
        i = 1
        for op in ("dispatch", "combine"):
            for k, (kind, _, exc) in enumerate(kinds):
                s += 2
                where = f"{op} with a {kind} input on rank 0"
                mine, peer = res[0][i], res[1][i]
                self.assertEqual(mine[:2], (op, kind))
                # The caller gets the original exception, unchanged.
                self.assertEqual(own[k][0], exc.__name__, f"{kind}'s own export")
                self.assertEqual(mine[2][:2], own[k], where)
                self.assert_at_once(
                    peer[2], "ValueError",
                    f"{op}: rank 0 rejected its input (see that rank's error); "
                    "no data was exchanged", f"rank 1, {where}")
                # The next step pairs: each rank gets one row of that step from each rank,
                # and combine brings its tokens back.
                for r in (0, 1):
                    self.assertEqual(res[r][i + 1], ("next step", kind,
                                                     ([100.0 * s, 100.0 * s + 1], True)),
                                     f"rank {r}, the step after {where}")
                i += 2

    def test_group_collectives_and_rearrange(self):
        res = self.run_two(group_rank)
        name = f"pysafe-group_rank-{os.getpid()}"
        own = res[0][0]
        self.assertEqual(own["numpy"][0], "RuntimeError")
        self.assertEqual(own["dlpack"][0], "BufferError")
        self.assertEqual(own["bytes"], ("RuntimeError", "no bytes today"))
        # The gathers read their input with numpy.asarray, the others export it (DLPack).
        self.assertEqual(own["index"][0], "TypeError")
        mine = {"all_gatherv": own["numpy"], "reduce_scatterv": own["numpy"],
                "all_gather": own["bytes"], "broadcast_root": own["index"]}
        peer = {
            "all_gather": "all_gatherv",  # the library's name of that collective
            "broadcast_root": "broadcast",
        }
        ops = ["all_gatherv", "reduce_scatterv", "all_to_allv", "send_recv", "broadcast",
               "broadcast_root", "all_gather", "rearrange"]
        for j, op in enumerate(ops):
            at = 1 + 2 * j  # after the bad values' own outcomes: (op, outcome), next step
            want = mine.get(op, own["dlpack"])
            self.assertEqual(res[0][at][0], op)
            self.assertEqual(res[0][at][1][:2], want, f"rank 0, {op}")
            if op == "rearrange":
                text = ("rearrange: rank 0 rejected its arguments (see that rank's error) "
                        "(EPLB rearrangement: no layer was changed)")
            else:
                text = (f"{peer.get(op, op)}: rank 0 of group '{name}' rejected its arguments "
                        "(see that rank's error); no data was exchanged")
            self.assert_at_once(res[1][at][1], "ValueError", text, f"rank 1, {op}")
            for r in (0, 1):
                self.assertEqual(res[r][at + 1], ("next step", op, [f"step{j}".encode()] * 2),
                                 f"rank {r}, the step after {op}")
        # Slot 0 <-> slot 1: rank 0 now holds rank 1's expert and the other way round.
        self.assertEqual(res[0][-1], ("rearranged", [[2.0] * H]))
        self.assertEqual(res[1][-1], ("rearranged", [[1.0] * H]))


# The child interpreter's common start: a one-rank group and manager with one dispatch of
# rows whose values are known; `windows()` counts this manager's shared-memory windows mapped
# in the process and `group_maps()` the group's own regions.
CHILD_PRELUDE = """
import gc, os, re, threading, time
import numpy as np
import torch
import epcomm

name = f"pylife-{os.getpid()}"

def maps(pattern):
    rx = re.compile(pattern)
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if rx.search(line))

def windows():
    return maps(rf"epcomm\\.{re.escape(name)}\\.[0-9a-f]+\\.w0\\.")

def group_maps():
    return maps(rf"epcomm\\.{re.escape(name)}\\.(control|[0-9a-f]+\\.0\\.)")

T, H = 64, 4096
x = np.arange(T * H, dtype=np.float32).reshape(T, H)
ids, w = np.zeros((T, 1), np.int64), np.ones((T, 1), np.float32)
"""


def run_child(body, timeout=90):
    """Runs CHILD_PRELUDE + body in a fresh interpreter; returns (exit status, stdout
    lines, stderr). A negative status is the signal that ended it."""
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(body)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    return p.returncode, p.stdout.splitlines(), p.stderr


VIEWS = {
    "numpy.asarray": "np.asarray",
    "torch.from_dlpack": "torch.from_dlpack",
    "numpy.from_dlpack": "np.from_dlpack",
}


class ViewsOutliveCloseTest(unittest.TestCase):
    """A view made before close() stays readable (the memory is unmapped only when the last
    view is gone); the closed manager and its Buffers refuse further use."""

    def scenario(self, view, source, closer):
        body = f"""
        g = epcomm.Group.shm(name, 0, 1)
        a = epcomm.All2All(g, "deepep_high_throughput", num_experts=2, top_k=1,
                           hidden_size=H, max_tokens_per_rank=T)
        d = a.dispatch(x, ids, w)
        if {source == "expert_output_buffer"!r}:
            src = a.expert_output_buffer()
            np.asarray(src)[...] = x
        else:
            src = d["hidden"]
        v = {VIEWS[view]}(src)
        mapped, group_mapped = windows(), group_maps()
        {closer}
        for what, call in (("dispatch", lambda: a.dispatch(x, ids, w)),
                           ("export", lambda: {VIEWS[view]}(src)),
                           ("tolist", lambda: src.tolist())):
            try:
                call()
                print(what, "no error")
            except ValueError as e:
                print(what, type(e).__name__, e)
        del d, src
        gc.collect()
        print("still mapped", mapped > 0 and windows() == mapped, group_maps() == group_mapped)
        print("reads", np.array_equal(np.asarray(v), x))
        del v
        gc.collect()
        print("after the last view", windows(), group_maps() if {closer == "g.close()"!r} else 0)
        g.close()
        print("group closed", group_maps())
        """
        status, lines, err = run_child(body)
        where = f"{view} of {source}, {closer}"
        self.assertEqual(status, 0, f"{where}: the child ended with {status}:\n{err}")
        closed = ("the All2All manager is closed",
                  "this Buffer views memory of a closed All2All manager; copy outputs "
                  "before close()")
        self.assertEqual(lines, [
            f"dispatch ValueError {closed[0]}",
            f"export ValueError {closed[1]}",
            f"tolist ValueError {closed[1]}",
            "still mapped True True",
            "reads True",
            "after the last view 0 0",
            "group closed 0",
        ], f"{where}\n{err}")

    def test_views_after_all2all_close(self):
        for view in VIEWS:
            for source in ("hidden", "expert_output_buffer"):
                with self.subTest(view=view, source=source):
                    self.scenario(view, source, "a.close()")

    def test_views_after_group_close(self):
        for view in VIEWS:
            for source in ("hidden", "expert_output_buffer"):
                with self.subTest(view=view, source=source):
                    self.scenario(view, source, "g.close()")

    def test_last_view_dying_while_an_exception_propagates(self):
        """The closed manager and group are destroyed (from the tensor's deleter) when their
        last view dies as a temporary of an expression that raises; the exception arrives
        intact."""
        body = """
        g = epcomm.Group.shm(name, 0, 1)
        a = epcomm.All2All(g, "deepep_high_throughput", num_experts=2, top_k=1,
                           hidden_size=H, max_tokens_per_rank=T)
        d = a.dispatch(x, ids, w)
        views = [torch.from_dlpack(d["hidden"])]
        del d
        a.close()
        g.close()
        print("mapped", windows() > 0, group_maps() > 0)

        def f(t, y):
            return t

        try:
            f(views.pop(), 1 / 0)
        except ZeroDivisionError as e:
            print(type(e).__name__, e)
        print("mapped", windows(), group_maps())
        """
        status, lines, err = run_child(body)
        self.assertEqual(status, 0, f"the child ended with {status}:\n{err}")
        self.assertEqual(lines, ["mapped True True", "ZeroDivisionError division by zero",
                                 "mapped 0 0"], err)

    def test_stats_and_plan_views_after_close(self):
        body = """
        g = epcomm.Group.shm(name, 0, 1)
        a = epcomm.All2All(g, "deepep_high_throughput", num_experts=2, top_k=1,
                           hidden_size=H, max_tokens_per_rank=T)
        a.dispatch(x, ids, w)
        st = a.stats()
        sent = torch.from_dlpack(st["tokens_sent"])
        plan = epcomm.LayerPlan([0, 1, 2, 3], [3, 2, 1, 0], 2, 0)
        sends = np.asarray(plan.sends)
        want = sends.tolist()
        a.close()
        g.close()
        plan.close()
        for what, call in (("stats", lambda: st["tokens_sent"].tolist()),
                           ("plan", lambda: np.asarray(plan.sends))):
            try:
                call()
                print(what, "no error")
            except ValueError as e:
                print(what, e)
        gc.collect()
        print(sent.tolist(), sends.tolist() == want and len(want) > 0)
        del sent, sends
        gc.collect()
        print("unmapped", windows(), group_maps())
        """
        status, lines, err = run_child(body)
        self.assertEqual(status, 0, f"the child ended with {status}:\n{err}")
        self.assertEqual(lines, [
            "stats this Buffer views memory of a closed All2All manager; copy outputs before "
            "close()",
            "plan this Buffer views memory of a closed layer plan; copy outputs before close()",
            "[64] True",
            "unmapped 0 0",
        ], err)

    def test_buffers_of_earlier_calls_raise(self):
        with epcomm.Group.shm(f"pysafe-stale-{os.getpid()}", 0, 1) as g, epcomm.All2All(
            g, "deepep_high_throughput", num_experts=2, top_k=1, hidden_size=4,
            max_tokens_per_rank=2,
        ) as a:
            x = np.ones((2, 4), np.float32)
            ids, w = np.zeros((2, 1), np.int64), np.ones((2, 1), np.float32)
            first = a.dispatch(x, ids, w)
            buf = a.expert_output_buffer()
            kept = np.asarray(first["hidden"]).copy()
            second = a.dispatch(2 * x, ids, w)
            for call in (lambda: np.asarray(first["hidden"]),
                         lambda: torch.from_dlpack(first["hidden"]),
                         lambda: first["hidden"].tolist(),
                         lambda: a.combine(first["hidden"], np.zeros((2, 4), np.float32))):
                with self.assertRaises(ValueError) as cm:
                    call()
                self.assertEqual(
                    str(cm.exception),
                    "this Buffer is an output of an earlier dispatch; the All2All manager has "
                    "replaced it since (its memory may be reused or freed): copy what you keep "
                    "before the next call")
            self.assertEqual(kept.tolist(), x.tolist())
            self.assertEqual(np.asarray(second["hidden"]).tolist(), (2 * x).tolist())
            a.expert_output_buffer()
            with self.assertRaises(ValueError) as cm:
                np.asarray(buf)
            self.assertEqual(
                str(cm.exception),
                "this Buffer is an expert-output buffer of an earlier expert_output_buffer(); "
                "the All2All manager has replaced it since (its memory may be reused or "
                "freed): copy what you keep before the next call")
        gc.collect()


class CloseWhileInFlightTest(unittest.TestCase):
    """close() from another thread while a call is in flight: an INVALID_STATE error on the
    closing thread, and the call, the handle and the peers go on unharmed."""

    def test_close_during_dispatch(self):
        body = """
        objs, res = {}, {}
        both = threading.Barrier(2)
        go, started = threading.Event(), threading.Event()
        T, H = 2, 4
        ids, w = np.array([[0], [2]]), np.ones((2, 1), np.float32)

        def rank(r):
            try:
                with epcomm.Group.shm(name, r, 2, timeout_s=30) as g:
                    a = epcomm.All2All(g, "deepep_high_throughput", num_experts=4, top_k=1,
                                       hidden_size=H, max_tokens_per_rank=4)
                    objs[r] = (g, a)
                    both.wait()
                    if r == 1:
                        go.wait()  # rank 0 waits in its dispatch meanwhile
                    else:
                        started.set()
                    d = a.dispatch(np.full((2, H), float(r), np.float32), ids, w)
                    res[r] = sorted(set(np.asarray(d["hidden"])[:, 0].tolist()))
                    g.barrier()
                    a.close()
            except BaseException as e:
                res[r] = repr(e)

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        started.wait(30)
        g0, a0 = objs[0]
        # Rank 0's dispatch is in flight (waiting for rank 1) once the library refuses another
        # call on the manager as in use.
        for _ in range(3000):
            try:
                a0.zero_copy_combines()
                time.sleep(0.01)
            except RuntimeError as e:
                assert "in use by another thread" in str(e), e
                break
        else:
            raise SystemExit("rank 0's dispatch was never seen in flight")
        for h in (a0, g0):
            try:
                h.close()
                print("close no error")
            except epcomm.Error as e:
                print(type(e).__name__, e.status, e)
        go.set()
        for t in threads:
            t.join(60)
        print(res[0], res[1])
        """
        status, lines, err = run_child(body)
        self.assertEqual(status, 0, f"the child ended with {status}:\n{err}")
        self.assertEqual(lines, [
            "RuntimeError 9 close() of the All2All manager refused: 1 call(s) on the All2All "
            "manager are still in flight; close it after they return",
            "RuntimeError 9 close() of the group refused: 1 call(s) on the group are still in "
            "flight; close it after they return",
            "[0.0, 1.0] [0.0, 1.0]",
        ], err)


if __name__ == "__main__":
    unittest.main()
