#include "checkpoint/transforms.h"

#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "checkpoint/metadata.h"

namespace checkpoint {

namespace {

constexpr int kDefaultZstdLevel = 3;

// ---- zstd/1 ----------------------------------------------------------------------

struct CCtxDeleter {
  void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
};
struct DCtxDeleter {
  void operator()(ZSTD_DCtx* d) const { ZSTD_freeDCtx(d); }
};

// One context per thread: creating one per block costs more than coding a
// small block.
ZSTD_CCtx* thread_cctx() {
  thread_local std::unique_ptr<ZSTD_CCtx, CCtxDeleter> cctx(ZSTD_createCCtx());
  if (!cctx) throw TransformError("zstd: cannot create a compression context");
  return cctx.get();
}

ZSTD_DCtx* thread_dctx() {
  thread_local std::unique_ptr<ZSTD_DCtx, DCtxDeleter> dctx(ZSTD_createDCtx());
  if (!dctx) throw TransformError("zstd: cannot create a decompression context");
  return dctx.get();
}

class ZstdTransform final : public BlockTransform {
 public:
  explicit ZstdTransform(int level) : level_(level) {}

  std::string descriptor() const override { return kZstdDescriptor; }

  void encode(const uint8_t* in, size_t n, size_t, std::vector<uint8_t>& out) const override {
    out.resize(ZSTD_compressBound(n));
    const size_t r = ZSTD_compressCCtx(thread_cctx(), out.data(), out.size(), in, n, level_);
    if (ZSTD_isError(r)) throw TransformError(std::string("zstd: ") + ZSTD_getErrorName(r));
    out.resize(r);
  }

  uint64_t decoded_size(const uint8_t* in, size_t n) const override {
    const unsigned long long size = ZSTD_getFrameContentSize(in, n);
    if (size == ZSTD_CONTENTSIZE_ERROR) throw TransformError("zstd: not a zstd frame");
    if (size == ZSTD_CONTENTSIZE_UNKNOWN) {
      throw TransformError("zstd: the frame does not record its content size");
    }
    return size;
  }

  void decode(const uint8_t* in, size_t n, size_t, uint8_t* out, size_t out_n) const override {
    const uint64_t size = decoded_size(in, n);
    if (size != out_n) {
      throw TransformError("zstd: the frame holds " + std::to_string(size) + " bytes, expected " +
                           std::to_string(out_n));
    }
    const size_t frame = ZSTD_findFrameCompressedSize(in, n);
    if (ZSTD_isError(frame)) throw TransformError(std::string("zstd: ") + ZSTD_getErrorName(frame));
    if (frame != n) {
      throw TransformError("zstd: " + std::to_string(n - frame) + " bytes follow the frame");
    }
    uint8_t unused = 0;  // zstd wants a valid pointer even for no output
    const size_t r = ZSTD_decompressDCtx(thread_dctx(), out_n ? out : &unused, out_n, in, n);
    if (ZSTD_isError(r)) throw TransformError(std::string("zstd: ") + ZSTD_getErrorName(r));
    if (r != out_n) {
      throw TransformError("zstd: decoded " + std::to_string(r) + " bytes, expected " +
                           std::to_string(out_n));
    }
  }

 private:
  int level_;
};

// ---- bytegroup/1 -----------------------------------------------------------------

// Plane k of `out` holds byte k of every element of `in`.
template <size_t E>
void group_bytes(const uint8_t* in, size_t count, uint8_t* out) {
  for (size_t i = 0; i < count; ++i) {
    for (size_t k = 0; k < E; ++k) out[k * count + i] = in[i * E + k];
  }
}

template <size_t E>
void ungroup_bytes(const uint8_t* in, size_t count, uint8_t* out) {
  for (size_t i = 0; i < count; ++i) {
    for (size_t k = 0; k < E; ++k) out[i * E + k] = in[k * count + i];
  }
}

void group_bytes_any(const uint8_t* in, size_t count, size_t e, uint8_t* out) {
  for (size_t i = 0; i < count; ++i) {
    for (size_t k = 0; k < e; ++k) out[k * count + i] = in[i * e + k];
  }
}

void ungroup_bytes_any(const uint8_t* in, size_t count, size_t e, uint8_t* out) {
  for (size_t i = 0; i < count; ++i) {
    for (size_t k = 0; k < e; ++k) out[i * e + k] = in[k * count + i];
  }
}

class ByteGroupTransform final : public BlockTransform {
 public:
  std::string descriptor() const override { return kByteGroupDescriptor; }

  void encode(const uint8_t* in, size_t n, size_t e, std::vector<uint8_t>& out) const override {
    check(n, e, "encode");
    out.resize(n);
    const size_t count = e ? n / e : 0;
    switch (e) {
      case 1: if (n) std::memcpy(out.data(), in, n); break;
      case 2: group_bytes<2>(in, count, out.data()); break;
      case 4: group_bytes<4>(in, count, out.data()); break;
      case 8: group_bytes<8>(in, count, out.data()); break;
      default: group_bytes_any(in, count, e, out.data()); break;
    }
  }

  uint64_t decoded_size(const uint8_t*, size_t n) const override { return n; }

  void decode(const uint8_t* in, size_t n, size_t e, uint8_t* out, size_t out_n) const override {
    if (n != out_n) {
      throw TransformError("bytegroup: " + std::to_string(n) + " bytes cannot decode to " +
                           std::to_string(out_n));
    }
    check(n, e, "decode");
    const size_t count = n / e;
    switch (e) {
      case 1: if (n) std::memcpy(out, in, n); break;
      case 2: ungroup_bytes<2>(in, count, out); break;
      case 4: ungroup_bytes<4>(in, count, out); break;
      case 8: ungroup_bytes<8>(in, count, out); break;
      default: ungroup_bytes_any(in, count, e, out); break;
    }
  }

 private:
  static void check(size_t n, size_t e, const char* what) {
    if (e == 0 || n % e != 0) {
      throw TransformError(std::string("bytegroup: cannot ") + what + " " + std::to_string(n) +
                           " bytes as elements of " + std::to_string(e) + " bytes");
    }
  }
};

// ---- signrot/1 -------------------------------------------------------------------

// Each element, read as an unsigned little-endian integer, rotated left by
// one bit (`left`) or right by one bit (the inverse).
template <typename U>
void rotate_elements(const uint8_t* in, size_t count, uint8_t* out, bool left) {
  constexpr unsigned kBits = sizeof(U) * 8;
  for (size_t i = 0; i < count; ++i) {
    U x;
    std::memcpy(&x, in + i * sizeof(U), sizeof(U));
    x = left ? static_cast<U>((x << 1) | (x >> (kBits - 1)))
             : static_cast<U>((x >> 1) | (x << (kBits - 1)));
    std::memcpy(out + i * sizeof(U), &x, sizeof(U));
  }
}

void rotate_any(const uint8_t* in, size_t n, size_t e, uint8_t* out, bool left,
                const char* what) {
  if (e == 0 || n % e != 0) {
    throw TransformError(std::string("signrot: cannot ") + what + " " + std::to_string(n) +
                         " bytes as elements of " + std::to_string(e) + " bytes");
  }
  const size_t count = n / e;
  switch (e) {
    case 1: rotate_elements<uint8_t>(in, count, out, left); break;
    case 2: rotate_elements<uint16_t>(in, count, out, left); break;
    case 4: rotate_elements<uint32_t>(in, count, out, left); break;
    case 8: rotate_elements<uint64_t>(in, count, out, left); break;
    default:
      throw TransformError("signrot: element size " + std::to_string(e) +
                           " is not one of 1, 2, 4, 8");
  }
}

// Moves the sign bit of every element to its least significant bit, so that
// the top byte of a bfloat16 or float32 is exactly its exponent.
class SignRotTransform final : public BlockTransform {
 public:
  std::string descriptor() const override { return kSignRotDescriptor; }

  void encode(const uint8_t* in, size_t n, size_t e, std::vector<uint8_t>& out) const override {
    out.resize(n);
    rotate_any(in, n, e, out.data(), true, "encode");
  }

  uint64_t decoded_size(const uint8_t*, size_t n) const override { return n; }

  void decode(const uint8_t* in, size_t n, size_t e, uint8_t* out, size_t out_n) const override {
    if (n != out_n) {
      throw TransformError("signrot: " + std::to_string(n) + " bytes cannot decode to " +
                           std::to_string(out_n));
    }
    rotate_any(in, n, e, out, false, "decode");
  }
};

// ---- zstdplanes/1 ----------------------------------------------------------------

// A plane at least this long whose bytes are close to uniform (order-0
// entropy of 7.9 bits per byte or more) is stored as a raw frame without
// running the compressor over it: the low mantissa bytes of floats are noise
// that zstd cannot shrink, and trying costs more than all the rest. (Shorter
// planes are compressed regardless: the estimate is unreliable there, and
// they are cheap.)
constexpr size_t kRawProbeMinPlane = 1024;
constexpr double kRawEntropyBits = 7.9;
// zstd's largest block; a raw frame is a run of raw blocks of at most this.
constexpr size_t kZstdMaxBlock = size_t{128} << 10;

// The bytes append_raw_frame writes for n bytes.
size_t raw_frame_size(size_t n) {
  const size_t fcs_bytes = n < 256 ? 1 : n < 65536 + 256 ? 2 : n <= 0xFFFFFFFFu ? 4 : 8;
  const size_t blocks = std::max<size_t>(1, (n + kZstdMaxBlock - 1) / kZstdMaxBlock);
  return 5 + fcs_bytes + 3 * blocks + n;
}

void put_le(std::vector<uint8_t>& out, uint64_t v, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// Appends a standard single-segment zstd frame that stores in[0, n) in raw
// blocks and records its content size (RFC 8878, 3.1.1).
void append_raw_frame(const uint8_t* in, size_t n, std::vector<uint8_t>& out) {
  put_le(out, 0xFD2FB528u, 4);
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
  out.push_back(static_cast<uint8_t>((fcs_flag << 6) | (1u << 5)));
  put_le(out, fcs, fcs_bytes);
  size_t pos = 0;
  do {
    const size_t len = std::min(kZstdMaxBlock, n - pos);
    const bool last = pos + len == n;
    put_le(out, (static_cast<uint64_t>(len) << 3) | (last ? 1u : 0u), 3);  // type 0: raw
    out.insert(out.end(), in + pos, in + pos + len);
    pos += len;
  } while (pos < n);
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
    check(n, e, "encode");
    const size_t plane = n / e;
    out.clear();
    out.reserve(raw_frame_size(plane) * e);
    std::vector<uint8_t> frame;
    for (size_t k = 0; k < e; ++k) {
      const uint8_t* p = in + k * plane;
      if (plane >= kRawProbeMinPlane && looks_like_noise(p, plane)) {
        append_raw_frame(p, plane, out);
        continue;
      }
      compress(p, plane, level_, frame);
      if (frame.size() > raw_frame_size(plane)) {
        append_raw_frame(p, plane, out);  // never pay more than a raw frame
      } else {
        out.insert(out.end(), frame.begin(), frame.end());
      }
    }
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
    check(out_n, e, "decode");
    const size_t plane = out_n / e;
    size_t pos = 0;
    for (size_t k = 0; k < e; ++k) {
      const std::string which = "zstdplanes: plane " + std::to_string(k) + ": ";
      if (pos >= n) throw TransformError(which + "missing (" + std::to_string(e) + " expected)");
      const size_t frame = ZSTD_findFrameCompressedSize(in + pos, n - pos);
      if (ZSTD_isError(frame)) throw TransformError(which + ZSTD_getErrorName(frame));
      const unsigned long long size = ZSTD_getFrameContentSize(in + pos, frame);
      if (size != plane) {
        throw TransformError(which + "the frame does not record " + std::to_string(plane) +
                             " bytes");
      }
      uint8_t unused = 0;  // zstd wants a valid pointer even for no output
      const size_t r = ZSTD_decompressDCtx(thread_dctx(), plane ? out + k * plane : &unused,
                                           plane, in + pos, frame);
      if (ZSTD_isError(r)) throw TransformError(which + ZSTD_getErrorName(r));
      if (r != plane) {
        throw TransformError(which + "decoded " + std::to_string(r) + " bytes, expected " +
                             std::to_string(plane));
      }
      pos += frame;
    }
    if (pos != n) throw TransformError("zstdplanes: " + std::to_string(n - pos) +
                                       " bytes follow the last plane");
  }

 private:
  static void check(size_t n, size_t e, const char* what) {
    if (e == 0 || n % e != 0) {
      throw TransformError(std::string("zstdplanes: cannot ") + what + " " + std::to_string(n) +
                           " bytes as " + std::to_string(e) + " planes");
    }
  }

  // Byte planes of floats are mostly literals with few long repeats: matches
  // shorter than 7 bytes cost more than the literals they replace, and once
  // they are excluded the fast strategy stores planes as small as levels up
  // to 15 do (measured on trained weights and AdamW moments), at a fraction
  // of the time. So levels below 16 code planes at level 1 with a minimum
  // match of 7; levels 16..19 use zstd's optimal parsers as they are.
  static void compress(const uint8_t* in, size_t n, int level, std::vector<uint8_t>& out) {
    ZSTD_CCtx* cctx = thread_cctx();
    ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
    const bool fast = level < 16;
    size_t r = ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, fast ? 1 : level);
    if (!ZSTD_isError(r) && fast) r = ZSTD_CCtx_setParameter(cctx, ZSTD_c_minMatch, 7);
    if (ZSTD_isError(r)) throw TransformError(std::string("zstd: ") + ZSTD_getErrorName(r));
    out.resize(ZSTD_compressBound(n));
    r = ZSTD_compress2(cctx, out.data(), out.size(), in, n);
    if (ZSTD_isError(r)) throw TransformError(std::string("zstd: ") + ZSTD_getErrorName(r));
    out.resize(r);
  }

  static bool looks_like_noise(const uint8_t* in, size_t n) {
    uint32_t counts[4][256] = {};  // four tables: fewer store-to-load stalls
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
      ++counts[0][in[i]];
      ++counts[1][in[i + 1]];
      ++counts[2][in[i + 2]];
      ++counts[3][in[i + 3]];
    }
    for (; i < n; ++i) ++counts[0][in[i]];
    double bits = 0;
    int seen = 0;
    const double total = static_cast<double>(n);
    for (int v = 0; v < 256; ++v) {
      const uint32_t c = counts[0][v] + counts[1][v] + counts[2][v] + counts[3][v];
      if (c) bits -= c * std::log2(c / total), ++seen;
    }
    // Miller-Madow: a sample's entropy underestimates the source's by about
    // (symbols seen - 1) / (2 n ln 2) bits per byte.
    const double per_byte = bits / total + (seen - 1) / (2 * total * std::log(2.0));
    return per_byte >= kRawEntropyBits;
  }

  int level_;
};

const std::map<std::string, std::shared_ptr<const BlockTransform>>& registry() {
  static const auto* transforms = new std::map<std::string, std::shared_ptr<const BlockTransform>>{
      {kZstdDescriptor, std::make_shared<ZstdTransform>(kDefaultZstdLevel)},
      {kByteGroupDescriptor, std::make_shared<ByteGroupTransform>()},
      {kSignRotDescriptor, std::make_shared<SignRotTransform>()},
      {kZstdPlanesDescriptor, std::make_shared<ZstdPlanesTransform>(kDefaultZstdLevel)},
  };
  return *transforms;
}

const std::shared_ptr<const BlockTransform>& find_shared(const std::string& descriptor) {
  const auto& transforms = registry();
  auto it = transforms.find(descriptor);
  if (it == transforms.end()) {
    throw TransformError("unknown transform descriptor '" + descriptor + "'");
  }
  return it->second;
}

}  // namespace

BlockTransform::~BlockTransform() = default;

const BlockTransform& find_transform(const std::string& descriptor) {
  return *find_shared(descriptor);
}

namespace {

void check_level(int level) {
  if (level < 1 || level > 19) {
    throw TransformError("compression.level " + std::to_string(level) + " is outside 1..19");
  }
}

}  // namespace

std::unique_ptr<BlockTransform> make_zstd(int level) {
  check_level(level);
  return std::make_unique<ZstdTransform>(level);
}

std::unique_ptr<BlockTransform> make_zstd_planes(int level) {
  check_level(level);
  return std::make_unique<ZstdPlanesTransform>(level);
}

std::vector<std::string> transform_chain_for(const CompressionOptions& c, DType dtype) {
  if (c.codec == "none") return {};
  if (c.codec != "zstd") {
    throw TransformError("compression.codec '" + c.codec + "' is not one of none, zstd");
  }
  bool group = false;
  if (c.byte_group == "on") {
    group = true;
  } else if (c.byte_group == "auto") {
    group = dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16;
  } else if (c.byte_group != "off") {
    throw TransformError("compression.byte_group '" + c.byte_group +
                         "' is not one of auto, on, off");
  }
  if (group) return {kSignRotDescriptor, kByteGroupDescriptor, kZstdPlanesDescriptor};
  return {kZstdDescriptor};
}

TransformChain TransformChain::for_decoding(const std::vector<std::string>& descriptors) {
  TransformChain chain;
  for (const std::string& d : descriptors) chain.transforms_.push_back(find_shared(d));
  return chain;
}

TransformChain TransformChain::for_encoding(const std::vector<std::string>& descriptors,
                                            int zstd_level) {
  TransformChain chain;
  for (const std::string& d : descriptors) {
    if (d == kZstdDescriptor) {
      chain.transforms_.push_back(make_zstd(zstd_level));
    } else if (d == kZstdPlanesDescriptor) {
      chain.transforms_.push_back(make_zstd_planes(zstd_level));
    } else {
      chain.transforms_.push_back(find_shared(d));
    }
  }
  return chain;
}

void TransformChain::encode(const uint8_t* in, size_t n, size_t element_size,
                            std::vector<uint8_t>& out) const {
  if (transforms_.empty()) {
    out.assign(in, in + n);
    return;
  }
  std::vector<uint8_t> scratch;
  for (size_t i = 0; i < transforms_.size(); ++i) {
    // The last transform writes into `out`; earlier ones alternate with it.
    const bool into_out = (transforms_.size() - i) % 2 == 1;
    std::vector<uint8_t>& dst = into_out ? out : scratch;
    const std::vector<uint8_t>& src = into_out ? scratch : out;
    if (i == 0) {
      transforms_[i]->encode(in, n, element_size, dst);
    } else {
      transforms_[i]->encode(src.data(), src.size(), element_size, dst);
    }
  }
}

void TransformChain::decode(const uint8_t* in, size_t n, size_t element_size, uint8_t* out,
                            size_t out_n) const {
  if (transforms_.empty()) {
    if (n != out_n) {
      throw TransformError("stored " + std::to_string(n) + " bytes for " + std::to_string(out_n) +
                           " logical bytes without a transform");
    }
    if (n) std::memcpy(out, in, n);
    return;
  }
  std::vector<uint8_t> buffers[2];
  const uint8_t* cur = in;
  size_t cur_n = n;
  for (size_t i = transforms_.size(); i-- > 0;) {
    const BlockTransform& t = *transforms_[i];
    if (i == 0) {
      t.decode(cur, cur_n, element_size, out, out_n);
      return;
    }
    const uint64_t size = t.decoded_size(cur, cur_n);
    if (size > kMaxBlockStoredBytes) {
      throw TransformError(t.descriptor() + ": claims to decode to " + std::to_string(size) +
                           " bytes, more than a block may hold");
    }
    std::vector<uint8_t>& next = buffers[i % 2];
    next.resize(static_cast<size_t>(size));
    t.decode(cur, cur_n, element_size, next.data(), next.size());
    cur = next.data();
    cur_n = next.size();
  }
}

}  // namespace checkpoint
