// The local file system: open/pread/pwrite/fsync, with a small cache of read
// descriptors (storage.h: posix_storage).
#include "checkpoint/storage/storage.h"
#include "checkpoint/storage/posix_counters.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>

namespace checkpoint {

namespace {

// Closes a file descriptor on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

std::atomic<uint64_t> g_direct_bytes{0};
std::atomic<uint64_t> g_buffered_bytes{0};
std::atomic<uint64_t> g_bounced_bytes{0};

void pwrite_all(int fd, const std::string& path, uint64_t offset, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  g_buffered_bytes.fetch_add(n, std::memory_order_relaxed);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) throw IoError::from_errno("cannot write", path, errno);
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

// O_DIRECT needs file offsets, lengths and memory aligned to the device's
// logical block; 4 KiB covers 512-byte and 4 KiB devices.
constexpr uint64_t kDirectAlign = 4096;
constexpr size_t kBounceBytes = size_t{8} << 20;

// One aligned buffer per writing thread, kept for the thread's life.
struct Bounce {
  void* p = nullptr;
  ~Bounce() { std::free(p); }
  uint8_t* get() {
    if (p == nullptr) p = std::aligned_alloc(kDirectAlign, kBounceBytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<uint8_t*>(p);
  }
};

uint8_t* bounce_buffer() {
  thread_local Bounce bounce;
  return bounce.get();
}

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(int fd, std::string path, const PosixOptions& options)
      : fd_(fd), path_(std::move(path)), options_(options), direct_(options.direct_io != DirectIo::kOff) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
    if (dfd_ >= 0) ::close(dfd_);
  }

  void append(const void* data, size_t n) override {
    write_at(position_, data, n);
    position_ += n;
  }
  void write_at(uint64_t offset, const void* data, size_t n) override {
    require_open();
    IoTimer timer(this, n);
    const auto* src = static_cast<const uint8_t*>(data);
    // The whole pages inside [offset, offset + n) go direct; the partial
    // pages at the ends through the page cache. Concurrent calls cover
    // disjoint ranges, so no page is written both ways.
    const uint64_t lo = (offset + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    const uint64_t hi = (offset + n) / kDirectAlign * kDirectAlign;
    if (n < options_.direct_min_bytes || hi <= lo ||
        !direct_.load(std::memory_order_relaxed) || direct_fd() < 0) {
      pwrite_all(fd_, path_, offset, src, n);
      return;
    }
    if (lo > offset) pwrite_all(fd_, path_, offset, src, static_cast<size_t>(lo - offset));
    write_direct(lo, src + (lo - offset), hi - lo);
    if (offset + n > hi) pwrite_all(fd_, path_, hi, src + (hi - offset), static_cast<size_t>(offset + n - hi));
  }
  void sync() override {
    require_open();
    // One inode: this flushes the page-cache pages, the metadata of the
    // direct writes and the device's cache.
    {
      IoTimer timer(this, 0);
      if (::fsync(fd_) != 0) throw IoError::from_errno("cannot fsync", path_, errno);
    }
    learn_from_this_file();
  }
  void start_writeback(uint64_t offset, uint64_t n) override {
#if defined(__linux__)
    // Queues the dirty pages for write-out and returns; fsync still waits
    // for them (and for metadata). A file system without it just says no.
    if (fd_ >= 0 && n > 0) {
      (void)::sync_file_range(fd_, static_cast<off64_t>(offset), static_cast<off64_t>(n),
                              SYNC_FILE_RANGE_WRITE);
    }
#else
    (void)offset;
    (void)n;
#endif
  }
  void close() override {
    if (dfd_ >= 0) {
      ::close(dfd_);  // nothing buffered behind it
      dfd_ = -1;
    }
    if (fd_ < 0) return;
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw IoError::from_errno("cannot close", path_, errno);
  }

 private:
  void require_open() const {
    if (fd_ < 0) throw IoError("write to closed file " + path_);
  }

  // The O_DIRECT descriptor, opened at the first large write; -1 where the
  // file system refuses it, or direct_io auto's probe chose the page cache
  // (then direct_ is false for good).
  int direct_fd() {
    std::call_once(direct_open_, [this] {
#if defined(O_DIRECT)
      auto_chose_ = options_.direct_io == DirectIo::kAuto;
      if (!use_direct_io(options_.direct_io, parent_dir(path_))) {
        direct_.store(false);
        return;
      }
      // Reopening through /proc names this very file even if it was
      // renamed since; the path is the fallback, checked to be the same
      // inode.
      const std::string self = "/proc/self/fd/" + std::to_string(fd_);
      dfd_ = ::open(self.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
      if (dfd_ < 0 && errno != EINVAL) dfd_ = ::open(path_.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
      struct stat a {}, b {};
      if (dfd_ >= 0 && (::fstat(fd_, &a) != 0 || ::fstat(dfd_, &b) != 0 || a.st_dev != b.st_dev ||
                        a.st_ino != b.st_ino)) {
        ::close(dfd_);
        dfd_ = -1;
      }
#endif
      if (dfd_ < 0) direct_.store(false);
    });
    return dfd_;
  }

  // Writes whole pages [offset, offset + n) with O_DIRECT, from `src` when
  // it is page-aligned, else through this thread's bounce buffer. Falls back
  // to the page cache for the rest when the kernel refuses (EINVAL) or
  // writes part of a page.
  void write_direct(uint64_t offset, const uint8_t* src, uint64_t n) {
    const bool aligned = reinterpret_cast<uintptr_t>(src) % kDirectAlign == 0;
    uint8_t* bounce = aligned ? nullptr : bounce_buffer();
    while (n > 0) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(n, aligned ? (uint64_t{1} << 30) : kBounceBytes));
      const uint8_t* from = src;
      if (!aligned) {
        std::memcpy(bounce, src, len);
        from = bounce;
        g_bounced_bytes.fetch_add(len, std::memory_order_relaxed);
      }
      size_t done = 0;
      while (done < len) {
        const ssize_t w = ::pwrite(dfd_, from + done, len - done, static_cast<off_t>(offset + done));
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EINVAL || errno == EOPNOTSUPP)) {
          direct_.store(false);  // this file system takes no direct writes after all
          pwrite_all(fd_, path_, offset + done, src + done, static_cast<size_t>(n - done));
          return;
        }
        if (w < 0) throw IoError::from_errno("cannot write", path_, errno);
        done += static_cast<size_t>(w);
        g_direct_bytes.fetch_add(static_cast<uint64_t>(w), std::memory_order_relaxed);
        if (done < len && done % kDirectAlign != 0) {  // a partial page: finish buffered
          pwrite_all(fd_, path_, offset + done, src + done, static_cast<size_t>(n - done));
          return;
        }
      }
      src += len;
      offset += len;
      n -= len;
    }
  }

  // auto: the wall time during which at least one write or fsync of this
  // file was under way, and the bytes written. Time between writes (the
  // caller hashing, staging or waiting for a peer) is not the way of
  // writing's, so it is left out.
  class IoTimer {
   public:
    IoTimer(PosixWritableFile* f, size_t n) : f_(f->options_.direct_io == DirectIo::kAuto ? f : nullptr) {
      if (f_ == nullptr) return;
      std::lock_guard<std::mutex> lock(f_->io_mu_);
      if (f_->io_active_++ == 0) f_->io_since_ = std::chrono::steady_clock::now();
      f_->bytes_ += n;
    }
    ~IoTimer() {
      if (f_ == nullptr) return;
      std::lock_guard<std::mutex> lock(f_->io_mu_);
      if (--f_->io_active_ == 0) {
        f_->io_busy_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - f_->io_since_).count();
      }
    }
    IoTimer(const IoTimer&) = delete;
    IoTimer& operator=(const IoTimer&) = delete;

   private:
    PosixWritableFile* f_;
  };

  // auto, at the first fsync after a large write: this file's rate (bytes
  // over its I/O time), for auto's next choice (direct_io.h). A file that
  // fell back to the page cache counts as such.
  void learn_from_this_file() {
    std::lock_guard<std::mutex> lock(io_mu_);
    if (!auto_chose_ || learned_ || bytes_ < options_.learn_min_bytes) return;
    learned_ = true;
    record_auto_write(parent_dir(path_), direct_.load(), bytes_, io_busy_s_);
  }

  int fd_;
  int dfd_ = -1;
  std::string path_;
  PosixOptions options_;
  std::atomic<bool> direct_;
  std::once_flag direct_open_;
  bool auto_chose_ = false;  // auto decided this file's way (at its first large write)
  bool learned_ = false;     // its rate was recorded
  std::mutex io_mu_;  // guards the four below
  int io_active_ = 0;  // writes and fsyncs under way
  std::chrono::steady_clock::time_point io_since_;
  double io_busy_s_ = 0;
  uint64_t bytes_ = 0;
  uint64_t position_ = 0;
};

// Read descriptors kept open between read_at calls: opening the file for
// every read dominates loads of many small items. pread on a shared
// descriptor is thread-safe. Entries are shared: one evicted while a read
// uses it closes when that read is done.
class ReadFdCache {
 public:
  static constexpr size_t kMaxOpen = 64;

  // An open descriptor for `path`. A cached one whose file was deleted or
  // renamed over since (no links left) is replaced by a fresh open.
  std::shared_ptr<const Fd> open(const std::string& path) {
    if (std::shared_ptr<const Fd> fd = lookup(path)) {
      struct stat st {};
      if (::fstat(fd->fd, &st) == 0 && st.st_nlink > 0) return fd;
      forget(path);
    }
    auto fd = std::make_shared<const Fd>(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd->fd < 0) throw IoError::from_errno("cannot open", path, errno);
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = index_.find(path); it != index_.end()) return it->second->second;  // raced
    lru_.emplace_front(path, fd);
    index_[path] = lru_.begin();
    if (lru_.size() > kMaxOpen) {
      index_.erase(lru_.back().first);
      lru_.pop_back();
    }
    return fd;
  }

  void forget(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = index_.find(path); it != index_.end()) {
      lru_.erase(it->second);
      index_.erase(it);
    }
  }

  // Forgets `path` and everything under it.
  void forget_under(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = lru_.begin(); it != lru_.end();) {
      const std::string& p = it->first;
      const bool under = p.compare(0, path.size(), path) == 0 &&
                         (p.size() == path.size() || p[path.size()] == '/' ||
                          (!path.empty() && path.back() == '/'));
      if (under) {
        index_.erase(p);
        it = lru_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    index_.clear();
    lru_.clear();
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return lru_.size();
  }

 private:
  std::shared_ptr<const Fd> lookup(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(path);
    if (it == index_.end()) return nullptr;
    lru_.splice(lru_.begin(), lru_, it->second);  // most recently used first
    return it->second->second;
  }

  std::mutex mu_;
  std::list<std::pair<std::string, std::shared_ptr<const Fd>>> lru_;
  std::unordered_map<std::string, std::list<std::pair<std::string, std::shared_ptr<const Fd>>>::iterator>
      index_;
};

class PosixStorage final : public Storage {
 public:
  explicit PosixStorage(const PosixOptions& options) : options_(options) {}

  void drop_read_cache() override { read_fds_.clear(); }

  std::unique_ptr<WritableFile> create_file(const std::string& path) override {
    read_fds_.forget(path);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) throw IoError::from_errno("cannot create", path, errno);
    return std::make_unique<PosixWritableFile>(fd, path, options_);
  }

  void read_at(const std::string& path, uint64_t offset, void* dst, size_t n) override {
    const std::shared_ptr<const Fd> fd = read_fds_.open(path);
    const Fd& f = *fd;
    auto* p = static_cast<uint8_t*>(dst);
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(f.fd, p + done, n - done, static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw IoError::from_errno("cannot read", path, errno);
      if (r == 0) {
        struct stat st {};
        const uint64_t size = ::fstat(f.fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
        throw IoError("truncated: " + path + " has " + std::to_string(size) +
                      " bytes, needed " + std::to_string(offset + n));
      }
      done += static_cast<size_t>(r);
    }
  }

  uint64_t file_size(const std::string& path) override {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) throw IoError::from_errno("cannot stat", path, errno);
    return static_cast<uint64_t>(st.st_size);
  }

  FileInfo stat(const std::string& path) override {
    struct ::stat st {};
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return {};
      throw IoError::from_errno("cannot stat", path, errno);
    }
    FileInfo info;
    info.type = S_ISREG(st.st_mode)   ? FileType::kFile
                : S_ISDIR(st.st_mode) ? FileType::kDirectory
                                      : FileType::kOther;
    info.size = static_cast<uint64_t>(st.st_size);
    info.mtime_unix_s = static_cast<int64_t>(st.st_mtime);
    return info;
  }

  void make_dirs(const std::string& path) override {
    if (path.empty()) return;
    for (size_t pos = path.find('/', 1);; pos = path.find('/', pos + 1)) {
      const std::string prefix = path.substr(0, pos);
      if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
        throw IoError::from_errno("cannot create directory", prefix, errno);
      }
      if (pos == std::string::npos) break;
    }
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      throw IoError("cannot create directory " + path + ": a file is in the way", ENOTDIR);
    }
  }

  void rename(const std::string& from, const std::string& to) override {
    read_fds_.forget_under(from);
    read_fds_.forget_under(to);
    if (::rename(from.c_str(), to.c_str()) != 0) {
      throw IoError::from_errno("cannot rename " + from + " to", to, errno);
    }
  }

  void sync_dir(const std::string& path) override {
    Fd f(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (f.fd < 0) throw IoError::from_errno("cannot open directory", path, errno);
    if (::fsync(f.fd) != 0) throw IoError::from_errno("cannot fsync directory", path, errno);
  }

  std::vector<std::string> list_dir(const std::string& path) override {
    DIR* dir = ::opendir(path.c_str());
    if (dir == nullptr) throw IoError::from_errno("cannot list", path, errno);
    std::vector<std::string> names;
    errno = 0;
    while (const dirent* entry = ::readdir(dir)) {
      const std::string name = entry->d_name;
      if (name != "." && name != "..") names.push_back(name);
      errno = 0;
    }
    const int err = errno;
    ::closedir(dir);
    if (err != 0) throw IoError::from_errno("cannot list", path, err);
    std::sort(names.begin(), names.end());
    return names;
  }

  void remove_all(const std::string& path) override {
    read_fds_.forget_under(path);
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno == ENOENT) return;
      throw IoError::from_errno("cannot stat", path, errno);
    }
    if (S_ISDIR(st.st_mode)) {
      for (const std::string& name : list_dir(path)) remove_all(join_path(path, name));
      if (::rmdir(path.c_str()) != 0 && errno != ENOENT) {
        throw IoError::from_errno("cannot remove directory", path, errno);
      }
    } else if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      throw IoError::from_errno("cannot remove", path, errno);
    }
  }

 private:
  const PosixOptions options_;
  ReadFdCache read_fds_;
};

}  // namespace

std::shared_ptr<Storage> posix_storage() {
  static const std::shared_ptr<Storage> storage = std::make_shared<PosixStorage>(PosixOptions{});
  return storage;
}

std::shared_ptr<Storage> posix_storage(const PosixOptions& options) {
  const PosixOptions d;
  if (options.direct_io == d.direct_io && options.direct_min_bytes == d.direct_min_bytes &&
      options.learn_min_bytes == d.learn_min_bytes) {
    return posix_storage();
  }
  return std::make_shared<PosixStorage>(options);
}

PosixWriteCounters posix_write_counters() {
  return PosixWriteCounters{g_direct_bytes.load(), g_buffered_bytes.load(), g_bounced_bytes.load()};
}

}  // namespace checkpoint
