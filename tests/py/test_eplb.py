"""EPLB policy through ctypes: vLLM's vectors (tests/distributed/test_eplb_algo.py).

    EPCOMM_LIBRARY=target/debug/deps/libepcomm.so python3 tests/py/test_eplb.py -v
"""

import ctypes
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from epcomm_testlib import check, load_library  # noqa: E402

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


if __name__ == "__main__":
    unittest.main()
