// A peer that stops responding (SHARDKIT_STALL_AT) in a training collective
// or in a save, in every checkpoint mode: with dist.timeout_s 3 the other
// rank fails within a bound, naming the collective and its group, and the
// launcher ends the job. Never an unbounded hang: every run has a hard
// deadline.
#include <thread>

#include "reliability/test_util.h"

namespace reliability {
namespace {

constexpr double kTimeoutS = 3;
// The launcher's grace between SIGTERM and SIGKILL (dist.stop_grace_s; 10 s
// by default): the stalled rank cannot act on SIGTERM, so each case waits
// it out.
constexpr double kGraceS = 1;
// Detection (3 timeouts at most) plus the launcher's kill grace plus slack.
constexpr double kBoundS = 3 * kTimeoutS + kGraceS + 15;

struct StallCase {
  const char* name;
  const char* stall_at;
  const char* mode;
  const char* group;  // the group the failure must name
};

const StallCase kCases[] = {
    {"TrainAllReduceSync", "train:5:1", "sync", "'train'"},
    {"TrainAllReduceAsync", "train:5:1", "async", "'train'"},
    {"SaveSync", "save:4:1", "sync", "'ckpt'"},
    {"SaveAsync", "save:4:1", "async", "'ckpt'"},
    {"SaveOverlap", "save:4:1", "overlap", "'ckpt'"},
};

// Names the case in test listings (ctest shows it).
void PrintTo(const StallCase& c, std::ostream* os) { *os << c.name; }

class HungPeer : public ::testing::TestWithParam<StallCase> {};

TEST_P(HungPeer, OtherRankFailsWithinBoundNamingTheCollective) {
  const StallCase& c = GetParam();
  const fs::path root = fresh_dir(std::string("hung_") + c.name);
  auto spec = small_run(root, {std::string("checkpoint.mode=") + c.mode, "dist.timeout_s=3",
                               "dist.stop_grace_s=" + std::to_string(kGraceS)},
                        {{"SHARDKIT_STALL_AT", c.stall_at}});
  const fs::path log = root / "train.log";
  Process p(train_argv(spec), spec.env, log.string());
  double stalled_at = -1;
  const double hard_deadline = monotonic_s() + 240;
  while (!p.poll() && monotonic_s() < hard_deadline) {
    if (stalled_at < 0 && contains(read_text_file(log.string()), "stops responding")) stalled_at = monotonic_s();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  bool timed_out = false;
  const int status = p.wait_for(1, &timed_out);
  const double ended = monotonic_s();
  const std::string out = read_text_file(log.string());
  ASSERT_FALSE(timed_out) << "hung for 240 s: " << tail(out);
  ASSERT_GE(stalled_at, 0) << "the stall never happened: " << tail(out);
  const double took = ended - stalled_at;
  std::cout << c.name << ": job ended " << took << " s after the stall, exit " << status << std::endl;
  EXPECT_NE(status, 0) << tail(out);
  EXPECT_LT(took, kBoundS) << tail(out);
  EXPECT_TRUE(contains(out, c.group)) << tail(out);
  const bool names_op = contains(out, "all_reduce") || contains(out, "all_gather") ||
                        contains(out, "broadcast") || contains(out, "barrier") || contains(out, "gather");
  EXPECT_TRUE(names_op) << tail(out);
  EXPECT_TRUE(contains(out, "rank 0")) << "the surviving rank's failure is reported: " << tail(out);
  // Whatever is committed is intact.
  for (const auto& ck : committed_checkpoints(spec.ckpt_dir)) EXPECT_EQ(verify_problems(ck.path), "");
}

INSTANTIATE_TEST_SUITE_P(Stalls, HungPeer, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace reliability
