#pragma once
// The part of Python's pickle that torch.save uses for a flat dict of tensors
// (the `data.pkl` member of its zip archive). Torch-free.
//
// Writing produces what Python's torch.save (protocol 2) writes for a plain
// dict of contiguous tensors, using only what torch.load(weights_only=True)
// accepts: GLOBAL torch._utils._rebuild_tensor_v2, torch.<T>Storage and
// collections.OrderedDict, with storages as persistent ids
// ('storage', torch.<T>Storage, key, 'cpu', numel) whose bytes are the zip
// member `<archive>/data/<key>`.
//
// Reading is a restricted interpreter, never Python's: it knows exactly the
// opcodes and globals such files contain (dicts, OrderedDicts with their
// `_metadata` state, tensors and parameters, storages) and rejects anything
// else naming the opcode or global. It executes nothing.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/format/types.h"

namespace checkpoint {

// One entry of the dict: a tensor viewing a storage.
struct PickledTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;   // contiguous (row-major) after parsing
  int64_t storage_offset = 0;    // in elements
  std::string storage_key;       // the member <archive>/data/<key>
  uint64_t storage_numel = 0;    // elements in the storage
};

// The storage class torch.save names for `dtype` ("FloatStorage", ...).
const char* storage_type_name(DType dtype);

// Parses `data.pkl` of a torch.save file holding a dict (or OrderedDict) of
// tensors. Checks every tensor is contiguous and lies within its storage.
// Throws FormatError naming `source` and, where it applies, the opcode and its
// offset, the global, or the dict entry.
std::vector<PickledTensor> parse_tensor_dict_pickle(const uint8_t* data, size_t size,
                                                    const std::string& source);

// Parses `data.pkl` of a torch.save file holding one tensor (what DCP writes
// for each tensor chunk); the result is named `name`. Same checks and errors
// as parse_tensor_dict_pickle.
PickledTensor parse_tensor_pickle(const uint8_t* data, size_t size, const std::string& source,
                                  const std::string& name);

// Pickles a plain dict name -> tensor as torch.save does, in the given order.
// `stride` and `storage_offset` of each entry are ignored: tensors are written
// contiguous at offset 0 of their own storage of storage_numel elements.
std::vector<uint8_t> write_tensor_dict_pickle(const std::vector<PickledTensor>& tensors);

// Pickles one tensor as torch.save(tensor) does (a DCP chunk's data.pkl).
std::vector<uint8_t> write_tensor_pickle(const PickledTensor& tensor);

// Contiguous (row-major) strides of `shape`, as torch computes them (a dim of
// size 0 counts as 1).
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape);

}  // namespace checkpoint
