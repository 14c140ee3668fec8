#pragma once
// AdamW and the learning-rate schedule (config section `optim`).
#include <cstdint>
#include <string>

#include "comm/enum_text.h"

namespace framework::optim {

// train.optimizer_impl: which AdamW implementation (sharded_adamw.h,
// resolve_adamw_impl); auto: the fastest this build has.
enum class OptimizerImpl { kAuto, kFused, kForeach, kForLoop };

inline constexpr OptimizerImpl kOptimizerImpls[] = {OptimizerImpl::kAuto, OptimizerImpl::kFused,
                                                    OptimizerImpl::kForeach, OptimizerImpl::kForLoop};

inline const char* to_string(OptimizerImpl impl) {
  switch (impl) {
    case OptimizerImpl::kAuto: return "auto";
    case OptimizerImpl::kFused: return "fused";
    case OptimizerImpl::kForeach: return "foreach";
    case OptimizerImpl::kForLoop: return "for_loop";
  }
  return "?";
}

// Throws std::invalid_argument naming the key and the allowed values.
inline OptimizerImpl parse_optimizer_impl(const std::string& impl) {
  return comm::parse_enum("train.optimizer_impl", impl, kOptimizerImpls);
}

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
