// Chunks on disk: encoding into checksummed blocks, reading back whole and
// partial ranges while fetching only the blocks needed, resharded reads, and
// damaged files or metadata reported with the item, chunk and file.
#include <gtest/gtest.h>

#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <unistd.h>

#include "checkpoint/format/checksum.h"
#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/codec/chunk_writer.h"
#include "checkpoint/storage/posix_counters.h"
#include "support/faulty_storage.h"
#include "support/skip.h"
#include "checkpoint/codec/transforms.h"

namespace checkpoint {
namespace {

constexpr uint64_t kBlock = 4096;
constexpr const char* kFile = "rank_0.data";

using Chain = std::vector<std::string>;
const std::vector<Chain> kChains = {
    {}, {"zstd/1"}, {"bytegroup/1", "zstd/1"}, {"signrot/1", "bytegroup/1", "zstdplanes/1"}};

std::string chunk_temp_dir(const std::string& tag) {
  std::string templ = ::testing::TempDir() + "/" + tag + "_XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + templ);
  return templ;
}

// Records every read_at.
class ReadCountingStorage : public StorageWrapper {
 public:
  struct Read {
    std::string path;
    uint64_t offset;
    size_t n;
  };
  using StorageWrapper::StorageWrapper;

  void read_at(const std::string& path, uint64_t offset, void* dst, size_t n) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      reads_.push_back(Read{path, offset, n});
    }
    StorageWrapper::read_at(path, offset, dst, n);
  }
  std::vector<Read> take_reads() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::move(reads_);
  }

 private:
  std::mutex mu_;
  std::vector<Read> reads_;
};

// Smooth float32 values: compressible, but not trivially.
std::vector<uint8_t> tensor_bytes(size_t numel, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0.0f, 0.01f);
  std::vector<uint8_t> bytes(numel * 4);
  for (size_t i = 0; i < numel; ++i) {
    const float f = static_cast<float>(i % 97) * 0.5f + noise(rng);
    std::memcpy(bytes.data() + 4 * i, &f, 4);
  }
  return bytes;
}

class ChunkIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = chunk_temp_dir("chunk_io");
    counting_ = std::make_shared<ReadCountingStorage>(posix_storage());
  }
  void TearDown() override { posix_storage()->remove_all(dir_); }

  // A float32 item of shape {rows, cols}, saved as chunks of `rows_per_chunk`
  // rows, one after another in `file` with junk between them.
  ItemMeta write_item(const std::string& name, int64_t rows, int64_t cols, int64_t rows_per_chunk,
                      const Chain& chain, const std::vector<uint8_t>& data,
                      const std::string& file = kFile, thread_pool::ThreadPool* pool = nullptr) {
    ItemMeta item{name, ItemKind::kTensor, DType::kFloat32, {rows, cols}, {}};
    std::vector<uint8_t> contents(13, 0xab);  // the first chunk does not start at 0
    for (int64_t r = 0; r < rows; r += rows_per_chunk) {
      const int64_t n = std::min(rows_per_chunk, rows - r);
      const uint64_t lo = static_cast<uint64_t>(r * cols * 4), len = static_cast<uint64_t>(n * cols * 4);
      EncodedChunk enc = encode_chunk(data.data() + lo, len, 4, chain, 3, kBlock, pool);
      ChunkMeta c;
      c.box = Box{{r, 0}, {n, cols}};
      c.file = file;
      c.offset = contents.size();
      c.length = enc.stored.size();
      c.logical_bytes = enc.logical_bytes;
      c.transforms = chain;
      c.checksum = enc.checksum;
      c.blocks = enc.blocks;
      item.chunks.push_back(c);
      contents.insert(contents.end(), enc.stored.begin(), enc.stored.end());
      contents.insert(contents.end(), 17, 0xcd);
    }
    append_file(file, contents);
    return item;
  }

  void append_file(const std::string& file, const std::vector<uint8_t>& contents) {
    const std::string path = join_path(dir_, file);
    std::vector<uint8_t> all;
    if (posix_storage()->exists(path)) all = posix_storage()->read_file(path, 1 << 30);
    all.insert(all.end(), contents.begin(), contents.end());
    posix_storage()->write_file_atomic(path, all);
  }

  void flip_byte(const std::string& file, uint64_t offset) {
    const std::string path = join_path(dir_, file);
    std::vector<uint8_t> all = posix_storage()->read_file(path, 1 << 30);
    all.at(offset) ^= 0x5a;
    posix_storage()->write_file_atomic(path, all);
  }

  void commit(const std::vector<ItemMeta>& items) {
    CheckpointMeta meta;
    meta.step = 10;
    meta.items = items;
    posix_storage()->write_file_atomic(join_path(dir_, kMetadataFileName), encode_metadata(meta));
  }

  std::string dir_;
  std::shared_ptr<ReadCountingStorage> counting_;
};

TEST(EncodeChunk, SplitsIntoWholeElementBlocksWithChecksums) {
  const std::vector<uint8_t> data = tensor_bytes(3000, 1);  // 12000 bytes
  const EncodedChunk enc = encode_chunk(data.data(), data.size(), 4, {}, 3, 4098, nullptr);
  ASSERT_EQ(enc.blocks.size(), 3u);  // 4096 + 4096 + 3808: the block size rounds down to 4096
  EXPECT_EQ(enc.blocks[0].logical_length, 4096u);
  EXPECT_EQ(enc.blocks[2].logical_length, 12000u - 8192u);
  EXPECT_EQ(enc.blocks[2].stored_offset, 8192u);
  EXPECT_EQ(enc.blocks[1].checksum, xxh3_64(data.data() + 4096, 4096));
  EXPECT_EQ(enc.checksum, xxh3_64(data.data(), data.size()));
  EXPECT_EQ(enc.stored, data);  // untransformed: stored == logical

  const EncodedChunk empty = encode_chunk(nullptr, 0, 4, {"zstd/1"}, 3, 4096, nullptr);
  EXPECT_TRUE(empty.blocks.empty());
  EXPECT_TRUE(empty.stored.empty());
  EXPECT_EQ(empty.checksum, xxh3_64(nullptr, 0));
  EXPECT_THROW(encode_chunk(data.data(), 6, 4, {}, 3, 4096, nullptr), std::invalid_argument);
  EXPECT_THROW(encode_chunk(data.data(), 8, 4, {}, 3, 2, nullptr), std::invalid_argument);
}

TEST(EncodeChunk, ParallelEncodingEqualsSerial) {
  const std::vector<uint8_t> data = tensor_bytes(50000, 2);
  thread_pool::ThreadPool pool(3);
  const Chain chain = {"bytegroup/1", "zstd/1"};
  const EncodedChunk serial = encode_chunk(data.data(), data.size(), 4, chain, 3, kBlock, nullptr);
  const EncodedChunk parallel = encode_chunk(data.data(), data.size(), 4, chain, 3, kBlock, &pool);
  EXPECT_EQ(serial.stored, parallel.stored);
  EXPECT_EQ(serial.blocks, parallel.blocks);
  EXPECT_EQ(serial.checksum, parallel.checksum);
  EXPECT_LT(serial.stored.size(), data.size());
}

// Chunks for the ChunkWriter tests: many small ones, a big one of many
// blocks in the middle, an empty one, and chains changing along the way.
struct TestChunk {
  std::vector<uint8_t> data;
  Chain chain;
};

std::vector<TestChunk> mixed_chunks() {
  std::vector<TestChunk> chunks;
  for (size_t i = 0; i < 120; ++i) {
    const size_t numel = 1 + (i * 37) % 900;
    chunks.push_back({tensor_bytes(numel, static_cast<uint32_t>(i)), kChains[1 + i % 3]});
    if (i == 60) chunks.push_back({tensor_bytes(40 * kBlock / 4 + 3, 99), kChains[3]});
    if (i == 70) chunks.push_back({{}, kChains[3]});
    if (i == 80) chunks.push_back({tensor_bytes(3 * kBlock / 4 + 1, 98), {}});  // uncompressed
  }
  return chunks;
}

// Writes `chunks` through a ChunkWriter into `path`; returns their metadata.
std::vector<ChunkMeta> write_with_chunk_writer(const std::string& path,
                                               const std::vector<TestChunk>& chunks,
                                               thread_pool::ThreadPool* pool, size_t window,
                                               size_t* peak = nullptr) {
  auto file = posix_storage()->create_file(path);
  ChunkWriter::Options o;
  o.block_size = kBlock;
  o.max_batches_in_flight = window;
  ChunkWriter writer(*file, pool, o);
  for (const TestChunk& c : chunks) writer.add_chunk(c.data.data(), c.data.size(), 4, c.chain);
  std::vector<ChunkMeta> metas = writer.finish();
  if (peak) *peak = writer.peak_batches_in_flight();
  file->sync();
  file->close();
  return metas;
}

TEST_F(ChunkIoTest, ChunkWriterStoresWhatEncodeChunkDoesBackToBackInOrder) {
  const std::vector<TestChunk> chunks = mixed_chunks();
  thread_pool::ThreadPool pool(3);
  size_t peak = 0;
  const std::string path = join_path(dir_, kFile);
  const std::vector<ChunkMeta> metas = write_with_chunk_writer(path, chunks, &pool, 4, &peak);
  const std::vector<uint8_t> file = posix_storage()->read_file(path, 1 << 30);
  ASSERT_EQ(metas.size(), chunks.size());
  uint64_t end = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ChunkMeta& m = metas[i];
    EXPECT_EQ(m.offset, end) << "chunk " << i << " does not follow the one before";
    end = m.offset + m.length;
    const EncodedChunk want = encode_chunk(chunks[i].data.data(), chunks[i].data.size(), 4,
                                           chunks[i].chain, 3, kBlock, nullptr);
    EXPECT_EQ(m.transforms, chunks[i].chain);
    EXPECT_EQ(m.logical_bytes, want.logical_bytes);
    EXPECT_EQ(m.checksum, want.checksum) << "chunk " << i;
    ASSERT_EQ(m.blocks.size(), want.blocks.size()) << "chunk " << i;
    for (size_t b = 0; b < want.blocks.size(); ++b) {
      EXPECT_EQ(m.blocks[b].stored_offset, want.blocks[b].stored_offset) << i << "/" << b;
      EXPECT_EQ(m.blocks[b].stored_length, want.blocks[b].stored_length) << i << "/" << b;
      EXPECT_EQ(m.blocks[b].logical_length, want.blocks[b].logical_length) << i << "/" << b;
      EXPECT_EQ(m.blocks[b].checksum, want.blocks[b].checksum) << i << "/" << b;
    }
    ASSERT_EQ(m.length, want.stored.size()) << "chunk " << i;
    EXPECT_TRUE(std::equal(want.stored.begin(), want.stored.end(),
                           file.begin() + static_cast<std::ptrdiff_t>(m.offset)))
        << "chunk " << i << " stored bytes differ";
  }
  EXPECT_EQ(end, file.size());
  EXPECT_LE(peak, 4u);
  EXPECT_GT(peak, 1u) << "blocks of different chunks were never in flight together";
}

TEST_F(ChunkIoTest, ChunkWriterOutputReadsBackBitExact) {
  const std::vector<TestChunk> chunks = mixed_chunks();
  thread_pool::ThreadPool pool(2);
  const std::vector<ChunkMeta> metas =
      write_with_chunk_writer(join_path(dir_, kFile), chunks, &pool, 3);
  ChunkReader reader(posix_storage(), dir_, &pool);
  for (size_t i = 0; i < chunks.size(); ++i) {
    const int64_t numel = static_cast<int64_t>(chunks[i].data.size() / 4);
    ItemMeta item{"item" + std::to_string(i), ItemKind::kTensor, DType::kFloat32, {numel}, {}};
    ChunkMeta c = metas[i];
    c.file = kFile;
    c.box = Box{{0}, {numel}};
    item.chunks.push_back(c);
    std::vector<uint8_t> got(chunks[i].data.size());
    reader.read_logical(item, 0, 0, got.size(), got.data());
    EXPECT_EQ(got, chunks[i].data) << "chunk " << i;
  }
}

// Big uncompressed chunks start at a file offset congruent to their memory
// address modulo 4 KiB (Options::align_in_place_bytes), so O_DIRECT writes
// them from that memory with no bounce copy; small and compressed chunks stay
// back to back; the skipped bytes are under 4 KiB each, covered by no chunk,
// and every chunk reads back bit-exact.
TEST_F(ChunkIoTest, BigPlainChunksAlignWithTheirMemoryAndGoDirectWithoutACopy) {
  const DirectIoProbe probe = probe_direct_io(dir_, uint64_t{1} << 20, 1);
  if (!probe.accepted) SHARDKIT_SKIP("the file system of " << dir_ << " refuses O_DIRECT: " << probe.detail);
  const size_t big = (size_t{2} << 20) + 4 * 100;  // 2 MiB + 100 floats
  std::vector<uint8_t> arena(4 * big + 8 * 4096);
  for (size_t i = 0; i < arena.size(); ++i) arena[i] = static_cast<uint8_t>(i * 29 + (i >> 11));
  // Four big chunks at different page offsets of the arena, small compressed
  // chunks between them.
  struct Piece {
    const uint8_t* data;
    size_t n;
    Chain chain;
  };
  std::vector<TestChunk> smalls;
  for (int i = 0; i < 4; ++i) smalls.push_back({tensor_bytes(300 + 50 * i, 7 + i), kChains[1]});
  std::vector<Piece> pieces;
  const size_t shifts[] = {0, 4, 1000, 4092};
  for (int i = 0; i < 4; ++i) {
    const uint8_t* base = arena.data() + i * (big + 4096);
    const uintptr_t page = (reinterpret_cast<uintptr_t>(base) + 4095) / 4096 * 4096;
    pieces.push_back({reinterpret_cast<const uint8_t*>(page) + shifts[i], big, {}});
    pieces.push_back({smalls[i].data.data(), smalls[i].data.size(), smalls[i].chain});
  }
  PosixOptions direct;
  direct.direct_io = DirectIo::kOn;
  thread_pool::ThreadPool pool(3);
  const std::string path = join_path(dir_, kFile);
  const PosixWriteCounters before = posix_write_counters();
  std::vector<ChunkMeta> metas;
  uint64_t stored = 0;
  {
    auto file = posix_storage(direct)->create_file(path);
    ChunkWriter::Options o;  // align_in_place_bytes: 1 MiB, the default
    ChunkWriter writer(*file, &pool, o);
    for (const Piece& p : pieces) writer.add_chunk(p.data, p.n, 4, p.chain);
    metas = writer.finish();
    stored = writer.stored_bytes();
    file->sync();
    file->close();
  }
  const PosixWriteCounters after = posix_write_counters();
  ASSERT_EQ(metas.size(), pieces.size());
  uint64_t end = 0, lengths = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const ChunkMeta& m = metas[i];
    const bool aligned = pieces[i].chain.empty();
    if (aligned) {
      EXPECT_EQ(m.offset % 4096, reinterpret_cast<uintptr_t>(pieces[i].data) % 4096) << "chunk " << i;
      EXPECT_GE(m.offset, end) << "chunk " << i;
      EXPECT_LT(m.offset - end, 4096u) << "chunk " << i;
    } else {
      EXPECT_EQ(m.offset, end) << "chunk " << i << ": a compressed chunk follows the one before";
    }
    end = m.offset + m.length;
    lengths += m.length;
  }
  EXPECT_EQ(stored, lengths) << "stored_bytes counts the chunks, not the skipped bytes";
  EXPECT_GE(after.direct_bytes - before.direct_bytes, uint64_t{4} * ((size_t{2} << 20) - 8192));
  EXPECT_EQ(after.bounced_bytes, before.bounced_bytes) << "a direct write went through the aligned buffer";
  ChunkReader reader(posix_storage(), dir_, &pool);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int64_t numel = static_cast<int64_t>(pieces[i].n / 4);
    ItemMeta item{"item" + std::to_string(i), ItemKind::kTensor, DType::kFloat32, {numel}, {}};
    ChunkMeta c = metas[i];
    c.file = kFile;
    c.box = Box{{0}, {numel}};
    item.chunks.push_back(c);
    std::vector<uint8_t> got(pieces[i].n);
    reader.read_logical(item, 0, 0, got.size(), got.data());
    EXPECT_TRUE(std::equal(got.begin(), got.end(), pieces[i].data)) << "chunk " << i;
  }
  // The same chunks back to back with alignment off: the direct writes of
  // unaligned memory go through the aligned buffer.
  {
    const PosixWriteCounters b = posix_write_counters();
    auto file = posix_storage(direct)->create_file(join_path(dir_, "b.data"));
    ChunkWriter::Options o;
    o.align_in_place_bytes = 0;
    ChunkWriter writer(*file, &pool, o);
    for (const Piece& p : pieces) writer.add_chunk(p.data, p.n, 4, p.chain);
    const std::vector<ChunkMeta> packed = writer.finish();
    file->sync();
    file->close();
    EXPECT_EQ(packed[0].offset, 0u);
    EXPECT_GT(posix_write_counters().bounced_bytes, b.bounced_bytes);
  }
}

TEST_F(ChunkIoTest, ChunkWriterWithoutAPoolMatchesThePipeline) {
  const std::vector<TestChunk> chunks = mixed_chunks();
  thread_pool::ThreadPool pool(4);
  const auto piped = write_with_chunk_writer(join_path(dir_, "a.data"), chunks, &pool, 8);
  size_t peak = 0;
  const auto serial = write_with_chunk_writer(join_path(dir_, "b.data"), chunks, nullptr, 1, &peak);
  EXPECT_EQ(peak, 1u);
  ASSERT_EQ(piped.size(), serial.size());
  for (size_t i = 0; i < piped.size(); ++i) {
    EXPECT_EQ(piped[i].offset, serial[i].offset);
    EXPECT_EQ(piped[i].checksum, serial[i].checksum);
  }
  EXPECT_EQ(posix_storage()->read_file(join_path(dir_, "a.data"), 1 << 30),
            posix_storage()->read_file(join_path(dir_, "b.data"), 1 << 30));
}

TEST_F(ChunkIoTest, ChunkWriterReleasesEachChunksBytesOnceWritten) {
  thread_pool::ThreadPool pool(2);
  auto file = posix_storage()->create_file(join_path(dir_, kFile));
  ChunkWriter::Options o;
  o.block_size = kBlock;
  o.max_batches_in_flight = 2;
  ChunkWriter writer(*file, &pool, o);
  std::vector<std::weak_ptr<const std::vector<uint8_t>>> owners;
  for (uint32_t i = 0; i < 20; ++i) {
    auto data = std::make_shared<const std::vector<uint8_t>>(tensor_bytes(3 * kBlock / 4, i));
    owners.push_back(data);
    writer.add_chunk(data->data(), data->size(), 4, kChains[3], data);
  }
  // With 2 blocks in flight, the earlier chunks are written and let go of.
  for (size_t i = 0; i + 3 < owners.size(); ++i) EXPECT_TRUE(owners[i].expired()) << "chunk " << i;
  writer.finish();
  for (size_t i = 0; i < owners.size(); ++i) EXPECT_TRUE(owners[i].expired()) << "chunk " << i;
}

// A real file that records its write and write-back calls.
class RecordingFile : public WritableFile {
 public:
  explicit RecordingFile(std::unique_ptr<WritableFile> inner) : inner_(std::move(inner)) {}
  void append(const void* data, size_t n) override { inner_->append(data, n); }
  void write_at(uint64_t offset, const void* data, size_t n) override {
    ++writes;
    inner_->write_at(offset, data, n);
  }
  void sync() override { inner_->sync(); }
  void close() override { inner_->close(); }
  void start_writeback(uint64_t offset, uint64_t n) override {
    writebacks.emplace_back(offset, n);
    inner_->start_writeback(offset, n);
  }
  size_t writes = 0;
  std::vector<std::pair<uint64_t, uint64_t>> writebacks;

 private:
  std::unique_ptr<WritableFile> inner_;
};

// Many small chunks, compressed or not, go out in few batches (one pool task
// and one write each), still read back bit-exact, and the file is asked to
// start write-back as the data accumulates, over contiguous ranges.
TEST_F(ChunkIoTest, ChunkWriterBatchesSmallChunksIntoFewWritesAndHintsWriteback) {
  for (const Chain& chain : {kChains[0], kChains[3]}) {
    RecordingFile file(posix_storage()->create_file(join_path(dir_, kFile)));
    thread_pool::ThreadPool pool(2);
    ChunkWriter::Options o;
    o.block_size = 1 << 20;
    o.batch_bytes = 64 << 10;
    o.writeback_bytes = 128 << 10;
    ChunkWriter writer(file, &pool, o);
    std::vector<std::vector<uint8_t>> datas;
    for (uint32_t i = 0; i < 400; ++i) datas.push_back(tensor_bytes(100 + (i * 13) % 400, i));
    uint64_t logical = 0;
    for (const auto& d : datas) {
      writer.add_chunk(d.data(), d.size(), 4, chain);
      logical += d.size();
    }
    const std::vector<ChunkMeta> metas = writer.finish();
    file.sync();
    file.close();
    // 400 chunks of about 1.2 KiB: 1 write per 64 KiB batch, not per chunk.
    EXPECT_LE(file.writes, logical / (64 << 10) + 2) << "chain of " << chain.size();
    EXPECT_GE(file.writes, 2u);
    ASSERT_FALSE(file.writebacks.empty());
    uint64_t next = 0;
    for (const auto& [offset, n] : file.writebacks) {
      EXPECT_EQ(offset, next);
      EXPECT_GE(n, uint64_t{128} << 10);
      next = offset + n;
    }
    EXPECT_LE(next, writer.stored_bytes());
    ChunkReader reader(posix_storage(), dir_, &pool);
    for (size_t i = 0; i < datas.size(); ++i) {
      const int64_t numel = static_cast<int64_t>(datas[i].size() / 4);
      ItemMeta item{"item" + std::to_string(i), ItemKind::kTensor, DType::kFloat32, {numel}, {}};
      ChunkMeta c = metas[i];
      c.file = kFile;
      c.box = Box{{0}, {numel}};
      item.chunks.push_back(c);
      std::vector<uint8_t> got(datas[i].size());
      reader.read_logical(item, 0, 0, got.size(), got.data());
      EXPECT_EQ(got, datas[i]) << "chunk " << i;
      EXPECT_EQ(c.checksum, xxh3_64(datas[i].data(), datas[i].size())) << "chunk " << i;
    }
  }
}

// A one-block chunk's checksum is its block's; metadata where the two
// disagree is reported, not trusted.
TEST_F(ChunkIoTest, OneBlockChunkWhoseChunkChecksumDisagreesIsReported) {
  const std::vector<uint8_t> data = tensor_bytes(500, 4);
  ItemMeta item = write_item("model.w", 500, 1, 500, kChains[3], data, kFile);
  ASSERT_EQ(item.chunks.size(), 1u);
  ASSERT_EQ(item.chunks[0].blocks.size(), 1u);
  item.chunks[0].checksum ^= 1;
  ChunkReader reader(posix_storage(), dir_);
  std::vector<uint8_t> got(data.size());
  try {
    reader.read_logical(item, 0, 0, got.size(), got.data());
    FAIL() << "no error";
  } catch (const ChecksumError& e) {
    EXPECT_NE(std::string(e.what()).find("model.w"), std::string::npos) << e.what();
  }
}

TEST_F(ChunkIoTest, ChunkWriterRethrowsAFailedWriteAndCanStillBeDestroyed) {
  faults::FaultPlan plan;
  plan.fail_on_write_call = 5;
  plan.fail_errno = EIO;
  auto storage = faults::fault_injecting_storage(posix_storage(), plan);
  thread_pool::ThreadPool pool(2);
  auto file = storage->create_file(join_path(dir_, kFile));
  const std::vector<TestChunk> chunks = mixed_chunks();
  try {
    ChunkWriter::Options o;
    o.block_size = kBlock;
    ChunkWriter writer(*file, &pool, o);
    for (const TestChunk& c : chunks) writer.add_chunk(c.data.data(), c.data.size(), 4, c.chain);
    writer.finish();
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), EIO);
    EXPECT_NE(std::string(e.what()).find(kFile), std::string::npos) << e.what();
  }
}

TEST_F(ChunkIoTest, WholeChunksReadBackBitExactForEveryChain) {
  thread_pool::ThreadPool pool(3);
  const std::vector<uint8_t> data = tensor_bytes(256 * 64, 3);
  for (size_t i = 0; i < kChains.size(); ++i) {
    const std::string file = "rank_" + std::to_string(i) + ".data";
    const ItemMeta item = write_item("model.w", 256, 64, 96, kChains[i], data, file);
    for (thread_pool::ThreadPool* p : {static_cast<thread_pool::ThreadPool*>(nullptr), &pool}) {
      ChunkReader reader(posix_storage(), dir_, p);
      std::vector<uint8_t> back(data.size());
      uint64_t at = 0;
      for (size_t c = 0; c < item.chunks.size(); ++c) {
        reader.read_logical(item, c, 0, item.chunks[c].logical_bytes, back.data() + at);
        at += item.chunks[c].logical_bytes;
      }
      EXPECT_EQ(back, data) << "chain " << i << (p ? " with" : " without") << " a pool";
    }
  }
}

TEST_F(ChunkIoTest, PartialRangesSpanningBlocksReadBackExactly) {
  const std::vector<uint8_t> data = tensor_bytes(128 * 64, 4);  // one chunk of 32 KiB: 8 blocks
  for (size_t i = 0; i < kChains.size(); ++i) {
    const std::string file = "rank_" + std::to_string(i) + ".data";
    const ItemMeta item = write_item("model.w", 128, 64, 128, kChains[i], data, file);
    ChunkReader reader(posix_storage(), dir_);
    const std::vector<std::pair<uint64_t, uint64_t>> ranges = {
        {0, 1}, {5, 100}, {4090, 12}, {4096, 4096}, {100, 3 * kBlock}, {8191, 16385},
        {data.size() - 7, 7}, {0, data.size() - 1}, {12345, 0}};
    for (const auto& [lo, n] : ranges) {
      std::vector<uint8_t> back(n, 0);
      reader.read_logical(item, 0, lo, n, back.data());
      EXPECT_TRUE(std::equal(back.begin(), back.end(), data.begin() + lo))
          << "chain " << i << " range " << lo << " +" << n;
    }
    std::vector<uint8_t> one(1);
    EXPECT_THROW(reader.read_logical(item, 0, data.size(), 1, one.data()), std::invalid_argument);
  }
}

TEST_F(ChunkIoTest, OnlyTheBlocksOverlappingTheRangeAreRead) {
  const std::vector<uint8_t> data = tensor_bytes(128 * 64, 5);
  for (size_t i = 0; i < kChains.size(); ++i) {
    const std::string file = "rank_" + std::to_string(i) + ".data";
    const ItemMeta item = write_item("model.w", 128, 64, 128, kChains[i], data, file);
    const ChunkMeta& chunk = item.chunks[0];
    ChunkReader reader(counting_, dir_);
    // Logical [2 * kBlock + 10, 4 * kBlock + 5) touches blocks 2, 3 and 4.
    std::vector<uint8_t> back(2 * kBlock - 5);
    counting_->take_reads();
    reader.read_logical(item, 0, 2 * kBlock + 10, back.size(), back.data());
    const uint64_t first = chunk.offset + chunk.blocks[2].stored_offset;
    const uint64_t end = chunk.offset + chunk.blocks[4].stored_offset + chunk.blocks[4].stored_length;
    uint64_t bytes = 0;
    const auto reads = counting_->take_reads();
    for (const auto& r : reads) {
      EXPECT_GE(r.offset, first) << "chain " << i;
      EXPECT_LE(r.offset + r.n, end) << "chain " << i;
      bytes += r.n;
    }
    EXPECT_EQ(bytes, end - first) << "chain " << i;
    // Compressed blocks come in one read; untransformed ones split where the
    // whole middle block goes straight into place.
    EXPECT_EQ(reads.size(), kChains[i].empty() ? 3u : 1u) << "chain " << i;
  }
}

TEST_F(ChunkIoTest, ReadIntoAppliesAReshardingPlanDecodingEachBlockOnce) {
  thread_pool::ThreadPool pool(2);
  const std::vector<uint8_t> data = tensor_bytes(256 * 64, 6);
  for (size_t i = 0; i < kChains.size(); ++i) {
    const std::string file = "rank_" + std::to_string(i) + ".data";
    // Saved as 4 row chunks; loaded as a column slice crossing chunks 0 to 2.
    const ItemMeta item = write_item("model.w", 256, 64, 64, kChains[i], data, file);
    const Box wanted{{40, 16}, {100, 24}};
    std::vector<uint8_t> got(100 * 24 * 4, 0);
    ChunkReader reader(counting_, dir_, &pool);
    counting_->take_reads();
    for (const ReadRequest& req : plan_reads(item, wanted)) reader.read_into(item, req, got.data());
    for (int64_t r = 0; r < 100; ++r) {
      ASSERT_EQ(std::memcmp(got.data() + r * 24 * 4, data.data() + ((40 + r) * 64 + 16) * 4, 24 * 4), 0)
          << "chain " << i << " row " << r;
    }
    std::set<uint64_t> offsets;
    for (const auto& read : counting_->take_reads()) {
      EXPECT_TRUE(offsets.insert(read.offset).second) << "a range was read twice, chain " << i;
    }
  }
}

TEST_F(ChunkIoTest, LargeChunksAreReadInBoundedBatches) {
  // 40 MiB untransformed; a column slice needs every block, none of them whole.
  const int64_t rows = 10240, cols = 1024;
  std::vector<uint8_t> data(static_cast<size_t>(rows * cols * 4));
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + i / 4096);
  ItemMeta item{"big", ItemKind::kTensor, DType::kFloat32, {rows, cols}, {}};
  EncodedChunk enc = encode_chunk(data.data(), data.size(), 4, {}, 3, 1 << 20, nullptr);
  item.chunks.push_back(ChunkMeta{full_box({rows, cols}), kFile, 0, enc.stored.size(),
                                  enc.logical_bytes, {}, enc.checksum, 0, enc.blocks});
  append_file(kFile, enc.stored);
  const Box wanted{{0, 0}, {rows, 8}};
  std::vector<uint8_t> got(static_cast<size_t>(rows * 8 * 4));
  ChunkReader reader(counting_, dir_);
  for (const ReadRequest& req : plan_reads(item, wanted)) reader.read_into(item, req, got.data());
  size_t largest = 0;
  for (const auto& r : counting_->take_reads()) largest = std::max(largest, r.n);
  EXPECT_LE(largest, size_t{32} << 20);
  for (int64_t r = 0; r < rows; r += 997) {
    ASSERT_EQ(std::memcmp(got.data() + r * 32, data.data() + r * cols * 4, 32), 0) << r;
  }
}

TEST_F(ChunkIoTest, FlippedStoredByteIsCaughtNamingItemChunkAndFile) {
  const std::vector<uint8_t> data = tensor_bytes(256 * 64, 7);
  for (size_t i = 0; i < kChains.size(); ++i) {
    const std::string file = "rank_" + std::to_string(i) + ".data";
    const ItemMeta item = write_item("model.w", 256, 64, 128, kChains[i], data, file);
    const ChunkMeta& chunk = item.chunks[1];
    flip_byte(file, chunk.offset + chunk.blocks[3].stored_offset + chunk.blocks[3].stored_length / 2);
    ChunkReader reader(posix_storage(), dir_);
    std::vector<uint8_t> back(chunk.logical_bytes);
    std::string message;
    try {
      reader.read_logical(item, 1, 0, back.size(), back.data());
    } catch (const ChecksumError& e) {
      message = e.what();
    } catch (const TransformError& e) {
      message = e.what();
    }
    EXPECT_NE(message.find(dir_ + " item 'model.w' chunk 1 block 3 (file " + file + ")"),
              std::string::npos)
        << "chain " << i << ": " << message;
    if (kChains[i].empty()) {
      EXPECT_EQ(message, "checksum mismatch in " + dir_ + " item 'model.w' chunk 1 block 3 (file " +
                             file + ")");
    }
    // Blocks not touched by the damage still read fine.
    reader.read_logical(item, 1, 0, 3 * kBlock, back.data());
    EXPECT_TRUE(std::equal(back.begin(), back.begin() + 3 * kBlock, data.begin() + chunk.logical_bytes));
  }
}

TEST_F(ChunkIoTest, WholeChunkReadsCheckTheChunkChecksumToo) {
  const std::vector<uint8_t> data = tensor_bytes(64 * 64, 8);
  ItemMeta item = write_item("model.w", 64, 64, 64, {"zstd/1"}, data);
  item.chunks[0].checksum ^= 1;
  ChunkReader reader(posix_storage(), dir_);
  std::vector<uint8_t> back(data.size());
  reader.read_logical(item, 0, 0, data.size() - 4, back.data());  // partial: blocks only
  EXPECT_THROW(reader.read_logical(item, 0, 0, data.size(), back.data()), ChecksumError);
}

TEST_F(ChunkIoTest, TruncatedDataFileErrorNamesTheFile) {
  const std::vector<uint8_t> data = tensor_bytes(128 * 64, 9);
  const ItemMeta item = write_item("model.w", 128, 64, 64, {"zstd/1"}, data);
  const ChunkMeta& chunk = item.chunks[1];
  ASSERT_EQ(::truncate(join_path(dir_, kFile).c_str(),
                       static_cast<off_t>(chunk.offset + chunk.length / 2)), 0);
  ChunkReader reader(posix_storage(), dir_);
  std::vector<uint8_t> back(chunk.logical_bytes);
  try {
    reader.read_logical(item, 1, 0, back.size(), back.data());
    FAIL() << "no error";
  } catch (const IoError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("item 'model.w' chunk 1"), std::string::npos) << message;
    EXPECT_NE(message.find("truncated: " + join_path(dir_, kFile)), std::string::npos) << message;
  }
  reader.read_logical(item, 0, 0, item.chunks[0].logical_bytes, back.data());  // chunk 0 is intact
}

TEST_F(ChunkIoTest, UnsafeFileNameInMetadataIsRefusedBeforeAnyRead) {
  const std::vector<uint8_t> data = tensor_bytes(64 * 64, 10);
  ItemMeta item = write_item("model.w", 64, 64, 64, {}, data);
  ChunkReader reader(counting_, dir_);
  std::vector<uint8_t> back(data.size());
  for (const std::string name : {"../rank_0.data", "/etc/passwd", ".metadata", "a/b", ""}) {
    item.chunks[0].file = name;
    counting_->take_reads();
    try {
      reader.read_logical(item, 0, 0, data.size(), back.data());
      FAIL() << "read from '" << name << "'";
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("unsafe file name '" + name + "'"), std::string::npos);
    }
    EXPECT_TRUE(counting_->take_reads().empty());
  }
}

TEST_F(ChunkIoTest, MalformedBlocksInUnvalidatedMetadataAreRefused) {
  const std::vector<uint8_t> data = tensor_bytes(64 * 64, 11);
  ItemMeta item = write_item("model.w", 64, 64, 64, {"zstd/1"}, data);
  ItemMeta bad = item;
  bad.chunks[0].blocks[1].stored_length = item.chunks[0].length;  // runs past the chunk
  ChunkReader reader(posix_storage(), dir_);
  std::vector<uint8_t> back(data.size());
  EXPECT_THROW(reader.read_logical(bad, 0, 0, data.size(), back.data()), FormatError);
  bad = item;
  bad.chunks[0].blocks.clear();
  EXPECT_THROW(reader.read_logical(bad, 0, 0, 4, back.data()), FormatError);
  bad = item;
  bad.chunks[0].transforms = {"zstd/7"};
  try {
    reader.read_logical(bad, 0, 0, 4, back.data());
    FAIL() << "no error";
  } catch (const TransformError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown transform descriptor 'zstd/7'"), std::string::npos);
  }
  EXPECT_THROW(reader.read_logical(item, 1, 0, 4, back.data()), FormatError);  // no chunk 1
}

TEST_F(ChunkIoTest, VerifyPassesAnIntactCheckpointAndReportsEveryBadChunk) {
  thread_pool::ThreadPool pool(2);
  const std::vector<uint8_t> w = tensor_bytes(256 * 64, 12), b = tensor_bytes(64 * 16, 13);
  const ItemMeta wi = write_item("model.w", 256, 64, 64, {"bytegroup/1", "zstd/1"}, w);
  const ItemMeta bi = write_item("model.b", 64, 16, 32, {}, b, "rank_1.data");
  commit({wi, bi});
  VerifyReport report = verify_checkpoint(*posix_storage(), dir_, &pool);
  EXPECT_TRUE(report.ok()) << report.problems.front().message;
  EXPECT_EQ(report.chunks, 6u);
  EXPECT_EQ(report.bytes, w.size() + b.size());

  flip_byte(kFile, wi.chunks[2].offset + 1);
  flip_byte("rank_1.data", bi.chunks[1].offset + bi.chunks[1].length - 1);
  report = verify_checkpoint(*posix_storage(), dir_);
  ASSERT_EQ(report.problems.size(), 2u);
  EXPECT_FALSE(report.ok());
  EXPECT_EQ(report.problems[0].item, "model.w");
  EXPECT_EQ(report.problems[0].chunk, 2u);
  EXPECT_EQ(report.problems[0].file, kFile);
  EXPECT_EQ(report.problems[1].item, "model.b");
  EXPECT_EQ(report.problems[1].chunk, 1u);
  EXPECT_NE(report.problems[1].message.find("checksum mismatch in " + dir_ + " item 'model.b' chunk 1"),
            std::string::npos)
      << report.problems[1].message;
  EXPECT_EQ(report.chunks, 6u);
}

TEST_F(ChunkIoTest, VerifyRefusesADirectoryWithoutCommittedMetadata) {
  try {
    verify_checkpoint(*posix_storage(), dir_);
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_EQ(std::string(e.what()), "not a committed checkpoint (no .metadata): " + dir_);
  }
}

}  // namespace
}  // namespace checkpoint
