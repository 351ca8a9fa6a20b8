//! After a failure, the survivors' group of a group: formed once ([`Group::shrink`] of the
//! ranks the group holds as lost), kept by the group itself ([`Group::survivors_slot`]), so
//! every user of the group — each MoE layer's fault-tolerant manager — continues over the same
//! survivors' group instead of forming its own. A failure of the survivors' group leads, the
//! same way, to its own survivors' group: a chain, walked by [`current`].

use super::Group;
use crate::error::{Error, Result};

/// A group's survivors' group and the ranks (of that group) it left out.
pub struct Survivors {
    excluded: Vec<usize>,
    group: Box<dyn Group>,
}

impl std::fmt::Debug for Survivors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Survivors")
            .field("excluded", &self.excluded)
            .field("group", &self.group.name())
            .finish()
    }
}

/// The group to use now and the mask of `g`'s ranks it leaves out (true = masked): `g` itself
/// while it holds no rank as lost; else its survivors' group (formed on first use: collective
/// over the survivors, which agree on the ranks left out ([`Group::shrink_lost`]); a failed
/// shrink fails the call and the next call tries again), and so on down the chain.
pub fn current(g: &mut dyn Group) -> Result<(Vec<bool>, &mut dyn Group)> {
    let world = g.size();
    let formed = g.survivors_slot().is_some_and(|s| s.is_some());
    if !formed {
        let Some((lost, group)) = g.shrink_lost()? else {
            return Ok((vec![false; world], g));
        };
        let slot = g.survivors_slot().ok_or_else(|| {
            Error::NotImplemented(format!(
                "group '{}' cannot keep a survivors' group",
                group.name()
            ))
        })?;
        *slot = Some(Survivors {
            excluded: lost,
            group,
        });
    }
    let Some(Some(s)) = g.survivors_slot() else {
        return Err(Error::Internal("the survivors' group went missing".into()));
    };
    let mut mask = vec![false; world];
    s.excluded.iter().for_each(|&r| mask[r] = true);
    let live: Vec<usize> = (0..world).filter(|&r| !mask[r]).collect();
    let (inner_mask, cur) = current(s.group.as_mut())?;
    for (i, m) in inner_mask.into_iter().enumerate() {
        if m {
            mask[live[i]] = true;
        }
    }
    Ok((mask, cur))
}
