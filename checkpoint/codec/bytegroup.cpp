// "bytegroup/1": byte k of every element into plane k (FORMAT.md, "Transforms").
#include "checkpoint/codec/builtin.h"

#include <string>
#include <vector>

#include "checkpoint/codec/byte_planes.h"

namespace checkpoint::codec_detail {

namespace {

class ByteGroupTransform final : public BlockTransform {
 public:
  std::string descriptor() const override { return kByteGroupDescriptor; }

  void encode(const uint8_t* in, size_t n, size_t e, std::vector<uint8_t>& out) const override {
    check(n, e, "encode");
    out.resize(n);
    split_planes(in, n / e, e, false, out.data());
  }

  uint64_t decoded_size(const uint8_t*, size_t n) const override { return n; }

  void decode(const uint8_t* in, size_t n, size_t e, uint8_t* out, size_t out_n) const override {
    if (n != out_n) {
      throw TransformError("bytegroup: " + std::to_string(n) + " bytes cannot decode to " +
                           std::to_string(out_n));
    }
    check(n, e, "decode");
    merge_planes(in, n / e, e, false, out);
  }

 private:
  static void check(size_t n, size_t e, const char* what) {
    if (e == 0 || n % e != 0) {
      throw TransformError(std::string("bytegroup: cannot ") + what + " " + std::to_string(n) +
                           " bytes as elements of " + std::to_string(e) + " bytes");
    }
  }
};

}  // namespace

std::unique_ptr<BlockTransform> new_bytegroup() { return std::make_unique<ByteGroupTransform>(); }

}  // namespace checkpoint::codec_detail
