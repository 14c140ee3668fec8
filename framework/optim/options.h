#pragma once
// AdamW and the learning-rate schedule (config section `optim`).
#include <cstdint>
#include <string>

#include "comm/enum_text.h"

namespace framework::optim {

// train.optimizer_impl: which AdamW implementation (sharded_adamw.h,
// resolve_adamw_impl); auto: the fastest this build has.
enum class OptimizerImpl { kAuto, kFused, kForeach, kForLoop };

inline constexpr comm::EnumName<OptimizerImpl> kOptimizerImpls[] = {
    {OptimizerImpl::kAuto, "auto"}, {OptimizerImpl::kFused, "fused"},
    {OptimizerImpl::kForeach, "foreach"}, {OptimizerImpl::kForLoop, "for_loop"}};
inline const char* to_string(OptimizerImpl impl) { return comm::enum_text(impl, kOptimizerImpls); }

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
