#include "framework/config/run_items.h"

#include "checkpoint/errors.h"
#include "checkpoint/interop/hf.h"
#include "framework/config/config.h"
#include "models/hf_adapter.h"
#include "models/lora_names.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <optional>
#include <string>

namespace framework::config {

namespace {

// The run's Config from the checkpoint's config item; nullopt without one.
std::optional<Config> saved_config(const checkpoint::RunAdapter::ReadBytesItem& read,
                                   const std::string& where) {
  const std::optional<std::string> yaml = read(kConfigItem);
  if (!yaml) return std::nullopt;
  try {
    return parse_config(*yaml, where + " (its saved config)");
  } catch (const ConfigError& e) {
    throw checkpoint::FormatError(where + ": the saved config cannot be read: " + e.what());
  }
}

class TrainerRunAdapter : public checkpoint::RunAdapter {
 public:
  std::optional<std::string> hf_config_json(const ReadBytesItem& read, const std::string& where,
                                            const std::string& torch_dtype) const override {
    const std::optional<Config> cfg = saved_config(read, where);
    if (!cfg) return std::nullopt;
    const models::HfAdapter* hf = models::find_hf_adapter(cfg->model.kind);
    if (hf == nullptr || !hf->config_json) {
      throw checkpoint::FormatError(where + ": model.kind is " + cfg->model.kind +
                                    ", which has no Hugging Face counterpart (llama has)");
    }
    try {
      return hf->config_json(cfg->model, torch_dtype);
    } catch (const std::invalid_argument& e) {
      throw checkpoint::FormatError(where + ": the run's model has no Hugging Face counterpart: " + e.what());
    }
  }

  std::vector<checkpoint::RenamedTensor> hf_renames(const std::string& config_json,
                                                    const std::string& where) const override {
    // Not one of ours (a checkpoint of ckpt import-hf, whose recorded
    // config.json no adapter reads): it kept the directory's names.
    try {
      return framework::config::hf_renames(hf_model_options(config_json, where));
    } catch (const ConfigError&) {
      return {};
    }
  }

  checkpoint::DcpParamGroup optimizer_param_group(const ReadBytesItem& read, const std::string& where,
                                                  const checkpoint::DcpParamGroup& fallback) const override {
    const std::optional<Config> cfg = saved_config(read, where);
    if (!cfg) return fallback;
    checkpoint::DcpParamGroup g;
    g.lr = cfg->optim.lr;
    g.beta1 = cfg->optim.beta1;
    g.beta2 = cfg->optim.beta2;
    g.eps = cfg->optim.eps;
    g.weight_decay = cfg->optim.weight_decay;
    return g;
  }

  std::string tokenizer(const ReadBytesItem& read, const std::string& where) const override {
    const std::optional<Config> cfg = saved_config(read, where);
    if (!cfg || cfg->data.tokenizer == "bytes") return "";
    return cfg->data.tokenizer;
  }

  std::optional<checkpoint::LoraTensor> lora_tensor(const std::string& parameter) const override {
    const std::optional<models::LoraParameter> p = models::lora_parameter(parameter);
    if (!p) return std::nullopt;
    return checkpoint::LoraTensor{p->target, p->is_a};
  }

  std::optional<checkpoint::LoraInfo> lora(const ReadBytesItem& read, const std::string& where) const override {
    const std::optional<Config> cfg = saved_config(read, where);
    if (!cfg || cfg->model.lora.rank <= 0) return std::nullopt;
    checkpoint::LoraInfo info;
    info.rank = cfg->model.lora.rank;
    info.alpha = cfg->model.lora.alpha;
    info.dropout = cfg->model.lora.dropout;
    try {
      info.targets = models::lora_targets(cfg->model.lora);
    } catch (const std::invalid_argument& e) {
      throw checkpoint::FormatError(where + ": " + e.what());
    }
    if (const std::optional<std::string> base = read(kLoraBaseItem)) {
      const LoraBase b = decode_lora_base(*base, where);
      info.base_path = b.path;
      info.base_hash = b.hash;
    }
    return info;
  }
};

}  // namespace

std::vector<checkpoint::RenamedTensor> hf_renames(const models::ModelOptions& options) {
  const models::HfAdapter* hf = models::find_hf_adapter(options.kind);
  if (hf == nullptr || !hf->renamed) return {};
  std::vector<checkpoint::RenamedTensor> out;
  for (const models::HfTensorNames& t : hf->renamed(options)) out.push_back({t.name, t.hf, t.split});
  return out;
}

std::string encode_lora_base(const LoraBase& base) {
  return nlohmann::ordered_json{{"path", base.path}, {"hash", base.hash}}.dump();
}

LoraBase decode_lora_base(const std::string& bytes, const std::string& where) {
  try {
    const nlohmann::json j = nlohmann::json::parse(bytes);
    return {j.at("path").get<std::string>(), j.at("hash").get<std::string>()};
  } catch (const nlohmann::json::exception& e) {
    throw checkpoint::FormatError(where + ": item " + kLoraBaseItem + " is not a LoRA base record: " + e.what());
  }
}

LoraBase lora_base_of(const std::string& init_from) {
  if (init_from.empty()) return {};
  const std::string path = std::filesystem::absolute(init_from).lexically_normal().string();
  return {path, checkpoint::weights_content_hash(path)};
}

std::shared_ptr<const checkpoint::RunAdapter> make_run_adapter() {
  return std::make_shared<TrainerRunAdapter>();
}

}  // namespace framework::config
