// The partial metadata reader: the head of a version-2 file, then only the
// chunk records a loading rank needs, found through each item's directory
// with range reads (FORMAT.md, "Reading part of a version-2 file").
#include <algorithm>
#include <limits>
#include <stdexcept>

#include "checkpoint/format/metadata.h"
#include "checkpoint/format/metadata_codec.h"
#include "checkpoint/format/types.h"  // find_tiling_problem

namespace checkpoint {

using namespace metadata_codec;

namespace {

// Directories up to this size (4 entries) are read whole rather than
// binary-searched: a few small reads, never much more than a rank's own records.
constexpr uint64_t kSmallDirectoryBytes = 96;

// The parts of `boxes` inside `shape` that hold elements; throws
// std::invalid_argument for a box that is not a box of the item.
std::vector<Box> requested_regions(const ItemMeta& item, const std::vector<Box>& boxes) {
  const size_t ndim = item.global_shape.size();
  const Box whole = full_box(item.global_shape);
  std::vector<Box> regions;
  for (const Box& box : boxes) {
    if (box.sizes.size() != ndim || box.offsets.size() != ndim) {
      throw std::invalid_argument("item '" + item.name + "': requested box has rank " +
                                  std::to_string(box.sizes.size()) + ", the item has rank " +
                                  std::to_string(ndim));
    }
    for (size_t d = 0; d < ndim; ++d) {
      if (box.offsets[d] < 0 || box.sizes[d] < 0 ||
          box.sizes[d] > std::numeric_limits<int64_t>::max() - box.offsets[d]) {
        throw std::invalid_argument("item '" + item.name + "': requested box " +
                                    box_to_string(box) + " has a negative or huge extent");
      }
    }
    if (auto region = intersect(box, whole)) regions.push_back(*region);
  }
  return regions;
}

bool overlaps_any(const Box& box, const std::vector<Box>& regions) {
  return std::any_of(regions.begin(), regions.end(),
                     [&](const Box& r) { return intersect(box, r).has_value(); });
}

// Sorted, merged, inclusive index ranges.
std::vector<std::pair<uint64_t, uint64_t>> merge_ranges(
    std::vector<std::pair<uint64_t, uint64_t>> ranges) {
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uint64_t, uint64_t>> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && r.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  return merged;
}

}  // namespace

MetadataReader::MetadataReader(Storage& storage, const std::string& checkpoint_dir)
    : storage_(&storage) {
  read_head(stat_committed_metadata(storage, checkpoint_dir, path_));
}

MetadataReader::MetadataReader(const std::vector<uint8_t>& bytes, std::string source)
    : bytes_(&bytes), path_(std::move(source)) {
  if (bytes.size() > kMaxMetadataFileBytes) {
    throw FormatError(path_ + ": " + std::to_string(bytes.size()) + " bytes is too large for metadata");
  }
  read_head(bytes.size());
}

void MetadataReader::read_head(uint64_t size) {
  std::vector<uint8_t> head = read_range(0, std::min<uint64_t>(size, kV2HeaderBytes));
  const uint32_t version = check_preamble(head.data(), head.size(), path_);
  if (version == 1) {
    // No index: read and check it whole, then serve chunks from memory.
    const std::vector<uint8_t> rest = read_range(head.size(), size - head.size());
    head.insert(head.end(), rest.begin(), rest.end());
    whole_ = decode_metadata(head.data(), head.size(), path_);
    head_ = whole_;
    for (ItemMeta& item : head_.items) item.chunks.clear();
    return;
  }
  const V2Header header = parse_v2_header(head.data(), size, path_);
  const std::vector<uint8_t> rest = read_range(kV2HeaderBytes, header.head_length + kChecksumBytes);
  head.insert(head.end(), rest.begin(), rest.end());
  decode_v2_head(head.data(), head.size(), header, path_, head_, sections_);
  sections_start_ = head.size();
}

uint64_t MetadataReader::chunk_count(size_t item) const {
  return head_.format_version == 1 ? whole_.items.at(item).chunks.size()
                                   : sections_.at(item).chunk_count;
}

std::vector<uint8_t> MetadataReader::read_range(uint64_t offset, uint64_t length) {
  std::vector<uint8_t> bytes(static_cast<size_t>(length));
  if (length > 0 && storage_ != nullptr) {
    storage_->read_at(path_, offset, bytes.data(), bytes.size());
  } else if (length > 0) {
    // The header checks keep every range inside the file.
    if (offset > bytes_->size() || length > bytes_->size() - offset) {
      throw FormatError(path_ + ": a read of " + std::to_string(length) + " bytes at " + std::to_string(offset) +
                        " runs past the end (" + std::to_string(bytes_->size()) + " bytes)");
    }
    std::copy_n(bytes_->data() + offset, bytes.size(), bytes.data());
  }
  bytes_read_ += length;
  return bytes;
}

std::vector<ChunkMeta> MetadataReader::chunks_overlapping(size_t item,
                                                          const std::vector<Box>& boxes) {
  const ItemMeta& shape = head_.items.at(item);
  const std::vector<Box> regions = requested_regions(shape, boxes);
  std::vector<ChunkMeta> result;
  if (regions.empty()) return result;
  if (head_.format_version == 1) {
    for (const ChunkMeta& chunk : whole_.items[item].chunks) {
      if (overlaps_any(chunk.box, regions)) result.push_back(chunk);
    }
    return result;
  }
  std::vector<uint64_t> indices;  // stored index of each chunk in `result`
  for (const auto& [first, last] : index_ranges(item, regions)) {
    std::vector<ChunkMeta> chunks = read_chunks(item, first, last);
    for (uint64_t i = first; i <= last; ++i) {
      ChunkMeta& chunk = chunks[static_cast<size_t>(i - first)];
      if (!overlaps_any(chunk.box, regions)) continue;
      result.push_back(std::move(chunk));
      indices.push_back(i);
    }
  }
  // The chunks read must tile every requested region: a directory that sent
  // the search astray, or a file whose chunks do not tile, shows up here.
  for (const Box& region : regions) {
    std::vector<Box> pieces;
    std::vector<uint64_t> piece_chunks;
    for (size_t c = 0; c < result.size(); ++c) {
      if (auto common = intersect(result[c].box, region)) {
        for (size_t d = 0; d < region.ndim(); ++d) common->offsets[d] -= region.offsets[d];
        pieces.push_back(*common);
        piece_chunks.push_back(indices[c]);
      }
    }
    if (auto problem = find_tiling_problem(region.sizes, pieces)) {
      std::string where;
      if (problem->first) where = "chunk " + std::to_string(piece_chunks[*problem->first]) + ": ";
      throw FormatError(path_ + ": item '" + shape.name + "': " + where +
                        "the chunks read do not cover the requested region " +
                        box_to_string(region) + " exactly: " + problem->message +
                        " (in the region's coordinates)");
    }
  }
  return result;
}

std::vector<std::pair<uint64_t, uint64_t>> MetadataReader::index_ranges(
    size_t item, const std::vector<Box>& regions) {
  const ItemSection& section = sections_[item];
  const uint64_t n = section.chunk_count;
  if (n == 0) return {};
  if (section.split.dim < 0) return {{0, n - 1}};
  const size_t d = static_cast<size_t>(section.split.dim);
  const uint64_t stride = section.split.stride;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const Box& region : regions) {
    const uint64_t lo = static_cast<uint64_t>(region.offsets[d]);
    const uint64_t hi = lo + static_cast<uint64_t>(region.sizes[d]);  // > lo: regions hold elements
    if (stride > 0) {
      // The head check made ceil(dim / stride) == n, so both are < n.
      ranges.emplace_back(lo / stride, (hi - 1) / stride);
    } else {
      // Sorted keys make first <= last; damaged ones may not (the cover
      // check then fails).
      ranges.push_back(std::minmax(last_chunk_at_or_before(item, lo),
                                   last_chunk_at_or_before(item, hi - 1)));
    }
  }
  small_directory_.clear();
  probed_keys_.clear();
  return merge_ranges(std::move(ranges));
}

uint64_t MetadataReader::last_chunk_at_or_before(size_t item, uint64_t key) {
  const ItemSection& section = sections_[item];
  const uint64_t n = section.chunk_count;
  const uint64_t directory_start = sections_start_ + section.offset;
  const bool small = n * kDirEntryBytes <= kSmallDirectoryBytes;
  if (small && small_directory_.empty()) small_directory_ = read_range(directory_start, n * kDirEntryBytes);
  auto key_at = [&](uint64_t i) {
    if (small) return get_dir_entry(small_directory_.data() + i * kDirEntryBytes).key;
    // The searches for a region's two ends share their first probes.
    if (auto hit = probed_keys_.find(i); hit != probed_keys_.end()) return hit->second;
    const std::vector<uint8_t> bytes = read_range(directory_start + i * kDirEntryBytes, 8);
    return probed_keys_[i] = load_le(bytes.data(), 8);
  };
  // Keys are sorted: the largest i with key(i) <= key (0 when none is; the
  // cover check then reports the gap).
  uint64_t lo = 0, hi = n;
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (key_at(mid) <= key) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

std::vector<ChunkMeta> MetadataReader::read_chunks(size_t item, uint64_t first, uint64_t last) {
  const ItemSection& section = sections_[item];
  const ItemMeta& shape = head_.items[item];
  const uint64_t n = section.chunk_count;
  const uint64_t directory_start = sections_start_ + section.offset;
  const uint64_t records_start = directory_start + n * kDirEntryBytes;
  const uint64_t records_length = section.length - n * kDirEntryBytes;
  // Entry first - 1 holds where record `first` starts.
  const uint64_t entry_first = first == 0 ? 0 : first - 1;
  const std::vector<uint8_t> directory =
      read_range(directory_start + entry_first * kDirEntryBytes,
                 (last - entry_first + 1) * kDirEntryBytes);
  const uint64_t begin = first == 0 ? 0 : get_dir_entry(directory.data()).record_end;
  std::vector<DirEntry> entries;
  uint64_t end = begin;
  for (uint64_t i = first; i <= last; ++i) {
    const DirEntry entry = get_dir_entry(directory.data() + (i - entry_first) * kDirEntryBytes);
    if (entry.record_end < end || entry.record_end > records_length) {
      throw FormatError(path_ + ": item '" + shape.name + "': chunk " + std::to_string(i) +
                        ": record end " + std::to_string(entry.record_end) + " lies outside [" +
                        std::to_string(end) + ", " + std::to_string(records_length) + "]");
    }
    end = entry.record_end;
    entries.push_back(entry);
  }
  const std::vector<uint8_t> records = read_range(records_start + begin, end - begin);
  std::vector<ChunkMeta> chunks;
  uint64_t start = begin;
  for (uint64_t i = first; i <= last; ++i) {
    const DirEntry& entry = entries[static_cast<size_t>(i - first)];
    chunks.push_back(decode_record(records.data() + (start - begin),
                                   static_cast<size_t>(entry.record_end - start), entry, shape,
                                   section, static_cast<size_t>(i), head_.world_size, path_));
    start = entry.record_end;
  }
  return chunks;
}

CheckpointMeta read_metadata_for(Storage& storage, const std::string& checkpoint_dir,
                                 const std::map<std::string, std::vector<Box>>& wanted,
                                 uint64_t* bytes_read) {
  MetadataReader reader(storage, checkpoint_dir);
  CheckpointMeta meta = reader.head();
  for (size_t i = 0; i < meta.items.size(); ++i) {
    auto it = wanted.find(meta.items[i].name);
    if (it != wanted.end()) meta.items[i].chunks = reader.chunks_overlapping(i, it->second);
  }
  if (bytes_read != nullptr) *bytes_read = reader.bytes_read();
  return meta;
}

}  // namespace checkpoint
