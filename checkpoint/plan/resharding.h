#pragma once
// Load-time resharding: which saved chunks overlap the region a rank now wants,
// and which byte ranges to copy (~DCP's _create_read_items). Pure functions.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/format/metadata.h"
#include "checkpoint/format/types.h"

namespace checkpoint {

// Copy `length` bytes from offset `src_offset` of a saved chunk's logical
// (row-major, untransformed) bytes to offset `dst_offset` of the destination
// box's row-major buffer.
struct ByteRange {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;

  friend bool operator==(const ByteRange& a, const ByteRange& b) {
    return a.src_offset == b.src_offset && a.dst_offset == b.dst_offset && a.length == b.length;
  }
};

// One saved chunk to read, and where its bytes go.
struct ReadRequest {
  std::string item;
  size_t chunk_index = 0;  // into saved.chunks
  Box overlap;             // global coordinates
  std::vector<ByteRange> ranges;  // ascending, coalesced
};

// The reads that fill `wanted` (global coordinates) from the saved chunks of
// `saved`, in chunk order. An empty `wanted` needs no reads.
// REQUIRES: `saved` passed validate_metadata (chunks disjoint and in bounds).
// Throws FormatError naming the item when `wanted` has the wrong rank, lies
// out of bounds, or is not fully covered by saved chunks.
std::vector<ReadRequest> plan_reads(const ItemMeta& saved, const Box& wanted);

// Byte ranges that copy `overlap` from a row-major buffer holding `src_chunk`
// into a row-major buffer holding `dst_box`. Dims over which the overlap spans
// both boxes whole are merged into one contiguous run, and adjacent runs are
// coalesced, so a full-row overlap of a dim-0 split is a single range.
// REQUIRES: overlap lies inside both boxes; all three have the same rank.
std::vector<ByteRange> overlap_byte_ranges(const Box& src_chunk, const Box& dst_box,
                                           const Box& overlap, size_t element_size);

}  // namespace checkpoint
