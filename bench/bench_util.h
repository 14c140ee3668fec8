#pragma once
// Shared pieces of ckpt_bench: timing, process memory, page-cache control,
// the compression study (bench/compression.cpp) and safetensors files.
// Benchmark-only code; nothing here is part of the library.
#include "checkpoint/options.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/storage/paced.h"
#include "checkpoint/storage/storage.h"
#include "checkpoint/timing.h"
#include "comm/process_group.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace bench {

using Clock = std::chrono::steady_clock;

using checkpoint::seconds_since;

// Fields of /proc/self/status in bytes (VmRSS, VmHWM); 0 when unreadable.
uint64_t proc_status_bytes(const char* field);
inline uint64_t rss_bytes() { return proc_status_bytes("VmRSS:"); }
inline uint64_t peak_rss_bytes() { return proc_status_bytes("VmHWM:"); }
// Resets VmHWM to the current RSS (echo 5 > /proc/self/clear_refs). False
// when the kernel refused.
bool reset_peak_rss();

// fdatasync + posix_fadvise(DONTNEED) on every regular file under `path` (a
// file or a directory). Returns false when any call failed.
bool drop_page_cache(const std::string& path);
// Fraction of the pages of the regular files under `path` resident in the
// page cache (mmap + mincore); -1 when it could not be measured.
double resident_fraction(const std::string& path);

// fsyncs `path` (a file); throws naming the path and strerror.
void fsync_path(const std::string& path);

// Options of a CheckpointManager that a benchmark drives itself: `mode`
// (sync, async, overlap) into `dir`, a save every step, only the newest kept,
// never resumed.
checkpoint::CheckpointOptions manager_options(checkpoint::SaveMode mode, const std::string& dir, int io_threads);

// Median of `v` (not empty).
double median(std::vector<double> v);

// Largest value of `v` over the members of `group` (all call it).
double max_over(comm::Group& group, double v);

// A named set of whole tensors (a model's weights, a safetensors file).
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// safetensors files, through the library's reader (checkpoint::WeightsFile)
// and writer (checkpoint::write_safetensors). Throw std::runtime_error
// (FormatError, IoError) naming the file and what is wrong.
NamedTensors read_safetensors(const std::string& path);
void write_safetensors(const std::string& path, const NamedTensors& tensors);


struct CompressionStudyOptions {
  std::string dir;            // scratch directory (created, removed)
  int io_threads = 4;
  uint64_t min_set_bytes = 64ull << 20;  // tile small sets to at least this
  int trials = 1;             // each variant saved and loaded this often; medians reported
  std::shared_ptr<checkpoint::Storage> storage;  // null: the POSIX file system
  bool reference_variants_only = false;  // none, zstd 3, floatgroup+zstd 3 only
};

// Runs every variant (none, zstd 1/3/9, floatgroup+zstd 1/3/9 through
// save_state_dict; plain single-threaded zstd of each whole tensor at level 3)
// on `tensors`, checks every load bit-exact, and returns a JSON list of
// {name, level, stored_bytes, logical_bytes, save_s, load_s, ...}. Each of
// `options.trials` trials runs every variant, in an order rotated by one per
// trial; save_s and load_s are medians, save_s_trials and load_s_trials the
// samples. Tensors are tiled into independent copies until the set holds `min_set_bytes`
// (`tile` false: as given). `group` is a one-rank checkpoint group.
nlohmann::json run_compression_study(const std::string& set_name, const NamedTensors& tensors,
                                     bool tile, comm::Group& group,
                                     const CompressionStudyOptions& options);

// Writes a small safetensors file (F32, BF16, F16, I64), reads it back and
// compares bytes. Throws on any difference.
void self_test_safetensors(const std::string& dir);

}  // namespace bench
