#!/usr/bin/env bash
# ft-campaign.sh: the long versions of the fault-tolerance campaigns (docs/reliability.md,
# "Fault tolerance").
#
# Single faults (tests/moe_ft.rs): four rank processes run 30 dispatch/combine steps of
# deepep_low_latency with fault tolerance on; at a random moment one random rank is SIGKILLed
# (even runs) or SIGSTOPped past the 1 s timeout and resumed (odd runs). Every run checks that
# no rank hangs, every survivor reports the same outcome for every step and the same final mask
# (the victim only), exactly one step failed, every other step's output equals the float32
# reference with the masked rank's experts left out (1e-5 relative) and its dropped-pair count
# is exact, the stopped rank never completes a call after it was masked, and nothing is left in
# /dev/shm. CI runs 8.
#
# Two faults at once (--overlap, tests/ft_overlap.rs): a SIGKILL and a SIGSTOP at the same
# moment, or two SIGSTOPs 5-80 ms apart (short stalls or long), each rank retrying a failed
# step after clean_buffers as vLLM's sentinel does; the rules are in that file's doc. CI runs 30.
#
# usage: scripts/ft-campaign.sh [--overlap] [RUNS [SEED]]
#        (default 100 runs, 200 with --overlap; SEED defaults to the clock)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--overlap" ]; then
    shift
    export EPCOMM_FT_OVERLAP_RUNS="${1:-200}"
    export EPCOMM_FT_SEED="${2:-$(date +%s)}"
    cargo test --test ft_overlap -- overlap_campaign_sample --nocapture --test-threads=1 2>&1 |
        grep -E '^ft overlap campaign|^test result|panicked|violations|FAILED|^(healthy|rank|masked|left|step) '
    exit "${PIPESTATUS[0]}"
fi
export EPCOMM_FT_RUNS="${1:-100}"
export EPCOMM_FT_SEED="${2:-$(date +%s)}"
cargo test --test moe_ft -- ft_campaign_sample --nocapture --test-threads=1 2>&1 |
    grep -E '^ft campaign|ft campaign:|^test result|panicked|violations|FAILED'
