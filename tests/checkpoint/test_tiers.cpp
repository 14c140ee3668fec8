// Multi-level checkpoints (checkpoint/tiers/local_tier.h, the manager's tiers):
// 4 ranks as threads over real Gloo groups, placed on 2 simulated nodes,
// each node with its own local tier directory, the durable tier in another.
// Local commit, partner copies, flushes every k-th save, retention per tier,
// and resume from the right tier after losing a node, every node, a full
// durable disk or a partner that cannot store its copy.
#include "checkpoint/async/manager.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/save_seam.h"
#include "checkpoint/tiers/local_tier.h"
#include "support/faulty_storage.h"
#include "support/multi_rank.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

namespace fs = std::filesystem;
using namespace checkpoint;
using testing_support::RankContext;
using testing_support::run_ranks;

namespace {

std::string tiers_scratch(const std::string& tag) {
  auto dir = fs::temp_directory_path() / ("shardkit_tiers_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The global weight at `step`: 12 x 8, distinct per step.
torch::Tensor weight_at(int64_t step) {
  return torch::arange(12 * 8, torch::kFloat32).reshape({12, 8}) / 3 + static_cast<float>(step);
}

// Rank r of `world` holds rows of the weight (FSDP-style) and a replicated
// bias and bytes item.
StateDict state_at(int64_t step, int rank, int world) {
  StateDict sd;
  const int64_t rows = 12 / world;
  sd.add_tensor("w", weight_at(step).narrow(0, rank * rows, rows).clone(), {12, 8}, {rank * rows, 0});
  sd.add_tensor("b", torch::full({5}, static_cast<float>(step)));
  sd.add_bytes("step", {static_cast<uint8_t>(step), 0, 0, 0});
  return sd;
}

StateDict empty_state(int rank, int world) {
  StateDict sd;
  const int64_t rows = 12 / world;
  sd.add_tensor("w", torch::zeros({rows, 8}), {12, 8}, {rank * rows, 0});
  sd.add_tensor("b", torch::zeros({5}));
  sd.add_bytes("step", {});
  return sd;
}

void expect_state(const StateDict& sd, int64_t step, int rank, int world) {
  const StateDict want = state_at(step, rank, world);
  EXPECT_TRUE(torch::equal(sd.tensors()[0].local, want.tensors()[0].local)) << "rank " << rank;
  EXPECT_TRUE(torch::equal(sd.tensors()[1].local, want.tensors()[1].local)) << "rank " << rank;
  EXPECT_EQ(sd.bytes()[0].data, want.bytes()[0].data) << "rank " << rank;
}

struct TierLayout {
  std::string root;
  std::string durable() const { return root + "/durable"; }
  std::string pattern() const { return root + "/local/node{node}"; }
  std::string node(int n) const { return local_tier_dir(pattern(), n); }
};

CheckpointOptions tier_options(const TierLayout& l, int64_t every, const std::string& mode = "async") {
  CheckpointOptions o;
  o.dir = l.durable();
  o.interval = 1;
  o.mode = parse_save_mode(mode);
  o.local.dir = l.pattern();
  o.local.keep_last = 2;
  o.durable.every = every;
  return o;
}

// Ranks 0,1 on node 0 and 2,3 on node 1 (world 4), or one rank per node.
int node_of(int rank, int world) { return world == 4 ? rank / 2 : rank; }

struct Saved {
  std::vector<CheckpointEvent> events;  // rank 0's
  std::vector<std::string> errors;      // per rank: finish()'s error
};

// Saves steps first..last with `options` on `world` ranks; the last is final
// when `final_last`.
Saved save_steps(const CheckpointOptions& options, int world, int64_t first, int64_t last,
                 bool final_last, std::shared_ptr<Storage> durable = posix_storage(),
                 std::function<std::shared_ptr<Storage>(int rank)> local = nullptr,
                 test_seam::SaveSeam seam = {}, double timeout_s = 30) {
  Saved out;
  out.errors.resize(world);
  std::mutex mu;
  run_ranks(
      world,
      [&](RankContext& ctx) {
        auto g = ctx.make_group("ckpt");
        CheckpointManager m(options, "", *g, "test", durable);
        test_seam::set_save_seam(m, seam);
        m.set_placement({node_of(ctx.rank, world), local ? local(ctx.rank) : posix_storage()});
        try {
          for (int64_t step = first; step <= last; ++step) {
            m.save(step, state_at(step, ctx.rank, world), final_last && step == last);
          }
          m.finish();
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mu);
          out.errors[ctx.rank] = e.what();
        }
        if (ctx.rank == 0) out.events = m.take_events();
      },
      timeout_s);
  return out;
}

struct Resumed {
  std::vector<std::optional<ResumeResult>> results;
};

Resumed resume_all(const CheckpointOptions& options, int world, std::optional<int64_t> expect_step) {
  Resumed out;
  out.results.resize(world);
  std::mutex mu;
  run_ranks(world, [&](RankContext& ctx) {
    auto g = ctx.make_group("ckpt");
    CheckpointManager m(options, "", *g, "test");
    m.set_placement({node_of(ctx.rank, world), posix_storage()});
    StateDict sd = empty_state(ctx.rank, world);
    std::optional<ResumeResult> r = m.resume(sd);
    if (expect_step && r) expect_state(sd, *expect_step, ctx.rank, world);
    std::lock_guard<std::mutex> lock(mu);
    out.results[ctx.rank] = std::move(r);
  });
  return out;
}

std::vector<int64_t> committed(const std::string& dir) {
  std::vector<int64_t> out;
  for (const CheckpointEntry& e : list_checkpoints(*posix_storage(), dir)) {
    if (e.committed) out.push_back(e.step);
  }
  return out;
}

bool has(const std::string& path) { return fs::exists(path); }

}  // namespace

// Every save commits on both nodes (record, metadata), partner copies land on
// the other node with a committed .partner.json, every 2nd save and the
// final one are flushed, byte for byte, and each tier keeps its own newest N.
TEST(Tiers, SavesCommitLocallyCopyToPartnersAndFlushEveryKth) {
  TierLayout l{tiers_scratch("save")};
  CheckpointOptions o = tier_options(l, 2);
  o.keep_last = 2;
  o.local.keep_last = 3;
  const Saved s = save_steps(o, 4, 1, 5, true);
  for (const std::string& e : s.errors) ASSERT_EQ(e, "");
  EXPECT_EQ(committed(l.durable()), (std::vector<int64_t>{4, 5}));  // 2, 4, 5 flushed; keep 2
  for (int n = 0; n < 2; ++n) {
    EXPECT_EQ(committed(l.node(n)), (std::vector<int64_t>{3, 4, 5})) << n;
    const std::string step = l.node(n) + "/step_5";
    EXPECT_TRUE(has(step + "/.local.json"));
    EXPECT_TRUE(has(step + "/.partner.json"));
    for (int r = 0; r < 4; ++r) {
      // Own files here, the other node's as partner copies.
      const bool own = r / 2 == n;
      EXPECT_EQ(has(step + "/" + rank_file_name(r)), own) << n << " " << r;
      EXPECT_EQ(has(step + "/.partner/" + rank_file_name(r)), !own) << n << " " << r;
    }
    // The same checkpoint, byte for byte, in both tiers.
    EXPECT_EQ(read_all(step + "/.metadata"), read_all(l.durable() + "/step_5/.metadata"));
    for (int r = n * 2; r < n * 2 + 2; ++r) {
      EXPECT_EQ(read_all(step + "/" + rank_file_name(r)),
                read_all(l.durable() + "/step_5/" + rank_file_name(r)));
      EXPECT_EQ(read_all(step + "/" + rank_file_name(r)),
                read_all(l.node(1 - n) + "/step_5/.partner/" + rank_file_name(r)));
    }
  }
  ASSERT_EQ(s.events.size(), 5u);
  for (const CheckpointEvent& ev : s.events) {
    EXPECT_TRUE(ev.ok) << ev.error;
    EXPECT_EQ(ev.partner, "ok") << ev.step;
    const bool flushed = ev.step % 2 == 0 || ev.step == 5;
    EXPECT_EQ(ev.flushed, flushed) << ev.step;
    EXPECT_EQ(ev.tier, flushed ? "local+durable" : "local") << ev.step;
    EXPECT_EQ(ev.local_path, l.node(0) + "/step_" + std::to_string(ev.step));
    EXPECT_GT(ev.local_commit_s, 0);
    if (flushed) {
      EXPECT_GE(ev.exposure_s, ev.flush_s);
    }
  }
  // Nothing newer than the local tier's step 5 was lost: resume takes it locally.
  const Resumed r = resume_all(o, 4, 5);
  ASSERT_TRUE(r.results[0]);
  EXPECT_EQ(r.results[0]->tier, "local");
  EXPECT_EQ(r.results[0]->reason, "every rank file is on its own node");
  EXPECT_EQ(r.results[3]->path, l.node(1) + "/step_5");
}

// Sync mode waits for the local commit only; the flush follows in the
// background and finish() waits for it.
TEST(Tiers, SyncModeReturnsAfterTheLocalCommit) {
  TierLayout l{tiers_scratch("sync")};
  const Saved s = save_steps(tier_options(l, 1, "sync"), 4, 1, 2, true);
  for (const std::string& e : s.errors) ASSERT_EQ(e, "");
  EXPECT_EQ(committed(l.durable()), (std::vector<int64_t>{1, 2}));
  ASSERT_EQ(s.events.size(), 2u);
  for (const CheckpointEvent& ev : s.events) {
    EXPECT_TRUE(ev.flushed);
    EXPECT_LE(ev.blocking_s, ev.local_commit_s + 1e-3);
  }
}

// Losing node 1's local directory: its files come from the partner copies on
// node 0, at 4 ranks and resharded onto 2 ranks (one per node) and onto 1.
TEST(Tiers, LosingOneNodeResumesFromPartnerCopiesAtAnyWorld) {
  for (int world : {4, 2}) {
    TierLayout l{tiers_scratch("lose1_" + std::to_string(world))};
    CheckpointOptions o = tier_options(l, 3);
    const Saved s = save_steps(o, 4, 1, 2, false);  // local only: no flush yet
    for (const std::string& e : s.errors) ASSERT_EQ(e, "");
    EXPECT_EQ(committed(l.durable()), std::vector<int64_t>{});
    fs::remove_all(l.node(1));
    const Resumed r = resume_all(o, world, 2);
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_TRUE(r.results[rank]) << rank;
      EXPECT_EQ(r.results[rank]->tier, "local");
      EXPECT_EQ(r.results[rank]->stats.step, 2);
      EXPECT_EQ(r.results[rank]->reason,
                "the files of node 1 (missing or incomplete there) come from partner copies on node 0");
    }
    // Node 1 holds the restored files it needed and the metadata, but no
    // record: it is never a source for another node.
    EXPECT_TRUE(has(l.node(1) + "/step_2/.metadata"));
    EXPECT_FALSE(has(l.node(1) + "/step_2/.local.json"));
  }
}

// Every local directory gone: the last durable checkpoint; a damaged partner
// copy or no partner copy at all: the durable one too, saying why.
TEST(Tiers, WithoutACompleteLocalCheckpointResumeTakesTheDurableOne) {
  TierLayout l{tiers_scratch("durable")};
  CheckpointOptions o = tier_options(l, 2);
  o.local.keep_last = 0;
  const Saved s = save_steps(o, 4, 1, 3, false);  // step 2 flushed; 1 and 3 local only
  for (const std::string& e : s.errors) ASSERT_EQ(e, "");
  EXPECT_EQ(committed(l.durable()), std::vector<int64_t>{2});

  // Node 1 lost and node 0's partner copies of rank 3 truncated: neither
  // step 3 nor step 2 is complete locally, the durable step 2 is the newest
  // complete one.
  fs::remove_all(l.node(1));
  fs::resize_file(l.node(0) + "/step_3/.partner/rank_3.data", 1);
  fs::resize_file(l.node(0) + "/step_2/.partner/rank_3.data", 1);
  Resumed r = resume_all(o, 4, 2);
  ASSERT_TRUE(r.results[0]);
  EXPECT_EQ(r.results[0]->tier, "durable");
  EXPECT_EQ(r.results[0]->path, l.durable() + "/step_2");
  ASSERT_FALSE(r.results[0]->notes.empty());
  EXPECT_NE(r.results[0]->notes[0].find("local step_3 lacks rank_3.data"), std::string::npos)
      << r.results[0]->notes[0];

  // Every local directory lost.
  fs::remove_all(l.root + "/local");
  r = resume_all(o, 4, 2);
  ASSERT_TRUE(r.results[1]);
  EXPECT_EQ(r.results[1]->tier, "durable");
  EXPECT_EQ(r.results[1]->reason, "the local tier has no step_2");
}

// A full durable disk fails the flush: the error says so and that the local
// tier keeps the checkpoint; nothing half-written stays in the durable tier,
// and resume takes the local copy.
TEST(Tiers, AFullDurableDiskFailsTheFlushAndTheLocalTierKeepsTheCheckpoint) {
  TierLayout l{tiers_scratch("fulldisk")};
  CheckpointOptions o = tier_options(l, 1);
  faults::FaultPlan plan;
  plan.fail_after_bytes = 100;
  auto full = faults::fault_injecting_storage(posix_storage(), plan);
  const Saved s = save_steps(o, 4, 1, 1, true, full);
  int failed = 0;
  for (const std::string& e : s.errors) {
    if (e.empty()) continue;
    ++failed;
    EXPECT_NE(e.find("flush to the durable tier"), std::string::npos) << e;
    EXPECT_NE(e.find("No space left on device"), std::string::npos) << e;
    EXPECT_NE(e.find("the local tier keeps it"), std::string::npos) << e;
  }
  EXPECT_EQ(failed, 4);
  EXPECT_EQ(committed(l.durable()), std::vector<int64_t>{});
  EXPECT_FALSE(has(l.durable() + "/step_1"));
  for (int n = 0; n < 2; ++n) EXPECT_EQ(committed(l.node(n)), std::vector<int64_t>{1});
  const Resumed r = resume_all(o, 4, 1);
  ASSERT_TRUE(r.results[0]);
  EXPECT_EQ(r.results[0]->tier, "local");
}

namespace {

// A local storage whose partner copies cannot be written (a full local disk
// on the partner's node).
class NoPartnerCopies : public StorageWrapper {
 public:
  using StorageWrapper::StorageWrapper;
  std::unique_ptr<WritableFile> create_file(const std::string& path) override {
    if (path.find("/.partner/") != std::string::npos) {
      throw IoError::from_errno("cannot create", path, ENOSPC);
    }
    return StorageWrapper::create_file(path);
  }
};

}  // namespace

// A partner that cannot store its copy: the save degrades to L1 (committed
// locally and flushed), the event says why, and no node claims L2; losing a
// node then resumes from the durable tier.
TEST(Tiers, APartnerThatCannotStoreItsCopyLeavesNoPartnerClaim) {
  TierLayout l{tiers_scratch("nopartner")};
  CheckpointOptions o = tier_options(l, 1);
  auto broken = std::make_shared<NoPartnerCopies>(posix_storage());
  const Saved s = save_steps(o, 4, 1, 1, true, posix_storage(), [&](int rank) {
    return rank == 2 ? std::static_pointer_cast<Storage>(broken) : posix_storage();
  });
  for (const std::string& e : s.errors) ASSERT_EQ(e, "");
  ASSERT_EQ(s.events.size(), 1u);
  EXPECT_EQ(s.events[0].partner.rfind("failed: rank 2: cannot create", 0), 0u) << s.events[0].partner;
  EXPECT_TRUE(s.events[0].flushed);
  for (int n = 0; n < 2; ++n) {
    EXPECT_EQ(committed(l.node(n)), std::vector<int64_t>{1});
    EXPECT_FALSE(has(l.node(n) + "/step_1/.partner.json")) << n;
  }
  fs::remove_all(l.node(0));
  const Resumed r = resume_all(o, 4, 1);
  ASSERT_TRUE(r.results[0]);
  EXPECT_EQ(r.results[0]->tier, "durable");
  EXPECT_NE(r.results[0]->reason.find("no committed partner copy"), std::string::npos)
      << r.results[0]->reason;
}

// A partner that is down (stops responding) during the partner copy: the
// save fails with the group's timeout on every rank, no node claims L2, the
// local (L1) checkpoint stays committed and loads.
TEST(Tiers, APartnerThatIsDownFailsTheSaveWithoutAPartnerClaim) {
  TierLayout l{tiers_scratch("down")};
  CheckpointOptions o = tier_options(l, 1);
  test_seam::SaveSeam seam;
  seam.before_partner = [](int64_t, int rank) {
    if (rank == 3) std::this_thread::sleep_for(std::chrono::seconds(6));
  };
  const Saved s = save_steps(o, 4, 1, 1, true, posix_storage(), nullptr, seam, 2.0);
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(s.errors[r], "") << r;
    EXPECT_NE(s.errors[r].find("checkpoint of step 1"), std::string::npos) << s.errors[r];
  }
  // Rank 1 sends to and receives from rank 3 (rank i of each node pairs up).
  EXPECT_NE(s.errors[1].find("send_recv"), std::string::npos) << s.errors[1];
  EXPECT_NE(s.errors[1].find("Timed out"), std::string::npos) << s.errors[1];
  for (int n = 0; n < 2; ++n) {
    EXPECT_EQ(committed(l.node(n)), std::vector<int64_t>{1});
    EXPECT_FALSE(has(l.node(n) + "/step_1/.partner.json")) << n;
  }
  EXPECT_EQ(committed(l.durable()), std::vector<int64_t>{});
  const Resumed r = resume_all(o, 4, 1);
  ASSERT_TRUE(r.results[0]);
  EXPECT_EQ(r.results[0]->tier, "local");
}

// The resume choice on inventories alone (no files): newest first, local
// before durable for a step, a node's own copy before a partner copy.
TEST(Tiers, ChooseResumeTiersPrefersTheNewestCompleteAndOwnCopies) {
  auto file = [](int rank, int node, uint64_t bytes) {
    return TierFile{rank_file_name(rank), rank, node, bytes, std::nullopt};
  };
  auto step = [&](int64_t n, int node, bool committed, std::vector<TierFile> own,
                  std::vector<TierFile> copies) {
    LocalStep s;
    s.step = n;
    s.committed = committed;
    s.record = LocalRecord{n, node, {0, 0, 1, 1}, own};
    s.own = own;
    if (!copies.empty()) {
      for (TierFile& f : copies) f.xxh3 = 7;
      s.partner = PartnerRecord{n, node, copies};
      s.partner_copies = copies;
    }
    return s;
  };
  NodeInventory n0{0, "/l/node0", {}, ""}, n1{1, "/l/node1", {}, ""};
  n0.steps.push_back(step(4, 0, true, {file(0, 0, 10), file(1, 0, 10)}, {file(2, 1, 10), file(3, 1, 10)}));
  n1.steps.push_back(step(4, 1, true, {file(2, 1, 10), file(3, 1, 10)}, {file(0, 0, 10), file(1, 0, 10)}));
  // Step 6 committed on node 0 only, and no partner copies of node 1's files.
  n0.steps.push_back(step(6, 0, true, {file(0, 0, 10), file(1, 0, 10)}, {}));
  std::vector<CheckpointEntry> durable(1);
  durable[0].step = 4;
  durable[0].path = "/d/step_4";
  durable[0].committed = true;
  TierChoice c = choose_resume_tiers({n0, n1}, durable);
  ASSERT_EQ(c.candidates.size(), 2u);
  EXPECT_EQ(c.candidates[0].step, 4);
  EXPECT_EQ(c.candidates[0].tier, Tier::kLocal);
  for (const FileSource& src : c.candidates[0].sources) EXPECT_FALSE(src.partner) << src.file.name;
  EXPECT_EQ(c.candidates[1].tier, Tier::kDurable);
  ASSERT_EQ(c.notes.size(), 1u);
  EXPECT_EQ(c.notes[0],
            "local step_6 lacks rank_2.data, rank_3.data (node 1: not committed there or files "
            "missing, and no committed partner copy)");
  // Round trip through the wire encodings.
  EXPECT_EQ(encode_candidates(decode_candidates(encode_candidates(c.candidates))),
            encode_candidates(c.candidates));
  EXPECT_EQ(encode_inventory(decode_inventory(encode_inventory(n0))), encode_inventory(n0));
  // Node 1 lost: step 4 from node 0's partner copies.
  c = choose_resume_tiers({n0}, durable);
  ASSERT_FALSE(c.candidates.empty());
  EXPECT_EQ(c.candidates[0].tier, Tier::kLocal);
  EXPECT_TRUE(c.candidates[0].sources[2].partner);
  EXPECT_EQ(c.candidates[0].sources[2].node, 0);
}

// Damaged records are refused with the file and field named.
TEST(Tiers, RecordsWithBadFieldsAreRefusedNamingTheFile) {
  EXPECT_THROW(decode_local_record("{", "/x/.local.json"), FormatError);
  try {
    decode_partner_record(R"({"format":"shardkit-partner/1","step":1,"node":0,"files":[{"name":"rank_1.data","rank":1,"node":1,"bytes":3}]})",
                          "/x/.partner.json");
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_EQ(std::string(e.what()), "/x/.partner.json: rank_1.data has no xxh3");
  }
  try {
    decode_local_record(R"({"format":"shardkit-local/2"})", "/x/.local.json");
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_EQ(std::string(e.what()), "/x/.local.json: format 'shardkit-local/2', expected 'shardkit-local/1'");
  }
  // Integers that are floats or out of range (converting them was undefined
  // behaviour): refused naming the field.
  auto error = [](const std::string& text) {
    try {
      decode_local_record(text, "/x/.local.json");
    } catch (const FormatError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string head = R"({"format":"shardkit-local/1",)";
  const std::string files = R"("files":[{"name":"rank_0.data","rank":0,"node":0,"bytes":3}]})";
  EXPECT_EQ(error(head + R"("step":1e300,"node":0,"node_of_rank":[0],)" + files),
            "/x/.local.json: field 'step' has the wrong type");
  EXPECT_EQ(error(head + R"("step":1,"node":0,"node_of_rank":[0.5],)" + files),
            "/x/.local.json: field 'node_of_rank' has the wrong type");
  EXPECT_EQ(error(head + R"("step":1,"node":3000000000,"node_of_rank":[0],)" + files),
            "/x/.local.json: field 'node' is out of range");
  EXPECT_EQ(error(head + R"("step":1,"node":0,"node_of_rank":[0],)" + files), "no error");
}
