#include "framework/train/state_dict.h"

#include "checkpoint/format/byte_order.h"
#include "framework/config/run_items.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <cstring>
#include <mutex>

#include <stdexcept>
#include <vector>

namespace framework::train {

std::vector<uint8_t> int64_bytes(int64_t v) {
  std::vector<uint8_t> b(8);
  checkpoint::store_le(b.data(), static_cast<uint64_t>(v), 8);
  return b;
}

int64_t bytes_int64(const std::vector<uint8_t>& b, const std::string& what) {
  if (b.size() != 8) {
    throw std::runtime_error(what + ": expected 8 bytes, got " + std::to_string(b.size()));
  }
  return static_cast<int64_t>(checkpoint::load_le(b.data(), 8));
}

std::vector<uint8_t> double_bytes(double v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  std::vector<uint8_t> b(8);
  checkpoint::store_le(b.data(), bits, 8);
  return b;
}

double bytes_double(const std::vector<uint8_t>& b, const std::string& what) {
  if (b.size() != 8) {
    throw std::runtime_error(what + ": expected 8 bytes, got " + std::to_string(b.size()));
  }
  const uint64_t bits = checkpoint::load_le(b.data(), 8);
  double v = 0;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

namespace {

// The state of `gen` (a CPU or CUDA generator) as bytes, and back.
std::vector<uint8_t> generator_bytes(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  const torch::Tensor rng = gen.get_state();
  const uint8_t* p = rng.data_ptr<uint8_t>();
  return std::vector<uint8_t>(p, p + rng.numel());
}

void set_generator_bytes(at::Generator gen, const std::vector<uint8_t>& bytes) {
  torch::Tensor t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(t);
}

// The default generator of the current CUDA device (LibTorch's
// at::globalContext().defaultGenerator, the same call in every LibTorch
// this project builds with).
at::Generator cuda_generator(const torch::Device& device) {
  return at::globalContext().defaultGenerator(torch::Device(torch::kCUDA, device.index()));
}

}  // namespace

checkpoint::StateDict get_state_dict(fsdp::FullyShardedModel& model,
                                     optim::ShardedAdamW* optimizer, const StateDictNames& names) {
  checkpoint::StateDict sd;
  const std::vector<std::string> params = model.param_names();
  for (size_t i = 0; i < params.size(); ++i) {
    if (names.trainable_only && !model.param_trainable(i)) continue;
    const dtensor::DTensor p = model.param_dtensor(i);
    sd.add_tensor(names.model_prefix + params[i], p.local(), p.global_shape(), p.local_offsets());
    if (optimizer == nullptr || !model.param_trainable(i)) continue;
    const optim::AdamWParamState st = optimizer->state(i);
    const std::string base = names.optim_prefix + params[i];
    sd.add_tensor(base + ".exp_avg", st.exp_avg.local(), st.exp_avg.global_shape(),
                  st.exp_avg.local_offsets());
    sd.add_tensor(base + ".exp_avg_sq", st.exp_avg_sq.local(), st.exp_avg_sq.global_shape(),
                  st.exp_avg_sq.local_offsets());
    sd.add_bytes(base + ".step", int64_bytes(st.step));
  }
  // Buffers are whole on every rank (the same values: broadcast in training),
  // so the checkpoint writes each once.
  for (const auto& [name, buffer] : model.buffers()) {
    if (buffer.defined()) sd.add_tensor(names.model_prefix + name, buffer);
  }
  return sd;
}

void set_optimizer_state(checkpoint::StateDict& sd, fsdp::FullyShardedModel& model,
                         optim::ShardedAdamW& optimizer, const StateDictNames& names) {
  const std::vector<std::string> params = model.param_names();
  for (size_t i = 0; i < params.size(); ++i) {
    if (!model.param_trainable(i)) continue;  // frozen: no optimizer state
    const std::string base = names.optim_prefix + params[i];
    const checkpoint::BytesEntry* step = sd.find_bytes(base + ".step");
    if (step == nullptr) throw std::runtime_error("state dict: no item " + base + ".step");
    const int64_t count = bytes_int64(step->data, "state dict: " + base + ".step");
    if (count <= 0) continue;  // never updated: nothing to hand over
    const checkpoint::TensorEntry* m = sd.find_tensor(base + ".exp_avg");
    const checkpoint::TensorEntry* v = sd.find_tensor(base + ".exp_avg_sq");
    if (m == nullptr || v == nullptr) {
      throw std::runtime_error("state dict: no item " + base +
                               (m == nullptr ? ".exp_avg" : ".exp_avg_sq"));
    }
    optimizer.set_state(i, count, m->local, v->local);
  }
}

checkpoint::StateDict get_run_state_dict(fsdp::FullyShardedModel& model, optim::ShardedAdamW& optimizer,
                                         const data::DataLoader& loader, int64_t step,
                                         const config::Config& config, const std::string& lora_base) {
  StateDictNames names;
  names.trainable_only = config.model.lora.rank > 0;
  checkpoint::StateDict sd = get_state_dict(model, &optimizer, names);
  if (names.trainable_only) sd.add_bytes(config::kLoraBaseItem, std::vector<uint8_t>(lora_base.begin(), lora_base.end()));
  sd.add_bytes(config::kStepItem, int64_bytes(step));
  sd.add_bytes(config::kLoaderItem, data::encode_loader_state(loader.state()));
  sd.add_bytes(config::kRngItem, generator_bytes(at::detail::getDefaultCPUGenerator()));
  const std::string yaml = config::to_yaml(config);
  sd.add_bytes(config::kConfigItem, std::vector<uint8_t>(yaml.begin(), yaml.end()));
  return sd;
}

checkpoint::StateDict get_run_state_dict(fsdp::FullyShardedModel& model, optim::ShardedAdamW& optimizer,
                                         const data::DataLoader& loader, int64_t step,
                                         const config::Config& config, const RunRecords& records) {
  checkpoint::StateDict sd = get_run_state_dict(model, optimizer, loader, step, config, records.lora_base);
  if (records.data != nullptr) {
    const data::LoaderState at = loader.state();
    NextBatchRecord next;
    next.batch_hash = global_batch_hash(loader.dataset(), at.global_batch_size, at.seed, at.next_step);
    next.data = *records.data;
    sd.add_bytes(config::kNextBatchItem, encode_next_batch(next));
  }
  sd.add_bytes(config::kLastLossItem, double_bytes(records.last_loss));
  // (A bytes item cannot be empty: a CPU run has none.)
  if (records.device.is_cuda()) sd.add_bytes(config::kRngCudaItem, generator_bytes(cuda_generator(records.device)));
  return sd;
}

int64_t set_run_state(checkpoint::StateDict& sd, fsdp::FullyShardedModel& model,
                      optim::ShardedAdamW& optimizer, data::DataLoader& loader, bool allow_config_change,
                      const torch::Device& device) {
  set_optimizer_state(sd, model, optimizer);
  const int64_t step = bytes_int64(sd.find_bytes(config::kStepItem)->data, config::kStepItem);
  const std::vector<uint8_t>& saved_position = sd.find_bytes(config::kLoaderItem)->data;
  if (saved_position.empty()) {
    // An imported checkpoint (ckpt import-dcp): the data continue at its
    // step, and the RNG keeps this run's state.
    data::LoaderState position = loader.state();
    position.next_step = step;
    loader.load_state(position);
    return step;
  }
  data::LoaderState loader_state = data::decode_loader_state(saved_position);
  if (allow_config_change) {
    // The user resumed across a run.seed or batch change: keep the position.
    const data::LoaderState now = loader.state();
    loader_state.seed = now.seed;
    loader_state.global_batch_size = now.global_batch_size;
  }
  loader.load_state(loader_state);
  set_generator_bytes(at::detail::getDefaultCPUGenerator(), sd.find_bytes(config::kRngItem)->data);
  // rng.cuda: saved by a run on a GPU (absent from a CPU run's checkpoints
  // and from those saved before it was recorded); restored when this run is
  // on a GPU too.
  const checkpoint::BytesEntry* cuda = sd.find_bytes(config::kRngCudaItem);
  if (cuda != nullptr && !cuda->data.empty() && device.is_cuda()) set_generator_bytes(cuda_generator(device), cuda->data);
  return step;
}

}  // namespace framework::train
