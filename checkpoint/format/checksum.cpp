#include "checkpoint/format/checksum.h"

#include <stdexcept>

#include <xxhash.h>
// Debian's amd64 libxxhash also exports XXH3's runtime dispatch: the same
// hash computed with the widest vectors the CPU has (AVX2, AVX-512) where
// the plain entry points use the SSE2 the library was built for. Over 1 GiB
// on this machine (bench/xxh3_dispatch_check.py, docs/benchmarks.md): the
// same speed from memory, 3x faster over an 8 MiB block in cache. A save
// hashes its bytes twice, the second time mostly from cache. CMake defines
// SHARDKIT_XXH3_DISPATCH where the library has it (CMakeLists.txt).
#if SHARDKIT_XXH3_DISPATCH
#define XXH_DISPATCH_DISABLE_REPLACE 1
#include <immintrin.h>
#include <xxh_x86dispatch.h>
#endif

namespace checkpoint {
namespace {

#if SHARDKIT_XXH3_DISPATCH
// Debian's build of the dispatched code returns with the vector registers'
// upper halves dirty (no vzeroupper): legacy-SSE code the thread ran next
// (all code built without -mavx, the plain XXH3 among it) then ran about 4x
// slower on this machine's EPYC, until something cleared them. So clear
// them after each call (vzeroupper, where the CPU has AVX at all).
__attribute__((target("avx"))) void xxh3_clear_upper_halves() { _mm256_zeroupper(); }

void xxh3_after_vector_code() {
  static const bool has_avx = (__builtin_cpu_init(), __builtin_cpu_supports("avx"));
  if (has_avx) xxh3_clear_upper_halves();
}

uint64_t xxh3_once(const void* data, size_t size) {
  const uint64_t h = XXH3_64bits_dispatch(data, size);
  xxh3_after_vector_code();
  return h;
}

void xxh3_update(XXH3_state_t* state, const void* data, size_t size) {
  XXH3_64bits_update_dispatch(state, data, size);
  xxh3_after_vector_code();
}
#else
uint64_t xxh3_once(const void* data, size_t size) { return XXH3_64bits(data, size); }
void xxh3_update(XXH3_state_t* state, const void* data, size_t size) { XXH3_64bits_update(state, data, size); }
#endif

}  // namespace

uint64_t xxh3_64(const void* data, size_t size) { return xxh3_once(data, size); }

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
  xxh3_update(state_->xxh, data, size);
}

uint64_t Xxh3Stream::digest() const { return XXH3_64bits_digest(state_->xxh); }

void Xxh3Stream::reset() { XXH3_64bits_reset(state_->xxh); }

}  // namespace checkpoint
