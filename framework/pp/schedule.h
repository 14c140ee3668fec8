#pragma once
// Pipeline schedules as plain lists of actions, and the split of a model's
// blocks into stages. Pure functions, torch-free: the runner (pipeline.h)
// executes the actions; tests check them directly.
//
// Stages: S = P x stages_per_rank stages, numbered in model order; stage s
// runs on pipeline rank s mod P (its "chunk" s / P there), as
// torch.distributed.pipelining's looped placement and Megatron's virtual
// pipeline have it.
#include "framework/pp/options.h"

#include <cstdint>
#include <string>
#include <vector>

namespace framework::pp {

struct Action {
  enum class Kind { kForward, kBackward };
  Kind kind = Kind::kForward;
  int64_t stage = 0;  // global stage index
  int64_t micro = 0;  // micro-batch index
  bool operator==(const Action& o) const { return kind == o.kind && stage == o.stage && micro == o.micro; }
};

// What one schedule needs, checked before a run (exits 2 through the config
// with one line): micro-batches from train.micro_batch_size.
//   1f1b: micro_batches >= P (fewer leave stages idle with nothing gained
//         over gpipe; torch.distributed.pipelining refuses them too);
//   interleaved_1f1b: stages_per_rank > 1 and micro_batches a multiple of P
//         (Megatron's rule);
//   gpipe, 1f1b: stages_per_rank 1.
// Throws std::invalid_argument naming the keys (parallel.pipeline_schedule,
// parallel.stages_per_rank, train.micro_batch_size) and the values.
void check_schedule(Schedule schedule, int64_t ranks, int64_t stages_per_rank, int64_t micro_batches);

// Pipeline rank `rank`'s actions of one step, in order. Every forward
// (stage s, micro m) comes before that pair's backward; the ranks' lists
// together run each pair's forward and backward exactly once, and never
// deadlock when sends do not block (tests simulate them).
// REQUIRES: check_schedule passed; 0 <= rank < ranks.
std::vector<Action> schedule_actions(Schedule schedule, int64_t ranks, int64_t rank,
                                     int64_t stages_per_rank, int64_t micro_batches);

// The most micro-batches whose forward has run and backward not yet, on
// any one stage of the list (activations held per stage).
int64_t peak_in_flight(const std::vector<Action>& actions);

// [first, end) block indices of each stage.
struct StageSpan {
  int64_t first = 0;
  int64_t end = 0;
};

// The model's blocks (names, in order: "model.layers.0", ...) over `stages`
// stages: at the split points (each names the first block of a stage after
// the first; comma-separated, torchtitan's pipeline_parallel_split_points),
// or, without any, evenly, the first n mod stages stages one block larger.
// Throws std::invalid_argument naming parallel.pipeline_split_points (a
// name that is no block, out of order, or not stages - 1 of them) or
// model.n_layers (fewer blocks than stages).
std::vector<StageSpan> split_blocks(const std::vector<std::string>& blocks, int64_t stages,
                                    const std::string& split_points);

}  // namespace framework::pp
