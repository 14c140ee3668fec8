#include "checkpoint/load.h"

#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/futures.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/plan/resharding.h"

#include <thread_pool/thread_pool.hpp>

#include <future>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string_view>
#include <unordered_map>

namespace checkpoint {

namespace {

// The saved items by name.
class ItemIndex {
 public:
  explicit ItemIndex(const CheckpointMeta& meta) {
    by_name_.reserve(meta.items.size());
    for (const ItemMeta& item : meta.items) by_name_.emplace(item.name, &item);
  }
  const ItemMeta* find(const std::string& name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : it->second;
  }

 private:
  std::unordered_map<std::string_view, const ItemMeta*> by_name_;
};

// Strictness, both directions, named: fills stats.missing and
// stats.unexpected, and throws unless options.allow_partial.
void check_names(const StateDict& state, const CheckpointMeta& meta, const ItemIndex& index,
                 const std::string& step_dir, const LoadOptions& options, LoadStats& stats) {
  auto wanted = [&](const std::string& name) { return !options.filter || options.filter(name); };
  std::set<std::string> have;
  for (const auto& t : state.tensors()) have.insert(t.name);
  for (const auto& b : state.bytes()) have.insert(b.name);
  std::vector<std::string> required_missing;
  for (const auto& name : have) {
    if (wanted(name) && index.find(name) == nullptr) {
      stats.missing.push_back(name);
      if (!options.optional || !options.optional(name)) required_missing.push_back(name);
    }
  }
  for (const auto& item : meta.items) {
    if (wanted(item.name) && !have.count(item.name)) stats.unexpected.push_back(item.name);
  }
  if (options.allow_partial || (required_missing.empty() && stats.unexpected.empty())) return;
  std::ostringstream msg;
  msg << "checkpoint " << step_dir << " does not match the state being loaded";
  if (!required_missing.empty()) msg << "; missing keys: " << join_names(required_missing);
  if (!stats.unexpected.empty()) msg << "; unexpected keys: " << join_names(stats.unexpected);
  msg << " (checkpoint.allow_partial: true tolerates this)";
  throw CheckpointError(msg.str());
}

// Throws CheckpointError naming the item when the saved item cannot fill `t`.
void check_tensor_matches(const ItemMeta& item, const TensorEntry& t, const std::string& where) {
  if (item.kind != ItemKind::kTensor) throw CheckpointError(where + " is not a tensor");
  if (item.dtype != to_dtype(t.local.scalar_type())) {
    throw CheckpointError("dtype mismatch for " + where + ": the checkpoint has " +
                          dtype_name(item.dtype) + ", the state expects " +
                          dtype_name(to_dtype(t.local.scalar_type())));
  }
  if (item.global_shape != t.global_shape) {
    throw CheckpointError("shape mismatch for " + where + ": the checkpoint has " +
                          shape_to_string(item.global_shape) + ", the state expects " +
                          shape_to_string(t.global_shape));
  }
  TORCH_CHECK(t.local.is_contiguous(), "load: ", where, ": destination must be contiguous");
}

}  // namespace

LoadStats load_state_dict(StateDict& state, const std::string& step_dir, const LoadOptions& options) {
  require_host_tensors(state, "load_state_dict");
  std::shared_ptr<Storage> storage = options.storage ? options.storage : posix_storage();
  // Only the metadata records of the chunks this rank's regions overlap
  // (a version-2 file's index; a version-1 file is read whole), after the
  // head shows that the state matches the checkpoint.
  MetadataReader reader_meta(*storage, step_dir);
  CheckpointMeta meta = reader_meta.head();
  const ItemIndex index(meta);
  auto wanted = [&](const std::string& name) { return !options.filter || options.filter(name); };
  auto item_index = [&](const ItemMeta* item) { return static_cast<size_t>(item - meta.items.data()); };

  LoadStats stats;
  stats.step = meta.step;
  stats.saved_world_size = meta.world_size;
  stats.saved_layout = meta.layout;
  check_names(state, meta, index, step_dir, options, stats);
  for (auto& t : state.tensors()) {
    const ItemMeta* item = wanted(t.name) ? index.find(t.name) : nullptr;
    if (item == nullptr) continue;
    check_tensor_matches(*item, t, "item '" + t.name + "' of checkpoint " + step_dir);
    const size_t i = item_index(item);
    meta.items[i].chunks = reader_meta.chunks_overlapping(i, {Box{t.offsets, t.local.sizes().vec()}});
  }
  for (auto& b : state.bytes()) {
    const ItemMeta* item = wanted(b.name) ? index.find(b.name) : nullptr;
    if (item == nullptr || item->kind != ItemKind::kBytes) continue;  // refused below
    const size_t i = item_index(item);
    meta.items[i].chunks = reader_meta.chunks_overlapping(i, {full_box(item->global_shape)});
  }
  stats.metadata_bytes_read = reader_meta.bytes_read();

  // One task per request on `pool`; a request spanning several blocks (a big
  // chunk) decodes them in parallel on `block_pool`, a second pool so that
  // no task waits on its own pool. `pool` is declared last: if this throws
  // with tasks queued, its destructor finishes them before `reader` goes.
  const size_t threads = static_cast<size_t>(std::max(1, options.io_threads));
  thread_pool::ThreadPool block_pool(threads);
  ChunkReader reader(storage, step_dir, &block_pool);
  thread_pool::ThreadPool pool(threads);
  std::vector<std::future<void>> tasks;

  for (auto& t : state.tensors()) {
    const ItemMeta* item = wanted(t.name) ? index.find(t.name) : nullptr;
    if (item == nullptr) continue;  // filtered out, or missing and tolerated above
    check_tensor_matches(*item, t, "item '" + t.name + "' of checkpoint " + step_dir);
    Box box{t.offsets, t.local.sizes().vec()};
    uint8_t* dst = static_cast<uint8_t*>(t.local.data_ptr());
    for (ReadRequest& req : plan_reads(*item, box)) {
      tasks.push_back(pool.Submit([&reader, item, dst, r = std::move(req)] {
        reader.read_into(*item, r, dst);
      }));
    }
    stats.bytes_read += static_cast<uint64_t>(t.local.numel()) * t.local.element_size();
  }
  for (auto& b : state.bytes()) {
    const ItemMeta* item = wanted(b.name) ? index.find(b.name) : nullptr;
    if (item == nullptr) continue;
    if (item->kind != ItemKind::kBytes || item->chunks.size() != 1) {
      throw CheckpointError("item '" + b.name + "' of checkpoint " + step_dir +
                            " is not a bytes item");
    }
    b.data.assign(static_cast<size_t>(item->chunks[0].logical_bytes), 0);
    BytesEntry* entry = &b;
    tasks.push_back(pool.Submit([&reader, item, entry] {
      reader.read_logical(*item, 0, 0, entry->data.size(), entry->data.data());
    }));
    stats.bytes_read += b.data.size();
  }
  wait_all(tasks);
  return stats;
}

std::vector<std::string> files_needed(const StateDict& state, const std::vector<uint8_t>& metadata,
                                      const LoadOptions& options) {
  // Named in errors as it always was (it used to be parsed from an in-memory
  // storage's /checkpoint).
  MetadataReader reader(metadata, join_path("/checkpoint", kMetadataFileName));
  const CheckpointMeta& meta = reader.head();
  const ItemIndex index(meta);
  auto wanted = [&](const std::string& name) { return !options.filter || options.filter(name); };
  std::set<std::string> files;
  auto add = [&](const ItemMeta* item, const Box& box) {
    const size_t i = static_cast<size_t>(item - meta.items.data());
    for (const ChunkMeta& c : reader.chunks_overlapping(i, {box})) files.insert(c.file);
  };
  for (const auto& t : state.tensors()) {
    const ItemMeta* item = wanted(t.name) ? index.find(t.name) : nullptr;
    if (item == nullptr || item->kind == ItemKind::kBytes ||
        item->global_shape.size() != t.offsets.size()) {
      continue;
    }
    add(item, Box{t.offsets, t.local.sizes().vec()});
  }
  for (const auto& b : state.bytes()) {
    const ItemMeta* item = wanted(b.name) ? index.find(b.name) : nullptr;
    if (item == nullptr || item->kind != ItemKind::kBytes) continue;
    add(item, full_box(item->global_shape));
  }
  return {files.begin(), files.end()};
}

}  // namespace checkpoint
