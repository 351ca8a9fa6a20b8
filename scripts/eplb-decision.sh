#!/usr/bin/env bash
# eplb-decision.sh: the long version of tests/eplb_decision.rs (docs/reliability.md). Three
# rank processes rearrange 24 EPLB layers while one rank is SIGSTOPped (past the timeout, then
# resumed) or SIGKILLed at a random moment; every run checks that all live ranks reach the same
# outcome (all OK with every layer new, or all failing with the same last rearranged layer and
# weights to match), and that every error blames the victim and how it failed. CI runs 30 runs.
# The batched runs: four ranks rearrange with migration batching while one rank is killed,
# stopped, or one of each, between two batches (the fault point eplb:between_batches); every
# live rank must fail alike at the same layer. CI runs 6.
#
# usage: scripts/eplb-decision.sh [--batched|--unbatched] [RUNS [SEED]]
#   RUNS (default 200) runs of each campaign; --batched runs only the batched one,
#   --unbatched only the 3-rank one; SEED defaults to the clock.
set -euo pipefail
cd "$(dirname "$0")/.."

which=both
case "${1:-}" in
--batched | --unbatched)
    which="${1#--}"
    shift
    ;;
esac
runs="${1:-${EPLB_DECISION_RUNS:-200}}"
if [ -n "${2:-}" ]; then export EPLB_DECISION_SEED="$2"; fi
filter=()
case "$which" in
both) export EPLB_DECISION_RUNS="$runs" EPLB_DECISION_BATCHED_RUNS="$runs" ;;
batched) export EPLB_DECISION_BATCHED_RUNS="$runs" && filter=(batched_rearrangement) ;;
unbatched) export EPLB_DECISION_RUNS="$runs" && filter=(every_rank_reaches) ;;
esac
cargo test --test eplb_decision -- "${filter[@]}" --nocapture --test-threads=1 2>&1 |
    grep -E 'eplb_decision|^test result|panicked|FAILED'
