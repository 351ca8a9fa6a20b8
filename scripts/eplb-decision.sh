#!/usr/bin/env bash
# eplb-decision.sh: the long version of tests/eplb_decision.rs (docs/reliability.md). Three
# rank processes rearrange 24 EPLB layers while one rank is SIGSTOPped (past the timeout, then
# resumed) or SIGKILLed at a random moment; every run checks that all live ranks reach the same
# outcome (all OK with every layer new, or all failing with the same last rearranged layer and
# weights to match), and that every error blames the victim and how it failed. CI runs 30 runs.
#
# usage: scripts/eplb-decision.sh [RUNS [SEED]]     (defaults 200 and the clock)
set -euo pipefail
cd "$(dirname "$0")/.."

export EPLB_DECISION_RUNS="${1:-${EPLB_DECISION_RUNS:-200}}"
if [ -n "${2:-}" ]; then export EPLB_DECISION_SEED="$2"; fi
cargo test --test eplb_decision -- --nocapture --test-threads=1 2>&1 | grep -E '^eplb_decision|^test result|panicked|FAILED'
