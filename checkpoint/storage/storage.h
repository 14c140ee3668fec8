#pragma once
// The file-system interface the checkpoint system does all its I/O through
// (LevelDB Env-style): data files, metadata, discovery, retention, the ckpt
// tool, export and import. Whoever builds a manager or calls save/load picks
// the Storage (the trainer: POSIX); nothing reads the environment. Tests wrap
// it to count, pace or fail operations (tests/support/faulty_storage.h).
// Implementations: posix_storage() (posix.cpp), memory_storage() (memory.h),
// paced_storage() (paced.h). Torch-free.
//
// Paths are built by the caller: a checkpoint directory joined with a flat
// file name that passed is_safe_file_name (metadata.h). Implementations do not
// interpret metadata; they never see a name the caller did not check.
//
// Thread safety: Storage methods may be called concurrently. A WritableFile
// may take write_at calls for disjoint ranges concurrently; append, sync and
// close need external synchronisation.
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/errors.h"  // IoError
#include "checkpoint/storage/direct_io.h"

namespace checkpoint {

// A file being written. Created by Storage::create_file; the destructor
// closes it (ignoring errors: call close() to see them). Data is durable only
// after sync().
class WritableFile {
 public:
  virtual ~WritableFile();
  // Writes at the append position, then advances it past the data.
  virtual void append(const void* data, size_t n) = 0;
  // Writes at `offset`; does not move the append position.
  virtual void write_at(uint64_t offset, const void* data, size_t n) = 0;
  virtual void sync() = 0;   // fsync
  virtual void close() = 0;  // idempotent; no writes after it
  // A hint that bytes [offset, offset + n), already written, will not change
  // before sync: start writing them to the device now, without waiting, so
  // that the final sync has less left to do. Errors are ignored (sync still
  // reports them). The default does nothing.
  virtual void start_writeback(uint64_t offset, uint64_t n) {
    (void)offset;
    (void)n;
  }
};

enum class FileType { kMissing, kFile, kDirectory, kOther };  // kOther: a symlink, a socket...

struct FileInfo {
  FileType type = FileType::kMissing;
  uint64_t size = 0;         // bytes, for a file
  int64_t mtime_unix_s = 0;  // last modification
};

class Storage {
 public:
  virtual ~Storage();

  // Creates or truncates `path` (mode 0644) for writing.
  virtual std::unique_ptr<WritableFile> create_file(const std::string& path) = 0;
  // Reads exactly bytes [offset, offset + n) of `path` into dst. A file too
  // short throws IoError "truncated: <path> has N bytes, needed <offset+n>".
  virtual void read_at(const std::string& path, uint64_t offset, void* dst, size_t n) = 0;
  virtual uint64_t file_size(const std::string& path) = 0;
  // Describes `path` without following a symbolic link (a symlink is
  // kOther). A missing path is kMissing; other failures throw IoError.
  virtual FileInfo stat(const std::string& path) = 0;
  bool exists(const std::string& path) { return stat(path).type != FileType::kMissing; }
  // Creates `path` and its missing parents (mkdir -p); existing is fine.
  virtual void make_dirs(const std::string& path) = 0;
  // make_dirs, then fsyncs the parent of every directory it created (a
  // directory's name lives in its parent): the new directories survive a
  // power loss. Directories that already existed are not fsynced.
  void make_dirs_durable(const std::string& path);
  // Atomically replaces `to` with `from` (rename(2)); durable after sync_dir.
  virtual void rename(const std::string& from, const std::string& to) = 0;
  // fsyncs the directory `path`, making renames and new entries in it durable.
  virtual void sync_dir(const std::string& path) = 0;
  // The names (not paths) in directory `path`, sorted, without "." and "..".
  virtual std::vector<std::string> list_dir(const std::string& path) = 0;
  // Deletes `path` and, if it is a directory, everything under it; a missing
  // path is fine. Does not follow symbolic links.
  virtual void remove_all(const std::string& path) = 0;

  // Closes the descriptors an implementation keeps open between read_at
  // calls (posix_storage does), so that files deleted since (by retention,
  // perhaps in another process) free their space. Readers call it when they
  // are done (ChunkReader's destructor); reads in flight are not disturbed.
  // The default keeps nothing.
  virtual void drop_read_cache() {}

  // Durably replaces `path` with `bytes`: writes <path>.tmp, fsyncs it,
  // renames it over `path` and fsyncs the parent directory. A crash at any
  // point leaves either the old file or the new one at `path`.
  void write_file_atomic(const std::string& path, const std::vector<uint8_t>& bytes);
  // Reads the whole file, refusing files larger than `max_bytes` (IoError).
  std::vector<uint8_t> read_file(const std::string& path, uint64_t max_bytes);
};

// Forwards every call to another Storage; subclasses override what they
// observe or change (counting reads, injecting faults).
class StorageWrapper : public Storage {
 public:
  explicit StorageWrapper(std::shared_ptr<Storage> inner) : inner_(std::move(inner)) {}

  std::unique_ptr<WritableFile> create_file(const std::string& path) override {
    return inner_->create_file(path);
  }
  void read_at(const std::string& path, uint64_t offset, void* dst, size_t n) override {
    inner_->read_at(path, offset, dst, n);
  }
  uint64_t file_size(const std::string& path) override { return inner_->file_size(path); }
  FileInfo stat(const std::string& path) override { return inner_->stat(path); }
  void make_dirs(const std::string& path) override { inner_->make_dirs(path); }
  void rename(const std::string& from, const std::string& to) override { inner_->rename(from, to); }
  void sync_dir(const std::string& path) override { inner_->sync_dir(path); }
  std::vector<std::string> list_dir(const std::string& path) override {
    return inner_->list_dir(path);
  }
  void remove_all(const std::string& path) override { inner_->remove_all(path); }
  void drop_read_cache() override { inner_->drop_read_cache(); }

 protected:
  Storage& inner() { return *inner_; }

 private:
  std::shared_ptr<Storage> inner_;
};

// The local file system: open/pread/pwrite/fsync. Shared; its only state is
// a cache of up to 64 descriptors open for reading, so that reading many
// small chunks does not open the file each time. A cached descriptor whose
// file was deleted or replaced (its link count is 0) is reopened; create_file,
// rename and remove_all through this storage forget the paths they touch, and
// drop_read_cache closes them all.
//
// PosixOptions::direct_io (checkpoint.direct_io, direct_io.h) says whether
// writes of at least direct_min_bytes bypass the page cache (O_DIRECT): their
// whole 4 KiB pages are written straight from the caller's memory when it is
// aligned like the file offset, else through an 8 MiB aligned buffer per
// writing thread; the partial pages at either end go through the page cache.
// A checkpoint then does not evict the job's page cache. Which way writes
// faster depends on the machine, so the default, auto, measures it: at a
// file's first large write, one probe per file system and process
// (cached_direct_io_probe) picks the faster; a probe that fails picks the
// page cache. Then auto's own files of at least learn_min_bytes are timed
// (bytes over the wall time its writes and fsync were under way): once one
// way has such a file, the next tries the other way, and later files take
// the way whose latest file wrote faster, measuring the slower way again
// after an interval (direct_io.h, choose_direct).
// true: O_DIRECT; false: page cache. A file system that refuses O_DIRECT
// (at open or at the first write) gets page-cache writes instead, with no
// error. Durability is unchanged: data is durable after sync().
// Reads always use the page cache.
struct PosixOptions {
  DirectIo direct_io = DirectIo::kAuto;
  uint64_t direct_min_bytes = uint64_t{1} << 20;  // smaller writes use the page cache
  uint64_t learn_min_bytes = uint64_t{64} << 20;  // auto: smaller files are not timed
};
// The shared default storage (PosixOptions{}: direct_io auto).
std::shared_ptr<Storage> posix_storage();
// A storage with these options; posix_storage() when they are the defaults.
std::shared_ptr<Storage> posix_storage(const PosixOptions& options);

// "<dir>/<name>", or `name` when dir is empty.
std::string join_path(const std::string& dir, const std::string& name);
// The directory part of `path`: "." when it has none, "/" for "/x".
std::string parent_dir(const std::string& path);

}  // namespace checkpoint
