#pragma once
// Counts the bytes LibTorch's CPU allocator holds, and their peak: installed
// over the default CPU allocator for a scope. Exact where RSS is not (glibc
// keeps freed memory), so memory targets can be checked byte for byte.
// Used by tests (a model built shard by shard) and bench/ (activation
// memory). Thread-safe; process-wide while installed.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace testing_support {

class CountingCpuAllocator : public c10::Allocator {
 public:
  CountingCpuAllocator() : base_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, kPriority); }
  ~CountingCpuAllocator() override { c10::SetCPUAllocator(base_, kPriority); }
  CountingCpuAllocator(const CountingCpuAllocator&) = delete;
  CountingCpuAllocator& operator=(const CountingCpuAllocator&) = delete;

  // LibTorch 1.13 declares allocate const, 2.x not: one of these two
  // overrides it, the other is an overload (no version check needed here).
  c10::DataPtr allocate(size_t n) const { return counted(n); }
  c10::DataPtr allocate(size_t n) { return counted(n); }
  // Context == data, as c10's raw_allocate asserts (Gloo and some CPU
  // kernels allocate raw): the size and owner live in a registry instead.
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  // LibTorch 2.3+ asks allocators for this (no override: 1.13 has none).
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::copy_n(static_cast<const char*>(src), count, static_cast<char*>(dest));
  }

  int64_t live_bytes() const { return live_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  struct Block {
    c10::DataPtr inner;  // the base allocator's, freed with the block
    size_t n = 0;
    const CountingCpuAllocator* owner = nullptr;
  };
  // Per address, a stack: counters installed over each other (a test's
  // counter over an earlier one's) register the same address, the outer one
  // last, and freeing it frees the inner one's in turn.
  struct Registry {
    std::mutex mu;
    std::unordered_map<void*, std::vector<Block>> blocks;
  };
  // Never destroyed: memory counted here may be freed after main returns.
  static Registry& registry() {
    static auto* r = new Registry();
    return *r;
  }

  c10::DataPtr counted(size_t n) const {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // nothing to count (n == 0)
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(registry().mu);
      registry().blocks[data].push_back(Block{std::move(inner), n, this});
    }
    const int64_t now = live_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &release, device};
  }

  static constexpr uint8_t kPriority = 200;
  static void release(void* p) {
    Block block;
    {
      std::lock_guard<std::mutex> lock(registry().mu);
      auto it = registry().blocks.find(p);
      if (it == registry().blocks.end()) return;
      block = std::move(it->second.back());
      it->second.pop_back();
      if (it->second.empty()) registry().blocks.erase(it);
    }
    block.owner->live_.fetch_sub(static_cast<int64_t>(block.n));
  }  // block.inner frees here, outside the lock (an inner counter's release locks again)

  c10::Allocator* base_;
  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
};

}  // namespace testing_support
