#pragma once
// The records of an instruction-data JSONL file (data.kind sft), rendered
// and packed into windows, without LibTorch: SftDataset (sft_dataset.h,
// which says how records are rendered, masked and packed) builds on it, and
// fuzz/fuzz_sft_jsonl.cpp reaches it the same way.
#include "framework/data/token_shard.h"  // DataError
#include "framework/tokenizer/tokenizer.h"

#include <cstdint>
#include <istream>
#include <string>
#include <vector>

namespace framework::data {

struct SftStats {
  int64_t records = 0;
  int64_t prompt_tokens = 0;      // tokens that train nothing (prompts, headers, specials)
  int64_t completion_tokens = 0;  // tokens the loss covers
  int64_t truncated = 0;          // records cut to seq_len + 1 tokens
  int64_t windows = 0;            // training windows (packs)
  int64_t eval_windows = 0;
};

// Windows of seq_len + 1 tokens, back to back.
struct SftWindows {
  std::vector<int32_t> tokens;   // -1 is padding
  std::vector<uint8_t> trained;  // whether the loss covers each token
  SftStats stats;                // records, prompt/completion tokens, truncated (windows: SftDataset's)
};

// Reads the records of `in` (the file `path`, named in errors), renders each
// with `tok` and packs them (`packed`: data.packed). Errors: DataError naming
// the file and line (a line that is not JSON or not a record; a messages
// record with a tokenizer that lacks Llama 3's chat tokens), or the file
// (no records, a read error).
SftWindows read_sft_records(std::istream& in, const std::string& path, const tokenizer::Tokenizer& tok,
                            int64_t seq_len, bool packed);

}  // namespace framework::data
