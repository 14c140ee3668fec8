#pragma once
// Uncompressed ("stored") zip archives, the container of PyTorch's torch.save
// format: a writer that streams members of known size with their data aligned
// to 64 bytes (as PyTorch's own writer does, so readers may mmap them), and a
// reader of the central directory that treats every byte as hostile.
// Zip64 records are written only when a size or offset needs them, and read
// when present. Torch-free.
//
// Why not LibTorch's caffe2::serialize::PyTorchStreamWriter / Reader
// (caffe2/serialize/inline_container.h), which write and read this same
// container: PyTorchStreamWriter::writeRecord takes each member as one
// buffer in memory, and PyTorchStreamReader::getRecord returns one (1.13 has
// no chunked read; 2.x's chunked getRecord still needs the member's size in
// a buffer of the caller's). `ckpt export` streams each tensor from the
// checkpoint's chunks in bounded slabs, converting dtypes on the way, so an
// export of a tensor larger than memory works; ZipWriter takes a member in
// any number of write() calls. And this file is in checkpoint_core, which
// the fuzz build and the metadata tools link without LibTorch.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/storage/storage.h"

namespace checkpoint {

// Alignment of every member's data in archives ZipWriter writes.
constexpr uint64_t kZipDataAlignment = 64;

// CRC-32 (ISO-HDLC, the zip checksum), continued from `crc` (start with 0).
uint32_t crc32_update(uint32_t crc, const void* data, size_t n);

// Writes a zip archive into `file` from its current start (offset 0),
// appending. Call sequence: (begin_member, write*, end_member)*, finish.
// Members are stored, never compressed. Not thread-safe.
class ZipWriter {
 public:
  // `file` must outlive the writer; nothing may be appended to it meanwhile.
  explicit ZipWriter(WritableFile& file) : file_(file) {}

  // Starts a member of exactly `size` bytes. REQUIRES: no member open;
  // name at most 65535 bytes.
  void begin_member(const std::string& name, uint64_t size);
  // Appends member data. REQUIRES: the total stays within the announced size
  // (else std::logic_error).
  void write(const void* data, size_t n);
  // Closes the member: checks that all its bytes were written and patches
  // its CRC-32 into the local header.
  void end_member();
  // Writes the central directory and end records. No members after it.
  void finish();

 private:
  struct Entry {
    std::string name;
    uint64_t size = 0;
    uint32_t crc = 0;
    uint64_t header_offset = 0;
  };
  void append(const void* data, size_t n);

  WritableFile& file_;
  uint64_t pos_ = 0;
  std::vector<Entry> entries_;
  bool open_ = false;
  uint64_t written_ = 0;  // of the open member
  bool finished_ = false;
};

// One member as the central directory describes it.
struct ZipMember {
  std::string name;
  uint16_t method = 0;            // 0: stored
  uint64_t compressed_size = 0;
  uint64_t size = 0;
  uint32_t crc32 = 0;
  uint64_t local_header_offset = 0;
};

// Reads the central directory of the zip archive `path`. Bounded: at most
// 64 MiB of directory; every offset and size is checked against the file.
// Throws FormatError naming `path` for anything malformed, IoError for I/O.
std::vector<ZipMember> read_zip_directory(Storage& storage, const std::string& path);

// The absolute file offset of `member`'s data, from its local header.
// Throws FormatError naming the member when it is compressed or its data does
// not lie within the file.
uint64_t zip_member_data_offset(Storage& storage, const std::string& path, const ZipMember& member);

}  // namespace checkpoint
