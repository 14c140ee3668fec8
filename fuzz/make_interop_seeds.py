#!/usr/bin/env python3
"""Writes the seed corpus of the interop fuzz targets (fuzz/corpus/<target>/)
from real writers: torch.save (python3-torch, 1.13 on Debian 12) for the
zip archive and data.pkl, safetensors and config.json as Hugging Face writes
them, and the DCP .metadata torch 2.6 wrote (tests/checkpoint/dcp). Run from
the repository root:  /usr/bin/python3 fuzz/make_interop_seeds.py fuzz/corpus
"""
import io
import json
import os
import shutil
import struct
import sys
import zipfile
from collections import OrderedDict

import torch

root = sys.argv[1] if len(sys.argv) > 1 else "fuzz/corpus"


def put(target, name, data):
    d = os.path.join(root, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def torch_save(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# torch.save files: a state_dict (OrderedDict with _metadata, a parameter), a
# plain dict of several dtypes, one tensor (what DCP writes per item).
torch.manual_seed(0)
lin = torch.nn.Linear(3, 2)
saves = {
    "state_dict": torch_save(lin.state_dict()),
    "dict": torch_save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                        "i": torch.tensor([1, 2], dtype=torch.int64),
                        "h": torch.ones(2, dtype=torch.float16),
                        "b": torch.zeros(1, dtype=torch.bfloat16),
                        "e": torch.zeros(0, 4)}),
    "param": torch_save(OrderedDict(p=torch.nn.Parameter(torch.ones(2, 2)))),
    "tensor": torch_save(torch.arange(4, dtype=torch.int32)),
    "view": torch_save({"v": torch.arange(8.0)[2:6]}),  # storage offset 2
}
for name, data in saves.items():
    put("fuzz_zip", name + ".pt", data)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        pkl = [n for n in z.namelist() if n.endswith("/data.pkl")][0]
        put("fuzz_torch_pickle", name + ".pkl", z.read(pkl))
# The even selector byte: the file itself (WeightsFile reads "PK\3\4" as torch.save).
put("fuzz_safetensors", "state_dict.pt", b"\0" + saves["state_dict"])


def safetensors(tensors, metadata=None):
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


put("fuzz_safetensors", "single.safetensors", b"\0" + safetensors(
    {"a": ("F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)), "b": ("BF16", [3], b"\0" * 6),
     "c": ("I64", [0], b"")}, {"format": "pt"}))
put("fuzz_safetensors", "index.json", b"\1" + json.dumps({
    "metadata": {"total_size": 16},
    "weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}},
    indent=2).encode())

llama = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
put("fuzz_hf_config", "llama3.json", json.dumps(llama, indent=2).encode())
plain = dict(llama, rope_scaling=None, tie_word_embeddings=True)
del plain["num_key_value_heads"], plain["head_dim"]
put("fuzz_hf_config", "llama.json", json.dumps(plain).encode())
# The mixtures of experts (models/hf_moe.cpp), as their export writes them.
qwen3_moe = dict(plain, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=8,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[0], output_router_logits=True,
                 router_aux_loss_coef=0.01, use_sliding_window=False, sliding_window=None, max_window_layers=2)
del qwen3_moe["mlp_bias"]
put("fuzz_hf_config", "qwen3_moe.json", json.dumps(qwen3_moe, indent=2).encode())
mixtral = dict(plain, architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=24,
               num_local_experts=4, num_experts_per_tok=2, output_router_logits=False, router_aux_loss_coef=0.0,
               router_jitter_noise=0.0, sliding_window=None)
del mixtral["mlp_bias"]
put("fuzz_hf_config", "mixtral.json", json.dumps(mixtral, indent=2).encode())

# DCP .metadata as torch 2.6's dcp.save wrote it (torch 1.13 has no DCP).
put("fuzz_dcp_metadata", "torch26_world2.metadata",
    open("tests/checkpoint/dcp/torch26_world2/.metadata", "rb").read())
