// libFuzzer target: torch.save's data.pkl (the tensor dialect of the
// restricted pickle VM), through both parsers the product runs on it:
// parse_tensor_dict_pickle (WeightsFile on a torch.save file) and
// parse_tensor_pickle (each DCP item's archive). Each must throw FormatError
// or succeed, never crash or allocate more than the input justifies; what
// they accept must be in bounds of its storage.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "checkpoint/errors.h"
#include "checkpoint/interop/pickle.h"

namespace {

void check(const checkpoint::PickledTensor& t) {
  if (t.storage_offset < 0 || t.stride.size() != t.shape.size()) {
    std::fprintf(stderr, "accepted tensor '%s' with a bad offset or stride\n", t.name.c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    for (const checkpoint::PickledTensor& t : checkpoint::parse_tensor_dict_pickle(data, size, "fuzz:data.pkl")) {
      check(t);
    }
  } catch (const checkpoint::FormatError&) {
  }
  try {
    check(checkpoint::parse_tensor_pickle(data, size, "fuzz:item/data.pkl", "fuzz.w"));
  } catch (const checkpoint::FormatError&) {
  }
  return 0;
}
