// Bad configurations through build/train as a process: each exits 2 with one
// message naming the key and where it came from (file:line, or the --set
// text), and creates nothing: run.dir and checkpoint.dir, set in the YAML to
// fresh directories, do not exist afterwards.
#include <fstream>
#include <future>
#include <regex>

#include "reliability/test_util.h"

namespace reliability {
namespace {

// Lines 1-4 of every YAML below: they point both directories at fresh paths.
constexpr const char* kBase = "run:\n  dir: {RUN}\ncheckpoint:\n  dir: {CKPT}\n";

struct BadConfig {
  const char* name;
  std::string yaml;                    // appended to kBase unless it starts with '!'
  std::vector<std::string> args;       // extra command-line arguments
  std::vector<std::string> expect;     // substrings of the output; {CFG} = the config path
  std::vector<std::string> absent = {};  // substrings the output must not have
};

std::vector<BadConfig> bad_configs() {
  return {
      {"UnknownSection", "trian:\n  steps: 5\n", {}, {"trian: unknown key at {CFG}:5", "did you mean train"}},
      {"TypoInKey", "train:\n  stpes: 5\n", {}, {"train.stpes: unknown key at {CFG}:6", "did you mean train.steps?"}},
      {"TypoInCheckpointKey", "  intervall: 5\n", {}, {"checkpoint.intervall: unknown key at {CFG}:5", "checkpoint.interval"}},
      {"TypoInNestedSection", "  compresion:\n    codec: zstd\n", {}, {"checkpoint.compresion", "{CFG}:5", "checkpoint.compression"}},
      {"WrongTypeWord", "train:\n  steps: many\n", {}, {"train.steps", "{CFG}:6", "many"}},
      {"WrongTypeFloatForInt", "train:\n  steps: 1.5\n", {}, {"train.steps", "{CFG}:6"}},
      {"WrongTypeBool", "  save_on_signal: maybe\n", {}, {"checkpoint.save_on_signal", "{CFG}:5"}},
      {"WrongTypeListForInt", "train:\n  steps: [1, 2]\n", {}, {"train.steps", "a list", "{CFG}:6"}},
      {"WrongTypeMapForInt", "train:\n  steps:\n    a: 1\n", {}, {"train.steps", "a map", "{CFG}:6"}},
      {"SectionGivenScalar", "train: 5\n", {}, {"train: expected a section", "{CFG}:5"}},
      {"StepsZero", "train:\n  steps: 0\n", {}, {"train.steps", "{CFG}:6"}},
      {"NegativeLr", "optim:\n  lr: -1\n", {}, {"optim.lr", "{CFG}:6"}},
      {"Beta1One", "optim:\n  beta1: 1.0\n", {}, {"optim.beta1", "{CFG}:6"}},
      {"IoThreadsZero", "  io_threads: 0\n", {}, {"checkpoint.io_threads", "{CFG}:5"}},
      {"ZstdLevel20", "  compression:\n    level: 20\n", {}, {"checkpoint.compression.level", "{CFG}:6"}},
      {"BlockSizeTooSmall", "  compression:\n    block_size: 100\n", {}, {"checkpoint.compression.block_size", "{CFG}:6"}},
      {"PortOutOfRange", "dist:\n  master_port: 70000\n", {}, {"dist.master_port", "{CFG}:6"}},
      {"TimeoutZero", "dist:\n  timeout_s: 0\n", {}, {"dist.timeout_s", "{CFG}:6"}},
      {"KeepLastNegative", "  keep_last: -1\n", {}, {"checkpoint.keep_last", "{CFG}:5"}},
      {"IntervalWord", "  interval: sometimes\n", {}, {"checkpoint.interval", "{CFG}:5", "expected auto or an integer >= 0, got \"sometimes\""}},
      {"MtbfZero", "  mtbf_s: 0\n", {}, {"checkpoint.mtbf_s", "{CFG}:5", "expected a number > 0"}},
      {"SetIntervalWord", "", {"--set", "checkpoint.interval=often"}, {"--set checkpoint.interval=often: ", "expected auto or an integer >= 0"}},
      {"ModeEnum", "  mode: turbo\n", {}, {"checkpoint.mode", "turbo", "{CFG}:5"}},
      {"OnErrorEnum", "  on_error: ignore\n", {}, {"checkpoint.on_error", "{CFG}:5"}},
      {"CodecEnum", "  compression:\n    codec: lz4\n", {}, {"checkpoint.compression.codec", "{CFG}:6"}},
      {"ModelKindEnum", "model:\n  kind: rnn\n", {}, {"model.kind", "{CFG}:6"}},
      {"DeviceEnum", "train:\n  device: tpu\n", {}, {"train.device", "{CFG}:6"}},
      {"EmptyResume", "  resume: \"\"\n", {}, {"checkpoint.resume", "{CFG}:5"}},
      {"HeadsDoNotDivideWidth", "model:\n  d_model: 30\n  n_heads: 4\n", {}, {"model.d_model (30, {CFG}:6)", "model.n_heads (4, {CFG}:7)"}},
      {"MinLrAboveLr", "optim:\n  lr: 0.001\n  min_lr: 0.01\n", {}, {"optim.min_lr (0.01, {CFG}:7)", "optim.lr"}},
      {"StopAtAfterSteps", "train:\n  steps: 10\n  stop_at: 20\n", {}, {"train.stop_at (20, {CFG}:7)", "train.steps (10, {CFG}:6)"}},
      {"TextWithoutPath", "data:\n  kind: text\n", {}, {"data.path", "data.kind (\"text\", {CFG}:6)"}},
      {"BothDegreesDerived", "parallel:\n  replicate: -1\n  shard: -1\n", {}, {"parallel.replicate (-1, {CFG}:6)", "parallel.shard (-1, {CFG}:7)"}},
      {"MeshDoesNotMatchWorld", "parallel:\n  replicate: 3\n  shard: 1\n", {}, {"parallel.replicate", "{CFG}"}},
      {"DuplicateKey", "train:\n  steps: 5\n  steps: 6\n", {}, {"train.steps: duplicate key at {CFG}:7 (first at line 6)"}},
      {"DuplicateSection", "checkpoint:\n  interval: 3\n", {}, {"checkpoint: duplicate key at {CFG}:5 (first at line 3)"}},
      {"UnclosedList", "train:\n  steps: [1, 2\n", {}, {"YAML syntax error", "{CFG}:"}},
      {"BadIndentation", "train:\n  steps: 5\n   log_every: 2\n", {}, {"YAML syntax error", "{CFG}:"}},
      {"TwoDocuments", "---\ntrain:\n  steps: 5\n", {}, {"{CFG}", "one YAML document"}},
      {"!TopLevelList", "!- run\n- train\n", {}, {"{CFG}:1", "top level must be a map"}},
      {"MissingFile", "", {"--config", "{MISSING}"}, {"{MISSING}: cannot open config file: No such file or directory"}},
      {"EmptySet", "", {"--set", ""}, {"--set : expected key.path=value"}},
      {"SetUnknownKey", "", {"--set", "train.stpes=5"}, {"--set train.stpes=5: unknown key", "did you mean train.steps?"}},
      {"SetWrongType", "", {"--set", "train.steps=abc"}, {"--set train.steps=abc: ", "abc"}},
      {"SetSection", "", {"--set", "checkpoint=5"}, {"--set checkpoint=5: checkpoint is a section"}},
      {"SetOutOfRange", "", {"--set", "checkpoint.io_threads=999"}, {"--set checkpoint.io_threads=999: "}},
      {"SetFlowList", "", {"--set", "train.steps=[1,2]"}, {"--set train.steps=[1,2]: expected"}},
      {"SetCrossKey", "", {"--set", "optim.min_lr=1"}, {"optim.min_lr (1.0, --set)", "optim.lr"}},
      {"NprocZero", "", {"--nproc", "0"}, {"--nproc"}},
      // An error found at the end of the file is on its last line (6), not after it.
      {"UnclosedListAtTheEnd", "train:\n  steps: [1, 2\n", {}, {"{CFG}:6: YAML syntax error"}},
      // Mistakes found before any rank starts: data, init_from, directories,
      // memory, resume. One message, printed once.
      {"TextWithTheDefaultVocab", "data:\n  kind: text\n  path: {CFG}\n", {},
       {"model.vocab_size (32, default) must be 256 when data.kind (\"text\", {CFG}:6) is text"}},
      {"TextPathMissing", "data:\n  kind: text\n  path: {MISSING}\nmodel:\n  vocab_size: 256\n", {},
       {"data.path: cannot open '{MISSING}': No such file or directory"}},
      {"TextPathIsADirectory", "data:\n  kind: text\n  path: {ROOT}\nmodel:\n  vocab_size: 256\n", {},
       {"data.path: '{ROOT}' is a directory, not a text file"}},
      {"TextPathTooShort", "data:\n  kind: text\n  path: {TINY}\nmodel:\n  vocab_size: 256\n", {},
       {"data.path: '{TINY}' has 2 bytes; model.seq_len 32 needs at least 33"}},
      {"TextHeldOutTooShort",
       "data:\n  kind: text\n  path: {CFG}\n  eval_fraction: 0.01\nmodel:\n  vocab_size: 256\n", {},
       {"data.eval_fraction 0.01 splits '{CFG}'", "held-out bytes; each part needs at least"}},
      {"EvalWithoutHeldOutData", "train:\n  eval_every: 5\n", {},
       {"train.eval_every (5, {CFG}:6) needs held-out data", "data.eval_fraction"}},
      {"InitFromMissing", "model:\n  init_from: {MISSING}\n", {},
       {"model.init_from: cannot open '{MISSING}': No such file or directory"}},
      {"InitFromIsADirectory", "model:\n  init_from: {ROOT}\n", {},
       {"model.init_from: '{ROOT}' is not a file"}},
      {"InitFromIsNotAWeightsFile", "model:\n  init_from: {CFG}\n", {},
       {"model.init_from: {CFG}"}},
      {"AbsurdModel", "model:\n  d_model: 1000000\n  n_heads: 1\n  n_layers: 1000\n", {},
       {"model (gpt, model.d_model 1000000, model.n_layers 1000", "needs about", "per rank",
        "but this machine has", "available"}},
      {"CheckpointDirIsAFile", "!run:\n  dir: {RUN}\ncheckpoint:\n  dir: {CFG}\n", {},
       {"checkpoint.dir: '{CFG}' is a file, not a directory"}},
      {"RunDirUnderAFile", "!run:\n  dir: {CFG}/run\ncheckpoint:\n  dir: {CKPT}\n", {},
       {"run.dir: cannot create '{CFG}/run': '{CFG}' is not a directory"}},
      {"ResumePathMissing", "  resume: {MISSING}\n", {}, {"checkpoint.resume: ", "{MISSING}"},
       {"checkpoint.resume: checkpoint.resume"}},
  };
}

std::string substitute(std::string s, const std::map<std::string, std::string>& vars) {
  for (const auto& [k, v] : vars) {
    for (size_t p = s.find(k); p != std::string::npos; p = s.find(k, p + v.size())) s.replace(p, k.size(), v);
  }
  return s;
}

struct CaseResult {
  std::string failure;  // "" when the case behaved
};

CaseResult run_case(const BadConfig& c) {
  const fs::path root = fresh_dir("config_" + std::string(c.name));
  const fs::path cfg = root / "cfg.yaml";
  const std::map<std::string, std::string> vars = {{"{RUN}", (root / "run").string()},
                                                   {"{CKPT}", (root / "ckpt").string()},
                                                   {"{CFG}", cfg.string()},
                                                   {"{MISSING}", (root / "missing.yaml").string()},
                                                   {"{ROOT}", root.string()},
                                                   {"{TINY}", (root / "tiny.txt").string()}};
  std::ofstream(root / "tiny.txt") << "ab";
  std::string yaml = c.yaml.rfind("!", 0) == 0 ? c.yaml.substr(1) : std::string(kBase) + c.yaml;
  std::ofstream(cfg) << substitute(yaml, vars);
  // Through test_fork (comm/fork_server.h): forked from a train loaded once.
  std::vector<std::string> argv{testing_support::binary_dir() + "/test_fork", train_binary(), "--config",
                                cfg.string(), "--nproc", "2"};
  for (const auto& a : c.args) {
    if (a == "--config") argv.erase(argv.begin() + 2, argv.begin() + 4);
    argv.push_back(substitute(a, vars));
  }
  // "--nproc 0" must replace, not follow, the default "--nproc 2".
  if (c.args.size() == 2 && c.args[0] == "--nproc") argv.erase(argv.begin() + 4, argv.begin() + 6);
  RunResult r = run_process(argv, {}, 120, (root / "train.log").string());
  std::ostringstream why;
  if (r.exit_code != 2) why << "exit " << r.exit_code << " (want 2); ";
  for (const auto& e : c.expect) {
    const std::string want = substitute(e, vars);
    if (!contains(r.output, want)) why << "missing \"" << want << "\"; ";
  }
  for (const auto& a : c.absent) {
    if (contains(r.output, substitute(a, vars))) why << "has \"" << a << "\"; ";
  }
  if (contains(r.output, "frame #") || contains(r.output, "Exception raised from"))
    why << "has a stack trace; ";
  // One message: the launcher checks once, no rank repeats it.
  if (contains(r.output, "[rank ")) why << "a rank started; ";
  if (fs::exists(root / "run")) why << "run.dir was created; ";
  if (fs::exists(root / "ckpt")) why << "checkpoint.dir was created; ";
  if (contains(r.output, "terminate called") || contains(r.output, "Aborted")) why << "crashed; ";
  if (!why.str().empty()) return {why.str() + "output: " + tail(r.output, 800)};
  fs::remove_all(root);
  return {};
}

TEST(ConfigRobustness, EveryBadConfigExits2NamingTheKeyAndCreatesNothing) {
  const auto cases = bad_configs();
  ASSERT_GE(cases.size(), 30u);
  // Four at a time: each process mostly waits for LibTorch to load.
  std::vector<std::future<CaseResult>> results;
  std::vector<std::string> failures;
  for (size_t i = 0; i < cases.size(); i += 4) {
    std::vector<std::future<CaseResult>> batch;
    for (size_t j = i; j < std::min(cases.size(), i + 4); ++j) {
      batch.push_back(std::async(std::launch::async, run_case, cases[j]));
    }
    for (size_t j = 0; j < batch.size(); ++j) {
      CaseResult r = batch[j].get();
      if (!r.failure.empty()) failures.push_back(std::string(cases[i + j].name) + ": " + r.failure);
    }
  }
  std::cout << cases.size() << " bad configs, " << failures.size() << " misbehaved" << std::endl;
  for (const auto& f : failures) ADD_FAILURE() << f;
}

}  // namespace
}  // namespace reliability
