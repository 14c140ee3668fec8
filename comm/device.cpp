#include "comm/device.h"

#include <torch/cuda.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#ifdef SHARDKIT_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "comm/torch_compat.h"
#endif

namespace comm {

#ifdef SHARDKIT_CUDA
namespace {
void check_cuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error state
    throw std::runtime_error(what + ": " + cudaGetErrorString(err));
  }
}
}  // namespace
#endif

bool cuda_available() {
#ifdef SHARDKIT_CUDA
  return cuda_device_count() > 0;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef SHARDKIT_CUDA
  return static_cast<int>(torch::cuda::device_count());
#else
  return 0;
#endif
}

double peak_device_memory_bytes(const at::Device& device) {
#ifdef SHARDKIT_CUDA
  if (device.is_cuda()) {
    // allocated_bytes[0]: the aggregate over pool types, in every LibTorch.
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return static_cast<double>(stats.allocated_bytes[0].peak);
  }
#endif
  (void)device;
  return 0;
}

void record_cuda_memory_history(bool on, size_t max_entries) {
#ifdef SHARDKIT_CUDA
  compat::record_cuda_memory_history(on, max_entries);
#else
  (void)on;
  (void)max_entries;
  throw std::logic_error("CUDA memory history: this build has no CUDA (SHARDKIT_CUDA off)");
#endif
}

std::string cuda_memory_snapshot_pickle() {
#ifdef SHARDKIT_CUDA
  return torch::cuda::_memory_snapshot_pickled();
#else
  throw std::logic_error("CUDA memory snapshot: this build has no CUDA (SHARDKIT_CUDA off)");
#endif
}

double cuda_device_total_bytes(int local_rank) {
#ifdef SHARDKIT_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return 0;
  }
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, local_rank % count), "cudaGetDeviceProperties");
  return static_cast<double>(prop.totalGlobalMem);
#else
  (void)local_rank;
  return 0;
#endif
}

std::string cuda_device_name(const at::Device& device) {
#ifdef SHARDKIT_CUDA
  if (device.is_cuda()) {
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, device.index() < 0 ? c10::cuda::current_device() : device.index()),
               "cudaGetDeviceProperties");
    return prop.name;
  }
#endif
  (void)device;
  return "";
}

double device_free_bytes(const at::Device& device) {
#ifdef SHARDKIT_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    size_t free = 0;
    size_t total = 0;
    check_cuda(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return static_cast<double>(free);
  }
#endif
  (void)device;
  return 0;
}

at::Device select_device(DeviceKind kind, int local_rank) {
  if (kind == DeviceKind::kCpu) return at::Device(at::kCPU);
#ifndef SHARDKIT_CUDA
  (void)local_rank;
  throw std::invalid_argument(
      "train.device: cuda, but this build has no CUDA (built against a LibTorch without CUDA); "
      "build with a CUDA LibTorch (scripts/gpu-build) or use train.device: cpu");
#else
  const int count = cuda_device_count();
  if (count == 0) {
    throw std::invalid_argument("train.device: cuda, but no CUDA device is visible to this process");
  }
  at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(local_rank % count));
  set_current_device(device);
  return device;
#endif
}

void set_current_device(const at::Device& device) {
#ifdef SHARDKIT_CUDA
  if (device.is_cuda()) c10::cuda::set_device(device.index());
#else
  (void)device;
#endif
}

void use_deterministic_cuda(bool on) {
#ifdef SHARDKIT_CUDA
  if (!on) {
    at::globalContext().setDeterministicAlgorithms(false, /*warn_only=*/false);
    return;
  }
  // cuBLAS is reproducible only with a fixed workspace configuration.
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  // warn_only: an op without a deterministic kernel warns instead of failing.
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
#else
  (void)on;
#endif
}

void synchronize(const at::Device& device) {
#ifdef SHARDKIT_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
#else
  (void)device;
#endif
}

HostSlab::HostSlab(size_t bytes, bool pinned) : size_(bytes) {
  if (bytes == 0) return;
#ifdef SHARDKIT_CUDA
  if (pinned && cuda_available()) {
    check_cuda(cudaHostAlloc(&data_, bytes, cudaHostAllocDefault),
               "cannot allocate " + std::to_string(bytes) + " bytes of pinned host memory");
    pinned_ = true;
    return;
  }
#else
  (void)pinned;
#endif
  if (posix_memalign(&data_, 4096, bytes) != 0) {
    data_ = nullptr;
    throw std::bad_alloc();
  }
}

HostSlab::~HostSlab() {
  if (data_ == nullptr) return;
#ifdef SHARDKIT_CUDA
  if (pinned_) {
    cudaFreeHost(data_);
    return;
  }
#endif
  std::free(data_);
}

at::Tensor HostSlab::view(size_t offset, at::IntArrayRef sizes, at::ScalarType dtype) const {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t nbytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  TORCH_INTERNAL_ASSERT(offset + nbytes <= size_, "HostSlab::view out of bounds");
  return at::from_blob(static_cast<char*>(data_) + offset, sizes,
                       at::TensorOptions().dtype(dtype).device(at::kCPU));
}

#ifdef SHARDKIT_CUDA
struct CopyStream::Impl {
  c10::cuda::CUDAStream stream;
  at::cuda::CUDAEvent ready;  // the compute stream's work before the copies
  at::cuda::CUDAEvent done;   // the copies
  bool recorded = false;
  explicit Impl(c10::DeviceIndex index)
      : stream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)) {}
};
#else
struct CopyStream::Impl {};
#endif

CopyStream::CopyStream(at::Device device) : device_(device) {
#ifdef SHARDKIT_CUDA
  if (device_.is_cuda()) impl_ = new Impl(device_.index());
#endif
}

CopyStream::~CopyStream() {
#ifdef SHARDKIT_CUDA
  if (impl_ != nullptr) {
    try {
      if (impl_->recorded) impl_->done.synchronize();  // no copy outlives its buffers
    } catch (...) {
    }
  }
#endif
  delete impl_;
}

void CopyStream::begin() {
#ifdef SHARDKIT_CUDA
  if (impl_ == nullptr) return;
  impl_->ready.record(c10::cuda::getCurrentCUDAStream(device_.index()));
  impl_->ready.block(impl_->stream);
#endif
}

void CopyStream::copy(at::Tensor& dst, const at::Tensor& src) {
#ifdef SHARDKIT_CUDA
  if (impl_ != nullptr) {
    c10::cuda::CUDAStreamGuard guard(impl_->stream);
    // The copy stream reads (or writes) device memory that the caching
    // allocator associates with the compute stream: tell it, so that memory
    // is not handed out again before the copy finished.
    const at::Tensor* dev = src.is_cuda() ? &src : dst.is_cuda() ? &dst : nullptr;
    if (dev != nullptr) {
      c10::cuda::CUDACachingAllocator::recordStream(dev->storage().data_ptr(), impl_->stream);
    }
    dst.copy_(src, /*non_blocking=*/true);
    return;
  }
#endif
  dst.copy_(src);
}

void CopyStream::record() {
#ifdef SHARDKIT_CUDA
  if (impl_ == nullptr) return;
  impl_->done.record(impl_->stream);
  impl_->recorded = true;
#endif
}

void CopyStream::synchronize() {
#ifdef SHARDKIT_CUDA
  if (impl_ != nullptr && impl_->recorded) impl_->done.synchronize();
#endif
}

void CopyStream::block_current_stream() {
#ifdef SHARDKIT_CUDA
  if (impl_ != nullptr && impl_->recorded) {
    impl_->done.block(c10::cuda::getCurrentCUDAStream(device_.index()));
  }
#endif
}

bool CopyStream::query() {
#ifdef SHARDKIT_CUDA
  if (impl_ != nullptr && impl_->recorded) return impl_->done.query();
#endif
  return true;
}

}  // namespace comm
