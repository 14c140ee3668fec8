// Shapes, causality, weight tying, determinism and option validation of the models.
#include "models/layered_model.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>
#include <string>

namespace models {
namespace {

ModelOptions small_options(const std::string& kind, bool tie) {
  ModelOptions o;
  o.kind = kind;
  o.vocab_size = 17;
  o.seq_len = 12;
  o.d_model = 16;
  o.n_layers = 2;
  o.n_heads = 4;
  o.tie_weights = tie;
  return o;
}

std::shared_ptr<LayeredModelImpl> seeded_model(const ModelOptions& o, uint64_t seed = 1) {
  torch::manual_seed(seed);
  return make_model(o);
}

torch::Tensor random_tokens(const ModelOptions& o, int64_t batch, int64_t len) {
  return torch::randint(o.vocab_size, {batch, len}, torch::kLong);
}

std::string error_of(const ModelOptions& o) {
  try {
    make_model(o);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

class BothKinds : public ::testing::TestWithParam<std::string> {};

TEST_P(BothKinds, ForwardMapsTokensToLogitsOverTheVocabulary) {
  auto o = small_options(GetParam(), true);
  auto model = seeded_model(o);
  auto logits = model->forward(random_tokens(o, 3, o.seq_len));
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, o.seq_len, o.vocab_size}));
  EXPECT_EQ(logits.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::isfinite(logits).all().item<bool>());
  // Shorter sequences than seq_len are fine.
  EXPECT_EQ(model->forward(random_tokens(o, 2, 5)).sizes(), (std::vector<int64_t>{2, 5, o.vocab_size}));
}

TEST_P(BothKinds, ForwardEqualsHeadOfBlocksOfEmbed) {
  auto o = small_options(GetParam(), false);
  auto model = seeded_model(o);
  auto tokens = random_tokens(o, 2, o.seq_len);
  auto h = model->embed(tokens);
  EXPECT_EQ(h.sizes(), (std::vector<int64_t>{2, o.seq_len, o.d_model}));
  ASSERT_EQ(model->num_blocks(), o.n_layers);
  for (int64_t i = 0; i < model->num_blocks(); ++i) h = model->block_forward(i, h);
  EXPECT_TRUE(torch::equal(model->head(h), model->forward(tokens)));
}

TEST_P(BothKinds, ChangingTokenTLeavesEarlierLogitsUnchanged) {
  auto o = small_options(GetParam(), true);
  auto model = seeded_model(o);
  auto tokens = random_tokens(o, 1, o.seq_len);
  const int64_t t = 7;
  auto changed = tokens.clone();
  changed[0][t] = (tokens[0][t].item<int64_t>() + 1) % o.vocab_size;
  auto a = model->forward(tokens);
  auto b = model->forward(changed);
  EXPECT_TRUE(torch::allclose(a.slice(1, 0, t), b.slice(1, 0, t), 1e-6, 1e-6));
  EXPECT_FALSE(torch::allclose(a.slice(1, t, t + 1), b.slice(1, t, t + 1), 1e-6, 1e-6));
}

TEST_P(BothKinds, SameSeedGivesIdenticalParametersAndAnotherSeedDoesNot) {
  auto o = small_options(GetParam(), false);
  auto a = seeded_model(o, 7)->named_parameters();
  auto b = seeded_model(o, 7)->named_parameters();
  auto c = seeded_model(o, 8)->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  bool any_differs = false;
  for (const auto& item : a) {
    EXPECT_TRUE(torch::equal(item.value(), b[item.key()])) << item.key();
    if (!torch::equal(item.value(), c[item.key()])) any_differs = true;
  }
  EXPECT_TRUE(any_differs);
}

TEST_P(BothKinds, TiedHeadSharesTheEmbeddingStorageAndHasFewerParameters) {
  auto tied = seeded_model(small_options(GetParam(), true));
  auto untied = seeded_model(small_options(GetParam(), false));
  auto tied_params = tied->named_parameters();
  EXPECT_EQ(tied_params.find("lm_head.weight"), nullptr);
  ASSERT_NE(untied->named_parameters().find("lm_head.weight"), nullptr);
  auto count = [](const std::shared_ptr<LayeredModelImpl>& m) {
    int64_t n = 0;
    for (const auto& p : m->parameters()) n += p.numel();
    return n;
  };
  const auto o = small_options(GetParam(), true);
  EXPECT_EQ(count(untied) - count(tied), o.vocab_size * o.d_model);

  // The head really reads tok_emb.weight: a gradient through the head lands there
  // even when the embedding lookup is bypassed.
  auto h = torch::randn({1, 3, o.d_model});
  tied->head(h).sum().backward();
  auto grad = tied_params["tok_emb.weight"].grad();
  ASSERT_TRUE(grad.defined());
  EXPECT_GT(grad.abs().sum().item<float>(), 0.0f);
}

TEST_P(BothKinds, BlocksAreRegisteredSubmodulesOwningAllTheirParameters) {
  auto o = small_options(GetParam(), true);
  auto model = seeded_model(o);
  int64_t in_blocks = 0;
  for (int64_t i = 0; i < model->num_blocks(); ++i) {
    for (const auto& p : model->block(i)->parameters()) in_blocks += p.numel();
  }
  int64_t named_blocks = 0;
  for (const auto& item : model->named_parameters()) {
    if (item.key().rfind("blocks.", 0) == 0) named_blocks += item.value().numel();
  }
  EXPECT_EQ(in_blocks, named_blocks);
  EXPECT_GT(in_blocks, 0);
}

// The memory estimate's parameter count comes from the options alone; it
// must equal what make_model builds, tied or not, with d_ff given or not.
TEST_P(BothKinds, ModelSizeCountsExactlyTheParametersMakeModelCreates) {
  for (bool tie : {true, false}) {
    for (int64_t d_ff : {0, 50}) {
      auto o = small_options(GetParam(), tie);
      o.d_ff = d_ff;
      o.n_layers = 3;
      auto model = seeded_model(o);
      int64_t all = 0;
      for (const auto& p : model->parameters()) all += p.numel();
      int64_t largest_block = 0;
      for (int64_t i = 0; i < model->num_blocks(); ++i) {
        int64_t n = 0;
        for (const auto& p : model->block(i)->parameters()) n += p.numel();
        largest_block = std::max(largest_block, n);
      }
      const ModelSize size = model_size(o);
      EXPECT_EQ(size.parameters, static_cast<double>(all)) << "tie " << tie << " d_ff " << d_ff;
      const int64_t rest = all - 3 * largest_block;
      EXPECT_EQ(size.largest_unit, static_cast<double>(std::max(rest, largest_block)));
      EXPECT_GT(size.activation_floats_per_sample, 0.0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, BothKinds, ::testing::Values("gpt", "mlp"));

TEST(Gpt, ParameterNamesFollowTheDocumentedLayout) {
  auto model = seeded_model(small_options("gpt", false));
  std::set<std::string> names;
  for (const auto& item : model->named_parameters()) names.insert(item.key());
  for (const char* expected :
       {"tok_emb.weight", "pos_emb.weight", "blocks.0.ln1.weight", "blocks.0.attn.qkv.weight",
        "blocks.0.attn.qkv.bias", "blocks.0.attn.proj.weight", "blocks.0.ln2.bias", "blocks.0.mlp.fc.weight",
        "blocks.1.mlp.proj.bias", "ln_f.weight", "lm_head.weight"}) {
    EXPECT_EQ(names.count(expected), 1u) << expected;
  }
  EXPECT_EQ(model->named_parameters()["blocks.0.attn.qkv.weight"].sizes(),
            (std::vector<int64_t>{48, 16}));
  EXPECT_EQ(model->named_parameters()["blocks.0.mlp.fc.weight"].sizes(), (std::vector<int64_t>{64, 16}));
}

TEST(Gpt, InitialisationIsGpt2Style) {
  ModelOptions o = small_options("gpt", false);
  o.d_model = 64;
  o.vocab_size = 256;
  auto params = seeded_model(o)->named_parameters();
  EXPECT_NEAR(params["tok_emb.weight"].std().item<float>(), 0.02, 0.002);
  EXPECT_NEAR(params["blocks.0.attn.qkv.weight"].std().item<float>(), 0.02, 0.002);
  EXPECT_TRUE(torch::equal(params["blocks.0.attn.qkv.bias"], torch::zeros({3 * o.d_model})));
  EXPECT_TRUE(torch::equal(params["ln_f.weight"], torch::ones({o.d_model})));
}

TEST(ModelOptions, BadSizesAreRejectedNamingTheOption) {
  auto with = [](auto edit) {
    auto o = small_options("gpt", true);
    edit(o);
    return error_of(o);
  };
  EXPECT_NE(with([](ModelOptions& o) { o.kind = "rnn"; }).find("model.kind"), std::string::npos);
  EXPECT_NE(with([](ModelOptions& o) { o.vocab_size = 0; }).find("model.vocab_size"), std::string::npos);
  EXPECT_NE(with([](ModelOptions& o) { o.seq_len = -1; }).find("model.seq_len"), std::string::npos);
  EXPECT_NE(with([](ModelOptions& o) { o.d_model = 0; }).find("model.d_model"), std::string::npos);
  EXPECT_NE(with([](ModelOptions& o) { o.n_layers = 0; }).find("model.n_layers"), std::string::npos);
  EXPECT_NE(with([](ModelOptions& o) { o.n_heads = 3; }).find("model.n_heads"), std::string::npos);
  EXPECT_NE(with([](ModelOptions& o) { o.d_ff = -4; }).find("model.d_ff"), std::string::npos);
  EXPECT_EQ(with([](ModelOptions& o) { o.d_ff = 24; }), "");
}

TEST(Models, SequencesLongerThanSeqLenAreRejected) {
  auto o = small_options("gpt", true);
  auto model = seeded_model(o);
  EXPECT_THROW(model->forward(random_tokens(o, 1, o.seq_len + 1)), c10::Error);
}

}  // namespace
}  // namespace models
