#!/usr/bin/python3
"""Training step time of shardkit's Llama (build/llama_ref --time-steps K, world
1, the real Trainer) against PyTorch eager on the same model, weights, batch
and thread count (tests/models/llama_reference.py: fp32 master weights, AdamW,
grad clipping; with --device cuda both sides compute in bf16).

  bench/step_compare.py [--device cpu|cuda] [--steps K] [--repeats R] [--blas-threads N|default] [--json FILE]
                        [--llama-ref PATH] [--d-model N ...]

Both sides run 2 warm-up steps, then K timed steps; the median is reported.
With --repeats R the two alternate R times (ours, PyTorch, ours, ...) and the
ratio is the median of the R pairs' ratios, so a machine whose speed drifts
slows both sides of a pair alike.
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "models"))

# Both sides get the same BLAS pool: OpenBLAS sizes its pool from this
# variable when it loads (with torch, below) and llama_ref inherits it. Left
# unset, OpenBLAS starts one thread per core on each side while LibTorch runs
# 1 intra-op thread, and the two sides' pools then contend with whatever else
# the machine runs, which is what was measured before. --blas-threads sets it.
BLAS_THREADS = "1"
for i, arg in enumerate(sys.argv):
    if arg == "--blas-threads" and i + 1 < len(sys.argv):
        BLAS_THREADS = sys.argv[i + 1]
    elif arg.startswith("--blas-threads="):
        BLAS_THREADS = arg.split("=", 1)[1]
if BLAS_THREADS != "default":
    os.environ["OPENBLAS_NUM_THREADS"] = BLAS_THREADS

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import llama_reference as ref  # noqa: E402

SIZES = {  # vocab, seq_len, d_model, n_layers, n_heads, n_kv_heads, d_ff, batch
    "cpu": dict(vocab=2048, seq_len=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=688, batch=4),
    "cuda": dict(vocab=32768, seq_len=2048, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8, d_ff=2816,
                 batch=8),
}
WARMUP = 2


def sdpa_attention_forward(self, x, cos, sin):
    """Reference attention with F.scaled_dot_product_attention (torch >= 2.0),
    used for the PyTorch side when ours uses SDPA too."""
    a = self.args
    B, T, _ = x.shape
    q = self.q_proj(x).view(B, T, a.n_heads, self.hd).transpose(1, 2)
    k = self.k_proj(x).view(B, T, a.n_kv_heads, self.hd).transpose(1, 2)
    v = self.v_proj(x).view(B, T, a.n_kv_heads, self.hd).transpose(1, 2)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    q = q * cos + ref.rotate_half(q) * sin
    k = k * cos + ref.rotate_half(k) * sin
    n_rep = a.n_heads // a.n_kv_heads
    k, v = ref.repeat_kv(k, n_rep), ref.repeat_kv(v, n_rep)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.o_proj(out.transpose(1, 2).reshape(B, T, a.n_heads * self.hd))


def run_ours(exe, config, sets, out, k):
    cmd = [exe, "--config", config, "--out", out, "--time-steps", str(k)]
    for key, v in sets.items():
        cmd += ["--set", "%s=%s" % (key, v)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
    if p.returncode != 0:
        sys.exit("llama_ref failed (rc %d): %s\n%s" % (p.returncode, " ".join(cmd), p.stdout[-4000:]))


def time_pytorch(run, device, k, use_sdpa):
    res = run["result"]
    pdt = res["mixed_precision"]["param_dtype"]
    model, args = ref.reference_from_run(run)
    if use_sdpa:
        ref.Attention.forward = sdpa_attention_forward
    model = model.to(device)
    x = run["inputs"][:1].to(device)
    y = run["targets"][:1].to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    stamps = []

    def on_step(i):
        sync()
        stamps.append(time.perf_counter())

    sync()
    t0 = time.perf_counter()
    ref.train(model, x, y, res["optim"], int(res["train"]["steps"]), float(res["train"]["grad_clip"]),
              pdt, n_steps=WARMUP + k, on_step=on_step)
    times = [b - a for a, b in zip([t0] + stamps[:-1], stamps)][WARMUP:]
    return statistics.median(times), times, sum(p.numel() for p in model.parameters())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--llama-ref", default=os.path.join(REPO, "build", "llama_ref"))
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "llama_tiny.yaml"))
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--blas-threads", default="1",
                    help="OPENBLAS_NUM_THREADS for both sides ('default': leave OpenBLAS's own choice)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="alternate ours and PyTorch this many times; ratio = median of the pairs' ratios")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16 peak for MFU (default: 989 for H100/H200)")
    ap.add_argument("--attention", choices=["auto", "matmul", "sdpa"], default="auto",
                    help="PyTorch side attention: auto = sdpa when ours reports sdpa and torch has it")
    ap.add_argument("--workdir", default=None)
    for key in SIZES["cpu"]:
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    a = ap.parse_args()

    size = dict(SIZES[a.device])
    for key in size:
        v = getattr(a, key)
        if v is not None:
            size[key] = v
    pdt = "bf16" if a.device == "cuda" else "fp32"
    sets = {
        "model.vocab_size": size["vocab"], "model.seq_len": size["seq_len"], "model.d_model": size["d_model"],
        "model.n_layers": size["n_layers"], "model.n_heads": size["n_heads"],
        "model.n_kv_heads": size["n_kv_heads"], "model.d_ff": size["d_ff"], "model.rope_scaling.factor": 0,
        "model.tie_weights": "false", "model.activation_checkpointing": "none",
        "train.steps": WARMUP, "train.global_batch_size": size["batch"], "train.micro_batch_size": size["batch"],
        "train.grad_clip": 1.0, "train.mixed_precision.param_dtype": pdt,
        "train.mixed_precision.reduce_dtype": "fp32", "train.device": a.device, "train.eval_every": 0,
        "optim.lr": 3e-4, "optim.min_lr": 3e-5, "optim.warmup_steps": 0, "optim.weight_decay": 0.1,
        "data.kind": "synthetic", "data.eval_fraction": 0, "checkpoint.interval": 0, "run.seed": 1234,
    }
    if not os.path.exists(a.llama_ref):
        sys.exit("%s not found (build the llama_ref target)" % a.llama_ref)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch %s has no CUDA device" % torch.__version__)
    workdir = a.workdir or tempfile.mkdtemp(prefix="step_compare_")
    out = os.path.join(workdir, "llama_ref")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)

    # Ours and PyTorch alternate, --repeats times: on a shared machine whose
    # speed drifts, each pair is measured under the same conditions, and the
    # ratio reported is the median of the pairs' ratios.
    pairs = []
    for r in range(a.repeats):
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        run_ours(a.llama_ref, a.config, sets, out, a.steps)
        run = ref.load_run(out)
        res = run["result"]
        threads = int(res.get("threads", torch.get_num_threads()))
        torch.set_num_threads(threads)
        tokens = int(res.get("tokens_per_step", size["batch"] * size["seq_len"]))
        ours_attention = res.get("attention", "?")
        have_sdpa = hasattr(F, "scaled_dot_product_attention")
        use_sdpa = (a.attention == "sdpa") or (a.attention == "auto" and ours_attention == "sdpa" and have_sdpa)
        if use_sdpa and not have_sdpa:
            sys.exit("--attention sdpa: torch %s has no scaled_dot_product_attention" % torch.__version__)
        pt_r, pt_times_r, n_params = time_pytorch(run, a.device, a.steps, use_sdpa)
        ours_r = float(res["step_time_s"])
        pairs.append({"ours_step_s": ours_r, "pytorch_step_s": pt_r, "ratio": ours_r / pt_r,
                      "ours_step_times_s": res.get("step_times_s"), "pytorch_step_times_s": pt_times_r})
    ours_s = statistics.median(p["ours_step_s"] for p in pairs)
    pt_s = statistics.median(p["pytorch_step_s"] for p in pairs)
    ratio = statistics.median(p["ratio"] for p in pairs)
    ours_tps, pt_tps = tokens / ours_s, tokens / pt_s

    report = {
        "step_time_ratio": ratio, "ours_step_s": ours_s, "pytorch_step_s": pt_s,
        "ours_tokens_per_s": ours_tps, "pytorch_tokens_per_s": pt_tps,
        "ours_step_times_s": pairs[-1]["ours_step_times_s"], "pytorch_step_times_s": pairs[-1]["pytorch_step_times_s"],
        "repeats": a.repeats, "pairs": pairs,
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "device": a.device, "threads": threads, "torch_version": torch.__version__,
        "ours_torch_version": res.get("torch"), "param_dtype": pdt,
        "attention": {"ours": ours_attention, "pytorch": "sdpa" if use_sdpa else "matmul"},
        "n_params": n_params, "tokens_per_step": tokens, "timed_steps": a.steps, "warmup_steps": WARMUP,
        "config": dict(size, **{"param_dtype": pdt, "grad_clip": 1.0}),
    }
    rows = [("ours (llama_ref)", ours_s, ours_tps), ("PyTorch eager", pt_s, pt_tps)]
    if a.device == "cuda":
        peak = (a.peak_tflops or 989.0) * 1e12
        name = torch.cuda.get_device_name(0)
        report.update({"gpu": name, "peak_flops": peak,
                       "ours_mfu": 6.0 * n_params * ours_tps / peak,
                       "pytorch_mfu": 6.0 * n_params * pt_tps / peak})
    print("Llama step time, world 1, %s (%s), %d threads, torch %s (ours: torch %s)"
          % (a.device, pdt, threads, torch.__version__, res.get("torch", "?")))
    print("  model: vocab %(vocab)d, seq %(seq_len)d, d_model %(d_model)d, layers %(n_layers)d, heads "
          "%(n_heads)d/%(n_kv_heads)d kv, d_ff %(d_ff)d, batch %(batch)d" % size
          + ", %.2fM params, %d tokens/step" % (n_params / 1e6, tokens))
    print("  attention: ours %s, PyTorch %s; median of %d steps after %d warm-up"
          % (ours_attention, "sdpa" if use_sdpa else "matmul", a.steps, WARMUP))
    hdr = "  %-18s %12s %14s" % ("", "step (s)", "tokens/s")
    if a.device == "cuda":
        hdr += " %8s" % "MFU"
    print(hdr)
    for i, (label, s, tps) in enumerate(rows):
        line = "  %-18s %12.4f %14.0f" % (label, s, tps)
        if a.device == "cuda":
            line += " %7.1f%%" % (100 * (report["ours_mfu"] if i == 0 else report["pytorch_mfu"]))
        print(line)
    if a.repeats > 1:
        print("  pairs (ours/PyTorch, alternating): " + ", ".join("%.3f" % p["ratio"] for p in pairs))
    print("  ratio ours/PyTorch step time: %.3f (< 1: ours faster%s)"
          % (report["step_time_ratio"], "; median of %d pairs" % a.repeats if a.repeats > 1 else ""))
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
