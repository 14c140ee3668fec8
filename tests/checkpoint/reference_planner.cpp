// The save planner as it was before it became a streaming, flat-memory
// planner (issue "Scale"): kept verbatim as the oracle that the new one must
// match plan for plan (test_planner.cpp, PlannerMatchesTheReference*).
#include "reference_planner.h"

#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>

namespace checkpoint::reference {

namespace {

std::string ranks_to_string(const std::vector<int>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(ranks[i]);
  }
  return out + "]";
}

}  // namespace

namespace {

struct ItemState {
  const WriteItem* first = nullptr;  // as declared by the first rank holding it
  int first_rank = 0;
  std::map<Box, std::vector<int>> holders;  // distinct box -> ranks holding it
};

[[noreturn]] void fail_item(const std::string& item, const std::string& why) {
  throw PlanError("item '" + item + "': " + why);
}

void check_item_declaration(const WriteItem& item, int rank) {
  if (item.name.empty()) throw PlanError("rank " + std::to_string(rank) + " holds an item with an empty name");
  if (item.global_shape.size() > kMaxNdim) {
    fail_item(item.name, "rank " + std::to_string(rank) + " declares " +
                             std::to_string(item.global_shape.size()) + " dims (limit " +
                             std::to_string(kMaxNdim) + ")");
  }
  const std::optional<uint64_t> numel = checked_numel(item.global_shape);
  const uint64_t esize = element_size(item.dtype);
  if (esize == 0 || !is_known_item_kind(static_cast<uint8_t>(item.kind))) {
    fail_item(item.name, "rank " + std::to_string(rank) + " declares an unknown kind or dtype");
  }
  if (!numel || *numel > kMaxItemBytes / esize) {
    fail_item(item.name, "rank " + std::to_string(rank) + " declares shape " +
                             shape_to_string(item.global_shape) +
                             " with a negative dim or more than 1 PiB");
  }
  if (item.kind == ItemKind::kBytes) {
    if (item.dtype != DType::kUInt8 || item.global_shape.size() != 1) {
      fail_item(item.name, "rank " + std::to_string(rank) +
                               ": a bytes item must be a 1-D uint8 tensor, got " +
                               dtype_name(item.dtype) + " " + shape_to_string(item.global_shape));
    }
    if (item.box != full_box(item.global_shape)) {
      fail_item(item.name, "rank " + std::to_string(rank) + " holds part " +
                               box_to_string(item.box) + " of a bytes item; bytes items are whole");
    }
  }
}

void check_agreement(const WriteItem& item, int rank, const ItemState& state) {
  const WriteItem& first = *state.first;
  const std::string who = "rank " + std::to_string(state.first_rank) + " has ";
  const std::string other = " but rank " + std::to_string(rank) + " has ";
  if (item.kind != first.kind) {
    fail_item(item.name, who + "kind " + item_kind_name(first.kind) + other + item_kind_name(item.kind));
  }
  if (item.dtype != first.dtype) {
    fail_item(item.name, who + "dtype " + dtype_name(first.dtype) + other + dtype_name(item.dtype));
  }
  if (item.global_shape != first.global_shape) {
    fail_item(item.name, who + "global shape " + shape_to_string(first.global_shape) + other +
                             shape_to_string(item.global_shape));
  }
}

std::vector<const LocalPlan*> plans_by_rank(const std::vector<LocalPlan>& plans) {
  std::vector<const LocalPlan*> by_rank(plans.size(), nullptr);
  for (const LocalPlan& plan : plans) {
    if (plan.rank < 0 || static_cast<size_t>(plan.rank) >= plans.size()) {
      throw PlanError("local plan of rank " + std::to_string(plan.rank) + " is out of range for " +
                      std::to_string(plans.size()) + " plans");
    }
    if (by_rank[plan.rank]) throw PlanError("two local plans claim rank " + std::to_string(plan.rank));
    by_rank[plan.rank] = &plan;
  }
  return by_rank;
}

// A replicated region (or a dim-0 piece of one) waiting for a writer.
struct ReplicatedPart {
  size_t item;
  size_t region;  // pieces of one region go to different holders
  Box box;
  uint64_t bytes;
  const std::vector<int>* holders;
};

std::vector<Box> split_rows(const Box& box, size_t parts) {
  const int64_t rows = box.sizes[0];
  const int64_t base = rows / static_cast<int64_t>(parts);
  const int64_t extra = rows % static_cast<int64_t>(parts);
  std::vector<Box> out;
  int64_t start = box.offsets[0];
  for (size_t p = 0; p < parts; ++p) {
    Box piece = box;
    piece.offsets[0] = start;
    piece.sizes[0] = base + (static_cast<int64_t>(p) < extra ? 1 : 0);
    start += piece.sizes[0];
    out.push_back(std::move(piece));
  }
  return out;
}

}  // namespace

GlobalPlan make_global_plan(const std::vector<LocalPlan>& plans, const PlanOptions& options) {
  const std::vector<const LocalPlan*> by_rank = plans_by_rank(plans);
  std::vector<ItemState> items;  // in order of first appearance, by rank
  std::unordered_map<std::string, size_t> index;
  for (const LocalPlan* plan : by_rank) {
    for (const WriteItem& item : plan->items) {
      auto [it, inserted] = index.emplace(item.name, items.size());
      if (inserted) {
        check_item_declaration(item, plan->rank);
        items.push_back(ItemState{&item, plan->rank, {}});
      } else {
        check_agreement(item, plan->rank, items[it->second]);
      }
      std::vector<int>& holders = items[it->second].holders[item.box];
      if (!holders.empty() && holders.back() == plan->rank) {
        fail_item(item.name, "rank " + std::to_string(plan->rank) + " holds box " +
                                 box_to_string(item.box) + " twice");
      }
      holders.push_back(plan->rank);
    }
  }

  for (const ItemState& state : items) {
    std::vector<Box> boxes;
    std::vector<const std::vector<int>*> holders;
    for (const auto& [box, ranks] : state.holders) boxes.push_back(box), holders.push_back(&ranks);
    if (auto problem = find_tiling_problem(state.first->global_shape, boxes)) {
      std::string msg = problem->message;
      for (auto i : {problem->first, problem->second}) {
        if (i) msg += "; box " + std::to_string(*i) + " is held by ranks " + ranks_to_string(*holders[*i]);
      }
      fail_item(state.first->name, msg);
    }
  }

  GlobalPlan plan;
  plan.per_rank.resize(plans.size());
  plan.bytes_per_rank.assign(plans.size(), 0);
  std::vector<std::vector<std::pair<size_t, Box>>> assigned(plans.size());
  std::vector<ReplicatedPart> pieces;
  size_t region_count = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const WriteItem& first = *items[i].first;
    const uint64_t esize = element_size(first.dtype);
    for (const auto& [box, ranks] : items[i].holders) {
      const size_t region = region_count++;
      if (first.kind == ItemKind::kTensor && box.is_empty()) continue;
      const uint64_t bytes = static_cast<uint64_t>(box.numel()) * esize;
      if (ranks.size() == 1) {
        assigned[ranks[0]].emplace_back(i, box);
        plan.bytes_per_rank[ranks[0]] += bytes;
        continue;
      }
      const bool splittable = first.kind == ItemKind::kTensor && box.ndim() >= 1 &&
                              bytes >= options.split_min_bytes && box.sizes[0] >= 2;
      const size_t parts =
          splittable ? std::min<size_t>(ranks.size(), static_cast<size_t>(box.sizes[0])) : 1;
      std::vector<Box> split = parts > 1 ? split_rows(box, parts) : std::vector<Box>{box};
      for (Box& piece : split) {
        const uint64_t piece_bytes = static_cast<uint64_t>(piece.numel()) * esize;
        pieces.push_back(ReplicatedPart{i, region, std::move(piece), piece_bytes, &ranks});
      }
    }
  }

  // Largest first to the least-loaded holder (ties: lowest rank) balances
  // bytes; the order is total so every coordinator computes the same plan.
  std::sort(pieces.begin(), pieces.end(), [](const ReplicatedPart& a, const ReplicatedPart& b) {
    if (a.bytes != b.bytes) return a.bytes > b.bytes;
    if (a.item != b.item) return a.item < b.item;
    return a.box < b.box;
  });
  std::map<size_t, std::set<int>> used;  // region -> holders already given a piece
  for (const ReplicatedPart& piece : pieces) {
    std::set<int>& taken = used[piece.region];
    int best = -1;
    for (int r : *piece.holders) {
      if (taken.count(r)) continue;
      if (best < 0 || plan.bytes_per_rank[r] < plan.bytes_per_rank[best]) best = r;
    }
    taken.insert(best);
    plan.bytes_per_rank[best] += piece.bytes;
    assigned[best].emplace_back(piece.item, piece.box);
  }

  for (size_t r = 0; r < assigned.size(); ++r) {
    std::sort(assigned[r].begin(), assigned[r].end());
    for (auto& [item, box] : assigned[r]) {
      plan.per_rank[r].push_back(WriteAssignment{items[item].first->name, std::move(box)});
    }
  }
  return plan;
}

}  // namespace checkpoint::reference
