#include "framework/fsdp/fully_shard.h"
#include "framework/fsdp/fully_shard_impl.h"

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

std::unique_ptr<FullyShardedModel> fully_shard(std::shared_ptr<torch::nn::Module> module,
                                               std::shared_ptr<dtensor::DeviceMesh> mesh,
                                               FsdpOptions options,
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
                                     FsdpOptions options, std::vector<std::string> unit_names,
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
  if (options_.expert_parallel.mesh) {
    expert_mesh_ = options_.expert_parallel.mesh;
    // With tensor parallelism the experts are whole on every tensor rank:
    // the expert mesh's fourth axis is the stage's tensor axis.
    const bool tp = tensor_axis_ >= 0;
    TORCH_CHECK(expert_mesh_->ndim() == (tp ? 4 : 3) &&
                    expert_mesh_->size(1) * expert_mesh_->size(2) == mesh_->size(shard_axis_) &&
                    expert_mesh_->size(0) == mesh_->size(replicate_axis_) &&
                    (!tp || expert_mesh_->size(3) == mesh_->size(tensor_axis_)),
                "fully_shard: the expert mesh must be {replicate, expert_shard, expert[, tensor]} over the shard axis");
    expert_param_mesh_ = tp ? expert_mesh_->permuted({0, 2, 1, 3}) : expert_mesh_->permuted({0, 2, 1});
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
  ParamSlot slot;
  slot.index = index;
  slot.name = name;
  slot.full = p;
  slot.trainable = p.requires_grad();
  slot.rows = p.size(0);
  slot.global_shape = p.sizes().vec();
  if (auto ep = options_.expert_parallel.params.find(name); ep != options_.expert_parallel.params.end()) {
    TORCH_CHECK(expert_mesh_, "fully_shard: parameter ", name, " is expert-parallel but no expert mesh was given");
    slot.expert = true;
    slot.global_shape = ep->second;
  }
  const int64_t shards = bucket_shards(slot.expert);
  if (auto tp = options_.tensor_parallel.find(name); tp != options_.tensor_parallel.end()) {
    if (tensor_axis_ < 0 && tp->second.dim >= 0) {
      throw std::invalid_argument("fully_shard: parameter " + name +
                                  " is split by tensor parallelism but the mesh has no tensor axis");
    }
    slot.tp_dim = tp->second.dim;
    slot.global_shape = tp->second.global_shape;
    slot.tp_sum_grads = tp->second.sum_grads && tensor_axis_ >= 0 && mesh_->size(tensor_axis_) > 1;
  }
  slot.row_numel = slot.rows == 0 ? 0 : p.numel() / slot.rows;
  slot.mine = chunk_span(slot.rows, shards, bucket_coordinate(slot.expert));
  if (unmaterialised(p)) {
    // Materialise this one parameter: it is sliced and freed below.
    alloc_storage(p, static_cast<size_t>(tensor_bytes(p)));
    init(name, p);
  }
  // The local shard (or DDP's master copy) keeps the parameter's dtype;
  // the module's parameter takes param_dtype.
  const bool cast = mixed_ && p.is_floating_point() && p.scalar_type() != param_dtype_;
  // A frozen parameter's shard may be narrower (frozen_dtype).
  const torch::ScalarType shard_dtype = !slot.trainable && p.is_floating_point()
                                            ? (options_.frozen_dtype == PrecisionDtype::kBf16 ? torch::kBFloat16
                                                                                                : p.scalar_type())
                                            : p.scalar_type();
  // An expert's rows keep a shard of their own even when their group is this
  // rank alone: the module's tensor is gathered for a unit and freed after.
  const bool whole = shards == 1 && !slot.expert;
  if (whole && !cast && shard_dtype == p.scalar_type()) {
    slot.local = p;  // DDP: the optimizer updates the module parameter itself
  } else {
    slot.local = p.narrow(0, slot.mine.offset, slot.mine.size).to(shard_dtype, false, true).set_requires_grad(slot.trainable);
  }
  if (cast) {
    p.set_data(torch::empty(p.sizes(), p.options().dtype(param_dtype_)));
    if (whole) raw_flat(p).copy_(slot.local.reshape({-1}));
  }
  if (!whole) free_storage(p);  // one full parameter at a time
  add_to_bucket(unit, std::move(slot));
}

// Files `slot` (its module tensor already in param_dtype) in the unit's
// bucket of its dtype and trainability, and counts its bytes.
void FullyShardedModel::add_to_bucket(Unit& unit, ParamSlot slot) {
  const torch::Tensor& p = slot.full;
  size_t b = 0;
  while (b < unit.buckets.size() &&
         (unit.buckets[b].dtype != p.scalar_type() || unit.buckets[b].trainable != slot.trainable ||
          unit.buckets[b].expert != slot.expert)) {
    ++b;
  }
  if (b == unit.buckets.size()) {
    unit.buckets.emplace_back();
    unit.buckets.back().dtype = p.scalar_type();
    unit.buckets.back().trainable = slot.trainable;
    unit.buckets.back().expert = slot.expert;
  }
  Bucket& bucket = unit.buckets[b];
  slot.bucket = b;
  slot.seg_offset = bucket.seg_numel;
  bucket.seg_numel += chunk_capacity(slot.rows, bucket_shards(slot.expert)) * slot.row_numel;
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

int64_t FullyShardedModel::bucket_shards(bool expert) const {
  return expert ? expert_mesh_->size(1) : mesh_->size(shard_axis_);
}

int64_t FullyShardedModel::bucket_coordinate(bool expert) const {
  return expert ? expert_mesh_->coordinate(1) : mesh_->coordinate(shard_axis_);
}

comm::Group& FullyShardedModel::bucket_group(bool expert, int channel) {
  return expert ? expert_mesh_->group(1, channel) : mesh_->group(shard_axis_, channel);
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

}  // namespace framework::fsdp
