// Reading a config: YAML file -> Config, then --set overrides, then the
// cross-key checks. Writing it back lives in emit.cpp.
#include "framework/config/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>

#include "framework/config/schema.h"
#include "framework/cp/sequence_split.h"
#include "framework/pp/schedule.h"
#include "models/hf_adapter.h"

namespace framework::config {
namespace {

// Where each key got its value: "configs/x.yaml:12" or "--set"; absent keys
// kept their default. Used to point cross-key errors at the right lines.
using Origins = std::map<std::string, std::string>;

[[noreturn]] void fail(const std::string& message) { throw ConfigError(message); }

std::string suggestion_for(const std::string& path) {
  std::string close = closest_path(path);
  return close.empty() ? "" : " \xE2\x80\x94 did you mean " + close + "?";
}

std::string describe_node(const YAML::Node& node) {
  if (node.IsMap()) return "a map";
  if (node.IsSequence()) return "a list";
  if (node.IsNull()) return "an empty value";
  return "\"" + node.Scalar() + "\"";
}

// Walks the YAML tree, assigning every leaf it finds through the schema.
class FileParser {
 public:
  FileParser(std::string source, Config* cfg, Origins* origins)
      : source_(std::move(source)), cfg_(cfg), origins_(origins) {}

  void parse_document(const YAML::Node& root) {
    if (root.IsNull()) return;  // empty file: all defaults
    if (!root.IsMap())
      fail(source_ + ":" + std::to_string(root.Mark().line + 1) +
           ": the top level must be a map of sections (run, train, model, ...), got " +
           describe_node(root));
    parse_map(root, "");
  }

 private:
  std::string at(int line) const { return source_ + ":" + std::to_string(line + 1); }

  void parse_map(const YAML::Node& map, const std::string& prefix) {
    std::map<std::string, int> seen;  // key name -> line, within this map
    for (const auto& entry : map) {
      // Copies: Node is a handle, and iterator proxies are temporaries.
      const YAML::Node name_node = entry.first;
      const YAML::Node value_node = entry.second;
      int line = name_node.Mark().line;
      if (!name_node.IsScalar())
        fail((prefix.empty() ? std::string("top level") : prefix) +
             ": keys must be plain names at " + at(line));
      std::string path = prefix.empty() ? name_node.Scalar() : prefix + "." + name_node.Scalar();
      auto [first, inserted] = seen.emplace(name_node.Scalar(), line);
      if (!inserted) fail_duplicate(path, first->second, line);
      if (const Key* key = find_key(path)) {
        parse_leaf(*key, value_node, line);
      } else if (is_section(path)) {
        parse_section(path, value_node, line);
      } else {
        fail(path + ": unknown key at " + at(line) + suggestion_for(path));
      }
    }
  }

  void fail_duplicate(const std::string& path, int first_line, int line) {
    fail(path + ": duplicate key at " + at(line) + " (first at line " +
         std::to_string(first_line + 1) + ")");
  }

  void parse_section(const std::string& path, const YAML::Node& node, int line) {
    if (node.IsNull()) return;  // "checkpoint:" with every key left out
    if (!node.IsMap())
      fail(path + ": expected a section (a map of keys), got " + describe_node(node) + " at " +
           at(line));
    parse_map(node, path);
  }

  void parse_leaf(const Key& key, const YAML::Node& node, int line) {
    // Also catches "checkpoint.interval: 5" next to "checkpoint: {interval: 6}".
    auto [first, inserted] = leaf_lines_.emplace(key.path, line);
    if (!inserted) fail_duplicate(key.path, first->second, line);
    std::string text = node.IsScalar() ? node.Scalar() : "";
    if (node.IsSequence() && key.constraint.list) {
      // A list of names: kept as the comma-separated string.
      text.clear();
      for (const YAML::Node& item : node) {
        if (!item.IsScalar() || item.Scalar().empty() || item.Scalar().find(',') != std::string::npos)
          fail(std::string(key.path) + ": expected " + describe_expected(key) + ", got a list item " +
               describe_node(item) + " at " + at(item.Mark().line));
        text += (text.empty() ? "" : ",") + item.Scalar();
      }
    } else if (!node.IsScalar() && !node.IsNull()) {
      fail(std::string(key.path) + ": expected " + describe_expected(key) + ", got " +
           describe_node(node) + " at " + at(line));
    }
    Value value;
    auto problem = parse_value(key, text, node.IsNull(), &value);
    if (problem) fail(std::string(key.path) + ": " + *problem + " at " + at(line));
    key.set(*cfg_, value);
    (*origins_)[key.path] = at(line);
  }

  std::string source_;
  Config* cfg_;
  Origins* origins_;
  std::map<std::string, int> leaf_lines_;
};

void parse_text(const std::string& yaml_text, const std::string& source, Config* cfg,
                Origins* origins) {
  std::vector<YAML::Node> docs;
  try {
    docs = YAML::LoadAll(yaml_text);
  } catch (const YAML::Exception& e) {
    // yaml-cpp marks an error found at the end of the input (an unclosed
    // bracket or quote) on the line after the last one; report the last.
    const int lines = static_cast<int>(std::count(yaml_text.begin(), yaml_text.end(), '\n')) +
                      (!yaml_text.empty() && yaml_text.back() != '\n' ? 1 : 0);
    std::string where =
        e.mark.is_null() ? source
                         : source + ":" + std::to_string(std::max(1, std::min(e.mark.line + 1, lines)));
    fail(where + ": YAML syntax error: " + e.msg);
  }
  if (docs.size() > 1)
    fail(source + ": expected one YAML document, found " + std::to_string(docs.size()));
  if (!docs.empty()) FileParser(source, cfg, origins).parse_document(docs[0]);
}

std::string first_key_under(const std::string& section) {
  for (const Key& key : schema())
    if (std::string(key.path).rfind(section + ".", 0) == 0) return key.path;
  return "";
}

void apply_override(const std::string& text, Config* cfg, Origins* origins) {
  std::string prefix = "--set " + text + ": ";
  size_t eq = text.find('=');
  if (eq == std::string::npos) fail(prefix + "expected key.path=value");
  std::string path = text.substr(0, eq);
  std::string raw = text.substr(eq + 1);
  const Key* key = find_key(path);
  if (key == nullptr && is_section(path))
    fail(prefix + path + " is a section, not a key; set one of its keys, e.g. " +
         first_key_under(path));
  if (key == nullptr) fail(prefix + "unknown key" + suggestion_for(path));
  YAML::Node node;
  try {
    node = YAML::Load(raw);
  } catch (const YAML::Exception&) {
    fail(prefix + "expected " + describe_expected(*key) + ", got \"" + raw +
         "\" (not a YAML scalar; quote it)");
  }
  std::string value_text = node.IsScalar() ? node.Scalar() : "";
  if (node.IsSequence() && key->constraint.list) {
    value_text.clear();
    for (const YAML::Node& item : node) {
      if (!item.IsScalar() || item.Scalar().empty() || item.Scalar().find(',') != std::string::npos)
        fail(prefix + "expected " + describe_expected(*key) + ", got a list item " + describe_node(item));
      value_text += (value_text.empty() ? "" : ",") + item.Scalar();
    }
  } else if (!node.IsScalar() && !node.IsNull()) {
    fail(prefix + "expected " + describe_expected(*key) + ", got " + describe_node(node));
  }
  Value value;
  auto problem = parse_value(*key, value_text, node.IsNull(), &value);
  if (problem) fail(prefix + *problem);
  key->set(*cfg, value);
  (*origins)[path] = "--set";
}

// "train.stop_at (500, configs/x.yaml:3)": value and where it came from.
std::string describe_key(const std::string& path, const Config& cfg, const Origins& origins) {
  auto it = origins.find(path);
  std::string origin = it == origins.end() ? "default" : it->second;
  const Key* k = find_key(path);
  return path + " (" + format_key_value(*k, k->get(cfg)) + ", " + origin + ")";
}

// Checks that involve several keys; run once, after every override.
void check_consistency(const Config& cfg, const Origins& origins) {
  auto key = [&](const char* path) { return describe_key(path, cfg, origins); };
  const auto describe = [&](const std::string& path) { return describe_key(path, cfg, origins); };
  try {
    // The layout's rules live with the layout (framework/parallel/layout.h).
    parallel::check_config(cfg.parallel, describe);
  } catch (const std::exception& e) {
    fail(e.what());
  }
  if (cfg.parallel.context > 1) {
    try {
      // The sequence's split over the context group (framework/cp).
      cp::check_sequence_split(cfg.model.seq_len, cfg.parallel.context, cfg.parallel.context_load_balance);
    } catch (const std::exception& e) {
      fail(e.what());
    }
  }
  if (cfg.profile.memory_snapshot && cfg.train.device != comm::DeviceKind::kCuda)
    fail(key("profile.memory_snapshot") + " needs " + key("train.device") +
         " to be cuda: the snapshot is the CUDA caching allocator's history");
  if (cfg.profile.every > 0 && cfg.profile.active > cfg.profile.every)
    fail(key("profile.active") + " must be at most " + key("profile.every") +
         " (each trace covers the last profile.active steps of every profile.every)");
  try {
    // The model kind's rules live with the kind (models/options.h).
    models::check_model_options(cfg.model, cfg.parallel.tensor,
                                [&](const std::string& path, const std::string&) {
                                  return describe_key(path, cfg, origins);
                                });
  } catch (const std::exception& e) {
    fail(e.what());
  }
  if (cfg.parallel.pipeline > 1 && cfg.model.tie_weights)
    fail(key("model.tie_weights") + " ties the first stage's embedding to the last stage's output: " +
         "set it false with " + key("parallel.pipeline"));
  if (cfg.train.micro_batch_size > cfg.train.global_batch_size)
    fail(key("train.micro_batch_size") + " must not exceed " + key("train.global_batch_size"));
  if (cfg.optim.min_lr > cfg.optim.lr)
    fail(key("optim.min_lr") + " must not exceed " + key("optim.lr"));
  if (cfg.data.kind == data::DataKind::kText && cfg.data.path.empty())
    fail(key("data.path") + " must name a text file when " + key("data.kind") + " is text");
  if (cfg.data.kind == data::DataKind::kTokens && cfg.data.path.empty())
    fail(key("data.path") + " must name token shards (a file, a directory or a glob) when " +
         key("data.kind") + " is tokens");
  if (cfg.data.kind == data::DataKind::kSft && cfg.data.path.empty())
    fail(key("data.path") + " must name a JSONL file of records when " + key("data.kind") + " is sft");
  if (cfg.data.kind != data::DataKind::kTokens && !cfg.data.eval_path.empty())
    fail(key("data.eval_path") + " is read only when " + key("data.kind") + " is tokens");
  if (cfg.data.kind == data::DataKind::kText && (cfg.data.tokenizer.empty() || cfg.data.tokenizer == "bytes") &&
      cfg.model.vocab_size != 256)
    fail(key("model.vocab_size") + " must be 256 when " + key("data.kind") +
         " is text without " + key("data.tokenizer") + " (the text dataset reads bytes)");
  if (cfg.train.eval_every > 0 && cfg.data.eval_fraction <= 0 && cfg.data.eval_path.empty())
    fail(key("train.eval_every") + " needs held-out data: set " + key("data.eval_fraction") +
         " above 0" + (cfg.data.kind == data::DataKind::kTokens ? " or " + key("data.eval_path") : std::string()));
  if (cfg.train.sample_every > 0 && cfg.model.vocab_size != 256 &&
      (cfg.data.tokenizer.empty() || cfg.data.tokenizer == "bytes"))
    fail(key("train.sample_every") + " prints text with " + key("data.tokenizer") +
         "; without one it is byte-level, which needs " + key("model.vocab_size") + " 256");
  if (cfg.train.sample_every > 0 && cfg.train.sample_prompt.empty())
    fail(key("train.sample_prompt") + " must not be empty when " + key("train.sample_every") + " is on");
  if (cfg.train.stop_at != 0 && cfg.train.stop_at > cfg.train.steps)
    fail(key("train.stop_at") + " must not exceed " + key("train.steps") + " (0 means never)");
}

std::string read_file(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) fail(path + ": cannot open config file: " + std::strerror(errno));
  std::string text;
  char buf[65536];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), file)) > 0) text.append(buf, n);
  int read_errno = std::ferror(file) ? errno : 0;
  std::fclose(file);
  if (read_errno != 0) fail(path + ": cannot read config file: " + std::strerror(read_errno));
  return text;
}

// The model keys of a Hugging Face config.json (`text`; `where` names it in
// messages: "model.init_from: DIR/config.json"), read by the adapter of its
// model_type (models/hf_adapter.h). A key the config did not set takes
// config.json's value; one set to another value is an error naming both
// (`path`, the file).
void apply_hf_config_json(const std::string& text, const std::string& where, const std::string& path, Config* cfg,
                          Origins* origins) {
  std::vector<models::HfConfigValue> values;
  try {
    values = models::read_hf_config_json(text);
  } catch (const std::invalid_argument& e) {
    fail(where + ": " + e.what());
  }
  for (const models::HfConfigValue& v : values) {
    const Key* key = find_key(v.key);
    if (key == nullptr) fail(where + ": " + v.field + " maps to no key " + v.key);
    // Through the key's own parse, so its type and range hold.
    const std::string value_text = std::holds_alternative<std::string>(v.value)
                                       ? std::get<std::string>(v.value)
                                       : format_value(v.value);
    Value value;
    if (auto problem = parse_value(*key, value_text, false, &value)) fail(where + ": " + v.field + ": " + *problem);
    if (origins->count(v.key) != 0 && key->get(*cfg) != value) {
      fail(describe_key(v.key, *cfg, *origins) + " disagrees with " + v.field + " " +
           format_value(value) + " in " + path);
    }
    key->set(*cfg, value);
    (*origins)[v.key] = path;
  }
}

// model.init_from naming a Hugging Face model directory (config.json beside
// its safetensors): config.json gives the model section.
void apply_hf_model_config(const std::string& dir, Config* cfg, Origins* origins) {
  const std::string path = dir + (dir.empty() || dir.back() == '/' ? "" : "/") + "config.json";
  std::FILE* probe = std::fopen(path.c_str(), "rb");
  if (probe == nullptr) return;  // not a Hugging Face directory: init_from reads it as weights
  std::fclose(probe);
  apply_hf_config_json(read_file(path), "model.init_from: " + path, path, cfg, origins);
}

}  // namespace

Config parse_config(const std::string& yaml_text, const std::string& source_name,
                    const std::vector<std::string>& overrides) {
  Config cfg;
  Origins origins;
  parse_text(yaml_text, source_name, &cfg, &origins);
  for (const std::string& text : overrides) apply_override(text, &cfg, &origins);
  if (!cfg.model.init_from.empty()) apply_hf_model_config(cfg.model.init_from, &cfg, &origins);
  // The default that depends on the model kind (models/options.h).
  if (origins.count("model.tie_weights") == 0) {
    cfg.model.tie_weights = models::ties_weights_by_default(cfg.model.kind);
  }
  check_consistency(cfg, origins);
  return cfg;
}

models::ModelOptions hf_model_options(const std::string& config_json, const std::string& where) {
  Config cfg;
  Origins origins;
  apply_hf_config_json(config_json, where, where, &cfg, &origins);
  return cfg.model;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_config(read_file(path), path, overrides);
}

std::string local_tier_pattern(const Config& cfg) {
  std::string pattern = cfg.checkpoint.local.dir;
  for (size_t at; (at = pattern.find("{run.dir}")) != std::string::npos;) pattern.replace(at, 9, cfg.run.dir);
  return pattern;
}

}  // namespace framework::config
