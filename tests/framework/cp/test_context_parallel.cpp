// Context parallelism (framework/cp): the sequence split (head-tail
// balanced or not) and ring attention over real Gloo groups. The attention
// of a sequence split C ways equals the whole sequence's causal attention
// (scaled_dot_product_attention on LibTorch 2.x, the matmul form on 1.13:
// comm::compat::causal_attention, what the llama runs) in its output and in
// the gradients of q, k and v, within 1e-5 in fp32, with and without
// grouped-query attention and load balancing.
#include "comm/torch_compat.h"  // causal_attention: the whole-sequence reference
#include "framework/cp/ring_attention.h"
#include "framework/cp/sequence_split.h"
#include "framework/cp/sequence_tensors.h"
#include "support/multi_rank.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace cp = framework::cp;
using testing_support::RankContext;
using testing_support::run_ranks;

// Named, not anonymous: test_framework's sources share one unity unit.
namespace context_parallel_test {

constexpr int64_t kBatch = 2, kSeq = 24, kDim = 8, kQueryHeads = 4;

std::vector<int64_t> range(int64_t first, int64_t count) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < count; ++i) out.push_back(first + i);
  return out;
}

std::vector<int64_t> concat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(ContextSplit, HeadTailGivesRankRTheChunksRAndTwoCMinusOneMinusR) {
  // 24 tokens, C = 3: six chunks of 4.
  EXPECT_EQ(cp::sequence_positions(24, 3, 0, cp::LoadBalance::kHeadTail), concat(range(0, 4), range(20, 4)));
  EXPECT_EQ(cp::sequence_positions(24, 3, 1, cp::LoadBalance::kHeadTail), concat(range(4, 4), range(16, 4)));
  EXPECT_EQ(cp::sequence_positions(24, 3, 2, cp::LoadBalance::kHeadTail), concat(range(8, 4), range(12, 4)));
  // C = 1 keeps the sequence as it is.
  EXPECT_EQ(cp::sequence_positions(24, 1, 0, cp::LoadBalance::kHeadTail), range(0, 24));
}

TEST(ContextSplit, NoneGivesRankRTheRthOfCChunks) {
  EXPECT_EQ(cp::sequence_positions(24, 3, 0, cp::LoadBalance::kNone), range(0, 8));
  EXPECT_EQ(cp::sequence_positions(24, 3, 2, cp::LoadBalance::kNone), range(16, 8));
  const torch::Tensor table = cp::position_table(24, 4, cp::LoadBalance::kNone);
  EXPECT_TRUE(torch::equal(table, torch::arange(24, torch::kLong).view({4, 6})));
}

TEST(ContextSplit, SplitTakesEachRanksTokensAlongTheSequenceDim) {
  const torch::Tensor x = torch::arange(2 * 8, torch::kFloat).view({2, 8});
  const torch::Tensor mine = cp::split_sequence(x, 2, 1, cp::LoadBalance::kHeadTail);
  EXPECT_TRUE(torch::equal(mine, torch::tensor({2.f, 3.f, 4.f, 5.f, 10.f, 11.f, 12.f, 13.f}).view({2, 4})));
}

TEST(ContextSplit, ASequenceThatDoesNotSplitEvenlyNamesSeqLenAndContext) {
  auto message = [](int64_t seq_len, int64_t context, cp::LoadBalance balance) -> std::string {
    try {
      cp::check_sequence_split(seq_len, context, balance);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  // 2C = 4 chunks of 26 tokens do not exist; C = 2 chunks do.
  const std::string head_tail = message(26, 2, cp::LoadBalance::kHeadTail);
  EXPECT_NE(head_tail.find("model.seq_len (26)"), std::string::npos) << head_tail;
  EXPECT_NE(head_tail.find("parallel.context (2)"), std::string::npos) << head_tail;
  EXPECT_EQ(head_tail.find('\n'), std::string::npos) << head_tail;
  EXPECT_EQ(message(26, 2, cp::LoadBalance::kNone), "");
  const std::string none = message(25, 2, cp::LoadBalance::kNone);
  EXPECT_NE(none.find("model.seq_len (25)"), std::string::npos) << none;
  EXPECT_NE(none.find("parallel.context (2)"), std::string::npos) << none;
  EXPECT_THROW(cp::sequence_positions(26, 2, 0, cp::LoadBalance::kHeadTail), std::invalid_argument);
  EXPECT_THROW(cp::split_sequence(torch::zeros({1, 26}), 2, 0, cp::LoadBalance::kHeadTail),
               std::invalid_argument);
  EXPECT_THROW(cp::check_sequence_split(24, 0, cp::LoadBalance::kNone), std::invalid_argument);
}

TEST(ContextSplit, GatherPutsEveryRanksTokensBackInSequenceOrder) {
  const torch::Tensor x = torch::randn({2, 3, kSeq, 5});
  for (const cp::LoadBalance balance : {cp::LoadBalance::kNone, cp::LoadBalance::kHeadTail}) {
    run_ranks(3, [&](RankContext& ctx) {
      auto group = ctx.make_group("cp");
      const torch::Tensor mine = cp::split_sequence(x, 3, ctx.rank, balance, /*dim=*/2);
      if (!torch::equal(cp::gather_sequence(mine, *group, balance, /*dim=*/2), x)) {
        throw std::runtime_error("gather_sequence did not restore the sequence");
      }
    });
  }
}

// What a check compares: the output and the gradients of q, k and v over
// the whole sequence, in sequence order.
struct Attention {
  torch::Tensor out, dq, dk, dv;
};

// The whole sequence in one piece: q [B, Hq, S, D], k and v [B, Hkv, S, D],
// key/value heads repeated as the llama repeats them.
Attention whole_sequence_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& dout, bool causal) {
  const torch::Tensor ql = q.detach().requires_grad_(), kl = k.detach().requires_grad_(),
                      vl = v.detach().requires_grad_();
  const int64_t group = q.size(1) / k.size(1);
  auto repeat = [&](const torch::Tensor& t) {
    return t.unsqueeze(2).expand({t.size(0), t.size(1), group, t.size(2), t.size(3)})
        .reshape({t.size(0), q.size(1), t.size(2), t.size(3)});
  };
  torch::Tensor out;
  if (causal) {
    out = comm::compat::causal_attention(ql, repeat(kl), repeat(vl));
  } else {
    const torch::Tensor scores = torch::matmul(ql, repeat(kl).transpose(-2, -1)) / std::sqrt(double(q.size(3)));
    out = torch::matmul(torch::softmax(scores, -1), repeat(vl));
  }
  out.backward(dout);
  return {out.detach(), ql.grad(), kl.grad(), vl.grad()};
}

// The same through ring attention over `context` ranks, gathered back.
// Every rank returns what it gathered; rank r's result lands in results[r].
// `stats`, when given, gets each rank's RingStats of the forward and backward.
std::vector<Attention> ring_attention_split(int64_t context, cp::LoadBalance balance, const torch::Tensor& q,
                                            const torch::Tensor& k, const torch::Tensor& v,
                                            const torch::Tensor& dout, bool causal,
                                            std::vector<cp::RingStats>* stats = nullptr) {
  std::vector<Attention> results(static_cast<size_t>(context));
  if (stats != nullptr) stats->assign(static_cast<size_t>(context), cp::RingStats{});
  run_ranks(static_cast<int>(context), [&](RankContext& ctx) {
    auto group = ctx.make_group("cp");
    auto mine = [&](const torch::Tensor& t) { return cp::split_sequence(t, context, ctx.rank, balance, /*dim=*/2); };
    const torch::Tensor ql = mine(q).requires_grad_(), kl = mine(k).requires_grad_(), vl = mine(v).requires_grad_();
    const torch::Tensor table = cp::position_table(q.size(2), context, balance);
    cp::RingStats* mine_stats = stats != nullptr ? &(*stats)[static_cast<size_t>(ctx.rank)] : nullptr;
    const torch::Tensor out = cp::ring_attention(ql, kl, vl, table, *group, causal, mine_stats);
    out.backward(mine(dout));
    auto whole = [&](const torch::Tensor& t) { return cp::gather_sequence(t, *group, balance, /*dim=*/2); };
    results[static_cast<size_t>(ctx.rank)] = {whole(out), whole(ql.grad()), whole(kl.grad()), whole(vl.grad())};
  });
  return results;
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() || !b.defined() || a.sizes() != b.sizes()) return std::numeric_limits<double>::infinity();
  return (a - b).abs().max().item<double>();
}

void expect_equal_attention(const std::vector<Attention>& ring, const Attention& whole) {
  for (size_t r = 0; r < ring.size(); ++r) {
    EXPECT_LT(max_diff(ring[r].out, whole.out), 1e-5) << "output, rank " << r;
    EXPECT_LT(max_diff(ring[r].dq, whole.dq), 1e-5) << "dq, rank " << r;
    EXPECT_LT(max_diff(ring[r].dk, whole.dk), 1e-5) << "dk, rank " << r;
    EXPECT_LT(max_diff(ring[r].dv, whole.dv), 1e-5) << "dv, rank " << r;
  }
}

struct Case {
  int64_t context;
  cp::LoadBalance balance;
  int64_t kv_heads;
};

std::string case_name(const Case& c) {
  return "C" + std::to_string(c.context) + (c.balance == cp::LoadBalance::kHeadTail ? "_HeadTail" : "_NoBalance") +
         (c.kv_heads < kQueryHeads ? "_Gqa" : "_Mha");
}
std::string param_name(const testing::TestParamInfo<Case>& info) { return case_name(info.param); }
// Named (ctest's test names carry the parameter: not its padding bytes).
void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

class RingAttention : public testing::TestWithParam<Case> {};

TEST_P(RingAttention, EqualsWholeSequenceCausalAttentionInOutputAndGradients) {
  const Case c = GetParam();
  torch::manual_seed(72);
  const torch::Tensor q = torch::randn({kBatch, kQueryHeads, kSeq, kDim});
  const torch::Tensor k = torch::randn({kBatch, c.kv_heads, kSeq, kDim});
  const torch::Tensor v = torch::randn({kBatch, c.kv_heads, kSeq, kDim});
  const torch::Tensor dout = torch::randn({kBatch, kQueryHeads, kSeq, kDim});
  const Attention whole = whole_sequence_attention(q, k, v, dout, /*causal=*/true);
  std::vector<cp::RingStats> stats;
  expect_equal_attention(ring_attention_split(c.context, c.balance, q, k, v, dout, /*causal=*/true, &stats), whole);
  // The seconds the trainer reports (metrics.jsonl): every rank spent some
  // in attention; waits only where blocks travel, and within attention.
  for (size_t r = 0; r < stats.size(); ++r) {
    EXPECT_GT(stats[r].attention_s, 0.0) << "rank " << r;
    if (c.context == 1) {
      EXPECT_EQ(stats[r].wait_s, 0.0) << "rank " << r;
    } else {
      EXPECT_GT(stats[r].wait_s, 0.0) << "rank " << r;
    }
    EXPECT_LE(stats[r].wait_s, stats[r].attention_s) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Splits, RingAttention,
    testing::Values(Case{1, cp::LoadBalance::kHeadTail, 2}, Case{2, cp::LoadBalance::kHeadTail, 2},
                    Case{2, cp::LoadBalance::kNone, 2}, Case{2, cp::LoadBalance::kHeadTail, 4},
                    Case{2, cp::LoadBalance::kNone, 4}, Case{3, cp::LoadBalance::kHeadTail, 2},
                    Case{3, cp::LoadBalance::kNone, 2}, Case{3, cp::LoadBalance::kHeadTail, 4},
                    Case{3, cp::LoadBalance::kNone, 4}, Case{4, cp::LoadBalance::kHeadTail, 2},
                    Case{4, cp::LoadBalance::kNone, 2}, Case{4, cp::LoadBalance::kHeadTail, 4},
                    Case{4, cp::LoadBalance::kNone, 4}),
    param_name);

TEST(RingAttentionNonCausal, EqualsWholeSequenceSoftmaxAttention) {
  torch::manual_seed(73);
  const torch::Tensor q = torch::randn({kBatch, kQueryHeads, kSeq, kDim});
  const torch::Tensor k = torch::randn({kBatch, 2, kSeq, kDim});
  const torch::Tensor v = torch::randn({kBatch, 2, kSeq, kDim});
  const torch::Tensor dout = torch::randn({kBatch, kQueryHeads, kSeq, kDim});
  const Attention whole = whole_sequence_attention(q, k, v, dout, /*causal=*/false);
  expect_equal_attention(ring_attention_split(3, cp::LoadBalance::kHeadTail, q, k, v, dout, /*causal=*/false),
                         whole);
}

// The context group as it will be inside a larger job: members {0, 2} and
// {1, 3} of a world of 4, so a member's index in its group is not its
// global rank; the two rings run side by side.
TEST(RingAttentionSubgroups, TwoContextGroupsOfAWorldOfFourRunSideBySide) {
  torch::manual_seed(74);
  const torch::Tensor q = torch::randn({kBatch, kQueryHeads, kSeq, kDim});
  const torch::Tensor k = torch::randn({kBatch, 2, kSeq, kDim});
  const torch::Tensor v = torch::randn({kBatch, 2, kSeq, kDim});
  const torch::Tensor dout = torch::randn({kBatch, kQueryHeads, kSeq, kDim});
  const Attention whole = whole_sequence_attention(q, k, v, dout, /*causal=*/true);
  const cp::LoadBalance balance = cp::LoadBalance::kHeadTail;
  std::vector<double> worst(4, std::numeric_limits<double>::infinity());
  run_ranks(4, [&](RankContext& ctx) {
    const int parity = ctx.rank % 2;
    auto group = ctx.rendezvous.new_group("cp" + std::to_string(parity), {parity, parity + 2});
    const int64_t member = group->rank();
    auto mine = [&](const torch::Tensor& t) { return cp::split_sequence(t, 2, member, balance, /*dim=*/2); };
    const torch::Tensor ql = mine(q).requires_grad_(), kl = mine(k).requires_grad_(), vl = mine(v).requires_grad_();
    const torch::Tensor out = cp::ring_attention(ql, kl, vl, cp::position_table(kSeq, 2, balance), *group);
    out.backward(mine(dout));
    auto whole_of = [&](const torch::Tensor& t) { return cp::gather_sequence(t, *group, balance, /*dim=*/2); };
    worst[static_cast<size_t>(ctx.rank)] =
        std::max({max_diff(whole_of(out), whole.out), max_diff(whole_of(ql.grad()), whole.dq),
                  max_diff(whole_of(kl.grad()), whole.dk), max_diff(whole_of(vl.grad()), whole.dv)});
  });
  for (size_t r = 0; r < worst.size(); ++r) EXPECT_LT(worst[r], 1e-5) << "rank " << r;
}

}  // namespace context_parallel_test
