#pragma once
// Moved: activation checkpointing is models/activation_checkpoint.h (a model
// applies it to its own blocks, and models/ includes nothing of framework/).
// The fsdp names stay.
#include "models/activation_checkpoint.h"

namespace framework::fsdp {

using models::BlockFn;
using models::checkpoint_activations;

}  // namespace framework::fsdp
