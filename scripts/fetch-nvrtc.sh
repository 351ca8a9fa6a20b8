#!/usr/bin/env bash
# Fetches NVRTC from PyPI (the nvidia-cuda-nvrtc-cu12 wheel, ~88 MB) for the CPU-only kernel
# compile check (tests/gpu_kernels.rs) and prints the directory holding libnvrtc.so.12, which is
# what EPCOMM_NVRTC_PATH should be set to. No CUDA toolkit or GPU is needed.
#
#   EPCOMM_NVRTC_CACHE    cache directory (default ~/.cache/epcomm-nvrtc)
#   EPCOMM_NVRTC_VERSION  pip version spec (default 12.8.*)
#   EPCOMM_NVRTC_WHEEL    use this already-downloaded .whl instead of pip
#
# Nothing is downloaded when the cache already holds the unpacked library. Progress goes to
# stderr; stdout is only the directory. libnvrtc loads libnvrtc-builtins.so from its own
# directory (RUNPATH $ORIGIN, and epcomm's loader preloads it by full path), so no
# LD_LIBRARY_PATH is needed.
set -euo pipefail

version="${EPCOMM_NVRTC_VERSION:-12.8.*}"
cache="${EPCOMM_NVRTC_CACHE:-$HOME/.cache/epcomm-nvrtc}"
tag="cu12-${version//\*/x}"
dest="$cache/$tag"
libdir="$dest/nvidia/cuda_nvrtc/lib"

have_lib() { compgen -G "$libdir/libnvrtc.so.*" >/dev/null && compgen -G "$libdir/libnvrtc-builtins.so.*" >/dev/null; }

if ! have_lib; then
  mkdir -p "$cache/wheels"
  wheel="${EPCOMM_NVRTC_WHEEL:-}"
  if [ -z "$wheel" ]; then
    # A wheel left by an earlier run whose unpacking was interrupted.
    wheel="$(ls -1 "$cache"/wheels/nvidia_cuda_nvrtc_cu12-"${version//\*/}"*.whl 2>/dev/null | sort | tail -n 1 || true)"
  fi
  if [ -z "$wheel" ]; then
    echo "fetch-nvrtc: downloading nvidia-cuda-nvrtc-cu12==$version into $cache/wheels" >&2
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
      --platform manylinux2014_x86_64 --python-version 3.11 \
      -d "$cache/wheels" "nvidia-cuda-nvrtc-cu12==$version" >&2
    wheel="$(ls -1 "$cache"/wheels/nvidia_cuda_nvrtc_cu12-*.whl | sort | tail -n 1)"
  fi
  [ -f "$wheel" ] || { echo "fetch-nvrtc: no wheel at '$wheel'" >&2; exit 1; }
  echo "fetch-nvrtc: unpacking $(basename "$wheel")" >&2
  tmp="$(mktemp -d "$cache/.unpack.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  if command -v unzip >/dev/null 2>&1; then
    unzip -q -o "$wheel" 'nvidia/cuda_nvrtc/lib/*' -d "$tmp"
  else
    python3 -m zipfile -e "$wheel" "$tmp"
  fi
  # Publish the unpacked tree in one rename so a concurrent run never sees half of it.
  rm -rf "$dest"
  mv "$tmp" "$dest"
  trap - EXIT
  have_lib || { echo "fetch-nvrtc: $wheel has no libnvrtc.so.* under nvidia/cuda_nvrtc/lib" >&2; exit 1; }
fi

echo "$libdir"
