//! Agreement before any data moves, the part every transport shares: the parameters all ranks
//! must pass alike (root, dtype, row size, a digest of a size list), and the one wording of a
//! rejection or a disagreement. Each transport gathers every rank's verdict and values its own
//! way (shm: the op header in shared memory; host: one all_gather of a fixed-size header) and
//! then calls [`verdict`], which checks them in the same order on every rank, so every rank
//! reaches the same outcome.

use super::{check_len, check_rank, check_reduce_scatterv, check_sizes, Op, P2p, ReduceScatterv};
use crate::error::{Error, Result};
use crate::num::FloatKind;

/// The most parameters one op agrees on.
pub(crate) const MAX_PARAMS: usize = 5;

/// How a parameter is shown in a disagreement message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Show {
    Number,
    Dtype,
    /// A digest of a list: the message says the lists differ.
    List,
}

/// One parameter every rank must pass alike.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Param {
    pub name: &'static str,
    pub value: u64,
    pub show: Show,
}

pub(crate) fn number(name: &'static str, v: usize) -> Param {
    Param {
        name,
        value: v as u64,
        show: Show::Number,
    }
}

pub(crate) fn dtype(name: &'static str, k: FloatKind) -> Param {
    Param {
        name,
        value: k as u64 + 1,
        show: Show::Dtype,
    }
}

/// A list by its FNV-1a digest (length included).
pub(crate) fn list(name: &'static str, v: &[usize]) -> Param {
    let h = crate::bytes::fnv1a(
        std::iter::once(v.len())
            .chain(v.iter().copied())
            .map(|x| x as u64),
    );
    Param {
        name,
        value: h,
        show: Show::List,
    }
}

fn dtype_name(v: u64) -> &'static str {
    [FloatKind::F32, FloatKind::Bf16, FloatKind::F16]
        .into_iter()
        .find(|k| *k as u64 + 1 == v)
        .map_or("an unknown dtype", FloatKind::name)
}

/// What one op's agreement sees of the ranks: whether rank p rejected its own arguments, and
/// the value rank p passes for parameter i.
pub(crate) struct Seen<'a> {
    pub world: usize,
    pub rejected: &'a dyn Fn(usize) -> bool,
    pub value: &'a dyn Fn(usize, usize) -> u64,
}

/// The verdict of one op, the same on every rank that sees the same values: a peer (other than
/// `me`) rejected its arguments, or the ranks disagree on a parameter (rank 0's value against
/// the first rank passing another).
pub(crate) fn verdict(op: Op, group: &str, me: usize, params: &[Param], seen: &Seen) -> Result<()> {
    let what = op.name();
    if let Some(p) = (0..seen.world).find(|&p| p != me && (seen.rejected)(p)) {
        return Err(Error::InvalidArgument(format!(
            "{what}: rank {p} of group '{group}' rejected its arguments (see that rank's error); no data was exchanged"
        )));
    }
    for (i, param) in params.iter().enumerate() {
        let value = |p: usize| (seen.value)(p, i);
        let v0 = value(0);
        let Some(p) = (1..seen.world).find(|&p| value(p) != v0) else {
            continue;
        };
        let pn = param.name;
        let detail = match param.show {
            Show::Number => format!("rank 0 passes {v0} but rank {p} passes {}", value(p)),
            Show::Dtype => format!(
                "rank 0 passes {} but rank {p} passes {}",
                dtype_name(v0),
                dtype_name(value(p))
            ),
            Show::List => format!("rank 0 and rank {p} pass different lists"),
        };
        return Err(disagree(op, group, pn, &detail));
    }
    Ok(())
}

/// The one wording of a disagreement on `what_differs` (`detail` says how).
pub(crate) fn disagree(op: Op, group: &str, what_differs: &str, detail: &str) -> Error {
    Error::InvalidArgument(format!(
        "{}: ranks of group '{group}' disagree on {what_differs}: {detail}; every rank must pass the same {what_differs} (no data was exchanged)",
        op.name()
    ))
}

/// all_gatherv's checks of this rank's own arguments, and the parameters every rank must pass
/// alike (the same for every transport).
pub(crate) fn all_gatherv_args(
    me: usize,
    world: usize,
    input_len: usize,
    sizes: &[usize],
    output_len: usize,
) -> (Result<()>, [Param; 2]) {
    let op = Op::AllGatherv;
    let local = check_sizes("sizes", op, sizes, world).and_then(|total| {
        check_len("input", op, input_len, sizes[me], &format!("sizes[{me}]"))?;
        check_len("output", op, output_len, total, "sum(sizes)")?;
        Ok(total)
    });
    let params = [
        number("sum(sizes)", *local.as_ref().unwrap_or(&0)),
        list("sizes", sizes),
    ];
    (local.map(drop), params)
}

/// reduce_scatterv's own checks (`Ok((row_bytes, first_row))`) and agreed parameters.
pub(crate) fn reduce_scatterv_args(
    me: usize,
    world: usize,
    r: &ReduceScatterv<'_>,
) -> (Result<(usize, usize)>, [Param; 4]) {
    let local = check_reduce_scatterv(me, world, r);
    let params = [
        dtype("dtype", r.kind),
        number("row_elems", r.row_elems),
        number(
            "sum(rows)",
            r.rows.iter().fold(0usize, |a, &r| a.wrapping_add(r)),
        ),
        list("rows", r.rows),
    ];
    (local, params)
}

/// broadcast's own checks and agreed parameters.
pub(crate) fn broadcast_args(world: usize, root: usize, len: usize) -> (Result<()>, [Param; 2]) {
    let local = check_rank("root", Op::Broadcast, root, world);
    (local, [number("root", root), number("byte count", len)])
}

/// A 64-bit fingerprint of "rank `from` sends `bytes` bytes to rank `to`" (splitmix64 mixes):
/// the sum of every rank's fingerprints of its sends equals that of its receives exactly when
/// every pair agrees, but for a chance of about 2^-64, so all_to_allv's ranks check all
/// pairs with two words each in the op header instead of gathering the size lists.
pub(crate) fn pair_hash(from: usize, to: usize, bytes: usize) -> u64 {
    let mix = |z: u64| {
        let z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    mix(mix(mix(from as u64) ^ to as u64) ^ bytes as u64)
}

/// all_to_allv: every pair checked in the same order on every rank — rank r's
/// `send_sizes[p]` (`sent(r, p)`) against rank p's `recv_sizes[r]` (`expected(p, r)`).
pub(crate) fn check_size_matrix(
    world: usize,
    sent: &dyn Fn(usize, usize) -> u64,
    expected: &dyn Fn(usize, usize) -> u64,
) -> Result<()> {
    for r in 0..world {
        for p in 0..world {
            let (s, e) = (sent(r, p), expected(p, r));
            if s == e {
                continue;
            }
            return Err(Error::InvalidArgument(if r == p {
                format!("all_to_allv: rank {r} sends {s} bytes to itself but expects {e}; no data was exchanged")
            } else {
                format!("all_to_allv: rank {r} sends {s} bytes to rank {p} but recv_sizes[{r}] on rank {p} is {e}; no data was exchanged")
            }));
        }
    }
    Ok(())
}

/// A rank's send_recv batch as words every rank can check: `[sends, receives, (peer, bytes)
/// per send in issue order, (peer, bytes) per receive in issue order]`.
pub(crate) fn p2p_words(ops: &[P2p<'_>]) -> Vec<u64> {
    let pair = |peer: &usize, len: usize| [*peer as u64, len as u64];
    let sends: Vec<u64> = ops
        .iter()
        .flat_map(|o| match o {
            P2p::Send { peer, data } => Some(pair(peer, data.len())),
            P2p::Recv { .. } => None,
        })
        .flatten()
        .collect();
    let recvs: Vec<u64> = ops
        .iter()
        .flat_map(|o| match o {
            P2p::Send { .. } => None,
            P2p::Recv { peer, data } => Some(pair(peer, data.len())),
        })
        .flatten()
        .collect();
    let mut w = vec![(sends.len() / 2) as u64, (recvs.len() / 2) as u64];
    w.extend(sends);
    w.extend(recvs);
    w
}

/// The byte counts of the sends (`sends` true) or receives in [`p2p_words`] `w` that name
/// `peer`, in issue order; `None` when `w` is not well formed.
fn p2p_lens(w: &[u64], sends: bool, peer: usize) -> Option<Vec<u64>> {
    let (ns, nr) = (*w.first()? as usize, *w.get(1)? as usize);
    let all = w.get(2..2 + 2 * (ns.checked_add(nr)?))?;
    let list = if sends {
        &all[..2 * ns]
    } else {
        &all[2 * ns..]
    };
    Some(
        list.chunks_exact(2)
            .filter(|m| m[0] == peer as u64)
            .map(|m| m[1])
            .collect(),
    )
}

/// send_recv: for every ordered pair (a, b), a = b included, in the same order on every rank, the
/// sizes of a's messages to b must be those of b's receives from a (`lists[p]` = rank p's
/// [`p2p_words`]).
pub(crate) fn check_messages(lists: &[Vec<u64>]) -> Result<()> {
    let (all, world) = (lists, lists.len());
    for a in 0..world {
        for b in 0..world {
            let (out, inn) = (p2p_lens(&all[a], true, b), p2p_lens(&all[b], false, a));
            let (Some(out), Some(inn)) = (out, inn) else {
                return Err(Error::Internal(format!(
                    "send_recv: the message list of rank {a} or {b} is malformed"
                )));
            };
            if out != inn {
                return Err(Error::InvalidArgument(format!(
                    "send_recv: rank {a} sends messages of {out:?} bytes to rank {b}, but rank {b} posted receives of {inn:?} bytes; no data was exchanged"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_rejecting_peer_then_the_first_differing_parameter() {
        let params = [number("root", 0), dtype("dtype", FloatKind::F32)];
        let vals = [[0u64, 1], [0, 2], [1, 2]];
        let seen = |rej: &'static [usize]| {
            move |me: usize| {
                let rejected = |p: usize| rej.contains(&p);
                let value = |p: usize, i: usize| vals[p][i];
                let seen = Seen {
                    world: 3,
                    rejected: &rejected,
                    value: &value,
                };
                verdict(Op::Broadcast, "g", me, &params, &seen)
                    .unwrap_err()
                    .to_string()
            }
        };
        assert_eq!(
            seen(&[2])(0),
            "broadcast: rank 2 of group 'g' rejected its arguments (see that rank's error); no data was exchanged"
        );
        assert_eq!(
            seen(&[])(1),
            "broadcast: ranks of group 'g' disagree on root: rank 0 passes 0 but rank 2 passes 1; every rank must pass the same root (no data was exchanged)"
        );
    }
}
