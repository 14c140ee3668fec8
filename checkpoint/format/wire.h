#pragma once
// Internal: little-endian byte encoding shared by the metadata file and the
// plan blobs exchanged between ranks. Not part of the public API.
//
// Integers: fixed-width little-endian (u8, u32, u64) or LEB128 varints
// (unsigned) and zigzag varints (signed). Strings: varint length + bytes.
// ByteReader bounds-checks every read and throws WireError; callers add the
// context (file, item, chunk) and rethrow their own error type.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/types.h"

namespace checkpoint::wire {

class WireError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ByteWriter {
 public:
  void put_u8(uint8_t v) { out_.push_back(v); }
  void put_u32(uint32_t v) { put_fixed(v, 4); }
  void put_u64(uint64_t v) { put_fixed(v, 8); }
  void put_varint(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<uint8_t>(v | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<uint8_t>(v));
  }
  void put_zigzag(int64_t v) {
    put_varint((static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63));
  }
  void put_string(const std::string& s) {
    put_varint(s.size());
    out_.insert(out_.end(), s.begin(), s.end());
  }
  void put_bytes(const uint8_t* data, size_t size) { out_.insert(out_.end(), data, data + size); }

  std::vector<uint8_t>& bytes() { return out_; }
  std::vector<uint8_t> release() { return std::move(out_); }

 private:
  void put_fixed(uint64_t v, size_t n) { append_le(out_, v, n); }
  std::vector<uint8_t> out_;
};

// Reads from [data, data + size). Never reads past the end; never allocates
// more than the bytes that remain can justify.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  size_t position() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  bool at_end() const { return pos_ == size_; }

  uint8_t get_u8(const char* what) {
    require(1, what);
    return data_[pos_++];
  }
  uint32_t get_u32(const char* what) { return static_cast<uint32_t>(get_fixed(4, what)); }
  uint64_t get_u64(const char* what) { return get_fixed(8, what); }

  uint64_t get_varint(const char* what) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t byte = get_u8(what);
      // The 10th byte may only carry the top bit of a 64-bit value.
      if (shift == 63 && byte > 1) fail(what, "varint overflows 64 bits");
      v |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return v;
    }
    fail(what, "varint longer than 10 bytes");
  }
  int64_t get_zigzag(const char* what) {
    uint64_t u = get_varint(what);
    return static_cast<int64_t>((u >> 1) ^ (~(u & 1) + 1));
  }
  // A varint that must fit in int64 (sizes, offsets stored unsigned).
  uint64_t get_varint_max(uint64_t max, const char* what) {
    uint64_t v = get_varint(what);
    if (v > max) fail(what, "value " + std::to_string(v) + " exceeds limit " + std::to_string(max));
    return v;
  }
  // A count of elements that each take at least `min_element_bytes` bytes to
  // encode: checked against the remaining input before anyone allocates.
  uint64_t get_count(size_t min_element_bytes, const char* what) {
    uint64_t n = get_varint(what);
    if (min_element_bytes == 0) min_element_bytes = 1;
    if (n > remaining() / min_element_bytes) {
      fail(what, "count " + std::to_string(n) + " exceeds what the remaining " +
                     std::to_string(remaining()) + " bytes can hold");
    }
    return n;
  }
  std::string get_string(size_t max_length, const char* what) {
    return std::string(get_string_view(max_length, what));
  }
  // get_string without a copy: a view into the input.
  std::string_view get_string_view(size_t max_length, const char* what) {
    uint64_t n = get_varint(what);
    if (n > max_length) {
      fail(what, "length " + std::to_string(n) + " exceeds limit " + std::to_string(max_length));
    }
    require(n, what);
    std::string_view s(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(n));
    pos_ += n;
    return s;
  }

  [[noreturn]] void fail(const char* what, const std::string& why) const {
    throw WireError("bad " + std::string(what) + " at byte " + std::to_string(pos_) + ": " + why);
  }

 private:
  void require(uint64_t n, const char* what) const {
    if (n > remaining()) {
      fail(what, "truncated: needs " + std::to_string(n) + " bytes, " +
                     std::to_string(remaining()) + " remain");
    }
  }
  uint64_t get_fixed(size_t n, const char* what) {
    require(n, what);
    const uint64_t v = load_le(data_ + pos_, n);
    pos_ += n;
    return v;
  }

  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// Dims (shapes, box offsets and sizes): one zigzag varint each; the count is
// written by the caller.
inline void put_dims(ByteWriter& w, const std::vector<int64_t>& dims) {
  for (int64_t v : dims) w.put_zigzag(v);
}
inline std::vector<int64_t> get_dims(ByteReader& r, size_t n, const char* what) {
  std::vector<int64_t> dims(n);  // n <= kMaxNdim
  for (auto& v : dims) v = r.get_zigzag(what);
  return dims;
}

// An item's header, the same bytes in the metadata (FORMAT.md) and in a
// local-plan blob: name, kind (u8), dtype (u8), ndim (varint), global shape.
inline void put_item_header(ByteWriter& w, const std::string& name, ItemKind kind, DType dtype,
                            const std::vector<int64_t>& global_shape) {
  w.put_string(name);
  w.put_u8(static_cast<uint8_t>(kind));
  w.put_u8(static_cast<uint8_t>(dtype));
  w.put_varint(global_shape.size());
  put_dims(w, global_shape);
}
// Reads an item header, checking the kind and dtype codes and the rank;
// returns the name, a view into the reader's input. `global_shape` is
// resized (its storage reused).
inline std::string_view get_item_header(ByteReader& r, ItemKind* kind, DType* dtype,
                                        std::vector<int64_t>* global_shape) {
  const std::string_view name = r.get_string_view(kMaxNameLength, "item name");
  const uint8_t kind_code = r.get_u8("item kind");
  if (!is_known_item_kind(kind_code)) r.fail("item kind", "unknown code " + std::to_string(kind_code));
  *kind = static_cast<ItemKind>(kind_code);
  const uint8_t dtype_code = r.get_u8("dtype");
  if (!is_known_dtype(dtype_code)) r.fail("dtype", "unknown code " + std::to_string(dtype_code));
  *dtype = static_cast<DType>(dtype_code);
  global_shape->resize(r.get_varint_max(kMaxNdim, "rank"));
  for (int64_t& v : *global_shape) v = r.get_zigzag("global shape");
  return name;
}

}  // namespace checkpoint::wire
