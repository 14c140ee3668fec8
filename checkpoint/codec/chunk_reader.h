#pragma once
// A data file -> blocks -> chunks: reading back any logical byte range of a
// saved chunk by fetching and decoding only the blocks it overlaps
// (ChunkReader), and verifying every checksum of a checkpoint
// (verify_checkpoint). The writing side is chunk_writer.h. Torch-free.
//
// Errors name the checkpoint directory, item, chunk index (and block) and
// file, e.g. "checksum mismatch in /ck/step_10 item 'model.w' chunk 1 block 0
// (file rank_1.data)". Their types tell what failed: FormatError (metadata
// that cannot be right), ChecksumError (bytes that decoded but are wrong),
// IoError (the file system, including truncated files), TransformError
// (bytes that do not decode).
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/errors.h"  // ChecksumError
#include "checkpoint/format/metadata.h"
#include "checkpoint/storage/storage.h"

namespace thread_pool {
class ThreadPool;
}

#include "checkpoint/plan/resharding.h"

namespace checkpoint {

// Reads saved chunks of one checkpoint directory. Stateless between calls;
// one reader may serve concurrent calls. The storage and pool must outlive it.
// REQUIRES: calls are not made from a task running on the reader's pool (they
// wait for the pool's tasks).
class ChunkReader {
 public:
  ChunkReader(std::shared_ptr<Storage> storage, std::string checkpoint_dir,
              thread_pool::ThreadPool* pool = nullptr);
  // Drops the storage's read cache (Storage::drop_read_cache).
  ~ChunkReader();
  ChunkReader(const ChunkReader&) = delete;
  ChunkReader& operator=(const ChunkReader&) = delete;

  // Copies logical bytes [lo, lo + n) of chunk `index` of `item` into dst.
  // Reads only the blocks overlapping the range (one read per run of
  // adjacent blocks, bounded in size), decodes them (in parallel when a pool
  // is given), verifies each block's checksum, and when the range is the
  // whole chunk also the chunk's checksum. Untransformed full blocks are read
  // straight into dst. REQUIRES: lo + n <= the chunk's logical bytes (else
  // std::invalid_argument).
  void read_logical(const ItemMeta& item, size_t index, uint64_t lo, uint64_t n, uint8_t* dst);

  // Applies a ReadRequest (resharding.h) for `item`: copies each of its byte
  // ranges from the saved chunk into `dst_box_bytes`, the row-major buffer of
  // the box the request was planned for. Each needed block is decoded once,
  // whatever number of ranges it feeds, and memory stays bounded by a few
  // blocks however large the chunk.
  void read_into(const ItemMeta& item, const ReadRequest& req, uint8_t* dst_box_bytes);

  // Reads every block of chunk `index` and checks every block checksum and
  // the chunk checksum, without holding the whole chunk in memory.
  void verify_chunk(const ItemMeta& item, size_t index);

 private:
  std::shared_ptr<Storage> storage_;
  std::string dir_;
  thread_pool::ThreadPool* pool_;
};

struct VerifyProblem {
  std::string item;
  size_t chunk = 0;
  std::string file;
  std::string message;  // the error, naming directory, item, chunk and file
};

struct VerifyReport {
  uint64_t chunks = 0;   // chunks checked
  uint64_t bytes = 0;    // logical bytes checked
  uint64_t skipped = 0;  // chunks not checked (verify_checkpoint_files)
  std::vector<VerifyProblem> problems;
  bool ok() const { return problems.empty(); }
};

// (any single process; no communication) Reads the committed metadata of
// `checkpoint_dir` and re-reads and checks every chunk (all blocks and
// checksums), continuing past bad chunks so that each is reported. Throws
// FormatError "not a committed checkpoint (no .metadata): <dir>" when there
// is no committed metadata, and FormatError or IoError when the metadata
// itself cannot be read.
VerifyReport verify_checkpoint(Storage& storage, const std::string& checkpoint_dir,
                               thread_pool::ThreadPool* pool = nullptr);

// verify_checkpoint for a directory that holds only some of its checkpoint's
// data files (a node-local step directory, tiers/local_tier.h): checks the
// chunks whose data file `check_file` accepts (called with the file name,
// e.g. "rank_0.data") and counts the others in VerifyReport::skipped.
VerifyReport verify_checkpoint_files(Storage& storage, const std::string& checkpoint_dir,
                                     const std::function<bool(const std::string& file)>& check_file,
                                     thread_pool::ThreadPool* pool = nullptr);

}  // namespace checkpoint
