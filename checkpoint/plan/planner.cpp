#include "checkpoint/plan/planner.h"

#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "checkpoint/format/wire.h"

namespace checkpoint {

namespace {

// "[0, 3]": ranks as shape_to_string writes dims.
std::string ranks_to_string(const std::vector<int>& ranks) {
  return shape_to_string(std::vector<int64_t>(ranks.begin(), ranks.end()));
}

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

void check_agreement(const WriteItem& item, int rank, const WriteItem& first, int first_rank) {
  const std::string who = "rank " + std::to_string(first_rank) + " has ";
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

// What the planner holds per item: the first declaration, and every (box,
// rank) it was given, flat (2 x ndim int64 per box), so that memory is a few
// dozen bytes per held region at any world size.
struct GlobalPlanner::Item {
  WriteItem first;  // as declared by the first rank holding it
  int first_rank = 0;
  std::vector<int64_t> coords;  // per entry: offsets then sizes
  std::vector<int32_t> ranks;   // per entry
  std::vector<std::pair<Box, int>> odd;  // boxes of another rank than the shape's
};

GlobalPlanner::GlobalPlanner(size_t world, PlanOptions options)
    : world_(world), options_(options) {}
GlobalPlanner::~GlobalPlanner() = default;

void GlobalPlanner::start_rank(int rank) {
  if (rank < 0 || static_cast<size_t>(rank) >= world_ || rank < next_rank_) {
    throw PlanError("local plan of rank " + std::to_string(rank) + " is out of range or order for " +
                    std::to_string(world_) + " plans");
  }
  next_rank_ = rank + 1;
  hint_ = 0;
}

void GlobalPlanner::add_item(const WriteItem& w, int rank) {
  auto [it, inserted] = index_.emplace(w.name, items_.size());
  if (inserted) {
    check_item_declaration(w, rank);
    items_.push_back(std::make_unique<Item>());
    items_.back()->first = WriteItem{w.name, w.kind, w.dtype, w.global_shape, Box{}};
    items_.back()->first_rank = rank;
  } else {
    const Item& first = *items_[it->second];
    check_agreement(w, rank, first.first, first.first_rank);
  }
  hint_ = it->second + 1;
  Item& item = *items_[it->second];
  const size_t ndim = item.first.global_shape.size();
  if (w.box.offsets.size() != ndim || w.box.sizes.size() != ndim) {
    item.odd.emplace_back(w.box, rank);
    return;
  }
  item.coords.insert(item.coords.end(), w.box.offsets.begin(), w.box.offsets.end());
  item.coords.insert(item.coords.end(), w.box.sizes.begin(), w.box.sizes.end());
  item.ranks.push_back(rank);
}

void GlobalPlanner::add(const LocalPlan& plan) {
  start_rank(plan.rank);
  for (const WriteItem& w : plan.items) add_item(w, plan.rank);
}

namespace {

// A distinct box of one item and the ranks holding it (ascending).
struct Region {
  Box box;
  std::vector<int> holders;
};

// The item's distinct boxes in Box order (as std::map<Box, ...> would list
// them), each with its holders.
std::vector<Region> group_regions(const WriteItem& first, const std::vector<int64_t>& coords,
                                  const std::vector<int32_t>& ranks,
                                  const std::vector<std::pair<Box, int>>& odd) {
  const size_t ndim = first.global_shape.size();
  const size_t n = ranks.size();
  std::vector<uint32_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<uint32_t>(i);
  auto at = [&](uint32_t i) { return coords.data() + static_cast<size_t>(i) * 2 * ndim; };
  // Lexicographic by offsets then sizes is lexicographic over the 2*ndim
  // coordinates; ties by rank keep holders ascending.
  auto before = [&](uint32_t a, uint32_t b) {
    const int64_t* x = at(a);
    const int64_t* y = at(b);
    for (size_t d = 0; d < 2 * ndim; ++d) {
      if (x[d] != y[d]) return x[d] < y[d];
    }
    return ranks[a] < ranks[b];
  };
  // Shards arrive in rank order, usually already in Box order (FSDP).
  if (!std::is_sorted(order.begin(), order.end(), before)) std::sort(order.begin(), order.end(), before);
  std::vector<Region> regions;
  for (size_t k = 0; k < n; ++k) {
    const int64_t* c = at(order[k]);
    const bool same = k > 0 && std::equal(c, c + 2 * ndim, at(order[k - 1]));
    if (!same) {
      Region r;
      r.box.offsets.assign(c, c + ndim);
      r.box.sizes.assign(c + ndim, c + 2 * ndim);
      regions.push_back(std::move(r));
    } else if (regions.back().holders.back() == ranks[order[k]]) {
      fail_item(first.name, "rank " + std::to_string(ranks[order[k]]) + " holds box " +
                                box_to_string(regions.back().box) + " twice");
    }
    regions.back().holders.push_back(ranks[order[k]]);
  }
  if (!odd.empty()) {
    // Boxes of the wrong rank: merged in Box order so that the tiling check
    // below names them as it always did.
    std::map<Box, std::vector<int>> all;
    for (Region& r : regions) all.emplace(std::move(r.box), std::move(r.holders));
    for (const auto& [box, rank] : odd) all[box].push_back(rank);
    regions.clear();
    for (auto& [box, holders] : all) {
      std::sort(holders.begin(), holders.end());
      regions.push_back(Region{box, holders});
    }
  }
  return regions;
}

// True when the non-empty regions are a one-dim partition of the shape that
// tiles it (the FSDP case), shown in one pass over the Box-ordered regions
// (for such a partition, Box order is order along the split dim). False means
// "not shown": the general check then runs and names the problem.
bool tiles_as_partition(const std::vector<int64_t>& shape, const std::vector<Region>& regions) {
  const size_t ndim = shape.size();
  if (ndim == 0) return false;
  bool whole_seen = false;
  int split = -1;
  int64_t next = 0;
  size_t nonempty = 0;
  for (const Region& r : regions) {
    const Box& b = r.box;
    bool empty = false;
    for (size_t d = 0; d < ndim; ++d) {
      if (b.offsets[d] < 0 || b.sizes[d] < 0 || b.offsets[d] > shape[d] ||
          b.sizes[d] > shape[d] - b.offsets[d]) {
        return false;
      }
      empty = empty || b.sizes[d] == 0;
    }
    if (empty) continue;
    ++nonempty;
    int here = -1;
    for (size_t d = 0; d < ndim; ++d) {
      if (b.offsets[d] == 0 && b.sizes[d] == shape[d]) continue;
      if (here >= 0) return false;
      here = static_cast<int>(d);
    }
    if (here < 0) {
      if (nonempty != 1) return false;
      whole_seen = true;
      continue;
    }
    if (whole_seen || (split >= 0 && split != here)) return false;
    split = here;
    if (b.offsets[split] != next) return false;
    next += b.sizes[split];
  }
  if (whole_seen) return true;
  if (nonempty == 0) return checked_numel(shape).value_or(1) == 0;
  return next == shape[static_cast<size_t>(split)];
}

// A replicated region (or a dim-0 piece of one) waiting for a writer.
struct ReplicatedPart {
  size_t item;
  size_t region;  // pieces of one region go to different holders
  Box box;
  uint64_t bytes;
  size_t holder_set;
};

// What finish builds up: each rank's (item index, box) pairs and byte load,
// and the replicated pieces still waiting for a writer.
struct Assignment {
  explicit Assignment(size_t world) : per_rank(world), bytes_per_rank(world, 0) {}
  std::vector<std::vector<std::pair<size_t, Box>>> per_rank;
  std::vector<uint64_t> bytes_per_rank;
  std::vector<ReplicatedPart> pieces;
  std::vector<std::vector<int>> holder_sets;  // distinct holder lists
  std::map<std::vector<int>, size_t> holder_set_ids;
  size_t region_count = 0;
};

// Throws PlanError naming the item and the holders of the boxes involved when
// the item's distinct boxes do not tile its shape. `odd`: some box has the
// wrong rank (the fast partition check does not apply).
void check_item_tiling(const WriteItem& first, const std::vector<Region>& regions, bool odd) {
  if (!odd && tiles_as_partition(first.global_shape, regions)) return;
  std::vector<Box> boxes;
  boxes.reserve(regions.size());
  for (const Region& r : regions) boxes.push_back(r.box);
  if (auto problem = find_tiling_problem(first.global_shape, boxes)) {
    std::string msg = problem->message;
    for (auto k : {problem->first, problem->second}) {
      if (k) msg += "; box " + std::to_string(*k) + " is held by ranks " + ranks_to_string(regions[*k].holders);
    }
    fail_item(first.name, msg);
  }
}

// Item `item`'s regions: one held by a single rank goes to it; a replicated
// one becomes pieces (dim-0 row ranges when large enough) for its holders.
void assign_item_regions(size_t item, const WriteItem& first, std::vector<Region>& regions,
                         const PlanOptions& options, Assignment& out) {
  const uint64_t esize = element_size(first.dtype);
  for (Region& r : regions) {
    const size_t region = out.region_count++;
    if (first.kind == ItemKind::kTensor && r.box.is_empty()) continue;
    const uint64_t bytes = static_cast<uint64_t>(r.box.numel()) * esize;
    if (r.holders.size() == 1) {
      out.bytes_per_rank[r.holders[0]] += bytes;
      out.per_rank[r.holders[0]].emplace_back(item, std::move(r.box));
      continue;
    }
    const bool splittable = first.kind == ItemKind::kTensor && r.box.ndim() >= 1 &&
                            bytes >= options.split_min_bytes && r.box.sizes[0] >= 2;
    size_t parts =
        splittable ? std::min<size_t>(r.holders.size(), static_cast<size_t>(r.box.sizes[0])) : 1;
    if (options.min_piece_bytes > 0) {
      parts = std::min<size_t>(parts, std::max<uint64_t>(1, bytes / options.min_piece_bytes));
    }
    auto [set_it, fresh] = out.holder_set_ids.emplace(r.holders, out.holder_sets.size());
    if (fresh) out.holder_sets.push_back(std::move(r.holders));
    std::vector<Box> split = parts > 1 ? split_rows(r.box, parts) : std::vector<Box>{r.box};
    for (Box& piece : split) {
      const uint64_t piece_bytes = static_cast<uint64_t>(piece.numel()) * esize;
      out.pieces.push_back(ReplicatedPart{item, region, std::move(piece), piece_bytes, set_it->second});
    }
  }
}

// Largest first to the least-loaded holder not yet given a piece of the
// same region (ties: lowest rank); the order is total so the plan is a
// pure function of the plans. Each distinct holder list keeps its holders
// ordered by (load, rank), so a choice costs a few ordered-set steps.
void assign_replicated_pieces(Assignment& out) {
  out.holder_set_ids.clear();
  std::vector<ReplicatedPart>& pieces = out.pieces;
  std::sort(pieces.begin(), pieces.end(), [](const ReplicatedPart& a, const ReplicatedPart& b) {
    if (a.bytes != b.bytes) return a.bytes > b.bytes;
    if (a.item != b.item) return a.item < b.item;
    return a.box < b.box;
  });
  std::vector<std::set<std::pair<uint64_t, int>>> by_load(out.holder_sets.size());
  std::vector<std::vector<size_t>> sets_of_rank(out.per_rank.size());
  for (size_t s = 0; s < out.holder_sets.size(); ++s) {
    for (int r : out.holder_sets[s]) {
      by_load[s].emplace(out.bytes_per_rank[r], r);
      sets_of_rank[r].push_back(s);
    }
  }
  std::unordered_set<uint64_t> taken;  // (region << 32) | rank
  for (ReplicatedPart& piece : pieces) {
    int best = -1;
    for (const auto& [load, r] : by_load[piece.holder_set]) {
      if (!taken.count(static_cast<uint64_t>(piece.region) << 32 | static_cast<uint32_t>(r))) {
        best = r;
        break;
      }
    }
    taken.insert(static_cast<uint64_t>(piece.region) << 32 | static_cast<uint32_t>(best));
    const uint64_t old_load = out.bytes_per_rank[best];
    out.bytes_per_rank[best] += piece.bytes;
    for (size_t s : sets_of_rank[best]) {
      by_load[s].erase({old_load, best});
      by_load[s].emplace(out.bytes_per_rank[best], best);
    }
    out.per_rank[best].emplace_back(piece.item, std::move(piece.box));
  }
  pieces = {};
}

}  // namespace

GlobalPlan GlobalPlanner::finish(std::vector<WriteItem>* declarations) {
  Assignment assignment(world_);
  for (size_t i = 0; i < items_.size(); ++i) {
    Item& item = *items_[i];
    std::vector<Region> regions = group_regions(item.first, item.coords, item.ranks, item.odd);
    const bool odd = !item.odd.empty();
    item.coords = {};
    item.ranks = {};
    item.odd = {};
    check_item_tiling(item.first, regions, odd);
    assign_item_regions(i, item.first, regions, options_, assignment);
  }
  assign_replicated_pieces(assignment);

  GlobalPlan plan;
  plan.per_rank.resize(world_);
  plan.bytes_per_rank = std::move(assignment.bytes_per_rank);
  for (size_t r = 0; r < assignment.per_rank.size(); ++r) {
    std::vector<std::pair<size_t, Box>>& boxes = assignment.per_rank[r];
    std::sort(boxes.begin(), boxes.end());
    plan.per_rank[r].reserve(boxes.size());
    for (auto& [item, box] : boxes) {
      plan.per_rank[r].push_back(WriteAssignment{items_[item]->first.name, std::move(box)});
    }
    boxes = {};
  }
  if (declarations) {
    declarations->clear();
    for (auto& item : items_) declarations->push_back(std::move(item->first));
  }
  items_.clear();
  index_.clear();
  return plan;
}

GlobalPlan make_global_plan(const std::vector<LocalPlan>& plans, const PlanOptions& options) {
  GlobalPlanner planner(plans.size(), options);
  for (const LocalPlan* plan : plans_by_rank(plans)) planner.add(*plan);
  return planner.finish();
}

// ---- plan blobs --------------------------------------------------------------

namespace {

constexpr uint32_t kLocalPlanTag = 0x504c4b53;    // "SKLP"
constexpr uint32_t kAssignmentsTag = 0x41574b53;  // "SKWA"

void put_box(wire::ByteWriter& w, const Box& box) {
  w.put_varint(box.sizes.size());
  wire::put_dims(w, box.offsets);
  wire::put_dims(w, box.sizes);
}

Box get_box(wire::ByteReader& r) {
  const size_t ndim = r.get_varint_max(kMaxNdim, "box rank");
  Box box;
  box.offsets = wire::get_dims(r, ndim, "box offset");
  box.sizes = wire::get_dims(r, ndim, "box size");
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
    wire::put_item_header(w, item.name, item.kind, item.dtype, item.global_shape);
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
      item.name = std::string(wire::get_item_header(r, &item.kind, &item.dtype, &item.global_shape));
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

int GlobalPlanner::add_encoded(const uint8_t* data, size_t size) {
  return decode_blob("local plan", kLocalPlanTag, data, size, [&](wire::ByteReader& r) {
    const int64_t rank = r.get_zigzag("rank");
    if (rank < 0 || rank > INT32_MAX) r.fail("rank", std::to_string(rank) + " is out of range");
    start_rank(static_cast<int>(rank));
    const uint64_t count = r.get_count(5, "item count");
    WriteItem slow;
    std::vector<int64_t> shape;
    for (uint64_t n = 0; n < count; ++n) {
      ItemKind kind;
      DType dtype;
      const std::string_view name = wire::get_item_header(r, &kind, &dtype, &shape);
      const size_t ndim = shape.size();
      const size_t box_ndim = r.get_varint_max(kMaxNdim, "box rank");
      // The common case: the item the previous one was followed by on an
      // earlier rank, declared the same, with a box of its rank: appended
      // without building a WriteItem.
      if (hint_ < items_.size()) {
        Item& item = *items_[hint_];
        const WriteItem& first = item.first;
        if (first.name == name && first.kind == kind && first.dtype == dtype && first.global_shape == shape &&
            box_ndim == ndim) {
          for (size_t d = 0; d < 2 * ndim; ++d) {
            item.coords.push_back(r.get_zigzag(d < ndim ? "box offset" : "box size"));
          }
          item.ranks.push_back(static_cast<int32_t>(rank));
          ++hint_;
          continue;
        }
      }
      slow.name.assign(name.data(), name.size());
      slow.kind = kind;
      slow.dtype = dtype;
      slow.global_shape = shape;
      slow.box.offsets = wire::get_dims(r, box_ndim, "box offset");
      slow.box.sizes = wire::get_dims(r, box_ndim, "box size");
      add_item(slow, static_cast<int>(rank));
    }
    return static_cast<int>(rank);
  });
}

}  // namespace checkpoint
