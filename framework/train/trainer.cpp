// The Trainer's loop (trainer_state.h): a step, the policy after it
// (logging, checkpoints, evaluation, samples), run(). The wiring is
// trainer_setup.cpp; the checkpoint policy is the manager's
// (CheckpointManager::save_if_due).
#include "framework/train/trainer_state.h"

#include <ATen/record_function.h>
#include "checkpoint/storage/direct_io.h"
#include "checkpoint/timing.h"
#include "comm/device.h"
#include "framework/data/sampler.h"
#include "framework/train/state_dict.h"
#include "framework/train/train_seam.h"
#include "models/generate.h"
#include "models/layered_model.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

namespace framework::train {

namespace fs = std::filesystem;
using checkpoint::seconds_since;
using detail::Clock;
using detail::LocalLoss;
using detail::MicroBatches;
using detail::RunSpan;
using detail::StepStats;
using detail::kStepStatsSlots;

namespace test_seam {

namespace {
std::function<void(int64_t step, int rank)> before_step_callback;  // tests only
}  // namespace

void set_before_step(std::function<void(int64_t step, int rank)> callback) {
  before_step_callback = std::move(callback);
}

void before_step(int64_t step, int rank) {
  if (before_step_callback) before_step_callback(step, rank);
}

}  // namespace test_seam

namespace {

// This process's peak resident set (VmHWM), MiB; 0 where unknown.
double peak_rss_mib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::strtod(line.c_str() + 6, nullptr) / 1024.0;
  }
  return 0;
}


// On `device`: the loss and token count are not read back before the reduce.
// `counts` 0: this rank's loss and tokens duplicate another's (a tensor-
// parallel rank other than the first of its group).
torch::Tensor pack_step_stats(const LocalLoss& local, bool stop_requested, bool ckpt_busy,
                              torch::Device device, bool counts = true) {
  torch::Tensor flags = torch::tensor(
      {static_cast<double>(stop_requested), static_cast<double>(ckpt_busy)}, torch::kDouble);
  const double weight = counts ? 1.0 : 0.0;
  return torch::cat({local.sum.detach().to(torch::kDouble).reshape({1}) * weight,
                     local.tokens.to(torch::kDouble).reshape({1}) * weight, flags.to(device)});
}

StepStats unpack_step_stats(const torch::Tensor& reduced) {
  torch::Tensor host = reduced.to(torch::kCPU);
  TORCH_INTERNAL_ASSERT(host.numel() == kStepStatsSlots, "step stats: ", host.numel(), " values");
  auto v = host.accessor<double, 1>();
  return {v[0], v[1], v[2], v[3]};
}

}  // namespace

// Everything a resumed run needs, as named items (state_dict.h).
checkpoint::StateDict Trainer::State::make_state_dict() {
  RunRecords records;
  records.lora_base = lora_base;
  // The loss of the step saved (a save follows its step's record).
  if (!history.empty() && history.back().step == step) records.last_loss = history.back().loss;
  records.data = &identity_of_data();
  records.device = device;
  return get_run_state_dict(*fsdp, *optim, *loader, step, cfg, records);
}

const DataIdentity& Trainer::State::identity_of_data() {
  if (!data_identity) data_identity = data_identity_of(loader->dataset(), loader->state());
  return *data_identity;
}

int64_t Trainer::State::last_step() const {
  const auto& tc = cfg.train;
  return tc.stop_at > 0 ? std::min(tc.stop_at, tc.steps) : tc.steps;
}

// After backward: FSDP's last reduce-scatters, then clipping by the global
// norm. Returns the norm before clipping (0 with train.grad_clip off).
double Trainer::State::finish_gradients() {
  fsdp->finish_backward();
  return cfg.train.grad_clip > 0 ? fsdp->clip_grad_norm(cfg.train.grad_clip) : 0.0;
}

// Returns the learning rate of `to_step`.
double Trainer::State::apply_optimizer_step(int64_t to_step) {
  // Overlap mode: the previous save may still be copying parameters and
  // optimizer state; they change only here.
  ckpt->wait_staged();
  double lr = optim->step(to_step);
  fsdp->zero_grad();
  step = to_step;
  return lr;
}

// The step's gradients, one path for every layout. First the step's small
// all-reduce: the global count of targets that count, and whether any rank
// was asked to stop or is still saving (its host read is the step's first).
// Each micro-batch's loss is normalised by that count, so the gradient is the
// global mean's at any world size and micro-batch size. Then the
// micro-batches' forwards and backwards as the layout runs them
// (run_micro_batches), then the loss sum for the log, in a second small
// all-reduce, counted once per tensor-parallel group (by the last stage).
StepStats Trainer::State::compute_gradients(int64_t to_step) {
  auto [host_inputs, host_targets] = [&] {
    RECORD_USER_SCOPE("shardkit::data");
    auto [inputs, targets] = loader->next();
    // Context parallelism: this rank's part of each sequence; it counts and
    // sums its own tokens only, so the step's all-reduces give the whole
    // sequences' count and loss once.
    return std::make_pair(split_sequence(inputs), split_sequence(targets));
  }();
  MicroBatches batches;
  const int64_t micro = host_inputs.size(0) / micro_batches;
  for (int64_t m = 0; m < micro_batches; ++m) {
    batches.inputs.push_back(host_inputs.narrow(0, m * micro, micro).to(device));
    batches.targets.push_back(host_targets.narrow(0, m * micro, micro).to(device));
  }
  const LocalLoss counted{torch::zeros({}, torch::TensorOptions(torch::kDouble).device(device)),
                          (host_targets != data::kIgnoreIndex).sum().to(device)};
  StepStats global;
  {
    // Every rank leaves this all-reduce at about the same time: a profile's
    // common origin for the ranks' timelines (bench/pipeline_schedules.py).
    RECORD_USER_SCOPE("shardkit::step_stats");
    torch::Tensor stats = pack_step_stats(counted, stop_signal().load() != 0, ckpt->busy(), device, counts_loss());
    test_seam::before_step(to_step, rt.env.rank);
    rt.train->all_reduce(stats);
    global = unpack_step_stats(stats);
  }
  torch::Tensor loss_sum = torch::zeros({1}, torch::TensorOptions(torch::kDouble).device(device));
  run_micro_batches(batches, std::max(1.0, global.tokens), loss_sum);
  if (!moe_names.empty()) {
    // The MoE layers' statistics ride on the same all-reduce: a slot for
    // every layer of the model (a pipeline stage fills its own), each
    // counted once per tensor-parallel group.
    int64_t width = 3;
    std::vector<int64_t> offset;
    for (const MoeLayerName& l : moe_names) {
      offset.push_back(width);
      width += l.experts;
    }
    torch::Tensor stats = torch::zeros({width}, torch::TensorOptions(torch::kDouble).device(device));
    stats.narrow(0, 0, 1).copy_(loss_sum);
    double aux = 0, weight = 0;
    for (size_t i = 0; i < moe.size(); ++i) {
      models::MoeLayerStats st = moe[i]->take_stats();
      aux += st.aux_loss;
      weight += st.aux_weight;
      stats.narrow(0, offset[moe_index[i]], moe_names[moe_index[i]].experts).copy_(st.loads);
    }
    stats.narrow(0, 1, 2).copy_(torch::tensor({aux, weight}, torch::kDouble));
    if (at.tensor != 0) stats.narrow(0, 1, width - 1).zero_();
    loss_sum = stats;
  }
  if (!counts_loss()) loss_sum.narrow(0, 0, 1).zero_();
  rt.train->all_reduce(loss_sum);
  const torch::Tensor host = loss_sum.to(torch::kCPU);
  global.loss_sum = host[0].item<double>();
  if (!moe_names.empty()) moe_step_stats = host.narrow(0, 1, host.size(0) - 1);
  return global;
}

// The layout's part of a step: the pipeline's schedule over this rank's
// stages (pipeline > 1), else the micro-batches in order on this rank's
// whole model (FSDP, DDP, HSDP, TP). Adds this rank's loss sum to
// `loss_sum`; each loss is divided by `global_tokens` before its backward.
void Trainer::State::run_micro_batches(const MicroBatches& batches, double global_tokens, torch::Tensor& loss_sum) {
  if (pipeline.runner) {
    run_pipeline_schedule(batches, global_tokens, loss_sum);
    return;
  }
  // FSDP reduce-scatters every micro-batch's gradients (DDP all-reduces
  // only the last's); the last one's wait is finish_gradients'.
  const size_t n = batches.inputs.size();
  for (size_t m = 0; m < n; ++m) {
    const bool last = m + 1 == n;
    fsdp->set_requires_gradient_sync(last);
    LossSum loss;
    {
      RECORD_USER_SCOPE("shardkit::forward");
      loss = fsdp->forward([&] { return user.loss(batches.inputs[m], batches.targets[m]); });
    }
    {
      RECORD_USER_SCOPE("shardkit::backward");
      (loss.sum / global_tokens).backward();
    }
    if (!last) fsdp->finish_backward();
    loss_sum += loss.sum.detach().to(torch::kDouble);
  }
}

models::LayeredModelImpl::Stage Trainer::State::stage_of(int64_t stage) const {
  models::LayeredModelImpl::Stage out;
  out.first = pipeline.spans[stage].first;
  out.end = pipeline.spans[stage].end;
  out.embed = pipeline.runner->is_first(stage);
  out.head = pipeline.runner->is_last(stage);
  return out;
}

// What goes between pipeline stages: the hidden [micro, T, d_model] in the
// compute dtype.
torch::TensorOptions Trainer::State::activation_options() const {
  const bool bf16 = cfg.train.mixed_precision.param_dtype == fsdp::PrecisionDtype::kBf16;
  return torch::TensorOptions().dtype(bf16 ? torch::kBFloat16 : torch::kFloat).device(device);
}

// Pipeline parallelism: the schedule's forwards and backwards over the
// micro-batches, each stage's FSDP reducing every backward pass (the
// replicate axis's all-reduce once, with the step's last); the last stage
// computes the loss.
void Trainer::State::run_pipeline_schedule(const MicroBatches& batches, double global_tokens,
                                           torch::Tensor& loss_sum) {
  pp::StageCallbacks cb;
  cb.forward = [&](int64_t stage, int64_t m, const torch::Tensor& input) {
    layered->set_stage(stage_of(stage));
    if (!pipeline.runner->is_last(stage)) return fsdp->forward([&] { return layered->forward(input); });
    const LossSum loss = fsdp->forward([&] { return user.loss(input, batches.targets[m]); });
    loss_sum += loss.sum.detach().to(torch::kDouble);
    return loss.sum / global_tokens;
  };
  cb.before_backward = [&](bool last) { fsdp->set_requires_gradient_sync(last); };
  cb.after_backward = [&] { fsdp->end_micro_backward(); };
  const torch::Tensor& first = batches.inputs.front();
  pipeline.runner->run_step(batches.inputs, {first.size(0), first.size(1), cfg.model.d_model}, activation_options(),
                            cb);
  fsdp->set_requires_gradient_sync(true);
}

void Trainer::State::finish_moe_step(StepRecord& rec) {
  const torch::Tensor& st = moe_step_stats;
  // The weight is each layer's (1 over a global batch) summed over the
  // layers: the loss recorded is the mean over the MoE layers.
  const double weight = st[1].item<double>();
  rec.moe_aux_loss = weight > 0 ? st[0].item<double>() / weight : 0.0;
  int64_t pos = 2;
  for (const MoeLayerName& l : moe_names) {
    const torch::Tensor loads = st.narrow(0, pos, l.experts);
    pos += l.experts;
    rec.expert_loads.emplace_back(loads.data_ptr<double>(), loads.data_ptr<double>() + l.experts);
  }
  for (size_t i = 0; i < moe.size(); ++i) {
    const std::vector<double>& loads = rec.expert_loads[moe_index[i]];
    moe[i]->update_bias(torch::tensor(loads, torch::kDouble));
  }
}

StepRecord Trainer::train_step() {
  State& s = *s_;
  TORCH_CHECK(s.step < s.cfg.train.steps, "train_step: already at train.steps (",
              s.cfg.train.steps, ")");
  const int64_t step = s.step + 1;
  auto t0 = Clock::now();
  const double waited_before = s.fsdp->comm_wait_seconds();
  const double pipeline_waited_before = s.pipeline.runner ? s.pipeline.runner->wait_seconds() : 0.0;
  const double all_to_all_before = *s.ep_layout.all_to_all_seconds;
  const cp::RingStats ring_before = *s.ring_stats;
  const StepStats global = s.compute_gradients(step);
  const double global_tokens = std::max(1.0, global.tokens);
  StepRecord rec;
  {
    RECORD_USER_SCOPE("shardkit::finish_gradients");
    rec.grad_norm = s.finish_gradients();
  }
  {
    RECORD_USER_SCOPE("shardkit::optimizer");
    rec.lr = s.apply_optimizer_step(step);
  }
  if (!s.moe_names.empty()) s.finish_moe_step(rec);
  rec.step = step;
  rec.loss = global.loss_sum / global_tokens;
  rec.stop_requested = global.stop_requested > 0;
  rec.checkpoint_busy = global.ckpt_busy > 0;
  rec.step_time_s = seconds_since(t0);
  rec.comm_wait_s = s.fsdp->comm_wait_seconds() - waited_before;
  rec.all_to_all_s = *s.ep_layout.all_to_all_seconds - all_to_all_before;
  rec.context_attention_s = s.ring_stats->attention_s - ring_before.attention_s;
  rec.context_wait_s = s.ring_stats->wait_s - ring_before.wait_s;
  if (s.pipeline.runner) {
    rec.pipeline_wait_s = s.pipeline.runner->wait_seconds() - pipeline_waited_before;
    rec.pipeline_peak_held = s.pipeline.runner->peak_held();
  }
  const int64_t tokens_per_step = s.cfg.train.global_batch_size * s.user.dataset->seq_len();
  rec.tokens_per_s = static_cast<double>(tokens_per_step) / std::max(rec.step_time_s, 1e-9);
  rec.mfu_percent = s.reports.mfu.percent(rec.tokens_per_s);
  s.history.push_back(rec);
  return rec;
}

// Every train.log_every steps and at the run's first and last step: the
// ranks' peak RSS (one small all-reduce, every rank), then on rank 0 the
// console line and the metrics.jsonl record.
void Trainer::State::log_step(const StepRecord& rec, const RunSpan& span) {
  const int64_t at = rec.step;
  bool log_now = at % cfg.train.log_every == 0 || at == span.last_step || at == span.first_step;
  if (!log_now) return;
  StepProgress progress;
  progress.peak_rss_mib = gather_per_rank(peak_rss_mib());
  if (device.is_cuda()) {
    progress.peak_gpu_mib = gather_per_rank(comm::peak_device_memory_bytes(device) / 1048576.0);
  }
  if (layout.context > 1) {
    progress.context_attention_s = gather_per_rank(rec.context_attention_s);
    progress.context_wait_s = gather_per_rank(rec.context_wait_s);
  }
  if (!is_logger) return;
  progress.first_step = span.first_step;
  progress.last_step = span.last_step;
  progress.run_s = seconds_since(span.start);
  reports.log->step(rec, progress);
}

// One value per rank, indexed by rank (a small all-reduce, every rank).
std::vector<double> Trainer::State::gather_per_rank(double mine) {
  const int world = rt.env.world_size;
  torch::Tensor rss = torch::zeros({world}, torch::kDouble);
  rss[rt.env.rank] = mine;
  rss = rss.to(device);
  rt.train->all_reduce(rss);
  rss = rss.to(torch::kCPU);
  return std::vector<double>(rss.data_ptr<double>(), rss.data_ptr<double>() + world);
}

// Each finished save: counted (on_error: warn keeps going past failures)
// and, on rank 0, logged. A retention that failed is not a failed save: that
// checkpoint committed, only older ones were not all deleted. Retention runs
// on rank 0 (durable) and node leaders (local), so every rank warns of its own.
void Trainer::State::log_checkpoint_events() {
  const std::vector<checkpoint::CheckpointEvent> events = ckpt->take_events();
  for (const auto& ev : events) {
    saves.failed += ev.ok ? 0 : 1;
    saves.last = ev;
    if (!reports.rank_events) reports.rank_events = std::make_unique<RankEventLog>(cfg.run.dir, rt.env.rank);
    reports.rank_events->checkpoint(ev);
    if (is_logger) reports.log->checkpoint(ev, ckpt->tiered());
  }
  // direct_io auto times each save's data file and may change its way
  // (direct_io.h): say so, after the save that changed it.
  if (is_logger && !events.empty() && !direct_io.text.empty()) {
    const bool direct = checkpoint::use_direct_io(checkpoint::DirectIo::kAuto, ckpt->dir());
    if (direct != direct_io.direct) {
      std::cout << "shardkit: checkpoint.direct_io auto: now " << checkpoint::describe_auto_direct_io(ckpt->dir())
                << std::endl;
      direct_io.direct = direct;
    }
  }
  for (const auto& f : ckpt->take_retention_failures()) {
    std::cerr << "shardkit: warning: checkpoint step " << f.step << " committed, but retention ("
              << f.tier << " tier, keep_last) failed on rank " << rt.env.rank << ": " << f.error << std::endl;
    if (is_logger) reports.log->retention_failure(f);
  }
}

// Saves when the manager's policy says so (checkpoint.interval, the last
// step, a stop signal, when_busy, on_error); records what it did in `rec`.
void Trainer::State::checkpoint_if_due(StepRecord& rec, int64_t last) {
  // Every rank saw the same busy flag in the step's all-reduce, so all
  // ranks skip together or save together.
  const checkpoint::DueSave done = ckpt->save_if_due(rec.step, last, rec.stop_requested, rec.checkpoint_busy,
                                                     [this] { return make_state_dict(); });
  if (!done.warning.empty() && is_logger) std::cerr << "shardkit: warning: " << done.warning << std::endl;
  if (done.skipped && is_logger) reports.log->checkpoint_skipped(rec.step);
  rec.checkpoint_skipped = done.skipped;
  rec.checkpoint_started = done.started;
  rec.checkpoint_blocking_s = done.blocking_s;
  if (!auto_interval) return;
  auto_interval->add_step(rec.step_time_s);
  // The final save (last step, a stop) has no next one to plan.
  if (done.started && rec.step < last && !rec.stop_requested) rederive_checkpoint_interval(rec);
}

void Trainer::State::rederive_checkpoint_interval(const StepRecord& rec) {
  // The ranks' means: the sum is the same bits on every rank, so every rank
  // derives the same interval and they keep saving together.
  torch::Tensor m = torch::tensor({rec.checkpoint_blocking_s, auto_interval->local_step_s()}, torch::kDouble);
  m = m.to(device);
  rt.train->all_reduce(m);
  m = m.to(torch::kCPU) / static_cast<double>(rt.env.world_size);
  const IntervalChoice choice =
      auto_interval->derive(m[0].item<double>(), m[1].item<double>(), startup.total_s);
  ckpt->set_interval(choice.steps, rec.step);
  if (is_logger) reports.log->checkpoint_interval(rec.step, choice, rec.step + choice.steps);
}

// A clean exit (done, stop_at, signal) commits the in-flight save first.
void Trainer::State::finish_checkpoints() {
  std::string warning;
  try {
    warning = ckpt->finish_or_warn();
  } catch (const checkpoint::CheckpointError&) {
    log_checkpoint_events();
    throw;
  }
  log_checkpoint_events();
  if (!warning.empty() && is_logger) std::cerr << "shardkit: warning: " << warning << std::endl;
}

// profile.every: a trace of the window that ended with this step.
void Trainer::State::after_step_profile() {
  const std::string snapshot = reports.profiler->after_step_memory(step, span->last_step);
  if (!snapshot.empty() && is_logger) reports.log->memory_snapshot(step, snapshot);
  if (!reports.profiler->enabled()) return;
  const std::string trace = reports.profiler->after_step(step, span->last_step);
  if (trace.empty() || !is_logger) return;
  reports.log->profile(std::max<int64_t>(1, step - cfg.profile.active + 1), step, StepProfiler::backend(),
               fs::path(trace).parent_path().string());
}

std::string Trainer::sample() {
  State& s = *s_;
  auto* model = dynamic_cast<models::LayeredModelImpl*>(s.user.module.get());
  if (model == nullptr) throw std::runtime_error("train.sample_every: only the built-in models can sample");
  if (s.layout.pipeline > 1) throw std::runtime_error("train.sample_every: a pipeline's stages do not sample (parallel.pipeline 1)");
  const std::string& spec = s.cfg.data.tokenizer;
  const bool bytes = spec.empty() || spec == "bytes";
  if (!bytes && !s.tokenizer) s.tokenizer = tokenizer::load_tokenizer(spec);
  std::vector<int64_t> prompt;
  if (bytes) {
    for (unsigned char c : s.cfg.train.sample_prompt) prompt.push_back(c);
  } else {
    prompt = s.tokenizer->encode(s.cfg.train.sample_prompt);
  }
  torch::NoGradGuard no_grad;
  // Every rank in step: the same gathered weights give the same tokens.
  const auto forward = [&](const torch::Tensor& tokens) {
    torch::Tensor logits = s.fsdp->forward([&] { return model->forward(tokens.to(s.device)); });
    // Tensor parallelism: each rank holds its slice of the vocabulary.
    if (s.layout.tensor > 1) logits = tp::gather_last_dim(logits, s.meshes.stage->group(2), s.cfg.model.vocab_size);
    return logits;
  };
  // Generation runs whole sequences on every rank: context parallelism off.
  s.use_context_parallel(false);
  std::vector<int64_t> ids;
  try {
    ids = models::generate(*model, s.cfg.model.seq_len, prompt, s.cfg.train.sample_tokens, {}, {}, false, forward);
  } catch (...) {
    s.use_context_parallel(true);
    throw;
  }
  s.use_context_parallel(true);
  if (bytes) return std::string(ids.begin(), ids.end());
  // The continuation: the whole decoded minus the decoded prompt (pieces may join).
  std::vector<int64_t> all = prompt;
  all.insert(all.end(), ids.begin(), ids.end());
  const std::string whole = s.tokenizer->decode(all), head = s.tokenizer->decode(prompt);
  return whole.compare(0, head.size(), head) == 0 ? whole.substr(head.size()) : " " + s.tokenizer->decode(ids);
}

EvalRecord Trainer::evaluate() {
  State& s = *s_;
  auto t0 = Clock::now();
  const int64_t n = std::min(s.user.dataset->eval_size(), s.cfg.train.eval_samples);
  if (n <= 0) {
    throw std::runtime_error("train.eval_every: no held-out samples; set data.eval_fraction > 0 (or data.eval_path)");
  }
  // TP ranks and a context group's ranks evaluate the same samples.
  const int64_t world = s.layout.batch_parallel();
  const int64_t rank = s.at.batch;
  const int64_t batch = s.cfg.train.global_batch_size;
  const int64_t local = batch / world;
  const auto pad = s.user.dataset->eval_sample(0);  // shapes and dtypes of a sample
  torch::NoGradGuard no_grad;
  torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions(torch::kDouble).device(s.device));
  torch::Tensor tokens = torch::zeros({}, torch::TensorOptions(torch::kDouble).device(s.device));
  for (int64_t first = 0; first < n; first += batch) {
    std::vector<torch::Tensor> inputs;
    std::vector<torch::Tensor> targets;
    for (int64_t r = 0; r < local; ++r) {
      const int64_t j = first + rank * local + r;
      if (j < n) {
        auto [in, tgt] = s.user.dataset->eval_sample(j);
        inputs.push_back(in);
        targets.push_back(tgt);
      } else {  // padding: every rank runs the same number of forwards
        inputs.push_back(torch::zeros_like(pad.first));
        targets.push_back(torch::full_like(pad.second, data::kIgnoreIndex));
      }
    }
    // Context parallelism: each rank its part of each sequence, as in training.
    torch::Tensor in = s.split_sequence(torch::stack(inputs)).to(s.device);
    torch::Tensor tgt = s.split_sequence(torch::stack(targets)).to(s.device);
    // In micro-batches, as training runs, so evaluation needs no more memory.
    const int64_t micro = local / s.micro_batches;
    if (s.layout.pipeline > 1) {
      // Through the pipeline's stages, forwards only; the last stage counts.
      std::vector<torch::Tensor> firsts;
      for (int64_t m = 0; m < local; m += micro) firsts.push_back(in.narrow(0, m, micro));
      pp::StageCallbacks cb;
      cb.forward = [&](int64_t stage, int64_t m, const torch::Tensor& input) {
        s.layered->set_stage(s.stage_of(stage));
        if (!s.pipeline.runner->is_last(stage)) return s.fsdp->forward([&] { return s.layered->forward(input); });
        const LossSum loss = s.fsdp->forward([&] { return s.user.loss(input, tgt.narrow(0, m * micro, micro)); });
        loss_sum += loss.sum.to(torch::kDouble);
        tokens += loss.count.to(torch::kDouble);
        return torch::Tensor();
      };
      s.pipeline.runner->run_forward(firsts, {micro, in.size(1), s.cfg.model.d_model}, s.activation_options(), cb);
      continue;
    }
    for (int64_t m = 0; m < local; m += micro) {
      torch::Tensor in_m = in.narrow(0, m, micro);
      torch::Tensor tgt_m = tgt.narrow(0, m, micro);
      const LossSum loss = s.fsdp->forward([&] { return s.user.loss(in_m, tgt_m); });
      loss_sum += loss.sum.to(torch::kDouble);
      tokens += loss.count.to(torch::kDouble);
    }
  }
  torch::Tensor both = torch::stack({loss_sum, tokens});
  if (!s.counts_loss()) both.zero_();  // the first rank of the (last stage's) TP group counts it
  s.rt.train->all_reduce(both);
  both = both.to(torch::kCPU);
  EvalRecord rec;
  rec.step = s.step;
  rec.tokens = both[1].item<double>();
  rec.loss = both[0].item<double>() / std::max(1.0, rec.tokens);
  rec.samples = n;
  rec.seconds = seconds_since(t0);
  return rec;
}

StepRecord Trainer::run_step() {
  State& s = *s_;
  if (!s.span) s.span = RunSpan{s.step + 1, s.last_step(), Clock::now()};
  s.log_restart_once();
  s.reports.profiler->before_step(s.step + 1);
  StepRecord rec;
  try {
    rec = train_step();
  } catch (const c10::OutOfMemoryError&) {
    // profile.memory_snapshot: what the allocator held when it ran out.
    const std::string snapshot = s.reports.profiler->write_oom_snapshot(s.step + 1);
    if (!snapshot.empty()) {
      std::cerr << "shardkit: rank " << s.rt.env.rank << " ran out of GPU memory in step " << s.step + 1
                << "; memory snapshot: " << snapshot << std::endl;
    }
    throw;
  }
  s.log_step(rec, *s.span);
  {
    RECORD_USER_SCOPE("shardkit::checkpoint");
    s.checkpoint_if_due(rec, s.span->last_step);
  }
  s.history.back() = rec;  // now with the checkpoint outcome
  s.after_step_profile();
  s.log_checkpoint_events();
  const int64_t every = s.cfg.train.eval_every;
  if (every > 0 && (s.step % every == 0 || s.step == s.cfg.train.steps)) {
    const EvalRecord eval = evaluate();
    if (s.is_logger) s.reports.log->eval(eval);
  }
  const int64_t sample_every = s.cfg.train.sample_every;
  if (sample_every > 0 && (s.step % sample_every == 0 || s.step == s.cfg.train.steps)) {
    const std::string text = sample();
    if (s.is_logger) s.reports.log->sample(s.step, s.cfg.train.sample_prompt, text);
  }
  return rec;
}

int Trainer::run() {
  State& s = *s_;
  s.log_startup_once();
  s.log_restart_once();
  s.span = RunSpan{s.step + 1, s.last_step(), Clock::now()};
  const RunSpan span = *s.span;
  bool stopped_by_signal = false;
  while (s.step < span.last_step && !stopped_by_signal) {
    stopped_by_signal = run_step().stop_requested;
  }
  s.span.reset();
  s.finish_checkpoints();
  // on_error: warn kept training past failed saves; a run whose last save
  // failed has not saved where it ended, and says so in its status.
  const bool last_save_failed = s.saves.last && !s.saves.last->ok;
  if (s.is_logger) {
    s.reports.log->end(s.step, stopped_by_signal);
    std::cout << "shardkit: " << (stopped_by_signal ? "stopped by signal" : "finished")
              << " at step " << s.step << std::endl;
    if (last_save_failed) {
      std::cerr << "train: " << s.saves.failed << " checkpoint save(s) failed "
                << "(checkpoint.on_error: warn), the last one too: step " << s.saves.last->step
                << " (" << s.saves.last->path << "): " << s.saves.last->error << std::endl;
    }
  }
  if (last_save_failed) return 1;
  return stopped_by_signal ? kExitPreempted : 0;
}

}  // namespace framework::train
