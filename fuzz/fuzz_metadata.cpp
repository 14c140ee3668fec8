// libFuzzer target: decode_metadata on arbitrary bytes. It must throw
// FormatError or succeed, never crash, read out of bounds or allocate more
// than the input justifies; and whatever it accepts must re-encode and decode
// to the same value (the writer accepts everything the reader does).
#include <cstdint>
#include <cstdlib>
#include <cstdio>

#include "checkpoint/format/metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  checkpoint::CheckpointMeta meta;
  try {
    meta = checkpoint::decode_metadata(data, size, "fuzz.metadata");
  } catch (const checkpoint::FormatError&) {
    return 0;
  }
  // Re-encoded in the version read: version 2 may reorder a v1 file's chunks.
  const std::vector<uint8_t> again = checkpoint::encode_metadata(meta, meta.format_version);
  const checkpoint::CheckpointMeta round = checkpoint::decode_metadata(again.data(), again.size(), "re-encoded");
  if (!(round == meta)) {
    std::fprintf(stderr, "decode(encode(meta)) != meta\n");
    std::abort();
  }
  return 0;
}
