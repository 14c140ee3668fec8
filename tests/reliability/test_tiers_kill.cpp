// Multi-level checkpoints as a user runs them: `train --nproc 4 --nodes 2`
// (two simulated nodes of two ranks, each with its own local tier), killed
// with SIGKILL after a local commit and before its flush, or with a partner
// that stops responding; the next run resumes from the local tier and its
// losses equal an uninterrupted run's bit for bit.
#include "reliability/test_util.h"

namespace reliability {
namespace {

bool exists(const fs::path& p) { return fs::exists(p); }

// The small model on 2 nodes x 2 ranks, local tier under `root`/local.
TrainSpec tier_run(const fs::path& root, const std::string& run, std::vector<std::string> extra,
                   EnvVars env = {}) {
  std::vector<std::string> sets = {
      "train.steps=12", "checkpoint.interval=2", "checkpoint.mode=async",
      "checkpoint.keep_last=0", "checkpoint.local.keep_last=0", "checkpoint.durable.every=1",
      "checkpoint.local.dir=\"" + (root / "local" / "node{node}").string() + "\""};
  sets.insert(sets.end(), extra.begin(), extra.end());
  TrainSpec spec = small_run(root, sets, std::move(env));
  spec.run_dir = root / run;
  spec.nproc = 4;
  spec.nodes = 2;
  return spec;
}

std::string node_dir(const fs::path& root, int node) {
  return (root / "local" / ("node" + std::to_string(node))).string();
}

TEST(TiersKill, KilledAfterTheLocalCommitBeforeTheFlushResumesFromTheLocalTier) {
  const fs::path root = fresh_dir("tiers_kill");
  const fs::path ref_root = fresh_dir("tiers_kill_ref");
  const TrainSpec ref = tier_run(ref_root, "run", {});
  RunResult r = run_train(ref, ref_root / "ref.log");
  ASSERT_EQ(r.exit_code, 0) << tail(r.output);
  const auto reference = read_losses(ref.run_dir / "metrics.jsonl");
  ASSERT_EQ(reference.size(), 12u);

  // Every rank dies after step 6's local commit (and partner copies),
  // before its flush.
  TrainSpec killed = tier_run(root, "run", {}, {{"SHARDKIT_KILL_AT", "flush:6"}});
  r = run_train(killed, root / "killed.log");
  EXPECT_NE(r.exit_code, 0) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "SHARDKIT_KILL_AT=flush:6")) << tail(r.output);
  EXPECT_EQ(committed_steps(killed.ckpt_dir), (std::vector<int64_t>{2, 4}));
  for (int n = 0; n < 2; ++n) {
    EXPECT_EQ(committed_steps(node_dir(root, n)), (std::vector<int64_t>{2, 4, 6})) << n;
    EXPECT_TRUE(exists(node_dir(root, n) + "/step_6/.partner.json")) << n;
  }

  // The same command resumes from the local step 6, flushes what it saves.
  TrainSpec again = tier_run(root, "run", {});
  r = run_train(again, root / "resumed.log");
  ASSERT_EQ(r.exit_code, 0) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "resumed from " + node_dir(root, 0) + "/step_6")) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "resume tier: local (every rank file is on its own node)"))
      << tail(r.output);
  EXPECT_EQ(compare_losses(read_losses(again.run_dir / "metrics.jsonl"), reference, 6), "");
  EXPECT_EQ(committed_steps(again.ckpt_dir), (std::vector<int64_t>{2, 4, 8, 10, 12}));
  EXPECT_EQ(verify_problems(again.ckpt_dir / "step_12"), "");
  fs::remove_all(root);
  fs::remove_all(ref_root);
}

TEST(TiersKill, APartnerThatStopsRespondingFailsTheSaveAndClaimsNoPartnerCopy) {
  const fs::path root = fresh_dir("tiers_partner_down");
  // Rank 3 (node 1) hangs before its partner copy of step 4.
  // A grace of 1 s: the hung rank cannot act on SIGTERM (10 s by default).
  TrainSpec hung = tier_run(root, "run", {"dist.timeout_s=3", "dist.stop_grace_s=1"},
                            {{"SHARDKIT_STALL_AT", "partner:4:3"}});
  RunResult r = run_train(hung, root / "hung.log");
  EXPECT_NE(r.exit_code, 0) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "checkpoint of step 4")) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "timeout 3 s")) << tail(r.output);
  for (int n = 0; n < 2; ++n) {
    // Committed locally (L1), but no node claims partner copies of it.
    EXPECT_TRUE(exists(node_dir(root, n) + "/step_4/.metadata")) << n;
    EXPECT_FALSE(exists(node_dir(root, n) + "/step_4/.partner.json")) << n;
  }
  EXPECT_EQ(committed_steps(hung.ckpt_dir), (std::vector<int64_t>{2}));
  TrainSpec again = tier_run(root, "run", {});
  r = run_train(again, root / "resumed.log");
  ASSERT_EQ(r.exit_code, 0) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "resumed from " + node_dir(root, 0) + "/step_4")) << tail(r.output);
  fs::remove_all(root);
}

}  // namespace
}  // namespace reliability
