//! Fault tolerance: the ranks a failure lost, and shrinking (the survivors form a smaller group,
//! as `ncclCommShrink` or MPI ULFM's `MPI_Comm_shrink`).
//!
//! The survivors meet through the normal join path (timeouts, liveness, identity, no
//! leftovers) under a name derived from the old group's name, its session (random, made by its
//! rank 0 and shared by every member) and the excluded ranks, so survivors with the same view
//! meet and survivors with different views do not (they time out). Once formed, the new group
//! gathers every member's view (old session, world, rank and excluded set) and fails on every
//! member, naming both views, unless all agree: a mixed group never serves.

use super::join::MAX_WORLD;
use super::wait::list;
use super::ShmGroup;
use crate::bytes;
use crate::error::{Error, Result};
use crate::group::Group;

/// Characters of the old name a derived name keeps: with '.' and 16 hex digits it stays within
/// the 64 characters of a group name, however often a group shrinks.
const NAME_PREFIX: usize = 64 - 17;
/// Words of a member's view: tag, old-name hash, session, world, old rank, excluded bit mask.
const VIEW_WORDS: usize = 5 + MAX_WORLD / 64;
/// High bits of a view's first word ("shrk").
const VIEW_TAG: u64 = 0x7368_726b << 32;

/// FNV-1a over `data`, continuing from `h`.
fn fnv(h: u64, data: &[u8]) -> u64 {
    data.iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// The name the survivors of group `name` (session `session`, `world` ranks) meet under when
/// they exclude `excluded`: a pure function of the four, at most 64 characters.
pub(crate) fn shrunk_name(name: &str, session: u64, world: usize, excluded: &[usize]) -> String {
    let mut h = fnv(FNV_START, b"epcomm-shrink1\0");
    h = fnv(h, name.as_bytes());
    h = fnv(h, &[0]);
    h = fnv(h, &session.to_le_bytes());
    h = fnv(h, &(world as u64).to_le_bytes());
    for &r in excluded {
        h = fnv(h, &(r as u64).to_le_bytes());
    }
    let cut = name.len().min(NAME_PREFIX);
    format!("{}.{h:016x}", &name[..cut])
}

/// Checks an excluded list for `rank` of group `name` of `world` ranks.
pub(crate) fn check_excluded(name: &str, rank: usize, world: usize, ex: &[usize]) -> Result<()> {
    if let Some(i) = ex.iter().position(|&r| r >= world) {
        return Err(Error::InvalidArgument(format!(
            "shrink: excluded[{i}] is {}; expected a rank of group '{name}' (0..{world})",
            ex[i]
        )));
    }
    if ex.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::InvalidArgument(format!(
            "shrink: excluded is [{}]; expected distinct ranks in increasing order",
            list(ex)
        )));
    }
    if ex.contains(&rank) {
        return Err(Error::InvalidArgument(format!(
            "shrink: excluded [{}] holds rank {rank}, the calling rank of group '{name}'; only the survivors call shrink",
            list(ex)
        )));
    }
    Ok(())
}

/// One member's view of a shrink, as the new group gathers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ShrinkView {
    /// The old group's name (its hash travels; the name labels messages).
    pub(crate) name: String,
    /// What tells the old group from another of the same name (shm: its session).
    pub(crate) session: u64,
    pub(crate) world: usize,
    pub(crate) rank: usize,
    pub(crate) excluded: Vec<usize>,
}

impl ShrinkView {
    fn encode(&self) -> [u64; VIEW_WORDS] {
        let mut w = [0u64; VIEW_WORDS];
        w[0] = VIEW_TAG | 1;
        w[1] = fnv(FNV_START, self.name.as_bytes());
        w[2] = self.session;
        w[3] = self.world as u64;
        w[4] = self.rank as u64;
        for &r in self.excluded.iter().filter(|&&r| r < MAX_WORLD) {
            w[5 + r / 64] |= 1 << (r % 64);
        }
        w
    }

    /// The old rank of new rank `p` in this view.
    fn survivor(&self, p: usize) -> Option<usize> {
        (0..self.world)
            .filter(|r| !self.excluded.contains(r))
            .nth(p)
    }

    /// How rank `p`'s gathered words `w` describe its view, for messages.
    fn describe(&self, p: usize, w: &[u64]) -> String {
        let (world, excluded) = (w[3] as usize, decode_mask(&w[5..]));
        let same_group = w[1] == fnv(FNV_START, self.name.as_bytes()) && w[2] == self.session;
        let group = if same_group {
            format!("'{}'", self.name)
        } else {
            format!("another group (session {:016x})", w[2])
        };
        format!(
            "new rank {p} (rank {} of {group} of {world} ranks) excludes [{}]",
            w[4],
            list(&excluded)
        )
    }
}

fn decode_mask(words: &[u64]) -> Vec<usize> {
    (0..words.len() * 64)
        .filter(|&r| words[r / 64] >> (r % 64) & 1 == 1)
        .collect()
}

/// Gathers every member's view over the new group `g` and checks that all equal rank 0's: the
/// same error on every member (INVALID_STATE naming both views) where one differs.
pub(crate) fn verify_views(g: &mut dyn Group, mine: &ShrinkView) -> Result<()> {
    let words = mine.encode();
    let mut all = vec![0u8; VIEW_WORDS * 8 * g.size()];
    g.all_gather(bytes::as_bytes(&words), &mut all)?;
    let all: Vec<u64> = bytes::to_vec(&all);
    let view = |p: usize| &all[p * VIEW_WORDS..(p + 1) * VIEW_WORDS];
    let first = view(0);
    let base = ShrinkView {
        session: first[2],
        world: first[3] as usize,
        rank: first[4] as usize,
        excluded: decode_mask(&first[5..]),
        ..mine.clone()
    };
    let fits = |p: usize| {
        let w = view(p);
        w[..4] == first[..4] && w[5..] == first[5..] && base.survivor(p) == Some(w[4] as usize)
    };
    match (0..g.size()).find(|&p| !fits(p)) {
        None => Ok(()),
        Some(p) => Err(Error::InvalidState(format!(
            "shrink: the members of the shrunk group '{}' do not agree on the shrink of group '{}': {}, but {}; every survivor must pass the same excluded list (the shrunk group is discarded)",
            g.name(),
            mine.name,
            base.describe(0, first),
            base.describe(p, view(p))
        ))),
    }
}

impl ShmGroup {
    /// The survivors of this group without `excluded` (see [`Group::shrink`]): a new group
    /// under a derived name, this rank renumbered among the survivors, with the same options.
    pub fn shrunk(&self, excluded: &[usize]) -> Result<ShmGroup> {
        check_excluded(&self.name, self.rank, self.world, excluded)?;
        self.check_not_masked()?;
        let name = shrunk_name(&self.name, self.session, self.world, excluded);
        let rank = self.rank - excluded.iter().filter(|&&r| r < self.rank).count();
        let world = self.world - excluded.len();
        let mut g = ShmGroup::join(&name, rank, world, self.opts.clone())?;
        let view = ShrinkView {
            name: self.name.clone(),
            session: self.session,
            world: self.world,
            rank: self.rank,
            excluded: excluded.to_vec(),
        };
        verify_views(&mut g, &view)?;
        Ok(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::GroupOptions;

    /// Derived names are pure, distinct per view and within 64 characters however often a
    /// group shrinks.
    #[test]
    fn derived_names_fit_and_differ() {
        let a = shrunk_name("g", 7, 4, &[3]);
        assert_eq!(a, shrunk_name("g", 7, 4, &[3]));
        assert!(a.starts_with("g.") && a.len() == 2 + 16, "{a}");
        assert_ne!(a, shrunk_name("g", 8, 4, &[3]));
        assert_ne!(a, shrunk_name("g", 7, 4, &[2]));
        assert_ne!(a, shrunk_name("g", 7, 4, &[2, 3]));
        let mut n = "x".repeat(64);
        for i in 0..5 {
            n = shrunk_name(&n, i, 8 - i as usize, &[0]);
            assert_eq!(n.len(), 64, "{n}");
            super::super::rendezvous::check_name(&n).unwrap();
        }
    }

    #[test]
    fn excluded_lists_are_checked() {
        let e = |ex: &[usize]| check_excluded("g", 1, 4, ex).unwrap_err().to_string();
        assert_eq!(
            e(&[4]),
            "shrink: excluded[0] is 4; expected a rank of group 'g' (0..4)"
        );
        assert_eq!(
            e(&[3, 2]),
            "shrink: excluded is [3, 2]; expected distinct ranks in increasing order"
        );
        assert_eq!(
            e(&[2, 2]),
            "shrink: excluded is [2, 2]; expected distinct ranks in increasing order"
        );
        assert_eq!(
            e(&[0, 1]),
            "shrink: excluded [0, 1] holds rank 1, the calling rank of group 'g'; only the survivors call shrink"
        );
        assert!(check_excluded("g", 1, 4, &[]).is_ok());
        assert!(check_excluded("g", 1, 4, &[0, 2, 3]).is_ok());
    }

    /// Members that meet under one name with different views (only a forged or colliding name
    /// can do that) fail on every member, naming both views.
    #[test]
    fn members_with_different_views_fail_alike() {
        let name = format!("unit-shrink-views-{}", std::process::id());
        let opts = GroupOptions {
            timeout: std::time::Duration::from_secs(5),
            ..GroupOptions::default()
        };
        let run = |new: usize, old: usize, excluded: Vec<usize>| {
            let (name, opts) = (name.clone(), opts.clone());
            std::thread::spawn(move || {
                let mut g = ShmGroup::join(&name, new, 2, opts).unwrap();
                let view = ShrinkView {
                    name: "old".into(),
                    session: 42,
                    world: 3,
                    rank: old,
                    excluded,
                };
                verify_views(&mut g, &view).map_err(|e| e.to_string())
            })
        };
        let a = run(0, 0, vec![2]);
        let b = run(1, 2, vec![1]);
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        let want = format!("shrink: the members of the shrunk group '{name}' do not agree on the shrink of group 'old': new rank 0 (rank 0 of 'old' of 3 ranks) excludes [2], but new rank 1 (rank 2 of 'old' of 3 ranks) excludes [1]; every survivor must pass the same excluded list (the shrunk group is discarded)");
        assert_eq!(a, Err(want.clone()));
        assert_eq!(b, Err(want));
    }
}
