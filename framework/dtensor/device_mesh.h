#pragma once
// DeviceMesh: the world's ranks laid out row-major over an n-dimensional
// shape (1-D {n}, or 2-D {replicate, shard} for HSDP), with one process group
// per mesh axis through this rank. For a 2-D mesh {R, S}: rank = r*S + s; the
// group along axis 0 holds the R ranks sharing s, the group along axis 1 the S
// ranks sharing r.
//
// Call sequence: (all ranks, same order) DeviceMesh::create. Afterwards each
// axis group is an ordinary comm::Group: its members must call
// collectives in the same order, from one thread at a time.
#include "comm/process_group.h"
#include "comm/runtime.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace framework::dtensor {

class DeviceMesh {
 public:
  // Creates this rank's group along every axis (axis 0 first), named
  // "<name>.<axis_name>.<index>", where index numbers the groups of that axis
  // by their coordinates on the other axes (row-major). Blocks until the
  // members of each group have joined.
  // REQUIRES: product(shape) == rv.world_size(); every extent >= 1;
  // axis_names has one distinct, non-empty name per axis; all ranks call it
  // in the same order; `name` is unique in the job (it prefixes store keys).
  //
  // `channels` > 1 gives every axis of extent > 1 that many groups over the
  // same members (channel c > 0 named "<group name>.c<c>"): a group runs its
  // collectives in order, so collectives that must overlap (FSDP's
  // all-gathers beside its reduce-scatters) go on different channels. Each
  // extra channel costs, per rank and axis of extent E: Gloo, E - 1 more
  // connections and the group's 2 worker threads; NCCL, one more
  // communicator (and stream) with its own buffers.
  static std::shared_ptr<DeviceMesh> create(comm::Rendezvous& rv,
                                            std::vector<int64_t> shape,
                                            std::vector<std::string> axis_names,
                                            const std::string& name = "mesh", int channels = 1);

  // A mesh over groups the caller already has (e.g. comm::wrap_c10d_backend
  // of their own c10d backends): groups[axis] is this rank's group along
  // that axis, its size the axis's extent and its rank this rank's
  // coordinate. An axis of extent 1 may pass nullptr (no collective runs on
  // it). Throws std::invalid_argument naming the axis when a group does
  // not fit the shape.
  static std::shared_ptr<DeviceMesh> from_groups(
      std::vector<int64_t> shape, std::vector<std::string> axis_names,
      std::vector<std::shared_ptr<comm::Group>> groups, const std::string& name = "mesh");

  // The same ranks and groups with the axes in `order` (a permutation of
  // 0..ndim-1): axis i of the view is axis order[i] of this mesh. Placements
  // on a view nest in its axis order, which is how a DTensor says that one
  // axis splits a dim first and another splits each part further (tensor
  // parallelism's shard of a weight, then FSDP's rows of that shard, on a
  // {replicate, shard, tensor} mesh: the view {replicate, tensor, shard}).
  // global_rank() and world_size() are this mesh's. Throws
  // std::invalid_argument when `order` is not a permutation.
  std::shared_ptr<DeviceMesh> permuted(const std::vector<int>& order) const;

  // The mesh of this rank's ranks along `axes` (distinct, ascending), the
  // other axes fixed at this rank's coordinates: PyTorch's mesh["a", "b"].
  // Its groups (and channels) are this mesh's; global_rank() and
  // world_size() are the sub-mesh's (row-major over `axes`). E.g. one
  // pipeline stage's {replicate, shard, tensor} mesh of a {pipeline,
  // replicate, shard, tensor} mesh: submesh({1, 2, 3}). Throws
  // std::invalid_argument when `axes` is empty, not ascending or out of range.
  std::shared_ptr<DeviceMesh> submesh(const std::vector<int>& axes) const;

  DeviceMesh(const DeviceMesh&) = delete;
  DeviceMesh& operator=(const DeviceMesh&) = delete;

  const std::string& name() const { return name_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<std::string>& axis_names() const { return axis_names_; }
  int64_t size(int axis) const;
  // This rank's coordinate on `axis`.
  int64_t coordinate(int axis) const;
  // This rank's coordinates on every axis.
  const std::vector<int64_t>& coordinates() const { return coordinates_; }
  // This rank's group along `axis`: size() == size(axis), rank() ==
  // coordinate(axis). The mesh owns it; it lives as long as the mesh.
  // Throws for an extent-1 axis made by from_groups without a group.
  comm::Group& group(int axis);
  // Channel `channel` of `axis` (see create): group(axis) for channel 0, for
  // an axis of extent 1, and on a mesh made with fewer channels (channel
  // modulo the count), so callers may always name the channel they want.
  comm::Group& group(int axis, int channel);
  int channels() const { return channels_; }
  // The axis called `name`; TORCH_CHECK names it when unknown.
  int axis_index(const std::string& name) const;
  int global_rank() const { return global_rank_; }
  int world_size() const { return world_size_; }

  // Row-major coordinates of `rank` in a mesh of `shape` and back (pure).
  static std::vector<int64_t> coordinates_of(int64_t rank, const std::vector<int64_t>& shape);
  static int64_t rank_of(const std::vector<int64_t>& coordinates,
                         const std::vector<int64_t>& shape);

 private:
  DeviceMesh() = default;
  void check_axis(int axis) const;

  std::string name_;
  std::vector<int64_t> shape_;
  std::vector<std::string> axis_names_;
  std::vector<int64_t> coordinates_;
  std::vector<std::shared_ptr<comm::Group>> groups_;  // one per axis
  // extra_[axis][c - 1]: channel c of the axis (empty for extent 1).
  std::vector<std::vector<std::shared_ptr<comm::Group>>> extra_;
  int channels_ = 1;
  int global_rank_ = 0;
  int world_size_ = 1;
};

}  // namespace framework::dtensor
