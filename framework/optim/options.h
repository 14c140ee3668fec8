#pragma once
// AdamW and the learning-rate schedule (config section `optim`).
#include <cstdint>

namespace framework::optim {

struct OptimOptions {
  double lr = 3e-3;           // peak learning rate, reached after warmup
  double min_lr = 3e-4;       // cosine floor at the last step
  int64_t warmup_steps = 10;  // linear warmup from 0
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
};

}  // namespace framework::optim
