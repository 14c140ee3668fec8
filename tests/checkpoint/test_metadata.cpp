// The metadata index: round trips, and rejection of every kind of damaged or
// hostile input with an error that names the file, item and chunk.
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "checkpoint/format/checksum.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/storage/memory.h"
#include "checkpoint/storage/storage.h"

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

}  // namespace
}  // namespace checkpoint
