#!/usr/bin/python3
"""Step time of a real Llama training run with and without checkpoints:
`train` (world 1) on bench/llama_sizes.py's Llama (on CUDA the 1.11B one in
bf16 with fp32 master weights and AdamW), once per checkpoint.mode, each run
saving at step --interval (and at its last step, untimed). The steps of the
run without checkpoints are the baseline.

  bench/train_ckpt_bench.py [--train build/train] [--device cpu|cuda]
                            [--modes none,async,overlap,overlap-chunked] [--interval N] [--steps S]
                            [--json FILE] [--workdir DIR] [--set key=value]...
                            [--d-model N ...]

With --steps S (default 2 x interval) each run trains S steps and saves at
step N = --interval; the metrics come from each run's metrics.jsonl
(train.log_every 1): the iteration time of step k is wall_s[k] - wall_s[k-1],
so it holds step k and whatever the loop did between the two steps' log
records (the save at step k-1, if any). Per mode:
  - blocking_s: the save's blocking time as the trainer recorded it;
  - save_iteration: the iteration right after the save (its blocking and the
    next step), over the same iteration without checkpoints;
  - around_save: iterations N+1 .. S (the save's copy and its write run
    during them), summed, over the same iterations without checkpoints;
  - before_save: iterations 3 .. N, which no save touches, over the same
    iterations without checkpoints: the noise between two runs.
  - all_over_none: iterations 3 .. S over the same without checkpoints:
    for every-step-local, whose saves touch every iteration, the step cost
    of per-step snapshots.
The target (#36): around_save <= 1.01 in overlap mode.

every-step-local is docs/fault-tolerance.md's recommended fast-recovery
configuration: a snapshot every step (checkpoint.interval 1, overlap) into
a node-local tier in memory (checkpoint.local.dir under /dev/shm, keep_last
1), flushed to checkpoint.dir every 50th (checkpoint.durable.every 50).

Modes: none (no saves), sync, async, overlap (checkpoint.device_snapshot
auto: on a GPU with the memory to spare, the state is first copied in device
memory), overlap-snapshot (device_snapshot on) and overlap-chunked
(device_snapshot off: chunks straight from the live state). Each mode's
"staging" is what the save's event says it did.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# --modes: the checkpoint settings of each.
MODES = {
    "none": {},
    "sync": {"checkpoint.mode": "sync"},
    "async": {"checkpoint.mode": "async"},
    "overlap": {"checkpoint.mode": "overlap"},
    "overlap-snapshot": {"checkpoint.mode": "overlap", "checkpoint.device_snapshot": "on"},
    "overlap-chunked": {"checkpoint.mode": "overlap", "checkpoint.device_snapshot": "off"},
    # checkpoint.local.dir: a directory under /dev/shm made per run (main()).
    "every-step-local": {"checkpoint.mode": "overlap", "checkpoint.interval": 1, "checkpoint.local.keep_last": 1,
                         "checkpoint.durable.every": 50},
}
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from llama_sizes import add_size_args, n_params, run_train, size_from_args, train_sets  # noqa: E402


def iterations(steps):
    """{k: wall_s[k] - wall_s[k-1]} for every k whose predecessor was logged."""
    return {k: steps[k]["wall_s"] - steps[k - 1]["wall_s"] for k in steps if k - 1 in steps}


def ratio(it, base, ks):
    ks = [k for k in ks if k in it and k in base]
    if not ks:
        return None, 0
    return sum(it[k] for k in ks) / sum(base[k] for k in ks), len(ks)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default=os.path.join(REPO, "build", "train"))
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "llama_tiny.yaml"))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--modes", default="none,async,overlap",
                    help="comma-separated: none, sync, async, overlap, overlap-snapshot, overlap-chunked, "
                         "every-step-local")
    ap.add_argument("--interval", type=int, default=20, help="the save's step (checkpoint.interval)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 2 x interval)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None, help="run and checkpoint directories (default: a temporary one)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    add_size_args(ap)
    a = ap.parse_args()
    size = size_from_args(a)
    steps = a.steps or 2 * a.interval
    modes = [m for m in a.modes.split(",") if m]
    if "none" not in modes:
        modes.insert(0, "none")
    for m in modes:
        if m not in MODES:
            sys.exit("--modes: unknown mode %r (one of %s)" % (m, ", ".join(MODES)))
    if a.interval < 4 or steps <= a.interval:
        sys.exit("--interval must be >= 4 and --steps above it")
    if not os.path.exists(a.train):
        sys.exit("%s not found (build the train target)" % a.train)
    workdir = a.workdir or tempfile.mkdtemp(prefix="train_ckpt_bench_")
    os.makedirs(workdir, exist_ok=True)

    runs = {}
    for mode in modes:
        run_dir = os.path.join(workdir, mode)
        shutil.rmtree(run_dir, ignore_errors=True)
        sets = train_sets(size, a.device, steps)
        sets.update({"train.log_every": 1, "run.dir": run_dir, "checkpoint.resume": "never",
                     "checkpoint.keep_last": 1})
        shm = None
        if mode != "none":
            sets.update({"checkpoint.interval": a.interval})
            sets.update(MODES[mode])
        if mode == "every-step-local":
            shm = tempfile.mkdtemp(prefix="train_ckpt_bench_", dir="/dev/shm")
            sets["checkpoint.local.dir"] = shm + "/{node}"
        for kv in a.set:
            k, _, v = kv.partition("=")
            sets[k] = v
        log = os.path.join(workdir, mode + ".log")
        st, events, wall, _ = run_train(a.train, a.config, sets, run_dir, log)
        runs[mode] = {"steps": st, "events": events, "wall_s": wall}
        print("  %-8s %3d steps logged, %d checkpoint events, process %.1f s" % (mode, len(st), len(events), wall),
              flush=True)
        if mode != "none":
            shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)

    base = iterations(runs["none"]["steps"])
    n = a.interval
    before, around = range(3, n + 1), range(n + 1, steps + 1)
    report = {"device": a.device, "config": size, "n_params": n_params(size), "steps": steps, "interval": n,
              "tokens_per_step": size["batch"] * size["seq_len"],
              "baseline_iteration_s": statistics.median(base[k] for k in before if k in base),
              "modes": {}}
    for mode in modes:
        if mode == "none":
            continue
        it = iterations(runs[mode]["steps"])
        ev = next((e for e in runs[mode]["events"] if int(e["step"]) == n), None)
        r_before, n_before = ratio(it, base, before)
        r_around, n_around = ratio(it, base, around)
        r_save, _ = ratio(it, base, [n + 1])
        r_all, n_all = ratio(it, base, range(3, steps + 1))
        report["modes"][mode] = {
            "blocking_s": ev["blocking_s"] if ev else None, "stage_s": ev["stage_s"] if ev else None,
            "write_s": ev["write_s"] if ev else None, "staging": ev.get("staging") if ev else None, "plan_s": ev["plan_s"] if ev else None,
            "bytes": ev["bytes"] if ev else None, "committed": bool(ev and ev["ok"]),
            "save_iteration_s": it.get(n + 1), "save_iteration_over_none": r_save,
            "around_save_over_none": r_around, "around_save_iterations": n_around,
            "before_save_over_none": r_before, "before_save_iterations": n_before,
            "all_over_none": r_all, "all_iterations": n_all,
            "process_wall_s": runs[mode]["wall_s"],
        }
    report["target_overlap_around_save_max"] = 1.01
    ov = report["modes"].get("overlap", {}).get("around_save_over_none")
    report["target_met"] = None if ov is None else ov <= 1.01

    print("Llama training with a checkpoint at step %d of %d, world 1, %s, %.2fB params, %d tokens/step"
          % (n, steps, a.device, report["n_params"] / 1e9, report["tokens_per_step"]))
    print("  iteration without checkpoints (median of steps 3..%d): %.4f s" % (n, report["baseline_iteration_s"]))
    print("  %-16s %10s %10s %12s %14s %14s %12s %10s" % ("mode", "blocking", "GiB", "save iter", "save iter/none",
                                                              "around/none", "before/none", "all/none"))
    fmt = lambda v, f: f % v if isinstance(v, (int, float)) else "-"
    for mode, m in report["modes"].items():
        print("  %-16s %10s %10s %12s %14s %14s %12s %10s" % (
            mode, fmt(m["blocking_s"], "%.4f"), fmt(m["bytes"] and m["bytes"] / 2**30, "%.2f"),
            fmt(m["save_iteration_s"], "%.4f"), fmt(m["save_iteration_over_none"], "%.3f"),
            fmt(m["around_save_over_none"], "%.4f"), fmt(m["before_save_over_none"], "%.4f"),
            fmt(m["all_over_none"], "%.4f")))
    print("  around = iterations %d..%d (%d) while the save runs; target: overlap around/none <= 1.01: %s"
          % (n + 1, steps, len(around), {True: "met", False: "MISSED", None: "n/a"}[report["target_met"]]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print("  wrote", a.json)
    if not a.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
