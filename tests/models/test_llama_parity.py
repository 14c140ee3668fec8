#!/usr/bin/python3
"""Parity of shardkit's Llama (build/llama_ref) with a plain-PyTorch reference
(tests/models/llama_reference.py).

  test_llama_parity.py --llama-ref build/llama_ref [--workdir DIR] [--only a,c]
  test_llama_parity.py --self-test     # checks the comparison logic itself

For each case llama_ref trains a small Llama at world 1 through the real
Trainer and writes its initial weights, probe logits, the batches it used and
its per-step losses / grad norms / learning rates. The reference loads the same
weights, replays the same batches with torch.optim.AdamW and the same schedule,
and every quantity is compared within a stated tolerance. Exit 1 on any mismatch.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)


def _python_with_torch():
    """The first of $SHARDKIT_PYTHON and PATH's python3 (as test_dcp.cpp tries
    them) that is not this interpreter and imports torch, or None: a pip
    PyTorch lives in its own environment, not in /usr/bin/python3. Paths are
    compared as given, not resolved: a virtual environment's python3 is a
    link to the system's interpreter, with other packages."""
    names = [os.environ.get("SHARDKIT_PYTHON"), shutil.which("python3")]
    for exe in names:
        if not exe or os.path.abspath(exe) == os.path.abspath(sys.executable):
            continue
        if subprocess.call([exe, "-c", "import torch"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL) == 0:
            return exe
    return None


try:
    import torch
    import llama_reference as ref
except Exception as e:  # a missing torch is a failure, not a skip
    other = _python_with_torch() if isinstance(e, ImportError) else None
    if other is not None and not os.environ.get("SHARDKIT_PARITY_REEXEC"):
        os.environ["SHARDKIT_PARITY_REEXEC"] = "1"
        os.execv(other, [other, os.path.abspath(__file__)] + sys.argv[1:])
    print("FAIL: cannot import torch / the reference (%s: %s); python %s"
          % (type(e).__name__, e, sys.executable))
    sys.exit(1)

BASE = {
    "model.vocab_size": 96, "model.seq_len": 32, "model.d_model": 64, "model.n_layers": 2,
    "model.n_heads": 4, "model.n_kv_heads": 2, "model.d_ff": 160, "model.rope_theta": 10000.0,
    "model.norm_eps": 1e-5, "model.rope_scaling.factor": 0, "model.tie_weights": "false",
    "model.activation_checkpointing": "none",
    "train.steps": 20, "train.global_batch_size": 8, "train.micro_batch_size": 8,
    "train.grad_clip": 1.0, "train.mixed_precision.param_dtype": "fp32",
    "train.mixed_precision.reduce_dtype": "fp32", "train.device": "cpu", "train.eval_every": 0,
    "optim.lr": 3e-3, "optim.min_lr": 3e-4, "optim.warmup_steps": 5, "optim.weight_decay": 0.1,
    "data.kind": "synthetic", "data.eval_fraction": 0, "checkpoint.interval": 0, "run.seed": 1234,
}

FP32_TOL = {"logits_abs": 1e-5, "loss_rel": 1e-4, "grad_norm_rel": 1e-4, "lr_abs": 1e-12}

CASES = [
    ("a", "fp32, GQA (n_kv_heads 2)", {}, FP32_TOL),
    ("b", "fp32, Llama 3.1 rope scaling x8, tied embeddings, n_kv_heads 1",
     {"model.rope_scaling.factor": 8, "model.rope_scaling.low_freq_factor": 1,
      "model.rope_scaling.high_freq_factor": 4, "model.rope_scaling.original_max_position": 16,
      "model.tie_weights": "true", "model.n_kv_heads": 1}, FP32_TOL),
    # bf16 compute: both sides round differently (matmul accumulation order,
    # fused kernels), so per-step losses drift apart a little as training goes on.
    # original_max_position 32 puts RoPE frequencies in all three bands of the
    # Llama 3.1 rule (hd 16: wavelengths 6.3 < 8 high, 19.9 medium, >= 63 > 32 low).
    ("f", "fp32, rope scaling x8 with high, medium and low frequency bands, untied, MHA",
     {"model.rope_scaling.factor": 8, "model.rope_scaling.low_freq_factor": 1,
      "model.rope_scaling.high_freq_factor": 4, "model.rope_scaling.original_max_position": 32,
      "model.n_kv_heads": 4}, FP32_TOL),
    ("c", "bf16 param_dtype, fp32 reduce",
     {"train.mixed_precision.param_dtype": "bf16"},
     {"logits_abs_scaled": 2e-2, "loss0_rel": 1e-3, "loss_rel": 5e-3, "grad_norm_rel": 2e-2,
      "lr_abs": 1e-12}),
    ("d", "fp32, gradient accumulation (micro_batch_size 2)",
     {"train.micro_batch_size": 2}, FP32_TOL),
    ("e", "fp32, activation_checkpointing full",
     {"model.activation_checkpointing": "full"}, FP32_TOL),
    # LoRA on every projection: only the adapters train (AdamW over them
    # alone), the base stays bit-identical; the logits after training
    # (B non-zero) are checked against x W^T + scale x A^T B^T.
    ("l", "fp32, LoRA rank 4, alpha 8 on all seven projections",
     {"model.lora.rank": 4, "model.lora.alpha": 8, "train.grad_clip": 0.05,
      "model.lora.targets": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"},
     dict(FP32_TOL, adapter_abs=1e-5)),
]


def rel_diffs(ours, theirs):
    a = torch.tensor(ours, dtype=torch.float64)
    b = torch.tensor(theirs, dtype=torch.float64)
    d = (a - b).abs()
    return d, d / b.abs().clamp_min(1e-12)


class Table:
    def __init__(self, name):
        self.name, self.rows, self.failures = name, [], []

    def add(self, what, max_abs, max_rel, tol_text, ok, detail=""):
        self.rows.append((what, max_abs, max_rel, tol_text, ok, detail))
        if not ok:
            self.failures.append("case %s: %s mismatch (max abs %.3g, max rel %.3g, tolerance %s)%s"
                                 % (self.name, what, max_abs, max_rel, tol_text,
                                    ("; " + detail) if detail else ""))

    def check(self, cond, what, detail):
        self.rows.append((what, float("nan"), float("nan"), "-", cond, detail))
        if not cond:
            self.failures.append("case %s: %s: %s" % (self.name, what, detail))

    def show(self):
        print("  %-28s %12s %12s  %-26s %s" % ("quantity", "max abs", "max rel", "tolerance", "result"))
        for what, ma, mr, tol, ok, detail in self.rows:
            print("  %-28s %12.3e %12.3e  %-26s %s%s" % (what, ma, mr, tol, "ok" if ok else "MISMATCH",
                                                        ("  " + detail) if detail else ""))


def compare_run(name, run, tol, fp32_losses=None, fp32_probe=None):
    """Compares one llama_ref output against the reference; returns the Table."""
    res = run["result"]
    t = Table(name)
    pdt = res["mixed_precision"]["param_dtype"]
    model, args = ref.reference_from_run(run)
    torch.manual_seed(0)

    # 1. probe logits with the initial weights.
    ours = run["probe_logits"]
    theirs = ref.probe_logits(model, run["probe_tokens"], pdt)
    if tuple(ours.shape) != tuple(theirs.shape):
        t.check(False, "probe logits shape", "ours %s, reference %s" % (tuple(ours.shape), tuple(theirs.shape)))
        return t
    d = (ours.double() - theirs.double()).abs()
    scale = float(theirs.abs().max())
    ma, mr = float(d.max()), float(d.max()) / max(scale, 1e-12)
    if "logits_abs" in tol:
        lim = tol["logits_abs"] * max(1.0, scale)
        t.add("probe logits", ma, mr, "abs %.0e (x max(1,|logit|max=%.2g))" % (tol["logits_abs"], scale),
              ma <= lim)
    else:
        lim = tol["logits_abs_scaled"] * max(1.0, scale)
        t.add("probe logits (bf16)", ma, mr, "abs %.0e x max(1,%.2g)" % (tol["logits_abs_scaled"], scale),
              ma <= lim)

    rs = res["model"].get("rope_scaling") or {}
    if float(rs.get("factor", 0) or 0) != 0:
        # the scaling must matter for these logits, or the case proves nothing
        plain = ref.ModelArgs.from_result(dict(res["model"], rope_scaling={"factor": 0}))
        m0 = ref.Llama(plain)
        m0.load_hf_state(run["weights"])
        dd = float((ref.probe_logits(m0, run["probe_tokens"], pdt).double() - ours.double()).abs().max())
        t.check(dd > 10 * lim, "rope scaling has an effect",
                "ours vs an unscaled reference: max abs %.3g (must exceed %.3g)" % (dd, 10 * lim))

    # 2. training replay.
    tr, opt = res["train"], res["optim"]
    n = len(res["losses"])
    inputs, targets = run["inputs"], run["targets"]
    if inputs.shape[0] != n:
        t.check(False, "recorded batches", "inputs.bin holds %d steps, result.json %d losses"
                % (inputs.shape[0], n))
        return t
    losses, norms, lrs = ref.train(model, inputs, targets, opt, int(tr["steps"]),
                                   float(tr.get("grad_clip", 0.0)), pdt)
    da, dr = rel_diffs(res["losses"], losses)
    if "loss0_rel" in tol:
        t.add("loss step 1", float(da[0]), float(dr[0]), "rel %.0e" % tol["loss0_rel"],
              float(dr[0]) <= tol["loss0_rel"])
    worst = int(dr.argmax())
    t.add("losses (%d steps)" % n, float(da.max()), float(dr.max()), "rel %.0e" % tol["loss_rel"],
          float(dr.max()) <= tol["loss_rel"],
          "worst step %d: ours %.7g ref %.7g" % (worst + 1, res["losses"][worst], losses[worst]))
    da, dr = rel_diffs(res["grad_norms"], norms)
    worst = int(dr.argmax())
    t.add("grad norms (pre-clip)", float(da.max()), float(dr.max()), "rel %.0e" % tol["grad_norm_rel"],
          float(dr.max()) <= tol["grad_norm_rel"],
          "worst step %d: ours %.7g ref %.7g" % (worst + 1, res["grad_norms"][worst], norms[worst]))
    da, _ = rel_diffs(res["lrs"], lrs)
    t.add("learning rates", float(da.max()), float("nan"), "abs %.0e" % tol["lr_abs"],
          float(da.max()) <= tol["lr_abs"])
    clip = float(tr.get("grad_clip", 0.0))
    if clip > 0:
        n_ours = sum(1 for g in res["grad_norms"] if g > clip)
        n_ref = sum(1 for g in norms if g > clip)
        t.check(n_ours > 0 and n_ref > 0, "clipping exercised",
                "%d/%d steps clipped (ours), %d/%d (reference)" % (n_ours, n, n_ref, n))
    t.check(True, "loss step 1 -> %d (info)" % n, "reference %.4f -> %.4f, ours %.4f -> %.4f"
            % (losses[0], losses[-1], res["losses"][0], res["losses"][-1]))
    if args.lora_rank > 0 and "final" in run:
        check_lora(t, run, model, pdt, tol)
    if fp32_probe is not None:
        same = bool(torch.equal(run["probe_logits"], fp32_probe))
        t.check(not same, "bf16 logits differ from fp32",
                "probe logits bitwise equal to the fp32 run's: the forward did not run in bf16" if same else
                "max |bf16 - fp32| logit %.3g" % float((run["probe_logits"] - fp32_probe).abs().max()))
    if fp32_losses is not None:
        t.check(list(res["losses"]) != list(fp32_losses), "bf16 differs from fp32",
                "bf16 losses bitwise equal to the fp32 run's: bf16 compute did not happen"
                if list(res["losses"]) == list(fp32_losses) else
                "max |bf16 - fp32| loss %.3g" % max(abs(a - b) for a, b in zip(res["losses"], fp32_losses)))
    return t


def check_lora(t, run, model, pdt, tol):
    """A LoRA run after its steps: the base bit-identical to the start, the
    adapters where the reference's replay took them, and the logits of our
    final weights (non-zero B) as plain-PyTorch LoRA computes them."""
    init, final = run["weights"], run["final"]
    base = [n for n in init if not ref.is_lora_name(n)]
    changed = [n for n in base if not torch.equal(init[n], final[n])]
    t.check(not changed, "base bit-identical after training",
            "%d base tensors, changed: %s" % (len(base), ", ".join(changed[:3]) or "none"))
    adapters = [n for n in final if ref.is_lora_name(n)]
    moved = [n for n in adapters if not torch.equal(init[n], final[n])]
    t.check(len(moved) == len(adapters) and adapters, "every adapter trained",
            "%d of %d adapter tensors moved" % (len(moved), len(adapters)))
    own = dict(model.named_parameters())
    worst, where = 0.0, ""
    for n in adapters:
        d = float((own[n].detach().double() - final[n].double()).abs().max())
        if d > worst:
            worst, where = d, n
    lim = tol.get("adapter_abs", 1e-4)
    t.add("adapters after %d steps" % len(run["result"]["losses"]), worst, float("nan"), "abs %.0e" % lim,
          worst <= lim, "worst %s" % where)
    ours_final, _ = ref.reference_from_run(dict(run, weights=final))
    theirs = ref.probe_logits(ours_final, run["probe_tokens"], pdt)
    d = float((run["final_probe_logits"].double() - theirs.double()).abs().max())
    scale = float(theirs.abs().max())
    lim = tol.get("logits_abs", 1e-5) * max(1.0, scale)
    t.add("LoRA logits (trained B)", d, d / max(scale, 1e-12), "abs %.0e x max(1,%.2g)"
          % (tol.get("logits_abs", 1e-5), scale), d <= lim)
    # the adapters must matter for these logits, or the check proves nothing
    plain = {n: v for n, v in final.items() if not ref.is_lora_name(n)}
    base_args = ref.ModelArgs.from_result(dict(run["result"]["model"], lora={"rank": 0}))
    m0 = ref.Llama(base_args)
    m0.load_hf_state(plain)
    dd = float((ref.probe_logits(m0, run["probe_tokens"], pdt).double() - theirs.double()).abs().max())
    t.check(dd > 10 * lim, "adapters have an effect", "base-only vs LoRA logits: max abs %.3g (must exceed %.3g)"
            % (dd, 10 * lim))


def run_llama_ref(exe, config, sets, out):
    os.makedirs(out, exist_ok=True)
    cmd = [exe, "--config", config, "--out", out]
    for k, v in sets.items():
        cmd += ["--set", "%s=%s" % (k, v)]
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
    if p.returncode != 0:
        raise RuntimeError("llama_ref failed (rc %d): %s\n%s" % (p.returncode, " ".join(cmd), p.stdout[-4000:]))
    return time.time() - t0


# ---------------------------------------------------------------- self-test

def fake_run(d, sets, perturb=None):
    """Writes a llama_ref-like directory from the reference itself."""
    os.makedirs(d, exist_ok=True)
    g = lambda k: sets.get(k, BASE[k])
    truthy = lambda v: str(v).lower() in ("1", "true", "yes")
    m = {"vocab_size": int(g("model.vocab_size")), "seq_len": int(g("model.seq_len")),
         "d_model": int(g("model.d_model")), "n_layers": int(g("model.n_layers")),
         "n_heads": int(g("model.n_heads")), "n_kv_heads": int(g("model.n_kv_heads")),
         "d_ff": int(g("model.d_ff")), "rope_theta": float(g("model.rope_theta")),
         "norm_eps": float(g("model.norm_eps")), "tie_weights": truthy(g("model.tie_weights")),
         "rope_scaling": {"factor": float(sets.get("model.rope_scaling.factor", 0)),
                          "low_freq_factor": float(sets.get("model.rope_scaling.low_freq_factor", 1)),
                          "high_freq_factor": float(sets.get("model.rope_scaling.high_freq_factor", 4)),
                          "original_max_position": int(sets.get("model.rope_scaling.original_max_position", 8192))}}
    optim = {"lr": float(g("optim.lr")), "min_lr": float(g("optim.min_lr")),
             "warmup_steps": int(g("optim.warmup_steps")), "weight_decay": float(g("optim.weight_decay")),
             "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    train = {"steps": int(g("train.steps")), "global_batch_size": int(g("train.global_batch_size")),
             "micro_batch_size": int(g("train.micro_batch_size")), "grad_clip": float(g("train.grad_clip"))}
    pdt = g("train.mixed_precision.param_dtype")
    args = ref.ModelArgs.from_result(m)
    torch.manual_seed(int(g("run.seed")))
    model = ref.Llama(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    ref.save_safetensors(os.path.join(d, "init.safetensors"), dict(model.named_parameters()))
    T, V, G, S = m["seq_len"], m["vocab_size"], train["global_batch_size"], train["steps"]
    probe = torch.randint(V, (2, T))
    logits = ref.probe_logits(model, probe, pdt)
    if perturb == "logits":
        logits = logits + 1e-3
    ref.write_bin(os.path.join(d, "probe_tokens.bin"), probe)
    ref.write_bin(os.path.join(d, "probe_logits.bin"), logits.float())
    # a learnable task: predict the next token of x -> (x * 3 + 1) mod V sequences
    start = torch.randint(V, (S, G, 1))
    seq = (start + torch.arange(T + 1).view(1, 1, -1) * 7) % V
    inputs, targets = seq[..., :-1].contiguous(), seq[..., 1:].clone()
    targets[..., : T // 4] = ref.IGNORE_INDEX
    ref.write_bin(os.path.join(d, "inputs.bin"), inputs)
    ref.write_bin(os.path.join(d, "targets.bin"), targets)
    if perturb == "lr":
        optim_run = dict(optim, lr=optim["lr"] * 1.001)
    else:
        optim_run = optim
    losses, norms, lrs = ref.train(model, inputs, targets, optim_run, S, train["grad_clip"], pdt)
    if perturb == "lr":
        lrs = [lr / 1.001 for lr in lrs]  # a wrong update, reported lrs right
    if perturb == "norm":
        norms = [x * 1.001 for x in norms]
    res = {"losses": losses, "grad_norms": norms, "lrs": lrs, "model": m, "optim": optim, "train": train,
           "mixed_precision": {"param_dtype": pdt, "reduce_dtype": "fp32"}, "attention": "matmul",
           "threads": torch.get_num_threads(), "device": "cpu"}
    with open(os.path.join(d, "result.json"), "w") as f:
        json.dump(res, f)


def self_test(workdir):
    ok = True
    fp32_losses = None
    for name, desc, sets, tol in CASES:
        if name in ("d", "e", "f", "l"):
            continue  # same as "a" for the reference (l: needs llama_ref's final weights)
        d = os.path.join(workdir, "self_" + name)
        fake_run(d, sets)
        t = compare_run(name, ref.load_run(d), tol, fp32_losses if name == "c" else None)
        if name == "a":
            fp32_losses = t and json.load(open(os.path.join(d, "result.json")))["losses"]
        print("self-test case %s (%s): %s" % (name, desc, "pass" if not t.failures else "FAIL"))
        t.show()
        ok &= not t.failures
    for perturb in ("logits", "lr", "norm"):
        d = os.path.join(workdir, "self_bad_" + perturb)
        fake_run(d, {}, perturb)
        t = compare_run("a/" + perturb, ref.load_run(d), FP32_TOL)
        print("self-test perturbed %s: %s (must be detected)" % (perturb, "detected" if t.failures else "MISSED"))
        for f in t.failures:
            print("   ", f)
        ok &= bool(t.failures)
    # bf16 run claiming fp32 losses must be caught
    d = os.path.join(workdir, "self_c")
    t = compare_run("c/fp32-losses", ref.load_run(d), [c for c in CASES if c[0] == "c"][0][3], ref.load_run(d)["result"]["losses"])
    print("self-test bf16==fp32 losses: %s (must be detected)" % ("detected" if t.failures else "MISSED"))
    ok &= bool(t.failures)
    print("SELF-TEST", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-ref", default=os.path.join(REPO, "build", "llama_ref"))
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "llama_tiny.yaml"))
    ap.add_argument("--workdir", default=None, help="keep the llama_ref outputs here")
    ap.add_argument("--only", default="", help="comma-separated case letters")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    print("python %s, torch %s, %d threads" % (sys.version.split()[0], torch.__version__,
                                               torch.get_num_threads()))
    torch.set_default_dtype(torch.float32)
    workdir = a.workdir or tempfile.mkdtemp(prefix="llama_parity_")
    os.makedirs(workdir, exist_ok=True)
    if a.self_test:
        return self_test(workdir)
    if not os.path.exists(a.llama_ref):
        print("FAIL: %s not found (build the llama_ref target)" % a.llama_ref)
        return 1
    only = set(x for x in a.only.split(",") if x)
    failures, fp32_losses, fp32_probe = [], None, None
    for name, desc, sets, tol in CASES:
        if only and name not in only and not (name == "a" and "c" in only):
            continue
        d = os.path.join(workdir, "case_" + name)
        shutil.rmtree(d, ignore_errors=True)
        s = dict(BASE)
        s.update(sets)
        try:
            secs = run_llama_ref(a.llama_ref, a.config, s, d)
            run = ref.load_run(d)
        except Exception as e:
            msg = "case %s (%s): %s" % (name, desc, e)
            print("FAIL", msg)
            failures.append(msg)
            continue
        t0 = time.time()
        t = compare_run(name, run, tol, fp32_losses if name == "c" else None,
                        fp32_probe if name == "c" else None)
        if name == "a":
            fp32_losses = run["result"]["losses"]
            fp32_probe = run["probe_logits"]
        print("case %s: %s  [llama_ref %.1fs, reference %.1fs, attention %s, threads %s]: %s"
              % (name, desc, secs, time.time() - t0, run["result"].get("attention"),
                 run["result"].get("threads"), "pass" if not t.failures else "FAIL"))
        t.show()
        failures += t.failures
    if failures:
        print("\nFAILED:")
        for f in failures:
            print("  " + f)
        return 1
    print("\nall llama parity cases passed")
    if not a.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
