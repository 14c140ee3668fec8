#pragma once
// The checkpoint system's exceptions: one root, CheckpointError, with every
// kind of failure beneath it, and one classification, is_damage(): whether a
// failure means the checkpoint's bytes are damaged (the resume fallback skips
// such a checkpoint and tries an older one) rather than that the caller or the
// state is wrong.
//
//   std::runtime_error
//     CheckpointError          a save or load failed (on every rank together
//       |                      where it was collective); the message names
//       |                      the rank(s) and cause
//       CheckpointDamagedError a collective load failed because the bytes are
//       |                      damaged on some rank and mismatch on none  (damage)
//       FormatError            metadata or a record that cannot be right  (damage)
//       ChecksumError          stored bytes that do not match their checksum  (damage)
//       TransformError         a descriptor, options or input a codec refuses  (damage)
//       IoError                a failed system call or a short file  (damage)
//       PlanError              local plans that do not fit together
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
  // True when the failure is in the checkpoint's bytes (see is_damage below).
  virtual bool is_damage() const { return false; }
};

// A load that failed because the checkpoint's bytes are damaged (metadata,
// data, checksums, truncation) on some rank, and on no rank because the
// state does not match it (CheckpointManager, once the ranks agree on it).
class CheckpointDamagedError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
  bool is_damage() const override { return true; }
};

// Every decode or validation failure. The message names the source (file
// path) and, where one is involved, the item and chunk index.
class FormatError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
  bool is_damage() const override { return true; }
};

// Stored bytes whose checksum does not match the one recorded for them.
class ChecksumError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
  bool is_damage() const override { return true; }
};

// An unknown descriptor, bad options, or input a decoder cannot accept. The
// message says what was wrong; readers add the file, item and chunk.
class TransformError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
  bool is_damage() const override { return true; }
};

// A failed system call or a file shorter than its reader needs. The message
// carries the path and strerror; error_number() is the errno (0 when none).
class IoError : public CheckpointError {
 public:
  explicit IoError(const std::string& message, int error_number = 0)
      : CheckpointError(message), error_number_(error_number) {}
  // "<what> <path>: <strerror(error_number)>", e.g. "cannot write /ck/x: No space left on device".
  // Defined in storage/storage.cpp.
  static IoError from_errno(const std::string& what, const std::string& path, int error_number);

  int error_number() const { return error_number_; }
  bool is_damage() const override { return true; }  // including truncated files

 private:
  int error_number_;
};

// Any inconsistency between ranks' local plans, or a malformed plan blob. The
// message names the item and the ranks involved.
class PlanError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

// Whether `e` means that the checkpoint's bytes are damaged: a FormatError,
// ChecksumError, TransformError or IoError (a truncated file included), or a
// CheckpointDamagedError that sums these up over the ranks. Any
// other exception (a state that does not match: names, dtypes, shapes; a
// PlanError; a LibTorch error) is not damage.
inline bool is_damage(const std::exception& e) {
  const auto* error = dynamic_cast<const CheckpointError*>(&e);
  return error != nullptr && error->is_damage();
}

}  // namespace checkpoint
