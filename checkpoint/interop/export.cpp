#include "checkpoint/interop/export.h"

#include <nlohmann/json.hpp>
#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <cstring>
#include <functional>
#include <stdexcept>

#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/plan/resharding.h"
#include "checkpoint/interop/torch_pickle.h"
#include "checkpoint/interop/weights_file.h"
#include "checkpoint/interop/zip_archive.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the exporter converts elements in place and assumes a little-endian host");

namespace checkpoint {

namespace {

// torch.save's archive layout, whatever the file is called.
constexpr const char* kArchiveName = "archive";

bool is_float(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kFloat16 ||
         d == DType::kBFloat16;
}

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

float load_as_float(DType from, const uint8_t* p) {
  switch (from) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kFloat64: {
      double d;
      std::memcpy(&d, p, 8);
      return static_cast<float>(d);
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
  const int64_t rows_per_slab = static_cast<int64_t>(
      std::max<uint64_t>(1, std::min<uint64_t>(rows, slab_bytes / (row_elems * esize))));
  std::vector<uint8_t> buf(static_cast<uint64_t>(rows_per_slab) * row_elems * esize);
  std::vector<uint8_t> converted;
  if (e.dtype != item.dtype) converted.resize(buf.size() / esize * element_size(e.dtype));

  for (int64_t r0 = 0; r0 < rows; r0 += rows_per_slab) {
    Box slab = full_box(item.global_shape);
    if (!item.global_shape.empty()) {
      slab.offsets[0] = r0;
      slab.sizes[0] = std::min(rows_per_slab, rows - r0);
    }
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
    e.dtype = options.dtype && is_float(item.dtype) ? *options.dtype : item.dtype;
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

}  // namespace

uint16_t float_to_bfloat16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (value != value) return 0x7FC0;  // NaN
  const uint32_t rounding_bias = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

void convert_float_elements(DType from, DType to, const uint8_t* src, uint64_t n, uint8_t* dst) {
  if (!is_float(from) || (to != DType::kFloat32 && to != DType::kBFloat16)) {
    throw std::invalid_argument(std::string("cannot convert ") + dtype_name(from) + " to " +
                                dtype_name(to));
  }
  const size_t in = element_size(from);
  if (from == to) {
    std::memcpy(dst, src, n * in);
    return;
  }
  for (uint64_t i = 0; i < n; ++i) {
    const float f = load_as_float(from, src + i * in);
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
  if (options.dtype && *options.dtype != DType::kFloat32 && *options.dtype != DType::kBFloat16) {
    throw std::invalid_argument(std::string("export converts floats to float32 or bfloat16, not ") +
                                dtype_name(*options.dtype));
  }
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
