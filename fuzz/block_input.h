#pragma once
// The input layout of fuzz_block_decoder, shared with the seed generator:
//
//   u8  chain         0: none, 1: zstd/1, 2: bytegroup/1 + zstd/1, 3: bytegroup/1,
//                     4: signrot/1 + bytegroup/1 + zstdplanes/1 (float grouping,
//                     decoded fused), 5: zstdplanes/1; others wrap (mod 6)
//   u8  dtype         DType code (1..10; others wrap)
//   u8  block_count   1..4 (wraps)
//   block_count x { u16 stored_length; u16 logical_length; u64 checksum }
//   u64 chunk_checksum
//   ...               the data file (rank_0.data); the chunk starts at 0
//
// All integers little-endian (checkpoint/format/byte_order.h). The metadata
// built from it is validated like a decoded one before the reader sees it.
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/format/byte_order.h"

namespace fuzz {

constexpr uint8_t kChainCount = 6;

inline std::vector<std::string> chain_for(uint8_t code) {
  switch (code % kChainCount) {
    case 1: return {"zstd/1"};
    case 2: return {"bytegroup/1", "zstd/1"};
    case 3: return {"bytegroup/1"};
    case 4: return {"signrot/1", "bytegroup/1", "zstdplanes/1"};
    case 5: return {"zstdplanes/1"};
    default: return {};
  }
}

struct BlockHeader {
  uint16_t stored_length = 0;
  uint16_t logical_length = 0;
  uint64_t checksum = 0;
};

}  // namespace fuzz
