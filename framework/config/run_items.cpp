#include "framework/config/run_items.h"

#include "checkpoint/errors.h"
#include "framework/config/config.h"
#include "models/hf_adapter.h"

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
    return hf->config_json(cfg->model, torch_dtype);
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
};

}  // namespace

std::shared_ptr<const checkpoint::RunAdapter> make_run_adapter() {
  return std::make_shared<TrainerRunAdapter>();
}

}  // namespace framework::config
