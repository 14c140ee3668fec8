#!/usr/bin/python3
"""Training step time of shardkit's Llama (build/llama_ref --time-steps K, world
1, the real Trainer) against PyTorch eager on the same model, weights, batch
and thread count (tests/models/llama_reference.py: fp32 master weights, AdamW,
grad clipping; with --device cuda both sides compute in bf16).

  bench/step_compare.py [--device cpu|cuda] [--steps K] [--repeats R] [--blas-threads N|default] [--json FILE]
                        [--llama-ref PATH] [--d-model N ...] [--pytorch-optimizer auto|fused|foreach|for_loop]
                        [--ours-set KEY=VALUE ...] [--baseline] [--time-optimizer K] [--profile-trace FILE]

PyTorch's AdamW runs fused=True by default (--pytorch-optimizer auto: fused
where that torch has it for the device, else foreach); ours runs its own
defaults (train.optimizer_impl auto, train.fused_kernels true) plus
--ours-set. --baseline also runs ours with train.optimizer_impl for_loop and
train.fused_kernels false (what ours ran before either existed) in every
pair. --time-optimizer K times the AdamW step alone, K times per
implementation, on both sides. --profile-trace has ours profile 3 more steps
in the last pair (bench/trace_top.py FILE tabulates it).

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
sys.path.insert(0, HERE)

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
from llama_sizes import WARMUP, add_size_args, size_from_args, train_sets  # noqa: E402



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


def run_ours(exe, config, sets, out, k, extra_args=()):
    cmd = [exe, "--config", config, "--out", out, "--time-steps", str(k)] + list(extra_args)
    for key, v in sets.items():
        cmd += ["--set", "%s=%s" % (key, v)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
    if p.returncode != 0:
        sys.exit("llama_ref failed (rc %d): %s\n%s" % (p.returncode, " ".join(cmd), p.stdout[-4000:]))


def pytorch_adamw_impl(choice, device):
    """The AdamW implementation the PyTorch side runs."""
    if choice != "auto":
        return choice
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    has_fused = (major, minor) >= (2, 4) or (device == "cuda" and major >= 2)
    return "fused" if has_fused else "foreach"


def time_pytorch_optimizer(model, device, k):
    """The AdamW step alone, k times after one that makes the state, per
    implementation this torch has, on the model's current gradients."""
    params = [p for p in model.parameters()]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {}
    for impl in ("fused", "foreach", "for_loop"):
        try:
            opt = torch.optim.AdamW(params, lr=1e-4, **ref.adamw_kwargs(impl))
            times = []
            for i in range(k + 1):
                sync()
                t0 = time.perf_counter()
                opt.step()
                sync()
                if i > 0:
                    times.append(time.perf_counter() - t0)
            out[impl] = statistics.median(times)
        except (RuntimeError, TypeError, ValueError) as e:
            out[impl] = None
            print("  PyTorch AdamW %s: not timed (%s)" % (impl, str(e).splitlines()[0]))
        opt = None
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def time_pytorch(run, device, k, use_sdpa, both, optimizer_impl=None, time_optimizer=0):
    """Median step time of k steps after WARMUP; with `both`, k steps with
    deterministic algorithms (as ours by default on CUDA), then k with
    PyTorch's defaults. Returns (median, times, [nondeterministic median,
    times], parameters, peak GPU MiB)."""
    res = run["result"]
    pdt = res["mixed_precision"]["param_dtype"]
    if device == "cuda" and hasattr(torch.device, "__enter__"):
        with torch.device(device):  # built on the GPU: a 1B model's CPU init takes long
            model, args = ref.reference_from_run(run)
    else:
        model, args = ref.reference_from_run(run)
    if use_sdpa:
        ref.Attention.forward = sdpa_attention_forward
    model = model.to(device)
    x = run["inputs"][:1].to(device)
    y = run["targets"][:1].to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    stamps = []

    def on_step(i):
        sync()
        stamps.append(time.perf_counter())
        if both and i == WARMUP + k - 1:
            torch.use_deterministic_algorithms(False)

    if both:
        torch.use_deterministic_algorithms(True, warn_only=True)
    sync()
    t0 = time.perf_counter()
    ref.train(model, x, y, res["optim"], int(res["train"]["steps"]), float(res["train"]["grad_clip"]),
              pdt, n_steps=WARMUP + k * (2 if both else 1), on_step=on_step, optimizer_impl=optimizer_impl)
    times = [b - a for a, b in zip([t0] + stamps[:-1], stamps)][WARMUP:]
    peak_mib = torch.cuda.max_memory_allocated() / 1048576.0 if device == "cuda" else None
    det, nondet = times[:k], times[k:]
    opt_times = time_pytorch_optimizer(model, device, time_optimizer) if time_optimizer > 0 else None
    return (statistics.median(det), det, (statistics.median(nondet), nondet) if both else None,
            sum(p.numel() for p in model.parameters()), peak_mib, opt_times)


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
    ap.add_argument("--pytorch-optimizer", default="auto", choices=["auto", "fused", "foreach", "for_loop"],
                    help="PyTorch side's AdamW (auto: fused where that torch has it, else foreach)")
    ap.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for ours (e.g. train.fused_kernels=false)")
    ap.add_argument("--baseline", action="store_true",
                    help="also run ours with train.optimizer_impl=for_loop, train.fused_kernels=false")
    ap.add_argument("--time-optimizer", type=int, default=0, help="time the AdamW step alone K times per impl")
    ap.add_argument("--profile-trace", default=None, help="ours profiles 3 steps in the last pair, trace here")
    add_size_args(ap)
    a = ap.parse_args()

    size = size_from_args(a)
    pdt = "bf16" if a.device == "cuda" else "fp32"
    sets = train_sets(size, a.device, WARMUP)
    for kv in a.ours_set:
        key, _, value = kv.partition("=")
        sets[key] = value
    pt_impl = pytorch_adamw_impl(a.pytorch_optimizer, a.device)
    if not os.path.exists(a.llama_ref):
        sys.exit("%s not found (build the llama_ref target)" % a.llama_ref)
    if a.device == "cuda":
        # The same cuBLAS workspace as ours (comm::use_deterministic_cuda), set
        # before PyTorch makes its first cuBLAS handle.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
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
        if a.baseline:
            base_sets = dict(sets, **{"train.optimizer_impl": "for_loop", "train.fused_kernels": "false"})
            run_ours(a.llama_ref, a.config, base_sets, out, a.steps)
            with open(os.path.join(out, "result.json")) as f:
                base_res = json.load(f)
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
        extra = []
        if a.time_optimizer > 0:
            extra += ["--time-optimizer", str(a.time_optimizer)]
        if a.profile_trace and r == a.repeats - 1:
            extra += ["--profile-trace", os.path.abspath(a.profile_trace)]
        run_ours(a.llama_ref, a.config, sets, out, a.steps, extra)
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
        both = "step_time_nondeterministic_s" in res
        pt_r, pt_times_r, pt_nd, n_params, pt_peak, pt_opt = time_pytorch(
            run, a.device, a.steps, use_sdpa, both, pt_impl, a.time_optimizer)
        ours_r = float(res["step_time_s"])
        pair = {"ours_step_s": ours_r, "pytorch_step_s": pt_r, "ratio": ours_r / pt_r,
                "ours_step_times_s": res.get("step_times_s"), "pytorch_step_times_s": pt_times_r,
                "ours_peak_gpu_mib": res.get("peak_gpu_mib"), "pytorch_peak_gpu_mib": pt_peak,
                "ours_optimizer_step_s": res.get("optimizer_step_s"), "pytorch_optimizer_step_s": pt_opt,
                "ours_profile": res.get("profile")}
        if a.baseline:
            pair.update({"baseline_step_s": float(base_res["step_time_s"]),
                         "baseline_ratio": float(base_res["step_time_s"]) / pt_r,
                         "baseline_peak_gpu_mib": base_res.get("peak_gpu_mib")})
            if "step_time_nondeterministic_s" in base_res:
                pair["baseline_nd_step_s"] = float(base_res["step_time_nondeterministic_s"])
        if both:
            ours_nd = float(res["step_time_nondeterministic_s"])
            pair.update({"ours_nd_step_s": ours_nd, "pytorch_nd_step_s": pt_nd[0], "nd_ratio": ours_nd / pt_nd[0],
                         "ours_nd_step_times_s": res.get("step_times_nondeterministic_s"),
                         "pytorch_nd_step_times_s": pt_nd[1]})
        pairs.append(pair)
        del run
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
        "pytorch_optimizer": pt_impl, "ours_optimizer": res.get("optimizer_impl"),
        "ours_fused_kernels": res.get("fused_kernels"), "ours_sets": a.ours_set,
        "ours_optimizer_step_s": pairs[-1]["ours_optimizer_step_s"],
        "pytorch_optimizer_step_s": pairs[-1]["pytorch_optimizer_step_s"], "ours_profile": res.get("profile"),
        "config": dict(size, **{"param_dtype": pdt, "grad_clip": 1.0}),
    }
    label = " (deterministic)" if both else ""
    rows = [("ours" + label, ours_s, ours_tps, "ours"), ("PyTorch eager" + label, pt_s, pt_tps, "pytorch")]
    if a.baseline:
        report["baseline_step_s"] = statistics.median(p["baseline_step_s"] for p in pairs)
        report["baseline_step_time_ratio"] = statistics.median(p["baseline_ratio"] for p in pairs)
        report["baseline_tokens_per_s"] = tokens / report["baseline_step_s"]
        report["baseline_peak_gpu_mib"] = max((p["baseline_peak_gpu_mib"] or 0) for p in pairs)
        rows.insert(1, ("ours, for_loop, unfused" + label, report["baseline_step_s"],
                        report["baseline_tokens_per_s"], "baseline"))
    if both:
        # Kernels as PyTorch picks them by default: train.deterministic: false.
        nd = {"ours_step_s": statistics.median(p["ours_nd_step_s"] for p in pairs),
              "pytorch_step_s": statistics.median(p["pytorch_nd_step_s"] for p in pairs),
              "step_time_ratio": statistics.median(p["nd_ratio"] for p in pairs)}
        nd["ours_tokens_per_s"], nd["pytorch_tokens_per_s"] = tokens / nd["ours_step_s"], tokens / nd["pytorch_step_s"]
        report["nondeterministic"] = nd
        # What each side does unless told otherwise: ours deterministic, PyTorch not.
        report["defaults_step_time_ratio"] = statistics.median(p["ours_step_s"] / p["pytorch_nd_step_s"] for p in pairs)
        rows += [("ours (default kernels)", nd["ours_step_s"], nd["ours_tokens_per_s"], "nd_ours"),
                 ("PyTorch eager (default)", nd["pytorch_step_s"], nd["pytorch_tokens_per_s"], "nd_pytorch")]
    if a.device == "cuda":
        peak = (a.peak_tflops or 989.0) * 1e12
        name = torch.cuda.get_device_name(0)
        ours_mem = max((p["ours_peak_gpu_mib"] or 0) for p in pairs)
        pt_mem = max((p["pytorch_peak_gpu_mib"] or 0) for p in pairs)
        report.update({"gpu": name, "peak_flops": peak,
                       "ours_mfu": 6.0 * n_params * ours_tps / peak,
                       "pytorch_mfu": 6.0 * n_params * pt_tps / peak,
                       "ours_peak_gpu_mib": ours_mem, "pytorch_peak_gpu_mib": pt_mem,
                       "peak_gpu_ratio": ours_mem / pt_mem if pt_mem else None})
        if a.baseline:
            report["baseline_mfu"] = 6.0 * n_params * report["baseline_tokens_per_s"] / peak
        if both:
            nd = report["nondeterministic"]
            nd["ours_mfu"] = 6.0 * n_params * nd["ours_tokens_per_s"] / peak
            nd["pytorch_mfu"] = 6.0 * n_params * nd["pytorch_tokens_per_s"] / peak
    print("Llama step time, world 1, %s (%s), %d threads, torch %s (ours: torch %s)"
          % (a.device, pdt, threads, torch.__version__, res.get("torch", "?")))
    print("  model: vocab %(vocab)d, seq %(seq_len)d, d_model %(d_model)d, layers %(n_layers)d, heads "
          "%(n_heads)d/%(n_kv_heads)d kv, d_ff %(d_ff)d, batch %(batch)d" % size
          + ", %.2fM params, %d tokens/step" % (n_params / 1e6, tokens))
    print("  attention: ours %s, PyTorch %s; median of %d steps after %d warm-up"
          % (ours_attention, "sdpa" if use_sdpa else "matmul", a.steps, WARMUP))
    print("  AdamW: ours %s (fused kernels %s), PyTorch %s"
          % (res.get("optimizer_impl", "?"), res.get("fused_kernels", "?"), pt_impl))
    hdr = "  %-28s %12s %14s" % ("", "step (s)", "tokens/s")
    if a.device == "cuda":
        hdr += " %8s %14s" % ("MFU", "peak GPU MiB")
    print(hdr)
    for row_label, s_, tps, side in rows:
        line = "  %-28s %12.4f %14.0f" % (row_label, s_, tps)
        if a.device == "cuda":
            d = report["nondeterministic"] if side.startswith("nd_") else report
            side = side[3:] if side.startswith("nd_") else side
            line += " %7.1f%% %14.0f" % (100 * d[side + "_mfu"], report[side + "_peak_gpu_mib"])
        print(line)
    if a.device == "cuda":
        print("  MFU: 6 x parameters x tokens/s over %.0f TFLOP/s (attention's own FLOPs not counted)"
              % (report["peak_flops"] / 1e12))
    if a.time_optimizer > 0:
        def fmt(d):
            return ", ".join("%s %.2f ms" % (k, 1000 * v) for k, v in (d or {}).items() if v is not None)
        print("  AdamW step alone (median of %d): ours %s; PyTorch %s"
              % (a.time_optimizer, fmt(report["ours_optimizer_step_s"]), fmt(report["pytorch_optimizer_step_s"])))
    if a.baseline:
        print("  ratio ours/PyTorch step time before (for_loop AdamW, no fused kernels): %.3f"
              % report["baseline_step_time_ratio"])
    if a.repeats > 1:
        print("  pairs (ours/PyTorch, alternating): " + ", ".join("%.3f" % p["ratio"] for p in pairs))
    if both:
        print("  ratio ours/PyTorch step time, both on PyTorch's default kernels (train.deterministic: false): "
              "%.3f; each side's default (ours deterministic): %.3f"
              % (report["nondeterministic"]["step_time_ratio"], report["defaults_step_time_ratio"]))
    print("  ratio ours/PyTorch step time%s: %.3f (< 1: ours faster%s)"
          % (label, report["step_time_ratio"], "; median of %d pairs" % a.repeats if a.repeats > 1 else ""))
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
