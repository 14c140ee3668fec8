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
#include "checkpoint/interop/renamed_tensor.h"
#include "models/options.h"

#include <memory>
#include <string>
#include <vector>

namespace framework::config {

// The trainer's bytes items (framework/train: make_state_dict).
inline constexpr const char* kStepItem = "train.step";     // int64, the last step taken
inline constexpr const char* kLoaderItem = "data.loader";  // the data loader's position
inline constexpr const char* kRngItem = "rng.cpu";         // LibTorch's CPU generator state
inline constexpr const char* kConfigItem = "config";       // the effective config (to_yaml)
// The resume audit's record (framework/train/resume_audit.h): JSON with the
// XXH3 of the next global batch's token ids and the data's identity (files,
// seed, batch size). Absent from checkpoints saved before it existed.
inline constexpr const char* kNextBatchItem = "data.next_batch";
inline constexpr const char* kLastLossItem = "train.last_loss";  // double (8 bytes LE), the saved step's loss
// LibTorch's CUDA generator state of the saving rank's device; only in the
// checkpoints of a run on a GPU.
inline constexpr const char* kRngCudaItem = "rng.cuda";
// A LoRA run's base (model.lora.rank > 0): its checkpoints hold the
// adapters, not the frozen base, and this item says which base they go on.
inline constexpr const char* kLoraBaseItem = "lora.base";

// The lora.base item: JSON {"path": model.init_from made absolute, "hash":
// checkpoint::weights_content_hash of it}; both empty for a base
// initialised at random from run.seed (no model.init_from).
struct LoraBase {
  std::string path;
  std::string hash;
};
std::string encode_lora_base(const LoraBase& base);
// Throws checkpoint::FormatError naming `where` for bytes that are not one.
LoraBase decode_lora_base(const std::string& bytes, const std::string& where);
// The record of `init_from` (made absolute; "" for none): hashes its
// weights, reading each tensor byte once.
LoraBase lora_base_of(const std::string& init_from);

// The parameters of a model of these options that its kind's Hugging Face
// format names or lays out otherwise (models::HfAdapter::renamed: a
// mixture of experts' stacked experts, one tensor per expert there), for
// reading a Hugging Face directory under our names (WeightsFile::renamed)
// and for writing one. Empty for a kind without an adapter.
std::vector<checkpoint::RenamedTensor> hf_renames(const models::ModelOptions& options);

// Reads the config item with parse_config; hf_config_json asks the
// model.kind's Hugging Face adapter (models::find_hf_adapter), the
// optimizer group is optim.*, the tokenizer data.tokenizer; hf_renames
// reads the config.json (hf_model_options) and asks its adapter (none for
// a config.json no adapter reads).
std::shared_ptr<const checkpoint::RunAdapter> make_run_adapter();

}  // namespace framework::config
