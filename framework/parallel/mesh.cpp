// The device meshes of a layout (mesh.h).
#include "framework/parallel/mesh.h"

namespace framework::parallel {

namespace {

// All axes but the first (a pipeline stage's part of a world mesh).
std::vector<int> inner_axes(const dtensor::DeviceMesh& mesh) {
  std::vector<int> axes;
  for (int a = 1; a < mesh.ndim(); ++a) axes.push_back(a);
  return axes;
}

}  // namespace

Meshes build_meshes(const Layout& layout, comm::Rendezvous& rendezvous, int channels) {
  Meshes meshes;
  std::vector<int64_t> shape = layout.stage_shape();
  std::vector<std::string> names = layout.stage_axis_names();
  std::vector<int64_t> expert_shape = layout.expert_shape();
  std::vector<std::string> expert_names = layout.expert_axis_names();
  const bool piped = layout.pipeline > 1;
  if (piped) {
    shape.insert(shape.begin(), layout.pipeline);
    names.insert(names.begin(), "pipeline");
    expert_shape.insert(expert_shape.begin(), layout.pipeline);
    expert_names.insert(expert_names.begin(), "pipeline");
  }
  meshes.world = dtensor::DeviceMesh::create(rendezvous, shape, names, "mesh", channels);
  meshes.stage = piped ? meshes.world->submesh(inner_axes(*meshes.world)) : meshes.world;
  if (layout.expert > 1) {
    // The same ranks in the same order (rank = ((p x replicate + r) x shard
    // + s) x tensor + t with s = expert_shard index x expert + e): the shard
    // axis factored, expert innermost.
    auto world = dtensor::DeviceMesh::create(rendezvous, expert_shape, expert_names, "expert_mesh", channels);
    meshes.expert = piped ? world->submesh(inner_axes(*world)) : world;
  }
  if (layout.context > 1) {
    // The same ranks in the same order, the shard axis factored (s =
    // batch_shard index x context + c). One channel: ring attention's
    // sends and receives run on the step's thread only.
    std::vector<int64_t> context_shape = layout.context_shape();
    std::vector<std::string> context_names = layout.context_axis_names();
    if (piped) {
      context_shape.insert(context_shape.begin(), layout.pipeline);
      context_names.insert(context_names.begin(), "pipeline");
    }
    auto world = dtensor::DeviceMesh::create(rendezvous, context_shape, context_names, "context_mesh", 1);
    meshes.context = piped ? world->submesh(inner_axes(*world)) : world;
  }
  return meshes;
}

}  // namespace framework::parallel
