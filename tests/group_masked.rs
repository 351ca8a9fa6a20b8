//! `group::masked::MaskedGroup`: the survivors' group under the original rank numbering. Rank 1
//! of 3 is masked; the two survivors' group (ranks 0 and 2, renumbered 0 and 1) carries the
//! collectives: lists keep the original indices, a masked rank's entries must be empty, equal
//! gathers show it as zeros, and a list that names it fails on the rank that passed it and, at
//! once, on its peer (no waiting for a rank that is not there).

mod ranks;

use std::time::Duration;

use epcomm::group::masked::MaskedGroup;
use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions, RowExchange};
use epcomm::Status;

const MASK: [bool; 3] = [false, true, false];
/// The original rank of each survivor.
const SURVIVORS: [usize; 2] = [0, 2];

fn on_survivors<T: Send + 'static>(
    tag: &str,
    f: impl Fn(&mut MaskedGroup<'_>) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let name = ranks::unique("gm", tag);
    ranks::on_threads(2, move |r| {
        let opts = GroupOptions {
            timeout: Duration::from_secs(20),
            ..GroupOptions::default()
        };
        let mut inner = ShmGroup::join(&name, r, 2, opts).unwrap();
        let mut g = MaskedGroup::new(&mut inner, SURVIVORS[r], &MASK).unwrap();
        f(&mut g)
    })
}

#[test]
fn collectives_keep_the_original_numbering() {
    let out = on_survivors("coll", |g| {
        let me = g.rank() as u8;
        assert_eq!((g.size(), g.mask()), (3, MASK.to_vec()));
        let mut all = vec![0u8; 5];
        g.all_gatherv(&vec![me; if me == 0 { 2 } else { 3 }], &[2, 0, 3], &mut all)
            .unwrap();
        let mut eq = vec![9u8; 3];
        g.all_gather(&[me + 10], &mut eq).unwrap();
        let mut dst = vec![0u8; 4 * 2];
        let src: Vec<u8> = (0..8).map(|i| me * 16 + i).collect();
        let (give, take) = if me == 0 {
            (
                vec![vec![0], vec![], vec![1]],
                vec![vec![1], vec![], vec![0]],
            )
        } else {
            (
                vec![vec![1], vec![], vec![0]],
                vec![vec![0], vec![], vec![1]],
            )
        };
        g.exchange_rows(RowExchange {
            src: &src,
            row_bytes: 4,
            give: &give,
            dst: &mut dst,
            take: &take,
        })
        .unwrap();
        (all, eq, dst)
    });
    for (r, (all, eq, dst)) in out.iter().enumerate() {
        assert_eq!(all, &[0, 0, 2, 2, 2], "survivor {r}");
        assert_eq!(
            eq,
            &[10, 0, 12],
            "survivor {r}: the masked rank's entry is zero"
        );
        let (own, peer) = if r == 0 { (0u8, 2u8) } else { (2, 0) };
        let row = |who: u8, i: u8| (0..4).map(|j| who * 16 + i * 4 + j).collect::<Vec<u8>>();
        // Slot 0: the peer's row 1; slot 1: this rank's own row 0.
        let want = [row(peer, 1), row(own, 0)];
        assert_eq!(dst, &want.concat(), "survivor {r}");
    }
}

#[test]
fn a_list_naming_the_masked_rank_fails_both_survivors_at_once() {
    let out = on_survivors("bad", |g| {
        let me = g.rank();
        // Survivor 0 (original rank 0) passes bytes for the masked rank 1.
        let sizes = if me == 0 { [1, 1, 1] } else { [1, 0, 1] };
        let mut all = vec![0u8; sizes.iter().sum()];
        let e = g.all_gatherv(&[1], &sizes, &mut all).unwrap_err();
        (e.status(), e.to_string())
    });
    assert_eq!(out[0].0, Status::InvalidArgument);
    assert!(
        out[0]
            .1
            .starts_with("all_gatherv: sizes[1] is not empty, but rank 1 of group '")
            && out[0]
                .1
                .ends_with("' is masked (it failed earlier); expected nothing for it"),
        "{}",
        out[0].1
    );
    assert_eq!(out[1].0, Status::InvalidArgument);
    assert!(
        out[1].1.starts_with("all_gatherv: rank 0 of group '") && out[1].1.contains("rejected"),
        "{}",
        out[1].1
    );
}
