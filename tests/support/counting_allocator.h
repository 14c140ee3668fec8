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
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  // LibTorch 2.3+ asks allocators for this (no override: 1.13 has none).
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::copy_n(static_cast<const char*>(src), count, static_cast<char*>(dest));
  }

  int64_t live_bytes() const { return live_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  c10::DataPtr counted(size_t n) const {
    c10::DataPtr inner = base_->allocate(n);
    auto* ctx = new Context{std::move(inner), n, this};
    const int64_t now = live_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    void* data = ctx->inner.get();
    const c10::Device device = ctx->inner.device();
    return {data, ctx, &release, device};
  }

  static constexpr uint8_t kPriority = 200;
  struct Context {
    c10::DataPtr inner;
    size_t n;
    const CountingCpuAllocator* owner;
  };
  static void release(void* p) {
    auto* ctx = static_cast<Context*>(p);
    ctx->owner->live_.fetch_sub(static_cast<int64_t>(ctx->n));
    delete ctx;
  }

  c10::Allocator* base_;
  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
};

}  // namespace testing_support
