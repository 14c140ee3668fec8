#pragma once
// Internal: how ranks agree on success. Every message a collective step
// exchanges starts with a status byte (1: ok, then the payload; 0: failed,
// then the error text), so a rank that failed still takes part in the
// collective and tells the others why; every rank then sees every failure and
// raises it, and none is left waiting in a later collective. Used by save (per
// phase) and the manager (resume, load). Not part of the public API.
#include <string>
#include <vector>

#include "comm/process_group.h"

namespace checkpoint {

// A success message carrying payload.
comm::Bytes tagged_ok(comm::Bytes payload);
// A failure message carrying the error text.
comm::Bytes tagged_error(const std::string& message);
// tagged_error(error) when error is non-empty, else tagged_ok(payload's bytes).
comm::Bytes tagged_result(const std::string& error, const std::string& payload);

// Whether a received message reports success (an empty one does not).
bool tagged_succeeded(const comm::Bytes& message);
// What follows the status byte: the payload or the error text ("" if empty).
std::string tagged_text(const comm::Bytes& message);

// The failures among the all-gathered messages (index = rank), as
// "rank 1: <error>; rank 3: <error>" ("no reply" for an empty message);
// "" when every rank succeeded.
std::string describe_rank_failures(const std::vector<comm::Bytes>& messages);

}  // namespace checkpoint
