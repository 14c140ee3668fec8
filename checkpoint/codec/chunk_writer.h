#pragma once
// Chunks -> blocks -> a data file: encoding a chunk's logical bytes into
// independently decodable, checksummed blocks (encode_chunk), and writing
// many chunks into one file with bounded memory (ChunkWriter). The reading
// side is chunk_reader.h. Torch-free.
#include <deque>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/format/metadata.h"
#include "checkpoint/storage/storage.h"

namespace thread_pool {
class ThreadPool;
}

namespace checkpoint {

class TransformChain;

// A chunk ready to be written: `stored` goes into a data file at some offset,
// and the ChunkMeta for it takes `blocks`, `checksum` and `logical_bytes`
// (with length = stored.size()).
struct EncodedChunk {
  std::vector<uint8_t> stored;
  std::vector<BlockMeta> blocks;  // stored offsets relative to the start of `stored`
  uint64_t checksum = 0;          // XXH3-64 of all logical bytes
  uint64_t logical_bytes = 0;
};

// Splits data[0, n) into blocks of `block_size` logical bytes (rounded down to
// a multiple of element_size; the last block may be shorter), passes each
// through `chain` (descriptors, zstd at `zstd_level`), and computes block and
// chunk checksums. Blocks are coded in parallel on `pool` when given.
// REQUIRES: n is a multiple of element_size; 0 < element_size <= block_size
// <= kMaxBlockLogicalBytes (else std::invalid_argument); not called from a
// task running on `pool` (it waits for the pool's tasks).
// Throws TransformError for an unknown descriptor or a bad level.
EncodedChunk encode_chunk(const uint8_t* data, uint64_t n, size_t element_size,
                          const std::vector<std::string>& chain, int zstd_level,
                          uint64_t block_size, thread_pool::ThreadPool* pool);

// Writes chunks one after another into one data file, in the order they are
// added, and says where each went. Chunks are cut into blocks; blocks are
// grouped into batches of about `batch_bytes` logical bytes (a block bigger
// than that is a batch of its own), so that many small chunks cost one pool
// task and one write per batch rather than per chunk. Each batch is encoded
// (transformed chunks) or copied (untransformed ones) and checksummed on the
// pool while the calling thread queues more; at most `max_batches_in_flight`
// batches are queued or encoded and not yet written (bounded memory), and
// the calling thread writes the finished batches in order at increasing
// offsets, asking the file to start write-back every `writeback_bytes` so
// that the disk works while the pool still encodes. An untransformed chunk
// of at least a batch is written straight from the caller's memory, its
// blocks in parallel on the pool, with no staging copy, while the next
// chunks are queued (at most max_batches_in_flight such blocks at once).
//
// Call sequence (one thread, never a task running on the pool): add_chunk
// any number of times, then finish. After an exception the writer is
// unusable; its destructor still waits for the tasks it started.
class ChunkWriter {
 public:
  struct Options {
    int zstd_level = 3;
    uint64_t block_size = uint64_t{8} << 20;  // rounded down to whole elements, >= one
    size_t max_batches_in_flight = 8;  // queued or being coded, not yet written; >= 1
    // Batches close at min(batch_bytes, block size) logical bytes.
    uint64_t batch_bytes = uint64_t{1} << 20;
    uint64_t writeback_bytes = uint64_t{16} << 20;  // 0: never hint
    // An untransformed chunk of at least this many bytes starts at a file
    // offset congruent to its memory address modulo 4 KiB, so that O_DIRECT
    // writes its whole pages straight from that memory, with no copy through
    // an aligned buffer (storage.h). The bytes skipped before it (under
    // 4 KiB) are covered by no chunk (FORMAT.md: they mean nothing). 0: chunks
    // back to back.
    uint64_t align_in_place_bytes = uint64_t{1} << 20;
  };

  // Writes to `file` from offset 0. `file` and `pool` must outlive the
  // writer; without a pool every batch is coded on the calling thread.
  ChunkWriter(WritableFile& file, thread_pool::ThreadPool* pool, Options options);
  ~ChunkWriter();
  ChunkWriter(const ChunkWriter&) = delete;
  ChunkWriter& operator=(const ChunkWriter&) = delete;

  // Queues data[0, n), elements of `element_size` bytes, as the next chunk,
  // passed through `transforms`; returns its index. The bytes must stay valid
  // and unchanged while the writer holds `owner`, which it releases once the
  // chunk's last block is written (at the latest in finish). May block on
  // writes and on the in-flight bound. REQUIRES: n is a multiple of
  // element_size; element size and block size in [1, kMaxBlockLogicalBytes]
  // (else std::invalid_argument). Throws TransformError, IoError.
  size_t add_chunk(const uint8_t* data, uint64_t n, size_t element_size,
                   const std::vector<std::string>& transforms,
                   std::shared_ptr<const void> owner = nullptr);

  // Writes every block still queued or in flight and returns where each
  // chunk went, in the order added: offset, length, logical_bytes, checksum,
  // transforms and blocks (file, box and writer_rank are the caller's). Does
  // not sync.
  std::vector<ChunkMeta> finish();

  // The chunks' stored bytes so far (the file's end less the bytes skipped
  // to align chunks, Options::align_in_place_bytes).
  uint64_t stored_bytes() const { return offset_ - skipped_; }
  uint64_t logical_bytes() const { return logical_; }
  // The most batches that were ever in flight at once (<= max_batches_in_flight).
  size_t peak_batches_in_flight() const { return peak_in_flight_; }

 private:
  struct Item;
  struct Encoded;
  struct InFlight;
  struct PlainInFlight;

  std::shared_ptr<const TransformChain> chain_for(const std::vector<std::string>& transforms);
  void submit_batch();
  void write_plain(size_t index, const uint8_t* data, uint64_t n, uint64_t block,
                   std::shared_ptr<const void> owner);
  void finish_oldest_plain();
  void write_oldest();
  void drain();
  void wait_all() noexcept;
  void note_written();

  WritableFile& file_;
  thread_pool::ThreadPool* pool_;
  Options options_;
  std::vector<ChunkMeta> chunks_;
  std::vector<std::shared_ptr<const void>> owners_;  // released when the chunk is written
  std::vector<size_t> blocks_left_;                 // per chunk, not yet written
  std::vector<Item> batch_;                         // blocks not yet submitted
  uint64_t batch_logical_ = 0;
  std::deque<InFlight> in_flight_;
  std::deque<PlainInFlight> plain_in_flight_;  // uncompressed chunks being written in place
  size_t plain_blocks_in_flight_ = 0;
  uint64_t skipped_ = 0;  // bytes before aligned chunks, covered by no chunk
  std::vector<std::vector<uint8_t>> spare_;  // written batches' buffers, for reuse
  std::vector<std::pair<std::vector<std::string>, std::shared_ptr<const TransformChain>>> chains_;
  uint64_t offset_ = 0;
  uint64_t logical_ = 0;
  uint64_t writeback_from_ = 0;
  size_t peak_in_flight_ = 0;
};

}  // namespace checkpoint
