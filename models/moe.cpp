#include "models/moe.h"

#include "models/activation_checkpoint.h"
#include "models/llama.h"

#include <torch/autograd.h>

#include <algorithm>

namespace models {
namespace {

// Passes x through unchanged and, in backward, gives `aux` the gradient
// `scale`: the auxiliary loss reaches the router's backward through the
// block's output (Megatron's MoEAuxLossAutoScaler), so it needs no path to
// the loss. That path would not exist under activation checkpointing (the
// first forward keeps no graph) nor on a pipeline stage without the loss.
class AuxLossGrad : public torch::autograd::Function<AuxLossGrad> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor aux,
                               double scale) {
    (void)aux;
    ctx->saved_data["scale"] = scale;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const double scale = ctx->saved_data["scale"].toDouble();
    return {grads[0], torch::full({}, scale, torch::TensorOptions(torch::kFloat).device(grads[0].device())),
            torch::Tensor()};
  }
};

}  // namespace

ExpertWeightImpl::ExpertWeightImpl(int64_t experts, int64_t out, int64_t in, bool materialize) {
  weight = register_parameter("weight", make_param({experts, out, in}, materialize));
}

GroupedExpertsImpl::GroupedExpertsImpl(int64_t experts, int64_t d_model, int64_t d_ff, bool materialize) {
  gate_proj = register_module("gate_proj", ExpertWeight(experts, d_ff, d_model, materialize));
  up_proj = register_module("up_proj", ExpertWeight(experts, d_ff, d_model, materialize));
  down_proj = register_module("down_proj", ExpertWeight(experts, d_model, d_ff, materialize));
}

torch::Tensor GroupedExpertsImpl::forward(const torch::Tensor& rows, const std::vector<int64_t>& counts) {
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == num_experts(), "experts: ", counts.size(),
              " counts for ", num_experts(), " experts");
  const torch::Tensor& g = gate_proj->weight;
  const torch::Tensor& u = up_proj->weight;
  const torch::Tensor& d = down_proj->weight;
  std::vector<torch::Tensor> outs;
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts(); ++e) {
    const int64_t n = counts[static_cast<size_t>(e)];
    if (n == 0) continue;
    const torch::Tensor x = rows.narrow(0, start, n);
    torch::Tensor h = torch::silu(torch::matmul(x, g[e].t())) * torch::matmul(x, u[e].t());
    outs.push_back(torch::matmul(h, d[e].t()));
    start += n;
  }
  TORCH_CHECK(start == rows.size(0), "experts: counts sum to ", start, ", rows ", rows.size(0));
  if (outs.empty()) {
    // No token here: a zero-row result that still depends on every weight,
    // so that each has a gradient (zeros) and FSDP's reduction sees it, and
    // on `rows`: under expert parallelism `rows` came by all-to-all, whose
    // backward is a collective every rank of the expert group must run,
    // also the one whose experts received nothing.
    return rows.new_zeros({0, d.size(1)}) +
           0 * (g.sum() + u.sum() + d.sum() + rows.sum()).to(rows.scalar_type());
  }
  return outs.size() == 1 ? outs[0] : torch::cat(outs);
}

MoeRouterImpl::MoeRouterImpl(int64_t experts, int64_t d_model, bool with_bias, bool materialize) {
  weight = register_parameter("weight", make_param({experts, d_model}, materialize));
  if (with_bias) {
    e_score_correction_bias = register_buffer("e_score_correction_bias", torch::zeros({experts}, torch::kFloat));
  }
}

MoeFeedForwardImpl::MoeFeedForwardImpl(const ModelOptions& o, bool materialize)
    : options_(o.moe), moe_layer_count_(std::max<int64_t>(1, o.n_layers - o.moe.first_dense_layers)) {
  const int64_t d_ff = moe_expert_d_ff(o);
  gate_ = register_module("gate", MoeRouter(options_.num_experts, o.d_model, options_.load_balance_rate > 0, materialize));
  experts_ = register_module("experts", GroupedExperts(options_.num_experts, o.d_model, d_ff, materialize));
  if (options_.num_shared_experts > 0) {
    shared_experts_ = register_module(
        "shared_experts", std::make_shared<LlamaMlpImpl>(o.d_model, options_.num_shared_experts * d_ff, materialize));
  }
}

torch::Tensor MoeFeedForwardImpl::forward(const torch::Tensor& x) {
  const int64_t d_model = x.size(-1);
  const int64_t E = options_.num_experts, k = options_.top_k;
  const torch::Tensor rows = x.reshape({-1, d_model});
  const int64_t n = rows.size(0);
  const torch::Tensor logits = torch::matmul(rows, gate_->weight.t()).to(torch::kFloat);  // [N, E]
  const torch::Tensor scores = options_.score_func == MoeScoreFunc::kSoftmax ? torch::softmax(logits, -1)
                                                                             : torch::sigmoid(logits);
  torch::Tensor chosen;  // [N, k]
  {
    torch::NoGradGuard no_grad;
    const torch::Tensor& bias = gate_->e_score_correction_bias;
    const torch::Tensor choice = bias.defined() ? scores + bias.to(scores.device()) : scores;
    chosen = std::get<1>(torch::topk(choice, k, -1));
  }
  last_choices_ = chosen;
  torch::Tensor weights = scores.gather(1, chosen);  // [N, k], fp32
  if (options_.route_norm) weights = weights / weights.sum(-1, true);
  if (options_.route_scale != 1.0) weights = weights * options_.route_scale;

  // Group the N x k choices by expert: a stable sort keeps each expert's
  // tokens in token order.
  const torch::Tensor flat = chosen.reshape({-1});
  const torch::Tensor order = std::get<1>(torch::sort(flat, /*stable=*/true, 0, false));
  const torch::Tensor token = torch::div(order, k, "floor");
  const torch::Tensor loads = torch::bincount(flat, {}, E);
  const torch::Tensor counts_cpu = loads.to(torch::kCPU);
  std::vector<int64_t> counts(counts_cpu.data_ptr<int64_t>(), counts_cpu.data_ptr<int64_t>() + E);

  torch::Tensor routed = dispatch_ ? dispatch_(rows.index_select(0, token), counts, *experts_)
                                   : experts_->forward(rows.index_select(0, token), counts);  // [N k, d]
  routed = routed * weights.reshape({-1}).index_select(0, order).unsqueeze(1).to(routed.scalar_type());
  torch::Tensor out = torch::zeros_like(rows).index_add(0, token, routed);
  if (shared_experts_) out = out + shared_experts_->forward(rows);

  // A training forward with a backward to come, once (not the probe of a
  // model in training mode under no_grad, not activation checkpointing's
  // recomputation).
  const bool counting = is_training() && !recomputing_activations() &&
                        (torch::GradMode::is_enabled() || checkpointed_first_pass());
  // Each of a context group's ranks holds these sequences' 1 / degree.
  const double share = (global_batch_ > 0 ? static_cast<double>(x.size(0)) / static_cast<double>(global_batch_) : 1.0) /
                       static_cast<double>(context_degree_);
  if (counting) {
    torch::NoGradGuard no_grad;
    torch::Tensor l = loads.to(torch::kDouble);
    loads_ = loads_.defined() ? loads_ + l : l;
  }
  if (options_.aux_loss_coef > 0 && (torch::GradMode::is_enabled() || counting)) {
    // Switch / Mixtral / Qwen3: E x sum_e f_e P_e, f_e the share of the
    // choices that went to e (a constant), P_e the mean probability.
    const torch::Tensor probs =
        options_.score_func == MoeScoreFunc::kSoftmax ? scores : scores / scores.sum(-1, true);
    torch::Tensor f = loads.to(torch::kFloat).detach();
    if (sum_over_context_) sum_over_context_(f);  // the whole sequences' choices
    f = f / static_cast<double>(n * context_degree_);
    const torch::Tensor aux = static_cast<double>(E) * (f * probs.mean(0)).sum();
    if (counting) {
      aux_sum_ += aux.item<double>() * share;
      aux_weight_ += share;
    }
    if (torch::GradMode::is_enabled() && aux.requires_grad()) {
      // The objective is aux_loss_coef x the mean over MoE layers: each
      // layer's share (set_global_batch_sequences) of that.
      const double scale = options_.aux_loss_coef * share / static_cast<double>(moe_layer_count_);
      out = AuxLossGrad::apply(out, aux, scale);
    }
  }
  return out.view(x.sizes());
}

void MoeFeedForwardImpl::set_context_parallel(int64_t degree, std::function<void(torch::Tensor&)> sum_over_group) {
  TORCH_CHECK(degree == 1 || (degree > 1 && sum_over_group),
              "set_context_parallel: a degree above 1 needs its group's sum; got degree ", degree);
  context_degree_ = degree;
  sum_over_context_ = degree > 1 ? std::move(sum_over_group) : nullptr;
}

void MoeFeedForwardImpl::set_expert_parallel(int64_t first, int64_t count, ExpertDispatch dispatch) {
  TORCH_CHECK(first >= 0 && count > 0 && first + count <= options_.num_experts, "set_expert_parallel: experts [",
              first, ", ", first + count, ") of ", options_.num_experts);
  torch::NoGradGuard no_grad;
  for (ExpertWeight* w : {&experts_->gate_proj, &experts_->up_proj, &experts_->down_proj}) {
    torch::Tensor& p = (*w)->weight;
    std::vector<int64_t> shape = p.sizes().vec();
    shape[0] = count;
    const bool has_storage = p.storage().nbytes() > 0 || p.numel() == 0;
    p.set_data(has_storage ? p.narrow(0, first, count).clone() : make_param(shape, false).to(p.device()));
  }
  dispatch_ = std::move(dispatch);
}

MoeLayerStats MoeFeedForwardImpl::take_stats() {
  MoeLayerStats s;
  s.loads = loads_.defined() ? loads_ : torch::zeros({options_.num_experts}, torch::kDouble);
  s.aux_loss = aux_sum_;
  s.aux_weight = aux_weight_;
  loads_ = torch::Tensor();
  aux_sum_ = aux_weight_ = 0;
  return s;
}

void MoeFeedForwardImpl::update_bias(const torch::Tensor& loads) {
  torch::Tensor& bias = gate_->e_score_correction_bias;
  if (!bias.defined() || options_.load_balance_rate <= 0) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor l = loads.to(bias.device()).to(torch::kFloat);
  torch::Tensor delta = options_.load_balance_rate * torch::sign(l.mean() - l);
  delta = delta - delta.mean();
  bias.add_(delta);
}

std::vector<MoeFeedForwardImpl*> moe_layers(torch::nn::Module& root) {
  std::vector<MoeFeedForwardImpl*> out;
  for (const auto& m : root.modules(/*include_self=*/true)) {
    if (auto* moe = dynamic_cast<MoeFeedForwardImpl*>(m.get())) out.push_back(moe);
  }
  return out;
}

ParameterCounts llama_parameter_counts(const ModelOptions& o) {
  const double d = static_cast<double>(o.d_model);
  const double hd = static_cast<double>(llama_head_dim(o));
  const double q = static_cast<double>(llama_attention_width(o));
  const double kv = static_cast<double>(o.n_kv_heads > 0 ? o.n_kv_heads : o.n_heads) * hd;
  const double attn = d * q * 2 + 2 * d * kv + (o.qk_norm ? 2 * hd : 0);
  const double norms = 2 * d;
  const double dense_mlp = 3 * d * static_cast<double>(llama_d_ff(o));
  const double embed = static_cast<double>(o.vocab_size) * d;
  ParameterCounts c;
  c.total = c.active = embed * (o.tie_weights ? 1 : 2) + d;
  for (int64_t i = 0; i < o.n_layers; ++i) {
    c.total += attn + norms;
    c.active += attn + norms;
    if (!is_moe_layer(o, i)) {
      c.total += dense_mlp;
      c.active += dense_mlp;
      continue;
    }
    const double expert = 3 * d * static_cast<double>(moe_expert_d_ff(o));
    const double E = static_cast<double>(o.moe.num_experts);
    const double router = E * d;
    const double shared = expert * static_cast<double>(o.moe.num_shared_experts);
    c.total += router + shared + E * expert;
    c.active += router + shared + static_cast<double>(o.moe.top_k) * expert;
  }
  return c;
}

}  // namespace models
