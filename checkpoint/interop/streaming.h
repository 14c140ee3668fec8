#pragma once
// What the importers and exporters of interop/ share to stream a model of
// any size through bounded memory. Internal (not installed), torch-free.
// Defined in dcp.cpp, except load_real (export.cpp, beside the float
// conversions).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <thread_pool/thread_pool.hpp>

#include "checkpoint/codec/chunk_writer.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/storage/storage.h"

namespace checkpoint {

// Rows of dim 0 per slab so a slab of `box` holds at most slab_bytes of
// `element_size`-byte elements (at least one row).
int64_t rows_per_slab(const Box& box, size_t element_size, uint64_t slab_bytes);

// `box` cut along dim 0 into slabs of `rows` rows (the last may be shorter);
// a 0-d box, or one with no rows, is one slab.
std::vector<Box> dim0_slabs(const Box& box, int64_t rows);

// The element at `p` of float type `from` (float32, float64, float16,
// bfloat16) as a double; std::invalid_argument for another type.
double load_real(DType from, const uint8_t* p);

// True when `box` has `shape`'s rank and lies inside it.
bool box_within_shape(const Box& box, const std::vector<int64_t>& shape);

// The header of an imported checkpoint: world size 1, `layout`, created
// now, info["imported_from"] and info["source"].
CheckpointMeta imported_checkpoint_meta(const std::string& layout, const std::string& imported_from,
                                        const std::string& source);

// Writes an imported checkpoint (ckpt import-dcp, import-hf) as rank 0 of a
// world of one: chunks are compressed and appended to rank_0.data in the
// order added, by a ChunkWriter on `io_threads` threads; commit() then
// writes the metadata, the commit. REQUIRES: `step_dir` exists and is
// empty. On an exception the caller removes `step_dir`.
class ImportWriter {
 public:
  ImportWriter(Storage& storage, std::string step_dir, int io_threads);

  // Adds an item (its chunks come from add_chunk); returns its index.
  size_t add_item(ItemMeta item);
  // Adds `data` (row-major elements of `box`) as a chunk of item `index`.
  void add_chunk(size_t index, const Box& box, std::shared_ptr<std::vector<uint8_t>> data,
                 size_t element_size);
  // Adds `name` as an 8-byte little-endian integer bytes item (the step
  // item, optim.<fqn>.step).
  void add_int64_item(const std::string& name, int64_t value);
  // Writes what remains, fsyncs, and commits `meta` with the items added.
  void commit(CheckpointMeta meta);

 private:
  Storage& storage_;
  std::string step_dir_;
  thread_pool::ThreadPool pool_;
  std::unique_ptr<WritableFile> file_;
  ChunkWriter writer_;
  std::vector<ItemMeta> items_;
  std::vector<std::pair<size_t, Box>> chunk_of_;  // per chunk added: (item, box)
};

}  // namespace checkpoint
