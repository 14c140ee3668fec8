// Save planning: who writes what, for FSDP, DDP, HSDP and replicated scalars,
// and the errors that name the item and ranks when local plans disagree.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "checkpoint/plan/planner.h"
#include "reference_planner.h"

#include <random>

namespace checkpoint {
namespace {

constexpr uint64_t kMiB = 1 << 20;

WriteItem tensor(const std::string& name, std::vector<int64_t> shape, Box box,
                 DType dtype = DType::kFloat32) {
  return WriteItem{name, ItemKind::kTensor, dtype, std::move(shape), std::move(box)};
}

Box rows(int64_t start, int64_t count, std::vector<int64_t> rest = {}) {
  Box box{{start}, {count}};
  for (int64_t d : rest) {
    box.offsets.push_back(0);
    box.sizes.push_back(d);
  }
  return box;
}

std::vector<LocalPlan> empty_plans(int world) {
  std::vector<LocalPlan> plans(world);
  for (int r = 0; r < world; ++r) plans[r].rank = r;
  return plans;
}

// All boxes assigned for `name`, over all ranks.
std::vector<Box> assigned_boxes(const GlobalPlan& plan, const std::string& name) {
  std::vector<Box> boxes;
  for (const auto& rank_items : plan.per_rank) {
    for (const auto& a : rank_items) {
      if (a.name == name) boxes.push_back(a.box);
    }
  }
  return boxes;
}

std::string plan_error(const std::vector<LocalPlan>& plans) {
  try {
    make_global_plan(plans, PlanOptions{});
  } catch (const PlanError& e) {
    return e.what();
  }
  return "";
}

TEST(Planner, FsdpShardsAreEachWrittenByTheirHolder) {
  auto plans = empty_plans(4);
  for (int r = 0; r < 4; ++r) {
    plans[r].items.push_back(tensor("w", {16, 8}, rows(4 * r, 4, {8})));
    // torch.chunk of 6 rows over 4 ranks: 2, 2, 2, 0
    plans[r].items.push_back(tensor("b", {6}, rows(std::min<int64_t>(2 * r, 6), r < 3 ? 2 : 0)));
  }
  const GlobalPlan plan = make_global_plan(plans, PlanOptions{});
  ASSERT_EQ(plan.per_rank.size(), 4u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(plan.per_rank[r], (std::vector<WriteAssignment>{{"w", rows(4 * r, 4, {8})},
                                                              {"b", rows(2 * r, 2)}}));
    EXPECT_EQ(plan.bytes_per_rank[r], 4u * 8 * 4 + 2 * 4);
  }
  // The empty shard of "b" needs no write.
  EXPECT_EQ(plan.per_rank[3], (std::vector<WriteAssignment>{{"w", rows(12, 4, {8})}}));
}

TEST(Planner, DdpReplicatedTensorIsSplitEvenlyAndWrittenOnce) {
  auto plans = empty_plans(4);
  const std::vector<int64_t> shape = {2048, 1024};  // 8 MiB of float32
  for (auto& p : plans) p.items.push_back(tensor("w", shape, rows(0, 2048, {1024})));
  const GlobalPlan plan = make_global_plan(plans, PlanOptions{});
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(plan.bytes_per_rank[r], 2 * kMiB) << "rank " << r;
    EXPECT_EQ(plan.per_rank[r].size(), 1u) << "rank " << r;
  }
  EXPECT_NO_THROW(check_tiling(shape, assigned_boxes(plan, "w"), "w"));
}

TEST(Planner, ReplicatedRegionWithFewerRowsThanHoldersIsSplitPerRow) {
  auto plans = empty_plans(4);
  for (auto& p : plans) p.items.push_back(tensor("w", {2, 1 << 20}, rows(0, 2, {1 << 20})));
  const GlobalPlan plan = make_global_plan(plans, PlanOptions{});
  EXPECT_EQ(assigned_boxes(plan, "w").size(), 2u);
  EXPECT_EQ(std::count(plan.bytes_per_rank.begin(), plan.bytes_per_rank.end(), 4 * kMiB), 2);
  EXPECT_NO_THROW(check_tiling({2, 1 << 20}, assigned_boxes(plan, "w"), "w"));
}

TEST(Planner, SmallReplicatedItemsAreBalancedWithinOneItem) {
  auto plans = empty_plans(4);
  for (int i = 0; i < 101; ++i) {
    for (auto& p : plans) p.items.push_back(tensor("p" + std::to_string(i), {256}, rows(0, 256)));
  }
  const GlobalPlan plan = make_global_plan(plans, PlanOptions{});
  size_t total = 0;
  for (const auto& rank_items : plan.per_rank) total += rank_items.size();
  EXPECT_EQ(total, 101u);  // each written once, none split
  const auto [lo, hi] = std::minmax_element(plan.bytes_per_rank.begin(), plan.bytes_per_rank.end());
  EXPECT_LE(*hi - *lo, 1024u);
}

TEST(Planner, HsdpShardsAreWrittenOnceAcrossReplicas) {
  // 2 replicas x 2 shards: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1.
  auto plans = empty_plans(4);
  const std::vector<int64_t> shape = {1024, 1024};  // 4 MiB; 2 MiB per shard
  for (int r = 0; r < 4; ++r) plans[r].items.push_back(tensor("w", shape, rows(512 * (r % 2), 512, {1024})));
  const GlobalPlan plan = make_global_plan(plans, PlanOptions{});
  for (int r = 0; r < 4; ++r) EXPECT_EQ(plan.bytes_per_rank[r], kMiB) << "rank " << r;
  EXPECT_NO_THROW(check_tiling(shape, assigned_boxes(plan, "w"), "w"));

  // Below the split threshold each shard goes whole to one of its replicas.
  PlanOptions no_split;
  no_split.split_min_bytes = 64 * kMiB;
  const GlobalPlan whole = make_global_plan(plans, no_split);
  const std::vector<Box> boxes = assigned_boxes(whole, "w");
  EXPECT_EQ(boxes.size(), 2u);
  EXPECT_NO_THROW(check_tiling(shape, boxes, "w"));
  EXPECT_EQ(whole.bytes_per_rank[0] + whole.bytes_per_rank[2], 2 * kMiB);
  EXPECT_EQ(whole.bytes_per_rank[1] + whole.bytes_per_rank[3], 2 * kMiB);
}

// At thousands of replicas a region is split into pieces of at least
// min_piece_bytes, not one tiny piece per holder, and the bytes stay balanced.
TEST(Planner, ManyReplicasSplitIntoPiecesOfAtLeastTheMinimum) {
  const int world = 512;
  auto plans = empty_plans(world);
  const std::vector<int64_t> shape = {4096, 1024};  // 16 MiB of float32
  for (int i = 0; i < 8; ++i) {
    for (auto& p : plans) p.items.push_back(tensor("w" + std::to_string(i), shape, rows(0, 4096, {1024})));
  }
  const GlobalPlan plan = make_global_plan(plans, PlanOptions{});
  for (int i = 0; i < 8; ++i) {
    const std::vector<Box> boxes = assigned_boxes(plan, "w" + std::to_string(i));
    EXPECT_EQ(boxes.size(), 16u);  // 16 MiB / 1 MiB
    EXPECT_NO_THROW(check_tiling(shape, boxes, "w"));
  }
  // 128 pieces of 1 MiB over 512 ranks: no rank writes two.
  EXPECT_EQ(*std::max_element(plan.bytes_per_rank.begin(), plan.bytes_per_rank.end()), kMiB);
  PlanOptions every_holder;
  every_holder.min_piece_bytes = 0;
  EXPECT_EQ(assigned_boxes(make_global_plan(plans, every_holder), "w0").size(), 512u);
}

TEST(Planner, ReplicatedScalarsAndBytesAreWrittenOnceAndNeverSplit) {
  auto plans = empty_plans(4);
  for (auto& p : plans) {
    p.items.push_back(tensor("step", {}, Box{{}, {}}, DType::kInt64));
    p.items.push_back(WriteItem{"config", ItemKind::kBytes, DType::kUInt8, {4 << 20}, rows(0, 4 << 20)});
    p.items.push_back(WriteItem{"empty_bytes", ItemKind::kBytes, DType::kUInt8, {0}, rows(0, 0)});
  }
  const GlobalPlan plan = make_global_plan(plans, PlanOptions{});
  EXPECT_EQ(assigned_boxes(plan, "step"), (std::vector<Box>{Box{{}, {}}}));
  EXPECT_EQ(assigned_boxes(plan, "config"), (std::vector<Box>{rows(0, 4 << 20)}));
  EXPECT_EQ(assigned_boxes(plan, "empty_bytes"), (std::vector<Box>{rows(0, 0)}));
}

TEST(Planner, BytesItemMustBeHeldWhole) {
  auto plans = empty_plans(1);
  plans[0].items.push_back(WriteItem{"rng", ItemKind::kBytes, DType::kUInt8, {16}, rows(0, 8)});
  EXPECT_NE(plan_error(plans).find("item 'rng'"), std::string::npos) << plan_error(plans);
}

TEST(Planner, GapIsRejectedNamingTheItem) {
  auto plans = empty_plans(4);
  for (int r = 0; r < 3; ++r) plans[r].items.push_back(tensor("w", {16, 8}, rows(4 * r, 4, {8})));
  const std::string error = plan_error(plans);
  EXPECT_NE(error.find("item 'w'"), std::string::npos) << error;
  EXPECT_NE(error.find("gap"), std::string::npos) << error;
}

TEST(Planner, PartialOverlapIsRejectedNamingTheItemAndRanks) {
  auto plans = empty_plans(2);
  plans[0].items.push_back(tensor("w", {4}, rows(0, 3)));
  plans[1].items.push_back(tensor("w", {4}, rows(2, 2)));
  const std::string error = plan_error(plans);
  EXPECT_NE(error.find("item 'w'"), std::string::npos) << error;
  EXPECT_NE(error.find("overlap"), std::string::npos) << error;
  EXPECT_NE(error.find("ranks [0]"), std::string::npos) << error;
  EXPECT_NE(error.find("ranks [1]"), std::string::npos) << error;
}

TEST(Planner, OutOfBoundsBoxIsRejectedNamingTheItemAndRank) {
  auto plans = empty_plans(2);
  plans[0].items.push_back(tensor("w", {4}, rows(0, 2)));
  plans[1].items.push_back(tensor("w", {4}, rows(2, 3)));
  const std::string error = plan_error(plans);
  EXPECT_NE(error.find("item 'w'"), std::string::npos) << error;
  EXPECT_NE(error.find("out of bounds"), std::string::npos) << error;
  EXPECT_NE(error.find("ranks [1]"), std::string::npos) << error;
}

TEST(Planner, DisagreementOnShapeOrDtypeIsRejectedNamingTheRanks) {
  auto plans = empty_plans(3);
  plans[0].items.push_back(tensor("w", {4}, rows(0, 2)));
  plans[2].items.push_back(tensor("w", {6}, rows(2, 2)));
  EXPECT_EQ(plan_error(plans), "item 'w': rank 0 has global shape [4] but rank 2 has [6]");

  plans[2].items[0] = tensor("w", {4}, rows(2, 2), DType::kBFloat16);
  EXPECT_EQ(plan_error(plans), "item 'w': rank 0 has dtype float32 but rank 2 has bfloat16");
}

TEST(Planner, ZeroSizeBoxesAreAccepted) {
  auto plans = empty_plans(2);
  for (auto& p : plans) p.items.push_back(tensor("empty", {0, 4}, rows(0, 0, {4})));
  plans[0].items.push_back(tensor("w", {4}, rows(0, 4)));
  plans[1].items.push_back(tensor("w", {4}, rows(4, 0)));
  const GlobalPlan plan = make_global_plan(plans, PlanOptions{});
  EXPECT_TRUE(assigned_boxes(plan, "empty").empty());
  EXPECT_EQ(assigned_boxes(plan, "w"), (std::vector<Box>{rows(0, 4)}));
}

TEST(Planner, RanksMustBeDistinctAndInRange) {
  auto plans = empty_plans(2);
  plans[1].rank = 0;
  EXPECT_NE(plan_error(plans).find("two local plans claim rank 0"), std::string::npos);
  plans[1].rank = 5;
  EXPECT_NE(plan_error(plans).find("rank 5 is out of range"), std::string::npos);
}

TEST(Planner, PlanIsDeterministic) {
  auto plans = empty_plans(4);
  for (int i = 0; i < 20; ++i) {
    for (auto& p : plans) p.items.push_back(tensor("p" + std::to_string(i), {64 * (i + 1), 1024}, rows(0, 64 * (i + 1), {1024})));
  }
  const GlobalPlan a = make_global_plan(plans, PlanOptions{});
  const GlobalPlan b = make_global_plan(plans, PlanOptions{});
  EXPECT_EQ(a.per_rank, b.per_rank);
  for (int i = 0; i < 20; ++i) {
    const std::string name = "p" + std::to_string(i);
    EXPECT_NO_THROW(check_tiling({64 * (i + 1), 1024}, assigned_boxes(a, name), name));
  }
}

TEST(Tiling, AcceptsDim1ShardingAndRejectsRankMismatch) {
  EXPECT_FALSE(find_tiling_problem({4, 8}, {Box{{0, 0}, {4, 4}}, Box{{0, 4}, {4, 4}}}));
  EXPECT_FALSE(find_tiling_problem({}, {Box{{}, {}}}));
  EXPECT_TRUE(find_tiling_problem({}, {Box{{}, {}}, Box{{}, {}}}));
  EXPECT_TRUE(find_tiling_problem({4, 8}, {Box{{0}, {4}}}));
  // 2-D grid with one overlapping corner.
  EXPECT_TRUE(find_tiling_problem({4, 4}, {Box{{0, 0}, {2, 2}}, Box{{0, 2}, {2, 2}},
                                           Box{{2, 0}, {2, 3}}, Box{{1, 2}, {3, 2}}}));
  EXPECT_THROW(check_tiling({4}, {Box{{0}, {2}}}, "w"), PlanError);
}

TEST(PlanCodec, LocalPlanRoundTrips) {
  LocalPlan plan;
  plan.rank = 3;
  plan.items.push_back(tensor("w", {16, 8}, rows(4, 4, {8}), DType::kBFloat16));
  plan.items.push_back(tensor("scalar", {}, Box{{}, {}}, DType::kInt64));
  plan.items.push_back(WriteItem{"rng", ItemKind::kBytes, DType::kUInt8, {5}, rows(0, 5)});
  const std::vector<uint8_t> blob = encode_local_plan(plan);
  const LocalPlan back = decode_local_plan(blob.data(), blob.size());
  EXPECT_EQ(back.rank, 3);
  ASSERT_EQ(back.items.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(back.items[i].name, plan.items[i].name);
    EXPECT_EQ(back.items[i].kind, plan.items[i].kind);
    EXPECT_EQ(back.items[i].dtype, plan.items[i].dtype);
    EXPECT_EQ(back.items[i].global_shape, plan.items[i].global_shape);
    EXPECT_EQ(back.items[i].box, plan.items[i].box);
  }
  for (size_t len = 0; len < blob.size(); ++len) {
    EXPECT_THROW(decode_local_plan(blob.data(), len), PlanError) << "length " << len;
  }
  std::vector<uint8_t> longer = blob;
  longer.push_back(0);
  EXPECT_THROW(decode_local_plan(longer.data(), longer.size()), PlanError);
}

TEST(PlanCodec, AssignmentsRoundTripAndTruncationIsRejected) {
  const std::vector<WriteAssignment> assignments = {
      {"w", rows(4, 4, {8})}, {"scalar", Box{{}, {}}}, {"b", rows(0, 0)}};
  const std::vector<uint8_t> blob = encode_assignments(assignments);
  EXPECT_EQ(decode_assignments(blob.data(), blob.size()), assignments);
  for (size_t len = 0; len < blob.size(); ++len) {
    EXPECT_THROW(decode_assignments(blob.data(), len), PlanError) << "length " << len;
  }
  // A local plan blob is not an assignments blob.
  const std::vector<uint8_t> other = encode_local_plan(LocalPlan{});
  EXPECT_THROW(decode_assignments(other.data(), other.size()), PlanError);
}

TEST(PlanCodec, AbsurdCountIsRejected) {
  std::vector<uint8_t> blob = encode_assignments({});
  blob.pop_back();
  for (uint8_t b : {0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}) blob.push_back(b);
  EXPECT_THROW(decode_assignments(blob.data(), blob.size()), PlanError);
}

// The streaming planner (GlobalPlanner, flat memory, ordered-set balancing)
// against the planner it replaced, kept as the oracle: the same plan, rank
// for rank and byte for byte, on random FSDP / HSDP / DDP / 2-D / mixed
// states with bytes items and empty shards, at several split thresholds.
std::vector<LocalPlan> random_plans(std::mt19937& rng, int world) {
  auto plans = empty_plans(world);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  const int items = 1 + pick(12);
  for (int i = 0; i < items; ++i) {
    const std::string name = "item" + std::to_string(i);
    const int64_t rows = pick(3) == 0 ? pick(4) : 1 + pick(40);
    const int64_t cols = 1 + pick(6);
    const DType dtype = pick(2) ? DType::kFloat32 : DType::kBFloat16;
    const int style = pick(5);
    if (style == 4) {  // a bytes item, held by one or by every rank
      const int64_t n = pick(20);
      const int owner = pick(2) ? -1 : pick(world);
      for (int r = 0; r < world; ++r) {
        if (owner < 0 || owner == r) {
          plans[r].items.push_back(WriteItem{name, ItemKind::kBytes, DType::kUInt8, {n}, Box{{0}, {n}}});
        }
      }
      continue;
    }
    // Shard(0) over `shard` ranks, torch.chunk-style, replicated world/shard
    // times (1: DDP, world: FSDP), or 2-D tiles over a 2 x (world/2) grid.
    const int shard = style == 0 ? 1 : style == 1 ? world : style == 2 ? std::max(1, world / 2) : 0;
    for (int r = 0; r < world; ++r) {
      Box box;
      if (shard > 0) {
        const int64_t idx = r % shard;
        const int64_t chunk = (rows + shard - 1) / shard;
        const int64_t lo = std::min(idx * chunk, rows), hi = std::min(lo + chunk, rows);
        box = Box{{lo, 0}, {hi - lo, cols}};
      } else {
        const int64_t half = (rows + 1) / 2;
        const int64_t lo = (r % 2) * half, hi = std::min(lo + half, rows);
        const int64_t lo_r = std::min<int64_t>(lo, rows);
        box = Box{{lo_r, 0}, {std::max<int64_t>(0, hi - lo_r), cols}};
      }
      plans[r].items.push_back(tensor(name, {rows, cols}, box, dtype));
    }
  }
  for (auto& p : plans) std::shuffle(p.items.begin(), p.items.end(), rng);
  return plans;
}

TEST(Planner, StreamingPlannerMatchesTheReferencePlanner) {
  std::mt19937 rng(20261123);
  int compared = 0;
  for (int round = 0; round < 400; ++round) {
    const int world = 1 + static_cast<int>(rng() % 9);
    auto plans = random_plans(rng, world);
    std::shuffle(plans.begin(), plans.end(), rng);  // any order in
    for (uint64_t split : {uint64_t{1}, uint64_t{64}, uint64_t{1} << 20}) {
      PlanOptions options;
      options.split_min_bytes = split;
      options.min_piece_bytes = 0;  // the reference split across every holder
      std::string want_error, got_error;
      GlobalPlan want, got;
      try {
        want = reference::make_global_plan(plans, options);
      } catch (const PlanError& e) {
        want_error = e.what();
      }
      try {
        got = make_global_plan(plans, options);
      } catch (const PlanError& e) {
        got_error = e.what();
      }
      ASSERT_EQ(got_error, want_error) << "round " << round;
      if (!want_error.empty()) continue;
      ASSERT_EQ(got.per_rank, want.per_rank) << "round " << round << " split " << split;
      ASSERT_EQ(got.bytes_per_rank, want.bytes_per_rank) << "round " << round;
      // The coordinator's way: encoded blobs, in rank order, added in place.
      GlobalPlanner planner(plans.size(), options);
      std::vector<const LocalPlan*> by_rank(plans.size());
      for (const LocalPlan& p : plans) by_rank[p.rank] = &p;
      for (const LocalPlan* p : by_rank) {
        const std::vector<uint8_t> blob = encode_local_plan(*p);
        ASSERT_EQ(planner.add_encoded(blob.data(), blob.size()), p->rank);
      }
      std::vector<WriteItem> declarations;
      const GlobalPlan streamed = planner.finish(&declarations);
      ASSERT_EQ(streamed.per_rank, want.per_rank) << "round " << round << " split " << split;
      ASSERT_EQ(streamed.bytes_per_rank, want.bytes_per_rank) << "round " << round;
      ++compared;
    }
  }
  EXPECT_GT(compared, 1000);
}

// The same errors, word for word, for plans that do not tile or disagree.
TEST(Planner, StreamingPlannerFailsLikeTheReferencePlanner) {
  std::mt19937 rng(7);
  int failures = 0;
  for (int round = 0; round < 400; ++round) {
    const int world = 2 + static_cast<int>(rng() % 5);
    auto plans = random_plans(rng, world);
    // Damage one item on one rank: shift, shrink, grow, re-rank its box,
    // change its dtype or shape, or drop it.
    auto& victim = plans[rng() % plans.size()];
    if (victim.items.empty()) continue;
    WriteItem& w = victim.items[rng() % victim.items.size()];
    switch (rng() % 7) {
      case 0: if (!w.box.offsets.empty()) w.box.offsets[0] += 1; break;
      case 1: if (!w.box.sizes.empty() && w.box.sizes[0] > 0) w.box.sizes[0] -= 1; break;
      case 2: if (!w.box.sizes.empty()) w.box.sizes.back() += 1; break;
      case 3: w.box.offsets.push_back(0), w.box.sizes.push_back(1); break;
      case 4: w.dtype = w.dtype == DType::kFloat32 ? DType::kFloat64 : DType::kFloat32; break;
      case 5: w.global_shape.push_back(1); break;
      case 6: victim.items.push_back(w); break;  // held twice
    }
    std::string want_error, got_error;
    try {
      reference::make_global_plan(plans, PlanOptions{});
    } catch (const PlanError& e) {
      want_error = e.what();
    }
    try {
      make_global_plan(plans, PlanOptions{});
    } catch (const PlanError& e) {
      got_error = e.what();
    }
    ASSERT_EQ(got_error, want_error) << "round " << round;
    failures += want_error.empty() ? 0 : 1;
    std::string streamed_error;
    try {
      GlobalPlanner planner(plans.size(), PlanOptions{});
      for (int r = 0; r < static_cast<int>(plans.size()); ++r) {
        const std::vector<uint8_t> blob = encode_local_plan(plans[r]);
        planner.add_encoded(blob.data(), blob.size());
      }
      planner.finish();
    } catch (const PlanError& e) {
      streamed_error = e.what();
    }
    ASSERT_EQ(streamed_error, want_error) << "round " << round;
  }
  EXPECT_GT(failures, 200);
}

}  // namespace
}  // namespace checkpoint
