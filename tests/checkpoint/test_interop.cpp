// Interop: exporting a sharded checkpoint to safetensors and torch.save files,
// reading such files back (ours and Python's) with WeightsFile, initializing a
// differently sharded state from them, and refusing hostile files cleanly.
// The Python checks run when a python3 with torch is found (SHARDKIT_PYTHON,
// /usr/bin/python3, python3) and are skipped, saying so, otherwise.
#include <gtest/gtest.h>
#include <unistd.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/interop/export.h"
#include "checkpoint/interop/hf.h"
#include "checkpoint/interop/import_weights.h"
#include "checkpoint/load.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/save.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/interop/pickle.h"
#include "checkpoint/interop/weights_file.h"
#include "checkpoint/interop/zip_archive.h"
#include "support/multi_rank.h"
#include "support/paths.h"
#include "support/python.h"
#include "support/skip.h"

namespace checkpoint {
namespace {

namespace fs = std::filesystem;
using namespace std::string_literals;

// A global tensor of the test checkpoint and how the 2 saving ranks split it.
struct GlobalTensor {
  std::string name;
  torch::Tensor full;
  int64_t dim = 0;
  std::vector<int64_t> split;  // sizes along `dim` per rank; empty: replicated
};

torch::Tensor wave(std::vector<int64_t> shape, double phase) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return (torch::sin(torch::arange(n, torch::kFloat64) * 0.37 + phase) * 3).to(torch::kFloat32).reshape(shape);
}

std::vector<GlobalTensor> global_tensors() {
  const float inf = std::numeric_limits<float>::infinity();
  // Edge cases for float32 -> bfloat16: NaN, infinities, -0, a subnormal,
  // and halfway values (1 + 2^-8 rounds down to even, 1 + 3 * 2^-8 up).
  torch::Tensor special = torch::tensor({std::nanf(""), inf, -inf, -0.0f, 1e-40f, 1.00390625f,
                                         1.01171875f, 3.4e38f});
  return {
      {"model.w", wave({7, 5}, 0), 0, {4, 3}},
      {"model.b", wave({9}, 1).to(torch::kBFloat16), 0, {5, 4}},
      {"model.cols", wave({4, 6}, 2), 1, {3, 3}},
      {"model.h", wave({6, 2}, 3).to(torch::kFloat16), 0, {1, 5}},
      {"model.special", special, 0, {4, 4}},
      {"model.ids", torch::arange(3, torch::kInt64) * 1000000007, 0, {}},
      {"model.flags", torch::tensor({true, false, true, true, false}), 0, {}},
      {"model.scalar", torch::tensor(2.5f), 0, {}},
      {"model.empty", torch::zeros({0, 3}), 0, {}},
      {"optim.w.exp_avg", wave({7, 5}, 4), 0, {4, 3}},
  };
}

std::string model_name(const std::string& item) { return item.substr(std::strlen("model.")); }

// Bit-exact comparison (NaN payloads included), except that with `any_nan`
// a NaN matches any NaN: torch itself converts float32 NaN to bfloat16 0x7FC0
// (c10's scalar path) or 0xFFFF (its vectorized CPU path); export writes 0x7FC0.
::testing::AssertionResult same_bits(const torch::Tensor& got, const torch::Tensor& want,
                                     bool any_nan = false) {
  if (got.scalar_type() != want.scalar_type() || got.sizes() != want.sizes()) {
    return ::testing::AssertionFailure() << got.toString() << got.sizes() << " vs " << want.toString()
                                         << want.sizes();
  }
  torch::Tensor a = got.contiguous(), b = want.contiguous();
  if (any_nan && a.is_floating_point()) {
    const torch::Tensor both_nan = a.isnan() & b.isnan();
    a = torch::where(both_nan, torch::zeros_like(a), a);
    b = torch::where(both_nan, torch::zeros_like(b), b);
  }
  if (std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) != 0) {
    return ::testing::AssertionFailure() << "values differ:\n" << a << "\nvs\n" << b;
  }
  return ::testing::AssertionSuccess();
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Runs a shell command; its exit status (-1 if it did not exit normally).
int run_command(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Rows [lo, hi) of dim 0 for part `part` of `parts` (as even as possible).
std::pair<int64_t, int64_t> part_range(int64_t n, int part, int parts) {
  return {n * part / parts, n * (part + 1) / parts};
}

class InteropTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Per process: ctest runs each test of this binary as its own process, in
    // parallel, and they must not delete each other's files.
    root_ = new fs::path(fs::path(testing_support::binary_dir()) /
                         ("test_interop_tmp_" + std::to_string(::getpid())));
    fs::remove_all(*root_);
    fs::create_directories(*root_);
    ckpt_ = new std::string((*root_ / "step_5").string());
    const std::vector<GlobalTensor> globals = global_tensors();
    testing_support::run_runtimes(2, [&](comm::Runtime& rt) {
      const int rank = rt.env.rank;
      StateDict sd;
      for (const GlobalTensor& g : globals) {
        if (g.split.empty()) {
          sd.add_tensor(g.name, g.full.clone());
          continue;
        }
        int64_t offset = 0;
        for (int r = 0; r < rank; ++r) offset += g.split[r];
        std::vector<int64_t> offsets(g.full.dim(), 0);
        offsets[g.dim] = offset;
        sd.add_tensor(g.name, g.full.narrow(g.dim, offset, g.split[rank]).contiguous(),
                      g.full.sizes().vec(), offsets);
      }
      sd.add_bytes("rng", {1, 2, 3});
      SaveOptions options;
      options.step = 5;
      options.compression.codec = checkpoint::Codec::kZstd;
      options.compression.block_size = 64;  // several blocks per chunk
      save_state_dict(sd, *ckpt_, *rt.checkpoint, options);
    });
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
    delete ckpt_;
  }

  static std::string out(const std::string& name) { return (*root_ / name).string(); }

  // Exports the model items of the test checkpoint, in small slabs so that
  // slabs cross chunk and block boundaries.
  static std::string export_model(ExportFormat format, const std::string& name,
                                  std::optional<DType> dtype = std::nullopt) {
    ExportOptions options;
    options.format = format;
    options.only = "model";
    options.dtype = dtype;
    options.slab_bytes = 40;
    export_checkpoint(*ckpt_, out(name), options);
    return out(name);
  }

  // Checks that `file` holds every model tensor (converted to bf16 when
  // `bf16`), reading each in three boxes along dim 0 as a 3-rank run would.
  static void expect_model_tensors(const std::string& file, bool bf16) {
    const WeightsFile wf = WeightsFile::open(file);
    size_t model_items = 0;
    for (const GlobalTensor& g : global_tensors()) {
      if (g.name.rfind("model.", 0) != 0) continue;
      ++model_items;
      torch::Tensor want = g.full;
      if (bf16 && want.is_floating_point()) want = want.to(torch::kBFloat16);
      const WeightsTensorInfo* info = wf.find(model_name(g.name));
      ASSERT_NE(info, nullptr) << g.name;
      EXPECT_EQ(info->dtype, to_dtype(want.scalar_type())) << g.name;
      EXPECT_EQ(info->shape, want.sizes().vec()) << g.name;
      const int64_t rows = want.dim() == 0 ? 1 : want.size(0);
      for (int part = 0; part < 3; ++part) {
        auto [lo, hi] = part_range(rows, part, 3);
        Box box = full_box(want.sizes().vec());
        torch::Tensor expected = want;
        if (want.dim() > 0) {
          box.offsets[0] = lo;
          box.sizes[0] = hi - lo;
          expected = want.narrow(0, lo, hi - lo);
        } else if (part > 0) {
          continue;
        }
        torch::Tensor got = torch::empty(expected.sizes(), want.options());
        wf.read_box(info->name, box, static_cast<uint8_t*>(got.data_ptr()));
        EXPECT_TRUE(same_bits(got, expected, bf16)) << g.name << " part " << part;
      }
    }
    EXPECT_EQ(wf.tensors().size(), model_items);
  }

  static fs::path* root_;
  static std::string* ckpt_;
};

fs::path* InteropTest::root_ = nullptr;
std::string* InteropTest::ckpt_ = nullptr;

// ---------------------------------------------------------------- export + WeightsFile

TEST_F(InteropTest, SafetensorsExportReadsBackBitExactInAnySharding) {
  const std::string file = export_model(ExportFormat::kSafetensors, "model.safetensors");
  EXPECT_EQ(WeightsFile::open(file).format(), "safetensors");
  EXPECT_EQ(WeightsFile::open(file).metadata().at("format"), "pt");
  expect_model_tensors(file, false);
  EXPECT_FALSE(fs::exists(file + ".tmp"));
}

TEST_F(InteropTest, TorchExportReadsBackBitExactInAnySharding) {
  const std::string file = export_model(ExportFormat::kTorch, "model.pt");
  EXPECT_EQ(WeightsFile::open(file).format(), "torch");
  expect_model_tensors(file, false);
}

TEST_F(InteropTest, Bf16ExportRoundsLikeTorch) {
  expect_model_tensors(export_model(ExportFormat::kSafetensors, "bf16.safetensors", DType::kBFloat16), true);
  expect_model_tensors(export_model(ExportFormat::kTorch, "bf16.pt", DType::kBFloat16), true);
}

TEST_F(InteropTest, Fp32ExportWidensHalfTypesExactly) {
  const WeightsFile wf = WeightsFile::open(export_model(ExportFormat::kTorch, "fp32.pt", DType::kFloat32));
  for (const GlobalTensor& g : global_tensors()) {
    if (g.name.rfind("model.", 0) != 0) continue;
    torch::Tensor want = g.full.is_floating_point() ? g.full.to(torch::kFloat32) : g.full;
    torch::Tensor got = torch::empty(want.sizes(), want.options());
    wf.read_box(model_name(g.name), full_box(want.sizes().vec()), static_cast<uint8_t*>(got.data_ptr()));
    EXPECT_TRUE(same_bits(got, want)) << g.name;
  }
}

TEST_F(InteropTest, ExportWithoutOnlyKeepsFullNamesAndSkipsBytesItems) {
  ExportOptions options;
  const ExportStats stats = export_checkpoint(*ckpt_, out("all.safetensors"), options);
  EXPECT_EQ(stats.tensors, global_tensors().size());
  EXPECT_EQ(stats.skipped, std::vector<std::string>{"rng"});
  const WeightsFile wf = WeightsFile::open(out("all.safetensors"));
  EXPECT_NE(wf.find("model.w"), nullptr);
  EXPECT_NE(wf.find("optim.w.exp_avg"), nullptr);
  EXPECT_EQ(wf.find("rng"), nullptr);
}

TEST_F(InteropTest, ExportOfAnUncommittedDirectoryNamesIt) {
  fs::create_directories(out("step_9"));
  try {
    export_checkpoint(out("step_9"), out("x.safetensors"), ExportOptions{});
    FAIL() << "expected an error";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("step_9"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(out("x.safetensors")));
}

TEST(InteropConversion, Fp32ToBf16MatchesTorchOnManyValues) {
  torch::Tensor x = torch::cat({torch::randn({4096}) * 1e3, torch::randn({4096}) * 1e-38,
                                torch::tensor({std::nanf(""), -std::nanf("")})});
  torch::Tensor got = torch::empty({x.numel()}, torch::kBFloat16);
  convert_float_elements(DType::kFloat32, DType::kBFloat16, static_cast<const uint8_t*>(x.data_ptr()),
                         static_cast<uint64_t>(x.numel()), static_cast<uint8_t*>(got.data_ptr()));
  EXPECT_TRUE(same_bits(got, x.to(torch::kBFloat16), /*any_nan=*/true));
  const uint16_t* bits = static_cast<const uint16_t*>(got.data_ptr());
  EXPECT_EQ(bits[x.numel() - 1], 0x7FC0);  // canonical quiet NaN, as c10::BFloat16(float)
}

// ---------------------------------------------------------------- load_weights_into

TEST_F(InteropTest, LoadWeightsIntoFillsAThreeWaySplitFromEitherFormat) {
  for (const std::string& file : {export_model(ExportFormat::kSafetensors, "load.safetensors"),
                                  export_model(ExportFormat::kTorch, "load.pt")}) {
    for (int rank = 0; rank < 3; ++rank) {
      StateDict sd;
      std::map<std::string, torch::Tensor> expected;
      for (const GlobalTensor& g : global_tensors()) {
        if (g.name.rfind("model.", 0) != 0) continue;
        if (g.full.dim() == 0) {
          sd.add_tensor(g.name, torch::zeros_like(g.full));
          expected[g.name] = g.full;
          continue;
        }
        auto [lo, hi] = part_range(g.full.size(0), rank, 3);
        std::vector<int64_t> sizes = g.full.sizes().vec(), offsets(g.full.dim(), 0);
        sizes[0] = hi - lo;
        offsets[0] = lo;
        sd.add_tensor(g.name, torch::zeros(sizes, g.full.options()), g.full.sizes().vec(), offsets);
        expected[g.name] = g.full.narrow(0, lo, hi - lo);
      }
      sd.add_bytes("rng", {9});
      const ImportStats stats = load_weights_into(sd, file, "model.", false);
      EXPECT_EQ(stats.tensors, expected.size());
      EXPECT_TRUE(stats.converted.empty());
      for (const TensorEntry& t : sd.tensors()) {
        EXPECT_TRUE(same_bits(t.local, expected[t.name])) << file << " " << t.name << " rank " << rank;
      }
      EXPECT_EQ(sd.find_bytes("rng")->data, std::vector<uint8_t>{9});
    }
  }
}

TEST_F(InteropTest, LoadWeightsIntoConvertsFloatTypesAndSaysSo) {
  const std::string file = export_model(ExportFormat::kSafetensors, "conv.safetensors", DType::kBFloat16);
  StateDict sd;
  sd.add_tensor("model.w", torch::zeros({7, 5}));
  const ImportStats stats = load_weights_into(sd, file, "model.", true);
  EXPECT_EQ(stats.converted, std::vector<std::string>{"w"});
  EXPECT_TRUE(same_bits(sd.tensors()[0].local, global_tensors()[0].full.to(torch::kBFloat16).to(torch::kFloat32)));
}

TEST_F(InteropTest, LoadWeightsIntoListsEveryMismatchInOneMessage) {
  const std::string file = export_model(ExportFormat::kSafetensors, "mismatch.safetensors");
  StateDict sd;
  sd.add_tensor("model.w", torch::zeros({7, 6}));              // wrong shape
  sd.add_tensor("model.ids", torch::zeros({3}, torch::kInt32));  // wrong dtype
  sd.add_tensor("model.nope", torch::zeros({2}));                // missing
  const torch::Tensor before = sd.tensors()[0].local.clone();
  try {
    load_weights_into(sd, file, "model.", false);
    FAIL() << "expected an error";
  } catch (const FormatError& e) {
    const std::string m = e.what();
    for (const char* part : {"mismatch.safetensors", "missing: nope", "unexpected: b, cols",
                             "w has shape [7, 5] in the file, [7, 6] in the model",
                             "ids is int64 in the file, int32 in the model"}) {
      EXPECT_NE(m.find(part), std::string::npos) << part << "\n" << m;
    }
  }
  EXPECT_TRUE(same_bits(sd.tensors()[0].local, before));  // untouched
}

TEST_F(InteropTest, LoadWeightsIntoSuggestsOnlyModelForPrefixedNames) {
  export_checkpoint(*ckpt_, out("prefixed.safetensors"), ExportOptions{});
  StateDict sd;
  sd.add_tensor("model.w", torch::zeros({7, 5}));
  try {
    load_weights_into(sd, out("prefixed.safetensors"), "model.", false);
    FAIL() << "expected an error";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("--only model"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------- renamed tensors

// Names the test checkpoint's tensors as a Hugging Face mixture of experts
// does its stacked experts: w [7, 5] as 7 tensors experts.K.w [5], h (fp16
// [6, 2]) as 6 tensors experts.K.h [2], and b as router.b.
std::vector<RenamedTensor> moe_like_renames(int64_t w_parts = 7) {
  RenamedTensor w{"w", {}, true}, h{"h", {}, true};
  for (int64_t k = 0; k < w_parts; ++k) w.parts.push_back("experts." + std::to_string(k) + ".w");
  for (int64_t k = 0; k < 6; ++k) h.parts.push_back("experts." + std::to_string(k) + ".h");
  return {w, h, RenamedTensor{"b", {"router.b"}, false}};
}

class RenamingRunAdapter : public RunAdapter {
 public:
  explicit RenamingRunAdapter(std::vector<RenamedTensor> renames) : renames_(std::move(renames)) {}
  std::optional<std::string> hf_config_json(const ReadBytesItem&, const std::string&,
                                            const std::string& torch_dtype) const override {
    return "{\"model_type\": \"test\", \"torch_dtype\": \"" + torch_dtype + "\"}\n";
  }
  DcpParamGroup optimizer_param_group(const ReadBytesItem&, const std::string&,
                                      const DcpParamGroup& fallback) const override {
    return fallback;
  }
  std::string tokenizer(const ReadBytesItem&, const std::string&) const override { return ""; }
  std::vector<RenamedTensor> hf_renames(const std::string&, const std::string&) const override { return renames_; }

 private:
  std::vector<RenamedTensor> renames_;
};

ExportOptions renaming_hf_export(std::vector<RenamedTensor> renames) {
  ExportOptions options;
  options.format = ExportFormat::kHf;
  options.run = std::make_shared<RenamingRunAdapter>(std::move(renames));
  options.slab_bytes = 8;        // slabs within each expert's row
  options.max_shard_bytes = 48;  // the parts of one tensor in several files
  return options;
}

// Fills every model tensor of the test checkpoint into a 3-way dim-0 split
// from `file`, as rank `rank` of 3, and checks each rank read only its rows.
void expect_three_way_load(const WeightsFile& file) {
  for (int rank = 0; rank < 3; ++rank) {
    StateDict sd;
    std::map<std::string, torch::Tensor> expected;
    uint64_t bytes = 0;
    for (const GlobalTensor& g : global_tensors()) {
      if (g.name.rfind("model.", 0) != 0) continue;
      torch::Tensor want = g.full;
      if (want.dim() == 0) {
        sd.add_tensor(g.name, torch::zeros_like(want));
      } else {
        auto [lo, hi] = part_range(want.size(0), rank, 3);
        std::vector<int64_t> sizes = want.sizes().vec(), offsets(want.dim(), 0);
        sizes[0] = hi - lo;
        offsets[0] = lo;
        sd.add_tensor(g.name, torch::zeros(sizes, want.options()), want.sizes().vec(), offsets);
        want = want.narrow(0, lo, hi - lo);
      }
      expected[g.name] = want;
      bytes += want.nbytes();
    }
    const ImportStats stats = load_weights_into(sd, file, "model.", false);
    EXPECT_EQ(stats.tensors, expected.size());
    EXPECT_EQ(stats.bytes_read, bytes) << "rank " << rank;
    for (const TensorEntry& t : sd.tensors()) {
      EXPECT_TRUE(same_bits(t.local, expected[t.name])) << t.name << " rank " << rank;
    }
  }
}

TEST_F(InteropTest, HfExportSplitsStackedItemsAndRenamedStacksThemBackInAnySharding) {
  export_checkpoint(*ckpt_, out("hf_split"), renaming_hf_export(moe_like_renames()));
  const WeightsFile raw = WeightsFile::open(out("hf_split"));
  ASSERT_EQ(raw.format(), "hf");
  EXPECT_TRUE(fs::exists(out("hf_split") + "/model.safetensors.index.json"));
  EXPECT_EQ(raw.find("w"), nullptr);
  EXPECT_EQ(raw.find("b"), nullptr);
  const torch::Tensor w = global_tensors()[0].full;
  for (int64_t k = 0; k < 7; ++k) {
    const WeightsTensorInfo* info = raw.find("experts." + std::to_string(k) + ".w");
    ASSERT_NE(info, nullptr) << k;
    EXPECT_EQ(info->shape, std::vector<int64_t>{5});
    torch::Tensor got = torch::empty({5});
    raw.read_box(info->name, full_box(info->shape), static_cast<uint8_t*>(got.data_ptr()));
    EXPECT_TRUE(same_bits(got, w[k])) << k;
  }
  ASSERT_NE(raw.find("experts.5.h"), nullptr);
  EXPECT_EQ(raw.find("experts.5.h")->dtype, DType::kFloat16);
  ASSERT_NE(raw.find("router.b"), nullptr);
  EXPECT_EQ(raw.find("router.b")->shape, std::vector<int64_t>{9});

  // Under our names again: every tensor, read in any split, a rank reading
  // only the bytes of its own rows (its experts).
  const WeightsFile ours = raw.renamed(moe_like_renames());
  EXPECT_EQ(ours.find("experts.0.w"), nullptr);
  ASSERT_NE(ours.find("w"), nullptr);
  EXPECT_EQ(ours.find("w")->shape, (std::vector<int64_t>{7, 5}));
  EXPECT_EQ(ours.find("h")->shape, (std::vector<int64_t>{6, 2}));
  expect_three_way_load(ours);

  // ckpt import-hf with the same renames: our names, and an export gives
  // the Hugging Face tensors back.
  HfImportOptions import;
  import.renames = moe_like_renames();
  import_hf_checkpoint(out("hf_split"), out("hf_split_imported"), import);
  const CheckpointMeta meta = read_committed_metadata(*posix_storage(), out("hf_split_imported"));
  ASSERT_NE(meta.find("model.w"), nullptr);
  EXPECT_EQ(meta.find("model.w")->global_shape, (std::vector<int64_t>{7, 5}));
  EXPECT_EQ(meta.find("model.experts.0.w"), nullptr);
  ExportOptions back = renaming_hf_export(moe_like_renames());
  back.dtype = DType::kFloat32;
  export_checkpoint(out("hf_split_imported"), out("hf_split_back"), back);
  const WeightsFile again = WeightsFile::open(out("hf_split_back"));
  ASSERT_NE(again.find("experts.6.w"), nullptr);
  torch::Tensor got = torch::empty({5});
  again.read_box("experts.6.w", full_box({5}), static_cast<uint8_t*>(got.data_ptr()));
  EXPECT_TRUE(same_bits(got, w[6]));
}

TEST_F(InteropTest, HfExportRefusesASplitWhoseRowsAreNotItsParts) {
  try {
    export_checkpoint(*ckpt_, out("hf_bad_split"), renaming_hf_export(moe_like_renames(3)));
    FAIL() << "expected a refusal";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("item model.w has shape [7, 5], not 3 rows"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(out("hf_bad_split")));
}

TEST_F(InteropTest, RenamedRefusesPartsThatAreMissingOrDoNotStack) {
  const WeightsFile f = WeightsFile::open(export_model(ExportFormat::kSafetensors, "stack.safetensors"));
  auto refusal = [&](const std::vector<RenamedTensor>& renames) -> std::string {
    try {
      f.renamed(renames);
    } catch (const FormatError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(refusal({{"x", {"w", "cols"}, true}}).find("they cannot stack into our 'x'"), std::string::npos);
  EXPECT_NE(refusal({{"x", {"w", "w.1", "w.2"}, true}}).find("has 'w' but not 'w.1' and 1 more"), std::string::npos)
      << refusal({{"x", {"w", "w.1", "w.2"}, true}});
  // None of the parts here, or ours here already: nothing changes.
  EXPECT_EQ(f.renamed({{"x", {"y", "z"}, true}}).tensors().size(), f.tensors().size());
  const WeightsFile kept = f.renamed({{"w", {"cols"}, false}});
  EXPECT_EQ(kept.find("w")->shape, (std::vector<int64_t>{7, 5}));
  EXPECT_NE(kept.find("cols"), nullptr);
  // One file's tensor as the one row of a stack.
  const WeightsFile one = f.renamed({{"stacked_w", {"w"}, true}});
  ASSERT_NE(one.find("stacked_w"), nullptr);
  EXPECT_EQ(one.find("w"), nullptr);
  torch::Tensor got = torch::empty({1, 3, 5});
  one.read_box("stacked_w", Box{{0, 2, 0}, {1, 3, 5}}, static_cast<uint8_t*>(got.data_ptr()));
  EXPECT_TRUE(same_bits(got, global_tensors()[0].full.narrow(0, 2, 3).unsqueeze(0)));
}

// ---------------------------------------------------------------- ckpt export

TEST_F(InteropTest, CkptExportWritesTheSameFileAsTheLibrary) {
  const std::string ckpt = testing_support::binary_dir() + "/ckpt";
  for (const char* format : {"safetensors", "torch"}) {
    const std::string cli = out(std::string("cli.") + format);
    ASSERT_EQ(run_command(ckpt + " export " + *ckpt_ + " --format " + format + " --out " + cli +
                          " --only model --dtype bf16 > " + out("cli.log") + " 2>&1"),
              0)
        << read_bytes(out("cli.log"));
    EXPECT_NE(read_bytes(out("cli.log")).find("exported 9 tensors"), std::string::npos)
        << read_bytes(out("cli.log"));
    const std::string lib = export_model(std::string(format) == "torch" ? ExportFormat::kTorch
                                                                         : ExportFormat::kSafetensors,
                                         std::string("lib.") + format, DType::kBFloat16);
    EXPECT_EQ(read_bytes(cli), read_bytes(lib)) << format;
  }
}

TEST_F(InteropTest, CkptExportExitCodes) {
  const std::string ckpt = testing_support::binary_dir() + "/ckpt";
  const std::string log = " > " + out("codes.log") + " 2>&1";
  EXPECT_EQ(run_command(ckpt + " export " + out("nowhere") + " --format torch --out " + out("n.pt") + log), 1);
  EXPECT_NE(read_bytes(out("codes.log")).find("nowhere"), std::string::npos) << read_bytes(out("codes.log"));
  EXPECT_EQ(run_command(ckpt + " export " + *ckpt_ + " --out " + out("n.pt") + log), 2);
  EXPECT_EQ(run_command(ckpt + " export " + *ckpt_ + " --format xml --out " + out("n.pt") + log), 2);
  EXPECT_EQ(run_command(ckpt + " export " + *ckpt_ + " --format torch --dtype f8 --out " + out("n.pt") + log), 2);
  EXPECT_EQ(run_command(ckpt + " export " + *ckpt_ + " --format torch --only nothing --out " + out("n.pt") + log), 1);
  EXPECT_NE(read_bytes(out("codes.log")).find("nothing to export"), std::string::npos);
  EXPECT_FALSE(fs::exists(out("n.pt")));
}

// ---------------------------------------------------------------- hostile files

// The message of the error WeightsFile::open throws for `bytes`; "" if none.
std::string open_error(const fs::path& path, const std::string& bytes) {
  write_bytes(path, bytes);
  try {
    WeightsFile::open(path.string());
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  return out + header + data;
}

TEST_F(InteropTest, HostileSafetensorsGiveCleanErrors) {
  const fs::path p = *root_ / "hostile.safetensors";
  const std::string f32x2 = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_EQ(open_error(p, safetensors_bytes(f32x2, std::string(8, '\0'))), "");
  const std::map<std::string, std::pair<std::string, std::string>> cases = {
      {"header length", {std::string(8, '\xff') + "{}", ""}},
      {"exceeds the file", {"\x40\0\0\0\0\0\0\0{}"s, ""}},
      {"bad safetensors JSON header", {safetensors_bytes(R"({"a": )", ""), ""}},
      {"nested too deeply", {safetensors_bytes(std::string(100, '[') + std::string(100, ']'), ""), ""}},
      {"tensor 'a': unsupported dtype \"F8_E4M3\"",
       {safetensors_bytes(R"({"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", "xx"), ""}},
      {"outside the data section", {safetensors_bytes(f32x2, std::string(4, '\0')), ""}},
      {"needs 8", {safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})",
                                     std::string(8, '\0')), ""}},
      {"overlap",
       {safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                          std::string(12, '\0')), ""}},
      {"\"shape\" holds -1", {safetensors_bytes(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,0]}})", ""), ""}},
  };
  for (const auto& [needle, input] : cases) {
    const std::string message = open_error(p, input.first);
    EXPECT_NE(message.find(needle), std::string::npos) << needle << ": " << message;
    EXPECT_NE(message.find(p.string()), std::string::npos) << message;
  }
}

// A torch.save-like zip holding `pickle` as archive/data.pkl and `storages`
// as archive/data/<key>.
std::string torch_zip_bytes(const fs::path& path, const std::string& pickle,
                            const std::map<std::string, std::string>& storages = {}) {
  auto storage = posix_storage();
  {
    auto file = storage->create_file(path.string());
    ZipWriter zip(*file);
    auto put = [&](const std::string& name, const std::string& bytes) {
      zip.begin_member(name, bytes.size());
      zip.write(bytes.data(), bytes.size());
      zip.end_member();
    };
    put("archive/data.pkl", pickle);
    for (const auto& [key, bytes] : storages) put("archive/data/" + key, bytes);
    zip.finish();
    file->close();
  }
  return read_bytes(path);
}

std::string pickle_of(const std::vector<PickledTensor>& tensors) {
  const std::vector<uint8_t> bytes = write_tensor_dict_pickle(tensors);
  return std::string(bytes.begin(), bytes.end());
}

TEST_F(InteropTest, HostilePicklesGiveCleanErrors) {
  const fs::path p = *root_ / "hostile.pt";
  PickledTensor t;
  t.name = "x";
  t.shape = {2};
  t.storage_key = "0";
  t.storage_numel = 2;
  ASSERT_EQ(open_error(p, torch_zip_bytes(p, pickle_of({t}), {{"0", std::string(8, '\0')}})), "");
  const std::string os_system = "\x80\x02" "cos\nsystem\n" "X\x02\x00\x00\x00" "ls\x85R."s;
  const std::map<std::string, std::string> cases = {
      {"unsupported pickle opcode 0x5d (EMPTY_LIST)", "\x80\x02]."s},
      {"pickle global 'os.system' is not allowed", os_system},
      {"not a dict of tensors", "\x80\x02K\x05."s},
      {"pickle truncated", "\x80\x02}(X\x05\x00\x00\x00" "ab"s},
      {"pickle ends without STOP", "\x80\x02}"s},
      {"memo key 7 not set", "\x80\x02h\x07."s},
  };
  for (const auto& [needle, pickle] : cases) {
    const std::string message = open_error(p, torch_zip_bytes(p, pickle));
    EXPECT_NE(message.find(needle), std::string::npos) << needle << ": " << message;
    EXPECT_NE(message.find("data.pkl"), std::string::npos) << message;
  }
  // Storage members that are missing or of the wrong size.
  EXPECT_NE(open_error(p, torch_zip_bytes(p, pickle_of({t}))).find("storage member 'archive/data/0' is missing"),
            std::string::npos);
  EXPECT_NE(open_error(p, torch_zip_bytes(p, pickle_of({t}), {{"0", "abc"}})).find("has 3 bytes"),
            std::string::npos);
  // A compressed member (method 8 in the central directory).
  std::string zip = torch_zip_bytes(p, pickle_of({t}), {{"0", std::string(8, '\0')}});
  const size_t central = zip.find("PK\x01\x02");
  ASSERT_NE(central, std::string::npos);
  zip[central + 10] = 8;
  EXPECT_NE(open_error(p, zip).find("'archive/data.pkl' of " + p.string() + " is compressed"), std::string::npos)
      << open_error(p, zip);
  // Truncated archives.
  zip = torch_zip_bytes(p, pickle_of({t}), {{"0", std::string(8, '\0')}});
  EXPECT_NE(open_error(p, zip.substr(0, zip.size() - 30)).find("malformed zip archive"), std::string::npos);
}

TEST(InteropPickle, WriterMatchesWhatTheReaderAccepts) {
  std::vector<PickledTensor> in(3);
  in[0] = {"big", DType::kInt8, {int64_t{1} << 33}, {}, 0, "0", uint64_t{1} << 33};
  in[1] = {"scalar", DType::kBFloat16, {}, {}, 0, "1", 1};
  in[2] = {"four_d", DType::kBool, {2, 0, 3, 4}, {}, 0, "2", 0};
  const std::string bytes = pickle_of(in);
  const std::vector<PickledTensor> out =
      parse_tensor_dict_pickle(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "mem");
  ASSERT_EQ(out.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(out[i].name, in[i].name);
    EXPECT_EQ(out[i].dtype, in[i].dtype);
    EXPECT_EQ(out[i].shape, in[i].shape);
    EXPECT_EQ(out[i].storage_numel, in[i].storage_numel);
    EXPECT_EQ(out[i].stride, contiguous_strides(in[i].shape));
  }
}

TEST(InteropZip, Crc32MatchesTheStandardCheckValue) {
  EXPECT_EQ(crc32_update(0, "123456789", 9), 0xCBF43926u);
  EXPECT_EQ(crc32_update(crc32_update(0, "1234", 4), "56789", 5), 0xCBF43926u);
}

// ---------------------------------------------------------------- Python

// A python3 that can import torch, or "" (the test then skips, saying so).
std::string python_with_torch() { return testing_support::python_with("torch"); }

const char* kNoPython =
    "no python3 with torch (tried $SHARDKIT_PYTHON, /usr/bin/python3, python3): "
    "apt-get install python3-torch to run the Python interop checks";

std::string python_script() { return testing_support::source_dir() + "/tests/tools/test_export_python.py"; }

TEST_F(InteropTest, PythonTorchLoadsTheExportsWithWeightsOnly) {
  const std::string python = python_with_torch();
  if (python.empty()) SHARDKIT_SKIP(kNoPython);
  // The expected tensors, as raw bytes the script compares against.
  const fs::path expected = *root_ / "expected";
  fs::create_directories(expected);
  nlohmann::json manifest;
  int i = 0;
  for (const GlobalTensor& g : global_tensors()) {
    if (g.name.rfind("model.", 0) != 0) continue;
    const torch::Tensor c = g.full.contiguous();
    const std::string file = std::to_string(i++) + ".bin";
    write_bytes(expected / file, std::string(static_cast<const char*>(c.data_ptr()), c.nbytes()));
    manifest[model_name(g.name)] = {{"dtype", safetensors_dtype_name(to_dtype(c.scalar_type()))},
                                    {"shape", c.sizes().vec()},
                                    {"file", file}};
  }
  write_bytes(expected / "manifest.json", manifest.dump());
  const std::string specs =
      " torch:" + export_model(ExportFormat::kTorch, "py.pt") +
      " safetensors:" + export_model(ExportFormat::kSafetensors, "py.safetensors") +
      " torch-bf16:" + export_model(ExportFormat::kTorch, "py16.pt", DType::kBFloat16) +
      " safetensors-bf16:" + export_model(ExportFormat::kSafetensors, "py16.safetensors", DType::kBFloat16);
  const std::string log = out("python_check.log");
  const int rc = run_command(python + " " + python_script() + " check-export " + expected.string() + specs +
                             " > " + log + " 2>&1");
  EXPECT_EQ(rc, 0) << read_bytes(log);
}

TEST_F(InteropTest, PythonTorchSaveFilesImport) {
  const std::string python = python_with_torch();
  if (python.empty()) SHARDKIT_SKIP(kNoPython);
  const fs::path dir = *root_ / "from_python";
  const std::string log = out("python_write.log");
  ASSERT_EQ(run_command(python + " " + python_script() + " write-torch-saves " + dir.string() + " > " + log +
                        " 2>&1"),
            0)
      << read_bytes(log);

  for (const char* name : {"plain.pt", "ordered.pt", "single.pt", "params.pt"}) {
    SCOPED_TRACE(name);
    const WeightsFile wf = WeightsFile::open((dir / name).string());
    EXPECT_EQ(wf.format(), "torch");
    const fs::path expected = dir / "expected" / name;
    const nlohmann::json manifest = nlohmann::json::parse(read_bytes(expected / "manifest.json"));
    EXPECT_EQ(wf.tensors().size(), manifest.size());
    for (const auto& [tensor, entry] : manifest.items()) {
      const WeightsTensorInfo* info = wf.find(tensor);
      ASSERT_NE(info, nullptr) << tensor;
      EXPECT_EQ(safetensors_dtype_name(info->dtype), entry["dtype"].get<std::string>()) << tensor;
      EXPECT_EQ(info->shape, entry["shape"].get<std::vector<int64_t>>()) << tensor;
      std::string got(info->nbytes, '\0');
      wf.read_box(tensor, full_box(info->shape), reinterpret_cast<uint8_t*>(got.data()));
      EXPECT_EQ(got, read_bytes(expected / entry["file"].get<std::string>())) << tensor;
    }
  }

  // A module's state_dict() into a 3-way split of its weight.
  const fs::path ordered = dir / "expected" / "ordered.pt";
  const nlohmann::json manifest = nlohmann::json::parse(read_bytes(ordered / "manifest.json"));
  const std::string w_bytes = read_bytes(ordered / manifest["0.weight"]["file"].get<std::string>());
  const torch::Tensor w = torch::from_blob(const_cast<char*>(w_bytes.data()), {3, 4}).clone();
  for (int rank = 0; rank < 3; ++rank) {
    StateDict sd;
    sd.add_tensor("model.0.weight", torch::zeros({1, 4}), {3, 4}, {rank, 0});
    for (const char* n : {"0.bias", "1.weight", "1.bias"}) sd.add_tensor(std::string("model.") + n, torch::zeros({3}));
    load_weights_into(sd, (dir / "ordered.pt").string(), "model.", false);
    EXPECT_TRUE(same_bits(sd.tensors()[0].local, w.narrow(0, rank, 1))) << rank;
  }

  try {
    WeightsFile::open((dir / "noncontig.pt").string());
    FAIL() << "a transposed tensor must be refused";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 't' is not contiguous"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace checkpoint
