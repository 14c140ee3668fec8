#pragma once
// FullyShardedModel's private parts, shared by its two source files
// (fully_shard.cpp: units, sharding and the forward hooks; fully_shard_
// schedule.cpp: gathers, reductions and gradients). Internal: not installed.
#include "framework/fsdp/fully_shard.h"

#include <chrono>
#include <string>
#include <vector>

namespace framework::fsdp {


// The parameter keeps its TensorImpl and StorageImpl (autograd's saved
// variables point at them); only the bytes behind the storage come and go.
inline void free_storage(const torch::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

// A parameter of a model built unmaterialised: its shape, no bytes yet.
inline bool unmaterialised(const torch::Tensor& p) { return p.numel() > 0 && p.storage().nbytes() == 0; }

inline void alloc_storage(const torch::Tensor& t, size_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

// A flat alias of the parameter's bytes that does not bump its autograd
// version counter (writing through the parameter itself would).
inline torch::Tensor raw_flat(const torch::Tensor& t) {
  return torch::from_blob(t.data_ptr(), {t.numel()}, t.options().requires_grad(false));
}

inline int64_t tensor_bytes(const torch::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// The mesh channels (DeviceMesh::create's `channels`): all-gathers, and
// everything else that is not a gradient reduction, on the axis's first
// group; reduce-scatters and the replicate axis's all-reduces on the second,
// so that an all-gather never queues behind a reduction in flight. On a
// mesh with one channel both are the same group.
constexpr int kGatherChannel = 0;
constexpr int kReduceChannel = 1;
constexpr size_t kNotInOrder = static_cast<size_t>(-1);

// work.wait(), adding the seconds it blocked to `total`.
inline void timed_wait(comm::Work& work, double& total) {
  if (!work.pending()) return;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    work.wait();
  } catch (...) {
    total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    throw;
  }
  total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct ParamSlot {
  size_t index = 0;         // position in the model's parameter order
  std::string name;
  torch::Tensor full;       // the module's parameter; storage only while gathered
  bool trainable = true;    // requires_grad
  int64_t rows = 0;         // global dim 0
  int64_t row_numel = 1;    // elements per dim-0 row
  dtensor::Span mine;       // this rank's rows
  size_t bucket = 0;        // the unit's flat buffer of this dtype and trainability
  int64_t seg_offset = 0;   // element offset inside a member's padded segment
  torch::Tensor local;      // the shard the optimizer owns
  // Tensor parallelism: `full` is this rank's part of global_shape, split
  // along tp_dim over the mesh's tensor axis (-1: whole on every TP rank).
  int64_t tp_dim = -1;
  // Whole on every TP rank, each rank's gradient a part (TensorParallelParam::sum_grads).
  bool tp_sum_grads = false;
  std::vector<int64_t> global_shape;
  // Expert parallelism: `full` is this rank's experts (rows of dim 0 of
  // global_shape), sharded over the expert-shard group only.
  bool expert = false;
};

// The parameters of one unit that share a dtype and trainability: one flat
// buffer, so one collective per gather and per reduction.
struct Bucket {
  torch::ScalarType dtype = torch::kFloat;
  bool trainable = true;
  bool expert = false;          // its members' rows are sharded over the expert-shard group
  std::vector<size_t> members;  // indices into Unit::params
  int64_t seg_numel = 0;        // padded elements per shard member in the flat buffers
  torch::Tensor grad_buffer;    // this rank's reduced gradients (keeps .grad views alive)
  // Gradients of the step's micro-batches that skipped the all-reduce over
  // the replicate axis (set_requires_gradient_sync(false)): summed here, in
  // the shards' dtype, and all-reduced once with the next synced backward.
  torch::Tensor unsynced;
  bool grad_views = false;  // DDP: the shards' .grad already view grad_buffer this step
};

struct FullyShardedModel::Unit {
  std::string name;
  size_t index = 0;          // in units_
  std::vector<ParamSlot> params;
  std::vector<Bucket> buckets;
  int64_t full_bytes = 0;
  size_t trainable = 0;      // parameters with requires_grad
  bool is_root = false;
  bool gathered = false;
  bool reduced = false;
  size_t grads_arrived = 0;
  // Reduced, but with frozen parameters its backward may still read them
  // (its input's gradient): freed when the next unit's backward begins.
  bool release_pending = false;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // kept alive
  // An all-gather issued ahead (prefetch): one per bucket, into gather_recv.
  bool gathering = false;
  std::vector<comm::Work> gather_work;
  std::vector<torch::Tensor> gather_recv;
};

// One bucket's share of a unit's gradient reduction.
struct FullyShardedModel::ReducePart {
  size_t bucket = 0;
  torch::Tensor send;   // the reduce-scatter's input (FSDP, HSDP), reduce_dtype
  torch::Tensor mine;   // its output: this rank's rows, reduce_dtype
  comm::Work rs;
  torch::Tensor grads;  // this backward's gradients of this rank, in the shards' dtype
  torch::Tensor wire;   // the replicate axis's all-reduce (DDP, HSDP), reduce_dtype
  comm::Work ar;
  bool sync = true;     // the backward that made it synced (set_requires_gradient_sync)
  bool parked = false;  // left in the bucket's unsynced sum
};

struct FullyShardedModel::Reduction {
  Unit* unit = nullptr;
  std::vector<ReducePart> parts;
  bool all_reduce = false;  // an all-reduce was issued for one of the parts
};

}  // namespace framework::fsdp
