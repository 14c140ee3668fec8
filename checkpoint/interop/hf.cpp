#include "checkpoint/interop/hf.h"

#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <ctime>

#include "checkpoint/codec/chunk_writer.h"
#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/interop/export.h"
#include "checkpoint/interop/weights_file.h"

namespace checkpoint {

namespace {

bool is_float(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kFloat16 || d == DType::kBFloat16;
}

}  // namespace

HfImportStats import_hf_checkpoint(const std::string& src, const std::string& step_dir,
                                   const HfImportOptions& options) {
  std::shared_ptr<Storage> storage = options.storage ? options.storage : posix_storage();
  if (storage->stat(src).type != FileType::kDirectory || !is_hf_model_dir(*storage, src)) {
    throw FormatError(src + ": not a Hugging Face model directory (no " + kHfSingleName + " or " +
                      kHfIndexName + ")");
  }
  const WeightsFile weights = WeightsFile::open(src, storage);
  if (weights.tensors().empty()) throw FormatError(src + ": nothing to import: no tensors");
  if (storage->exists(step_dir)) {
    throw IoError(step_dir + ": exists; import-hf writes a new checkpoint directory");
  }
  HfImportStats stats;
  CheckpointMeta out;
  out.world_size = 1;
  out.layout = "imported from Hugging Face";
  out.created_unix_s = static_cast<int64_t>(std::time(nullptr));
  out.info["imported_from"] = "huggingface";
  out.info["source"] = src;
  const std::string config_path = join_path(src, "config.json");
  if (storage->exists(config_path)) {
    std::string text(storage->file_size(config_path), '\0');
    storage->read_at(config_path, 0, text.data(), text.size());
    out.info["hf_config"] = text;
  }
  storage->make_dirs_durable(step_dir);
  const std::string data_file = "rank_0.data";
  try {
    thread_pool::ThreadPool pool(static_cast<size_t>(std::max(1, options.io_threads)));
    std::unique_ptr<WritableFile> file = storage->create_file(join_path(step_dir, data_file));
    ChunkWriter::Options wo;
    wo.max_batches_in_flight = 2 * pool.num_threads();
    ChunkWriter writer(*file, &pool, wo);
    std::vector<std::pair<size_t, Box>> chunk_of;  // per chunk added: (item, box)
    for (const WeightsTensorInfo& t : weights.tensors()) {
      const DType to = is_float(t.dtype) ? DType::kFloat32 : t.dtype;
      if (to != t.dtype) stats.converted.push_back(t.name);
      ItemMeta item;
      item.name = "model." + t.name;
      item.dtype = to;
      item.global_shape = t.shape;
      out.items.push_back(std::move(item));
      const size_t index = out.items.size() - 1;
      const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
      const uint64_t numel = static_cast<uint64_t>(full_box(t.shape).numel());
      const uint64_t row_bytes = rows == 0 ? 0 : numel / static_cast<uint64_t>(rows) * element_size(to);
      const int64_t per = static_cast<int64_t>(std::max<uint64_t>(
          1, row_bytes == 0 ? 1 : std::min<uint64_t>(static_cast<uint64_t>(rows), options.slab_bytes / row_bytes)));
      std::vector<uint8_t> raw;
      for (int64_t r0 = 0; r0 < std::max<int64_t>(rows, 1); r0 += per) {
        Box slab = full_box(t.shape);
        if (slab.ndim() > 0) {
          slab.offsets[0] = r0;
          slab.sizes[0] = std::min(per, rows - r0);
        }
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
        writer.add_chunk(buf->data(), buf->size(), element_size(to), {}, buf);
        chunk_of.emplace_back(index, slab);
        stats.bytes += buf->size();
        if (rows == 0) break;
      }
      ++stats.tensors;
    }
    {  // train.step 0: a model to start from
      auto buf = std::make_shared<std::vector<uint8_t>>(8, 0);
      ItemMeta item;
      item.name = "train.step";
      item.kind = ItemKind::kBytes;
      item.dtype = DType::kUInt8;
      item.global_shape = {8};
      out.items.push_back(std::move(item));
      writer.add_chunk(buf->data(), 8, 1, {}, buf);
      chunk_of.emplace_back(out.items.size() - 1, full_box({8}));
    }
    out.step = 0;
    std::vector<ChunkMeta> chunks = writer.finish();
    file->sync();
    file->close();
    for (size_t k = 0; k < chunks.size(); ++k) {
      chunks[k].box = chunk_of[k].second;
      chunks[k].file = data_file;
      chunks[k].writer_rank = 0;
      out.items[chunk_of[k].first].chunks.push_back(std::move(chunks[k]));
    }
    storage->sync_dir(step_dir);
    storage->write_file_atomic(join_path(step_dir, kMetadataFileName), encode_metadata(out));
  } catch (...) {
    storage->remove_all(step_dir);
    throw;
  }
  return stats;
}

}  // namespace checkpoint
