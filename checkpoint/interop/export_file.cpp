// One file of full tensors (export.h): safetensors, or a torch.save
// archive that torch.load(f, weights_only=True) accepts.
#include "checkpoint/interop/export_internal.h"

#include <nlohmann/json.hpp>
#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>

#include "checkpoint/interop/pickle.h"
#include "checkpoint/interop/zip_archive.h"

namespace checkpoint::export_detail {

namespace {

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

}  // namespace

ExportStats export_file(const std::string& step_dir, const std::string& out_path, const ExportOptions& options) {
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

}  // namespace checkpoint::export_detail
