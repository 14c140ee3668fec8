#pragma once
// Expert parallelism (parallel.expert, docs/moe.md): a mixture of experts'
// routed experts split over the expert axis of the layout, which borrows
// its ranks from the shard axis (shard = expert_shard x expert, as
// torchtitan's dp_shard = efsdp x ep). Each rank keeps num_experts /
// expert of them (rows of the stacked expert tensors, so a checkpoint
// still holds expert e at row e); FSDP shards those rows over the
// expert_shard group (fsdp::FsdpOptions::expert_parallel).
//
// A layer's forward sends each routed token to the rank of its expert and
// the expert's output back, by two all-to-alls over the expert axis (Gloo
// on the CPU, NCCL on CUDA); their backward is the same exchange reversed.
// Before them, one all-to-all of per-expert counts tells each rank how
// many rows it gets for each of its experts.
//
//   const ep::ExpertParallelLayout ep = ep::parallelize_experts(*model, meshes.expert);
//   init = ep::expert_init(ep, init);            // a model built unmaterialised
//   fsdp_options.expert_parallel = {meshes.expert, ep.params};
#include "framework/dtensor/device_mesh.h"

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace framework::ep {

struct ExpertParallelLayout {
  // Every expert parameter by name, with the whole (all experts) shape.
  std::unordered_map<std::string, std::vector<int64_t>> params;
  int64_t size = 1;  // expert-parallel ranks
  int64_t rank = 0;  // this rank's coordinate on the expert axis
  // Seconds this rank spent in the layers' all-to-alls so far, forward and
  // backward (the counts' exchange too); on NCCL, the time to enqueue them.
  std::shared_ptr<double> all_to_all_seconds = std::make_shared<double>(0.0);
};

// Makes every mixture-of-experts layer under `module` keep its experts
// [rank x E / size, (rank + 1) x E / size) and dispatch through the expert
// axis (axis 2) of `mesh` ({replicate, expert_shard, expert[, tensor]};
// parallel::Meshes::expert). Throws std::invalid_argument when the axis
// does not divide a layer's experts, naming both.
ExpertParallelLayout parallelize_experts(torch::nn::Module& module, std::shared_ptr<dtensor::DeviceMesh> mesh);

// An initialiser for a model whose expert parameters have no storage: it
// builds the whole parameter, has `full_init` fill it and keeps this rank's
// experts (other parameters go to full_init as they are).
using FullInit = std::function<void(const std::string& name, const torch::Tensor& full)>;
FullInit expert_init(const ExpertParallelLayout& layout, FullInit full_init);

// Rows of `input` to the members of `group`: in_splits[i] rows to member i;
// out_splits[i] rows from member i. Differentiable: the gradient goes back
// by the reverse exchange.
// `seconds` (optional) adds the time of both exchanges.
torch::Tensor all_to_all(const torch::Tensor& input, const std::vector<int64_t>& out_splits,
                         const std::vector<int64_t>& in_splits, comm::Group& group, double* seconds = nullptr);

}  // namespace framework::ep
