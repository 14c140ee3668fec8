// fully_shard on a module that is not one of ours: units by name, the
// model's own forward with run_unit, parameters of two dtypes, frozen
// parameters (in the root and inside a unit), a parameter tied across the
// root and a unit, and a buffer. Every gradient matches the same module
// run unsharded on the whole batch, under FSDP, HSDP and DDP over real Gloo
// groups; what cannot be sharded is refused by name.
#include "comm/torch_compat.h"  // the c10d headers, with Gloo enabled
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include "framework/dtensor/device_mesh.h"
#include "framework/fsdp/fully_shard.h"
#include "support/multi_rank.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fsdp = framework::fsdp;
using testing_support::run_runtimes;

namespace {

constexpr int64_t kDim = 6;

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(torch::Dtype gain_dtype, torch::Tensor shared) : shared_(shared) {
    lin = register_module("lin", torch::nn::Linear(kDim, kDim));
    gain = register_parameter("gain", torch::rand({kDim}, gain_dtype) + 0.5);
    if (shared.defined()) register_parameter("shared", shared);  // tied with the root's
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = torch::tanh(lin(x)) * gain.to(x.dtype());
    return shared_.defined() ? h.matmul(shared_) : h;
  }
  torch::nn::Linear lin{nullptr};
  torch::Tensor gain;

 private:
  torch::Tensor shared_;
};
TORCH_MODULE(Block);

class ToyImpl : public torch::nn::Module {
 public:
  explicit ToyImpl(bool use_run_unit = true) : use_run_unit_(use_run_unit) {
    shared = register_parameter("shared", torch::randn({kDim, kDim}) * 0.3);
    inp = register_module("inp", torch::nn::Linear(kDim, kDim));
    frozen = register_module("frozen", torch::nn::Linear(kDim, kDim));
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
    blocks = register_module("blocks", torch::nn::ModuleList());
    blocks->push_back(Block(torch::kFloat, shared));
    blocks->push_back(Block(torch::kDouble, torch::Tensor()));
    blocks[0]->as<Block>()->lin->bias.set_requires_grad(false);  // frozen inside a unit
    scale = register_buffer("scale", torch::full({kDim}, 0.5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = frozen(inp(x));
    for (const auto& b : *blocks) {
      auto call = [&] { return b->as<Block>()->forward(h); };
      h = use_run_unit_ ? fsdp::run_unit(*b, call) : call();
    }
    return h * scale;
  }
  torch::Tensor shared;
  torch::nn::Linear inp{nullptr}, frozen{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::Tensor scale;

 private:
  bool use_run_unit_;
};
TORCH_MODULE(Toy);

Toy make_toy(bool use_run_unit = true) {
  static std::mutex mu;  // ranks are threads: one generator
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(5);
  return Toy(use_run_unit);
}

torch::Tensor batch(int64_t rows) {
  torch::Generator gen = at::detail::createCPUGenerator(17);
  return torch::randn({rows, kDim}, gen);
}

// Rank r takes chunk r of a 12-row batch; the gradients, summed over the
// ranks by FSDP, must be those of the unsharded model on the whole batch.
void expect_gradients_match_unsharded(int world, std::vector<int64_t> mesh_shape,
                                      std::vector<std::string> units) {
  run_runtimes(world, [&](comm::Runtime& rt) {
    Toy ref = make_toy();
    (ref->forward(batch(12)).pow(2).sum()).backward();
    std::map<std::string, torch::Tensor> ref_grads;
    for (const auto& p : ref->named_parameters()) ref_grads[p.key()] = p.value().grad();

    Toy toy = make_toy();
    {
      torch::NoGradGuard no_grad;
      toy->scale.fill_(0.5 + rt.env.rank);  // rank 0's value wins the broadcast
    }
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, mesh_shape,
                                                       {"replicate", "shard"});
    auto sharded = fsdp::fully_shard(toy.ptr(), mesh, {}, units);
    torch::Tensor x = batch(12).chunk(world)[rt.env.rank];
    sharded->forward([&] { return toy->forward(x); }).pow(2).sum().backward();
    sharded->finish_backward();

    EXPECT_TRUE(torch::equal(toy->scale, torch::full({kDim}, 0.5))) << "buffer not broadcast";
    const std::vector<std::string> names = sharded->param_names();
    EXPECT_EQ(std::count(names.begin(), names.end(), "blocks.0.shared"), 0)
        << "a tied parameter appears once, under its first name";
    EXPECT_EQ(names.size(), ref_grads.size() - 1);
    for (size_t i = 0; i < names.size(); ++i) {
      const torch::Tensor local = sharded->local_params()[i];
      const torch::Tensor& want = ref_grads.at(names[i]);
      if (!sharded->param_trainable(i)) {
        EXPECT_FALSE(want.defined()) << names[i];
        EXPECT_FALSE(local.grad().defined()) << names[i] << " is frozen but got a gradient";
        continue;
      }
      ASSERT_TRUE(local.grad().defined()) << names[i] << " got no gradient";
      EXPECT_EQ(local.grad().scalar_type(), want.scalar_type()) << names[i];
      const torch::Tensor got = sharded->like_param(i, local.grad()).full_tensor();
      EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6))
          << names[i] << " differs by " << (got - want).abs().max().item<double>();
    }
    const std::vector<torch::Tensor> buffers = {toy->scale};
    EXPECT_EQ(sharded->buffers().size(), 1u);
  });
}

TEST(FullyShard, GradientsMatchTheUnshardedModuleUnderFsdp) {
  expect_gradients_match_unsharded(3, {1, 3}, {"blocks.0", "blocks.1"});
}

TEST(FullyShard, GradientsMatchTheUnshardedModuleUnderHsdp) {
  expect_gradients_match_unsharded(4, {2, 2}, fsdp::children_of(*make_toy(), "blocks"));
}

TEST(FullyShard, GradientsMatchTheUnshardedModuleUnderDdp) {
  expect_gradients_match_unsharded(2, {2, 1}, {"blocks.0", "blocks.1"});
}

// No units: the root is the whole model and run_unit is a plain call.
TEST(FullyShard, WithoutUnitsTheWholeModelIsTheRootUnit) {
  expect_gradients_match_unsharded(2, {1, 2}, {});
}

TEST(FullyShard, UnitsAreNamedByChildrenOrPredicate) {
  Toy toy = make_toy();
  EXPECT_EQ(fsdp::children_of(*toy, "blocks"), (std::vector<std::string>{"blocks.0", "blocks.1"}));
  EXPECT_EQ(fsdp::modules_where(*toy,
                                [](const std::string&, const torch::nn::Module& m) {
                                  return dynamic_cast<const torch::nn::LinearImpl*>(&m) != nullptr;
                                }),
            (std::vector<std::string>{"inp", "frozen", "blocks.0.lin", "blocks.1.lin"}));
  // The outermost match wins: nothing inside a matched block is visited.
  EXPECT_EQ(fsdp::modules_where(*toy,
                                [](const std::string& name, const torch::nn::Module&) {
                                  return name.rfind("blocks.", 0) == 0;
                                }),
            (std::vector<std::string>{"blocks.0", "blocks.1"}));
  EXPECT_THROW(fsdp::children_of(*toy, "layers"), std::invalid_argument);
}

template <class Fn>
std::string fsdp_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(FullyShard, RefusesWhatItCannotShardNamingIt) {
  run_runtimes(2, [&](comm::Runtime& rt) {
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {1, 2}, {"replicate", "shard"});
    EXPECT_NE(fsdp_error_of([&] { fsdp::fully_shard(make_toy().ptr(), mesh, {}, {"blocks.7"}); })
                  .find("unit 'blocks.7' is not a submodule"),
              std::string::npos);
    EXPECT_NE(fsdp_error_of([&] { fsdp::fully_shard(make_toy().ptr(), mesh, {}, {"blocks", "blocks.0"}); })
                  .find("overlap"),
              std::string::npos);
    Toy scalar = make_toy();
    scalar->register_parameter("temperature", torch::tensor(1.0));
    const std::string err = fsdp_error_of([&] { fsdp::fully_shard(scalar.ptr(), mesh, {}, {}); });
    EXPECT_NE(err.find("temperature"), std::string::npos) << err;
    EXPECT_NE(err.find("0-d"), std::string::npos) << err;
  });
}

// A forward that calls a unit without run_unit reads parameters that are
// not there: one error naming the units and the fix, no crash.
TEST(FullyShard, AUnitCalledWithoutRunUnitIsAClearError) {
  run_runtimes(2, [&](comm::Runtime& rt) {
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {1, 2}, {"replicate", "shard"});
    Toy toy = make_toy(/*use_run_unit=*/false);
    auto sharded = fsdp::fully_shard(toy.ptr(), mesh, {}, {"blocks.0", "blocks.1"});
    const std::string err = fsdp_error_of([&] { sharded->forward([&] { return toy->forward(batch(2)); }); });
    EXPECT_NE(err.find("run_unit"), std::string::npos) << err;
    EXPECT_NE(err.find("blocks.0, blocks.1"), std::string::npos) << err;
  });
}

// Plugging in a process group the user made: their own store and
// c10d::ProcessGroupGloo, wrapped as a Group, a mesh over it, FSDP on top.
TEST(FullyShard, RunsOverTheUsersOwnC10dProcessGroup) {
  constexpr int kWorld = 2;
  auto store = c10::make_intrusive<c10d::HashStore>();  // the user's store, shared by the threads
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kWorld; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        // The user's code: a Gloo process group of their own.
        auto opts = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(30));
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, kWorld, opts);

        auto group = comm::wrap_c10d_backend(pg, "users_group");
        EXPECT_EQ(group->rank(), rank);
        EXPECT_EQ(group->backend_name(), "gloo");
        auto mesh = framework::dtensor::DeviceMesh::from_groups({1, kWorld}, {"replicate", "shard"},
                                                                {nullptr, group});
        EXPECT_EQ(mesh->global_rank(), rank);

        Toy ref = make_toy();
        ref->forward(batch(12)).pow(2).sum().backward();
        Toy toy = make_toy();
        auto sharded = fsdp::fully_shard(toy.ptr(), mesh, {}, {"blocks.0", "blocks.1"});
        torch::Tensor x = batch(12).chunk(kWorld)[rank];
        sharded->forward([&] { return toy->forward(x); }).pow(2).sum().backward();
        sharded->finish_backward();
        const std::vector<std::string> names = sharded->param_names();
        for (size_t i = 0; i < names.size(); ++i) {
          if (!sharded->param_trainable(i)) continue;
          const torch::Tensor got =
              sharded->like_param(i, sharded->local_params()[i].grad()).full_tensor();
          EXPECT_TRUE(torch::allclose(got, ref->named_parameters()[names[i]].grad(), 1e-5, 1e-6))
              << names[i];
        }
        EXPECT_THROW(mesh->group(0), c10::Error);  // extent 1, no group
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int rank = 0; rank < kWorld; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;

  // What is not a c10d backend is refused by name.
  auto not_a_group = c10::make_intrusive<c10d::HashStore>();
  EXPECT_THROW(comm::wrap_c10d_backend(not_a_group, "bad"), std::invalid_argument);
}

}  // namespace

// Overlap (parallel.prefetch): the schedule of collectives one step leaves
// on a rank, read from FullyShardedModel::schedule(). What the CUDA path's
// streams rely on is this order: a collective is issued (on its channel's
// group, hence stream) before the compute it overlaps, and waited for only
// after it.
namespace {

class ChainImpl : public torch::nn::Module {
 public:
  ChainImpl() {
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < 4; ++i) layers->push_back(torch::nn::Linear(kDim, kDim));
  }
  torch::Tensor forward(torch::Tensor h) {
    for (const auto& l : *layers) {
      h = fsdp::run_unit(*l, [&] { return torch::tanh(l->as<torch::nn::Linear>()->forward(h)); });
    }
    return h;
  }
  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(Chain);

struct ScheduleRun {
  std::vector<std::string> schedule;          // of the second step
  std::vector<torch::Tensor> grads;           // this rank's shard gradients
  int64_t peak = 0, unit_bytes = 0;
};

// Two steps on a {2, 2} HSDP mesh (all-gathers and reduce-scatters over the
// shard axis, all-reduces over the replicate axis), on rank `rank`.
ScheduleRun run_chain(comm::Runtime& rt, int64_t prefetch) {
  auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {2, 2}, {"replicate", "shard"},
                                                     "mesh_p" + std::to_string(prefetch),
                                                     prefetch > 0 ? 2 : 1);
  Chain chain{nullptr};  // (a default-constructed holder would draw from the generator unlocked)
  {
    static std::mutex mu;  // ranks are threads: one generator
    std::lock_guard<std::mutex> lock(mu);
    torch::manual_seed(11);
    chain = Chain();
  }
  fsdp::FsdpOptions options;
  options.prefetch = prefetch;
  auto sharded = fsdp::fully_shard(chain.ptr(), mesh, options, fsdp::children_of(*chain, "layers"));
  ScheduleRun out;
  for (int step = 0; step < 2; ++step) {
    sharded->zero_grad();
    sharded->clear_schedule();
    sharded->set_schedule_logging(step == 1);
    sharded->reset_peak_memory();
    torch::Tensor x = batch(8).chunk(4)[rt.env.rank] * (step + 1);
    sharded->forward([&] { return chain->forward(x); }).pow(2).sum().backward();
    sharded->finish_backward();
  }
  out.schedule = sharded->schedule();
  for (const torch::Tensor& p : sharded->local_params()) out.grads.push_back(p.grad().clone());
  out.peak = sharded->memory_stats().peak_gathered_bytes;
  out.unit_bytes = sharded->memory_stats().largest_unit_bytes;
  return out;
}

// Position of the n-th (0-based) entry equal to `what`; fails the test when absent.
size_t pos(const std::vector<std::string>& s, const std::string& what, int nth = 0) {
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == what && nth-- == 0) return i;
  }
  ADD_FAILURE() << "no '" << what << "' in the schedule";
  return s.size();
}

std::string unit(int k) { return "layers." + std::to_string(k); }

std::string joined(const std::vector<std::string>& s) {
  std::string out;
  for (const std::string& e : s) out += e + "\n";
  return out;
}

}  // namespace

TEST(FsdpPrefetch, GathersRunAheadAndReductionsStayInFlightWithBitIdenticalGradients) {
  run_runtimes(4, [&](comm::Runtime& rt) {
    const ScheduleRun off = run_chain(rt, 0);
    const ScheduleRun on = run_chain(rt, 1);
    const std::vector<std::string>& s = on.schedule;
    SCOPED_TRACE("prefetch 1 schedule:\n" + joined(s));
    // Forward: unit k+1's all-gather is issued before unit k runs and
    // waited for after it started.
    for (int k = 0; k < 3; ++k) {
      EXPECT_LT(pos(s, "gather.issue " + unit(k + 1)), pos(s, "forward " + unit(k))) << k;
      EXPECT_GT(pos(s, "gather.wait " + unit(k + 1)), pos(s, "forward " + unit(k))) << k;
    }
    // The forward's last unit stays gathered for its backward, which comes first.
    EXPECT_EQ(std::count(s.begin(), s.end(), "gather.issue " + unit(3)), 1);
    // Backward: unit k-1's all-gather goes out before unit k's gradients are
    // reduced; unit k's reduce-scatter and all-reduce are in flight while
    // unit k-1's backward runs, and waited for before unit k-1's go out.
    for (int k = 3; k >= 1; --k) {
      const size_t backward_prev = pos(s, "backward " + unit(k - 1));
      EXPECT_LT(pos(s, "gather.issue " + unit(k - 1), 1), pos(s, "reduce.issue " + unit(k))) << k;
      EXPECT_LT(pos(s, "reduce.issue " + unit(k)), backward_prev) << k;
      EXPECT_GT(pos(s, "reduce.wait " + unit(k)), backward_prev) << k;
      EXPECT_LT(pos(s, "reduce.wait " + unit(k)), pos(s, "reduce.issue " + unit(k - 1))) << k;
      EXPECT_GT(pos(s, "allreduce.wait " + unit(k)), backward_prev) << k;
    }
    EXPECT_EQ(s.back(), "allreduce.wait " + unit(0));

    // Prefetch 0: every collective is waited for right where it is issued.
    const std::vector<std::string>& t = off.schedule;
    ASSERT_FALSE(t.empty());
    for (size_t i = 0; i < t.size(); ++i) {
      for (const char* kind : {"gather", "reduce", "allreduce"}) {
        const std::string issue = std::string(kind) + ".issue ";
        if (t[i].rfind(issue, 0) != 0) continue;
        ASSERT_LT(i + 1, t.size());
        const std::string wait = std::string(kind) + ".wait " + t[i].substr(issue.size());
        const bool next = t[i + 1] == wait ||
                          (kind == std::string("reduce") && i + 2 < t.size() && t[i + 2] == wait);
        EXPECT_TRUE(next) << "prefetch 0: '" << t[i] << "' not waited for at once:\n" << joined(t);
      }
    }
    // Same collectives, same reduction order: the same bits.
    ASSERT_EQ(on.grads.size(), off.grads.size());
    for (size_t i = 0; i < on.grads.size(); ++i) {
      EXPECT_TRUE(torch::equal(on.grads[i], off.grads[i]))
          << "parameter " << i << " differs by " << (on.grads[i] - off.grads[i]).abs().max().item<double>();
    }
    // Gathered memory: one unit's parameters and gradients without
    // prefetch; with it, one more gathered ahead and one reduction in flight.
    EXPECT_LE(off.peak, 2 * off.unit_bytes);
    EXPECT_LE(on.peak, 4 * on.unit_bytes);
    EXPECT_GT(on.peak, 2 * on.unit_bytes);
  });
}
