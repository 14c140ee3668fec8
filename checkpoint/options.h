#pragma once
// Checkpoint options (config section `checkpoint`). Torch-free.
#include <cstdint>
#include <string>

#include "comm/enum_text.h"

namespace checkpoint {

// The enum-like keys of this section, each parsed once (by the config loader,
// or by whoever fills CheckpointOptions from text) with parse_<name>, and
// written back with to_string (the config's YAML spellings); each k<Name>s
// table lists the values with their spellings in the order the allowed values
// are named (comm/enum_text.h). Each parse_<name> throws
// std::invalid_argument naming the key, the value and the allowed values,
// e.g. "checkpoint.mode 'x' is not one of sync, async, overlap".

// checkpoint.compression.codec.
enum class Codec { kNone, kZstd };
inline constexpr comm::EnumName<Codec> kCodecs[] = {{Codec::kNone, "none"}, {Codec::kZstd, "zstd"}};
inline const char* to_string(Codec codec) { return comm::enum_text(codec, kCodecs); }
inline Codec parse_codec(const std::string& codec) {
  return comm::parse_enum("checkpoint.compression.codec", codec, kCodecs);
}

// checkpoint.compression.byte_group: group bytes by significance before
// compressing; auto: for floats.
enum class ByteGroup { kAuto, kOn, kOff };
inline constexpr comm::EnumName<ByteGroup> kByteGroups[] = {
    {ByteGroup::kAuto, "auto"}, {ByteGroup::kOn, "on"}, {ByteGroup::kOff, "off"}};
inline const char* to_string(ByteGroup byte_group) { return comm::enum_text(byte_group, kByteGroups); }
inline ByteGroup parse_byte_group(const std::string& byte_group) {
  return comm::parse_enum("checkpoint.compression.byte_group", byte_group, kByteGroups);
}

// checkpoint.mode (manager.h describes the modes).
enum class SaveMode { kSync, kAsync, kOverlap };
inline constexpr comm::EnumName<SaveMode> kSaveModes[] = {
    {SaveMode::kSync, "sync"}, {SaveMode::kAsync, "async"}, {SaveMode::kOverlap, "overlap"}};
inline const char* to_string(SaveMode mode) { return comm::enum_text(mode, kSaveModes); }
inline SaveMode parse_save_mode(const std::string& mode) {
  return comm::parse_enum("checkpoint.mode", mode, kSaveModes);
}

// checkpoint.on_error: a failed save stops training (fail) or is logged (warn).
enum class OnError { kFail, kWarn };
inline constexpr comm::EnumName<OnError> kOnErrors[] = {{OnError::kFail, "fail"}, {OnError::kWarn, "warn"}};
inline const char* to_string(OnError on_error) { return comm::enum_text(on_error, kOnErrors); }
inline OnError parse_on_error(const std::string& on_error) {
  return comm::parse_enum("checkpoint.on_error", on_error, kOnErrors);
}

// checkpoint.when_busy: what a due save does while the previous one is still
// in flight.
enum class WhenBusy { kWait, kSkip };
inline constexpr comm::EnumName<WhenBusy> kWhenBusys[] = {{WhenBusy::kWait, "wait"}, {WhenBusy::kSkip, "skip"}};
inline const char* to_string(WhenBusy when_busy) { return comm::enum_text(when_busy, kWhenBusys); }
inline WhenBusy parse_when_busy(const std::string& when_busy) {
  return comm::parse_enum("checkpoint.when_busy", when_busy, kWhenBusys);
}

// checkpoint.device_snapshot (CheckpointOptions::device_snapshot).
enum class DeviceSnapshot { kAuto, kOn, kOff };
inline constexpr comm::EnumName<DeviceSnapshot> kDeviceSnapshots[] = {
    {DeviceSnapshot::kAuto, "auto"}, {DeviceSnapshot::kOn, "on"}, {DeviceSnapshot::kOff, "off"}};
inline const char* to_string(DeviceSnapshot device_snapshot) {
  return comm::enum_text(device_snapshot, kDeviceSnapshots);
}
inline DeviceSnapshot parse_device_snapshot(const std::string& device_snapshot) {
  return comm::parse_enum("checkpoint.device_snapshot", device_snapshot, kDeviceSnapshots);
}

// checkpoint.direct_io (PosixOptions::direct_io, storage/direct_io.h): auto:
// measured by a probe; true: O_DIRECT where the file system takes it (else
// page cache, silently); false: page cache. The spellings are the YAML
// booleans the key took when it was a bool, plus auto: "auto" | "true" |
// "false".
enum class DirectIo { kAuto, kOn, kOff };
inline constexpr comm::EnumName<DirectIo> kDirectIos[] = {
    {DirectIo::kAuto, "auto"}, {DirectIo::kOn, "true"}, {DirectIo::kOff, "false"}};
inline const char* to_string(DirectIo direct_io) { return comm::enum_text(direct_io, kDirectIos); }

// Also takes True/TRUE/False/FALSE, as the key did as a bool.
inline DirectIo parse_direct_io(const std::string& text) {
  if (text == "True" || text == "TRUE") return DirectIo::kOn;
  if (text == "False" || text == "FALSE") return DirectIo::kOff;
  return comm::parse_enum("checkpoint.direct_io", text, kDirectIos);
}

// checkpoint.resume_audit: what a resume does when the batch it would train
// on next is not the one the checkpoint recorded (the trainer's audit,
// framework/train/resume_audit.h): error (exit 2), warn, or off (no check).
enum class ResumeAudit { kError, kWarn, kOff };
inline constexpr comm::EnumName<ResumeAudit> kResumeAudits[] = {
    {ResumeAudit::kError, "error"}, {ResumeAudit::kWarn, "warn"}, {ResumeAudit::kOff, "off"}};
inline const char* to_string(ResumeAudit resume_audit) { return comm::enum_text(resume_audit, kResumeAudits); }
inline ResumeAudit parse_resume_audit(const std::string& resume_audit) {
  return comm::parse_enum("checkpoint.resume_audit", resume_audit, kResumeAudits);
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

// checkpoint.interval auto: the trainer derives the interval from the
// measured save stall and step time and checkpoint.mtbf_s (Young/Daly,
// framework/train/checkpoint_interval.h) and sets it on the manager; the
// manager itself never sees this value.
inline constexpr int64_t kIntervalAuto = -1;

struct CheckpointOptions {
  std::string dir = "";        // empty: <run.dir>/checkpoints
  int64_t interval = 0;        // save every N steps (and at the last); 0: off; kIntervalAuto: derived
  double mtbf_s = 3600;        // interval auto: the job's mean time between failures, seconds
  SaveMode mode = SaveMode::kSync;
  int64_t keep_last = 0;       // keep the newest N committed; 0: keep all
  std::string resume = "auto"; // auto | never | <path to a checkpoint>
  // resume auto: a committed checkpoint that fails to load (damaged) is set
  // aside and the next older one is tried; false: fail instead.
  bool resume_fallback = true;
  // Resume a checkpoint saved under another model, data, seed or batch
  // configuration (the trainer refuses by default, naming the keys).
  bool allow_config_change = false;
  // Resume: compare the next batch with the one the checkpoint recorded.
  ResumeAudit resume_audit = ResumeAudit::kError;
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

}  // namespace checkpoint
