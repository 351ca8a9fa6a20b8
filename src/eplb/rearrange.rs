//! Rearrangement: moving expert weights from the old placement to the new one, layer by layer,
//! through an EPLB communicator. Receives and local copies land in a staging buffer; a layer's
//! live weights change only after all of its transfers succeeded, so a failed or interrupted
//! transfer leaves that layer (and every later one) exactly as it was.

use super::communicator::EplbCommunicator;
use super::transfer::{apply_rank_mapping, plan_layer, LayerPlan};
use crate::copy::{copy_streaming, streaming_fence};
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
                let data = rows[row].take().expect("primary rows are distinct");
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
    let _rank = crate::log::rank_scope(g.rank());
    if old.len() != new.len() || old.len() != weights.len() {
        return Err(Error::InvalidArgument(format!(
            "old has {} layers, new {} and weights {}; expected the same number of layers",
            old.len(),
            new.len(),
            weights.len()
        )));
    }
    let mut summary = Summary::default();
    // The staging buffers (one layer of this rank's weights, like vLLM's expert_weights_buffer)
    // are kept per thread for the next rearrangement: allocating and zero-filling them on
    // every call cost more than the transfer itself.
    thread_local! {
        static STAGING: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut staging = STAGING.with(|s| std::mem::take(&mut *s.borrow_mut()));
    staging.resize_with(row_bytes.len(), Vec::new);
    let result = rearrange_layers(
        g,
        comm,
        old,
        new,
        weights,
        row_bytes,
        rank_mapping,
        &mut staging,
        &mut summary,
    );
    STAGING.with(|s| *s.borrow_mut() = staging);
    result.map(|()| summary)
}

#[allow(clippy::too_many_arguments)]
fn rearrange_layers(
    g: &mut dyn Group,
    comm: &mut dyn EplbCommunicator,
    old: &[Vec<i64>],
    new: &[Vec<i64>],
    weights: &mut [LayerWeights<'_>],
    row_bytes: &[usize],
    rank_mapping: Option<&[i64]>,
    staging: &mut [Vec<u8>],
    summary: &mut Summary,
) -> Result<()> {
    let me = g.rank();
    let world = g.size();
    for (l, ((o, n), w)) in old.iter().zip(new).zip(weights.iter_mut()).enumerate() {
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
        let plan = plan_layer(&o, &n, n_local, me)?;
        move_layer(g, comm, &plan, w, row_bytes, staging).map_err(|e| {
            let done = if l == 0 {
                "no layer was changed".to_owned()
            } else {
                format!(
                    "layers before {l} were rearranged; layer {l} and later keep the old placement"
                )
            };
            match e {
                Error::PeerFailure(m) => {
                    Error::PeerFailure(format!("{m} (EPLB rearrangement: {done})"))
                }
                Error::Timeout(m) => Error::Timeout(format!("{m} (EPLB rearrangement: {done})")),
                other => other,
            }
        })?;
        if !plan.is_noop() {
            summary.layers_changed += 1;
        }
        summary.rows_sent += plan.sends.len();
        summary.rows_received += plan.recvs.len() + plan.duplicates.len();
        summary.rows_copied_locally += plan.local_copies.len();
    }
    Ok(())
}
