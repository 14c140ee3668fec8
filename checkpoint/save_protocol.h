#pragma once
// Internal: the pieces of the save protocol (save.cpp) that are pure
// functions of the messages exchanged, so that bench/scale_bench can run the
// coordinator's and a rank's real work at any simulated world size without a
// process group. Not part of the public API.
//
// Messages (every one starts with agreement.h's status byte):
//   rank -> coordinator  local plan: encode_local_plan's blob      (gather)
//   coordinator -> rank  its reply: u64 plan id, then its encoded
//                        assignments; or the planning error, the same text
//                        for every rank                              (scatter)
//   rank -> coordinator  write report: u64 logical, u64 stored bytes, then
//                        its chunks' records as in the metadata
//                        (metadata_codec::put_chunk), in assignment order  (gather)
//   coordinator -> all   verdict: u64 total logical, u64 total stored bytes;
//                        or the error every rank raises           (broadcast)
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/format/metadata.h"
#include "checkpoint/plan/planner.h"
#include "checkpoint/save.h"

namespace checkpoint {

// What the coordinator keeps from planning: for the commit, and across saves
// in a SavePlanCache. Compact: an item index and the box's coordinates per
// assignment (a few dozen bytes each at any world size).
struct CoordinatorPlan {
  std::vector<ItemMeta> items;      // declarations in first-seen order; no chunks
  // Rank r's assignments are k in [rank_begin[r], rank_begin[r + 1]), in
  // plan order: item item_of[k], box coords[coord_at[k] ...] (the item's
  // ndim offsets, then its ndim sizes).
  std::vector<uint64_t> rank_begin;
  std::vector<uint32_t> item_of;
  std::vector<uint64_t> coord_at;
  std::vector<int64_t> coords;

  int world() const { return rank_begin.empty() ? 0 : static_cast<int>(rank_begin.size() - 1); }
  Box box(uint64_t k) const;
  std::vector<WriteAssignment> assignments(int rank) const;
};

namespace save_protocol {

using Bytes = std::vector<uint8_t>;

// (every rank) What this rank's structure is, for plan caching: XXH3-64 over
// its local-plan blob, the plan options, the world size and the rank.
uint64_t structure_hash(const Bytes& local_plan_blob, const PlanOptions& options, int world,
                        int rank);

// (coordinator) One reply per rank from the gathered local-plan messages
// (index = rank), decoded and planned one at a time, each freed as it goes. On success `kept` receives the plan. Never throws for bad
// input: a failed rank or disagreeing plans give every rank the same error.
std::vector<Bytes> plan_replies(std::vector<Bytes> gathered, const PlanOptions& options,
                                const std::string& step_dir, uint64_t plan_id,
                                CoordinatorPlan* kept);

// (every rank) Its assignments from its reply; throws CheckpointError with the
// coordinator's text if planning failed.
std::vector<WriteAssignment> assignments_from_reply(const Bytes& reply, uint64_t* plan_id);

// (every rank) Its write report (without the status byte): its byte totals,
// then its chunks, in assignment order.
Bytes encode_write_report(uint64_t logical_bytes, uint64_t stored_bytes, const std::vector<ChunkMeta>& chunks);

// (coordinator) The encoded metadata (version 2) of the checkpoint from the
// kept plan and the gathered write reports (every one succeeded), built one
// item at a time (MetadataWriter). Adds the byte totals to `stats`. Throws
// CheckpointError on a malformed report, FormatError on invalid metadata.
Bytes assemble_metadata(const CoordinatorPlan& kept, const std::vector<Bytes>& reports,
                        const SaveOptions& options, SaveStats& stats);

}  // namespace save_protocol
}  // namespace checkpoint
