#pragma once
// Test support: a Storage that records what a save does to the file system
// and can rebuild every state a power loss (or kernel crash) at any point of
// that record could leave on disk. The crash-consistency checker
// (tests/checkpoint/crash_check.h) runs recovery on those states. Not part of
// the product (nothing installed, nothing in checkpoint/ knows of it): the
// product only ever needs the Storage interface. Torch-free.
//
// The model (docs/reliability.md, FORMAT.md "Durability"): the weakest file
// system POSIX allows, not ext4's stronger habits.
//   * The live view is the page cache: every call sees every earlier call.
//   * File data: a write (append, write_at) is durable once a later fsync of
//     the same file completed. A write after the file's last fsync may be
//     lost, kept or partly kept, independently per 4 KiB block of the file
//     (so a write torn at any block boundary, in any subset of its blocks);
//     a block lost inside the file's size reads as zeros.
//   * Names: an operation on a directory's entries (create, mkdir, rename,
//     unlink) is durable once a later fsync of that directory completed (for
//     a rename, of both directories). Each one after that may be lost or kept
//     independently of every other, in any order: no ordering between
//     directories, none inside one directory (ext4's journal would keep them
//     in order; POSIX does not promise it, and we do not rely on it). Each
//     operation is atomic: a rename is either wholly there or wholly not.
//     Operations name inodes, so a kept rename of a file whose create was
//     lost still links that file's data under the new name.
//   * fsync of a file says nothing about its name; fsync of a directory says
//     nothing about its files' data, nor about its own name in its parent.
//   * What is unreachable from the root after a crash is gone.
//   * A failed fsync (EIO, the write-back error of a dying disk; armed with
//     fail_sync_call) makes nothing durable, and what it should have made
//     durable stays uncertain for good: a later fsync of the same file or
//     directory that succeeds does not cover writes or entries made before
//     the failed one. That is Linux's behaviour since "fsyncgate" (the
//     pages that failed to write are marked clean; the error is reported
//     once), so retrying a failed fsync and trusting the data is caught.
//     The live view (the page cache) keeps the data.
// Operations of concurrent threads are recorded in the order they took the
// storage's lock: the checker explores crashes along that one interleaving.
//
// Thread safety: every call takes one mutex.
#include "checkpoint/storage/storage.h"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace checkpoint::crash {

constexpr uint64_t kBlockSize = 4096;  // the unit a crash keeps or loses of a file write

enum class OpKind { kWrite, kFsync, kCreate, kMkdir, kRename, kUnlink, kSyncDir, kMark };

// One recorded operation. Inode 0 is the root directory.
struct Op {
  OpKind kind = OpKind::kMark;
  int64_t inode = 0;     // the file written or fsynced; the inode created, moved or unlinked
  int64_t dir = 0;       // the directory whose entries change (rename: the source)
  std::string name;      // the entry (rename: the source name)
  int64_t to_dir = 0;    // rename: the destination directory
  std::string to_name;   // rename: the destination name
  uint64_t offset = 0;   // write
  std::vector<uint8_t> bytes;  // write
  std::string path;      // for reports: the path as the caller gave it
  std::string mark;      // kMark: a label the scenario added (not a file-system operation)
  bool failed = false;   // kFsync, kSyncDir: the call failed with EIO (fail_sync_call)
};

// What a crash after the first `ops` operations may or may not have kept.
struct UncertainItem {
  size_t op = 0;        // index into the log
  uint64_t block = 0;   // kWrite: the file block (offset / kBlockSize); else 0
};

// A file-system image: path -> contents (directories: a trailing '/', no
// bytes). Comparable, so identical crash states are recognised.
using Image = std::map<std::string, std::vector<uint8_t>>;

class CrashStorage final : public Storage {
 public:
  CrashStorage();

  std::unique_ptr<WritableFile> create_file(const std::string& path) override;
  void read_at(const std::string& path, uint64_t offset, void* dst, size_t n) override;
  uint64_t file_size(const std::string& path) override;
  FileInfo stat(const std::string& path) override;
  void make_dirs(const std::string& path) override;
  void rename(const std::string& from, const std::string& to) override;
  void sync_dir(const std::string& path) override;
  std::vector<std::string> list_dir(const std::string& path) override;
  void remove_all(const std::string& path) override;

  // Adds a label to the log (e.g. "returned step_3"): the scenario says what
  // it knew at this point. Not a file-system operation.
  void mark(const std::string& label);
  // Makes everything so far durable, as if every file and directory had been
  // fsynced (the state before the scenario starts).
  void make_all_durable();

  // Arms a failure: the sync call with index `call` (0-based, counting every
  // WritableFile::sync and sync_dir made through this storage since it was
  // built) throws IoError EIO and is logged as a failed fsync. Once.
  void fail_sync_call(size_t call);
  // Sync calls made so far (the next one's index).
  size_t sync_calls() const;
  // The failed fsync, as describe() writes it ("" while none failed).
  std::string failed_sync() const;

  // A copy of the log so far. Index i is "operation i+1"; a crash "at k"
  // happens after the first k operations.
  std::vector<Op> log() const;

  // Called by the files this storage hands out.
  void record_write(int64_t inode, const std::string& path, uint64_t offset, const void* data, size_t n);
  // Throws IoError EIO when this call was armed to fail (after logging it).
  void record_fsync(int64_t inode, const std::string& path);

 private:
  // Logs a file or directory fsync; true when it is the armed failure.
  bool log_sync_locked(OpKind kind, int64_t inode, const std::string& path);

  struct Inode {
    bool directory = false;
    std::vector<uint8_t> bytes;
    std::map<std::string, int64_t> entries;
  };
  int64_t lookup(const std::string& path) const;  // -1 when missing
  std::pair<int64_t, std::string> parent_and_name(const std::string& path, const char* what) const;
  void remove_locked(int64_t dir, const std::string& name, const std::string& path);

  mutable std::mutex mu_;
  std::map<int64_t, Inode> inodes_;
  int64_t next_inode_ = 1;
  std::vector<Op> log_;
  size_t durable_prefix_ = 0;  // make_all_durable: ops before it are certain
  size_t sync_calls_ = 0;
  std::optional<size_t> fail_sync_call_;
  std::string failed_sync_;
};

// The operations a crash after `crash_point` operations may have lost.
std::vector<UncertainItem> uncertain_items(const std::vector<Op>& log, size_t crash_point);

// The durable image after a crash following the first `crash_point`
// operations, keeping exactly those uncertain items whose `keep` is true.
// REQUIRES: keep.size() == items.size(), items from uncertain_items(log, crash_point).
Image crash_image(const std::vector<Op>& log, size_t crash_point,
                  const std::vector<UncertainItem>& items, const std::vector<bool>& keep);

// A fresh memory storage holding `image`.
std::shared_ptr<Storage> materialize(const Image& image);

// "write rank_0.data [0, 812)", "rename /ck/step_1/.metadata.tmp -> .metadata", ...
std::string describe(const Op& op);

}  // namespace checkpoint::crash
