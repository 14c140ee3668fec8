// DCP checkpoints' data: each item's torch.save archive (opened and checked
// against its chunk), boxes read across chunks, key mapping, and
// `ckpt import-dcp`. The .metadata pickle is dcp_metadata.cpp's.
#include "checkpoint/interop/dcp.h"

#include <algorithm>
#include <cstring>
#include <ctime>
#include <map>
#include <optional>

#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/interop/pickle.h"
#include "checkpoint/interop/streaming.h"
#include "checkpoint/interop/zip_archive.h"
#include "checkpoint/plan/resharding.h"

namespace checkpoint {

namespace {

constexpr uint64_t kMaxItemPickleBytes = uint64_t{64} << 20;

// One item's archive as a file of its own, for the zip reader: reads of
// "item" at [0, length) are reads of `file` at [offset, offset + length).
class ArchiveView : public Storage {
 public:
  ArchiveView(Storage& base, std::string file, uint64_t offset, uint64_t length)
      : base_(base), file_(std::move(file)), offset_(offset), length_(length) {}
  void read_at(const std::string&, uint64_t offset, void* dst, size_t n) override {
    if (offset > length_ || n > length_ - offset) {
      throw FormatError(file_ + ": the archive at offset " + std::to_string(offset_) +
                        " reaches past its recorded length " + std::to_string(length_));
    }
    base_.read_at(file_, offset_ + offset, dst, n);
  }
  uint64_t file_size(const std::string&) override { return length_; }
  FileInfo stat(const std::string&) override { return {FileType::kFile, length_, 0}; }
  std::unique_ptr<WritableFile> create_file(const std::string&) override { refuse(); }
  void make_dirs(const std::string&) override { refuse(); }
  void rename(const std::string&, const std::string&) override { refuse(); }
  void sync_dir(const std::string&) override { refuse(); }
  std::vector<std::string> list_dir(const std::string&) override { refuse(); }
  void remove_all(const std::string&) override { refuse(); }

 private:
  [[noreturn]] static void refuse() { throw std::logic_error("ArchiveView is read-only"); }
  Storage& base_;
  std::string file_;
  uint64_t offset_;
  uint64_t length_;
};

// ------------------------------------------------------------ import-dcp

// A DCP tensor to import, under its shardkit name.
struct PlannedItem {
  const DcpTensorItem* item;
  std::string name;
  bool step;  // an AdamW step: an 8-byte integer item
};

// What import-dcp carries: the mapped model and optimizer tensors (two keys
// mapping to one name is an error); the rest goes to stats.ignored.
// train_state.step is read into `train_step`.
std::vector<PlannedItem> plan_import(Storage& storage, const std::string& src, const DcpMetadata& meta,
                                     const std::vector<DcpRename>& renames, DcpImportStats& stats,
                                     int64_t& train_step) {
  std::vector<PlannedItem> planned;
  std::map<std::string, std::string> seen;
  for (const DcpTensorItem& item : meta.tensors) {
    if (item.fqn == "train_state.step") {
      train_step = read_dcp_step(storage, src, item);
      continue;
    }
    const std::string name = dcp_to_shardkit_name(item.fqn, renames);
    if (name.empty()) {
      stats.ignored.push_back(item.fqn);
      continue;
    }
    if (!seen.emplace(name, item.fqn).second) {
      throw FormatError(src + ": DCP keys '" + seen[name] + "' and '" + item.fqn +
                        "' both map to '" + name + "'");
    }
    const bool is_step = name.rfind("optim.", 0) == 0 && name.size() > 5 &&
                         name.compare(name.size() - 5, 5, ".step") == 0;
    planned.push_back({&item, name, is_step});
  }
  for (const DcpBytesItem& b : meta.bytes) stats.ignored.push_back(b.fqn);
  if (planned.empty()) throw FormatError(src + ": nothing to import: no model or optimizer tensors");
  return planned;
}

// Copies every chunk of `item` into `out` as item `name`, in dim-0 slabs of
// at most slab_bytes.
void import_tensor(Storage& storage, const std::string& src, const DcpTensorItem& item,
                   const std::string& name, uint64_t slab_bytes, ImportWriter& out, DcpImportStats& stats) {
  ItemMeta meta_item;
  meta_item.name = name;
  meta_item.dtype = item.dtype;
  meta_item.global_shape = item.shape;
  const size_t index = out.add_item(std::move(meta_item));
  const size_t esize = element_size(item.dtype);
  for (const DcpChunk& c : item.chunks) {
    for (const Box& slab : dim0_slabs(c.box, rows_per_slab(c.box, esize, slab_bytes))) {
      auto buf = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(slab.numel()) * esize);
      if (!slab.is_empty()) read_dcp_box(storage, src, item, slab, buf->data());
      stats.bytes += buf->size();
      out.add_chunk(index, slab, std::move(buf), esize);
    }
  }
}

}  // namespace

bool is_dcp_checkpoint(Storage& storage, const std::string& dir) {
  const std::string path = join_path(dir, ".metadata");
  if (storage.stat(path).type != FileType::kFile || storage.file_size(path) < 2) return false;
  uint8_t head[2];
  storage.read_at(path, 0, head, 2);
  return head[0] == 0x80 && head[1] >= 2 && head[1] <= 5;
}

uint64_t dcp_chunk_data_offset(Storage& storage, const std::string& dir, const DcpTensorItem& item,
                               const DcpChunk& chunk) {
  const std::string file = join_path(dir, chunk.location.file);
  const std::string where = file + " (item '" + item.fqn + "', chunk " + box_to_string(chunk.box) +
                            ", archive at offset " + std::to_string(chunk.location.offset) + ")";
  const uint64_t file_bytes = storage.file_size(file);
  if (chunk.location.offset > file_bytes || chunk.location.length > file_bytes - chunk.location.offset) {
    throw FormatError(where + ": the archive of " + std::to_string(chunk.location.length) +
                      " bytes reaches past the end of the file (" + std::to_string(file_bytes) +
                      " bytes): truncated?");
  }
  ArchiveView view(storage, file, chunk.location.offset, chunk.location.length);
  const std::vector<ZipMember> members = [&] {
    try {
      return read_zip_directory(view, "item");
    } catch (const FormatError& e) {
      throw FormatError(where + ": not a torch.save archive: " + e.what());
    }
  }();
  const ZipMember* pickle = nullptr;
  std::map<std::string, const ZipMember*> by_name;
  for (const ZipMember& m : members) {
    by_name[m.name] = &m;
    const size_t slash = m.name.find('/');
    if (slash != std::string::npos && m.name.substr(slash) == "/data.pkl") pickle = &m;
  }
  if (pickle == nullptr) throw FormatError(where + ": archive without <name>/data.pkl");
  const std::string prefix = pickle->name.substr(0, pickle->name.size() - std::strlen("data.pkl"));
  if (pickle->size > kMaxItemPickleBytes) throw FormatError(where + ": data.pkl is too large");
  std::vector<uint8_t> pkl(pickle->size);
  view.read_at("item", zip_member_data_offset(view, "item", *pickle), pkl.data(), pkl.size());
  if (crc32_update(0, pkl.data(), pkl.size()) != pickle->crc32) {
    throw FormatError(where + ": CRC-32 mismatch in data.pkl");
  }
  const PickledTensor t = parse_tensor_pickle(pkl.data(), pkl.size(), where + ": data.pkl", item.fqn);
  if (t.dtype != item.dtype) {
    throw FormatError(where + ": the archive holds " + dtype_name(t.dtype) + ", the metadata says " +
                      dtype_name(item.dtype));
  }
  if (t.shape != chunk.box.sizes) {
    throw FormatError(where + ": the archive holds a tensor of shape " + shape_to_string(t.shape) +
                      ", the chunk is " + shape_to_string(chunk.box.sizes));
  }
  auto member = by_name.find(prefix + "data/" + t.storage_key);
  if (member == by_name.end()) {
    throw FormatError(where + ": storage member '" + prefix + "data/" + t.storage_key + "' is missing");
  }
  const uint64_t esize = element_size(t.dtype);
  if (member->second->size != t.storage_numel * esize) {
    throw FormatError(where + ": storage member has " + std::to_string(member->second->size) +
                      " bytes, its pickle says " + std::to_string(t.storage_numel * esize));
  }
  return chunk.location.offset + zip_member_data_offset(view, "item", *member->second) +
         static_cast<uint64_t>(t.storage_offset) * esize;
}

std::string dcp_to_shardkit_name(const std::string& fqn, const std::vector<DcpRename>& renames) {
  auto starts_with = [](const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; };
  std::string key = fqn;
  for (const auto& [from, to] : renames) {
    if (starts_with(key, from)) {
      key = to + key.substr(from.size());
      break;
    }
  }
  if (starts_with(key, "model.")) return key;
  for (const char* optim : {"optim.state.", "optimizer.state."}) {
    if (starts_with(key, optim)) return "optim." + key.substr(std::strlen(optim));
  }
  for (const char* other : {"optim.", "optimizer.", "lr_scheduler.", "dataloader.", "train_state.",
                            "extra."}) {
    if (starts_with(key, other)) return "";
  }
  return "model." + key;
}

bool box_within_shape(const Box& box, const std::vector<int64_t>& shape) {
  bool inside = box.offsets.size() == shape.size() && box.sizes.size() == shape.size();
  for (size_t d = 0; inside && d < shape.size(); ++d) {
    inside = box.offsets[d] >= 0 && box.sizes[d] >= 0 && box.offsets[d] <= shape[d] &&
             box.sizes[d] <= shape[d] - box.offsets[d];
  }
  return inside;
}

int64_t read_dcp_step(Storage& storage, const std::string& dir, const DcpTensorItem& item) {
  const std::optional<uint64_t> numel = checked_numel(item.shape);
  if (!numel || *numel != 1) {
    throw FormatError(dir + ": item '" + item.fqn + "' of shape " + shape_to_string(item.shape) +
                      " is not a single number");
  }
  uint8_t raw[8] = {};
  read_dcp_box(storage, dir, item, full_box(item.shape), raw);
  switch (item.dtype) {
    case DType::kFloat32:
    case DType::kFloat64: return static_cast<int64_t>(load_real(item.dtype, raw));
    case DType::kInt64: return static_cast<int64_t>(load_le(raw, 8));
    case DType::kInt32: return static_cast<int32_t>(load_le(raw, 4));
    default:
      throw FormatError(dir + ": item '" + item.fqn + "' is " + dtype_name(item.dtype) +
                        ", not a step count");
  }
}

// ------------------------------------------------------- streaming pieces

int64_t rows_per_slab(const Box& box, size_t element_size, uint64_t slab_bytes) {
  const int64_t rows = box.ndim() == 0 ? 1 : box.sizes[0];
  const uint64_t row_bytes = rows == 0 ? 0 : static_cast<uint64_t>(box.numel()) / rows * element_size;
  return static_cast<int64_t>(std::max<uint64_t>(
      1, row_bytes == 0 ? 1 : std::min<uint64_t>(rows, slab_bytes / row_bytes)));
}

std::vector<Box> dim0_slabs(const Box& box, int64_t rows) {
  const int64_t total = box.ndim() == 0 ? 1 : box.sizes[0];
  std::vector<Box> out;
  for (int64_t r0 = 0; r0 < std::max<int64_t>(total, 1); r0 += rows) {
    Box slab = box;
    if (slab.ndim() > 0) {
      slab.offsets[0] = box.offsets[0] + r0;
      slab.sizes[0] = std::min(rows, total - r0);
    }
    out.push_back(std::move(slab));
    if (total == 0) break;
  }
  return out;
}

CheckpointMeta imported_checkpoint_meta(const std::string& layout, const std::string& imported_from,
                                        const std::string& source) {
  CheckpointMeta meta;
  meta.world_size = 1;
  meta.layout = layout;
  meta.created_unix_s = static_cast<int64_t>(std::time(nullptr));
  meta.info["imported_from"] = imported_from;
  meta.info["source"] = source;
  return meta;
}

namespace {
constexpr const char* kImportDataFile = "rank_0.data";

ChunkWriter::Options import_writer_options(const thread_pool::ThreadPool& pool) {
  ChunkWriter::Options wo;
  wo.max_batches_in_flight = 2 * pool.num_threads();
  return wo;
}
}  // namespace

ImportWriter::ImportWriter(Storage& storage, std::string step_dir, int io_threads)
    : storage_(storage),
      step_dir_(std::move(step_dir)),
      pool_(static_cast<size_t>(std::max(1, io_threads))),
      file_(storage.create_file(join_path(step_dir_, kImportDataFile))),
      writer_(*file_, &pool_, import_writer_options(pool_)) {}

size_t ImportWriter::add_item(ItemMeta item) {
  items_.push_back(std::move(item));
  return items_.size() - 1;
}

void ImportWriter::add_chunk(size_t index, const Box& box, std::shared_ptr<std::vector<uint8_t>> data,
                             size_t element_size) {
  const uint8_t* bytes = data->data();
  const size_t n = data->size();
  writer_.add_chunk(bytes, n, element_size, {}, std::move(data));
  chunk_of_.emplace_back(index, box);
}

void ImportWriter::add_int64_item(const std::string& name, int64_t value) {
  auto buf = std::make_shared<std::vector<uint8_t>>(8);
  store_le(buf->data(), static_cast<uint64_t>(value), 8);
  ItemMeta item;
  item.name = name;
  item.kind = ItemKind::kBytes;
  item.dtype = DType::kUInt8;
  item.global_shape = {8};
  const size_t index = add_item(std::move(item));
  add_chunk(index, full_box({8}), std::move(buf), 1);
}

void ImportWriter::commit(CheckpointMeta meta) {
  std::vector<ChunkMeta> chunks = writer_.finish();
  file_->sync();
  file_->close();
  meta.items = std::move(items_);
  for (size_t k = 0; k < chunks.size(); ++k) {
    chunks[k].box = chunk_of_[k].second;
    chunks[k].file = kImportDataFile;
    chunks[k].writer_rank = 0;
    meta.items[chunk_of_[k].first].chunks.push_back(std::move(chunks[k]));
  }
  storage_.sync_dir(step_dir_);
  storage_.write_file_atomic(join_path(step_dir_, kMetadataFileName), encode_metadata(meta));
}

DcpImportStats import_dcp_checkpoint(const std::string& src, const std::string& step_dir,
                                     const DcpImportOptions& options) {
  std::shared_ptr<Storage> storage = options.storage ? options.storage : posix_storage();
  const DcpMetadata meta = read_dcp_metadata(*storage, src);
  if (storage->exists(step_dir)) {
    throw IoError(step_dir + ": exists; import-dcp writes a new checkpoint directory");
  }
  DcpImportStats stats;
  int64_t train_step = -1;
  const std::vector<PlannedItem> planned = plan_import(*storage, src, meta, options.renames, stats, train_step);
  storage->make_dirs_durable(step_dir);
  try {
    ImportWriter out(*storage, step_dir, options.io_threads);
    CheckpointMeta header = imported_checkpoint_meta("imported from PyTorch DCP", "pytorch-dcp", src);
    int64_t max_optim_step = -1;
    for (const PlannedItem& p : planned) {
      if (p.step) {
        const int64_t v = read_dcp_step(*storage, src, *p.item);
        max_optim_step = std::max(max_optim_step, v);
        out.add_int64_item(p.name, v);
        stats.bytes += 8;
      } else {
        import_tensor(*storage, src, *p.item, p.name, options.slab_bytes, out, stats);
      }
      ++stats.tensors;
    }
    stats.step = train_step >= 0 ? train_step : std::max<int64_t>(0, max_optim_step);
    if (!options.step_item.empty()) {
      out.add_int64_item(options.step_item, stats.step);
      stats.bytes += 8;
    }
    header.step = stats.step;
    out.commit(std::move(header));
  } catch (...) {
    storage->remove_all(step_dir);
    throw;
  }
  return stats;
}

void read_dcp_box(Storage& storage, const std::string& dir, const DcpTensorItem& item,
                  const Box& box, uint8_t* dst) {
  if (!box_within_shape(box, item.shape)) {
    throw FormatError(join_path(dir, ".metadata") + ": box " + box_to_string(box) +
                      " lies outside item '" + item.fqn + "' of shape " + shape_to_string(item.shape));
  }
  if (box.is_empty()) return;
  for (const DcpChunk& c : item.chunks) {
    const std::optional<Box> overlap = intersect(c.box, box);
    if (!overlap) continue;
    const uint64_t data = dcp_chunk_data_offset(storage, dir, item, c);
    const std::string file = join_path(dir, c.location.file);
    for (const ByteRange& r : overlap_byte_ranges(c.box, box, *overlap, element_size(item.dtype))) {
      storage.read_at(file, data + r.src_offset, dst + r.dst_offset, r.length);
    }
  }
}

std::string dcp_model_name(const std::string& fqn) {
  static const char* const kNotModel[] = {"optim.",      "optimizer.",   "lr_scheduler.",
                                          "dataloader.", "train_state.", "extra."};
  if (fqn.rfind("model.", 0) == 0) return fqn.substr(6);
  for (const char* p : kNotModel) {
    if (fqn.rfind(p, 0) == 0) return "";
  }
  return fqn;
}

}  // namespace checkpoint
