//! epcomm_eplb_schedule_migration_batches with maps decoded from the input, against the Rust
//! scheduler (`epcomm::eplb::migration::schedule_migration_batches`, vLLM v0.33.0's
//! migration_scheduler.py): the same batches and flows read back through the schedule view,
//! or the same status and message. Maps are as long as num_slots says; a leading flag byte
//! swaps a size for a non-positive or oversized one, which must be rejected before the maps
//! are read. No caught panic (EPCOMM_ERROR_INTERNAL), `*out` untouched on failure.
#![no_main]

use std::ffi::CStr;

use epcomm::eplb::migration::schedule_migration_batches;
use epcomm::ffi::eplb_algo::{
    epcomm_eplb_migration_schedule_destroy, epcomm_eplb_migration_schedule_view,
    epcomm_eplb_schedule_migration_batches, epcomm_eplb_schedule_view,
};
use epcomm::ffi::error::epcomm_last_error_message;
use epcomm::ffi::{EPCOMM_ERROR_INTERNAL, EPCOMM_OK};
use libfuzzer_sys::fuzz_target;

/// (src, dst, experts) per flow, per batch, as the view shows them.
fn read_view(v: &epcomm_eplb_schedule_view) -> Vec<Vec<(i64, i64, Vec<i64>)>> {
    let sl = |p: *const i64, n: i64| unsafe { std::slice::from_raw_parts(p, n as usize) };
    let starts = sl(v.batch_starts, v.num_batches + 1);
    let flows = sl(v.flows, 2 * v.num_flows);
    let es = sl(v.expert_starts, v.num_flows + 1);
    let ids = sl(v.expert_ids, v.num_expert_ids);
    starts
        .windows(2)
        .map(|b| {
            (b[0] as usize..b[1] as usize)
                .map(|f| {
                    let e = ids[es[f] as usize..es[f + 1] as usize].to_vec();
                    (flows[2 * f], flows[2 * f + 1], e)
                })
                .collect()
        })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let n = 1 + data[1] as usize % 4;
    let ranks = 1 + data[2] as usize % 70;
    let slots = n * ranks;
    // Ids from the bytes: 255 is -1 (empty), 254 a huge id, else a small expert id.
    let id = |i: usize| match data.get(4 + i).copied().unwrap_or(0) {
        255 => -1,
        254 => i64::MAX,
        x => (x % (1 + data[3] % 64)) as i64,
    };
    let old: Vec<i64> = (0..slots).map(id).collect();
    let new: Vec<i64> = (0..slots).map(|i| id(slots + i)).collect();
    let (mut num_slots, mut per_rank) = (slots as i64, n as i64);
    if data[0] & 0x80 != 0 {
        let bad = [0, -1, i64::MIN, 1 << 41, slots as i64 + 1][data[0] as usize % 5];
        if data[0] & 1 == 0 && bad <= slots as i64 {
            num_slots = bad;
        } else {
            per_rank = bad;
        }
    }
    let sentinel = std::ptr::dangling_mut();
    let mut out = sentinel;
    let rc = unsafe {
        epcomm_eplb_schedule_migration_batches(
            old.as_ptr(),
            new.as_ptr(),
            num_slots,
            per_rank,
            &mut out,
        )
    };
    assert_ne!(rc, EPCOMM_ERROR_INTERNAL, "caught panic");
    if rc != EPCOMM_OK {
        assert_eq!(out, sentinel, "*out written on failure");
        let msg = unsafe { CStr::from_ptr(epcomm_last_error_message()) };
        assert!(!msg.to_bytes().is_empty());
        if num_slots > 0 && num_slots as usize <= slots && per_rank > 0 {
            let p = num_slots as usize;
            let e = schedule_migration_batches(per_rank as usize, &old[..p], &new[..p])
                .expect_err("Rust scheduled what C refused");
            assert_eq!(rc, e.status() as i32);
            assert_eq!(msg.to_str().unwrap(), e.to_string());
        }
        return;
    }
    let want = schedule_migration_batches(n, &old, &new).expect("C scheduled what Rust refused");
    let mut v = std::mem::MaybeUninit::<epcomm_eplb_schedule_view>::zeroed();
    assert_eq!(
        unsafe { epcomm_eplb_migration_schedule_view(out, v.as_mut_ptr()) },
        EPCOMM_OK
    );
    let got = read_view(unsafe { v.assume_init_ref() });
    let want: Vec<Vec<(i64, i64, Vec<i64>)>> = want
        .iter()
        .map(|b| {
            b.iter()
                .map(|f| (f.src_rank as i64, f.dst_rank as i64, f.expert_ids.clone()))
                .collect()
        })
        .collect();
    assert_eq!(got, want);
    unsafe { epcomm_eplb_migration_schedule_destroy(out) };
});
