#include "framework/dtensor/device_mesh.h"

#include <set>
#include <stdexcept>

namespace framework::dtensor {

std::vector<int64_t> DeviceMesh::coordinates_of(int64_t rank, const std::vector<int64_t>& shape) {
  int64_t total = 1;
  for (int64_t extent : shape) total *= extent;
  TORCH_CHECK(rank >= 0 && rank < total, "DeviceMesh: rank ", rank, " outside a mesh of ",
              total, " ranks");
  std::vector<int64_t> coords(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    coords[i] = rank % shape[i];
    rank /= shape[i];
  }
  return coords;
}

int64_t DeviceMesh::rank_of(const std::vector<int64_t>& coordinates,
                            const std::vector<int64_t>& shape) {
  TORCH_CHECK(coordinates.size() == shape.size(), "DeviceMesh: ", coordinates.size(),
              " coordinates for a ", shape.size(), "-D mesh");
  int64_t rank = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    TORCH_CHECK(coordinates[i] >= 0 && coordinates[i] < shape[i], "DeviceMesh: coordinate ",
                coordinates[i], " on axis ", i, " outside extent ", shape[i]);
    rank = rank * shape[i] + coordinates[i];
  }
  return rank;
}

std::shared_ptr<DeviceMesh> DeviceMesh::create(comm::Rendezvous& rv,
                                               std::vector<int64_t> shape,
                                               std::vector<std::string> axis_names,
                                               const std::string& name, int channels) {
  TORCH_CHECK(channels >= 1, "DeviceMesh '", name, "': channels must be >= 1, got ", channels);
  TORCH_CHECK(!shape.empty(), "DeviceMesh '", name, "': shape must have at least one axis");
  TORCH_CHECK(axis_names.size() == shape.size(), "DeviceMesh '", name, "': ", axis_names.size(),
              " axis names for ", shape.size(), " axes");
  int64_t total = 1;
  std::set<std::string> seen;
  for (size_t i = 0; i < shape.size(); ++i) {
    TORCH_CHECK(shape[i] >= 1, "DeviceMesh '", name, "': axis '", axis_names[i],
                "' has extent ", shape[i], ", must be >= 1");
    TORCH_CHECK(!axis_names[i].empty(), "DeviceMesh '", name, "': axis ", i, " has no name");
    TORCH_CHECK(seen.insert(axis_names[i]).second, "DeviceMesh '", name,
                "': duplicate axis name '", axis_names[i], "'");
    total *= shape[i];
  }
  TORCH_CHECK(total == rv.world_size(), "DeviceMesh '", name, "': shape holds ", total,
              " ranks but the world size is ", rv.world_size());

  std::shared_ptr<DeviceMesh> mesh(new DeviceMesh());
  mesh->name_ = name;
  mesh->shape_ = std::move(shape);
  mesh->axis_names_ = std::move(axis_names);
  mesh->global_rank_ = rv.rank();
  mesh->world_size_ = rv.world_size();
  mesh->coordinates_ = coordinates_of(rv.rank(), mesh->shape_);

  for (int axis = 0; axis < mesh->ndim(); ++axis) {
    // Members: this rank's coordinates with `axis` varied, ascending.
    std::vector<int> members;
    std::vector<int64_t> coords = mesh->coordinates_;
    for (int64_t k = 0; k < mesh->shape_[axis]; ++k) {
      coords[axis] = k;
      members.push_back(static_cast<int>(rank_of(coords, mesh->shape_)));
    }
    // Index of the group: the other coordinates, row-major.
    int64_t index = 0;
    for (int other = 0; other < mesh->ndim(); ++other) {
      if (other != axis) index = index * mesh->shape_[other] + mesh->coordinates_[other];
    }
    std::string group_name = name + "." + mesh->axis_names_[axis] + "." + std::to_string(index);
    auto group = rv.new_group(group_name, members);
    TORCH_INTERNAL_ASSERT(group->rank() == mesh->coordinates_[axis], "mesh group ", group_name,
                          " has member index ", group->rank(), ", expected coordinate ",
                          mesh->coordinates_[axis]);
    mesh->groups_.push_back(std::move(group));
    mesh->extra_.emplace_back();
    if (mesh->shape_[axis] == 1) continue;
    for (int c = 1; c < channels; ++c) {
      mesh->extra_.back().push_back(rv.new_group(group_name + ".c" + std::to_string(c), members));
    }
  }
  mesh->channels_ = channels;
  return mesh;
}

std::shared_ptr<DeviceMesh> DeviceMesh::from_groups(
    std::vector<int64_t> shape, std::vector<std::string> axis_names,
    std::vector<std::shared_ptr<comm::Group>> groups, const std::string& name) {
  if (shape.size() != axis_names.size() || shape.size() != groups.size() || shape.empty()) {
    throw std::invalid_argument("DeviceMesh::from_groups('" + name +
                                "'): shape, axis_names and groups differ in length");
  }
  std::shared_ptr<DeviceMesh> mesh(new DeviceMesh());
  mesh->name_ = name;
  for (size_t i = 0; i < shape.size(); ++i) {
    const std::string axis = "DeviceMesh::from_groups('" + name + "'): axis '" + axis_names[i] + "'";
    if (groups[i] == nullptr && shape[i] != 1) {
      throw std::invalid_argument(axis + " has extent " + std::to_string(shape[i]) + " but no group");
    }
    if (groups[i] != nullptr && groups[i]->size() != shape[i]) {
      throw std::invalid_argument(axis + " has extent " + std::to_string(shape[i]) + " but group '" +
                                  groups[i]->name() + "' has " + std::to_string(groups[i]->size()) +
                                  " members");
    }
    mesh->coordinates_.push_back(groups[i] == nullptr ? 0 : groups[i]->rank());
  }
  mesh->shape_ = std::move(shape);
  mesh->axis_names_ = std::move(axis_names);
  mesh->groups_ = std::move(groups);
  mesh->extra_.resize(mesh->groups_.size());
  mesh->global_rank_ = static_cast<int>(rank_of(mesh->coordinates_, mesh->shape_));
  int64_t total = 1;
  for (int64_t e : mesh->shape_) total *= e;
  mesh->world_size_ = static_cast<int>(total);
  return mesh;
}

std::shared_ptr<DeviceMesh> DeviceMesh::permuted(const std::vector<int>& order) const {
  std::vector<bool> seen(shape_.size(), false);
  if (order.size() != shape_.size()) {
    throw std::invalid_argument("DeviceMesh '" + name_ + "': permuted() needs " +
                                std::to_string(shape_.size()) + " axes, got " +
                                std::to_string(order.size()));
  }
  std::shared_ptr<DeviceMesh> view(new DeviceMesh());
  view->name_ = name_;
  for (int axis : order) {
    if (axis < 0 || axis >= ndim() || seen[axis]) {
      throw std::invalid_argument("DeviceMesh '" + name_ + "': permuted() needs a permutation of its axes");
    }
    seen[axis] = true;
    view->shape_.push_back(shape_[axis]);
    view->axis_names_.push_back(axis_names_[axis]);
    view->coordinates_.push_back(coordinates_[axis]);
    view->groups_.push_back(groups_[axis]);
    view->extra_.push_back(extra_[axis]);
  }
  view->channels_ = channels_;
  view->global_rank_ = global_rank_;
  view->world_size_ = world_size_;
  return view;
}

std::shared_ptr<DeviceMesh> DeviceMesh::submesh(const std::vector<int>& axes) const {
  if (axes.empty()) throw std::invalid_argument("DeviceMesh '" + name_ + "': submesh() needs an axis");
  std::shared_ptr<DeviceMesh> sub(new DeviceMesh());
  sub->name_ = name_;
  int last = -1;
  for (int axis : axes) {
    if (axis <= last || axis >= ndim()) {
      throw std::invalid_argument("DeviceMesh '" + name_ + "': submesh() needs distinct axes in ascending order below " +
                                  std::to_string(ndim()));
    }
    last = axis;
    sub->shape_.push_back(shape_[axis]);
    sub->axis_names_.push_back(axis_names_[axis]);
    sub->coordinates_.push_back(coordinates_[axis]);
    sub->groups_.push_back(groups_[axis]);
    sub->extra_.push_back(extra_[axis]);
  }
  sub->channels_ = channels_;
  sub->global_rank_ = static_cast<int>(rank_of(sub->coordinates_, sub->shape_));
  int64_t total = 1;
  for (int64_t e : sub->shape_) total *= e;
  sub->world_size_ = static_cast<int>(total);
  return sub;
}

void DeviceMesh::check_axis(int axis) const {
  TORCH_CHECK(axis >= 0 && axis < ndim(), "DeviceMesh '", name_, "': axis ", axis,
              " out of range for a ", ndim(), "-D mesh");
}

int64_t DeviceMesh::size(int axis) const {
  check_axis(axis);
  return shape_[axis];
}

int64_t DeviceMesh::coordinate(int axis) const {
  check_axis(axis);
  return coordinates_[axis];
}

comm::Group& DeviceMesh::group(int axis) {
  check_axis(axis);
  TORCH_CHECK(groups_[axis] != nullptr, "DeviceMesh '", name_, "': axis '", axis_names_[axis],
              "' has no group (extent 1, made by from_groups)");
  return *groups_[axis];
}

comm::Group& DeviceMesh::group(int axis, int channel) {
  check_axis(axis);
  TORCH_CHECK(channel >= 0, "DeviceMesh '", name_, "': channel ", channel, " is negative");
  const auto& extra = extra_[axis];
  const size_t c = static_cast<size_t>(channel) % (extra.size() + 1);
  return c == 0 ? group(axis) : *extra[c - 1];
}

int DeviceMesh::axis_index(const std::string& name) const {
  int found = -1;
  std::string known;
  for (int i = 0; i < ndim(); ++i) {
    if (axis_names_[i] == name) found = i;
    known += (i == 0 ? "" : ", ") + axis_names_[i];
  }
  TORCH_CHECK(found >= 0, "DeviceMesh '", name_, "': no axis named '", name, "' (axes: ", known,
              ")");
  return found;
}

}  // namespace framework::dtensor
