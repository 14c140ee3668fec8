#pragma once
// Save planning, DCP-style: pure functions from what every rank holds to what
// every rank writes. No I/O, no communication; tests call these directly.
//
// Call sequence during a save (save.cpp); no coordinator is involved:
//   (all ranks)   build a LocalPlan of the regions they hold; encode_local_plan
//   (all ranks)   all-gather the blobs; decode_local_plan each
//   (all ranks)   make_global_plan on the same plans: every rank computes the
//                 same GlobalPlan, so no assignments are sent
//   (all ranks)   write exactly the regions in plan.per_rank[own rank]
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/format/types.h"

namespace checkpoint {

// Any inconsistency between ranks' local plans, or a malformed plan blob. The
// message names the item and the ranks involved.
class PlanError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

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
};

// Builds the global plan from every rank's local plan.
//   - Regions held by one rank are written by that rank.
//   - A region held by several ranks (same name and box) is written exactly
//     once: split along dim 0 into up to |holders| pieces if it is a tensor of
//     >= split_min_bytes with ndim >= 1, each piece going to a different
//     holder; pieces are assigned largest first to the least-loaded holder.
//   - Empty tensor regions are accepted and need no write; a bytes item is
//     always written (as one chunk), even when empty.
// Every item's assignments tile its global shape exactly.
// REQUIRES: plans[i].rank are 0..plans.size()-1 in some order.
// Throws PlanError when ranks disagree on an item's kind, dtype or shape, when
// a box is out of bounds or of the wrong rank, or when the distinct boxes of an
// item leave a gap or partially overlap.
GlobalPlan make_global_plan(const std::vector<LocalPlan>& plans, const PlanOptions& options);

// A reason why boxes do not tile a shape, with the indices of the boxes
// involved (second is set for overlaps).
struct TilingProblem {
  std::string message;
  std::optional<size_t> first;
  std::optional<size_t> second;
};

// Checks that `boxes` tile `global_shape` exactly: every box has the shape's
// rank and lies in bounds, boxes are pairwise disjoint, and their element
// counts add up to the shape's. Empty boxes are allowed anywhere in bounds.
// Returns nullopt when they do. Safe on untrusted input (overflow-checked).
std::optional<TilingProblem> find_tiling_problem(const std::vector<int64_t>& global_shape,
                                                 const std::vector<Box>& boxes);

// find_tiling_problem, throwing PlanError("item '<item>': ...") on a problem.
void check_tiling(const std::vector<int64_t>& global_shape, const std::vector<Box>& boxes,
                  const std::string& item);

// Byte-blob codecs for plans. save all-gathers encode_local_plan's blobs;
// the assignment codec is for callers that send assignments (save does not:
// every rank computes its own). Decoders are bounds-checked and throw
// PlanError on malformed input.
std::vector<uint8_t> encode_local_plan(const LocalPlan& plan);
LocalPlan decode_local_plan(const uint8_t* data, size_t size);
std::vector<uint8_t> encode_assignments(const std::vector<WriteAssignment>& assignments);
std::vector<WriteAssignment> decode_assignments(const uint8_t* data, size_t size);

}  // namespace checkpoint
