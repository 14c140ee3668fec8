#include "checkpoint/format/types.h"

#include <algorithm>
#include <limits>

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

}  // namespace checkpoint
