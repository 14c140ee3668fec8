#include "framework/dtensor/device_mesh.h"
#include "tests/support/multi_rank.h"

#include <gtest/gtest.h>

namespace framework::dtensor {
namespace {

using testing_support::RankContext;
using testing_support::run_ranks;

TEST(DeviceMesh, TwoByTwoMeshLaysRanksOutRowMajor) {
  run_ranks(4, [](RankContext& ctx) {
    auto mesh = DeviceMesh::create(ctx.rendezvous, {2, 2}, {"replicate", "shard"});
    const int64_t r = ctx.rank / 2, s = ctx.rank % 2;
    EXPECT_EQ(mesh->ndim(), 2);
    EXPECT_EQ(mesh->coordinate(0), r);
    EXPECT_EQ(mesh->coordinate(1), s);
    EXPECT_EQ(mesh->global_rank(), ctx.rank);
    EXPECT_EQ(mesh->world_size(), 4);
    EXPECT_EQ(mesh->group(0).size(), 2);
    EXPECT_EQ(mesh->group(1).size(), 2);
    EXPECT_EQ(mesh->group(0).rank(), r);
    EXPECT_EQ(mesh->group(1).rank(), s);
    EXPECT_EQ(mesh->group(0).global_ranks(), (std::vector<int>{static_cast<int>(s), static_cast<int>(2 + s)}));
    EXPECT_EQ(mesh->group(1).global_ranks(), (std::vector<int>{static_cast<int>(2 * r), static_cast<int>(2 * r + 1)}));
    EXPECT_EQ(mesh->group(0).name(), "mesh.replicate." + std::to_string(s));
    EXPECT_EQ(mesh->group(1).name(), "mesh.shard." + std::to_string(r));
    EXPECT_EQ(mesh->axis_index("shard"), 1);
  });
}

// The {replicate, shard, tensor} mesh of tensor parallelism (tensor
// innermost: consecutive ranks) and its {replicate, tensor, shard} view,
// on which DTensors nest TP's split before FSDP's.
TEST(DeviceMesh, ThreeDimensionalMeshAndAPermutedViewShareGroups) {
  run_ranks(4, [](RankContext& ctx) {
    auto mesh = DeviceMesh::create(ctx.rendezvous, {1, 2, 2}, {"replicate", "shard", "tensor"});
    EXPECT_EQ(mesh->coordinate(1), ctx.rank / 2);
    EXPECT_EQ(mesh->coordinate(2), ctx.rank % 2);
    const int t0 = ctx.rank / 2 * 2;
    EXPECT_EQ(mesh->group(2).global_ranks(), (std::vector<int>{t0, t0 + 1}));
    auto view = mesh->permuted({0, 2, 1});
    EXPECT_EQ(view->axis_names(), (std::vector<std::string>{"replicate", "tensor", "shard"}));
    EXPECT_EQ(view->coordinates(), (std::vector<int64_t>{0, ctx.rank % 2, ctx.rank / 2}));
    EXPECT_EQ(&view->group(1), &mesh->group(2));
    EXPECT_EQ(&view->group(2), &mesh->group(1));
    EXPECT_EQ(view->global_rank(), ctx.rank);
    EXPECT_EQ(view->world_size(), 4);
    EXPECT_THROW(mesh->permuted({0, 1, 1}), std::invalid_argument);
    EXPECT_THROW(mesh->permuted({0, 1}), std::invalid_argument);
  });
}

TEST(DeviceMesh, AllReduceOverEachAxisSumsOnlyThatAxisMembers) {
  run_ranks(4, [](RankContext& ctx) {
    auto mesh = DeviceMesh::create(ctx.rendezvous, {2, 2}, {"dp", "fsdp"});
    const int64_t r = ctx.rank / 2, s = ctx.rank % 2;
    at::Tensor along_dp = at::full({3}, ctx.rank, at::kLong);
    mesh->group(0).all_reduce(along_dp);
    EXPECT_TRUE(at::equal(along_dp, at::full({3}, s + (2 + s), at::kLong)));
    at::Tensor along_fsdp = at::full({3}, ctx.rank, at::kLong);
    mesh->group(mesh->axis_index("fsdp")).all_reduce(along_fsdp);
    EXPECT_TRUE(at::equal(along_fsdp, at::full({3}, 2 * r + (2 * r + 1), at::kLong)));
  });
}

TEST(DeviceMesh, OneDimensionalMeshHasOneGroupOverTheWorld) {
  run_ranks(3, [](RankContext& ctx) {
    auto mesh = DeviceMesh::create(ctx.rendezvous, {3}, {"fsdp"}, "flat");
    EXPECT_EQ(mesh->coordinate(0), ctx.rank);
    EXPECT_EQ(mesh->group(0).size(), 3);
    EXPECT_EQ(mesh->group(0).name(), "flat.fsdp.0");
    // A second mesh with another name coexists with the first.
    auto other = DeviceMesh::create(ctx.rendezvous, {1, 3}, {"dp", "fsdp"}, "other");
    EXPECT_EQ(other->group(0).size(), 1);
    EXPECT_EQ(other->group(1).size(), 3);
  });
}

TEST(DeviceMesh, ShapeThatDoesNotCoverTheWorldIsRejected) {
  run_ranks(2, [](RankContext& ctx) {
    try {
      DeviceMesh::create(ctx.rendezvous, {3}, {"fsdp"});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("world size is 2"), std::string::npos) << e.what();
    }
  });
}

TEST(DeviceMesh, UnknownAxisNameIsReportedByName) {
  run_ranks(1, [](RankContext& ctx) {
    auto mesh = DeviceMesh::create(ctx.rendezvous, {1}, {"fsdp"});
    try {
      mesh->axis_index("tp");
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("no axis named 'tp'"), std::string::npos) << e.what();
    }
  });
}

TEST(DeviceMesh, CoordinatesRoundTripThroughRanks) {
  const std::vector<int64_t> shape{2, 3};
  for (int64_t rank = 0; rank < 6; ++rank) {
    auto coords = DeviceMesh::coordinates_of(rank, shape);
    EXPECT_EQ(coords, (std::vector<int64_t>{rank / 3, rank % 3}));
    EXPECT_EQ(DeviceMesh::rank_of(coords, shape), rank);
  }
}

}  // namespace
}  // namespace framework::dtensor
