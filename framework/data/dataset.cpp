#include "framework/data/dataset.h"

#include "framework/data/sft_dataset.h"
#include "framework/data/synthetic_dataset.h"
#include "framework/data/text_dataset.h"
#include "framework/data/token_dataset.h"

namespace framework::data {

uint64_t mix_seed(uint64_t seed, uint64_t index) {
  // Two splitmix64 finaliser rounds so that nearby (seed, index) pairs diverge.
  auto finalise = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  return finalise(finalise(seed + 0x9E3779B97F4A7C15ULL) ^ (index + 0x632BE59BD9B4E019ULL));
}

std::pair<torch::Tensor, torch::Tensor> Dataset::eval_sample(int64_t j) const {
  TORCH_CHECK(false, "this dataset holds no validation samples (data.eval_fraction 0), asked for ", j);
}

std::unique_ptr<Dataset> make_dataset(const DataOptions& data, const models::ModelOptions& model,
                                      uint64_t seed) {
  switch (data.kind) {
    case DataKind::kSynthetic:
      return std::make_unique<SyntheticDataset>(data.task, model.vocab_size, model.seq_len, seed, 0,
                                                data.eval_fraction > 0);
    case DataKind::kText: {
      TORCH_CHECK(!data.path.empty(), "data.path must name a text file for data.kind text");
      const bool bytes = data.tokenizer.empty() || data.tokenizer == "bytes";
      TORCH_CHECK(!bytes || model.vocab_size == TextDataset::kVocabSize,
                  "model.vocab_size must be 256 for data.kind text without data.tokenizer (byte-level), got ",
                  model.vocab_size);
      return std::make_unique<TextDataset>(data.path, model.seq_len, seed, data.eval_fraction,
                                           data.tokenizer, model.vocab_size);
    }
    case DataKind::kTokens: {
      TokenDatasetOptions o;
      o.path = data.path;
      o.eval_path = data.eval_path;
      o.eval_fraction = data.eval_fraction;
      o.seq_len = model.seq_len;
      o.vocab_size = model.vocab_size;
      o.seed = seed;
      o.check_tokens = data.check_tokens;
      return std::make_unique<TokenDataset>(o);
    }
    case DataKind::kSft:
      if (data.path.empty()) throw DataError("data.path must name a JSONL file for data.kind sft");
      return std::make_unique<SftDataset>(data.path, data.tokenizer, model.seq_len, model.vocab_size, seed,
                                          data.eval_fraction, data.packed);
  }
  TORCH_INTERNAL_ASSERT(false, "data.kind ", static_cast<int>(data.kind), " is not a DataKind");
}

}  // namespace framework::data
