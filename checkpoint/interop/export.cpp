#include "checkpoint/interop/export.h"

#include <nlohmann/json.hpp>
#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/plan/resharding.h"
#include "checkpoint/interop/dcp.h"
#include "checkpoint/interop/hf.h"
#include "checkpoint/interop/pickle.h"
#include "checkpoint/interop/streaming.h"
#include "checkpoint/interop/weights_file.h"
#include "checkpoint/interop/zip_archive.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the exporter converts elements in place and assumes a little-endian host");

namespace checkpoint {

namespace {

// torch.save's archive layout, whatever the file is called.
constexpr const char* kArchiveName = "archive";

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One tensor item to write.
struct ExportItem {
  const ItemMeta* item = nullptr;
  std::string name;     // in the output
  DType dtype;          // in the output
  uint64_t nbytes = 0;  // in the output
};

using Sink = std::function<void(const uint8_t*, size_t)>;

// Feeds the row-major bytes of `e` (converted to e.dtype) to `sink`, one slab
// of dim-0 rows at a time (see export.h).
void stream_item(ChunkReader& reader, const ExportItem& e, uint64_t slab_bytes, const Sink& sink) {
  const ItemMeta& item = *e.item;
  const uint64_t numel = *checked_numel(item.global_shape);
  if (numel == 0) return;
  const size_t esize = element_size(item.dtype);
  const int64_t rows = item.global_shape.empty() ? 1 : item.global_shape[0];
  const uint64_t row_elems = numel / static_cast<uint64_t>(rows);
  const Box full = full_box(item.global_shape);
  const int64_t per_slab = rows_per_slab(full, esize, slab_bytes);
  std::vector<uint8_t> buf(static_cast<uint64_t>(per_slab) * row_elems * esize);
  std::vector<uint8_t> converted;
  if (e.dtype != item.dtype) converted.resize(buf.size() / esize * element_size(e.dtype));

  for (const Box& slab : dim0_slabs(full, per_slab)) {
    const uint64_t n = static_cast<uint64_t>(slab.numel());
    for (const ReadRequest& req : plan_reads(item, slab)) reader.read_into(item, req, buf.data());
    if (e.dtype == item.dtype) {
      sink(buf.data(), n * esize);
    } else {
      convert_float_elements(item.dtype, e.dtype, buf.data(), n, converted.data());
      sink(converted.data(), n * element_size(e.dtype));
    }
  }
}

// Where the bytes go: one implementation per format.
class ExportWriter {
 public:
  virtual ~ExportWriter() = default;
  virtual void begin_tensor(size_t index) = 0;
  virtual void write(const uint8_t* data, size_t n) = 0;
  virtual void end_tensor() = 0;
  virtual void finish() = 0;
};

// The header (encode_safetensors_header), then every tensor's bytes in the
// order of `items`.
class SafetensorsWriter : public ExportWriter {
 public:
  SafetensorsWriter(WritableFile& file, const std::vector<ExportItem>& items,
                    const CheckpointMeta& meta)
      : file_(file) {
    std::vector<SafetensorsTensor> tensors;
    for (const ExportItem& e : items) tensors.push_back({e.name, e.dtype, e.item->global_shape});
    const std::vector<uint8_t> header =
        encode_safetensors_header(tensors, {{"format", "pt"}, {"step", std::to_string(meta.step)}});
    file_.append(header.data(), header.size());
  }
  void begin_tensor(size_t) override {}
  void write(const uint8_t* data, size_t n) override { file_.append(data, n); }
  void end_tensor() override {}
  void finish() override {}

 private:
  WritableFile& file_;
};

// archive/data.pkl (written first, from the metadata alone), then one stored
// member archive/data/<i> per tensor, then archive/version and
// archive/byteorder, as torch.save lays them out.
class TorchZipWriter : public ExportWriter {
 public:
  TorchZipWriter(WritableFile& file, const std::vector<ExportItem>& items) : zip_(file), items_(items) {
    std::vector<PickledTensor> tensors;
    for (size_t i = 0; i < items.size(); ++i) {
      PickledTensor t;
      t.name = items[i].name;
      t.dtype = items[i].dtype;
      t.shape = items[i].item->global_shape;
      t.storage_key = std::to_string(i);
      t.storage_numel = items[i].nbytes / element_size(items[i].dtype);
      tensors.push_back(std::move(t));
    }
    put_member("data.pkl", write_tensor_dict_pickle(tensors));
  }
  void begin_tensor(size_t index) override {
    zip_.begin_member(std::string(kArchiveName) + "/data/" + std::to_string(index), items_[index].nbytes);
  }
  void write(const uint8_t* data, size_t n) override { zip_.write(data, n); }
  void end_tensor() override { zip_.end_member(); }
  void finish() override {
    put_member("version", {'3', '\n'});
    put_member("byteorder", {'l', 'i', 't', 't', 'l', 'e'});
    zip_.finish();
  }

 private:
  void put_member(const std::string& name, const std::vector<uint8_t>& bytes) {
    zip_.begin_member(std::string(kArchiveName) + "/" + name, bytes.size());
    zip_.write(bytes.data(), bytes.size());
    zip_.end_member();
  }
  ZipWriter zip_;
  const std::vector<ExportItem>& items_;
};

std::vector<ExportItem> select_items(const CheckpointMeta& meta, const std::string& step_dir,
                                     const ExportOptions& options, ExportStats& stats) {
  const std::string prefix = options.only.empty() ? "" : options.only + ".";
  std::vector<ExportItem> items;
  for (const ItemMeta& item : meta.items) {
    if (item.kind != ItemKind::kTensor || item.name.compare(0, prefix.size(), prefix) != 0 ||
        item.name.size() == prefix.size()) {
      stats.skipped.push_back(item.name);
      continue;
    }
    ExportItem e;
    e.item = &item;
    e.name = item.name.substr(prefix.size());
    e.dtype = options.dtype && is_floating_dtype(item.dtype) ? *options.dtype : item.dtype;
    e.nbytes = *checked_numel(item.global_shape) * element_size(e.dtype);
    try {
      (void)nlohmann::json(e.name).dump();
    } catch (const nlohmann::json::exception&) {
      throw FormatError(step_dir + ": item name is not valid UTF-8, which both formats require: " +
                        nlohmann::json(item.name).dump(-1, ' ', true, nlohmann::json::error_handler_t::replace));
    }
    if (options.format == ExportFormat::kSafetensors && e.name == "__metadata__") {
      throw FormatError(step_dir + ": item '" + item.name + "' would be named __metadata__, "
                        "which safetensors reserves");
    }
    items.push_back(std::move(e));
  }
  if (items.empty()) {
    throw FormatError(step_dir + ": nothing to export: no tensor items" +
                      (prefix.empty() ? std::string() : " named " + prefix + "*"));
  }
  std::sort(items.begin(), items.end(),
            [](const ExportItem& a, const ExportItem& b) { return a.name < b.name; });
  return items;
}

// ------------------------------------------------------------------ DCP

// Appends to `file` at its current end while a ZipWriter sees offsets from
// 0: each DCP item is a torch.save archive of its own inside one data file.
class ArchiveAppender : public WritableFile {
 public:
  ArchiveAppender(WritableFile& file, uint64_t base) : file_(file), base_(base) {}
  void append(const void* data, size_t n) override {
    file_.append(data, n);
    size_ += n;
  }
  void write_at(uint64_t offset, const void* data, size_t n) override {
    file_.write_at(base_ + offset, data, n);
  }
  void sync() override {}
  void close() override {}
  uint64_t size() const { return size_; }

 private:
  WritableFile& file_;
  uint64_t base_;
  uint64_t size_ = 0;
};

// torch.save(obj) for an object whose protocol-2 pickle is `pkl` and whose
// tensor storage (if any) is `data` under key "0": data.pkl, byteorder,
// data/0, version. Returns the archive's length.
uint64_t append_archive(WritableFile& file, uint64_t at, const std::vector<uint8_t>& pkl,
                        bool has_storage, const uint8_t* data, uint64_t n) {
  ArchiveAppender out(file, at);
  ZipWriter zip(out);
  auto member = [&](const std::string& name, const void* bytes, uint64_t size) {
    zip.begin_member(std::string(kArchiveName) + "/" + name, size);
    zip.write(bytes, static_cast<size_t>(size));
    zip.end_member();
  };
  member("data.pkl", pkl.data(), pkl.size());
  member("byteorder", "little", 6);
  static const uint8_t kNothing = 0;
  if (has_storage) member("data/0", n == 0 ? &kNothing : data, n);
  member("version", "3\n", 2);
  zip.finish();
  return out.size();
}

// The bytes of a bytes item, or nullopt when there is none.
std::optional<std::string> read_bytes_item(const CheckpointMeta& meta, ChunkReader& reader,
                                           const std::string& name) {
  const ItemMeta* item = meta.find(name);
  if (item == nullptr || item->kind != ItemKind::kBytes) return std::nullopt;
  std::vector<uint8_t> bytes(static_cast<size_t>(*checked_numel(item->global_shape)));
  for (const ReadRequest& req : plan_reads(*item, full_box(item->global_shape))) {
    reader.read_into(*item, req, bytes.data());
  }
  return std::string(bytes.begin(), bytes.end());
}

// The run adapter's view of the checkpoint's bytes items.
RunAdapter::ReadBytesItem bytes_item_reader(const CheckpointMeta& meta, ChunkReader& reader) {
  return [&meta, &reader](const std::string& name) { return read_bytes_item(meta, reader, name); };
}

// Writes a directory `out_dir` through <out_dir>.tmp: `fill` writes into
// the temporary directory, which then replaces `out_dir`; a failure removes
// it.
void write_dir_atomically(Storage& storage, const std::string& out_dir,
                          const std::function<void(const std::string& tmp)>& fill) {
  const std::string tmp = out_dir + ".tmp";
  storage.remove_all(tmp);
  storage.make_dirs(tmp);
  try {
    fill(tmp);
  } catch (...) {
    storage.remove_all(tmp);
    throw;
  }
  storage.remove_all(out_dir);
  storage.rename(tmp, out_dir);
  storage.sync_dir(parent_dir(out_dir));
}

constexpr const char* kDcpDataName = "__0_0.distcp";

// A DCP export in progress: the data file of torch.save archives, and the
// metadata that lists them.
struct DcpOut {
  WritableFile& file;
  uint64_t at = 0;  // where the next archive goes
  DcpMetadata dcp;
  std::vector<std::string> params;  // model parameter names, in checkpoint order

  // Appends torch.save(obj) of pickle `pkl` (and storage `data`) and says where it went.
  DcpLocation append(const std::vector<uint8_t>& pkl, bool has_storage, const uint8_t* data, uint64_t n) {
    const uint64_t length = append_archive(file, at, pkl, has_storage, data, n);
    const DcpLocation loc{kDcpDataName, at, length};
    at += length;
    return loc;
  }
  DcpLocation append_tensor(DType dtype, const std::vector<int64_t>& shape, const uint8_t* data, uint64_t n) {
    PickledTensor t;
    t.dtype = dtype;
    t.shape = shape;
    t.storage_key = "0";
    t.storage_numel = n / element_size(dtype);
    return append(write_tensor_pickle(t), true, data, n);
  }
};

bool ends_with(const std::string& s, const std::string& e) {
  return s.size() >= e.size() && s.compare(s.size() - e.size(), e.size(), e) == 0;
}

// shardkit's 8-byte optim.<fqn>.step -> AdamW's 0-d float32 step tensor.
void export_dcp_step(DcpOut& out, ChunkReader& reader, const ItemMeta& item, ExportStats& stats) {
  std::vector<uint8_t> raw(8);
  for (const ReadRequest& req : plan_reads(item, full_box(item.global_shape))) {
    reader.read_into(item, req, raw.data());
  }
  const float step = static_cast<float>(static_cast<int64_t>(load_le(raw.data(), 8)));
  uint8_t bytes[4];
  std::memcpy(bytes, &step, 4);
  DcpTensorItem t;
  t.fqn = "optim.state." + item.name.substr(6);
  t.dtype = DType::kFloat32;
  t.chunks.push_back({Box{}, out.append_tensor(DType::kFloat32, {}, bytes, 4)});
  out.dcp.tensors.push_back(std::move(t));
  ++stats.tensors;
  stats.data_bytes += 4;
}

// Tensor `item` as DCP key `key`: one chunk per dim-0 slab of at most slab_bytes.
void export_dcp_tensor(DcpOut& out, ChunkReader& reader, const ItemMeta& item, const std::string& key,
                       uint64_t slab_bytes, ExportStats& stats) {
  DcpTensorItem t;
  t.fqn = key;
  t.dtype = item.dtype;
  t.shape = item.global_shape;
  const Box full = full_box(item.global_shape);
  const size_t esize = element_size(item.dtype);
  const int64_t rows = item.global_shape.empty() ? 1 : item.global_shape[0];
  // An empty tensor with rows is one chunk.
  const int64_t per_slab = *checked_numel(item.global_shape) == 0 ? std::max<int64_t>(rows, 1)
                                                                  : rows_per_slab(full, esize, slab_bytes);
  std::vector<uint8_t> buf;
  for (const Box& slab : dim0_slabs(full, per_slab)) {
    buf.assign(static_cast<size_t>(slab.numel()) * esize, 0);
    if (!slab.is_empty()) {
      for (const ReadRequest& req : plan_reads(item, slab)) reader.read_into(item, req, buf.data());
    }
    t.chunks.push_back({slab, out.append_tensor(item.dtype, slab.sizes, buf.data(), buf.size())});
    stats.data_bytes += buf.size();
  }
  out.dcp.tensors.push_back(std::move(t));
  ++stats.tensors;
}

// The checkpoint's items as DCP keys: model.<name>; with the optimizer,
// optim.state.<name>.exp_avg / exp_avg_sq and .step. The rest is skipped.
void export_dcp_items(DcpOut& out, ChunkReader& reader, const CheckpointMeta& meta, bool with_optim,
                      uint64_t slab_bytes, ExportStats& stats) {
  for (const ItemMeta& item : meta.items) {
    const bool tensor = item.kind == ItemKind::kTensor;
    const bool optim = with_optim && item.name.rfind("optim.", 0) == 0;
    if (tensor && item.name.rfind("model.", 0) == 0) {
      out.params.push_back(item.name.substr(6));
      export_dcp_tensor(out, reader, item, item.name, slab_bytes, stats);
    } else if (optim && tensor && (ends_with(item.name, ".exp_avg") || ends_with(item.name, ".exp_avg_sq"))) {
      export_dcp_tensor(out, reader, item, "optim.state." + item.name.substr(6), slab_bytes, stats);
    } else if (optim && item.kind == ItemKind::kBytes && ends_with(item.name, ".step")) {
      export_dcp_step(out, reader, item, stats);
    } else {
      stats.skipped.push_back(item.name);
    }
  }
}

// optim.param_groups.0.*: torch.save'd Python values, as AdamW keys them:
// torch 2.6's keys, plus decoupled_weight_decay (True), which AdamW's groups
// have from torch 2.7 on. dcp.load fails on a key the loading optimizer has
// and the checkpoint lacks ("Missing key in checkpoint state_dict"), and
// ignores one the checkpoint has and the optimizer lacks, so a checkpoint
// with both loads in either.
void export_param_group(DcpOut& out, const DcpParamGroup& g) {
  auto bytes_item = [&](const std::string& name, std::vector<uint8_t> pkl) {
    out.dcp.bytes.push_back({"optim.param_groups.0." + name, out.append(pkl, false, nullptr, 0)});
  };
  auto real = [](double v) {
    PickleWriter p;
    p.real(v);
    return p.finish();
  };
  auto flag = [](std::optional<bool> v) {
    PickleWriter p;
    if (v) p.boolean(*v); else p.none();
    return p.finish();
  };
  bytes_item("lr", real(g.lr));
  PickleWriter betas;
  betas.real(g.beta1);
  betas.real(g.beta2);
  betas.op(0x86);  // TUPLE2
  bytes_item("betas", betas.finish());
  bytes_item("eps", real(g.eps));
  bytes_item("weight_decay", real(g.weight_decay));
  bytes_item("amsgrad", flag(false));
  bytes_item("foreach", flag(std::nullopt));
  bytes_item("maximize", flag(false));
  bytes_item("capturable", flag(false));
  bytes_item("differentiable", flag(false));
  bytes_item("fused", flag(std::nullopt));
  bytes_item("decoupled_weight_decay", flag(true));
  PickleWriter names;
  names.op(']');
  names.op('(');
  for (const std::string& n : out.params) names.str(n);
  names.op('e');  // APPENDS
  bytes_item("params", names.finish());
}

ExportStats export_dcp(const std::string& step_dir, const std::string& out_dir,
                       const ExportOptions& options) {
  if (options.dtype) throw std::invalid_argument("--dtype does not apply to a DCP export");
  std::shared_ptr<Storage> storage = options.storage ? options.storage : posix_storage();
  const CheckpointMeta meta = read_committed_metadata(*storage, step_dir);
  const bool with_optim = options.only != "model";
  if (!options.only.empty() && options.only != "model") {
    throw std::invalid_argument("a DCP export takes --only model or nothing, not --only " + options.only);
  }
  ExportStats stats;
  thread_pool::ThreadPool pool(static_cast<size_t>(std::max(1, options.io_threads)));
  ChunkReader reader(storage, step_dir, &pool);
  write_dir_atomically(*storage, out_dir, [&](const std::string& tmp) {
    std::unique_ptr<WritableFile> file = storage->create_file(join_path(tmp, kDcpDataName));
    DcpOut out{*file, 0, {}, {}};
    export_dcp_items(out, reader, meta, with_optim, options.slab_bytes, stats);
    if (out.params.empty()) throw FormatError(step_dir + ": nothing to export: no model.* tensor items");
    if (with_optim) {
      DcpParamGroup g = options.dcp_param_group;
      if (options.run) g = options.run->optimizer_param_group(bytes_item_reader(meta, reader), step_dir, g);
      export_param_group(out, g);
    }
    file->sync();
    file->close();
    storage->write_file_atomic(join_path(tmp, ".metadata"), write_dcp_metadata(out.dcp));
  });
  stats.file_bytes = storage->file_size(join_path(out_dir, kDcpDataName));
  return stats;
}

// ------------------------------------------------------------------ Hugging Face

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

// How an HF export gets each item's bytes.
using ItemSource = std::function<void(const ExportItem&, const Sink&)>;

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

// ------------------------------------------------------------------ LoRA

bool is_lora_item(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

// The run's LoRA adapters, or nullopt when it trained none.
std::optional<LoraInfo> lora_of(const CheckpointMeta& meta, ChunkReader& reader, const std::string& step_dir,
                                const ExportOptions& options) {
  if (!options.run) return std::nullopt;
  return options.run->lora(bytes_item_reader(meta, reader), step_dir);
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

// The checkpoint's adapter items (model.<name>.lora_{A,B}.weight).
std::vector<const ItemMeta*> lora_items(const CheckpointMeta& meta) {
  std::vector<const ItemMeta*> out;
  for (const ItemMeta& item : meta.items) {
    if (item.kind == ItemKind::kTensor && item.name.rfind("model.", 0) == 0 && is_lora_item(item.name)) {
      out.push_back(&item);
    }
  }
  return out;
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

ExportStats export_hf_merged(const std::string& step_dir, const std::string& out_dir, const ExportOptions& options,
                             const std::shared_ptr<Storage>& storage, const CheckpointMeta& meta,
                             ChunkReader& reader, const LoraInfo& lora) {
  const std::string base = checked_lora_base(storage, lora, step_dir, options);
  const WeightsFile weights = WeightsFile::open(base, storage);
  const double scale = lora.alpha / static_cast<double>(lora.rank);
  // The adapters, by the base tensor they change ("<name>.weight").
  std::map<std::string, Adapter> adapters;
  for (const ItemMeta* item : lora_items(meta)) {
    const std::string name = item->name.substr(6);  // without "model."
    const bool is_a = name.find(".lora_A.") != std::string::npos;
    const size_t at = name.find(is_a ? ".lora_A." : ".lora_B.");
    const std::string target = name.substr(0, at) + name.substr(at + 7);  // ".lora_A.weight" -> ".weight"
    Adapter& ad = adapters[target];
    (is_a ? ad.a : ad.b) = read_reals(reader, *item, step_dir);
    if (is_a) {
      ad.rank = item->global_shape[0];
      ad.in = item->global_shape[1];
    } else {
      ad.out = item->global_shape[0];
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
  const std::string config = hf_config_json(meta, reader, step_dir, items, options);
  stats.tokenizer = export_tokenizer(*storage, meta, reader, step_dir, options, stats);
  const uint64_t slab_bytes = std::max<uint64_t>(options.slab_bytes, 1);
  const ItemSource source = [&](const ExportItem& e, const Sink& sink) {
    const ItemMeta& m = *e.item;
    if (*checked_numel(m.global_shape) == 0) return;
    const size_t esize = element_size(m.dtype);
    const Box full = full_box(m.global_shape);
    auto it = adapters.find(m.name);
    std::vector<uint8_t> raw, out;
    std::vector<double> row;
    for (const Box& slab : dim0_slabs(full, rows_per_slab(full, std::max<size_t>(esize, 8), slab_bytes))) {
      const uint64_t n = static_cast<uint64_t>(slab.numel());
      raw.resize(n * esize);
      weights.read_box(m.name, slab, raw.data());
      if (it == adapters.end()) {
        if (e.dtype == m.dtype) {
          sink(raw.data(), raw.size());
        } else {
          out.resize(n * element_size(e.dtype));
          convert_float_elements(m.dtype, e.dtype, raw.data(), n, out.data());
          sink(out.data(), out.size());
        }
        continue;
      }
      // W + scale * B A, row by row: each row of B times A.
      const Adapter& ad = it->second;
      const int64_t rows = slab.sizes[0];
      std::vector<float> merged(n);
      row.assign(static_cast<size_t>(ad.in), 0.0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = slab.offsets[0] + r;
        std::fill(row.begin(), row.end(), 0.0);
        for (int64_t k = 0; k < ad.rank; ++k) {
          const double b = ad.b[static_cast<size_t>(i * ad.rank + k)];
          const double* a = ad.a.data() + k * ad.in;
          for (int64_t c = 0; c < ad.in; ++c) row[static_cast<size_t>(c)] += b * a[c];
        }
        for (int64_t c = 0; c < ad.in; ++c) {
          const uint64_t at = static_cast<uint64_t>(r * ad.in + c);
          merged[at] = static_cast<float>(load_real(m.dtype, raw.data() + at * esize) + scale * row[static_cast<size_t>(c)]);
        }
      }
      out.resize(n * element_size(e.dtype));
      convert_float_elements(DType::kFloat32, e.dtype, reinterpret_cast<const uint8_t*>(merged.data()), n, out.data());
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
  const std::vector<const ItemMeta*> adapters = lora_items(meta);
  if (!lora || adapters.empty()) {
    throw std::invalid_argument(step_dir + ": no LoRA adapters to export (the run had no model.lora.rank)");
  }
  ExportStats stats;
  std::vector<ExportItem> items;
  for (const ItemMeta* item : adapters) {
    ExportItem e;
    e.item = item;
    e.name = "base_model.model." + item->name.substr(6);
    e.dtype = options.dtype && is_floating_dtype(item->dtype) ? *options.dtype : item->dtype;
    e.nbytes = *checked_numel(item->global_shape) * element_size(e.dtype);
    items.push_back(std::move(e));
  }
  std::sort(items.begin(), items.end(), [](const ExportItem& a, const ExportItem& b) { return a.name < b.name; });
  for (const ItemMeta& item : meta.items) {
    if (item.kind != ItemKind::kTensor || item.name.rfind("model.", 0) != 0 || !is_lora_item(item.name)) {
      stats.skipped.push_back(item.name);
    }
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
  const std::vector<ExportItem> items = select_items(meta, step_dir, model_only, stats);
  const std::string config = hf_config_json(meta, reader, step_dir, items, options);
  stats.tokenizer = export_tokenizer(*storage, meta, reader, step_dir, options, stats);
  const uint64_t slab_bytes = std::max<uint64_t>(options.slab_bytes, 1);
  write_hf_dir(*storage, out_dir, items, meta, config,
               [&](const ExportItem& e, const Sink& sink) { stream_item(reader, e, slab_bytes, sink); }, options,
               stats);
  return stats;
}

}  // namespace

double load_real(DType from, const uint8_t* p) {
  switch (from) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kFloat64: {
      double d;
      std::memcpy(&d, p, 8);
      return d;
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return half_to_float(h);
    }
    case DType::kBFloat16: {
      uint32_t bits = 0;
      std::memcpy(reinterpret_cast<uint8_t*>(&bits) + 2, p, 2);
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    default: throw std::invalid_argument(std::string("not a float type: ") + dtype_name(from));
  }
}

uint16_t float_to_bfloat16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (value != value) return 0x7FC0;  // NaN
  const uint32_t rounding_bias = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

void convert_float_elements(DType from, DType to, const uint8_t* src, uint64_t n, uint8_t* dst) {
  if (!is_floating_dtype(from) || (to != DType::kFloat32 && to != DType::kBFloat16)) {
    throw std::invalid_argument(std::string("cannot convert ") + dtype_name(from) + " to " +
                                dtype_name(to));
  }
  const size_t in = element_size(from);
  if (from == to) {
    std::memcpy(dst, src, n * in);
    return;
  }
  for (uint64_t i = 0; i < n; ++i) {
    const float f = static_cast<float>(load_real(from, src + i * in));
    if (to == DType::kFloat32) {
      std::memcpy(dst + i * 4, &f, 4);
    } else {
      const uint16_t b = float_to_bfloat16_bits(f);
      std::memcpy(dst + i * 2, &b, 2);
    }
  }
}

ExportStats export_checkpoint(const std::string& step_dir, const std::string& out_path,
                              const ExportOptions& options) {
  if (options.format == ExportFormat::kDcp) return export_dcp(step_dir, out_path, options);
  if (options.dtype && *options.dtype != DType::kFloat32 && *options.dtype != DType::kBFloat16) {
    throw std::invalid_argument(std::string("export converts floats to float32 or bfloat16, not ") +
                                dtype_name(*options.dtype));
  }
  if (options.format == ExportFormat::kHf) return export_hf(step_dir, out_path, options);
  if (options.format == ExportFormat::kPeft) return export_peft(step_dir, out_path, options);
  std::shared_ptr<Storage> storage = options.storage ? options.storage : posix_storage();
  const CheckpointMeta meta = read_committed_metadata(*storage, step_dir);

  ExportStats stats;
  const std::vector<ExportItem> items = select_items(meta, step_dir, options, stats);
  thread_pool::ThreadPool pool(static_cast<size_t>(std::max(1, options.io_threads)));
  ChunkReader reader(storage, step_dir, &pool);

  const std::string tmp = out_path + ".tmp";
  std::unique_ptr<WritableFile> file = storage->create_file(tmp);
  try {
    std::unique_ptr<ExportWriter> writer;
    if (options.format == ExportFormat::kSafetensors) {
      writer = std::make_unique<SafetensorsWriter>(*file, items, meta);
    } else {
      writer = std::make_unique<TorchZipWriter>(*file, items);
    }
    for (size_t i = 0; i < items.size(); ++i) {
      writer->begin_tensor(i);
      stream_item(reader, items[i], std::max<uint64_t>(options.slab_bytes, 1),
                  [&](const uint8_t* data, size_t n) { writer->write(data, n); });
      writer->end_tensor();
      stats.data_bytes += items[i].nbytes;
      ++stats.tensors;
    }
    writer->finish();
    file->sync();
    file->close();
  } catch (...) {
    file.reset();
    storage->remove_all(tmp);
    throw;
  }
  storage->rename(tmp, out_path);
  storage->sync_dir(parent_dir(out_path));
  stats.file_bytes = storage->file_size(out_path);
  return stats;
}

}  // namespace checkpoint
