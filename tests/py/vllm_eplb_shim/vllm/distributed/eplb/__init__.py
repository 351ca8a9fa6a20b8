"""A stand-in for `vllm.distributed.eplb` (see the shim's README.md)."""
