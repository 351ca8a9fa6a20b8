#!/usr/bin/env bash
# bench-netns.sh: the host-transport benchmarks across a real network stack, as two hosts
# would run them: two network namespaces joined by a veth pair, each end shaped with tc netem
# (rate limit and one-way delay; where the kernel has no netem, tbf's rate limit alone, said so
# in the output), half the ranks in each namespace. Runs, in the same run and
# alternating per T, epcomm against the same traffic written by hand:
#   - torch.distributed/gloo: examples/python/bench_from_torch.py (one process per rank);
#   - MPI over TCP (--mca btl tcp,self): benches/mpi_ep.c (mpirun; each rank enters its
#     namespace through this script's --enter mode).
# Everything it creates (namespaces, veth, qdiscs) is removed on exit, also on failure.
#
# usage: sudo scripts/bench-netns.sh [--tokens 1,128,1024,4096] [--ranks 2,4] [--rate 10gbit]
#                                    [--delay 50us] [--iters 10] [--reps 5] [--threads 1]
#                                    [--only gloo|mpi]
# --threads: torch intra-op threads per gloo rank, both sides (default 1, as bench-host.sh).
# Environment: PYTHON (default python3; needs torch), EPCOMM_LIBRARY (default
# target/release/libepcomm.so, built when missing).
set -euo pipefail

NS_A=epcomm-bench-a
NS_B=epcomm-bench-b
VETH_A=epb-a
VETH_B=epb-b
ADDR_A=10.213.0.1
ADDR_B=10.213.0.2

# --agent HOST CMD...: Open MPI's launch agent (plm_rsh_agent, instead of ssh): runs its
# daemon's command in the namespace whose address is HOST.
if [ "${1:-}" = --agent ]; then
    if [ "$2" = "$ADDR_B" ]; then ns=$NS_B; else ns=$NS_A; fi
    shift 2
    exec ip netns exec "$ns" sh -c "$*"
fi

TOKENS=1,128,1024,4096
RANKS=2,4
RATE=10gbit
DELAY=50us
ITERS=10
REPS=5
THREADS=1
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
        --threads) THREADS="$2"; shift 2 ;;
        --only) ONLY="$2"; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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
SHAPE=""
for side in "A $NS_A $VETH_A $ADDR_A" "B $NS_B $VETH_B $ADDR_B"; do
    set -- $side
    ip -n "$2" link set lo up
    ip -n "$2" addr add "$4/24" dev "$3"
    ip -n "$2" link set "$3" up
    if ip netns exec "$2" tc qdisc add dev "$3" root netem delay "$DELAY" rate "$RATE" 2>/dev/null; then
        SHAPE="tc netem rate $RATE delay $DELAY on each end"
    else
        # Kernels without sch_netem (and no module to load) still have tbf: the rate limit
        # alone, said so in the output.
        ip netns exec "$2" tc qdisc add dev "$3" root tbf rate "$RATE" burst 1mb latency 10ms \
            || die "tc cannot shape $3 (neither netem nor tbf)"
        SHAPE="tc tbf rate $RATE on each end (no added delay: this kernel has no netem qdisc)"
    fi
done
# The round trip of a 1-byte TCP ping-pong across the pair (no ping in minimal images).
ip netns exec "$NS_B" python3 -c '
import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("'"$ADDR_B"'", 29399)); s.listen(1); c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(1)): c.sendall(b)' &
sleep 1
RTT="$(ip netns exec "$NS_A" python3 -c '
import socket, statistics, time; c = socket.create_connection(("'"$ADDR_B"'", 29399), timeout=5)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); t = []
for _ in range(200):
    s = time.perf_counter(); c.sendall(b"x"); c.recv(1); t.append(time.perf_counter() - s)
print(f"TCP round trip median {statistics.median(t) * 1e6:.0f} us")')" \
    || die "the veth pair does not carry packets"
wait
say "veth $VETH_A ($NS_A, $ADDR_A) <-> $VETH_B ($NS_B, $ADDR_B), $SHAPE; $RTT"
echo "Network: veth pair between two network namespaces, $SHAPE; $RTT"
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
                --iters "$ITERS" --reps "$REPS" --threads "$THREADS" &
            pids+=($!)
        done
        for p in "${pids[@]}"; do wait "$p" || die "a gloo rank failed"; done
        echo
    done
fi

if [ "$ONLY" != gloo ]; then
    command -v mpicc >/dev/null && command -v mpirun >/dev/null || die "needs Open MPI (mpicc, mpirun)"
    mkdir -p target/mpi
    mpicc -O3 -march=native -std=c11 -Iinclude -Iexamples/mpi benches/mpi_ep.c -L"$(dirname "$LIB")" -l:"$(basename "$LIB")" \
        -Wl,-rpath,"$(dirname "$LIB")" -o target/mpi/mpi_ep
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export EPCOMM_MPI_ALLTOALLV="${EPCOMM_MPI_ALLTOALLV:-1}"
    IFS=, read -r -a WORLDS <<<"$RANKS"
    for world in "${WORLDS[@]}"; do
        # Two "hosts", one per namespace, half the ranks on each: mpirun runs in A and starts
        # B's daemon through this script's --agent mode (as it would through ssh).
        half=$((world / 2))
        # More ranks than cores (both "hosts" share this machine's): waiting ranks yield
        # instead of spinning on the cores the working ones need (see bench-host.sh).
        yield=()
        [ "$(nproc)" -ge "$world" ] || yield=(--mca mpi_yield_when_idle 1)
        ip netns exec "$NS_A" mpirun --oversubscribe --bind-to none -np "$world" \
            --host "$ADDR_A:$half,$ADDR_B:$((world - half))" \
            --mca plm_rsh_agent "$ROOT/scripts/bench-netns.sh --agent" \
            --mca oob_tcp_if_include 10.213.0.0/24 "${yield[@]}" --mca pml ob1 --mca btl tcp,self \
            --mca btl_tcp_if_include 10.213.0.0/24 \
            -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM -x EPCOMM_MPI_ALLTOALLV \
            "$ROOT/target/mpi/mpi_ep" --tokens "$TOKENS" --iters "$ITERS" --reps "$REPS"
        echo
    done
fi
echo "Load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
