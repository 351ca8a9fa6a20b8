//! Rearrangement: moving expert weights from the old placement to the new one, layer by layer,
//! through an EPLB communicator. Receives and local copies land in a staging buffer; a layer's
//! live weights change only after all of its transfers succeeded, so a failed or interrupted
//! transfer leaves that layer (and every later one) exactly as it was.
//!
//! Double-buffered ([`rearrange_into`]): the live weights are only read and the new placement
//! is written straight into caller-provided next buffers, each byte once (no staging); the
//! commit is the swap, which the caller makes for the layers the call reports valid.
//!
//! A layer's transfers run in one communicator execute, or, with migration batching (vLLM
//! v0.33.0's `enable_migration_batching` under async EPLB), in one execute per batch of vLLM's
//! migration scheduler ([`super::migration`]): each rank talks to at most one peer per execute.
//! Both paths send the same rows from the same sources; only the order and grouping differ.

use std::collections::HashMap;

use super::communicator::EplbCommunicator;
use super::migration::{schedule_migration_batches, Batches};
use super::transfer::{
    apply_rank_mapping, plan_layer, survivors_placement, unsourced_experts, LayerPlan,
};
use crate::copy::{copy_streaming, streaming_fence};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::RowExchange;
use crate::group::{Group, P2p};

/// One layer's expert weights on this rank: one byte buffer per weight tensor, each
/// `n_local` rows of `row_bytes[t]` bytes.
pub type LayerWeights<'a> = Vec<&'a mut [u8]>;

/// What a rearrangement did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    pub layers_changed: usize,
    pub rows_sent: usize,
    pub rows_received: usize,
    pub rows_copied_locally: usize,
    /// Communicator executes this rank ran: one per layer, or with migration batching one per
    /// batch of each layer (a layer that moves nothing then has none).
    pub executes: usize,
    /// Per layer, the logical experts the new placement needs that no member rank holds (after
    /// a failure: experts whose every replica was on a removed rank), sorted. Non-empty only
    /// under [`LostExperts::LeaveUnwritten`]: their slots keep the bytes they held before.
    pub lost_experts: Vec<Vec<i64>>,
    /// Rows (one per received slot and tensor) that came by the row exchange into next
    /// buffers this rank declared shared memory ([`RearrangeOptions::next_shared`], which the
    /// C ABI and Python set when every next tensor lies in memory from `epcomm_mem_alloc`):
    /// the senders stored them there, each byte once, with plain stores, no system call. 0 for
    /// the staged path and for next buffers in ordinary memory, whose rows are read from the
    /// senders through the kernel.
    pub rows_into_shared: usize,
}

/// What a rearrangement does with logical experts the new placement needs but no member rank
/// holds (after a failure: every replica was on a removed rank, so the weights are gone).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LostExperts {
    /// Fail every rank before any data moves, naming the layer and the experts.
    #[default]
    Refuse,
    /// Rearrange everything else; each slot of a lost expert is left unwritten (it keeps the
    /// bytes that slot held on that rank before the call, the weights of the expert the old
    /// placement had there, or whatever an empty slot held) and the experts are reported in
    /// [`Summary::lost_experts`]: the caller loads their weights there or serves without them.
    LeaveUnwritten,
}

/// How a rearrangement runs; every rank must pass the same.
#[derive(Debug, Clone, Copy, Default)]
pub struct RearrangeOptions<'a> {
    /// Old rank -> new rank or -1, for a change of EP size (see [`apply_rank_mapping`]).
    pub rank_mapping: Option<&'a [i64]>,
    /// The weight tensors' dtypes, one per tensor of a layer; empty when unknown.
    pub dtypes: &'a [DType],
    /// vLLM's `EPLBConfig.migration_batching_enabled` (`use_async and
    /// enable_migration_batching`): run each layer's transfers batch by batch as vLLM
    /// v0.33.0's migration scheduler orders them.
    pub migration_batching: bool,
    /// What happens to logical experts the new placement needs but no member rank holds (after
    /// a failure: experts whose every replica was on a removed rank); every rank must pass the
    /// same.
    pub lost: LostExperts,
    /// [`rearrange_into`]: this rank's next buffers lie in shared memory it allocated from
    /// this group ([`Group::alloc_shared`]; `epcomm_mem_alloc` in C, `Group.alloc` in Python,
    /// where epcomm finds it out itself). When any rank sets it, each layer's received rows
    /// travel by the communicator's row exchange: a sender stores each row straight into its
    /// final place in a receiver's shared next buffer (plain stores, one copy per byte, no
    /// system call), and reads from the sender through the kernel (`process_vm_readv`) for a
    /// receiver whose next buffers are ordinary memory. Ranks may differ; it changes only how
    /// the bytes move, never which (a next buffer wrongly said to be shared is still filled).
    pub next_shared: bool,
}

/// One transfer of a rank's plan: `Send(i)` is `plan.sends[i]`, `Recv(i)` is `plan.recvs[i]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Send(usize),
    Recv(usize),
}

/// A layer's plan on this rank and its transfers, one list per communicator execute.
#[derive(Debug, Clone)]
struct LayerMoves {
    plan: LayerPlan,
    executes: Vec<Vec<Step>>,
    /// The lost experts whose slots are left unwritten (see [`LostExperts`]).
    lost: Vec<i64>,
}

/// The unbatched path: every send, then every receive, in one execute (vLLM's `move_to_buffer`).
fn one_execute(plan: &LayerPlan) -> Vec<Vec<Step>> {
    let sends = (0..plan.sends.len()).map(Step::Send);
    vec![sends.chain((0..plan.recvs.len()).map(Step::Recv)).collect()]
}

/// Each transfer's index in `transfers` (a plan's sends or receives: expert, row, peer), by
/// (expert, peer).
fn by_expert_and_peer(transfers: &[(i64, usize, usize)]) -> HashMap<(i64, usize), usize> {
    let keys = transfers.iter().map(|&(expert, _, peer)| (expert, peer));
    keys.zip(0..).collect()
}

/// The batched path (vLLM's `_execute_migration_batches`): per batch, this rank's sends or
/// receives of its flow, experts in flow order. Every flow touching `me` must be a transfer of
/// its plan and every transfer of the plan must be in one flow, so the batched path moves what
/// the plan moves, from the same sources.
fn batched_executes(plan: &LayerPlan, batches: &Batches, me: usize) -> Result<Vec<Vec<Step>>> {
    let (sends, recvs) = (
        by_expert_and_peer(&plan.sends),
        by_expert_and_peer(&plan.recvs),
    );
    let mut used = 0;
    let mut executes = Vec::with_capacity(batches.len());
    for batch in batches {
        let mut steps = Vec::new();
        for f in batch {
            let (table, peer, step): (_, _, fn(usize) -> Step) = if f.src_rank == me {
                (&sends, f.dst_rank, Step::Send)
            } else if f.dst_rank == me {
                (&recvs, f.src_rank, Step::Recv)
            } else {
                continue;
            };
            for &e in &f.expert_ids {
                let i = table.get(&(e, peer)).ok_or_else(|| {
                    Error::Internal(format!(
                        "rearrange: the migration schedule moves expert {e} between ranks {} and {} but rank {me}'s transfer plan does not",
                        f.src_rank, f.dst_rank
                    ))
                })?;
                steps.push(step(*i));
                used += 1;
            }
        }
        executes.push(steps);
    }
    if used != plan.sends.len() + plan.recvs.len() {
        return Err(Error::Internal(format!(
            "rearrange: the migration schedule covers {used} of the {} transfers of rank {me}'s plan",
            plan.sends.len() + plan.recvs.len()
        )));
    }
    Ok(executes)
}

fn rows_of(buf: &[u8], row_bytes: usize, r: usize) -> std::ops::Range<usize> {
    debug_assert!((r + 1) * row_bytes <= buf.len());
    r * row_bytes..(r + 1) * row_bytes
}

/// Local copies into the staging buffers (sized to the layer first).
fn stage_local_copies(
    plan: &LayerPlan,
    weights: &[&mut [u8]],
    row_bytes: &[usize],
    staging: &mut [Vec<u8>],
) {
    for ((buf, &rb), w) in staging.iter_mut().zip(row_bytes).zip(weights.iter()) {
        if buf.len() < w.len() {
            buf.resize(w.len(), 0);
        }
        for &(dst, src) in &plan.local_copies {
            let (d, s) = (rows_of(buf, rb, dst), rows_of(w, rb, src));
            copy_streaming(&mut buf[d], &w[s]);
        }
    }
    streaming_fence();
}

/// Runs the layer's transfers, one communicator execute per entry of `moves.executes`: sends
/// read rows of `sources`, receives land in their primary rows of `dests` (the staging buffers,
/// or the next weights of a double-buffered rearrangement).
fn transfer<S: AsRef<[u8]>, D: AsMut<[u8]>>(
    g: &mut dyn Group,
    comm: &mut dyn EplbCommunicator,
    moves: &LayerMoves,
    sources: &[S],
    row_bytes: &[usize],
    dests: &mut [D],
) -> Result<()> {
    let plan = &moves.plan;
    // Receive rows are distinct primaries: split the destinations into disjoint rows.
    let mut recv_rows: Vec<Vec<Option<&mut [u8]>>> = dests
        .iter_mut()
        .zip(row_bytes)
        .map(|(buf, &rb)| buf.as_mut().chunks_mut(rb.max(1)).map(Some).collect())
        .collect();
    each_execute(moves, |steps| {
        let mut ops: Vec<P2p<'_>> = Vec::new();
        for &step in steps {
            match step {
                Step::Send(i) => {
                    let (_, row, dst) = plan.sends[i];
                    for (w, &rb) in sources.iter().zip(row_bytes) {
                        let w = w.as_ref();
                        ops.push(P2p::Send {
                            peer: dst,
                            data: &w[rows_of(w, rb, row)],
                        });
                    }
                }
                Step::Recv(i) => {
                    let (_, row, src) = plan.recvs[i];
                    for rows in recv_rows.iter_mut() {
                        let data = rows[row].take().ok_or_else(|| {
                            Error::Internal(format!(
                                "rearrange: the plan receives into slot {row} twice"
                            ))
                        })?;
                        ops.push(P2p::Recv { peer: src, data });
                    }
                }
            }
        }
        comm.execute(g, &mut ops)
    })
}

/// Runs `execute` on the steps of each communicator execute of `moves`, with the fault points
/// before, between and after them.
fn each_execute(moves: &LayerMoves, mut execute: impl FnMut(&[Step]) -> Result<()>) -> Result<()> {
    crate::fault::point("eplb:before_staging");
    for steps in &moves.executes {
        execute(steps)?;
        crate::fault::point("eplb:between_batches");
    }
    crate::fault::point("eplb:after_staging");
    Ok(())
}

/// [`transfer`] through the communicator's row exchange: per execute, one exchange per weight
/// tensor (rows of the same steps, in step order, so each peer pair matches them as the sends
/// and receives would be). A receiver whose next buffer is shared memory gets its rows stored
/// there by their senders.
fn transfer_rows(
    g: &mut dyn Group,
    comm: &mut dyn EplbCommunicator,
    moves: &LayerMoves,
    sources: &[&[u8]],
    row_bytes: &[usize],
    dests: &mut [&mut [u8]],
) -> Result<()> {
    let (plan, world) = (&moves.plan, g.size());
    each_execute(moves, |steps| {
        let (mut give, mut take) = (vec![Vec::new(); world], vec![Vec::new(); world]);
        for &step in steps {
            match step {
                Step::Send(i) => give[plan.sends[i].2].push(plan.sends[i].1 as u32),
                Step::Recv(i) => take[plan.recvs[i].2].push(plan.recvs[i].1 as u32),
            }
        }
        for ((src, dst), &rb) in sources.iter().zip(dests.iter_mut()).zip(row_bytes) {
            let rows = RowExchange {
                src,
                row_bytes: rb,
                give: &give,
                dst,
                take: &take,
            };
            comm.exchange_rows(g, rows)?;
        }
        Ok(())
    })
}

// transfer, transfer_rows and move_layer share their (group, communicator, moves, rows)
// arguments: three ways to move one layer, each clearer with its inputs named.
/// Moves one layer per its plan.
fn move_layer(
    g: &mut dyn Group,
    comm: &mut dyn EplbCommunicator,
    moves: &LayerMoves,
    weights: &mut [&mut [u8]],
    row_bytes: &[usize],
    staging: &mut [Vec<u8>],
) -> Result<()> {
    let plan = &moves.plan;
    stage_local_copies(plan, weights, row_bytes, staging);
    transfer(g, comm, moves, weights, row_bytes, staging)?;
    // Every transfer succeeded: apply.
    let primaries: Vec<usize> = plan.recvs.iter().map(|r| r.1).collect();
    for ((w, &rb), buf) in weights.iter_mut().zip(row_bytes).zip(staging.iter()) {
        for row in 0..plan.unchanged.len() {
            let staged = plan.local_copies.iter().any(|c| c.0 == row) || primaries.contains(&row);
            if !plan.unchanged[row] && staged {
                let r = rows_of(w, rb, row);
                copy_streaming(&mut w[r.clone()], &buf[r]);
            }
        }
        for &(dup, primary) in &plan.duplicates {
            let (d, p) = (rows_of(w, rb, dup), rows_of(w, rb, primary));
            w.copy_within(p, d.start);
        }
    }
    streaming_fence();
    Ok(())
}

// rearrange, rearrange_typed, rearrange_with and rearrange_into share their leading arguments:
// the Rust API's entry points, the shorter ones each one call of rearrange_with.
/// Rearranges every layer from `old` to `new` (physical → logical per layer, `-1` = empty
/// slot). `weights[l]` holds layer l's tensors on this rank. With `rank_mapping` the EP size
/// changes (see [`apply_rank_mapping`]): with one entry per rank of the group, a scale-down on
/// the old group (ranks that leave send their experts and keep none); with fewer, a scale-up
/// on the grown group (new ranks start empty); with more, a scale-down after a failure on the
/// group of survivors (see [`rearrange_with`]).
/// Collective. The staging buffers (one layer of this rank's weights) stay allocated on the
/// calling thread for the next rearrangement.
pub fn rearrange(
    g: &mut dyn Group,
    comm: &mut dyn EplbCommunicator,
    old: &[Vec<i64>],
    new: &[Vec<i64>],
    weights: &mut [LayerWeights<'_>],
    row_bytes: &[usize],
    rank_mapping: Option<&[i64]>,
) -> Result<Summary> {
    rearrange_typed(g, comm, old, new, weights, row_bytes, rank_mapping, &[])
}

/// [`rearrange`], with the weight tensors' dtypes (one per tensor of a layer; empty when
/// unknown), which every rank must pass alike too.
#[allow(clippy::too_many_arguments)]
pub fn rearrange_typed(
    g: &mut dyn Group,
    comm: &mut dyn EplbCommunicator,
    old: &[Vec<i64>],
    new: &[Vec<i64>],
    weights: &mut [LayerWeights<'_>],
    row_bytes: &[usize],
    rank_mapping: Option<&[i64]>,
    dtypes: &[DType],
) -> Result<Summary> {
    let options = RearrangeOptions {
        rank_mapping,
        dtypes,
        ..RearrangeOptions::default()
    };
    rearrange_with(g, comm, old, new, weights, row_bytes, &options)
}

/// [`rearrange`] with every option (the rank mapping, the dtypes, migration batching, lost
/// experts), which every rank must pass alike: a disagreement fails every rank before any layer
/// moves.
///
/// A rank mapping longer than the group is a scale-down after a failure: the group is the
/// surviving ranks (`rank_mapping[r] >= 0`, renumbered as the mapping says), the removed ranks
/// are not members and send nothing, and the old placement is read as the survivors hold it
/// ([`survivors_placement`]): the new placement (group size x slots per rank) is sourced from
/// surviving replicas only. A lost expert is then refused on every rank with a message naming
/// the layer, the experts and the removed ranks, unless `options.lost` leaves it unwritten.
pub fn rearrange_with(
    g: &mut dyn Group,
    comm: &mut dyn EplbCommunicator,
    old: &[Vec<i64>],
    new: &[Vec<i64>],
    weights: &mut [LayerWeights<'_>],
    row_bytes: &[usize],
    options: &RearrangeOptions<'_>,
) -> Result<Summary> {
    let _rank = crate::log::rank_scope(g.rank());
    let _call = crate::call::scope("rearrange");
    let shape = check_layers(old.len(), new.len(), weights.len());
    // Every rank checks its own arguments, then all agree on what they rearrange before any
    // layer moves: a rank's rejection or a disagreement fails every rank, no layer changed.
    let (me, world) = (g.rank(), g.size());
    let plans = shape.and_then(|()| plans(me, world, old, new, &lens(weights), row_bytes, options));
    let header = header(plans.is_ok(), world, old, new, row_bytes, options);
    let agreed = agree(g, &header);
    let plans = match (plans, agreed) {
        (Err(e), _) => return Err(e),
        (Ok(_), Err(e)) => return Err(with_progress(e, 0)),
        (Ok(p), Ok(_)) => p,
    };
    with_staging(row_bytes.len(), |staging| {
        let mut summary = Summary::default();
        rearrange_layers(g, comm, &plans, weights, row_bytes, staging, &mut summary)
            .map(|()| summary)
    })
}

/// The words of the agreement header.
const WORDS: usize = 11;

/// What every rank must rearrange alike, as the words of the agreement header: this rank's
/// verdict (bit 0; bit 1: its next buffers are shared memory, which ranks may differ on), the
/// layer count, digests of the row sizes, dtypes, maps and rank mapping, and
/// whether migration batching is on (it sets how many executes each layer runs), whether lost
/// experts are left unwritten, and whether this is a scale-down after a failure (the rank
/// mapping is longer than the group).
fn header(
    ok: bool,
    world: usize,
    old: &[Vec<i64>],
    new: &[Vec<i64>],
    row_bytes: &[usize],
    options: &RearrangeOptions<'_>,
) -> [u64; WORDS] {
    use crate::bytes::fnv1a;
    let maps = |m: &[Vec<i64>]| {
        fnv1a(
            m.iter()
                .flat_map(|l| std::iter::once(l.len() as u64).chain(l.iter().map(|&x| x as u64))),
        )
    };
    [
        u64::from(ok) | u64::from(ok && options.next_shared) << 1,
        old.len() as u64,
        row_bytes.len() as u64,
        fnv1a(row_bytes.iter().map(|&b| b as u64)),
        fnv1a(
            options
                .dtypes
                .iter()
                .map(|d| u64::from(d.code) << 32 | u64::from(d.bits) << 16 | u64::from(d.lanes)),
        ),
        maps(old),
        maps(new),
        // Hashed only once checked: a rejected mapping's length may not be the caller's.
        options
            .rank_mapping
            .filter(|_| ok)
            .map_or(0, |m| 1 + fnv1a(m.iter().map(|&x| x as u64))),
        u64::from(options.migration_batching),
        u64::from(options.lost == LostExperts::LeaveUnwritten),
        u64::from(post_failure(options.rank_mapping, world)),
    ]
}

/// A rank mapping longer than the group: the removed ranks are not members (a scale-down after
/// a failure, on the group of survivors).
fn post_failure(mapping: Option<&[i64]>, world: usize) -> bool {
    mapping.is_some_and(|m| m.len() > world)
}

/// Runs `f` with `tensors` staging buffers (one layer of this rank's weights, like vLLM's
/// expert_weights_buffer), kept per thread for the next rearrangement: allocating and
/// zero-filling them on every call cost more than the transfer itself.
fn with_staging<T>(tensors: usize, f: impl FnOnce(&mut [Vec<u8>]) -> T) -> T {
    thread_local! {
        static STAGING: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut staging = STAGING.with(|s| std::mem::take(&mut *s.borrow_mut()));
    staging.resize_with(tensors, Vec::new);
    let result = f(&mut staging);
    STAGING.with(|s| *s.borrow_mut() = staging);
    result
}

/// The byte lengths of every layer's tensors.
fn lens<B: AsRef<[u8]>>(weights: &[Vec<B>]) -> Vec<Vec<usize>> {
    weights
        .iter()
        .map(|l| l.iter().map(|t| t.as_ref().len()).collect())
        .collect()
}

/// The plan of every layer on this rank and its executes, checking the arguments (`weights`:
/// the byte lengths of every layer's tensors).
fn plans(
    me: usize,
    world: usize,
    old: &[Vec<i64>],
    new: &[Vec<i64>],
    weights: &[Vec<usize>],
    row_bytes: &[usize],
    options: &RearrangeOptions<'_>,
) -> Result<Vec<LayerMoves>> {
    let mut plans = Vec::with_capacity(old.len());
    for (l, ((o, n), w)) in old.iter().zip(new).zip(weights).enumerate() {
        if w.len() != row_bytes.len() {
            return Err(Error::InvalidArgument(format!(
                "layer {l} has {} weight tensors; expected {}",
                w.len(),
                row_bytes.len()
            )));
        }
        let (o, n, lost) = group_maps(l, world, o, n, options)?;
        if o.len() % world != 0 {
            return Err(Error::InvalidArgument(format!(
                "layer {l}: {} physical slots do not divide over {world} ranks",
                o.len()
            )));
        }
        let n_local = o.len() / world;
        for (t, (buf, &rb)) in w.iter().zip(row_bytes).enumerate() {
            if *buf != n_local * rb {
                return Err(Error::InvalidArgument(format!(
                    "layer {l} tensor {t} has {buf} bytes; expected {n_local} local experts x {rb} bytes"
                )));
            }
        }
        // The plan refuses an expert no rank holds before the schedule (which skips it) is made.
        let plan = plan_layer(&o, &n, n_local, me)?;
        let executes = if options.migration_batching {
            batched_executes(&plan, &schedule_migration_batches(n_local, &o, &n)?, me)?
        } else {
            one_execute(&plan)
        };
        plans.push(LayerMoves {
            plan,
            executes,
            lost,
        });
    }
    Ok(plans)
}

/// One layer's old and new maps over the group's ranks, and the lost experts left unwritten.
///
/// The rank mapping widens them for a change of EP size ([`apply_rank_mapping`]), or, when it
/// is longer than the group (after a failure), narrows the old map to the survivors
/// ([`survivors_placement`]). Experts the new map needs and the old one lacks are lost: after a
/// failure refused here, on every rank alike; under [`LostExperts::LeaveUnwritten`] their new
/// slots take the old map's entry (so the plan leaves them unchanged); otherwise refused by
/// [`plan_layer`] on the rank that needs them.
fn group_maps(
    l: usize,
    world: usize,
    o: &[i64],
    n: &[i64],
    options: &RearrangeOptions<'_>,
) -> Result<(Vec<i64>, Vec<i64>, Vec<i64>)> {
    let mut removed = Vec::new();
    let (o, mut n) = match options.rank_mapping {
        Some(m) if m.len() > world => {
            let n_local = n.len() / world;
            if n_local == 0 || !n.len().is_multiple_of(world) {
                return Err(Error::InvalidArgument(format!(
                    "layer {l}: the new placement has {} slots, which do not divide over the {world} surviving ranks",
                    n.len()
                )));
            }
            let (survivors, gone) = survivors_placement(o, n_local, m, world)?;
            removed = gone;
            (survivors, n.to_vec())
        }
        Some(m) => {
            check_resize(l, world, m.len(), o.len(), n.len())?;
            apply_rank_mapping(o, n, o.len() / m.len().max(1), m)?
        }
        None => (o.to_vec(), n.to_vec()),
    };
    // Maps of different sizes are refused by the plan, with its message.
    let lost = unsourced_experts(&o, &n);
    if lost.is_empty() || o.len() != n.len() {
        return Ok((o, n, Vec::new()));
    }
    match options.lost {
        LostExperts::LeaveUnwritten => {
            for (slot, e) in n.iter_mut().enumerate() {
                if lost.contains(e) {
                    *e = o[slot];
                }
            }
            Ok((o, n, lost))
        }
        LostExperts::Refuse if post_failure(options.rank_mapping, world) => {
            Err(Error::InvalidArgument(format!(
                "rearrange: layer {l} needs logical experts {lost:?}, which have no replica on a surviving rank (rank_mapping removes ranks {removed:?}); their weights are gone: allow lost experts to rearrange the others and leave their slots unwritten (the call reports them; load their weights there afterwards), or choose a new placement without them"
            )))
        }
        LostExperts::Refuse => Ok((o, n, Vec::new())),
    }
}

/// A change of EP size runs on the group its mapping's length says: one entry per rank, a
/// scale-down on the old group (the new placement has no more ranks); fewer, a scale-up on the
/// grown group (the new placement has the group's ranks). Maps that do not split into the
/// mapping's blocks are left to [`apply_rank_mapping`], with its message.
fn check_resize(l: usize, world: usize, entries: usize, old: usize, new: usize) -> Result<()> {
    if entries == 0
        || !old.is_multiple_of(entries)
        || old / entries == 0
        || !new.is_multiple_of(old / entries)
    {
        return Ok(());
    }
    let n_local = old / entries;
    let new_ranks = new / n_local;
    if entries == world && new_ranks > world {
        return Err(Error::InvalidArgument(format!(
            "layer {l}: rank_mapping has one entry per rank of the group ({world}), a scale-down on the old group, but the new placement has {new_ranks} ranks of {n_local} slots; a scale-up runs on the grown group, with one entry per old rank"
        )));
    }
    if entries < world && new_ranks != world {
        return Err(Error::InvalidArgument(format!(
            "layer {l}: rank_mapping has {entries} entries, fewer than the {world} ranks of the group (a scale-up on the grown group), but the new placement has {new_ranks} ranks of {n_local} slots; expected {world} ranks ({} slots)",
            world * n_local
        )));
    }
    Ok(())
}

const HEADER: [&str; WORDS] = [
    "",
    "the number of layers",
    "the number of weight tensors per layer",
    "the weight row bytes",
    "the weight dtypes",
    "the old placement",
    "the new placement",
    "the rank mapping",
    "migration batching",
    "leaving lost experts unwritten",
    "a scale-down after a failure",
];

/// Gathers every rank's header (its verdict and what it rearranges); any rank's rejection or
/// a disagreement is an error, the same on every rank. Returns whether any rank's next buffers
/// are shared memory (then every rank moves rows by the row exchange).
fn agree(g: &mut dyn Group, mine: &[u64; WORDS]) -> Result<bool> {
    let bytes: Vec<u8> = mine.iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut all = vec![0u8; bytes.len() * g.size()];
    g.all_gather(&bytes, &mut all)?;
    let headers: Vec<[u64; WORDS]> = all
        .chunks_exact(8 * WORDS)
        .map(|c| {
            let mut h = [0u64; WORDS];
            for (w, x) in h.iter_mut().zip(crate::bytes::words::<u64>(c)) {
                *w = u64::from_le(x);
            }
            h
        })
        .collect();
    if let Some(r) = headers.iter().position(|h| h[0] == 0) {
        if r != g.rank() {
            return Err(Error::InvalidArgument(format!(
                "rearrange: rank {r} rejected its arguments (see that rank's error)"
            )));
        }
    }
    for (i, what) in HEADER.iter().enumerate().skip(1) {
        let v0 = headers[0][i];
        if let Some(p) = (1..headers.len()).find(|&p| headers[p][i] != v0) {
            let detail = match i {
                1 | 2 => format!("rank 0 passes {v0} but rank {p} passes {}", headers[p][i]),
                8..=10 => format!(
                    "rank 0 turns it {} but rank {p} turns it {}",
                    on_off(v0),
                    on_off(headers[p][i])
                ),
                _ => format!("rank 0 and rank {p} pass different ones"),
            };
            return Err(Error::InvalidArgument(format!(
                "rearrange: ranks disagree on {what}: {detail}; every rank must pass the same"
            )));
        }
    }
    Ok(headers.iter().any(|h| h[0] & 2 != 0))
}

fn on_off(v: u64) -> &'static str {
    if v == 0 {
        "off"
    } else {
        "on"
    }
}

/// Takes part in a rearrangement as a rank whose arguments failed its own checks (`e`,
/// returned): the peers fail at once naming this rank, and no layer changes anywhere.
pub fn reject_rearrange(g: &mut dyn Group, e: Error) -> Error {
    let _ = agree(g, &[0; WORDS]);
    e
}

/// Adds what the rearrangement did to an error of layer `l`: the layers before it hold the
/// new placement, it and later ones the old.
fn with_progress(e: Error, l: usize) -> Error {
    let done = if l == 0 {
        "no layer was changed".to_owned()
    } else {
        format!("layers before {l} were rearranged; layer {l} and later keep the old placement")
    };
    let add = |m: String| format!("{m} (EPLB rearrangement: {done})");
    match e {
        Error::PeerFailure(m) => Error::PeerFailure(add(m)),
        Error::Timeout(m) => Error::Timeout(add(m)),
        Error::InvalidArgument(m) => Error::InvalidArgument(add(m)),
        Error::InvalidState(m) => Error::InvalidState(add(m)),
        Error::Runtime(m) => Error::Runtime(add(m)),
        Error::System(m) => Error::System(add(m)),
        Error::Internal(m) => Error::Internal(add(m)),
        // Errors without a message of their own (null pointers, backend names) are local.
        other => other,
    }
}

fn rearrange_layers(
    g: &mut dyn Group,
    comm: &mut dyn EplbCommunicator,
    plans: &[LayerMoves],
    weights: &mut [LayerWeights<'_>],
    row_bytes: &[usize],
    staging: &mut [Vec<u8>],
    summary: &mut Summary,
) -> Result<()> {
    for (l, (moves, w)) in plans.iter().zip(weights.iter_mut()).enumerate() {
        // The layer is applied only after its transfer ops committed on every rank, so every
        // rank reports the same layer.
        move_layer(g, comm, moves, w, row_bytes, staging).map_err(|e| with_progress(e, l))?;
        count_layer(summary, moves);
    }
    Ok(())
}

/// One layer's live weights, read-only: the source of a double-buffered rearrangement.
pub type LayerView<'a> = Vec<&'a [u8]>;

/// What a double-buffered rearrangement ([`rearrange_into`]) did.
#[derive(Debug)]
#[must_use]
pub struct Rearranged {
    /// The summary, or the error (with the same text [`rearrange_with`] gives).
    pub result: Result<Summary>,
    /// The layers whose next buffers now hold the new placement: `0..next_valid`, the same on
    /// every rank. All of them on success; on an error at layer `l`, the layers before it.
    /// Layer `next_valid`'s next buffers are then partly written (garbage), later layers' are
    /// untouched, and the live weights of every layer are unchanged.
    pub next_valid: usize,
}

/// Checks the next buffers of a double-buffered rearrangement, given as (address, length)
/// ranges per layer and tensor: one per live tensor, of its size, none overlapping a live
/// tensor or another next tensor. The messages name the first bad buffer.
pub fn check_next_buffers(
    live: &[Vec<(usize, usize)>],
    next: &[Vec<(usize, usize)>],
) -> Result<()> {
    if next.len() != live.len() {
        return Err(Error::InvalidArgument(format!(
            "next_weights has {} layers; expected {} (one per layer of the live weights)",
            next.len(),
            live.len()
        )));
    }
    let overlap = |a: (usize, usize), b: (usize, usize)| {
        a.1 > 0 && b.1 > 0 && a.0 < b.0.saturating_add(b.1) && b.0 < a.0.saturating_add(a.1)
    };
    for (l, (lv, nx)) in live.iter().zip(next).enumerate() {
        if nx.len() != lv.len() {
            return Err(Error::InvalidArgument(format!(
                "next_weights layer {l} has {} tensors; expected {} (as the live weights)",
                nx.len(),
                lv.len()
            )));
        }
        for (t, (&n, &w)) in nx.iter().zip(lv).enumerate() {
            if n.1 != w.1 {
                return Err(Error::InvalidArgument(format!(
                    "next_weights layer {l} tensor {t} has {} bytes; expected {} (the size of live layer {l} tensor {t})",
                    n.1, w.1
                )));
            }
        }
    }
    let all = |m: &[Vec<(usize, usize)>]| -> Vec<(usize, usize, (usize, usize))> {
        let it = m.iter().enumerate();
        it.flat_map(|(l, v)| v.iter().enumerate().map(move |(t, &r)| (l, t, r)))
            .collect()
    };
    let (live, next) = (all(live), all(next));
    for (i, &(l, t, n)) in next.iter().enumerate() {
        if let Some(&(l2, t2, _)) = live.iter().find(|w| overlap(n, w.2)) {
            return Err(Error::InvalidArgument(format!(
                "next_weights layer {l} tensor {t} overlaps live layer {l2} tensor {t2}; the next weights must be buffers of their own"
            )));
        }
        if let Some(&(l2, t2, _)) = next[..i].iter().find(|m| overlap(n, m.2)) {
            return Err(Error::InvalidArgument(format!(
                "next_weights layer {l} tensor {t} overlaps next_weights layer {l2} tensor {t2}; every next tensor must be a buffer of its own"
            )));
        }
    }
    Ok(())
}

fn ranges<B: AsRef<[u8]>>(weights: &[Vec<B>]) -> Vec<Vec<(usize, usize)>> {
    let range = |b: &B| (b.as_ref().as_ptr() as usize, b.as_ref().len());
    weights
        .iter()
        .map(|l| l.iter().map(range).collect())
        .collect()
}

/// A double-buffered rearrangement: as [`rearrange_with`], but the live weights (`live`) are
/// only read, and every layer's new placement is written into `next` (buffers of the live
/// tensors' sizes, separate from them), each byte once: a slot's row is its live row (an
/// unchanged or emptied slot), a local copy of another live row, a received row, or a
/// duplicate of a received row. `next` need not be initialised. The commit is the swap: the
/// caller uses layer l's next buffers once [`Rearranged::next_valid`] exceeds l, which happens
/// when the layer's transfer committed on every rank. Bad next buffers fail every rank before
/// any data moves. Collective; every rank must rearrange double-buffered.
#[allow(clippy::too_many_arguments)]
pub fn rearrange_into(
    g: &mut dyn Group,
    comm: &mut dyn EplbCommunicator,
    old: &[Vec<i64>],
    new: &[Vec<i64>],
    live: &[LayerView<'_>],
    next: &mut [LayerWeights<'_>],
    row_bytes: &[usize],
    options: &RearrangeOptions<'_>,
) -> Rearranged {
    let _rank = crate::log::rank_scope(g.rank());
    let _call = crate::call::scope("rearrange");
    let (me, world) = (g.rank(), g.size());
    let plans = check_layers(old.len(), new.len(), live.len())
        .and_then(|()| check_next_buffers(&ranges(live), &ranges(next)))
        .and_then(|()| plans(me, world, old, new, &lens(live), row_bytes, options));
    let header = header(plans.is_ok(), world, old, new, row_bytes, options);
    let agreed = agree(g, &header);
    let (plans, by_rows) = match (plans, agreed) {
        (Err(e), _) => return rearranged(Err(e), 0),
        (Ok(_), Err(e)) => return rearranged(Err(with_progress(e, 0)), 0),
        (Ok(p), Ok(any_shared)) => (p, any_shared),
    };
    let mut summary = Summary::default();
    let layers = plans.iter().zip(live).zip(next.iter_mut());
    for (l, ((moves, src), dst)) in layers.enumerate() {
        if let Err(e) = place_layer(g, comm, moves, src, dst, row_bytes, by_rows) {
            return rearranged(Err(with_progress(e, l)), l);
        }
        count_layer(&mut summary, moves);
        if by_rows && options.next_shared {
            summary.rows_into_shared += moves.plan.recvs.len() * row_bytes.len();
        }
    }
    rearranged(Ok(summary), plans.len())
}

fn rearranged(result: Result<Summary>, next_valid: usize) -> Rearranged {
    Rearranged { result, next_valid }
}

/// The layer counts of the old and new maps and the weights agree.
fn check_layers(old: usize, new: usize, weights: usize) -> Result<()> {
    if old != new || old != weights {
        return Err(Error::InvalidArgument(format!(
            "old has {old} layers, new {new} and weights {weights}; expected the same number of layers"
        )));
    }
    Ok(())
}

/// Adds a moved layer to the summary.
fn count_layer(summary: &mut Summary, moves: &LayerMoves) {
    let plan = &moves.plan;
    if !plan.is_noop() {
        summary.layers_changed += 1;
    }
    summary.rows_sent += plan.sends.len();
    summary.rows_received += plan.recvs.len() + plan.duplicates.len();
    summary.rows_copied_locally += plan.local_copies.len();
    summary.executes += moves.executes.len();
    summary.lost_experts.push(moves.lost.clone());
}

/// Per slot, the live row it is copied from, or None for a slot written by a receive (its
/// primary row or a duplicate of it).
fn live_sources(plan: &LayerPlan) -> Vec<Option<usize>> {
    let mut from: Vec<Option<usize>> = (0..plan.unchanged.len()).map(Some).collect();
    for &(dst, src) in &plan.local_copies {
        from[dst] = Some(src);
    }
    for r in &plan.recvs {
        from[r.1] = None;
    }
    for &(dup, _) in &plan.duplicates {
        from[dup] = None;
    }
    from
}

/// Writes one layer's next buffers: live and local rows (runs of consecutive rows as one
/// copy), the transfers, then the duplicates of received rows.
fn place_layer(
    g: &mut dyn Group,
    comm: &mut dyn EplbCommunicator,
    moves: &LayerMoves,
    live: &[&[u8]],
    next: &mut [&mut [u8]],
    row_bytes: &[usize],
    by_rows: bool,
) -> Result<()> {
    let from = live_sources(&moves.plan);
    for ((src, dst), &rb) in live.iter().zip(next.iter_mut()).zip(row_bytes) {
        let mut row = 0;
        while row < from.len() {
            let Some(s) = from[row] else {
                row += 1;
                continue;
            };
            let mut n = 1;
            while from.get(row + n).copied().flatten() == Some(s + n) {
                n += 1;
            }
            copy_streaming(
                &mut dst[row * rb..(row + n) * rb],
                &src[s * rb..(s + n) * rb],
            );
            row += n;
        }
    }
    streaming_fence();
    if by_rows {
        transfer_rows(g, comm, moves, live, row_bytes, next)?;
    } else {
        transfer(g, comm, moves, live, row_bytes, next)?;
    }
    for (dst, &rb) in next.iter_mut().zip(row_bytes) {
        for &(dup, primary) in &moves.plan.duplicates {
            dst.copy_within(rows_of(dst, rb, primary), dup * rb);
        }
    }
    Ok(())
}

/// Per layer, the logical experts a rearrangement of these arguments on a group of `world`
/// ranks would leave unwritten under [`LostExperts::LeaveUnwritten`] (what
/// [`Summary::lost_experts`] then reports): lets a caller size its output before the
/// collective call. The errors are those of the rearrangement's own checks.
pub fn lost_by_layer(
    world: usize,
    old: &[Vec<i64>],
    new: &[Vec<i64>],
    options: &RearrangeOptions<'_>,
) -> Result<Vec<Vec<i64>>> {
    check_layers(old.len(), new.len(), old.len())?;
    let opts = RearrangeOptions {
        lost: LostExperts::LeaveUnwritten,
        ..*options
    };
    let layers = old.iter().zip(new).enumerate();
    layers
        .map(|(l, (o, n))| group_maps(l, world.max(1), o, n, &opts).map(|m| m.2))
        .collect()
}
