#pragma once
// The chat tokenizer of the instruction-data tests (SftDataset.*) and of
// fuzz/fuzz_sft_jsonl.cpp: the fixture's Llama 3 style byte-level BPE
// (tests/tools/data/bpe_fixture.json's learnt_split, checked against Hugging
// Face's) with Llama 3's chat specials added after its vocabulary, as
// tokenizer.json text. Needs nlohmann-json only (the fuzz build has no
// LibTorch).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>

namespace testing_support {

inline std::string chat_tokenizer_json_text(const std::string& source_dir) {
  nlohmann::json fixture;
  std::ifstream(source_dir + "/tests/tools/data/bpe_fixture.json") >> fixture;
  nlohmann::json tok = fixture["tokenizers"]["learnt_split"];
  int64_t next = 0;
  for (const auto& a : tok["added_tokens"]) next = std::max<int64_t>(next, a["id"].get<int64_t>() + 1);
  for (const char* special : {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}) {
    tok["added_tokens"].push_back({{"id", next++}, {"content", special}, {"single_word", false}, {"lstrip", false},
                                   {"rstrip", false}, {"normalized", false}, {"special", true}});
  }
  return tok.dump();
}

}  // namespace testing_support
