#include "support/faulty_storage.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>

namespace checkpoint::faults {

namespace {

class FaultInjector {
 public:
  explicit FaultInjector(FaultPlan plan) : plan_(plan) {}

  // Bytes of an n-byte write that may go through; throws after letting them
  // through is the caller's job (see FaultyFile::checked_write).
  size_t admit_write(const std::string& path, size_t n) {
    const int64_t call = ++write_calls_;
    if (call == plan_.fail_on_write_call) fail("write", path, plan_.fail_errno);
    if (plan_.fail_after_bytes < 0) return n;
    const int64_t before = written_.fetch_add(static_cast<int64_t>(n));
    const int64_t room = std::max<int64_t>(0, plan_.fail_after_bytes - before);
    return static_cast<size_t>(std::min<int64_t>(room, static_cast<int64_t>(n)));
  }
  void on_sync(const std::string& path) {
    if (++sync_calls_ == plan_.fail_on_sync_call) fail("fsync", path, plan_.fail_errno);
  }
  void on_rename(const std::string& path) {
    if (++rename_calls_ == plan_.fail_on_rename_call) fail("rename", path, plan_.fail_errno);
  }
  [[noreturn]] static void fail(const std::string& what, const std::string& path, int err) {
    throw IoError::from_errno("injected fault: cannot " + what, path, err);
  }

 private:
  const FaultPlan plan_;
  std::atomic<int64_t> write_calls_{0};
  std::atomic<int64_t> written_{0};
  std::atomic<int64_t> sync_calls_{0};
  std::atomic<int64_t> rename_calls_{0};
};

class FaultyFile final : public WritableFile {
 public:
  FaultyFile(std::unique_ptr<WritableFile> inner, std::string path,
             std::shared_ptr<FaultInjector> faults)
      : inner_(std::move(inner)), path_(std::move(path)), faults_(std::move(faults)) {}

  void append(const void* data, size_t n) override {
    write_at(position_, data, n);
    position_ += n;
  }
  void write_at(uint64_t offset, const void* data, size_t n) override {
    const size_t admitted = faults_->admit_write(path_, n);
    if (admitted > 0) inner_->write_at(offset, data, admitted);
    if (admitted < n) FaultInjector::fail("write", path_, ENOSPC);
  }
  void sync() override {
    faults_->on_sync(path_);
    inner_->sync();
  }
  void start_writeback(uint64_t offset, uint64_t n) override { inner_->start_writeback(offset, n); }
  void close() override { inner_->close(); }

 private:
  std::unique_ptr<WritableFile> inner_;
  std::string path_;
  std::shared_ptr<FaultInjector> faults_;
  uint64_t position_ = 0;
};

class FaultInjectingStorage final : public StorageWrapper {
 public:
  FaultInjectingStorage(std::shared_ptr<Storage> inner, FaultPlan plan)
      : StorageWrapper(std::move(inner)), faults_(std::make_shared<FaultInjector>(plan)) {}

  std::unique_ptr<WritableFile> create_file(const std::string& path) override {
    return std::make_unique<FaultyFile>(inner().create_file(path), path, faults_);
  }
  void rename(const std::string& from, const std::string& to) override {
    faults_->on_rename(from);
    inner().rename(from, to);
  }
  void sync_dir(const std::string& path) override {
    faults_->on_sync(path);
    inner().sync_dir(path);
  }

 private:
  std::shared_ptr<FaultInjector> faults_;
};

}  // namespace

std::shared_ptr<Storage> fault_injecting_storage(std::shared_ptr<Storage> inner, FaultPlan plan) {
  return std::make_shared<FaultInjectingStorage>(std::move(inner), plan);
}

FaultPlan parse_fault_plan(const std::string& spec) {
  FaultPlan plan;
  size_t pos = 0;
  while (pos < spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    std::string part = spec.substr(pos, end - pos);
    pos = end + 1;
    if (part.empty()) continue;
    size_t eq = part.find('=');
    if (eq == std::string::npos) throw std::invalid_argument("fault plan: expected key=value, got '" + part + "'");
    std::string key = part.substr(0, eq), value = part.substr(eq + 1);
    if (key == "errno") {
      if (value == "ENOSPC") plan.fail_errno = ENOSPC;
      else if (value == "EIO") plan.fail_errno = EIO;
      else if (value == "EDQUOT") plan.fail_errno = EDQUOT;
      else throw std::invalid_argument("fault plan: unknown errno '" + value + "'");
      continue;
    }
    int64_t n = 0;
    try {
      size_t used = 0;
      n = std::stoll(value, &used);
      if (used != value.size()) throw std::invalid_argument(value);
    } catch (const std::exception&) {
      throw std::invalid_argument("fault plan: " + key + " needs an integer, got '" + value + "'");
    }
    if (key == "fail_after_bytes") plan.fail_after_bytes = n;
    else if (key == "fail_on_write_call") plan.fail_on_write_call = n;
    else if (key == "fail_on_sync_call") plan.fail_on_sync_call = n;
    else if (key == "fail_on_rename_call") plan.fail_on_rename_call = n;
    else throw std::invalid_argument("fault plan: unknown key '" + key + "'");
  }
  return plan;
}

}  // namespace checkpoint::faults
