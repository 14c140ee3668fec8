#pragma once
// Internal to codec/: running a batch of tasks on an optional pool.
#include <thread_pool/thread_pool.hpp>

#include <functional>
#include <future>
#include <vector>

namespace checkpoint::codec_detail {

// Runs fn(0) .. fn(count - 1), on `pool` when there is one and more than one
// task. Waits for all of them, then rethrows the first failure.
inline void run_all(thread_pool::ThreadPool* pool, size_t count, const std::function<void(size_t)>& fn) {
  if (pool == nullptr || count <= 1) {
    for (size_t i = 0; i < count; ++i) fn(i);
    return;
  }
  std::vector<std::future<void>> futures;
  futures.reserve(count);
  for (size_t i = 0; i < count; ++i) futures.push_back(pool->Submit([&fn, i] { fn(i); }));
  for (auto& f : futures) f.wait();  // every task still refers to the caller's frame
  for (auto& f : futures) f.get();
}

}  // namespace checkpoint::codec_detail
