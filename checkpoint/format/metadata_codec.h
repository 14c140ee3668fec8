#pragma once
// Internal: the pieces of the metadata encoding that version 1 (metadata.cpp),
// version 2 (metadata_v2.cpp) and the partial reader (metadata_reader.cpp)
// share. Not part of the public API; FORMAT.md specifies the bytes.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/format/metadata.h"
#include "checkpoint/format/wire.h"

namespace checkpoint::metadata_codec {

constexpr char kMagic[8] = {'S', 'H', 'K', 'C', 'K', 'P', 'T', '\0'};
// Magic, version, flags: the part every version shares.
constexpr size_t kPreambleBytes = 8 + 4 + 4;
// Version 2: preamble, head_length, sections_length.
constexpr size_t kV2HeaderBytes = kPreambleBytes + 8 + 8;
constexpr size_t kChecksumBytes = 8;
// Version 2: header, head checksum, file checksum around the head and sections.
constexpr size_t kV2FixedBytes = kV2HeaderBytes + 2 * kChecksumBytes;
constexpr size_t kDirEntryBytes = 24;  // key, record_end, record_checksum

// Minimum encoded sizes, used to bound counts by the bytes that remain.
constexpr size_t kMinInfoEntryBytes = 2;   // two empty strings
constexpr size_t kMinChunkBytes = 15;      // file, offset, length, logical, #transforms,
                                           // checksum (8), writer rank, #blocks

// The smallest record of a chunk of an item of rank `ndim` (2 * ndim box dims
// of at least one byte each).
inline size_t min_chunk_bytes(size_t ndim) { return kMinChunkBytes + 2 * ndim; }

// The fields before the items: step, world size, layout, creation time, info.
void put_meta_fields(wire::ByteWriter& w, const CheckpointMeta& meta);
void get_meta_fields(wire::ByteReader& r, CheckpointMeta& meta);
// An item's name, kind, dtype, ndim and global shape.
void put_item_shape(wire::ByteWriter& w, const ItemMeta& item);
void get_item_shape(wire::ByteReader& r, ItemMeta& item);
// One chunk (v1's `chunk`, v2's `record`) of an item of rank `ndim`.
void put_chunk(wire::ByteWriter& w, const ChunkMeta& chunk);
ChunkMeta get_chunk(wire::ByteReader& r, size_t ndim);

// validate_metadata without the chunks: the top-level fields and every item's
// name, kind, dtype and shape (what a v2 head holds).
void validate_head(const CheckpointMeta& meta, const std::string& source);
// validate_metadata's checks of one item and its chunks (not the uniqueness
// of its name among the others).
void validate_item(const ItemMeta& item, int32_t world_size, const std::string& source);
// The checks validate_metadata applies to chunk `index` of `item` (bounds,
// sizes, file name, transforms, blocks, writer rank); the tiling is not
// checked. Errors read "<source>: item '<name>': chunk <index>: ...".
void validate_chunk(const ItemMeta& item, const ChunkMeta& chunk, size_t index,
                    int32_t world_size, const std::string& source);

// Checks the size (at least the smallest file of any version), the magic and
// the version of a metadata file's bytes; returns the version.
uint32_t check_preamble(const uint8_t* data, size_t size, const std::string& source);

// The checks and errors of read_committed_metadata before it reads: the
// directory exists, `path` (set to dir/.metadata) is a regular file of at most
// kMaxMetadataFileBytes. Returns its size.
uint64_t stat_committed_metadata(Storage& storage, const std::string& checkpoint_dir,
                                 std::string& path);

// Version 2 (metadata_v2.cpp).
std::vector<uint8_t> encode_v2(const CheckpointMeta& meta);
CheckpointMeta decode_v2(const uint8_t* data, size_t size, const std::string& source);

// The header fields of a v2 file of `file_size` bytes, checked: the file is
// exactly kV2FixedBytes + head_length + sections_length bytes.
struct V2Header {
  uint32_t flags = 0;
  uint64_t head_length = 0;
  uint64_t sections_length = 0;
};
// `header` holds the first kV2HeaderBytes bytes of the file.
V2Header parse_v2_header(const uint8_t* header, uint64_t file_size, const std::string& source);

// Decodes and checks a v2 head: `data` holds bytes [0, kV2HeaderBytes + H + 8)
// of the file (header, head, head checksum). Fills `meta` (items without
// chunks) and one section per item; checks the head checksum, the flags, the
// head fields (validate_head), and that the sections are in item order
// without gaps, fill sections_length exactly, and are consistent with each
// item's chunk count, split and shape.
void decode_v2_head(const uint8_t* data, size_t size, const V2Header& header,
                    const std::string& source, CheckpointMeta& meta,
                    std::vector<ItemSection>& sections);

struct DirEntry {
  uint64_t key = 0;
  uint64_t record_end = 0;
  uint64_t record_checksum = 0;
};
DirEntry get_dir_entry(const uint8_t* data);

// Decodes record `index` of `item` (`data`, `size`: exactly its bytes) after
// checking it against its directory entry (checksum, then key), then
// validate_chunk. Errors name the item and chunk index.
ChunkMeta decode_record(const uint8_t* data, size_t size, const DirEntry& entry,
                        const ItemMeta& item, const ItemSection& section, size_t index,
                        int32_t world_size, const std::string& source);

// The key of a chunk in the directory: its box offset along the split dim.
uint64_t chunk_key(const Box& box, const ChunkSplit& split);

}  // namespace checkpoint::metadata_codec
