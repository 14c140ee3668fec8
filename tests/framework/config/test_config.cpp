// framework/config: YAML -> Config, validation messages, --set overrides,
// to_yaml round trips, and the repository's configs/*.yaml.
#include "framework/config/config.h"
#include "framework/config/run_items.h"
#include "support/paths.h"

#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <ostream>
#include <set>

namespace framework::config {
namespace {

namespace fs = std::filesystem;
using namespace std::string_literals;

// Every key the option structs expose, as documented in the brief.
const std::vector<std::string> kAllKeys = {
    "run.dir", "run.seed", "run.host_malloc",
    "train.steps", "train.stop_at", "train.global_batch_size", "train.log_every",
    "train.eval_every", "train.eval_samples", "train.sample_every", "train.sample_prompt",
    "train.sample_tokens", "train.device", "train.deterministic", "train.optimizer_impl", "train.fused_kernels", "train.peak_tflops", "train.grad_clip",
    "train.micro_batch_size", "train.mixed_precision.param_dtype",
    "train.mixed_precision.reduce_dtype",
    "profile.every", "profile.active", "profile.dir", "profile.memory_snapshot", "metrics.tensorboard",
    "model.kind", "model.vocab_size", "model.seq_len", "model.d_model", "model.n_layers",
    "model.n_heads", "model.n_kv_heads", "model.head_dim", "model.d_ff", "model.tie_weights", "model.rope_theta",
    "model.norm_eps", "model.rope_scaling.factor", "model.rope_scaling.low_freq_factor",
    "model.rope_scaling.high_freq_factor", "model.rope_scaling.original_max_position",
    "model.activation_checkpointing", "model.activation_checkpointing_every",
    "model.lora.rank", "model.lora.alpha", "model.lora.dropout", "model.lora.base_dtype", "model.lora.targets",
    "model.qk_norm", "model.moe.num_experts", "model.moe.top_k", "model.moe.d_ff", "model.moe.score_func",
    "model.moe.route_norm", "model.moe.route_scale", "model.moe.num_shared_experts", "model.moe.first_dense_layers",
    "model.moe.aux_loss_coef", "model.moe.load_balance_rate", "model.init_from",
    "data.kind", "data.task", "data.path", "data.eval_fraction", "data.eval_path", "data.check_tokens",
    "data.tokenizer", "data.packed",
    "optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.weight_decay", "optim.beta1",
    "optim.beta2", "optim.eps",
    "parallel.replicate", "parallel.shard", "parallel.tensor", "parallel.expert", "parallel.context",
    "parallel.context_load_balance", "parallel.pipeline",
    "parallel.pipeline_schedule", "parallel.stages_per_rank", "parallel.pipeline_split_points",
    "parallel.reshard_after_forward", "parallel.prefetch",
    "dist.backend", "dist.timeout_s", "dist.stop_grace_s", "dist.standby", "dist.standby_delay_s", "dist.master_addr",
    "dist.master_port",
    "checkpoint.dir", "checkpoint.interval", "checkpoint.mtbf_s", "checkpoint.mode", "checkpoint.keep_last",
    "checkpoint.resume", "checkpoint.resume_fallback", "checkpoint.allow_config_change", "checkpoint.resume_audit", "checkpoint.on_error", "checkpoint.save_on_signal",
    "checkpoint.when_busy", "checkpoint.allow_partial", "checkpoint.model_only",
    "checkpoint.io_threads", "checkpoint.plan_cache", "checkpoint.direct_io", "checkpoint.device_snapshot", "checkpoint.local.dir", "checkpoint.local.keep_last",
    "checkpoint.local.partner", "checkpoint.durable.every", "checkpoint.compression.codec", "checkpoint.compression.level",
    "checkpoint.compression.byte_group", "checkpoint.compression.block_size",
};

// The message of the ConfigError that `fn` throws; fails the test if none.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ConfigError";
  return "";
}

std::string parse_error(const std::string& yaml, const std::vector<std::string>& sets = {}) {
  return error_of([&] { parse_config(yaml, "configs/x.yaml", sets); });
}

// Leaf paths of a YAML map, dotted.
void collect_leaf_paths(const YAML::Node& node, const std::string& prefix,
                        std::vector<std::string>* out) {
  for (const auto& entry : node) {
    std::string name = entry.first.Scalar();
    std::string path = prefix.empty() ? name : prefix + "." + name;
    if (entry.second.IsMap()) collect_leaf_paths(entry.second, path, out);
    else out->push_back(path);
  }
}

// The scalar at a dotted path of a YAML map.
std::string scalar_at(const YAML::Node& node, const std::string& path) {
  size_t dot = path.find('.');
  if (dot == std::string::npos) return node[path].Scalar();
  return scalar_at(node[path.substr(0, dot)], path.substr(dot + 1));
}

// A config where every key differs from its default.
Config non_default_config() {
  Config c;
  c.run.dir = "runs/odd \"quoted\" dir: #1";
  c.run.seed = 7;
  c.train.steps = 1000;
  c.train.stop_at = 500;
  c.train.global_batch_size = 64;
  c.train.log_every = 5;
  c.train.eval_every = 7;
  c.train.eval_samples = 33;
  c.train.sample_every = 7;
  c.train.sample_prompt = "Hi there";
  c.train.sample_tokens = 9;
  c.train.device = comm::DeviceKind::kCuda;
  c.train.deterministic = false;
  c.train.optimizer_impl = framework::optim::OptimizerImpl::kForeach;
  c.train.fused_kernels = false;
  c.train.peak_tflops = 312;
  c.profile.every = 7;
  c.profile.active = 3;
  c.profile.dir = "traces";
  c.profile.memory_snapshot = true;
  c.metrics.tensorboard = true;
  c.train.grad_clip = 0.25;
  c.train.micro_batch_size = 8;
  c.train.mixed_precision.param_dtype = framework::fsdp::PrecisionDtype::kBf16;
  c.train.mixed_precision.reduce_dtype = framework::fsdp::PrecisionDtype::kBf16;
  c.model.kind = "mlp";
  c.model.n_kv_heads = 3;
  c.model.head_dim = 24;
  c.model.rope_theta = 500000.0;
  c.model.norm_eps = 1e-6;
  c.model.rope_scaling.factor = 8.0;
  c.model.rope_scaling.low_freq_factor = 2.0;
  c.model.rope_scaling.high_freq_factor = 5.0;
  c.model.rope_scaling.original_max_position = 1024;
  c.model.activation_checkpointing = models::ActivationCheckpointing::kSelective;
  c.model.activation_checkpointing_every = 3;
  c.model.vocab_size = 256;
  c.model.seq_len = 128;
  c.model.d_model = 96;
  c.model.n_layers = 3;
  c.model.n_heads = 6;
  c.model.d_ff = 300;
  c.model.tie_weights = false;
  c.model.init_from = "weights/init.safetensors";
  c.model.lora.rank = 8;
  c.model.lora.alpha = 32;
  c.model.lora.dropout = 0.05;
  c.model.lora.base_dtype = "bf16";
  c.model.lora.targets = "q_proj,k_proj,v_proj,o_proj";
  c.model.qk_norm = true;
  c.model.moe.num_experts = 4;
  c.model.moe.top_k = 3;
  c.model.moe.d_ff = 64;
  c.model.moe.score_func = models::MoeScoreFunc::kSigmoid;
  c.model.moe.route_norm = true;
  c.model.moe.route_scale = 2.5;
  c.model.moe.num_shared_experts = 1;
  c.model.moe.first_dense_layers = 1;
  c.model.moe.aux_loss_coef = 0.01;
  c.model.moe.load_balance_rate = 0.001;
  c.data.kind = framework::data::DataKind::kTokens;
  c.data.task = framework::data::SyntheticTask::kAdd;
  c.data.path = "data/train_*.bin";
  c.data.eval_fraction = 0.25;
  c.data.eval_path = "data/val.bin";
  c.data.check_tokens = false;
  c.data.tokenizer = "tokenizer.json";
  c.data.packed = false;
  c.optim.lr = 1.0 / 3.0;
  c.optim.min_lr = 1e-7;
  c.optim.warmup_steps = 0;
  c.optim.weight_decay = 0.0;
  c.optim.beta1 = 0.8;
  c.optim.beta2 = 0.999;
  c.optim.eps = 1e-12;
  c.parallel.replicate = 2;
  c.parallel.shard = 4;
  c.parallel.tensor = 2;
  c.parallel.expert = 2;
  c.parallel.context = 2;
  c.parallel.context_load_balance = framework::cp::LoadBalance::kNone;
  c.parallel.pipeline = 2;
  c.parallel.pipeline_schedule = framework::pp::Schedule::kInterleaved1F1B;
  c.parallel.stages_per_rank = 2;
  c.parallel.pipeline_split_points = "model.layers.2,model.layers.4,model.layers.6";
  c.parallel.reshard_after_forward = false;
  c.parallel.prefetch = 3;
  c.dist.backend = comm::Backend::kNccl;
  c.dist.timeout_s = 30.5;
  c.dist.stop_grace_s = 4.5;
  c.dist.standby = false;
  c.dist.standby_delay_s = 0.5;
  c.dist.master_addr = "10.0.0.1";
  c.dist.master_port = 29501;
  c.checkpoint.dir = "/tmp/ckpt";
  c.checkpoint.interval = 25;
  c.checkpoint.mtbf_s = 600.5;
  c.checkpoint.mode = checkpoint::SaveMode::kOverlap;
  c.checkpoint.keep_last = 3;
  c.checkpoint.resume = "never";
  c.checkpoint.resume_fallback = false;
  c.checkpoint.allow_config_change = true;
  c.checkpoint.resume_audit = checkpoint::ResumeAudit::kWarn;
  c.checkpoint.on_error = checkpoint::OnError::kWarn;
  c.checkpoint.save_on_signal = false;
  c.checkpoint.when_busy = checkpoint::WhenBusy::kSkip;
  c.checkpoint.allow_partial = true;
  c.checkpoint.model_only = true;
  c.checkpoint.io_threads = 16;
  c.checkpoint.plan_cache = false;
  c.checkpoint.direct_io = checkpoint::DirectIo::kOn;
  c.checkpoint.device_snapshot = checkpoint::DeviceSnapshot::kOff;
  c.run.host_malloc = comm::HostMalloc::kDefault;
  c.checkpoint.local.dir = "/dev/shm/run/node{node}";
  c.checkpoint.local.keep_last = 5;
  c.checkpoint.local.partner = false;
  c.checkpoint.durable.every = 3;
  c.checkpoint.compression.codec = checkpoint::Codec::kZstd;
  c.checkpoint.compression.level = 19;
  c.checkpoint.compression.byte_group = checkpoint::ByteGroup::kOff;
  c.checkpoint.compression.block_size = 1 << 20;
  return c;
}

// ---- Bad files: each message names the key path and the 1-based line. ----

struct BadConfigCase {
  const char* name;
  const char* yaml;
  const char* key;       // must appear in the message
  const char* location;  // "configs/x.yaml:<line>", must appear in the message
  const char* detail;    // must appear in the message
};

const BadConfigCase kBadConfigs[] = {
    {"UnknownKeySuggestsTheClosestKey",
     "run:\n  dir: runs/x\ncheckpoint:\n  interval: 5\n  intervl: 10\n",
     "checkpoint.intervl", "configs/x.yaml:5", "did you mean checkpoint.interval?"},
    {"NestedUnknownKeySuggestsTheNestedKey",
     "checkpoint:\n  compression:\n    codec: zstd\n    levle: 5\n",
     "checkpoint.compression.levle", "configs/x.yaml:4", "did you mean checkpoint.compression.level?"},
    {"MisspelledSectionSuggestsTheSection",
     "train:\n  steps: 5\nchekpoint:\n  interval: 5\n",
     "chekpoint", "configs/x.yaml:3", "did you mean checkpoint?"},
    {"ShortMisspelledNameStillGetsASuggestion",
     "checkpoint:\n  compression:\n    lvl: 3\n", "checkpoint.compression.lvl",
     "configs/x.yaml:3", "did you mean checkpoint.compression.level?"},
    {"KeyUnderTheWrongSectionSuggestsWhereItLives",
     "train:\n  seed: 5\n", "train.seed", "configs/x.yaml:2", "did you mean run.seed?"},
    {"IntegerGivenAsWordIsRejected",
     "train:\n  log_every: 1\n  grad_clip: 1\n  steps: abc\n",
     "train.steps", "configs/x.yaml:4", "expected an integer, got \"abc\""},
    {"IntegerGivenAsFractionIsRejected",
     "train:\n  steps: 1.5\n", "train.steps", "configs/x.yaml:2", "expected an integer"},
    {"IntegerWithTrailingGarbageIsRejected",
     "model:\n  d_model: 10abc\n", "model.d_model", "configs/x.yaml:2", "\"10abc\""},
    {"BoolGivenAsYesIsRejected",
     "model:\n  tie_weights: yes\n", "model.tie_weights", "configs/x.yaml:2",
     "expected true or false"},
    {"NumberGivenAsWordIsRejected",
     "optim:\n  lr: fast\n", "optim.lr", "configs/x.yaml:2", "expected a number"},
    {"SectionGivenAsScalarIsRejected",
     "run:\n  seed: 1\ncheckpoint: 3\n", "checkpoint", "configs/x.yaml:3", "expected a section"},
    {"ScalarGivenAsMapIsRejected",
     "train:\n  steps:\n    value: 3\n", "train.steps", "configs/x.yaml:2", "got a map"},
    {"ScalarGivenAsListIsRejected",
     "dist:\n  backend: [gloo, nccl]\n", "dist.backend", "configs/x.yaml:2", "got a list"},
    {"EnumOutsideItsChoicesIsRejected",
     "checkpoint:\n  interval: 5\n  mode: fast\n", "checkpoint.mode", "configs/x.yaml:3",
     "expected one of sync|async|overlap, got \"fast\""},
    {"DirectIoGivenAsYesIsRejected",
     "checkpoint:\n  direct_io: yes\n", "checkpoint.direct_io", "configs/x.yaml:2",
     "expected one of auto|true|false, got \"yes\""},
    {"IntervalGivenAsAnotherWordIsRejected",
     "checkpoint:\n  interval: sometimes\n", "checkpoint.interval", "configs/x.yaml:2",
     "expected auto or an integer >= 0, got \"sometimes\""},
    {"IntervalOfMinusOneIsRejected",
     "checkpoint:\n  interval: -1\n", "checkpoint.interval", "configs/x.yaml:2",
     "expected auto or an integer >= 0, got -1"},
    {"ZeroMtbfIsRejected",
     "checkpoint:\n  interval: auto\n  mtbf_s: 0\n", "checkpoint.mtbf_s", "configs/x.yaml:3",
     "expected a number > 0, got 0"},
    {"DeviceOutsideItsChoicesIsRejected",
     "train:\n  device: tpu\n", "train.device", "configs/x.yaml:2", "one of cpu|cuda"},
    {"ZeroStepsIsRejected",
     "train:\n  steps: 0\n", "train.steps", "configs/x.yaml:2", "expected an integer >= 1, got 0"},
    {"NegativeSeedIsRejected",
     "run:\n  seed: -3\n", "run.seed", "configs/x.yaml:2", ">= 0"},
    {"Beta2OfOneIsRejected",
     "optim:\n  beta2: 1.0\n", "optim.beta2", "configs/x.yaml:2", "in [0, 1)"},
    {"ZeroLearningRateIsRejected",
     "optim:\n  lr: 0\n", "optim.lr", "configs/x.yaml:2", "> 0"},
    {"ShardDegreeOfZeroIsRejected",
     "parallel:\n  shard: 0\n", "parallel.shard", "configs/x.yaml:2", "-1 or >= 1"},
    {"PortAboveRangeIsRejected",
     "dist:\n  master_port: 70000\n", "dist.master_port", "configs/x.yaml:2", "0..65535"},
    {"ZstdLevelAboveRangeIsRejected",
     "checkpoint:\n  compression:\n    level: 22\n", "checkpoint.compression.level",
     "configs/x.yaml:3", "1..19"},
    {"TinyBlockSizeIsRejected",
     "checkpoint:\n  compression:\n    block_size: 100\n", "checkpoint.compression.block_size",
     "configs/x.yaml:3", "4096..1073741824"},
    {"TooManyIoThreadsIsRejected",
     "checkpoint:\n  io_threads: 1000\n", "checkpoint.io_threads", "configs/x.yaml:2", "1..256"},
    {"EmptyResumeIsRejected",
     "checkpoint:\n  resume: \"\"\n", "checkpoint.resume", "configs/x.yaml:2", "non-empty"},
    {"EmptyIntegerValueIsRejected",
     "train:\n  steps:\n", "train.steps", "configs/x.yaml:2", "got an empty value"},
    {"DuplicateKeyNamesBothLines",
     "checkpoint:\n  interval: 5\n  mode: sync\n  interval: 6\n", "checkpoint.interval",
     "configs/x.yaml:4", "first at line 2"},
    {"DuplicateSectionNamesBothLines",
     "train:\n  steps: 5\nmodel:\n  d_model: 64\ntrain:\n  log_every: 2\n", "train",
     "configs/x.yaml:5", "first at line 1"},
    {"DottedKeyRepeatingANestedKeyIsADuplicate",
     "checkpoint:\n  interval: 5\ncheckpoint.interval: 6\n", "checkpoint.interval",
     "configs/x.yaml:3", "first at line 2"},
    {"CrossKeyBothDegreesDerivedNamesBothKeys",
     "parallel:\n  replicate: -1\n  shard: -1\n", "parallel.replicate", "configs/x.yaml:2",
     "parallel.shard (-1, configs/x.yaml:3)"},
    {"CrossKeyHeadsMustDivideWidth",
     "model:\n  d_model: 65\n  n_heads: 4\n", "model.d_model", "configs/x.yaml:2",
     "model.n_heads (4, configs/x.yaml:3)"},
    {"CrossKeyMinLrAboveLr",
     "optim:\n  lr: 1.0e-3\n  min_lr: 1.0e-2\n", "optim.min_lr", "configs/x.yaml:3",
     "optim.lr (0.001, configs/x.yaml:2)"},
    {"CrossKeyTextNeedsAPath",
     "data:\n  kind: text\n", "data.path", "configs/x.yaml:2", "data.kind (\"text\""},
    {"CrossKeyMemorySnapshotNeedsCuda",
     "profile:\n  memory_snapshot: true\n", "profile.memory_snapshot", "configs/x.yaml:2",
     "needs train.device (\"cpu\", default) to be cuda"},
    {"CrossKeyStopAfterTheLastStep",
     "train:\n  steps: 10\n  stop_at: 11\n", "train.stop_at", "configs/x.yaml:3",
     "train.steps (10, configs/x.yaml:2)"},
    {"CrossKeyPipelineWithTiedWeights",
     "model:\n  kind: gpt\nparallel:\n  pipeline: 2\n", "model.tie_weights", "default",
     "parallel.pipeline (2, configs/x.yaml:4)"},
    {"CrossKeyStagesPerRankNeedsInterleaved",
     "model:\n  kind: llama\nparallel:\n  pipeline: 2\n  stages_per_rank: 2\n", "parallel.stages_per_rank",
     "configs/x.yaml:5", "interleaved_1f1b takes more"},
    {"CrossKeyInterleavedNeedsStagesPerRank",
     "model:\n  kind: llama\nparallel:\n  pipeline: 2\n  pipeline_schedule: interleaved_1f1b\n",
     "parallel.pipeline_schedule", "configs/x.yaml:5", "needs parallel.stages_per_rank > 1"},
    {"LoraTargetThatIsNoProjection",
     "model:\n  lora:\n    rank: 4\n    targets: q_proj,attn\n", "model.lora.targets", "configs/x.yaml:4",
     "'attn' is not one of q_proj"},
    {"NameListWithANestedListIsRejected",
     "model:\n  lora:\n    targets: [q_proj, [a]]\n", "model.lora.targets", "configs/x.yaml:3",
     "got a list item a list"},
    {"TopLevelListIsRejected",
     "- a\n- b\n", "top level", "configs/x.yaml:1", "map of sections"},
    {"YamlSyntaxErrorCarriesTheLine",
     "train:\n  steps: [1,\nmodel:\n  d_model: 3\n", "YAML syntax error", "configs/x.yaml:",
     "YAML syntax error"},
};

// Names the case in test output instead of dumping its bytes.
void PrintTo(const BadConfigCase& c, std::ostream* os) { *os << c.name; }

class BadConfig : public ::testing::TestWithParam<BadConfigCase> {};

TEST_P(BadConfig, ErrorNamesKeyAndLine) {
  const BadConfigCase& c = GetParam();
  std::string message = parse_error(c.yaml);
  EXPECT_NE(message.find(c.key), std::string::npos) << message;
  EXPECT_NE(message.find(c.location), std::string::npos) << message;
  EXPECT_NE(message.find(c.detail), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
}

INSTANTIATE_TEST_SUITE_P(Config, BadConfig, ::testing::ValuesIn(kBadConfigs),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(Config, UnknownKeyMessageHasTheDocumentedShape) {
  EXPECT_EQ(parse_error("checkpoint:\n  intervl: 5\n"),
            "checkpoint.intervl: unknown key at configs/x.yaml:2 \xE2\x80\x94 did you mean "
            "checkpoint.interval?");
}

TEST(Config, UnknownKeyWithNothingCloseHasNoSuggestion) {
  std::string message = parse_error("train:\n  zzzzqqq: 5\n");
  EXPECT_EQ(message, "train.zzzzqqq: unknown key at configs/x.yaml:2");
}

TEST(Config, WrongTypeMessageHasTheDocumentedShape) {
  EXPECT_EQ(parse_error("run:\n  seed: 1\ntrain:\n  steps: abc\n"),
            "train.steps: expected an integer, got \"abc\" at configs/x.yaml:4");
}

TEST(Config, HeadsNeedNotDivideWidthForMlp) {
  Config cfg = parse_config("model:\n  kind: mlp\n  d_model: 65\n  n_heads: 4\n", "x.yaml");
  EXPECT_EQ(cfg.model.d_model, 65);
}

// ---- Files. ----

TEST(Config, EmptyFileGivesAllDefaults) {
  EXPECT_EQ(parse_config("", "empty.yaml"), Config{});
  EXPECT_EQ(parse_config("# nothing here\n", "empty.yaml"), Config{});
  EXPECT_EQ(parse_config("checkpoint:\n", "empty.yaml"), Config{});
}

TEST(Config, ValuesInTheFileReachTheStructs) {
  Config cfg = parse_config(
      "train:\n  steps: 50\n  grad_clip: 0\n  device: cuda\n"
      "model:\n  tie_weights: false\n"
      "optim:\n  lr: 1.0e-2\n"
      "dist:\n  master_port: 1234\n"
      "checkpoint:\n  resume: /tmp/ckpt/step_40\n  compression:\n    codec: zstd\n    level: 9\n",
      "x.yaml");
  EXPECT_EQ(cfg.train.steps, 50);
  EXPECT_EQ(cfg.train.grad_clip, 0.0);
  EXPECT_EQ(cfg.train.device, comm::DeviceKind::kCuda);
  EXPECT_FALSE(cfg.model.tie_weights);
  EXPECT_DOUBLE_EQ(cfg.optim.lr, 1e-2);
  EXPECT_EQ(cfg.dist.master_port, 1234);
  EXPECT_EQ(cfg.checkpoint.resume, "/tmp/ckpt/step_40");
  EXPECT_EQ(cfg.checkpoint.compression.codec, checkpoint::Codec::kZstd);
  EXPECT_EQ(cfg.checkpoint.compression.level, 9);
  EXPECT_EQ(cfg.run.seed, Config{}.run.seed);
}

TEST(Config, MissingFileErrorNamesThePathAndReason) {
  std::string message = error_of([] { load_config("/nonexistent/dir/cfg.yaml"); });
  EXPECT_NE(message.find("/nonexistent/dir/cfg.yaml"), std::string::npos) << message;
  EXPECT_NE(message.find("No such file or directory"), std::string::npos) << message;
}

TEST(Config, EveryConfigInTheRepositoryParses) {
  fs::path dir = fs::path(testing_support::source_dir()) / "configs";
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".yaml") continue;
    names.insert(entry.path().filename().string());
    EXPECT_NO_THROW(load_config(entry.path().string())) << entry.path();
  }
  for (const char* expected : {"default.yaml", "ddp.yaml", "hsdp.yaml", "text.yaml"})
    EXPECT_EQ(names.count(expected), 1u) << expected;
}

TEST(Config, RepositoryConfigsSelectTheirLayouts) {
  auto load = [](const char* name) {
    return load_config((fs::path(testing_support::source_dir()) / "configs" / name).string());
  };
  Config def = load("default.yaml");
  EXPECT_EQ(def.parallel.replicate, 1);
  EXPECT_EQ(def.parallel.shard, -1);
  EXPECT_EQ(def.checkpoint.mode, checkpoint::SaveMode::kAsync);
  EXPECT_EQ(def.checkpoint.interval, 50);
  Config ddp = load("ddp.yaml");
  EXPECT_EQ(ddp.parallel.replicate, -1);
  EXPECT_EQ(ddp.parallel.shard, 1);
  Config hsdp = load("hsdp.yaml");
  EXPECT_EQ(hsdp.parallel.replicate, 2);
  EXPECT_EQ(hsdp.parallel.shard, 2);
  Config text = load("text.yaml");
  EXPECT_EQ(text.data.kind, framework::data::DataKind::kText);
  EXPECT_EQ(text.data.path, "README.md");
  EXPECT_EQ(text.model.vocab_size, 256);
}

TEST(Config, DefaultYamlListsEveryKey) {
  YAML::Node root = YAML::LoadFile((fs::path(testing_support::source_dir()) / "configs/default.yaml").string());
  std::vector<std::string> paths;
  collect_leaf_paths(root, "", &paths);
  EXPECT_EQ(paths, kAllKeys);
}

// ---- --set overrides. ----

TEST(Config, SetOverridesWinOverTheFile) {
  Config cfg = parse_config("train:\n  steps: 50\ncheckpoint:\n  mode: sync\n", "x.yaml",
                            {"train.steps=70", "checkpoint.mode=overlap",
                             "checkpoint.compression.block_size=65536", "optim.lr=0.01",
                             "model.tie_weights=false", "data.path=some file.txt"});
  EXPECT_EQ(cfg.train.steps, 70);
  EXPECT_EQ(cfg.checkpoint.mode, checkpoint::SaveMode::kOverlap);
  EXPECT_EQ(cfg.checkpoint.compression.block_size, 65536);
  EXPECT_DOUBLE_EQ(cfg.optim.lr, 0.01);
  EXPECT_FALSE(cfg.model.tie_weights);
  EXPECT_EQ(cfg.data.path, "some file.txt");
}

// Every key whose values are a closed set (an enum in its options struct),
// with its spellings in the order the schema lists them.
const std::vector<std::pair<std::string, std::vector<std::string>>> kEnumKeys = {
    {"run.host_malloc", {"keep", "default"}},
    {"train.device", {"cpu", "cuda"}},
    {"train.optimizer_impl", {"auto", "fused", "foreach", "for_loop"}},
    {"train.mixed_precision.param_dtype", {"fp32", "bf16"}},
    {"train.mixed_precision.reduce_dtype", {"fp32", "bf16"}},
    {"model.activation_checkpointing", {"none", "full", "selective"}},
    {"data.kind", {"synthetic", "text", "tokens", "sft"}},
    {"data.task", {"copy", "reverse", "add"}},
    {"dist.backend", {"auto", "gloo", "nccl"}},
    {"checkpoint.mode", {"sync", "async", "overlap"}},
    {"checkpoint.on_error", {"fail", "warn"}},
    {"checkpoint.when_busy", {"wait", "skip"}},
    {"checkpoint.device_snapshot", {"auto", "on", "off"}},
    {"checkpoint.direct_io", {"auto", "true", "false"}},
    {"checkpoint.compression.codec", {"none", "zstd"}},
    {"checkpoint.compression.byte_group", {"auto", "on", "off"}},
};

TEST(Config, EveryEnumKeyReadsAndWritesEachOfItsSpellings) {
  for (const auto& [key, values] : kEnumKeys) {
    for (const std::string& value : values) {
      SCOPED_TRACE(key + "=" + value);
      // data.kind text and tokens need a path; text without a tokenizer reads bytes.
      const Config cfg =
          parse_config("", "x.yaml", {"data.path=x", "model.vocab_size=256", key + "=" + value});
      const std::string yaml = to_yaml(cfg);
      const std::string leaf = key.substr(key.rfind('.') + 1);
      EXPECT_NE(yaml.find("  " + leaf + ": \"" + value + "\"\n"), std::string::npos) << yaml;
      EXPECT_EQ(parse_config(yaml, "effective.yaml"), cfg);
    }
  }
}

TEST(Config, AnEnumKeyRefusesOtherValuesListingItsSpellings) {
  for (const auto& [key, values] : kEnumKeys) {
    std::string allowed;
    for (const std::string& value : values) allowed += (allowed.empty() ? "" : "|") + value;
    EXPECT_EQ(parse_error("", {key + "=bogus"}),
              "--set " + key + "=bogus: expected one of " + allowed + ", got \"bogus\"");
  }
}

// The one parse function of each enum (for code that fills the options from
// text itself, as the tests do) words its error as the key, the value and
// the allowed values.
TEST(Config, EnumParseFunctionsNameTheKeyAndTheAllowedValues) {
  auto message = [](const std::function<void()>& parse) {
    try {
      parse();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([] { comm::parse_host_malloc("x"); }),
            "run.host_malloc 'x' is not one of keep, default");
  EXPECT_EQ(message([] { comm::parse_device_kind("x"); }),
            "train.device 'x' is not one of cpu, cuda");
  EXPECT_EQ(message([] { framework::optim::parse_optimizer_impl("x"); }),
            "train.optimizer_impl 'x' is not one of auto, fused, foreach, for_loop");
  EXPECT_EQ(message([] {
              framework::fsdp::parse_precision_dtype("x", "train.mixed_precision.reduce_dtype");
            }),
            "train.mixed_precision.reduce_dtype 'x' is not one of fp32, bf16");
  EXPECT_EQ(message([] { models::parse_activation_checkpointing("x"); }),
            "model.activation_checkpointing 'x' is not one of none, full, selective");
  EXPECT_EQ(message([] { framework::data::parse_data_kind("x"); }),
            "data.kind 'x' is not one of synthetic, text, tokens, sft");
  EXPECT_EQ(message([] { framework::data::parse_synthetic_task("x"); }),
            "data.task 'x' is not one of copy, reverse, add");
  EXPECT_EQ(message([] { comm::parse_backend("x"); }),
            "dist.backend 'x' is not one of auto, gloo, nccl");
  EXPECT_EQ(message([] { checkpoint::parse_save_mode("x"); }),
            "checkpoint.mode 'x' is not one of sync, async, overlap");
  EXPECT_EQ(message([] { checkpoint::parse_on_error("x"); }),
            "checkpoint.on_error 'x' is not one of fail, warn");
  EXPECT_EQ(message([] { checkpoint::parse_when_busy("x"); }),
            "checkpoint.when_busy 'x' is not one of wait, skip");
  EXPECT_EQ(message([] { checkpoint::parse_device_snapshot("x"); }),
            "checkpoint.device_snapshot 'x' is not one of auto, on, off");
  EXPECT_EQ(message([] { checkpoint::parse_direct_io("x"); }),
            "checkpoint.direct_io 'x' is not one of auto, true, false");
  EXPECT_EQ(message([] { checkpoint::parse_codec("x"); }),
            "checkpoint.compression.codec 'x' is not one of none, zstd");
  EXPECT_EQ(message([] { checkpoint::parse_byte_group("x"); }),
            "checkpoint.compression.byte_group 'x' is not one of auto, on, off");
  EXPECT_EQ(checkpoint::parse_save_mode(to_string(checkpoint::SaveMode::kOverlap)),
            checkpoint::SaveMode::kOverlap);
}

// checkpoint.direct_io was a bool; it is auto by default now, and the
// spellings it took as a bool keep their meaning.
TEST(Config, DirectIoIsAutoByDefaultAndKeepsItsBooleanSpellings) {
  EXPECT_EQ(parse_config("", "x.yaml").checkpoint.direct_io, checkpoint::DirectIo::kAuto);
  const std::vector<std::pair<std::string, checkpoint::DirectIo>> spellings = {
      {"auto", checkpoint::DirectIo::kAuto}, {"true", checkpoint::DirectIo::kOn},
      {"True", checkpoint::DirectIo::kOn},   {"TRUE", checkpoint::DirectIo::kOn},
      {"false", checkpoint::DirectIo::kOff}, {"False", checkpoint::DirectIo::kOff},
      {"FALSE", checkpoint::DirectIo::kOff}};
  for (const auto& [text, want] : spellings) {
    SCOPED_TRACE(text);
    EXPECT_EQ(parse_config("checkpoint:\n  direct_io: " + text + "\n", "x.yaml").checkpoint.direct_io, want);
    EXPECT_EQ(parse_config("", "x.yaml", {"checkpoint.direct_io=" + text}).checkpoint.direct_io, want);
  }
}

TEST(Config, LaterSetOverridesWinOverEarlierOnes) {
  Config cfg = parse_config("", "x.yaml", {"train.steps=5", "train.steps=9"});
  EXPECT_EQ(cfg.train.steps, 9);
}

TEST(Config, SetOfAnEmptyValueGivesAnEmptyString) {
  Config cfg = parse_config("dist:\n  master_addr: host\n", "x.yaml", {"dist.master_addr="});
  EXPECT_EQ(cfg.dist.master_addr, "");
}

TEST(Config, SetOfAnUnknownKeySuggestsTheClosestKey) {
  EXPECT_EQ(parse_error("", {"checkpoint.intervl=5"}),
            "--set checkpoint.intervl=5: unknown key \xE2\x80\x94 did you mean checkpoint.interval?");
}

TEST(Config, SetWithTheWrongTypeNamesTheKey) {
  EXPECT_EQ(parse_error("", {"train.steps=abc"}),
            "--set train.steps=abc: expected an integer, got \"abc\"");
}

TEST(Config, SetOutOfRangeNamesTheKeyAndRange) {
  std::string message = parse_error("", {"checkpoint.compression.level=0"});
  EXPECT_NE(message.find("--set checkpoint.compression.level=0"), std::string::npos) << message;
  EXPECT_NE(message.find("1..19"), std::string::npos) << message;
}

TEST(Config, SetWithoutAnEqualsSignIsAnError) {
  std::string message = parse_error("", {"train.steps"});
  EXPECT_NE(message.find("--set train.steps"), std::string::npos) << message;
  EXPECT_NE(message.find("key.path=value"), std::string::npos) << message;
}

TEST(Config, SetOfASectionIsAnError) {
  std::string message = parse_error("", {"checkpoint=3"});
  EXPECT_NE(message.find("--set checkpoint=3"), std::string::npos) << message;
  EXPECT_NE(message.find("is a section"), std::string::npos) << message;
}

TEST(Config, SetOfAListIsAnError) {
  std::string message = parse_error("", {"train.steps=[1, 2]"});
  EXPECT_NE(message.find("--set train.steps=[1, 2]"), std::string::npos) << message;
  EXPECT_NE(message.find("got a list"), std::string::npos) << message;
}

TEST(Config, CrossKeyChecksRunAfterTheOverrides) {
  // The file alone is inconsistent; the override repairs it.
  Config cfg = parse_config("model:\n  d_model: 65\n", "x.yaml", {"model.d_model=68"});
  EXPECT_EQ(cfg.model.d_model, 68);
  // The file alone is fine; the override breaks it and is blamed.
  std::string message = parse_error("parallel:\n  replicate: 1\n", {"parallel.replicate=-1"});
  EXPECT_NE(message.find("parallel.replicate (-1, --set)"), std::string::npos) << message;
  EXPECT_NE(message.find("parallel.shard (-1, default)"), std::string::npos) << message;
}

// ---- Writing back. ----

TEST(Config, ToYamlRoundTripsANonDefaultConfig) {
  Config cfg = non_default_config();
  ASSERT_NE(cfg, Config{});
  Config back = parse_config(to_yaml(cfg), "to_yaml");
  EXPECT_EQ(back, cfg);
  EXPECT_EQ(back.run.dir, cfg.run.dir);
  EXPECT_EQ(back.optim.lr, cfg.optim.lr);  // exact, not approximately
  EXPECT_EQ(back.checkpoint.compression.block_size, cfg.checkpoint.compression.block_size);
}

TEST(Config, ToYamlWritesEveryKeyNestedBySection) {
  YAML::Node root = YAML::Load(to_yaml(Config{}));
  std::vector<std::string> paths;
  collect_leaf_paths(root, "", &paths);
  EXPECT_EQ(paths, kAllKeys);
}

TEST(Config, EveryKeyDiffersFromItsDefaultInTheRoundTripConfig) {
  // Guards the round-trip test: a key left at its default would prove nothing.
  YAML::Node changed = YAML::Load(to_yaml(non_default_config()));
  YAML::Node defaults = YAML::Load(to_yaml(Config{}));
  for (const std::string& key : kAllKeys)
    EXPECT_NE(scalar_at(changed, key), scalar_at(defaults, key)) << key;
}

TEST(Config, ToYamlWritesFloatsThatYaml11ReadersSeeAsFloats) {
  // PyYAML (YAML 1.1) reads "1" as an int and "1e-08" as a string.
  std::string yaml = to_yaml(Config{});
  EXPECT_NE(yaml.find("grad_clip: 1.0\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("eps: 1.0e-08\n"), std::string::npos) << yaml;
}

TEST(Config, WriteEffectiveConfigWritesAParseableFileInANewDirectory) {
  fs::path dir = fs::path(testing_support::binary_dir()) / "test_config_tmp" / "run" / "nested";
  fs::remove_all(dir.parent_path().parent_path());
  Config cfg = non_default_config();
  write_effective_config(cfg, dir.string());
  EXPECT_EQ(load_config((dir / "config.yaml").string()), cfg);
  // Overwriting leaves exactly one file behind: no temporaries.
  write_effective_config(Config{}, dir.string());
  EXPECT_EQ(load_config((dir / "config.yaml").string()), Config{});
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  fs::remove_all(dir.parent_path().parent_path());
}

TEST(Config, ReferenceMarkdownListsEveryKey) {
  std::string md = reference_markdown();
  EXPECT_EQ(md.rfind("| key | type | default | meaning |", 0), 0u) << md;
  for (const std::string& key : kAllKeys)
    EXPECT_NE(md.find("| `" + key + "` |"), std::string::npos) << key;
  EXPECT_NE(md.find("`\"runs/default\"`"), std::string::npos) << md;
  EXPECT_NE(md.find("sync\\|async\\|overlap"), std::string::npos) << md;
  size_t rows = static_cast<size_t>(std::count(md.begin(), md.end(), '\n'));
  EXPECT_EQ(rows, kAllKeys.size() + 2);
}

TEST(Config, NameListsTakeAYamlListOrCommas) {
  Config c = parse_config("model:\n  kind: llama\n  lora:\n    rank: 4\n    targets: [q_proj, o_proj]\n"
                          "parallel:\n  pipeline_split_points: [model.layers.2]\n",
                          "x.yaml");
  EXPECT_EQ(c.model.lora.targets, "q_proj,o_proj");
  EXPECT_EQ(c.parallel.pipeline_split_points, "model.layers.2");
  EXPECT_EQ(parse_config("model:\n  lora:\n    targets: k_proj,up_proj\n", "x.yaml").model.lora.targets,
            "k_proj,up_proj");
}

TEST(Config, LlamaDoesNotTieWeightsUnlessTheConfigSaysSo) {
  EXPECT_FALSE(parse_config("model:\n  kind: llama\n", "x.yaml").model.tie_weights);
  EXPECT_TRUE(parse_config("model:\n  kind: llama\n  tie_weights: true\n", "x.yaml").model.tie_weights);
  EXPECT_TRUE(parse_config("model:\n  kind: llama\n", "x.yaml", {"model.tie_weights=true"}).model.tie_weights);
  EXPECT_TRUE(parse_config("model:\n  kind: gpt\n", "x.yaml").model.tie_weights);
  // The effective config reads back the same.
  const Config llama = parse_config("model:\n  kind: llama\n", "x.yaml");
  EXPECT_EQ(parse_config(to_yaml(llama), "effective.yaml"), llama);
}

// train.peak_tflops: auto (0, the default), or a positive number; the word
// auto and 0 are the same value, and the effective config reads back.
TEST(Config, PeakTflopsTakesAutoOrAPositiveNumber) {
  EXPECT_EQ(parse_config("train:\n  peak_tflops: auto\n", "x.yaml").train.peak_tflops, 0.0);
  EXPECT_EQ(parse_config("", "x.yaml").train.peak_tflops, 0.0);
  EXPECT_EQ(parse_config("", "x.yaml", {"train.peak_tflops=0"}).train.peak_tflops, 0.0);
  const Config set = parse_config("train:\n  peak_tflops: 989.5\n", "x.yaml");
  EXPECT_EQ(set.train.peak_tflops, 989.5);
  EXPECT_EQ(parse_config(to_yaml(set), "effective.yaml"), set);
  std::string e = parse_error("train:\n  peak_tflops: -3\n");
  EXPECT_NE(e.find("train.peak_tflops"), std::string::npos) << e;
  EXPECT_NE(e.find("expected auto or a number > 0, got -3"), std::string::npos) << e;
  e = parse_error("train:\n  peak_tflops: fast\n");
  EXPECT_NE(e.find("configs/x.yaml:2"), std::string::npos) << e;
  EXPECT_NE(e.find("expected auto or a number > 0, got \"fast\""), std::string::npos) << e;
}

// checkpoint.interval: an integer as before, or auto (kept as
// kIntervalAuto), which the effective config writes back as the word, so a
// checkpoint's config and config.yaml read back the same.
TEST(Config, CheckpointIntervalTakesAutoAndWritesItBack) {
  const Config a = parse_config("checkpoint:\n  interval: auto\n  mtbf_s: 120\n", "x.yaml");
  EXPECT_EQ(a.checkpoint.interval, checkpoint::kIntervalAuto);
  EXPECT_EQ(a.checkpoint.mtbf_s, 120.0);
  const std::string yaml = to_yaml(a);
  EXPECT_NE(yaml.find("  interval: auto\n"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("  mtbf_s: 120.0\n"), std::string::npos) << yaml;
  EXPECT_EQ(parse_config(yaml, "effective.yaml"), a);
  EXPECT_EQ(parse_config("", "x.yaml", {"checkpoint.interval=auto"}).checkpoint.interval, checkpoint::kIntervalAuto);
  // Integers are what they were.
  EXPECT_EQ(parse_config("checkpoint:\n  interval: 0\n", "x.yaml").checkpoint.interval, 0);
  const Config seven = parse_config("", "x.yaml", {"checkpoint.interval=7"});
  EXPECT_EQ(seven.checkpoint.interval, 7);
  EXPECT_NE(to_yaml(seven).find("  interval: 7\n"), std::string::npos);
  EXPECT_EQ(Config{}.checkpoint.mtbf_s, 3600.0);
  const std::string e = parse_error("checkpoint:\n  interval: sometimes\n");
  EXPECT_NE(e.find("checkpoint.interval"), std::string::npos) << e;
  EXPECT_NE(e.find("expected auto or an integer >= 0"), std::string::npos) << e;
}

TEST(Config, LlamaShapeAndBatchErrorsNameTheKeys) {
  std::string e = parse_error("model:\n  kind: llama\n  n_heads: 4\n  n_kv_heads: 3\n");
  EXPECT_NE(e.find("model.n_heads (4"), std::string::npos) << e;
  EXPECT_NE(e.find("model.n_kv_heads (3"), std::string::npos) << e;
  e = parse_error("model:\n  kind: llama\n  d_model: 12\n  n_heads: 4\n");
  EXPECT_NE(e.find("must be even"), std::string::npos) << e;
  // model.head_dim: heads of their own width; d_model need not divide then.
  e = parse_error("model:\n  kind: llama\n  d_model: 30\n  n_heads: 4\n");
  EXPECT_NE(e.find("model.d_model (30"), std::string::npos) << e;
  EXPECT_NE(e.find("model.head_dim"), std::string::npos) << e;
  e = parse_error("model:\n  kind: llama\n  head_dim: -8\n");
  EXPECT_NE(e.find("model.head_dim"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  e = parse_error("model:\n  kind: llama\n  head_dim: 7\n");
  EXPECT_NE(e.find("model.head_dim (7"), std::string::npos) << e;
  EXPECT_NE(e.find("must be even"), std::string::npos) << e;
  const Config wide = parse_config("model:\n  kind: llama\n  d_model: 30\n  n_heads: 4\n  head_dim: 16\n", "x.yaml");
  EXPECT_EQ(models::llama_attention_width(wide.model), 64);
  e = parse_error("model:\n  kind: llama\n  d_model: 30\n  n_heads: 4\n  n_kv_heads: 2\n  head_dim: 16\n"
                  "parallel:\n  tensor: 4\n");
  EXPECT_NE(e.find("parallel.tensor (4"), std::string::npos) << e;
  e = parse_error("train:\n  global_batch_size: 8\n  micro_batch_size: 16\n");
  EXPECT_NE(e.find("train.micro_batch_size (16"), std::string::npos) << e;
  e = parse_error("train:\n  mixed_precision:\n    param_dtype: fp16\n");
  EXPECT_NE(e.find("train.mixed_precision.param_dtype"), std::string::npos) << e;
  e = parse_error("model:\n  activation_checkpointing: some\n");
  EXPECT_NE(e.find("model.activation_checkpointing"), std::string::npos) << e;
  e = parse_error("model:\n  kind: llama\n  rope_scaling:\n    factor: 8.0\n    low_freq_factor: 4.0\n    high_freq_factor: 1.0\n");
  EXPECT_NE(e.find("model.rope_scaling.high_freq_factor"), std::string::npos) << e;
}


// A config.json field of another JSON type (fuzz_hf_config found these: a
// number where a string or bool is read) is refused as model.init_from's
// ConfigError naming the file, not an uncaught nlohmann type_error.
TEST(Config, InitFromConfigJsonWithAFieldOfTheWrongTypeIsRefusedNamingTheFile) {
  const fs::path dir = fs::path(testing_support::binary_dir()) / "test_config_tmp" / "hf_wrong_types";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string llama =
      R"("hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, )"
      R"("num_attention_heads": 4, "vocab_size": 64)";
  for (const std::string& json : {R"({"model_type": 5})"s, R"({"model_type": "llama", "hidden_act": 1, )" + llama + "}",
                                  R"({"model_type": "llama", "attention_bias": "no", )" + llama + "}",
                                  R"({"model_type": "llama", "tie_word_embeddings": [], )" + llama + "}",
                                  R"({"model_type": "llama", "rope_scaling": {"rope_type": 3}, )" + llama + "}"}) {
    std::ofstream(dir / "config.json") << json;
    const std::string e = parse_error("model:\n  init_from: " + dir.string() + "\n");
    EXPECT_NE(e.find("model.init_from: " + (dir / "config.json").string() + ": "), std::string::npos)
        << json << ": " << e;
    EXPECT_TRUE(e.find("is not a string") != std::string::npos || e.find("wrong JSON type") != std::string::npos)
        << json << ": " << e;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace framework::config

// docs/config-reference.md is the schema's own output, verbatim.
TEST(ConfigReference, DocsTableMatchesTheSchema) {
  const std::string path = testing_support::source_dir() + "/docs/config-reference.md";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot read " << path;
  std::string page((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string begin = "<!-- config-reference:begin -->\n", end = "<!-- config-reference:end -->";
  auto b = page.find(begin), e = page.find(end);
  ASSERT_NE(b, std::string::npos) << path << " lacks the config reference markers";
  ASSERT_NE(e, std::string::npos);
  EXPECT_EQ(page.substr(b + begin.size(), e - b - begin.size()),
            framework::config::reference_markdown())
      << "regenerate the table in docs/config-reference.md with: build/train --config-reference";
}

// The exports (checkpoint/interop/export_lora.cpp) know a LoRA adapter's
// tensors only through the run adapter: which weight each changes and
// which factor it is.
TEST(RunAdapter, NamesEachLoraTensorByTheWeightItChangesAndItsFactor) {
  const std::shared_ptr<const checkpoint::RunAdapter> run = framework::config::make_run_adapter();
  const std::optional<checkpoint::LoraTensor> a = run->lora_tensor("layers.3.attn.q_proj.lora_A.weight");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->target, "layers.3.attn.q_proj.weight");
  EXPECT_TRUE(a->is_a);
  const std::optional<checkpoint::LoraTensor> b = run->lora_tensor("layers.0.mlp.down_proj.lora_B.weight");
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->target, "layers.0.mlp.down_proj.weight");
  EXPECT_FALSE(b->is_a);
  EXPECT_FALSE(run->lora_tensor("layers.0.attn.q_proj.weight").has_value());
  EXPECT_FALSE(run->lora_tensor("embed.weight").has_value());
}
