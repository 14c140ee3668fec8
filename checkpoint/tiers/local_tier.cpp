#include "checkpoint/tiers/local_tier.h"

#include "checkpoint/format/checksum.h"
#include "checkpoint/format/metadata.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <type_traits>
#include <set>

namespace checkpoint {

namespace {

using nlohmann::json;

constexpr const char* kLocalFormat = "shardkit-local/1";
constexpr const char* kPartnerFormat = "shardkit-partner/1";
constexpr uint64_t kMaxRecordBytes = 64ull << 20;

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t parse_hex64(const std::string& s, const std::string& where) {
  if (s.size() != 16 || s.find_first_not_of("0123456789abcdef") != std::string::npos) {
    throw FormatError(where + ": xxh3 '" + s + "' is not 16 lowercase hex digits");
  }
  return std::stoull(s, nullptr, 16);
}

json file_json(const TierFile& f) {
  json j = {{"name", f.name}, {"rank", f.rank}, {"node", f.node}, {"bytes", f.bytes}};
  if (f.xxh3) j["xxh3"] = hex64(*f.xxh3);
  return j;
}

// Reads field `key` of `j` as T, or throws FormatError naming it.
// An integer must be a JSON integer within T's range: converting a float,
// or a value T cannot hold, would be undefined behaviour (seen while
// writing fuzz/fuzz_local_tier.cpp, after fuzz_tokenizer_json found the
// same in tokenizer.json).
template <class T>
T integer(const json& v, const std::string& bad) {
  if (!v.is_number_integer()) throw FormatError(bad + "has the wrong type");
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<T>::max())) throw FormatError(bad + "is out of range");
    return static_cast<T>(u);
  }
  const int64_t i = v.get<int64_t>();
  if (i < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
      (std::is_signed_v<T> && i > static_cast<int64_t>(std::numeric_limits<T>::max()))) {
    throw FormatError(bad + "is out of range");
  }
  return static_cast<T>(i);
}

template <class T>
T field(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end()) throw FormatError(where + ": missing field '" + key + "'");
  const std::string bad = where + ": field '" + std::string(key) + "' ";
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    return integer<T>(*it, bad);
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    if (!it->is_array()) throw FormatError(bad + "has the wrong type");
    std::vector<int> out;
    for (const json& v : *it) out.push_back(integer<int>(v, bad));
    return out;
  } else {
    try {
      return it->template get<T>();
    } catch (const json::exception&) {
      throw FormatError(bad + "has the wrong type");
    }
  }
}

TierFile file_from_json(const json& j, const std::string& where) {
  TierFile f;
  f.name = field<std::string>(j, "name", where);
  f.rank = field<int>(j, "rank", where);
  f.node = field<int>(j, "node", where);
  f.bytes = field<uint64_t>(j, "bytes", where);
  if (j.contains("xxh3")) f.xxh3 = parse_hex64(field<std::string>(j, "xxh3", where), where);
  if (f.rank < 0 || f.node < 0 || f.name != rank_file_name(f.rank)) {
    throw FormatError(where + ": file entry '" + f.name + "' (rank " + std::to_string(f.rank) +
                      ") is not rank_<rank>.data");
  }
  return f;
}

json parse_json(const std::string& text, const std::string& where) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw FormatError(where + ": not JSON (" + std::string(e.what()) + ")");
  }
}

void check_format(const json& j, const char* expected, const std::string& where) {
  if (!j.is_object()) throw FormatError(where + ": not a JSON object");
  const std::string format = field<std::string>(j, "format", where);
  if (format != expected) {
    throw FormatError(where + ": format '" + format + "', expected '" + expected + "'");
  }
}

std::string join(const std::vector<std::string>& names, size_t max = 4) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < max; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > max) out += " and " + std::to_string(names.size() - max) + " more";
  return out;
}

std::string node_list(const std::set<int>& nodes) {
  std::string out;
  for (int n : nodes) out += (out.empty() ? "" : ", ") + std::to_string(n);
  return (nodes.size() == 1 ? "node " : "nodes ") + out;
}

json files_json(const std::vector<TierFile>& files) {
  json out = json::array();
  for (const TierFile& f : files) out.push_back(file_json(f));
  return out;
}

// Parses a record of `format` and reads the step and node both records
// start with; the rest of the JSON is the caller's.
template <typename Record>
json decode_record_head(const std::string& text, const char* format, const std::string& where, Record& r) {
  json j = parse_json(text, where);
  check_format(j, format, where);
  r.step = field<int64_t>(j, "step", where);
  r.node = field<int>(j, "node", where);
  return j;
}

}  // namespace

std::string local_tier_dir(const std::string& pattern, int node) {
  std::string out = pattern;
  const std::string key = "{node}";
  for (size_t at = out.find(key); at != std::string::npos; at = out.find(key, at)) {
    out.replace(at, key.size(), std::to_string(node));
  }
  return out;
}

std::string rank_file_name(int rank) { return "rank_" + std::to_string(rank) + ".data"; }

const char* tier_name(Tier tier) { return tier == Tier::kLocal ? "local" : "durable"; }

std::string encode_local_record(const LocalRecord& r) {
  return json{{"format", kLocalFormat}, {"step", r.step},           {"node", r.node},
              {"node_of_rank", r.node_of_rank}, {"files", files_json(r.files)}}
      .dump(1);
}

LocalRecord decode_local_record(const std::string& text, const std::string& where) {
  LocalRecord r;
  const json j = decode_record_head(text, kLocalFormat, where, r);
  r.node_of_rank = field<std::vector<int>>(j, "node_of_rank", where);
  if (r.node_of_rank.empty()) throw FormatError(where + ": node_of_rank is empty");
  for (const json& f : field<json>(j, "files", where)) r.files.push_back(file_from_json(f, where));
  for (const TierFile& f : r.files) {
    if (f.rank >= static_cast<int>(r.node_of_rank.size()) || r.node_of_rank[f.rank] != f.node ||
        f.node != r.node) {
      throw FormatError(where + ": " + f.name + " is not a file of node " + std::to_string(r.node));
    }
  }
  return r;
}

std::string encode_partner_record(const PartnerRecord& r) {
  return json{{"format", kPartnerFormat}, {"step", r.step}, {"node", r.node}, {"files", files_json(r.files)}}
      .dump(1);
}

PartnerRecord decode_partner_record(const std::string& text, const std::string& where) {
  PartnerRecord r;
  const json j = decode_record_head(text, kPartnerFormat, where, r);
  for (const json& f : field<json>(j, "files", where)) {
    TierFile file = file_from_json(f, where);
    if (!file.xxh3) throw FormatError(where + ": " + file.name + " has no xxh3");
    r.files.push_back(std::move(file));
  }
  return r;
}

NodeInventory inventory_local_tier(Storage& storage, const std::string& dir, int node) {
  NodeInventory inv;
  inv.node = node;
  inv.dir = dir;
  std::vector<CheckpointEntry> entries;
  try {
    entries = list_checkpoints(storage, dir);
  } catch (const std::exception& e) {
    inv.error = e.what();
    return inv;
  }
  for (const CheckpointEntry& e : entries) {
    LocalStep s;
    s.step = e.step;
    s.path = e.path;
    s.committed = e.committed;
    auto present = [&](const std::string& path, const TierFile& f) {
      const FileInfo info = storage.stat(path);
      if (info.type != FileType::kFile) {
        s.problems.push_back(path + " is missing");
        return false;
      }
      if (info.size != f.bytes) {
        s.problems.push_back(path + " has " + std::to_string(info.size) + " bytes, recorded " +
                             std::to_string(f.bytes));
        return false;
      }
      return true;
    };
    try {
      const std::string where = join_path(e.path, kLocalRecordName);
      if (storage.exists(where)) {
        const std::vector<uint8_t> bytes = storage.read_file(where, kMaxRecordBytes);
        LocalRecord r = decode_local_record(std::string(bytes.begin(), bytes.end()), where);
        if (r.step != e.step) throw FormatError(where + ": records step " + std::to_string(r.step));
        for (const TierFile& f : r.files) {
          if (present(join_path(e.path, f.name), f)) s.own.push_back(f);
        }
        s.record = std::move(r);
      }
    } catch (const std::exception& ex) {
      s.problems.push_back(ex.what());
    }
    try {
      const std::string where = join_path(e.path, kPartnerRecordName);
      if (storage.exists(where)) {
        const std::vector<uint8_t> bytes = storage.read_file(where, kMaxRecordBytes);
        PartnerRecord r = decode_partner_record(std::string(bytes.begin(), bytes.end()), where);
        if (r.step != e.step) throw FormatError(where + ": records step " + std::to_string(r.step));
        const std::string copies = join_path(e.path, kPartnerDirName);
        for (const TierFile& f : r.files) {
          if (present(join_path(copies, f.name), f)) s.partner_copies.push_back(f);
        }
        s.partner = std::move(r);
      }
    } catch (const std::exception& ex) {
      s.problems.push_back(ex.what());
    }
    inv.steps.push_back(std::move(s));
  }
  return inv;
}

std::string check_partner_copy(Storage& storage, const std::string& step_path, const TierFile& file) {
  constexpr uint64_t kPieceBytes = 4ull << 20;
  const std::string path = join_path(join_path(step_path, kPartnerDirName), file.name);
  const FileInfo info = storage.stat(path);
  if (info.type != FileType::kFile) return path + " is missing";
  if (info.size != file.bytes) {
    return path + " has " + std::to_string(info.size) + " bytes, recorded " + std::to_string(file.bytes);
  }
  if (!file.xxh3) return path + ": .partner.json records no XXH3";
  std::vector<uint8_t> buf(static_cast<size_t>(std::min(file.bytes, kPieceBytes)));
  Xxh3Stream hash;
  try {
    for (uint64_t at = 0; at < file.bytes;) {
      const size_t n = static_cast<size_t>(std::min(file.bytes - at, kPieceBytes));
      storage.read_at(path, at, buf.data(), n);
      hash.update(buf.data(), n);
      at += n;
    }
  } catch (const IoError& e) {
    return e.what();
  }
  if (hash.digest() != *file.xxh3) {
    return path + ": XXH3 " + hex64(hash.digest()) + ", recorded " + hex64(*file.xxh3);
  }
  return "";
}

std::string encode_inventory(const NodeInventory& inv) {
  json steps = json::array();
  for (const LocalStep& s : inv.steps) {
    json own = json::array(), copies = json::array();
    for (const TierFile& f : s.own) own.push_back(file_json(f));
    for (const TierFile& f : s.partner_copies) copies.push_back(file_json(f));
    json j = {{"step", s.step}, {"path", s.path}, {"committed", s.committed}, {"own", own},
              {"partner_copies", copies}, {"problems", s.problems}};
    if (s.record) j["record"] = encode_local_record(*s.record);
    if (s.partner) j["partner"] = encode_partner_record(*s.partner);
    steps.push_back(std::move(j));
  }
  return json{{"node", inv.node}, {"dir", inv.dir}, {"error", inv.error}, {"steps", steps}}.dump();
}

NodeInventory decode_inventory(const std::string& text) {
  const std::string where = "local tier inventory";
  const json j = parse_json(text, where);
  NodeInventory inv;
  inv.node = field<int>(j, "node", where);
  inv.dir = field<std::string>(j, "dir", where);
  inv.error = field<std::string>(j, "error", where);
  for (const json& js : field<json>(j, "steps", where)) {
    LocalStep s;
    s.step = field<int64_t>(js, "step", where);
    s.path = field<std::string>(js, "path", where);
    s.committed = field<bool>(js, "committed", where);
    for (const json& f : field<json>(js, "own", where)) s.own.push_back(file_from_json(f, where));
    for (const json& f : field<json>(js, "partner_copies", where)) {
      s.partner_copies.push_back(file_from_json(f, where));
    }
    s.problems = field<std::vector<std::string>>(js, "problems", where);
    if (js.contains("record")) s.record = decode_local_record(field<std::string>(js, "record", where), where);
    if (js.contains("partner")) {
      s.partner = decode_partner_record(field<std::string>(js, "partner", where), where);
    }
    inv.steps.push_back(std::move(s));
  }
  return inv;
}

namespace {

// A node's committed step_<N> with a record.
struct Holder {
  const LocalStep* step;
  int node;
};

std::vector<Holder> committed_holders(const std::vector<NodeInventory>& nodes, int64_t step) {
  std::vector<Holder> holders;
  for (const NodeInventory& n : nodes) {
    for (const LocalStep& s : n.steps) {
      if (s.step == step && s.committed && s.record) holders.push_back({&s, n.node});
    }
  }
  return holders;
}

// The last of `files` named `name`, as a source on `node`.
std::optional<FileSource> named(const std::vector<TierFile>& files, const std::string& name, int node,
                                bool partner) {
  std::optional<FileSource> found;
  for (const TierFile& f : files) {
    if (f.name == name) found = FileSource{f, node, partner};
  }
  return found;
}

// Where rank file `name` of `step` is: a holder's own file first, then a
// holder's partner copy, then a partner copy on any node.
std::optional<FileSource> find_rank_file(const std::vector<NodeInventory>& nodes,
                                         const std::vector<Holder>& holders, int64_t step,
                                         const std::string& name) {
  for (const Holder& h : holders) {
    if (auto found = named(h.step->own, name, h.node, false)) return found;
  }
  for (const Holder& h : holders) {
    if (!h.step->partner) continue;
    if (auto found = named(h.step->partner_copies, name, h.node, true)) return found;
  }
  // A partner copy may sit on a node whose own part is not committed (it
  // could not be, after losing files); its .partner.json is the claim that
  // counts.
  for (const NodeInventory& n : nodes) {
    for (const LocalStep& s : n.steps) {
      if (s.step != step || !s.partner) continue;
      if (auto found = named(s.partner_copies, name, n.node, true)) return found;
    }
  }
  return std::nullopt;
}

// Fills local.sources with every rank file of the saving world and
// local.reason; returns why the step is not a candidate ("" when it is).
std::string collect_sources(const std::vector<NodeInventory>& nodes, const std::vector<Holder>& holders,
                            const std::vector<int>& node_of_rank, ResumeCandidate& local) {
  std::vector<std::string> missing;
  std::set<int> from_partner_nodes, lost_nodes;
  for (int r = 0; r < local.world_size; ++r) {
    const std::string name = rank_file_name(r);
    const std::optional<FileSource> found = find_rank_file(nodes, holders, local.step, name);
    if (!found) {
      missing.push_back(name);
      lost_nodes.insert(node_of_rank[r]);
      continue;
    }
    if (found->partner) {
      from_partner_nodes.insert(found->node);
      lost_nodes.insert(node_of_rank[r]);
    }
    local.sources.push_back(*found);
  }
  if (!missing.empty()) {
    return "local step_" + std::to_string(local.step) + " lacks " + join(missing) + " (" +
           node_list(lost_nodes) + ": not committed there or files missing, and no " +
           "committed partner copy)";
  }
  if (from_partner_nodes.empty()) {
    local.reason = "every rank file is on its own node";
  } else {
    local.reason = "the files of " + node_list(lost_nodes) +
                   " (missing or incomplete there) come from partner copies on " +
                   node_list(from_partner_nodes);
  }
  return "";
}

// The local tier's candidate for `step` from the nodes that committed it
// (`holders`, not empty); returns why it is not one ("" when it is).
std::string local_candidate(const std::vector<NodeInventory>& nodes, const std::vector<Holder>& holders,
                            ResumeCandidate& local) {
  const std::vector<int>& node_of_rank = holders[0].step->record->node_of_rank;
  local.world_size = static_cast<int>(node_of_rank.size());
  local.metadata_node = holders[0].node;
  for (const Holder& h : holders) {
    if (h.step->record->node_of_rank != node_of_rank) {
      return "the nodes' records of local step_" + std::to_string(local.step) + " disagree on the world";
    }
  }
  return collect_sources(nodes, holders, node_of_rank, local);
}

bool any_local_step(const std::vector<NodeInventory>& nodes, int64_t step) {
  for (const NodeInventory& n : nodes) {
    for (const LocalStep& s : n.steps) {
      if (s.step == step) return true;
    }
  }
  return false;
}

}  // namespace

TierChoice choose_resume_tiers(const std::vector<NodeInventory>& nodes,
                               const std::vector<CheckpointEntry>& durable) {
  std::set<int64_t, std::greater<int64_t>> steps;
  std::map<int64_t, const CheckpointEntry*> durable_at;
  for (const CheckpointEntry& e : durable) {
    if (!e.committed) continue;
    steps.insert(e.step);
    durable_at[e.step] = &e;
  }
  for (const NodeInventory& n : nodes) {
    for (const LocalStep& s : n.steps) {
      if (s.committed) steps.insert(s.step);
    }
  }
  TierChoice out;
  for (int64_t step : steps) {
    // The local tier: the nodes that committed this step with a record.
    ResumeCandidate local;
    local.step = step;
    local.tier = Tier::kLocal;
    const std::vector<Holder> holders = committed_holders(nodes, step);
    std::string why_not;
    if (!holders.empty()) {
      why_not = local_candidate(nodes, holders, local);
    } else if (any_local_step(nodes, step)) {
      why_not = "no node holds a committed local step_" + std::to_string(step);
    }
    if (why_not.empty() && !holders.empty()) {
      out.candidates.push_back(std::move(local));
    } else if (!why_not.empty() && out.candidates.empty()) {
      out.notes.push_back(why_not);
    }
    if (auto it = durable_at.find(step); it != durable_at.end()) {
      ResumeCandidate d;
      d.step = step;
      d.tier = Tier::kDurable;
      d.durable_path = it->second->path;
      if (!why_not.empty()) {
        d.reason = why_not;
      } else if (holders.empty()) {
        d.reason = "the local tier has no step_" + std::to_string(step);
      } else {
        d.reason = "the local copy of step_" + std::to_string(step) + " did not load";
      }
      out.candidates.push_back(std::move(d));
    }
  }
  return out;
}

std::string encode_candidates(const std::vector<ResumeCandidate>& candidates) {
  json list = json::array();
  for (const ResumeCandidate& c : candidates) {
    json sources = json::array();
    for (const FileSource& s : c.sources) {
      sources.push_back({{"file", file_json(s.file)}, {"node", s.node}, {"partner", s.partner}});
    }
    list.push_back({{"step", c.step},
                    {"tier", tier_name(c.tier)},
                    {"reason", c.reason},
                    {"durable_path", c.durable_path},
                    {"world_size", c.world_size},
                    {"metadata_node", c.metadata_node},
                    {"sources", sources}});
  }
  return list.dump();
}

std::vector<ResumeCandidate> decode_candidates(const std::string& text) {
  const std::string where = "resume candidates";
  std::vector<ResumeCandidate> out;
  for (const json& j : parse_json(text, where)) {
    ResumeCandidate c;
    c.step = field<int64_t>(j, "step", where);
    c.tier = field<std::string>(j, "tier", where) == "local" ? Tier::kLocal : Tier::kDurable;
    c.reason = field<std::string>(j, "reason", where);
    c.durable_path = field<std::string>(j, "durable_path", where);
    c.world_size = field<int>(j, "world_size", where);
    c.metadata_node = field<int>(j, "metadata_node", where);
    for (const json& s : field<json>(j, "sources", where)) {
      c.sources.push_back(FileSource{file_from_json(field<json>(s, "file", where), where), field<int>(s, "node", where),
                                     field<bool>(s, "partner", where)});
    }
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace checkpoint
