#!/usr/bin/env bash
# The GPU path's device check: ONE command, < 10 minutes on one GPU (sized for an H200), no
# network, using the CUDA driver, NCCL and NVRTC already installed there (PyTorch's wheels).
#
#   scripts/gpu-check.sh                  # results in $OUT (else ./gpu-check-out)
#   EPCOMM_GPU_CHECK_BIN=path/to/epcomm-gpu-check scripts/gpu-check.sh
#   QUICK=1 scripts/gpu-check.sh          # smaller matrix (about 1/3 of the time)
#
# The binary: $EPCOMM_GPU_CHECK_BIN, else ./gpu-check-bin/epcomm-gpu-check (what a CPU machine
# builds and carries: `cargo build --release --features cuda,nccl --bin epcomm-gpu-check`),
# else target/release/epcomm-gpu-check, else it is built with cargo when cargo exists.
#
# Phases (each under `timeout`; each writes $OUT/<phase>.json, and every finished case at once
# to $OUT/<phase>.cases.jsonl so a timed-out phase still leaves its results):
#   0 probe    nvidia-smi, kernel version, caps JSON (driver, devices, NCCL, NVRTC)
#   1 kernels  NVRTC compile of every kernel variant for the device; the worked example
#              (2 thread-ranks) exactly; every layout x dtype x id dtype vs the CPU reference
#              (R = 1, 2 thread-ranks); capacity mode on 2 thread-ranks
#   1s sanitize-{memcheck,racecheck,synccheck}: phase 1's worked example, every layout once
#              and capacity mode (`kernels --sanitize`) under compute-sanitizer, when the
#              machine has it (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin); else "skipped"
#   2 nccl     one rank through NCCL, every layout, T in {1,128,4096}, H=7168, K=8, E=256, vs
#              the CPU reference; capacity mode captured in a CUDA graph, replayed 10x; a
#              graph captured at T=32, a call at T=64, the graph replayed (results checked);
#              pool reallocations over 50 random-routing calls per layout (0 expected)
#   3 ranks    R in {2,4,8} ranks as threads on the one GPU (in-process fabric: D2D copies;
#              NCCL refuses two ranks per GPU); one-sided IPC/VMM: reported not_implemented
#   4 perf     1 GiB device-to-device copy bandwidth vs NCCL R=1 dispatch+combine per layout
# Then a table of every phase and $OUT/summary.json. Exit status 0 only if phases 0-2 passed
# and no sanitizer that ran reported an error.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$here/gpu-check-out}"
mkdir -p "$OUT"
log="$OUT/log.txt"
: >"$log"
say() { echo "$*" | tee -a "$log" >&2; }

# ---- the binary ---------------------------------------------------------------------------
bin="${EPCOMM_GPU_CHECK_BIN:-}"
for c in "$here/gpu-check-bin/epcomm-gpu-check" "$here/target/release/epcomm-gpu-check"; do
  [ -n "$bin" ] && break
  [ -x "$c" ] && bin="$c"
done
if [ -z "$bin" ] && command -v cargo >/dev/null; then
  say "gpu-check: building epcomm-gpu-check with cargo"
  (cd "$here" && cargo build --release --features cuda,nccl --bin epcomm-gpu-check) >>"$log" 2>&1 \
    && bin="$here/target/release/epcomm-gpu-check"
fi
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  say "gpu-check: no epcomm-gpu-check binary (set EPCOMM_GPU_CHECK_BIN)"
  echo '{"status": "fail", "error": "no epcomm-gpu-check binary"}' >"$OUT/summary.json"
  exit 2
fi
say "gpu-check: binary $bin"

# ---- the host's libraries (no network) ----------------------------------------------------
py_dirs="$(python3 - 2>/dev/null <<'PY'
import importlib.util as u
out = []
for m in ("nvidia", "torch"):
    try:
        s = u.find_spec(m)
    except Exception:
        s = None
    if s and s.submodule_search_locations:
        out += list(s.submodule_search_locations)
print("\n".join(out))
PY
)"
search_dirs="$py_dirs /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu /usr/local/lib"
find_lib() { # pattern
  local f
  # shellcheck disable=SC2086
  f="$(find $search_dirs -name "$1" ! -name '*builtins*' 2>/dev/null | sort -V | tail -n 1)"
  [ -n "$f" ] || f="$(ldconfig -p 2>/dev/null | awk -v p="${1%\*}" '$1 ~ p {print $NF}' | head -n 1)"
  echo "$f"
}
if [ -z "${VLLM_NCCL_SO_PATH:-}" ]; then
  nccl="$(find_lib 'libnccl.so.2')"
  [ -n "$nccl" ] && export VLLM_NCCL_SO_PATH="$nccl"
fi
if [ -z "${EPCOMM_NVRTC_PATH:-}" ]; then
  nvrtc="$(find_lib 'libnvrtc.so.*')"
  [ -n "$nvrtc" ] && export EPCOMM_NVRTC_PATH="$(dirname "$nvrtc")"
fi
export EPCOMM_CACHE_DIR="${EPCOMM_CACHE_DIR:-$OUT/kernel-cache}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"
say "gpu-check: VLLM_NCCL_SO_PATH=${VLLM_NCCL_SO_PATH:-<unset>} EPCOMM_NVRTC_PATH=${EPCOMM_NVRTC_PATH:-<unset>}"

quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)

# ---- phases ---------------------------------------------------------------------------------
declare -A rc_of
run_phase() { # name budget_seconds
  local name="$1" budget="$2" start end
  start=$(date +%s)
  say "gpu-check: phase $name (timeout ${budget}s)"
  rm -f "$OUT/$name.json" "$OUT/$name.cases.jsonl"
  timeout --kill-after=5 "$budget" "$bin" "$name" --out "$OUT" "${quick[@]}" >>"$log" 2>&1
  local rc=$?
  end=$(date +%s)
  rc_of[$name]=$rc
  if [ ! -s "$OUT/$name.json" ]; then
    local done_cases=0
    [ -f "$OUT/$name.cases.jsonl" ] && done_cases=$(wc -l <"$OUT/$name.cases.jsonl")
    local why="exit status $rc"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="timed out after ${budget}s"
    printf '{"phase": "%s", "status": "fail", "error": "%s", "finished_cases": %s}\n' \
      "$name" "$why" "$done_cases" >"$OUT/$name.json"
  fi
  say "gpu-check: phase $name rc=$rc in $((end - start))s"
}

# compute-sanitizer over phase 1's small matrix, one tool per run: $OUT/sanitize-<tool>.json
# (the phase's own JSON, the sanitizer's exit status and its "ERROR SUMMARY" error count) and
# $OUT/sanitize-<tool>.log (the sanitizer's report).
sanitizer=""
for c in "$(command -v compute-sanitizer 2>/dev/null)" "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" \
         /usr/local/cuda/bin/compute-sanitizer; do
  [ -n "$c" ] && [ -x "$c" ] && { sanitizer="$c"; break; }
done
run_sanitizer() { # tool budget_seconds
  local tool="$1" budget="$2" name="sanitize-$1" rc errors
  local res="$OUT/$name.json" dir="$OUT/$name"
  if [ -z "$sanitizer" ]; then
    printf '{"phase": "%s", "status": "skipped", "reason": "compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"}\n' \
      "$name" >"$res"
    say "gpu-check: $name skipped (no compute-sanitizer)"
    rc_of[$name]=0
    return
  fi
  say "gpu-check: $name (timeout ${budget}s)"
  rm -rf "$dir" "$res"
  EPCOMM_NVRTC_LINEINFO=1 timeout --kill-after=5 "$budget" "$sanitizer" --tool "$tool" --error-exitcode 86 \
    --log-file "$OUT/$name.log" "$bin" kernels --sanitize --out "$dir" >>"$log" 2>&1
  rc=$?
  errors="$(grep -oE 'ERROR SUMMARY: [0-9]+' "$OUT/$name.log" 2>/dev/null | tail -n 1 | grep -oE '[0-9]+$')"
  python3 - "$name" "$rc" "${errors:-null}" "$dir/kernels.json" "$sanitizer" >"$res" <<'PY'
import json, sys
name, rc, errors, inner, tool = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
try:
    v = json.load(open(inner))
except Exception as e:
    v = {"status": "fail", "error": "no result: %s" % e}
errors = None if errors == "null" else int(errors)
ok = rc == 0 and errors == 0 and v.get("status") in ("pass", "pass_with_skips")
why = "timed out" if rc in (124, 137) else ("exit status %d" % rc)
print(json.dumps({"phase": name, "status": "pass" if ok else "fail", "sanitizer": tool,
                  "exit": rc, "why": None if ok else why, "sanitizer_errors": errors,
                  "passed": v.get("passed"), "total": v.get("total"),
                  "cases": v.get("cases", []), "error": v.get("error")}))
PY
  rc_of[$name]=$rc
  say "gpu-check: $name rc=$rc errors=${errors:-?}"
}

{
  echo "== nvidia-smi"; timeout 15 nvidia-smi 2>&1
  echo "== nvidia-smi -q (compute mode)"; timeout 15 nvidia-smi -q 2>&1 | grep -iE 'compute mode|driver version|cuda version|product name' 
  echo "== uname -r"; uname -r
} >"$OUT/system.txt" 2>&1
# Budgets add up to 540 s (+5 s kill grace each); phases usually end well before theirs.
run_phase probe 30
run_phase kernels 110
for tool in memcheck racecheck synccheck; do run_sanitizer "$tool" 40; done
run_phase nccl 140
run_phase ranks 80
run_phase perf 60

# ---- table ------------------------------------------------------------------------------------
python3 - "$OUT" <<'PY' | tee -a "$log"
import json, os, sys
out = sys.argv[1]
rows, summary = [], {}
for ph in ("probe", "kernels", "sanitize-memcheck", "sanitize-racecheck", "sanitize-synccheck",
           "nccl", "ranks", "perf"):
    try:
        v = json.load(open(os.path.join(out, ph + ".json")))
    except Exception as e:
        v = {"status": "fail", "error": "no result: %s" % e}
    summary[ph] = v.get("status")
    detail = ""
    if ph.startswith("sanitize-"):
        detail = v.get("reason") or "%s sanitizer errors, %s/%s cases passed%s" % (
            v.get("sanitizer_errors"), v.get("passed"), v.get("total"),
            "" if v.get("status") == "pass" else " (%s)" % v.get("why"))
    elif "passed" in v:
        detail = "%s/%s cases passed" % (v["passed"], v["total"])
        if v.get("skipped_or_not_implemented"):
            detail += ", %s skipped/not implemented" % v["skipped_or_not_implemented"]
        bad = [c for c in v.get("cases", []) if not c.get("pass")
               and c.get("status") not in ("skipped", "not_implemented")]
        if bad:
            c = bad[0]
            detail += "; first failure: %s %s %s" % (
                c.get("case", c.get("backend", "")), c.get("layout", ""),
                (c.get("error") or json.dumps(c.get("ranks", ""))[:160]))
    elif ph == "probe" and "caps" in v:
        cu = v["caps"].get("cuda", {})
        devs = cu.get("devices", [])
        detail = "driver %s, %s, NCCL %s, NVRTC %s" % (
            cu.get("driver_version"), devs[0].get("name") if devs else "no device",
            v["caps"].get("nccl", {}).get("version"), v["caps"].get("nvrtc", {}).get("version"))
    elif ph == "perf" and "d2d_gbps_read_plus_write" in v:
        detail = "D2D %.0f GB/s; " % v["d2d_gbps_read_plus_write"] + ", ".join(
            "%s %.2f ms" % (p["backend"], 1e3 * p["best_seconds"]) for p in v.get("nccl_r1", []))
    else:
        detail = v.get("error", "")
    rows.append((ph, v.get("status"), detail))
print("%-18s %-16s %s" % ("phase", "status", "detail"))
for r in rows:
    print("%-18s %-16s %s" % (r[0], r[1], r[2][:200]))
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
PY

ok=0
for p in probe kernels nccl sanitize-memcheck sanitize-racecheck sanitize-synccheck; do
  [ "${rc_of[$p]:-1}" = 0 ] || ok=1
done
exit $ok
