#include "framework/fsdp/fully_shard.h"

#include <ATen/record_function.h>

#include "models/forward_hooks.h"

#include <torch/csrc/autograd/function_hook.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

namespace framework::fsdp {

using dtensor::Placement;
using dtensor::chunk_capacity;
using dtensor::chunk_span;

namespace {

// The parameter keeps its TensorImpl and StorageImpl (autograd's saved
// variables point at them); only the bytes behind the storage come and go.
void free_storage(const torch::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

// A parameter of a model built unmaterialised: its shape, no bytes yet.
bool unmaterialised(const torch::Tensor& p) { return p.numel() > 0 && p.storage().nbytes() == 0; }

void alloc_storage(const torch::Tensor& t, size_t nbytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

// A flat alias of the parameter's bytes that does not bump its autograd
// version counter (writing through the parameter itself would).
torch::Tensor raw_flat(const torch::Tensor& t) {
  return torch::from_blob(t.data_ptr(), {t.numel()}, t.options().requires_grad(false));
}

int64_t tensor_bytes(const torch::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// The mesh channels (DeviceMesh::create's `channels`): all-gathers, and
// everything else that is not a gradient reduction, on the axis's first
// group; reduce-scatters and the replicate axis's all-reduces on the second,
// so that an all-gather never queues behind a reduction in flight. On a
// mesh with one channel both are the same group.
constexpr int kGatherChannel = 0;
constexpr int kReduceChannel = 1;
constexpr size_t kNotInOrder = static_cast<size_t>(-1);

// work.wait(), adding the seconds it blocked to `total`.
void timed_wait(comm::Work& work, double& total) {
  if (!work.pending()) return;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    work.wait();
  } catch (...) {
    total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    throw;
  }
  total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

struct ParamSlot {
  size_t index = 0;         // position in the model's parameter order
  std::string name;
  torch::Tensor full;       // the module's parameter; storage only while gathered
  bool trainable = true;    // requires_grad
  int64_t rows = 0;         // global dim 0
  int64_t row_numel = 1;    // elements per dim-0 row
  dtensor::Span mine;       // this rank's rows
  size_t bucket = 0;        // the unit's flat buffer of this dtype and trainability
  int64_t seg_offset = 0;   // element offset inside a member's padded segment
  torch::Tensor local;      // the shard the optimizer owns
  // Tensor parallelism: `full` is this rank's part of global_shape, split
  // along tp_dim over the mesh's tensor axis (-1: whole on every TP rank).
  int64_t tp_dim = -1;
  std::vector<int64_t> global_shape;
};

// The parameters of one unit that share a dtype and trainability: one flat
// buffer, so one collective per gather and per reduction.
struct Bucket {
  torch::ScalarType dtype = torch::kFloat;
  bool trainable = true;
  std::vector<size_t> members;  // indices into Unit::params
  int64_t seg_numel = 0;        // padded elements per shard member in the flat buffers
  torch::Tensor grad_buffer;    // this rank's reduced gradients (keeps .grad views alive)
  // Gradients of the step's micro-batches that skipped the all-reduce over
  // the replicate axis (set_requires_gradient_sync(false)): summed here, in
  // the shards' dtype, and all-reduced once with the next synced backward.
  torch::Tensor unsynced;
  bool grad_views = false;  // DDP: the shards' .grad already view grad_buffer this step
};

struct FullyShardedModel::Unit {
  std::string name;
  size_t index = 0;          // in units_
  std::vector<ParamSlot> params;
  std::vector<Bucket> buckets;
  int64_t full_bytes = 0;
  size_t trainable = 0;      // parameters with requires_grad
  bool is_root = false;
  bool gathered = false;
  bool reduced = false;
  size_t grads_arrived = 0;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // kept alive
  // An all-gather issued ahead (prefetch): one per bucket, into gather_recv.
  bool gathering = false;
  std::vector<comm::Work> gather_work;
  std::vector<torch::Tensor> gather_recv;
};

// One bucket's share of a unit's gradient reduction.
struct FullyShardedModel::ReducePart {
  size_t bucket = 0;
  torch::Tensor send;   // the reduce-scatter's input (FSDP, HSDP), reduce_dtype
  torch::Tensor mine;   // its output: this rank's rows, reduce_dtype
  comm::Work rs;
  torch::Tensor grads;  // this backward's gradients of this rank, in the shards' dtype
  torch::Tensor wire;   // the replicate axis's all-reduce (DDP, HSDP), reduce_dtype
  comm::Work ar;
  bool sync = true;     // the backward that made it synced (set_requires_gradient_sync)
  bool parked = false;  // left in the bucket's unsynced sum
};

struct FullyShardedModel::Reduction {
  Unit* unit = nullptr;
  std::vector<ReducePart> parts;
  bool all_reduce = false;  // an all-reduce was issued for one of the parts
};

namespace {

class GradAccumulatedHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradAccumulatedHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

// Which sharded model and unit a module is: what UnitScope looks up.
struct UnitRegistry {
  std::mutex mu;
  std::unordered_map<const torch::nn::Module*, std::pair<FullyShardedModel*, size_t>> units;
};

UnitRegistry& registry() {
  static UnitRegistry r;
  return r;
}

bool inside(const std::string& name, const std::string& unit) {
  return name.size() > unit.size() && name.compare(0, unit.size(), unit) == 0 &&
         name[unit.size()] == '.';
}

}  // namespace

std::vector<std::string> children_of(const torch::nn::Module& model, const std::string& list) {
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (item.key() != list) continue;
    std::vector<std::string> out;
    for (const auto& child : item.value()->named_children()) out.push_back(list + "." + child.key());
    if (out.empty()) {
      throw std::invalid_argument("fully_shard: submodule '" + list + "' has no children");
    }
    return out;
  }
  throw std::invalid_argument("fully_shard: the model has no submodule '" + list + "'");
}

std::vector<std::string> modules_where(const torch::nn::Module& model, const UnitPredicate& pred) {
  std::vector<std::string> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    bool nested = false;
    for (const std::string& u : out) nested = nested || inside(item.key(), u);
    if (!nested && pred(item.key(), *item.value())) out.push_back(item.key());
  }
  return out;
}

UnitScope::UnitScope(const torch::nn::Module& unit) {
  {
    UnitRegistry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.units.find(&unit);
    if (it == r.units.end()) return;
    owner_ = it->second.first;
    unit_ = it->second.second;
  }
  FullyShardedModel& m = *owner_;
  FullyShardedModel::Unit& u = *m.units_[unit_];
  m.gather(u);
  if (!m.in_backward_) {
    // A forward (not activation checkpointing's recompute in backward):
    // record the order, and issue the next units' all-gathers.
    if (unit_ < m.seen_.size() && !m.seen_[unit_]) {
      m.seen_[unit_] = true;
      m.this_order_.push_back(unit_);
    }
    m.prefetch_next(u, /*backward=*/false);
  }
  m.log("forward", u);
}

torch::Tensor UnitScope::output(torch::Tensor out) {
  if (owner_ == nullptr) return out;
  has_output_ = true;
  if (torch::GradMode::is_enabled() && out.requires_grad()) {
    // Fires when the gradient of this unit's output is ready, i.e. right
    // before the unit's own backward ops run.
    FullyShardedModel* owner = owner_;
    FullyShardedModel::Unit* unit = owner_->units_[unit_].get();
    out.register_hook([owner, unit](const torch::Tensor&) { owner->before_unit_backward(*unit); });
  }
  return out;
}

UnitScope::~UnitScope() {
  if (owner_ == nullptr) return;
  const bool training = torch::GradMode::is_enabled();
  // Without an output there is no hook to gather again for backward: keep
  // the parameters until the unit's gradients are reduced.
  // With prefetch on, the forward's last unit stays gathered: its backward
  // comes first, right after the loss.
  const bool keep = owner_->options_.prefetch > 0 && owner_->last_in_order(unit_);
  if (!training || (has_output_ && owner_->options_.reshard_after_forward && !keep)) {
    owner_->release(*owner_->units_[unit_]);
  }
}

std::vector<int64_t> mesh_shape_for(const ParallelOptions& o, int world) {
  int64_t r = o.replicate, s = o.shard;
  if (r == -1 && s == -1) {
    throw std::invalid_argument("parallel.replicate and parallel.shard cannot both be -1");
  }
  if (o.tensor < 1 || world % o.tensor != 0) {
    throw std::invalid_argument("parallel.tensor (" + std::to_string(o.tensor) +
                                ") does not divide the world size " + std::to_string(world));
  }
  if (o.tensor > 1) {
    ParallelOptions data_parallel;
    data_parallel.replicate = o.replicate;
    data_parallel.shard = o.shard;
    std::vector<int64_t> dp = mesh_shape_for(data_parallel, static_cast<int>(world / o.tensor));
    return {dp[0], dp[1], o.tensor};
  }
  if (r == -1) r = world % s == 0 ? world / s : -1;
  if (s == -1) s = world % r == 0 ? world / r : -1;
  if (r < 1 || s < 1 || r * s != world) {
    throw std::invalid_argument("parallel.replicate (" + std::to_string(o.replicate) +
                                ") x parallel.shard (" + std::to_string(o.shard) +
                                ") does not match the " +
                                (o.tensor > 1 ? "data-parallel size " : "world size ") +
                                std::to_string(world));
  }
  return {r, s};
}

void move_to_device(torch::nn::Module& module, torch::Device device) {
  bool any_unmaterialised = false;
  for (const auto& p : module.parameters()) any_unmaterialised |= unmaterialised(p);
  if (!any_unmaterialised) {
    module.to(device);
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters()) {
    if (unmaterialised(p)) {
      p.set_data(torch::empty(p.sizes(), p.options().device(device)));
      free_storage(p);
    } else {
      p.set_data(p.to(device));
    }
  }
  for (auto& b : module.buffers()) b.set_data(b.to(device));
}

torch::ScalarType to_scalar_type(PrecisionDtype dtype) {
  switch (dtype) {
    case PrecisionDtype::kFp32: return torch::kFloat;
    case PrecisionDtype::kBf16: return torch::kBFloat16;
  }
  return torch::kFloat;
}

std::string layout_name(const std::vector<int64_t>& shape) {
  const bool tp = shape.size() > 2 && shape[2] > 1;
  std::string dp;
  if (shape.at(1) == 1) {
    dp = shape.at(0) == 1 ? (tp ? "" : "single") : "ddp";
  } else {
    dp = shape.at(0) == 1 ? "fsdp" : "hsdp";
  }
  if (!tp) return dp;
  return dp.empty() ? "tp" : dp + "+tp";
}

std::unique_ptr<FullyShardedModel> fully_shard(std::shared_ptr<torch::nn::Module> module,
                                               std::shared_ptr<dtensor::DeviceMesh> mesh,
                                               ParallelOptions options,
                                               std::vector<std::string> units,
                                               ParamInit init) {
  return std::make_unique<FullyShardedModel>(std::move(module), std::move(mesh), options,
                                             std::move(units), std::move(init));
}

namespace {

// A parameter tensor to shard, under its first name; `unit` is the unit
// whose name prefixes it (0: the root).
struct FoundParam {
  std::string name;
  torch::Tensor tensor;
  size_t unit;
};

// The unit of parameter `param`: the unit whose name prefixes it, else the root.
size_t unit_of_param(const std::vector<std::unique_ptr<FullyShardedModel::Unit>>& units,
                     const std::string& param) {
  for (size_t u = 1; u < units.size(); ++u) {
    if (inside(param, units[u]->name)) return u;
  }
  return 0;
}

// Throws std::invalid_argument naming `name` when `p` cannot be sharded.
void check_shardable(const std::string& name, const torch::Tensor& p, bool have_init) {
  if (p.dim() == 0) {
    throw std::invalid_argument("fully_shard: parameter " + name +
                                " is 0-d; give it shape [1] to shard it");
  }
  const bool no_storage = unmaterialised(p);
  if (no_storage && !have_init) {
    throw std::invalid_argument("fully_shard: parameter " + name +
                                " has no storage (a model built unmaterialised) and no "
                                "initialiser was given");
  }
  if (!p.is_contiguous() || p.storage_offset() != 0 ||
      (!no_storage && p.storage().nbytes() != static_cast<size_t>(tensor_bytes(p)))) {
    throw std::invalid_argument("fully_shard: parameter " + name +
                                " does not own a dense storage of its own (a view?)");
  }
}

// One entry per parameter tensor, in parameter order: tied names collapse
// onto the first, and a tensor tied across units belongs to the root.
std::vector<FoundParam> find_params(const torch::nn::Module& module,
                                    const std::vector<std::unique_ptr<FullyShardedModel::Unit>>& units,
                                    bool have_init) {
  std::vector<FoundParam> found;
  std::unordered_map<const c10::TensorImpl*, size_t> seen;
  for (const auto& item : module.named_parameters()) {
    const torch::Tensor& p = item.value();
    const size_t unit = unit_of_param(units, item.key());
    auto it = seen.find(p.unsafeGetTensorImpl());
    if (it != seen.end()) {
      if (found[it->second].unit != unit) found[it->second].unit = 0;
      continue;
    }
    check_shardable(item.key(), p, have_init);
    seen.emplace(p.unsafeGetTensorImpl(), found.size());
    found.push_back({item.key(), p, unit});
  }
  return found;
}

}  // namespace

FullyShardedModel::FullyShardedModel(std::shared_ptr<torch::nn::Module> module,
                                     std::shared_ptr<dtensor::DeviceMesh> mesh,
                                     ParallelOptions options, std::vector<std::string> unit_names,
                                     ParamInit init)
    : module_(std::move(module)), mesh_(std::move(mesh)), options_(options) {
  set_mesh_and_precision();
  const std::vector<const torch::nn::Module*> unit_modules = make_units(unit_names);
  const std::vector<FoundParam> found = find_params(*module_, units_, static_cast<bool>(init));
  torch::NoGradGuard no_grad;
  for (size_t index = 0; index < found.size(); ++index) {
    add_param(found[index].name, found[index].tensor, *units_[found[index].unit], index, init);
  }
  for (const auto& item : module_->named_buffers()) buffers_.emplace_back(item.key(), item.value());
  index_params_and_hook_grads();
  register_units(unit_modules);
}

void FullyShardedModel::set_mesh_and_precision() {
  TORCH_CHECK(mesh_->ndim() == 2 || mesh_->ndim() == 3,
              "fully_shard needs a {replicate, shard} or {replicate, shard, tensor} mesh");
  if (mesh_->ndim() == 3) {
    tensor_axis_ = 2;
    // DTensors nest the tensor axis's split inside-out of FSDP's: a view
    // of the mesh with the tensor axis before the shard axis.
    param_mesh_ = mesh_->permuted({replicate_axis_, tensor_axis_, shard_axis_});
  } else {
    param_mesh_ = mesh_;
  }
  param_dtype_ = to_scalar_type(options_.mixed_precision.param_dtype);
  reduce_dtype_ = to_scalar_type(options_.mixed_precision.reduce_dtype);
  mixed_ = param_dtype_ != torch::kFloat || reduce_dtype_ != torch::kFloat;
}

// The root unit, then one per name; the names must exist and must not
// nest. Returns each unit's module (the root's: the model).
std::vector<const torch::nn::Module*> FullyShardedModel::make_units(
    const std::vector<std::string>& unit_names) {
  std::unordered_map<std::string, std::shared_ptr<torch::nn::Module>> by_name;
  for (const auto& item : module_->named_modules("", /*include_self=*/false)) {
    by_name.emplace(item.key(), item.value());
  }
  units_.push_back(std::make_unique<Unit>());
  units_[0]->name = "root";
  units_[0]->is_root = true;
  std::vector<const torch::nn::Module*> unit_modules = {module_.get()};
  for (const std::string& name : unit_names) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      throw std::invalid_argument("fully_shard: unit '" + name + "' is not a submodule of the model");
    }
    for (size_t u = 1; u < units_.size(); ++u) {
      const std::string& other = units_[u]->name;
      if (other == name || inside(name, other) || inside(other, name)) {
        throw std::invalid_argument("fully_shard: units '" + other + "' and '" + name +
                                    "' overlap; units must not nest or repeat");
      }
    }
    units_.push_back(std::make_unique<Unit>());
    units_.back()->name = name;
    units_.back()->index = units_.size() - 1;
    unit_modules.push_back(it->second.get());
  }
  std::vector<size_t> order;
  for (size_t u = 1; u < units_.size(); ++u) order.push_back(u);
  set_order(std::move(order));
  return unit_modules;
}

// Takes over parameter `p` (number `index` in parameter order) into `unit`:
// materialises it if it has no storage, keeps this rank's shard (or DDP's
// master copy), casts the module's tensor to param_dtype, frees its storage
// (FSDP) and files it in the unit's bucket of its dtype and trainability.
void FullyShardedModel::add_param(const std::string& name, const torch::Tensor& p, Unit& unit,
                                  size_t index, const ParamInit& init) {
  const int64_t shards = mesh_->size(shard_axis_);
  ParamSlot slot;
  slot.index = index;
  slot.name = name;
  slot.full = p;
  slot.trainable = p.requires_grad();
  slot.rows = p.size(0);
  slot.global_shape = p.sizes().vec();
  if (auto tp = options_.tensor_parallel.find(name); tp != options_.tensor_parallel.end()) {
    if (tensor_axis_ < 0 && tp->second.dim >= 0) {
      throw std::invalid_argument("fully_shard: parameter " + name +
                                  " is split by tensor parallelism but the mesh has no tensor axis");
    }
    slot.tp_dim = tp->second.dim;
    slot.global_shape = tp->second.global_shape;
  }
  slot.row_numel = slot.rows == 0 ? 0 : p.numel() / slot.rows;
  slot.mine = chunk_span(slot.rows, shards, mesh_->coordinate(shard_axis_));
  if (unmaterialised(p)) {
    // Materialise this one parameter: it is sliced and freed below.
    alloc_storage(p, static_cast<size_t>(tensor_bytes(p)));
    init(name, p);
  }
  // The local shard (or DDP's master copy) keeps the parameter's dtype;
  // the module's parameter takes param_dtype.
  const bool cast = mixed_ && p.is_floating_point() && p.scalar_type() != param_dtype_;
  if (shards == 1 && !cast) {
    slot.local = p;  // DDP: the optimizer updates the module parameter itself
  } else {
    slot.local = p.narrow(0, slot.mine.offset, slot.mine.size).clone().set_requires_grad(slot.trainable);
  }
  if (cast) {
    p.set_data(torch::empty(p.sizes(), p.options().dtype(param_dtype_)));
    if (shards == 1) raw_flat(p).copy_(slot.local.reshape({-1}));
  }
  if (shards > 1) free_storage(p);  // one full parameter at a time
  add_to_bucket(unit, std::move(slot));
}

// Files `slot` (its module tensor already in param_dtype) in the unit's
// bucket of its dtype and trainability, and counts its bytes.
void FullyShardedModel::add_to_bucket(Unit& unit, ParamSlot slot) {
  const torch::Tensor& p = slot.full;
  size_t b = 0;
  while (b < unit.buckets.size() &&
         (unit.buckets[b].dtype != p.scalar_type() || unit.buckets[b].trainable != slot.trainable)) {
    ++b;
  }
  if (b == unit.buckets.size()) {
    unit.buckets.emplace_back();
    unit.buckets.back().dtype = p.scalar_type();
    unit.buckets.back().trainable = slot.trainable;
  }
  Bucket& bucket = unit.buckets[b];
  slot.bucket = b;
  slot.seg_offset = bucket.seg_numel;
  bucket.seg_numel += chunk_capacity(slot.rows, mesh_->size(shard_axis_)) * slot.row_numel;
  bucket.members.push_back(unit.params.size());
  unit.full_bytes += tensor_bytes(p);
  unit.trainable += slot.trainable ? 1 : 0;
  stats_.sharded_param_bytes += tensor_bytes(slot.local);
  stats_.full_param_bytes += tensor_bytes(p);
  unit.params.push_back(std::move(slot));
}

// param_index_ in the model's parameter order, and a hook on every
// trainable parameter's gradient accumulator that counts its unit's
// arrived gradients.
void FullyShardedModel::index_params_and_hook_grads() {
  for (auto& u : units_) {
    Unit* unit = u.get();
    stats_.largest_unit_bytes = std::max(stats_.largest_unit_bytes, unit->full_bytes);
    for (ParamSlot& slot : unit->params) {
      param_index_.emplace_back(unit, &slot - unit->params.data());
      if (slot.trainable) {
        // Holding the AccumulateGrad node keeps the same node (and our hook)
        // for every step: the parameter only keeps a weak reference to it.
        auto acc = torch::autograd::impl::grad_accumulator(slot.full);
        acc->add_post_hook(std::make_unique<GradAccumulatedHook>([this, unit] {
          on_grad_accumulated(*unit);
        }));
        unit->accumulators.push_back(std::move(acc));
      }
    }
  }
  std::sort(param_index_.begin(), param_index_.end(),
            [](const auto& a, const auto& b) {
              return a.first->params[a.second].index < b.first->params[b.second].index;
            });
}

namespace {

// The unit hook (models/forward_hooks.h): what models::run_unit calls.
torch::Tensor gather_around_unit(const torch::nn::Module& unit, const models::UnitFn& fn) {
  return run_unit(unit, fn);
}

}  // namespace

// From here on UnitScope (and models::run_unit, through the unit hook) finds
// the units.
void FullyShardedModel::register_units(const std::vector<const torch::nn::Module*>& unit_modules) {
  models::set_unit_hook(&gather_around_unit);
  UnitRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (size_t u = 1; u < units_.size(); ++u) r.units[unit_modules[u]] = {this, u};
}

FullyShardedModel::~FullyShardedModel() {
  UnitRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto it = r.units.begin(); it != r.units.end();) {
    it = it->second.first == this ? r.units.erase(it) : std::next(it);
  }
}

std::vector<std::string> FullyShardedModel::unit_names() const {
  std::vector<std::string> out;
  for (const auto& u : units_) out.push_back(u->name);
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> FullyShardedModel::buffers() const {
  return buffers_;
}

bool FullyShardedModel::param_trainable(size_t index) const {
  const auto& [unit, slot] = param_index_.at(index);
  return unit->params[slot].trainable;
}

void FullyShardedModel::set_order(std::vector<size_t> order) {
  order_ = std::move(order);
  pos_.assign(units_.size(), kNotInOrder);
  for (size_t i = 0; i < order_.size(); ++i) pos_[order_[i]] = i;
}

bool FullyShardedModel::last_in_order(size_t unit) const {
  return !order_.empty() && order_.back() == unit;
}

void FullyShardedModel::log(const char* what, const Unit& unit) {
  if (log_schedule_) schedule_.push_back(std::string(what) + " " + unit.name);
}

void FullyShardedModel::begin_forward() {
  const bool ddp = mesh_->size(shard_axis_) == 1;
  for (auto& u : units_) {
    u->reduced = false;
    u->grads_arrived = 0;
    if (ddp) u->gathered = false;  // refreshed from the (updated) masters by gather
  }
  in_backward_ = false;
  this_order_.clear();
  seen_.assign(units_.size(), false);
  if (torch::GradMode::is_enabled() && options_.broadcast_buffers) broadcast_buffers();
  issue_gather(*units_[0]);
  // The first units' all-gathers go out behind the root's.
  for (size_t i = 0; !ddp && i < order_.size() && i < static_cast<size_t>(options_.prefetch); ++i) {
    issue_gather(*units_[order_[i]]);
  }
  gather(*units_[0]);
}

void FullyShardedModel::end_forward() {
  if (!this_order_.empty() && this_order_ != order_) set_order(this_order_);
  if (torch::GradMode::is_enabled()) return;  // the root is needed for backward
  for (auto& u : units_) release(*u);
}

void FullyShardedModel::abort_forward() {
  for (auto& u : units_) {
    try {
      release(*u);
    } catch (...) {
      // The forward's own error is the one to report.
    }
  }
}

void FullyShardedModel::rethrow_forward_error(const c10::Error& e) {
  const std::string what = e.what_without_backtrace();
  // How LibTorch 1.13 and 2.x report a read of a tensor without storage.
  if (what.find("storage of size 0") != std::string::npos ||
      what.find("data is not allocated") != std::string::npos ||
      what.find("storage has") != std::string::npos) {
    std::string units;
    for (size_t u = 1; u < units_.size(); ++u) units += (u > 1 ? ", " : "") + units_[u]->name;
    throw std::runtime_error(
        "fully_shard: the forward used a parameter that is not gathered: call each unit (" +
        units + ") through fsdp::run_unit or a UnitScope in the model's forward (" + what + ")");
  }
  throw;
}

void FullyShardedModel::broadcast_buffers() {
  torch::NoGradGuard no_grad;
  for (auto& [name, buffer] : buffers_) {
    if (!buffer.defined() || buffer.numel() == 0) continue;
    for (int axis : {shard_axis_, replicate_axis_, tensor_axis_}) {
      if (axis < 0 || mesh_->size(axis) == 1) continue;
      torch::Tensor t = buffer.is_contiguous() ? buffer : buffer.contiguous();
      mesh_->group(axis).broadcast(t, 0);
      if (!t.is_same(buffer)) buffer.copy_(t);
    }
  }
}



void FullyShardedModel::gather(Unit& unit) {
  if (unit.gathered) return;
  issue_gather(unit);
  finish_gather(unit);
}

// Packs this rank's shards of each bucket and issues the bucket's
// all-gather; finish_gather waits for it and fills the parameters.
void FullyShardedModel::issue_gather(Unit& unit) {
  if (unit.gathered || unit.gathering) return;
  RECORD_USER_SCOPE("shardkit::fsdp_gather");  // a profile's phase (docs/gpu.md)
  const int64_t shards = mesh_->size(shard_axis_);
  torch::NoGradGuard no_grad;
  if (shards == 1) {
    // DDP: parameters are always whole; under mixed precision they are
    // refreshed from the master copies (which the optimizer changed).
    for (const ParamSlot& p : unit.params) {
      if (!p.local.is_same(p.full)) raw_flat(p.full).copy_(p.local.reshape({-1}));
    }
    unit.gathered = true;
    return;
  }
  log("gather.issue", unit);
  unit.gathering = true;
  for (const Bucket& bucket : unit.buckets) {
    // In the module parameters' dtype (param_dtype): the cast to it happens
    // before the all-gather, which then moves half the bytes for bf16.
    auto dtype = unit.params[bucket.members.front()].local.options().requires_grad(false).dtype(
        bucket.dtype);
    torch::Tensor send = torch::zeros({bucket.seg_numel}, dtype);
    for (size_t m : bucket.members) {
      const ParamSlot& p = unit.params[m];
      send.narrow(0, p.seg_offset, p.mine.size * p.row_numel).copy_(p.local.reshape({-1}));
    }
    torch::Tensor recv = torch::empty({shards * bucket.seg_numel}, dtype);
    unit.gather_work.push_back(mesh_->group(shard_axis_, kGatherChannel).all_gather_async(recv, send));
    unit.gather_recv.push_back(recv);
  }
  live_bytes_ += unit.full_bytes;
  stats_.peak_gathered_bytes = std::max(stats_.peak_gathered_bytes, live_bytes_);
}

void FullyShardedModel::finish_gather(Unit& unit) {
  if (!unit.gathering) return;
  RECORD_USER_SCOPE("shardkit::fsdp_gather");
  torch::NoGradGuard no_grad;
  const int64_t shards = mesh_->size(shard_axis_);
  std::vector<comm::Work> work = std::move(unit.gather_work);
  std::vector<torch::Tensor> recv = std::move(unit.gather_recv);
  unit.gather_work.clear();
  unit.gather_recv.clear();
  unit.gathering = false;
  try {
    for (size_t b = 0; b < unit.buckets.size(); ++b) {
      const Bucket& bucket = unit.buckets[b];
      timed_wait(work[b], comm_wait_s_);
      for (size_t m : bucket.members) {
        const ParamSlot& p = unit.params[m];
        alloc_storage(p.full, static_cast<size_t>(tensor_bytes(p.full)));
        torch::Tensor dst = raw_flat(p.full);
        for (int64_t r = 0; r < shards; ++r) {
          dtensor::Span span = chunk_span(p.rows, shards, r);
          dst.narrow(0, span.offset * p.row_numel, span.size * p.row_numel)
              .copy_(recv[b].narrow(0, r * bucket.seg_numel + p.seg_offset, span.size * p.row_numel));
        }
      }
      recv[b] = torch::Tensor();
    }
  } catch (...) {
    for (const ParamSlot& p : unit.params) free_storage(p.full);
    live_bytes_ -= unit.full_bytes;
    throw;
  }
  unit.gathered = true;
  log("gather.wait", unit);
}

void FullyShardedModel::prefetch_next(const Unit& unit, bool backward) {
  const size_t n = static_cast<size_t>(std::max<int64_t>(options_.prefetch, 0));
  if (n == 0 || mesh_->size(shard_axis_) == 1 || unit.is_root) return;
  const size_t p = pos_[unit.index];
  if (p == kNotInOrder) return;
  for (size_t j = 1; j <= n; ++j) {
    if (backward ? j > p : p + j >= order_.size()) break;
    issue_gather(*units_[order_[backward ? p - j : p + j]]);
  }
}

// The hook on a unit's output: its gradient arrived, so the unit's own
// backward is next. Its parameters are gathered (or its prefetched gather
// waited for), and the gathers of the units whose backward comes after it
// go out.
void FullyShardedModel::before_unit_backward(Unit& unit) {
  in_backward_ = true;
  log("backward", unit);
  gather(unit);
  prefetch_next(unit, /*backward=*/true);
}

void FullyShardedModel::release(Unit& unit) {
  finish_gather(unit);  // a prefetched all-gather that no forward used
  if (!unit.gathered) return;
  // DDP: the parameters stay whole (and up to date) until the next forward.
  if (mesh_->size(shard_axis_) == 1) return;
  unit.gathered = false;
  for (const ParamSlot& p : unit.params) free_storage(p.full);
  live_bytes_ -= unit.full_bytes;
}

void FullyShardedModel::on_grad_accumulated(Unit& unit) {
  if (mesh_->size(shard_axis_) > 1) {
    // A full gradient of this unit now exists until the unit is reduced.
    live_bytes_ += unit.full_bytes / static_cast<int64_t>(unit.params.size());
    stats_.peak_gathered_bytes = std::max(stats_.peak_gathered_bytes, live_bytes_);
  }
  if (++unit.grads_arrived == unit.trainable) reduce_grads(unit);
}

// This backward's gradients `part.grads` (this rank's, in the shards' dtype;
// for HSDP already reduce-scattered) over the replicate axis (DDP, HSDP):
// summed across replicas, in the reduce dtype, only when this backward
// syncs; until then they wait in `unsynced`, so each micro-batch's
// gradients are all-reduced exactly once, whichever backward passes sync.
// Without replicas (FSDP) there is nothing to do.
void FullyShardedModel::issue_replicated(Bucket& bucket, ReducePart& part) {
  if (mesh_->size(replicate_axis_) == 1) return;
  if (bucket.unsynced.defined()) part.grads.add_(bucket.unsynced);
  if (!part.sync) {
    bucket.unsynced = part.grads;
    part.parked = true;
    return;
  }
  bucket.unsynced = torch::Tensor();
  part.wire = part.grads.to(comm_dtype(bucket.dtype));
  part.ar = mesh_->group(replicate_axis_, kReduceChannel).all_reduce_async(part.wire);
}

// Adds the reduced gradients to what earlier backward passes of the step
// left in the bucket, and points the shards' .grad at it.
void FullyShardedModel::finish_replicated(Unit& unit, Bucket& bucket, ReducePart& part) {
  if (part.parked) return;
  if (part.wire.defined()) {
    timed_wait(part.ar, comm_wait_s_);
    if (!part.wire.is_same(part.grads)) part.grads.copy_(part.wire);
    part.wire = torch::Tensor();
  }
  if (bucket.grad_buffer.defined()) {
    bucket.grad_buffer.add_(part.grads);  // accumulation: the shards' .grad are views of it
  } else {
    bucket.grad_buffer = part.grads;
  }
  part.grads = torch::Tensor();
  if (mesh_->size(shard_axis_) == 1) {
    // DDP: until the step's last backward the sum stays in the buffer: the
    // parameter is its own shard here, so a .grad view would have the next
    // backward accumulate into it.
    if (!part.sync) return;
    for (size_t m : bucket.members) {
      ParamSlot& p = unit.params[m];
      p.local.mutable_grad() =
          bucket.grad_buffer.narrow(0, p.seg_offset, p.local.numel()).view(p.local.sizes());
    }
    bucket.grad_views = true;
    return;
  }
  for (size_t m : bucket.members) {
    ParamSlot& p = unit.params[m];
    p.local.mutable_grad() =
        bucket.grad_buffer.narrow(0, p.seg_offset, p.mine.size * p.row_numel).view(p.local.sizes());
  }
}

torch::ScalarType FullyShardedModel::comm_dtype(torch::ScalarType bucket_dtype) const {
  return mixed_ && at::isFloatingType(bucket_dtype) ? reduce_dtype_ : bucket_dtype;
}

// This backward's gradients of the unit, reduced (summed over the
// data-parallel ranks) in reduce_dtype and added, in the shards' dtype, to
// what earlier backward passes of the step left in the shards' .grad.
// With prefetch 0 the reduction is complete on return. Otherwise the
// reduce-scatters (then the replicate axis's all-reduces) stay in flight
// while the backward goes on: at most `prefetch` of each once this one is
// issued, the older ones waited for before this one's buffers exist, and
// all of them by finish_backward.
void FullyShardedModel::reduce_grads(Unit& unit) {
  if (unit.reduced) return;
  RECORD_USER_SCOPE("shardkit::fsdp_reduce");
  unit.reduced = true;
  torch::NoGradGuard no_grad;
  const bool ddp = mesh_->size(shard_axis_) == 1;
  const size_t limit = static_cast<size_t>(std::max<int64_t>(options_.prefetch, 1));
  while (!reducing_.empty() && reducing_.size() >= limit) wait_reduce_scatter();
  auto rec = std::make_unique<Reduction>();
  rec->unit = &unit;
  for (size_t b = 0; b < unit.buckets.size(); ++b) {
    if (!unit.buckets[b].trainable) continue;
    ReducePart part;
    part.bucket = b;
    part.sync = sync_;
    if (ddp) {
      take_replicated_grads(unit, unit.buckets[b], part);
    } else {
      issue_reduce_scatter(unit, unit.buckets[b], part);
    }
    rec->parts.push_back(std::move(part));
  }
  if (!ddp) {
    if (!rec->parts.empty()) log("reduce.issue", unit);
    release(unit);
  }
  reducing_.push_back(std::move(rec));
  if (ddp) wait_reduce_scatter();  // DDP: no reduce-scatter; its all-reduce goes out now
  if (options_.prefetch <= 0) drain_reductions();
}

// DDP: the bucket's gradients as one flat tensor, for one all-reduce
// across replicas with those of the micro-batches that skipped it. The
// parameter is its own shard, so once its .grad views the reduced sum, a
// further backward would add to that sum in place and have it summed again.
void FullyShardedModel::take_replicated_grads(Unit& unit, Bucket& bucket, ReducePart& part) {
  if (bucket.grad_views) {
    throw std::logic_error(
        "fully_shard (DDP): a backward after this step's gradients were already synced would "
        "count them twice: call set_requires_gradient_sync(false) before every backward of a "
        "step but the last, and zero_grad() before the next step");
  }
  const auto local_options = unit.params[bucket.members.front()].local.options().requires_grad(false);
  torch::Tensor flat = torch::zeros({bucket.seg_numel}, local_options.dtype(comm_dtype(bucket.dtype)));
  for (size_t m : bucket.members) {
    const ParamSlot& p = unit.params[m];
    if (p.full.grad().defined()) {
      flat.narrow(0, p.seg_offset, p.full.numel()).copy_(p.full.grad().reshape({-1}));
    }
  }
  part.grads = flat.to(local_options.dtype());
  for (size_t m : bucket.members) unit.params[m].full.mutable_grad().reset();
}

// FSDP, HSDP: the bucket's full gradients packed rank by rank into one send
// buffer, and its reduce-scatter over the shard axis issued on the
// reduction channel; the full gradients are freed.
void FullyShardedModel::issue_reduce_scatter(Unit& unit, Bucket& bucket, ReducePart& part) {
  const int64_t shards = mesh_->size(shard_axis_);
  const auto comm = unit.params[bucket.members.front()].local.options().requires_grad(false).dtype(
      comm_dtype(bucket.dtype));
  part.send = torch::zeros({shards * bucket.seg_numel}, comm);
  for (size_t m : bucket.members) {
    const ParamSlot& p = unit.params[m];
    const torch::Tensor& g = p.full.grad();
    if (!g.defined()) continue;  // unused parameter: contributes zeros
    torch::Tensor flat = g.reshape({-1});
    for (int64_t r = 0; r < shards; ++r) {
      dtensor::Span span = chunk_span(p.rows, shards, r);
      part.send.narrow(0, r * bucket.seg_numel + p.seg_offset, span.size * p.row_numel)
          .copy_(flat.narrow(0, span.offset * p.row_numel, span.size * p.row_numel));
    }
  }
  part.mine = torch::empty({bucket.seg_numel}, comm);
  part.rs = mesh_->group(shard_axis_, kReduceChannel).reduce_scatter_async(part.mine, part.send);
  // The send buffer now holds what the full gradients held.
  for (size_t m : bucket.members) {
    ParamSlot& p = unit.params[m];
    if (p.full.grad().defined()) live_bytes_ -= tensor_bytes(p.full);
    p.full.mutable_grad().reset();
  }
  live_bytes_ += tensor_bytes(part.send);
  stats_.peak_gathered_bytes = std::max(stats_.peak_gathered_bytes, live_bytes_);
}

// The oldest reduction's reduce-scatters are waited for; its all-reduces
// over the replicate axis go out.
void FullyShardedModel::wait_reduce_scatter() {
  std::unique_ptr<Reduction> rec = std::move(reducing_.front());
  reducing_.pop_front();
  Unit& unit = *rec->unit;
  const bool scattered = mesh_->size(shard_axis_) > 1;
  for (ReducePart& part : rec->parts) {
    if (!scattered) continue;
    const auto local_dtype = unit.params[unit.buckets[part.bucket].members.front()].local.scalar_type();
    timed_wait(part.rs, comm_wait_s_);
    live_bytes_ -= tensor_bytes(part.send);
    part.send = torch::Tensor();
    part.grads = part.mine.to(local_dtype);
    part.mine = torch::Tensor();
  }
  if (scattered && !rec->parts.empty()) log("reduce.wait", unit);
  for (ReducePart& part : rec->parts) {
    issue_replicated(unit.buckets[part.bucket], part);
    rec->all_reduce = rec->all_reduce || part.wire.defined();
  }
  if (rec->all_reduce) log("allreduce.issue", unit);
  replicating_.push_back(std::move(rec));
  const size_t limit = static_cast<size_t>(std::max<int64_t>(options_.prefetch, 0));
  while (replicating_.size() > limit) wait_all_reduce();
}

void FullyShardedModel::wait_all_reduce() {
  std::unique_ptr<Reduction> rec = std::move(replicating_.front());
  replicating_.pop_front();
  Unit& unit = *rec->unit;
  for (ReducePart& part : rec->parts) finish_replicated(unit, unit.buckets[part.bucket], part);
  if (rec->all_reduce) log("allreduce.wait", unit);
}

void FullyShardedModel::drain_reductions() {
  while (!reducing_.empty()) wait_reduce_scatter();
  while (!replicating_.empty()) wait_all_reduce();
}

void FullyShardedModel::finish_backward() {
  // Units are visited in backward order (last unit to first, then root), the
  // same on every rank, so any catch-up collectives line up.
  for (size_t i = units_.size(); i-- > 1;) reduce_grads(*units_[i]);
  reduce_grads(*units_[0]);
  drain_reductions();
  for (auto& u : units_) release(*u);
  in_backward_ = false;
}

std::vector<torch::Tensor> FullyShardedModel::local_params() const {
  std::vector<torch::Tensor> out;
  for (const auto& [unit, slot] : param_index_) out.push_back(unit->params[slot].local);
  return out;
}

std::vector<std::string> FullyShardedModel::param_names() const {
  std::vector<std::string> out;
  for (const auto& [unit, slot] : param_index_) out.push_back(unit->params[slot].name);
  return out;
}

dtensor::DTensor FullyShardedModel::like_param(size_t index, torch::Tensor local) const {
  const auto& [unit, slot] = param_index_.at(index);
  const ParamSlot& p = unit->params[slot];
  const Placement fsdp = mesh_->size(shard_axis_) > 1 ? Placement::shard(0) : Placement::replicate();
  if (tensor_axis_ < 0) {
    return dtensor::DTensor(std::move(local), p.full.sizes().vec(), mesh_,
                            {Placement::replicate(), fsdp});
  }
  // On the {replicate, tensor, shard} view: TP's split, then FSDP's rows of it.
  const Placement tp = p.tp_dim >= 0 ? Placement::shard(p.tp_dim) : Placement::replicate();
  return dtensor::DTensor(std::move(local), p.global_shape, param_mesh_,
                          {Placement::replicate(), tp, fsdp});
}

dtensor::DTensor FullyShardedModel::param_dtensor(size_t index) const {
  const auto& [unit, slot] = param_index_.at(index);
  return like_param(index, unit->params[slot].local);
}

double FullyShardedModel::grad_norm() {
  torch::NoGradGuard no_grad;
  const auto params = local_params();
  auto device = params.empty() ? torch::Device(torch::kCPU) : params.front().device();
  torch::Tensor sq = torch::zeros({1}, torch::TensorOptions().dtype(torch::kDouble).device(device));
  // Parameters that tensor parallelism keeps whole have equal gradients on
  // every TP rank: the first of the tensor axis counts them.
  const bool tp_first = tensor_axis_ < 0 || mesh_->coordinate(tensor_axis_) == 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& t = params[i];
    const auto& [unit, slot] = param_index_[i];
    if (unit->params[slot].tp_dim < 0 && !tp_first) continue;
    if (t.grad().defined() && t.numel() > 0) sq += t.grad().to(torch::kDouble).pow(2).sum();
  }
  // Shards are disjoint across the shard and tensor axes; replicas hold
  // equal gradients.
  if (mesh_->size(shard_axis_) > 1) mesh_->group(shard_axis_).all_reduce(sq);
  if (tensor_axis_ >= 0 && mesh_->size(tensor_axis_) > 1) mesh_->group(tensor_axis_).all_reduce(sq);
  return std::sqrt(sq.item<double>());
}

double FullyShardedModel::clip_grad_norm(double max_norm) {
  double norm = grad_norm();
  double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    torch::NoGradGuard no_grad;
    for (const torch::Tensor& t : local_params()) {
      if (t.grad().defined()) t.grad().mul_(coef);
    }
  }
  return norm;
}

void FullyShardedModel::zero_grad() {
  for (const torch::Tensor& t : local_params()) {
    const_cast<torch::Tensor&>(t).mutable_grad().reset();
  }
  for (auto& u : units_) {
    for (Bucket& b : u->buckets) {
      b.grad_buffer = torch::Tensor();
      b.unsynced = torch::Tensor();
      b.grad_views = false;
    }
  }
}

void FullyShardedModel::reset_peak_memory() { stats_.peak_gathered_bytes = live_bytes_; }

}  // namespace framework::fsdp
