// Load-time resharding: reading a checkpoint saved under one sharding into
// another, checked by materializing the bytes each read plan copies.
#include <gtest/gtest.h>

#include <cstring>

#include "checkpoint/plan/resharding.h"

namespace checkpoint {
namespace {

// Saved item of int32 elements whose value is their global row-major index.
ItemMeta saved_item(std::vector<int64_t> shape, std::vector<Box> chunks) {
  ItemMeta item{"w", ItemKind::kTensor, DType::kInt32, std::move(shape), {}};
  for (Box& box : chunks) {
    ChunkMeta c;
    c.box = std::move(box);
    c.logical_bytes = static_cast<uint64_t>(c.box.numel()) * 4;
    item.chunks.push_back(std::move(c));
  }
  return item;
}

int32_t global_index(const std::vector<int64_t>& shape, const std::vector<int64_t>& at) {
  int64_t i = 0;
  for (size_t d = 0; d < shape.size(); ++d) i = i * shape[d] + at[d];
  return static_cast<int32_t>(i);
}

// Row-major values of `box` taken from the global-index tensor.
std::vector<int32_t> values_of(const std::vector<int64_t>& shape, const Box& box) {
  std::vector<int32_t> out;
  if (box.is_empty()) return out;
  std::vector<int64_t> at = box.offsets;
  while (true) {
    out.push_back(global_index(shape, at));
    size_t d = box.ndim();
    while (d > 0 && ++at[d - 1] == box.offsets[d - 1] + box.sizes[d - 1]) {
      at[d - 1] = box.offsets[d - 1];
      --d;
    }
    if (d == 0) break;
  }
  return out;
}

// Executes the read plan against synthetic chunk contents.
std::vector<int32_t> load(const ItemMeta& saved, const Box& wanted) {
  std::vector<int32_t> dst(static_cast<size_t>(wanted.numel()), -1);
  for (const ReadRequest& read : plan_reads(saved, wanted)) {
    const std::vector<int32_t> src = values_of(saved.global_shape, saved.chunks[read.chunk_index].box);
    for (const ByteRange& r : read.ranges) {
      EXPECT_LE(r.src_offset + r.length, src.size() * 4);
      EXPECT_LE(r.dst_offset + r.length, dst.size() * 4);
      std::memcpy(reinterpret_cast<char*>(dst.data()) + r.dst_offset,
                  reinterpret_cast<const char*>(src.data()) + r.src_offset, r.length);
    }
  }
  return dst;
}

// torch.chunk along `dim` into `parts` pieces (the last ones may be short or empty).
std::vector<Box> chunk_along(const std::vector<int64_t>& shape, size_t dim, int64_t parts) {
  const int64_t step = (shape[dim] + parts - 1) / parts;
  std::vector<Box> boxes;
  for (int64_t p = 0; p < parts; ++p) {
    Box box = full_box(shape);
    box.offsets[dim] = std::min(p * step, shape[dim]);
    box.sizes[dim] = std::min(step, shape[dim] - box.offsets[dim]);
    boxes.push_back(box);
  }
  return boxes;
}

void expect_loads_correctly(const ItemMeta& saved, const std::vector<Box>& wanted_boxes) {
  for (const Box& wanted : wanted_boxes) {
    EXPECT_EQ(load(saved, wanted), values_of(saved.global_shape, wanted)) << box_to_string(wanted);
  }
}

TEST(Resharding, SaveWithFourRanksLoadWithThree) {
  const std::vector<int64_t> shape = {12, 5};
  const ItemMeta saved = saved_item(shape, chunk_along(shape, 0, 4));
  const std::vector<Box> wanted = chunk_along(shape, 0, 3);
  expect_loads_correctly(saved, wanted);
  // New rank 1 holds rows 4..8: rows 4,5 from old rank 1 and 6,7 from old rank 2.
  const std::vector<ReadRequest> reads = plan_reads(saved, wanted[1]);
  ASSERT_EQ(reads.size(), 2u);
  EXPECT_EQ(reads[0].chunk_index, 1u);
  EXPECT_EQ(reads[0].overlap, (Box{{4, 0}, {2, 5}}));
  EXPECT_EQ(reads[0].ranges, (std::vector<ByteRange>{{1 * 5 * 4, 0, 2 * 5 * 4}}));
  EXPECT_EQ(reads[1].chunk_index, 2u);
  EXPECT_EQ(reads[1].ranges, (std::vector<ByteRange>{{0, 2 * 5 * 4, 2 * 5 * 4}}));
}

TEST(Resharding, UnevenTorchChunkShardsIncludingAnEmptyOne) {
  const std::vector<int64_t> shape = {6, 3};
  const std::vector<Box> saved_boxes = chunk_along(shape, 0, 4);  // 2, 2, 2, 0 rows
  ASSERT_EQ(saved_boxes[3].sizes[0], 0);
  const ItemMeta saved = saved_item(shape, saved_boxes);
  expect_loads_correctly(saved, chunk_along(shape, 0, 4));
  expect_loads_correctly(saved, chunk_along(shape, 0, 2));
  expect_loads_correctly(saved, chunk_along(shape, 0, 5));
  expect_loads_correctly(saved, {full_box(shape)});
  // The empty saved chunk is never read.
  for (const ReadRequest& read : plan_reads(saved, full_box(shape))) {
    EXPECT_NE(read.chunk_index, 3u);
  }
}

TEST(Resharding, Dim1ShardsLoadIntoDim0Shards) {
  const std::vector<int64_t> shape = {4, 8};
  const ItemMeta saved = saved_item(shape, chunk_along(shape, 1, 4));
  expect_loads_correctly(saved, chunk_along(shape, 0, 2));
  expect_loads_correctly(saved, chunk_along(shape, 1, 3));
  // Rows 0..2 from the chunk holding columns 2..4: one 8-byte range per row.
  const std::vector<ReadRequest> reads = plan_reads(saved, chunk_along(shape, 0, 2)[0]);
  ASSERT_EQ(reads.size(), 4u);
  EXPECT_EQ(reads[1].ranges, (std::vector<ByteRange>{{0, 2 * 4, 8}, {2 * 4, 10 * 4, 8}}));
}

TEST(Resharding, Dim0ShardsLoadIntoDim1Shards) {
  const std::vector<int64_t> shape = {6, 4};
  const ItemMeta saved = saved_item(shape, chunk_along(shape, 0, 3));
  expect_loads_correctly(saved, chunk_along(shape, 1, 2));
}

TEST(Resharding, ReplicatedCheckpointLoadsIntoShards) {
  const std::vector<int64_t> shape = {8, 4};
  const ItemMeta saved = saved_item(shape, {full_box(shape)});
  expect_loads_correctly(saved, chunk_along(shape, 0, 4));
  expect_loads_correctly(saved, chunk_along(shape, 1, 4));
  const std::vector<ReadRequest> reads = plan_reads(saved, Box{{2, 0}, {4, 4}});
  ASSERT_EQ(reads.size(), 1u);
  EXPECT_EQ(reads[0].ranges, (std::vector<ByteRange>{{2 * 4 * 4, 0, 4 * 4 * 4}}));
}

TEST(Resharding, FullRowOverlapOfDim0SplitIsOneRange) {
  const Box src{{0, 0}, {4, 8}}, dst{{2, 0}, {4, 8}}, overlap{{2, 0}, {2, 8}};
  EXPECT_EQ(overlap_byte_ranges(src, dst, overlap, 2),
            (std::vector<ByteRange>{{2 * 8 * 2, 0, 2 * 8 * 2}}));
}

TEST(Resharding, ThreeDimensionalGridReshardsIntoAnyBox) {
  const std::vector<int64_t> shape = {6, 5, 4};
  std::vector<Box> grid;
  for (const Box& a : chunk_along(shape, 1, 2)) {
    for (const Box& b : chunk_along(shape, 2, 3)) grid.push_back(*intersect(a, b));
  }
  const ItemMeta saved = saved_item(shape, grid);
  expect_loads_correctly(saved, chunk_along(shape, 0, 4));
  expect_loads_correctly(saved, {Box{{1, 1, 1}, {3, 3, 2}}, Box{{5, 4, 3}, {1, 1, 1}}});
}

TEST(Resharding, ScalarLoadsFromItsOneChunk) {
  const ItemMeta saved = saved_item({}, {Box{{}, {}}});
  const std::vector<ReadRequest> reads = plan_reads(saved, Box{{}, {}});
  ASSERT_EQ(reads.size(), 1u);
  EXPECT_EQ(reads[0].ranges, (std::vector<ByteRange>{{0, 0, 4}}));
}

TEST(Resharding, EmptyWantedBoxNeedsNoReads) {
  const std::vector<int64_t> shape = {6, 3};
  const ItemMeta saved = saved_item(shape, chunk_along(shape, 0, 3));
  EXPECT_TRUE(plan_reads(saved, Box{{6, 0}, {0, 3}}).empty());
  EXPECT_TRUE(plan_reads(saved_item({0, 3}, {}), Box{{0, 0}, {0, 3}}).empty());
}

TEST(Resharding, UncoveredWantedBoxIsRejectedNamingTheItem) {
  const std::vector<int64_t> shape = {6, 3};
  std::vector<Box> boxes = chunk_along(shape, 0, 3);
  boxes.pop_back();
  const ItemMeta saved = saved_item(shape, boxes);
  try {
    plan_reads(saved, full_box(shape));
    FAIL() << "expected FormatError";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("item 'w'"), std::string::npos) << e.what();
  }
}

TEST(Resharding, WantedBoxOutOfBoundsOrWrongRankIsRejected) {
  const std::vector<int64_t> shape = {6, 3};
  const ItemMeta saved = saved_item(shape, chunk_along(shape, 0, 3));
  EXPECT_THROW(plan_reads(saved, Box{{4, 0}, {3, 3}}), FormatError);
  EXPECT_THROW(plan_reads(saved, Box{{0}, {3}}), FormatError);
}

}  // namespace
}  // namespace checkpoint
