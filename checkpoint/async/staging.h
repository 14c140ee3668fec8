#pragma once
// Host staging of a state dict: one host copy of every tensor, in buffers
// that are allocated once (reserve) and reused by every later save.
//
// For state on a GPU the buffers are one page-locked slab (exactly the
// state's bytes plus alignment, never LibTorch's power-of-two rounding), and
// the copies run on a dedicated CUDA stream: stage() only enqueues them
// after the work already queued on the compute stream, and the caller waits
// on the host (wait()) before anything changes the state or reads the host
// copy. For host state stage() copies at once (memcpy) and wait() is a no-op.
//
// Call sequence (training thread): reserve(state) [optional, ahead of time];
// stage(state); wait(). The next stage() REQUIRES the previous host copy is
// no longer being read.
//
// Overlap mode on a GPU splits the staging between two threads instead:
// begin_overlap(state, snapshot) on the training thread, copy_to_host(state)
// on the writer thread. The device-to-host copy then goes in chunks of at
// most kOverlapChunkBytes with one in flight, so a small device-to-host copy
// the training step makes meanwhile (its loss read) waits for at most one
// chunk, not for the whole state (on an H100, 12.4 GiB held the next step's
// loss read for 0.25 s). With a snapshot, begin_overlap first copies the state
// into a device buffer (allocated once, reused) on the compute stream, so the
// optimizer may change the state at once; without one the state must stay
// unchanged until copy_to_host() returned.
#include "checkpoint/state_dict.h"
#include "comm/device.h"

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
  // Copies every tensor of `host` (as laid out by stage) back into `state`,
  // host to device through the copy stream, then waits for it.
  void to_device(StateDict& state, const StateDict& host);

  // Overlap on a GPU (see the header comment). (training thread) Reserves,
  // snapshots `state` on the device when `snapshot`, and orders the copy
  // stream after the compute stream's work so far. Returns a StateDict over
  // the host buffers, filled once copy_to_host() returned. Throws
  // std::runtime_error naming the bytes when the snapshot cannot be allocated.
  StateDict begin_overlap(const StateDict& state, bool snapshot);
  // (writer thread) Copies the snapshot (or, without one, `state`) into the
  // host buffers in chunks, one in flight, and returns when all arrived.
  void copy_to_host(const StateDict& state);
  // Whether a device snapshot of `state` is held already, or fits in the
  // device memory nobody holds with kSnapshotMarginBytes to spare.
  bool snapshot_fits(const StateDict& state) const;
  static constexpr size_t kOverlapChunkBytes = size_t{64} << 20;
  static constexpr double kSnapshotMarginBytes = 2.0 * (1 << 30);

  uint64_t bytes() const;       // host memory held for staging
  uint64_t device_bytes() const;  // device memory held for snapshots
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
  comm::CopyStream& stream_for(const StateDict& state);

  std::unique_ptr<comm::HostSlab> slab_;
  std::vector<Slot> slots_;
  std::unique_ptr<comm::CopyStream> stream_;
  torch::Tensor snapshot_;  // bytes on the device, laid out as slab_; undefined: none
  bool snapshot_taken_ = false;  // the last begin_overlap() took a snapshot
};

}  // namespace checkpoint
