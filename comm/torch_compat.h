#pragma once
// THE one place that knows which LibTorch it is compiled against.
//
// Everything version-specific lives here: which headers define the c10d
// Gloo/NCCL backends, what their base class is, how TCPStore options are
// spelled, how a backend is constructed, and how torch::optim keys its
// per-parameter state. Only .cpp files include it; the rest of the project
// sees comm::Group and the helpers at the bottom.
//
//   LibTorch 1.13: ProcessGroupGloo derives from c10d::ProcessGroup.
//   LibTorch 2.x : ProcessGroupGloo derives from c10d::Backend; ProcessGroup
//                  became a wrapper. A backend constructed directly still has
//                  the same collective methods, so an alias suffices.

// TorchConfig does not define these, and without them the backend headers
// compile to nothing.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#if defined(SHARDKIT_CUDA) && !defined(USE_C10D_NCCL)
#define USE_C10D_NCCL 1
#endif

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/optim/optimizer.h>
#include <torch/version.h>
#ifdef SHARDKIT_CUDA
#include <torch/csrc/cuda/memory_snapshot.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "comm/process_group.h"
#include "comm/runtime.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace comm::compat {

#if TORCH_VERSION_MAJOR >= 2
using BackendBase = c10d::Backend;
#else
using BackendBase = c10d::ProcessGroup;
#endif
using BackendPtr = c10::intrusive_ptr<BackendBase>;
// What wrap_c10d_backend accepts, in words.
inline const char* backend_base_name() {
  return TORCH_VERSION_MAJOR >= 2 ? "a c10d::Backend, e.g. c10d::ProcessGroupGloo"
                                  : "a c10d::ProcessGroup, e.g. c10d::ProcessGroupGloo";
}
using StorePtr = c10::intrusive_ptr<c10d::Store>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

inline constexpr int kTorchMajor = TORCH_VERSION_MAJOR;
inline constexpr int kTorchMinor = TORCH_VERSION_MINOR;

inline c10d::TCPStoreOptions tcp_store_options(int port, bool is_server,
                                               std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = is_server;
  opts.timeout = timeout;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  // From 2.4 on useLibUV defaults to true, but Debian (and other distribution)
  // builds of LibTorch have no libuv, and then every TCPStore throws "use_libuv
  // was requested but PyTorch was build without libuv support". The classic
  // backend is in every build and is what 1.13 used.
  opts.useLibUV = false;
#endif
  return opts;
}

// A rank's store. The server (is_server) waits in here until `world_size`
// callers, itself included, have connected; a client only connects.
// REQUIRES: exactly one caller per job passes is_server = true.
inline StorePtr make_tcp_store(const std::string& host, int port, bool is_server,
                               int world_size, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts = tcp_store_options(port, is_server, timeout);
  opts.numWorkers = world_size;  // c10::optional in 1.13, std::optional in 2.x
  opts.waitWorkers = true;
  return c10::make_intrusive<c10d::TCPStore>(host, opts);
}

// A store server for ranks elsewhere that all connect as clients: it counts
// and waits for no one (numWorkers unset), so it returns once it listens.
// Port 0: any free port (tcp_store_port says which).
inline StorePtr make_tcp_store_server(const std::string& host, int port,
                                      std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts = tcp_store_options(port, /*is_server=*/true, timeout);
  opts.waitWorkers = false;
  return c10::make_intrusive<c10d::TCPStore>(host, opts);
}

// The port a TCPStore listens on (server) or connected to (client).
inline int tcp_store_port(const StorePtr& store) {
  return static_cast<const c10d::TCPStore&>(*store).getPort();
}

// Strings in and out of a store (c10d stores bytes).
inline void store_set(const StorePtr& store, const std::string& key, const std::string& value) {
  store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

// Waits up to the store's timeout for `key` to be set.
inline std::string store_get(const StorePtr& store, const std::string& key) {
  const std::vector<uint8_t> value = store->get(key);
  return std::string(value.begin(), value.end());
}

// Adds `delta` to the counter at `key` (0 when unset); returns the new value.
inline int64_t store_add(const StorePtr& store, const std::string& key, int64_t delta) {
  return store->add(key, delta);
}

// Waits up to the store's timeout until `key` is set.
inline void store_wait(const StorePtr& store, const std::string& key) { store->wait({key}); }

// Whether `key` is set now (no waiting).
inline bool store_has(const StorePtr& store, const std::string& key) {
  return store->check({key});
}

inline StorePtr make_prefix_store(const std::string& prefix, StorePtr base) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, std::move(base));
}

// The Gloo transport device: loopback for local jobs, GLOO_SOCKET_IFNAME when
// set (as in PyTorch), else this host's resolvable address.
inline std::shared_ptr<::gloo::transport::Device> make_gloo_device(const std::string& master_addr) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (master_addr == "127.0.0.1" || master_addr == "localhost") {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// Blocks until all `size` members have joined through `store`.
inline BackendPtr make_gloo_backend(const StorePtr& store, int rank, int size,
                                    std::chrono::milliseconds timeout,
                                    const std::string& master_addr) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  opts->devices.push_back(make_gloo_device(master_addr));
  opts->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}

#ifdef SHARDKIT_CUDA
// The CUDA caching allocator's history (torch.cuda.memory._record_memory_history's
// C++ side, what profile.memory_snapshot records). 2.x: every allocation
// and free, with its C++ stack, the last `max_entries` of them; 1.13: only
// the live blocks' stacks (no trace). Off: recording stops.
inline void record_cuda_memory_history(bool on, size_t max_entries) {
#if TORCH_VERSION_MAJOR >= 2
  torch::cuda::_record_memory_history(on, /*record_context=*/true,
                                      /*trace_alloc_max_entries=*/static_cast<int64_t>(max_entries),
                                      /*trace_alloc_record_context=*/true, /*record_cpp_context=*/true);
#else
  (void)max_entries;
  torch::cuda::_record_memory_history(on);
#endif
}

inline BackendPtr make_nccl_backend(const StorePtr& store, int rank, int size,
                                    std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
}
#endif

// torch::optim keys per-parameter state by the parameter's TensorImpl: as a
// string in 1.13, as a void* in 2.x.
#if TORCH_VERSION_MAJOR >= 2
inline void* optimizer_state_key(const at::Tensor& param) { return param.unsafeGetTensorImpl(); }
#else
inline std::string optimizer_state_key(const at::Tensor& param) {
  return c10::guts::to_string(param.unsafeGetTensorImpl());
}
#endif

// Causal self-attention of q [B, H, T, Dh] over k, v [B, H, T, Dh] (key and
// value heads already repeated to H). The plain path: scores by matmul,
// softmax in fp32 (as autocast keeps it), cast back to the inputs' dtype.
inline at::Tensor causal_attention_matmul(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v) {
  const int64_t len = q.size(-2);
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  // Rebuilt per call (tiny) rather than kept as a buffer, so it never shows
  // up in a state dict or in sharding.
  at::Tensor future = at::ones({len, len}, q.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(scores.to(at::kFloat), -1).to(q.scalar_type()), v);
}

// The fused kernel where LibTorch has one (2.x: scaled_dot_product_attention,
// causal, flash or memory-efficient where the device supports them), else
// causal_attention_matmul. Both compute the same function, within rounding.
inline constexpr bool kFusedAttention = TORCH_VERSION_MAJOR >= 2;
inline at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true);
#else
  return causal_attention_matmul(q, k, v);
#endif
}


// AdamW's multi-tensor and fused kernels.
//
//   LibTorch 1.13: the _foreach_* ops, no _foreach_lerp_; _fused_adam_ (not
//                  adamw) on CUDA only.
//   LibTorch 2.4+: _fused_adamw_ on CPU and CUDA (the CPU kernel came in
//                  2.4), and _foreach_lerp_, which Python's foreach AdamW uses
//                  for the first moment.
inline constexpr bool kHasFusedAdamW =
    TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4);

// exp_avgs = beta * exp_avgs + (1 - beta) * grads, as the version's Python
// foreach AdamW computes it: lerp with weight 1 - beta on 2.x, mul then add on
// 1.13.
inline void foreach_moving_average_(at::TensorList exp_avgs, at::TensorList grads, double beta) {
#if TORCH_VERSION_MAJOR >= 2
  at::_foreach_lerp_(exp_avgs, grads, 1.0 - beta);
#else
  at::_foreach_mul_(exp_avgs, beta);
  at::_foreach_add_(exp_avgs, grads, 1.0 - beta);
#endif
}

// torch.optim.AdamW(fused=True)'s kernel: one launch per chunk of tensors
// updates params, exp_avgs and exp_avg_sqs in place. state_steps: float32
// scalars on the params' device, already incremented for this step.
// REQUIRES: kHasFusedAdamW.
inline void fused_adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList state_steps, double lr,
                         double beta1, double beta2, double weight_decay, double eps) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, state_steps, lr,
                    beta1, beta2, weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
#else
  (void)params, (void)grads, (void)exp_avgs, (void)exp_avg_sqs, (void)state_steps, (void)lr;
  (void)beta1, (void)beta2, (void)weight_decay, (void)eps;
  throw std::logic_error("fused AdamW needs LibTorch 2.4 or later; this is " TORCH_VERSION);
#endif
}

// RMSNorm as one LibTorch op where the version has it (2.4+: at::rms_norm;
// recent versions dispatch it to a fused CUDA kernel, 2.6 composes it), else
// nothing: the caller composes it. Same math as the composed form: x in fp32,
// times rsqrt(mean(x^2) + eps), cast back to x's dtype, times weight.
inline constexpr bool kHasRmsNorm =
    TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4);
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::rms_norm(x, {x.size(-1)}, weight, eps);
#else
  (void)weight, (void)eps;
  throw std::logic_error("at::rms_norm needs LibTorch 2.4 or later; this is " TORCH_VERSION);
  return x;
#endif
}

}  // namespace comm::compat

namespace comm {

struct Group::Backend {
  compat::BackendPtr pg;
  std::string kind;  // "gloo" | "nccl"
};

struct Rendezvous::Store {
  compat::StorePtr store;
};

}  // namespace comm
