#pragma once
// The trainer's conventions for what it saves beside the model and
// optimizer, which checkpoint/ does not know: the names of its items, and
// the run adapter through which the exports read them (checkpoint::RunAdapter:
// the config item parsed as a Config, the model kind's Hugging Face adapter
// from models/hf_adapter.h). Torch-free: the ckpt tool uses it.
//
// Example (what `ckpt export` does):
//   checkpoint::ExportOptions options;
//   options.run = framework::config::make_run_adapter();
//   checkpoint::export_checkpoint(step_dir, out, options);
#include "checkpoint/interop/export.h"

#include <memory>

namespace framework::config {

// The trainer's bytes items (framework/train: make_state_dict).
inline constexpr const char* kStepItem = "train.step";     // int64, the last step taken
inline constexpr const char* kLoaderItem = "data.loader";  // the data loader's position
inline constexpr const char* kRngItem = "rng.cpu";         // LibTorch's CPU generator state
inline constexpr const char* kConfigItem = "config";       // the effective config (to_yaml)

// Reads the config item with parse_config; hf_config_json asks the
// model.kind's Hugging Face adapter (models::find_hf_adapter), the
// optimizer group is optim.*, the tokenizer data.tokenizer.
std::shared_ptr<const checkpoint::RunAdapter> make_run_adapter();

}  // namespace framework::config
