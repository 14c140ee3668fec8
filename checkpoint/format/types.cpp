#include "checkpoint/format/types.h"

#include <algorithm>
#include <limits>
#include <set>
#include <utility>

namespace checkpoint {

namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kFloat32, "float32", 4}, {DType::kFloat64, "float64", 8},
    {DType::kFloat16, "float16", 2}, {DType::kBFloat16, "bfloat16", 2},
    {DType::kInt64, "int64", 8},     {DType::kInt32, "int32", 4},
    {DType::kInt16, "int16", 2},     {DType::kInt8, "int8", 1},
    {DType::kUInt8, "uint8", 1},     {DType::kBool, "bool", 1},
};

const DTypeInfo* find_dtype(DType dtype) {
  for (const auto& info : kDTypes) {
    if (info.dtype == dtype) return &info;
  }
  return nullptr;
}

}  // namespace

size_t element_size(DType dtype) {
  const DTypeInfo* info = find_dtype(dtype);
  return info ? info->size : 0;
}

const char* dtype_name(DType dtype) {
  const DTypeInfo* info = find_dtype(dtype);
  return info ? info->name : "unknown";
}

bool is_known_dtype(uint8_t code) {
  return find_dtype(static_cast<DType>(code)) != nullptr;
}

bool is_floating_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat64 || dtype == DType::kFloat16 ||
         dtype == DType::kBFloat16;
}

const char* item_kind_name(ItemKind kind) {
  switch (kind) {
    case ItemKind::kTensor: return "tensor";
    case ItemKind::kBytes: return "bytes";
  }
  return "unknown";
}

bool is_known_item_kind(uint8_t code) {
  return code == static_cast<uint8_t>(ItemKind::kTensor) ||
         code == static_cast<uint8_t>(ItemKind::kBytes);
}

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

Box full_box(const std::vector<int64_t>& shape) {
  return Box{std::vector<int64_t>(shape.size(), 0), shape};
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  if (a.ndim() != b.ndim() || a.offsets.size() != a.ndim() ||
      b.offsets.size() != b.ndim()) {
    return std::nullopt;
  }
  Box out;
  out.offsets.resize(a.ndim());
  out.sizes.resize(a.ndim());
  for (size_t d = 0; d < a.ndim(); ++d) {
    int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    int64_t hi = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
    if (hi <= lo) return std::nullopt;
    out.offsets[d] = lo;
    out.sizes[d] = hi - lo;
  }
  return out;
}

std::optional<uint64_t> checked_numel(const std::vector<int64_t>& dims) {
  uint64_t n = 1;
  constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  for (int64_t d : dims) {
    if (d < 0) return std::nullopt;
    uint64_t ud = static_cast<uint64_t>(d);
    if (ud != 0 && n > kMax / ud) return std::nullopt;
    n *= ud;
  }
  return n;
}

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t d = 0; d < shape.size(); ++d) {
    if (d) out += ", ";
    out += std::to_string(shape[d]);
  }
  return out + "]";
}

std::string box_to_string(const Box& box) {
  std::string out = "[";
  for (size_t d = 0; d < box.sizes.size(); ++d) {
    if (d) out += ", ";
    int64_t lo = d < box.offsets.size() ? box.offsets[d] : 0;
    out += std::to_string(lo) + ":" + std::to_string(lo + box.sizes[d]);
  }
  return out + "]";
}

std::string join_names(const std::vector<std::string>& names, size_t max) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i == max) {
      out += ", ... (" + std::to_string(names.size() - max) + " more)";
      break;
    }
    out += (i ? ", " : "") + names[i];
  }
  return out;
}

// Box geometry: whether boxes tile a shape (find_tiling_problem).

namespace {

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

// The common case, shown in O(n log n) without allocating per box: the
// non-empty boxes (in bounds) are whole in every dim but one, and along that
// dim they follow one another from 0 to its extent. False: not shown (the
// general check then finds the problem, or that there is none).
bool is_one_dim_partition(const std::vector<int64_t>& shape, const std::vector<Box>& boxes,
                          const std::vector<size_t>& live) {
  const size_t ndim = shape.size();
  if (ndim == 0 || live.empty()) return false;
  int split = -1;
  for (size_t i : live) {
    for (size_t d = 0; d < ndim; ++d) {
      if (boxes[i].offsets[d] == 0 && boxes[i].sizes[d] == shape[d]) continue;
      if (split >= 0 && static_cast<size_t>(split) != d) return false;
      split = static_cast<int>(d);
    }
  }
  if (split < 0) return live.size() == 1;  // one whole box
  const size_t d = static_cast<size_t>(split);
  std::vector<std::pair<int64_t, int64_t>> spans;  // (offset, size) along d
  spans.reserve(live.size());
  for (size_t i : live) spans.emplace_back(boxes[i].offsets[d], boxes[i].sizes[d]);
  std::sort(spans.begin(), spans.end());
  int64_t next = 0;
  for (const auto& [offset, size] : spans) {
    if (offset != next) return false;
    next += size;
  }
  return next == shape[d];
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
  if (is_one_dim_partition(global_shape, boxes, live)) return std::nullopt;
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

}  // namespace checkpoint
