#pragma once
// Token shards (data.kind tokens), without LibTorch: llm.c's .bin and
// Megatron-LM's .bin + .idx, opened, checked and memory-mapped
// (the formats: framework/data/token_dataset.h). fuzz/fuzz_token_shard.cpp
// reaches them here, as TokenDataset does.
//
// Every error is a DataError naming the file and, for bad bytes, the offset.
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace framework::data {

// Bad token data or a bad data.* setting: one line naming the file and offset.
class DataError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// One memory-mapped shard.
struct TokenShard {
  std::string path;    // the .bin
  std::string format;  // "llm.c uint16", "llm.c uint32", "megatron int32", ...
  int width = 2;       // bytes per token
  bool is_signed = false;
  int64_t data_offset = 0;  // byte offset of token 0 in the file
  int64_t tokens = 0;
  std::vector<int64_t> doc_starts;   // token index of each document's start (starts with 0)
  std::shared_ptr<const uint8_t> map;  // the whole file, read-only (munmap on release)
  int64_t map_bytes = 0;

  // Token t (REQUIRES 0 <= t < tokens), widened.
  int64_t at(int64_t t) const;
};

// `path`: a file, a Megatron prefix (X for X.bin + X.idx), a directory (its
// *.bin files) or a glob; `key` names the setting in errors (data.path).
// Returns the .bin files in name order. Errors: nothing matches, not found.
std::vector<std::string> resolve_token_paths(const std::string& path, const std::string& key);

// A directory in tokenize's layout (train_*.bin and val_*.bin, or
// train_text_document / val_text_document) or llm.c's (NAME_train_*.bin and
// NAME_val_*.bin): `val` holds the validation shards and `train` every other
// one. Both are empty unless `path` is a directory holding training and
// validation shards alike. `files`: resolve_token_paths(path, ...).
struct DirectorySplit {
  std::vector<std::string> train, val;
};
DirectorySplit split_token_directory(const std::string& path, const std::vector<std::string>& files);

// Opens and checks one shard: magic, version, dtype, sizes (a truncated or
// over-long file is an error naming the expected and actual byte counts).
TokenShard open_token_shard(const std::string& bin_path);

// The token files this process has verified (data.check_tokens), one per
// line, for kCheckedTokensEnv: train's launcher passes its verdict to its
// ranks there, so a job reads the ids once rather than once per rank.
constexpr const char* kCheckedTokensEnv = "SHARDKIT_TOKENS_CHECKED";
std::string checked_token_files();

// Reads every token of `s` once (pread, never the whole file in memory) and
// refuses an id outside [0, vocab), naming `key`. Verified files are
// remembered for the process (and passed by train's launcher to its ranks),
// so preflight and the trainers do not read them again: a file is the same
// while its path, size, modification time and inode are. Returns whether it
// read the file (false: already checked in this job).
bool check_shard_tokens(const TokenShard& s, int64_t vocab, const std::string& key);

// The DataError for token t of `s`, whose id v lies outside [0, vocab).
[[noreturn]] void throw_token_outside_vocab(const std::string& key, const TokenShard& s, int64_t t, int64_t v,
                                            int64_t vocab);

}  // namespace framework::data
