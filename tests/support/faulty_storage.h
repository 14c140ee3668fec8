#pragma once
// Test support: a Storage wrapper that fails chosen operations like a full
// disk or a failing device, for the suites and the reliability harness
// (train_faults). Not part of the product: the product never reads a fault
// plan, and nothing here is installed.
#include "checkpoint/storage/storage.h"

#include <cerrno>
#include <cstdint>
#include <memory>
#include <string>

namespace checkpoint::faults {

// When a fault-injecting storage fails an operation. Counts start at 1 and
// are shared by all files of the storage; -1 disables a fault.
struct FaultPlan {
  // After this many bytes written in total (append + write_at), the write
  // that crosses the limit stores what fits and fails with ENOSPC, like a
  // full disk; every later write fails too.
  int64_t fail_after_bytes = -1;
  // errno for the call-count faults below (ENOSPC, EIO, ...).
  int fail_errno = ENOSPC;
  int64_t fail_on_write_call = -1;   // N-th append/write_at
  int64_t fail_on_sync_call = -1;    // N-th WritableFile::sync or sync_dir
  int64_t fail_on_rename_call = -1;  // N-th rename (the file is not renamed)
};

// Parses "fail_after_bytes=N,fail_on_write_call=N,fail_on_sync_call=N,
// fail_on_rename_call=N,errno=ENOSPC|EIO|EDQUOT" (any subset). Throws
// std::invalid_argument naming the bad part.
FaultPlan parse_fault_plan(const std::string& spec);

// Wraps `inner`, failing the operations `plan` names with IoError (message
// "injected fault: ..." plus the path and strerror). Thread-safe counters.
std::shared_ptr<Storage> fault_injecting_storage(std::shared_ptr<Storage> inner, FaultPlan plan);

}  // namespace checkpoint::faults
