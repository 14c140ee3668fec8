// libFuzzer target: PyTorch DCP's `.metadata` (a pickle, the DCP dialect of
// the restricted pickle VM), through parse_dcp_metadata, the parser
// read_dcp_metadata runs on the file's bytes. It must throw FormatError or
// succeed, never crash, read out of bounds or allocate more than the input
// justifies; and whatever it accepts, write_dcp_metadata must write a pickle
// that it reads back to the same items.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "checkpoint/errors.h"
#include "checkpoint/interop/dcp.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  checkpoint::DcpMetadata meta;
  try {
    meta = checkpoint::parse_dcp_metadata(data, size, "fuzz/.metadata");
  } catch (const checkpoint::FormatError&) {
    return 0;
  }
  const std::vector<uint8_t> again = checkpoint::write_dcp_metadata(meta);
  const checkpoint::DcpMetadata round = checkpoint::parse_dcp_metadata(again.data(), again.size(), "re-written");
  if (round.tensors.size() != meta.tensors.size() || round.bytes.size() != meta.bytes.size()) {
    std::fprintf(stderr, "parse(write(meta)) has other items than meta\n");
    std::abort();
  }
  for (size_t i = 0; i < meta.tensors.size(); ++i) {
    if (round.tensors[i].fqn != meta.tensors[i].fqn || round.tensors[i].shape != meta.tensors[i].shape ||
        round.tensors[i].dtype != meta.tensors[i].dtype ||
        round.tensors[i].chunks.size() != meta.tensors[i].chunks.size()) {
      std::fprintf(stderr, "parse(write(meta)) differs in tensor %zu\n", i);
      std::abort();
    }
  }
  return 0;
}
