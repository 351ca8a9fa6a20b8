//! Pure selection logic: all2all backend names, EPLB communicator names, configuration checks.

pub mod all2all;
pub mod config;
pub mod eplb;
pub mod hint;
pub mod pydantic;
pub mod suggest;
pub mod versions;

pub use hint::Hint;
