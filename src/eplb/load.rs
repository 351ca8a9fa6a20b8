//! Expert load statistics (vLLM's `EplbState` bookkeeping): tokens per physical expert recorded
//! over the last `window_size` steps before each rearrangement, a rearrangement every
//! `step_interval` steps (the first after a quarter interval), and the balancedness log line.

use crate::error::{Error, Result};
use crate::group::Group;
use crate::log;
use crate::select::config::EplbConfig;

/// Load bookkeeping for one model on one rank.
#[derive(Debug, Clone)]
pub struct LoadState {
    model: String,
    layers: usize,
    physical: usize,
    window_size: usize,
    step_interval: usize,
    log_interval: usize,
    log_balancedness: bool,
    /// This step's tokens per (layer, physical expert).
    pass: Vec<i64>,
    /// The last `window_size` recorded steps.
    window: Vec<Vec<i64>>,
    window_step: usize,
    /// Steps since the last rearrangement (vLLM's `expert_rearrangement_step`).
    step: usize,
}

/// The balancedness line vLLM logs (rank 0).
pub fn balancedness_line(
    step: usize,
    model: &str,
    avg: f64,
    max: i64,
    balancedness: f64,
    until: usize,
) -> String {
    format!(
        "EPLB step: {step} for model {model}: avg_tokens={avg:.2}, max_tokens={max}, balancedness={balancedness:.4}, steps until the next rearrangement: {until}"
    )
}

/// vLLM's `_compute_eplb_load_stats` over the summed pass (`layers x physical` slots, `world`
/// ranks): each layer's tokens per rank, then the sum over layers of the mean over ranks and the
/// sum over layers of the max over ranks, in float32 as vLLM's tensors are.
fn load_stats(total: &[i64], physical: usize, world: usize) -> (f64, f64) {
    let per_rank = physical / world.max(1);
    let (mut avg, mut max) = (0f32, 0f32);
    for layer in total.chunks(physical.max(1)) {
        let tokens: Vec<f32> = (0..world)
            .map(|r| layer[r * per_rank..(r + 1) * per_rank].iter().sum::<i64>() as f32)
            .collect();
        avg += tokens.iter().sum::<f32>() / world.max(1) as f32;
        max += tokens.iter().copied().fold(0f32, f32::max);
    }
    (f64::from(avg), f64::from(max))
}

fn all_reduce_sum(g: &mut dyn Group, v: &[i64]) -> Result<Vec<i64>> {
    let mine = crate::bytes::as_bytes(v);
    let mut all = vec![0u8; mine.len() * g.size()];
    g.all_gather(mine, &mut all)?;
    let mut sum = vec![0i64; v.len()];
    for chunk in all.chunks_exact(mine.len().max(1)) {
        for (s, x) in sum.iter_mut().zip(crate::bytes::words::<i64>(chunk)) {
            *s += x;
        }
    }
    Ok(sum)
}

impl LoadState {
    pub fn new(cfg: &EplbConfig, model: &str, layers: usize, physical: usize) -> Result<LoadState> {
        cfg.validate()?;
        if cfg.window_size <= 0 || cfg.step_interval <= 0 || cfg.log_balancedness_interval <= 0 {
            return Err(Error::InvalidArgument(format!(
                "window_size ({}), step_interval ({}) and log_balancedness_interval ({}) must be greater than 0",
                cfg.window_size, cfg.step_interval, cfg.log_balancedness_interval
            )));
        }
        if layers == 0 || physical == 0 {
            return Err(Error::InvalidArgument(format!(
                "num_layers ({layers}) and num_physical_experts ({physical}) must be greater than 0"
            )));
        }
        // The window holds window_size x layers x physical counters.
        let entries = (cfg.window_size as u128 + 1) * layers as u128 * physical as u128;
        if entries > 1 << 28 {
            return Err(Error::InvalidArgument(format!(
                "window_size ({}) x num_layers ({layers}) x num_physical_experts ({physical}) is too large: the load window would need {entries} counters (at most {})",
                cfg.window_size,
                1u64 << 28
            )));
        }
        let interval = cfg.step_interval as usize;
        Ok(LoadState {
            model: model.to_owned(),
            layers,
            physical,
            window_size: cfg.window_size as usize,
            step_interval: interval,
            log_interval: cfg.log_balancedness_interval as usize,
            log_balancedness: cfg.log_balancedness,
            pass: vec![0; layers * physical],
            window: vec![vec![0; layers * physical]; cfg.window_size as usize],
            window_step: 0,
            step: interval - interval / 4,
        })
    }

    /// Steps since the last rearrangement.
    pub fn step_count(&self) -> usize {
        self.step
    }

    /// Whether this step's load is part of the window (only the last `window_size` steps
    /// before a rearrangement are).
    pub fn recording(&self) -> bool {
        self.step_interval.saturating_sub(self.step) <= self.window_size
    }

    /// Adds per-physical-expert token counts of one layer to this step (ignored outside the
    /// recording window, as vLLM's router skips recording then).
    pub fn record_counts(&mut self, layer: usize, counts: &[u32]) -> Result<()> {
        if layer >= self.layers || counts.len() != self.physical {
            return Err(Error::InvalidArgument(format!(
                "load of layer {layer} with {} experts; expected a layer below {} and {} physical experts",
                counts.len(),
                self.layers,
                self.physical
            )));
        }
        if !self.recording() && !self.log_balancedness {
            return Ok(());
        }
        for (p, &c) in self.pass[layer * self.physical..(layer + 1) * self.physical]
            .iter_mut()
            .zip(counts)
        {
            *p += c as i64;
        }
        Ok(())
    }

    /// Counts each valid (non-negative) physical id once.
    pub fn record_ids(&mut self, layer: usize, ids: &[i64]) -> Result<()> {
        let mut counts = vec![0u32; self.physical];
        for &e in ids {
            if e >= 0 {
                let e = e as usize;
                if e >= self.physical {
                    return Err(Error::InvalidArgument(format!(
                        "expert id {e} is out of range: expected [0, {})",
                        self.physical
                    )));
                }
                counts[e] += 1;
            }
        }
        self.record_counts(layer, &counts)
    }

    /// Ends a forward step (collective on the EP group when logging). Returns true when the
    /// caller should rearrange now.
    pub fn step(&mut self, g: &mut dyn Group, is_dummy: bool, log_stats: bool) -> Result<bool> {
        if is_dummy {
            self.pass.fill(0);
        }
        if log_stats && self.log_balancedness && self.step.is_multiple_of(self.log_interval) {
            let total = all_reduce_sum(g, &self.pass)?;
            let (avg, max) = load_stats(&total, self.physical, g.size());
            let bal = if max > 0.0 { avg / max } else { 0.0 };
            let max = max as i64;
            if g.rank() == 0 {
                log::info(&balancedness_line(
                    self.step,
                    &self.model,
                    avg,
                    max,
                    bal,
                    self.step_interval.saturating_sub(self.step),
                ));
            }
        }
        if !is_dummy && self.recording() {
            self.window[self.window_step].copy_from_slice(&self.pass);
            self.window_step = (self.window_step + 1) % self.window_size;
        }
        self.pass.fill(0);
        self.step += 1;
        if self.step >= self.step_interval {
            self.step = 0;
            return Ok(true);
        }
        Ok(false)
    }

    /// The window's load per logical expert, summed over the window and all ranks (collective):
    /// `phy2log[l]` maps each physical slot to its logical expert (-1 = empty).
    pub fn logical_load(
        &self,
        g: &mut dyn Group,
        phy2log: &[Vec<i64>],
        logical: usize,
    ) -> Result<Vec<Vec<f32>>> {
        if phy2log.len() != self.layers || phy2log.iter().any(|r| r.len() != self.physical) {
            return Err(Error::InvalidArgument(format!(
                "phy2log must be {} layers of {} physical experts",
                self.layers, self.physical
            )));
        }
        let mut local = vec![0i64; self.layers * logical];
        for w in &self.window {
            for (l, row) in phy2log.iter().enumerate() {
                for (p, &e) in row.iter().enumerate() {
                    if e >= 0 {
                        if e as usize >= logical {
                            return Err(Error::InvalidArgument(format!(
                                "phy2log[{l}][{p}] = {e} is not a logical expert id below {logical}"
                            )));
                        }
                        local[l * logical + e as usize] += w[l * self.physical + p];
                    }
                }
            }
        }
        let total = all_reduce_sum(g, &local)?;
        Ok(total
            .chunks(logical)
            .map(|c| c.iter().map(|&x| x as f32).collect())
            .collect())
    }
}
