#pragma once
// Helpers for tests that train and checkpoint: a trainer's full (unsharded)
// state, every item of a committed checkpoint, and the `train` binary run as
// a user runs it with the losses it logged.
#include "checkpoint/load.h"
#include "checkpoint/format/metadata.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/sharded_adamw.h"
#include "framework/train/trainer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <torch/torch.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace testing_support {

// Full model parameters and optimizer moments by item name, on the host,
// plus the optimizer steps. Collective: every rank calls it.
using FullState = std::map<std::string, torch::Tensor>;

inline FullState gather_full_state(framework::train::Trainer& t) {
  FullState out;
  auto& model = t.model();
  auto names = model.param_names();
  for (size_t i = 0; i < names.size(); ++i) {
    out["model." + names[i]] = model.param_dtensor(i).full_tensor().to(torch::kCPU);
    auto st = t.optimizer().state(i);
    out["optim." + names[i] + ".exp_avg"] = st.exp_avg.full_tensor().to(torch::kCPU);
    out["optim." + names[i] + ".exp_avg_sq"] = st.exp_avg_sq.full_tensor().to(torch::kCPU);
    out["optim." + names[i] + ".step"] = torch::tensor({st.step});
  }
  return out;
}

inline void expect_same_state(const FullState& a, const FullState& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    ASSERT_NE(it, b.end()) << what << ": missing " << name;
    EXPECT_TRUE(torch::equal(t, it->second)) << what << ": " << name << " differs";
  }
}

// Everything stored in a committed checkpoint but the "config" item (it
// records the saving mode, which tests vary on purpose), read back whole on
// one rank: item name -> bytes.
inline std::map<std::string, std::vector<uint8_t>> read_checkpoint_items(const std::string& path) {
  auto meta = checkpoint::read_committed_metadata(*checkpoint::posix_storage(), path);
  checkpoint::StateDict sd;
  for (const auto& item : meta.items) {
    if (item.name == "config") continue;
    if (item.kind == checkpoint::ItemKind::kBytes) {
      sd.add_bytes(item.name, {});
    } else {
      sd.add_tensor(item.name, torch::empty(item.global_shape, checkpoint::to_scalar_type(item.dtype)));
    }
  }
  checkpoint::LoadOptions lo;
  lo.filter = [](const std::string& n) { return n != "config"; };
  checkpoint::load_state_dict(sd, path, lo);
  std::map<std::string, std::vector<uint8_t>> out;
  for (const auto& b : sd.bytes()) out[b.name] = b.data;
  for (const auto& t : sd.tensors()) {
    const uint8_t* p = static_cast<const uint8_t*>(t.local.data_ptr());
    out[t.name] = std::vector<uint8_t>(p, p + t.local.numel() * t.local.element_size());
  }
  return out;
}

struct CliResult {
  int status = -1;
  std::string output;  // stdout and stderr
};

// Runs `<train> args` through the shell and waits for it.
inline CliResult run_train_binary(const std::string& train, const std::string& args) {
  std::string cmd = train + " " + args + " 2>&1";
  CliResult r;
  FILE* p = popen(cmd.c_str(), "r");
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  int raw = pclose(p);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  return r;
}

// step -> loss as run_dir/metrics.jsonl records it (later lines win).
inline std::map<int64_t, double> logged_losses(const std::string& run_dir) {
  std::map<int64_t, double> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return out;
}

}  // namespace testing_support
