// Global batch sampling, data-parallel slicing, and resumable loader state.
#include "framework/data/loader.h"
#include "framework/data/sampler.h"
#include "framework/data/synthetic_dataset.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace framework::data {
namespace {

std::shared_ptr<Dataset> reverse_dataset(uint64_t seed) {
  return std::make_shared<SyntheticDataset>(SyntheticTask::kReverse, 32, 16, seed);
}

TEST(GlobalBatchSampler, GlobalIndicesAreConsecutiveAndDisjointAcrossSteps) {
  GlobalBatchSampler sampler(4, 1);
  EXPECT_EQ(sampler.global_indices(0), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(sampler.global_indices(3), (std::vector<int64_t>{12, 13, 14, 15}));
}

TEST(GlobalBatchSampler, LocalSlicesConcatenateToTheGlobalBatchForAnyDpSize) {
  GlobalBatchSampler sampler(8, 1);
  for (int n : {1, 2, 4}) {
    for (int64_t step : {0, 5}) {
      std::vector<int64_t> joined;
      for (int r = 0; r < n; ++r) {
        auto local = sampler.local_indices(step, r, n);
        EXPECT_EQ(local.size(), static_cast<size_t>(8 / n));
        joined.insert(joined.end(), local.begin(), local.end());
      }
      EXPECT_EQ(joined, sampler.global_indices(step)) << "dp size " << n;
    }
  }
}

TEST(GlobalBatchSampler, NonDivisibleBatchIsRejectedNamingGlobalBatchSize) {
  GlobalBatchSampler sampler(6, 1);
  try {
    sampler.local_indices(0, 0, 4);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("train.global_batch_size"), std::string::npos) << message;
    EXPECT_NE(message.find("data-parallel size (4)"), std::string::npos) << message;
  }
  EXPECT_THROW(DataLoader(reverse_dataset(1), 6, 1, 0, 4), c10::Error);
  EXPECT_THROW(GlobalBatchSampler(0, 1), c10::Error);
}

TEST(DataLoader, UnionOfLocalBatchesOverRanksEqualsTheGlobalBatch) {
  auto ds = reverse_dataset(3);
  DataLoader single(ds, 8, 3, 0, 1);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> global;
  for (int step = 0; step < 3; ++step) global.push_back(single.next());
  EXPECT_EQ(global[0].first.sizes(), (std::vector<int64_t>{8, 16}));

  for (int n : {1, 2, 4}) {
    std::vector<DataLoader> ranks;
    for (int r = 0; r < n; ++r) ranks.emplace_back(ds, 8, 3, r, n);
    for (int step = 0; step < 3; ++step) {
      std::vector<torch::Tensor> inputs, targets;
      for (auto& loader : ranks) {
        auto [x, y] = loader.next();
        EXPECT_EQ(x.size(0), 8 / n);
        inputs.push_back(x);
        targets.push_back(y);
      }
      EXPECT_TRUE(torch::equal(torch::cat(inputs), global[step].first)) << "n " << n << " step " << step;
      EXPECT_TRUE(torch::equal(torch::cat(targets), global[step].second)) << "n " << n << " step " << step;
    }
  }
}

TEST(LoaderState, EncodeDecodeRoundTrips) {
  LoaderState state{123456789012LL, 0xFEDCBA9876543210ULL, 64};
  auto bytes = encode_loader_state(state);
  EXPECT_EQ(bytes.size(), 29u);
  auto back = decode_loader_state(bytes);
  EXPECT_EQ(back.next_step, state.next_step);
  EXPECT_EQ(back.seed, state.seed);
  EXPECT_EQ(back.global_batch_size, state.global_batch_size);
}

TEST(LoaderState, TruncatedOrForeignBytesAreRejected) {
  auto bytes = encode_loader_state(LoaderState{1, 2, 3});
  auto truncated = bytes;
  truncated.pop_back();
  EXPECT_THROW(decode_loader_state(truncated), std::runtime_error);
  auto bad_magic = bytes;
  bad_magic[0] = 'X';
  EXPECT_THROW(decode_loader_state(bad_magic), std::runtime_error);
  auto bad_version = bytes;
  bad_version[4] = 99;
  EXPECT_THROW(decode_loader_state(bad_version), std::runtime_error);
  EXPECT_THROW(decode_loader_state({}), std::runtime_error);
}

TEST(DataLoader, ResumeAtADifferentDpSizeContinuesTheSameGlobalSequence) {
  auto ds = reverse_dataset(4);
  DataLoader reference(ds, 8, 4, 0, 1);
  std::vector<torch::Tensor> expected;
  for (int step = 0; step < 5; ++step) expected.push_back(reference.next().first);

  // Run 3 steps at dp size 2, save, resume at dp size 4.
  std::vector<DataLoader> before;
  for (int r = 0; r < 2; ++r) before.emplace_back(ds, 8, 4, r, 2);
  for (int step = 0; step < 3; ++step) {
    for (auto& loader : before) loader.next();
  }
  auto saved = encode_loader_state(before[1].state());

  for (int step = 3; step < 5; ++step) {
    std::vector<torch::Tensor> parts;
    for (int r = 0; r < 4; ++r) {
      DataLoader resumed(ds, 8, 4, r, 4);
      resumed.load_state(decode_loader_state(saved));
      for (int s = 3; s < step; ++s) resumed.next();
      parts.push_back(resumed.next().first);
    }
    EXPECT_TRUE(torch::equal(torch::cat(parts), expected[step])) << "step " << step;
  }
}

TEST(DataLoader, LoadingStateFromADifferentSeedOrBatchSizeFailsNamingIt) {
  DataLoader loader(reverse_dataset(1), 8, 1, 0, 1);
  try {
    loader.load_state(LoaderState{2, 99, 8});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("seed"), std::string::npos);
  }
  try {
    loader.load_state(LoaderState{2, 1, 16});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("train.global_batch_size"), std::string::npos);
  }
  EXPECT_EQ(loader.state().next_step, 0);
}

}  // namespace
}  // namespace framework::data
