#pragma once
// The run configuration: one YAML file plus `--set key.path=value` overrides,
// parsed into the option structs each component owns. Torch-free.
//
// Keys are the dotted paths of the option fields (run.dir, train.steps,
// checkpoint.compression.level, ...). Every key is described once, in the
// schema table in schema.cpp, which drives parsing, validation, overrides,
// to_yaml and reference_markdown.
//
// Example:
//   Config cfg = load_config("configs/default.yaml", {"train.steps=50"});
//   write_effective_config(cfg, cfg.run.dir);
//
// Thread safety: all functions are pure or touch only their own files; they
// may be called from any thread.
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/options.h"
#include "framework/data/options.h"
#include "comm/options.h"
#include "framework/fsdp/options.h"
#include "framework/optim/options.h"
#include "framework/parallel/layout.h"
#include "framework/config/train_options.h"
#include "models/options.h"

namespace framework::config {

struct Config {
  framework::train::RunOptions run;
  framework::train::TrainOptions train;
  framework::train::ProfileOptions profile;
  framework::train::MetricsOptions metrics;
  models::ModelOptions model;
  framework::data::DataOptions data;
  framework::optim::OptimOptions optim;
  framework::parallel::ParallelConfig parallel;
  comm::DistOptions dist;
  checkpoint::CheckpointOptions checkpoint;
};

// checkpoint.local.dir with every "{run.dir}" replaced by run.dir (its
// "{node}" left for checkpoint::local_tier_dir); "" without a local tier.
std::string local_tier_pattern(const Config& cfg);

// Compares every key of the schema (all option fields); doubles exactly.
bool operator==(const Config& a, const Config& b);
bool operator!=(const Config& a, const Config& b);

// A user error in the configuration: unknown key, wrong type, value out of
// range, inconsistent keys, unreadable or malformed file. what() is one
// user-facing line that names the key path and, for file errors, the
// source:line (1-based). Callers print it and exit with status 2.
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Reads and parses the YAML file at `path`, then applies each override
// ("key.path=value", value parsed as a YAML scalar) in order, then runs the
// cross-key checks. Keys not given keep the option structs' defaults; an
// empty file gives all defaults.
// Throws ConfigError (missing file: path and strerror; syntax error: file:line).
Config load_config(const std::string& path,
                   const std::vector<std::string>& overrides = {});

// Same as load_config on text already in memory; `source_name` stands for the
// file in messages.
Config parse_config(const std::string& yaml_text,
                    const std::string& source_name,
                    const std::vector<std::string>& overrides = {});

// The model a Hugging Face config.json (text) describes, as model.init_from
// of its directory reads it: model.kind and the keys the adapter of its
// model_type sets (models/hf_adapter.h), the rest at their defaults.
// Throws ConfigError naming `where` for a config.json no adapter reads.
models::ModelOptions hf_model_options(const std::string& config_json, const std::string& where);

// The full effective configuration, every key, nested by section.
// parse_config(to_yaml(cfg), ...) == cfg for any cfg that passes validation.
std::string to_yaml(const Config& cfg);

// Writes to_yaml(cfg) to <run_dir>/config.yaml, creating run_dir. Atomic:
// written to a temporary file in run_dir, fsynced, then renamed over.
// Call from one process only (rank 0).
// Throws std::runtime_error (not ConfigError) naming the path and strerror.
void write_effective_config(const Config& cfg, const std::string& run_dir);

// A key whose value differs between two configs, values as YAML text.
struct KeyChange {
  std::string key;
  std::string was;
  std::string now;
};

// The keys, in schema order, whose values differ between `was` and `now`,
// among those equal to or starting with one of `prefixes` ("model.",
// "run.seed").
std::vector<KeyChange> changed_keys(const Config& was, const Config& now,
                                    const std::vector<std::string>& prefixes);

// A markdown table "key | type | default | meaning" with one row per key, in
// schema order; defaults are those of the option structs.
std::string reference_markdown();

}  // namespace framework::config
