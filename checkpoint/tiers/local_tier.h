#pragma once
// Multi-level checkpoints (docs/checkpoints.md, "Multi-level checkpoints", FORMAT.md
// "Tiers"): the node-local tier's records, what one node's local tier holds,
// and the resume choice between the local and the durable tier. Torch-free;
// the protocol over the checkpoint group (local commit, partner copies,
// flush, restore) is in checkpoint/tiers/protocol.h (internal).
//
// One node's local tier (checkpoint.local.dir, "{node}" replaced by the node):
//   step_<N>/
//     rank_<r>.data     the data files written by this node's ranks: the
//                       bytes of the durable tier's files
//     .local.json       LocalRecord: the job's world, every rank's node, the
//                       files of this node; written before .metadata
//     .metadata         the checkpoint's metadata, byte for byte the durable
//                       one; its presence commits this node's part (L1)
//     .partner/rank_<q>.data
//                       copies of the files of the ranks whose partner is on
//                       this node (L2)
//     .partner.json     PartnerRecord: those copies with their sizes and
//                       XXH3-64; written after every copy was fsynced on
//                       every node; its presence is the L2 claim
#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/storage/storage.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace checkpoint {

constexpr const char* kLocalRecordName = ".local.json";
constexpr const char* kPartnerDirName = ".partner";
constexpr const char* kPartnerRecordName = ".partner.json";

// checkpoint.local.dir with every "{node}" replaced by `node`.
std::string local_tier_dir(const std::string& pattern, int node);
// The data file every rank writes: "rank_<r>.data".
std::string rank_file_name(int rank);

// One data file of a local checkpoint.
struct TierFile {
  std::string name;   // rank_<r>.data
  int rank = 0;       // the rank that wrote it
  int node = 0;       // that rank's node
  uint64_t bytes = 0;
  std::optional<uint64_t> xxh3;  // of the whole file; partner copies only
};

// .local.json of one node's step_<N>.
struct LocalRecord {
  int64_t step = 0;
  int node = 0;                   // the node holding this directory
  std::vector<int> node_of_rank;  // index: rank; size: the saving world
  std::vector<TierFile> files;    // the files written on this node
};

// .partner.json of one node's step_<N>.
struct PartnerRecord {
  int64_t step = 0;
  int node = 0;                   // the node holding the copies
  std::vector<TierFile> files;    // TierFile::node: the node they came from
};

// JSON text; decode throws FormatError naming `where` and the field.
std::string encode_local_record(const LocalRecord& record);
LocalRecord decode_local_record(const std::string& text, const std::string& where);
std::string encode_partner_record(const PartnerRecord& record);
PartnerRecord decode_partner_record(const std::string& text, const std::string& where);

// One step directory of one node's local tier, as observed.
struct LocalStep {
  int64_t step = 0;
  std::string path;
  bool committed = false;            // .metadata present
  std::optional<LocalRecord> record; // .local.json, when it decodes and names this step
  std::vector<TierFile> own;         // record files present with the recorded size
  std::optional<PartnerRecord> partner;  // .partner.json, when it decodes and names this step
  std::vector<TierFile> partner_copies;  // partner files present with the recorded size
  std::vector<std::string> problems;     // e.g. "rank_3.data has 10 bytes, recorded 20"
};

struct NodeInventory {
  int node = 0;
  std::string dir;
  std::vector<LocalStep> steps;  // by step
  std::string error;             // the directory could not be listed
};

// (one rank per node) What `dir` holds: every step directory with its
// records and the files they name (stat only; nothing is read but the
// records). A missing directory is an empty inventory.
NodeInventory inventory_local_tier(Storage& storage, const std::string& dir, int node);
std::string encode_inventory(const NodeInventory& inventory);

// (any process) Reads the partner copy of `file` (an entry of .partner.json)
// in `step_path`/.partner/ and compares its size and whole-file XXH3-64 with
// the recorded ones. Returns "" when they match, else what differs, naming
// the copy's path ("<path> is missing", "<path>: XXH3 <hex>, recorded <hex>").
std::string check_partner_copy(Storage& storage, const std::string& step_path, const TierFile& file);
NodeInventory decode_inventory(const std::string& text);

enum class Tier { kLocal, kDurable };
const char* tier_name(Tier tier);  // "local" | "durable"

// Where a rank file of a local checkpoint is.
struct FileSource {
  TierFile file;       // xxh3 set for a partner copy
  int node = 0;        // the node holding it
  bool partner = false;  // in that node's .partner/
};

// A checkpoint resume may load.
struct ResumeCandidate {
  int64_t step = 0;
  Tier tier = Tier::kDurable;
  std::string reason;                // why this tier, for the log
  std::string durable_path;          // kDurable
  int world_size = 0;                // kLocal: the saving world
  int metadata_node = -1;            // kLocal: a node whose step_<N> is committed
  std::vector<FileSource> sources;   // kLocal: one per rank file, by rank
};

// Every checkpoint resume could load, newest step first; for one step the
// local tier comes before the durable one. A local step is a candidate when
// some node committed it and every rank file of the saving world is on a
// node that committed it (own file) or in a committed partner copy; a node's
// own copy is preferred. `nodes` are the current job's nodes; `durable` the
// durable tier's listing. A local step that is not a candidate is described
// in `notes` (newest first) when it is newer than the newest candidate.
struct TierChoice {
  std::vector<ResumeCandidate> candidates;
  std::vector<std::string> notes;
};
TierChoice choose_resume_tiers(const std::vector<NodeInventory>& nodes,
                               const std::vector<CheckpointEntry>& durable);

// Compact text for a candidate list (sent from the coordinator to all ranks).
std::string encode_candidates(const std::vector<ResumeCandidate>& candidates);
std::vector<ResumeCandidate> decode_candidates(const std::string& text);

}  // namespace checkpoint
