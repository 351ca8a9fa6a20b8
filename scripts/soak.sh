#!/usr/bin/env bash
# soak.sh: the long soak (docs/reliability.md). In one process, a 2-rank shared-memory
# group on two threads runs 10^5 dispatch/combine iterations (five layouts, changing token
# counts, every result checked against the reference) and 10^3 group + manager create/destroy
# cycles; prints VmRSS and open file descriptors after a warm-up and at the end, and fails if RSS
# grew by 16 MiB or more, if the descriptor count changed, or if anything of the soak's groups
# is left in /dev/shm. CI runs the short version (cargo test --test soak: 2000 and 100).
#
# usage: scripts/soak.sh [ITERS [CYCLES]]     (defaults 100000 and 1000; a release build)
set -euo pipefail
cd "$(dirname "$0")/.."

export EPCOMM_SOAK_ITERS="${1:-${EPCOMM_SOAK_ITERS:-100000}}"
export EPCOMM_SOAK_CYCLES="${2:-${EPCOMM_SOAK_CYCLES:-1000}}"
echo "soak: ${EPCOMM_SOAK_ITERS} dispatch/combine iterations, ${EPCOMM_SOAK_CYCLES} create/destroy cycles (release)" >&2
start=$(date +%s)
cargo test --release --test soak -- --nocapture --test-threads=1 2>&1 | grep -v '^Using .* all2all manager\.$'
echo "soak: done in $(( $(date +%s) - start )) s" >&2
