#include "checkpoint/transforms.h"

#include <zstd.h>

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

const std::map<std::string, std::shared_ptr<const BlockTransform>>& registry() {
  static const auto* transforms = new std::map<std::string, std::shared_ptr<const BlockTransform>>{
      {kZstdDescriptor, std::make_shared<ZstdTransform>(kDefaultZstdLevel)},
      {kByteGroupDescriptor, std::make_shared<ByteGroupTransform>()},
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

std::unique_ptr<BlockTransform> make_zstd(int level) {
  if (level < 1 || level > 19) {
    throw TransformError("compression.level " + std::to_string(level) + " is outside 1..19");
  }
  return std::make_unique<ZstdTransform>(level);
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
  if (group) return {kByteGroupDescriptor, kZstdDescriptor};
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
