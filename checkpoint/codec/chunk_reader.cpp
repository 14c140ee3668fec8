#include "checkpoint/codec/chunk_reader.h"

#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <cstring>
#include <limits>

#include "checkpoint/codec/parallel.h"
#include "checkpoint/codec/transforms.h"
#include "checkpoint/format/checksum.h"
#include "checkpoint/futures.h"

namespace checkpoint {

using codec_detail::run_all;

namespace {

// A batch of adjacent blocks is fetched with one read; this bounds the stored
// bytes plus decode buffers one batch holds (at least one block always fits).
constexpr uint64_t kReadBatchBytes = uint64_t{32} << 20;
constexpr uint64_t kMaxOffset = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

// A part of one block's logical bytes and where it goes (a ByteRange, in
// chunk coordinates, becomes one BlockSlice per block it touches).
struct BlockSlice {
  uint64_t block_offset;  // within the block's logical bytes
  uint8_t* dst;
  uint64_t length;
};

// One block to fetch, and what to do with its logical bytes.
struct BlockPlan {
  size_t block;               // index into ChunkMeta::blocks
  uint8_t* direct = nullptr;  // the whole block lands here, or
  std::vector<BlockSlice> slices;  // these parts of it land there
};

// Reading one chunk: the checked metadata, its transforms and error context.
class ChunkFetch {
 public:
  ChunkFetch(Storage& storage, const std::string& dir, thread_pool::ThreadPool* pool,
            const ItemMeta& item, size_t index)
      : storage_(storage), pool_(pool) {
    where_ = dir + " item '" + item.name + "' chunk " + std::to_string(index);
    if (index >= item.chunks.size()) {
      throw FormatError(where_ + ": the item has only " + std::to_string(item.chunks.size()) +
                        " chunks");
    }
    chunk_ = &item.chunks[index];
    if (!is_safe_file_name(chunk_->file)) {
      throw FormatError("unsafe file name '" + chunk_->file + "' in " + where_ +
                        ": not a plain name inside the checkpoint directory");
    }
    file_suffix_ = " (file " + chunk_->file + ")";
    path_ = join_path(dir, chunk_->file);
    element_size_ = element_size(item.dtype);
    check_blocks();
    try {
      chain_ = TransformChain::for_decoding(chunk_->transforms);
    } catch (const TransformError& e) {
      throw TransformError("cannot read " + where_ + file_suffix_ + ": " + e.what());
    }
  }

  const ChunkMeta& chunk() const { return *chunk_; }
  const std::string& where() const { return where_; }

  // Copies `ranges` (ascending, disjoint, inside the chunk's logical bytes)
  // out of the chunk, each to dst_base + its dst_offset.
  void read_ranges(const std::vector<ByteRange>& ranges, uint8_t* dst_base) {
    uint64_t covered = 0;
    for (const ByteRange& r : ranges) covered += r.length;
    std::vector<BlockPlan> plans = plan_blocks(ranges, dst_base);
    const bool whole = covered == chunk_->logical_bytes;
    Xxh3Stream stream;
    const bool hash = whole && chunk_->blocks.size() > 1;
    run_plans(plans, hash ? &stream : nullptr);
    if (whole) check_chunk_checksum(hash ? &stream : nullptr);
  }

  // Reads every block, checking all checksums.
  void verify() {
    std::vector<BlockPlan> plans(chunk_->blocks.size());
    for (size_t b = 0; b < plans.size(); ++b) plans[b].block = b;
    Xxh3Stream stream;
    const bool hash = chunk_->blocks.size() > 1;
    run_plans(plans, hash ? &stream : nullptr);
    check_chunk_checksum(hash ? &stream : nullptr);
  }

 private:
  // Defends against metadata that skipped validate_metadata: everything the
  // reader relies on (FORMAT.md, "Validation").
  void check_blocks() {
    const ChunkMeta& c = *chunk_;
    auto fail = [&](const std::string& why) {
      throw FormatError(where_ + file_suffix_ + ": " + why);
    };
    if (c.offset > kMaxOffset ||
        c.length > kMaxOffset - c.offset) {
      fail("stored range overflows");
    }
    if (c.logical_bytes > 0 && c.blocks.empty()) fail("a non-empty chunk has no blocks");
    starts_.assign(1, 0);
    uint64_t stored_end = 0;
    for (const BlockMeta& b : c.blocks) {
      if (b.stored_offset < stored_end || b.stored_offset > c.length ||
          b.stored_length > c.length - b.stored_offset || b.logical_length == 0 ||
          b.logical_length > kMaxBlockLogicalBytes || b.stored_length > kMaxBlockStoredBytes ||
          b.logical_length > c.logical_bytes - starts_.back() ||
          (c.transforms.empty() && b.stored_length != b.logical_length) ||
          b.logical_length % element_size_ != 0) {
        fail("block " + std::to_string(starts_.size() - 1) + " is malformed");
      }
      stored_end = b.stored_offset + b.stored_length;
      starts_.push_back(starts_.back() + b.logical_length);
    }
    if (starts_.back() != c.logical_bytes) fail("blocks do not add up to the chunk");
  }

  std::vector<BlockPlan> plan_blocks(const std::vector<ByteRange>& ranges, uint8_t* dst_base) const {
    std::vector<BlockPlan> plans;
    for (const ByteRange& r : ranges) {
      if (r.length == 0) continue;
      uint64_t pos = r.src_offset;
      const uint64_t end = r.src_offset + r.length;
      size_t b = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), pos) -
                                     starts_.begin()) - 1;
      while (pos < end) {
        const uint64_t block_start = starts_[b], block_end = starts_[b + 1];
        const uint64_t take = std::min(end, block_end) - pos;
        if (plans.empty() || plans.back().block != b) plans.push_back(BlockPlan{b, nullptr, {}});
        BlockPlan& plan = plans.back();
        uint8_t* dst = dst_base + r.dst_offset + (pos - r.src_offset);
        if (take == block_end - block_start && plan.slices.empty()) {
          plan.direct = dst;
        } else {
          plan.slices.push_back(BlockSlice{pos - block_start, dst, take});
        }
        pos += take;
        if (pos == block_end) ++b;
      }
    }
    return plans;
  }

  const BlockMeta& block_of(const BlockPlan& p) const { return chunk_->blocks[p.block]; }

  // Untransformed blocks that land whole are read straight into place.
  bool reads_in_place(const BlockPlan& p) const { return chain_.is_identity() && p.direct; }

  // Memory a plan adds to a batch beyond the caller's buffers.
  uint64_t batch_cost(const BlockPlan& p) const {
    if (reads_in_place(p)) return 0;
    const BlockMeta& b = block_of(p);
    return b.stored_length + (chain_.is_identity() || p.direct ? 0 : b.logical_length);
  }

  // Whether plan `next` can join a batch whose last plan is `prev`.
  bool joins(const BlockPlan& prev, const BlockPlan& next, uint64_t cost) const {
    const BlockMeta &a = block_of(prev), &b = block_of(next);
    if (next.block != prev.block + 1 || b.stored_offset != a.stored_offset + a.stored_length) {
      return false;
    }
    if (reads_in_place(prev) != reads_in_place(next)) return false;
    if (reads_in_place(prev)) return next.direct == prev.direct + a.logical_length;
    return cost + batch_cost(next) <= kReadBatchBytes;
  }

  void run_plans(std::vector<BlockPlan>& plans, Xxh3Stream* stream) {
    size_t first = 0;
    while (first < plans.size()) {
      size_t last = first + 1;
      uint64_t cost = batch_cost(plans[first]);
      while (last < plans.size() && joins(plans[last - 1], plans[last], cost)) {
        cost += batch_cost(plans[last]);
        ++last;
      }
      run_batch(plans, first, last, stream);
      first = last;
    }
  }

  // Fetches plans [first, last) with one read, decodes and checks each block
  // (in parallel), delivers its bytes, then feeds `stream` in block order.
  void run_batch(std::vector<BlockPlan>& plans, size_t first, size_t last, Xxh3Stream* stream) {
    const BlockMeta& head = block_of(plans[first]);
    const BlockMeta& tail = block_of(plans[last - 1]);
    const uint64_t stored_bytes = tail.stored_offset + tail.stored_length - head.stored_offset;
    const bool in_place = reads_in_place(plans[first]);
    std::unique_ptr<uint8_t[]> staging;  // not zero-filled: the read fills it
    uint8_t* fetched = plans[first].direct;
    if (!in_place) {
      staging.reset(new uint8_t[static_cast<size_t>(stored_bytes)]);
      fetched = staging.get();
    }
    read_stored(chunk_->offset + head.stored_offset, fetched, stored_bytes, plans[first].block,
                plans[last - 1].block);

    // Each block's logical bytes: in the caller's buffer, in staging (an
    // untransformed block), or in a decode buffer.
    std::vector<const uint8_t*> logical(last - first);
    std::vector<std::unique_ptr<uint8_t[]>> decoded(last - first);
    run_all(pool_, last - first, [&](size_t k) {
      const BlockPlan& plan = plans[first + k];
      const BlockMeta& block = block_of(plan);
      const uint8_t* stored = fetched + (block.stored_offset - head.stored_offset);
      if (chain_.is_identity()) {
        logical[k] = stored;
      } else {
        uint8_t* out = plan.direct;
        if (out == nullptr) {
          decoded[k].reset(new uint8_t[static_cast<size_t>(block.logical_length)]);
          out = decoded[k].get();
        }
        decode_block(plan.block, stored, out);
        logical[k] = out;
      }
      check_block_checksum(plan.block, logical[k]);
      for (const BlockSlice& slice : plan.slices) {
        std::memcpy(slice.dst, logical[k] + slice.block_offset, static_cast<size_t>(slice.length));
      }
    });
    if (stream) {
      for (size_t k = 0; k < logical.size(); ++k) {
        stream->update(logical[k], static_cast<size_t>(block_of(plans[first + k]).logical_length));
      }
    }
  }

  void read_stored(uint64_t offset, uint8_t* dst, uint64_t n, size_t first_block,
                   size_t last_block) {
    try {
      storage_.read_at(path_, offset, dst, static_cast<size_t>(n));
    } catch (const IoError& e) {
      std::string blocks = "block " + std::to_string(first_block);
      if (last_block != first_block) {
        blocks = "blocks " + std::to_string(first_block) + ".." + std::to_string(last_block);
      }
      throw IoError("cannot read " + where_ + " " + blocks + file_suffix_ + ": " + e.what(),
                    e.error_number());
    }
  }

  void decode_block(size_t b, const uint8_t* stored, uint8_t* out) const {
    const BlockMeta& block = chunk_->blocks[b];
    try {
      chain_.decode(stored, static_cast<size_t>(block.stored_length), element_size_, out,
                    static_cast<size_t>(block.logical_length));
    } catch (const TransformError& e) {
      throw TransformError("cannot decode " + where_ + " block " + std::to_string(b) +
                           file_suffix_ + ": " + e.what());
    }
  }

  void check_block_checksum(size_t b, const uint8_t* logical) const {
    const BlockMeta& block = chunk_->blocks[b];
    if (xxh3_64(logical, static_cast<size_t>(block.logical_length)) != block.checksum) {
      throw ChecksumError("checksum mismatch in " + where_ + " block " + std::to_string(b) +
                          file_suffix_);
    }
  }

  // The chunk checksum, from `stream` over all blocks. Without a stream the
  // chunk has at most one block, already checked: its checksum is the
  // chunk's (XXH3 of the same bytes), so the two recorded values must agree.
  void check_chunk_checksum(const Xxh3Stream* stream) const {
    uint64_t digest = 0;
    if (stream) {
      digest = stream->digest();
    } else {
      digest = chunk_->blocks.empty() ? xxh3_64(nullptr, 0) : chunk_->blocks[0].checksum;
    }
    if (digest != chunk_->checksum) {
      throw ChecksumError("checksum mismatch in " + where_ + file_suffix_ +
                          ": the blocks are intact but the chunk checksum differs");
    }
  }

  Storage& storage_;
  thread_pool::ThreadPool* pool_;
  const ChunkMeta* chunk_ = nullptr;
  std::string where_, file_suffix_, path_;
  size_t element_size_ = 1;
  std::vector<uint64_t> starts_;  // logical offset of each block, then the chunk's end
  TransformChain chain_;
};

}  // namespace

ChunkReader::ChunkReader(std::shared_ptr<Storage> storage, std::string checkpoint_dir,
                         thread_pool::ThreadPool* pool)
    : storage_(std::move(storage)), dir_(std::move(checkpoint_dir)), pool_(pool) {}

ChunkReader::~ChunkReader() {
  if (storage_) storage_->drop_read_cache();
}

void ChunkReader::read_logical(const ItemMeta& item, size_t index, uint64_t lo, uint64_t n,
                               uint8_t* dst) {
  ChunkFetch read(*storage_, dir_, pool_, item, index);
  const uint64_t logical = read.chunk().logical_bytes;
  if (lo > logical || n > logical - lo) {
    throw std::invalid_argument("read_logical: range [" + std::to_string(lo) + ", +" +
                                std::to_string(n) + ") lies outside the " +
                                std::to_string(logical) + " bytes of " + read.where());
  }
  read.read_ranges({ByteRange{lo, 0, n}}, dst);
}

void ChunkReader::read_into(const ItemMeta& item, const ReadRequest& req, uint8_t* dst_box_bytes) {
  ChunkFetch read(*storage_, dir_, pool_, item, req.chunk_index);
  const uint64_t logical = read.chunk().logical_bytes;
  uint64_t next = 0;  // ranges must ascend without overlap
  for (const ByteRange& r : req.ranges) {
    if (r.src_offset < next || r.src_offset > logical || r.length > logical - r.src_offset) {
      throw std::invalid_argument("read_into: byte range at " + std::to_string(r.src_offset) +
                                  " is out of order or outside the " + std::to_string(logical) +
                                  " bytes of " + read.where());
    }
    next = r.src_offset + r.length;
  }
  read.read_ranges(req.ranges, dst_box_bytes);
}

void ChunkReader::verify_chunk(const ItemMeta& item, size_t index) {
  ChunkFetch(*storage_, dir_, pool_, item, index).verify();
}

VerifyReport verify_checkpoint(Storage& storage, const std::string& checkpoint_dir,
                               thread_pool::ThreadPool* pool) {
  return verify_checkpoint_files(storage, checkpoint_dir, [](const std::string&) { return true; }, pool);
}

VerifyReport verify_checkpoint_files(Storage& storage, const std::string& checkpoint_dir,
                                     const std::function<bool(const std::string& file)>& check_file,
                                     thread_pool::ThreadPool* pool) {
  const CheckpointMeta meta = read_committed_metadata(storage, checkpoint_dir);
  // Non-owning: the caller's storage outlives this call.
  ChunkReader reader(std::shared_ptr<Storage>(std::shared_ptr<Storage>(), &storage),
                     checkpoint_dir, pool);
  VerifyReport report;
  for (const ItemMeta& item : meta.items) {
    for (size_t c = 0; c < item.chunks.size(); ++c) {
      if (!check_file(item.chunks[c].file)) {
        ++report.skipped;
        continue;
      }
      ++report.chunks;
      try {
        reader.verify_chunk(item, c);
        report.bytes += item.chunks[c].logical_bytes;
      } catch (const std::runtime_error& e) {
        report.problems.push_back(VerifyProblem{item.name, c, item.chunks[c].file, e.what()});
      }
    }
  }
  return report;
}

}  // namespace checkpoint
