//! Rank mappings the docs call invalid (two old ranks on one new rank, no surviving rank, a new
//! rank nobody takes, a rank beyond the new EP size, a length that does not fit the group and
//! the new placement) are INVALID_ARGUMENT with the same full
//! message on every rank, through the C ABI (epcomm_eplb_rearrange on 3 threads of a C shm
//! group, and epcomm_eplb_lost_experts), for each use of a mapping: a scale-down on the old
//! group (one entry per rank), a scale-up (fewer entries) and a scale-down after a failure
//! (more entries). No weight changes. On 0dfc3b5 `[0, 0, 1]` and `[-1, -1, -1]` returned OK
//! on every rank.

mod ranks;

use std::ffi::{CStr, CString};

use epcomm::ffi::eplb_runtime::{
    epcomm_eplb_communicator_create, epcomm_eplb_communicator_destroy, epcomm_eplb_lost_experts,
    epcomm_eplb_rearrange,
};
use epcomm::ffi::error::epcomm_last_error_message;
use epcomm::ffi::group::{
    epcomm_group_create_shm, epcomm_group_destroy, epcomm_group_options, epcomm_group_options_init,
};
use epcomm::ffi::select::epcomm_eplb_select_request;
use epcomm::ffi::tensor::{epcomm_device, epcomm_tensor};
use epcomm::ffi::{epcomm_dtype, EPCOMM_DEVICE_CPU, EPCOMM_ERROR_INVALID_ARGUMENT};

const WORLD: usize = 3;
const ROW: usize = 8;
/// Slots per rank of the group's placement (the weights' rows).
const N_LOCAL: usize = 2;

const DUPLICATE: &str =
    "rank_mapping[0] and rank_mapping[1] are both 0; every surviving rank needs a rank of its own";

fn last_error() -> String {
    let p = epcomm_last_error_message();
    if p.is_null() {
        return String::new();
    }
    // SAFETY: a NUL-terminated string the library keeps until the next call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// One case: the old and new maps (one layer), the mapping and the error every rank must get.
struct Case {
    old: Vec<i64>,
    new: Vec<i64>,
    mapping: Vec<i64>,
    want: String,
}

fn cases() -> Vec<Case> {
    let none = |n: usize| {
        format!("rank_mapping removes all of its {n} ranks (every entry is -1); expected at least one surviving rank (an entry >= 0)")
    };
    // Scale-down 3 -> 2 on the old group of 3 (vLLM's elastic EP: one entry per rank).
    let down = |mapping: Vec<i64>, want: String| Case {
        old: (0..6).collect(),
        new: vec![0, 1, 2, 3],
        mapping,
        want,
    };
    // Scale-up 2 -> 3 on the grown group.
    let up = |mapping: Vec<i64>, want: String| Case {
        old: vec![0, 1, 2, 3],
        new: vec![0, 1, 2, 3, 0, 1],
        mapping,
        want,
    };
    // After a failure: 4 old ranks, the 3 survivors are the group.
    let after = |mapping: Vec<i64>, want: String| Case {
        old: (0..8).collect(),
        new: vec![0, 1, 2, 3, 4, 5],
        mapping,
        want,
    };
    vec![
        down(vec![0, 0, 1], DUPLICATE.into()),
        down(vec![-1, -1, -1], none(3)),
        down(vec![0, -1, -1], "rank_mapping gives new rank 1 to no surviving rank; expected the new ranks 0 to 1 (the new EP size 2) to be taken by one surviving rank each".into()),
        down(vec![0, 2, 1], "rank_mapping[1] is 2; expected -1 (removed) or a rank below the new EP size 2".into()),
        // Length against the group: one entry per rank is a scale-down, fewer a scale-up to
        // the group's size.
        Case {
            old: (0..6).collect(),
            new: (0..8).collect(),
            mapping: vec![0, 1, 2],
            want: "layer 0: rank_mapping has one entry per rank of the group (3), a scale-down on the old group, but the new placement has 4 ranks of 2 slots; a scale-up runs on the grown group, with one entry per old rank".into(),
        },
        Case {
            old: vec![0, 1, 2, 3],
            new: (0..8).collect(),
            mapping: vec![0, 1],
            want: "layer 0: rank_mapping has 2 entries, fewer than the 3 ranks of the group (a scale-up on the grown group), but the new placement has 4 ranks of 2 slots; expected 3 ranks (6 slots)".into(),
        },
        up(vec![0, 0], DUPLICATE.into()),
        up(vec![-1, -1], none(2)),
        after(vec![0, 0, -1, 1], DUPLICATE.into()),
        after(vec![-1, -1, -1, -1], none(4)),
        after(vec![0, 1, -1, -1], "rank_mapping gives new rank 2 to no surviving rank; expected the new ranks 0 to 2 (the new EP size 3) to be taken by one surviving rank each".into()),
        after(vec![0, 1, -1, 3], "rank_mapping[3] is 3; expected -1 (removed) or a rank below the new EP size 3".into()),
    ]
}

/// epcomm_eplb_rearrange of `case` on rank `r` of a C shm group: (status, message, whether
/// the weights stayed as they were).
fn c_rearrange(group: &str, r: usize, case: &Case) -> (i32, String, bool) {
    let name = CString::new(group).unwrap();
    let gloo = CString::new("torch_gloo").unwrap();
    let request = epcomm_eplb_select_request {
        struct_size: std::mem::size_of::<epcomm_eplb_select_request>() as u32,
        communicator: gloo.as_ptr(),
        elastic: false,
        device_type: EPCOMM_DEVICE_CPU,
        weight_dtypes: std::ptr::null(),
        num_weight_dtypes: 0,
        nccl_available: 0,
        nixl_available: 0,
    };
    let mut opts = std::mem::MaybeUninit::<epcomm_group_options>::zeroed();
    let (mut g, mut comm) = (std::ptr::null_mut(), std::ptr::null_mut());
    let mut weights = vec![r as u8 + 1; N_LOCAL * ROW];
    let before = weights.clone();
    let mut shape = [N_LOCAL as i64, ROW as i64];
    let tensor = epcomm_tensor {
        data: weights.as_mut_ptr().cast(),
        device: epcomm_device {
            device_type: EPCOMM_DEVICE_CPU,
            device_id: 0,
        },
        ndim: 2,
        dtype: epcomm_dtype {
            code: 1,
            bits: 8,
            lanes: 1,
        },
        shape: shape.as_mut_ptr(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    };
    // SAFETY: valid arguments; the handles are destroyed below.
    let rc = unsafe {
        assert_eq!(epcomm_group_options_init(opts.as_mut_ptr()), 0);
        let mut opts = opts.assume_init();
        opts.timeout_s = 20.0;
        let rc = epcomm_group_create_shm(name.as_ptr(), r as i32, WORLD as i32, &opts, &mut g);
        assert_eq!(rc, 0, "{}", last_error());
        let rc = epcomm_eplb_communicator_create(g, &request, &mut comm);
        assert_eq!(rc, 0, "{}", last_error());
        epcomm_eplb_rearrange(
            comm,
            case.old.as_ptr(),
            case.new.as_ptr(),
            1,
            case.old.len() as i64,
            case.new.len() as i64,
            &tensor,
            1,
            case.mapping.as_ptr(),
            case.mapping.len(),
            std::ptr::null_mut(),
        )
    };
    let msg = last_error();
    // SAFETY: live handles, destroyed once.
    unsafe {
        epcomm_eplb_communicator_destroy(comm);
        epcomm_group_destroy(g);
    }
    (rc, msg, weights == before)
}

#[test]
fn invalid_rank_mappings_fail_every_rank_alike_through_the_c_abi() {
    for (i, case) in cases().into_iter().enumerate() {
        let group = ranks::unique("m", "map");
        let case = std::sync::Arc::new(case);
        let c = case.clone();
        let out = ranks::on_threads(WORLD, move |r| c_rearrange(&group, r, &c));
        for (r, (rc, msg, kept)) in out.into_iter().enumerate() {
            assert_eq!(
                (rc, msg.as_str()),
                (EPCOMM_ERROR_INVALID_ARGUMENT, case.want.as_str()),
                "case {i} (mapping {:?}), rank {r}",
                case.mapping
            );
            assert!(kept, "case {i}, rank {r}: the weights changed");
        }
    }
}

/// epcomm_eplb_lost_experts checks a mapping as the rearrangement after a failure does.
#[test]
fn lost_experts_refuses_the_same_mappings_through_the_c_abi() {
    let none = "rank_mapping removes all of its 3 ranks (every entry is -1); expected at least one surviving rank (an entry >= 0)";
    let old: Vec<i64> = (0..6).collect();
    for (mapping, want) in [
        (vec![0, 0, 1], DUPLICATE),
        (vec![-1, -1, -1], none),
        (
            vec![0, 2, -1],
            "rank_mapping[1] is 2; expected -1 (removed) or a rank below the new EP size 2",
        ),
    ] {
        let mut lost = [-7i64; 6];
        let mut n = -7i64;
        // SAFETY: buffers of the sizes given.
        let rc = unsafe {
            epcomm_eplb_lost_experts(
                old.as_ptr(),
                6,
                2,
                mapping.as_ptr(),
                mapping.len(),
                lost.as_mut_ptr(),
                lost.len(),
                &mut n,
            )
        };
        assert_eq!(
            (rc, last_error().as_str()),
            (EPCOMM_ERROR_INVALID_ARGUMENT, want),
            "{mapping:?}"
        );
        assert_eq!((n, lost), (-7, [-7; 6]), "{mapping:?}: outputs untouched");
    }
    // A valid one after a failure: rank 1 died, its experts 2 and 3 are lost.
    let mut lost = [0i64; 6];
    let mut n = 0i64;
    let mapping = [0i64, -1, 1];
    // SAFETY: buffers of the sizes given.
    let rc = unsafe {
        epcomm_eplb_lost_experts(
            old.as_ptr(),
            6,
            2,
            mapping.as_ptr(),
            3,
            lost.as_mut_ptr(),
            6,
            &mut n,
        )
    };
    assert_eq!(
        (rc, n, &lost[..2]),
        (0, 2, &[2i64, 3][..]),
        "{}",
        last_error()
    );
}
