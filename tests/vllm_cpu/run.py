"""vLLM's CPU expert parallelism through epcomm's vLLM plugin, inside a real vLLM.

    python run.py check WORKDIR      the test (tests/vllm_cpu.rs runs it): exit 0 and "PASS" lines,
                                     or exit 1 with what differed
    python run.py bench WORKDIR      tokens/s of DP=1, DP=2 + EP over epcomm (shm, torch) and
                                     DP=2 + EP over plain torch.distributed collectives

Run it with the python of a venv holding vllm-cpu and epcomm (scripts/provision-vllm-cpu.sh;
the plugin is the installed package's `vllm.general_plugins` entry point). Everything is
local: the model is built under WORKDIR (tests/vllm_cpu/model.py), HF_HUB_OFFLINE is set.

`check`: greedy decoding of the same prompts (token ids; uneven per-rank batches) with
  1. DP=1 (one process, vLLM alone: the reference),
  2. DP=2 + enable_expert_parallel, offline (vLLM's DP example's launch: one process per DP
     rank, VLLM_DP_* variables), eager, through the plugin (VLLM_PLUGINS=epcomm),
  3. the same in vLLM's default compiled mode (torch.compile),
  4. `vllm serve --data-parallel-size 2 --enable-expert-parallel` and the completions API,
  5. the negative control: 2. with a deliberately broken combine (doubles its result), which
     must differ from 1.;
  6. nothing left behind: no psm_* segment (vLLM's message queues) the runs made stays in
     /dev/shm (every run stops vLLM's engine cores the way a clean exit does);
each of 2.-5. must show (per-process records of the manager, tests/vllm_cpu/hooks) that
epcomm's manager served dispatches and combines in every DP rank's worker.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_TOKENS = 8
MAX_MODEL_LEN = 128
RUN_TIMEOUT = 900


def prompts(n=6, seed=7):
    """``n`` prompts of token ids, lengths 5 to 40 (seeded)."""
    import random

    r = random.Random(seed)
    lengths = [5, 40, 12, 29, 7, 21, 33, 9, 17, 26, 11, 38][:n]
    return [[r.randrange(0, 500) for _ in range(k)] for k in lengths]


def split(items, dp_size, dp_rank):
    """DP rank ``dp_rank``'s share: uneven on purpose (rank 0 gets a third)."""
    if dp_size == 1:
        return list(range(len(items)))
    cut = len(items) // 3
    return list(range(cut)) if dp_rank == 0 else list(range(cut, len(items)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(workdir, hook="", extra=None):
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_PLUGINS": "epcomm",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        "EPCOMM_VLLM_REQUIRE": "1",
        "PYTHONPATH": os.pathsep.join(
            [os.path.join(HERE, "hooks")] + [p for p in [env.get("PYTHONPATH")] if p]),
        "EPCOMM_VLLM_TEST_HOOK": hook,
    })
    if extra:
        env.update(extra)
    return env


def engine_args(model, compiled):
    return dict(model=model, tokenizer=model, dtype="float32", max_model_len=MAX_MODEL_LEN,
                enforce_eager=not compiled, max_num_seqs=16, seed=0,
                gpu_memory_utilization=0.5)


def rank_main(args):
    """One DP rank (or the DP=1 run): generate this rank's prompts, write the results."""
    model, out, dp_size, dp_rank, compiled, n = (args[0], args[1], int(args[2]), int(args[3]),
                                                 args[4] == "1", int(args[5]))
    max_tokens = int(args[6]) if len(args) > 6 else MAX_TOKENS
    from vllm import LLM, SamplingParams

    ps = prompts(n)
    mine = split(ps, dp_size, dp_rank)
    kw = engine_args(model, compiled)
    if dp_size > 1:
        kw["enable_expert_parallel"] = True
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    reqs = [{"prompt_token_ids": ps[i]} for i in mine] or [{"prompt_token_ids": [1]}]
    llm.generate(reqs[:1], sp)  # warm-up (compilation, first allocations): not timed
    t0 = time.perf_counter()
    outs = llm.generate(reqs, sp)
    dt = time.perf_counter() - t0
    res = {}
    for i, o in zip(mine, outs):
        c = o.outputs[0]
        lps = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs or [])]
        res[str(i)] = {"tokens": list(c.token_ids), "logprobs": lps}
    with open(out, "w") as f:
        json.dump({"results": res, "seconds": dt,
                   "tokens": sum(len(r["tokens"]) for r in res.values())}, f)
    # vLLM's DP example sleeps before exiting so that the peers' last collectives finish.
    time.sleep(1)
    # Stop the engine core (and its workers) the way vLLM does at a clean exit, so that they
    # unlink their shared memory (two psm_* message queues of 160 and 240 MiB and a semaphore
    # per rank); os._exit skips vLLM's finalizers, and the SIGKILL of the process group after
    # it would leave them in /dev/shm.
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)


def run_offline(workdir, model, dp, compiled, name, hook="", extra=None, n=6,
                max_tokens=MAX_TOKENS):
    """DP=``dp`` offline (one process per DP rank, as vLLM's DP example); returns
    ({prompt index: result}, tokens/s over the ranks' generate calls, the stats records)."""
    out_dir = os.path.join(workdir, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    env = base_env(workdir, hook, extra)
    env["EPCOMM_VLLM_TEST_STATS"] = out_dir
    port = free_port()
    procs = []
    for r in range(dp):
        e = dict(env)
        if dp > 1:
            e.update({"VLLM_DP_RANK": str(r), "VLLM_DP_RANK_LOCAL": str(r),
                      "VLLM_DP_SIZE": str(dp), "VLLM_DP_MASTER_IP": "127.0.0.1",
                      "VLLM_DP_MASTER_PORT": str(port)})
        log = open(os.path.join(out_dir, f"rank{r}.log"), "w")
        procs.append((subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "rank", model,
             os.path.join(out_dir, f"rank{r}.json"), str(dp), str(r),
             "1" if compiled else "0", str(n), str(max_tokens)],
            env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    deadline = time.time() + RUN_TIMEOUT
    failed = None
    for p, log in procs:
        try:
            rc = p.wait(timeout=max(1, deadline - time.time()))
            if rc != 0 and failed is None:
                failed = f"exit status {rc}"
        except subprocess.TimeoutExpired:
            failed = failed or f"timed out after {RUN_TIMEOUT} s"
        log.close()
    # Each rank's process group: the rank and the engine core and worker processes vLLM
    # started for it, which may outlive a rank that exited (they would hold ports and CPU).
    for p, _ in procs:
        end_group(p)
    if failed:
        tail = open(os.path.join(out_dir, "rank0.log")).read()[-3000:]
        raise RuntimeError(f"{name}: a DP rank failed ({failed}); rank 0's log ends:\n{tail}")
    results, tokens, secs = {}, 0, 0.0
    for r in range(dp):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            d = json.load(f)
        results.update(d["results"])
        tokens += d["tokens"]
        secs = max(secs, d["seconds"])
    return results, tokens / secs, stats(out_dir)


def group_alive(pgid):
    """Whether a process of group ``pgid`` still runs (zombies do not count)."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError, ValueError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def end_group(p, grace=30):
    """Waits up to ``grace`` s for what is left of ``p``'s process group (engine cores,
    workers, and Python's resource tracker, which unlinks the shared memory a killed vLLM
    process leaves) to exit by itself, then SIGKILLs the rest."""
    p.wait()
    deadline = time.time() + grace
    while group_alive(p.pid) and time.time() < deadline:
        time.sleep(0.2)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stats(out_dir):
    recs = []
    for fn in sorted(os.listdir(out_dir)):
        if fn.startswith("stats-") and fn.endswith(".json"):
            with open(os.path.join(out_dir, fn)) as f:
                recs.append(json.load(f))
    return recs


def run_serve(workdir, model, hook="stats", extra=None, n=6):
    """``vllm serve MODEL --data-parallel-size 2 --enable-expert-parallel`` and the completions
    API (greedy, the prompts as token ids, one request at a time)."""
    out_dir = os.path.join(workdir, "serve")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    env = base_env(workdir, hook, extra)
    env["EPCOMM_VLLM_TEST_STATS"] = out_dir
    port = free_port()
    # `vllm serve`, through tests/vllm_cpu/vllm_cli.py: vllm-cpu's own `vllm` script cannot
    # find its version (its distribution is not named vllm).
    cmd = [sys.executable, os.path.join(HERE, "vllm_cli.py"), "serve", model,
           "--tokenizer", model, "--dtype", "float32",
           "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--enforce-eager",
           "--data-parallel-size", "2", "--enable-expert-parallel", "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", "tiny-moe", "--seed", "0",
           # Drain on SIGTERM (vLLM's default, 0, aborts and kills its engine cores at once).
           "--shutdown-timeout", "30"]
    log = open(os.path.join(out_dir, "serve.log"), "w")
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + RUN_TIMEOUT
        while True:
            if p.poll() is not None:
                raise RuntimeError("vllm serve exited with status %s; its log ends:\n%s" % (
                    p.returncode, open(os.path.join(out_dir, "serve.log")).read()[-3000:]))
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"vllm serve not healthy within {RUN_TIMEOUT} s")
            time.sleep(2)
        results = {}
        for i, ids in enumerate(prompts(n)):
            body = json.dumps({"model": "tiny-moe", "prompt": ids, "max_tokens": MAX_TOKENS,
                               "temperature": 0, "ignore_eos": True,
                               "return_token_ids": True, "logprobs": 0}).encode()
            req = urllib.request.Request(base + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                d = json.loads(r.read())
            ch = d["choices"][0]
            results[str(i)] = {"tokens": ch.get("token_ids"),
                               "logprobs": (ch.get("logprobs") or {}).get("token_logprobs")}
        return results, stats(out_dir)
    finally:
        # SIGTERM to the server alone: it stops its engine cores and their workers, which
        # unlink their shared memory (a SIGTERM to the whole group would race that).
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        end_group(p)
        log.close()


def compare(ref, got):
    """(differences as text lines, the largest |logprob difference|)."""
    diffs, worst = [], 0.0
    for k in sorted(ref, key=int):
        if k not in got:
            diffs.append(f"prompt {k}: missing")
            continue
        a, b = ref[k]["tokens"], got[k]["tokens"]
        if a != b:
            diffs.append(f"prompt {k}: tokens {b} != reference {a}")
        la, lb = ref[k].get("logprobs") or [], got[k].get("logprobs") or []
        for x, y in zip(la, lb):
            worst = max(worst, abs(x - y))
    return diffs, worst


def served_by_epcomm(recs, transport, dp=2):
    """Every DP rank's worker has a record of epcomm's manager with dispatches and combines."""
    ranks = {r["rank"] for r in recs if r["dispatches"] > 0 and r["combines"] > 0
             and r["class"] == "EpcommVllmAll2AllManager" and r["transport"] == transport}
    return ranks == set(range(dp)), recs


def vllm_shm():
    """vLLM's shared-memory message queues (Python's SharedMemory names them psm_*)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("psm_")}


def check(workdir):
    shm_before = vllm_shm()
    model = build_model(workdir)
    failures = []
    ref, tps1, _ = run_offline(workdir, model, 1, False, "dp1")
    print(f"dp1 (reference, one process): {len(ref)} prompts, {tps1:.1f} tokens/s")
    cases = [("dp2-eager", False, "shm"), ("dp2-compiled", True, "shm"),
             ("dp2-eager-torch", False, "torch")]
    for name, compiled, transport in cases:
        got, tps, recs = run_offline(workdir, model, 2, compiled, name, hook="stats",
                                     extra={"EPCOMM_VLLM_TRANSPORT": transport}
                                     if transport == "torch" else None)
        diffs, worst = compare(ref, got)
        ok, _ = served_by_epcomm(recs, transport)
        summary = ", ".join(f"rank {r['rank']}: {r['dispatches']} dispatches, "
                            f"{r['combines']} combines, {r['rows_gathered']} rows gathered"
                            for r in recs)
        if diffs or not ok:
            failures.append(f"{name}: {'; '.join(diffs) or 'no epcomm records: ' + summary}")
            print(f"FAIL {name}: {diffs} served_by_epcomm={ok} ({summary})")
        else:
            print(f"PASS {name}: greedy tokens of {len(ref)} prompts equal DP=1's "
                  f"(largest |logprob difference| {worst:g}); epcomm ({transport}) served "
                  f"{summary}; {tps:.1f} tokens/s")
    got, recs = run_serve(workdir, model)
    diffs, worst = compare(ref, got)
    ok, _ = served_by_epcomm(recs, "shm")
    if diffs or not ok:
        failures.append(f"serve: {'; '.join(diffs) or 'no epcomm records'}")
        print(f"FAIL serve: {diffs} served_by_epcomm={ok} {recs}")
    else:
        print(f"PASS serve: vllm serve --data-parallel-size 2 --enable-expert-parallel: greedy "
              f"tokens equal DP=1's (largest |logprob difference| {worst:g}); epcomm served "
              f"{len(recs)} workers")
    got, _, recs = run_offline(workdir, model, 2, False, "dp2-broken-combine",
                               hook="stats,broken-combine")
    diffs, _ = compare(ref, got)
    ok, _ = served_by_epcomm(recs, "shm")
    if not diffs or not ok:
        failures.append("negative control: a doubled combine gave DP=1's tokens")
        print("FAIL negative control: the broken combine was not caught")
    else:
        print(f"PASS negative control: a deliberately broken combine (doubled) changes the "
              f"greedy tokens of {len(diffs)} of {len(ref)} prompts")
    left = sorted(vllm_shm() - shm_before)
    if left:
        failures.append(f"left in /dev/shm: {left}")
        print(f"FAIL shared memory: the runs left {left} in /dev/shm")
    else:
        print("PASS shared memory: no vLLM message queue (psm_*) left in /dev/shm")
    if failures:
        print("FAILED: " + " | ".join(failures))
        return 1
    print("ALL PASSED")
    return 0


def bench(workdir, n=12, max_tokens=32):
    model = build_model(workdir)
    rows = []
    ref, tps, _ = run_offline(workdir, model, 1, False, "bench-dp1", n=n, max_tokens=max_tokens)
    rows.append(("DP=1 (one process, vLLM alone)", tps, "-"))
    runs = [("DP=2 + EP, epcomm shm", {"EPCOMM_VLLM_TRANSPORT": "shm"}, ""),
            ("DP=2 + EP, epcomm torch (gloo)", {"EPCOMM_VLLM_TRANSPORT": "torch"}, ""),
            ("DP=2 + EP, plain torch.distributed (control)",
             {"EPCOMM_VLLM_MANAGER": "0"}, "control")]
    for label, extra, hook in runs:
        got, tps, _ = run_offline(workdir, model, 2, False, "bench-" + str(len(rows)),
                                  hook=hook, extra=extra, n=n, max_tokens=max_tokens)
        diffs, _ = compare(ref, got)
        rows.append((label, tps, "equal" if not diffs else f"DIFFER ({len(diffs)})"))
    print(f"{n} prompts (5 to 40 tokens), {max_tokens} generated tokens each, greedy, eager, "
          "float32, OMP_NUM_THREADS=1 per process; tokens/s = generated tokens / the slowest "
          "rank's generate() time")
    print("| run | tokens/s | greedy tokens vs DP=1 |")
    print("|---|---|---|")
    for label, t, eq in rows:
        print(f"| {label} | {t:.1f} | {eq} |")
    return 0


def build_model(workdir):
    sys.path.insert(0, HERE)
    import model as tiny

    path = os.path.join(workdir, "tiny-qwen3-moe")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        tiny.build(path)
    return path


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "rank":
        rank_main(sys.argv[2:])
    os.makedirs(sys.argv[2], exist_ok=True)
    workdir = os.path.abspath(sys.argv[2])
    # vLLM's ZeroMQ IPC sockets go to VLLM_RPC_BASE_PATH (default: the temporary directory),
    # and a stopped engine leaves them there: give them a directory of this run's own (short:
    # a socket's path is at most 107 bytes) and remove it at the end.
    rpc = tempfile.mkdtemp(prefix="epcomm-vllm-rpc-")
    os.environ["VLLM_RPC_BASE_PATH"] = rpc
    try:
        rc = {"check": check, "bench": bench}[cmd](workdir)
    finally:
        shutil.rmtree(rpc, ignore_errors=True)
    sys.exit(rc)
