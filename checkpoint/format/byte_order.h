#pragma once
// Internal: the one little-endian integer coding. Every fixed-width integer in
// our files (metadata, plan blobs, safetensors headers, zip records, pickles,
// zstd frames) is written and read through these. Not part of the public API.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace checkpoint {

// Writes the low `bytes` bytes of v at dst, least significant first; returns
// the byte after the last one written. REQUIRES: bytes <= 8.
inline uint8_t* store_le(uint8_t* dst, uint64_t v, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) *dst++ = static_cast<uint8_t>(v >> (8 * i));
  return dst;
}

// Appends the low `bytes` bytes of v to out, least significant first.
inline void append_le(std::vector<uint8_t>& out, uint64_t v, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// The unsigned value of the `bytes` bytes at p, least significant first.
// REQUIRES: bytes <= 8 and [p, p + bytes) readable.
inline uint64_t load_le(const uint8_t* p, size_t bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace checkpoint
