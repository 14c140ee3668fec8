#include "framework/train/metrics_log.h"

#include "checkpoint/timing.h"
#include "comm/runtime.h"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <stdexcept>

namespace framework::train {

namespace fs = std::filesystem;
using checkpoint::seconds_since;

namespace {

std::string format_duration(double seconds) {
  auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%02lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  return buf;
}

// "2026-11-23T01:02:03.456Z"
std::string utc_timestamp() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[40];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  char out[48];
  std::snprintf(out, sizeof(out), "%s.%03dZ", buf, static_cast<int>(ms));
  return out;
}

}  // namespace

MetricsLog::MetricsLog(const config::Config& cfg, std::chrono::steady_clock::time_point started)
    : cfg_(cfg), started_(started) {
  fs::create_directories(cfg.run.dir);
  config::write_effective_config(cfg, cfg.run.dir);
  const fs::path path = fs::path(cfg.run.dir) / "metrics.jsonl";
  bool torn = false;
  {
    std::ifstream earlier(path, std::ios::binary);
    if (earlier) {
      earlier_ = read_earlier_attempts(earlier);
      earlier.clear();
      char last = '\n';
      torn = earlier.seekg(-1, std::ios::end) && earlier.get(last) && last != '\n';
    }
  }
  out_.open(path, std::ios::app);
  if (!out_) throw std::runtime_error("cannot open " + path.string() + " for appending");
  // A record a crash cut short: this attempt's first record starts a line
  // of its own, not the end of that one.
  if (torn) out_ << "\n";
}

// Text that is not UTF-8 (a path, a sample's bytes) is written with U+FFFD.
// Every record has its "time" (the goodput ledger reads the last one).
void MetricsLog::write(const nlohmann::json& record) {
  nlohmann::json timed = record;
  if (!timed.contains("time")) timed["time"] = utc_timestamp();
  out_ << timed.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  out_.flush();
}

// Where this run segment starts, so that a reader of metrics.jsonl tells a
// fresh run from a resume and knows the world and layout of each.
void MetricsLog::start(const RunStart& s) {
  nlohmann::json j = {{"event", "start"},
                      {"time", utc_timestamp()},
                      {"step", s.step},
                      {"resumed_from", s.resumed_from ? nlohmann::json(*s.resumed_from) : nlohmann::json()},
                      {"world", s.world},
                      {"layout", s.layout},
                      {"device", s.device},
                      {"params", s.params},
                      {"memory_estimate_mib",
                       s.memory_estimate_mib ? nlohmann::json(*s.memory_estimate_mib) : nlohmann::json()},
                      {"libtorch", comm::torch_version()}};
  if (s.resumed_from) {
    j["resumed_step"] = s.resumed.step;
    j["saved_world"] = s.resumed.saved_world_size;
    j["saved_layout"] = s.resumed.saved_layout;
    if (!s.resume_tier.empty()) {
      j["resumed_tier"] = s.resume_tier;
      j["resume_reason"] = s.resume_reason;
    }
  }
  write(j);
  if (cfg_.metrics.tensorboard) {
    tb_ = std::make_unique<TensorBoardWriter>((fs::path(cfg_.run.dir) / "tb").string(), s.step + 1);
  }
}

// Loudly, on stderr and in metrics.jsonl: each damaged checkpoint resume
// set aside, and why.
void MetricsLog::resume_skipped(const std::vector<checkpoint::SkippedCheckpoint>& skipped) {
  for (const checkpoint::SkippedCheckpoint& c : skipped) {
    std::cerr << "shardkit: WARNING: checkpoint " << c.path << " failed to load and was skipped"
              << (c.moved_to.empty() ? "" : " (moved to " + c.moved_to + ")") << ": " << c.error
              << std::endl;
    write({{"event", "resume_skipped"}, {"path", c.path}, {"moved_to", c.moved_to}, {"error", c.error}});
  }
}

double MfuBasis::percent(double tokens_per_s) const {
  if (flops_per_token <= 0 || peak_flops <= 0) return 0;
  return 100.0 * flops_per_token * tokens_per_s / (peak_flops * static_cast<double>(devices));
}

std::optional<double> known_peak_tflops(const std::string& name) {
  auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  // Most specific first: "H100 PCIe" before "H100".
  const std::pair<const char*, double> table[] = {
      {"H100 NVL", 835}, {"H100 PCIe", 756}, {"H100", 989}, {"H200", 989}, {"H800", 989},
      {"H20", 148},      {"B200", 2250},     {"A100", 312}, {"A800", 312}, {"L40S", 362}};
  for (const auto& [part, tflops] : table)
    if (has(part)) return tflops;
  return std::nullopt;
}

MfuBasis mfu_basis(double flops_per_token, double peak_tflops, const std::string& gpu_name,
                   int64_t devices) {
  MfuBasis m;
  m.flops_per_token = flops_per_token;
  m.devices = devices;
  if (peak_tflops > 0) {
    m.peak_flops = peak_tflops * 1e12;
    m.peak_source = "train.peak_tflops";
  } else if (gpu_name.empty()) {
    m.missing = "on the CPU set train.peak_tflops";
  } else if (const std::optional<double> known = known_peak_tflops(gpu_name)) {
    m.peak_flops = *known * 1e12;
    m.peak_source = gpu_name + ", bf16 dense";
  } else {
    m.missing = gpu_name + " is not in the table of peaks: set train.peak_tflops";
  }
  if (flops_per_token <= 0) m.missing = "the model's FLOPs per token are not known";
  return m;
}

namespace {

// Each MoE layer's busiest expert over the mean load (1: balanced).
std::vector<double> load_imbalance(const StepRecord& rec) {
  std::vector<double> out;
  for (const std::vector<double>& loads : rec.expert_loads) {
    double sum = 0, most = 0;
    for (double l : loads) {
      sum += l;
      most = std::max(most, l);
    }
    out.push_back(sum > 0 ? most * static_cast<double>(loads.size()) / sum : 0.0);
  }
  return out;
}

}  // namespace

void MetricsLog::step(const StepRecord& rec, const StepProgress& p) {
  const double per_step = p.run_s / static_cast<double>(rec.step - p.first_step + 1);
  std::ostringstream line;
  line << "step " << rec.step << "/" << cfg_.train.steps << " | loss " << std::fixed
       << std::setprecision(4) << rec.loss << " | lr " << std::scientific << std::setprecision(2)
       << rec.lr << std::fixed << " | grad_norm " << std::setprecision(3) << rec.grad_norm << " | "
       << std::setprecision(0) << rec.tokens_per_s << " tok/s | ";
  if (rec.mfu_percent > 0) line << "mfu " << std::setprecision(1) << rec.mfu_percent << "% | ";
  const std::vector<double> imbalance = load_imbalance(rec);
  if (!imbalance.empty()) {
    line << "moe aux " << std::setprecision(4) << rec.moe_aux_loss << " load max/mean " << std::setprecision(2)
         << *std::max_element(imbalance.begin(), imbalance.end()) << " | ";
  }
  line << std::setprecision(3) << rec.step_time_s << " s/step | rss " << std::setprecision(0)
       << *std::max_element(p.peak_rss_mib.begin(), p.peak_rss_mib.end()) << " MiB | elapsed "
       << format_duration(seconds_since(started_)) << " | ETA "
       << format_duration(per_step * static_cast<double>(p.last_step - rec.step));
  std::cout << line.str() << std::endl;
  nlohmann::json j = {{"step", rec.step},
                      {"loss", rec.loss},
                      {"lr", rec.lr},
                      {"tokens_per_s", rec.tokens_per_s},
                      {"step_time_s", rec.step_time_s},
                      {"comm_wait_s", rec.comm_wait_s},
                      {"grad_norm", rec.grad_norm},
                      {"time", utc_timestamp()},
                      {"wall_s", seconds_since(started_)},
                      {"peak_rss_mib", p.peak_rss_mib}};
  if (!p.peak_gpu_mib.empty()) j["peak_gpu_mib"] = p.peak_gpu_mib;
  if (rec.mfu_percent > 0) j["mfu_percent"] = rec.mfu_percent;
  if (!imbalance.empty()) {
    j["moe_aux_loss"] = rec.moe_aux_loss;
    j["expert_load"] = rec.expert_loads;
    j["expert_load_max_over_mean"] = imbalance;
  }
  if (cfg_.parallel.expert > 1) j["all_to_all_s"] = rec.all_to_all_s;
  if (!p.context_attention_s.empty()) {
    j["context_attention_s"] = p.context_attention_s;
    j["context_wait_s"] = p.context_wait_s;
  }
  if (rec.pipeline_peak_held > 0) {
    j["pipeline_wait_s"] = rec.pipeline_wait_s;
    j["pipeline_peak_held"] = rec.pipeline_peak_held;
  }
  write(j);
  if (tb_) {
    std::vector<std::pair<std::string, double>> scalars = {
        {"loss", rec.loss},
        {"lr", rec.lr},
        {"grad_norm", rec.grad_norm},
        {"tokens_per_s", rec.tokens_per_s},
        {"step_time_s", rec.step_time_s},
        {"comm_wait_s", rec.comm_wait_s},
        {"memory/peak_rss_mib", *std::max_element(p.peak_rss_mib.begin(), p.peak_rss_mib.end())}};
    if (rec.mfu_percent > 0) scalars.emplace_back("mfu_percent", rec.mfu_percent);
    if (!imbalance.empty()) {
      scalars.emplace_back("moe/aux_loss", rec.moe_aux_loss);
      if (cfg_.parallel.expert > 1) scalars.emplace_back("moe/all_to_all_s", rec.all_to_all_s);
      for (size_t l = 0; l < imbalance.size(); ++l) {
        scalars.emplace_back("moe/load_max_over_mean/moe_layer_" + std::to_string(l), imbalance[l]);
      }
    }
    if (!p.context_attention_s.empty()) {
      scalars.emplace_back("context/attention_s_max",
                           *std::max_element(p.context_attention_s.begin(), p.context_attention_s.end()));
      scalars.emplace_back("context/wait_s_max",
                           *std::max_element(p.context_wait_s.begin(), p.context_wait_s.end()));
    }
    if (!p.peak_gpu_mib.empty()) {
      scalars.emplace_back("memory/peak_gpu_mib",
                           *std::max_element(p.peak_gpu_mib.begin(), p.peak_gpu_mib.end()));
    }
    tb_->scalars(rec.step, scalars);
  }
}

void MetricsLog::eval(const EvalRecord& rec) {
  std::ostringstream line;
  line << "eval step " << rec.step << " | val_loss " << std::fixed << std::setprecision(4)
       << rec.loss << " | " << rec.samples << " held-out samples | " << std::setprecision(3)
       << rec.seconds << " s";
  std::cout << line.str() << std::endl;
  write({{"event", "eval"},         {"step", rec.step},
         {"val_loss", rec.loss},    {"val_tokens", rec.tokens},
         {"samples", rec.samples},  {"eval_s", rec.seconds},
         {"time", utc_timestamp()}, {"wall_s", seconds_since(started_)}});
  if (tb_) tb_->scalars(rec.step, {{"val_loss", rec.loss}});
}

void MetricsLog::checkpoint(const checkpoint::CheckpointEvent& ev, bool tiered) {
  std::ostringstream line;
  line << std::fixed << std::setprecision(3) << "checkpoint step " << ev.step << " (" << ev.mode
       << ") " << (ev.ok ? "committed " : "FAILED ") << ev.path << " | blocking " << ev.blocking_s
       << " s | stage " << ev.stage_s << " s | write " << ev.write_s << " s | commit "
       << ev.commit_s << " s | " << std::setprecision(1) << ev.bytes / 1048576.0 << " MiB -> "
       << ev.stored_bytes / 1048576.0 << " MiB";
  if (!ev.staging.empty()) line << " | staging " << ev.staging;
  if (tiered) {
    line << " | tier " << ev.tier << " | local commit " << std::setprecision(3) << ev.local_commit_s
         << " s | partner " << ev.partner;
    if (ev.flushed) line << " | durable +" << ev.exposure_s << " s";
  }
  std::cout << line.str() << std::endl;
  if (tiered && ev.partner.rfind("failed", 0) == 0) {
    std::cerr << "shardkit: warning: checkpoint step " << ev.step
              << " has no partner copies (L1 only): " << ev.partner << std::endl;
  }
  nlohmann::json j = {{"event", "checkpoint"}, {"step", ev.step},         {"mode", ev.mode},
                      {"blocking_s", ev.blocking_s}, {"stage_s", ev.stage_s},
                      {"write_s", ev.write_s},   {"commit_s", ev.commit_s}, {"bytes", ev.bytes},
                      {"stored_bytes", ev.stored_bytes}, {"ok", ev.ok},   {"path", ev.path},
                      {"plan_s", ev.plan_s}, {"plan_cached", ev.plan_cached}, {"time", utc_timestamp()}};
  if (!ev.staging.empty()) j["staging"] = ev.staging;
  if (tiered) {
    j["tier"] = ev.tier;
    j["local_path"] = ev.local_path;
    j["local_commit_s"] = ev.local_commit_s;
    j["partner"] = ev.partner;
    j["flushed"] = ev.flushed;
    j["flush_s"] = ev.flush_s;
    j["exposure_s"] = ev.exposure_s;
  }
  if (!ev.ok) j["error"] = ev.error;
  out_ << j.dump() << "\n";
  out_.flush();
  if (tb_ && ev.ok) {
    tb_->scalars(ev.step, {{"checkpoint/blocking_s", ev.blocking_s},
                           {"checkpoint/stage_s", ev.stage_s},
                           {"checkpoint/write_s", ev.write_s},
                           {"checkpoint/commit_s", ev.commit_s}});
  }
}

void RankEventLog::checkpoint(const checkpoint::CheckpointEvent& ev) {
  if (failed_) return;
  if (!out_.is_open()) {
    const fs::path dir = fs::path(run_dir_) / "checkpoint_events";
    std::error_code ec;
    fs::create_directories(dir, ec);
    out_.open(dir / ("rank" + std::to_string(rank_) + ".jsonl"), std::ios::app);
  }
  nlohmann::json j = {{"step", ev.step},
                      {"rank", rank_},
                      {"mode", ev.mode},
                      {"ok", ev.ok},
                      {"tier", ev.tier},
                      {"started_unix_s", ev.started_unix_s},
                      {"blocking_s", ev.blocking_s},
                      {"stage_s", ev.stage_s},
                      {"write_started_unix_s", ev.write_started_unix_s},
                      {"write_s", ev.write_s},
                      {"commit_s", ev.commit_s}};
  if (!ev.staging.empty()) j["staging"] = ev.staging;
  out_ << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  out_.flush();
  if (!out_) {
    std::cerr << "shardkit: WARNING: cannot write " << run_dir_ << "/checkpoint_events/rank" << rank_
              << ".jsonl; no more checkpoint timeline records from this rank" << std::endl;
    failed_ = true;
  }
}

void MetricsLog::checkpoint_skipped(int64_t step) {
  std::cout << "checkpoint step " << step << " skipped: previous save still in flight" << std::endl;
}

void MetricsLog::checkpoint_interval(int64_t step, const IntervalChoice& c, int64_t next_save) {
  std::ostringstream line;
  line << std::fixed << std::setprecision(3) << "shardkit: checkpoint.interval auto: every " << c.steps
       << (c.steps == 1 ? " step" : " steps") << " (Young/Daly: sqrt(2 x save stall " << c.save_stall_s << " s x mtbf " << std::setprecision(0)
       << c.mtbf_s << " s) = " << std::setprecision(1) << c.interval_s << " s at " << std::setprecision(3)
       << c.step_s << " s/step), next save at step " << next_save << "; expected loss per failure "
       << std::setprecision(1) << c.expected_loss_s << " s";
  std::cout << line.str() << std::endl;
  write({{"event", "checkpoint_interval"},
         {"step", step},
         {"interval_steps", c.steps},
         {"interval_s", c.interval_s},
         {"save_stall_s", c.save_stall_s},
         {"step_s", c.step_s},
         {"mtbf_s", c.mtbf_s},
         {"expected_loss_s", c.expected_loss_s},
         {"next_save_step", next_save},
         {"wall_s", seconds_since(started_)}});
}

void MetricsLog::restart(const RestartLedger& r) {
  std::ostringstream line;
  line << std::fixed << std::setprecision(1) << "shardkit: restart " << r.restart << " of this run: lost "
       << r.lost_s << " s since the last attempt's last record, " << r.redone_steps << " steps to redo (about "
       << r.redone_s << " s) from step " << r.step << "; goodput so far " << std::setprecision(3) << r.goodput
       << " of " << std::setprecision(1) << r.run_wall_s << " s";
  std::cout << line.str() << std::endl;
  write({{"event", "restart"},
         {"restart", r.restart},
         {"step", r.step},
         {"lost_s", r.lost_s},
         {"redone_steps", r.redone_steps},
         {"redone_s", r.redone_s},
         {"run_wall_s", r.run_wall_s},
         {"goodput", r.goodput},
         {"wall_s", seconds_since(started_)}});
  if (tb_) {
    tb_->scalars(r.step, {{"goodput/lost_s", r.lost_s},
                          {"goodput/redone_steps", static_cast<double>(r.redone_steps)},
                          {"goodput/goodput", r.goodput}});
  }
}

void MetricsLog::retention_failure(const checkpoint::RetentionFailure& f) {
  write({{"event", "retention"}, {"step", f.step}, {"tier", f.tier}, {"ok", false}, {"error", f.error}});
}

void MetricsLog::profile(int64_t first_step, int64_t step, const std::string& backend,
                         const std::string& dir) {
  std::cout << "profile steps " << first_step << "-" << step << " (" << backend << "): " << dir
            << "/rank*.json" << std::endl;
  write({{"event", "profile"}, {"step", step}, {"backend", backend}, {"dir", dir}});
}

void MetricsLog::memory_snapshot(int64_t step, const std::string& path) {
  std::cout << "memory snapshot step " << step << ": " << path << " (rank 0; every rank writes its own)" << std::endl;
  write({{"event", "memory_snapshot"}, {"step", step}, {"path", path}});
}

void MetricsLog::sample(int64_t step, const std::string& prompt, const std::string& text) {
  std::string shown = prompt + text;
  for (char& c : shown) {
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';  // one line in the log
  }
  std::cout << "sample step " << step << " | " << shown << std::endl;
  write({{"event", "sample"}, {"step", step}, {"prompt", prompt}, {"text", text}});
}

void MetricsLog::startup(int64_t step, const StartupPhases& p) {
  std::ostringstream line;
  line << std::fixed << std::setprecision(2) << "shardkit: startup " << p.total_s << " s"
       << (p.standby ? " from the standby's activation" : "") << (p.forked ? " from the fork" : "") << " (load " << p.load_s
       << ", rendezvous " << p.rendezvous_s << ", groups " << p.groups_s << ", model " << p.model_s << ", data "
       << p.data_s << ", checkpoint " << p.checkpoint_s << ", resume " << p.resume_s << ", other " << p.other_s
       << ")";
  std::cout << line.str() << std::endl;
  write({{"event", "startup"},
         {"time", utc_timestamp()},
         {"step", step},
         {"restart", p.restart},
         {"standby", p.standby},
         {"forked", p.forked},
         {"startup_s", p.total_s},
         {"load_s", p.load_s},
         {"rendezvous_s", p.rendezvous_s},
         {"groups_s", p.groups_s},
         {"model_s", p.model_s},
         {"data_s", p.data_s},
         {"checkpoint_s", p.checkpoint_s},
         {"resume_s", p.resume_s},
         {"other_s", p.other_s},
         {"wall_s", seconds_since(started_)}});
}

void MetricsLog::end(int64_t step, bool stopped_by_signal) {
  out_ << nlohmann::json({{"event", "end"},
                          {"time", utc_timestamp()},
                          {"step", step},
                          {"status", stopped_by_signal ? "stopped" : "finished"},
                          {"wall_s", seconds_since(started_)}})
              .dump()
       << "\n";
  out_.flush();
}

}  // namespace framework::train
