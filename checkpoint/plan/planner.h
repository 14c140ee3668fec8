#pragma once
// Save planning, DCP-style: pure functions from what every rank holds to what
// every rank writes. No I/O, no communication; tests call these directly.
//
// Call sequence during a save (save.cpp, save_protocol.h):
//   (all ranks)   build a LocalPlan of the regions they hold; encode_local_plan
//   (coordinator) gathers the blobs; decode_local_plan and GlobalPlanner::add
//                 each in rank order; finish; encode_assignments per rank
//   (all ranks)   decode_assignments of their own (scattered); write exactly
//                 those regions
// With plan caching (save.h, SavePlanCache) the first three steps are skipped
// while every rank's structure is unchanged.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/errors.h"  // PlanError
#include "checkpoint/format/types.h"

namespace checkpoint {

// One region a rank holds. Ranks holding the same (name, box) hold replicas.
struct WriteItem {
  std::string name;
  ItemKind kind = ItemKind::kTensor;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> global_shape;
  Box box;  // the region this rank holds, in global coordinates
};

struct LocalPlan {
  int rank = 0;
  std::vector<WriteItem> items;
};

// A region this rank must write: its held box or, for a large replicated
// region, a dim-0 row range of it.
struct WriteAssignment {
  std::string name;
  Box box;

  friend bool operator==(const WriteAssignment& a, const WriteAssignment& b) {
    return a.name == b.name && a.box == b.box;
  }
};

struct GlobalPlan {
  std::vector<std::vector<WriteAssignment>> per_rank;  // indexed by rank
  std::vector<uint64_t> bytes_per_rank;                 // logical bytes to write
};

struct PlanOptions {
  // Replicated regions smaller than this are written whole by one holder;
  // larger ones are split along dim 0 across their holders.
  uint64_t split_min_bytes = 1 << 20;
  // Pieces of a split region are at least this big (a region of B bytes goes
  // to at most B / min_piece_bytes holders): at thousands of replicas, tiny
  // pieces would cost more in metadata, and in every loading rank's reads of
  // it, than they save in balance. 0: split across every holder.
  uint64_t min_piece_bytes = 1 << 20;
};

// The planner, fed one local plan at a time (the coordinator decodes and adds
// each as it goes, so it never holds every rank's plan at once). Memory: a
// few dozen bytes per held region, plus the plan. Not thread-safe.
class GlobalPlanner {
 public:
  GlobalPlanner(size_t world, PlanOptions options);
  ~GlobalPlanner();
  GlobalPlanner(const GlobalPlanner&) = delete;
  GlobalPlanner& operator=(const GlobalPlanner&) = delete;

  // Adds rank plan.rank's plan. REQUIRES: ranks added in increasing order,
  // each < world. Throws PlanError on a bad declaration or a disagreement
  // with an earlier rank.
  void add(const LocalPlan& plan);
  // add(decode_local_plan(data, size)) without building the plan: items
  // declared as on an earlier rank are appended in place. Returns the rank.
  // Throws PlanError as both would.
  int add_encoded(const uint8_t* data, size_t size);
  // The plan (make_global_plan's, below); `declarations`, when given, gets
  // every item as first declared (box empty), in order of first appearance.
  // The planner is empty afterwards.
  GlobalPlan finish(std::vector<WriteItem>* declarations = nullptr);

 private:
  struct Item;
  void start_rank(int rank);
  void add_item(const WriteItem& w, int rank);

  size_t world_;
  PlanOptions options_;
  int next_rank_ = 0;
  size_t hint_ = 0;  // the item expected next in the current rank's plan
  std::vector<std::unique_ptr<Item>> items_;
  std::unordered_map<std::string, size_t> index_;
};

// Builds the global plan from every rank's local plan.
//   - Regions held by one rank are written by that rank.
//   - A region held by several ranks (same name and box) is written exactly
//     once: split along dim 0 into up to min(|holders|, rows, bytes /
//     min_piece_bytes) pieces if it is a tensor of >= split_min_bytes with
//     ndim >= 1, each piece going to a different holder; pieces are assigned
//     largest first to the least-loaded holder.
//   - Empty tensor regions are accepted and need no write; a bytes item is
//     always written (as one chunk), even when empty.
// Every item's assignments tile its global shape exactly.
// REQUIRES: plans[i].rank are 0..plans.size()-1 in some order.
// Throws PlanError when ranks disagree on an item's kind, dtype or shape, when
// a box is out of bounds or of the wrong rank, or when the distinct boxes of an
// item leave a gap or partially overlap.
GlobalPlan make_global_plan(const std::vector<LocalPlan>& plans, const PlanOptions& options);

// find_tiling_problem and check_tiling (box geometry) are declared in
// format/types.h.

// Byte-blob codecs for plans: save gathers encode_local_plan's blobs at the
// coordinator and scatters encode_assignments' to each rank. Decoders are bounds-checked and throw
// PlanError on malformed input.
std::vector<uint8_t> encode_local_plan(const LocalPlan& plan);
LocalPlan decode_local_plan(const uint8_t* data, size_t size);
std::vector<uint8_t> encode_assignments(const std::vector<WriteAssignment>& assignments);
std::vector<WriteAssignment> decode_assignments(const uint8_t* data, size_t size);

}  // namespace checkpoint
