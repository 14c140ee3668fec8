#pragma once
// The global index of a checkpoint: which items exist, their global shapes and
// dtypes, and where each chunk of each item lies (file, offset, length,
// transforms, checksum). Plain values plus a versioned binary encoding, whose
// byte layout FORMAT.md specifies. Torch-free.
//
// Writers: (coordinator) build a CheckpointMeta from the global plan and the
// chunk locations every rank reports, encode_metadata, and commit the bytes as
// step_<N>/.metadata. Readers: (every rank) read_committed_metadata, then plan
// reads with resharding.h (load.cpp); ckpt inspect/verify and export read it
// the same way.
#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/format/types.h"
#include "checkpoint/storage/storage.h"

namespace checkpoint {

constexpr uint32_t kFormatVersion = 1;
// The committed metadata file inside step_<N>/; its presence makes the
// directory a checkpoint.
constexpr const char* kMetadataFileName = ".metadata";
// Written first, fsynced, then renamed to kMetadataFileName (the commit).
constexpr const char* kMetadataTmpFileName = ".metadata.tmp";

// Every decode or validation failure. The message names the source (file
// path) and, where one is involved, the item and chunk index.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Blocks bound what a reader must hold in memory to decode part of a chunk.
// Writers choose the block size (8 MiB by default); readers refuse larger ones.
constexpr uint64_t kMaxBlockLogicalBytes = uint64_t{1} << 30;  // 1 GiB
// Room for a compressor's worst-case expansion of a maximal block.
constexpr uint64_t kMaxBlockStoredBytes = kMaxBlockLogicalBytes + (kMaxBlockLogicalBytes >> 6);

// A range of a chunk's stored bytes that decodes on its own (e.g. one zstd
// frame) into `logical_length` logical bytes. Blocks are in logical order: a
// block's logical offset is the sum of the logical lengths before it, and the
// logical lengths add up to the chunk's logical bytes. Stored ranges are in
// the same order and do not overlap.
struct BlockMeta {
  uint64_t stored_offset = 0;  // relative to ChunkMeta::offset
  uint64_t stored_length = 0;
  uint64_t logical_length = 0;
  uint64_t checksum = 0;       // XXH3-64 of this block's logical bytes

  friend bool operator==(const BlockMeta& a, const BlockMeta& b) {
    return a.stored_offset == b.stored_offset && a.stored_length == b.stored_length &&
           a.logical_length == b.logical_length && a.checksum == b.checksum;
  }
};

struct ChunkMeta {
  Box box;                  // region of the item, global coordinates
  std::string file;         // flat name inside the step directory, e.g. "rank_0.data"
  uint64_t offset = 0;      // first stored byte in `file`
  uint64_t length = 0;      // stored bytes in `file` (after transforms)
  uint64_t logical_bytes = 0;  // box numel * element size
  // Transform descriptors in the order they were applied ("bytegroup/1",
  // "zstd/1"); readers invert them in reverse. Empty: stored == logical, so
  // length == logical_bytes.
  std::vector<std::string> transforms;
  uint64_t checksum = 0;    // XXH3-64 of the logical (untransformed, row-major) bytes
  int32_t writer_rank = 0;  // rank that wrote the chunk (diagnostics)
  // One or more blocks for a non-empty chunk (an untransformed chunk too: then
  // each block stores its logical bytes as they are); none for an empty one.
  std::vector<BlockMeta> blocks;

  friend bool operator==(const ChunkMeta& a, const ChunkMeta& b) {
    return a.box == b.box && a.file == b.file && a.offset == b.offset && a.length == b.length &&
           a.logical_bytes == b.logical_bytes && a.transforms == b.transforms &&
           a.checksum == b.checksum && a.writer_rank == b.writer_rank && a.blocks == b.blocks;
  }
};

struct ItemMeta {
  std::string name;
  ItemKind kind = ItemKind::kTensor;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> global_shape;
  std::vector<ChunkMeta> chunks;  // disjoint; together they tile global_shape

  friend bool operator==(const ItemMeta& a, const ItemMeta& b) {
    return a.name == b.name && a.kind == b.kind && a.dtype == b.dtype &&
           a.global_shape == b.global_shape && a.chunks == b.chunks;
  }
};

struct CheckpointMeta {
  uint32_t format_version = kFormatVersion;
  int64_t step = 0;
  int32_t world_size = 1;      // of the run that wrote it
  std::string layout;          // e.g. "fsdp replicate=1 shard=2" (informational)
  int64_t created_unix_s = 0;
  std::map<std::string, std::string> info;  // free-form (torch version, git sha, ...)
  std::vector<ItemMeta> items;

  // The item named `name`, or nullptr. Linear scan.
  const ItemMeta* find(const std::string& name) const;

  friend bool operator==(const CheckpointMeta& a, const CheckpointMeta& b) {
    return a.format_version == b.format_version && a.step == b.step &&
           a.world_size == b.world_size && a.layout == b.layout &&
           a.created_unix_s == b.created_unix_s && a.info == b.info && a.items == b.items;
  }
};

// Encodes `meta` (validated first: throws FormatError rather than write an
// index no reader would accept).
std::vector<uint8_t> encode_metadata(const CheckpointMeta& meta);

// Decodes and validates untrusted bytes. `source` (the file path) prefixes
// every error message. Never reads out of bounds; never allocates more than
// the input size justifies.
CheckpointMeta decode_metadata(const uint8_t* data, size_t size, const std::string& source);

// The most bytes a metadata file may have (4 GiB); a larger one is refused
// before it is read.
constexpr uint64_t kMaxMetadataFileBytes = uint64_t{1} << 32;

// (any process) Reads and decodes the committed metadata of the checkpoint
// directory `checkpoint_dir` through `storage`: the one way every reader
// (load, verify, export, the ckpt tool) gets it. Throws FormatError naming the
// directory: "no such checkpoint directory: D", "not a directory: D", "not a
// committed checkpoint (no .metadata): D", a metadata file that is not a
// regular file or is larger than kMaxMetadataFileBytes, and every decode
// error; IoError for the file system.
CheckpointMeta read_committed_metadata(Storage& storage, const std::string& checkpoint_dir);

// Semantic checks (see FORMAT.md, "Validation"): throws FormatError naming
// `source`, the item and the chunk index.
void validate_metadata(const CheckpointMeta& meta, const std::string& source);

// True when `name` is a flat data-file name that stays inside the checkpoint
// directory: non-empty, at most kMaxNameLength bytes, no '/' or '\\', not
// starting with '.', no control characters.
bool is_safe_file_name(const std::string& name);

}  // namespace checkpoint
