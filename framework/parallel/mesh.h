#pragma once
// The device meshes of a parallel layout (layout.h), built once per run:
// the world mesh (with the pipeline axis outermost when there is one) and
// this rank's stage mesh, {replicate, shard} or {replicate, shard, tensor},
// which FSDP and TP work on. A parallelism asks for its mesh here; it does
// no mesh arithmetic of its own.
#include "framework/dtensor/device_mesh.h"
#include "framework/parallel/layout.h"

#include <memory>

namespace framework::parallel {

struct Meshes {
  // {pipeline, replicate, shard[, tensor]} with a pipeline; else the stage mesh.
  std::shared_ptr<dtensor::DeviceMesh> world;
  // This rank's stage: the axes the data-parallel and tensor-parallel
  // collectives run on.
  std::shared_ptr<dtensor::DeviceMesh> stage;
  // Expert parallelism (layout.expert > 1): {replicate, expert_shard,
  // expert[, tensor]} over the stage's ranks (Layout::expert_shape); the
  // expert axis's group moves tokens (all-to-all), the expert_shard axis's
  // shards the experts. Else null.
  std::shared_ptr<dtensor::DeviceMesh> expert;
  // Context parallelism (layout.context > 1): {replicate, batch_shard,
  // context[, tensor]} over the stage's ranks (Layout::context_shape); the
  // context axis's group (ranks of the shard axis `tensor` apart, of one
  // tensor rank) is ring attention's.
  // Else null.
  std::shared_ptr<dtensor::DeviceMesh> context;
  // The context axis's group. REQUIRES: context > 1.
  comm::Group& context_group() const { return context->group(2); }
  // The pipeline axis's group (send/recv between stages). REQUIRES:
  // pipeline > 1.
  comm::Group& pipeline_group() const { return world->group(0); }
};

// (all ranks of the world) Creates the meshes' process groups through
// `rendezvous`. `channels` 2 gives every axis a second set of process groups
// (FSDP's prefetch: all-gathers do not queue behind reduce-scatters).
// REQUIRES: layout.world() is the rendezvous's world size.
Meshes build_meshes(const Layout& layout, comm::Rendezvous& rendezvous, int channels);

}  // namespace framework::parallel
