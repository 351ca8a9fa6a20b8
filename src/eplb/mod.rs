//! Expert-parallel load balancing (SPEC §5): the rebalancing policy. (Transfer plans,
//! communicators and the load state are tracked in the EPLB issue.)

pub mod policy;
