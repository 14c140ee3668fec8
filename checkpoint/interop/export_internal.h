#pragma once
// What the export files share (internal to checkpoint/interop, not
// installed). One export format per file:
//   export.cpp          the dispatcher (export_checkpoint), element
//                       conversions, item selection and streaming;
//   export_file.cpp     one file: safetensors, or a torch.save archive;
//   export_dcp.cpp      a PyTorch DCP directory;
//   export_hf.cpp       a Hugging Face directory (safetensors shards,
//                       config.json, the tokenizer);
//   export_lora.cpp     a LoRA run's adapters: PEFT's directory, and the
//                       Hugging Face directory with them merged.
#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/interop/export.h"
#include "checkpoint/interop/renamed_tensor.h"
#include "checkpoint/interop/streaming.h"
#include "checkpoint/interop/weights_file.h"
#include "checkpoint/storage/storage.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace checkpoint::export_detail {

// torch.save's archive layout, whatever the file is called.
inline constexpr const char* kArchiveName = "archive";

// One tensor item to write: the item, or one row of its dim 0 (that dim
// dropped: a stacked expert, RenamedTensor::split).
struct ExportItem {
  const ItemMeta* item = nullptr;
  std::string name;     // in the output
  DType dtype;          // in the output
  uint64_t nbytes = 0;  // in the output
  int64_t row = -1;     // -1: the whole item

  // In the output.
  std::vector<int64_t> shape() const {
    if (row < 0) return item->global_shape;
    return std::vector<int64_t>(item->global_shape.begin() + 1, item->global_shape.end());
  }
};

// The boxes (in the item's coordinates) that cover `e` in row-major order,
// each of at most slab_bytes of `element_size`-byte elements (at least one
// row of the output's dim 0; one box for a 0-d output).
std::vector<Box> item_slabs(const ExportItem& e, size_t element_size, uint64_t slab_bytes);

// `items` under Hugging Face's names: an item that `renames` names takes
// its part's name, or (split) becomes one item per row, named by the parts;
// the rest keep theirs. Sorted by name. Throws FormatError naming
// `step_dir` for a split item whose dim 0 is not the parts' count.
std::vector<ExportItem> renamed_items(const std::vector<ExportItem>& items, const std::vector<RenamedTensor>& renames,
                                      const std::string& step_dir);

using Sink = std::function<void(const uint8_t*, size_t)>;

// Feeds the row-major bytes of `e` (converted to e.dtype) to `sink`, one slab
// of dim-0 rows at a time (see export.h).
void stream_item(ChunkReader& reader, const ExportItem& e, uint64_t slab_bytes, const Sink& sink);

// How an HF export gets each item's bytes.
using ItemSource = std::function<void(const ExportItem&, const Sink&)>;

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
    for (const ExportItem& e : items) tensors.push_back({e.name, e.dtype, e.shape()});
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

// The tensor items under options.only (all when empty), named without that
// prefix, sorted by name; the rest go to stats.skipped. Throws FormatError
// naming `step_dir` when none is left or a name cannot be written.
std::vector<ExportItem> select_items(const CheckpointMeta& meta, const std::string& step_dir,
                                     const ExportOptions& options, ExportStats& stats);

// The bytes of a bytes item, or nullopt when there is none.
std::optional<std::string> read_bytes_item(const CheckpointMeta& meta, ChunkReader& reader,
                                           const std::string& name);
// The run adapter's view of the checkpoint's bytes items.
RunAdapter::ReadBytesItem bytes_item_reader(const CheckpointMeta& meta, ChunkReader& reader);

// Writes a directory `out_dir` through <out_dir>.tmp: `fill` writes into
// the temporary directory, which then replaces `out_dir`; a failure removes
// it.
void write_dir_atomically(Storage& storage, const std::string& out_dir,
                          const std::function<void(const std::string& tmp)>& fill);

// The exports, one per file (export_checkpoint in export.cpp dispatches).
ExportStats export_file(const std::string& step_dir, const std::string& out_path, const ExportOptions& options);
ExportStats export_dcp(const std::string& step_dir, const std::string& out_dir, const ExportOptions& options);
ExportStats export_hf(const std::string& step_dir, const std::string& out_dir, const ExportOptions& options);
ExportStats export_peft(const std::string& step_dir, const std::string& out_dir, const ExportOptions& options);

// Hugging Face (export_hf.cpp), for export_hf and the merged LoRA export:
// config.json of the checkpoint's model; the tokenizer to ship ("" for
// none); the directory itself (safetensors shards of `items`, config.json,
// the tokenizer's files).
std::string hf_config_json(const CheckpointMeta& meta, ChunkReader& reader, const std::string& step_dir,
                           const std::vector<ExportItem>& items, const ExportOptions& options);
// The run adapter's renames for the HF directory of `config` (none without
// a run adapter).
std::vector<RenamedTensor> hf_renames(const std::string& config, const std::string& step_dir,
                                      const ExportOptions& options);
std::string export_tokenizer(Storage& storage, const CheckpointMeta& meta, ChunkReader& reader,
                             const std::string& step_dir, const ExportOptions& options, ExportStats& stats);
void write_hf_dir(Storage& storage, const std::string& out_dir, const std::vector<ExportItem>& items,
                  const CheckpointMeta& meta, const std::string& config, const ItemSource& source,
                  const ExportOptions& options, ExportStats& stats);

// LoRA (export_lora.cpp): the run's adapters (nullopt when it trained none
// or no run adapter is given), and the Hugging Face directory of its base
// with them merged.
std::optional<LoraInfo> lora_of(const CheckpointMeta& meta, ChunkReader& reader, const std::string& step_dir,
                                const ExportOptions& options);
ExportStats export_hf_merged(const std::string& step_dir, const std::string& out_dir, const ExportOptions& options,
                             const std::shared_ptr<Storage>& storage, const CheckpointMeta& meta,
                             ChunkReader& reader, const LoraInfo& lora);

}  // namespace checkpoint::export_detail
