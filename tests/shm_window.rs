//! Symmetric memory of the shared-memory group (`Group::alloc_shared`): exchange_rows into a
//! window (the sources store their rows straight into it) and reduce_rows from a window (the
//! destinations load the rows from it) give exactly the bytes and sums of private buffers, on
//! thread ranks and on process ranks (whose windows are mapped through /proc), with some ranks
//! in windows and others not, at an offset into a window, with rows far larger than the caches
//! (streaming stores), and with repeated destination rows (no window offered then). A count
//! disagreement with a window destination fails on every rank with one message before any row
//! moves, and the group stays usable.

mod ranks;

use std::time::Duration;

use epcomm::error::Error;
use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions, RowExchange, RowReduce};
use epcomm::num::{self, FloatKind};

fn opts() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(30),
        ..GroupOptions::default()
    }
}

/// A deterministic byte of row `r` of rank `src` at byte `i`.
fn byte(src: usize, r: usize, i: usize) -> u8 {
    (src * 131 + r * 17 + i * 7 + (i >> 8)) as u8
}

/// Rows `src` gives `dst`: `n(src, dst)` of them, some repeated, in a scrambled order.
fn give_list(src: usize, dst: usize, rows: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7 + src * 3 + dst * 5) % rows) as u32)
        .collect()
}

fn count(src: usize, dst: usize, big: bool) -> usize {
    if big {
        // 2 x 1100 rows of 16 KiB: over 16 MiB per pair, written with streaming stores.
        1100
    } else {
        3 + (src * 5 + dst * 3) % 7
    }
}

/// One exchange_rows and (small rows) one reduce_rows on this rank of `world`; `window` says
/// whether it puts its buffers in a window. Panics on a wrong byte or sum.
fn exchange_and_reduce(g: &mut ShmGroup, world: usize, window: bool, big: bool) {
    let me = g.rank();
    let (rows, row_bytes) = if big { (1200, 16384) } else { (11, 40) };
    let src: Vec<u8> = (0..rows * row_bytes)
        .map(|i| byte(me, i / row_bytes, i % row_bytes))
        .collect();
    let give: Vec<Vec<u32>> = (0..world)
        .map(|p| give_list(me, p, rows, count(me, p, big)))
        .collect();
    let incoming: usize = (0..world).map(|p| count(p, me, big)).sum();
    // Destination rows: reversed, so each source's rows are scattered.
    let mut next = (0..incoming as u32).rev();
    let take: Vec<Vec<u32>> = (0..world)
        .map(|p| {
            (0..count(p, me, big))
                .map(|_| next.next().unwrap())
                .collect()
        })
        .collect();
    // In a window at one row's offset, or private.
    let want_bytes = incoming * row_bytes;
    let mut shared = g.alloc_shared(want_bytes + row_bytes).unwrap().unwrap();
    let mut private = vec![0u8; want_bytes];
    let dst: &mut [u8] = if window {
        &mut shared[row_bytes..]
    } else {
        &mut private
    };
    g.exchange_rows(RowExchange {
        src: &src,
        row_bytes,
        give: &give,
        dst,
        take: &take,
    })
    .unwrap();
    for (p, list) in take.iter().enumerate() {
        let from = give_list(p, me, rows, count(p, me, big));
        for (i, &d) in list.iter().enumerate() {
            let got = &dst[d as usize * row_bytes..][..row_bytes];
            let s = from[i] as usize;
            assert!(
                got.iter().enumerate().all(|(k, &b)| b == byte(p, s, k)),
                "rank {me}: row {d} from rank {p} (#{i}, its row {s}) differs"
            );
        }
    }

    if big {
        // The large case is about the streaming stores of exchange_rows.
        return;
    }
    // reduce_rows of the received rows as bf16, from the window or a private copy.
    let elems = row_bytes / 2;
    let vals = |r: usize, e: usize| ((r * 3 + e) % 13) as f32 - 6.0 + me as f32 * 0.5;
    let mine: Vec<f32> = (0..rows * elems)
        .map(|i| vals(i / elems, i % elems))
        .collect();
    let bf = num::from_f32(&mine, FloatKind::Bf16);
    let mut src_shared = g.alloc_shared(bf.len()).unwrap().unwrap();
    src_shared.copy_from_slice(&bf);
    let red_src: &[u8] = if window { &src_shared } else { &bf };
    let out_rows = 5;
    let weight = |p: usize, i: usize| [1.0f32, 0.5, -0.25, 2.0][(p + i) % 4];
    let red_take: Vec<Vec<(u32, f32)>> = (0..world)
        .map(|p| {
            (0..count(p, me, big))
                .map(|i| ((i % out_rows) as u32, weight(p, i)))
                .collect()
        })
        .collect();
    let mut out = vec![0u8; out_rows * elems * 4];
    g.reduce_rows(RowReduce {
        src: red_src,
        kind: FloatKind::Bf16,
        row_elems: elems,
        give: &give,
        out: &mut out,
        out_kind: FloatKind::F32,
        take: &red_take,
    })
    .unwrap();
    let mut want = vec![0f32; out_rows * elems];
    for (p, list) in red_take.iter().enumerate() {
        let from = give_list(p, me, rows, count(p, me, big));
        for (i, &(r, w)) in list.iter().enumerate() {
            for e in 0..elems {
                let x = vals(from[i] as usize, e) - me as f32 * 0.5 + p as f32 * 0.5;
                let x = num::to_f32(&num::from_f32(&[x], FloatKind::Bf16), FloatKind::Bf16)[0];
                want[r as usize * elems + e] += if w == 1.0 { x } else { w * x };
            }
        }
    }
    assert_eq!(
        num::to_f32(&out, FloatKind::F32),
        want,
        "rank {me}: reduce_rows"
    );
}

fn thread_case(world: usize, window: fn(usize) -> bool, big: bool) {
    let name = ranks::unique("wt", "threads");
    ranks::on_threads(world, move |rank| {
        let mut g = ShmGroup::join(&name, rank, world, opts()).unwrap();
        assert!(g.direct(), "these cases need direct reads");
        for _ in 0..2 {
            exchange_and_reduce(&mut g, world, window(rank), big);
        }
        g.barrier().unwrap();
    });
}

#[test]
fn thread_ranks_all_in_windows() {
    thread_case(3, |_| true, false);
}

#[test]
fn thread_ranks_some_in_windows() {
    thread_case(3, |r| r != 1, false);
}

#[test]
fn thread_ranks_large_rows_stream() {
    thread_case(2, |_| true, true);
}

/// One rank process of [`process_ranks_in_windows`].
#[test]
fn window_rank_child() {
    let (Ok(name), Ok(rank)) = (std::env::var("WIN_GROUP"), std::env::var("WIN_RANK")) else {
        return;
    };
    let rank: usize = rank.parse().unwrap();
    let mut g = ShmGroup::join(&name, rank, 3, opts()).unwrap();
    for big in [false, true] {
        exchange_and_reduce(&mut g, 3, rank != 2, big);
        exchange_and_reduce(&mut g, 3, true, big);
    }
    g.barrier().unwrap();
    println!("WIN_OK");
}

#[test]
fn process_ranks_in_windows() {
    let name = ranks::unique("wp", "procs");
    let kids = ranks::spawn_ranks("window_rank_child", 0..3, |r| {
        vec![("WIN_GROUP", name.clone()), ("WIN_RANK", r.to_string())]
    });
    let done = ranks::wait_all(kids, Duration::from_secs(120));
    ranks::assert_all_ok(&done);
    for d in &done {
        assert!(d.stdout.contains("WIN_OK"), "{}", d.output());
    }
    assert!(ranks::shm_leftovers(&name).is_empty());
}

/// Repeated destination rows: no window is offered (two sources would store the same row); the
/// result is the private buffers' (the later source's row).
#[test]
fn repeated_destination_rows_fall_back() {
    let name = ranks::unique("wt", "repeat");
    let got = ranks::on_threads(2, move |me| {
        let mut g = ShmGroup::join(&name, me, 2, opts()).unwrap();
        let src = vec![me as u8 + 1; 8];
        let give = vec![vec![0u32], vec![0u32]];
        let take = vec![vec![0u32], vec![0u32]];
        let mut w = g.alloc_shared(8).unwrap().unwrap();
        g.exchange_rows(RowExchange {
            src: &src,
            row_bytes: 8,
            give: &give,
            dst: &mut w,
            take: &take,
        })
        .unwrap();
        let mut private = vec![0u8; 8];
        g.exchange_rows(RowExchange {
            src: &src,
            row_bytes: 8,
            give: &give,
            dst: &mut private,
            take: &take,
        })
        .unwrap();
        (w.to_vec(), private)
    });
    for (w, private) in got {
        assert_eq!(w, private);
        assert_eq!(w, vec![2u8; 8]);
    }
}

/// Rank 0 gives rank 1 two rows, rank 1 (a window destination) takes one: every rank fails
/// with the same message before any row moves, and the next op works.
#[test]
fn count_disagreement_fails_everywhere_before_data_moves() {
    let name = ranks::unique("wt", "counts");
    let errors = ranks::on_threads(2, move |me| {
        let mut g = ShmGroup::join(&name, me, 2, opts()).unwrap();
        let src = vec![7u8; 16];
        let (give, take) = if me == 0 {
            (
                vec![vec![0u32], vec![0u32, 1]],
                vec![vec![0u32], vec![1u32]],
            )
        } else {
            (vec![vec![0u32], vec![1u32]], vec![vec![0u32], vec![1u32]])
        };
        let mut w = g.alloc_shared(16).unwrap().unwrap();
        let e = g
            .exchange_rows(RowExchange {
                src: &src,
                row_bytes: 8,
                give: &give,
                dst: &mut w,
                take: &take,
            })
            .unwrap_err();
        let untouched = if me == 1 { w[..8] == [0u8; 8] } else { true };
        g.barrier().unwrap();
        (e, untouched)
    });
    for (e, untouched) in errors {
        match e {
            Error::InvalidArgument(m) => assert_eq!(
                m,
                "exchange_rows: rank 0 gives 2 rows to rank 1 but rank 1 expects 1"
            ),
            other => panic!("{other:?}"),
        }
        assert!(untouched, "a row moved before the disagreement was found");
    }
}
