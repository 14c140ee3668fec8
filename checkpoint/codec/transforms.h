#pragma once
// Per-block stream transforms (compression, byte grouping), recorded in the
// metadata by versioned descriptor ("zstd/1", "signrot/1", "bytegroup/1",
// "zstdplanes/1"; FORMAT.md defines each) and looked up in
// a registry when reading. A chunk's transforms are applied to each of its
// blocks in order; readers invert them in reverse (FORMAT.md, "Data files").
// Torch-free.
//
// Thread safety: transforms are immutable; encode/decode may run concurrently
// on any number of threads.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/errors.h"  // TransformError
#include "checkpoint/options.h"
#include "checkpoint/format/types.h"

namespace checkpoint {

class BlockTransform {
 public:
  virtual ~BlockTransform();

  // The versioned name recorded in the metadata, e.g. "zstd/1".
  virtual std::string descriptor() const = 0;

  // Replaces the contents of `out` with the encoding of `in[0, n)`.
  // `element_size` is the item's element size (used by byte grouping).
  // Throws TransformError when the input cannot be encoded.
  virtual void encode(const uint8_t* in, size_t n, size_t element_size,
                      std::vector<uint8_t>& out) const = 0;

  // The length `in[0, n)` decodes to, read from the encoded bytes themselves
  // (untrusted: the caller bounds it before allocating). Throws
  // TransformError when the input does not say.
  virtual uint64_t decoded_size(const uint8_t* in, size_t n) const = 0;

  // Decodes `in[0, n)` into `out[0, out_n)`.
  // REQUIRES: out_n is the decoded length the writer recorded.
  // Untrusted input: throws TransformError (saying what is wrong) when it is
  // corrupt or does not decode to exactly out_n bytes; never writes past
  // out_n, never crashes.
  virtual void decode(const uint8_t* in, size_t n, size_t element_size, uint8_t* out,
                      size_t out_n) const = 0;
};

constexpr const char* kZstdDescriptor = "zstd/1";
constexpr const char* kByteGroupDescriptor = "bytegroup/1";
constexpr const char* kSignRotDescriptor = "signrot/1";
constexpr const char* kZstdPlanesDescriptor = "zstdplanes/1";

// The registry's transform for `descriptor` (a process-lifetime singleton).
// Its encoder uses default settings (zstd level 3); its decoder reads what
// any settings produced. Throws TransformError "unknown transform descriptor
// 'x/9'" for descriptors this build does not know.
const BlockTransform& find_transform(const std::string& descriptor);

// A zstd/1 encoder at `level` (1..19, else TransformError). The level is a
// writer choice; decoding does not need it.
std::unique_ptr<BlockTransform> make_zstd(int level);

// A zstdplanes/1 encoder at `level` (1..19, else TransformError). Planes
// that look like noise are stored raw; levels below 16 all code the others
// with zstd's fast strategy, Huffman-coded literals forced on, a minimum
// match of 7 and a large acceleration (smaller than any fast level on float
// byte planes, and several times faster); 16..19 as zstd does.
std::unique_ptr<BlockTransform> make_zstd_planes(int level);

// The descriptors a writer applies to chunks of `dtype` under `c`:
//   codec none -> {}
//   codec zstd -> {"zstd/1"}, or float grouping {"signrot/1", "bytegroup/1",
//                 "zstdplanes/1"} when byte_group is on, or auto and
//                 dtype is float32/bfloat16/float16.
// Chunks written by older builds as {"bytegroup/1", "zstd/1"} stay readable.
std::vector<std::string> transform_chain_for(const CompressionOptions& c, DType dtype);

// A resolved list of transforms applied in order; empty = identity. The
// float-grouping chain {"signrot/1", "bytegroup/1", "zstdplanes/1"} runs
// fused: one pass rotates and splits into planes, and the planes are coded
// straight from (decoded straight into) a per-thread scratch buffer of one
// block, with the bytes the three transforms produce one after another.
class TransformChain {
 public:
  TransformChain() = default;

  // For reading: every descriptor from the registry (TransformError for an
  // unknown one).
  static TransformChain for_decoding(const std::vector<std::string>& descriptors);
  // For writing: like for_decoding, but zstd/1 and zstdplanes/1 encode at
  // `zstd_level`.
  static TransformChain for_encoding(const std::vector<std::string>& descriptors, int zstd_level);

  bool is_identity() const { return transforms_.empty(); }

  // Replaces `out` with in[0, n) passed through every transform in order.
  void encode(const uint8_t* in, size_t n, size_t element_size, std::vector<uint8_t>& out) const;
  // The same, appended to what `out` holds already.
  void encode_append(const uint8_t* in, size_t n, size_t element_size,
                     std::vector<uint8_t>& out) const;

  // Inverts encode into out[0, out_n). Intermediate results are bounded by
  // kMaxBlockStoredBytes. Same error contract as BlockTransform::decode.
  void decode(const uint8_t* in, size_t n, size_t element_size, uint8_t* out, size_t out_n) const;

 private:
  void detect_float_group(const std::vector<std::string>& descriptors, int zstd_level);

  std::vector<std::shared_ptr<const BlockTransform>> transforms_;
  bool float_group_ = false;  // the fused float-grouping chain
  int float_group_level_ = 3;
};

}  // namespace checkpoint
