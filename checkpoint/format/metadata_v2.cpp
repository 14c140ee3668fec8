// Version 2 of the metadata file (FORMAT.md, "Version 2"): a head with the
// item table, then one section per item holding a fixed-width directory and
// the chunk records, so that a reader can find and read only the chunks it
// needs. The whole-file encoder and decoder live here; the partial reader is
// metadata_reader.cpp.
#include <algorithm>
#include <numeric>
#include <unordered_set>

#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/checksum.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/format/metadata_codec.h"
#include "checkpoint/format/wire.h"

namespace checkpoint {

using namespace metadata_codec;

namespace {

// name length, kind, dtype, ndim, chunk count, section offset and length,
// split dim, stride: one byte each at least.
constexpr size_t kMinItemEntryBytes = 9;

[[noreturn]] void fail(const std::string& source, const std::string& why) {
  throw FormatError(source + ": " + why);
}

std::string item_context(const ItemMeta& item) { return "item '" + item.name + "': "; }

std::string chunk_context(const ItemMeta& item, size_t index) {
  return item_context(item) + "chunk " + std::to_string(index) + ": ";
}

// The order version 2 stores an item's chunks in: by (offset, size) along
// the split dim, ties in their original order; unchanged without a split.
std::vector<size_t> stored_order(const std::vector<ChunkMeta>& chunks, const ChunkSplit& split) {
  std::vector<size_t> order(chunks.size());
  std::iota(order.begin(), order.end(), size_t{0});
  if (split.dim < 0) return order;
  const size_t d = static_cast<size_t>(split.dim);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const Box& x = chunks[a].box;
    const Box& y = chunks[b].box;
    if (x.offsets[d] != y.offsets[d]) return x.offsets[d] < y.offsets[d];
    return x.sizes[d] < y.sizes[d];
  });
  return order;
}

void put_section(wire::ByteWriter& sections, const ItemMeta& item, const ChunkSplit& split) {
  wire::ByteWriter records;
  std::vector<DirEntry> directory;
  for (size_t index : stored_order(item.chunks, split)) {
    const ChunkMeta& chunk = item.chunks[index];
    const size_t start = records.bytes().size();
    put_chunk(records, chunk);
    const size_t end = records.bytes().size();
    directory.push_back({chunk_key(chunk.box, split), end,
                         xxh3_64(records.bytes().data() + start, end - start)});
  }
  for (const DirEntry& e : directory) {
    sections.put_u64(e.key);
    sections.put_u64(e.record_end);
    sections.put_u64(e.record_checksum);
  }
  sections.put_bytes(records.bytes().data(), records.bytes().size());
}

// Item `item`'s section (`data`, `size`: exactly its bytes) decoded whole:
// every directory entry against its record, the records filling it exactly.
std::vector<ChunkMeta> decode_section(const uint8_t* data, size_t size, const ItemMeta& item,
                                      const ItemSection& section, int32_t world_size,
                                      const std::string& source) {
  const size_t n = static_cast<size_t>(section.chunk_count);  // bounded by the head check
  const size_t directory_bytes = n * kDirEntryBytes;
  const uint8_t* records = data + directory_bytes;
  const uint64_t records_length = size - directory_bytes;
  std::vector<ChunkMeta> chunks;
  chunks.reserve(n);
  uint64_t start = 0;
  for (size_t c = 0; c < n; ++c) {
    const DirEntry entry = get_dir_entry(data + c * kDirEntryBytes);
    if (entry.record_end < start || entry.record_end > records_length) {
      fail(source, chunk_context(item, c) + "record end " + std::to_string(entry.record_end) +
                       " lies outside [" + std::to_string(start) + ", " +
                       std::to_string(records_length) + "]");
    }
    chunks.push_back(decode_record(records + start, entry.record_end - start, entry, item, section,
                                   c, world_size, source));
    start = entry.record_end;
  }
  if (start != records_length) {
    fail(source, item_context(item) + "the records fill " + std::to_string(start) + " of the " +
                     std::to_string(records_length) + " record bytes of the section");
  }
  return chunks;
}

// The checks a full decode adds once the chunks are known to tile: the stored
// split is the chunks' split, and the chunks are in its order.
void check_split(const ItemMeta& item, const ItemSection& section, const std::string& source) {
  std::vector<Box> boxes;
  for (const ChunkMeta& c : item.chunks) boxes.push_back(c.box);
  const ChunkSplit actual = classify_chunk_split(item.global_shape, boxes);
  if (!(actual == section.split)) {
    fail(source, item_context(item) + "stored split (dim " + std::to_string(section.split.dim) +
                     ", stride " + std::to_string(section.split.stride) +
                     ") is not the chunks' split (dim " + std::to_string(actual.dim) +
                     ", stride " + std::to_string(actual.stride) + ")");
  }
  const std::vector<size_t> order = stored_order(item.chunks, actual);
  for (size_t c = 0; c < order.size(); ++c) {
    if (order[c] != c) {
      fail(source, chunk_context(item, c) + "out of order (chunks are sorted by their offset "
                                           "and size along the split dim)");
    }
  }
}

void check_section_entry(const ItemMeta& item, const ItemSection& section, uint64_t expected_offset,
                         uint64_t sections_length, const std::string& source) {
  const std::string where = item_context(item);
  if (section.offset != expected_offset) {
    fail(source, where + "section offset " + std::to_string(section.offset) + ", expected " +
                     std::to_string(expected_offset) +
                     " (sections follow each other in item order)");
  }
  if (section.length > sections_length - section.offset) {
    fail(source, where + "section of " + std::to_string(section.length) + " bytes at " +
                     std::to_string(section.offset) + " runs past the sections' " +
                     std::to_string(sections_length) + " bytes");
  }
  const size_t ndim = item.global_shape.size();
  if (section.chunk_count > section.length / (kDirEntryBytes + min_chunk_bytes(ndim))) {
    fail(source, where + "chunk count " + std::to_string(section.chunk_count) +
                     " does not fit a section of " + std::to_string(section.length) + " bytes");
  }
  const uint64_t numel = *checked_numel(item.global_shape);  // validate_head checked it
  if (item.kind == ItemKind::kBytes && section.chunk_count != 1) {
    fail(source, where + "a bytes item has exactly one chunk, found " +
                     std::to_string(section.chunk_count));
  }
  if (numel > 0 && section.chunk_count == 0) fail(source, where + "no chunks for a non-empty item");
  const ChunkSplit& split = section.split;
  if (split.dim < -1 || split.dim >= static_cast<int64_t>(ndim)) {
    fail(source, where + "split dim " + std::to_string(split.dim) + " is not a dim of shape " +
                     shape_to_string(item.global_shape));
  }
  if (split.dim >= 0 && section.chunk_count < 2) {
    fail(source, where + "split dim " + std::to_string(split.dim) + " with fewer than 2 chunks");
  }
  if (split.stride > 0) {
    if (split.dim < 0 || numel == 0) {
      fail(source, where + "stride " + std::to_string(split.stride) +
                       " without a split dim or elements");
    }
    // Chunk i starts at i * stride and the last ends at the shape: exactly
    // ceil(dim / stride) chunks.
    const uint64_t dim = static_cast<uint64_t>(item.global_shape[static_cast<size_t>(split.dim)]);
    const uint64_t count = dim / split.stride + (dim % split.stride != 0 ? 1 : 0);
    if (count != section.chunk_count) {
      fail(source, where + "stride " + std::to_string(split.stride) + " over dim size " +
                       std::to_string(dim) + " makes " + std::to_string(count) +
                       " chunks, not " + std::to_string(section.chunk_count));
    }
  }
}

}  // namespace

ChunkSplit classify_chunk_split(const std::vector<int64_t>& shape, const std::vector<Box>& boxes) {
  ChunkSplit split;
  if (boxes.size() < 2) return split;
  const size_t ndim = shape.size();
  for (size_t d = 0; d < ndim && split.dim < 0; ++d) {
    const bool partitions = std::all_of(boxes.begin(), boxes.end(), [&](const Box& box) {
      for (size_t e = 0; e < ndim; ++e) {
        if (e != d && (box.offsets[e] != 0 || box.sizes[e] != shape[e])) return false;
      }
      return true;
    });
    if (partitions) split.dim = static_cast<int32_t>(d);
  }
  if (split.dim < 0) return split;
  const size_t d = static_cast<size_t>(split.dim);
  std::vector<std::pair<int64_t, int64_t>> spans;  // (offset, size) along d
  for (const Box& box : boxes) {
    if (box.is_empty()) return split;  // no stride with empty chunks
    spans.emplace_back(box.offsets[d], box.sizes[d]);
  }
  std::sort(spans.begin(), spans.end());
  const int64_t stride = spans[0].second;
  const size_t n = spans.size();
  for (size_t i = 0; i < n; ++i) {
    const int64_t offset = spans[i].first, size = spans[i].second;
    if (offset % stride != 0 || static_cast<uint64_t>(offset / stride) != i) return split;
    if (i + 1 < n ? size != stride : size > stride) return split;
  }
  if (spans[n - 1].first + spans[n - 1].second != shape[d]) return split;
  split.stride = static_cast<uint64_t>(stride);
  return split;
}

namespace metadata_codec {

uint64_t chunk_key(const Box& box, const ChunkSplit& split) {
  return split.dim < 0 ? 0 : static_cast<uint64_t>(box.offsets[static_cast<size_t>(split.dim)]);
}

DirEntry get_dir_entry(const uint8_t* data) {
  return {load_le(data, 8), load_le(data + 8, 8), load_le(data + 16, 8)};
}

std::vector<uint8_t> encode_v2(const CheckpointMeta& meta) {
  MetadataWriter writer(meta, /*validate=*/false);  // encode_metadata validated it whole
  for (const ItemMeta& item : meta.items) writer.add_item(item);
  return writer.finish();
}

V2Header parse_v2_header(const uint8_t* header, uint64_t file_size, const std::string& source) {
  if (file_size < kV2FixedBytes) {
    fail(source, "too short (" + std::to_string(file_size) + " bytes) to be version-2 metadata");
  }
  V2Header h;
  h.flags = static_cast<uint32_t>(load_le(header + 12, 4));
  h.head_length = load_le(header + 16, 8);
  h.sections_length = load_le(header + 24, 8);
  const uint64_t room = file_size - kV2FixedBytes;
  if (h.head_length > room || h.sections_length > room - h.head_length) {
    fail(source, "header says head " + std::to_string(h.head_length) + " + sections " +
                     std::to_string(h.sections_length) + " bytes but the file is truncated (" +
                     std::to_string(room) + " bytes present for both)");
  }
  if (h.head_length + h.sections_length != room) {
    fail(source, "header says head " + std::to_string(h.head_length) + " + sections " +
                     std::to_string(h.sections_length) + " bytes but the file has trailing bytes (" +
                     std::to_string(room) + " bytes present for both)");
  }
  return h;
}

void decode_v2_head(const uint8_t* data, size_t size, const V2Header& header,
                    const std::string& source, CheckpointMeta& meta,
                    std::vector<ItemSection>& sections) {
  const size_t head_end = kV2HeaderBytes + static_cast<size_t>(header.head_length);
  if (size != head_end + kChecksumBytes) fail(source, "internal: head bytes of the wrong size");
  if (load_le(data + head_end, 8) != xxh3_64(data, head_end)) {
    fail(source, "head checksum mismatch: the metadata is corrupt");
  }
  if (header.flags != 0) fail(source, "unknown flags " + std::to_string(header.flags));
  meta = CheckpointMeta();
  meta.format_version = 2;
  sections.clear();
  wire::ByteReader r(data + kV2HeaderBytes, static_cast<size_t>(header.head_length));
  std::string context;
  try {
    get_meta_fields(r, meta);
    meta.items.resize(r.get_count(kMinItemEntryBytes, "item count"));
    sections.resize(meta.items.size());
    for (size_t i = 0; i < meta.items.size(); ++i) {
      context = "item " + std::to_string(i) + ": ";
      get_item_shape(r, meta.items[i]);
      context = item_context(meta.items[i]);
      ItemSection& s = sections[i];
      s.chunk_count = r.get_varint("chunk count");
      s.offset = r.get_varint("section offset");
      s.length = r.get_varint("section length");
      const int64_t dim = r.get_zigzag("split dim");
      if (dim < -1 || dim >= static_cast<int64_t>(kMaxNdim)) {
        r.fail("split dim", std::to_string(dim) + " is not a dim");
      }
      s.split.dim = static_cast<int32_t>(dim);
      s.split.stride = r.get_varint("stride");
    }
    context.clear();
    if (!r.at_end()) r.fail("end of head", std::to_string(r.remaining()) + " trailing bytes");
  } catch (const wire::WireError& e) {
    fail(source, context + e.what() + " (byte offsets are relative to the head at " +
                     std::to_string(kV2HeaderBytes) + ")");
  }
  validate_head(meta, source);
  uint64_t expected_offset = 0;
  for (size_t i = 0; i < meta.items.size(); ++i) {
    check_section_entry(meta.items[i], sections[i], expected_offset, header.sections_length, source);
    expected_offset += sections[i].length;
  }
  if (expected_offset != header.sections_length) {
    fail(source, "the item sections fill " + std::to_string(expected_offset) + " of the " +
                     std::to_string(header.sections_length) + " section bytes");
  }
}

ChunkMeta decode_record(const uint8_t* data, size_t size, const DirEntry& entry,
                        const ItemMeta& item, const ItemSection& section, size_t index,
                        int32_t world_size, const std::string& source) {
  const std::string where = chunk_context(item, index);
  if (xxh3_64(data, size) != entry.record_checksum) fail(source, where + "record checksum mismatch");
  wire::ByteReader r(data, size);
  ChunkMeta chunk;
  try {
    chunk = get_chunk(r, item.global_shape.size());
    if (!r.at_end()) r.fail("end of record", std::to_string(r.remaining()) + " trailing bytes");
  } catch (const wire::WireError& e) {
    fail(source, where + e.what() + " (byte offsets are relative to the record)");
  }
  validate_chunk(item, chunk, index, world_size, source);
  const uint64_t key = chunk_key(chunk.box, section.split);
  if (key != entry.key) {
    fail(source, where + "directory key " + std::to_string(entry.key) +
                     " is not the chunk's offset " + std::to_string(key) + " along the split dim");
  }
  return chunk;
}

CheckpointMeta decode_v2(const uint8_t* data, size_t size, const std::string& source) {
  const V2Header header = parse_v2_header(data, size, source);
  if (load_le(data + size - kChecksumBytes, 8) != xxh3_64(data, size - kChecksumBytes)) {
    fail(source, "checksum mismatch: the metadata is corrupt");
  }
  const size_t head_bytes = kV2HeaderBytes + static_cast<size_t>(header.head_length) + kChecksumBytes;
  CheckpointMeta meta;
  std::vector<ItemSection> sections;
  decode_v2_head(data, head_bytes, header, source, meta, sections);
  const uint8_t* base = data + head_bytes;
  for (size_t i = 0; i < meta.items.size(); ++i) {
    const ItemSection& s = sections[i];
    meta.items[i].chunks = decode_section(base + s.offset, static_cast<size_t>(s.length),
                                          meta.items[i], s, meta.world_size, source);
  }
  validate_metadata(meta, source);
  for (size_t i = 0; i < meta.items.size(); ++i) check_split(meta.items[i], sections[i], source);
  return meta;
}

}  // namespace metadata_codec

struct MetadataWriter::State {
  CheckpointMeta fields;
  bool validate = true;
  wire::ByteWriter head;      // the item entries so far
  wire::ByteWriter sections;  // their sections
  uint64_t items = 0;
  std::unordered_set<std::string> names;
};

MetadataWriter::~MetadataWriter() = default;

MetadataWriter::MetadataWriter(const CheckpointMeta& fields, bool validate)
    : state_(std::make_unique<State>()) {
  State& st = *state_;
  st.validate = validate;
  st.fields.format_version = 2;
  st.fields.step = fields.step;
  st.fields.world_size = fields.world_size;
  st.fields.layout = fields.layout;
  st.fields.created_unix_s = fields.created_unix_s;
  st.fields.info = fields.info;
  if (st.validate) validate_metadata(st.fields, "metadata being encoded");
}

void MetadataWriter::add_item(const ItemMeta& item) {
  State& st = *state_;
  if (st.validate) {
    if (!st.names.insert(item.name).second) {
      throw FormatError("metadata being encoded: item '" + item.name + "': duplicate item name");
    }
    validate_item(item, st.fields.world_size, "metadata being encoded");
  }
  std::vector<Box> boxes;
  boxes.reserve(item.chunks.size());
  for (const ChunkMeta& c : item.chunks) boxes.push_back(c.box);
  const ChunkSplit split = classify_chunk_split(item.global_shape, boxes);
  const uint64_t offset = st.sections.bytes().size();
  put_section(st.sections, item, split);
  put_item_shape(st.head, item);
  st.head.put_varint(item.chunks.size());
  st.head.put_varint(offset);
  st.head.put_varint(st.sections.bytes().size() - offset);
  st.head.put_zigzag(split.dim);
  st.head.put_varint(split.stride);
  ++st.items;
}

std::vector<uint8_t> MetadataWriter::finish() {
  State& st = *state_;
  wire::ByteWriter head;
  put_meta_fields(head, st.fields);
  head.put_varint(st.items);
  head.put_bytes(st.head.bytes().data(), st.head.bytes().size());
  st.head = wire::ByteWriter();
  wire::ByteWriter w;
  w.bytes().reserve(kV2FixedBytes + head.bytes().size() + st.sections.bytes().size());
  w.put_bytes(reinterpret_cast<const uint8_t*>(kMagic), sizeof(kMagic));
  w.put_u32(2);
  w.put_u32(0);  // flags: none defined in version 2
  w.put_u64(head.bytes().size());
  w.put_u64(st.sections.bytes().size());
  w.put_bytes(head.bytes().data(), head.bytes().size());
  w.put_u64(xxh3_64(w.bytes().data(), w.bytes().size()));
  w.put_bytes(st.sections.bytes().data(), st.sections.bytes().size());
  st.sections = wire::ByteWriter();
  w.put_u64(xxh3_64(w.bytes().data(), w.bytes().size()));
  st.items = 0;
  st.names.clear();
  return w.release();
}

}  // namespace checkpoint
