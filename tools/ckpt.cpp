// ckpt: look at checkpoints without LibTorch or a GPU.
//   ckpt list DIR [--json]      the checkpoints in a checkpoint.dir and their status
//                               (committed, damaged, uncommitted, set-aside)
//   ckpt inspect CKPT [--chunks] [--json]
//                               what a checkpoint's metadata says
//   ckpt verify CKPT [--threads N] [--json]
//                               read every chunk back and check its checksum
//   ckpt export CKPT --format safetensors|torch|dcp --out FILE [--dtype bf16|fp32] [--only model]
//   ckpt import-dcp SRC DST [--map FROM=TO ...] [--threads N]
//                               consolidate into one file of full tensors
//   ckpt tiers DURABLE_DIR --local DIR [--local DIR ...] | --local PATTERN --nodes N
//              [--verify] [--threads N] [--json]
//                               multi-level checkpoints: each step in the durable
//                               tier and every node's local tier, and what resume
//                               would load (the trainer's choose_resume_tiers)
// Exit codes: 0 success (verify, tiers --verify: everything intact), 1 failure or damage,
// 2 usage error. --json prints one JSON object on stdout and nothing else
// there; errors still go to stderr. Everything read from disk is untrusted:
// the metadata decoder validates it, and names are escaped before they reach
// the terminal.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <thread_pool/thread_pool.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <exception>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/interop/dcp.h"
#include "checkpoint/interop/export.h"
#include "checkpoint/interop/hf.h"
#include "framework/config/config.h"
#include "framework/config/run_items.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/storage/storage.h"
#include "checkpoint/tiers/local_tier.h"
#include "tools/tier_report.h"
#include "tools/command_line.h"

namespace {

using checkpoint::CheckpointMeta;
using checkpoint::ChunkMeta;
using checkpoint::ItemMeta;

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// ---------------------------------------------------------------- formatting

// Hostile names must not drive the terminal: control bytes become \xNN.
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string human_bytes(uint64_t bytes) {
  static const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes) / 1024;
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", value, kUnits[unit]);
  return buf;
}

// `unix_s` through strftime(`format`), as UTC or local time; "@<unix_s>"
// when out of range.
std::string format_time(int64_t unix_s, const char* format, bool utc) {
  const std::time_t t = static_cast<std::time_t>(unix_s);
  std::tm tm{};
  char buf[64];
  const bool split = (utc ? gmtime_r(&t, &tm) : localtime_r(&t, &tm)) != nullptr;
  if (!split || std::strftime(buf, sizeof buf, format, &tm) == 0) return "@" + std::to_string(unix_s);
  return buf;
}

// Local time as "2024-05-01 12:00:00".
std::string local_time(int64_t unix_s) { return format_time(unix_s, "%Y-%m-%d %H:%M:%S", false); }

// UTC as ISO 8601, "2024-05-01T12:00:00Z".
std::string utc_iso8601(int64_t unix_s) { return format_time(unix_s, "%Y-%m-%dT%H:%M:%SZ", true); }

// Names from disk need not be UTF-8: replace rather than throw.
void print_json(const nlohmann::ordered_json& j) {
  std::cout << j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
}

// "ckpt verify: <target>: <message>"; the target only when the message does
// not name it already (bad_alloc cannot).
void print_error(const std::string& command, const std::string& target, const std::string& message) {
  std::cerr << "ckpt " << command << ": "
            << (message.find(target) == std::string::npos ? printable(target) + ": " : "")
            << printable(message) << "\n";
}

// Left-aligned columns separated by two spaces.
void print_table(const std::vector<std::vector<std::string>>& rows, std::ostream& out) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    width.resize(std::max(width.size(), row.size()), 0);
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line += std::string(width[i] - row[i].size() + 2, ' ');
    }
    out << line << "\n";
  }
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

// ---------------------------------------------------------------- checkpoints

// Where the tool reads checkpoints: the local file system.
checkpoint::Storage& storage() { return *checkpoint::posix_storage(); }

struct ItemSummary {
  uint64_t logical_bytes = 0;
  uint64_t stored_bytes = 0;
  std::vector<std::vector<std::string>> transform_chains;  // distinct, in chunk order
};

// "bytegroup/1+zstd/1, zstd/1"; "-" for untransformed.
std::string chains_to_string(const std::vector<std::vector<std::string>>& chains) {
  if (chains.empty()) return "-";
  std::vector<std::string> parts;
  for (const auto& chain : chains) parts.push_back(chain.empty() ? "-" : join(chain, "+"));
  return join(parts, ", ");
}

std::string hex64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

ItemSummary summarize(const ItemMeta& item) {
  ItemSummary s;
  std::set<std::vector<std::string>> seen;
  for (const ChunkMeta& c : item.chunks) {
    s.logical_bytes += c.logical_bytes;
    s.stored_bytes += c.length;
    if (seen.insert(c.transforms).second) s.transform_chains.push_back(c.transforms);
  }
  return s;
}

struct Totals {
  uint64_t chunks = 0;
  uint64_t logical_bytes = 0;
  uint64_t stored_bytes = 0;
  std::set<std::string> files;
};

Totals totals_of(const CheckpointMeta& meta) {
  Totals t;
  for (const ItemMeta& item : meta.items) {
    for (const ChunkMeta& c : item.chunks) {
      ++t.chunks;
      t.logical_bytes += c.logical_bytes;
      t.stored_bytes += c.length;
      t.files.insert(c.file);
    }
  }
  return t;
}

std::string ratio(uint64_t stored, uint64_t logical) {
  if (logical == 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", static_cast<double>(stored) / static_cast<double>(logical));
  return buf;
}

// ---------------------------------------------------------------- list

// A damaged entry's error without its directory, which the PATH column
// already shows: "/c/step_20/.metadata: truncated" -> ".metadata: truncated".
std::string short_reason(const checkpoint::CheckpointStatusEntry& e) {
  std::string reason = e.error;
  const std::string prefix = e.entry.path + "/";
  for (size_t at; (at = reason.find(prefix)) != std::string::npos;) reason.erase(at, prefix.size());
  return reason;
}

nlohmann::ordered_json list_json(const std::string& dir,
                                 const std::vector<checkpoint::CheckpointStatusEntry>& entries) {
  nlohmann::ordered_json checkpoints = nlohmann::ordered_json::array();
  for (const checkpoint::CheckpointStatusEntry& e : entries) {
    nlohmann::ordered_json j = {{"step", e.entry.step},
                                {"status", checkpoint::checkpoint_status_name(e.status)},
                                {"bytes", e.entry.bytes},
                                {"mtime_unix_s", e.entry.mtime_unix_s},
                                {"mtime", utc_iso8601(e.entry.mtime_unix_s)},
                                {"path", e.entry.path}};
    if (e.status == checkpoint::CheckpointStatus::kDamaged) j["error"] = e.error;
    checkpoints.push_back(std::move(j));
  }
  return {{"dir", dir}, {"checkpoints", checkpoints}};
}

// Exits 0 whatever the statuses: listing is not checking (verify checks).
int run_list(const std::string& dir, bool json) {
  const std::vector<checkpoint::CheckpointStatusEntry> entries =
      checkpoint::list_checkpoints_with_status(storage(), dir);
  if (json) {
    print_json(list_json(dir, entries));
    return kExitOk;
  }
  if (entries.empty()) {
    std::cout << "no checkpoints in " << printable(dir) << "\n";
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows = {{"STEP", "STATUS", "SIZE", "DATE", "PATH"}};
  bool any_damaged = false;
  for (const checkpoint::CheckpointStatusEntry& e : entries) {
    rows.push_back({std::to_string(e.entry.step), checkpoint::checkpoint_status_name(e.status),
                    human_bytes(e.entry.bytes), local_time(e.entry.mtime_unix_s),
                    printable(e.entry.path)});
    if (e.status == checkpoint::CheckpointStatus::kDamaged) {
      rows.back().push_back(printable(short_reason(e)));
      any_damaged = true;
    }
  }
  // A REASON column only when some entry is damaged; other rows end at PATH.
  if (any_damaged) rows.front().push_back("REASON");
  print_table(rows, std::cout);
  return kExitOk;
}

// ---------------------------------------------------------------- inspect

std::string chunk_line(size_t index, const ChunkMeta& c) {
  std::ostringstream line;
  line << "    chunk " << index << "  box " << checkpoint::box_to_string(c.box) << "  "
       << printable(c.file) << " @" << c.offset << " +" << c.length << "  logical " << c.logical_bytes
       << "  rank " << c.writer_rank << "  xxh3 " << hex64(c.checksum);
  if (!c.transforms.empty()) line << "  " << printable(join(c.transforms, "+"));
  if (!c.blocks.empty()) {
    line << "  blocks " << c.blocks.size() << ":";
    for (const checkpoint::BlockMeta& b : c.blocks) {
      line << " [" << b.stored_offset << " +" << b.stored_length << " -> " << b.logical_length
           << " xxh3 " << hex64(b.checksum) << "]";
    }
  }
  return line.str();
}

void print_inspect_text(const std::string& path, const CheckpointMeta& meta, bool chunks) {
  std::vector<std::vector<std::string>> header = {
      {"checkpoint", printable(path)},
      {"format", "version " + std::to_string(meta.format_version)},
      {"step", std::to_string(meta.step)},
      {"world size", std::to_string(meta.world_size)},
      {"layout", meta.layout.empty() ? "-" : printable(meta.layout)},
      {"created", local_time(meta.created_unix_s) + " (" + std::to_string(meta.created_unix_s) + ")"}};
  const char* label = "info";  // on the first info line only
  for (const auto& [key, value] : meta.info) {
    header.push_back({label, printable(key) + " = " + printable(value)});
    label = "";
  }
  print_table(header, std::cout);
  std::cout << "\n";

  std::vector<std::vector<std::string>> rows = {
      {"ITEM", "KIND", "DTYPE", "SHAPE", "CHUNKS", "LOGICAL", "STORED", "TRANSFORMS"}};
  for (const ItemMeta& item : meta.items) {
    const ItemSummary s = summarize(item);
    rows.push_back({printable(item.name), checkpoint::item_kind_name(item.kind),
                    checkpoint::dtype_name(item.dtype), checkpoint::shape_to_string(item.global_shape),
                    std::to_string(item.chunks.size()), human_bytes(s.logical_bytes),
                    human_bytes(s.stored_bytes), printable(chains_to_string(s.transform_chains))});
  }
  if (!chunks) {
    print_table(rows, std::cout);
  } else {
    // One table for the items, each followed by its chunks (not aligned).
    std::ostringstream table;
    print_table(rows, table);
    std::istringstream lines(table.str());
    std::string line;
    std::getline(lines, line);
    std::cout << line << "\n";
    for (const ItemMeta& item : meta.items) {
      std::getline(lines, line);
      std::cout << line << "\n";
      for (size_t i = 0; i < item.chunks.size(); ++i) std::cout << chunk_line(i, item.chunks[i]) << "\n";
    }
  }
  const Totals t = totals_of(meta);
  std::cout << "\ntotal: " << meta.items.size() << " items, " << t.chunks << " chunks, "
            << t.files.size() << " files, " << human_bytes(t.logical_bytes) << " logical ("
            << t.logical_bytes << " bytes), " << human_bytes(t.stored_bytes) << " stored ("
            << t.stored_bytes << " bytes), stored/logical " << ratio(t.stored_bytes, t.logical_bytes)
            << "\n";
}

nlohmann::ordered_json chunk_json(const ChunkMeta& c) {
  nlohmann::ordered_json blocks = nlohmann::ordered_json::array();
  for (const checkpoint::BlockMeta& b : c.blocks) {
    blocks.push_back({{"stored_offset", b.stored_offset},
                      {"stored_length", b.stored_length},
                      {"logical_length", b.logical_length},
                      {"checksum", b.checksum}});
  }
  return {{"offsets", c.box.offsets},
          {"sizes", c.box.sizes},
          {"file", c.file},
          {"offset", c.offset},
          {"length", c.length},
          {"logical_bytes", c.logical_bytes},
          {"transforms", c.transforms},
          {"checksum", c.checksum},
          {"writer_rank", c.writer_rank},
          {"blocks", blocks}};
}

nlohmann::ordered_json inspect_json(const std::string& path, const CheckpointMeta& meta, bool chunks) {
  nlohmann::ordered_json items = nlohmann::ordered_json::array();
  for (const ItemMeta& item : meta.items) {
    const ItemSummary s = summarize(item);
    nlohmann::ordered_json j = {{"name", item.name},
                        {"kind", checkpoint::item_kind_name(item.kind)},
                        {"dtype", checkpoint::dtype_name(item.dtype)},
                        {"shape", item.global_shape},
                        {"num_chunks", item.chunks.size()},
                        {"logical_bytes", s.logical_bytes},
                        {"stored_bytes", s.stored_bytes},
                        {"transform_chains", s.transform_chains}};
    if (chunks) {
      j["chunks"] = nlohmann::ordered_json::array();
      for (const ChunkMeta& c : item.chunks) j["chunks"].push_back(chunk_json(c));
    }
    items.push_back(std::move(j));
  }
  const Totals t = totals_of(meta);
  return {{"path", path},
          {"format_version", meta.format_version},
          {"step", meta.step},
          {"world_size", meta.world_size},
          {"layout", meta.layout},
          {"created_unix_s", meta.created_unix_s},
          {"created", local_time(meta.created_unix_s)},
          {"info", meta.info},
          {"items", items},
          {"totals",
           {{"items", meta.items.size()},
            {"chunks", t.chunks},
            {"files", t.files.size()},
            {"logical_bytes", t.logical_bytes},
            {"stored_bytes", t.stored_bytes}}}};
}

int run_inspect(const std::string& path, bool chunks, bool json) {
  const CheckpointMeta meta = checkpoint::read_committed_metadata(storage(), path);
  if (json) {
    print_json(inspect_json(path, meta, chunks));
  } else {
    print_inspect_text(path, meta, chunks);
  }
  return kExitOk;
}

// ---------------------------------------------------------------- verify

std::string problem_line(const checkpoint::VerifyProblem& p) {
  std::ostringstream line;
  line << "BAD";
  if (!p.item.empty()) line << " item '" << printable(p.item) << "'";
  line << " chunk " << p.chunk;
  if (!p.file.empty()) line << " (" << printable(p.file) << ")";
  line << ": " << printable(p.message);
  return line.str();
}

nlohmann::ordered_json verify_json(const std::string& path, const checkpoint::VerifyReport& report,
                                   double seconds, const std::string& error) {
  nlohmann::ordered_json problems = nlohmann::ordered_json::array();
  for (const checkpoint::VerifyProblem& p : report.problems) {
    problems.push_back({{"item", p.item}, {"chunk", p.chunk}, {"file", p.file}, {"error", p.message}});
  }
  nlohmann::ordered_json j = {{"path", path},
                              {"ok", error.empty() && report.ok()},
                              {"chunks", report.chunks},
                              {"bytes", report.bytes},
                              {"seconds", seconds}};
  if (!error.empty()) j["error"] = error;
  j["problems"] = problems;
  return j;
}

std::string seconds_text(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", seconds);
  return buf;
}

int run_verify(const std::string& path, int threads, bool json) {
  const auto start = std::chrono::steady_clock::now();
  thread_pool::ThreadPool pool(static_cast<size_t>(threads));
  checkpoint::VerifyReport report;
  std::string error;  // the metadata could not be read: nothing was verified
  try {
    report = checkpoint::verify_checkpoint(storage(), path, &pool);
  } catch (const std::exception& e) {
    if (!json) throw;
    error = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (json) {
    // Even a checkpoint whose metadata does not read gets its object, with
    // "error" (and ok false); the error also goes to stderr as in text mode.
    print_json(verify_json(path, report, seconds, error));
    if (!error.empty()) print_error("verify", path, error);
    return error.empty() && report.ok() ? kExitOk : kExitFailure;
  }
  if (report.ok()) {
    std::cout << "OK: " << report.chunks << " chunks, " << report.bytes << " bytes verified in "
              << seconds_text(seconds) << " s\n";
    return kExitOk;
  }
  for (const checkpoint::VerifyProblem& p : report.problems) std::cout << problem_line(p) << "\n";
  std::cout << "FAILED: " << printable(path) << ": " << report.problems.size() << " problem(s) in "
            << report.chunks << " chunks\n";
  return kExitFailure;
}

// ---------------------------------------------------------------- tiers

const char* durable_status(const tools::DurableStep& d) {
  return d.entry ? checkpoint::checkpoint_status_name(d.entry->status) : "absent";
}

const char* node_status(const tools::NodeStep& n) {
  return n.step ? checkpoint::checkpoint_status_name(n.status) : "absent";
}

// "nodes 0, 1" / "node 1": where a set of files came from.
std::string nodes_text(const std::set<int>& nodes) {
  std::vector<std::string> parts;
  for (int n : nodes) parts.push_back(std::to_string(n));
  return (nodes.size() == 1 ? "node " : "nodes ") + join(parts, ", ");
}

// "own files 2 of 2; partner copies committed (2 files, of node 1)".
std::string node_contents(const checkpoint::LocalStep& s) {
  std::string out = s.record ? "own files " + std::to_string(s.own.size()) + " of " +
                                   std::to_string(s.record->files.size())
                             : std::string("no ") + checkpoint::kLocalRecordName;
  if (!s.partner) return out + "; partner copies: none";
  std::set<int> from;
  for (const checkpoint::TierFile& f : s.partner->files) from.insert(f.node);
  out += "; partner copies committed (";
  if (s.partner_copies.size() != s.partner->files.size()) {
    out += std::to_string(s.partner_copies.size()) + " of ";
  }
  out += std::to_string(s.partner->files.size()) + (s.partner->files.size() == 1 ? " file" : " files");
  if (!from.empty()) out += ", of " + nodes_text(from);
  return out + ")";
}

// "rank_2.data, rank_3.data: on node 1; rank_0.data: partner copy on node 0".
std::string elsewhere_text(const std::vector<tools::FileLocation>& files) {
  std::map<std::pair<int, bool>, std::vector<std::string>> by_place;
  for (const tools::FileLocation& f : files) by_place[{f.node, f.partner}].push_back(printable(f.file));
  std::vector<std::string> parts;
  for (const auto& [place, names] : by_place) {
    const auto [node, partner] = place;
    const std::string copies = names.size() == 1 ? "partner copy" : "partner copies";
    parts.push_back(join(names, ", ") + ": " +
                    (node < 0 ? std::string("on no node")
                              : (partner ? copies + " on node " : std::string("on node ")) + std::to_string(node)));
  }
  return join(parts, "; ");
}

std::string candidate_text(const checkpoint::ResumeCandidate& c) {
  return std::string(checkpoint::tier_name(c.tier)) + ": " + printable(c.reason);
}

// "step 30 from the local tier (every rank file is on its own node)".
std::string resume_text(const checkpoint::ResumeCandidate& c) {
  return "step " + std::to_string(c.step) + " from the " + checkpoint::tier_name(c.tier) + " tier (" +
         printable(c.reason) + ")";
}

constexpr const char* kIndent = "           ";  // under the second column

void print_verify_lines(const checkpoint::VerifyReport& report, const std::string& error,
                        const std::string& elsewhere) {
  if (!error.empty()) {
    std::cout << kIndent << "BAD: " << printable(error) << "\n";
    return;
  }
  // An overview: the first few bad chunks (`ckpt verify` and --json list all).
  constexpr size_t kMaxLines = 5;
  for (size_t i = 0; i < report.problems.size() && i < kMaxLines; ++i) {
    std::cout << kIndent << problem_line(report.problems[i]) << "\n";
  }
  if (report.problems.size() > kMaxLines) {
    std::cout << kIndent << "... and " << report.problems.size() - kMaxLines << " more bad chunks\n";
  }
  std::cout << kIndent << "verified: " << report.chunks - report.problems.size() << " of "
            << report.chunks << " chunks intact (" << human_bytes(report.bytes) << ")";
  if (!elsewhere.empty()) std::cout << "; " << elsewhere;
  std::cout << "\n";
}

// `s` followed by spaces up to `width` (at least one).
std::string padded(const std::string& s, size_t width) {
  return s + std::string(s.size() < width ? width - s.size() : 1, ' ');
}

// "  node 0   committed    <what>": a line of a step; without `what`, the
// status ends it.
std::string step_line(const std::string& label, const std::string& status, const std::string& what) {
  return "  " + padded(label, 9) + (what.empty() ? status : padded(status, 13) + what) + "\n";
}

void print_node_step(const tools::NodeStep& n) {
  std::cout << step_line("node " + std::to_string(n.node), node_status(n),
                         n.step ? node_contents(*n.step) : "");
  if (!n.step) return;
  if (n.status == checkpoint::CheckpointStatus::kDamaged) {
    std::cout << kIndent << "error: " << printable(n.status_error) << "\n";
  }
  for (const std::string& p : n.step->problems) std::cout << kIndent << "problem: " << printable(p) << "\n";
  const tools::LocalVerify& v = n.verify;
  if (v.ran && n.status != checkpoint::CheckpointStatus::kDamaged) {
    print_verify_lines(v.report, v.error, elsewhere_text(v.elsewhere));
  }
  if (!v.partner_copies.empty()) {
    std::vector<std::string> intact;
    for (const tools::PartnerCopyCheck& c : v.partner_copies) {
      if (c.problem.empty()) {
        intact.push_back(printable(c.file.name));
      } else {
        std::cout << kIndent << "BAD partner copy: " << printable(c.problem) << "\n";
      }
    }
    if (!intact.empty()) {
      std::cout << kIndent << "partner copies intact (XXH3-64 as recorded): " << join(intact, ", ") << "\n";
    }
  }
}

void print_tiers_text(const tools::TierReport& r) {
  std::vector<std::vector<std::string>> header = {{"durable", printable(r.durable_dir)}};
  for (const tools::NodeTier& n : r.nodes) {
    header.push_back({"node " + std::to_string(n.inventory.node), printable(n.inventory.dir)});
    if (n.missing) header.back().push_back("missing (a lost node)");
    if (!n.inventory.error.empty()) header.back().push_back("error: " + printable(n.inventory.error));
  }
  print_table(header, std::cout);
  if (r.steps.empty()) std::cout << "\nno checkpoints in either tier\n";
  for (const tools::StepReport& s : r.steps) {
    std::cout << "\nstep " << s.step << "\n";
    const tools::DurableStep& d = s.durable;
    std::cout << step_line("durable", durable_status(d), d.entry ? printable(d.entry->entry.path) : "");
    for (const std::string& path : d.set_aside) std::cout << kIndent << "set aside: " << printable(path) << "\n";
    if (d.entry && d.entry->status == checkpoint::CheckpointStatus::kDamaged) {
      std::cout << kIndent << "error: " << printable(d.entry->error) << "\n";
    }
    if (d.verified) print_verify_lines(d.report, d.verify_error, "");
    for (const tools::NodeStep& n : s.nodes) print_node_step(n);
    if (s.candidates.empty()) {
      std::cout << step_line("resume", "not loadable: " + (s.not_loadable.empty() ? "no tier committed it"
                                                                                  : printable(s.not_loadable)),
                             "");
    }
    for (size_t i = 0; i < s.candidates.size(); ++i) {
      std::cout << (i == 0 ? "  resume   " : std::string(kIndent) + "else ") << candidate_text(s.candidates[i])
                << "\n";
    }
  }
  std::cout << "\n";
  for (const std::string& note : r.notes) std::cout << "resume note: " << printable(note) << "\n";
  if (r.verified) {
    if (r.damage.empty()) {
      std::cout << "verify: OK: every committed checkpoint and partner copy is intact\n";
    } else {
      std::cout << "verify: FAILED: " << r.damage.size() << " problem(s)\n";
    }
  }
  for (const tools::FailingCandidate& f : r.failing) {
    std::cout << "resume would fail on step " << f.candidate.step << " from the "
              << checkpoint::tier_name(f.candidate.tier) << " tier: " << printable(f.why) << "\n";
  }
  if (r.resume) {
    std::cout << "resume would load: " << resume_text(*r.resume) << "\n";
  } else if (!r.failing.empty()) {
    std::cout << "resume would fail: no checkpoint it could load is intact\n";
  } else {
    std::cout << "nothing to resume\n";
  }
}

nlohmann::ordered_json report_json(const checkpoint::VerifyReport& report, const std::string& error) {
  nlohmann::ordered_json problems = nlohmann::ordered_json::array();
  for (const checkpoint::VerifyProblem& p : report.problems) {
    problems.push_back({{"item", p.item}, {"chunk", p.chunk}, {"file", p.file}, {"error", p.message}});
  }
  nlohmann::ordered_json j = {{"ok", error.empty() && report.ok()},
                              {"chunks", report.chunks},
                              {"bytes", report.bytes}};
  if (report.skipped) j["skipped"] = report.skipped;
  if (!error.empty()) j["error"] = error;
  j["problems"] = problems;
  return j;
}

nlohmann::ordered_json candidate_json(const checkpoint::ResumeCandidate& c) {
  nlohmann::ordered_json j = {{"step", c.step}, {"tier", checkpoint::tier_name(c.tier)}, {"reason", c.reason}};
  if (c.tier == checkpoint::Tier::kDurable) {
    j["path"] = c.durable_path;
    return j;
  }
  j["world_size"] = c.world_size;
  j["metadata_node"] = c.metadata_node;
  nlohmann::ordered_json sources = nlohmann::ordered_json::array();
  for (const checkpoint::FileSource& s : c.sources) {
    sources.push_back({{"file", s.file.name}, {"node", s.node}, {"partner", s.partner}});
  }
  j["sources"] = sources;
  return j;
}

nlohmann::ordered_json tier_files_json(const std::vector<checkpoint::TierFile>& files) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const checkpoint::TierFile& f : files) out.push_back(f.name);
  return out;
}

nlohmann::ordered_json node_step_json(const tools::NodeStep& n) {
  nlohmann::ordered_json j = {{"node", n.node}, {"path", n.path}, {"status", node_status(n)}};
  if (!n.step) return j;
  const checkpoint::LocalStep& s = *n.step;
  if (n.status == checkpoint::CheckpointStatus::kDamaged) j["error"] = n.status_error;
  j["record"] = s.record.has_value();
  j["own_files"] = tier_files_json(s.own);
  j["recorded_files"] = s.record ? tier_files_json(s.record->files) : nlohmann::ordered_json::array();
  if (s.partner) {
    nlohmann::ordered_json files = nlohmann::ordered_json::array();
    for (const checkpoint::TierFile& f : s.partner->files) {
      bool present = false;
      for (const checkpoint::TierFile& c : s.partner_copies) present = present || c.name == f.name;
      files.push_back({{"file", f.name}, {"from_node", f.node}, {"bytes", f.bytes},
                       {"xxh3", hex64(f.xxh3.value_or(0))}, {"present", present}});
    }
    j["partner_copies"] = files;
  } else {
    j["partner_copies"] = nullptr;
  }
  j["problems"] = s.problems;
  const tools::LocalVerify& v = n.verify;
  if (v.ran || !v.partner_copies.empty()) {
    nlohmann::ordered_json verify =
        v.ran ? report_json(v.report, v.error) : nlohmann::ordered_json::object();
    nlohmann::ordered_json elsewhere = nlohmann::ordered_json::array();
    for (const tools::FileLocation& f : v.elsewhere) {
      elsewhere.push_back({{"file", f.file}, {"node", f.node < 0 ? nlohmann::ordered_json(nullptr)
                                                                  : nlohmann::ordered_json(f.node)},
                           {"partner", f.partner}});
    }
    verify["elsewhere"] = elsewhere;
    nlohmann::ordered_json copies = nlohmann::ordered_json::array();
    for (const tools::PartnerCopyCheck& c : v.partner_copies) {
      nlohmann::ordered_json cj = {{"file", c.file.name}, {"ok", c.problem.empty()}};
      if (!c.problem.empty()) cj["error"] = c.problem;
      copies.push_back(std::move(cj));
    }
    verify["partner_copies"] = copies;
    j["verify"] = verify;
  }
  return j;
}

nlohmann::ordered_json tiers_json(const tools::TierReport& r) {
  nlohmann::ordered_json nodes = nlohmann::ordered_json::array();
  for (const tools::NodeTier& n : r.nodes) {
    nlohmann::ordered_json j = {{"node", n.inventory.node}, {"dir", n.inventory.dir}, {"missing", n.missing}};
    if (!n.inventory.error.empty()) j["error"] = n.inventory.error;
    nodes.push_back(std::move(j));
  }
  nlohmann::ordered_json steps = nlohmann::ordered_json::array();
  for (const tools::StepReport& s : r.steps) {
    const tools::DurableStep& d = s.durable;
    nlohmann::ordered_json durable = {{"status", durable_status(d)}};
    if (d.entry) durable["path"] = d.entry->entry.path;
    if (d.entry && d.entry->status == checkpoint::CheckpointStatus::kDamaged) durable["error"] = d.entry->error;
    durable["set_aside"] = d.set_aside;
    if (d.verified) durable["verify"] = report_json(d.report, d.verify_error);
    nlohmann::ordered_json node_steps = nlohmann::ordered_json::array();
    for (const tools::NodeStep& n : s.nodes) node_steps.push_back(node_step_json(n));
    nlohmann::ordered_json candidates = nlohmann::ordered_json::array();
    for (const checkpoint::ResumeCandidate& c : s.candidates) candidates.push_back(candidate_json(c));
    nlohmann::ordered_json resume = {{"candidates", candidates}};
    if (s.candidates.empty()) resume["not_loadable"] = s.not_loadable;
    steps.push_back({{"step", s.step}, {"durable", durable}, {"nodes", node_steps}, {"resume", resume}});
  }
  nlohmann::ordered_json j = {{"durable_dir", r.durable_dir}, {"nodes", nodes}, {"steps", steps},
                              {"notes", r.notes}};
  if (r.verified) j["verify"] = {{"ok", r.damage.empty()}, {"problems", r.damage}};
  nlohmann::ordered_json failing = nlohmann::ordered_json::array();
  for (const tools::FailingCandidate& f : r.failing) {
    nlohmann::ordered_json c = candidate_json(f.candidate);
    c["error"] = f.why;
    failing.push_back(std::move(c));
  }
  j["failing"] = failing;
  j["resume"] = r.resume ? candidate_json(*r.resume) : nlohmann::ordered_json(nullptr);
  return j;
}

struct TiersArgs {
  std::string durable_dir;
  std::vector<std::string> local;  // directories, or one pattern with {node}
  int nodes = 0;                   // with a pattern
  bool verify = false;
  int threads = 4;
  bool json = false;
};

// The local tier directories, by node; throws std::invalid_argument (a
// usage error) for a combination of --local and --nodes that names none.
std::vector<std::string> local_tier_dirs(const TiersArgs& args) {
  const bool pattern = args.local.size() == 1 && args.local[0].find("{node}") != std::string::npos;
  if (args.nodes > 0) {
    if (!pattern) {
      throw std::invalid_argument("--nodes " + std::to_string(args.nodes) +
                                  " needs one --local pattern containing {node}");
    }
    std::vector<std::string> dirs;
    for (int k = 0; k < args.nodes; ++k) dirs.push_back(checkpoint::local_tier_dir(args.local[0], k));
    return dirs;
  }
  for (const std::string& dir : args.local) {
    if (dir.find("{node}") != std::string::npos) {
      throw std::invalid_argument("--local " + dir + ": a pattern with {node} needs --nodes N");
    }
  }
  return args.local;
}

// Exits 0 without --verify (listing is not checking); with it, 1 when
// anything verified is damaged.
int run_tiers(const TiersArgs& args, const std::vector<std::string>& local_dirs) {
  thread_pool::ThreadPool pool(static_cast<size_t>(args.threads));
  tools::TierReportOptions options;
  options.verify = args.verify;
  options.pool = &pool;
  const tools::TierReport report = tools::build_tier_report(storage(), args.durable_dir, local_dirs, options);
  if (args.json) {
    print_json(tiers_json(report));
  } else {
    print_tiers_text(report);
  }
  return args.verify && !report.damage.empty() ? kExitFailure : kExitOk;
}

// ---------------------------------------------------------------- export

struct ExportArgs {
  std::string format;
  std::string out;
  std::string dtype;  // "", "bf16" or "fp32"
  std::string only;
  std::string max_shard_size = "5GB";  // hf
  std::string tokenizer;               // hf: "", a file, or none
  bool merge_lora = false;             // hf of a LoRA run: the base with the adapters merged
  std::string base;                    // hf --merge-lora, peft: the base directory
  int threads = 4;
};

// "5GB", "500MB", "2GiB", "4096" (bytes), as Hugging Face's max_shard_size
// reads them: KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024.
uint64_t parse_size(const std::string& text) {
  size_t end = 0;
  double v = 0;
  try {
    v = std::stod(text, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  const std::string unit = text.substr(end);
  static const std::map<std::string, double> units = {
      {"", 1},        {"B", 1},           {"KB", 1e3},         {"MB", 1e6},
      {"GB", 1e9},    {"TB", 1e12},       {"KiB", 1024.0},     {"MiB", 1048576.0},
      {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  auto it = units.find(unit);
  if (end == 0 || it == units.end() || v <= 0) {
    throw std::invalid_argument("--max-shard-size " + text + ": expected a size such as 5GB, 500MB or 2GiB");
  }
  return static_cast<uint64_t>(v * it->second);
}

int run_export(const std::string& path, const ExportArgs& args) {
  checkpoint::ExportOptions options;
  options.format = args.format == "torch" ? checkpoint::ExportFormat::kTorch
                   : args.format == "dcp" ? checkpoint::ExportFormat::kDcp
                   : args.format == "hf"  ? checkpoint::ExportFormat::kHf
                   : args.format == "peft" ? checkpoint::ExportFormat::kPeft
                                          : checkpoint::ExportFormat::kSafetensors;
  if (args.merge_lora && args.format != "hf") {
    throw std::invalid_argument("--merge-lora goes with --format hf, not --format " + args.format);
  }
  if (!args.base.empty() && !(args.format == "peft" || args.merge_lora)) {
    throw std::invalid_argument("--base goes with --format peft or --format hf --merge-lora");
  }
  options.merge_lora = args.merge_lora;
  options.base = args.base;
  options.max_shard_bytes = parse_size(args.max_shard_size);
  if (args.dtype == "bf16") options.dtype = checkpoint::DType::kBFloat16;
  if (args.dtype == "fp32") options.dtype = checkpoint::DType::kFloat32;
  options.only = args.only;
  options.io_threads = args.threads;
  options.tokenizer = args.tokenizer;
  options.run = framework::config::make_run_adapter();
  const checkpoint::ExportStats stats = checkpoint::export_checkpoint(path, args.out, options);
  std::cout << "exported " << stats.tensors << " tensors (" << human_bytes(stats.data_bytes)
            << ") to " << printable(args.out) << " (" << args.format << ", "
            << human_bytes(stats.file_bytes) << ")";
  if (!stats.skipped.empty()) std::cout << "; skipped " << stats.skipped.size() << " items";
  if (!stats.tokenizer.empty()) std::cout << "; tokenizer " << printable(stats.tokenizer);
  std::cout << "\n";
  if (!stats.tokenizer_missing.empty()) {
    std::cerr << "ckpt: the run's data.tokenizer " << printable(stats.tokenizer_missing)
              << " is not there: no tokenizer files exported (give --tokenizer FILE)\n";
  }
  return kExitOk;
}

// ---------------------------------------------------------------- import-hf

// The directory's tensors that our model of its config.json names
// otherwise (a mixture of experts' experts, stacked); none when it has no
// config.json we read (its tensors keep their names, as before).
std::vector<checkpoint::RenamedTensor> hf_dir_renames(const std::string& src) {
  const std::string path = checkpoint::join_path(src, "config.json");
  std::shared_ptr<checkpoint::Storage> storage = checkpoint::posix_storage();
  if (!storage->exists(path)) return {};
  std::string text(storage->file_size(path), '\0');
  storage->read_at(path, 0, text.data(), text.size());
  try {
    return framework::config::hf_renames(framework::config::hf_model_options(text, path));
  } catch (const framework::config::ConfigError&) {
    return {};
  }
}

int run_import_hf(const std::string& src, const std::string& dst, int threads) {
  checkpoint::HfImportOptions options;
  options.io_threads = threads;
  options.step_item = framework::config::kStepItem;
  options.renames = hf_dir_renames(src);
  const checkpoint::HfImportStats stats = checkpoint::import_hf_checkpoint(src, dst, options);
  std::cout << "imported " << stats.tensors << " tensors (" << human_bytes(stats.bytes) << " as float32) from "
            << printable(src) << " into " << printable(dst);
  if (!stats.converted.empty()) std::cout << "; converted to float32: " << stats.converted.size() << " tensors";
  std::cout << "; resume it with checkpoint.resume: " << printable(dst) << " and checkpoint.model_only: true\n";
  return kExitOk;
}

// ---------------------------------------------------------------- import-dcp

int run_import_dcp(const std::string& src, const std::string& dst,
                   const std::vector<std::string>& maps, int threads) {
  checkpoint::DcpImportOptions options;
  options.io_threads = threads;
  options.step_item = framework::config::kStepItem;
  for (const std::string& m : maps) {
    const size_t eq = m.find('=');
    if (eq == std::string::npos) {
      throw std::invalid_argument("--map " + m + ": expected FROM=TO (a key prefix and its replacement)");
    }
    options.renames.emplace_back(m.substr(0, eq), m.substr(eq + 1));
  }
  const checkpoint::DcpImportStats stats = checkpoint::import_dcp_checkpoint(src, dst, options);
  std::cout << "imported " << stats.tensors << " items (" << human_bytes(stats.bytes) << ") from "
            << printable(src) << " into " << printable(dst) << ", step " << stats.step;
  if (!stats.ignored.empty()) {
    std::cout << "; not carried: " << stats.ignored.size() << " keys ("
              << checkpoint::join_names(stats.ignored, 4) << ")";
  }
  std::cout << "\n";
  return kExitOk;
}

// What the subcommands' options fill in (some share one: --json, CKPT, --threads).
struct CommandArgs {
  std::string dir;   // list
  std::string ckpt;  // inspect, verify, export
  bool json = false;
  bool chunks = false;
  int threads = 4;
  ExportArgs export_args;
  std::string hf_src, hf_dst;
  std::string dcp_src, dcp_dst;
  std::vector<std::string> maps;
  TiersArgs tiers;
};

// The subcommands, each with its options (in the order --help lists them).
// CKPT, the checkpoint that inspect, verify and export read.
void add_ckpt_arg(CLI::App& command, CommandArgs& a) {
  command.add_option("CKPT", a.ckpt, "a checkpoint directory (step_<N>/)")->required();
}

// --threads of a command's readers or writers.
void add_threads_option(CLI::App& command, int& threads, const char* what) {
  command.add_option("--threads", threads, what)->check(CLI::Range(1, 1024));
}

CLI::App* add_list_command(CLI::App& app, CommandArgs& a) {
  CLI::App* list = app.add_subcommand(
      "list",
      "the checkpoints in a checkpoint.dir and their status: committed, damaged (.metadata "
      "does not read back), uncommitted (no .metadata) or set-aside (step_<N>.damaged)");
  list->add_option("DIR", a.dir, "a checkpoint.dir (holding step_<N>/ directories)")->required();
  list->add_flag("--json", a.json, "print one JSON object: {dir, checkpoints: [...]}");
  return list;
}

CLI::App* add_inspect_command(CLI::App& app, CommandArgs& a) {
  CLI::App* inspect = app.add_subcommand("inspect", "what a checkpoint's metadata says");
  add_ckpt_arg(*inspect, a);
  inspect->add_flag("--chunks", a.chunks, "also list every chunk");
  inspect->add_flag("--json", a.json, "print one JSON object");
  return inspect;
}

CLI::App* add_verify_command(CLI::App& app, CommandArgs& a) {
  CLI::App* verify = app.add_subcommand("verify", "read every chunk back and check its checksum");
  add_ckpt_arg(*verify, a);
  add_threads_option(*verify, a.threads, "reader threads");
  verify->add_flag("--json", a.json, "print one JSON object: {ok, chunks, bytes, seconds, problems}");
  return verify;
}

CLI::App* add_export_command(CLI::App& app, CommandArgs& a) {
  CLI::App* export_cmd = app.add_subcommand(
      "export",
      "consolidate a sharded checkpoint into one file of full tensors (safetensors, or a "
      "torch.save archive that torch.load(f, weights_only=True) reads), or write it as a "
      "PyTorch DCP checkpoint directory (dcp: model and AdamW state, for dcp.load at any world "
      "size), or as a Hugging Face Llama directory (hf: config.json and sharded safetensors "
      "with their index; --merge-lora for a LoRA run: its base with the adapters merged), or as "
      "PEFT's LoRA adapter directory (peft: adapter_config.json and adapter_model.safetensors); "
      "bytes items (RNG state, step, loader position, config) are skipped");
  add_ckpt_arg(*export_cmd, a);
  ExportArgs& e = a.export_args;
  export_cmd->add_option("--format", e.format, "output format")
      ->required()
      ->check(CLI::IsMember({"safetensors", "torch", "dcp", "hf", "peft"}));
  export_cmd->add_option("--out", e.out, "output file, or directory for dcp, hf and peft (written as OUT.tmp, then renamed)")
      ->required();
  export_cmd->add_option("--dtype", e.dtype,
                         "convert floating-point tensors (bf16: round to nearest even); others stay as they are")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  export_cmd->add_option("--only", e.only, "only items named ONLY.<name>, written as <name> (e.g. --only model "
                                           "for the model's parameter names)");
  export_cmd->add_option("--max-shard-size", e.max_shard_size, "hf: the most tensor bytes per safetensors file, "
                                                               "as save_pretrained's max_shard_size (5GB, 500MB, "
                                                               "2GiB; default 5GB)");
  export_cmd->add_option("--tokenizer", e.tokenizer, "hf: the tokenizer.json or .model to ship (default: the run's "
                                                     "data.tokenizer; none: no tokenizer files)");
  export_cmd->add_flag("--merge-lora", e.merge_lora,
                       "hf, of a LoRA run's checkpoint: write its base with W + (alpha/rank) B A merged into "
                       "every adapted projection (float32 unless --dtype)");
  export_cmd->add_option("--base", e.base, "hf --merge-lora, peft: the LoRA base's Hugging Face directory (default: "
                                           "the one the run recorded; its weights must hash the same)");
  add_threads_option(*export_cmd, e.threads, "reader threads");
  return export_cmd;
}

// An import: SRC converted into the checkpoint DST by --threads writers.
CLI::App* add_import_command(CLI::App& app, const char* name, const char* description, std::string& src,
                             const char* src_help, std::string& dst, const char* dst_help) {
  CLI::App* import = app.add_subcommand(name, description);
  import->add_option("SRC", src, src_help)->required();
  import->add_option("DST", dst, dst_help)->required();
  return import;
}

CLI::App* add_import_hf_command(CLI::App& app, CommandArgs& a) {
  CLI::App* import_hf = add_import_command(
      app, "import-hf",
      "convert a Hugging Face model directory (config.json, model.safetensors or sharded with "
      "model.safetensors.index.json) into a model-only shardkit checkpoint, float32, streaming; "
      "resume it with checkpoint.model_only: true at any world size",
      a.hf_src, "a Hugging Face model directory", a.hf_dst, "the checkpoint directory to create, e.g. runs/x/init");
  add_threads_option(*import_hf, a.threads, "writer threads");
  return import_hf;
}

CLI::App* add_import_dcp_command(CLI::App& app, CommandArgs& a) {
  CLI::App* import_dcp = add_import_command(
      app, "import-dcp",
      "convert a PyTorch DCP checkpoint (torchtitan, FSDP2) into a shardkit checkpoint, "
      "streaming: model and AdamW state, reshardable like any checkpoint",
      a.dcp_src, "a DCP checkpoint directory (.metadata, *.distcp)", a.dcp_dst,
      "the checkpoint directory to create, e.g. run/checkpoints/step_1000");
  import_dcp->add_option("--map", a.maps,
                         "FROM=TO: DCP keys starting with FROM get TO instead, before the default "
                         "mapping (repeatable; e.g. --map module.=model.)");
  add_threads_option(*import_dcp, a.threads, "writer threads");
  return import_dcp;
}

CLI::App* add_tiers_command(CLI::App& app, CommandArgs& a) {
  TiersArgs& t = a.tiers;
  CLI::App* tiers = app.add_subcommand(
      "tiers",
      "multi-level checkpoints: every step in the durable tier and in each node's local tier "
      "(committed, own files, partner copies, problems), and which checkpoint the trainer's "
      "resume would load and why");
  tiers->add_option("DURABLE_DIR", t.durable_dir, "the durable tier: a checkpoint.dir")->required();
  tiers->add_option("--local", t.local,
                    "a node's local tier directory, repeatable (node = position), or one "
                    "checkpoint.local.dir pattern containing {node} with --nodes")
      ->required()
      ->allow_extra_args(false);
  tiers->add_option("--nodes", t.nodes, "the number of nodes, with a --local pattern")->check(CLI::Range(1, 1 << 20));
  tiers->add_flag("--verify", t.verify,
                  "also read back every committed checkpoint of every tier (chunk checksums; "
                  "partner copies by their XXH3-64); exit 1 on damage");
  add_threads_option(*tiers, t.threads, "reader threads");
  tiers->add_flag("--json", t.json,
                  "print one JSON object: {durable_dir, nodes, steps: [{step, durable, nodes, "
                  "resume}], notes, verify, failing, resume}");
  return tiers;
}

// What an error message of `command` names: its DIR, SRC, DURABLE_DIR or CKPT.
const std::string& error_target(const std::string& command, const CommandArgs& a) {
  if (command == "list") return a.dir;
  if (command == "import-dcp") return a.dcp_src;
  if (command == "import-hf") return a.hf_src;
  if (command == "tiers") return a.tiers.durable_dir;
  return a.ckpt;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ckpt: list, inspect, verify, export and import shardkit checkpoints, and show "
               "the tiers of multi-level ones"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("ckpt (shardkit) ") + SHARDKIT_VERSION);
  CommandArgs a;
  CLI::App* list = add_list_command(app, a);
  CLI::App* inspect = add_inspect_command(app, a);
  add_verify_command(app, a);  // the remaining case below
  CLI::App* export_cmd = add_export_command(app, a);
  CLI::App* import_hf = add_import_hf_command(app, a);
  CLI::App* import_dcp = add_import_dcp_command(app, a);
  CLI::App* tiers = add_tiers_command(app, a);
  if (const std::optional<int> status = tools::parse_command_line(app, argc, argv)) return *status;

  const std::string command = app.get_subcommands().front()->get_name();
  std::vector<std::string> local_dirs;
  if (*tiers) {
    try {
      local_dirs = local_tier_dirs(a.tiers);
    } catch (const std::invalid_argument& e) {
      std::cerr << "ckpt tiers: " << printable(e.what()) << "\n";
      return kExitUsage;
    }
  }
  try {
    if (*tiers) return run_tiers(a.tiers, local_dirs);
    if (*list) return run_list(a.dir, a.json);
    if (*inspect) return run_inspect(a.ckpt, a.chunks, a.json);
    if (*export_cmd) return run_export(a.ckpt, a.export_args);
    if (*import_dcp) return run_import_dcp(a.dcp_src, a.dcp_dst, a.maps, a.threads);
    if (*import_hf) return run_import_hf(a.hf_src, a.hf_dst, a.threads);
    return run_verify(a.ckpt, a.threads, a.json);
  } catch (const std::exception& e) {
    print_error(command, error_target(command, a), e.what());
    return kExitFailure;
  }
}
