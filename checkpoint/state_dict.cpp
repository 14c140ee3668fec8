#include "checkpoint/state_dict.h"

#include <stdexcept>

namespace checkpoint {

void require_host_tensors(const StateDict& state, const char* what) {
  for (const auto& t : state.tensors()) {
    TORCH_CHECK(t.local.device().is_cpu(), what, ": item ", t.name, " is on ", t.local.device(),
                "; stage GPU state to the host first (CheckpointManager does, through pinned "
                "buffers; or HostStaging)");
  }
}

void StateDict::check_new_name(const std::string& name) const {
  TORCH_CHECK(!name.empty(), "StateDict: empty item name");
  TORCH_CHECK(names_.count(name) == 0, "StateDict: duplicate item ", name);
}

void StateDict::add_tensor(std::string name, torch::Tensor local, std::vector<int64_t> global_shape,
                           std::vector<int64_t> offsets) {
  check_new_name(name);
  TORCH_CHECK(local.device().is_cpu() || local.device().is_cuda(), "StateDict: item ", name,
              " is on ", local.device(), "; only CPU and CUDA tensors are supported");
  TORCH_CHECK(static_cast<size_t>(local.dim()) == global_shape.size() &&
                  offsets.size() == global_shape.size(),
              "StateDict: item ", name, " has rank ", local.dim(), " but global shape ",
              global_shape.size(), " and offsets ", offsets.size());
  for (size_t d = 0; d < global_shape.size(); ++d) {
    TORCH_CHECK(offsets[d] >= 0 && offsets[d] + local.size(d) <= global_shape[d], "StateDict: item ",
                name, " dim ", d, ": box [", offsets[d], ", ", offsets[d] + local.size(d),
                ") outside the global size ", global_shape[d]);
  }
  to_dtype(local.scalar_type());  // rejects unsupported types early
  names_.insert(name);
  tensors_.push_back({std::move(name), std::move(local), std::move(global_shape), std::move(offsets)});
}

void StateDict::add_tensor(std::string name, torch::Tensor full) {
  auto shape = full.sizes().vec();
  add_tensor(std::move(name), std::move(full), shape, std::vector<int64_t>(shape.size(), 0));
}

void StateDict::add_bytes(std::string name, std::vector<uint8_t> data) {
  check_new_name(name);
  names_.insert(name);
  bytes_.push_back({std::move(name), std::move(data)});
}

TensorEntry* StateDict::find_tensor(const std::string& name) {
  for (auto& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

BytesEntry* StateDict::find_bytes(const std::string& name) {
  for (auto& b : bytes_) {
    if (b.name == name) return &b;
  }
  return nullptr;
}

uint64_t StateDict::nbytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors_) n += static_cast<uint64_t>(t.local.numel()) * t.local.element_size();
  for (const auto& b : bytes_) n += b.data.size();
  return n;
}

DType to_dtype(c10::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return DType::kFloat32;
    case torch::kFloat64: return DType::kFloat64;
    case torch::kFloat16: return DType::kFloat16;
    case torch::kBFloat16: return DType::kBFloat16;
    case torch::kInt64: return DType::kInt64;
    case torch::kInt32: return DType::kInt32;
    case torch::kInt16: return DType::kInt16;
    case torch::kInt8: return DType::kInt8;
    case torch::kUInt8: return DType::kUInt8;
    case torch::kBool: return DType::kBool;
    default: TORCH_CHECK(false, "checkpoint: unsupported dtype ", t);
  }
}

c10::ScalarType to_scalar_type(DType t) {
  switch (t) {
    case DType::kFloat32: return torch::kFloat32;
    case DType::kFloat64: return torch::kFloat64;
    case DType::kFloat16: return torch::kFloat16;
    case DType::kBFloat16: return torch::kBFloat16;
    case DType::kInt64: return torch::kInt64;
    case DType::kInt32: return torch::kInt32;
    case DType::kInt16: return torch::kInt16;
    case DType::kInt8: return torch::kInt8;
    case DType::kUInt8: return torch::kUInt8;
    case DType::kBool: return torch::kBool;
  }
  TORCH_CHECK(false, "checkpoint: unknown dtype code ", static_cast<int>(t));
}

}  // namespace checkpoint
