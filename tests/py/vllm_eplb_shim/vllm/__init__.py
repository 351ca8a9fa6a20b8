"""A stand-in for vLLM's package: only the modules vLLM's EPLB tests import (see README.md)."""
