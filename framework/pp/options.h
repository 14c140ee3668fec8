#pragma once
// Pipeline parallelism's options (config keys parallel.pipeline*,
// parallel.stages_per_rank). Torch-free.
#include "comm/enum_text.h"

#include <string>

namespace framework::pp {

// parallel.pipeline_schedule, as torch.distributed.pipelining names them:
//   gpipe            every micro-batch's forward, then every backward;
//   1f1b             after P - 1 - rank warm-up forwards, one forward and
//                    one backward in turn: at most P micro-batches'
//                    activations held per stage;
//   interleaved_1f1b Megatron's interleaved 1F1B over
//                    parallel.stages_per_rank (> 1) stages per rank, stage
//                    s on pipeline rank s mod P: a smaller bubble.
enum class Schedule { kGpipe, k1F1B, kInterleaved1F1B };

inline constexpr comm::EnumName<Schedule> kSchedules[] = {
    {Schedule::kGpipe, "gpipe"}, {Schedule::k1F1B, "1f1b"},
    {Schedule::kInterleaved1F1B, "interleaved_1f1b"}};
inline const char* to_string(Schedule schedule) { return comm::enum_text(schedule, kSchedules); }
inline Schedule parse_schedule(const std::string& text) {
  return comm::parse_enum("parallel.pipeline_schedule", text, kSchedules);
}

}  // namespace framework::pp
