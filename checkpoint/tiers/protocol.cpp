#include "checkpoint/tiers/protocol.h"

#include "checkpoint/agreement.h"
#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/save_seam.h"
#include "checkpoint/error_text.h"
#include "checkpoint/format/checksum.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/load.h"
#include "checkpoint/timing.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <set>

namespace checkpoint {

namespace {

using Clock = std::chrono::steady_clock;
using comm::Bytes;

// Piece size of file transfers between ranks (partner copies, restores).
constexpr size_t kPieceBytes = 8 << 20;
constexpr uint64_t kMaxMetadataBytes = 1ull << 34;

Bytes u64_bytes(uint64_t v) {
  Bytes b(8);
  std::memcpy(b.data(), &v, 8);
  return b;
}

uint64_t bytes_u64(const Bytes& b, size_t at) {
  uint64_t v = 0;
  std::memcpy(&v, b.data() + at, 8);
  return v;
}

// What one side of a file transfer saw.
struct TransferResult {
  std::string send_error;  // this rank could not read what it sent
  std::string recv_error;  // what it received is not what was sent, or could not be stored
  uint64_t recv_xxh3 = 0;
};

// One side of a file transfer: what it sends and where what it receives goes.
struct TransferEnds {
  Storage* send_storage = nullptr;
  std::string send_path;
  uint64_t send_n = 0;
  int to = -1;  // -1: sends nothing
  Storage* recv_storage = nullptr;
  std::string recv_tmp;
  std::string recv_path;
  uint64_t recv_n = 0;
  int from = -1;  // -1: receives nothing
  std::optional<uint64_t> expect_xxh3;
};

// The pieces of a transfer, both ways at once. A local failure does not stop
// the exchange (the peer would wait for the bytes): the sender then sends
// zeros. Returns the XXH3 of what was sent and of what was received.
std::pair<uint64_t, uint64_t> exchange_pieces(comm::Group& group, const TransferEnds& e,
                                              WritableFile* file, TransferResult& out) {
  const bool sending = e.to >= 0, receiving = e.from >= 0;
  std::vector<uint8_t> sbuf(sending ? std::min<uint64_t>(e.send_n, kPieceBytes) : 0);
  std::vector<uint8_t> rbuf(receiving ? std::min<uint64_t>(e.recv_n, kPieceBytes) : 0);
  Xxh3Stream send_hash, recv_hash;
  for (uint64_t done_s = 0, done_r = 0; (sending && done_s < e.send_n) || (receiving && done_r < e.recv_n);) {
    const size_t ns = sending ? static_cast<size_t>(std::min<uint64_t>(e.send_n - done_s, kPieceBytes)) : 0;
    const size_t nr = receiving ? static_cast<size_t>(std::min<uint64_t>(e.recv_n - done_r, kPieceBytes)) : 0;
    if (ns > 0) {
      if (out.send_error.empty()) {
        try {
          e.send_storage->read_at(e.send_path, done_s, sbuf.data(), ns);
        } catch (const std::exception& ex) {
          out.send_error = error_text(ex);
        }
      }
      if (!out.send_error.empty()) std::fill(sbuf.begin(), sbuf.begin() + ns, 0);
      send_hash.update(sbuf.data(), ns);
    }
    group.send_recv(sbuf.data(), ns, ns > 0 ? e.to : -1, rbuf.data(), nr, nr > 0 ? e.from : -1);
    if (nr > 0) {
      recv_hash.update(rbuf.data(), nr);
      if (file && out.recv_error.empty()) {
        try {
          file->append(rbuf.data(), nr);
        } catch (const std::exception& ex) {
          out.recv_error = error_text(ex);
        }
      }
    }
    done_s += ns;
    done_r += nr;
  }
  return {send_hash.digest(), recv_hash.digest()};
}

// The receiving side's end: checks what arrived against the sender's trailer
// (and the recorded XXH3), then renames the file into place or removes it.
void finish_receive(const TransferEnds& e, const Bytes& trailer_in, std::unique_ptr<WritableFile> file,
                    TransferResult& out) {
  if (out.recv_error.empty() && bytes_u64(trailer_in, 0) != 1) {
    out.recv_error = "the sender could not read " + e.recv_path + "'s source";
  }
  if (out.recv_error.empty() && bytes_u64(trailer_in, 8) != out.recv_xxh3) {
    out.recv_error = e.recv_path + ": XXH3 of the bytes received differs from the sender's";
  }
  if (out.recv_error.empty() && e.expect_xxh3 && *e.expect_xxh3 != out.recv_xxh3) {
    out.recv_error = e.recv_path + ": XXH3 " + std::to_string(out.recv_xxh3) +
                     " differs from the recorded " + std::to_string(*e.expect_xxh3);
  }
  try {
    if (file) {
      if (out.recv_error.empty()) file->sync();
      file->close();
    }
    if (out.recv_error.empty()) {
      e.recv_storage->rename(e.recv_tmp, e.recv_path);
    } else {
      e.recv_storage->remove_all(e.recv_tmp);
    }
  } catch (const std::exception& ex) {
    if (out.recv_error.empty()) out.recv_error = error_text(ex);
  }
}

// Streams e.send_path (send_n bytes, read from send_storage) to member `to`
// while receiving recv_n bytes from member `from` into recv_tmp, which is
// renamed to recv_path once complete and verified (the sender's XXH3 of what
// it read, and expect_xxh3 when given). A local failure does not stop the
// exchange: the sender says so in the trailer. Throws only DistError (the
// group is broken then).
TransferResult transfer_file(comm::Group& group, const TransferEnds& e) {
  TransferResult out;
  const bool sending = e.to >= 0, receiving = e.from >= 0;
  std::unique_ptr<WritableFile> file;
  if (receiving) {
    try {
      file = e.recv_storage->create_file(e.recv_tmp);
    } catch (const std::exception& ex) {
      out.recv_error = error_text(ex);
    }
  }
  const auto [sent_xxh3, recv_xxh3] = exchange_pieces(group, e, file.get(), out);
  // Trailer: whether the sender read its file, and the XXH3 of what it sent.
  Bytes trailer_out(16, 0), trailer_in(16, 0);
  if (sending) {
    const uint64_t ok = out.send_error.empty() ? 1 : 0;
    std::memcpy(trailer_out.data(), &ok, 8);
    std::memcpy(trailer_out.data() + 8, &sent_xxh3, 8);
  }
  group.send_recv(trailer_out.data(), sending ? 16 : 0, e.to, trailer_in.data(), receiving ? 16 : 0, e.from);
  if (receiving) {
    out.recv_xxh3 = recv_xxh3;
    finish_receive(e, trailer_in, std::move(file), out);
  }
  return out;
}

// Copies `from` to `to` within or across storages, fsyncing the copy; the
// XXH3 of the bytes copied.
uint64_t copy_file(Storage& src, const std::string& from, Storage& dst, const std::string& to) {
  const uint64_t size = src.file_size(from);
  std::unique_ptr<WritableFile> out = dst.create_file(to);
  std::vector<uint8_t> buf(static_cast<size_t>(std::min<uint64_t>(size, kPieceBytes)));
  Xxh3Stream hash;
  for (uint64_t at = 0; at < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(size - at, kPieceBytes));
    src.read_at(from, at, buf.data(), n);
    hash.update(buf.data(), n);
    out->append(buf.data(), n);
    at += n;
  }
  out->sync();
  out->close();
  return hash.digest();
}

// Every rank's message, or throws CheckpointError(prefix + the failures).
std::vector<Bytes> agree(comm::Group& group, const std::string& error,
                         const Bytes& payload, const std::string& prefix) {
  std::vector<Bytes> all =
      group.all_gather_bytes(error.empty() ? tagged_ok(payload) : tagged_error(error));
  const std::string failures = describe_rank_failures(all);
  if (!failures.empty()) throw CheckpointError(prefix + " (" + failures + ")");
  return all;
}

}  // namespace

TierProtocol::TierProtocol(const CheckpointOptions& options, std::string durable_dir,
                           std::shared_ptr<Storage> durable, comm::Group& group, int node,
                           std::shared_ptr<Storage> local)
    : options_(options),
      dir_(std::move(durable_dir)),
      storage_(std::move(durable)),
      group_(group),
      node_(node),
      local_dir_(local_tier_dir(options_.local.dir, node)),
      local_storage_(std::move(local)) {}

std::string TierProtocol::local_step_path(int64_t step) const {
  return join_path(local_dir_, step_dir_name(step));
}

const TierProtocol::Topology& TierProtocol::topology() {
  if (topology_) return *topology_;
  auto topo = std::make_shared<Topology>();
  const std::vector<Bytes> all = group_.all_gather_bytes(u64_bytes(static_cast<uint64_t>(node_)));
  for (const Bytes& b : all) topo->node_of_rank.push_back(static_cast<int>(bytes_u64(b, 0)));
  for (int r = 0; r < group_.size(); ++r) topo->ranks_of_node[topo->node_of_rank[r]].push_back(r);
  for (const auto& [node, ranks] : topo->ranks_of_node) topo->nodes.push_back(node);
  const int me = group_.rank();
  topo->node = topo->node_of_rank[me];
  topo->leader = topo->leader_of(topo->node) == me;
  if (topo->nodes.size() < 2) {
    topo->no_partner = "one node";
  } else {
    const size_t per_node = topo->ranks_of_node.begin()->second.size();
    for (const auto& [node, ranks] : topo->ranks_of_node) {
      if (ranks.size() != per_node) topo->no_partner = "nodes with different numbers of ranks";
    }
  }
  if (topo->no_partner.empty()) {
    // Rank i of node k keeps the file of rank i of the previous node, and
    // its own file goes to rank i of the next node (a ring over the nodes).
    const auto& nodes = topo->nodes;
    const size_t k = static_cast<size_t>(std::find(nodes.begin(), nodes.end(), topo->node) - nodes.begin());
    const std::vector<int>& mine = topo->ranks_of_node[topo->node];
    const size_t i = static_cast<size_t>(std::find(mine.begin(), mine.end(), me) - mine.begin());
    topo->partner_to = topo->ranks_of_node[nodes[(k + 1) % nodes.size()]][i];
    topo->partner_from = topo->ranks_of_node[nodes[(k + nodes.size() - 1) % nodes.size()]][i];
  }
  topology_ = topo;
  return *topology_;
}

// ---------------------------------------------------------------------------
// The local commit.

void TierProtocol::commit_local(TierSave& save, const StateDict& staged, SaveOptions so,
                                const test_seam::SaveSeam* seam) {
  topology();
  if (seam && seam->before_write) seam->before_write(save.step, group_.rank());
  const std::string failed =
      "checkpoint save of step " + std::to_string(save.step) + " to the local tier failed";
  clear_local_leftover(save, failed);
  so.node_local = true;
  SaveStats st;
  save.event->write_started_unix_s = unix_seconds_now();
  try {
    st = save_state_dict(staged, save.local_path, group_, so);
  } catch (const CheckpointError&) {
    remove_local_step(save);  // every rank failed together: no rank is still writing
    throw;
  }
  save.metadata = std::move(st.metadata);
  save.event->plan_s = st.plan_s;
  save.event->plan_cached = st.plan_cached;
  save.event->write_s = st.plan_s + st.write_s;
  save.event->bytes = st.total_logical_bytes;
  save.event->stored_bytes = st.total_stored_bytes;
  commit_on_every_node(save, failed, st.commit_s);
}

// (all ranks) A leftover of this step (an uncommitted crash remnant, or a
// checkpoint resume did not take) must not mix with the new files.
void TierProtocol::clear_local_leftover(const TierSave& save, const std::string& failed) {
  std::string error;
  if (topology().leader) {
    try {
      if (local_storage_->exists(save.local_path)) {
        const std::string aside = join_path(local_dir_, ".deleting." + step_dir_name(save.step));
        local_storage_->remove_all(aside);
        local_storage_->rename(save.local_path, aside);
        local_storage_->sync_dir(local_dir_);
        local_storage_->remove_all(aside);
      }
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  agree(group_, error, {}, failed + " clearing " + save.local_path);
}

// (node leaders) Best effort, after every rank failed together.
void TierProtocol::remove_local_step(const TierSave& save) {
  if (!topology().leader) return;
  try {
    local_storage_->remove_all(save.local_path);
  } catch (const std::exception&) {
  }
}

// (all ranks) Commit on every node: the record, then the metadata.
void TierProtocol::commit_on_every_node(TierSave& save, const std::string& failed, double write_commit_s) {
  const Topology& topo = topology();
  const int rank = group_.rank();
  auto t = Clock::now();
  uint64_t mine = 0;
  std::string error;
  try {
    mine = local_storage_->file_size(join_path(save.local_path, rank_file_name(rank)));
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  std::vector<Bytes> sizes;
  try {
    sizes = agree(group_, error, u64_bytes(mine), failed);
  } catch (const CheckpointError&) {
    remove_local_step(save);
    throw;
  }
  save.file_bytes.clear();
  for (const Bytes& b : sizes) save.file_bytes.push_back(bytes_u64(b, 1));
  if (topo.leader) {
    try {
      LocalRecord record;
      record.step = save.step;
      record.node = topo.node;
      record.node_of_rank = topo.node_of_rank;
      for (int r : topo.ranks_of_node.at(topo.node)) {
        record.files.push_back(TierFile{rank_file_name(r), r, topo.node, save.file_bytes[r], std::nullopt});
      }
      const std::string text = encode_local_record(record);
      local_storage_->write_file_atomic(join_path(save.local_path, kLocalRecordName),
                                        std::vector<uint8_t>(text.begin(), text.end()));
      local_storage_->sync_dir(save.local_path);
      local_storage_->write_file_atomic(join_path(save.local_path, kMetadataFileName), save.metadata);
    } catch (const std::exception& e) {
      error = "node " + std::to_string(topo.node) + ": " + error_text(e);
    }
  }
  try {
    agree(group_, error, {}, failed + " committing; nothing was committed");
  } catch (const CheckpointError&) {
    remove_local_step(save);
    throw;
  }
  save.event->commit_s = write_commit_s + seconds_since(t);
  save.local_committed = Clock::now();
  save.event->local_commit_s = seconds_since(save.started);
  save.event->tier = "local";
  save.event->local_path = save.local_path;
  save.event->path = save.local_path;
  save.local_done = true;
}

// ---------------------------------------------------------------------------
// After the local commit: partner copies, flush, retention.

void TierProtocol::finish(TierSave& save, const test_seam::SaveSeam* seam) {
  const Topology& topo = topology();
  if (!options_.local.partner) {
    save.event->partner = "off";
  } else if (!topo.no_partner.empty()) {
    save.event->partner = "skipped: " + topo.no_partner;
  } else {
    if (seam && seam->before_partner) seam->before_partner(save.step, group_.rank());
    partner_copy(save);
  }
  std::exception_ptr flush_error;
  if (save.flush) {
    if (seam && seam->before_flush) seam->before_flush(save.step, group_.rank());
    try {
      flush(save);
    } catch (const CheckpointError&) {
      flush_error = std::current_exception();
    }
  }
  apply_retention_of_both(save);
  if (flush_error) std::rethrow_exception(flush_error);
}

// Retention: never the step just saved (the newest in both tiers), never an
// uncommitted directory; the durable tier only after a flush committed. A
// failure is recorded in `save` (each tier on its own), never thrown: the
// save itself committed.
void TierProtocol::apply_retention_of_both(TierSave& save) {
  auto retain = [&](Storage& storage, const std::string& dir, int64_t keep, const char* tier) {
    try {
      apply_retention(storage, dir, keep, save.step);
    } catch (const std::exception& e) {
      save.retention_failures.push_back({save.step, tier, error_text(e)});
    }
  };
  if (topology().leader && options_.local.keep_last > 0) {
    retain(*local_storage_, local_dir_, options_.local.keep_last, "local");
  }
  if (group_.rank() == 0 && save.event->flushed && options_.keep_last > 0) {
    retain(*storage_, dir_, options_.keep_last, "durable");
  }
}

// (all ranks) Each rank's file goes to its partner on the next node, into
// <local step dir>/.partner/; once every copy is fsynced everywhere, each
// node's leader writes .partner.json (the L2 claim). A failure leaves no
// claim on any node and marks the report; the L1 checkpoint stands.
void TierProtocol::partner_copy(TierSave& save) {
  const Topology& topo = topology();
  const int rank = group_.rank();
  const std::string copies = join_path(save.local_path, kPartnerDirName);
  std::string prep_error;
  try {
    local_storage_->make_dirs(copies);
  } catch (const std::exception& e) {
    prep_error = error_text(e);
  }
  const std::string name = rank_file_name(topo.partner_from);
  TransferEnds ends;
  ends.send_storage = local_storage_.get();
  ends.send_path = join_path(save.local_path, rank_file_name(rank));
  ends.send_n = save.file_bytes[rank];
  ends.to = topo.partner_to;
  ends.recv_storage = local_storage_.get();
  ends.recv_tmp = join_path(copies, ".incoming." + name);
  ends.recv_path = join_path(copies, name);
  ends.recv_n = save.file_bytes[topo.partner_from];
  ends.from = topo.partner_from;
  const TransferResult tr = transfer_file(group_, ends);
  std::string error = prep_error;
  if (error.empty()) error = tr.recv_error;
  if (error.empty() && !tr.send_error.empty()) error = "reading its own file: " + tr.send_error;
  TierFile kept{name, topo.partner_from, topo.node_of_rank[topo.partner_from],
                save.file_bytes[topo.partner_from], tr.recv_xxh3};
  const std::string entry = encode_partner_record(PartnerRecord{save.step, topo.node, {kept}});
  std::vector<Bytes> all = group_.all_gather_bytes(tagged_result(error, entry));
  std::string failures = describe_rank_failures(all);
  if (failures.empty() && topo.leader) {
    try {
      PartnerRecord record{save.step, topo.node, {}};
      for (int r : topo.ranks_of_node.at(topo.node)) {
        const std::string text = tagged_text(all[r]);
        for (TierFile& f : decode_partner_record(text, "partner copy report").files) record.files.push_back(f);
      }
      local_storage_->sync_dir(copies);
      const std::string text = encode_partner_record(record);
      local_storage_->write_file_atomic(join_path(save.local_path, kPartnerRecordName),
                                        std::vector<uint8_t>(text.begin(), text.end()));
    } catch (const std::exception& e) {
      error = "node " + std::to_string(topo.node) + ": " + error_text(e);
    }
  }
  if (failures.empty()) {
    all = group_.all_gather_bytes(tagged_result(error, ""));
    failures = describe_rank_failures(all);
  }
  if (failures.empty()) {
    save.event->partner = "ok";
    return;
  }
  // No claim anywhere: a node whose .partner.json was written takes it back.
  if (topo.leader) {
    try {
      local_storage_->remove_all(join_path(save.local_path, kPartnerRecordName));
      local_storage_->sync_dir(save.local_path);
      local_storage_->remove_all(copies);
    } catch (const std::exception&) {
    }
  }
  save.event->partner = "failed: " + failures;
}

// (all ranks) Copies each rank's committed local file to the durable step
// directory, then rank 0 commits the same metadata there.
void TierProtocol::flush(TierSave& save) {
  auto t = Clock::now();
  const int rank = group_.rank();
  const std::string durable = join_path(dir_, step_dir_name(save.step));
  const std::string failed = "checkpoint of step " + std::to_string(save.step) +
                             ": flush to the durable tier (" + durable + ") failed";
  const std::string kept = "; the local tier keeps it (" + save.local_path + ")";
  std::string error;
  if (rank == 0) {
    try {
      if (storage_->exists(durable)) storage_->remove_all(durable);  // an uncommitted leftover
      storage_->make_dirs_durable(durable);
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  Bytes verdict = group_.broadcast_bytes(tagged_result(error, ""), 0);
  if (!tagged_succeeded(verdict)) throw CheckpointError(failed + " (rank 0: " + tagged_text(verdict) + ")" + kept);
  try {
    const std::string name = rank_file_name(rank);
    copy_file(*local_storage_, join_path(save.local_path, name), *storage_, join_path(durable, name));
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  std::vector<Bytes> reports = group_.gather_bytes(tagged_result(error, ""), 0);
  if (rank == 0) {
    std::string failures = describe_rank_failures(reports);
    if (failures.empty()) {
      try {
        storage_->sync_dir(durable);
        storage_->write_file_atomic(join_path(durable, kMetadataFileName), save.metadata);
      } catch (const std::exception& e) {
        failures = "rank 0 commit: " + error_text(e);
      }
    }
    if (!failures.empty()) {
      std::string ignored;  // a commit whose directory fsync failed may reach the disk all the same
      remove_step_dir(*storage_, durable, &ignored);
    }
    verdict = tagged_result(failures, "");
  }
  verdict = group_.broadcast_bytes(verdict, 0);
  if (!tagged_succeeded(verdict)) throw CheckpointError(failed + " (" + tagged_text(verdict) + ")" + kept);
  save.event->flushed = true;
  save.event->flush_s = seconds_since(t);
  save.event->exposure_s = seconds_since(save.local_committed);
  save.event->tier = "local+durable";
  save.event->path = durable;
}

// ---------------------------------------------------------------------------
// Resume.

TierChoice TierProtocol::choose_resume() {
  const Topology& topo = topology();
  Bytes mine = tagged_ok({});
  if (topo.leader) {
    try {
      const std::string inv = encode_inventory(inventory_local_tier(*local_storage_, local_dir_, topo.node));
      mine = tagged_ok(Bytes(inv.begin(), inv.end()));
    } catch (const std::exception& e) {
      mine = tagged_error(error_text(e));
    }
  }
  std::vector<Bytes> gathered = group_.gather_bytes(mine, 0);
  std::string error, text;
  if (group_.rank() == 0) {
    try {
      const std::string failures = describe_rank_failures(gathered);
      if (!failures.empty()) throw std::runtime_error("listing the local tier failed (" + failures + ")");
      std::vector<NodeInventory> nodes;
      for (int node : topo.nodes) {
        const std::string inv = tagged_text(gathered[topo.leader_of(node)]);
        nodes.push_back(decode_inventory(inv));
      }
      const TierChoice choice = choose_resume_tiers(nodes, list_checkpoints(*storage_, dir_));
      nlohmann::json j = {{"candidates", encode_candidates(choice.candidates)}, {"notes", choice.notes}};
      text = j.dump();
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  const Bytes reply = group_.broadcast_bytes(tagged_result(error, text), 0);
  if (!tagged_succeeded(reply)) throw CheckpointError("checkpoint.resume: " + tagged_text(reply));
  const nlohmann::json j = nlohmann::json::parse(tagged_text(reply));
  TierChoice choice;
  choice.candidates = decode_candidates(j["candidates"].get<std::string>());
  choice.notes = j["notes"].get<std::vector<std::string>>();
  return choice;
}

void TierProtocol::restore_local(StateDict& state, const ResumeCandidate& c) {
  const std::string step_path = local_step_path(c.step);
  const std::string what = "restoring local step_" + std::to_string(c.step);
  // 1. The metadata, from a node that committed the step.
  const std::vector<uint8_t> meta = broadcast_local_metadata(step_path, c, what);
  // 2. The files this rank's load reads that its node lacks.
  const std::vector<Bytes> wants = group_.gather_bytes(files_missing(state, meta, step_path, c), 0);
  // 3. Who sends each of them to whom, one list every rank walks in order.
  const std::vector<Move> moves = agree_moves(wants, c, what);
  // 4. Every transfer involves two ranks that both reach it.
  std::string error = run_moves(moves, step_path);
  try {
    if (error.empty()) local_storage_->sync_dir(step_path);
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  auto damaged_if_failed = [&](const std::string& failure) {
    const std::string failures = describe_rank_failures(group_.all_gather_bytes(tagged_result(failure, "")));
    if (!failures.empty()) throw CheckpointDamagedError(what + " failed (" + failures + ")");
  };
  damaged_if_failed(error);
  // 5. A node that lacked the step commits the metadata there, after every
  // file arrived (it has no .local.json: never a source for another resume).
  if (topology().leader) {
    try {
      if (!local_storage_->exists(join_path(step_path, kMetadataFileName))) {
        local_storage_->write_file_atomic(join_path(step_path, kMetadataFileName), meta);
      }
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  damaged_if_failed(error);
}

// (all ranks) The step's metadata, read by the leader of a node that
// committed it and broadcast.
std::vector<uint8_t> TierProtocol::broadcast_local_metadata(const std::string& step_path,
                                                           const ResumeCandidate& c, const std::string& what) {
  const Topology& topo = topology();
  const int root = topo.ranks_of_node.count(c.metadata_node) ? topo.leader_of(c.metadata_node) : 0;
  std::string error;
  Bytes meta;
  if (group_.rank() == root) {
    try {
      meta = local_storage_->read_file(join_path(step_path, kMetadataFileName), kMaxMetadataBytes);
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  const Bytes reply = group_.broadcast_bytes(error.empty() ? tagged_ok(std::move(meta)) : tagged_error(error), root);
  if (!tagged_succeeded(reply)) {
    throw CheckpointDamagedError(what + " failed (rank " + std::to_string(root) + ": " + tagged_text(reply) + ")");
  }
  return std::vector<uint8_t>(reply.begin() + 1, reply.end());
}

// This rank's report for step 2 of restore_local: tagged, the names of the
// files its load reads that are not in `step_path` with the recorded size,
// one a line.
Bytes TierProtocol::files_missing(const StateDict& state, const std::vector<uint8_t>& metadata,
                                  const std::string& step_path, const ResumeCandidate& c) {
  std::string wanted, error;
  try {
    local_storage_->make_dirs_durable(step_path);
    LoadOptions lo;
    if (options_.model_only) {
      lo.filter = [](const std::string& name) { return name.rfind("model.", 0) == 0; };
    }
    for (const std::string& f : files_needed(state, metadata, lo)) {
      const FileInfo info = local_storage_->stat(join_path(step_path, f));
      bool present = false;
      for (const FileSource& src : c.sources) {
        if (src.file.name == f) present = info.type == FileType::kFile && info.size == src.file.bytes;
      }
      if (!present) wanted += f + "\n";
    }
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  return tagged_result(error, wanted);
}

// (rank 0) Assigns each (node, file) one receiving rank of that node and one
// sending rank of a node holding it (or a local copy from the node's own
// partner copies), as a JSON list. Throws when a file cannot be had.
std::string TierProtocol::plan_moves(const std::vector<Bytes>& wants, const ResumeCandidate& c) {
  const Topology& topo = topology();
  const std::string failures = describe_rank_failures(wants);
  if (!failures.empty()) throw std::runtime_error(failures);
  std::map<std::string, const FileSource*> source_of;
  for (const FileSource& s : c.sources) source_of[s.file.name] = &s;
  std::set<std::pair<int, std::string>> planned;  // (node, file)
  nlohmann::json list = nlohmann::json::array();
  std::map<int, int> sends_by_node;
  for (int r = 0; r < group_.size(); ++r) {
    const std::string text = tagged_text(wants[r]);
    for (size_t pos = 0, end; (end = text.find('\n', pos)) != std::string::npos; pos = end + 1) {
      const std::string f = text.substr(pos, end - pos);
      auto it = source_of.find(f);
      if (it == source_of.end()) throw std::runtime_error("rank " + std::to_string(r) + " needs " + f + ", which no node holds");
      const int node = topo.node_of_rank[r];
      if (!planned.insert({node, f}).second) continue;
      const FileSource& s = *it->second;
      if (!topo.ranks_of_node.count(s.node)) throw std::runtime_error(f + " is on node " + std::to_string(s.node) + ", not in this job");
      int from = -1;
      if (s.node != node) {
        const std::vector<int>& holders = topo.ranks_of_node.at(s.node);
        from = holders[static_cast<size_t>(sends_by_node[s.node]++) % holders.size()];
      } else if (!s.partner) {
        continue;  // present after all (another rank of the node sees it)
      }
      nlohmann::json m = {{"file", f}, {"from", from}, {"to", r}, {"partner", s.partner}, {"bytes", s.file.bytes}};
      if (s.file.xxh3) m["xxh3"] = *s.file.xxh3;
      list.push_back(m);
    }
  }
  return list.dump();
}

// (all ranks) rank 0's plan_moves, broadcast and decoded.
std::vector<TierProtocol::Move> TierProtocol::agree_moves(const std::vector<Bytes>& wants, const ResumeCandidate& c,
                                                          const std::string& what) {
  std::string plan, plan_error;
  if (group_.rank() == 0) {
    try {
      plan = plan_moves(wants, c);
    } catch (const std::exception& e) {
      plan_error = error_text(e);
    }
  }
  const Bytes reply = group_.broadcast_bytes(tagged_result(plan_error, plan), 0);
  if (!tagged_succeeded(reply)) throw CheckpointDamagedError(what + " failed (" + tagged_text(reply) + ")");
  std::vector<Move> moves;
  for (const nlohmann::json& m : nlohmann::json::parse(tagged_text(reply))) {
    Move mv;
    mv.file = m["file"].get<std::string>();
    mv.from = m["from"].get<int>();
    mv.to = m["to"].get<int>();
    mv.partner = m["partner"].get<bool>();
    mv.bytes = m["bytes"].get<uint64_t>();
    if (m.contains("xxh3")) mv.xxh3 = m["xxh3"].get<uint64_t>();
    moves.push_back(std::move(mv));
  }
  return moves;
}

// (all ranks) Walks the list: a transfer between the two ranks it names, or
// a copy from the receiver's own .partner/. "" or this rank's first failure.
std::string TierProtocol::run_moves(const std::vector<Move>& moves, const std::string& step_path) {
  const int rank = group_.rank();
  std::string error;
  for (const Move& m : moves) {
    const std::string target = join_path(step_path, m.file);
    const std::string tmp = join_path(step_path, ".incoming." + m.file);
    if (m.from < 0) {
      if (m.to != rank) continue;
      try {
        const uint64_t h = copy_file(*local_storage_, join_path(join_path(step_path, kPartnerDirName), m.file),
                                     *local_storage_, tmp);
        if (m.xxh3 && h != *m.xxh3) throw ChecksumError(m.file + ": partner copy's XXH3 differs from the recorded one");
        local_storage_->rename(tmp, target);
      } catch (const std::exception& e) {
        if (error.empty()) error = error_text(e);
      }
      continue;
    }
    if (m.from != rank && m.to != rank) continue;
    TransferEnds ends;
    ends.send_storage = local_storage_.get();
    ends.send_path = m.partner ? join_path(join_path(step_path, kPartnerDirName), m.file) : target;
    ends.send_n = m.from == rank ? m.bytes : 0;
    ends.to = m.from == rank ? m.to : -1;
    ends.recv_storage = local_storage_.get();
    ends.recv_tmp = tmp;
    ends.recv_path = target;
    ends.recv_n = m.to == rank ? m.bytes : 0;
    ends.from = m.to == rank ? m.from : -1;
    ends.expect_xxh3 = m.xxh3;
    const TransferResult tr = transfer_file(group_, ends);
    if (error.empty()) error = m.to == rank ? tr.recv_error : tr.send_error;
  }
  return error;
}

}  // namespace checkpoint
