#include "framework/dtensor/dtensor.h"

#include <algorithm>

namespace framework::dtensor {

namespace {

// The box of one rank, and for every sharding axis the extent of its dim just
// before that axis split it (what a gather along that axis rebuilds).
struct SplitTrace {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  std::vector<int64_t> parent_sizes;  // per mesh axis; -1 where Replicate
};

void check_layout(const std::vector<int64_t>& global_shape,
                  const std::vector<int64_t>& mesh_shape,
                  const std::vector<Placement>& placements) {
  TORCH_CHECK(placements.size() == mesh_shape.size(), "DTensor: ", placements.size(),
              " placements ", to_string(placements), " for a ", mesh_shape.size(), "-D mesh");
  for (int64_t extent : global_shape) {
    TORCH_CHECK(extent >= 0, "DTensor: negative extent in the global shape: ", extent);
  }
  for (const Placement& p : placements) {
    TORCH_CHECK(!p.is_shard() || (p.dim >= 0 && p.dim < static_cast<int64_t>(global_shape.size())),
                "DTensor: placement ", p.to_string(), " for a tensor of ", global_shape.size(),
                " dims");
  }
}

SplitTrace trace_split(const std::vector<int64_t>& global_shape,
                       const std::vector<int64_t>& mesh_shape,
                       const std::vector<int64_t>& coords,
                       const std::vector<Placement>& placements) {
  check_layout(global_shape, mesh_shape, placements);
  TORCH_CHECK(coords.size() == mesh_shape.size(), "DTensor: ", coords.size(),
              " coordinates for a ", mesh_shape.size(), "-D mesh");
  SplitTrace trace{std::vector<int64_t>(global_shape.size(), 0), global_shape,
                   std::vector<int64_t>(mesh_shape.size(), -1)};
  for (size_t axis = 0; axis < mesh_shape.size(); ++axis) {
    TORCH_CHECK(coords[axis] >= 0 && coords[axis] < mesh_shape[axis], "DTensor: coordinate ",
                coords[axis], " on mesh axis ", axis, " outside extent ", mesh_shape[axis]);
    if (!placements[axis].is_shard()) continue;
    const int64_t d = placements[axis].dim;
    const Span span = chunk_span(trace.sizes[d], mesh_shape[axis], coords[axis]);
    trace.parent_sizes[axis] = trace.sizes[d];
    trace.offsets[d] += span.offset;
    trace.sizes[d] = span.size;
  }
  return trace;
}

// Collectives move bits: view the data as an integer type of the same width,
// which every backend supports (Gloo on 1.13 may lack bf16/bool).
at::Tensor as_bits(const at::Tensor& t) {
  switch (t.element_size()) {
    case 1: return t.view(at::kByte);
    case 2: return t.view(at::kHalf);  // Gloo has no int16; all-gather only copies
    case 4: return t.view(at::kInt);
    case 8: return t.view(at::kLong);
    default:
      TORCH_CHECK(false, "DTensor: cannot communicate dtype ", t.dtype(), " (element size ",
                  t.element_size(), ")");
  }
  return t;  // unreachable
}

// Rebuilds dim `dim` (extent `parent_size` before this axis split it) from
// the shards held along `group`. Shards are padded to the chunk capacity so
// every member sends the same number of elements; since shard i starts at
// i*capacity, the first parent_size gathered rows are the rebuilt dim.
at::Tensor gather_along(const at::Tensor& local, comm::Group& group, int64_t dim,
                        int64_t parent_size) {
  const int64_t capacity = chunk_capacity(parent_size, group.size());
  at::Tensor front = local.movedim(dim, 0);
  std::vector<int64_t> sizes = front.sizes().vec();
  sizes[0] = capacity;
  at::Tensor padded = at::zeros(sizes, local.options());
  padded.narrow(0, 0, front.size(0)).copy_(front);
  sizes[0] = capacity * group.size();
  at::Tensor gathered = at::empty(sizes, local.options());
  at::Tensor gathered_bits = as_bits(gathered);
  group.all_gather(gathered_bits, as_bits(padded));
  return gathered.narrow(0, 0, parent_size).movedim(0, dim).contiguous();
}

// The mesh axes whose groups redistribute(current -> target) gathers over.
// Decided from placements only, so every rank decides the same.
std::vector<bool> axes_to_gather(const std::vector<Placement>& current,
                                 const std::vector<Placement>& target, size_t tensor_ndim) {
  const size_t n = current.size();
  std::vector<bool> gather(n, false);
  for (size_t a = 0; a < n; ++a) {
    if (current[a].is_shard() && current[a] != target[a]) gather[a] = true;
  }
  // A later axis nested inside a gathered split of the same dim goes too.
  for (size_t a = 0; a < n; ++a) {
    if (!gather[a]) continue;
    for (size_t b = a + 1; b < n; ++b) {
      if (current[b].is_shard() && current[b].dim == current[a].dim) gather[b] = true;
    }
  }
  // What remains sharded must be a prefix of the target's nesting on every
  // dim, so the target box lies inside the box we hold; else gather all.
  for (size_t d = 0; d < tensor_ndim; ++d) {
    std::vector<size_t> kept, wanted;
    for (size_t a = 0; a < n; ++a) {
      const auto dim = static_cast<int64_t>(d);
      if (current[a].is_shard() && current[a].dim == dim && !gather[a]) kept.push_back(a);
      if (target[a].is_shard() && target[a].dim == dim) wanted.push_back(a);
    }
    const bool prefix = kept.size() <= wanted.size() &&
                        std::equal(kept.begin(), kept.end(), wanted.begin());
    if (!prefix) {
      for (size_t a = 0; a < n; ++a) gather[a] = current[a].is_shard();
      break;
    }
  }
  return gather;
}

at::Tensor narrow_to_box(at::Tensor t, const std::vector<int64_t>& held_offsets,
                         const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  for (size_t d = 0; d < sizes.size(); ++d) {
    t = t.narrow(static_cast<int64_t>(d), offsets[d] - held_offsets[d], sizes[d]);
  }
  return t;
}

}  // namespace

DTensor::DTensor(at::Tensor local, std::vector<int64_t> global_shape,
                 std::shared_ptr<DeviceMesh> mesh, std::vector<Placement> placements)
    : local_(std::move(local)), global_shape_(std::move(global_shape)), mesh_(std::move(mesh)),
      placements_(std::move(placements)) {
  TORCH_CHECK(mesh_ != nullptr, "DTensor: mesh is null");
  TORCH_CHECK(local_.defined(), "DTensor: local tensor is undefined");
  auto box = local_box(global_shape_, mesh_->shape(), mesh_->coordinates(), placements_);
  TORCH_CHECK(local_.sizes().vec() == box.second, "DTensor: local tensor has shape ",
              local_.sizes(), " but global shape ", at::IntArrayRef(global_shape_), " with ",
              to_string(placements_), " gives rank ", mesh_->global_rank(), " a box of ",
              at::IntArrayRef(box.second));
}

DTensor DTensor::distribute(const at::Tensor& full, std::shared_ptr<DeviceMesh> mesh,
                            std::vector<Placement> placements) {
  TORCH_CHECK(mesh != nullptr, "DTensor::distribute: mesh is null");
  std::vector<int64_t> global_shape = full.sizes().vec();
  auto box = local_box(global_shape, mesh->shape(), mesh->coordinates(), placements);
  at::Tensor local = narrow_to_box(full, std::vector<int64_t>(global_shape.size(), 0),
                                   box.first, box.second)
                         .clone(at::MemoryFormat::Contiguous);
  return DTensor(std::move(local), std::move(global_shape), std::move(mesh),
                 std::move(placements));
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> DTensor::local_box(
    const std::vector<int64_t>& global_shape, const std::vector<int64_t>& mesh_shape,
    const std::vector<int64_t>& coords, const std::vector<Placement>& placements) {
  SplitTrace trace = trace_split(global_shape, mesh_shape, coords, placements);
  return {std::move(trace.offsets), std::move(trace.sizes)};
}

std::vector<int64_t> DTensor::local_offsets() const {
  return local_box(global_shape_, mesh_->shape(), mesh_->coordinates(), placements_).first;
}

std::vector<int64_t> DTensor::local_sizes() const {
  return local_box(global_shape_, mesh_->shape(), mesh_->coordinates(), placements_).second;
}

bool DTensor::is_replicated_somewhere() const {
  for (int axis = 0; axis < mesh_->ndim(); ++axis) {
    if (!placements_[axis].is_shard() && mesh_->size(axis) > 1) return true;
  }
  return false;
}

at::Tensor DTensor::full_tensor() const {
  return redistribute(std::vector<Placement>(placements_.size(), Placement::replicate()))
      .local();
}

DTensor DTensor::redistribute(const std::vector<Placement>& target) const {
  const std::vector<int64_t>& mesh_shape = mesh_->shape();
  const std::vector<int64_t>& coords = mesh_->coordinates();
  check_layout(global_shape_, mesh_shape, target);
  const SplitTrace held = trace_split(global_shape_, mesh_shape, coords, placements_);
  const std::vector<bool> gather = axes_to_gather(placements_, target, global_shape_.size());

  // Undo the splits innermost first; each gather rebuilds its parent extent.
  at::Tensor data = local_;
  std::vector<Placement> gathered = placements_;
  bool copied = false;
  for (int axis = mesh_->ndim(); axis-- > 0;) {
    if (!gather[axis]) continue;
    data = gather_along(data, mesh_->group(axis), placements_[axis].dim,
                        held.parent_sizes[axis]);
    gathered[axis] = Placement::replicate();
    copied = true;
  }
  const auto have = local_box(global_shape_, mesh_shape, coords, gathered);
  const auto want = local_box(global_shape_, mesh_shape, coords, target);
  at::Tensor local = narrow_to_box(data, have.first, want.first, want.second);
  local = copied ? local.contiguous() : local.clone(at::MemoryFormat::Contiguous);
  return DTensor(std::move(local), global_shape_, mesh_, target);
}

}  // namespace framework::dtensor
