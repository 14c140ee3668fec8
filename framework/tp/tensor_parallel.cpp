#include "framework/tp/tensor_parallel.h"

#include "framework/dtensor/chunk.h"
#include "models/forward_hooks.h"
#include "models/llama.h"
#include "models/model_spec.h"

#include <torch/csrc/autograd/custom_function.h>

#include <stdexcept>
#include <unordered_set>

namespace framework::tp {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

comm::Group& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<comm::Group*>(ctx->saved_data["group"].toInt());
}

void remember_group(AutogradContext* ctx, comm::Group& group) {
  ctx->saved_data["group"] = reinterpret_cast<int64_t>(&group);
}

torch::Tensor all_reduced(const torch::Tensor& t, comm::Group& group) {
  torch::Tensor out = t.contiguous().clone();
  group.all_reduce(out);
  return out;
}

// Forward: the input as it is; backward: the gradient summed over the TP
// group (Megatron's "f", in front of a column-parallel projection).
struct CopyToTensorParallel : torch::autograd::Function<CopyToTensorParallel> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, comm::Group* group) {
    remember_group(ctx, *group);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {all_reduced(grad[0], group_of(ctx)), torch::Tensor()};
  }
};

// Forward: the partial results summed over the TP group; backward: the
// gradient as it is (Megatron's "g", behind a row-parallel projection).
struct ReduceFromTensorParallel : torch::autograd::Function<ReduceFromTensorParallel> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& x, comm::Group* group) {
    return all_reduced(x, *group);
  }
  static variable_list backward(AutogradContext*, variable_list grad) {
    return {grad[0], torch::Tensor()};
  }
};

// Forward: the whole last dim, gathered by the chunk rule; backward: this
// rank's slice of the gradient.
struct GatherLastDim : torch::autograd::Function<GatherLastDim> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, comm::Group* group,
                               int64_t full) {
    const int64_t parts = group->size();
    const int64_t cap = dtensor::chunk_capacity(full, parts);
    const dtensor::Span mine = dtensor::chunk_span(full, parts, group->rank());
    ctx->saved_data["offset"] = mine.offset;
    ctx->saved_data["size"] = mine.size;
    std::vector<int64_t> padded_shape = x.sizes().vec();
    padded_shape.back() = cap;
    torch::Tensor send = torch::zeros(padded_shape, x.options());
    send.narrow(-1, 0, mine.size).copy_(x);
    send = send.movedim(-1, 0).contiguous();  // [cap, ...]
    std::vector<int64_t> recv_shape = send.sizes().vec();
    recv_shape[0] = cap * parts;
    torch::Tensor recv = torch::empty(recv_shape, x.options());
    group->all_gather(recv, send);
    std::vector<torch::Tensor> pieces;
    for (int64_t r = 0; r < parts; ++r) {
      const dtensor::Span s = dtensor::chunk_span(full, parts, r);
      if (s.size > 0) pieces.push_back(recv.narrow(0, r * cap, s.size));
    }
    return torch::cat(pieces, 0).movedim(0, -1).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const int64_t offset = ctx->saved_data["offset"].toInt();
    const int64_t size = ctx->saved_data["size"].toInt();
    return {grad[0].narrow(-1, offset, size).contiguous(), torch::Tensor(), torch::Tensor()};
  }
};

// Megatron's vocabulary-parallel cross-entropy: softmax statistics by
// all-reduce (max, then the sum of exps), the target's logit from the rank
// that holds it; backward is local (softmax minus the one-hot).
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& targets, int64_t vocab_offset,
                               comm::Group* group, int64_t ignore_index) {
    const int64_t local_vocab = logits.size(1);
    torch::Tensor max = logits.numel() > 0 ? std::get<0>(logits.max(1))
                                           : torch::full({logits.size(0)}, -INFINITY, logits.options());
    max = max.contiguous();
    group->all_reduce(max, comm::ReduceOp::kMax);
    torch::Tensor shifted = logits - max.unsqueeze(1);
    torch::Tensor exp = shifted.exp();
    torch::Tensor sum_exp = exp.sum(1).contiguous();
    group->all_reduce(sum_exp);
    torch::Tensor in_range = (targets >= vocab_offset) & (targets < vocab_offset + local_vocab);
    torch::Tensor local_target = (targets - vocab_offset).masked_fill(in_range.logical_not(), 0);
    torch::Tensor target_logit = torch::zeros({logits.size(0)}, logits.options());
    if (local_vocab > 0) {
      target_logit = shifted.gather(1, local_target.unsqueeze(1)).squeeze(1) * in_range.to(logits.dtype());
    }
    target_logit = target_logit.contiguous();
    group->all_reduce(target_logit);
    torch::Tensor valid = targets != ignore_index;
    torch::Tensor loss = (sum_exp.log() - target_logit) * valid.to(logits.dtype());
    ctx->save_for_backward({exp / sum_exp.unsqueeze(1), local_target, in_range, valid});
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const variable_list saved = ctx->get_saved_variables();
    torch::Tensor g = saved[0].clone();  // softmax of this rank's vocabulary
    if (g.size(1) > 0) {
      g.scatter_add_(1, saved[1].unsqueeze(1), -saved[2].to(g.dtype()).unsqueeze(1));
    }
    g.mul_((grad[0] * saved[3].to(g.dtype())).unsqueeze(1));
    return {g, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// Does the dotted name match the pattern ("*" = one whole component)?
bool matches(const std::string& pattern, const std::string& name) {
  size_t p = 0, n = 0;
  while (p <= pattern.size() && n <= name.size()) {
    const size_t pe = std::min(pattern.find('.', p), pattern.size());
    const size_t ne = std::min(name.find('.', n), name.size());
    const std::string part = pattern.substr(p, pe - p);
    if (part != "*" && part != name.substr(n, ne - n)) return false;
    const bool pattern_done = pe == pattern.size(), name_done = ne == name.size();
    if (pattern_done || name_done) return pattern_done && name_done;
    p = pe + 1;
    n = ne + 1;
  }
  return false;
}

// A tensor of `sizes` whose storage holds no bytes (as models build
// unmaterialised parameters).
torch::Tensor storage_less(const std::vector<int64_t>& sizes, const torch::TensorOptions& options) {
  torch::Tensor t = torch::empty(sizes, options);
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
  return t;
}

// Keeps this rank's part of `param` (split along `dim`) in place.
void keep_local_part(torch::Tensor& param, int64_t dim, int64_t parts, int64_t index) {
  const dtensor::Span span = dtensor::chunk_span(param.size(dim), parts, index);
  torch::NoGradGuard no_grad;
  const bool unmaterialised = param.numel() > 0 && param.storage().nbytes() == 0;
  if (unmaterialised) {
    std::vector<int64_t> sizes = param.sizes().vec();
    sizes[dim] = span.size;
    param.set_data(storage_less(sizes, param.options().requires_grad(false)));
  } else {
    param.set_data(param.narrow(dim, span.offset, span.size).clone());
  }
}

}  // namespace

Style parse_style(const std::string& name, const std::string& what) {
  if (name == "colwise") return Style::kColwise;
  if (name == "rowwise") return Style::kRowwise;
  if (name == "replicate") return Style::kReplicate;
  if (name == "sum_grads") return Style::kSumGrads;
  throw std::invalid_argument(what + ": style must be colwise, rowwise, replicate or sum_grads, got '" + name + "'");
}

std::string to_string(Style style) {
  switch (style) {
    case Style::kColwise: return "colwise";
    case Style::kRowwise: return "rowwise";
    case Style::kReplicate: return "replicate";
    case Style::kSumGrads: return "sum_grads";
  }
  return "?";
}

namespace {

// The forward hook of one split module: colwise copies the input into the
// group (and gathers the output if asked); a vocabulary-parallel embedding
// looks up only its rows [first, first + count) and sums over the group;
// rowwise sums its partial outputs. Each hook holds the mesh: its group
// lives as long as the hook.
models::ForwardHook make_tp_hook(const PlanEntry& entry, bool embedding, dtensor::Span span,
                                 int64_t rows, std::shared_ptr<dtensor::DeviceMesh> mesh,
                                 comm::Group* group) {
  if (entry.style == Style::kColwise) {
    const bool gather = entry.gather_output;
    return [mesh, group, gather, rows](const torch::Tensor& x, const models::ModuleFn& inner) {
      torch::Tensor y = inner(CopyToTensorParallel::apply(x, group));
      return gather ? GatherLastDim::apply(y, group, rows) : y;
    };
  }
  if (embedding) {
    const int64_t first = span.offset, count = span.size;
    return [mesh, group, first, count](const torch::Tensor& ids, const models::ModuleFn& inner) {
      torch::Tensor outside = (ids < first) | (ids >= first + count);
      torch::Tensor rows_out = inner((ids - first).masked_fill(outside, 0));
      return ReduceFromTensorParallel::apply(rows_out.masked_fill(outside.unsqueeze(-1), 0), group);
    };
  }
  return [mesh, group](const torch::Tensor& x, const models::ModuleFn& inner) {
    return ReduceFromTensorParallel::apply(inner(x), group);
  };
}

// Splits the colwise or rowwise module `m` (`name`, named by the plan entry
// `what`): keeps this rank's part of its weight (and a colwise bias),
// records the split in `layout` and installs its forward hook. Throws
// std::invalid_argument naming entry and module when `m` cannot be split.
void split_module(torch::nn::Module& m, const std::string& name, const PlanEntry& entry,
                  const std::string& what, const std::shared_ptr<dtensor::DeviceMesh>& mesh,
                  comm::Group* group, TensorParallelLayout& layout, const torch::nn::Module& root) {
  if (auto* tied = dynamic_cast<models::TiedOutputImpl*>(&m)) {
    // The output of tied weights: the embedding's table, split by
    // vocabulary rows (its rowwise entry, earlier in the plan), is already
    // this colwise projection's Shard(0); only the hook is new.
    std::string table;
    for (const auto& p : root.named_parameters()) {
      if (p.value().is_same(tied->weight())) table = p.key();
    }
    auto it = layout.params.find(table);
    if (entry.style != Style::kColwise || it == layout.params.end() || it->second.dim != 0) {
      throw std::invalid_argument(what + ": module '" + name + "' is the output of tied weights: it must be " +
                                  "colwise, after its embedding" + (table.empty() ? "" : " (" + table + ")") +
                                  " is split rowwise by vocabulary");
    }
    const int64_t rows = it->second.global_shape.at(0);
    if (group == nullptr) return;
    models::set_forward_hook(m, make_tp_hook(entry, false, dtensor::chunk_span(rows, layout.size, layout.rank),
                                             rows, mesh, group));
    return;
  }
  if (dynamic_cast<torch::nn::LinearImpl*>(&m) != nullptr ||
      dynamic_cast<torch::nn::EmbeddingImpl*>(&m) != nullptr) {
    throw std::invalid_argument(what + ": module '" + name +
                                "' is a torch::nn::Linear/Embedding, whose forward cannot be "
                                "hooked in C++; use models::Projection / models::TokenEmbedding "
                                "or run your forward through models::call_with_hook");
  }
  auto own = m.named_parameters(/*recurse=*/false);  // handles: set_data reaches the module's
  torch::Tensor* weight = own.find("weight");
  if (weight == nullptr || weight->dim() != 2) {
    throw std::invalid_argument(what + ": module '" + name + "' has no 2-D parameter 'weight'");
  }
  torch::Tensor* bias = own.find("bias");
  const bool embedding = dynamic_cast<models::TokenEmbeddingImpl*>(&m) != nullptr;
  if (entry.style == Style::kRowwise && bias != nullptr && !embedding) {
    throw std::invalid_argument(what + ": module '" + name +
                                "' has a bias, which a row-parallel projection would add once "
                                "per rank");
  }
  if (entry.gather_output && entry.style != Style::kColwise) {
    throw std::invalid_argument(what + ": gather_output is for colwise entries only");
  }
  const int64_t dim = entry.style == Style::kColwise || embedding ? 0 : 1;
  const int64_t rows = weight->size(0);  // vocabulary / output features, before splitting
  const dtensor::Span span = dtensor::chunk_span(weight->size(dim), layout.size, layout.rank);
  layout.params[name + ".weight"] = {dim, weight->sizes().vec()};
  keep_local_part(*weight, dim, layout.size, layout.rank);
  if (bias != nullptr && entry.style == Style::kColwise) {
    layout.params[name + ".bias"] = {0, bias->sizes().vec()};
    keep_local_part(*bias, 0, layout.size, layout.rank);
  }
  // LoRA adapters (models::ProjectionImpl::add_lora): their path runs
  // outside this module's hook. Colwise: A whole on every rank, B split by
  // output rows like the weight, and B's input copied into the group (its
  // gradient all-reduced, so A's is whole). Rowwise: A split by input
  // columns like the weight and its partial outputs all-reduced, B whole.
  auto* proj = dynamic_cast<models::ProjectionImpl*>(&m);
  if (proj != nullptr && proj->has_lora()) {
    if (entry.gather_output) {
      throw std::invalid_argument(what + ": module '" + name + "' has LoRA adapters, which gather_output does not gather");
    }
    const bool colwise = entry.style == Style::kColwise;
    const std::string adapter = colwise ? "lora_B" : "lora_A";
    torch::nn::Module& sub = *m.named_children()[adapter];
    auto sub_params = sub.named_parameters(/*recurse=*/false);
    torch::Tensor* w = sub_params.find("weight");
    layout.params[name + "." + adapter + ".weight"] = {dim, w->sizes().vec()};
    const dtensor::Span sub_span = dtensor::chunk_span(w->size(dim), layout.size, layout.rank);
    keep_local_part(*w, dim, layout.size, layout.rank);
    if (group != nullptr) {
      PlanEntry inner = entry;
      inner.gather_output = false;
      models::set_forward_hook(sub, make_tp_hook(inner, false, sub_span, w->size(0), mesh, group));
    }
  }
  if (group == nullptr) return;  // tensor 1: nothing to communicate
  models::set_forward_hook(m, make_tp_hook(entry, embedding, span, rows, mesh, group));
}

}  // namespace

TensorParallelLayout parallelize_module(torch::nn::Module& module,
                                        std::shared_ptr<dtensor::DeviceMesh> mesh, int axis,
                                        const Plan& plan) {
  TensorParallelLayout layout;
  layout.size = mesh->size(axis);
  layout.rank = mesh->coordinate(axis);
  comm::Group* group = layout.size > 1 ? &mesh->group(axis) : nullptr;
  for (const auto& item : module.named_parameters()) {
    layout.params[item.key()] = {-1, item.value().sizes().vec()};
  }
  std::unordered_map<std::string, std::string> claimed;  // module -> plan entry
  for (const PlanEntry& entry : plan) {
    const std::string what = "tensor-parallel plan entry '" + entry.pattern + "' (" +
                             to_string(entry.style) + ")";
    bool found = false;
    for (const auto& sub : module.named_modules("", /*include_self=*/false)) {
      if (!matches(entry.pattern, sub.key())) continue;
      found = true;
      const std::string& name = sub.key();
      auto [it, fresh] = claimed.emplace(name, entry.pattern);
      if (!fresh) {
        throw std::invalid_argument(what + ": module '" + name + "' is also named by entry '" +
                                    it->second + "'");
      }
      if (entry.style == Style::kReplicate) continue;
      if (entry.style == Style::kSumGrads) {
        for (const auto& p : sub.value()->named_parameters()) layout.params[name + "." + p.key()].sum_grads = true;
        continue;
      }
      split_module(*sub.value(), name, entry, what, mesh, group, layout, module);
    }
    if (!found) throw std::invalid_argument(what + " matches no submodule of the model");
  }
  return layout;
}

Plan restrict_plan(const torch::nn::Module& module, const Plan& plan) {
  Plan out;
  for (const PlanEntry& entry : plan) {
    for (const auto& sub : module.named_modules("", /*include_self=*/false)) {
      if (matches(entry.pattern, sub.key())) {
        out.push_back(entry);
        break;
      }
    }
  }
  return out;
}

void clear_hooks(const torch::nn::Module& module) {
  for (const auto& sub : module.named_modules("", /*include_self=*/false)) {
    models::clear_forward_hook(*sub.value());
  }
}

torch::Tensor local_part(const TensorParallelLayout& layout, const std::string& name,
                         const torch::Tensor& full) {
  auto it = layout.params.find(name);
  if (it == layout.params.end() || it->second.dim < 0) return full.clone();
  const dtensor::Span span = dtensor::chunk_span(full.size(it->second.dim), layout.size, layout.rank);
  return full.narrow(it->second.dim, span.offset, span.size).clone();
}

FullInit sharded_init(const TensorParallelLayout& layout, FullInit full_init) {
  return [layout, full_init](const std::string& name, const torch::Tensor& local) {
    auto it = layout.params.find(name);
    if (it == layout.params.end() || it->second.dim < 0) {
      full_init(name, local);
      return;
    }
    torch::NoGradGuard no_grad;
    torch::Tensor full = torch::empty(it->second.global_shape, local.options().requires_grad(false));
    full_init(name, full);
    const dtensor::Span span = dtensor::chunk_span(full.size(it->second.dim), layout.size, layout.rank);
    local.copy_(full.narrow(it->second.dim, span.offset, span.size));
  };
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                           int64_t vocab_offset, comm::Group& group,
                                           int64_t ignore_index) {
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && logits.size(0) == targets.size(0),
              "vocab_parallel_cross_entropy: logits [N, V_local] and targets [N], got ",
              logits.sizes(), " and ", targets.sizes());
  return VocabParallelCrossEntropy::apply(logits, targets, vocab_offset, &group, ignore_index);
}

torch::Tensor gather_last_dim(const torch::Tensor& local, comm::Group& group, int64_t full) {
  return GatherLastDim::apply(local, &group, full);
}

Plan llama_plan() { return models::llama_tp_plan(); }

}  // namespace framework::tp
