#include "checkpoint/interop/hf.h"

#include <algorithm>
#include <cstdio>

#include "checkpoint/format/checksum.h"

#include "checkpoint/format/metadata.h"
#include "checkpoint/interop/export.h"
#include "checkpoint/interop/streaming.h"
#include "checkpoint/interop/weights_file.h"

namespace checkpoint {

namespace {

// Copies tensor `t` of `weights` into `out` as model.<name>, floats as
// float32, in dim-0 slabs of at most slab_bytes.
void import_tensor(const WeightsFile& weights, const WeightsTensorInfo& t, uint64_t slab_bytes,
                   ImportWriter& out, HfImportStats& stats) {
  const DType to = is_floating_dtype(t.dtype) ? DType::kFloat32 : t.dtype;
  if (to != t.dtype) stats.converted.push_back(t.name);
  ItemMeta item;
  item.name = "model." + t.name;
  item.dtype = to;
  item.global_shape = t.shape;
  const size_t index = out.add_item(std::move(item));
  const Box full = full_box(t.shape);
  std::vector<uint8_t> raw;
  for (const Box& slab : dim0_slabs(full, rows_per_slab(full, element_size(to), slab_bytes))) {
    const uint64_t n = static_cast<uint64_t>(slab.numel());
    raw.resize(n * element_size(t.dtype));
    auto buf = std::make_shared<std::vector<uint8_t>>(n * element_size(to));
    if (n > 0) {
      weights.read_box(t.name, slab, raw.data());
      if (to != t.dtype) {
        convert_float_elements(t.dtype, to, raw.data(), n, buf->data());
      } else {
        std::copy(raw.begin(), raw.end(), buf->begin());
      }
    }
    stats.bytes += buf->size();
    out.add_chunk(index, slab, std::move(buf), element_size(to));
  }
  ++stats.tensors;
}

}  // namespace

HfImportStats import_hf_checkpoint(const std::string& src, const std::string& step_dir,
                                   const HfImportOptions& options) {
  std::shared_ptr<Storage> storage = options.storage ? options.storage : posix_storage();
  if (storage->stat(src).type != FileType::kDirectory || !is_hf_model_dir(*storage, src)) {
    throw FormatError(src + ": not a Hugging Face model directory (no " + kHfSingleName + " or " +
                      kHfIndexName + ")");
  }
  const WeightsFile weights = WeightsFile::open(src, storage).renamed(options.renames);
  if (weights.tensors().empty()) throw FormatError(src + ": nothing to import: no tensors");
  if (storage->exists(step_dir)) {
    throw IoError(step_dir + ": exists; import-hf writes a new checkpoint directory");
  }
  HfImportStats stats;
  CheckpointMeta header = imported_checkpoint_meta("imported from Hugging Face", "huggingface", src);
  const std::string config_path = join_path(src, "config.json");
  if (storage->exists(config_path)) {
    std::string text(storage->file_size(config_path), '\0');
    storage->read_at(config_path, 0, text.data(), text.size());
    header.info["hf_config"] = text;
  }
  storage->make_dirs_durable(step_dir);
  try {
    ImportWriter out(*storage, step_dir, options.io_threads);
    for (const WeightsTensorInfo& t : weights.tensors()) import_tensor(weights, t, options.slab_bytes, out, stats);
    if (!options.step_item.empty()) out.add_int64_item(options.step_item, 0);  // a model to start from
    header.step = 0;
    out.commit(std::move(header));
  } catch (...) {
    storage->remove_all(step_dir);
    throw;
  }
  return stats;
}

std::string weights_content_hash(const std::string& path, std::shared_ptr<Storage> storage,
                                 uint64_t slab_bytes) {
  const WeightsFile weights = WeightsFile::open(path, storage ? storage : posix_storage());
  std::vector<const WeightsTensorInfo*> order;
  for (const WeightsTensorInfo& t : weights.tensors()) order.push_back(&t);
  std::sort(order.begin(), order.end(),
            [](const WeightsTensorInfo* a, const WeightsTensorInfo* b) { return a->name < b->name; });
  Xxh3Stream hash;
  std::vector<uint8_t> buf;
  for (const WeightsTensorInfo* t : order) {
    // name NUL dtype NUL rank dims..., then the bytes
    hash.update(t->name.data(), t->name.size() + 1);
    const std::string dtype = dtype_name(t->dtype);
    hash.update(dtype.data(), dtype.size() + 1);
    const uint64_t rank = t->shape.size();
    hash.update(&rank, sizeof(rank));
    hash.update(t->shape.data(), t->shape.size() * sizeof(int64_t));
    const Box full = full_box(t->shape);
    const size_t esize = element_size(t->dtype);
    for (const Box& slab : dim0_slabs(full, rows_per_slab(full, esize, slab_bytes))) {
      const uint64_t n = static_cast<uint64_t>(slab.numel());
      if (n == 0) continue;
      buf.resize(n * esize);
      weights.read_box(t->name, slab, buf.data());
      hash.update(buf.data(), buf.size());
    }
  }
  char hex[24];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(hash.digest()));
  return std::string("xxh3:") + hex;
}

}  // namespace checkpoint
