#pragma once
// What the trainer needs besides the config, for llama.h's model: the model
// built from a seed, its FSDP units, its loss, and a token dataset.
#include "llama.h"

#include "framework/data/dataset.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/train/trainer.h"

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace llama {

// Sequences t[k+1] = (3 t[k] + 1) mod vocab from a random start: the model
// learns the rule. sample(i) is a pure function of (seed, i).
class AffineSequences : public framework::data::Dataset {
 public:
  AffineSequences(int64_t vocab, int64_t seq_len, uint64_t seed)
      : vocab_(vocab), seq_len_(seq_len), seed_(seed) {}
  int64_t seq_len() const override { return seq_len_; }
  int64_t vocab_size() const override { return vocab_; }
  std::pair<torch::Tensor, torch::Tensor> sample(int64_t index) const override {
    const uint64_t h = framework::data::mix_seed(seed_, static_cast<uint64_t>(index));
    torch::Tensor seq = torch::empty({seq_len_ + 1}, torch::kLong);
    int64_t t = static_cast<int64_t>(h % static_cast<uint64_t>(vocab_));
    for (int64_t k = 0; k <= seq_len_; ++k, t = (3 * t + 1) % vocab_) seq[k] = t;
    return {seq.narrow(0, 0, seq_len_), seq.narrow(0, 1, seq_len_)};
  }
  std::string describe() const override { return "affine sequences"; }

 private:
  int64_t vocab_, seq_len_;
  uint64_t seed_;
};

// Your model, your loss, your data: what the Trainer needs.
inline framework::train::UserModel make_user_model(int64_t seed, const LlamaOptions& o = {}) {
  torch::manual_seed(static_cast<uint64_t>(seed));  // the same weights on every rank
  auto model = Llama(o).ptr();
  framework::train::UserModel user;
  user.module = model;
  user.units = framework::fsdp::children_of(*model, "layers");  // layers.0, layers.1
  user.loss = [model](const torch::Tensor& inputs, const torch::Tensor& targets) {
    torch::Tensor logits = model->forward(inputs);
    torch::Tensor sum = torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions()
            .ignore_index(framework::data::kIgnoreIndex)
            .reduction(torch::kSum));
    return framework::train::LossSum{sum, (targets != framework::data::kIgnoreIndex).sum()};
  };
  user.dataset = std::make_shared<AffineSequences>(o.vocab_size, o.seq_len, static_cast<uint64_t>(seed));
  user.description = "llama " + std::to_string(o.n_layers) + " layers";
  return user;
}

}  // namespace llama
