#pragma once
// Plain value types shared by the checkpoint core: element types, item kinds
// and boxes (chunk regions in a tensor's global index space). Torch-free.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/errors.h"  // PlanError (check_tiling)

namespace checkpoint {

// Limits every decoder enforces on untrusted input (and every encoder on what
// it writes).
constexpr size_t kMaxNdim = 16;
constexpr size_t kMaxNameLength = 4096;
constexpr uint64_t kMaxItemBytes = uint64_t{1} << 50;  // 1 PiB per item

// On-disk element type codes. The numeric values are part of the file format
// (FORMAT.md); never renumber, only append.
enum class DType : uint8_t {
  kFloat32 = 1,
  kFloat64 = 2,
  kFloat16 = 3,
  kBFloat16 = 4,
  kInt64 = 5,
  kInt32 = 6,
  kInt16 = 7,
  kInt8 = 8,
  kUInt8 = 9,
  kBool = 10,
};

// Bytes per element (bool is stored as one byte).
size_t element_size(DType dtype);
// "float32", "bfloat16", "int64", "uint8", "bool", ...
const char* dtype_name(DType dtype);
// True when `code` is the value of one of the DType enumerators.
bool is_known_dtype(uint8_t code);
// float32, float64, float16 or bfloat16.
bool is_floating_dtype(DType dtype);

// What an item is. Numeric values are part of the file format.
//   kTensor: a (possibly sharded) tensor.
//   kBytes:  opaque bytes (RNG state, step, loader position, effective config)
//            stored as a 1-D uint8 tensor of shape {n}; always exactly one
//            chunk, replicated or owned by one rank.
enum class ItemKind : uint8_t { kTensor = 1, kBytes = 2 };

const char* item_kind_name(ItemKind kind);  // "tensor" | "bytes"
bool is_known_item_kind(uint8_t code);

// A rectangular region of a tensor in global index space: for every dim d it
// covers [offsets[d], offsets[d] + sizes[d]). A 0-d box (both vectors empty)
// covers the single element of a scalar.
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;

  size_t ndim() const { return sizes.size(); }
  // Product of sizes (1 for 0-d). REQUIRES: sizes non-negative, product fits.
  int64_t numel() const;
  bool is_empty() const { return numel() == 0; }

  friend bool operator==(const Box& a, const Box& b) {
    return a.offsets == b.offsets && a.sizes == b.sizes;
  }
  friend bool operator!=(const Box& a, const Box& b) { return !(a == b); }
  // Lexicographic by (offsets, sizes); gives plans a deterministic order.
  friend bool operator<(const Box& a, const Box& b) {
    if (a.offsets != b.offsets) return a.offsets < b.offsets;
    return a.sizes < b.sizes;
  }
};

// The box covering a whole tensor of `shape`.
Box full_box(const std::vector<int64_t>& shape);

// The common region of `a` and `b`; nullopt when they have different ranks or
// the common region holds no element.
std::optional<Box> intersect(const Box& a, const Box& b);

// Product of `dims`, or nullopt when a dim is negative or the product overflows
// int64. Used on untrusted shapes before any arithmetic.
std::optional<uint64_t> checked_numel(const std::vector<int64_t>& dims);

// "[2, 8]" and "[0:2, 4:8]" for error messages.
std::string shape_to_string(const std::vector<int64_t>& shape);
std::string box_to_string(const Box& box);
// "a, b, c", at most `max` names, then ", ... (N more)".
std::string join_names(const std::vector<std::string>& names, size_t max = 8);

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

}  // namespace checkpoint
