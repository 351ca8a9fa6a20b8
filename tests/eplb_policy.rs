//! vLLM's EPLB policy: the test vectors of vLLM's tests/distributed/test_eplb_algo.py
//! and invariants on random loads for many (L, E, P, G, N, R) shapes.

use epcomm::eplb::policy::{
    compute_logical_maps, min_redundant_experts, np_sum_f32, preserve_intragpu_slots,
    rebalance_experts,
};
use epcomm::Status;

fn f32s(rows: &[&[i64]]) -> Vec<Vec<f32>> {
    rows.iter()
        .map(|r| r.iter().map(|&x| x as f32).collect())
        .collect()
}

#[test]
fn vllm_vector_hierarchical() {
    let w = f32s(&[
        &[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        &[20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]);
    let p2l = rebalance_experts(&w, 16, 4, 2, 8, None).unwrap();
    assert_eq!(
        p2l,
        vec![
            vec![5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
            vec![7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
        ]
    );
    let (cnt, _) = compute_logical_maps(&p2l, 12);
    assert_eq!(
        cnt,
        vec![
            vec![1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
            vec![1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1],
        ]
    );
}

#[test]
fn vllm_vector_logical_maps() {
    let (cnt, maps) = compute_logical_maps(&[vec![0, 1, 2, 3, 0, 1], vec![0, 2, 0, 1, 0, 3]], 4);
    assert_eq!(cnt, vec![vec![2, 2, 1, 1], vec![3, 1, 1, 1]]);
    assert_eq!(
        maps,
        vec![
            vec![
                vec![0, 4, -1],
                vec![1, 5, -1],
                vec![2, -1, -1],
                vec![3, -1, -1]
            ],
            vec![
                vec![0, 2, 4],
                vec![3, -1, -1],
                vec![1, -1, -1],
                vec![5, -1, -1]
            ],
        ]
    );
}

#[test]
fn vllm_vector_small_cases() {
    let w = f32s(&[&[10, 20, 30, 40]]);
    let p2l = rebalance_experts(&w, 4, 1, 1, 1, None).unwrap();
    let mut sorted = p2l[0].clone();
    sorted.sort();
    assert_eq!(sorted, vec![0, 1, 2, 3]);
    let e = rebalance_experts(&w, 7, 2, 2, 4, None).unwrap_err();
    assert_eq!(e.status(), Status::Assertion);
    assert_eq!(e.exception(), "AssertionError");
}

#[test]
fn numpy_pairwise_sum() {
    // Exact for small integers; beyond 2^24 the pairwise order matters and is numpy's.
    assert_eq!(np_sum_f32(&[1.0, 2.0, 3.0]), 6.0);
    let v: Vec<f32> = (0..300).map(|i| 16_777_216.0 + i as f32).collect();
    let mut r = [0f32; 8];
    // Independent restatement of numpy's blocked loop for n = 150 (the right half).
    let right = &v[150..];
    r.copy_from_slice(&right[..8]);
    let mut i = 8;
    while i < 144 {
        for j in 0..8 {
            r[j] += right[i + j];
        }
        i += 8;
    }
    let mut want = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for x in &right[144..] {
        want += x;
    }
    assert_eq!(np_sum_f32(right), want);
}

#[test]
fn preserve_slots_keeps_experts_in_place() {
    let old = vec![vec![0, 1, 2, 3, 4, 5]];
    let mut new = vec![vec![1, 0, 6, 5, 7, 3]];
    preserve_intragpu_slots(&mut new, 2, &old);
    // GPU 0 block [1,0,6] vs old [0,1,2]: 0 and 1 keep slots 0,1; 6 fills slot 2.
    // GPU 1 block [5,7,3] vs old [3,4,5]: 3 -> slot 0, 5 -> slot 2, 7 fills slot 1.
    assert_eq!(new, vec![vec![0, 1, 6, 3, 7, 5]]);
}

#[test]
fn min_redundant() {
    assert_eq!(min_redundant_experts(256, 32), 0);
    assert_eq!(min_redundant_experts(58, 8), 6);
    assert_eq!(min_redundant_experts(7, 1), 0);
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[test]
fn invariants_on_random_loads() {
    let shapes = [
        (2, 12, 16, 4, 2, 8),
        (3, 16, 16, 4, 2, 4),
        (4, 64, 80, 8, 4, 16),
        (2, 256, 288, 8, 4, 32),
        (5, 32, 48, 4, 1, 8),
        (2, 24, 30, 3, 2, 6), // groups don't divide into nodes: global policy
        (2, 20, 24, 4, 4, 6), // GPUs don't divide into nodes: one node (warning)
        (1, 8, 8, 1, 1, 1),
    ];
    for (seed, &(l, e, p, g, n, r)) in shapes.iter().enumerate() {
        let w: Vec<Vec<f32>> = (0..l)
            .map(|li| {
                (0..e)
                    .map(|x| (mix((seed * 1000 + li * 100 + x) as u64) % 5000) as f32)
                    .collect()
            })
            .collect();
        let old: Vec<Vec<usize>> = (0..l).map(|_| (0..p).map(|s| s % e).collect()).collect();
        for old_map in [None, Some(old.as_slice())] {
            let map = rebalance_experts(&w, p, g, n, r, old_map).unwrap();
            assert_eq!(map.len(), l);
            for (li, row) in map.iter().enumerate() {
                assert_eq!(row.len(), p, "P slots filled");
                let (cnt, _) = compute_logical_maps(std::slice::from_ref(row), e);
                assert!(
                    cnt[0].iter().all(|&c| c >= 1),
                    "every logical expert has a replica"
                );
                // The hierarchical policy keeps each expert's replicas on one node.
                let hierarchical = g % n == 0 && r % n == 0;
                if hierarchical && n > 1 {
                    let per_node = p / n;
                    for x in 0..e {
                        let nodes: std::collections::BTreeSet<usize> = row
                            .iter()
                            .enumerate()
                            .filter(|(_, &v)| v == x)
                            .map(|(s, _)| s / per_node)
                            .collect();
                        assert_eq!(nodes.len(), 1, "expert {x} spans nodes in layer {li}");
                    }
                }
                if let Some(old) = old_map {
                    // Preserve: every slot whose old expert is still on the GPU keeps it.
                    let s = p / r;
                    let plain = rebalance_experts(&w, p, g, n, r, None).unwrap();
                    for gpu in 0..r {
                        let block = &row[gpu * s..(gpu + 1) * s];
                        let mut a = block.to_vec();
                        let mut b = plain[li][gpu * s..(gpu + 1) * s].to_vec();
                        a.sort();
                        b.sort();
                        assert_eq!(a, b, "same experts per GPU");
                        for slot in 0..s {
                            let was = old[li][gpu * s + slot];
                            let still = plain[li][gpu * s..(gpu + 1) * s].contains(&was);
                            let kept_before = old[li][gpu * s..gpu * s + slot]
                                .iter()
                                .filter(|&&v| v == was)
                                .count();
                            let avail = plain[li][gpu * s..(gpu + 1) * s]
                                .iter()
                                .filter(|&&v| v == was)
                                .count();
                            if still && kept_before < avail {
                                assert_eq!(
                                    block[slot], was,
                                    "slot {slot} of GPU {gpu} keeps expert {was}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
