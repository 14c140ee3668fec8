// "signrot/1": the sign bit of every element moves to its lowest bit (FORMAT.md, "Transforms").
#include "checkpoint/codec/builtin.h"

#include <string>
#include <vector>

#include "checkpoint/codec/byte_planes.h"

namespace checkpoint::codec_detail {

namespace {

void rotate_any(const uint8_t* in, size_t n, size_t e, uint8_t* out, bool left,
                const char* what) {
  if (e == 0 || n % e != 0) {
    throw TransformError(std::string("signrot: cannot ") + what + " " + std::to_string(n) +
                         " bytes as elements of " + std::to_string(e) + " bytes");
  }
  if (!rotatable(e)) {
    throw TransformError("signrot: element size " + std::to_string(e) +
                         " is not one of 1, 2, 4, 8");
  }
  rotate_elements(in, n / e, e, left, out);
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

}  // namespace

std::unique_ptr<BlockTransform> new_signrot() { return std::make_unique<SignRotTransform>(); }

}  // namespace checkpoint::codec_detail
