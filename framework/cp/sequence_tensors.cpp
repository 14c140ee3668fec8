// The sequence split on tensors (sequence_tensors.h).
#include "framework/cp/sequence_tensors.h"

#include <vector>

namespace framework::cp {

torch::Tensor position_table(int64_t seq_len, int64_t context, LoadBalance balance) {
  check_sequence_split(seq_len, context, balance);
  std::vector<int64_t> all;
  all.reserve(static_cast<size_t>(seq_len));
  for (int64_t r = 0; r < context; ++r) {
    const std::vector<int64_t> mine = sequence_positions(seq_len, context, r, balance);
    all.insert(all.end(), mine.begin(), mine.end());
  }
  return torch::tensor(all, torch::kLong).view({context, seq_len / context});
}

torch::Tensor split_sequence(const torch::Tensor& x, int64_t context, int64_t rank, LoadBalance balance,
                             int64_t dim) {
  const std::vector<int64_t> mine = sequence_positions(x.size(dim), context, rank, balance);
  const torch::Tensor index = torch::tensor(mine, torch::kLong).to(x.device());
  return x.index_select(dim, index);
}

torch::Tensor gather_sequence(const torch::Tensor& local, comm::Group& group, LoadBalance balance,
                              int64_t dim) {
  const int64_t context = group.size();
  dim = dim < 0 ? dim + local.dim() : dim;
  const int64_t seq_len = local.size(dim) * context;
  std::vector<int64_t> shape = local.sizes().vec();
  shape.insert(shape.begin(), context);
  torch::Tensor gathered = torch::empty(shape, local.options().requires_grad(false));
  group.all_gather(gathered, local.detach().contiguous());
  // Member by member along `dim`, then each token to its true position.
  const torch::Tensor concatenated = torch::cat(gathered.unbind(0), dim);
  const torch::Tensor order = position_table(seq_len, context, balance).view({-1}).argsort();
  return concatenated.index_select(dim, order.to(local.device()));
}

}  // namespace framework::cp
