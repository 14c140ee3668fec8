#pragma once
// Host staging of a state dict: one host copy of every tensor, in buffers
// that are allocated once (reserve) and reused by every later save.
//
// For state on a GPU the buffers are one page-locked slab (exactly the
// state's bytes plus alignment, never LibTorch's power-of-two rounding), and
// the copies run on a dedicated CUDA stream: stage() only enqueues them
// after the work already queued on the compute stream. The caller then
// either waits on the host (wait(): async mode) or makes the compute stream
// wait on the device (block_compute(): overlap mode, no host sync) before
// anything changes the state, and wait()s before reading the host copy.
// For host state stage() copies at once (memcpy) and the waits are no-ops.
//
// Call sequence (training thread): reserve(state) [optional, ahead of time];
// stage(state); then wait() or block_compute(); wait() again from any
// thread before the host copy is read. The next stage() REQUIRES the
// previous host copy is no longer being read.
#include "checkpoint/state_dict.h"
#include "dist/device.h"

#include <memory>
#include <string>
#include <vector>

namespace checkpoint {

class HostStaging {
 public:
  HostStaging();
  ~HostStaging();

  // Allocates host buffers matching the tensors of `state` (names, sizes,
  // dtypes). Keeps the current ones when they already match. Pinned when any
  // tensor is on a CUDA device.
  void reserve(const StateDict& state);
  // Starts copying `state`'s tensors into the host buffers (reserving first
  // if the layout changed) and returns a StateDict over those buffers, with
  // `state`'s bytes entries copied. See the header comment for the waits.
  StateDict stage(const StateDict& state);
  // Host waits until the copies of the last stage() (or to_device()) are done.
  void wait();
  // The current CUDA stream waits for those copies (no host sync).
  void block_compute();
  // Copies every tensor of `host` (as laid out by stage) back into `state`,
  // host to device through the copy stream, then waits for it.
  void to_device(StateDict& state, const StateDict& host);

  uint64_t bytes() const;       // host memory held for staging
  bool pinned() const;
  bool reserved() const { return slab_ != nullptr; }

  // True when any tensor of `state` lives on a GPU.
  static bool has_device_tensors(const StateDict& state);

 private:
  struct Slot {
    std::string name;
    std::vector<int64_t> sizes;
    c10::ScalarType dtype;
    size_t offset = 0;
    torch::Tensor host;  // view into slab_
  };
  bool matches(const StateDict& state) const;
  framework::dist::CopyStream& stream_for(const StateDict& state);

  std::unique_ptr<framework::dist::HostSlab> slab_;
  std::vector<Slot> slots_;
  std::unique_ptr<framework::dist::CopyStream> stream_;
};

}  // namespace checkpoint
