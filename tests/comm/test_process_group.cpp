// Collectives over real Gloo groups, 2-4 ranks as threads on loopback.
#include "comm/process_group.h"
#include "support/multi_rank.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <condition_variable>
#include <mutex>

using comm::DistError;
using comm::Group;
using comm::ReduceOp;
using testing_support::RankContext;
using testing_support::run_ranks;

class CollectivesAcrossWorlds : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesAcrossWorlds, AllReduceSumsAndAverages) {
  int world = GetParam();
  run_ranks(world, [&](RankContext& ctx) {
    auto g = ctx.make_group("train");
    at::Tensor t = at::full({5}, static_cast<double>(ctx.rank + 1), at::kDouble);
    g->all_reduce(t, ReduceOp::kSum);
    double expected = world * (world + 1) / 2.0;
    EXPECT_TRUE(at::allclose(t, at::full({5}, expected, at::kDouble)));
    at::Tensor a = at::full({3}, static_cast<float>(ctx.rank), at::kFloat);
    g->all_reduce(a, ReduceOp::kAvg);
    EXPECT_FLOAT_EQ(a[0].item<float>(), (world - 1) / 2.0f);
    at::Tensor m = at::tensor({static_cast<int64_t>(ctx.rank)}, at::kLong);
    g->all_reduce(m, ReduceOp::kMax);
    EXPECT_EQ(m.item<int64_t>(), world - 1);
  });
}

TEST_P(CollectivesAcrossWorlds, AllGatherConcatenatesInRankOrder) {
  int world = GetParam();
  run_ranks(world, [&](RankContext& ctx) {
    auto g = ctx.make_group("train");
    at::Tensor in = at::arange(4, at::kFloat) + 10 * ctx.rank;
    at::Tensor out = at::empty({4 * world}, at::kFloat);
    g->all_gather(out, in);
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(at::equal(out.narrow(0, 4 * r, 4), at::arange(4, at::kFloat) + 10 * r));
    }
  });
}

TEST_P(CollectivesAcrossWorlds, ReduceScatterGivesEachRankTheSumOfItsSlice) {
  int world = GetParam();
  run_ranks(world, [&](RankContext& ctx) {
    auto g = ctx.make_group("train");
    // Member r contributes (r+1) * [0, 1, ..., 3*world-1].
    at::Tensor in = at::arange(3 * world, at::kDouble) * (ctx.rank + 1);
    at::Tensor out = at::empty({3}, at::kDouble);
    g->reduce_scatter(out, in, ReduceOp::kSum);
    double factor = world * (world + 1) / 2.0;
    at::Tensor expected = at::arange(3 * ctx.rank, 3 * ctx.rank + 3, at::kDouble) * factor;
    EXPECT_TRUE(at::allclose(out, expected)) << out << expected;
    g->reduce_scatter(out, in, ReduceOp::kAvg);
    EXPECT_TRUE(at::allclose(out, expected / world));
  });
}

TEST_P(CollectivesAcrossWorlds, BroadcastAndBytePayloadsReachEveryRank) {
  int world = GetParam();
  run_ranks(world, [&](RankContext& ctx) {
    auto g = ctx.make_group("train");
    at::Tensor t = ctx.rank == 1 ? at::full({4}, 7, at::kInt) : at::zeros({4}, at::kInt);
    g->broadcast(t, 1);
    EXPECT_EQ(t.sum().item<int>(), 28);
    comm::Bytes mine(static_cast<size_t>(ctx.rank * 3), static_cast<uint8_t>(ctx.rank));
    auto all = g->all_gather_bytes(mine);
    ASSERT_EQ(static_cast<int>(all.size()), world);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(all[r], comm::Bytes(static_cast<size_t>(r * 3), static_cast<uint8_t>(r)));
    }
    comm::Bytes payload = {1, 2, 3, 250};
    auto got = g->broadcast_bytes(ctx.rank == 0 ? payload : comm::Bytes{}, 0);
    EXPECT_EQ(got, payload);
    g->barrier();
  });
}

// What a coordinator gathers and scatters: each member's own payload of any
// length (empty too), at a root other than 0, and nothing for the others.
TEST_P(CollectivesAcrossWorlds, GatherAndScatterBytesReachOnlyTheirMembers) {
  int world = GetParam();
  const int root = world - 1;
  auto payload = [](int r) {
    return comm::Bytes(static_cast<size_t>(r == 1 ? 0 : 5 + r * 7),
                                  static_cast<uint8_t>(40 + r));
  };
  run_ranks(world, [&](RankContext& ctx) {
    auto g = ctx.make_group("ckpt");
    auto gathered = g->gather_bytes(payload(ctx.rank), root);
    if (ctx.rank == root) {
      ASSERT_EQ(static_cast<int>(gathered.size()), world);
      for (int r = 0; r < world; ++r) EXPECT_EQ(gathered[r], payload(r)) << "from rank " << r;
    } else {
      EXPECT_TRUE(gathered.empty());
    }
    std::vector<comm::Bytes> out;
    if (ctx.rank == root) {
      for (int r = 0; r < world; ++r) out.push_back(payload(world - 1 - r));
    }
    EXPECT_EQ(g->scatter_bytes(out, root), payload(world - 1 - ctx.rank));
    g->barrier();
  });
}

// The *_async forms (what FSDP's prefetch issues): the blocking forms' bits,
// fp32 and bf16 (Gloo moves bf16 as fp16 bits and sums it in fp32 or
// after moving), with collectives on two groups over the same ranks in
// flight at once and waited for in the reverse order.
TEST_P(CollectivesAcrossWorlds, AsyncFormsGiveTheBlockingBitsWhileInFlightOnTwoGroups) {
  int world = GetParam();
  run_ranks(world, [&](RankContext& ctx) {
    auto gathers = ctx.make_group("gathers");
    auto reductions = ctx.make_group("reductions");
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      // Values whose sums round differently in different orders.
      at::Tensor in = (at::arange(6 * world, at::kFloat).sin() * (ctx.rank + 1.37)).to(dtype);
      at::Tensor mine = in.narrow(0, 0, 6).clone();
      at::Tensor gathered = at::empty({6 * world}, dtype);
      at::Tensor scattered = at::empty({6}, dtype);
      at::Tensor summed = in.clone();
      at::Tensor averaged = in.clone();
      comm::Work ag = gathers->all_gather_async(gathered, mine);
      comm::Work rs = reductions->reduce_scatter_async(scattered, in);
      comm::Work ar = reductions->all_reduce_async(summed);
      comm::Work avg = reductions->all_reduce_async(averaged, ReduceOp::kAvg);
      EXPECT_TRUE(ag.pending() && rs.pending() && ar.pending() && avg.pending());
      avg.wait();
      ar.wait();
      rs.wait();
      ag.wait();
      EXPECT_FALSE(ag.pending());
      ag.wait();  // a second wait is a no-op

      at::Tensor gathered_ref = at::empty({6 * world}, dtype);
      gathers->all_gather(gathered_ref, mine);
      at::Tensor scattered_ref = at::empty({6}, dtype);
      reductions->reduce_scatter(scattered_ref, in);
      at::Tensor summed_ref = in.clone();
      reductions->all_reduce(summed_ref);
      at::Tensor averaged_ref = in.clone();
      reductions->all_reduce(averaged_ref, ReduceOp::kAvg);
      const std::string what = std::string(dtype == at::kFloat ? "fp32" : "bf16");
      EXPECT_TRUE(at::equal(gathered, gathered_ref)) << what;
      EXPECT_TRUE(at::equal(scattered, scattered_ref)) << what;
      EXPECT_TRUE(at::equal(summed, summed_ref)) << what;
      EXPECT_TRUE(at::equal(averaged, averaged_ref)) << what;
      // And they are the right values: rank r's rows of the sum, in order.
      at::Tensor total = at::zeros({6 * world}, at::kFloat);
      for (int r = 0; r < world; ++r) {
        total += (at::arange(6 * world, at::kFloat).sin() * (r + 1.37)).to(dtype).to(at::kFloat);
      }
      EXPECT_TRUE(at::allclose(summed.to(at::kFloat), total, 2e-2, 2e-2)) << what;
      for (int r = 0; r < world; ++r) {
        at::Tensor theirs = (at::arange(6, at::kFloat).sin() * (r + 1.37)).to(dtype);
        EXPECT_TRUE(at::equal(gathered.narrow(0, 6 * r, 6), theirs)) << what << " member " << r;
      }
    }
  });
}

// Rows member `from` sends member `to` in the all-to-all test: uneven, and
// 0 for some pairs (a member's own rows included).
int64_t rows_between(int from, int to) { return (from + 2 * to) % 3; }

// Row k of what member `from` sends member `to`: [from, to, k] as values.
at::Tensor rows_sent(int from, int to, at::ScalarType dtype) {
  const int64_t n = rows_between(from, to);
  at::Tensor out = at::empty({n, 3}, at::kFloat);
  for (int64_t k = 0; k < n; ++k) {
    out[k][0] = from;
    out[k][1] = to;
    out[k][2] = k + 0.5;
  }
  return out.to(dtype);
}

TEST_P(CollectivesAcrossWorlds, AllToAllMovesUnevenSplitsInMemberOrder) {
  const int world = GetParam();
  run_ranks(world, [&](RankContext& ctx) {
    auto g = ctx.make_group("experts");
    std::vector<int64_t> send;
    for (int j = 0; j < world; ++j) send.push_back(rows_between(ctx.rank, j));
    const std::vector<int64_t> receive = g->all_to_all_counts(send);
    for (int i = 0; i < world; ++i) EXPECT_EQ(receive[i], rows_between(i, ctx.rank)) << "from member " << i;
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
      std::vector<at::Tensor> parts, expected_parts;
      for (int j = 0; j < world; ++j) parts.push_back(rows_sent(ctx.rank, j, dtype));
      for (int i = 0; i < world; ++i) expected_parts.push_back(rows_sent(i, ctx.rank, dtype));
      const at::Tensor in = at::cat(parts);
      const at::Tensor expected = at::cat(expected_parts);
      at::Tensor out = at::full({expected.size(0), 3}, -1, dtype);
      g->all_to_all(out, in, receive, send);
      EXPECT_TRUE(at::equal(out, expected)) << dtype << "\n" << out << "\n" << expected;
      // The async form, and back again: the inverse splits return every row
      // to its sender in its place (the expert layer's return trip).
      at::Tensor back = at::empty_like(in);
      comm::Work w = g->all_to_all_async(back, out, send, receive);
      w.wait();
      EXPECT_TRUE(at::equal(back, in)) << dtype;
    }
    // Nothing to move anywhere (no token routed to a remote expert).
    const std::vector<int64_t> none(world, 0);
    at::Tensor empty_in = at::empty({0, 3});
    at::Tensor empty_out = at::empty({0, 3});
    g->all_to_all(empty_out, empty_in, none, none);
    EXPECT_EQ(empty_out.size(0), 0);
    // Splits that do not add up to the tensors are refused before anything moves.
    at::Tensor in = at::zeros({2, 3});
    at::Tensor out = at::zeros({2, 3});
    std::vector<int64_t> wrong(world, 0);
    wrong[0] = 3;
    EXPECT_THROW(g->all_to_all(out, in, wrong, wrong), c10::Error);
    EXPECT_FALSE(g->broken());
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, CollectivesAcrossWorlds, ::testing::Values(2, 3, 4));

TEST(CheckpointGroup, RunsCollectivesFromABackgroundThreadWhileTrainingGroupIsBusy) {
  run_ranks(2, [&](RankContext& ctx) {
    auto train = ctx.make_group("train");
    auto ckpt = ctx.make_group("ckpt");
    std::atomic<int> ckpt_rounds{0};
    std::exception_ptr bg_error;
    std::thread background([&] {
      try {
        for (int i = 0; i < 100; ++i) {
          at::Tensor big = at::full({4096}, static_cast<float>(ctx.rank + i), at::kFloat);
          at::Tensor out = at::empty({4096 * 2}, at::kFloat);
          ckpt->all_gather(out, big);
          if (out[0].item<float>() != static_cast<float>(i) ||
              out[4096].item<float>() != static_cast<float>(1 + i)) {
            throw std::runtime_error("checkpoint group all_gather returned wrong data");
          }
          if (i % 10 == 0) ckpt->barrier();
          ckpt_rounds.fetch_add(1);
        }
      } catch (...) {
        bg_error = std::current_exception();
      }
    });
    for (int step = 0; step < 200; ++step) {
      at::Tensor g = at::full({1024}, static_cast<double>(step), at::kDouble);
      train->all_reduce(g, ReduceOp::kSum);
      ASSERT_EQ(g[0].item<double>(), 2.0 * step);
    }
    background.join();
    if (bg_error) std::rethrow_exception(bg_error);
    EXPECT_EQ(ckpt_rounds.load(), 100);
  });
}

// The stuck peer (a thread of this process) stays silent until rank 0 has
// its answer or `wake_after` has passed, whichever comes first: a timeout
// that fails to fire leaves rank 0 waiting until the peer leaves.
class StuckPeer {
 public:
  void stay_silent(std::chrono::milliseconds wake_after) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, wake_after, [&] { return answered_; });
  }
  void answered() {
    std::lock_guard<std::mutex> lock(mu_);
    answered_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool answered_ = false;
};

TEST(DeadPeer, CollectiveAgainstAStuckPeerTimesOutNamingTheOperation) {
  std::string message;
  StuckPeer peer;
  run_ranks(2, [&](RankContext& ctx) {
    std::vector<int> all{0, 1};
    auto g = ctx.rendezvous.new_group("train", all);
    if (ctx.rank == 1) {
      // Alive but never joins the collective: stays silent past the timeout.
      peer.stay_silent(std::chrono::milliseconds(9000));
      return;
    }
    at::Tensor t = at::ones({8});
    auto start = std::chrono::steady_clock::now();
    try {
      g->all_reduce(t);
      ADD_FAILURE() << "all_reduce against a stuck peer returned";
    } catch (const DistError& e) {
      message = e.what();
    }
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // Fails after the 3 s group timeout, long before the peer wakes up (9 s).
    EXPECT_LT(waited, 7.0);
    // The group is now unusable and says so at once.
    EXPECT_THROW(g->barrier(), DistError);
    peer.answered();
  }, /*timeout_s=*/3.0);
  EXPECT_NE(message.find("all_reduce"), std::string::npos) << message;
  EXPECT_NE(message.find("'train'"), std::string::npos) << message;
}

TEST(DeadPeer, AllToAllAgainstAStuckPeerTimesOutNamingTheOperation) {
  std::string message;
  StuckPeer peer;
  run_ranks(2, [&](RankContext& ctx) {
    std::vector<int> all{0, 1};
    auto g = ctx.rendezvous.new_group("experts", all);
    if (ctx.rank == 1) {
      peer.stay_silent(std::chrono::milliseconds(6000));
      return;
    }
    at::Tensor in = at::ones({3, 4});
    at::Tensor out = at::zeros({2, 4});
    auto start = std::chrono::steady_clock::now();
    try {
      g->all_to_all(out, in, {1, 1}, {1, 2});
      ADD_FAILURE() << "all_to_all against a stuck peer returned";
    } catch (const DistError& e) {
      message = e.what();
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(waited, 5.5);  // the 3 s timeout, not the peer's 6 s
    EXPECT_THROW(g->barrier(), DistError);
    peer.answered();
  }, /*timeout_s=*/3.0);
  EXPECT_NE(message.find("all_to_all on group 'experts'"), std::string::npos) << message;
}

TEST(DeadPeer, CollectiveAgainstAPeerThatLeftFailsInsteadOfHanging) {
  std::string message;
  run_ranks(2, [&](RankContext& ctx) {
    std::vector<int> all{0, 1};
    auto g = ctx.rendezvous.new_group("train", all);
    if (ctx.rank == 1) {
      g.reset();  // the peer's sockets close
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    at::Tensor t = at::ones({8});
    try {
      g->all_reduce(t);
      ADD_FAILURE() << "all_reduce against a departed peer returned";
    } catch (const DistError& e) {
      message = e.what();
    }
  }, /*timeout_s=*/5.0);
  EXPECT_NE(message.find("all_reduce"), std::string::npos) << message;
}
