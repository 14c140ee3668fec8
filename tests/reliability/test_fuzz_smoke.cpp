// A bounded libFuzzer run of each fuzz target (fuzz/): configures and builds
// the torch-free fuzz build with clang in <build>/fuzz-ci (incrementally),
// then runs each target for 1 s from the committed seed corpus. Skips, with
// the reason, when clang++ or its libFuzzer runtime is missing. scripts/fuzz
// runs longer.
#include <cstdlib>
#include <fstream>
#include <regex>

#include "reliability/test_util.h"
#include "support/paths.h"

namespace reliability {
namespace {

// 1 s each: every input of the seed corpus runs first, however short the
// run; then the mutations. Fuzzing proper is scripts/fuzz's (600 s each).
// Uncached, the build takes most of the test's time (402 s of 545 s in a
// fresh clone on 2 cores, beside the Debian 13 leg's build; its limit is
// 900 s, tests/reliability/CMakeLists.txt).
constexpr int kSecondsPerTarget = 1;
// Every target of fuzz/CMakeLists.txt (SHARDKIT_FUZZ_TARGETS), each with its
// seed corpus in fuzz/corpus/<target>.
const std::vector<std::string> kTargets = {"fuzz_metadata",    "fuzz_block_decoder", "fuzz_dcp_metadata",
                                           "fuzz_torch_pickle", "fuzz_zip",           "fuzz_safetensors",
                                           "fuzz_hf_config",   "fuzz_tokenizer_json", "fuzz_local_tier",
                                           "fuzz_token_shard", "fuzz_sft_jsonl"};

std::string which(const std::string& program) {
  RunResult r = run_process({"/bin/sh", "-c", "command -v " + program}, {}, 30,
                            (fresh_dir("fuzz_which") / "out.txt").string());
  std::string path = r.output.substr(0, r.output.find('\n'));
  return r.exit_code == 0 ? path : "";
}

TEST(FuzzSmoke, EachTargetRunsCleanFromTheSeedCorpus) {
  const std::string clang = which("clang++");
  if (clang.empty()) SHARDKIT_SKIP("clang++ not found: the fuzz build needs clang (Debian: clang)");
  const fs::path work = fresh_dir("fuzz_probe");
  std::ofstream(work / "probe.cpp") << "#include <cstdint>\n#include <cstddef>\n"
                                       "extern \"C\" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n";
  RunResult probe = run_process({clang, "-fsanitize=fuzzer,address", (work / "probe.cpp").string(), "-o",
                                 (work / "probe").string()},
                                {}, 120, (work / "probe.log").string());
  if (probe.exit_code != 0) {
    SHARDKIT_SKIP("clang++ -fsanitize=fuzzer does not link (Debian: libclang-rt-14-dev): "
                  << tail(probe.output, 500));
  }
  const fs::path build = fs::path(testing_support::binary_dir()) / "fuzz-ci";
  const std::string src = testing_support::source_dir();
  RunResult conf = run_process({"/usr/bin/env", "cmake", "-S", src, "-B", build.string(), "-G", "Ninja",
                                "-DSHARDKIT_WITH_TORCH=OFF", "-DSHARDKIT_FUZZ=ON", "-DSHARDKIT_BUILD_TESTS=OFF",
                                "-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DCMAKE_CXX_COMPILER=" + clang},
                               {}, 300, (work / "configure.log").string());
  ASSERT_EQ(conf.exit_code, 0) << tail(conf.output);
  std::vector<std::string> make_cmd = {"/usr/bin/env", "cmake", "--build", build.string(), "-j2", "--target"};
  make_cmd.insert(make_cmd.end(), kTargets.begin(), kTargets.end());
  RunResult make = run_process(make_cmd, {}, 1200, (work / "build.log").string());
  ASSERT_EQ(make.exit_code, 0) << tail(make.output);
  for (const std::string& target : kTargets) {
    ASSERT_TRUE(fs::is_directory(src + "/fuzz/corpus/" + target)) << "no seed corpus fuzz/corpus/" << target;
    const fs::path corpus = work / ("corpus_" + target);
    fs::create_directories(corpus);
    RunResult r = run_process({(build / target).string(), "-max_total_time=" + std::to_string(kSecondsPerTarget),
                               "-print_final_stats=1", "-rss_limit_mb=2048", "-timeout=10", corpus.string(),
                               src + "/fuzz/corpus/" + target},
                              {}, kSecondsPerTarget + 120, (work / (target + ".log")).string());
    std::smatch m;
    static const std::regex execs("stat::number_of_executed_units: ([0-9]+)");
    const std::string n = std::regex_search(r.output, m, execs) ? m[1].str() : "?";
    std::cout << target << ": " << n << " executions in " << kSecondsPerTarget << " s, exit "
              << r.exit_code << std::endl;
    EXPECT_EQ(r.exit_code, 0) << tail(r.output, 4000);
    EXPECT_FALSE(contains(r.output, "ERROR: AddressSanitizer")) << tail(r.output, 4000);
    EXPECT_FALSE(contains(r.output, "runtime error:")) << tail(r.output, 4000);
  }
}

}  // namespace
}  // namespace reliability
