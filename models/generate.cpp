#include "models/generate.h"

#include "models/llama.h"

#include <algorithm>
#include <limits>

namespace models {

int64_t sample_next(const torch::Tensor& logits, const SamplingOptions& options, at::Generator& gen) {
  torch::Tensor l = logits.detach().to(torch::kFloat).reshape({-1});
  if (options.temperature <= 0) return l.argmax().item<int64_t>();
  l = l / options.temperature;
  if (options.top_k > 0 && options.top_k < l.size(0)) {
    const torch::Tensor kth = std::get<0>(l.topk(options.top_k)).min();
    l = l.masked_fill(l < kth, -std::numeric_limits<float>::infinity());
  }
  if (options.top_p < 1.0) {
    auto [sorted, order] = l.sort(/*dim=*/0, /*descending=*/true);
    torch::Tensor cumulative = torch::softmax(sorted, 0).cumsum(0);
    // Drop a token when the ones before it already reach top_p (the first always stays).
    torch::Tensor drop = (cumulative - torch::softmax(sorted, 0)) >= options.top_p;
    sorted = sorted.masked_fill(drop, -std::numeric_limits<float>::infinity());
    l = torch::full_like(l, -std::numeric_limits<float>::infinity()).scatter(0, order, sorted);
  }
  torch::Tensor probs = torch::softmax(l, 0);
  return torch::multinomial(probs, 1, /*replacement=*/false, gen).item<int64_t>();
}

std::vector<int64_t> generate(LayeredModelImpl& model, int64_t seq_len, const std::vector<int64_t>& prompt,
                              int64_t max_new,
                              const SamplingOptions& options, const std::function<void(int64_t)>& on_token,
                              bool use_cache, const std::function<torch::Tensor(const torch::Tensor&)>& forward) {
  TORCH_CHECK(!prompt.empty(), "generate: the prompt holds no tokens");
  torch::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  std::vector<int64_t> seq = prompt, out;
  auto* llama = dynamic_cast<LlamaModelImpl*>(&model);
  const torch::Device device = model.parameters().front().device();
  KvCache cache;
  for (int64_t step = 0; step < max_new; ++step) {
    torch::Tensor logits;
    if (llama != nullptr && use_cache) {
      // The prompt at once, then one new token per step.
      const int64_t from = cache.length;
      std::vector<int64_t> fresh(seq.begin() + from, seq.end());
      torch::Tensor tokens = torch::tensor(fresh, torch::kLong).unsqueeze(0).to(device);
      logits = llama->forward_cached(tokens, cache).select(1, -1).squeeze(0);
    } else {
      const int64_t window = std::min<int64_t>(static_cast<int64_t>(seq.size()), seq_len);
      std::vector<int64_t> last(seq.end() - window, seq.end());
      torch::Tensor tokens = torch::tensor(last, torch::kLong).unsqueeze(0);
      logits = (forward ? forward(tokens) : model.forward(tokens.to(device))).select(1, -1).squeeze(0);
    }
    const int64_t next = sample_next(logits.cpu(), options, gen);
    seq.push_back(next);
    out.push_back(next);
    if (on_token) on_token(next);
  }
  return out;
}

}  // namespace models
