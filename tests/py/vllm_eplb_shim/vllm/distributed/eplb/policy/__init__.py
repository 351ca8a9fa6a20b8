"""A stand-in for `vllm.distributed.eplb.policy` (see the shim's README.md)."""

from .default import DefaultEplbPolicy

__all__ = ["DefaultEplbPolicy"]
