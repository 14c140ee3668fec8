#pragma once
// DCP's get_state_dict / set_state_dict for this framework: a
// FullyShardedModel's and its ShardedAdamW's sharded state as named
// checkpoint::StateDict items, under the module's own parameter names, so
// that save_state_dict / load_state_dict / CheckpointManager persist and
// reshard them. The trainer builds its checkpoints with these.
//
// Items (this rank's shards, global shapes and offsets from the layout):
//   <model_prefix><name>                 parameter (e.g. "model.blocks.0.attn.qkv.weight")
//   <model_prefix><buffer name>          buffer, whole (e.g. "model.bn.running_mean")
// and for each trainable (requires_grad) parameter:
//   <optim_prefix><name>.exp_avg         AdamW first moment, sharded like the parameter
//   <optim_prefix><name>.exp_avg_sq      second moment
//   <optim_prefix><name>.step            update count (8-byte little-endian bytes item)
//
// Call sequence for a load: sd = get_state_dict(model, &optim); load into sd
// (the model's shards are written in place: the items share their storage);
// then set_optimizer_state(sd, model, optim).
//
// Thread safety: none; the model and optimizer must not step meanwhile.
#include "checkpoint/state_dict.h"
#include "framework/config/config.h"
#include "framework/data/loader.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/sharded_adamw.h"
#include "framework/train/resume_audit.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace framework::train {

struct StateDictNames {
  std::string model_prefix = "model.";
  std::string optim_prefix = "optim.";
  // Leave out the frozen (requires_grad false) parameters: a LoRA run's
  // checkpoints hold the adapters, not the base.
  bool trainable_only = false;
};

// The model's items, and the optimizer's when `optimizer` is not null. The
// tensors are the live shards (no copies).
checkpoint::StateDict get_state_dict(fsdp::FullyShardedModel& model,
                                     optim::ShardedAdamW* optimizer,
                                     const StateDictNames& names = {});

// Hands the optimizer items of `sd` (after a load) to `optimizer`: moments
// and step counts of every parameter whose step is above 0. Throws
// std::runtime_error naming the item when one is missing or malformed.
void set_optimizer_state(checkpoint::StateDict& sd, fsdp::FullyShardedModel& model,
                         optim::ShardedAdamW& optimizer, const StateDictNames& names = {});

// Everything a resumed run needs, as named items: get_state_dict(model,
// &optimizer), and the trainer's own items (framework/config/run_items.h):
// the step, the loader's position, LibTorch's CPU generator state and the
// effective config (to_yaml). The LR schedule is a pure function of the
// step, so it needs no item. A LoRA run (model.lora.rank > 0) saves only
// the trainable parameters and `lora_base` as the lora.base item
// (config::encode_lora_base): which base the adapters go on.
checkpoint::StateDict get_run_state_dict(fsdp::FullyShardedModel& model, optim::ShardedAdamW& optimizer,
                                         const data::DataLoader& loader, int64_t step,
                                         const config::Config& config, const std::string& lora_base = {});

// What the trainer records beside the state for a resume to check itself
// (resume_audit.h).
struct RunRecords {
  std::string lora_base;  // as above
  // The loss of the step saved (train.last_loss); NaN when none was taken
  // in this process yet.
  double last_loss = std::numeric_limits<double>::quiet_NaN();
  // The data's identity (data_identity_of, computed once per run); with it,
  // the data.next_batch item: the hash of the global batch the loader
  // yields next. Null: no data.next_batch item.
  const DataIdentity* data = nullptr;
  // A CUDA device: its generator's state as the rng.cuda item (none on
  // the CPU).
  torch::Device device{torch::kCPU};
};

// get_run_state_dict's items plus data.next_batch, train.last_loss and
// rng.cuda (framework/config/run_items.h).
checkpoint::StateDict get_run_state_dict(fsdp::FullyShardedModel& model, optim::ShardedAdamW& optimizer,
                                         const data::DataLoader& loader, int64_t step,
                                         const config::Config& config, const RunRecords& records);

// After a load into get_run_state_dict's items: hands the optimizer its
// state, the loader its position and the CPU generator its state (and the
// CUDA generator of `device` its, when that is a GPU and the item holds
// one), and returns the step. A checkpoint imported from PyTorch DCP (an empty
// loader item) continues the data at its step and keeps the generator.
// `allow_config_change` (checkpoint.allow_config_change): the loader keeps
// its own seed and batch size.
int64_t set_run_state(checkpoint::StateDict& sd, fsdp::FullyShardedModel& model,
                      optim::ShardedAdamW& optimizer, data::DataLoader& loader, bool allow_config_change,
                      const torch::Device& device = torch::kCPU);

// An int64 as the 8-byte little-endian bytes item the state dict uses
// (optimizer steps, train.step), and back: throws std::runtime_error naming
// `what` when the item is not 8 bytes.
std::vector<uint8_t> int64_bytes(int64_t v);
int64_t bytes_int64(const std::vector<uint8_t>& bytes, const std::string& what);
// A double as 8 little-endian bytes (its IEEE-754 bits), and back.
std::vector<uint8_t> double_bytes(double v);
double bytes_double(const std::vector<uint8_t>& bytes, const std::string& what);

}  // namespace framework::train
