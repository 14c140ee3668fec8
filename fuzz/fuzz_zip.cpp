// libFuzzer target: the zip reader of torch.save archives. The input is the
// archive, in an in-memory Storage; read_zip_directory reads its central
// directory and zip_member_data_offset each member's local header, as
// WeightsFile and the DCP item reader do. Malformed archives must end in
// FormatError (or IoError), never a crash, an out-of-bounds read or a large
// allocation; every accepted member's data must lie within the file.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "checkpoint/errors.h"
#include "checkpoint/interop/zip_archive.h"
#include "checkpoint/storage/memory.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto storage = checkpoint::memory_storage();
  {
    auto file = storage->create_file("/a.pt");
    file->append(data, size);
    file->close();
  }
  std::vector<checkpoint::ZipMember> members;
  try {
    members = checkpoint::read_zip_directory(*storage, "/a.pt");
  } catch (const checkpoint::FormatError&) {
    return 0;
  } catch (const checkpoint::IoError&) {
    return 0;
  }
  for (const checkpoint::ZipMember& m : members) {
    try {
      const uint64_t at = checkpoint::zip_member_data_offset(*storage, "/a.pt", m);
      if (at > size || m.size > size - at) {
        std::fprintf(stderr, "member '%s' accepted outside the file\n", m.name.c_str());
        std::abort();
      }
    } catch (const checkpoint::FormatError&) {
    } catch (const checkpoint::IoError&) {
    }
  }
  return 0;
}
