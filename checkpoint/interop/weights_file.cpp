#include "checkpoint/interop/weights_file.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>

#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/interop/dcp.h"
#include "checkpoint/plan/resharding.h"
#include "checkpoint/interop/pickle.h"
#include "checkpoint/interop/zip_archive.h"

namespace checkpoint {

namespace {

constexpr uint64_t kMaxPickleBytes = uint64_t{64} << 20;
constexpr int kMaxJsonDepth = 4;  // {"name": {"shape": [..]}}

struct SafetensorsDType {
  DType dtype;
  const char* name;
};
constexpr SafetensorsDType kSafetensorsDTypes[] = {
    {DType::kFloat32, "F32"}, {DType::kFloat64, "F64"}, {DType::kFloat16, "F16"},
    {DType::kBFloat16, "BF16"}, {DType::kInt64, "I64"}, {DType::kInt32, "I32"},
    {DType::kInt16, "I16"},   {DType::kInt8, "I8"},    {DType::kUInt8, "U8"},
    {DType::kBool, "BOOL"},
};

FormatError error_in(const std::string& path, const std::string& what) {
  return FormatError(path + ": " + what);
}

// Byte size of `shape` x `dtype`, or a FormatError naming the tensor.
uint64_t checked_nbytes(const std::string& path, const std::string& name,
                        const std::vector<int64_t>& shape, DType dtype) {
  const std::optional<uint64_t> numel = checked_numel(shape);
  const uint64_t esize = element_size(dtype);
  if (shape.size() > kMaxNdim || !numel || *numel > kMaxItemBytes / esize) {
    throw error_in(path, "tensor '" + name + "' has an invalid shape " + shape_to_string(shape));
  }
  return *numel * esize;
}

std::vector<int64_t> parse_shape(const nlohmann::json& j, const std::string& path,
                                 const std::string& name) {
  if (!j.is_array() || j.size() > kMaxNdim) {
    throw error_in(path, "tensor '" + name + "': \"shape\" must be an array of at most " +
                             std::to_string(kMaxNdim) + " dims");
  }
  std::vector<int64_t> shape;
  for (const auto& d : j) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      throw error_in(path, "tensor '" + name + "': \"shape\" holds " + d.dump() +
                               ", not a non-negative integer");
    }
    shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  return shape;
}

}  // namespace

const char* safetensors_dtype_name(DType dtype) {
  for (const auto& d : kSafetensorsDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

std::optional<DType> parse_safetensors_dtype(const std::string& name) {
  for (const auto& d : kSafetensorsDTypes) {
    if (name == d.name) return d.dtype;
  }
  return std::nullopt;
}

std::vector<uint8_t> encode_safetensors_header(const std::vector<SafetensorsTensor>& tensors,
                                               const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) m[key] = value;
    header["__metadata__"] = std::move(m);
  }
  uint64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    const uint64_t nbytes = *checked_numel(t.shape) * element_size(t.dtype);
    header[t.name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::vector<uint8_t> out;
  out.reserve(8 + text.size());
  append_le(out, text.size(), 8);
  out.insert(out.end(), text.begin(), text.end());
  return out;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata,
                       std::shared_ptr<Storage> storage) {
  std::vector<uint64_t> sizes;
  for (const SafetensorsTensor& t : tensors) {
    const std::optional<uint64_t> numel = checked_numel(t.shape);
    if (!numel) {
      throw std::invalid_argument("write_safetensors: tensor '" + t.name + "' has an invalid shape " +
                                  shape_to_string(t.shape));
    }
    sizes.push_back(*numel * element_size(t.dtype));
    if (sizes.back() > 0 && t.data == nullptr) {
      throw std::invalid_argument("write_safetensors: tensor '" + t.name + "' has no data");
    }
  }
  if (!storage) storage = posix_storage();
  const std::vector<uint8_t> header = encode_safetensors_header(tensors, metadata);
  std::unique_ptr<WritableFile> file = storage->create_file(path);
  file->append(header.data(), header.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (sizes[i] > 0) file->append(tensors[i].data, sizes[i]);
  }
  file->sync();
  file->close();
}

WeightsFile WeightsFile::open(const std::string& path, std::shared_ptr<Storage> storage) {
  WeightsFile f;
  f.storage_ = storage ? std::move(storage) : posix_storage();
  f.path_ = path;
  if (f.storage_->stat(path).type == FileType::kDirectory) {
    if (is_hf_model_dir(*f.storage_, path)) {
      f.format_ = "hf";
      f.open_hf();
      return f;
    }
    if (!is_dcp_checkpoint(*f.storage_, path)) {
      throw error_in(path, "a directory, but neither a PyTorch DCP checkpoint (no pickled .metadata) "
                           "nor a Hugging Face model (no model.safetensors or "
                           "model.safetensors.index.json)");
    }
    f.format_ = "dcp";
    f.open_dcp();
    for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_[f.tensors_[i].name] = i;
    return f;
  }
  const uint64_t size = f.storage_->file_size(path);
  uint8_t magic[4] = {0, 0, 0, 0};
  if (size >= sizeof magic) f.storage_->read_at(path, 0, magic, sizeof magic);
  if (std::memcmp(magic, "PK\x03\x04", 4) == 0) {
    f.format_ = "torch";
    f.open_torch_zip();
  } else {
    f.format_ = "safetensors";
    f.open_safetensors();
  }
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_[f.tensors_[i].name] = i;
  return f;
}

namespace {

// A tensor's bytes in the data section, [begin, end).
struct Span {
  uint64_t begin, end;
  size_t tensor;
};

// The JSON header of the safetensors file `path` (after its 8-byte length);
// the data section is [data_start, data_start + data_size).
nlohmann::json read_safetensors_header(Storage& storage, const std::string& path, uint64_t& data_start,
                                       uint64_t& data_size) {
  const uint64_t file_size = storage.file_size(path);
  if (file_size < 8) throw error_in(path, "too short for a safetensors header length");
  uint8_t len_bytes[8];
  storage.read_at(path, 0, len_bytes, 8);
  const uint64_t header_len = load_le(len_bytes, 8);
  if (header_len > kMaxSafetensorsHeaderBytes || header_len > file_size - 8) {
    throw error_in(path, "safetensors header length " + std::to_string(header_len) +
                             " exceeds the file (" + std::to_string(file_size) +
                             " bytes) or the 100 MiB limit; not a safetensors file?");
  }
  std::string text(header_len, '\0');
  storage.read_at(path, 8, text.data(), text.size());
  data_start = 8 + header_len;
  data_size = file_size - data_start;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (depth > kMaxJsonDepth) throw std::runtime_error("nested too deeply");
      return true;
    });
  } catch (const std::exception& e) {
    throw error_in(path, std::string("bad safetensors JSON header: ") + e.what());
  }
  if (!header.is_object()) throw error_in(path, "safetensors header is not a JSON object");
  return header;
}

// One tensor entry {"dtype", "shape", "data_offsets"}; `span` gets its
// data_offsets, checked against the data section of data_size bytes.
WeightsTensorInfo parse_safetensors_entry(const std::string& path, const std::string& name,
                                          const nlohmann::json& entry, uint64_t data_size, Span& span) {
  auto bad = [&](const std::string& what) { return error_in(path, "tensor '" + name + "': " + what); };
  if (name.empty() || name.size() > kMaxNameLength) throw bad("invalid name length");
  if (!entry.is_object()) throw bad("entry is not an object");
  if (!entry.contains("dtype") || !entry["dtype"].is_string()) throw bad("missing \"dtype\"");
  const std::string dtype_str = entry["dtype"].get<std::string>();
  const std::optional<DType> dtype = parse_safetensors_dtype(dtype_str);
  if (!dtype) throw bad("unsupported dtype \"" + dtype_str + "\"");
  if (!entry.contains("shape")) throw bad("missing \"shape\"");
  WeightsTensorInfo info;
  info.name = name;
  info.dtype = *dtype;
  info.shape = parse_shape(entry["shape"], path, name);
  info.nbytes = checked_nbytes(path, name, info.shape, info.dtype);
  const nlohmann::json* offsets = entry.contains("data_offsets") ? &entry["data_offsets"] : nullptr;
  if (offsets == nullptr || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
    throw bad("\"data_offsets\" must be [begin, end]");
  }
  span.begin = (*offsets)[0].get<uint64_t>();
  span.end = (*offsets)[1].get<uint64_t>();
  if (span.begin > span.end || span.end > data_size) {
    throw bad("data_offsets [" + std::to_string(span.begin) + ", " + std::to_string(span.end) +
              ") outside the data section of " + std::to_string(data_size) + " bytes");
  }
  if (span.end - span.begin != info.nbytes) {
    throw bad("data_offsets span " + std::to_string(span.end - span.begin) + " bytes, but " + dtype_str +
              " " + shape_to_string(info.shape) + " needs " + std::to_string(info.nbytes));
  }
  return info;
}

// `tensors` in data-section order; no two non-empty spans may overlap.
std::vector<WeightsTensorInfo> order_by_offset(const std::string& path, std::vector<WeightsTensorInfo> tensors,
                                               std::vector<Span> spans) {
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Span* reach = nullptr;  // the non-empty span ending last so far
  for (const Span& s : spans) {
    if (s.begin == s.end) continue;
    if (reach != nullptr && s.begin < reach->end) {
      throw error_in(path, "tensors '" + tensors[reach->tensor].name + "' and '" +
                               tensors[s.tensor].name + "' overlap in the data section");
    }
    if (reach == nullptr || s.end > reach->end) reach = &s;
  }
  std::vector<WeightsTensorInfo> ordered;
  for (const Span& s : spans) ordered.push_back(std::move(tensors[s.tensor]));
  return ordered;
}

}  // namespace

void WeightsFile::open_safetensors() {
  uint64_t data_start = 0;
  uint64_t data_size = 0;
  const nlohmann::json header = read_safetensors_header(*storage_, path_, data_start, data_size);
  std::vector<Span> spans;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw error_in(path_, "\"__metadata__\" is not an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) throw error_in(path_, "\"__metadata__\" value of '" + key + "' is not a string");
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    Span span{0, 0, tensors_.size()};
    WeightsTensorInfo info = parse_safetensors_entry(path_, name, entry, data_size, span);
    info.data_offset = data_start + span.begin;
    spans.push_back(span);
    tensors_.push_back(std::move(info));
  }
  tensors_ = order_by_offset(path_, std::move(tensors_), std::move(spans));
}

void WeightsFile::open_torch_zip() {
  const std::vector<ZipMember> members = read_zip_directory(*storage_, path_);
  const ZipMember* pickle = nullptr;
  std::map<std::string, const ZipMember*> by_name;
  for (const ZipMember& m : members) {
    by_name[m.name] = &m;
    const size_t slash = m.name.find('/');
    if (slash != std::string::npos && m.name.substr(slash) == "/data.pkl") {
      if (pickle != nullptr) throw error_in(path_, "more than one data.pkl in the archive");
      pickle = &m;
    }
  }
  if (pickle == nullptr) {
    throw error_in(path_, "zip archive without <name>/data.pkl: not a torch.save file");
  }
  const std::string prefix = pickle->name.substr(0, pickle->name.size() - std::strlen("data.pkl"));

  auto read_member = [&](const ZipMember& m, uint64_t limit) {
    if (m.size > limit) throw error_in(path_, "zip member '" + m.name + "' is too large");
    std::vector<uint8_t> bytes(m.size);
    storage_->read_at(path_, zip_member_data_offset(*storage_, path_, m), bytes.data(), bytes.size());
    if (crc32_update(0, bytes.data(), bytes.size()) != m.crc32) {
      throw error_in(path_, "CRC-32 mismatch in zip member '" + m.name + "'");
    }
    return bytes;
  };
  if (auto it = by_name.find(prefix + "byteorder"); it != by_name.end()) {
    const std::vector<uint8_t> order = read_member(*it->second, 16);
    if (std::string(order.begin(), order.end()) != "little") {
      throw error_in(path_, "byte order '" + std::string(order.begin(), order.end()) +
                                "' is not supported (little-endian only)");
    }
  }
  const std::vector<uint8_t> pkl = read_member(*pickle, kMaxPickleBytes);
  const std::vector<PickledTensor> parsed =
      parse_tensor_dict_pickle(pkl.data(), pkl.size(), path_ + ":" + pickle->name);

  for (const PickledTensor& t : parsed) {
    const std::string member_name = prefix + "data/" + t.storage_key;
    auto it = by_name.find(member_name);
    if (it == by_name.end()) {
      throw error_in(path_, "tensor '" + t.name + "': storage member '" + member_name + "' is missing");
    }
    const ZipMember& m = *it->second;
    const uint64_t esize = element_size(t.dtype);
    if (m.size != t.storage_numel * esize) {
      throw error_in(path_, "tensor '" + t.name + "': storage member '" + member_name + "' has " +
                                std::to_string(m.size) + " bytes, its pickle says " +
                                std::to_string(t.storage_numel * esize));
    }
    WeightsTensorInfo info;
    info.name = t.name;
    info.dtype = t.dtype;
    info.shape = t.shape;
    info.nbytes = checked_nbytes(path_, t.name, t.shape, t.dtype);
    info.data_offset = zip_member_data_offset(*storage_, path_, m) +
                       static_cast<uint64_t>(t.storage_offset) * esize;
    tensors_.push_back(std::move(info));
  }
}

void WeightsFile::open_dcp() {
  const DcpMetadata meta = read_dcp_metadata(*storage_, path_);
  for (const DcpTensorItem& item : meta.tensors) {
    const std::string name = dcp_model_name(item.fqn);
    if (name.empty()) continue;  // optimizer, scheduler, loader, train state
    if (index_.count(name) != 0) {
      throw error_in(path_, "both '" + item.fqn + "' and another key name the weight '" + name + "'");
    }
    WeightsTensorInfo info;
    info.name = name;
    info.dtype = item.dtype;
    info.shape = item.shape;
    info.nbytes = checked_nbytes(path_, item.fqn, item.shape, item.dtype);
    for (const DcpChunk& c : item.chunks) {
      info.chunks.push_back({c.box, path_ + "/" + c.location.file,
                             dcp_chunk_data_offset(*storage_, path_, item, c)});
    }
    index_[name] = tensors_.size();
    tensors_.push_back(std::move(info));
  }
}

bool is_hf_model_dir(Storage& storage, const std::string& dir) {
  return storage.exists(join_path(dir, kHfIndexName)) || storage.exists(join_path(dir, kHfSingleName));
}

// Every tensor of the shards, as one chunk (the whole tensor) in its file.
// The index's weight_map must name each tensor's file, and each file must
// hold what the map puts there.
void WeightsFile::open_hf() {
  std::map<std::string, std::vector<std::string>> by_file;  // shard -> names the index puts there
  const std::string index_path = join_path(path_, kHfIndexName);
  if (storage_->exists(index_path)) {
    const uint64_t size = storage_->file_size(index_path);
    if (size > kMaxSafetensorsHeaderBytes) throw error_in(index_path, "larger than 100 MiB");
    std::string text(size, '\0');
    storage_->read_at(index_path, 0, text.data(), text.size());
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw error_in(index_path, std::string("not JSON: ") + e.what());
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      throw error_in(index_path, "no \"weight_map\" object");
    }
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos ||
          file.get<std::string>().empty()) {
        throw error_in(index_path, "weight_map[\"" + name + "\"] must be a file name in " + path_);
      }
      by_file[file.get<std::string>()].push_back(name);
    }
  } else {
    by_file[kHfSingleName] = {};  // every tensor of the one file
  }
  for (const auto& shard_names : by_file) {
    // Not a structured binding: clang 14 (the fuzz build) cannot capture one in `add`.
    const std::string& file_name = shard_names.first;
    const std::vector<std::string>& names = shard_names.second;
    const std::string file_path = join_path(path_, file_name);
    const WeightsFile shard = WeightsFile::open(file_path, storage_);
    if (shard.format() != "safetensors") throw error_in(file_path, "not a safetensors file");
    auto add = [&](const WeightsTensorInfo& t) {
      if (index_.count(t.name) != 0) {
        throw error_in(path_, "tensor '" + t.name + "' is in two files, the second " + file_name);
      }
      WeightsTensorInfo info = t;
      info.chunks = {WeightsChunk{full_box(t.shape), file_path, t.data_offset}};
      index_[info.name] = tensors_.size();
      tensors_.push_back(std::move(info));
    };
    if (names.empty()) {
      for (const WeightsTensorInfo& t : shard.tensors()) add(t);
    }
    for (const std::string& name : names) {
      const WeightsTensorInfo* t = shard.find(name);
      if (t == nullptr) {
        throw error_in(index_path, "weight_map puts '" + name + "' in " + file_name + ", which has no such tensor");
      }
      add(*t);
    }
  }
}

namespace {

// `chunk` of a tensor moved to row `row` of a tensor stacked along a new dim
// 0: its bytes stay where they are, its box gains that dim.
WeightsChunk as_row(WeightsChunk chunk, int64_t row) {
  chunk.box.offsets.insert(chunk.box.offsets.begin(), row);
  chunk.box.sizes.insert(chunk.box.sizes.begin(), 1);
  return chunk;
}

std::string listed(const std::vector<std::string>& names) {
  std::string out = "'" + names.front() + "'";
  if (names.size() > 1) out += " and " + std::to_string(names.size() - 1) + " more";
  return out;
}

}  // namespace

WeightsFile WeightsFile::renamed(const std::vector<RenamedTensor>& renames) const {
  std::map<size_t, WeightsTensorInfo> made;  // by the position of its first part
  std::vector<bool> gone(tensors_.size(), false);
  for (const RenamedTensor& r : renames) {
    if (r.parts.empty() || (!r.split && r.parts.size() != 1)) {
      throw std::invalid_argument("WeightsFile::renamed: '" + r.name + "' needs one part, or split");
    }
    if (index_.count(r.name) != 0) continue;  // the file has ours
    std::vector<size_t> at;
    std::vector<std::string> missing;
    for (const std::string& part : r.parts) {
      auto it = index_.find(part);
      if (it == index_.end()) {
        missing.push_back(part);
      } else {
        at.push_back(it->second);
      }
    }
    if (at.empty()) continue;
    if (!missing.empty()) {
      throw error_in(path_, "has '" + tensors_[at.front()].name + "' but not " + listed(missing) +
                                ", which with it make our '" + r.name + "'");
    }
    const WeightsTensorInfo& first = tensors_[at.front()];
    WeightsTensorInfo info = first;
    info.name = r.name;
    if (r.split) {
      info.shape.insert(info.shape.begin(), static_cast<int64_t>(at.size()));
      info.nbytes = checked_nbytes(path_, r.name, info.shape, info.dtype);
      info.data_offset = 0;
      info.chunks.clear();
      for (size_t row = 0; row < at.size(); ++row) {
        const WeightsTensorInfo& t = tensors_[at[row]];
        if (t.dtype != first.dtype || t.shape != first.shape) {
          throw error_in(path_, "'" + t.name + "' is " + dtype_name(t.dtype) + " " + shape_to_string(t.shape) +
                                    ", '" + first.name + "' " + dtype_name(first.dtype) + " " +
                                    shape_to_string(first.shape) + ": they cannot stack into our '" + r.name + "'");
        }
        if (t.chunks.empty()) {
          info.chunks.push_back(as_row(WeightsChunk{full_box(t.shape), path_, t.data_offset}, row));
        }
        for (const WeightsChunk& c : t.chunks) info.chunks.push_back(as_row(c, row));
      }
    }
    for (size_t i : at) gone[i] = true;
    made[*std::min_element(at.begin(), at.end())] = std::move(info);
  }
  WeightsFile out;
  out.storage_ = storage_;
  out.path_ = path_;
  out.format_ = format_;
  out.metadata_ = metadata_;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (auto it = made.find(i); it != made.end()) out.tensors_.push_back(std::move(it->second));
    if (!gone[i]) out.tensors_.push_back(tensors_[i]);
  }
  for (size_t i = 0; i < out.tensors_.size(); ++i) {
    if (!out.index_.emplace(out.tensors_[i].name, i).second) {
      throw error_in(path_, "two tensors would be named '" + out.tensors_[i].name + "'");
    }
  }
  return out;
}

const WeightsTensorInfo* WeightsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void WeightsFile::read_box(const std::string& name, const Box& box, uint8_t* dst) const {
  const WeightsTensorInfo* info = find(name);
  if (info == nullptr) throw error_in(path_, "no tensor '" + name + "'");
  const Box whole = full_box(info->shape);
  bool inside = box.ndim() == info->shape.size() && box.offsets.size() == box.ndim();
  for (size_t d = 0; inside && d < box.ndim(); ++d) {
    inside = box.offsets[d] >= 0 && box.sizes[d] >= 0 && box.offsets[d] <= info->shape[d] &&
             box.sizes[d] <= info->shape[d] - box.offsets[d];
  }
  if (!inside) {
    throw error_in(path_, "box " + box_to_string(box) + " lies outside tensor '" + name + "' of shape " +
                              shape_to_string(info->shape));
  }
  if (box.is_empty()) return;
  if (!info->chunks.empty()) {  // DCP: from every chunk the box overlaps
    for (const WeightsChunk& c : info->chunks) {
      const std::optional<Box> overlap = intersect(c.box, box);
      if (!overlap) continue;
      for (const ByteRange& r : overlap_byte_ranges(c.box, box, *overlap, element_size(info->dtype))) {
        storage_->read_at(c.file, c.data_offset + r.src_offset, dst + r.dst_offset, r.length);
      }
    }
    return;
  }
  for (const ByteRange& r : overlap_byte_ranges(whole, box, box, element_size(info->dtype))) {
    storage_->read_at(path_, info->data_offset + r.src_offset, dst + r.dst_offset, r.length);
  }
}

}  // namespace checkpoint
