// generate: continues a prompt with a trained model, from a shardkit
// checkpoint saved at any world size (loaded whole, in this one process) or
// from a Hugging Face Llama directory. A llama keeps a KV cache.
//
//   build/generate --checkpoint runs/x/checkpoints/step_200 --prompt "To be"
//                  [--max-new-tokens 64] [--temperature T --top-k K --top-p P --seed S]
//                  [--tokenizer bytes] [--prompt-ids 1,2,3] [--ids] [--base HF_DIR]
//
// A LoRA run's checkpoint holds its adapters: generate loads the base the
// run recorded (or --base, a copy of it: its weights must hash the same)
// and the adapters on it.
//
// Tokenizers (framework/tokenizer): a Hugging Face tokenizer.json, a
// SentencePiece .model, or bytes (byte-level, vocabulary 256). Without
// --tokenizer: the Hugging Face directory's tokenizer.json or
// tokenizer.model, else the run's data.tokenizer, else bytes. Or give
// --prompt-ids and read --ids. Exit status: 0 done, 2 bad arguments or input
// (one line naming it), 1 anything else.
#include "checkpoint/interop/hf.h"
#include "comm/exit_now.h"
#include "comm/fork_server.h"
#include "checkpoint/interop/import_weights.h"
#include "framework/config/run_items.h"
#include "checkpoint/interop/weights_file.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/load.h"
#include "checkpoint/state_dict.h"
#include "framework/config/config.h"
#include "framework/tokenizer/tokenizer.h"
#include "models/generate.h"
#include "models/layered_model.h"
#include "models/llama.h"
#include "tools/command_line.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <stdexcept>

namespace {

struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The model of a checkpoint (its config item, or the config.json ckpt import-hf
// recorded) or of a Hugging Face directory, with its weights.
// A LoRA run's checkpoint holds the adapters: their base is `base_arg`,
// else the directory the run recorded, and must hash as the run recorded.
std::string lora_base_dir(const std::string& path, const std::string& base_arg) {
  checkpoint::StateDict head;
  head.add_bytes(framework::config::kLoraBaseItem, {});
  checkpoint::LoadOptions only_base;
  only_base.allow_partial = true;
  only_base.filter = [](const std::string& n) { return n == framework::config::kLoraBaseItem; };
  checkpoint::load_state_dict(head, path, only_base);
  const std::vector<uint8_t>& bytes = head.bytes().front().data;
  if (bytes.empty()) throw UsageError("--checkpoint: " + path + " holds LoRA adapters but no record of their base");
  const framework::config::LoraBase saved =
      framework::config::decode_lora_base(std::string(bytes.begin(), bytes.end()), path);
  if (saved.path.empty()) {
    throw UsageError("--checkpoint: " + path + " holds LoRA adapters on a base initialised at random "
                     "(no model.init_from): there is no base to load");
  }
  const std::string base = base_arg.empty() ? saved.path : base_arg;
  if (!is_dir(base) && ::access(base.c_str(), R_OK) != 0) {
    throw UsageError("--checkpoint: the LoRA base " + base + " of " + path + " is not there" +
                     (base_arg.empty() ? "; give --base DIR, a copy of it" : ""));
  }
  const std::string hash = checkpoint::weights_content_hash(base);
  if (hash != saved.hash) {
    throw UsageError((base_arg.empty() ? "the LoRA base " : "--base ") + base + " has weights " + hash +
                     ", not those of the base " + saved.path + " (" + saved.hash + ") that " + path +
                     " was trained on");
  }
  return base;
}

// The weights at `path` under our names (a Hugging Face mixture of
// experts' experts stack into ours).
checkpoint::WeightsFile hf_weights(const std::string& path, const models::ModelOptions& model) {
  return checkpoint::WeightsFile::open(path).renamed(framework::config::hf_renames(model));
}

std::pair<framework::config::Config, std::shared_ptr<models::LayeredModelImpl>> load_model(
    const std::string& path, const std::string& base_arg) {
  if (!is_dir(path)) throw UsageError("--checkpoint: " + path + " is not a directory");
  framework::config::Config cfg;
  const bool hf = checkpoint::is_hf_model_dir(*checkpoint::posix_storage(), path);
  if (hf) {
    cfg = framework::config::parse_config("model:\n  kind: llama\n", path, {"model.init_from=" + path});
  } else if (const auto meta = checkpoint::read_committed_metadata(*checkpoint::posix_storage(), path);
             meta.find(framework::config::kConfigItem) == nullptr) {
    // A checkpoint made by ckpt import-hf: the config.json it recorded.
    const auto it = meta.info.find("hf_config");
    if (it == meta.info.end()) {
      throw UsageError("--checkpoint: " + path + " holds no config item (saved by train) and no recorded "
                       "config.json (ckpt import-hf)");
    }
    char dir[] = "/tmp/generate_hf_config_XXXXXX";
    if (::mkdtemp(dir) == nullptr) throw std::runtime_error("cannot create a temporary directory");
    const std::string json = std::string(dir) + "/config.json";
    std::ofstream(json) << it->second;
    try {
      cfg = framework::config::parse_config("model:\n  kind: llama\n", path, {std::string("model.init_from=") + dir});
    } catch (...) {
      ::unlink(json.c_str());
      ::rmdir(dir);
      throw;
    }
    ::unlink(json.c_str());
    ::rmdir(dir);
    cfg.model.init_from.clear();
  } else {
    checkpoint::StateDict head;
    head.add_bytes(framework::config::kConfigItem, {});
    checkpoint::LoadOptions only_config;
    only_config.filter = [](const std::string& n) { return n == framework::config::kConfigItem; };
    checkpoint::load_state_dict(head, path, only_config);
    const std::vector<uint8_t>& yaml = head.bytes().front().data;
    if (yaml.empty()) throw UsageError("--checkpoint: " + path + " holds no config item (saved by train)");
    // The run's model; init_from was its start, not ours to read again.
    cfg = framework::config::parse_config(std::string(yaml.begin(), yaml.end()), path + "/config",
                                          {"model.init_from="});
  }
  const bool lora = !hf && cfg.model.lora.rank > 0;
  if (!base_arg.empty() && !lora) throw UsageError("--base: " + path + " holds no LoRA adapters");
  std::shared_ptr<models::LayeredModelImpl> model;
  {
    torch::manual_seed(0);  // overwritten by the weights
    model = models::make_model(cfg.model, true);
  }
  checkpoint::StateDict sd, base_sd;
  for (const auto& p : model->named_parameters()) {
    // LoRA: the base's weights from its directory, the adapters from the checkpoint.
    (lora && !models::is_lora_parameter(p.key()) ? base_sd : sd).add_tensor("model." + p.key(), p.value().detach());
  }
  torch::NoGradGuard no_grad;
  if (lora) {
    const std::string base = lora_base_dir(path, base_arg);
    checkpoint::load_weights_into(base_sd, hf_weights(base, cfg.model), "model.", false);
    std::cerr << "generate: LoRA adapters of " << path << " on the base " << base << std::endl;
  }
  if (hf) {
    checkpoint::load_weights_into(sd, hf_weights(path, cfg.model), "model.", false);
  } else {
    checkpoint::LoadOptions model_only;
    model_only.filter = [](const std::string& n) { return n.rfind("model.", 0) == 0; };
    checkpoint::load_state_dict(sd, path, model_only);
  }
  model->eval();
  return {cfg, model};
}

// Without --tokenizer: a Hugging Face directory's own, else the run's
// data.tokenizer (when the file is still there), else bytes.
std::string default_tokenizer(const std::string& checkpoint, const framework::config::Config& cfg) {
  for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
    const std::string p = checkpoint + "/" + name;
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode)) return p;
  }
  struct stat st {};
  const std::string& t = cfg.data.tokenizer;
  if (!t.empty() && t != "bytes" && ::stat(t.c_str(), &st) == 0 && S_ISREG(st.st_mode)) return t;
  return "bytes";
}

std::vector<int64_t> parse_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      size_t used = 0;
      ids.push_back(std::stoll(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw UsageError("--prompt-ids: '" + item + "' is not an integer (expected ids like 1,2,3)");
    }
  }
  return ids;
}

struct Args {
  std::string checkpoint_path, tokenizer, prompt, prompt_ids, base;
  int64_t max_new = 64;
  models::SamplingOptions sampling;
  bool print_ids = false;
};

void add_options(CLI::App& app, Args& a) {
  app.add_option("--checkpoint", a.checkpoint_path, "a checkpoint (step_<N>/) or a Hugging Face model directory")
      ->required();
  app.add_option("--base", a.base,
                 "a LoRA run's checkpoint: its base's Hugging Face directory (default: the one the run recorded; "
                 "its weights must hash the same)");
  app.add_option("--tokenizer", a.tokenizer,
                 "a Hugging Face tokenizer.json, a SentencePiece .model, or bytes (default: the Hugging Face "
                 "directory's, else the run's data.tokenizer, else bytes)");
  app.add_option("--prompt", a.prompt, "the text to continue");
  app.add_option("--prompt-ids", a.prompt_ids, "the prompt as token ids, comma-separated (instead of --prompt)");
  app.add_option("--max-new-tokens", a.max_new, "tokens to generate")->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  app.add_option("--temperature", a.sampling.temperature, "0: greedy (default); above 0: sample")
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--top-k", a.sampling.top_k, "sample among the k most likely tokens (0: all)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app.add_option("--top-p", a.sampling.top_p, "sample within the smallest set of probability p (1: all)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", a.sampling.seed, "seed of the sampling generator");
  app.add_flag("--ids", a.print_ids, "also print {\"prompt_ids\": [...], \"ids\": [...]} as the last line");
}

std::unique_ptr<framework::tokenizer::Tokenizer> open_tokenizer(const std::string& spec) {
  try {
    return framework::tokenizer::load_tokenizer(spec);
  } catch (const framework::tokenizer::TokenizerError& e) {
    throw UsageError(std::string("--tokenizer ") + e.what());
  }
}

// The prompt's ids (--prompt-ids, or --prompt encoded), each checked to be
// below the model's vocabulary size.
std::vector<int64_t> prompt_ids_of(const Args& a, const framework::tokenizer::Tokenizer& tok, int64_t vocab) {
  std::vector<int64_t> ids;
  if (!a.prompt_ids.empty()) {
    ids = parse_ids(a.prompt_ids);
  } else {
    if (a.tokenizer == "bytes" && vocab != 256) {
      throw UsageError("--prompt: the model's vocabulary has " + std::to_string(vocab) +
                       " tokens; the byte-level tokenizer needs 256 (give --tokenizer or --prompt-ids)");
    }
    if (tok.vocab_size() > vocab) {
      throw UsageError("--tokenizer " + tok.describe() + " has more tokens than the model's vocabulary (" +
                       std::to_string(vocab) + ")");
    }
    ids = tok.encode(a.prompt);
  }
  for (int64_t id : ids) {
    if (id < 0 || id >= vocab) {
      throw UsageError("--prompt-ids: id " + std::to_string(id) + " is outside [0, model.vocab_size " +
                       std::to_string(vocab) + ")");
    }
  }
  return ids;
}

// The continuation decoded once: the whole decoded minus the decoded prompt
// (pieces may join).
std::string continuation_text(const framework::tokenizer::Tokenizer& tok, const std::vector<int64_t>& ids,
                              const std::vector<int64_t>& out) {
  std::vector<int64_t> all = ids;
  all.insert(all.end(), out.begin(), out.end());
  const std::string whole = tok.decode(all), head = tok.decode(ids);
  return whole.compare(0, head.size(), head) == 0 ? whole.substr(head.size()) : " " + tok.decode(out);
}

// The failure's line on stderr and the exit status: 2 for bad arguments or
// input (and configs), 1 for anything else.
int report_failure(const std::exception& e) {
  const bool usage = dynamic_cast<const UsageError*>(&e) != nullptr ||
                     dynamic_cast<const framework::config::ConfigError*>(&e) != nullptr;
  const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
  std::cerr << "generate: " << (torch_error != nullptr ? torch_error->what_without_backtrace() : e.what())
            << std::endl;
  return usage ? 2 : 1;
}

int generate_main(int argc, char** argv) {
  CLI::App app{"generate: continue a prompt with a trained model (a checkpoint of any world size, or a "
               "Hugging Face Llama directory)"};
  Args a;
  add_options(app, a);
  if (const std::optional<int> status = tools::parse_command_line(app, argc, argv)) return *status;
  try {
    if (a.prompt.empty() == a.prompt_ids.empty()) throw UsageError("give one of --prompt and --prompt-ids");
    auto [cfg, model] = load_model(a.checkpoint_path, a.base);
    if (a.tokenizer.empty()) a.tokenizer = default_tokenizer(a.checkpoint_path, cfg);
    const std::unique_ptr<framework::tokenizer::Tokenizer> tok = open_tokenizer(a.tokenizer);
    const std::vector<int64_t> ids = prompt_ids_of(a, *tok, cfg.model.vocab_size);
    const bool text = a.prompt_ids.empty();
    const bool bytes = a.tokenizer == "bytes";
    if (text) std::cout << a.prompt << std::flush;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<int64_t> out = models::generate(*model, cfg.model.seq_len, ids, a.max_new, a.sampling,
                                                      [&](int64_t id) {
                                                        // bytes stream as they come; a tokenizer file decodes once, below
                                                        if (text && bytes) std::cout << static_cast<char>(id) << std::flush;
                                                      });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (text && !bytes) std::cout << continuation_text(*tok, ids, out);
    if (text) std::cout << std::endl;
    std::fprintf(stderr, "generate: %zu tokens in %.3f s (%.1f tokens/s), %s, model %s%s\n", out.size(), s,
                 s > 0 ? static_cast<double>(out.size()) / s : 0.0,
                 a.sampling.temperature > 0 ? "sampled" : "greedy", cfg.model.kind.c_str(),
                 cfg.model.kind == "llama" ? " with a KV cache" : "");
    if (a.print_ids) std::cout << nlohmann::ordered_json{{"prompt_ids", ids}, {"ids", out}}.dump() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    return report_failure(e);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Under the test suite only (SHARDKIT_TEST_SERVE; comm/fork_server.h).
  comm::serve_forks_if_asked(argc, argv);
  const int status = generate_main(argc, argv);
  // Everything is written; what is left at exit is LibTorch's static
  // destructors (comm/exit_now.h).
  comm::exit_now(status);
}
