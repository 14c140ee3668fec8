#!/usr/bin/python3
"""context_parallel: sequences longer than one rank can train, split over
ranks with ring attention (issue #72), side by side in one invocation.

  bench/context_parallel.py [--train build/train] [--config configs/llama_tiny.yaml]
                            [--contexts 2,4] [--seq-len S] [--min-seq-len 256]
                            [--budget-mib M] [--max-step-s 4] [--steps 5]
                            [--vocab 256] [--d-model 64] [--n-layers 2] [--n-heads 4]
                            [--n-kv-heads 2] [--d-ff 172] [--set KEY=VALUE]...
                            [--workdir D] [--json-out F]

Every job is `train --nproc N` on configs/llama_tiny.yaml with the model
above (fp32, no activation checkpointing, synthetic data, no eval, no
checkpoints, a global batch of one sequence), --steps steps, steps 3.. timed.

1. The base length S1: the longest model.seq_len one rank trains within the
   per-rank memory budget (--budget-mib; default this machine's
   MemAvailable over the largest context degree, so that every job below
   fits beside its own ranks) and the step-time limit (--max-step-s: on a
   2-core machine the step's attention, quadratic in the length, is what
   ends the search first). Found by doubling from --min-seq-len (a multiple
   of 2 x every context degree), one short world-1 job per length; --seq-len
   S skips the search.
2. The rows: S1 at one rank (parallel.context 1), then for each C of
   --contexts, C x S1 over C ranks (parallel.context C, FSDP over the same C
   ranks: parallel.shard C), once with the head-tail load balance (the
   default) and once with parallel.context_load_balance none. Per row:
     peak_rss_mib   each rank's peak resident memory (metrics.jsonl);
     step_s         the median step (rank 0's step_time_s);
     tokens_per_rank
                    model.seq_len / C, the tokens each rank's activations hold;
     wait_share     the median over steps of each rank's seconds waiting for a
                    key/value or gradient block (metrics.jsonl's
                    context_wait_s) over the step, the largest over the ranks;
     attention_s    each rank's median seconds in ring attention per step
                    (context_attention_s), forward and backward, waits
                    included;
     compute_s      each rank's median of attention less waiting
                    (context_attention_s - context_wait_s): its own blocks'
                    work;
     imbalance      the slowest rank's compute_s over the fastest's (1:
                    even; the head-tail split aims at 1, and without it the
                    last rank of the ring does the most while the others
                    wait for it, which their wait share shows).
Checks (one line naming it, exit 1): every job finished; a context-parallel
job logged context_attention_s and context_wait_s for every rank.
Prints a table and one JSON object (--json-out F writes it too).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PROG = "context_parallel"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WARMUP = 2
MODEL = {"vocab": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 172}


def fail(msg, code=1):
    print(f"{PROG}: {msg}", file=sys.stderr)
    sys.exit(code)


def mem_available_mib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def job_sets(a, seq_len, context, balance, run_dir):
    sets = {
        "run.dir": run_dir, "run.seed": 1234,
        "model.vocab_size": a.vocab, "model.seq_len": seq_len, "model.d_model": a.d_model,
        "model.n_layers": a.n_layers, "model.n_heads": a.n_heads, "model.n_kv_heads": a.n_kv_heads,
        "model.d_ff": a.d_ff, "model.rope_scaling.factor": 0, "model.activation_checkpointing": "none",
        "train.steps": a.steps, "train.global_batch_size": 1, "train.micro_batch_size": 0,
        "train.log_every": 1, "train.eval_every": 0, "train.mixed_precision.param_dtype": "fp32",
        "optim.warmup_steps": 0, "data.kind": "synthetic", "data.eval_fraction": 0,
        "checkpoint.interval": 0,
        "parallel.shard": context, "parallel.context": context,
    }
    if context > 1:
        sets["parallel.context_load_balance"] = balance
    for kv in a.set:
        key, _, value = kv.partition("=")
        sets[key] = value
    return sets


def run_job(a, seq_len, context, balance, tag, timeout=None):
    """(records by step, None) or (None, why it did not finish)."""
    run_dir = os.path.join(a.workdir, tag)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [a.train, "--nproc", str(context), "--config", a.config]
    for key, value in job_sets(a, seq_len, context, balance, run_dir).items():
        cmd += ["--set", f"{key}={value}"]
    log = os.path.join(a.workdir, tag + ".log")
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return None, f"over {timeout:.0f} s"
    if rc != 0:
        with open(log) as f:
            return None, f"exit {rc}: " + f.read()[-1500:]
    steps = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "step" in r and "step_time_s" in r and "event" not in r:
                steps[int(r["step"])] = r
    return steps, None


def timed(steps):
    return [r for k, r in sorted(steps.items()) if k > WARMUP]


def per_rank(recs, key, how):
    rows = [r[key] for r in recs if isinstance(r.get(key), list)]
    if not rows:
        return None
    return [how([row[i] for row in rows]) for i in range(len(rows[0]))]


def summarise(steps, seq_len, context, balance):
    recs = timed(steps)
    if not recs:
        fail("no timed steps in metrics.jsonl (--steps too small)")
    row = {"seq_len": seq_len, "context": context, "world": context,
           "load_balance": balance if context > 1 else None, "tokens_per_rank": seq_len // context,
           "step_s": statistics.median(r["step_time_s"] for r in recs),
           "peak_rss_mib": per_rank(recs, "peak_rss_mib", max)}
    if context > 1:
        for key in ("context_attention_s", "context_wait_s"):
            if any(not isinstance(r.get(key), list) or len(r[key]) != context for r in recs):
                fail(f"{key} missing from some steps of the context {context} job's metrics.jsonl "
                     f"(one value per rank expected)")
        attention = per_rank(recs, "context_attention_s", statistics.median)
        compute = [statistics.median(r["context_attention_s"][i] - r["context_wait_s"][i] for r in recs)
                   for i in range(context)]
        shares = [statistics.median(r["context_wait_s"][i] / max(r["step_time_s"], 1e-12) for r in recs)
                  for i in range(context)]
        row.update({"attention_s": attention, "compute_s": compute, "wait_share": max(shares),
                    "wait_share_per_rank": shares, "imbalance": max(compute) / max(min(compute), 1e-12)})
    return row


def find_base(a, contexts):
    """The longest doubling of --min-seq-len within the budget and the step limit."""
    tried, best = [], None
    seq = a.min_seq_len
    while True:
        steps, why = run_job(a, seq, 1, "head_tail", f"search_{seq}", timeout=a.max_step_s * (a.steps + 4) + 30)
        fits, peak, step_s = False, None, None
        if steps:
            recs = timed(steps) or list(steps.values())
            peak = max(max(r.get("peak_rss_mib", [0])) for r in recs)
            step_s = statistics.median(r["step_time_s"] for r in recs)
            fits = peak <= a.budget_mib and step_s <= a.max_step_s
            why = None if fits else (f"peak {peak:.0f} MiB over the budget {a.budget_mib:.0f}" if peak > a.budget_mib
                                     else f"step {step_s:.2f} s over --max-step-s {a.max_step_s}")
        tried.append({"seq_len": seq, "fits": fits, "peak_rss_mib": peak, "step_s": step_s, "why": why})
        print(f"  search: seq_len {seq}: " + ("fits" if fits else f"does not fit ({why.splitlines()[0]})"),
              flush=True)
        if not fits:
            break
        best = seq
        seq *= 2
    if best is None:
        fail(f"--min-seq-len {a.min_seq_len} does not fit one rank: {tried[0]['why']}")
    return best, tried


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0] + " ...", epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default=os.path.join(REPO, "build", "train"))
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "llama_tiny.yaml"))
    ap.add_argument("--contexts", default="2,4")
    ap.add_argument("--seq-len", type=int, default=None, help="the base length S1 (default: searched)")
    ap.add_argument("--min-seq-len", type=int, default=256)
    ap.add_argument("--budget-mib", type=float, default=None)
    ap.add_argument("--max-step-s", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=5)
    for key, value in MODEL.items():
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()

    if not os.access(a.train, os.X_OK):
        fail(f"{a.train}: not built (cmake --build build --target train)", 2)
    if a.steps <= WARMUP:
        fail(f"--steps must be above {WARMUP} (steps {WARMUP + 1}.. are timed)", 2)
    try:
        contexts = sorted({int(c) for c in a.contexts.split(",") if c.strip()})
    except ValueError:
        fail("--contexts is comma-separated numbers", 2)
    if not contexts or any(c < 2 for c in contexts):
        fail("--contexts must name degrees of 2 or more", 2)
    chunk = 2 * max(contexts)
    base_given = a.seq_len is not None
    if (a.seq_len or a.min_seq_len) % chunk != 0:
        fail(f"--{'seq-len' if base_given else 'min-seq-len'} must be a multiple of 2 x the largest context "
             f"degree ({chunk}): the head-tail split takes 2C equal chunks", 2)
    if a.budget_mib is None:
        avail = mem_available_mib()
        if avail is None:
            fail("MemAvailable unknown: give --budget-mib", 2)
        a.budget_mib = avail / max(contexts)
    keep = a.workdir is not None
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="context_parallel_bench.")
    os.makedirs(a.workdir, exist_ok=True)
    started = time.time()

    search = []
    if base_given:
        base = a.seq_len
    else:
        print(f"{PROG}: searching the longest seq_len one rank trains within {a.budget_mib:.0f} MiB and "
              f"{a.max_step_s} s a step", flush=True)
        base, search = find_base(a, contexts)
    rows = []
    jobs = [(base, 1, "head_tail")]
    for c in contexts:
        jobs += [(c * base, c, "head_tail"), (c * base, c, "none")]
    for seq, c, balance in jobs:
        tag = f"s{seq}_c{c}_{balance}"
        print(f"{PROG}: seq_len {seq}, context {c}" + (f", {balance}" if c > 1 else ""), flush=True)
        steps, why = run_job(a, seq, c, balance, tag)
        if steps is None:
            fail(f"the job seq_len {seq} context {c} {balance} did not finish ({why.splitlines()[0]}); "
                 f"log: {os.path.join(a.workdir, tag + '.log')}")
        rows.append(summarise(steps, seq, c, balance))

    base_peak = max(rows[0]["peak_rss_mib"] or [0]) or None
    print()
    print("| seq_len | context | balance | tokens/rank | peak RSS/rank MiB | vs one rank at S1 | step s | "
          "K/V wait share | attention s/rank | compute s/rank | slowest/fastest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        peak = max(r["peak_rss_mib"] or [0]) or None
        r["peak_vs_base"] = peak / base_peak if peak and base_peak else None
        attention = "/".join(f"{x:.3f}" for x in r["attention_s"]) if r.get("attention_s") else "-"
        compute = "/".join(f"{x:.3f}" for x in r["compute_s"]) if r.get("compute_s") else "-"
        print(f"| {r['seq_len']} | {r['context']} | {r['load_balance'] or '-'} | {r['tokens_per_rank']} | "
              f"{fmt(peak, '.0f')} | {fmt(r['peak_vs_base'], '.2f')} | {r['step_s']:.3f} | "
              f"{fmt(r.get('wait_share'), '.3f')} | {attention} | {compute} | {fmt(r.get('imbalance'), '.2f')} |")
    balance = []
    for c in contexts:
        on = next(r for r in rows if r["context"] == c and r["load_balance"] == "head_tail")
        off = next(r for r in rows if r["context"] == c and r["load_balance"] == "none")
        balance.append({"context": c, "seq_len": on["seq_len"], "head_tail_imbalance": on["imbalance"],
                        "none_imbalance": off["imbalance"], "head_tail_step_s": on["step_s"],
                        "none_step_s": off["step_s"]})
    print()
    for b in balance:
        print(f"load balance at context {b['context']}: slowest/fastest rank's attention compute {b['head_tail_imbalance']:.2f} "
              f"head-tail, {b['none_imbalance']:.2f} none; step {b['head_tail_step_s']:.3f} s against "
              f"{b['none_step_s']:.3f} s")
    result = {"kind": "context_parallel", "benchmark": PROG, "train": a.train,
              "model": {k: getattr(a, k) for k in MODEL}, "steps": a.steps, "timed_from_step": WARMUP + 1,
              "budget_mib": a.budget_mib, "max_step_s": a.max_step_s, "base_seq_len": base,
              "base_seq_len_searched": not base_given, "search": search, "rows": rows, "load_balance": balance,
              "cores": os.cpu_count(), "wall_s": time.time() - started}
    text = json.dumps(result, indent=1)
    print(text)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(text + "\n")
    if not keep:
        shutil.rmtree(a.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
