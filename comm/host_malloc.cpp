#include "comm/host_malloc.h"

#include <cstdlib>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace comm {

HostMallocOutcome apply_host_malloc(HostMalloc mode) {
  if (mode == HostMalloc::kDefault) return HostMallocOutcome::kDefault;
  // A user who tuned malloc through its environment variables asked for
  // exactly that; glibc has applied them already.
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"}) {
    if (std::getenv(name) != nullptr) return HostMallocOutcome::kEnvironment;
  }
#if defined(__GLIBC__)
  // Both: setting either one turns glibc's adaptive mmap threshold off, and
  // either one alone measured slower than both (docs/llama.md).
  const bool mmap_ok = mallopt(M_MMAP_THRESHOLD, static_cast<int>(kKeepMmapThreshold)) == 1;
  const bool trim_ok = mallopt(M_TRIM_THRESHOLD, static_cast<int>(kKeepTrimThreshold)) == 1;
  return mmap_ok && trim_ok ? HostMallocOutcome::kKept : HostMallocOutcome::kUnsupported;
#else
  return HostMallocOutcome::kUnsupported;
#endif
}

}  // namespace comm
