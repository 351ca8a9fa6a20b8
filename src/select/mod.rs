//! Pure selection logic: all2all backend names, EPLB communicator names, configuration checks.

pub mod all2all;
pub mod config;
pub mod eplb;
pub mod suggest;
pub mod hint;

pub use hint::Hint;
