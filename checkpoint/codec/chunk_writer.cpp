#include "checkpoint/codec/chunk_writer.h"

#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <cstring>

#include "checkpoint/codec/parallel.h"
#include "checkpoint/codec/transforms.h"
#include "checkpoint/format/checksum.h"
#include "checkpoint/futures.h"

namespace checkpoint {

using codec_detail::run_all;

namespace {

// Throws std::invalid_argument("<who>: <n> bytes are not whole elements of
// <element_size>") unless they are. REQUIRES: element_size > 0.
void require_whole_elements(const char* who, uint64_t n, size_t element_size) {
  if (n % element_size != 0) {
    throw std::invalid_argument(std::string(who) + ": " + std::to_string(n) +
                                " bytes are not whole elements of " + std::to_string(element_size));
  }
}

}  // namespace

EncodedChunk encode_chunk(const uint8_t* data, uint64_t n, size_t element_size,
                          const std::vector<std::string>& chain, int zstd_level,
                          uint64_t block_size, thread_pool::ThreadPool* pool) {
  if (element_size == 0 || block_size < element_size || block_size > kMaxBlockLogicalBytes) {
    throw std::invalid_argument("encode_chunk: block size " + std::to_string(block_size) +
                                " must lie in [element size " + std::to_string(element_size) +
                                ", 1 GiB]");
  }
  require_whole_elements("encode_chunk", n, element_size);
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

// An uncompressed chunk whose blocks are being written from the caller's
// memory: the tasks fill `sums` (each block's checksum, then the chunk's).
struct ChunkWriter::PlainInFlight {
  size_t chunk;
  std::shared_ptr<std::vector<uint64_t>> sums;
  std::vector<std::future<void>> tasks;
  std::shared_ptr<const void> owner;  // the bytes, until the tasks are done
};

ChunkWriter::ChunkWriter(WritableFile& file, thread_pool::ThreadPool* pool, Options options)
    : file_(file), pool_(pool), options_(options) {
  options_.max_batches_in_flight = std::max<size_t>(1, options_.max_batches_in_flight);
  options_.batch_bytes = std::max<uint64_t>(1, options_.batch_bytes);
}

ChunkWriter::~ChunkWriter() { wait_all(); }

void ChunkWriter::wait_all() noexcept {
  for (InFlight& f : in_flight_) {
    if (f.result.valid()) f.result.wait();  // the task still reads the caller's bytes
  }
  in_flight_.clear();
  for (PlainInFlight& p : plain_in_flight_) {
    for (auto& t : p.tasks) {
      if (t.valid()) t.wait();
    }
  }
  plain_in_flight_.clear();
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
  require_whole_elements("ChunkWriter", n, element_size);
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
    if (transforms.empty() && options_.align_in_place_bytes > 0 && n >= options_.align_in_place_bytes) {
      constexpr uint64_t kPage = 4096;  // O_DIRECT's alignment (storage.h)
      const uint64_t address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(data));
      const uint64_t skip = (address % kPage + kPage - offset_ % kPage) % kPage;
      offset_ += skip;
      skipped_ += skip;
    }
    c.offset = offset_;
    if (!transforms.empty()) c.checksum = xxh3_64(data, 0);
    chunks_.push_back(std::move(c));
    owners_.emplace_back();
    blocks_left_.push_back(0);
    if (transforms.empty()) write_plain(index, data, n, bs, std::move(owner));
    offset_ += chunks_[index].length;
    note_written();
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
  while (in_flight_.size() >= options_.max_batches_in_flight) write_oldest();
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
  if (spare_.size() < options_.max_batches_in_flight) spare_.push_back(std::move(e.bytes));
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
// caller's memory, in parallel, with no staging copy. The chunk's layout is
// known at once; the writes and checksums run on the pool while later chunks
// are queued (up to max_batches_in_flight blocks), so the writers never wait
// for a chunk's last block before starting the next chunk's first.
void ChunkWriter::write_plain(size_t index, const uint8_t* data, uint64_t n, uint64_t block,
                              std::shared_ptr<const void> owner) {
  ChunkMeta& c = chunks_[index];
  const size_t nblocks = static_cast<size_t>(n == 0 ? 0 : (n + block - 1) / block);
  c.blocks.resize(nblocks);
  c.length = n;
  for (size_t i = 0; i < nblocks; ++i) {
    BlockMeta& bm = c.blocks[i];
    bm.stored_offset = i * block;
    bm.stored_length = std::min(block, n - i * block);
    bm.logical_length = bm.stored_length;
  }
  if (pool_ == nullptr || nblocks <= 1) {
    for (BlockMeta& bm : c.blocks) {
      bm.checksum = xxh3_64(data + bm.stored_offset, bm.stored_length);
      file_.write_at(c.offset + bm.stored_offset, data + bm.stored_offset, bm.stored_length);
    }
    c.checksum = nblocks == 1 ? c.blocks[0].checksum : xxh3_64(data, n);
    return;
  }
  while (!plain_in_flight_.empty() && plain_blocks_in_flight_ + nblocks > options_.max_batches_in_flight) {
    finish_oldest_plain();
  }
  PlainInFlight f{index, std::make_shared<std::vector<uint64_t>>(nblocks + 1), {}, std::move(owner)};
  f.tasks.reserve(nblocks + 1);
  auto sums = f.sums;
  f.tasks.push_back(pool_->Submit([data, n, sums, nblocks] { (*sums)[nblocks] = xxh3_64(data, n); }));
  WritableFile* file = &file_;
  const uint64_t base = c.offset;
  for (size_t i = 0; i < nblocks; ++i) {
    const uint64_t lo = c.blocks[i].stored_offset;
    const size_t len = static_cast<size_t>(c.blocks[i].stored_length);
    f.tasks.push_back(pool_->Submit([file, data, base, lo, len, sums, i] {
      (*sums)[i] = xxh3_64(data + lo, len);
      file->write_at(base + lo, data + lo, len);
    }));
  }
  plain_blocks_in_flight_ += nblocks;
  plain_in_flight_.push_back(std::move(f));
}

// Waits for the oldest plain chunk's writes (rethrowing their failure) and
// records its checksums.
void ChunkWriter::finish_oldest_plain() {
  PlainInFlight& f = plain_in_flight_.front();
  checkpoint::wait_all(f.tasks);
  ChunkMeta& c = chunks_[f.chunk];
  for (size_t i = 0; i < c.blocks.size(); ++i) c.blocks[i].checksum = (*f.sums)[i];
  c.checksum = f.sums->back();
  plain_blocks_in_flight_ -= c.blocks.size();
  plain_in_flight_.pop_front();
}

std::vector<ChunkMeta> ChunkWriter::finish() {
  drain();
  while (!plain_in_flight_.empty()) finish_oldest_plain();
  owners_.clear();
  spare_.clear();
  spare_.shrink_to_fit();
  return std::move(chunks_);
}

}  // namespace checkpoint
