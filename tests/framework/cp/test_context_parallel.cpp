// Context parallelism (framework/cp): the sequence split (head-tail
// balanced or not), its refusal of a sequence that does not split evenly,
// and its way back over real Gloo groups.
#include "framework/cp/sequence_split.h"
#include "framework/cp/sequence_tensors.h"
#include "support/multi_rank.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace cp = framework::cp;
using testing_support::RankContext;
using testing_support::run_ranks;

// Named, not anonymous: test_framework's sources share one unity unit.
namespace context_parallel_test {

constexpr int64_t kSeq = 24;

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

}  // namespace context_parallel_test
