#include "framework/train/preflight.h"

#include "framework/cp/sequence_split.h"
#include "models/model_spec.h"
#include "framework/config/run_items.h"

#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/codec/transforms.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/interop/dcp.h"
#include "checkpoint/interop/hf.h"
#include "checkpoint/interop/weights_file.h"
#include "checkpoint/load.h"
#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/tiers/local_tier.h"
#include "comm/launch_env.h"
#include "framework/tokenizer/tokenizer.h"
#include "framework/data/dataset.h"
#include "framework/data/text_dataset.h"
#include "comm/device.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/sharded_adamw.h"
#include "framework/pp/schedule.h"
#include "models/layered_model.h"

#include <c10/util/Exception.h>

#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace framework::train {

namespace {

[[noreturn]] void fail(const std::string& message) { throw PreflightError(message); }

std::string quoted(const std::string& path) { return "'" + path + "'"; }

std::string mib(double bytes) {
  char buf[64];
  if (bytes >= 1024.0 * 1024 * 1024 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.3g TiB", bytes / (1024.0 * 1024 * 1024 * 1024));
  } else if (bytes >= 1024.0 * 1024 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.1f GiB", bytes / (1024.0 * 1024 * 1024));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", bytes / (1024.0 * 1024));
  }
  return buf;
}

// The closest existing ancestor of `path` (itself if it exists).
std::string existing_ancestor(std::string path) {
  struct stat st {};
  while (!path.empty() && ::stat(path.c_str(), &st) != 0) {
    const size_t slash = path.find_last_of('/');
    if (slash == std::string::npos) return ".";
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
  return path.empty() ? "." : path;
}

// `key`'s directory exists (or can be made under a writable directory) and
// can be written by this user. Creates nothing.
void check_writable_dir(const std::string& key, const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) fail(key + ": " + quoted(dir) + " is a file, not a directory");
    if (::access(dir.c_str(), W_OK | X_OK) != 0)
      fail(key + ": " + quoted(dir) + " is not writable: " + std::strerror(errno));
    return;
  }
  const std::string parent = existing_ancestor(dir);
  if (::stat(parent.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    fail(key + ": cannot create " + quoted(dir) + ": " + quoted(parent) + " is not a directory");
  if (::access(parent.c_str(), W_OK | X_OK) != 0)
    fail(key + ": cannot create " + quoted(dir) + ": " + quoted(parent) +
         " is not writable: " + std::strerror(errno));
}

void check_data(const config::Config& cfg) {
  if (cfg.data.kind == data::DataKind::kText) {
    try {
      data::check_text_file(cfg.data.path, cfg.model.seq_len, cfg.data.eval_fraction);
    } catch (const std::invalid_argument& e) {
      fail(e.what());
    }
  }
  const bool tokenizer = !cfg.data.tokenizer.empty() && cfg.data.tokenizer != "bytes";
  if (tokenizer && cfg.data.kind == data::DataKind::kSynthetic)
    fail("data.tokenizer is read only when data.kind is text, tokens or sft");
  if (tokenizer && cfg.data.kind == data::DataKind::kTokens) {
    try {  // the shards' tokenizer: it must load and fit the model
      const auto tok = tokenizer::load_tokenizer(cfg.data.tokenizer);
      if (tok->vocab_size() > cfg.model.vocab_size)
        fail("data.tokenizer " + tok->describe() + " has more tokens than model.vocab_size " +
             std::to_string(cfg.model.vocab_size));
    } catch (const tokenizer::TokenizerError& e) {
      fail(std::string("data.tokenizer: ") + e.what());
    }
  }
  if (cfg.data.kind != data::DataKind::kText || tokenizer) {
    try {
      // Synthetic data is generated from the seed: cheap to build here.
      // Token shards are mapped and their headers checked, and with
      // data.check_tokens every token id is read once (remembered for the
      // process, so the trainer does not read them again). A text file with
      // data.tokenizer is tokenized (small runs: each rank does it again).
      data::make_dataset(cfg.data, cfg.model, static_cast<uint64_t>(cfg.run.seed));
    } catch (const c10::Error& e) {
      fail(e.what_without_backtrace());
    } catch (const std::invalid_argument& e) {  // data::DataError: names the file and offset
      fail(e.what());
    }
  }
}

void check_init_from(const config::Config& cfg) {
  const std::string& path = cfg.model.init_from;
  if (path.empty()) return;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    fail("model.init_from: cannot open " + quoted(path) + ": " + std::strerror(errno));
  const bool dir = S_ISDIR(st.st_mode) &&
                   (checkpoint::is_dcp_checkpoint(*checkpoint::posix_storage(), path) ||
                    checkpoint::is_hf_model_dir(*checkpoint::posix_storage(), path));
  if (!S_ISREG(st.st_mode) && !dir)
    fail("model.init_from: " + quoted(path) +
         " is not a file (a safetensors or torch.save file of full weights), a PyTorch DCP "
         "checkpoint directory nor a Hugging Face model directory (model.safetensors or "
         "model.safetensors.index.json)");
  if (::access(path.c_str(), R_OK) != 0)
    fail("model.init_from: cannot read " + quoted(path) + ": " + std::strerror(errno));
  try {
    // Only its header (safetensors), directory and index (torch.save), or
    // metadata and archive directories (DCP); and a Hugging Face mixture of
    // experts' per-expert tensors, that they stack into ours.
    checkpoint::WeightsFile::open(path).renamed(config::hf_renames(cfg.model));
  } catch (const checkpoint::FormatError& e) {
    fail(std::string("model.init_from: ") + e.what());
  } catch (const checkpoint::IoError& e) {
    fail(std::string("model.init_from: ") + e.what());
  }
}

void check_memory(const config::Config& cfg, const MemoryEstimate& m, int local_ranks) {
  if (cfg.train.device == comm::DeviceKind::kCuda) {
    // Everything but the host staging lives on the rank's GPU.
    const double device_bytes = comm::cuda_device_total_bytes(0);
    const double need = m.total() - m.host_only();
    if (device_bytes > 0 && need > device_bytes) {
      std::ostringstream msg;
      msg << "model (" << cfg.model.kind << ", model.d_model " << cfg.model.d_model
          << ", model.n_layers " << cfg.model.n_layers << ", model.vocab_size "
          << cfg.model.vocab_size << ", model.seq_len " << cfg.model.seq_len << ") needs about "
          << mib(need) << " of GPU memory per rank (" << describe(m)
          << "), but the GPU has " << mib(device_bytes)
          << "; make the model or train.global_batch_size smaller, or shard it over more GPUs";
      fail(msg.str());
    }
    // The host holds the staging buffers (pinned) only.
    const std::optional<double> available = available_memory_bytes();
    if (available && m.host_only() * local_ranks > *available) {
      fail("checkpoint staging and the local tier need about " + mib(m.host_only() * local_ranks) +
           " of host memory for " + std::to_string(local_ranks) + " ranks, but this machine has " +
           mib(*available) + " available; use checkpoint.mode: sync");
    }
    return;
  }
  const std::optional<double> available = available_memory_bytes();
  if (!available) return;
  const double need = m.total() * local_ranks;
  if (need <= *available) return;
  std::ostringstream msg;
  msg << "model (" << cfg.model.kind << ", model.d_model " << cfg.model.d_model
      << ", model.n_layers " << cfg.model.n_layers << ", model.vocab_size " << cfg.model.vocab_size
      << ", model.seq_len " << cfg.model.seq_len << ") needs about " << describe(m)
      << " per rank";
  if (local_ranks > 1) msg << ", x " << local_ranks << " ranks on this machine = " << mib(need);
  msg << ", but this machine has " << mib(*available)
      << " available; make the model or train.global_batch_size smaller, or use more machines";
  fail(msg.str());
}

std::string checkpoint_dir_of(const config::Config& cfg) {
  return cfg.checkpoint.dir.empty() ? cfg.run.dir + "/checkpoints" : cfg.checkpoint.dir;
}

}  // namespace

ResumeSource resume_source(const config::Config& cfg) {
  const std::string& resume = cfg.checkpoint.resume;
  checkpoint::Storage& storage = *checkpoint::posix_storage();
  if (checkpoint::resume_request(resume) != checkpoint::ResumeRequest::kPath ||
      !checkpoint::is_dcp_checkpoint(storage, resume)) {
    return ResumeSource::kConfig;
  }
  return checkpoint::latest_committed(storage, checkpoint_dir_of(cfg)) ? ResumeSource::kAutoAfterDcp
                                                                       : ResumeSource::kDcp;
}

namespace {

// The saved config of a committed checkpoint, or nullopt if it is damaged
// (resume's fallback deals with that, loudly).
// A bytes item of the checkpoint (empty when it has none); nullopt when
// the checkpoint is damaged.
std::optional<std::string> saved_bytes_item(const std::string& step_dir, const std::string& name) {
  checkpoint::StateDict sd;
  sd.add_bytes(name, {});
  checkpoint::LoadOptions options;
  options.allow_partial = true;
  options.filter = [&name](const std::string& n) { return n == name; };
  options.io_threads = 1;
  try {
    checkpoint::load_state_dict(sd, step_dir, options);
  } catch (const checkpoint::DamageError&) {  // checkpoint/errors.h: is_damage()
    return std::nullopt;
  }
  const auto& bytes = sd.find_bytes(name)->data;
  return std::string(bytes.begin(), bytes.end());
}

std::optional<std::string> saved_config(const std::string& step_dir) {
  return saved_bytes_item(step_dir, config::kConfigItem);
}

// A LoRA run resumes onto the base its adapters were trained on: the
// weights of model.init_from must hash as the checkpoint's lora.base says.
void check_lora_base(const config::Config& cfg, const std::string& path) {
  const std::optional<std::string> bytes = saved_bytes_item(path, config::kLoraBaseItem);
  if (!bytes || bytes->empty()) return;  // damaged (resume names it) or not a LoRA checkpoint
  config::LoraBase saved;
  try {
    saved = config::decode_lora_base(*bytes, path);
  } catch (const std::exception& e) {
    fail(std::string("checkpoint.resume: ") + e.what());
  }
  const std::string& init_from = cfg.model.init_from;
  const std::string saved_text =
      saved.path.empty() ? std::string("a base initialised at random from run.seed")
                         : "the base '" + saved.path + "' (" + saved.hash + ")";
  if (init_from.empty()) {
    if (saved.path.empty()) return;
    fail("checkpoint.resume: " + path + " holds LoRA adapters trained on " + saved_text +
         "; set model.init_from to that base");
  }
  if (saved.path.empty()) {
    fail("model.init_from '" + init_from + "': " + path + " holds LoRA adapters trained on " + saved_text +
         ", not on model.init_from");
  }
  std::string hash;
  try {
    hash = checkpoint::weights_content_hash(init_from);
  } catch (const std::exception& e) {
    fail("model.init_from: " + std::string(e.what()));
  }
  if (hash != saved.hash) {
    fail("model.init_from '" + init_from + "' has weights " + hash + ", not those of " + saved_text +
         " that the LoRA adapters of " + path + " were trained on");
  }
}

// checkpoint.resume: never refuses a checkpoint.dir that holds committed
// checkpoints of an earlier run.
void refuse_earlier_checkpoints(checkpoint::Storage& storage, const std::string& dir) {
  std::string found;
  int count = 0;
  for (const auto& e : checkpoint::list_checkpoints(storage, dir)) {
    if (!e.committed) continue;
    found += (count++ ? ", " : "") + checkpoint::step_dir_name(e.step);
  }
  if (count > 0)
    fail("checkpoint.resume: never, but checkpoint.dir " + quoted(dir) +
         " already holds committed checkpoints of an earlier run (" + found +
         "); this run would overwrite and prune them and a later resume would mix the two. "
         "Resume them (checkpoint.resume: auto), choose another run.dir, or delete them");
}

// checkpoint.resume: auto: the committed steps, newest first; with a local
// tier, this node's committed local steps too (a local step before the
// durable one of the same step), so that the config compared is the one
// resume most likely loads.
std::vector<std::string> auto_resume_candidates(const config::Config& cfg,
                                                checkpoint::Storage& storage,
                                                const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> steps;
  for (const auto& e : checkpoint::list_checkpoints(storage, dir)) {
    if (e.committed) steps.emplace_back(2 * e.step, e.path);
  }
  if (!cfg.checkpoint.local.dir.empty()) {
    const std::string pattern = config::local_tier_pattern(cfg);
    int node = 0;
    try {
      node = comm::detect_launch_env(comm::process_env()).node;
    } catch (const std::exception&) {
      // The rank reports a malformed environment itself.
    }
    try {
      for (const auto& e : checkpoint::list_checkpoints(storage, checkpoint::local_tier_dir(pattern, node))) {
        if (e.committed) steps.emplace_back(2 * e.step + 1, e.path);
      }
    } catch (const std::exception&) {
      // An unreadable local tier: resume reports it.
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  std::vector<std::string> candidates;
  for (const auto& [key, path] : steps) candidates.push_back(path);
  return candidates;
}

// The checkpoint at `path`, saved with the config `yaml`, is what resume
// loads: a run with other settings fails, unless only allowed keys changed
// or checkpoint.allow_config_change (then a warning).
void check_saved_config(const config::Config& cfg, const std::string& path,
                        const std::string& yaml, PreflightReport& report) {
  const auto& ck = cfg.checkpoint;
  report.resume_from = path;
  if (yaml.empty()) return;  // imported (ckpt import-dcp): no config to compare
  const std::vector<std::string> changes =
      resume_conflicts(yaml, path + " (its saved config)", cfg, ck.model_only);
  if (changes.empty()) {
    // Allowed changes are still worth a line: a resumed run with another
    // train.steps follows another LR schedule.
    const std::vector<std::string> allowed = resume_changes(yaml, path, cfg);
    if (!allowed.empty()) {
      std::string list;
      for (size_t i = 0; i < allowed.size(); ++i) list += (i ? ", " : "") + allowed[i];
      report.warnings.push_back("resuming " + path + " with changed settings: " + list);
    }
    return;
  }
  std::string list;
  for (size_t i = 0; i < changes.size(); ++i) list += (i ? ", " : "") + changes[i];
  if (ck.allow_config_change) {
    report.warnings.push_back("resuming " + path + " although it was saved with other settings: " +
                              list + " (checkpoint.allow_config_change)");
    return;
  }
  fail("checkpoint.resume: " + path + " was saved by a run with other settings: " + list +
       ". Resuming it would mix two runs: use another run.dir for a new run, set these keys "
       "back, or set checkpoint.allow_config_change: true to resume anyway");
}

void check_resume(const config::Config& cfg, PreflightReport& report) {
  const auto& ck = cfg.checkpoint;
  const std::string dir = checkpoint_dir_of(cfg);
  checkpoint::Storage& storage = *checkpoint::posix_storage();
  std::vector<std::string> candidates;
  const checkpoint::ResumeRequest request = checkpoint::resume_request(ck.resume);
  if (request == checkpoint::ResumeRequest::kNever) {
    refuse_earlier_checkpoints(storage, dir);
    return;
  }
  const ResumeSource source = resume_source(cfg);
  if (source == ResumeSource::kDcp) {
    try {  // PyTorch DCP: its metadata must read; it carries no config to compare
      checkpoint::read_dcp_metadata(storage, ck.resume);
    } catch (const std::exception& e) {
      fail(std::string("checkpoint.resume: ") + e.what());
    }
    report.resume_from = ck.resume;
    return;
  }
  if (request == checkpoint::ResumeRequest::kAuto || source == ResumeSource::kAutoAfterDcp) {
    candidates = auto_resume_candidates(cfg, storage, dir);
  } else {
    try {
      candidates.push_back(*checkpoint::resolve_resume(storage, ck.resume, dir));
    } catch (const std::runtime_error& e) {
      const std::string what = e.what();
      fail(what.rfind("checkpoint.resume", 0) == 0 ? what : "checkpoint.resume: " + what);
    }
  }
  for (const std::string& path : candidates) {
    std::optional<std::string> yaml = saved_config(path);
    if (!yaml) {
      if (request == checkpoint::ResumeRequest::kAuto && ck.resume_fallback) continue;  // resume sets it aside
      return;  // resume fails naming the damage
    }
    check_saved_config(cfg, path, *yaml, report);
    if (cfg.model.lora.rank > 0) check_lora_base(cfg, path);
    return;
  }
}

}  // namespace

bool local_tier_in_memory(const std::string& dir_pattern) {
  namespace fs = std::filesystem;
  if (dir_pattern.empty()) return false;
  fs::path dir = fs::path(dir_pattern.substr(0, dir_pattern.find('{'))).lexically_normal();
  std::error_code ec;
  while (!dir.empty() && !fs::is_directory(dir, ec)) dir = dir.parent_path();
  struct statfs st {};
  if (dir.empty() || ::statfs(dir.c_str(), &st) != 0) return false;
  constexpr long kTmpfsMagic = 0x01021994, kRamfsMagic = static_cast<long>(0x858458f6);
  return static_cast<long>(st.f_type) == kTmpfsMagic || static_cast<long>(st.f_type) == kRamfsMagic;
}

MemoryEstimate estimate_memory(const config::Config& cfg, int world_size, int nodes) {
  const models::ModelSize size = models::model_size(cfg.model);
  double shard = 1, tensor = 1, expert = 1, context = 1;
  try {
    const parallel::Layout layout = parallel::resolve(cfg.parallel, world_size);
    shard = static_cast<double>(layout.shard);
    tensor = static_cast<double>(layout.tensor);
    expert = static_cast<double>(layout.expert);
    context = static_cast<double>(layout.context);
  } catch (const std::invalid_argument&) {
  }
  // Expert parallelism: a rank gathers only its share of a block's routed
  // experts (over its expert_shard group).
  double largest_unit = size.largest_unit;
  if (expert > 1 && size.routed_experts_per_block > 0) {
    largest_unit = std::max(size.outside_blocks,
                            size.largest_block - size.routed_experts_per_block * (1 - 1 / expert));
  }
  MemoryEstimate m;
  constexpr double kFloat = 4;
  // Module parameters, their gradients and activations are in param_dtype;
  // shards, shard gradients and AdamW in fp32; the loss in fp32.
  const bool bf16 = cfg.train.mixed_precision.param_dtype == fsdp::PrecisionDtype::kBf16;
  const double compute = bf16 ? 2 : kFloat;
  // Tensor parallelism splits nearly every parameter (all but the norms)
  // over the tensor axis before FSDP shards each part; a mixture of
  // experts' routed experts stay whole on every tensor rank.
  // A pipeline stage holds about 1 / pipeline of the parameters.
  const double stages = static_cast<double>(std::max<int64_t>(1, cfg.parallel.pipeline));
  const double moe_blocks =
      cfg.model.moe.num_experts > 0 ? static_cast<double>(cfg.model.n_layers - cfg.model.moe.first_dense_layers) : 0;
  const double whole_on_tp = tensor > 1 ? size.routed_experts_per_block * moe_blocks : 0;
  m.params = ((size.parameters - whole_on_tp) / tensor + whole_on_tp) / (shard * stages) * kFloat;
  m.grads = m.params;
  m.optimizer = 2 * m.params;
  if (cfg.model.lora.rank > 0) {
    // LoRA: only the adapters have gradients and AdamW state.
    const double adapters = models::lora_parameter_count(cfg.model);
    m.grads = adapters / (shard * tensor * stages) * kFloat;
    m.optimizer = 2 * m.grads;
    // model.lora.base_dtype bf16: the frozen base's shards in 2 bytes.
    if (cfg.model.lora.base_dtype == "bf16") m.params = (size.parameters * 2 + adapters * kFloat) / (shard * tensor * stages);
  }
  if (shard > 1) {
    // Parameters and gradients of the unit in backward; with prefetch N,
    // N more units gathered ahead and up to N reductions' buffers in flight.
    const double prefetch = static_cast<double>(std::max<int64_t>(cfg.parallel.prefetch, 0));
    // (A mixture of experts' block is not split by tensor parallelism.)
    m.gathered = (2 + 2 * prefetch) * largest_unit / (whole_on_tp > 0 ? 1 : tensor) * compute;
  } else if (bf16) {
    m.gathered = 2 * size.parameters / tensor * compute;  // DDP: bf16 parameters and gradients beside the masters
  }
  // The ranks of a TP group share a batch, and a context group's its
  // sequences, each member holding 1 / context of every sequence's tokens.
  const double per_rank_batch = std::ceil(static_cast<double>(cfg.train.global_batch_size) /
                                          std::max(1.0, world_size / (tensor * stages * context)));
  const double micro = cfg.train.micro_batch_size > 0
                           ? std::min(per_rank_batch, static_cast<double>(cfg.train.micro_batch_size))
                           : per_rank_batch;
  // A checkpointed block keeps only its input (seq_len x d_model) until its
  // backward recomputes it, one block at a time.
  const double layers = static_cast<double>(cfg.model.n_layers);
  const double block = size.block_activation_floats_per_sample;
  const double head = size.activation_floats_per_sample - layers * block;
  const double input = static_cast<double>(cfg.model.seq_len * cfg.model.d_model);
  double checkpointed = 0;
  switch (cfg.model.activation_checkpointing) {
    case models::ActivationCheckpointing::kNone: break;
    case models::ActivationCheckpointing::kFull: checkpointed = layers; break;
    case models::ActivationCheckpointing::kSelective:
      checkpointed = std::ceil(layers / static_cast<double>(cfg.model.activation_checkpointing_every));
      break;
  }
  const double blocks = (layers - checkpointed) * block + checkpointed * input +
                        (checkpointed > 0 ? block : 0);
  // Every activation kept is per token (ring attention keeps no score
  // matrix), so a context-parallel rank keeps 1 / context of them.
  m.activations = micro * (blocks * compute + head * kFloat) / context;
  if (stages > 1) {
    // A stage runs 1 / pipeline of the blocks, and holds the activations of
    // up to pipeline micro-batches (1f1b, interleaved) or all of them (gpipe).
    const double micro_batches = std::max(1.0, std::floor(per_rank_batch / micro));
    const double held = cfg.parallel.pipeline_schedule == pp::Schedule::kGpipe ? micro_batches
                                                                             : std::min(micro_batches, stages);
    m.activations = micro * held * (blocks / stages * compute + head * kFloat);
  }
  const bool staged =
      cfg.checkpoint.interval != 0 && cfg.checkpoint.mode != checkpoint::SaveMode::kSync;
  m.staging = staged ? m.params + m.optimizer : 0;
  const std::string local_dir = config::local_tier_pattern(cfg);
  if (cfg.checkpoint.interval != 0 && local_tier_in_memory(local_dir)) {
    // keep_last 0 keeps every checkpoint of the run (interval auto: up to
    // one a step).
    const int64_t interval = cfg.checkpoint.interval == checkpoint::kIntervalAuto ? 1 : cfg.checkpoint.interval;
    const int64_t saves = (cfg.train.steps + interval - 1) / interval;
    const int64_t keep = cfg.checkpoint.local.keep_last > 0 ? std::min(cfg.checkpoint.local.keep_last, saves) : saves;
    const double copies = cfg.checkpoint.local.partner && nodes > 1 ? 2 : 1;
    m.local_tier = (m.params + m.optimizer) * static_cast<double>(keep + 1) * copies;
  }
  return m;
}

void check_pipeline_sampling(const config::Config& cfg) {
  if (cfg.parallel.pipeline <= 1 || cfg.train.sample_every <= 0) return;
  fail("train.sample_every " + std::to_string(cfg.train.sample_every) +
       " generates on one whole model; set it 0 with parallel.pipeline " + std::to_string(cfg.parallel.pipeline));
}

void check_parallel(const config::Config& cfg, int world_size) {
  const auto& par = cfg.parallel;
  try {
    const parallel::Layout layout = parallel::resolve(par, world_size);
    models::check_tensor_parallel_plan(cfg.model, layout.tensor);
    models::check_expert_parallel(cfg.model, layout.expert);
    models::check_context_parallel(cfg.model, layout.context);
    parallel::split_batch(par, layout, cfg.train.global_batch_size, cfg.train.micro_batch_size);
    if (layout.pipeline == 1) return;
    models::check_pipeline_support(cfg.model, layout.pipeline);
    const models::ModelSpec& spec = models::find_model_spec(cfg.model.kind);
    check_pipeline_sampling(cfg);
    // The blocks by name, from the model built without storage (llama) or
    // its block count: what the split points must name.
    std::vector<std::string> blocks;
    if (spec.lazy_init) {
      blocks = spec.build(cfg.model, false)->unit_names();
    } else {
      for (int64_t i = 0; i < cfg.model.n_layers; ++i) blocks.push_back("blocks." + std::to_string(i));
    }
    pp::split_blocks(blocks, par.pipeline * par.stages_per_rank, par.pipeline_split_points);
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
}

std::vector<ContextActivations> activations_by_context(const config::Config& cfg, int world_size) {
  std::vector<ContextActivations> out;
  const int64_t configured = std::max<int64_t>(1, cfg.parallel.context);
  for (int64_t c : {1, 2, 4, 8}) {
    ContextActivations row;
    row.context = c;
    try {
      cp::check_sequence_split(cfg.model.seq_len, c, cfg.parallel.context_load_balance);
    } catch (const std::invalid_argument&) {
      row.splits = false;
      out.push_back(row);
      continue;
    }
    // The same ranks over the batch, each sequence over c of them.
    config::Config as = cfg;
    as.parallel.context = c;
    as.parallel.expert = 1;  // a rank's activations do not depend on it
    if (as.parallel.shard > 0) as.parallel.shard = as.parallel.shard / configured * c;
    const int world = static_cast<int>(world_size / configured * c);
    row.bytes = estimate_memory(as, world).activations;
    out.push_back(row);
  }
  return out;
}

std::string describe(const MemoryEstimate& m) {
  return mib(m.total()) + " (params " + mib(m.params) + ", grads " + mib(m.grads) +
         ", optimizer " + mib(m.optimizer) + ", gathered unit " + mib(m.gathered) +
         ", activations " + mib(m.activations) + ", checkpoint staging " + mib(m.staging) +
         (m.local_tier > 0 ? ", local tier in memory " + mib(m.local_tier) : std::string()) + ")";
}

std::optional<double> available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return std::nullopt;
}

std::vector<std::string> resume_conflicts(const std::string& saved_yaml, const std::string& source,
                                          const config::Config& cfg, bool model_only) {
  config::Config saved;
  try {
    saved = config::parse_config(saved_yaml, source);
  } catch (const config::ConfigError& e) {
    fail(std::string("checkpoint.resume: cannot compare with the checkpoint's config: ") +
         e.what());
  }
  std::vector<std::string> prefixes = {"model."};
  if (!model_only) {
    prefixes.insert(prefixes.end(), {"data.", "run.seed", "train.global_batch_size"});
  }
  std::vector<std::string> out;
  for (const config::KeyChange& c : config::changed_keys(saved, cfg, prefixes)) {
    if (c.key == "model.init_from") continue;  // ignored when resuming
    out.push_back(c.key + " (" + c.was + " -> " + c.now + ")");
  }
  return out;
}

void check_directories(const config::Config& cfg) {
  check_writable_dir("run.dir", cfg.run.dir);
  // save_on_signal saves even with checkpoint.interval 0.
  check_writable_dir(cfg.checkpoint.dir.empty() ? "checkpoint.dir (<run.dir>/checkpoints)"
                                                : "checkpoint.dir",
                     checkpoint_dir_of(cfg));
}

std::vector<std::string> resume_changes(const std::string& saved_yaml, const std::string& source,
                                        const config::Config& cfg) {
  config::Config saved;
  try {
    saved = config::parse_config(saved_yaml, source);
  } catch (const config::ConfigError&) {
    return {};  // resume_conflicts reported it
  }
  std::vector<std::string> out;
  for (const config::KeyChange& c :
       config::changed_keys(saved, cfg, {"train.steps", "train.stop_at", "optim.", "parallel."})) {
    out.push_back(c.key + " (" + c.was + " -> " + c.now + ")");
  }
  return out;
}

// train.optimizer_impl names an implementation this LibTorch has (fused:
// 2.4+), before any rank starts.
static void check_optimizer(const config::Config& cfg) {
  try {
    optim::resolve_adamw_impl(cfg.train.optimizer_impl, torch::kCPU);
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
}

PreflightReport preflight(const config::Config& cfg, int world_size, int local_ranks) {
  PreflightReport report;
  check_directories(cfg);
  check_optimizer(cfg);
  check_parallel(cfg, world_size);
  try {
    models::check_lora_support(cfg.model);
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  check_data(cfg);
  report.memory = estimate_memory(cfg, world_size);
  check_memory(cfg, report.memory, std::max(1, local_ranks));
  check_resume(cfg, report);
  // A LoRA run reads its base from model.init_from when it resumes too.
  if (!report.resume_from || cfg.model.lora.rank > 0) check_init_from(cfg);
  return report;
}

}  // namespace framework::train
