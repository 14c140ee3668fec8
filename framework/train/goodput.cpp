#include "framework/train/goodput.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <ctime>

namespace framework::train {

double parse_utc_timestamp(const std::string& text) {
  std::tm tm{};
  int ms = 0, used = 0;
  if (std::sscanf(text.c_str(), "%4d-%2d-%2dT%2d:%2d:%2d.%3dZ%n", &tm.tm_year, &tm.tm_mon, &tm.tm_mday, &tm.tm_hour,
                  &tm.tm_min, &tm.tm_sec, &ms, &used) != 7 ||
      static_cast<size_t>(used) != text.size()) {
    return -1;
  }
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  return static_cast<double>(timegm(&tm)) + ms / 1000.0;
}

namespace {

// The latest attempt's steps, for its last step and mean step time.
struct AttemptSteps {
  int64_t start_step = 0;
  int64_t last_step = -1;
  double step_s_sum = 0;
  int64_t count = 0;
};

}  // namespace

EarlierAttempts read_earlier_attempts(std::istream& in) {
  EarlierAttempts out;
  AttemptSteps latest;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("time") || !j["time"].is_string()) continue;
    const double t = parse_utc_timestamp(j["time"].get<std::string>());
    if (t < 0) continue;
    const std::string event = j.value("event", "");
    if (event == "start") {
      if (!out.any) out = EarlierAttempts{true, t};
      latest = AttemptSteps{j.value("step", int64_t{0})};
    }
    if (!out.any) continue;  // a record before any start (none are written so)
    out.last_record_unix_s = t;
    if (event.empty() && j.contains("step")) {
      latest.last_step = std::max(latest.last_step, j["step"].get<int64_t>());
      latest.step_s_sum += j.value("step_time_s", 0.0);
      ++latest.count;
    } else if (event == "restart") {
      ++out.restarts;
      out.lost_s += j.value("lost_s", 0.0);
      out.redone_s += j.value("redone_s", 0.0);
    } else if (event == "end" && j.value("status", "") == "finished") {
      out = EarlierAttempts{};
    }
  }
  if (out.any) {
    out.last_step = latest.last_step >= 0 ? latest.last_step : latest.start_step;
    out.mean_step_s = latest.count > 0 ? latest.step_s_sum / static_cast<double>(latest.count) : 0.0;
  }
  return out;
}

RestartLedger restart_ledger(const EarlierAttempts& earlier, int64_t resumed_step, double now_unix_s) {
  RestartLedger r;
  r.restart = earlier.restarts + 1;
  r.step = resumed_step;
  r.lost_s = std::max(0.0, now_unix_s - earlier.last_record_unix_s);
  r.redone_steps = std::max<int64_t>(0, earlier.last_step - resumed_step);
  r.redone_s = static_cast<double>(r.redone_steps) * earlier.mean_step_s;
  r.run_wall_s = std::max(0.0, now_unix_s - earlier.first_start_unix_s);
  const double unproductive = earlier.lost_s + earlier.redone_s + r.lost_s + r.redone_s;
  r.goodput = r.run_wall_s > 0 ? std::clamp((r.run_wall_s - unproductive) / r.run_wall_s, 0.0, 1.0) : 1.0;
  return r;
}

}  // namespace framework::train
