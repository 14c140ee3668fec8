// The ckpt command-line tool, run as a process on real checkpoint directories
// written here byte by byte: what a user sees from list, inspect, verify and
// tiers, and the exit codes scripts rely on (0 ok, 1 failure or damage, 2
// usage).
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
#include <regex>
#include <sstream>

#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/tiers/local_tier.h"
#include "checkpoint/format/checksum.h"
#include "checkpoint/format/metadata.h"
#include "support/paths.h"

namespace checkpoint {
namespace {

namespace fs = std::filesystem;

const std::string kCkpt = testing_support::binary_dir() + "/ckpt";

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

struct SplitRunResult {
  int exit_code = -1;
  std::string out;  // stdout alone (what --json promises to keep clean)
  std::string err;
};

// Runs `ckpt <args>` with stderr to `stderr_file`, so stdout can be parsed.
SplitRunResult run_ckpt_split(const std::vector<std::string>& args, const fs::path& stderr_file) {
  std::string command = shell_quote(kCkpt);
  for (const std::string& a : args) command += " " + shell_quote(a);
  command += " 2>" + shell_quote(stderr_file.string());
  SplitRunResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error(std::string("popen: ") + std::strerror(errno));
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) result.out.append(buf, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream err(stderr_file, std::ios::binary);
  result.err.assign(std::istreambuf_iterator<char>(err), std::istreambuf_iterator<char>());
  return result;
}

// The cells of each line of a `ckpt list` table: columns are separated by
// two or more spaces, values hold at most single ones ("76 B").
std::vector<std::vector<std::string>> table_rows(const std::string& output) {
  std::vector<std::vector<std::string>> rows;
  std::istringstream lines(output);
  static const std::regex kGap(" {2,}");
  for (std::string line; std::getline(lines, line);) {
    rows.emplace_back(std::sregex_token_iterator(line.begin(), line.end(), kGap, -1),
                      std::sregex_token_iterator());
  }
  return rows;
}

// The table row whose PATH cell is `path`; empty if none.
std::vector<std::string> row_for_path(const std::string& output, const fs::path& path) {
  for (const std::vector<std::string>& row : table_rows(output)) {
    if (row.size() >= 5 && row[4] == path.string()) return row;
  }
  return {};
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

// Sum of the sizes of the regular files in `dir` (what SIZE and bytes report).
uint64_t bytes_in(const fs::path& dir) {
  uint64_t total = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) total += e.file_size();
  }
  return total;
}

// One checkpoint.dir holding every status `ckpt list` tells apart:
//   step_10          committed
//   step_20          .metadata cut in half              -> damaged
//   step_30          .metadata with one bit flipped     -> damaged
//   step_30.damaged  set aside by an earlier resume     -> set-aside
//   step_40          data written, no .metadata          -> uncommitted
// plus junk that is no checkpoint at all.
class CkptToolList : public CkptTool {
 protected:
  void SetUp() override {
    CkptTool::SetUp();
    write_checkpoint(root_, 10);
    const fs::path truncated = write_checkpoint(root_, 20);
    fs::resize_file(truncated / kMetadataFileName, fs::file_size(truncated / kMetadataFileName) / 2);
    const fs::path flipped = write_checkpoint(root_, 30);
    flip_byte(flipped / kMetadataFileName, 30);
    fs::rename(write_checkpoint(root_, 31), root_ / "step_30.damaged");
    write_checkpoint(root_, 40, /*committed=*/false);
    fs::create_directories(root_ / "step_x");
    fs::create_directories(root_ / "step_05");
    fs::create_directories(root_ / "step_5.damaged.0");
    fs::create_directories(root_ / "step_5.broken");
  }
};

TEST_F(CkptToolList, TextTellsCommittedDamagedUncommittedAndSetAsideApart) {
  const RunResult r = run_ckpt({"list", root_.string()});
  ASSERT_EQ(r.exit_code, 0) << r.output;  // listing is not checking
  const auto rows = table_rows(r.output);
  ASSERT_EQ(rows.size(), 6u) << r.output;
  EXPECT_EQ(rows[0], (std::vector<std::string>{"STEP", "STATUS", "SIZE", "DATE", "PATH", "REASON"}))
      << r.output;

  const auto committed = row_for_path(r.output, root_ / "step_10");
  ASSERT_EQ(committed.size(), 5u) << r.output;
  EXPECT_EQ(committed[0], "10");
  EXPECT_EQ(committed[1], "committed");
  EXPECT_EQ(committed[2], std::to_string(bytes_in(root_ / "step_10")) + " B");

  const auto truncated = row_for_path(r.output, root_ / "step_20");
  ASSERT_EQ(truncated.size(), 6u) << r.output;
  EXPECT_EQ(truncated[1], "damaged") << r.output;
  // Short: the file's name, without the directory the PATH column shows.
  EXPECT_EQ(truncated[5].rfind(".metadata", 0), 0u) << truncated[5];

  const auto flipped = row_for_path(r.output, root_ / "step_30");
  ASSERT_EQ(flipped.size(), 6u) << r.output;
  EXPECT_EQ(flipped[1], "damaged") << r.output;
  EXPECT_EQ(flipped[5].rfind(".metadata", 0), 0u) << flipped[5];

  const auto set_aside = row_for_path(r.output, root_ / "step_30.damaged");
  ASSERT_EQ(set_aside.size(), 5u) << r.output;
  EXPECT_EQ(set_aside[0], "30");
  EXPECT_EQ(set_aside[1], "set-aside");

  const auto uncommitted = row_for_path(r.output, root_ / "step_40");
  ASSERT_EQ(uncommitted.size(), 5u) << r.output;
  EXPECT_EQ(uncommitted[1], "uncommitted");

  // By step, the step directory before its set-aside copy.
  std::vector<std::string> order;
  for (size_t i = 1; i < rows.size(); ++i) order.push_back(rows[i].at(4));
  EXPECT_EQ(order, (std::vector<std::string>{(root_ / "step_10").string(), (root_ / "step_20").string(),
                                             (root_ / "step_30").string(),
                                             (root_ / "step_30.damaged").string(),
                                             (root_ / "step_40").string()}));
}

TEST_F(CkptToolList, JsonHasEveryEntryWithItsStatusAndTheErrorOfDamagedOnes) {
  const SplitRunResult r = run_ckpt_split({"list", "--json", root_.string()}, root_ / "stderr");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.err, "");
  const nlohmann::json j = nlohmann::json::parse(r.out);  // stdout is the JSON and nothing else
  EXPECT_EQ(j["dir"], root_.string());
  const nlohmann::json& c = j["checkpoints"];
  ASSERT_EQ(c.size(), 5u) << r.out;
  const std::vector<std::pair<int64_t, std::string>> expected = {
      {10, "committed"}, {20, "damaged"}, {30, "damaged"}, {30, "set-aside"}, {40, "uncommitted"}};
  const std::vector<std::string> names = {"step_10", "step_20", "step_30", "step_30.damaged", "step_40"};
  const std::regex iso(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)");
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(c[i]["step"], expected[i].first);
    EXPECT_EQ(c[i]["status"], expected[i].second);
    EXPECT_EQ(c[i]["path"], (root_ / names[i]).string());
    EXPECT_EQ(c[i]["bytes"], bytes_in(root_ / names[i]));
    EXPECT_GT(c[i]["mtime_unix_s"].get<int64_t>(), 1600000000);
    EXPECT_TRUE(std::regex_match(c[i]["mtime"].get<std::string>(), iso)) << c[i]["mtime"];
    // An error exactly for the damaged ones, naming the metadata file.
    EXPECT_EQ(c[i].contains("error"), expected[i].second == "damaged") << c[i];
    if (expected[i].second == "damaged") {
      EXPECT_TRUE(contains(c[i]["error"].get<std::string>(), (root_ / names[i] / ".metadata").string()))
          << c[i]["error"];
    }
  }
}

TEST_F(CkptTool, ListWithoutDamageHasNoReasonColumn) {
  write_checkpoint(root_, 10);
  write_checkpoint(root_, 20, /*committed=*/false);
  const RunResult r = run_ckpt({"list", root_.string()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto rows = table_rows(r.output);
  ASSERT_EQ(rows.size(), 3u) << r.output;
  EXPECT_EQ(rows[0], (std::vector<std::string>{"STEP", "STATUS", "SIZE", "DATE", "PATH"})) << r.output;
  EXPECT_EQ(row_for_path(r.output, root_ / "step_10").at(1), "committed");
  EXPECT_EQ(row_for_path(r.output, root_ / "step_20").at(1), "uncommitted");
}

TEST_F(CkptTool, ListJsonOfAnEmptyDirectoryIsAnEmptyList) {
  const SplitRunResult r = run_ckpt_split({"list", "--json", root_.string()}, root_ / "stderr");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j["checkpoints"].is_array());
  EXPECT_TRUE(j["checkpoints"].empty());
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
  for (const char* expected : {"version 2", "fsdp replicate=1 shard=2", "git = abc123", "model.w",
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

TEST_F(CkptTool, VerifyJsonOfAnIntactCheckpointSaysOk) {
  const fs::path dir = write_checkpoint(root_, 10);
  const SplitRunResult r = run_ckpt_split({"verify", "--json", dir.string()}, root_ / "stderr");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.err, "");
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["path"], dir.string());
  EXPECT_EQ(j["ok"], true);
  EXPECT_EQ(j["chunks"], 4);
  EXPECT_EQ(j["bytes"], 76);
  EXPECT_TRUE(j["seconds"].is_number()) << j;
  EXPECT_GE(j["seconds"].get<double>(), 0.0);
  EXPECT_TRUE(j["problems"].is_array());
  EXPECT_TRUE(j["problems"].empty());
  EXPECT_FALSE(j.contains("error"));
}

TEST_F(CkptTool, VerifyJsonNamesEachBadChunkAndExitsOne) {
  const fs::path dir = write_checkpoint(root_, 10);
  flip_byte(dir / "rank_1.data", 5);  // model.w chunk 1
  const SplitRunResult r = run_ckpt_split({"verify", "--json", dir.string()}, root_ / "stderr");
  ASSERT_EQ(r.exit_code, 1) << r.out << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["ok"], false);
  EXPECT_EQ(j["chunks"], 4);
  ASSERT_EQ(j["problems"].size(), 1u) << j;
  const nlohmann::json& p = j["problems"][0];
  EXPECT_EQ(p["item"], "model.w");
  EXPECT_EQ(p["chunk"], 1);
  EXPECT_EQ(p["file"], "rank_1.data");
  EXPECT_TRUE(contains(p["error"].get<std::string>(), "rank_1.data")) << p;
  EXPECT_EQ(j["bytes"], 76 - 24);  // the bad chunk's bytes are not counted as verified
}

TEST_F(CkptTool, VerifyJsonOfUnreadableMetadataIsStillOneObject) {
  const fs::path dir = write_checkpoint(root_, 10);
  fs::resize_file(dir / kMetadataFileName, 20);
  const SplitRunResult r = run_ckpt_split({"verify", "--json", dir.string()}, root_ / "stderr");
  ASSERT_EQ(r.exit_code, 1) << r.out << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["ok"], false);
  EXPECT_EQ(j["chunks"], 0);
  EXPECT_TRUE(j["problems"].empty());
  EXPECT_TRUE(contains(j["error"].get<std::string>(), (dir / kMetadataFileName).string())) << j;
  EXPECT_TRUE(contains(r.err, (dir / kMetadataFileName).string())) << r.err;  // and for a human
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

// ---------------------------------------------------------------- tiers

std::vector<uint8_t> file_bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_text(const fs::path& file, const std::string& text) {
  std::ofstream(file, std::ios::binary | std::ios::trunc) << text;
}

// A multi-level checkpoint as a job of 2 nodes with one rank each leaves it
// (tiers/local_tier.h): under root_/
//   durable/step_<N>/                   the checkpoint (write_checkpoint)
//   local/node<k>/step_<N>/rank_<k>.data, .metadata, .local.json
//   local/node<k>/step_<N>/.partner/rank_<1-k>.data, .partner.json  (with partner copies)
class CkptToolTiers : public CkptTool {
 protected:
  void SetUp() override {
    CkptTool::SetUp();
    durable_ = root_ / "durable";
    pattern_ = (root_ / "local" / "node{node}").string();
  }

  fs::path local(int node) const { return local_tier_dir(pattern_, node); }
  fs::path local_step(int node, int64_t step) const { return local(node) / step_dir_name(step); }

  void write_tiers(int64_t step, bool durable = true, bool partner = true) {
    const fs::path source = write_checkpoint(root_ / "scratch", step);
    std::vector<TierFile> files;
    for (int rank = 0; rank < 2; ++rank) {
      const std::string name = rank_file_name(rank);
      const std::vector<uint8_t> bytes = file_bytes(source / name);
      files.push_back(TierFile{name, rank, rank, bytes.size(), xxh3_64(bytes.data(), bytes.size())});
    }
    for (int node = 0; node < 2; ++node) {
      const fs::path dir = local_step(node, step);
      fs::create_directories(dir / kPartnerDirName);
      fs::copy_file(source / files[node].name, dir / files[node].name);
      TierFile own = files[node];
      own.xxh3.reset();
      write_text(dir / kLocalRecordName, encode_local_record(LocalRecord{step, node, {0, 1}, {own}}));
      fs::copy_file(source / kMetadataFileName, dir / kMetadataFileName);
      if (partner) {
        const TierFile& other = files[1 - node];
        fs::copy_file(source / other.name, dir / kPartnerDirName / other.name);
        write_text(dir / kPartnerRecordName, encode_partner_record(PartnerRecord{step, node, {other}}));
      }
    }
    if (durable) {
      fs::create_directories(durable_);
      fs::rename(source, durable_ / step_dir_name(step));
    }
    fs::remove_all(root_ / "scratch");
  }

  RunResult run_tiers(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"tiers", durable_.string(), "--local", pattern_, "--nodes", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_ckpt(args);
  }

  fs::path durable_;
  std::string pattern_;
};

TEST_F(CkptToolTiers, ListsEveryStepOfBothTiersNewestFirstAndResumesFromTheLocalOne) {
  write_tiers(10, /*durable=*/true);
  fs::remove_all(local(0) / "step_10");  // local retention kept only the newest
  fs::remove_all(local(1) / "step_10");
  write_tiers(20, /*durable=*/false);    // not flushed yet
  const RunResult r = run_tiers();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string step20 =
      "step 20\n"
      "  durable  absent\n"
      "  node 0   committed    own files 1 of 1; partner copies committed (1 file, of node 1)\n"
      "  node 1   committed    own files 1 of 1; partner copies committed (1 file, of node 0)\n"
      "  resume   local: every rank file is on its own node\n";
  const std::string step10 = "step 10\n  durable  committed    " + (durable_ / "step_10").string() +
                             "\n"
                             "  node 0   absent\n"
                             "  node 1   absent\n"
                             "  resume   durable: the local tier has no step_10\n";
  EXPECT_TRUE(contains(r.output, step20)) << r.output;
  EXPECT_TRUE(contains(r.output, step10)) << r.output;
  EXPECT_LT(r.output.find("step 20"), r.output.find("step 10")) << r.output;
  EXPECT_TRUE(contains(r.output, "node 1   " + local(1).string() + "\n")) << r.output;
  // The last line: what the trainer's resume would load.
  EXPECT_TRUE(r.output.size() > 1 &&
              r.output.substr(r.output.rfind('\n', r.output.size() - 2) + 1) ==
                  "resume would load: step 20 from the local tier (every rank file is on its own node)\n")
      << r.output;
}

TEST_F(CkptToolTiers, TakesTheLocalDirectoriesOneByOne) {
  write_tiers(20);
  const RunResult r = run_ckpt({"tiers", "--local", local(0).string(), "--local", local(1).string(),
                                durable_.string()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "node 1   committed    own files 1 of 1")) << r.output;
  EXPECT_TRUE(contains(r.output, "           else durable: the local copy of step_20 did not load\n"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "resume would load: step 20 from the local tier")) << r.output;
}

TEST_F(CkptToolTiers, JsonHasTheSameFacts) {
  write_tiers(20);
  const SplitRunResult r = run_ckpt_split(
      {"tiers", durable_.string(), "--local", pattern_, "--nodes", "2", "--json"}, root_ / "stderr");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.err, "");
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["durable_dir"], durable_.string());
  ASSERT_EQ(j["nodes"].size(), 2u) << j;
  EXPECT_EQ(j["nodes"][1]["dir"], local(1).string());
  EXPECT_EQ(j["nodes"][1]["missing"], false);
  ASSERT_EQ(j["steps"].size(), 1u) << j;
  const nlohmann::json& s = j["steps"][0];
  EXPECT_EQ(s["step"], 20);
  EXPECT_EQ(s["durable"]["status"], "committed");
  EXPECT_EQ(s["durable"]["path"], (durable_ / "step_20").string());
  ASSERT_EQ(s["nodes"].size(), 2u) << s;
  EXPECT_EQ(s["nodes"][0]["status"], "committed");
  EXPECT_EQ(s["nodes"][0]["own_files"], nlohmann::json({"rank_0.data"}));
  EXPECT_EQ(s["nodes"][0]["partner_copies"][0]["file"], "rank_1.data");
  EXPECT_EQ(s["nodes"][0]["partner_copies"][0]["from_node"], 1);
  EXPECT_EQ(s["nodes"][0]["partner_copies"][0]["present"], true);
  ASSERT_EQ(s["resume"]["candidates"].size(), 2u) << s;
  EXPECT_EQ(s["resume"]["candidates"][0]["tier"], "local");
  EXPECT_EQ(s["resume"]["candidates"][1]["tier"], "durable");
  EXPECT_EQ(j["resume"]["step"], 20);
  EXPECT_EQ(j["resume"]["tier"], "local");
  EXPECT_EQ(j["resume"]["reason"], "every rank file is on its own node");
  EXPECT_FALSE(j.contains("verify")) << "verify only with --verify";
}

TEST_F(CkptToolTiers, ALostNodesFilesComeFromPartnerCopies) {
  write_tiers(20);
  fs::remove_all(local(1));
  RunResult r = run_tiers();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "node 1   " + local(1).string() + "  missing (a lost node)\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "  node 1   absent\n")) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "resume would load: step 20 from the local tier (the files of node 1 (missing or "
                       "incomplete there) come from partner copies on node 0)\n"))
      << r.output;

  r = run_tiers({"--verify"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Node 0's own chunks are verified; the lost node's file is found elsewhere.
  EXPECT_TRUE(contains(r.output, "verified: 2 of 2 chunks intact (36 B); rank_1.data: partner copy on node 0\n"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "partner copies intact (XXH3-64 as recorded): rank_1.data\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "verify: OK")) << r.output;
}

TEST_F(CkptToolTiers, VerifyNamesACorruptedPartnerCopyAndExitsOne) {
  write_tiers(20);
  fs::remove_all(local(1));
  const fs::path copy = local_step(0, 20) / kPartnerDirName / "rank_1.data";
  flip_byte(copy, 3);
  // Listing is not checking: the size still matches the record.
  RunResult r = run_tiers();
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "resume would load: step 20 from the local tier")) << r.output;

  r = run_tiers({"--verify"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "BAD partner copy: " + copy.string() + ": XXH3 ")) << r.output;
  EXPECT_TRUE(contains(r.output, "verify: FAILED: 1 problem(s)")) << r.output;
  // Resume would find out too, and fall back to the durable copy.
  EXPECT_TRUE(contains(r.output, "resume would fail on step 20 from the local tier: " + copy.string()))
      << r.output;
  EXPECT_TRUE(contains(r.output,
                       "resume would load: step 20 from the durable tier (the local copy of step_20 did "
                       "not load)\n"))
      << r.output;

  const SplitRunResult j = run_ckpt_split(
      {"tiers", durable_.string(), "--local", pattern_, "--nodes", "2", "--verify", "--json"},
      root_ / "stderr");
  EXPECT_EQ(j.exit_code, 1) << j.out << j.err;
  const nlohmann::json doc = nlohmann::json::parse(j.out);
  EXPECT_EQ(doc["verify"]["ok"], false);
  const nlohmann::json& check = doc["steps"][0]["nodes"][0]["verify"]["partner_copies"][0];
  EXPECT_EQ(check["file"], "rank_1.data");
  EXPECT_EQ(check["ok"], false);
  EXPECT_TRUE(contains(check["error"].get<std::string>(), copy.string())) << check;
  EXPECT_EQ(doc["resume"]["tier"], "durable");
}

TEST_F(CkptToolTiers, VerifyReadsTheLocalChunksAndSaysWhereTheOtherFilesAre) {
  write_tiers(20);
  RunResult r = run_tiers({"--verify"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "verified: 2 of 2 chunks intact (36 B); rank_1.data: on node 1\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "verified: 2 of 2 chunks intact (40 B); rank_0.data: on node 0\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "verified: 4 of 4 chunks intact (76 B)\n")) << r.output;  // durable

  flip_byte(local_step(0, 20) / "rank_0.data", 5);  // model.w chunk 0
  r = run_tiers({"--verify"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "BAD item 'model.w' chunk 0 (rank_0.data): ")) << r.output;
  EXPECT_TRUE(contains(r.output, (local(0) / "step_20").string())) << r.output;
  EXPECT_TRUE(contains(r.output, "resume would load: step 20 from the durable tier")) << r.output;
}

TEST_F(CkptToolTiers, ALostNodeWithoutPartnerCopiesResumesFromTheDurableTier) {
  write_tiers(10, /*durable=*/true, /*partner=*/false);
  write_tiers(20, /*durable=*/false, /*partner=*/false);
  fs::remove_all(local(1));
  const RunResult r = run_tiers();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string why =
      "local step_20 lacks rank_1.data (node 1: not committed there or files missing, and no committed "
      "partner copy)";
  EXPECT_TRUE(contains(r.output, "  node 0   committed    own files 1 of 1; partner copies: none\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "  resume   not loadable: " + why + "\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "resume note: " + why + "\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "resume would load: step 10 from the durable tier (local step_10 lacks "
                                 "rank_1.data"))
      << r.output;
}

TEST_F(CkptToolTiers, ARestoredStepWithoutItsRecordIsShownAndNotReliedOn) {
  write_tiers(20, /*durable=*/false);
  fs::remove(local_step(1, 20) / kLocalRecordName);
  const RunResult r = run_tiers();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "  node 1   committed    no .local.json; partner copies committed")) << r.output;
  EXPECT_TRUE(contains(r.output, "resume would load: step 20 from the local tier (the files of node 1")) << r.output;
}

TEST_F(CkptToolTiers, NothingCommittedMeansNothingToResume) {
  const RunResult r = run_tiers();
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "no checkpoints in either tier")) << r.output;
  EXPECT_TRUE(contains(r.output, "nothing to resume\n")) << r.output;
}

TEST_F(CkptToolTiers, LocalPatternAndNodesMustGoTogether) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"tiers", durable_.string(), "--local", pattern_},                      // {node}, no --nodes
           {"tiers", durable_.string(), "--local", local(0).string(), "--nodes", "2"},  // no {node}
           {"tiers", durable_.string()},                                           // no --local
           {"tiers", durable_.string(), "--local", pattern_, "--nodes", "0"}}) {
    const RunResult r = run_ckpt(args);
    EXPECT_EQ(r.exit_code, 2) << args.back() << ": " << r.output;
  }
  const RunResult r = run_ckpt({"tiers", durable_.string(), "--local", pattern_});
  EXPECT_TRUE(contains(r.output, "ckpt tiers: --local " + pattern_ + ": a pattern with {node} needs --nodes N"))
      << r.output;
}

}  // namespace
}  // namespace checkpoint
