#pragma once
// Context parallelism's sequence split (docs/parallelism.md, "Context
// parallelism"): which tokens of a sequence each rank of the context group
// holds. Torch-free, so that the config's checks can call it before any
// rank starts; framework/cp/sequence_tensors.h applies it to tensors.
//
// A sequence of S tokens splits over C ranks:
//   kHeadTail (the default): into 2C equal chunks; rank r holds chunks r
//     and 2C-1-r, in that order. Under a causal mask every rank then has
//     the same work: an early chunk sees few keys, its partner many.
//   kNone: into C equal chunks; rank r holds chunk r (the last rank has
//     the most work under a causal mask).
// A rank's tokens keep their true positions: RoPE and the causal mask use
// them, never the local index.
//
//   cp::check_sequence_split(seq_len, context, cp::LoadBalance::kHeadTail);
//   const std::vector<int64_t> mine = cp::sequence_positions(seq_len, context, rank, balance);
#include "comm/enum_text.h"

#include <cstdint>
#include <string>
#include <vector>

namespace framework::cp {

enum class LoadBalance { kNone, kHeadTail };

// parallel.context_load_balance's spellings.
inline constexpr comm::EnumName<LoadBalance> kLoadBalances[] = {{LoadBalance::kHeadTail, "head_tail"},
                                                                {LoadBalance::kNone, "none"}};
inline const char* to_string(LoadBalance balance) { return comm::enum_text(balance, kLoadBalances); }
inline LoadBalance parse_load_balance(const std::string& text) {
  return comm::parse_enum("parallel.context_load_balance", text, kLoadBalances);
}

// Throws std::invalid_argument, naming model.seq_len and parallel.context
// with their values, when `seq_len` does not split into the 2C (kHeadTail)
// or C (kNone) equal chunks, or when `context` < 1.
void check_sequence_split(int64_t seq_len, int64_t context, LoadBalance balance);

// The global positions of rank `rank`'s tokens, in the order the rank
// holds them (seq_len / context of them, ascending). REQUIRES
// (std::invalid_argument otherwise): check_sequence_split passes, 0 <= rank
// < context.
std::vector<int64_t> sequence_positions(int64_t seq_len, int64_t context, int64_t rank, LoadBalance balance);

}  // namespace framework::cp
