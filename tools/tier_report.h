#pragma once
// What `ckpt tiers` reports: every step of a durable tier (checkpoint.dir)
// and of the node-local tiers (checkpoint.local.dir of each node), what each
// holds, optionally whether its bytes verify, and which checkpoint the
// trainer's resume would load. The resume choice is the trainer's own
// (choose_resume_tiers over inventory_local_tier and the durable listing,
// tiers/local_tier.h), so the tool and the trainer agree. Torch-free; the
// printing (text, JSON) is in ckpt.cpp.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/storage/storage.h"
#include "checkpoint/tiers/local_tier.h"

namespace thread_pool {
class ThreadPool;
}

namespace tools {

// One node's local tier directory.
struct NodeTier {
  checkpoint::NodeInventory inventory;  // node, dir, steps; error: not listable
  bool missing = false;                 // the directory does not exist (a lost node)
};

// Where a data file of a local checkpoint is, seen from a node that lacks it.
struct FileLocation {
  std::string file;      // rank_<r>.data
  int node = -1;         // -1: on no node (neither own file nor partner copy)
  bool partner = false;  // a partner copy (in that node's .partner/)
};

// A partner copy checked against .partner.json.
struct PartnerCopyCheck {
  checkpoint::TierFile file;  // the .partner.json entry
  std::string problem;        // "": size and XXH3-64 match
};

// --verify of one node's step directory.
struct LocalVerify {
  bool ran = false;                     // committed: the chunks were verified
  checkpoint::VerifyReport report;      // the chunks of the files in this directory
  std::string error;                    // .metadata did not read: no chunk verified
  std::vector<FileLocation> elsewhere;  // the checkpoint's files not in this directory
  std::vector<PartnerCopyCheck> partner_copies;  // every file of .partner.json
};

// One node's step_<N>.
struct NodeStep {
  int node = 0;
  std::string path;                           // <local dir>/step_<N>
  std::optional<checkpoint::LocalStep> step;  // nullopt: no step_<N> on this node
  // The step directory's status as `ckpt list` judges it (reads .metadata).
  checkpoint::CheckpointStatus status = checkpoint::CheckpointStatus::kUncommitted;
  std::string status_error;  // kDamaged: why
  LocalVerify verify;
};

// The durable tier's step_<N>.
struct DurableStep {
  std::optional<checkpoint::CheckpointStatusEntry> entry;  // nullopt: absent
  std::vector<std::string> set_aside;  // step_<N>.damaged[.<K>] paths
  bool verified = false;               // --verify on a committed entry
  checkpoint::VerifyReport report;
  std::string verify_error;  // verify_checkpoint threw
};

struct StepReport {
  int64_t step = 0;
  DurableStep durable;
  std::vector<NodeStep> nodes;  // one per node, by node
  // This step's resume candidates, in the order resume tries them; when
  // there is none, why not ("" when nothing of it is committed anywhere).
  std::vector<checkpoint::ResumeCandidate> candidates;
  std::string not_loadable;
};

// A candidate resume would try before the one it loads, and why it fails.
struct FailingCandidate {
  checkpoint::ResumeCandidate candidate;
  std::string why;
};

struct TierReport {
  std::string durable_dir;
  std::vector<NodeTier> nodes;
  std::vector<StepReport> steps;   // newest first
  std::vector<std::string> notes;  // choose_resume_tiers: newer local steps it cannot load
  bool verified = false;           // --verify ran
  // Damage found: a .metadata that does not read, bad chunks, own files
  // missing from a committed step, partner copies that differ from their
  // record. One line each, naming the file.
  std::vector<std::string> damage;
  // What resume would load: the first candidate not known to be damaged
  // (by its metadata, or by --verify); the ones before it fail.
  std::vector<FailingCandidate> failing;
  std::optional<checkpoint::ResumeCandidate> resume;
};

struct TierReportOptions {
  bool verify = false;
  thread_pool::ThreadPool* pool = nullptr;  // verify's readers
};

// (any single process) Lists `durable_dir` and every local tier directory
// (`local_dirs[k]` is node k's; a missing one is a lost node, not an error),
// reads every metadata and record, and with `options.verify` every chunk and
// partner copy. Throws what list_checkpoints_with_status throws for a
// durable_dir that cannot be listed; everything else is reported.
TierReport build_tier_report(checkpoint::Storage& storage, const std::string& durable_dir,
                             const std::vector<std::string>& local_dirs,
                             const TierReportOptions& options);

}  // namespace tools
