"""The Llama sizes and `--set` overrides that bench/step_compare.py,
bench/train_ckpt_bench.py and bench/lora_finetune.py run, and the `train`
run the last two share (no torch import: those run without a Python
PyTorch)."""
import json
import os
import subprocess
import sys
import time

WARMUP = 2

SIZES = {  # vocab, seq_len, d_model, n_layers, n_heads, n_kv_heads, d_ff, batch
    "cpu": dict(vocab=2048, seq_len=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=688, batch=4),
    # 1.11B parameters, Llama 3.2 1B's shape (d_model 2048, 16 layers, 32/8
    # heads, d_ff 8192) with an untied 32K vocabulary; 8192 tokens per step.
    "cuda": dict(vocab=32768, seq_len=2048, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
                 batch=4),
}


def add_size_args(ap):
    """--vocab, --seq-len, --d-model ... overriding the device's size."""
    for key in SIZES["cpu"]:
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None)


def size_from_args(a):
    size = dict(SIZES[a.device])
    for key in size:
        v = getattr(a, key)
        if v is not None:
            size[key] = v
    return size


def n_params(size):
    """Parameters of the untied Llama of `size` (embedding, head, norms)."""
    d, f, v, L = size["d_model"], size["d_ff"], size["vocab"], size["n_layers"]
    kv = d // size["n_heads"] * size["n_kv_heads"]
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    return 2 * v * d + L * per_layer + d


def train_sets(size, device, steps):
    """configs/llama_tiny.yaml overrides: this size, bf16 compute with fp32
    masters on CUDA (fp32 on the CPU), no activation checkpointing, one
    micro-batch, synthetic data, no eval, no checkpoints."""
    pdt = "bf16" if device == "cuda" else "fp32"
    return {
        "model.vocab_size": size["vocab"], "model.seq_len": size["seq_len"], "model.d_model": size["d_model"],
        "model.n_layers": size["n_layers"], "model.n_heads": size["n_heads"],
        "model.n_kv_heads": size["n_kv_heads"], "model.d_ff": size["d_ff"], "model.rope_scaling.factor": 0,
        "model.tie_weights": "false", "model.activation_checkpointing": "none",
        "train.steps": steps, "train.global_batch_size": size["batch"], "train.micro_batch_size": size["batch"],
        "train.grad_clip": 1.0, "train.mixed_precision.param_dtype": pdt,
        "train.mixed_precision.reduce_dtype": "fp32", "train.device": device, "train.eval_every": 0,
        "optim.lr": 3e-4, "optim.min_lr": 3e-5, "optim.warmup_steps": 0, "optim.weight_decay": 0.1,
        "data.kind": "synthetic", "data.eval_fraction": 0, "checkpoint.interval": 0, "run.seed": 1234,
    }


def run_train(exe, config, sets, run_dir, log, nproc=None):
    """Runs `exe --config config [--nproc N] --set k=v ...` with its output in
    `log`; exits naming the command and the log's tail when it fails. Returns
    (steps: {step: metrics.jsonl record}, checkpoint events, wall seconds,
    the log's text)."""
    cmd = [exe] + (["--nproc", str(nproc)] if nproc is not None else []) + ["--config", config]
    for key, v in sets.items():
        cmd += ["--set", "%s=%s" % (key, v)]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ %s\n" % " ".join(cmd))
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    with open(log) as f:
        out = f.read()
    if p.returncode != 0:
        sys.exit("train failed (rc %d): %s\n%s" % (p.returncode, " ".join(cmd), out[-4000:]))
    steps, events = {}, []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("event") == "checkpoint":
                events.append(r)
            elif "step" in r and "wall_s" in r and "event" not in r:
                steps[int(r["step"])] = r
    return steps, events, wall, out
