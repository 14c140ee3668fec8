#include "framework/train/resume_audit.h"

#include "checkpoint/errors.h"
#include "checkpoint/format/checksum.h"
#include "framework/config/run_items.h"
#include "framework/data/sampler.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

namespace framework::train {
namespace {

constexpr uint64_t kWholeFileUpTo = 64 << 10;  // fingerprint: the whole file up to this size
constexpr uint64_t kPiece = 16 << 10;          // else four pieces of this size

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t parse_hex64(const std::string& text) {
  if (text.size() != 16 || text.find_first_not_of("0123456789abcdef") != std::string::npos) {
    throw std::invalid_argument("'" + text + "' is not 16 hex digits");
  }
  return std::stoull(text, nullptr, 16);
}

[[noreturn]] void io_error(const std::string& what, const std::string& path) {
  throw std::runtime_error("resume audit: cannot " + what + " data file '" + path + "': " + std::strerror(errno));
}

DataFile identify_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) io_error("open", path);
  std::unique_ptr<int, void (*)(int*)> closer(new int(fd), [](int* f) {
    ::close(*f);
    delete f;
  });
  struct stat st {};
  if (::fstat(fd, &st) != 0) io_error("stat", path);
  DataFile out;
  out.path = path;
  out.size = static_cast<uint64_t>(st.st_size);
  std::vector<std::pair<uint64_t, uint64_t>> pieces;  // (offset, length)
  if (out.size <= kWholeFileUpTo) {
    pieces.push_back({0, out.size});
  } else {
    const uint64_t last = out.size - kPiece;
    pieces = {{0, kPiece}, {last / 3, kPiece}, {last / 3 * 2, kPiece}, {last, kPiece}};
  }
  checkpoint::Xxh3Stream hash;
  std::vector<uint8_t> buf(kWholeFileUpTo);
  for (const auto& [offset, length] : pieces) {
    uint64_t done = 0;
    while (done < length) {
      const ssize_t n = ::pread(fd, buf.data(), length - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) io_error("read", path);
      if (n == 0) break;  // shrank meanwhile: the fingerprint tells
      hash.update(buf.data(), static_cast<size_t>(n));
      done += static_cast<uint64_t>(n);
    }
  }
  out.fingerprint = hash.digest();
  return out;
}

const checkpoint::BytesEntry* find_bytes(const checkpoint::StateDict& sd, const std::string& name) {
  for (const checkpoint::BytesEntry& b : sd.bytes()) {
    if (b.name == name) return &b;
  }
  return nullptr;
}

std::string name_of(const std::string& path) { return std::filesystem::path(path).filename().string(); }

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : sep) + p;
  return out;
}

std::string names_of(const std::vector<DataFile>& files) {
  std::vector<std::string> names;
  for (const auto& f : files) names.push_back(name_of(f.path));
  return join(names, ", ");
}

// The data files' part of the explanation: empty when they agree.
std::vector<std::string> explain_files(const std::vector<DataFile>& saved, const std::vector<DataFile>& now) {
  const auto content = [](const DataFile& f) { return std::make_pair(f.size, f.fingerprint); };
  std::vector<std::string> out;
  if (saved.size() == now.size()) {
    bool same_content = true, same_names = true;
    for (size_t i = 0; i < saved.size(); ++i) {
      same_content = same_content && content(saved[i]) == content(now[i]);
      same_names = same_names && name_of(saved[i].path) == name_of(now[i].path);
    }
    if (same_content) return out;  // (paths may differ: the data moved)
    // The same contents, in another order: say which file now holds what.
    std::vector<std::pair<uint64_t, uint64_t>> a, b;
    for (size_t i = 0; i < saved.size(); ++i) {
      a.push_back(content(saved[i]));
      b.push_back(content(now[i]));
    }
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    if (a == b) {
      std::vector<std::string> moves;
      for (size_t i = 0; i < now.size(); ++i) {
        if (content(now[i]) == content(saved[i])) continue;
        for (size_t j = 0; j < saved.size(); ++j) {
          if (content(saved[j]) == content(now[i])) {
            moves.push_back(name_of(now[i].path) + " holds what " + name_of(saved[j].path) + " held");
            break;
          }
        }
      }
      out.push_back("shards in another order (" + join(moves, ", ") + ")");
      return out;
    }
    if (same_names) {
      for (size_t i = 0; i < saved.size(); ++i) {
        if (content(saved[i]) == content(now[i])) continue;
        std::string why = saved[i].size != now[i].size
                              ? std::to_string(saved[i].size) + " -> " + std::to_string(now[i].size) + " bytes"
                              : "same size, other bytes";
        out.push_back("a data file changed under the same name (" + now[i].path + ": " + why + ")");
      }
      return out;
    }
  }
  out.push_back("other data files (saved: " + names_of(saved) + "; now: " + names_of(now) + ")");
  return out;
}

}  // namespace

DataIdentity data_identity_of(const data::Dataset& dataset, const data::LoaderState& position) {
  DataIdentity out;
  out.seed = position.seed;
  out.global_batch_size = position.global_batch_size;
  for (const std::string& path : dataset.files()) out.files.push_back(identify_file(path));
  return out;
}

uint64_t global_batch_hash(const data::Dataset& dataset, int64_t global_batch_size, uint64_t seed, int64_t step) {
  const data::GlobalBatchSampler sampler(global_batch_size, seed);
  checkpoint::Xxh3Stream hash;
  for (int64_t index : sampler.global_indices(step)) {
    auto [inputs, targets] = dataset.sample(index);
    for (const torch::Tensor& t : {inputs, targets}) {
      const torch::Tensor c = t.to(torch::kCPU).contiguous();
      hash.update(c.data_ptr(), c.nbytes());
    }
  }
  return hash.digest();
}

std::vector<uint8_t> encode_next_batch(const NextBatchRecord& record) {
  nlohmann::ordered_json files = nlohmann::ordered_json::array();
  for (const DataFile& f : record.data.files) {
    files.push_back({{"path", f.path}, {"size", f.size}, {"fingerprint", hex64(f.fingerprint)}});
  }
  const nlohmann::ordered_json j = {{"version", 1},
                                    {"batch_hash", hex64(record.batch_hash)},
                                    {"seed", record.data.seed},
                                    {"global_batch_size", record.data.global_batch_size},
                                    {"files", files}};
  const std::string text = j.dump();
  return std::vector<uint8_t>(text.begin(), text.end());
}

NextBatchRecord decode_next_batch(const std::vector<uint8_t>& bytes, const std::string& where) {
  try {
    const nlohmann::json j = nlohmann::json::parse(bytes.begin(), bytes.end());
    if (j.at("version").get<int>() != 1) {
      throw std::invalid_argument("version " + std::to_string(j.at("version").get<int>()) + " (this build reads 1)");
    }
    NextBatchRecord out;
    out.batch_hash = parse_hex64(j.at("batch_hash").get<std::string>());
    out.data.seed = j.at("seed").get<uint64_t>();
    out.data.global_batch_size = j.at("global_batch_size").get<int64_t>();
    for (const auto& f : j.at("files")) {
      out.data.files.push_back({f.at("path").get<std::string>(), f.at("size").get<uint64_t>(),
                                parse_hex64(f.at("fingerprint").get<std::string>())});
    }
    return out;
  } catch (const std::exception& e) {
    throw checkpoint::FormatError(where + ": item " + config::kNextBatchItem + " is not a next-batch record: " +
                                  e.what());
  }
}

std::string explain_batch_difference(const NextBatchRecord& saved, const NextBatchRecord& now) {
  std::vector<std::string> why;
  if (saved.data.seed != now.data.seed) {
    why.push_back("another seed (saved " + std::to_string(saved.data.seed) + ", now " +
                  std::to_string(now.data.seed) + ")");
  }
  if (saved.data.global_batch_size != now.data.global_batch_size) {
    why.push_back("another train.global_batch_size (saved " + std::to_string(saved.data.global_batch_size) +
                  ", now " + std::to_string(now.data.global_batch_size) + ")");
  }
  for (std::string& s : explain_files(saved.data.files, now.data.files)) why.push_back(std::move(s));
  if (why.empty()) why.push_back("the next batch differs");
  return join(why, "; ") + " (saved hash " + hex64(saved.batch_hash) + ", now " + hex64(now.batch_hash) + ")";
}

AuditVerdict audit_resume(const checkpoint::StateDict& sd, const data::DataLoader& loader,
                          const DataIdentity& identity, checkpoint::ResumeAudit mode,
                          const std::string& checkpoint_path, bool config_change_allowed) {
  AuditVerdict v;
  const checkpoint::BytesEntry* position = find_bytes(sd, config::kLoaderItem);
  const checkpoint::BytesEntry* saved = find_bytes(sd, config::kNextBatchItem);
  if (mode == checkpoint::ResumeAudit::kOff) {
    v.outcome = AuditOutcome::kOff;
    return v;
  }
  if (position == nullptr || position->data.empty()) {
    v.outcome = AuditOutcome::kImported;
    v.message = "resume audit skipped: " + checkpoint_path +
                " was imported (no data loader position); the data continue at its step";
    return v;
  }
  if (saved == nullptr || saved->data.empty()) {
    v.outcome = AuditOutcome::kNoRecord;
    v.message = "resume audit skipped: " + checkpoint_path +
                " was saved before checkpoints recorded their next batch";
    return v;
  }
  const NextBatchRecord before = decode_next_batch(saved->data, checkpoint_path);
  const data::LoaderState at = loader.state();
  NextBatchRecord now;
  now.batch_hash = global_batch_hash(loader.dataset(), at.global_batch_size, at.seed, at.next_step);
  const std::string step = std::to_string(at.next_step + 1);
  if (now.batch_hash == before.batch_hash) {
    v.outcome = AuditOutcome::kPassed;
    v.message = "resume audit: step " + step + "'s batch is the one " + checkpoint_path + " recorded (xxh3 " +
                hex64(now.batch_hash) + ")";
    return v;
  }
  now.data = identity;
  const std::string what = "checkpoint.resume_audit: resuming " + checkpoint_path + ", step " + step +
                           " would train on another batch than the saved run would have: " +
                           explain_batch_difference(before, now);
  // The seed or batch size changed on purpose, the data files did not.
  const bool allowed = config_change_allowed && before.data.files == now.data.files &&
                       (before.data.seed != now.data.seed ||
                        before.data.global_batch_size != now.data.global_batch_size);
  if (allowed) {
    v.outcome = AuditOutcome::kDiffers;
    v.message = what + " (checkpoint.allow_config_change: resuming anyway)";
    return v;
  }
  if (mode == checkpoint::ResumeAudit::kError) {
    throw ResumeAuditError(what + ". Resuming would mix two runs: put the data back as it was, or set "
                                  "checkpoint.resume_audit: warn to resume anyway");
  }
  v.outcome = AuditOutcome::kDiffers;
  v.message = what + " (checkpoint.resume_audit: warn, resuming anyway)";
  return v;
}

}  // namespace framework::train
