#include "framework/train/tensorboard.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <stdexcept>

namespace framework::train {

namespace {

// The reflected Castagnoli polynomial's table, built once.
std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
  return table;
}

// Protobuf wire format: the few encodings tensorflow.Event needs.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void little_endian(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void key(std::string& out, int field, int wire_type) {
  varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type));
}

void bytes_field(std::string& out, int field, const std::string& bytes) {
  key(out, field, 2);
  varint(out, bytes.size());
  out += bytes;
}

// An Event with wall_time (now) and step; `rest` its other fields, encoded.
std::string event(int64_t step, const std::string& rest) {
  std::string out;
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  uint64_t bits = 0;
  std::memcpy(&bits, &now, sizeof bits);
  key(out, 1, 1);  // wall_time, fixed64
  little_endian(out, bits, 8);
  key(out, 2, 0);  // step, varint (two's complement for int64)
  varint(out, static_cast<uint64_t>(step));
  return out + rest;
}

std::string summary_value(const std::string& tag, double value) {
  std::string v;
  bytes_field(v, 1, tag);
  const float f = static_cast<float>(value);
  uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof bits);
  key(v, 2, 5);  // simple_value, fixed32
  little_endian(v, bits, 4);
  return v;
}

// Seconds since the epoch, past every earlier file's in `dir`: TensorBoard
// reads a directory's files in name order, so a resumed run's file (and its
// purge) must sort after the files it follows even within one second.
int64_t file_time(const std::string& dir) {
  int64_t t = std::chrono::duration_cast<std::chrono::seconds>(
                  std::chrono::system_clock::now().time_since_epoch())
                  .count();
  const std::string prefix = "events.out.tfevents.";
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    try {
      t = std::max<int64_t>(t, static_cast<int64_t>(std::stoll(name.substr(prefix.size()))) + 1);
    } catch (const std::exception&) {
      // not one of ours: its order is its own
    }
  }
  return t;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = crc32c_table();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

std::string tf_record(const std::string& data) {
  std::string out;
  std::string length;
  little_endian(length, data.size(), 8);
  out += length;
  little_endian(out, masked_crc32c(length.data(), length.size()), 4);
  out += data;
  little_endian(out, masked_crc32c(data.data(), data.size()), 4);
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t first_step) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  path_ = dir + "/events.out.tfevents." + std::to_string(file_time(dir)) + "." + host_name() + "." +
          std::to_string(::getpid()) + ".shardkit";
  file_ = std::fopen(path_.c_str(), "ab");
  if (file_ == nullptr) {
    throw std::runtime_error("metrics.tensorboard: cannot create " + path_ + ": " +
                             std::strerror(errno));
  }
  std::string version;
  bytes_field(version, 3, "brain.Event:2");
  write_event(event(first_step > 1 ? first_step : 0, version));
  if (first_step > 1) {
    std::string session_log;
    key(session_log, 1, 0);  // status
    varint(session_log, 1);  // START
    std::string rest;
    bytes_field(rest, 6, session_log);
    write_event(event(first_step, rest));
  }
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void TensorBoardWriter::scalars(int64_t step,
                                const std::vector<std::pair<std::string, double>>& values) {
  std::string summary;
  for (const auto& [tag, value] : values) bytes_field(summary, 1, summary_value(tag, value));
  std::string rest;
  bytes_field(rest, 5, summary);
  write_event(event(step, rest));
}

void TensorBoardWriter::write_event(const std::string& data) {
  if (file_ == nullptr) return;
  const std::string record = tf_record(data);
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size() || std::fflush(file_) != 0) {
    std::cerr << "shardkit: WARNING: metrics.tensorboard: writing " << path_
              << " failed: " << std::strerror(errno) << "; no more TensorBoard events this run"
              << std::endl;
    std::fclose(file_);
    file_ = nullptr;
  }
}

}  // namespace framework::train
