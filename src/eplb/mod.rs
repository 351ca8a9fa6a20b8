//! Expert-parallel load balancing (docs/design.md, section 7): the rebalancing policy, the transfer
//! plan, vLLM's migration scheduler (batches of transfers), the communicators that move expert
//! weights, and the rearrangement itself.

pub mod communicator;
pub mod load;
pub mod migration;
pub mod policy;
pub mod rearrange;
pub mod scale_down;
pub mod transfer;

pub use transfer::lost_experts;
