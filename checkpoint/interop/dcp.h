#pragma once
// Reading checkpoints that PyTorch's torch.distributed.checkpoint (DCP)
// wrote with its FileSystemWriter (torchtitan's step-N/ folders too).
// Torch-free.
//
// A DCP checkpoint directory holds `.metadata`, a Python pickle of
// torch.distributed.checkpoint.metadata.Metadata (written last), and data
// files `__<rank>_<n>.distcp`. Each item (a tensor chunk, or a non-tensor
// value) is a complete torch.save zip archive at the (offset, length) that
// the metadata's storage_data records; tensor chunks are boxes of the
// item's global shape, as DTensor shards are. Formats read: what torch 2.6
// writes (pickle protocol 2 to 5, TensorProperties as its 5-tuple state,
// storage_meta, planner_data), and what later versions add (a `version`
// field, StorageMeta.modules); _StorageInfo.transform_descriptors (the
// stream extensions of newer versions, e.g. zstd) is refused by name.
//
// Everything read is untrusted. `.metadata` is read by a restricted pickle
// interpreter that executes nothing and admits only the globals such files
// contain (the metadata classes, torch.Size, torch dtypes, the layout and
// memory-format helpers, pathlib paths); any other global, opcode or shape
// of data is an error naming the file, the pickle offset and the global.
// Chunk boxes are checked against the global shape, every chunk must have
// its storage entry, and each archive is checked against its chunk (dtype,
// shape, member sizes within the recorded length) when it is opened.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/format/types.h"
#include "checkpoint/storage/storage.h"

namespace checkpoint {

// Where one item's torch.save archive lies.
struct DcpLocation {
  std::string file;     // relative to the checkpoint directory (a plain file name)
  uint64_t offset = 0;  // byte offset of the archive in `file`
  uint64_t length = 0;  // its length
};

struct DcpChunk {
  Box box;  // region of the tensor, global coordinates
  DcpLocation location;
};

struct DcpTensorItem {
  std::string fqn;  // flattened key, e.g. "model.layers.0.attention.wq.weight"
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;  // global
  std::vector<DcpChunk> chunks;
};

// A non-tensor value (a torch.save'd Python object: lr, betas, a list of
// names, pickled loader state). Listed, not interpreted.
struct DcpBytesItem {
  std::string fqn;
  DcpLocation location;
};

struct DcpMetadata {
  std::vector<DcpTensorItem> tensors;  // in the metadata's order
  std::vector<DcpBytesItem> bytes;
  std::string version;  // Metadata.version (newer writers); empty for torch 2.6
};

// True when `dir` holds a `.metadata` file that starts like a pickle (so it
// is DCP's, not ours).
bool is_dcp_checkpoint(Storage& storage, const std::string& dir);

// Reads and validates `dir`/.metadata (at most 1 GiB). Throws FormatError
// naming the file and what is wrong, IoError when it cannot be read.
DcpMetadata read_dcp_metadata(Storage& storage, const std::string& dir);
// The same from bytes; `source` names them in errors (tests, fuzzing).
DcpMetadata parse_dcp_metadata(const uint8_t* data, size_t size, const std::string& source);

// Pickles `meta` as DCP's .metadata (protocol 2, no memo, which torch 2.6
// and later read): Metadata with state_dict_metadata, planner_data (each
// key's path: "model.<fqn>" -> ("model", "<fqn>"), else the key alone),
// storage_data and storage_meta None. Chunks' MetadataIndex.index is their
// position in their item's chunk list.
std::vector<uint8_t> write_dcp_metadata(const DcpMetadata& meta);

// Opens the torch.save archive of `chunk` of `item` and returns the absolute
// offset in `dir`/<file> of the chunk's row-major tensor bytes
// (numel(box) * element_size(dtype) of them). Reads the archive's
// directory, data.pkl and local header only. Throws FormatError naming the
// file, the item and the archive offset when the archive is not a
// torch.save of one contiguous tensor of the chunk's dtype and shape, or
// reaches past its recorded length or the file's end.
uint64_t dcp_chunk_data_offset(Storage& storage, const std::string& dir, const DcpTensorItem& item,
                               const DcpChunk& chunk);

// Reads the row-major bytes of `box` (global coordinates) of `item` into
// dst (numel(box) * element size bytes), from every chunk it overlaps,
// reading only those ranges (and each overlapped archive's directory).
// Throws FormatError for a box outside the item, and as
// dcp_chunk_data_offset does.
void read_dcp_box(Storage& storage, const std::string& dir, const DcpTensorItem& item,
                  const Box& box, uint8_t* dst);

// A one-element item as an integer step (AdamW's float32 step,
// torchtitan's int32 train_state.step; float64 and int64 too). Throws
// FormatError naming `dir` and the item for any other shape or dtype, and
// as read_dcp_box does.
int64_t read_dcp_step(Storage& storage, const std::string& dir, const DcpTensorItem& item);

// The model parameter name of a DCP key, as model.init_from sees it:
// "model.<name>" -> "<name>" (DCP's get_state_dict layout); keys under
// "optim.", "optimizer.", "lr_scheduler.", "dataloader.", "train_state.",
// "extra." -> "" (not model state); any other key -> itself (torchtitan's
// newer layout saves the model at the top level).
std::string dcp_model_name(const std::string& fqn);

// "from=to": a DCP key starting with `from` has it replaced by `to` before
// the default mapping (e.g. "module.=model." for a DDP-wrapped model).
using DcpRename = std::pair<std::string, std::string>;

// The shardkit name of DCP key `fqn` after `renames` (first match wins), by
// the default mapping (import_dcp.h lists it): "model.<fqn>" and bare
// "<fqn>" -> "model.<fqn>", "optim.state.<fqn>.<x>" and
// "optimizer.state.<fqn>.<x>" -> "optim.<fqn>.<x>"; "" for keys that are not
// model or optimizer state (param groups, scheduler, loader, train state).
std::string dcp_to_shardkit_name(const std::string& fqn, const std::vector<DcpRename>& renames = {});

struct DcpImportOptions {
  std::vector<DcpRename> renames;
  int io_threads = 4;
  uint64_t slab_bytes = uint64_t{64} << 20;  // most bytes of one imported chunk
  std::shared_ptr<Storage> storage;          // null: the POSIX file system
  // The 8-byte integer item that records the imported step for the run
  // that resumes from it (the trainer's: framework/config/run_items.h);
  // empty: none.
  std::string step_item;
};

struct DcpImportStats {
  int64_t step = 0;                  // train_state.step, else the largest AdamW step, else 0
  uint64_t tensors = 0;              // items written (tensors and AdamW steps)
  uint64_t bytes = 0;                // logical bytes written
  std::vector<std::string> ignored;  // DCP keys not carried
};

// `ckpt import-dcp`: converts the DCP checkpoint `src` into a committed
// shardkit checkpoint `step_dir` (created; it must not exist), streaming:
// each DCP chunk is copied as one or more chunks of at most slab_bytes
// (dim-0 slabs), so memory stays bounded whatever the model size, and the
// result reshards like any checkpoint. Items: the mapped model and AdamW
// moment tensors, optim.<fqn>.step and options.step_item as 8-byte integers; the
// metadata (written last, the commit) records the step and
// info["imported_from"] = "pytorch-dcp". Throws FormatError naming the
// checkpoint and key for two keys mapping to one name or unreadable input,
// IoError for I/O; a failed import removes what it wrote.
DcpImportStats import_dcp_checkpoint(const std::string& src, const std::string& step_dir,
                                     const DcpImportOptions& options);

}  // namespace checkpoint
