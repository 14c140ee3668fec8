// The ckpt command-line tool, run as a process on real checkpoint directories
// written here byte by byte: what a user sees from list, inspect and verify,
// and the exit codes scripts rely on (0 ok, 1 failure or damage, 2 usage).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "checkpoint/storage/checkpoint_dir.h"
#include "checkpoint/format/checksum.h"
#include "checkpoint/format/metadata.h"

namespace checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr const char* kCkpt = SHARDKIT_BINARY_DIR "/ckpt";

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs `ckpt <args>` and collects its output and exit code.
RunResult run_ckpt(const std::vector<std::string>& args) {
  std::string command = shell_quote(kCkpt);
  for (const std::string& a : args) command += " " + shell_quote(a);
  command += " 2>&1";
  RunResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error(std::string("popen: ") + std::strerror(errno));
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) result.output.append(buf, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// A checkpoint as a two-rank FSDP run would write it:
//   model.w  float32 [4, 3], rows 0-1 in rank_0.data, rows 2-3 in rank_1.data
//   model.b  float32 [3], replicated, written once by rank 0
//   rng.cpu  bytes [16], written by rank 1
class CheckpointWriter {
 public:
  static constexpr uint64_t kBlockBytes = 16;

  explicit CheckpointWriter(fs::path dir) : dir_(std::move(dir)) { fs::create_directories(dir_); }

  // Appends `bytes` (the logical bytes, untransformed) to `file` and records
  // the chunk.
  void add_chunk(ItemMeta& item, Box box, const std::string& file, int32_t rank,
                 const std::vector<uint8_t>& bytes) {
    ChunkMeta c;
    c.box = std::move(box);
    c.file = file;
    c.offset = file_sizes_[file];
    c.length = bytes.size();
    c.logical_bytes = bytes.size();
    c.checksum = xxh3_64(bytes.data(), bytes.size());
    c.writer_rank = rank;
    // Untransformed blocks of kBlockBytes (FORMAT.md: every non-empty chunk
    // has blocks; stored == logical for each).
    for (uint64_t lo = 0; lo < bytes.size(); lo += kBlockBytes) {
      const uint64_t n = std::min<uint64_t>(kBlockBytes, bytes.size() - lo);
      c.blocks.push_back(BlockMeta{lo, n, n, xxh3_64(bytes.data() + lo, n)});
    }
    std::ofstream out(dir_ / file, std::ios::binary | std::ios::app);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    file_sizes_[file] += bytes.size();
    item.chunks.push_back(std::move(c));
  }

  // The commit: .metadata written last.
  void commit(const CheckpointMeta& meta) {
    const std::vector<uint8_t> encoded = encode_metadata(meta);
    std::ofstream out(dir_ / kMetadataFileName, std::ios::binary);
    out.write(reinterpret_cast<const char*>(encoded.data()), static_cast<std::streamsize>(encoded.size()));
  }

 private:
  fs::path dir_;
  std::map<std::string, uint64_t> file_sizes_;
};

std::vector<uint8_t> float_bytes(size_t count, float first) {
  std::vector<uint8_t> out(count * sizeof(float));
  for (size_t i = 0; i < count; ++i) {
    const float v = first + static_cast<float>(i);
    std::memcpy(out.data() + i * sizeof(float), &v, sizeof v);  // little-endian host
  }
  return out;
}

// Writes step_<step>/ under `root`; committed unless told otherwise.
fs::path write_checkpoint(const fs::path& root, int64_t step, bool committed = true) {
  const fs::path dir = root / step_dir_name(step);
  CheckpointWriter writer(dir);
  CheckpointMeta meta;
  meta.step = step;
  meta.world_size = 2;
  meta.layout = "fsdp replicate=1 shard=2";
  meta.created_unix_s = 1700000000;
  meta.info = {{"git", "abc123"}};

  ItemMeta w{"model.w", ItemKind::kTensor, DType::kFloat32, {4, 3}, {}};
  writer.add_chunk(w, Box{{0, 0}, {2, 3}}, "rank_0.data", 0, float_bytes(6, 0.0f));
  writer.add_chunk(w, Box{{2, 0}, {2, 3}}, "rank_1.data", 1, float_bytes(6, 6.0f));
  ItemMeta b{"model.b", ItemKind::kTensor, DType::kFloat32, {3}, {}};
  writer.add_chunk(b, Box{{0}, {3}}, "rank_0.data", 0, float_bytes(3, 100.0f));
  ItemMeta rng{"rng.cpu", ItemKind::kBytes, DType::kUInt8, {16}, {}};
  std::vector<uint8_t> state(16);
  for (size_t i = 0; i < state.size(); ++i) state[i] = static_cast<uint8_t>(i * 7);
  writer.add_chunk(rng, Box{{0}, {16}}, "rank_1.data", 1, state);
  meta.items = {w, b, rng};
  if (committed) writer.commit(meta);
  return dir;
}

class CkptTool : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "shardkit-ckpt-tool-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr) << std::strerror(errno);
    root_ = pattern;
    ASSERT_TRUE(fs::exists(kCkpt)) << kCkpt << " is not built";
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  fs::path root_;
};

void flip_byte(const fs::path& file, uint64_t offset) {
  std::fstream f(file, std::ios::binary | std::ios::in | std::ios::out);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(static_cast<char>(c ^ 0x40));
}

TEST_F(CkptTool, ListShowsCommittedAndIncompleteCheckpoints) {
  write_checkpoint(root_, 10);
  write_checkpoint(root_, 20, /*committed=*/false);
  fs::create_directories(root_ / "step_x");
  fs::create_directories(root_ / "step_05");

  const RunResult r = run_ckpt({"list", root_.string()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "STEP")) << r.output;
  EXPECT_TRUE(contains(r.output, (root_ / "step_10").string())) << r.output;
  EXPECT_TRUE(contains(r.output, "committed")) << r.output;
  EXPECT_TRUE(contains(r.output, (root_ / "step_20").string())) << r.output;
  EXPECT_TRUE(contains(r.output, "INCOMPLETE")) << r.output;
  EXPECT_FALSE(contains(r.output, "step_x")) << r.output;
  EXPECT_FALSE(contains(r.output, "step_05")) << r.output;
  EXPECT_LT(r.output.find("step_10"), r.output.find("step_20")) << r.output;
}

TEST_F(CkptTool, ListOfAnEmptyOrMissingDirectorySaysSoAndSucceeds) {
  RunResult r = run_ckpt({"list", root_.string()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "no checkpoints in " + root_.string())) << r.output;
  r = run_ckpt({"list", (root_ / "missing").string()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "no checkpoints in")) << r.output;
}

TEST_F(CkptTool, InspectShowsLayoutItemsAndShapes) {
  const fs::path dir = write_checkpoint(root_, 10);
  const RunResult r = run_ckpt({"inspect", dir.string()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* expected : {"version 1", "fsdp replicate=1 shard=2", "git = abc123", "model.w",
                               "[4, 3]", "float32", "model.b", "rng.cpu", "bytes", "uint8", "[16]",
                               "total: 3 items, 4 chunks, 2 files"}) {
    EXPECT_TRUE(contains(r.output, expected)) << "missing '" << expected << "' in\n" << r.output;
  }
  EXPECT_FALSE(contains(r.output, "rank_1.data")) << "chunks only with --chunks\n" << r.output;
}

TEST_F(CkptTool, InspectWithChunksListsEveryChunk) {
  const fs::path dir = write_checkpoint(root_, 10);
  const RunResult r = run_ckpt({"inspect", "--chunks", dir.string()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[0:2, 0:3]  rank_0.data @0 +24")) << r.output;
  EXPECT_TRUE(contains(r.output, "[2:4, 0:3]  rank_1.data @0 +24")) << r.output;
  EXPECT_TRUE(contains(r.output, "[0:3]  rank_0.data @24 +12")) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 1")) << r.output;
}

TEST_F(CkptTool, InspectJsonIsOneObjectWithTheSameFacts) {
  const fs::path dir = write_checkpoint(root_, 10);
  const RunResult r = run_ckpt({"inspect", "--json", "--chunks", dir.string()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["step"], 10);
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_EQ(j["layout"], "fsdp replicate=1 shard=2");
  EXPECT_EQ(j["info"]["git"], "abc123");
  ASSERT_EQ(j["items"].size(), 3u);
  EXPECT_EQ(j["items"][0]["name"], "model.w");
  EXPECT_EQ(j["items"][0]["shape"], nlohmann::json({4, 3}));
  EXPECT_EQ(j["items"][0]["num_chunks"], 2);
  EXPECT_EQ(j["items"][0]["logical_bytes"], 48);
  EXPECT_EQ(j["items"][0]["chunks"][1]["file"], "rank_1.data");
  EXPECT_EQ(j["items"][0]["chunks"][1]["offsets"], nlohmann::json({2, 0}));
  EXPECT_EQ(j["totals"]["chunks"], 4);
  EXPECT_EQ(j["totals"]["stored_bytes"], 24 + 24 + 12 + 16);
}

TEST_F(CkptTool, InspectRefusesAnIncompleteCheckpointNamingIt) {
  const fs::path dir = write_checkpoint(root_, 20, /*committed=*/false);
  const RunResult r = run_ckpt({"inspect", dir.string()});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, dir.string())) << r.output;
  EXPECT_TRUE(contains(r.output, "not a committed checkpoint")) << r.output;
}

TEST_F(CkptTool, InspectOfDamagedMetadataFailsNamingTheFile) {
  const fs::path dir = write_checkpoint(root_, 10);
  flip_byte(dir / kMetadataFileName, 30);
  RunResult r = run_ckpt({"inspect", dir.string()});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, (dir / kMetadataFileName).string())) << r.output;

  // Garbage of every length is an error, never a crash.
  for (size_t size : {0, 7, 31, 64}) {
    std::ofstream(dir / kMetadataFileName, std::ios::binary | std::ios::trunc) << std::string(size, '\xff');
    r = run_ckpt({"inspect", dir.string()});
    EXPECT_EQ(r.exit_code, 1) << size << ": " << r.output;
    EXPECT_TRUE(contains(r.output, dir.string())) << r.output;
  }
}

TEST_F(CkptTool, InspectEscapesControlCharactersFromDisk) {
  const fs::path dir = root_ / "step_1";
  CheckpointWriter writer(dir);
  CheckpointMeta meta;
  meta.step = 1;
  meta.layout = "fsdp\x1b[2J";
  meta.created_unix_s = INT64_MAX;  // no calendar date: printed raw
  meta.items.push_back(ItemMeta{"evil\x1b]0;title\x07", ItemKind::kTensor, DType::kInt8, {0}, {}});
  writer.commit(meta);
  RunResult r = run_ckpt({"inspect", dir.string()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find('\x1b'), std::string::npos) << r.output;
  EXPECT_TRUE(contains(r.output, "evil\\x1b]0;title\\x07")) << r.output;
  r = run_ckpt({"inspect", "--json", dir.string()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["items"][0]["name"], "evil\x1b]0;title\x07");
}

TEST_F(CkptTool, VerifyOfAnIntactCheckpointSucceeds) {
  const fs::path dir = write_checkpoint(root_, 10);
  const RunResult r = run_ckpt({"verify", "--threads", "2", dir.string()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "OK: 4 chunks, 76 bytes verified in")) << r.output;
}

TEST_F(CkptTool, VerifyNamesTheItemWhoseDataByteFlipped) {
  const fs::path dir = write_checkpoint(root_, 10);
  flip_byte(dir / "rank_1.data", 5);  // model.w chunk 1
  const RunResult r = run_ckpt({"verify", dir.string()});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "BAD item 'model.w' chunk 1 (rank_1.data)")) << r.output;
  EXPECT_FALSE(contains(r.output, "model.b")) << r.output;
  EXPECT_FALSE(contains(r.output, "rng.cpu")) << r.output;
}

TEST_F(CkptTool, VerifyNamesATruncatedDataFile) {
  const fs::path dir = write_checkpoint(root_, 10);
  fs::resize_file(dir / "rank_1.data", 30);  // cuts into rng.cpu
  const RunResult r = run_ckpt({"verify", dir.string()});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "BAD")) << r.output;
  EXPECT_TRUE(contains(r.output, "rank_1.data")) << r.output;
  EXPECT_TRUE(contains(r.output, "rng.cpu")) << r.output;
}

TEST_F(CkptTool, VerifyNamesAMissingDataFile) {
  const fs::path dir = write_checkpoint(root_, 10);
  fs::remove(dir / "rank_0.data");
  const RunResult r = run_ckpt({"verify", dir.string()});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "rank_0.data")) << r.output;
}

TEST_F(CkptTool, VerifyRefusesADirectoryWithoutMetadata) {
  const fs::path dir = write_checkpoint(root_, 10);
  fs::remove(dir / kMetadataFileName);
  RunResult r = run_ckpt({"verify", dir.string()});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, dir.string())) << r.output;
  EXPECT_TRUE(contains(r.output, ".metadata")) << r.output;

  r = run_ckpt({"verify", (root_ / "step_99").string()});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, (root_ / "step_99").string())) << r.output;
}

TEST_F(CkptTool, UsageErrorsExitWithTwo) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{}, {"frobnicate"}, {"verify"}, {"list"},
                                             {"verify", "--threads", "0", root_.string()},
                                             {"inspect", "--bogus", root_.string()}}) {
    const RunResult r = run_ckpt(args);
    EXPECT_EQ(r.exit_code, 2) << (args.empty() ? "" : args[0]) << ": " << r.output;
  }
  EXPECT_EQ(run_ckpt({"--help"}).exit_code, 0);
}

}  // namespace
}  // namespace checkpoint
