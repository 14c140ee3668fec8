#!/usr/bin/python3
"""LoRA against full fine-tuning of the same Llama, side by side in one
invocation: `train --nproc N` (FSDP over N ranks) on bench/llama_sizes.py's
Llama, once per variant, each run taking --steps steps with an async
checkpoint at step --interval (and at its last step). Per variant:

  - sharded_mib: the parameter shards each rank holds (the banner's "MiB on
    this rank"; LoRA: the frozen base and the adapters);
  - state_mib: those plus the fp32 gradients and both AdamW moments of what
    trains, per rank (3 x 4 bytes x trainable / ranks);
  - peak_rss_mib: the largest rank's peak resident memory (metrics.jsonl);
  - step_s: the median iteration (wall_s[k] - wall_s[k-1]) over the steps no
    save touches (3 .. interval);
  - ckpt_mib: the bytes of the checkpoint at step --interval (a LoRA run
    saves the adapters and their AdamW state, not the base);
  - blocking_s: that save's blocking time as the trainer recorded it.

Variants: full (every weight trains), lora (model.lora.rank --rank on
--targets), lora-bf16 (the same with model.lora.base_dtype bf16). Ratios are
against full. Prints a table and JSON (--json FILE too).

  bench/lora_finetune.py [--train build/train] [--nproc 2] [--steps 12]
                         [--interval 6] [--rank 16] [--targets q_proj,k_proj,v_proj,o_proj]
                         [--json FILE] [--workdir DIR] [--set key=value]... [--d-model N ...]
"""

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from llama_sizes import add_size_args, n_params, run_train, size_from_args, train_sets  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default=os.path.join(REPO, "build", "train"))
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "llama_tiny.yaml"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--interval", type=int, default=6)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    add_size_args(ap)
    a = ap.parse_args()
    if a.interval < 4 or a.steps <= a.interval:
        sys.exit("--interval must be >= 4 and --steps above it")
    if not os.path.exists(a.train):
        sys.exit("%s not found (build the train target)" % a.train)
    size = size_from_args(a)
    workdir = a.workdir or tempfile.mkdtemp(prefix="lora_bench_")
    os.makedirs(workdir, exist_ok=True)
    lora = {"model.lora.rank": a.rank, "model.lora.alpha": 2 * a.rank, "model.lora.targets": a.targets}
    variants = [("full", {}), ("lora", lora), ("lora-bf16", dict(lora, **{"model.lora.base_dtype": "bf16"}))]

    report = {"device": a.device, "nproc": a.nproc, "config": size, "n_params": n_params(size),
              "steps": a.steps, "interval": a.interval, "lora_rank": a.rank, "lora_targets": a.targets,
              "variants": {}}
    for name, extra in variants:
        run_dir = os.path.join(workdir, name)
        shutil.rmtree(run_dir, ignore_errors=True)
        sets = train_sets(size, a.device, a.steps)
        sets.update({"train.log_every": 1, "run.dir": run_dir, "checkpoint.resume": "never",
                     "checkpoint.interval": a.interval, "checkpoint.mode": "async", "checkpoint.keep_last": 0,
                     "train.micro_batch_size": 0})  # each rank's share in one forward
        sets.update(extra)
        for kv in a.set:
            k, _, v = kv.partition("=")
            sets[k] = v
        steps, events, wall, out = run_train(a.train, a.config, sets, run_dir, os.path.join(workdir, name + ".log"),
                                             nproc=a.nproc)
        banner = re.search(r"model llama (\d+) params(?: \((\d+) trainable)?.*?, ([0-9.]+) MiB on this rank", out)
        it = {k: steps[k]["wall_s"] - steps[k - 1]["wall_s"] for k in steps if k - 1 in steps}
        quiet = [it[k] for k in range(3, a.interval + 1) if k in it]
        ev = next((e for e in events if int(e["step"]) == a.interval), None)
        rss = max(max(r["peak_rss_mib"]) if isinstance(r["peak_rss_mib"], list) else r["peak_rss_mib"]
                  for r in steps.values())
        report["variants"][name] = {
            "params": int(banner.group(1)) if banner else None,
            "trainable": int(banner.group(2) or banner.group(1)) if banner else None,
            "sharded_mib": float(banner.group(3)) if banner else None,
            "state_mib": (float(banner.group(3)) + 12.0 * int(banner.group(2) or banner.group(1)) / a.nproc / 2**20)
            if banner else None,
            "peak_rss_mib": rss,
            "step_s": statistics.median(quiet) if quiet else None,
            "ckpt_mib": ev["bytes"] / 2**20 if ev else None,
            "blocking_s": ev["blocking_s"] if ev else None,
            "final_loss": steps[max(steps)]["loss"] if steps else None,
            "process_wall_s": wall,
        }
        print("  %-9s done in %.1f s" % (name, wall), flush=True)
        shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)

    full = report["variants"]["full"]
    for v in report["variants"].values():
        for key in ("sharded_mib", "state_mib", "peak_rss_mib", "step_s", "ckpt_mib", "blocking_s"):
            v[key + "_over_full"] = (v[key] / full[key]) if v[key] is not None and full[key] else None

    print("LoRA (rank %d on %s) against full fine-tuning: Llama %.1fM params, %d ranks (FSDP), %s, "
          "async checkpoint at step %d" % (a.rank, a.targets, report["n_params"] / 1e6, a.nproc, a.device,
                                           a.interval))
    print("  %-9s %10s %16s %16s %10s %10s %10s %11s" % ("variant", "trainable", "params MiB/rank",
                                                         "+grads+AdamW", "peak RSS", "step s", "ckpt MiB",
                                                         "blocking s"))
    for name, v in report["variants"].items():
        def f(x, spec):
            return "-" if x is None else spec % x
        print("  %-9s %10s %16s %16s %10s %10s %10s %11s" % (
            name, f(v["trainable"], "%d"), f(v["sharded_mib"], "%.2f") + f(v["sharded_mib_over_full"], " (%.2fx)"),
            f(v["state_mib"], "%.2f") + f(v["state_mib_over_full"], " (%.2fx)"),
            f(v["peak_rss_mib"], "%.0f"), f(v["step_s"], "%.3f"), f(v["ckpt_mib"], "%.2f"), f(v["blocking_s"], "%.4f")))
    print(json.dumps(report))
    if a.json:
        with open(a.json, "w") as fo:
            json.dump(report, fo, indent=1)
            fo.write("\n")
    if not a.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
