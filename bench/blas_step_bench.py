#!/usr/bin/env python3
"""Training step time on the reference BLAS against OpenBLAS, side by side.

Runs the real `train` binary on the 12.6M-parameter GPT (configs/default.yaml
with model.d_model 512, model.n_layers 4; 2 local ranks, FSDP, no
checkpoints) once per BLAS per trial, interleaved (trial 1: reference then
OpenBLAS, trial 2: OpenBLAS then reference, ...) so that the machine's drift
hits both alike. The BLAS is chosen per process with LD_PRELOAD of its
libblas.so.3 and liblapack.so.3, so the result does not depend on which one
update-alternatives selects. Step time is rank 0's `step_time_s` from
metrics.jsonl; step 1 (allocations, thread start-up) is skipped.

  python3 bench/blas_step_bench.py [--train build/train] [--steps 3] [--trials 2]
                                   [--nproc 2] [--set key=value]... [--json FILE]

Prints a table and JSON: median s/step per BLAS over every measured step of
every trial, and reference / OpenBLAS. The reference BLAS takes 10-17 s a
step on this project's 2-core machine, so the defaults take 1-2 minutes.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

LIBDIR = "/usr/lib/x86_64-linux-gnu"
# name -> directory holding that implementation's libblas.so.3 and liblapack.so.3
BLAS = {
    "reference": (f"{LIBDIR}/blas", f"{LIBDIR}/lapack"),
    "openblas": (f"{LIBDIR}/openblas-pthread", f"{LIBDIR}/openblas-pthread"),
}
MODEL = ["model.d_model=512", "model.n_layers=4"]


def preload(name):
    blas_dir, lapack_dir = BLAS[name]
    return f"{blas_dir}/libblas.so.3 {lapack_dir}/liblapack.so.3"


def loads_openblas(train, name):
    """Whether `train` under this LD_PRELOAD maps libopenblas (what ldd resolves)."""
    env = dict(os.environ, LD_PRELOAD=preload(name))
    out = subprocess.run(["ldd", train], env=env, capture_output=True, text=True, check=True).stdout
    return "libopenblas" in out


def run_train(args, name, run_dir):
    sets = MODEL + [f"train.steps={args.steps}", "train.log_every=1", "checkpoint.interval=0",
                    "checkpoint.resume=never", f"run.dir={run_dir}",
                    f"checkpoint.dir={run_dir}/ck"] + args.set
    cmd = [args.train, "--nproc", str(args.nproc), "--config", args.config]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, LD_PRELOAD=preload(name))
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"blas_step_bench: {name}: train exited {proc.returncode}\n{proc.stdout}{proc.stderr}")
    params = re.search(r"model \S+ (\d+) params", proc.stdout)
    times = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "step_time_s" in rec:
                times[rec["step"]] = rec["step_time_s"]
    shutil.rmtree(run_dir, ignore_errors=True)
    measured = [times[s] for s in sorted(times) if s > 1]  # step 1 is warm-up
    if not measured:
        sys.exit(f"blas_step_bench: {name}: no step after the first in metrics.jsonl")
    return measured, wall, int(params.group(1)) if params else None


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", default=os.path.join(root, "build", "train"))
    ap.add_argument("--config", default=os.path.join(root, "configs", "default.yaml"))
    ap.add_argument("--steps", type=int, default=3, help="steps per run, the first is skipped")
    ap.add_argument("--trials", type=int, default=2, help="runs per BLAS, interleaved")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="extra config override key=value")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), f"blas_step_bench_{os.getpid()}"))
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be >= 2 (step 1 is skipped)")
    for name, dirs in BLAS.items():
        for d, lib in zip(dirs, ("libblas.so.3", "liblapack.so.3")):
            if not os.path.exists(os.path.join(d, lib)):
                sys.exit(f"blas_step_bench: {d}/{lib} missing (apt-get install libblas3 liblapack3 "
                         "libopenblas0-pthread)")
    # The comparison is only meaningful if LD_PRELOAD really swaps the BLAS.
    for name in BLAS:
        if loads_openblas(args.train, name) != (name == "openblas"):
            sys.exit(f"blas_step_bench: LD_PRELOAD={preload(name)} does not select {name}")

    names = list(BLAS)
    samples = {n: [] for n in names}
    walls = {n: [] for n in names}
    params = None
    load_before = os.getloadavg()[0]
    for trial in range(args.trials):
        order = names if trial % 2 == 0 else names[::-1]
        for name in order:
            measured, wall, params = run_train(args, name, os.path.join(args.dir, name))
            samples[name] += measured
            walls[name].append(wall)
            print(f"trial {trial + 1} {name:9s}: " + " ".join(f"{t:.3f}" for t in measured) +
                  f" s/step (run {wall:.1f} s)", flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)

    med = {n: statistics.median(samples[n]) for n in names}
    out = {
        "overrides": MODEL + args.set, "params": params, "nproc": args.nproc, "steps": args.steps,
        "trials": args.trials, "cores": os.cpu_count(), "loadavg_1m_before": round(load_before, 2),
        "preload": {n: preload(n) for n in names},
        "step_time_s": {n: {"median": med[n], "min": min(samples[n]), "max": max(samples[n]),
                            "samples": samples[n]} for n in names},
        "run_wall_s": walls,
        "reference_over_openblas": med["reference"] / med["openblas"],
    }
    print(f"\nblas_step_bench: GPT {params} params, {args.nproc} ranks, "
          f"{args.trials} trials x {args.steps - 1} measured steps")
    print(f"  {'BLAS':10s} {'median s/step':>14s} {'min':>8s} {'max':>8s}")
    for n in names:
        s = out["step_time_s"][n]
        print(f"  {n:10s} {s['median']:14.3f} {s['min']:8.3f} {s['max']:8.3f}")
    print(f"  reference / openblas: {out['reference_over_openblas']:.1f}x")
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
