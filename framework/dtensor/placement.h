#pragma once
// How a DTensor is laid out along one mesh axis: Shard(dim) splits global
// dimension `dim` over the axis (chunk.h rule), Replicate() keeps it whole on
// every member of the axis. Plain value type.
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <vector>

namespace framework::dtensor {

struct Placement {
  enum class Kind { kShard, kReplicate };
  Kind kind = Kind::kReplicate;
  int64_t dim = 0;  // meaningful only for kShard

  static Placement shard(int64_t dim) {
    TORCH_CHECK(dim >= 0, "Placement::shard: dim must be >= 0, got ", dim);
    return Placement{Kind::kShard, dim};
  }
  static Placement replicate() { return Placement{Kind::kReplicate, 0}; }

  bool is_shard() const { return kind == Kind::kShard; }
  // "Shard(0)", "Replicate()".
  std::string to_string() const {
    return is_shard() ? "Shard(" + std::to_string(dim) + ")" : "Replicate()";
  }
  bool operator==(const Placement& other) const {
    return kind == other.kind && (kind == Kind::kReplicate || dim == other.dim);
  }
  bool operator!=(const Placement& other) const { return !(*this == other); }
};

// "[Replicate(), Shard(0)]", for error messages.
inline std::string to_string(const std::vector<Placement>& placements) {
  std::string out = "[";
  for (size_t i = 0; i < placements.size(); ++i) {
    if (i > 0) out += ", ";
    out += placements[i].to_string();
  }
  return out + "]";
}

}  // namespace framework::dtensor
