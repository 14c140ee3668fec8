// The device meshes of a layout (mesh.h).
#include "framework/parallel/mesh.h"

namespace framework::parallel {

Meshes build_meshes(const Layout& layout, comm::Rendezvous& rendezvous, int channels) {
  Meshes meshes;
  std::vector<int64_t> shape = layout.stage_shape();
  std::vector<std::string> names = layout.stage_axis_names();
  if (layout.pipeline == 1) {
    meshes.stage = dtensor::DeviceMesh::create(rendezvous, shape, names, "mesh", channels);
    meshes.world = meshes.stage;
    if (layout.expert > 1) {
      meshes.expert = dtensor::DeviceMesh::create(rendezvous, layout.expert_shape(),
                                                  {"replicate", "expert_shard", "expert"}, "expert_mesh", channels);
    }
    return meshes;
  }
  shape.insert(shape.begin(), layout.pipeline);
  names.insert(names.begin(), "pipeline");
  meshes.world = dtensor::DeviceMesh::create(rendezvous, shape, names, "mesh", channels);
  std::vector<int> stage_axes;
  for (int a = 1; a < meshes.world->ndim(); ++a) stage_axes.push_back(a);
  meshes.stage = meshes.world->submesh(stage_axes);
  return meshes;
}

}  // namespace framework::parallel
