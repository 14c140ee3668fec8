// FullyShardedModel's schedule: all-gathers before a unit runs (prefetched
// ahead of it), reduce-scatters and replicate all-reduces after its
// backward, and the gradients' norm and clipping.
#include "framework/fsdp/fully_shard.h"
#include "framework/fsdp/fully_shard_impl.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

namespace framework::fsdp {

using dtensor::Placement;
using dtensor::chunk_capacity;
using dtensor::chunk_span;

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
    const int64_t group_shards = bucket_shards(bucket.expert);
    if (group_shards == 1) {  // experts whole on this rank: nothing to gather
      unit.gather_work.emplace_back();
      unit.gather_recv.push_back(send);
      continue;
    }
    torch::Tensor recv = torch::empty({group_shards * bucket.seg_numel}, dtype);
    unit.gather_work.push_back(bucket_group(bucket.expert, kGatherChannel).all_gather_async(recv, send));
    unit.gather_recv.push_back(recv);
  }
  live_bytes_ += unit.full_bytes;
  stats_.peak_gathered_bytes = std::max(stats_.peak_gathered_bytes, live_bytes_);
}

void FullyShardedModel::finish_gather(Unit& unit) {
  if (!unit.gathering) return;
  RECORD_USER_SCOPE("shardkit::fsdp_gather");
  torch::NoGradGuard no_grad;
  std::vector<comm::Work> work = std::move(unit.gather_work);
  std::vector<torch::Tensor> recv = std::move(unit.gather_recv);
  unit.gather_work.clear();
  unit.gather_recv.clear();
  unit.gathering = false;
  try {
    for (size_t b = 0; b < unit.buckets.size(); ++b) {
      const Bucket& bucket = unit.buckets[b];
      const int64_t shards = bucket_shards(bucket.expert);
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
void FullyShardedModel::release_pending(const Unit* except) {
  for (auto& u : units_) {
    if (!u->release_pending || u.get() == except) continue;
    u->release_pending = false;
    release(*u);
  }
}

void FullyShardedModel::before_unit_backward(Unit& unit) {
  in_backward_ = true;
  // The unit whose backward ran before this one's is done with its frozen
  // parameters: this unit's output gradient is its input's.
  release_pending(&unit);
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
    // set_hold_root: later backward passes of the step still use the
    // root's parameters; finish_backward frees them. A unit with frozen
    // parameters has all its gradients before its backward is done (the
    // input's gradient still reads the frozen weights): freed later.
    if (unit.is_root && hold_root_) {
    } else if (unit.trainable < unit.params.size()) {
      unit.release_pending = true;
    } else {
      release(unit);
    }
  }
  reducing_.push_back(std::move(rec));
  if (ddp) wait_reduce_scatter();  // DDP: no reduce-scatter; its all-reduce goes out now
  if (options_.prefetch <= 0) drain_reductions();
}

// Tensor parallelism's sum_grads parameters (a per-head norm): each TP
// rank's gradient covers its heads; the whole gradient is their sum, on
// every TP rank before the data-parallel reduction. One small blocking
// all-reduce each, in the same order on every TP rank (the autograd
// graph's), on the tensor group its forward hooks use.
void FullyShardedModel::sum_grads_over_tensor_axis(Unit& unit, const Bucket& bucket) {
  for (size_t m : bucket.members) {
    ParamSlot& p = unit.params[m];
    if (!p.tp_sum_grads) continue;
    if (!p.full.grad().defined()) {  // unused on this rank: its part is zero
      p.full.mutable_grad() = torch::zeros_like(p.full);
      if (mesh_->size(shard_axis_) > 1) live_bytes_ += tensor_bytes(p.full);  // issue_reduce_scatter frees it
    }
    mesh_->group(tensor_axis_).all_reduce(p.full.mutable_grad());
  }
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
  sum_grads_over_tensor_axis(unit, bucket);
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
  sum_grads_over_tensor_axis(unit, bucket);
  const int64_t shards = bucket_shards(bucket.expert);
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
  if (shards == 1) {
    // Experts whole on this rank: their gradients are this rank's already
    // (every expert-parallel rank's tokens reached them).
    part.mine = part.send;
  } else {
    part.mine = torch::empty({bucket.seg_numel}, comm);
    part.rs = bucket_group(bucket.expert, kReduceChannel).reduce_scatter_async(part.mine, part.send);
  }
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

void FullyShardedModel::end_micro_backward() {
  // The same order as finish_backward. Units that got no gradient in this
  // pass (another stage's, on a rank with several) wait for
  // finish_backward. The root stays gathered (set_hold_root).
  for (size_t i = units_.size(); i-- > 1;) {
    if (units_[i]->grads_arrived > 0) reduce_grads(*units_[i]);
  }
  if (units_[0]->grads_arrived > 0) reduce_grads(*units_[0]);
  release_pending(nullptr);
  for (auto& u : units_) {
    u->reduced = false;
    u->grads_arrived = 0;
  }
}

void FullyShardedModel::finish_backward() {
  // Units are visited in backward order (last unit to first, then root), the
  // same on every rank, so any catch-up collectives line up.
  for (size_t i = units_.size(); i-- > 1;) reduce_grads(*units_[i]);
  reduce_grads(*units_[0]);
  drain_reductions();
  for (auto& u : units_) {
    u->release_pending = false;
    release(*u);
  }
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
  if (p.expert) {
    // On the {replicate, expert, expert_shard[, tensor]} view: the experts'
    // rows, then FSDP's rows of them (whole on every tensor rank).
    const Placement rows = bucket_shards(true) > 1 ? Placement::shard(0) : Placement::replicate();
    std::vector<Placement> placements{Placement::replicate(), Placement::shard(0), rows};
    if (expert_param_mesh_->ndim() == 4) placements.push_back(Placement::replicate());
    return dtensor::DTensor(std::move(local), p.global_shape, expert_param_mesh_, std::move(placements));
  }
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
  if (norm_group_ != nullptr && norm_group_->size() > 1) norm_group_->all_reduce(sq);
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
