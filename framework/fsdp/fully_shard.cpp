#include "framework/fsdp/fully_shard.h"

#include <torch/csrc/autograd/function_hook.h>

#include <cmath>
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

}  // namespace

struct ParamSlot {
  size_t index = 0;         // position in the model's parameter order
  std::string name;
  torch::Tensor full;       // the module's parameter; storage only while gathered
  int64_t rows = 0;         // global dim 0
  int64_t row_numel = 1;    // elements per dim-0 row
  dtensor::Span mine;       // this rank's rows
  int64_t seg_offset = 0;   // element offset inside a member's padded segment
  torch::Tensor local;      // the shard the optimizer owns
};

struct FullyShardedModel::Unit {
  std::string name;
  std::vector<ParamSlot> params;
  int64_t seg_numel = 0;    // padded elements per member in the flat buffers
  int64_t full_bytes = 0;
  bool is_root = false;
  bool gathered = false;
  bool reduced = false;
  size_t grads_arrived = 0;
  torch::Tensor grad_buffer;  // this rank's reduced gradient shards
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // kept alive
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

}  // namespace

std::vector<int64_t> mesh_shape_for(const ParallelOptions& o, int world) {
  int64_t r = o.replicate, s = o.shard;
  if (r == -1 && s == -1) {
    throw std::invalid_argument("parallel.replicate and parallel.shard cannot both be -1");
  }
  if (r == -1) r = world % s == 0 ? world / s : -1;
  if (s == -1) s = world % r == 0 ? world / r : -1;
  if (r < 1 || s < 1 || r * s != world) {
    throw std::invalid_argument("parallel.replicate (" + std::to_string(o.replicate) +
                                ") x parallel.shard (" + std::to_string(o.shard) +
                                ") does not match the world size " + std::to_string(world));
  }
  return {r, s};
}

std::string layout_name(const std::vector<int64_t>& shape) {
  if (shape.at(1) == 1) return shape.at(0) == 1 ? "single" : "ddp";
  return shape.at(0) == 1 ? "fsdp" : "hsdp";
}

FullyShardedModel::FullyShardedModel(std::shared_ptr<models::LayeredModelImpl> model,
                                     std::shared_ptr<dtensor::DeviceMesh> mesh,
                                     ParallelOptions options)
    : model_(std::move(model)), mesh_(std::move(mesh)), options_(options) {
  TORCH_CHECK(mesh_->ndim() == 2, "fully_shard needs a {replicate, shard} mesh");
  const int64_t shards = mesh_->size(shard_axis_);
  const int64_t my_shard = mesh_->coordinate(shard_axis_);

  // Which unit owns each parameter: blocks by identity, the rest is the root.
  std::unordered_map<const c10::TensorImpl*, size_t> owner;
  units_.push_back(std::make_unique<Unit>());
  units_[0]->name = "root";
  units_[0]->is_root = true;
  for (int64_t b = 0; b < model_->num_blocks(); ++b) {
    units_.push_back(std::make_unique<Unit>());
    units_.back()->name = "blocks." + std::to_string(b);
    for (const auto& p : model_->block(b)->parameters()) owner[p.unsafeGetTensorImpl()] = b + 1;
  }

  torch::NoGradGuard no_grad;
  size_t index = 0;
  for (const auto& item : model_->named_parameters()) {
    const torch::Tensor& p = item.value();
    TORCH_CHECK(p.dim() >= 1, "fully_shard: parameter ", item.key(), " is 0-d");
    TORCH_CHECK(p.is_contiguous() && p.storage_offset() == 0 &&
                    p.storage().nbytes() == static_cast<size_t>(tensor_bytes(p)),
                "fully_shard: parameter ", item.key(), " does not own a dense storage");
    auto it = owner.find(p.unsafeGetTensorImpl());
    Unit& unit = *units_[it == owner.end() ? 0 : it->second];
    ParamSlot slot;
    slot.index = index++;
    slot.name = item.key();
    slot.full = p;
    slot.rows = p.size(0);
    slot.row_numel = slot.rows == 0 ? 0 : p.numel() / slot.rows;
    slot.mine = chunk_span(slot.rows, shards, my_shard);
    slot.seg_offset = unit.seg_numel;
    unit.seg_numel += chunk_capacity(slot.rows, shards) * slot.row_numel;
    unit.full_bytes += tensor_bytes(p);
    if (shards == 1) {
      slot.local = p;  // DDP: the optimizer updates the module parameter itself
    } else {
      slot.local = p.narrow(0, slot.mine.offset, slot.mine.size).clone().set_requires_grad(true);
    }
    stats_.sharded_param_bytes += tensor_bytes(slot.local);
    stats_.full_param_bytes += tensor_bytes(p);
    unit.params.push_back(std::move(slot));
  }

  for (auto& u : units_) {
    Unit* unit = u.get();
    stats_.largest_unit_bytes = std::max(stats_.largest_unit_bytes, unit->full_bytes);
    for (ParamSlot& slot : unit->params) {
      param_index_.emplace_back(unit, &slot - unit->params.data());
      // Holding the AccumulateGrad node keeps the same node (and our hook)
      // for every step: the parameter only keeps a weak reference to it.
      auto acc = torch::autograd::impl::grad_accumulator(slot.full);
      acc->add_post_hook(std::make_unique<GradAccumulatedHook>([this, unit] {
        on_grad_accumulated(*unit);
      }));
      unit->accumulators.push_back(std::move(acc));
      if (shards > 1) free_storage(slot.full);
    }
  }
  std::sort(param_index_.begin(), param_index_.end(),
            [](const auto& a, const auto& b) {
              return a.first->params[a.second].index < b.first->params[b.second].index;
            });
}

FullyShardedModel::~FullyShardedModel() = default;

void FullyShardedModel::gather(Unit& unit) {
  if (unit.gathered) return;
  unit.gathered = true;
  const int64_t shards = mesh_->size(shard_axis_);
  if (shards == 1) return;  // DDP: parameters are always whole
  torch::NoGradGuard no_grad;
  auto dtype = unit.params.front().local.options();
  torch::Tensor send = torch::zeros({unit.seg_numel}, dtype);
  for (const ParamSlot& p : unit.params) {
    send.narrow(0, p.seg_offset, p.mine.size * p.row_numel).copy_(p.local.reshape({-1}));
  }
  torch::Tensor recv = torch::empty({shards * unit.seg_numel}, dtype);
  mesh_->group(shard_axis_).all_gather(recv, send);
  for (const ParamSlot& p : unit.params) {
    alloc_storage(p.full, static_cast<size_t>(tensor_bytes(p.full)));
    torch::Tensor dst = raw_flat(p.full);
    for (int64_t r = 0; r < shards; ++r) {
      dtensor::Span span = chunk_span(p.rows, shards, r);
      dst.narrow(0, span.offset * p.row_numel, span.size * p.row_numel)
          .copy_(recv.narrow(0, r * unit.seg_numel + p.seg_offset, span.size * p.row_numel));
    }
  }
  live_bytes_ += unit.full_bytes;
  stats_.peak_gathered_bytes = std::max(stats_.peak_gathered_bytes, live_bytes_);
}

void FullyShardedModel::release(Unit& unit) {
  if (!unit.gathered) return;
  unit.gathered = false;
  if (mesh_->size(shard_axis_) == 1) return;
  for (const ParamSlot& p : unit.params) free_storage(p.full);
  live_bytes_ -= unit.full_bytes;
}

void FullyShardedModel::on_grad_accumulated(Unit& unit) {
  if (mesh_->size(shard_axis_) > 1) {
    // A full gradient of this unit now exists until the unit is reduced.
    live_bytes_ += unit.full_bytes / static_cast<int64_t>(unit.params.size());
    stats_.peak_gathered_bytes = std::max(stats_.peak_gathered_bytes, live_bytes_);
  }
  if (++unit.grads_arrived == unit.params.size()) reduce_grads(unit);
}

void FullyShardedModel::reduce_grads(Unit& unit) {
  if (unit.reduced) return;
  unit.reduced = true;
  torch::NoGradGuard no_grad;
  const int64_t shards = mesh_->size(shard_axis_);
  const int64_t replicas = mesh_->size(replicate_axis_);
  auto dtype = unit.params.front().local.options();
  if (shards == 1) {
    // DDP: one flat all-reduce of the unit's gradients across replicas.
    torch::Tensor flat = torch::zeros({unit.seg_numel}, dtype);
    for (const ParamSlot& p : unit.params) {
      if (p.full.grad().defined()) {
        flat.narrow(0, p.seg_offset, p.full.numel()).copy_(p.full.grad().reshape({-1}));
      }
    }
    if (replicas > 1) mesh_->group(replicate_axis_).all_reduce(flat);
    for (const ParamSlot& p : unit.params) {
      p.full.mutable_grad() = flat.narrow(0, p.seg_offset, p.full.numel()).view(p.full.sizes());
    }
    unit.grad_buffer = flat;
    return;
  }
  torch::Tensor send = torch::zeros({shards * unit.seg_numel}, dtype);
  for (const ParamSlot& p : unit.params) {
    const torch::Tensor& g = p.full.grad();
    if (!g.defined()) continue;  // unused parameter: contributes zeros
    torch::Tensor flat = g.reshape({-1});
    for (int64_t r = 0; r < shards; ++r) {
      dtensor::Span span = chunk_span(p.rows, shards, r);
      send.narrow(0, r * unit.seg_numel + p.seg_offset, span.size * p.row_numel)
          .copy_(flat.narrow(0, span.offset * p.row_numel, span.size * p.row_numel));
    }
  }
  torch::Tensor mine = torch::empty({unit.seg_numel}, dtype);
  mesh_->group(shard_axis_).reduce_scatter(mine, send);
  if (replicas > 1) mesh_->group(replicate_axis_).all_reduce(mine);
  for (ParamSlot& p : unit.params) {
    p.local.mutable_grad() =
        mine.narrow(0, p.seg_offset, p.mine.size * p.row_numel).view(p.local.sizes());
    if (p.full.grad().defined()) live_bytes_ -= tensor_bytes(p.full);
    p.full.mutable_grad().reset();
  }
  unit.grad_buffer = mine;
  release(unit);
}

torch::Tensor FullyShardedModel::forward(const torch::Tensor& tokens) {
  for (auto& u : units_) {
    u->reduced = false;
    u->grads_arrived = 0;
  }
  const bool training = torch::GradMode::is_enabled();
  Unit& root = *units_[0];
  gather(root);
  torch::Tensor h = model_->embed(tokens);
  for (int64_t b = 0; b < model_->num_blocks(); ++b) {
    Unit& unit = *units_[b + 1];
    gather(unit);
    h = model_->block_forward(b, h);
    if (!training || options_.reshard_after_forward) release(unit);
    if (training && h.requires_grad()) {
      // Fires when the gradient of this unit's output is ready, i.e. right
      // before the unit's own backward ops run.
      Unit* up = &unit;
      h.register_hook([this, up](const torch::Tensor&) { gather(*up); });
    }
  }
  torch::Tensor logits = model_->head(h);
  if (!training) release(root);
  return logits;
}

void FullyShardedModel::finish_backward() {
  // Units are visited in backward order (blocks last to first, then root), the
  // same on every rank, so any catch-up collectives line up.
  for (size_t i = units_.size(); i-- > 1;) reduce_grads(*units_[i]);
  reduce_grads(*units_[0]);
  for (auto& u : units_) release(*u);
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
  std::vector<Placement> placements = {Placement::replicate(), mesh_->size(shard_axis_) > 1
                                                                   ? Placement::shard(0)
                                                                   : Placement::replicate()};
  return dtensor::DTensor(std::move(local), p.full.sizes().vec(), mesh_, placements);
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
  for (const torch::Tensor& t : params) {
    if (t.grad().defined() && t.numel() > 0) sq += t.grad().to(torch::kDouble).pow(2).sum();
  }
  // Shards are disjoint across the shard axis; replicas hold equal gradients.
  if (mesh_->size(shard_axis_) > 1) mesh_->group(shard_axis_).all_reduce(sq);
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
  for (auto& u : units_) u->grad_buffer = torch::Tensor();
}

void FullyShardedModel::reset_peak_memory() { stats_.peak_gathered_bytes = live_bytes_; }

}  // namespace framework::fsdp
