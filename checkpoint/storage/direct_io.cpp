// checkpoint.direct_io auto: the probe that measures page-cache against
// O_DIRECT writes on a directory's file system (direct_io.h).
#include "checkpoint/storage/direct_io.h"

#include "checkpoint/errors.h"  // IoError
#include "checkpoint/storage/storage.h"  // join_path, parent_dir

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

namespace checkpoint {

namespace {

// O_DIRECT's alignment (storage.h) and the writers' piece size (the chunk
// writer's 8 MiB blocks), so the probe writes as a save does.
constexpr uint64_t kAlign = 4096;
constexpr uint64_t kPiece = uint64_t{8} << 20;

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};

// Bytes that no file system can compress or deduplicate away.
std::unique_ptr<uint8_t, AlignedFree> probe_bytes(uint64_t n) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kAlign, n));
  if (p == nullptr) throw std::bad_alloc();
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (uint64_t i = 0; i < n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  return std::unique_ptr<uint8_t, AlignedFree>(p);
}

// The file system refused O_DIRECT (at open or at the first write).
struct Refused {
  int error_number;
};

// Seconds to write data[0, n) into a new `path` in pieces and fsync it; the
// file is deleted after. Throws Refused, or IoError naming the path.
double timed_write(const std::string& path, const uint8_t* data, uint64_t n, bool direct) {
  const auto t0 = std::chrono::steady_clock::now();
  const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | (direct ? O_DIRECT : 0);
  const int fd = ::open(path.c_str(), flags, 0600);
  if (fd < 0 && direct && errno == EINVAL) throw Refused{errno};
  if (fd < 0) throw IoError::from_errno("cannot create", path, errno);
  struct Cleanup {
    int fd;
    const std::string& path;
    ~Cleanup() {
      ::close(fd);
      ::unlink(path.c_str());
    }
  } cleanup{fd, path};
  for (uint64_t at = 0; at < n;) {
    const size_t len = static_cast<size_t>(std::min(kPiece, n - at));
    const ssize_t w = ::pwrite(fd, data + at, len, static_cast<off_t>(at));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && direct && (errno == EINVAL || errno == EOPNOTSUPP)) throw Refused{errno};
    if (w < 0) throw IoError::from_errno("cannot write", path, errno);
    at += static_cast<uint64_t>(w);
  }
  if (::fsync(fd) != 0) throw IoError::from_errno("cannot fsync", path, errno);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string gb_per_s(uint64_t bytes, double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GB/s", s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0.0);
  return text;
}

// "O_DIRECT (64 MiB each way: 1.90 GB/s direct, 1.02 GB/s page cache)" and
// the like: the choice first, then why.
std::string describe(const DirectIoProbe& p) {
  const std::string size = std::to_string(p.bytes >> 20) + " MiB";
  std::string why;
  if (p.failed) {
    why = "probe failed: " + p.detail;
  } else if (!p.accepted) {
    why = p.detail;
  } else {
    why = size + " each way: " + gb_per_s(p.bytes, p.direct_s) + " direct, " +
          gb_per_s(p.bytes, p.buffered_s) + " page cache";
  }
  return std::string(p.use_direct ? "O_DIRECT" : "page cache") + " (" + why + ")";
}

}  // namespace

bool prefer_direct(const DirectIoProbe& probe) {
  return probe.accepted && !probe.failed && probe.direct_s > 0 && probe.direct_s < probe.buffered_s;
}

DirectIoProbe probe_direct_io(const std::string& dir, uint64_t bytes, int trials) {
  DirectIoProbe p;
  p.dir = dir;
  p.bytes = std::max(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  // One name per process and thread: ranks sharing a directory probe apart.
  const std::string path = join_path(dir, ".direct_io_probe." + std::to_string(::getpid()) + "." +
                                              std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id())));
  try {
    const auto data = probe_bytes(p.bytes);
    p.accepted = true;
    for (int t = 0; t < std::max(1, trials); ++t) {
      const double b = timed_write(path, data.get(), p.bytes, false);
      p.buffered_s = t == 0 ? b : std::min(p.buffered_s, b);
      if (!p.accepted) continue;
      try {
        const double d = timed_write(path, data.get(), p.bytes, true);
        p.direct_s = t == 0 ? d : std::min(p.direct_s, d);
      } catch (const Refused& r) {
        p.accepted = false;
        p.direct_s = 0;
        p.refused_errno = r.error_number;
        p.detail = std::string("O_DIRECT refused here: ") + std::strerror(r.error_number);
      }
    }
  } catch (const std::exception& e) {  // IoError, bad_alloc: never lose the checkpoint over a probe
    ::unlink(path.c_str());
    p.failed = true;
    p.accepted = false;
    p.direct_s = 0;
    p.detail = e.what();
  }
  p.use_direct = prefer_direct(p);
  p.detail = describe(p);
  return p;
}

namespace {

// Per file system (device number): its probe and what its files measured.
struct FileSystemRecord {
  DirectIoProbe probe;
  DirectIoLearned learned;
};

std::mutex g_mu;  // guards g_by_device and g_remember_in; held through a probe (they are rare)
std::map<dev_t, FileSystemRecord> g_by_device;
std::string g_remember_in;  // remember_direct_io_probes_in's file; "" for none

// The directory whose file system `dir` is on: `dir`, or for one not made
// yet its nearest existing ancestor (where it will be made). False, with
// `at` set to what was tried, where nothing can be stat'ed.
bool existing_dir(const std::string& dir, std::string& at, dev_t& device) {
  at = dir.empty() ? "." : dir;
  struct stat st {};
  while (::stat(at.c_str(), &st) != 0 && errno == ENOENT && at != parent_dir(at)) at = parent_dir(at);
  if (::stat(at.c_str(), &st) != 0) return false;
  device = st.st_dev;
  return true;
}

// SHARDKIT_DIRECT_IO_PROBES: probes shared by every process of this boot
// that names the file; "" for none.
const std::string& shared_probes_file() {
  static const std::string file = [] {
    const char* value = std::getenv("SHARDKIT_DIRECT_IO_PROBES");
    return std::string(value != nullptr ? value : "");
  }();
  return file;
}

// The probe of `device`: the one remembered in g_remember_in, else the one
// in the shared file, else a new one of `at` (remembered in both). Holds g_mu.
DirectIoProbe remembered_or_new_probe(dev_t device, const std::string& at) {
  const std::string& shared = shared_probes_file();
  if (!g_remember_in.empty()) {
    if (std::optional<DirectIoProbe> known = read_remembered_probe(g_remember_in, device)) {
      known->dir = at;
      return *known;
    }
  }
  if (!shared.empty()) {
    if (std::optional<DirectIoProbe> known = read_remembered_probe(shared, device)) {
      known->dir = at;
      known->detail = describe(*known) + "; probe of an earlier process, reused from " + shared +
                      " (SHARDKIT_DIRECT_IO_PROBES)";
      if (!g_remember_in.empty()) write_remembered_probe(g_remember_in, device, *known);
      return *known;
    }
  }
  DirectIoProbe probe = probe_direct_io(at);
  if (!g_remember_in.empty()) write_remembered_probe(g_remember_in, device, probe);
  if (!shared.empty()) write_remembered_probe(shared, device, probe);
  return probe;
}

// The record of `device`, probing `at` first if it has none. Holds g_mu.
FileSystemRecord& record_locked(dev_t device, const std::string& at) {
  auto it = g_by_device.find(device);
  if (it == g_by_device.end()) {
    it = g_by_device.emplace(device, FileSystemRecord{remembered_or_new_probe(device, at), {}}).first;
  }
  return it->second;
}

// A copy of the record of `dir`'s file system (probed first if need be); a
// file system that cannot be stat'ed gets a failed probe naming the error.
FileSystemRecord record_of(const std::string& dir) {
  std::string at;
  dev_t device = 0;
  if (!existing_dir(dir, at, device)) return FileSystemRecord{probe_direct_io(at), {}};
  std::lock_guard<std::mutex> lock(g_mu);
  return record_locked(device, at);
}

}  // namespace

DirectIoProbe cached_direct_io_probe(const std::string& dir) { return record_of(dir).probe; }

namespace {

constexpr const char* kRememberedTag = "direct_io_probe/1";
// A remembered-probes file is a few lines; anything much larger is not one.
constexpr std::streamsize kMaxRememberedBytes = 1 << 20;

// This boot of this machine: the kernel's random boot id; "" if unreadable.
std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!(in >> id)) return "";
  return id;
}

// One remembered line, parsed; nullopt for anything malformed.
struct RememberedLine {
  std::string boot;
  uint64_t device = 0;
  DirectIoProbe probe;
};

std::optional<RememberedLine> parse_remembered(const std::string& line) {
  std::istringstream in(line);
  std::string tag;
  RememberedLine r;
  int accepted = -1;
  int refused_errno = -1;
  DirectIoProbe& p = r.probe;
  if (!(in >> tag >> r.boot >> r.device >> accepted >> p.bytes >> p.buffered_s >> p.direct_s >> refused_errno)) {
    return std::nullopt;
  }
  std::string rest;
  if (in >> rest) return std::nullopt;  // trailing fields: not this version's line
  const bool times_ok = std::isfinite(p.buffered_s) && std::isfinite(p.direct_s) && p.buffered_s > 0 &&
                        p.direct_s >= 0 && (accepted == 0 || p.direct_s > 0);
  if (tag != kRememberedTag || (accepted != 0 && accepted != 1) || p.bytes == 0 || !times_ok ||
      refused_errno < 0 || refused_errno > 4095) {
    return std::nullopt;
  }
  p.accepted = accepted == 1;
  if (!p.accepted) {
    p.direct_s = 0;
    p.refused_errno = refused_errno;
    p.detail = std::string("O_DIRECT refused here: ") + std::strerror(refused_errno);
  }
  p.use_direct = prefer_direct(p);
  p.detail = describe(p);
  return r;
}

// The lines of `path` that parse; none for a missing, unreadable or
// oversized file.
std::vector<RememberedLine> read_remembered_lines(const std::string& path) {
  std::vector<RememberedLine> lines;
  std::ifstream in(path);
  if (!in) return lines;
  in.seekg(0, std::ios::end);
  if (in.tellg() > kMaxRememberedBytes) return lines;
  in.seekg(0);
  std::string line;
  while (std::getline(in, line)) {
    if (std::optional<RememberedLine> r = parse_remembered(line)) lines.push_back(std::move(*r));
  }
  return lines;
}

std::string remembered_line(const std::string& boot, uint64_t device, const DirectIoProbe& p) {
  const int refused_errno = p.accepted ? 0 : (p.refused_errno > 0 ? p.refused_errno : EINVAL);
  char text[256];
  std::snprintf(text, sizeof text, "%s %s %llu %d %llu %.9g %.9g %d", kRememberedTag, boot.c_str(),
                static_cast<unsigned long long>(device), p.accepted ? 1 : 0,
                static_cast<unsigned long long>(p.bytes), p.buffered_s, p.accepted ? p.direct_s : 0.0,
                refused_errno);
  return text;
}

}  // namespace

void remember_direct_io_probes_in(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_remember_in = path;
}

std::optional<DirectIoProbe> read_remembered_probe(const std::string& path, uint64_t device) {
  try {
    const std::string boot = boot_id();
    if (boot.empty()) return std::nullopt;
    for (RememberedLine& r : read_remembered_lines(path)) {
      if (r.boot != boot || r.device != device) continue;
      r.probe.reused_from = path;
      r.probe.detail += "; probe of an earlier process of this run, reused from " + path;
      return r.probe;
    }
  } catch (const std::exception&) {  // bad_alloc and the like: probe instead
  }
  return std::nullopt;
}

bool write_remembered_probe(const std::string& path, uint64_t device, const DirectIoProbe& probe) {
  try {
    const std::string boot = boot_id();
    if (boot.empty() || probe.failed || probe.bytes == 0) return false;
    std::string text;
    for (const RememberedLine& r : read_remembered_lines(path)) {
      if (r.boot == boot && r.device == device) continue;
      text += remembered_line(r.boot, r.device, r.probe) + "\n";
    }
    text += remembered_line(boot, device, probe) + "\n";
    std::error_code ec;
    const std::filesystem::path target(path);
    if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path(), ec);
    // One name per process and thread: ranks sharing the file write apart.
    const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                            std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << text;
      out.close();
      if (!out) {
        ::unlink(tmp.c_str());
        return false;
      }
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      ::unlink(tmp.c_str());
      return false;
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

namespace {

// Whether O_DIRECT is the faster way by the latest files (a tie: no); both
// ways measured.
bool direct_faster(const DirectIoLearned& l) { return l.direct_bytes_per_s > l.buffered_bytes_per_s; }

// Whether the slower way is due to be measured again.
bool retry_due(const DirectIoLearned& l) {
  const uint64_t total = l.direct_files + l.buffered_files;
  const uint64_t slower_latest = direct_faster(l) ? l.buffered_latest : l.direct_latest;
  return total - slower_latest >= l.retry_after;
}

}  // namespace

bool choose_direct(const DirectIoProbe& probe, const DirectIoLearned& learned) {
  if (!probe.accepted || probe.failed) return false;
  const bool direct_known = learned.direct_bytes_per_s > 0;
  const bool buffered_known = learned.buffered_bytes_per_s > 0;
  if (!direct_known && !buffered_known) return probe.use_direct;
  if (direct_known != buffered_known) return !direct_known;  // measure the other way
  const bool faster = direct_faster(learned);
  return retry_due(learned) ? !faster : faster;
}

void learn_auto_write(DirectIoLearned& l, bool direct, double bytes_per_s) {
  if (!(bytes_per_s > 0)) return;
  const bool both_known = l.direct_bytes_per_s > 0 && l.buffered_bytes_per_s > 0;
  // The first file of a retry: both known, this the slower way, and due.
  // (Files opened while it was being written went the same way; they find
  // the interval already moved.)
  const bool retry = both_known && direct != direct_faster(l) && retry_due(l);
  const uint64_t ordinal = l.direct_files + l.buffered_files + 1;
  if (direct) {
    l.direct_bytes_per_s = bytes_per_s;
    ++l.direct_files;
    l.direct_latest = ordinal;
  } else {
    l.buffered_bytes_per_s = bytes_per_s;
    ++l.buffered_files;
    l.buffered_latest = ordinal;
  }
  if (retry) {
    ++l.retries;
    const bool still_slower = direct != direct_faster(l);
    l.retry_after = still_slower ? std::min(l.retry_after * 2, DirectIoLearned::kMaxRetryAfter)
                                 : DirectIoLearned::kFirstRetryAfter;
  }
}

void record_auto_write(const std::string& dir, bool direct, uint64_t bytes, double seconds) {
  if (bytes == 0 || !(seconds > 0)) return;
  std::string at;
  dev_t device = 0;
  if (!existing_dir(dir, at, device)) return;
  std::lock_guard<std::mutex> lock(g_mu);
  learn_auto_write(record_locked(device, at).learned, direct, static_cast<double>(bytes) / seconds);
}

DirectIoLearned learned_direct_io(const std::string& dir) { return record_of(dir).learned; }

std::string describe_auto_direct_io(const std::string& dir) {
  const FileSystemRecord r = record_of(dir);
  const DirectIoLearned& l = r.learned;
  if (l.direct_bytes_per_s <= 0 && l.buffered_bytes_per_s <= 0) return r.probe.detail;
  const auto rate = [](double r, uint64_t files) {
    char text[48];
    if (r <= 0) return std::string("not yet");
    std::snprintf(text, sizeof text, "%.2f GB/s", r / 1e9);
    return std::string(text) + " (" + std::to_string(files) + (files == 1 ? " file)" : " files)");
  };
  const bool both = l.direct_bytes_per_s > 0 && l.buffered_bytes_per_s > 0;
  const bool retrying = both && r.probe.accepted && !r.probe.failed && retry_due(l);
  return std::string(choose_direct(r.probe, l) ? "O_DIRECT" : "page cache") +
         (retrying ? ", the slower way, measured again" : "") + " (latest checkpoint files: " +
         rate(l.direct_bytes_per_s, l.direct_files) + " direct, " +
         rate(l.buffered_bytes_per_s, l.buffered_files) + " page cache)";
}

bool use_direct_io(DirectIo mode, const std::string& dir) {
  switch (mode) {
    case DirectIo::kOn: return true;
    case DirectIo::kOff: return false;
    case DirectIo::kAuto: {
      const FileSystemRecord r = record_of(dir);
      return choose_direct(r.probe, r.learned);
    }
  }
  return false;
}

}  // namespace checkpoint
