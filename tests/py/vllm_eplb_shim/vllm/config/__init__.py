"""A stand-in for `vllm.config` (see the shim's README.md)."""
