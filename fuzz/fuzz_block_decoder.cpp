// libFuzzer target: the read path of a chunk. A small metadata (one 1-D item,
// one chunk of up to 4 blocks, its transform chain and checksums) and the
// bytes of its data file come from the input (block_input.h); ChunkReader
// reads them from an in-memory Storage: the whole chunk, a part of it, and
// verify_chunk. Corrupt input must end in FormatError, ChecksumError,
// TransformError or IoError, never a crash or an out-of-bounds access.
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/codec/chunk_writer.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/storage/memory.h"
#include "checkpoint/storage/storage.h"
#include "checkpoint/codec/transforms.h"
#include "block_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const auto chain = fuzz::chain_for(data[0]);
  const auto dtype = static_cast<checkpoint::DType>(1 + data[1] % 10);
  const size_t blocks = 1 + data[2] % 4;
  size_t pos = 3;
  if (size < pos + blocks * 12 + 8) return 0;
  checkpoint::ChunkMeta chunk;
  chunk.file = "rank_0.data";
  chunk.transforms = chain;
  uint64_t stored = 0, logical = 0;
  for (size_t b = 0; b < blocks; ++b) {
    checkpoint::BlockMeta bm;
    bm.stored_offset = stored;
    bm.stored_length = checkpoint::load_le(data + pos, 2);
    bm.logical_length = checkpoint::load_le(data + pos + 2, 2);
    bm.checksum = checkpoint::load_le(data + pos + 4, 8);
    pos += 12;
    stored += bm.stored_length;
    logical += bm.logical_length;
    chunk.blocks.push_back(bm);
  }
  chunk.checksum = checkpoint::load_le(data + pos, 8);
  pos += 8;
  const size_t esize = checkpoint::element_size(dtype);
  if (logical == 0 || logical % esize != 0) return 0;
  chunk.offset = 0;
  chunk.length = stored;
  chunk.logical_bytes = logical;
  const auto numel = static_cast<int64_t>(logical / esize);
  chunk.box.offsets = {0};
  chunk.box.sizes = {numel};

  checkpoint::CheckpointMeta meta;
  checkpoint::ItemMeta item;
  item.name = "fuzz.w";
  item.dtype = dtype;
  item.global_shape = {numel};
  item.chunks.push_back(chunk);
  meta.items.push_back(item);
  try {
    checkpoint::validate_metadata(meta, "fuzz");
  } catch (const checkpoint::FormatError&) {
    return 0;  // a reader would have refused this metadata
  }

  auto storage = checkpoint::memory_storage();
  storage->make_dirs("/ck");
  {
    auto file = storage->create_file("/ck/rank_0.data");
    file->append(data + pos, size - pos);
    file->close();
  }
  checkpoint::ChunkReader reader(storage, "/ck");
  std::vector<uint8_t> out(logical);
  auto attempt = [&](auto&& fn) {
    try {
      fn();
    } catch (const checkpoint::FormatError&) {
    } catch (const checkpoint::ChecksumError&) {
    } catch (const checkpoint::TransformError&) {
    } catch (const checkpoint::IoError&) {
    }
  };
  attempt([&] { reader.read_logical(item, 0, 0, logical, out.data()); });
  attempt([&] { reader.verify_chunk(item, 0); });
  // A part: from the middle of the first block to one element before the end.
  const uint64_t lo = (logical / esize / 2) * esize;
  const uint64_t n = logical - lo > esize ? logical - lo - esize : logical - lo;
  attempt([&] { reader.read_logical(item, 0, lo, n, out.data()); });
  return 0;
}
