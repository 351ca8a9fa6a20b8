//! The EPLB test fixture shared by the rearrangement tests, the fault matrix, the EPLB decision
//! test and the fault campaign: synthetic expert weights whose bytes encode (expert, layer,
//! tensor, element), so a rank's weights after a rearrangement are checked byte for byte against
//! a placement; the placements and the communicator those tests use.

use epcomm::eplb::communicator::{self, EplbCommunicator};
use epcomm::eplb::policy::rebalance_experts;
use epcomm::select::eplb::DeviceKind;

/// Synthetic weights of `world` ranks: each layer has one tensor per entry of `row_bytes`, whose
/// rows (one per physical expert slot) are `row_bytes[t]` bytes.
#[derive(Debug, Clone, Copy)]
pub struct Weights<'a> {
    pub world: usize,
    pub row_bytes: &'a [usize],
}

impl Weights<'_> {
    /// The bytes of expert `e`'s row of tensor `t` in layer `l`; an empty slot (`e < 0`) is all
    /// 0xAB.
    pub fn row(&self, e: i64, l: usize, t: usize) -> Vec<u8> {
        (0..self.row_bytes[t])
            .map(|i| {
                if e < 0 {
                    0xAB
                } else {
                    (e as usize * 31 + l * 7 + t * 3 + i) as u8
                }
            })
            .collect()
    }

    /// Rank `rank`'s tensors of layer `l` under placement `map`: tensor t holds the rows of the
    /// rank's slots in slot order.
    pub fn layer(&self, map: &[i64], l: usize, rank: usize) -> Vec<Vec<u8>> {
        let n_local = map.len() / self.world;
        (0..self.row_bytes.len())
            .map(|t| {
                map[rank * n_local..(rank + 1) * n_local]
                    .iter()
                    .flat_map(|&e| self.row(e, l, t))
                    .collect()
            })
            .collect()
    }

    /// Rank `rank`'s tensors of every layer of `maps`: weights[l][t].
    pub fn all(&self, maps: &[Vec<i64>], rank: usize) -> Vec<Vec<Vec<u8>>> {
        maps.iter()
            .enumerate()
            .map(|(l, map)| self.layer(map, l, rank))
            .collect()
    }

    /// Per layer of `w`: N = the new placement's bytes, O = the old one's, B = both (the layer
    /// does not change on this rank), X = anything else.
    pub fn pattern(
        &self,
        w: &[Vec<Vec<u8>>],
        old: &[Vec<i64>],
        new: &[Vec<i64>],
        rank: usize,
    ) -> String {
        w.iter()
            .enumerate()
            .map(|(l, layer)| {
                let is_new = *layer == self.layer(&new[l], l, rank);
                let is_old = *layer == self.layer(&old[l], l, rank);
                match (is_new, is_old) {
                    (true, true) => 'B',
                    (true, false) => 'N',
                    (false, true) => 'O',
                    (false, false) => 'X',
                }
            })
            .collect()
    }
}

/// Mutable views of weights[l][t], as `rearrange` takes them.
pub fn views(w: &mut [Vec<Vec<u8>>]) -> Vec<Vec<&mut [u8]>> {
    w.iter_mut()
        .map(|l| l.iter_mut().map(|t| t.as_mut_slice()).collect())
        .collect()
}

/// `layers` layers of `physical` slots holding logical expert `slot % logical`.
pub fn modulo_placement(layers: usize, physical: usize, logical: usize) -> Vec<Vec<i64>> {
    (0..layers)
        .map(|_| (0..physical).map(|i| (i % logical) as i64).collect())
        .collect()
}

/// A skewed load per (layer, logical expert): `((e * 37 + l * 11 + 5 * seed) % 23) * 10 + floor`.
pub fn skewed_load(layers: usize, logical: usize, seed: usize, floor: f32) -> Vec<Vec<f32>> {
    (0..layers)
        .map(|l| {
            (0..logical)
                .map(|e| ((e * 37 + l * 11 + seed * 5) % 23) as f32 * 10.0 + floor)
                .collect()
        })
        .collect()
}

/// vLLM's rebalancing policy for `load[layer][logical expert]` over `physical` slots of `world`
/// ranks (one group, one node).
pub fn rebalanced(load: &[Vec<f32>], physical: usize, world: usize) -> Vec<Vec<i64>> {
    rebalance_experts(load, physical, 1, 1, world, None)
        .unwrap()
        .into_iter()
        .map(|r| r.into_iter().map(|x| x as i64).collect())
        .collect()
}

/// The `torch_gloo` communicator on CPU, as the factory makes it.
pub fn gloo_cpu() -> epcomm::Result<Box<dyn EplbCommunicator>> {
    communicator::create(
        Some("torch_gloo"),
        false,
        DeviceKind::Cpu,
        &[],
        false,
        false,
    )
}

/// Passes of `eplb:before_staging` (one per layer) in this process.
static PASSES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A fault hook (`epcomm::fault::set_hook`): the calling (child) process kills itself at its
/// second `eplb:before_staging`, i.e. before layer 1's transfer.
#[allow(dead_code)] // not every test binary that includes the fixture kills a rank
pub fn kill_before_layer_1(name: &str) {
    let n = PASSES.fetch_add(
        usize::from(name == "eplb:before_staging"),
        std::sync::atomic::Ordering::Relaxed,
    );
    if name == "eplb:before_staging" && n == 1 {
        // SAFETY: raising a signal on this (child) process.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}
