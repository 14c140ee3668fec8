#pragma once
// Internal to codec/: the built-in transforms' constructors and the
// per-thread resources they share. Not installed.
#include <zstd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "checkpoint/codec/transforms.h"

namespace checkpoint::codec_detail {

constexpr int kDefaultZstdLevel = 3;

struct CCtxDeleter {
  void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
};
struct DCtxDeleter {
  void operator()(ZSTD_DCtx* d) const { ZSTD_freeDCtx(d); }
};

// Element sizes signrot/1 can rotate.
inline bool rotatable(size_t e) { return e == 1 || e == 2 || e == 4 || e == 8; }

// One zstd context per thread (zstd.cpp): creating one per block costs more
// than coding a small block.
ZSTD_CCtx* thread_cctx();
ZSTD_DCtx* thread_dctx();

// Per-thread buffers that only grow, never zero-filled (transforms.cpp).
// Slot 0 holds encoder input planes, slot 1 decoder output planes.
uint8_t* thread_scratch(int slot, size_t n);

// One file each; `level` was checked by the caller (1..19).
std::unique_ptr<BlockTransform> new_zstd(int level);         // zstd.cpp: "zstd/1"
std::unique_ptr<BlockTransform> new_bytegroup();             // bytegroup.cpp: "bytegroup/1"
std::unique_ptr<BlockTransform> new_signrot();               // signrot.cpp: "signrot/1"
std::unique_ptr<BlockTransform> new_zstd_planes(int level);  // zstd_planes.cpp: "zstdplanes/1"

// zstdplanes/1 on planes already split (zstd_planes.cpp), for
// TransformChain's fused float path: `in` holds e planes of n / e bytes.
// Decoding points planes[k] at plane k, inside `in` when it is stored raw,
// else inside `out`.
void zstd_encode_planes(const uint8_t* in, size_t n, size_t e, int level,
                        std::vector<uint8_t>& out);
void zstd_decode_planes_to(const uint8_t* in, size_t n, size_t e, uint8_t* out, size_t out_n,
                           const uint8_t** planes);

}  // namespace checkpoint::codec_detail
