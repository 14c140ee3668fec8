#pragma once
// What the trainer needs besides the config, for cnn.h's model: the model
// built from a seed, its units, its loss, and an image dataset.
#include "cnn.h"

#include "framework/data/dataset.h"
#include "framework/train/trainer.h"

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace cnn {

// make_sample as a Dataset: one (image, label) per global index.
class QuadrantImages : public framework::data::Dataset {
 public:
  QuadrantImages(CnnOptions o, uint64_t seed) : o_(o), seed_(seed) {}
  std::pair<torch::Tensor, torch::Tensor> sample(int64_t index) const override {
    return make_sample(o_, seed_, index);
  }
  std::string describe() const override { return "quadrant images"; }

 private:
  CnnOptions o_;
  uint64_t seed_;
};

inline framework::train::UserModel make_user_model(int64_t seed, SmallCnn* out = nullptr,
                                                 const CnnOptions& o = {}) {
  torch::manual_seed(static_cast<uint64_t>(seed));  // the same weights on every rank
  SmallCnn model(o);
  if (out != nullptr) *out = model;
  framework::train::UserModel user;
  user.module = model.ptr();
  user.units = {"stem", "body"};
  user.loss = [model = model.ptr()](const torch::Tensor& images, const torch::Tensor& labels) {
    torch::Tensor logits = model->forward(images);
    torch::Tensor sum = torch::nn::functional::cross_entropy(
        logits, labels,
        torch::nn::functional::CrossEntropyFuncOptions()
            .ignore_index(framework::data::kIgnoreIndex)
            .reduction(torch::kSum));
    return framework::train::LossSum{sum, (labels != framework::data::kIgnoreIndex).sum()};
  };
  user.dataset = std::make_shared<QuadrantImages>(o, static_cast<uint64_t>(seed));
  user.description = "cnn (frozen stem)";
  return user;
}

}  // namespace cnn
