#include "framework/data/token_shard.h"

#include <dirent.h>
#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <tuple>

namespace framework::data {
namespace {

constexpr int32_t kLlmcMagic16 = 20240520;  // GPT-2 data: version 1, uint16 tokens
constexpr int32_t kLlmcMagic32 = 20240801;  // Llama 3 data: version 7, uint32 tokens
constexpr int64_t kLlmcHeaderBytes = 256 * 4;
constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kMegatronHeaderBytes = 9 + 8 + 1 + 8 + 8;

[[noreturn]] void shard_error(const std::string& message) { throw DataError(message); }

std::string quote_path(const std::string& s) { return "'" + s + "'"; }

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// One token of `width` bytes at p, widened.
int64_t decode(const uint8_t* p, int width, bool is_signed) {
  switch (width * (is_signed ? -1 : 1)) {
    case 1: return *p;
    case -1: return static_cast<int8_t>(*p);
    case 2: return load<uint16_t>(p);
    case -2: return load<int16_t>(p);
    case 4: return load<uint32_t>(p);
    case -4: return load<int32_t>(p);
    default: return load<int64_t>(p);
  }
}

bool is_regular(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// The whole file, mapped read-only. Errors name the file.
std::pair<std::shared_ptr<const uint8_t>, int64_t> map_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) shard_error("data: cannot open " + quote_path(path) + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    shard_error("data: cannot stat " + quote_path(path) + ": " + std::strerror(e));
  }
  const auto size = static_cast<int64_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    shard_error("data: " + quote_path(path) + " is empty (0 bytes)");
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
  const int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) shard_error("data: cannot map " + quote_path(path) + ": " + std::strerror(e));
  // Windows are drawn at random: no read-ahead beyond the pages touched.
  ::madvise(p, static_cast<size_t>(size), MADV_RANDOM);
  std::shared_ptr<const uint8_t> map(static_cast<const uint8_t*>(p), [size](const uint8_t* q) {
    ::munmap(const_cast<uint8_t*>(q), static_cast<size_t>(size));
  });
  return {map, size};
}

void parse_llmc(TokenShard& s) {
  const uint8_t* p = s.map.get();
  const int32_t magic = s.map_bytes >= 4 ? load<int32_t>(p) : 0;
  if (magic != kLlmcMagic16 && magic != kLlmcMagic32) {
    std::ostringstream m;
    m << "data: " << quote_path(s.path) << " is not a token shard: offset 0 holds "
      << (s.map_bytes >= 4 ? std::to_string(magic) : "less than 4 bytes")
      << "; expected llm.c's magic " << kLlmcMagic16 << " (uint16 tokens) or " << kLlmcMagic32
      << " (uint32 tokens), or a Megatron .idx beside it";
    shard_error(m.str());
  }
  if (s.map_bytes < kLlmcHeaderBytes) {
    shard_error("data: " + quote_path(s.path) + " is truncated: " + std::to_string(s.map_bytes) +
         " bytes, fewer than llm.c's " + std::to_string(kLlmcHeaderBytes) + "-byte header");
  }
  const int32_t version = load<int32_t>(p + 4);
  const int32_t want = magic == kLlmcMagic16 ? 1 : 7;
  if (version != want) {
    shard_error("data: " + quote_path(s.path) + ": llm.c version " + std::to_string(version) +
         " at offset 4; magic " + std::to_string(magic) + " goes with version " +
         std::to_string(want));
  }
  const int32_t count = load<int32_t>(p + 8);
  if (count < 0) {
    shard_error("data: " + quote_path(s.path) + ": negative token count " + std::to_string(count) +
         " at offset 8");
  }
  s.width = magic == kLlmcMagic16 ? 2 : 4;
  s.is_signed = false;
  s.format = magic == kLlmcMagic16 ? "llm.c uint16" : "llm.c uint32";
  s.data_offset = kLlmcHeaderBytes;
  s.tokens = count;
  const int64_t expected = kLlmcHeaderBytes + int64_t{count} * s.width;
  if (s.map_bytes < expected) {
    shard_error("data: " + quote_path(s.path) + " is truncated: the header (offset 8) says " +
         std::to_string(count) + " tokens, " + std::to_string(expected) + " bytes in all; the file has " +
         std::to_string(s.map_bytes) + " (it ends in token " +
         std::to_string((s.map_bytes - kLlmcHeaderBytes) / s.width) + ")");
  }
  if (s.map_bytes > expected) {
    shard_error("data: " + quote_path(s.path) + " has " + std::to_string(s.map_bytes - expected) +
         " bytes after its last token at offset " + std::to_string(expected) +
         " (the header at offset 8 says " + std::to_string(count) + " tokens)");
  }
  s.doc_starts = {0};
}

struct MegatronDtype {
  int width;
  bool is_signed;
  const char* name;
};

// Megatron-LM's DType codes (megatron/core/datasets/indexed_dataset.py).
MegatronDtype megatron_dtype(uint8_t code, const std::string& idx) {
  switch (code) {
    case 1: return {1, false, "uint8"};
    case 2: return {1, true, "int8"};
    case 3: return {2, true, "int16"};
    case 4: return {4, true, "int32"};
    case 5: return {8, true, "int64"};
    case 8: return {2, false, "uint16"};
    case 6:
    case 7:
      shard_error("data: " + quote_path(idx) + ": dtype code " + std::to_string(code) +
           " at offset 17 is a float type, not token ids");
    default:
      shard_error("data: " + quote_path(idx) + ": unknown dtype code " + std::to_string(code) +
           " at offset 17 (Megatron's are 1-8)");
  }
}

void parse_megatron(TokenShard& s, const std::string& idx) {
  auto [imap, isize] = map_file(idx);
  const uint8_t* p = imap.get();
  if (isize < kMegatronHeaderBytes || std::memcmp(p, kMegatronMagic, 9) != 0) {
    shard_error("data: " + quote_path(idx) + " is not a Megatron index: " +
         (isize < 9 ? std::string("shorter than its 9-byte magic")
                    : std::string("offset 0 does not hold MMIDIDX\\0\\0")));
  }
  const auto version = load<uint64_t>(p + 9);
  if (version != 1) {
    shard_error("data: " + quote_path(idx) + ": Megatron index version " + std::to_string(version) +
         " at offset 9; only version 1 is known");
  }
  const MegatronDtype dt = megatron_dtype(p[17], idx);
  const auto sequences = load<uint64_t>(p + 18);
  const auto documents = load<uint64_t>(p + 26);
  // Lengths (int32), pointers (int64), document indices (int64), then an
  // optional int8 mode per sequence (multimodal datasets).
  const uint64_t need = kMegatronHeaderBytes + sequences * 12 + documents * 8;
  if (sequences > (uint64_t{1} << 40) || documents > (uint64_t{1} << 40) ||
      static_cast<uint64_t>(isize) < need) {
    shard_error("data: " + quote_path(idx) + " is truncated: its header (offsets 18, 26) counts " +
         std::to_string(sequences) + " sequences and " + std::to_string(documents) +
         " document indices, " + std::to_string(need) + " bytes; the file has " + std::to_string(isize));
  }
  if (static_cast<uint64_t>(isize) != need && static_cast<uint64_t>(isize) != need + sequences) {
    shard_error("data: " + quote_path(idx) + " has " + std::to_string(isize) + " bytes; its header counts " +
         std::to_string(sequences) + " sequences and " + std::to_string(documents) +
         " document indices, " + std::to_string(need) + " bytes (or " +
         std::to_string(need + sequences) + " with sequence modes)");
  }
  const uint8_t* lengths = p + kMegatronHeaderBytes;
  const uint8_t* pointers = lengths + sequences * 4;
  const uint8_t* docs = pointers + sequences * 8;
  std::vector<int64_t> seq_start(sequences + 1, 0);  // token offset of each sequence
  for (uint64_t i = 0; i < sequences; ++i) {
    const auto len = load<int32_t>(lengths + i * 4);
    const auto ptr = load<int64_t>(pointers + i * 8);
    if (len < 0 || ptr != seq_start[i] * dt.width) {
      const int64_t off = len < 0 ? kMegatronHeaderBytes + static_cast<int64_t>(i) * 4
                                  : static_cast<int64_t>(pointers - p) + static_cast<int64_t>(i) * 8;
      shard_error("data: " + quote_path(idx) + ": sequence " + std::to_string(i) + " at offset " +
           std::to_string(off) + (len < 0 ? " has a negative length " + std::to_string(len)
                                          : " points at byte " + std::to_string(ptr) + ", not " +
                                                std::to_string(seq_start[i] * dt.width) +
                                                " where the previous sequence ends"));
    }
    seq_start[i + 1] = seq_start[i] + len;
  }
  s.width = dt.width;
  s.is_signed = dt.is_signed;
  s.format = std::string("megatron ") + dt.name;
  s.data_offset = 0;
  s.tokens = seq_start[sequences];
  const int64_t expected = s.tokens * s.width;
  if (s.map_bytes != expected) {
    shard_error("data: " + quote_path(s.path) + (s.map_bytes < expected ? " is truncated: " : " is too long: ") +
         std::to_string(s.map_bytes) + " bytes, but " + quote_path(idx) + " lists " +
         std::to_string(s.tokens) + " " + dt.name + " tokens, " + std::to_string(expected) + " bytes");
  }
  // Document d is sequences [docs[d], docs[d + 1]); docs[0] is 0 and the last
  // is the sequence count.
  int64_t prev = 0;
  for (uint64_t d = 0; d < documents; ++d) {
    const auto v = load<int64_t>(docs + d * 8);
    const bool bad = v < prev || static_cast<uint64_t>(v) > sequences || (d == 0 && v != 0) ||
                     (d + 1 == documents && static_cast<uint64_t>(v) != sequences);
    if (bad) {
      shard_error("data: " + quote_path(idx) + ": document index " + std::to_string(d) + " at offset " +
           std::to_string((docs - p) + static_cast<int64_t>(d) * 8) + " is " + std::to_string(v) +
           " (they rise from 0 to the sequence count " + std::to_string(sequences) + ")");
    }
    // Empty documents (a repeated index) start nowhere: none at the shard's
    // end, where the next shard's first document starts (fuzz_token_shard).
    if (d + 1 < documents && seq_start[v] < s.tokens &&
        (s.doc_starts.empty() || s.doc_starts.back() != seq_start[v])) {
      s.doc_starts.push_back(seq_start[v]);
    }
    prev = v;
  }
  if (s.doc_starts.empty()) s.doc_starts = {0};
}

// Files whose every token id was read and found below a vocabulary size,
// each as "path|size|mtime_s|mtime_ns|inode|vocab": the process's own checks
// and those its launcher passed down (kCheckedTokensEnv).
std::mutex checked_mu;
std::set<std::string>& checked_files() {
  static std::set<std::string>* files = [] {
    auto* f = new std::set<std::string>;
    if (const char* env = std::getenv(kCheckedTokensEnv)) {
      std::istringstream in(env);
      std::string line;
      while (std::getline(in, line)) {
        if (!line.empty()) f->insert(line);
      }
    }
    return f;
  }();
  return *files;
}

}  // namespace

void throw_token_outside_vocab(const std::string& key, const TokenShard& s, int64_t t, int64_t v,
                            int64_t vocab) {
  shard_error(key + ": " + quote_path(s.path) + ": token id " + std::to_string(v) + " at byte offset " +
       std::to_string(s.data_offset + t * s.width) + " (token " + std::to_string(t) +
       ") is outside [0, model.vocab_size " + std::to_string(vocab) + ")");
}

bool check_shard_tokens(const TokenShard& s, int64_t vocab, const std::string& key) {
  struct stat st {};
  ::stat(s.path.c_str(), &st);
  const std::string id = s.path + "|" + std::to_string(st.st_size) + "|" + std::to_string(st.st_mtim.tv_sec) + "|" +
                         std::to_string(st.st_mtim.tv_nsec) + "|" + std::to_string(st.st_ino) + "|" +
                         std::to_string(vocab);
  {
    std::lock_guard<std::mutex> lock(checked_mu);
    if (checked_files().count(id) != 0) return false;
  }
  const int fd = ::open(s.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) shard_error(key + ": cannot open " + quote_path(s.path) + ": " + std::strerror(errno));
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  constexpr int64_t kChunkTokens = 1 << 20;
  // A chunk, or the whole shard when it is smaller.
  std::vector<uint8_t> buf(static_cast<size_t>(std::min(kChunkTokens, std::max<int64_t>(s.tokens, 1)) * s.width));
  for (int64_t t0 = 0; t0 < s.tokens; t0 += kChunkTokens) {
    const int64_t n = std::min(kChunkTokens, s.tokens - t0);
    const int64_t bytes = n * s.width;
    int64_t got = 0;
    while (got < bytes) {
      const ssize_t r = ::pread(fd, buf.data() + got, static_cast<size_t>(bytes - got),
                                s.data_offset + t0 * s.width + got);
      if (r <= 0) {
        const int e = r < 0 ? errno : EIO;
        ::close(fd);
        shard_error(key + ": cannot read " + quote_path(s.path) + " at offset " +
             std::to_string(s.data_offset + t0 * s.width + got) + ": " + std::strerror(e));
      }
      got += r;
    }
    int64_t lo = 0, hi = 0;
    auto scan = [&](auto tag) {
      using T = decltype(tag);
      T mn = std::numeric_limits<T>::max(), mx = std::numeric_limits<T>::lowest();
      const T* v = reinterpret_cast<const T*>(buf.data());
      for (int64_t i = 0; i < n; ++i) {
        mn = std::min(mn, v[i]);
        mx = std::max(mx, v[i]);
      }
      lo = static_cast<int64_t>(mn);
      hi = static_cast<int64_t>(mx);  // no uint64 dtype: always fits
    };
    switch (s.width * (s.is_signed ? -1 : 1)) {
      case 1: scan(uint8_t{}); break;
      case -1: scan(int8_t{}); break;
      case 2: scan(uint16_t{}); break;
      case -2: scan(int16_t{}); break;
      case 4: scan(uint32_t{}); break;
      case -4: scan(int32_t{}); break;
      default: scan(int64_t{}); break;
    }
    if (lo < 0 || hi >= vocab) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t v = decode(buf.data() + i * s.width, s.width, s.is_signed);
        if (v < 0 || v >= vocab) {
          ::close(fd);
          throw_token_outside_vocab(key, s, t0 + i, v, vocab);
        }
      }
    }
  }
  ::close(fd);
  std::lock_guard<std::mutex> lock(checked_mu);
  checked_files().insert(id);
  return true;
}

std::string checked_token_files() {
  std::lock_guard<std::mutex> lock(checked_mu);
  std::string out;
  for (const std::string& f : checked_files()) out += f + "\n";
  return out;
}

int64_t TokenShard::at(int64_t t) const { return decode(map.get() + data_offset + t * width, width, is_signed); }

std::vector<std::string> resolve_token_paths(const std::string& path, const std::string& key) {
  if (path.empty()) shard_error(key + " must name token shards (a file, a directory or a glob)");
  std::vector<std::string> out;
  if (path.find_first_of("*?[") != std::string::npos) {
    glob_t g{};
    const int rc = ::glob(path.c_str(), 0, nullptr, &g);
    if (rc == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) {
        const std::string m = g.gl_pathv[i];
        if (ends_with(m, ".bin") && is_regular(m)) out.push_back(m);
      }
    }
    const size_t matched = rc == 0 ? g.gl_pathc : 0;
    ::globfree(&g);
    if (matched == 0) shard_error(key + ": no file matches " + quote_path(path));
    if (out.empty()) {
      shard_error(key + ": " + quote_path(path) + " matches " + std::to_string(matched) +
           " files, none a .bin token shard");
    }
  } else {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      DIR* dir = ::opendir(path.c_str());
      if (dir == nullptr) shard_error(key + ": cannot list " + quote_path(path) + ": " + std::strerror(errno));
      while (const dirent* e = ::readdir(dir)) {
        const std::string name = e->d_name;
        const std::string full = path + (ends_with(path, "/") ? "" : "/") + name;
        if (ends_with(name, ".bin") && is_regular(full)) out.push_back(full);
      }
      ::closedir(dir);
      if (out.empty()) shard_error(key + ": directory " + quote_path(path) + " holds no .bin token shards");
    } else if (::stat(path.c_str(), &st) == 0) {
      if (!S_ISREG(st.st_mode)) shard_error(key + ": " + quote_path(path) + " is not a regular file");
      // X.idx names its Megatron dataset as well as X.bin does.
      out.push_back(ends_with(path, ".idx") ? path.substr(0, path.size() - 4) + ".bin" : path);
    } else if (is_regular(path + ".bin")) {
      out.push_back(path + ".bin");  // a Megatron path prefix
    } else {
      shard_error(key + ": cannot open " + quote_path(path) + ": " + std::strerror(ENOENT));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

DirectorySplit split_token_directory(const std::string& path, const std::vector<std::string>& files) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return {};
  const auto named = [](const std::string& file, const std::string& role) {
    const std::string name = file.substr(file.find_last_of('/') + 1);
    return name.rfind(role + "_", 0) == 0 || name.find("_" + role + "_") != std::string::npos;
  };
  DirectorySplit split;
  bool any_train = false;
  for (const std::string& f : files) {
    if (named(f, "val")) {
      split.val.push_back(f);
    } else {
      any_train = any_train || named(f, "train");
      split.train.push_back(f);
    }
  }
  if (split.val.empty() || !any_train) return {};
  return split;
}

TokenShard open_token_shard(const std::string& bin_path) {
  TokenShard s;
  s.path = bin_path;
  std::tie(s.map, s.map_bytes) = map_file(bin_path);
  const std::string idx =
      (ends_with(bin_path, ".bin") ? bin_path.substr(0, bin_path.size() - 4) : bin_path) + ".idx";
  if (ends_with(bin_path, ".bin") && is_regular(idx)) {
    parse_megatron(s, idx);
  } else {
    parse_llmc(s);
  }
  return s;
}

}  // namespace framework::data
