"""A plain-PyTorch reference Llama (Llama 3 architecture, Hugging Face names
and rotate-half RoPE) and a replay of shardkit's training step, used to check
build/llama_ref (tests/models/test_llama_parity.py, bench/step_compare.py).
Optionally Qwen3's q/k norm and a mixture-of-experts feed-forward
(tests/models/moe_reference.py: Qwen3-MoE, Mixtral, DeepSeek-V3 routing).

Plain torch ops only (no SDPA, no torch.func): runs on torch 1.13 and 2.x.
"""

import json
import math
import os
import struct

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_reference import MoE, MoeArgs, keeps_fp32, route_margins

IGNORE_INDEX = -100


# ---------------------------------------------------------------- model

class ModelArgs:
    def __init__(self, vocab_size, seq_len, d_model, n_layers, n_heads, n_kv_heads,
                 d_ff, rope_theta=10000.0, norm_eps=1e-5, tie_weights=False,
                 rope_scaling=None, lora=None, qk_norm=False, moe=None, head_dim=None):
        self.vocab_size = int(vocab_size)
        self.seq_len = int(seq_len)
        self.d_model = int(d_model)
        self.n_layers = int(n_layers)
        self.n_heads = int(n_heads)
        self.n_kv_heads = int(n_kv_heads) if n_kv_heads else int(n_heads)
        # Each head's width: Hugging Face's config.head_dim, which Qwen3-MoE
        # sets apart from d_model / n_heads; None or 0: that quotient.
        self.head_dim = int(head_dim) if head_dim else self.d_model // self.n_heads
        self.d_ff = int(d_ff)
        self.rope_theta = float(rope_theta)
        self.norm_eps = float(norm_eps)
        self.tie_weights = bool(tie_weights)
        self.rope_scaling = dict(rope_scaling or {})
        lora = dict(lora or {})
        self.lora_rank = int(lora.get("rank", 0) or 0)
        self.lora_alpha = float(lora.get("alpha", 16.0))
        self.lora_targets = list(lora.get("targets") or [])
        self.qk_norm = bool(qk_norm)
        self.moe = MoeArgs(moe, self.d_ff)

    @classmethod
    def from_result(cls, m):
        """From result.json's "model" object."""
        return cls(m["vocab_size"], m["seq_len"], m["d_model"], m["n_layers"], m["n_heads"],
                   m.get("n_kv_heads") or m["n_heads"], m["d_ff"], m.get("rope_theta", 10000.0),
                   m.get("norm_eps", 1e-5), m.get("tie_weights", False), m.get("rope_scaling"),
                   m.get("lora"), m.get("qk_norm", False), m.get("moe"), m.get("head_dim"))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope_inv_freq(args):
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    rs = args.rope_scaling
    factor = float(rs.get("factor", 0.0) or 0.0)
    if factor == 0.0:
        return inv_freq
    # Hugging Face _compute_llama3_parameters.
    low_freq_factor = float(rs.get("low_freq_factor", 1.0))
    high_freq_factor = float(rs.get("high_freq_factor", 4.0))
    old_context_len = float(rs.get("original_max_position",
                                   rs.get("original_max_position_embeddings", 8192)))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_cos_sin(args, T):
    inv_freq = rope_inv_freq(args)
    t = torch.arange(T).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def repeat_kv(x, n_rep):
    if n_rep == 1:
        return x
    b, kv, t, hd = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, t, hd).reshape(b, kv * n_rep, t, hd)


class LoraLinear(nn.Module):
    """A frozen x W^T plus PEFT's LoRA path, written out in plain ops:
    y = x W^T + (alpha / rank) x A^T B^T, A [rank, in], B [out, rank]."""

    def __init__(self, d_in, d_out, rank, alpha):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in), requires_grad=False)
        self.lora_A = nn.Linear(d_in, rank, bias=False)
        self.lora_B = nn.Linear(rank, d_out, bias=False)
        self.scale = alpha / rank

    def forward(self, x):
        return (torch.matmul(x, self.weight.t()) +
                self.scale * torch.matmul(torch.matmul(x, self.lora_A.weight.t()), self.lora_B.weight.t()))


def linear(args, name, d_in, d_out):
    """nn.Linear, or a LoraLinear where args targets `name`."""
    if args.lora_rank > 0 and name in args.lora_targets:
        return LoraLinear(d_in, d_out, args.lora_rank, args.lora_alpha)
    return nn.Linear(d_in, d_out, bias=False)


def is_lora_name(name):
    return ".lora_A." in name or ".lora_B." in name


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.hd = args.head_dim
        self.q_proj = linear(args, "q_proj", args.d_model, args.n_heads * self.hd)
        self.k_proj = linear(args, "k_proj", args.d_model, args.n_kv_heads * self.hd)
        self.v_proj = linear(args, "v_proj", args.d_model, args.n_kv_heads * self.hd)
        self.o_proj = linear(args, "o_proj", args.n_heads * self.hd, args.d_model)
        if args.qk_norm:  # Qwen3: per-head RMSNorm of q and k, [head_dim] weights
            self.q_norm = RMSNorm(self.hd, args.norm_eps)
            self.k_norm = RMSNorm(self.hd, args.norm_eps)

    def forward(self, x, cos, sin):
        a = self.args
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, a.n_heads, self.hd)
        k = self.k_proj(x).view(B, T, a.n_kv_heads, self.hd)
        if a.qk_norm:  # over each head's dimensions, before the rotary embedding
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, a.n_kv_heads, self.hd).transpose(1, 2)
        cos = cos.to(q.dtype)
        sin = sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        n_rep = a.n_heads // a.n_kv_heads
        k = repeat_kv(k, n_rep)
        v = repeat_kv(v, n_rep)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v)
        out = out.transpose(1, 2).reshape(B, T, a.n_heads * self.hd)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.gate_proj = linear(args, "gate_proj", args.d_model, args.d_ff)
        self.up_proj = linear(args, "up_proj", args.d_model, args.d_ff)
        self.down_proj = linear(args, "down_proj", args.d_ff, args.d_model)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args, layer=0):
        super().__init__()
        self.input_layernorm = RMSNorm(args.d_model, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.d_model, args.norm_eps)
        # blocks < model.moe.first_dense_layers keep the dense MLP
        self.mlp = MoE(args.d_model, args.moe) if args.moe.is_moe_layer(layer) else MLP(args)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.d_model)
        self.layers = nn.ModuleList([DecoderLayer(args, i) for i in range(args.n_layers)])
        self.norm = RMSNorm(args.d_model, args.norm_eps)


class Llama(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        if not args.tie_weights:
            self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)
        if args.lora_rank > 0:  # LoRA: only the adapters train
            for name, p in self.named_parameters():
                p.requires_grad_(is_lora_name(name))

    def forward(self, tokens):
        T = tokens.shape[1]
        x = self.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(self.args, T)
        cos, sin = cos.to(x.device), sin.to(x.device)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        if self.args.tie_weights:
            return F.linear(x, self.model.embed_tokens.weight)
        return self.lm_head(x)

    def moe_blocks(self):
        """The MoE feed-forwards, in layer order (empty for a dense model)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def aux_loss(self):
        """The last forward's load-balancing loss: the mean over the MoE
        layers of each one's (None when off)."""
        terms = [b.last_aux for b in self.moe_blocks() if b.last_aux is not None]
        return torch.stack(terms).mean() if terms else None

    def load_hf_state(self, tensors):
        """Copies {HF name: tensor} into the parameters; every name must match."""
        own = dict(self.named_parameters())
        missing = sorted(set(own) - set(tensors))
        extra = sorted(set(tensors) - set(own))
        if missing or extra:
            raise ValueError("safetensors names do not match the reference: missing %s, unexpected %s"
                             % (missing, extra))
        with torch.no_grad():
            for name, p in own.items():
                t = tensors[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError("%s: shape %s, expected %s" % (name, tuple(t.shape), tuple(p.shape)))
                p.copy_(t.to(p.dtype))


def ce_sum(logits, targets):
    """Summed fp32 cross-entropy over the targets that are not IGNORE_INDEX."""
    V = logits.shape[-1]
    return F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def loss_fn(logits, targets):
    return ce_sum(logits, targets) / (targets != IGNORE_INDEX).sum()


def compute_copy(model, dtype):
    """A copy of the fp32 model in dtype for bf16/fp16 compute; the balancing
    biases stay fp32 (they only choose experts, and are updated in fp32)."""
    import copy
    c = copy.deepcopy(model).to(dtype)
    master = dict(model.named_parameters())
    for name, p in c.named_parameters():
        if keeps_fp32(name):
            p.data = master[name].detach().clone().float()
    return c


# ---------------------------------------------------------------- files

_ST_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def load_safetensors(path):
    """Parses a safetensors file without the safetensors package."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = data[base + b:base + e]
        dt = info["dtype"]
        if dt == "BF16":
            u16 = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u16.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(_ST_DTYPES[dt]).newbyteorder("<"))
        t = torch.from_numpy(arr.copy()).reshape(info["shape"])
        out[name] = t
    return out


def save_safetensors(path, tensors):
    """Writes fp32 tensors (for self-tests)."""
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        b = t.detach().float().contiguous().cpu().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_bin(path, dtype, shape=None):
    """Raw little-endian file -> tensor ("int64" or "float32")."""
    arr = np.fromfile(path, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)
    t = torch.from_numpy(arr)
    return t.reshape(shape) if shape is not None else t


def write_bin(path, t):
    a = t.detach().cpu().contiguous().numpy()
    a.astype(a.dtype.newbyteorder("<")).tofile(path)


def load_run(d):
    """Everything llama_ref wrote into directory d."""
    with open(os.path.join(d, "result.json")) as f:
        res = json.load(f)
    m, tr = res["model"], res["train"]
    T, V = int(m["seq_len"]), int(m["vocab_size"])
    G = int(tr["global_batch_size"])
    run = {"result": res, "weights": load_safetensors(os.path.join(d, "init.safetensors")),
           "probe_tokens": read_bin(os.path.join(d, "probe_tokens.bin"), "int64", (-1, T)),
           "probe_logits": read_bin(os.path.join(d, "probe_logits.bin"), "float32", (-1, T, V))}
    if os.path.exists(os.path.join(d, "final.safetensors")):
        run["final"] = load_safetensors(os.path.join(d, "final.safetensors"))
        run["final_probe_logits"] = read_bin(os.path.join(d, "final_probe_logits.bin"), "float32", (-1, T, V))
    if os.path.isdir(os.path.join(d, "final_hf")):  # the final weights as a Hugging Face directory
        run["hf_dir"] = os.path.join(d, "final_hf")
    rp = os.path.join(d, "probe_routes.bin")
    if os.path.exists(rp):  # MoE: int64 [n_moe_layers, probes * seq_len, top_k], shaped by compare_run
        run["probe_routes"] = read_bin(rp, "int64")
    ip, tp = os.path.join(d, "inputs.bin"), os.path.join(d, "targets.bin")
    if os.path.exists(ip):
        run["inputs"] = read_bin(ip, "int64", (-1, G, T))
        run["targets"] = read_bin(tp, "int64", (-1, G, T))
    return run


# ---------------------------------------------------------------- training

def lr_at(step, optim, total_steps):
    """shardkit's schedule at 1-based step: linear warmup, then cosine to min_lr."""
    lr = float(optim["lr"])
    min_lr = float(optim.get("min_lr", 0.0))
    warmup = int(optim.get("warmup_steps", 0))
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    decay = total_steps - warmup
    if decay <= 0:
        return lr
    p = min(max((step - warmup) / decay, 0.0), 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * p))


_DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def adamw_kwargs(impl):
    """torch.optim.AdamW's keyword for an implementation name of
    train.optimizer_impl: fused, foreach, for_loop; None: torch's default."""
    return {None: {}, "fused": {"fused": True}, "foreach": {"foreach": True},
            "for_loop": {"foreach": False}}[impl]


def train(model, inputs, targets, optim, total_steps, grad_clip, param_dtype="fp32",
          n_steps=None, on_step=None, optimizer_impl=None, micro_batch_size=None, moe_stats=None):
    """Replays shardkit's training: one optimizer step per entry of inputs
    ([steps, B, T]); returns (losses, grad_norms, lrs).

    micro_batch_size (None: B): the step runs micro-batches of that many rows
    in order, accumulating gradients; each one's objective is its summed
    cross-entropy over the step's count of targets (so the step's gradient is
    that of the global mean), plus, for MoE with aux_loss_coef c, c x its
    load-balancing loss x (its rows / B). The reported loss is the
    cross-entropy alone; the grad norm is the whole objective's. With MoE
    load balancing, each MoE layer's bias moves after the optimizer step by
    the step's loads (all micro-batches).

    moe_stats: a dict to fill, per step, with "loads" (per MoE layer, the
    top-k choices per expert, a list of lists), "margins" (the smallest gap
    between a token's k-th and (k+1)-th selection score over the step's
    tokens and MoE layers: where the replay came nearest to a routing tie)
    and "aux" (the load-balancing loss as the objective weighs it: the sum
    over micro-batches of their aux x rows / B, i.e. the mean over equal
    micro-batches; None when aux_loss_coef is 0).

    param_dtype "bf16": fp32 masters and AdamW; a bf16 copy of the model runs
    forward/backward each micro-batch, its gradients converted to fp32 and
    accumulated on the masters."""
    dtype = _DT[param_dtype]
    every = list(model.parameters())
    params = [p for p in every if p.requires_grad]  # LoRA: the adapters; never the MoE biases
    opt = torch.optim.AdamW(params, lr=float(optim["lr"]),
                            betas=(float(optim.get("beta1", 0.9)), float(optim.get("beta2", 0.95))),
                            eps=float(optim.get("eps", 1e-8)),
                            weight_decay=float(optim.get("weight_decay", 0.0)),
                            **adamw_kwargs(optimizer_impl))
    compute = model
    if dtype != torch.float32:
        compute = compute_copy(model, dtype)
    cparams = list(compute.parameters())
    moe = model.args.moe
    aux_coef = moe.aux_loss_coef if moe.enabled else 0.0
    n_steps = inputs.shape[0] if n_steps is None else n_steps
    losses, norms, lrs = [], [], []
    for i in range(n_steps):
        s = i + 1
        x = inputs[i % inputs.shape[0]]
        y = targets[i % targets.shape[0]]
        B = x.shape[0]
        mb = int(micro_batch_size) if micro_batch_size else B
        if compute is not model:
            with torch.no_grad():
                for cp, p in zip(cparams, every):
                    cp.copy_(p)  # rounds to dtype as p.to(dtype) does; the MoE biases stay fp32
                    cp.grad = None
        for p in params:
            p.grad = None
        n_targets = (y != IGNORE_INDEX).sum()
        loss = 0.0
        loads = None
        margin = float("inf")
        aux_step = 0.0 if aux_coef > 0 else None
        for r0 in range(0, B, mb):
            xm, ym = x[r0:r0 + mb], y[r0:r0 + mb]
            ce = ce_sum(compute(xm), ym) / n_targets
            objective = ce
            if aux_coef > 0:
                aux = compute.aux_loss() * (xm.shape[0] / B)
                objective = objective + aux_coef * aux
                aux_step += float(aux)
            objective.backward()
            loss = loss + ce.detach()
            if compute is not model:
                for cp, p in zip(cparams, every):
                    if cp.grad is not None:
                        p.grad = cp.grad.float() if p.grad is None else p.grad + cp.grad.float()
                        cp.grad = None
            step_loads = [b.last_load for b in compute.moe_blocks()]
            loads = step_loads if loads is None else [a + b for a, b in zip(loads, step_loads)]
            if moe_stats is not None:
                for b in compute.moe_blocks():
                    margin = min(margin, float(route_margins(b.last_select, b.last_routes.shape[-1]).min()))
        if grad_clip and grad_clip > 0:
            gn = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
        else:
            gn = 0.0
        lr = lr_at(s, optim, total_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        for block, load in zip(model.moe_blocks(), loads or []):
            block.gate.balance(load)  # no-op unless load_balance_rate > 0
        losses.append(float(loss))
        norms.append(gn)
        lrs.append(lr)
        if moe_stats is not None:
            moe_stats.setdefault("loads", []).append([load.tolist() for load in loads or []])
            moe_stats.setdefault("margins", []).append(margin)
            moe_stats.setdefault("aux", []).append(aux_step)
        if on_step is not None:
            on_step(i)
    return losses, norms, lrs


def reference_from_run(run, param_dtype=None):
    """(fp32 Llama loaded with the run's initial weights, args)."""
    args = ModelArgs.from_result(run["result"]["model"])
    m = Llama(args)
    m.load_hf_state(run["weights"])
    return m, args


def probe_logits(model, tokens, param_dtype="fp32"):
    dtype = _DT[param_dtype]
    with torch.no_grad():
        if dtype == torch.float32:
            return model(tokens).float()
        return compute_copy(model, dtype)(tokens).float()


def probe_routes(model, tokens, param_dtype="fp32"):
    """The experts each MoE layer chooses for tokens [P, T], in layer order:
    (routes int64 [n_moe_layers, P*T, k] in topk's order, margins fp32
    [n_moe_layers, P*T]: each token's gap between its k-th and (k+1)-th
    selection score, how near its choice is to a tie; inf when k = E)."""
    dtype = _DT[param_dtype]
    with torch.no_grad():
        m = model if dtype == torch.float32 else compute_copy(model, dtype)
        m(tokens)
        routes, margins = [], []
        for b in m.moe_blocks():
            routes.append(b.last_routes.clone())
            margins.append(route_margins(b.last_select, b.last_routes.shape[-1]))
    if not routes:
        return torch.zeros(0, tokens.numel(), 0, dtype=torch.int64), torch.zeros(0, tokens.numel())
    return torch.stack(routes), torch.stack(margins)
