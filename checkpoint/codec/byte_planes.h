#pragma once
// The byte shuffles behind float grouping (FORMAT.md: signrot/1,
// bytegroup/1), as single passes: rotating every element left by one bit
// and splitting it into byte planes at once, and the inverse. SSE2 (every
// x86-64) when the compiler targets it, portable scalar code otherwise; both
// produce the same bytes. Torch-free, no state: safe on any thread.
#include <cstddef>
#include <cstdint>

namespace checkpoint {

// Plane k of `out` (out[k * count, (k + 1) * count)) receives byte k of every
// element of `in` (count elements of e bytes, little-endian), each first
// rotated left by one bit when `rotate` (signrot/1) or as is (bytegroup/1).
// e may be any size for rotate == false, and 1, 2, 4 or 8 with rotation.
// `in` and `out` must not overlap.
void split_planes(const uint8_t* in, size_t count, size_t e, bool rotate, uint8_t* out);

// The inverse: element i of `out` is byte i of every plane of `planes`,
// rotated right by one bit when `rotate`.
void merge_planes(const uint8_t* planes, size_t count, size_t e, bool rotate, uint8_t* out);

// The same with each plane anywhere: plane k is planes[k][0, count).
// REQUIRES: e <= kMaxPlanes.
constexpr size_t kMaxPlanes = 8;
void merge_planes_from(const uint8_t* const* planes, size_t count, size_t e, bool rotate,
                       uint8_t* out);

// Rotates each of `count` elements of e bytes (1, 2, 4 or 8) by one bit,
// left or right, from `in` to `out` (which may be the same buffer).
void rotate_elements(const uint8_t* in, size_t count, size_t e, bool left, uint8_t* out);

}  // namespace checkpoint
