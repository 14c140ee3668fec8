"""Loads a Hugging Face model directory into the plain-PyTorch reference
Llama (llama_reference.py) by Hugging Face's own tensor names and config.json
fields, as transformers' LlamaForCausalLM, Qwen3MoeForCausalLM and
MixtralForCausalLM read them, written from their published configs and
checkpoints, not from shardkit's C++ mapping (models/hf_moe.cpp):

  LlamaForCausalLM     dense; intermediate_size is the MLP's width
  Qwen3MoeForCausalLM  q_norm/k_norm on every layer; a layer is sparse unless
                       mlp_only_layers lists it (decoder_sparse_step 1);
                       experts model.layers.N.mlp.experts.K.{gate,up,down}_proj
                       of width moe_intermediate_size; router mlp.gate; top-k
                       weights renormalised when norm_topk_prob
  MixtralForCausalLM   every layer sparse; router block_sparse_moe.gate;
                       experts block_sparse_moe.experts.K.{w1 (gate), w3 (up),
                       w2 (down)} of width intermediate_size; top-k weights
                       always renormalised

All three route by a softmax over the experts, unscaled, with no shared
expert. The reference holds each layer's experts stacked along a new dim 0,
so the per-expert tensors are stacked here. Also writes such a directory from
a reference model (write_hf_dir), for the parity script's self-test.
"""

import json
import os

import torch

import llama_reference as ref

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
# (ours, Hugging Face's) per expert projection
EXPERT_NAMES = {"qwen3_moe": (("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj")),
                "mixtral": (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))}
MOE_BLOCK = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}


def read_tensors(d):
    """Every tensor of the directory: model.safetensors, or the shards its
    model.safetensors.index.json maps."""
    index = os.path.join(d, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for name in files:
        out.update(ref.load_safetensors(os.path.join(d, name)))
    return out


def model_args(cfg):
    """ModelArgs from config.json's fields (head_dim, as Hugging Face's
    attention reads it, when present); raises ValueError for what the
    reference cannot be (another model type, sparse steps)."""
    kind = cfg.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError("model_type %r: not one of %s" % (kind, sorted(ARCHITECTURES)))
    if cfg.get("architectures") != [ARCHITECTURES[kind]]:
        raise ValueError("architectures %r for model_type %s" % (cfg.get("architectures"), kind))
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rs = cfg.get("rope_scaling")
    rope_scaling = None
    if rs:
        if rs.get("rope_type", rs.get("type")) != "llama3":
            raise ValueError("rope_scaling %r" % rs)
        rope_scaling = {"factor": rs["factor"], "low_freq_factor": rs["low_freq_factor"],
                        "high_freq_factor": rs["high_freq_factor"],
                        "original_max_position": rs["original_max_position_embeddings"]}
    moe = None
    d_ff = cfg["intermediate_size"]
    if kind == "qwen3_moe":
        if cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError("decoder_sparse_step %s" % cfg["decoder_sparse_step"])
        dense = sorted(cfg.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise ValueError("mlp_only_layers %s is not the first layers" % dense)
        moe = {"num_experts": cfg["num_experts"], "top_k": cfg["num_experts_per_tok"],
               "d_ff": cfg["moe_intermediate_size"], "route_norm": bool(cfg.get("norm_topk_prob", False)),
               "first_dense_layers": len(dense)}
    elif kind == "mixtral":
        if cfg.get("sliding_window") is not None:
            raise ValueError("sliding_window %s" % cfg["sliding_window"])
        moe = {"num_experts": cfg["num_local_experts"], "top_k": cfg["num_experts_per_tok"],
               "d_ff": cfg["intermediate_size"], "route_norm": True, "first_dense_layers": 0}
    if moe is not None:
        moe.update(score_func="softmax", route_scale=1.0, num_shared_experts=0)
    return ref.ModelArgs(cfg["vocab_size"], cfg.get("max_position_embeddings", 2048), hidden,
                         cfg["num_hidden_layers"], heads, cfg.get("num_key_value_heads") or heads, d_ff,
                         cfg.get("rope_theta", 10000.0), cfg.get("rms_norm_eps", 1e-6),
                         cfg.get("tie_word_embeddings", False), rope_scaling,
                         qk_norm=(kind == "qwen3_moe"), moe=moe, head_dim=head_dim)


def reference_names(tensors, kind, args):
    """{the reference's parameter name: tensor} from Hugging Face's names:
    each MoE layer's per-expert tensors stacked (expert K as row K), Mixtral's
    router renamed. Raises ValueError for a tensor left over or missing."""
    left = dict(tensors)
    out = {}
    if kind in MOE_BLOCK:
        block = MOE_BLOCK[kind]
        for layer in range(args.n_layers):
            if not args.moe.is_moe_layer(layer):
                continue
            at = "model.layers.%d." % layer
            out[at + "mlp.gate.weight"] = left.pop(at + block + ".gate.weight")
            for ours, theirs in EXPERT_NAMES[kind]:
                rows = [left.pop("%s%s.experts.%d.%s.weight" % (at, block, k, theirs))
                        for k in range(args.moe.num_experts)]
                out[at + "mlp.experts.%s.weight" % ours] = torch.stack(rows)
    out.update(left)
    return out


def load_hf_dir(d):
    """(reference Llama holding the directory's weights in fp32, args, config.json)."""
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    args = model_args(cfg)
    model = ref.Llama(args)
    model.load_hf_state(reference_names(read_tensors(d), cfg["model_type"], args))
    return model, args, cfg


def write_hf_dir(d, model, swap_experts=False):
    """Writes `model` (a reference Llama of a format above) as a Hugging Face
    directory: config.json and model.safetensors under Hugging Face's names.
    swap_experts: experts 0 and 1 of the first MoE layer trade places (a
    fault the parity check must catch)."""
    a = model.args
    kind = "llama" if not a.moe.enabled else ("qwen3_moe" if a.qk_norm else "mixtral")
    cfg = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "hidden_size": a.d_model,
           "intermediate_size": a.d_ff, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
           "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "vocab_size": a.vocab_size,
           "max_position_embeddings": a.seq_len, "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
           "tie_word_embeddings": a.tie_weights, "rope_scaling": None, "torch_dtype": "float32"}
    if float(a.rope_scaling.get("factor", 0) or 0) > 0:
        rs = a.rope_scaling
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": rs["factor"], "low_freq_factor": rs["low_freq_factor"],
                               "high_freq_factor": rs["high_freq_factor"],
                               "original_max_position_embeddings": rs["original_max_position"]}
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    if kind == "qwen3_moe":
        cfg.update(num_experts=a.moe.num_experts, num_experts_per_tok=a.moe.top_k,
                   moe_intermediate_size=a.moe.d_ff, norm_topk_prob=a.moe.route_norm, decoder_sparse_step=1,
                   mlp_only_layers=list(range(a.moe.first_dense_layers)))
    elif kind == "mixtral":
        cfg.update(num_local_experts=a.moe.num_experts, num_experts_per_tok=a.moe.top_k,
                   intermediate_size=a.moe.d_ff, sliding_window=None)
    swapped = not swap_experts
    if kind in MOE_BLOCK:
        block = MOE_BLOCK[kind]
        for layer in range(a.n_layers):
            if not a.moe.is_moe_layer(layer):
                continue
            at = "model.layers.%d." % layer
            tensors[at + block + ".gate.weight"] = tensors.pop(at + "mlp.gate.weight")
            for ours, theirs in EXPERT_NAMES[kind]:
                stacked = tensors.pop(at + "mlp.experts.%s.weight" % ours)
                order = list(range(stacked.shape[0]))
                if not swapped:
                    order[0], order[1] = 1, 0
                for k, row in enumerate(order):
                    tensors["%s%s.experts.%d.%s.weight" % (at, block, k, theirs)] = stacked[row]
            swapped = True
    os.makedirs(d, exist_ok=True)
    ref.save_safetensors(os.path.join(d, "model.safetensors"), tensors)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
