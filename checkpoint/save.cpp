#include "checkpoint/save.h"

#include "checkpoint/agreement.h"
#include "checkpoint/error_text.h"
#include "checkpoint/format/checksum.h"
#include "checkpoint/codec/chunk_writer.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/codec/transforms.h"
#include "checkpoint/format/wire.h"
#include "checkpoint/timing.h"

#include <thread_pool/thread_pool.hpp>

#include <chrono>
#include <ctime>
#include <future>
#include <map>

namespace checkpoint {

namespace {

using Clock = std::chrono::steady_clock;
using framework::dist::Bytes;

// Throws on every rank if any rank reported an error, naming each
// (agreement.h: every message between ranks starts with a status byte).
void raise_if_any_failed(const std::vector<Bytes>& replies, const std::string& phase,
                         const std::string& step_dir) {
  const std::string failures = describe_rank_failures(replies);
  if (!failures.empty()) {
    throw CheckpointError("checkpoint save to " + step_dir + " failed during " + phase + " (" +
                          failures + "); nothing was committed");
  }
}

// A written chunk as one rank reports it to the coordinator.
void put_chunk_location(wire::ByteWriter& w, const ChunkMeta& c) {
  w.put_u64(c.offset);
  w.put_u64(c.length);
  w.put_u64(c.logical_bytes);
  w.put_u64(c.checksum);
  w.put_varint(c.transforms.size());
  for (const auto& t : c.transforms) w.put_string(t);
  w.put_varint(c.blocks.size());
  for (const auto& b : c.blocks) {
    w.put_u64(b.stored_offset);
    w.put_u64(b.stored_length);
    w.put_u64(b.logical_length);
    w.put_u64(b.checksum);
  }
}

void get_chunk_location(wire::ByteReader& r, ChunkMeta& c) {
  c.offset = r.get_u64("offset");
  c.length = r.get_u64("length");
  c.logical_bytes = r.get_u64("logical bytes");
  c.checksum = r.get_u64("checksum");
  uint64_t nt = r.get_count(1, "transforms");
  for (uint64_t i = 0; i < nt; ++i) c.transforms.push_back(r.get_string(256, "transform"));
  uint64_t nb = r.get_count(32, "blocks");
  c.blocks.resize(nb);
  for (auto& b : c.blocks) {
    b.stored_offset = r.get_u64("block offset");
    b.stored_length = r.get_u64("block length");
    b.logical_length = r.get_u64("block logical length");
    b.checksum = r.get_u64("block checksum");
  }
}

// The bytes of `sub` (inside the held box), contiguous. Splits along dim 0 of
// a contiguous tensor need no copy.
torch::Tensor sub_box(const torch::Tensor& held, const Box& held_box, const Box& sub) {
  if (sub.offsets == held_box.offsets && sub.sizes == held_box.sizes && held.is_contiguous()) {
    return held;  // the whole box (the common case): no views to make
  }
  torch::Tensor t = held;
  for (size_t d = 0; d < sub.offsets.size(); ++d) {
    t = t.narrow(static_cast<int64_t>(d), sub.offsets[d] - held_box.offsets[d], sub.sizes[d]);
  }
  return t.contiguous();
}

// This rank's data file. Chunks are queued in order and written by a
// ChunkWriter: small chunks are grouped into batches of about 1 MiB, each
// encoded (or copied) on the pool and written with one call, at most
// 2 * io_threads batches in flight; big uncompressed chunks go straight from
// the tensors' memory.
class RankWriter {
 public:
  RankWriter(Storage& storage, const std::string& step_dir, int rank, const SaveOptions& options)
      : options_(options), pool_(static_cast<size_t>(std::max(1, options.io_threads))) {
    file_name_ = "rank_" + std::to_string(rank) + ".data";
    file_ = storage.create_file(join_path(step_dir, file_name_));
    ChunkWriter::Options o;
    o.zstd_level = options.compression.level;
    o.block_size = static_cast<uint64_t>(std::max<int64_t>(1, options.compression.block_size));
    o.max_batches_in_flight = 2 * pool_.num_threads();
    chunks_ = std::make_unique<ChunkWriter>(*file_, &pool_, o);
  }

  // Queues `n` logical bytes as the next chunk of this rank's file; the
  // writer holds `owner` (what keeps the bytes alive) until they are written.
  void add_chunk(const uint8_t* data, uint64_t n, DType dtype, std::shared_ptr<const void> owner) {
    chunks_->add_chunk(data, n, element_size(dtype), transform_chain_for(options_.compression, dtype),
                       std::move(owner));
  }

  // Writes what is still in flight, fsyncs and closes the file; returns the
  // chunks' locations in the order queued.
  std::vector<ChunkMeta> finish() {
    std::vector<ChunkMeta> out = chunks_->finish();
    for (ChunkMeta& c : out) c.file = file_name_;
    file_->sync();
    file_->close();
    return out;
  }

  uint64_t stored_bytes() const { return chunks_->stored_bytes(); }
  size_t peak_batches_in_flight() const { return chunks_->peak_batches_in_flight(); }
  uint64_t logical_bytes() const { return chunks_->logical_bytes(); }

 private:
  const SaveOptions& options_;
  thread_pool::ThreadPool pool_;
  std::string file_name_;
  std::unique_ptr<WritableFile> file_;
  std::unique_ptr<ChunkWriter> chunks_;  // destroyed first: waits for its tasks
};

LocalPlan make_local_plan(const StateDict& state, int rank) {
  LocalPlan plan;
  plan.rank = rank;
  for (const auto& t : state.tensors()) {
    WriteItem w;
    w.name = t.name;
    w.kind = ItemKind::kTensor;
    w.dtype = to_dtype(t.local.scalar_type());
    w.global_shape = t.global_shape;
    w.box = Box{t.offsets, t.local.sizes().vec()};
    plan.items.push_back(std::move(w));
  }
  for (const auto& b : state.bytes()) {
    WriteItem w;
    w.name = b.name;
    w.kind = ItemKind::kBytes;
    w.dtype = DType::kUInt8;
    w.global_shape = {static_cast<int64_t>(b.data.size())};
    w.box = Box{{0}, {static_cast<int64_t>(b.data.size())}};
    plan.items.push_back(std::move(w));
  }
  return plan;
}

// This rank's assigned regions, written, synced and closed; returns their
// locations in order.
std::vector<ChunkMeta> write_assignments(const StateDict& state,
                                         const std::vector<WriteAssignment>& assignments,
                                         RankWriter& writer, int rank) {
  std::map<std::string, const TensorEntry*> tensors;
  std::map<std::string, const BytesEntry*> bytes;
  for (const auto& t : state.tensors()) tensors[t.name] = &t;
  for (const auto& b : state.bytes()) bytes[b.name] = &b;
  for (const auto& a : assignments) {
    if (auto it = bytes.find(a.name); it != bytes.end()) {
      const auto& data = it->second->data;  // the state outlives the writer
      writer.add_chunk(data.data(), data.size(), DType::kUInt8, nullptr);
    } else {
      const TensorEntry& t = *tensors.at(a.name);
      auto piece = std::make_shared<const torch::Tensor>(
          sub_box(t.local, Box{t.offsets, t.local.sizes().vec()}, a.box));
      writer.add_chunk(static_cast<const uint8_t*>(piece->data_ptr()),
                       static_cast<uint64_t>(piece->numel()) * piece->element_size(),
                       to_dtype(piece->scalar_type()), piece);
    }
  }
  std::vector<ChunkMeta> out = writer.finish();
  for (size_t i = 0; i < out.size(); ++i) {
    out[i].box = assignments[i].box;
    out[i].writer_rank = rank;
  }
  return out;
}

CheckpointMeta assemble_metadata(const std::vector<LocalPlan>& plans, const GlobalPlan& plan,
                                 const std::vector<Bytes>& locations, int world,
                                 const SaveOptions& options) {
  CheckpointMeta meta;
  meta.format_version = kFormatVersion;
  meta.step = options.step;
  meta.world_size = world;
  meta.layout = options.layout;
  meta.created_unix_s = static_cast<int64_t>(std::time(nullptr));
  meta.info = options.info;
  std::map<std::string, size_t> index;
  for (const auto& lp : plans) {
    for (const auto& w : lp.items) {
      if (index.count(w.name)) continue;
      index[w.name] = meta.items.size();
      ItemMeta item;
      item.name = w.name;
      item.kind = w.kind;
      item.dtype = w.dtype;
      item.global_shape = w.global_shape;
      meta.items.push_back(std::move(item));
    }
  }
  for (int r = 0; r < world; ++r) {
    wire::ByteReader reader(locations[r].data() + 1, locations[r].size() - 1);
    for (const auto& a : plan.per_rank[r]) {
      ChunkMeta c;
      get_chunk_location(reader, c);
      c.box = a.box;
      c.file = "rank_" + std::to_string(r) + ".data";
      c.writer_rank = r;
      meta.items[index.at(a.name)].chunks.push_back(std::move(c));
    }
  }
  return meta;
}

}  // namespace

namespace {

// Step 3: writes this rank's assignments and returns its reply for the
// all-gather: logical and stored bytes, then the chunks' locations.
Bytes write_this_rank(const StateDict& state, const std::string& step_dir, const GlobalPlan& plan,
                      int rank, Storage& storage, const SaveOptions& options, SaveStats& stats) {
  storage.make_dirs(step_dir);
  RankWriter writer(storage, step_dir, rank, options);
  std::vector<ChunkMeta> chunks = write_assignments(state, plan.per_rank[rank], writer, rank);
  stats.logical_bytes = writer.logical_bytes();
  stats.stored_bytes = writer.stored_bytes();
  stats.peak_batches_in_flight = writer.peak_batches_in_flight();
  wire::ByteWriter w;
  w.put_u64(stats.logical_bytes);
  w.put_u64(stats.stored_bytes);
  for (const auto& c : chunks) put_chunk_location(w, c);
  return w.release();
}

// Step 4's input: every rank's chunk locations (tagged, as the metadata
// assembly takes them), adding up the byte totals into `stats`.
std::vector<Bytes> chunk_locations(const std::vector<Bytes>& replies, SaveStats& stats) {
  std::vector<Bytes> locations;
  for (const auto& r : replies) {
    wire::ByteReader reader(r.data() + 1, r.size() - 1);
    stats.total_logical_bytes += reader.get_u64("logical");
    stats.total_stored_bytes += reader.get_u64("stored");
    Bytes rest(r.begin() + 1 + 16, r.end());
    rest.insert(rest.begin(), uint8_t{1});
    locations.push_back(std::move(rest));
  }
  return locations;
}

}  // namespace

SaveStats save_state_dict(const StateDict& state, const std::string& step_dir,
                          framework::dist::Group& group, const SaveOptions& options) {
  require_host_tensors(state, "save_state_dict");
  SaveStats stats;
  const int rank = group.rank();
  const int world = group.size();
  std::shared_ptr<Storage> storage = options.storage ? options.storage : posix_storage();
  auto t0 = Clock::now();

  // 1. Local plans, exchanged.
  Bytes mine;
  try {
    mine = tagged_ok(encode_local_plan(make_local_plan(state, rank)));
    // Durable at once: a commit inside a step directory whose own name is
    // lost in a power cut is no commit (and retention may already have
    // deleted the previous checkpoint).
    if (rank == 0) storage->make_dirs_durable(step_dir);
  } catch (const std::exception& e) {
    mine = tagged_error(error_text(e));
  }
  std::vector<Bytes> replies = group.all_gather_bytes(mine);
  raise_if_any_failed(replies, "planning", step_dir);

  // 2. The global plan: a pure function of the same inputs on every rank.
  std::vector<LocalPlan> plans;
  GlobalPlan plan;
  try {
    for (const auto& r : replies) plans.push_back(decode_local_plan(r.data() + 1, r.size() - 1));
    plan = make_global_plan(plans, options.plan);
  } catch (const std::exception& e) {
    throw CheckpointError("checkpoint save to " + step_dir + " failed during planning: " + error_text(e) +
                          "; nothing was committed");
  }
  stats.plan_s = seconds_since(t0);

  // 3. Write this rank's assignments. The step directory exists once the
  // plans were exchanged (rank 0 made it before replying).
  auto t1 = Clock::now();
  try {
    mine = tagged_ok(write_this_rank(state, step_dir, plan, rank, *storage, options, stats));
  } catch (const std::exception& e) {
    mine = tagged_error(error_text(e));
  }
  replies = group.all_gather_bytes(mine);
  stats.write_s = seconds_since(t1);
  raise_if_any_failed(replies, "writing", step_dir);

  // 4. Commit (coordinator), then tell everyone how it went.
  auto t2 = Clock::now();
  const std::vector<Bytes> locations = chunk_locations(replies, stats);
  Bytes verdict;
  if (rank == 0) {
    try {
      CheckpointMeta meta = assemble_metadata(plans, plan, locations, world, options);
      // The data files' names in the step directory must reach the disk
      // before the commit: POSIX does not order the .metadata rename after
      // them, and a commit naming a lost file is a damaged checkpoint.
      storage->sync_dir(step_dir);
      storage->write_file_atomic(join_path(step_dir, kMetadataFileName), encode_metadata(meta));
      verdict = tagged_ok({});
    } catch (const std::exception& e) {
      verdict = tagged_error(std::string("commit: ") + error_text(e));
    }
  }
  verdict = group.broadcast_bytes(verdict, 0);
  stats.commit_s = seconds_since(t2);
  if (!tagged_succeeded(verdict)) {
    throw CheckpointError("checkpoint save to " + step_dir + " failed (rank 0 " +
                          tagged_text(verdict) + "); nothing was committed");
  }
  return stats;
}

}  // namespace checkpoint
