#include "checkpoint/plan/planner.h"

#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>

#include "checkpoint/format/wire.h"

namespace checkpoint {

namespace {

std::string ranks_to_string(const std::vector<int>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(ranks[i]);
  }
  return out + "]";
}

std::string box_problem(size_t i, const Box& box, const std::string& why) {
  return "box " + std::to_string(i) + " " + box_to_string(box) + " " + why;
}

// Picks the dim whose offsets vary most, so the sweep below prunes well for
// boxes sharded along any one dim.
size_t choose_sweep_dim(const std::vector<Box>& boxes, const std::vector<size_t>& live,
                        size_t ndim) {
  size_t best = 0, best_distinct = 0;
  for (size_t d = 0; d < ndim; ++d) {
    std::set<int64_t> offsets;
    for (size_t i : live) offsets.insert(boxes[i].offsets[d]);
    if (offsets.size() > best_distinct) best = d, best_distinct = offsets.size();
  }
  return best;
}

std::optional<TilingProblem> find_overlap(const std::vector<Box>& boxes, std::vector<size_t> live,
                                          size_t ndim) {
  if (ndim == 0) {
    if (live.size() > 1) return TilingProblem{"scalar boxes overlap", live[0], live[1]};
    return std::nullopt;
  }
  size_t d = choose_sweep_dim(boxes, live, ndim);
  std::sort(live.begin(), live.end(), [&](size_t a, size_t b) {
    return boxes[a].offsets[d] < boxes[b].offsets[d];
  });
  std::vector<size_t> active;
  for (size_t i : live) {
    const int64_t start = boxes[i].offsets[d];
    active.erase(std::remove_if(active.begin(), active.end(),
                                [&](size_t j) {
                                  return boxes[j].offsets[d] + boxes[j].sizes[d] <= start;
                                }),
                 active.end());
    for (size_t j : active) {
      if (intersect(boxes[i], boxes[j])) {
        return TilingProblem{"box " + std::to_string(j) + " " + box_to_string(boxes[j]) +
                                 " and box " + std::to_string(i) + " " + box_to_string(boxes[i]) +
                                 " overlap",
                             j, i};
      }
    }
    active.push_back(i);
  }
  return std::nullopt;
}

}  // namespace

std::optional<TilingProblem> find_tiling_problem(const std::vector<int64_t>& global_shape,
                                                 const std::vector<Box>& boxes) {
  const std::optional<uint64_t> total = checked_numel(global_shape);
  if (!total) {
    return TilingProblem{"global shape " + shape_to_string(global_shape) +
                             " has a negative dim or too many elements",
                         std::nullopt, std::nullopt};
  }
  const size_t ndim = global_shape.size();
  std::vector<size_t> live;  // boxes holding at least one element
  for (size_t i = 0; i < boxes.size(); ++i) {
    const Box& box = boxes[i];
    if (box.sizes.size() != ndim || box.offsets.size() != ndim) {
      return TilingProblem{box_problem(i, box, "has rank " + std::to_string(box.sizes.size()) +
                                                   " but the shape has rank " +
                                                   std::to_string(ndim)),
                           i, std::nullopt};
    }
    bool empty = false;
    for (size_t d = 0; d < ndim; ++d) {
      const int64_t off = box.offsets[d], size = box.sizes[d], dim = global_shape[d];
      if (off < 0 || size < 0 || off > dim || size > dim - off) {
        return TilingProblem{box_problem(i, box, "is out of bounds of shape " +
                                                     shape_to_string(global_shape)),
                             i, std::nullopt};
      }
      empty = empty || size == 0;
    }
    if (!empty) live.push_back(i);
  }
  if (auto overlap = find_overlap(boxes, live, ndim)) return overlap;
  // In bounds and disjoint, so the sum cannot exceed (or overflow past) total.
  uint64_t covered = 0;
  for (size_t i : live) covered += static_cast<uint64_t>(boxes[i].numel());
  if (covered != *total) {
    return TilingProblem{"chunks cover " + std::to_string(covered) + " of " +
                             std::to_string(*total) + " elements of shape " +
                             shape_to_string(global_shape) + " (a gap)",
                         std::nullopt, std::nullopt};
  }
  return std::nullopt;
}

void check_tiling(const std::vector<int64_t>& global_shape, const std::vector<Box>& boxes,
                  const std::string& item) {
  if (auto problem = find_tiling_problem(global_shape, boxes)) {
    throw PlanError("item '" + item + "': " + problem->message);
  }
}

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

// ---- plan blobs --------------------------------------------------------------

namespace {

constexpr uint32_t kLocalPlanTag = 0x504c4b53;    // "SKLP"
constexpr uint32_t kAssignmentsTag = 0x41574b53;  // "SKWA"

void put_dims(wire::ByteWriter& w, const std::vector<int64_t>& dims) {
  for (int64_t v : dims) w.put_zigzag(v);
}

std::vector<int64_t> get_dims(wire::ByteReader& r, size_t n, const char* what) {
  std::vector<int64_t> dims(n);
  for (auto& v : dims) v = r.get_zigzag(what);
  return dims;
}

void put_box(wire::ByteWriter& w, const Box& box) {
  w.put_varint(box.sizes.size());
  put_dims(w, box.offsets);
  put_dims(w, box.sizes);
}

Box get_box(wire::ByteReader& r) {
  const size_t ndim = r.get_varint_max(kMaxNdim, "box rank");
  Box box;
  box.offsets = get_dims(r, ndim, "box offset");
  box.sizes = get_dims(r, ndim, "box size");
  return box;
}

template <typename Fn>
auto decode_blob(const char* what, uint32_t tag, const uint8_t* data, size_t size, Fn&& body) {
  try {
    wire::ByteReader r(data, size);
    if (r.get_u32("tag") != tag) r.fail("tag", "not a " + std::string(what));
    auto out = body(r);
    if (!r.at_end()) r.fail("end", std::to_string(r.remaining()) + " trailing bytes");
    return out;
  } catch (const wire::WireError& e) {
    throw PlanError(std::string(what) + " blob: " + e.what());
  }
}

}  // namespace

std::vector<uint8_t> encode_local_plan(const LocalPlan& plan) {
  wire::ByteWriter w;
  w.put_u32(kLocalPlanTag);
  w.put_zigzag(plan.rank);
  w.put_varint(plan.items.size());
  for (const WriteItem& item : plan.items) {
    w.put_string(item.name);
    w.put_u8(static_cast<uint8_t>(item.kind));
    w.put_u8(static_cast<uint8_t>(item.dtype));
    w.put_varint(item.global_shape.size());
    put_dims(w, item.global_shape);
    put_box(w, item.box);
  }
  return w.release();
}

LocalPlan decode_local_plan(const uint8_t* data, size_t size) {
  return decode_blob("local plan", kLocalPlanTag, data, size, [](wire::ByteReader& r) {
    LocalPlan plan;
    const int64_t rank = r.get_zigzag("rank");
    if (rank < 0 || rank > INT32_MAX) r.fail("rank", std::to_string(rank) + " is out of range");
    plan.rank = static_cast<int>(rank);
    // name length, kind, dtype, ndim, box rank: at least 5 bytes per item
    plan.items.resize(r.get_count(5, "item count"));
    for (WriteItem& item : plan.items) {
      item.name = r.get_string(kMaxNameLength, "item name");
      const uint8_t kind = r.get_u8("item kind");
      if (!is_known_item_kind(kind)) r.fail("item kind", "unknown code " + std::to_string(kind));
      item.kind = static_cast<ItemKind>(kind);
      const uint8_t dtype = r.get_u8("dtype");
      if (!is_known_dtype(dtype)) r.fail("dtype", "unknown code " + std::to_string(dtype));
      item.dtype = static_cast<DType>(dtype);
      item.global_shape = get_dims(r, r.get_varint_max(kMaxNdim, "rank"), "global shape");
      item.box = get_box(r);
    }
    return plan;
  });
}

std::vector<uint8_t> encode_assignments(const std::vector<WriteAssignment>& assignments) {
  wire::ByteWriter w;
  w.put_u32(kAssignmentsTag);
  w.put_varint(assignments.size());
  for (const WriteAssignment& a : assignments) {
    w.put_string(a.name);
    put_box(w, a.box);
  }
  return w.release();
}

std::vector<WriteAssignment> decode_assignments(const uint8_t* data, size_t size) {
  return decode_blob("assignments", kAssignmentsTag, data, size, [](wire::ByteReader& r) {
    std::vector<WriteAssignment> out(r.get_count(2, "assignment count"));
    for (WriteAssignment& a : out) {
      a.name = r.get_string(kMaxNameLength, "assignment name");
      a.box = get_box(r);
    }
    return out;
  });
}

}  // namespace checkpoint
