#include "tools/tier_report.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

namespace tools {

namespace {

using checkpoint::CheckpointEntry;
using checkpoint::CheckpointStatus;
using checkpoint::CheckpointStatusEntry;
using checkpoint::LocalStep;
using checkpoint::NodeInventory;
using checkpoint::ResumeCandidate;
using checkpoint::Tier;
using checkpoint::TierFile;

NodeTier inventory_node(checkpoint::Storage& storage, const std::string& dir, int node) {
  NodeTier tier;
  try {
    tier.missing = storage.stat(dir).type == checkpoint::FileType::kMissing;
  } catch (const std::exception& e) {
    tier.inventory.node = node;
    tier.inventory.dir = dir;
    tier.inventory.error = e.what();
    return tier;
  }
  tier.inventory = checkpoint::inventory_local_tier(storage, dir, node);
  return tier;
}

const LocalStep* step_of(const NodeInventory& inv, int64_t step) {
  for (const LocalStep& s : inv.steps) {
    if (s.step == step) return &s;
  }
  return nullptr;
}

bool has_file(const std::vector<TierFile>& files, const std::string& name) {
  return std::any_of(files.begin(), files.end(), [&](const TierFile& f) { return f.name == name; });
}

// Where resume would find `file` of local step `step`: an own file of a node
// that committed the step, else a committed partner copy (.partner.json),
// the order choose_resume_tiers looks in.
FileLocation locate(const std::string& file, int64_t step, const std::vector<NodeTier>& nodes) {
  for (const NodeTier& n : nodes) {
    const LocalStep* s = step_of(n.inventory, step);
    if (s && s->committed && s->record && has_file(s->own, file)) return {file, n.inventory.node, false};
  }
  for (const NodeTier& n : nodes) {
    const LocalStep* s = step_of(n.inventory, step);
    if (s && s->partner && has_file(s->partner_copies, file)) return {file, n.inventory.node, true};
  }
  return {file, -1, false};
}

// --verify of one node's step directory: the chunks of the files it holds,
// where the others are, and its partner copies.
LocalVerify verify_local_step(checkpoint::Storage& storage, const LocalStep& s,
                              const std::vector<NodeTier>& nodes, thread_pool::ThreadPool* pool) {
  LocalVerify v;
  if (s.committed) {
    v.ran = true;
    std::map<std::string, bool> here;  // file -> present in this directory
    auto in_this_dir = [&](const std::string& file) {
      auto it = here.find(file);
      if (it == here.end()) {
        const bool present = storage.stat(checkpoint::join_path(s.path, file)).type == checkpoint::FileType::kFile;
        it = here.emplace(file, present).first;
      }
      return it->second;
    };
    try {
      v.report = checkpoint::verify_checkpoint_files(storage, s.path, in_this_dir, pool);
    } catch (const std::exception& e) {
      v.error = e.what();
    }
    for (const auto& [file, present] : here) {
      if (!present) v.elsewhere.push_back(locate(file, s.step, nodes));
    }
  }
  if (s.partner) {
    for (const TierFile& f : s.partner->files) {
      v.partner_copies.push_back({f, checkpoint::check_partner_copy(storage, s.path, f)});
    }
  }
  return v;
}

std::vector<NodeInventory> inventories_of_step(const std::vector<NodeTier>& nodes, int64_t step) {
  std::vector<NodeInventory> out;
  for (const NodeTier& n : nodes) {
    NodeInventory inv = n.inventory;
    inv.steps.clear();
    if (const LocalStep* s = step_of(n.inventory, step)) inv.steps.push_back(*s);
    out.push_back(std::move(inv));
  }
  return out;
}

std::string step_name(int64_t step) { return checkpoint::step_dir_name(step); }

void add_damage(std::vector<std::string>& damage, const std::string& line) {
  if (std::find(damage.begin(), damage.end(), line) == damage.end()) damage.push_back(line);
}

void collect_damage(const StepReport& s, std::vector<std::string>& damage) {
  const DurableStep& d = s.durable;
  if (d.entry && d.entry->status == CheckpointStatus::kDamaged) add_damage(damage, d.entry->error);
  if (!d.verify_error.empty()) add_damage(damage, d.verify_error);
  for (const checkpoint::VerifyProblem& p : d.report.problems) add_damage(damage, p.message);
  for (const NodeStep& n : s.nodes) {
    if (!n.step) continue;
    if (n.status == CheckpointStatus::kDamaged) add_damage(damage, n.status_error);
    // A committed step's records and files are claims: a problem with them
    // is damage. An uncommitted one may still be being written.
    if (n.step->committed) {
      for (const std::string& p : n.step->problems) add_damage(damage, p);
    }
    if (!n.verify.error.empty() && n.status != CheckpointStatus::kDamaged) add_damage(damage, n.verify.error);
    for (const checkpoint::VerifyProblem& p : n.verify.report.problems) add_damage(damage, p.message);
    for (const PartnerCopyCheck& c : n.verify.partner_copies) {
      if (!c.problem.empty()) add_damage(damage, c.problem);
    }
  }
}

const StepReport* report_of(const std::vector<StepReport>& steps, int64_t step) {
  for (const StepReport& s : steps) {
    if (s.step == step) return &s;
  }
  return nullptr;
}

// Why loading `c` would fail, as far as the metadata read and --verify tell;
// "" when nothing is known against it.
std::string known_failure(const ResumeCandidate& c, const StepReport& s) {
  if (c.tier == Tier::kDurable) {
    const DurableStep& d = s.durable;
    if (d.entry && d.entry->status == CheckpointStatus::kDamaged) return d.entry->error;
    if (!d.verify_error.empty()) return d.verify_error;
    if (!d.report.problems.empty()) return d.report.problems.front().message;
    return "";
  }
  for (const NodeStep& n : s.nodes) {
    // Resume reads the metadata of `metadata_node` only (restore_local).
    if (n.node == c.metadata_node && n.status == CheckpointStatus::kDamaged) return n.status_error;
  }
  for (const checkpoint::FileSource& src : c.sources) {
    for (const NodeStep& n : s.nodes) {
      if (n.node != src.node) continue;
      if (src.partner) {
        for (const PartnerCopyCheck& check : n.verify.partner_copies) {
          if (check.file.name == src.file.name && !check.problem.empty()) return check.problem;
        }
      } else {
        for (const checkpoint::VerifyProblem& p : n.verify.report.problems) {
          if (p.file == src.file.name) return p.message;
        }
      }
    }
  }
  return "";
}

// What the durable tier holds of `step`: its entry (verified when asked)
// and the directories set aside.
DurableStep report_durable_step(checkpoint::Storage& storage, int64_t step,
                                const std::vector<CheckpointStatusEntry>& listed,
                                const TierReportOptions& options) {
  DurableStep d;
  for (const CheckpointStatusEntry& e : listed) {
    if (e.entry.step != step) continue;
    if (e.status == CheckpointStatus::kSetAside) {
      d.set_aside.push_back(e.entry.path);
    } else {
      d.entry = e;
    }
  }
  if (options.verify && d.entry && d.entry->status == CheckpointStatus::kCommitted) {
    d.verified = true;
    try {
      d.report = checkpoint::verify_checkpoint(storage, d.entry->entry.path, options.pool);
    } catch (const std::exception& e) {
      d.verify_error = e.what();
    }
  }
  return d;
}

// What node `n`'s local tier holds of `step`, with its status (verified
// when asked).
NodeStep report_node_step(checkpoint::Storage& storage, int64_t step, const NodeTier& n,
                          const std::vector<NodeTier>& nodes, const TierReportOptions& options) {
  NodeStep ns;
  ns.node = n.inventory.node;
  ns.path = checkpoint::join_path(n.inventory.dir, step_name(step));
  if (const LocalStep* s = step_of(n.inventory, step)) {
    ns.step = *s;
    const CheckpointStatusEntry status =
        checkpoint::checkpoint_status(storage, CheckpointEntry{step, s->path, s->committed, 0, 0});
    ns.status = status.status;
    ns.status_error = status.error;
    if (options.verify) ns.verify = verify_local_step(storage, *s, nodes, options.pool);
  }
  return ns;
}

// One step in both tiers, and resume's candidates for it alone.
StepReport report_step(checkpoint::Storage& storage, int64_t step, const std::vector<CheckpointStatusEntry>& listed,
                       const std::vector<CheckpointEntry>& durable, const std::vector<NodeTier>& nodes,
                       const TierReportOptions& options) {
  StepReport r;
  r.step = step;
  r.durable = report_durable_step(storage, step, listed, options);
  for (const NodeTier& n : nodes) r.nodes.push_back(report_node_step(storage, step, n, nodes, options));
  // This step alone: its candidates are those of the whole choice, and a
  // local step that cannot load gets its reason as the (only) note.
  std::vector<CheckpointEntry> durable_of_step;
  for (const CheckpointEntry& e : durable) {
    if (e.step == step) durable_of_step.push_back(e);
  }
  const checkpoint::TierChoice choice =
      checkpoint::choose_resume_tiers(inventories_of_step(nodes, step), durable_of_step);
  r.candidates = choice.candidates;
  if (r.candidates.empty() && !choice.notes.empty()) r.not_loadable = choice.notes.front();
  return r;
}

// What resume would load: the first candidate of the whole choice that no
// check found damaged; the ones before it go to `failing`.
void choose_resume(TierReport& report, const std::vector<CheckpointEntry>& durable) {
  std::vector<NodeInventory> inventories;
  for (const NodeTier& n : report.nodes) inventories.push_back(n.inventory);
  const checkpoint::TierChoice choice = checkpoint::choose_resume_tiers(inventories, durable);
  report.notes = choice.notes;
  for (const ResumeCandidate& c : choice.candidates) {
    const StepReport* s = report_of(report.steps, c.step);
    const std::string why = s ? known_failure(c, *s) : "";
    if (why.empty()) {
      report.resume = c;
      break;
    }
    report.failing.push_back({c, why});
  }
}

}  // namespace

TierReport build_tier_report(checkpoint::Storage& storage, const std::string& durable_dir,
                             const std::vector<std::string>& local_dirs,
                             const TierReportOptions& options) {
  TierReport report;
  report.durable_dir = durable_dir;
  report.verified = options.verify;
  const std::vector<CheckpointStatusEntry> listed =
      checkpoint::list_checkpoints_with_status(storage, durable_dir);
  for (size_t k = 0; k < local_dirs.size(); ++k) {
    report.nodes.push_back(inventory_node(storage, local_dirs[k], static_cast<int>(k)));
  }

  // The durable listing resume sees (list_checkpoints): the step directories.
  std::vector<CheckpointEntry> durable;
  std::set<int64_t, std::greater<int64_t>> steps;
  for (const CheckpointStatusEntry& e : listed) {
    steps.insert(e.entry.step);
    if (e.status != CheckpointStatus::kSetAside) durable.push_back(e.entry);
  }
  for (const NodeTier& n : report.nodes) {
    for (const LocalStep& s : n.inventory.steps) steps.insert(s.step);
  }
  for (int64_t step : steps) {
    report.steps.push_back(report_step(storage, step, listed, durable, report.nodes, options));
  }
  for (const StepReport& s : report.steps) collect_damage(s, report.damage);
  choose_resume(report, durable);
  return report;
}

}  // namespace tools
