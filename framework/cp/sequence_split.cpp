// The sequence split (sequence_split.h): positions per rank, and the one
// divisibility rule.
#include "framework/cp/sequence_split.h"

#include <stdexcept>
#include <string>

namespace framework::cp {

void check_sequence_split(int64_t seq_len, int64_t context, LoadBalance balance) {
  if (context < 1) {
    throw std::invalid_argument("parallel.context (" + std::to_string(context) + ") must be at least 1");
  }
  const int64_t chunks = balance == LoadBalance::kHeadTail ? 2 * context : context;
  if (seq_len < chunks || seq_len % chunks != 0) {
    const std::string why = balance == LoadBalance::kHeadTail
                                ? "2 x parallel.context (" + std::to_string(context) +
                                      ") = " + std::to_string(chunks) +
                                      " equal chunks (the head-tail load balance; "
                                      "parallel.context_load_balance: none needs only parallel.context)"
                                : "parallel.context (" + std::to_string(context) + ") equal chunks";
    throw std::invalid_argument("model.seq_len (" + std::to_string(seq_len) + ") must split into " + why);
  }
}

std::vector<int64_t> sequence_positions(int64_t seq_len, int64_t context, int64_t rank, LoadBalance balance) {
  check_sequence_split(seq_len, context, balance);
  if (rank < 0 || rank >= context) {
    throw std::invalid_argument("context rank " + std::to_string(rank) + " is outside parallel.context (" +
                                std::to_string(context) + ")");
  }
  std::vector<int64_t> positions;
  positions.reserve(static_cast<size_t>(seq_len / context));
  auto add_chunk = [&](int64_t first, int64_t count) {
    for (int64_t i = 0; i < count; ++i) positions.push_back(first + i);
  };
  if (balance == LoadBalance::kHeadTail) {
    const int64_t chunk = seq_len / (2 * context);
    add_chunk(rank * chunk, chunk);
    add_chunk((2 * context - 1 - rank) * chunk, chunk);
  } else {
    const int64_t chunk = seq_len / context;
    add_chunk(rank * chunk, chunk);
  }
  return positions;
}

}  // namespace framework::cp
