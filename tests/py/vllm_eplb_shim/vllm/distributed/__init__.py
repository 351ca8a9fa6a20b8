"""A stand-in for `vllm.distributed` (see the shim's README.md)."""
