#include "framework/dtensor/dtensor.h"
#include "tests/support/multi_rank.h"

#include <gtest/gtest.h>

namespace framework::dtensor {
namespace {

using testing_support::RankContext;
using testing_support::run_ranks;

using Shape = std::vector<int64_t>;

// Same values on every rank; exact in every dtype the tests use.
at::Tensor sample(const Shape& shape, at::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t e : shape) numel *= e;
  return at::arange(numel, at::kDouble).mul(0.25).sub(3).reshape(shape).to(dtype);
}

at::Tensor box_of(const at::Tensor& full, const std::pair<Shape, Shape>& box) {
  at::Tensor t = full;
  for (size_t d = 0; d < box.first.size(); ++d) {
    t = t.narrow(static_cast<int64_t>(d), box.first[d], box.second[d]);
  }
  return t;
}

// The local chunk is exactly the part of `full` at the rank's box.
void expect_holds_box_of(const DTensor& t, const at::Tensor& full) {
  ASSERT_EQ(t.local().sizes().vec(), t.local_sizes());
  EXPECT_TRUE(at::equal(t.local(), box_of(full, {t.local_offsets(), t.local_sizes()})))
      << "placements " << to_string(t.placements());
  EXPECT_EQ(t.local().scalar_type(), full.scalar_type());
}

std::vector<int64_t> sizes_of(int64_t n, int64_t parts) {
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < parts; ++i) sizes.push_back(chunk_span(n, parts, i).size);
  return sizes;
}

TEST(Chunk, SplitsLikeTorchChunkWithEmptyTrailingParts) {
  EXPECT_EQ(sizes_of(6, 4), (std::vector<int64_t>{2, 2, 2, 0}));
  EXPECT_EQ(sizes_of(3, 4), (std::vector<int64_t>{1, 1, 1, 0}));
  EXPECT_EQ(sizes_of(8, 3), (std::vector<int64_t>{3, 3, 2}));
  EXPECT_EQ(sizes_of(0, 2), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(chunk_span(6, 4, 3).offset, 6);
  EXPECT_EQ(chunk_span(8, 3, 2).offset, 6);
  EXPECT_EQ(chunk_capacity(6, 4), 2);
  EXPECT_EQ(chunk_capacity(0, 2), 0);
  EXPECT_THROW(chunk_span(6, 4, 4), c10::Error);
  EXPECT_THROW(chunk_capacity(6, 0), c10::Error);
}

TEST(Placement, PrintsAndComparesLikeDTensor) {
  EXPECT_EQ(Placement::shard(0).to_string(), "Shard(0)");
  EXPECT_EQ(Placement::replicate().to_string(), "Replicate()");
  EXPECT_EQ(Placement::shard(1), Placement::shard(1));
  EXPECT_NE(Placement::shard(1), Placement::shard(0));
  EXPECT_NE(Placement::shard(0), Placement::replicate());
  EXPECT_EQ(to_string({Placement::replicate(), Placement::shard(0)}), "[Replicate(), Shard(0)]");
}

TEST(LocalBox, IsAPureFunctionOfShapesCoordinatesAndPlacements) {
  using P = Placement;
  // 1-D mesh of 4, 6 rows: the last rank's box is empty and sits at the end.
  auto box = DTensor::local_box({6, 5}, {4}, {3}, {P::shard(0)});
  EXPECT_EQ(box.first, (Shape{6, 0}));
  EXPECT_EQ(box.second, (Shape{0, 5}));
  // Two axes sharding dim 0 nest: 7 -> 4,3 over axis 0, then 4 -> 2,2 and 3 -> 2,1.
  box = DTensor::local_box({7, 4}, {2, 2}, {1, 1}, {P::shard(0), P::shard(0)});
  EXPECT_EQ(box.first, (Shape{6, 0}));
  EXPECT_EQ(box.second, (Shape{1, 4}));
  box = DTensor::local_box({7, 4}, {2, 2}, {0, 1}, {P::shard(0), P::shard(0)});
  EXPECT_EQ(box.first, (Shape{2, 0}));
  EXPECT_EQ(box.second, (Shape{2, 4}));
  // HSDP: the replicate coordinate does not move the box.
  EXPECT_EQ(DTensor::local_box({5, 3}, {2, 2}, {0, 1}, {P::replicate(), P::shard(1)}),
            DTensor::local_box({5, 3}, {2, 2}, {1, 1}, {P::replicate(), P::shard(1)}));
  EXPECT_THROW(DTensor::local_box({5}, {2}, {0}, {P::shard(1)}), c10::Error);
  EXPECT_THROW(DTensor::local_box({5}, {2}, {2}, {P::shard(0)}), c10::Error);
  EXPECT_THROW(DTensor::local_box({5}, {2, 2}, {0, 0}, {P::shard(0)}), c10::Error);
}

TEST(DTensor, DistributeAndFullTensorRoundTripForEveryWorldShapeAndPlacement) {
  const std::vector<Shape> shapes{{6, 5}, {3, 2}, {7}, {4, 3, 2}, {0, 4}};
  const std::vector<at::ScalarType> dtypes{at::kDouble, at::kFloat, at::kBFloat16, at::kLong};
  for (int world = 1; world <= 4; ++world) {
    run_ranks(world, [&](RankContext& ctx) {
      auto mesh = DeviceMesh::create(ctx.rendezvous, {world}, {"fsdp"});
      for (size_t i = 0; i < shapes.size(); ++i) {
        const Shape& shape = shapes[i];
        const at::Tensor full = sample(shape, dtypes[i % dtypes.size()]);
        for (Placement p : {Placement::shard(0), Placement::shard(1), Placement::replicate()}) {
          if (p.is_shard() && p.dim >= static_cast<int64_t>(shape.size())) continue;
          DTensor t = DTensor::distribute(full, mesh, {p});
          Shape offsets(shape.size(), 0), sizes = shape;
          if (p.is_shard()) {
            Span span = chunk_span(shape[p.dim], world, ctx.rank);
            offsets[p.dim] = span.offset;
            sizes[p.dim] = span.size;
          }
          EXPECT_EQ(t.local_offsets(), offsets) << p.to_string();
          EXPECT_EQ(t.local_sizes(), sizes) << p.to_string();
          EXPECT_TRUE(t.local().is_contiguous());
          expect_holds_box_of(t, full);
          EXPECT_EQ(t.is_replicated_somewhere(), !p.is_shard() && world > 1);
          at::Tensor back = t.full_tensor();
          EXPECT_TRUE(at::equal(back, full))
              << "world " << world << " shape " << at::IntArrayRef(shape) << " " << p.to_string();
        }
      }
    });
  }
}

TEST(DTensor, RedistributeRoundTripsAreExactIncludingEmptyShardsAndBf16) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    run_ranks(4, [&](RankContext& ctx) {
      auto mesh = DeviceMesh::create(ctx.rendezvous, {4}, {"fsdp"});
      const at::Tensor full = sample({6, 3}, dtype);  // 6 rows over 4: 2,2,2,0
      const auto s0 = Placement::shard(0), s1 = Placement::shard(1), rep = Placement::replicate();

      DTensor a = DTensor::distribute(full, mesh, {s0});
      DTensor replicated = a.redistribute({rep});
      EXPECT_TRUE(at::equal(replicated.local(), full));
      DTensor again = replicated.redistribute({s0});
      expect_holds_box_of(again, full);
      EXPECT_TRUE(at::equal(again.local(), a.local()));

      DTensor cols = a.redistribute({s1});  // 3 columns over 4: 1,1,1,0
      expect_holds_box_of(cols, full);
      EXPECT_TRUE(at::equal(cols.redistribute({s0}).local(), a.local()));

      DTensor from_full = DTensor::distribute(full, mesh, {rep}).redistribute({s1});
      expect_holds_box_of(from_full, full);
      EXPECT_TRUE(at::equal(from_full.full_tensor(), full));
    });
  }
}

TEST(DTensor, RedistributeResultDoesNotShareStorage) {
  run_ranks(2, [](RankContext& ctx) {
    auto mesh = DeviceMesh::create(ctx.rendezvous, {2}, {"fsdp"});
    const at::Tensor full = sample({4, 2}, at::kFloat);
    DTensor a = DTensor::distribute(full, mesh, {Placement::shard(0)});
    DTensor same = a.redistribute({Placement::shard(0)});
    same.mutable_local().fill_(100);
    expect_holds_box_of(a, full);
  });
}

TEST(DTensor, ReplicateToShardNeedsNoOtherRank) {
  run_ranks(2, [](RankContext& ctx) {
    auto mesh = DeviceMesh::create(ctx.rendezvous, {2}, {"fsdp"});
    const at::Tensor full = sample({5, 4}, at::kDouble);
    if (ctx.rank == 0) {
      // Only rank 0 calls it: any collective here would stall and fail.
      DTensor t = DTensor::distribute(full, mesh, {Placement::replicate()})
                      .redistribute({Placement::shard(1)});
      expect_holds_box_of(t, full);
    }
    mesh->group(0).barrier();
  });
}

TEST(DTensor, HsdpPlacementsReplicateBoxesAcrossTheReplicateAxis) {
  run_ranks(4, [](RankContext& ctx) {
    auto mesh = DeviceMesh::create(ctx.rendezvous, {2, 2}, {"replicate", "shard"});
    const at::Tensor full = sample({5, 3}, at::kFloat);
    DTensor t = DTensor::distribute(full, mesh, {Placement::replicate(), Placement::shard(0)});
    expect_holds_box_of(t, full);
    const int64_t r = mesh->coordinate(0), s = mesh->coordinate(1);
    auto peer = DTensor::local_box({5, 3}, {2, 2}, {1 - r, s}, t.placements());
    EXPECT_EQ(peer.first, t.local_offsets());
    EXPECT_EQ(peer.second, t.local_sizes());
    EXPECT_EQ(t.local_sizes()[0], s == 0 ? 3 : 2);
    // The replicate-axis peer really holds the same values.
    at::Tensor both = at::empty({2, t.local().numel()}, at::kFloat);
    mesh->group(0).all_gather(both, t.local());
    EXPECT_TRUE(at::equal(both[0], both[1]));
    EXPECT_TRUE(t.is_replicated_somewhere());
    EXPECT_TRUE(at::equal(t.full_tensor(), full));
  });
}

TEST(DTensor, TwoAxesShardingOneDimNestAndRedistributeExactly) {
  run_ranks(4, [](RankContext& ctx) {
    auto mesh = DeviceMesh::create(ctx.rendezvous, {2, 2}, {"dp", "fsdp"});
    const at::Tensor full = sample({7, 3, 2}, at::kBFloat16);
    const auto s0 = Placement::shard(0), s1 = Placement::shard(1), rep = Placement::replicate();
    DTensor nested = DTensor::distribute(full, mesh, {s0, s0});
    expect_holds_box_of(nested, full);
    EXPECT_FALSE(nested.is_replicated_somewhere());
    EXPECT_TRUE(at::equal(nested.full_tensor(), full));
    for (std::vector<Placement> target : {std::vector<Placement>{rep, s0},
                                          std::vector<Placement>{s0, rep},
                                          std::vector<Placement>{s1, s0},
                                          std::vector<Placement>{s0, s1},
                                          std::vector<Placement>{s1, s1},
                                          std::vector<Placement>{rep, rep}}) {
      DTensor moved = nested.redistribute(target);
      expect_holds_box_of(moved, full);
      DTensor back = moved.redistribute({s0, s0});
      EXPECT_TRUE(at::equal(back.local(), nested.local())) << to_string(target);
      EXPECT_TRUE(at::equal(moved.full_tensor(), full)) << to_string(target);
    }
  });
}

TEST(DTensor, LocalBoxAgreesWithWhatDistributeGivesEveryRank) {
  run_ranks(4, [](RankContext& ctx) {
    auto mesh = DeviceMesh::create(ctx.rendezvous, {2, 2}, {"dp", "fsdp"});
    const at::Tensor full = sample({6, 5}, at::kDouble);
    const std::vector<Placement> placements{Placement::shard(1), Placement::shard(0)};
    DTensor t = DTensor::distribute(full, mesh, placements);
    auto box = DTensor::local_box({6, 5}, {2, 2}, DeviceMesh::coordinates_of(ctx.rank, {2, 2}),
                                  placements);
    EXPECT_EQ(box.first, t.local_offsets());
    EXPECT_EQ(box.second, t.local_sizes());
    EXPECT_TRUE(at::equal(t.local(), box_of(full, box)));
  });
}

TEST(DTensor, LocalTensorOfTheWrongShapeIsRejected) {
  run_ranks(2, [](RankContext& ctx) {
    auto mesh = DeviceMesh::create(ctx.rendezvous, {2}, {"fsdp"});
    try {
      DTensor t(at::zeros({3, 4}), {4, 4}, mesh, {Placement::shard(0)});
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("box of [2, 4]"), std::string::npos) << e.what();
    }
    EXPECT_THROW(DTensor(at::zeros({4, 4}), {4, 4}, mesh, {}), c10::Error);
  });
}

}  // namespace
}  // namespace framework::dtensor
