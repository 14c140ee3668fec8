#pragma once
// The learning-rate schedule: a pure function of the step, so a resumed run
// needs no schedule state beyond the step itself.
#include "framework/optim/options.h"

#include <cstdint>

namespace framework::optim {

// Step is 1-based. Linear warmup from lr/warmup_steps to lr over
// warmup_steps, then cosine from lr down to min_lr at total_steps.
double lr_at(const OptimOptions& options, int64_t step, int64_t total_steps);

}  // namespace framework::optim
