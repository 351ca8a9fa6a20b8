//! Process groups: every primitive against a local reference (random data, uneven and zero
//! sizes, f32/bf16/f16) on 2, 3, 4 and 8 processes, on threads, and over a host transport; and
//! the failure matrix (dead peer, missing peer, mismatched world size, stale segment, wrong
//! collective order, capacity limit). Every multi-process case is bounded: children that run
//! past their deadline are killed and the test fails.
//!
//! Multi-process cases re-run this test binary as the ranks (`EPCOMM_TEST_CHILD`), so each rank
//! is a real process.

mod ranks;

use std::collections::HashMap;
use std::process::Child;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::{Duration, Instant};

use epcomm::group::host::{HostGroup, HostTransport};
use epcomm::group::shm::ShmGroup;
use epcomm::group::{AllToAllv, Group, GroupOptions, P2p, ReduceScatterv, RowExchange, RowReduce};
use epcomm::num::{self, FloatKind};
use epcomm::{Error, Status};
use ranks::{assert_all_ok, shm_leftovers, wait_all, Finished};

// ---- deterministic data --------------------------------------------------------------------

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn key(parts: &[u64]) -> u64 {
    parts.iter().fold(0x1234_5678, |acc, &p| mix(acc ^ p))
}

fn bytes(k: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| mix(k ^ i.wrapping_mul(0x100_0000_01b3)) as u8)
        .collect()
}

fn floats(k: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| (mix(k ^ (i << 1)) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// Rows per rank for iteration `it`: uneven, with zeros.
fn rows_for(seed: u64, it: u64, world: usize) -> Vec<usize> {
    (0..world)
        .map(|r| {
            let v = mix(key(&[seed, it, r as u64, 1])) % 7;
            if v < 2 {
                0
            } else {
                (v as usize) * (1 + it as usize % 3)
            }
        })
        .collect()
}

// ---- the worker: every primitive, checked against a locally computed reference ---------------

fn exercise(g: &mut dyn Group, seed: u64, iters: u64) {
    let me = g.rank();
    let world = g.size();
    for it in 0..iters {
        g.barrier().unwrap();

        // all_gatherv of bytes.
        let row = 24 + (it as usize % 4) * 1000;
        let rows = rows_for(seed, it, world);
        let sizes: Vec<usize> = rows.iter().map(|r| r * row).collect();
        let mine = bytes(key(&[seed, it, me as u64, 2]), sizes[me]);
        let mut out = vec![0u8; sizes.iter().sum()];
        g.all_gatherv(&mine, &sizes, &mut out).unwrap();
        let expect: Vec<u8> = (0..world)
            .flat_map(|r| bytes(key(&[seed, it, r as u64, 2]), sizes[r]))
            .collect();
        assert!(out == expect, "all_gatherv mismatch (rank {me}, iter {it})");

        // reduce_scatterv in every float kind, against an f64 reference and bit-exact against
        // the same f32 sum in rank order.
        for kind in [FloatKind::F32, FloatKind::Bf16, FloatKind::F16] {
            let elems = 3 + it as usize % 5 * 100;
            let total: usize = rows.iter().sum();
            let input_of = |r: usize| {
                num::from_f32(
                    &floats(key(&[seed, it, r as u64, kind as u64, 3]), total * elems),
                    kind,
                )
            };
            let input = input_of(me);
            let mut out = vec![0u8; rows[me] * elems * kind.size()];
            g.reduce_scatterv(ReduceScatterv {
                input: &input,
                rows: &rows,
                row_elems: elems,
                kind,
                output: &mut out,
            })
            .unwrap();
            let start: usize = rows[..me].iter().sum::<usize>() * elems;
            let n = rows[me] * elems;
            let mut acc = vec![0f32; n];
            let mut exact = vec![0f64; n];
            for r in 0..world {
                let vals = num::to_f32(&input_of(r), kind);
                for i in 0..n {
                    acc[i] += vals[start + i];
                    exact[i] += vals[start + i] as f64;
                }
            }
            assert_eq!(
                out,
                num::from_f32(&acc, kind),
                "reduce_scatterv {kind:?} rank {me} iter {it}"
            );
            // Tolerance: one rounding of the output type (f32 accumulation error is far below).
            let tol = match kind {
                FloatKind::F32 => 1e-5,
                FloatKind::Bf16 => 1.6e-2,
                FloatKind::F16 => 2e-3,
            };
            for (got, want) in num::to_f32(&out, kind).iter().zip(&exact) {
                assert!(
                    ((*got as f64) - want).abs() <= tol * want.abs().max(1.0),
                    "{got} vs {want}"
                );
            }
        }

        // all_to_allv with uneven and zero chunks.
        let chunk = |src: usize, dst: usize| {
            let v = mix(key(&[seed, it, src as u64, dst as u64, 4])) % 5;
            if v == 0 {
                0
            } else {
                v as usize * 37 + it as usize * 11
            }
        };
        let send: Vec<u8> = (0..world)
            .flat_map(|p| bytes(key(&[seed, it, me as u64, p as u64, 5]), chunk(me, p)))
            .collect();
        let send_sizes: Vec<usize> = (0..world).map(|p| chunk(me, p)).collect();
        let recv_sizes: Vec<usize> = (0..world).map(|p| chunk(p, me)).collect();
        let mut recv = vec![0u8; recv_sizes.iter().sum()];
        g.all_to_allv(AllToAllv {
            send: &send,
            send_sizes: &send_sizes,
            recv: &mut recv,
            recv_sizes: &recv_sizes,
        })
        .unwrap();
        let expect: Vec<u8> = (0..world)
            .flat_map(|p| bytes(key(&[seed, it, p as u64, me as u64, 5]), chunk(p, me)))
            .collect();
        assert!(
            recv == expect,
            "all_to_allv mismatch (rank {me}, iter {it})"
        );

        // Batched send/recv: each rank sends 0..2 messages to each peer (self included).
        let count = |src: usize, dst: usize| {
            (mix(key(&[seed, it, src as u64, dst as u64, 6])) % 3) as usize
        };
        let msg_len = |src: usize, dst: usize, j: usize| {
            (mix(key(&[seed, it, src as u64, dst as u64, j as u64, 7])) % 300) as usize
        };
        let msg = |src: usize, dst: usize, j: usize| {
            bytes(
                key(&[seed, it, src as u64, dst as u64, j as u64, 8]),
                msg_len(src, dst, j),
            )
        };
        let sends: Vec<(usize, Vec<u8>)> = (0..world)
            .flat_map(|p| (0..count(me, p)).map(move |j| (p, j)))
            .map(|(p, j)| (p, msg(me, p, j)))
            .collect();
        let mut recvs: Vec<(usize, usize, Vec<u8>)> = (0..world)
            .flat_map(|p| (0..count(p, me)).map(move |j| (p, j)))
            .map(|(p, j)| (p, j, vec![0u8; msg_len(p, me, j)]))
            .collect();
        {
            let mut ops: Vec<P2p<'_>> = Vec::new();
            // Interleave sends and receives to show order only matters per peer pair.
            let mut ri = recvs.iter_mut();
            for (peer, data) in &sends {
                ops.push(P2p::Send { peer: *peer, data });
                if let Some((p, _, buf)) = ri.next() {
                    ops.push(P2p::Recv {
                        peer: *p,
                        data: buf,
                    });
                }
            }
            for (p, _, buf) in ri {
                ops.push(P2p::Recv {
                    peer: *p,
                    data: buf,
                });
            }
            g.send_recv(&mut ops).unwrap();
        }
        for (p, j, buf) in &recvs {
            assert_eq!(*buf, msg(*p, me, *j), "send_recv from {p} #{j} to {me}");
        }

        // exchange_rows: each peer gets rows of mine (repeats allowed), placed at a permuted
        // set of rows on the receiver.
        let row_bytes = 8 + it as usize * 40;
        let my_rows = 1 + (mix(key(&[seed, it, me as u64, 10])) % 9) as usize;
        let rows_of = |r: usize| 1 + (mix(key(&[seed, it, r as u64, 10])) % 9) as usize;
        let n_to = |src: usize, dst: usize| {
            (mix(key(&[seed, it, src as u64, dst as u64, 11])) % 6) as usize
        };
        let pick = |src: usize, dst: usize, i: usize| {
            (mix(key(&[seed, it, src as u64, dst as u64, i as u64, 12])) % rows_of(src) as u64)
                as u32
        };
        let src_rows: Vec<u8> = (0..my_rows)
            .flat_map(|r| bytes(key(&[seed, it, me as u64, r as u64, 13]), row_bytes))
            .collect();
        let give: Vec<Vec<u32>> = (0..world)
            .map(|p| (0..n_to(me, p)).map(|i| pick(me, p, i)).collect())
            .collect();
        let total_in: usize = (0..world).map(|p| n_to(p, me)).sum();
        // Destination rows: a shuffled permutation, so rows from one peer are scattered in dst.
        let mut perm: Vec<u32> = (0..total_in as u32).collect();
        perm.sort_by_key(|&i| mix(key(&[seed, it, me as u64, i as u64, 16])));
        let mut next = perm.into_iter();
        let take: Vec<Vec<u32>> = (0..world)
            .map(|p| (0..n_to(p, me)).map(|_| next.next().unwrap()).collect())
            .collect();
        let mut dst = vec![0u8; total_in * row_bytes];
        g.exchange_rows(RowExchange {
            src: &src_rows,
            row_bytes,
            give: &give,
            dst: &mut dst,
            take: &take,
        })
        .unwrap();
        for (p, list) in take.iter().enumerate() {
            for (i, &d) in list.iter().enumerate() {
                let want = bytes(
                    key(&[seed, it, p as u64, pick(p, me, i) as u64, 13]),
                    row_bytes,
                );
                assert_eq!(
                    &dst[d as usize * row_bytes..(d as usize + 1) * row_bytes],
                    &want[..],
                    "exchange_rows row from {p} #{i}"
                );
            }
        }

        // reduce_rows: weighted contributions summed in rank order, then list order.
        for kind in [FloatKind::F32, FloatKind::Bf16, FloatKind::F16] {
            let elems = 5 + it as usize;
            let vals_of = |r: usize| {
                floats(
                    key(&[seed, it, r as u64, kind as u64, 14]),
                    rows_of(r) * elems,
                )
            };
            let src = num::from_f32(&vals_of(me), kind);
            let acc_rows = 3;
            let weight = |src: usize, i: usize| {
                [1.0f32, 0.5, -0.25, 2.0]
                    [(mix(key(&[seed, it, src as u64, i as u64, 15])) % 4) as usize]
            };
            let take: Vec<Vec<(u32, f32)>> = (0..world)
                .map(|p| {
                    (0..n_to(p, me))
                        .map(|i| ((i % acc_rows) as u32, weight(p, i)))
                        .collect()
                })
                .collect();
            let mut out = vec![0u8; acc_rows * elems * 4];
            g.reduce_rows(RowReduce {
                src: &src,
                kind,
                row_elems: elems,
                give: &give,
                out: &mut out,
                out_kind: FloatKind::F32,
                take: &take,
            })
            .unwrap();
            let mut want = vec![0f32; acc_rows * elems];
            for (p, list) in take.iter().enumerate() {
                let theirs = num::to_f32(&num::from_f32(&vals_of(p), kind), kind);
                for (i, &(r, w)) in list.iter().enumerate() {
                    let s = pick(p, me, i) as usize;
                    for e in 0..elems {
                        let x = theirs[s * elems + e];
                        want[r as usize * elems + e] += if w == 1.0 { x } else { w * x };
                    }
                }
            }
            assert_eq!(
                num::to_f32(&out, FloatKind::F32),
                want,
                "reduce_rows {kind:?} rank {me} iter {it}"
            );
        }

        // broadcast and small all_gather.
        let root = it as usize % world;
        let mut data = if me == root {
            bytes(key(&[seed, it, 9]), 777)
        } else {
            vec![0u8; 777]
        };
        g.broadcast(root, &mut data).unwrap();
        assert_eq!(data, bytes(key(&[seed, it, 9]), 777));
        let mut all = vec![0u8; 8 * world];
        g.all_gather(&(me as u64 * 3 + it).to_ne_bytes(), &mut all)
            .unwrap();
        for r in 0..world {
            assert_eq!(
                u64::from_ne_bytes(all[r * 8..r * 8 + 8].try_into().unwrap()),
                r as u64 * 3 + it
            );
        }
    }
    g.barrier().unwrap();
}

// ---- multi-process plumbing -----------------------------------------------------------------

struct ChildCtx {
    case: String,
    rank: usize,
    world: usize,
    group: String,
    seed: u64,
}

fn child() -> Option<ChildCtx> {
    let case = std::env::var("EPCOMM_TEST_CHILD").ok()?;
    let get = |k: &str| std::env::var(k).unwrap();
    Some(ChildCtx {
        case,
        rank: get("EPCOMM_TEST_RANK").parse().unwrap(),
        world: get("EPCOMM_TEST_WORLD").parse().unwrap(),
        group: get("EPCOMM_TEST_GROUP"),
        seed: get("EPCOMM_TEST_SEED").parse().unwrap(),
    })
}

/// A group name unique to this run (`ranks::unique`).
fn unique(name: &str) -> String {
    ranks::unique("t", name)
}

/// Spawns `which` ranks of this test (`test_name`) as child processes of a `world`-rank group.
fn spawn(
    test_name: &str,
    case: &str,
    group: &str,
    world: usize,
    which: &[usize],
    extra_env: &[(&'static str, String)],
) -> Vec<(usize, Child)> {
    ranks::spawn_ranks(test_name, which.iter().copied(), |rank| {
        let mut env = vec![
            ("EPCOMM_TEST_CHILD", case.to_owned()),
            ("EPCOMM_TEST_RANK", rank.to_string()),
            ("EPCOMM_TEST_WORLD", world.to_string()),
            ("EPCOMM_TEST_GROUP", group.to_owned()),
            ("EPCOMM_TEST_SEED", "42".to_owned()),
        ];
        env.extend(extra_env.iter().cloned());
        env
    })
}

/// Child side: prints the outcome of `f` as one line `RESULT <status> <message>`.
fn report(r: epcomm::Result<()>) {
    match r {
        Ok(()) => println!("\nRESULT ok"),
        Err(e) => println!("\nRESULT {} {}", e.status() as i32, e),
    }
}

fn result_line(f: &Finished) -> String {
    f.output()
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or("<none>")
        .to_owned()
}

fn opts() -> GroupOptions {
    GroupOptions {
        initial_capacity: 4096, // small, so the regions grow during the test
        ..GroupOptions::default()
    }
}

// ---- correctness ----------------------------------------------------------------------------

#[test]
fn primitives_on_2_3_4_8_processes() {
    if let Some(c) = child() {
        let mut g = ShmGroup::join(&c.group, c.rank, c.world, opts()).unwrap();
        exercise(&mut g, c.seed, 6);
        return;
    }
    for world in [2, 3, 4, 8] {
        let group = unique("prims");
        let kids = spawn(
            "primitives_on_2_3_4_8_processes",
            "prims",
            &group,
            world,
            &(0..world).collect::<Vec<_>>(),
            &[],
        );
        assert_all_ok(&wait_all(kids, Duration::from_secs(120)));
        assert!(
            shm_leftovers(&group).is_empty(),
            "{:?}",
            shm_leftovers(&group)
        );
    }
}

#[test]
fn primitives_on_threads() {
    for (world, direct_reads) in [(1, true), (2, true), (3, true), (4, true), (3, false)] {
        let group = unique("threads");
        let name = group.clone();
        ranks::on_threads(world, move |rank| {
            let o = GroupOptions {
                direct_reads,
                ..opts()
            };
            let mut g = ShmGroup::join(&name, rank, world, o).unwrap();
            assert_eq!(
                g.direct(),
                direct_reads,
                "threads of one process can always read each other"
            );
            exercise(&mut g, 7, 4);
        });
        assert!(shm_leftovers(&group).is_empty());
    }
}

/// A host transport over in-process channels: what a runtime's own send/recv would be.
struct ChannelTransport {
    rank: usize,
    to: Vec<Sender<Vec<u8>>>,
    from: Vec<Receiver<Vec<u8>>>,
}

impl HostTransport for ChannelTransport {
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), String> {
        self.to[peer].send(data.to_vec()).map_err(|e| e.to_string())
    }
    fn recv(&mut self, peer: usize, data: &mut [u8]) -> Result<(), String> {
        let m = self.from[peer]
            .recv_timeout(Duration::from_secs(30))
            .map_err(|e| format!("{e} (rank {} from {peer})", self.rank))?;
        if m.len() != data.len() {
            return Err(format!("got {} bytes, expected {}", m.len(), data.len()));
        }
        data.copy_from_slice(&m);
        Ok(())
    }
}

fn channel_transports(world: usize) -> Vec<ChannelTransport> {
    let mut senders: Vec<Vec<Option<Sender<Vec<u8>>>>> = (0..world)
        .map(|_| (0..world).map(|_| None).collect())
        .collect();
    let mut receivers: HashMap<(usize, usize), Receiver<Vec<u8>>> = HashMap::new();
    for (src, row) in senders.iter_mut().enumerate() {
        for (dst, cell) in row.iter_mut().enumerate() {
            let (tx, rx) = channel();
            *cell = Some(tx);
            receivers.insert((src, dst), rx);
        }
    }
    (0..world)
        .map(|r| ChannelTransport {
            rank: r,
            to: senders[r].iter_mut().map(|s| s.take().unwrap()).collect(),
            from: (0..world)
                .map(|src| receivers.remove(&(src, r)).unwrap())
                .collect(),
        })
        .collect()
}

#[test]
fn primitives_over_host_callbacks() {
    for world in [1, 2, 3, 5] {
        let handles: Vec<_> = channel_transports(world)
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                std::thread::spawn(move || {
                    let mut g = HostGroup::new(Box::new(t), "host", rank, world, false).unwrap();
                    exercise(&mut g, 11, 3);
                })
            })
            .collect();
        for h in handles {
            h.join().expect("rank thread panicked");
        }
    }
}

#[test]
fn host_transport_errors_are_reported() {
    struct Broken;
    impl HostTransport for Broken {
        fn send(&mut self, _: usize, _: &[u8]) -> Result<(), String> {
            Err("connection reset".into())
        }
        fn recv(&mut self, _: usize, _: &mut [u8]) -> Result<(), String> {
            Err("connection reset".into())
        }
    }
    let mut g = HostGroup::new(Box::new(Broken), "h", 0, 2, false).unwrap();
    let e = g.barrier().unwrap_err();
    assert_eq!(e.status(), Status::Runtime);
    assert_eq!(e.to_string(), "host transport send to rank 1 failed during barrier of group 'h' on rank 0: connection reset");
    let e = g.barrier().unwrap_err();
    assert_eq!(e.status(), Status::InvalidState);
}

// ---- argument errors ------------------------------------------------------------------------

#[test]
fn bad_arguments_are_clear_errors() {
    let group = unique("args");
    let mut g = ShmGroup::join(&group, 0, 1, opts()).unwrap();
    let e = g.all_gatherv(&[1, 2, 3], &[4], &mut [0; 4]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "all_gatherv: input has 3 bytes; expected 4 (sizes[0])"
    );
    let e = g.all_gatherv(&[1], &[1, 1], &mut [0; 2]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "all_gatherv: sizes has 2 entries; expected one per rank (1)"
    );
    let e = g
        .reduce_scatterv(ReduceScatterv {
            input: &[0; 8],
            rows: &[2],
            row_elems: 2,
            kind: FloatKind::F32,
            output: &mut [0; 16],
        })
        .unwrap_err();
    assert_eq!(e.to_string(), "reduce_scatterv: input has 8 bytes; expected 16 (sum(rows) = 2 rows of 2 float32 elements)");
    let e = g.broadcast(3, &mut [0; 4]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "broadcast: root is 3; expected a rank in 0..1"
    );
    // Argument errors do not break the group.
    g.barrier().unwrap();
    for (name, rank, world, msg) in [
        ("bad/name", 0, 1, "group name 'bad/name' is not valid: expected 1 to 64 characters from A-Z, a-z, 0-9, '_', '.', '-'"),
        ("ok", 2, 2, "rank is 2; expected 0 <= rank < world_size (2)"),
        ("ok", 0, 0, "world_size is 0; expected 1..=1024"),
    ] {
        let e = ShmGroup::join(name, rank, world, opts()).unwrap_err();
        assert_eq!((e.status(), e.to_string().as_str()), (Status::InvalidArgument, msg));
    }
}

#[test]
fn capacity_limit_names_the_sizes() {
    let group = unique("cap");
    // Direct reads need no region space for payloads; the staged mode does.
    let o = GroupOptions {
        initial_capacity: 4096,
        max_capacity: 1 << 20,
        direct_reads: false,
        ..GroupOptions::default()
    };
    let mut g = ShmGroup::join(&group, 0, 1, o).unwrap();
    let big = vec![0u8; 2 << 20];
    let mut out = vec![0u8; 2 << 20];
    let e = g.all_gatherv(&big, &[big.len()], &mut out).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert_eq!(
        e.to_string(),
        format!("group '{group}' needs 2097216 bytes of shared memory on rank 0 for this call, more than the maximum capacity of 1048576 bytes (set a larger max_capacity_bytes)")
    );
    drop(g);
    assert!(shm_leftovers(&group).is_empty());
}

// ---- failures -------------------------------------------------------------------------------

#[test]
fn dead_peer_is_reported_within_a_second() {
    const NAME: &str = "dead_peer_is_reported_within_a_second";
    if let Some(c) = child() {
        let mut g = ShmGroup::join(&c.group, c.rank, c.world, opts()).unwrap();
        g.barrier().unwrap();
        if c.rank == 2 {
            std::thread::sleep(Duration::from_millis(200));
            std::process::abort(); // dies mid-run, no cleanup
        }
        let t = Instant::now();
        let r = g.all_gatherv(&[1; 10], &[10; 3], &mut [0; 30]);
        println!("\nELAPSED {}", t.elapsed().as_millis());
        report(r);
        return;
    }
    let group = unique("dead");
    let kids = spawn(
        NAME,
        "dead",
        &group,
        3,
        &[0, 1, 2],
        &[("EPCOMM_TIMEOUT_S", "30".into())],
    );
    let res = wait_all(kids, Duration::from_secs(60));
    for f in res.iter().filter(|f| f.rank != 2) {
        let line = result_line(f);
        let (status, msg) = line.split_once(' ').unwrap();
        assert_eq!(
            status,
            (Status::PeerFailure as i32).to_string(),
            "{}",
            f.output()
        );
        assert!(
            msg.starts_with(&format!("rank 2 of group '{group}' died (pid ")),
            "{msg}"
        );
        assert!(msg.contains(" is gone) during all_gatherv (op #2"), "{msg}");
        let elapsed: u64 = f
            .output()
            .lines()
            .find_map(|l| l.strip_prefix("ELAPSED "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(elapsed < 1500, "took {elapsed} ms");
    }
    assert!(
        shm_leftovers(&group).is_empty(),
        "{:?}",
        shm_leftovers(&group)
    );
}

#[test]
fn missing_peer_times_out_naming_it() {
    const NAME: &str = "missing_peer_times_out_naming_it";
    if let Some(c) = child() {
        report(ShmGroup::join(&c.group, c.rank, c.world, opts()).map(drop));
        return;
    }
    let group = unique("missing");
    let kids = spawn(
        NAME,
        "missing",
        &group,
        3,
        &[0, 1],
        &[("EPCOMM_TIMEOUT_S", "1".into())],
    );
    let res = wait_all(kids, Duration::from_secs(30));
    for f in &res {
        assert_eq!(
            result_line(f),
            format!(
                "{} timed out after 1.0 s waiting for rank(s) 2 to join group '{group}' (rank(s) 2 of 3 missing; joined: rank(s) 0, 1); check that those ranks were started and create the group with the name '{group}' and world_size 3 (a rank that failed first reports its own error there; two jobs that use one name at the same time are refused, saying so), or raise the timeout (EPCOMM_TIMEOUT_S, or the group's timeout_s)",
                Status::Timeout as i32
            ),
            "{}",
            f.output()
        );
    }
    assert_eq!(Status::Timeout.exception(), Some("TimeoutError"));
    assert!(
        shm_leftovers(&group).is_empty(),
        "{:?}",
        shm_leftovers(&group)
    );
}

#[test]
fn slow_peer_times_out_mid_operation() {
    const NAME: &str = "slow_peer_times_out_mid_operation";
    if let Some(c) = child() {
        let mut g = ShmGroup::join(&c.group, c.rank, c.world, opts()).unwrap();
        if c.rank == 1 {
            std::thread::sleep(Duration::from_secs(3));
            return;
        }
        report(g.barrier());
        return;
    }
    let group = unique("slow");
    let kids = spawn(
        NAME,
        "slow",
        &group,
        2,
        &[0, 1],
        &[("EPCOMM_TIMEOUT_S", "1".into())],
    );
    let res = wait_all(kids, Duration::from_secs(30));
    assert_eq!(
        result_line(&res[0]),
        format!(
            "{} timed out after 1.0 s in barrier of group '{group}' (op #1) waiting for rank(s) 1",
            Status::Timeout as i32
        ),
        "{}",
        res[0].output()
    );
    assert!(
        shm_leftovers(&group).is_empty(),
        "{:?}",
        shm_leftovers(&group)
    );
}

#[test]
fn mismatched_world_size_is_an_error() {
    const NAME: &str = "mismatched_world_size_is_an_error";
    if let Some(c) = child() {
        let world = if c.rank == 1 { 3 } else { 2 };
        report(ShmGroup::join(&c.group, c.rank, world, opts()).map(drop));
        return;
    }
    let group = unique("mismatch");
    let kids = spawn(
        NAME,
        "mismatch",
        &group,
        2,
        &[0, 1],
        &[("EPCOMM_TIMEOUT_S", "20".into())],
    );
    let res = wait_all(kids, Duration::from_secs(40));
    let code = Status::InvalidArgument as i32;
    assert_eq!(
        result_line(&res[0]),
        format!("{code} rank 1 tried to join group '{group}' with world_size 3, but this group has world_size 2"),
        "{}",
        res[0].output()
    );
    assert_eq!(
        result_line(&res[1]),
        format!("{code} rank 1 joined group '{group}' with world_size 3, but rank 0 created it with world_size 2"),
        "{}",
        res[1].output()
    );
    assert!(
        shm_leftovers(&group).is_empty(),
        "{:?}",
        shm_leftovers(&group)
    );
}

#[test]
fn stale_segment_of_a_crashed_run_is_replaced() {
    const NAME: &str = "stale_segment_of_a_crashed_run_is_replaced";
    if let Some(c) = child() {
        if c.case == "crash" {
            // Rank 0 of a 2-rank run that crashes before rank 1 arrives: leaves its segments.
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                std::process::abort();
            });
            let _ = ShmGroup::join(&c.group, 0, 2, opts());
            return;
        }
        let mut g = ShmGroup::join(&c.group, c.rank, c.world, opts()).unwrap();
        exercise(&mut g, 3, 1);
        return;
    }
    let group = unique("stale");
    let crashed = wait_all(
        spawn(NAME, "crash", &group, 2, &[0], &[]),
        Duration::from_secs(30),
    );
    assert!(!crashed[0].success());
    assert!(
        !shm_leftovers(&group).is_empty(),
        "the crash should leave segments behind"
    );
    let res = wait_all(
        spawn(NAME, "run", &group, 2, &[0, 1], &[]),
        Duration::from_secs(60),
    );
    assert_all_ok(&res);
    assert!(
        shm_leftovers(&group).is_empty(),
        "{:?}",
        shm_leftovers(&group)
    );
}

#[test]
fn different_collectives_are_an_error_not_a_hang() {
    let group = unique("order");
    let g2 = group.clone();
    let t = std::thread::spawn(move || {
        let mut g = ShmGroup::join(&g2, 1, 2, opts()).unwrap();
        g.all_gatherv(&[1], &[1, 1], &mut [0; 2]).unwrap_err()
    });
    let mut g = ShmGroup::join(&group, 0, 2, opts()).unwrap();
    let mine = g.barrier().unwrap_err();
    let theirs = t.join().unwrap();
    let texts = [mine.to_string(), theirs.to_string()];
    assert!(
        texts.iter().any(|t| t.contains("called barrier while rank")
            || t.contains("called all_gatherv while rank")),
        "{texts:?}"
    );
    for e in [&mine, &theirs] {
        assert!(
            matches!(e.status(), Status::InvalidState | Status::PeerFailure),
            "{e}"
        );
    }
    // A broken group refuses further work with a clear message.
    let e = g.barrier().unwrap_err();
    assert_eq!(e.status(), Status::InvalidState);
    assert!(e.to_string().starts_with(&format!(
        "barrier: group '{group}' is unusable after an earlier failure ("
    )));
}

#[test]
fn a_destroyed_peer_is_reported() {
    let group = unique("left");
    let g2 = group.clone();
    let t = std::thread::spawn(move || {
        let g = ShmGroup::join(&g2, 1, 2, opts()).unwrap();
        drop(g);
    });
    let mut g = ShmGroup::join(&group, 0, 2, opts()).unwrap();
    t.join().unwrap();
    let e = g.barrier().unwrap_err();
    assert_eq!(e.status(), Status::PeerFailure);
    assert_eq!(e.to_string(), format!("rank 1 of group '{group}' left (destroyed its group handle) during barrier (op #1, seen from rank 0)"));
    drop(g);
    assert!(shm_leftovers(&group).is_empty());
    let _ = Error::Timeout(String::new());
}

#[test]
fn a_failed_join_leaves_nothing_behind() {
    let group = unique("joinfail");
    let huge = GroupOptions {
        initial_capacity: 1 << 50,
        ..opts()
    };
    let e = ShmGroup::join(&group, 0, 1, huge).unwrap_err();
    assert_eq!(e.status(), Status::System);
    assert!(
        e.to_string().starts_with(
            &format!("cannot create the shared-memory region of rank 0 of group '{group}' (1125899906842624 bytes): ")
        ),
        "{e}"
    );
    assert!(
        shm_leftovers(&group).is_empty(),
        "{:?}",
        shm_leftovers(&group)
    );
    // The name is free again, and a rank that fails while joining is reported to the others.
    let g2 = group.clone();
    let t = std::thread::spawn(move || ShmGroup::join(&g2, 0, 2, opts()).map(drop));
    std::thread::sleep(Duration::from_millis(100));
    let huge = GroupOptions {
        initial_capacity: 1 << 50,
        ..opts()
    };
    assert_eq!(
        ShmGroup::join(&group, 1, 2, huge).unwrap_err().status(),
        Status::System
    );
    let e = t.join().unwrap().unwrap_err();
    assert_eq!(e.status(), Status::PeerFailure);
    assert_eq!(
        e.to_string(),
        format!("rank 1 of group '{group}' failed while joining (see that rank's error)")
    );
    assert!(
        shm_leftovers(&group).is_empty(),
        "{:?}",
        shm_leftovers(&group)
    );
}

/// A timeout beyond the cap (1e20 s, infinity, 1e300) is an argument error naming the value
/// (in exponent form, not 300 digits) and the cap, never a panic in the duration arithmetic;
/// the cap itself is accepted.
#[test]
fn huge_timeouts_are_argument_errors_naming_the_cap() {
    use epcomm::ffi::group::{
        epcomm_group, epcomm_group_create_shm, epcomm_group_destroy, epcomm_group_options,
        epcomm_group_options_init,
    };
    let name = std::ffi::CString::new(unique("huge-timeout")).unwrap();
    for t in [86400.5, 1e9, 1e20, f64::INFINITY, 1e300] {
        let mut o: epcomm_group_options = unsafe { std::mem::zeroed() };
        // SAFETY: a writable options struct.
        unsafe { epcomm_group_options_init(&mut o) };
        o.timeout_s = t;
        let mut g: *mut epcomm_group = std::ptr::null_mut();
        // SAFETY: valid name, options and out pointer.
        let rc = unsafe { epcomm_group_create_shm(name.as_ptr(), 0, 1, &o, &mut g) };
        // SAFETY: a NUL-terminated string owned by this thread, copied at once.
        let msg =
            unsafe { std::ffi::CStr::from_ptr(epcomm::ffi::error::epcomm_last_error_message()) }
                .to_string_lossy()
                .into_owned();
        assert_eq!(rc, Status::InvalidArgument as i32, "{t}: {msg}");
        assert_eq!(
            msg,
            format!("options->timeout_s is {t:e}; expected seconds (> 0, at most 86400, one day), or <= 0 for the default")
        );
        assert!(g.is_null());
    }
    let mut o: epcomm_group_options = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { epcomm_group_options_init(&mut o) };
    o.timeout_s = 86400.0;
    let mut g: *mut epcomm_group = std::ptr::null_mut();
    // SAFETY: as above.
    let rc = unsafe { epcomm_group_create_shm(name.as_ptr(), 0, 1, &o, &mut g) };
    assert_eq!(rc, 0);
    // SAFETY: the handle is live.
    unsafe { epcomm_group_destroy(g) };
}
