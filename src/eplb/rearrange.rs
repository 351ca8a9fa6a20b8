//! Rearrangement: moving expert weights from the old placement to the new one, layer by layer,
//! through an EPLB communicator. Receives and local copies land in a staging buffer; a layer's
//! live weights change only after all of its transfers succeeded, so a failed or interrupted
//! transfer leaves that layer (and every later one) exactly as it was.

use super::communicator::EplbCommunicator;
use super::transfer::{apply_rank_mapping, plan_layer, LayerPlan};
use crate::copy::{copy_streaming, streaming_fence};
use crate::dtype::DType;
use crate::error::{Error, Result};
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
}

fn rows_of(buf: &[u8], row_bytes: usize, r: usize) -> std::ops::Range<usize> {
    debug_assert!((r + 1) * row_bytes <= buf.len());
    r * row_bytes..(r + 1) * row_bytes
}

/// Moves one layer per its plan.
fn move_layer(
    g: &mut dyn Group,
    comm: &mut dyn EplbCommunicator,
    plan: &LayerPlan,
    weights: &mut [&mut [u8]],
    row_bytes: &[usize],
    staging: &mut [Vec<u8>],
) -> Result<()> {
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
    {
        let mut ops: Vec<P2p<'_>> = Vec::new();
        for &(_, row, dst) in &plan.sends {
            for (w, &rb) in weights.iter().zip(row_bytes) {
                ops.push(P2p::Send {
                    peer: dst,
                    data: &w[rows_of(w, rb, row)],
                });
            }
        }
        // Receive rows are distinct primaries: split the staging buffers into disjoint rows.
        let mut recv_rows: Vec<Vec<Option<&mut [u8]>>> = staging
            .iter_mut()
            .zip(row_bytes)
            .map(|(buf, &rb)| buf.chunks_mut(rb.max(1)).map(Some).collect())
            .collect();
        for &(_, row, src) in &plan.recvs {
            for rows in recv_rows.iter_mut() {
                let data = rows[row].take().ok_or_else(|| {
                    Error::Internal(format!(
                        "rearrange: the plan receives into slot {row} twice"
                    ))
                })?;
                ops.push(P2p::Recv { peer: src, data });
            }
        }
        crate::fault::point("eplb:before_staging");
        comm.execute(g, &mut ops)?;
        crate::fault::point("eplb:after_staging");
    }
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

/// Rearranges every layer from `old` to `new` (physical → logical per layer, `-1` = empty
/// slot). `weights[l]` holds layer l's tensors on this rank. With `rank_mapping` the EP size
/// changes (see [`apply_rank_mapping`]); ranks that leave send their experts and keep none.
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
    let _rank = crate::log::rank_scope(g.rank());
    let shape = if old.len() != new.len() || old.len() != weights.len() {
        Err(Error::InvalidArgument(format!(
            "old has {} layers, new {} and weights {}; expected the same number of layers",
            old.len(),
            new.len(),
            weights.len()
        )))
    } else {
        Ok(())
    };
    // Every rank checks its own arguments, then all agree on what they rearrange before any
    // layer moves: a rank's rejection or a disagreement fails every rank, no layer changed.
    let plans = shape.and_then(|()| {
        plans(
            g.rank(),
            g.size(),
            old,
            new,
            weights,
            row_bytes,
            rank_mapping,
        )
    });
    let header = header(plans.is_ok(), old, new, row_bytes, dtypes, rank_mapping);
    let agreed = agree(g, &header);
    let plans = match (plans, agreed) {
        (Err(e), _) => return Err(e),
        (Ok(_), Err(e)) => return Err(with_progress(e, 0)),
        (Ok(p), Ok(())) => p,
    };
    with_staging(row_bytes.len(), |staging| {
        let mut summary = Summary::default();
        rearrange_layers(g, comm, &plans, weights, row_bytes, staging, &mut summary)
            .map(|()| summary)
    })
}

/// What every rank must rearrange alike, as the words of the agreement header: this rank's
/// verdict, the layer count, digests of the row sizes, dtypes, maps and rank mapping.
fn header(
    ok: bool,
    old: &[Vec<i64>],
    new: &[Vec<i64>],
    row_bytes: &[usize],
    dtypes: &[DType],
    rank_mapping: Option<&[i64]>,
) -> [u64; 8] {
    use crate::bytes::fnv1a;
    let maps = |m: &[Vec<i64>]| {
        fnv1a(
            m.iter()
                .flat_map(|l| std::iter::once(l.len() as u64).chain(l.iter().map(|&x| x as u64))),
        )
    };
    [
        u64::from(ok),
        old.len() as u64,
        row_bytes.len() as u64,
        fnv1a(row_bytes.iter().map(|&b| b as u64)),
        fnv1a(
            dtypes
                .iter()
                .map(|d| u64::from(d.code) << 32 | u64::from(d.bits) << 16 | u64::from(d.lanes)),
        ),
        maps(old),
        maps(new),
        rank_mapping.map_or(0, |m| 1 + fnv1a(m.iter().map(|&x| x as u64))),
    ]
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

/// The plan of every layer on this rank, checking the arguments.
fn plans(
    me: usize,
    world: usize,
    old: &[Vec<i64>],
    new: &[Vec<i64>],
    weights: &[LayerWeights<'_>],
    row_bytes: &[usize],
    rank_mapping: Option<&[i64]>,
) -> Result<Vec<LayerPlan>> {
    let mut plans = Vec::with_capacity(old.len());
    for (l, ((o, n), w)) in old.iter().zip(new).zip(weights).enumerate() {
        if w.len() != row_bytes.len() {
            return Err(Error::InvalidArgument(format!(
                "layer {l} has {} weight tensors; expected {}",
                w.len(),
                row_bytes.len()
            )));
        }
        let (o, n) = match rank_mapping {
            Some(m) => {
                let old_world = m.len();
                let n_local = o.len() / old_world.max(1);
                apply_rank_mapping(o, n, n_local, m)?
            }
            None => (o.clone(), n.clone()),
        };
        if o.len() % world != 0 {
            return Err(Error::InvalidArgument(format!(
                "layer {l}: {} physical slots do not divide over {world} ranks",
                o.len()
            )));
        }
        let n_local = o.len() / world;
        for (t, (buf, &rb)) in w.iter().zip(row_bytes).enumerate() {
            if buf.len() != n_local * rb {
                return Err(Error::InvalidArgument(format!(
                    "layer {l} tensor {t} has {} bytes; expected {n_local} local experts x {rb} bytes",
                    buf.len()
                )));
            }
        }
        plans.push(plan_layer(&o, &n, n_local, me)?);
    }
    Ok(plans)
}

const HEADER: [&str; 8] = [
    "",
    "the number of layers",
    "the number of weight tensors per layer",
    "the weight row bytes",
    "the weight dtypes",
    "the old placement",
    "the new placement",
    "the rank mapping",
];

/// Gathers every rank's header (its verdict and what it rearranges); any rank's rejection or
/// a disagreement is an error, the same on every rank.
fn agree(g: &mut dyn Group, mine: &[u64; 8]) -> Result<()> {
    let bytes: Vec<u8> = mine.iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut all = vec![0u8; bytes.len() * g.size()];
    g.all_gather(&bytes, &mut all)?;
    let headers: Vec<[u64; 8]> = all
        .chunks_exact(64)
        .map(|c| {
            let mut h = [0u64; 8];
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
                _ => format!("rank 0 and rank {p} pass different ones"),
            };
            return Err(Error::InvalidArgument(format!(
                "rearrange: ranks disagree on {what}: {detail}; every rank must pass the same"
            )));
        }
    }
    Ok(())
}

/// Takes part in a rearrangement as a rank whose arguments failed its own checks (`e`,
/// returned): the peers fail at once naming this rank, and no layer changes anywhere.
pub fn reject_rearrange(g: &mut dyn Group, e: Error) -> Error {
    let _ = agree(g, &[0; 8]);
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
    plans: &[LayerPlan],
    weights: &mut [LayerWeights<'_>],
    row_bytes: &[usize],
    staging: &mut [Vec<u8>],
    summary: &mut Summary,
) -> Result<()> {
    for (l, (plan, w)) in plans.iter().zip(weights.iter_mut()).enumerate() {
        // The layer is applied only after its transfer op committed on every rank, so every
        // rank reports the same layer.
        move_layer(g, comm, plan, w, row_bytes, staging).map_err(|e| with_progress(e, l))?;
        if !plan.is_noop() {
            summary.layers_changed += 1;
        }
        summary.rows_sent += plan.sends.len();
        summary.rows_received += plan.recvs.len() + plan.duplicates.len();
        summary.rows_copied_locally += plan.local_copies.len();
    }
    Ok(())
}
