#!/usr/bin/env bash
# bench-host.sh: epcomm over host transports against the same traffic written by hand with the
# same engine, on this machine's loopback, in the same run (alternating, medians), results
# compared byte for byte:
#   - torch.distributed/gloo: examples/python/bench_from_torch.py (Group.from_torch against
#     all_to_all_single);
#   - MPI over TCP (--mca btl tcp,self): benches/mpi_ep.c (examples/mpi's transport against
#     pack + MPI_Alltoallv + unpack, MPI_Alltoallv + f32 reduce).
# T = 1, 128, 1024, 4096 and R = 2, 4 by default (H=7168 bf16, top-8 of 256 experts). Prints
# Markdown tables (with the load average) and writes the plot of the ratios to --svg.
# scripts/bench-netns.sh runs the same across two network namespaces.
#
# usage: scripts/bench-host.sh [--tokens 1,128,1024,4096] [--ranks 2,4] [--iters 10] [--reps 5]
#                              [--threads 1] [--only gloo|mpi] [--svg docs/performance-host.svg]
# --threads: torch intra-op threads per gloo rank, both sides (default 1: one core per rank, as
# the MPI ranks have; 0 leaves torch's default).
# Environment: PYTHON (default python3; needs torch), EPCOMM_MPI_ALLTOALLV=0 / --send-recv-only
# are the "before" (no all_to_allv callback).
set -euo pipefail

TOKENS=1,128,1024,4096
RANKS=2,4
ITERS=10
REPS=5
THREADS=1
ONLY=""
SVG=""
say() { printf '%s\n' "bench-host: $*" >&2; }
die() { printf '%s\n' "bench-host: error: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --tokens) TOKENS="$2"; shift 2 ;;
        --ranks) RANKS="$2"; shift 2 ;;
        --iters) ITERS="$2"; shift 2 ;;
        --reps) REPS="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --only) ONLY="$2"; shift 2 ;;
        --svg) SVG="$2"; shift 2 ;;
        -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option '$1' (try --help)" ;;
    esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
say "building libepcomm (cargo build --release --lib)"
cargo build --release --lib >&2
LIB="$ROOT/target/release/libepcomm.so"
OUT="$(mktemp -t bench-host.XXXXXX)"
trap 'rm -f "$OUT"' EXIT
echo "Machine: $(nproc) CPUs, $(uname -sr); load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo

if [ "$ONLY" != mpi ]; then
    PYTHONPATH="$ROOT/python" EPCOMM_LIBRARY="$LIB" "$PYTHON" examples/python/bench_from_torch.py \
        --tokens "$TOKENS" --ranks "$RANKS" --iters "$ITERS" --reps "$REPS" --threads "$THREADS" | tee -a "$OUT"
    echo
fi
if [ "$ONLY" != gloo ]; then
    command -v mpicc >/dev/null && command -v mpirun >/dev/null || die "needs Open MPI (mpicc, mpirun)"
    mkdir -p target/mpi
    mpicc -O3 -march=native -std=c11 -Iinclude -Iexamples/mpi benches/mpi_ep.c -L"$ROOT/target/release" -lepcomm \
        -Wl,-rpath,"$ROOT/target/release" -o target/mpi/mpi_ep
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    IFS=, read -r -a WORLDS <<<"$RANKS"
    for world in "${WORLDS[@]}"; do
        bind=(--bind-to core --map-by core)
        # More ranks than cores: Open MPI's default busy polling makes a waiting rank spin on
        # the core a working rank needs (T=1, R=4 on 2 cores: 33.6 ms per iteration against
        # 0.61 ms yielding, on both sides alike), so waiting ranks yield, as Open MPI
        # recommends when oversubscribing.
        [ "$(nproc)" -ge "$world" ] || bind=(--oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
        mpirun "${bind[@]}" -np "$world" --mca pml ob1 --mca btl tcp,self \
            --mca btl_tcp_if_include lo target/mpi/mpi_ep --tokens "$TOKENS" --iters "$ITERS" \
            --reps "$REPS" | tee -a "$OUT"
        echo
    done
fi
echo "Load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ -n "$SVG" ]; then
    python3 scripts/plot-host-bench.py <"$OUT" >"$SVG"
    say "plot written to $SVG"
fi
