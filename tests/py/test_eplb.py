"""EPLB through ctypes: the policy on vLLM's vectors (tests/distributed/test_eplb_algo.py), and
the experts a failure loses (epcomm_eplb_lost_experts); through the epcomm package (python/,
put on sys.path here): lost_experts and a scale-down after a failure on three threads (the
survivors of four ranks), a lost expert refused on every rank or allowed and reported.

    EPCOMM_LIBRARY=target/debug/deps/libepcomm.so python3 tests/py/test_eplb.py -v
"""

import ctypes
import os
import sys
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "..", "..", "python"))

from epcomm_testlib import (  # noqa: E402
    ERROR_INVALID_ARGUMENT,
    check,
    load_library,
    text,
    unique_name,
)

i64p = ctypes.POINTER(ctypes.c_int64)
LIB = load_library(
    {
        "epcomm_eplb_rebalance": (
            ctypes.c_int32,
            [ctypes.POINTER(ctypes.c_float)] + [ctypes.c_int64] * 6 + [i64p, i64p],
        ),
        "epcomm_eplb_logical_maps": (
            ctypes.c_int32,
            [i64p] + [ctypes.c_int64] * 4 + [i64p, i64p],
        ),
        "epcomm_eplb_lost_experts": (
            ctypes.c_int32,
            [i64p, ctypes.c_int64, ctypes.c_int64, i64p, ctypes.c_size_t, i64p,
             ctypes.c_size_t, i64p],
        ),
        "epcomm_last_error_message": (ctypes.c_char_p, []),
    }
)


def rebalance(weight, p, g, n, r, old=None):
    layers, e = len(weight), len(weight[0])
    w = (ctypes.c_float * (layers * e))(*[x for row in weight for x in row])
    out = (ctypes.c_int64 * (layers * p))()
    o = None if old is None else (ctypes.c_int64 * (layers * p))(*[x for row in old for x in row])
    check(LIB.epcomm_eplb_rebalance(w, layers, e, p, g, n, r, o, out))
    return [list(out[i * p:(i + 1) * p]) for i in range(layers)]


def logical_maps(p2l, e, width):
    layers, p = len(p2l), len(p2l[0])
    src = (ctypes.c_int64 * (layers * p))(*[x for row in p2l for x in row])
    cnt = (ctypes.c_int64 * (layers * e))()
    l2p = (ctypes.c_int64 * (layers * e * width))()
    check(LIB.epcomm_eplb_logical_maps(src, layers, p, e, width, cnt, l2p))
    counts = [list(cnt[i * e:(i + 1) * e]) for i in range(layers)]
    maps = [[list(l2p[(i * e + x) * width:(i * e + x + 1) * width]) for x in range(e)] for i in range(layers)]
    return counts, maps


class VllmVectors(unittest.TestCase):
    def test_basic_rebalance(self):
        weight = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                  [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
        p2l = rebalance(weight, 16, 4, 2, 8)
        self.assertEqual(p2l, [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                               [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])
        counts, _ = logical_maps(p2l, 12, 2)
        self.assertEqual(counts, [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                                  [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]])

    def test_logical_maps(self):
        counts, maps = logical_maps([[0, 1, 2, 3, 0, 1], [0, 2, 0, 1, 0, 3]], 4, 3)
        self.assertEqual(counts, [[2, 2, 1, 1], [3, 1, 1, 1]])
        self.assertEqual(maps, [[[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]],
                                [[0, 2, 4], [3, -1, -1], [1, -1, -1], [5, -1, -1]]])

    def test_single_gpu_is_a_permutation(self):
        self.assertEqual(sorted(rebalance([[10, 20, 30, 40]], 4, 1, 1, 1)[0]), [0, 1, 2, 3])

    def test_invalid_shape_is_an_assertion(self):
        with self.assertRaises(AssertionError):
            rebalance([[10, 20, 30, 40]], 7, 2, 2, 4)

    def test_preserve_keeps_an_unchanged_placement(self):
        weight = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]]
        first = rebalance(weight, 16, 4, 2, 8)
        self.assertEqual(rebalance(weight, 16, 4, 2, 8, old=first), first)


# 4 ranks x 3 slots; expert 2's only replica is on rank 2, which dies.
EXPOSED = [0, 1, 3, 4, 5, 6, 2, 7, 1, 6, 7, 0]
MAPPING = [0, 1, -1, 2]
SURVIVORS = [0, 1, 3]  # the old rank of each new rank
# A new placement for the survivors' 9 slots with every expert (so it needs the lost 2).
NEW = [2, 0, 1, 3, 4, 5, 6, 7, 0]
ROW = 16
LAYERS = 2
REFUSAL = (
    "rearrange: layer 0 needs logical experts [2], which have no replica on a surviving rank "
    "(rank_mapping removes ranks [2]); their weights are gone: allow lost experts to rearrange "
    "the others and leave their slots unwritten (the call reports them; load their weights "
    "there afterwards), or choose a new placement without them"
)


def c_lost(old, n_local, mapping, capacity):
    src = (ctypes.c_int64 * len(old))(*old)
    m = (ctypes.c_int64 * len(mapping))(*mapping)
    out = (ctypes.c_int64 * max(capacity, 1))(*([-7] * max(capacity, 1)))
    n = ctypes.c_int64(-1)
    st = LIB.epcomm_eplb_lost_experts(src, len(old), n_local, m, len(mapping),
                                      out if capacity else None, capacity, ctypes.byref(n))
    return st, n.value, list(out)


class LostExperts(unittest.TestCase):
    def test_the_c_entry_point(self):
        self.assertEqual(c_lost(EXPOSED, 3, MAPPING, 12), (0, 1, [2] + [-7] * 11))
        self.assertEqual(c_lost(EXPOSED, 3, [0, 1, -1, -1], 12)[:2], (0, 2))
        self.assertEqual(c_lost(EXPOSED, 3, [0, 1, -1, -1], 12)[2][:3], [2, 7, -7])
        self.assertEqual(c_lost(EXPOSED, 3, MAPPING, 0)[:2], (0, 1))  # count only
        st, n, _ = c_lost(EXPOSED, 3, [0, 1, -1, -1], 1)
        self.assertEqual((st, n), (ERROR_INVALID_ARGUMENT, 2))
        self.assertEqual(
            text(LIB.epcomm_last_error_message()),
            "lost_capacity is 1 but 2 experts are lost; pass room for *num_lost_out ids "
            "(num_slots always suffice)",
        )

    def test_the_package(self):
        from epcomm import eplb

        self.assertEqual(eplb.lost_experts(EXPOSED, 3, MAPPING), [2])
        self.assertEqual(eplb.lost_experts(EXPOSED, 3, [0, 1, 2, 3]), [])
        with self.assertRaises(ValueError) as cm:
            eplb.lost_experts(EXPOSED, 3, [0, 0, -1, 1])
        self.assertEqual(
            str(cm.exception),
            "rank_mapping[0] and rank_mapping[1] are both 0; every surviving rank needs a rank "
            "of its own",
        )


def row(expert, layer):
    return bytes((expert * 31 + layer * 7 + i) % 256 for i in range(ROW))


def rows(experts, layer):
    return bytearray(b"".join(row(e, layer) for e in experts))


def survivors_rearrange(allow, double_buffered):
    """Rank r of the 3 survivors rearranges EXPOSED -> NEW with MAPPING (on a thread); returns
    per rank (its weights after, as bytes per layer, or the exception, summary)."""
    survivors_rearrange.runs += 1
    name = unique_name("pyeplbsd", "shrink%d" % survivors_rearrange.runs)
    results = [None] * 3

    def rank(r):
        from epcomm import EplbCommunicator, Group

        try:
            with Group.shm(name, r, 3, timeout_s=20) as g, EplbCommunicator(g, "torch_gloo") as c:
                old_rank = SURVIVORS[r]
                live = [rows(EXPOSED[old_rank * 3:old_rank * 3 + 3], l) for l in range(LAYERS)]
                views = [[memoryview(b).cast("B", (3, ROW))] for b in live]
                nxt = [bytearray(len(b)) for b in live]
                nviews = [[memoryview(b).cast("B", (3, ROW))] for b in nxt]
                summary = c.rearrange(
                    [EXPOSED] * LAYERS, [NEW] * LAYERS, views, rank_mapping=MAPPING,
                    next_weights=nviews if double_buffered else None,
                    allow_lost_experts=allow,
                )
                out = nxt if double_buffered else live
                results[r] = ([bytes(b) for b in out], summary)
        except Exception as e:  # reported to the main thread
            results[r] = (e, None)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        if t.is_alive():
            raise AssertionError("a rank did not finish within 60 s")
    return results


survivors_rearrange.runs = 0


class ScaleDownAfterFailure(unittest.TestCase):
    def test_a_lost_expert_is_refused_on_every_rank(self):
        for double_buffered in (False, True):
            for r, (e, _) in enumerate(survivors_rearrange(False, double_buffered)):
                self.assertIsInstance(e, ValueError, f"rank {r}: {e!r}")
                self.assertEqual(str(e), REFUSAL)

    def test_an_allowed_lost_expert_keeps_its_old_bytes_and_is_reported(self):
        for double_buffered in (False, True):
            for r, (w, summary) in enumerate(survivors_rearrange(True, double_buffered)):
                self.assertNotIsInstance(w, Exception, f"rank {r}: {w!r}")
                self.assertEqual(summary["lost_experts"], [[2]] * LAYERS)
                old_rank = SURVIVORS[r]
                old = EXPOSED[old_rank * 3:old_rank * 3 + 3]
                # The new placement, except expert 2's slot: it keeps the old slot's bytes.
                want = [n if n != 2 else o for n, o in zip(NEW[r * 3:r * 3 + 3], old)]
                for layer in range(LAYERS):
                    self.assertEqual(w[layer], bytes(rows(want, layer)), f"rank {r}")


if __name__ == "__main__":
    unittest.main()
