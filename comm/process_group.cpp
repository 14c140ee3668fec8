#include "comm/process_group.h"

#include "comm/torch_compat.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace comm {

namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:  // Gloo rejects AVG: SUM, then divide.
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp");
}

// Gloo reduces host tensors; NCCL device tensors. A tensor on the other side
// is staged through a copy on the backend's side (the way to run several
// ranks on one GPU is a Gloo training group over CUDA tensors, and the
// checkpoint group's byte payloads are host tensors even under NCCL).
at::Tensor on_backend_device(const at::Tensor& t, bool backend_is_cuda) {
  if (backend_is_cuda && !t.is_cuda()) return t.to(at::kCUDA);
  if (!backend_is_cuda && !t.is_cpu()) return t.to(at::kCPU);
  return t;
}

void copy_back(at::Tensor& dst, const at::Tensor& staged) {
  if (!dst.is_same(staged)) dst.copy_(staged);
}

void divide_for_avg(at::Tensor& t, ReduceOp op, int size) {
  if (op != ReduceOp::kAvg) return;
  TORCH_CHECK(t.is_floating_point(), "ReduceOp::kAvg needs a floating tensor, got ", t.dtype());
  t.div_(size);
}

}  // namespace

std::string error_message(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

Group::Group(std::string name, int rank, std::vector<int> ranks, std::unique_ptr<Backend> backend,
             std::chrono::milliseconds timeout)
    : name_(std::move(name)), rank_(rank), ranks_(std::move(ranks)), backend_(std::move(backend)),
      timeout_(timeout) {}

std::shared_ptr<Group> wrap_c10d_backend(c10::intrusive_ptr<c10::intrusive_ptr_target> backend,
                                         std::string name, std::vector<int> global_ranks,
                                         std::chrono::milliseconds timeout) {
  auto* base = dynamic_cast<compat::BackendBase*>(backend.get());
  if (base == nullptr) {
    throw std::invalid_argument("wrap_c10d_backend('" + name +
                                "'): not a c10d backend of this LibTorch (" +
                                compat::backend_base_name() + ")");
  }
  auto b = std::make_unique<Group::Backend>();
  b->pg = compat::BackendPtr::reclaim_copy(base);
  b->kind = base->getBackendName();
  const int size = base->getSize();
  if (global_ranks.empty()) {
    for (int r = 0; r < size; ++r) global_ranks.push_back(r);
  }
  if (static_cast<int>(global_ranks.size()) != size) {
    throw std::invalid_argument("wrap_c10d_backend('" + name + "'): " +
                                std::to_string(global_ranks.size()) + " global ranks for a group of " +
                                std::to_string(size));
  }
  return std::make_shared<Group>(std::move(name), base->getRank(), std::move(global_ranks),
                                 std::move(b), timeout);
}

Group::~Group() = default;

std::string Group::backend_name() const { return backend_->kind; }
bool Group::backend_is_cuda() const { return backend_->kind == "nccl"; }

void Group::check_usable(const char* op) const {
  if (!broken_reason_.empty()) {
    std::ostringstream msg;
    msg << "dist: " << op << " on group '" << name_ << "' (rank " << rank_ << " of " << size()
        << "): the group is unusable after an earlier failure: " << broken_reason_;
    throw DistError(msg.str());
  }
}

struct Work::State {
  Group* group = nullptr;
  const char* op = "";
  compat::WorkPtr work;
  std::function<void()> finish;
};

Work::Work() = default;
Work::Work(std::unique_ptr<State> state) : state_(std::move(state)) {}
Work::Work(Work&&) noexcept = default;
Work& Work::operator=(Work&& other) noexcept {
  if (this != &other) {
    if (state_) {
      try {
        wait();
      } catch (...) {
      }
    }
    state_ = std::move(other.state_);
  }
  return *this;
}

Work::~Work() {
  if (!state_) return;
  try {
    wait();
  } catch (...) {
    // The group is marked broken; its next collective reports it.
  }
}

void Work::wait() {
  if (!state_) return;
  std::unique_ptr<State> s = std::move(state_);
  try {
    // The group's own timeout (Options::timeout) bounds this wait; a peer
    // that died closes its sockets, which fails the wait sooner.
    if (s->work) s->work->wait();
  } catch (const std::exception& e) {
    s->group->fail(s->op, e);
  }
  if (s->finish) s->finish();
}

void Group::fail(const char* op, const std::exception& e) {
  std::ostringstream msg;
  msg << "dist: " << op << " on group '" << name_ << "' (rank " << rank_ << " of " << size()
      << ", timeout " << timeout_.count() / 1000.0 << " s) failed: " << error_message(e);
  broken_reason_ = std::string(op) + " failed";
  throw DistError(msg.str());
}

template <class StartFn>
Work Group::start(const char* op, StartFn&& start_fn, std::function<void()> finish) {
  check_usable(op);
  auto state = std::make_unique<Work::State>();
  state->group = this;
  state->op = op;
  state->finish = std::move(finish);
  try {
    state->work = start_fn();
  } catch (const std::exception& e) {
    fail(op, e);
  }
  return Work(std::move(state));
}

template <class StartFn>
void Group::run(const char* op, StartFn&& start_fn) {
  start(op, std::forward<StartFn>(start_fn), {}).wait();
}

// Gloo (1.13's at least) refuses bfloat16 ("Invalid scalar type"). Data
// movement does not care what the 2-byte elements are, so the collectives
// that only move bytes send the same bits as fp16 (gloo has no int16; nothing is computed on them); reductions sum in fp32
// (all_reduce) or locally in bf16 after moving (reduce_scatter).
bool Group::needs_bf16_bits(const at::Tensor& t) const {
  return t.scalar_type() == at::kBFloat16 && !backend_is_cuda();
}

void Group::all_reduce(at::Tensor& tensor, ReduceOp op) { all_reduce_async(tensor, op).wait(); }

Work Group::all_reduce_async(at::Tensor tensor, ReduceOp op) {
  TORCH_CHECK(tensor.is_contiguous(), "all_reduce needs a contiguous tensor");
  const int n = size();
  if (n == 1) {
    divide_for_avg(tensor, op, 1);
    return Work();
  }
  // bf16 on Gloo: summed in fp32 (and divided there for AVG), then rounded.
  at::Tensor target = needs_bf16_bits(tensor) ? tensor.to(at::kFloat) : tensor;
  at::Tensor staged = on_backend_device(target, backend_is_cuda());
  std::vector<at::Tensor> ts{staged};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  return start("all_reduce", [&] { return backend_->pg->allreduce(ts, opts); },
               [tensor, target, staged, op, n]() mutable {
                 copy_back(target, staged);
                 divide_for_avg(target, op, n);
                 copy_back(tensor, target);
               });
}

void Group::all_gather(at::Tensor& out, const at::Tensor& in) { all_gather_async(out, in).wait(); }

Work Group::all_gather_async(at::Tensor out, const at::Tensor& in) {
  TORCH_CHECK(out.is_contiguous(), "all_gather: output must be contiguous");
  TORCH_CHECK(out.scalar_type() == in.scalar_type(), "all_gather: dtype mismatch ", out.dtype(),
              " vs ", in.dtype());
  TORCH_CHECK(out.numel() == in.numel() * size(), "all_gather: output has ", out.numel(),
              " elements, expected ", in.numel() * size());
  at::Tensor flat_out = out.view({-1});
  if (size() == 1) {
    flat_out.copy_(in.reshape({-1}));
    return Work();
  }
  if (in.numel() == 0) return Work();
  at::Tensor flat_in = in.contiguous().view({-1});
  if (needs_bf16_bits(in)) {
    flat_out = flat_out.view(at::kHalf);
    flat_in = flat_in.view(at::kHalf);
  }
  // Gloo on 1.13 has no _allgather_base: gather into the chunk views of the
  // flat output instead (exact, one copy).
  at::Tensor staged_out = on_backend_device(flat_out, backend_is_cuda());
  std::vector<std::vector<at::Tensor>> outs{staged_out.chunk(size())};
  std::vector<at::Tensor> ins{on_backend_device(flat_in, backend_is_cuda())};
  return start("all_gather", [&] { return backend_->pg->allgather(outs, ins); },
               [flat_out, staged_out, ins]() mutable { copy_back(flat_out, staged_out); });
}

void Group::reduce_scatter(at::Tensor& out, const at::Tensor& in, ReduceOp op) {
  reduce_scatter_async(out, in, op).wait();
}

Work Group::reduce_scatter_async(at::Tensor out, const at::Tensor& in, ReduceOp op) {
  TORCH_CHECK(out.is_contiguous(), "reduce_scatter: output must be contiguous");
  TORCH_CHECK(out.scalar_type() == in.scalar_type(), "reduce_scatter: dtype mismatch");
  TORCH_CHECK(in.numel() == out.numel() * size(), "reduce_scatter: input has ", in.numel(),
              " elements, expected ", out.numel() * size());
  at::Tensor flat_in = in.contiguous().view({-1});
  at::Tensor flat_out = out.view({-1});
  const int n = size();
  if (n == 1) {
    flat_out.copy_(flat_in);
    divide_for_avg(out, op, 1);
    return Work();
  }
  if (out.numel() == 0) return Work();
  TORCH_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg,
              "reduce_scatter supports SUM and AVG");
  // Gloo has no reduce_scatter on 1.13: all-to-all sends slice j to member j,
  // then each member sums what it received in member order (deterministic).
  at::Tensor staged_in = on_backend_device(flat_in, backend_is_cuda());
  at::Tensor received = at::empty_like(staged_in);
  std::vector<int64_t> splits(n, out.numel());
  const bool bits = needs_bf16_bits(staged_in);
  at::Tensor wire_in = bits ? staged_in.view(at::kHalf) : staged_in;
  at::Tensor wire_out = bits ? received.view(at::kHalf) : received;
  return start("reduce_scatter",
               [&] {
                 c10d::AllToAllOptions opts;
                 return backend_->pg->alltoall_base(wire_out, wire_in, splits, splits, opts);
               },
               [out, flat_out, staged_in, received, op, n]() mutable {
                 at::Tensor summed = received.view({n, flat_out.numel()}).sum(/*dim=*/0);
                 flat_out.copy_(summed);
                 divide_for_avg(out, op, n);
               });
}

void Group::all_to_all(at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                       const std::vector<int64_t>& in_splits) {
  all_to_all_async(out, in, out_splits, in_splits).wait();
}

Work Group::all_to_all_async(at::Tensor out, const at::Tensor& in, std::vector<int64_t> out_splits,
                             std::vector<int64_t> in_splits) {
  const size_t n = ranks_.size();
  TORCH_CHECK(in_splits.size() == n && out_splits.size() == n, "all_to_all: ", in_splits.size(), " in and ",
              out_splits.size(), " out splits for ", n, " members");
  TORCH_CHECK(out.is_contiguous(), "all_to_all: output must be contiguous");
  TORCH_CHECK(out.scalar_type() == in.scalar_type(), "all_to_all: dtype mismatch ", out.dtype(), " vs ",
              in.dtype());
  TORCH_CHECK(in.dim() >= 1 && out.dim() == in.dim() && out.sizes().slice(1) == in.sizes().slice(1),
              "all_to_all: output ", out.sizes(), " and input ", in.sizes(), " differ past dim 0");
  int64_t sent = 0, received = 0;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(in_splits[i] >= 0 && out_splits[i] >= 0, "all_to_all: negative split for member ", i);
    sent += in_splits[i];
    received += out_splits[i];
  }
  TORCH_CHECK(sent == in.size(0) && received == out.size(0), "all_to_all: splits of ", sent, " and ", received,
              " rows for an input of ", in.size(0), " and an output of ", out.size(0));
  if (n == 1) {
    out.copy_(in);
    return Work();
  }
  at::Tensor wire_in = in.contiguous();
  at::Tensor wire_out = out;
  if (needs_bf16_bits(in)) {  // Gloo moves bits, not bf16
    wire_in = wire_in.view(at::kHalf);
    wire_out = wire_out.view(at::kHalf);
  }
  at::Tensor staged_in = on_backend_device(wire_in, backend_is_cuda());
  at::Tensor staged_out = on_backend_device(wire_out, backend_is_cuda());
  return start("all_to_all",
               [&] {
                 c10d::AllToAllOptions opts;
                 return backend_->pg->alltoall_base(staged_out, staged_in, out_splits, in_splits, opts);
               },
               [wire_out, staged_out, staged_in]() mutable { copy_back(wire_out, staged_out); });
}

std::vector<int64_t> Group::all_to_all_counts(const std::vector<int64_t>& send) {
  const size_t n = ranks_.size();
  TORCH_CHECK(send.size() == n, "all_to_all_counts: ", send.size(), " counts for ", n, " members");
  at::Tensor in = at::tensor(send, at::kLong);
  at::Tensor out = at::empty({static_cast<int64_t>(n)}, at::kLong);
  const std::vector<int64_t> ones(n, 1);
  all_to_all(out, in, ones, ones);
  return std::vector<int64_t>(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + n);
}

void Group::broadcast(at::Tensor& tensor, int root) {
  TORCH_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " out of range");
  if (size() == 1 || tensor.numel() == 0) return;
  TORCH_CHECK(tensor.is_contiguous(), "broadcast needs a contiguous tensor");
  if (needs_bf16_bits(tensor)) {
    at::Tensor bits = tensor.view(at::kHalf);
    broadcast(bits, root);
    return;
  }
  at::Tensor staged = on_backend_device(tensor, backend_is_cuda());
  std::vector<at::Tensor> ts{staged};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  run("broadcast", [&] { return backend_->pg->broadcast(ts, opts); });
  copy_back(tensor, staged);
}

void Group::barrier() {
  if (size() == 1) return;
  // A tiny all-reduce rather than c10d's barrier: same semantics, and it
  // fails with the same timeout and error path as every other collective.
  at::Tensor t = on_backend_device(at::zeros({1}, at::kInt), backend_is_cuda());
  std::vector<at::Tensor> ts{t};
  run("barrier", [&] { return backend_->pg->allreduce(ts); });
}

std::vector<Bytes> Group::all_gather_bytes(const Bytes& mine) {
  at::Tensor my_len = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong);
  at::Tensor lens = at::empty({size()}, at::kLong);
  all_gather(lens, my_len);
  int64_t max_len = lens.max().item<int64_t>();
  at::Tensor padded = at::zeros({max_len}, at::kByte);
  if (!mine.empty()) std::memcpy(padded.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({max_len * size()}, at::kByte);
  if (max_len > 0) all_gather(all, padded);
  std::vector<Bytes> result(size());
  const uint8_t* base = all.data_ptr<uint8_t>();
  for (int r = 0; r < size(); ++r) {
    int64_t n = lens[r].item<int64_t>();
    result[r].assign(base + r * max_len, base + r * max_len + n);
  }
  return result;
}

Bytes Group::broadcast_bytes(const Bytes& payload, int root) {
  at::Tensor len = at::tensor({static_cast<int64_t>(payload.size())}, at::kLong);
  broadcast(len, root);
  int64_t n = len.item<int64_t>();
  at::Tensor buf = at::empty({n}, at::kByte);
  if (rank_ == root && n > 0) std::memcpy(buf.data_ptr(), payload.data(), n);
  broadcast(buf, root);
  const uint8_t* p = buf.data_ptr<uint8_t>();
  return Bytes(p, p + n);
}

namespace {

// A payload behind its u64 length, zero-padded to `width` bytes.
void put_framed(uint8_t* dst, const Bytes& payload) {
  const uint64_t n = payload.size();
  std::memcpy(dst, &n, sizeof n);
  if (n > 0) std::memcpy(dst + sizeof n, payload.data(), payload.size());
}

Bytes get_framed(const uint8_t* src, int64_t width) {
  uint64_t n = 0;
  std::memcpy(&n, src, sizeof n);
  TORCH_CHECK(n <= static_cast<uint64_t>(width) - sizeof n, "dist: framed payload of ", n,
              " bytes exceeds its frame of ", width);
  return Bytes(src + sizeof n, src + sizeof n + n);
}

}  // namespace

std::vector<Bytes> Group::gather_bytes(const Bytes& mine, int root) {
  TORCH_CHECK(root >= 0 && root < size(), "gather_bytes: root ", root, " out of range");
  if (size() == 1) return {mine};
  at::Tensor width = at::tensor({static_cast<int64_t>(mine.size() + sizeof(uint64_t))}, at::kLong);
  all_reduce(width, ReduceOp::kMax);
  const int64_t w = width.item<int64_t>();
  at::Tensor framed = at::zeros({w}, at::kByte);
  put_framed(framed.data_ptr<uint8_t>(), mine);
  std::vector<at::Tensor> ins{on_backend_device(framed, backend_is_cuda())};
  std::vector<std::vector<at::Tensor>> outs;
  at::Tensor all;
  if (rank_ == root) {
    all = on_backend_device(at::empty({w * size()}, at::kByte), backend_is_cuda());
    outs.push_back(all.chunk(size()));
  }
  c10d::GatherOptions opts;
  opts.rootRank = root;
  run("gather", [&] { return backend_->pg->gather(outs, ins, opts); });
  std::vector<Bytes> result;
  if (rank_ != root) return result;
  at::Tensor host = all.cpu();
  for (int r = 0; r < size(); ++r) result.push_back(get_framed(host.data_ptr<uint8_t>() + r * w, w));
  return result;
}

Bytes Group::scatter_bytes(const std::vector<Bytes>& per_member, int root) {
  TORCH_CHECK(root >= 0 && root < size(), "scatter_bytes: root ", root, " out of range");
  if (rank_ == root) {
    TORCH_CHECK(per_member.size() == static_cast<size_t>(size()), "scatter_bytes: ",
                per_member.size(), " payloads for ", size(), " members");
  }
  if (size() == 1) return per_member[0];
  at::Tensor width = at::zeros({1}, at::kLong);
  if (rank_ == root) {
    size_t longest = 0;
    for (const Bytes& b : per_member) longest = std::max(longest, b.size());
    width.fill_(static_cast<int64_t>(longest + sizeof(uint64_t)));
  }
  broadcast(width, root);
  const int64_t w = width.item<int64_t>();
  at::Tensor mine = on_backend_device(at::empty({w}, at::kByte), backend_is_cuda());
  std::vector<at::Tensor> outs{mine};
  std::vector<std::vector<at::Tensor>> ins;
  if (rank_ == root) {
    at::Tensor all = at::zeros({w * size()}, at::kByte);
    for (int r = 0; r < size(); ++r) put_framed(all.data_ptr<uint8_t>() + r * w, per_member[r]);
    ins.push_back(on_backend_device(all, backend_is_cuda()).chunk(size()));
  }
  c10d::ScatterOptions opts;
  opts.rootRank = root;
  run("scatter", [&] { return backend_->pg->scatter(outs, ins, opts); });
  at::Tensor host = mine.cpu();
  return get_framed(host.data_ptr<uint8_t>(), w);
}

Work Group::send_async(at::Tensor tensor, int to, int tag) {
  TORCH_CHECK(to >= 0 && to < size() && to != rank_, "send_async: bad destination ", to);
  TORCH_CHECK(tag >= 0, "send_async: negative tag ", tag);
  at::Tensor flat = tensor.contiguous().view({-1});
  if (needs_bf16_bits(flat)) flat = flat.view(at::kHalf);  // Gloo moves bits, not bf16
  std::vector<at::Tensor> out{on_backend_device(flat, backend_is_cuda())};
  return start("send", [&] { return backend_->pg->send(out, to, tag); }, [out] {});
}

Work Group::recv_async(at::Tensor tensor, int from, int tag) {
  TORCH_CHECK(from >= 0 && from < size() && from != rank_, "recv_async: bad source ", from);
  TORCH_CHECK(tag >= 0, "recv_async: negative tag ", tag);
  TORCH_CHECK(tensor.is_contiguous(), "recv_async: the tensor must be contiguous");
  at::Tensor flat = tensor.view({-1});
  if (needs_bf16_bits(flat)) flat = flat.view(at::kHalf);
  at::Tensor staged = on_backend_device(flat, backend_is_cuda());
  std::vector<at::Tensor> in{staged};
  return start("recv", [&] { return backend_->pg->recv(in, from, tag); },
               [flat, staged]() mutable { copy_back(flat, staged); });
}

void Group::send_recv(const void* send, size_t send_n, int to, void* recv, size_t recv_n,
                      int from) {
  const bool sending = to >= 0 && send_n > 0;
  const bool receiving = from >= 0 && recv_n > 0;
  TORCH_CHECK(!sending || (to < size() && to != rank_), "send_recv: bad destination ", to);
  TORCH_CHECK(!receiving || (from < size() && from != rank_), "send_recv: bad source ", from);
  if (!sending && !receiving) return;
  check_usable("send_recv");
  const bool cuda = backend_is_cuda();
  std::vector<at::Tensor> out, in;
  at::Tensor in_host;
  if (sending) {
    at::Tensor host = at::from_blob(const_cast<void*>(send), {static_cast<int64_t>(send_n)},
                                    at::TensorOptions().dtype(at::kByte));
    out.push_back(on_backend_device(host, cuda));
  }
  if (receiving) {
    in_host = at::from_blob(recv, {static_cast<int64_t>(recv_n)}, at::TensorOptions().dtype(at::kByte));
    in.push_back(on_backend_device(in_host, cuda));
  }
  try {
    compat::WorkPtr sent, received;
    if (sending) sent = backend_->pg->send(out, to, 0);
    if (receiving) received = backend_->pg->recv(in, from, 0);
    if (sent) sent->wait();
    if (received) received->wait();
  } catch (const std::exception& e) {
    std::ostringstream msg;
    msg << "dist: send_recv on group '" << name_ << "' (rank " << rank_ << " of " << size();
    if (sending) msg << ", " << send_n << " bytes to member " << to;
    if (receiving) msg << ", " << recv_n << " bytes from member " << from;
    msg << ", timeout " << timeout_.count() / 1000.0 << " s) failed: " << error_message(e);
    broken_reason_ = "send_recv failed";
    throw DistError(msg.str());
  }
  if (receiving) copy_back(in_host, in[0]);
}

}  // namespace comm
