// The parallel layout (layout.h): resolving the degrees against a world
// size, and the rules that need none.
#include "framework/parallel/layout.h"

#include "framework/pp/schedule.h"

#include <stdexcept>
#include <utility>

namespace framework::parallel {

namespace {

[[noreturn]] void refuse(const std::string& message) { throw std::invalid_argument(message); }

std::string text(int64_t v) { return std::to_string(v); }

}  // namespace

fsdp::FsdpOptions fsdp_options(const ParallelConfig& config) {
  fsdp::FsdpOptions options;
  options.reshard_after_forward = config.reshard_after_forward;
  options.prefetch = config.prefetch;
  return options;
}

Layout resolve(const ParallelConfig& config, int64_t world) {
  Layout layout;
  if (config.pipeline < 1 || world % config.pipeline != 0) {
    refuse("parallel.pipeline (" + text(config.pipeline) + ") does not divide the world size " + text(world));
  }
  layout.pipeline = config.pipeline;
  const int64_t stage = world / config.pipeline;
  if (config.replicate == -1 && config.shard == -1) {
    refuse("parallel.replicate and parallel.shard cannot both be -1");
  }
  if (config.tensor < 1 || stage % config.tensor != 0) {
    refuse("parallel.tensor (" + text(config.tensor) + ") does not divide the world size " + text(stage));
  }
  layout.tensor = config.tensor;
  const int64_t data_parallel = stage / config.tensor;
  int64_t r = config.replicate, s = config.shard;
  if (r == -1) r = data_parallel % s == 0 ? data_parallel / s : -1;
  if (s == -1) s = data_parallel % r == 0 ? data_parallel / r : -1;
  if (r < 1 || s < 1 || r * s != data_parallel) {
    refuse("parallel.replicate (" + text(config.replicate) + ") x parallel.shard (" + text(config.shard) +
           ") does not match the " + (config.tensor > 1 ? "data-parallel size " : "world size ") +
           text(data_parallel));
  }
  layout.replicate = r;
  layout.shard = s;
  if (config.expert < 1 || s % config.expert != 0) {
    refuse("parallel.expert (" + text(config.expert) + ") must divide the shard degree " + text(s) +
           ": expert parallelism borrows its ranks from the shard axis");
  }
  layout.expert = config.expert;
  if (config.context < 1 || s % config.context != 0) {
    refuse("parallel.context (" + text(config.context) + ") must divide the shard degree " + text(s) +
           ": context parallelism borrows its ranks from the shard axis");
  }
  layout.context = config.context;
  return layout;
}

int64_t split_batch(const ParallelConfig& config, const Layout& layout, int64_t global_batch, int64_t micro_batch) {
  // A context group reads the same samples: the batch splits over the rest.
  const int64_t ranks = layout.batch_parallel();
  const std::string what = layout.context > 1 ? "data-parallel ranks / parallel.context (" : "data-parallel ranks (";
  if (global_batch % ranks != 0) {
    refuse("train.global_batch_size (" + text(global_batch) + ") must be divisible by the " + what + text(ranks) +
           ")");
  }
  if (micro_batch > 0 && global_batch % (micro_batch * ranks) != 0) {
    refuse("train.global_batch_size (" + text(global_batch) + ") must be divisible by train.micro_batch_size (" +
           text(micro_batch) + ") x " + what + text(ranks) + ")");
  }
  const int64_t micro_batches = micro_batch > 0 ? global_batch / ranks / micro_batch : 1;
  if (layout.pipeline > 1) {
    pp::check_schedule(config.pipeline_schedule, layout.pipeline, config.stages_per_rank, micro_batches);
  }
  return micro_batches;
}

void check_config(const ParallelConfig& config, const std::function<std::string(const std::string&)>& describe) {
  if (config.replicate == -1 && config.shard == -1) {
    refuse(describe("parallel.replicate") + " and " + describe("parallel.shard") +
           " are both -1; at most one degree can be derived from the world size");
  }
  if (config.pipeline > 1) {
    try {
      // What needs no world size: the schedule's stages per rank (its
      // micro-batch rule is checked when the local batch is known).
      pp::check_schedule(config.pipeline_schedule, config.pipeline, config.stages_per_rank, config.pipeline);
    } catch (const std::exception& e) {
      refuse(describe("parallel.pipeline_schedule") + ", " + describe("parallel.stages_per_rank") + ": " +
             e.what());
    }
  } else if (config.stages_per_rank != 1) {
    refuse(describe("parallel.stages_per_rank") + " needs " + describe("parallel.pipeline") + " above 1");
  }
}

std::vector<int64_t> Layout::context_shape() const {
  if (tensor > 1) return {replicate, batch_shard(), context, tensor};
  return {replicate, batch_shard(), context};
}

std::vector<std::string> Layout::context_axis_names() const {
  if (tensor > 1) return {"replicate", "batch_shard", "context", "tensor"};
  return {"replicate", "batch_shard", "context"};
}

std::vector<int64_t> Layout::stage_shape() const {
  if (tensor > 1) return {replicate, shard, tensor};
  return {replicate, shard};
}

std::vector<int64_t> Layout::expert_shape() const {
  if (tensor > 1) return {replicate, expert_shard(), expert, tensor};
  return {replicate, expert_shard(), expert};
}

std::vector<std::string> Layout::expert_axis_names() const {
  if (tensor > 1) return {"replicate", "expert_shard", "expert", "tensor"};
  return {"replicate", "expert_shard", "expert"};
}

std::vector<std::string> Layout::stage_axis_names() const {
  if (tensor > 1) return {"replicate", "shard", "tensor"};
  return {"replicate", "shard"};
}

Layout::Coordinates Layout::coordinates(int64_t rank) const {
  Coordinates c;
  const int64_t in_stage = rank % stage_world();
  c.pipeline = rank / stage_world();
  c.data_parallel = in_stage / tensor;
  c.tensor = in_stage % tensor;
  c.batch = c.data_parallel / context;
  c.context = c.data_parallel % context;
  return c;
}

std::string Layout::data_parallel_name() const {
  const bool tp = tensor > 1;
  std::string dp;
  if (shard == 1) {
    dp = replicate == 1 ? (tp ? "" : "single") : "ddp";
  } else {
    dp = replicate == 1 ? "fsdp" : "hsdp";
  }
  if (!tp) return dp;
  return dp.empty() ? "tp" : dp + "+tp";
}

std::string Layout::describe() const {
  std::string out = data_parallel_name() + " replicate=" + text(replicate) + " shard=" + text(shard);
  if (expert > 1) out += " expert=" + text(expert);
  if (context > 1) out += " context=" + text(context);
  if (tensor > 1) out += " tensor=" + text(tensor);
  return out;
}

}  // namespace framework::parallel
