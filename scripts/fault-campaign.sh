#!/usr/bin/env bash
# fault-campaign.sh: the long fault/tamper campaign (docs/reliability.md, "Fault campaign").
# Runs RUNS runs per class of tests/fault_campaign.rs (3-rank multi-step workloads in real
# processes; one rank SIGKILLed, SIGSTOPped past the timeout, SIGTERMed or SIGINTed at a random
# moment; two jobs with one group name; the group's /dev/shm segments overwritten or truncated)
# and prints the summary table (class, runs, hit, crashes, hangs, leftovers, silent_wrong,
# divergent, misblamed, mixed_groups). Exits non-zero when any rule was broken in any class
# (EPCOMM_CAMPAIGN_STRICT=1: the rules the CI test lists as expected to fail count too).
# CI runs the short version: EPCOMM_TEST_FULL=1 cargo test --test fault_campaign (40 runs per
# class; a plain cargo test runs 20).
#
# usage: scripts/fault-campaign.sh [RUNS [CLASSES]]
#   RUNS     runs per class (default 500; or EPCOMM_CAMPAIGN_RUNS)
#   CLASSES  comma-separated: moe,eplb,collectives,same_name,tamper (default all; or
#            EPCOMM_CAMPAIGN_CLASSES)
#   EPCOMM_CAMPAIGN_FAULTS=KILL,STOP (any of KILL, STOP, TERM, INT) limits the signals drawn;
#   EPCOMM_CAMPAIGN_TIMEOUT_S=N sets the ranks' timeout (default 1 s);
#   EPCOMM_CAMPAIGN_SEED=N repeats a campaign; EPCOMM_CAMPAIGN_VERBOSE=1 prints one line per
#   signal run; EPCOMM_CAMPAIGN_RELEASE=1 uses a release build.
# e.g. the EPLB figure over stalls and kills: EPCOMM_CAMPAIGN_FAULTS=KILL,STOP scripts/fault-campaign.sh 200 eplb
set -euo pipefail
cd "$(dirname "$0")/.."

export EPCOMM_CAMPAIGN_RUNS="${1:-${EPCOMM_CAMPAIGN_RUNS:-500}}"
export EPCOMM_CAMPAIGN_CLASSES="${2:-${EPCOMM_CAMPAIGN_CLASSES:-}}"
export EPCOMM_CAMPAIGN_STRICT=1
profile=()
if [ "${EPCOMM_CAMPAIGN_RELEASE:-0}" != 0 ]; then
    profile=(--release)
fi
echo "fault-campaign: ${EPCOMM_CAMPAIGN_RUNS} runs per class, classes ${EPCOMM_CAMPAIGN_CLASSES:-all}" >&2
start=$(date +%s)
status=0
cargo test "${profile[@]}" --test fault_campaign -- --exact fault_campaign || status=$?
echo "fault-campaign: done in $(( $(date +%s) - start )) s (exit status ${status})" >&2
exit "$status"
