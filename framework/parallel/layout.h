#pragma once
// The parallel layout's one home, as torchtitan's ParallelDims: the config
// section `parallel:` as a value (ParallelConfig), and its resolution
// against a world size into every axis's degree (Layout), checked together
// by one pure, torch-free function (resolve). framework/parallel/mesh.h
// builds the device meshes from a Layout; nothing else does mesh arithmetic.
//
// The axes, outermost first: pipeline x replicate x shard x tensor. A rank's
// index is ((p x replicate + r) x shard + s) x tensor + t, so a tensor group
// is consecutive ranks (one node) and a pipeline stage's ranks are a block.
//
// Which axes a parallelism uses or borrows:
//   pipeline   its own axis; each stage is a mesh of the three axes inside;
//   replicate  DDP/HSDP: gradients all-reduced;
//   shard      FSDP: parameters sharded, all-gathered per unit;
//   tensor     TP: parameters split by the model's plan (framework/tp);
//   (expert and context parallelism borrow their ranks from the shard axis,
//   as in torchtitan: shard = expert-FSDP x expert, shard = batch_shard x
//   context; docs/architecture.md, "Adding a parallelism", lists what a new
//   axis touches.)
//   context    CP: each sequence split over `context` consecutive ranks of
//              the shard axis (framework/cp), which read the same samples;
//              the batch splits over replicate x batch_shard only, and FSDP
//              shards the parameters over the whole shard axis.
//
// Example:
//   const parallel::Layout layout = parallel::resolve(cfg.parallel, world);
//   layout.data_parallel();             // replicate x shard
//   layout.coordinates(rank).tensor;    // this rank's place on the tensor axis
#include "framework/cp/sequence_split.h"
#include "framework/fsdp/options.h"
#include "framework/pp/options.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace framework::parallel {

// The config section `parallel:` (keys in framework/config/schema.cpp).
// prefetch and reshard_after_forward are FSDP's own options
// (fsdp::FsdpOptions), kept in this section where users set them.
struct ParallelConfig {
  // Degrees. -1 (replicate or shard, not both): whatever the world size
  // leaves. replicate 1 = FSDP, shard 1 = DDP, both > 1 = HSDP.
  int64_t replicate = 1;
  int64_t shard = -1;
  // Tensor-parallel degree: the innermost axis. 1: none.
  int64_t tensor = 1;
  // Expert-parallel degree (a mixture of experts, docs/moe.md): the routed
  // experts split over this many ranks of the shard axis, which the
  // experts' FSDP then shards over the rest (shard = expert_shard x
  // expert, expert innermost). 1: none.
  int64_t expert = 1;
  // Context-parallel degree (framework/cp): each sequence split over this
  // many consecutive ranks of the shard axis (shard = batch_shard x
  // context, context innermost), attention run as a ring over them; the
  // batch splits over replicate x batch_shard. `context_load_balance`: the
  // head-tail split (2 x context chunks, rank r holding r and 2C-1-r) or
  // none (context chunks). 1: none.
  int64_t context = 1;
  cp::LoadBalance context_load_balance = cp::LoadBalance::kHeadTail;
  // Pipeline-parallel degree: the outermost axis. The model's blocks split
  // into pipeline x stages_per_rank stages (stage s on pipeline rank s mod
  // pipeline), evenly or at pipeline_split_points (comma-separated block
  // names, each the first block of a stage after the first). 1: none.
  int64_t pipeline = 1;
  pp::Schedule pipeline_schedule = pp::Schedule::k1F1B;
  int64_t stages_per_rank = 1;
  std::string pipeline_split_points;
  // FSDP (fsdp::FsdpOptions): free each unit's gathered parameters after
  // its forward; how many units ahead a gather is issued (0: no overlap).
  bool reshard_after_forward = true;
  int64_t prefetch = 1;
};

// Every axis's degree for one world size: their product is the world size.
struct Layout {
  int64_t pipeline = 1;
  int64_t replicate = 1;
  int64_t shard = 1;
  int64_t tensor = 1;
  int64_t expert = 1;  // of the shard axis's ranks
  int64_t context = 1;  // of the shard axis's ranks, innermost

  // The shard axis's ranks that read different samples (shard / context).
  int64_t batch_shard() const { return shard / context; }
  // The context mesh {replicate, batch_shard, context[, tensor]}: a
  // stage's ranks with the shard axis factored, context innermost of it
  // (the tensor axis only when tensor > 1: a context group is the ranks of
  // one tensor rank, each attending over its own heads), and its axis names.
  std::vector<int64_t> context_shape() const;
  std::vector<std::string> context_axis_names() const;

  // The experts' FSDP degree: the shard axis's ranks that hold the same experts.
  int64_t expert_shard() const { return shard / expert; }
  // The experts' mesh {replicate, expert_shard, expert[, tensor]}: a
  // stage's ranks with the shard axis factored (the tensor axis only when
  // tensor > 1: tensor parallelism leaves the experts whole, so each
  // tensor-parallel rank runs the same experts on the same tokens), and
  // its axis names.
  std::vector<int64_t> expert_shape() const;
  std::vector<std::string> expert_axis_names() const;

  int64_t world() const { return pipeline * stage_world(); }
  // The ranks of one pipeline stage (all of them without a pipeline).
  int64_t stage_world() const { return replicate * shard * tensor; }
  // The data-parallel ranks of a stage: FSDP/DDP reduce gradients over these.
  int64_t data_parallel() const { return replicate * shard; }
  // The ranks the batch is split over: the data-parallel ranks but the
  // context axis (a context group reads the same samples).
  int64_t batch_parallel() const { return replicate * batch_shard(); }

  // A stage's mesh, {replicate, shard} or, with tensor > 1, {replicate,
  // shard, tensor}, and its axis names; the world mesh puts "pipeline"
  // first when pipeline > 1.
  std::vector<int64_t> stage_shape() const;
  std::vector<std::string> stage_axis_names() const;

  struct Coordinates {
    int64_t pipeline = 0;       // the pipeline rank
    int64_t data_parallel = 0;  // the rank among the stage's data-parallel ranks
    int64_t tensor = 0;         // the rank on the tensor axis
    int64_t batch = 0;          // the rank among the ranks the batch is split over
    int64_t context = 0;        // the rank in its context group
  };
  // REQUIRES: 0 <= rank < world().
  Coordinates coordinates(int64_t rank) const;

  // The banner's data-parallel name: single, ddp, fsdp, hsdp, tp or
  // ddp/fsdp/hsdp+tp.
  std::string data_parallel_name() const;
  // A stage's layout as the banner prints it: "fsdp replicate=1 shard=2",
  // "hsdp+tp replicate=2 shard=2 tensor=2", "fsdp replicate=1 shard=4
  // context=2" (the pipeline is the caller's).
  std::string describe() const;
};

// FSDP's options from the section's FSDP keys (prefetch,
// reshard_after_forward); the rest of fsdp::FsdpOptions at its defaults.
fsdp::FsdpOptions fsdp_options(const ParallelConfig& config);

// Resolves the derived (-1) degree and checks every degree against
// `world`: throws std::invalid_argument naming the keys, their values and
// the size they do not divide or match.
Layout resolve(const ParallelConfig& config, int64_t world);

// The global batch over a layout's batch ranks (batch_parallel()): an even split and,
// with a micro-batch size (train.micro_batch_size; 0: none), whole
// micro-batches of it; a pipeline's schedule gets enough of them
// (pp::check_schedule). Returns the micro-batches per step (1 without a
// micro-batch size). Throws std::invalid_argument naming the keys and the
// values. The train command's dry run and preflight call it before any rank
// starts, the Trainer when it builds its mesh.
int64_t split_batch(const ParallelConfig& config, const Layout& layout, int64_t global_batch, int64_t micro_batch);

// The rules that need no world size, run when the config is loaded (the
// sequence's split over the context group is the config's
// check_consistency, which knows model.seq_len: cp::check_sequence_split).
// `describe(path)` is how a key is named in the message ("parallel.shard
// (-1, configs/x.yaml:4)"); throws std::invalid_argument.
void check_config(const ParallelConfig& config, const std::function<std::string(const std::string&)>& describe);

}  // namespace framework::parallel
