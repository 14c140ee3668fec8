// checkpoint_basic: saves and loads a map of plain tensors with the shardkit
// checkpoint library, sharded over N ranks. Build: see CMakeLists.txt.
//
//   checkpoint_basic [--nproc N] [--dir DIR]
//
// Started outside torchrun/SLURM, it runs N copies of itself as ranks 0..N-1
// (default 2) with the library's local launcher, as `torchrun --standalone`
// would, in a fresh directory under /tmp unless --dir is given. Each rank:
//   1. holds a dim-0 slice of the sharded tensors and a replica of "scale";
//   2. saves them, zstd-compressed, with save_state_dict (all ranks);
//   3. saves them again asynchronously with a CheckpointManager (all ranks);
//   4. loads the async checkpoint into a different split: column slices, in
//      reversed rank order (each rank alone, no communication);
// and rank 0 also loads the first checkpoint into full tensors, then inspects
// and verifies both. Prints "checkpoint_basic: OK" when every rank got back
// what was saved.
#include "checkpoint/shardkit_checkpoint.h"
#include "comm/self_launch.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace ck = checkpoint;
namespace fd = comm;

namespace {

using TensorMap = std::map<std::string, torch::Tensor>;

// The tensors to checkpoint: the same values on every rank (fixed seed).
TensorMap make_tensors() {
  torch::manual_seed(0);
  return {
      {"encoder.weight", torch::randn({10, 6})},
      {"encoder.bias", torch::randn({10})},
      {"token_counts", torch::arange(9, torch::kInt64)},  // 9 rows: an uneven split
      {"scale", torch::full({3}, 0.5, torch::kFloat64)},  // replicated on every rank
  };
}

bool is_sharded(const std::string& name) { return name != "scale"; }

// This rank's state: of each sharded tensor, part `part` of `parts` along dim
// 0 (or along the last dim with `by_columns`); of the others, the whole
// tensor. With `zeros` the boxes are zero-filled, ready to load into
// (load_state_dict needs contiguous CPU tensors of the saved dtype).
ck::StateDict make_state(const TensorMap& tensors, int part, int parts, bool by_columns,
                         bool zeros) {
  ck::StateDict state;
  for (const auto& [name, full] : tensors) {
    torch::Tensor local = full;
    std::vector<int64_t> offsets(full.dim(), 0);
    if (is_sharded(name)) {
      const int64_t dim = by_columns ? full.dim() - 1 : 0;
      const int64_t per = (full.size(dim) + parts - 1) / parts;
      const int64_t lo = std::min(full.size(dim), per * part);
      local = full.narrow(dim, lo, std::min(full.size(dim) - lo, per));
      offsets[dim] = lo;
    }
    local = zeros ? torch::zeros(local.sizes(), local.options()) : local.clone();
    state.add_tensor(name, local, full.sizes().vec(), offsets);
  }
  return state;
}

// The number of entries of `state` that differ from their box of `tensors`.
int count_mismatches(const ck::StateDict& state, const TensorMap& tensors, const std::string& what) {
  int bad = 0;
  for (const ck::TensorEntry& e : state.tensors()) {
    torch::Tensor want = tensors.at(e.name);
    for (int64_t d = 0; d < want.dim(); ++d) want = want.narrow(d, e.offsets[d], e.local.size(d));
    if (!torch::equal(e.local, want)) {
      std::cerr << what << ": " << e.name << " differs from what was saved\n";
      ++bad;
    }
  }
  return bad;
}

// Rank 0: what the metadata says, and whether every chunk reads back intact.
int inspect_and_verify(const std::string& dir) {
  const ck::CheckpointMeta meta = ck::read_committed_metadata(*ck::posix_storage(), dir);
  std::cout << dir << ": step " << meta.step << ", saved by " << meta.world_size << " ranks\n";
  for (const ck::ItemMeta& item : meta.items) {
    std::cout << "  " << item.name << " " << ck::dtype_name(item.dtype) << " "
              << ck::shape_to_string(item.global_shape) << " in " << item.chunks.size()
              << " chunk(s)\n";
  }
  const ck::VerifyReport report = ck::verify_checkpoint(*ck::posix_storage(), dir);
  for (const ck::VerifyProblem& p : report.problems) std::cerr << p.message << "\n";
  return report.ok() ? 0 : 1;
}

int run_rank(const std::string& dir) {
  // Rank, world size and rendezvous address from the environment that the
  // launcher (or torchrun) set; then a Gloo process group over all ranks.
  const fd::LaunchEnv env = fd::detect_launch_env(fd::process_env());
  fd::DistOptions dist;
  dist.timeout_s = 60;  // a dead peer fails collectives after 60 s instead of hanging
  const std::unique_ptr<fd::Runtime> runtime = fd::init_runtime(env, dist, fd::DeviceKind::kCpu);
  fd::Group& group = *runtime->checkpoint;
  const int rank = group.rank();
  const int world = group.size();
  const TensorMap tensors = make_tensors();

  // 1-2. A sharded, compressed save: every rank calls it; it returns after
  //      the commit, or throws on every rank if any rank failed.
  ck::StateDict state = make_state(tensors, rank, world, /*by_columns=*/false, /*zeros=*/false);
  ck::SaveOptions save;
  save.step = 1;
  save.compression.codec = checkpoint::Codec::kZstd;
  save.io_threads = 2;
  const std::string sync_dir = dir + "/sync";
  ck::save_state_dict(state, sync_dir, group, save);

  // 3. An async save: save() returns once the state is copied into host
  //    buffers; a background thread writes <dir>/async/step_2 over `group`
  //    (which nothing else may use until finish() returns).
  ck::CheckpointOptions options;
  options.dir = dir + "/async";
  options.mode = checkpoint::SaveMode::kAsync;
  options.io_threads = 2;
  {
    ck::CheckpointManager manager(options, "", group, "dim-0 shards");
    manager.save(/*step=*/2, state);
    for (ck::TensorEntry& e : state.tensors()) e.local.zero_();  // fine: the copy is saved
    manager.finish();  // waits for the commit; rethrows a failure as CheckpointError
  }
  const std::string async_dir = ck::latest_committed(*ck::posix_storage(), options.dir).value().path;

  // 4. Load into a different split. No communication: every rank reads just
  //    the blocks that overlap its boxes.
  ck::LoadOptions load;
  load.io_threads = 2;
  int bad = 0;
  ck::StateDict resharded = make_state(tensors, world - 1 - rank, world, /*by_columns=*/true,
                                       /*zeros=*/true);
  ck::load_state_dict(resharded, async_dir, load);
  bad += count_mismatches(resharded, tensors, "column-split load");

  if (rank == 0) {
    // One process, full tensors: what a tool or a single-GPU job would do.
    ck::StateDict whole = make_state(tensors, 0, 1, /*by_columns=*/false, /*zeros=*/true);
    ck::load_state_dict(whole, sync_dir, load);
    bad += count_mismatches(whole, tensors, "single-process load");
    bad += inspect_and_verify(sync_dir);
    bad += inspect_and_verify(async_dir);
  }

  // Every rank learns whether any rank saw a difference.
  torch::Tensor failures = torch::full({1}, bad, torch::kInt64);
  group.all_reduce(failures);
  if (failures.item<int64_t>() != 0) return 1;
  if (rank == 0) std::cout << "checkpoint_basic: OK" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fd::self_launching_main(argc, argv, "checkpoint_basic", run_rank);
}
