// libFuzzer target: token shards (data.kind tokens), through
// framework::data::open_token_shard -- what TokenDataset, preflight and
// data_bench open -- then check_shard_tokens and every token read back with
// TokenShard::at, as training windows read them. The input is one shard:
// byte 0 even, an llm.c .bin (the rest of the input); odd, a Megatron
// dataset: bytes 1-4 give the .idx's length L (little-endian, modulo the
// bytes left + 1), then come the .idx's L bytes and the .bin. The shard is
// written to files of this process's own under /dev/shm (it is read by
// mmap, as the product reads it). Anything not accepted must end in
// DataError; what is accepted must hold its tokens inside the file and its
// document starts in order.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "framework/data/token_shard.h"

namespace {

void write_file(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    std::string d = "/dev/shm/shardkit_fuzz_token_shard_" + std::to_string(::getpid());
    std::system(("mkdir -p " + d).c_str());
    return d;
  }();
  const std::string bin = dir + "/shard.bin", idx = dir + "/shard.idx";
  if (size == 0) return 0;
  const bool megatron = (data[0] & 1) != 0;
  ++data;
  --size;
  if (megatron) {
    uint32_t l = 0;
    const size_t n = size < 4 ? size : 4;
    std::memcpy(&l, data, n);
    data += n;
    size -= n;
    const size_t idx_len = l % (size + 1);
    write_file(idx, data, idx_len);
    write_file(bin, data + idx_len, size - idx_len);
  } else {
    ::unlink(idx.c_str());  // an .idx beside it makes the .bin Megatron's
    write_file(bin, data, size);
  }
  framework::data::TokenShard shard;
  try {
    shard = framework::data::open_token_shard(bin);
  } catch (const framework::data::DataError&) {
    return 0;
  }
  // Accepted: every token lies inside the mapped file, documents in order.
  if (shard.tokens < 0 || shard.data_offset < 0 ||
      shard.data_offset + shard.tokens * shard.width > shard.map_bytes) {
    std::abort();
  }
  if (shard.doc_starts.empty() || shard.doc_starts.front() != 0) std::abort();
  for (size_t d = 1; d < shard.doc_starts.size(); ++d) {
    if (shard.doc_starts[d] <= shard.doc_starts[d - 1] || shard.doc_starts[d] >= shard.tokens) std::abort();
  }
  int64_t sum = 0;
  for (int64_t t = 0; t < shard.tokens; ++t) sum += shard.at(t);
  if (sum == 0x7fffffffffffffffLL) std::abort();  // keeps the reads
  try {
    framework::data::check_shard_tokens(shard, 50257, "data.path");
  } catch (const framework::data::DataError&) {
  }
  return 0;
}
