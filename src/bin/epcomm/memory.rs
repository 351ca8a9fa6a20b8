//! Whether a benchmark case fits in this machine's memory, checked before the case starts so a
//! case that does not fit is refused with one line instead of failing (or waking the
//! out-of-memory killer) half-way.

/// Whether the shared-memory group stages data in its shared regions: the ranks' contributions
/// are then copied there too (memory-backed segments, charged to the machine's memory). By
/// default (direct mode) peers read each other's buffers in place.
pub fn region_mode() -> bool {
    !epcomm::env::shm_direct()
}

/// `bytes` with a decimal unit, e.g. `15.0 GB`.
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.1} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.1} kB", b / 1e3)
    }
}

/// What one case needs on each rank: process memory, and (in region mode) its shared region.
pub struct Need {
    /// Bytes of memory per rank, all buffers of the case at its peak.
    pub memory: u64,
    /// Bytes per rank of the shared region when the group stages data there.
    pub shm: u64,
    /// What `memory` is made of, for the refusal line: (bytes, what), adding up to `memory`
    /// (empty: the line gives the total only).
    pub parts: Vec<(u64, String)>,
}

/// `None` when `ranks` ranks of `need` (with the shared region in region mode) fit in
/// MemAvailable; otherwise the one line that refuses `what`, naming the options in `shrink`.
/// The figures it names add up: the parts to the bytes per rank, which times the ranks is the
/// total compared with MemAvailable.
pub fn refusal(what: &str, need: &Need, ranks: usize, shrink: &str) -> Option<String> {
    let n = ranks as u64;
    let shm = if region_mode() { need.shm } else { 0 };
    let per_rank = need.memory.saturating_add(shm);
    let mut parts: Vec<String> = need
        .parts
        .iter()
        .map(|(b, w)| format!("{} {w}", human(*b)))
        .collect();
    if shm > 0 && !parts.is_empty() {
        parts.push(format!(
            "{} the shared region (EPCOMM_SHM_DIRECT=0)",
            human(shm)
        ));
    }
    let detail = if parts.is_empty() {
        String::new()
    } else {
        format!(": {}", parts.join(" + "))
    };
    if let Some(avail) = epcomm::probe::available_memory() {
        let total = per_rank.saturating_mul(n);
        if total > avail {
            return Some(format!(
                "refused {what}: needs {per_rank} bytes per rank ({}{detail}) x {ranks} ranks = {} in all, more than the {} available (MemAvailable); lower {shrink}",
                human(per_rank),
                human(total),
                human(avail)
            ));
        }
    }
    None
}
