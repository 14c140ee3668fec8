#pragma once
// A resume that checks itself. Every checkpoint the trainer writes records
// the hash of the global batch the run would train on next (item
// data.next_batch, framework/config/run_items.h), with what identifies the
// data: its files (name, size, a cheap fingerprint), run.seed and
// train.global_batch_size. A resume hashes that batch again from the
// restored loader position, before the first update, and compares.
//
// The record (JSON, one replicated bytes item: every rank computes the same
// bytes, one writes them):
//   {"version": 1, "batch_hash": "<16 hex digits>", "seed": S,
//    "global_batch_size": G,
//    "files": [{"path": "...", "size": N, "fingerprint": "<16 hex digits>"}, ...]}
// batch_hash: XXH3-64 (seed 0) over the samples of the global batch in
// global order (GlobalBatchSampler::global_indices), each sample's inputs
// then its targets as their raw (int64 little-endian) bytes. It never
// depends on a rank's slice, so it is the same at every world size and
// parallel layout. fingerprint: XXH3-64 of the whole file up to 64 KiB, else
// of four 16 KiB pieces (at the start, a third, two thirds, the end). The
// verdict is the batch hash alone; the rest only says why it differs.
//
// Call sequence: (all ranks, once) data_identity_of; (all ranks, each save)
// encode_next_batch({global_batch_hash(...), identity}); (all ranks, after
// set_run_state) audit_resume, which every rank decides alike.
#include "checkpoint/options.h"
#include "checkpoint/state_dict.h"
#include "framework/data/dataset.h"
#include "framework/data/loader.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace framework::train {

struct DataFile {
  std::string path;
  uint64_t size = 0;
  uint64_t fingerprint = 0;
  bool operator==(const DataFile& o) const {
    return path == o.path && size == o.size && fingerprint == o.fingerprint;
  }
};

struct DataIdentity {
  uint64_t seed = 0;
  int64_t global_batch_size = 0;
  std::vector<DataFile> files;  // dataset.files(), in stream order
};

struct NextBatchRecord {
  uint64_t batch_hash = 0;
  DataIdentity data;
};

// The identity of `dataset`'s files (stat and at most 64 KiB read from
// each) with the loader's seed and batch size. Throws std::runtime_error
// naming the file and strerror when one cannot be read.
DataIdentity data_identity_of(const data::Dataset& dataset, const data::LoaderState& position);

// XXH3-64 of global step `step`'s batch (0-based: the batch step + 1
// trains on) as the record above hashes it. REQUIRES: step >= 0.
uint64_t global_batch_hash(const data::Dataset& dataset, int64_t global_batch_size, uint64_t seed, int64_t step);

std::vector<uint8_t> encode_next_batch(const NextBatchRecord& record);
// Throws checkpoint::FormatError naming `where` for bytes that are not a record.
NextBatchRecord decode_next_batch(const std::vector<uint8_t>& bytes, const std::string& where);

// What differs between the saved record and now, as phrases joined by "; ":
// "another seed (saved S, now T)", "another train.global_batch_size (saved
// A, now B)", "shards in another order (...)", "a data file changed under
// the same name (<file>)", "other data files (...)"; else "the next batch
// differs". Always ends with "(saved hash X, now Y)".
std::string explain_batch_difference(const NextBatchRecord& saved, const NextBatchRecord& now);

// checkpoint.resume_audit error: the resumed run would not train on the
// batch the saved run would have. train exits 2 with its message.
class ResumeAuditError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class AuditOutcome {
  kPassed,           // the next batch is the recorded one
  kOff,              // checkpoint.resume_audit off
  kNoRecord,         // saved before checkpoints recorded their next batch
  kImported,         // imported (empty loader item): the data follow the step
  kDiffers,          // warn: differs, training goes on
};

struct AuditVerdict {
  AuditOutcome outcome = AuditOutcome::kPassed;
  // One line for the log (rank 0 prints it): the note, the warning or the pass.
  std::string message;
};

// After set_run_state on `sd` loaded from `checkpoint_path`: compares the
// batch `loader` yields next with the data.next_batch item. `identity`:
// data_identity_of this run's data (only read on a difference). Throws
// ResumeAuditError for a difference when `mode` is error, except one that
// run.seed or train.global_batch_size alone explain when
// `config_change_allowed` (checkpoint.allow_config_change: the user changed
// them on purpose), which is a warning.
AuditVerdict audit_resume(const checkpoint::StateDict& sd, const data::DataLoader& loader,
                          const DataIdentity& identity, checkpoint::ResumeAudit mode,
                          const std::string& checkpoint_path, bool config_change_allowed = false);

}  // namespace framework::train
