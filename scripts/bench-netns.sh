#!/usr/bin/env bash
# bench-netns.sh: the host-transport benchmarks across a real network stack, as two hosts
# would run them: two network namespaces joined by a veth pair, each end shaped with tc netem
# (rate limit and one-way delay), half the ranks in each namespace. Runs, in the same run and
# alternating per T, epcomm against the same traffic written by hand:
#   - torch.distributed/gloo: examples/python/bench_from_torch.py (one process per rank);
#   - MPI over TCP (--mca btl tcp,self): benches/mpi_ep.c (mpirun; each rank enters its
#     namespace through this script's --enter mode).
# Everything it creates (namespaces, veth, qdiscs) is removed on exit, also on failure.
#
# usage: sudo scripts/bench-netns.sh [--tokens 1,128,1024,4096] [--ranks 2,4] [--rate 10gbit]
#                                    [--delay 50us] [--iters 10] [--reps 5] [--only gloo|mpi]
# Environment: PYTHON (default python3; needs torch), EPCOMM_LIBRARY (default
# target/release/libepcomm.so, built when missing).
set -euo pipefail

NS_A=epcomm-bench-a
NS_B=epcomm-bench-b
VETH_A=epb-a
VETH_B=epb-b
ADDR_A=10.213.0.1
ADDR_B=10.213.0.2

# --enter -- CMD...: run CMD in this MPI rank's namespace (the first half of the ranks in A).
if [ "${1:-}" = --enter ]; then
    rank="${OMPI_COMM_WORLD_RANK:?not under mpirun}"
    world="${OMPI_COMM_WORLD_SIZE:?not under mpirun}"
    if [ $((rank * 2 / world)) = 0 ]; then ns=$NS_A; else ns=$NS_B; fi
    shift 2
    exec ip netns exec "$ns" "$@"
fi

TOKENS=1,128,1024,4096
RANKS=2,4
RATE=10gbit
DELAY=50us
ITERS=10
REPS=5
ONLY=""
say() { printf '%s\n' "bench-netns: $*" >&2; }
die() { printf '%s\n' "bench-netns: error: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
    case "$1" in
        --tokens) TOKENS="$2"; shift 2 ;;
        --ranks) RANKS="$2"; shift 2 ;;
        --rate) RATE="$2"; shift 2 ;;
        --delay) DELAY="$2"; shift 2 ;;
        --iters) ITERS="$2"; shift 2 ;;
        --reps) REPS="$2"; shift 2 ;;
        --only) ONLY="$2"; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option '$1' (try --help)" ;;
    esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[ "$(id -u)" = 0 ] || die "needs root (ip netns, tc)"
command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (ip, tc)"
PYTHON="${PYTHON:-python3}"
LIB="${EPCOMM_LIBRARY:-$ROOT/target/release/libepcomm.so}"
if [ ! -f "$LIB" ]; then
    say "building libepcomm (cargo build --release --lib)"
    cargo build --release --lib >&2
fi

cleanup() {
    ip netns del "$NS_A" 2>/dev/null || true
    ip netns del "$NS_B" 2>/dev/null || true
}
trap cleanup EXIT
cleanup
ip netns add "$NS_A" || die "ip netns add failed (no CAP_SYS_ADMIN in this container?)"
ip netns add "$NS_B"
ip link add "$VETH_A" netns "$NS_A" type veth peer name "$VETH_B" netns "$NS_B"
for side in "A $NS_A $VETH_A $ADDR_A" "B $NS_B $VETH_B $ADDR_B"; do
    set -- $side
    ip -n "$2" link set lo up
    ip -n "$2" addr add "$4/24" dev "$3"
    ip -n "$2" link set "$3" up
    ip netns exec "$2" tc qdisc add dev "$3" root netem delay "$DELAY" rate "$RATE"
done
ip netns exec "$NS_A" ping -c 1 -W 2 "$ADDR_B" >/dev/null || die "the veth pair does not carry packets"
RTT="$(ip netns exec "$NS_A" ping -c 5 -i 0.2 -q "$ADDR_B" | tail -1)"
say "veth $VETH_A ($NS_A, $ADDR_A) <-> $VETH_B ($NS_B, $ADDR_B), netem rate $RATE delay $DELAY each way; ping: $RTT"
echo "Network: veth pair between two network namespaces, tc netem rate $RATE delay $DELAY on each end; ping $RTT"
echo "Load average before: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) CPUs"
echo

if [ "$ONLY" != mpi ]; then
    IFS=, read -r -a WORLDS <<<"$RANKS"
    for world in "${WORLDS[@]}"; do
        port=$((29500 + RANDOM % 1000))
        pids=()
        for ((r = world - 1; r >= 0; r--)); do
            if [ $((r * 2 / world)) = 0 ]; then ns=$NS_A; dev=$VETH_A; else ns=$NS_B; dev=$VETH_B; fi
            ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$dev" PYTHONPATH="$ROOT/python" \
                EPCOMM_LIBRARY="$LIB" "$PYTHON" examples/python/bench_from_torch.py \
                --rank "$r" --world "$world" --master "$ADDR_A:$port" --tokens "$TOKENS" \
                --iters "$ITERS" --reps "$REPS" &
            pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || die "a gloo rank failed"; done
        echo
    done
fi

if [ "$ONLY" != gloo ]; then
    command -v mpicc >/dev/null && command -v mpirun >/dev/null || die "needs Open MPI (mpicc, mpirun)"
    mkdir -p target/mpi
    mpicc -O2 -std=c11 -Iinclude -Iexamples/mpi benches/mpi_ep.c -L"$(dirname "$LIB")" -lepcomm \
        -Wl,-rpath,"$(dirname "$LIB")" -o target/mpi/mpi_ep
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    IFS=, read -r -a WORLDS <<<"$RANKS"
    for world in "${WORLDS[@]}"; do
        mpirun --oversubscribe --bind-to none -np "$world" --mca pml ob1 --mca btl tcp,self \
            --mca btl_tcp_if_include 10.213.0.0/24 \
            "$ROOT/scripts/bench-netns.sh" --enter -- "$ROOT/target/mpi/mpi_ep" \
            --tokens "$TOKENS" --iters "$ITERS" --reps "$REPS"
        echo
    done
fi
echo "Load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
