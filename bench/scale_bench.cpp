// scale_bench: the save planner, the metadata writer and the load planner at
// 64 to 16,384 simulated ranks, in one process (issue "Scale").
//
// Every number comes from the library's real code paths (save_protocol.h:
// the coordinator's plan_replies and assemble_metadata, a rank's
// assignments_from_reply; encode_metadata; the partial metadata reader a
// loading rank uses), run on the messages the ranks of a real save would
// exchange. Only the collectives are simulated: their payloads are counted as
// the Group implements them (gather_bytes: one MAX all-reduce of a length,
// then payloads framed to the longest; scatter_bytes: a broadcast length,
// then the member's framed payload).
//
// The state is LLaMA-7B-like: 32 layers, 291 parameters, each with AdamW's
// two moments (873 tensors) plus one replicated bytes item: 874 items per
// rank. Layouts: fsdp (Shard(0) over all ranks), hsdp (Shard(0) over
// --hsdp-shard ranks, replicated across the rest), ddp (every rank holds
// everything; replicated data is split across the holders).
//
// Each role runs in its own forked process, so that its peak memory (VmHWM
// over the RSS it started with) is its own:
//   coordinator   decodes every local plan, plans, makes every reply; then
//                 assembles and encodes the metadata from every write report
//   rank          a typical non-coordinator rank: its local plan, its
//                 reply's assignments, its write report
//   cached        the second save with plan caching: structure hash and the
//                 agreement (one all-reduce of 3 int64)
//   load          a loading rank (same world and layout): the metadata bytes
//                 it reads with the partial reader (head included), against
//                 what describes its own regions (their records and
//                 directory entries: "x own" is (read - head) / own)
//   load_resharded  the same for a rank of an FSDP load at 3/4 of the world
// Output: a table, and JSON (--json FILE, or stdout with --json -).
#include "checkpoint/format/checksum.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/format/metadata_codec.h"
#include "checkpoint/format/wire.h"
#include "checkpoint/save_protocol.h"
#include "checkpoint/storage/storage.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace checkpoint;
using Bytes = std::vector<uint8_t>;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

uint64_t proc_status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::stoull(line.substr(std::string(field).size()));
  }
  return 0;
}

struct Param {
  std::string name;
  std::vector<int64_t> shape;
};

std::vector<Param> llama7b_params() {
  std::vector<Param> p;
  p.push_back({"tok_embeddings.weight", {32000, 4096}});
  for (int l = 0; l < 32; ++l) {
    const std::string b = "layers." + std::to_string(l) + ".";
    for (const char* w : {"wq", "wk", "wv", "wo"}) {
      p.push_back({b + "attention." + w + ".weight", {4096, 4096}});
    }
    p.push_back({b + "feed_forward.w1.weight", {11008, 4096}});
    p.push_back({b + "feed_forward.w2.weight", {4096, 11008}});
    p.push_back({b + "feed_forward.w3.weight", {11008, 4096}});
    p.push_back({b + "attention_norm.weight", {4096}});
    p.push_back({b + "ffn_norm.weight", {4096}});
  }
  p.push_back({"norm.weight", {4096}});
  p.push_back({"output.weight", {32000, 4096}});
  return p;
}

struct Layout {
  std::string kind;  // fsdp | hsdp | ddp
  int world = 1;
  int shard = 1;     // ranks one copy is sharded over
  std::string describe() const {
    return kind == "hsdp" ? "hsdp " + std::to_string(world / shard) + "x" + std::to_string(shard)
                          : kind + " " + std::to_string(world);
  }
};

// Rank `rank`'s box of a tensor of `shape`: Shard(0), torch.chunk-style, over
// layout.shard ranks.
Box box_of(const std::vector<int64_t>& shape, const Layout& layout, int rank) {
  Box box = full_box(shape);
  if (layout.shard <= 1) return box;
  const int64_t idx = rank % layout.shard;
  const int64_t chunk = (shape[0] + layout.shard - 1) / layout.shard;
  const int64_t lo = std::min(idx * chunk, shape[0]);
  const int64_t hi = std::min(lo + chunk, shape[0]);
  box.offsets[0] = lo;
  box.sizes[0] = hi - lo;
  return box;
}

constexpr int64_t kTrainStateBytes = 200;

LocalPlan local_plan(const std::vector<Param>& params, const Layout& layout, int rank) {
  LocalPlan plan;
  plan.rank = rank;
  plan.items.reserve(params.size() * 3 + 1);
  for (const Param& p : params) {
    const Box box = box_of(p.shape, layout, rank);
    for (const char* prefix : {"model.", "optim.exp_avg.", "optim.exp_avg_sq."}) {
      plan.items.push_back(WriteItem{prefix + p.name, ItemKind::kTensor, DType::kFloat32, p.shape, box});
    }
  }
  plan.items.push_back(WriteItem{"train_state", ItemKind::kBytes, DType::kUInt8, {kTrainStateBytes},
                                 Box{{0}, {kTrainStateBytes}}});
  return plan;
}

Bytes tagged(Bytes payload) {
  payload.insert(payload.begin(), uint8_t{1});
  return payload;
}

// A rank's write report for its assignments, with plausible locations: one
// block per chunk, uncompressed, consecutive in its file.
Bytes write_report(const std::vector<WriteAssignment>& assignments) {
  std::vector<ChunkMeta> chunks;
  uint64_t offset = 0;
  for (const auto& a : assignments) {
    const uint64_t n = static_cast<uint64_t>(a.box.numel()) * (a.name == "train_state" ? 1 : 4);
    ChunkMeta c;
    c.box = a.box;
    c.offset = offset;
    c.length = n;
    c.logical_bytes = n;
    c.checksum = 0x9e3779b97f4a7c15ull ^ offset;
    c.blocks.push_back(BlockMeta{0, n, n, 0x9e3779b97f4a7c15ull ^ offset});
    chunks.push_back(std::move(c));
    offset += n;
  }
  return save_protocol::encode_write_report(offset, offset, chunks);
}

// What the Group's byte collectives deliver to each member (process_group.cpp).
struct Traffic {
  uint64_t sent = 0, received = 0;
};

// Runs `fn` in a forked child; returns its JSON, with "peak_mib" (VmHWM over
// the RSS the child started with) added.
json in_child(const std::function<json()>& fn) {
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
  std::cout.flush();
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    close(fds[0]);
    std::string out;
    try {
      const uint64_t base = proc_status_kib("VmRSS:");
      json j = fn();
      j["peak_mib"] = (static_cast<double>(proc_status_kib("VmHWM:")) - static_cast<double>(base)) / 1024.0;
      out = j.dump();
    } catch (const std::exception& e) {
      out = json{{"error", e.what()}}.dump();
    }
    size_t done = 0;
    while (done < out.size()) {
      ssize_t n = write(fds[1], out.data() + done, out.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    close(fds[1]);
    _exit(0);
  }
  close(fds[1]);
  std::string text;
  char buf[65536];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (text.empty()) return json{{"error", "the child died (status " + std::to_string(status) + ")"}};
  return json::parse(text);
}

struct Scenario {
  Layout layout;
  std::string work_dir;
  int typical_rank = 1;
};

// The coordinator: plan from every local plan, then the metadata from every
// write report. Writes the typical rank's reply and the metadata to work_dir.
json coordinator_role(const Scenario& s, const std::vector<Param>& params) {
  const int world = s.layout.world;
  json j;
  // Received: every rank's framed local plan (gather), built here as it
  // arrives; the coordinator's own plan is not sent.
  std::vector<Bytes> gathered(world);
  uint64_t longest = 0, received = 0;
  for (int r = 0; r < world; ++r) {
    gathered[r] = tagged(encode_local_plan(local_plan(params, s.layout, r)));
    longest = std::max<uint64_t>(longest, gathered[r].size());
  }
  received = static_cast<uint64_t>(world - 1) * (longest + 8) + 8 * 1;
  auto t = Clock::now();
  CoordinatorPlan kept;
  std::vector<Bytes> replies = save_protocol::plan_replies(std::move(gathered), PlanOptions{},
                                                           s.work_dir, 12345, &kept);
  const double plan_s = seconds_since(t);
  if (replies.empty() || replies[0].empty() || replies[0][0] != 1) {
    throw std::runtime_error("planning failed: " + std::string(replies[0].begin() + 1, replies[0].end()));
  }
  uint64_t reply_longest = 0;
  for (const Bytes& r : replies) reply_longest = std::max<uint64_t>(reply_longest, r.size());
  uint64_t sent = static_cast<uint64_t>(world - 1) * (reply_longest + 8) + 8;
  {
    std::ofstream out(s.work_dir + "/reply.bin", std::ios::binary);
    out.write(reinterpret_cast<const char*>(replies[s.typical_rank].data()),
              static_cast<std::streamsize>(replies[s.typical_rank].size()));
    std::ofstream w(s.work_dir + "/reply_width.txt");
    w << reply_longest + 8;
  }
  replies = {};
  // The write reports, then the metadata.
  std::vector<Bytes> reports(world);
  uint64_t report_longest = 0;
  for (int r = 0; r < world; ++r) {
    reports[r] = tagged(write_report(kept.assignments(r)));
    report_longest = std::max<uint64_t>(report_longest, reports[r].size());
  }
  received += static_cast<uint64_t>(world - 1) * (report_longest + 8) + 8;
  t = Clock::now();
  SaveOptions options;
  options.step = 100;
  options.layout = s.layout.describe();
  SaveStats stats;
  Bytes encoded = save_protocol::assemble_metadata(kept, reports, options, stats);
  reports = {};
  const double meta_s = seconds_since(t);
  sent += 8 + 17;  // the verdict
  const uint64_t chunks = kept.item_of.size();
  {
    std::ofstream out(s.work_dir + "/" + kMetadataFileName, std::ios::binary);
    out.write(reinterpret_cast<const char*>(encoded.data()), static_cast<std::streamsize>(encoded.size()));
  }
  j["plan_s"] = plan_s;
  j["metadata_s"] = meta_s;
  j["received_bytes"] = received;
  j["sent_bytes"] = sent;
  j["metadata_bytes"] = encoded.size();
  j["chunks"] = chunks;
  j["items"] = kept.items.size();
  return j;
}

// A typical rank: its local plan, its reply, its write report. The cached
// second save: structure hash and one all-reduce.
json rank_role(const Scenario& s, const std::vector<Param>& params) {
  std::ifstream in(s.work_dir + "/reply.bin", std::ios::binary);
  Bytes reply((std::istreambuf_iterator<char>(in)), {});
  std::ifstream win(s.work_dir + "/reply_width.txt");
  uint64_t reply_width = 0;
  win >> reply_width;
  auto t = Clock::now();
  Bytes blob = encode_local_plan(local_plan(params, s.layout, s.typical_rank));
  const uint64_t structure = save_protocol::structure_hash(blob, PlanOptions{}, s.layout.world, s.typical_rank);
  std::vector<WriteAssignment> mine = save_protocol::assignments_from_reply(reply, nullptr);
  const double plan_s = seconds_since(t);
  Bytes report = write_report(mine);
  json j;
  j["plan_s"] = plan_s;
  // Sent: its framed local plan, its framed report, the two MAX lengths.
  // Received: the two MAX lengths, the scatter width, its framed reply, the
  // verdict's length and bytes.
  j["sent_bytes"] = blob.size() + 1 + 8 + report.size() + 1 + 8 + 16;
  j["received_bytes"] = 8 + 8 + 8 + reply_width + 8 + 17;
  j["assignments"] = mine.size();
  // Second save, plan cached: the structure hash of a new local plan and the
  // agreement's 24 bytes.
  t = Clock::now();
  Bytes again = encode_local_plan(local_plan(params, s.layout, s.typical_rank));
  const bool same = save_protocol::structure_hash(again, PlanOptions{}, s.layout.world,
                                                  s.typical_rank) == structure;
  j["cached_plan_s"] = seconds_since(t);
  j["cached_hit"] = same;
  j["cached_sent_bytes"] = 24;
  j["cached_received_bytes"] = 24;
  return j;
}

// A loading rank: the head, then only the records of the chunks its regions
// overlap (MetadataReader, as load_state_dict reads). "Own" is what describes
// its regions: those chunks' records and directory entries.
json load_role(const Scenario& s, const std::vector<Param>& params, const Layout& loading, int rank) {
  std::shared_ptr<Storage> storage = posix_storage();
  auto t = Clock::now();
  MetadataReader reader(*storage, s.work_dir);
  const uint64_t head_bytes = reader.bytes_read();
  const LocalPlan wanted = local_plan(params, loading, rank);
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < reader.head().items.size(); ++i) index[reader.head().items[i].name] = i;
  uint64_t own = 0, chunks = 0;
  for (const WriteItem& w : wanted.items) {
    for (const ChunkMeta& c : reader.chunks_overlapping(index.at(w.name), {w.box})) {
      wire::ByteWriter record;
      metadata_codec::put_chunk(record, c);
      own += record.bytes().size() + metadata_codec::kDirEntryBytes;
      ++chunks;
    }
  }
  json j;
  j["loading"] = loading.describe();
  j["rank"] = rank;
  j["read_s"] = seconds_since(t);
  j["head_bytes"] = head_bytes;
  j["bytes_read"] = reader.bytes_read();
  j["own_bytes"] = own;
  j["chunks"] = chunks;
  j["ratio"] = own > 0 ? static_cast<double>(reader.bytes_read() - head_bytes) / static_cast<double>(own) : 0.0;
  return j;
}

// The layout `kind` at `world` ranks, sharded as that kind is.
Scenario make_scenario(const std::string& kind, int world, int hsdp_shard) {
  Scenario s;
  s.layout.kind = kind;
  s.layout.world = world;
  s.layout.shard = kind == "fsdp" ? world : kind == "hsdp" ? std::min(hsdp_shard, world) : 1;
  s.typical_rank = world / 2 + 1;
  return s;
}

// Each role in a child process of its own, in a scratch directory: the
// coordinator, then (when it worked) a typical rank, its load, and a load
// resharded to FSDP over 3/4 of the ranks (e.g. 64 -> 48).
json run_scenario(Scenario& s, const std::vector<Param>& params, const std::string& work) {
  const std::string& kind = s.layout.kind;
  const int world = s.layout.world;
  s.work_dir = work + "/scale_bench_" + std::to_string(getpid()) + "_" + kind + std::to_string(world);
  std::string mk = "mkdir -p '" + s.work_dir + "'";
  if (std::system(mk.c_str()) != 0) throw std::runtime_error("cannot make " + s.work_dir);
  json row = {{"layout", kind}, {"world", world}, {"describe", s.layout.describe()},
              {"items_per_rank", params.size() * 3 + 1}};
  row["coordinator"] = in_child([&] { return coordinator_role(s, params); });
  if (!row["coordinator"].contains("error")) {
    row["rank"] = in_child([&] { return rank_role(s, params); });
    row["load"] = in_child([&] { return load_role(s, params, s.layout, s.typical_rank); });
    Layout smaller{"fsdp", std::max(1, world * 3 / 4), std::max(1, world * 3 / 4)};
    row["load_resharded"] = in_child([&] { return load_role(s, params, smaller, smaller.world / 2 + 1); });
  }
  std::string rm = "rm -rf '" + s.work_dir + "'";
  (void)std::system(rm.c_str());
  return row;
}

void print_header() {
  std::cout << std::left << std::setw(16) << "layout" << std::right << std::setw(10) << "coord s"
            << std::setw(10) << "coord MiB" << std::setw(12) << "coord recv" << std::setw(10)
            << "rank s" << std::setw(10) << "rank MiB" << std::setw(11) << "rank recv"
            << std::setw(11) << "cached ms" << std::setw(11) << "meta MiB" << std::setw(11)
            << "load KiB" << std::setw(9) << "x own" << std::setw(12) << "reshard KiB" << "\n";
}

// The scenario's line of the table, or what failed.
void print_row(const Scenario& s, json& row) {
  const json& c = row["coordinator"];
  if (c.contains("error")) {
    std::cout << std::left << std::setw(16) << s.layout.describe() << "FAILED: " << c["error"].get<std::string>() << "\n";
    return;
  }
  const json& r = row["rank"];
  std::cout << std::left << std::setw(16) << s.layout.describe() << std::right << std::fixed
            << std::setprecision(2) << std::setw(10)
            << c["plan_s"].get<double>() + c["metadata_s"].get<double>() << std::setw(10)
            << std::setprecision(0) << c["peak_mib"].get<double>() << std::setw(12)
            << std::setprecision(1) << c["received_bytes"].get<double>() / 1048576.0
            << std::setw(10) << std::setprecision(4) << r["plan_s"].get<double>() << std::setw(10)
            << std::setprecision(1) << r["peak_mib"].get<double>() << std::setw(11)
            << std::setprecision(3) << r["received_bytes"].get<double>() / 1048576.0
            << std::setw(11) << std::setprecision(3) << r["cached_plan_s"].get<double>() * 1e3
            << std::setw(11) << std::setprecision(1)
            << c["metadata_bytes"].get<double>() / 1048576.0 << std::setw(11)
            << row["load"].value("bytes_read", 0.0) / 1024.0 << std::setw(9) << std::setprecision(2)
            << row["load"].value("ratio", 0.0) << std::setw(12) << std::setprecision(1)
            << row["load_resharded"].value("bytes_read", 0.0) / 1024.0 << "\n";
  std::cout.flush();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"scale_bench: save planning and checkpoint metadata at simulated scale"};
  std::vector<int> ranks{64, 256, 1024, 4096, 16384};
  std::vector<std::string> layouts{"fsdp", "hsdp", "ddp"};
  int hsdp_shard = 8;
  int max_replicated_ranks = 16384;
  std::string json_path;
  std::string work = "/tmp";
  app.add_option("--ranks", ranks, "simulated world sizes")->delimiter(',');
  app.add_option("--layouts", layouts, "fsdp, hsdp, ddp")->delimiter(',');
  app.add_option("--hsdp-shard", hsdp_shard, "ranks one HSDP copy is sharded over");
  app.add_option("--max-replicated-ranks", max_replicated_ranks,
                 "skip hsdp and ddp above this world (printed)");
  app.add_option("--json", json_path, "write the JSON here ('-': stdout)");
  app.add_option("--work-dir", work, "scratch directory");
  CLI11_PARSE(app, argc, argv);

  const std::vector<Param> params = llama7b_params();
  json rows = json::array();
  print_header();
  for (const std::string& kind : layouts) {
    for (int world : ranks) {
      Scenario s = make_scenario(kind, world, hsdp_shard);
      if (kind != "fsdp" && world > max_replicated_ranks) {
        std::cout << std::left << std::setw(16) << s.layout.describe()
                  << "skipped: above --max-replicated-ranks\n";
        continue;
      }
      rows.push_back(run_scenario(s, params, work));
      print_row(s, rows.back());
    }
  }
  json out = {{"benchmark", "scale_bench"}, {"rows", rows}};
  if (json_path == "-") {
    std::cout << out.dump(2) << "\n";
  } else if (!json_path.empty()) {
    std::ofstream(json_path) << out.dump(2) << "\n";
  }
  return 0;
}
