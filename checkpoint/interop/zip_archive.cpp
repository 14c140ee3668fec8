#include "checkpoint/interop/zip_archive.h"

#include <algorithm>
#include <array>
#include <stdexcept>

#include "checkpoint/format/byte_order.h"
#include "checkpoint/format/metadata.h"

namespace checkpoint {

namespace {

constexpr uint32_t kLocalHeaderSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint32_t kZip64EndSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr uint16_t kZip64ExtraId = 0x0001;
constexpr uint16_t kPaddingExtraId = 0x4246;  // "FB", as PyTorch's writer pads
constexpr uint16_t kFlagUtf8Names = 0x0800;
constexpr uint32_t kMax32 = 0xFFFFFFFFu;
constexpr size_t kLocalHeaderSize = 30;
constexpr size_t kCentralHeaderSize = 46;
constexpr size_t kEndSize = 22;
constexpr size_t kZip64EndSize = 56;
constexpr size_t kZip64LocatorSize = 20;
constexpr uint64_t kMaxCentralDirectoryBytes = uint64_t{64} << 20;

std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}

void put16(std::vector<uint8_t>& out, uint16_t v) { append_le(out, v, 2); }
void put32(std::vector<uint8_t>& out, uint32_t v) { append_le(out, v, 4); }
void put64(std::vector<uint8_t>& out, uint64_t v) { append_le(out, v, 8); }

uint32_t clamp32(uint64_t v) { return v >= kMax32 ? kMax32 : static_cast<uint32_t>(v); }

FormatError zip_error(const std::string& path, const std::string& what) {
  return FormatError("malformed zip archive " + path + ": " + what);
}

// Fills sizes and offset from a central entry's zip64 extra field, in the
// order the zip specification gives, for the fields saturated at 0xFFFFFFFF.
void apply_zip64_extra(const uint8_t* extra, size_t n, ZipMember& m, const std::string& path) {
  size_t pos = 0;
  while (pos + 4 <= n) {
    const uint16_t id = static_cast<uint16_t>(load_le(extra + pos, 2));
    const uint16_t len = static_cast<uint16_t>(load_le(extra + pos + 2, 2));
    pos += 4;
    if (pos + len > n) throw zip_error(path, "extra field overruns entry '" + m.name + "'");
    if (id == kZip64ExtraId) {
      size_t field = pos;
      auto take = [&](uint64_t& dst) {
        if (dst != kMax32) return;
        if (field + 8 > pos + len) throw zip_error(path, "short zip64 field for '" + m.name + "'");
        dst = load_le(extra + field, 8);
        field += 8;
      };
      take(m.size);
      take(m.compressed_size);
      take(m.local_header_offset);
    }
    pos += len;
  }
}

}  // namespace

uint32_t crc32_update(uint32_t crc, const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = make_crc_table();
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

// ---------------------------------------------------------------- writer

void ZipWriter::append(const void* data, size_t n) {
  file_.append(data, n);
  pos_ += n;
}

void ZipWriter::begin_member(const std::string& name, uint64_t size) {
  if (open_ || finished_) throw std::logic_error("ZipWriter: member already open or finished");
  if (name.size() > 0xFFFF) throw std::invalid_argument("zip member name too long: " + name);
  const bool zip64 = size >= kMax32;
  std::vector<uint8_t> h;
  put32(h, kLocalHeaderSig);
  put16(h, zip64 ? 45 : 20);
  put16(h, kFlagUtf8Names);
  put16(h, 0);  // stored
  put16(h, 0);  // time
  put16(h, 0);  // date
  put32(h, 0);  // crc, patched by end_member
  put32(h, clamp32(size));
  put32(h, clamp32(size));
  put16(h, static_cast<uint16_t>(name.size()));
  const size_t extra_len_at = h.size();
  put16(h, 0);
  h.insert(h.end(), name.begin(), name.end());
  if (zip64) {
    put16(h, kZip64ExtraId);
    put16(h, 16);
    put64(h, size);
    put64(h, size);
  }
  // Pad with an extra field so that the data starts on an aligned offset.
  const uint64_t unpadded = pos_ + h.size() + 4;
  const uint16_t pad = static_cast<uint16_t>((kZipDataAlignment - unpadded % kZipDataAlignment) %
                                             kZipDataAlignment);
  put16(h, kPaddingExtraId);
  put16(h, pad);
  h.insert(h.end(), pad, 'Z');
  const size_t extra_len = h.size() - kLocalHeaderSize - name.size();
  h[extra_len_at] = static_cast<uint8_t>(extra_len);
  h[extra_len_at + 1] = static_cast<uint8_t>(extra_len >> 8);

  entries_.push_back(Entry{name, size, 0, pos_});
  append(h.data(), h.size());
  open_ = true;
  written_ = 0;
}

void ZipWriter::write(const void* data, size_t n) {
  if (!open_) throw std::logic_error("ZipWriter: no member open");
  Entry& e = entries_.back();
  if (written_ + n > e.size) {
    throw std::logic_error("ZipWriter: member '" + e.name + "' exceeds its announced size");
  }
  e.crc = crc32_update(e.crc, data, n);
  append(data, n);
  written_ += n;
}

void ZipWriter::end_member() {
  if (!open_) throw std::logic_error("ZipWriter: no member open");
  const Entry& e = entries_.back();
  if (written_ != e.size) {
    throw std::logic_error("ZipWriter: member '" + e.name + "' got " + std::to_string(written_) +
                           " of " + std::to_string(e.size) + " bytes");
  }
  std::vector<uint8_t> crc;
  put32(crc, e.crc);
  file_.write_at(e.header_offset + 14, crc.data(), crc.size());
  open_ = false;
}

void ZipWriter::finish() {
  if (open_ || finished_) throw std::logic_error("ZipWriter: member open or already finished");
  const uint64_t cd_offset = pos_;
  std::vector<uint8_t> cd;
  for (const Entry& e : entries_) {
    std::vector<uint8_t> extra;
    if (e.size >= kMax32) {
      put64(extra, e.size);
      put64(extra, e.size);
    }
    if (e.header_offset >= kMax32) put64(extra, e.header_offset);
    if (!extra.empty()) {
      std::vector<uint8_t> field;
      put16(field, kZip64ExtraId);
      put16(field, static_cast<uint16_t>(extra.size()));
      extra.insert(extra.begin(), field.begin(), field.end());
    }
    const uint16_t version = extra.empty() ? 20 : 45;
    put32(cd, kCentralSig);
    put16(cd, version);  // made by
    put16(cd, version);  // needed
    put16(cd, kFlagUtf8Names);
    put16(cd, 0);  // stored
    put16(cd, 0);
    put16(cd, 0);
    put32(cd, e.crc);
    put32(cd, clamp32(e.size));
    put32(cd, clamp32(e.size));
    put16(cd, static_cast<uint16_t>(e.name.size()));
    put16(cd, static_cast<uint16_t>(extra.size()));
    put16(cd, 0);  // comment
    put16(cd, 0);  // disk
    put16(cd, 0);  // internal attributes
    put32(cd, 0);  // external attributes
    put32(cd, clamp32(e.header_offset));
    cd.insert(cd.end(), e.name.begin(), e.name.end());
    cd.insert(cd.end(), extra.begin(), extra.end());
  }
  const uint64_t cd_size = cd.size();
  const uint64_t count = entries_.size();
  const bool zip64 = count >= 0xFFFF || cd_offset >= kMax32 || cd_size >= kMax32;
  if (zip64) {
    const uint64_t record_offset = cd_offset + cd_size;
    put32(cd, kZip64EndSig);
    put64(cd, kZip64EndSize - 12);
    put16(cd, 45);
    put16(cd, 45);
    put32(cd, 0);
    put32(cd, 0);
    put64(cd, count);
    put64(cd, count);
    put64(cd, cd_size);
    put64(cd, cd_offset);
    put32(cd, kZip64LocatorSig);
    put32(cd, 0);
    put64(cd, record_offset);
    put32(cd, 1);
  }
  put32(cd, kEndSig);
  put16(cd, 0);
  put16(cd, 0);
  put16(cd, static_cast<uint16_t>(std::min<uint64_t>(count, 0xFFFF)));
  put16(cd, static_cast<uint16_t>(std::min<uint64_t>(count, 0xFFFF)));
  put32(cd, clamp32(cd_size));
  put32(cd, clamp32(cd_offset));
  put16(cd, 0);
  append(cd.data(), cd.size());
  finished_ = true;
}

// ---------------------------------------------------------------- reader

std::vector<ZipMember> read_zip_directory(Storage& storage, const std::string& path) {
  const uint64_t file_size = storage.file_size(path);
  if (file_size < kEndSize) throw zip_error(path, "too short for an end record");
  const uint64_t tail_size = std::min<uint64_t>(file_size, kEndSize + 0xFFFF);
  std::vector<uint8_t> tail(tail_size);
  storage.read_at(path, file_size - tail_size, tail.data(), tail.size());

  // The end record is the last signature whose comment reaches the end exactly.
  size_t end_pos = SIZE_MAX;
  for (size_t i = tail_size - kEndSize + 1; i-- > 0;) {
    if (load_le(&tail[i], 4) == kEndSig && i + kEndSize + load_le(&tail[i + 20], 2) == tail_size) {
      end_pos = i;
      break;
    }
  }
  if (end_pos == SIZE_MAX) throw zip_error(path, "no end of central directory record");
  const uint64_t end_offset = file_size - tail_size + end_pos;
  const uint8_t* e = &tail[end_pos];
  uint64_t count = load_le(e + 10, 2);
  uint64_t cd_size = load_le(e + 12, 4);
  uint64_t cd_offset = load_le(e + 16, 4);
  if (load_le(e + 4, 2) != 0 && load_le(e + 4, 2) != 0xFFFF) throw zip_error(path, "multi-disk archive");

  if (count == 0xFFFF || cd_size == kMax32 || cd_offset == kMax32) {
    if (end_offset < kZip64LocatorSize) throw zip_error(path, "missing zip64 locator");
    uint8_t loc[kZip64LocatorSize];
    storage.read_at(path, end_offset - kZip64LocatorSize, loc, sizeof loc);
    if (load_le(loc, 4) != kZip64LocatorSig) throw zip_error(path, "missing zip64 locator");
    const uint64_t record = load_le(loc + 8, 8);
    if (record > end_offset - kZip64LocatorSize ||
        end_offset - kZip64LocatorSize - record < kZip64EndSize) {
      throw zip_error(path, "zip64 end record out of range");
    }
    uint8_t r[kZip64EndSize];
    storage.read_at(path, record, r, sizeof r);
    if (load_le(r, 4) != kZip64EndSig) throw zip_error(path, "bad zip64 end record signature");
    count = load_le(r + 32, 8);
    cd_size = load_le(r + 40, 8);
    cd_offset = load_le(r + 48, 8);
  }
  if (cd_offset > end_offset || cd_size > end_offset - cd_offset) {
    throw zip_error(path, "central directory out of range");
  }
  if (cd_size > kMaxCentralDirectoryBytes) throw zip_error(path, "central directory too large");
  if (count > cd_size / kCentralHeaderSize) throw zip_error(path, "entry count exceeds directory");

  std::vector<uint8_t> cd(cd_size);
  storage.read_at(path, cd_offset, cd.data(), cd.size());
  std::vector<ZipMember> members;
  members.reserve(count);
  size_t pos = 0;
  for (uint64_t i = 0; i < count; ++i) {
    if (cd.size() - pos < kCentralHeaderSize || load_le(&cd[pos], 4) != kCentralSig) {
      throw zip_error(path, "bad central directory entry " + std::to_string(i));
    }
    const uint8_t* h = &cd[pos];
    const size_t name_len = load_le(h + 28, 2);
    const size_t extra_len = load_le(h + 30, 2);
    const size_t comment_len = load_le(h + 32, 2);
    if (cd.size() - pos - kCentralHeaderSize < name_len + extra_len + comment_len) {
      throw zip_error(path, "central directory entry " + std::to_string(i) + " overruns it");
    }
    ZipMember m;
    m.method = static_cast<uint16_t>(load_le(h + 10, 2));
    m.crc32 = static_cast<uint32_t>(load_le(h + 16, 4));
    m.compressed_size = load_le(h + 20, 4);
    m.size = load_le(h + 24, 4);
    m.local_header_offset = load_le(h + 42, 4);
    m.name.assign(reinterpret_cast<const char*>(h + kCentralHeaderSize), name_len);
    apply_zip64_extra(h + kCentralHeaderSize + name_len, extra_len, m, path);
    if (m.local_header_offset > cd_offset || m.compressed_size > cd_offset) {
      throw zip_error(path, "member '" + m.name + "' lies outside the archive");
    }
    members.push_back(std::move(m));
    pos += kCentralHeaderSize + name_len + extra_len + comment_len;
  }
  return members;
}

uint64_t zip_member_data_offset(Storage& storage, const std::string& path, const ZipMember& member) {
  if (member.method != 0) {
    throw FormatError("zip member '" + member.name + "' of " + path + " is compressed (method " +
                      std::to_string(member.method) + "); only stored members can be read");
  }
  if (member.compressed_size != member.size) {
    throw zip_error(path, "stored member '" + member.name + "' has differing sizes");
  }
  uint8_t h[kLocalHeaderSize];
  storage.read_at(path, member.local_header_offset, h, sizeof h);
  if (load_le(h, 4) != kLocalHeaderSig) {
    throw zip_error(path, "bad local header for member '" + member.name + "'");
  }
  const uint64_t data = member.local_header_offset + kLocalHeaderSize + load_le(h + 26, 2) +
                        load_le(h + 28, 2);
  const uint64_t file_size = storage.file_size(path);
  if (data > file_size || member.size > file_size - data) {
    throw zip_error(path, "data of member '" + member.name + "' runs past the end of the file");
  }
  return data;
}

}  // namespace checkpoint
