#include "checkpoint/interop/import_dcp.h"

#include <algorithm>
#include <map>

#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/metadata.h"

namespace checkpoint {

namespace {

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// The offsets of a local shard, as a box.
Box box_of(const TensorEntry& e) {
  Box b;
  b.offsets = e.offsets;
  b.sizes = e.local.sizes().vec();
  return b;
}

}  // namespace

DcpLoadStats load_dcp_into(StateDict& state, const std::string& dir, const DcpLoadOptions& options) {
  std::shared_ptr<Storage> storage = options.storage ? options.storage : posix_storage();
  const DcpMetadata meta = read_dcp_metadata(*storage, dir);
  DcpLoadStats stats;
  std::map<std::string, const DcpTensorItem*> by_name;
  for (const DcpTensorItem& item : meta.tensors) {
    if (item.fqn == "train_state.step") {
      stats.step = read_dcp_step(*storage, dir, item);
      continue;
    }
    const std::string name = dcp_to_shardkit_name(item.fqn, options.renames);
    if (name.empty()) {
      stats.ignored.push_back(item.fqn);
    } else if (!by_name.emplace(name, &item).second) {
      throw FormatError(dir + ": DCP keys '" + by_name[name]->fqn + "' and '" + item.fqn +
                        "' both map to '" + name + "'");
    }
  }
  for (const DcpBytesItem& b : meta.bytes) stats.ignored.push_back(b.fqn);

  // Check everything before changing anything.
  std::vector<std::string> problems;
  std::vector<std::string> required_missing;
  for (const TensorEntry& e : state.tensors()) {
    auto it = by_name.find(e.name);
    if (it == by_name.end()) {
      (starts_with(e.name, options.required_prefix) ? required_missing : stats.missing).push_back(e.name);
      continue;
    }
    const DcpTensorItem& item = *it->second;
    if (item.shape != e.global_shape) {
      problems.push_back(e.name + ": shape " + shape_to_string(item.shape) + " in '" + item.fqn +
                         "', " + shape_to_string(e.global_shape) + " here");
    } else if (item.dtype != to_dtype(e.local.scalar_type())) {
      problems.push_back(e.name + ": " + dtype_name(item.dtype) + " in '" + item.fqn + "', " +
                         dtype_name(to_dtype(e.local.scalar_type())) + " here");
    } else if (!e.local.is_contiguous() || !e.local.device().is_cpu()) {
      problems.push_back(e.name + ": the local tensor must be contiguous and on the CPU");
    }
  }
  for (const BytesEntry& b : state.bytes()) {
    const size_t dot = b.name.rfind(".step");
    if (!starts_with(b.name, "optim.") || dot == std::string::npos || dot + 5 != b.name.size()) continue;
    if (by_name.count(b.name) == 0) stats.missing.push_back(b.name);
  }
  if (!required_missing.empty()) {
    problems.insert(problems.begin(), "missing in the DCP checkpoint: " + join_names(required_missing));
  }
  if (!problems.empty()) {
    std::string msg = dir + ": cannot load the DCP checkpoint into this state:";
    for (const std::string& p : problems) msg += "\n  " + p;
    throw FormatError(msg);
  }

  int64_t max_optim_step = -1;
  for (TensorEntry& e : state.tensors()) {
    auto it = by_name.find(e.name);
    if (it == by_name.end()) continue;
    read_dcp_box(*storage, dir, *it->second, box_of(e), static_cast<uint8_t*>(e.local.data_ptr()));
    ++stats.tensors;
    stats.bytes_read += static_cast<uint64_t>(e.local.nbytes());
  }
  for (BytesEntry& b : state.bytes()) {
    auto it = by_name.find(b.name);
    if (it == by_name.end() || !starts_with(b.name, "optim.")) continue;
    const int64_t step = read_dcp_step(*storage, dir, *it->second);
    b.data.assign(8, 0);
    store_le(b.data.data(), static_cast<uint64_t>(step), 8);
    max_optim_step = std::max(max_optim_step, step);
    ++stats.tensors;
  }
  if (stats.step < 0) stats.step = max_optim_step;
  return stats;
}

}  // namespace checkpoint
