#pragma once
// The multi-level protocol over the checkpoint group (docs/checkpoints.md,
// "Multi-level checkpoints"; FORMAT.md "Tiers"; the records and the resume
// choice: tiers/local_tier.h): the local commit on every node, partner
// copies, the flush to the durable tier, retention of both tiers, and the
// restore of a local checkpoint some node lacks.
//
// Internal to the checkpoint library (not installed): the manager
// (async/manager.h) is its one caller. A save goes
//   (all ranks) commit_local, in save() (sync) or on the background thread;
//   (all ranks, background) finish: partner copies, the flush when due,
//                           retention.
// A resume goes (all ranks) choose_resume, then for a local candidate
// restore_local and the manager's load of local_step_path().
// Thread safety: one thread at a time (the manager's calling or background
// thread), as the checkpoint group.
#include "checkpoint/event.h"
#include "checkpoint/options.h"
#include "checkpoint/save.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/storage/storage.h"
#include "checkpoint/tiers/local_tier.h"
#include "comm/process_group.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace checkpoint {

namespace test_seam {
struct SaveSeam;  // checkpoint/save_seam.h (test-only)
}

// One save on its way through the tiers.
struct TierSave {
  int64_t step = 0;
  bool flush = false;      // flush this one to the durable tier
  std::string local_path;  // this rank's node's step directory
  std::chrono::steady_clock::time_point started;  // when save() was called
  // Set by commit_local.
  bool local_done = false;  // committed in the local tier
  std::vector<uint8_t> metadata;
  std::vector<uint64_t> file_bytes;  // by rank
  std::chrono::steady_clock::time_point local_committed;
  // The save's event: the protocol fills its tier fields (tier, path,
  // local_path, local_commit_s, partner, flushed, flush_s, exposure_s) and,
  // for the local write, plan_s, plan_cached, write_s, commit_s, bytes,
  // stored_bytes. REQUIRES: outlives the calls.
  CheckpointEvent* event = nullptr;
  // Set by finish: retention that failed after this save committed (on this
  // rank: a node leader's local tier, rank 0's durable tier). The save
  // stands; the manager reports these apart from the save.
  std::vector<RetentionFailure> retention_failures;
};

class TierProtocol {
 public:
  // `durable_dir` on `durable`: checkpoint.dir; the local tier is
  // options.local.dir for `node` on `local`. REQUIRES: `group` (the
  // checkpoint group) outlives the protocol.
  TierProtocol(const CheckpointOptions& options, std::string durable_dir,
               std::shared_ptr<Storage> durable, comm::Group& group, int node,
               std::shared_ptr<Storage> local);

  // This rank's node's local tier directory, and its step_<N> there.
  const std::string& local_dir() const { return local_dir_; }
  std::string local_step_path(int64_t step) const;

  // (all ranks) Writes `staged` into every node's local tier with `options`
  // (the manager's, on the local storage) and commits it there: .local.json,
  // then .metadata, on each node. Every node committed or, after a failure
  // anywhere, none (each removes its step directory); throws CheckpointError.
  void commit_local(TierSave& save, const StateDict& staged, SaveOptions options,
                    const test_seam::SaveSeam* seam);
  // (all ranks, background) Partner copies, the flush when due, retention of
  // both tiers. A flush failure is the save's failure; the local tier keeps
  // the checkpoint.
  void finish(TierSave& save, const test_seam::SaveSeam* seam);

  // (all ranks) Every checkpoint resume could load, newest first, with the
  // notes on newer local steps that are not usable; chosen by rank 0 from
  // every node's inventory and the durable listing, and broadcast.
  TierChoice choose_resume();
  // (all ranks) Makes every file this rank's load of `state` needs present
  // in its node's local step directory: from the node itself (its own files
  // or its partner copies) or sent by a rank of the node that holds it.
  // Throws CheckpointDamagedError when it cannot.
  void restore_local(StateDict& state, const ResumeCandidate& candidate);

 private:
  // Which node each member of the checkpoint group is on (all-gathered once).
  struct Topology {
    std::vector<int> node_of_rank;
    std::vector<int> nodes;  // distinct, ascending
    std::map<int, std::vector<int>> ranks_of_node;
    int node = 0;
    bool leader = false;     // the lowest rank of its node
    int partner_to = -1;     // the rank this one's file is copied to
    int partner_from = -1;   // the rank whose file this one keeps
    std::string no_partner;  // why there are no partner copies
    int leader_of(int node) const { return ranks_of_node.at(node).front(); }
  };
  // A file restore_local moves to a rank that lacks it.
  struct Move {
    std::string file;
    int from = -1;  // -1: a copy from the receiver's own .partner/
    int to = 0;
    bool partner = false;
    uint64_t bytes = 0;
    std::optional<uint64_t> xxh3;
  };

  const Topology& topology();
  void clear_local_leftover(const TierSave& save, const std::string& failed);
  void commit_on_every_node(TierSave& save, const std::string& failed, double write_commit_s);
  void remove_local_step(const TierSave& save);
  void partner_copy(TierSave& save);
  void flush(TierSave& save);
  void apply_retention_of_both(TierSave& save);
  std::vector<uint8_t> broadcast_local_metadata(const std::string& step_path, const ResumeCandidate& c,
                                                const std::string& what);
  comm::Bytes files_missing(const StateDict& state, const std::vector<uint8_t>& metadata,
                            const std::string& step_path, const ResumeCandidate& c);
  std::string plan_moves(const std::vector<comm::Bytes>& wants, const ResumeCandidate& c);
  std::vector<Move> agree_moves(const std::vector<comm::Bytes>& wants, const ResumeCandidate& c,
                                const std::string& what);
  std::string run_moves(const std::vector<Move>& moves, const std::string& step_path);

  CheckpointOptions options_;
  std::string dir_;
  std::shared_ptr<Storage> storage_;
  comm::Group& group_;
  int node_;
  std::string local_dir_;
  std::shared_ptr<Storage> local_storage_;
  std::shared_ptr<Topology> topology_;
};

}  // namespace checkpoint
