#include "framework/pp/schedule.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>

namespace framework::pp {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

Action forward(int64_t stage, int64_t micro) { return {Action::Kind::kForward, stage, micro}; }
Action backward(int64_t stage, int64_t micro) { return {Action::Kind::kBackward, stage, micro}; }

// Megatron's interleaved order: the k-th forward (or backward) of a rank
// runs chunk (k / P) mod V (backward: counted from the last chunk) on
// micro-batch (k / (P V)) P + k mod P.
Action interleaved(bool is_forward, int64_t k, int64_t ranks, int64_t rank, int64_t chunks) {
  int64_t chunk = (k / ranks) % chunks;
  if (!is_forward) chunk = chunks - 1 - chunk;
  const int64_t micro = (k / (ranks * chunks)) * ranks + k % ranks;
  const int64_t stage = chunk * ranks + rank;
  return is_forward ? forward(stage, micro) : backward(stage, micro);
}

}  // namespace

void check_schedule(Schedule schedule, int64_t ranks, int64_t stages_per_rank, int64_t micro_batches) {
  const std::string name = std::string("parallel.pipeline_schedule ") + to_string(schedule);
  if (ranks < 1 || stages_per_rank < 1 || micro_batches < 1) {
    throw std::invalid_argument(name + ": needs parallel.pipeline, parallel.stages_per_rank and the micro-batches >= 1");
  }
  if (schedule == Schedule::kInterleaved1F1B) {
    if (stages_per_rank < 2) {
      throw std::invalid_argument(name + " needs parallel.stages_per_rank > 1, got " + str(stages_per_rank));
    }
    if (micro_batches % ranks != 0) {
      throw std::invalid_argument(name + " needs the micro-batches per step (" + str(micro_batches) +
                                  ", from train.micro_batch_size) to be a multiple of parallel.pipeline (" +
                                  str(ranks) + ")");
    }
    return;
  }
  if (stages_per_rank != 1) {
    throw std::invalid_argument(name + " runs one stage per rank: parallel.stages_per_rank must be 1, got " +
                                str(stages_per_rank) + " (interleaved_1f1b takes more)");
  }
  if (schedule == Schedule::k1F1B && micro_batches < ranks) {
    throw std::invalid_argument(name + " needs at least parallel.pipeline (" + str(ranks) +
                                ") micro-batches per step, got " + str(micro_batches) +
                                " (set train.micro_batch_size to the local batch / " + str(ranks) +
                                " or less)");
  }
}

std::vector<Action> schedule_actions(Schedule schedule, int64_t ranks, int64_t rank, int64_t stages_per_rank,
                                     int64_t micro_batches) {
  const int64_t m = micro_batches;
  std::vector<Action> out;
  switch (schedule) {
    case Schedule::kGpipe: {
      for (int64_t i = 0; i < m; ++i) out.push_back(forward(rank, i));
      for (int64_t i = 0; i < m; ++i) out.push_back(backward(rank, i));
      break;
    }
    case Schedule::k1F1B: {
      const int64_t warmup = std::min(ranks - 1 - rank, m);
      for (int64_t i = 0; i < warmup; ++i) out.push_back(forward(rank, i));
      for (int64_t i = 0; i < m - warmup; ++i) {
        out.push_back(forward(rank, warmup + i));
        out.push_back(backward(rank, i));
      }
      for (int64_t i = m - warmup; i < m; ++i) out.push_back(backward(rank, i));
      break;
    }
    case Schedule::kInterleaved1F1B: {
      const int64_t v = stages_per_rank;
      const int64_t total = m * v;
      const int64_t warmup = std::min(total, (ranks - rank - 1) * 2 + (v - 1) * ranks);
      for (int64_t k = 0; k < warmup; ++k) out.push_back(interleaved(true, k, ranks, rank, v));
      for (int64_t k = 0; k < total - warmup; ++k) {
        out.push_back(interleaved(true, warmup + k, ranks, rank, v));
        out.push_back(interleaved(false, k, ranks, rank, v));
      }
      for (int64_t k = total - warmup; k < total; ++k) out.push_back(interleaved(false, k, ranks, rank, v));
      break;
    }
  }
  return out;
}

int64_t peak_in_flight(const std::vector<Action>& actions) {
  std::map<int64_t, int64_t> live;
  int64_t peak = 0;
  for (const Action& a : actions) {
    int64_t& n = live[a.stage];
    n += a.kind == Action::Kind::kForward ? 1 : -1;
    peak = std::max(peak, n);
  }
  return peak;
}

std::vector<StageSpan> split_blocks(const std::vector<std::string>& blocks, int64_t stages,
                                    const std::string& split_points) {
  const int64_t n = static_cast<int64_t>(blocks.size());
  std::vector<std::string> points;
  {
    std::stringstream in(split_points);
    std::string item;
    while (std::getline(in, item, ',')) {
      const size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
      if (a != std::string::npos) points.push_back(item.substr(a, b - a + 1));
    }
  }
  if (n < stages) {
    throw std::invalid_argument("model.n_layers (" + str(n) + " blocks) is below the pipeline's " + str(stages) +
                                " stages (parallel.pipeline x parallel.stages_per_rank): every stage needs a block");
  }
  std::vector<StageSpan> out;
  if (points.empty()) {
    int64_t first = 0;
    for (int64_t s = 0; s < stages; ++s) {
      const int64_t size = n / stages + (s < n % stages ? 1 : 0);
      out.push_back({first, first + size});
      first += size;
    }
    return out;
  }
  if (static_cast<int64_t>(points.size()) != stages - 1) {
    throw std::invalid_argument("parallel.pipeline_split_points names " + str(static_cast<int64_t>(points.size())) +
                                " blocks; " + str(stages) + " stages need " + str(stages - 1));
  }
  int64_t first = 0;
  for (const std::string& p : points) {
    auto it = std::find(blocks.begin(), blocks.end(), p);
    if (it == blocks.end()) {
      throw std::invalid_argument("parallel.pipeline_split_points: '" + p + "' names no block (" + blocks.front() +
                                  " ... " + blocks.back() + ")");
    }
    const int64_t at = it - blocks.begin();
    if (at <= first) {
      throw std::invalid_argument("parallel.pipeline_split_points: '" + p +
                                  "' leaves a stage without blocks (points must be in model order, after " +
                                  blocks.front() + ")");
    }
    out.push_back({first, at});
    first = at;
  }
  out.push_back({first, n});
  return out;
}

}  // namespace framework::pp
