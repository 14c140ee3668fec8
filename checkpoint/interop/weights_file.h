#pragma once
// A file of full (unsharded) weights made outside this project -- safetensors,
// or a torch.save zip archive of a flat dict name -> tensor -- opened for
// ranged reads, so that every rank reads only the box of each tensor it holds.
// Torch-free.
//
// Everything read from the file is untrusted. safetensors: the header length
// is bounded (<= 100 MiB) and within the file, JSON errors are named, every
// tensor's data_offsets lie within the data section, match dtype x shape and
// do not overlap. torch.save: the zip central directory is bounds-checked,
// the members needed must be stored (uncompressed), and data.pkl is read by a
// restricted pickle reader (pickle.h) that executes nothing.
// Errors are FormatError (metadata.h) naming the path and the tensor;
// IoError for the file system.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/format/types.h"
#include "checkpoint/interop/renamed_tensor.h"
#include "checkpoint/storage/storage.h"

namespace checkpoint {

// Bound on the JSON header of a safetensors file.
constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;

// A DCP tensor's chunk: its box and where its row-major bytes are.
struct WeightsChunk {
  Box box;
  std::string file;          // path
  uint64_t data_offset = 0;  // absolute offset of the box's first element in `file`
};

struct WeightsTensorInfo {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  // DCP: the saved chunks (tiling the shape); data_offset is then unused.
  std::vector<WeightsChunk> chunks;
  // Absolute offset in the file of the tensor's first element (for both
  // formats: inside the data section, or inside the storage's zip member);
  // the tensor's row-major bytes follow contiguously.
  uint64_t data_offset = 0;
  uint64_t nbytes = 0;  // numel * element_size(dtype)
};

class WeightsFile {
 public:
  // Opens and validates `path`: a zip archive (starts with "PK\3\4") is read
  // as torch.save, a directory holding a PyTorch DCP checkpoint (dcp.h) as
  // its model weights (names as dcp_model_name gives them; every chunk's
  // archive is checked here), a Hugging Face model directory (format "hf":
  // model.safetensors.index.json and the shards its weight_map names, or
  // one model.safetensors) as the tensors of its safetensors files, under
  // their own names, anything else as safetensors. Only the headers, or the
  // directory and data.pkl, are read here. `storage` null: the POSIX file
  // system.
  static WeightsFile open(const std::string& path, std::shared_ptr<Storage> storage = nullptr);

  // In file order (safetensors: by data offset; torch: dict order).
  const std::vector<WeightsTensorInfo>& tensors() const { return tensors_; }
  // nullptr when there is no tensor `name`.
  const WeightsTensorInfo* find(const std::string& name) const;
  // Reads the row-major bytes of `box` (global coordinates) of tensor `name`
  // into dst (numel(box) * element size bytes), reading only those byte
  // ranges of the file. Throws FormatError for an unknown name or a box
  // outside the tensor. Thread-safe (reads only).
  void read_box(const std::string& name, const Box& box, uint8_t* dst) const;
  // This file under our names: each of `renames` whose parts it holds (and
  // not the name itself) is listed as its name in place of its parts. A
  // split one is a tensor [parts, part shape...] whose row r lies where part
  // r lies, so read_box of a box of it reads only the bytes of the rows the
  // box covers (each rank reads the experts of its own shards). A rename
  // none of whose parts is here changes nothing. Throws FormatError naming
  // the file for a rename some of whose parts are missing, or whose parts
  // differ in dtype or shape (a split one's are all one dtype and shape).
  WeightsFile renamed(const std::vector<RenamedTensor>& renames) const;
  // "safetensors", "torch", "dcp" or "hf".
  const std::string& format() const { return format_; }
  const std::string& path() const { return path_; }
  // safetensors "__metadata__" (string values); empty for torch files.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  WeightsFile() = default;
  void open_safetensors();
  void open_torch_zip();
  void open_dcp();
  void open_hf();

  std::shared_ptr<Storage> storage_;
  std::string path_;
  std::string format_;
  std::vector<WeightsTensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A Hugging Face model directory's weights: the index of a sharded save, or
// the one file of an unsharded one (save_pretrained's names).
constexpr const char* kHfIndexName = "model.safetensors.index.json";
constexpr const char* kHfSingleName = "model.safetensors";
bool is_hf_model_dir(Storage& storage, const std::string& dir);

// The safetensors dtype string for `dtype` ("F32", "BF16", "I64", "BOOL", ...)
// and back (nullopt for strings this format does not know).
const char* safetensors_dtype_name(DType dtype);
std::optional<DType> parse_safetensors_dtype(const std::string& name);

// One tensor of a safetensors file being written.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  // Its numel(shape) * element_size(dtype) row-major bytes; read by
  // write_safetensors, ignored by encode_safetensors_header.
  const uint8_t* data = nullptr;
};

// The bytes a safetensors file starts with: the 8-byte little-endian length
// of the JSON header, then the header -- "__metadata__" first (left out when
// `metadata` is empty), then `tensors` in order, each with
// {dtype, shape, data_offsets}, the offsets consecutive -- padded with spaces
// to a multiple of 8 bytes. The tensors' bytes follow it, in the same order.
// REQUIRES: valid shapes and UTF-8 names (export checks them first).
std::vector<uint8_t> encode_safetensors_header(const std::vector<SafetensorsTensor>& tensors,
                                               const std::map<std::string, std::string>& metadata);

// Writes `path` (created or truncated, not atomically) as a safetensors file
// of `tensors` and syncs it. Throws std::invalid_argument for an invalid
// shape or a null `data` with bytes to write; IoError for the file.
// `storage` null: the POSIX file system.
void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {},
                       std::shared_ptr<Storage> storage = nullptr);

}  // namespace checkpoint
