#include "checkpoint/plan/resharding.h"

namespace checkpoint {

namespace {

// Row-major element strides of a box.
std::vector<uint64_t> strides_of(const Box& box) {
  std::vector<uint64_t> strides(box.ndim(), 1);
  for (size_t d = box.ndim(); d-- > 1;) {
    strides[d - 1] = strides[d] * static_cast<uint64_t>(box.sizes[d]);
  }
  return strides;
}

void append_coalesced(std::vector<ByteRange>& ranges, const ByteRange& next) {
  if (!ranges.empty()) {
    ByteRange& last = ranges.back();
    if (last.src_offset + last.length == next.src_offset &&
        last.dst_offset + last.length == next.dst_offset) {
      last.length += next.length;
      return;
    }
  }
  ranges.push_back(next);
}

}  // namespace

std::vector<ByteRange> overlap_byte_ranges(const Box& src_chunk, const Box& dst_box,
                                           const Box& overlap, size_t element_size) {
  std::vector<ByteRange> ranges;
  if (overlap.is_empty()) return ranges;
  const size_t ndim = overlap.ndim();
  // Innermost dims that the overlap spans whole in both boxes form, together
  // with the next dim out, one contiguous run in both buffers.
  size_t run_dim = ndim;  // first dim of the contiguous run
  uint64_t run_elems = 1;
  while (run_dim > 0) {
    const size_t d = run_dim - 1;
    run_elems *= static_cast<uint64_t>(overlap.sizes[d]);
    run_dim = d;
    if (overlap.sizes[d] != src_chunk.sizes[d] || overlap.sizes[d] != dst_box.sizes[d]) break;
  }
  const std::vector<uint64_t> src_strides = strides_of(src_chunk);
  const std::vector<uint64_t> dst_strides = strides_of(dst_box);
  // Odometer over the dims outside the run.
  std::vector<int64_t> index(run_dim, 0);
  while (true) {
    uint64_t src = 0, dst = 0;
    for (size_t d = 0; d < ndim; ++d) {
      const int64_t global = overlap.offsets[d] + (d < run_dim ? index[d] : 0);
      src += static_cast<uint64_t>(global - src_chunk.offsets[d]) * src_strides[d];
      dst += static_cast<uint64_t>(global - dst_box.offsets[d]) * dst_strides[d];
    }
    append_coalesced(ranges, ByteRange{src * element_size, dst * element_size,
                                       run_elems * element_size});
    size_t d = run_dim;
    while (d > 0 && ++index[d - 1] == overlap.sizes[d - 1]) index[--d] = 0;
    if (d == 0) break;
  }
  return ranges;
}

std::vector<ReadRequest> plan_reads(const ItemMeta& saved, const Box& wanted) {
  const std::vector<int64_t>& shape = saved.global_shape;
  auto fail = [&](const std::string& why) {
    return FormatError("item '" + saved.name + "': " + why);
  };
  if (wanted.sizes.size() != shape.size() || wanted.offsets.size() != shape.size()) {
    throw fail("wanted box " + box_to_string(wanted) + " has the wrong rank for shape " +
               shape_to_string(shape));
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    const int64_t off = wanted.offsets[d], size = wanted.sizes[d];
    if (off < 0 || size < 0 || off > shape[d] || size > shape[d] - off) {
      throw fail("wanted box " + box_to_string(wanted) + " is out of bounds of shape " +
                 shape_to_string(shape));
    }
  }
  std::vector<ReadRequest> reads;
  if (wanted.is_empty()) return reads;
  const size_t esize = element_size(saved.dtype);
  uint64_t covered = 0;
  for (size_t i = 0; i < saved.chunks.size(); ++i) {
    const Box& chunk = saved.chunks[i].box;
    std::optional<Box> overlap = intersect(chunk, wanted);
    if (!overlap) continue;
    covered += static_cast<uint64_t>(overlap->numel());
    ReadRequest read{saved.name, i, *overlap, {}};
    read.ranges = overlap_byte_ranges(chunk, wanted, read.overlap, esize);
    reads.push_back(std::move(read));
  }
  // Saved chunks are disjoint, so full coverage means the counts match.
  if (covered != static_cast<uint64_t>(wanted.numel())) {
    throw fail("saved chunks cover " + std::to_string(covered) + " of the " +
               std::to_string(wanted.numel()) + " elements of wanted box " +
               box_to_string(wanted));
  }
  return reads;
}

}  // namespace checkpoint
