#include "checkpoint/chunk_io.h"
#include "checkpoint/futures.h"

#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <cstring>
#include <functional>
#include <future>
#include <limits>

#include "checkpoint/checksum.h"
#include "checkpoint/transforms.h"

namespace checkpoint {

namespace {

// A batch of adjacent blocks is fetched with one read; this bounds the stored
// bytes plus decode buffers one batch holds (at least one block always fits).
constexpr uint64_t kReadBatchBytes = uint64_t{32} << 20;
// The metadata file is read whole; nothing legitimate comes near this.
constexpr uint64_t kMaxMetadataBytes = uint64_t{4} << 30;
constexpr uint64_t kMaxOffset = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

// Runs fn(0) .. fn(count - 1), on `pool` when there is one and more than one
// task. Waits for all of them, then rethrows the first failure.
void run_all(thread_pool::ThreadPool* pool, size_t count, const std::function<void(size_t)>& fn) {
  if (pool == nullptr || count <= 1) {
    for (size_t i = 0; i < count; ++i) fn(i);
    return;
  }
  std::vector<std::future<void>> futures;
  futures.reserve(count);
  for (size_t i = 0; i < count; ++i) futures.push_back(pool->Submit([&fn, i] { fn(i); }));
  for (auto& f : futures) f.wait();  // every task still refers to the caller's frame
  for (auto& f : futures) f.get();
}

// Where part of a block's logical bytes go.
struct Piece {
  uint64_t block_offset;  // within the block's logical bytes
  uint8_t* dst;
  uint64_t length;
};

// One block to fetch, and what to do with its logical bytes.
struct BlockPlan {
  size_t block;               // index into ChunkMeta::blocks
  uint8_t* direct = nullptr;  // the whole block lands here, or
  std::vector<Piece> pieces;  // these parts of it land there
};

// A contiguous logical range of the chunk and where it goes.
struct Range {
  uint64_t src;
  uint8_t* dst;
  uint64_t length;
};

// Reading one chunk: the checked metadata, its transforms and error context.
class ChunkRead {
 public:
  ChunkRead(Storage& storage, const std::string& dir, thread_pool::ThreadPool* pool,
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

  // Copies `ranges` (ascending, disjoint, inside the chunk) out of the chunk.
  void read_ranges(const std::vector<Range>& ranges) {
    uint64_t covered = 0;
    for (const Range& r : ranges) covered += r.length;
    std::vector<BlockPlan> plans = plan_blocks(ranges);
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

  std::vector<BlockPlan> plan_blocks(const std::vector<Range>& ranges) const {
    std::vector<BlockPlan> plans;
    for (const Range& r : ranges) {
      if (r.length == 0) continue;
      uint64_t pos = r.src;
      const uint64_t end = r.src + r.length;
      size_t b = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), pos) -
                                     starts_.begin()) - 1;
      while (pos < end) {
        const uint64_t block_start = starts_[b], block_end = starts_[b + 1];
        const uint64_t take = std::min(end, block_end) - pos;
        if (plans.empty() || plans.back().block != b) plans.push_back(BlockPlan{b, nullptr, {}});
        BlockPlan& plan = plans.back();
        uint8_t* dst = r.dst + (pos - r.src);
        if (take == block_end - block_start && plan.pieces.empty()) {
          plan.direct = dst;
        } else {
          plan.pieces.push_back(Piece{pos - block_start, dst, take});
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
      for (const Piece& piece : plan.pieces) {
        std::memcpy(piece.dst, logical[k] + piece.block_offset, static_cast<size_t>(piece.length));
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

EncodedChunk encode_chunk(const uint8_t* data, uint64_t n, size_t element_size,
                          const std::vector<std::string>& chain, int zstd_level,
                          uint64_t block_size, thread_pool::ThreadPool* pool) {
  if (element_size == 0 || block_size < element_size || block_size > kMaxBlockLogicalBytes) {
    throw std::invalid_argument("encode_chunk: block size " + std::to_string(block_size) +
                                " must lie in [element size " + std::to_string(element_size) +
                                ", 1 GiB]");
  }
  if (n % element_size != 0) {
    throw std::invalid_argument("encode_chunk: " + std::to_string(n) +
                                " bytes are not whole elements of " + std::to_string(element_size));
  }
  const TransformChain transforms = TransformChain::for_encoding(chain, zstd_level);
  const uint64_t bs = block_size - block_size % element_size;
  const size_t count = static_cast<size_t>((n + bs - 1) / bs);
  EncodedChunk out;
  out.logical_bytes = n;
  out.blocks.resize(count);
  std::vector<std::vector<uint8_t>> encoded(count);
  // Task `count` hashes the whole chunk alongside the blocks.
  run_all(pool, count + 1, [&](size_t i) {
    if (i == count) {
      out.checksum = xxh3_64(data, static_cast<size_t>(n));
      return;
    }
    const uint64_t start = i * bs;
    const size_t len = static_cast<size_t>(std::min(bs, n - start));
    out.blocks[i].logical_length = len;
    out.blocks[i].checksum = xxh3_64(data + start, len);
    if (!transforms.is_identity()) transforms.encode(data + start, len, element_size, encoded[i]);
  });
  if (transforms.is_identity()) {
    out.stored.assign(data, data + n);
    for (size_t i = 0; i < count; ++i) {
      out.blocks[i].stored_offset = i * bs;
      out.blocks[i].stored_length = out.blocks[i].logical_length;
    }
    return out;
  }
  uint64_t total = 0;
  for (size_t i = 0; i < count; ++i) {
    out.blocks[i].stored_offset = total;
    out.blocks[i].stored_length = encoded[i].size();
    total += encoded[i].size();
  }
  out.stored.resize(static_cast<size_t>(total));
  for (size_t i = 0; i < count; ++i) {
    if (!encoded[i].empty()) {
      std::memcpy(out.stored.data() + out.blocks[i].stored_offset, encoded[i].data(),
                  encoded[i].size());
    }
    std::vector<uint8_t>().swap(encoded[i]);  // release as we go
  }
  return out;
}

// One block of one chunk, queued for a batch.
struct ChunkWriter::Item {
  size_t chunk;
  size_t block;
  const uint8_t* data;
  size_t length;
  size_t element_size;
  std::shared_ptr<const TransformChain> chain;  // null: stored as is
};

// A batch's stored bytes, back to back, and each block's share of them.
struct ChunkWriter::Encoded {
  std::vector<uint8_t> bytes;
  std::vector<uint64_t> lengths;    // stored bytes per item
  std::vector<uint64_t> checksums;  // XXH3 of each item's logical bytes
};

struct ChunkWriter::InFlight {
  std::vector<Item> items;
  std::future<Encoded> result;
};

ChunkWriter::ChunkWriter(WritableFile& file, thread_pool::ThreadPool* pool, Options options)
    : file_(file), pool_(pool), options_(options) {
  options_.max_blocks_in_flight = std::max<size_t>(1, options_.max_blocks_in_flight);
  options_.batch_bytes = std::max<uint64_t>(1, options_.batch_bytes);
}

ChunkWriter::~ChunkWriter() { wait_all(); }

void ChunkWriter::wait_all() noexcept {
  for (InFlight& f : in_flight_) {
    if (f.result.valid()) f.result.wait();  // the task still reads the caller's bytes
  }
  in_flight_.clear();
}

std::shared_ptr<const TransformChain> ChunkWriter::chain_for(
    const std::vector<std::string>& transforms) {
  for (const auto& [descriptors, chain] : chains_) {
    if (descriptors == transforms) return chain;
  }
  auto chain = std::make_shared<const TransformChain>(
      TransformChain::for_encoding(transforms, options_.zstd_level));
  chains_.emplace_back(transforms, chain);
  return chain;
}

size_t ChunkWriter::add_chunk(const uint8_t* data, uint64_t n, size_t element_size,
                              const std::vector<std::string>& transforms,
                              std::shared_ptr<const void> owner) {
  const uint64_t block_size = options_.block_size;
  if (element_size == 0 || block_size == 0 || block_size > kMaxBlockLogicalBytes) {
    throw std::invalid_argument("ChunkWriter: block size " + std::to_string(block_size) +
                                " or element size " + std::to_string(element_size) +
                                " outside [1, 1 GiB]");
  }
  if (n % element_size != 0) {
    throw std::invalid_argument("ChunkWriter: " + std::to_string(n) +
                                " bytes are not whole elements of " + std::to_string(element_size));
  }
  const uint64_t bs = std::max<uint64_t>(element_size, block_size - block_size % element_size);
  const uint64_t batch_limit = std::min(options_.batch_bytes, bs);
  const size_t index = chunks_.size();
  ChunkMeta c;
  c.logical_bytes = n;
  c.transforms = transforms;
  logical_ += n;
  if (n == 0 || (transforms.empty() && n >= batch_limit)) {
    // In place: everything queued before goes first.
    drain();
    c.offset = offset_;
    if (transforms.empty()) {
      write_plain(data, n, bs, c);
    } else {
      c.checksum = xxh3_64(data, 0);
    }
    offset_ += c.length;
    note_written();
    chunks_.push_back(std::move(c));
    owners_.emplace_back();
    blocks_left_.push_back(0);
    return index;
  }
  std::shared_ptr<const TransformChain> chain = transforms.empty() ? nullptr : chain_for(transforms);
  const size_t count = static_cast<size_t>((n + bs - 1) / bs);
  c.blocks.resize(count);
  for (size_t i = 0; i < count; ++i) {
    c.blocks[i].logical_length = std::min(bs, n - i * bs);
  }
  chunks_.push_back(std::move(c));
  owners_.push_back(std::move(owner));
  blocks_left_.push_back(count);
  // A one-block chunk's checksum is its block's (the same XXH3 of the same
  // bytes), taken when the block is written; longer ones are hashed here,
  // block by block, while the pool encodes.
  Xxh3Stream stream;
  for (size_t i = 0; i < count; ++i) {
    const size_t len = static_cast<size_t>(std::min(bs, n - i * bs));
    if (!batch_.empty() && batch_logical_ + len > batch_limit) submit_batch();
    batch_.push_back(Item{index, i, data + i * bs, len, element_size, chain});
    batch_logical_ += len;
    if (batch_logical_ >= batch_limit) submit_batch();
    if (count > 1) stream.update(data + i * bs, len);
  }
  if (count > 1) chunks_[index].checksum = stream.digest();
  return index;
}

void ChunkWriter::submit_batch() {
  if (batch_.empty()) return;
  while (in_flight_.size() >= options_.max_blocks_in_flight) write_oldest();
  std::vector<Item> items = std::move(batch_);
  batch_.clear();
  const uint64_t logical = batch_logical_;
  batch_logical_ = 0;
  // A written batch's buffer is reused: no allocation (and no page faults)
  // per batch.
  std::vector<uint8_t> buffer;
  if (!spare_.empty()) {
    buffer = std::move(spare_.back());
    spare_.pop_back();
  }
  // The caller's bytes stay valid until the task is done (wait_all,
  // write_oldest).
  auto encode = [items, logical, buffer = std::move(buffer)]() mutable {
    Encoded e;
    e.bytes = std::move(buffer);
    e.bytes.clear();
    // Stored bytes rarely exceed logical ones by more than frame headers;
    // a coder briefly needs its bound (zstd's: + 0.4%, + 64 bytes per small
    // frame) at the end of the buffer.
    e.bytes.reserve(static_cast<size_t>(logical + logical / 32 + 512 * items.size()));
    e.lengths.reserve(items.size());
    e.checksums.reserve(items.size());
    for (const Item& it : items) {
      const size_t before = e.bytes.size();
      e.checksums.push_back(xxh3_64(it.data, it.length));
      if (it.chain) {
        it.chain->encode_append(it.data, it.length, it.element_size, e.bytes);
      } else {
        e.bytes.insert(e.bytes.end(), it.data, it.data + it.length);
      }
      e.lengths.push_back(e.bytes.size() - before);
    }
    return e;
  };
  std::future<Encoded> result;
  if (pool_) {
    result = pool_->Submit(encode);
  } else {
    std::promise<Encoded> done;
    try {
      done.set_value(encode());
    } catch (...) {
      done.set_exception(std::current_exception());
    }
    result = done.get_future();
  }
  in_flight_.push_back(InFlight{std::move(items), std::move(result)});
  peak_in_flight_ = std::max(peak_in_flight_, in_flight_.size());
}

void ChunkWriter::write_oldest() {
  InFlight& f = in_flight_.front();
  Encoded e = f.result.get();
  file_.write_at(offset_, e.bytes.data(), e.bytes.size());
  uint64_t at = offset_;
  for (size_t i = 0; i < f.items.size(); ++i) {
    const Item& it = f.items[i];
    ChunkMeta& c = chunks_[it.chunk];
    if (it.block == 0) c.offset = at;
    BlockMeta& block = c.blocks[it.block];
    block.stored_offset = at - c.offset;
    block.stored_length = e.lengths[i];
    block.checksum = e.checksums[i];
    if (c.blocks.size() == 1) c.checksum = e.checksums[i];
    c.length += e.lengths[i];
    at += e.lengths[i];
    if (--blocks_left_[it.chunk] == 0) owners_[it.chunk].reset();
  }
  offset_ = at;
  in_flight_.pop_front();
  if (spare_.size() < options_.max_blocks_in_flight) spare_.push_back(std::move(e.bytes));
  note_written();
}

void ChunkWriter::drain() {
  submit_batch();
  while (!in_flight_.empty()) write_oldest();
}

void ChunkWriter::note_written() {
  if (options_.writeback_bytes == 0 || offset_ - writeback_from_ < options_.writeback_bytes) return;
  file_.start_writeback(writeback_from_, offset_ - writeback_from_);
  writeback_from_ = offset_;
}

// Uncompressed: blocks are checksummed and written straight from the
// caller's memory, in parallel, with no staging copy.
void ChunkWriter::write_plain(const uint8_t* data, uint64_t n, uint64_t block, ChunkMeta& c) {
  const uint64_t nblocks = n == 0 ? 0 : (n + block - 1) / block;
  c.blocks.resize(nblocks);
  c.length = n;
  const uint64_t base = offset_;
  auto write_block = [this, data, n, block, base, &c](uint64_t i) {
    const uint64_t lo = i * block;
    const uint64_t len = std::min(block, n - lo);
    BlockMeta& bm = c.blocks[i];
    bm.stored_offset = lo;
    bm.stored_length = len;
    bm.logical_length = len;
    bm.checksum = xxh3_64(data + lo, len);
    file_.write_at(base + lo, data + lo, len);
  };
  if (pool_ == nullptr || nblocks <= 1) {
    for (uint64_t i = 0; i < nblocks; ++i) write_block(i);
    c.checksum = nblocks == 1 ? c.blocks[0].checksum : xxh3_64(data, n);
    return;
  }
  std::vector<std::future<void>> tasks;
  tasks.reserve(nblocks + 1);
  uint64_t chunk_sum = 0;
  tasks.push_back(pool_->Submit([data, n, &chunk_sum] { chunk_sum = xxh3_64(data, n); }));
  for (uint64_t i = 0; i < nblocks; ++i) tasks.push_back(pool_->Submit(write_block, i));
  checkpoint::wait_all(tasks);
  c.checksum = chunk_sum;
}

std::vector<ChunkMeta> ChunkWriter::finish() {
  drain();
  owners_.clear();
  spare_.clear();
  spare_.shrink_to_fit();
  return std::move(chunks_);
}

ChunkReader::ChunkReader(std::shared_ptr<Storage> storage, std::string checkpoint_dir,
                         thread_pool::ThreadPool* pool)
    : storage_(std::move(storage)), dir_(std::move(checkpoint_dir)), pool_(pool) {}

ChunkReader::~ChunkReader() {
  if (storage_) storage_->drop_read_cache();
}

void ChunkReader::read_logical(const ItemMeta& item, size_t index, uint64_t lo, uint64_t n,
                               uint8_t* dst) {
  ChunkRead read(*storage_, dir_, pool_, item, index);
  const uint64_t logical = read.chunk().logical_bytes;
  if (lo > logical || n > logical - lo) {
    throw std::invalid_argument("read_logical: range [" + std::to_string(lo) + ", +" +
                                std::to_string(n) + ") lies outside the " +
                                std::to_string(logical) + " bytes of " + read.where());
  }
  read.read_ranges({Range{lo, dst, n}});
}

void ChunkReader::read_into(const ItemMeta& item, const ReadRequest& req, uint8_t* dst_box_bytes) {
  ChunkRead read(*storage_, dir_, pool_, item, req.chunk_index);
  const uint64_t logical = read.chunk().logical_bytes;
  std::vector<Range> ranges;
  ranges.reserve(req.ranges.size());
  uint64_t next = 0;  // ranges must ascend without overlap
  for (const ByteRange& r : req.ranges) {
    if (r.src_offset < next || r.src_offset > logical || r.length > logical - r.src_offset) {
      throw std::invalid_argument("read_into: byte range at " + std::to_string(r.src_offset) +
                                  " is out of order or outside the " + std::to_string(logical) +
                                  " bytes of " + read.where());
    }
    next = r.src_offset + r.length;
    ranges.push_back(Range{r.src_offset, dst_box_bytes + r.dst_offset, r.length});
  }
  read.read_ranges(ranges);
}

void ChunkReader::verify_chunk(const ItemMeta& item, size_t index) {
  ChunkRead(*storage_, dir_, pool_, item, index).verify();
}

VerifyReport verify_checkpoint(Storage& storage, const std::string& checkpoint_dir,
                               thread_pool::ThreadPool* pool) {
  const std::string meta_path = join_path(checkpoint_dir, kMetadataFileName);
  if (!storage.exists(meta_path)) {
    throw FormatError("not a committed checkpoint (no .metadata): " + checkpoint_dir);
  }
  const std::vector<uint8_t> bytes = storage.read_file(meta_path, kMaxMetadataBytes);
  const CheckpointMeta meta = decode_metadata(bytes.data(), bytes.size(), meta_path);
  // Non-owning: the caller's storage outlives this call.
  ChunkReader reader(std::shared_ptr<Storage>(std::shared_ptr<Storage>(), &storage),
                     checkpoint_dir, pool);
  VerifyReport report;
  for (const ItemMeta& item : meta.items) {
    for (size_t c = 0; c < item.chunks.size(); ++c) {
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
