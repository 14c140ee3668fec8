#pragma once
// Test oracle: the save planner before issue "Scale" (reference_planner.cpp).
#include "checkpoint/plan/planner.h"

namespace checkpoint::reference {

GlobalPlan make_global_plan(const std::vector<LocalPlan>& plans, const PlanOptions& options);

}  // namespace checkpoint::reference
