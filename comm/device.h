#pragma once
// Devices and host<->device copies: the one place that knows CUDA.
//
// Everything here works in every build. Without CUDA (SHARDKIT_CUDA off, or no
// device present) cuda_available() is false, HostSlab is ordinary memory and
// CopyStream copies synchronously, so callers need no #ifdefs.
//
// Thread safety: HostSlab is a plain buffer. A CopyStream is used by one
// thread at a time, except synchronize()/query(), which any thread may call
// after record() returned.
#include <ATen/ATen.h>

#include <cstddef>
#include <string>

#include "comm/options.h"

namespace comm {

bool cuda_available();  // built with CUDA and at least one device present
int cuda_device_count();
// The device of this process for train.device: CUDA device
// local_rank % count, made current for this thread and the process's later
// CUDA work. Throws std::invalid_argument naming train.device when CUDA is
// asked for but unavailable (no CUDA build, or no device).
at::Device select_device(DeviceKind kind, int local_rank);
// Makes `device` current on the calling thread (no-op for CPU).
void set_current_device(const at::Device& device);
// Reproducible CUDA kernels: deterministic algorithms (cuBLAS workspace
// config set if the user did not). REQUIRES: called before the first cuBLAS
// call. false: PyTorch's default kernels again (train.deterministic: false).
// No-op without CUDA.
void use_deterministic_cuda(bool on = true);
// Peak bytes LibTorch's CUDA caching allocator has given to tensors on
// `device` since the process started; 0 for the CPU or without CUDA.
double peak_device_memory_bytes(const at::Device& device);

// CUDA memory snapshots (profile.memory_snapshot). record_cuda_memory_history
// starts (or stops) recording LibTorch's caching allocator's history: every
// allocation and free with its stack, the last `max_entries` (LibTorch 2.x;
// 1.13 keeps only the live blocks' stacks). cuda_memory_snapshot_pickle is
// what torch.cuda.memory._dump_snapshot writes: the allocator's segments and
// the recorded trace, pickled, which PyTorch's memory_viz opens. Both throw
// std::logic_error without CUDA.
void record_cuda_memory_history(bool on, size_t max_entries = 100000);
std::string cuda_memory_snapshot_pickle();

// Total memory of CUDA device local_rank % count (its properties; creates no
// context), or 0 without CUDA or devices.
double cuda_device_total_bytes(int local_rank);

// The name of CUDA device `device` ("NVIDIA H100 80GB HBM3"), or "" for
// the CPU or without CUDA.
std::string cuda_device_name(const at::Device& device);
// Device memory that neither LibTorch's caching allocator nor anyone else
// holds on `device` (cudaMemGetInfo's free bytes); 0 for the CPU or without
// CUDA. Memory the caching allocator keeps cached for reuse is not counted.
double device_free_bytes(const at::Device& device);

// Host waits for all work queued on `device` (no-op for CPU).
void synchronize(const at::Device& device);

// One host allocation, page-locked when `pinned` (cudaHostAlloc) so copies
// to and from the GPU run at full bandwidth and asynchronously. Exactly
// `bytes` are allocated (LibTorch's caching host allocator rounds up to a
// power of two, up to 2x). Falls back to ordinary memory without CUDA.
class HostSlab {
 public:
  HostSlab(size_t bytes, bool pinned);
  ~HostSlab();
  HostSlab(const HostSlab&) = delete;
  HostSlab& operator=(const HostSlab&) = delete;
  void* data() const { return data_; }
  size_t size() const { return size_; }
  bool pinned() const { return pinned_; }
  // A tensor viewing [offset, offset + numel * itemsize) of the slab.
  // REQUIRES: in bounds; the slab outlives the tensor.
  at::Tensor view(size_t offset, at::IntArrayRef sizes, at::ScalarType dtype) const;

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  bool pinned_ = false;
};

// A dedicated copy stream and a completion mark on one CUDA device, for
// staging device state to the host (and back) without stalling the compute
// stream. For a CPU device every call copies synchronously.
//
// Call sequence: begin() (training thread) orders the copy stream after the
// work queued so far on the current (compute) stream; copy() enqueues copies;
// record() marks them; synchronize() waits for the mark on the host, and
// block_current_stream() makes the calling thread's compute stream wait for
// it on the device. Async mode does all of it on the training thread;
// overlap mode's writer thread does copy(), record() and synchronize() per
// chunk after the training thread's begin() (checkpoint/async/staging.h).
class CopyStream {
 public:
  explicit CopyStream(at::Device device);
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  const at::Device& device() const { return device_; }
  void begin();
  // dst.copy_(src) on the copy stream; asynchronous when the host side is
  // pinned. The caller keeps both alive and unchanged until the mark passed.
  void copy(at::Tensor& dst, const at::Tensor& src);
  void record();
  void synchronize();
  void block_current_stream();
  bool query();  // true once the recorded mark has passed

 private:
  struct Impl;
  at::Device device_;
  Impl* impl_ = nullptr;
};

}  // namespace comm
