#pragma once
// What one rank contributes to (or takes from) a checkpoint: named pieces of
// global tensors and named byte strings. Torch-side; no communication.
//
// A tensor entry is this rank's box of a global tensor: `local` holds the
// region starting at `offsets` with sizes local.sizes(). Several ranks may hold
// the same box (replicas): it is written once. A bytes entry is a small opaque
// value (step, loader position, RNG state, config) held by one or more ranks;
// every holder must hold the same bytes.
//
// Ownership: a StateDict holds torch::Tensor handles, not copies; saving reads
// the caller's tensors and loading writes into them. Thread safety: none; use
// a StateDict from one thread at a time.
#include "checkpoint/format/types.h"

#include <torch/torch.h>

#include <string>
#include <unordered_set>
#include <vector>

namespace checkpoint {

struct TensorEntry {
  std::string name;
  torch::Tensor local;                // CPU or CUDA; filled in place by load
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;       // of `local` inside the global tensor
};

struct BytesEntry {
  std::string name;
  std::vector<uint8_t> data;          // replaced by what the checkpoint holds on load
};

class StateDict {
 public:
  // REQUIRES: names unique across tensors and bytes (checked); local on the
  // CPU or a CUDA device (save_state_dict / load_state_dict take host
  // tensors only; CheckpointManager stages GPU state through pinned buffers).
  // Names are fixed once added: the mutable accessors below are for the
  // entries' data, not their names.
  void add_tensor(std::string name, torch::Tensor local, std::vector<int64_t> global_shape,
                  std::vector<int64_t> offsets);
  // A whole tensor (unsharded; replicated if several ranks add it).
  void add_tensor(std::string name, torch::Tensor full);
  void add_bytes(std::string name, std::vector<uint8_t> data);

  std::vector<TensorEntry>& tensors() { return tensors_; }
  const std::vector<TensorEntry>& tensors() const { return tensors_; }
  std::vector<BytesEntry>& bytes() { return bytes_; }
  const std::vector<BytesEntry>& bytes() const { return bytes_; }
  TensorEntry* find_tensor(const std::string& name);
  BytesEntry* find_bytes(const std::string& name);
  // Sum of the logical bytes of all entries on this rank.
  uint64_t nbytes() const;

 private:
  void check_new_name(const std::string& name) const;
  std::vector<TensorEntry> tensors_;
  std::vector<BytesEntry> bytes_;
  std::unordered_set<std::string> names_;  // of all entries
};

// Throws naming the first item whose tensor is not on the CPU.
void require_host_tensors(const StateDict& state, const char* what);

DType to_dtype(c10::ScalarType t);         // throws for types the format lacks
c10::ScalarType to_scalar_type(DType t);

}  // namespace checkpoint
