#include "checkpoint/format/checksum.h"

#include <stdexcept>

#include <xxhash.h>

namespace checkpoint {

uint64_t xxh3_64(const void* data, size_t size) {
  return XXH3_64bits(data, size);
}

struct Xxh3Stream::State {
  XXH3_state_t* xxh = nullptr;
  ~State() { XXH3_freeState(xxh); }
};

Xxh3Stream::Xxh3Stream() : state_(std::make_unique<State>()) {
  state_->xxh = XXH3_createState();
  if (state_->xxh == nullptr) throw std::bad_alloc();
  reset();
}

Xxh3Stream::~Xxh3Stream() = default;
Xxh3Stream::Xxh3Stream(Xxh3Stream&&) noexcept = default;
Xxh3Stream& Xxh3Stream::operator=(Xxh3Stream&&) noexcept = default;

void Xxh3Stream::update(const void* data, size_t size) {
  XXH3_64bits_update(state_->xxh, data, size);
}

uint64_t Xxh3Stream::digest() const { return XXH3_64bits_digest(state_->xxh); }

void Xxh3Stream::reset() { XXH3_64bits_reset(state_->xxh); }

}  // namespace checkpoint
