#pragma once
// DTensor: a tensor distributed over a DeviceMesh. Each rank holds its local
// chunk plus what describes the whole: the global shape, the mesh and one
// Placement per mesh axis.
//
// Layout rule (as torch.distributed DTensor): start from the global box; for
// each mesh axis in order, Shard(d) splits the current extent of dim d over the
// axis (chunk.h rule) and keeps the part at this rank's coordinate; Replicate()
// keeps the box whole. Two axes sharding the same dim therefore nest in axis
// order. Shards may be empty (6 rows over 4 ranks -> 2,2,2,0).
//
// Collectives (full_tensor, redistribute) use the mesh's axis groups: every
// rank of those groups must call them, in the same order, from the thread
// that owns the mesh. Everything else is local.
#include "framework/dtensor/chunk.h"
#include "framework/dtensor/device_mesh.h"
#include "framework/dtensor/placement.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace framework::dtensor {

class DTensor {
 public:
  // Wraps an existing local chunk (shared, not copied).
  // REQUIRES: mesh != nullptr; one placement per mesh axis; every shard dim <
  // global_shape.size(); local.sizes() == the box local_box() gives this rank
  // (TORCH_CHECK reports both).
  DTensor(at::Tensor local, std::vector<int64_t> global_shape, std::shared_ptr<DeviceMesh> mesh,
          std::vector<Placement> placements);

  // Every rank passes the same full tensor; each keeps a contiguous copy of its
  // own chunk. No communication.
  static DTensor distribute(const at::Tensor& full, std::shared_ptr<DeviceMesh> mesh,
                            std::vector<Placement> placements);

  // {offsets, sizes} in the global index space of the box held by the rank at
  // `coords` of a mesh of `mesh_shape`. Pure: the checkpoint planner calls it
  // for every rank. REQUIRES: sizes agree (one placement and coordinate per
  // mesh axis), coords inside mesh_shape, shard dims < global_shape.size().
  static std::pair<std::vector<int64_t>, std::vector<int64_t>> local_box(
      const std::vector<int64_t>& global_shape, const std::vector<int64_t>& mesh_shape,
      const std::vector<int64_t>& coords, const std::vector<Placement>& placements);

  const at::Tensor& local() const { return local_; }
  // Writable access to the chunk for in-place updates (optimizer steps,
  // checkpoint loads). REQUIRES: its shape is not changed.
  at::Tensor& mutable_local() { return local_; }
  const std::vector<int64_t>& global_shape() const { return global_shape_; }
  const std::vector<Placement>& placements() const { return placements_; }
  const std::shared_ptr<DeviceMesh>& mesh() const { return mesh_; }

  // This rank's box (local_box at the mesh's coordinates).
  std::vector<int64_t> local_offsets() const;
  std::vector<int64_t> local_sizes() const;

  // True when another rank holds the same data: some mesh axis of extent > 1
  // is Replicate(). (Coinciding empty shards do not count: they hold nothing.)
  bool is_replicated_somewhere() const;

  // The whole tensor, contiguous, on every rank. Collective over the groups
  // of the axes that shard; no communication when nothing is sharded.
  at::Tensor full_tensor() const;

  // The same global tensor laid out by `target` (one placement per mesh axis).
  // Communicates only where data must move: it all-gathers over the axes
  // whose sharding changes (and any later axis nested inside them); axes that
  // go Replicate -> Shard only narrow locally. Shard(d) -> Shard(e) goes
  // through the gathered tensor. Collective over the groups of the gathered
  // axes: their members must all call it with the same target. The result
  // never shares storage with *this.
  DTensor redistribute(const std::vector<Placement>& target) const;

 private:
  at::Tensor local_;
  std::vector<int64_t> global_shape_;
  std::shared_ptr<DeviceMesh> mesh_;
  std::vector<Placement> placements_;
};

}  // namespace framework::dtensor
