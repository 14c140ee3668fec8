"""A plain-PyTorch mixture-of-experts feed-forward for the reference Llama
(tests/models/llama_reference.py), written from the published Qwen3-MoE /
Mixtral / DeepSeek-V3 semantics, not from shardkit's code:

  router      logits = x gate^T; scores = softmax(logits) or sigmoid(logits),
              in fp32; chosen = topk(scores + bias, k) (bias: DeepSeek-V3's
              e_score_correction_bias, for the choice only); weights = the
              scores at chosen, renormalised to sum 1 (route_norm), times
              route_scale
  experts     stacked SwiGLUs, expert e: down[e] (silu(gate[e] x) * up[e] x)
  shared      one SwiGLU of width num_shared_experts x d_ff every token takes
  aux loss    E sum_e f_e P_e per layer (f_e: share of the top-k choices,
              constant; P_e: mean router probability)
  balancing   after each optimizer step, bias_e += r sign(mean load - load_e),
              centred (auxiliary-loss-free balancing)

Hugging Face-style names: mlp.gate.weight [E, d], mlp.gate.e_score_correction_bias
[E], mlp.experts.{gate,up}_proj.weight [E, I, d], mlp.experts.down_proj.weight
[E, d, I], mlp.shared_experts.{gate,up,down}_proj.weight.

Plain torch ops only (no torch.func): runs on torch 1.13 and 2.x.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

# Parameters that stay fp32 in a bf16 compute copy and never train.
FP32_BUFFER_SUFFIXES = ("e_score_correction_bias",)


def keeps_fp32(name):
    """Whether parameter `name` is one of the fp32, untrained ones (the
    balancing bias): no gradient, not in the optimizer, not cast to the
    compute dtype."""
    return name.endswith(FP32_BUFFER_SUFFIXES)


class MoeArgs:
    """result.json's model.moe (absent or num_experts 0: a dense model).
    Defaults are those of shardkit's MoeOptions, so a partial dict reads as
    the C++ side would read the same config."""

    def __init__(self, moe, model_d_ff):
        moe = dict(moe or {})
        self.num_experts = int(moe.get("num_experts", 0) or 0)
        self.top_k = int(moe.get("top_k", 2))
        self.d_ff = int(moe.get("d_ff", 0) or 0) or int(model_d_ff)  # 0: the model's d_ff
        self.score_func = str(moe.get("score_func", "softmax"))
        self.route_norm = bool(moe.get("route_norm", False))
        self.route_scale = float(moe.get("route_scale", 1.0))
        self.num_shared_experts = int(moe.get("num_shared_experts", 0) or 0)
        self.first_dense_layers = int(moe.get("first_dense_layers", 0) or 0)
        self.aux_loss_coef = float(moe.get("aux_loss_coef", 0.0) or 0.0)
        self.load_balance_rate = float(moe.get("load_balance_rate", 0.0) or 0.0)
        if self.num_experts > 0:
            if self.score_func not in ("softmax", "sigmoid"):
                raise ValueError("model.moe.score_func %r: softmax or sigmoid" % self.score_func)
            if not 1 <= self.top_k <= self.num_experts:
                raise ValueError("model.moe.top_k %d not in [1, %d]" % (self.top_k, self.num_experts))

    @property
    def enabled(self):
        return self.num_experts > 0

    def is_moe_layer(self, layer):
        return self.num_experts > 0 and layer >= self.first_dense_layers


class Weight(nn.Module):
    """A holder of one parameter named `weight`, so that the stacked experts
    get the names experts.gate_proj.weight etc."""

    def __init__(self, *shape):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class Router(nn.Module):
    """mlp.gate: the router's weight [E, d] and, with balancing on, the
    untrained fp32 bias [E] that shifts the choice (not the weights)."""

    def __init__(self, d_model, moe):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, d_model))
        if moe.load_balance_rate > 0:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x):
        """x [N, d] -> (chosen [N, k] int64, weights [N, k] fp32, logits fp32
        [N, E], scores fp32 [N, E], selection scores fp32 [N, E])."""
        m = self.moe
        logits = torch.matmul(x, self.weight.t()).float()
        if m.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
        select = scores.detach()
        if self.e_score_correction_bias is not None:
            select = select + self.e_score_correction_bias.detach().float()
        chosen = torch.topk(select, m.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)  # the bias only chooses, never weighs
        if m.route_norm:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * m.route_scale
        return chosen, weights, logits, scores, select

    def balance(self, load):
        """Auxiliary-loss-free balancing after an optimizer step: load [E] is
        the step's count of top-k choices per expert (all micro-batches).
        Overloaded experts' bias goes down by the rate, underloaded ones' up,
        the change centred to mean 0; fp32, outside autograd."""
        if self.e_score_correction_bias is None:
            return
        with torch.no_grad():
            load = load.float()
            delta = self.moe.load_balance_rate * torch.sign(load.mean() - load)
            delta = delta - delta.mean()
            self.e_score_correction_bias.add_(delta.to(self.e_score_correction_bias.dtype))


class Experts(nn.Module):
    """The E routed SwiGLU experts, stacked: gate_proj/up_proj [E, I, d],
    down_proj [E, d, I]. Each expert runs on the rows routed to it only (the
    dropless gather-compute-scatter of Mixtral's reference loop)."""

    def __init__(self, d_model, moe):
        super().__init__()
        E, I = moe.num_experts, moe.d_ff
        self.gate_proj = Weight(E, I, d_model)
        self.up_proj = Weight(E, I, d_model)
        self.down_proj = Weight(E, d_model, I)

    def expert(self, e, x):
        h = F.silu(torch.matmul(x, self.gate_proj.weight[e].t())) * torch.matmul(x, self.up_proj.weight[e].t())
        return torch.matmul(h, self.down_proj.weight[e].t())

    def forward(self, x, chosen, weights):
        out = torch.zeros_like(x)
        w = weights.to(x.dtype)  # the routing weights in the compute dtype
        for e in range(self.gate_proj.weight.shape[0]):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            if rows.numel() == 0:
                continue  # no token chose e: no output, no gradient
            y = self.expert(e, x[rows]) * w[rows, slot].unsqueeze(-1)
            out = out.index_add(0, rows, y)
        return out


class SwiGLU(nn.Module):
    """The shared experts: a plain SwiGLU MLP (names gate_proj, up_proj,
    down_proj)."""

    def __init__(self, d_model, d_ff):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """A block's mixture-of-experts feed-forward. Each forward records, for
    the training replay and the probe: last_routes [N, k] (topk's order),
    last_select [N, E] (the scores the choice was made on), last_load [E]
    (top-k choices per expert) and last_aux (this layer's load-balancing
    loss, with its gradient; None when aux_loss_coef is 0)."""

    def __init__(self, d_model, moe):
        super().__init__()
        self.moe = moe
        self.gate = Router(d_model, moe)
        self.experts = Experts(d_model, moe)
        if moe.num_shared_experts > 0:
            self.shared_experts = SwiGLU(d_model, moe.num_shared_experts * moe.d_ff)
        else:
            self.shared_experts = None
        self.last_routes = self.last_select = self.last_load = self.last_aux = None

    def forward(self, x):
        shape = x.shape
        xs = x.reshape(-1, shape[-1])
        chosen, weights, logits, scores, select = self.gate(xs)
        out = self.experts(xs, chosen, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(xs)
        E = self.moe.num_experts
        load = torch.bincount(chosen.reshape(-1), minlength=E)
        self.last_routes, self.last_select, self.last_load = chosen.detach(), select.detach(), load.detach()
        self.last_aux = aux_loss(self.moe, logits, scores, load) if self.moe.aux_loss_coef > 0 else None
        return out.reshape(shape)


def route_margins(select, k):
    """Per token, the gap between its k-th and (k+1)-th selection score: how
    near its choice is to a tie (inf when k is every expert)."""
    if select.shape[-1] <= k:
        return torch.full(select.shape[:-1], float("inf"))
    top = torch.topk(select, k + 1, dim=-1).values
    return top[..., k - 1] - top[..., k]


def aux_loss(moe, logits, scores, load):
    """One layer's load-balancing loss over its N tokens:
    E sum_e f_e P_e, f_e = load_e / N (the share of the N k choices times k;
    a constant), P_e = the mean over tokens of the router probability p[:, e]
    (softmax of the logits; for sigmoid scores, the scores normalised per
    token)."""
    N = logits.shape[0]
    if moe.score_func == "softmax":
        p = torch.softmax(logits, dim=-1)
    else:
        p = scores / scores.sum(-1, keepdim=True)
    f = load.detach().float() / N
    return moe.num_experts * (f * p.mean(0)).sum()
