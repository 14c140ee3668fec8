#include "checkpoint/format/metadata.h"

#include <cerrno>
#include <cstring>
#include <limits>
#include <set>

#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/checksum.h"
#include "checkpoint/format/metadata_codec.h"
#include "checkpoint/format/types.h"  // find_tiling_problem
#include "checkpoint/format/wire.h"

namespace checkpoint {

using namespace metadata_codec;

namespace {

constexpr size_t kHeaderBytes = kPreambleBytes + 8;  // v1: magic, version, flags, body length
constexpr size_t kTrailerBytes = kChecksumBytes;     // XXH3-64 of everything before it
constexpr size_t kMaxFileNameLength = 255;
constexpr size_t kMaxInfoValueLength = 1 << 20;
constexpr uint64_t kMaxFileOffset = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

constexpr size_t kMinItemBytes = 5;        // v1: name length, kind, dtype, ndim, chunk count
constexpr size_t kMinBlockBytes = 11;      // three varints, checksum (8)

bool has_control_char(const std::string& s) {
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) return true;
  }
  return false;
}

class Validator {
 public:
  explicit Validator(const std::string& source) : source_(source) {}

  // `with_chunks` false: a head (items without chunks), checked up to the
  // item shapes.
  void check(const CheckpointMeta& meta, bool with_chunks) {
    if (meta.format_version < kOldestFormatVersion || meta.format_version > kFormatVersion) {
      fail("format version " + std::to_string(meta.format_version) + " is not between " +
           std::to_string(kOldestFormatVersion) + " and " + std::to_string(kFormatVersion));
    }
    if (meta.world_size < 1) fail("world size " + std::to_string(meta.world_size) + " < 1");
    if (meta.step < 0) fail("step " + std::to_string(meta.step) + " < 0");
    if (meta.layout.size() > kMaxNameLength) fail("layout longer than " + std::to_string(kMaxNameLength));
    for (const auto& [key, value] : meta.info) {
      if (key.size() > kMaxNameLength || value.size() > kMaxInfoValueLength) {
        fail("info entry '" + key.substr(0, 64) + "' is too long");
      }
    }
    std::set<std::string> names;
    for (const ItemMeta& item : meta.items) {
      context_ = "item '" + item.name + "': ";
      if (item.name.empty()) fail("empty item name");
      if (item.name.size() > kMaxNameLength) fail("item name longer than " + std::to_string(kMaxNameLength));
      if (!names.insert(item.name).second) fail("duplicate item name");
      check_item_shape(item);
      if (with_chunks) check_item_chunks(item, meta.world_size);
    }
  }

  // One item, whole (all but the uniqueness of its name among others).
  void check_item(const ItemMeta& item, int32_t world_size) {
    context_ = "item '" + item.name + "': ";
    if (item.name.empty()) fail("empty item name");
    if (item.name.size() > kMaxNameLength) fail("item name longer than " + std::to_string(kMaxNameLength));
    check_item_shape(item);
    check_item_chunks(item, world_size);
  }

  void check_one_chunk(const ItemMeta& item, const ChunkMeta& chunk, size_t index,
                       int32_t world_size) {
    context_ = "item '" + item.name + "': chunk " + std::to_string(index) + ": ";
    check_chunk(item, chunk, element_size(item.dtype), world_size);
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw FormatError(source_ + ": " + context_ + why);
  }

  void check_item_shape(const ItemMeta& item) {
    if (!is_known_item_kind(static_cast<uint8_t>(item.kind))) fail("unknown item kind");
    if (!is_known_dtype(static_cast<uint8_t>(item.dtype))) fail("unknown dtype");
    if (item.global_shape.size() > kMaxNdim) fail("more than " + std::to_string(kMaxNdim) + " dims");
    const std::optional<uint64_t> numel = checked_numel(item.global_shape);
    const uint64_t esize = element_size(item.dtype);
    if (!numel || *numel > kMaxItemBytes / esize) {
      fail("global shape " + shape_to_string(item.global_shape) +
           " has a negative dim or exceeds 1 PiB");
    }
    if (item.kind == ItemKind::kBytes) {
      if (item.dtype != DType::kUInt8 || item.global_shape.size() != 1) {
        fail("a bytes item must be 1-D uint8, got " + std::string(dtype_name(item.dtype)) + " " +
             shape_to_string(item.global_shape));
      }
    }
  }

  void check_item_chunks(const ItemMeta& item, int32_t world_size) {
    const uint64_t esize = element_size(item.dtype);
    if (item.kind == ItemKind::kBytes) {
      if (item.chunks.size() != 1) {
        fail("a bytes item has exactly one chunk, found " + std::to_string(item.chunks.size()));
      }
    }
    const std::string item_context = context_;
    std::vector<Box> boxes;
    for (size_t i = 0; i < item.chunks.size(); ++i) {
      context_ = item_context + "chunk " + std::to_string(i) + ": ";
      check_chunk(item, item.chunks[i], esize, world_size);
      boxes.push_back(item.chunks[i].box);
    }
    context_ = item_context;
    if (auto problem = find_tiling_problem(item.global_shape, boxes)) {
      std::string where;
      if (problem->first) where = "chunk " + std::to_string(*problem->first) + ": ";
      fail(where + problem->message);
    }
  }

  void check_box(const ItemMeta& item, const Box& box) {
    const size_t ndim = item.global_shape.size();
    if (box.sizes.size() != ndim || box.offsets.size() != ndim) {
      fail("box has rank " + std::to_string(box.sizes.size()) + " but the item has rank " +
           std::to_string(ndim));
    }
    for (size_t d = 0; d < ndim; ++d) {
      const int64_t off = box.offsets[d], size = box.sizes[d], dim = item.global_shape[d];
      if (off < 0 || size < 0 || off > dim || size > dim - off) {
        fail("box " + box_to_string(box) + " is out of bounds of shape " +
             shape_to_string(item.global_shape));
      }
    }
    if (item.kind == ItemKind::kBytes && box != full_box(item.global_shape)) {
      fail("the chunk of a bytes item must cover it whole, got " + box_to_string(box));
    }
  }

  void check_chunk(const ItemMeta& item, const ChunkMeta& chunk, uint64_t esize,
                   int32_t world_size) {
    check_box(item, chunk.box);
    const uint64_t expected = static_cast<uint64_t>(chunk.box.numel()) * esize;
    if (chunk.logical_bytes != expected) {
      fail("logical_bytes " + std::to_string(chunk.logical_bytes) + " != " +
           std::to_string(expected) + " for box " + box_to_string(chunk.box) + " of " +
           dtype_name(item.dtype));
    }
    if (!is_safe_file_name(chunk.file)) {
      fail("file name '" + chunk.file + "' is not a plain name inside the checkpoint directory");
    }
    if (chunk.offset > kMaxFileOffset || chunk.length > kMaxFileOffset - chunk.offset) {
      fail("offset " + std::to_string(chunk.offset) + " + length " +
           std::to_string(chunk.length) + " overflows");
    }
    for (const std::string& t : chunk.transforms) {
      if (t.empty() || t.size() > kMaxNameLength || has_control_char(t)) {
        fail("bad transform descriptor '" + t + "'");
      }
    }
    if (chunk.transforms.empty() && chunk.length != chunk.logical_bytes) {
      fail("untransformed chunk stores " + std::to_string(chunk.length) + " bytes, expected " +
           std::to_string(chunk.logical_bytes));
    }
    check_blocks(chunk);
    if (chunk.writer_rank < 0 || chunk.writer_rank >= world_size) {
      fail("writer rank " + std::to_string(chunk.writer_rank) + " is outside world size " +
           std::to_string(world_size));
    }
  }

  void check_blocks(const ChunkMeta& chunk) {
    if (chunk.logical_bytes > 0 && chunk.blocks.empty()) fail("a non-empty chunk has no blocks");
    uint64_t logical = 0;
    uint64_t stored_end = 0;  // end of the previous block's stored range
    for (size_t b = 0; b < chunk.blocks.size(); ++b) {
      const BlockMeta& block = chunk.blocks[b];
      const std::string name = "block " + std::to_string(b);
      if (block.stored_offset > chunk.length ||
          block.stored_length > chunk.length - block.stored_offset) {
        fail(name + " stored range [" + std::to_string(block.stored_offset) + ", +" +
             std::to_string(block.stored_length) + ") lies outside the chunk's " +
             std::to_string(chunk.length) + " stored bytes");
      }
      if (block.stored_offset < stored_end) {
        fail(name + " stored range starts at " + std::to_string(block.stored_offset) +
             ", before the previous block ends at " + std::to_string(stored_end));
      }
      stored_end = block.stored_offset + block.stored_length;
      if (block.logical_length == 0) fail(name + " is empty");
      if (block.logical_length > kMaxBlockLogicalBytes ||
          block.stored_length > kMaxBlockStoredBytes) {
        fail(name + " is larger than the 1 GiB block limit");
      }
      if (chunk.transforms.empty() && block.stored_length != block.logical_length) {
        fail(name + " of an untransformed chunk stores " + std::to_string(block.stored_length) +
             " bytes for " + std::to_string(block.logical_length) + " logical bytes");
      }
      if (block.logical_length > chunk.logical_bytes - logical) {
        fail("block logical lengths exceed the chunk's " + std::to_string(chunk.logical_bytes) +
             " logical bytes");
      }
      logical += block.logical_length;
    }
    if (logical != chunk.logical_bytes) {
      fail("block logical lengths add up to " + std::to_string(logical) + ", not " +
           std::to_string(chunk.logical_bytes));
    }
  }

  const std::string& source_;
  std::string context_;
};

}  // namespace

// ---- shared encoding -----------------------------------------------------------

namespace metadata_codec {

namespace {

int32_t get_int32(wire::ByteReader& r, const char* what) {
  const int64_t v = r.get_zigzag(what);
  if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
    r.fail(what, std::to_string(v) + " does not fit in 32 bits");
  }
  return static_cast<int32_t>(v);
}

}  // namespace

void put_chunk(wire::ByteWriter& w, const ChunkMeta& chunk) {
  wire::put_dims(w, chunk.box.offsets);
  wire::put_dims(w, chunk.box.sizes);
  w.put_string(chunk.file);
  w.put_varint(chunk.offset);
  w.put_varint(chunk.length);
  w.put_varint(chunk.logical_bytes);
  w.put_varint(chunk.transforms.size());
  for (const std::string& t : chunk.transforms) w.put_string(t);
  w.put_u64(chunk.checksum);
  w.put_zigzag(chunk.writer_rank);
  w.put_varint(chunk.blocks.size());
  for (const BlockMeta& b : chunk.blocks) {
    w.put_varint(b.stored_offset);
    w.put_varint(b.stored_length);
    w.put_varint(b.logical_length);
    w.put_u64(b.checksum);
  }
}

void put_meta_fields(wire::ByteWriter& w, const CheckpointMeta& meta) {
  w.put_zigzag(meta.step);
  w.put_zigzag(meta.world_size);
  w.put_string(meta.layout);
  w.put_zigzag(meta.created_unix_s);
  w.put_varint(meta.info.size());
  for (const auto& [key, value] : meta.info) {
    w.put_string(key);
    w.put_string(value);
  }
}

void put_item_shape(wire::ByteWriter& w, const ItemMeta& item) {
  wire::put_item_header(w, item.name, item.kind, item.dtype, item.global_shape);
}

void get_meta_fields(wire::ByteReader& r, CheckpointMeta& meta) {
  meta.step = r.get_zigzag("step");
  meta.world_size = get_int32(r, "world size");
  meta.layout = r.get_string(kMaxNameLength, "layout");
  meta.created_unix_s = r.get_zigzag("creation time");
  const uint64_t info_count = r.get_count(kMinInfoEntryBytes, "info count");
  for (uint64_t i = 0; i < info_count; ++i) {
    std::string key = r.get_string(kMaxNameLength, "info key");
    std::string value = r.get_string(kMaxInfoValueLength, "info value");
    if (!meta.info.emplace(std::move(key), std::move(value)).second) {
      r.fail("info key", "duplicate key");
    }
  }
}

void get_item_shape(wire::ByteReader& r, ItemMeta& item) {
  item.name = std::string(wire::get_item_header(r, &item.kind, &item.dtype, &item.global_shape));
}

ChunkMeta get_chunk(wire::ByteReader& r, size_t ndim) {
  ChunkMeta chunk;
  chunk.box.offsets = wire::get_dims(r, ndim, "box offset");
  chunk.box.sizes = wire::get_dims(r, ndim, "box size");
  chunk.file = r.get_string(kMaxFileNameLength, "file name");
  chunk.offset = r.get_varint("file offset");
  chunk.length = r.get_varint("stored length");
  chunk.logical_bytes = r.get_varint("logical length");
  chunk.transforms.resize(r.get_count(1, "transform count"));
  for (std::string& t : chunk.transforms) t = r.get_string(kMaxNameLength, "transform");
  chunk.checksum = r.get_u64("checksum");
  chunk.writer_rank = get_int32(r, "writer rank");
  chunk.blocks.resize(r.get_count(kMinBlockBytes, "block count"));
  for (BlockMeta& b : chunk.blocks) {
    b.stored_offset = r.get_varint("block stored offset");
    b.stored_length = r.get_varint("block stored length");
    b.logical_length = r.get_varint("block logical length");
    b.checksum = r.get_u64("block checksum");
  }
  return chunk;
}

void validate_head(const CheckpointMeta& meta, const std::string& source) {
  Validator(source).check(meta, /*with_chunks=*/false);
}

void validate_item(const ItemMeta& item, int32_t world_size, const std::string& source) {
  Validator(source).check_item(item, world_size);
}

void validate_chunk(const ItemMeta& item, const ChunkMeta& chunk, size_t index,
                    int32_t world_size, const std::string& source) {
  Validator(source).check_one_chunk(item, chunk, index, world_size);
}

}  // namespace metadata_codec

// ---- version 1 -----------------------------------------------------------------

namespace {

void put_v1_body(wire::ByteWriter& w, const CheckpointMeta& meta) {
  put_meta_fields(w, meta);
  w.put_varint(meta.items.size());
  for (const ItemMeta& item : meta.items) {
    put_item_shape(w, item);
    w.put_varint(item.chunks.size());
    for (const ChunkMeta& chunk : item.chunks) put_chunk(w, chunk);
  }
}

class BodyDecoder {
 public:
  explicit BodyDecoder(wire::ByteReader& r) : r_(r) {}

  // Fills `meta`; context() says which item/chunk was being read on failure.
  void decode(CheckpointMeta& meta) {
    get_meta_fields(r_, meta);
    meta.items.resize(r_.get_count(kMinItemBytes, "item count"));
    for (size_t i = 0; i < meta.items.size(); ++i) {
      context_ = "item " + std::to_string(i) + ": ";
      decode_item(meta.items[i]);
    }
    context_.clear();
  }

  const std::string& context() const { return context_; }

 private:
  void decode_item(ItemMeta& item) {
    // The name comes first: on a later failure the context names the item.
    wire::ByteReader name_peek = r_;
    context_ = "item '" + name_peek.get_string(kMaxNameLength, "item name") + "': ";
    get_item_shape(r_, item);
    const size_t ndim = item.global_shape.size();
    item.chunks.resize(r_.get_count(min_chunk_bytes(ndim), "chunk count"));
    const std::string item_context = context_;
    for (size_t c = 0; c < item.chunks.size(); ++c) {
      context_ = item_context + "chunk " + std::to_string(c) + ": ";
      item.chunks[c] = get_chunk(r_, ndim);
    }
    context_ = item_context;
  }

  wire::ByteReader& r_;
  std::string context_;
};

}  // namespace

const ItemMeta* CheckpointMeta::find(const std::string& name) const {
  for (const ItemMeta& item : items) {
    if (item.name == name) return &item;
  }
  return nullptr;
}

bool is_safe_file_name(const std::string& name) {
  if (name.empty() || name.size() > kMaxFileNameLength || name[0] == '.') return false;
  if (name.find('/') != std::string::npos || name.find('\\') != std::string::npos) return false;
  return !has_control_char(name);
}

void validate_metadata(const CheckpointMeta& meta, const std::string& source) {
  Validator(source).check(meta, /*with_chunks=*/true);
}

namespace {

std::vector<uint8_t> encode_v1(const CheckpointMeta& meta) {
  wire::ByteWriter w;
  w.put_bytes(reinterpret_cast<const uint8_t*>(kMagic), sizeof(kMagic));
  w.put_u32(1);
  w.put_u32(0);  // flags: none defined in version 1
  w.put_u64(0);  // body length, patched below
  put_v1_body(w, meta);
  std::vector<uint8_t>& out = w.bytes();
  const uint64_t body_length = out.size() - kHeaderBytes;
  store_le(out.data() + 16, body_length, 8);
  w.put_u64(xxh3_64(out.data(), out.size()));
  return w.release();
}

CheckpointMeta decode_v1(const uint8_t* data, size_t size, const std::string& source) {
  auto fail = [&](const std::string& why) -> FormatError {
    return FormatError(source + ": " + why);
  };
  wire::ByteReader header(data + sizeof(kMagic), kHeaderBytes - sizeof(kMagic));
  const uint32_t version = header.get_u32("version");
  const uint32_t flags = header.get_u32("flags");
  const uint64_t body_length = header.get_u64("body length");
  const uint64_t available = size - kHeaderBytes - kTrailerBytes;
  if (body_length != available) {
    throw fail("header says the body has " + std::to_string(body_length) + " bytes but the file " +
               (body_length > available ? "is truncated" : "has trailing bytes") + " (" +
               std::to_string(available) + " body bytes present)");
  }
  wire::ByteReader trailer(data + size - kTrailerBytes, kTrailerBytes);
  const uint64_t stored_sum = trailer.get_u64("checksum");
  const uint64_t actual_sum = xxh3_64(data, size - kTrailerBytes);
  if (stored_sum != actual_sum) throw fail("checksum mismatch: the metadata is corrupt");
  if (flags != 0) throw fail("unknown flags " + std::to_string(flags));

  CheckpointMeta meta;
  meta.format_version = version;
  wire::ByteReader body(data + kHeaderBytes, body_length);
  BodyDecoder decoder(body);
  try {
    decoder.decode(meta);
    if (!body.at_end()) body.fail("end of body", std::to_string(body.remaining()) + " trailing bytes");
  } catch (const wire::WireError& e) {
    throw fail(decoder.context() + e.what() + " (byte offsets are relative to the body at " +
               std::to_string(kHeaderBytes) + ")");
  }
  validate_metadata(meta, source);
  return meta;
}

}  // namespace

std::vector<uint8_t> encode_metadata(const CheckpointMeta& meta, uint32_t version) {
  if (version < kOldestFormatVersion || version > kFormatVersion) {
    throw FormatError("cannot encode metadata as format version " + std::to_string(version) +
                      "; this build writes versions " + std::to_string(kOldestFormatVersion) +
                      " and " + std::to_string(kFormatVersion));
  }
  validate_metadata(meta, "metadata being encoded");
  return version == 1 ? encode_v1(meta) : encode_v2(meta);
}

uint32_t metadata_codec::check_preamble(const uint8_t* data, size_t size, const std::string& source) {
  // The smallest file of any version (v1 with an empty body).
  if (size < kHeaderBytes + kTrailerBytes) {
    throw FormatError(source + ": too short (" + std::to_string(size) +
                      " bytes) to be checkpoint metadata");
  }
  if (std::memcmp(data, kMagic, sizeof(kMagic)) != 0) {
    throw FormatError(source + ": not checkpoint metadata (bad magic)");
  }
  const uint32_t version = static_cast<uint32_t>(load_le(data + sizeof(kMagic), 4));
  if (version < kOldestFormatVersion || version > kFormatVersion) {
    throw FormatError("unsupported format version " + std::to_string(version) + " in " + source +
                      "; this build reads versions " + std::to_string(kOldestFormatVersion) +
                      " and " + std::to_string(kFormatVersion));
  }
  return version;
}

CheckpointMeta decode_metadata(const uint8_t* data, size_t size, const std::string& source) {
  const uint32_t version = check_preamble(data, size, source);
  return version == 1 ? decode_v1(data, size, source) : decode_v2(data, size, source);
}

uint64_t metadata_codec::stat_committed_metadata(Storage& storage, const std::string& checkpoint_dir,
                                                 std::string& path) {
  const FileType dir_type = storage.stat(checkpoint_dir).type;
  if (dir_type == FileType::kMissing) throw FormatError("no such checkpoint directory: " + checkpoint_dir);
  if (dir_type != FileType::kDirectory) throw FormatError("not a directory: " + checkpoint_dir);
  path = join_path(checkpoint_dir, kMetadataFileName);
  const FileInfo info = storage.stat(path);
  if (info.type == FileType::kMissing) {
    throw FormatError("not a committed checkpoint (no " + std::string(kMetadataFileName) +
                      "): " + checkpoint_dir);
  }
  if (info.type != FileType::kFile) throw FormatError(path + ": not a regular file");
  if (info.size > kMaxMetadataFileBytes) {
    throw FormatError(path + ": " + std::to_string(info.size) + " bytes is too large for metadata");
  }
  return info.size;
}

CheckpointMeta read_committed_metadata(Storage& storage, const std::string& checkpoint_dir) {
  std::string path;
  stat_committed_metadata(storage, checkpoint_dir, path);
  const std::vector<uint8_t> bytes = storage.read_file(path, kMaxMetadataFileBytes);
  return decode_metadata(bytes.data(), bytes.size(), path);
}

}  // namespace checkpoint
