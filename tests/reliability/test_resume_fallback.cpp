// Resume past a damaged newest checkpoint: with resume auto and
// checkpoint.resume_fallback (the default), a newest checkpoint whose data
// file is truncated or whose metadata has a flipped bit is set aside as
// step_<N>.damaged, named loudly (stderr and metrics.jsonl), and the run
// resumes from the next older one; with resume_fallback false it fails
// naming the file and changes nothing.
#include <fstream>

#include "reliability/test_util.h"

namespace reliability {
namespace {

// Saves steps 2, 4 and 6 (sync), then damages step_6's `file`.
TrainSpec damaged_run(const std::string& name, const std::string& file, bool truncate) {
  const fs::path root = fresh_dir("resume_fallback_" + name);
  auto first = small_run(root, {"train.steps=6", "checkpoint.interval=2", "checkpoint.keep_last=0",
                                "checkpoint.mode=sync"});
  RunResult r = run_train(first, root / "first.log");
  EXPECT_EQ(r.exit_code, 0) << tail(r.output);
  EXPECT_EQ(committed_steps(first.ckpt_dir), (std::vector<int64_t>{2, 4, 6}));
  const fs::path target = first.ckpt_dir / "step_6" / file;
  std::string bytes = read_text_file(target.string());
  if (truncate) {
    bytes.resize(bytes.size() / 2);
  } else {
    bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x5a);
  }
  std::ofstream(target, std::ios::binary | std::ios::trunc) << bytes;
  auto again = first;
  again.sets = {"train.steps=8", "checkpoint.interval=0", "checkpoint.mode=sync"};
  return again;
}

struct FallbackCase {
  const char* name;
  const char* file;
  bool truncate;
};

void PrintTo(const FallbackCase& c, std::ostream* os) { *os << c.name; }

class ResumeFallback : public ::testing::TestWithParam<FallbackCase> {};

TEST_P(ResumeFallback, SetsTheDamagedNewestAsideAndResumesFromTheOlderOne) {
  const FallbackCase& c = GetParam();
  TrainSpec spec = damaged_run(std::string(c.name) + "_on", c.file, c.truncate);
  RunResult r = run_train(spec, spec.run_dir.parent_path() / "resume.log");
  EXPECT_EQ(r.exit_code, 0) << tail(r.output);
  const std::string step6 = (spec.ckpt_dir / "step_6").string();
  EXPECT_TRUE(contains(r.output, "checkpoint " + step6 + " failed to load and was skipped (moved to " +
                                     step6 + ".damaged)"))
      << tail(r.output);
  EXPECT_TRUE(contains(r.output, c.file)) << "the reason names the file: " << tail(r.output);
  EXPECT_TRUE(contains(r.output, "resumed from " + (spec.ckpt_dir / "step_4").string()))
      << tail(r.output);
  EXPECT_FALSE(contains(r.output, "frame #")) << tail(r.output);
  EXPECT_TRUE(fs::exists(step6 + ".damaged/" + c.file));  // set aside, not deleted
  EXPECT_EQ(committed_steps(spec.ckpt_dir), (std::vector<int64_t>{2, 4}));
  const std::string metrics = read_text_file((spec.run_dir / "metrics.jsonl").string());
  EXPECT_TRUE(contains(metrics, "\"event\":\"resume_skipped\"")) << metrics;
  const auto losses = read_losses(spec.run_dir / "metrics.jsonl");
  EXPECT_EQ(losses.rbegin()->first, 8);
  EXPECT_TRUE(losses.count(5)) << "training continued after step 4";
}

TEST_P(ResumeFallback, WithoutFallbackTheRunFailsNamingTheFileAndKeepsEverything) {
  const FallbackCase& c = GetParam();
  TrainSpec spec = damaged_run(std::string(c.name) + "_off", c.file, c.truncate);
  spec.sets.push_back("checkpoint.resume_fallback=false");
  RunResult r = run_train(spec, spec.run_dir.parent_path() / "resume.log");
  EXPECT_NE(r.exit_code, 0) << tail(r.output);
  EXPECT_TRUE(contains(r.output, c.file)) << tail(r.output);
  EXPECT_FALSE(contains(r.output, "resumed from")) << tail(r.output);
  EXPECT_TRUE(fs::exists(spec.ckpt_dir / "step_6" / c.file));
  EXPECT_FALSE(fs::exists(spec.ckpt_dir / "step_6.damaged"));
}

// A changed model is refused before loading (test_run_safety.cpp); forced
// with checkpoint.allow_config_change, its load fails and sets nothing aside.

INSTANTIATE_TEST_SUITE_P(Damage, ResumeFallback,
                         ::testing::Values(FallbackCase{"TruncatedData", "rank_0.data", true},
                                           FallbackCase{"FlippedMetadata", ".metadata", false}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace reliability
