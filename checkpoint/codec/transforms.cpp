// The transform registry (descriptor -> transform), the chains a save uses,
// and TransformChain; each transform lives in its own file (builtin.h).
#include "checkpoint/codec/transforms.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "checkpoint/codec/builtin.h"
#include "checkpoint/codec/byte_planes.h"
#include "checkpoint/format/metadata.h"

namespace checkpoint {

namespace codec_detail {

// Per-thread buffers that only grow, never zero-filled: decoding and the
// fused float-group path need a block-sized intermediate, and allocating
// (and page-faulting) one per block costs more than the shuffle itself.
// Slot 0 holds encoder input planes, slot 1 decoder output planes. A thread
// keeps at most one block's worth per slot.
uint8_t* thread_scratch(int slot, size_t n) {
  struct Buffer {
    std::unique_ptr<uint8_t[]> data;
    size_t size = 0;
  };
  thread_local Buffer buffers[2];
  Buffer& b = buffers[slot];
  if (b.size < n) {
    b.data.reset();  // release the old one before taking the new one
    b.size = 0;
    b.data.reset(new uint8_t[n]);
    b.size = n;
  }
  return b.data.get();
}

}  // namespace codec_detail

namespace {

const std::map<std::string, std::shared_ptr<const BlockTransform>>& registry() {
  static const auto* transforms = new std::map<std::string, std::shared_ptr<const BlockTransform>>{
      {kZstdDescriptor, codec_detail::new_zstd(codec_detail::kDefaultZstdLevel)},
      {kByteGroupDescriptor, codec_detail::new_bytegroup()},
      {kSignRotDescriptor, codec_detail::new_signrot()},
      {kZstdPlanesDescriptor, codec_detail::new_zstd_planes(codec_detail::kDefaultZstdLevel)},
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
  return codec_detail::new_zstd(level);
}

std::unique_ptr<BlockTransform> make_zstd_planes(int level) {
  check_level(level);
  return codec_detail::new_zstd_planes(level);
}

std::vector<std::string> transform_chain_for(const CompressionOptions& c, DType dtype) {
  if (c.codec == Codec::kNone) return {};
  bool group = false;
  switch (c.byte_group) {
    case ByteGroup::kOn: group = true; break;
    case ByteGroup::kOff: group = false; break;
    case ByteGroup::kAuto:
      group = dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16;
      break;
  }
  if (group) return {kSignRotDescriptor, kByteGroupDescriptor, kZstdPlanesDescriptor};
  return {kZstdDescriptor};
}

void TransformChain::detect_float_group(const std::vector<std::string>& descriptors,
                                        int zstd_level) {
  float_group_ = descriptors.size() == 3 && descriptors[0] == kSignRotDescriptor &&
                 descriptors[1] == kByteGroupDescriptor && descriptors[2] == kZstdPlanesDescriptor;
  float_group_level_ = zstd_level;
}

TransformChain TransformChain::for_decoding(const std::vector<std::string>& descriptors) {
  TransformChain chain;
  for (const std::string& d : descriptors) chain.transforms_.push_back(find_shared(d));
  chain.detect_float_group(descriptors, codec_detail::kDefaultZstdLevel);
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
  chain.detect_float_group(descriptors, zstd_level);
  return chain;
}

void TransformChain::encode(const uint8_t* in, size_t n, size_t element_size,
                            std::vector<uint8_t>& out) const {
  out.clear();
  encode_append(in, n, element_size, out);
}

void TransformChain::encode_append(const uint8_t* in, size_t n, size_t element_size,
                                   std::vector<uint8_t>& out) const {
  if (transforms_.empty()) {
    out.insert(out.end(), in, in + n);
    return;
  }
  if (float_group_ && codec_detail::rotatable(element_size) && n % element_size == 0) {
    uint8_t* planes = codec_detail::thread_scratch(0, n);
    split_planes(in, n / element_size, element_size, true, planes);
    codec_detail::zstd_encode_planes(planes, n, element_size, float_group_level_, out);
    return;
  }
  // Anything else goes through the transforms one by one (which also
  // reports what is wrong with input the fused path does not take).
  std::vector<uint8_t> buffers[2];
  for (size_t i = 0; i < transforms_.size(); ++i) {
    std::vector<uint8_t>& dst = buffers[i % 2];
    if (i == 0) {
      transforms_[i]->encode(in, n, element_size, dst);
    } else {
      const std::vector<uint8_t>& src = buffers[(i + 1) % 2];
      transforms_[i]->encode(src.data(), src.size(), element_size, dst);
    }
  }
  std::vector<uint8_t>& last = buffers[(transforms_.size() - 1) % 2];
  if (out.empty()) {
    out = std::move(last);
    return;
  }
  // Appended with resize + memcpy rather than out.insert(end, last.begin(),
  // last.end()): GCC 14 at -O2 inlines vector's range insert and then reports
  // a -Wstringop-overflow on its reallocation path that cannot happen (a
  // known false positive of that pass). Same bytes, same single growth.
  const size_t old_size = out.size();
  out.resize(old_size + last.size());
  if (!last.empty()) std::memcpy(out.data() + old_size, last.data(), last.size());
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
  if (float_group_ && codec_detail::rotatable(element_size) && out_n % element_size == 0) {
    // Planes stored raw are merged straight from `in`.
    const uint8_t* planes[kMaxPlanes];
    codec_detail::zstd_decode_planes_to(in, n, element_size, codec_detail::thread_scratch(1, out_n),
                                        out_n, planes);
    merge_planes_from(planes, out_n / element_size, element_size, true, out);
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
