// A Hugging Face directory (export.h): safetensors shards (with their
// index past one), config.json and the tokenizer's files.
#include "checkpoint/interop/export_internal.h"

#include <nlohmann/json.hpp>
#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>

#include "checkpoint/interop/hf.h"

#include <cstdio>

namespace checkpoint::export_detail {

const char* torch_dtype_name(DType d) {
  return d == DType::kBFloat16 ? "bfloat16" : d == DType::kFloat16 ? "float16" : "float32";
}

// config.json of the checkpoint's model: from the run's settings, else the
// one import_hf_checkpoint recorded.
std::string hf_config_json(const CheckpointMeta& meta, ChunkReader& reader, const std::string& step_dir,
                           const std::vector<ExportItem>& items, const ExportOptions& options) {
  const std::string dtype = torch_dtype_name(options.dtype ? *options.dtype : items.front().dtype);
  if (options.run) {
    if (auto json = options.run->hf_config_json(bytes_item_reader(meta, reader), step_dir, dtype)) return *json;
  }
  auto it = meta.info.find("hf_config");
  if (it == meta.info.end()) {
    throw FormatError(step_dir + ": no run settings (saved by train) and no recorded Hugging Face "
                      "config.json (ckpt import-hf): the model's options are unknown");
  }
  nlohmann::json j = nlohmann::json::parse(it->second);
  j["torch_dtype"] = dtype;
  return j.dump(2) + "\n";
}

std::vector<RenamedTensor> hf_renames(const std::string& config, const std::string& step_dir,
                                      const ExportOptions& options) {
  return options.run ? options.run->hf_renames(config, step_dir) : std::vector<RenamedTensor>{};
}

bool regular_file(Storage& storage, const std::string& path) {
  return storage.stat(path).type == FileType::kFile;
}

std::vector<uint8_t> read_whole(Storage& storage, const std::string& path) {
  return storage.read_file(path, storage.file_size(path));
}

// The tokenizer an HF export ships: options.tokenizer, else the run's
// (recorded in `stats` when named but gone).
std::string export_tokenizer(Storage& storage, const CheckpointMeta& meta, ChunkReader& reader,
                             const std::string& step_dir, const ExportOptions& options,
                             ExportStats& stats) {
  if (options.tokenizer == "none") return "";
  if (!options.tokenizer.empty()) {
    if (!regular_file(storage, options.tokenizer)) {
      throw std::invalid_argument("--tokenizer " + options.tokenizer + ": no such tokenizer file");
    }
    return options.tokenizer;
  }
  if (!options.run) return "";
  const std::string named = options.run->tokenizer(bytes_item_reader(meta, reader), step_dir);
  if (named.empty()) return "";
  if (!regular_file(storage, named)) {
    stats.tokenizer_missing = named;
    return "";
  }
  return named;
}

// Writes the tokenizer's files into `dir`: tokenizer.json or tokenizer.model,
// and tokenizer_config.json (the one beside the source, else a minimal one).
void write_tokenizer_files(Storage& storage, const std::string& source, const std::string& dir) {
  const bool json = source.size() >= 5 && source.compare(source.size() - 5, 5, ".json") == 0;
  storage.write_file_atomic(join_path(dir, json ? "tokenizer.json" : "tokenizer.model"), read_whole(storage, source));
  const std::string beside = source.substr(0, source.find_last_of('/') + 1) + "tokenizer_config.json";
  if (regular_file(storage, beside)) {
    storage.write_file_atomic(join_path(dir, "tokenizer_config.json"), read_whole(storage, beside));
  } else {
    const std::string text =
        nlohmann::json{{"tokenizer_class", json ? "PreTrainedTokenizerFast" : "LlamaTokenizer"}}.dump(2) + "\n";
    storage.write_file_atomic(join_path(dir, "tokenizer_config.json"), std::vector<uint8_t>(text.begin(), text.end()));
  }
}

// Safetensors shards: consecutive items while they fit max_shard_bytes (a
// larger item gets a shard of its own).
std::vector<std::vector<ExportItem>> hf_shards(const std::vector<ExportItem>& items, uint64_t max_shard_bytes) {
  std::vector<std::vector<ExportItem>> shards;
  uint64_t in_shard = 0;
  for (const ExportItem& e : items) {
    if (shards.empty() || (in_shard > 0 && in_shard + e.nbytes > max_shard_bytes)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(e);
    in_shard += e.nbytes;
  }
  return shards;
}

// Writes the Hugging Face directory `out_dir`: `items` in safetensors
// shards, config.json and the tokenizer's files.
void write_hf_dir(Storage& storage, const std::string& out_dir, const std::vector<ExportItem>& items,
                  const CheckpointMeta& meta, const std::string& config, const ItemSource& source,
                  const ExportOptions& options, ExportStats& stats) {
  const std::vector<std::vector<ExportItem>> shards = hf_shards(items, options.max_shard_bytes);
  write_dir_atomically(storage, out_dir, [&](const std::string& tmp) {
    nlohmann::json weight_map = nlohmann::json::object();
    uint64_t total = 0;
    for (size_t k = 0; k < shards.size(); ++k) {
      char name[64];
      std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
      const std::string file_name = shards.size() == 1 ? kHfSingleName : name;
      std::unique_ptr<WritableFile> file = storage.create_file(join_path(tmp, file_name));
      SafetensorsWriter writer(*file, shards[k], meta);
      for (size_t i = 0; i < shards[k].size(); ++i) {
        writer.begin_tensor(i);
        source(shards[k][i], [&](const uint8_t* data, size_t n) { writer.write(data, n); });
        writer.end_tensor();
        weight_map[shards[k][i].name] = file_name;
        total += shards[k][i].nbytes;
        ++stats.tensors;
      }
      file->sync();
      file->close();
      stats.file_bytes += storage.file_size(join_path(tmp, file_name));
    }
    stats.data_bytes = total;
    if (shards.size() > 1) {
      nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
      const std::string text = index.dump(2) + "\n";
      storage.write_file_atomic(join_path(tmp, kHfIndexName), std::vector<uint8_t>(text.begin(), text.end()));
    }
    storage.write_file_atomic(join_path(tmp, "config.json"), std::vector<uint8_t>(config.begin(), config.end()));
    if (!stats.tokenizer.empty()) write_tokenizer_files(storage, stats.tokenizer, tmp);
    storage.sync_dir(tmp);
  });
}

ExportStats export_hf(const std::string& step_dir, const std::string& out_dir, const ExportOptions& options) {
  if (!options.only.empty() && options.only != "model") {
    throw std::invalid_argument("a Hugging Face export takes the model: --only model or nothing, not --only " +
                                options.only);
  }
  std::shared_ptr<Storage> storage = options.storage ? options.storage : posix_storage();
  const CheckpointMeta meta = read_committed_metadata(*storage, step_dir);
  thread_pool::ThreadPool pool(static_cast<size_t>(std::max(1, options.io_threads)));
  ChunkReader reader(storage, step_dir, &pool);
  const std::optional<LoraInfo> lora = lora_of(meta, reader, step_dir, options);
  if (lora && options.merge_lora) return export_hf_merged(step_dir, out_dir, options, storage, meta, reader, *lora);
  if (options.merge_lora) {
    throw std::invalid_argument(step_dir + ": --merge-lora: the run trained no LoRA adapters (no model.lora.rank)");
  }
  if (lora) {
    throw std::invalid_argument(step_dir + " holds LoRA adapters, not the base model: give --merge-lora for the base with "
                      "the adapters merged, or --format peft for the adapters");
  }
  ExportOptions model_only = options;
  model_only.only = "model";
  ExportStats stats;
  std::vector<ExportItem> items = select_items(meta, step_dir, model_only, stats);
  const std::string config = hf_config_json(meta, reader, step_dir, items, options);
  items = renamed_items(items, hf_renames(config, step_dir, options), step_dir);
  stats.tokenizer = export_tokenizer(*storage, meta, reader, step_dir, options, stats);
  const uint64_t slab_bytes = std::max<uint64_t>(options.slab_bytes, 1);
  write_hf_dir(*storage, out_dir, items, meta, config,
               [&](const ExportItem& e, const Sink& sink) { stream_item(reader, e, slab_bytes, sink); }, options,
               stats);
  return stats;
}

}  // namespace checkpoint::export_detail
