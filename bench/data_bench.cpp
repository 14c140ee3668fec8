// data_bench: what reading pre-tokenized shards costs (data.kind tokens),
// against the byte-level text dataset that reads its file whole, side by
// side in one run on the same bytes:
//   - open: mapping and checking the headers (data.check_tokens false);
//   - check: the token-id pass (data.check_tokens true), from a cold page
//     cache where the kernel allows dropping it, and its read rate;
//   - sampling: --samples random windows of --seq-len tokens, as the
//     trainer draws them (samples/s);
//   - memory: resident growth over each phase, anonymous (the process's
//     own) and file-backed (mapped page cache) apart.
// Prints a table and writes JSON (--json).
//   build/data_bench [--dir /tmp/x] [--shards 4] [--tokens-per-shard 134217728]
//                    [--seq-len 1024] [--samples 20000] [--json FILE]
#include "bench/bench_util.h"
#include "framework/data/text_dataset.h"
#include "framework/data/token_dataset.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
double mib(double bytes) { return bytes / 1048576.0; }

// llm.c uint16 shards of pseudo-random ids below 50257.
std::vector<std::string> write_shards(const std::string& dir, int shards, int64_t per_shard) {
  std::filesystem::create_directories(dir);
  std::vector<std::string> paths;
  std::mt19937_64 rng(1);
  std::vector<uint16_t> buf(1 << 20);
  for (int s = 0; s < shards; ++s) {
    char name[64];
    std::snprintf(name, sizeof(name), "/bench_%03d.bin", s);
    paths.push_back(dir + name);
    std::ofstream out(paths.back(), std::ios::binary);
    std::vector<int32_t> header(256, 0);
    header[0] = 20240520;
    header[1] = 1;
    header[2] = static_cast<int32_t>(per_shard);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
    for (int64_t done = 0; done < per_shard;) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(buf.size()), per_shard - done);
      for (int64_t i = 0; i < n; ++i) buf[static_cast<size_t>(i)] = static_cast<uint16_t>(rng() % 50257);
      out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(n * 2));
      done += n;
    }
  }
  return paths;
}

// Resident growth split as the kernel counts it: anonymous memory (the
// process's own, what reading a file whole costs) and file-backed pages (the
// shards' mapped page cache, shared and reclaimable under pressure).
struct Phase {
  double seconds = 0;
  double anon_mib = 0;
  double file_mib = 0;
};

template <typename Fn>
Phase measure(Fn fn) {
  const double anon = static_cast<double>(bench::proc_status_bytes("RssAnon:"));
  const double file = static_cast<double>(bench::proc_status_bytes("RssFile:"));
  const auto t0 = Clock::now();
  fn();
  return {since(t0), mib(static_cast<double>(bench::proc_status_bytes("RssAnon:")) - anon),
          mib(static_cast<double>(bench::proc_status_bytes("RssFile:")) - file)};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("data_bench: token shards (mmap) against a text file read whole");
  std::string dir = std::filesystem::temp_directory_path().string() + "/shardkit_data_bench_" +
                    std::to_string(::getpid());
  int shards = 4;
  int64_t per_shard = int64_t{1} << 27;  // 128 Mi tokens, 256 MiB a shard
  int64_t seq_len = 1024;
  int64_t samples = 20000;
  std::string json_path;
  bool keep = false;
  app.add_option("--dir", dir, "where the shards are written (removed after, unless --keep)");
  app.add_option("--shards", shards, "llm.c uint16 shards");
  app.add_option("--tokens-per-shard", per_shard, "tokens per shard");
  app.add_option("--seq-len", seq_len, "window length (model.seq_len)");
  app.add_option("--samples", samples, "random windows drawn per dataset");
  app.add_option("--json", json_path, "write the results as JSON here");
  app.add_flag("--keep", keep, "keep the shards");
  CLI11_PARSE(app, argc, argv);

  const auto paths = write_shards(dir, shards, per_shard);
  const double data_mib = mib(static_cast<double>(shards) * static_cast<double>(per_shard) * 2);
  bool cold = true;
  for (const auto& p : paths) cold = bench::drop_page_cache(p) && cold;

  framework::data::TokenDatasetOptions o;
  o.path = dir + "/bench_*.bin";
  o.seq_len = seq_len;
  o.vocab_size = 50304;
  o.seed = 1;
  o.check_tokens = false;
  std::unique_ptr<framework::data::TokenDataset> lazy;
  const Phase open = measure([&] { lazy = std::make_unique<framework::data::TokenDataset>(o); });
  o.check_tokens = true;
  std::unique_ptr<framework::data::TokenDataset> checked;
  const Phase check = measure([&] { checked = std::make_unique<framework::data::TokenDataset>(o); });
  int64_t sink = 0;
  const Phase tokens_sampling = measure([&] {
    for (int64_t i = 0; i < samples; ++i) sink += checked->sample(i).first[0].item<int64_t>();
  });

  // The text dataset over the first shard's bytes, the way data.kind text reads: whole.
  std::unique_ptr<framework::data::TextDataset> text;
  const Phase text_open = measure([&] { text = std::make_unique<framework::data::TextDataset>(paths[0], seq_len, 1); });
  const Phase text_sampling = measure([&] {
    for (int64_t i = 0; i < samples; ++i) sink += text->sample(i).first[0].item<int64_t>();
  });
  const double check_rate = data_mib / check.seconds;
  std::printf("data_bench: %d llm.c uint16 shards, %.0f MiB of tokens; seq_len %ld; %ld samples; page cache %s\n",
              shards, data_mib, static_cast<long>(seq_len), static_cast<long>(samples),
              cold ? "dropped before the check" : "not dropped (warm)");
  std::printf("%-36s %9s %10s %10s %20s\n", "phase", "seconds", "anon MiB", "file MiB", "rate");
  auto row = [](const char* name, const Phase& p, const std::string& rate) {
    std::printf("%-36s %9.3f %10.1f %10.1f %20s\n", name, p.seconds, p.anon_mib, p.file_mib, rate.c_str());
  };
  auto per_s = [](double v, const char* unit) {
    char b[64];
    std::snprintf(b, sizeof(b), "%.0f %s", v, unit);
    return std::string(b);
  };
  row("tokens: open (headers only)", open, "");
  row("tokens: check every id (pread)", check, per_s(check_rate, "MiB/s"));
  row("tokens: random windows", tokens_sampling, per_s(static_cast<double>(samples) / tokens_sampling.seconds, "samples/s"));
  row("text: read one shard whole", text_open, per_s(mib(static_cast<double>(per_shard)) * 2 / text_open.seconds, "MiB/s"));
  row("text: random windows", text_sampling, per_s(static_cast<double>(samples) / text_sampling.seconds, "samples/s"));
  std::printf("anonymous memory: tokens %.1f MiB for %.0f MiB of shards; text %.1f MiB for one %.0f MiB shard\n",
              open.anon_mib + check.anon_mib + tokens_sampling.anon_mib, data_mib, text_open.anon_mib,
              data_mib / shards);

  nlohmann::json j = {
      {"shards", shards}, {"tokens_per_shard", per_shard}, {"data_mib", data_mib}, {"seq_len", seq_len},
      {"samples", samples}, {"page_cache_dropped", cold},
      {"tokens_open_s", open.seconds}, {"tokens_open_anon_mib", open.anon_mib},
      {"tokens_check_s", check.seconds}, {"tokens_check_anon_mib", check.anon_mib},
      {"tokens_check_file_mib", check.file_mib}, {"tokens_check_mib_per_s", check_rate},
      {"tokens_sampling_s", tokens_sampling.seconds}, {"tokens_sampling_anon_mib", tokens_sampling.anon_mib},
      {"tokens_sampling_file_mib", tokens_sampling.file_mib},
      {"tokens_samples_per_s", static_cast<double>(samples) / tokens_sampling.seconds},
      {"text_open_s", text_open.seconds}, {"text_open_anon_mib", text_open.anon_mib},
      {"text_sampling_s", text_sampling.seconds},
      {"text_samples_per_s", static_cast<double>(samples) / text_sampling.seconds}, {"checksum", sink}};
  if (!json_path.empty()) std::ofstream(json_path) << j.dump(2) << "\n";
  if (!keep) std::filesystem::remove_all(dir);
  return 0;
}
