#include "framework/ep/expert_parallel.h"

#include "models/moe.h"

#include <torch/autograd.h>

#include <chrono>
#include <numeric>
#include <stdexcept>

namespace framework::ep {
namespace {

// Adds the seconds of its scope to `total` (when given).
struct Timer {
  double* total;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  explicit Timer(double* t) : total(t) {}
  ~Timer() {
    if (total) *total += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

class AllToAllFn : public torch::autograd::Function<AllToAllFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
                               std::vector<int64_t> out_splits, std::vector<int64_t> in_splits,
                               comm::Group* group, double* seconds) {
    ctx->saved_data["out"] = c10::IValue(out_splits);
    ctx->saved_data["in"] = c10::IValue(in_splits);
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    ctx->saved_data["seconds"] = reinterpret_cast<int64_t>(seconds);
    return exchange(input, out_splits, in_splits, *group, seconds);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::vector<int64_t> out_splits = ctx->saved_data["out"].toIntVector();
    const std::vector<int64_t> in_splits = ctx->saved_data["in"].toIntVector();
    auto* group = reinterpret_cast<comm::Group*>(ctx->saved_data["group"].toInt());
    auto* seconds = reinterpret_cast<double*>(ctx->saved_data["seconds"].toInt());
    // The rows this rank received go back where they came from.
    return {exchange(grads[0], in_splits, out_splits, *group, seconds), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }

  static torch::Tensor exchange(const torch::Tensor& input, const std::vector<int64_t>& out_splits,
                                const std::vector<int64_t>& in_splits, comm::Group& group, double* seconds) {
    const Timer timer(seconds);
    const int64_t rows = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
    std::vector<int64_t> shape = input.sizes().vec();
    shape[0] = rows;
    torch::Tensor out = torch::empty(shape, input.options().requires_grad(false));
    torch::Tensor in = input.detach().contiguous();
    group.all_to_all(out, in, out_splits, in_splits);
    return out;
  }
};

// The dispatch of one layer (models::ExpertDispatch) over `group`, this
// rank keeping `local` of the experts.
torch::Tensor dispatch(const torch::Tensor& rows, const std::vector<int64_t>& counts,
                       models::GroupedExpertsImpl& experts, comm::Group& group, double* seconds) {
  const int64_t ranks = group.size();
  const int64_t local = experts.num_experts();
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == ranks * local, "expert parallelism: ", counts.size(),
              " expert counts for ", ranks, " ranks of ", local, " experts");
  // How many rows each rank sends this one for each of its experts.
  const auto long_cpu = torch::TensorOptions(torch::kLong);
  torch::Tensor send_counts = torch::tensor(counts, long_cpu).to(rows.device());
  torch::Tensor recv_counts = torch::empty({ranks * local}, long_cpu.device(rows.device()));
  const std::vector<int64_t> even(static_cast<size_t>(ranks), local);
  {
    const Timer timer(seconds);
    group.all_to_all(recv_counts, send_counts, even, even);
  }
  const torch::Tensor got = recv_counts.to(torch::kCPU);
  const int64_t* rc = got.data_ptr<int64_t>();
  std::vector<int64_t> in_splits(static_cast<size_t>(ranks), 0), out_splits(static_cast<size_t>(ranks), 0);
  for (int64_t r = 0; r < ranks; ++r) {
    for (int64_t e = 0; e < local; ++e) {
      in_splits[r] += counts[static_cast<size_t>(r * local + e)];
      out_splits[r] += rc[r * local + e];
    }
  }
  const torch::Tensor received = AllToAllFn::apply(rows, out_splits, in_splits, &group, seconds);
  // Received rank by rank, each rank's rows by expert; the experts want
  // theirs together: every rank's rows of expert 0, then of expert 1...
  std::vector<int64_t> start(static_cast<size_t>(ranks * local));
  int64_t offset = 0;
  for (int64_t i = 0; i < ranks * local; ++i) {
    start[i] = offset;
    offset += rc[i];
  }
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(offset));
  std::vector<int64_t> per_expert(static_cast<size_t>(local), 0);
  for (int64_t e = 0; e < local; ++e) {
    for (int64_t r = 0; r < ranks; ++r) {
      const int64_t i = r * local + e;
      for (int64_t k = 0; k < rc[i]; ++k) order.push_back(start[i] + k);
      per_expert[e] += rc[i];
    }
  }
  const torch::Tensor perm = torch::tensor(order, long_cpu).to(rows.device());
  const torch::Tensor inverse = torch::empty_like(perm).index_copy_(0, perm, torch::arange(offset, perm.options()));
  const torch::Tensor outputs = experts.forward(received.index_select(0, perm), per_expert);
  return AllToAllFn::apply(outputs.index_select(0, inverse), in_splits, out_splits, &group, seconds);
}

}  // namespace

torch::Tensor all_to_all(const torch::Tensor& input, const std::vector<int64_t>& out_splits,
                         const std::vector<int64_t>& in_splits, comm::Group& group, double* seconds) {
  return AllToAllFn::apply(input, out_splits, in_splits, &group, seconds);
}

ExpertParallelLayout parallelize_experts(torch::nn::Module& module, std::shared_ptr<dtensor::DeviceMesh> mesh) {
  ExpertParallelLayout layout;
  layout.size = mesh->size(2);
  layout.rank = mesh->coordinate(2);
  comm::Group* group = &mesh->group(2);
  double* seconds = layout.all_to_all_seconds.get();
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    auto* moe = dynamic_cast<models::MoeFeedForwardImpl*>(item.value().get());
    if (moe == nullptr) continue;
    const int64_t experts = moe->num_experts();
    if (experts % layout.size != 0) {
      throw std::invalid_argument("parallel.expert (" + std::to_string(layout.size) +
                                  ") must divide model.moe.num_experts (" + std::to_string(experts) +
                                  "): each expert-parallel rank holds the same number of experts");
    }
    const int64_t count = experts / layout.size;
    for (const auto& p : item.value()->named_parameters()) {
      if (p.key().rfind("experts.", 0) != 0) continue;
      std::vector<int64_t> shape = p.value().sizes().vec();
      layout.params.emplace(item.key() + "." + p.key(), shape);
    }
    // `mesh` keeps the group alive for the module's life (the trainer's meshes).
    moe->set_expert_parallel(layout.rank * count, count,
                             [group, seconds, keep = layout.all_to_all_seconds](
                                 const torch::Tensor& rows, const std::vector<int64_t>& counts,
                                 models::GroupedExpertsImpl& local) {
                               return dispatch(rows, counts, local, *group, seconds);
                             });
  }
  return layout;
}

FullInit expert_init(const ExpertParallelLayout& layout, FullInit full_init) {
  return [layout, full_init = std::move(full_init)](const std::string& name, const torch::Tensor& full) {
    auto it = layout.params.find(name);
    if (it == layout.params.end()) {
      full_init(name, full);
      return;
    }
    torch::NoGradGuard no_grad;
    torch::Tensor whole = torch::empty(it->second, full.options());
    full_init(name, whole);
    const int64_t count = it->second[0] / layout.size;
    full.copy_(whole.narrow(0, layout.rank * count, count));
  };
}

}  // namespace framework::ep
