#pragma once
// fully_shard for any torch::nn::Module: FSDP, DDP and HSDP over a 2-D
// device mesh {replicate, shard}.
//
// The caller names the units: submodules by their names in
// named_modules() ("layers.0", "layers.1", ... -- children_of() lists a
// ModuleList's or Sequential's children; modules_where() takes a
// predicate). Every parameter that is in no unit belongs to the root unit.
// Every parameter is stored as this rank's Shard(0) chunk (torch.chunk
// rows) of the mesh's shard axis -- the tensor the optimizer updates. The
// module's own parameter tensors keep their full shapes but have no storage
// except while their unit is gathered:
//
//   forward : FullyShardedModel::forward(fn) gathers the root unit and runs
//             fn, the model's own forward. Inside it, each unit's call is
//             wrapped in run_unit(unit, fn) (or a UnitScope): it all-gathers
//             the unit's shards into its parameters, runs the unit and frees
//             them again (reshard_after_forward);
//   backward: a hook on the unit's output gathers them again before the
//             unit's backward runs; once the last gradient of the unit is
//             accumulated, its gradients are reduce-scattered (summed) into
//             the shards' .grad and the full parameters and gradients freed.
//
// LibTorch C++ has no module forward hooks, so this one line per unit call
// is what stands for FSDP2's pre/post-forward hooks. run_unit is a plain
// call when the module is not a unit of a sharded model, so the model's
// code runs unchanged on one device. A model that must not depend on the
// framework (models/) calls models::run_unit instead: the unit hook there,
// which a FullyShardedModel sets to run_unit when it is built. With no units at all, the root unit is
// the whole model: it needs no change to the model, and gathers every
// parameter for the forward.
//
// Overlap (options.prefetch = N, default 1; FSDP2's implicit prefetch):
// while a unit runs, the all-gathers of the next N units (in the last
// forward's order; in backward, the reverse) are in flight, and a unit's
// gradient reduction stays in flight while the next unit's backward runs
// (at most N; all are done by finish_backward). Collectives run through
// comm::Group's async forms: reduce-scatters and all-reduces on the mesh's
// channel 1, all-gathers on channel 0 (DeviceMesh::create's `channels`; one
// group serves both on a mesh with one channel). Results are bit-identical
// to N = 0, where each collective is waited for where it is issued.
//
// Memory: with N = 0 only one unit is ever gathered besides the root, so
// parameter plus gradient memory per rank is the sharded total plus the
// largest unit's parameters and gradients; with N, up to 1 + N units in
// forward and 2 + 2N in backward (docs/parallelism.md).
// With shard size 1 (DDP) the local tensor is the module parameter itself
// and gradients are all-reduced; with replicate > 1 (HSDP) the reduce-scatter
// is followed by an all-reduce across replicas.
//
// What the module may hold:
//   - parameters of several dtypes: each unit keeps one flat buffer (one
//     collective) per dtype;
//   - frozen parameters (requires_grad false): sharded and gathered like the
//     rest, never reduced, and left out of the optimizer's state (LoRA's
//     frozen base). A unit that holds some is freed when the next unit's
//     backward begins, not when its last gradient arrives: its backward
//     may still read them for its input's gradient;
//   - tied parameters (one tensor registered under several names): kept
//     once, under its first name; tied across units, it joins the root;
//   - buffers: not sharded; in training, every forward broadcasts them from
//     the mesh's first rank (options.broadcast_buffers), as DDP does, so all
//     ranks hold the same values and a checkpoint writes them once;
//   - 0-d parameters, and parameters that do not own a dense storage of
//     their own (views), are refused with an error naming them.
//
// Mixed precision (options.mixed_precision, FSDP2's MixedPrecisionPolicy):
// with param_dtype bf16, the module's floating-point parameters become bf16
// (the forward computes in bf16) while the local shards, which the
// optimizer updates, keep their dtype (fp32 master weights). A gather casts
// the shards to bf16 before the all-gather (half the bytes); a reduction
// casts the bf16 gradients to reduce_dtype for the collective and then
// adds them to the fp32 shard gradients. DDP then keeps an fp32 master copy
// beside the bf16 parameter.
//
// Gradient accumulation: gradients of several backward passes before one
// optimizer step add up in the shards' .grad (FSDP, HSDP: each backward
// reduce-scatters its own; memory stays flat). set_requires_gradient_sync
// (false) skips the all-reduce over the replicate axis for the micro-batches
// before the last, as DDP's no_sync() and FSDP2's set_requires_all_reduce
// do: DDP then all-reduces once per step, HSDP reduce-scatters every
// micro-batch and all-reduces the accumulated shards once.
//
// Parameters without storage (a model built unmaterialised): pass `init`,
// and the constructor materialises them one at a time -- allocates the full
// tensor, has init fill it, keeps this rank's shard, frees it -- so a rank
// never holds more than its shards plus the largest parameter.
//
// Tensor parallelism (framework/tp): on a {replicate, shard, tensor} mesh
// the module's parameters are already this rank's TP parts (what
// tp::parallelize_module left); options.tensor_parallel says how each was
// split. FSDP shards each part over the shard axis as above, never
// communicates over the tensor axis, and gives each parameter a DTensor
// with both placements on the view {replicate, tensor, shard} of the mesh
// (TP's split first, FSDP's rows of it second), with the whole parameter's
// global shape. grad_norm() sums over the tensor axis too, counting the
// parameters TP keeps whole once.
//
// Gradients are SUMMED across data-parallel ranks: the caller scales its loss
// by the global normaliser (e.g. the global token count), which makes results
// independent of the world size.
//
// Thread safety: one training thread drives it. The CPU autograd engine runs
// backward (and so the gather and reduce hooks) on the calling thread; for
// CUDA tensors it runs them on its own per-device thread while the calling
// thread blocks in backward(). Either way the hooks' collectives never run
// concurrently with the training thread's, they run in the same backward
// order on every rank, and on the stream the engine runs each unit's
// backward on (the current stream of the device thread, which is the
// forward's stream): NCCL's wait() orders that stream after the collective,
// and Gloo stages CUDA tensors through the host synchronously.
#include "framework/dtensor/dtensor.h"
#include "framework/fsdp/options.h"

#include <torch/torch.h>

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace framework::fsdp {

struct MemoryStats {
  int64_t sharded_param_bytes = 0;   // local shards (this rank)
  int64_t full_param_bytes = 0;      // the whole model, unsharded
  int64_t largest_unit_bytes = 0;    // parameters of the largest unit
  int64_t peak_gathered_bytes = 0;   // peak of gathered params + full grads
};

class FullyShardedModel;
struct Bucket;     // parameters gathered and reduced together; fully_shard.cpp
struct ParamSlot;  // one parameter of a unit; fully_shard.cpp

// The names of `list`'s children, as units: children_of(model, "layers") ->
// {"layers.0", "layers.1", ...}. Throws std::invalid_argument when `model`
// has no submodule of that name, or it has no children.
std::vector<std::string> children_of(const torch::nn::Module& model, const std::string& list);

// The names of the submodules (not the model itself) for which
// pred(name, module) holds, outermost first; a submodule inside one that
// matched is not visited.
using UnitPredicate = std::function<bool(const std::string& name, const torch::nn::Module&)>;
std::vector<std::string> modules_where(const torch::nn::Module& model, const UnitPredicate& pred);

// Around one call of a unit inside the model's forward: gathers the unit's
// parameters for the scope's life when `unit` is a unit of a
// FullyShardedModel (a no-op for any other module). Pass the unit's output
// (each output tensor, for several) to output(): at the end of the scope the
// parameters are freed (reshard_after_forward), and gathered again when the
// output's gradient arrives in backward. Without an output the parameters
// stay gathered until the unit's gradients are reduced.
class UnitScope {
 public:
  explicit UnitScope(const torch::nn::Module& unit);
  ~UnitScope();
  UnitScope(const UnitScope&) = delete;
  UnitScope& operator=(const UnitScope&) = delete;

  torch::Tensor output(torch::Tensor out);

 private:
  FullyShardedModel* owner_ = nullptr;
  size_t unit_ = 0;
  bool has_output_ = false;
};

// out = fn() with `unit`'s parameters gathered: the one line a model's
// forward needs per unit call, e.g.
//   for (auto& layer : *layers_) h = fsdp::run_unit(*layer, [&] { return layer->as<Block>()->forward(h); });
template <class Fn>
torch::Tensor run_unit(const torch::nn::Module& unit, Fn&& fn) {
  UnitScope scope(unit);
  return scope.output(fn());
}

// Fills a full parameter (by its name) with its initial values.
using ParamInit = std::function<void(const std::string& name, const torch::Tensor& full)>;

class FullyShardedModel {
 public:
  // REQUIRES: every rank passes an identically initialised module and the
  // same mesh (axes {replicate, shard}, or {replicate, shard, tensor} with
  // options.tensor_parallel set) and units. Takes over the module's
  // parameters (their storage is freed until gathered). Throws
  // std::invalid_argument naming the unit or parameter when a unit name is
  // unknown, units nest, or a parameter cannot be sharded (0-d, or a view),
  // or has no storage and no `init` was given.
  FullyShardedModel(std::shared_ptr<torch::nn::Module> module,
                    std::shared_ptr<dtensor::DeviceMesh> mesh, FsdpOptions options,
                    std::vector<std::string> units = {}, ParamInit init = {});
  ~FullyShardedModel();
  FullyShardedModel(const FullyShardedModel&) = delete;
  FullyShardedModel& operator=(const FullyShardedModel&) = delete;

  // Runs fn() -- the model's forward, and the loss if the caller likes --
  // with the root unit gathered; the units gather themselves through
  // run_unit. In training (grad mode on) the root stays gathered until
  // finish_backward(); under torch::NoGradGuard everything is freed before
  // returning. A parameter of a unit used outside its run_unit fails with an
  // error naming the unit.
  template <class Fn>
  auto forward(Fn&& fn) -> decltype(fn()) {
    begin_forward();
    try {
      auto out = fn();
      end_forward();
      return out;
    } catch (const c10::Error& e) {
      abort_forward();
      rethrow_forward_error(e);
    } catch (...) {
      abort_forward();
      throw;
    }
  }

  // After loss.backward(): checks that every unit reduced its gradients (a
  // unit whose parameters got no gradient is reduced with zeros, on every
  // rank alike) and frees what is still gathered.
  void finish_backward();

  // The tensors the optimizer owns, in parameter order: local shards (FSDP,
  // HSDP) or the module parameters themselves (DDP). Frozen parameters are
  // included, with requires_grad false.
  std::vector<torch::Tensor> local_params() const;
  // Parameter names (the module's named_parameters order, tied parameters
  // once) and their DTensors.
  std::vector<std::string> param_names() const;
  dtensor::DTensor param_dtensor(size_t index) const;
  bool param_trainable(size_t index) const;  // requires_grad
  // A DTensor with the same layout as parameter `index` around `local`
  // (e.g. an optimizer moment of that parameter).
  dtensor::DTensor like_param(size_t index, torch::Tensor local) const;
  // The module's buffers (named_buffers order): whole, replicated tensors.
  std::vector<std::pair<std::string, torch::Tensor>> buffers() const;
  // The units, root first ("root", then the names given).
  std::vector<std::string> unit_names() const;

  // L2 norm of all gradients across all shards (replicas counted once).
  double grad_norm();
  // Scales all gradients so their global norm is at most max_norm; returns
  // the norm before clipping.
  double clip_grad_norm(double max_norm);
  void zero_grad();
  // false: the next backward passes accumulate without the all-reduce over
  // the replicate axis: DDP's no_sync(), FSDP2's set_requires_all_reduce
  // (false) for HSDP. FSDP and HSDP still reduce-scatter every backward, so
  // the accumulated gradients stay sharded. Set it back to true before the
  // last backward of the step, which all-reduces the sum.
  void set_requires_gradient_sync(bool sync) { sync_ = sync; }

  // Pipeline parallelism: several micro-batches' forwards run before their
  // backwards (GPipe, 1F1B), so one step has several backward passes whose
  // graphs were all recorded first.
  //   - set_hold_root(true) keeps the root unit's parameters gathered from
  //     the step's first forward to finish_backward(): later passes' graphs
  //     still use them. Its gradients are reduced pass by pass, as every
  //     unit's.
  //   - end_micro_backward() after each backward pass but the step's last:
  //     every unit that got gradients in that pass has them reduced (as
  //     finish_backward does), and every unit is ready for the next pass.
  // finish_backward() still ends the step. Results equal those of the same
  // passes run one forward and backward at a time.
  void set_hold_root(bool hold) { hold_root_ = hold; }
  void end_micro_backward();
  // A group over which grad_norm() also sums the squared norm: ranks that
  // hold disjoint parameters (pipeline stages). Null: none.
  void set_norm_group(comm::Group* group) { norm_group_ = group; }

  // The schedule of collectives, for tests and for seeing the overlap: with
  // logging on, one entry per event, in the order they happened on this
  // rank: "gather.issue U", "gather.wait U", "forward U" (the unit's forward
  // starts), "backward U" (its output's gradient arrived), "reduce.issue U",
  // "reduce.wait U", "allreduce.issue U", "allreduce.wait U" (U: the unit's
  // name). Off by default (it grows by a few entries per unit and step).
  void set_schedule_logging(bool on) { log_schedule_ = on; }
  const std::vector<std::string>& schedule() const { return schedule_; }
  void clear_schedule() { schedule_.clear(); }
  // Seconds this rank's training thread has spent waiting for FSDP's
  // collectives (all-gathers, reduce-scatters, replicate all-reduces) since
  // the model was built: the communication the compute did not hide. With
  // prefetch 0 it is the collectives' whole time. On NCCL a wait only
  // orders the stream, so the host hardly waits: use a profile there.
  double comm_wait_seconds() const { return comm_wait_s_; }

  const MemoryStats& memory_stats() const { return stats_; }
  void reset_peak_memory();
  dtensor::DeviceMesh& mesh() { return *mesh_; }
  torch::nn::Module& module() { return *module_; }
  const FsdpOptions& options() const { return options_; }

  struct Unit;  // one FSDP unit; defined in fully_shard.cpp
  struct Reduction;  // one unit's gradient reduction in flight; fully_shard.cpp

 private:
  friend class UnitScope;
  void begin_forward();
  void end_forward();
  void abort_forward();
  [[noreturn]] void rethrow_forward_error(const c10::Error& e);
  // The constructor's steps, in order (fully_shard.cpp).
  void set_mesh_and_precision();
  std::vector<const torch::nn::Module*> make_units(const std::vector<std::string>& unit_names);
  void add_param(const std::string& name, const torch::Tensor& p, Unit& unit, size_t index,
                 const ParamInit& init);
  void add_to_bucket(Unit& unit, ParamSlot slot);
  void index_params_and_hook_grads();
  void register_units(const std::vector<const torch::nn::Module*>& unit_modules);
  void broadcast_buffers();
  void gather(Unit& unit);
  void issue_gather(Unit& unit);
  void finish_gather(Unit& unit);
  // Issues the all-gathers of the `options_.prefetch` units after `unit` in
  // forward order (backward: before it), those not gathered yet.
  void prefetch_next(const Unit& unit, bool backward);
  void before_unit_backward(Unit& unit);
  void release_pending(const Unit* except);
  void release(Unit& unit);
  void reduce_grads(Unit& unit);
  void wait_reduce_scatter();
  void wait_all_reduce();
  void drain_reductions();
  void log(const char* what, const Unit& unit);
  bool last_in_order(size_t unit) const;
  void set_order(std::vector<size_t> order);
  torch::ScalarType comm_dtype(torch::ScalarType bucket_dtype) const;
  // The replicate axis of one bucket's reduction: issue_replicated sums this
  // backward's gradients with the unsynced ones and, when this backward
  // syncs, issues their all-reduce; finish_replicated waits for it and adds
  // the result to the bucket's .grad buffer (FSDP, HSDP, DDP alike).
  struct ReducePart;
  // A bucket's part of reduce_grads: DDP's flat gradients (take_replicated_grads),
  // or FSDP/HSDP's packed send buffer and its reduce-scatter issued.
  void take_replicated_grads(Unit& unit, Bucket& bucket, ReducePart& part);
  void issue_reduce_scatter(Unit& unit, Bucket& bucket, ReducePart& part);
  void issue_replicated(Bucket& bucket, ReducePart& part);
  void finish_replicated(Unit& unit, Bucket& bucket, ReducePart& part);
  void on_grad_accumulated(Unit& unit);

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<dtensor::DeviceMesh> mesh_;
  FsdpOptions options_;
  int shard_axis_ = 1;
  int replicate_axis_ = 0;
  int tensor_axis_ = -1;  // 2 on a {replicate, shard, tensor} mesh
  std::shared_ptr<dtensor::DeviceMesh> param_mesh_;  // what the DTensors live on
  // Expert parallelism (FsdpOptions::expert_parallel): its mesh
  // {replicate, expert_shard, expert} and the view {replicate, expert,
  // expert_shard} its parameters' DTensors live on; null without.
  std::shared_ptr<dtensor::DeviceMesh> expert_mesh_, expert_param_mesh_;
  // A bucket's shard group: the shard axis, or the expert-shard axis.
  int64_t bucket_shards(bool expert) const;
  void sum_grads_over_tensor_axis(Unit& unit, const Bucket& bucket);
  int64_t bucket_coordinate(bool expert) const;
  comm::Group& bucket_group(bool expert, int channel);
  std::vector<std::unique_ptr<Unit>> units_;  // units_[0] is the root
  std::vector<std::pair<Unit*, size_t>> param_index_;  // model parameter order -> (unit, slot)
  std::vector<std::pair<std::string, torch::Tensor>> buffers_;
  MemoryStats stats_;
  int64_t live_bytes_ = 0;
  bool sync_ = true;
  // Forward order of the units (indices into units_, the root left out):
  // the registration order until a forward has run, then the order of the
  // last forward. pos_[u] is unit u's place in it (npos: not in it).
  std::vector<size_t> order_, this_order_, pos_;
  std::vector<bool> seen_;
  bool in_backward_ = false;
  // Reductions in flight: their reduce-scatters, then their all-reduces
  // over the replicate axis, oldest first.
  std::deque<std::unique_ptr<Reduction>> reducing_, replicating_;
  double comm_wait_s_ = 0;
  bool log_schedule_ = false;
  std::vector<std::string> schedule_;
  bool mixed_ = false;  // a mixed-precision policy other than fp32/fp32
  bool hold_root_ = false;            // set_hold_root
  comm::Group* norm_group_ = nullptr;  // set_norm_group
  torch::ScalarType param_dtype_ = torch::kFloat;
  torch::ScalarType reduce_dtype_ = torch::kFloat;
};

// fully_shard(module, mesh, options, units): the FSDP2 spelling.
std::unique_ptr<FullyShardedModel> fully_shard(std::shared_ptr<torch::nn::Module> module,
                                               std::shared_ptr<dtensor::DeviceMesh> mesh,
                                               FsdpOptions options = {},
                                               std::vector<std::string> units = {},
                                               ParamInit init = {});

// module.to(device), except that parameters without storage (a model built
// unmaterialised) stay so: they become tensors of `device` without bytes,
// which the FullyShardedModel then materialises there one at a time.
void move_to_device(torch::nn::Module& module, torch::Device device);

// fp32 -> kFloat, bf16 -> kBFloat16.
torch::ScalarType to_scalar_type(PrecisionDtype dtype);

}  // namespace framework::fsdp
