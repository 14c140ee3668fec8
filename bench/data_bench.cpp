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

struct Args {
  std::string dir = std::filesystem::temp_directory_path().string() + "/shardkit_data_bench_" +
                    std::to_string(::getpid());
  int shards = 4;
  int64_t per_shard = int64_t{1} << 27;  // 128 Mi tokens, 256 MiB a shard
  int64_t seq_len = 1024;
  int64_t samples = 20000;
  std::string json_path;
  bool keep = false;
};

// The phases of both datasets over the same shards.
struct Results {
  double data_mib = 0;
  bool cold = true;  // the page cache was dropped before the check
  Phase open, check, tokens_sampling, text_open, text_sampling;
  int64_t sink = 0;  // sampled ids summed, so that no sampling is optimised away
  // Kept open to the end, as a trainer keeps its dataset.
  std::unique_ptr<framework::data::TokenDataset> lazy, checked;
  std::unique_ptr<framework::data::TextDataset> text;
};

// data.kind tokens: open without the id check, open with it, random windows.
void measure_token_dataset(const Args& args, Results& r) {
  framework::data::TokenDatasetOptions o;
  o.path = args.dir + "/bench_*.bin";
  o.seq_len = args.seq_len;
  o.vocab_size = 50304;
  o.seed = 1;
  o.check_tokens = false;
  r.open = measure([&] { r.lazy = std::make_unique<framework::data::TokenDataset>(o); });
  o.check_tokens = true;
  r.check = measure([&] { r.checked = std::make_unique<framework::data::TokenDataset>(o); });
  r.tokens_sampling = measure([&] {
    for (int64_t i = 0; i < args.samples; ++i) r.sink += r.checked->sample(i).first[0].item<int64_t>();
  });
}

// The text dataset over the first shard's bytes, the way data.kind text reads: whole.
void measure_text_dataset(const Args& args, const std::string& first_shard, Results& r) {
  r.text_open =
      measure([&] { r.text = std::make_unique<framework::data::TextDataset>(first_shard, args.seq_len, 1); });
  r.text_sampling = measure([&] {
    for (int64_t i = 0; i < args.samples; ++i) r.sink += r.text->sample(i).first[0].item<int64_t>();
  });
}

void print_table(const Args& args, const Results& r) {
  const double check_rate = r.data_mib / r.check.seconds;
  std::printf("data_bench: %d llm.c uint16 shards, %.0f MiB of tokens; seq_len %ld; %ld samples; page cache %s\n",
              args.shards, r.data_mib, static_cast<long>(args.seq_len), static_cast<long>(args.samples),
              r.cold ? "dropped before the check" : "not dropped (warm)");
  std::printf("%-36s %9s %10s %10s %20s\n", "phase", "seconds", "anon MiB", "file MiB", "rate");
  auto row = [](const char* name, const Phase& p, const std::string& rate) {
    std::printf("%-36s %9.3f %10.1f %10.1f %20s\n", name, p.seconds, p.anon_mib, p.file_mib, rate.c_str());
  };
  auto per_s = [](double v, const char* unit) {
    char b[64];
    std::snprintf(b, sizeof(b), "%.0f %s", v, unit);
    return std::string(b);
  };
  const double samples = static_cast<double>(args.samples);
  row("tokens: open (headers only)", r.open, "");
  row("tokens: check every id (pread)", r.check, per_s(check_rate, "MiB/s"));
  row("tokens: random windows", r.tokens_sampling, per_s(samples / r.tokens_sampling.seconds, "samples/s"));
  row("text: read one shard whole", r.text_open,
      per_s(mib(static_cast<double>(args.per_shard)) * 2 / r.text_open.seconds, "MiB/s"));
  row("text: random windows", r.text_sampling, per_s(samples / r.text_sampling.seconds, "samples/s"));
  std::printf("anonymous memory: tokens %.1f MiB for %.0f MiB of shards; text %.1f MiB for one %.0f MiB shard\n",
              r.open.anon_mib + r.check.anon_mib + r.tokens_sampling.anon_mib, r.data_mib, r.text_open.anon_mib,
              r.data_mib / args.shards);
}

nlohmann::json results_json(const Args& args, const Results& r) {
  const double samples = static_cast<double>(args.samples);
  return {
      {"shards", args.shards}, {"tokens_per_shard", args.per_shard}, {"data_mib", r.data_mib},
      {"seq_len", args.seq_len}, {"samples", args.samples}, {"page_cache_dropped", r.cold},
      {"tokens_open_s", r.open.seconds}, {"tokens_open_anon_mib", r.open.anon_mib},
      {"tokens_check_s", r.check.seconds}, {"tokens_check_anon_mib", r.check.anon_mib},
      {"tokens_check_file_mib", r.check.file_mib}, {"tokens_check_mib_per_s", r.data_mib / r.check.seconds},
      {"tokens_sampling_s", r.tokens_sampling.seconds}, {"tokens_sampling_anon_mib", r.tokens_sampling.anon_mib},
      {"tokens_sampling_file_mib", r.tokens_sampling.file_mib},
      {"tokens_samples_per_s", samples / r.tokens_sampling.seconds},
      {"text_open_s", r.text_open.seconds}, {"text_open_anon_mib", r.text_open.anon_mib},
      {"text_sampling_s", r.text_sampling.seconds},
      {"text_samples_per_s", samples / r.text_sampling.seconds}, {"checksum", r.sink}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("data_bench: token shards (mmap) against a text file read whole");
  Args args;
  app.add_option("--dir", args.dir, "where the shards are written (removed after, unless --keep)");
  app.add_option("--shards", args.shards, "llm.c uint16 shards");
  app.add_option("--tokens-per-shard", args.per_shard, "tokens per shard");
  app.add_option("--seq-len", args.seq_len, "window length (model.seq_len)");
  app.add_option("--samples", args.samples, "random windows drawn per dataset");
  app.add_option("--json", args.json_path, "write the results as JSON here");
  app.add_flag("--keep", args.keep, "keep the shards");
  CLI11_PARSE(app, argc, argv);

  const auto paths = write_shards(args.dir, args.shards, args.per_shard);
  Results r;
  r.data_mib = mib(static_cast<double>(args.shards) * static_cast<double>(args.per_shard) * 2);
  for (const auto& p : paths) r.cold = bench::drop_page_cache(p) && r.cold;
  measure_token_dataset(args, r);
  measure_text_dataset(args, paths[0], r);
  print_table(args, r);
  if (!args.json_path.empty()) std::ofstream(args.json_path) << results_json(args, r).dump(2) << "\n";
  if (!args.keep) std::filesystem::remove_all(args.dir);
  return 0;
}
