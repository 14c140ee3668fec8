#pragma once
// comm::Group: the project's process group. It wraps one c10d
// backend (Gloo, or NCCL in CUDA builds), names itself in every error, turns
// a dead or stuck peer into a DistError after the group timeout, and provides
// the collectives Gloo lacks on LibTorch 1.13 (flat all-gather,
// reduce-scatter, AVG) with exact results.
//
// Thread safety: a Group is used from one thread at a time. The training
// group belongs to the training loop; the checkpoint group to the checkpoint
// thread. Two groups may run collectives concurrently from two threads.
// All members must call the same collectives in the same order.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace comm {

// A collective failed: timeout, dead peer, or an earlier failure left the
// group unusable. The message names the group, the operation and the rank.
class DistError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class ReduceOp { kSum, kAvg, kMax, kMin };

// e.what(), without the C++ backtrace a c10::Error carries (users see the
// message, not stack frames).
std::string error_message(const std::exception& e);

using Bytes = std::vector<uint8_t>;

class Group;

// A collective in flight, from one of Group's *_async forms. wait() returns
// once it finished and its result is in place (in the tensors the call was
// given), and turns a failure into the same DistError as the blocking form,
// breaking the group. Gloo runs the collective on the group's own threads;
// NCCL on the communicator's stream, and wait() makes the current CUDA
// stream wait for it (an event, not the host), so the host goes on. A Work
// that goes out of scope unwaited is waited for then (its error, if any,
// left in the group). The group must outlive its works; members issue the
// group's collectives in the same order, and may wait for them in any order.
class Work {
 public:
  Work();  // nothing in flight: wait() returns at once
  Work(Work&&) noexcept;
  Work& operator=(Work&&) noexcept;
  ~Work();
  void wait();
  bool pending() const { return state_ != nullptr; }

  struct State;  // process_group.cpp

 private:
  friend class Group;
  explicit Work(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

class Group {
 public:
  struct Backend;  // opaque; defined next to the c10d compat code

  // `ranks[i]` is the global rank of member i; `rank` is this process's index.
  Group(std::string name, int rank, std::vector<int> ranks,
        std::unique_ptr<Backend> backend, std::chrono::milliseconds timeout);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<int>& global_ranks() const { return ranks_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  std::string backend_name() const;
  // NCCL: collectives run on CUDA tensors (host tensors are staged through
  // the current device). Gloo: on host tensors (CUDA tensors are staged
  // through host copies). Either way callers may pass tensors of any device.
  bool backend_is_cuda() const;

  // In place on every member.
  void all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // out = concat over members of `in` (flattened). REQUIRES: out contiguous,
  // out.numel() == size() * in.numel(), same dtype.
  void all_gather(at::Tensor& out, const at::Tensor& in);
  // out = reduction over members of slice rank() of `in` (flattened).
  // REQUIRES: in.numel() == size() * out.numel(), same dtype.
  void reduce_scatter(at::Tensor& out, const at::Tensor& in, ReduceOp op = ReduceOp::kSum);
  void broadcast(at::Tensor& tensor, int root);
  void barrier();

  // The same collectives, issued and not waited for: the result is in
  // `tensor` / `out` once the returned Work's wait() returned. The tensors
  // must not be touched (read or written) until then; the Work keeps them
  // alive. Results are bit-identical to the blocking forms'.
  Work all_reduce_async(at::Tensor tensor, ReduceOp op = ReduceOp::kSum);
  Work all_gather_async(at::Tensor out, const at::Tensor& in);
  Work reduce_scatter_async(at::Tensor out, const at::Tensor& in, ReduceOp op = ReduceOp::kSum);

  // All-to-all along dim 0 with uneven splits (expert parallelism's token
  // dispatch and return): the first in_splits[0] rows of `in` go to member
  // 0, the next in_splits[1] to member 1, and so on; `out` receives, in
  // member order, out_splits[i] rows from member i. A split may be 0.
  // REQUIRES: size() entries in each split list, in.size(0) ==
  // sum(in_splits), out contiguous with out.size(0) == sum(out_splits), the
  // same dtype and the same size in every other dim; out_splits[i] here is
  // in_splits[rank()] at member i (all_to_all_counts exchanges them). Every
  // member calls it. Exact (bytes are moved, nothing is computed).
  void all_to_all(at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                  const std::vector<int64_t>& in_splits);
  Work all_to_all_async(at::Tensor out, const at::Tensor& in, std::vector<int64_t> out_splits,
                        std::vector<int64_t> in_splits);
  // Member j gets send[j] from each member: returns what member i sent this
  // one, by i (the out_splits of an all_to_all whose in_splits are `send`).
  std::vector<int64_t> all_to_all_counts(const std::vector<int64_t>& send);

  // Byte payloads of any length (plans, metadata, small state).
  std::vector<Bytes> all_gather_bytes(const Bytes& mine);
  Bytes broadcast_bytes(const Bytes& payload, int root);
  // Every member's `mine` at `root` (index = member), an empty vector
  // elsewhere. A member receives nothing but the longest payload's length:
  // what a coordinator gathers stays off the others.
  std::vector<Bytes> gather_bytes(const Bytes& mine, int root);
  // Member r gets per_member[r] (read at `root` only, where it must have
  // size() entries). A member receives its own payload, padded to the
  // longest one.
  Bytes scatter_bytes(const std::vector<Bytes>& per_member, int root);

  // Point to point: sends send_n bytes at `send` to member `to` and receives
  // recv_n bytes from member `from` into `recv`, both in flight at once, and
  // returns when both finished. Either side is skipped with to / from = -1 or
  // a length of 0; the peer must post the matching receive / send with the
  // same length. Messages between one pair arrive in the order sent. Only
  // the members involved take part (not a collective). A dead or stuck peer
  // fails it after the group timeout (DistError), breaking the group.
  void send_recv(const void* send, size_t send_n, int to, void* recv, size_t recv_n, int from);

  // Point to point, tensors, issued and not waited for (pipeline
  // parallelism's activations and their gradients): `tensor` goes to member
  // `to`, or member `from`'s arrives in `tensor` (same shape and dtype on both
  // sides) once the Work's wait() returned. `tag` (>= 0) pairs a send with
  // its receive: on Gloo, messages with different tags between one pair may
  // be received in any order; NCCL ignores tags, so both sides must issue
  // their sends and receives in the same order. Only the two members take
  // part. A dead peer fails the wait after the group timeout (DistError).
  Work send_async(at::Tensor tensor, int to, int tag);
  Work recv_async(at::Tensor tensor, int from, int tag);

  // True once a collective failed; every later call throws at once.
  bool broken() const { return !broken_reason_.empty(); }

 private:
  // Starts a collective (start() returns its c10d work), waits for it, and
  // turns any failure into a DistError naming the group and `op`.
  template <class StartFn>
  void run(const char* op, StartFn&& start);
  // Starts a collective and returns its Work; `finish` runs after a
  // successful wait (copies back out of staging buffers, local sums).
  template <class StartFn>
  Work start(const char* op, StartFn&& start, std::function<void()> finish);
  // Marks the group broken and throws the DistError naming `op` and `e`.
  [[noreturn]] void fail(const char* op, const std::exception& e);
  friend class Work;
  void check_usable(const char* op) const;
  bool needs_bf16_bits(const at::Tensor& t) const;

  std::string name_;
  int rank_;
  std::vector<int> ranks_;
  std::unique_ptr<Backend> backend_;
  std::chrono::milliseconds timeout_;
  std::string broken_reason_;
};

// Plugging in your own process group: a Group over a c10d backend that the
// caller made, e.g. c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank,
// size, options) (or ProcessGroupNCCL in CUDA builds) with their own store.
// On LibTorch 2.x a c10d::ProcessGroup holds one backend per device: pass
// pg->getBackend(c10::DeviceType::CPU) (or CUDA). `global_ranks` are the
// members' global ranks (default 0 .. size-1); `timeout` is what errors
// report (the backend's own options bound its waits). The Group shares the
// backend with the caller. Throws std::invalid_argument when `backend` is
// not a c10d backend of this LibTorch, or global_ranks does not match its
// size.
std::shared_ptr<Group> wrap_c10d_backend(c10::intrusive_ptr<c10::intrusive_ptr_target> backend,
                                         std::string name, std::vector<int> global_ranks = {},
                                         std::chrono::milliseconds timeout = std::chrono::minutes(30));

}  // namespace comm
