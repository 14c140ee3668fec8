#!/usr/bin/python3
"""moe: a mixture of experts against a dense llama with the same active
parameters per token, side by side in one invocation, and how evenly the
router spreads the tokens with and without balancing (issue #70).

  bench/moe.py [--train build/train] [--device cpu|cuda] [--worlds 1,2,4]
               [--expert-degrees world,2] [--steps 12] [--rounds 2] [--per-rank-batch 8]
               [--balance-steps 100] [--balance-warmup 10] [--balance-world 1]
               [--balance-rates 0.001,0.01] [--aux-coef 0.01]
               [--data text|copy|reverse|add] [--text FILE]
               [--d-model N] [--n-layers N] [--n-heads N] [--n-kv-heads N] [--seq-len N]
               [--experts E] [--top-k K] [--expert-ff I] [--shared S] [--first-dense N]
               [--dtype fp32|bf16] [--lr 3e-3] [--set key=value]... [--workdir D]
               [--json-out F]

Every job is `train --nproc N` (FSDP over N ranks, parallel.shard -1) on
the same data, seed, attention, d_model, layers, seq_len and per-rank batch
(global batch = per-rank batch x N). Two models:
  dense  the llama with a SwiGLU MLP of width (K + S) x I in every block;
  moe    the same llama whose blocks (after --first-dense dense ones, which
         keep the width (K + S) x I) route each token to K of E SwiGLU
         experts of width I (softmax scores, top-K renormalised), plus S
         shared experts of width I: per token the same MLP parameters and
         FLOPs as the dense block, and the router's E x d_model more (both
         banners' counts are in the JSON).

1. Throughput and memory, per world in --worlds, dense, moe and moe with
   expert parallelism alternated, --rounds times (each value the median of
   its rounds; every round's values are in the side's "rounds"). The moe
   runs in each expert layout of the world besides plain FSDP:
     parallel.expert E for each E of --expert-degrees ("world": the world;
     default world,2) above 1 that divides the world and --experts: each
     rank holds experts / E of the routed experts and tokens travel to them
     by all-to-all; the experts' FSDP runs over the world / E ranks that
     hold the same experts (docs/moe.md, "Expert parallelism"). At worlds
     2 and 4 by default: EP 2 (world 2), EP 4 and EP 2 x FSDP 2 (world 4).
   Each run takes --steps steps; per run, over steps 3..steps of
   metrics.jsonl:
     tokens_per_s   the median of the job's tokens per second (all ranks);
     tokens_per_s_best
                    its best step (the highest over the steps and rounds):
                    on a shared machine whose neighbours slow some steps
                    down (2.5x here), the least disturbed one;
     step_s         the median step;
     peak_rss_mib   each rank's peak resident memory (parameters, AdamW,
                    activations, LibTorch's own), the largest over the steps;
     peak_gpu_mib   with --device cuda, each rank's peak allocated device
                    memory (metrics.jsonl's peak_gpu_mib).
     all_to_all_s   with expert parallelism, the median of rank 0's seconds
                    in the step's all-to-alls (forward and backward;
                    metrics.jsonl's all_to_all_s, which is rank 0's);
     all_to_all_share
                    the median over the steps of rank 0's all_to_all_s /
                    step_time_s, the all-to-alls' share of its step. An
                    all-to-all's seconds include waiting for the slowest
                    rank of the expert group to reach it.
   The moe runs here balance with the bias (model.moe.load_balance_rate
   0.001, no auxiliary loss). Ratios are moe / dense (each layout's moe
   against the same world's dense).
2. Load balance: the moe model at --balance-world ranks for --balance-steps
   steps, once per routing variant, on the same data and seed:
     none       no balancing (load_balance_rate 0, aux_loss_coef 0);
     bias=R     DeepSeek-V3's bias, load_balance_rate R, per --balance-rates;
     aux=C      the auxiliary loss, aux_loss_coef C (--aux-coef), no bias.
   Each step's loads are the tokens each expert received over all ranks
   (metrics.jsonl's expert_load); max/mean is its busiest expert over the
   mean (1: balanced; at most E / K, every token choosing that expert).
   Reported: per MoE layer and overall (the mean over layers; and the worst
   layer) the mean of max/mean over steps 1..warmup (where the router
   starts), over the steps after --balance-warmup, and over the last quarter
   of the steps; the loss over the last 10 steps; vs_none = the overall
   after warm-up over the none variant's.
3. The all-to-all's share of the step, per expert layout: each row's
   "all_to_all_share" and "all_to_all_s" ({layout: value}, null at a world
   with no expert layout) and the top-level "all_to_all" (every layout's
   share and seconds, and how they are measured).

Data (--data): text (default) is language modelling over --text's bytes
(vocabulary 256; default docs/benchmarks.md, the largest page of docs/;
its size and sha256 are in the JSON: the page changes as benchmarks are
documented, so pass --text a fixed copy to compare runs across commits); copy, reverse and add are the
synthetic tasks. On text the skew of the bytes (spaces, e, t...) routes
unevenly from the first step, and without balancing the deeper layers
collapse: one expert is among every token's two (max/mean E / K); on the copy task's uniform random digits the
router starts nearer balance and the imbalance develops as it trains
(docs/moe.md, "Measured").

Precision: fp32 on the CPU (as bench/llama_sizes.py's CPU runs), bf16 compute with fp32 master weights and AdamW on CUDA
(--dtype overrides). The defaults finish in a few minutes on a 2-core CPU
machine; on a GPU machine pass bigger sizes (--d-model, --expert-ff,
--seq-len, ...); worlds above the GPUs that nvidia-smi lists are skipped
(NCCL takes one GPU per rank), and so are expert degrees that divide the
world but not --experts (listed in the JSON's "skipped_expert_layouts").
Prints two tables and one JSON object (and writes it to --json-out).
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from llama_sizes import WARMUP, run_train, train_sets  # noqa: E402

PROG = "moe"
A2A_MEASURE = ("rank 0's: the median over the timed steps of its all_to_all_s / step_time_s (metrics.jsonl "
               "carries rank 0's), then the median over rounds; the all-to-alls' seconds include waiting for the "
               "slowest rank of the expert group")
A2A_NONE = "not measured: no expert layout at these worlds (parallel.expert needs a world of 2 or more)"
# The throughput runs' balancing (and no auxiliary loss).
THROUGHPUT_BALANCE_RATE = 0.001

SIZES = {
    # ~1.7M total, ~0.9M active parameters; about 0.1 s a step at world 1.
    "cpu": dict(seq_len=128, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, experts=8, top_k=2,
                expert_ff=128, shared=1, first_dense=0, per_rank_batch=8),
    "cuda": dict(seq_len=1024, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, experts=16, top_k=2,
                 expert_ff=512, shared=1, first_dense=0, per_rank_batch=8),
}


def fail(msg, code=2):
    print(f"{PROG}: {msg}", file=sys.stderr)
    sys.exit(code)


def dense_ff(size):
    return (size["top_k"] + size["shared"]) * size["expert_ff"]


def model_sets(size, variant):
    """model.* of the dense or the moe llama (the same attention)."""
    sets = {"model.d_ff": dense_ff(size), "model.qk_norm": "true"}
    if variant == "dense":
        sets["model.moe.num_experts"] = 0
        return sets
    sets.update({"model.moe.num_experts": size["experts"], "model.moe.top_k": size["top_k"],
                 "model.moe.d_ff": size["expert_ff"], "model.moe.num_shared_experts": size["shared"],
                 "model.moe.first_dense_layers": size["first_dense"], "model.moe.score_func": "softmax",
                 "model.moe.route_norm": "true", "model.moe.route_scale": 1.0,
                 "model.moe.aux_loss_coef": 0, "model.moe.load_balance_rate": 0})
    return sets


def expert_layouts(world, degrees, experts):
    """The expert layouts run at `world` besides plain FSDP, the largest
    expert degree first: [(expert, expert_shard)], and the degrees left out
    because they divide the world but not `experts`."""
    run, skipped = [], []
    for d in degrees:
        e = world if d == "world" else d
        if e <= 1 or world % e or any(x == e for x, _ in run):
            continue
        if experts % e:
            skipped.append(e)
            continue
        run.append((e, world // e))
    return sorted(run, reverse=True), sorted(set(skipped))


def layout_key(expert, expert_shard):
    """The JSON's name of an expert layout: ep4, ep2xfsdp2."""
    return f"ep{expert}" + (f"xfsdp{expert_shard}" if expert_shard > 1 else "")


def layout_label(expert, expert_shard):
    return f"EP {expert}" + (f" x FSDP {expert_shard}" if expert_shard > 1 else "")


def job_sets(a, size, world, steps, run_dir, variant, extra=None):
    base = dict(size, vocab=a.vocab, d_ff=dense_ff(size), batch=size["per_rank_batch"] * world)
    sets = train_sets(base, a.device, steps)
    sets.update({"run.dir": run_dir, "train.log_every": 1, "checkpoint.resume": "never",
                 "train.micro_batch_size": 0,  # each rank's share in one forward
                 "parallel.replicate": 1, "parallel.shard": -1,
                 "train.mixed_precision.param_dtype": a.dtype,
                 "optim.lr": a.lr, "optim.min_lr": a.lr / 10, "optim.warmup_steps": a.balance_warmup})
    if a.data == "text":
        sets.update({"data.kind": "text", "data.path": a.text})
    else:
        sets.update({"data.kind": "synthetic", "data.task": a.data})
    sets.update(model_sets(size, variant))
    sets.update(extra or {})
    for kv in a.set:
        k, _, v = kv.partition("=")
        sets[k] = v
    return sets


def run_job(a, size, world, steps, variant, tag, extra=None):
    run_dir = os.path.join(a.workdir, tag)
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = job_sets(a, size, world, steps, run_dir, variant, extra)
    recs, _, wall, out = run_train(a.train, a.config, sets, run_dir, os.path.join(a.workdir, tag + ".log"),
                                   nproc=world)
    banner = re.search(r"model llama (\d+) params(?:, (\d+) active per token)?", out)
    params = int(banner.group(1)) if banner else None
    active = int(banner.group(2)) if banner and banner.group(2) else params
    return {"steps": recs, "params": params, "active_params": active, "process_wall_s": wall}


def per_rank_peak(recs, key):
    rows = [r[key] for r in recs if isinstance(r.get(key), list)]
    if not rows:
        return None
    return [max(r[i] for r in rows) for i in range(len(rows[0]))]


def throughput(job):
    timed = [r for k, r in sorted(job["steps"].items()) if k > WARMUP]
    if not timed:
        fail("no steps after the warm-up in metrics.jsonl (--steps too small)", 1)
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
           "tokens_per_s_best": max(r["tokens_per_s"] for r in timed),
           "step_s": statistics.median(r["step_time_s"] for r in timed),
           "peak_rss_mib": per_rank_peak(timed, "peak_rss_mib"),
           "peak_gpu_mib": per_rank_peak(timed, "peak_gpu_mib")}
    if any("all_to_all_s" in r for r in timed):
        if not all("all_to_all_s" in r for r in timed):
            fail("all_to_all_s missing from some steps of metrics.jsonl", 1)
        out["all_to_all_s"] = statistics.median(r["all_to_all_s"] for r in timed)
        out["all_to_all_share"] = statistics.median(r["all_to_all_s"] / max(r["step_time_s"], 1e-12)
                                                    for r in timed)
    return out


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def balance(job, warmup):
    recs = [r for _, r in sorted(job["steps"].items()) if "expert_load_max_over_mean" in r]
    if not recs:
        fail("no expert_load_max_over_mean in metrics.jsonl (is the model a mixture of experts?)", 1)
    layers = len(recs[0]["expert_load_max_over_mean"])
    n = len(recs)
    spans = {"first": recs[:warmup], "after_warmup": recs[warmup:], "last_quarter": recs[n - max(1, n // 4):]}
    out = {"moe_layers": layers, "steps": n}
    for name, span in spans.items():
        per_layer = [mean(r["expert_load_max_over_mean"][i] for r in span) for i in range(layers)]
        out[name] = {"per_layer": per_layer, "overall": mean(per_layer), "worst_layer": max(per_layer)}
    out["loss_last10"] = mean(r["loss"] for r in recs[-10:])
    aux = [r["moe_aux_loss"] for r in recs[warmup:] if r.get("moe_aux_loss")]
    out["aux_loss_after_warmup"] = mean(aux) if aux else None
    # The last step's loads per layer, for a look at where the tokens went.
    out["last_step_expert_load"] = recs[-1]["expert_load"]
    return out


def gpu_count():
    if shutil.which("nvidia-smi") is None:
        return None
    p = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       universal_newlines=True)
    return sum(1 for line in p.stdout.splitlines() if line.startswith("GPU ")) if p.returncode == 0 else None


def fmt(x, spec):
    return "-" if x is None else spec % x


def spread(side, key):
    """The median over rounds, and with 2 or more rounds their range."""
    vals = [x[key] for x in side["rounds"]]
    text = f"{side[key]:.0f}"
    return text + (f" ({min(vals):.0f}-{max(vals):.0f})" if len(vals) > 1 else "")


def ratio(x, y):
    return x / y if x is not None and y else None


def side_summary(rs, world):
    """One side's rounds folded: medians over rounds (per rank for memory)."""
    side = {
        "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
        "tokens_per_s_best": max(x["tokens_per_s_best"] for x in rs),
        "step_s": statistics.median(x["step_s"] for x in rs),
        # Per rank, the median over rounds of each rank's peak.
        "peak_rss_mib": [statistics.median(x["peak_rss_mib"][i] for x in rs) for i in range(world)],
        "peak_gpu_mib": ([statistics.median(x["peak_gpu_mib"][i] for x in rs) for i in range(world)]
                         if all(x["peak_gpu_mib"] for x in rs) else None),
    }
    if all("all_to_all_s" in x for x in rs):
        side["all_to_all_s"] = statistics.median(x["all_to_all_s"] for x in rs)
        side["all_to_all_share"] = statistics.median(x["all_to_all_share"] for x in rs)
    side["rounds"] = rs
    return side


def over(m, d):
    """m / d for tokens/s, the best step, the step and the peaks (the
    largest rank's)."""
    return {
        "tokens_per_s": ratio(m["tokens_per_s"], d["tokens_per_s"]),
        "tokens_per_s_best": ratio(m["tokens_per_s_best"], d["tokens_per_s_best"]),
        "step_s": ratio(m["step_s"], d["step_s"]),
        "peak_rss_mib": ratio(max(m["peak_rss_mib"]), max(d["peak_rss_mib"])),
        "peak_gpu_mib": ratio(max(m["peak_gpu_mib"]), max(d["peak_gpu_mib"]))
        if m["peak_gpu_mib"] and d["peak_gpu_mib"] else None,
    }


def main():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0] + " ...",
                                 epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default=os.path.join(REPO, "build", "train"))
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "llama_tiny.yaml"))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                    help="train.mixed_precision.param_dtype (default fp32 on the CPU, bf16 on CUDA)")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--expert-degrees", default="world,2",
                    help="parallel.expert values run beside FSDP at each world: comma-separated numbers or 'world' "
                         "(the world); each above 1 that divides the world and --experts runs; 'none': no expert "
                         "parallelism (default world,2: EP 2 at world 2, EP 4 and EP 2 x FSDP 2 at world 4)")
    ap.add_argument("--steps", type=int, default=12, help="steps of each throughput run (3.. are timed)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--balance-steps", type=int, default=100)
    ap.add_argument("--balance-warmup", type=int, default=10,
                    help="steps left out of the balance's after-warm-up mean; also optim.warmup_steps")
    ap.add_argument("--balance-world", type=int, default=1)
    ap.add_argument("--balance-rates", default="0.001,0.01")
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--data", choices=["text", "copy", "reverse", "add"], default="text")
    ap.add_argument("--text", default=os.path.join(REPO, "docs", "benchmarks.md"))
    ap.add_argument("--lr", type=float, default=3e-3)
    for key, v in SIZES["cpu"].items():
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None,
                        help=f"default {v} (cpu), {SIZES['cuda'][key]} (cuda)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run")
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()

    if not os.access(a.train, os.X_OK):
        fail(f"{a.train}: not built (cmake --build build --target train)")
    if a.steps <= WARMUP:
        fail(f"--steps must be above {WARMUP} (steps {WARMUP + 1}.. are timed)")
    if a.rounds < 1:
        fail("--rounds must be at least 1")
    if a.balance_steps < a.balance_warmup + 4 or a.balance_warmup < 1:
        fail("--balance-warmup must be >= 1 and --balance-steps at least 4 above it")
    size = dict(SIZES[a.device])
    for key in size:
        v = getattr(a, key)
        if v is not None:
            size[key] = v
    if not 1 <= size["top_k"] <= size["experts"]:
        fail("--top-k must be 1..--experts")
    if size["first_dense"] >= size["n_layers"]:
        fail("--first-dense must leave at least one MoE block")
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    try:
        worlds = [int(w) for w in a.worlds.split(",")]
        rates = [float(r) for r in a.balance_rates.split(",") if r]
    except ValueError:
        fail("--worlds and --balance-rates are comma-separated numbers")
    if any(w < 1 for w in worlds) or any(r <= 0 for r in rates):
        fail("--worlds must be >= 1 and --balance-rates > 0")
    degrees = []
    if a.expert_degrees.strip() not in ("", "none"):
        for d in a.expert_degrees.split(","):
            d = d.strip()
            if d == "world":
                degrees.append(d)
            elif d.isdigit() and int(d) >= 1:
                degrees.append(int(d))
            else:
                fail(f"--expert-degrees: {d!r} is neither a number >= 1 nor 'world'")
    a.vocab = 256
    data = {"kind": a.data}
    if a.data == "text":
        a.text = os.path.abspath(a.text)
        if not os.path.isfile(a.text):
            fail(f"--text {a.text}: no such file")
        with open(a.text, "rb") as f:
            blob = f.read()
        data.update({"path": os.path.relpath(a.text, REPO) if a.text.startswith(REPO + os.sep) else a.text,
                     "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()})
    skipped = []
    if a.device == "cuda":
        gpus = gpu_count()
        if gpus is not None:
            skipped = [w for w in worlds if w > gpus]
            worlds = [w for w in worlds if w <= gpus]
            if a.balance_world > gpus:
                fail(f"--balance-world {a.balance_world}: only {gpus} GPU(s)")
        if not worlds:
            fail("no world in --worlds fits the GPUs")
    keep = a.workdir is not None
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="moe_bench.")
    os.makedirs(a.workdir, exist_ok=True)

    # 1. Throughput and memory: dense, moe (FSDP) and moe in each expert
    # layout, alternated within each world and round.
    bias = {"model.moe.load_balance_rate": THROUGHPUT_BALANCE_RATE}
    layouts, skipped_layouts = {}, []
    for w in worlds:
        layouts[w], left_out = expert_layouts(w, degrees, size["experts"])
        skipped_layouts += [{"world": w, "expert": e, "reason": f"{e} does not divide --experts {size['experts']}"}
                            for e in left_out]
    sides = {w: ["dense", "moe"] + [layout_key(e, s) for e, s in layouts[w]] for w in worlds}
    rounds = {w: {side: [] for side in sides[w]} for w in worlds}
    counts = {}
    for r in range(a.rounds):
        for w in worlds:
            jobs = [("dense", "dense", None), ("moe", "moe", bias)]
            jobs += [(layout_key(e, s), "moe", dict(bias, **{"parallel.expert": e})) for e, s in layouts[w]]
            for side, variant, extra in jobs:
                job = run_job(a, size, w, a.steps, variant, f"{side}_w{w}_r{r}", extra)
                if side in ("dense", "moe"):
                    counts[variant] = {"params": job["params"], "active_params": job["active_params"]}
                t = throughput(job)
                if side not in ("dense", "moe") and "all_to_all_s" not in t:
                    fail(f"world {w} {side}: no all_to_all_s in metrics.jsonl (is parallel.expert on?)", 1)
                rounds[w][side].append(t)
                a2a = (f", all-to-all {t['all_to_all_s']:.3f} s ({100 * t['all_to_all_share']:.0f}% of the step)"
                       if "all_to_all_s" in t else "")
                print(f"world {w} {side:10s} round {r}: {t['tokens_per_s']:.0f} tok/s, step {t['step_s']:.3f} s, "
                      f"peak RSS {max(t['peak_rss_mib']):.0f} MiB{a2a}", file=sys.stderr)
    rows = []
    a2a_layouts = []
    for w in worlds:
        row = {"world": w, "global_batch": size["per_rank_batch"] * w, "tokens_per_step":
               size["per_rank_batch"] * w * size["seq_len"]}
        for variant in ("dense", "moe"):
            row[variant] = side_summary(rounds[w][variant], w)
        d, m = row["dense"], row["moe"]
        row["moe_over_dense"] = over(m, d)
        # The moe in each expert layout, each with its ratios to the dense
        # and to the moe under plain FSDP at this world.
        row["moe_ep"] = {}
        for e, s in layouts[w]:
            key = layout_key(e, s)
            ep = dict({"layout": layout_label(e, s), "expert": e, "expert_shard": s},
                      **side_summary(rounds[w][key], w))
            ep["moe_over_dense"] = over(ep, d)
            ep["over_moe_fsdp"] = over(ep, m)
            row["moe_ep"][key] = ep
            a2a_layouts.append({"layout": key, "label": ep["layout"], "world": w, "expert": e, "expert_shard": s,
                                "share_of_step": ep["all_to_all_share"], "seconds": ep["all_to_all_s"],
                                "step_s": ep["step_s"],
                                "share_of_step_rounds": [x["all_to_all_share"] for x in ep["rounds"]],
                                "seconds_rounds": [x["all_to_all_s"] for x in ep["rounds"]]})
        # The all-to-all's seconds and share of the step, one entry per
        # expert layout of this world (null where there is none).
        row["all_to_all_s"] = {k: ep["all_to_all_s"] for k, ep in row["moe_ep"].items()} or None
        row["all_to_all_share"] = {k: ep["all_to_all_share"] for k, ep in row["moe_ep"].items()} or None
        rows.append(row)

    # 2. Load balance on the same data and seed.
    variants = [("none", {})]
    variants += [(f"bias={r:g}", {"model.moe.load_balance_rate": r}) for r in rates]
    if a.aux_coef > 0:
        variants.append((f"aux={a.aux_coef:g}", {"model.moe.aux_loss_coef": a.aux_coef}))
    bal = []
    for name, extra in variants:
        job = run_job(a, size, a.balance_world, a.balance_steps, "moe", "balance_" + re.sub(r"[^a-z0-9.]", "_", name),
                      extra)
        b = balance(job, a.balance_warmup)
        b = dict({"variant": name, "load_balance_rate": extra.get("model.moe.load_balance_rate", 0),
                  "aux_loss_coef": extra.get("model.moe.aux_loss_coef", 0)}, **b)
        bal.append(b)
        print(f"balance {name:10s}: max/mean first {b['first']['overall']:.2f}, after warm-up "
              f"{b['after_warmup']['overall']:.2f}, last quarter {b['last_quarter']['overall']:.2f}, "
              f"loss {b['loss_last10']:.3f}", file=sys.stderr)
    none = bal[0]["after_warmup"]["overall"]
    for b in bal:
        b["vs_none"] = ratio(b["after_warmup"]["overall"], none)

    if not keep:
        shutil.rmtree(a.workdir, ignore_errors=True)

    # Tables.
    dn, mo = counts["dense"], counts["moe"]
    print(f"MoE (top-{size['top_k']} of {size['experts']} experts of width {size['expert_ff']}, "
          f"{size['shared']} shared, {size['first_dense']} dense first blocks; {mo['params']} params, "
          f"{mo['active_params']} active per token) against dense (MLP width {dense_ff(size)}; "
          f"{dn['params']} params): d_model {size['d_model']}, {size['n_layers']} layers, seq_len "
          f"{size['seq_len']}, {size['per_rank_batch']} sequences per rank, {a.device} {a.dtype}, "
          f"data {a.data}{' ' + data['path'] if a.data == 'text' else ''}")
    gpu = any(r["dense"]["peak_gpu_mib"] for r in rows)
    rng = " (rounds' range)" if a.rounds > 1 else ""
    head = ["world", "MoE layout", "dense tok/s" + rng, "MoE tok/s" + rng, "MoE/dense", "dense best", "MoE best",
            "MoE/dense best", "dense peak RSS MiB by rank",
            "MoE peak RSS MiB by rank", "MoE/dense"]
    if gpu:
        head += ["dense peak GPU MiB", "MoE peak GPU MiB", "MoE/dense"]
    head += ["all-to-all share of step (rank 0)" + rng, "all-to-all s/step (rank 0)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        d = r["dense"]
        moes = [(f"FSDP {r['world']}", r["moe"], r["moe_over_dense"])]
        moes += [(ep["layout"], ep, ep["moe_over_dense"]) for ep in r["moe_ep"].values()]
        for label, m, q in moes:
            cells = [str(r["world"]), label, spread(d, "tokens_per_s"), spread(m, "tokens_per_s"),
                     f"{q['tokens_per_s']:.2f}", f"{d['tokens_per_s_best']:.0f}", f"{m['tokens_per_s_best']:.0f}",
                     f"{q['tokens_per_s_best']:.2f}", " / ".join(f"{x:.0f}" for x in d["peak_rss_mib"]),
                     " / ".join(f"{x:.0f}" for x in m["peak_rss_mib"]), f"{q['peak_rss_mib']:.2f}"]
            if gpu:
                cells += [" / ".join(f"{x:.0f}" for x in d["peak_gpu_mib"] or []),
                          " / ".join(f"{x:.0f}" for x in m["peak_gpu_mib"] or []), fmt(q["peak_gpu_mib"], "%.2f")]
            if "all_to_all_share" in m:
                shares = [x["all_to_all_share"] for x in m["rounds"]]
                cells += [f"{m['all_to_all_share']:.2f}" + (f" ({min(shares):.2f}-{max(shares):.2f})"
                                                             if len(shares) > 1 else ""),
                          f"{m['all_to_all_s']:.4f}"]
            else:
                cells += ["-", "-"]
            print("| " + " | ".join(cells) + " |")
    if a2a_layouts:
        print(f"all-to-all share of the step: {A2A_MEASURE}")
    else:
        print(f"all-to-all share of the step: {A2A_NONE}")
    if skipped:
        print(f"worlds {skipped} skipped: more ranks than GPUs")
    for x in skipped_layouts:
        print(f"world {x['world']} expert {x['expert']} skipped: {x['reason']}")
    print()
    head = ["routing", "max/mean steps 1-%d" % a.balance_warmup, "after warm-up, by MoE layer", "overall",
            "worst layer", "last quarter", "vs none", "loss (last 10)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for b in bal:
        cells = [b["variant"], f"{b['first']['overall']:.2f}",
                 " / ".join(f"{x:.2f}" for x in b["after_warmup"]["per_layer"]),
                 f"{b['after_warmup']['overall']:.2f}", f"{b['after_warmup']['worst_layer']:.2f}",
                 f"{b['last_quarter']['overall']:.2f}", f"{b['vs_none']:.2f}", f"{b['loss_last10']:.3f}"]
        print("| " + " | ".join(cells) + " |")

    result = {
        "benchmark": "moe",
        "command": "bench/moe.py " + " ".join(sys.argv[1:]),
        "device": a.device, "dtype": a.dtype, "cores": os.cpu_count(), "size": size,
        "dense_d_ff": dense_ff(size), "vocab_size": a.vocab, "data": data, "steps": a.steps,
        "timed_steps_from": WARMUP + 1, "rounds": a.rounds, "lr": a.lr,
        "throughput_moe_load_balance_rate": THROUGHPUT_BALANCE_RATE,
        "params": {"dense": dn, "moe": mo,
                   "active_moe_over_dense": ratio(mo["active_params"], dn["active_params"])},
        "expert_degrees": degrees,
        "rows": rows, "skipped_worlds": skipped, "skipped_expert_layouts": skipped_layouts,
        "balance": {"world": a.balance_world, "steps": a.balance_steps, "warmup": a.balance_warmup,
                    "variants": bal},
        # One entry per expert layout (keyed as each row's moe_ep), and
        # every layout's details in "layouts".
        "all_to_all": {"share_of_step": {x["layout"]: x["share_of_step"] for x in a2a_layouts} or None,
                       "seconds": {x["layout"]: x["seconds"] for x in a2a_layouts} or None,
                       "layouts": a2a_layouts, "measured_on": "rank 0",
                       "note": A2A_MEASURE if a2a_layouts else A2A_NONE},
    }
    print(json.dumps(result))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
