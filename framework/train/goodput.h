#pragma once
// The goodput ledger (docs/reliability.md, "Goodput"): what the run's
// failures cost, from metrics.jsonl's own records. A run that restarts in a
// run.dir whose metrics.jsonl holds an attempt that did not finish reads
// what that attempt logged (read_earlier_attempts) and, as its first step
// begins, records the cost of the restart (restart_ledger). Pure functions
// over the file's text: no collectives; rank 0 calls them.
#include <cstdint>
#include <istream>
#include <string>

namespace framework::train {

// The attempts in metrics.jsonl since the last one that finished (an "end"
// record with status "finished": a run extended later starts a new
// ledger). Attempts are told apart by their "start" records.
struct EarlierAttempts {
  bool any = false;                 // an attempt that did not finish
  double first_start_unix_s = 0;    // the first of them: the run's first start
  double last_record_unix_s = 0;    // the last record of the latest attempt
  int64_t last_step = 0;            // its last logged step (its start's step without one)
  double mean_step_s = 0;           // the mean step_time_s of its logged steps (0: none)
  int restarts = 0;                 // "restart" records since the first start
  double lost_s = 0;                // their lost_s, summed
  double redone_s = 0;              // their redone_s, summed
};

// Reads metrics.jsonl's lines; lines that are not JSON objects (a record
// torn by a crash) and records without a "time" are skipped.
EarlierAttempts read_earlier_attempts(std::istream& metrics_jsonl);

// One restart's cost and the goodput so far (the "restart" record).
struct RestartLedger {
  int restart = 0;            // this run.dir's restarts so far, this one included
  int64_t step = 0;           // the step resumed from (0: started over)
  double lost_s = 0;          // the latest attempt's last record to this attempt's first step
  int64_t redone_steps = 0;   // the latest attempt's last logged step less `step`
  double redone_s = 0;        // redone_steps x that attempt's mean step time
  double run_wall_s = 0;      // since the run's first start
  double goodput = 1;         // (run_wall_s - all lost_s - all redone_s) / run_wall_s, in [0, 1]
};

// REQUIRES: earlier.any. `now_unix_s`: when this attempt's first step begins.
RestartLedger restart_ledger(const EarlierAttempts& earlier, int64_t resumed_step, double now_unix_s);

// "2026-11-23T01:02:03.456Z" (metrics.jsonl's "time") as Unix seconds;
// negative when the text is not such a timestamp.
double parse_utc_timestamp(const std::string& text);

}  // namespace framework::train
