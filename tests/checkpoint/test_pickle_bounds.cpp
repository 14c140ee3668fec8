// The restricted pickle VM's bounds against hostile data.pkl files
// (fuzz/fuzz_torch_pickle; torch-free, unlike test_interop.cpp).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "checkpoint/errors.h"
#include "checkpoint/interop/pickle.h"

namespace checkpoint {
namespace {

// torch.save(tensor) with a size tuple of `dims` ints, memoized and passed
// to `tensors` tensors in a dict: before the bound, each tensor copied the
// whole tuple (K * N int64 from a pickle of about N + 16 K bytes).
std::vector<uint8_t> shared_size_tuple_pickle(size_t dims, size_t tensors) {
  PickleWriter w;
  w.op('}');
  w.op('(');
  for (size_t k = 0; k < tensors; ++k) {
    w.str("w" + std::to_string(k));
    w.global("torch._utils", "_rebuild_tensor_v2");
    w.op('(');
    w.op('(');
    w.str("storage");
    w.global("torch", "FloatStorage");
    w.str(std::to_string(k));
    w.str("cpu");
    w.integer(1);
    w.op('t');
    w.op('Q');
    w.integer(0);
    if (k == 0) {
      w.op('(');
      for (size_t d = 0; d < dims; ++d) w.integer(1);
      w.op('t');
      w.op('q');  // BINPUT 0
      w.op(0);
    } else {
      w.op('h');  // BINGET 0
      w.op(0);
    }
    w.int_tuple(std::vector<int64_t>(dims <= 16 ? dims : 1, 1));  // contiguous strides of all-1 sizes
    w.boolean(false);
    w.global("collections", "OrderedDict");
    w.op(')');
    w.op('R');
    w.op('t');
    w.op('R');
  }
  w.op('u');
  return w.finish();
}

TEST(PickleBounds, ASizeTupleLongerThanMaxNdimIsRefusedWhereTheTensorIsBuilt) {
  const std::vector<uint8_t> pkl = shared_size_tuple_pickle(1 << 16, 64);
  try {
    parse_tensor_dict_pickle(pkl.data(), pkl.size(), "hostile/data.pkl");
    ADD_FAILURE() << "a 65536-dim size tuple was accepted";
  } catch (const FormatError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("hostile/data.pkl: tensor size has 65536 dims, more than 16 (pickle offset "),
              std::string::npos) << what;
  }
  // At the bound it reads (and the tensors lie within their storages).
  const std::vector<uint8_t> ok = shared_size_tuple_pickle(16, 3);
  const std::vector<PickledTensor> read = parse_tensor_dict_pickle(ok.data(), ok.size(), "ok/data.pkl");
  ASSERT_EQ(read.size(), 3u);
  EXPECT_EQ(read[2].name, "w2");
  EXPECT_EQ(read[2].shape, std::vector<int64_t>(16, 1));
}

}  // namespace
}  // namespace checkpoint
