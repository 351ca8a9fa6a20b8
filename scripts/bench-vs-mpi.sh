#!/usr/bin/env bash
# bench-vs-mpi.sh: epcomm dispatch+combine against Open MPI's MPI_Alltoallv (transport only, on
# pre-packed buffers) and against a memcpy of the same bytes, for the DeepSeek-V3 shape
# (H=7168 bf16, E=256, K=8), R=2 ranks pinned one per core, T in {128, 4096}, uniform routing.
# Then the EPLB policy time. Targets: docs/design.md, section 8; method and results: docs/performance.md.
#
# usage: scripts/bench-vs-mpi.sh [--iters N] [--warmup N] [--routing uniform|skewed|top2]
#                                [--out DIR] [--no-install]
#   --out DIR      keep the raw JSON there (default: a temporary directory, removed at exit)
#   --no-install   never run apt-get; fail if mpicc/mpirun are missing
# Environment: EPCOMM_BENCH_BACKENDS overrides the backend list (comma separated).
set -euo pipefail

ITERS=50
WARMUP=5
ROUTING=uniform
OUT=""
INSTALL=1
RANKS=2
TOKENS=(128 4096)
HIDDEN=7168
EXPERTS=256
TOPK=8
DTYPE=bf16
DTYPE_BYTES=2
BACKENDS="${EPCOMM_BENCH_BACKENDS:-deepep_high_throughput,deepep_low_latency,allgather_reducescatter,flashinfer_nvlink_two_sided}"

say() { printf '%s\n' "bench-vs-mpi: $*" >&2; }
die() { printf '%s\n' "bench-vs-mpi: error: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --iters) [ $# -ge 2 ] || die "--iters needs a value"; ITERS="$2"; shift 2 ;;
        --warmup) [ $# -ge 2 ] || die "--warmup needs a value"; WARMUP="$2"; shift 2 ;;
        --routing) [ $# -ge 2 ] || die "--routing needs a value"; ROUTING="$2"; shift 2 ;;
        --out) [ $# -ge 2 ] || die "--out needs a value"; OUT="$2"; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option '$1' (try --help)" ;;
    esac
done
case "$ITERS$WARMUP" in *[!0-9]*|"") die "--iters and --warmup need non-negative integers" ;; esac
[ "$ITERS" -ge 1 ] || die "--iters must be at least 1"
case "$ROUTING" in uniform|skewed|top2) ;; *) die "--routing $ROUTING: expected uniform, skewed or top2" ;; esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[ -f Cargo.toml ] && [ -f benches/mpi_alltoallv.c ] || die "run from the epcomm repository (no Cargo.toml or benches/mpi_alltoallv.c under $ROOT)"

if [ -z "$OUT" ]; then
    OUT="$(mktemp -d -t bench-vs-mpi.XXXXXX)"
    trap 'rm -rf "$OUT"' EXIT
else
    mkdir -p "$OUT" || die "cannot create --out directory $OUT"
fi

# Open MPI refuses to run as root without these.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Keep Open MPI's shared-memory transport and its single-copy (CMA) path, the default; say so.
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-cma}"

# (a) tools --------------------------------------------------------------------------------
command -v python3 >/dev/null || die "python3 is needed to read the JSON results"
command -v cargo >/dev/null || die "cargo is needed to build epcomm (install Rust: https://rustup.rs)"
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
    [ "$INSTALL" = 1 ] || die "mpicc/mpirun not found (install libopenmpi-dev and openmpi-bin)"
    command -v apt-get >/dev/null || die "mpicc/mpirun not found and no apt-get here: install Open MPI (libopenmpi-dev, openmpi-bin) by hand"
    SUDO=""
    if [ "$(id -u)" != 0 ]; then
        command -v sudo >/dev/null || die "mpicc/mpirun not found; installing needs root (or sudo)"
        SUDO=sudo
    fi
    say "installing Open MPI (libopenmpi-dev openmpi-bin) with apt-get"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q >"$OUT/apt.log" 2>&1 \
        || { tail -20 "$OUT/apt.log" >&2; die "apt-get update failed (log above)"; }
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenmpi-dev openmpi-bin >>"$OUT/apt.log" 2>&1 \
        || { tail -20 "$OUT/apt.log" >&2; die "apt-get install libopenmpi-dev openmpi-bin failed (log above)"; }
    command -v mpicc >/dev/null && command -v mpirun >/dev/null || die "Open MPI installed but mpicc/mpirun still not on PATH"
fi

# (b) build --------------------------------------------------------------------------------
say "building epcomm (cargo build --release)"
cargo build --release --bin epcomm >"$OUT/cargo.log" 2>&1 \
    || { tail -30 "$OUT/cargo.log" >&2; die "cargo build --release failed (log above)"; }
EPCOMM="$ROOT/target/release/epcomm"
[ -x "$EPCOMM" ] || die "no $EPCOMM after the build"
mkdir -p target/mpi
MPIBENCH="$ROOT/target/mpi/mpi_alltoallv"
say "building the MPI baseline (mpicc -O2 benches/mpi_alltoallv.c)"
mpicc -O2 -std=c11 -o "$MPIBENCH" benches/mpi_alltoallv.c 2>"$OUT/mpicc.log" \
    || { cat "$OUT/mpicc.log" >&2; die "mpicc failed (log above)"; }

# (c) run ----------------------------------------------------------------------------------
# Other work on the host skews everything (two ranks on two cores leave none spare): record it.
LOAD_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)"
NCPU="$(nproc 2>/dev/null || echo 1)"
MPIRUN=(mpirun -np "$RANKS")
if [ "$NCPU" -lt "$RANKS" ]; then
    say "WARNING: $NCPU CPU(s) for $RANKS ranks: oversubscribed, no binding; times are not meaningful"
    # Waiting ranks yield instead of spinning on the cores the working ones need.
    MPIRUN+=(--oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
    BINDING="none (oversubscribed: $NCPU CPUs; mpi_yield_when_idle 1)"
else
    MPIRUN+=(--bind-to core --map-by core)
    BINDING="one rank per core (mpirun --bind-to core --map-by core)"
fi
tiny=(--tokens 4 --hidden 64 --experts 8 --topk 2 --dtype-bytes 2 --iters 1 --warmup 0 --json)
if ! "${MPIRUN[@]}" "$MPIBENCH" "${tiny[@]}" >"$OUT/mpi-probe.log" 2>&1; then
    say "NOTE: mpirun with core binding failed on this machine; falling back to --bind-to none:"
    sed 's/^/    /' "$OUT/mpi-probe.log" | head -10 >&2
    MPIRUN=(mpirun -np "$RANKS" --oversubscribe --bind-to none)
    BINDING="none (binding to cores failed here; the MPI ranks float, epcomm still pins its own)"
    "${MPIRUN[@]}" "$MPIBENCH" "${tiny[@]}" >"$OUT/mpi-probe.log" 2>&1 \
        || { cat "$OUT/mpi-probe.log" >&2; die "mpirun fails even without binding (log above)"; }
fi

TOKLIST="$(IFS=,; echo "${TOKENS[*]}")"
# The MPI baseline runs right before each epcomm backend, with the same T values, so every
# epcomm/MPI ratio compares two runs minutes, not hours, apart (the host is shared and noisy).
run_mpi() { # $1: token list, $2: output file
    "${MPIRUN[@]}" "$MPIBENCH" --tokens "$1" --hidden "$HIDDEN" --experts "$EXPERTS" \
        --topk "$TOPK" --dtype-bytes "$DTYPE_BYTES" --routing "$ROUTING" --iters "$ITERS" \
        --warmup "$WARMUP" --json >"$2" 2>"$2.err" \
        || { cat "$2.err" >&2; die "the MPI baseline failed (log above)"; }
}

FAILED=()
IFS=, read -r -a BACKEND_LIST <<<"$BACKENDS"
[ "${#BACKEND_LIST[@]}" -gt 0 ] || die "no backends to run"
for b in "${BACKEND_LIST[@]}"; do
    toks="$TOKLIST"
    if [ "$b" = deepep_low_latency ]; then
        # EXPERT_MAJOR receive buffers hold E_local * M * R rows whatever the routing:
        # at T=4096 that is 128 * 4096 * 2 rows of 14336 B = 15 GB per rank.
        toks=128
        say "deepep_low_latency at T=128 only: its EXPERT_MAJOR buffer is E_local*M*R rows ($((EXPERTS / RANKS)) x M x $RANKS x $((HIDDEN * DTYPE_BYTES)) B; at M=4096 that is $((EXPERTS / RANKS * 4096 * RANKS * HIDDEN * DTYPE_BYTES / 1000000000)) GB per rank), more than this machine has"
    fi
    say "MPI baseline: ${MPIRUN[*]} mpi_alltoallv --tokens $toks"
    run_mpi "$toks" "$OUT/mpi-$b.jsonl"
    say "epcomm bench moe --backend $b --tokens $toks"
    if ! "$EPCOMM" bench moe --backend "$b" --ranks "$RANKS" --tokens "$toks" --hidden "$HIDDEN" \
        --experts "$EXPERTS" --topk "$TOPK" --dtype "$DTYPE" --routing "$ROUTING" \
        --iters "$ITERS" --warmup "$WARMUP" --json >"$OUT/epcomm-$b.json" 2>"$OUT/epcomm-$b.err"; then
        sed 's/^/    /' "$OUT/epcomm-$b.err" | tail -10 >&2
        say "WARNING: epcomm bench moe --backend $b failed (above); continuing"
        FAILED+=("$b")
        rm -f "$OUT/epcomm-$b.json"
    fi
done

# (d) table --------------------------------------------------------------------------------
echo
echo "epcomm vs Open MPI MPI_Alltoallv (transport only) vs memcpy: $RANKS ranks; MPI binding: $BINDING; epcomm pins rank r to CPU r itself"
echo "H=$HIDDEN $DTYPE, E=$EXPERTS, K=$TOPK, $ROUTING routing, $ITERS iterations after $WARMUP warm-up; median of the slowest rank per iteration"
echo "host: $(uname -n), $NCPU CPUs, $(date -u '+%Y-%m-%d %H:%M UTC'), $(mpirun --version 2>/dev/null | head -1); load average before the runs: $LOAD_BEFORE"
python3 - "$OUT" "$RANKS" "$HIDDEN" "$DTYPE_BYTES" <<'PY'
import json, os, sys

out, ranks, hidden, es = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
row = hidden * es

def fail(msg):
    sys.exit("bench-vs-mpi: error: " + msg)

# Per backend: the MPI run just before it ({T: result}) and epcomm's results.
runs = []
for name in sorted(os.listdir(out)):
    if not (name.startswith("epcomm-") and name.endswith(".json")):
        continue
    backend = name[len("epcomm-"):-len(".json")]
    with open(os.path.join(out, name)) as f:
        text = f.read()
    try:
        ep = json.loads(text[text.index("["):])
    except ValueError:
        fail(f"cannot parse {name} (epcomm bench moe --json output):\n{text[:400]}")
    mpi = {}
    with open(os.path.join(out, f"mpi-{backend}.jsonl")) as f:
        for line in f:
            if line.strip().startswith("{"):
                r = json.loads(line)
                mpi[r["tokens"]] = r
    if not mpi:
        fail(f"the MPI baseline run before {backend} printed no results")
    runs.append((backend, ep, mpi))
if not runs:
    fail("no epcomm results to show")

# The bytes epcomm's own memcpy copied (its dispatch bytes_received), by layout: TOKEN_MAJOR and
# RANK_MAJOR receive the rank-deduplicated rows; REPLICATED every rank's T rows; EXPERT_MAJOR one
# row per (token, local expert).
def memcpy_bytes(r):
    dedup = r["gbps_dedup"] * 1e9 * r["pair_ms"] / 1e3 / 2
    per_exp = r["gbps_per_expert"] * 1e9 * r["pair_ms"] / 1e3 / 2
    return {"allgather_reducescatter": ranks * r["tokens"] * row,
            "deepep_low_latency": per_exp}.get(r["backend"], dedup)

def f2(x):
    return f"{x:.2f}"

rows = []
for backend, ep, mpi in runs:
    for r in ep:
        m = mpi.get(r["tokens"])
        mem = memcpy_bytes(r) / (r["memcpy_ms"] / 1e3) / 1e9 if r["memcpy_ms"] > 0 else float("nan")
        rows.append((r["tokens"], r["backend"], r, m, mem))
rows.sort(key=lambda x: (x[0], x[1]))

fmt = "{:<28} {:>5} {:>9} {:>8} {:>8} {:>7} {:>8} {:>8} {:>7} {:>10} {:>8}"
print()
print(fmt.format("backend", "T", "epcomm ms", "p99 ms", "MPI ms", "ep/MPI", "ep GB/s",
                 "memcpy", "ep/mem", "MPI GB/s", "MPI/mem"))
print(fmt.format("", "", "(pair)", "", "(pair)", "", "(dedup)", "GB/s", "", "(dedup)", ""))
for t, name, r, m, mem in rows:
    print(fmt.format(name, t, f2(r["pair_ms"]), f2(r["pair_p99_ms"]),
                     f2(m["pair_ms"]) if m else "-",
                     f2(r["pair_ms"] / m["pair_ms"]) if m else "-",
                     f2(r["gbps_dedup"]), f2(mem), f2(r["gbps_dedup"] / mem),
                     f2(m["gbps_dedup"]) if m else "-",
                     f2(m["gbps_dedup"] / m["memcpy_gbps"]) if m else "-"))
print()
print("ep/MPI: epcomm dispatch+combine time / two MPI_Alltoallv (run just before, same T);")
print("        <= 0.70 at T=4096 and <= 0.50 at T=128 meet the targets (MPI only moves pre-packed")
print("        bytes; epcomm also routes, packs, reduces).")
print("GB/s (dedup): 2 x rank-deduplicated bytes per rank / pair time (dispatch out + combine back).")
print("memcpy GB/s: the memcpy epcomm times in the same run, of the bytes its dispatch received;")
print("        ep/mem: the pair's GB/s over it. MPI/mem: the same for MPI (its own run's memcpy).")
print()
print("detail (ms, median of the slowest rank):")
dfmt = "  {:<28} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}"
print(dfmt.format("", "T", "dispatch", "combine", "memcpy", "disp/mem", "MPI disp", "MPI comb", "MPI mcpy"))
for t, name, r, m, mem in rows:
    print(dfmt.format(name, t, f2(r["dispatch_ms"]), f2(r["combine_ms"]), f2(r["memcpy_ms"]),
                      f2(r["memcpy_ms"] / r["dispatch_ms"]) if r["dispatch_ms"] else "-",
                      f2(m["dispatch_ms"]) if m else "-", f2(m["combine_ms"]) if m else "-",
                      f2(m["memcpy_ms"]) if m else "-"))
print("disp/mem: dispatch's received bytes/s over the same-run memcpy's (memcpy time / dispatch")
print("        time); >= 0.80 at T=4096 for the deduplicating backends meets the target.")
print("deepep_low_latency's pair / deepep_high_throughput's at T=128 <= 4 meets its target.")
bad = sum(m.get("bad_rows", 0) for _, _, mpi in runs for m in mpi.values())
if bad:
    print(f"WARNING: the MPI baseline received {bad} rows with a wrong source tag")
PY

echo
say "epcomm bench eplb"
"$EPCOMM" bench eplb || FAILED+=("eplb")

if [ "${#FAILED[@]}" -gt 0 ]; then
    die "these runs failed: ${FAILED[*]} (see the messages above)"
fi
