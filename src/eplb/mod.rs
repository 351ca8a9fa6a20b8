//! Expert-parallel load balancing (SPEC §5): the rebalancing policy, the transfer plan, the
//! communicators that move expert weights, and the rearrangement itself.

pub mod communicator;
pub mod load;
pub mod policy;
pub mod rearrange;
pub mod transfer;
