#!/usr/bin/python3
"""pipeline_schedules: the pipeline's schedules (parallel.pipeline_schedule)
against the same work at P = 1, their bubble, the activations each stage
holds, and how much of the inter-stage transfer a slow link adds.

  bench/pipeline_schedules.py [--train build/train] [--pipelines 2,4]
                              [--schedules gpipe,1f1b,interleaved_1f1b]
                              [--micro-batches 8] [--steps 8] [--mbit 200]
                              [--json F] [--trace-dir D]

Each job is `build/train` processes with torchrun's environment, rank r
pinned to core r mod the cores, in a network namespace of its own (as
bench/fsdp_overlap.py runs them). The same llama, global batch and
micro-batches (train.micro_batch_size) run at P = 1 (one process,
gradient accumulation over the micro-batches) and, per schedule, at
P = 2 and 4 (pipeline only: one rank per stage). Per case, each the median
over steps 3..steps of rank 0's metrics.jsonl:
  step_s            the step at P (loopback, no rate limit);
  vs_p1             step_s / the P = 1 step: the same work. With one core
                    per stage a pipeline would do it in about
                    (M + P - 1) / (M P) of the time; this machine has
                    2 cores, so at P = 4 two stages share each one;
  bubble_measured   pipeline_wait_s / step_s on rank 0 (the first stage):
                    the share of its step it waited for the other stages;
  bubble_theory     (P - 1) / (M + P - 1) (interleaved: (P - 1) / (V M + P - 1)
                    with V stages per rank), for equal stage times;
  held              pipeline_peak_held: the most micro-batches whose
                    activations one stage of rank 0 held;
  peak_rss_mib      each rank's peak resident memory (parameters, AdamW,
                    activations and LibTorch's own), by stage;
  act_mib_est       held x one micro-batch's activations of rank 0's stages
                    (the model's size formula), what held means in bytes;
  step_s_limited    the step with the namespace's loopback limited to --mbit
                    (tc tbf): every activation and gradient crosses it;
  transfer_s        the bytes every stage boundary carries per step
                    (activations forward, gradients back; V P - 1
                    boundaries) at --mbit: the namespace's one link carries
                    them all;
  hidden_share      1 - (step_s_limited - step_s) / transfer_s: the share of
                    the transfer that the schedule hid behind compute.
Needs root, iproute2 (ip, tc with tbf) and taskset; without them it says so
and exits 2. Prints a table, and with --json one JSON object (scripts/plot-bench
pipeline draws it). With --trace-dir, the first P = 4 1f1b run also writes
a profiler trace of one step on every rank (profile.every), whose
shardkit::pp_forward / pp_backward ranges make the JSON's timeline.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_overlap import Link, fail_on, free_port_base, launch_ranks, wait_ranks  # noqa: E402

PROG = "pipeline_schedules"

MODEL = {
    "kind": "llama", "vocab_size": 256, "seq_len": 128, "d_model": 256, "n_layers": 8,
    "n_heads": 4, "n_kv_heads": 2, "d_ff": 704,
}
MICRO_ROWS = 2  # samples per micro-batch


def fail(msg, code=2):
    print(f"{PROG}: {msg}", file=sys.stderr)
    sys.exit(code)


def config_args(args, pipeline, schedule, run_dir, trace_step=0):
    per_rank = 1 if schedule != "interleaved_1f1b" else 2
    sets = [f"run.dir={run_dir}", f"train.steps={args.steps}", "train.log_every=1",
            "train.eval_every=0", "checkpoint.interval=0", "data.kind=synthetic",
            "data.task=copy", "data.eval_fraction=0", "model.tie_weights=false",
            f"train.global_batch_size={MICRO_ROWS * args.micro_batches}",
            f"train.micro_batch_size={MICRO_ROWS}", "parallel.replicate=1", "parallel.shard=1",
            f"parallel.pipeline={pipeline}"]
    if pipeline > 1:
        sets += [f"parallel.pipeline_schedule={schedule}", f"parallel.stages_per_rank={per_rank}"]
    sets += [f"model.{k}={v}" for k, v in MODEL.items()]
    if trace_step:
        sets += [f"profile.every={trace_step}", "profile.active=1", f"profile.dir={run_dir}/profile"]
    out = ["--config", args.config]
    for s in sets:
        out += ["--set", s]
    return out


def run_job(args, link, pipeline, schedule, work, tag, trace_step=0):
    run_dir = os.path.join(work, tag)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    port = free_port_base()
    conf = config_args(args, pipeline, schedule, run_dir, trace_step)
    procs = launch_ranks(link, args.train, run_dir, [(pipeline, r, port, conf) for r in range(pipeline)])
    fail_on(wait_ranks(procs), run_dir, tag)
    steps = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "step_time_s" in rec and rec["step"] >= 3:
                steps.append(rec)
    if not steps:
        fail(f"{tag}: no steps from 3 on in metrics.jsonl", 1)
    rss = [max(r["peak_rss_mib"][i] for r in steps) for i in range(len(steps[0]["peak_rss_mib"]))]
    return {"step_s": statistics.median(r["step_time_s"] for r in steps),
            "wait_s": statistics.median(r.get("pipeline_wait_s", 0.0) for r in steps),
            "held": max(r.get("pipeline_peak_held", 0) for r in steps),
            "peak_rss_mib": rss, "dir": run_dir}


def pp_ranges(path):
    """The shardkit::pp_forward / pp_backward ranges of one rank's Chrome
    trace: [name, start_ms, dur_ms], start from the end of the step's
    shardkit::step_stats all-reduce, which every rank leaves at about the
    same time (each process's profiler has a clock of its own)."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    out = []
    origin = None
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X":
            continue
        if name == "shardkit::step_stats":
            origin = (float(e["ts"]) + float(e["dur"])) / 1000.0
        if name.startswith("shardkit::pp_f") or name.startswith("shardkit::pp_b"):
            out.append([name, float(e["ts"]) / 1000.0, float(e["dur"]) / 1000.0])
    origin = origin if origin is not None else min((r[1] for r in out), default=0.0)
    return sorted(([n, round(s - origin, 3), round(d, 3)] for n, s, d in out), key=lambda r: r[1])


def activation_mib_per_micro(pipeline, per_rank):
    """One micro-batch's activations of rank 0's stages, fp32, from the
    llama's size formula (models/model_spec.cpp: llama_size)."""
    d, ff, s, h = MODEL["d_model"], MODEL["d_ff"], MODEL["seq_len"], MODEL["n_heads"]
    block = 12 * d + 4 * ff + 2 * h * s
    blocks = MODEL["n_layers"] / pipeline  # rank 0's share (all its stages)
    return MICRO_ROWS * s * blocks * block * 4 / 2**20


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--train", default=os.path.join(here, "..", "build", "train"))
    parser.add_argument("--config", default=os.path.join(here, "..", "configs", "default.yaml"))
    parser.add_argument("--pipelines", default="2,4")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--mbit", type=float, default=200)
    parser.add_argument("--json")
    parser.add_argument("--trace-dir")
    args = parser.parse_args()
    if os.geteuid() != 0:
        fail("needs root (network namespaces and tc)")
    for tool in ("ip", "tc", "taskset"):
        if shutil.which(tool) is None:
            fail(f"needs {tool}")
    if not os.access(args.train, os.X_OK):
        fail(f"{args.train}: not built")
    if args.steps < 4:
        fail("--steps must be at least 4 (steps 3.. are timed)")
    pipelines = [int(p) for p in args.pipelines.split(",")]
    schedules = args.schedules.split(",")
    for p in pipelines:
        if p < 2 or MODEL["n_layers"] % (2 * p) or args.micro_batches % p:
            fail(f"--pipelines: {p} must be >= 2 and divide {MODEL['n_layers'] // 2} and --micro-batches")
    for s in schedules:
        if s not in ("gpipe", "1f1b", "interleaved_1f1b"):
            fail(f"--schedules: '{s}' is not gpipe, 1f1b or interleaved_1f1b")

    work = tempfile.mkdtemp(prefix="pipeline_schedules.")
    link = Link()
    rows = []
    timeline = {}
    m = args.micro_batches
    # Bytes one stage boundary carries per step: each micro-batch's hidden
    # [rows, seq, d_model] fp32 forward and its gradient back.
    boundary_bytes = 2 * m * MICRO_ROWS * MODEL["seq_len"] * MODEL["d_model"] * 4
    try:
        link.set_rate(None)
        base = run_job(args, link, 1, "1f1b", work, "p1")
        print(f"P 1: step {base['step_s']:.3f} s", file=sys.stderr)
        for p in pipelines:
            for schedule in schedules:
                v = 2 if schedule == "interleaved_1f1b" else 1
                name = f"{schedule} P{p}"
                link.set_rate(None)
                trace = 5 if args.trace_dir and not timeline and p == max(pipelines) and schedule == "1f1b" else 0
                fast = run_job(args, link, p, schedule, work, "fast", trace)
                link.set_rate(args.mbit)
                slow = run_job(args, link, p, schedule, work, "slow")
                # Every boundary's traffic shares the one limited link: a
                # micro-batch crosses V x P - 1 of them.
                transfer = (v * p - 1) * boundary_bytes * 8 / (args.mbit * 1e6)
                theory = (p - 1) / (v * m + p - 1)
                row = {
                    "case": name, "schedule": schedule, "pipeline": p, "stages_per_rank": v,
                    "micro_batches": m, "step_s": fast["step_s"], "step_s_p1": base["step_s"],
                    "vs_p1": fast["step_s"] / base["step_s"],
                    "bubble_measured": fast["wait_s"] / fast["step_s"], "bubble_theory": theory,
                    "held": fast["held"], "peak_rss_mib": fast["peak_rss_mib"],
                    "act_mib_est": fast["held"] * activation_mib_per_micro(p, v) / max(v, 1),
                    "rate_mbit": args.mbit, "step_s_limited": slow["step_s"], "transfer_s": transfer,
                    "hidden_share": 1 - (slow["step_s"] - fast["step_s"]) / transfer,
                }
                rows.append(row)
                if trace:
                    ranks = []
                    for r in range(p):
                        src = os.path.join(fast["dir"], "profile", f"step_{trace}", f"rank{r}.json")
                        if not os.path.exists(src):
                            continue
                        if args.trace_dir:
                            os.makedirs(args.trace_dir, exist_ok=True)
                            shutil.copyfile(src, os.path.join(args.trace_dir, f"pipeline_1f1b_rank{r}.json"))
                        ranks.append(pp_ranges(src))
                    timeline = {"case": name, "step": trace, "ranks": ranks}
                print(f"{name:20s} step {fast['step_s']:.3f} (x{row['vs_p1']:.2f} of P 1)  bubble "
                      f"{row['bubble_measured']:.2f} (theory {theory:.2f})  held {fast['held']}  "
                      f"limited {slow['step_s']:.3f}  hidden {row['hidden_share']:.2f}", file=sys.stderr)
    finally:
        link.close()
        shutil.rmtree(work, ignore_errors=True)

    head = ["case", "step_s", "vs P 1", "bubble", "theory", "held", "act MiB", "peak RSS MiB by stage",
            f"step @ {args.mbit:.0f} Mbit/s", "transfer_s", "hidden"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["case"], f"{r['step_s']:.3f}", f"{r['vs_p1']:.2f}", f"{r['bubble_measured']:.2f}",
                 f"{r['bubble_theory']:.2f}", str(r["held"]), f"{r['act_mib_est']:.1f}",
                 " / ".join(f"{x:.0f}" for x in r["peak_rss_mib"]), f"{r['step_s_limited']:.3f}",
                 f"{r['transfer_s']:.3f}", f"{r['hidden_share']:.2f}"]
        print("| " + " | ".join(cells) + " |")
    result = {
        "benchmark": "pipeline_schedules",
        "command": "bench/pipeline_schedules.py " + " ".join(sys.argv[1:]),
        "model": MODEL, "micro_batch_rows": MICRO_ROWS, "micro_batches": m, "steps": args.steps,
        "cores": os.cpu_count(), "step_s_p1": base["step_s"], "rows": rows, "timeline": timeline,
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
