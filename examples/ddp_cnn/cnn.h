#pragma once
// A small image classifier, written as any LibTorch user would write it: a
// frozen stem (a pretrained feature extractor in fine-tuning: Conv2d and
// BatchNorm2d in eval mode, requires_grad false, with BatchNorm's running
// statistics as buffers) and a trainable body (Conv2d, ReLU, Linear).
//
// For DDP nothing in the model changes. For FSDP/HSDP each Sequential is a
// unit, called through framework::fsdp::run_unit (a plain call unsharded):
//   fully_shard(model, mesh, options, {"stem", "body"})
#include "framework/fsdp/fully_shard.h"

#include <torch/torch.h>

#include <cstdint>

namespace cnn {

struct CnnOptions {
  int64_t image_size = 12;  // square, 1 channel
  int64_t classes = 4;
  int64_t stem_channels = 8;
  int64_t body_channels = 16;
  int64_t hidden = 32;
};

class SmallCnnImpl : public torch::nn::Module {
 public:
  explicit SmallCnnImpl(const CnnOptions& o) {
    namespace nn = torch::nn;
    stem = register_module(
        "stem", nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, o.stem_channels, 3).padding(1)),
                               nn::BatchNorm2d(o.stem_channels), nn::ReLU()));
    const int64_t after = (o.image_size - 3) / 2 + 1;  // 3x3, stride 2, no padding
    body = register_module(
        "body", nn::Sequential(nn::Conv2d(nn::Conv2dOptions(o.stem_channels, o.body_channels, 3).stride(2)),
                               nn::ReLU(), nn::Flatten(),
                               nn::Linear(o.body_channels * after * after, o.hidden), nn::ReLU(),
                               nn::Linear(o.hidden, o.classes)));
    // "Pretrained" stem: running statistics that are not the defaults, so a
    // checkpoint that lost them would show.
    torch::NoGradGuard no_grad;
    for (auto& b : stem->named_buffers()) {
      if (b.key().find("running_mean") != std::string::npos) b.value().uniform_(-0.1, 0.1);
      if (b.key().find("running_var") != std::string::npos) b.value().uniform_(0.9, 1.1);
    }
    for (auto& p : stem->parameters()) p.set_requires_grad(false);
    stem->eval();  // BatchNorm uses its running statistics and never updates them
  }

  // images float [B, 1, S, S] -> logits [B, classes]
  torch::Tensor forward(const torch::Tensor& images) {
    torch::Tensor h = framework::fsdp::run_unit(*stem, [&] { return stem->forward(images); });
    return framework::fsdp::run_unit(*body, [&] { return body->forward(h); });
  }

  torch::nn::Sequential stem{nullptr};
  torch::nn::Sequential body{nullptr};
};
TORCH_MODULE(SmallCnn);

// Images with one bright 3x3 square in one of `classes` regions (the label)
// on noise: sample(i) is a pure function of (seed, i).
inline std::pair<torch::Tensor, torch::Tensor> make_sample(const CnnOptions& o, uint64_t seed,
                                                           int64_t index) {
  torch::Generator gen = at::detail::createCPUGenerator(seed * 1000003ULL + static_cast<uint64_t>(index));
  torch::Tensor image = torch::randn({1, o.image_size, o.image_size}, gen) * 0.3;
  const int64_t label = torch::randint(0, o.classes, {1}, gen).item<int64_t>();
  const int64_t half = o.image_size / 2;
  const int64_t row = (label / 2) * half + torch::randint(0, half - 3 + 1, {1}, gen).item<int64_t>();
  const int64_t col = (label % 2) * half + torch::randint(0, half - 3 + 1, {1}, gen).item<int64_t>();
  image.narrow(1, row, 3).narrow(2, col, 3).add_(2.0);
  return {image, torch::tensor(label, torch::kLong)};
}

}  // namespace cnn
