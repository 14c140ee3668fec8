#pragma once
// How glibc's malloc hands freed host memory back to the kernel
// (config key run.host_malloc).
//
// A training step allocates and frees the same large host buffers every step
// (activations, gradients, optimizer temporaries on the CPU). glibc's default
// serves blocks above its mmap threshold (128 KiB, raised adaptively up to
// 32 MiB) with their own mmap and unmaps them on free, and trims the heap top
// above 128 KiB; the next step then faults every page in again. Under
// LibTorch 2.6 on the CPU that was about 20,000 minor faults per step of the
// tiny llama and most of a 2.6-3.1x step-time gap to PyTorch eager
// (docs/llama.md). keep fixes the thresholds, which keeps freed memory in
// the process for reuse: the resident set stays near its peak instead of
// shrinking between steps.
//
// Not thread-safe with respect to other mallopt callers; call once per
// process, before training starts. Only glibc has these knobs: elsewhere
// nothing changes.
#include <cstddef>

#include "comm/options.h"

namespace comm {

// What apply_host_malloc did.
enum class HostMallocOutcome {
  kKept,         // thresholds set (keep)
  kDefault,      // glibc's defaults left alone (default)
  kEnvironment,  // MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ /
                 // MALLOC_TOP_PAD_ set by the user: theirs win, nothing changed
  kUnsupported,  // not glibc, or mallopt refused: nothing changed
};

// The thresholds keep sets: blocks below kKeepMmapThreshold come from the
// heap, and the heap is trimmed only when more than kKeepTrimThreshold is
// free at its top.
inline constexpr std::size_t kKeepMmapThreshold = std::size_t{32} << 20;
inline constexpr std::size_t kKeepTrimThreshold = std::size_t{1} << 30;

HostMallocOutcome apply_host_malloc(HostMalloc mode);

}  // namespace comm
