#pragma once
// Initializing a (possibly sharded) state from a file of full weights made
// elsewhere: safetensors, or a torch.save dict of tensors (weights_file.h).
// No communication: every rank opens the file and reads only the box of each
// tensor it holds (for a dim-0 shard, one contiguous range per tensor).
//
// Call sequence: (every rank) build the state dict of the fresh model as for
// a checkpoint load, then load_weights_into. Ranks that hold replicas each
// read their copy.
#include "checkpoint/interop/weights_file.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/storage/storage.h"

#include <memory>
#include <string>
#include <vector>

namespace checkpoint {

struct ImportStats {
  uint64_t tensors = 0;                  // entries of the state filled
  uint64_t bytes_read = 0;               // from the file
  std::vector<std::string> missing;      // state names the file lacks (allow_partial)
  std::vector<std::string> unexpected;   // file names the state lacks (allow_partial)
  std::vector<std::string> converted;    // filled with a float dtype conversion
};

// Fills every tensor entry of `state` named `prefix` + <name> (e.g. prefix
// "model.") from the file's tensor <name>; entries not under `prefix` (and
// bytes entries) are left alone. The global shape must equal the file's
// shape. Dtypes must be equal, except that floating-point types convert into
// each other (float32, float64, float16, bfloat16) as torch's copy_ does
// (round to nearest even); those entries are listed in `converted`.
// Throws FormatError with one message listing every missing and unexpected
// name (unless allow_partial) and every shape or dtype mismatch (always),
// without having changed the state; errors reading the file name it.
// The file is read through `storage` (null: the POSIX file system).
ImportStats load_weights_into(StateDict& state, const std::string& path, const std::string& prefix,
                              bool allow_partial, std::shared_ptr<Storage> storage = nullptr);

// The same from a file already open: for one read under our names
// (WeightsFile::renamed: a Hugging Face mixture of experts' experts stack
// into ours).
ImportStats load_weights_into(StateDict& state, const WeightsFile& file, const std::string& prefix,
                              bool allow_partial);

}  // namespace checkpoint
