// "zstd/1": the block is one zstd frame (FORMAT.md, "Transforms").
#include "checkpoint/codec/builtin.h"

#include <string>
#include <vector>

namespace checkpoint::codec_detail {

namespace {

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

}  // namespace

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

std::unique_ptr<BlockTransform> new_zstd(int level) { return std::make_unique<ZstdTransform>(level); }

}  // namespace checkpoint::codec_detail
