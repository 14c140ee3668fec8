#pragma once
// Hugging Face model directories into shardkit checkpoints (`ckpt
// import-hf`). The way out is export_checkpoint with ExportFormat::kHf
// (export.h); model.init_from reads a directory directly (weights_file.h,
// framework/config for its config.json). Torch-free.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/interop/renamed_tensor.h"
#include "checkpoint/storage/storage.h"

namespace checkpoint {

struct HfImportOptions {
  int io_threads = 4;
  uint64_t slab_bytes = uint64_t{64} << 20;  // most bytes of one imported chunk
  std::shared_ptr<Storage> storage;          // null: the POSIX file system
  // The 8-byte integer item that records the step (0) for the run that
  // starts from the import (the trainer's: framework/config/run_items.h);
  // empty: none.
  std::string step_item;
  // Tensors the directory names or lays out otherwise than the model that
  // will resume the import (the tool asks the model's Hugging Face adapter:
  // a mixture of experts' experts stack into ours); empty: its own names.
  std::vector<RenamedTensor> renames;
};

struct HfImportStats {
  uint64_t tensors = 0;
  uint64_t bytes = 0;                  // logical bytes written (float32)
  std::vector<std::string> converted;  // tensors stored as bf16/fp16/fp64, written as float32
};

// Converts the weights of the Hugging Face model directory `src`
// (model.safetensors, or the shards model.safetensors.index.json lists)
// into a committed model-only checkpoint `step_dir` (created; it must not
// exist): item model.<name> per tensor (after options.renames), floating-point tensors as float32
// (the trainer's master dtype), and options.step_item 0. Streaming: at most
// slab_bytes of a tensor in memory at a time. The metadata records
// info["imported_from"] = "huggingface", info["source"] and, when `src`
// has a config.json, info["hf_config"] (its text), from which an export
// back writes config.json. Resume it with checkpoint.model_only: true, at
// any world size. Throws FormatError naming the file for unreadable input,
// IoError for I/O; a failed import removes what it wrote.
HfImportStats import_hf_checkpoint(const std::string& src, const std::string& step_dir,
                                   const HfImportOptions& options);

// A content hash of the weights at `path` (whatever WeightsFile::open
// reads: a Hugging Face directory, safetensors, torch.save, PyTorch DCP):
// XXH3-64 over every tensor in name order -- its name, dtype, shape and
// row-major bytes -- so it does not depend on how the tensors are split
// into files, nor on anything but the tensors (config.json is not in it).
// "xxh3:" and 16 hex digits. Reads every tensor byte once, in dim-0 slabs
// of at most slab_bytes. A LoRA run records it for its base (the trainer's
// lora.base item). Throws as WeightsFile::open and read_box.
std::string weights_content_hash(const std::string& path, std::shared_ptr<Storage> storage = nullptr,
                                 uint64_t slab_bytes = uint64_t{64} << 20);

}  // namespace checkpoint
