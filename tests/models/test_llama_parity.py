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

Mixture-of-experts cases (m, x, v, w, q) also compare the experts the initial
model routes the probe tokens to (probe_routes.bin, int64 [n_moe_layers,
2 * seq_len, top_k]) and every parameter after the steps (final.safetensors),
the DeepSeek-V3 balancing bias included.

Every case but LoRA's also checks the Hugging Face export of the final
weights (final_hf/, as ckpt export --format hf writes it): the reference
loads it by Hugging Face's tensor names and config.json fields alone
(hf_reference.py: LlamaForCausalLM, Qwen3MoeForCausalLM for m and q, Mixtral for
x), and its logits for the probe must be ours after the steps; for v and w,
which neither MoE format expresses, the export must have been refused in one
line naming the model.moe key.
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

# MoE: FP32_TOL, plus the final parameters and routes.
#  param_abs  every trained parameter after the 20 steps, absolute. AdamW
#             moves each element by about lr per step whatever its gradient's
#             scale, so an element whose gradient is near fp32 noise in some
#             step (m / sqrt(v) ill-conditioned) ends up a few 1e-6 off after
#             mere reordering of the sums: replaying the reference against
#             itself with the batch rows permuted or other micro-batch sizes
#             (the same mathematics) gave up to 9e-6 on single elements
#             (typically 3e-7 to 3e-6), and the dense llama_ref against the
#             reference 2.6e-6. So not the LoRA adapters' 1e-5, which sits on
#             that noise: 5e-5. Faults move parameters by ~1e-2 (the aux loss
#             left out: 0.019; the balancing left out: 0.013), 200x more.
#  bias_abs   the balancing biases after the steps: sums of +-rate, centred,
#             in fp32 from the same integer loads on both sides: equal up to
#             the rounding of the centring (the self-replays above: exactly
#             equal), while one step's move is rate / E at least (1.25e-4).
#  route_tie  the probe's routes are compared exactly as sets per token; a
#             token may differ only where the reference's k-th and (k+1)-th
#             selection scores are within this of each other (a tie at fp32
#             rounding: the scores differ between implementations by ~1e-8).
#             The same kind of tie during training would change one token's
#             experts for a step and fail the losses / parameters; the replay
#             reports its closest tie so such a failure can be told apart (in
#             the self-replays the closest was 5e-7 to 1e-5, the median
#             step's 4e-5 to 1e-4).
MOE_TOL = dict(FP32_TOL, param_abs=5e-5, bias_abs=1e-6, route_tie=1e-6)

# Every MoE key, explicitly, so each case reads the same whatever the C++
# defaults become; the cases override some.
MOE_BASE = {"model.moe.num_experts": 8, "model.moe.top_k": 2, "model.moe.d_ff": 32,
            "model.moe.score_func": "softmax", "model.moe.route_norm": "true", "model.moe.route_scale": 1.0,
            "model.moe.num_shared_experts": 0, "model.moe.first_dense_layers": 0,
            "model.moe.aux_loss_coef": 0.0, "model.moe.load_balance_rate": 0.0, "model.qk_norm": "false"}
MOE_M = dict(MOE_BASE, **{"model.qk_norm": "true", "model.moe.aux_loss_coef": 0.01})

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
    # Mixtures of experts, in fp32: the routing is a discrete choice, but with
    # the same fp32 scores on both sides (up to rounding) the same experts are
    # chosen, so the FP32 tolerances hold; see MOE_TOL for the rest.
    ("m", "fp32, Qwen3-MoE-like: 8 experts top-2 softmax, route_norm, qk_norm, aux loss 0.01",
     MOE_M, MOE_TOL),
    ("x", "fp32, Mixtral-like: 4 experts top-2 softmax, route_norm, d_ff 48",
     dict(MOE_BASE, **{"model.moe.num_experts": 4, "model.moe.d_ff": 48}), MOE_TOL),
    ("v", "fp32, DeepSeek-V3-like: 8 experts top-3 sigmoid, route_scale 2.5, 1 shared, "
          "1 dense layer, bias balancing 0.001",
     dict(MOE_BASE, **{"model.moe.top_k": 3, "model.moe.d_ff": 24, "model.moe.score_func": "sigmoid",
                       "model.moe.route_scale": 2.5, "model.moe.num_shared_experts": 1,
                       "model.moe.first_dense_layers": 1, "model.moe.load_balance_rate": 0.001}), MOE_TOL),
    # Qwen3-30B-A3B's attention shape: head_dim set apart from d_model /
    # n_heads (2048 / 32 = 64 there, head_dim 128), so q_proj and o_proj are
    # [n_heads * head_dim, d_model] and [d_model, n_heads * head_dim], and
    # RoPE and the q/k norms run over head_dim. Its gradient norms (~0.8)
    # stay under the base's clip of 1, so clip at 0.5 to exercise it.
    ("q", "fp32, case m with head_dim 16 apart from d_model 32 / n_heads 4",
     dict(MOE_M, **{"model.d_model": 32, "model.head_dim": 16, "train.grad_clip": 0.5}), MOE_TOL),
    ("w", "fp32, case m with micro_batch_size 2, activation_checkpointing full, bias balancing 0.01",
     dict(MOE_M, **{"train.micro_batch_size": 2, "model.activation_checkpointing": "full",
                    "model.moe.load_balance_rate": 0.01}), MOE_TOL),
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
    if args.qk_norm:
        # likewise the q/k norm (its weights start at 1, but the normalisation
        # itself changes the attention)
        plain = ref.ModelArgs.from_result(dict(res["model"], qk_norm=False))
        m0 = ref.Llama(plain)
        m0.load_hf_state({k: v for k, v in run["weights"].items()
                          if not k.endswith((".q_norm.weight", ".k_norm.weight"))})
        dd = float((ref.probe_logits(m0, run["probe_tokens"], pdt).double() - ours.double()).abs().max())
        t.check(dd > 10 * lim, "qk_norm has an effect",
                "ours vs a reference without q/k norm: max abs %.3g (must exceed %.3g)" % (dd, 10 * lim))
    if args.moe.enabled:
        check_routes(t, run, model, args, pdt, tol)

    # 2. training replay.
    tr, opt = res["train"], res["optim"]
    n = len(res["losses"])
    inputs, targets = run["inputs"], run["targets"]
    if inputs.shape[0] != n:
        t.check(False, "recorded batches", "inputs.bin holds %d steps, result.json %d losses"
                % (inputs.shape[0], n))
        return t
    moe_stats = {} if args.moe.enabled else None
    losses, norms, lrs = ref.train(model, inputs, targets, opt, int(tr["steps"]),
                                   float(tr.get("grad_clip", 0.0)), pdt,
                                   micro_batch_size=tr.get("micro_batch_size"), moe_stats=moe_stats)
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
    if moe_stats:
        # where a routing tie could make both sides pick different experts
        # mid-run (a loss / parameter mismatch from that step on), and how
        # the reference spread the tokens
        margins = moe_stats["margins"]
        s = min(range(n), key=lambda i: margins[i])
        last = moe_stats["loads"][-1]
        t.check(True, "replay routing (info)", "closest tie: margin %.2g at step %d%s; step %d loads: %s"
                % (margins[s], s + 1, " (within route_tie)" if margins[s] <= tol.get("route_tie", 0.0) else "",
                   n, "; ".join(str(load) for load in last)))
        check_step_moe(t, res, moe_stats, tol)
    if args.lora_rank > 0 and "final" in run:
        check_lora(t, run, model, pdt, tol)
    if args.lora_rank == 0:
        check_hf(t, run, pdt, tol)
    if "param_abs" in tol:
        check_final(t, run, model, pdt, tol)
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


def hf_format(m):
    """(model_type, None) that ckpt export --format hf must write for
    result.json's model m, or (None, the model.* key its refusal names): the
    first rule m breaks, in the exporter's order (docs/moe.md)."""
    moe = m.get("moe") or {}
    if int(moe.get("num_experts", 0) or 0) == 0:
        return ("llama", None) if not m.get("qk_norm") else (None, "model.qk_norm")
    if moe.get("score_func", "softmax") != "softmax":
        return None, "model.moe.score_func"
    if float(moe.get("route_scale", 1.0)) != 1.0:
        return None, "model.moe.route_scale"
    if int(moe.get("num_shared_experts", 0) or 0) > 0:
        return None, "model.moe.num_shared_experts"
    if float(moe.get("load_balance_rate", 0) or 0) > 0:
        return None, "model.moe.load_balance_rate"
    if m.get("qk_norm"):
        return "qwen3_moe", None
    if not moe.get("route_norm"):
        return None, "model.moe.route_norm"
    if int(moe.get("first_dense_layers", 0) or 0) > 0:
        return None, "model.moe.first_dense_layers"
    return "mixtral", None


def check_hf(t, run, pdt, tol):
    """The Hugging Face export of the final weights, loaded by Hugging Face's
    names and config.json alone (hf_reference.py), gives our final probe
    logits; or, for a model neither format expresses, the export was refused
    in one line naming the key."""
    import hf_reference as hf_ref
    res = run["result"]
    kind, key = hf_format(res["model"])
    refused = res.get("hf_export_refused")
    if key is not None:
        t.check(refused is not None and (": " + key + " is ") in refused and "\n" not in refused,
                "Hugging Face export refused", "expected one line naming %s; got %r" % (key, refused))
        return
    if refused is not None or "hf_dir" not in run:
        t.check(False, "Hugging Face export", "refused: %r" % refused if refused else "final_hf/ missing")
        return
    try:
        model, _, cfg = hf_ref.load_hf_dir(run["hf_dir"])
    except (ValueError, KeyError) as e:
        t.check(False, "Hugging Face directory", "%s: %s" % (type(e).__name__, e))
        return
    t.check(cfg["model_type"] == kind, "Hugging Face format", "model_type %s (expected %s), architectures %s"
            % (cfg["model_type"], kind, cfg.get("architectures")))
    want_hd = res["model"].get("head_dim")
    t.check(want_hd is None or cfg.get("head_dim") == want_hd, "Hugging Face head_dim",
            "config.json head_dim %s (expected %s)" % (cfg.get("head_dim"), want_hd))
    ours = run["final_probe_logits"]
    theirs = ref.probe_logits(model, run["probe_tokens"], pdt)
    d = float((ours.double() - theirs.double()).abs().max())
    scale = float(theirs.abs().max())
    factor = tol["logits_abs"] if "logits_abs" in tol else tol["logits_abs_scaled"]
    lim = factor * max(1.0, scale)
    t.add("final logits from HF (%s)" % kind, d, d / max(scale, 1e-12), "abs %.0e x max(1,%.2g)"
          % (factor, scale), d <= lim)


def check_routes(t, run, model, args, pdt, tol):
    """The experts each MoE layer of the initial model chose for the probe
    tokens: ours (probe_routes.bin) against the reference's, compared as sets
    per token (the outputs do not depend on the order within the top k; an
    order difference is reported for information). Also that the routing is
    not degenerate: every layer sends the probe to at least 2 experts."""
    moe = args.moe
    n_layers = sum(1 for i in range(args.n_layers) if moe.is_moe_layer(i))
    tokens = run["probe_tokens"]
    rows, k = tokens.numel(), moe.top_k
    if "probe_routes" not in run:
        t.check(False, "probe routes", "probe_routes.bin missing")
        return
    flat = run["probe_routes"]
    if flat.numel() != n_layers * rows * k:
        t.check(False, "probe routes shape", "%d int64 values, expected [%d MoE layers, %d tokens, top_k %d]"
                % (flat.numel(), n_layers, rows, k))
        return
    ours = flat.reshape(n_layers, rows, k)
    theirs, margins = ref.probe_routes(model, tokens, pdt)
    in_range = bool(((ours >= 0) & (ours < moe.num_experts)).all())
    distinct = bool((ours.sort(-1).values[..., 1:] != ours.sort(-1).values[..., :-1]).all()) if k > 1 else True
    t.check(in_range and distinct, "probe routes valid",
            "expert indices in [0, %d) and k distinct per token" % moe.num_experts if in_range and distinct else
            "out of range or repeated experts: %s" % ours[0, :2].tolist())
    same_set = (ours.sort(-1).values == theirs.sort(-1).values).all(-1)
    diff = ~same_set
    tie = margins <= tol.get("route_tie", 0.0)
    bad = diff & ~tie
    n_diff, n_bad = int(diff.sum()), int(bad.sum())
    n_order = int((same_set & (ours != theirs).any(-1)).sum())
    detail = "%d of %d tokens x %d layers chose another set (%d at a tie within %.0e)" % (
        n_diff, rows, n_layers, n_diff - n_bad, tol.get("route_tie", 0.0))
    if n_bad:
        l, r = [int(v) for v in bad.nonzero()[0]]
        detail += "; first: layer %d token %d ours %s reference %s (margin %.2g)" % (
            l, r, ours[l, r].tolist(), theirs[l, r].tolist(), float(margins[l, r]))
    t.check(n_bad == 0, "probe routes (sets)", detail)
    t.check(True, "probe routes order (info)", "%d tokens: same set, another order" % n_order)
    used = [int(ours[l].unique().numel()) for l in range(n_layers)]
    t.check(min(used) >= 2, "routing non-trivial",
            "experts used by the probe per MoE layer: %s of %d (at least 2 each)" % (used, moe.num_experts))
    biases = sorted(n for n in run["weights"] if ref.keeps_fp32(n))
    if biases:  # balancing starts from no bias
        worst = max(float(run["weights"][n].abs().max()) for n in biases)
        t.check(worst == 0.0, "initial biases zero", "%d biases, max |bias| %.3g" % (len(biases), worst))


def check_step_moe(t, res, moe_stats, tol):
    """What result.json may add per step for a mixture of experts, where
    present: "expert_loads" [steps][MoE layers][experts] (top-k choices per
    expert over the step's micro-batches) exactly as the replay's, the
    routing of every training token in aggregate; "moe_aux_losses" [steps]
    (the mean over the MoE layers, micro-batches weighted by rows / B as the
    objective weighs them) within loss_rel, when aux_loss_coef > 0."""
    n = len(res["losses"])
    if "expert_loads" in res:
        ours = res["expert_loads"]
        theirs = moe_stats["loads"]
        shape_ok = len(ours) == n and all(len(a) == len(b) and all(len(x) == len(y) for x, y in zip(a, b))
                                          for a, b in zip(ours, theirs))
        if not shape_ok:
            t.check(False, "expert loads per step", "shape differs from [%d steps][%d layers][%d experts]"
                    % (n, len(theirs[0]), len(theirs[0][0]) if theirs[0] else 0))
        else:
            bad = [i for i in range(n) if [[int(round(v)) for v in layer] for layer in ours[i]] != theirs[i]]
            detail = "%d of %d steps differ" % (len(bad), n)
            if bad:
                i = bad[0]
                detail += "; first step %d: ours %s, reference %s (closest routing tie that step: %.2g)" % (
                    i + 1, ours[i], theirs[i], moe_stats["margins"][i])
            t.check(not bad, "expert loads per step", detail)
    aux = moe_stats.get("aux") or []
    if "moe_aux_losses" in res and aux and aux[0] is not None:
        if len(res["moe_aux_losses"]) != n:
            t.check(False, "aux losses", "%d values for %d steps" % (len(res["moe_aux_losses"]), n))
            return
        da, dr = rel_diffs(res["moe_aux_losses"], aux)
        worst = int(dr.argmax())
        t.add("aux losses", float(da.max()), float(dr.max()), "rel %.0e" % tol["loss_rel"],
              float(dr.max()) <= tol["loss_rel"],
              "worst step %d: ours %.7g ref %.7g" % (worst + 1, res["moe_aux_losses"][worst], aux[worst]))


def check_final(t, run, model, pdt, tol):
    """Every parameter after the steps (final.safetensors) where the
    reference's replay took it, the MoE balancing biases to their own bound;
    that the biases moved where balancing is on; and the logits of our final
    weights as the reference computes them (routing of trained weights)."""
    if "final" not in run:
        t.check(False, "final parameters", "final.safetensors missing")
        return
    final, init = run["final"], run["weights"]
    own = {n: p.detach() for n, p in model.named_parameters()}
    missing, extra = sorted(set(own) - set(final)), sorted(set(final) - set(own))
    if missing or extra:
        t.check(False, "final parameter names", "missing %s, unexpected %s" % (missing[:4], extra[:4]))
        return
    n_steps = len(run["result"]["losses"])
    worst = {False: (0.0, ""), True: (0.0, "")}  # keyed by keeps_fp32 (bias)
    for n, p in own.items():
        d = float((p.double() - final[n].double()).abs().max())
        b = ref.keeps_fp32(n)
        if d > worst[b][0] or not worst[b][1]:
            worst[b] = (d, n)
    d, where = worst[False]
    t.add("parameters after %d steps" % n_steps, d, float("nan"), "abs %.0e" % tol["param_abs"],
          d <= tol["param_abs"], "worst %s" % where)
    biases = sorted(n for n in own if ref.keeps_fp32(n))
    if biases:
        d, where = worst[True]
        t.add("balancing biases (%d)" % len(biases), d, float("nan"), "abs %.0e" % tol["bias_abs"],
              d <= tol["bias_abs"], "worst %s" % where)
        moved = [float((final[n].double() - init[n].double()).abs().max()) for n in biases]
        moved_ref = [float((own[n].double() - init[n].double()).abs().max()) for n in biases]
        t.check(min(moved) > 0 and min(moved_ref) > 0, "biases moved",
                "max |final - init| per layer: ours %s, reference %s"
                % (["%.3g" % v for v in moved], ["%.3g" % v for v in moved_ref]))
    if "final_probe_logits" in run:
        m1, _ = ref.reference_from_run(dict(run, weights=final))
        theirs = ref.probe_logits(m1, run["probe_tokens"], pdt)
        d = float((run["final_probe_logits"].double() - theirs.double()).abs().max())
        scale = float(theirs.abs().max())
        lim = tol["logits_abs"] * max(1.0, scale)
        t.add("final probe logits", d, d / max(scale, 1e-12), "abs %.0e x max(1,%.2g)"
              % (tol["logits_abs"], scale), d <= lim)


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
    """Writes a llama_ref-like directory from the reference itself.
    perturb: None, or a fault the comparison must catch: "logits" (probe
    logits off by 1e-3), "lr" (updates with lr x 1.001, right lrs reported),
    "norm" (grad norms x 1.001), and for MoE "route" (one probe token's
    first expert replaced), "aux" (trained without the aux loss),
    "balance" (the bias never moved), "bias" (a final bias off by 1e-5),
    "head_dim" (final_hf/config.json without its head_dim),
    "loads" (one choice moved between experts in result.json's expert_loads),
    "hf" (experts 0 and 1 of the first MoE layer swapped in final_hf/)."""
    os.makedirs(d, exist_ok=True)
    g = lambda k: sets.get(k, BASE[k])
    truthy = lambda v: str(v).lower() in ("1", "true", "yes")
    m = {"vocab_size": int(g("model.vocab_size")), "seq_len": int(g("model.seq_len")),
         "d_model": int(g("model.d_model")), "n_layers": int(g("model.n_layers")),
         "n_heads": int(g("model.n_heads")), "n_kv_heads": int(g("model.n_kv_heads")),
         "head_dim": int(sets.get("model.head_dim", 0)) or int(g("model.d_model")) // int(g("model.n_heads")),
         "d_ff": int(g("model.d_ff")), "rope_theta": float(g("model.rope_theta")),
         "norm_eps": float(g("model.norm_eps")), "tie_weights": truthy(g("model.tie_weights")),
         "rope_scaling": {"factor": float(sets.get("model.rope_scaling.factor", 0)),
                          "low_freq_factor": float(sets.get("model.rope_scaling.low_freq_factor", 1)),
                          "high_freq_factor": float(sets.get("model.rope_scaling.high_freq_factor", 4)),
                          "original_max_position": int(sets.get("model.rope_scaling.original_max_position", 8192))},
         "qk_norm": truthy(sets.get("model.qk_norm", False))}
    moe_key = lambda k, default, conv: conv(sets.get("model.moe." + k, default))
    if moe_key("num_experts", 0, int) > 0:  # as llama_ref writes model.moe
        m["moe"] = {"num_experts": moe_key("num_experts", 0, int), "top_k": moe_key("top_k", 2, int),
                    "d_ff": moe_key("d_ff", 0, int), "score_func": moe_key("score_func", "softmax", str),
                    "route_norm": moe_key("route_norm", False, truthy),
                    "route_scale": moe_key("route_scale", 1.0, float),
                    "num_shared_experts": moe_key("num_shared_experts", 0, int),
                    "first_dense_layers": moe_key("first_dense_layers", 0, int),
                    "aux_loss_coef": moe_key("aux_loss_coef", 0.0, float),
                    "load_balance_rate": moe_key("load_balance_rate", 0.0, float)}
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
            if p.dim() >= 2:  # matrices and stacked experts; norms 1, MoE biases 0
                p.normal_(0, 0.02)
    ref.save_safetensors(os.path.join(d, "init.safetensors"), dict(model.named_parameters()))
    T, V, G, S = m["seq_len"], m["vocab_size"], train["global_batch_size"], train["steps"]
    probe = torch.randint(V, (2, T))
    logits = ref.probe_logits(model, probe, pdt)
    if perturb == "logits":
        logits = logits + 1e-3
    ref.write_bin(os.path.join(d, "probe_tokens.bin"), probe)
    ref.write_bin(os.path.join(d, "probe_logits.bin"), logits.float())
    if args.moe.enabled:
        routes, _ = ref.probe_routes(model, probe, pdt)
        if perturb == "route":  # token 0 of the first MoE layer: another first choice
            others = [e for e in range(args.moe.num_experts) if e not in routes[0, 0].tolist()]
            routes[0, 0, 0] = others[0]
        ref.write_bin(os.path.join(d, "probe_routes.bin"), routes)
    if perturb == "aux":
        model.args.moe.aux_loss_coef = 0.0  # result.json still says it is on
    if perturb == "balance":
        model.args.moe.load_balance_rate = 0.0  # the bias exists, never moves
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
    moe_stats = {}
    losses, norms, lrs = ref.train(model, inputs, targets, optim_run, S, train["grad_clip"], pdt,
                                   micro_batch_size=train["micro_batch_size"], moe_stats=moe_stats)
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref.write_bin(os.path.join(d, "final_probe_logits.bin"), ref.probe_logits(model, probe, pdt).float())
    if perturb == "bias":
        name = sorted(n for n in final if ref.keeps_fp32(n))[0]
        final[name][0] += 1e-5
    ref.save_safetensors(os.path.join(d, "final.safetensors"), final)
    kind, key = hf_format(m)
    if key is not None:
        refusal = "%s/final_checkpoint: the run's model has no Hugging Face counterpart: %s is ..." % (d, key)
    elif args.lora_rank == 0:
        import hf_reference as hf_ref
        hf_ref.write_hf_dir(os.path.join(d, "final_hf"), model, swap_experts=(perturb == "hf"))
        if perturb == "head_dim":  # config.json without head_dim: Hugging Face reads hidden / heads
            path = os.path.join(d, "final_hf", "config.json")
            with open(path) as f:
                cfg = json.load(f)
            del cfg["head_dim"]
            with open(path, "w") as f:
                json.dump(cfg, f, indent=2)
    if perturb == "lr":
        lrs = [lr / 1.001 for lr in lrs]  # a wrong update, reported lrs right
    if perturb == "norm":
        norms = [x * 1.001 for x in norms]
    res = {"losses": losses, "grad_norms": norms, "lrs": lrs, "model": m, "optim": optim, "train": train,
           "mixed_precision": {"param_dtype": pdt, "reduce_dtype": "fp32"}, "attention": "matmul",
           "threads": torch.get_num_threads(), "device": "cpu"}
    if key is not None:
        res["hf_export_refused"] = refusal
    if args.moe.enabled:  # as llama_ref: per step, loads per layer per expert (doubles), mean aux
        res["expert_loads"] = [[[float(v) for v in layer] for layer in step] for step in moe_stats["loads"]]
        res["moe_aux_losses"] = [a or 0.0 for a in moe_stats["aux"]]
        if perturb == "loads":  # one token's choice moved at step 10, first layer
            res["expert_loads"][9][0][0] += 1
            res["expert_loads"][9][0][1] -= 1
    with open(os.path.join(d, "result.json"), "w") as f:
        json.dump(res, f)


def check_moe_formula():
    """The reference's MoE (moe_reference.py: each expert on its routed rows,
    index_add) against the same semantics written densely: every expert on
    every token, weighted by a [N, E] matrix that is zero off the top k; the
    aux loss from a one-hot mask; their gradients; and one balancing update
    worked by hand. Returns a list of failures."""
    import moe_reference as moe_ref
    failures = []
    g = torch.Generator().manual_seed(7)
    d, N = 16, 40
    for label, cfg in (("softmax, route_norm, aux", {"num_experts": 6, "top_k": 2, "d_ff": 8,
                                                      "route_norm": True, "aux_loss_coef": 0.01}),
                       ("softmax, top-1, no norm", {"num_experts": 4, "top_k": 1, "d_ff": 8}),
                       ("sigmoid, scale 2.5, shared, bias, aux", {
                           "num_experts": 8, "top_k": 3, "d_ff": 8, "score_func": "sigmoid", "route_norm": True,
                           "route_scale": 2.5, "num_shared_experts": 2, "load_balance_rate": 1e-3,
                           "aux_loss_coef": 0.01})):
        args = moe_ref.MoeArgs(cfg, 32)
        block = moe_ref.MoE(d, args)
        with torch.no_grad():
            for name, p in block.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if name.endswith("bias") else 0.5))
        x = torch.randn(N, d, generator=g)
        out = block(x)
        trained = [p for p in block.parameters() if p.requires_grad]

        def grads_of(*values):  # each value's gradients, separately (the aux term's are small)
            out_g = []
            for v in values:
                gs = torch.autograd.grad(v, trained, retain_graph=True, allow_unused=True)
                out_g += [torch.zeros_like(p) if gr is None else gr for p, gr in zip(trained, gs)]
            return out_g

        grads = grads_of(*([out.square().sum()] + ([block.last_aux] if block.last_aux is not None else [])))
        P = dict(block.named_parameters())
        logits = (x @ P["gate.weight"].t()).float()
        scores = logits.softmax(-1) if args.score_func == "softmax" else logits.sigmoid()
        bias = P["gate.e_score_correction_bias"] if "gate.e_score_correction_bias" in P else 0.0
        idx = (scores.detach() + bias).topk(args.top_k, -1).indices
        mask = torch.zeros(N, args.num_experts).scatter(1, idx, 1.0)
        w = scores * mask
        if args.route_norm:
            w = w / w.sum(-1, keepdim=True)
        w = w * args.route_scale
        h = (_silu(torch.einsum("nd,eid->eni", x, P["experts.gate_proj.weight"])) *
             torch.einsum("nd,eid->eni", x, P["experts.up_proj.weight"]))
        y = torch.einsum("eni,edi->end", h, P["experts.down_proj.weight"])
        dense = torch.einsum("ne,end->nd", w, y)
        if args.num_shared_experts:
            dense = dense + (_silu(x @ P["shared_experts.gate_proj.weight"].t()) *
                             (x @ P["shared_experts.up_proj.weight"].t())) @ P["shared_experts.down_proj.weight"].t()
        aux = None
        if args.aux_loss_coef > 0:
            p = logits.softmax(-1) if args.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
            aux = args.num_experts * (mask.sum(0) / N * p.mean(0)).sum()
        dgrads = grads_of(*([dense.square().sum()] + ([aux] if aux is not None else [])))
        # relative to each quantity's largest element (fp32 sums in another order)
        rel = lambda a, b: float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)
        if len(grads) != len(dgrads) or (aux is None) != (block.last_aux is None):
            failures.append("MoE %s: aux loss on one side only" % label)
            continue
        err = max([rel(out, dense)] + [rel(a, b) for a, b in zip(grads, dgrads)])
        if aux is not None:
            err = max(err, rel(block.last_aux, aux))
        good = torch.equal(block.last_routes, idx) and err <= 1e-5
        if not good:
            failures.append("MoE %s: loop vs dense formula: routes equal %s, max rel %.3g"
                            % (label, torch.equal(block.last_routes, idx), err))
        print("self-test MoE formula (%s): loop vs dense, routes, output, aux, gradients: max rel %.2g: %s"
              % (label, err, "pass" if good else "FAIL"))
    # balancing by hand: E 4, rate 0.1, loads [6, 2, 2, 2] (mean 3): signs
    # [-1, 1, 1, 1] x 0.1, centred by their mean 0.05
    r = moe_ref.Router(4, moe_ref.MoeArgs({"num_experts": 4, "top_k": 2, "load_balance_rate": 0.1}, 8))
    r.balance(torch.tensor([6, 2, 2, 2]))
    want = torch.tensor([-0.15, 0.05, 0.05, 0.05])
    bal = float((r.e_score_correction_bias - want).abs().max())
    print("self-test MoE balancing by hand: %s" % ("pass" if bal < 1e-7 else "FAIL (%s)" % r.e_score_correction_bias))
    if bal >= 1e-7:
        failures.append("MoE balancing: %s, expected %s" % (r.e_score_correction_bias.tolist(), want.tolist()))
    return failures


def _silu(v):
    """silu written out, not F.silu: the dense formula is a second writing."""
    return v * torch.sigmoid(v)


def self_test(workdir):
    ok = True
    for f in check_moe_formula():
        print("   ", f)
        ok = False
    fp32_losses = None
    for name, desc, sets, tol in CASES:
        if name in ("d", "e", "f", "l"):
            continue  # same as "a" for the reference (l: needs llama_ref's final weights)
        # MoE cases run in full: "w" is the one with micro-batches in the replay
        d = os.path.join(workdir, "self_" + name)
        fake_run(d, sets)
        t = compare_run(name, ref.load_run(d), tol, fp32_losses if name == "c" else None)
        if name == "a":
            fp32_losses = t and json.load(open(os.path.join(d, "result.json")))["losses"]
        print("self-test case %s (%s): %s" % (name, desc, "pass" if not t.failures else "FAIL"))
        t.show()
        ok &= not t.failures
    cases = {c[0]: c for c in CASES}
    for perturb, case in (("logits", "a"), ("lr", "a"), ("norm", "a"),
                          ("route", "m"), ("aux", "m"), ("balance", "v"), ("bias", "v"), ("balance", "w"),
                          ("loads", "x"), ("hf", "m"), ("hf", "x"), ("head_dim", "q")):
        d = os.path.join(workdir, "self_bad_%s_%s" % (case, perturb))
        fake_run(d, cases[case][2], perturb)
        t = compare_run(case + "/" + perturb, ref.load_run(d), cases[case][3])
        print("self-test perturbed %s/%s: %s (must be detected)"
              % (case, perturb, "detected" if t.failures else "MISSED"))
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
