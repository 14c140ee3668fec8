// For ZSTD_c_literalCompressionMode (zstd >= 1.4.0; a parameter zstd calls
// experimental). Where the library refuses it, planes are coded without it.
#define ZSTD_STATIC_LINKING_ONLY
// "zstdplanes/1": one zstd frame per byte plane (FORMAT.md, "Transforms").
#include "checkpoint/codec/builtin.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint/codec/byte_planes.h"
#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/metadata.h"

namespace checkpoint::codec_detail {

namespace {

// A plane at least this long whose bytes are close to uniform (order-0
// entropy of 7.9 bits per byte or more) is stored as a raw frame without
// running the compressor over it: the low mantissa bytes of floats are noise
// that zstd cannot shrink. The estimate looks at up to kProbeBytes of the
// plane, in kProbeWindows evenly spaced windows: the decision only ever
// costs size, never correctness, and a sample this large estimates an
// entropy near 8 bits to a few hundredths of a bit. Shorter planes get a
// cheaper test (sample_looks_like_noise, from 1 KiB); the shortest go to the
// compressor regardless, whose output is replaced by a raw frame when that
// is smaller.
constexpr size_t kRawProbeMinPlane = 16384;
constexpr double kRawEntropyBits = 7.9;
constexpr size_t kProbeBytes = 16384;
constexpr size_t kProbeWindows = 16;
// zstd's largest block; a raw frame is a run of raw blocks of at most this.
constexpr size_t kZstdMaxBlock = size_t{128} << 10;

// The bytes write_raw_frame writes for n bytes.
size_t raw_frame_size(size_t n) {
  const size_t fcs_bytes = n < 256 ? 1 : n < 65536 + 256 ? 2 : n <= 0xFFFFFFFFu ? 4 : 8;
  const size_t blocks = std::max<size_t>(1, (n + kZstdMaxBlock - 1) / kZstdMaxBlock);
  return 5 + fcs_bytes + 3 * blocks + n;
}

// Writes a standard single-segment zstd frame that stores in[0, n) in raw
// blocks and records its content size (RFC 8878, 3.1.1), raw_frame_size(n)
// bytes, at dst.
void write_raw_frame(const uint8_t* in, size_t n, uint8_t* dst) {
  dst = store_le(dst, 0xFD2FB528u, 4);
  // Frame header descriptor: single segment (bit 5), content size field of
  // 1, 2, 4 or 8 bytes (bits 7-6); no checksum, no dictionary.
  uint8_t fcs_flag = 3;
  size_t fcs_bytes = 8;
  uint64_t fcs = n;
  if (n < 256) {
    fcs_flag = 0, fcs_bytes = 1;
  } else if (n < 65536 + 256) {
    fcs_flag = 1, fcs_bytes = 2, fcs = n - 256;
  } else if (n <= 0xFFFFFFFFu) {
    fcs_flag = 2, fcs_bytes = 4;
  }
  *dst++ = static_cast<uint8_t>((fcs_flag << 6) | (1u << 5));
  dst = store_le(dst, fcs, fcs_bytes);
  size_t pos = 0;
  do {
    const size_t len = std::min(kZstdMaxBlock, n - pos);
    const bool last = pos + len == n;
    dst = store_le(dst, (static_cast<uint64_t>(len) << 3) | (last ? 1u : 0u), 3);  // type 0: raw
    if (len) std::memcpy(dst, in + pos, len);
    dst += len;
    pos += len;
  } while (pos < n);
}

// c * log2(c) for every count a probe can produce.
const float* count_log_table() {
  static const float* table = [] {
    auto* t = new float[kProbeBytes + 1];
    t[0] = 0;
    for (size_t c = 1; c <= kProbeBytes; ++c) {
      t[c] = static_cast<float>(static_cast<double>(c) * std::log2(static_cast<double>(c)));
    }
    return t;
  }();
  return table;
}

// For planes too short for the entropy estimate: 256 bytes at an even
// stride, and how many distinct values they hold. Uniform bytes give 162 on
// average (standard deviation 4.6); a plane of 7 random bits gives 111, a
// float exponent plane a few dozen. Noise is 140 or more: such a plane could
// shrink by a few percent at most, and coding it costs more than writing it.
constexpr size_t kDistinctSamples = 256;
constexpr int kDistinctNoise = 140;

bool sample_looks_like_noise(const uint8_t* in, size_t n) {
  uint64_t seen[4] = {0, 0, 0, 0};
  const size_t stride = n / kDistinctSamples;
  for (size_t i = 0; i < kDistinctSamples; ++i) {
    const uint8_t v = in[i * stride];
    seen[v >> 6] |= uint64_t{1} << (v & 63);
  }
  const int distinct = __builtin_popcountll(seen[0]) + __builtin_popcountll(seen[1]) +
                       __builtin_popcountll(seen[2]) + __builtin_popcountll(seen[3]);
  return distinct >= kDistinctNoise;
}

bool looks_like_noise(const uint8_t* in, size_t n) {
  uint32_t counts[4][256] = {};  // four tables: fewer store-to-load stalls
  auto count_range = [&counts](const uint8_t* p, size_t len) {
    size_t i = 0;
    for (; i + 4 <= len; i += 4) {
      ++counts[0][p[i]];
      ++counts[1][p[i + 1]];
      ++counts[2][p[i + 2]];
      ++counts[3][p[i + 3]];
    }
    for (; i < len; ++i) ++counts[0][p[i]];
  };
  size_t sampled = n;
  if (n <= kProbeBytes) {
    count_range(in, n);
  } else {
    const size_t window = kProbeBytes / kProbeWindows;
    const size_t stride = (n - window) / (kProbeWindows - 1);
    for (size_t w = 0; w < kProbeWindows; ++w) count_range(in + w * stride, window);
    sampled = kProbeBytes;
  }
  const float* clogc = count_log_table();
  double sum = 0;
  int seen = 0;
  for (int v = 0; v < 256; ++v) {
    const uint32_t c = counts[0][v] + counts[1][v] + counts[2][v] + counts[3][v];
    if (c) sum += clogc[c], ++seen;
  }
  // H = log2(N) - sum(c log2 c) / N. Miller-Madow: a sample's entropy
  // underestimates the source's by about (symbols seen - 1) / (2 N ln 2).
  const double total = static_cast<double>(sampled);
  const double per_byte =
      std::log2(total) - sum / total + (seen - 1) / (2 * total * std::log(2.0));
  return per_byte >= kRawEntropyBits;
}

// Byte planes of floats are mostly literals with few long repeats: what
// compresses them is the Huffman coding of the literals, and searching for
// matches costs most of the time while finding little (short matches even
// cost more than the literals they replace). So levels below 16 code planes
// with the fast strategy, a minimum match of 7, a small hash table and a
// large acceleration (targetLength: after a miss, skip ahead fast), with
// Huffman coding of literals forced on (the fast strategy with acceleration
// would turn it off). Measured on exponent planes of normal(0, 0.02) floats:
// 3-4x the speed of plain level 1 and about 10% smaller (docs/benchmarks.md, "Compression").
// Runs of repeats (zeros, constant tensors) are still found: a match is
// extended as far as it goes once seen. Where the library refuses the
// literal mode, planes are coded at level 1 with a minimum match of 7, as
// before. Levels 16..19 use zstd's optimal parsers as they are.
constexpr int kPlanesTargetLength = 64;
constexpr int kPlanesHashLog = 10;

bool set_param(ZSTD_CCtx* cctx, ZSTD_cParameter p, int v) {
  return !ZSTD_isError(ZSTD_CCtx_setParameter(cctx, p, v));
}

// The calling thread's context for planes, configured for `level` (kept
// configured between calls: a thread codes one level at a time, mostly).
ZSTD_CCtx* planes_cctx(int level) {
  struct Planes {
    std::unique_ptr<ZSTD_CCtx, CCtxDeleter> cctx{ZSTD_createCCtx()};
    int level = 0;  // configured for; 0: not yet
  };
  thread_local Planes planes;
  ZSTD_CCtx* cctx = planes.cctx.get();
  if (!cctx) throw TransformError("zstd: cannot create a compression context");
  if (planes.level == level) return cctx;
  planes.level = 0;
  ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
  bool ok = true;
  if (level >= 16) {
    ok = set_param(cctx, ZSTD_c_compressionLevel, level);
  } else {
    ok = set_param(cctx, ZSTD_c_compressionLevel, 1) && set_param(cctx, ZSTD_c_minMatch, 7);
    const bool huffman_forced =
        ok && set_param(cctx, ZSTD_c_literalCompressionMode, 1 /* ZSTD_ps_enable */);
    if (huffman_forced) {
      ok = set_param(cctx, ZSTD_c_targetLength, kPlanesTargetLength) &&
           set_param(cctx, ZSTD_c_hashLog, kPlanesHashLog);
    }
  }
  if (!ok) throw TransformError("zstd: cannot configure a compression context for level " +
                                std::to_string(level));
  planes.level = level;
  return cctx;
}

void check_planes(size_t n, size_t e, const char* what) {
  if (e == 0 || n % e != 0) {
    throw TransformError(std::string("zstdplanes: cannot ") + what + " " + std::to_string(n) +
                         " bytes as " + std::to_string(e) + " planes");
  }
}

// Appends the zstdplanes/1 encoding of in[0, n) (e planes, the bytegroup/1
// layout) to `out`: each plane one frame, raw where that is no bigger or the
// plane looks like noise.
void encode_planes(const uint8_t* in, size_t n, size_t e, int level, std::vector<uint8_t>& out) {
  check_planes(n, e, "encode");
  const size_t plane = n / e;
  const size_t raw = raw_frame_size(plane);
  const size_t cap = std::max(raw, ZSTD_compressBound(plane));
  const size_t start = out.size();
  out.resize(start + cap * e);
  ZSTD_CCtx* cctx = nullptr;
  size_t pos = start;
  for (size_t k = 0; k < e; ++k) {
    const uint8_t* p = in + k * plane;
    const bool noise = plane >= kRawProbeMinPlane ? looks_like_noise(p, plane)
                       : plane >= kDistinctSamples * 4 ? sample_looks_like_noise(p, plane)
                                                        : false;
    if (!noise) {
      if (cctx == nullptr) cctx = planes_cctx(level);
      const size_t r = ZSTD_compress2(cctx, out.data() + pos, cap, p, plane);
      if (ZSTD_isError(r)) throw TransformError(std::string("zstd: ") + ZSTD_getErrorName(r));
      if (r <= raw) {  // never pay more than a raw frame
        pos += r;
        continue;
      }
    }
    write_raw_frame(p, plane, out.data() + pos);
    pos += raw;
  }
  out.resize(pos);
}

// The length of the header of a single-segment frame without checksum or
// dictionary (the frames write_raw_frame writes), or 0 for any other input.
size_t raw_frame_header_size(const uint8_t* in, size_t n) {
  if (n < 6 || in[0] != 0x28 || in[1] != 0xB5 || in[2] != 0x2F || in[3] != 0xFD) return 0;
  const uint8_t fhd = in[4];
  if ((fhd & 0x20) == 0 || (fhd & 0x1F) != 0) return 0;  // single segment, nothing else
  static constexpr size_t kFcsBytes[4] = {1, 2, 4, 8};
  const size_t size = 5 + kFcsBytes[fhd >> 6];
  return size <= n ? size : 0;
}

// The 3-byte block header at in[0, 3).
uint32_t block_header(const uint8_t* in) {
  return static_cast<uint32_t>(in[0]) | static_cast<uint32_t>(in[1]) << 8 |
         static_cast<uint32_t>(in[2]) << 16;
}

// When in[0, n) is a frame of raw blocks only (what write_raw_frame writes:
// single segment, no checksum, no dictionary), copies its content into
// out[0, out_n) and returns true. Returns false for anything else, leaving
// it to zstd (which also reports what is wrong with a malformed frame).
// Copying directly skips the decompression context's per-frame set-up,
// which costs more than the copy for small planes.
bool copy_raw_frame(const uint8_t* in, size_t n, uint8_t* out, size_t out_n) {
  size_t pos = raw_frame_header_size(in, n);
  if (pos == 0) return false;
  size_t written = 0;
  for (;;) {
    if (n - pos < 3) return false;
    const uint32_t header = block_header(in + pos);
    pos += 3;
    const bool last = header & 1;
    const uint32_t type = (header >> 1) & 3;
    const size_t size = header >> 3;
    if (type != 0 || size > n - pos || size > out_n - written) return false;
    if (size) std::memcpy(out + written, in + pos, size);
    pos += size;
    written += size;
    if (last) break;
  }
  return pos == n && written == out_n;
}

// The content of a frame of exactly one raw block of `size` bytes (what
// write_raw_frame writes for a plane of up to 128 KiB), or null.
const uint8_t* single_raw_block(const uint8_t* in, size_t n, size_t size) {
  const size_t pos = raw_frame_header_size(in, n);
  if (pos == 0 || n - pos != 3 + size) return nullptr;
  return block_header(in + pos) == ((static_cast<uint32_t>(size) << 3) | 1u) ? in + pos + 3 : nullptr;
}

// Decodes a zstdplanes/1 encoding of out_n bytes (e planes): plane k is
// decoded into out + k * (out_n / e) and planes[k] points there, or, when
// `planes` is given and the plane is stored as a single raw block, planes[k]
// points at its bytes inside `in` and nothing is copied.
void decode_planes_to(const uint8_t* in, size_t n, size_t e, uint8_t* out, size_t out_n,
                      const uint8_t** planes) {
  check_planes(out_n, e, "decode");
  const size_t plane = out_n / e;
  size_t pos = 0;
  for (size_t k = 0; k < e; ++k) {
    auto fail = [k](const std::string& why) {
      throw TransformError("zstdplanes: plane " + std::to_string(k) + ": " + why);
    };
    if (pos >= n) fail("missing (" + std::to_string(e) + " expected)");
    const size_t frame = ZSTD_findFrameCompressedSize(in + pos, n - pos);
    if (ZSTD_isError(frame)) fail(ZSTD_getErrorName(frame));
    const unsigned long long size = ZSTD_getFrameContentSize(in + pos, frame);
    if (size != plane) fail("the frame does not record " + std::to_string(plane) + " bytes");
    uint8_t* dst = out + k * plane;
    if (planes) planes[k] = dst;
    if (plane && planes) {
      if (const uint8_t* raw = single_raw_block(in + pos, frame, plane)) {
        planes[k] = raw;
        pos += frame;
        continue;
      }
    }
    if (plane && copy_raw_frame(in + pos, frame, dst, plane)) {
      pos += frame;
      continue;
    }
    uint8_t unused = 0;  // zstd wants a valid pointer even for no output
    const size_t r = ZSTD_decompressDCtx(thread_dctx(), plane ? dst : &unused, plane, in + pos, frame);
    if (ZSTD_isError(r)) fail(ZSTD_getErrorName(r));
    if (r != plane) {
      fail("decoded " + std::to_string(r) + " bytes, expected " + std::to_string(plane));
    }
    pos += frame;
  }
  if (pos != n) {
    throw TransformError("zstdplanes: " + std::to_string(n - pos) + " bytes follow the last plane");
  }
}

// Decodes a zstdplanes/1 encoding into out[0, out_n) (e planes).
void decode_planes(const uint8_t* in, size_t n, size_t e, uint8_t* out, size_t out_n) {
  decode_planes_to(in, n, e, out, out_n, nullptr);
}

// Splits its input into one plane per byte of an element (the layout
// bytegroup/1 produces) and codes each plane as its own zstd frame, so each
// gets its own entropy tables: the exponent plane is compressed well, the
// mantissa planes do not dilute it.
class ZstdPlanesTransform final : public BlockTransform {
 public:
  explicit ZstdPlanesTransform(int level) : level_(level) {}

  std::string descriptor() const override { return kZstdPlanesDescriptor; }

  void encode(const uint8_t* in, size_t n, size_t e, std::vector<uint8_t>& out) const override {
    out.clear();
    encode_planes(in, n, e, level_, out);
  }

  // The sum of the frames' content sizes.
  uint64_t decoded_size(const uint8_t* in, size_t n) const override {
    uint64_t total = 0;
    for (size_t pos = 0; pos < n;) {
      const size_t frame = ZSTD_findFrameCompressedSize(in + pos, n - pos);
      if (ZSTD_isError(frame)) {
        throw TransformError(std::string("zstdplanes: ") + ZSTD_getErrorName(frame));
      }
      const unsigned long long size = ZSTD_getFrameContentSize(in + pos, frame);
      if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN) {
        throw TransformError("zstdplanes: a frame does not record its content size");
      }
      if (size > kMaxBlockStoredBytes - std::min<uint64_t>(total, kMaxBlockStoredBytes)) {
        throw TransformError("zstdplanes: the frames hold more than a block may");
      }
      total += size;
      pos += frame;
    }
    return total;
  }

  void decode(const uint8_t* in, size_t n, size_t e, uint8_t* out, size_t out_n) const override {
    decode_planes(in, n, e, out, out_n);
  }

 private:
  int level_;
};

}  // namespace

void zstd_encode_planes(const uint8_t* in, size_t n, size_t e, int level,
                        std::vector<uint8_t>& out) {
  encode_planes(in, n, e, level, out);
}

void zstd_decode_planes_to(const uint8_t* in, size_t n, size_t e, uint8_t* out, size_t out_n,
                           const uint8_t** planes) {
  decode_planes_to(in, n, e, out, out_n, planes);
}

std::unique_ptr<BlockTransform> new_zstd_planes(int level) {
  return std::make_unique<ZstdPlanesTransform>(level);
}

}  // namespace checkpoint::codec_detail
