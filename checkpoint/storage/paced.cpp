#include "checkpoint/storage/paced.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace checkpoint {

namespace {

using Clock = std::chrono::steady_clock;

class PacedDevice {
 public:
  explicit PacedDevice(double bytes_per_s) : bytes_per_s_(bytes_per_s) {}

  // Books n bytes after everything booked before; returns when they are done.
  Clock::time_point book(uint64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point start = std::max(Clock::now(), busy_until_);
    busy_until_ = start + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(static_cast<double>(n) / bytes_per_s_));
    return busy_until_;
  }
  Clock::time_point busy_until() {
    std::lock_guard<std::mutex> lock(mu_);
    return busy_until_;
  }

 private:
  const double bytes_per_s_;
  std::mutex mu_;
  Clock::time_point busy_until_{};
};

class PacedFile final : public WritableFile {
 public:
  PacedFile(std::unique_ptr<WritableFile> inner, std::shared_ptr<PacedDevice> device)
      : inner_(std::move(inner)), device_(std::move(device)) {}
  void append(const void* data, size_t n) override {
    inner_->append(data, n);
    device_->book(n);
  }
  void write_at(uint64_t offset, const void* data, size_t n) override {
    inner_->write_at(offset, data, n);
    device_->book(n);
  }
  void sync() override {
    inner_->sync();
    std::this_thread::sleep_until(device_->busy_until());
  }
  void close() override { inner_->close(); }
  void start_writeback(uint64_t offset, uint64_t n) override { inner_->start_writeback(offset, n); }

 private:
  std::unique_ptr<WritableFile> inner_;
  std::shared_ptr<PacedDevice> device_;
};

class PacedStorage final : public StorageWrapper {
 public:
  PacedStorage(std::shared_ptr<Storage> inner, double bytes_per_s)
      : StorageWrapper(std::move(inner)), device_(std::make_shared<PacedDevice>(bytes_per_s)) {}
  std::unique_ptr<WritableFile> create_file(const std::string& path) override {
    return std::make_unique<PacedFile>(StorageWrapper::create_file(path), device_);
  }
  void read_at(const std::string& path, uint64_t offset, void* dst, size_t n) override {
    const Clock::time_point done = device_->book(n);
    StorageWrapper::read_at(path, offset, dst, n);
    std::this_thread::sleep_until(done);
  }

 private:
  std::shared_ptr<PacedDevice> device_;
};

}  // namespace

std::shared_ptr<Storage> paced_storage(std::shared_ptr<Storage> inner,
                                     double mb_per_s) {
  if (!(mb_per_s > 0)) throw std::invalid_argument("paced_storage: bandwidth must be positive");
  return std::make_shared<PacedStorage>(std::move(inner), mb_per_s * 1e6);
}

}  // namespace checkpoint
