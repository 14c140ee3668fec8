#pragma once
// The checkpoint system's exceptions: one root, CheckpointError, with every
// kind of failure beneath it, and one classification, is_damage(): whether a
// failure means the checkpoint's bytes are damaged (the resume fallback skips
// such a checkpoint and tries an older one) rather than that the caller or the
// state is wrong.
//
//   std::runtime_error
//     CheckpointError            a save or load failed (on every rank together
//       |                        where it was collective); the message names
//       |                        the rank(s) and cause
//       DamageError              the failure lies in the checkpoint's bytes:
//       | CheckpointDamagedError   a collective load found damage on some rank
//       |                          and a mismatch on none
//       | FormatError              metadata or a record that cannot be right
//       | ChecksumError            bytes that do not match their checksum
//       | TransformError           a descriptor, options or input a codec refuses
//       | IoError                  a failed system call or a short file
//       PlanError                local plans that do not fit together
//
// Every class keeps the header it was declared in (save.h, metadata.h,
// chunk_reader.h, transforms.h, storage.h, planner.h include this one).
// Torch-free, and includes nothing from checkpoint/: storage/, the bottom
// layer, builds on it.
#include <exception>
#include <stdexcept>
#include <string>

namespace checkpoint {

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The kinds of failure that lie in the checkpoint's bytes (is_damage below).
class DamageError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

// A load that failed because the checkpoint's bytes are damaged (metadata,
// data, checksums, truncation) on some rank, and on no rank because the
// state does not match it (CheckpointManager, once the ranks agree on it).
class CheckpointDamagedError : public DamageError {
 public:
  using DamageError::DamageError;
};

// Every decode or validation failure. The message names the source (file
// path) and, where one is involved, the item and chunk index.
class FormatError : public DamageError {
 public:
  using DamageError::DamageError;
};

// Stored bytes that do not match the checksum recorded for them.
class ChecksumError : public DamageError {
 public:
  using DamageError::DamageError;
};

// An unknown descriptor, bad options, or input a decoder cannot accept. The
// message says what was wrong; readers add the file, item and chunk.
class TransformError : public DamageError {
 public:
  using DamageError::DamageError;
};

// A failed system call or a file shorter than its reader needs. The message
// carries the path and strerror; error_number() is the errno (0 when none).
class IoError : public DamageError {
 public:
  explicit IoError(const std::string& message, int error_number = 0)
      : DamageError(message), error_number_(error_number) {}
  // "<what> <path>: <strerror(error_number)>", e.g. "cannot write /ck/x: No space left on device".
  // Defined in storage/storage.cpp.
  static IoError from_errno(const std::string& what, const std::string& path, int error_number);

  int error_number() const { return error_number_; }

 private:
  int error_number_;
};

// Any inconsistency between ranks' local plans, or a malformed plan blob. The
// message names the item and the ranks involved.
class PlanError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

// Whether `e` means that the checkpoint's bytes are damaged: a DamageError
// (FormatError, ChecksumError, TransformError, IoError -- a truncated file
// included -- or a CheckpointDamagedError that sums these up over the
// ranks). Any other exception (a state that does not match: names, dtypes,
// shapes; a PlanError; a LibTorch error) is not damage.
inline bool is_damage(const std::exception& e) { return dynamic_cast<const DamageError*>(&e) != nullptr; }

}  // namespace checkpoint
