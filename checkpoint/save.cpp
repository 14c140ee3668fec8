#include "checkpoint/save.h"

#include "checkpoint/save_protocol.h"

#include "checkpoint/agreement.h"
#include "checkpoint/error_text.h"
#include "checkpoint/format/checksum.h"
#include "checkpoint/codec/chunk_writer.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/format/metadata_codec.h"
#include "checkpoint/codec/transforms.h"
#include "checkpoint/format/wire.h"
#include "checkpoint/timing.h"

#include <thread_pool/thread_pool.hpp>

#include <chrono>
#include <ctime>
#include <future>
#include <map>
#include <random>
#include <string_view>
#include <unordered_map>

namespace checkpoint {

namespace {

using Clock = std::chrono::steady_clock;
using comm::Bytes;

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

}  // namespace

Box CoordinatorPlan::box(uint64_t k) const {
  const size_t ndim = items[item_of[k]].global_shape.size();
  const int64_t* c = coords.data() + coord_at[k];
  return Box{std::vector<int64_t>(c, c + ndim), std::vector<int64_t>(c + ndim, c + 2 * ndim)};
}

std::vector<WriteAssignment> CoordinatorPlan::assignments(int rank) const {
  std::vector<WriteAssignment> out;
  for (uint64_t k = rank_begin[rank]; k < rank_begin[rank + 1]; ++k) {
    out.push_back(WriteAssignment{items[item_of[k]].name, box(k)});
  }
  return out;
}

namespace save_protocol {

uint64_t structure_hash(const Bytes& local_plan_blob, const PlanOptions& options, int world,
                        int rank) {
  Xxh3Stream h;
  h.update(local_plan_blob.data(), local_plan_blob.size());
  const uint64_t extra[3] = {options.split_min_bytes, static_cast<uint64_t>(world),
                             static_cast<uint64_t>(rank)};
  h.update(extra, sizeof extra);
  return h.digest();
}

std::vector<Bytes> plan_replies(std::vector<Bytes> gathered, const PlanOptions& options,
                                const std::string& step_dir, uint64_t plan_id,
                                CoordinatorPlan* kept) {
  const size_t world = gathered.size();
  auto everyone = [&](const std::string& error) { return std::vector<Bytes>(world, tagged_error(error)); };
  const std::string failures = describe_rank_failures(gathered);
  if (!failures.empty()) {
    return everyone("checkpoint save to " + step_dir + " failed during planning (" + failures +
                    "); nothing was committed");
  }
  CoordinatorPlan plan;
  GlobalPlan global;
  try {
    // One plan at a time, each blob freed once added: the coordinator never
    // holds every rank's decoded plan.
    GlobalPlanner planner(world, options);
    for (size_t r = 0; r < world; ++r) {
      const int claimed = planner.add_encoded(gathered[r].data() + 1, gathered[r].size() - 1);
      if (claimed != static_cast<int>(r)) {
        throw PlanError("the local plan from rank " + std::to_string(r) + " claims rank " +
                        std::to_string(claimed));
      }
      Bytes().swap(gathered[r]);
    }
    std::vector<WriteItem> declarations;
    global = planner.finish(&declarations);
    plan.items.reserve(declarations.size());
    for (WriteItem& w : declarations) {
      ItemMeta item;
      item.name = std::move(w.name);
      item.kind = w.kind;
      item.dtype = w.dtype;
      item.global_shape = std::move(w.global_shape);
      plan.items.push_back(std::move(item));
    }
  } catch (const std::exception& e) {
    return everyone("checkpoint save to " + step_dir + " failed during planning: " + error_text(e) +
                    "; nothing was committed");
  }
  // Each rank's reply, and the plan kept compact: each rank's assignments are
  // freed as soon as they are encoded and recorded.
  std::unordered_map<std::string_view, uint32_t> item_index;
  for (size_t i = 0; i < plan.items.size(); ++i) item_index.emplace(plan.items[i].name, static_cast<uint32_t>(i));
  std::vector<Bytes> replies(world);
  plan.rank_begin.assign(1, 0);
  for (size_t r = 0; r < world; ++r) {
    wire::ByteWriter w;
    w.put_u64(plan_id);
    Bytes body = w.release();
    Bytes assigned = encode_assignments(global.per_rank[r]);
    body.reserve(1 + body.size() + assigned.size());
    body.insert(body.begin(), uint8_t{1});  // tagged ok
    body.insert(body.end(), assigned.begin(), assigned.end());
    replies[r] = std::move(body);
    for (const WriteAssignment& a : global.per_rank[r]) {
      plan.item_of.push_back(item_index.at(a.name));
      plan.coord_at.push_back(plan.coords.size());
      plan.coords.insert(plan.coords.end(), a.box.offsets.begin(), a.box.offsets.end());
      plan.coords.insert(plan.coords.end(), a.box.sizes.begin(), a.box.sizes.end());
    }
    plan.rank_begin.push_back(plan.item_of.size());
    std::vector<WriteAssignment>().swap(global.per_rank[r]);
  }
  if (kept) *kept = std::move(plan);
  return replies;
}

std::vector<WriteAssignment> assignments_from_reply(const Bytes& reply, uint64_t* plan_id) {
  if (!tagged_succeeded(reply)) throw CheckpointError(tagged_text(reply));
  if (reply.size() < 1 + 8) throw CheckpointError("checkpoint save: short planning reply");
  wire::ByteReader r(reply.data() + 1, 8);
  const uint64_t id = r.get_u64("plan id");
  if (plan_id) *plan_id = id;
  return decode_assignments(reply.data() + 9, reply.size() - 9);
}

Bytes encode_write_report(uint64_t logical_bytes, uint64_t stored_bytes, const std::vector<ChunkMeta>& chunks) {
  wire::ByteWriter w;
  w.put_u64(logical_bytes);
  w.put_u64(stored_bytes);
  for (const ChunkMeta& c : chunks) metadata_codec::put_chunk(w, c);  // as in the metadata
  return w.release();
}

Bytes assemble_metadata(const CoordinatorPlan& kept, const std::vector<Bytes>& reports,
                        const SaveOptions& options, SaveStats& stats) {
  const int world = static_cast<int>(reports.size());
  if (world != kept.world()) {
    throw CheckpointError("checkpoint save: " + std::to_string(world) + " write reports for a plan of " +
                          std::to_string(kept.world()) + " ranks");
  }
  // Where each assignment's location lies in its rank's report (one pass
  // over every report), and the byte totals.
  const uint64_t n = kept.item_of.size();
  std::vector<uint64_t> location_at(n);
  for (int r = 0; r < world; ++r) {
    const Bytes& report = reports[r];
    wire::ByteReader reader(report.data() + 1, report.size() - 1);
    stats.total_logical_bytes += reader.get_u64("logical");
    stats.total_stored_bytes += reader.get_u64("stored");
    for (uint64_t k = kept.rank_begin[r]; k < kept.rank_begin[r + 1]; ++k) {
      location_at[k] = 1 + (report.size() - 1 - reader.remaining());
      metadata_codec::get_chunk(reader, kept.items[kept.item_of[k]].global_shape.size());
    }
    if (!reader.at_end()) {
      throw CheckpointError("checkpoint save: rank " + std::to_string(r) + "'s write report has " +
                            std::to_string(reader.remaining()) + " bytes more than its chunks");
    }
  }
  // Each item's assignments in (rank, plan) order: a counting sort.
  const size_t items = kept.items.size();
  std::vector<uint64_t> item_begin(items + 1, 0);
  for (uint32_t i : kept.item_of) ++item_begin[i + 1];
  for (size_t i = 0; i < items; ++i) item_begin[i + 1] += item_begin[i];
  std::vector<uint64_t> by_item(n);
  std::vector<int32_t> rank_of(n);
  {
    std::vector<uint64_t> fill(item_begin.begin(), item_begin.end() - 1);
    for (int r = 0; r < world; ++r) {
      for (uint64_t k = kept.rank_begin[r]; k < kept.rank_begin[r + 1]; ++k) {
        const uint64_t at = fill[kept.item_of[k]]++;
        by_item[at] = k;
        rank_of[at] = r;
      }
    }
  }
  CheckpointMeta fields;
  fields.step = options.step;
  fields.world_size = world;
  fields.layout = options.layout;
  fields.created_unix_s = static_cast<int64_t>(std::time(nullptr));
  fields.info = options.info;
  MetadataWriter writer(fields);
  std::vector<std::string> files(world);
  for (int r = 0; r < world; ++r) files[r] = "rank_" + std::to_string(r) + ".data";
  for (size_t i = 0; i < items; ++i) {
    ItemMeta item = kept.items[i];
    item.chunks.resize(item_begin[i + 1] - item_begin[i]);
    for (uint64_t at = item_begin[i]; at < item_begin[i + 1]; ++at) {
      const uint64_t k = by_item[at];
      const int r = rank_of[at];
      ChunkMeta& c = item.chunks[at - item_begin[i]];
      const Bytes& report = reports[r];
      wire::ByteReader reader(report.data() + location_at[k], report.size() - location_at[k]);
      c = metadata_codec::get_chunk(reader, item.global_shape.size());
      c.box = kept.box(k);
      c.file = files[r];
      c.writer_rank = r;
    }
    writer.add_item(item);
  }
  return writer.finish();
}

}  // namespace save_protocol

namespace {

// Step 3: writes this rank's assignments and returns its write report:
// logical and stored bytes, then the chunks' records (save_protocol.h).
Bytes write_this_rank(const StateDict& state, const std::string& step_dir,
                      const std::vector<WriteAssignment>& assignments, int rank, Storage& storage,
                      const SaveOptions& options, SaveStats& stats) {
  storage.make_dirs(step_dir);
  RankWriter writer(storage, step_dir, rank, options);
  std::vector<ChunkMeta> chunks = write_assignments(state, assignments, writer, rank);
  stats.logical_bytes = writer.logical_bytes();
  stats.stored_bytes = writer.stored_bytes();
  stats.peak_batches_in_flight = writer.peak_batches_in_flight();
  return save_protocol::encode_write_report(stats.logical_bytes, stats.stored_bytes, chunks);
}

// A fresh plan id: agreed by the coordinator's scatter, never 0, < 2^62 (so
// that its negation fits the agreement's all-reduce).
uint64_t new_plan_id() {
  std::random_device rd;
  const uint64_t id = (static_cast<uint64_t>(rd()) << 32 | rd()) ^
                      static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  return (id & ((uint64_t{1} << 62) - 1)) | 1;
}

// Whether every rank may save with its cached plan: one all-reduce (MIN) of
// [this rank fits, plan id, -plan id]; true iff all fit and all ids agree.
bool cached_plan_agreed(comm::Group& group, bool fits, uint64_t plan_id) {
  const int64_t id = fits ? static_cast<int64_t>(plan_id) : 0;
  at::Tensor agree = torch::tensor({int64_t{fits ? 1 : 0}, id, -id}, torch::kLong);
  group.all_reduce(agree, comm::ReduceOp::kMin);
  const int64_t* v = agree.data_ptr<int64_t>();
  return v[0] == 1 && v[1] == -v[2] && v[1] != 0;
}

// Removes `step_dir`'s .metadata (and a leftover .metadata.tmp) and fsyncs
// the directory; best effort: the caller is already failing.
void withdraw_commit(Storage& storage, const std::string& step_dir) {
  try {
    storage.remove_all(join_path(step_dir, kMetadataFileName));
    storage.remove_all(join_path(step_dir, std::string(kMetadataFileName) + ".tmp"));
    storage.sync_dir(step_dir);
  } catch (const std::exception&) {
  }
}

// Step 1: this rank's encoded local plan; `error` is set instead when it
// cannot be made (the rank still takes every collective).
Bytes make_local_plan_blob(const StateDict& state, const std::string& step_dir, int rank, Storage& storage,
                           const SaveOptions& options, std::string* error) {
  try {
    Bytes blob = encode_local_plan(make_local_plan(state, rank));
    // Durable at once: a commit inside a step directory whose own name is
    // lost in a power cut is no commit (and retention may already have
    // deleted the previous checkpoint).
    if (rank == 0 || options.node_local) storage.make_dirs_durable(step_dir);
    return blob;
  } catch (const std::exception& e) {
    *error = error_text(e);
    return {};
  }
}

// Step 2 in full: the coordinator plans from every rank's blob and scatters
// each rank its assignments. Refills `cache` (when given); `kept` is the
// coordinator's plan (rank 0 only).
std::vector<WriteAssignment> plan_with_coordinator(comm::Group& group, Bytes blob,
                                                   const std::string& error, uint64_t structure,
                                                   const std::string& step_dir, const SaveOptions& options,
                                                   SavePlanCache* cache,
                                                   std::shared_ptr<const CoordinatorPlan>* kept) {
  if (cache) {
    ++cache->misses;
    cache->valid = false;
  }
  std::vector<Bytes> gathered =
      group.gather_bytes(error.empty() ? tagged_ok(std::move(blob)) : tagged_error(error), 0);
  std::vector<Bytes> replies;
  if (group.rank() == 0) {
    auto plan = std::make_shared<CoordinatorPlan>();
    replies = save_protocol::plan_replies(std::move(gathered), options.plan, step_dir, new_plan_id(), plan.get());
    *kept = std::move(plan);
  }
  gathered = {};
  uint64_t plan_id = 0;
  std::vector<WriteAssignment> assignments =
      save_protocol::assignments_from_reply(group.scatter_bytes(replies, 0), &plan_id);
  if (cache) {
    cache->structure = structure;
    cache->plan_id = plan_id;
    cache->assignments = assignments;
    cache->coordinator = *kept;
    cache->valid = true;
  }
  return assignments;
}

// Step 2: the plan, cached when every rank's structure is unchanged, else
// from the coordinator (plan_with_coordinator).
std::vector<WriteAssignment> agree_on_plan(comm::Group& group, Bytes blob, const std::string& error,
                                           const std::string& step_dir, const SaveOptions& options,
                                           SaveStats& stats, std::shared_ptr<const CoordinatorPlan>* kept) {
  SavePlanCache* cache = options.plan_cache.get();
  const uint64_t structure =
      error.empty() ? save_protocol::structure_hash(blob, options.plan, group.size(), group.rank()) : 0;
  if (cache) {
    const bool fits = error.empty() && cache->valid && cache->structure == structure &&
                      (group.rank() != 0 || cache->coordinator);
    stats.plan_cached = cached_plan_agreed(group, fits, cache->plan_id);
  }
  if (!stats.plan_cached) {
    return plan_with_coordinator(group, std::move(blob), error, structure, step_dir, options, cache, kept);
  }
  ++cache->hits;
  *kept = cache->coordinator;
  return cache->assignments;
}

// Step 4 (coordinator): the verdict every rank receives. Commits the metadata
// when every rank's report is a success; the verdict then carries the totals
// (and, node-local, the encoded metadata), else the failure.
Bytes commit_on_coordinator(const std::shared_ptr<const CoordinatorPlan>& kept, std::vector<Bytes> reports,
                            const std::string& step_dir, Storage& storage, const SaveOptions& options) {
  const std::string failures = describe_rank_failures(reports);
  if (!failures.empty()) {
    return tagged_error("checkpoint save to " + step_dir + " failed during writing (" + failures +
                        "); nothing was committed");
  }
  try {
    SaveStats totals;
    Bytes encoded = save_protocol::assemble_metadata(*kept, reports, options, totals);
    reports = {};
    if (!options.node_local) {
      // The data files' names in the step directory must reach the disk
      // before the commit: POSIX does not order the .metadata rename after
      // them, and a commit naming a lost file is a damaged checkpoint.
      storage.sync_dir(step_dir);
      storage.write_file_atomic(join_path(step_dir, kMetadataFileName), encoded);
    }
    wire::ByteWriter w;
    w.put_u64(totals.total_logical_bytes);
    w.put_u64(totals.total_stored_bytes);
    Bytes head = w.release();
    if (options.node_local) head.insert(head.end(), encoded.begin(), encoded.end());
    return tagged_ok(std::move(head));
  } catch (const std::exception& e) {
    // The rename may have happened before the directory fsync failed:
    // take the commit back, durably, so that the live directory agrees
    // with the error and a power loss cannot bring it back (a failed
    // fsync is never retried and trusted; FORMAT.md "Durability").
    if (!options.node_local) withdraw_commit(storage, step_dir);
    return tagged_error("checkpoint save to " + step_dir + " failed (rank 0 commit: " + error_text(e) +
                        "); nothing was committed");
  }
}

// After step 4 (all ranks): throws the failure, or fills the totals (and,
// node-local, the metadata) from the coordinator's verdict.
void read_verdict(const Bytes& verdict, const SaveOptions& options, SaveStats& stats) {
  if (!tagged_succeeded(verdict)) throw CheckpointError(tagged_text(verdict));
  wire::ByteReader totals(verdict.data() + 1, verdict.size() - 1);
  stats.total_logical_bytes = totals.get_u64("total logical");
  stats.total_stored_bytes = totals.get_u64("total stored");
  if (options.node_local) stats.metadata.assign(verdict.begin() + 1 + 16, verdict.end());
}

}  // namespace

SaveStats save_state_dict(const StateDict& state, const std::string& step_dir,
                          comm::Group& group, const SaveOptions& options) {
  require_host_tensors(state, "save_state_dict");
  SaveStats stats;
  const int rank = group.rank();
  std::shared_ptr<Storage> storage = options.storage ? options.storage : posix_storage();
  auto t0 = Clock::now();

  // 1. This rank's local plan.
  std::string error;
  Bytes blob = make_local_plan_blob(state, step_dir, rank, *storage, options, &error);

  // 2. The plan: cached when every rank's structure is unchanged, else from
  // the coordinator.
  std::shared_ptr<const CoordinatorPlan> kept;
  const std::vector<WriteAssignment> assignments =
      agree_on_plan(group, std::move(blob), error, step_dir, options, stats, &kept);
  stats.plan_s = seconds_since(t0);

  // 3. Write this rank's assignments. The step directory exists once the
  // plan was agreed (rank 0 made it before).
  auto t1 = Clock::now();
  Bytes report;
  try {
    report = tagged_ok(write_this_rank(state, step_dir, assignments, rank, *storage, options, stats));
  } catch (const std::exception& e) {
    report = tagged_error(error_text(e));
  }
  std::vector<Bytes> reports = group.gather_bytes(report, 0);
  stats.write_s = seconds_since(t1);

  // 4. Commit (coordinator), then tell everyone how it went.
  auto t2 = Clock::now();
  Bytes verdict;
  if (rank == 0) verdict = commit_on_coordinator(kept, std::move(reports), step_dir, *storage, options);
  verdict = group.broadcast_bytes(verdict, 0);
  stats.commit_s = seconds_since(t2);
  read_verdict(verdict, options, stats);
  return stats;
}

}  // namespace checkpoint
