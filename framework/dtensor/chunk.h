#pragma once
// torch.chunk-style splitting of n rows over k parts, the one rule every
// sharded tensor in the project follows (DTensor, FSDP flat params, the
// checkpoint planner):
//   chunk = ceil(n / k); part i owns [min(i*chunk, n), min((i+1)*chunk, n)).
// Trailing parts may be empty: 6 rows over 4 -> 2,2,2,0; 3 over 4 -> 1,1,1,0.
// Every part starts at i*chunk unless it is empty, so gathering all parts
// padded to `chunk` rows and keeping the first n rows rebuilds the whole.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

namespace framework::dtensor {

struct Span {
  int64_t offset;
  int64_t size;
};

// ceil(n / parts): the size every part is padded to for collectives.
// REQUIRES: n >= 0, parts >= 1.
inline int64_t chunk_capacity(int64_t n, int64_t parts) {
  TORCH_CHECK(n >= 0, "chunk_capacity: negative size ", n);
  TORCH_CHECK(parts >= 1, "chunk_capacity: number of parts must be >= 1, got ", parts);
  return (n + parts - 1) / parts;
}

// The rows of part `index`. REQUIRES: 0 <= index < parts.
inline Span chunk_span(int64_t n, int64_t parts, int64_t index) {
  const int64_t chunk = chunk_capacity(n, parts);
  TORCH_CHECK(index >= 0 && index < parts, "chunk_span: part index ", index,
              " out of range for ", parts, " parts");
  const int64_t begin = std::min(index * chunk, n);
  const int64_t end = std::min((index + 1) * chunk, n);
  return Span{begin, end - begin};
}

}  // namespace framework::dtensor
