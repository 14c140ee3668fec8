#pragma once
// Test-only and not installed: how many bytes the POSIX storages of this
// process wrote with O_DIRECT and through the page cache (storage.h,
// PosixOptions), so a test sees which path a write took.
#include <cstdint>

namespace checkpoint {

// Since the process started; read while no write is in flight.
struct PosixWriteCounters {
  uint64_t direct_bytes = 0;
  uint64_t buffered_bytes = 0;
  uint64_t bounced_bytes = 0;  // of direct_bytes: copied through an aligned buffer first
};
PosixWriteCounters posix_write_counters();

}  // namespace checkpoint
