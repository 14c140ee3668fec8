#include "checkpoint/async/staging.h"

#include <algorithm>
#include <stdexcept>

namespace checkpoint {

namespace {

// Copy engines reach full bandwidth on aligned buffers.
constexpr size_t kSlotAlignment = 256;

size_t align_up(size_t n) { return (n + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment; }

size_t tensor_bytes(const torch::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}

at::Device device_of(const StateDict& state) {
  for (const auto& t : state.tensors()) {
    if (t.local.is_cuda()) return t.local.device();
  }
  return at::Device(at::kCPU);
}

}  // namespace

HostStaging::HostStaging() = default;
HostStaging::~HostStaging() {
  // Copies in flight still write into the slab: let them finish first.
  if (stream_) stream_->synchronize();
}

bool HostStaging::has_device_tensors(const StateDict& state) {
  return device_of(state).is_cuda();
}

bool HostStaging::matches(const StateDict& state) const {
  if (!slab_ || slots_.size() != state.tensors().size()) return false;
  if (slab_->pinned() != (has_device_tensors(state) && comm::cuda_available())) {
    return false;
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    const auto& t = state.tensors()[i];
    if (slots_[i].name != t.name || slots_[i].dtype != t.local.scalar_type() ||
        slots_[i].sizes != t.local.sizes().vec()) {
      return false;
    }
  }
  return true;
}

void HostStaging::reserve(const StateDict& state) {
  if (matches(state)) return;
  if (stream_) stream_->synchronize();  // nothing may still copy into the old slab
  slots_.clear();
  size_t total = 0;
  for (const auto& t : state.tensors()) {
    Slot s;
    s.name = t.name;
    s.sizes = t.local.sizes().vec();
    s.dtype = t.local.scalar_type();
    s.offset = total;
    total += align_up(tensor_bytes(t.local));
    slots_.push_back(std::move(s));
  }
  slab_.reset();  // free the old slab before pinning a new one
  snapshot_ = torch::Tensor();
  slab_ = std::make_unique<comm::HostSlab>(total, has_device_tensors(state));
  for (Slot& s : slots_) s.host = slab_->view(s.offset, s.sizes, s.dtype);
}

comm::CopyStream& HostStaging::stream_for(const StateDict& state) {
  at::Device device = device_of(state);
  if (!stream_ || stream_->device() != device) {
    if (stream_) stream_->synchronize();
    stream_ = std::make_unique<comm::CopyStream>(device);
  }
  return *stream_;
}

StateDict HostStaging::stage(const StateDict& state) {
  reserve(state);
  comm::CopyStream& stream = stream_for(state);
  // The copies read the state as the compute stream leaves it.
  stream.begin();
  StateDict out;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const auto& t = state.tensors()[i];
    torch::Tensor& host = slots_[i].host;
    stream.copy(host, t.local.detach());
    out.add_tensor(t.name, host, t.global_shape, t.offsets);
  }
  stream.record();
  for (const auto& b : state.bytes()) out.add_bytes(b.name, b.data);
  return out;
}

void HostStaging::wait() {
  if (stream_) stream_->synchronize();
}

void HostStaging::to_device(StateDict& state, const StateDict& host) {
  comm::CopyStream& stream = stream_for(state);
  stream.begin();
  for (size_t i = 0; i < state.tensors().size(); ++i) {
    torch::Tensor dst = state.tensors()[i].local.detach();
    stream.copy(dst, host.tensors().at(i).local);
  }
  stream.record();
  // The compute stream must not use the state before it arrived, and the
  // host buffers must not be reused before the copies read them.
  stream.block_current_stream();
  stream.synchronize();
  for (const auto& b : host.bytes()) {
    if (BytesEntry* mine = state.find_bytes(b.name)) mine->data = b.data;
  }
}

bool HostStaging::snapshot_fits(const StateDict& state) const {
  if (!has_device_tensors(state)) return false;
  if (matches(state) && snapshot_.defined()) return true;
  uint64_t need = 0;
  for (const auto& t : state.tensors()) need += align_up(tensor_bytes(t.local));
  return comm::device_free_bytes(device_of(state)) >=
         static_cast<double>(need) + kSnapshotMarginBytes;
}

StateDict HostStaging::begin_overlap(const StateDict& state, bool snapshot) {
  reserve(state);
  comm::CopyStream& stream = stream_for(state);
  snapshot_taken_ = snapshot;
  if (snapshot) {
    const at::Device device = device_of(state);
    if (!snapshot_.defined() || snapshot_.device() != device) {
      snapshot_ = torch::Tensor();
      try {
        snapshot_ = torch::empty({static_cast<int64_t>(slab_->size())},
                                 torch::TensorOptions().dtype(torch::kByte).device(device));
      } catch (const c10::Error& e) {
        throw std::runtime_error("cannot allocate the " + std::to_string(slab_->size()) +
                                 " bytes of a device snapshot on " + device.str() + ": " +
                                 e.what_without_backtrace());
      }
    }
    // On the compute stream: whatever changes the state later runs after it.
    for (size_t i = 0; i < slots_.size(); ++i) {
      const torch::Tensor& src = state.tensors()[i].local;
      const int64_t n = static_cast<int64_t>(tensor_bytes(src));
      snapshot_.narrow(0, static_cast<int64_t>(slots_[i].offset), n)
          .view(src.scalar_type())
          .view(src.sizes())
          .copy_(src.detach());
    }
  }
  // The copies read the state (or the snapshot) as the compute stream leaves it.
  stream.begin();
  StateDict out;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const auto& t = state.tensors()[i];
    out.add_tensor(t.name, slots_[i].host, t.global_shape, t.offsets);
  }
  for (const auto& b : state.bytes()) out.add_bytes(b.name, b.data);
  return out;
}

void HostStaging::copy_to_host(const StateDict& state) {
  comm::CopyStream& stream = *stream_;
  // One chunk in flight: enqueue, mark, wait.
  auto chunk = [&](torch::Tensor dst, const torch::Tensor& src) {
    stream.copy(dst, src);
    stream.record();
    stream.synchronize();
  };
  if (snapshot_taken_) {
    torch::Tensor host = slab_->view(0, {static_cast<int64_t>(slab_->size())}, torch::kByte);
    const int64_t total = host.numel();
    const int64_t step = static_cast<int64_t>(kOverlapChunkBytes);
    for (int64_t at = 0; at < total; at += step) {
      const int64_t n = std::min(step, total - at);
      chunk(host.narrow(0, at, n), snapshot_.narrow(0, at, n));
    }
    return;
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    torch::Tensor src = state.tensors()[i].local.detach();
    torch::Tensor dst = slots_[i].host;
    if (!src.is_contiguous() || src.numel() == 0) {
      chunk(dst, src);
      continue;
    }
    src = src.view(-1);
    dst = dst.view(-1);
    const int64_t step = std::max<int64_t>(1, static_cast<int64_t>(kOverlapChunkBytes) / src.element_size());
    for (int64_t at = 0; at < src.numel(); at += step) {
      const int64_t n = std::min(step, src.numel() - at);
      chunk(dst.narrow(0, at, n), src.narrow(0, at, n));
    }
  }
}

uint64_t HostStaging::device_bytes() const {
  return snapshot_.defined() ? static_cast<uint64_t>(snapshot_.numel()) : 0;
}

uint64_t HostStaging::bytes() const { return slab_ ? slab_->size() : 0; }
bool HostStaging::pinned() const { return slab_ && slab_->pinned(); }

}  // namespace checkpoint
