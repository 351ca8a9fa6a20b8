//! epcomm_eplb_rebalance and epcomm_eplb_logical_maps with shapes and loads decoded from the
//! input. Shapes are small (every buffer is as large as the shape says); a leading flag byte
//! swaps one size for a non-positive or overflowing value, which the checks must reject before
//! touching any buffer. On success: every physical slot maps to a logical expert, every logical
//! expert has a replica, and the logical maps agree.
#![no_main]

use epcomm::ffi::eplb::{epcomm_eplb_logical_maps, epcomm_eplb_rebalance};
use epcomm::ffi::{EPCOMM_ERROR_INTERNAL, EPCOMM_OK};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let b = |i: usize| data[i] as i64;
    let l = 1 + b(1) % 3;
    let r = 1 + b(2) % 8;
    let n = 1 + b(3) % 4;
    let g = 1 + b(4) % 8;
    let e = 1 + b(5) % 32;
    let p = 1 + b(6) % 48;
    let mut dims = [l, e, p, g, n, r];
    let mut weight_len = (l * e) as usize;
    let mut out_len = (l * p) as usize;
    if data[0] & 0x80 != 0 {
        // Invalid sizes: non-positive, or products beyond the 2^40 limit.
        let bad = [0, -1, i64::MIN, i64::MAX, 1 << 41][b(7) as usize % 5];
        let k = (data[0] & 0x7f) as usize % 6;
        if bad > 0 && k > 2 {
            return; // only L, E and P take part in the size products
        }
        dims[k] = bad;
        weight_len = 1;
        out_len = 1;
    }
    let weight: Vec<f32> = (0..weight_len)
        .map(|i| {
            let x = data.get(8 + i).copied().unwrap_or(1);
            match x {
                255 => f32::NAN,
                254 => f32::INFINITY,
                253 => -1.0,
                _ => x as f32,
            }
        })
        .collect();
    let old: Option<Vec<i64>> = (data[7] & 1 == 1 && data[0] & 0x80 == 0)
        .then(|| (0..out_len).map(|i| (i as i64 * 7 + b(7)) % e).collect());
    let mut out = vec![-77i64; out_len];
    let [l, e, p, g, n, r] = dims;
    let rc = unsafe {
        epcomm_eplb_rebalance(
            weight.as_ptr(),
            l,
            e,
            p,
            g,
            n,
            r,
            old.as_ref().map_or(std::ptr::null(), |o| o.as_ptr()),
            out.as_mut_ptr(),
        )
    };
    assert_ne!(rc, EPCOMM_ERROR_INTERNAL);
    if rc != EPCOMM_OK {
        assert!(
            out.iter().all(|&x| x == -77),
            "output written by a failing call"
        );
        return;
    }
    for layer in out.chunks(p as usize) {
        assert!(layer.iter().all(|&x| (0..e).contains(&x)), "{layer:?}");
        assert!(
            (0..e).all(|x| layer.contains(&x)),
            "an expert without replica: {layer:?}"
        );
    }
    let (el, w) = ((l * e) as usize, p as usize);
    let mut cnt = vec![0i64; el];
    let mut map = vec![0i64; el * w];
    let rc = unsafe {
        epcomm_eplb_logical_maps(out.as_ptr(), l, p, e, p, cnt.as_mut_ptr(), map.as_mut_ptr())
    };
    assert_eq!(rc, EPCOMM_OK);
    for (li, layer) in out.chunks(p as usize).enumerate() {
        for x in 0..e as usize {
            let c = cnt[li * e as usize + x];
            assert_eq!(c, layer.iter().filter(|&&v| v == x as i64).count() as i64);
            let slots = &map[(li * e as usize + x) * w..][..w];
            for (k, &s) in slots.iter().enumerate() {
                if (k as i64) < c {
                    assert_eq!(layer[s as usize], x as i64);
                } else {
                    assert_eq!(s, -1);
                }
            }
        }
    }
});
