//! One colour per backend, the same in every chart (a fixed palette keyed by the backend, not
//! by a series' position), and one marker per rank count.

use epcomm::select::all2all::{self, Backend};

use crate::plot::Marker;

/// The colour of memcpy's reference lines.
pub const MEMCPY: &str = "#000000";

/// The colour of `backend` (every backend its own).
pub fn backend_color(backend: Backend) -> &'static str {
    match backend {
        Backend::AllgatherReducescatter => "#1f77b4",
        Backend::DeepepHighThroughput => "#d62728",
        Backend::DeepepLowLatency => "#2ca02c",
        Backend::DeepepV2 => "#9467bd",
        Backend::MoriHighThroughput => "#ff7f0e",
        Backend::MoriLowLatency => "#8c564b",
        Backend::NixlEp => "#e377c2",
        Backend::FlashinferNvlinkTwoSided => "#17becf",
        Backend::FlashinferNvlinkOneSided => "#bcbd22",
        Backend::Moonep => "#7f7f7f",
        Backend::Mori => "#393b79",
    }
}

/// The colour of a backend name as the bench prints it (aliases take their backend's; a
/// name that does not resolve is grey).
pub fn color(name: &str) -> &'static str {
    all2all::resolve_quiet(name).map_or("#7f7f7f", |r| backend_color(r.backend))
}

/// The marker of the `i`-th rank count of a sweep.
pub fn marker(i: usize) -> Marker {
    [
        Marker::Circle,
        Marker::Square,
        Marker::Triangle,
        Marker::Diamond,
    ][i % 4]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_backend_has_its_own_colour() {
        let mut seen: Vec<&str> = Backend::ALL.iter().map(|&b| backend_color(b)).collect();
        seen.push(MEMCPY);
        let n = seen.len();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), n, "a colour used twice");
        assert_eq!(
            color("flashinfer_all2allv"),
            color("flashinfer_nvlink_two_sided")
        );
    }
}
