// framework/parallel: the layout's degrees resolved against a world size,
// its rules, each rank's coordinates and the banner's names. Pure and
// torch-free (it runs in test_config).
#include "framework/parallel/layout.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>

namespace {

using framework::parallel::check_config;
using framework::parallel::Layout;
using framework::parallel::ParallelConfig;
using framework::parallel::resolve;

ParallelConfig degrees(int64_t replicate, int64_t shard, int64_t tensor = 1, int64_t pipeline = 1) {
  ParallelConfig c;
  c.replicate = replicate;
  c.shard = shard;
  c.tensor = tensor;
  c.pipeline = pipeline;
  return c;
}

std::string refusal(const ParallelConfig& c, int64_t world) {
  try {
    resolve(c, world);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(ParallelLayout, TheDerivedDegreeTakesWhatTheWorldLeaves) {
  const Layout fsdp = resolve(ParallelConfig{}, 4);  // the defaults: replicate 1, shard -1
  EXPECT_EQ(std::make_tuple(fsdp.pipeline, fsdp.replicate, fsdp.shard, fsdp.tensor), std::make_tuple(1, 1, 4, 1));
  EXPECT_EQ(fsdp.describe(), "fsdp replicate=1 shard=4");
  const Layout ddp = resolve(degrees(-1, 1), 4);
  EXPECT_EQ(ddp.replicate, 4);
  EXPECT_EQ(ddp.describe(), "ddp replicate=4 shard=1");
  const Layout hsdp_tp = resolve(degrees(2, -1, 2), 8);
  EXPECT_EQ(hsdp_tp.shard, 2);
  EXPECT_EQ(hsdp_tp.data_parallel(), 4);
  EXPECT_EQ(hsdp_tp.describe(), "hsdp+tp replicate=2 shard=2 tensor=2");
  const Layout pp = resolve(degrees(1, -1, 2, 2), 8);
  EXPECT_EQ(pp.stage_world(), 4);
  EXPECT_EQ(pp.shard, 2);
  EXPECT_EQ(pp.world(), 8);
  EXPECT_EQ(pp.stage_shape(), (std::vector<int64_t>{1, 2, 2}));
  EXPECT_EQ(pp.stage_axis_names(), (std::vector<std::string>{"replicate", "shard", "tensor"}));
  EXPECT_EQ(resolve(degrees(1, 1), 1).describe(), "single replicate=1 shard=1");
  EXPECT_EQ(resolve(degrees(1, 1, 2), 2).describe(), "tp replicate=1 shard=1 tensor=2");
}

TEST(ParallelLayout, DegreesThatDoNotFitTheWorldAreRefusedNamingTheKeys) {
  EXPECT_EQ(refusal(degrees(1, -1, 1, 3), 4), "parallel.pipeline (3) does not divide the world size 4");
  EXPECT_EQ(refusal(degrees(1, -1, 2), 3), "parallel.tensor (2) does not divide the world size 3");
  EXPECT_EQ(refusal(degrees(-1, -1), 4), "parallel.replicate and parallel.shard cannot both be -1");
  EXPECT_EQ(refusal(degrees(3, -1), 4), "parallel.replicate (3) x parallel.shard (-1) does not match the world size 4");
  EXPECT_EQ(refusal(degrees(2, 2, 2), 4),
            "parallel.replicate (2) x parallel.shard (2) does not match the data-parallel size 2");
}

TEST(ParallelLayout, CoordinatesPutTheTensorAxisInnermostAndThePipelineOutermost) {
  const Layout l = resolve(degrees(2, 2, 2, 2), 16);
  std::set<std::tuple<int64_t, int64_t, int64_t>> seen;
  for (int64_t rank = 0; rank < l.world(); ++rank) {
    const Layout::Coordinates c = l.coordinates(rank);
    EXPECT_EQ(rank, (c.pipeline * l.data_parallel() + c.data_parallel) * l.tensor + c.tensor) << rank;
    seen.insert({c.pipeline, c.data_parallel, c.tensor});
  }
  EXPECT_EQ(seen.size(), 16u);  // every rank its own place
  EXPECT_EQ(l.coordinates(1).tensor, 1);  // a tensor group is consecutive ranks
  EXPECT_EQ(l.coordinates(8).pipeline, 1);
}

TEST(ParallelLayout, RulesWithoutAWorldSizeNameEachKeyAsTheCallerDescribesIt) {
  const auto describe = [](const std::string& path) { return path + " (from test)"; };
  try {
    check_config(degrees(-1, -1), describe);
    FAIL() << "accepted both degrees derived";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "parallel.replicate (from test) and parallel.shard (from test) are both -1; at "
                                     "most one degree can be derived from the world size");
  }
  ParallelConfig staged;
  staged.stages_per_rank = 2;
  try {
    check_config(staged, describe);
    FAIL() << "accepted stages_per_rank without a pipeline";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "parallel.stages_per_rank (from test) needs parallel.pipeline (from test) above 1");
  }
  ParallelConfig interleaved = degrees(1, -1, 1, 2);
  interleaved.pipeline_schedule = framework::pp::Schedule::kInterleaved1F1B;
  try {
    check_config(interleaved, describe);
    FAIL() << "accepted interleaved_1f1b with one stage per rank";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.pipeline_schedule (from test), parallel.stages_per_rank (from test): "),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(check_config(ParallelConfig{}, describe));
}

}  // namespace

// Context parallelism (#72) borrows its ranks from the shard axis, as
// consecutive ranks (context innermost): FSDP still shards over the whole
// shard axis, the batch splits over replicate x shard / context only.
TEST(ParallelLayout, ContextFoldsIntoTheShardAxisInnermostAndTheBatchSplitsOverTheRest) {
  ParallelConfig c = degrees(2, -1);
  c.context = 2;
  const Layout l = resolve(c, 8);
  EXPECT_EQ(std::make_tuple(l.replicate, l.shard, l.context, l.batch_shard()), std::make_tuple(2, 4, 2, 2));
  EXPECT_EQ(l.data_parallel(), 8);
  EXPECT_EQ(l.batch_parallel(), 4);
  EXPECT_EQ(l.describe(), "hsdp replicate=2 shard=4 context=2");
  EXPECT_EQ(l.context_shape(), (std::vector<int64_t>{2, 2, 2}));
  std::map<int64_t, std::set<int64_t>> groups;  // batch rank -> its context group's ranks
  for (int64_t rank = 0; rank < 8; ++rank) {
    const Layout::Coordinates at = l.coordinates(rank);
    EXPECT_EQ(at.batch * 2 + at.context, at.data_parallel) << rank;
    groups[at.batch].insert(rank);
  }
  ASSERT_EQ(groups.size(), 4u);
  for (const auto& [batch, ranks] : groups) {
    EXPECT_EQ(ranks, (std::set<int64_t>{2 * batch, 2 * batch + 1})) << "consecutive ranks of the shard axis";
  }
  EXPECT_EQ(framework::parallel::split_batch(c, l, 12, 0), 1);
  EXPECT_EQ(framework::parallel::split_batch(c, l, 12, 3), 1);  // 12 / 4 batch ranks = 3 = one micro-batch
  try {
    framework::parallel::split_batch(c, l, 6, 0);
    FAIL() << "accepted 6 sequences over 4 batch ranks";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "train.global_batch_size (6) must be divisible by the data-parallel ranks / "
                                     "parallel.context (4)");
  }
  ParallelConfig one = degrees(1, -1);
  one.context = 2;
  EXPECT_EQ(resolve(one, 2).describe(), "fsdp replicate=1 shard=2 context=2");
  EXPECT_EQ(resolve(one, 2).batch_parallel(), 1);
}

TEST(ParallelLayout, AContextDegreeThatDoesNotDivideTheShardIsRefusedAndItCombinesWithTheOtherAxes) {
  ParallelConfig c = degrees(1, -1);
  c.context = 3;
  EXPECT_EQ(refusal(c, 4),
            "parallel.context (3) must divide the shard degree 4: context parallelism borrows its ranks from the "
            "shard axis");
  // With tensor and expert parallelism (world 8: shard 4 = batch 2 x
  // context 2 = expert shard 2 x expert 2, tensor 2): a context group is
  // the ranks of one tensor rank whose shard index differs in its context
  // place only, `tensor` apart in the world.
  c.context = 2;
  c.tensor = 2;
  c.expert = 2;
  const Layout l = resolve(c, 8);
  EXPECT_EQ(l.describe(), "fsdp+tp replicate=1 shard=4 expert=2 context=2 tensor=2");
  EXPECT_EQ(l.context_shape(), (std::vector<int64_t>{1, 2, 2, 2}));
  EXPECT_EQ(l.context_axis_names(), (std::vector<std::string>{"replicate", "batch_shard", "context", "tensor"}));
  EXPECT_EQ(l.batch_parallel(), 2);
  std::map<std::pair<int64_t, int64_t>, std::set<int64_t>> groups;  // (batch, tensor) -> its context group
  for (int64_t rank = 0; rank < 8; ++rank) {
    const Layout::Coordinates at = l.coordinates(rank);
    groups[{at.batch, at.tensor}].insert(rank);
  }
  ASSERT_EQ(groups.size(), 4u);
  for (const auto& [key, ranks] : groups) {
    const int64_t first = key.first * 4 + key.second;
    EXPECT_EQ(ranks, (std::set<int64_t>{first, first + 2})) << "batch " << key.first << ", tensor " << key.second;
  }
  // With a pipeline: each stage's ranks in the same layout.
  ParallelConfig piped = degrees(1, -1, 1, 2);
  piped.context = 2;
  const Layout p = resolve(piped, 4);
  EXPECT_EQ(p.describe(), "fsdp replicate=1 shard=2 context=2");
  EXPECT_EQ(p.coordinates(3).pipeline, 1);
  EXPECT_EQ(p.coordinates(3).context, 1);
  EXPECT_EQ(p.coordinates(2).context, 0);
  EXPECT_EQ(refusal(degrees(1, -1), 4), "(accepted)");
}
