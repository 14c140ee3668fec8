// A LoRA run's adapters (export.h): PEFT's adapter directory, and the
// Hugging Face directory of the base with them merged. Which tensors are
// adapters, and of which weight, the run adapter says
// (RunAdapter::lora_tensor): checkpoint/ knows no model's names.
#include "checkpoint/interop/export_internal.h"

#include <nlohmann/json.hpp>
#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>

#include "checkpoint/interop/hf.h"
#include "checkpoint/plan/resharding.h"

namespace checkpoint::export_detail {

namespace {

// The trainer's model items are model.<parameter> (state_dict.h).
constexpr const char* kModelPrefix = "model.";
constexpr size_t kModelPrefixSize = 6;

// A checkpoint item that is one of the run's LoRA adapter tensors, with
// what the run adapter says of it.
struct LoraItem {
  const ItemMeta* item = nullptr;
  LoraTensor tensor;
};

// The checkpoint's adapter items: model.<parameter> where the run adapter
// names <parameter> an adapter tensor. None without a run adapter.
std::vector<LoraItem> lora_items(const CheckpointMeta& meta, const ExportOptions& options) {
  std::vector<LoraItem> out;
  if (!options.run) return out;
  for (const ItemMeta& item : meta.items) {
    if (item.kind != ItemKind::kTensor || item.name.rfind(kModelPrefix, 0) != 0) continue;
    if (auto tensor = options.run->lora_tensor(item.name.substr(kModelPrefixSize))) out.push_back({&item, *tensor});
  }
  return out;
}

// The base to merge into or to name: options.base or the recorded one,
// its content hash checked against the recorded one.
std::string checked_lora_base(const std::shared_ptr<Storage>& storage, const LoraInfo& lora,
                              const std::string& step_dir, const ExportOptions& options) {
  const std::string base = options.base.empty() ? lora.base_path : options.base;
  if (base.empty()) {
    throw FormatError(step_dir + ": its LoRA base was initialised at random (the run had no model.init_from), "
                      "so there are no base weights to merge into");
  }
  if (!storage->exists(base)) {
    throw std::invalid_argument(step_dir + ": its LoRA base " + base + " is not there" +
                      (options.base.empty() ? "; give --base DIR, a copy of it" : ""));
  }
  const std::string hash = weights_content_hash(base, storage);
  if (hash != lora.base_hash) {
    throw std::invalid_argument("the LoRA base " + base + " has weights " + hash + ", not those of the base " +
                      lora.base_path + " (" + lora.base_hash + ") that " + step_dir + " was trained on");
  }
  return base;
}

// A float tensor item, whole, as doubles.
std::vector<double> read_reals(ChunkReader& reader, const ItemMeta& item, const std::string& step_dir) {
  if (!is_floating_dtype(item.dtype) || item.global_shape.size() != 2) {
    throw FormatError(step_dir + ": item " + item.name + " is not a 2-d floating-point tensor");
  }
  const uint64_t n = *checked_numel(item.global_shape);
  const size_t esize = element_size(item.dtype);
  std::vector<uint8_t> raw(n * esize);
  for (const ReadRequest& req : plan_reads(item, full_box(item.global_shape))) reader.read_into(item, req, raw.data());
  std::vector<double> out(n);
  for (uint64_t i = 0; i < n; ++i) out[i] = load_real(item.dtype, raw.data() + i * esize);
  return out;
}

// One projection's adapter: B [out, rank] and A [rank, in], whole.
struct Adapter {
  std::vector<double> a, b;
  int64_t rank = 0, in = 0, out = 0;
};
using Adapters = std::map<std::string, Adapter>;  // by the base tensor they change

// The checkpoint's adapters, read whole, each checked against the base
// tensor it changes ([out, in], floating point).
Adapters read_adapters(const CheckpointMeta& meta, ChunkReader& reader, const WeightsFile& weights,
                       const std::string& base, const std::string& step_dir, const ExportOptions& options) {
  Adapters adapters;
  for (const LoraItem& l : lora_items(meta, options)) {
    Adapter& ad = adapters[l.tensor.target];
    (l.tensor.is_a ? ad.a : ad.b) = read_reals(reader, *l.item, step_dir);
    if (l.tensor.is_a) {
      ad.rank = l.item->global_shape[0];
      ad.in = l.item->global_shape[1];
    } else {
      ad.out = l.item->global_shape[0];
    }
  }
  for (const auto& [target, ad] : adapters) {
    const WeightsTensorInfo* t = weights.find(target);
    if (t == nullptr || ad.a.empty() || ad.b.empty() || t->shape.size() != 2 || t->shape[0] != ad.out ||
        t->shape[1] != ad.in || !is_floating_dtype(t->dtype)) {
      throw FormatError(step_dir + ": the adapter of " + target + " has no matching " +
                        (t == nullptr ? "tensor" : "[out, in] float tensor") + " in the base " + base);
    }
  }
  return adapters;
}

// Rows [first, first + rows) of W + scale x B A, W's rows being `raw` (in
// `dtype`), as float32.
std::vector<float> merged_rows(const Adapter& ad, double scale, DType dtype, const uint8_t* raw, int64_t first,
                               int64_t rows) {
  const size_t esize = element_size(dtype);
  std::vector<float> merged(static_cast<size_t>(rows * ad.in));
  std::vector<double> row(static_cast<size_t>(ad.in), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = first + r;
    std::fill(row.begin(), row.end(), 0.0);
    for (int64_t k = 0; k < ad.rank; ++k) {
      const double b = ad.b[static_cast<size_t>(i * ad.rank + k)];
      const double* a = ad.a.data() + k * ad.in;
      for (int64_t c = 0; c < ad.in; ++c) row[static_cast<size_t>(c)] += b * a[c];
    }
    for (int64_t c = 0; c < ad.in; ++c) {
      const uint64_t at = static_cast<uint64_t>(r * ad.in + c);
      merged[at] = static_cast<float>(load_real(dtype, raw + at * esize) + scale * row[static_cast<size_t>(c)]);
    }
  }
  return merged;
}

// Every tensor of the base, by name, in the export's dtype (floats:
// options.dtype or float32).
std::vector<ExportItem> base_items(const std::vector<ItemMeta>& metas, const ExportOptions& options) {
  std::vector<ExportItem> items;
  for (const ItemMeta& m : metas) {
    ExportItem e;
    e.item = &m;
    e.name = m.name;
    e.dtype = is_floating_dtype(m.dtype) ? options.dtype.value_or(DType::kFloat32) : m.dtype;
    e.nbytes = *checked_numel(m.global_shape) * element_size(e.dtype);
    items.push_back(std::move(e));
  }
  std::sort(items.begin(), items.end(), [](const ExportItem& a, const ExportItem& b) { return a.name < b.name; });
  return items;
}

}  // namespace

// The run's LoRA adapters, or nullopt when it trained none.
std::optional<LoraInfo> lora_of(const CheckpointMeta& meta, ChunkReader& reader, const std::string& step_dir,
                                const ExportOptions& options) {
  if (!options.run) return std::nullopt;
  return options.run->lora(bytes_item_reader(meta, reader), step_dir);
}

ExportStats export_hf_merged(const std::string& step_dir, const std::string& out_dir, const ExportOptions& options,
                             const std::shared_ptr<Storage>& storage, const CheckpointMeta& meta,
                             ChunkReader& reader, const LoraInfo& lora) {
  const std::string base = checked_lora_base(storage, lora, step_dir, options);
  const WeightsFile weights = WeightsFile::open(base, storage);
  const double scale = lora.alpha / static_cast<double>(lora.rank);
  const Adapters adapters = read_adapters(meta, reader, weights, base, step_dir, options);
  std::vector<ItemMeta> metas;
  metas.reserve(weights.tensors().size());
  for (const WeightsTensorInfo& t : weights.tensors()) {
    ItemMeta m;
    m.name = t.name;
    m.dtype = t.dtype;
    m.global_shape = t.shape;
    metas.push_back(std::move(m));
  }
  ExportStats stats;
  std::vector<ExportItem> items = base_items(metas, options);
  const std::string config = hf_config_json(meta, reader, step_dir, items, options);
  // A base of our names (a safetensors file of ours) is written under
  // Hugging Face's; a Hugging Face base has them already.
  items = renamed_items(items, hf_renames(config, step_dir, options), step_dir);
  stats.tokenizer = export_tokenizer(*storage, meta, reader, step_dir, options, stats);
  const uint64_t slab_bytes = std::max<uint64_t>(options.slab_bytes, 1);
  // Each base tensor by slabs of rows; an adapted one as W + scale x B A.
  const ItemSource source = [&](const ExportItem& e, const Sink& sink) {
    const ItemMeta& m = *e.item;
    if (*checked_numel(e.shape()) == 0) return;
    const size_t esize = element_size(m.dtype);
    auto it = adapters.find(m.name);
    if (it != adapters.end() && e.row >= 0) {
      throw FormatError(step_dir + ": " + m.name + " has an adapter but is written split, as " + e.name);
    }
    std::vector<uint8_t> raw, out;
    for (const Box& slab : item_slabs(e, std::max<size_t>(esize, 8), slab_bytes)) {
      const uint64_t n = static_cast<uint64_t>(slab.numel());
      raw.resize(n * esize);
      weights.read_box(m.name, slab, raw.data());
      if (it == adapters.end() && e.dtype == m.dtype) {
        sink(raw.data(), raw.size());
        continue;
      }
      out.resize(n * element_size(e.dtype));
      if (it == adapters.end()) {
        convert_float_elements(m.dtype, e.dtype, raw.data(), n, out.data());
      } else {
        const std::vector<float> merged = merged_rows(it->second, scale, m.dtype, raw.data(), slab.offsets[0],
                                                      slab.sizes[0]);
        convert_float_elements(DType::kFloat32, e.dtype, reinterpret_cast<const uint8_t*>(merged.data()), n,
                               out.data());
      }
      sink(out.data(), out.size());
    }
  };
  write_hf_dir(*storage, out_dir, items, meta, config, source, options, stats);
  stats.skipped.clear();
  return stats;
}

// PEFT's adapter directory (export.h).
ExportStats export_peft(const std::string& step_dir, const std::string& out_dir, const ExportOptions& options) {
  std::shared_ptr<Storage> storage = options.storage ? options.storage : posix_storage();
  const CheckpointMeta meta = read_committed_metadata(*storage, step_dir);
  thread_pool::ThreadPool pool(static_cast<size_t>(std::max(1, options.io_threads)));
  ChunkReader reader(storage, step_dir, &pool);
  const std::optional<LoraInfo> lora = lora_of(meta, reader, step_dir, options);
  const std::vector<LoraItem> adapters = lora_items(meta, options);
  if (!lora || adapters.empty()) {
    throw std::invalid_argument(step_dir + ": no LoRA adapters to export (the run had no model.lora.rank)");
  }
  ExportStats stats;
  std::vector<ExportItem> items;
  for (const LoraItem& l : adapters) {
    const ItemMeta* item = l.item;
    ExportItem e;
    e.item = item;
    e.name = "base_model.model." + item->name.substr(kModelPrefixSize);
    e.dtype = options.dtype && is_floating_dtype(item->dtype) ? *options.dtype : item->dtype;
    e.nbytes = *checked_numel(item->global_shape) * element_size(e.dtype);
    items.push_back(std::move(e));
  }
  std::sort(items.begin(), items.end(), [](const ExportItem& a, const ExportItem& b) { return a.name < b.name; });
  for (const ItemMeta& item : meta.items) {
    const bool adapter = std::any_of(adapters.begin(), adapters.end(), [&](const LoraItem& l) { return l.item == &item; });
    if (!adapter) stats.skipped.push_back(item.name);
  }
  nlohmann::ordered_json config = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", options.base.empty() ? lora->base_path : options.base},
      {"r", lora->rank},
      {"lora_alpha", lora->alpha},
      {"lora_dropout", lora->dropout},
      {"target_modules", lora->targets},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"use_rslora", false},
      {"use_dora", false},
      {"revision", nullptr},
  };
  const std::string text = config.dump(2) + "\n";
  write_dir_atomically(*storage, out_dir, [&](const std::string& tmp) {
    const std::string file_name = "adapter_model.safetensors";
    std::unique_ptr<WritableFile> file = storage->create_file(join_path(tmp, file_name));
    SafetensorsWriter writer(*file, items, meta);
    for (size_t i = 0; i < items.size(); ++i) {
      writer.begin_tensor(i);
      stream_item(reader, items[i], std::max<uint64_t>(options.slab_bytes, 1),
                  [&](const uint8_t* data, size_t n) { writer.write(data, n); });
      writer.end_tensor();
      stats.data_bytes += items[i].nbytes;
      ++stats.tensors;
    }
    file->sync();
    file->close();
    stats.file_bytes = storage->file_size(join_path(tmp, file_name));
    storage->write_file_atomic(join_path(tmp, "adapter_config.json"), std::vector<uint8_t>(text.begin(), text.end()));
    storage->sync_dir(tmp);
  });
  return stats;
}

}  // namespace checkpoint::export_detail
