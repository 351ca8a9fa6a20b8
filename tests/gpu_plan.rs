//! Host-side planning of the GPU transport (pure Rust, runs on CPU-only CI): counts rows,
//! matrices, offsets, scan levels, grid sizes, exchange plans and every layout's output shapes,
//! checked against the worked example of docs/design.md and against the CPU path's own sizes.

use epcomm::gpu::kernels::{encode_error_word, DeviceError, ERR_DUPLICATE_ID, SCAN_TILE};
use epcomm::gpu::nccl::plan::{counts_plan, ExchangeOptions};
use epcomm::gpu::transport::plan::*;
use epcomm::select::all2all::{Backend, Layout};

/// What `ep_layout` + the error copy put into one rank's counts row.
fn counts_row(ids: &[i64], k: usize, world: usize, experts: usize, err: u64) -> Vec<i32> {
    let el = experts / world;
    let t = ids.len() / k;
    let mut row = vec![0i32; counts_row_len(world, experts)];
    row[ROW_TOKENS] = t as i32;
    row[ROW_ERROR] = err as u32 as i32;
    row[ROW_ERROR + 1] = (err >> 32) as u32 as i32;
    for tok in ids.chunks(k) {
        let mut to = vec![false; world];
        for &e in tok {
            if e >= 0 {
                to[e as usize / el] = true;
                row[row_expert_counts(world) + e as usize] += 1;
            }
        }
        for (r, &f) in to.iter().enumerate() {
            row[ROW_RANK_COUNTS + r] += f as i32;
        }
    }
    row
}

/// The worked example of docs/design.md: R=2, E=4, K=2.
fn worked() -> Gathered {
    let r0 = counts_row(&[0, 2, 1, 0, 3, -1], 2, 2, 4, 0);
    let r1 = counts_row(&[2, 3, 1, -1], 2, 2, 4, 0);
    Gathered::parse(&[r0, r1].concat(), 2, 4).unwrap()
}

fn geo(rank: usize, m: usize) -> ShapeGeometry {
    ShapeGeometry {
        world: 2,
        rank,
        num_experts: 4,
        top_k: 2,
        hidden: 1,
        max_tokens_per_rank: m,
        backend: Backend::FlashinferNvlinkTwoSided,
    }
}

#[test]
fn parse_worked_example() {
    let g = worked();
    assert_eq!(g.tokens, vec![3, 2]);
    assert_eq!(g.errors, vec![0, 0]);
    // rank 0: tokens 0 (→0,1), 1 (→0), 2 (→1); rank 1: token 0 (→1), token 1 (→0).
    assert_eq!(g.rank_counts, vec![2, 2, 1, 1]);
    assert_eq!(g.expert_counts, vec![2, 1, 1, 1, 0, 1, 1, 1]);
    assert_eq!(g.pair_counts(), vec![3, 2, 1, 2]);
    assert_eq!(g.replicated_counts(), vec![3, 3, 2, 2]);
    assert!(g.first_error().is_none());
    g.check(0).unwrap();
}

#[test]
fn shapes_match_the_worked_example() {
    let g = worked();
    let m = 4;
    for (rank, tm_rows, ep_rows, rm_counts) in [(0, 3, 4, [2, 1]), (1, 3, 4, [2, 1])] {
        let s = dispatch_shape(Layout::TokenMajor, &geo(rank, m), &g).unwrap();
        assert_eq!(s.received_rows, tm_rows);
        assert_eq!(s.hidden, vec![tm_rows, 1]);
        assert_eq!(s.topk_ids, vec![tm_rows, 2]);
        assert_eq!(s.counts, 2);

        let s = dispatch_shape(Layout::ExpertPacked, &geo(rank, m), &g).unwrap();
        assert_eq!(s.received_rows, ep_rows);
        assert_eq!(s.hidden, vec![ep_rows, 1]);
        assert_eq!(s.topk_weights, vec![ep_rows]);
        assert_eq!(s.expert_offsets, 3);
        assert_eq!(s.src, ep_rows);

        let s = dispatch_shape(Layout::ExpertMajor, &geo(rank, m), &g).unwrap();
        assert_eq!(s.received_rows, 4); // counts [2, 2] on both ranks
        assert_eq!(s.hidden, vec![2, m * 2, 1]);
        assert_eq!(s.buffer_rows, 2 * m * 2);

        let s = dispatch_shape(Layout::RankMajor, &geo(rank, m), &g).unwrap();
        assert_eq!(s.received_rows, rm_counts.iter().sum::<usize>());
        assert_eq!(s.hidden, vec![2, m, 1]);
        assert_eq!(s.topk_ids, vec![2 * m, 2]);
        assert_eq!(s.counts, 2);

        let s = dispatch_shape(Layout::Replicated, &geo(rank, m), &g).unwrap();
        assert_eq!(s.received_rows, 5);
        assert_eq!(s.hidden, vec![5, 1]);
    }
    // RANK_MAJOR receive offsets per source: rank 0 gets [2, 1] rows.
    assert_eq!(recv_offsets(&g.rank_counts, 2, 0), vec![0, 2, 3]);
    assert_eq!(recv_offsets(&g.rank_counts, 2, 1), vec![0, 2, 3]);
}

#[test]
fn fixed_capacity_overflow_names_the_rank() {
    let g = worked();
    // The CPU manager's wording (one home: moe::too_many_tokens).
    let want = |m: usize, backend: &str, layout: &str| {
        format!("dispatch: rank 0 has 3 tokens, more than max_tokens_per_rank = {m} of the {backend} backend ({layout} buffers hold M tokens per source rank)")
    };
    let e = dispatch_shape(Layout::RankMajor, &geo(0, 1), &g).unwrap_err();
    assert_eq!(
        e.to_string(),
        want(1, "flashinfer_nvlink_two_sided", "RANK_MAJOR")
    );
    // T > M is an error even when no destination receives more than M rows (rank 0 sends 2
    // of its 3 tokens to each rank): the CPU path rejects it, so the GPU path must too.
    for rank in 0..2 {
        let e = dispatch_shape(Layout::RankMajor, &geo(rank, 2), &g).unwrap_err();
        assert_eq!(
            e.to_string(),
            want(2, "flashinfer_nvlink_two_sided", "RANK_MAJOR")
        );
    }
    let ll = ShapeGeometry {
        backend: Backend::DeepepLowLatency,
        ..geo(1, 2)
    };
    let e = dispatch_shape(Layout::ExpertMajor, &ll, &g).unwrap_err();
    assert_eq!(e.to_string(), want(2, "deepep_low_latency", "EXPERT_MAJOR"));
}

#[test]
fn a_peer_error_reaches_every_rank() {
    let bad = encode_error_word(ERR_DUPLICATE_ID, 5, 1);
    let r0 = counts_row(&[0, 1], 2, 2, 4, 0);
    let r1 = counts_row(&[2, 3], 2, 2, 4, bad);
    let g = Gathered::parse(&[r0, r1].concat(), 2, 4).unwrap();
    assert_eq!(g.errors[1], bad);
    assert_eq!(
        g.first_error(),
        Some((1, DeviceError::DuplicateId { token: 5, k: 1 }))
    );
    let own = g.check(1).unwrap_err().to_string();
    assert!(
        own.starts_with("topk_ids[5] routes token 5 to one expert twice"),
        "{own}"
    );
    let peer = g.check(0).unwrap_err().to_string();
    assert!(
        peer.starts_with("rank 1 rejected its dispatch input: topk_ids[5]"),
        "{peer}"
    );
}

#[test]
fn parse_rejects_malformed_rows() {
    assert!(Gathered::parse(&[0; 5], 2, 4).is_err());
    let mut r0 = counts_row(&[0, 1], 2, 2, 4, 0);
    r0[ROW_RANK_COUNTS] = -1;
    let r1 = counts_row(&[2, 3], 2, 2, 4, 0);
    assert!(Gathered::parse(&[r0, r1].concat(), 2, 4).is_err());
}

#[test]
fn combine_matrices_are_the_transposes() {
    let g = worked();
    assert_eq!(transpose(&[1, 2, 3, 4], 2), vec![1, 3, 2, 4]);
    assert_eq!(
        combine_counts(Layout::TokenMajor, &g),
        transpose(&g.rank_counts, 2)
    );
    assert_eq!(
        combine_counts(Layout::ExpertPacked, &g),
        transpose(&g.pair_counts(), 2)
    );
    assert_eq!(combine_counts(Layout::Replicated, &g), vec![3, 2, 3, 2]);
    // What an expert rank sends back equals what its sources expect to receive.
    for layout in [Layout::TokenMajor, Layout::ExpertMajor, Layout::RankMajor] {
        let cm = combine_counts(layout, &g);
        let p0 = counts_plan(&cm, 2, 0, 8, ExchangeOptions::for_version(22800)).unwrap();
        let p1 = counts_plan(&cm, 2, 1, 8, ExchangeOptions::for_version(22800)).unwrap();
        assert_eq!(p0.sends[0].bytes, p1.recvs[0].bytes);
        assert_eq!(p1.sends[0].bytes, p0.recvs[0].bytes);
    }
}

#[test]
fn broadcast_plan_is_an_all_gather() {
    let tokens = [3usize, 0, 5];
    for rank in 0..3 {
        let p = broadcast_plan(&tokens, rank, 16, true);
        assert_eq!(p.send_bytes, tokens[rank] * 16);
        assert_eq!(p.recv_bytes, 8 * 16);
        assert_eq!(p.recv_rows, tokens.to_vec());
        assert!(p
            .sends
            .iter()
            .all(|t| t.offset == 0 && t.bytes == tokens[rank] * 16));
        let offs: Vec<usize> = p.recvs.iter().map(|t| t.offset).collect();
        let want: Vec<usize> = [0usize, 48, 48]
            .iter()
            .enumerate()
            .filter(|(s, _)| *s != rank)
            .map(|(_, &o)| o)
            .collect();
        assert_eq!(offs, want);
        match p.local {
            Some(l) => {
                assert_eq!(l.recv_offset, [0, 48, 48][rank]);
                assert_eq!(l.bytes, tokens[rank] * 16);
            }
            None => assert_eq!(tokens[rank], 0),
        }
        // Receive sizes agree with the senders' sizes.
        for rv in &p.recvs {
            assert_eq!(rv.bytes, tokens[rv.peer] * 16);
        }
    }
    // Without zero-size p2p, empty transfers vanish on both sides.
    let p1 = broadcast_plan(&tokens, 1, 16, false);
    assert!(p1.sends.is_empty());
    let p0 = broadcast_plan(&tokens, 0, 16, false);
    assert!(p0.recvs.iter().all(|t| t.peer != 1));
}

#[test]
fn scan_levels_and_scratch() {
    let tile = SCAN_TILE as usize;
    assert_eq!(scan_levels(0), vec![0]);
    assert_eq!(scan_levels(tile), vec![tile]);
    assert_eq!(scan_levels(tile + 1), vec![tile + 1, 2]);
    assert_eq!(
        scan_levels(tile * tile + 1),
        vec![tile * tile + 1, tile + 1, 2]
    );
    assert_eq!(scan_blocks(0), 1);
    assert_eq!(scan_blocks(tile * 3), 3);
    assert_eq!(scan_scratch_elems(tile), 0);
    assert_eq!(scan_scratch_elems(tile + 1), 3);
    assert_eq!(scan_scratch_elems(tile * tile + 1), (tile + 2) + 3);
    // DeepSeek-V3 at T=4096, R=8, K=8: pair flags of 262144 entries need two levels.
    assert_eq!(scan_levels(8 * 4096 * 8), vec![262144, 256]);
}

#[test]
fn grid_sizes() {
    assert_eq!(blocks_for(0, 256, 1056), 1);
    assert_eq!(blocks_for(257, 256, 1056), 2);
    assert_eq!(blocks_for(10_000_000, 256, 1056), 1056);
    assert_eq!(blocks_for(5, 0, 0), 1);
}

#[test]
fn capacity_mode_is_expert_major_only_and_static() {
    for l in [
        Layout::Replicated,
        Layout::TokenMajor,
        Layout::ExpertPacked,
        Layout::RankMajor,
    ] {
        assert!(!capacity_supported(l));
    }
    assert!(capacity_supported(Layout::ExpertMajor));
    // R=8, M=128, H=7168 bf16, K=8, bf16 expert outputs.
    let (d, c) = capacity_bytes(8, 128, 7168 * 2, 8, 7168 * 2);
    assert_eq!(d, 8 * 128 * (14336 + 64 + 4));
    assert_eq!(c, 8 * 128 * 8 * 14336);
}

/// Every layout's received rows against the CPU path's definition, on random routings.
#[test]
fn shapes_agree_with_a_direct_count() {
    let (world, experts, k, m) = (4usize, 16usize, 3usize, 64usize);
    let el = experts / world;
    let mut seed = 0x1234_5678_u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for _ in 0..20 {
        let mut ranks_ids = Vec::new();
        for _ in 0..world {
            let t = (next() % 40) as usize;
            let mut ids = Vec::new();
            for _ in 0..t {
                let mut row: Vec<i64> = Vec::new();
                while row.len() < k {
                    let e = (next() % (experts as u64 + 2)) as i64 - 1;
                    if e == -1 || !row.contains(&e) {
                        row.push(e.min(experts as i64 - 1));
                    }
                    if row.iter().filter(|&&x| x >= 0).count()
                        != row
                            .iter()
                            .filter(|&&x| x >= 0)
                            .collect::<std::collections::BTreeSet<_>>()
                            .len()
                    {
                        row.pop();
                    }
                }
                ids.extend(row);
            }
            ranks_ids.push(ids);
        }
        let raw: Vec<i32> = ranks_ids
            .iter()
            .flat_map(|ids| counts_row(ids, k, world, experts, 0))
            .collect();
        let g = Gathered::parse(&raw, world, experts).unwrap();
        for d in 0..world {
            let gm = ShapeGeometry {
                world,
                rank: d,
                num_experts: experts,
                top_k: k,
                hidden: 8,
                max_tokens_per_rank: m,
                backend: Backend::FlashinferNvlinkTwoSided,
            };
            let owned = |e: i64| e >= 0 && e as usize / el == d;
            let token_rows: usize = ranks_ids
                .iter()
                .map(|ids| {
                    ids.chunks(k)
                        .filter(|t| t.iter().any(|&e| owned(e)))
                        .count()
                })
                .sum();
            let pair_rows: usize = ranks_ids
                .iter()
                .map(|ids| ids.iter().filter(|&&e| owned(e)).count())
                .sum();
            let s = dispatch_shape(Layout::TokenMajor, &gm, &g).unwrap();
            assert_eq!(s.received_rows, token_rows);
            let s = dispatch_shape(Layout::ExpertPacked, &gm, &g).unwrap();
            assert_eq!(s.received_rows, pair_rows);
            let s = dispatch_shape(Layout::RankMajor, &gm, &g).unwrap();
            assert_eq!(s.received_rows, token_rows);
            let off = recv_offsets(&g.rank_counts, world, d);
            assert_eq!(off[world] as usize, token_rows);
        }
    }
}

#[cfg(feature = "cuda")]
#[test]
fn launch_arguments_are_checked_against_the_tables() {
    use epcomm::gpu::kernels::{EP_LOCAL_COPY, EP_SUM_RANKS};
    use epcomm::gpu::launch::{arch_for, check_args, Arg};
    assert_eq!(arch_for((9, 0)), "sm_90");
    check_args(&EP_LOCAL_COPY, &[Arg::Ptr(1), Arg::Ptr(2), Arg::U64(3)]).unwrap();
    // Wrong count, wrong kind, NULL where not nullable.
    assert!(check_args(&EP_LOCAL_COPY, &[Arg::Ptr(1), Arg::Ptr(2)]).is_err());
    assert!(check_args(&EP_LOCAL_COPY, &[Arg::Ptr(1), Arg::Ptr(2), Arg::I32(3)]).is_err());
    assert!(check_args(&EP_LOCAL_COPY, &[Arg::Ptr(0), Arg::Ptr(2), Arg::U64(3)]).is_err());
    // Nullable pointers may be 0 (ep_sum_ranks' rank_flag/send_pos for REPLICATED).
    check_args(
        &EP_SUM_RANKS,
        &[
            Arg::Ptr(1),
            Arg::Ptr(0),
            Arg::Ptr(0),
            Arg::I32(1),
            Arg::I32(1),
            Arg::I32(1),
            Arg::Ptr(2),
        ],
    )
    .unwrap();
}

#[test]
fn sizes_beyond_i32_are_rejected_before_any_launch() {
    use epcomm::gpu::transport::plan::check_index_limits;
    check_index_limits(8, 256, 8, 7168, 4096).unwrap();
    // Largest accepted: M * R * K + 1 == i32::MAX.
    let m = (i32::MAX as usize - 1) / 16;
    check_index_limits(2, 4, 8, 1, m).unwrap();
    let e = check_index_limits(2, 4, 8, 1, m + 1).unwrap_err();
    assert!(
        e.to_string()
            .contains("max_tokens_per_rank x world_size x top_k"),
        "{e}"
    );
    // Overflowing usize saturates instead of wrapping to a small number.
    assert!(check_index_limits(2, 4, 8, 1, usize::MAX / 2).is_err());
    let e = check_index_limits(2, 4, 2, 1 << 31, 0).unwrap_err();
    assert!(e.to_string().starts_with("hidden is 2147483648"), "{e}");
    let e = check_index_limits(2, 1 << 31, 2, 16, 0).unwrap_err();
    assert!(e.to_string().starts_with("num_experts is"), "{e}");
}

#[test]
fn a_host_side_rejection_reaches_the_peers() {
    use epcomm::gpu::kernels::ERR_HOST_REJECTED;
    // GpuManager::reject_dispatch: a counts row of T = 0 carrying the host-made word.
    let word = encode_error_word(ERR_HOST_REJECTED, 0, 0);
    let r0 = counts_row(&[0, 1, 2, 3], 2, 2, 4, 0);
    let r1 = counts_row(&[], 2, 2, 4, word);
    let g = Gathered::parse(&[r0, r1].concat(), 2, 4).unwrap();
    assert_eq!(g.first_error(), Some((1, DeviceError::HostRejected)));
    let peer = g.check(0).unwrap_err();
    assert_eq!(peer.status(), epcomm::Status::InvalidArgument);
    assert_eq!(
        peer.to_string(),
        "rank 1 rejected its dispatch input: its input failed the host-side checks (sizes, shapes, dtypes or alignment)"
    );
}
