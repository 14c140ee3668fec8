#pragma once
// Ring attention: scaled dot-product attention of a sequence split over
// the context group (sequence_split.h), exact. Each rank holds its tokens'
// queries, keys and values; the keys and values travel around the ring
// (member r sends to r+1 and receives from r-1) while each rank computes
// its queries' attention block by block. The blocks combine exactly through
// the log-sum-exp (online softmax: a running row maximum and sum, fp32).
// The next block is sent while the current one is computed
// (comm::Group::send_async / recv_async: Gloo on the CPU, NCCL on CUDA).
//
// Backward runs the same ring: the keys and values travel again, dq
// accumulates locally, and each block's dk and dv accumulate (fp32) on the
// ranks whose queries see it and travel with it, arriving back at the
// block's owner after C hops. Grouped-query attention keeps only the key
// and value heads on the wire; a block is expanded to the query heads
// locally (query head h reads key/value head h / (Hq / Hkv), as Hugging
// Face's repeat_kv).
//
// The causal mask comes from the tokens' true positions (the position
// table). A rank's tokens are runs of consecutive positions (two under the
// head-tail split), and a block is computed run against run: a run of keys
// that a run of queries does not see is skipped, one it sees whole needs no
// mask; only a run against itself is masked. Under head-tail every other
// rank's block then costs each rank half a block.
//
//   const torch::Tensor table = cp::position_table(seq_len, group.size(), cp::LoadBalance::kHeadTail);
//   torch::Tensor out = cp::ring_attention(q, k, v, table, group);   // [B, Hq, S/C, D]
//
// Thread safety: as comm::Group's: one thread drives a group (forward and
// backward both use it).
#include "comm/process_group.h"

#include <torch/torch.h>

namespace framework::cp {

// Seconds one rank spent in ring attention, added to by every call given
// it (forward and backward): the trainer reads them per step for
// metrics.jsonl, bench/context_parallel.py for the share of the step spent
// waiting for blocks and the ranks' balance. Host wall time: on CUDA the
// kernels run asynchronously, so attention_s is the host's and wait_s
// includes the device work the wait had to finish first.
struct RingStats {
  double attention_s = 0;  // inside the forward and the backward
  double wait_s = 0;       // of which waiting for a key/value or gradient block to arrive
};

// softmax(q k^T / sqrt(D) + mask) v over the whole sequence, for this
// rank's queries. q [B, Hq, Sl, D]; k, v [B, Hkv, Sl, D] with Hq a multiple
// of Hkv; all of this rank's Sl tokens. `positions` [C, Sl] int64 (on the
// CPU; position_table): row j holds member j's tokens' global positions,
// in the order member j holds them. `causal`: a query at position i sees
// the keys at positions <= i (else every key). Returns [B, Hq, Sl, D] in
// q's dtype. Differentiable in q, k and v (custom backward, over the same
// group). Every member calls it, with the same shapes and table. `stats`,
// when given, must outlive the backward; its seconds grow by this call's.
// REQUIRES: C == group.size(); with `causal`, every query's own position
// among the keys (true of every split of a sequence).
torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& positions, comm::Group& group, bool causal = true,
                             RingStats* stats = nullptr);

}  // namespace framework::cp
