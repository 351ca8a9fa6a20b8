//! Double-buffered EPLB rearrangement into next buffers in shared memory (`Group::alloc_shared`,
//! `RearrangeOptions::next_shared`): the senders store each received row straight into the
//! receiver's next buffer. The next buffers end byte-identical to next buffers in ordinary
//! memory (whose rows are read through the kernel) and to the new placement, on 2 and 4 ranks,
//! threads and processes, every rank shared, none, or every other one, migration batching on
//! and off. That the path was taken: `Summary::rows_into_shared` counts the rows stored
//! into this rank's shared next buffers, and across processes a sender has the receiver's
//! shared memory mapped (its `/proc/self/maps` lists a peer's window). A rank killed before
//! a layer's transfer leaves the survivors reporting the same valid layers, with the live
//! weights unchanged and later layers' next buffers untouched; bad next buffers fail every
//! rank before any data moves.

mod common;
mod ranks;

use std::time::Duration;

use epcomm::eplb::rearrange::{rearrange_into, LayerView, RearrangeOptions, Summary};
use epcomm::eplb::transfer::plan_layer;
use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};
use epcomm::Status;

use common::eplb_fixture::{self, Weights};

const ROW_BYTES: [usize; 2] = [24, 4096];
const LAYERS: usize = 3;
const LOGICAL: usize = 8;
const PHYSICAL: usize = 16;
/// What the next buffers hold before a rearrangement: every byte must be written.
const GARBAGE: u8 = 0xA5;

/// A rank's tensors of every layer: weights[l][t].
type Tensors = Vec<Vec<Vec<u8>>>;

fn opts() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(20),
        ..GroupOptions::default()
    }
}

fn tensors(map: &[Vec<i64>], rank: usize, world: usize) -> Tensors {
    let w = Weights {
        world,
        row_bytes: &ROW_BYTES,
    };
    w.all(map, rank)
}

/// A deterministic generator (xorshift64*), so a failing case can be replayed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }

    /// Old and new maps of every layer: the old one holds every logical expert (shuffled), the
    /// new one random experts, about one slot in eight empty.
    fn maps(&mut self) -> (Vec<Vec<i64>>, Vec<Vec<i64>>) {
        let old = (0..LAYERS)
            .map(|_| {
                let mut m: Vec<i64> = (0..PHYSICAL)
                    .map(|i| (if i < LOGICAL { i } else { self.below(LOGICAL) }) as i64)
                    .collect();
                for i in (1..m.len()).rev() {
                    m.swap(i, self.below(i + 1));
                }
                m
            })
            .collect();
        let new = (0..LAYERS)
            .map(|_| {
                (0..PHYSICAL)
                    .map(|_| match self.below(8) {
                        0 => -1,
                        _ => self.below(LOGICAL) as i64,
                    })
                    .collect()
            })
            .collect();
        (old, new)
    }
}

/// `buf` cut into next buffers shaped as `live` (layer after layer, tensor after tensor).
fn carve<'a>(mut buf: &'a mut [u8], live: &Tensors) -> Vec<Vec<&'a mut [u8]>> {
    let mut layers = Vec::new();
    for l in live {
        let mut layer = Vec::new();
        for t in l {
            let (head, rest) = std::mem::take(&mut buf).split_at_mut(t.len());
            layer.push(head);
            buf = rest;
        }
        layers.push(layer);
    }
    layers
}

fn read_only(w: &Tensors) -> Vec<LayerView<'_>> {
    w.iter()
        .map(|l| l.iter().map(Vec::as_slice).collect())
        .collect()
}

/// Rows (one per received slot and tensor) rank `r` receives from its peers.
fn received_rows(old: &[Vec<i64>], new: &[Vec<i64>], r: usize, world: usize) -> usize {
    let n_local = PHYSICAL / world;
    let layers = old.iter().zip(new);
    let recvs: usize = layers
        .map(|(o, n)| plan_layer(o, n, n_local, r).unwrap().recvs.len())
        .sum();
    recvs * ROW_BYTES.len()
}

/// One double-buffered rearrangement on rank `r`, its next buffers in shared memory from the
/// group (`shared`) or in ordinary memory; returns them (copied out) and the summary.
fn place(
    g: &mut ShmGroup,
    (old, new): (&[Vec<i64>], &[Vec<i64>]),
    batching: bool,
    shared: bool,
) -> (Tensors, Summary) {
    let (r, world) = (g.rank(), g.size());
    let live = tensors(old, r, world);
    let total: usize = live.iter().flatten().map(Vec::len).sum();
    let mut heap = vec![GARBAGE; total];
    let mut window = g
        .alloc_shared(total)
        .unwrap()
        .expect("a direct-mode group has windows");
    window.fill(GARBAGE);
    let buf: &mut [u8] = if shared { &mut window } else { &mut heap };
    let mut next = carve(buf, &live);
    let options = RearrangeOptions {
        migration_batching: batching,
        next_shared: shared,
        ..RearrangeOptions::default()
    };
    let mut c = eplb_fixture::gloo_cpu().unwrap();
    let out = rearrange_into(
        g,
        c.as_mut(),
        old,
        new,
        &read_only(&live),
        &mut next,
        &ROW_BYTES,
        &options,
    );
    assert_eq!(out.next_valid, LAYERS, "rank {r}");
    let summary = out.result.unwrap();
    let placed = next
        .iter()
        .map(|l| l.iter().map(|t| t.to_vec()).collect())
        .collect();
    assert!(live == tensors(old, r, world), "rank {r}: live changed");
    (placed, summary)
}

/// Whether `placed` holds, in every slot the new placement fills, that slot's expert (an
/// emptied slot keeps its live row).
fn holds_new(placed: &Tensors, new: &[Vec<i64>], r: usize, world: usize) -> bool {
    let want = tensors(new, r, world);
    let n_local = PHYSICAL / world;
    (0..LAYERS).all(|l| {
        (0..ROW_BYTES.len()).all(|t| {
            let rb = ROW_BYTES[t];
            (0..n_local).all(|s| {
                let rows = s * rb..(s + 1) * rb;
                new[l][r * n_local + s] < 0 || placed[l][t][rows.clone()] == want[l][t][rows]
            })
        })
    })
}

/// On every rank: next buffers in ordinary memory, in shared memory on every rank, then on
/// every other rank; all three byte-identical and the new placement, the rows stored into
/// shared memory counted. Returns the summary of the all-shared run.
fn every_way(g: &mut ShmGroup, maps: (&[Vec<i64>], &[Vec<i64>]), batching: bool) -> Summary {
    let (r, world) = (g.rank(), g.size());
    let rows = received_rows(maps.0, maps.1, r, world);
    let case = format!("rank {r} of {world}, batching {batching}");
    let (heap, s0) = place(g, maps, batching, false);
    assert!(
        holds_new(&heap, maps.1, r, world),
        "{case}: ordinary next buffers"
    );
    assert_eq!(s0.rows_into_shared, 0, "{case}");
    let (shared, s1) = place(g, maps, batching, true);
    assert!(shared == heap, "{case}: shared next buffers");
    assert_eq!(s1.rows_into_shared, rows, "{case}");
    let (mixed, s2) = place(g, maps, batching, r % 2 == 0);
    assert!(mixed == heap, "{case}: shared next buffers on even ranks");
    assert_eq!(
        s2.rows_into_shared,
        if r % 2 == 0 { rows } else { 0 },
        "{case}"
    );
    // Apart from the counter, the summaries agree.
    let plain = |s: &Summary| Summary {
        rows_into_shared: 0,
        ..s.clone()
    };
    assert_eq!(plain(&s1), s0, "{case}");
    assert_eq!(plain(&s2), s0, "{case}");
    s1
}

#[test]
fn shared_next_buffers_match_ordinary_ones_on_threads() {
    let mut rng = Rng(0x5DEE_CE66_D1CE_4E5B);
    for world in [2, 4] {
        for batching in [false, true] {
            for _ in 0..2 {
                let (old, new) = rng.maps();
                let name = ranks::unique("e", "sh");
                let moved = ranks::on_threads(world, move |r| {
                    let mut g = ShmGroup::join(&name, r, world, opts()).unwrap();
                    every_way(&mut g, (&old, &new), batching).rows_received
                });
                assert!(moved.iter().sum::<usize>() > 0, "a case that moves rows");
            }
        }
    }
}

/// The shared memory of peers of group `group` this process has mapped: the windows of other
/// ranks, by name (`epcomm.{group}.{session}.w{rank}.{id}.{pid}`; every allocation has an id).
fn peer_windows(group: &str, me: usize) -> std::collections::BTreeSet<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let prefix = format!("/memfd:epcomm.{group}.");
    maps.lines()
        .filter_map(|l| l.split_once(&prefix).map(|(_, rest)| rest.to_owned()))
        .filter(|rest| {
            let owner = rest.split('.').nth(1).and_then(|w| w.strip_prefix('w'));
            owner.is_some_and(|o| o.parse::<usize>().is_ok_and(|o| o != me))
        })
        .collect()
}

#[test]
fn shared_next_buffers_match_ordinary_ones_across_processes() {
    if let Ok(group) = std::env::var("EPCOMM_EPLB_SHARED_CHILD") {
        let rank: usize = std::env::var("EPCOMM_EPLB_RANK").unwrap().parse().unwrap();
        let world: usize = std::env::var("EPCOMM_EPLB_WORLD").unwrap().parse().unwrap();
        let mut g = ShmGroup::join(&group, rank, world, opts()).unwrap();
        let mut rng = Rng(0xC0FF_EE00 + world as u64);
        for batching in [false, true] {
            let (old, new) = rng.maps();
            let (_, s) = place(&mut g, (&old, &new), batching, false);
            let before = peer_windows(&group, rank);
            if !batching {
                assert!(before.is_empty(), "rank {rank}: {before:?}");
            }
            every_way(&mut g, (&old, &new), batching);
            // A rank that sent rows stored them in its peers' new shared next buffers, which it
            // mapped for that.
            let mapped = peer_windows(&group, rank).difference(&before).count();
            assert_eq!(
                mapped > 0,
                s.rows_sent > 0,
                "rank {rank}: {mapped} new peer windows"
            );
        }
        return;
    }
    for world in [2, 4] {
        let group = ranks::unique("e", "shp");
        let kids = ranks::spawn_ranks(
            "shared_next_buffers_match_ordinary_ones_across_processes",
            0..world,
            |r| {
                vec![
                    ("EPCOMM_EPLB_SHARED_CHILD", group.clone()),
                    ("EPCOMM_EPLB_RANK", r.to_string()),
                    ("EPCOMM_EPLB_WORLD", world.to_string()),
                ]
            },
        );
        for k in ranks::wait_all(kids, Duration::from_secs(60)) {
            assert!(k.success(), "rank {} of {world}: {}", k.rank, k.output());
        }
        assert_eq!(ranks::shm_leftovers(&group), Vec::<String>::new());
    }
}

#[test]
fn a_rank_killed_during_a_shared_transfer_leaves_the_same_valid_layers() {
    if let Ok(group) = std::env::var("EPCOMM_EPLB_SHKILL_CHILD") {
        let rank: usize = std::env::var("EPCOMM_EPLB_RANK").unwrap().parse().unwrap();
        let (old, new) = (
            eplb_fixture::modulo_placement(LAYERS, 12, LOGICAL),
            (0..LAYERS)
                .map(|l| (0..12).map(|s| ((s + 2 + l) % LOGICAL) as i64).collect())
                .collect::<Vec<Vec<i64>>>(),
        );
        if rank == 2 {
            assert!(epcomm::fault::set_hook(eplb_fixture::kill_before_layer_1));
        }
        let mut g = ShmGroup::join(&group, rank, 3, opts()).unwrap();
        let live = tensors(&old, rank, 3);
        let total: usize = live.iter().flatten().map(Vec::len).sum();
        let mut window = g.alloc_shared(total).unwrap().unwrap();
        window.fill(GARBAGE);
        let mut c = eplb_fixture::gloo_cpu().unwrap();
        let options = RearrangeOptions {
            next_shared: true,
            ..RearrangeOptions::default()
        };
        let out = {
            let mut next = carve(&mut window, &live);
            rearrange_into(
                &mut g,
                c.as_mut(),
                &old,
                &new,
                &read_only(&live),
                &mut next,
                &ROW_BYTES,
                &options,
            )
        };
        let e = out.result.unwrap_err();
        assert_eq!(out.next_valid, 1, "rank {rank}: {e}");
        assert_eq!(e.status(), Status::PeerFailure, "{e}");
        assert!(e.to_string().contains("rank 2 of group"), "{e}");
        assert!(
            e.to_string().ends_with("(EPLB rearrangement: layers before 1 were rearranged; layer 1 and later keep the old placement)"),
            "{e}"
        );
        assert!(live == tensors(&old, rank, 3), "rank {rank}: live changed");
        let next = carve(&mut window, &live);
        let want = tensors(&new, rank, 3);
        assert!(
            next[0].iter().zip(&want[0]).all(|(n, w)| **n == w[..]),
            "rank {rank}: layer 0's next is not the new placement"
        );
        assert!(
            next[2].iter().flat_map(|t| t.iter()).all(|&b| b == GARBAGE),
            "rank {rank}: layer 2's next was written"
        );
        return;
    }
    let group = ranks::unique("e", "shkill");
    let kids = ranks::spawn_ranks(
        "a_rank_killed_during_a_shared_transfer_leaves_the_same_valid_layers",
        0..3,
        |r| {
            vec![
                ("EPCOMM_EPLB_SHKILL_CHILD", group.clone()),
                ("EPCOMM_EPLB_RANK", r.to_string()),
            ]
        },
    );
    for k in ranks::wait_all(kids, Duration::from_secs(60)) {
        if k.rank != 2 {
            assert!(k.success(), "rank {}: {}", k.rank, k.output());
        }
    }
    assert_eq!(ranks::shm_leftovers(&group), Vec::<String>::new());
}

#[test]
fn bad_shared_next_buffers_fail_every_rank_before_any_data_moves() {
    let (old, new) = Rng(3).maps();
    let name = ranks::unique("e", "shbad");
    let res = ranks::on_threads(2, move |r| {
        let mut g = ShmGroup::join(&name, r, 2, opts()).unwrap();
        let live = tensors(&old, r, 2);
        let total: usize = live.iter().flatten().map(Vec::len).sum();
        let mut window = g.alloc_shared(total).unwrap().unwrap();
        window.fill(GARBAGE);
        let mut next = carve(&mut window, &live);
        if r == 1 {
            // One byte short: refused on this rank, every rank fails.
            let t = std::mem::take(&mut next[1][0]);
            let n = t.len();
            next[1][0] = &mut t[..n - 1];
        }
        let mut c = eplb_fixture::gloo_cpu().unwrap();
        let options = RearrangeOptions {
            next_shared: true,
            ..RearrangeOptions::default()
        };
        let out = rearrange_into(
            &mut g,
            c.as_mut(),
            &old,
            &new,
            &read_only(&live),
            &mut next,
            &ROW_BYTES,
            &options,
        );
        drop(next);
        let untouched = window.iter().all(|&b| b == GARBAGE);
        (
            out.next_valid,
            out.result.unwrap_err().to_string(),
            untouched,
        )
    });
    let short = ROW_BYTES[0] * PHYSICAL / 2;
    assert_eq!(
        res[1].1,
        format!(
            "next_weights layer 1 tensor 0 has {} bytes; expected {short} (the size of live layer 1 tensor 0)",
            short - 1
        )
    );
    assert_eq!(
        res[0].1,
        "rearrange: rank 1 rejected its arguments (see that rank's error) (EPLB rearrangement: no layer was changed)"
    );
    for (r, (valid, _, untouched)) in res.iter().enumerate() {
        assert_eq!(*valid, 0, "rank {r}");
        assert!(untouched, "rank {r}: next buffers written");
    }
}

/// The last error message of this thread's C calls.
fn last_error() -> String {
    let p = epcomm::ffi::error::epcomm_last_error_message();
    if p.is_null() {
        return String::new();
    }
    // SAFETY: a NUL-terminated string the library keeps alive until the next call.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// One uint8 host tensor [rows, row_bytes] at `data`.
fn c_tensor(data: *mut u8, shape: &mut [i64; 2]) -> epcomm::ffi::tensor::epcomm_tensor {
    use epcomm::ffi::tensor::{epcomm_device, epcomm_tensor};
    epcomm_tensor {
        data: data.cast(),
        device: epcomm_device {
            device_type: epcomm::ffi::EPCOMM_DEVICE_CPU,
            device_id: 0,
        },
        ndim: 2,
        dtype: epcomm::ffi::epcomm_dtype {
            code: 1,
            bits: 8,
            lanes: 1,
        },
        shape: shape.as_mut_ptr(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// epcomm_eplb_rearrange_into on rank `r` of the C group `g` through communicator `comm`, one
/// uint8 tensor of `ROW_BYTES[1]`-byte rows per layer, into next tensors at `next` (layer
/// after layer); returns the summary.
///
/// # Safety
/// `g` and `comm` are live handles; `next` holds every layer's next tensor.
unsafe fn c_rearrange_into(
    comm: *mut epcomm::ffi::eplb_runtime::epcomm_eplb_communicator,
    maps: (&[Vec<i64>], &[Vec<i64>]),
    live: &mut [Vec<u8>],
    next: *mut u8,
) -> epcomm::ffi::eplb_runtime::epcomm_eplb_summary {
    let (old, new) = maps;
    let rows = live[0].len() / ROW_BYTES[1];
    let mut shape = [rows as i64, ROW_BYTES[1] as i64];
    let live_t: Vec<_> = live
        .iter_mut()
        .map(|l| c_tensor(l.as_mut_ptr(), &mut shape))
        .collect();
    let next_t: Vec<_> = (0..live.len())
        // SAFETY: within the caller's next buffer.
        .map(|l| c_tensor(unsafe { next.add(l * live[0].len()) }, &mut shape))
        .collect();
    let (o, n) = (old.concat(), new.concat());
    let mut summary = epcomm::ffi::eplb_runtime::epcomm_eplb_summary::default();
    let mut valid = -1i64;
    // SAFETY: every pointer is valid for what it is given with (caller contract).
    let rc = unsafe {
        epcomm::ffi::eplb_runtime::epcomm_eplb_rearrange_into(
            comm,
            o.as_ptr(),
            n.as_ptr(),
            LAYERS as i64,
            PHYSICAL as i64,
            PHYSICAL as i64,
            live_t.as_ptr(),
            next_t.as_ptr(),
            1,
            std::ptr::null(),
            &mut summary,
            &mut valid,
        )
    };
    assert_eq!(rc, 0, "{}", last_error());
    assert_eq!(valid, LAYERS as i64);
    summary
}

/// A C caller's next weights from epcomm_mem_alloc are found to be shared memory: the senders
/// store the rows there (they map the receiver's allocation), byte-identical to next weights
/// in malloc'd memory.
#[test]
fn c_callers_next_weights_from_epcomm_mem_alloc_take_the_shared_path() {
    cmem_run(
        "c_callers_next_weights_from_epcomm_mem_alloc_take_the_shared_path",
        "torch_gloo",
    );
}

/// vLLM 0.34.0's push backend `symm_mem` on host-staged weights: a real communicator in
/// epcomm, whose senders store each row into the receiver's shared next weights; the same
/// bytes as torch_gloo's.
#[test]
fn symm_mem_pushes_into_shared_next_weights() {
    cmem_run("symm_mem_pushes_into_shared_next_weights", "symm_mem");
}

/// The two-process run of the tests above over EPLB communicator `communicator`: `test` is
/// the test that re-runs in the child processes.
fn cmem_run(test: &str, communicator: &str) {
    use epcomm::ffi::eplb_runtime::{
        epcomm_eplb_communicator_create, epcomm_eplb_communicator_destroy,
    };
    use epcomm::ffi::group::{epcomm_group_create_shm, epcomm_group_destroy};
    use epcomm::ffi::mem::epcomm_mem_alloc;
    use epcomm::ffi::select::epcomm_eplb_select_request;
    if let Ok(group) = std::env::var("EPCOMM_EPLB_CMEM_CHILD") {
        let rank: usize = std::env::var("EPCOMM_EPLB_RANK").unwrap().parse().unwrap();
        let cname = std::ffi::CString::new(group.clone()).unwrap();
        let (mut g, mut comm) = (std::ptr::null_mut(), std::ptr::null_mut());
        let name = std::ffi::CString::new(communicator).unwrap();
        let request = epcomm_eplb_select_request {
            struct_size: std::mem::size_of::<epcomm_eplb_select_request>() as u32,
            communicator: name.as_ptr(),
            elastic: false,
            device_type: epcomm::ffi::EPCOMM_DEVICE_CPU,
            weight_dtypes: std::ptr::null(),
            num_weight_dtypes: 0,
            nccl_available: 0,
            nixl_available: 0,
        };
        // SAFETY: valid arguments; the handles are destroyed below.
        unsafe {
            let rc =
                epcomm_group_create_shm(cname.as_ptr(), rank as i32, 2, std::ptr::null(), &mut g);
            assert_eq!(rc, 0, "{}", last_error());
            assert_eq!(
                epcomm_eplb_communicator_create(g, &request, &mut comm),
                0,
                "{}",
                last_error()
            );
        }
        let (old, new) = Rng(41).maps();
        let mut live: Vec<Vec<u8>> = tensors(&old, rank, 2)
            .into_iter()
            .map(|mut l| l.remove(1))
            .collect();
        let total = live.len() * live[0].len();
        let mut heap = vec![GARBAGE; total];
        // SAFETY: live handles, buffers of the layout.
        let s = unsafe { c_rearrange_into(comm, (&old, &new), &mut live, heap.as_mut_ptr()) };
        assert!(peer_windows(&group, rank).is_empty());
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: a live handle; p is freed with the group.
        assert_eq!(
            unsafe { epcomm_mem_alloc(g, total, &mut p) },
            0,
            "{}",
            last_error()
        );
        // SAFETY: `total` bytes from epcomm_mem_alloc.
        let shared = unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), total) };
        shared.fill(GARBAGE);
        // SAFETY: live handles, buffers of the layout.
        let s2 = unsafe { c_rearrange_into(comm, (&old, &new), &mut live, shared.as_mut_ptr()) };
        assert!(shared[..] == heap[..], "rank {rank}: shared next differs");
        assert_eq!(
            (s2.rows_sent, s2.rows_received),
            (s.rows_sent, s.rows_received)
        );
        assert!(
            s.rows_sent > 0 && s.rows_received > 0,
            "a case that moves rows"
        );
        assert!(
            !peer_windows(&group, rank).is_empty(),
            "rank {rank}: no peer memory mapped"
        );
        // SAFETY: live handles, destroyed once.
        unsafe {
            epcomm_eplb_communicator_destroy(comm);
            epcomm_group_destroy(g);
        }
        return;
    }
    let group = ranks::unique("e", "shc");
    let kids = ranks::spawn_ranks(test, 0..2, |r| {
        vec![
            ("EPCOMM_EPLB_CMEM_CHILD", group.clone()),
            ("EPCOMM_EPLB_RANK", r.to_string()),
        ]
    });
    for k in ranks::wait_all(kids, Duration::from_secs(60)) {
        assert!(k.success(), "rank {}: {}", k.rank, k.output());
    }
    assert_eq!(ranks::shm_leftovers(&group), Vec::<String>::new());
}
