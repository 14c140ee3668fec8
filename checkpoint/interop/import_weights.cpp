#include "checkpoint/interop/import_weights.h"

#include "checkpoint/format/metadata.h"
#include "checkpoint/interop/weights_file.h"

#include <set>
#include <sstream>

namespace checkpoint {

namespace {

struct ImportJob {
  TensorEntry* entry;
  const WeightsTensorInfo* info;
};

// Reads the entry's box from the file, converting float types when they differ.
void fill_entry(const WeightsFile& file, const ImportJob& job) {
  TensorEntry& t = *job.entry;
  const Box box{t.offsets, t.local.sizes().vec()};
  const bool same_dtype = to_dtype(t.local.scalar_type()) == job.info->dtype;
  if (same_dtype && t.local.is_contiguous()) {
    file.read_box(job.info->name, box, static_cast<uint8_t*>(t.local.data_ptr()));
    return;
  }
  torch::Tensor staged = torch::empty(t.local.sizes(), torch::dtype(to_scalar_type(job.info->dtype)));
  file.read_box(job.info->name, box, static_cast<uint8_t*>(staged.data_ptr()));
  torch::NoGradGuard no_grad;
  t.local.copy_(staged);
}

}  // namespace

ImportStats load_weights_into(StateDict& state, const std::string& path, const std::string& prefix,
                              bool allow_partial, std::shared_ptr<Storage> storage) {
  return load_weights_into(state, WeightsFile::open(path, storage ? storage : posix_storage()), prefix,
                           allow_partial);
}

ImportStats load_weights_into(StateDict& state, const WeightsFile& file, const std::string& prefix,
                              bool allow_partial) {
  const std::string& path = file.path();
  ImportStats stats;
  std::vector<std::string> mismatches;
  std::set<std::string> used;
  std::vector<ImportJob> jobs;
  for (TensorEntry& t : state.tensors()) {
    if (t.name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string name = t.name.substr(prefix.size());
    const WeightsTensorInfo* info = file.find(name);
    if (info == nullptr) {
      stats.missing.push_back(name);
      continue;
    }
    used.insert(name);
    const DType want = to_dtype(t.local.scalar_type());
    if (info->shape != t.global_shape) {
      mismatches.push_back(name + " has shape " + shape_to_string(info->shape) + " in the file, " +
                           shape_to_string(t.global_shape) + " in the model");
    } else if (want != info->dtype && !(is_floating_dtype(want) && is_floating_dtype(info->dtype))) {
      mismatches.push_back(name + " is " + dtype_name(info->dtype) + " in the file, " +
                           dtype_name(want) + " in the model");
    } else {
      if (want != info->dtype) stats.converted.push_back(name);
      jobs.push_back(ImportJob{&t, info});
    }
  }
  for (const WeightsTensorInfo& info : file.tensors()) {
    if (!used.count(info.name)) stats.unexpected.push_back(info.name);
  }
  const bool unmatched = !stats.missing.empty() || !stats.unexpected.empty();
  if (!mismatches.empty() || (unmatched && !allow_partial)) {
    std::ostringstream msg;
    msg << "weights file " << path << " (" << file.format() << ") does not match the model";
    if (!stats.missing.empty()) msg << "; missing: " << join_names(stats.missing);
    if (!stats.unexpected.empty()) msg << "; unexpected: " << join_names(stats.unexpected);
    if (!mismatches.empty()) msg << "; " << join_names(mismatches);
    if (!prefix.empty() && !stats.unexpected.empty() &&
        stats.unexpected.front().compare(0, prefix.size(), prefix) == 0) {
      msg << " (the file's names start with '" << prefix << "': export with --only "
          << prefix.substr(0, prefix.size() - 1) << ")";
    } else if (mismatches.empty()) {
      msg << " (allow_partial tolerates missing and unexpected names)";
    }
    throw FormatError(msg.str());
  }
  for (const ImportJob& job : jobs) {
    fill_entry(file, job);
    ++stats.tensors;
    stats.bytes_read += static_cast<uint64_t>(job.entry->local.numel()) * element_size(job.info->dtype);
  }
  return stats;
}

}  // namespace checkpoint
