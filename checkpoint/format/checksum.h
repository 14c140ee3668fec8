#pragma once
// XXH3-64 checksums. Chunk checksums cover a chunk's logical bytes (before
// transforms); the metadata trailer covers the encoded metadata.
#include <cstddef>
#include <cstdint>
#include <memory>

namespace checkpoint {

// One-shot XXH3-64 (seed 0) of `size` bytes at `data`.
uint64_t xxh3_64(const void* data, size_t size);

// Incremental XXH3-64 (seed 0): update() any number of times, then digest().
// The digest equals xxh3_64 of the concatenated input. digest() does not end
// the stream; more update() calls may follow. Movable, not copyable (a
// moved-from stream may only be destroyed or assigned to); not thread-safe.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(Xxh3Stream&&) noexcept;
  Xxh3Stream& operator=(Xxh3Stream&&) noexcept;
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;

  void update(const void* data, size_t size);
  uint64_t digest() const;
  // Back to the empty-input state.
  void reset();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace checkpoint
