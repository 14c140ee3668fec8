// The metadata index: round trips, and rejection of every kind of damaged or
// hostile input with an error that names the file, item and chunk.
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <utility>

#include "checkpoint/errors.h"
#include "checkpoint/format/checksum.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/storage/memory.h"
#include "checkpoint/storage/storage.h"

#include <xxhash.h>

namespace checkpoint {
namespace {

constexpr const char* kSource = "/ckpt/step_7/.metadata";

ChunkMeta plain_chunk(Box box, uint64_t element_size, const std::string& file, uint64_t offset,
                      int32_t rank) {
  ChunkMeta c;
  c.box = std::move(box);
  c.file = file;
  c.offset = offset;
  c.logical_bytes = static_cast<uint64_t>(c.box.numel()) * element_size;
  c.length = c.logical_bytes;
  c.checksum = 0x1234567890abcdefULL + offset;
  c.writer_rank = rank;
  // Untransformed chunks are one block storing the logical bytes as they are.
  if (c.logical_bytes > 0) c.blocks = {{0, c.logical_bytes, c.logical_bytes, c.checksum ^ 1}};
  return c;
}

CheckpointMeta rich_meta() {
  CheckpointMeta meta;
  meta.step = 7;
  meta.world_size = 4;
  meta.layout = "fsdp replicate=1 shard=4";
  meta.created_unix_s = 1700000000;
  meta.info = {{"torch", "2.3.0"}, {"git", "abc123"}, {"empty", ""}};

  ItemMeta w{"model.layers.0.weight", ItemKind::kTensor, DType::kFloat32, {8, 4}, {}};
  for (int r = 0; r < 4; ++r) {
    w.chunks.push_back(plain_chunk(Box{{2 * r, 0}, {2, 4}}, 4, "rank_" + std::to_string(r) + ".data",
                                   0, r));
  }
  // A compressed chunk with two blocks.
  w.chunks[1].transforms = {"bytegroup/1", "zstd/1"};
  w.chunks[1].length = 20;
  w.chunks[1].blocks = {{0, 12, 16, 0x1111}, {12, 8, 16, 0x2222}};
  meta.items.push_back(w);

  ItemMeta b{"model.layers.0.bias", ItemKind::kTensor, DType::kBFloat16, {5}, {}};
  b.chunks.push_back(plain_chunk(Box{{0}, {5}}, 2, "rank_0.data", 32, 0));
  meta.items.push_back(b);

  ItemMeta scalar{"optim.lr", ItemKind::kTensor, DType::kFloat64, {}, {}};
  scalar.chunks.push_back(plain_chunk(Box{{}, {}}, 8, "rank_1.data", 32, 1));
  meta.items.push_back(scalar);

  ItemMeta rng{"rng.cpu", ItemKind::kBytes, DType::kUInt8, {16}, {}};
  rng.chunks.push_back(plain_chunk(Box{{0}, {16}}, 1, "rank_2.data", 32, 2));
  meta.items.push_back(rng);

  ItemMeta empty{"model.empty", ItemKind::kTensor, DType::kInt64, {0, 3}, {}};
  meta.items.push_back(empty);
  return meta;
}

CheckpointMeta decode(const std::vector<uint8_t>& blob) {
  return decode_metadata(blob.data(), blob.size(), kSource);
}

// Recomputes the trailer after a deliberate edit, so only the edit is wrong.
void reseal(std::vector<uint8_t>& blob) {
  const uint64_t sum = xxh3_64(blob.data(), blob.size() - 8);
  for (int i = 0; i < 8; ++i) blob[blob.size() - 8 + i] = static_cast<uint8_t>(sum >> (8 * i));
}

// Header + `body` + a valid trailer.
std::vector<uint8_t> blob_with_body(const std::vector<uint8_t>& body) {
  std::vector<uint8_t> blob = {'S', 'H', 'K', 'C', 'K', 'P', 'T', 0, 1, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < 8; ++i) blob.push_back(static_cast<uint8_t>(uint64_t{body.size()} >> (8 * i)));
  blob.insert(blob.end(), body.begin(), body.end());
  blob.resize(blob.size() + 8);
  reseal(blob);
  return blob;
}

void put_varint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}

std::string error_of(const CheckpointMeta& meta) {
  try {
    validate_metadata(meta, kSource);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

std::string decode_error(const std::vector<uint8_t>& blob) {
  try {
    decode(blob);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

TEST(Metadata, RoundTripPreservesEveryField) {
  const CheckpointMeta meta = rich_meta();
  const CheckpointMeta back = decode(encode_metadata(meta));
  EXPECT_EQ(back, meta);
  ASSERT_NE(back.find("rng.cpu"), nullptr);
  EXPECT_EQ(back.find("rng.cpu")->kind, ItemKind::kBytes);
  ASSERT_EQ(back.find("model.layers.0.weight")->chunks[1].blocks.size(), 2u);
  EXPECT_EQ(back.find("model.layers.0.weight")->chunks[1].blocks[1].checksum, 0x2222u);
  EXPECT_EQ(back.find("missing"), nullptr);
}

// The save coordinator's streaming writer gives encode_metadata's bytes, and
// refuses what encode_metadata refuses, naming the item.
TEST(Metadata, StreamingWriterMatchesEncodeMetadata) {
  const CheckpointMeta meta = rich_meta();
  MetadataWriter writer(meta);
  for (const ItemMeta& item : meta.items) writer.add_item(item);
  EXPECT_EQ(writer.finish(), encode_metadata(meta));

  MetadataWriter twice(meta);
  twice.add_item(meta.items[0]);
  try {
    twice.add_item(meta.items[0]);
    FAIL() << "a repeated item name was accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("item '" + meta.items[0].name + "': duplicate item name"),
              std::string::npos) << e.what();
  }
  ItemMeta gap = meta.items[0];
  ASSERT_FALSE(gap.chunks.empty());
  gap.chunks.pop_back();
  if (gap.kind == ItemKind::kTensor) {
    MetadataWriter w(meta);
    try {
      w.add_item(gap);
      FAIL() << "an item with a gap was accepted";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("item '" + gap.name + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(Metadata, EncodingIsDeterministic) {
  EXPECT_EQ(encode_metadata(rich_meta()), encode_metadata(rich_meta()));
}

// The committed metadata reads back through each Storage the same.
TEST(Metadata, CommittedMetadataRoundTripsOnPosixAndInMemory) {
  const std::string posix_dir = ::testing::TempDir() + "/test_metadata_roundtrip";
  for (auto [storage, dir] : {std::pair{posix_storage(), posix_dir},
                              std::pair{memory_storage(), std::string("/ck/step_3")}}) {
    storage->remove_all(dir);
    storage->make_dirs(dir);
    storage->write_file_atomic(join_path(dir, kMetadataFileName), encode_metadata(rich_meta()));
    EXPECT_EQ(read_committed_metadata(*storage, dir), rich_meta());
    storage->remove_all(dir);
  }
}

std::string metadata_error(Storage& storage, const std::string& dir) {
  try {
    read_committed_metadata(storage, dir);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "no error";
}

TEST(Metadata, ReadingWhatIsNotACommittedCheckpointNamesTheDirectoryAndWhy) {
  auto storage = memory_storage();
  storage->make_dirs("/ck/step_1");
  storage->write_file_atomic("/ck/file", {1, 2, 3});
  EXPECT_EQ(metadata_error(*storage, "/ck/nope"), "no such checkpoint directory: /ck/nope");
  EXPECT_EQ(metadata_error(*storage, "/ck/file"), "not a directory: /ck/file");
  EXPECT_EQ(metadata_error(*storage, "/ck/step_1"),
            "not a committed checkpoint (no .metadata): /ck/step_1");
  storage->make_dirs("/ck/step_1/.metadata");
  EXPECT_EQ(metadata_error(*storage, "/ck/step_1"), "/ck/step_1/.metadata: not a regular file");
}

TEST(Metadata, EveryTruncationIsRejected) {
  for (uint32_t version : {1u, 2u}) {
    const std::vector<uint8_t> blob = encode_metadata(rich_meta(), version);
    for (size_t len = 0; len < blob.size(); ++len) {
      std::vector<uint8_t> prefix(blob.begin(), blob.begin() + static_cast<ptrdiff_t>(len));
      EXPECT_THROW(decode(prefix), FormatError) << "v" << version << " length " << len;
    }
  }
}

TEST(Metadata, EverySingleByteFlipIsRejected) {
  for (uint32_t version : {1u, 2u}) {
    const std::vector<uint8_t> blob = encode_metadata(rich_meta(), version);
    for (size_t i = 0; i < blob.size(); ++i) {
      for (uint8_t mask : {0x01, 0x80}) {
        std::vector<uint8_t> bad = blob;
        bad[i] ^= mask;
        EXPECT_THROW(decode(bad), FormatError)
            << "v" << version << " byte " << i << " mask " << int(mask);
      }
    }
  }
}

TEST(Metadata, ChecksumMismatchIsReported) {
  for (uint32_t version : {1u, 2u}) {
    std::vector<uint8_t> blob = encode_metadata(rich_meta(), version);
    blob[40] ^= 0x10;
    EXPECT_NE(decode_error(blob).find("checksum mismatch"), std::string::npos) << decode_error(blob);
    EXPECT_NE(decode_error(blob).find(kSource), std::string::npos);
  }
}

TEST(Metadata, WrongMagicIsRejected) {
  std::vector<uint8_t> blob = encode_metadata(rich_meta());
  blob[0] = 'X';
  reseal(blob);
  EXPECT_NE(decode_error(blob).find("bad magic"), std::string::npos);
}

TEST(Metadata, NewerVersionIsRefusedWithAClearMessage) {
  for (uint32_t version : {1u, 2u}) {
    std::vector<uint8_t> blob = encode_metadata(rich_meta(), version);
    blob[8] = 7;
    reseal(blob);
    EXPECT_EQ(decode_error(blob), std::string("unsupported format version 7 in ") + kSource +
                                      "; this build reads versions 1 and 2");
  }
  EXPECT_THROW(encode_metadata(rich_meta(), 3), FormatError);
  EXPECT_THROW(encode_metadata(rich_meta(), 0), FormatError);
}

TEST(Metadata, UnknownFlagsAreRejected) {
  std::vector<uint8_t> blob = encode_metadata(rich_meta(), 1);
  blob[12] = 1;
  reseal(blob);
  EXPECT_NE(decode_error(blob).find("flags"), std::string::npos);
}

TEST(Metadata, TrailingGarbageIsRejected) {
  std::vector<uint8_t> blob = encode_metadata(rich_meta(), 1);
  blob.push_back(0);
  EXPECT_THROW(decode(blob), FormatError);

  // Garbage inside the body, with a consistent header and checksum.
  std::vector<uint8_t> body(blob.begin() + 24, blob.end() - 9);
  body.push_back(0);
  EXPECT_NE(decode_error(blob_with_body(body)).find("trailing bytes"), std::string::npos);
}

TEST(Metadata, CraftedBodyWithoutTamperingDecodes) {
  // Guards the crafting helpers used by the hostile-count tests below.
  const std::vector<uint8_t> blob = encode_metadata(rich_meta(), 1);
  std::vector<uint8_t> body(blob.begin() + 24, blob.end() - 8);
  CheckpointMeta v1 = rich_meta();
  v1.format_version = 1;
  EXPECT_EQ(decode(blob_with_body(body)), v1);
}

TEST(Metadata, AbsurdItemCountIsRejectedWithoutAllocating) {
  // Honouring the count would mean ~2^40 ItemMeta objects (about 100 TiB):
  // bad_alloc or a hang. A FormatError proves the count was checked against
  // the remaining bytes first.
  std::vector<uint8_t> body = {0, 2, 0, 0, 0};  // step 0, world 1, layout "", time 0, no info
  put_varint(body, uint64_t{1} << 40);          // items
  body.resize(body.size() + 64, 0);
  const std::string error = decode_error(blob_with_body(body));
  EXPECT_NE(error.find("item count"), std::string::npos) << error;
  EXPECT_NE(error.find(kSource), std::string::npos) << error;
}

TEST(Metadata, AbsurdChunkCountIsRejectedNamingTheItem) {
  std::vector<uint8_t> body = {0, 2, 0, 0, 0, 1};  // ... one item
  body.push_back(1);
  body.push_back('w');  // name "w"
  body.push_back(1);    // tensor
  body.push_back(1);    // float32
  body.push_back(1);    // ndim 1
  body.push_back(8);    // dim 4 (zigzag)
  put_varint(body, uint64_t{1} << 40);  // chunks
  body.resize(body.size() + 100, 0);
  const std::string error = decode_error(blob_with_body(body));
  EXPECT_NE(error.find("item 'w'"), std::string::npos) << error;
  EXPECT_NE(error.find("chunk count"), std::string::npos) << error;
}

TEST(Metadata, TooManyDimsAreRejected) {
  std::vector<uint8_t> body = {0, 2, 0, 0, 0, 1, 1, 'w', 1, 1, 17};
  body.resize(body.size() + 100, 0);
  EXPECT_NE(decode_error(blob_with_body(body)).find("rank"), std::string::npos);
}

TEST(Metadata, PathEscapesAreRejectedNamingTheItemAndChunk) {
  for (const char* bad : {"../x", "/etc/passwd", "a/b", "..", ".", ".hidden", "a\\b", "", "a\nb"}) {
    CheckpointMeta meta = rich_meta();
    meta.items[0].chunks[2].file = bad;
    const std::string error = error_of(meta);
    EXPECT_NE(error.find("item 'model.layers.0.weight': chunk 2"), std::string::npos)
        << bad << ": " << error;
    EXPECT_NE(error.find(kSource), std::string::npos) << error;
    EXPECT_THROW(encode_metadata(meta), FormatError) << bad;
  }
}

TEST(Metadata, PathEscapeInStoredBytesIsRejected) {
  // "rank_0.data" and "/etc/passwd" have the same length: patch one into the
  // encoded bytes and fix up the checksum.
  std::vector<uint8_t> blob = encode_metadata(rich_meta(), 1);
  const std::string from = "rank_0.data", to = "/etc/passwd";
  auto it = std::search(blob.begin(), blob.end(), from.begin(), from.end());
  ASSERT_NE(it, blob.end());
  std::copy(to.begin(), to.end(), it);
  reseal(blob);
  const std::string error = decode_error(blob);
  EXPECT_NE(error.find("item 'model.layers.0.weight': chunk 0"), std::string::npos) << error;
  EXPECT_NE(error.find("/etc/passwd"), std::string::npos) << error;
}

TEST(Metadata, SafeFileNamesAreFlatAndVisible) {
  EXPECT_TRUE(is_safe_file_name("rank_0.data"));
  EXPECT_TRUE(is_safe_file_name("rank_12.1.data"));
  EXPECT_FALSE(is_safe_file_name(".metadata"));
  EXPECT_FALSE(is_safe_file_name("dir/rank_0.data"));
  EXPECT_FALSE(is_safe_file_name(std::string(300, 'a')));
}

TEST(Metadata, LogicalBytesMismatchIsRejected) {
  CheckpointMeta meta = rich_meta();
  meta.items[1].chunks[0].logical_bytes = 12;
  meta.items[1].chunks[0].length = 12;
  const std::string error = error_of(meta);
  EXPECT_NE(error.find("item 'model.layers.0.bias': chunk 0: logical_bytes 12 != 10"),
            std::string::npos)
      << error;
}

TEST(Metadata, UntransformedChunkMustStoreItsLogicalBytes) {
  CheckpointMeta meta = rich_meta();
  meta.items[0].chunks[0].length = 31;
  EXPECT_NE(error_of(meta).find("chunk 0: untransformed"), std::string::npos) << error_of(meta);
}

TEST(Metadata, ChunksThatDoNotTileAreRejected) {
  CheckpointMeta gap = rich_meta();
  gap.items[0].chunks.pop_back();
  EXPECT_NE(error_of(gap).find("item 'model.layers.0.weight'"), std::string::npos);
  EXPECT_NE(error_of(gap).find("gap"), std::string::npos) << error_of(gap);

  CheckpointMeta overlap = rich_meta();
  overlap.items[0].chunks[3].box = Box{{5, 0}, {2, 4}};  // overlaps chunk 2 ([4:6])
  EXPECT_NE(error_of(overlap).find("overlap"), std::string::npos) << error_of(overlap);

  CheckpointMeta out_of_bounds = rich_meta();
  out_of_bounds.items[0].chunks[3].box = Box{{7, 0}, {2, 4}};
  EXPECT_NE(error_of(out_of_bounds).find("chunk 3: box [7:9, 0:4] is out of bounds"),
            std::string::npos)
      << error_of(out_of_bounds);

  CheckpointMeta wrong_rank = rich_meta();
  wrong_rank.items[0].chunks[0].box = Box{{0}, {2}};
  EXPECT_NE(error_of(wrong_rank).find("chunk 0: box has rank 1"), std::string::npos);
}

TEST(Metadata, BlocksMustAddUpAndStayInsideTheChunk) {
  CheckpointMeta short_blocks = rich_meta();
  short_blocks.items[0].chunks[1].blocks[1].logical_length = 8;
  EXPECT_NE(error_of(short_blocks).find("chunk 1: block logical lengths add up to 24"),
            std::string::npos)
      << error_of(short_blocks);

  CheckpointMeta outside = rich_meta();
  outside.items[0].chunks[1].blocks[1].stored_length = 9;
  EXPECT_NE(error_of(outside).find("chunk 1: block 1 stored range"), std::string::npos)
      << error_of(outside);
}

TEST(Metadata, NonEmptyChunksMustHaveBlocks) {
  CheckpointMeta meta = rich_meta();
  meta.items[1].chunks[0].blocks.clear();
  EXPECT_NE(error_of(meta).find("item 'model.layers.0.bias': chunk 0: a non-empty chunk has no blocks"),
            std::string::npos)
      << error_of(meta);
}

TEST(Metadata, BlockStoredRangesMustBeInOrderAndDisjoint) {
  CheckpointMeta overlapping = rich_meta();
  overlapping.items[0].chunks[1].blocks[1].stored_offset = 8;
  EXPECT_NE(error_of(overlapping).find("chunk 1: block 1 stored range starts at 8, before the "
                                       "previous block ends at 12"),
            std::string::npos)
      << error_of(overlapping);
  CheckpointMeta swapped = rich_meta();
  std::swap(swapped.items[0].chunks[1].blocks[0].stored_offset,
            swapped.items[0].chunks[1].blocks[1].stored_offset);
  EXPECT_NE(error_of(swapped).find("chunk 1: block"), std::string::npos) << error_of(swapped);
}

TEST(Metadata, EmptyAndOversizedBlocksAreRejected) {
  CheckpointMeta empty = rich_meta();
  empty.items[0].chunks[1].blocks.push_back({20, 0, 0, 0});
  EXPECT_NE(error_of(empty).find("chunk 1: block 2 is empty"), std::string::npos)
      << error_of(empty);
  CheckpointMeta huge = rich_meta();
  huge.items[4].global_shape = {int64_t{1} << 28, 3};
  huge.items[4].chunks.push_back(
      plain_chunk(Box{{0, 0}, {int64_t{1} << 28, 3}}, 8, "rank_0.data", 64, 0));
  EXPECT_NE(error_of(huge).find("block 0 is larger than the 1 GiB block limit"), std::string::npos)
      << error_of(huge);
}

TEST(Metadata, UntransformedBlocksStoreTheirLogicalBytes) {
  CheckpointMeta meta = rich_meta();
  ChunkMeta& chunk = meta.items[0].chunks[0];  // 32 logical bytes, untransformed
  chunk.blocks = {{0, 16, 16, 1}, {16, 12, 16, 2}};
  EXPECT_NE(error_of(meta).find("chunk 0: block 1 of an untransformed chunk stores 12 bytes for 16"),
            std::string::npos)
      << error_of(meta);
  chunk.blocks = {{0, 16, 16, 1}, {16, 16, 16, 2}};
  EXPECT_EQ(error_of(meta), "");
}

TEST(Metadata, TruncatedBlockListIsRejectedBeforeAllocating) {
  // A body whose only chunk ends in the middle of its block checksum: the
  // block count no longer fits the bytes that remain.
  CheckpointMeta meta;
  ItemMeta item{"x", ItemKind::kTensor, DType::kUInt8, {4}, {}};
  item.chunks.push_back(plain_chunk(Box{{0}, {4}}, 1, "rank_0.data", 0, 0));
  meta.items.push_back(item);
  std::vector<uint8_t> blob = encode_metadata(meta, 1);
  std::vector<uint8_t> body(blob.begin() + 24, blob.end() - 8);
  body.resize(body.size() - 3);
  EXPECT_NE(decode_error(blob_with_body(body)).find("item 'x': chunk 0: bad block count"),
            std::string::npos)
      << decode_error(blob_with_body(body));
}

TEST(Metadata, OffsetPlusLengthOverflowIsRejected) {
  CheckpointMeta meta = rich_meta();
  meta.items[0].chunks[1].offset = ~uint64_t{0} - 4;
  EXPECT_NE(error_of(meta).find("overflows"), std::string::npos);
}

TEST(Metadata, ItemNamesMustBeUniqueAndNonEmpty) {
  CheckpointMeta dup = rich_meta();
  dup.items[1].name = dup.items[0].name;
  EXPECT_NE(error_of(dup).find("duplicate item name"), std::string::npos);
  CheckpointMeta empty = rich_meta();
  empty.items[1].name = "";
  EXPECT_NE(error_of(empty).find("empty item name"), std::string::npos);
}

TEST(Metadata, BytesItemsAreOneWholeUint8Chunk) {
  CheckpointMeta two = rich_meta();
  two.items[3].chunks[0] = plain_chunk(Box{{0}, {8}}, 1, "rank_2.data", 32, 2);
  two.items[3].chunks.push_back(plain_chunk(Box{{8}, {8}}, 1, "rank_2.data", 40, 2));
  EXPECT_NE(error_of(two).find("item 'rng.cpu': a bytes item has exactly one chunk"),
            std::string::npos)
      << error_of(two);
  CheckpointMeta typed = rich_meta();
  typed.items[3].dtype = DType::kInt32;
  EXPECT_NE(error_of(typed).find("1-D uint8"), std::string::npos);
}

TEST(Metadata, ShapesBeyondOnePebibyteAreRejected) {
  CheckpointMeta meta = rich_meta();
  meta.items[4].global_shape = {int64_t{1} << 40, 0, 1 << 20};
  EXPECT_EQ(error_of(meta), "");  // zero elements
  meta.items[4].global_shape = {int64_t{1} << 40, 1 << 20};
  EXPECT_NE(error_of(meta).find("exceeds 1 PiB"), std::string::npos);
  meta.items[4].global_shape = {-1, 3};
  EXPECT_NE(error_of(meta).find("negative"), std::string::npos);
}

TEST(Metadata, WriterRankMustBeInsideTheWorld) {
  CheckpointMeta meta = rich_meta();
  meta.items[0].chunks[0].writer_rank = 4;
  EXPECT_NE(error_of(meta).find("chunk 0: writer rank 4"), std::string::npos);
}

// ---- version 2 ------------------------------------------------------------------

// A tensor item of `shape` split along `dim` at `cuts` (the boundaries, from 0
// to shape[dim]), one chunk per piece, in the order given.
ItemMeta split_item(const std::string& name, std::vector<int64_t> shape, size_t dim,
                    const std::vector<int64_t>& cuts) {
  ItemMeta item{name, ItemKind::kTensor, DType::kFloat32, shape, {}};
  uint64_t offset = 0;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    Box box = full_box(shape);
    box.offsets[dim] = cuts[i];
    box.sizes[dim] = cuts[i + 1] - cuts[i];
    item.chunks.push_back(plain_chunk(box, 4, "rank_" + std::to_string(i % 4) + ".data", offset,
                                      static_cast<int32_t>(i % 4)));
    offset += item.chunks.back().length;
  }
  return item;
}

std::vector<int64_t> even_cuts(int64_t size, int64_t step) {
  std::vector<int64_t> cuts;
  for (int64_t c = 0; c < size; c += step) cuts.push_back(c);
  cuts.push_back(size);
  return cuts;
}

// Every kind of item version 2 distinguishes.
CheckpointMeta varied_meta() {
  CheckpointMeta meta = rich_meta();  // rows, a compressed chunk, scalar, bytes, empty tensor
  meta.items.push_back(split_item("cols", {3, 10}, 1, {0, 4, 8, 10}));
  meta.items.push_back(split_item("irregular", {9, 2}, 0, {0, 1, 3, 3, 6, 9}));  // an empty chunk
  ItemMeta grid{"grid", ItemKind::kTensor, DType::kFloat32, {4, 6}, {}};
  for (int64_t r : {0, 2}) {
    for (int64_t c : {0, 3}) {
      grid.chunks.push_back(plain_chunk(Box{{r, c}, {2, 3}}, 4, "rank_3.data", 100, 3));
    }
  }
  meta.items.push_back(grid);
  meta.items.push_back(split_item("one", {5, 5}, 0, {0, 5}));
  return meta;
}

// `meta` with each item's chunks in the order version 2 stores them.
CheckpointMeta in_stored_order(CheckpointMeta meta) {
  for (ItemMeta& item : meta.items) {
    std::vector<Box> boxes;
    for (const ChunkMeta& c : item.chunks) boxes.push_back(c.box);
    const ChunkSplit split = classify_chunk_split(item.global_shape, boxes);
    if (split.dim < 0) continue;
    const size_t d = static_cast<size_t>(split.dim);
    std::stable_sort(item.chunks.begin(), item.chunks.end(),
                     [d](const ChunkMeta& a, const ChunkMeta& b) {
                       return std::make_pair(a.box.offsets[d], a.box.sizes[d]) <
                              std::make_pair(b.box.offsets[d], b.box.sizes[d]);
                     });
  }
  return meta;
}

// Recomputes both checksums of a version-2 file after a deliberate edit.
void reseal_v2(std::vector<uint8_t>& blob) {
  uint64_t head_length = 0;
  for (int i = 0; i < 8; ++i) head_length |= uint64_t{blob[16 + i]} << (8 * i);
  const size_t head_end = 32 + static_cast<size_t>(head_length);
  const uint64_t head_sum = xxh3_64(blob.data(), head_end);
  for (int i = 0; i < 8; ++i) blob[head_end + i] = static_cast<uint8_t>(head_sum >> (8 * i));
  reseal(blob);
}

TEST(MetadataV2, RoundTripPreservesEveryItemInStoredOrder) {
  const CheckpointMeta meta = varied_meta();
  EXPECT_EQ(decode(encode_metadata(meta)), in_stored_order(meta));
  EXPECT_EQ(decode(encode_metadata(meta)).format_version, 2u);
  // Chunks given out of order come back sorted along the split dim.
  CheckpointMeta reversed = meta;
  for (ItemMeta& item : reversed.items) std::reverse(item.chunks.begin(), item.chunks.end());
  const CheckpointMeta back = decode(encode_metadata(reversed));
  EXPECT_EQ(back, in_stored_order(reversed));
  EXPECT_EQ(back.find("model.layers.0.weight")->chunks, meta.find("model.layers.0.weight")->chunks);
  EXPECT_EQ(back.find("irregular")->chunks[2].box, (Box{{3, 0}, {0, 2}}));  // empty before [3:6]
  // The grid has no split dim: its order is the writer's.
  EXPECT_EQ(back.find("grid")->chunks, reversed.find("grid")->chunks);
  EXPECT_EQ(encode_metadata(meta), encode_metadata(meta));
}

TEST(MetadataV2, VersionOneFilesStillDecodeInTheirOrder) {
  CheckpointMeta reversed = varied_meta();
  for (ItemMeta& item : reversed.items) std::reverse(item.chunks.begin(), item.chunks.end());
  const CheckpointMeta back = decode(encode_metadata(reversed, 1));
  EXPECT_EQ(back.format_version, 1u);
  CheckpointMeta expected = reversed;
  expected.format_version = 1;
  EXPECT_EQ(back, expected);
}

TEST(MetadataV2, SplitDimAndStrideFollowTheChunkBoxes) {
  auto split_of = [](const ItemMeta& item) {
    std::vector<Box> boxes;
    for (const ChunkMeta& c : item.chunks) boxes.push_back(c.box);
    return classify_chunk_split(item.global_shape, boxes);
  };
  EXPECT_EQ(split_of(split_item("a", {8, 4}, 0, {0, 2, 4, 6, 8})), (ChunkSplit{0, 2}));
  EXPECT_EQ(split_of(split_item("a", {8, 4}, 0, {0, 3, 6, 8})), (ChunkSplit{0, 3}));  // short last
  EXPECT_EQ(split_of(split_item("a", {9, 4}, 0, {0, 3, 6, 9})), (ChunkSplit{0, 3}));
  EXPECT_EQ(split_of(split_item("a", {8, 4}, 0, {0, 2, 5, 8})), (ChunkSplit{0, 0}));  // uneven
  EXPECT_EQ(split_of(split_item("a", {8, 4}, 0, {0, 3, 6, 7, 8})), (ChunkSplit{0, 0}));
  EXPECT_EQ(split_of(split_item("a", {10}, 0, {0, 3, 6, 10})), (ChunkSplit{0, 0}));  // long last
  EXPECT_EQ(split_of(split_item("a", {8, 4}, 0, {0, 4, 4, 8})), (ChunkSplit{0, 0}));  // empty chunk
  EXPECT_EQ(split_of(split_item("a", {4, 8}, 1, {0, 4, 8})), (ChunkSplit{1, 4}));
  EXPECT_EQ(split_of(split_item("a", {1, 8}, 1, {0, 4, 8})), (ChunkSplit{1, 4}));
  EXPECT_EQ(split_of(split_item("a", {2, 1, 8}, 2, {0, 4, 8})), (ChunkSplit{2, 4}));
  EXPECT_EQ(split_of(split_item("a", {0, 3}, 1, {0, 3, 3})), (ChunkSplit{1, 0}));
  // Both dims qualify when every chunk spans the whole (empty) shape: the lowest.
  ItemMeta spans_all{"e", ItemKind::kTensor, DType::kFloat32, {0, 3}, {}};
  spans_all.chunks.push_back(plain_chunk(Box{{0, 0}, {0, 3}}, 4, "rank_0.data", 0, 0));
  spans_all.chunks.push_back(spans_all.chunks[0]);
  EXPECT_EQ(split_of(spans_all), (ChunkSplit{0, 0}));
  EXPECT_EQ(split_of(split_item("a", {8, 4}, 0, {0, 8})), (ChunkSplit{}));  // one chunk
  EXPECT_EQ(split_of(ItemMeta{"e", ItemKind::kTensor, DType::kFloat32, {0, 3}, {}}), (ChunkSplit{}));
  EXPECT_EQ(split_of(varied_meta().items.at(7)), (ChunkSplit{}));  // the 2x2 grid
  ASSERT_EQ(varied_meta().items.at(7).name, "grid");
}

class CountingStorage : public StorageWrapper {
 public:
  using StorageWrapper::StorageWrapper;
  void read_at(const std::string& path, uint64_t offset, void* dst, size_t n) override {
    bytes_ += n;
    ++reads_;
    StorageWrapper::read_at(path, offset, dst, n);
  }
  uint64_t bytes_ = 0;
  uint64_t reads_ = 0;
};

constexpr const char* kStepDir = "/ck/step_5";

std::shared_ptr<CountingStorage> storage_with(const std::vector<uint8_t>& file) {
  auto storage = std::make_shared<CountingStorage>(memory_storage());
  storage->make_dirs(kStepDir);
  storage->write_file_atomic(join_path(kStepDir, kMetadataFileName), file);
  return storage;
}

// What a partial read must return: the full decode's chunks overlapping a box.
std::vector<ChunkMeta> overlapping(const ItemMeta& item, const std::vector<Box>& boxes) {
  std::vector<ChunkMeta> out;
  for (const ChunkMeta& c : item.chunks) {
    for (const Box& b : boxes) {
      if (intersect(c.box, b)) {
        out.push_back(c);
        break;
      }
    }
  }
  return out;
}

CheckpointMeta strided_meta(int64_t chunks) {
  CheckpointMeta meta;
  meta.world_size = 4;
  meta.items.push_back(split_item("w", {4 * chunks, 16}, 0, even_cuts(4 * chunks, 4)));
  meta.items.push_back(split_item("b", {16}, 0, {0, 16}));
  return meta;
}

TEST(MetadataReader, OneRankOfAThousandStrideChunksReadsOnlyItsRecords) {
  const CheckpointMeta meta = strided_meta(1024);
  const std::vector<uint8_t> file = encode_metadata(meta);
  auto storage = storage_with(file);
  MetadataReader reader(*storage, kStepDir);
  const uint64_t head = reader.bytes_read();
  EXPECT_EQ(reader.head().items.size(), 2u);
  EXPECT_TRUE(reader.head().items[0].chunks.empty());
  EXPECT_EQ(reader.chunk_count(0), 1024u);
  const std::vector<Box> mine = {Box{{4 * 500, 0}, {4, 16}}};
  EXPECT_EQ(reader.chunks_overlapping(0, mine), overlapping(meta.items[0], mine));
  ASSERT_EQ(reader.chunks_overlapping(0, mine).size(), 1u);
  // About one record: 2 directory entries and a record of ~30 bytes.
  const uint64_t record = 64;
  EXPECT_LE(reader.bytes_read() - head, 2 * (2 * 24 + record));  // both calls above
  EXPECT_LT(head, 200u);
  EXPECT_GT(file.size(), 1024 * (24 + 20));
  EXPECT_EQ(storage->bytes_, reader.bytes_read());

  // Straddling three chunks, several boxes, boxes past the shape, empty boxes.
  const std::vector<std::vector<Box>> asks = {
      {Box{{6, 3}, {5, 2}}},
      {Box{{0, 0}, {1, 16}}, Box{{4095, 0}, {1, 16}}, Box{{10, 0}, {3, 1}}},
      {Box{{4094, 0}, {100, 16}}},
      {Box{{0, 0}, {0, 16}}},
      {full_box(meta.items[0].global_shape)}};
  for (const auto& boxes : asks) {
    EXPECT_EQ(reader.chunks_overlapping(0, boxes), overlapping(meta.items[0], boxes));
  }
  EXPECT_EQ(reader.chunks_overlapping(1, {Box{{3}, {2}}}), meta.items[1].chunks);
  EXPECT_THROW(reader.chunks_overlapping(0, {Box{{0}, {1}}}), std::invalid_argument);
}

TEST(MetadataReader, IrregularSplitsAndGridsReturnWhatAFullDecodeWould) {
  CheckpointMeta meta;
  meta.world_size = 4;
  for (int64_t n : {7, 400}) {  // a small directory read whole, a large one searched
    std::vector<int64_t> cuts = {0};
    for (int64_t i = 0; i < n; ++i) cuts.push_back(cuts.back() + (i % 5 == 3 ? 0 : 1 + i % 3));
    meta.items.push_back(split_item("irregular" + std::to_string(n), {cuts.back(), 3}, 0, cuts));
  }
  ItemMeta grid{"grid", ItemKind::kTensor, DType::kFloat32, {6, 6}, {}};
  for (int64_t r = 0; r < 6; r += 2) {
    for (int64_t c = 0; c < 6; c += 3) {
      grid.chunks.push_back(plain_chunk(Box{{r, c}, {2, 3}}, 4, "rank_1.data", 0, 1));
    }
  }
  meta.items.push_back(grid);
  const CheckpointMeta expected = decode(encode_metadata(meta));
  auto storage = storage_with(encode_metadata(meta));
  MetadataReader reader(*storage, kStepDir);
  for (size_t i = 0; i < expected.items.size(); ++i) {
    const int64_t rows = expected.items[i].global_shape[0];
    for (int64_t lo = 0; lo < rows; lo += (rows > 50 ? 37 : 1)) {
      for (int64_t len : {int64_t{1}, int64_t{2}, int64_t{5}, rows}) {
        const std::vector<Box> boxes = {Box{{lo, 1}, {std::min(len, rows - lo), 1}}};
        EXPECT_EQ(reader.chunks_overlapping(i, boxes), overlapping(expected.items[i], boxes))
            << expected.items[i].name << " rows " << lo << "+" << len;
      }
    }
  }
  // The search reads a few directory entries, not the 9.6 KB directory.
  MetadataReader fresh(*storage, kStepDir);
  const uint64_t head = fresh.bytes_read();
  fresh.chunks_overlapping(1, {Box{{300, 0}, {1, 3}}});
  EXPECT_LT(fresh.bytes_read() - head, 20 * 8 + 2 * 24 + 64);
}

TEST(MetadataReader, BytesInMemoryReadAsTheSameFileInAStorage) {
  for (uint32_t version : {1u, 2u}) {
    const CheckpointMeta meta = strided_meta(64);
    const std::vector<uint8_t> file = encode_metadata(meta, version);
    auto storage = storage_with(file);
    MetadataReader from_storage(*storage, kStepDir);
    MetadataReader from_bytes(file, "sent by rank 0");
    EXPECT_EQ(from_bytes.head().format_version, version);
    ASSERT_EQ(from_bytes.head().items.size(), from_storage.head().items.size());
    for (size_t i = 0; i < meta.items.size(); ++i) {
      EXPECT_EQ(from_bytes.chunk_count(i), from_storage.chunk_count(i));
      const std::vector<Box> all = {full_box(meta.items[i].global_shape)};
      EXPECT_EQ(from_bytes.chunks_overlapping(i, all), from_storage.chunks_overlapping(i, all));
      EXPECT_EQ(from_bytes.chunks_overlapping(i, all), meta.items[i].chunks);
    }
    // Damage is named by the source given, as a path is.
    std::vector<uint8_t> cut(file.begin(), file.begin() + static_cast<ptrdiff_t>(file.size() / 2));
    try {
      MetadataReader bad(cut, "sent by rank 0");
      for (size_t i = 0; i < meta.items.size(); ++i) {
        bad.chunks_overlapping(i, {full_box(meta.items[i].global_shape)});
      }
      ADD_FAILURE() << "a truncated metadata blob was read (v" << version << ")";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("sent by rank 0"), std::string::npos) << e.what();
    }
  }
}

// checkpoint/errors.h: one root, and one classification of damage.
TEST(CheckpointErrors, EveryKindIsACheckpointErrorAndOnlyTheBytesKindsAreDamage) {
  const std::vector<std::pair<std::exception_ptr, bool>> kinds = {
      {std::make_exception_ptr(FormatError("f")), true},
      {std::make_exception_ptr(ChecksumError("c")), true},
      {std::make_exception_ptr(TransformError("t")), true},
      {std::make_exception_ptr(IoError("i", EIO)), true},
      {std::make_exception_ptr(CheckpointDamagedError("d")), true},
      {std::make_exception_ptr(PlanError("p")), false},
      {std::make_exception_ptr(CheckpointError("save failed")), false}};
  for (const auto& [error, damage] : kinds) {
    try {
      std::rethrow_exception(error);
    } catch (const CheckpointError& e) {
      EXPECT_EQ(is_damage(e), damage) << e.what();
    }
  }
  EXPECT_FALSE(is_damage(std::runtime_error("a LibTorch error")));
  EXPECT_FALSE(is_damage(std::invalid_argument("shape")));
}

TEST(MetadataReader, ReadsVersionOneFilesWhole) {
  const CheckpointMeta meta = varied_meta();
  auto storage = storage_with(encode_metadata(meta, 1));
  MetadataReader reader(*storage, kStepDir);
  EXPECT_EQ(reader.head().format_version, 1u);
  EXPECT_EQ(reader.bytes_read(), encode_metadata(meta, 1).size());
  const std::vector<Box> boxes = {Box{{1, 0}, {2, 4}}};
  EXPECT_EQ(reader.chunks_overlapping(0, boxes), overlapping(meta.items[0], boxes));
  EXPECT_EQ(reader.chunk_count(0), 4u);
}

TEST(MetadataReader, ReadMetadataForFillsOnlyTheWantedItems) {
  const CheckpointMeta meta = varied_meta();
  auto storage = storage_with(encode_metadata(meta));
  uint64_t bytes = 0;
  const CheckpointMeta got = read_metadata_for(
      *storage, kStepDir,
      {{"cols", {Box{{0, 3}, {3, 2}}}}, {"rng.cpu", {Box{{0}, {16}}}}, {"absent", {}}}, &bytes);
  EXPECT_EQ(bytes, storage->bytes_);
  const CheckpointMeta full = decode(encode_metadata(meta));
  ASSERT_EQ(got.items.size(), full.items.size());
  for (size_t i = 0; i < got.items.size(); ++i) {
    const ItemMeta& item = got.items[i];
    EXPECT_EQ(item.global_shape, full.items[i].global_shape);
    if (item.name == "cols") {
      EXPECT_EQ(item.chunks, overlapping(full.items[i], {Box{{0, 3}, {3, 2}}}));
      EXPECT_EQ(item.chunks.size(), 2u);
    } else if (item.name == "rng.cpu") {
      EXPECT_EQ(item.chunks, full.items[i].chunks);
    } else {
      EXPECT_TRUE(item.chunks.empty()) << item.name;
    }
  }
  EXPECT_EQ(metadata_error(*storage, "/ck/none"), "no such checkpoint directory: /ck/none");
  EXPECT_THROW(MetadataReader(*storage, "/ck/none"), FormatError);
}

// Every byte of a small v2 file flipped in turn: a full decode refuses it; a
// partial reader refuses it or returns exactly the undamaged chunks.
TEST(MetadataReader, EverySingleByteFlipIsRefusedOrHarmless) {
  CheckpointMeta meta;
  meta.world_size = 4;
  meta.items.push_back(split_item("s", {8, 2}, 0, {0, 2, 4, 6, 8}));
  meta.items.push_back(split_item("i", {6, 2}, 0, {0, 1, 3, 3, 6}));
  ItemMeta grid{"g", ItemKind::kTensor, DType::kFloat32, {2, 2}, {}};
  grid.chunks.push_back(plain_chunk(Box{{0, 0}, {2, 1}}, 4, "rank_0.data", 0, 0));
  grid.chunks.push_back(plain_chunk(Box{{0, 1}, {2, 1}}, 4, "rank_0.data", 8, 0));
  meta.items.push_back(grid);
  const std::vector<uint8_t> file = encode_metadata(meta);
  const CheckpointMeta good = decode(file);
  const std::vector<std::vector<Box>> asks = {
      {Box{{3, 0}, {2, 2}}}, {Box{{2, 1}, {3, 1}}}, {Box{{1, 1}, {1, 1}}}};
  size_t refused_partially = 0;
  for (size_t i = 0; i < file.size(); ++i) {
    std::vector<uint8_t> bad = file;
    bad[i] ^= 0x01;
    EXPECT_THROW(decode(bad), FormatError) << "byte " << i;
    auto storage = storage_with(bad);
    bool refused = false;
    try {
      MetadataReader reader(*storage, kStepDir);
      ASSERT_EQ(reader.head().items.size(), 3u) << "byte " << i;
      for (size_t item = 0; item < 3; ++item) {
        EXPECT_EQ(reader.chunks_overlapping(item, asks[item]),
                  overlapping(good.items[item], asks[item]))
            << "byte " << i << " item " << item;
      }
    } catch (const FormatError& e) {
      refused = true;
      EXPECT_NE(std::string(e.what()).find("/ck/step_5/.metadata"), std::string::npos) << e.what();
    }
    refused_partially += refused ? 1 : 0;
  }
  EXPECT_GT(refused_partially, file.size() / 3);
}

TEST(MetadataReader, TruncatedAndExtendedFilesAreRefusedFromTheHeader) {
  const std::vector<uint8_t> file = encode_metadata(strided_meta(64));
  for (size_t len : {size_t{0}, size_t{20}, size_t{40}, file.size() / 2, file.size() - 1}) {
    auto storage = storage_with(std::vector<uint8_t>(file.begin(), file.begin() + len));
    EXPECT_THROW(MetadataReader(*storage, kStepDir), FormatError) << len;
  }
  std::vector<uint8_t> longer = file;
  longer.push_back(0);
  auto storage = storage_with(longer);
  try {
    MetadataReader reader(*storage, kStepDir);
    FAIL() << "an extended file was accepted";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("trailing bytes"), std::string::npos) << e.what();
    EXPECT_LE(storage->bytes_, 32u);
  }
}

void set_u64(std::vector<uint8_t>& blob, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) blob[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

TEST(MetadataReader, HostileLengthsAndOffsetsAreRefused) {
  CheckpointMeta meta;
  meta.items.push_back(split_item("aa", {4}, 0, {0, 4}));
  meta.items.push_back(split_item("bb", {4}, 0, {0, 4}));
  const std::vector<uint8_t> file = encode_metadata(meta);
  auto refuse = [&](std::vector<uint8_t> bad, const std::string& expected) {
    EXPECT_NE(decode_error(bad).find(expected), std::string::npos) << decode_error(bad);
    auto storage = storage_with(bad);
    try {
      MetadataReader reader(*storage, kStepDir);
      for (size_t i = 0; i < reader.head().items.size(); ++i) {
        reader.chunks_overlapping(i, {Box{{0}, {4}}});
      }
      ADD_FAILURE() << "accepted, expected " << expected;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  for (uint64_t huge : {~uint64_t{0}, uint64_t{1} << 40, uint64_t{file.size()}}) {
    std::vector<uint8_t> bad = file;
    set_u64(bad, 16, huge);
    refuse(bad, "truncated");
    bad = file;
    set_u64(bad, 24, huge);
    refuse(bad, "truncated");
  }
  // Moving bytes from the head to the sections keeps the size right.
  std::vector<uint8_t> shifted = file;
  set_u64(shifted, 16, file[16] - 1u);
  set_u64(shifted, 24, file[24] + 1u);
  refuse(shifted, "checksum");

  // Item bb's entry: name, kind, dtype, ndim, one dim, chunk count, then the
  // section offset (one byte here).
  const std::string name = "\x02"
                           "bb";
  const size_t at = static_cast<size_t>(
      std::search(file.begin(), file.end(), name.begin(), name.end()) - file.begin());
  ASSERT_LT(at, file.size());
  const size_t count_at = at + 3 + 4, offset_at = count_at + 1;
  ASSERT_EQ(file[count_at], 1);
  ASSERT_GT(file[offset_at], 0);
  ASSERT_LT(file[offset_at], 0x80);
  for (uint8_t offset : {uint8_t{0}, uint8_t(file[offset_at] + 1), uint8_t{0x7f}}) {
    std::vector<uint8_t> bad = file;
    bad[offset_at] = offset;
    reseal_v2(bad);
    refuse(bad, "item 'bb': section offset");
  }
  std::vector<uint8_t> many = file;
  many[count_at] = 0x7f;
  reseal_v2(many);
  refuse(many, "item 'bb': chunk count 127 does not fit");
  // A consistent edit still decodes: guards the offsets used above.
  std::vector<uint8_t> same = file;
  reseal_v2(same);
  EXPECT_EQ(decode(same), meta);
}

TEST(MetadataReader, DamagedRecordIsNamedByItemAndChunk) {
  const CheckpointMeta meta = strided_meta(8);
  std::vector<uint8_t> file = encode_metadata(meta);
  // The last record of item w's section ends just before item b's section.
  const std::string file_name = "rank_3.data";
  auto last = std::find_end(file.begin(), file.end(), file_name.begin(), file_name.end());
  ASSERT_NE(last, file.end());
  *(last + 5) = '7';  // rank_7.data: a valid name, so only the checksum can tell
  reseal_v2(file);
  auto storage = storage_with(file);
  MetadataReader reader(*storage, kStepDir);
  try {
    reader.chunks_overlapping(0, {Box{{28, 0}, {4, 16}}});
    FAIL() << "a damaged record was accepted";
  } catch (const FormatError& e) {
    EXPECT_EQ(std::string(e.what()),
              "/ck/step_5/.metadata: item 'w': chunk 7: record checksum mismatch");
  }
  EXPECT_EQ(reader.chunks_overlapping(0, {Box{{0, 0}, {4, 16}}}).size(), 1u);
}

TEST(Checksum, StreamingDigestEqualsOneShot) {
  std::vector<uint8_t> data(10000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + 7);
  Xxh3Stream stream;
  stream.update(data.data(), 1);
  stream.update(data.data() + 1, 4000);
  stream.update(data.data() + 4001, data.size() - 4001);
  EXPECT_EQ(stream.digest(), xxh3_64(data.data(), data.size()));
  stream.reset();
  EXPECT_EQ(stream.digest(), xxh3_64(nullptr, 0));
  Xxh3Stream moved = std::move(stream);
  moved.update(data.data(), 10);
  EXPECT_EQ(moved.digest(), xxh3_64(data.data(), 10));
}

// checksum.cpp may hash through XXH3's runtime dispatch (AVX2, AVX-512): the
// values must be the library's plain XXH3-64 at every size class XXH3 treats
// apart (0, 1-3, 4-8, 9-16, 17-128, 129-240 bytes, then stripes of 64 in
// blocks of 1024, and large inputs) and at every alignment, one-shot and
// streamed in uneven pieces, and the format's published values hold.
TEST(Checksum, EqualsTheReferenceXxh3AtEverySizeAndAlignment) {
  EXPECT_EQ(xxh3_64(nullptr, 0), 0x2D06800538D394C2ull);  // XXH3-64 of no bytes, seed 0
  std::vector<uint8_t> data((4 << 20) + 64);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (uint8_t& b : data) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<uint8_t>(x);
  }
  const size_t sizes[] = {0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 4096,
                          65537, (1 << 20) + 3, 4 << 20};
  for (size_t offset : {0, 1, 7, 32}) {
    for (size_t n : sizes) {
      const uint8_t* p = data.data() + offset;
      const uint64_t want = XXH3_64bits(p, n);
      EXPECT_EQ(xxh3_64(p, n), want) << n << " bytes at offset " << offset;
      Xxh3Stream stream;
      for (size_t done = 0, piece = 1; done < n; done += piece, piece = piece * 3 + 5) {
        stream.update(p + done, std::min(piece, n - done));
      }
      EXPECT_EQ(stream.digest(), want) << n << " bytes at offset " << offset << ", streamed";
    }
  }
}

}  // namespace
}  // namespace checkpoint
