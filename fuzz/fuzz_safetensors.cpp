// libFuzzer target: WeightsFile::open, the entry point of every weights
// import, on untrusted bytes. The first input byte chooses what the rest is:
//   even: a file /m/w.safetensors (its 8-byte length, JSON header and data
//         section; input starting "PK\3\4" is read as torch.save instead,
//         as the product does);
//   odd:  /m/model.safetensors.index.json of a Hugging Face directory that
//         also holds one small valid shard, model-00001-of-00001.safetensors
//         ("a" and "b", float32 [2]).
// Must throw FormatError (or IoError for a file the index names that is not
// there), never crash or allocate more than the input justifies.
#include <cstdint>
#include <cstring>
#include <string>

#include "checkpoint/errors.h"
#include "checkpoint/interop/weights_file.h"
#include "checkpoint/storage/memory.h"

namespace {

void put(checkpoint::Storage& storage, const std::string& path, const void* data, size_t size) {
  auto file = storage.create_file(path);
  file->append(data, size);
  file->close();
}

std::string shard() {
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  std::string out(8, '\0');
  for (int k = 0; k < 8; ++k) out[k] = static_cast<char>((header.size() >> (8 * k)) & 0xFF);
  return out + header + std::string(16, '\0');
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  auto storage = checkpoint::memory_storage();
  storage->make_dirs("/m");
  std::string path;
  if (data[0] % 2 == 0) {
    path = "/m/w.safetensors";
    put(*storage, path, data + 1, size - 1);
  } else {
    path = "/m";
    put(*storage, std::string("/m/") + checkpoint::kHfIndexName, data + 1, size - 1);
    static const std::string valid = shard();
    put(*storage, "/m/model-00001-of-00001.safetensors", valid.data(), valid.size());
  }
  try {
    const checkpoint::WeightsFile w = checkpoint::WeightsFile::open(path, storage);
    for (const checkpoint::WeightsTensorInfo& t : w.tensors()) {
      if (w.find(t.name) == nullptr && w.format() != "safetensors") std::abort();
    }
  } catch (const checkpoint::FormatError&) {
  } catch (const checkpoint::IoError&) {
  }
  return 0;
}
