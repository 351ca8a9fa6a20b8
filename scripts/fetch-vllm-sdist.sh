#!/usr/bin/env bash
# Fetches one vLLM release's source tree (its sdist from PyPI, tests/ included) and prints the
# tree's path: the reference epcomm's names, messages and algorithms are read from, and where
# tests/eplb_vllm_algo.rs takes vLLM's unmodified tests/distributed/test_eplb_algo.py.
#   usage: scripts/fetch-vllm-sdist.sh VERSION [DIR]     (DIR defaults to ./vllm-src)
# An existing DIR/vllm-VERSION is reused. `pip download --no-binary :all:` alone fails: pip
# prepares the sdist's metadata and vLLM's setup.py imports torch. So pip runs without build
# isolation in a scratch venv, with a stand-in `torch` that answers only setup.py's version
# probes, and VLLM_TARGET_DEVICE=empty. Without an sdist (some releases) it exits non-zero.
set -euo pipefail
ver=${1:?usage: fetch-vllm-sdist.sh VERSION [DIR]}
dir=${2:-vllm-src}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [ -d "$dir/vllm-$ver/vllm" ]; then
  echo "$dir/vllm-$ver"
  exit 0
fi
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m venv "$work/venv" >/dev/null
pip="$work/venv/bin/pip"
"$pip" install -q --disable-pip-version-check "setuptools>=77.0.3,<81" "setuptools-scm>=8" \
  "setuptools-rust>=1.9.0" "packaging>=24.2" wheel jinja2 >/dev/null
stub="$work/stub"
mkdir -p "$stub/torch/utils"
cat >"$stub/torch/__init__.py" <<'PY'
import types
__version__ = "0+stub"
version = types.SimpleNamespace(cuda=None, hip=None, xpu=None)
PY
: >"$stub/torch/utils/__init__.py"
printf 'CUDA_HOME = None\nROCM_HOME = None\n' >"$stub/torch/utils/cpp_extension.py"
if ! PYTHONPATH="$stub" VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1 \
  "$pip" download -q --disable-pip-version-check "vllm==$ver" --no-deps --no-binary :all: \
  --no-build-isolation -d "$work/dl" >"$work/log" 2>&1; then
  echo "no usable sdist of vllm $ver: $(tail -1 "$work/log")" >&2
  exit 1
fi
# Unpacked beside its final place, then renamed, so a stopped run leaves no half tree behind.
mkdir -p "$work/tree"
tar -xzf "$work"/dl/vllm-*.tar.gz -C "$work/tree"
rm -rf "$dir/vllm-$ver.partial"
mv "$work/tree/vllm-$ver" "$dir/vllm-$ver.partial"
mv "$dir/vllm-$ver.partial" "$dir/vllm-$ver"
echo "$dir/vllm-$ver"
