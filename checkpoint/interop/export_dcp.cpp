// A PyTorch DCP directory (export.h): one data file of torch.save archives
// and the .metadata that lists them, as torch.distributed.checkpoint saves.
#include "checkpoint/interop/export_internal.h"

#include <nlohmann/json.hpp>
#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>

#include "checkpoint/format/byte_order.h"
#include "checkpoint/interop/dcp.h"
#include "checkpoint/interop/pickle.h"
#include "checkpoint/interop/zip_archive.h"
#include "checkpoint/plan/resharding.h"

namespace checkpoint::export_detail {

namespace {

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

}  // namespace

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

}  // namespace checkpoint::export_detail
