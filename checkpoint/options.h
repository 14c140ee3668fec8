#pragma once
// Checkpoint options (config section `checkpoint`). Torch-free.
#include <cstdint>
#include <string>

#include "comm/enum_text.h"

namespace checkpoint {

// The enum-like keys of this section, each parsed once (by the config loader,
// or by whoever fills CheckpointOptions from text) with parse_<name>, and
// written back with to_string (the config's YAML spellings); each k<Name>s
// array lists the values in the order the allowed values are named
// (comm/enum_text.h).

// checkpoint.compression.codec.
enum class Codec { kNone, kZstd };
// checkpoint.compression.byte_group: group bytes by significance before
// compressing; auto: for floats.
enum class ByteGroup { kAuto, kOn, kOff };
// checkpoint.mode (manager.h describes the modes).
enum class SaveMode { kSync, kAsync, kOverlap };
// checkpoint.on_error: a failed save stops training (fail) or is logged (warn).
enum class OnError { kFail, kWarn };
// checkpoint.when_busy: what a due save does while the previous one is still
// in flight.
enum class WhenBusy { kWait, kSkip };
// checkpoint.device_snapshot (CheckpointOptions::device_snapshot).
enum class DeviceSnapshot { kAuto, kOn, kOff };

inline constexpr Codec kCodecs[] = {Codec::kNone, Codec::kZstd};
inline constexpr ByteGroup kByteGroups[] = {ByteGroup::kAuto, ByteGroup::kOn, ByteGroup::kOff};
inline constexpr SaveMode kSaveModes[] = {SaveMode::kSync, SaveMode::kAsync, SaveMode::kOverlap};
inline constexpr OnError kOnErrors[] = {OnError::kFail, OnError::kWarn};
inline constexpr WhenBusy kWhenBusys[] = {WhenBusy::kWait, WhenBusy::kSkip};
inline constexpr DeviceSnapshot kDeviceSnapshots[] = {DeviceSnapshot::kAuto, DeviceSnapshot::kOn,
                                                      DeviceSnapshot::kOff};

// "none" | "zstd", ...: the YAML spelling.
const char* to_string(Codec codec);
const char* to_string(ByteGroup byte_group);
const char* to_string(SaveMode mode);
const char* to_string(OnError on_error);
const char* to_string(WhenBusy when_busy);
const char* to_string(DeviceSnapshot device_snapshot);

// Each throws std::invalid_argument naming the key, the value and the
// allowed values, e.g. "checkpoint.mode 'x' is not one of sync, async, overlap".
Codec parse_codec(const std::string& codec);
ByteGroup parse_byte_group(const std::string& byte_group);
SaveMode parse_save_mode(const std::string& mode);
OnError parse_on_error(const std::string& on_error);
WhenBusy parse_when_busy(const std::string& when_busy);
DeviceSnapshot parse_device_snapshot(const std::string& device_snapshot);

// checkpoint.direct_io (PosixOptions::direct_io, storage/direct_io.h): auto:
// measured by a probe; true: O_DIRECT where the file system takes it (else
// page cache, silently); false: page cache. The spellings are the YAML
// booleans the key took when it was a bool, plus auto.
enum class DirectIo { kAuto, kOn, kOff };
inline constexpr DirectIo kDirectIos[] = {DirectIo::kAuto, DirectIo::kOn, DirectIo::kOff};

// "auto" | "true" | "false".
inline const char* to_string(DirectIo direct_io) {
  switch (direct_io) {
    case DirectIo::kAuto: return "auto";
    case DirectIo::kOn: return "true";
    case DirectIo::kOff: return "false";
  }
  return "?";
}

// Also takes True/TRUE/False/FALSE, as the key did as a bool. Throws
// std::invalid_argument naming checkpoint.direct_io, the value and the
// allowed values.
inline DirectIo parse_direct_io(const std::string& text) {
  if (text == "True" || text == "TRUE") return DirectIo::kOn;
  if (text == "False" || text == "FALSE") return DirectIo::kOff;
  return comm::parse_enum("checkpoint.direct_io", text, kDirectIos);
}

struct CompressionOptions {
  Codec codec = Codec::kNone;
  int level = 3;                          // zstd level, 1..19
  ByteGroup byte_group = ByteGroup::kAuto;  // auto: on for floats
  int64_t block_size = 8 << 20;           // bytes per independently coded block
};

// checkpoint.resume: auto | never | a checkpoint's path. It stays a string
// (a path is one of its values); what it asks for is read here, once.
enum class ResumeRequest { kAuto, kNever, kPath };

inline ResumeRequest resume_request(const std::string& resume) {
  if (resume == "auto") return ResumeRequest::kAuto;
  if (resume == "never") return ResumeRequest::kNever;
  return ResumeRequest::kPath;
}

// checkpoint.local: the node-local tier (docs/checkpoints.md, "Multi-level checkpoints").
struct LocalTierOptions {
  // Empty: one tier (checkpoint.dir). Else each node's local directory
  // (/dev/shm/..., local NVMe); "{node}" is replaced by the node's index,
  // which simulated nodes on one machine need.
  std::string dir = "";
  int64_t keep_last = 2;  // per node: the newest N committed; 0: keep all
  bool partner = true;    // copy each rank's file to a rank on the next node (L2)
};

// checkpoint.durable: the durable tier (checkpoint.dir) under a local tier.
struct DurableTierOptions {
  // Flush the local checkpoints of steps that are multiples of k x interval,
  // and the final one; 1: all.
  int64_t every = 1;
};

struct CheckpointOptions {
  std::string dir = "";        // empty: <run.dir>/checkpoints
  int64_t interval = 0;        // save every N steps (and at the last); 0: off
  SaveMode mode = SaveMode::kSync;
  int64_t keep_last = 0;       // keep the newest N committed; 0: keep all
  std::string resume = "auto"; // auto | never | <path to a checkpoint>
  // resume auto: a committed checkpoint that fails to load (damaged) is set
  // aside and the next older one is tried; false: fail instead.
  bool resume_fallback = true;
  // Resume a checkpoint saved under another model, data, seed or batch
  // configuration (the trainer refuses by default, naming the keys).
  bool allow_config_change = false;
  OnError on_error = OnError::kFail;
  bool save_on_signal = true;        // SIGTERM triggers a final save
  WhenBusy when_busy = WhenBusy::kWait;  // a save still in flight
  bool allow_partial = false;        // load: tolerate missing/unexpected items
  bool model_only = false;           // load: model weights only
  int io_threads = 4;
  // Save-plan caching (save.h, SavePlanCache): later saves of an unchanged
  // structure skip the plan exchange; proven by one small all-reduce.
  bool plan_cache = true;
  // Large data-file writes bypass the page cache (O_DIRECT; storage.h,
  // PosixOptions): auto: where a probe of the file system finds it faster
  // (storage/direct_io.h). Used by whoever builds the POSIX storage (the trainer).
  DirectIo direct_io = DirectIo::kAuto;
  // Overlap mode with state on a GPU: snapshot the state into device memory
  // (as much again as the state, held for the run) so the optimizer never
  // waits for the device-to-host copy. auto: when the device has that much
  // free beyond a 2 GiB margin at the first save | on | off.
  DeviceSnapshot device_snapshot = DeviceSnapshot::kAuto;
  CompressionOptions compression;
  LocalTierOptions local;
  DurableTierOptions durable;
};

inline const char* to_string(Codec codec) {
  switch (codec) {
    case Codec::kNone: return "none";
    case Codec::kZstd: return "zstd";
  }
  return "?";
}

inline const char* to_string(ByteGroup byte_group) {
  switch (byte_group) {
    case ByteGroup::kAuto: return "auto";
    case ByteGroup::kOn: return "on";
    case ByteGroup::kOff: return "off";
  }
  return "?";
}

inline const char* to_string(SaveMode mode) {
  switch (mode) {
    case SaveMode::kSync: return "sync";
    case SaveMode::kAsync: return "async";
    case SaveMode::kOverlap: return "overlap";
  }
  return "?";
}

inline const char* to_string(OnError on_error) {
  switch (on_error) {
    case OnError::kFail: return "fail";
    case OnError::kWarn: return "warn";
  }
  return "?";
}

inline const char* to_string(WhenBusy when_busy) {
  switch (when_busy) {
    case WhenBusy::kWait: return "wait";
    case WhenBusy::kSkip: return "skip";
  }
  return "?";
}

inline const char* to_string(DeviceSnapshot device_snapshot) {
  switch (device_snapshot) {
    case DeviceSnapshot::kAuto: return "auto";
    case DeviceSnapshot::kOn: return "on";
    case DeviceSnapshot::kOff: return "off";
  }
  return "?";
}

inline Codec parse_codec(const std::string& codec) {
  return comm::parse_enum("checkpoint.compression.codec", codec, kCodecs);
}
inline ByteGroup parse_byte_group(const std::string& byte_group) {
  return comm::parse_enum("checkpoint.compression.byte_group", byte_group, kByteGroups);
}
inline SaveMode parse_save_mode(const std::string& mode) {
  return comm::parse_enum("checkpoint.mode", mode, kSaveModes);
}
inline OnError parse_on_error(const std::string& on_error) {
  return comm::parse_enum("checkpoint.on_error", on_error, kOnErrors);
}
inline WhenBusy parse_when_busy(const std::string& when_busy) {
  return comm::parse_enum("checkpoint.when_busy", when_busy, kWhenBusys);
}
inline DeviceSnapshot parse_device_snapshot(const std::string& device_snapshot) {
  return comm::parse_enum("checkpoint.device_snapshot", device_snapshot,
                                    kDeviceSnapshots);
}

}  // namespace checkpoint
