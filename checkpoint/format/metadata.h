#pragma once
// The global index of a checkpoint: which items exist, their global shapes and
// dtypes, and where each chunk of each item lies (file, offset, length,
// transforms, checksum). Plain values plus a versioned binary encoding, whose
// byte layout FORMAT.md specifies. Torch-free.
//
// Writers: (coordinator) build a CheckpointMeta from the global plan and the
// chunk locations every rank reports, encode_metadata (version 2), and commit
// the bytes as step_<N>/.metadata.
// Readers, by what they need:
//   - (every loading rank) only the chunks overlapping the regions it loads:
//     MetadataReader / read_metadata_for read the head (items, shapes) and,
//     with range reads, the records of those chunks, so a rank's metadata I/O
//     does not grow with the world size that wrote the checkpoint. Then plan
//     reads with resharding.h (load.cpp).
//   - (any process) everything: read_committed_metadata reads and validates
//     the whole file (ckpt verify, inspect, export, import).
// Both read version 1 files as well (a v1 file has no index: it is read whole).
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/errors.h"  // FormatError
#include "checkpoint/format/types.h"
#include "checkpoint/storage/storage.h"

namespace checkpoint {

// The version encode_metadata writes by default; decoders read every version
// in [kOldestFormatVersion, kFormatVersion].
constexpr uint32_t kFormatVersion = 2;
constexpr uint32_t kOldestFormatVersion = 1;
// The committed metadata file inside step_<N>/; its presence makes the
// directory a checkpoint.
constexpr const char* kMetadataFileName = ".metadata";
// Written first, fsynced, then renamed to kMetadataFileName (the commit).
constexpr const char* kMetadataTmpFileName = ".metadata.tmp";

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
  // Disjoint; together they tile global_shape. Version 2 stores them in the
  // order of ChunkSplit (below), so a round trip may reorder them.
  std::vector<ChunkMeta> chunks;

  friend bool operator==(const ItemMeta& a, const ItemMeta& b) {
    return a.name == b.name && a.kind == b.kind && a.dtype == b.dtype &&
           a.global_shape == b.global_shape && a.chunks == b.chunks;
  }
};

struct CheckpointMeta {
  uint32_t format_version = kFormatVersion;  // as read (decoders); ignored by encode_metadata
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

// Encodes `meta` as format `version` (1 or 2; version 1 only for tests and
// tools that must produce old files), validated first: throws FormatError
// rather than write an index no reader would accept. Version 2 writes each
// item's chunks in ChunkSplit order (sorted by their offset along the split
// dim); meta.format_version is not consulted.
std::vector<uint8_t> encode_metadata(const CheckpointMeta& meta, uint32_t version = kFormatVersion);

// Decodes and validates untrusted bytes of any supported version, whole (for
// version 2: both checksums, every record against its directory entry, the
// chunk order and split). `source` (the file path) prefixes every error
// message. Never reads out of bounds; never allocates more than the input size
// justifies. The result's format_version is the version read.
CheckpointMeta decode_metadata(const uint8_t* data, size_t size, const std::string& source);

// How version 2 indexes the chunks of an item (FORMAT.md, "Chunk order and
// split"). `dim` >= 0 when the item has at least two chunks and every chunk
// spans the whole shape in every dim but `dim` (the lowest such dim); the
// chunks are then stored sorted by (offset, size) along `dim`. `stride` > 0
// when, in that order, no chunk is empty and chunk i starts at i * stride with
// size stride, except the last, whose size is in (0, stride].
struct ChunkSplit {
  int32_t dim = -1;
  uint64_t stride = 0;

  friend bool operator==(const ChunkSplit& a, const ChunkSplit& b) {
    return a.dim == b.dim && a.stride == b.stride;
  }
};

// The split of chunks with boxes `boxes` (in any order) of an item of shape
// `shape`. REQUIRES: the boxes tile the shape (validate_metadata).
ChunkSplit classify_chunk_split(const std::vector<int64_t>& shape, const std::vector<Box>& boxes);

// The most bytes a metadata file may have (4 GiB); a larger one is refused
// before it is read.
constexpr uint64_t kMaxMetadataFileBytes = uint64_t{1} << 32;

// (any process) Reads and decodes the committed metadata of the checkpoint
// directory `checkpoint_dir` through `storage`, whole: what verify, inspect,
// export and the ckpt tool read (a loading rank reads in part: MetadataReader
// below). Throws FormatError naming the
// directory: "no such checkpoint directory: D", "not a directory: D", "not a
// committed checkpoint (no .metadata): D", a metadata file that is not a
// regular file or is larger than kMaxMetadataFileBytes, and every decode
// error; IoError for the file system.
CheckpointMeta read_committed_metadata(Storage& storage, const std::string& checkpoint_dir);

// Where the chunks of one item lie in a version-2 file (its item entry).
struct ItemSection {
  uint64_t chunk_count = 0;
  uint64_t offset = 0;  // relative to the start of the sections
  uint64_t length = 0;
  ChunkSplit split;
};

// (every loading rank) Reads the committed metadata of `checkpoint_dir` in
// part: the constructor reads the head (version 2: the fixed header, the head
// and its checksum; the same directory and file checks and errors as
// read_committed_metadata); chunks_overlapping then reads, with range reads,
// only the records of the chunks it returns (and a few directory entries). A
// version-1 file has no index: it is read and decoded whole, and
// chunks_overlapping filters in memory.
//
// What is read is checked as a full decode checks it (checksums of the head
// and of every record read, record against its directory entry, chunk bounds,
// blocks, file names), but bytes that are never read are not: the file
// checksum is not verified. FormatError messages name the file, the item and
// the chunk index. Not thread-safe; `storage` must outlive the reader.
class MetadataReader {
 public:
  MetadataReader(Storage& storage, const std::string& checkpoint_dir);
  // Reads from `bytes`, a whole metadata file already in memory (e.g. one
  // rank read it and sent it to the others); `source` names it in errors, as
  // the path does above. Applies the same size limit. `bytes` must outlive
  // the reader.
  MetadataReader(const std::vector<uint8_t>& bytes, std::string source);

  // The metadata without chunks: every item has its name, kind, dtype and
  // shape and an empty chunk list; format_version is the version read.
  const CheckpointMeta& head() const { return head_; }
  const std::string& path() const { return path_; }
  // REQUIRES: item < head().items.size() (as for the two below).
  uint64_t chunk_count(size_t item) const;

  // The chunks of item `item` that overlap any of `boxes` (each in the item's
  // coordinates, with its rank, non-negative; parts outside the shape are
  // ignored), in stored order, each once. Throws FormatError when what was
  // read is damaged or the chunks read do not cover the requested region
  // exactly (a gap or an overlap); std::invalid_argument for a box of the
  // wrong rank or with a negative offset or size. Empty boxes need nothing.
  std::vector<ChunkMeta> chunks_overlapping(size_t item, const std::vector<Box>& boxes);

  // Metadata bytes read from storage so far (the head included).
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  // Decodes the head of a file of `size` bytes (both constructors).
  void read_head(uint64_t size);
  std::vector<uint8_t> read_range(uint64_t offset, uint64_t length);
  // Indices [first, last] of item `item`'s chunks, read, checked and decoded.
  std::vector<ChunkMeta> read_chunks(size_t item, uint64_t first, uint64_t last);
  // The index of the last chunk whose directory key is <= `key` (0 if none).
  uint64_t last_chunk_at_or_before(size_t item, uint64_t key);
  std::vector<std::pair<uint64_t, uint64_t>> index_ranges(size_t item,
                                                          const std::vector<Box>& regions);

  Storage* storage_ = nullptr;                // null: read from bytes_
  const std::vector<uint8_t>* bytes_ = nullptr;
  std::string path_;
  CheckpointMeta head_;
  CheckpointMeta whole_;                // version 1: the whole decoded file
  std::vector<ItemSection> sections_;   // version 2: one per item
  uint64_t sections_start_ = 0;         // file offset of the sections
  std::vector<uint8_t> small_directory_;  // while index_ranges searches a small directory
  std::map<uint64_t, uint64_t> probed_keys_;  // directory keys read while it searches a large one
  uint64_t bytes_read_ = 0;
};

// Version-2 metadata built one item at a time: the save coordinator's way,
// so that it never holds every chunk record of a large checkpoint at once.
// Gives exactly encode_metadata's bytes for the same fields and items.
class MetadataWriter {
 public:
  // `fields`: step, world size, layout, creation time and info (its items
  // are ignored). `validate`: check each item as encode_metadata does
  // (throws FormatError naming the item and chunk); false only for callers
  // that validated already.
  explicit MetadataWriter(const CheckpointMeta& fields, bool validate = true);
  ~MetadataWriter();
  MetadataWriter(const MetadataWriter&) = delete;
  MetadataWriter& operator=(const MetadataWriter&) = delete;
  // Encodes the next item's section; `item` need not be kept.
  void add_item(const ItemMeta& item);
  // The file's bytes; the writer is empty afterwards.
  std::vector<uint8_t> finish();

 private:
  struct State;  // the item entries and sections so far (metadata_v2.cpp)
  std::unique_ptr<State> state_;
};

// (every loading rank) The head plus, for each item named in `wanted`, only
// the chunks overlapping its boxes (MetadataReader::chunks_overlapping); other
// items have no chunks. Names not in the checkpoint are ignored (the caller
// reports missing items). Sets *bytes_read, when given, to the metadata bytes
// read.
CheckpointMeta read_metadata_for(Storage& storage, const std::string& checkpoint_dir,
                                 const std::map<std::string, std::vector<Box>>& wanted,
                                 uint64_t* bytes_read = nullptr);

// Semantic checks (see FORMAT.md, "Validation"): throws FormatError naming
// `source`, the item and the chunk index.
void validate_metadata(const CheckpointMeta& meta, const std::string& source);

// True when `name` is a flat data-file name that stays inside the checkpoint
// directory: non-empty, at most kMaxNameLength bytes, no '/' or '\\', not
// starting with '.', no control characters.
bool is_safe_file_name(const std::string& name);

}  // namespace checkpoint
