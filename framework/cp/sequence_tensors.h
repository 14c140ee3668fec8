#pragma once
// The sequence split (sequence_split.h) applied to tensors: a rank's part
// of a [B, S, ...] tensor (inputs, labels, positions), the whole table of
// positions that ring attention's causal mask reads, and the way back to
// the whole sequence (outputs, and the tests' comparisons).
//
//   const torch::Tensor ids = cp::split_sequence(batch, group.size(), group.rank(), balance);
//   const torch::Tensor table = cp::position_table(seq_len, group.size(), balance);
//   torch::Tensor out = cp::ring_attention(q, k, v, table, group);   // ring_attention.h
//   torch::Tensor whole = cp::gather_sequence(out.detach(), group, balance, /*dim=*/2);
#include "comm/process_group.h"
#include "framework/cp/sequence_split.h"

#include <torch/torch.h>

#include <cstdint>

namespace framework::cp {

// [context, seq_len / context] int64 on the CPU: row r is
// sequence_positions(seq_len, context, r, balance). Throws
// std::invalid_argument as check_sequence_split does.
torch::Tensor position_table(int64_t seq_len, int64_t context, LoadBalance balance);

// Rank `rank`'s tokens of `x` along `dim` (the sequence dim, of size
// seq_len), in the order of sequence_positions. Differentiable (an
// index_select): the gradient lands at the tokens' true places. Throws
// std::invalid_argument as check_sequence_split does.
torch::Tensor split_sequence(const torch::Tensor& x, int64_t context, int64_t rank, LoadBalance balance,
                             int64_t dim = 1);

// The inverse over the group: every member's `local` (the same shape on
// each, split_sequence's output for that member's rank) gathered and put
// back in sequence order along `dim`. Every member calls it and gets the
// whole tensor. Not differentiable (an all-gather of values).
torch::Tensor gather_sequence(const torch::Tensor& local, comm::Group& group, LoadBalance balance,
                              int64_t dim = 1);

}  // namespace framework::cp
