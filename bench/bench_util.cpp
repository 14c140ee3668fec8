// ckpt_bench helpers: process memory, page cache, safetensors, and the
// compression study. See bench_util.h.
#include "bench/bench_util.h"

#include "checkpoint/interop/weights_file.h"
#include "checkpoint/load.h"
#include "checkpoint/save.h"

#include <zstd.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>
#include <sstream>
#include <stdexcept>

namespace bench {

namespace fs = std::filesystem;

namespace {

std::string errno_text(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

std::vector<std::string> regular_files_under(const std::string& path) {
  std::vector<std::string> out;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    out.push_back(path);
  } else if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::recursive_directory_iterator(path, ec)) {
      if (e.is_regular_file()) out.push_back(e.path().string());
    }
  }
  return out;
}

// RAII file descriptor.
class Fd {
 public:
  Fd(const std::string& path, int flags, mode_t mode = 0644) : path_(path) {
    fd_ = ::open(path.c_str(), flags | O_CLOEXEC, mode);
    if (fd_ < 0) throw std::runtime_error(errno_text("cannot open", path));
  }
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

  void write_all(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = ::write(fd_, p, std::min<size_t>(n, 8u << 20));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) throw std::runtime_error(errno_text("write failed on", path_));
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  void read_all(void* data, size_t n) {
    char* p = static_cast<char*>(data);
    while (n > 0) {
      ssize_t r = ::read(fd_, p, std::min<size_t>(n, 8u << 20));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw std::runtime_error(errno_text("read failed on", path_));
      if (r == 0) throw std::runtime_error("unexpected end of file: " + path_);
      p += r;
      n -= static_cast<size_t>(r);
    }
  }
  void sync() {
    if (::fsync(fd_) != 0) throw std::runtime_error(errno_text("fsync failed on", path_));
  }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace

// ---------------------------------------------------------------------------
// Process memory and page cache

uint64_t proc_status_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(in, line)) {
    if (line.compare(0, n, field) == 0) {
      return std::stoull(line.substr(n)) * 1024;  // "VmRSS:   1234 kB"
    }
  }
  return 0;
}

bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

bool drop_page_cache(const std::string& path) {
  bool ok = true;
  for (const auto& f : regular_files_under(path)) {
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      ok = false;
      continue;
    }
    ok = ::fdatasync(fd) == 0 && ok;
    ok = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0 && ok;
    ::close(fd);
  }
  return ok;
}

double resident_fraction(const std::string& path) {
  const long page = ::sysconf(_SC_PAGESIZE);
  uint64_t pages = 0;
  uint64_t resident = 0;
  for (const auto& f : regular_files_under(path)) {
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size == 0) {
      ::close(fd);
      continue;
    }
    const size_t len = static_cast<size_t>(st.st_size);
    void* map = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (map == MAP_FAILED) return -1;
    std::vector<unsigned char> vec((len + page - 1) / page);
    bool ok = ::mincore(map, len, vec.data()) == 0;
    ::munmap(map, len);
    if (!ok) return -1;
    pages += vec.size();
    for (unsigned char c : vec) resident += c & 1;
  }
  return pages == 0 ? 0.0 : static_cast<double>(resident) / static_cast<double>(pages);
}

void fsync_path(const std::string& path) {
  Fd fd(path, O_RDONLY);
  fd.sync();
}

checkpoint::CheckpointOptions manager_options(checkpoint::SaveMode mode, const std::string& dir, int io_threads) {
  checkpoint::CheckpointOptions co;
  co.interval = 1;
  co.keep_last = 1;
  co.resume = "never";
  co.io_threads = io_threads;
  co.mode = mode;
  co.dir = dir;
  return co;
}

double median(std::vector<double> v) {
  TORCH_CHECK(!v.empty(), "median of nothing");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double max_over(comm::Group& group, double v) {
  torch::Tensor t = torch::tensor({v}, torch::kDouble);
  group.all_reduce(t, comm::ReduceOp::kMax);
  return t.item<double>();
}

// ---------------------------------------------------------------------------
// safetensors

NamedTensors read_safetensors(const std::string& path) {
  const checkpoint::WeightsFile file = checkpoint::WeightsFile::open(path);
  if (file.format() != "safetensors") throw std::runtime_error(path + ": not a safetensors file");
  NamedTensors out;
  for (const checkpoint::WeightsTensorInfo& info : file.tensors()) {  // in file order
    torch::Tensor t = torch::empty(info.shape, checkpoint::to_scalar_type(info.dtype));
    if (info.nbytes > 0) {
      file.read_box(info.name, checkpoint::full_box(info.shape), static_cast<uint8_t*>(t.data_ptr()));
    }
    out.emplace_back(info.name, t);
  }
  return out;
}

void write_safetensors(const std::string& path, const NamedTensors& tensors) {
  std::vector<torch::Tensor> contiguous;  // keeps the bytes alive until written
  std::vector<checkpoint::SafetensorsTensor> entries;
  for (const auto& [name, t] : tensors) {
    contiguous.push_back(t.contiguous());
    const torch::Tensor& c = contiguous.back();
    entries.push_back({name, checkpoint::to_dtype(c.scalar_type()), c.sizes().vec(),
                       static_cast<const uint8_t*>(c.data_ptr())});
  }
  checkpoint::write_safetensors(path, entries);
}

namespace {

bool same_bytes(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  torch::Tensor ca = a.contiguous();
  torch::Tensor cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), static_cast<size_t>(ca.numel()) * ca.element_size()) == 0;
}

}  // namespace

void self_test_safetensors(const std::string& dir) {
  fs::create_directories(dir);
  const std::string path = (fs::path(dir) / "selftest.safetensors").string();
  NamedTensors in = {
      {"w.f32", torch::randn({3, 5})},
      {"w.bf16", torch::randn({4, 2}).to(torch::kBFloat16)},
      {"w.f16", torch::randn({7}).to(torch::kFloat16)},
      {"ids.i64", torch::arange(6, torch::kInt64).reshape({2, 3})},
      {"empty", torch::empty({0, 4})}};
  write_safetensors(path, in);
  NamedTensors out = read_safetensors(path);
  std::map<std::string, torch::Tensor> by_name(out.begin(), out.end());
  for (const auto& [name, t] : in) {
    auto it = by_name.find(name);
    if (it == by_name.end() || !same_bytes(t, it->second)) {
      throw std::runtime_error("safetensors self-test: tensor '" + name + "' did not round-trip");
    }
  }
  if (out.size() != in.size()) throw std::runtime_error("safetensors self-test: extra tensors");
  fs::remove(path);
}

// ---------------------------------------------------------------------------
// Compression study

namespace {

using checkpoint::ByteGroup;
using checkpoint::Codec;

struct Variant {
  std::string name;
  bool whole_chunk;  // one zstd frame per chunk, one thread (not a checkpoint codec)
  checkpoint::Codec codec;
  checkpoint::ByteGroup byte_group;
  int level;
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"none", false, Codec::kNone, ByteGroup::kOff, 0},
      {"zstd", false, Codec::kZstd, ByteGroup::kOff, 1},
      {"zstd", false, Codec::kZstd, ByteGroup::kOff, 3},
      {"zstd", false, Codec::kZstd, ByteGroup::kOff, 9},
      // byte_group on: float grouping, signrot/1 + bytegroup/1 + zstdplanes/1
      {"floatgroup+zstd", false, Codec::kZstd, ByteGroup::kOn, 1},
      {"floatgroup+zstd", false, Codec::kZstd, ByteGroup::kOn, 3},
      {"floatgroup+zstd", false, Codec::kZstd, ByteGroup::kOn, 9},
      {"zstd_whole_chunk_1thread", true, Codec::kZstd, ByteGroup::kOff, 3}};
  return v;
}

uint64_t nbytes(const torch::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

// Independent copies "tile<k>/<name>" until the set holds `min_bytes`: each
// copy is its own item and chunk, so no codec sees the repetition (zstd
// frames are per block, and blocks never span chunks).
NamedTensors tile_set(const NamedTensors& tensors, uint64_t min_bytes, int* copies) {
  uint64_t set_bytes = 0;
  for (const auto& [n, t] : tensors) set_bytes += nbytes(t);
  TORCH_CHECK(set_bytes > 0, "compression input set is empty");
  *copies = static_cast<int>(std::max<uint64_t>(1, (min_bytes + set_bytes - 1) / set_bytes));
  if (*copies == 1) return tensors;
  NamedTensors out;
  for (int k = 0; k < *copies; ++k) {
    for (const auto& [n, t] : tensors) out.emplace_back("tile" + std::to_string(k) + "/" + n, t.contiguous());
  }
  return out;
}

// The reference approach: one ZSTD_compress call per whole tensor on one
// thread, written back to back into one file, fsynced; load reads and
// decompresses each into its preallocated target.
void whole_chunk_save(const NamedTensors& set, const std::string& path, int level,
                      std::vector<uint64_t>& frame_sizes, uint64_t* stored) {
  Fd fd(path, O_WRONLY | O_CREAT | O_TRUNC);
  std::vector<uint8_t> buf;
  *stored = 0;
  frame_sizes.clear();
  for (const auto& [n, t] : set) {
    const size_t src = nbytes(t);
    buf.resize(ZSTD_compressBound(src));
    size_t r = ZSTD_compress(buf.data(), buf.size(), t.data_ptr(), src, level);
    if (ZSTD_isError(r)) throw std::runtime_error(std::string("ZSTD_compress: ") + ZSTD_getErrorName(r));
    fd.write_all(buf.data(), r);
    frame_sizes.push_back(r);
    *stored += r;
  }
  fd.sync();
}

void whole_chunk_load(NamedTensors& targets, const std::string& path,
                      const std::vector<uint64_t>& frame_sizes) {
  Fd fd(path, O_RDONLY);
  std::vector<uint8_t> buf;
  for (size_t i = 0; i < targets.size(); ++i) {
    buf.resize(frame_sizes[i]);
    fd.read_all(buf.data(), buf.size());
    torch::Tensor& t = targets[i].second;
    size_t r = ZSTD_decompress(t.data_ptr(), nbytes(t), buf.data(), buf.size());
    if (ZSTD_isError(r) || r != nbytes(t)) {
      throw std::runtime_error("ZSTD_decompress of '" + targets[i].first + "' failed");
    }
  }
}

}  // namespace

namespace {

// CPU seconds (user + system) of this process so far, all threads.
double process_cpu_s() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  return s(ru.ru_utime) + s(ru.ru_stime);
}

}  // namespace

namespace {

// One variant's samples over the trials (stored bytes: the last trial's).
struct VariantSamples {
  uint64_t stored = 0;
  std::vector<double> save_s, load_s, save_cpu_s, load_cpu_s;
};

// Wall and CPU seconds of `fn`, appended to `wall` and `cpu`.
template <typename Fn>
void time_into(std::vector<double>& wall, std::vector<double>& cpu, Fn fn) {
  auto t0 = Clock::now();
  double c0 = process_cpu_s();
  fn();
  wall.push_back(seconds_since(t0));
  cpu.push_back(process_cpu_s() - c0);
}

// The reference: whole tensors through one-thread zstd into `vdir`, loaded
// back into `targets`.
void sample_whole_chunk(const NamedTensors& set, NamedTensors& targets, const std::string& vdir, int level,
                        VariantSamples& out) {
  const std::string path = (fs::path(vdir) / "whole.zst").string();
  std::vector<uint64_t> frames;
  time_into(out.save_s, out.save_cpu_s, [&] { whole_chunk_save(set, path, level, frames, &out.stored); });
  drop_page_cache(vdir);
  time_into(out.load_s, out.load_cpu_s, [&] { whole_chunk_load(targets, path, frames); });
}

// save_state_dict with the variant's compression into `vdir`, then
// load_state_dict into `targets`.
void sample_checkpoint(const NamedTensors& set, NamedTensors& targets, const std::string& vdir, const Variant& v,
                       comm::Group& group, const CompressionStudyOptions& options,
                       VariantSamples& out) {
  checkpoint::StateDict sd;
  for (const auto& [n, tt] : set) sd.add_tensor(n, tt);
  checkpoint::SaveOptions so;
  so.storage = options.storage;
  so.io_threads = options.io_threads;
  so.compression.codec = v.codec;
  so.compression.byte_group = v.byte_group;
  if (v.level > 0) so.compression.level = v.level;
  const std::string step_dir = (fs::path(vdir) / "step_0").string();
  time_into(out.save_s, out.save_cpu_s,
            [&] { out.stored = checkpoint::save_state_dict(sd, step_dir, group, so).total_stored_bytes; });
  drop_page_cache(vdir);
  checkpoint::StateDict into;
  for (const auto& [n, tt] : targets) into.add_tensor(n, tt);
  checkpoint::LoadOptions lo;
  lo.storage = options.storage;
  lo.io_threads = options.io_threads;
  time_into(out.load_s, out.load_cpu_s, [&] { checkpoint::load_state_dict(into, step_dir, lo); });
}

// Throws naming the first tensor of `set` that `targets` does not hold bit-exact.
void check_loaded_exact(const NamedTensors& set, const NamedTensors& targets, const std::string& set_name,
                        const Variant& v) {
  for (size_t i = 0; i < set.size(); ++i) {
    if (!same_bytes(set[i].second, targets[i].second)) {
      throw std::runtime_error("compression study: " + set_name + " variant " + v.name + " level " +
                               std::to_string(v.level) + ": tensor '" + set[i].first +
                               "' did not load back bit-exact");
    }
  }
}

// The study's row of one variant: sizes, medians and rates.
nlohmann::json variant_row(const Variant& v, const VariantSamples& x, uint64_t logical, size_t tensors,
                           int copies, int io_threads) {
  const double mb = static_cast<double>(logical) / 1e6;
  const int threads = v.whole_chunk ? 1 : io_threads;
  const double save_s = median(x.save_s);
  const double load_s = median(x.load_s);
  return {{"name", v.name},
          {"level", v.level},
          {"stored_bytes", x.stored},
          {"logical_bytes", logical},
          {"ratio", static_cast<double>(x.stored) / static_cast<double>(logical)},
          {"save_s", save_s},
          {"load_s", load_s},
          {"save_cpu_s", median(x.save_cpu_s)},
          {"load_cpu_s", median(x.load_cpu_s)},
          {"save_s_trials", x.save_s},
          {"load_s_trials", x.load_s},
          {"threads", threads},
          // Per thread = per CPU-second the save used, on all threads.
          {"save_mb_s_per_thread", mb / std::max(1e-9, median(x.save_cpu_s))},
          {"load_mb_s", mb / load_s},
          {"tensors", tensors},
          {"tile_copies", copies}};
}

}  // namespace

nlohmann::json run_compression_study(const std::string& set_name, const NamedTensors& tensors,
                                     bool tile, comm::Group& group,
                                     const CompressionStudyOptions& options) {
  int copies = 1;
  NamedTensors set = tile ? tile_set(tensors, options.min_set_bytes, &copies) : tensors;
  uint64_t logical = 0;
  for (const auto& [n, t] : set) logical += nbytes(t);
  NamedTensors targets;
  for (const auto& [n, t] : set) targets.emplace_back(n, torch::zeros_like(t));

  const std::vector<Variant>& vs = variants();
  auto wanted = [&options](const Variant& v) {
    if (!options.reference_variants_only) return true;
    return v.name == "none" || (v.level == 3 && (v.name == "zstd" || v.name == "floatgroup+zstd"));
  };
  const std::string set_dir = (fs::path(options.dir) / set_name).string();
  std::vector<VariantSamples> samples(vs.size());
  const int trials = std::max(1, options.trials);
  // Trial t runs the variants in a rotated order, so that no variant always
  // follows the same one (the disk's write-back state, the CPU's caches).
  for (int t = 0; t < trials; ++t) {
    for (size_t j = 0; j < vs.size(); ++j) {
      const size_t vi = (j + static_cast<size_t>(t)) % vs.size();
      const Variant& v = vs[vi];
      if (!wanted(v)) continue;
      const std::string vdir =
          (fs::path(set_dir) / (v.name + "_" + std::to_string(v.level))).string();
      fs::remove_all(vdir);
      fs::create_directories(vdir);
      for (auto& [n, tt] : targets) tt.zero_();
      if (v.whole_chunk) {
        sample_whole_chunk(set, targets, vdir, v.level, samples[vi]);
      } else {
        sample_checkpoint(set, targets, vdir, v, group, options, samples[vi]);
      }
      check_loaded_exact(set, targets, set_name, v);
      fs::remove_all(vdir);
    }
  }
  fs::remove_all(set_dir);

  nlohmann::json rows = nlohmann::json::array();
  for (size_t vi = 0; vi < vs.size(); ++vi) {
    if (wanted(vs[vi])) rows.push_back(variant_row(vs[vi], samples[vi], logical, set.size(), copies, options.io_threads));
  }
  return rows;
}

}  // namespace bench
