// Learning smoke test: a small GPT trained on one process must learn the reverse
// task well enough to halve its loss. Guards against silent breakage (masking,
// head tying, init) that shape tests cannot see.
#include "framework/data/loader.h"
#include "framework/data/synthetic_dataset.h"
#include "comm/cpu_threads.h"
#include "models/layered_model.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <vector>

namespace models {
namespace {

TEST(GptLearning, LossOnReverseTaskDropsBelowHalfOfTheFirstStep) {
  // One thread in LibTorch's pool and OpenBLAS's: ctest -j2 runs two tests on
  // 2 cores, and a BLAS thread waiting for a descheduled peer stalls a step.
  comm::set_cpu_threads(1);
  ModelOptions o;  // defaults: gpt, vocab 32, seq_len 32, d_model 64, 2 layers, 4 heads, tied
  torch::manual_seed(0);
  auto model = make_model(o);
  auto dataset = std::make_shared<framework::data::SyntheticDataset>(
      framework::data::SyntheticTask::kReverse, o.vocab_size, o.seq_len, /*seed=*/1234);
  framework::data::DataLoader loader(dataset, /*global_batch_size=*/32, /*seed=*/1234, 0, 1);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3));

  const int kSteps = 150;
  std::vector<float> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [inputs, targets] = loader.next();
    auto logits = model->forward(inputs);
    auto loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, o.vocab_size}), targets.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(framework::data::kIgnoreIndex));
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    losses.push_back(loss.item<float>());
  }
  std::cout << dataset->describe() << "\nloss:";
  for (int step = 0; step < kSteps; step += 10) std::cout << " [" << step << "] " << losses[step];
  std::cout << " [" << kSteps - 1 << "] " << losses.back() << "\n";
  float tail = 0;
  for (int step = kSteps - 10; step < kSteps; ++step) tail += losses[step] / 10;
  EXPECT_LT(tail, 0.5f * losses.front()) << "first " << losses.front() << ", mean of last 10 " << tail;
}

}  // namespace
}  // namespace models
