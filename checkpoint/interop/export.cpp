// Exports (export.h): the dispatcher, element conversions, item selection
// and streaming, shared by the formats' files (export_internal.h).
#include "checkpoint/interop/export_internal.h"

#include <nlohmann/json.hpp>
#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>

#include "checkpoint/plan/resharding.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the exporter converts elements in place and assumes a little-endian host");

namespace checkpoint {

namespace {

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

}  // namespace

namespace export_detail {

std::vector<Box> item_slabs(const ExportItem& e, size_t element_size, uint64_t slab_bytes) {
  const Box full = full_box(e.shape());
  std::vector<Box> slabs = dim0_slabs(full, rows_per_slab(full, element_size, slab_bytes));
  if (e.row >= 0) {
    for (Box& b : slabs) {
      b.offsets.insert(b.offsets.begin(), e.row);
      b.sizes.insert(b.sizes.begin(), 1);
    }
  }
  return slabs;
}

// Feeds the row-major bytes of `e` (converted to e.dtype) to `sink`, one slab
// of dim-0 rows at a time (see export.h).
void stream_item(ChunkReader& reader, const ExportItem& e, uint64_t slab_bytes, const Sink& sink) {
  const ItemMeta& item = *e.item;
  if (*checked_numel(e.shape()) == 0) return;
  const size_t esize = element_size(item.dtype);
  std::vector<uint8_t> buf;
  std::vector<uint8_t> converted;
  for (const Box& slab : item_slabs(e, esize, slab_bytes)) {
    const uint64_t n = static_cast<uint64_t>(slab.numel());
    buf.resize(n * esize);
    for (const ReadRequest& req : plan_reads(item, slab)) reader.read_into(item, req, buf.data());
    if (e.dtype == item.dtype) {
      sink(buf.data(), n * esize);
    } else {
      converted.resize(n * element_size(e.dtype));
      convert_float_elements(item.dtype, e.dtype, buf.data(), n, converted.data());
      sink(converted.data(), n * element_size(e.dtype));
    }
  }
}

std::vector<ExportItem> renamed_items(const std::vector<ExportItem>& items, const std::vector<RenamedTensor>& renames,
                                      const std::string& step_dir) {
  std::map<std::string, const RenamedTensor*> by_name;
  for (const RenamedTensor& r : renames) by_name[r.name] = &r;
  std::vector<ExportItem> out;
  for (const ExportItem& e : items) {
    auto it = by_name.find(e.name);
    if (it == by_name.end()) {
      out.push_back(e);
      continue;
    }
    const RenamedTensor& r = *it->second;
    if (!r.split) {
      out.push_back(e);
      out.back().name = r.parts.at(0);
      continue;
    }
    const std::vector<int64_t>& shape = e.item->global_shape;
    if (e.row >= 0 || shape.empty() || shape[0] != static_cast<int64_t>(r.parts.size())) {
      throw FormatError(step_dir + ": item " + e.item->name + " has shape " + shape_to_string(shape) + ", not " +
                        std::to_string(r.parts.size()) + " rows, one per tensor " + r.parts.front() + ", ...");
    }
    for (size_t row = 0; row < r.parts.size(); ++row) {
      ExportItem part = e;
      part.name = r.parts[row];
      part.row = static_cast<int64_t>(row);
      part.nbytes = e.nbytes / r.parts.size();
      out.push_back(std::move(part));
    }
  }
  std::sort(out.begin(), out.end(), [](const ExportItem& a, const ExportItem& b) { return a.name < b.name; });
  for (size_t i = 1; i < out.size(); ++i) {
    if (out[i].name == out[i - 1].name) {
      throw FormatError(step_dir + ": items " + out[i - 1].item->name + " and " + out[i].item->name +
                        " would both be written as " + out[i].name);
    }
  }
  return out;
}

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

}  // namespace export_detail

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
  if (options.format == ExportFormat::kDcp) return export_detail::export_dcp(step_dir, out_path, options);
  if (options.dtype && *options.dtype != DType::kFloat32 && *options.dtype != DType::kBFloat16) {
    throw std::invalid_argument(std::string("export converts floats to float32 or bfloat16, not ") +
                                dtype_name(*options.dtype));
  }
  if (options.format == ExportFormat::kHf) return export_detail::export_hf(step_dir, out_path, options);
  if (options.format == ExportFormat::kPeft) return export_detail::export_peft(step_dir, out_path, options);
  return export_detail::export_file(step_dir, out_path, options);
}

}  // namespace checkpoint
