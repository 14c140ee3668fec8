#include "checkpoint/async/staging.h"

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
  if (slab_->pinned() != (has_device_tensors(state) && framework::dist::cuda_available())) {
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
  slab_ = std::make_unique<framework::dist::HostSlab>(total, has_device_tensors(state));
  for (Slot& s : slots_) s.host = slab_->view(s.offset, s.sizes, s.dtype);
}

framework::dist::CopyStream& HostStaging::stream_for(const StateDict& state) {
  at::Device device = device_of(state);
  if (!stream_ || stream_->device() != device) {
    if (stream_) stream_->synchronize();
    stream_ = std::make_unique<framework::dist::CopyStream>(device);
  }
  return *stream_;
}

StateDict HostStaging::stage(const StateDict& state) {
  reserve(state);
  framework::dist::CopyStream& stream = stream_for(state);
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

void HostStaging::block_compute() {
  if (stream_) stream_->block_current_stream();
}

void HostStaging::to_device(StateDict& state, const StateDict& host) {
  framework::dist::CopyStream& stream = stream_for(state);
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

uint64_t HostStaging::bytes() const { return slab_ ? slab_->size() : 0; }
bool HostStaging::pinned() const { return slab_ && slab_->pinned(); }

}  // namespace checkpoint
