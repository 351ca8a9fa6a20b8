//! Group identity: two jobs that use one group name at the same time never form a mixed group.
//! Each run starts two 2-rank jobs (four child processes, this test binary run again as
//! `identity_rank`, in a random order, back to back) under one name; every rank that creates
//! its group exchanges its job's id through it. Every outcome must be: a job whose ranks all
//! succeed and see only their own job's id, or ranks that fail with an error saying the name is
//! in use by another job (or, for a rank whose rank 0 was refused, that no rank 0 came).
//! Segments of another user, or with a mode wider than 0600, are refused.
//!
//! `EPCOMM_IDENTITY_RUNS` (default 30) sets the number of runs.

mod ranks;

use std::time::Duration;

use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};
use epcomm::Status;
use ranks::{shm_leftovers, wait_all, Finished};

const CHILD_TEST: &str = "identity_rank";

/// Child side: joins rank EPCOMM_ID_RANK of a 2-rank group and gathers the job ids.
#[test]
fn identity_rank() {
    let Ok(group) = std::env::var("EPCOMM_ID_GROUP") else {
        return;
    };
    let rank: usize = std::env::var("EPCOMM_ID_RANK").unwrap().parse().unwrap();
    let job = std::env::var("EPCOMM_ID_JOB").unwrap();
    // One second: a clash's rank 0 keeps its record one timeout before it gives up (the
    // name is then free), and each of the 30 runs waits for that.
    let opts = GroupOptions {
        timeout: Duration::from_secs(1),
        ..GroupOptions::default()
    };
    let result = ShmGroup::join(&group, rank, 2, opts).and_then(|mut g| {
        let mut ids = [0u8; 2];
        g.all_gatherv(job.as_bytes(), &[1, 1], &mut ids)?;
        g.barrier()?;
        Ok(String::from_utf8_lossy(&ids).into_owned())
    });
    match result {
        Ok(ids) => println!("\nID_RESULT ok {ids}"),
        Err(e) => println!("\nID_RESULT err {} {e}", e.status() as i32),
    }
}

fn result_line(f: &Finished) -> String {
    f.stdout
        .lines()
        .find_map(|l| l.strip_prefix("ID_RESULT "))
        .unwrap_or("<none>")
        .to_owned()
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn two_jobs_with_one_name_never_form_a_mixed_group() {
    let runs: usize = std::env::var("EPCOMM_IDENTITY_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let (mut both_ok, mut one_ok, mut none_ok) = (0, 0, 0);
    for run in 0..runs {
        let group = ranks::unique("id", "jobs");
        // (job, rank) in a random order.
        let mut order = [('A', 0usize), ('A', 1), ('B', 0), ('B', 1)];
        for i in (1..order.len()).rev() {
            order.swap(i, (xorshift(&mut rng) % (i as u64 + 1)) as usize);
        }
        let children: Vec<(usize, std::process::Child)> = order
            .iter()
            .enumerate()
            .map(|(i, &(job, rank))| {
                let env = [
                    ("EPCOMM_ID_GROUP", group.clone()),
                    ("EPCOMM_ID_RANK", rank.to_string()),
                    ("EPCOMM_ID_JOB", job.to_string()),
                ];
                (i, ranks::spawn_test(CHILD_TEST, &env))
            })
            .collect();
        let results = wait_all(children, Duration::from_secs(20));
        let lines: Vec<String> = results
            .iter()
            .map(|r| {
                let (job, rank) = order[r.rank];
                format!("job {job} rank {rank}: {}", result_line(r))
            })
            .collect();
        let mut ok_jobs = 0;
        for job in ['A', 'B'] {
            let mine: Vec<(usize, String)> = results
                .iter()
                .filter(|r| order[r.rank].0 == job)
                .map(|r| (order[r.rank].1, result_line(r)))
                .collect();
            let oks = mine.iter().filter(|(_, l)| l.starts_with("ok ")).count();
            for (rank, l) in &mine {
                if let Some(ids) = l.strip_prefix("ok ") {
                    assert_eq!(
                        ids,
                        format!("{job}{job}"),
                        "run {run}: a mixed group: job {job} rank {rank} saw job ids {ids}:\n{}",
                        lines.join("\n")
                    );
                } else {
                    let known = [
                        "is in use by another job",
                        "waiting for rank 0 to create group",
                    ];
                    assert!(
                        known.iter().any(|k| l.contains(k)),
                        "run {run}: job {job} rank {rank} failed otherwise:\n{}",
                        lines.join("\n")
                    );
                }
            }
            assert!(
                oks == 0 || oks == 2,
                "run {run}: job {job} half succeeded:\n{}",
                lines.join("\n")
            );
            if oks == 2 {
                ok_jobs += 1;
            }
        }
        match ok_jobs {
            2 => both_ok += 1,
            1 => one_ok += 1,
            _ => none_ok += 1,
        }
        let left = shm_leftovers(&group);
        assert!(left.is_empty(), "run {run}: left {left:?}");
    }
    eprintln!(
        "shm_identity: {runs} runs of two jobs on one name: both jobs ok {both_ok}, one job ok {one_ok}, neither {none_ok}, mixed groups 0"
    );
}

/// A rendezvous record owned by the caller but readable by others (mode 0644) is refused,
/// naming the mode; rank 0 does not replace it and no rank joins through it.
#[test]
fn a_record_with_a_wide_mode_is_refused() {
    let group = ranks::unique("id", "mode");
    let path = format!("/dev/shm/epcomm.{group}");
    std::fs::write(&path, [0u8; 64]).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let opts = GroupOptions {
        timeout: Duration::from_secs(1),
        ..GroupOptions::default()
    };
    for rank in [0, 1] {
        let e = ShmGroup::join(&group, rank, 2, opts.clone()).unwrap_err();
        assert_eq!(e.status(), Status::InvalidState, "{e}");
        assert_eq!(
            e.to_string(),
            format!("group name '{group}' is in use by another job or user, refused: {path} has mode 0644, wider than the expected 0600")
        );
    }
    std::fs::remove_file(&path).unwrap();
}

/// Unique group ids (as `ncclGetUniqueId`): two groups made from two ids at the same time, with
/// the same ranks, never meet; each id is new; an id that was not made by `UniqueId::new` is
/// refused, naming what was expected.
#[test]
fn groups_from_unique_ids_never_meet() {
    use epcomm::group::shm::UniqueId;
    let ids = [UniqueId::new().unwrap(), UniqueId::new().unwrap()];
    assert_ne!(ids[0], ids[1]);
    let results = ranks::on_threads(4, move |t| {
        let (job, rank) = (t / 2, t % 2);
        let mut g = ShmGroup::join_unique(&ids[job], rank, 2, GroupOptions::default()).unwrap();
        let mut seen = [0u8; 2];
        g.all_gatherv(&[b'A' + job as u8], &[1, 1], &mut seen)
            .unwrap();
        (job, seen)
    });
    for (job, seen) in results {
        let own = b'A' + job as u8;
        assert_eq!(seen, [own, own], "job {job} saw {seen:?}");
    }
    let mut bad = UniqueId::new().unwrap();
    bad.0[0] = b'x';
    let e = ShmGroup::join_unique(&bad, 0, 1, GroupOptions::default()).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert_eq!(
        e.to_string(),
        "unique group id is not one made by UniqueId::new / epcomm_group_unique_id: it starts with \"xpcomm-uid1:\"; expected \"epcomm-uid1:\", 32 lowercase hex digits and zero bytes"
    );
}

/// The C ABI of unique ids: rank 0 makes one, the other rank receives it by the host's means (a
/// channel here), both create from it and exchange data; NULL and zeroed ids are errors.
#[test]
fn unique_ids_through_the_c_abi() {
    use epcomm::ffi::error::epcomm_last_error_message;
    use epcomm::ffi::group::{
        epcomm_group, epcomm_group_all_gather, epcomm_group_create_shm_unique,
        epcomm_group_destroy, epcomm_group_unique_id, epcomm_unique_id, EPCOMM_UNIQUE_ID_BYTES,
    };
    let last_error = || {
        // SAFETY: a NUL-terminated string owned by this thread, copied at once.
        unsafe { std::ffi::CStr::from_ptr(epcomm_last_error_message()) }
            .to_string_lossy()
            .into_owned()
    };
    let (tx, rx) = std::sync::mpsc::channel::<epcomm_unique_id>();
    let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
    let results = ranks::on_threads(2, move |rank| {
        let id = if rank == 0 {
            let mut id = epcomm_unique_id {
                internal: [0; EPCOMM_UNIQUE_ID_BYTES],
            };
            // SAFETY: `id` is writable.
            assert_eq!(unsafe { epcomm_group_unique_id(&mut id) }, 0);
            tx.send(id).unwrap();
            id
        } else {
            rx.lock().unwrap().recv().unwrap()
        };
        let mut g: *mut epcomm_group = std::ptr::null_mut();
        // SAFETY: a valid id and out pointer; NULL options are the defaults.
        let rc = unsafe {
            epcomm_group_create_shm_unique(&id, rank as i32, 2, std::ptr::null(), &mut g)
        };
        assert_eq!(rc, 0, "{}", last_error());
        let input = [b'a' + rank as u8; 4];
        let mut out = [0u8; 8];
        // SAFETY: the handle is live and the buffers have the sizes passed.
        let rc = unsafe {
            epcomm_group_all_gather(g, input.as_ptr().cast(), 4, out.as_mut_ptr().cast())
        };
        // SAFETY: the handle is live.
        unsafe { epcomm_group_destroy(g) };
        (rc, out)
    });
    for (rank, (rc, out)) in results.into_iter().enumerate() {
        assert_eq!((rc, &out), (0, b"aaaabbbb"), "rank {rank}");
    }

    let mut g: *mut epcomm_group = std::ptr::null_mut();
    // SAFETY: NULL id, valid out pointer.
    let rc =
        unsafe { epcomm_group_create_shm_unique(std::ptr::null(), 0, 1, std::ptr::null(), &mut g) };
    assert_eq!(
        (rc, last_error().as_str()),
        (Status::NullPointer as i32, "argument 'id' must not be NULL")
    );
    // SAFETY: NULL out pointer.
    let rc = unsafe { epcomm_group_unique_id(std::ptr::null_mut()) };
    assert_eq!(
        (rc, last_error().as_str()),
        (
            Status::NullPointer as i32,
            "argument 'out' must not be NULL"
        )
    );
    let zero = epcomm_unique_id {
        internal: [0; EPCOMM_UNIQUE_ID_BYTES],
    };
    // SAFETY: a readable id and a valid out pointer.
    let rc = unsafe { epcomm_group_create_shm_unique(&zero, 0, 1, std::ptr::null(), &mut g) };
    assert_eq!(rc, Status::InvalidArgument as i32);
    assert_eq!(
        last_error(),
        "unique group id is not one made by UniqueId::new / epcomm_group_unique_id: it starts with \"\\0\\0\\0\\0\\0\\0\\0\\0\\0\\0\\0\\0\"; expected \"epcomm-uid1:\", 32 lowercase hex digits and zero bytes"
    );
    assert!(g.is_null(), "no handle on failure");
}
