#!/usr/bin/env bash
# ft-campaign.sh: the long version of tests/moe_ft.rs's campaign (docs/reliability.md, "Fault
# tolerance"). Four rank processes run 30 dispatch/combine steps of deepep_low_latency with
# fault tolerance on; at a random moment one random rank is SIGKILLed (even runs) or SIGSTOPped
# past the 1 s timeout and resumed (odd runs). Every run checks that no rank hangs, every
# survivor reports the same outcome for every step and the same final mask (the victim only),
# exactly one step failed, every other step's output equals the float32 reference with the
# masked rank's experts left out (1e-5 relative) and its dropped-pair count is exact, the
# stopped rank never completes a call after it was masked, and nothing is left in /dev/shm.
# CI runs 8.
#
# usage: scripts/ft-campaign.sh [RUNS [SEED]]   (default 100 runs; SEED defaults to the clock)
set -euo pipefail
cd "$(dirname "$0")/.."
export EPCOMM_FT_RUNS="${1:-100}"
export EPCOMM_FT_SEED="${2:-$(date +%s)}"
cargo test --test moe_ft -- ft_campaign_sample --nocapture --test-threads=1 2>&1 |
    grep -E '^ft campaign|ft campaign:|^test result|panicked|violations|FAILED'
