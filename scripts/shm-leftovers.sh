#!/usr/bin/env bash
# shm-leftovers.sh: the long versions of tests/shm_leftovers.rs, tests/shm_creation_kills.rs and
# tests/shm_identity.rs (docs/reliability.md). Three rank processes run multi-step collectives
# (regions growing) while one rank, or every rank once the group formed, is SIGKILLed,
# SIGTERMed or SIGINTed at a random moment; every run checks that nothing of the group is left
# in /dev/shm. Whole jobs (2-4 rank processes, unique ids and names) and `epcomm demo` are
# signalled (KILL, TERM, INT, HUP) at random moments of group creation; after the next epcomm
# process created a group, nothing of them may be left. Then two 2-rank jobs start at the same
# moment under one group name: never a mixed group. Last, the documented maximum of 1024 thread
# ranks in one process. CI runs 30 + 30 + 6 + 30 runs.
#
# usage: scripts/shm-leftovers.sh [RUNS [SEED]]     (defaults 300 and the clock; the demo is
#                                                   killed RUNS/4 times)
set -euo pipefail
cd "$(dirname "$0")/.."

export EPCOMM_LEFTOVER_RUNS="${1:-${EPCOMM_LEFTOVER_RUNS:-300}}"
export EPCOMM_IDENTITY_RUNS="${EPCOMM_IDENTITY_RUNS:-$EPCOMM_LEFTOVER_RUNS}"
export EPCOMM_CREATION_KILLS="${EPCOMM_CREATION_KILLS:-$EPCOMM_LEFTOVER_RUNS}"
export EPCOMM_CREATION_DEMO_KILLS="${EPCOMM_CREATION_DEMO_KILLS:-$((EPCOMM_LEFTOVER_RUNS / 4))}"
if [ -n "${2:-}" ]; then
    export EPCOMM_LEFTOVER_SEED="$2" EPCOMM_CREATION_SEED="$2"
fi
cargo test --release --test shm_leftovers --test shm_creation_kills --test shm_identity -- --include-ignored --nocapture --test-threads=1 2>&1 \
    | grep -E 'shm_(identity|leftovers|creation_kills): |^test result|panicked|FAILED|^error'
